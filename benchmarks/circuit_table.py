"""The circuit methods compared: a Markdown table from the output folders of ``contribution-lens circuit`` runs.

One row a model, task, method and level: the counterfactual, the prompts scored and those evaluated
(``in-sample`` where they overlap), MIB's CPR (higher is better) and CMD (lower is better) and the area
under f of the ``|score|`` circuits (``|score| area``, what this package called CPR before it followed
MIB), each with its 95 % bootstrap interval over prompts, the planned passes of the scoring a prompt,
and the measured cost a prompt in forward-pass equivalents: the scoring's seconds (and the curve's) over
the seconds of one plain clean forward pass of the same prompts, timed in the same run (``timing.json``).

    contribution-lens circuit --model smollm2-135m --task ioi --method eap --method random --n 32 --out runs/ioi
    python benchmarks/circuit_table.py runs/*             # every run folder given
    python benchmarks/circuit_table.py --csv all.csv runs/*
"""

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

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


def _split(row: Any) -> str:
    """``scoring 32 / evaluation 32``, or ``all 64, in-sample``."""
    scored, evaluated = f"{row.scored} {row.scored_prompts}", f"{row.evaluated} {row.evaluated_prompts}"
    text = scored if scored == evaluated else f"{scored} / {evaluated}"
    return text + (", in-sample" if str(row.in_sample) == "True" else "")


def markdown(table: pd.DataFrame) -> str:
    """The Markdown table: model, task, counterfactual, split, method, level, CPR, CMD and the |score| area with
    intervals, and the costs."""
    header = (
        "| model | task | counterfactual | scored / evaluated | method | level | CPR [95 % CI] | CMD [95 % CI] "
        "| \\|score\\| area [95 % CI] | planned passes a prompt | measured cost a prompt (scoring) "
        "| measured cost a prompt (curve) |"
    )
    lines = [header, "|" + "---|" * 12]
    for row in table.itertuples(index=False):
        area = _interval(row.absolute_area, row.absolute_area_low, row.absolute_area_high)
        lines.append(
            f"| {row.model} | {row.task} | {row.counterfactual} | {_split(row)} | {row.method} | {row.level} "
            f"| {_interval(row.cpr, row.cpr_low, row.cpr_high)} | {_interval(row.cmd, row.cmd_low, row.cmd_high)} "
            f"| {area} | {_number(row.planned_scoring, 0)} | {_number(row.scoring_cost)} | {_number(row.curve_cost)} |"
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
    table = table.sort_values(["model", "task", "counterfactual", "level", "method"], kind="stable")
    table = table.reset_index(drop=True)
    print(markdown(table))
    if args.csv is not None:
        table.to_csv(args.csv, index=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
