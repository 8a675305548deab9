"""ALTI (Ferrando et al. 2022) in its pre-LayerNorm decoder form: ``alti`` and ``alti_rollout``.

Notation as in `contribution_lens.decomposition`: at layer ``l``, ``alpha_ij^h`` is the pattern,
``vt_j^h = v_j^h W_O^h`` the projected value (``hook_v`` times ``W_O``), ``x_i`` the residual
stream entering the block (``hook_resid_pre``).

The attention block ``y_i = x_i + Attn(LN(x))_i`` splits exactly into one vector per source token:

    T_i(x_j) = sum_h alpha_ij^h vt_j^h + [i == j] x_i,        y_i = sum_j T_i(x_j) + b_O

(``y_i`` is ``hook_resid_mid``). The contribution is the Manhattan-distance proximity,
normalised over the keys:

    p_ij = max(0, ||y_i||_1 - ||y_i - T_i(x_j)||_1),          c_ij = p_ij / sum_k p_ik

In post-LN BERT the original ALTI maps each ``T_i(x_j)`` through the linear part of the LayerNorm
that follows the block. In a pre-LN decoder (Llama, SmolLM2) the norm comes *before* the
attention: it acts on ``x_j`` on the way to ``W_V`` and is already inside ``vt_j`` (its scale
``1 / rms(x_j)`` is taken as given with the input, as in the reference implementation's
``pre_layer_norm`` branch), and nothing follows the residual sum, so ``T_i(x_j)`` is used as it
is. For a post-LN encoder this form is the split of the sum *before* its LayerNorm. ``alti``
scores are per layer and token level ``[batch query key]``; ``alti_rollout`` multiplies them
through the layers, ``R^l = C^l R^{l-1}`` (``R^0 = C^0``): the share of each *input* token.
Queries are processed in chunks so that ``[batch query key d_model]`` never exceeds
`ALTI_MAX_ELEMENTS` numbers.

How it relates to the built-ins (`contribution_lens.methods.factors`): ``value_weighted``,
``alpha_ij^h ||vt_j^h||``, is the norm-based measure of Kobayashi et al. (2020); ALTI goes one
step further, adding the residual ``x_i`` and comparing whole vectors with the block output
rather than taking norms.

Example (one head, two tokens):
    >>> import torch
    >>> pattern = torch.tensor([[[[1.0, 0.0], [0.5, 0.5]]]])
    >>> v = torch.tensor([[[[1.0, 0.0]], [[0.0, 1.0]]]])  # [batch key kv_head d_head]
    >>> W_O = torch.eye(2)[None]  # [head d_head d_model]
    >>> resid_pre = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    >>> valid = torch.tensor([[[True, False], [True, True]]])
    >>> alti_contributions(pattern, v, W_O, None, resid_pre, valid)[0, 1].tolist()
    [0.25, 0.75]
"""

from collections.abc import Sequence

import einops
import torch
from jaxtyping import Bool, Float
from torch import Tensor

from contribution_lens import adapter
from contribution_lens.decomposition import projected_values
from contribution_lens.engine import map_layers
from contribution_lens.methods.registry import Method, ScoreContext, normalise_rows, prepared_score

ALTI_MAX_ELEMENTS = 2**24
"""Largest ``[batch query key d_model]`` block ALTI builds (chunks of queries stay under it)."""


def alti_contributions(
    pattern: Float[Tensor, "batch head query key"],
    v: Float[Tensor, "batch key kv_head d_head"],
    W_O: Float[Tensor, "head d_head d_model"],
    b_O: Float[Tensor, " d_model"] | None,
    resid_pre: Float[Tensor, "batch query d_model"],
    valid: Bool[Tensor, "batch query key"],
    *,
    max_elements: int = ALTI_MAX_ELEMENTS,
) -> Float[Tensor, "batch query key"]:
    """ALTI ``c_ij`` of one pre-LN attention block (see the module docstring), rows summing to 1.

    Accumulates in float32 at least. Queries go in chunks so that the transformed vectors
    ``T_i(x_j)`` of a chunk, ``[batch chunk key d_model]``, hold at most ``max_elements`` numbers.
    """
    acc = torch.promote_types(pattern.dtype, torch.float32)
    batch, _, n_query, n_key = pattern.shape
    alpha = torch.where(einops.rearrange(valid, "batch query key -> batch 1 query key"), pattern.to(acc), 0)
    vt = projected_values(v.to(acc), W_O.to(acc))
    x = resid_pre.to(acc)
    chunk = max(1, max_elements // max(1, batch * n_key * W_O.shape[-1]))
    out = torch.zeros(batch, n_query, n_key, dtype=acc, device=pattern.device)
    for start in range(0, n_query, chunk):
        stop = min(start + chunk, n_query)
        out[:, start:stop] = _alti_chunk(alpha[:, :, start:stop], vt, x, b_O, start, n_key - n_query)
    return normalise_rows(torch.where(valid, out, 0))


def _alti_chunk(
    alpha: Float[Tensor, "batch head query key"],
    vt: Float[Tensor, "batch head key d_model"],
    x: Float[Tensor, "batch query_all d_model"],
    b_O: Tensor | None,
    start: int,
    offset: int,
) -> Float[Tensor, "batch query key"]:
    """Proximities ``p_ij`` for the queries ``start .. start + chunk`` (``offset``: key index of query 0)."""
    transformed = einops.einsum(alpha, vt, "batch head query key, batch head key d_model -> batch query key d_model")
    queries = torch.arange(start, start + alpha.shape[2], device=alpha.device)
    # The residual x_i belongs to the query's own token: T_i(x_i) gains x_i.
    transformed[:, queries - start, queries + offset] += x[:, queries]
    y = transformed.sum(2) + (0 if b_O is None else b_O.to(transformed.dtype))
    distance = (y[:, :, None] - transformed).abs().sum(-1)
    return (y.abs().sum(-1, keepdim=True) - distance).clamp(min=0)


def alti_score(layer: adapter.LayerInputs, context: ScoreContext) -> Float[Tensor, "batch query key"]:
    """Registered ``alti``: `alti_contributions` of the layer, reading ``hook_resid_pre``."""
    valid = layer.decompose(context.scope).valid
    return alti_contributions(layer.pattern, layer.v, layer.W_O, layer.b_O, layer.captured[adapter.RESID_PRE], valid)


def alti_rollout_scores(
    model: adapter.Model, batch: adapter.TokenBatch, layers: Sequence[int]
) -> dict[int, Float[Tensor, "batch query key"]]:
    """ALTI rolled out over layers ``0..l`` for every requested ``l``: ``R^l = C^l R^{l-1}``, ``R^0 = C^0``.

    ``R^l_ij`` is the share of input token ``j`` in the residual stream at position ``i`` after
    block ``l`` (the MLP acts on each position alone, so it mixes nothing). One forward pass runs
    ALTI on every layer up to the last requested one.
    """
    wanted = set(layers)
    out: dict[int, Tensor] = {}
    rollout: list[Tensor] = []

    def step(layer: adapter.LayerInputs) -> None:
        contributions = alti_score(layer, ScoreContext())
        if rollout:
            contributions = einops.einsum(
                contributions, rollout.pop(), "batch query mid, batch mid key -> batch query key"
            )
        rollout.append(contributions)
        if layer.layer in wanted:
            out[layer.layer] = contributions

    map_layers(model, batch, step, layers=list(range(max(layers) + 1)), capture=(adapter.RESID_PRE,))
    return out


METHODS: tuple[Method, ...] = (
    Method(
        "alti",
        alti_score,
        "ALTI: Manhattan proximity of each token's transformed vector to the block output (Ferrando et al.)",
        capture=(adapter.RESID_PRE,),
        token_level=True,
        builtin=True,
    ),
    Method(
        "alti_rollout",
        prepared_score,
        "ALTI rolled out from the input tokens through every layer up to this one (Ferrando et al.)",
        prepare=alti_rollout_scores,
        token_level=True,
        builtin=True,
    ),
)
