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

import contextlib
import contextvars
import hashlib
import os
import random
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import einops
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from contribution_lens._lazy import face
from contribution_lens.circuits import task_builders
from contribution_lens.circuits.checks import check_seed, check_task_fields, token_ids
from contribution_lens.circuits.task_builders import CAPITALS_COUNTERFACTUALS as CAPITALS_COUNTERFACTUALS
from contribution_lens.circuits.task_builders import CUSTOM as CUSTOM
from contribution_lens.circuits.task_builders import INDUCTION_COUNTERFACTUALS as INDUCTION_COUNTERFACTUALS
from contribution_lens.circuits.task_builders import IOI_COUNTERFACTUALS as IOI_COUNTERFACTUALS
from contribution_lens.circuits.task_builders import Counterfactual as Counterfactual
from contribution_lens.circuits.task_builders import check_counterfactual as check_counterfactual

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


PARTS = ("all", "scoring", "evaluation")
"""A task's ``part``: all its prompts, or one side of `Task.split`."""


_DERIVED: contextvars.ContextVar[bool] = contextvars.ContextVar("derived", default=False)
"""True while a task makes another of its own prompts (`Task.subset`, `Task.with_metric`): checked, not warned twice."""


@contextlib.contextmanager
def _derived() -> Iterator[None]:
    token = _DERIVED.set(True)
    try:
        yield
    finally:
        _DERIVED.reset(token)


def _warn_repeated(task: "Task") -> None:
    """A warning where prompts repeat: an interval over prompts would count each repeat as new evidence."""
    distinct = len(set(task.fingerprints().tolist()))
    if distinct < len(task):
        warnings.warn(
            f"task {task.name!r}: {len(task)} prompts, {distinct} distinct: repeated prompts add no evidence, yet "
            "an interval over prompts counts every repeat as if it did",
            UserWarning,
            stacklevel=4,
        )


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
    tokenizer: str | None = None
    """The tokenizer the prompts' ids are of (`contribution_lens.adapter.tokenizer_identity`; None: not recorded)."""

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
    ``scoring`` or ``evaluation`` side of `split`. ``tokenizer``: the identity of the tokenizer the
    ids are of (`contribution_lens.adapter.tokenizer_identity`), which every task built from a model
    records and every function that takes a model and a task compares with the model's; None for
    ids given by hand (pass ``tokenizer=adapter.tokenizer_identity(model)`` to have them checked too).

    Ids may be any integer tensor, NumPy array or nested lists; what the constructor cannot accept
    is refused naming the field (`contribution_lens.circuits.checks.check_task_fields`), and repeated
    prompts are warned about: they add no evidence, yet an interval over prompts counts each repeat.

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
    tokenizer: str | None = None

    def __post_init__(self) -> None:
        for field, ndim in (("clean", 2), ("corrupted", 2), ("answer", 1), ("foil", 1), ("last", 1)):
            object.__setattr__(self, field, token_ids(getattr(self, field), field, ndim))
        check_task_fields(self, METRICS, PARTS)
        if not _DERIVED.get():
            _warn_repeated(self)

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
        with _derived():
            return Task(
                self.name, self.clean[rows], self.corrupted[rows], self.answer[rows], self.foil[rows],
                self.last[rows], self.metric, self.counterfactual, self.part if part is None else part, self.tokenizer,
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
        return Prompts(self.name, self.counterfactual, self.part, self.fingerprints(), self.tokenizer)

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
        seed = check_seed(seed)
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
        with _derived():
            return Task(
                self.name, self.clean, self.corrupted, self.answer, self.foil, self.last, metric, self.counterfactual,
                self.part, self.tokenizer,
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
        return task_builders.ioi(cls, model, n=n, seed=seed, counterfactual=counterfactual)

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
        return task_builders.induction(cls, model, n=n, length=length, seed=seed, counterfactual=counterfactual)

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
        return task_builders.capitals(cls, model, n=n, seed=seed, counterfactual=counterfactual)

    @classmethod
    def from_jsonl(cls, model: Model, path: Any, *, metric: str = "logit_diff") -> "Task":
        """A user's task: one JSON object a line, ``{"clean": ..., "corrupted": ..., "answer": ..., "foil": ...}``.

        All four fields are strings. ``clean`` and ``corrupted`` are texts tokenised as the model
        tokenises (its BOS convention) and must give the same token count; ``answer`` and ``foil``
        are the next tokens compared at the end of the text, each exactly one token as written,
        leading space included (``" Mary"``), and different. Blank lines are skipped; other fields
        are ignored. The task is named after the file. Every line is checked before any is used,
        and a bad one is refused naming the file, its line number and the field: a line that is
        not UTF-8 (the file is read as UTF-8, a byte-order mark and Windows line ends allowed), an
        answer or foil that is not the token read after the clean text (``"Paris"`` without its
        space), a prompt longer than the model's context. The model comes first, as in every call
        (the earlier order, ``(path, model)``, still works with a ``FutureWarning``). ``path``: a
        ``str`` or ``os.PathLike``.

        Example:
            >>> import json, tempfile
            >>> from contribution_lens.loading import load_skeleton
            >>> row = {"clean": "The capital of France is", "corrupted": "The capital of Japan is",
            ...        "answer": " Paris", "foil": " Tokyo"}
            >>> path = tempfile.mkdtemp() + "/capitals.jsonl"
            >>> _ = open(path, "w").write(json.dumps(row) + "\\n")
            >>> Task.from_jsonl(load_skeleton(), path)
            Task('capitals', 1 prompts of 6 to 6 tokens, metric logit_diff, counterfactual custom)
        """
        if isinstance(model, str | os.PathLike):  # the order before the model came first, as in every other call
            warnings.warn(
                "Task.from_jsonl(path, model) is the earlier order: pass the model first, as every other call "
                "does, Task.from_jsonl(model, path)",
                FutureWarning,
                stacklevel=2,
            )
            model, path = path, model
        if metric not in METRICS:
            raise ValueError(f"metric must be one of {sorted(METRICS)}, got {metric!r}")
        return task_builders.from_jsonl(cls, model, path, metric=metric)


_MOVED = ("IOI_TEMPLATES", "IOI_PLACES", "IOI_OBJECTS", "IOI_NAMES", "IOI_SLOTS", "CAPITALS")
__getattr__, _ = face(
    __name__,
    {},
    {
        name: (
            f"contribution_lens.circuits.task_builders:{name}",
            f"use contribution_lens.circuits.task_builders.{name}",
        )
        for name in _MOVED
    },
)
