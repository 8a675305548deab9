"""A circuit run: every method's scores and faithfulness curves on one task, kept method by method.

`run_circuits` splits the task into disjoint scoring and evaluation prompts (`Task.split`, as MIB
scores on its train split and evaluates on another; ``RunSettings.split=None`` scores and evaluates
every prompt, in-sample), scores the scoring prompts with each circuit method (`circuit_scores`),
then evaluates the circuits those scores choose at MIB's ten sizes on the evaluation prompts, per
level (`circuit_curve`: by signed score and by ``|score|``, pruned, greedy where the method says).
Layout of ``out``:

* ``config.json`` -- every input: the model, the task (its prompts' fingerprint, a task file's
  SHA-256), its counterfactual and size, the split, the selection, the seed, the steps, the
  resamples and the package version (`contribution_lens.circuits.run_folder`): a resumed run must
  match, and is refused naming what changed (``restart=True``, ``--restart``: start afresh);
* ``{method}/circuit_scores.safetensors`` -- the method's `CircuitScores` (over every scoring prompt);
* ``{method}/curve-{level}.safetensors`` -- its `CircuitCurve` at that level (``edge`` or ``node``; a
  method that scores nodes only has no edge level);
* ``{method}/timing.json`` -- seconds of the scoring and of each curve, beside the seconds of one
  plain clean forward pass of the same prompts timed in the same run: their ratio is the cost in
  forward-pass equivalents per prompt;
* ``circuits.csv`` -- one row a method and level: the counterfactual, the prompts scored and those
  evaluated (in-sample or not), MIB's CPR and CMD and the ``|score|`` area with their 95 % bootstrap
  intervals, the planned passes and the measured cost, and a note where the numbers lack something
  (too few prompts for an interval, an undefined f) (`circuit_table`);
* ``report.html`` -- the table, the model's accuracy on the task and every method's curves per level.

A finished method's files are never rewritten: a killed run continues with the first method or
level that has no file, each kept file checked against this run's prompts. Before any method is
scored, a counterfactual that does not move the metric on the scoring or evaluation prompts is
refused (f would divide by it). Under ``torchrun --nproc_per_node N`` rank ``r`` takes prompts
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
from contribution_lens.circuits import run_folder
from contribution_lens.circuits.attribution import GRADIENT_COPIES
from contribution_lens.circuits.checks import (
    check_count,
    check_levels,
    check_memory,
    check_seed,
    check_steps,
    check_switch,
)
from contribution_lens.circuits.contribution import COPIES as CONTRIBUTION_COPIES
from contribution_lens.circuits.evaluation import (
    FRACTIONS,
    RESAMPLES,
    SELECTIONS,
    CircuitCurve,
    circuit_curve,
    unmoved,
)
from contribution_lens.circuits.graph import Graph, check_counting
from contribution_lens.circuits.interchange import window_length
from contribution_lens.circuits.registry import DEFAULT_MEMORY, LEVELS, get_circuit_method
from contribution_lens.circuits.scoring import CircuitScores, circuit_scores, node_sums
from contribution_lens.circuits.task import Prompts, Task
from contribution_lens.circuits.task_checks import check_task
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
    "contribution-ig": lambda graph, steps: (2 * steps, steps),
    "information-flow-routes": lambda graph, steps: (1, 0),
    "information-flow-routes-last": lambda graph, steps: (1, 0),
    "random": lambda graph, steps: (0, 0),
}
"""Forward and backward passes a prompt of the package's circuit methods (a method not here: unknown).

``eap``: the counterfactual's pass, the clean pass and its backward pass; ``eap-ig``: both passes
recorded, then ``steps`` interpolated passes with their backward passes; ``activation-patching``:
both passes, then one patched pass a head or MLP; ``contribution``: one forward-mode pass (its primal and
its tangent, two passes' work; the embeddings' passes stop before the first block) and its backward
pass; ``contribution-ig``: the same at each of ``steps`` points of the path; ``information-flow-routes``
and ``-last``: one clean pass (and the proximities, memory-bound); ``random``: none.
"""
WINDOWED: dict[str, float] = {
    "eap": GRADIENT_COPIES,
    "eap-ig": GRADIENT_COPIES,
    "contribution": CONTRIBUTION_COPIES,
    "contribution-ig": CONTRIBUTION_COPIES,
}
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
    memory = check_memory(memory)
    copies = WINDOWED.get(method)
    window = None if copies is None else window_length(length, len(graph.writers), d_model, copies, memory)
    return 1 if window is None else math.ceil(length / window)


BACKWARD_COST = 2.0
"""Forward-pass equivalents of one backward pass (the usual estimate), for the planned cost."""


def curve_passes(fractions: Sequence[float] = FRACTIONS) -> int:
    """Passes a prompt of one curve, at most: the clean and counterfactual passes, then one patched pass a size
    below the whole model and a selection (`SELECTIONS`); a circuit both selections choose runs once."""
    return 2 + len(SELECTIONS) * sum(1 for fraction in fractions if fraction < 1)


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
        [('eap', 2, 1, 20), ('random', 0, 0, 20)]
    """
    steps, memory = check_steps(steps), check_memory(memory)
    plans = []
    for method in methods:
        count = PASSES.get(get_circuit_method(method).name)
        forwards, backwards = count(graph, steps) if count is not None else (None, None)
        curves = curve_passes() * len(method_levels(method, levels))
        split = windows(graph, get_circuit_method(method).name, length, d_model, memory)
        plans.append(PlannedPasses(method, forwards, backwards, curves, split))
    return plans


def describe_plan(
    plans: Sequence[PlannedPasses],
    n_prompts: int,
    forward_seconds: float | None = None,
    *,
    scored: int | None = None,
    evaluated: int | None = None,
) -> str:
    """One line a method, then the total; with ``forward_seconds`` (a plain pass of every prompt) the time too.

    ``scored`` and ``evaluated``: the prompts scored and those the curves evaluate (default: all ``n_prompts``).
    """
    scored = n_prompts if scored is None else scored
    evaluated = n_prompts if evaluated is None else evaluated
    lines, passes = [], 0.0
    for plan in plans:
        if plan.equivalents is None:
            scoring = "scoring: passes unknown (not one of the package's methods)"
        else:
            scoring = f"scoring: {plan.forwards} forward + {plan.backwards} backward"
            if plan.windows > 1:
                scoring += f", each of {plan.windows} windows of positions (a prompt does not fit the memory budget)"
            passes += plan.equivalents * scored
        passes += plan.curves * evaluated
        lines.append(f"{plan.method}: {scoring}; curves: at most {plan.curves} forward (passes a prompt)")
    summary = f"{len(plans)} methods, {n_prompts} prompts: about {passes:.0f} forward-pass equivalents"
    if forward_seconds is not None:
        seconds = passes / n_prompts * forward_seconds
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
    return task.subset(torch.arange(rank, len(task), world))


def _interleaved(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The parts' last axis back in prompt order: part ``r`` holds prompts ``r, r + N, ...``."""
    world, n = len(parts), sum(part.shape[-1] for part in parts)
    whole = parts[0].new_empty((*parts[0].shape[:-1], n))
    for rank, part in enumerate(parts):
        whole[..., rank::world] = part
    return whole


def _merged_prompts(parts: Sequence[Prompts | None]) -> Prompts | None:
    first = parts[0]
    if first is None or any(part is None for part in parts):
        return None
    return replace(first, fingerprints=_interleaved([part.fingerprints for part in parts if part is not None]))


def merge_scores(parts: Sequence[CircuitScores]) -> CircuitScores:
    """The mean over every prompt of the parts' scores (each a mean over its own prompts), weighted by prompts."""
    first = parts[0]
    counts = torch.tensor([part.n_prompts for part in parts], dtype=torch.float64)
    total = counts.sum()

    def mean(values: list[torch.Tensor]) -> torch.Tensor:
        stacked = torch.stack([value.double() for value in values])
        return ((stacked * counts[:, None]).sum(0) / total).float()

    merged = replace(first, n_prompts=int(total), prompts=_merged_prompts([p.prompts for p in parts]))
    if first.edge_scores is None:
        return replace(merged, component_scores=mean([p.component_scores for p in parts]))
    edges = mean([p.edge_scores for p in parts if p.edge_scores is not None])
    return replace(merged, component_scores=node_sums(first.graph, edges), edge_scores=edges)


def merge_curves(parts: Sequence[CircuitCurve]) -> CircuitCurve:
    """The parts' per-prompt metrics (and prompts) back in prompt order (part ``r`` holds prompts ``r, r + N, ...``)."""
    return replace(
        parts[0],
        clean=_interleaved([part.clean for part in parts]),
        corrupted=_interleaved([part.corrupted for part in parts]),
        patched=_interleaved([part.patched for part in parts]),
        evaluated=_merged_prompts([part.evaluated for part in parts]),
    )


@dataclass(frozen=True)
class RunSettings:
    """What a run computes beside its task: the methods, the levels, the seed, the steps, the resamples, the split
    and the selection.

    ``split``: the share of the task's prompts scored, the rest evaluated (`Task.split` with ``seed``);
    None scores and evaluates every prompt (in-sample). ``prune`` and ``greedy``: `circuit_curve`'s.
    """

    methods: tuple[str, ...]
    levels: tuple[str, ...] = LEVELS
    seed: int = 0
    steps: int = 5
    resamples: int = RESAMPLES
    split: float | None = 0.5
    prune: bool = True
    greedy: bool | None = None
    edges: str = "native"
    """The graph's edge counting (`contribution_lens.circuits.graph`): ``"native"`` or ``"mib"``."""
    scored: int | None = None
    """At most this many of the scoring part's prompts are scored (its first ones; the evaluation part is the
    same): an expensive method (activation patching) scored on fewer prompts, evaluated on the same ones."""

    def __post_init__(self) -> None:
        """Every setting checked as the library's functions check it (`contribution_lens.circuits.checks`)."""
        if isinstance(self.methods, str) or not self.methods:
            raise ValueError(f"methods must be a non-empty sequence of circuit method names, got {self.methods!r}")
        methods = tuple(get_circuit_method(method).name for method in self.methods)
        if len(set(methods)) != len(methods):
            raise ValueError(f"methods: each method once, got {self.methods!r}")
        object.__setattr__(self, "methods", methods)
        object.__setattr__(self, "levels", check_levels(self.levels))
        object.__setattr__(self, "seed", check_seed(self.seed))
        object.__setattr__(self, "steps", check_steps(self.steps))
        object.__setattr__(self, "resamples", check_count(self.resamples, "resamples"))
        split = self.split
        if split is not None and (isinstance(split, bool) or not isinstance(split, int | float) or not 0 < split < 1):
            raise ValueError(f"split must be a number in (0, 1) (the share of prompts scored) or None, got {split!r}")
        check_switch(self.prune, "prune")
        check_switch(self.greedy, "greedy", optional=True)
        check_counting(self.edges)
        if self.scored is not None:
            object.__setattr__(self, "scored", check_count(self.scored, "scored"))

    def parts(self, task: Task) -> tuple[Task, Task]:
        """The scoring and the evaluation task (the task itself twice where ``split`` is None)."""
        scoring, evaluation = (task, task) if self.split is None else task.split(self.split, seed=self.seed)
        if self.scored is not None and self.scored < len(scoring):
            scoring = scoring.subset(torch.arange(self.scored))
        return scoring, evaluation


def run_circuits(
    model: adapter.Model,
    task: Task,
    settings: RunSettings,
    out: str | os.PathLike,
    *,
    config: dict[str, Any] | None = None,
    report: bool = True,
    restart: bool = False,
) -> pd.DataFrame | None:
    """Score ``task`` with every method and evaluate its curves; the table (`circuit_table`) on rank 0, else None.

    ``config`` (the model's name, the task's settings) is written to ``config.json`` with every other
    input (`contribution_lens.circuits.run_folder.run_config`); a folder holding a run of other inputs
    is refused naming what changed, unless ``restart`` (its results removed first). What ``out``
    already holds of this run is kept, checked against this run's prompts, and not recomputed.
    """
    check_task(model, task)
    check_switch(restart, "restart")
    out_dir = Path(out)
    rank, world = rank_and_world()
    scoring, evaluation = settings.parts(task)
    config = run_folder.run_config(task, settings, config)
    if restart and rank == 0:
        run_folder.clear_run(out_dir)
    barrier(world)
    run_folder.check_run_folder(out_dir, config)
    _check_folder(out_dir, scoring, evaluation)
    for part in (scoring,) if scoring is evaluation else (scoring, evaluation):
        check_counterfactual_moves(model, part, part.part)
    barrier(world)
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        write_text(out_dir / run_folder.CONFIG, json.dumps(config, indent=2, sort_keys=True))
    barrier(world)
    mine = (shard(scoring, rank, world), shard(evaluation, rank, world))
    forward: tuple[float, float] | None = None
    for method in settings.methods:
        folder = out_dir / method
        levels = method_levels(method, settings.levels)
        if (folder / SCORES).exists() and all((folder / f"curve-{level}.safetensors").exists() for level in levels):
            continue
        if forward is None:  # a plain pass of each part's prompts: the scoring's and the curves' unit of cost
            forward = (forward_seconds(model, mine[0]), forward_seconds(model, mine[1]))
        folder.mkdir(parents=True, exist_ok=True)
        scores = _scores(model, mine[0], method, settings, folder, rank, world, forward[0])
        for level in levels:
            _curve(model, mine[1], scores, level, settings, folder, rank, world, forward[1])
    barrier(world)
    if rank != 0:
        return None
    # The folder's other methods too (a run may add methods to a folder, one command at a time).
    earlier = sorted(p.name for p in out_dir.iterdir() if (p / SCORES).exists() and p.name not in settings.methods)
    methods = (*settings.methods, *earlier)
    table = circuit_table(out_dir, methods, LEVELS)
    write_text(out_dir / TABLE, table.to_csv(index=False))
    if report:
        write_report(model, evaluation, table, out_dir, settings, methods=methods)
    return table


def _check_folder(out: Path, scoring: Task, evaluation: Task) -> None:
    """Every result kept in ``out`` against this run's scoring and evaluation prompts (`run_folder.check_kept`)."""
    if not out.is_dir():
        return
    for folder in sorted(p for p in out.iterdir() if p.is_dir()):
        if (folder / SCORES).exists():
            run_folder.check_kept(folder / SCORES, CircuitScores.load(folder / SCORES).prompts, scoring.prompts)
        for curve in sorted(p for p in folder.glob("curve-*.safetensors") if ".part-" not in p.name):
            run_folder.check_kept(curve, CircuitCurve.load(curve).evaluated, evaluation.prompts)


def _metric_values(model: adapter.Model, task: Task, ids: torch.Tensor, size: int = 16) -> torch.Tensor:
    """The task's metric of each prompt of ``ids`` (its clean or corrupted prompts) in a plain pass."""
    values = []
    for start in range(0, len(task), size):
        rows = torch.arange(start, min(start + size, len(task)))
        batch = adapter.to_token_batch(model, ids[rows], attention_mask=task.attention_mask[rows])
        with torch.no_grad():
            logits = adapter.forward(model, batch)[:, : batch.tokens.shape[1]]
        values.append(task.subset(rows).metric_values(logits).cpu())
    return torch.cat(values)


def check_counterfactual_moves(model: adapter.Model, task: Task, part: str) -> None:
    """Refuse, before any method runs, prompts whose counterfactual does not move the metric (two plain passes)."""
    reason = unmoved(_metric_values(model, task, task.clean), _metric_values(model, task, task.corrupted))
    where = "the prompts" if part == "all" else f"the {part} prompts"
    if reason:
        raise ValueError(
            f"task: on {where} {reason}; no circuit can be evaluated: use a counterfactual that changes the answer"
        )


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
        scores = circuit_scores(model, task, method, seed=settings.seed, steps=settings.steps, edges=settings.edges)
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
        curve = circuit_curve(
            model, task, scores, level, prune=settings.prune, greedy=settings.greedy, seed=settings.seed
        )
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
    "method", "level", "counterfactual", "scored", "scored_prompts", "evaluated", "evaluated_prompts", "in_sample",
    "prune", "greedy", "cpr", "cpr_low", "cpr_high", "cmd", "cmd_low", "cmd_high",
    "absolute_area", "absolute_area_low", "absolute_area_high",
    "planned_scoring", "scoring_cost", "curve_cost", "forward_seconds", "note",
)  # fmt: skip


def circuit_table(
    out: str | os.PathLike, methods: Sequence[str] | None = None, levels: Sequence[str] = LEVELS
) -> pd.DataFrame:
    """One row a method and level of the run in ``out``: its prompts, CPR and CMD with intervals, passes and cost.

    ``counterfactual``: what the corrupted prompts ask; ``scored`` and ``evaluated``: the part of the
    task (``scoring``, ``evaluation`` or ``all``) the scores came from and the curve was evaluated on,
    with their prompt counts; ``in_sample``: whether the two share prompts. ``prune`` and ``greedy``:
    the selection (`circuit_curve`). ``cpr`` and ``cmd``: MIB's (the signed selection's area under f,
    the ``|score|`` selection's area under ``|1 - f|``); ``absolute_area``: the ``|score|``
    selection's area under f. ``planned_scoring``: forward-pass equivalents a prompt of the scoring by
    `PASSES` (NaN where unknown);
    ``scoring_cost`` and ``curve_cost``: the measured seconds of the scoring and of that level's
    curve over the seconds of one plain clean forward pass of the same prompts in the same run
    (forward-pass equivalents a prompt). ``note``: what the row's numbers lack, in words (too few
    prompts for an interval, an undefined f: `CircuitCurve.note`). ``methods``: every method folder
    of ``out`` if None.
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
            rows.append(
                {
                    "method": method, "level": level, **_prompt_columns(curve), "prune": curve.prune,
                    "greedy": curve.greedy, **_areas(curve),
                    "planned_scoring": planned, "scoring_cost": _cost(timing.get("scores")),
                    "curve_cost": _cost(timing.get(f"curve-{level}")),
                    "forward_seconds": timing.get("scores", {}).get("forward_seconds", math.nan),
                    "note": curve.note,
                }
            )  # fmt: skip
    return pd.DataFrame(rows, columns=list(COLUMNS))


def _prompt_columns(curve: CircuitCurve) -> dict[str, Any]:
    """The counterfactual, the prompts scored and evaluated, and whether they overlap."""
    scored, evaluated = curve.scored, curve.evaluated
    return {
        "counterfactual": curve.counterfactual,
        "scored": "?" if scored is None else scored.part,
        "scored_prompts": -1 if scored is None else len(scored),
        "evaluated": "?" if evaluated is None else evaluated.part,
        "evaluated_prompts": int(curve.clean.shape[0]),
        "in_sample": curve.in_sample,
    }


def _areas(curve: CircuitCurve) -> dict[str, float]:
    """CPR, CMD and the ``|score|`` area, each with its interval."""
    columns: dict[str, float] = {}
    for name in ("cpr", "cmd", "absolute_area"):
        low, high = getattr(curve, f"{name}_interval")
        columns |= {name: getattr(curve, name), f"{name}_low": low, f"{name}_high": high}
    return columns


def _config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


def _cost(stage: dict[str, float] | None) -> float:
    if not stage or not stage.get("forward_seconds"):
        return math.nan
    return float(stage["seconds"] / stage["forward_seconds"])


def write_report(
    model: adapter.Model,
    task: Task,
    table: pd.DataFrame,
    out: Path,
    settings: RunSettings,
    *,
    methods: Sequence[str] | None = None,
) -> Path:
    """``report.html``: the model's accuracy on the task, the table, and every method's curve per level.

    ``methods``: the methods whose curves are drawn (default: ``settings.methods``), at every level.
    """
    import warnings

    from contribution_lens.circuits.task_checks import task_report
    from contribution_lens.drawing import html
    from contribution_lens.drawing.circuit_figures import faithfulness_figure

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        task_summary = repr(task_report(model, task, seed=settings.seed))
    notes = " ".join(str(w.message) for w in caught)
    samples = (
        "Scored and evaluated on the same prompts (in-sample)."
        if settings.split is None
        else f"Scored on {settings.split:g} of the prompts, evaluated on the others (no prompt in both)."
    )
    about = f"{task!r}. {samples} {task_summary}. {notes}".strip()
    sections: list[Any] = [("The task", about), ("CPR and CMD", table)]
    for level in LEVELS:
        rows = []
        for method in settings.methods if methods is None else methods:
            path = out / method / f"curve-{level}.safetensors"
            if not path.exists():
                continue
            curve = CircuitCurve.load(path)
            for row in curve.table.itertuples():
                rows.append(
                    {"method": f"{method} ({row.selection})", "fraction": row.fraction,
                     "faithfulness": row.faithfulness, "low": row.low, "high": row.high}
                )  # fmt: skip
        if rows:
            figure = faithfulness_figure(pd.DataFrame(rows), title=f"Faithfulness by circuit size, {level} level")
            sections.append((f"{level.capitalize()} level", figure))
    return html.write_html(out / REPORT, f"Circuits of {task.name}", sections)
