"""How much a circuit depends on its prompts: `circuit_stability` re-scores resamples of a task's prompts.

A circuit is an estimate from a finite set of prompts, and another set of prompts from the same
task gives another circuit (Méloux, Portet and Peyrard 2025, "Mechanistic Interpretability as
Statistical Estimation: A Variance Analysis of EAP-IG", arXiv 2510.00845, found EAP-IG's circuits
varying widely under resampling of the input prompts, and ask for stability to be reported). Here
the method scores ``R`` resamples of the task's ``n`` prompts, and the circuits at each size are
compared with the Jaccard index ``J(A, B) = |A ∩ B| / |A ∪ B|`` (edges at edge level, heads and MLPs
at node level):

* ``jaccard``: the mean over the ``R (R - 1) / 2`` pairs of resamples. Under the bootstrap principle
  two resamples of the ``n`` prompts stand for two independent sets of ``n`` prompts of the task, so
  this is the overlap two studies of the same size would find; no resample is privileged.
* ``jaccard_to_full``: each resample's circuit against the circuit of all ``n`` prompts (the
  plug-in estimate of the task's circuit): how close an ``n``-prompt circuit is to its task's.

Their intervals are the 2.5 and 97.5 percentiles of the pairs' (resamples') overlaps: the range an
overlap falls in, not a confidence interval of the mean. ``chance`` is the expected Jaccard index of
two circuits of the same size ``k`` drawn uniformly from the ``N`` edges (nodes): with ``X`` their
shared count, hypergeometric (``N``, ``k``, ``k``), ``E[X / (2k - X)]``. ``frequency`` is each edge's
(node's) share of the resamples whose circuit holds it.

**Resampling.** ``sampling="bootstrap"`` (the default) draws ``n`` of the ``n`` prompts with
replacement (Efron 1979): a resample has the task's size, so the variability measured is that of
an ``n``-prompt circuit, the one a study reports. ``sampling="subsample"`` draws ``n // 2`` without
replacement, the half-samples of stability selection (Meinshausen and Bühlmann 2010): no prompt
counts twice, but each circuit comes from half the prompts, so it measures a smaller study and
overstates the instability of the ``n``-prompt circuit (the variance of a mean score doubles).

**Cost**: ``R + 1`` scorings (each resample and all prompts), each the method's passes over
``n`` prompts (``n // 2`` subsampled): ``(R + 1)`` times the method's forward-pass equivalents a
prompt, per prompt of the task (EAP: about 3, so 63 at ``R = 20``). The circuits are chosen with
`CircuitScores.circuit` and compared without any further pass.

Example (``cl.circuit_stability(model, task, method="eap")`` makes such a result; here one is made by hand):
    >>> import torch
    >>> from contribution_lens.circuits.graph import Graph
    >>> graph = Graph(n_layers=1, n_heads=1, n_kv_heads=1, pos_embed=False)
    >>> kept = torch.zeros(3, 1, len(graph.edges), dtype=torch.bool)  # three resamples, one size
    >>> kept[0, 0, [0, 1]] = kept[1, 0, [1, 2]] = kept[2, 0, [0, 1]] = True
    >>> result = CircuitStability("demo", "eap", "edge", "bootstrap", graph, torch.tensor([0.25]), kept[0], kept,
    ...                           torch.zeros(3, 4, dtype=torch.long), n_prompts=4)
    >>> round(float(result.jaccard[0]), 4), result.to_full[:, 0].tolist()  # pairs 1/3, 1/3, 1
    (0.5556, [1.0, 0.3333333333333333, 1.0])
"""

import dataclasses
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor
from tqdm.auto import tqdm

from contribution_lens.adapter import Model
from contribution_lens.circuits.evaluation import FRACTIONS
from contribution_lens.circuits.graph import Graph, circuit_graph
from contribution_lens.circuits.registry import DEFAULT_MEMORY, get_circuit_method
from contribution_lens.circuits.resampling import check_memory, check_steps, percentile_interval
from contribution_lens.circuits.scoring import CircuitScores, check_fraction, check_level, check_task, circuit_scores
from contribution_lens.circuits.task import Task
from contribution_lens.files import Saves


def _bootstrap(n: int, resamples: int, generator: torch.Generator) -> Tensor:
    return torch.randint(0, n, (resamples, n), generator=generator)


def _subsample(n: int, resamples: int, generator: torch.Generator) -> Tensor:
    return torch.stack([torch.randperm(n, generator=generator)[: n // 2] for _ in range(resamples)])


SAMPLINGS: dict[str, Callable[[int, int, torch.Generator], Tensor]] = {"bootstrap": _bootstrap, "subsample": _subsample}
"""How resamples draw their prompts (module docstring): ``bootstrap``, ``n`` of the ``n`` with replacement;
``subsample``, ``n // 2`` without. Each maps ``(n, resamples, generator)`` to the rows ``[resample draw]``."""


def chance_jaccard(n: int, k: int) -> float:
    """The expected Jaccard index of two independent uniformly random ``k``-subsets of ``n`` items.

    Their intersection ``X`` is hypergeometric: ``P(X = x) = C(k, x) C(n - k, k - x) / C(n, k)``, and
    ``J = X / (2k - X)``. NaN for ``k = 0`` (two empty sets).

    Example:
        >>> chance_jaccard(4, 2)  # x = 0, 1, 2 with probabilities 1/6, 4/6, 1/6: J = 0, 1/3, 1
        0.3888888888888889
        >>> chance_jaccard(10, 10)
        1.0
    """
    if k == 0:
        return math.nan
    x = torch.arange(max(0, 2 * k - n), k + 1, dtype=torch.float64)
    log_p = _log_comb(k, x) + _log_comb(n - k, k - x) - _log_comb(n, torch.tensor(float(k), dtype=torch.float64))
    return float((log_p.exp() * x / (2 * k - x)).sum())


def _log_comb(n: int, x: Tensor) -> Tensor:
    return torch.lgamma(torch.tensor(n + 1.0, dtype=torch.float64)) - torch.lgamma(x + 1) - torch.lgamma(n - x + 1)


def pairwise_jaccard(kept: Bool[Tensor, "set item"], other: Bool[Tensor, "other item"]) -> Float[Tensor, "set other"]:
    """``|A ∩ B| / |A ∪ B|`` of every row of ``kept`` with every row of ``other`` (NaN where both are empty)."""
    a, b = kept.double(), other.double()
    inter = a @ b.T
    union = a.sum(1)[:, None] + b.sum(1)[None, :] - inter
    return torch.where(union > 0, inter / union.clamp_min(1), torch.full_like(inter, math.nan))


@dataclass(frozen=True)
class CircuitStability(Saves):
    """One method's circuits of resamples of a task's prompts, at each size, beside the circuit of all of them.

    ``full[s]``: the circuit of every prompt at ``fractions[s]``; ``kept[r, s]``: resample ``r``'s; an item
    is an edge (``level="edge"``, in `Graph.edges` order) or a head or MLP (``"node"``, `Graph.components`).
    ``rows[r]``: the prompts resample ``r`` drew.
    """

    task: str
    method: str
    level: str
    sampling: str
    graph: Graph
    fractions: Float[Tensor, " size"]
    full: Bool[Tensor, "size item"]
    kept: Bool[Tensor, "resample size item"]
    rows: Int[Tensor, "resample draw"]
    n_prompts: int
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kept.shape[1:] != self.full.shape or self.full.shape[0] != len(self.fractions):
            raise ValueError(
                f"kept {tuple(self.kept.shape)}, full {tuple(self.full.shape)} and fractions "
                f"{tuple(self.fractions.shape)} disagree"
            )

    @property
    def items(self) -> list[str]:
        """The names of what circuits hold: edges (edge level) or heads and MLPs (node level)."""
        return self.graph.edges if self.level == "edge" else self.graph.components

    @property
    def sizes(self) -> Float[Tensor, " size"]:
        """Items in the circuit of all prompts at each fraction."""
        return self.full.sum(1).double()

    @property
    def pairwise(self) -> Float[Tensor, "pair size"]:
        """The Jaccard index of every pair of resamples (``r < r'``) at each size."""
        resamples = self.kept.shape[0]
        upper = torch.triu_indices(resamples, resamples, offset=1)
        per_size = [pairwise_jaccard(self.kept[:, s], self.kept[:, s])[upper[0], upper[1]] for s in range(len(self))]
        return torch.stack(per_size, dim=1)

    @property
    def jaccard(self) -> Float[Tensor, " size"]:
        """The mean Jaccard index over pairs of resamples at each size (module docstring)."""
        return self.pairwise.nanmean(0)

    @property
    def jaccard_interval(self) -> Float[Tensor, "size 2"]:
        """The 2.5 and 97.5 percentiles of the pairs' Jaccard indices at each size."""
        return percentile_interval(self.pairwise)

    @property
    def to_full(self) -> Float[Tensor, "resample size"]:
        """Each resample's Jaccard index with the circuit of all prompts, at each size."""
        per_size = [pairwise_jaccard(self.kept[:, s], self.full[s : s + 1])[:, 0] for s in range(len(self))]
        return torch.stack(per_size, dim=1)

    @property
    def jaccard_to_full(self) -> Float[Tensor, " size"]:
        return self.to_full.nanmean(0)

    @property
    def jaccard_to_full_interval(self) -> Float[Tensor, "size 2"]:
        return percentile_interval(self.to_full)

    @property
    def chance(self) -> Float[Tensor, " size"]:
        """The expected Jaccard index of two uniformly random circuits of the full circuit's size (`chance_jaccard`)."""
        n = self.full.shape[1]
        return torch.tensor([chance_jaccard(n, int(k)) for k in self.sizes.tolist()], dtype=torch.float64)

    @property
    def frequency(self) -> Float[Tensor, "size item"]:
        """Each item's share of the resamples whose circuit holds it, at each size."""
        return self.kept.double().mean(0)

    def __len__(self) -> int:
        return len(self.fractions)

    @property
    def table(self) -> pd.DataFrame:
        """One row a size: ``fraction``, ``size``, ``jaccard`` (pairs of resamples) with ``low`` and ``high``,
        ``to_full`` (each resample against all prompts) with its own, and ``chance``."""
        pairs, full = self.jaccard_interval, self.jaccard_to_full_interval
        return pd.DataFrame(
            {
                "fraction": self.fractions.double().numpy(),
                "size": self.sizes.numpy(),
                "jaccard": self.jaccard.numpy(),
                "low": pairs[:, 0].numpy(),
                "high": pairs[:, 1].numpy(),
                "to_full": self.jaccard_to_full.numpy(),
                "to_full_low": full[:, 0].numpy(),
                "to_full_high": full[:, 1].numpy(),
                "chance": self.chance.numpy(),
            }
        )

    def inclusion(self, fraction: float | None = None) -> pd.DataFrame:
        """One row an item in some resample's circuit (or the full one) at ``fraction`` (by default the size
        nearest 1 %): ``item``, ``frequency`` (share of resamples), ``in_full``; most frequent first."""
        s = self._size(fraction)
        frequency = self.frequency[s]
        shown = torch.nonzero((frequency > 0) | self.full[s])[:, 0]
        names = self.items
        table = pd.DataFrame(
            {
                "item": [names[i] for i in shown.tolist()],
                "frequency": frequency[shown].numpy(),
                "in_full": self.full[s, shown].numpy(),
            }
        )
        return table.sort_values(["frequency", "in_full"], ascending=False, kind="stable").reset_index(drop=True)

    def _size(self, fraction: float | None) -> int:
        if fraction is None:
            return int((self.fractions.double().log() - math.log(0.01)).abs().argmin())
        matches = torch.nonzero((self.fractions.double() - fraction).abs() < 1e-12)[:, 0]
        if len(matches) == 0:
            raise ValueError(f"fraction: {fraction!r} is not one of this result's {self.fractions.tolist()}")
        return int(matches[0])

    def __repr__(self) -> str:
        s = self._size(None)
        low, high = self.jaccard_interval[s].tolist()
        return (
            f"CircuitStability({self.method} on {self.task}, {self.level} level, {self.kept.shape[0]} "
            f"{self.sampling} resamples of {self.n_prompts} prompts: Jaccard {float(self.jaccard[s]):.3f} "
            f"[{low:.3f}, {high:.3f}] at {100 * float(self.fractions[s]):g} % (chance {float(self.chance[s]):.3f}))"
        )

    def figures(self) -> dict[str, Any]:
        """``jaccard``: the overlap against the circuit's size, with chance; ``frequency``: how often the most
        frequent items are in a resample's circuit, at the size nearest 1 %."""
        from contribution_lens.drawing.circuit_check_figures import frequency_figure, stability_figure

        return {"jaccard": stability_figure(self), "frequency": frequency_figure(self)}

    def report(self, path: str | os.PathLike) -> Path:
        from contribution_lens.drawing import html

        sections: list[Any] = [*self.figures().items(), ("Overlap by size", self.table)]
        sections.append(("The most frequent items at the size nearest 1 %", self.inclusion().head(50)))
        return html.write_html(path, repr(self), sections)


def prompts(task: Task, rows: Tensor) -> Task:
    """The task of prompts ``rows`` (repeats allowed): every per-prompt tensor field indexed, the rest kept."""
    picked: dict[str, Any] = {
        field.name: value[rows]
        for field in dataclasses.fields(task)
        if isinstance(value := getattr(task, field.name), Tensor) and value.shape[:1] == (len(task),)
    }
    return dataclasses.replace(task, **picked)


def circuits_of(scores: CircuitScores, fractions: Sequence[float], level: str) -> Bool[Tensor, "size item"]:
    """Which items the circuit of ``scores`` holds at each fraction (`CircuitScores.circuit`)."""
    rows = []
    for fraction in fractions:
        circuit = scores.circuit(fraction, level)
        if level == "edge":
            rows.append(circuit.kept)
        else:
            chosen = set(circuit.chosen)
            rows.append(torch.tensor([name in chosen for name in scores.graph.components]))
    return torch.stack(rows)


def _check(model: Model, task: Task, method: str, level: str, options: dict[str, Any]) -> tuple[float, ...]:
    """Refuse every bad argument before any pass; the fractions, sorted."""
    chosen = get_circuit_method(method)
    check_task(model, task)
    check_level(level)
    if level == "edge" and chosen.level == "node":
        raise ValueError(f"level: {chosen.name!r} scores nodes only; ask for level='node'")
    resamples = options["resamples"]
    if isinstance(resamples, bool) or not isinstance(resamples, int) or resamples < 2:
        raise ValueError(
            f"resamples must be an integer of at least 2 (pairs of resamples are compared), got {resamples!r}"
        )
    if options["sampling"] not in SAMPLINGS:
        raise ValueError(f"sampling must be one of {', '.join(SAMPLINGS)}, got {options['sampling']!r}")
    if len(task) < 2:
        raise ValueError(f"task: resampling needs at least 2 prompts, got {len(task)}")
    fractions = options["fractions"]
    if isinstance(fractions, str | bytes) or not isinstance(fractions, Sequence) or not fractions:
        raise ValueError(f"fractions must be a non-empty sequence of numbers in (0, 1], got {fractions!r}")
    checked = sorted({check_fraction(fraction) for fraction in fractions})
    if isinstance(options["seed"], bool) or not isinstance(options["seed"], int):
        raise ValueError(f"seed must be an integer (resample r is scored with seed + 1 + r), got {options['seed']!r}")
    check_steps(options["steps"])
    check_memory(options["memory"])
    return tuple(checked)


def circuit_stability(
    model: Model,
    task: Task,
    method: str = "eap",
    level: str = "edge",
    *,
    resamples: int = 20,
    fractions: Sequence[float] = FRACTIONS,
    sampling: str = "bootstrap",
    seed: int = 0,
    steps: int = 5,
    memory: int = DEFAULT_MEMORY,
    progress: bool = True,
) -> CircuitStability:
    """Score ``resamples`` resamples of ``task``'s prompts and all of them with ``method``; compare the circuits.

    Resample ``r`` draws its prompts from a generator seeded by ``seed`` and is scored with seed
    ``seed + 1 + r`` (so a method that draws, the random control, draws anew); all prompts with
    ``seed``. ``steps`` and ``memory`` are `circuit_scores`'s. Cost: ``resamples + 1`` scorings
    (module docstring); ``progress`` shows a bar (tqdm). Every argument is checked before any pass.
    """
    options = {"resamples": resamples, "sampling": sampling, "fractions": fractions}
    chosen = _check(model, task, method, level, {**options, "seed": seed, "steps": steps, "memory": memory})
    rows = SAMPLINGS[sampling](len(task), resamples, torch.Generator().manual_seed(seed))
    kept = []
    bar = tqdm(total=resamples + 1, desc=f"stability of {method}", unit="scoring", disable=not progress)
    with bar:
        full_scores = circuit_scores(model, task, method, memory=memory, seed=seed, steps=steps)
        full = circuits_of(full_scores, chosen, level)
        bar.update()
        for r in range(resamples):
            scores = circuit_scores(
                model, prompts(task, rows[r]), method, memory=memory, seed=seed + 1 + r, steps=steps
            )
            kept.append(circuits_of(scores, chosen, level))
            bar.update()
    return CircuitStability(
        task.name,
        full_scores.method,
        level,
        sampling,
        circuit_graph(model),
        torch.tensor(chosen, dtype=torch.float64),
        full,
        torch.stack(kept),
        rows,
        len(task),
        seed,
    )
