"""Model-level invariants on tiny random bridges (mha / gqa / mqa, with and without biases)."""

import pandas as pd
import pytest
import torch

import contribution_lens as cl
from conftest import VARIANTS, assert_close, raises_bad_input, tiny_bridge
from contribution_lens import adapter
from helpers import IDS, tokens
from reference import reference_contributions

ARCHS = [pytest.param(v, b, id=f"{v}-{'bias' if b else 'nobias'}") for v in VARIANTS for b in (False, True)]


@pytest.mark.parametrize(("variant", "biases"), ARCHS)
def test_heads_reconstruct_attention_output(variant: str, biases: bool) -> None:
    model = tiny_bridge(variant, biases=biases)
    ids = tokens()
    _, cache = model.run_with_cache(ids)
    geometry = cl.attention_geometry(model, ids, scope="intra")
    for layer in range(model.cfg.n_layers):
        pattern, v = cache[adapter.pattern_hook(layer)], cache[adapter.value_hook(layer)]
        W_O, b_O = adapter.output_weights(model, layer)
        assert (b_O is not None) and bool((b_O != 0).any()) == biases
        ref = reference_contributions(pattern, v, W_O, "intra")
        hook_out = cache[adapter.output_hook(layer)].double()
        assert_close(ref["layer_output"] + b_O.double(), hook_out, rtol=1e-5, atol=1e-5)
        # No post-attention norm in these models: the block's hook_attn_out is the same tensor.
        assert_close(cache[f"blocks.{layer}.hook_attn_out"].double(), hook_out)
        assert_close(geometry[layer].attention, pattern)
        assert_close(geometry[layer].output_norm, ref["output_norm"], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("variant", "biases"), ARCHS)
def test_inter_output_norm_is_the_norm_of_hook_out_minus_bias(variant: str, biases: bool) -> None:
    model = tiny_bridge(variant, biases=biases, seed=1)
    ids = tokens(seed=1)
    _, cache = model.run_with_cache(ids)
    geometry = cl.attention_geometry(model, ids, scope="inter")
    for layer in geometry.layers:
        _, b_O = adapter.output_weights(model, layer)
        expected = (cache[adapter.output_hook(layer)] - b_O).norm(dim=-1)
        d = geometry[layer]
        for head in range(model.cfg.n_heads):
            assert_close(d.output_norm[:, head], expected, rtol=1e-4, atol=1e-5)
        assert_close(d.sum_over_heads().sum(-1), torch.ones(ids.shape), atol=1e-4)
        assert_close(d.attention * d.relative_norm * d.cosine, d.contribution, atol=1e-6)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_padding_gives_the_numbers_of_each_text_alone(variant: str) -> None:
    model = tiny_bridge(variant, biases=True)
    long, short = tokens(1, 9, seed=2), tokens(1, 5, seed=3)
    padded = torch.cat([long, torch.cat([short, torch.zeros(1, 4, dtype=torch.long)], dim=1)])
    mask = torch.ones_like(padded)
    mask[1, 5:] = 0
    batch = cl.attention_geometry(model, padded, attention_mask=mask)
    alone_long = cl.attention_geometry(model, long)
    alone_short = cl.attention_geometry(model, short)
    for layer in batch.layers:
        for name in cl.FACTORS:
            assert_close(batch[layer].factor(name)[:1], alone_long[layer].factor(name), atol=1e-5)
            assert_close(batch[layer].factor(name)[1:, :, :5, :5], alone_short[layer].factor(name), atol=1e-5)
            assert bool((batch[layer].factor(name)[1, :, 5:] == 0).all())
            assert bool((batch[layer].factor(name)[1, :, :, 5:] == 0).all())
    assert batch.attention_mask[1].tolist() == [True] * 5 + [False] * 4
    assert len(batch.str_tokens[1]) == 5


def test_cache_input_matches_forward_hooks() -> None:
    model = tiny_bridge("gqa", biases=True)
    ids = tokens()
    _, cache = model.run_with_cache(ids)
    from_cache = cl.attention_geometry(model, cache, tokens=ids, layers=[1])
    from_hooks = cl.attention_geometry(model, ids, layers=[1])
    assert list(from_cache.layers) == [1]
    assert_close(from_cache[1].contribution, from_hooks[1].contribution)
    assert from_cache.str_tokens == from_hooks.str_tokens


def test_head_summary_and_labels() -> None:
    model = tiny_bridge("mha")
    ids = tokens(1, 6)
    g = cl.attention_geometry(model, ids)
    summary = g.head_summary("attention")
    assert summary.shape == (2, 4)
    # Each valid query's attention sums to 1 over its i+1 keys: the mean over 21 pairs is 6/21.
    assert_close(summary, torch.full((2, 4), 6 / 21), atol=1e-5)
    assert g.labels()[0] == f"0:{g.str_tokens[0][0]}"
    assert len(set(g.labels())) == 6


def test_half_precision_model_is_finite_and_close_to_float32() -> None:
    model = tiny_bridge("gqa", biases=True)
    ids = tokens()
    full = cl.attention_geometry(model, ids)
    half = cl.attention_geometry(model.to(torch.bfloat16), ids)
    for layer in full.layers:
        assert half[layer].contribution.dtype == torch.float32
        assert bool(torch.isfinite(half[layer].contribution).all())
        # bf16 keeps 8 bits of mantissa: weights agree to a few hundredths.
        assert_close(half[layer].contribution, full[layer].contribution, rtol=0, atol=0.05)


def test_bad_input() -> None:
    model = tiny_bridge("mha")
    with raises_bad_input("layer 2 does not exist: the model has 2 layers"):
        cl.attention_geometry(model, tokens(), layers=[2])
    with raises_bad_input("more than the model's context of 64 tokens"):
        cl.attention_geometry(model, tokens(1, 65))
    with raises_bad_input("token tensor is empty"):
        cl.attention_geometry(model, torch.zeros(1, 0, dtype=torch.long))
    with raises_bad_input("has no tokenizer"):
        cl.attention_geometry(model, "some text")
    with raises_bad_input("not right-padded"):
        cl.attention_geometry(model, tokens(1, 4), attention_mask=torch.tensor([[1, 0, 1, 1]]))
    with raises_bad_input("scope must be one of"):
        cl.attention_geometry(model, tokens(), scope="all")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="no hook_dict"):
        cl.attention_geometry(torch.nn.Linear(2, 2), tokens(), layers=[0])  # type: ignore[arg-type]


def test_largest_intermediate_has_no_d_model_factor() -> None:
    """Every tensor made inside decompose is at most pattern-sized or one d_model vector per query."""
    batch, n_heads, pos, d_head, d_model = 1, 4, 48, 4, 128
    pattern = torch.softmax(torch.randn(batch, n_heads, pos, pos), -1)
    v, W_O = torch.randn(batch, pos, 2, d_head), torch.randn(n_heads, d_head, d_model)
    sizes: list[int] = []

    class Track(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor):
                sizes.append(out.numel())
            return out

    with Track():
        cl.decompose(pattern, v, W_O, scope="inter")
        cl.decompose(pattern, v, W_O, scope="intra")
    assert len(sizes) > 20
    assert max(sizes) == pattern.numel()
    assert pattern.numel() > batch * pos * d_model


def test_tidy_table_with_filters_and_token_strings(bundled_model) -> None:
    g = cl.attention_geometry(bundled_model, "The cat sat on the mat.", layers=[2, 3])
    table = g.to_dataframe(layers=3, heads=[0, 1], queries=[-1])
    n = len(g.str_tokens[0])
    assert len(table) == 2 * n  # one row per visible key of the last query, for two heads
    assert list(table.columns) == [
        "layer",
        "head",
        "query",
        "key",
        "query_token",
        "key_token",
        "attention",
        "relative_norm",
        "cosine",
        "contribution",
    ]
    row = table[(table["head"] == 1) & (table["key"] == 2)].iloc[0]
    assert row["query_token"] == g.str_tokens[0][-1] and row["key_token"] == g.str_tokens[0][2]
    assert row["contribution"] == pytest.approx(g[3].contribution[0, 1, n - 1, 2].item())
    causal = g.to_dataframe(layers=2, heads=0)
    assert (causal["key"] <= causal["query"]).all() and len(causal) == n * (n + 1) // 2


def test_save_and_load_round_trip(tmp_path) -> None:
    model = tiny_bridge("gqa", biases=True)
    g = cl.attention_geometry(model, IDS, scope="intra")
    path = g.save(tmp_path / "g.safetensors")
    back = cl.Geometry.load(path)
    assert back.scope == "intra" and back.layers == g.layers and back.str_tokens == g.str_tokens
    assert back.n_layers == g.n_layers and torch.equal(back.tokens, g.tokens)
    for layer in g:
        for name in cl.FACTORS:
            assert torch.equal(back[layer].factor(name), g[layer].factor(name))
    (tmp_path / "other.safetensors").write_bytes(b"not a file")
    with pytest.raises(Exception):  # noqa: B017 - safetensors' own error for a corrupt file
        cl.Geometry.load(tmp_path / "other.safetensors")
    with pytest.raises(FileNotFoundError, match="no saved Geometry at"):
        cl.Geometry.load(tmp_path / "missing.safetensors")


def test_layer_summary_streams_the_same_numbers_as_the_kept_geometry(bundled_model) -> None:
    text = "Alice gave Bob the book because she had read it."
    streamed = cl.layer_summary(bundled_model, text, layers=[0, 10, 29])
    kept = cl.attention_geometry(bundled_model, text, layers=[0, 10, 29]).layer_summary()
    pd.testing.assert_frame_equal(streamed, kept)


@pytest.mark.usefixtures("as_a_user")
def test_a_one_token_summary_is_refused() -> None:
    model = tiny_bridge("mha")
    with pytest.raises(ValueError, match="it needs a text of at least two tokens"):
        cl.attention_geometry(model, torch.tensor([[7]])).layer_summary()
    with pytest.raises(ValueError, match="it needs a text of at least two tokens"):
        cl.layer_summary(model, torch.tensor([[7]]))
