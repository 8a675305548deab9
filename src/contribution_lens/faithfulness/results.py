"""A faithfulness run as data: its records, the numbers read off them, its verdicts, figures and report.

`FaithfulnessRun` holds the records of a run (one per text and condition) with the settings
that produced them. Everything else is derived from the records, once, on first use:

* `summary`: per (task, protocol, method, mode, ratio) PPL, ΔPPL and Δloss (text sets) or
  accuracy (multiple choice), with 95% paired-bootstrap intervals;
* `tables`: the bootstrap tables (`contribution_lens.faithfulness.statistics.Tables`): Δloss
  per ratio, AOPC, verdicts, accuracy against chance;
* `verdicts()`, `verdict_sentences()`, `figures()`, `report(path)`.

`save(folder)` writes the files of the run's folder (the run itself in ``faithfulness_run.safetensors``,
through `contribution_lens.files.save_result` as every result; the tables and the page for people),
`FaithfulnessRun.load(folder)` reads a folder back (what `contribution_lens.faithfulness.run` left,
finished or, from its part files, not).

Example:
    >>> records = [
    ...     {"protocol": "every_layer", "task": "t", "kind": "lm", "seq": str(s), "method": m, "mode": "sufficiency",
    ...      "ratio": r, "nll": 10.0 + s + (r if m == "attention" else r / 2), "clean": 10.0 + s, "tokens": 5}
    ...     for s in range(4) for m in ("attention", "contribution") for r in (0.0, 0.5)
    ... ]
    >>> run = FaithfulnessRun(records, Settings(methods=("attention", "contribution"), ratios=(0.0, 0.5),
    ...     modes=("sufficiency",), rank_by="abs"), DataSettings(data=("text",)), resamples=50)
    >>> run.verdicts()[["better", "worse", "verdict"]].values.tolist()
    [['contribution', 'attention', 'better']]
"""

import dataclasses
import json
import os
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import pandas as pd
import plotly.graph_objects as go

from contribution_lens.faithfulness import report, statistics
from contribution_lens.faithfulness.settings import DataSettings, Settings
from contribution_lens.files import load_result, save_result, write_text
from contribution_lens.losses import perplexity

GROUP = ["task", "protocol", "method", "mode", "ratio"]
FILES = (
    "config.json",
    "records.jsonl",
    "summary.csv",
    "aopc.csv",
    "verdicts.csv",
    "report.html",
    "faithfulness_run.safetensors",
)
"""What `FaithfulnessRun.save` writes (``config.json`` only where the run knows its settings)."""
STATE = "faithfulness_run.safetensors"
"""The run itself, as every result is saved (`contribution_lens.files.save_result`)."""


class FaithfulnessRun:
    """The records of a faithfulness run with their settings; every table and figure derives from them."""

    def __init__(
        self,
        records: Sequence[dict[str, Any]],
        settings: Settings | None = None,
        data: DataSettings | None = None,
        *,
        model_name: str = "",
        resamples: int = 1000,
        seed: int | None = None,
    ) -> None:
        if not records:
            raise ValueError("no records: a faithfulness run needs at least one finished condition")
        self.records = list(records)
        self.settings, self.data = settings, data
        self.model_name, self.resamples = model_name, resamples
        self.seed = seed if seed is not None else settings.seed if settings is not None else 0
        """Seed of the bootstrap (the settings' seed by default)."""

    def __repr__(self) -> str:
        tasks = sorted({r["task"] for r in self.records})
        methods = sorted({r["method"] for r in self.records})
        protocols = sorted({r.get("protocol", "every_layer") for r in self.records})
        return (
            f"FaithfulnessRun(model={self.model_name!r}, tasks={tasks}, methods={methods}, "
            f"protocols={protocols}, records={len(self.records)})"
        )

    @property
    def frame(self) -> pd.DataFrame:
        """The records as a table, one row per text and condition (a copy: the run's own tables read the kept one)."""
        return self._frame.copy()

    @property
    def tables(self) -> statistics.Tables:
        """Every number with its paired-bootstrap interval (Δloss, AOPC, verdicts, accuracy); copies, as `frame`."""
        return dataclasses.replace(
            self._tables, **{f.name: getattr(self._tables, f.name).copy() for f in dataclasses.fields(self._tables)}
        )

    @property
    def summary(self) -> pd.DataFrame:
        """Per (task, protocol, method, mode, ratio): PPL, ΔPPL, Δloss or accuracy, with 95% intervals (a copy)."""
        return self._summary.copy()

    @cached_property
    def _frame(self) -> pd.DataFrame:
        frame = pd.DataFrame(self.records)
        if "protocol" not in frame:
            frame["protocol"] = "every_layer"
        return frame

    @cached_property
    def _tables(self) -> statistics.Tables:
        return statistics.bootstrap_tables(self._frame, resamples=self.resamples, seed=self.seed)

    @cached_property
    def _summary(self) -> pd.DataFrame:
        rows = [_summary_row(keys, group) for keys, group in self._frame.groupby([*GROUP, "kind"])]
        intervals = pd.concat(
            [
                self._tables.delta_loss[[*GROUP, "ci_low", "ci_high"]],
                self._tables.accuracy[[*GROUP, "ci_low", "ci_high", "clean_ci_low", "clean_ci_high", "chance"]],
            ]
        )
        return pd.DataFrame(rows).merge(intervals.astype({"ratio": float}), on=GROUP, how="left")

    def aopc(self) -> pd.DataFrame:
        """Area over the perturbation curve (mean Δloss over the nonzero ratios) with its interval."""
        return self._tables.aopc.copy()

    def verdicts(self) -> pd.DataFrame:
        """The claimed ordering judged pair by pair: better, worse or indistinguishable."""
        return self._tables.verdicts.copy()

    def verdict_sentences(self, *, with_task: bool | None = None) -> list[str]:
        """Each verdict in words, with its Δloss difference and interval (naming the task where several are)."""
        if with_task is None:
            with_task = self._frame["task"].nunique() > 1
        return [report.verdict_sentence(row, with_task=with_task) for _, row in self.verdicts().iterrows()]

    def figures(self) -> dict[str, go.Figure]:
        """Δloss, ΔPPL and accuracy against the removal ratio, per task, protocol and mode, each under its title."""
        return dict(report.figures(self.summary))

    def stored_fields(self) -> dict[str, Any]:
        """What `save` keeps of the run (`contribution_lens.files.save_result`): its records and settings."""
        return {
            "records": self.records,
            "settings": self.settings,
            "data": self.data,
            "model_name": self.model_name,
            "resamples": self.resamples,
            "seed": self.seed,
        }

    def report(self, path: str | os.PathLike) -> Path:
        """One self-contained HTML page: verdicts in words first, then the curves and every number."""
        return report.write_report(
            self.summary,
            Path(path),
            title=f"Faithfulness of importance measures: {self.model_name}",
            tables=self.tables,
        )

    def save(self, folder: str | os.PathLike) -> Path:
        """Write `FILES` into ``folder`` (each file atomically); returns the folder."""
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        if self.settings is not None and self.data is not None:
            config = {"model": self.model_name, "protocol": self.settings.to_dict(), "data": self.data.to_dict()}
            write_text(out / "config.json", json.dumps(config, indent=2, sort_keys=True))
        write_text(out / "records.jsonl", records_text(self.records))
        for name, frame in (("summary", self.summary), ("aopc", self.aopc()), ("verdicts", self.verdicts())):
            write_text(out / f"{name}.csv", frame.to_csv(index=False))
        save_result(out / STATE, self, example=STATE)
        self.report(out / "report.html")
        return out

    @classmethod
    def load(cls, folder: str | os.PathLike, *, resamples: int | None = None) -> "FaithfulnessRun":
        """A run folder read back: the run `save` wrote, else (a run still going) its config and part files.

        ``resamples``: the bootstrap's resamples (default: those the run was saved with, else 1000).
        """
        source = Path(folder)
        if (source / STATE).is_file():
            saved = load_result(source / STATE, cls)
            if resamples is not None:
                saved.resamples = resamples
            return saved
        return cls._in_progress(source, 1000 if resamples is None else resamples)

    @classmethod
    def _in_progress(cls, source: Path, resamples: int) -> "FaithfulnessRun":
        """The run of a folder that holds its config and records (or part files) but no saved run."""
        config_path = source / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"{source} holds no faithfulness run (no config.json)")
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
            settings = Settings(**_tuples(config["protocol"]))
            sizes = _tuples(config["data"])
            data = DataSettings(data=(*sizes.pop("lm"), *sizes.pop("choice")), **sizes)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{config_path} is not a faithfulness run's config: {error}") from None
        merged = source / "records.jsonl"
        if merged.is_file():
            records = [json.loads(line) for line in merged.read_text(encoding="utf-8").splitlines() if line]
        else:
            records = read_records(source)
        return cls(records, settings, data, model_name=config.get("model", ""), resamples=resamples)


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


def records_text(records: Sequence[dict[str, Any]]) -> str:
    """Records as JSON lines, keys sorted: the one layout of ``part-*.jsonl`` and ``records.jsonl``."""
    return "".join(json.dumps(r, sort_keys=True) + "\n" for r in records)


def _tuples(fields: dict[str, Any]) -> dict[str, Any]:
    """JSON's lists back to the tuples the settings hold."""
    return {name: tuple(value) if isinstance(value, list) else value for name, value in fields.items()}


def _summary_row(keys: tuple, group: pd.DataFrame) -> dict[str, Any]:
    *named, kind = keys
    row: dict[str, Any] = dict(zip(GROUP, named, strict=True)) | {"n": len(group)}
    if kind == "lm":
        tokens = int(group["tokens"].sum())
        clean_loss, loss = group["clean"].sum() / tokens, group["nll"].sum() / tokens
        ppl = perplexity(group["nll"].sum(), tokens)
        row.update(ppl=ppl, delta_ppl=ppl - perplexity(group["clean"].sum(), tokens), delta_loss=loss - clean_loss)
    else:
        row.update(accuracy=group["correct"].astype(float).mean(), clean_accuracy=group["clean"].astype(float).mean())
    return row


def mean_over_ratios(summary: pd.DataFrame) -> pd.DataFrame:
    """Mean over the run's nonzero ratios (the AOPC for Δloss), per task, protocol, method and mode."""
    value_columns = [c for c in ("delta_ppl", "delta_loss", "accuracy") if c in summary]
    keys = ["task", "protocol", "mode", "method"] if "protocol" in summary else ["task", "mode", "method"]
    table = summary[summary["ratio"] > 0].groupby(keys)[value_columns].mean()
    return table.dropna(how="all")
