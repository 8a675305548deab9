"""The circuit methods compared: a Markdown table from the output folders of ``contribution-lens circuit`` runs.

One row a model, task, method and level: CPR (higher is better) and CMD (lower is better) with their
95 % bootstrap intervals over prompts, the planned passes of the scoring a prompt, and the measured
cost a prompt in forward-pass equivalents: the scoring's seconds (and the curve's) over the seconds
of one plain clean forward pass of the same prompts, timed in the same run (``timing.json``).

    contribution-lens circuit --model smollm2-135m --task ioi --method eap --method random --n 16 --out runs/ioi
    python benchmarks/circuit_table.py runs/*             # every run folder given
    python benchmarks/circuit_table.py --csv all.csv runs/*
"""

import argparse
import json
import math
import sys
from pathlib import Path

import pandas as pd

from contribution_lens.circuits.runner import TABLE, circuit_table


def _interval(value: float, low: float, high: float) -> str:
    return f"{value:.3f} [{low:.3f}, {high:.3f}]"


def _number(value: float, digits: int = 1) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def folder_rows(folder: Path) -> pd.DataFrame:
    """The run's table (recomputed from its result files) with its model and task."""
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    table = circuit_table(folder)
    table.insert(0, "task", config.get("task", "?"))
    table.insert(0, "model", Path(str(config.get("model", "?"))).name)
    return table


def markdown(table: pd.DataFrame) -> str:
    """The Markdown table: model, task, method, level, CPR and CMD with intervals, prompts and costs."""
    header = (
        "| model | task | method | level | prompts | CPR [95 % CI] | CMD [95 % CI] | planned passes a prompt "
        "| measured cost a prompt (scoring) | measured cost a prompt (curve) |"
    )
    lines = [header, "|" + "---|" * 10]
    for row in table.itertuples(index=False):
        lines.append(
            f"| {row.model} | {row.task} | {row.method} | {row.level} | {row.prompts} "
            f"| {_interval(row.cpr, row.cpr_low, row.cpr_high)} | {_interval(row.cmd, row.cmd_low, row.cmd_high)} "
            f"| {_number(row.planned_scoring, 0)} | {_number(row.scoring_cost)} | {_number(row.curve_cost)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path, help="output folders of contribution-lens circuit")
    parser.add_argument("--csv", type=Path, help="also write the rows as CSV here")
    args = parser.parse_args(argv)
    runs = [folder for folder in args.folders if (folder / "config.json").is_file()]
    skipped = [str(folder) for folder in args.folders if folder not in runs]
    if skipped:
        print(f"not run folders (no config.json): {', '.join(skipped)}", file=sys.stderr)
    if not runs:
        print(f"no run folder among {len(args.folders)} given (each holds config.json and {TABLE})", file=sys.stderr)
        return 2
    table = pd.concat([folder_rows(folder) for folder in runs], ignore_index=True)
    table = table.sort_values(["model", "task", "level", "method"], kind="stable").reset_index(drop=True)
    print(markdown(table))
    if args.csv is not None:
        table.to_csv(args.csv, index=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
