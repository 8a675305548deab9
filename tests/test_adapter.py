"""The adapter: what a layer offers, tokens, padding, and models without the hooks."""

import dataclasses

import pytest
import torch

import contribution_lens as cl
from conftest import assert_close, raises_bad_input, tiny_bridge
from contribution_lens import adapter
from helpers import IDS, tiny_batch, tokens


def test_layer_inputs_hold_what_the_layer_offers() -> None:
    model = tiny_bridge("mqa", biases=True, seed=2)
    seen = cl.map_layers(model, IDS, lambda layer: layer, layers=[-1])[-1]
    _, cache = model.run_with_cache(IDS)
    assert seen.layer == 1 and seen.causal
    assert_close(seen.pattern, cache[adapter.pattern_hook(1)])
    assert_close(seen.v, cache[adapter.value_hook(1)])
    assert_close(seen.z, cache["blocks.1.attn.hook_z"])
    assert_close(seen.hook_out, cache[adapter.output_hook(1, model)])
    assert seen.b_O is not None and seen.W_O.shape == (4, 8, 32)
    assert torch.equal(seen.tokens, IDS) and bool(seen.attention_mask.all()) and seen.padding_mask is None


@pytest.mark.usefixtures("as_a_user")
def test_token_ids_and_layers_and_caches() -> None:
    model = tiny_bridge("gqa")
    with pytest.raises(ValueError, match=r"token id 50 is outside the model's vocabulary of 50 ids \(0..49\)"):
        cl.attention_geometry(model, torch.tensor([[1, 2, 50]]))
    with pytest.raises(ValueError, match=r"token id -1 is outside the model's vocabulary"):
        cl.map_layers(model, torch.tensor([[1, -1, 3]]), lambda layer: None)
    with pytest.raises(ValueError, match=r"layer -3 does not exist: the model has 2 layers \(0..1\)"):
        cl.attention_geometry(model, torch.tensor([[1, 2, 3]]), layers=[-3])
    assert cl.attention_geometry(model, torch.tensor([[1, 2, 3]]), layers=[-1]).layers == [1]
    _, cache = model.run_with_cache(torch.tensor([[1, 2, 3]]), remove_batch_dim=True)
    with pytest.raises(ValueError, match=r"the cache has no batch axis \(made with remove_batch_dim=True\)"):
        cl.attention_geometry(model, cache)


@pytest.mark.usefixtures("as_a_user")
def test_pad_rows_checks_vocabulary_through_to_token_batch() -> None:
    model = tiny_bridge("mha")
    with pytest.raises(ValueError, match="attention_mask is not right-padded"):
        adapter.to_token_batch(model, torch.tensor([[1, 2, 3]]), attention_mask=torch.tensor([[1, 0, 1]]))


def test_model_without_attention_hooks_is_refused() -> None:
    model = tiny_bridge("mha")

    class NoHooks:
        def __init__(self) -> None:
            self.cfg = model.cfg
            self.hook_dict = {k: v for k, v in model.hook_dict.items() if not k.endswith("hook_v")}

    with raises_bad_input("model has no hook 'blocks.0.attn.hook_v'"):
        cl.attention_geometry(NoHooks(), tokens())


def test_head_outputs_are_derived_once_with_one_masking_rule() -> None:
    """``z = alpha v`` from hook_z or from the pattern: the same numbers, 0 at padding queries, cached per dtype."""
    model = tiny_bridge("gqa", biases=True, seed=3)
    batch = tiny_batch(model)  # right-padded: the second text's positions 4.. are padding
    seen = []

    def per_layer(layer: adapter.LayerInputs) -> None:
        from_hook = layer.head_outputs()
        assert layer.head_outputs() is from_hook  # derived once for every caller of the pass
        rebuilt = dataclasses.replace(layer, z=None, _cache={}).head_outputs()
        seen.append((layer, from_hook, rebuilt))

    cl.map_layers(model, batch, per_layer)
    for layer, from_hook, rebuilt in seen:
        assert layer.z is not None and from_hook.dtype == torch.float32
        real = batch.attention_mask[:, :, None, None]
        assert_close(rebuilt, from_hook, rtol=1e-5, atol=1e-6)
        assert bool((from_hook.masked_select(~real) == 0).all()) and bool((rebuilt.masked_select(~real) == 0).all())
        expected = torch.einsum("bhqk,bkhd->bqhd", layer.pattern, layer.v.repeat_interleave(2, dim=2))
        assert_close(from_hook[0], expected[0], rtol=1e-5, atol=1e-6)  # the unpadded text: alpha v itself


def _final_stream(model, ids, positions):
    """The residual stream entering the final norm, its scale and the unembedding's output, at ``positions``."""
    _, cache = model.run_with_cache(ids[None], names_filter=lambda name: name.startswith(("ln_final.", "unembed.")))
    rows = torch.tensor(positions)
    return cache["ln_final.hook_in"][0, rows], cache["ln_final.hook_scale"][0, rows, 0], cache["unembed.hook_out"][0]


def test_the_readout_evaluates_the_models_own_logit_from_its_residual_stream() -> None:
    model = tiny_bridge("gqa", biases=True, seed=4)
    readout = adapter.readout(model)
    assert readout.post_norms == (None, None) and readout.softcap is None and readout.final_norm is not None
    assert list(readout.residual_capture) == adapter.residual_capture(model)
    assert list(readout.flow_capture) == adapter.flow_capture(model) == ["hook_resid_pre"]
    ids = torch.tensor([1, 5, 9, 3, 7, 2, 8, 11])
    stream, scale, raw = _final_stream(model, ids, [3, 7])
    value = readout.logit(stream, scale, [5, 9], [None, 2])
    assert value.dtype == torch.float64
    expected = torch.stack([raw[3, 5], raw[7, 9] - raw[7, 2]]).double()
    assert_close(value, expected, rtol=1e-5, atol=1e-5)
    # In float32 it is the same number to float32's precision, not float64's.
    assert_close(readout.logit(stream, scale, [5, 9], [None, 2], dtype=torch.float32), expected.float())
    with pytest.raises(ValueError, match="final_scale is needed"):
        readout.logit(stream, None, [5, 9])


def test_the_readout_of_a_post_normed_model_reads_every_layers_norm(tmp_path) -> None:
    """Gemma 3: a norm after each attention (its scale captured per layer), RMSNorm with the weight offset."""
    import architectures

    model = cl.load_model(str(architectures.build("Gemma3ForCausalLM", tmp_path / "gemma3")))
    readout = adapter.readout(model)
    assert all(norm is not None for norm in readout.post_norms) and len(readout.post_norms) == model.cfg.n_layers
    assert readout.flow_capture[0] == "hook_resid_pre" and readout.flow_capture[-1].endswith("hook_scale")
    ids = model.tokenizer.encode(architectures.TEXT, return_tensors="pt")[0]
    stream, scale, raw = _final_stream(model, ids, [len(ids) - 1])
    target = int(raw[-1].argmax())
    assert_close(readout.logit(stream, scale, [target]), raw[-1:, target].double(), rtol=1e-4, atol=1e-4)


def test_the_readout_of_bloom_takes_no_norm_after_its_attention(tmp_path) -> None:
    """Bloom's ``hook_attn_out`` is ``attn.o.hook_out``, the o-projection itself (its attention adds the residual
    stream inside): no norm follows the attention, as the circuit wiring always read it, and logit attribution's
    terms sum to the model's logit (the readout took ``attn.o`` for a norm and refused, before one anatomy)."""
    import architectures

    model = cl.load_model(str(architectures.build("BloomForCausalLM", tmp_path / "bloom")))
    readout = adapter.readout(model)
    assert readout.post_norms == (None, None) and readout.flow_capture == ("hook_resid_pre",)
    assert (
        adapter.circuit_wiring._weights(model, adapter.anatomy_of(model).layers[0], 0, torch.float32).post_name is None
    )
    explained = cl.logit_attribution(model, architectures.TEXT)
    assert_close(torch.tensor(explained.total()), torch.tensor(explained.logit).double(), rtol=1e-5, atol=1e-5)
