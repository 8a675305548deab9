"""``contribution-lens replicate`` end to end on a tiny random decoder: files, claims, resume, chance, dry run, CUDA."""

import json
import shlex
from pathlib import Path

import pytest
import torch

from conftest import REPLICATE_SIZES, winogrande_file
from contribution_lens import cli, loading, replication
from contribution_lens.cli import options
from contribution_lens.faithfulness import DataSettings, FaithfulnessRun, Settings
from contribution_lens.faithfulness import runner as faithfulness_runner
from contribution_lens.replication import runner

CLAIM_IDS = list(replication.STATEMENTS)


def read_claims(out: Path) -> dict:
    return json.loads((out / "claims.json").read_text())


def test_every_claim_is_in_claims_json_with_a_verdict_from_the_fixed_set(tiny_replication: Path) -> None:
    saved = read_claims(tiny_replication)
    assert [claim["id"] for claim in saved["claims"]] == CLAIM_IDS
    assert saved["verdicts"] == ["supported", "partly", "not supported", "no verdict"]
    for claim in saved["claims"]:
        assert claim["verdict"] in replication.VERDICTS, claim
        assert claim["line"] and claim["statement"], claim
    measured = {claim["id"]: claim for claim in saved["claims"] if claim["reason"] is None}
    # Everything the data allow is measured: the text claims and the sink claims, each with a number in its interval.
    assert {"opening_case", "hierarchy_chain", "contribution_beats_attention", "sink_norm_removal"} <= set(measured)
    for claim in measured.values():
        assert claim["low"] <= claim["number"] <= claim["high"], claim
        assert claim["command"].startswith("contribution-lens "), claim
    for name in (
        "claims.md",
        "report.html",
        "text/records.jsonl",
        "sinks/sink_claims.json",
        "opening/layer_summary.jsonl",
    ):
        assert (tiny_replication / name).is_file(), name
    assert saved["device"] == "cpu" and saved["dtype"] == "float32"


def test_no_data_for_a_task_says_so_and_the_markdown_lists_every_claim(tiny_replication: Path) -> None:
    saved = {claim["id"]: claim for claim in read_claims(tiny_replication)["claims"]}
    assert saved["downstream_mmlu"]["verdict"] == "no verdict"
    assert saved["downstream_mmlu"]["reason"] == "no mmlu data given (--data mmlu=PATH)"
    markdown = (tiny_replication / "claims.md").read_text()
    for claim_id in CLAIM_IDS:
        assert f"## {claim_id}: " in markdown
    assert markdown.count("```bash") == len(CLAIM_IDS)


def test_a_model_at_chance_gets_no_verdict_and_no_removal_run(tiny_replication: Path) -> None:
    claim = {c["id"]: c for c in read_claims(tiny_replication)["claims"]}["downstream_winogrande"]
    clean = FaithfulnessRun.load(tiny_replication / "choice-clean", resamples=100).tables.accuracy.iloc[0]
    assert not clean["above_chance"] and clean["chance"] == 0.5
    assert (claim["verdict"], claim["reason"]) == ("no verdict", "the model is at chance")
    assert (claim["number"], claim["low"], claim["high"]) == pytest.approx(
        (clean["clean_accuracy"], clean["clean_ci_low"], clean["clean_ci_high"])
    )
    assert "the model is at chance" in claim["line"] and claim["cells"] == []
    assert not (tiny_replication / "choice").exists(), "no removal passes for a task the model cannot answer"


def test_a_model_above_chance_gets_the_accuracy_drop_judged(tiny_decoder, replicate_data, tmp_path) -> None:
    """Label each item with the tiny model's own choice: it is then always right, and the removal run runs."""
    wino = Path(replicate_data[3].partition("=")[2])
    clean = FaithfulnessRun.load(_clean_run(tiny_decoder, wino, tmp_path / "probe"), resamples=100).frame.sort_values(
        "seq", key=lambda s: s.str[1:].astype(int)
    )
    answers = [str(int(pred) + 1) for pred in clean["pred"]]
    relabelled = winogrande_file(tmp_path / "right.jsonl", answers)
    out = tmp_path / "run"
    argv = ["replicate", "--model", str(tiny_decoder), "--data", f"winogrande={relabelled}", *REPLICATE_SIZES]
    assert cli.main([*argv, "--out", str(out)]) == 0
    claim = {c["id"]: c for c in read_claims(out)["claims"]}["downstream_winogrande"]
    assert claim["reason"] is None and claim["verdict"] in ("supported", "partly", "not supported")
    assert claim["line"].startswith("clean accuracy 1.000 [1.000, 1.000] over 12 items, chance 0.500; ")
    (cell,) = claim["cells"]
    assert cell["where"] == "every_layer · winogrande · comprehensiveness"
    assert (claim["number"], claim["low"], claim["high"]) == (cell["number"], cell["low"], cell["high"])
    removal = FaithfulnessRun.load(out / "choice", resamples=100)
    assert set(removal.frame["method"]) == set(replication.CHOICE_METHODS)
    # The text claims have no data here: no verdict, saying what to give.
    assert {c["id"]: c for c in read_claims(out)["claims"]}["opening_case"]["reason"].startswith("no text data given")


def _clean_run(model_folder: Path, wino: Path, out: Path) -> Path:
    model = loading.load_model(str(model_folder))
    data = DataSettings(data=(f"winogrande={wino}",), max_item_tokens=64, batch_size=4)
    faithfulness_runner.run(model, replication.settings.clean_settings(), data, out, progress=False)
    return out


def test_an_interrupted_run_resumes_where_it_stopped(
    tiny_decoder, replicate_data, tiny_replication, tmp_path, monkeypatch
) -> None:
    argv = ["replicate", "--model", str(tiny_decoder), *replicate_data, *REPLICATE_SIZES, "--out", str(tmp_path)]
    real = faithfulness_runner._append
    calls = []

    def interrupted(stream, records):
        calls.append(len(records))
        if len(calls) == 5:
            raise KeyboardInterrupt
        real(stream, records)

    monkeypatch.setattr(faithfulness_runner, "_append", interrupted)
    assert cli.main(argv) == 130
    written = len((tmp_path / "text" / "part-0.jsonl").read_text().splitlines())
    assert written == sum(calls[:4]) > 0 and not (tmp_path / "claims.json").exists()
    calls.clear()
    monkeypatch.setattr(
        faithfulness_runner, "_append", lambda stream, records: (calls.append(0), real(stream, records))
    )
    assert cli.main(argv) == 0
    lines = (tmp_path / "text" / "part-0.jsonl").read_text().splitlines()
    assert len(lines) == len((tiny_replication / "text" / "part-0.jsonl").read_text().splitlines()), "nothing redone"
    first = len(calls)
    assert cli.main(argv) == 0 and len(calls) == first, "a finished run redoes nothing"
    # The resumed run gives the uninterrupted run's claims.
    resumed, whole = read_claims(tmp_path), read_claims(tiny_replication)
    for mine, theirs in zip(resumed["claims"], whole["claims"], strict=True):
        assert (mine["id"], mine["verdict"], mine["number"]) == (theirs["id"], theirs["verdict"], theirs["number"])


def test_a_dry_run_loads_no_weights_and_prints_the_passes(
    tiny_decoder, replicate_data, tmp_path, capsys, monkeypatch
) -> None:
    from transformers import PreTrainedModel

    def refuse(*args, **kwargs):
        raise AssertionError("a dry run read weights")

    monkeypatch.setattr(loading, "load_model", refuse)
    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(refuse))
    out = tmp_path / "planned"
    assert cli.main(["replicate", "--model", str(tiny_decoder), *replicate_data, *REPLICATE_SIZES, "--out", str(out),
                     "--dry-run"]) == 0  # fmt: skip
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("text faithfulness: 58 forward passes, about ")
    # 12 two-option items in passes of at most 4 sequences: 6 units, each a clean pass and one at ratio 0.
    assert printed[1].startswith("multiple-choice clean accuracy: 12 forward passes")
    assert printed[-1].startswith("in all ") and " passes, estimated " in printed[-1]
    assert not out.exists(), "a dry run writes nothing"


def test_the_dry_run_counts_what_the_run_does(tiny_decoder, replicate_data, tiny_replication) -> None:
    """The text run's passes as planned are those its records took (one clean, one at ratio 0, one a condition)."""
    skeleton = loading.load_skeleton(str(tiny_decoder))
    data = _data_settings(replicate_data)
    planned = replication.plan(skeleton, data, "/nonexistent", size="quick")
    text = next(part for part in planned.parts if part.name == "text faithfulness")
    settings = replication.text_settings(replication.SIZES["quick"])
    variants = len(settings.variants()) * len(settings.modes) * (len(settings.ratios) - 1) * len(settings.protocols)
    assert text.passes == 1 * (2 + variants)  # four 16-token chunks, one unit of 4
    resumed = replication.plan(skeleton, data, tiny_replication, size="quick")
    assert next(p for p in resumed.parts if p.name == "text faithfulness").passes == 0, "a finished part costs nothing"


def _data_settings(replicate_data: list[str]) -> DataSettings:
    return replication.data_settings(
        tuple(replicate_data[1::2]), replication.SIZES["quick"], chunk_length=16, max_chunks=4, max_items=12,
        max_item_tokens=64, batch_size=4,
    )  # fmt: skip


def test_each_parts_command_gives_the_parts_own_settings(tiny_replication: Path) -> None:
    """The command printed beside a claim rebuilds exactly the settings its folder was run with."""
    saved = read_claims(tiny_replication)
    parser = cli.app.build_parser()
    for part in ("text", "choice-clean"):
        args = parser.parse_args(shlex.split(saved["commands"][part])[1:])
        config = json.loads((tiny_replication / part / "config.json").read_text())
        assert options.build(Settings, args).to_dict() == config["protocol"]
        assert options.build(DataSettings, args).to_dict() == config["data"]
        assert args.out == str(tiny_replication / part)
    sinks = parser.parse_args(shlex.split(saved["commands"]["sinks"])[1:])
    chunks = json.loads((tiny_replication / "opening" / "layer_summary.jsonl").read_text().splitlines()[-1])["text"] + 1
    assert (sinks.chunk_length, sinks.max_chunks) == (16, chunks)
    again = parser.parse_args(shlex.split(saved["commands"]["replicate"])[1:])
    assert (
        again.size == "quick" and again.max_chunks == 4 and again.data == saved["data"]["lm"] + saved["data"]["choice"]
    )


def test_a_folder_of_another_replication_is_refused(tiny_decoder, replicate_data, tiny_replication, capsys) -> None:
    argv = ["replicate", "--model", str(tiny_decoder), *replicate_data, *REPLICATE_SIZES, "--max-chunks", "3"]
    assert cli.main([*argv, "--out", str(tiny_replication)]) == 2
    assert capsys.readouterr().err == (
        f"contribution-lens: error: {tiny_replication} holds a replication with other settings "
        f"({tiny_replication / 'config.json'}); use another --out folder\n"
    )


def test_the_replication_loads_back(tiny_replication: Path) -> None:
    result = replication.Replication.load(tiny_replication)
    assert [claim.id for claim in result.claims] == CLAIM_IDS
    assert result["downstream_winogrande"].verdict == replication.AT_CHANCE
    assert repr(result).startswith("Replication(model=") and "16" in repr(result)
    assert set(result.tables) >= {"aopc", "accuracy", "opening", "sink_heads"}
    assert runner.OPENING == Path("opening") / "layer_summary.jsonl"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: torch finds none here")
def test_the_cuda_path_is_taken_when_a_device_is_given(tiny_decoder, replicate_data, tmp_path) -> None:
    torch.cuda.reset_peak_memory_stats()
    argv = ["replicate", "--model", str(tiny_decoder), *replicate_data, *REPLICATE_SIZES, "--device", "cuda",
            "--dtype", "bfloat16", "--out", str(tmp_path)]  # fmt: skip
    assert cli.main(argv) == 0
    saved = read_claims(tmp_path)
    assert saved["device"].startswith("cuda") and saved["dtype"] == "bfloat16"
    assert torch.cuda.max_memory_allocated() > 0
    assert all(claim["verdict"] in replication.VERDICTS for claim in saved["claims"])
    assert "--device cuda --dtype bfloat16" in saved["commands"]["text"]


def test_a_given_prepend_bos_reaches_every_parts_command(tmp_path: Path) -> None:
    """``--prepend-bos no`` given to replicate is in the command of every part, so each reproduces the same chunks."""
    from contribution_lens.faithfulness import RunOptions

    (tmp_path / "t.txt").write_text("one two three")
    (tmp_path / "w.jsonl").write_text("{}")
    specs = (f"text={tmp_path / 't.txt'}", f"winogrande={tmp_path / 'w.jsonl'}")
    data = DataSettings(data=specs, chunk_length=16, max_chunks=4, prepend_bos=False)
    commands = runner.part_commands(runner.Parts(data, replication.SIZES["quick"]), tmp_path, [], RunOptions())
    parser = cli.app.build_parser()
    for part in ("text", "choice-clean", "choice", "sinks", "replicate"):
        assert "--prepend-bos no" in commands[part], part
        args = parser.parse_args(shlex.split(commands[part].replace("NEW_FOLDER", str(tmp_path / "new")))[1:])
        given = args.prepend_bos if part == "sinks" else options.build(DataSettings, args).prepend_bos
        assert given in ("no", False), (part, given)


SUBSETS = {
    "text-only": ("gsm8k=gsm8k/test.jsonl",),
    "choice-only": ("boolq=boolq/val.jsonl",),
    "both": ("gsm8k=gsm8k/test.jsonl", "boolq=boolq/val.jsonl"),
}


@pytest.mark.parametrize("subset", list(SUBSETS))
def test_every_subset_of_the_data_plans_and_runs(subset, tiny_decoder, shared_data, tmp_path, capsys) -> None:
    """A text set alone, a choice set alone or both: the dry run plans only the parts given, the run judges them."""
    words = [word for spec in SUBSETS[subset] for word in ("--data", spec.replace("=", f"={shared_data}/", 1))]
    argv = ["replicate", "--model", str(tiny_decoder), *words, *REPLICATE_SIZES, "--max-item-tokens", "256"]
    out = tmp_path / "run"
    assert cli.main([*argv, "--out", str(out), "--dry-run"]) == 0
    planned = {line.partition(":")[0]: line for line in capsys.readouterr().out.splitlines()}
    text, choice = subset != "choice-only", subset != "text-only"
    assert ("text faithfulness" in planned) == text and ("sink study" in planned) == text, planned
    assert ("multiple-choice clean accuracy" in planned) == choice, planned
    assert " 0 forward passes" not in planned.get("text faithfulness", "")
    assert cli.main([*argv, "--out", str(out)]) == 0
    claims = {claim["id"]: claim for claim in read_claims(out)["claims"]}
    assert list(claims) == CLAIM_IDS
    assert claims["hierarchy_chain"]["line"].startswith("no text data given") == (not text)
    assert claims["downstream_boolq"]["line"].startswith("no boolq data given") == (not choice)
    assert (out / "choice-clean").is_dir() == choice and (out / "text").is_dir() == text
