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
* ``verdicts.csv`` -- the claimed ordering judged pair by pair (`contribution_lens.stats`);
* ``report.html`` -- the verdicts in words, then the curves; written by rank 0 at the end.

Under ``torchrun --nproc_per_node N`` each rank takes every N-th unit of work (a batch of
chunks or items, in a fixed order) and rank 0 merges once all ranks are done.
"""

import json
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from contribution_lens import adapter, data, faithfulness_report, stats
from contribution_lens.faithfulness import (
    NOTHING_REMOVED,
    PROTOCOLS,
    Condition,
    Protocol,
    clean_run,
    conditions,
    continuation_logprob,
    masked_forward,
    perplexity,
    token_nll,
)

Key = tuple[str, str, str, str, str, float]


@dataclass(frozen=True)
class RunConfig:
    """What to evaluate: text sets (``NAME=PATH``) and multiple-choice sets, and their sizes."""

    lm: tuple[str, ...] = ()
    choice: tuple[str, ...] = ()
    chunk_length: int = 256
    max_chunks: int | None = 200
    max_items: int | None = 200
    max_item_tokens: int = 512
    batch_size: int = 8
    choice_ratios: tuple[float, ...] | None = None
    """Ratios for multiple-choice tasks (they cost one pass per option); None = the protocol's."""

    def __post_init__(self) -> None:
        if not self.lm and not self.choice:
            raise ValueError("nothing to evaluate: give at least one text or multiple-choice data set")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {self.batch_size}")
        if self.chunk_length < 2:
            raise ValueError(f"chunk_length must be at least 2, got {self.chunk_length}")


@dataclass
class Unit:
    """One unit of work: a batch of sequences of one task that share clean and masked passes."""

    task: str
    kind: str  # "lm" or "choice"
    ids: list[str]
    tokens: list[torch.Tensor]
    spans: list[tuple[int, int]]  # continuation [start, end) per sequence ("choice" only)
    items: list[tuple[str, int, list[int]]]  # (item id, label, row indices) ("choice" only)


def task_name(spec: str) -> str:
    return data.split_spec(spec)[0]


def build_units(model: adapter.Model, config: RunConfig) -> list[Unit]:
    """Tokenise every data set and cut it into units, in a deterministic order."""
    tokenizer = model.tokenizer
    bos = int(tokenizer.bos_token_id)
    units: list[Unit] = []
    for spec in config.lm:
        task = task_name(spec)
        adapter.check_length(model, config.chunk_length, "the chunk length")
        texts = data.load_texts(spec)
        chunks = data.chunk_tokens(
            tokenizer, texts, length=config.chunk_length, bos_token_id=bos, max_chunks=config.max_chunks
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
                ctx = [bos, *tokenizer(context, add_special_tokens=False)["input_ids"]]
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
        for start in range(0, len(kept), config.batch_size):
            unit = Unit(task, "choice", [], [], [], [])
            for item, seqs, spans in kept[start : start + config.batch_size]:
                rows = list(range(len(unit.tokens), len(unit.tokens) + len(seqs)))
                unit.ids += [f"{item.item_id}#{k}" for k in range(len(seqs))]
                unit.tokens += seqs
                unit.spans += spans
                unit.items.append((item.item_id, item.label, rows))
            units.append(unit)
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


def _unit_records(unit: Unit, logits: torch.Tensor, batch: adapter.TokenBatch) -> list[dict[str, Any]]:
    if unit.kind == "choice":
        return _item_records(unit, logits, batch)
    nll, count = token_nll(logits, batch.tokens, batch.attention_mask)
    return [{"seq": i, "nll": n, "tokens": c} for i, n, c in zip(unit.ids, nll.tolist(), count.tolist(), strict=True)]


def _unit_keys(unit: Unit) -> list[str]:
    return [item_id for item_id, _, _ in unit.items] if unit.kind == "choice" else list(unit.ids)


def _key(record: dict[str, Any]) -> Key:
    protocol = record.get("protocol", "every_layer")
    return (protocol, record["task"], record["seq"], record["method"], record["mode"], float(record["ratio"]))


def read_records(out: Path) -> list[dict[str, Any]]:
    """Every complete record in the part files (a line cut short by a crash is ignored)."""
    records = []
    for part in sorted(out.glob("part-*.jsonl")):
        for line in part.read_text(encoding="utf-8").splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def _append(stream: Any, records: list[dict[str, Any]]) -> None:
    stream.write("".join(json.dumps(r, sort_keys=True) + "\n" for r in records))
    stream.flush()
    os.fsync(stream.fileno())


def _repair_tail(path: Path) -> None:
    """Drop a last line left without its newline by an interrupted write."""
    if not path.exists():
        return
    text = path.read_text(encoding="utf-8")
    if text and not text.endswith("\n"):
        path.write_text(text[: text.rfind("\n") + 1], encoding="utf-8")


def _distributed() -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    return rank, world


def _check_config(out: Path, meta: dict[str, Any], rank: int) -> None:
    """Keep ``config.json`` unless it differs; a config with no record beside it is replaced.

    (A run that failed before its first record must not block the corrected rerun.)
    """
    path = out / "config.json"
    previous = json.loads(path.read_text(encoding="utf-8")) if path.exists() else None
    if previous is not None and previous != meta and (read_records(out) or (out / "records.jsonl").exists()):
        raise ValueError(f"{out} holds a run with other settings ({path}); use another --out folder")
    if previous != meta and rank == 0:
        staging = path.with_suffix(".tmp")
        staging.write_text(json.dumps(meta, indent=2, sort_keys=True), encoding="utf-8")
        os.replace(staging, path)


def run_faithfulness(
    model: adapter.Model,
    config: RunConfig,
    protocol: Protocol,
    out: str | os.PathLike,
    *,
    model_name: str = "",
    progress: bool = True,
    resamples: int = 1000,
    rows_per_pass: int | None = None,
) -> pd.DataFrame | None:
    """Run (or resume) the protocol on every data set; returns the summary on rank 0.

    ``resamples`` bootstrap replicates give the intervals; ``rows_per_pass`` bounds how many
    rows (conditions x sequences of one unit) share one forward pass (None: 64 on a GPU, no
    stacking on a CPU; see `faithfulness.masked_forward`).
    """
    out_dir = Path(out)
    rank, world = _distributed()
    units = build_units(model, config)  # before writing anything: bad data fails early
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"model": model_name, "protocol": protocol.to_dict(), "data": _config_dict(config)}
    if world > 1:
        dist.barrier()
    _check_config(out_dir, meta, rank)
    if world > 1:
        dist.barrier()
    part = out_dir / f"part-{rank}.jsonl"
    _repair_tail(part)
    done = {_key(r) for r in read_records(out_dir)}
    plan = plan_units(model, units[rank::world], config, protocol, done)
    bar = tqdm(
        total=sum(work.passes for work in plan),
        desc=f"faithfulness passes (rank {rank})",
        unit="pass",
        disable=not progress or rank != 0,
    )  # tqdm's "<remaining" field is the ETA
    with open(part, "a", encoding="utf-8") as stream, bar:
        for work in plan:
            for records, passes in _run_unit(model, work, protocol, rows_per_pass=rows_per_pass):
                if records:
                    _append(stream, records)
                bar.update(passes)
    if world > 1:
        dist.barrier()
    if rank != 0:
        return None
    return _finish(out_dir, model_name, protocol, resamples)


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
    model: adapter.Model, units: Sequence[Unit], config: RunConfig, protocol: Protocol, done: set[Key] | None = None
) -> list[Work]:
    """The work left on ``units`` given the records already ``done``."""
    done = done or set()
    layers = adapter.check_layers(model, list(protocol.layers) if protocol.layers is not None else None)
    plan = []
    for unit in units:
        ratios = (config.choice_ratios or protocol.ratios) if unit.kind == "choice" else protocol.ratios
        keys = _unit_keys(unit)

        def missing(name: str, condition: Condition) -> bool:
            label, mode, ratio = condition.label, condition.mode, float(condition.ratio)
            return any((name, unit.task, key, label, mode, ratio) not in done for key in keys)  # noqa: B023

        zero = [
            (name, c.label, c.mode)
            for name in protocol.protocols
            for method, rank in protocol.variants()
            for c in [Condition(method, rank, mode, 0.0) for mode in protocol.modes]
            if 0 in ratios and missing(name, c)
        ]
        todo = {
            name: [c for c in conditions(protocol, ratios, PROTOCOLS[name].variants(layers)) if missing(name, c)]
            for name in protocol.protocols
        }
        work = Work(unit, zero, {name: c for name, c in todo.items() if c})
        if work.zero or work.todo:
            plan.append(work)
    return plan


def _run_unit(
    model: adapter.Model, work: Work, protocol: Protocol, *, rows_per_pass: int | None
) -> Iterator[tuple[list[dict[str, Any]], int]]:
    """Records of one unit as they complete, with the passes each took."""
    unit = work.unit
    batch = adapter.pad_rows(model, unit.tokens)
    clean = clean_run(model, batch, protocol)
    base = _unit_records(unit, clean.logits, batch)
    yield [], 1
    if work.zero:
        # Nothing removed: no mask applies; one pass serves every method, mode and protocol.
        ((_, logits),) = masked_forward(model, batch, clean, PROTOCOLS["every_layer"], [NOTHING_REMOVED])
        rows = _unit_records(unit, logits, batch)
        yield [r for name, label, mode in work.zero for r in _records(unit, name, label, mode, 0.0, rows, base)], 1
    for name, todo in work.todo.items():
        removal = PROTOCOLS[name]
        n_variants = len(removal.variants(clean.layers))
        pending: dict[tuple[str, str, float], dict[int | None, list[dict[str, Any]]]] = {}
        for condition, logits in masked_forward(model, batch, clean, removal, todo, rows_per_pass=rows_per_pass):
            group_key = (condition.label, condition.mode, condition.ratio)
            group = pending.setdefault(group_key, {})
            group[condition.layer] = _unit_records(unit, logits, batch)
            records: list[dict[str, Any]] = []
            if len(group) == n_variants:
                rows = _combine_layers(pending.pop(group_key))
                records = _records(unit, name, condition.label, condition.mode, condition.ratio, rows, base)
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

    def describe(self) -> str:
        minutes = self.seconds / 60
        return (
            f"{self.units} units, {self.passes} forward passes (one plain pass of a unit: "
            f"{self.forward_seconds:.2f} s); estimated {minutes:.1f} min on one process"
        )


def plan_run(
    model: adapter.Model,
    config: RunConfig,
    protocol: Protocol,
    *,
    out: str | os.PathLike | None = None,
    time_passes: bool = True,
) -> RunPlan:
    """Passes and estimated time of a run (what is left of it, if ``out`` holds records); writes nothing.

    The estimate times one plain forward and one scoring pass of the first unit and scales
    both by each unit's number of tokens: ``sum_u (t_score + (passes_u - 1) t_forward) T_u / T_0``.
    """
    units = build_units(model, config)
    done = {_key(r) for r in read_records(Path(out))} if out is not None and Path(out).is_dir() else set()
    plan = plan_units(model, units, config, protocol, done)
    passes = sum(work.passes for work in plan)
    if not plan or not time_passes:
        return RunPlan(len(plan), passes, 0.0, 0.0)
    first = adapter.pad_rows(model, plan[0].unit.tokens)
    adapter.forward(model, first)  # warm-up
    forward = _timed(lambda: adapter.forward(model, first))
    scoring = _timed(lambda: clean_run(model, first, protocol))
    size0 = sum(len(t) for t in plan[0].unit.tokens)
    seconds = sum(
        (scoring + (work.passes - 1) * forward) * sum(len(t) for t in work.unit.tokens) / size0 for work in plan
    )
    return RunPlan(len(plan), passes, forward, seconds)


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _finish(out_dir: Path, model_name: str, protocol: Protocol, resamples: int) -> pd.DataFrame:
    records = merge_records(out_dir)
    summary, tables = analyse(records, resamples=resamples, seed=protocol.seed)
    for name, frame in (("summary", summary), ("aopc", tables.aopc), ("verdicts", tables.verdicts)):
        staging = out_dir / f"{name}.csv.tmp"
        frame.to_csv(staging, index=False)
        os.replace(staging, out_dir / f"{name}.csv")
    title = f"Faithfulness of importance measures: {model_name}"
    write_report(summary, out_dir / "report.html", title=title, tables=tables)
    return summary


def _config_dict(config: RunConfig) -> dict[str, Any]:
    return {
        "lm": list(config.lm),
        "choice": list(config.choice),
        "chunk_length": config.chunk_length,
        "max_chunks": config.max_chunks,
        "max_items": config.max_items,
        "max_item_tokens": config.max_item_tokens,
        "batch_size": config.batch_size,
        "choice_ratios": None if config.choice_ratios is None else list(config.choice_ratios),
    }


def merge_records(out: Path) -> list[dict[str, Any]]:
    """Merge the part files into ``records.jsonl``: one record per key, sorted by key."""
    unique = {_key(r): r for r in read_records(out)}
    records = [unique[k] for k in sorted(unique)]
    staging = out / "records.jsonl.tmp"
    staging.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in records), encoding="utf-8")
    os.replace(staging, out / "records.jsonl")
    return records


GROUP = ["task", "protocol", "method", "mode", "ratio"]


def analyse(
    records: list[dict[str, Any]], *, resamples: int = 1000, seed: int = 0
) -> tuple[pd.DataFrame, stats.Tables]:
    """The summary (point values and 95% intervals) and the bootstrap tables of a run's records."""
    if not records:
        raise ValueError("no records to summarise")
    frame = pd.DataFrame(records)
    if "protocol" not in frame:
        frame["protocol"] = "every_layer"
    tables = stats.bootstrap_tables(frame, resamples=resamples, seed=seed)
    rows = []
    for (task, protocol, method, mode, ratio, kind), group in frame.groupby([*GROUP, "kind"]):
        row: dict[str, Any] = dict(zip(GROUP, (task, protocol, method, mode, ratio), strict=True)) | {"n": len(group)}
        if kind == "lm":
            tokens = int(group["tokens"].sum())
            clean_loss, loss = group["clean"].sum() / tokens, group["nll"].sum() / tokens
            ppl = perplexity(group["nll"].sum(), tokens)
            row.update(ppl=ppl, delta_ppl=ppl - perplexity(group["clean"].sum(), tokens), delta_loss=loss - clean_loss)
        else:
            row.update(
                accuracy=group["correct"].astype(float).mean(), clean_accuracy=group["clean"].astype(float).mean()
            )
        rows.append(row)
    intervals = pd.concat(
        [
            tables.delta_loss[[*GROUP, "ci_low", "ci_high"]],
            tables.accuracy[[*GROUP, "ci_low", "ci_high", "clean_ci_low", "clean_ci_high", "chance"]],
        ]
    )
    summary = pd.DataFrame(rows).merge(intervals.astype({"ratio": float}), on=GROUP, how="left")
    return summary, tables


def summarise(records: list[dict[str, Any]], *, resamples: int = 1000, seed: int = 0) -> pd.DataFrame:
    """Per (task, protocol, method, mode, ratio): PPL, ΔPPL, Δloss (text) or accuracy (choice), with intervals."""
    return analyse(records, resamples=resamples, seed=seed)[0]


def mean_over_ratios(summary: pd.DataFrame) -> pd.DataFrame:
    """Mean over the run's nonzero ratios (the AOPC for Δloss), per task, protocol, method and mode."""
    value_columns = [c for c in ("delta_ppl", "delta_loss", "accuracy") if c in summary]
    keys = ["task", "protocol", "mode", "method"] if "protocol" in summary else ["task", "mode", "method"]
    table = summary[summary["ratio"] > 0].groupby(keys)[value_columns].mean()
    return table.dropna(how="all")


write_report = faithfulness_report.write_report


def _curves(summary: pd.DataFrame, task: str, column: str) -> Iterator[tuple[str, Any]]:
    return faithfulness_report.curves(summary, task, column)
