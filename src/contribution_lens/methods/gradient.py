"""Gradient times attention: ``grad_attention``.

With ``L`` the mean next-token negative log-likelihood of the batch (real tokens only) and one
backward pass through the unmodified forward:

    g_ij^h = alpha_ij^h * dL / d alpha_ij^h                   (signed, per head)

The derivative is the total one: it follows ``alpha^l``'s effect through every later layer,
their patterns included. It is causal (a derivative) instead of read from the decomposition.
"""

from collections.abc import Sequence
from typing import Any

import einops
import torch
from jaxtyping import Float
from torch import Tensor

from contribution_lens import adapter
from contribution_lens.losses import mean_token_nll
from contribution_lens.methods.method import Method, ScoreContext, prepared_score


def attention_gradients(
    model: adapter.Model, batch: adapter.TokenBatch, layers: Sequence[int]
) -> dict[int, Float[Tensor, "batch head query key"]]:
    """``dL / d alpha^l`` for every requested layer from one forward and one backward pass.

    The residual stream entering block 0 is made a leaf requiring grad, so the patterns are in
    the graph whether or not the parameters require grad; parameter gradients are not computed.
    """
    patterns: dict[int, Tensor] = {}

    def keep(layer: int) -> adapter.HookFn:
        def hook(pattern: Tensor, hook: Any) -> None:
            patterns[layer] = pattern

        return hook

    def leaf(resid: Tensor, hook: Any) -> Tensor:
        return resid.detach().requires_grad_(True)

    hooks = [(adapter.resid_pre_hook(0), leaf)] + [(adapter.pattern_hook(layer), keep(layer)) for layer in layers]
    with torch.inference_mode(False), torch.enable_grad():
        logits = adapter.forward(model, batch, hooks, grad=True)
        loss = mean_token_nll(logits, batch.tokens, batch.attention_mask, what="grad_attention")
        grads = torch.autograd.grad(loss, [patterns[layer] for layer in layers], allow_unused=True)
    missing = [layer for layer, grad in zip(layers, grads, strict=True) if grad is None]
    if missing:
        raise RuntimeError(f"the loss does not depend on hook_pattern of layers {missing}")
    return {layer: grad.detach() for layer, grad in zip(layers, grads, strict=True)}


def grad_attention_score(layer: adapter.LayerInputs, context: ScoreContext) -> Float[Tensor, "batch head query key"]:
    """Registered ``grad_attention``: ``alpha * dL/dalpha`` per head, 0 where a key is not visible."""
    grad = prepared_score(layer, context)
    valid = einops.rearrange(layer.decompose(context.scope).valid, "batch query key -> batch 1 query key")
    return torch.where(valid, layer.pattern.float() * grad.float(), 0)


METHODS: tuple[Method, ...] = (
    Method(
        "grad_attention",
        grad_attention_score,
        "alpha * dL/dalpha: attention times the gradient of the next-token loss",
        signed=True,
        prepare=attention_gradients,
        builtin=True,
    ),
)
