"""Attention sinks: sink vs tail decomposition, anti-alignment, the convex sink-ratio curve.

For one head and query ``i``, with the first ``k`` positions as the sink (``k = 1``: BOS; where
a text has no BOS, or for an encoder, the sink keys `detect_sinks` finds instead):

* sink ratio ``a_i = sum_{j<k} alpha_ij``; sink part ``s_i = sum_{j<k} alpha_ij vt_j``; tail
  output ``t_i = sum_{j>=k} alpha_ij vt_j``, so ``o_i = s_i + t_i``;
* unit-mass directions ``S = s_i / a_i`` (``= vt_0`` for ``k = 1``) and ``U = t_i / (1 - a_i)``;
* keeping the tail proportions fixed, ``o(beta) = beta S + (1 - beta) U`` and ``o(a_i) = o_i``;
  ``||o(beta)||^2 = beta^2 A + 2 beta (1 - beta) C + (1 - beta)^2 B`` with ``A = ||S||^2``,
  ``B = ||U||^2``, ``C = <S, U>``, minimised at ``beta* = (B - C) / (A + B - 2C)``, which lies
  strictly inside (0, 1) exactly when ``C < min(A, B)``: then a mixture is shorter than either end,
  i.e. the sink's value partly cancels the tail.

Every inner product is taken through ``d_head`` with the Gram matrix ``W_O^h W_O^h^T``.
"""

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import einops
import numpy as np
import pandas as pd
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor
from tqdm.auto import tqdm

from contribution_lens import adapter
from contribution_lens.choices import as_index
from contribution_lens.decomposition import Decomposition, Factor, Scope, head_gram, is_causal
from contribution_lens.engine import LayerResults, map_layers

if TYPE_CHECKING:
    import plotly.graph_objects as go

PARTS = ("sink", "tail")


@dataclass(frozen=True)
class SinkLayer:
    """Per-query sink geometry of one layer (intra-head), ``[batch head query]`` unless noted."""

    sink_ratio: Float[Tensor, "batch head query"]
    output_norm: Float[Tensor, "batch head query"]
    sink_sq: Float[Tensor, "batch head query"]
    """``A = ||S||^2``."""
    tail_sq: Float[Tensor, "batch head query"]
    """``B = ||U||^2``."""
    cross: Float[Tensor, "batch head query"]
    """``C = <S, U>``."""
    sink_tail_cosine: Float[Tensor, "batch head query"]
    """``cos(s_i, t_i)``: anti-alignment of the sink's value with the tail output."""
    sink_token_cosine: Float[Tensor, "batch head key"]
    """``cos(vt_sink, vt_j)`` for every key (the sink value: mean of the first k values)."""
    cone_cosine: Float[Tensor, "batch head query"]
    """``cos(o_i, mean_i U_i/||U_i||)``: how far each output lies inside the semantic cone."""
    queries: Bool[Tensor, "batch query"]
    """Real queries that see at least one tail key (``i >= k``)."""
    keys: Bool[Tensor, "batch key"]
    """Real tail (semantic) keys."""
    sinks: Bool[Tensor, "batch key"]
    """The sink keys."""
    factors: dict[Scope, dict[str, Float[Tensor, " head"]]] = field(default_factory=dict)
    """Sink vs tail factors per scope (see `part_factors`); empty where `sink_analysis` did not ask."""

    @property
    def beta_star(self) -> Float[Tensor, "batch head query"]:
        """The exact minimiser of ``||o(beta)||``, clipped to [0, 1]."""
        return unclipped_beta_star(self).clamp(0, 1)

    @property
    def interior_minimum(self) -> Bool[Tensor, "batch head query"]:
        """Whether ``||o(beta)||`` has its minimum strictly inside (0, 1)."""
        return (self.cross < self.sink_sq) & (self.cross < self.tail_sq)

    def curve(self, betas: Tensor) -> Float[Tensor, "beta batch head query"]:
        """``||o(beta)||`` on a grid of ``beta``."""
        # The grid comes from the caller (a plot builds it on the CPU); the terms may sit on a GPU.
        b = einops.rearrange(betas.to(self.sink_sq), "beta -> beta 1 1 1")
        sq = b**2 * self.sink_sq + 2 * b * (1 - b) * self.cross + (1 - b) ** 2 * self.tail_sq
        return sq.clamp_min(0).sqrt()


def unclipped_beta_star(layer: SinkLayer) -> Tensor:
    denominator = layer.sink_sq + layer.tail_sq - 2 * layer.cross  # ||S - U||^2 >= 0
    numerator = layer.tail_sq - layer.cross
    safe = denominator > 0
    return torch.where(safe, numerator / torch.where(safe, denominator, 1), 0)


def sink_mask(
    sinks: Sequence[int] | Tensor | None,
    k: int,
    batch: int,
    n_key: int,
    device: torch.device,
) -> Bool[Tensor, "batch key"]:
    """Which keys are the sink: given positions, a ``[batch key]`` mask, or the first ``k``."""
    if sinks is None:
        if not 1 <= k < n_key:
            raise ValueError(f"the sink needs 1 <= k < sequence length ({n_key}), got k={k}")
        mask = torch.zeros(batch, n_key, dtype=torch.bool, device=device)
        mask[:, :k] = True
        return mask
    if isinstance(sinks, Tensor) and sinks.dtype == torch.bool:
        if tuple(sinks.shape) != (batch, n_key):
            raise ValueError(f"a sink mask must be [batch key] = {(batch, n_key)}, got {tuple(sinks.shape)}")
        return sinks.to(device)
    listed = [sinks] if isinstance(sinks, int) or getattr(sinks, "ndim", 1) == 0 else list(sinks)
    positions = [as_index(p, "sink positions must be integers") for p in listed]
    if not positions:
        raise ValueError("sinks is empty: give at least one sink position")
    bad = [p for p in positions if not -n_key <= p < n_key]
    if bad:
        raise ValueError(f"sink position {bad[0]} is outside the sequence of {n_key} tokens")
    mask = torch.zeros(batch, n_key, dtype=torch.bool, device=device)
    mask[:, [p % n_key for p in positions]] = True
    if bool(mask.all()):
        raise ValueError("every position is a sink: nothing is left for the tail")
    return mask


def sink_shares(
    pattern: Float[Tensor, "batch head query key"], *, attention_mask: Bool[Tensor, "batch key"] | None = None
) -> Float[Tensor, "batch key"]:
    """Each key's attention share (Gu et al., 2024): its attention averaged over heads and over the
    real queries that can see it (for a causal pattern, the queries at or after it); 0 at padding.

    0 also for a key that no real query other than its own attends to: under causal attention the
    last token is seen by itself alone, and its "share" is its own query's self-attention, which can
    be the largest on a text without BOS; nothing could sink attention into it (a text of one token
    keeps its share).
    """
    batch, _, n_query, n_key = pattern.shape
    real = (
        torch.ones(batch, n_key, dtype=torch.bool, device=pattern.device)
        if attention_mask is None
        else attention_mask.to(pattern.device, torch.bool)
    )
    alpha = torch.where(real[:, None, None, :] & real[:, None, -n_query:, None], pattern.float(), 0)
    received = einops.reduce(alpha, "batch head query key -> batch key", "mean") * n_query
    seen_by = einops.reduce((alpha > 0).float(), "batch head query key -> batch key", "max")
    viewers = einops.reduce((alpha > 0).float(), "batch head query key -> batch head key", "sum").amax(1).clamp_min(1)
    # The key's own query is the diagonal (queries are the last n_query positions).
    positions = torch.arange(n_key, device=pattern.device)
    own = positions[None, :] == positions[n_key - n_query :, None]
    others = einops.reduce(((alpha > 0) & ~own).float(), "batch head query key -> batch key", "max") > 0
    others = others | ~others.any(-1, keepdim=True)
    return torch.where((seen_by > 0) & real & others, received / viewers, 0)


def detect_sinks(
    pattern: Float[Tensor, "batch head query key"],
    *,
    epsilon: float = 0.3,
    attention_mask: Bool[Tensor, "batch key"] | None = None,
) -> Bool[Tensor, "batch key"]:
    """Sink keys by the attention-share threshold of Gu et al. (2024): mean share ``> epsilon``.

    A key's share is `sink_shares`: its attention averaged over heads and over the real queries
    that can see it (0 for a key no query but its own sees). Where no key passes the threshold the
    key of largest share is the sink, so every text has one.
    """
    if not 0 < epsilon < 1:
        raise ValueError(f"epsilon must lie in (0, 1), got {epsilon}")
    share = sink_shares(pattern, attention_mask=attention_mask)
    sinks = share > epsilon
    fallback = torch.zeros_like(sinks)
    fallback[torch.arange(pattern.shape[0]), share.argmax(-1)] = True
    return torch.where(sinks.any(-1, keepdim=True), sinks, fallback)


def sink_layer(
    pattern: Float[Tensor, "batch head query key"],
    v: Float[Tensor, "batch key kv_head d_head"],
    W_O: Float[Tensor, "head d_head d_model"],
    *,
    k: int = 1,
    sinks: Sequence[int] | Tensor | None = None,
    attention_mask: Bool[Tensor, "batch key"] | None = None,
    causal: bool | None = None,
    gram: Float[Tensor, "head d_head e_head"] | None = None,
) -> SinkLayer:
    """Sink geometry of one layer from its pattern, values and ``W_O`` (see the module doc).

    The sink is ``sinks`` (positions, or a ``[batch key]`` mask) or else the first ``k`` positions.
    ``causal``: whether the pattern is causal (None: read from the pattern, one pass over it).
    ``gram``: ``head_gram`` of ``W_O`` in float32 where the caller has it (`LayerInputs.gram`).
    """
    batch, n_heads, n_query, n_key = pattern.shape
    if n_query != n_key:
        raise ValueError("sink analysis needs the full square pattern")
    is_sink = sink_mask(sinks, k, batch, n_key, pattern.device)
    real = (
        torch.ones(batch, n_key, dtype=torch.bool, device=pattern.device)
        if attention_mask is None
        else attention_mask.to(pattern.device, torch.bool)
    )
    is_sink = is_sink & real
    valid = einops.rearrange(real, "batch key -> batch 1 1 key") & einops.rearrange(
        real, "batch query -> batch 1 query 1"
    )
    # Padding may hold anything (NaN too): zeroed where there is some, else the pattern is used as it is.
    alpha = pattern.float() if attention_mask is None else torch.where(valid, pattern.float(), 0)
    group = n_heads // v.shape[2]
    values = torch.where(einops.rearrange(real, "batch key -> batch key 1 1"), v.float(), 0)
    values = einops.repeat(values, "batch key kv_head d_head -> batch (kv_head group) key d_head", group=group)
    gram = head_gram(W_O.float()) if gram is None else gram.float()

    sink_ratio, z_sink, z_tail = _sink_and_tail_outputs(alpha, values, is_sink)
    z_out = z_sink + z_tail
    sink_mean, tail_mean = _unit_mass_directions(alpha, is_sink, sink_ratio, z_sink, z_tail)
    # x G once per vector x, each then read by every <x, y>_G it enters: the same products, in the
    # same order, as the three-operand einsum (which contracts x with G first), without repeating them.
    sink_g, tail_g, out_g, z_sink_g, z_tail_g = (
        einops.einsum(x, gram, "b h q d, h d e -> b h q e") for x in (sink_mean, tail_mean, z_out, z_sink, z_tail)
    )
    dot = "b h q e, b h q e -> b h q"
    sink_sq = einops.einsum(sink_g, sink_mean, dot)
    tail_sq = einops.einsum(tail_g, tail_mean, dot)
    cross = einops.einsum(sink_g, tail_mean, dot)
    out_sq = einops.einsum(out_g, z_out, dot).clamp_min(0)

    s_t = einops.einsum(z_sink_g, z_tail, dot)
    sink_tail_cosine = _cosine(s_t, einops.einsum(z_sink_g, z_sink, dot), einops.einsum(z_tail_g, z_tail, dot))
    sink_token_cosine = _sink_token_cosine(values, gram, is_sink)
    keys = real & ~is_sink
    causal = is_causal(pattern) if causal is None else causal
    queries = _sink_and_tail_queries(valid[:, 0], real, is_sink, keys, causal)
    cone_cosine = _cone_cosine(tail_mean, tail_sq, z_out, out_sq, gram, queries)

    if sinks is not None and not isinstance(sinks, Tensor) and not bool(queries.any()):
        raise ValueError(
            f"no real query sees both a sink key (sinks={sinks!r}) and a tail key: every statistic "
            "would be empty (under causal attention only later tokens see a sink: choose earlier positions)"
        )
    q_mask = einops.rearrange(queries, "b q -> b 1 q")
    zero = torch.zeros((), device=pattern.device)
    return SinkLayer(
        sink_ratio=torch.where(q_mask, sink_ratio, zero),
        output_norm=torch.where(q_mask, out_sq.sqrt(), zero),
        sink_sq=torch.where(q_mask, sink_sq, zero),
        tail_sq=torch.where(q_mask, tail_sq, zero),
        cross=torch.where(q_mask, cross, zero),
        sink_tail_cosine=torch.where(q_mask, sink_tail_cosine, zero),
        sink_token_cosine=torch.where(einops.rearrange(keys, "b k -> b 1 k"), sink_token_cosine, zero),
        cone_cosine=torch.where(q_mask, cone_cosine, zero),
        queries=queries,
        keys=keys,
        sinks=is_sink,
    )


def _sink_and_tail_outputs(
    alpha: Float[Tensor, "b h q k"], values: Float[Tensor, "b h k d"], is_sink: Bool[Tensor, "b k"]
) -> tuple[Float[Tensor, "b h q"], Float[Tensor, "b h q d"], Float[Tensor, "b h q d"]]:
    """``a_i = sum_{j in sink} alpha_ij``, ``z_sink = sum_{j in sink} alpha_ij v_j`` and ``z_tail`` (the other keys).

    The pattern times the values of the part's keys alone: the sink's from its few columns, the
    tail's from masked values; the pattern is never copied.
    """
    sink_keys = is_sink.to(values.dtype)
    columns = is_sink.any(0).nonzero().squeeze(1)
    alpha_sink = alpha.index_select(3, columns) * sink_keys[:, None, None, columns]
    z_sink = einops.einsum(alpha_sink, values.index_select(2, columns), "b h q k, b h k d -> b h q d")
    z_tail = einops.einsum(alpha, values * (1 - sink_keys[:, None, :, None]), "b h q k, b h k d -> b h q d")
    return alpha_sink.sum(-1), z_sink, z_tail


def _unit_mass_directions(
    alpha: Tensor, is_sink: Tensor, sink_ratio: Tensor, z_sink: Tensor, z_tail: Tensor
) -> tuple[Float[Tensor, "b h q d"], Float[Tensor, "b h q d"]]:
    """``S = s_i / a_i`` and ``U = t_i / (tail mass)``, 0 where a part has no mass.

    The tail's own mass, not ``1 - a_i``: where ``a_i`` rounds to 1 in float32, ``1 - a_i`` is 0 while
    the tail still holds (tiny) attention, and ``t_i / 1e-30`` overflowed ``||U||^2`` to NaN.
    """
    tail_ratio = einops.einsum(alpha, (~is_sink).to(alpha.dtype), "b h q k, b k -> b h q")
    sink_mean = z_sink / sink_ratio.clamp_min(1e-30)[..., None]
    tail_mean = torch.where(tail_ratio[..., None] > 0, z_tail / tail_ratio.clamp_min(1e-38)[..., None], 0)
    return sink_mean, tail_mean


def _cosine(dot: Tensor, sq_x: Tensor, sq_y: Tensor) -> Tensor:
    """``dot / sqrt(sq_x sq_y)`` in [-1, 1], 0 where a norm is 0."""
    norms = (sq_x.clamp_min(0) * sq_y.clamp_min(0)).sqrt()
    return torch.where(norms > 0, dot / norms.clamp_min(1e-30), 0).clamp(-1, 1)


def _sink_token_cosine(
    values: Float[Tensor, "b h k d"], gram: Float[Tensor, "h d e"], is_sink: Bool[Tensor, "b k"]
) -> Float[Tensor, "b h k"]:
    """``cos(vt_sink, vt_j)`` for every key, the sink value being the mean of the sink keys' values."""
    sink_weight = einops.rearrange(is_sink.float(), "b k -> b 1 k 1")
    sink_value = (values * sink_weight).sum(2) / sink_weight.sum(2).clamp_min(1)  # [b h d]
    token_dot = einops.einsum(sink_value, gram, values, "b h d, h d e, b h k e -> b h k")
    token_sq = einops.einsum(values, gram, values, "b h k d, h d e, b h k e -> b h k")
    sink_value_sq = einops.einsum(sink_value, gram, sink_value, "b h d, h d e, b h e -> b h")
    return _cosine(token_dot, sink_value_sq[..., None], token_sq)


def _sink_and_tail_queries(
    visible: Bool[Tensor, "b q k"], real: Tensor, is_sink: Tensor, keys: Tensor, causal: bool
) -> Bool[Tensor, "b q"]:
    """Real non-sink queries that see at least one sink key and one tail key (causally, if ``causal``)."""
    n_query, n_key = visible.shape[-2:]
    if causal:
        visible = visible & torch.ones(n_query, n_key, dtype=torch.bool, device=visible.device).tril()
    return real & ~is_sink & (visible & is_sink[:, None, :]).any(-1) & (visible & keys[:, None, :]).any(-1)


def _cone_cosine(
    tail_mean: Tensor, tail_sq: Tensor, z_out: Tensor, out_sq: Tensor, gram: Tensor, queries: Tensor
) -> Float[Tensor, "b h q"]:
    """``cos(o_i, axis)``, the axis being the mean unit tail direction over the real queries (d_head coordinates)."""
    unit_tail = tail_mean / tail_sq.clamp_min(1e-30).sqrt()[..., None]
    q_weight = einops.rearrange(queries.float(), "b q -> b 1 q 1")
    axis = (unit_tail * q_weight).sum(2) / q_weight.sum(2).clamp_min(1)  # [b h d]
    axis_sq = einops.einsum(axis, gram, axis, "b h d, h d e, b h e -> b h")
    cone_dot = einops.einsum(z_out, gram, axis, "b h q d, h d e, b h e -> b h q")
    return _cosine(cone_dot, out_sq, einops.repeat(axis_sq, "b h -> b h q", q=z_out.shape[2]))


def part_factors(
    d: Decomposition,
    is_sink: Bool[Tensor, "batch key"],
    queries: Bool[Tensor, "batch query"],
    pairs: "TailPairs | None" = None,
    quantiles: dict[str, Float[Tensor, " head"]] | None = None,
) -> dict[str, Float[Tensor, " head"]]:
    """Sink vs tail factors per head, each a mean over the sink layer's ``queries``.

    For a part ``P`` (the sink keys, or the others) and query ``i``: attention ``sum_{j in P} alpha_ij``
    and contribution ``sum_{j in P} c_ij`` are summed over the part's keys; relative norm and cosine
    are their attention-weighted means ``sum_{j in P} alpha_ij x_ij / sum_{j in P} alpha_ij``. Since
    ``c_ij = alpha_ij cos_ij ||vt_j|| / ||o_i||`` and ``relative_norm_ij = ||vt_j|| / ||o_i||``, every
    sum is a product of a pattern-sized tensor (``alpha`` or ``alpha cos``) with per-key weights: one
    batched matrix product, no masked copy. Keys ``sink_*`` and ``tail_*``, plus
    ``tail_cosine_q10/q50/q90`` and ``tail_relative_norm_q10/q50/q90``: the distribution over
    (query, tail key) pairs with ``alpha > 0``, as ``torch.quantile`` gives it (`tail_quantiles`;
    ``pairs``: those pairs where the caller has them already, `TailPairs.of`; ``quantiles``: the
    quantiles themselves, where `tail_quantiles` found them for several decompositions at once;
    ``{}`` leaves them out).

    Example:
        >>> import torch
        >>> from contribution_lens.decomposition import decompose
        >>> pattern = torch.tensor([[[[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.5, 0.25, 0.25]]]])
        >>> v = torch.tensor([[[[1.0, 0.0]], [[0.0, 1.0]], [[0.0, 2.0]]]])
        >>> d = decompose(pattern, v, torch.eye(2)[None], scope="intra")
        >>> sink = torch.tensor([[True, False, False]])
        >>> f = part_factors(d, sink, torch.tensor([[False, True, True]]))
        >>> round(f["sink_attention"].item(), 3), round((f["sink_contribution"] + f["tail_contribution"]).item(), 3)
        (0.5, 1.0)
    """
    if quantiles is None:
        quantiles = tail_quantiles([d], pairs or TailPairs.of(d.attention, d.valid, is_sink, queries))[0]
    return _factor_means([d], is_sink, queries)[0] | quantiles


def _factor_means(
    decompositions: Sequence[Decomposition], is_sink: Bool[Tensor, "batch key"], queries: Bool[Tensor, "batch query"]
) -> list[dict[str, Float[Tensor, " head"]]]:
    """`part_factors` without the quantiles, for decompositions of one layer (its scopes).

    The attention sums read only ``alpha`` and ``||vt_j||``, which every scope of a layer shares:
    where they are the same tensors they are summed once.
    """
    first = decompositions[0]
    alpha = first.attention
    q_weight = einops.rearrange(queries.to(alpha.dtype), "b q -> b 1 q")
    n_queries = q_weight.sum((0, 2)).clamp_min(1)
    sink_keys = is_sink.to(alpha.dtype)
    key_weights = None
    out = []
    for d in decompositions:
        if key_weights is None or d.attention is not alpha or not torch.equal(d.value_norm, first.value_norm):
            key_weights = _key_weights(d, sink_keys)
            with_attention = einops.einsum(d.attention, key_weights, "b h q k, b h k part -> b h q part")
        with_cosine = _weighted_cosine_sums(d.attention, d.cosine, key_weights)
        inverse_norm = torch.where(d.output_norm != 0, 1 / torch.where(d.output_norm != 0, d.output_norm, 1), 0)
        means: dict[str, Tensor] = {}
        for index, part in enumerate(PARTS):
            mass = with_attention[..., index]
            per_query = {
                Factor.ATTENTION: mass,
                Factor.RELATIVE_NORM: with_attention[..., 2 + index] * inverse_norm / mass.clamp_min(1e-30),
                Factor.COSINE: with_cosine[..., index] / mass.clamp_min(1e-30),
                Factor.CONTRIBUTION: with_cosine[..., 2 + index] * inverse_norm,
            }
            for factor in Factor:
                means[f"{part}_{factor}"] = (per_query[factor] * q_weight).sum((0, 2)) / n_queries
        out.append(means)
    return out


QUERY_BLOCK_BYTES = 1 << 20
"""How much of ``alpha cos`` `_weighted_cosine_sums` builds at once: a block that stays in the cache."""


def _weighted_cosine_sums(
    alpha: Float[Tensor, "b h q k"], cosine: Float[Tensor, "b h q k"], key_weights: Float[Tensor, "b h k part"]
) -> Float[Tensor, "b h q part"]:
    """``sum_j alpha_ij cos_ij w_jp``, a block of queries at a time.

    The product ``alpha cos`` is pattern-sized: built whole, it is a fresh allocation (a first
    touch of every page) read back from memory; built a block of queries at a time into one
    buffer, it stays in the cache. Each query's sum is the same matrix product either way.
    """
    batch, heads, n_query, n_key = alpha.shape
    rows = max(1, QUERY_BLOCK_BYTES // max(1, batch * heads * n_key * alpha.element_size()))
    out = alpha.new_empty(batch, heads, n_query, key_weights.shape[-1])
    buffer = alpha.new_empty(batch, heads, min(rows, n_query), n_key)
    for start in range(0, n_query, rows):
        block = slice(start, start + rows)
        product = torch.mul(alpha[:, :, block], cosine[:, :, block], out=buffer[:, :, : out[:, :, block].shape[2]])
        torch.matmul(product, key_weights, out=out[:, :, block])
    return out


def _key_weights(d: Decomposition, sink_keys: Float[Tensor, "batch key"]) -> Float[Tensor, "batch head key part"]:
    """Per-key weights of the parts: 1 on the sink's keys, 1 on the others, then ``||vt_j||`` on each."""
    n_heads = d.attention.shape[1]
    value_norm = d.value_norm.to(d.attention.dtype)
    return torch.stack(
        [
            einops.repeat(sink_keys, "b k -> b h k", h=n_heads),
            einops.repeat(1 - sink_keys, "b k -> b h k", h=n_heads),
            value_norm * sink_keys[:, None],
            value_norm * (1 - sink_keys[:, None]),
        ],
        dim=-1,
    )


QUANTILES = (10, 50, 90)
"""The percentiles of the tail's cosine and relative norm that `part_factors` reports."""


@dataclass(frozen=True)
class TailPairs:
    """The (query, tail key) pairs of one layer whose cosine and relative norm `tail_quantiles` describes.

    A pair is a query in ``queries`` and a key it sees that is not a sink, in any text of the
    batch; ``keep`` (``[head pair]``, None when every pair is kept) leaves out the pairs a head
    gives no attention. The same for both scopes: built once per layer.
    """

    at: Int[Tensor, " pair"]
    """Flat ``(b q k)`` index of each pair."""
    key: Int[Tensor, " pair"]
    """Flat ``(b k)`` index of its key."""
    query: Int[Tensor, " pair"]
    """Flat ``(b q)`` index of its query."""
    keep: Bool[Tensor, "head pair"] | None

    @classmethod
    def of(
        cls,
        attention: Float[Tensor, "batch head query key"],
        valid: Bool[Tensor, "batch query key"],
        is_sink: Bool[Tensor, "batch key"],
        queries: Bool[Tensor, "batch query"],
    ) -> "TailPairs":
        pairs = valid & (~is_sink)[:, None, :] & queries[:, :, None]
        b, q, k = pairs.nonzero(as_tuple=True)
        n_query, n_key = pairs.shape[1:]
        at = (b * n_query + q) * n_key + k
        attended = einops.rearrange(attention, "b h q k -> h (b q k)").index_select(1, at) > 0
        return cls(at, b * n_key + k, b * n_query + q, None if bool(attended.all()) else attended)

    def gather(self, tensor: Float[Tensor, "batch head query key"]) -> Float[Tensor, "head pair"]:
        return einops.rearrange(tensor, "b h q k -> h (b q k)").index_select(1, self.at)


def tail_quantiles(
    decompositions: Sequence[Decomposition], pairs: TailPairs
) -> list[dict[str, Float[Tensor, " head"]]]:
    """Per decomposition and head, `QUANTILES` of ``cos_ij`` and of ``||vt_j|| / ||o_i||`` over the tail ``pairs``.

    The relative norm is gathered from its two factors, never built pattern-sized; it is bit for
    bit what ``Decomposition.relative_norm`` holds at those pairs. Each factor of each decomposition
    is one `masked_quantiles` call on its ``[head pair]`` rows, gathered into one reused buffer: the
    quantiles are exact whatever the rows a call holds, and a call whose rows fit in the cache is
    faster than one over every factor at once (1.6x on SmolLM2 at 512 tokens, one thread).
    """
    n_heads, n_pairs = decompositions[0].cosine.shape[1], pairs.at.numel()
    rows = decompositions[0].cosine.new_empty(n_heads, n_pairs)
    fractions = [p / 100 for p in QUANTILES]
    out: list[dict[str, Tensor]] = []
    for d in decompositions:
        found = {}
        torch.index_select(einops.rearrange(d.cosine, "b h q k -> h (b q k)"), 1, pairs.at, out=rows)
        found["cosine"] = masked_quantiles(rows, pairs.keep, fractions)
        torch.index_select(einops.rearrange(d.value_norm, "b h k -> h (b k)"), 1, pairs.key, out=rows)
        output_norm = einops.rearrange(d.output_norm, "b h q -> h (b q)")
        if bool((output_norm != 0).all()):
            rows.div_(output_norm.index_select(1, pairs.query))
        else:  # Decomposition.relative_norm's 0 where ||o|| = 0
            gathered = output_norm.index_select(1, pairs.query)
            rows.copy_(torch.where(gathered != 0, rows / gathered.where(gathered != 0, 1), 0))
        found["relative_norm"] = masked_quantiles(rows, pairs.keep, fractions)
        out.append(
            {
                f"tail_{name}_q{p}": quantiles[index]
                for name, quantiles in found.items()
                for index, p in enumerate(QUANTILES)
            }
        )
    return out


def _bin_bits(items: int) -> int:
    """``b`` with about 8 values a bin in ``2**b`` bins (at least ``2**12``, at most ``2**18``)."""
    return min(18, max(12, math.ceil(math.log2(max(items, 1) / 8))))


def masked_quantiles(
    values: Float[Tensor, "row item"], keep: Bool[Tensor, "row item"] | None, fractions: Sequence[float]
) -> Float[Tensor, "fraction row"]:
    """``torch.quantile(values[r][keep[r]], f)`` (linear interpolation) for every row and fraction, exactly.

    With ``n`` kept values ``x_(0) <= ... <= x_(n-1)`` in a row and ``r = f (n - 1)``, the quantile
    is ``x_(floor r) + (r - floor r) (x_(ceil r) - x_(floor r))``, computed as ``torch.quantile``
    computes it (``r`` in the values' dtype, ``torch.lerp``), so the result is the same to the bit.
    Only the order statistics at ``floor r`` and ``ceil r`` are found, without sorting a row: each
    value gets a bin that never decreases with the value (the bits of ``x - min``, a non-negative
    float, read as an integer and shifted into about ``items / 8`` bins), the
    cumulative counts of the bins give the bin and the rank inside it of each order statistic, and
    only the values in those few bins are sorted. A row with nothing kept gives 0. Values must be
    finite.

    Example:
        >>> import torch
        >>> values = torch.tensor([[3.0, 1.0, 2.0, 10.0], [4.0, -1.0, 0.5, 0.0]])
        >>> found = masked_quantiles(values, torch.tensor([[True, True, True, False], [True] * 4]), [0.5, 0.9])
        >>> [[round(x, 4) for x in row] for row in found.tolist()]  # rows: fractions; columns: rows of values
        [[2.0, 0.25], [2.8, 2.95]]
    """
    n_rows, bin_bits = values.shape[0], _bin_bits(values.shape[1])
    bins = 1 << bin_bits
    values = values if values.dtype == torch.float64 else values.to(torch.float32)
    integer = torch.int64 if values.dtype == torch.float64 else torch.int32
    low = (values if keep is None else torch.where(keep, values, torch.inf)).amin(1, keepdim=True)
    # x - min is a non-negative float (or inf): its bits, read as an integer, grow with it. Below
    # 2**-24 of the widest row's span all is one bin (else most bins would go to exponents no
    # value has); then one right shift for every row brings the widest to at most `_bin_bits` bins:
    # log-spaced, so a heavy tail does not crowd the bulk into a few bins. In place: each new
    # tensor costs a first touch of its memory, as much as the arithmetic.
    difference = values - low
    span = float((difference if keep is None else torch.where(keep, difference, 0)).max())
    floor_here = torch.tensor(span * 2.0**-24, dtype=values.dtype)  # on the CPU, for the Python numbers below
    floor = floor_here.to(values.device)
    binned = difference.clamp_min_(floor).view(integer)
    binned -= floor.view(integer)
    widest = float(torch.tensor(span, dtype=values.dtype).view(integer) - floor_here.view(integer))
    binned >>= max(0, math.frexp(widest + 1)[1] - bin_bits)
    binned += torch.arange(n_rows, device=values.device, dtype=integer)[:, None] * bins
    if keep is not None:
        binned.masked_fill_(~keep, n_rows * bins)  # one spare bin past the rows' for what is left out
    counts = torch.bincount(binned.flatten(), minlength=n_rows * bins + 1)[: n_rows * bins].reshape(n_rows, bins)
    cumulative = counts.cumsum(1)
    n = cumulative[:, -1]
    ranks = torch.tensor(list(fractions), dtype=values.dtype, device=values.device)[:, None] * (n - 1).clamp_min(0)
    below, above = ranks.to(torch.int64), ranks.ceil().to(torch.int64)
    wanted = einops.rearrange(torch.stack([below, above]), "end fraction row -> row (end fraction)").contiguous()
    bin_of = torch.searchsorted(cumulative, wanted, right=True).clamp_max(bins - 1)  # [row target]
    before = torch.where(bin_of > 0, cumulative.gather(1, (bin_of - 1).clamp_min(0)), 0)
    targets = bin_of + torch.arange(n_rows, device=values.device)[:, None] * bins
    candidates = _values_in_bins(values, binned, targets, n_rows * bins + 1)
    # A target's value: its bin's first candidate plus its rank inside the bin.
    distinct = torch.unique(targets)
    sizes = counts.flatten()[distinct]
    at = (sizes.cumsum(0) - sizes)[torch.searchsorted(distinct, targets)] + (wanted - before)
    found = (
        candidates[at.clamp(0, max(candidates.numel() - 1, 0))] if candidates.numel() else values.new_zeros(at.shape)
    )
    found = einops.rearrange(found, "row (end fraction) -> end fraction row", end=2)
    result = torch.lerp(found[0], found[1], ranks - below)
    return torch.where(n > 0, result, 0)


def _values_in_bins(
    values: Float[Tensor, "row item"], binned: Int[Tensor, "row item"], targets: Int[Tensor, "row target"], n_bins: int
) -> Float[Tensor, " candidate"]:
    """The values whose bin (of ``n_bins``) is one of their row's ``targets``, sorted by bin, then by value."""
    wanted = torch.zeros(n_bins, dtype=torch.uint8, device=binned.device)
    wanted[targets.flatten()] = 1
    hit = wanted.index_select(0, binned.flatten()).view(binned.shape)  # a lookup: one pass, whatever the targets
    rows, items = hit.nonzero(as_tuple=True)
    candidates, order = values[rows, items].sort(stable=True)
    _, regroup = binned[rows, items][order].sort(stable=True)
    return candidates[regroup]


class SinkAnalysis(LayerResults[SinkLayer]):
    """Sink geometry of every requested layer for one batch: a `LayerResults` of `SinkLayer`.

    ``analysis[10]`` is layer 10's `SinkLayer` (its sink/tail factors in ``.factors``);
    `head_table`, `per_query` and `claims` read every layer. ``save(path)`` /
    ``SinkAnalysis.load(path)`` keep it in one file; ``figures()`` and ``report(path)`` draw it.
    """

    STORED = ("k",)

    def __init__(self, layers: Mapping[int, SinkLayer], *, k: int = 1, **results: Any) -> None:
        super().__init__(layers, **results)
        self.k = k

    @property
    def factors(self) -> dict[Scope, dict[int, dict[str, Tensor]]]:
        """``factors[scope][layer][name]`` -> ``[head]`` (see `part_factors`)."""
        scopes = next(iter(self.values())).factors
        return {scope: {layer: s.factors[scope] for layer, s in self.items()} for scope in scopes}

    def head_table(self) -> pd.DataFrame:
        """One row per (layer, head) with every per-head statistic."""
        rows = []
        for layer, s in self.items():
            q = einops.rearrange(s.queries, "b q -> b 1 q").float()
            n = q.sum((0, 2)).clamp_min(1)
            key_weight = einops.rearrange(s.keys, "b k -> b 1 k").float()

            def mean(x: Tensor, q: Tensor = q, n: Tensor = n) -> list[float]:
                return ((x * q).sum((0, 2)) / n).tolist()

            columns = {
                "sink_ratio": mean(s.sink_ratio),
                "output_norm": mean(s.output_norm),
                "sink_tail_cosine": mean(s.sink_tail_cosine),
                "negative_sink_tail_share": mean((s.sink_tail_cosine < 0).float()),
                "negative_sink_token_share": (
                    ((s.sink_token_cosine < 0).float() * key_weight).sum((0, 2)) / key_weight.sum((0, 2)).clamp_min(1)
                ).tolist(),
                "interior_minimum_share": mean(s.interior_minimum.float()),
                "beta_star": mean(s.beta_star),
                "beta_star_minus_ratio": mean(s.beta_star - s.sink_ratio),
                "cone_cosine": mean(s.cone_cosine),
            }
            for scope, per_head in s.factors.items():
                for name, values in per_head.items():
                    columns[f"{scope}_{name}"] = values.tolist()
            for head in range(s.sink_ratio.shape[1]):
                rows.append({"layer": layer, "head": head, **{c: v[head] for c, v in columns.items()}})
        return pd.DataFrame(rows).set_index(["layer", "head"])

    def per_query(self) -> pd.DataFrame:
        """One row per (layer, head, batch, query): sink ratio, output norm, beta*, cosines."""
        frames = []
        for layer, s in self.items():
            b_idx, q_idx = s.queries.nonzero(as_tuple=True)
            for head in range(s.sink_ratio.shape[1]):
                frames.append(
                    pd.DataFrame(
                        {
                            "layer": layer,
                            "head": head,
                            "batch": b_idx.cpu().numpy(),
                            "query": q_idx.cpu().numpy(),
                            "sink_ratio": s.sink_ratio[b_idx, head, q_idx].cpu().numpy(),
                            "output_norm": s.output_norm[b_idx, head, q_idx].cpu().numpy(),
                            "beta_star": s.beta_star[b_idx, head, q_idx].cpu().numpy(),
                            "interior_minimum": s.interior_minimum[b_idx, head, q_idx].cpu().numpy(),
                            "sink_tail_cosine": s.sink_tail_cosine[b_idx, head, q_idx].cpu().numpy(),
                        }
                    )
                )
        return pd.concat(frames, ignore_index=True)

    def claims(self) -> dict[str, float]:
        """The numbers behind the sink claims, over all layers, heads and real queries."""
        table = self.per_query()
        heads = self.head_table()
        corr = np.corrcoef(table["beta_star"], table["sink_ratio"])[0, 1] if len(table) > 1 else float("nan")
        return {
            "share_queries_sink_anti_aligned_with_tail": float((table["sink_tail_cosine"] < 0).mean()),
            "share_heads_mostly_anti_aligned": float((heads["negative_sink_tail_share"] > 0.5).mean()),
            "share_sink_token_pairs_anti_aligned": float(heads["negative_sink_token_share"].mean()),
            "share_queries_interior_minimum": float(table["interior_minimum"].mean()),
            "median_abs_beta_star_minus_ratio": float((table["beta_star"] - table["sink_ratio"]).abs().median()),
            "corr_beta_star_sink_ratio": float(corr),
            "mean_sink_contribution_intra": float(heads["intra_sink_contribution"].mean())
            if "intra_sink_contribution" in heads
            else float("nan"),
            **{
                f"share_heads_negative_{scope}_sink_contribution": float((heads[column] < 0).mean())
                for scope in Scope
                if (column := f"{scope}_sink_contribution") in heads
            },
            **{
                f"mean_intra_{part}_{factor}": float(heads[column].mean())
                for part in PARTS
                for factor in Factor
                if (column := f"intra_{part}_{factor}") in heads
            },
            "n_layers": float(self.n_layers),
        }

    def verdicts(self) -> pd.DataFrame:
        """The sink claims this analysis can judge, in words (`claim_verdicts`)."""
        return claim_verdicts(self.claims())

    def figures(self) -> "dict[str, go.Figure]":
        """Per layer and head: the sink ratio, the anti-aligned share and the sink's contribution; the scatter."""
        from contribution_lens.drawing import plot

        heads = self.head_table()
        columns = {
            "sink_ratio": "Sink ratio, per head",
            "negative_sink_tail_share": "Share of queries whose sink value points against the tail, per head",
            **{f"{scope}_sink_contribution": f"Contribution of the sink ({scope}-head), per head" for scope in Scope},
        }
        out = {title: plot.sink_head_grid(heads, column) for column, title in columns.items() if column in heads}
        out["Sink ratio vs output norm"] = plot.sink_ratio_scatter(self.per_query())
        return out

    def report(self, path: str | os.PathLike) -> Path:
        """One self-contained HTML page: the claims judged, the figures, every per-head number."""
        from contribution_lens.drawing import html

        sections: list[html.Section] = [
            ("The claims, measured here", self.verdicts()),
            *self.figures().items(),
            ("Per head", self.head_table()),
        ]
        texts = self.tokens.shape[0]
        return html.write_html(
            path, f"SinkAnalysis of {texts} text{'s' * (texts != 1)}, layers {self.layers}", sections
        )


def sink_analysis(
    model: adapter.Model,
    inputs: str | Sequence[str] | Tensor,
    *,
    k: int | None = None,
    sinks: Sequence[int] | str | None = None,
    epsilon: float = 0.3,
    layers: int | Sequence[int] | None = None,
    scopes: Sequence[str] = ("intra", "inter"),
    quantiles: Sequence[str] | None = None,
    attention_mask: Tensor | None = None,
    prepend_bos: bool | None = None,
    progress: bool = False,
) -> SinkAnalysis:
    """Sink geometry and sink/tail factors of every requested layer in one forward pass.

    Args:
        k: the sink is the first ``k`` positions, unless ``sinks`` is given. None (default):
            position 0 where every text starts with the model's BOS, else ``sinks="auto"``.
        sinks: sink positions, or ``"auto"``: per layer and text, the keys whose mean attention
            share exceeds ``epsilon`` (Gu et al.'s threshold; see `detect_sinks`), which finds
            an encoder's ``[CLS]``/``[SEP]`` and the sink of a text without BOS.
        epsilon: the threshold for ``sinks="auto"``.
        scopes: the scopes whose sink/tail factors are computed (`part_factors`).
        quantiles: the scopes (of ``scopes``) whose tail distributions are computed too: the
            factors ``tail_cosine_q10/q50/q90`` and ``tail_relative_norm_q10/q50/q90``
            (`tail_quantiles`). None (default): the inter scope, where it is computed;
            ``("intra", "inter")`` adds the intra scope's (a third of the analysis's own cost at
            512 tokens); ``()``: none. No figure, claim or verdict reads them; the per-head
            table (`SinkAnalysis.head_table`, ``report``) shows those computed.
        prepend_bos: prepend the tokenizer's BOS to texts; None: the model's own choice
            (``cfg.default_prepend_bos``).
        progress: show a progress bar ("sink analysis"), one step a layer.

    Example:
        >>> import contribution_lens as cl
        >>> model = cl.load_model()
        >>> analysis = cl.sink_analysis(model, "The cat sat on the mat.", layers=[10])
        >>> analysis.head_table().shape[0]  # one row per head of layer 10
        9
        >>> 0 <= analysis.claims()["share_queries_interior_minimum"] <= 1
        True
    """
    if isinstance(sinks, str) and sinks != "auto":
        raise ValueError(f"sinks must be positions, a mask or 'auto', got {sinks!r}")
    if isinstance(scopes, str) or not scopes:
        raise ValueError(f"scopes must be some of {tuple(map(str, Scope))}, got {scopes!r}")
    if k is not None:
        k = as_index(k, "k must be an integer")
    wanted = [Scope.of(scope) for scope in scopes]
    described = _quantile_scopes(quantiles, wanted)
    positions = None if isinstance(sinks, str) else sinks

    def on_layer(layer: adapter.LayerInputs) -> SinkLayer:
        mask = layer.padding_mask
        find = isinstance(sinks, str) or (sinks is None and k is None and not layer.bos_first)
        chosen = detect_sinks(layer.pattern, epsilon=epsilon, attention_mask=mask) if find else positions
        geometry = sink_layer(
            layer.pattern, layer.v, layer.W_O, k=k or 1, sinks=chosen, attention_mask=mask, causal=layer.causal,
            gram=layer.gram,
        )  # fmt: skip
        decompositions = {scope: layer.decompose(scope) for scope in wanted}
        found: dict[Scope, dict[str, Tensor]] = {scope: {} for scope in wanted}
        if described:
            first = decompositions[described[0]]  # the pairs are the same in every scope
            pairs = TailPairs.of(first.attention, first.valid, geometry.sinks, geometry.queries)
            found.update(zip(described, tail_quantiles([decompositions[s] for s in described], pairs), strict=True))
        means = _factor_means(list(decompositions.values()), geometry.sinks, geometry.queries)
        factors = {scope: m | found[scope] for scope, m in zip(decompositions, means, strict=True)}
        bar.update()
        return replace(geometry, factors=factors)

    total = len(adapter.check_layers(model, layers))
    with tqdm(total=total, desc="sink analysis", unit="layer", disable=not progress) as bar:
        results = map_layers(
            model, inputs, on_layer, layers=layers, attention_mask=attention_mask, prepend_bos=prepend_bos
        )
    return SinkAnalysis.from_results(results, k=k or 1)


def _quantile_scopes(quantiles: Sequence[str] | None, scopes: Sequence[Scope]) -> list[Scope]:
    """The scopes whose tail quantiles `sink_analysis` computes, each one of ``scopes``."""
    if quantiles is None:
        return [Scope.INTER] if Scope.INTER in scopes else []
    if isinstance(quantiles, str):
        raise ValueError(f"quantiles must be a sequence of scopes, e.g. ({quantiles!r},), got the string {quantiles!r}")
    unknown = [scope for scope in quantiles if str(scope) not in Scope.names()]
    if unknown:
        raise ValueError(f"quantiles must hold scopes of {Scope.names()}, got {unknown[0]!r}")
    chosen = [Scope.of(scope) for scope in quantiles]
    missing = [str(scope) for scope in chosen if scope not in scopes]
    if missing:
        raise ValueError(
            f"quantiles asks for the {missing[0]} scope, which scopes={tuple(map(str, scopes))} does not compute"
        )
    return list(dict.fromkeys(chosen))


def claim_verdicts(claims: dict[str, float]) -> pd.DataFrame:
    """The four sink claims in words: what was measured, the threshold it is held to, the verdict.

    Reads the numbers of `SinkAnalysis.claims` and, where present, those of the sink-norm
    intervention (keys ``zero_*`` as the ``sinks`` command writes them). Thresholds:

    * anti-alignment: ``cos(s_i, t_i) < 0`` for more than 90 % of (head, query) pairs is
      "supported", more than 50 % "partly (a majority, not a rule)", else "not supported";
    * interior minimum: more than 50 % of (head, query) pairs have one;
    * active suppression: the sink's mean intra-head contribution is below 0;
    * sink-norm removal: the low-norm outputs' cone cosine rises in more than half the layers
      and perplexity rises.
    """
    rows = []
    anti = claims["share_queries_sink_anti_aligned_with_tail"]
    anti_verdict = "supported" if anti > 0.9 else "partly (a majority, not a rule)" if anti > 0.5 else "not supported"
    rows.append(
        (
            "The sink's value points against the semantic tokens' output (anti-aligned)",
            f"cos(s_i, t_i) < 0 for {anti:.1%} of (head, query) pairs",
            "> 90 % supported, > 50 % partly",
            anti_verdict,
        )
    )
    interior = claims["share_queries_interior_minimum"]
    rows.append(
        (
            "The output norm is convex in the sink ratio with an interior minimum",
            f"convex by construction; minimum strictly inside (0, 1) for {interior:.1%} of (head, query) pairs",
            "> 50 %",
            "supported" if interior > 0.5 else "not supported",
        )
    )
    sink = claims["mean_sink_contribution_intra"]
    rows.append(
        (
            "Sinks are active suppressors (their contribution is negative)",
            f"mean intra-head contribution of the sink {sink:+.3f}",
            "< 0",
            "supported" if sink < 0 else "not supported: the sink adds to the output on average",
        )
    )
    if "zero_delta_ppl" in claims and "zero_layers_where_low_norm_cone_cosine_rises" in claims:
        rises, n_layers = claims["zero_layers_where_low_norm_cone_cosine_rises"], claims.get("n_layers", float("nan"))
        before = claims.get("zero_mean_low_norm_cone_cosine_clean", float("nan"))
        after = claims.get("zero_mean_low_norm_cone_cosine_intervened", float("nan"))
        delta = claims["zero_delta_ppl"]
        holds = rises > n_layers / 2 and delta > 0
        rows.append(
            (
                "Removing the sink's value norm collapses outputs into the semantic cone and raises perplexity",
                f"cone cosine of low-norm outputs {before:.3f} -> {after:.3f} (rises in {rises:.0f} of "
                f"{n_layers:.0f} layers); perplexity {delta:+.2f}",
                "rises in > half the layers and ΔPPL > 0",
                "supported" if holds else "not supported",
            )
        )
    return pd.DataFrame(rows, columns=["claim", "measured here", "threshold", "verdict"])
