"""The faithfulness report: verdicts in words first, then Δloss curves with intervals, ΔPPL, accuracy.

Every sentence reads off `contribution_lens.faithfulness.statistics` tables; nothing here computes
a statistic. `contribution_lens.faithfulness.FaithfulnessRun.report` is the way in.
"""

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import plotly.graph_objects as go

from contribution_lens.choices import MODES
from contribution_lens.drawing import html, plot
from contribution_lens.faithfulness import statistics
from contribution_lens.faithfulness.registry import describe


def verdict_sentence(row: Any, *, with_task: bool = False) -> str:
    r"""One verdict row in words, e.g. ``contribution is more faithful than attention (...): ...``.

    Example:
        >>> row = pd.Series({"better": "contribution", "worse": "attention", "mode": "sufficiency",
        ...     "protocol": "every_layer", "task": "gsm8k", "difference": -0.07, "ci_low": -0.1,
        ...     "ci_high": -0.04, "verdict": "better"})
        >>> print(verdict_sentence(row).replace(": ", ":\n"))
        contribution is more faithful than attention (sufficiency, masking at every layer):
        Δloss difference -0.070 [-0.100, -0.040]
    """
    claim = {
        "better": f"{row['better']} is more faithful than {row['worse']}",
        "worse": f"{row['better']} is less faithful than {row['worse']}",
        "indistinguishable": f"{row['better']} and {row['worse']} cannot be told apart",
    }[row["verdict"]]
    where = f"{row['mode']}, {describe(row['protocol'])}" + (f", {row['task']}" if with_task else "")
    numbers = f"{row['difference']:.3f} [{row['ci_low']:.3f}, {row['ci_high']:.3f}]"
    return f"{claim} ({where}): Δloss difference {numbers}"


def verdict_table(verdicts: pd.DataFrame) -> pd.DataFrame:
    with_task = verdicts["task"].nunique() > 1
    words = [verdict_sentence(row, with_task=with_task) for _, row in verdicts.iterrows()]
    return pd.DataFrame({"verdict (AOPC of Δloss, 95% paired-bootstrap interval)": words})


def chance_sentences(accuracy: pd.DataFrame) -> list[str]:
    """Per multiple-choice task: clean accuracy, its interval, the chance line and what follows."""
    sentences = []
    for task, rows in accuracy.groupby("task"):
        row = rows.iloc[0]
        numbers = (
            f"{task}: clean accuracy {row['clean_accuracy']:.3f} [{row['clean_ci_low']:.3f}, "
            f"{row['clean_ci_high']:.3f}] over {row['n']} items; chance is {row['chance']:.3f}."
        )
        if row["above_chance"]:
            sentences.append(f"{numbers} The model is above chance before any masking.")
        else:
            sentences.append(
                f"{numbers} The model is NOT above chance before any masking, so its accuracy curves "
                "cannot show whether a measure is faithful."
            )
    return sentences


def curves(summary: pd.DataFrame, task: str, column: str) -> Iterator[tuple[str, Any]]:
    """One figure per protocol and mode: ``column`` against the ratio, with 95% error bars."""
    subset = summary[summary["task"] == task]
    protocols = sorted(subset["protocol"].unique()) if "protocol" in subset else [None]
    for protocol in protocols:
        part = subset if protocol is None else subset[subset["protocol"] == protocol]
        for mode in MODES:
            rows = part[part["mode"] == mode]
            if rows.empty or column not in rows or rows[column].isna().all():
                continue
            groups = {m: g.sort_values("ratio") for m, g in rows.groupby("method")}
            where = mode if protocol is None else f"{mode}, {describe(protocol)}"
            figure = plot.lines(
                {m: g[column].tolist() for m, g in groups.items()},
                title=f"{task}: {column} vs removal ratio ({where})",
                x=sorted(rows["ratio"].unique()),
                xaxis_title="removal ratio",
                yaxis_title=column,
            )
            if column in ("delta_loss", "accuracy") and "ci_low" in rows:
                for trace, g in zip(figure.data, groups.values(), strict=True):
                    trace.error_y = {
                        "type": "data",
                        "array": (g["ci_high"] - g[column]).tolist(),
                        "arrayminus": (g[column] - g["ci_low"]).tolist(),
                    }
            if column == "accuracy" and "chance" in rows:
                figure.add_hline(y=float(rows["chance"].iloc[0]), line_dash="dot", annotation_text="chance")
            yield f"{task} — {where} — {column}", figure


def figures(summary: pd.DataFrame) -> list[tuple[str, go.Figure]]:
    """Every curve of a run: Δloss, ΔPPL, accuracy, per task, protocol and mode."""
    return [
        section
        for column in ("delta_loss", "delta_ppl", "accuracy")
        for task in sorted(summary["task"].unique())
        for section in curves(summary, task, column)
    ]


def write_report(summary: pd.DataFrame, path: Path, *, title: str, tables: statistics.Tables | None = None) -> Path:
    """HTML: the verdicts in words, chance lines, AOPC, Δloss curves, ΔPPL, accuracy, all numbers."""
    sections: list[html.Section] = []
    if tables is not None and not tables.verdicts.empty:
        sections.append(("Verdicts", verdict_table(tables.verdicts)))
    if tables is not None and not tables.accuracy.empty:
        sections.append(("Multiple choice against chance", " ".join(chance_sentences(tables.accuracy))))
    if tables is not None and not tables.aopc.empty:
        heading = "Area over the perturbation curve: mean Δloss over the nonzero ratios, 95% interval"
        sections.append((heading, tables.aopc.set_index(["task", "protocol", "mode", "method"]).sort_index()))
    sections.extend(figures(summary))
    index = [c for c in ("task", "protocol", "mode", "method", "ratio") if c in summary]
    sections.append(("All numbers", summary.set_index(index).sort_index()))
    return html.write_html(path, title, sections)
