"""Circuit scores of a task, and the circuits they choose: `circuit_scores`, `CircuitScores`, `Circuit`.

A circuit at fraction ``f`` keeps the ``int(f * n)`` edges (or heads and MLPs) of largest
``|score|`` (MIB's ``apply_topn``, without its pruning of edges that reach neither the input nor
the logits: such an edge changes nothing in the patched pass). Node level keeps every edge out of
a kept node, and the embeddings and logits always (`Graph.edges_of_nodes`).

Example:
    >>> import torch
    >>> import contribution_lens as cl
    >>> model = cl.load_model()
    >>> ids = torch.randint(100, 1000, (2, 6), generator=torch.Generator().manual_seed(0))
    >>> task = cl.Task("demo", ids, ids.flip(0), ids[:, 0], ids[:, 1], cl.Task.full_length(ids))
    >>> scores = cl.circuit_scores(model, task, method="random")
    >>> circuit = scores.circuit(0.01)
    >>> len(circuit.edges) == int(0.01 * len(scores.edges))
    True
"""

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from jaxtyping import Bool, Float
from torch import Tensor

from contribution_lens.adapter import Model
from contribution_lens.circuits.graph import Graph, circuit_graph
from contribution_lens.circuits.registry import DEFAULT_MEMORY, LEVELS, CircuitContext, get_circuit_method
from contribution_lens.circuits.task import Task
from contribution_lens.files import Saves


def check_fraction(fraction: Any) -> float:
    if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0 < fraction <= 1:
        raise ValueError(f"fraction must be a number in (0, 1] (the share of edges or nodes kept), got {fraction!r}")
    return float(fraction)


def check_level(level: Any) -> str:
    if level not in LEVELS:
        raise ValueError(f"level must be 'edge' or 'node', got {level!r}")
    return str(level)


@dataclass(frozen=True)
class Circuit(Saves):
    """A set of kept edges (one flag an edge of ``graph``, in `Graph.edges` order).

    ``chosen``: the heads and MLPs a node-level circuit keeps (empty at edge level).
    """

    graph: Graph
    kept: Bool[Tensor, " edge"]
    level: str = "edge"
    fraction: float = math.nan
    chosen: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kept.shape != (len(self.graph.edges),):
            raise ValueError(f"kept has shape {tuple(self.kept.shape)}; the graph has {len(self.graph.edges)} edges")
        object.__setattr__(self, "kept", self.kept.to(torch.bool).cpu())

    @classmethod
    def from_nodes(cls, graph: Graph, nodes: Any, fraction: float = math.nan) -> "Circuit":
        """The node-level circuit keeping ``nodes`` (heads and MLPs; embeddings and logits are always kept)."""
        names = [nodes] if isinstance(nodes, str) else list(nodes)
        graph.check_nodes(names)
        chosen = tuple(name for name in graph.components if name in set(names))
        return cls(graph, graph.edges_of_nodes(set(chosen)), "node", fraction, chosen)

    @classmethod
    def from_edges(cls, graph: Graph, edges: Any, fraction: float = math.nan) -> "Circuit":
        """The circuit keeping the edges named in ``edges`` (``"L0H1->L2H3<q>"``, as in `Graph.edges`)."""
        names = [edges] if isinstance(edges, str) else list(edges)
        unknown = [name for name in names if name not in graph.edge_ids]
        if unknown:
            raise ValueError(
                f"edges: unknown edge {unknown[0]!r}; edges are named as in Graph.edges, e.g. {graph.edges[0]!r}"
            )
        kept = torch.zeros(len(graph.edges), dtype=torch.bool)
        kept[[graph.edge_ids[name] for name in names]] = True
        return cls(graph, kept, "edge", fraction)

    @property
    def edges(self) -> list[str]:
        """The kept edges' names."""
        return [self.graph.edges[i] for i in torch.nonzero(self.kept)[:, 0].tolist()]

    @property
    def nodes(self) -> list[str]:
        """The nodes in the circuit: the kept ones (node level), or those a kept edge joins (edge level)."""
        if self.level == "node":
            return [*self.graph.writers[: self.graph.n_embeddings], *self.chosen, "logits"]
        writers, inputs = self.graph.edge_index
        touched = {self.graph.writers[u] for u in writers[self.kept].tolist()}
        for i in set(inputs[self.kept].tolist()):
            touched.update(self.graph.input_nodes[i])
        return [name for name in self.graph.nodes if name in touched]

    def patch(self) -> Float[Tensor, "writer input"]:
        """1 where an edge of the graph carries the counterfactual, 0 where it is kept or is no edge."""
        return (self.graph.valid & ~self.graph.edge_mask(self.kept)).float()

    def __repr__(self) -> str:
        size = f"{len(self.chosen)} of {len(self.graph.components)} nodes" if self.level == "node" else ""
        size = size or f"{int(self.kept.sum())} of {len(self.graph.edges)} edges"
        return f"Circuit({self.level} level: {size})"

    def figures(self) -> dict[str, Any]:
        """``nodes``: the heads and MLPs in the circuit, layer by layer."""
        from contribution_lens.drawing.circuit_figures import circuit_nodes_figure

        return {"nodes": circuit_nodes_figure(self.graph.components, self.nodes)}

    def report(self, path: str | os.PathLike) -> Path:
        from contribution_lens.drawing import html

        table = pd.DataFrame({"edge": self.edges})
        return html.write_html(path, repr(self), [*self.figures().items(), ("Edges", table)])


@dataclass(frozen=True)
class CircuitScores(Saves):
    """One method's scores of a task: ``component_scores`` (heads and MLPs) and ``edge_scores`` (None: node level)."""

    task: str
    method: str
    graph: Graph
    component_scores: Float[Tensor, " component"]
    edge_scores: Float[Tensor, " edge"] | None = None
    n_prompts: int = 0
    seed: int = 0

    @property
    def nodes(self) -> pd.DataFrame:
        """One row a head or MLP: ``node``, ``layer``, ``head`` (-1 for an MLP), ``score``."""
        names = self.graph.components
        layers = [int(name[1:].split("H")[0].split(".")[0]) for name in names]
        heads = [int(name.split("H")[1]) if "H" in name else -1 for name in names]
        return pd.DataFrame({"node": names, "layer": layers, "head": heads, "score": self.component_scores.numpy()})

    @property
    def edges(self) -> pd.DataFrame:
        """One row an edge: ``edge``, ``source``, ``target`` (an input), ``score``; empty for a node-level method."""
        if self.edge_scores is None:
            return pd.DataFrame({"edge": [], "source": [], "target": [], "score": []})
        writers, inputs = self.graph.edge_index
        return pd.DataFrame(
            {
                "edge": self.graph.edges,
                "source": [self.graph.writers[u] for u in writers.tolist()],
                "target": [self.graph.inputs[i] for i in inputs.tolist()],
                "score": self.edge_scores.numpy(),
            }
        )

    def circuit(self, fraction: float, level: str = "edge") -> Circuit:
        """The circuit of the ``int(fraction * n)`` edges (or nodes) of largest ``|score|``."""
        fraction = check_fraction(fraction)
        level = check_level(level)
        if level == "edge" and self.edge_scores is None:
            raise ValueError(f"level: {self.method!r} scores nodes only; ask for level='node'")
        scores = self.edge_scores if level == "edge" else self.component_scores
        assert scores is not None
        count = int(fraction * len(scores))
        order = torch.sort(scores.abs(), descending=True, stable=True).indices[:count]
        if level == "node":
            return Circuit.from_nodes(self.graph, [self.graph.components[i] for i in order.tolist()], fraction)
        kept = torch.zeros(len(scores), dtype=torch.bool)
        kept[order] = True
        return Circuit(self.graph, kept, "edge", fraction)

    def __repr__(self) -> str:
        size = f"{len(self.graph.edges)} edges, " if self.edge_scores is not None else ""
        return (
            f"CircuitScores({self.method} on {self.task}: {size}{len(self.graph.components)} nodes, "
            f"{self.n_prompts} prompts)"
        )

    def figures(self) -> dict[str, Any]:
        """``nodes``: each head's and MLP's score, layer by layer."""
        from contribution_lens.drawing.circuit_figures import node_scores_figure

        return {"nodes": node_scores_figure(self.nodes, f"{self.method} on {self.task}")}

    def report(self, path: str | os.PathLike) -> Path:
        from contribution_lens.drawing import html

        top = self.edges.reindex(self.edges["score"].abs().sort_values(ascending=False).index).head(30)
        sections: list[Any] = [*self.figures().items(), ("The 30 edges of largest |score|", top)]
        return html.write_html(path, repr(self), sections)


def check_task(model: Model, task: Any) -> Task:
    """Refuse what is not a `Task`, or token ids outside the model's vocabulary, before any pass."""
    if not isinstance(task, Task):
        raise ValueError(f"task must be a contribution_lens Task, got {type(task).__name__}")
    vocab = int(model.cfg.d_vocab)
    for name in ("clean", "corrupted", "answer", "foil"):
        ids = getattr(task, name)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise ValueError(f"task.{name}: token ids must lie in [0, {vocab}) (the model's vocabulary)")
    if int(task.last.min()) < 0 or int(task.last.max()) >= task.clean.shape[1]:
        raise ValueError(f"task.last: positions must lie in [0, {task.clean.shape[1]})")
    from contribution_lens.circuits.interchange import check_metric

    check_metric(task)
    return task


def circuit_scores(
    model: Model, task: Task, method: str = "eap", *, memory: int = DEFAULT_MEMORY, seed: int = 0, steps: int = 5
) -> CircuitScores:
    """Score every edge (or node) of ``model``'s circuit graph on ``task`` with the circuit method ``method``.

    ``memory``: bytes one batch's activation differences may take (prompts are batched to fit; the
    gradient methods split a prompt that does not fit alone into windows of positions, each its own passes);
    ``steps``: integrated-gradient steps (``eap-ig``). Everything is checked before any pass.
    """
    chosen = get_circuit_method(method)
    check_task(model, task)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    if isinstance(memory, bool) or not isinstance(memory, int) or memory < 1:
        raise ValueError(f"memory must be a positive number of bytes, got {memory!r}")
    graph = circuit_graph(model)
    context = CircuitContext(graph, memory, seed, steps)
    scores = chosen.score_fn(model, task, context).detach().float().cpu()
    expected = len(graph.edges) if chosen.level == "edge" else len(graph.components)
    if scores.shape != (expected,):
        raise ValueError(f"circuit method {chosen.name!r} returned {tuple(scores.shape)}; expected ({expected},)")
    if chosen.level == "node":
        return CircuitScores(task.name, chosen.name, graph, scores, None, len(task), seed)
    return CircuitScores(task.name, chosen.name, graph, node_sums(graph, scores), scores, len(task), seed)


def node_sums(graph: Graph, edge_scores: Float[Tensor, " edge"]) -> Float[Tensor, " component"]:
    """Each head's and MLP's score: the sum of its outgoing edges' scores."""
    totals = torch.zeros(len(graph.writers), dtype=torch.float64)
    totals.index_add_(0, graph.edge_index[0], edge_scores.double())
    return totals[graph.n_embeddings :].float()
