"""Kobayashi et al.'s layer-level norm against a float64 port of their code, and as a token-level method."""

import pytest

import contribution_lens as cl
from conftest import assert_close, tiny_bridge
from contribution_lens import adapter, faithfulness
from contribution_lens._settings import SettingError
from contribution_lens.methods import get_method
from helpers import authors_inputs, method_scores, tiny_batch
from reference import kobayashi_norms

TEXT = "Peers: the cat sat on the mat."


def assert_matches_kobayashi(model, text: str) -> None:
    batch = adapter.to_token_batch(model, text)
    layers = list(range(model.cfg.n_layers))
    got = method_scores(model, batch, "kobayashi", layers)
    per_head = method_scores(model, batch, "value_weighted", layers)
    for layer, inputs in authors_inputs(model, batch, layers).items():
        heads, summed = kobayashi_norms(inputs["probs"], inputs["values"], inputs["dense_weight"])
        scale = float(summed.abs().max())
        error = float((got[layer].double() - summed).abs().max()) / scale
        assert error <= 1e-5, f"layer {layer}: ||sum_h alpha f(x)|| differs from the port by {error:.2e} (relative)"
        # value_weighted is their per-head ||alpha f(x)||; its head sum is not the layer-level norm.
        assert_close(per_head[layer].double(), heads, rtol=1e-4, atol=1e-5 * scale)
        assert bool((got[layer] <= per_head[layer].sum(1) * (1 + 1e-5) + 1e-6).all()), "triangle inequality"


def test_kobayashi_matches_their_code_on_minilm(encoder_model) -> None:
    assert_matches_kobayashi(encoder_model, TEXT)


def test_kobayashi_matches_their_code_on_a_tiny_bert(tiny_bert) -> None:
    assert_matches_kobayashi(tiny_bert, TEXT)


def test_kobayashi_matches_their_code_on_smollm2_with_gqa(bundled_model) -> None:
    assert_matches_kobayashi(bundled_model, TEXT)


def test_kobayashi_is_not_the_head_sum_of_value_weighted(bundled_model) -> None:
    batch = adapter.to_token_batch(bundled_model, TEXT)
    layer = method_scores(bundled_model, batch, "kobayashi", [5])[5]
    head_sum = method_scores(bundled_model, batch, "value_weighted", [5])[5].sum(1)
    visible = layer > 0
    relative = ((head_sum - layer)[visible] / layer[visible]).median()
    assert float(relative) > 0.1, f"the two measures differ little here ({float(relative):.3f}): the test shows nothing"


@pytest.mark.parametrize("variant", ["mha", "gqa", "mqa"])
def test_kobayashi_is_token_level_and_zero_where_nothing_is_seen(variant: str) -> None:
    model = tiny_bridge(variant, biases=True)
    batch = tiny_batch(model)
    scores = method_scores(model, batch, "kobayashi", [0, 1])
    valid = cl.attention_geometry(model, batch.tokens, attention_mask=batch.attention_mask)[1].valid
    for layer in (0, 1):
        assert scores[layer].shape == valid.shape
        assert bool((scores[layer][~valid] == 0).all())
        assert bool((scores[layer][valid] > 0).all())
    assert get_method("kobayashi").token_level


def test_kobayashi_runs_through_the_faithfulness_harness_and_refuses_head_granularity() -> None:
    model = tiny_bridge("gqa", biases=True)
    batch = tiny_batch(model)
    protocol = faithfulness.Settings(methods=("kobayashi", "value_weighted"), ratios=(0.0, 0.5))
    clean = faithfulness.clean_run(model, batch, protocol)
    assert clean.scores["kobayashi"][1].shape == clean.valid.shape
    condition = faithfulness.Condition("kobayashi", "abs", "comprehensiveness", 0.5)
    [(_, logits)] = faithfulness.masked_forward(model, batch, clean, faithfulness.PROTOCOLS["every_layer"], [condition])
    assert logits.shape[:2] == batch.tokens.shape
    with pytest.raises(SettingError, match=r"granularity: expected 'token' with kobayashi \(token-level scores\)"):
        faithfulness.Settings(methods=("kobayashi", "attention"), granularity="head")
