"""Model-level contribution weights: `attention_geometry` keeps every requested layer's `Decomposition`.

It is one per-layer function on `contribution_lens.map_layers`. For long inputs keep a summary
instead of the decompositions: `layer_summary` streams the same numbers as
``attention_geometry(...).layer_summary()`` with one layer alive at a time.
"""

import os
from collections.abc import Callable, Mapping, Sequence
from operator import attrgetter
from pathlib import Path
from typing import TYPE_CHECKING

import einops
import pandas as pd
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor
from transformer_lens import ActivationCache

from contribution_lens import adapter
from contribution_lens.choices import as_index, as_indices
from contribution_lens.decomposition import MEASURES, Decomposition, Factor, Scope, accumulation_dtype, decompose
from contribution_lens.engine import LayerResults, map_layers, tiles_mode

if TYPE_CHECKING:
    import plotly.graph_objects as go


class Geometry(LayerResults[Decomposition]):
    """Per-layer `Decomposition` of a batch, with the tokens that label it.

    ``geometry[3].contribution`` is ``[batch head query key]``; ``geometry[-1]`` is the last layer.
    ``save(path)`` / ``Geometry.load(path)`` keep every layer's factors in one file; ``figures()``
    and ``report(path)`` are its overview.
    """

    STORED = ("scope",)

    def __init__(
        self,
        layers: Mapping[int, Decomposition],
        tokens: Int[Tensor, "batch pos"],
        attention_mask: Bool[Tensor, "batch pos"],
        str_tokens: list[list[str]],
        scope: Scope | str,
        n_layers: int | None = None,
        logits: Tensor | None = None,
        bos_first: bool = True,
    ) -> None:
        super().__init__(
            layers,
            tokens=tokens,
            attention_mask=attention_mask,
            str_tokens=str_tokens,
            n_layers=n_layers,
            logits=logits,
            bos_first=bos_first,
        )
        self.scope = Scope.of(scope)
        for layer, d in self.items():
            if d.attention.shape[0] != tokens.shape[0] or d.attention.shape[-1] != tokens.shape[1]:
                raise ValueError(f"layer {layer} has shape {tuple(d.attention.shape)}, tokens {tuple(tokens.shape)}")

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", scope={self.scope!r})"

    def to(self, target: torch.device | str | torch.dtype) -> "Geometry":
        """A copy on another device or in another floating dtype."""
        moved = {layer: d.to(target) for layer, d in self.items()}
        device_move = not isinstance(target, torch.dtype)
        tokens = self.tokens.to(target) if device_move else self.tokens
        mask = self.attention_mask.to(target) if device_move else self.attention_mask
        batch = self.batch_fields() | {"tokens": tokens, "attention_mask": mask, "logits": None}
        return Geometry(moved, scope=self.scope, **batch)

    def head_summary(self, factor: Factor | str = Factor.CONTRIBUTION) -> Float[Tensor, "layer head"]:
        """Mean of ``factor`` over every valid (query, key) pair of the batch, per layer and head.

        Rows follow ``self.layers``.
        """
        factor = Factor.of(factor)
        rows = []
        for d in self.values():
            valid = einops.rearrange(d.valid, "batch query key -> batch 1 query key").to(d.attention.dtype)
            total = einops.reduce(d.factor(factor) * valid, "batch head query key -> head", "sum")
            rows.append(total / valid.sum().clamp_min(1))
        return torch.stack(rows)

    def layer_summary(self, sink: int | None = None) -> pd.DataFrame:
        """One row per layer: how far attention and contribution disagree (see `layer_disagreement`).

        ``sink``: the key position compared; None: 0 where every text starts with the model's BOS,
        else, per layer and text, the key of largest attention share (`sink_positions`).
        """
        mask = self.attention_mask
        rows = [
            {"layer": layer, **layer_disagreement(d, mask, sink_positions(d, sink, self.bos_first, mask))}
            for layer, d in self.items()
        ]
        return pd.DataFrame(rows).set_index("layer")

    def sink_layer(self, sink: int | None = None) -> int:
        """The layer where attention to and contribution of key ``sink`` differ most (token level; ``sink`` as in
        `layer_summary`)."""
        table = self.layer_summary(sink)
        return int(table["sink_contribution"].sub(table["sink_attention"]).abs().idxmax())

    def to_dataframe(
        self,
        *,
        layers: int | Sequence[int] | None = None,
        heads: int | Sequence[int] | None = None,
        queries: int | Sequence[int] | None = None,
        keys: int | Sequence[int] | None = None,
        index: int = 0,
        min_abs_contribution: float = 0.0,
    ) -> pd.DataFrame:
        """A tidy long table: one row per (layer, head, query, key) of batch element ``index``.

        Columns: ``layer, head, query, key, query_token, key_token, attention, relative_norm,
        cosine, contribution``. Only visible pairs appear (no future keys, no padding); the
        filters keep it small: a 512-token text has 0.1 M pairs per head and layer.

        Example:
            >>> import torch, contribution_lens as cl
            >>> pattern = torch.tensor([[[[1.0, 0.0], [0.25, 0.75]]]])
            >>> d = cl.decompose(pattern, torch.randn(1, 2, 1, 3), torch.randn(1, 3, 4))
            >>> g = cl.Geometry({0: d}, torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.bool),
            ...                 [["<s>", "a"]], "inter")
            >>> g.to_dataframe(queries=1)[["query_token", "key_token", "attention"]].values.tolist()
            [['a', '<s>', 0.25], ['a', 'a', 0.75]]
        """
        index = as_index(index, "index must be an integer")
        if not 0 <= index < len(self.str_tokens):
            raise IndexError(f"index {index} is outside the batch of {len(self.str_tokens)}")
        chosen_layers = self.layers if layers is None else [self.resolve(x) for x in as_indices(layers, "layers")]
        n = len(self.str_tokens[index])
        frames = []
        for layer in chosen_layers:
            d = self[layer]
            head_ids = _positions(heads, d.shape[1], "head")
            query_ids = _positions(queries, n, "query")
            key_ids = _positions(keys, n, "key")
            frames.append(_layer_frame(d, layer, index, head_ids, query_ids, key_ids, self.str_tokens[index]))
        table = pd.concat(frames, ignore_index=True)
        if min_abs_contribution > 0:
            table = table[table["contribution"].abs() >= min_abs_contribution].reset_index(drop=True)
        return table

    def figures(
        self,
        *,
        layer: int | None = None,
        index: int = 0,
        measures: Mapping[str, Callable[[Decomposition], Tensor]] | None = None,
    ) -> "dict[str, go.Figure]":
        """The overview of batch element ``index``, each figure under its title.

        The attention to, and the contribution of, the first token (BOS) per layer and head; then,
        at ``layer`` (default: `sink_layer` of key 0, where the two disagree most), the token-level
        contribution heatmap and the measures of the last query side by side. ``measures`` maps
        a label to a score of a `Decomposition`: by default its own four (attention,
        value-weighted, output-normalised, contribution); ``cl.methods.decomposition_measures()``
        adds every registered one.
        """
        from contribution_lens.drawing import plot

        shown = self.sink_layer(0) if layer is None else self.resolve(layer)
        query = len(self.str_tokens[index]) - 1
        sink_attention = torch.stack([d.attention[index, :, 1:, 0].mean(-1) for d in self.values()])
        sink_contribution = torch.stack([d.contribution[index, :, 1:, 0].mean(-1) for d in self.values()])
        chosen = measures if measures is not None else {label: attrgetter(name) for name, label in MEASURES.items()}
        # Key 0 is BOS where the texts start with one, else the text's first token, named as such.
        first = "BOS" if self.bos_first else f"the first token, {self.str_tokens[index][0]!r}"
        bos = f"contribution of {first} ({self.scope}-head)"
        return {
            f"Attention to the first token ({first}), per head": plot.head_grid(
                sink_attention, title=f"attention to {first}", layers=self.layers
            ),
            f"Contribution of the first token ({first}), per head": plot.head_grid(
                sink_contribution, title=bos, layers=self.layers, signed=True
            ),
            f"Token-level contribution at layer {shown}": plot.token_heatmap(self, layer=shown, index=index),
            f"Every measure for the last query at layer {shown}": plot.measure_bars(
                self, chosen, layer=shown, query=query, index=index
            ),
        }

    def report(
        self,
        path: str | os.PathLike,
        *,
        title: str | None = None,
        layer: int | None = None,
        text: str = "",
        measures: Mapping[str, Callable[[Decomposition], Tensor]] | None = None,
    ) -> Path:
        """One self-contained HTML page: the text, the per-layer summary and `figures` (of batch element 0).

        ``title`` defaults to what the result is: ``Geometry of N tokens (scope-head)``.

        Example:
            >>> import contribution_lens as cl, tempfile
            >>> model = cl.load_model()
            >>> g = cl.attention_geometry(model, "The cat sat on the mat.")
            >>> g.report(tempfile.mkdtemp() + "/demo.html").stat().st_size > 1_000_000  # plotly.js is embedded
            True
        """
        from contribution_lens.drawing import html

        sections: list[html.Section] = [
            ("Text", text or "".join(self.str_tokens[0])),
            ("Per-layer summary", self.layer_summary()),
            *self.figures(layer=layer, measures=measures).items(),
        ]
        default = f"Geometry of {len(self.str_tokens[0])} tokens ({self.scope}-head)"
        return html.write_html(path, default if title is None else title, sections)


def _positions(value: int | Sequence[int] | None, size: int, what: str) -> list[int]:
    if value is None:
        return list(range(size))
    plural = {"query": "queries"}.get(what, f"{what}s")
    resolved = []
    items = as_indices(value, plural)
    if not items:
        raise ValueError(f"{plural} is empty: give at least one {what}, or None for all {plural}")
    for item in items:
        if not -size <= item < size:
            raise IndexError(f"{what} {item} does not exist (0..{size - 1})")
        resolved.append(item % size)
    return resolved


def _layer_frame(
    d: Decomposition, layer: int, index: int, heads: list[int], queries: list[int], keys: list[int], tokens: list[str]
) -> pd.DataFrame:
    h = torch.tensor(heads)[:, None, None]
    q = torch.tensor(queries)[None, :, None]
    k = torch.tensor(keys)[None, None, :]
    h, q, k = torch.broadcast_tensors(h, q, k)
    visible = d.valid[index][q, k].cpu()
    h, q, k = h[visible], q[visible], k[visible]
    columns = {str(f): d.factor(f)[index][h, q, k].detach().float().cpu().numpy() for f in Factor}
    return pd.DataFrame(
        {
            "layer": layer,
            "head": h.numpy(),
            "query": q.numpy(),
            "key": k.numpy(),
            "query_token": [tokens[i] for i in q.tolist()],
            "key_token": [tokens[j] for j in k.tolist()],
            **columns,
        }
    )


def sink_positions(
    d: Decomposition, sink: int | None, bos_first: bool, attention_mask: Bool[Tensor, "batch key"]
) -> int | Int[Tensor, " batch"]:
    """The key compared with the rest in a layer summary: ``sink``, or 0 after a BOS, else found per text.

    Found: the key of largest attention share (`contribution_lens.analyses.sinks.sink_shares`,
    Gu et al.'s share, averaged over heads and the queries that see the key).
    """
    if sink is not None or bos_first:
        return 0 if sink is None else sink
    from contribution_lens.analyses.sinks import sink_shares

    return sink_shares(d.attention, attention_mask=attention_mask).argmax(-1)


def layer_disagreement(d: Decomposition, attention_mask: Tensor, sink: int | Tensor = 0) -> dict[str, float]:
    """How far attention and contribution disagree in one layer, token level.

    * ``sink_attention`` / ``sink_contribution``: mean over real queries ``i != sink`` that can
      see the sink of the head-averaged attention to, and the summed contribution of, key ``sink``;
    * ``negative_share``: share of attended (head, query, key) triples whose weight is negative;
    * ``top1_agreement``: share of those queries whose most-attended key is also the key of
      largest contribution.

    ``sink`` is one key position, or one per text (``[batch]``, as `sink_positions` finds them).
    Raises for a batch whose texts all have one token: no query then sees another key. The sums
    are `Disagreement`'s, which `layer_summary` adds a tile of queries at a time.
    """
    summary = Disagreement(attention_mask, sink, d.shape[-1])
    summary.add(d)
    return summary.result()


class Disagreement:
    """`layer_disagreement`'s sums over one layer's queries, added a tile of queries at a time (`add`), then `result`.

    Each sum runs over the queries a tile holds, in float64; the means and shares come at the end, so
    the numbers do not depend on how the queries were tiled (beyond float64's rounding).
    """

    def __init__(self, attention_mask: Tensor, sink: int | Tensor, n_key: int) -> None:
        if int(attention_mask.sum(-1).max()) < 2:
            raise ValueError(
                "a layer summary compares each query's attention with its contributions over the keys it sees: "
                "it needs a text of at least two tokens (with prepend_bos=False a one-word text has one)"
            )
        batch, device = attention_mask.shape[0], attention_mask.device
        self.attention_mask, self.sink = attention_mask.to(torch.bool), sink
        self.column = (
            torch.full((batch,), _sink_position(sink, n_key), device=device)
            if not isinstance(sink, Tensor)
            else sink.to(device, torch.long)
        )
        self.sums = torch.zeros(6, dtype=torch.float64)
        """Sink attention, sink contribution, real queries, negative triples, attended triples, agreeing queries."""

    def add(self, d: Decomposition, first_query: int | None = None) -> None:
        """Add the queries of ``d``: a layer's decomposition, or a tile's whose first query is ``first_query``."""
        _, heads, n_query, n_key = d.shape
        first = n_key - n_query if first_query is None else first_query
        device = d.attention.device
        column = self.column.to(device)
        reached = column < n_key  # a causal tile's keys may end before the sink
        at_sink = einops.repeat(torch.where(reached, column, 0), "batch -> batch query 1", query=n_query)
        positions = torch.arange(first, first + n_query, device=device)
        real_query = self.attention_mask.to(device)[:, first : first + n_query] & d.valid.gather(2, at_sink)[..., 0]
        # The sink attending to itself says nothing.
        real_query &= reached[:, None] & (positions[None, :] != column[:, None])
        # Head by head: a long text's summary never holds a second full [batch head query key] tensor.
        attention = torch.zeros_like(d.attention[:, 0])
        contribution = torch.zeros_like(attention)
        negative, attended = 0, 0
        for head in range(heads):
            alpha, weight = d.attention[:, head], d.head_contribution(head)
            attention += alpha
            contribution += weight
            seen = alpha > 0
            attended += int(seen.sum())
            negative += int(seen.logical_and_(weight < 0).sum())
        attention /= heads
        agree = attention.argmax(-1) == contribution.argmax(-1)
        found = [attention.gather(2, at_sink)[..., 0][real_query], contribution.gather(2, at_sink)[..., 0][real_query]]
        self.sums += torch.tensor(
            [*(float(x.double().sum()) for x in found), float(real_query.sum()), negative, attended,
             float(agree[real_query].sum())],
            dtype=torch.float64,
        )  # fmt: skip

    def result(self) -> dict[str, float]:
        """The four numbers of `layer_disagreement`; raises where no real query but the sink sees the sink."""
        sink_attention, sink_contribution, queries, negative, attended, agree = self.sums.tolist()
        if not queries:
            shown = self.column.tolist() if isinstance(self.sink, Tensor) else self.sink
            raise ValueError(
                f"no real query other than the sink sees key {shown} (causal attention: only later tokens see it; "
                "padding sees nothing): choose an earlier sink position"
            )
        return {
            "sink_attention": sink_attention / queries,
            "sink_contribution": sink_contribution / queries,
            "negative_share": negative / attended if attended else float("nan"),
            "top1_agreement": agree / queries,
        }


def _found_sink(layer: adapter.LayerInputs) -> Tensor:
    """Per text, the key of largest attention share in ``layer`` (as `sink_positions` finds it), read in tiles."""
    from contribution_lens.analyses.sinks import layer_sink_shares

    return layer_sink_shares(layer).argmax(-1)


def _sink_position(sink: int, n_key: int) -> int:
    """``sink`` as a key position in [0, n_key); negative ones are refused (the last real token differs per text)."""
    sink = as_index(sink, "sink must be an integer key position")
    if not 0 <= sink < n_key:
        raise ValueError(
            f"sink must be a key position from 0 to {n_key - 1}, got {sink}"
            + (
                " (positions do not count from the end: with padding the last token differs per text)"
                if sink < 0
                else ""
            )
        )
    return sink


def layer_summary(
    model: adapter.Model,
    inputs: str | Sequence[str] | Tensor,
    *,
    layers: int | Sequence[int] | None = None,
    scope: Scope | str = Scope.INTER,
    sink: int | None = None,
    prepend_bos: bool | None = None,
    tiles: bool | None = None,
) -> pd.DataFrame:
    """`Geometry.layer_summary` without keeping any layer: memory of one layer at a time.

    ``sink`` as in `Geometry.layer_summary` (None: 0 after a BOS, else found per layer and text);
    ``prepend_bos``: prepend the tokenizer's BOS to texts (None: the model's own choice). Each layer
    is read a tile of queries at a time; ``tiles=True`` runs the pass itself in tiles, holding no
    pattern (`contribution_lens.adapter.tiled_attention`: what a 32,768-token text needs), ``False``
    keeps the model's own, None (default) decides by the length (`contribution_lens.engine.WHOLE_PATTERN_BYTES`).

    Example:
        >>> import contribution_lens as cl
        >>> model = cl.load_model()
        >>> cl.layer_summary(model, "The cat sat on the mat.", layers=[0, 1]).shape
        (2, 4)
    """

    scope = Scope.of(scope)

    def summarise(layer: adapter.LayerInputs) -> dict[str, float]:
        mask = layer.attention_mask
        found = sink if sink is not None or layer.bos_first else _found_sink(layer)
        summary = Disagreement(mask, 0 if found is None else found, layer.pattern.shape[-1])
        for tile in layer.tiles():
            summary.add(layer.decompose_rows(scope, tile), tile.start)
        return summary.result()

    mode = tiles_mode(tiles)
    results = map_layers(model, inputs, summarise, layers=layers, prepend_bos=prepend_bos, qk=mode)
    return pd.DataFrame([{"layer": layer, **row} for layer, row in results.items()]).set_index("layer")


def attention_geometry(
    model: adapter.Model,
    inputs: str | Sequence[str] | Tensor | ActivationCache,
    *,
    layers: int | Sequence[int] | None = None,
    scope: Scope | str = Scope.INTER,
    attention_mask: Tensor | None = None,
    tokens: Tensor | None = None,
    dtype: torch.dtype | str | None = None,
    prepend_bos: bool | None = None,
) -> Geometry:
    """Contribution weights and their factors for every requested layer, in one forward pass.

    Each layer is decomposed inside its hooks (see `contribution_lens.decompose`), so the
    activation cache is never stored; causal or bidirectional attention is read from
    ``model.cfg.attention_dir``.

    Args:
        model: a TransformerLens ``TransformerBridge``.
        inputs: a text, a list of texts (right-padded; padding carries no weight and is
            marked in ``attention_mask``), token ids ``[pos]``/``[batch pos]``, or an
            ``ActivationCache`` from ``model.run_with_cache`` (no forward pass then).
        layers: layer indices (negative ones count from the end); None for all.
        scope: ``"inter"`` (weights over heads and keys sum to 1) or ``"intra"`` (per head).
        attention_mask: padding mask for token ids or a cache (1 = real token).
        tokens: the token ids a cache was computed from, for labels.
        dtype: accumulation dtype (float32 by default, whatever the model's dtype; float64, or its
            name: `contribution_lens.decomposition.accumulation_dtype`).
        prepend_bos: prepend the tokenizer's BOS to texts; None: the model's own choice
            (``cfg.default_prepend_bos``, `contribution_lens.adapter.prepends_bos`).

    Example:
        >>> import contribution_lens as cl
        >>> model = cl.load_model()
        >>> g = cl.attention_geometry(model, "The cat sat on the mat.", layers=[0, 5])
        >>> g.str_tokens[0][:3]
        ['<|im_start|>', 'The', ' cat']
        >>> round(g[5].sum_over_heads()[0, -1].sum().item(), 4)
        1.0
    """
    scope = Scope.of(scope)
    dtype = None if dtype is None else accumulation_dtype(dtype)
    if isinstance(inputs, ActivationCache):
        return _from_cache(model, inputs, adapter.check_layers(model, layers), scope, attention_mask, tokens, dtype)
    results = map_layers(
        model,
        inputs,
        lambda layer: layer.decompose(scope, dtype),
        layers=layers,
        attention_mask=attention_mask,
        prepend_bos=prepend_bos,
    )
    return Geometry.from_results(results, scope=scope)


def _from_cache(
    model: adapter.Model,
    cache: ActivationCache,
    layers: list[int],
    scope: Scope,
    attention_mask: Tensor | None,
    tokens: Tensor | None,
    dtype: torch.dtype | None,
) -> Geometry:
    adapter.check_hooks(model, layers)
    causal = adapter.is_causal_model(model)
    results = {}
    for layer in layers:
        for name in (adapter.pattern_hook(layer), adapter.value_hook(layer, model)):
            if name not in cache:
                raise ValueError(f"the cache has no {name!r}: run run_with_cache without a names_filter that drops it")
        pattern = cache[adapter.pattern_hook(layer)]
        if pattern.ndim == 3:
            raise ValueError(
                "the cache has no batch axis (made with remove_batch_dim=True); "
                "use the default batched cache of run_with_cache"
            )
        mask = None if attention_mask is None else attention_mask.to(torch.bool)
        results[layer] = decompose(
            pattern,
            adapter.read_values(model, layer, cache[adapter.value_hook(layer, model)]),
            adapter.output_weights(model, layer)[0],
            scope=scope,
            attention_mask=mask,
            causal=causal,
            dtype=dtype,
        )
    first = results[layers[0]]
    batch, _, _, length = first.attention.shape
    if tokens is None:
        token_ids = torch.full((batch, length), -1, dtype=torch.long)
        str_tokens = [[f"<{i}>" for i in range(length)] for _ in range(batch)]
    else:
        token_ids = tokens.reshape(batch, length)
        str_tokens = [adapter.token_labels(model, row.tolist()) for row in token_ids]
    full_mask = (
        torch.ones(batch, length, dtype=torch.bool) if attention_mask is None else attention_mask.to(torch.bool).cpu()
    )
    if attention_mask is not None:
        str_tokens = [labels[: int(m.sum())] for labels, m in zip(str_tokens, full_mask, strict=True)]
    bos_first = tokens is None or set(token_ids[:, 0].tolist()) <= adapter.start_ids(model)
    return Geometry(results, token_ids, full_mask, str_tokens, scope, adapter.n_layers(model), bos_first=bos_first)
