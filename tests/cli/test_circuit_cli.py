"""``contribution-lens circuit``: bad arguments named before loading, a run on a tiny checkpoint, resume, torchrun."""

import inspect
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

import contribution_lens as cl
from contribution_lens import cli, loading
from contribution_lens.circuits import Graph, run_folder, runner

SRC = Path(__file__).resolve().parents[2] / "src"
METHODS = ("--method", "eap", "--method", "activation-patching", "--method", "random")


def run_cli(capsys, *argv: object) -> tuple[int, str, str]:
    """The exit status (argparse's own mistakes exit), stdout and stderr."""
    try:
        status = cli.main([str(a) for a in argv])
    except SystemExit as exit:
        status = int(exit.code or 0)
    captured = capsys.readouterr()
    return status, captured.out, captured.err


@pytest.fixture
def no_model(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(loading, "load_model", refuse)


def tiny_args(tiny_decoder: Path, out: Path, *extra: object) -> list[object]:
    return ["circuit", "--model", tiny_decoder, "--task", "induction", "--n", 6, "--length", 4, *extra, "--out", out]


@pytest.fixture(scope="module")
def tiny_run(tiny_decoder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One single-process run on the tiny checkpoint: eap, activation patching and random, both levels."""
    out = tmp_path_factory.mktemp("circuit") / "run"
    assert cli.main([str(a) for a in tiny_args(tiny_decoder, out, *METHODS)]) == 0
    return out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--method", "nope"], "--method: expected a registered circuit method: eap, eap-ig, activation-patching, "
                               "random, contribution, contribution-ig, information-flow-routes, "
                               "information-flow-routes-last, got 'nope'"),
        (["--method", "eap", "--level", "both"], "--level: expected a level: edge, node, got 'both'"),
        (["--method", "eap", "--method", "eap"], "--method: expected each method once, got 'eap,eap'"),
        (["--method", "eap", "--n", "0"], "--n: expected a positive integer, got 0"),
        (["--method", "eap", "--steps", "0"], "--steps: expected a positive integer, got 0"),
        (["--method", "eap", "--task", "sst2"],
         "--task: expected ioi, induction, capitals or a .jsonl file of prompts, got 'sst2'"),
        (["--method", "eap", "--task", "missing.jsonl"],
         "--task: expected ioi, induction, capitals or a .jsonl file of prompts, got 'missing.jsonl' (no such file)"),
        (["--task", "ioi"], "the following arguments are required: --method (see contribution-lens circuit --help)"),
        (["--method", "eap", "--edges", "grouped"], "argument --edges: invalid choice: 'grouped' (choose from "
                                                    "'native', 'mib') (see contribution-lens circuit --help)"),
        (["--method", "eap", "--counterfactual", "ABC"],
         "--counterfactual: expected one of ioi's: s2-io-flip, abc, got 'ABC'"),
        (["--method", "eap", "--task", "induction", "--counterfactual", "abc"],
         "--counterfactual: expected one of induction's: first-copy-resampled, got 'abc'"),
        (["--method", "eap", "--split", "0"],
         "--split: expected a number in (0, 1) (the share of prompts scored; the rest are evaluated), got '0'"),
        (["--method", "eap", "--split", "1.5"],
         "--split: expected a number in (0, 1) (the share of prompts scored; the rest are evaluated), got '1.5'"),
        (["--method", "eap", "--split", "half"],
         "--split: expected a number in (0, 1) (the share of prompts scored; the rest are evaluated), got 'half'"),
        (["--method", "eap", "--greedy", "always"],
         "argument --greedy: invalid choice: 'always' (choose from 'method', 'yes', 'no') "
         "(see contribution-lens circuit --help)"),
        (["--method", "eap", "--n", "1"],
         "--split: task: 1 prompts, 1 distinct, cannot be split into two non-empty parts with no prompt in both "
         "(or pass --in-sample)"),
    ],
)  # fmt: skip
def test_bad_arguments_are_named_before_the_model_loads(
    argv, message, tiny_decoder, tmp_path, capsys, no_model
) -> None:
    out = tmp_path / "out"
    status, _, err = run_cli(capsys, "circuit", "--model", tiny_decoder, *argv, "--out", out)
    assert status == 2
    assert err == f"contribution-lens: error: {message}\n"
    assert not out.exists()


def test_a_bad_task_file_is_refused_naming_its_line_before_the_model_loads(
    tiny_decoder, tmp_path, capsys, no_model
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"clean": "a b"}\n')
    status, _, err = run_cli(capsys, "circuit", "--model", tiny_decoder, "--task", bad, "--method", "eap",
                             "--out", tmp_path / "out")  # fmt: skip
    assert status == 2
    assert err == f"contribution-lens: error: --task: {bad}, line 1: field 'corrupted' is missing\n"
    good = tmp_path / "good.jsonl"
    good.write_text('{"clean": "a b", "corrupted": "a c", "answer": " d", "foil": " e"}\n')
    status, _, err = run_cli(capsys, "circuit", "--model", tiny_decoder, "--task", good, "--method", "eap",
                             "--counterfactual", "abc", "--out", tmp_path / "out")  # fmt: skip
    assert (status, err) == (2, "contribution-lens: error: --counterfactual: expected none with a task file (its "
                                "corrupted prompts are its own), got 'abc'\n")  # fmt: skip


def test_a_run_writes_scores_curves_the_table_and_the_report(tiny_run: Path, tiny_decoder) -> None:
    table = pd.read_csv(tiny_run / runner.TABLE)
    assert list(table.columns) == list(runner.COLUMNS)
    # activation patching scores nodes: it has no edge level.
    assert list(zip(table["method"], table["level"], strict=True)) == [
        ("eap", "edge"), ("eap", "node"), ("activation-patching", "node"), ("random", "edge"), ("random", "node")
    ]  # fmt: skip
    # Scored on half the prompts, evaluated on the other half (MIB's protocol), pruned, the methods' own selection.
    assert (table["scored"] == "scoring").all() and (table["evaluated"] == "evaluation").all()
    assert (table["scored_prompts"] == 3).all() and (table["evaluated_prompts"] == 3).all()
    assert (~table["in_sample"]).all() and table["prune"].all() and (~table["greedy"]).all()
    assert (table["counterfactual"] == "first-copy-resampled").all()
    assert (table["cpr_low"] <= table["cpr_high"]).all() and (table["cmd_low"] <= table["cmd_high"]).all()
    assert (table["absolute_area_low"] <= table["absolute_area_high"]).all()
    assert (table["scoring_cost"][table["method"] != "random"] > 0).all()
    assert (table["curve_cost"] > 0).all()
    assert table.loc[table["method"] == "eap", "planned_scoring"].tolist() == [4.0, 4.0]  # 2 forward + 1 backward
    scores = cl.CircuitScores.load(tiny_run / "eap" / runner.SCORES)
    assert (scores.method, scores.task, scores.n_prompts, scores.prompts.part) == ("eap", "induction", 3, "scoring")
    curve = cl.CircuitCurve.load(tiny_run / "eap" / "curve-edge.safetensors")
    assert (curve.evaluated.part, curve.in_sample) == ("evaluation", False)
    row = table[(table["method"] == "eap") & (table["level"] == "edge")].iloc[0]
    assert row["cpr"] == pytest.approx(curve.cpr) and row["cmd"] == pytest.approx(curve.cmd)
    assert row["absolute_area"] == pytest.approx(curve.absolute_area)
    report = (tiny_run / runner.REPORT).read_text()
    assert report.count("Faithfulness by circuit size") == 2 and "evaluated on the others" in report
    config = json.loads((tiny_run / "config.json").read_text())
    assert (config["prompts"], config["scoring_prompts"], config["evaluation_prompts"], config["split"]) == (
        6,
        3,
        3,
        0.5,
    )
    assert not list(tiny_run.rglob("*.part-*")) and not (tiny_run / ".lock").exists()


def test_a_killed_run_resumes_keeping_each_finished_method(
    tiny_decoder, tiny_run, tmp_path, capsys, monkeypatch
) -> None:
    out = tmp_path / "run"
    real_curve, real_scores = runner.circuit_curve, runner.circuit_scores

    def killed(model, task, scores, level, **kwargs):
        if scores.method == "random":
            raise KeyboardInterrupt
        return real_curve(model, task, scores, level, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(runner, "circuit_curve", killed)
        status, _, err = run_cli(capsys, *tiny_args(tiny_decoder, out, "--method", "eap", "--method", "random"))
    assert (status, err.splitlines()[-1]) == (130, "contribution-lens: error: interrupted")
    eap_files = {p: p.stat().st_mtime_ns for p in (out / "eap").iterdir()}
    assert {p.name for p in eap_files} == {runner.SCORES, "curve-edge.safetensors", "curve-node.safetensors",
                                           "timing.json"}  # fmt: skip
    assert not (out / runner.TABLE).exists()

    calls: list[str] = []
    monkeypatch.setattr(runner, "circuit_scores", lambda *a, **k: calls.append(a[2]) or real_scores(*a, **k))
    monkeypatch.setattr(runner, "circuit_curve", lambda *a, **k: calls.append(a[2].method) or real_curve(*a, **k))
    status, _, err = run_cli(capsys, *tiny_args(tiny_decoder, out, "--method", "eap", "--method", "random"))
    assert status == 0, err
    assert calls == ["random", "random"]  # random's scores were kept; its two curves run; eap is not redone
    assert {p: p.stat().st_mtime_ns for p in (out / "eap").iterdir()} == eap_files
    resumed, whole = pd.read_csv(out / runner.TABLE), pd.read_csv(tiny_run / runner.TABLE)
    whole = whole[whole["method"] != "activation-patching"].reset_index(drop=True)
    columns = ["method", "level", "cpr", "cmd", "cpr_low", "cmd_high"]
    pd.testing.assert_frame_equal(resumed[columns], whole[columns], rtol=1e-5)

    # Once results exist, other settings are refused, naming what changed.
    status, _, err = run_cli(capsys, *tiny_args(tiny_decoder, out, "--method", "eap", "--seed", "1"))
    assert status == 2
    assert err.startswith(
        f"contribution-lens: error: {out} holds a run of other inputs ({out / 'config.json'}): seed 0 then, 1 now; "
        "the prompts (their fingerprint) '"
    )
    assert err.endswith(
        "now. Its results cannot be reused: pass --restart (restart=True) to discard them and start afresh, or use "
        "another --out folder\n"
    )


def test_dry_run_prints_the_passes_and_time_and_writes_nothing(tiny_decoder, tmp_path, capsys) -> None:
    out = tmp_path / "plan"
    status, printed, err = run_cli(capsys, *tiny_args(tiny_decoder, out, *METHODS, "--method", "eap-ig", "--dry-run"))
    assert status == 0, err
    graph = Graph(n_layers=2, n_heads=4, n_kv_heads=2, pos_embed=False)
    assert f"{len(graph.components)} nodes, {len(graph.edges)} edges" in printed
    assert "scoring 3 prompts, evaluating 3" in printed
    assert "eap: scoring: 2 forward + 1 backward; curves: at most 40 forward" in printed
    assert "eap-ig: scoring: 7 forward + 5 backward; curves: at most 40 forward" in printed
    assert (
        f"activation-patching: scoring: {2 + len(graph.components)} forward + 0 backward; curves: at most 20" in printed
    )
    assert re.search(r"6 prompts: about \d+ forward-pass equivalents \(one plain pass .*\); estimated [\d.]+ (s|min)",
                     printed), printed  # fmt: skip
    assert not out.exists()


def test_mibs_edge_counting_scores_and_evaluates_mibs_graph(tiny_decoder, tmp_path, capsys) -> None:
    """``--edges mib``: every query head its own k and v inputs, in the plan, the scores and the run's settings."""
    mib = Graph(n_layers=2, n_heads=4, n_kv_heads=2, pos_embed=False, counting="mib")
    status, printed, err = run_cli(capsys, *tiny_args(tiny_decoder, tmp_path / "plan", "--method", "eap", "--edges",
                                                      "mib", "--dry-run"))  # fmt: skip
    assert status == 0, err
    assert f"{len(mib.components)} nodes, {len(mib.edges)} edges (mib counting)" in printed
    out = tmp_path / "run"
    argv = tiny_args(tiny_decoder, out, "--method", "eap", "--level", "edge", "--edges", "mib")
    status, _, err = run_cli(capsys, *argv)
    assert status == 0, err
    scores = cl.CircuitScores.load(out / "eap" / runner.SCORES)
    assert scores.graph == mib and len(scores.edge_scores) == len(mib.edges) > mib.n_edges("native")
    assert json.loads((out / "config.json").read_text())["edges"] == "mib"
    assert pd.read_csv(out / runner.TABLE)[["method", "level"]].values.tolist() == [["eap", "edge"]]


def test_in_sample_runs_are_labelled_so(tiny_decoder, tmp_path, capsys) -> None:
    out = tmp_path / "inside"
    argv = tiny_args(tiny_decoder, out, "--method", "random", "--level", "node", "--in-sample", "--no-prune",
                     "--counterfactual", "first-copy-resampled")  # fmt: skip
    status, _, err = run_cli(capsys, *argv)
    assert status == 0, err
    table = pd.read_csv(out / runner.TABLE)
    assert table[["scored", "scored_prompts", "evaluated", "evaluated_prompts"]].values.tolist() == [
        ["all", 6, "all", 6]
    ]
    assert table["in_sample"].all() and not table["prune"].any()
    assert "in-sample" in (out / runner.REPORT).read_text()
    curve = cl.CircuitCurve.load(out / "random" / "curve-node.safetensors")
    assert "in-sample" in repr(curve) and json.loads((out / "config.json").read_text())["split"] == "in-sample"


def test_scored_scores_fewer_prompts_and_evaluates_the_same_ones(tiny_decoder, tmp_path, capsys) -> None:
    """``--scored 1``: the first prompt of the scoring part is scored, the evaluation part is the full run's."""
    runs = {}
    for name, extra in (("all", ()), ("one", ("--scored", 1))):
        out = tmp_path / name
        status, _, err = run_cli(capsys, *tiny_args(tiny_decoder, out, "--method", "random", "--level", "node", *extra))
        assert status == 0, err
        runs[name] = (pd.read_csv(out / runner.TABLE), cl.CircuitCurve.load(out / "random" / "curve-node.safetensors"))
    (table_all, curve_all), (table_one, curve_one) = runs["all"], runs["one"]
    assert table_all["scored_prompts"].tolist() == [3] and table_one["scored_prompts"].tolist() == [1]
    assert table_one["evaluated_prompts"].tolist() == table_all["evaluated_prompts"].tolist() == [3]
    assert torch.equal(curve_one.clean, curve_all.clean) and torch.equal(curve_one.corrupted, curve_all.corrupted)
    assert json.loads((tmp_path / "one" / "config.json").read_text())["scored_limit"] == 1


def test_a_method_registered_later_is_taken_by_name(tiny_decoder, tmp_path, capsys) -> None:
    def later_first(model, task, context):
        return -torch.arange(len(context.graph.components), dtype=torch.float32)

    cl.register_circuit_method("later-first", later_first, level="node")
    try:
        status, _, err = run_cli(capsys, *tiny_args(tiny_decoder, tmp_path / "run", "--method", "later-first"))
    finally:
        cl.unregister_circuit_method("later-first")
    assert status == 0, err
    table = pd.read_csv(tmp_path / "run" / runner.TABLE)
    assert table[["method", "level"]].values.tolist() == [["later-first", "node"]]
    assert table["planned_scoring"].isna().all()  # the package does not know its passes


def test_torchrun_two_processes_merge_to_the_single_process_result(tiny_decoder, tiny_run, tmp_path) -> None:
    out = tmp_path / "ddp"
    # torchrun takes ``--n`` for an abbreviation of its own options: the run says --prompts.
    argv = [str(a) for a in tiny_args(tiny_decoder, out, *METHODS)]
    argv[argv.index("--n")] = "--prompts"
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "contribution_lens.cli", *argv]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    for method in ("eap", "activation-patching", "random"):
        got = cl.CircuitScores.load(out / method / runner.SCORES)
        want = cl.CircuitScores.load(tiny_run / method / runner.SCORES)
        assert got.n_prompts == want.n_prompts == 3  # the scoring half of six
        assert torch.equal(got.prompts.fingerprints, want.prompts.fingerprints)
        torch.testing.assert_close(got.component_scores, want.component_scores, rtol=1e-5, atol=1e-5)
        if want.edge_scores is not None:
            assert got.edge_scores is not None
            torch.testing.assert_close(got.edge_scores, want.edge_scores, rtol=1e-5, atol=1e-5)
        for level in runner.method_levels(method, ("edge", "node")):
            name = f"curve-{level}.safetensors"
            got_curve, want_curve = (
                cl.CircuitCurve.load(out / method / name),
                cl.CircuitCurve.load(tiny_run / method / name),
            )
            for field in ("clean", "corrupted", "patched", "chosen", "edges"):
                torch.testing.assert_close(getattr(got_curve, field), getattr(want_curve, field), rtol=1e-5, atol=1e-5)
            assert torch.equal(got_curve.evaluated.fingerprints, want_curve.evaluated.fingerprints)  # prompt order
    got_table, want_table = pd.read_csv(out / runner.TABLE), pd.read_csv(tiny_run / runner.TABLE)
    columns = ["method", "level", "scored_prompts", "evaluated_prompts", "in_sample", "cpr", "cmd", "cpr_low",
               "cpr_high", "cmd_low", "cmd_high", "absolute_area"]  # fmt: skip
    pd.testing.assert_frame_equal(got_table[columns], want_table[columns], rtol=1e-4)


def test_the_commands_counterfactuals_are_the_tasks() -> None:
    from contribution_lens.circuits import task as task_module
    from contribution_lens.cli.circuit import COUNTERFACTUALS

    tables = {"ioi": task_module.IOI_COUNTERFACTUALS, "induction": task_module.INDUCTION_COUNTERFACTUALS,
              "capitals": task_module.CAPITALS_COUNTERFACTUALS}  # fmt: skip
    assert COUNTERFACTUALS == {name: tuple(table) for name, table in tables.items()}
    # Each builder's default is its table's first.
    for name, build in (("ioi", cl.Task.ioi), ("induction", cl.Task.induction), ("capitals", cl.Task.capitals)):
        assert inspect.signature(build).parameters["counterfactual"].default == COUNTERFACTUALS[name][0]


def test_help_imports_no_torch() -> None:
    code = (
        "import sys\nfrom contribution_lens import cli\n"
        "try:\n    cli.main(['circuit', '--help'])\nexcept SystemExit as exit:\n    print('exit', exit.code)\n"
        "print('torch imported:', 'torch' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "COLUMNS": "200"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "exit 0" in result.stdout and "torch imported: False" in result.stdout
    assert "--method METHOD" in result.stdout and "(default: 64)" in result.stdout


def test_a_plan_counts_the_windows_a_prompt_too_long_for_the_budget_is_scored_in() -> None:
    """The gradient methods repeat their passes a window of positions at a time; the plan says so and counts them."""
    from contribution_lens.circuits import runner

    graph = Graph(n_layers=2, n_heads=4, n_kv_heads=2, pos_embed=False)
    per_position = len(graph.writers) * 32 * 4 * runner.WINDOWED["eap"]
    memory = int(5 * per_position)
    plans = runner.plan_passes(graph, ["eap", "random"], ["edge"], length=23, d_model=32, memory=memory)
    assert [(p.method, p.windows) for p in plans] == [("eap", 5), ("random", 1)]
    assert plans[0].equivalents == 5 * (2 + runner.BACKWARD_COST)
    assert "each of 5 windows of positions" in runner.describe_plan(plans, 3)
    whole = runner.plan_passes(graph, ["eap"], ["edge"], length=5, d_model=32, memory=memory)
    assert whole[0].windows == 1


TASK_LINES = [
    {"clean": "the capital of france is", "corrupted": "the capital of japan is", "answer": " paris", "foil": " tokyo"},
    {"clean": "the capital of italy is", "corrupted": "the capital of spain is", "answer": " rome", "foil": " madrid"},
    {"clean": "the cat sat on the", "corrupted": "the dog ran to the", "answer": " mat", "foil": " door"},
    {"clean": "she went to the", "corrupted": "he came from the", "answer": " shop", "foil": " house"},
]


def test_an_edited_task_file_is_refused_naming_what_changed_until_restart(
    tiny_decoder, tmp_path, capsys, monkeypatch
) -> None:
    """The run folder records the task file's contents, not its path: an edited file is another run."""
    task = tmp_path / "mine.jsonl"
    task.write_text("".join(json.dumps(row) + "\n" for row in TASK_LINES))
    out = tmp_path / "run"
    argv = ["circuit", "--model", tiny_decoder, "--task", task, "--method", "random", "--level", "node", "--out", out]
    status, _, err = run_cli(capsys, *argv)
    assert status == 0, err
    kept = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    edited = [TASK_LINES[0] | {"foil": " london"}, *TASK_LINES[1:]]  # one foil changed
    task.write_text("".join(json.dumps(row) + "\n" for row in edited))
    with monkeypatch.context() as patch:
        patch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("the model loaded before the refusal"))
        status, _, err = run_cli(capsys, *argv)
    assert status == 2
    assert err.startswith(f"contribution-lens: error: {out} holds a run of other inputs ({out / 'config.json'}): ")
    assert "the task file's contents (SHA-256) '" in err and "the prompts (their fingerprint) '" in err
    assert "pass --restart (restart=True) to discard them and start afresh" in err
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == kept  # nothing stale rewritten
    status, _, err = run_cli(capsys, *argv, "--restart")
    assert status == 0, err
    config = json.loads((out / "config.json").read_text())
    assert config["task_file_sha256"] == run_folder.file_fingerprint(task)
    scores = cl.CircuitScores.load(out / "random" / runner.SCORES)
    assert scores.prompts.overlap(cl.Task.from_jsonl(cl.load_model(str(tiny_decoder)), task).prompts) == len(
        scores.prompts
    )


def test_a_resume_with_other_inputs_or_kept_results_of_another_run_is_refused(
    tiny_decoder, tiny_run, tmp_path, capsys
) -> None:
    out = tmp_path / "copy"
    shutil.copytree(tiny_run, out)
    # Another number of bootstrap resamples: the curves kept were resampled 1000 times.
    status, _, err = run_cli(capsys, *tiny_args(tiny_decoder, out, *METHODS, "--bootstrap", "100"))
    assert status == 2 and "bootstrap 1000 then, 100 now." in err
    # A folder of an earlier version, whose config does not record one.
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "version"}))
    status, _, err = run_cli(capsys, *tiny_args(tiny_decoder, out, *METHODS))
    assert (
        status == 2 and f"the package version not recorded (an earlier version) then, {config['version']!r} now" in err
    )
    # Results of another run copied in beside this one's: no table mixes them.
    other = tmp_path / "other"
    status, _, err = run_cli(capsys, *tiny_args(tiny_decoder, other, "--method", "random", "--level", "node",
                                                "--seed", "1"))  # fmt: skip
    assert status == 0, err
    shutil.copytree(tiny_run / "eap", other / "eap")
    status, _, err = run_cli(capsys, *tiny_args(tiny_decoder, other, "--method", "random", "--level", "node",
                                                "--seed", "1"))  # fmt: skip
    assert status == 2
    assert err.startswith(
        f"contribution-lens: error: {other / 'eap' / runner.SCORES} was computed on other prompts than this run's "
        "scoring prompts ("
    )
    assert err.endswith("the folder mixes two runs; pass --restart (restart=True) to start afresh\n")
