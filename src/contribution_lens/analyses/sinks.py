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
from jaxtyping import Bool, Float
from torch import Tensor
from tqdm.auto import tqdm

from contribution_lens import adapter
from contribution_lens.choices import as_index
from contribution_lens.decomposition import Decomposition, Factor, Scope, head_gram, is_causal
from contribution_lens.engine import LayerResults, map_layers, tiles_mode

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
    """Sink vs tail factors per scope (see `SinkRows.factors`); empty where `sink_analysis` did not ask."""

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
    keeps its share). The sums are `SinkShares`', which `layer_sink_shares` adds a tile at a time.
    """
    batch, heads, _, n_key = pattern.shape
    shares = SinkShares(batch, heads, n_key, attention_mask, pattern.device)
    shares.add(pattern)
    return shares.result()


class SinkShares:
    """`sink_shares`' sums over a layer's queries, added a tile of queries at a time (`add`), then `result`."""

    def __init__(
        self, batch: int, heads: int, n_key: int, attention_mask: Bool[Tensor, "batch key"] | None, device: torch.device
    ) -> None:
        self.real = (
            torch.ones(batch, n_key, dtype=torch.bool, device=device)
            if attention_mask is None
            else attention_mask.to(device, torch.bool)
        )
        self.heads = heads
        self.received = torch.zeros(batch, n_key, device=device)
        self.seen_by = torch.zeros(batch, n_key, dtype=torch.bool, device=device)
        self.viewers = torch.zeros(batch, heads, n_key, device=device)
        self.others = torch.zeros(batch, n_key, dtype=torch.bool, device=device)

    def add(self, pattern: Float[Tensor, "batch head row key"], first_query: int | None = None) -> None:
        """Add the rows of queries ``first_query ..`` (default: the last rows) over the first keys."""
        n_query, n_key = pattern.shape[-2:]
        first = self.real.shape[1] - n_query if first_query is None else first_query
        real = self.real[:, :n_key]
        real_q = self.real[:, first : first + n_query]
        alpha = torch.where(real[:, None, None, :] & real_q[:, None, :, None], pattern.float(), 0)
        attended = alpha > 0
        self.received[:, :n_key] += einops.reduce(alpha, "batch head query key -> batch key", "sum")
        self.seen_by[:, :n_key] |= einops.reduce(attended, "batch head query key -> batch key", "max")
        self.viewers[..., :n_key] += einops.reduce(attended.float(), "batch head query key -> batch head key", "sum")
        # The key's own query is the diagonal.
        positions = torch.arange(n_key, device=pattern.device)
        own = positions[None, :] == torch.arange(first, first + n_query, device=pattern.device)[:, None]
        self.others[:, :n_key] |= einops.reduce(attended & ~own, "batch head query key -> batch key", "max")

    def result(self) -> Float[Tensor, "batch key"]:
        others = self.others | ~self.others.any(-1, keepdim=True)
        viewers = self.viewers.amax(1).clamp_min(1)
        return torch.where(self.seen_by & self.real & others, self.received / self.heads / viewers, 0)


def layer_sink_shares(layer: adapter.LayerInputs) -> Float[Tensor, "batch key"]:
    """`sink_shares` of one layer, read a tile of queries at a time (`contribution_lens.adapter.LayerInputs.tiles`)."""
    batch, heads, _, n_key = layer.pattern.shape
    shares = SinkShares(batch, heads, n_key, layer.padding_mask, layer.v.device)
    for tile in layer.tiles():
        shares.add(layer.pattern_rows(tile), tile.start + n_key - layer.pattern.shape[2])
    return shares.result()


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
    _check_epsilon(epsilon)
    return sinks_of_shares(sink_shares(pattern, attention_mask=attention_mask), epsilon)


def _check_epsilon(epsilon: float) -> None:
    if not 0 < epsilon < 1:
        raise ValueError(f"epsilon must lie in (0, 1), got {epsilon}")


def sinks_of_shares(share: Float[Tensor, "batch key"], epsilon: float) -> Bool[Tensor, "batch key"]:
    """`detect_sinks` from the keys' shares: those above ``epsilon``, else the largest."""
    sinks = share > epsilon
    fallback = torch.zeros_like(sinks)
    fallback[torch.arange(share.shape[0]), share.argmax(-1)] = True
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
    `SinkRows` with every query at once: `sink_analysis` adds them a tile of queries at a time.
    """
    batch, _, n_query, n_key = pattern.shape
    if n_query != n_key:
        raise ValueError("sink analysis needs the full square pattern")
    is_sink = sink_mask(sinks, k, batch, n_key, pattern.device)
    rows = SinkRows(v, W_O, is_sink, attention_mask=attention_mask, gram=gram)
    rows.add(pattern, causal=is_causal(pattern) if causal is None else causal)
    return rows.geometry(sinks)


class SinkRows:
    """`sink_layer` and the sink/tail factors of one layer, its queries added a tile at a time (`add`).

    For each query ``i`` and part ``P`` (the sink keys, the tail keys) one product of its row of the
    pattern with the keys reads ``z_P = sum_{j in P} alpha_ij v_j`` (the sink and tail outputs through
    ``d_head``), ``u_P = sum_{j in P} alpha_ij v_j / ||vt_j||``, ``sum_{j in P} alpha_ij ||vt_j||`` and the
    part's mass ``sum_{j in P} alpha_ij``; with whether the query sees a sink key and a tail key, that is
    all the row is read for. The geometry (`geometry`) and each scope's factors (`factors`) then read
    these ``[batch head query (d_head)]`` tensors, never the pattern: with ``o`` the scope's output,
    ``cos_ij ||vt_j|| = <o, vt_j> / ||o||``, so ``sum_{j in P} alpha_ij cos_ij ||vt_j|| = <o, z_P W_O> / ||o||``
    and ``sum_{j in P} alpha_ij cos_ij = <o, u_P W_O> / ||o||``, every inner product through ``d_head``.
    """

    def __init__(
        self,
        v: Float[Tensor, "batch key kv_head d_head"],
        W_O: Float[Tensor, "head d_head d_model"],
        is_sink: Bool[Tensor, "batch key"],
        *,
        attention_mask: Bool[Tensor, "batch key"] | None = None,
        gram: Float[Tensor, "head d_head e_head"] | None = None,
    ) -> None:
        batch, n_key, n_kv, d_head = v.shape
        n_heads, device = W_O.shape[0], v.device
        self.real = (
            torch.ones(batch, n_key, dtype=torch.bool, device=device)
            if attention_mask is None
            else attention_mask.to(device, torch.bool)
        )
        self.masked, self.W_O = attention_mask is not None, W_O
        self.is_sink = is_sink.to(device) & self.real
        values = torch.where(einops.rearrange(self.real, "batch key -> batch key 1 1"), v.float(), 0)
        self.values = einops.repeat(
            values, "batch key kv_head d_head -> batch (kv_head group) key d_head", group=n_heads // n_kv
        )
        self.gram = head_gram(W_O.float()) if gram is None else gram.float()
        self.value_norm = einops.einsum(self.values, self.gram, self.values, "b h k d, h d e, b h k e -> b h k")
        self.value_norm = self.value_norm.clamp_min(0).sqrt()
        inverse = torch.where(self.value_norm > 0, 1 / self.value_norm.where(self.value_norm > 0, 1), 0)
        # Per key: v_j, v_j / ||vt_j||, ||vt_j||, 1: one product with a row reads every sum of its part.
        per_key = torch.cat([self.values, self.values * inverse[..., None], self.value_norm[..., None],
                             torch.ones_like(self.value_norm)[..., None]], -1)  # fmt: skip
        self.tail_keys = per_key * (self.real & ~self.is_sink).float()[:, None, :, None]
        self.sink_keys = per_key * self.is_sink.float()[:, None, :, None]
        self.sink_columns = self.is_sink.any(0).nonzero().squeeze(1)
        self.parts = {part: torch.zeros(batch, n_heads, n_key, 2 * d_head + 2, device=device) for part in PARTS}
        """Per part and query: ``z_P``, ``u_P``, ``sum alpha ||vt||``, ``sum alpha`` (`SinkRows`)."""
        self.queries = torch.zeros(batch, n_key, dtype=torch.bool, device=device)

    def add(
        self, pattern: Float[Tensor, "batch head row key"], *, causal: bool, first_query: int | None = None
    ) -> None:
        """Add the rows of queries ``first_query ..`` (default: the last rows), over the first keys of the text."""
        n_query, n_key = pattern.shape[-2:]
        first = n_key - n_query if first_query is None else first_query
        rows = slice(first, first + n_query)
        real_q = self.real[:, rows]
        valid = self.real[:, None, None, :n_key] & real_q[:, None, :, None]
        # Padding may hold anything (NaN too): zeroed where there is some, else the pattern is used as it is.
        alpha = pattern.float() if not self.masked else torch.where(valid, pattern.float(), 0)
        columns = self.sink_columns[self.sink_columns < n_key]
        # The sink's few columns alone; the tail's from every key, the sink's zeroed in the right operand.
        self.parts["sink"][:, :, rows] = alpha.index_select(3, columns) @ self.sink_keys.index_select(2, columns)
        self.parts["tail"][:, :, rows] = alpha @ self.tail_keys[:, :, :n_key]
        visible = valid[:, 0]
        if causal:
            visible = visible & torch.ones(n_query, n_key, dtype=torch.bool, device=visible.device).tril(first)
        is_sink = self.is_sink[:, :n_key]
        keys = self.real[:, :n_key] & ~is_sink
        sees = (visible & is_sink[:, None, :]).any(-1) & (visible & keys[:, None, :]).any(-1)
        self.queries[:, rows] = real_q & ~self.is_sink[:, rows] & sees

    def _part(self, part: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``z_P``, ``u_P``, ``sum alpha ||vt||`` and the mass of ``part``, per query."""
        d_head = self.values.shape[-1]
        found = self.parts[part]
        return found[..., :d_head], found[..., d_head : 2 * d_head], found[..., -2], found[..., -1]

    def factors(
        self, scope: Scope, *, z: Tensor | None = None, output: Tensor | None = None, reading: Tensor | None = None
    ) -> dict[str, Float[Tensor, " head"]]:
        """The sink vs tail factors of ``scope`` per head, each a mean over the sink layer's queries.

        For a part ``P`` and query ``i``: attention ``sum_{j in P} alpha_ij`` and contribution
        ``sum_{j in P} c_ij`` are summed over the part's keys; relative norm and cosine are their
        attention-weighted means ``sum_{j in P} alpha_ij x_ij / sum_{j in P} alpha_ij``. ``o`` is the
        heads' output ``z`` (``[batch query head d_head]``, the model's ``hook_z``; default the sum of
        the parts) through ``W_O`` (intra), or the layer's ``output`` (``[batch query d_model]``, the
        o-projection's less ``b_O``; default ``sum_h z^h W_O^h``) (inter), read through each head as
        ``reading`` ``[batch head query d_head]`` where the caller has it (``o W_O^h^T``,
        `contribution_lens.adapter.LayerInputs.inter_reading`).
        """
        parts = {part: self._part(part) for part in PARTS}
        z_out = parts["sink"][0] + parts["tail"][0]
        # A half-precision hook_z is the parts' sum rounded once more: o built from it would make the intra
        # weights sum to 1 only to that rounding (2e-4 in bfloat16), so there it is the parts' float32 sum.
        heads_z = z_out if z is None or z.dtype.itemsize < 4 else einops.rearrange(z.float(), "b q h d -> b h q d")
        if scope == Scope.INTRA:
            reading = einops.einsum(heads_z, self.gram, "b h q d, h d e -> b h q e")  # <o^h, x W_O^h> = z G x
            norm = einops.einsum(reading, heads_z, "b h q e, b h q e -> b h q").clamp_min(0).sqrt()
        else:
            W_O = self.W_O.to(heads_z.dtype)
            o = einops.einsum(heads_z, W_O, "b h q d, h d m -> b q m") if output is None else output.float()
            if reading is None:
                reading = einops.einsum(o, W_O, "b q m, h d m -> b h q d")  # <o, x W_O^h> = (o W_O^h^T) x
            reading = reading.float()
            norm = einops.repeat(o.norm(dim=-1), "b q -> b h q", h=heads_z.shape[1])
        q_mask = einops.rearrange(self.queries, "b q -> b 1 q")
        reading, norm = torch.where(q_mask[..., None], reading, 0), torch.where(q_mask, norm, 0)
        inverse_norm = torch.where(norm != 0, 1 / norm.where(norm != 0, 1), 0)
        q_weight = q_mask.to(norm.dtype)
        n_queries = q_weight.sum((0, 2)).clamp_min(1)
        means: dict[str, Tensor] = {}
        for part, (z_part, u_part, value_norms, mass) in parts.items():
            cosines = einops.einsum(reading, u_part, "b h q d, b h q d -> b h q") * inverse_norm
            weighted = einops.einsum(reading, z_part, "b h q d, b h q d -> b h q") * inverse_norm
            per_query = {
                Factor.ATTENTION: mass,
                Factor.RELATIVE_NORM: value_norms * inverse_norm / mass.clamp_min(1e-30),
                Factor.COSINE: cosines / mass.clamp_min(1e-30),
                Factor.CONTRIBUTION: weighted * inverse_norm,
            }
            for factor in Factor:
                means[f"{part}_{factor}"] = (per_query[factor] * q_weight).sum((0, 2)) / n_queries
        return means

    def geometry(self, sinks: Sequence[int] | Tensor | None = None) -> SinkLayer:
        """The `SinkLayer` of every query added (``sinks``: the positions asked for, named where no query sees them)."""
        gram, queries = self.gram, self.queries
        (z_sink, _, _, sink_ratio), (z_tail, _, _, tail_ratio) = self._part("sink"), self._part("tail")
        z_out = z_sink + z_tail
        sink_mean, tail_mean = _unit_mass_directions(tail_ratio, sink_ratio, z_sink, z_tail)
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
        sink_token_cosine = _sink_token_cosine(self.values, gram, self.is_sink)
        keys = self.real & ~self.is_sink
        cone_cosine = _cone_cosine(tail_mean, tail_sq, z_out, out_sq, gram, queries)
        if sinks is not None and not isinstance(sinks, Tensor) and not bool(queries.any()):
            raise ValueError(
                f"no real query sees both a sink key (sinks={sinks!r}) and a tail key: every statistic "
                "would be empty (under causal attention only later tokens see a sink: choose earlier positions)"
            )
        q_mask = einops.rearrange(queries, "b q -> b 1 q")
        zero = torch.zeros((), device=queries.device)
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
            sinks=self.is_sink,
        )


def _unit_mass_directions(
    tail_ratio: Tensor, sink_ratio: Tensor, z_sink: Tensor, z_tail: Tensor
) -> tuple[Float[Tensor, "b h q d"], Float[Tensor, "b h q d"]]:
    """``S = s_i / a_i`` and ``U = t_i / (tail mass)``, 0 where a part has no mass.

    The tail's own mass, not ``1 - a_i``: where ``a_i`` rounds to 1 in float32, ``1 - a_i`` is 0 while
    the tail still holds (tiny) attention, and ``t_i / 1e-30`` overflowed ``||U||^2`` to NaN.
    """
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


QUANTILES = (10, 50, 90)
"""The percentiles of the tail's cosine and relative norm that `sink_analysis` reports (`TailQuantiles`)."""
TAIL_KEPT_BYTES = 512 << 20
"""The most bytes of tail pairs one scope of one layer keeps between the quantiles' two sweeps (`TailQuantiles`):
SmolLM2 at 2,048 tokens needs about 170 MB; past it the second sweep reads the tiles again."""


class TailQuantiles:
    """`QUANTILES` of ``cos_ij`` and of ``||vt_j|| / ||o_i||`` per head over one layer's tail pairs, in one scope.

    A pair is a query of the sink layer's ``queries`` and a key it sees that is not a sink, in any
    text of the batch, where the head gives it attention (``alpha > 0``). The decompositions of the
    layer's queries come a tile at a time (`add`): each tile's values are counted in their bins
    (`TileQuantiles`, pairs only) where they lie, in the cache, and kept while they fit ``kept_bytes``;
    `result` then reads the kept values of the bins that hold the quantiles. Where they do not fit
    (long texts), the tiles must come once more (`collect`, unless `swept`). The relative norm is
    ``Decomposition.relative_norm`` bit for bit; the numbers are ``torch.quantile``'s.
    """

    def __init__(
        self, heads: int, dtype: torch.dtype, device: torch.device, *, items: int, kept_bytes: int | None = None
    ) -> None:
        fractions, bits = [p / 100 for p in QUANTILES], stream_bits(items)
        self.found = {
            name: TileQuantiles(heads, fractions, dtype, device, domain, bits) for name, domain in FACTORS.items()
        }
        self.kept: list[dict[str, tuple[Tensor, Tensor]]] | None = []
        self.room = TAIL_KEPT_BYTES if kept_bytes is None else kept_bytes

    @staticmethod
    def values(
        d: Decomposition, is_sink: Bool[Tensor, "batch key"], queries: Bool[Tensor, "batch query"], first_query: int
    ) -> tuple[dict[str, Float[Tensor, "head item"]], Bool[Tensor, "head item"]]:
        """Each factor of ``d`` (queries from ``first_query``) ``[head (batch query key)]``, and where a pair is not."""
        n_query, n_key = d.shape[2:]
        pairs = d.valid & (~is_sink[:, :n_key])[:, None, :] & queries[:, first_query : first_query + n_query, None]
        left_out = torch.le(d.attention, 0).logical_or_(~pairs[:, None])
        output_norm = d.output_norm[..., None]
        relative_norm = d.value_norm[:, :, None, :] / output_norm
        if not bool((output_norm != 0).all()):  # Decomposition.relative_norm's 0 where ||o|| = 0
            relative_norm = torch.where(output_norm != 0, relative_norm, 0)
        rows = "b h q k -> h (b q k)"
        found = {"cosine": einops.rearrange(d.cosine, rows), "relative_norm": einops.rearrange(relative_norm, rows)}
        return found, einops.rearrange(left_out, rows)

    @property
    def swept(self) -> bool:
        """Whether the first sweep kept every value: `result` then needs no second sweep over the tiles."""
        return self.kept is not None

    def add(self, d: Decomposition, is_sink: Tensor, queries: Tensor, first_query: int | None = None) -> None:
        """The first sweep: one tile's decomposition (queries from ``first_query``, default the last rows)."""
        first = queries.shape[1] - d.shape[2] if first_query is None else first_query
        found, left_out = self.values(d, is_sink, queries, first)
        bins = {name: self.found[name].add(values, left_out) for name, values in found.items()}
        if self.kept is not None:
            self.room -= sum(found[name].nbytes + bins[name].nbytes for name in found)
            self.kept = [*self.kept, {name: (found[name], bins[name]) for name in found}] if self.room >= 0 else None

    def collect(self, d: Decomposition, is_sink: Tensor, queries: Tensor, first_query: int | None = None) -> None:
        """The second sweep, where the first could not keep the values: every tile once more, as `add` saw them."""
        first = queries.shape[1] - d.shape[2] if first_query is None else first_query
        found, left_out = self.values(d, is_sink, queries, first)
        for name, values in found.items():
            self.found[name].collect(values, self.found[name].bins(values, left_out))

    def result(self) -> dict[str, Float[Tensor, " head"]]:
        """``tail_{cosine,relative_norm}_q{10,50,90}`` per head."""
        for tile in self.kept or []:
            for name, (values, bins) in tile.items():
                self.found[name].collect(values, bins)
        self.kept = None
        out: dict[str, Tensor] = {}
        for name, quantiles in self.found.items():
            found = quantiles.result()
            out |= {f"tail_{name}_q{p}": found[index] for index, p in enumerate(QUANTILES)}
        return out


FACTORS = {"cosine": "unit", "relative_norm": "non-negative"}
"""The factors whose tail distribution `TailQuantiles` describes, and where their values lie (`order_bins`)."""


STREAM_BITS = 16
"""At most ``2**STREAM_BITS`` bins a row (`TileQuantiles`): a bin then spans 1/65,536 of [-1, 1] for a cosine,
1/128 of a norm's magnitude."""


def stream_bits(items: int) -> int:
    """Bits of the bins for ``items`` values a row: about 8 values a bin, from ``2**10`` to ``2**STREAM_BITS`` bins."""
    return min(STREAM_BITS, max(10, math.ceil(math.log2(max(items, 1) / 8))))


def order_bins(values: Tensor, domain: str = "any", bits: int = STREAM_BITS) -> Tensor:
    """Each value's bin, an int32 in ``[0, 2**bits)`` that never decreases with the value (finite values).

    ``domain``: ``"unit"`` for values in [-1, 1] (cosines: equal bins of the interval), ``"non-negative"``
    (ratios of norms: the float's bits, read as an integer, which grows with a non-negative float, from
    ``2**-32`` to ``2**32``: 64 octaves of ``2**(bits - 6)`` bins each), else ``"any"``: the top bits
    of the float with a negative one's lower bits flipped, so that they fall as it falls. A value off
    its domain lands in the first or last bin: the bins still never decrease.

    Example:
        >>> order_bins(torch.tensor([-1.0, -0.5, 0.0, 0.5, 1.0]), "unit").tolist()
        [0, 16383, 32767, 49151, 65535]
        >>> bins = order_bins(torch.tensor([-2.0, -1e-30, -0.0, 0.0, 3.0]))
        >>> bool((bins[1:] >= bins[:-1]).all())
        True
    """
    top = (1 << bits) - 1
    if domain == "unit":
        half = top / 2
        return values.clamp(-1, 1).mul_(half).add_(half).to(torch.int32)
    integer, width, mantissa = (torch.int64, 64, 52) if values.dtype == torch.float64 else (torch.int32, 32, 23)
    raw = values.contiguous().view(integer)
    if domain == "non-negative":
        low = torch.tensor(2.0**-32, dtype=values.dtype).view(integer).item()
        return raw.sub(low).bitwise_right_shift_(mantissa - (bits - 6)).clamp_(0, top).to(torch.int32)
    ordered = raw ^ ((raw >> (width - 1)) & torch.iinfo(integer).max)
    return ((ordered >> (width - bits)) + (1 << (bits - 1))).to(torch.int32)


class TileQuantiles:
    """``torch.quantile`` (linear interpolation) of each row's kept values, the items of the rows seen a part at a time.

    With ``n`` kept values ``x_(0) <= ... <= x_(n-1)`` in a row and ``r = f (n - 1)``, the quantile is
    ``x_(floor r) + (r - floor r) (x_(ceil r) - x_(floor r))``, computed as ``torch.quantile`` computes it
    (``r`` in the values' dtype, ``torch.lerp``), so the result is the same to the bit. Only the order
    statistics at ``floor r`` and ``ceil r`` are found, without sorting a row: the first sweep (`add`)
    counts each row's values in `STREAM_BITS` bins that never decrease with the value (`order_bins`),
    which names the bins holding the wanted order statistics and their ranks there; the second
    (`collect`: the same parts, or the values and bins `add` returned) keeps the values of those bins
    alone, sorted at the end. Memory: the counts and those values, whatever the number of items. A row
    with nothing kept gives 0; values must be finite.
    """

    def __init__(
        self,
        n_rows: int,
        fractions: Sequence[float],
        dtype: torch.dtype,
        device: torch.device,
        domain: str = "any",
        bits: int = STREAM_BITS,
    ) -> None:
        self.fractions, self.dtype, self.domain, self.bits = list(fractions), dtype, domain, bits
        self.spare = n_rows << bits
        self.counts = torch.zeros(self.spare + 1, dtype=torch.int64, device=device)  # a spare bin for what is left out
        self.offsets = torch.arange(n_rows, device=device, dtype=torch.int32)[:, None] << bits
        self.candidates: list[tuple[Tensor, Tensor]] = []
        self._targets: tuple[Tensor, Tensor, Tensor, Tensor] | None = None

    def bins(self, values: Float[Tensor, "row item"], left_out: Bool[Tensor, "row item"] | None) -> Tensor:
        """Each item's bin among all rows' (the spare one where ``left_out``)."""
        flat = order_bins(values.to(self.dtype), self.domain, self.bits).add_(self.offsets)
        return flat if left_out is None else flat.masked_fill_(left_out, self.spare)

    def add(self, values: Float[Tensor, "row item"], left_out: Bool[Tensor, "row item"] | None) -> Tensor:
        """The first sweep: count a part's values (but those ``left_out``) in their bins; returns the bins."""
        if self._targets is not None:
            raise RuntimeError("add after collect: the bins of the order statistics are fixed once collecting starts")
        flat = self.bins(values, left_out)
        self.counts += torch.bincount(flat.flatten(), minlength=self.spare + 1)
        return flat

    def _plan(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Per row, the ranks, the wanted order statistics, their bins and their ranks within those bins."""
        if self._targets is None:
            counts = self.counts[: self.spare].view(-1, 1 << self.bits)
            cumulative = counts.cumsum(1)
            n = cumulative[:, -1]
            fractions = torch.tensor(self.fractions, dtype=self.dtype, device=counts.device)
            ranks = fractions[:, None] * (n - 1).clamp_min(0)
            below, above = ranks.to(torch.int64), ranks.ceil().to(torch.int64)
            wanted = einops.rearrange(
                torch.stack([below, above]), "end fraction row -> row (end fraction)"
            ).contiguous()
            bin_of = torch.searchsorted(cumulative, wanted, right=True).clamp_max((1 << self.bits) - 1)
            before = torch.where(bin_of > 0, cumulative.gather(1, (bin_of - 1).clamp_min(0)), 0)
            self._targets = (ranks, below, bin_of + self.offsets.long(), wanted - before)
        return self._targets

    def collect(self, values: Float[Tensor, "row item"], bins: Tensor) -> None:
        """The second sweep: keep a part's values whose bin (`bins`' or `add`'s) holds a wanted order statistic."""
        _, _, targets, _ = self._plan()
        table = torch.zeros(self.spare + 1, dtype=torch.uint8, device=bins.device)
        table[targets.flatten()] = 1
        at = table.index_select(0, bins.flatten()).nonzero().squeeze(1)  # a lookup: one pass, whatever the targets
        self.candidates.append(
            (values.to(self.dtype).flatten().index_select(0, at), bins.flatten().index_select(0, at))
        )

    def result(self) -> Float[Tensor, "fraction row"]:
        """The quantiles, ``[fraction row]``, once both sweeps saw every part."""
        ranks, below, targets, within = self._plan()
        values = torch.cat([c[0] for c in self.candidates]) if self.candidates else ranks.new_zeros(0)
        bins = torch.cat([c[1] for c in self.candidates]).long() if self.candidates else targets.new_zeros(0)
        # Sorted by value, then (stably) by bin: each bin's values in order, bins in order.
        by_value, order = values.sort(stable=True)
        groups, regroup = bins[order].sort(stable=True)
        ordered = by_value[regroup]
        at = torch.searchsorted(groups, targets) + within
        picked = ordered[at.clamp(0, max(ordered.numel() - 1, 0))] if ordered.numel() else ranks.new_zeros(at.shape)
        picked = einops.rearrange(picked, "row (end fraction) -> end fraction row", end=2)
        n = self.counts[: self.spare].view(-1, 1 << self.bits).sum(1)
        return torch.where(n > 0, torch.lerp(picked[0], picked[1], ranks - below), 0)


def masked_quantiles(
    values: Float[Tensor, "row item"], keep: Bool[Tensor, "row item"] | None, fractions: Sequence[float]
) -> Float[Tensor, "fraction row"]:
    """``torch.quantile(values[r][keep[r]], f)`` (linear interpolation) for every row and fraction, exactly.

    `TileQuantiles` with every item at once: only the order statistics at ``floor r`` and ``ceil r``
    are found, without sorting a row (the values of the few bins that hold them are sorted).

    Example:
        >>> import torch
        >>> values = torch.tensor([[3.0, 1.0, 2.0, 10.0], [4.0, -1.0, 0.5, 0.0]])
        >>> found = masked_quantiles(values, torch.tensor([[True, True, True, False], [True] * 4]), [0.5, 0.9])
        >>> [[round(x, 4) for x in row] for row in found.tolist()]  # rows: fractions; columns: rows of values
        [[2.0, 0.25], [2.8, 2.95]]
    """
    dtype = torch.float64 if values.dtype == torch.float64 else torch.float32
    quantiles = TileQuantiles(values.shape[0], fractions, dtype, values.device, bits=stream_bits(values.shape[1]))
    bins = quantiles.add(values, None if keep is None else ~keep)
    quantiles.collect(values, bins)
    return quantiles.result()


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
        """``factors[scope][layer][name]`` -> ``[head]`` (see `SinkRows.factors`)."""
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
    tiles: bool | None = None,
) -> SinkAnalysis:
    """Sink geometry and sink/tail factors of every requested layer in one forward pass.

    Args:
        k: the sink is the first ``k`` positions, unless ``sinks`` is given. None (default):
            position 0 where every text starts with the model's BOS, else ``sinks="auto"``.
        sinks: sink positions, or ``"auto"``: per layer and text, the keys whose mean attention
            share exceeds ``epsilon`` (Gu et al.'s threshold; see `detect_sinks`), which finds
            an encoder's ``[CLS]``/``[SEP]`` and the sink of a text without BOS.
        epsilon: the threshold for ``sinks="auto"``.
        scopes: the scopes whose sink/tail factors are computed (`SinkRows.factors`).
        quantiles: the scopes (of ``scopes``) whose tail distributions are computed too: the
            factors ``tail_cosine_q10/q50/q90`` and ``tail_relative_norm_q10/q50/q90``
            (`tail_quantiles`). None (default): the inter scope, where it is computed;
            ``("intra", "inter")`` adds the intra scope's (a third of the analysis's own cost at
            512 tokens); ``()``: none. No figure, claim or verdict reads them; the per-head
            table (`SinkAnalysis.head_table`, ``report``) shows those computed.
        prepend_bos: prepend the tokenizer's BOS to texts; None: the model's own choice
            (``cfg.default_prepend_bos``).
        progress: show a progress bar ("sink analysis"), one step a layer.
        tiles: each layer is read a tile of queries at a time; True runs the pass itself in tiles,
            holding no pattern (`contribution_lens.adapter.tiled_attention`: what a 32,768-token text
            needs), False keeps the model's own, None (default) decides by the length
            (`contribution_lens.engine.WHOLE_PATTERN_BYTES`).

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
    _check_epsilon(epsilon)
    mode = tiles_mode(tiles)  # a bad value is refused before the pass
    tiles_mode(tiles)  # a bad value is refused before the pass

    def on_layer(layer: adapter.LayerInputs) -> SinkLayer:
        find = isinstance(sinks, str) or (sinks is None and k is None and not layer.bos_first)
        chosen = sinks_of_shares(layer_sink_shares(layer), epsilon) if find else positions
        batch, _, _, n_key = layer.pattern.shape
        is_sink = sink_mask(chosen, k or 1, batch, n_key, layer.v.device)
        analysed = analyse_layer(layer, is_sink, wanted, described, named=chosen)
        bar.update()
        return analysed

    total = len(adapter.check_layers(model, layers))
    with tqdm(total=total, desc="sink analysis", unit="layer", disable=not progress) as bar:
        results = map_layers(
            model, inputs, on_layer, layers=layers, attention_mask=attention_mask, prepend_bos=prepend_bos, qk=mode,
        )  # fmt: skip
    return SinkAnalysis.from_results(results, k=k or 1)


def analyse_layer(
    layer: adapter.LayerInputs,
    is_sink: Bool[Tensor, "batch key"],
    scopes: Sequence[Scope],
    described: Sequence[Scope],
    *,
    named: Sequence[int] | Tensor | None = None,
) -> SinkLayer:
    """`sink_analysis` of one layer: its `SinkRows` (geometry, each scope's factors) and its `TailQuantiles`.

    The pattern is read a tile of queries at a time (`contribution_lens.adapter.LayerInputs.tiles`),
    whether the pass kept it or it is recomputed from the queries and keys: no tensor holds it whole.
    Only the scopes whose tail distributions are asked for (``described``) are decomposed, a tile at
    a time, once, or twice where the pairs outgrow `TAIL_KEPT_BYTES`.
    """
    batch, heads, n_query, n_key = layer.pattern.shape
    offset, acc = n_key - n_query, layer.key_side().dtype
    rows = SinkRows(layer.v, layer.W_O, is_sink, attention_mask=layer.padding_mask, gram=layer.gram)
    items = batch * n_query * (n_key + 1) // 2 if layer.causal else batch * n_query * n_key  # the pairs, about
    tails = {scope: TailQuantiles(heads, acc, layer.v.device, items=items) for scope in described}
    tiles = layer.tiles()
    for tile in tiles:
        alpha = layer.pattern_rows(tile)
        rows.add(alpha, causal=layer.causal, first_query=tile.start + offset)
        for scope, tail in tails.items():
            d = layer.decompose_rows(scope, tile, pattern=alpha)
            tail.add(d, rows.is_sink, rows.queries, tile.start + offset)
    for scope, tail in tails.items():
        for tile in [] if tail.swept else tiles:  # the second sweep, where the pairs were too many to keep
            tail.collect(layer.decompose_rows(scope, tile), rows.is_sink, rows.queries, tile.start + offset)
    geometry = rows.geometry(named)
    output = layer.output_without_bias()
    # The inter scope's reading of each query, which its decomposition computed already where it was asked for.
    reading = layer.inter_reading() if Scope.INTER in described and output is not None else None
    factors = {
        scope: rows.factors(scope, z=layer.z, output=output, reading=reading)
        | (tails[scope].result() if scope in tails else {})
        for scope in scopes
    }
    return replace(geometry, factors=factors)


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
