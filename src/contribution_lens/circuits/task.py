"""A task a circuit is found for: prompts with counterfactuals, an answer and a foil per prompt.

Prompt ``p`` has a clean and a corrupted (counterfactual) token sequence of the same length, an
answer ``t_p`` and a foil ``f_p``; the metric is read at its last real position ``last[p]``. By
default it is the logit difference

    m_p = z_p(t_p) - z_p(f_p),        z_p = the logits at (p, last[p]),

and `Task.metric_values` offers two more (`METRICS`): the answer's probability ``softmax(z_p)[t_p]``,
and the KL divergence ``KL(P_clean,p || P_p)`` of the run's next-token distribution from the clean
run's. Built in: `Task.ioi` (Wang et al. 2023's indirect-object identification; its counterfactual
MIB's default ``s2-io-flip`` or Wang et al.'s ``abc``, `IOI_COUNTERFACTUALS`), `Task.induction`
(random tokens repeated, the first copy resampled) and `Task.capitals` (a country's capital, the
country swapped), measured above chance on every bundled model (`docs/results.md`); users' own
tasks come from a JSON-lines file (`Task.from_jsonl`). Every task names its counterfactual
(``counterfactual``: what the corrupted prompts ask) and the part of a split it is
(``part``: ``all``, or ``scoring`` and ``evaluation`` from `Task.split`). `task_report` says
whether a model does a task: its clean accuracy (``m_p > 0``) and mean logit difference with a
bootstrap interval, with a warning where that interval includes 0.

    >>> from contribution_lens.circuits.task import Task
    >>> from contribution_lens.loading import load_skeleton
    >>> task = Task.ioi(load_skeleton(), n=4, seed=0)  # a tokenizer is all it needs (no weights)
    >>> task.clean.shape == task.corrupted.shape, len(task)
    (True, 4)
"""

import hashlib
import json
import os
import random
import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import einops
import numpy as np
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from contribution_lens import adapter

Model = Any  # a TransformerBridge


def _logit_diff(logits: Tensor, answer: Tensor, foil: Tensor, clean: Tensor | None) -> Tensor:
    rows = torch.arange(logits.shape[0], device=logits.device)
    return logits[rows, answer] - logits[rows, foil]


def _probability(logits: Tensor, answer: Tensor, foil: Tensor, clean: Tensor | None) -> Tensor:
    rows = torch.arange(logits.shape[0], device=logits.device)
    return logits.softmax(-1)[rows, answer]


def _kl(logits: Tensor, answer: Tensor, foil: Tensor, clean: Tensor | None) -> Tensor:
    if clean is None:
        raise ValueError("clean_logits: the metric 'kl' compares a run with the clean run; pass the clean run's logits")
    reference = clean.log_softmax(-1)
    return (reference.exp() * (reference - logits.log_softmax(-1))).sum(-1)


METRICS: dict[str, Callable[[Tensor, Tensor, Tensor, Tensor | None], Tensor]] = {
    "logit_diff": _logit_diff,
    "probability": _probability,
    "kl": _kl,
}
"""The metrics a task reads at ``last`` (a closed set), each ``(logits, answer, foil, clean_logits) -> [prompt]``.

* ``logit_diff``: ``z(t) - z(f)``. Clean: how strongly the model prefers the answer; corrupted: how
  strongly it prefers it without the information the counterfactual removes (near 0 or negative).
* ``probability``: ``softmax(z)[t]``. Corrupted: the answer's probability without that information.
* ``kl``: ``KL(P_clean || P) = sum_v P_clean(v) (log P_clean(v) - log P(v))``: 0 for the clean run
  itself, positive for the corrupted run (how far the counterfactual moves the whole distribution);
  lower is more faithful, the other way round from the other two, and it needs the clean logits.
"""


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
PARTS = ("all", "scoring", "evaluation")
"""A task's ``part``: all its prompts, or one side of `Task.split`."""


def check_counterfactual(name: Any, known: dict[str, Counterfactual], task: str) -> str:
    """``name`` if it is one of ``known`` (a task's counterfactuals), else a ValueError listing them."""
    if not isinstance(name, str) or name not in known:
        raise ValueError(f"counterfactual: {task} offers {', '.join(known)}; got {name!r}")
    return name


@dataclass(frozen=True)
class Prompts:
    """Which prompts a result was computed on: the task, its counterfactual, the part of a split, and one
    fingerprint a prompt (`Task.fingerprints`), so that two results can say whether they share prompts.

    Example:
        >>> import torch
        >>> scored = Prompts("ioi", "s2-io-flip", "scoring", torch.tensor([1, 2, 3]))
        >>> scored, scored.overlap(Prompts("ioi", "s2-io-flip", "evaluation", torch.tensor([3, 4])))
        (Prompts(ioi, s2-io-flip, scoring part: 3 prompts), 1)
    """

    task: str
    counterfactual: str
    part: str
    fingerprints: Int[Tensor, " prompt"]

    def __len__(self) -> int:
        return int(self.fingerprints.shape[0])

    def overlap(self, other: "Prompts") -> int:
        """How many of ``other``'s prompts are among these."""
        return int(torch.isin(other.fingerprints, self.fingerprints).sum())

    @property
    def label(self) -> str:
        """``"scoring (32)"``: the part and its prompt count, as the results table shows it."""
        return f"{self.part} ({len(self)})"

    def __repr__(self) -> str:
        return f"Prompts({self.task}, {self.counterfactual}, {self.part} part: {len(self)} prompts)"


@dataclass(frozen=True)
class Task:
    """Clean and corrupted token ids of equal shape, right-padded, one answer and one foil per prompt.

    ``last[p]`` is the index of prompt ``p``'s last real token (where the metric is read); positions
    after it are padding (the model's pad id), which a causal model's earlier positions never see.
    Clean and corrupted have the same token count in every prompt, so one ``last`` serves both.
    ``counterfactual`` names what the corrupted prompts ask (`IOI_COUNTERFACTUALS` and the other
    built-in tasks' tables; `CUSTOM` for ids given or read from a file); ``part`` is ``all``, or the
    ``scoring`` or ``evaluation`` side of `split`.

    Example:
        >>> import torch
        >>> ids = torch.tensor([[1, 5, 7, 9], [1, 6, 8, 0]])
        >>> task = Task("toy", ids, ids.flip(1), answer=torch.tensor([3, 4]), foil=torch.tensor([2, 2]),
        ...             last=torch.tensor([3, 2]))
        >>> task
        Task('toy', 2 prompts of 3 to 4 tokens, metric logit_diff, counterfactual custom)
        >>> task.attention_mask.tolist()
        [[True, True, True, True], [True, True, True, False]]
    """

    name: str
    clean: Int[Tensor, "prompt pos"]
    corrupted: Int[Tensor, "prompt pos"]
    answer: Int[Tensor, " prompt"]
    foil: Int[Tensor, " prompt"]
    last: Int[Tensor, " prompt"]
    metric: str = "logit_diff"
    counterfactual: str = CUSTOM
    part: str = "all"

    def __post_init__(self) -> None:
        if self.clean.ndim != 2 or self.clean.shape[0] == 0:
            raise ValueError(
                f"clean must be token ids [prompt pos] with at least one prompt, got {tuple(self.clean.shape)}"
            )
        if self.clean.shape != self.corrupted.shape:
            raise ValueError(
                f"clean and corrupted must have the same shape (one token count a prompt), "
                f"got {tuple(self.clean.shape)} and {tuple(self.corrupted.shape)}"
            )
        for field in ("answer", "foil", "last"):
            if tuple(getattr(self, field).shape) != (self.clean.shape[0],):
                raise ValueError(
                    f"{field} must hold one id a prompt, shape ({self.clean.shape[0]},), "
                    f"got {tuple(getattr(self, field).shape)}"
                )
        if bool((self.answer == self.foil).any()):
            raise ValueError("foil must differ from answer in every prompt")
        if bool(((self.last < 0) | (self.last >= self.clean.shape[1])).any()):
            raise ValueError(f"last must index a position of the prompts, 0..{self.clean.shape[1] - 1}")
        if self.metric not in METRICS:
            raise ValueError(f"metric must be one of {sorted(METRICS)}, got {self.metric!r}")
        if not isinstance(self.counterfactual, str) or not self.counterfactual:
            raise ValueError(f"counterfactual must be a non-empty name, got {self.counterfactual!r}")
        if self.part not in PARTS:
            raise ValueError(f"part must be one of {', '.join(PARTS)}, got {self.part!r}")

    def __len__(self) -> int:
        return int(self.clean.shape[0])

    def __repr__(self) -> str:
        lengths = (self.last + 1).tolist()
        part = "" if self.part == "all" else f", {self.part} part"
        return (
            f"Task({self.name!r}, {len(self)} prompts of {min(lengths)} to {max(lengths)} tokens, "
            f"metric {self.metric}, counterfactual {self.counterfactual}{part})"
        )

    def subset(self, rows: Int[Tensor, " rows"], part: str | None = None) -> "Task":
        """The prompts ``rows`` (indices, in that order) as a task of their own; ``part``: its `PARTS` name."""
        return Task(
            self.name, self.clean[rows], self.corrupted[rows], self.answer[rows], self.foil[rows], self.last[rows],
            self.metric, self.counterfactual, self.part if part is None else part,
        )  # fmt: skip

    def fingerprints(self) -> Int[Tensor, " prompt"]:
        """One 64-bit hash a prompt of its real clean and corrupted ids, answer and foil: equal prompts, equal hashes.

        Example:
            >>> import torch
            >>> ids = torch.tensor([[1, 5], [1, 5], [2, 6]])
            >>> task = Task("toy", ids, ids, torch.tensor([3, 3, 3]), torch.tensor([4, 4, 4]), Task.full_length(ids))
            >>> hashes = task.fingerprints().tolist()
            >>> hashes[0] == hashes[1] != hashes[2]
            True
        """
        values = []
        for row in range(len(self)):
            end = int(self.last[row]) + 1
            parts = (
                self.clean[row, :end],
                self.corrupted[row, :end],
                self.answer[row : row + 1],
                self.foil[row : row + 1],
            )
            digest = hashlib.blake2b(digest_size=8)
            for part in parts:
                digest.update(part.to(torch.int64).cpu().numpy().tobytes())
                digest.update(b"|")
            values.append(int.from_bytes(digest.digest(), "little", signed=True))
        return torch.tensor(values, dtype=torch.int64)

    @property
    def prompts(self) -> Prompts:
        """These prompts as results record them: the task's name, counterfactual, part and fingerprints."""
        return Prompts(self.name, self.counterfactual, self.part, self.fingerprints())

    def split(self, fraction: float = 0.5, *, seed: int = 0) -> tuple["Task", "Task"]:
        """Disjoint ``scoring`` and ``evaluation`` tasks: about ``fraction`` of the prompts scored, the rest evaluated.

        As MIB scores circuits on its train split and evaluates them on another. Identical prompts
        (equal `fingerprints`) go to the same side, so no prompt is in both; the distinct prompts
        are shuffled with ``seed`` and the first ``round(fraction * distinct)`` (at least one, and
        at least one left) are scored. Each side keeps the task's prompt order.

        Example:
            >>> import torch
            >>> ids = torch.arange(12).reshape(6, 2)
            >>> task = Task("toy", ids, ids + 1, torch.zeros(6, dtype=torch.long), torch.ones(6, dtype=torch.long),
            ...             Task.full_length(ids))
            >>> scoring, evaluation = task.split(0.5, seed=0)
            >>> len(scoring), len(evaluation), scoring.part, evaluation.part
            (3, 3, 'scoring', 'evaluation')
        """
        if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0 < fraction < 1:
            raise ValueError(f"fraction must be a number in (0, 1) (the share of prompts scored), got {fraction!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        fingerprints = self.fingerprints().tolist()
        distinct = list(dict.fromkeys(fingerprints))
        if len(distinct) < 2:
            raise ValueError(
                f"task: {len(self)} prompts, {len(distinct)} distinct, cannot be split into two non-empty parts "
                "with no prompt in both"
            )
        random.Random(seed).shuffle(distinct)
        count = min(max(round(fraction * len(distinct)), 1), len(distinct) - 1)
        scored = set(distinct[:count])
        rows = torch.tensor([fp in scored for fp in fingerprints])
        return (
            self.subset(torch.nonzero(rows)[:, 0], "scoring"),
            self.subset(torch.nonzero(~rows)[:, 0], "evaluation"),
        )

    @property
    def n_prompts(self) -> int:
        return len(self)

    @property
    def attention_mask(self) -> Bool[Tensor, "prompt pos"]:
        """True at every real token (positions ``0..last[p]``), False at the right padding."""
        positions = torch.arange(self.clean.shape[1], device=self.last.device)
        return einops.rearrange(positions, "pos -> 1 pos") <= einops.rearrange(self.last, "prompt -> prompt 1")

    @staticmethod
    def full_length(clean: Tensor) -> Tensor:
        """``last`` for unpadded prompts: every prompt's last position."""
        return torch.full((clean.shape[0],), clean.shape[1] - 1, dtype=torch.long)

    def metric_values(
        self,
        logits: Float[Tensor, "prompt *pos d_vocab"],
        clean_logits: Float[Tensor, "prompt *pos d_vocab"] | None = None,
    ) -> Float[Tensor, " prompt"]:
        """The task's metric (`METRICS`) per prompt, read at ``last``, in float32 (float64 stays float64).

        Args:
            logits: a run's logits, ``[prompt pos d_vocab]`` (read at ``last[p]``) or already at the
                last position, ``[prompt d_vocab]``.
            clean_logits: the clean run's logits in the same layout; needed by ``kl`` only.

        Example:
            >>> import torch
            >>> ids = torch.zeros(2, 3, dtype=torch.long)
            >>> task = Task("toy", ids, ids, torch.tensor([1, 2]), torch.tensor([0, 0]), Task.full_length(ids))
            >>> task.metric_values(torch.tensor([[0.0, 2.0, 1.0], [1.0, 0.0, 4.0]]))
            tensor([2., 3.])
        """
        values = self._at_last(logits, "logits")
        clean = None if clean_logits is None else self._at_last(clean_logits, "clean_logits")
        if clean is not None and clean.shape != values.shape:
            raise ValueError(f"clean_logits has shape {tuple(clean.shape)} at last, logits {tuple(values.shape)}")
        answer, foil = self.answer.to(values.device), self.foil.to(values.device)
        return METRICS[self.metric](values, answer, foil, clean)

    def _at_last(self, logits: Tensor, name: str) -> Tensor:
        if logits.ndim not in (2, 3) or logits.shape[0] != len(self):
            raise ValueError(
                f"{name} must be [prompt pos d_vocab] or [prompt d_vocab] with {len(self)} prompts, "
                f"got {tuple(logits.shape)}"
            )
        if logits.ndim == 3:
            rows = torch.arange(len(self), device=logits.device)
            logits = logits[rows, self.last.to(logits.device)]
        return logits if logits.dtype == torch.float64 else logits.float()

    def with_metric(self, metric: str) -> "Task":
        """The same prompts read with another metric of `METRICS`."""
        return Task(
            self.name, self.clean, self.corrupted, self.answer, self.foil, self.last, metric, self.counterfactual,
            self.part,
        )  # fmt: skip

    @classmethod
    def ioi(cls, model: Model, *, n: int = 64, seed: int = 0, counterfactual: str = "s2-io-flip") -> "Task":
        """Indirect-object identification: "When Mary and John went to the store, John gave a drink to".

        Each prompt is one of Wang et al. (2023)'s fifteen templates, in the ABBA or BABA order (alternating),
        with two names that are one token each in the model's tokenizer (after the space the template
        gives them); the answer is the indirect object (``" Mary"``), the foil the subject (``" John"``).
        The counterfactual (`IOI_COUNTERFACTUALS`) is MIB's default, ``"s2-io-flip"``: the subject's
        second mention replaced by the indirect object ("When Mary and John went to the store, Mary
        gave a drink to"), which asks for the other name; or ``"abc"`` (Wang et al.'s): the three name
        slots filled with three other names, so nothing in it says which name to give the answer to.
        The clean prompts are the same for both at one seed. Prompts whose clean and corrupted texts
        tokenise to different lengths are drawn again.

        Args:
            model: a causal language model with a tokenizer and an unembedding.
            n: the number of prompts.
            seed: the random seed of the templates, names, places and objects.
            counterfactual: ``"s2-io-flip"`` or ``"abc"``.
        """
        check_counterfactual(counterfactual, IOI_COUNTERFACTUALS, "Task.ioi")
        _check_model(model, tokenizer=True)
        _check_count(n, "n")
        names = _one_token_words(model, IOI_NAMES)
        if len(names) < 5:
            raise ValueError(f"model: its tokenizer has only {len(names)} of the IOI names as one token; 5 are needed")
        rng = random.Random(seed)
        prompts = []
        for index in range(n):
            make = partial(_ioi_prompt, model, names, rng, abba=index % 2 == 0, counterfactual=counterfactual)
            prompts.append(_draw(make, "ioi"))
        return _assemble(model, "ioi", prompts, counterfactual=counterfactual)

    @classmethod
    def induction(
        cls, model: Model, *, n: int = 64, length: int = 10, seed: int = 0, counterfactual: str = "first-copy-resampled"
    ) -> "Task":
        """Induction: ``length`` random tokens, then the same again; the last one is to be predicted.

        Clean: ``r_1 .. r_L r_1 .. r_{L-1}`` (after BOS where the model prepends one); the answer is
        ``r_L``, the token that followed ``r_{L-1}`` before. Corrupted: the first copy resampled,
        ``r'_1 .. r'_L r_1 .. r_{L-1}``, so nothing earlier says what comes next. The foil is an
        ordinary token in neither sequence. Tokens are ordinary words of the vocabulary (letters,
        one token that decodes and encodes back to itself, no special token); a model without a
        tokenizer draws from every id.

        Args:
            model: a causal language model with an unembedding.
            n: the number of prompts.
            length: the number of tokens repeated, at least 2.
            seed: the random seed.
            counterfactual: ``"first-copy-resampled"``, the one it offers (`INDUCTION_COUNTERFACTUALS`).
        """
        check_counterfactual(counterfactual, INDUCTION_COUNTERFACTUALS, "Task.induction")
        _check_model(model, tokenizer=False)
        _check_count(n, "n")
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
        return _assemble(model, "induction", prompts, counterfactual=counterfactual)

    @classmethod
    def capitals(cls, model: Model, *, n: int = 64, seed: int = 0, counterfactual: str = "other-country") -> "Task":
        """A country's capital: "The capital of France is" -> ``" Paris"``, the foil another capital.

        Each prompt pairs two countries whose prompts tokenise to the same length and whose capitals
        are one token each: the clean prompt names one (its capital is the answer), the corrupted
        the other (its capital is the foil), so the counterfactual asks for the foil.

        Args:
            model: a causal language model with a tokenizer and an unembedding.
            n: the number of prompts.
            seed: the random seed of the pairs.
            counterfactual: ``"other-country"``, the one it offers (`CAPITALS_COUNTERFACTUALS`).
        """
        check_counterfactual(counterfactual, CAPITALS_COUNTERFACTUALS, "Task.capitals")
        return _paired(model, "capitals", CAPITALS, n=n, seed=seed, counterfactual=counterfactual)

    @classmethod
    def from_jsonl(cls, path: str | os.PathLike, model: Model, *, metric: str = "logit_diff") -> "Task":
        """A user's task: one JSON object a line, ``{"clean": ..., "corrupted": ..., "answer": ..., "foil": ...}``.

        All four fields are strings. ``clean`` and ``corrupted`` are texts tokenised as the model
        tokenises (its BOS convention) and must give the same token count; ``answer`` and ``foil``
        are the next tokens compared at the end of the text, each exactly one token as written,
        leading space included (``" Mary"``), and different. Blank lines are skipped; other fields
        are ignored. The task is named after the file. Every line is checked before any is used,
        and a bad one is refused naming its line number and field.

        Example:
            >>> import json, tempfile
            >>> from contribution_lens.loading import load_skeleton
            >>> row = {"clean": "The capital of France is", "corrupted": "The capital of Japan is",
            ...        "answer": " Paris", "foil": " Tokyo"}
            >>> path = tempfile.mkdtemp() + "/capitals.jsonl"
            >>> _ = open(path, "w").write(json.dumps(row) + "\\n")
            >>> Task.from_jsonl(path, load_skeleton())
            Task('capitals', 1 prompts of 6 to 6 tokens, metric logit_diff, counterfactual custom)
        """
        _check_model(model, tokenizer=True)
        if metric not in METRICS:
            raise ValueError(f"metric must be one of {sorted(METRICS)}, got {metric!r}")
        file = Path(path)
        if not file.is_file():
            raise ValueError(f"path: no such file: {file}")
        prompts = []
        for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
            if line.strip():
                prompts.append(_jsonl_prompt(model, line, f"{file}, line {number}"))
        if not prompts:
            raise ValueError(f"path: {file} holds no task line")
        return _assemble(model, file.stem, prompts, metric=metric)


Prompt = tuple[list[int], list[int], int, int]
"""One prompt as token ids: clean, corrupted (same length), answer, foil."""


def _check_model(model: Model, *, tokenizer: bool) -> None:
    """Refuse, before any pass, a model a circuit task cannot run on."""
    if not adapter.is_causal_model(model):
        raise ValueError(
            "model: an encoder (bidirectional attention) has no next-token prediction to explain; "
            "circuit tasks need a causal language model"
        )
    try:
        adapter.unembedding(model)
    except ValueError as error:
        raise ValueError(f"model: {error}") from None
    if tokenizer and getattr(model, "tokenizer", None) is None:
        raise ValueError("model: this task is built from text and the model has no tokenizer")


def _check_count(n: Any, name: str) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{name} must be a positive integer (the number of prompts), got {n!r}")


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
    model: Model, name: str, prompts: Sequence[Prompt], *, metric: str = "logit_diff", counterfactual: str = CUSTOM
) -> Task:
    """Right-pad the prompts with the model's pad id to one length and set ``last``."""
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
    return Task(name, clean, corrupted, answer, foil, last, metric, counterfactual)


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
    model: Model, name: str, items: Sequence[tuple[str, str]], *, n: int, seed: int, counterfactual: str
) -> Task:
    """Prompts of two items each: the first's text and answer (clean), the second's text and answer (foil)."""
    _check_model(model, tokenizer=True)
    _check_count(n, "n")
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
    return _assemble(model, name, [pairs[index % len(pairs)] for index in range(n)], counterfactual=counterfactual)


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
    ids = {}
    for field in ("answer", "foil"):
        tokens = _encode(model, row[field])
        if len(tokens) != 1:
            raise ValueError(f"{where}: field {field!r} ({row[field]!r}) is {len(tokens)} tokens; it must be one token")
        ids[field] = tokens[0]
    if ids["answer"] == ids["foil"]:
        raise ValueError(f"{where}: field 'foil' is the same token as field 'answer' ({row['answer']!r})")
    return clean, corrupted, ids["answer"], ids["foil"]


@dataclass(frozen=True)
class TaskReport:
    """Whether a model does a task: clean accuracy and mean logit difference with a bootstrap interval.

    ``logit_diff[p] = z_p(t_p) - z_p(f_p)`` on the clean prompts; ``accuracy`` the share with
    ``logit_diff > 0``; ``low``, ``high`` the percentile bootstrap interval (``level``) of the mean
    over prompts. ``done`` is ``low > 0``: the interval excludes 0 on the side of the answer.
    """

    task: str
    logit_diff: Float[Tensor, " prompt"]
    accuracy: float
    mean: float
    low: float
    high: float
    level: float = 0.95

    @property
    def done(self) -> bool:
        return self.low > 0

    def __repr__(self) -> str:
        percent = round(100 * self.level)
        return (
            f"TaskReport({self.task!r}, {self.logit_diff.shape[0]} prompts: accuracy {self.accuracy:.3f}, "
            f"logit difference {self.mean:.3f} [{self.low:.3f}, {self.high:.3f}] ({percent} %))"
        )


def bootstrap_mean_interval(
    values: np.ndarray, *, resamples: int = 1000, seed: int = 0, level: float = 0.95
) -> tuple[float, float]:
    """The percentile bootstrap interval of ``values``'s mean (``resamples`` draws with replacement)."""
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(values), size=(resamples, len(values)))
    means = values[draws].mean(axis=1)
    tail = (1 - level) / 2
    return float(np.quantile(means, tail)), float(np.quantile(means, 1 - tail))


def task_report(
    model: Model, task: Task, *, batch_size: int = 16, resamples: int = 1000, seed: int = 0, level: float = 0.95
) -> TaskReport:
    """Run the clean prompts and report the model's accuracy and mean logit difference on ``task``.

    Warns (``UserWarning``) where the interval of the mean logit difference includes 0 or lies
    below it: the model does not do the task, and a circuit found for it explains noise.
    """
    _check_model(model, tokenizer=False)
    _check_count(batch_size, "batch_size")
    _check_count(resamples, "resamples")
    if not 0 < level < 1:
        raise ValueError(f"level must lie in (0, 1), got {level!r}")
    adapter.check_token_ids(model, torch.cat([task.clean.flatten(), task.answer, task.foil]))
    diff = task.with_metric("logit_diff")
    values = []
    for start in range(0, len(task), batch_size):
        rows = slice(start, start + batch_size)
        batch = adapter.to_token_batch(model, task.clean[rows], attention_mask=task.attention_mask[rows])
        logits = adapter.forward(model, batch)[:, : batch.tokens.shape[1]]
        values.append(task.subset(torch.arange(len(task))[rows]).with_metric("logit_diff").metric_values(logits).cpu())
    logit_diff = torch.cat(values)
    array = logit_diff.double().numpy()
    low, high = bootstrap_mean_interval(array, resamples=resamples, seed=seed, level=level)
    report = TaskReport(diff.name, logit_diff, float((array > 0).mean()), float(array.mean()), low, high, level)
    if not report.done:
        warnings.warn(
            f"the model does not do the task {task.name!r}: the {round(100 * level)} % interval of its mean logit "
            f"difference, [{low:.3g}, {high:.3g}], is not above 0 (accuracy {report.accuracy:.2f}); "
            "a circuit found for it would explain noise",
            UserWarning,
            stacklevel=2,
        )
    return report
