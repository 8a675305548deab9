"""``benchmarks/claims_table.py``: the claims x families table is read from the runs' own claims.json."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "claims_table.py"


def table_of(*paths: Path | str) -> str:
    done = subprocess.run([sys.executable, str(SCRIPT), *map(str, paths)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


def row(table: str, statement: str) -> list[str]:
    (line,) = [line for line in table.splitlines() if line.startswith(f"| {statement} |")]
    return [part.strip() for part in line.strip("|").split(" | ")]


def test_each_family_shows_its_own_number_interval_and_verdict(tiny_replication: Path, tmp_path: Path) -> None:
    saved = json.loads((tiny_replication / "claims.json").read_text())
    # A second "family": the same run under another name, one claim's verdict turned around.
    other = json.loads(json.dumps(saved))
    other["model"] = "other-model"
    measured = next(c for c in other["claims"] if c["reason"] is None and c["number"] is not None)
    first_verdict = measured["verdict"]
    measured["verdict"] = "not supported" if first_verdict in ("supported", "partly") else "supported"
    (tmp_path / "other.json").write_text(json.dumps(other))

    table = table_of(tiny_replication / "claims.json", tmp_path / "other.json")
    assert len([line for line in table.splitlines() if line.startswith("| ") and "---" not in line]) == 1 + len(
        saved["claims"]
    )
    for claim in saved["claims"]:
        cells = row(table, claim["statement"])
        if claim["reason"] is not None:
            assert cells[1] == f"no verdict ({claim['reason']})"
        elif claim["number"] is not None:
            number = f"{claim['number']:+.3g} [{claim['low']:+.3g}, {claim['high']:+.3g}]"
            assert cells[1] == f"{claim['verdict']}: {number}", cells
    cells = row(table, measured["statement"])
    assert cells[1].startswith(first_verdict) and cells[2].startswith(measured["verdict"])
    name = Path(saved["model"]).name  # the tiny decoder's checkpoint folder, by its last part
    if first_verdict == "supported":
        assert f"(holds on {name}, fails on other-model)" in cells[3], cells[3]
    elif first_verdict == "not supported":
        assert f"(holds on other-model, fails on {name})" in cells[3], cells[3]
    else:  # partly against not supported: neither holds
        assert "holds on" not in cells[3], cells[3]
    assert f"- `{name}`: size {saved['size']}" in table
    short = subprocess.run([sys.executable, str(SCRIPT), "--short", str(tiny_replication / "claims.json")],
                           capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert [row(short, f"`{claim['id']}`")[1] for claim in saved["claims"]] == [
        row(table, claim["statement"])[1] for claim in saved["claims"]
    ]


def test_a_file_that_is_not_a_replication_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "claims.json"
    path.write_text(json.dumps({"format": "something else"}))
    done = subprocess.run([sys.executable, str(SCRIPT), str(path)], capture_output=True, text=True, check=False)
    assert done.returncode == 1
    assert done.stderr.strip() == f"{path}: not a claims.json written by contribution-lens replicate"


@pytest.mark.parametrize(
    ("verdicts", "expected"),
    [
        ({"a": "supported", "b": "supported", "c": "supported"}, "supported on all 3"),
        ({"a": "no verdict", "b": "no verdict"}, "no verdict on any"),
        ({"a": "partly"}, "partly (one model only)"),
        (
            {"a": "supported", "b": "not supported", "c": "partly"},
            "supported on a; not supported on b; partly on c (holds on a, fails on b)",
        ),
        ({"a": "partly", "b": "not supported"}, "partly on a; not supported on b"),
    ],
)
def test_what_the_families_say_together(verdicts: dict[str, str], expected: str) -> None:
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import claims_table
    finally:
        sys.path.remove(str(SCRIPT.parent))
    assert claims_table.together(verdicts) == expected


# The three runs the README's and docs/results.md's claims tables are printed from, kept in the repository
# (the replicate command of docs/results.md#claims-on-three-families writes each; copied as <model>.json).
ROOT = SCRIPT.parents[1]
KEPT_RUNS = [ROOT / "docs" / "claims" / f"{model}.json" for model in ("smollm2-135m", "gemma3-270m", "qwen2.5-0.5b")]


def printed_block(text: str, first_line: str) -> str:
    """The lines of ``text`` from the table whose header is ``first_line`` to the first blank line after it,
    with the run lines (``- `model`: ...``) that follow a blank line in the script's output."""
    lines = text.splitlines()
    start = lines.index(first_line)
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    block = lines[start:end]
    runs = end + 1
    while runs < len(lines) and lines[runs].startswith("- `"):
        block.append(lines[runs])
        runs += 1
    return "\n".join(block)


@pytest.mark.parametrize(("page", "short"), [("README.md", True), ("docs/results.md", False)])
def test_the_docs_claims_tables_are_what_the_kept_runs_print(page: str, short: bool) -> None:
    printed = table_of(*KEPT_RUNS, *(["--short"] if short else []))
    header = printed.splitlines()[0]
    shown = printed_block((ROOT / page).read_text(encoding="utf-8"), header)
    table_lines = [line for line in printed.splitlines() if line.startswith("|")]
    run_lines = [line for line in printed.splitlines() if line.startswith("- `")]
    # The README shows the table; the results page the table and what each run rests on.
    expected = table_lines if short else [*table_lines, *run_lines]
    assert shown.splitlines() == expected


def test_the_kept_runs_are_the_replications_the_docs_name() -> None:
    for path in KEPT_RUNS:
        saved = json.loads(path.read_text(encoding="utf-8"))
        assert saved["format"].startswith("contribution_lens.Replication/"), path
        assert saved["model"] == path.stem, (path, saved["model"])
        assert path.stat().st_size < 200_000, f"{path} is {path.stat().st_size} bytes: keep claims.json only"
