"""Flow across layers: how a prediction's residual stream is mixed from the input tokens, layer by layer.

At every layer ``l`` the residual stream after attention, ``r_i = x_i + a_i`` (``x_i`` =
``hook_resid_pre``, ``a_i`` = the attention output with ``b_O``), splits by the contribution rule
into one signed part per (head, key) and the residual term (`contribution_lens.mixing`):

    w_ij^h = <r_i, alpha_ij^h vt_j^h> / ||r_i||^2 = alpha_ij^h * (||vt_j^h|| / ||r_i||) * cos(r_i, vt_j^h)
    M_ij   = sum_h w_ij^h + [i == j] <r_i, x_i + b_O> / ||r_i||^2          (sum_j M_ij = 1)

``flow.mixing[l]`` is ``M`` of layer ``l`` (``[query key]``); composed, ``R^l = M^l R^{l-1}``,
its row at the explained position is ``flow.rollout[l]`` (``[layer key]``, rows summing to 1):
the signed share of each input token in that position's residual stream after layer ``l``.

How the rest of the block is treated, and what the composition ignores:

* **MLPs** act on each position alone: they mix no tokens, and the stream entering layer ``l+1``
  is taken to carry the token shares of ``r_i`` (what an MLP writes is credited to the tokens in
  the proportions of its input; its non-linearity, and any token-specific work it does, is ignored).
* **Norms.** The pre-attention norm of ``x_j`` sits inside ``vt_j`` with its scale taken as given;
  a norm after the attention (Gemma's ``ln1_post``) maps every part through its linear part with
  the scale frozen at the position (its bias, like ``b_O``, goes to the residual term); a norm
  after the residual sum (BERT's post-LN) or after the MLP is per-position and is ignored.
* **Biases** (``b_O``, a post-norm's bias) belong to no token: they count in the residual term.
* The rollout multiplies *signed* shares: a negative share of a negative share is positive; it is
  a linear bookkeeping of the residual stream, not a causal effect (the faithfulness protocol
  ``prediction`` tests that).

The pruned graph (as in information-flow routes, Ferrando & Voita 2024) starts at the explained
position after the last layer and, layer by layer downwards, keeps every edge (a head's key, or the
residual) whose ``|w|`` reaches ``threshold`` into a node already kept.

Example:
    >>> import contribution_lens as cl
    >>> model = cl.load_model()
    >>> f = cl.flow(model, "The cat sat on the mat.")
    >>> round(f.mixing[3].sum(-1).max().item(), 4), round(f.rollout[-1].sum().item(), 4)
    (1.0, 1.0)
"""

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor

from contribution_lens import adapter
from contribution_lens.choices import as_indices, as_position, as_threshold
from contribution_lens.engine import LayerResults, map_layers
from contribution_lens.mixing import layer_mixing

if TYPE_CHECKING:
    import plotly.graph_objects as go

DEFAULT_THRESHOLD = 0.02
"""Smallest ``|w_ij^h|`` kept as an edge (and the graph's default threshold)."""


@dataclass(frozen=True)
class FlowEdges:
    """The (head, query, key) parts of one layer with ``|w| >= threshold``, and their three factors."""

    head: Int[Tensor, " edge"]
    query: Int[Tensor, " edge"]
    key: Int[Tensor, " edge"]
    weight: Float[Tensor, " edge"]
    attention: Float[Tensor, " edge"]
    relative_norm: Float[Tensor, " edge"]
    cosine: Float[Tensor, " edge"]

    def __post_init__(self) -> None:
        sizes = {getattr(self, f.name).shape for f in fields(self)}
        if len(sizes) != 1 or len(next(iter(sizes))) != 1:
            raise ValueError(f"edge fields must be 1-D of one length, got shapes {sorted(sizes)}")


@dataclass(frozen=True)
class FlowLayer:
    """One layer of a `Flow`: the token mixing, its residual term, and the strong per-head edges."""

    mixing: Float[Tensor, "query key"]
    residual: Float[Tensor, " query"]
    edges: FlowEdges


def _flow_layer(readout: adapter.Readout, layer: adapter.LayerInputs, threshold: float) -> FlowLayer:
    """One layer of a flow: its mixing, residual terms and the parts ``|w| >= threshold`` with their factors."""
    mixing = layer_mixing(layer, readout.attention_update(layer), factors=True, threshold=threshold)
    assert mixing.strong is not None  # asked for with the threshold
    strong = mixing.strong
    first = strong.batch == 0  # a flow explains one text
    batch, head, query, key, weight = (
        t[first] for t in (strong.batch, strong.head, strong.query, strong.key, strong.weight)
    )
    attention = layer.pattern[0][head, query, key].float()
    relative = mixing.relative_norm(batch, head, query, key)
    product = attention * relative
    cosine = torch.where(product > 0, weight / torch.where(product > 0, product, 1), 0)
    edges = FlowEdges(head.cpu(), query.cpu(), key.cpu(), weight.cpu(), attention.cpu(), relative.cpu(), cosine.cpu())
    return FlowLayer(mixing.mixing[0].cpu(), mixing.residual[0].cpu(), edges)


class Flow(LayerResults[FlowLayer]):
    """Per-layer token mixing of one text, with the explained position(s) and the strong edges.

    ``flow.mixing[l]`` is ``[query key]``; ``flow.rollout`` is ``[layer key]`` for the explained
    position (with several, ``flow.at(p).rollout``); ``flow.graph()`` the pruned edges.
    ``save(path)`` keeps the mixings, residual terms and edges (not the pass's logits).
    """

    STORED = ("positions", "threshold")

    def __init__(
        self,
        layers: Mapping[int, FlowLayer],
        *,
        positions: Sequence[int],
        threshold: float = DEFAULT_THRESHOLD,
        **results: Any,
    ) -> None:
        super().__init__(layers, **results)
        if self.tokens.shape[0] != 1:
            raise ValueError(f"a Flow explains one text, got a batch of {self.tokens.shape[0]}")
        if self.layers != list(range(self.n_layers)):
            raise ValueError(f"a Flow needs every layer 0..{self.n_layers - 1}, got {self.layers}")
        n = len(self.str_tokens[0])
        self.positions = [as_position(p, n) for p in positions]
        if not self.positions:
            raise ValueError("a Flow needs at least one explained position")
        self.threshold = float(threshold)
        self._rollouts: dict[int, Tensor] = {}

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", positions={self.positions}, threshold={self.threshold:g})"

    @property
    def mixing(self) -> LayerResults[Tensor]:
        """``mixing[l]``: layer ``l``'s signed ``[query key]`` mixing, every row summing to 1."""
        return self.map(lambda layer: layer.mixing)

    def at(self, position: int) -> "Flow":
        """The same flow explaining ``position`` (no new pass: every position's mixing is kept)."""
        return self._explaining([position])

    def _explaining(self, positions: Sequence[int]) -> "Flow":
        """`at` for several positions: the layers (and the rollouts computed so far) are shared, not copied."""
        flow = Flow(dict(self.items()), positions=positions, threshold=self.threshold, **self.batch_fields())
        flow._rollouts = self._rollouts
        return flow

    @property
    def position(self) -> int:
        """The explained position (refused when there are several: use `at`)."""
        if len(self.positions) != 1:
            raise ValueError(f"this flow explains positions {self.positions}: pick one with flow.at(position)")
        return self.positions[0]

    @property
    def rollout(self) -> Float[Tensor, "layer key"]:
        """Row ``l``: the explained position's residual stream after layer ``l`` over the input tokens."""
        return self.rollout_at(self.position)

    def rollout_at(self, position: int) -> Float[Tensor, "layer key"]:
        """`rollout` of any position: ``e_p M^l M^{l-1} ... M^0`` for every ``l`` (float64 products)."""
        position = as_position(position, len(self.str_tokens[0]))
        if position not in self._rollouts:
            mixings = [self[layer].mixing.double() for layer in self.layers]
            rows = []
            for top in range(len(mixings)):
                row = mixings[top][position]
                for below in range(top - 1, -1, -1):
                    row = row @ mixings[below]
                rows.append(row)
            self._rollouts[position] = torch.stack(rows).float()
        return self._rollouts[position].clone()  # a copy: what a caller changes is not what later reads get

    def graph(self, position: int | None = None, threshold: float | None = None) -> pd.DataFrame:
        """The pruned graph of ``position`` (default: the explained one): one row per kept edge.

        Nodes are (column, position): column ``l`` is the stream entering layer ``l`` and column
        ``n_layers`` the stream after the last. Columns: ``layer, head`` (-1: the residual),
        ``source`` (position in column ``layer``), ``target`` (in ``layer + 1``), their tokens,
        ``attention, relative_norm, cosine, weight``.
        """
        position = self.position if position is None else as_position(position, len(self.str_tokens[0]))
        threshold = self.threshold if threshold is None else as_threshold(threshold)
        if threshold < self.threshold:
            raise ValueError(f"threshold {threshold:g} is below the {self.threshold:g} the edges were kept at")
        table = self.to_dataframe(min_abs_weight=threshold)
        kept, frontier = [], {position}
        for layer in reversed(self.layers):
            rows = table[(table["layer"] == layer) & table["target"].isin(frontier)]
            kept.append(rows)
            frontier = set(rows["source"].tolist())
        return pd.concat(kept[::-1], ignore_index=True)

    def to_dataframe(self, *, layers: int | Sequence[int] | None = None, min_abs_weight: float = 0.0) -> pd.DataFrame:
        """Every kept edge and every residual term as a tidy table (columns as in `graph`)."""
        chosen = self.layers if layers is None else [self.resolve(x) for x in as_indices(layers, "layers")]
        tokens = self.str_tokens[0]
        frames = []
        for layer in chosen:
            value = self[layer]
            e = value.edges
            n = value.residual.shape[0]
            nan = torch.full((n,), float("nan"))
            frames.append(
                pd.DataFrame(
                    {
                        "layer": layer,
                        "head": torch.cat([e.head, torch.full((n,), -1)]).numpy(),
                        "source": torch.cat([e.key, torch.arange(n)]).numpy(),
                        "target": torch.cat([e.query, torch.arange(n)]).numpy(),
                        "attention": torch.cat([e.attention, nan]).numpy(),
                        "relative_norm": torch.cat([e.relative_norm, nan]).numpy(),
                        "cosine": torch.cat([e.cosine, nan]).numpy(),
                        "weight": torch.cat([e.weight, value.residual.float()]).numpy(),
                    }
                )
            )
        table = pd.concat(frames, ignore_index=True)
        table = table[table["weight"].abs() >= min_abs_weight].reset_index(drop=True)
        table.insert(3, "source_token", [tokens[i] for i in table["source"]])
        table.insert(5, "target_token", [tokens[i] for i in table["target"]])
        return table

    def figures(self) -> "dict[str, go.Figure]":
        """``{"graph": ..., "rollout": ...}``: the pruned graph and the rollout heatmap of the explained position.

        A flow explaining several positions draws both for each: ``"graph at 7"``, ``"rollout at 7"``, ...
        """
        from contribution_lens.drawing import plot

        if len(self.positions) == 1:
            return {"graph": plot.flow_graph(self), "rollout": plot.flow_rollout(self)}
        drawn = {}
        for position in self.positions:
            drawn[f"graph at {position}"] = plot.flow_graph(self, position=position)
            drawn[f"rollout at {position}"] = plot.flow_rollout(self, position=position)
        return drawn

    def report(self, path: str | os.PathLike) -> Path:
        """One self-contained HTML page: the figures, then the pruned graph's edges of each explained position."""
        from contribution_lens.drawing import html

        labels = self.labels()
        sections: list[html.Section] = [("Text", "".join(self.str_tokens[0])), *self.figures().items()]
        for position in self.positions:
            heading = f"The pruned graph of {labels[position]} (|weight| ≥ {self.threshold:g})"
            sections.append((heading, self.graph(position)))
        return html.write_html(path, f"Flow into {', '.join(labels[p] for p in self.positions)}", sections)


def flow(
    model: adapter.Model,
    inputs: str | Tensor,
    position: int | Sequence[int] = -1,
    *,
    threshold: float = DEFAULT_THRESHOLD,
    prepend_bos: bool | None = None,
) -> Flow:
    """The signed token mixing of every layer and its rollout at ``position``, in one forward pass.

    Args:
        model: a TransformerLens ``TransformerBridge`` (decoder or encoder).
        inputs: one text, or token ids ``[pos]`` / ``[1 pos]``.
        position: the explained position(s) (negative ones count from the end); several share
            the one pass (``flow.at(p)`` picks one).
        threshold: the smallest ``|w_ij^h|`` kept as an edge of the graph.
        prepend_bos: prepend the tokenizer's BOS to a text; None: the model's own choice
            (``cfg.default_prepend_bos``).

    Every layer keeps its ``[query key]`` mixing (``n_layers * pos^2`` floats) and the edges
    above ``threshold``; the per-head ``[head query key]`` weights live only inside the layer's hook.
    """
    if isinstance(inputs, Tensor) and inputs.ndim == 2 and inputs.shape[0] != 1:
        raise ValueError(f"flow explains one text: got a batch of {inputs.shape[0]} token rows")
    if not isinstance(inputs, str | Tensor):
        raise TypeError(f"flow explains one text (a str or token ids), got {type(inputs).__name__}")
    threshold = as_threshold(threshold)
    batch = adapter.to_token_batch(model, inputs, prepend_bos=prepend_bos)
    n = batch.tokens.shape[1]
    positions = [as_position(p, n) for p in as_indices(position, "positions")]  # bad positions fail before the pass
    readout = adapter.readout(model)
    results = map_layers(
        model, batch, lambda layer: _flow_layer(readout, layer, threshold), capture=list(readout.flow_capture)
    )
    return Flow.from_results(results, positions=positions, threshold=threshold)
