"""The claims x families table: the ``claims.json`` of several ``contribution-lens replicate`` runs side by side.

Run: ``python benchmarks/claims_table.py runs/*/claims.json`` (one file per model, in the order given;
``--short`` names each claim by its id, as the README's table does). It prints a Markdown table, one row
a claim (in the order of the first file), one column a model: the verdict, then the claim's number and
its 95 % interval (a claim judged in several settings shows its weakest, as ``claims.md`` does), or the
reason where there is no verdict. The last column says what the families say together, mechanically:
``supported on all 3``, ``no verdict on any``, or each verdict with the models that gave it, and ``holds
on A, fails on B`` where a claim is supported on one model and not supported on another ("partly" is not
"holds"). Under the table it lists each run's model, size, data and dtype, so a reader sees what the
numbers rest on.

It reads JSON only (no model, no torch): the numbers are those the runs wrote.
"""

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def read(paths: Sequence[str | Path]) -> list[dict[str, Any]]:
    """Each file's claims.json; a file that is not a replication's is refused by name."""
    runs = []
    for path in map(Path, paths):
        saved = json.loads(path.read_text(encoding="utf-8"))
        if not str(saved.get("format", "")).startswith("contribution_lens.Replication/"):
            raise SystemExit(f"{path}: not a claims.json written by contribution-lens replicate")
        runs.append(saved)
    return runs


def cell(claim: dict[str, Any] | None) -> str:
    """``supported: +0.12 [+0.05, +0.2]``; ``no verdict (the model is at chance)``; ``-`` where absent."""
    if claim is None:
        return "-"
    if claim["verdict"] == "no verdict":
        return f"no verdict ({claim.get('reason') or 'nothing to judge'})"
    if claim.get("number") is None or claim.get("low") is None or claim.get("high") is None:
        return claim["verdict"]
    return f"{claim['verdict']}: {claim['number']:+.3g} [{claim['low']:+.3g}, {claim['high']:+.3g}]"


def together(verdicts: dict[str, str]) -> str:
    """What the models say together, from each model's verdict (model name -> verdict)."""
    values = set(verdicts.values())
    if len(verdicts) == 1:
        return f"{next(iter(values))} (one model only)"
    if len(values) == 1:
        (only,) = values
        return f"{only} on all {len(verdicts)}" if only != "no verdict" else "no verdict on any"
    by_verdict: dict[str, list[str]] = {}
    for model, verdict in verdicts.items():
        by_verdict.setdefault(verdict, []).append(model)
    words = "; ".join(f"{verdict} on {', '.join(models)}" for verdict, models in by_verdict.items())
    holds = [m for m, v in verdicts.items() if v == "supported"]  # "partly" is not "holds"
    fails = [m for m, v in verdicts.items() if v == "not supported"]
    if holds and fails:
        words += f" (holds on {', '.join(holds)}, fails on {', '.join(fails)})"
    return words


def table(runs: Sequence[dict[str, Any]], *, short: bool = False) -> str:
    """The Markdown table of ``runs`` (claims.json contents), then what each run rests on.

    ``short`` names each claim by its id (``opening_case``) instead of its statement, for the README.
    """
    # A checkpoint folder is named by its last part; a bundled name or a hub id as given.
    models = [Path(run["model"]).name if run["model"].startswith("/") else run["model"] or f"run {i + 1}"
              for i, run in enumerate(runs)]  # fmt: skip
    found = [{claim["id"]: claim for claim in run["claims"]} for run in runs]
    lines = [
        "| claim | " + " | ".join(f"`{m}`" for m in models) + " | the families together |",
        "|---" * (len(models) + 2) + "|",
    ]
    for claim in runs[0]["claims"]:
        each = [claims.get(claim["id"]) for claims in found]
        verdicts = {m: c["verdict"] for m, c in zip(models, each, strict=True) if c is not None}
        row = [f"`{claim['id']}`" if short else claim["statement"], *map(cell, each), together(verdicts)]
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    for model, run in zip(models, runs, strict=True):
        data = run.get("data", {})
        sets = ", ".join(spec.split("=")[0] for spec in [*data.get("lm", []), *data.get("choice", [])])
        lines.append(
            f"- `{model}`: size {run['size']} ({data.get('max_chunks')} chunks of {data.get('chunk_length')} "
            f"tokens a text set, {data.get('max_items')} items a multiple-choice set; {sets}), "
            f"{run.get('dtype', '')} on {run.get('device', '')}"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("claims", nargs="+", help="claims.json files written by contribution-lens replicate")
    parser.add_argument("--short", action="store_true", help="name each claim by its id (the README's table)")
    args = parser.parse_args(argv)
    print(table(read(args.claims), short=args.short), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
