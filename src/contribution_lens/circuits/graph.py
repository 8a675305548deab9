"""The circuit graph: nodes that write into the residual stream, the inputs that read it, and edges.

Nodes, in forward order: ``embed``, ``pos_embed`` (learned positions only), then per layer ``l``
its heads ``L{l}H{h}`` and its MLP ``L{l}.mlp``, and last ``logits``. Each node but ``logits``
writes into the stream; each input reads it. The inputs (MIB's edge level): per layer the q input
of every head (``L{l}H{h}<q>``), the k and v inputs of every key head, the MLP's input
(``L{l}.mlp``) and the logits' input (``logits``). An edge ``u -> i`` joins every node ``u`` to
every input ``i`` downstream of it (a layer's heads are upstream of its MLP, not of each other).

Grouped-query attention: the heads of a group share one key and one value projection, so in the
``"native"`` counting their k and v inputs are one per key head, named ``L{l}KV{g}<k>`` and
``L{l}KV{g}<v>`` (key head ``g`` serves query heads ``g * group ... (g + 1) * group - 1``), and a
layer has ``n_heads + 2 n_kv_heads + 1`` inputs: the graph counts what the model computes. In the
``"mib"`` counting (MIB's ``ungroup_grouped_query_attention``) every query head has its own k and v
input, ``L{l}H{h}<k>`` and ``L{l}H{h}<v>``, read from its own copy of the stream and projected by its
key head's weights: ``3 n_heads + 1`` inputs a layer, and a patched pass hands each query head keys
and values computed from its own input. Under multi-head attention (one query head a key head) the
two countings are the same graph, with MIB's names. Qwen2.5-0.5B (24 layers, 14 heads, 2 key heads)
has 79,813 edges natively and 179,749 in MIB's counting.

Example:
    >>> from contribution_lens.circuits.graph import Graph
    >>> graph = Graph(n_layers=2, n_heads=2, n_kv_heads=1, pos_embed=False)
    >>> graph.nodes[:4], graph.inputs[:4]
    (['embed', 'L0H0', 'L0H1', 'L0.mlp'], ['L0H0<q>', 'L0H1<q>', 'L0KV0<k>', 'L0KV0<v>'])
    >>> len(graph.edges), graph.edges[0]
    (36, 'embed->L0H0<q>')
    >>> Graph(n_layers=2, n_heads=2, n_kv_heads=1, pos_embed=False, counting="mib").inputs[:6]
    ['L0H0<q>', 'L0H1<q>', 'L0H0<k>', 'L0H1<k>', 'L0H0<v>', 'L0H1<v>']
    >>> graph.n_edges("native"), graph.n_edges("mib")
    (36, 46)
"""

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

COUNTINGS = ("native", "mib")
"""How a grouped-query model's k and v inputs are counted: one per key head (as the model computes
them) or one per query head (MIB's ungrouped graph)."""


def check_counting(edges: Any) -> str:
    """``edges`` if it names one of `COUNTINGS`, else a ValueError naming the argument."""
    if edges not in COUNTINGS:
        raise ValueError(
            f"edges must be 'native' (k and v inputs one per key head, as the model computes them) or 'mib' "
            f"(one per query head, MIB's ungrouped graph), got {edges!r}"
        )
    return str(edges)


@dataclass(frozen=True)
class Graph:
    """The nodes, inputs and edges of a model's circuit graph, with their index maps.

    ``writers`` are the nodes that write (all but ``logits``), in forward order; ``components``
    the heads and MLPs (what node-level circuits choose among; ``embed``, ``pos_embed`` and
    ``logits`` are in every circuit). ``counting``: one of `COUNTINGS` (the module docstring).
    ``d_model`` and ``model`` (the model's width and name, where known) take no part in comparisons:
    MIB's graph files carry them (`contribution_lens.circuits.mib_format`).
    """

    n_layers: int
    n_heads: int
    n_kv_heads: int
    pos_embed: bool
    counting: str = "native"
    d_model: int | None = field(default=None, compare=False)
    model: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        check_counting(self.counting)

    @property
    def group(self) -> int:
        """Query heads per key head (the model's)."""
        return self.n_heads // self.n_kv_heads

    @property
    def kv_inputs(self) -> int:
        """k inputs (and v inputs) a layer: one a key head (``"native"``), one a query head (``"mib"``)."""
        return self.n_heads if self.counting == "mib" else self.n_kv_heads

    @property
    def kv_group(self) -> int:
        """Query heads that read one k (or v) input: the model's group natively, 1 in MIB's counting."""
        return self.n_heads // self.kv_inputs

    @property
    def layer_inputs(self) -> int:
        """Inputs a layer: its q, k and v inputs and its MLP's."""
        return self.n_heads + 2 * self.kv_inputs + 1

    def n_edges(self, counting: str | None = None) -> int:
        """Edges in ``counting`` (one of `COUNTINGS`; None: this graph's own), without building either graph."""
        other = self if counting is None else replace(self, counting=check_counting(counting))
        return int(other.upstream.sum())

    def recounted(self, counting: str) -> "Graph":
        """The graph of the same model in ``counting`` (itself where that is its own)."""
        return self if counting == self.counting else replace(self, counting=check_counting(counting))

    @cached_property
    def native_input(self) -> Int[Tensor, " input"]:
        """For each input, the index of the input of the native graph that reads for it.

        Itself in the native graph; in MIB's, a query head's k (v) input maps to its key head's.
        """
        native = self.recounted("native")
        index: list[int] = []
        for layer in range(self.n_layers):
            start = layer * native.layer_inputs
            index += range(start, start + self.n_heads)
            for side in range(2):
                first = start + self.n_heads + side * self.n_kv_heads
                index += [first + j * self.kv_group // self.group for j in range(self.kv_inputs)]
            index.append(start + native.layer_inputs - 1)
        return torch.tensor([*index, len(native.inputs) - 1])

    @property
    def n_embeddings(self) -> int:
        return 1 + int(self.pos_embed)

    def layer_start(self, layer: int) -> int:
        """The index in `writers` of ``L{layer}H0``."""
        return self.n_embeddings + layer * (self.n_heads + 1)

    @cached_property
    def writers(self) -> list[str]:
        names = ["embed", "pos_embed"][: self.n_embeddings]
        for layer in range(self.n_layers):
            names += [f"L{layer}H{h}" for h in range(self.n_heads)] + [f"L{layer}.mlp"]
        return names

    @cached_property
    def nodes(self) -> list[str]:
        """Every node: the writers, then ``logits``."""
        return [*self.writers, "logits"]

    @cached_property
    def components(self) -> list[str]:
        """The heads and MLPs, in forward order."""
        return self.writers[self.n_embeddings :]

    def _kv(self, layer: int, g: int, side: str) -> str:
        return f"L{layer}H{g}<{side}>" if self.kv_group == 1 else f"L{layer}KV{g}<{side}>"

    @cached_property
    def inputs(self) -> list[str]:
        """Every input, in forward order: per layer q, k, v inputs and the MLP's, then ``logits``."""
        names: list[str] = []
        for layer in range(self.n_layers):
            names += [f"L{layer}H{h}<q>" for h in range(self.n_heads)]
            for side in "kv":
                names += [self._kv(layer, g, side) for g in range(self.kv_inputs)]
            names.append(f"L{layer}.mlp")
        return [*names, "logits"]

    def input_range(self, kind: str, layer: int) -> tuple[int, int]:
        """The slice of `inputs` read at ``kind`` (q, k, v, mlp, logits) of ``layer``."""
        if kind == "logits":
            return len(self.inputs) - 1, len(self.inputs)
        start = layer * self.layer_inputs
        kv = self.kv_inputs
        sizes = {"q": (0, self.n_heads), "k": (self.n_heads, kv), "v": (self.n_heads + kv, kv)}
        sizes["mlp"] = (self.n_heads + 2 * kv, 1)
        offset, size = sizes[kind]
        return start + offset, start + offset + size

    def input_group(self, kind: str, layer: int) -> tuple[int, int]:
        """The slice of `inputs` read from one stream together: a layer's q, k and v inputs, else ``kind``'s own."""
        if kind in ("q", "k", "v"):
            return self.input_range("q", layer)[0], self.input_range("v", layer)[1]
        return self.input_range(kind, layer)

    def writer_range(self, kind: str, layer: int) -> tuple[int, int]:
        """The slice of `writers` written at ``kind`` (embed, pos_embed, heads, mlp) of ``layer``."""
        if kind == "embed":
            return 0, 1
        if kind == "pos_embed":
            return 1, 2
        start = self.layer_start(layer)
        return (start, start + self.n_heads) if kind == "heads" else (start + self.n_heads, start + self.n_heads + 1)

    def writer_layer(self, index: int) -> int:
        """The layer whose block holds writer ``index`` of `writers` (an embedding: 0, the first block reads it)."""
        return max(0, (index - self.n_embeddings) // (self.n_heads + 1))

    @cached_property
    def upstream(self) -> Int[Tensor, " input"]:
        """For each input, how many writers are upstream of it (they are the first ones)."""
        counts = []
        for layer in range(self.n_layers):
            counts += [self.layer_start(layer)] * (self.layer_inputs - 1)
            counts.append(self.layer_start(layer) + self.n_heads)
        return torch.tensor([*counts, len(self.writers)])

    @cached_property
    def valid(self) -> Bool[Tensor, "writer input"]:
        """Whether writer ``u`` is upstream of input ``i``: the edges as a dense mask."""
        return torch.arange(len(self.writers))[:, None] < self.upstream[None, :]

    @cached_property
    def edge_index(self) -> tuple[Int[Tensor, " edge"], Int[Tensor, " edge"]]:
        """(writer, input) of every edge, input by input (the order of `edges`)."""
        inputs, writers = torch.nonzero(self.valid.T, as_tuple=True)
        return writers, inputs

    @cached_property
    def edges(self) -> list[str]:
        """Every edge's name, ``"{writer}->{input}"``."""
        writers, inputs = self.edge_index
        return [f"{self.writers[u]}->{self.inputs[i]}" for u, i in zip(writers.tolist(), inputs.tolist(), strict=True)]

    @cached_property
    def edge_ids(self) -> dict[str, int]:
        return {name: index for index, name in enumerate(self.edges)}

    @cached_property
    def node_ids(self) -> dict[str, int]:
        return {name: index for index, name in enumerate(self.nodes)}

    @cached_property
    def input_nodes(self) -> list[list[str]]:
        """For each input, the nodes that read it (a key head's group of query heads)."""
        readers: list[list[str]] = []
        for layer in range(self.n_layers):
            readers += [[f"L{layer}H{h}"] for h in range(self.n_heads)]
            size = self.kv_group
            group = [[f"L{layer}H{h}" for h in range(g * size, (g + 1) * size)] for g in range(self.kv_inputs)]
            readers += group + group + [[f"L{layer}.mlp"]]
        return [*readers, ["logits"]]

    def edge_mask(self, kept: Bool[Tensor, " edge"]) -> Bool[Tensor, "writer input"]:
        """``kept`` (one flag an edge, in `edges` order) as a dense ``[writer input]`` mask."""
        return self.dense(kept.to(torch.bool))

    def dense(self, values: Tensor) -> Tensor:
        """``values`` (one an edge, in `edges` order) as a dense ``[writer input]`` matrix, zero where no edge is."""
        dense = values.new_zeros(self.valid.shape, device="cpu")
        writers, inputs = self.edge_index
        dense[writers, inputs] = values.cpu()
        return dense

    def recount_kept(self, kept: Bool[Tensor, " edge"], counting: str) -> Bool[Tensor, " recounted_edge"]:
        """``kept`` (one flag an edge of this graph) as the same circuit on the graph of ``counting``.

        Into MIB's counting a key head's k (v) edge becomes the edges of its group's query heads; back,
        the query heads of a group must keep the same k (v) edges, else a ValueError names the first
        edge whose group differs (such a circuit has no native form).
        """
        target = self.recounted(counting)
        if target == self:
            return kept
        dense = self.edge_mask(kept)
        if target.counting == "mib":
            return self._edges_of(target, dense[:, target.native_input])
        moved = torch.zeros(target.valid.shape, dtype=torch.bool)
        moved[:, self.native_input] = dense
        differs = (moved[:, self.native_input] != dense)[self.edge_index]
        if bool(differs.any()):
            first = self.edges[int(torch.nonzero(differs)[0, 0])]
            raise ValueError(
                f"edges: the circuit keeps {first!r} differently from another query head of its group; "
                "the native graph has one k and one v input per key head"
            )
        return self._edges_of(target, moved)

    def recount_scores(self, scores: Float[Tensor, " edge"], counting: str) -> Float[Tensor, " recounted_edge"]:
        """``scores`` (one an edge of this graph) on the graph of ``counting``.

        Into MIB's counting a key head's k (v) edge's score is split evenly over its group's query heads
        (their sum is the score); back, a group's query heads' scores are summed: for a gradient
        method that is exactly the score of the input they share (its gradient is the sum of theirs).
        """
        target = self.recounted(counting)
        if target == self:
            return scores
        dense = self.dense(scores)
        if target.counting == "mib":
            shares = torch.bincount(target.native_input, minlength=len(self.inputs)).to(dense.dtype)
            return self._edges_of(target, (dense / shares)[:, target.native_input])
        summed = dense.new_zeros(target.valid.shape).index_add_(1, self.native_input, dense)
        return self._edges_of(target, summed)

    @staticmethod
    def _edges_of(graph: "Graph", dense: Tensor) -> Tensor:
        writers, inputs = graph.edge_index
        return dense[writers, inputs]

    def edges_of_nodes(self, nodes: set[str]) -> Bool[Tensor, " edge"]:
        """The node-level circuit's edges: every edge out of a kept node (the embeddings are always kept).

        Every other edge leaves a left-out node, so the pass equals replacing the left-out nodes'
        outputs by the counterfactual's. Edges into a left-out node are kept too: without
        post-attention norms they change nothing (its output is replaced), and with them the norm's
        scale, which a layer's heads share, then sees that node as the node-patched pass does.
        """
        kept = nodes | {"embed", "pos_embed"}
        source = torch.tensor([name in kept for name in self.writers])
        return source[self.edge_index[0]]

    def check_nodes(self, names: list[str] | set[str] | tuple[str, ...], argument: str = "nodes") -> None:
        """Refuse a name that is not a node of this graph, naming ``argument``."""
        unknown = [name for name in names if name not in self.node_ids]
        if unknown:
            positions = "'pos_embed', " if self.pos_embed else ""
            raise ValueError(
                f"{argument}: unknown node {unknown[0]!r}; nodes are 'embed', {positions}"
                f"'L{{layer}}H{{head}}' (layer < {self.n_layers}, head < {self.n_heads}), 'L{{layer}}.mlp' and 'logits'"
            )


def circuit_graph(model: Any, edges: str = "native") -> Graph:
    """The `Graph` of ``model``, from its config; a model whose graph cannot be wired is refused with the reason.

    ``edges``: ``"native"`` (k and v inputs one per key head) or ``"mib"`` (one per query head, MIB's
    ungrouped graph: the module docstring); a model whose attention cannot be ungrouped is refused
    for ``"mib"``.
    """
    from contribution_lens.adapter import check_circuit_model, layout

    counting = check_counting(edges)
    check_circuit_model(model, ungrouped=counting == "mib")
    shape = layout(model)
    name = getattr(model.cfg, "model_name", None)
    return Graph(
        shape.n_layers, shape.n_heads, shape.n_kv_heads, shape.pos_embed, counting,
        int(model.cfg.d_model), str(name) if name else None,
    )  # fmt: skip
