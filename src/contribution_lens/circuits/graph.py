"""The circuit graph: nodes that write into the residual stream, the inputs that read it, and edges.

Nodes, in forward order: ``embed``, ``pos_embed`` (learned positions only), then per layer ``l``
its heads ``L{l}H{h}`` and its MLP ``L{l}.mlp``, and last ``logits``. Each node but ``logits``
writes into the stream; each input reads it. The inputs (MIB's edge level): per layer the q input
of every head (``L{l}H{h}<q>``), the k and v inputs of every key head, the MLP's input
(``L{l}.mlp``) and the logits' input (``logits``). An edge ``u -> i`` joins every node ``u`` to
every input ``i`` downstream of it (a layer's heads are upstream of its MLP, not of each other).

Grouped-query attention: the heads of a group share one key and one value projection, so their k
and v inputs are one per key head, named ``L{l}KV{g}<k>`` and ``L{l}KV{g}<v>`` (key head ``g``
serves query heads ``g * group ... (g + 1) * group - 1``); under multi-head attention (one query
head a key head) they are ``L{l}H{h}<k>`` as in MIB. MIB ungroups the keys and values of its
GQA models (one k and v input per query head); here they are counted as the model computes them,
so a layer has ``n_heads + 2 n_kv_heads + 1`` inputs.

Example:
    >>> from contribution_lens.circuits.graph import Graph
    >>> graph = Graph(n_layers=2, n_heads=2, n_kv_heads=1, pos_embed=False)
    >>> graph.nodes[:4], graph.inputs[:4]
    (['embed', 'L0H0', 'L0H1', 'L0.mlp'], ['L0H0<q>', 'L0H1<q>', 'L0KV0<k>', 'L0KV0<v>'])
    >>> len(graph.edges), graph.edges[0]
    (36, 'embed->L0H0<q>')
"""

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from jaxtyping import Bool, Int
from torch import Tensor


@dataclass(frozen=True)
class Graph:
    """The nodes, inputs and edges of a model's circuit graph, with their index maps.

    ``writers`` are the nodes that write (all but ``logits``), in forward order; ``components``
    the heads and MLPs (what node-level circuits choose among; ``embed``, ``pos_embed`` and
    ``logits`` are in every circuit).
    """

    n_layers: int
    n_heads: int
    n_kv_heads: int
    pos_embed: bool

    def __post_init__(self) -> None:
        if self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")

    @property
    def group(self) -> int:
        """Query heads per key head."""
        return self.n_heads // self.n_kv_heads

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
        return f"L{layer}H{g}<{side}>" if self.group == 1 else f"L{layer}KV{g}<{side}>"

    @cached_property
    def inputs(self) -> list[str]:
        """Every input, in forward order: per layer q, k, v inputs and the MLP's, then ``logits``."""
        names: list[str] = []
        for layer in range(self.n_layers):
            names += [f"L{layer}H{h}<q>" for h in range(self.n_heads)]
            for side in "kv":
                names += [self._kv(layer, g, side) for g in range(self.n_kv_heads)]
            names.append(f"L{layer}.mlp")
        return [*names, "logits"]

    def input_range(self, kind: str, layer: int) -> tuple[int, int]:
        """The slice of `inputs` read at ``kind`` (q, k, v, mlp, logits) of ``layer``."""
        if kind == "logits":
            return len(self.inputs) - 1, len(self.inputs)
        start = layer * (self.n_heads + 2 * self.n_kv_heads + 1)
        sizes = {"q": (0, self.n_heads), "k": (self.n_heads, self.n_kv_heads)}
        sizes |= {
            "v": (self.n_heads + self.n_kv_heads, self.n_kv_heads),
            "mlp": (self.n_heads + 2 * self.n_kv_heads, 1),
        }
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
            counts += [self.layer_start(layer)] * (self.n_heads + 2 * self.n_kv_heads)
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
            group = [
                [f"L{layer}H{h}" for h in range(g * self.group, (g + 1) * self.group)] for g in range(self.n_kv_heads)
            ]
            readers += group + group + [[f"L{layer}.mlp"]]
        return [*readers, ["logits"]]

    def edge_mask(self, kept: Bool[Tensor, " edge"]) -> Bool[Tensor, "writer input"]:
        """``kept`` (one flag an edge, in `edges` order) as a dense ``[writer input]`` mask."""
        dense = torch.zeros(self.valid.shape, dtype=torch.bool)
        writers, inputs = self.edge_index
        dense[writers, inputs] = kept.to(torch.bool).cpu()
        return dense

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


def circuit_graph(model: Any) -> Graph:
    """The `Graph` of ``model``, from its config; a model whose graph cannot be wired is refused with the reason."""
    from contribution_lens.adapter import check_circuit_model, layout

    check_circuit_model(model)
    shape = layout(model)
    return Graph(shape.n_layers, shape.n_heads, shape.n_kv_heads, shape.pos_embed)
