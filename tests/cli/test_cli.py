"""The command line: every mistake gets one line before any model is loaded; one run per folder."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from contribution_lens import cli, loading
from contribution_lens.cli import outdir
from contribution_lens.faithfulness import runner

SRC = Path(__file__).resolve().parents[2] / "src"
TEXT = " ".join(
    f"Sentence {i}: the quick brown fox jumps over the lazy dog and runs into the forest." for i in range(40)
)


def python(code: str, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, env=env, timeout=120)


@pytest.fixture
def no_model(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(loading, "load_model", refuse)


@pytest.fixture
def text_file(tmp_path) -> Path:
    path = tmp_path / "tiny.txt"
    path.write_text(TEXT)
    return path


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    status = cli.main([str(a) for a in argv])
    return status, capsys.readouterr().err


def test_help_shows_defaults_without_importing_torch() -> None:
    code = (
        "import sys\nfrom contribution_lens import cli\n"
        "for argv in (['--help'], ['demo', '--help'], ['faithfulness', '--help'], ['sinks', '--help'],\n"
        "             ['replicate', '--help']):\n"
        "    try:\n        cli.main(argv)\n    except SystemExit as exit:\n        print('exit', exit.code)\n"
        "print('torch imported:', 'torch' in sys.modules)\n"
    )
    result = python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("exit 0") == 5
    assert "--size SIZE" in result.stdout and "(default: quick)" in result.stdout
    assert "(default: 200)" in result.stdout and "(default: smollm2-135m)" in result.stdout
    assert "(default: comprehensiveness,sufficiency)" in result.stdout
    assert "torch imported: False" in result.stdout


def _help(capsys, *argv: str) -> str:
    """What ``contribution-lens ARGV --help`` prints, its lines joined (argparse wraps at the terminal's width)."""
    with pytest.MonkeyPatch.context() as patch, pytest.raises(SystemExit) as exit:
        patch.setenv("COLUMNS", "400")  # no name broken at its hyphen
        cli.main([*argv, "--help"])
    assert exit.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def test_a_measure_registered_here_is_in_the_registry_and_the_faithfulness_help(capsys) -> None:
    import contribution_lens as cl

    assert "values_alone" not in _help(capsys, "faithfulness")
    cl.register_method("values_alone", lambda layer, context: layer.decompose(context.scope).value_norm[:, :, None])
    try:
        assert cl.available_methods()[-1] == "values_alone"
        assert "logit_attribution, values_alone)" in _help(capsys, "faithfulness")
    finally:
        cl.unregister_method("values_alone")
    assert "values_alone" not in _help(capsys, "faithfulness")


def test_a_circuit_method_registered_here_is_in_the_registry_and_the_circuit_help(capsys) -> None:
    import contribution_lens as cl

    cl.register_circuit_method("later_first", lambda model, task, context: None, level="node")
    try:
        assert cl.available_circuit_methods()[-1] == "later_first"
        assert "information-flow-routes-last, later_first;" in _help(capsys, "circuit")
    finally:
        cl.unregister_circuit_method("later_first")
    assert "later_first" not in _help(capsys, "circuit")


def test_a_protocol_registered_here_is_in_the_registry_and_the_faithfulness_help(capsys) -> None:
    from contribution_lens import faithfulness

    class Nowhere(faithfulness.RemovalProtocol):
        name, description = "nowhere", "removes nothing"

        def keep(self, clean, condition, layer):
            return None

    faithfulness.register_protocol(Nowhere())
    try:
        assert list(faithfulness.PROTOCOLS)[-1] == "nowhere"
        assert faithfulness.Settings(protocols=("nowhere",)).protocols == ("nowhere",)
        assert "prediction, nowhere)" in _help(capsys, "faithfulness")
    finally:
        faithfulness.PROTOCOLS.unregister("nowhere")
    assert "nowhere" not in _help(capsys, "faithfulness")


def test_version() -> None:
    result = python("from contribution_lens import cli\ncli.main(['--version'])")
    assert result.returncode == 0, result.stderr
    from importlib.metadata import version

    assert result.stdout == f"contribution-lens {version('contribution-lens')}\n"


def test_the_module_prints_one_line_without_traceback(tmp_path) -> None:
    argv = ["sinks", "--data", "text", "--max-chunks", "-1", "--out", str(tmp_path / "o")]
    result = python(
        "import sys, runpy\nsys.argv = ['contribution-lens', *sys.argv[1:]]\n"
        "runpy.run_module('contribution_lens.cli', run_name='__main__')",
        *argv,
    )
    assert result.returncode == 2
    assert result.stderr == "contribution-lens: error: --max-chunks: expected a positive integer, got -1\n"


FAITH = ["faithfulness", "--data", "{text}"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["demo", "--layer", "99"], "--layer: expected a layer from -30 to 29 (smollm2-135m has 30 layers), got 99"),
        (["demo", "--layer", "-31"], "--layer: expected a layer from -30 to 29 (smollm2-135m has 30 layers), got -31"),
        (
            [*FAITH, "--layers", "3,99"],
            "--layers: expected a layer from -30 to 29 (smollm2-135m has 30 layers), got 99",
        ),
        ([*FAITH, "--layers", "3,x"], "--layers: expected comma-separated integers, got '3,x'"),
        ([*FAITH, "--max-chunks", "-1"], "--max-chunks: expected a positive integer, got -1"),
        ([*FAITH, "--max-items", "0"], "--max-items: expected a positive integer, got 0"),
        ([*FAITH, "--batch-size", "0"], "--batch-size: expected a positive integer, got 0"),
        ([*FAITH, "--threads", "0"], "--threads: expected a positive integer, got 0"),
        ([*FAITH, "--chunk-length", "1"], "--chunk-length: expected an integer >= 2, got 1"),
        ([*FAITH, "--ratios", "0,1"], "--ratios: expected comma-separated numbers in [0, 1), got '0,1'"),
        ([*FAITH, "--choice-ratios", "a"], "--choice-ratios: expected comma-separated numbers in [0, 1), got 'a'"),
        (
            [*FAITH, "--methods", "attention,saliency"],
            "--methods: expected 'all' or a comma-separated subset of attention, value_weighted, output_normalized, "
            "contribution, random, kobayashi, alti, alti_rollout, value_zeroing, grad_attention, flow, "
            "attention_rollout, logit_attribution, got 'attention,saliency'",
        ),
        (
            [*FAITH, "--protocol", "every_layer,leave_one_out"],
            "--protocol: expected 'all' or a comma-separated subset of every_layer, one_layer, input_deletion, "
            "prediction, got 'every_layer,leave_one_out'",
        ),
        ([*FAITH, "--rank-by", "rank"], "--rank-by: expected a comma-separated subset of abs, signed, got 'rank'"),
        (
            [*FAITH, "--protocol", "input_deletion", "--granularity", "head"],
            "--granularity: expected 'token' with --protocol input_deletion (it ranks tokens), got 'head'",
        ),
        (
            [*FAITH, "--methods", "attention,kobayashi,alti", "--granularity", "head"],
            "--granularity: expected 'token' with kobayashi, alti (token-level scores), got 'head'",
        ),
        ([*FAITH, "--bootstrap", "0"], "--bootstrap: expected a positive integer, got 0"),
        (
            [*FAITH, "--modes", "both"],
            "--modes: expected a comma-separated subset of comprehensiveness, sufficiency, got 'both'",
        ),
        (
            ["faithfulness", "--data", "gsm8k=missing.jsonl"],
            "--data: expected NAME=PATH with an existing file or folder, got 'gsm8k=missing.jsonl' "
            "(missing.jsonl does not exist)",
        ),
        (
            ["faithfulness", "--data", "wiki={text_path}"],
            "--data: expected NAME=PATH with NAME one of gsm8k, fineweb, text, mmlu, winogrande, boolq, "
            "got 'wiki={text_path}'",
        ),
        (["sinks", "--data", "boolq"], "--data: expected a text set (gsm8k, fineweb, text), got 'boolq'"),
        (
            ["sinks", "--data", "{text}", "--k", "0"],
            "--k: expected an integer from 1 to --chunk-length - 1 (255), got 0",
        ),
        (
            [*FAITH, "--prepend-bos", "maybe"],
            "--prepend-bos: expected yes, no or model (the model's own choice, cfg.default_prepend_bos), got 'maybe'",
        ),
        (
            ["sinks", "--data", "{text}", "--prepend-bos", "1"],
            "--prepend-bos: expected yes, no or model (the model's own choice, cfg.default_prepend_bos), got '1'",
        ),
        (
            [*FAITH, "--device", "cuda"],
            "--device: expected a device that is available, got 'cuda' (torch finds no cuda device)",
        ),
        ([*FAITH, "--device", "gpu"], "--device: expected a torch device such as cpu, cuda or cuda:1, got 'gpu'"),
        (
            ["sinks", "--data", "{text}", "--model", "./no-such-checkpoint"],
            "--model: expected 'smollm2-135m', 'minilm-l6', 'gemma3-270m', 'qwen2.5-0.5b', a checkpoint folder or a "
            "Hugging Face id, "
            "got './no-such-checkpoint' "
            "(no config.json)",
        ),
        (["demo", "--text", " "], "--text: expected some text, got ' '"),
        (
            ["replicate", "--data", "{text}", "--size", "huge"],
            "argument --size: invalid choice: 'huge' (choose from 'quick', 'paper') (see contribution-lens replicate "
            "--help)",
        ),
        (["replicate", "--data", "{text}", "--max-chunks", "0"], "--max-chunks: expected a positive integer, got 0"),
        (["replicate", "--data", "{text}", "--chunk-length", "1"], "--chunk-length: expected an integer >= 2, got 1"),
        (
            ["replicate", "--data", "{text}", "--choice-ratios", "0,1"],
            "--choice-ratios: expected comma-separated numbers in [0, 1), got '0,1'",
        ),
        (
            ["replicate", "--data", "boolq=missing.jsonl"],
            "--data: expected NAME=PATH with an existing file or folder, got 'boolq=missing.jsonl' "
            "(missing.jsonl does not exist)",
        ),
        (
            ["replicate", "--data", "{text}", "--chunk-length", "9000"],
            "--chunk-length: expected at most smollm2-135m's context of 8192 tokens, got 9000",
        ),
        (
            ["replicate", "--data", "{text}", "--device", "cuda"],
            "--device: expected a device that is available, got 'cuda' (torch finds no cuda device)",
        ),
        (["replicate", "--data", "{text}", "--bootstrap", "0"], "--bootstrap: expected a positive integer, got 0"),
        (["replicate", "--data", "{text}", "--batch-size", "0"], "--batch-size: expected a positive integer, got 0"),
        (
            ["replicate", "--data", "{text}", "--model", "./no-such-checkpoint", "--dry-run"],
            "--model: expected 'smollm2-135m', 'minilm-l6', 'gemma3-270m', 'qwen2.5-0.5b', a checkpoint folder or a "
            "Hugging Face id, got './no-such-checkpoint' (no config.json)",
        ),
        (["replicate"], "the following arguments are required: --data (see contribution-lens replicate --help)"),
        (
            [*FAITH, "--max-chunks", "x"],
            "argument --max-chunks: invalid int value: 'x' (see contribution-lens faithfulness --help)",
        ),
    ],
)
def test_mistakes_get_one_line_before_the_model_is_loaded(
    argv, message, text_file, tmp_path, capsys, no_model, monkeypatch
) -> None:
    if "--device" in argv and "cuda" in argv:
        import torch

        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "out"
    fill = {"{text}": f"text={text_file}", "{text_path}": str(text_file)}
    argv = [fill.get(a, a).replace("{text_path}", str(text_file)) for a in argv]
    try:
        status, err = run_cli(capsys, *argv, "--out", out)
    except SystemExit as exit:  # argparse's own mistakes
        status, err = int(exit.code or 0), capsys.readouterr().err
    assert status == 2
    assert err == f"contribution-lens: error: {message.replace('{text_path}', str(text_file))}\n"
    assert not out.exists(), "nothing may be written before the arguments are good"


def test_out_naming_a_file_or_below_a_file_is_refused(text_file, tmp_path, capsys, no_model) -> None:
    for out, message in [
        (text_file, f"--out: expected a folder, got '{text_file}' (an existing file)"),
        (
            text_file / "run",
            f"--out: expected a folder that can be created, got '{text_file / 'run'}' ({text_file} is a file)",
        ),
    ]:
        status, err = run_cli(capsys, "faithfulness", "--data", f"text={text_file}", "--out", out)
        assert (status, err) == (2, f"contribution-lens: error: {message}\n")
    assert text_file.read_text() == TEXT


def test_a_second_run_on_a_folder_in_use_is_refused(text_file, tmp_path, capsys, no_model) -> None:
    out = tmp_path / "busy"
    with outdir.locked(out):
        status, err = run_cli(capsys, "faithfulness", "--data", f"text={text_file}", "--out", out)
        assert status == 2
        assert err == (
            f"contribution-lens: error: --out {out} is in use by another run (pid {os.getpid()}); "
            "wait for it or choose another folder\n"
        )
        assert [p.name for p in out.iterdir()] == [".lock"]
    assert not out.exists(), "the lock's folder is removed when the run that created it leaves it empty"


HOLD = """import time
from contribution_lens.cli import outdir
with outdir.locked({out!r}):
    print("held", flush=True)
    time.sleep(60)
"""


HOLD = """import time
from contribution_lens.cli import outdir
with outdir.locked({out!r}):
    print("held", flush=True)
    time.sleep(60)
"""


def test_the_lock_is_held_across_processes_and_released_when_its_holder_dies(tmp_path) -> None:
    out = tmp_path / "shared"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD.format(out=str(out))],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(SRC)},
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(outdir.FolderInUseError, match=rf"in use by another run \(pid {holder.pid}\)"):
            with outdir.locked(out):
                pass
    finally:
        holder.kill()
        holder.wait()
    with outdir.locked(out) as folder:  # killed: the kernel dropped its lock
        assert (folder / ".lock").read_text() == f"{os.getpid()}\n"


FAST = ["--methods", "attention,random", "--ratios", "0,0.5", "--chunk-length", "16", "--max-chunks", "2"]


@pytest.fixture
def fast_model(bundled_model, monkeypatch):
    monkeypatch.setattr(loading, "load_model", lambda *args, **kwargs: bundled_model)
    return bundled_model


def test_bad_data_found_after_loading_leaves_nothing(tmp_path, capsys, fast_model) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "no answer field"}\n')
    out = tmp_path / "out"
    status, err = run_cli(capsys, "faithfulness", "--data", f"gsm8k={bad}", *FAST, "--out", out)
    assert status == 2
    assert err == f"contribution-lens: error: {bad} record 0 lacks field(s) ['answer']; has ['question']\n"
    assert not out.exists()


def test_a_failed_run_does_not_block_the_corrected_rerun(text_file, tmp_path, capsys, fast_model, monkeypatch) -> None:
    out = tmp_path / "run"

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    # A run stopped before its first record: config.json is written, no record is.
    with monkeypatch.context() as patch:
        patch.setattr(runner, "clean_run", interrupted)
        status, err = run_cli(
            capsys, "faithfulness", "--data", f"text={text_file}", *FAST, "--layers", "0", "--out", out
        )
    assert (status, err.splitlines()[-1]) == (130, "contribution-lens: error: interrupted")  # after tqdm's bar
    assert json.loads((out / "config.json").read_text())["protocol"]["layers"] == [0]
    assert not (out / ".lock").exists()
    # The corrected rerun, with other settings, into the same folder.
    status, err = run_cli(capsys, "faithfulness", "--data", f"text={text_file}", *FAST, "--layers", "-1", "--out", out)
    assert status == 0, err
    assert json.loads((out / "config.json").read_text())["protocol"]["layers"] == [29]
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert len(records) == 2 * 2 * 2 * 2  # chunks x methods x modes x ratios
    assert not (out / ".lock").exists()
    # Once records exist, other settings are refused (resume needs the same ones).
    status, err = run_cli(capsys, "faithfulness", "--data", f"text={text_file}", *FAST, "--layers", "0", "--out", out)
    assert status == 2
    assert err == (
        f"contribution-lens: error: {out} holds a run with other settings ({out / 'config.json'}); "
        "use another --out folder\n"
    )


def test_dry_run_prints_the_plan_and_writes_nothing(text_file, tmp_path, capsys, fast_model) -> None:
    out = tmp_path / "plan"
    status = cli.main(
        ["faithfulness", "--data", f"text={text_file}", *FAST, "--protocol", "all", "--dry-run", "--out", str(out)]
    )
    printed = capsys.readouterr().out
    assert status == 0
    assert re.search(r"\d+ forward passes .*; estimated [\d.]+ (s|min|h)", printed), printed
    assert not out.exists()


def test_sinks_writes_the_study_and_prints_the_verdicts(text_file, tmp_path, capsys, fast_model) -> None:
    out = tmp_path / "sinks"
    argv = ["sinks", "--data", f"text={text_file}", "--chunk-length", "24", "--max-chunks", "2", "--out", out]
    status = cli.main([str(a) for a in argv])
    printed = capsys.readouterr().out
    assert status == 0
    assert "The output norm is convex in the sink ratio with an interior minimum" in printed
    assert f"wrote {out}/sinks.html, sink_heads.csv and sink_claims.json" in printed
    import contribution_lens as cl

    study = cl.SinkStudy.load(out)
    assert set(study.interventions) == {"zero", "mean_tail"} and len(study.verdicts()) == 4


def test_demo_writes_its_page(tmp_path, capsys, fast_model) -> None:
    out = tmp_path / "demo"
    status = cli.main(["demo", "--text", "The cat sat on the mat.", "--layer", "-1", "--out", str(out)])
    printed = capsys.readouterr().out
    assert status == 0 and "Per-layer contribution geometry of 8 tokens" in printed
    page = (out / "demo.html").read_text()
    assert "Token-level contribution at layer 29" in page and "The cat sat on the mat." in page


def test_chunk_length_beyond_the_context_is_refused_before_loading(text_file, tmp_path, capsys, no_model) -> None:
    status, err = run_cli(capsys, "sinks", "--data", f"text={text_file}", "--chunk-length", "9000", "--out", tmp_path)
    assert status == 2
    expected = "--chunk-length: expected at most smollm2-135m's context of 8192 tokens, got 9000"
    assert err == f"contribution-lens: error: {expected}\n"


def test_a_nested_config_gives_layers_and_context_before_loading(text_file, tmp_path, capsys, no_model) -> None:
    # Gemma 3 and multimodal checkpoints keep the language model's sizes in text_config.
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    config = {"architectures": ["Gemma3ForConditionalGeneration"], "text_config": {"num_hidden_layers": 4}}
    (folder / "config.json").write_text(
        json.dumps({**config, "text_config": {**config["text_config"], "max_position_embeddings": 128}})
    )
    data = ["--data", f"text={text_file}", "--model", folder]
    status, err = run_cli(capsys, "sinks", *data, "--chunk-length", "200", "--out", tmp_path / "a")
    assert (status, err) == (
        2,
        f"contribution-lens: error: --chunk-length: expected at most {folder}'s context of 128 tokens, got 200\n",
    )
    status, err = run_cli(capsys, "faithfulness", *data, "--layers", "4", "--out", tmp_path / "b")
    assert err == f"contribution-lens: error: --layers: expected a layer from -4 to 3 ({folder} has 4 layers), got 4\n"


def test_max_item_tokens_beyond_the_context_is_refused_before_loading(tmp_path, capsys, no_model) -> None:
    items = tmp_path / "boolq.jsonl"
    items.write_text('{"question": "is it", "passage": "it is", "label": "true"}\n')
    argv = ["faithfulness", "--data", f"boolq={items}", "--max-item-tokens", "9000", "--out", tmp_path / "out"]
    status, err = run_cli(capsys, *argv)
    assert status == 2
    expected = "--max-item-tokens: expected at most smollm2-135m's context of 8192 tokens, got 9000"
    assert err == f"contribution-lens: error: {expected}\n"


def test_the_prediction_protocol_on_multiple_choice_data_is_refused_before_loading(tmp_path, capsys, no_model) -> None:
    items = tmp_path / "boolq.jsonl"
    items.write_text('{"question": "is it", "passage": "it is", "label": "true"}\n')
    out = tmp_path / "out"
    argv = ["faithfulness", "--data", f"boolq={items}", "--protocol", "every_layer,prediction", "--out", out]
    status, err = run_cli(capsys, *argv)
    assert status == 2
    expected = (
        f"--protocol: expected a protocol that takes multiple-choice data (--data boolq={items}), "
        "got 'prediction' (it explains one next-token prediction of a text)"
    )
    assert err == f"contribution-lens: error: {expected}\n"
    assert not out.exists(), "nothing may be written before the arguments are good"
