"""Why a head attends: every pre-softmax score of one head split exactly over upstream components.

Layer ``l``, head ``h``, query ``i``, key ``j``: ``s_ij = scale <q_i, k_j>`` (the maths:
`contribution_lens.qk`). The residual stream entering layer ``l`` is ``x = sum_c x^c`` over the
components ``embed``, ``pos_embed`` (learned positions), ``L{m}H{h}`` (head ``h`` of layer ``m``,
``z^h W_O^h``), ``L{m}.mlp``, and the biases under their parameters' names (``L{m}.b_O``,
``L{l}.ln1.b``, ``b_Q``, ``b_K``, ...). With every norm's scale frozen at its value in this pass
and the rotary embedding applied to each component's projection,

    s_ij = scale sum_a sum_b <q_i^a, k_j^b>          K_ij^b = scale <q_i, k_j^b>    Q_ij^a = scale <q_i^a, k_j>
    A_ij^b = K_ij^b - sum_k alpha_ik K_ik^b          sum_b A_ij^b = log alpha_ij + H(alpha_i)

Each component is projected into the head's query and key space as the pass produces it
(``d_head`` numbers per component and position; ``[component position d_model]`` is never kept):
per layer the only large intermediate is the heads' ``[head pos n]`` projection.

Exact, checked on every call: the scores rebuilt from the terms equal the model's own pre-softmax
scores (``hook_attn_scores``) and their softmax its pattern (``hook_pattern``) to 1e-4 relative,
else the call raises naming the architecture. Where the model soft-caps its scores (Gemma 2:
``c tanh(s / c)``) the terms add up to the score *before* the cap (``softcap``), so the advantages
add up to ``s_ij - sum_k alpha_ik s_ik``, not to ``log alpha_ij + H``. Frozen: a term is what the
score would lose if that component were removed *with every norm's scale kept*, not an ablation.
Under rotary embeddings no component holds the position: the rotation acts on every component's
query and key, so position shows only in how each component's terms change with the key.

    >>> import contribution_lens as cl
    >>> model = cl.load_model()
    >>> result = cl.qk_attribution(model, "The cat sat on the mat. The cat", layer=3, head=0)
    >>> table = result.key_side  # components x keys of the last query
    >>> bool(((table.sum() - result.scores).abs() < 1e-3 * result.scores.abs().max()).all())
    True
"""

import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import einops
import pandas as pd
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from contribution_lens import adapter, qk
from contribution_lens.choices import as_index, as_indices, as_position
from contribution_lens.decomposition import accumulation_dtype
from contribution_lens.engine import map_layers
from contribution_lens.files import Saves
from contribution_lens.qk import component_layer_head

TOLERANCE = 1e-4
"""Relative gap between the rebuilt scores (and their softmax) and the model's above which a call fails."""
HALF_TOLERANCE = 3e-2
"""The same for a model in float16 or bfloat16, whose own scores are rounded to 8 or 11 bits."""
SIDES = ("key", "query")


@dataclass(frozen=True)
class QKCell:
    """The split of one score ``s_ij`` of one head: what the *why* of a single (query, key) needs.

    ``key_side``/``query_side`` are the advantages ``A_ij`` per component (pandas, indexed by
    component); each sums to ``total``, which equals ``log_alpha_plus_entropy`` (without a soft-cap).
    """

    head: int
    query: int
    key: int
    alpha: float
    score: float
    log_alpha_plus_entropy: float
    key_side: pd.Series
    query_side: pd.Series

    @property
    def total(self) -> float:
        return float(self.key_side.sum())

    def __repr__(self) -> str:
        def largest(series: pd.Series) -> str:
            name = series.abs().idxmax()
            return f"{name} {series[name]:+.3g}"

        return (
            f"QKCell(head={self.head}, query={self.query}, key={self.key}, alpha={self.alpha:.3g}, "
            f"total={self.total:.4g}, log_alpha_plus_entropy={self.log_alpha_plus_entropy:.4g}, "
            f"largest key side: {largest(self.key_side)}, query side: {largest(self.query_side)})"
        )


@dataclass(frozen=True, eq=False)
class _QKParts:
    """The fields of a `QKAttribution` (described there) and what every view of it is computed from: the fields'
    checks, which heads, queries and keys a call selects, the rotation applied on demand, the raw terms."""

    tokens: Int[Tensor, " pos"]
    str_tokens: list[str]
    layer: int
    heads: tuple[int, ...]
    queries: tuple[int, ...]
    query_components: tuple[str, ...]
    key_components: tuple[str, ...]
    query_parts: Float[Tensor, "q_component query head d_head"]
    key_parts: Float[Tensor, "k_component key kv_head d_head"]
    kv_index: tuple[int, ...]
    """For each of `heads`, its column of ``key_parts`` (query heads share key heads under GQA)."""
    pattern: Float[Tensor, "head query key"]
    """The model's own attention weights ``alpha`` (``hook_pattern``) at `queries`."""
    visible: Bool[Tensor, "query key"]
    """Whether each query sees each key (causal mask, sliding window)."""
    cos: Float[Tensor, "key rotary"] | None = None
    sin: Float[Tensor, "key rotary"] | None = None
    rotary_adjacent: bool = False
    """The rotation turns dims ``(0, 1), (2, 3), ...`` together rather than the two halves (see `qk.rotate`)."""
    softcap: float | None = None
    """Where the model soft-caps its scores (``c tanh(s / c)``, Gemma 2), ``c``: the terms add up to ``s``."""
    architecture: str = ""
    _cache: dict[Any, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        n_heads, n_queries, n_keys = len(self.heads), len(self.queries), self.key_parts.shape[1]
        expected = {
            "query_parts": (len(self.query_components), n_queries, n_heads),
            "key_parts": (len(self.key_components), n_keys, max(self.kv_index, default=-1) + 1),
            "pattern": (n_heads, n_queries, n_keys),
            "visible": (n_queries, n_keys),
        }
        for name, shape in expected.items():
            got = tuple(getattr(self, name).shape)[: len(shape)]
            if got != shape:
                raise ValueError(f"{name} has shape {tuple(getattr(self, name).shape)}, expected {shape}[...]")
        if len(self.kv_index) != n_heads or self.tokens.shape != (len(self.str_tokens),):
            raise ValueError(f"{len(self.kv_index)} key heads for {n_heads} heads; {len(self.str_tokens)} labels")
        if n_keys > len(self.str_tokens) or any(not 0 <= i < n_keys for i in self.queries):
            raise ValueError(f"queries {self.queries} or {n_keys} keys do not fit the {len(self.str_tokens)} tokens")
        if (self.cos is None) != (self.sin is None) or (self.cos is not None and self.cos.shape[0] != n_keys):
            raise ValueError(f"cos and sin must both be [key rotary] with {n_keys} keys, or both None")

    # --- selection -------------------------------------------------------------------------

    @property
    def n_keys(self) -> int:
        """How many key positions the terms cover (``0..max(queries)`` in a decoder, every position in an encoder)."""
        return int(self.key_parts.shape[1])

    def _heads(self, head: int | Sequence[int] | None) -> list[int]:
        if head is None:
            return list(range(len(self.heads)))
        chosen = []
        for item in as_indices(head, "heads"):
            if item not in self.heads:
                raise ValueError(f"head {item} was not computed; this result holds heads {list(self.heads)}")
            chosen.append(self.heads.index(item))
        return chosen

    def _queries(self, query: int | Sequence[int] | None) -> list[int]:
        if query is None:
            return list(range(len(self.queries)))
        chosen = []
        for item in as_indices(query, "queries"):
            position = as_position(item, len(self.str_tokens))
            if position not in self.queries:
                raise ValueError(f"query {item} was not computed; this result holds queries {_span(self.queries)}")
            chosen.append(self.queries.index(position))
        return chosen

    def _key(self, key: Any, query_row: int) -> int:
        position = as_position(key, len(self.str_tokens))
        query = self.queries[query_row]
        if position >= self.n_keys or not bool(self.visible[query_row, position]):
            after = " (a decoder's query sees the keys up to itself)" if position > query else ""
            raise ValueError(f"key {key} is not seen by query {query}{after}")
        return position

    def _visible_keys(self, query_row: int) -> list[int]:
        return torch.nonzero(self.visible[query_row]).flatten().tolist()

    def _one_head(self, head: int | None) -> int:
        if head is None and len(self.heads) > 1:
            raise ValueError(f"this result holds heads {list(self.heads)}: pass head=")
        return self._heads(head)[0]

    def _one_query(self, query: int | None) -> int:
        if query is None and len(self.queries) > 1:
            raise ValueError(f"this result holds {len(self.queries)} queries: pass query=")
        return self._queries(query)[0]

    def _shaped(self, tensor: Tensor, heads: list[int], queries: list[int]) -> Tensor:
        """Drop the head axis for one head and the query axis for one query (``tensor`` is ``[head query ...]``)."""
        if len(queries) == 1:
            tensor = tensor[:, 0]
        return tensor[0] if len(heads) == 1 else tensor

    # --- the rotation, applied on demand -----------------------------------------------------

    def _turn(self, x: Tensor, positions: Any, *, back: bool = False) -> Tensor:
        """``R_p x`` (``back``: ``R_p^T x``) with one position per entry of ``x``'s second-last axis."""
        if self.cos is None or self.sin is None:
            return x
        cos, sin = self.cos[positions], self.sin[positions]
        return qk.rotate(x, cos, -sin if back else sin, adjacent=self.rotary_adjacent)

    def _q(self) -> Float[Tensor, "query head d_head"]:
        """The full (rotated, scaled) queries ``q_i = R_i sum_a q_i^a`` (and the keys likewise, cached)."""
        if "q" not in self._cache:
            rows = list(self.queries)
            queries, keys = self.query_parts.sum(0), self.key_parts.sum(0)  # [query head d_head], [key kv_head d_head]
            if self.cos is not None and self.sin is not None:
                queries = self._turn(queries, torch.tensor(rows)[:, None])
                keys = self._turn(keys, torch.arange(self.n_keys)[:, None])
            self._cache["q"], self._cache["k"] = queries, keys
        return self._cache["q"]

    def _k(self, h: int) -> Float[Tensor, "key d_head"]:
        self._q()
        return self._cache["k"][:, self.kv_index[h]]

    def _scores(self, heads: list[int], queries: list[int]) -> Float[Tensor, "head query key"]:
        q = self._q()
        scores = torch.stack([q[queries, h] @ self._k(h).T for h in heads])
        return scores.masked_fill(~self.visible[queries], -torch.inf)

    # --- the raw terms --------------------------------------------------------------------------

    def _key_terms(self, h: int, queries: list[int]) -> Float[Tensor, "query component key"]:
        """``K_ij^b = <q_i, R_j k_j^b> = <R_j^T q_i, k_j^b>``: each query turned back by every key's angle."""
        q = self._q()[queries, h]  # [query d_head]
        parts = self.key_parts[:, :, self.kv_index[h]]  # [component key d_head]
        if self.cos is None:
            return qk.key_side(q, parts)
        turned = self._turn(q[:, None, :].expand(-1, self.n_keys, -1), slice(None), back=True)
        return einops.einsum(turned, parts, "query key d_head, component key d_head -> query component key")

    def _query_terms(self, h: int, queries: list[int]) -> Float[Tensor, "query component key"]:
        """``Q_ij^a = <R_i q_i^a, k_j> = <q_i^a, R_i^T k_j>``: every key turned back by each query's angle."""
        parts = self.query_parts[:, queries, h]  # [component query d_head]
        k = self._k(h)
        if self.cos is None:
            return qk.query_side(parts, k)
        positions = [self.queries[i] for i in queries]
        turned = self._turn(k[None].expand(len(queries), -1, -1), torch.tensor(positions)[:, None], back=True)
        return einops.einsum(parts, turned, "component query d_head, query key d_head -> query component key")

    def terms(
        self, side: str = "key", head: int | Sequence[int] | None = None, query: int | Sequence[int] | None = None
    ) -> Float[Tensor, "head query component key"]:
        """``K_ij^b`` (``side="key"``) or ``Q_ij^a`` (``"query"``), ``[head query component key]``, 0 at unseen keys."""
        side = _side(side)
        heads, queries = self._heads(head), self._queries(query)
        compute = self._key_terms if side == "key" else self._query_terms
        hidden = ~self.visible[queries][:, None, :]
        return torch.stack([compute(h, queries).masked_fill(hidden, 0.0) for h in heads])


@dataclass(frozen=True, eq=False)
class QKAttribution(_QKParts, Saves):
    """One layer's pre-softmax scores, for some heads and queries, split over upstream components.

    ``query_parts[a, i, h]`` is ``scale q_i^a`` of head ``heads[h]`` at query ``queries[i]`` and
    ``key_parts[b, j, kv_index[h]]`` is ``k_j^b`` at key ``j``, each with every norm applied at its
    frozen scale and *before* the rotary embedding: the rotation ``R`` (angles ``cos``/``sin`` per
    position, None without rotary) is applied when a term is asked for, ``<R_i q^a, R_j k^b> =
    <q^a, R_i^T R_j k^b>``, so no ``[component position]`` tensor is rotated at all. Everything is
    computed from the parts on demand: `scores`, `key_side`, `query_side`, `advantage`, `pairs`,
    `cell`. A table for one head and one query is pandas; several give tensors with a leading head
    axis (when several heads) and query axis (when several queries).
    """

    # --- views: the scores, the terms and their advantages as tables -------------------------

    def score_table(self, head: int | None = None, query: int | Sequence[int] | None = None) -> Any:
        """The rebuilt pre-softmax scores (before any soft-cap): `scores` for a chosen head and query."""
        heads, queries = self._heads(head), self._queries(query)
        scores = self._scores(heads, queries)
        if len(heads) == 1 and len(queries) == 1:
            keys = self._visible_keys(queries[0])
            return pd.Series(scores[0, 0, keys].double().numpy(), index=pd.Index(keys, name="key"), name="score")
        return self._shaped(scores, heads, queries)

    @property
    def scores(self) -> Any:
        """``s_ij`` rebuilt from the terms (masked keys ``-inf``): a Series over keys for one head and query."""
        return self.score_table()

    def _table(self, values: Tensor, side: str, heads: list[int], queries: list[int]) -> Any:
        if len(heads) == 1 and len(queries) == 1:
            keys = self._visible_keys(queries[0])
            names = self.key_components if side == "key" else self.query_components
            table = pd.DataFrame(
                values[0, 0][:, keys].double().numpy(), index=pd.Index(names, name="component"), columns=keys
            )
            table.columns.name = "key"
            return table
        return self._shaped(values, heads, queries)

    @property
    def key_side(self) -> Any:
        """``K_ij^b = scale <q_i, k_j^b>``: components x keys (pandas) for one head and query, else `terms`."""
        heads, queries = self._heads(None), self._queries(None)
        return self._table(self.terms("key"), "key", heads, queries)

    @property
    def query_side(self) -> Any:
        """``Q_ij^a = scale <q_i^a, k_j>``, shaped as `key_side`; each column sums to the score."""
        heads, queries = self._heads(None), self._queries(None)
        return self._table(self.terms("query"), "query", heads, queries)

    def advantage(
        self, side: str = "key", head: int | Sequence[int] | None = None, query: int | Sequence[int] | None = None
    ) -> Any:
        """``A_ij^c = T_ij^c - sum_k alpha_ik T_ik^c``: summed over components, ``log alpha_ij + H(alpha_i)``.

        ``side`` is ``"key"`` or ``"query"``; shaped as `key_side` (pandas for one head and query).
        """
        side = _side(side)
        heads, queries = self._heads(head), self._queries(query)
        terms = self.terms(side, [self.heads[h] for h in heads], [self.queries[i] for i in queries])
        visible = self.visible[queries]
        values = torch.stack([qk.advantage(terms[n], self.pattern[h, queries], visible) for n, h in enumerate(heads)])
        return self._table(values, side, heads, queries)

    def log_alpha_plus_entropy(self, head: int | None = None, query: int | Sequence[int] | None = None) -> Any:
        """``log alpha_ij + H(alpha_i)`` from the model's pattern: what each key's advantages add up to."""
        heads, queries = self._heads(head), self._queries(query)
        values = torch.stack(
            [qk.log_alpha_plus_entropy(self.pattern[h, queries], self.visible[queries]) for h in heads]
        )
        if len(heads) == 1 and len(queries) == 1:
            keys = self._visible_keys(queries[0])
            return pd.Series(values[0, 0, keys].numpy(), index=pd.Index(keys, name="key"), name="log_alpha_plus_H")
        return self._shaped(values, heads, queries)

    def pairs(self, key: int, query: int | None = None, head: int | None = None) -> pd.DataFrame:
        """Every ``scale <q_i^a, k_j^b>``: query components (rows) x key components (columns); the sum is ``s_ij``.

        ``query`` and ``head`` may be left out where the result holds one.
        """
        h, i = self._one_head(head), self._one_query(query)
        j = self._key(key, i)
        query_parts = self._turn(self.query_parts[:, i, h], self.queries[i])
        key_parts = self._turn(self.key_parts[:, j, self.kv_index[h]], j)
        return pd.DataFrame(
            qk.pair_terms(query_parts, key_parts).double().numpy(),
            index=pd.Index(self.query_components, name="query component"),
            columns=pd.Index(self.key_components, name="key component"),
        )

    def cell(self, query: int | None = None, key: int | None = None, head: int | None = None) -> QKCell:
        """Both sides' advantages of one score, computed for that cell alone (cheap: what the inspector calls).

        ``key`` None: the key the head attends to most from this query.
        """
        h, i = self._one_head(head), self._one_query(query)
        seen = self.visible[i]
        alpha = self.pattern[h, i].masked_fill(~seen, 0.0)
        j = int(alpha.argmax()) if key is None else self._key(key, i)
        key_terms = self._key_terms(h, [i])[0].masked_fill(~seen[None], 0.0)  # [component key]
        key_adv = key_terms[:, j] - key_terms @ alpha.to(key_terms.dtype)
        # Q_ij^a - sum_k alpha_ik Q_ik^a = <R_i q_i^a, k_j - sum_k alpha_ik k_k>: one vector, not [component key].
        k = self._k(h)
        mean_key = alpha.to(k.dtype) @ k.masked_fill(~seen[:, None], 0.0)
        query_adv = self._turn(self.query_parts[:, i, h], self.queries[i]) @ (k[j] - mean_key)
        q = self._q()[i, h]
        target = qk.log_alpha_plus_entropy(alpha[None], self.visible[i][None])[0, j]
        return QKCell(
            head=self.heads[h],
            query=self.queries[i],
            key=j,
            alpha=float(alpha[j]),
            score=float(q @ k[j]),
            log_alpha_plus_entropy=float(target),
            key_side=pd.Series(key_adv.double().numpy(), index=pd.Index(self.key_components, name="component")),
            query_side=pd.Series(query_adv.double().numpy(), index=pd.Index(self.query_components, name="component")),
        )

    # --- tables, figures, files -------------------------------------------------------------

    def to_dataframe(self, side: str | None = None) -> pd.DataFrame:
        """One row per (side, head, query, component, seen key): the term (``value``) and its ``advantage``.

        Columns ``side, target_head, query, key, key_token, component, layer, head, value, advantage``;
        ``layer``/``head`` are the component's own (missing for the embedding and ``b_Q``/``b_K``).
        ``value`` summed over components is the score, ``advantage`` summed is ``log alpha + H``.
        Rows grow as heads x queries x components x keys: select with `cell` or `advantage` on long texts.
        """
        sides = SIDES if side is None else (_side(side),)
        frames = []
        for which in sides:
            terms = self.terms(which)
            names = self.key_components if which == "key" else self.query_components
            for n, h in enumerate(self.heads):
                for r, i in enumerate(self.queries):
                    keys = self._visible_keys(r)
                    values = terms[n, r][:, keys]
                    adv = qk.advantage(terms[n, r : r + 1], self.pattern[n, r : r + 1], self.visible[r : r + 1])[0]
                    frames.append(self._rows(which, h, i, keys, names, values, adv[:, keys]))
        table = pd.concat(frames, ignore_index=True)
        for column in ("layer", "head"):
            table[column] = table[column].astype("Int64")
        return table

    def _rows(
        self, side: str, head: int, query: int, keys: list[int], names: Sequence[str], values: Tensor, adv: Tensor
    ) -> pd.DataFrame:
        where = [component_layer_head(name) for name in names]
        n_keys = len(keys)
        return pd.DataFrame(
            {
                "side": side,
                "target_head": head,
                "query": query,
                "key": keys * len(names),
                "key_token": [self.str_tokens[j] for j in keys] * len(names),
                "component": [name for name in names for _ in range(n_keys)],
                "layer": [layer for layer, _ in where for _ in range(n_keys)],
                "head": [h for _, h in where for _ in range(n_keys)],
                "value": values.reshape(-1).double().numpy(),
                "advantage": adv.reshape(-1).double().numpy(),
            }
        )

    def top(
        self, k: int = 10, side: str = "key", *, key: int | None = None, query: int | None = None,
        head: int | None = None,
    ) -> pd.DataFrame:  # fmt: skip
        """The ``k`` (component, key) rows of largest ``|advantage|`` on ``side``, largest first.

        ``key``: only that key (e.g. the one the head attends to); ``query``/``head``: only those.
        """
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be a positive integer, got {k!r}")
        table = self.to_dataframe(side)
        if head is not None:
            table = table[table["target_head"] == self.heads[self._heads(head)[0]]]
        if query is not None:
            table = table[table["query"] == self.queries[self._queries(query)[0]]]
        if key is not None:
            table = table[table["key"] == as_position(key, len(self.str_tokens))]
        order = table["advantage"].abs().sort_values(ascending=False).index[:k]
        return table.loc[order].reset_index(drop=True)

    def figures(self, head: int | None = None, query: int | None = None, key: int | None = None) -> dict[str, Any]:
        """``advantage`` (components x keys heatmap), ``key`` (both sides' bars at one key), ``heads`` (layers x heads).

        For one head and query (default: the first head, the last query); ``key`` defaults to the
        key the head attends to most.
        """
        from contribution_lens.drawing import plot

        head = self.heads[0] if head is None else head
        query = self.queries[-1] if query is None else query
        return {
            "advantage": plot.qk_advantage(self, head=head, query=query),
            "key": plot.qk_key_bars(self, head=head, query=query, key=key),
            "heads": plot.qk_heads(self, head=head, query=query, key=key),
        }

    def __repr__(self) -> str:
        return (
            f"QKAttribution(layer={self.layer}, heads={list(self.heads)}, queries={_span(self.queries)}, "
            f"keys={self.n_keys}, components={len(self.query_components)} query / {len(self.key_components)} key)"
        )

    def report(self, path: str | os.PathLike, head: int | None = None, query: int | None = None) -> Path:
        """One self-contained HTML page: the figures of one head and query and its largest terms."""
        from contribution_lens.drawing import html

        head = self.heads[0] if head is None else head
        query = self.queries[-1] if query is None else query
        sections: list[html.Section] = [
            ("Text", "".join(self.str_tokens)),
            ("What is split", f"layer {self.layer}, head {head}, query {query}: its scores over "
             f"{len(self.query_components)} query-side and {len(self.key_components)} key-side components"),
            *self.figures(head=head, query=query).items(),
            ("The 20 largest terms", self.top(20, head=head, query=query)),
        ]  # fmt: skip
        return html.write_html(path, f"QKAttribution of layer {self.layer}", sections)


def _span(values: Sequence[int]) -> str:
    if len(values) > 3 and list(values) == list(range(values[0], values[-1] + 1)):
        return f"[{values[0]}..{values[-1]}]"
    return str(list(values))


def _side(side: Any) -> str:
    if side not in SIDES:
        raise ValueError(f"side must be 'key' or 'query', got {side!r}")
    return str(side)


# --- the pass ------------------------------------------------------------------------------------


class _Projector:
    """The per-layer function: each component projected into the heads' query and key space as it is produced.

    ``reads[side][t]`` is ``[d_model n]``, the queries' (``"q"``) or keys' (``"k"``) read matrix seen
    through the stream norms ``plan.norms[t:]`` (up to their scales, applied at the end). Query
    parts are kept at the query rows only, key parts at the first ``n_keys`` positions, each side in
    one buffer ``[component pos n]`` sized from the first block (every block writes as many
    components in a model of identical blocks), so the parts are never copied into a second tensor.
    """

    def __init__(
        self,
        model: adapter.Model,
        plan: adapter.QKPlan,
        form: adapter.QKForm,
        reads: dict[str, list[Tensor]],
        kv_heads: list[int],
        rows: Tensor,
        n_keys: int,
        store: dict[str, Tensor],
    ) -> None:
        self.model, self.plan, self.reads, self.rows, self.n_keys, self.store = model, plan, reads, rows, n_keys, store
        self.form = form
        self.kv_heads = kv_heads
        self.positions: dict[str, Tensor | slice] = {"q": rows, "k": slice(0, n_keys)}
        self.names: list[str] = []
        self.stages: list[int] = []
        self.buffers: dict[str, Tensor] = {}
        self.scales: dict[int, Tensor] = {}
        self.target: adapter.TargetReads | None = None

    @classmethod
    def of(
        cls, model: adapter.Model, layer: int, heads: list[int], rows: list[int], length: int,
        store: dict[str, Tensor], dtype: torch.dtype,
    ) -> "_Projector":  # fmt: skip
        """The projector of ``layer``'s ``heads`` at query ``rows`` of a text of ``length`` tokens."""
        form = adapter.qk_form(model, layer)
        plan = adapter.qk_plan(model, layer)
        kv_heads = sorted({h // form.group for h in heads})
        n_keys = max(rows) + 1 if form.causal else length
        reads = _reads(plan, form, heads, kv_heads, dtype)
        return cls(model, plan, form, reads, kv_heads, torch.tensor(rows), n_keys, store)

    def __call__(self, layer: adapter.LayerInputs) -> None:
        self.scales.update(adapter.stream_scales(self.plan, layer, self.store))
        writes = adapter.embedding_writes(self.model, self.plan, layer, self.store) if layer.layer == 0 else []
        if layer.layer < self.plan.layer:
            block = adapter.layer_writes(self.model, self.plan, layer)
            if not self.buffers:  # the target's norm bias and b_Q/b_K come last
                per_block = sum(len(write.names) for write in block)
                self._allocate(sum(len(write.names) for write in writes) + per_block * self.plan.layer + 2)
            self.add(writes + block)
        else:
            if not self.buffers:
                self._allocate(sum(len(w.names) for w in writes) + 2)
            self.add([*writes, *adapter.target_writes(self.plan)])
            self.target = adapter.target_reads(layer, self.form)

    def _allocate(self, capacity: int) -> None:
        for side, read in self.reads.items():
            rows = self.rows.shape[0] if side == "q" else self.n_keys
            self.buffers[side] = read[0].new_empty(capacity, rows, read[0].shape[1])

    def _room(self, count: int) -> None:
        """Grow the buffers where a block writes more components than the first did (blocks of different kinds)."""
        used = len(self.names)
        for side, buffer in self.buffers.items():
            if used + count > buffer.shape[0]:
                extra = buffer.new_empty(used + count - buffer.shape[0], *buffer.shape[1:])
                self.buffers[side] = torch.cat([buffer, extra])

    def add(self, writes: list[adapter.Write]) -> None:
        for write in writes:
            count, start = len(write.names), len(self.names)
            self._room(count)
            for side, buffer in self.buffers.items():
                read = self.reads[side][write.stage]
                buffer[start : start + count] = self._project(write, read, self.positions[side], buffer.shape[1])
            self.names += write.names
            self.stages += [write.stage] * count

    def add_bias(self, side: str, bias: Float[Tensor, "head d_head"]) -> None:
        """``b_Q`` or ``b_K`` (after every stream norm): the last component of that side only."""
        index = len(self.names)
        self._room(1)
        self.buffers[side][index] = einops.rearrange(bias, "head d_head -> (head d_head)").to(self.buffers[side])

    def _project(self, write: adapter.Write, read: Tensor, positions: Tensor | slice, n_rows: int) -> Tensor:
        if write.norm is not None:
            read = qk.pull_back(read, write.norm.gain, write.norm.centre)
        value = write.value
        if write.W_O is not None:
            projected = qk.project_heads(value[positions], write.W_O, read)
        elif value.ndim == 1:
            projected = (value.to(read.dtype) @ read).expand(1, n_rows, -1)
        else:
            projected = (value[positions].to(read.dtype) @ read)[None]
        if write.scale is not None:
            projected = projected / write.scale[positions].to(read.dtype)[None, :, None]
        return projected

    def parts(self, side: str, extra: int) -> Float[Tensor, "component pos n"]:
        """A side's parts (``extra`` more rows: its bias), each times ``1 / prod s`` of the stream norms it passes."""
        count = len(self.names)
        parts = self.buffers[side][: count + extra]
        n_norms = len(self.plan.norms)
        positions = self.positions[side]
        factors = torch.ones(n_norms + 1, parts.shape[1], dtype=parts.dtype, device=parts.device)
        for index in reversed(range(n_norms)):
            factors[index] = factors[index + 1] / self.scales[index][positions].to(parts.dtype)
        stages = torch.tensor(self.stages, device=parts.device)
        parts[:count] *= factors[stages][..., None]
        return parts


def _reads(
    plan: adapter.QKPlan, form: adapter.QKForm, heads: list[int], kv_heads: list[int], dtype: torch.dtype
) -> dict[str, list[Tensor]]:
    """The q and k read matrices ``[d_model n]`` for every stage: ``W`` pulled back through ``plan.norms[t:]``."""
    reads = {}
    for side, weights in (("q", form.W_Q[heads]), ("k", form.W_K[kv_heads])):
        read = einops.rearrange(weights.to(dtype), "head d_model d_head -> d_model (head d_head)")
        stages = [read]
        for norm in reversed(plan.norms):
            stages.insert(0, qk.pull_back(stages[0], norm.norm.gain, norm.norm.centre))
        reads[side] = stages
    return reads


def _finish(
    parts: Tensor, norm: adapter.Norm | None, norm_scale: Tensor | None, scale: float, n_heads: int
) -> Float[Tensor, "component pos head d_head"]:
    """A side's parts through its q/k norm (scale frozen per head and position) and, for queries, ``scale``."""
    parts = einops.rearrange(parts, "component pos (head d_head) -> component pos head d_head", head=n_heads)
    if norm is not None and norm_scale is not None:
        frozen = einops.rearrange(norm_scale.to(parts.dtype), "head pos -> pos head 1")
        gain = scale if norm.gain is None else norm.gain.to(parts.dtype) * scale
        parts *= gain / frozen
    elif scale != 1.0:
        parts *= scale
    return parts


def _check(result: QKAttribution, form: adapter.QKForm, target: adapter.TargetReads, heads: list[int]) -> None:
    """Raise unless the rebuilt scores are the model's own and their softmax its pattern (`TOLERANCE`, relative)."""
    rows = list(result.queries)
    rebuilt = qk.softcapped(result._scores(list(range(len(heads))), list(range(len(rows)))), form.softcap)
    visible = result.visible[None].expand_as(rebuilt)
    if target.scores is not None:
        model = target.scores[heads][:, rows, : result.n_keys]
    elif not form.rotary and form.q_norm is None:
        k = target.k[: result.n_keys].repeat_interleave(form.group, dim=1)
        model = form.scale * einops.einsum(
            target.q[rows][:, heads], k[:, heads], "query head d_head, key head d_head -> head query key"
        )
    else:
        model = None
    gaps = {} if model is None else {"its pre-softmax scores": qk.relative_gap(rebuilt, model, visible)}
    softmax = torch.softmax(rebuilt.to(torch.float64), -1).nan_to_num(0.0)
    gaps["its pattern (after softmax)"] = qk.relative_gap(softmax, result.pattern, visible)
    tolerance = HALF_TOLERANCE if form.W_Q.dtype in (torch.float16, torch.bfloat16) else TOLERANCE
    bad = {name: gap for name, gap in gaps.items() if not gap <= tolerance}
    if bad:
        what = " and ".join(f"{name} by {gap:.2g}" for name, gap in bad.items())
        raise RuntimeError(
            f"the scores rebuilt from the terms of layer {result.layer} heads {list(result.heads)} miss the model's: "
            f"{what} (relative; tolerance {tolerance:g}): {form.architecture}'s attention is not wired the way "
            "the adapter reads it"
        )


def _visible(form: adapter.QKForm, target: adapter.TargetReads, rows: list[int], n_keys: int) -> Tensor:
    """Which keys each query sees: from the model's scores (masked ones at the dtype's minimum), else causally."""
    if target.scores is not None:
        scores = target.scores[:, rows, :n_keys]
        seen = torch.isfinite(scores) & (scores > torch.finfo(scores.dtype).min / 2)
        return seen.any(0)
    keys = torch.arange(n_keys, device=target.pattern.device)
    queries = torch.tensor(rows, device=keys.device)
    if form.causal:
        return keys[None, :] <= queries[:, None]
    return torch.ones(len(rows), n_keys, dtype=torch.bool, device=keys.device)


def _resolve_heads(model: adapter.Model, head: Any, heads: Any) -> list[int]:
    if head is not None and heads is not None:
        raise ValueError("give head= or heads=, not both")
    chosen = heads if heads is not None else head
    n_heads = int(model.cfg.n_heads)
    if chosen is None:
        return list(range(n_heads))
    resolved = []
    for item in as_indices(chosen, "heads"):
        if not -n_heads <= item < n_heads:
            raise ValueError(
                f"head {item} does not exist: layers of this model have {n_heads} heads (0..{n_heads - 1})"
            )
        resolved.append(item % n_heads)
    if not resolved:
        raise ValueError("heads is empty; pass None for every head of the layer")
    return sorted(set(resolved))


def _batch(model: adapter.Model, text: str | Tensor, prepend_bos: bool | None) -> adapter.TokenBatch:
    if not isinstance(text, str | Tensor):
        raise TypeError(f"text must be one string or a tensor of token ids, got {type(text).__name__}")
    if isinstance(text, Tensor) and text.ndim == 2 and text.shape[0] != 1:
        raise ValueError(f"qk_attribution explains one text at a time; got a batch of {text.shape[0]}")
    # None: the engine's own default (map_layers and to_token_batch decide whether BOS is prepended).
    if prepend_bos is None:
        return adapter.to_token_batch(model, text)
    return adapter.to_token_batch(model, text, prepend_bos=prepend_bos)


def qk_attribution(
    model: adapter.Model,
    text: str | Tensor,
    layer: int,
    head: int | Sequence[int] | None = None,
    query: int | Sequence[int] | None = -1,
    *,
    heads: int | Sequence[int] | None = None,
    prepend_bos: bool | None = None,
    dtype: torch.dtype | str = torch.float32,
) -> QKAttribution:
    """Split the pre-softmax scores of ``layer``'s ``head`` at ``query`` over every upstream component.

    One forward pass up to ``layer``; every component is projected into the head's query and key
    space as the pass produces it. The result's `QKAttribution.key_side`, `~QKAttribution.query_side`
    and `~QKAttribution.advantage` add up to the scores and to ``log alpha + H``; the module's
    docstring has the maths, what is frozen and what is exact (checked on every call).

    Args:
        model: a ``TransformerBridge`` (decoder or encoder).
        text: one text or token ids ``[pos]``.
        layer: the layer (negative: from the end).
        head: one head, a list, or None for every head of the layer (``heads=`` is the same).
        query: one position, a list, or None for every position (negative: from the end).
        prepend_bos: prepend the tokenizer's BOS to a text; None follows the engine's default.
        dtype: accumulation dtype (float32, or float64 for a tighter sum, or its name; never below
            float32: `contribution_lens.decomposition.accumulation_dtype`).

    Example:
        >>> import contribution_lens as cl
        >>> model = cl.load_model()
        >>> result = cl.qk_attribution(model, "The cat sat on the mat. The cat", layer=3, head=0)
        >>> cell = result.cell()  # the key the head attends to most
        >>> bool(abs(cell.total - cell.log_alpha_plus_entropy) < 1e-3)
        True
    """
    layer = _resolve_layer(model, layer)
    chosen = _resolve_heads(model, head, heads)
    dtype = accumulation_dtype(dtype)
    batch = _batch(model, text, prepend_bos)
    length = batch.tokens.shape[1]
    rows = (
        list(range(length)) if query is None else sorted({as_position(q, length) for q in as_indices(query, "queries")})
    )
    if not rows:
        raise ValueError("query is empty; pass None for every query")
    store: dict[str, Tensor] = {}
    projector = _Projector.of(model, layer, chosen, rows, length, store, dtype)
    map_layers(
        model,
        batch,
        projector,
        layers=list(range(layer + 1)),
        capture=projector.plan.capture,
        extra_hooks=adapter.embedding_hooks(model, projector.plan, store),
    )
    return _assemble(projector, batch, chosen)


def _assemble(projector: _Projector, batch: adapter.TokenBatch, heads: list[int]) -> QKAttribution:
    """The `QKAttribution` of a fed projector (its pass, or a `QKTape`'s replay), checked against the model."""
    form, layer, kv_heads, n_keys = projector.form, projector.plan.layer, projector.kv_heads, projector.n_keys
    rows = projector.rows.tolist()
    target = projector.target
    assert target is not None  # the target layer's hooks fired (map_layers raises otherwise)
    biases = {"q": form.b_Q, "k": form.b_K}
    extra = {side: int(bias is not None) for side, bias in biases.items()}
    q_scale = None if target.q_scale is None else target.q_scale[heads][:, rows]
    k_scale = None if target.k_scale is None else target.k_scale[kv_heads][:, :n_keys]
    with torch.inference_mode():  # the buffers were made in the pass: finish them in place, as inference tensors
        for side, bias in biases.items():
            if bias is not None:
                projector.add_bias(side, bias[heads if side == "q" else kv_heads])
        query_parts = _finish(projector.parts("q", extra["q"]), form.q_norm, q_scale, form.scale, len(heads))
        key_parts = _finish(projector.parts("k", extra["k"]), form.k_norm, k_scale, 1.0, len(kv_heads))
    names = tuple(projector.names)
    rotary = form.rotary and target.cos is not None and target.sin is not None
    result = QKAttribution(
        tokens=batch.tokens[0].cpu(),
        str_tokens=batch.str_tokens[0],
        layer=layer,
        heads=tuple(heads),
        queries=tuple(rows),
        query_components=names + (("b_Q",) if extra["q"] else ()),
        key_components=names + (("b_K",) if extra["k"] else ()),
        query_parts=query_parts.cpu(),
        key_parts=key_parts.cpu(),
        kv_index=tuple(kv_heads.index(h // form.group) for h in heads),
        pattern=target.pattern[heads][:, rows, :n_keys].to(query_parts.dtype).cpu(),
        visible=_visible(form, target, rows, n_keys).cpu(),
        cos=target.cos[:n_keys].to(query_parts.dtype).cpu() if rotary and target.cos is not None else None,
        sin=target.sin[:n_keys].to(query_parts.dtype).cpu() if rotary and target.sin is not None else None,
        rotary_adjacent=form.rotary_adjacent,
        softcap=form.softcap,
        architecture=form.architecture,
    )
    _check(result, form, target, heads)
    return result


def _resolve_layer(model: adapter.Model, layer: Any) -> int:
    if layer is None or (hasattr(layer, "__iter__") and getattr(layer, "ndim", 1) != 0):
        raise TypeError(f"layer must be one integer, got {type(layer).__name__} {layer!r}")
    index = as_index(layer, "layer must be an integer")
    return adapter.check_layers(model, index)[0]


# --- a kept pass: any head's split later, without a pass of its own ------------------------------


@dataclass(eq=False)
class QKTape:
    """What one pass over layers ``0..last`` keeps so that any head's split at `rows` needs no pass of its own.

    `qk_attribution` runs the model up to its layer for every split. A viewer that splits many
    heads of one text (the inspector's *why* panel) records instead, in a pass it runs anyway,
    each layer's reads: the heads' ``z``, the residual stream's hooks, the norms' scales, the
    layer's own ``q``, ``k``, rotary angles and q/k norm scales, and its pattern and pre-softmax
    scores at the query rows `rows` only. `attribution` feeds them to the projector
    `qk_attribution` uses, so a split from the tape is that function's split, checked against the
    model the same way, at the cost of the projections alone. Its size: `estimate_bytes` before the
    pass, `nbytes` after it.

    Example:
        >>> import contribution_lens as cl
        >>> model = cl.load_model()
        >>> batch = cl.to_token_batch(model, "The cat sat on the mat. The cat")
        >>> tape = QKTape.plan(model, batch, last=3, rows=[-2, -1]).run()  # or tape.record in a pass of one's own
        >>> kept = tape.attribution(3, head=0, query=[-2, -1])
        >>> fresh = cl.qk_attribution(model, batch.tokens[0], 3, head=0, query=[-2, -1])
        >>> bool(torch.equal(kept.advantage("key"), fresh.advantage("key")))
        True
    """

    model: adapter.Model
    batch: adapter.TokenBatch
    last: int
    rows: tuple[int, ...]
    capture: tuple[str, ...]
    hooks: list[tuple[str, adapter.HookFn]]
    """The pass's extra hooks: the embedding's parts, into `store` (`contribution_lens.adapter.embedding_hooks`)."""
    store: dict[str, Tensor]
    layers: dict[int, adapter.LayerInputs] = field(default_factory=dict)
    """Each recorded layer's reads, without its pattern and scores (those are in ``cut``)."""
    cut: dict[int, dict[str, Tensor]] = field(default_factory=dict)
    """Each recorded layer's pattern and scores ``[batch head row key]`` at `rows` only."""

    @classmethod
    def plan(cls, model: adapter.Model, batch: adapter.TokenBatch, last: int, rows: Sequence[int]) -> "QKTape | None":
        """A tape to record in a pass over layers ``0..last`` of ``batch`` (one text), or None where none can be.

        ``rows``: the query positions splits will ask for (negative: from the end), checked here.

        None where `qk_attribution` refuses the model's blocks or a layer lacks a hook it reads:
        a split then runs its own pass, and says why it cannot be had.
        """
        if batch.tokens.shape[0] != 1:
            raise ValueError(f"a QKTape records one text, got a batch of {batch.tokens.shape[0]}")
        length = batch.tokens.shape[1]
        rows = sorted({as_position(row, length) for row in as_indices(rows, "rows")})
        if not rows:
            raise ValueError("rows is empty: a tape keeps the pattern at the query rows splits will ask for")
        last = _resolve_layer(model, last)
        try:
            for layer in range(last + 1):  # first, as in a split: a form it refuses (ALiBi, ...)
                adapter.qk_form(model, layer)
            plans = [adapter.qk_plan(model, layer) for layer in range(last + 1)]
        except ValueError:
            return None
        capture = tuple(dict.fromkeys(name for plan in plans for name in plan.capture))
        if not adapter.has_capture(model, range(last + 1), capture):
            return None
        store: dict[str, Tensor] = {}
        hooks = adapter.embedding_hooks(model, plans[-1], store)
        return cls(model, batch, last, tuple(rows), capture, hooks, store)

    @staticmethod
    def estimate_bytes(model: adapter.Model, length: int, n_rows: int, last: int) -> int:
        """At most the bytes a tape of layers ``0..last`` keeps for ``length`` tokens and ``n_rows`` query rows.

        Per layer: four residual-stream vectors, ``z``, ``q``, ``k``, the rotary angles and the
        norms' scales per position in the model's dtype, and the pattern's and scores' rows at 4
        bytes a number (some bridges upcast them); the embedding's parts once.
        """
        cfg, facts = model.cfg, adapter.anatomy_of(model)
        n_heads, n_kv, d_head = facts.n_heads, facts.n_kv_heads, int(cfg.d_head)
        size = adapter.model_dtype(model).itemsize
        # Four residual vectors (the MLP's output too, in post-LN blocks); cos and sin are d_head wide
        # each; 8 for the norms' scales. The embedding's parts (BERT: three) are kept once.
        per_position = 4 * int(cfg.d_model) + (2 * n_heads + n_kv + 2) * d_head + 8
        activations = ((last + 1) * per_position + 3 * int(cfg.d_model)) * length * max(size, 2)
        return activations + (last + 1) * 2 * n_heads * n_rows * length * 4

    @property
    def nbytes(self) -> int:
        """The bytes the recorded layers keep (the model's weights, which they share, not counted)."""
        kept = [t for inputs in self.layers.values() for t in (inputs.z, *inputs.captured.values()) if t is not None]
        kept += [t for cut in self.cut.values() for t in cut.values()] + list(self.store.values())
        return sum(t.numel() * t.element_size() for t in kept)

    def record(self, inputs: adapter.LayerInputs) -> None:
        """The pass's per-layer function: keep a copy of layer ``inputs.layer``'s reads (the pass frees its own)."""
        if inputs.layer > self.last:
            return
        length = self.batch.tokens.shape[1]
        rows = torch.tensor(self.rows, device=inputs.pattern.device)
        captured = {name: tensor.clone() for name, tensor in inputs.captured.items() if name in self.capture}
        whole = {"pattern": inputs.pattern, "scores": captured.pop(adapter.QK_SCORES)}
        # Only the rows a split will ask for (`covers`): the [head pos pos] tensors are most of a layer.
        self.cut[inputs.layer] = {
            name: tensor[:, :, rows].clone() if tensor.ndim == 4 and tensor.shape[2] == length else tensor.clone()
            for name, tensor in whole.items()
        }
        z = None if inputs.z is None else inputs.z.clone()
        # Pattern and values the projector does not read: zeros of their shapes that take no memory.
        pattern, v = (tensor.new_zeros(()).expand(tensor.shape) for tensor in (inputs.pattern, inputs.v))
        self.layers[inputs.layer] = replace(
            inputs, pattern=pattern, v=v, z=z, hook_out=None, gram_of=None, captured=captured, _cache={}
        )

    def run(self) -> "QKTape":
        """Record in a pass of its own over layers ``0..last`` (for a caller without a pass to share)."""
        layers = list(range(self.last + 1))
        map_layers(self.model, self.batch, self.record, layers=layers, capture=self.capture, extra_hooks=self.hooks)
        return self

    def covers(self, layer: int, rows: Sequence[int]) -> bool:
        """Whether the tape holds layer ``layer`` (and all before it) and every query of ``rows``."""
        return set(range(layer + 1)) <= self.layers.keys() and set(rows) <= set(self.rows)

    def attribution(
        self, layer: int, head: int | Sequence[int] | None = None, query: int | Sequence[int] | None = None,
        *, dtype: torch.dtype | str = torch.float32,
    ) -> QKAttribution:  # fmt: skip
        """`qk_attribution` of ``layer``'s ``head`` at ``query`` (default: the tape's rows), from the tape.

        Raises `ValueError` where the tape does not hold the layer or a query (`covers`).
        """
        length = self.batch.tokens.shape[1]
        layer = _resolve_layer(self.model, layer)
        chosen = _resolve_heads(self.model, head, None)
        dtype = accumulation_dtype(dtype)
        asked = self.rows if query is None else as_indices(query, "queries")
        rows = sorted({as_position(q, length) for q in asked})
        if not rows or not self.covers(layer, rows):
            raise ValueError(
                f"the tape holds layers {_span(sorted(self.layers))} and queries {_span(self.rows)}: "
                f"not layer {layer} at queries {_span(rows)}"
            )
        projector = _Projector.of(self.model, layer, chosen, rows, length, self.store, dtype)
        with torch.inference_mode():  # as in the pass: its buffers are inference tensors, finished in place
            for earlier in range(layer):
                projector(self.layers[earlier])
            projector(self._target(layer))
        return _assemble(projector, self.batch, chosen)

    def _target(self, layer: int) -> adapter.LayerInputs:
        """Layer ``layer``'s reads with its pattern and scores whole again: the kept rows, zeros at the others."""
        length, rows = self.batch.tokens.shape[1], list(self.rows)

        def whole(tensor: Tensor) -> Tensor:
            if len(rows) == length or tensor.ndim != 4 or tensor.shape[2] != len(rows):
                return tensor  # kept whole (`record` cuts only [batch head pos key] tensors)
            out = tensor.new_zeros(*tensor.shape[:2], length, tensor.shape[3])
            out[:, :, rows] = tensor
            return out

        cut, kept = self.cut[layer], self.layers[layer]
        captured = {**kept.captured, adapter.QK_SCORES: whole(cut["scores"])}
        return replace(kept, pattern=whole(cut["pattern"]), captured=captured, _cache={})
