"""Markdown tables of faithfulness runs (``summary.csv`` from ``contribution-lens faithfulness``).

Run: ``python benchmarks/faithfulness_tables.py OUT_DIR [OUT_DIR ...]``. For each text task it prints
Δloss and ΔPPL per method at each ratio for both modes and the mean over ratios, and whether the
paper's ordering (attention < value-weighted < output-normalised < contribution) holds in the
means; for multiple-choice tasks the accuracy per ratio.
"""

import itertools
import sys
from pathlib import Path

import pandas as pd

ORDER = ["attention", "value_weighted", "output_normalized", "contribution"]
ALL = [*ORDER, "random"]


def table(frame: pd.DataFrame, column: str) -> str:
    pivot = frame.pivot_table(index="method", columns="ratio", values=column).reindex(ALL).dropna(how="all")
    pivot["mean"] = pivot.mean(axis=1)
    header = "| method | " + " | ".join(f"{c:g}" if isinstance(c, float) else c for c in pivot.columns) + " |"
    lines = [header, "|---" * (len(pivot.columns) + 1) + "|"]
    for method, row in pivot.iterrows():
        lines.append(f"| {method} | " + " | ".join(f"{v:.3g}" for v in row) + " |")
    return "\n".join(lines)


def ordering(frame: pd.DataFrame, column: str, mode: str) -> str:
    means = frame.groupby("method")[column].mean()
    present = [m for m in ORDER if m in means]
    values = [means[m] for m in present]
    # Comprehensiveness: a more faithful measure hurts more; sufficiency: it hurts less.
    ranked = values if mode == "comprehensiveness" else [-v for v in values]
    holds = all(a < b for a, b in itertools.pairwise(ranked))
    best = max(present, key=lambda m: means[m] if mode == "comprehensiveness" else -means[m])
    control = means.get("random")
    beats = sum((means[m] > control) if mode == "comprehensiveness" else (means[m] < control) for m in present)
    return (
        f"paper ordering {'holds' if holds else 'does not hold'}; best: {best}; "
        f"{beats}/{len(present)} measures beat the random control"
    )


def main() -> None:
    for folder in sys.argv[1:]:
        summary = pd.read_csv(Path(folder) / "summary.csv")
        for task, frame in summary.groupby("task"):
            for mode, part in frame.groupby("mode"):
                n = int(part["n"].max())
                if "delta_loss" in part and part["delta_loss"].notna().any():
                    clean = part.loc[part["ratio"] == 0, "ppl"].mean()
                    verdict = ordering(part, "delta_loss", mode)
                    print(f"\n**{task}, {mode}** ({n} chunks, clean PPL {clean:.2f}): Δloss (nats/token); {verdict}\n")
                    print(table(part, "delta_loss"))
                    print(f"\n**{task}, {mode}**: ΔPPL\n")
                    print(table(part, "delta_ppl"))
                else:
                    clean = part["clean_accuracy"].mean()
                    print(f"\n**{task}, {mode}** ({n} items, clean accuracy {clean:.3f}): accuracy\n")
                    print(table(part, "accuracy"))


if __name__ == "__main__":
    main()
