"""Paired bootstrap, AOPC and verdicts on synthetic records with known answers."""

import numpy as np
import pandas as pd
import pytest

from conftest import raises_bad_input
from contribution_lens.faithfulness import statistics

RATIOS = (0.0, 0.1, 0.5)


def synthetic_records(
    effects: dict[str, float], *, n: int = 60, noise: float = 0.05, seed: int = 0, mode: str = "comprehensiveness"
) -> pd.DataFrame:
    """Per-token Δloss of ``method`` at ratio r > 0 is ``effects[method] * r / 0.3`` plus text noise.

    The text noise is shared by every method (paired), as real texts are.
    """
    rng = np.random.default_rng(seed)
    tokens = rng.integers(20, 40, size=n)
    clean = rng.uniform(2, 4, size=n) * tokens
    shared = rng.normal(0, 1, size=n)
    rows = []
    for method, effect in effects.items():
        own = rng.normal(0, noise, size=n)
        for ratio in RATIOS:
            scale = ratio / 0.3
            per_token = (effect + shared + own) * scale
            for s in range(n):
                rows.append(
                    {
                        "protocol": "every_layer",
                        "task": "text",
                        "kind": "lm",
                        "seq": str(s),
                        "method": method,
                        "mode": mode,
                        "ratio": ratio,
                        "nll": clean[s] + per_token[s] * tokens[s],
                        "clean": clean[s],
                        "tokens": int(tokens[s]),
                    }
                )
    return pd.DataFrame(rows)


def test_resample_counts_are_reproducible_and_draw_every_text_count_times() -> None:
    a = statistics.resample_counts(7, resamples=50, seed=3)
    assert np.array_equal(a, statistics.resample_counts(7, resamples=50, seed=3))
    assert not np.array_equal(a, statistics.resample_counts(7, resamples=50, seed=4))
    assert (a.sum(1) == 7).all()
    with raises_bad_input("cannot bootstrap an empty set of texts"):
        statistics.resample_counts(0, resamples=5, seed=0)


def test_delta_loss_is_token_weighted_and_aopc_is_the_mean_over_nonzero_ratios() -> None:
    records = synthetic_records({"attention": 0.1, "contribution": 0.4})
    tables = statistics.bootstrap_tables(records, resamples=200)
    for method in ("attention", "contribution"):
        rows = records[records["method"] == method]
        expected = {
            r: ((g["nll"] - g["clean"]).sum() / g["tokens"].sum()) for r, g in rows.groupby("ratio")
        }  # fmt: skip
        got = tables.delta_loss.query("method == @method").set_index("ratio")["delta_loss"]
        for ratio in RATIOS:
            assert got[ratio] == pytest.approx(expected[ratio], abs=1e-12)
        aopc = tables.aopc.query("method == @method").iloc[0]
        assert aopc["aopc"] == pytest.approx((expected[0.1] + expected[0.5]) / 2, abs=1e-12)
        assert aopc["ratios"] == "0.1,0.5", "ratio 0 is not part of the area"
        assert aopc["ci_low"] <= aopc["aopc"] <= aopc["ci_high"]
    at_zero = tables.delta_loss.query("ratio == 0")
    assert (at_zero[["delta_loss", "ci_low", "ci_high"]] == 0).all().all()


@pytest.mark.parametrize("mode", ["comprehensiveness", "sufficiency"])
def test_known_orderings_get_the_right_verdicts(mode: str) -> None:
    # Under comprehensiveness the faithful method hurts more; under sufficiency it hurts less.
    sign = 1 if mode == "comprehensiveness" else -1
    effects = {
        "attention": 0.0,
        "value_weighted": sign * 0.2,
        "output_normalized": sign * 0.2,  # tied with value_weighted
        "contribution": sign * 0.1,  # claimed best, truly worse than value_weighted
        "random": -sign * 0.3,
    }
    verdicts = statistics.bootstrap_tables(synthetic_records(effects, mode=mode), resamples=300).verdicts
    got = {(r.better, r.worse): r.verdict for r in verdicts.itertuples()}
    assert got == {
        ("value_weighted", "attention"): "better",
        ("output_normalized", "value_weighted"): "indistinguishable",
        ("contribution", "output_normalized"): "worse",
        ("contribution", "attention"): "better",
        ("contribution", "value_weighted"): "worse",
        ("contribution", "random"): "better",
    }
    row = verdicts.set_index(["better", "worse"]).loc[("contribution", "attention")]
    assert row["difference"] == pytest.approx(sign * 0.1 * (0.1 + 0.5) / 2 / 0.3, abs=0.02)


def test_interval_covers_the_true_difference_and_is_reproducible() -> None:
    true_difference = 0.05 * (0.1 + 0.5) / 2 / 0.3
    covered = 0
    for seed in range(20):
        records = synthetic_records({"attention": 0.0, "contribution": 0.05}, n=40, noise=0.1, seed=seed)
        row = statistics.bootstrap_tables(records, resamples=300, seed=seed).verdicts.iloc[0]
        covered += row["ci_low"] <= true_difference <= row["ci_high"]
    assert covered >= 16, f"the 95% interval covered the truth in only {covered}/20 runs"
    records = synthetic_records({"attention": 0.0, "contribution": 0.05})
    first = statistics.bootstrap_tables(records, resamples=100, seed=7).verdicts
    pd.testing.assert_frame_equal(first, statistics.bootstrap_tables(records, resamples=100, seed=7).verdicts)
    other = statistics.bootstrap_tables(records, resamples=100, seed=8).verdicts
    assert first["ci_low"].iloc[0] != other["ci_low"].iloc[0]


def test_claimed_pairs_follow_the_chain_then_contribution_against_every_other_method() -> None:
    pairs = statistics.claimed_pairs(
        ["attention", "value_weighted", "output_normalized", "contribution", "random", "peer"]
    )
    assert pairs == [
        ("value_weighted", "attention"),
        ("output_normalized", "value_weighted"),
        ("contribution", "output_normalized"),
        ("contribution", "attention"),
        ("contribution", "value_weighted"),
        ("contribution", "random"),
        ("contribution", "peer"),
    ]


def test_judge_reads_the_interval_in_the_direction_of_the_mode() -> None:
    assert statistics.judge(0.01, 0.03, "comprehensiveness") == "better"
    assert statistics.judge(0.01, 0.03, "sufficiency") == "worse"
    assert statistics.judge(-0.03, -0.01, "sufficiency") == "better"
    assert statistics.judge(-0.01, 0.03, "sufficiency") == "indistinguishable"
    assert statistics.judge(1e-9, 2e-9, "comprehensiveness") == "indistinguishable", "noise-sized gaps are ties"


def test_choice_accuracy_has_intervals_and_the_chance_line() -> None:
    rng = np.random.default_rng(0)
    rows = []
    for item in range(80):
        clean = bool(rng.random() < 0.5)
        for ratio in (0.0, 0.5):
            rows.append(
                {
                    "protocol": "every_layer", "task": "boolq", "kind": "choice", "seq": str(item),
                    "method": "contribution", "mode": "sufficiency", "ratio": ratio,
                    "correct": clean if ratio == 0 else bool(rng.random() < 0.3),
                    "clean": clean, "logprobs": [-1.0, -2.0],
                }
            )  # fmt: skip
    table = statistics.bootstrap_tables(pd.DataFrame(rows), resamples=300).accuracy
    assert (table["chance"] == 0.5).all()
    row = table.query("ratio == 0").iloc[0]
    assert row["ci_low"] < row["accuracy"] < row["ci_high"]
    assert row["accuracy"] == row["clean_accuracy"]
    assert row["clean_ci_low"] < 0.5 < row["clean_ci_high"] and not row["above_chance"]


def test_the_layer_level_norm_is_judged_beside_attention_and_the_per_head_norm() -> None:
    pairs = statistics.claimed_pairs(["attention", "value_weighted", "kobayashi", "contribution"])
    assert ("kobayashi", "attention") in pairs and ("kobayashi", "value_weighted") in pairs
    assert ("contribution", "kobayashi") in pairs, "contribution is still judged against every other method"
    assert len(pairs) == len(set(pairs))
    assert statistics.claimed_pairs(["attention", "kobayashi"]) == [("kobayashi", "attention")]
