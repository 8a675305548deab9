"""The adapter: what a layer offers, tokens, padding, and models without the hooks."""

import pytest
import torch

import contribution_lens as cl
from conftest import assert_close, raises_bad_input, tiny_bridge
from contribution_lens import adapter
from helpers import IDS, tokens


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
