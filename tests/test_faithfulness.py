"""Causal masking: the intervention's exactness, the ranking rule, and the resumable run."""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import contribution_lens as cl
from conftest import assert_close, assert_self_contained, raises_bad_input, tiny_bridge
from contribution_lens import adapter, evaluation, faithfulness
from contribution_lens.interventions import remove_keys
from reference import reference_contributions


def test_removal_is_exactly_the_sum_of_the_remaining_terms() -> None:
    model = tiny_bridge("gqa", biases=True)
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    batch = adapter.to_token_batch(model, ids)
    keep = torch.rand(2, 8, 8, generator=torch.Generator().manual_seed(1)) > 0.4
    layer = 1
    captured = cl.map_layers(model, batch, lambda inputs: inputs, layers=[layer], edit=remove_keys({layer: keep}))[
        layer
    ]
    # The pattern the layer used after the edit holds only the surviving terms.
    W_O, b_O = captured.W_O, captured.b_O
    pattern = captured.pattern
    assert bool((pattern[~keep[:, None].expand_as(pattern)] == 0).all())
    remaining = reference_contributions(pattern, captured.v, W_O, "inter")["layer_output"]
    assert_close(remaining + b_O.double(), captured.hook_out.double(), rtol=1e-5, atol=1e-5)


def test_removal_keeps_the_other_weights_unrenormalised() -> None:
    model = tiny_bridge("mha")
    ids = torch.randint(0, 50, (1, 6), generator=torch.Generator().manual_seed(2))
    batch = adapter.to_token_batch(model, ids)
    keep = torch.ones(1, 6, 6, dtype=torch.bool)
    keep[0, 5, 0] = False
    _, cache = model.run_with_cache(ids)
    seen = {
        "pattern": cl.map_layers(model, batch, lambda inputs: inputs.pattern, layers=[0], edit=remove_keys({0: keep}))[
            0
        ]
    }
    clean = cache[adapter.pattern_hook(0)]
    assert bool((seen["pattern"][0, :, 5, 0] == 0).all())
    assert_close(seen["pattern"][0, :, 5, 1:], clean[0, :, 5, 1:])  # not rescaled to sum to 1


@pytest.mark.parametrize("mode", faithfulness.MODES)
@pytest.mark.parametrize("rank_by", ["abs", "signed"])
def test_removal_mask_follows_the_ranking_rule(mode: str, rank_by: str) -> None:
    pos = 10
    scores = torch.randn(2, pos, pos, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    valid = torch.ones(pos, pos, dtype=torch.bool).tril().expand(2, pos, pos).clone()
    valid[1, :, 7:] = False  # padded keys of the second sequence
    valid[1, 7:] = False
    for ratio in (0.0, 0.3, 0.7, 0.9):
        keep = faithfulness.removal_keep_mask(scores, valid, ratio=ratio, mode=mode, rank_by=rank_by)
        assert bool(keep[~valid].all()), "invalid keys are never removed"
        for b in range(2):
            for i in range(pos):
                candidates = valid[b, i].nonzero()[:, 0]
                removed = (~keep[b, i]).nonzero()[:, 0]
                assert len(removed) == math.floor(ratio * len(candidates) + 1e-9)
                if len(removed) == 0 or len(removed) == len(candidates):
                    continue
                value = scores[b, i].abs() if rank_by == "abs" else scores[b, i]
                kept = [int(j) for j in candidates if int(j) not in removed.tolist()]
                if mode == "comprehensiveness":
                    assert value[removed].min() >= value[kept].max()
                else:
                    assert value[removed].max() <= value[kept].min()


def test_random_control_records_do_not_depend_on_the_batch_size(bundled_model, shared_data, tmp_path) -> None:
    protocol = faithfulness.Protocol(methods=("random",), modes=("comprehensiveness",), ratios=(0.5,), rank_by="abs")
    runs = []
    for size in (1, 3):
        config = small_config(shared_data, lm=(), max_items=3, batch_size=size)
        evaluation.run_faithfulness(bundled_model, config, protocol, tmp_path / str(size), progress=False)
        runs.append(read_merged(tmp_path / str(size)))
    assert [r["seq"] for r in runs[0]] == [r["seq"] for r in runs[1]]
    for alone, batched in zip(*runs, strict=True):
        assert alone["logprobs"] == pytest.approx(batched["logprobs"], rel=1e-4, abs=1e-3), alone["seq"]


def test_protocol_refuses_bad_settings() -> None:
    with raises_bad_input("unknown protocol(s) ['everywhere']"):
        faithfulness.Protocol(protocols=("everywhere",))
    with raises_bad_input("input_deletion ranks tokens: granularity='head' needs the masking protocols"):
        faithfulness.Protocol(protocols=("input_deletion",), granularity="head")
    with raises_bad_input("unknown method(s) ['saliency']"):
        faithfulness.Protocol(methods=("attention", "saliency"))
    with raises_bad_input("ratio 1.0 is outside [0, 1)"):
        faithfulness.Protocol(ratios=(0.0, 1.0))
    with raises_bad_input("ratio -0.1 is outside [0, 1)"):
        faithfulness.Protocol(ratios=(-0.1,))
    with raises_bad_input("unknown mode(s) ['both']"):
        faithfulness.Protocol(modes=("both",))


SMALL = faithfulness.Protocol(methods=("attention", "contribution", "random"), ratios=(0.0, 0.5), rank_by="abs")


def small_config(shared_data: Path, **overrides) -> evaluation.RunConfig:
    settings = {
        "lm": (f"gsm8k={shared_data / 'gsm8k' / 'test.jsonl'}",),
        "choice": (f"boolq={shared_data / 'boolq' / 'val.jsonl'}",),
        "chunk_length": 32,
        "max_chunks": 4,
        "max_items": 2,
        "max_item_tokens": 256,
        "batch_size": 2,
    }
    settings.update(overrides)
    return evaluation.RunConfig(**settings)


def read_merged(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def small_run(bundled_model, shared_data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("faith") / "run"
    evaluation.run_faithfulness(bundled_model, small_config(shared_data), SMALL, out, progress=False)
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
    summary = evaluation.summarise(records)
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
    evaluation.run_faithfulness(bundled_model, small_config(shared_data), SMALL, out, progress=False)
    resumed_calls = calls["n"]
    calls["n"] = 0
    evaluation.run_faithfulness(bundled_model, small_config(shared_data), SMALL, out, progress=False)
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
    other = faithfulness.Protocol(methods=("attention",), ratios=(0.0, 0.5))
    with raises_bad_input("holds a run with other settings"):
        evaluation.run_faithfulness(bundled_model, small_config(shared_data), other, small_run, progress=False)


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
        ({"lm": (f"gsm8k={bad}",)}, "lacks field(s) ['answer']"),
        ({"lm": (f"fineweb={empty}",)}, "holds no records"),
        ({"lm": (f"text={short}",)}, "fewer than one chunk of 32"),
        ({"lm": (f"text={tmp_path / 'missing.txt'}",)}, "does not exist"),
        ({"choice": (f"mmlu={header}",)}, "has header"),
    ]
    for overrides, message in cases:
        out = tmp_path / "out"
        config = evaluation.RunConfig(**{"chunk_length": 32, **overrides})
        with pytest.raises(
            (ValueError, FileNotFoundError),
            match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]"),
        ):
            evaluation.run_faithfulness(bundled_model, config, SMALL, out, progress=False)
        assert not out.exists(), "nothing may be written for bad input"
    with raises_bad_input("nothing to evaluate"):
        evaluation.RunConfig()


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


def test_inter_scope_output_normalisation_does_not_change_the_ranking() -> None:
    """Per query, ||o_i|| is shared by every (head, key) in the inter scope; per head it is not."""
    from contribution_lens.decomposition import decompose, scores_from

    g = torch.Generator().manual_seed(5)
    pattern = torch.randn(1, 4, 9, 9, generator=g).masked_fill(~torch.ones(9, 9).tril().bool(), -torch.inf).softmax(-1)
    v, W_O = torch.randn(1, 9, 2, 6, generator=g), torch.randn(4, 6, 16, generator=g)
    masks = {}
    for scope in ("inter", "intra"):
        d = decompose(pattern, v, W_O, scope=scope)
        for method in ("value_weighted", "output_normalized"):
            token_scores = scores_from(d, method).sum(1)
            masks[scope, method] = faithfulness.removal_keep_mask(
                token_scores, d.valid, ratio=0.5, mode="comprehensiveness"
            )
    assert torch.equal(masks["inter", "value_weighted"], masks["inter", "output_normalized"])
    assert not torch.equal(masks["intra", "value_weighted"], masks["intra", "output_normalized"])


def test_signed_ranking_is_reported_only_where_it_differs() -> None:
    protocol = faithfulness.Protocol(methods=("attention", "contribution", "random"))
    labels = [faithfulness.Condition(m, r, "sufficiency", 0.1).label for m, r in protocol.variants()]
    assert labels == ["attention", "contribution", "contribution:signed", "random"]


def tiny_clean(protocol: faithfulness.Protocol, lengths=(8, 5)):
    model = tiny_bridge("gqa", biases=True)
    generator = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, 50, (n,), generator=generator) for n in lengths]
    batch = adapter.pad_rows(model, rows)
    return model, batch, faithfulness.clean_run(model, batch, protocol)


@pytest.mark.parametrize("name", list(faithfulness.PROTOCOLS))
def test_stacked_conditions_give_the_logits_of_one_condition_per_pass(name: str) -> None:
    protocol = faithfulness.Protocol(methods=("contribution", "random"), protocols=(name,))
    model, batch, clean = tiny_clean(protocol)
    removal = faithfulness.PROTOCOLS[name]
    todo = faithfulness.conditions(protocol, (0.3, 0.6), removal.variants(clean.layers))
    stacked = dict(faithfulness.masked_forward(model, batch, clean, removal, todo, rows_per_pass=64))
    alone = dict(faithfulness.masked_forward(model, batch, clean, removal, todo, rows_per_pass=1))
    assert len(stacked) == len(todo) == 3 * 2 * 2 * len(removal.variants(clean.layers))
    for condition in todo:
        valid = batch.attention_mask
        assert_close(stacked[condition][valid], alone[condition][valid], rtol=1e-4, atol=1e-4)
    nothing = dict(faithfulness.masked_forward(model, batch, clean, removal, [faithfulness.NOTHING_REMOVED]))
    assert_close(nothing[faithfulness.NOTHING_REMOVED], clean.logits, rtol=1e-5, atol=1e-5)


def test_input_deletion_renormalises_over_the_remaining_keys_at_every_layer() -> None:
    protocol = faithfulness.Protocol(methods=("contribution",), protocols=("input_deletion",), layers=(1,))
    model, batch, clean = tiny_clean(protocol)
    removal = faithfulness.PROTOCOLS["input_deletion"]
    condition = faithfulness.Condition("contribution", "abs", "comprehensiveness", 0.5)
    keep = removal.keep(clean, condition, 0)
    assert keep is removal.keep(clean, condition, 1), "one ranking per query, the same at every layer"
    edit = faithfulness.removal_edit(clean, removal, [condition])
    seen = cl.map_layers(model, batch, lambda layer: layer.pattern, layers=[0, 1], edit=edit)
    valid = batch.attention_mask
    for layer in (0, 1):
        pattern = seen[layer]
        assert bool((pattern[~keep[:, None].expand_as(pattern)] == 0).all()), "deleted keys get no weight"
        sums = pattern.sum(-1)[valid[:, None].expand(-1, pattern.shape[1], -1)]
        assert_close(sums, torch.ones_like(sums), rtol=1e-5, atol=1e-5)


def test_head_granularity_ranks_each_heads_keys() -> None:
    protocol = faithfulness.Protocol(methods=("output_normalized", "random"), granularity="head", scope="intra")
    *_, clean = tiny_clean(protocol)
    assert clean.scores["output_normalized"][0].shape == (2, 4, 8, 8)
    assert clean.scores["random"][1].shape == (2, 4, 8, 8)
    condition = faithfulness.Condition("output_normalized", "abs", "comprehensiveness", 0.5)
    keep = faithfulness.PROTOCOLS["every_layer"].keep(clean, condition, 0)
    assert keep.shape == (2, 4, 8, 8) and not torch.equal(keep[:, 0], keep[:, 1]), "heads choose their own keys"
    assert ((~keep).sum(-1)[0, :, 7] == 4).all(), "each head removes floor(0.5 * 8) keys of query 7"


FULL = faithfulness.Protocol(
    methods=("attention", "value_weighted", "contribution", "random"),
    ratios=(0.0, 0.2, 0.5),
    layers=(2, 20),
    protocols=tuple(faithfulness.PROTOCOLS),
)


def full_config(shared_data: Path) -> evaluation.RunConfig:
    winogrande = f"winogrande={shared_data / 'winogrande' / 'dev_partial_scoring_llmfoundry.jsonl'}"
    return small_config(shared_data, choice=(winogrande,), max_chunks=2, max_items=2)


@pytest.fixture(scope="module")
def full_run(bundled_model, shared_data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("full") / "run"
    evaluation.run_faithfulness(bundled_model, full_config(shared_data), FULL, out, progress=False, resamples=200)
    return out


def test_every_protocol_writes_intervals_aopc_and_verdicts(full_run: Path) -> None:
    import pandas as pd

    summary = pd.read_csv(full_run / "summary.csv")
    assert set(summary["protocol"]) == set(faithfulness.PROTOCOLS)
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
    plan = evaluation.plan_run(bundled_model, config, FULL, out=tmp_path / "new")
    # 2 units (1 of chunks, 1 of items); per unit 1 clean + 1 at ratio 0 + 5 ranked methods x 2 modes
    # x 2 ratios for every_layer and input_deletion, and twice that for one_layer (2 layers).
    assert plan.passes == 2 * (2 + 20 + 20 + 40)
    assert plan.seconds > plan.forward_seconds > 0
    assert f"{plan.passes} forward passes" in plan.describe()
    assert not (tmp_path / "new").exists()
    assert evaluation.plan_run(bundled_model, config, FULL, out=full_run).passes == 0, "a finished run has no work"
