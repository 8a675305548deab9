"""The same invariants on the real bundled SmolLM2-135M (GQA: 9 query heads, 3 kv heads)."""

import pytest
import torch

import contribution_lens as cl
from conftest import assert_close, raises_bad_input
from contribution_lens import adapter
from reference import reference_contributions

TEXTS = [
    "The quick brown fox jumps over the lazy dog because it was in a hurry.",
    "Paris is the capital of France.",
]


def test_bundled_model_loads_offline(bundled_model) -> None:
    cfg = bundled_model.cfg
    assert (cfg.n_layers, cfg.n_heads, cfg.n_key_value_heads, cfg.d_head) == (30, 9, 3, 64)
    batch = cl.to_token_batch(bundled_model, "Hello world")
    # Every text starts with the BOS token, so position 0 is the same sink everywhere.
    assert batch.str_tokens[0][0] == bundled_model.tokenizer.bos_token == "<|im_start|>"
    assert batch.tokens[0, 0].item() == bundled_model.tokenizer.bos_token_id
    # Real weights, not a random init: the model predicts an obvious continuation.
    logits = adapter.forward(bundled_model, cl.to_token_batch(bundled_model, "The capital of France is"))
    assert bundled_model.tokenizer.decode(logits[0, -1].argmax()).strip() == "Paris"


@pytest.mark.parametrize("scope", ["intra", "inter"])
def test_invariants_on_every_layer(bundled_model, scope: str) -> None:
    g = cl.attention_geometry(bundled_model, TEXTS[0], scope=scope)
    assert sorted(g.layers) == list(range(30))
    for layer, d in g.items():
        sums = d.contribution.sum(-1) if scope == "intra" else d.sum_over_heads().sum(-1)
        assert_close(sums, torch.ones_like(sums), atol=1e-4)
        assert_close(d.attention * d.relative_norm * d.cosine, d.contribution, atol=1e-5)
        assert bool(torch.isfinite(d.contribution).all()), layer


def test_heads_reconstruct_hook_out_and_match_the_oracle(bundled_model) -> None:
    batch = cl.to_token_batch(bundled_model, TEXTS[1])
    _, cache = bundled_model.run_with_cache(batch.tokens)
    g = cl.attention_geometry(bundled_model, cache, tokens=batch.tokens, layers=[0, 14, 29])
    for layer in (0, 14, 29):
        pattern, v = cache[adapter.pattern_hook(layer)], cache[adapter.value_hook(layer)]
        W_O, b_O = adapter.output_weights(bundled_model, layer)
        assert b_O is None  # Llama has no o-projection bias
        ref = reference_contributions(pattern, v, W_O, "inter")
        assert_close(ref["layer_output"], cache[adapter.output_hook(layer)].double(), rtol=1e-4, atol=1e-4)
        # No post-attention norm in Llama: the block-level hook holds the same output.
        assert_close(cache[f"blocks.{layer}.hook_attn_out"], cache[adapter.output_hook(layer)])
        assert_close(g[layer].contribution, ref["contribution"], rtol=1e-3, atol=1e-4)


def test_padded_batch_equals_each_text_alone(bundled_model) -> None:
    layers = [0, 10, 29]
    batch = cl.attention_geometry(bundled_model, TEXTS, layers=layers)
    n_short = len(batch.str_tokens[1])
    assert n_short < len(batch.str_tokens[0])
    assert not bool(batch.attention_mask[1, n_short:].any())
    for index, text in enumerate(TEXTS):
        alone = cl.attention_geometry(bundled_model, text, layers=layers)
        n = len(alone.str_tokens[0])
        assert batch.str_tokens[index] == alone.str_tokens[0]
        for layer in layers:
            for name in cl.FACTORS:
                got = batch[layer].factor(name)[index : index + 1, :, :n, :n]
                assert_close(got, alone[layer].factor(name), rtol=1e-4, atol=1e-5)
    assert bool((batch[29].contribution[1, :, n_short:] == 0).all())


def test_bf16_model_within_tolerance_of_fp32(bundled_model) -> None:
    half = cl.load_model(dtype=torch.bfloat16)
    assert adapter.model_dtype(half) == torch.bfloat16
    full_g = cl.attention_geometry(bundled_model, TEXTS[0], layers=[0, 15, 29])
    half_g = cl.attention_geometry(half, TEXTS[0], layers=[0, 15, 29])
    for layer in (0, 15, 29):
        got, want = half_g[layer].sum_over_heads(), full_g[layer].sum_over_heads()
        assert got.dtype == torch.float32 and bool(torch.isfinite(got).all())
        # Token-level weights: bf16 activations drift through 30 layers; 0.1 absolute is the
        # stated tolerance, and the typical error is far smaller.
        assert (got - want).abs().max().item() < 0.1
        assert (got - want).abs().mean().item() < 0.01


def test_text_errors(bundled_model) -> None:
    with raises_bad_input("input text 1 is empty"):
        cl.attention_geometry(bundled_model, ["fine", "   "])
    with raises_bad_input("no input texts given"):
        cl.attention_geometry(bundled_model, [])
    with raises_bad_input("more than the model's context of 8192 tokens"):
        cl.attention_geometry(bundled_model, "word " * 8300, layers=[0])
    with raises_bad_input("layer -31 does not exist"):
        cl.attention_geometry(bundled_model, "fine", layers=[-31])
