"""Gradient times attention against autograd on a leaf pattern."""

import pytest
import torch

from conftest import assert_close, tiny_bridge
from contribution_lens import adapter
from contribution_lens.methods import gradient
from helpers import method_scores, tiny_batch


def test_grad_attention_equals_autograd_on_a_leaf_pattern() -> None:
    model = tiny_bridge("gqa", biases=True)
    batch = tiny_batch(model)
    got = method_scores(model, batch, "grad_attention", [0, 1])
    for layer in (0, 1):
        expected = autograd_alpha_times_grad(model, batch, layer)
        assert bool(got[layer].abs().sum() > 0), f"layer {layer}: no gradient reached the pattern"
        assert_close(got[layer], expected.float(), rtol=1e-4, atol=1e-7)


def test_grad_attention_on_bundled_model_and_needs_two_tokens(bundled_model) -> None:
    batch = adapter.to_token_batch(bundled_model, "Peers: the cat sat.")
    got = method_scores(bundled_model, batch, "grad_attention", [5])[5]
    # The library's float32 pass against a float64 loss: entries near 1e-4 differ by up to ~1e-6.
    assert_close(got, autograd_alpha_times_grad(bundled_model, batch, 5).float(), rtol=1e-3, atol=2e-6)
    one_token = adapter.to_token_batch(bundled_model, torch.tensor([[1]]))
    with pytest.raises(ValueError, match="grad_attention needs at least two tokens in a text"):
        gradient.attention_gradients(bundled_model, one_token, [0])


def autograd_alpha_times_grad(model, batch, layer: int) -> torch.Tensor:
    """alpha * dL/dalpha with alpha of one layer swapped for a leaf tensor (the rest of the graph intact)."""
    leaf: dict[str, torch.Tensor] = {}

    def swap(pattern: torch.Tensor, hook) -> torch.Tensor:
        leaf["alpha"] = pattern.detach().clone().requires_grad_(True)
        return leaf["alpha"]

    kwargs = {"attention_mask": batch.attention_mask.long()} if batch.padded else {}
    with torch.enable_grad(), model.hooks(fwd_hooks=[(adapter.pattern_hook(layer), swap)]):
        logits = model(batch.tokens, **kwargs)
    log_probs = torch.log_softmax(logits[:, :-1].double(), dim=-1)
    nll = -log_probs.gather(-1, batch.tokens[:, 1:, None])[..., 0]
    predicted = batch.attention_mask[:, 1:] & batch.attention_mask[:, :-1]
    nll[predicted].mean().backward()
    alpha = leaf["alpha"]
    assert alpha.grad is not None, "the loss must depend on the swapped pattern"
    visible = torch.ones(alpha.shape[-2:], dtype=torch.bool).tril() & batch.attention_mask[:, None, None, :]
    return torch.where(visible, alpha.detach() * alpha.grad, 0)
