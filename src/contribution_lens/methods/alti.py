"""ALTI (Ferrando et al. 2022) as its authors define it, pre-LN and post-LN: ``alti`` and ``alti_rollout``.

Notation as in `contribution_lens.decomposition`: at layer ``l``, ``alpha_ij^h`` is the pattern,
``vt_j^h = v_j^h W_O^h`` the projected value (``hook_v``, which holds ``b_V``, times ``W_O``),
``x_i`` the residual stream entering the block (``hook_resid_pre``).

The residual sum of the attention block splits exactly into one vector per source token:

    T_i(x_j) = sum_h alpha_ij^h vt_j^h + [i == j] x_i,        s_i = sum_j T_i(x_j) + b_O

What ALTI compares with the block output ``y_i`` depends on the form of the block, read from the
model (`contribution_lens.adapter.block_forms`):

* **pre-LN** (Llama, SmolLM2: ``y = x + Attn(LN(x))``): the norm acts on ``x_j`` on the way to
  ``W_V`` and is already inside ``vt_j`` (its scale is taken as given with the input, as in the
  authors' ``pre_layer_norm`` branch), and nothing follows the sum: ``T'_i(x_j) = T_i(x_j)``,
  ``y_i = s_i`` (``hook_resid_mid``).
* **post-LN** (BERT, RoBERTa: ``y = LN(x + Attn(x))``): every vector goes through the linear part
  of that LayerNorm, ``L(t) = (t - mean(t)) * gamma`` (centring and ``gamma``), and the query's
  scale ``1 / sigma_i``, ``sigma_i = sqrt(var(s_i) + eps)``; ``beta`` and ``L(b_O) / sigma_i``
  belong to no token:

      T'_i(x_j) = L(T_i(x_j)) / sigma_i,        y_i = sum_j T'_i(x_j) + L(b_O) / sigma_i + beta = LN(s_i)

  (the authors' ``transformed_vectors_std`` and ``resultant``; their code takes ``sigma_i`` as
  the standard deviation of ``s_i + eps``, which is that of ``s_i``: the two differ by
  ``O(eps / var)``, 1e-12 in BERT).

Any other form (a norm on the attention output before the sum, as in Gemma; parallel attention
and MLP; RMSNorm after the sum) is refused, naming it. The contribution is the Manhattan
proximity, clipped at 0 and normalised over the keys (the authors' ``min_sum`` with the
resultant's norm):

    p_ij = max(0, ||y_i||_1 - ||y_i - T'_i(x_j)||_1),          c_ij = p_ij / sum_k p_ik

``alti`` scores are per layer and token level ``[batch query key]``; ``alti_rollout`` multiplies
them through the layers, ``R^l = C^l R^{l-1}`` (``R^0 = C^0``): the share of each *input* token.
Queries are processed in chunks so that ``[batch query key d_model]`` never exceeds
`ALTI_MAX_ELEMENTS` numbers.

How it relates to the norm measures: ``value_weighted``, ``alpha_ij^h ||vt_j^h||``, is
Kobayashi et al.'s per-head norm and ``kobayashi`` their layer-level ``||sum_h alpha_ij^h
vt_j^h||`` (`contribution_lens.methods.kobayashi`); ALTI goes one step further, adding the
residual ``x_i`` (and the norm after it) and comparing whole vectors with the block output.

Example (one head, two tokens, pre-LN):
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
from contribution_lens.methods.method import Method, ScoreContext, normalise_rows, prepared_score

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
    norm: adapter.Norm | None = None,
    max_elements: int = ALTI_MAX_ELEMENTS,
) -> Float[Tensor, "batch query key"]:
    """ALTI ``c_ij`` of one attention block (see the module docstring), rows summing to 1.

    ``norm``: the LayerNorm after the residual sum of a post-LN block (`adapter.post_norm`);
    None for the pre-LN form. Accumulates in float32 at least. Queries go in chunks so that the
    transformed vectors of a chunk, ``[batch chunk key d_model]``, hold at most ``max_elements``
    numbers.
    """
    acc = torch.promote_types(pattern.dtype, torch.float32)
    batch, _, n_query, n_key = pattern.shape
    alpha = torch.where(einops.rearrange(valid, "batch query key -> batch 1 query key"), pattern.to(acc), 0)
    vt = projected_values(v.to(acc), W_O.to(acc))
    x = resid_pre.to(acc)
    bias = None if b_O is None else b_O.to(acc)
    chunk = max(1, max_elements // max(1, batch * n_key * W_O.shape[-1]))
    out = torch.zeros(batch, n_query, n_key, dtype=acc, device=pattern.device)
    for start in range(0, n_query, chunk):
        stop = min(start + chunk, n_query)
        transformed, y = _transformed(alpha[:, :, start:stop], vt, x, bias, start, n_key - n_query, norm)
        out[:, start:stop] = manhattan_proximity(transformed, y)
    return normalise_rows(torch.where(valid, out, 0))


def manhattan_proximity(
    parts: Float[Tensor, "*rows part d_model"], total: Float[Tensor, "*rows d_model"]
) -> Float[Tensor, "*rows part"]:
    """ALTI's proximity of each part ``c`` to the sum ``y`` it is part of: ``max(0, ||y||_1 - ||y - c||_1)``.

    Unnormalised (ALTI and information flow routes divide by the sum over the parts).
    """
    distance = (total.unsqueeze(-2) - parts).abs().sum(-1)
    return (total.abs().sum(-1, keepdim=True) - distance).clamp(min=0)


def _transformed(
    alpha: Float[Tensor, "batch head query key"],
    vt: Float[Tensor, "batch head key d_model"],
    x: Float[Tensor, "batch query_all d_model"],
    b_O: Tensor | None,
    start: int,
    offset: int,
    norm: adapter.Norm | None,
) -> tuple[Float[Tensor, "batch query key d_model"], Float[Tensor, "batch query d_model"]]:
    """``T'_i(x_j)`` and ``y_i`` for the queries ``start .. start + chunk`` (``offset``: key index of query 0)."""
    transformed = einops.einsum(alpha, vt, "batch head query key, batch head key d_model -> batch query key d_model")
    queries = torch.arange(start, start + alpha.shape[2], device=alpha.device)
    # The residual x_i belongs to the query's own token: T_i(x_i) gains x_i.
    transformed[:, queries - start, queries + offset] += x[:, queries]
    summed = transformed.sum(2) + (0 if b_O is None else b_O)
    if norm is None:
        return transformed, summed
    # Post-LN: the linear part of the LayerNorm (centring, gamma) and the query's 1 / sigma_i.
    assert norm.eps is not None  # `adapter.post_norm` gives none without it
    sigma = (summed.var(-1, unbiased=False, keepdim=True) + norm.eps).sqrt()
    gamma = norm.gain
    centred = transformed - transformed.mean(-1, keepdim=True)
    transformed = (centred if gamma is None else centred * gamma.to(transformed.dtype)) / sigma[:, :, None]
    return transformed, adapter.apply_post_norm(norm, summed)


def block_norms(model: adapter.Model, layers: Sequence[int]) -> dict[int, adapter.Norm | None]:
    """Per layer, the LayerNorm ALTI maps each vector through (post-LN) or None (pre-LN).

    Refused, naming the form, where a layer's block is neither (`adapter.block_forms`).
    """
    forms = adapter.block_forms(model)
    other = {layer: forms[layer] for layer in layers if forms[layer] not in (adapter.PRE_LN, adapter.POST_LN)}
    if other:
        layer = min(other)
        raise ValueError(
            f"ALTI is not implemented for the attention block of layer {layer}: {other[layer]}; it is "
            f"implemented for {adapter.PRE_LN} blocks (y = x + Attn(LN(x))) and {adapter.POST_LN} blocks "
            "(y = LayerNorm(x + Attn(x)))"
        )
    return {layer: adapter.post_norm(model, layer) if forms[layer] == adapter.POST_LN else None for layer in layers}


def alti_layer(layer: adapter.LayerInputs, norm: adapter.Norm | None) -> Float[Tensor, "batch query key"]:
    """`alti_contributions` of one layer, reading ``hook_resid_pre``, in the form ``norm`` says."""
    valid = layer.decompose().valid
    x = layer.captured[adapter.RESID_PRE]
    return alti_contributions(layer.pattern, layer.v, layer.W_O, layer.b_O, x, valid, norm=norm)


def alti_score(layer: adapter.LayerInputs, context: ScoreContext) -> Float[Tensor, "batch query key"]:
    """Registered ``alti``: `alti_layer` in the form its ``prepare`` (`block_norms`) found.

    Without prepared state the form is read from ``context.model`` (the probe is cached per model).
    """
    if isinstance(context.prepared, dict) and layer.layer in context.prepared:
        return alti_layer(layer, context.prepared[layer.layer])
    if context.model is None:
        raise ValueError(
            f"ALTI needs the block form of layer {layer.layer}: pass ScoreContext(model=model) or run the "
            "method's prepare on this batch first"
        )
    return alti_layer(layer, block_norms(context.model, [layer.layer])[layer.layer])


def alti_rollout_scores(
    model: adapter.Model, batch: adapter.TokenBatch, layers: Sequence[int]
) -> dict[int, Float[Tensor, "batch query key"]]:
    """ALTI rolled out over layers ``0..l`` for every requested ``l``: ``R^l = C^l R^{l-1}``, ``R^0 = C^0``.

    ``R^l_ij`` is the share of input token ``j`` in the residual stream at position ``i`` after
    block ``l`` (the MLP acts on each position alone, so it mixes nothing). One forward pass runs
    ALTI on every layer up to the last requested one.
    """
    wanted = set(layers)
    norms = block_norms(model, range(max(layers) + 1))
    out: dict[int, Tensor] = {}
    rollout: list[Tensor] = []

    def step(layer: adapter.LayerInputs) -> None:
        contributions = alti_layer(layer, norms[layer.layer])
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
        "ALTI: Manhattan proximity of each token's transformed vector to the block output, pre-LN or "
        "post-LN as the model is (Ferrando et al.)",
        capture=(adapter.RESID_PRE,),
        prepare=lambda model, batch, layers: block_norms(model, layers),
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
