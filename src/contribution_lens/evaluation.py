"""The faithfulness run: data to records (JSONL, resumable, shardable over torchrun) to a report.

Layout of ``out``:

* ``config.json`` -- the protocol and data; a resumed run must match it;
* ``part-{rank}.jsonl`` -- records appended (and flushed) as each forward pass finishes, one
  line per (task, sequence, method, mode, ratio); an interrupted run skips what is there;
* ``records.jsonl`` -- all parts merged, deduplicated and sorted;
* ``summary.csv`` and ``report.html`` -- written by rank 0 at the end.

Under ``torchrun --nproc_per_node N`` each rank takes every N-th unit of work (a batch of
chunks or items, in a fixed order) and rank 0 merges once all ranks are done.
"""

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from contribution_lens import adapter, data, plot, report
from contribution_lens.faithfulness import (
    MODES,
    Protocol,
    clean_run,
    continuation_logprob,
    masked_logits,
    perplexity,
    token_nll,
)

Key = tuple[str, str, str, str, float]


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


def _conditions(protocol: Protocol, ratios: Sequence[float]) -> list[tuple[str, str, float]]:
    return [(m, mode, r) for m in protocol.methods for mode in protocol.modes for r in ratios]


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
    return (record["task"], record["seq"], record["method"], record["mode"], float(record["ratio"]))


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
) -> pd.DataFrame | None:
    """Run (or resume) the protocol on every data set; returns the summary on rank 0."""
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
    mine = units[rank::world]
    lm_conditions = _conditions(protocol, protocol.ratios)
    choice_conditions = _conditions(protocol, config.choice_ratios or protocol.ratios)
    plan = []
    for unit in mine:
        conditions = choice_conditions if unit.kind == "choice" else lm_conditions
        keys = _unit_keys(unit)
        todo = [c for c in conditions if any((unit.task, k, *c) not in done for k in keys)]
        if todo:
            plan.append((unit, todo))
    passes = sum(1 + len({c for c in todo if c[2] > 0}) + any(c[2] == 0 for c in todo) for _, todo in plan)
    bar = tqdm(total=passes, desc=f"faithfulness passes (rank {rank})", unit="pass", disable=not progress or rank != 0)
    with open(part, "a", encoding="utf-8") as stream, bar:
        for unit, todo in plan:
            batch = adapter.pad_rows(model, unit.tokens)
            clean = clean_run(model, batch, protocol)
            clean_records = _unit_records(unit, clean.logits, batch)
            bar.update()
            zero_logits = None
            for method, mode, ratio in todo:
                if ratio == 0:
                    # Nothing removed: the hooks multiply by 1; computed once for all methods.
                    if zero_logits is None:
                        zero_logits = masked_logits(model, batch, clean, method=method, mode=mode, ratio=0.0)
                        bar.update()
                    logits = zero_logits
                else:
                    logits = masked_logits(
                        model, batch, clean, method=method, mode=mode, ratio=ratio, rank_by=protocol.rank_by
                    )
                    bar.update()
                records = []
                for masked, base in zip(_unit_records(unit, logits, batch), clean_records, strict=True):
                    record = {"task": unit.task, "kind": unit.kind, "method": method, "mode": mode, "ratio": ratio}
                    record.update(masked)
                    record["clean"] = base.get("nll", base.get("correct"))
                    records.append(record)
                _append(stream, records)
                done.update(_key(r) for r in records)
    if world > 1:
        dist.barrier()
    if rank != 0:
        return None
    records = merge_records(out_dir)
    summary = summarise(records)
    staging = out_dir / "summary.csv.tmp"
    summary.to_csv(staging, index=False)
    os.replace(staging, out_dir / "summary.csv")
    write_report(summary, out_dir / "report.html", title=f"Faithfulness of importance measures: {model_name}")
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


def summarise(records: list[dict[str, Any]]) -> pd.DataFrame:
    """Per (task, method, mode, ratio): PPL, ΔPPL and Δloss (text) or accuracy (choice)."""
    if not records:
        raise ValueError("no records to summarise")
    frame = pd.DataFrame(records)
    rows = []
    for (task, kind, method, mode, ratio), group in frame.groupby(["task", "kind", "method", "mode", "ratio"]):
        row: dict[str, Any] = {"task": task, "method": method, "mode": mode, "ratio": ratio, "n": len(group)}
        if kind == "lm":
            tokens = int(group["tokens"].sum())
            clean_loss, loss = group["clean"].sum() / tokens, group["nll"].sum() / tokens
            row.update(
                ppl=perplexity(group["nll"].sum(), tokens),
                delta_ppl=perplexity(group["nll"].sum(), tokens) - perplexity(group["clean"].sum(), tokens),
                delta_loss=loss - clean_loss,
            )
        else:
            row.update(accuracy=group["correct"].mean(), clean_accuracy=group["clean"].astype(float).mean())
        rows.append(row)
    return pd.DataFrame(rows)


def mean_over_ratios(summary: pd.DataFrame) -> pd.DataFrame:
    """Area under each curve: the mean over the run's ratios, per task, method and mode."""
    value_columns = [c for c in ("delta_ppl", "delta_loss", "accuracy") if c in summary]
    table = summary.groupby(["task", "mode", "method"])[value_columns].mean()
    return table.dropna(how="all")


def _curves(summary: pd.DataFrame, task: str, column: str) -> Iterator[tuple[str, Any]]:
    subset = summary[summary["task"] == task]
    for mode in MODES:
        rows = subset[subset["mode"] == mode]
        if rows.empty or column not in rows or rows[column].isna().all():
            continue
        series = {m: g.sort_values("ratio")[column].tolist() for m, g in rows.groupby("method")}
        ratios = sorted(rows["ratio"].unique())
        figure = plot.lines(
            series,
            title=f"{task}: {column} vs removal ratio ({mode})",
            x=ratios,
            xaxis_title="removal ratio",
            yaxis_title=column,
        )
        yield f"{task} — {mode} — {column}", figure


def write_report(summary: pd.DataFrame, path: Path, *, title: str) -> Path:
    """HTML with the ΔPPL / Δloss curves of both modes, accuracy curves and the summary tables."""
    sections: list[report.Section] = [("Mean over ratios (area under the curve)", mean_over_ratios(summary))]
    for task in sorted(summary["task"].unique()):
        for column in ("delta_ppl", "delta_loss", "accuracy"):
            sections.extend(_curves(summary, task, column))
    sections.append(("All numbers", summary.set_index(["task", "mode", "method", "ratio"]).sort_index()))
    return report.write_html(path, title, sections)
