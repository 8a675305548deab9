"""``benchmarks/claims_table.py``: the claims x families table is read from the runs' own claims.json."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "claims_table.py"


def table_of(*paths: Path) -> str:
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
