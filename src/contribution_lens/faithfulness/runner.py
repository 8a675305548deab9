"""The faithfulness run: data to records (JSONL, resumable, shardable over torchrun) to a report.

Layout of ``out``:

* ``config.json`` -- the protocol and data; a resumed run must match it;
* ``part-{rank}.jsonl`` -- records appended (and flushed) as each forward pass finishes, one
  line per (task, sequence, method, mode, ratio); an interrupted run skips what is there;
* ``records.jsonl`` -- all parts merged, deduplicated and sorted;
* ``summary.csv`` -- per (task, protocol, method, mode, ratio): Δloss, ΔPPL or accuracy, with
  the 95% paired-bootstrap interval of Δloss (text) or accuracy (multiple choice) in
  ``ci_low``/``ci_high``;
* ``aopc.csv`` -- the area over the perturbation curve per protocol, task, mode and method;
* ``verdicts.csv`` -- the claimed ordering judged pair by pair (`contribution_lens.faithfulness.statistics`);
* ``report.html`` -- the verdicts in words, then the curves; written by rank 0 at the end;
* ``faithfulness_run.safetensors`` -- the run itself (records and settings), as every result is saved.

`run` returns the `contribution_lens.faithfulness.FaithfulnessRun` (on rank 0), which
`FaithfulnessRun.load` reads back from the folder.

Under ``torchrun --nproc_per_node N`` each rank takes every N-th unit of work (a batch of
``batch_size`` chunks or items, in a fixed order); the units left over, all of them in a run with
fewer units than processes, are shared pass by pass (`plan_units`). Rank 0 merges once all ranks
are done.
"""

import json
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from contribution_lens import adapter
from contribution_lens.choices import Granularity
from contribution_lens.engine import map_layers
from contribution_lens.faithfulness import data
from contribution_lens.faithfulness.registry import PROTOCOLS
from contribution_lens.faithfulness.removal import NOTHING_REMOVED, CleanRun, Condition, LayerScores, masked_forward
from contribution_lens.faithfulness.results import STATE, FaithfulnessRun, read_records, records_text
from contribution_lens.faithfulness.settings import DataSettings, RunOptions, Settings, task_name
from contribution_lens.files import write_text
from contribution_lens.losses import continuation_logprob, token_nll
from contribution_lens.methods import ScoreContext, get_method
from contribution_lens.processes import barrier, rank_and_world

Key = tuple[str, str, str, str, str, float]


def clean_run(model: adapter.Model, batch: adapter.TokenBatch, settings: Settings) -> CleanRun:
    """One forward pass scoring every key at every scored layer for every method (a per-layer function)."""
    layers = adapter.check_layers(model, list(settings.layers) if settings.layers is not None else None)
    chosen = [get_method(name) for name in settings.methods]
    prepared = {m.name: m.prepare(model, batch, layers) for m in chosen if m.prepare is not None}
    capture = tuple(sorted({name for m in chosen for name in m.capture}))
    per_head = settings.granularity == Granularity.HEAD
    contexts = {m.name: ScoreContext(settings.scope, settings.seed, model, prepared.get(m.name)) for m in chosen}

    def on_layer(layer: adapter.LayerInputs) -> LayerScores:
        scores = {
            m.name: m.head_scores(layer, contexts[m.name]) if per_head else m.token_scores(layer, contexts[m.name])
            for m in chosen
        }
        return LayerScores(scores, layer.decompose(settings.scope).valid)

    result = map_layers(model, batch, on_layer, layers=layers, capture=capture, keep_logits=True)
    return CleanRun.from_results(result)


def conditions(settings: Settings, ratios: Sequence[float], layers: Sequence[int | None]) -> list[Condition]:
    """Every (method, ranking, mode, nonzero ratio, layer variant) of a run, in a fixed order."""
    return [
        Condition(method, rank, mode, ratio, layer)
        for method, rank in settings.variants()
        for mode in settings.modes
        for ratio in ratios
        if ratio > 0
        for layer in layers
    ]


@dataclass
class Unit:
    """One unit of work: a batch of sequences of one task that share clean and masked passes."""

    task: str
    kind: str  # "lm" or "choice"
    ids: list[str]
    tokens: list[torch.Tensor]
    spans: list[tuple[int, int]]  # continuation [start, end) per sequence ("choice" only)
    items: list[tuple[str, int, list[int]]]  # (item id, label, row indices) ("choice" only)


def build_units(model: adapter.Model, config: DataSettings) -> list[Unit]:
    """Tokenise every data set and cut it into units, in a deterministic order."""
    tokenizer = model.tokenizer
    bos = adapter.bos_to_prepend(model, config.prepend_bos)
    first = [] if bos is None else [bos]
    units: list[Unit] = []
    for spec in config.lm:
        task = task_name(spec)
        adapter.check_length(model, config.chunk_length, "the chunk length")
        chunks = data.text_chunks(
            model, [spec], length=config.chunk_length, max_chunks=config.max_chunks, prepend_bos=config.prepend_bos
        )
        for start in range(0, chunks.shape[0], config.batch_size):
            rows = list(range(start, min(start + config.batch_size, chunks.shape[0])))
            units.append(Unit(task, "lm", [str(r) for r in rows], [chunks[r] for r in rows], [], []))
    for spec in config.choice:
        task = task_name(spec)
        items = data.load_choices(spec)
        kept: list[tuple[data.Choice, list[torch.Tensor], list[tuple[int, int]]]] = []
        for item in items:
            seqs, spans = [], []
            for context, continuation in zip(item.contexts, item.continuations, strict=True):
                ctx = [*first, *tokenizer(context, add_special_tokens=False)["input_ids"]]
                cont = tokenizer(continuation, add_special_tokens=False)["input_ids"]
                if not cont:
                    raise data.DataFormatError(f"{task} item {item.item_id}: empty continuation")
                seqs.append(torch.tensor(ctx + cont, dtype=torch.long))
                spans.append((len(ctx), len(ctx) + len(cont)))
            if max(len(s) for s in seqs) <= config.max_item_tokens:
                kept.append((item, seqs, spans))
            if config.max_items is not None and len(kept) >= config.max_items:
                break
        if not kept:
            raise ValueError(f"{task}: no item fits in {config.max_item_tokens} tokens")
        units += _choice_units(task, kept, config.batch_size)
    return units


def _choice_units(
    task: str, kept: list[tuple[data.Choice, list[torch.Tensor], list[tuple[int, int]]]], batch_size: int
) -> list[Unit]:
    """Whole items packed into units of at most ``batch_size`` sequences (one option is one sequence).

    An item's options stay in one pass (an item with more options than ``batch_size`` gets a unit of
    its own). Counting items instead let 8 MMLU items make 32 sequences a pass, whose logits over
    Gemma 3's 262,144-token vocabulary alone took over 8 GB.
    """
    units: list[Unit] = []
    for item, seqs, spans in kept:
        if not units or (units[-1].tokens and len(units[-1].tokens) + len(seqs) > batch_size):
            units.append(Unit(task, "choice", [], [], [], []))
        unit = units[-1]
        rows = list(range(len(unit.tokens), len(unit.tokens) + len(seqs)))
        unit.ids += [f"{item.item_id}#{k}" for k in range(len(seqs))]
        unit.tokens += seqs
        unit.spans += spans
        unit.items.append((item.item_id, item.label, rows))
    return units


def _item_records(unit: Unit, logits: torch.Tensor, batch: adapter.TokenBatch) -> list[dict[str, Any]]:
    device = batch.tokens.device
    starts = torch.tensor([s for s, _ in unit.spans], device=device)
    ends = torch.tensor([e for _, e in unit.spans], device=device)
    logprob = continuation_logprob(logits, batch.tokens, starts, ends).tolist()
    out = []
    for item_id, label, rows in unit.items:
        scores = [logprob[r] for r in rows]
        prediction = max(range(len(scores)), key=scores.__getitem__)
        out.append({"seq": item_id, "logprobs": scores, "pred": prediction, "correct": prediction == label})
    return out


def _unit_records(
    unit: Unit, logits: torch.Tensor, batch: adapter.TokenBatch, protocol: str = "every_layer"
) -> list[dict[str, Any]]:
    if unit.kind == "choice":
        return _item_records(unit, logits, batch)
    nll, count = token_nll(logits, batch.tokens, PROTOCOLS[protocol].loss_mask(batch))
    return [{"seq": i, "nll": n, "tokens": c} for i, n, c in zip(unit.ids, nll.tolist(), count.tolist(), strict=True)]


def _unit_keys(unit: Unit) -> list[str]:
    return [item_id for item_id, _, _ in unit.items] if unit.kind == "choice" else list(unit.ids)


def _key(record: dict[str, Any]) -> Key:
    protocol = record.get("protocol", "every_layer")
    return (protocol, record["task"], record["seq"], record["method"], record["mode"], float(record["ratio"]))


def finished(out: Path) -> set[Key]:
    """The conditions whose records the part files in ``out`` hold (empty where there is no folder)."""
    return {_key(r) for r in read_records(out)} if out.is_dir() else set()


def _append(stream: Any, records: list[dict[str, Any]]) -> None:
    stream.write(records_text(records))
    stream.flush()
    os.fsync(stream.fileno())


def _repair_tail(path: Path) -> None:
    """Drop a last line left without its newline by an interrupted write."""
    if not path.exists():
        return
    text = path.read_text(encoding="utf-8")
    if text and not text.endswith("\n"):
        path.write_text(text[: text.rfind("\n") + 1], encoding="utf-8")


@contextmanager
def cpu_threads(model: adapter.Model, options: RunOptions) -> Iterator[int]:
    """Run with `RunOptions.cpu_threads` torch threads where the model is on a CPU; the count (0 off a CPU).

    torch's own default is every core of the machine in every process: two processes on two cores,
    or one beside other jobs, then fight over them (one thread was 5-7x faster than two on a loaded
    2-core machine). The previous count is restored on leaving.
    """
    if next(model.parameters()).device.type != "cpu":
        yield 0
        return
    before, threads = torch.get_num_threads(), options.cpu_threads()
    torch.set_num_threads(threads)
    try:
        yield threads
    finally:
        torch.set_num_threads(before)


def _check_config(out: Path, meta: dict[str, Any], rank: int) -> None:
    """Keep ``config.json`` unless it differs; a config with no record beside it is replaced.

    (A run that failed before its first record must not block the corrected rerun.)
    """
    path = out / "config.json"
    previous = json.loads(path.read_text(encoding="utf-8")) if path.exists() else None
    if previous is not None and previous != meta and (read_records(out) or (out / "records.jsonl").exists()):
        raise ValueError(f"{out} holds a run with other settings ({path}); use another --out folder")
    if previous != meta and rank == 0:
        write_text(path, json.dumps(meta, indent=2, sort_keys=True))


def config_of(model_name: str, settings: Settings, data: DataSettings) -> dict[str, Any]:
    """What ``config.json`` records: a resumed run must have the same."""
    return {"model": model_name, "protocol": settings.to_dict(), "data": data.to_dict()}


def run(
    model: adapter.Model,
    settings: Settings,
    data: DataSettings,
    out: str | os.PathLike,
    *,
    options: RunOptions | None = None,
    model_name: str = "",
    progress: bool = True,
    label: str = "faithfulness",
) -> FaithfulnessRun | None:
    """Run (or resume) a faithfulness run on every data set; its result on rank 0 (None on others).

    Every record is appended to ``out`` as its pass finishes: an interrupted run resumes where it
    stopped when called again with the same settings (``label`` names it on the progress bar).
    ``options.rows_per_pass`` bounds how many
    rows (conditions x sequences of one unit) share one forward pass (None: 64 on a GPU, no
    stacking on a CPU; see `contribution_lens.faithfulness.removal.masked_forward`), and
    ``options.resamples`` bootstrap replicates give the intervals.
    """
    options = options or RunOptions()
    out_dir = Path(out)
    rank, world = rank_and_world()
    units = build_units(model, data)  # before writing anything: bad data fails early
    check_protocols(settings, units)
    plan_layers = adapter.check_layers(model, list(settings.layers) if settings.layers is not None else None)
    out_dir.mkdir(parents=True, exist_ok=True)
    barrier(world)
    _check_config(out_dir, config_of(model_name, settings, data), rank)
    barrier(world)
    part = out_dir / f"part-{rank}.jsonl"
    _repair_tail(part)
    done = finished(out_dir)
    plan = plan_units(model, units, data, settings, done, layers=plan_layers, share=(rank, world))
    if plan and rank == 0:
        # The folder's saved run (if any) is out of date until this one is saved: `FaithfulnessRun.load`
        # reads the part files meanwhile.
        (out_dir / STATE).unlink(missing_ok=True)
    bar = tqdm(
        total=sum(work.passes for work in plan),
        desc=f"{label} passes (rank {rank})",
        unit="pass",
        disable=not progress or rank != 0,
    )  # tqdm's "<remaining" field is the ETA
    with open(part, "a", encoding="utf-8") as stream, bar, cpu_threads(model, options):
        for work in plan:
            for records, passes in _run_unit(model, work, settings, rows_per_pass=options.rows_per_pass):
                if records:
                    _append(stream, records)
                bar.update(passes)
    barrier(world)
    if rank != 0:
        return None
    records = merged_records(out_dir)
    result = FaithfulnessRun(records, settings, data, model_name=model_name, resamples=options.resamples)
    result.save(out_dir)  # records.jsonl, the tables and the report
    return result


def check_protocols(settings: Settings, units: Sequence[Unit]) -> None:
    """Refuse a text-only protocol (``prediction``) on multiple-choice data, before any pass."""
    text_only = [name for name in settings.protocols if PROTOCOLS[name].text_only]
    choice = sorted({unit.task for unit in units if unit.kind == "choice"})
    if text_only and choice:
        raise ValueError(
            f"protocol {text_only[0]!r} explains one next-token prediction of a text; "
            f"it does not take multiple-choice data ({', '.join(choice)})"
        )


@dataclass
class Work:
    """What one unit still needs: ratio-0 records and, per removal protocol, conditions to run."""

    unit: Unit
    zero: list[tuple[str, str, str]]  # (protocol, method label, mode)
    todo: dict[str, list[Condition]]

    @property
    def passes(self) -> int:
        """Forward passes, counted in copies of the unit: 1 clean, 1 at ratio 0, 1 per condition."""
        return 1 + bool(self.zero) + sum(len(todo) for todo in self.todo.values())


def plan_units(
    model: adapter.Model,
    units: Sequence[Unit],
    config: DataSettings,
    settings: Settings,
    done: set[Key] | None = None,
    *,
    layers: list[int] | None = None,
    share: tuple[int, int] = (0, 1),
) -> list[Work]:
    """The work left on ``units`` given the records already ``done``: all of it, or one process's ``share``.

    ``share`` is (rank, world size). The first ``world * (len(units) // world)`` units go whole to
    the ranks in turn; each unit left over (all of them where the units are fewer than the
    processes: 4 chunks at a batch size of 8 make one) is split by its passes: its ratio-0 pass and
    its groups of conditions (one method, mode and ratio, with every layer variant) are dealt to the
    ranks in turn, and every rank that holds a part of it runs its scoring pass too. A pass computes
    the same batch whichever process runs it, so the records are those of one process. The shares
    depend on ``units`` alone, never on ``done``: ranks that read the records at different moments
    still agree on them.
    """
    done = done or set()
    if layers is None:
        layers = adapter.check_layers(model, list(settings.layers) if settings.layers is not None else None)
    rank, world = share
    whole = world * (len(units) // world)
    plan = []
    for index, unit in enumerate(units):
        if index < whole and index % world != rank:
            continue
        dealt = index >= whole and world > 1
        ratios = (config.choice_ratios or settings.ratios) if unit.kind == "choice" else settings.ratios
        keys = _unit_keys(unit)

        def missing(name: str, condition: Condition) -> bool:
            label, mode, ratio = condition.label, condition.mode, float(condition.ratio)
            return any((name, unit.task, key, label, mode, ratio) not in done for key in keys)  # noqa: B023

        zero = [
            (name, c.label, c.mode)
            for name in settings.protocols
            for method, ranking in settings.variants()
            for c in [Condition(method, ranking, mode, 0.0) for mode in settings.modes]
            if 0 in ratios and missing(name, c) and not (dealt and rank != 0)
        ]
        groups: dict[tuple[str, str, str, float], int] = {}  # numbered 1, 2, ...: the ratio-0 pass is group 0

        def mine(name: str, condition: Condition) -> bool:
            key = (name, condition.label, condition.mode, float(condition.ratio))
            return not dealt or groups.setdefault(key, len(groups) + 1) % world == rank  # noqa: B023

        todo = {
            name: [
                c
                for c in conditions(settings, ratios, PROTOCOLS[name].variants(layers))
                if mine(name, c) and missing(name, c)
            ]
            for name in settings.protocols
        }
        work = Work(unit, zero, {name: c for name, c in todo.items() if c})
        if work.zero or work.todo:
            plan.append(work)
    return plan


def _run_unit(
    model: adapter.Model, work: Work, settings: Settings, *, rows_per_pass: int | None
) -> Iterator[tuple[list[dict[str, Any]], int]]:
    """Records of one unit as they complete, with the passes each took."""
    unit = work.unit
    batch = adapter.pad_rows(model, unit.tokens)
    clean = clean_run(model, batch, settings)
    assert clean.logits is not None
    # A protocol's records measure its own positions (prediction: one target token per text).
    names = sorted({name for name, _, _ in work.zero} | set(work.todo))
    base = {name: _unit_records(unit, clean.logits, batch, name) for name in names}
    yield [], 1
    if work.zero:
        # Nothing removed: no mask applies; one pass serves every method, mode and protocol.
        ((_, logits),) = masked_forward(model, batch, clean, PROTOCOLS["every_layer"], [NOTHING_REMOVED])
        zero_rows = {name: _unit_records(unit, logits, batch, name) for name in names}
        yield (
            [
                r
                for name, label, mode in work.zero
                for r in _records(unit, name, label, mode, 0.0, zero_rows[name], base[name])
            ],
            1,
        )
    for name, todo in work.todo.items():
        removal = PROTOCOLS[name]
        n_variants = len(removal.variants(clean.layers))
        pending: dict[tuple[str, str, float], dict[int | None, list[dict[str, Any]]]] = {}
        for condition, logits in masked_forward(model, batch, clean, removal, todo, rows_per_pass=rows_per_pass):
            group_key = (condition.label, condition.mode, condition.ratio)
            group = pending.setdefault(group_key, {})
            group[condition.layer] = _unit_records(unit, logits, batch, name)
            records: list[dict[str, Any]] = []
            if len(group) == n_variants:
                rows = _combine_layers(pending.pop(group_key))
                records = _records(unit, name, condition.label, condition.mode, condition.ratio, rows, base[name])
            yield records, 1


def _records(
    unit: Unit, protocol: str, label: str, mode: str, ratio: float, rows: list[dict], base: list[dict]
) -> list[dict[str, Any]]:
    condition = {"protocol": protocol, "task": unit.task, "kind": unit.kind, "method": label, "mode": mode}
    return [
        {**condition, "ratio": ratio, **row, "clean": clean.get("nll", clean.get("correct"))}
        for row, clean in zip(rows, base, strict=True)
    ]


def _combine_layers(per_layer: dict[int | None, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One record per sequence: the mean over the layers masked one at a time (kept per layer too)."""
    if list(per_layer) == [None]:
        return per_layer[None]
    layers = sorted(layer for layer in per_layer if layer is not None)
    combined = []
    for index, first in enumerate(per_layer[layers[0]]):
        rows = [per_layer[layer][index] for layer in layers]
        if "nll" in first:
            nll = [row["nll"] for row in rows]
            combined.append(
                {**first, "nll": sum(nll) / len(nll), "nll_per_layer": dict(zip(map(str, layers), nll, strict=True))}
            )
            continue
        correct = [float(row["correct"]) for row in rows]
        logprobs = [sum(values) / len(values) for values in zip(*(row["logprobs"] for row in rows), strict=True)]
        combined.append(
            {
                "seq": first["seq"],
                "logprobs": logprobs,
                "pred": max(range(len(logprobs)), key=logprobs.__getitem__),
                "correct": sum(correct) / len(correct),
                "correct_per_layer": dict(zip(map(str, layers), correct, strict=True)),
            }
        )
    return combined


@dataclass(frozen=True)
class RunPlan:
    """What a run will cost before it starts (`plan_run`)."""

    units: int
    passes: int
    forward_seconds: float
    """One plain forward pass of the first unit."""
    seconds: float
    threads: int = 0
    """The torch threads the passes were timed with (0: not on a CPU, or not timed)."""

    def describe(self) -> str:
        minutes = self.seconds / 60
        threads = f" with {self.threads} thread{'s' if self.threads > 1 else ''}" if self.threads else ""
        return (
            f"{self.units} units, {self.passes} forward passes (one plain pass of a unit: "
            f"{self.forward_seconds:.2f} s); estimated {minutes:.1f} min on one process{threads}"
        )


def plan_run(
    model: adapter.Model,
    settings: Settings,
    data: DataSettings,
    *,
    out: str | os.PathLike | None = None,
    time_passes: bool = True,
    options: RunOptions | None = None,
) -> RunPlan:
    """Passes and estimated time of a run (what is left of it, if ``out`` holds records); writes nothing.

    The estimate times one plain forward and one scoring pass of the first unit and scales
    both by each unit's number of tokens: ``sum_u (t_score + (passes_u - 1) t_forward) T_u / T_0``.
    On a CPU the passes are timed with the threads the run will use (``options.threads``, or its
    default: `RunOptions.cpu_threads`).
    """
    units = build_units(model, data)
    done = finished(Path(out)) if out is not None else set()
    plan = plan_units(model, units, data, settings, done)
    passes = sum(work.passes for work in plan)
    if not plan or not time_passes:
        return RunPlan(len(plan), passes, 0.0, 0.0)
    first = adapter.pad_rows(model, plan[0].unit.tokens)
    with cpu_threads(model, options or RunOptions()) as threads:
        adapter.forward(model, first)  # warm-up
        forward = _timed(lambda: adapter.forward(model, first))
        scoring = _timed(lambda: clean_run(model, first, settings))
    size0 = sum(len(t) for t in plan[0].unit.tokens)
    seconds = sum(
        (scoring + (work.passes - 1) * forward) * sum(len(t) for t in work.unit.tokens) / size0 for work in plan
    )
    return RunPlan(len(plan), passes, forward, seconds, threads)


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def merged_records(out: Path) -> list[dict[str, Any]]:
    """Every record of the part files once (a condition redone after a crash counts once), sorted by key."""
    unique = {_key(r): r for r in read_records(out)}
    return [unique[k] for k in sorted(unique)]


def merge_records(out: Path) -> list[dict[str, Any]]:
    """Merge the part files into ``records.jsonl`` (`merged_records`, written)."""
    records = merged_records(out)
    write_text(out / "records.jsonl", records_text(records))
    return records
