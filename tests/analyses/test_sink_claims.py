"""The sink study: the claims judged on a corpus, and a result that saves, loads and reports itself."""

import json

import pandas as pd
import pytest
import torch

import contribution_lens as cl
from conftest import assert_self_contained
from contribution_lens.analyses import sink_claims as study_module


@pytest.fixture(scope="module")
def study(bundled_model) -> cl.SinkStudy:
    text = "The old lighthouse keeper climbed the stairs every night to light the lamp for the passing ships."
    ids = bundled_model.to_tokens([text, text.replace("lighthouse", "harbour")])[:, :20]
    return cl.sink_study(bundled_model, ids, variants=("zero",), progress=False)


def test_the_study_judges_every_claim_from_its_own_numbers(study) -> None:
    verdicts = study.verdicts()
    assert len(verdicts) == 4 and list(verdicts.columns) == ["claim", "measured here", "threshold", "verdict"]
    claims = study.claims
    assert claims["n_layers"] == 30 and 0 <= claims["share_queries_interior_minimum"] <= 1
    assert claims["zero_ppl"] > 0 and claims["zero_delta_ppl"] == pytest.approx(
        claims["zero_ppl"] - claims["zero_ppl_clean"]
    )
    assert set(study.effect().index) == {"zero"} and len(study.per_layer()) == 30
    layer, head = study.beta_head
    assert study.heads.loc[(layer, head), "sink_ratio"] == study.heads["sink_ratio"].max()
    titles = list(study.figures())
    assert titles[0].startswith("Per layer") and f"beta curves, L{layer}H{head}" in titles


def test_save_then_load_gives_the_same_study(study, tmp_path) -> None:
    folder = study.save(tmp_path / "sinks")
    assert {p.name for p in folder.iterdir()} == set(study_module.FILES.values())
    assert json.loads((folder / "sink_claims.json").read_text()) == study.claims
    assert_self_contained((folder / "sinks.html").read_text())
    loaded = cl.SinkStudy.load(folder)
    assert loaded.claims == study.claims and loaded.beta_head == study.beta_head and loaded.queries == study.queries
    pd.testing.assert_frame_equal(loaded.heads, study.heads, check_exact=False, rtol=1e-9)
    pd.testing.assert_frame_equal(loaded.effect(), study.effect())
    assert torch.equal(loaded.beta.sink_ratio, study.beta.sink_ratio.cpu())
    pd.testing.assert_frame_equal(loaded.verdicts(), study.verdicts())


def test_a_folder_without_a_study_is_named(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match=r"holds no saved sink study: sink_study.safetensors missing"):
        cl.SinkStudy.load(tmp_path)
    with pytest.raises(ValueError, match=r"variants must be some of \('zero', 'mean_tail'\), got \['none'\]"):
        cl.sink_study(None, torch.zeros(1, 3, dtype=torch.long), variants=("none",))


def test_a_truncated_study_file_is_named(study, tmp_path) -> None:
    folder = study.save(tmp_path / "sinks")
    state = folder / "sink_study.safetensors"
    state.write_bytes(state.read_bytes()[:100])
    expected = rf"^{state} is not a SinkStudy written by SinkStudy.save \(SafetensorError"
    with pytest.raises(ValueError, match=expected):
        cl.SinkStudy.load(folder)


def test_the_study_shows_a_bar_for_the_analysis_and_for_each_intervention(capsys) -> None:
    from conftest import tiny_bridge

    chunks = torch.tensor([[1, 5, 9, 3, 7, 2, 8, 11], [1, 4, 6, 11, 13, 2, 9, 5]])
    cl.sink_study(tiny_bridge("gqa"), chunks, batch_size=1)
    bars = capsys.readouterr().err
    assert "sink analysis: 100%" in bars and "2/2 [" in bars  # one step a layer of the 2-layer bridge
    assert "sink zero: 100%" in bars and "sink mean_tail: 100%" in bars
    cl.sink_study(tiny_bridge("gqa"), chunks, progress=False)
    assert capsys.readouterr().err == ""
