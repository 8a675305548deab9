"""The signed token mixing of one layer: attention's parts of the residual stream, by the contribution rule.

Notation as in `contribution_lens.decomposition`. At layer ``l`` the residual stream ``x_i``
(``hook_resid_pre``) gets attention's update ``a_i = sum_h sum_j alpha_ij^h vt_j^h + b_O``
(`contribution_lens.adapter.Readout.attention_update`; with a norm after the attention, as in Gemma,
every term goes through that norm's linear part with its scale frozen at position ``i``, and its
bias joins ``b_O``). With ``r_i = x_i + a_i`` (the residual stream after attention), each part is
projected on ``r_i`` -- the contribution rule applied to the whole residual sum:

    w_ij^h = <r_i, alpha_ij^h vt_j^h> / ||r_i||^2
           = alpha_ij^h * (||vt_j^h|| / ||r_i||) * cos(r_i, vt_j^h)
    rho_i  = <r_i, x_i + b_O> / ||r_i||^2                      (the residual term)
    M_ij   = sum_h w_ij^h + [i == j] rho_i,                    sum_j M_ij = 1

``M`` (``[batch query key]``) is the layer's signed token mixing. ``b_O`` (and a post-norm's
bias) belong to no token: they are counted in the position's own residual term, like the MLP.
`layer_mixing` computes it from one layer's hooks without ever building ``[batch head query key]``
for more than a few heads at a time; `contribution_lens.flow` keeps it per layer and
`contribution_lens.methods.rollout` composes it across layers.

It is core, beside `contribution_lens.decomposition.decompose_layer`: an analysis (`flow`), a
method (``flow``) and the explaining pass all read it.

Example (every row of a layer's mixing sums to 1):
    >>> import contribution_lens as cl
    >>> from contribution_lens import adapter
    >>> model = cl.load_model()
    >>> readout = adapter.readout(model)
    >>> def rows(layer):
    ...     return layer_mixing(layer, readout.attention_update(layer)).mixing.sum(-1)
    >>> sums = cl.map_layers(model, "The cat sat.", rows, layers=[3], capture=list(readout.flow_capture))
    >>> bool((sums[3] - 1).abs().max() < 1e-4)
    True
"""

import itertools
from dataclasses import dataclass

import einops
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from contribution_lens import adapter
from contribution_lens.decomposition import head_gram


@dataclass(frozen=True)
class StrongParts:
    """The parts ``w_ij^h`` of one layer with ``|w| >= threshold``, in (batch, head, query, key) order."""

    batch: Int[Tensor, " part"]
    head: Int[Tensor, " part"]
    query: Int[Tensor, " part"]
    key: Int[Tensor, " part"]
    weight: Float[Tensor, " part"]


@dataclass(frozen=True)
class LayerMixing:
    """One layer's signed mixing of the residual stream (see the module docstring), float32.

    ``mixing[b, i, j]`` is ``M_ij`` (rows of padding queries are those of the identity),
    ``residual[b, i]`` is ``rho_i``; ``value_norm`` is ``||vt_j^h||`` after the post-attention
    norm's gain (before its ``1/scale_i``) and ``stream_norm`` ``||r_i||``; ``strong`` the parts
    ``w_ij^h`` above a threshold (``value_norm`` and ``strong`` only where they were asked for).
    The per-head ``w_ij^h`` themselves are never kept: ``[batch head query key]`` for every layer
    is what `layer_mixing` avoids.
    """

    mixing: Float[Tensor, "batch query key"]
    residual: Float[Tensor, "batch query"]
    valid: Bool[Tensor, "batch query key"]
    stream_norm: Float[Tensor, "batch query"]
    value_norm: Float[Tensor, "batch head key"] | None = None
    scale: Float[Tensor, "batch query"] | None = None
    """The post-attention norm's scale (the parts are divided by it), None without one."""
    strong: StrongParts | None = None

    def relative_norm(self, batch: Tensor, head: Tensor, query: Tensor, key: Tensor) -> Tensor:
        """``||vt_j^h|| / ||r_i||`` (post-norm included) at the given index tensors."""
        if self.value_norm is None:
            raise ValueError("this mixing was computed without factors (factors=False)")
        norm = self.value_norm[batch, head, key]
        if self.scale is not None:
            norm = norm / self.scale[batch, query]
        stream = self.stream_norm[batch, query]
        return torch.where(stream > 0, norm / stream.clamp_min(torch.finfo(stream.dtype).tiny), 0)


def layer_mixing(
    layer: adapter.LayerInputs,
    update: adapter.AttentionUpdate,
    *,
    factors: bool = False,
    threshold: float | None = None,
) -> LayerMixing:
    """`LayerMixing` of one layer from its hooks; ``factors`` adds the value norms, ``threshold`` the strong parts.

    ``w_ij^h = alpha_ij^h <r_i W_O^h^T / ||r_i||^2, v_j^h>`` (through the norm:
    ``<r_i, D_i vt> = <D_i^T r_i, vt>``): the row scale is folded into the read, and the weights
    are built a few heads at a time (`_HEAD_CHUNK`; a causal pattern in tiles of queries without
    the keys they cannot see, `_TILE`), summed into ``M`` and searched for parts
    ``|w| >= threshold`` while in cache; nothing as large as ``[batch head query key]`` is built.
    """
    acc = torch.promote_types(layer.pattern.dtype, torch.float32)
    valid = layer.valid
    W_O = layer.W_O.to(acc)
    x, added = update.resid_pre.to(acc), update.added.to(acc)
    stream = x + added
    squared = (stream * stream).sum(-1)
    inverse = torch.where(squared > 0, 1 / squared.clamp_min(torch.finfo(acc).tiny), 0)
    scale = None if update.scale is None else update.scale.to(acc)
    direction = stream if update.norm is None else update.norm.pull_back(stream, scale)  # type: ignore[arg-type]
    read = einops.einsum(
        direction * inverse[..., None], W_O, "batch query d_model, head d_head d_model -> batch head query d_head"
    )
    v = layer.v.to(acc)
    mixing, strong = _head_sum(layer, read, v, valid, threshold)
    heads = _heads_sum(layer, W_O, acc)
    if update.norm is not None:
        heads = update.norm.linear(heads, scale)
    # What is not a token's part: the stream itself plus the biases (the stream minus the heads).
    residual = (stream * (stream - heads)).sum(-1) * inverse
    # A padding query sees nothing: its row is that of the identity (without padding every query sees itself).
    real = None if layer.padding_mask is None else valid.any(-1)
    torch.diagonal(mixing, dim1=-2, dim2=-1).add_(residual if real is None else torch.where(real, residual, 1.0))
    value_norm = _value_norm(v, W_O, update.norm) if factors else None
    return LayerMixing(mixing, residual, valid, squared.sqrt(), value_norm, scale, strong)


_HEAD_CHUNK = 1 << 20
"""Elements of per-head weights ``w_ij^h`` built at once (4 MB in float32): as many heads of a tile as fit."""


def _head_sum(
    layer: adapter.LayerInputs,
    read: Float[Tensor, "batch head query d_head"],
    v: Float[Tensor, "batch key kv_head d_head"],
    valid: Bool[Tensor, "batch query key"],
    threshold: float | None,
) -> tuple[Float[Tensor, "batch query key"], StrongParts | None]:
    """``sum_h w_ij^h`` and the parts with ``|w| >= threshold``, zero (and none) where the key is not visible.

    Visibility is applied once, to the sum and to the parts found: what a query cannot see has
    pattern 0, or, in a padding query's row, whatever the model left there.
    """
    batch, n_heads, n_query, n_key = layer.pattern.shape
    # One copy of the values per query head (GQA) for the layer: every chunk is then a view.
    values = einops.rearrange(v, "batch key kv_head d_head -> batch kv_head d_head key")
    values = values.repeat_interleave(n_heads // v.shape[2], dim=1)
    lower = layer.causal and layer.padding_mask is None and n_query == n_key
    mixing = torch.zeros((batch, n_query, n_key), dtype=read.dtype, device=read.device)
    found: list[tuple[Tensor, ...]] = []
    for rows, keys in _tiles(n_query, n_key, lower):
        step = max(1, _HEAD_CHUNK // (batch * (rows.stop - rows.start) * keys.stop))
        for start in range(0, n_heads, step):
            heads = slice(start, min(start + step, n_heads))
            w = torch.matmul(read[:, heads, rows], values[:, heads, :, keys])
            w.mul_(layer.pattern[:, heads, rows, keys])
            mixing[:, rows, keys].add_(w.sum(1) if w.shape[1] > 1 else w[:, 0])
            if threshold is not None:
                found.append(_strong(w, start, rows.start, threshold))
    if lower:
        mixing.tril_()  # several times faster than a boolean fill
    else:
        mixing.masked_fill_(~valid, 0)
    if threshold is None:
        return mixing, None
    b, h, q, k, weight = (torch.cat(column) for column in zip(*found, strict=True))
    seen = valid[b, q, k].nonzero()[:, 0]
    seen = seen[torch.argsort((((b * n_heads + h) * n_query + q) * n_key + k)[seen])]  # tiles and chunks: sorted
    return mixing, StrongParts(b[seen], h[seen], q[seen], k[seen], weight[seen])


_TILE = 128
"""Queries per tile of a causal square pattern: the tile of queries ``a..b`` needs the keys ``0..b`` only
(at 1,024 tokens eight tiles hold 56% of the square; fastest on a 2-core CPU of 4 MB L2 among 64-512)."""


def _tiles(n_query: int, n_key: int, lower: bool) -> list[tuple[slice, slice]]:
    """``(queries, keys)`` blocks covering every visible key (causal, square: each block's keys end where it ends)."""
    if not lower:
        return [(slice(0, n_query), slice(0, n_key))]
    count = max(1, round(n_query / _TILE))
    bounds = [n_query * i // count for i in range(count + 1)]
    return [(slice(a, b), slice(0, b)) for a, b in itertools.pairwise(bounds)]


def _strong(
    w: Float[Tensor, "batch head query key"], head: int, query: int, threshold: float
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(batch, head, query, key, weight)`` of every ``|w| >= threshold`` (``w`` starting at ``head`` and ``query``).

    Strong parts are few: the rows that hold one are found by two reductions, then only they are searched.
    """
    rows = (w.amax(-1) >= threshold) | (w.amin(-1) <= -threshold)
    b, h, q = rows.nonzero(as_tuple=True)
    candidates = w[b, h, q]
    row, key = (candidates.abs() >= threshold).nonzero(as_tuple=True)
    return b[row], h[row] + head, q[row] + query, key, candidates[row, key]


def _heads_sum(
    layer: adapter.LayerInputs, W_O: Float[Tensor, "head d_head d_model"], acc: torch.dtype
) -> Float[Tensor, "batch query d_model"]:
    """``sum_h z^h W_O^h``: off ``hook_out`` where that is at least float32, else from `LayerInputs.head_outputs`."""
    output = layer.output_without_bias()
    if output is not None:
        return output.to(acc)
    return einops.einsum(
        layer.head_outputs(acc), W_O, "batch query head d_head, head d_head d_model -> batch query d_model"
    )


def _value_norm(
    v: Float[Tensor, "batch key kv_head d_head"],
    W_O: Float[Tensor, "head d_head d_model"],
    norm: adapter.Norm | None,
) -> Float[Tensor, "batch head key"]:
    """``||vt_j^h||`` (through the post-norm's gain) as ``sqrt(v G^h v)``, ``G^h`` the Gram matrix of ``W_O^h``."""
    gram = head_gram(W_O if norm is None else norm.linear(W_O, None))
    grouped = einops.rearrange(gram, "(kv_head group) d_head e_head -> kv_head group d_head e_head", kv_head=v.shape[2])
    v_gram = einops.einsum(
        v, grouped, "batch key kv_head d_head, kv_head group d_head e_head -> batch kv_head group key e_head"
    )
    squared = einops.einsum(
        v_gram, v, "batch kv_head group key e_head, batch key kv_head e_head -> batch kv_head group key"
    )
    return einops.rearrange(squared.clamp_min(0).sqrt(), "batch kv_head group key -> batch (kv_head group) key")
