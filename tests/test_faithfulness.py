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


def test_protocol_refuses_bad_settings() -> None:
    with raises_bad_input("unknown method(s) ['saliency']"):
        faithfulness.Protocol(methods=("attention", "saliency"))
    with raises_bad_input("ratio 1.0 is outside [0, 1)"):
        faithfulness.Protocol(ratios=(0.0, 1.0))
    with raises_bad_input("ratio -0.1 is outside [0, 1)"):
        faithfulness.Protocol(ratios=(-0.1,))
    with raises_bad_input("unknown mode(s) ['both']"):
        faithfulness.Protocol(modes=("both",))


SMALL = faithfulness.Protocol(methods=("attention", "contribution", "random"), ratios=(0.0, 0.5))


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
    keys = [(r["task"], r["seq"], r["method"], r["mode"], r["ratio"]) for r in records]
    assert len(set(keys)) == len(keys) and keys == sorted(keys)
    for r in records:
        if r["ratio"] == 0 and r["kind"] == "lm":
            assert r["nll"] == r["clean"], "ratio 0 must reproduce the clean run exactly"
    summary = evaluation.summarise(records)
    at_zero = summary[(summary["task"] == "gsm8k") & (summary["ratio"] == 0)]
    assert (at_zero["delta_ppl"] == 0).all() and (at_zero["delta_loss"] == 0).all()
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
    # 3 units in all (2 of chunks, 1 of items), each 1 clean + 1 ratio-0 + 6 masked passes.
    assert 0 < resumed_calls < 3 * 8, "only the missing units are redone"
    assert calls["n"] == 0, "a complete run does no forward pass"
    got, want = read_merged(out), read_merged(small_run)
    assert [(r["task"], r["seq"], r["method"], r["mode"], r["ratio"]) for r in got] == [
        (r["task"], r["seq"], r["method"], r["mode"], r["ratio"]) for r in want
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
        "--methods", "attention,contribution,random", "--ratios", "0,0.5",
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
