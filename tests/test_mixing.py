"""layer_mixing (the flow's per-layer step) against its former, fully materialised formula.

`layer_mixing` builds the per-head weights ``w_ij^h`` a few heads at a time and keeps only their
sum and the parts above a threshold; `_materialised` is the formula it replaced, every
``[batch head query key]`` tensor built at once: both must give the same numbers, with padding,
GQA, MQA, a bidirectional encoder and a Gemma-style norm after the attention.
"""

import dataclasses

import pytest
import torch

import architectures
import contribution_lens as cl
from conftest import assert_close, tiny_bridge, tiny_encoder
from contribution_lens import adapter, mixing
from helpers import tiny_batch

IDS = torch.tensor([1, 5, 9, 3, 7, 2, 8, 11])


def _materialised(layer: adapter.LayerInputs, update: adapter.AttentionUpdate) -> dict[str, torch.Tensor]:
    """The former layer_mixing: weights, token mixing, residual term and value norms, nothing contracted early."""
    acc = torch.promote_types(layer.pattern.dtype, torch.float32)
    valid = layer.valid
    alpha = torch.where(valid[:, None], layer.pattern.to(acc), 0)
    v = layer.v.to(acc).repeat_interleave(alpha.shape[1] // layer.v.shape[2], dim=2)
    W_O = layer.W_O.to(acc)
    x, added = update.resid_pre.to(acc), update.added.to(acc)
    stream = x + added
    squared = (stream * stream).sum(-1)
    inverse = torch.where(squared > 0, 1 / squared, 0)
    scale = None if update.scale is None else update.scale.to(acc)
    direction = stream if update.norm is None else update.norm.pull_back(stream, scale)
    read = torch.einsum("bqm,hdm->bqhd", direction, W_O)
    weights = alpha * torch.einsum("bqhd,bkhd->bhqk", read, v) * inverse[:, None, :, None]
    z = torch.einsum("bhqk,bkhd->bqhd", alpha, v) if layer.z is None else layer.z.to(acc)
    heads = torch.einsum("bqhd,hdm->bqm", z, W_O)
    vt = torch.einsum("bkhd,hdm->bkhm", v, W_O)
    if update.norm is not None:
        heads = update.norm.linear(heads, scale)
        vt = update.norm.linear(vt, None)
    residual = (stream * (x + added - heads)).sum(-1) * inverse
    mixing = weights.sum(1)
    mixing.diagonal(dim1=-2, dim2=-1).add_(torch.where(valid.any(-1), residual, 1.0))
    value_norm = vt.norm(dim=-1).transpose(1, 2)
    return {"weights": weights, "mixing": mixing, "residual": residual, "value_norm": value_norm, "valid": valid}


def _gemma3(tmp_path_factory: pytest.TempPathFactory) -> adapter.Model:
    return cl.load_model(str(architectures.build("Gemma3ForCausalLM", tmp_path_factory.mktemp("gemma3") / "gemma3")))


MODELS = {
    "mha": lambda _: tiny_bridge("mha", biases=True),
    "gqa": lambda _: tiny_bridge("gqa", biases=True),
    "mqa": lambda _: tiny_bridge("mqa", biases=True),
    "encoder-gqa": lambda _: tiny_encoder("gqa", biases=True),
    "gemma3-post-norm": _gemma3,
}


BATCHES = {"padded": tiny_batch, "one-text": lambda model: adapter.to_token_batch(model, IDS)}


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("chunk", [None, 1, 3], ids=["defaults", "one-head-tiles", "uneven-chunks-tiles"])
@pytest.mark.parametrize("name", list(MODELS))
def test_layer_mixing_equals_the_materialised_formula(name, chunk, batch, tmp_path_factory, monkeypatch):
    model = MODELS[name](tmp_path_factory)
    tokens = BATCHES[batch](model)
    if chunk is not None:
        # `chunk` heads at a time (of 4: 3 then 1), and a causal square pattern in tiles of 2 or 3 queries.
        monkeypatch.setattr(mixing, "_HEAD_CHUNK", chunk * tokens.tokens.numel() * tokens.tokens.shape[1])
        monkeypatch.setattr(mixing, "_TILE", 3)
    threshold = 0.02
    seen = []

    def per_layer(layer: adapter.LayerInputs) -> None:
        update = adapter.attention_update(model, layer)
        got = mixing.layer_mixing(layer, update, factors=True, threshold=threshold)
        # Without hook_out (or with it in half precision) the heads' sum is rebuilt from alpha v.
        bare = mixing.layer_mixing(dataclasses.replace(layer, z=None, hook_out=None), update)
        seen.append((got, bare, _materialised(layer, update)))

    cl.map_layers(model, tokens, per_layer, capture=adapter.flow_capture(model))
    assert sum(len(got.strong.weight) for got, _, _ in seen) > 0
    for got, bare, expected in seen:
        assert_close(got.mixing, expected["mixing"], rtol=1e-5, atol=1e-5)
        assert_close(bare.mixing, expected["mixing"], rtol=1e-5, atol=1e-5)
        # A padding query's residual term is that of whatever the model attended there; its row is the identity's.
        real = expected["valid"].any(-1)
        assert_close(got.residual[real], expected["residual"][real], rtol=1e-5, atol=1e-5)
        assert_close(got.value_norm, expected["value_norm"], rtol=1e-4, atol=1e-5)
        weights, strong = expected["weights"], got.strong
        index = (strong.batch, strong.head, strong.query, strong.key)
        assert_close(strong.weight, weights[index], rtol=1e-5, atol=1e-6)
        kept = torch.zeros_like(weights, dtype=torch.bool)
        kept[index] = True
        differ = kept != (weights.abs() >= threshold)
        assert bool(((weights[differ].abs() - threshold).abs() < 1e-6).all())  # only at the threshold itself
        assert not bool((kept & ~expected["valid"][:, None]).any())  # nothing a query cannot see, no padding
        order = ((strong.batch * 64 + strong.head) * 64 + strong.query) * 64 + strong.key
        assert bool((order.diff() > 0).all())  # one part once, in (batch, head, query, key) order
