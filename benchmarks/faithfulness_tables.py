"""Markdown tables of faithfulness runs (the CSVs written by ``contribution-lens faithfulness``).

Run: ``python benchmarks/faithfulness_tables.py OUT_DIR [OUT_DIR ...]``. Per folder it prints the
verdicts in words (``verdicts.csv``), the AOPC with 95% intervals (``aopc.csv``), and per text
task, protocol and mode the Δloss per method at each ratio with its interval; for
multiple-choice tasks the accuracy with its interval and the chance line.
"""

import sys
from pathlib import Path

import pandas as pd

from contribution_lens.faithfulness.report import chance_sentences, verdict_sentence

ORDER = [
    "attention",
    "value_weighted",
    "kobayashi",
    "output_normalized",
    "contribution",
    "contribution:signed",
    "random",
]


def with_interval(value: float, low: float, high: float) -> str:
    return f"{value:.3g} [{low:.3g}, {high:.3g}]"


def table(frame: pd.DataFrame, column: str) -> str:
    cells = frame.assign(cell=[with_interval(r[column], r["ci_low"], r["ci_high"]) for _, r in frame.iterrows()])
    pivot = cells.pivot_table(index="method", columns="ratio", values="cell", aggfunc="first")
    order = [m for m in ORDER if m in pivot.index] + [m for m in pivot.index if m not in ORDER]
    pivot = pivot.reindex(order)
    lines = [
        "| method | " + " | ".join(f"{c:g}" for c in pivot.columns) + " |",
        "|---" * (len(pivot.columns) + 1) + "|",
    ]
    lines += [f"| {method} | " + " | ".join(row) + " |" for method, row in pivot.iterrows()]
    return "\n".join(lines)


def main() -> None:
    for folder in map(Path, sys.argv[1:]):
        summary = pd.read_csv(folder / "summary.csv")
        verdicts = pd.read_csv(folder / "verdicts.csv")
        print(f"\n### {folder}\n")
        with_task = verdicts["task"].nunique() > 1
        for _, row in verdicts.iterrows():
            print(f"- {verdict_sentence(row, with_task=with_task)}")
        aopc = pd.read_csv(folder / "aopc.csv")
        if not aopc.empty:
            aopc["aopc"] = [with_interval(r["aopc"], r["ci_low"], r["ci_high"]) for _, r in aopc.iterrows()]
            print(f"\n**AOPC** (mean Δloss over ratios {aopc['ratios'].iloc[0]})\n")
            pivot = aopc.pivot_table(index="method", columns=["protocol", "mode"], values="aopc", aggfunc="first")
            print("| method | " + " | ".join(f"{p}, {m}" for p, m in pivot.columns) + " |")
            print("|---" * (len(pivot.columns) + 1) + "|")
            for method, row in pivot.iterrows():
                print(f"| {method} | " + " | ".join(row.fillna("")) + " |")
        for (task, protocol, mode), part in summary.groupby(["task", "protocol", "mode"]):
            n = int(part["n"].max())
            if "delta_loss" in part and part["delta_loss"].notna().any():
                clean = part.loc[part["ratio"] == 0, "ppl"].mean()
                print(f"\n**{task}, {protocol}, {mode}** ({n} chunks, clean PPL {clean:.2f}): Δloss (nats/token)\n")
                print(table(part, "delta_loss"))
            else:
                frame = part.assign(above_chance=part["clean_ci_low"] > part["chance"])
                print(f"\n**{task}, {protocol}, {mode}**: {chance_sentences(frame)[0]}\n")
                print(table(part, "accuracy"))


if __name__ == "__main__":
    main()
