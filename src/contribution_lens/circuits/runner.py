"""A circuit run: every method's scores and faithfulness curves on one task, kept method by method.

`run_circuits` scores the task with each circuit method (`circuit_scores`), then evaluates the
circuits those scores choose at MIB's ten sizes, per level (`circuit_curve`). Layout of ``out``:

* ``config.json`` -- the model, the task and its size, the seed and the steps: a resumed run must match;
* ``{method}/circuit_scores.safetensors`` -- the method's `CircuitScores` (over every prompt);
* ``{method}/curve-{level}.safetensors`` -- its `CircuitCurve` at that level (``edge`` or ``node``; a
  method that scores nodes only has no edge level);
* ``{method}/timing.json`` -- seconds of the scoring and of each curve, beside the seconds of one
  plain clean forward pass of the same prompts timed in the same run: their ratio is the cost in
  forward-pass equivalents per prompt;
* ``circuits.csv`` -- one row a method and level: CPR and CMD with their 95 % bootstrap intervals,
  the planned passes and the measured cost (`circuit_table`);
* ``report.html`` -- the table, the model's accuracy on the task and every method's curve per level.

A finished method's files are never rewritten: a killed run continues with the first method or
level that has no file. Under ``torchrun --nproc_per_node N`` rank ``r`` takes prompts
``r, r + N, ...``; each rank's scores are kept as a part file, every rank merges them (the mean over
prompts, weighted by each part's prompts) before the curves, and rank 0 puts the curves' per-prompt
metrics back in prompt order: the merged result is the single-process one up to float32 rounding.
"""

import json
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from contribution_lens import adapter
from contribution_lens.circuits.attribution import GRADIENT_COPIES
from contribution_lens.circuits.contribution import COPIES as CONTRIBUTION_COPIES
from contribution_lens.circuits.evaluation import FRACTIONS, RESAMPLES, CircuitCurve, circuit_curve
from contribution_lens.circuits.graph import Graph
from contribution_lens.circuits.interchange import window_length
from contribution_lens.circuits.registry import DEFAULT_MEMORY, LEVELS, get_circuit_method
from contribution_lens.circuits.scoring import CircuitScores, circuit_scores, node_sums
from contribution_lens.circuits.task import Task
from contribution_lens.files import write_text
from contribution_lens.processes import barrier, rank_and_world

SCORES = "circuit_scores.safetensors"
TABLE = "circuits.csv"
REPORT = "report.html"

PassCount = Callable[[Graph, int], tuple[int, int]]
PASSES: dict[str, PassCount] = {
    "eap": lambda graph, steps: (2, 1),
    "eap-ig": lambda graph, steps: (2 + steps, steps),
    "activation-patching": lambda graph, steps: (2 + len(graph.components), 0),
    "contribution": lambda graph, steps: (2, 1),
    "random": lambda graph, steps: (0, 0),
}
"""Forward and backward passes a prompt of the package's circuit methods (a method not here: unknown).

``eap``: the counterfactual's pass, the clean pass and its backward pass; ``eap-ig``: both passes
recorded, then ``steps`` interpolated passes with their backward passes; ``activation-patching``:
both passes, then one patched pass a head or MLP; ``contribution``: one forward-mode pass (its primal and
its tangent, two passes' work; the embeddings' passes stop before the first block) and its backward
pass; ``random``: none.
"""
WINDOWED: dict[str, float] = {"eap": GRADIENT_COPIES, "eap-ig": GRADIENT_COPIES, "contribution": CONTRIBUTION_COPIES}
"""Methods that score a prompt too long for the memory budget a window of positions at a time, and the
``[writer batch pos d_model]`` copies each holds (`interchange.pieces`)."""


def windows(graph: Graph, method: str, length: int, d_model: int, memory: int = DEFAULT_MEMORY) -> int:
    """Windows of positions ``method`` splits a prompt of ``length`` tokens into (1: the prompt fits whole).

    Example:
        >>> from contribution_lens.circuits.graph import Graph
        >>> graph = Graph(n_layers=2, n_heads=4, n_kv_heads=2, pos_embed=False)
        >>> windows(graph, "eap", 20, 32, memory=2**30), windows(graph, "eap", 20, 32, memory=20_000)
        (1, 7)
    """
    copies = WINDOWED.get(method)
    window = None if copies is None else window_length(length, len(graph.writers), d_model, copies, memory)
    return 1 if window is None else math.ceil(length / window)


BACKWARD_COST = 2.0
"""Forward-pass equivalents of one backward pass (the usual estimate), for the planned cost."""


def curve_passes(fractions: Sequence[float] = FRACTIONS) -> int:
    """Passes a prompt of one curve: the clean and counterfactual passes, then one patched pass a size."""
    return 2 + len(fractions)


def method_levels(method: str, levels: Sequence[str]) -> tuple[str, ...]:
    """The levels of ``levels`` a method can be evaluated at: a node-level method has no edge level."""
    chosen = get_circuit_method(method)
    return tuple(level for level in levels if chosen.level == "edge" or level == "node")


@dataclass(frozen=True)
class PlannedPasses:
    """What one method costs a prompt before it runs (None where the method does not say)."""

    method: str
    forwards: int | None
    backwards: int | None
    curves: int
    """Passes a prompt of its curves, every level together."""
    windows: int = 1
    """Windows of positions a prompt's scoring runs in (`windows`): each repeats the scoring's passes."""

    @property
    def equivalents(self) -> float | None:
        """Forward-pass equivalents a prompt of the scoring (a backward pass counted as `BACKWARD_COST`)."""
        if self.forwards is None or self.backwards is None:
            return None
        return (self.forwards + BACKWARD_COST * self.backwards) * self.windows


def plan_passes(
    graph: Graph,
    methods: Sequence[str],
    levels: Sequence[str],
    *,
    steps: int = 5,
    length: int = 0,
    d_model: int = 0,
    memory: int = DEFAULT_MEMORY,
) -> list[PlannedPasses]:
    """The passes a prompt of each method's scoring and of its curves.

    With ``length`` (tokens a prompt) and ``d_model``, a scoring that splits a prompt too long for
    ``memory`` into windows of positions counts each window's passes (`windows`).

    Example:
        >>> from contribution_lens.circuits.graph import Graph
        >>> graph = Graph(n_layers=2, n_heads=4, n_kv_heads=2, pos_embed=False)
        >>> [(p.method, p.forwards, p.backwards, p.curves) for p in plan_passes(graph, ["eap", "random"], ["edge"])]
        [('eap', 2, 1, 12), ('random', 0, 0, 12)]
    """
    plans = []
    for method in methods:
        count = PASSES.get(get_circuit_method(method).name)
        forwards, backwards = count(graph, steps) if count is not None else (None, None)
        curves = curve_passes() * len(method_levels(method, levels))
        split = windows(graph, get_circuit_method(method).name, length, d_model, memory)
        plans.append(PlannedPasses(method, forwards, backwards, curves, split))
    return plans


def describe_plan(plans: Sequence[PlannedPasses], n_prompts: int, forward_seconds: float | None = None) -> str:
    """One line a method, then the total; with ``forward_seconds`` (a plain pass of every prompt) the time too."""
    lines, total = [], 0.0
    for plan in plans:
        if plan.equivalents is None:
            scoring = "scoring: passes unknown (not one of the package's methods)"
        else:
            scoring = f"scoring: {plan.forwards} forward + {plan.backwards} backward"
            if plan.windows > 1:
                scoring += f", each of {plan.windows} windows of positions (a prompt does not fit the memory budget)"
            total += plan.equivalents
        total += plan.curves
        lines.append(f"{plan.method}: {scoring}; curves: {plan.curves} forward (passes a prompt)")
    passes = total * n_prompts
    summary = f"{len(plans)} methods, {n_prompts} prompts: about {passes:.0f} forward-pass equivalents"
    if forward_seconds is not None:
        seconds = total * forward_seconds
        summary += f" (one plain pass of every prompt: {forward_seconds:.3f} s); estimated {_duration(seconds)}"
    return "\n".join([*lines, summary])


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def forward_seconds(model: adapter.Model, task: Task, *, repeats: int = 3) -> float:
    """The median time of one plain clean forward pass of every prompt of ``task`` (after a warm-up pass)."""
    batch = adapter.to_token_batch(model, task.clean, attention_mask=task.attention_mask)
    times = []
    with torch.no_grad():
        adapter.forward(model, batch)
        for _ in range(repeats):
            start = time.perf_counter()
            adapter.forward(model, batch)
            _synchronise(model)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _synchronise(model: adapter.Model) -> None:
    if torch.cuda.is_available() and next(model.parameters()).is_cuda:
        torch.cuda.synchronize()


def shard(task: Task, rank: int, world: int) -> Task:
    """Prompts ``rank, rank + world, ...`` of ``task`` (the whole task where ``world`` is 1)."""
    if world == 1:
        return task
    rows = torch.arange(rank, len(task), world)
    return Task(
        task.name, task.clean[rows], task.corrupted[rows], task.answer[rows], task.foil[rows], task.last[rows],
        task.metric,
    )  # fmt: skip


def merge_scores(parts: Sequence[CircuitScores]) -> CircuitScores:
    """The mean over every prompt of the parts' scores (each a mean over its own prompts), weighted by prompts."""
    first = parts[0]
    counts = torch.tensor([part.n_prompts for part in parts], dtype=torch.float64)
    total = counts.sum()

    def mean(values: list[torch.Tensor]) -> torch.Tensor:
        stacked = torch.stack([value.double() for value in values])
        return ((stacked * counts[:, None]).sum(0) / total).float()

    if first.edge_scores is None:
        return replace(first, component_scores=mean([p.component_scores for p in parts]), n_prompts=int(total))
    edges = mean([p.edge_scores for p in parts if p.edge_scores is not None])
    return replace(first, component_scores=node_sums(first.graph, edges), edge_scores=edges, n_prompts=int(total))


def merge_curves(parts: Sequence[CircuitCurve]) -> CircuitCurve:
    """The parts' per-prompt metrics back in prompt order (part ``r`` holds prompts ``r, r + N, ...``)."""
    world = len(parts)
    n = sum(part.clean.shape[0] for part in parts)
    clean = torch.empty(n, dtype=parts[0].clean.dtype)
    corrupted = torch.empty_like(clean)
    patched = torch.empty(parts[0].patched.shape[0], n, dtype=parts[0].patched.dtype)
    for rank, part in enumerate(parts):
        clean[rank::world], corrupted[rank::world], patched[:, rank::world] = part.clean, part.corrupted, part.patched
    return replace(parts[0], clean=clean, corrupted=corrupted, patched=patched)


@dataclass(frozen=True)
class RunSettings:
    """What a run computes beside its task: the methods, the levels, the seed, the steps and the resamples."""

    methods: tuple[str, ...]
    levels: tuple[str, ...] = LEVELS
    seed: int = 0
    steps: int = 5
    resamples: int = RESAMPLES


def _check_config(out: Path, config: dict[str, Any]) -> None:
    path = out / "config.json"
    if path.exists():
        previous = json.loads(path.read_text(encoding="utf-8"))
        if previous != config:
            raise ValueError(f"{out} holds a run with other settings ({path}); use another --out folder")


def run_circuits(
    model: adapter.Model,
    task: Task,
    settings: RunSettings,
    out: str | os.PathLike,
    *,
    config: dict[str, Any] | None = None,
    report: bool = True,
) -> pd.DataFrame | None:
    """Score ``task`` with every method and evaluate its curves; the table (`circuit_table`) on rank 0, else None.

    ``config`` (the model's name, the task's settings) is written to ``config.json``; a folder
    holding another config is refused. What ``out`` already holds is kept and not recomputed.
    """
    for method in settings.methods:
        get_circuit_method(method)
    out_dir = Path(out)
    rank, world = rank_and_world()
    config = {**(config or {}), "task": task.name, "prompts": len(task), "seed": settings.seed,
              "steps": settings.steps}  # fmt: skip
    _check_config(out_dir, config)
    barrier(world)
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        write_text(out_dir / "config.json", json.dumps(config, indent=2, sort_keys=True))
    barrier(world)
    mine = shard(task, rank, world)
    forward: float | None = None
    for method in settings.methods:
        folder = out_dir / method
        levels = method_levels(method, settings.levels)
        if (folder / SCORES).exists() and all((folder / f"curve-{level}.safetensors").exists() for level in levels):
            continue
        if forward is None:
            forward = forward_seconds(model, mine)
        folder.mkdir(parents=True, exist_ok=True)
        scores = _scores(model, mine, method, settings, folder, rank, world, forward)
        for level in levels:
            _curve(model, mine, scores, level, settings, folder, rank, world, forward)
    barrier(world)
    if rank != 0:
        return None
    # The folder's other methods too (a run may add methods to a folder, one command at a time).
    earlier = sorted(p.name for p in out_dir.iterdir() if (p / SCORES).exists() and p.name not in settings.methods)
    methods = (*settings.methods, *earlier)
    table = circuit_table(out_dir, methods, LEVELS)
    write_text(out_dir / TABLE, table.to_csv(index=False))
    if report:
        write_report(model, task, table, out_dir, replace(settings, methods=methods, levels=LEVELS))
    return table


def _part(name: str, rank: int, world: int) -> str:
    return f"{name}.part-{rank}-of-{world}.safetensors"


def _record_time(folder: Path, stage: str, seconds: float, forward: float, prompts: int) -> None:
    path = folder / "timing.json"
    timing = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    timing[stage] = {"seconds": seconds, "forward_seconds": forward, "prompts": prompts}
    write_text(path, json.dumps(timing, indent=2, sort_keys=True))


def _scores(
    model: adapter.Model, task: Task, method: str, settings: RunSettings, folder: Path, rank: int, world: int,
    forward: float,
) -> CircuitScores:  # fmt: skip
    final = folder / SCORES
    if final.exists():
        return CircuitScores.load(final)
    part = folder / _part("scores", rank, world)
    if not part.exists():
        start = time.perf_counter()
        scores = circuit_scores(model, task, method, seed=settings.seed, steps=settings.steps)
        _synchronise(model)
        seconds = time.perf_counter() - start
        scores.save(part)
        if rank == 0:
            _record_time(folder, "scores", seconds, forward, len(task))
    barrier(world)
    merged = merge_scores([CircuitScores.load(folder / _part("scores", r, world)) for r in range(world)])
    barrier(world)  # every rank has read every part
    if rank == 0:
        merged.save(final)
        for r in range(world):
            (folder / _part("scores", r, world)).unlink()
    return merged


def _curve(
    model: adapter.Model, task: Task, scores: CircuitScores, level: str, settings: RunSettings, folder: Path,
    rank: int, world: int, forward: float,
) -> None:  # fmt: skip
    final = folder / f"curve-{level}.safetensors"
    if final.exists():
        return
    name = f"curve-{level}"
    part = folder / _part(name, rank, world)
    if not part.exists():
        start = time.perf_counter()
        curve = circuit_curve(model, task, scores, level, seed=settings.seed)
        _synchronise(model)
        seconds = time.perf_counter() - start
        replace(curve, resamples=settings.resamples).save(part)
        if rank == 0:
            _record_time(folder, name, seconds, forward, len(task))
    barrier(world)
    if rank == 0:
        parts = [folder / _part(name, r, world) for r in range(world)]
        merge_curves([CircuitCurve.load(p) for p in parts]).save(final)
        for p in parts:
            p.unlink()
    barrier(world)


COLUMNS = (
    "method", "level", "prompts", "cpr", "cpr_low", "cpr_high", "cmd", "cmd_low", "cmd_high",
    "planned_scoring", "scoring_cost", "curve_cost", "forward_seconds",
)  # fmt: skip


def circuit_table(
    out: str | os.PathLike, methods: Sequence[str] | None = None, levels: Sequence[str] = LEVELS
) -> pd.DataFrame:
    """One row a method and level of the run in ``out``: CPR and CMD with intervals, passes and measured cost.

    ``planned_scoring``: forward-pass equivalents a prompt of the scoring by `PASSES` (NaN where unknown);
    ``scoring_cost`` and ``curve_cost``: the measured seconds of the scoring and of that level's
    curve over the seconds of one plain clean forward pass of the same prompts in the same run
    (forward-pass equivalents a prompt). ``methods``: every method folder of ``out`` if None.
    """
    folder = Path(out)
    if methods is None:
        methods = sorted(p.name for p in folder.iterdir() if (p / SCORES).exists())
    rows = []
    for method in methods:
        scores_path = folder / method / SCORES
        if not scores_path.exists():
            continue
        timing_path = folder / method / "timing.json"
        timing = json.loads(timing_path.read_text(encoding="utf-8")) if timing_path.exists() else {}
        scores = CircuitScores.load(scores_path)
        count = PASSES.get(method)
        planned = math.nan
        if count is not None:
            forwards, backwards = count(scores.graph, int(_config(folder).get("steps", 5)))
            planned = forwards + BACKWARD_COST * backwards
        for level in levels:
            path = folder / method / f"curve-{level}.safetensors"
            if not path.exists():
                continue
            curve = CircuitCurve.load(path)
            cpr_low, cpr_high = curve.cpr_interval
            cmd_low, cmd_high = curve.cmd_interval
            rows.append(
                {
                    "method": method, "level": level, "prompts": int(curve.clean.shape[0]),
                    "cpr": curve.cpr, "cpr_low": cpr_low, "cpr_high": cpr_high,
                    "cmd": curve.cmd, "cmd_low": cmd_low, "cmd_high": cmd_high,
                    "planned_scoring": planned, "scoring_cost": _cost(timing.get("scores")),
                    "curve_cost": _cost(timing.get(f"curve-{level}")),
                    "forward_seconds": timing.get("scores", {}).get("forward_seconds", math.nan),
                }
            )  # fmt: skip
    return pd.DataFrame(rows, columns=list(COLUMNS))


def _config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


def _cost(stage: dict[str, float] | None) -> float:
    if not stage or not stage.get("forward_seconds"):
        return math.nan
    return float(stage["seconds"] / stage["forward_seconds"])


def write_report(model: adapter.Model, task: Task, table: pd.DataFrame, out: Path, settings: RunSettings) -> Path:
    """``report.html``: the model's accuracy on the task, the table, and every method's curve per level."""
    import warnings

    from contribution_lens.circuits.task import task_report
    from contribution_lens.drawing import html
    from contribution_lens.drawing.circuit_figures import faithfulness_figure

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        task_summary = repr(task_report(model, task, seed=settings.seed))
    notes = " ".join(str(w.message) for w in caught)
    sections: list[Any] = [("The task", f"{task!r}. {task_summary}. {notes}".strip()), ("CPR and CMD", table)]
    for level in settings.levels:
        rows = []
        for method in settings.methods:
            path = out / method / f"curve-{level}.safetensors"
            if not path.exists():
                continue
            curve = CircuitCurve.load(path)
            interval = curve.faithfulness_interval
            for i, fraction in enumerate(curve.fractions.tolist()):
                rows.append(
                    {"method": method, "fraction": fraction, "faithfulness": float(curve.faithfulness[i]),
                     "low": float(interval[i, 0]), "high": float(interval[i, 1])}
                )  # fmt: skip
        if rows:
            figure = faithfulness_figure(pd.DataFrame(rows), title=f"Faithfulness by circuit size, {level} level")
            sections.append((f"{level.capitalize()} level", figure))
    return html.write_html(out / REPORT, f"Circuits of {task.name}", sections)
