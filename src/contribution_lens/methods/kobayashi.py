"""Kobayashi et al.'s (2020) layer-level norm measure: ``kobayashi``, ``||sum_h alpha_ij^h f^h(x_j)||``.

Notation as in `contribution_lens.decomposition`: ``f^h(x_j) = vt_j^h = v_j^h W_O^h`` is the
projected value. ``v_j^h`` is ``hook_v``, so it holds the value bias ``b_V`` (``x W_V + b_V``), as
the authors' ``value_layer`` does; ``b_O`` belongs to no token and is left out, as in their code.
The score of key ``j`` for query ``i`` at one layer is the norm of what ``j`` adds to the layer's
attention output, summed over heads *before* the norm:

    kobayashi_ij = || sum_h alpha_ij^h vt_j^h ||          (token level, [batch query key])

This is not the per-head ``value_weighted`` score ``alpha_ij^h ||vt_j^h||`` summed over heads,
``sum_h alpha_ij^h ||vt_j^h||``: heads whose vectors point apart cancel in the norm of the sum, not
in the sum of the norms (the triangle inequality: ``kobayashi <= sum_h value_weighted``).

No ``[batch query key d_model]`` tensor is built. With the per-key Gram matrix of the heads'
projected values, ``G_j[h, g] = <vt_j^h, vt_j^g>`` (``[batch key head head]``),

    ||sum_h alpha_ij^h vt_j^h||^2 = sum_{h,g} alpha_ij^h G_j[h, g] alpha_ij^g

so the largest intermediate is pattern-sized.

Example (two heads that cancel for key 0 and add for key 1):
    >>> import torch
    >>> pattern = torch.tensor([[[[0.5, 0.5]], [[0.5, 0.5]]]])  # [batch head query key], one query
    >>> v = torch.tensor([[[[1.0], [-1.0]], [[1.0], [1.0]]]])  # [batch key kv_head d_head]
    >>> W_O = torch.ones(2, 1, 1)  # [head d_head d_model]
    >>> valid = torch.ones(1, 1, 2, dtype=torch.bool)
    >>> layer_norms(pattern, v, W_O, valid)[0, 0].tolist()
    [0.0, 1.0]
"""

import einops
import torch
from jaxtyping import Bool, Float
from torch import Tensor

from contribution_lens.adapter import LayerInputs
from contribution_lens.decomposition import projected_values
from contribution_lens.methods.method import Method, ScoreContext


def layer_norms(
    pattern: Float[Tensor, "batch head query key"],
    v: Float[Tensor, "batch key kv_head d_head"],
    W_O: Float[Tensor, "head d_head d_model"],
    valid: Bool[Tensor, "batch query key"],
) -> Float[Tensor, "batch query key"]:
    """``||sum_h alpha_ij^h vt_j^h||`` (see the module docstring), float32 at least, 0 where not ``valid``."""
    acc = torch.promote_types(pattern.dtype, torch.float32)
    alpha = torch.where(einops.rearrange(valid, "batch query key -> batch 1 query key"), pattern.to(acc), 0)
    vt = projected_values(v.to(acc), W_O.to(acc))
    gram = einops.einsum(vt, vt, "batch head key d_model, batch other key d_model -> batch key head other")
    mixed = einops.einsum(alpha, gram, "batch head query key, batch key head other -> batch other query key")
    squared = einops.reduce(mixed * alpha, "batch other query key -> batch query key", "sum")
    # Rounding can leave a tiny negative where the heads cancel exactly.
    return torch.where(valid, squared.clamp(min=0).sqrt(), 0)


def kobayashi_score(layer: LayerInputs, context: ScoreContext) -> Float[Tensor, "batch query key"]:
    """Registered ``kobayashi``: `layer_norms` of the layer (token level)."""
    return layer_norms(layer.pattern, layer.v, layer.W_O, layer.decompose(context.scope).valid)


METHODS: tuple[Method, ...] = (
    Method(
        "kobayashi",
        kobayashi_score,
        "||sum_h alpha f_h(x)||: Kobayashi et al.'s layer-level norm (token level; value_weighted is per head)",
        label="Kobayashi ‖Σ_h α vt‖",
        token_level=True,
        builtin=True,
    ),
)
