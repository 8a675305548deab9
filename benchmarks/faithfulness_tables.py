"""Markdown tables of faithfulness runs (the CSVs written by ``contribution-lens faithfulness``).

Run: ``python benchmarks/faithfulness_tables.py [--reference METHOD ...] OUT_DIR [OUT_DIR ...]``.
Per folder it prints the verdicts in words (``verdicts.csv``), the AOPC with 95% intervals
(``aopc.csv``), and per text task, protocol and mode the Δloss per method at each ratio with its
interval; for multiple-choice tasks the accuracy with its interval and the chance line.

``verdicts.csv`` judges the claimed ordering (`contribution_lens.faithfulness.statistics.claimed_pairs`)
only, so a run of other methods (``flow``, the rollouts, ``logit_attribution``) has no verdict there.
``--reference METHOD`` (repeatable) also judges METHOD against every other method of each run that
has it: the verdicts and AOPC are then recomputed from the run's ``records.jsonl`` with the run's own
paired bootstrap (its seed, ``--bootstrap`` resamples), and the AOPC must match ``aopc.csv``.
"""

import argparse
from collections.abc import Sequence
from pathlib import Path
from unittest import mock

import numpy as np
import pandas as pd

from contribution_lens.faithfulness import FaithfulnessRun, statistics
from contribution_lens.faithfulness.report import chance_sentences, verdict_sentence

ORDER = [
    "attention",
    "value_weighted",
    "kobayashi",
    "output_normalized",
    "contribution",
    "contribution:signed",
    "alti",
    "attention_rollout",
    "alti_rollout",
    "flow",
    "flow:signed",
    "logit_attribution",
    "logit_attribution:signed",
    "random",
]


def with_interval(value: float, low: float, high: float) -> str:
    return f"{value:.3g} [{low:.3g}, {high:.3g}]"


def ordered(frame: pd.DataFrame) -> pd.DataFrame:
    """Rows (methods) in `ORDER`, unknown methods after them."""
    order = [m for m in ORDER if m in frame.index] + [m for m in frame.index if m not in ORDER]
    return frame.reindex(order)


def table(frame: pd.DataFrame, column: str) -> str:
    cells = frame.assign(cell=[with_interval(r[column], r["ci_low"], r["ci_high"]) for _, r in frame.iterrows()])
    pivot = ordered(cells.pivot_table(index="method", columns="ratio", values="cell", aggfunc="first"))
    lines = [
        "| method | " + " | ".join(f"{c:g}" for c in pivot.columns) + " |",
        "|---" * (len(pivot.columns) + 1) + "|",
    ]
    lines += [f"| {method} | " + " | ".join(row) + " |" for method, row in pivot.iterrows()]
    return "\n".join(lines)


def judged(folder: Path, references: Sequence[str], resamples: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """AOPC and verdicts of a run, with each reference method judged against every other method.

    `statistics.bootstrap_tables` judges `statistics.claimed_pairs`, which adds the pairs of
    `statistics.COMPARED_WITH`; the references are added there for this call only, so their
    differences come from the same paired draws as every other number of the run.
    """
    run = FaithfulnessRun.load(folder, resamples=resamples)
    methods = sorted(run.frame["method"].unique())
    extra = {ref: tuple(m for m in methods if m != ref) for ref in references if ref in methods}
    with mock.patch.dict(statistics.COMPARED_WITH, extra):
        tables = statistics.bootstrap_tables(run.frame, resamples=run.resamples, seed=run.seed)
    written = pd.read_csv(folder / "aopc.csv")
    keys = ["protocol", "task", "mode", "method"]
    both = written.merge(tables.aopc, on=keys, suffixes=("", "_now"))
    if len(both) != len(written) or not np.allclose(
        both[["aopc", "ci_low", "ci_high"]].to_numpy(float),
        both[["aopc_now", "ci_low_now", "ci_high_now"]].to_numpy(float),
    ):
        raise SystemExit(f"{folder}: the recomputed AOPC differs from aopc.csv; give the run's --bootstrap")
    return tables.aopc, tables.verdicts


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=Path, metavar="OUT_DIR")
    parser.add_argument(
        "--reference", action="append", default=[], help="judge this method against every other (repeatable)"
    )
    parser.add_argument("--bootstrap", type=int, default=1000, help="the runs' --bootstrap (with --reference)")
    args = parser.parse_args(argv)
    for folder in args.folders:
        summary = pd.read_csv(folder / "summary.csv")
        if args.reference:
            aopc, verdicts = judged(folder, args.reference, args.bootstrap)
        else:
            aopc, verdicts = pd.read_csv(folder / "aopc.csv"), pd.read_csv(folder / "verdicts.csv")
        print(f"\n### {folder}\n")
        with_task = verdicts["task"].nunique() > 1
        if verdicts.empty:
            print("- no claimed pair among these methods (see --reference)")
        for _, row in verdicts.iterrows():
            print(f"- {verdict_sentence(row, with_task=with_task)}")
        if not aopc.empty:
            aopc = aopc.assign(aopc=[with_interval(r["aopc"], r["ci_low"], r["ci_high"]) for _, r in aopc.iterrows()])
            print(f"\n**AOPC** (mean Δloss over ratios {aopc['ratios'].iloc[0]})\n")
            pivot = aopc.pivot_table(index="method", columns=["protocol", "mode"], values="aopc", aggfunc="first")
            pivot = ordered(pivot)
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
