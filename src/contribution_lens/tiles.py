"""Attention a tile of queries at a time: the pattern recomputed from queries and keys, never whole.

A layer's pattern ``alpha = softmax(mask(cap(scale q k^T)))`` is ``[batch head query key]``: 38 GB in
float32 for SmolLM2's 9 heads at 32,768 tokens. Every analysis of a layer reads it one query at a
time (a row's weights need that row, the values and the query's own output), so it can be read a
**tile** of queries at a time (`Tile`: rows ``start .. stop - 1`` and, under causal attention, only
the keys up to the last of them): from the model's pattern where it exists, or recomputed from ``q``
and ``k`` (`QueryKeys.pattern`), as memory-efficient attention kernels recompute it. `query_tiles`
lays tiles out within a byte budget (`TILE_BYTES`, small enough to stay in the cache), and `attend`
runs attention itself that way, for a forward pass that never holds a pattern.

Nothing here knows TransformerLens: `contribution_lens.adapter` reads ``q``, ``k``, the scale, the
soft-cap and the masks of each layer.

    >>> import torch
    >>> q, k = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8)  # GQA: 2 kv heads for 4 query heads
    >>> qk = QueryKeys(q, k, scale=8**-0.5)
    >>> future = torch.ones(6, 6, dtype=torch.bool).triu(1)
    >>> whole = torch.softmax((q @ k.repeat_interleave(2, 1).mT * 8**-0.5).masked_fill(future, -torch.inf), -1)
    >>> tiles = query_tiles(6, 6, heads=4, causal=True, budget=256, min_rows=1)
    >>> [(t.start, t.stop, t.keys) for t in tiles]
    [(0, 1, 1), (1, 2, 2), (2, 3, 3), (3, 4, 4), (4, 5, 5), (5, 6, 6)]
    >>> all(torch.allclose(qk.pattern(t), whole[:, :, t.start : t.stop, : t.keys]) for t in tiles)
    True
"""

import math
from dataclasses import dataclass

import einops
import torch
from jaxtyping import Bool, Float
from torch import Tensor

TILE_BYTES = 8 << 20
"""The bytes of one pattern-sized tensor of a tile (``[batch head row key]`` in float32): a tile's tensors
stay in the cache, where whole patterns at 2,048 tokens (151 MB a layer for SmolLM2) do not."""
CAUSAL_TILES = 8
"""At least this many tiles a causal layer (of `MIN_ROWS` rows at least): a tile reads the keys up to its last
query, so the keys after each query that it still reads come to ``1 / (2 CAUSAL_TILES)`` of the triangle."""
MIN_ROWS = 16
"""Rows a tile holds at least (past the budget where keys are many: 16 rows of 32,768 keys and 9 heads are 19 MB),
so that its products stay wide enough to run fast."""


@dataclass(frozen=True)
class Tile:
    """Queries ``start .. stop - 1`` and the keys ``0 .. keys - 1`` they may see (``stop`` under causal attention)."""

    start: int
    stop: int
    keys: int

    @property
    def rows(self) -> int:
        return self.stop - self.start

    @property
    def queries(self) -> slice:
        return slice(self.start, self.stop)


def query_tiles(
    n_query: int,
    n_key: int,
    *,
    heads: int,
    batch: int = 1,
    causal: bool,
    budget: int = TILE_BYTES,
    itemsize: int = 4,
    min_rows: int | None = None,
) -> list[Tile]:
    """Tiles covering queries ``0 .. n_query - 1`` of ``n_key`` keys, each ``[batch heads rows keys]`` in ``budget``.

    Queries are the last ``n_query`` of the keys (as in `contribution_lens.decomposition.valid_positions`).
    Under causal attention a tile reads the keys up to its last query only (about half the work of the
    whole pattern, in `CAUSAL_TILES` tiles at least), so early tiles may hold more rows; every tile has
    ``min_rows`` at least (default `MIN_ROWS`; or what is left).

    Example:
        >>> [(t.start, t.stop, t.keys) for t in query_tiles(4, 4, heads=1, causal=True, budget=16, min_rows=1)]
        [(0, 1, 1), (1, 2, 2), (2, 3, 3), (3, 4, 4)]
    """
    cells = max(1, budget // max(1, batch * heads * itemsize))
    offset, tiles, start = n_key - n_query, [], 0
    least = MIN_ROWS if min_rows is None else min_rows
    most = max(least, -(-n_query // CAUSAL_TILES))
    while start < n_query:
        if causal:
            seen = offset + start  # keys before the tile's first query: rows * (seen + rows) <= cells
            rows = min(most, max(least, int((math.sqrt(seen * seen + 4 * cells) - seen) // 2)))
        else:
            rows = max(least, cells // n_key)
        stop = min(n_query, start + max(1, rows))
        tiles.append(Tile(start, stop, offset + stop if causal else n_key))
        start = stop
    return tiles


@dataclass(frozen=True, eq=False)
class QueryKeys:
    """One layer's queries and keys as they enter ``q k^T``, and how its scores become its pattern.

    ``alpha_ij = softmax_j(mask_ij(cap(scale <q_i, k_j>)))`` with ``cap(s) = c tanh(s / c)`` where the
    model soft-caps its scores (``softcap`` ``c``; Gemma 2); key ``j`` is hidden from query ``i`` after it
    (``causal``), at or before ``i - window`` (a sliding window, as Gemma 3's local layers) and at padding
    (``attention_mask`` False). Query head ``h`` reads key head ``h // (head / kv_head)`` (GQA). The
    softmax runs in float32 and the pattern is cast to ``dtype`` (the model's), as the model computes it,
    so a recomputed row is the model's row (`contribution_lens.adapter` checks it on every model).
    """

    q: Float[Tensor, "batch head query d_head"]
    k: Float[Tensor, "batch kv_head key d_head"]
    scale: float
    softcap: float | None = None
    causal: bool = True
    window: int | None = None
    attention_mask: Bool[Tensor, "batch key"] | None = None
    dtype: torch.dtype | None = None
    """The pattern's dtype (None: the dtype of ``q``)."""

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The pattern's ``(batch, head, query, key)``: queries are the last of the keys."""
        batch, heads, n_query, _ = self.q.shape
        return batch, heads, n_query, self.k.shape[2]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.k))

    def tiles(self, budget: int = TILE_BYTES, min_rows: int | None = None) -> list[Tile]:
        """`query_tiles` of this layer."""
        batch, heads, n_query, n_key = self.shape
        return query_tiles(
            n_query, n_key, heads=heads, batch=batch, causal=self.causal, budget=budget, min_rows=min_rows
        )

    def visible(self, tile: Tile) -> Bool[Tensor, "batch row key"]:
        """Which of the tile's keys each of its queries sees (causal, window, padding)."""
        batch, _, n_query, n_key = self.shape
        first = n_key - n_query + tile.start
        rows = torch.arange(first, first + tile.rows, device=self.q.device)[:, None]
        keys = torch.arange(tile.keys, device=self.q.device)[None, :]
        seen = keys <= rows if self.causal else torch.ones(tile.rows, tile.keys, dtype=torch.bool, device=rows.device)
        if self.window is not None:
            seen = seen & (keys > rows - self.window)
        seen = einops.repeat(seen, "row key -> batch row key", batch=batch)
        if self.attention_mask is not None:
            seen = seen & self.attention_mask[:, None, : tile.keys].to(device=seen.device, dtype=torch.bool)
        return seen

    def scores(self, tile: Tile) -> Float[Tensor, "batch head row key"]:
        """``cap(scale <q_i, k_j>)`` for the tile's queries and keys (hidden keys included, unmasked)."""
        n_kv = self.k.shape[1]
        q = einops.rearrange(self.q[:, :, tile.queries], "b (kv g) r d -> b kv (g r) d", kv=n_kv)
        scores = torch.matmul(q, self.k[:, :, : tile.keys].transpose(-1, -2)) * self.scale
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        return einops.rearrange(scores, "b kv (g r) key -> b (kv g) r key", r=tile.rows)

    def pattern(self, tile: Tile) -> Float[Tensor, "batch head row key"]:
        """The tile's rows of the pattern over its keys (0 at hidden keys; a row of 0 where a query sees nothing)."""
        seen = self.visible(tile)[:, None]
        scores = self.scores(tile).masked_fill_(~seen, -torch.inf)
        pattern = torch.softmax(scores, dim=-1, dtype=torch.float32).to(self.dtype or self.q.dtype)
        if self.attention_mask is not None or self.window is not None:
            pattern = pattern.nan_to_num_(0.0)  # a row with no visible key is all NaN after the softmax
        return pattern


def attend(
    qk: QueryKeys, v: Float[Tensor, "batch kv_head key d_head"], *, budget: int = TILE_BYTES
) -> Float[Tensor, "batch query head d_head"]:
    """``z_i^h = sum_j alpha_ij^h v_j^h`` a tile of queries at a time: attention that never holds the pattern.

    The pattern of each tile (`QueryKeys.pattern`) times the values, in the pattern's dtype as the model
    multiplies them; the result is ``[batch query head d_head]`` (``hook_z``'s layout). Where the form
    is plain (no soft-cap, window or padding), torch's own memory-efficient kernel
    (``scaled_dot_product_attention``), which tiles the same way and skips the keys after each tile
    under causal attention: about twice as fast (1.7x to 2.2x on a layer of SmolLM2's shape at 4,096 tokens,
    one thread, load 5), equal to 1e-6.

    Example:
        >>> q, k, v = torch.randn(1, 2, 5, 4), torch.randn(1, 1, 5, 4), torch.randn(1, 1, 5, 4)
        >>> qk = QueryKeys(q, k, scale=0.5)
        >>> (whole,) = qk.tiles(budget=1 << 20)  # one tile: every query, every key
        >>> torch.allclose(attend(qk, v, budget=16), (qk.pattern(whole) @ v).transpose(1, 2))
        True
    """
    batch, heads, n_query, n_key = qk.shape
    n_kv = v.shape[1]
    if qk.softcap is None and qk.window is None and qk.attention_mask is None and n_query == n_key:
        z = torch.nn.functional.scaled_dot_product_attention(
            qk.q, qk.k, v.to(qk.q.dtype), is_causal=qk.causal, scale=qk.scale, enable_gqa=n_kv != heads
        )
        return z.transpose(1, 2).to(v.dtype)
    out = v.new_empty(batch, n_query, heads, v.shape[-1])
    for tile in qk.tiles(budget):
        alpha = einops.rearrange(qk.pattern(tile), "b (kv g) r key -> b kv (g r) key", kv=n_kv)
        z = torch.matmul(alpha.to(v.dtype), v[:, :, : tile.keys])
        out[:, tile.queries] = einops.rearrange(z, "b kv (g r) d -> b r (kv g) d", r=tile.rows)
    return out
