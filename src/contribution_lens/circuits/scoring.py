"""Circuit scores of a task, and the circuits they choose: `circuit_scores`, `CircuitScores`, `Circuit`.

A circuit at fraction ``f`` keeps ``int(f * n)`` of the ``n`` edges (or heads and MLPs), chosen as
MIB's ``apply_topn`` and ``apply_greedy`` choose them (`CircuitScores.ranking`):

* by ``|score|`` (``absolute=True``, MIB's ``--absolute``), or by signed score (``absolute=False``):
  first the scores that most say "keep this edge clean" (`ScoreOrientation`: the most negative
  effects ``m(patched) - m(clean)``, which are MIB's largest scores, or the largest importances);
* the top ``int(f * n)`` of that key (MIB's ``apply_topn``), or greedily from the logits
  (``greedy=True``, MIB's ``apply_greedy``, edges only): the edges into the logits are the first
  candidates; each edge taken adds its upstream node, whose own input edges become candidates; the
  best candidate is taken next. Greedy's order does not depend on ``n``: the circuit at ``n`` is
  the first ``n`` edges of one order (`greedy_order`).

``prune=True`` then drops every edge on no path of kept edges from an embedding to the logits
(MIB's ``prune``, `prune_edges`). Such an edge changes nothing in the patched pass (its writer's
output reaches the logits only through patched edges, or its inputs are all the counterfactual's:
`contribution_lens.circuits.interchange.active_writers`), except where a post-attention norm mixes
a layer's heads, so f is the same up to float error and there; the edge count is not. Node level
keeps every edge out of a kept node, and the embeddings and logits always (`Graph.edges_of_nodes`).

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

import heapq
import math
import os
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from contribution_lens.adapter import Model
from contribution_lens.circuits.checks import (
    check_fraction,
    check_level,
    check_memory,
    check_seed,
    check_steps,
    check_switch,
    checked_scores,
)
from contribution_lens.circuits.graph import Graph, check_counting, circuit_graph
from contribution_lens.circuits.registry import (
    DEFAULT_MEMORY,
    EFFECT,
    IMPORTANCE,
    CircuitContext,
    ScoreOrientation,
    get_circuit_method,
)
from contribution_lens.circuits.task import Prompts, Task
from contribution_lens.circuits.task_checks import check_task
from contribution_lens.files import Saves


def _reads(graph: Graph) -> Bool[Tensor, "writer input"]:
    """Whether writer ``w`` reads input ``i``: a head its q input and its group's k and v inputs, an MLP its input."""
    index = {name: number for number, name in enumerate(graph.writers)}
    reads = torch.zeros(graph.valid.shape, dtype=torch.bool)
    for i, readers in enumerate(graph.input_nodes):
        for name in readers:
            if name in index:
                reads[index[name], i] = True
    return reads


def prune_edges(graph: Graph, kept: Bool[Tensor, " edge"]) -> Bool[Tensor, " edge"]:
    """The kept edges that lie on a path of kept edges from an embedding to the logits (MIB's ``prune``).

    A writer is *reached* where a kept edge into one of its inputs comes from an embedding or a
    reached writer, and *useful* where a kept edge leads from it to the logits or into an input of
    a useful writer; an edge stays where its writer is reached and it leads to the logits or to a
    useful writer. That is the fixed point MIB's ``prune`` iterates to (nodes with no kept input or
    no kept output removed, then their edges, until nothing changes). A key head's k or v input
    serves its group's heads: an edge into it reaches each of them.

    Example:
        >>> g = Graph(n_layers=2, n_heads=1, n_kv_heads=1, pos_embed=False)
        >>> kept = torch.zeros(len(g.edges), dtype=torch.bool)
        >>> for name in ("embed->L0H0<v>", "L0H0->logits", "L1H0->logits"):  # L1H0 reads nothing kept
        ...     kept[g.edge_ids[name]] = True
        >>> [g.edges[i] for i in torch.nonzero(prune_edges(g, kept))[:, 0].tolist()]
        ['embed->L0H0<v>', 'L0H0->logits']
    """
    dense = graph.edge_mask(kept)
    reads = _reads(graph)
    reached = torch.zeros(len(graph.writers), dtype=torch.bool)
    reached[: graph.n_embeddings] = True
    for w in range(graph.n_embeddings, len(graph.writers)):
        reached[w] = bool((dense[:, reads[w]] & reached[:, None]).any())
    logits = graph.input_range("logits", 0)[0]
    useful_input = torch.zeros(len(graph.inputs), dtype=torch.bool)
    useful_input[logits] = True
    for w in reversed(range(len(graph.writers))):
        if bool((dense[w] & useful_input).any()):
            useful_input |= reads[w]  # every input of a useful writer leads on to the logits
    on_path = dense & reached[:, None] & useful_input[None, :]
    writers, inputs = graph.edge_index
    return on_path[writers, inputs]


def greedy_order(graph: Graph, key: Float[Tensor, " edge"]) -> Int[Tensor, " edge"]:
    """Every edge in the order MIB's ``apply_greedy`` takes them, the largest ``key`` first among the candidates.

    The candidates are the edges into the logits, and the input edges of every writer an edge taken so far
    comes from (added when its first edge is taken). Ties go to the earlier edge of `Graph.edges`.

    Example:
        >>> g = Graph(n_layers=1, n_heads=1, n_kv_heads=1, pos_embed=False)
        >>> key = torch.zeros(len(g.edges))
        >>> key[g.edge_ids["embed->L0H0<q>"]] = 5.0  # the largest, but no candidate until L0H0 is in
        >>> key[g.edge_ids["L0H0->logits"]] = 1.0
        >>> [g.edges[i] for i in greedy_order(g, key)[:3].tolist()]
        ['L0H0->logits', 'embed->L0H0<q>', 'embed->L0H0<k>']
    """
    values = torch.nan_to_num(key.double(), nan=-math.inf).tolist()
    writers, inputs = graph.edge_index
    bounds = torch.cumsum(torch.bincount(inputs, minlength=len(graph.inputs)), 0).tolist()
    reads = [torch.nonzero(row)[:, 0].tolist() for row in _reads(graph)]
    heap: list[tuple[float, int]] = []
    pushed: set[int] = set()

    def candidates(i: int) -> None:
        if i not in pushed:
            pushed.add(i)
            for e in range(bounds[i - 1] if i else 0, bounds[i]):
                heapq.heappush(heap, (-values[e], e))

    candidates(graph.input_range("logits", 0)[0])
    added = [False] * len(graph.writers)
    order, writer_of = [], writers.tolist()
    while heap:
        _, e = heapq.heappop(heap)
        order.append(e)
        u = writer_of[e]
        if not added[u]:
            added[u] = True
            for i in reads[u]:
                candidates(i)
    return torch.tensor(order, dtype=torch.long)


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

    def with_edges(self, edges: str) -> "Circuit":
        """The same circuit on the graph of the edge counting ``edges`` (``"native"`` or ``"mib"``).

        Into MIB's counting each key head's k (v) edge becomes its group's query heads' edges; back, a
        group's query heads must keep the same edges (`Graph.recount_kept`). A node-level circuit keeps its nodes.
        """
        graph = self.graph.recounted(check_counting(edges))
        if graph == self.graph:
            return self
        if self.level == "node":
            return Circuit.from_nodes(graph, self.chosen, self.fraction)
        return Circuit(graph, self.graph.recount_kept(self.kept, edges), "edge", self.fraction)

    def to_mib(self, path: str | os.PathLike) -> Path:
        """Write the circuit as MIB's JSON graph (`contribution_lens.circuits.mib_format`): ``in_graph`` of every
        edge and node, in MIB's ungrouped counting; every score 0."""
        from contribution_lens.circuits.mib_format import write_mib

        mib = self.with_edges("mib")
        return write_mib(path, mib.graph, kept=mib.kept)

    @classmethod
    def from_mib(cls, model: Model, path: str | os.PathLike, *, edges: str = "mib") -> "Circuit":
        """The circuit a MIB graph file keeps (its edges' ``in_graph``), on ``model``'s graph of ``edges``.

        The file is refused, naming what differs, where its ``cfg`` is another model's; ``edges="native"``
        needs a group's query heads to keep the same k and v edges (`with_edges`).
        """
        from contribution_lens.circuits.mib_format import MibFile

        counting = check_counting(edges)
        graph = circuit_graph(model, counting)
        found = MibFile(path, graph)
        return cls(found.graph, found.kept, "edge").with_edges(counting)

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
    """One method's scores of a task: ``component_scores`` (heads and MLPs) and ``edge_scores`` (None: node level).

    ``prompts``: the prompts scored (`Prompts`: the task, its counterfactual, the part of a split,
    one fingerprint a prompt); ``orientation``: which way the scores point (`ScoreOrientation`,
    what signed selection keeps first); ``greedy``: whether the method's circuits are chosen
    greedily from the logits by default (MIB's choice for the method).
    """

    task: str
    method: str
    graph: Graph
    component_scores: Float[Tensor, " component"]
    edge_scores: Float[Tensor, " edge"] | None = None
    n_prompts: int = 0
    seed: int = 0
    prompts: Prompts | None = None
    orientation: ScoreOrientation = EFFECT
    greedy: bool = False

    def __post_init__(self) -> None:
        """The scores against the graph (one finite score a node, and an edge), the prompts against their count:
        scores built by hand, merged, read from MIB's file or loaded from an edited one are checked alike."""
        object.__setattr__(
            self,
            "component_scores",
            checked_scores(self.component_scores, self.graph.components, self.method, "a head or MLP"),
        )
        if self.edge_scores is not None:
            object.__setattr__(
                self, "edge_scores", checked_scores(self.edge_scores, self.graph.edges, self.method, "an edge")
            )
        if self.prompts is not None and len(self.prompts) != self.n_prompts:
            raise ValueError(
                f"n_prompts is {self.n_prompts} but the prompts recorded are {len(self.prompts)} "
                f"(scores of circuit method {self.method!r})"
            )

    @classmethod
    def from_fields(cls, fields: dict[str, Any]) -> "CircuitScores":
        """Rebuild saved scores; a file written before scores said which way they point is refused."""
        if "orientation" not in fields:
            raise ValueError(
                "these scores were saved by an earlier version, which did not record which way they point "
                "(signed selection, MIB's CPR, needs it): compute them again"
            )
        return cls(**fields)

    @property
    def counterfactual(self) -> str:
        """The counterfactual of the prompts scored (``"custom"`` where none was recorded)."""
        return "custom" if self.prompts is None else self.prompts.counterfactual

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

    def circuit(
        self,
        fraction: float,
        level: str = "edge",
        *,
        absolute: bool = True,
        prune: bool = False,
        greedy: bool | None = None,
    ) -> Circuit:
        """The circuit of ``int(fraction * n)`` edges (or nodes) chosen as MIB chooses them (the module docstring).

        Args:
            fraction: the share of edges (or nodes) chosen, in (0, 1].
            level: ``"edge"`` or ``"node"``.
            absolute: by ``|score|`` (True, the default here and in MIB's ``apply_topn``), or by signed
                score in the direction that keeps the clean behaviour (False; MIB's CPR circuits).
            prune: drop the edges on no path from an embedding to the logits (MIB always prunes).
            greedy: greedy selection from the logits (edges only); None: the method's own choice
                (``self.greedy``: information flow routes, as MIB evaluates them).

        Example:
            >>> import torch
            >>> from contribution_lens.circuits.graph import Graph
            >>> graph = Graph(n_layers=1, n_heads=1, n_kv_heads=1, pos_embed=False)
            >>> effects = torch.linspace(-0.5, 1.0, len(graph.edges))  # 8 edges, m(patched) - m(clean)
            >>> scores = CircuitScores("toy", "hand", graph, torch.zeros(2), effects)
            >>> scores.circuit(0.125).edges, scores.circuit(0.125, absolute=False).edges
            (['L0.mlp->logits'], ['embed->L0H0<q>'])
        """
        fraction = check_fraction(fraction)
        level = check_level(level)
        order = self.ranking(level, absolute=absolute, greedy=greedy)
        return self.circuit_of(
            order[: int(fraction * len(order))], level, fraction, prune=bool(check_switch(prune, "prune"))
        )

    def ranking(
        self, level: str = "edge", *, absolute: bool = True, greedy: bool | None = None
    ) -> Int[Tensor, " item"]:
        """Every edge's (or node's) index in the order the selection takes them: a circuit of ``k`` is the first ``k``.

        ``absolute`` and ``greedy`` as in `circuit`. Top-n ties keep `Graph.edges` order (a stable sort).
        """
        level = check_level(level)
        check_switch(absolute, "absolute")
        greedy = check_switch(greedy, "greedy", optional=True)
        if level == "edge" and self.edge_scores is None:
            raise ValueError(f"level: {self.method!r} scores nodes only; ask for level='node'")
        if greedy and level == "node":
            raise ValueError("greedy: greedy selection from the logits chooses edges; at node level pass greedy=False")
        scores = self.edge_scores if level == "edge" else self.component_scores
        assert scores is not None
        key = scores.abs() if absolute else self.orientation.keep_key(scores)
        if level == "edge" and (self.greedy if greedy is None else greedy):
            return greedy_order(self.graph, key)
        return torch.sort(torch.nan_to_num(key.double(), nan=-math.inf), descending=True, stable=True).indices

    def circuit_of(self, chosen: Int[Tensor, " kept"], level: str, fraction: float, *, prune: bool) -> Circuit:
        """The circuit keeping the edges (or nodes) ``chosen`` (indices), pruned with ``prune``."""
        if level == "node":
            circuit = Circuit.from_nodes(self.graph, [self.graph.components[i] for i in chosen.tolist()], fraction)
        else:
            kept = torch.zeros(len(self.graph.edges), dtype=torch.bool)
            kept[chosen] = True
            circuit = Circuit(self.graph, kept, "edge", fraction)
        if not prune:
            return circuit
        return Circuit(self.graph, prune_edges(self.graph, circuit.kept), level, fraction, circuit.chosen)

    def with_edges(self, edges: str) -> "CircuitScores":
        """The scores on the graph of the edge counting ``edges`` (`Graph.recount_scores`): into MIB's, a key
        head's edge's score split evenly over its group's query heads; back, theirs summed. Node scores stay."""
        graph = self.graph.recounted(check_counting(edges))
        if graph == self.graph or self.edge_scores is None:
            return replace(self, graph=graph)
        return replace(self, graph=graph, edge_scores=self.graph.recount_scores(self.edge_scores, edges))

    def to_mib(self, path: str | os.PathLike) -> Path:
        """Write the scores as MIB's JSON graph (`contribution_lens.circuits.mib_format`): every edge's score, or
        (a node-level method) every head's and MLP's, as MIB's node-level scores; nothing ``in_graph`` but the logits.

        The scores are written in MIB's sign, larger meaning keep (``self.orientation.keep_key``): an
        effect ``m(patched) - m(clean)`` is written negated, as MIB's own attribution writes it (its
        metric is the negated logit difference), so MIB's ``apply_topn(absolute=False)`` on the file
        chooses this package's signed circuits. Native scores of a grouped-query model are split evenly
        over each group's query heads (with a warning): score with ``edges="mib"`` for each query head's own.
        """
        from contribution_lens.circuits.mib_format import write_mib

        extra = {"task": self.task, "method": self.method}
        if self.edge_scores is None:
            keep = self.orientation.keep_key(self.component_scores)
            return write_mib(path, self.graph.recounted("mib"), node_scores=keep, extra=extra)
        if self.graph.counting == "native" and self.graph.group > 1:
            warnings.warn(
                "scores of the native graph: each key head's k and v edge's score is split evenly over its group's "
                "query heads in MIB's ungrouped graph; score with edges='mib' for each query head's own",
                stacklevel=2,
            )
        mib = self.with_edges("mib")
        assert mib.edge_scores is not None
        return write_mib(path, mib.graph, edge_scores=self.orientation.keep_key(mib.edge_scores), extra=extra)

    @classmethod
    def from_mib(cls, model: Model, path: str | os.PathLike, *, edges: str = "mib") -> "CircuitScores":
        """The scores in a MIB graph file, on ``model``'s graph of ``edges`` (node-level where its nodes have scores).

        ``task`` and ``method`` are the file's ``cfg`` entries where it has them (else the file's stem
        and ``"mib"``). The scores are MIB's, larger meaning keep, so they are read as importances
        (`IMPORTANCE`): signed selection keeps the largest first, as MIB's ``apply_topn(absolute=False)``
        does. Refused, naming what differs, where the file is another model's.
        """
        from contribution_lens.circuits.mib_format import MibFile

        counting = check_counting(edges)
        graph = circuit_graph(model, counting)
        found = MibFile(path, graph)
        task, method = str(found.cfg.get("task", Path(path).stem)), str(found.cfg.get("method", "mib"))
        if found.node_scores is not None:
            return cls(task, method, graph, found.node_scores, orientation=IMPORTANCE)
        edge_scores = found.graph.recount_scores(found.edge_scores, counting)
        return cls(task, method, graph, node_sums(graph, edge_scores), edge_scores, orientation=IMPORTANCE)

    def __repr__(self) -> str:
        size = f"{len(self.graph.edges)} edges, " if self.edge_scores is not None else ""
        part = "" if self.prompts is None or self.prompts.part == "all" else f", {self.prompts.part} part"
        return (
            f"CircuitScores({self.method} on {self.task}/{self.counterfactual}: {size}{len(self.graph.components)} "
            f"nodes, {self.n_prompts} prompts{part})"
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


def circuit_scores(
    model: Model,
    task: Task,
    method: str = "eap",
    *,
    memory: int = DEFAULT_MEMORY,
    seed: int = 0,
    steps: int = 5,
    edges: str = "native",
) -> CircuitScores:
    """Score every edge (or node) of ``model``'s circuit graph on ``task`` with the circuit method ``method``.

    ``memory``: bytes one batch's activation differences may take (prompts are batched to fit; the
    gradient methods split a prompt that does not fit alone into windows of positions, each its own passes);
    ``steps``: integrated-gradient steps (``eap-ig``); ``edges``: the graph's edge counting, ``"native"``
    or ``"mib"`` (MIB's ungrouped graph: `contribution_lens.circuits.graph`). Everything is checked before any pass
    (`contribution_lens.circuits.checks`: the task against the model, ``memory``, ``seed``, ``steps``), and the
    method's scores after it: one finite number an edge (or node), a NaN or a wrong shape refused naming the
    method; scores that are all 0 (the counterfactual moves nothing the method sees) are warned about.
    """
    chosen = get_circuit_method(method)
    check_task(model, task)
    memory, seed, steps = check_memory(memory), check_seed(seed), check_steps(steps)
    graph = circuit_graph(model, edges)
    context = CircuitContext(graph, memory, seed, steps)
    names = graph.edges if chosen.level == "edge" else graph.components
    scores = checked_scores(
        chosen.score_fn(model, task, context),
        names,
        chosen.name,
        "an edge" if chosen.level == "edge" else "a head or MLP",
    )
    if not bool(scores.any()):
        warnings.warn(
            f"circuit method {chosen.name!r} scored every {chosen.level} 0 on task {task.name!r}: a circuit chosen "
            "from these scores is arbitrary (does the counterfactual move the metric?)",
            UserWarning,
            stacklevel=2,
        )
    edge_scores, nodes = (None, scores) if chosen.level == "node" else (scores, node_sums(graph, scores))
    return CircuitScores(
        task.name, chosen.name, graph, nodes, edge_scores, len(task), seed, task.prompts, chosen.orientation,
        chosen.greedy,
    )  # fmt: skip


def node_sums(graph: Graph, edge_scores: Float[Tensor, " edge"]) -> Float[Tensor, " component"]:
    """Each head's and MLP's score: the sum of its outgoing edges' scores."""
    totals = torch.zeros(len(graph.writers), dtype=torch.float64)
    totals.index_add_(0, graph.edge_index[0], edge_scores.double())
    return totals[graph.n_embeddings :].float()
