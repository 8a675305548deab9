"""A circuit's faithfulness as MIB measures it: `evaluate_circuit` and `circuit_curve`.

With ``m(C)`` the task's metric averaged over prompts in the pass that keeps the circuit ``C``'s
edges clean and patches every other edge with the counterfactual (`contribution_lens.circuits.interchange`),
``M`` the whole model (the clean pass) and ``∅`` the empty circuit (the counterfactual's pass),

    f(C) = (m(C) - m(∅)) / (m(M) - m(∅)).

The curve evaluates the circuits of a `CircuitScores` at ``0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50``
and ``100 %`` of the edges (or nodes); its CPR is the area under ``f`` and its CMD the area under
``|1 - f|``, by trapezoids over the fraction (MIB's ``evaluate_area_under_curve``). Intervals are
percentile bootstraps over prompts (each resample recomputes every mean).

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

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from contribution_lens.adapter import Model, hidden_bias_path
from contribution_lens.circuits import interchange as ic
from contribution_lens.circuits.graph import circuit_graph
from contribution_lens.circuits.registry import DEFAULT_MEMORY
from contribution_lens.circuits.scoring import Circuit, CircuitScores, check_level, check_task
from contribution_lens.circuits.task import Task
from contribution_lens.files import Saves

FRACTIONS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
"""MIB's circuit sizes: the share of edges (or nodes) kept."""
RESAMPLES = 1000


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

    @property
    def faithfulness(self) -> float:
        return float(faithfulness(self.patched, self.clean, self.corrupted))

    @property
    def interval(self) -> tuple[float, float]:
        """The 95 % bootstrap interval of `faithfulness` over prompts."""
        rows = _resamples(len(self.clean), self.resamples, self.seed)
        low, high = _interval(faithfulness(self.patched[rows], self.clean[rows], self.corrupted[rows])).tolist()
        return low, high

    @property
    def metrics(self) -> pd.DataFrame:
        """One row a prompt: the metric in the clean, counterfactual and patched passes."""
        return pd.DataFrame(
            {"clean": self.clean.numpy(), "corrupted": self.corrupted.numpy(), "patched": self.patched.numpy()}
        )

    def __repr__(self) -> str:
        low, high = self.interval
        return (
            f"CircuitEvaluation({self.circuit!r} on {self.task}: faithfulness {self.faithfulness:.3f} "
            f"[{low:.3f}, {high:.3f}], {len(self.clean)} prompts)"
        )

    def figures(self) -> dict[str, Any]:
        """``metrics``: each prompt's metric in the three passes."""
        from contribution_lens.drawing.circuit_figures import prompt_metrics_figure

        return {"metrics": prompt_metrics_figure(self.metrics, self.task)}

    def report(self, path: str | os.PathLike) -> Path:
        from contribution_lens.drawing import html

        return html.write_html(path, repr(self), [*self.figures().items(), ("Per prompt", self.metrics)])


@dataclass(frozen=True)
class CircuitCurve(Saves):
    """Faithfulness of one method's circuits at each size, with CPR and CMD (MIB's circuit-localisation scores)."""

    task: str
    method: str
    level: str
    fractions: Float[Tensor, " size"]
    sizes: Float[Tensor, " size"]
    clean: Float[Tensor, " prompt"]
    corrupted: Float[Tensor, " prompt"]
    patched: Float[Tensor, "size prompt"]
    seed: int = 0
    resamples: int = RESAMPLES

    @property
    def faithfulness(self) -> Float[Tensor, " size"]:
        return faithfulness(self.patched, self.clean, self.corrupted)

    def _bootstrap(self) -> tuple[Tensor, Tensor, Tensor]:
        rows = _resamples(self.clean.shape[0], self.resamples, self.seed)
        f = faithfulness(
            self.patched[:, rows].transpose(0, 1), self.clean[rows][:, None], self.corrupted[rows][:, None]
        )
        cpr, cmd = areas(f, self.fractions.double())
        return f, cpr, cmd

    @property
    def faithfulness_interval(self) -> Float[Tensor, "size 2"]:
        return _interval(self._bootstrap()[0])

    @property
    def cpr(self) -> float:
        """Circuit performance ratio: the area under ``f`` over the fraction (higher is better)."""
        return float(areas(self.faithfulness, self.fractions.double())[0])

    @property
    def cmd(self) -> float:
        """Circuit-model distance: the area under ``|1 - f|`` over the fraction (lower is better)."""
        return float(areas(self.faithfulness, self.fractions.double())[1])

    @property
    def cpr_interval(self) -> tuple[float, float]:
        low, high = _interval(self._bootstrap()[1]).tolist()
        return low, high

    @property
    def cmd_interval(self) -> tuple[float, float]:
        low, high = _interval(self._bootstrap()[2]).tolist()
        return low, high

    @property
    def table(self) -> pd.DataFrame:
        """One row a size: ``fraction``, ``size`` (edges or nodes kept), ``faithfulness`` and its interval."""
        interval = self.faithfulness_interval
        return pd.DataFrame(
            {
                "fraction": self.fractions.numpy(),
                "size": self.sizes.numpy(),
                "faithfulness": self.faithfulness.numpy(),
                "low": interval[:, 0].numpy(),
                "high": interval[:, 1].numpy(),
            }
        )

    def __repr__(self) -> str:
        return (
            f"CircuitCurve({self.method} on {self.task}, {self.level} level: CPR {self.cpr:.3f}, CMD {self.cmd:.3f}, "
            f"{self.clean.shape[0]} prompts)"
        )

    def figures(self) -> dict[str, Any]:
        """``faithfulness``: f against the fraction kept (log axis), with its interval."""
        from contribution_lens.drawing.circuit_figures import faithfulness_figure

        name = f"{self.method} (CPR {self.cpr:.2f}, CMD {self.cmd:.2f})"
        figure = faithfulness_figure(self.table.assign(method=name), title=f"Faithfulness of circuits on {self.task}")
        return {"faithfulness": figure}

    def report(self, path: str | os.PathLike) -> Path:
        from contribution_lens.drawing import html

        return html.write_html(path, repr(self), [*self.figures().items(), ("Faithfulness by size", self.table)])


def _check_circuit(model: Model, circuit: Any) -> None:
    if not isinstance(circuit, Circuit):
        raise ValueError(f"circuit must be a Circuit, got {type(circuit).__name__}")
    graph = circuit_graph(model)
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
    """The task's metric per prompt with ``circuit`` kept clean and every other edge patched (three passes a prompt)."""
    check_task(model, task)
    _check_circuit(model, circuit)
    results: list[list[Tensor]] = [[], [], []]
    size = ic.batch_size(task, len(circuit.graph.writers), int(model.cfg.d_model), 2.0, memory)
    for batch in _recorded_batches(model, task, size):
        patched = _patched(model, task, batch, circuit)
        for kept, value in zip(results, (batch.clean, batch.corrupted, patched), strict=True):
            kept.append(value.cpu())
    clean, corrupted, patched = (torch.cat(parts) for parts in results)
    return CircuitEvaluation(task.name, circuit, clean, corrupted, patched, seed)


def circuit_curve(
    model: Model,
    task: Task,
    scores: CircuitScores,
    level: str = "edge",
    *,
    fractions: tuple[float, ...] = FRACTIONS,
    memory: int = DEFAULT_MEMORY,
    seed: int = 0,
) -> CircuitCurve:
    """Faithfulness of ``scores``' circuits at each fraction (MIB's ten sizes), CPR and CMD.

    One counterfactual and one clean pass a batch, then one patched pass a size (an empty circuit
    is the counterfactual's pass and the full one the clean pass: neither runs again).
    """
    check_task(model, task)
    level = check_level(level)
    circuits = [scores.circuit(fraction, level) for fraction in fractions]
    _check_circuit(model, circuits[0])
    size = ic.batch_size(task, len(scores.graph.writers), int(model.cfg.d_model), 2.0, memory)
    parts: list[tuple[Tensor, Tensor, Tensor]] = []
    for batch in _recorded_batches(model, task, size):  # every size's passes write in one batch's memory
        patched = [_size_metric(model, task, batch, circuit) for circuit in circuits]
        parts.append((batch.clean.cpu(), batch.corrupted.cpu(), torch.stack(patched).cpu()))
    counts = [len(c.chosen) if level == "node" else int(c.kept.sum()) for c in circuits]
    return CircuitCurve(
        task.name,
        scores.method,
        level,
        torch.tensor(fractions, dtype=torch.float64),
        torch.tensor(counts, dtype=torch.float64),
        torch.cat([p[0] for p in parts]),
        torch.cat([p[1] for p in parts]),
        torch.cat([p[2] for p in parts], dim=1),
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
