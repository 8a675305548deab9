"""MIB's graph files, both ways: circuits and scores as the JSON that MIB's and EAP-IG's ``Graph.from_json`` read.

The file is what EAP-IG's ``Graph.to_json`` writes (one JSON object)::

    {"cfg": {"n_layers": 24, "n_heads": 14, "parallel_attn_mlp": false, "d_model": 896,
             "model_name": "Qwen2.5-0.5B"},
     "nodes": {"input": {"in_graph": true}, "a0.h0": {"in_graph": false}, ..., "logits": {"in_graph": true}},
     "edges": {"input->a0.h0<q>": {"score": 0.031, "in_graph": true}, ..., "m23->logits": {...}}}

``cfg`` holds what MIB's ``Graph.from_model`` builds the graph from; ``model_name`` is written here
and checked when a file is read (MIB's reader keeps extra keys and uses none). A node-level score
file gives each head and MLP a ``score`` (``input`` has none: MIB reads it as unscored, always
kept); an edge-level one gives each edge its score. Node names map both ways:

| here | MIB |
|---|---|
| ``embed``, ``pos_embed`` | ``input`` (token and learned position embeddings, one node) |
| ``L{l}H{h}`` | ``a{l}.h{h}`` |
| ``L{l}.mlp`` | ``m{l}`` |
| ``logits`` | ``logits`` |

and so do edges (``L2H1->L5H3<q>`` is ``a2.h1->a5.h3<q>``). MIB's graph is ungrouped (one k and v
input a query head, `contribution_lens.circuits.graph`): a native grouped circuit is written with
each key head's edge as its group's query heads' edges, and a native score split evenly over them.
Where the model has learned positions, ``input``'s edge is kept where ``embed``'s or
``pos_embed``'s is (a warning says when they differ) and scores the sum of theirs (patching
``input`` patches both); read back, a kept ``input`` edge keeps both and its score is split evenly
between them, so writing what was read gives the file's numbers again.

A file is checked before anything else is read from it: its ``cfg`` against the model (layers,
heads, width, and the model's name where the file has one), then every node's and edge's name.
Every error names the file.
"""

import json
import math
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Bool, Float, Int, Shaped
from torch import Tensor

from contribution_lens.circuits.graph import Graph
from contribution_lens.files import write_text

KEYS = ("cfg", "nodes", "edges")
CFG_KEYS = ("n_layers", "n_heads", "d_model")


def mib_node(graph: Graph, name: str) -> str:
    """MIB's name of node ``name`` of ``graph`` (the embeddings are ``input``)."""
    if name in ("embed", "pos_embed"):
        return "input"
    if name == "logits":
        return name
    if name.endswith(".mlp"):
        return f"m{name[1:-4]}"
    layer, head = name[1:].split("H")
    return f"a{layer}.h{head}"


def mib_writers(graph: Graph) -> list[str]:
    """MIB's forward nodes: ``input``, then each layer's heads and MLP (its ``scores`` rows)."""
    return ["input", *(mib_node(graph, name) for name in graph.components)]


def mib_inputs(graph: Graph) -> list[str]:
    """MIB's names of the inputs of the graph in MIB's counting (its ``scores`` columns, in the same order)."""
    names: list[str] = []
    for layer in range(graph.n_layers):
        names += [f"a{layer}.h{h}<{side}>" for side in "qkv" for h in range(graph.n_heads)]
        names.append(f"m{layer}")
    return [*names, "logits"]


def _writer_rows(graph: Graph) -> Int[Tensor, " writer"]:
    """For each writer of ``graph``, its row of MIB's forward nodes (the embeddings share row 0)."""
    n = graph.n_embeddings
    return torch.cat([torch.zeros(n, dtype=torch.long), torch.arange(1, len(graph.writers) - n + 1)])


def mib_edges(graph: Graph) -> tuple[list[str], Int[Tensor, " mib_edge"], Int[Tensor, " mib_edge"]]:
    """MIB's edges in the order its ``Graph.from_model`` adds them: names, rows (forward node) and columns (input).

    ``graph`` is counted ``"mib"``. Per layer, each upstream node's edges into every head's q, k and
    v inputs (head by head), then each upstream node's edge into the MLP; last, every node's into the logits.
    """
    writers, inputs = mib_writers(graph), mib_inputs(graph)
    per_layer = 3 * graph.n_heads + 1
    rows: list[int] = []
    columns: list[int] = []
    for layer in range(graph.n_layers):
        heads = 1 + layer * (graph.n_heads + 1)
        for u in range(heads):
            for h in range(graph.n_heads):
                rows += [u] * 3
                columns += [layer * per_layer + side * graph.n_heads + h for side in range(3)]
        rows += range(heads + graph.n_heads)
        columns += [layer * per_layer + 3 * graph.n_heads] * (heads + graph.n_heads)
    rows += range(len(writers))
    columns += [len(inputs) - 1] * len(writers)
    names = [f"{writers[u]}->{inputs[i]}" for u, i in zip(rows, columns, strict=True)]
    return names, torch.tensor(rows), torch.tensor(columns)


def _cfg(graph: Graph, extra: dict[str, Any]) -> dict[str, Any]:
    if graph.d_model is None:
        raise ValueError(
            "graph: MIB's files carry the model's width (d_model), which this graph does not know; "
            "build it with cl.circuit_graph(model)"
        )
    cfg: dict[str, Any] = {"n_layers": graph.n_layers, "n_heads": graph.n_heads, "parallel_attn_mlp": False}
    cfg["d_model"] = graph.d_model
    if graph.model:
        cfg["model_name"] = graph.model
    return cfg | extra


def _merged_rows(graph: Graph, dense: Shaped[Tensor, "writer input"], kind: str) -> Shaped[Tensor, "forward input"]:
    """``dense`` ``[writer input]`` with the embeddings' rows made MIB's one ``input`` row (or of ``kept``: any)."""
    n = graph.n_embeddings
    if n == 1:
        return dense
    if kind == "kept":
        if not torch.equal(dense[0], dense[1]):
            differ = int((dense[0] != dense[1]).sum())
            warnings.warn(
                f"{differ} inputs keep the edge from embed or from pos_embed but not both; MIB's input node is "
                "both, so the file keeps both there",
                stacklevel=4,
            )
        top = dense[:n].any(0, keepdim=True)
    else:
        top = dense[:n].sum(0, keepdim=True)
    return torch.cat([top, dense[n:]])


def _in_graph(graph: Graph, kept: Bool[Tensor, "forward input"]) -> list[bool]:
    """Each MIB node's ``in_graph`` as MIB's ``apply_topn`` sets it: an edge out of it and (but ``input``) one into it.

    ``kept`` is MIB's ``[forward input]`` matrix; the logits are always in the graph.
    """
    outgoing = kept.any(1)
    into = kept.any(0)
    ingoing = torch.zeros(len(outgoing), dtype=torch.bool)
    ingoing[0] = True
    for layer in range(graph.n_layers):
        start, per_layer = 1 + layer * (graph.n_heads + 1), 3 * graph.n_heads + 1
        columns = into[layer * per_layer : (layer + 1) * per_layer]
        heads = columns[: 3 * graph.n_heads].view(3, graph.n_heads).any(0)
        ingoing[start : start + graph.n_heads] = heads
        ingoing[start + graph.n_heads] = columns[-1]
    return [*(outgoing & ingoing).tolist(), True]


def write_mib(
    path: str | os.PathLike,
    graph: Graph,
    *,
    kept: Bool[Tensor, " edge"] | None = None,
    edge_scores: Float[Tensor, " edge"] | None = None,
    node_scores: Float[Tensor, " component"] | None = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write MIB's JSON graph of ``graph`` (counted ``"mib"``) to ``path``: its kept edges and its scores.

    ``kept``: one flag an edge (a circuit; else nothing is in the graph but the logits, as MIB's
    attribution leaves it); ``edge_scores``: one an edge (else 0); ``node_scores``: one a head and
    MLP (`Graph.components`), written as MIB's node-level scores. ``extra``: more ``cfg`` keys.
    """
    cfg = _cfg(graph, extra or {})
    names, rows, columns = mib_edges(graph)
    flags = graph.edge_mask(kept if kept is not None else torch.zeros(len(graph.edges), dtype=torch.bool))
    flags = _merged_rows(graph, flags, "kept")
    values = torch.zeros(len(graph.edges), dtype=torch.float64) if edge_scores is None else edge_scores.double()
    values = _merged_rows(graph, graph.dense(values), "scores")
    in_graph = _in_graph(graph, flags)
    nodes: dict[str, dict[str, Any]] = {}
    for index, name in enumerate([*mib_writers(graph), "logits"]):
        nodes[name] = {"in_graph": in_graph[index]}
        if node_scores is not None and 0 < index <= len(graph.components):
            nodes[name]["score"] = float(node_scores[index - 1])
    edge_flags, edge_values = flags[rows, columns].tolist(), values[rows, columns].tolist()
    edges = {
        name: {"score": score, "in_graph": flag}
        for name, score, flag in zip(names, edge_values, edge_flags, strict=True)
    }
    return write_text(path, json.dumps({"cfg": cfg, "nodes": nodes, "edges": edges}))


class MibFile:
    """A MIB graph file read and checked against a model's graph (counted ``"mib"``): ``kept``, ``edge_scores``
    (one an edge of the graph) and ``node_scores`` (one a head and MLP, or None where the file has none)."""

    def __init__(self, path: str | os.PathLike, graph: Graph) -> None:
        self.path, self.graph = Path(path), graph.recounted("mib")
        content = self._content()
        self.cfg: dict[str, Any] = content["cfg"]
        self._check_cfg()
        self.node_scores = self._nodes(content["nodes"])
        self._rows, self._columns, self._kept, self._scores = self._edges(content["edges"])

    def _refuse(self, problem: str) -> ValueError:
        return ValueError(f"path: {self.path}: {problem}")

    def _content(self) -> dict[str, Any]:
        if not self.path.exists():
            raise self._refuse("no such file")
        if not self.path.is_file():
            raise self._refuse("not a file")
        try:
            content = json.loads(self.path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise self._refuse(f"not a JSON file ({error})") from None
        if not isinstance(content, dict):
            raise self._refuse("not a MIB graph: the JSON is not an object with 'cfg', 'nodes' and 'edges'")
        missing = [key for key in KEYS if key not in content]
        if missing:
            raise self._refuse(f"not a MIB graph: it has no {missing[0]!r} (MIB's graphs hold 'cfg', 'nodes', 'edges')")
        for key in KEYS:
            if not isinstance(content[key], dict):
                raise self._refuse(f"{key!r} must be a JSON object, got {type(content[key]).__name__}")
        return content

    def _check_cfg(self) -> None:
        """The file's ``cfg`` against the model's: every difference named, before nodes or edges are read."""
        cfg, graph = self.cfg, self.graph
        missing = [key for key in (*CFG_KEYS, "parallel_attn_mlp") if key not in cfg]
        if missing:
            raise self._refuse(f"its cfg has no {missing[0]!r} (MIB's cfg holds n_layers, n_heads, d_model, ...)")
        model: dict[str, Any] = {"n_layers": graph.n_layers, "n_heads": graph.n_heads, "d_model": graph.d_model}
        if graph.model and "model_name" in cfg:
            model["model_name"] = graph.model
        differ = [
            f"{key} {cfg[key]!r} in the file, {value!r} in the model"
            for key, value in model.items()
            if not _same(cfg[key], value)
        ]
        if cfg["parallel_attn_mlp"]:
            differ.append("parallel_attn_mlp true in the file; the model's attention and MLP run one after the other")
        if differ:
            raise self._refuse(f"a graph of another model: {'; '.join(differ)}")

    def _nodes(self, nodes: dict[str, Any]) -> Tensor | None:
        known = {name: index for index, name in enumerate([*mib_writers(self.graph), "logits"])}
        scores = torch.full((len(known),), math.nan, dtype=torch.float64)
        for name, info in nodes.items():
            if name not in known:
                raise self._refuse(
                    f"unknown node {name!r}; MIB's nodes are 'input', 'a{{layer}}.h{{head}}' (layer < "
                    f"{self.graph.n_layers}, head < {self.graph.n_heads}), 'm{{layer}}' and 'logits'"
                )
            if not isinstance(info, dict) or not isinstance(info.get("in_graph"), bool):
                raise self._refuse(f"node {name!r} must be an object with a boolean 'in_graph'")
            if "score" in info and name != "logits":
                scores[known[name]] = _number(info["score"], f"node {name!r}'s score", self._refuse)
        components = scores[1:-1]
        if bool(components.isnan().all()):
            return None
        if bool(components.isnan().any()):
            name = mib_writers(self.graph)[1 + int(torch.nonzero(components.isnan())[0, 0])]
            raise self._refuse(f"node {name!r} has no score where other heads and MLPs have one")
        return components.float()

    def _edges(self, edges: dict[str, Any]) -> tuple[Tensor, Tensor, list[bool], list[float]]:
        names, rows, columns = mib_edges(self.graph)
        index = {name: i for i, name in enumerate(names)}
        chosen: list[int] = []
        kept: list[bool] = []
        scores: list[float] = []
        for name, info in edges.items():
            if name not in index:
                raise self._refuse(f"unknown edge {name!r}; MIB's edges are named like {names[0]!r}")
            if not isinstance(info, dict) or not isinstance(info.get("in_graph"), bool) or "score" not in info:
                raise self._refuse(f"edge {name!r} must be an object with a number 'score' and a boolean 'in_graph'")
            chosen.append(index[name])
            kept.append(info["in_graph"])
            scores.append(_number(info["score"], f"edge {name!r}'s score", self._refuse))
        picked = torch.tensor(chosen, dtype=torch.long)
        return rows[picked], columns[picked], kept, scores

    def _per_edge(self, values: Tensor, kind: str) -> Tensor:
        """MIB's edge values as one a graph edge: an ``input`` edge is each embedding's (kept), or split evenly."""
        graph = self.graph
        dense = torch.zeros(len(mib_writers(graph)), len(graph.inputs), dtype=values.dtype)
        dense[self._rows, self._columns] = values
        n = graph.n_embeddings
        ours = dense[_writer_rows(graph)]
        if kind == "scores":
            ours[:n] /= n
        writers, inputs = graph.edge_index
        return ours[writers, inputs]

    @property
    def kept(self) -> Bool[Tensor, " edge"]:
        return self._per_edge(torch.tensor(self._kept, dtype=torch.bool), "kept")

    @property
    def edge_scores(self) -> Float[Tensor, " edge"]:
        return self._per_edge(torch.tensor(self._scores, dtype=torch.float64), "scores").float()


def _same(found: Any, expected: Any) -> bool:
    return not isinstance(found, bool) and found == expected


def _number(value: Any, what: str, refuse: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise refuse(f"{what} must be a number, got {value!r}")
    return float(value)
