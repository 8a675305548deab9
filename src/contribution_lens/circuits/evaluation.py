"""A circuit's faithfulness as MIB measures it: `evaluate_circuit` and `circuit_curve`.

With ``m(C)`` the task's metric averaged over prompts in the pass that keeps the circuit ``C``'s
edges clean and patches every other edge with the counterfactual (`contribution_lens.circuits.interchange`),
``M`` the whole model (the clean pass) and ``∅`` the empty circuit (the counterfactual's pass),

    f(C) = (m(C) - m(∅)) / (m(M) - m(∅)).

The curve evaluates the circuits of a `CircuitScores` at ``0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50``
and ``100 %`` of the edges (or nodes), ``int(x * n)`` of ``n`` at fraction ``x``, chosen twice
(`SELECTIONS`): by signed score in the direction that keeps the clean behaviour, and by ``|score|``.
As MIB's ``print_results.py`` reads its two runs, its CPR is the area under ``f`` of the signed
selection and its CMD the area under ``|1 - f|`` of the ``|score|`` selection, trapezoids over the
fraction from 0.001 to 1 (MIB's ``evaluate_area_under_curve``); the area under ``f`` of the
``|score|`` selection is `CircuitCurve.absolute_area`. Intervals are percentile bootstraps over
prompts (each resample recomputes every mean); with fewer than ten prompts (the task module's
``MIN_INTERVAL_PROMPTS``) every repr, table and report says they are too few for one.

``f`` is undefined where the counterfactual does not move the metric (``m(M) - m(∅)`` is 0, or
within float32 rounding of it: `unmoved`): then `CircuitEvaluation.faithfulness`, CPR and CMD are
NaN, a warning says why when they are computed, and the repr, table and report say it in words.

Example:
    >>> import torch
    >>> import contribution_lens as cl
    >>> model = cl.load_model()
    >>> ids = torch.randint(100, 1000, (2, 6), generator=torch.Generator().manual_seed(0))
    >>> task = cl.Task("demo", ids, ids.flip(0), ids[:, 0], ids[:, 1], cl.Task.full_length(ids))
    >>> graph = cl.circuit_graph(model)
    >>> every = cl.Circuit.from_nodes(graph, graph.components)  # the whole model: the clean pass
    >>> round(cl.evaluate_circuit(model, task, every).faithfulness, 4)
    1.0
"""

import math
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import einops
import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from contribution_lens.adapter import Model, hidden_bias_path
from contribution_lens.circuits import interchange as ic
from contribution_lens.circuits.checks import (
    check_fractions,
    check_level,
    check_memory,
    check_seed,
    check_switch,
    check_tokenizer,
    few_prompts,
)
from contribution_lens.circuits.graph import circuit_graph
from contribution_lens.circuits.registry import DEFAULT_MEMORY, LEVELS
from contribution_lens.circuits.scoring import Circuit, CircuitScores
from contribution_lens.circuits.task import Prompts, Task
from contribution_lens.circuits.task_checks import check_task
from contribution_lens.files import Saves

FRACTIONS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
"""MIB's circuit sizes: the share of edges (or nodes) kept."""
RESAMPLES = 1000
UNMOVED = 1e-5
"""``|m(M) - m(∅)|`` at most this share of the metric's size (``max(mean |m(M)|, mean |m(∅)|)``) is no movement:
float32 passes of the same prompt differ by about that much (see `unmoved`)."""


def unmoved(clean: Tensor, corrupted: Tensor) -> str:
    """Why faithfulness is undefined on these metrics, or ``""``: the counterfactual does not move their mean.

    Example:
        >>> import torch
        >>> unmoved(torch.tensor([2.0, 1.0]), torch.tensor([2.0, 1.0]))[:70]
        'the counterfactual does not move the metric: mean m(clean) - m(corrupt'
        >>> unmoved(torch.tensor([2.0, 1.0]), torch.tensor([0.5, 0.0]))
        ''
    """
    clean, corrupted = clean.double(), corrupted.double()
    if not bool(torch.isfinite(clean).all() and torch.isfinite(corrupted).all()):
        return "the metric is not finite in the clean or the counterfactual pass"
    moved = float(clean.mean() - corrupted.mean())
    size = max(float(clean.abs().mean()), float(corrupted.abs().mean()))
    if abs(moved) > UNMOVED * size:
        return ""
    return (
        f"the counterfactual does not move the metric: mean m(clean) - m(corrupted) = {moved:.3g} over "
        f"{clean.shape[-1]} prompts, and f divides by it"
    )


def faithfulness(patched: Tensor, clean: Tensor, corrupted: Tensor) -> Tensor:
    """``(mean patched - mean corrupted) / (mean clean - mean corrupted)`` over the last axis (prompts), in float64.

    The three broadcast against each other without that axis (sizes, bootstrap resamples).
    """
    empty = corrupted.double().mean(-1)
    return (patched.double().mean(-1) - empty) / (clean.double().mean(-1) - empty)


def areas(f: Float[Tensor, "*batch size"], fractions: Float[Tensor, " size"]) -> tuple[Tensor, Tensor]:
    """CPR and CMD: the trapezoid areas under ``f`` and under ``|1 - f|`` over ``fractions``."""
    width = fractions[1:] - fractions[:-1]
    cpr = (width * (f[..., 1:] + f[..., :-1]) / 2).sum(-1)
    gap = (1 - f).abs()
    cmd = (width * (gap[..., 1:] + gap[..., :-1]) / 2).sum(-1)
    return cpr, cmd


def _resamples(n: int, resamples: int, seed: int) -> Tensor:
    return torch.randint(0, n, (resamples, n), generator=torch.Generator().manual_seed(seed))


def _interval(values: Tensor) -> Tensor:
    """The 95 % percentile interval over the first axis, ``[..., 2]``."""
    return torch.stack([values.quantile(0.025, dim=0), values.quantile(0.975, dim=0)], dim=-1)


@dataclass(frozen=True)
class CircuitEvaluation(Saves):
    """A circuit's metric per prompt in the clean, counterfactual and patched passes."""

    task: str
    circuit: Circuit
    clean: Float[Tensor, " prompt"]
    corrupted: Float[Tensor, " prompt"]
    patched: Float[Tensor, " prompt"]
    seed: int = 0
    resamples: int = RESAMPLES
    prompts: Prompts | None = None
    """The prompts evaluated: the task, its counterfactual, its part of a split."""

    def __post_init__(self) -> None:
        check_metrics(self.clean, self.corrupted, self.patched, self.prompts)
        if not isinstance(self.circuit, Circuit):
            raise ValueError(f"circuit must be a Circuit, got {type(self.circuit).__name__}")

    @property
    def undefined(self) -> str:
        """Why `faithfulness` is undefined (NaN), or ``""`` (`unmoved`)."""
        return unmoved(self.clean, self.corrupted)

    @property
    def faithfulness(self) -> float:
        """f of the circuit; NaN where the counterfactual does not move the metric (`undefined` says so)."""
        return math.nan if self.undefined else float(faithfulness(self.patched, self.clean, self.corrupted))

    @property
    def interval(self) -> tuple[float, float]:
        """The 95 % bootstrap interval of `faithfulness` over prompts (``few`` says where the prompts are too few)."""
        if self.undefined:
            return math.nan, math.nan
        rows = _resamples(len(self.clean), self.resamples, self.seed)
        low, high = _interval(faithfulness(self.patched[rows], self.clean[rows], self.corrupted[rows])).tolist()
        return low, high

    @property
    def few(self) -> str:
        """``"too few prompts for an interval: 3 < 10"`` (`MIN_INTERVAL_PROMPTS`), or ``""``."""
        return few_prompts(len(self.clean))

    @property
    def metrics(self) -> pd.DataFrame:
        """One row a prompt: the metric in the clean, counterfactual and patched passes."""
        return pd.DataFrame(
            {"clean": self.clean.numpy(), "corrupted": self.corrupted.numpy(), "patched": self.patched.numpy()}
        )

    def __repr__(self) -> str:
        about = "" if self.prompts is None else f"/{self.prompts.counterfactual}"
        part = "" if self.prompts is None or self.prompts.part == "all" else f", {self.prompts.part} part"
        if self.undefined:
            value = f"faithfulness undefined ({self.undefined})"
        else:
            low, high = self.interval
            value = f"faithfulness {self.faithfulness:.3f} [{low:.3f}, {high:.3f}]"
        few = f"; {self.few}" if self.few else ""
        return (
            f"CircuitEvaluation({self.circuit!r} on {self.task}{about}: {value}, {len(self.clean)} prompts{part}{few})"
        )

    def figures(self) -> dict[str, Any]:
        """``metrics``: each prompt's metric in the three passes."""
        from contribution_lens.drawing.circuit_figures import prompt_metrics_figure

        return {"metrics": prompt_metrics_figure(self.metrics, self.task)}

    def report(self, path: str | os.PathLike) -> Path:
        from contribution_lens.drawing import html

        return html.write_html(path, repr(self), [*self.figures().items(), ("Per prompt", self.metrics)])


def check_metrics(clean: Tensor, corrupted: Tensor, patched: Tensor, prompts: Prompts | None) -> None:
    """A result's per-prompt metrics against each other and its prompts (``patched``: ``[... prompt]``)."""
    n = clean.shape[-1] if clean.ndim == 1 else -1
    if clean.ndim != 1 or corrupted.shape != clean.shape or patched.shape[-1:] != clean.shape:
        raise ValueError(
            f"clean, corrupted and patched must hold one metric a prompt, got shapes {tuple(clean.shape)}, "
            f"{tuple(corrupted.shape)} and {tuple(patched.shape)}"
        )
    if prompts is not None and len(prompts) != n:
        raise ValueError(f"the prompts recorded are {len(prompts)}, the metrics {n}")


SELECTIONS = ("signed", "absolute")
"""The two circuits `circuit_curve` evaluates at each size, as MIB's two runs choose them: by signed score in the
direction that keeps the clean behaviour (its ``--absolute`` off, which its CPR is read from) and by ``|score|``
(``--absolute`` on, which its CMD is read from)."""


def mib_areas(
    signed: Float[Tensor, "*batch size"], absolute: Float[Tensor, "*batch size"], fractions: Float[Tensor, " size"]
) -> tuple[Tensor, Tensor, Tensor]:
    """CPR, CMD and the ``|score|`` selection's area under ``f``, from the two selections' faithfulness curves.

    ``CPR = area under f`` of the signed selection and ``CMD = area under |1 - f|`` of the ``|score|``
    selection, trapezoids over the fractions (MIB's ``area_under`` and ``area_from_1`` of
    ``evaluate_area_under_curve``, read from its runs with ``--absolute`` off and on by ``print_results.py``).

    Example:
        >>> import torch
        >>> fractions = torch.tensor([0.5, 1.0], dtype=torch.float64)
        >>> cpr, cmd, area = mib_areas(torch.tensor([1.5, 1.0]), torch.tensor([0.5, 1.0]), fractions)
        >>> round(float(cpr), 3), round(float(cmd), 3), round(float(area), 3)  # 0.5 * (1.5 + 1) / 2, ...
        (0.625, 0.125, 0.375)
    """
    cpr, _ = areas(signed, fractions)
    area, cmd = areas(absolute, fractions)
    return cpr, cmd, area


@dataclass(frozen=True)
class CircuitCurve(Saves):
    """Faithfulness of one method's circuits at each size and selection, with MIB's CPR and CMD.

    ``patched[s, k, p]``: prompt ``p``'s metric with the circuit of selection ``SELECTIONS[s]``
    (signed, ``|score|``) at ``fractions[k]`` kept; ``chosen[s, k]``: the edges (or nodes) that
    selection chose, ``edges[s, k]``: the edges of the circuit evaluated (after pruning, with
    ``prune``). ``scored`` and ``evaluated``: the prompts the scores came from and those evaluated
    (`contribution_lens.circuits.task.Prompts`); where they share prompts the curve is in-sample.
    """

    task: str
    method: str
    level: str
    fractions: Float[Tensor, " size"]
    clean: Float[Tensor, " prompt"]
    corrupted: Float[Tensor, " prompt"]
    patched: Float[Tensor, "selection size prompt"]
    chosen: Float[Tensor, "selection size"]
    edges: Float[Tensor, "selection size"]
    prune: bool = True
    greedy: bool = False
    scored: Prompts | None = None
    evaluated: Prompts | None = None
    seed: int = 0
    resamples: int = RESAMPLES

    def __post_init__(self) -> None:
        """Every field against the others: a curve built, merged or loaded from an edited file is checked alike."""
        if self.patched.ndim != 3 or self.patched.shape[0] != len(SELECTIONS):
            raise ValueError(
                f"patched must be [selection size prompt] with {len(SELECTIONS)} selections ({', '.join(SELECTIONS)}), "
                f"got {tuple(self.patched.shape)}"
            )
        sizes = (len(SELECTIONS), self.fractions.shape[0])
        if self.fractions.ndim != 1 or self.patched.shape[1] != sizes[1]:
            raise ValueError(f"fractions has shape {tuple(self.fractions.shape)}; patched {tuple(self.patched.shape)}")
        if tuple(self.chosen.shape) != sizes or tuple(self.edges.shape) != sizes:
            raise ValueError(
                f"chosen and edges must be [selection size] = {sizes}, got {tuple(self.chosen.shape)} and "
                f"{tuple(self.edges.shape)}"
            )
        check_metrics(self.clean, self.corrupted, self.patched, self.evaluated)
        shares = self.fractions.tolist()
        if shares != sorted(set(shares)) or not all(0 < share <= 1 for share in shares):
            raise ValueError(f"fractions must be distinct shares in (0, 1], sorted, got {shares}")
        if self.level not in LEVELS:
            raise ValueError(f"level must be 'edge' or 'node', got {self.level!r}")

    @classmethod
    def from_fields(cls, fields: dict[str, Any]) -> "CircuitCurve":
        """Rebuild a saved curve; one of the layout before MIB's selections is refused."""
        if "chosen" not in fields:
            raise ValueError(
                "this curve was saved by an earlier version, whose CPR chose circuits by absolute score "
                "(MIB's CPR chooses them by signed score): compute the curve again"
            )
        return cls(**fields)

    @property
    def counterfactual(self) -> str:
        """The counterfactual of the prompts evaluated (``"custom"`` where none was recorded)."""
        return "custom" if self.evaluated is None else self.evaluated.counterfactual

    @property
    def overlap(self) -> int | None:
        """How many evaluated prompts were also scored (None where either set was not recorded)."""
        if self.scored is None or self.evaluated is None:
            return None
        return self.scored.overlap(self.evaluated)

    @property
    def in_sample(self) -> bool | None:
        """Whether the circuits were evaluated on prompts they were scored on (None: not recorded)."""
        overlap = self.overlap
        return None if overlap is None else overlap > 0

    @property
    def undefined(self) -> str:
        """Why f, CPR and CMD are undefined (NaN), or ``""`` (`unmoved`)."""
        return unmoved(self.clean, self.corrupted)

    @property
    def few(self) -> str:
        """``"too few prompts for an interval: 3 < 10"`` (`MIN_INTERVAL_PROMPTS`), or ``""``."""
        return few_prompts(int(self.clean.shape[0]))

    @property
    def note(self) -> str:
        """What the numbers lack, in words (`undefined`, `few`), or ``""``: every table and report shows it."""
        return "; ".join(filter(None, (self.undefined and f"f undefined: {self.undefined}", self.few)))

    @property
    def faithfulness(self) -> Float[Tensor, "selection size"]:
        """f at each size, one row a selection (`SELECTIONS`: signed, then ``|score|``); NaN where `undefined`."""
        f = faithfulness(self.patched, self.clean, self.corrupted)
        return torch.full_like(f, math.nan) if self.undefined else f

    def _bootstrap(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """f ``[resample selection size]``, then CPR, CMD and the ``|score|`` area ``[resample]`` (NaN where
        `undefined`)."""
        rows = _resamples(self.clean.shape[0], self.resamples, self.seed)
        patched = einops.rearrange(
            self.patched[:, :, rows], "selection size resample prompt -> resample selection size prompt"
        )
        f = faithfulness(patched, self.clean[rows][:, None, None], self.corrupted[rows][:, None, None])
        if self.undefined:
            f = torch.full_like(f, math.nan)
        return f, *mib_areas(f[:, 0], f[:, 1], self.fractions.double())

    def _areas(self) -> tuple[Tensor, Tensor, Tensor]:
        f = self.faithfulness
        return mib_areas(f[0], f[1], self.fractions.double())

    @property
    def faithfulness_interval(self) -> Float[Tensor, "selection size 2"]:
        return _interval(self._bootstrap()[0])

    @property
    def cpr(self) -> float:
        """MIB's circuit performance ratio: the area under f of the signed selection's circuits (higher is better).

        Above 1 where circuits do the task better than the whole model (they leave out what works against it).
        """
        return float(self._areas()[0])

    @property
    def cmd(self) -> float:
        """MIB's circuit-model distance: the area under ``|1 - f|`` of the ``|score|`` selection (lower is better)."""
        return float(self._areas()[1])

    @property
    def absolute_area(self) -> float:
        """The area under f of the ``|score|`` selection's circuits (what this package called CPR before)."""
        return float(self._areas()[2])

    def _area_interval(self, which: int) -> tuple[float, float]:
        low, high = _interval(self._bootstrap()[which]).tolist()
        return low, high

    @property
    def cpr_interval(self) -> tuple[float, float]:
        return self._area_interval(1)

    @property
    def cmd_interval(self) -> tuple[float, float]:
        return self._area_interval(2)

    @property
    def absolute_area_interval(self) -> tuple[float, float]:
        return self._area_interval(3)

    @property
    def table(self) -> pd.DataFrame:
        """One row a selection and size: ``selection``, ``fraction``, ``chosen`` (edges or nodes the selection
        chose), ``edges`` (the circuit's edges as evaluated), ``faithfulness`` and its interval, and ``note``
        (what the numbers lack, `note`)."""
        f, interval = self.faithfulness, self.faithfulness_interval
        sizes = len(self.fractions)
        return pd.DataFrame(
            {
                "selection": [name for name in SELECTIONS for _ in range(sizes)],
                "fraction": self.fractions.repeat(len(SELECTIONS)).numpy(),
                "chosen": self.chosen.round().long().flatten().numpy(),  # counts, kept as float64 beside f
                "edges": self.edges.round().long().flatten().numpy(),
                "faithfulness": f.flatten().numpy(),
                "low": interval[..., 0].flatten().numpy(),
                "high": interval[..., 1].flatten().numpy(),
                "note": [self.note] * (len(SELECTIONS) * sizes),
            }
        )

    @property
    def samples(self) -> str:
        """Which prompts were scored and which evaluated: ``"scored on scoring (32), evaluated on evaluation (32)"``,
        and ``in-sample`` where they share prompts."""
        scored = "unrecorded prompts" if self.scored is None else self.scored.label
        evaluated = f"{self.clean.shape[0]} prompts" if self.evaluated is None else self.evaluated.label
        note = {True: ", in-sample", False: "", None: ", overlap unknown"}[self.in_sample]
        return f"scored on {scored}, evaluated on {evaluated}{note}"

    def __repr__(self) -> str:
        if self.undefined:
            values = f"CPR and CMD undefined ({self.undefined})"
        else:
            values = f"CPR {self.cpr:.3f}, CMD {self.cmd:.3f}, |score| area {self.absolute_area:.3f}"
        few = f"; {self.few}" if self.few else ""
        return (
            f"CircuitCurve({self.method} on {self.task}/{self.counterfactual}, {self.level} level: {values}; "
            f"{self.samples}{few})"
        )

    def figure_table(self) -> pd.DataFrame:
        """`table` as `figures` draws it: ``method`` names the method and selection with its area (``"eap, signed
        (CPR 1.22)"``), ``size`` the circuit's edges as evaluated."""
        labels = {
            "signed": f"{self.method}, signed (CPR {self.cpr:.2f})",
            "absolute": f"{self.method}, |score| (CMD {self.cmd:.2f})",
        }
        return self.table.assign(method=lambda t: t["selection"].map(labels), size=lambda t: t["edges"])

    def figures(self) -> dict[str, Any]:
        """``faithfulness``: f against the fraction kept (log axis), each selection with its interval (signed: the
        circuits of MIB's CPR; ``|score|``: those of its CMD)."""
        from contribution_lens.drawing.circuit_figures import faithfulness_figure

        title = f"Faithfulness of circuits on {self.task}/{self.counterfactual}"
        return {"faithfulness": faithfulness_figure(self.figure_table(), title=title)}

    def report(self, path: str | os.PathLike) -> Path:
        from contribution_lens.drawing import html

        sections = [*self.figures().items(), ("Faithfulness by selection and size", self.table)]
        return html.write_html(path, repr(self), sections)


def _check_circuit(model: Model, circuit: Any) -> None:
    if not isinstance(circuit, Circuit):
        raise ValueError(f"circuit must be a Circuit, got {type(circuit).__name__}")
    graph = circuit_graph(model, circuit.graph.counting)
    if circuit.graph != graph:
        raise ValueError(f"circuit: its graph {circuit.graph} is not this model's {graph}")


@dataclass
class _Batch:
    """One batch's counterfactual recording, clean and counterfactual metrics, and the memory its patched passes
    write in (``work``, shaped as ``record``; ``buffers``, the sums')."""

    rows: Tensor
    record: Tensor
    clean: Tensor
    corrupted: Tensor
    work: Tensor
    buffers: dict[Any, Tensor]
    skip_idle: bool
    """Whether the patched passes may skip the MLPs and heads a circuit leaves idle (`ic.active_writers`)."""


def _recorded_batches(model: Model, task: Task, size: int) -> Iterator[_Batch]:
    """The task's batches of ``size`` prompts, each recorded once for every patched pass it serves.

    Each batch's recording and differences take the memory of the batch before, and its sums the same
    buffers: a fresh tensor of this size costs, on a CPU, as much in page faults as writing it.
    """
    graph = circuit_graph(model)
    record: Tensor | None = None
    work: Tensor | None = None
    buffers = dict[Any, Tensor]()
    skip_idle = not hidden_bias_path(model)
    for rows in ic.batches(task, size):
        record, corrupted = ic.record(model, task, graph, rows, corrupted=True, storage=record)
        work = ic.reused(work, tuple(record.shape), record)
        clean = ic.patched_metric(model, task, rows, ic.Null())
        yield _Batch(rows, record, clean, corrupted, work, buffers, skip_idle)


def _patched(model: Model, task: Task, batch: _Batch, circuit: Circuit) -> Tensor:
    """The metric with ``circuit`` kept; ``batch.work`` is overwritten with the differences (the recording is not)."""
    patch = circuit.patch().to(batch.record.device)
    stream = ic.Interchange(
        circuit.graph, batch.work, patch, corrupted=batch.record, buffers=batch.buffers, skip_idle=batch.skip_idle
    )
    return ic.patched_metric(model, task, batch.rows, stream)


def evaluate_circuit(
    model: Model, task: Task, circuit: Circuit, *, memory: int = DEFAULT_MEMORY, seed: int = 0
) -> CircuitEvaluation:
    """The task's metric per prompt with ``circuit`` kept clean and every other edge patched (three passes a prompt).

    Everything is checked before any pass (`contribution_lens.circuits.checks`); where the counterfactual
    does not move the metric, f is undefined: a warning says so, and the result's repr.
    """
    check_task(model, task)
    _check_circuit(model, circuit)
    memory, seed = check_memory(memory), check_seed(seed)
    results: list[list[Tensor]] = [[], [], []]
    size = ic.batch_size(task, len(circuit.graph.writers), int(model.cfg.d_model), 2.0, memory)
    for batch in _recorded_batches(model, task, size):
        patched = _patched(model, task, batch, circuit)
        for kept, value in zip(results, (batch.clean, batch.corrupted, patched), strict=True):
            kept.append(value.cpu())
    clean, corrupted, patched = (torch.cat(parts) for parts in results)
    _warn_unmoved(clean, corrupted, task)
    return CircuitEvaluation(task.name, circuit, clean, corrupted, patched, seed, prompts=task.prompts)


def _warn_unmoved(clean: Tensor, corrupted: Tensor, task: Task) -> None:
    reason = unmoved(clean, corrupted)
    if reason:
        warnings.warn(f"task {task.name!r}: faithfulness is undefined: {reason}", UserWarning, stacklevel=3)


def circuit_curve(
    model: Model,
    task: Task,
    scores: CircuitScores,
    level: str = "edge",
    *,
    fractions: tuple[float, ...] = FRACTIONS,
    prune: bool = True,
    greedy: bool | None = None,
    memory: int = DEFAULT_MEMORY,
    seed: int = 0,
) -> CircuitCurve:
    """Faithfulness of ``scores``' circuits at MIB's ten sizes, by signed score and by ``|score|``: CPR and CMD.

    At each fraction ``x`` both selections (`SELECTIONS`) keep ``int(x * n)`` of the ``n`` edges (or
    nodes), as `CircuitScores.circuit` chooses them with ``absolute`` off and on. ``prune``: drop the
    edges on no path from an embedding to the logits (MIB always prunes; f is the same up to float
    error except where a post-attention norm mixes a layer's heads; the edge counts are not).
    ``greedy``: greedy selection from the logits (edges only); None: the method's own (MIB's choice).

    One counterfactual and one clean pass a batch, then one patched pass a distinct circuit: a
    circuit both selections choose runs once (non-negative scores choose the same), and an empty
    circuit is the counterfactual's pass and the full one the clean pass (neither runs again).
    The scores' prompts and the task's are compared (`Task.fingerprints`): a curve evaluated on
    prompts it was scored on says it is in-sample. ``fractions`` are sorted for you; they must hold 1
    and at least one other size (`contribution_lens.circuits.checks.check_fractions`). Every argument
    is checked before any pass, scores of prompts of another tokenizer refused.
    """
    check_task(model, task)
    if not isinstance(scores, CircuitScores):
        raise ValueError(f"scores must be CircuitScores, got {type(scores).__name__}")
    check_tokenizer(model, None if scores.prompts is None else scores.prompts.tokenizer, "scores")
    level, fractions = check_level(level), check_fractions(fractions)
    memory, seed = check_memory(memory), check_seed(seed)
    prune = bool(check_switch(prune, "prune"))
    orders = [scores.ranking(level, absolute=name == "absolute", greedy=greedy) for name in SELECTIONS]
    counts = [int(fraction * len(orders[0])) for fraction in fractions]
    circuits = [
        [
            scores.circuit_of(order[:count], level, fraction, prune=prune)
            for count, fraction in zip(counts, fractions, strict=True)
        ]
        for order in orders
    ]
    _check_circuit(model, circuits[0][0])
    distinct: dict[bytes, int] = {}
    index = [[distinct.setdefault(c.kept.numpy().tobytes(), len(distinct)) for c in row] for row in circuits]
    unique = {
        number: circuit
        for row, numbers in zip(circuits, index, strict=True)
        for circuit, number in zip(row, numbers, strict=True)
    }
    size = ic.batch_size(task, len(scores.graph.writers), int(model.cfg.d_model), 2.0, memory)
    parts: list[tuple[Tensor, Tensor, Tensor]] = []
    for batch in _recorded_batches(model, task, size):  # every circuit's pass writes in one batch's memory
        metrics = [_size_metric(model, task, batch, unique[number]).cpu() for number in range(len(unique))]
        patched = torch.stack([torch.stack([metrics[number] for number in row]) for row in index])
        parts.append((batch.clean.cpu(), batch.corrupted.cpu(), patched))
    chosen = torch.tensor([counts] * len(SELECTIONS), dtype=torch.float64)
    edges = torch.tensor([[float(c.kept.sum()) for c in row] for row in circuits], dtype=torch.float64)
    _warn_unmoved(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), task)
    return CircuitCurve(
        task.name,
        scores.method,
        level,
        torch.tensor(fractions, dtype=torch.float64),
        torch.cat([p[0] for p in parts]),
        torch.cat([p[1] for p in parts]),
        torch.cat([p[2] for p in parts], dim=2),
        chosen,
        edges,
        prune,
        level == "edge" and (scores.greedy if greedy is None else bool(greedy)),
        scores.prompts,
        task.prompts,
        seed,
    )


def _size_metric(model: Model, task: Task, batch: _Batch, circuit: Circuit) -> Tensor:
    if circuit.level == "edge" and bool(circuit.kept.all()):
        return batch.clean
    patch = circuit.patch()
    if not bool(patch.any()):
        return batch.clean
    if bool(patch.sum() == circuit.graph.valid.sum()):
        return batch.corrupted
    return _patched(model, task, batch, circuit)
