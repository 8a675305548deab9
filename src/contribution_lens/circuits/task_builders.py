"""The built-in tasks and a user's task file, built into tasks: `Task.ioi`, `Task.induction`, `Task.capitals` and
`Task.from_jsonl` are the public entry points; this module holds what they draw from and how.

Every task is built from its model's tokenizer and records its identity (``Task.tokenizer``,
`contribution_lens.adapter.tokenizer_identity`), so that one built for another model is refused by
every function that takes a model and a task. Prompts are texts tokenised as the model tokenises
them (its BOS convention), right-padded with its pad id; an answer (and a foil) is the one token
the model reads after the clean text (a word after a space is written with the space, ``" Mary"``),
never a merge across the boundary; a prompt longer than the model's context is refused, naming it.

Example:
    >>> from contribution_lens.loading import load_skeleton
    >>> from contribution_lens.circuits.task import Task
    >>> task = capitals(Task, load_skeleton(), n=3, seed=0)
    >>> len(task), task.counterfactual, task.tokenizer.startswith("49152 tokens #")
    (3, 'other-country', True)
"""

import json
import os
import random
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from contribution_lens import adapter
from contribution_lens.circuits.checks import check_count, check_seed, check_task_model

if TYPE_CHECKING:
    from contribution_lens.circuits.task import Task

Model = Any  # a TransformerBridge
Make = Callable[..., "Task"]
"""The task class the builders return an instance of (`Task`, passed in by its classmethods)."""


@dataclass(frozen=True)
class Counterfactual:
    """A task's named counterfactual: what its corrupted prompts ask (``asks``), and where it comes from."""

    name: str
    asks: str
    source: str


IOI_COUNTERFACTUALS: dict[str, Counterfactual] = {
    c.name: c
    for c in (
        Counterfactual(
            "s2-io-flip",
            'the subject\'s second mention replaced by the indirect object ("..., Mary gave a drink to"): the '
            "counterfactual's answer is the clean foil, so the patched information is which name is repeated",
            "MIB's IOI data set, its default s2_io_flip_counterfactual (MIB_circuit_track/dataset.py)",
        ),
        Counterfactual(
            "abc",
            "the three name slots filled with three other names: nothing says which of the clean names to give",
            "Wang et al. (2023)'s ABC distribution (MIB's data set holds it too, abc_counterfactual)",
        ),
    )
}
"""`Task.ioi`'s counterfactuals, by name; the first is the default."""
INDUCTION_COUNTERFACTUALS: dict[str, Counterfactual] = {
    "first-copy-resampled": Counterfactual(
        "first-copy-resampled",
        "the first copy replaced by other random tokens: nothing earlier says what comes next",
        "the usual induction corruption (repeated random tokens, the first copy resampled)",
    )
}
"""`Task.induction`'s counterfactual."""
CAPITALS_COUNTERFACTUALS: dict[str, Counterfactual] = {
    "other-country": Counterfactual(
        "other-country",
        "another country whose prompt has the same token count: the counterfactual asks for the foil, its capital",
        "this package's capitals task",
    )
}
"""`Task.capitals`'s counterfactual."""
CUSTOM = "custom"
"""The counterfactual of a task built from its ids or read from a file: whatever its corrupted prompts say."""


def check_counterfactual(name: Any, known: dict[str, Counterfactual], task: str) -> str:
    """``name`` if it is one of ``known`` (a task's counterfactuals), else a ValueError listing them."""
    if not isinstance(name, str) or name not in known:
        raise ValueError(f"counterfactual: {task} offers {', '.join(known)}; got {name!r}")
    return name


def ioi(make: Make, model: Model, *, n: int = 64, seed: int = 0, counterfactual: str = "s2-io-flip") -> "Task":
    """`Task.ioi`: Wang et al.'s templates, two one-token names, ABBA and BABA alternating."""
    check_counterfactual(counterfactual, IOI_COUNTERFACTUALS, "Task.ioi")
    check_task_model(model, tokenizer=True)
    n, seed = check_count(n, "n"), check_seed(seed)
    names = _one_token_words(model, IOI_NAMES)
    if len(names) < 5:
        raise ValueError(f"model: its tokenizer has only {len(names)} of the IOI names as one token; 5 are needed")
    rng = random.Random(seed)
    prompts = []
    for index in range(n):
        drawn = partial(_ioi_prompt, model, names, rng, abba=index % 2 == 0, counterfactual=counterfactual)
        prompts.append(_draw(drawn, "ioi"))
    return _assemble(make, model, "ioi", prompts, counterfactual=counterfactual)


def induction(
    make: Make,
    model: Model,
    *,
    n: int = 64,
    length: int = 10,
    seed: int = 0,
    counterfactual: str = "first-copy-resampled",
) -> "Task":
    """`Task.induction`: ``length`` ordinary tokens, then the same again, the first copy resampled."""
    check_counterfactual(counterfactual, INDUCTION_COUNTERFACTUALS, "Task.induction")
    check_task_model(model, tokenizer=False)
    n, seed = check_count(n, "n"), check_seed(seed)
    if isinstance(length, bool) or not isinstance(length, int) or length < 2:
        raise ValueError(f"length must be an integer of at least 2 (tokens repeated), got {length!r}")
    adapter.check_length(model, 2 * length + 1, f"length={length}: the prompt")
    rng = random.Random(seed)
    draw = _ordinary_tokens(model, rng)
    bos = _bos(model)
    prompts = []
    for _ in range(n):
        tokens = draw(3 * length + 1)
        first, resampled, foil = tokens[:length], tokens[length : 2 * length], tokens[-1]
        clean = [*bos, *first, *first[:-1]]
        corrupted = [*bos, *resampled, *first[:-1]]
        prompts.append((clean, corrupted, first[-1], foil))
    return _assemble(make, model, "induction", prompts, counterfactual=counterfactual)


def capitals(make: Make, model: Model, *, n: int = 64, seed: int = 0, counterfactual: str = "other-country") -> "Task":
    """`Task.capitals`: pairs of countries whose prompts tokenise to one length."""
    check_counterfactual(counterfactual, CAPITALS_COUNTERFACTUALS, "Task.capitals")
    return _paired(make, model, "capitals", CAPITALS, n=n, seed=seed, counterfactual=counterfactual)


def from_jsonl(make: Make, model: Model, path: str | os.PathLike, *, metric: str = "logit_diff") -> "Task":
    """`Task.from_jsonl`: every line of the file checked, a bad one refused naming the file, the line and the field."""
    check_task_model(model, tokenizer=True)
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"path: no such file: {file}")
    prompts = [_jsonl_prompt(model, line, f"{file}, line {number}") for number, line in task_lines(file)]
    if not prompts:
        raise ValueError(f"path: {file} holds no task line")
    return _assemble(make, model, file.stem, prompts, metric=metric)


UTF16 = {b"\xff\xfe": "UTF-16 (little-endian)", b"\xfe\xff": "UTF-16 (big-endian)"}
"""Byte-order marks of encodings a task file may have been saved in by mistake."""


def task_lines(file: Path) -> Iterator[tuple[int, str]]:
    """The non-blank lines of a UTF-8 task file, numbered (a UTF-8 byte-order mark and Windows line ends are read).

    A file in another encoding is refused naming the file and the first line that is not UTF-8.
    """
    data = file.read_bytes()
    for mark, encoding in UTF16.items():
        if data.startswith(mark):
            raise ValueError(f"{file}: {encoding} text (its byte-order mark); save the file as UTF-8")
    data = data.removeprefix(b"\xef\xbb\xbf")
    for number, raw in enumerate(data.split(b"\n"), start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(
                f"{file}, line {number}: not UTF-8 text (the byte 0x{raw[error.start]:02x} at column "
                f"{error.start + 1}); save the file as UTF-8"
            ) from None
        if line.strip():
            yield number, line


Prompt = tuple[list[int], list[int], int, int]
"""One prompt as token ids: clean, corrupted (same length), answer, foil."""


def _bos(model: Model) -> list[int]:
    bos = adapter.bos_to_prepend(model)
    return [] if bos is None else [bos]


def _encode(model: Model, text: str) -> list[int]:
    """``text``'s ids without special tokens (BOS is the caller's, by the model's convention)."""
    return list(model.tokenizer(text, add_special_tokens=False)["input_ids"])


def _one_token_words(model: Model, words: Sequence[str]) -> list[str]:
    """The words that are one token each, with the leading space they are written with."""
    return [word for word in words if len(_encode(model, word)) == 1]


def _draw(make: Callable[[], Prompt | None], name: str, attempts: int = 200) -> Prompt:
    """The first prompt ``make`` accepts (None: drawn again), refused after ``attempts`` tries."""
    for _ in range(attempts):
        prompt = make()
        if prompt is not None:
            return prompt
    raise ValueError(
        f"model: no {name} prompt with clean and corrupted of equal token counts in {attempts} draws "
        "(its tokenizer splits the words differently)"
    )


def _texts_prompt(model: Model, clean: str, corrupted: str, answer: str, foil: str) -> Prompt | None:
    """Token ids of one prompt, or None where the lengths differ or a word is not one token in context."""
    bos = _bos(model)
    clean_ids, corrupted_ids = [*bos, *_encode(model, clean)], [*bos, *_encode(model, corrupted)]
    answer_ids, foil_ids = _encode(model, answer), _encode(model, foil)
    if len(clean_ids) != len(corrupted_ids) or len(answer_ids) != 1 or len(foil_ids) != 1:
        return None
    # The answer must be the token the model reads after the clean text, not a merge across the boundary.
    if [*bos, *_encode(model, clean + answer)] != [*clean_ids, answer_ids[0]]:
        return None
    return clean_ids, corrupted_ids, answer_ids[0], foil_ids[0]


def _assemble(
    make: Make,
    model: Model,
    name: str,
    prompts: Sequence[Prompt],
    *,
    metric: str = "logit_diff",
    counterfactual: str = CUSTOM,
) -> "Task":
    """Right-pad the prompts with the model's pad id to one length, set ``last`` and record the tokenizer."""
    length = max(len(clean) for clean, *_ in prompts)
    adapter.check_length(model, length, f"the longest {name} prompt")
    clean = torch.full((len(prompts), length), adapter.pad_id(model), dtype=torch.long)
    corrupted = clean.clone()
    for row, (clean_ids, corrupted_ids, _, _) in enumerate(prompts):
        clean[row, : len(clean_ids)] = torch.tensor(clean_ids)
        corrupted[row, : len(corrupted_ids)] = torch.tensor(corrupted_ids)
    answer = torch.tensor([prompt[2] for prompt in prompts])
    foil = torch.tensor([prompt[3] for prompt in prompts])
    last = torch.tensor([len(prompt[0]) - 1 for prompt in prompts])
    adapter.check_token_ids(model, torch.cat([clean.flatten(), corrupted.flatten(), answer, foil]))
    tokenizer = adapter.tokenizer_identity(model)
    return make(name, clean, corrupted, answer, foil, last, metric, counterfactual, tokenizer=tokenizer)


# Wang et al. 2023's templates (their ioi_dataset.py, BABA form); {a} {b} are the first two names,
# {s} the subject's repetition, {io} never appears: the prompt stops where it would be said.
IOI_TEMPLATES: tuple[str, ...] = (
    "Then, {a} and {b} went to the {place}. {s} gave a {object} to",
    "Then, {a} and {b} had a lot of fun at the {place}. {s} gave a {object} to",
    "Then, {a} and {b} were working at the {place}. {s} decided to give a {object} to",
    "Then, {a} and {b} were thinking about going to the {place}. {s} wanted to give a {object} to",
    "Then, {a} and {b} had a long argument, and afterwards {s} said to",
    "After {a} and {b} went to the {place}, {s} gave a {object} to",
    "When {a} and {b} got a {object} at the {place}, {s} decided to give it to",
    "When {a} and {b} got a {object} at the {place}, {s} decided to give the {object} to",
    "While {a} and {b} were working at the {place}, {s} gave a {object} to",
    "While {a} and {b} were commuting to the {place}, {s} gave a {object} to",
    "After the lunch, {a} and {b} went to the {place}. {s} gave a {object} to",
    "Afterwards, {a} and {b} went to the {place}. {s} gave a {object} to",
    "Then, {a} and {b} had a long argument. Afterwards {s} said to",
    "The {place} {a} and {b} went to had a {object}. {s} gave it to",
    "Friends {a} and {b} found a {object} at the {place}. {s} gave it to",
)
IOI_PLACES = ("store", "garden", "restaurant", "school", "hospital", "office", "house", "station")
IOI_OBJECTS = ("ring", "kiss", "bone", "basketball", "computer", "necklace", "drink", "snack")
IOI_NAMES: tuple[str, ...] = tuple(
    " " + name
    for name in (
        "Mary John Tom James Dan Sid Martin Amy Lisa Michael Alice Kate Paul Anna David Mark Sarah Peter "
        "Emma Jack Laura Steve Chris Rachel George Jane Adam Eric Max Sam Ben Tim Joe Bob Jessica Henry "
        "Sophie Daniel Charles Susan Robert Helen Frank Julia Lucy Jacob Andrew Carl Emily Anne"
    ).split()
)


def _ioi_prompt(
    model: Model, names: Sequence[str], rng: random.Random, *, abba: bool, counterfactual: str
) -> Prompt | None:
    template = rng.choice(IOI_TEMPLATES)
    place, thing = rng.choice(IOI_PLACES), rng.choice(IOI_OBJECTS)
    io, s, c, d, e = (name.strip() for name in rng.sample(list(names), 5))  # five drawn whatever the counterfactual
    first, second = (io, s) if abba else (s, io)
    clean = template.format(a=first, b=second, s=s, place=place, object=thing)
    slots = IOI_SLOTS[counterfactual](first, second, io, (c, d, e))
    corrupted = template.format(**slots, place=place, object=thing)
    return _texts_prompt(model, clean, corrupted, " " + io, " " + s)


IOI_SLOTS: dict[str, Callable[[str, str, str, tuple[str, str, str]], dict[str, str]]] = {
    "s2-io-flip": lambda first, second, io, others: {"a": first, "b": second, "s": io},
    "abc": lambda first, second, io, others: dict(zip("abs", others, strict=True)),
}
"""The counterfactual's names in a template's slots ``a``, ``b`` and ``s`` (the second mention), from the clean
prompt's first and second names, its indirect object and three other names (`IOI_COUNTERFACTUALS`)."""


CAPITALS: tuple[tuple[str, str], ...] = tuple(
    (f"The capital of {country} is", f" {capital}")
    for country, capital in (
        ("France", "Paris"), ("Germany", "Berlin"), ("Japan", "Tokyo"), ("Italy", "Rome"),
        ("Spain", "Madrid"), ("Russia", "Moscow"), ("China", "Beijing"), ("Egypt", "Cairo"),
        ("Greece", "Athens"), ("England", "London"), ("Canada", "Ottawa"), ("Austria", "Vienna"),
        ("Poland", "Warsaw"), ("Ireland", "Dublin"), ("Portugal", "Lisbon"), ("Norway", "Oslo"),
        ("Sweden", "Stockholm"), ("Kenya", "Nairobi"), ("Peru", "Lima"), ("Cuba", "Havana"),
        ("Thailand", "Bangkok"), ("Turkey", "Ankara"), ("Iran", "Tehran"), ("India", "Delhi"),
        ("Denmark", "Copenhagen"), ("Finland", "Helsinki"), ("Hungary", "Budapest"), ("Belgium", "Brussels"),
    )
)  # fmt: skip
"""(prompt, answer) pairs of `Task.capitals`."""


def _paired(
    make: Make, model: Model, name: str, items: Sequence[tuple[str, str]], *, n: int, seed: int, counterfactual: str
) -> "Task":
    """Prompts of two items each: the first's text and answer (clean), the second's text and answer (foil)."""
    check_task_model(model, tokenizer=True)
    n, seed = check_count(n, "n"), check_seed(seed)
    rng = random.Random(seed)
    pairs = [
        prompt
        for (clean, answer) in items
        for (corrupted, foil) in items
        if answer != foil and (prompt := _texts_prompt(model, clean, corrupted, answer, foil)) is not None
    ]
    if not pairs:
        raise ValueError(f"model: no {name} pair has clean and corrupted of equal token counts in its tokenizer")
    rng.shuffle(pairs)
    return _assemble(
        make, model, name, [pairs[index % len(pairs)] for index in range(n)], counterfactual=counterfactual
    )


def _ordinary_tokens(model: Model, rng: random.Random) -> Callable[[int], list[int]]:
    """A sampler of ``k`` distinct ordinary token ids (words that decode and encode back to one id)."""
    tokenizer = getattr(model, "tokenizer", None)
    d_vocab = int(model.cfg.d_vocab)
    special = set() if tokenizer is None else {int(i) for i in tokenizer.all_special_ids}

    # Words with their leading space where the tokenizer writes one (BPE), so the tokens read as words.
    spaced = tokenizer is not None and tokenizer.decode(_encode(model, " the")).startswith(" ")
    word = re.compile(r"^ [A-Za-z]{2,}$" if spaced else r"^[A-Za-z]{2,}$")

    def ordinary(token: int) -> bool:
        if tokenizer is None:
            return True
        if token in special or token >= len(tokenizer):
            return False
        text = tokenizer.decode([token])
        return bool(word.match(text)) and _encode(model, text) == [token]

    def draw(k: int) -> list[int]:
        chosen: list[int] = []
        for _ in range(200 * k):
            token = rng.randrange(d_vocab)
            if token not in chosen and ordinary(token):
                chosen.append(token)
                if len(chosen) == k:
                    return chosen
        raise ValueError(f"model: fewer than {k} ordinary tokens found in its vocabulary of {d_vocab}")

    return draw


_FIELDS = ("clean", "corrupted", "answer", "foil")


def _jsonl_prompt(model: Model, line: str, where: str) -> Prompt:
    """One line of a task file checked field by field; every refusal names ``where`` and the field."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: not a JSON object ({error.msg})") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: not a JSON object with fields {', '.join(_FIELDS)}")
    for field in _FIELDS:
        if field not in row:
            raise ValueError(f"{where}: field {field!r} is missing")
        if not isinstance(row[field], str) or not row[field]:
            raise ValueError(f"{where}: field {field!r} must be a non-empty string, got {row[field]!r}")
    bos = _bos(model)
    clean, corrupted = [*bos, *_encode(model, row["clean"])], [*bos, *_encode(model, row["corrupted"])]
    if len(clean) != len(corrupted):
        raise ValueError(
            f"{where}: field 'corrupted' is {len(corrupted)} tokens long and field 'clean' {len(clean)}; "
            "they must have the same token count"
        )
    limit = adapter.context_length(model)
    if limit is not None and len(clean) > limit:
        raise ValueError(
            f"{where}: field 'clean' is {len(clean)} tokens long, more than the model's context of {limit} tokens"
        )
    ids = {field: _next_token(model, row, field, clean, where) for field in ("answer", "foil")}
    if ids["answer"] == ids["foil"]:
        raise ValueError(f"{where}: field 'foil' is the same token as field 'answer' ({row['answer']!r})")
    return clean, corrupted, ids["answer"], ids["foil"]


def _glued(text: str, word: str) -> bool:
    """Whether ``word`` would run on from ``text``'s last word: a letter or digit on both sides, no space between
    (ASCII only: a script written without spaces between words runs on by nature)."""
    end, start = text[-1], word[0]
    return end.isascii() and end.isalnum() and start.isascii() and start.isalnum()


def _next_token(model: Model, row: dict[str, str], field: str, clean: list[int], where: str) -> int:
    """The id of ``row[field]``: one token, and the one the model reads after the clean text (as the built-in
    tasks' answers are), not a merge with the clean text's last token."""
    tokens = _encode(model, row[field])
    if len(tokens) != 1:
        raise ValueError(f"{where}: field {field!r} ({row[field]!r}) is {len(tokens)} tokens; it must be one token")
    if _glued(row["clean"], row[field]):
        raise ValueError(
            f"{where}: field {field!r} ({row[field]!r}) is glued to the last word of field 'clean' (the text would "
            f"read {row['clean'].split()[-1] + row[field]!r}); write it with its leading space, as the built-in "
            f"tasks do ({' ' + row[field]!r})"
        )
    together = [*_bos(model), *_encode(model, row["clean"] + row[field])]
    if together != [*clean, tokens[0]]:
        same = next((i for i, (a, b) in enumerate(zip(clean, together, strict=False)) if a != b), len(clean))
        ends, reads = adapter.token_labels(model, clean[same:]), adapter.token_labels(model, together[same:])
        raise ValueError(
            f"{where}: field {field!r} ({row[field]!r}) is not the token read after field 'clean': the clean text "
            f"ends in {ends}, but with {row[field]!r} after it the end reads {reads}; write it as the text goes on "
            "(a word after a space with its space: ' Paris')"
        )
    return tokens[0]
