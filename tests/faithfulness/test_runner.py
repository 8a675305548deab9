"""The faithfulness run: records, resume, sharding, bad data, every protocol, the dry run."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import assert_self_contained, raises_bad_input
from contribution_lens import adapter, faithfulness


def test_random_control_records_do_not_depend_on_the_batch_size(bundled_model, shared_data, tmp_path) -> None:
    protocol = faithfulness.Settings(methods=("random",), modes=("comprehensiveness",), ratios=(0.5,), rank_by="abs")
    runs = []
    for size in (1, 3):
        boolq = (f"boolq={shared_data / 'boolq' / 'val.jsonl'}",)
        config = small_config(shared_data, data=boolq, max_items=3, batch_size=size)
        faithfulness.run(bundled_model, protocol, config, tmp_path / str(size), progress=False)
        runs.append(read_merged(tmp_path / str(size)))
    assert [r["seq"] for r in runs[0]] == [r["seq"] for r in runs[1]]
    for alone, batched in zip(*runs, strict=True):
        assert alone["logprobs"] == pytest.approx(batched["logprobs"], rel=1e-4, abs=1e-3), alone["seq"]


SMALL = faithfulness.Settings(methods=("attention", "contribution", "random"), ratios=(0.0, 0.5), rank_by="abs")


def small_config(shared_data: Path, **overrides) -> faithfulness.DataSettings:
    settings = {
        "data": (f"gsm8k={shared_data / 'gsm8k' / 'test.jsonl'}", f"boolq={shared_data / 'boolq' / 'val.jsonl'}"),
        "chunk_length": 32,
        "max_chunks": 4,
        "max_items": 2,
        "max_item_tokens": 256,
        "batch_size": 2,
    }
    settings.update(overrides)
    return faithfulness.DataSettings(**settings)


def read_merged(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def small_run(bundled_model, shared_data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("faith") / "run"
    faithfulness.run(bundled_model, SMALL, small_config(shared_data), out, progress=False)
    return out


def test_run_writes_records_summary_and_report(small_run: Path) -> None:
    records = read_merged(small_run)
    # 4 chunks + 2 items, 3 methods x 2 modes x 2 ratios each.
    assert len(records) == (4 + 2) * 3 * 2 * 2
    keys = [(r["protocol"], r["task"], r["seq"], r["method"], r["mode"], r["ratio"]) for r in records]
    assert len(set(keys)) == len(keys) and keys == sorted(keys)
    for r in records:
        if r["ratio"] == 0 and r["kind"] == "lm":
            assert r["nll"] == pytest.approx(r["clean"], rel=1e-6), "ratio 0 must reproduce the clean run"
    summary = faithfulness.FaithfulnessRun.load(small_run).summary
    at_zero = summary[(summary["task"] == "gsm8k") & (summary["ratio"] == 0)]
    assert (at_zero["delta_ppl"].abs() < 1e-4).all() and (at_zero["delta_loss"].abs() < 1e-6).all()
    # Removing half of every query's most contributing keys at every layer must hurt.
    hurt = summary.query("task == 'gsm8k' and ratio == 0.5 and mode == 'comprehensiveness'")
    assert (hurt["delta_loss"] > 0).all()
    html = (small_run / "report.html").read_text()
    assert_self_contained(html)
    assert "delta_ppl" in html and "comprehensiveness" in html
    assert (small_run / "summary.csv").is_file()
    umask = os.umask(0)
    os.umask(umask)
    assert (small_run / "report.html").stat().st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's private 0600


def test_interrupted_run_resumes_without_loss_or_repeats(
    bundled_model, shared_data, small_run: Path, tmp_path, monkeypatch
) -> None:
    out = tmp_path / "resumed"
    shutil.copytree(small_run, out)
    (out / "records.jsonl").unlink()
    part = out / "part-0.jsonl"
    lines = part.read_text().splitlines(keepends=True)
    # Drop the last third of the records and leave half a line, as a killed run would.
    part.write_text("".join(lines[: 2 * len(lines) // 3]) + lines[-1][:20])
    calls = {"n": 0}
    original = adapter.forward

    def counting_forward(*args, **kwargs):
        calls["n"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(adapter, "forward", counting_forward)
    faithfulness.run(bundled_model, SMALL, small_config(shared_data), out, progress=False)
    resumed_calls = calls["n"]
    calls["n"] = 0
    faithfulness.run(bundled_model, SMALL, small_config(shared_data), out, progress=False)
    # 3 units in all (2 of chunks, 1 of items), each 1 clean + 1 ratio-0 + 6 masked passes
    # (the masked conditions of a unit share forward calls).
    assert 0 < resumed_calls < 3 * 8, "only the missing units are redone"
    assert calls["n"] == 0, "a complete run does no forward pass"
    got, want = read_merged(out), read_merged(small_run)
    assert [(r["protocol"], r["task"], r["seq"], r["method"], r["mode"], r["ratio"]) for r in got] == [
        (r["protocol"], r["task"], r["seq"], r["method"], r["mode"], r["ratio"]) for r in want
    ]
    for a, b in zip(got, want, strict=True):
        if "nll" in a:
            assert a["nll"] == pytest.approx(b["nll"], rel=1e-6)
        else:
            assert a["pred"] == b["pred"]


def test_other_settings_in_the_same_folder_are_refused(bundled_model, shared_data, small_run: Path) -> None:
    other = faithfulness.Settings(methods=("attention",), ratios=(0.0, 0.5))
    with raises_bad_input("holds a run with other settings"):
        faithfulness.run(bundled_model, other, small_config(shared_data), small_run, progress=False)


def test_bad_data_fails_before_writing(bundled_model, tmp_path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "no answer field"}\n')
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    short = tmp_path / "short.txt"
    short.write_text("Too short.")
    header = tmp_path / "x_test.csv"
    header.write_text("q,a,b,c,d,answer\nwhat,1,2,3,4,0\n")
    cases = [
        (f"gsm8k={bad}", "lacks field(s) ['answer']"),
        (f"fineweb={empty}", "holds no records"),
        (f"text={short}", "fewer than one chunk of 32"),
        (f"mmlu={header}", "has header"),
    ]
    for spec, message in cases:
        out = tmp_path / "out"
        config = faithfulness.DataSettings(data=(spec,), chunk_length=32)
        with pytest.raises((ValueError, FileNotFoundError), match=re.escape(message)):
            faithfulness.run(bundled_model, SMALL, config, out, progress=False)
        assert not out.exists(), "nothing may be written for bad input"
    with raises_bad_input("data: expected NAME=PATH with an existing file or folder"):
        faithfulness.DataSettings(data=(f"text={tmp_path / 'missing.txt'}",))
    with raises_bad_input("nothing to evaluate"):
        faithfulness.DataSettings()


def test_torchrun_two_processes_merge_to_the_single_process_result(shared_data, small_run: Path, tmp_path) -> None:
    out = tmp_path / "ddp"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "contribution_lens.cli", "faithfulness",
        "--data", f"gsm8k={shared_data / 'gsm8k' / 'test.jsonl'}",
        "--data", f"boolq={shared_data / 'boolq' / 'val.jsonl'}",
        "--methods", "attention,contribution,random", "--ratios", "0,0.5", "--rank-by", "abs",
        "--chunk-length", "32", "--max-chunks", "4", "--max-items", "2", "--max-item-tokens", "256",
        "--batch-size", "2", "--out", str(out),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in out.glob("part-*.jsonl")) == ["part-0.jsonl", "part-1.jsonl"]
    got, want = read_merged(out), read_merged(small_run)
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert (a["task"], a["seq"], a["method"], a["mode"], a["ratio"]) == (
            b["task"], b["seq"], b["method"], b["mode"], b["ratio"]
        )  # fmt: skip
        if "nll" in a:
            assert a["nll"] == pytest.approx(b["nll"], rel=1e-5)
        else:
            assert a["pred"] == b["pred"]


def shares(units: int, world: int, done=None) -> list[list[tuple]]:
    """Each rank's (unit, pass) pieces of a run of ``units`` one-chunk units (``("zero", ...)``: the ratio-0 pass)."""
    import torch

    from contribution_lens.faithfulness.runner import Unit, plan_units

    chunks = [Unit("gsm8k", "lm", [str(i)], [torch.arange(8)], [], []) for i in range(units)]
    config = faithfulness.DataSettings(data=("gsm8k",), max_chunks=units)
    out = []
    for rank in range(world):
        plan = plan_units(None, chunks, config, SMALL, done, layers=[0, 1], share=(rank, world))
        out.append(
            [(w.unit.ids[0], "zero", p, m, mode) for w in plan for p, m, mode in w.zero]
            + [(w.unit.ids[0], p, c) for w in plan for p, todo in w.todo.items() for c in todo]
        )
    return out


@pytest.mark.parametrize("units", [1, 3, 4])
def test_processes_share_the_passes_when_the_units_are_few(units: int) -> None:
    """Every piece of the one-process plan goes to exactly one of two ranks, and both get work.

    Failed before: work was split by whole units (``--batch-size`` chunks), so with 4 chunks at the
    default batch of 8 the second process did nothing.
    """
    (alone,) = shares(units, 1)
    ranks = shares(units, 2)
    assert all(ranks), "every rank has work"
    assert sorted(map(repr, ranks[0] + ranks[1])) == sorted(map(repr, alone)), "each piece once"
    if units % 2:  # the unit left over is dealt pass by pass: half its groups each, the ratio-0 pass to rank 0
        last = str(units - 1)
        counts = [len([p for p in r if p[0] == last and p[1] != "zero"]) for r in ranks]
        assert abs(counts[0] - counts[1]) <= max(counts) // 2, counts
    # A rank that reads the records after the other wrote its share still takes the same share.
    written = {(p[1], "gsm8k", p[0], p[2].label, p[2].mode, float(p[2].ratio)) for p in ranks[0] if p[1] != "zero"}
    assert shares(units, 2, written)[1] == ranks[1]


STORY = (
    "The old lighthouse keeper climbed the stairs every evening to light the lamp. Ships passed far out at sea, "
    "and the keeper wrote their names in a book. One winter a storm broke the great window, and the keeper "
    "carried a lantern up and down the stairs all night so that the light never went out."
)


def test_torchrun_two_processes_share_one_unit_and_write_the_records_of_one(bundled_model, tmp_path) -> None:
    """Two chunks at the default batch of 8 are one unit: both processes work, the records are byte-identical."""
    (tmp_path / "story.txt").write_text(STORY, encoding="utf-8")
    story = f"text={tmp_path / 'story.txt'}"
    protocol = faithfulness.Settings(methods=("attention", "random"), ratios=(0.0, 0.5), rank_by="abs")
    config = faithfulness.DataSettings(data=(story,), chunk_length=32, max_chunks=2)
    options = faithfulness.RunOptions(threads=1, resamples=100)
    faithfulness.run(bundled_model, protocol, config, tmp_path / "one", options=options, progress=False)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "contribution_lens.cli", "faithfulness", "--data", story, "--methods", "attention,random",
        "--ratios", "0,0.5", "--rank-by", "abs", "--chunk-length", "32", "--max-chunks", "2",
        "--threads", "1", "--bootstrap", "100", "--out", str(tmp_path / "two"),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    parts = [(tmp_path / "two" / f"part-{rank}.jsonl").read_text().splitlines() for rank in (0, 1)]
    assert all(parts), "both processes wrote records"
    assert (tmp_path / "two" / "records.jsonl").read_bytes() == (tmp_path / "one" / "records.jsonl").read_bytes()


# Every protocol that takes multiple-choice data (``prediction`` explains texts only; test_removal runs it).
MASKING = tuple(name for name, protocol in faithfulness.PROTOCOLS.items() if not protocol.text_only)
FULL = faithfulness.Settings(
    methods=("attention", "value_weighted", "contribution", "random"),
    ratios=(0.0, 0.2, 0.5),
    layers=(2, 20),
    protocols=MASKING,
)


def full_config(shared_data: Path) -> faithfulness.DataSettings:
    winogrande = f"winogrande={shared_data / 'winogrande' / 'dev_partial_scoring_llmfoundry.jsonl'}"
    gsm8k = f"gsm8k={shared_data / 'gsm8k' / 'test.jsonl'}"
    return small_config(shared_data, data=(gsm8k, winogrande), max_chunks=2, max_items=2)


@pytest.fixture(scope="module")
def full_run(bundled_model, shared_data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("full") / "run"
    options = faithfulness.RunOptions(resamples=200)
    faithfulness.run(bundled_model, FULL, full_config(shared_data), out, options=options, progress=False)
    return out


def test_every_protocol_writes_intervals_aopc_and_verdicts(full_run: Path) -> None:
    import pandas as pd

    summary = pd.read_csv(full_run / "summary.csv")
    assert set(summary["protocol"]) == set(MASKING) and len(MASKING) >= 3
    text = summary[summary["task"] == "gsm8k"]
    assert text[["delta_loss", "ci_low", "ci_high"]].notna().all().all()
    assert (text["ci_low"] <= text["delta_loss"] + 1e-12).all() and (
        text["delta_loss"] <= text["ci_high"] + 1e-12
    ).all()
    at_zero = text[text["ratio"] == 0]
    assert len(at_zero) == 3 * 5 * 2 and (at_zero["delta_loss"].abs() < 1e-6).all(), "ratio 0 removes nothing"
    choice = summary[summary["task"] == "winogrande"]
    assert choice[["accuracy", "ci_low", "ci_high", "chance"]].notna().all().all() and (choice["chance"] == 0.5).all()
    aopc = pd.read_csv(full_run / "aopc.csv")
    assert list(aopc.columns) == ["protocol", "task", "mode", "method", "aopc", "ci_low", "ci_high", "ratios"]
    assert len(aopc) == 3 * 2 * 5 and set(aopc["ratios"]) == {"0.2,0.5"}
    verdicts = pd.read_csv(full_run / "verdicts.csv")
    assert list(verdicts.columns) == [
        "protocol", "task", "mode", "better", "worse", "difference", "ci_low", "ci_high", "verdict"
    ]  # fmt: skip
    assert set(verdicts["verdict"]) <= {"better", "worse", "indistinguishable"}
    assert len(verdicts) == 3 * 2 * 5  # 2 chain pairs + contribution vs attention, signed, random
    records = read_merged(full_run)
    one_layer = [r for r in records if r["protocol"] == "one_layer" and r["ratio"] > 0 and r["kind"] == "lm"]
    for r in one_layer:
        assert sorted(r["nll_per_layer"]) == ["2", "20"]
        assert r["nll"] == pytest.approx(sum(r["nll_per_layer"].values()) / 2)
    html = (full_run / "report.html").read_text()
    assert_self_contained(html)
    assert html.index("<h2>Verdicts</h2>") < html.index("Plotly.newPlot"), "the report leads with the verdicts"
    assert "(comprehensiveness, input-token deletion): Δloss difference" in html
    assert "chance is 0.500" in html


def test_dry_run_counts_the_passes_and_writes_nothing(bundled_model, shared_data, full_run: Path, tmp_path) -> None:
    config = full_config(shared_data)
    plan = faithfulness.plan_run(bundled_model, FULL, config, out=tmp_path / "new")
    # 3 units (1 of chunks; the items' options, at most batch_size sequences a pass, make 2); per unit 1 clean
    # + 1 at ratio 0 + 5 ranked methods x 2 modes x 2 ratios for every_layer and input_deletion, and twice that
    # for one_layer (2 layers).
    assert plan.passes == 3 * (2 + 20 + 20 + 40)
    assert plan.seconds > plan.forward_seconds > 0
    assert f"{plan.passes} forward passes" in plan.describe()
    one = faithfulness.plan_run(bundled_model, FULL, config, options=faithfulness.RunOptions(threads=1))
    assert one.threads == 1 and one.describe().endswith("on one process with 1 thread"), "timed as the run runs"
    assert not (tmp_path / "new").exists()
    assert faithfulness.plan_run(bundled_model, FULL, config, out=full_run).passes == 0, "a finished run has no work"


def test_a_multiple_choice_pass_holds_at_most_batch_size_sequences(bundled_model, tmp_path) -> None:
    # Failed before: --batch-size counted items, so 8 four-option MMLU items made a 32-sequence pass (Gemma 3's
    # logits alone over 8 GB; the 24 GB machine killed the run).
    from conftest import winogrande_file
    from contribution_lens.faithfulness.runner import build_units

    wino = winogrande_file(tmp_path / "wino.jsonl")
    for batch_size in (1, 3, 4):
        config = faithfulness.DataSettings(data=(f"winogrande={wino}",), batch_size=batch_size, max_items=12)
        units = build_units(bundled_model, config)
        assert all(len(unit.tokens) <= max(batch_size, 2) for unit in units), [len(u.tokens) for u in units]
        items = [item for unit in units for item in unit.items]
        assert len(items) == 12 and all(len(rows) == 2 for _, _, rows in items)  # every item whole, in one pass
        assert sum(len(unit.tokens) for unit in units) == 24
