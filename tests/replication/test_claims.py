"""The verdict rules on tables whose answer is known: every claim reads what the library computed."""

import numpy as np
import pandas as pd
import pytest

from contribution_lens.replication import claims
from contribution_lens.replication.results import Replication


def verdict_row(better: str, worse: str, mode: str, low: float, high: float, *, protocol: str = "every_layer",
                task: str = "gsm8k") -> dict:  # fmt: skip
    from contribution_lens.faithfulness.statistics import judge

    row = {"protocol": protocol, "task": task, "mode": mode, "better": better, "worse": worse}
    return row | {"difference": (low + high) / 2, "ci_low": low, "ci_high": high, "verdict": judge(low, high, mode)}


def test_a_claim_is_supported_only_where_every_setting_says_so_and_shows_its_weakest() -> None:
    rows = [
        verdict_row("contribution", "attention", "comprehensiveness", 0.05, 0.20),
        verdict_row("contribution", "attention", "sufficiency", -0.02, -0.01),
        verdict_row("contribution", "attention", "comprehensiveness", 0.01, 0.03, protocol="input_deletion"),
    ]
    claim = claims.pair_claim(
        "contribution_beats_attention", pd.DataFrame(rows), "contribution", "attention", command="c"
    )
    assert claim.verdict == "supported"
    # The weakest: sufficiency's bound nearest 0 (-0.01, +0.01 in the claim's favour) ties input_deletion's 0.01;
    # the first in (protocol, task, mode) order is kept, and its number and interval are the claim's.
    assert (claim.number, claim.low, claim.high) == (-0.015, -0.02, -0.01)
    rows.append(verdict_row("contribution", "attention", "sufficiency", -0.01, 0.02, protocol="input_deletion"))
    partly = claims.pair_claim(
        "contribution_beats_attention", pd.DataFrame(rows), "contribution", "attention", command="c"
    )
    assert partly.verdict == "partly" and (partly.low, partly.high) == (-0.01, 0.02)
    assert partly.line.startswith("better in 3 of 4 settings; weakest: input_deletion · gsm8k · sufficiency: ")
    worse = [verdict_row("contribution", "attention", "sufficiency", 0.01, 0.02)]
    refuted = claims.pair_claim(
        "contribution_beats_attention", pd.DataFrame(worse), "contribution", "attention", command=""
    )
    assert refuted.verdict == "not supported" and refuted.line.startswith("better in 0 of 1 settings, worse in 1;")


def test_the_chain_holds_in_a_setting_only_where_all_three_links_do() -> None:
    links = [
        ("value_weighted", "attention"),
        ("output_normalized", "value_weighted"),
        ("contribution", "output_normalized"),
    ]
    rows = [verdict_row(b, w, "comprehensiveness", 0.01, 0.02) for b, w in links]
    rows += [verdict_row(b, w, "sufficiency", -0.02, -0.01) for b, w in links[:2]]
    rows.append(verdict_row(*links[2], "sufficiency", -0.01, 0.01))  # the last link cannot be told apart
    chain = claims.chain_claim(pd.DataFrame(rows), command="")
    assert chain.verdict == "partly"
    assert [cell.verdict for cell in chain.cells] == ["better", "indistinguishable"]
    assert chain.line.startswith(
        "the chain holds in 1 of 2 settings; weakest link: every_layer · gsm8k · sufficiency: "
    )


def clean_accuracy(task: str, accuracy: float, low: float, high: float, chance: float) -> pd.DataFrame:
    return pd.DataFrame([{"task": task, "clean_accuracy": accuracy, "clean_ci_low": low, "clean_ci_high": high,
                          "n": 100, "chance": chance, "above_chance": low > chance}])  # fmt: skip


def test_a_model_at_chance_gets_no_verdict_whatever_the_removal_says() -> None:
    removal = pd.DataFrame([verdict_row("contribution", "attention", "comprehensiveness", 0.1, 0.2, task="mmlu")])
    at_chance = clean_accuracy("mmlu", 0.27, 0.19, 0.36, 0.25)
    claim = claims.downstream_claim("mmlu", at_chance, removal, command="r", clean_command="c")
    assert claim.verdict == claims.AT_CHANCE == "no verdict: the model is at chance"
    assert claim.kind == "no verdict" and claim.command == "c" and not claim.cells
    assert (claim.number, claim.low, claim.high) == (0.27, 0.19, 0.36)
    assert claim.line.startswith(
        "clean accuracy 0.270 [0.190, 0.360] over 100 items, chance 0.250: the model is at chance"
    )
    above = claims.downstream_claim("mmlu", clean_accuracy("mmlu", 0.6, 0.5, 0.7, 0.25), removal, command="r",
                                    clean_command="c")  # fmt: skip
    assert above.verdict == "supported" and above.command == "r" and (above.low, above.high) == (0.1, 0.2)
    assert "accuracy drop(contribution) - accuracy drop(attention)" in above.line
    missing = claims.downstream_claim("boolq", at_chance, removal, command="r", clean_command="c")
    assert missing.verdict == "no verdict: no boolq data given (--data boolq=PATH)"


def test_the_opening_case_bootstraps_over_texts() -> None:
    rows = [{"text": t, "layer": layer, "sink_attention": 0.5 + 0.01 * t, "sink_contribution": 0.1}
            for t in range(6) for layer in range(3)]  # fmt: skip
    claim = claims.opening_claim(pd.DataFrame(rows), None, command="", resamples=200)
    assert claim.verdict == "supported" and claim.number == pytest.approx(0.425)
    assert 0.4 <= claim.low < claim.number < claim.high <= 0.45
    assert "larger in 3 of 3 layers" in claim.line
    flipped = pd.DataFrame(rows).assign(sink_contribution=0.9)
    assert claims.opening_claim(flipped, None, command="").verdict == "not supported"


def test_bootstrap_mean_is_the_mean_with_a_percentile_interval() -> None:
    values = np.arange(20.0)
    mean, low, high = claims.bootstrap_mean(values, resamples=500)
    assert mean == 9.5 and 6.5 < low < 9.5 < high < 12.5
    assert all(np.isnan(claims.bootstrap_mean(np.array([np.nan]))))


def test_a_verdict_outside_the_fixed_set_is_refused() -> None:
    with pytest.raises(ValueError, match="verdict must be one of"):
        claims.Claim("opening_case", "s", "better", "line", "")


def test_a_replication_round_trips_through_its_files(tmp_path) -> None:
    rows = [verdict_row("contribution", "attention", "comprehensiveness", 0.05, 0.2)]
    found = [
        claims.pair_claim("contribution_beats_attention", pd.DataFrame(rows), "contribution", "attention", command="x"),
        claims.downstream_claim(
            "mmlu", clean_accuracy("mmlu", 0.27, 0.19, 0.36, 0.25), None, command="r", clean_command="c"
        ),
        claims.no_verdict("sink_factors", "no text data given"),
    ]
    result = Replication(found, "m", "quick", {"lm": []}, {"text": "x"}, {"aopc": pd.DataFrame({"a": [1.0]})})
    result.save(tmp_path)
    back = Replication.load(tmp_path)
    assert back.claims == found and back.tables["aopc"].equals(result.tables["aopc"])
    markdown = (tmp_path / "claims.md").read_text()
    row = "| On MMLU, removing what contribution ranks highest costs more accuracy than attention's | "
    assert row + "+0.27 [+0.19, +0.36] | no verdict: the model is at chance |" in markdown
    with pytest.raises(KeyError, match="no claim 'x'"):
        back["x"]
    # A folder saved before replication.safetensors existed is read from its claims.json.
    (tmp_path / "replication.safetensors").unlink()
    from_json = Replication.load(tmp_path)
    assert from_json.claims == found and from_json.tables["aopc"].equals(result.tables["aopc"])
