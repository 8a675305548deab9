"""A circuit in the inspector: the circuit drawn; a click on a head node opens that head at the final position.

For a task's prompt ``p`` (its clean ids ``task.clean[p, :last[p] + 1]``), the final position
``i = task.last[p]`` (where the task's metric is read) and a head ``L{l}H{h}`` of the circuit, a
click opens the inspector on layer ``l``, head ``h``, query ``i``, with the *why* panel of that head
there: its score at each key split over the upstream components (``log alpha_ij + H(alpha_i)`` as a
sum of advantages, `contribution_lens.qk_attribution`). MLPs, the embeddings and the logits have no
attention pattern: a click on them opens nothing and says so.

Live (`CircuitInspector` displayed in JupyterLab) the view is one widget, the inspector's, which
draws the circuit beside its view (``static/circuit.js``; above it on a narrow screen): a click sets
the inspector's ``layer``, ``head`` and ``query`` and asks the kernel for the why row, and the
inspector's answer is brought into sight. Its outputs are the circuit as an image, then the
inspector's still and its widget; both images name the widget in their metadata, which hides them
while it is live and keeps the still current (`contribution_lens.views.inspector.still`): with no
kernel, a reopened notebook and an export show the circuit and the last view. Static
(`CircuitInspector.write_html`) the page is the inspector's own
(`contribution_lens.views.inspector.page`) holding the layers of the circuit's heads and their why
rows at ``i``, with the circuit beside it: every head opens offline.
"""

import base64
import json
import math
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import plotly.graph_objects as go

from contribution_lens import adapter
from contribution_lens.choices import as_count, as_index
from contribution_lens.circuits.graph import circuit_graph
from contribution_lens.circuits.scoring import Circuit, CircuitScores, check_task
from contribution_lens.circuits.task import Task
from contribution_lens.drawing.circuit_figures import circuit_figure
from contribution_lens.views.inspector import page
from contribution_lens.views.inspector.subject import InspectorError
from contribution_lens.views.inspector.widget import Inspector, inspect
from contribution_lens.views.inspector.windows import DEFAULT_TOKENS

MAX_EDGES = 200
"""The most edges drawn (the strongest by ``|score|``; all alike without scores): more hide the nodes."""
_HEAD = re.compile(r"^L(\d+)H(\d+)$")


def check_prompt(task: Task, prompt: Any) -> int:
    """``prompt`` as an index of the task's prompts, ``0 <= prompt < len(task)``; else an error naming ``prompt``.

    Example:
        >>> import torch
        >>> task = Task("t", torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long),
        ...             torch.zeros(2, dtype=torch.long), torch.ones(2, dtype=torch.long), torch.tensor([2, 1]))
        >>> check_prompt(task, 1)
        1
    """
    n = len(task)
    try:
        index = as_index(prompt, "prompt must be an integer")
    except TypeError as error:
        raise InspectorError(
            f"prompt must be the index of one of the task's {n} prompts (0..{n - 1}): {error}"
        ) from None
    if not 0 <= index < n:
        raise InspectorError(f"prompt {index} is not a prompt of the task: it has {n} prompts (0..{n - 1})")
    return index


def chosen_circuit(
    model: adapter.Model, circuit: Any, fraction: float | None, level: str | None
) -> tuple[Circuit, CircuitScores | None]:
    """The circuit to show and the scores that colour it: ``circuit`` itself, or ``circuit.circuit(fraction, level)``.

    Refused, naming the argument: anything else, a `CircuitScores` without ``fraction``, a
    `Circuit` with a ``fraction`` or a ``level``, a graph of another model, a circuit with no head
    (nothing to open).
    """
    if isinstance(circuit, CircuitScores):
        if fraction is None:
            raise InspectorError("fraction: circuit scores need the fraction of edges (or nodes, level='node') to keep")
        scores: CircuitScores | None = circuit
        shown = circuit.circuit(fraction, "edge" if level is None else level)
    elif isinstance(circuit, Circuit):
        for name, value in (("fraction", fraction), ("level", level)):
            if value is not None:
                raise InspectorError(
                    f"{name}: a Circuit is shown as it is (it keeps {circuit!r}); pass its scores to choose one"
                )
        scores, shown = None, circuit
    else:
        raise InspectorError(f"circuit must be a Circuit or CircuitScores, got {type(circuit).__name__}")
    graph = circuit_graph(model)
    if shown.graph != graph:
        raise InspectorError(
            f"circuit: its graph ({shown.graph.n_layers} layers, {shown.graph.n_heads} heads) is not the model's "
            f"({graph.n_layers} layers, {graph.n_heads} heads)"
        )
    if not any(_HEAD.match(node) for node in shown.nodes):
        raise InspectorError(f"circuit: {shown!r} holds no attention head, so no node opens the inspector")
    return shown, scores


def circuit_tables(
    circuit: Circuit, scores: CircuitScores | None = None, *, max_edges: int = MAX_EDGES
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The tables `contribution_lens.plot.circuit_figure` draws: the circuit's nodes and its kept edges.

    An edge ``writer -> input`` is drawn into each node reading that input (a key or value input of
    a KV group into each of its query heads), with the input's kind (q, k, v, or "" for an MLP's or
    the logits') and its name (``edge``, so the figure counts edges and lines apart); only edges
    between nodes of the circuit are drawn, the ``max_edges`` strongest.
    Scores (node and edge) come from ``scores``; without them nodes have none and edges score 1.

    Example:
        >>> import torch
        >>> from contribution_lens.circuits.graph import Graph
        >>> graph = Graph(n_layers=1, n_heads=2, n_kv_heads=2, pos_embed=False)
        >>> nodes, edges = circuit_tables(Circuit.from_edges(graph, ["embed->L0H1<k>", "L0H1->logits"]))
        >>> list(nodes["node"]), list(zip(edges["upstream"], edges["downstream"], edges["input"]))
        (['embed', 'L0H1', 'logits'], [('embed', 'L0H1', 'k'), ('L0H1', 'logits', '')])
    """
    graph, kept_nodes = circuit.graph, set(circuit.nodes)
    node_scores = {} if scores is None else dict(zip(scores.nodes["node"], scores.nodes["score"], strict=True))
    nodes = pd.DataFrame({"node": circuit.nodes, "score": [node_scores.get(n, math.nan) for n in circuit.nodes]})
    writers, inputs = graph.edge_index
    rows = []
    for e in circuit.kept.nonzero()[:, 0].tolist():
        name = graph.inputs[int(inputs[e])]
        kind = name[-2] if name.endswith(">") else ""
        score = 1.0 if scores is None or scores.edge_scores is None else float(scores.edge_scores[e])
        for reader in graph.input_nodes[int(inputs[e])]:
            if reader in kept_nodes:
                rows.append((graph.writers[int(writers[e])], reader, kind, score, graph.edges[e]))
    edges = pd.DataFrame(rows, columns=["upstream", "downstream", "input", "score", "edge"])
    edges = edges.iloc[edges["score"].abs().to_numpy().argsort(kind="stable")[::-1][:max_edges]]
    return nodes, edges.sort_index().reset_index(drop=True)


def node_targets(nodes: Sequence[str], query: int, prompt: int) -> dict[str, dict[str, Any]]:
    """What a click on each node does: a head opens ``(layer, head)`` at ``query``; every node says what happened.

    Example:
        >>> targets = node_targets(["embed", "L1H2", "L1.mlp"], query=6, prompt=0)
        >>> targets["L1H2"]["layer"], targets["L1H2"]["head"], "layer" in targets["L1.mlp"]
        (1, 2, False)
    """
    targets: dict[str, dict[str, Any]] = {}
    for node in nodes:
        if head := _HEAD.match(node):
            layer, index = int(head.group(1)), int(head.group(2))
            note = (
                f"{node} opened in the inspector at query {query}, prompt {prompt}'s final position (where the task's "
                "metric is read), with its why panel: the head's score at each key split over the upstream components."
            )
            targets[node] = {"layer": layer, "head": index, "note": note}
        else:
            what = "an MLP" if node.endswith(".mlp") else "the logits" if node == "logits" else "an embedding"
            targets[node] = {
                "note": f"{node} is {what}: it has no attention pattern, so it opens nothing in the inspector. "
                "Click a head (L…H…) to open it at the final position."
            }
    return targets


def inspect_circuit(
    model: adapter.Model,
    task: Task,
    circuit: Circuit | CircuitScores,
    *,
    fraction: float | None = None,
    level: str | None = None,
    prompt: int = 0,
    tokens: int = DEFAULT_TOKENS,
    max_edges: int = MAX_EDGES,
) -> "CircuitInspector":
    """A circuit drawn over the inspector of one of the task's prompts: a click on a head node opens that head.

    A head ``L{l}H{h}`` opens the inspector of the clean prompt ``p`` on layer ``l``, head ``h``
    and the query ``i = task.last[p]`` (the final position, where the metric is read), with the
    *why* panel of that head at ``i``: ``log alpha_ij + H(alpha_i) = sum_c A_ij^c`` over the upstream
    components ``c`` (`Inspector.why`). Display it in JupyterLab (live), or write the page
    (`CircuitInspector.write_html`), on which every head of the circuit opens offline.

    Args:
        model: the ``TransformerBridge`` the circuit was found on.
        task: the circuit's `contribution_lens.Task`.
        circuit: a `contribution_lens.Circuit`, or the `contribution_lens.CircuitScores` to choose one from
            (``scores.circuit(fraction, level)``; its scores colour the nodes and edges).
        fraction: with scores, the fraction of edges (``level="edge"``) or nodes kept.
        level: with scores, ``"edge"`` (default) or ``"node"``.
        prompt: which of the task's prompts the inspector shows (its clean ids, up to ``last``).
        tokens: the inspector's window of queries (it ends at the final position).
        max_edges: the most edges drawn (the strongest).

    Every value is checked before the model runs (`InspectorError`, naming the argument); then one
    forward pass computes every layer and records what the why panels read.

    Example:
        >>> import contribution_lens as cl
        >>> model = cl.load_model()
        >>> task = cl.Task.ioi(model, n=2)
        >>> circuit = cl.Circuit.from_nodes(cl.circuit_graph(model), ["L4H3", "L9H0", "L9.mlp"])
        >>> view = cl.inspect_circuit(model, task, circuit, prompt=1)  # or (model, task, scores, fraction=0.01)
        >>> view.heads, view.target("L9H0") == (9, 0, int(task.last[1]))
        (['L4H3', 'L9H0'], True)
    """
    task = check_task(model, task)
    prompt = check_prompt(task, prompt)
    tokens, max_edges = as_count(tokens, "tokens"), as_count(max_edges, "max_edges")
    shown, scores = chosen_circuit(model, circuit, fraction, level)
    last = int(task.last[prompt])
    ids = task.clean[prompt, : last + 1]
    targets = node_targets(shown.nodes, last, prompt)
    first = next(t for t in targets.values() if "layer" in t)
    inspector = inspect(
        model, ids, layer=first["layer"], head=first["head"], start=max(0, last + 1 - tokens), tokens=tokens
    )
    nodes, edges = circuit_tables(shown, scores, max_edges=max_edges)
    size = repr(shown).removeprefix("Circuit(").removesuffix(")")  # "edge level: 70 of 70651 edges"
    title = f"{size} of {scores.method} on {task.name}" if scores is not None else f"{size}, as given"
    figure = circuit_figure(nodes, edges, n_layers=shown.graph.n_layers, n_heads=shown.graph.n_heads, title=title)
    return CircuitInspector(inspector, shown, targets, figure, prompt=prompt, query=last)


class CircuitInspector:
    """A circuit's figure over an `Inspector` of one prompt (build it with `inspect_circuit`).

    ``heads``: the circuit's heads, in the graph's order; `target` maps one to the inspector's
    ``(layer, head, query)``; `open` shows it (what a click on its node does, live); displayed in
    JupyterLab it shows the figure, a note of the last click and the inspector; `write_html` writes
    the static page, on which every head of the circuit opens without a kernel.
    """

    def __init__(
        self,
        inspector: Inspector,
        circuit: Circuit,
        targets: dict[str, dict[str, Any]],
        figure: go.Figure,
        *,
        prompt: int,
        query: int,
    ) -> None:
        self.inspector, self.circuit, self.figure = inspector, circuit, figure
        self.prompt, self.query = prompt, query
        self._window = inspector.start, inspector.tokens  # the opening window: it ends at the final position
        self._targets = targets

    @property
    def heads(self) -> list[str]:
        """The circuit's heads (``L{l}H{h}``): the nodes that open the inspector."""
        return [node for node, target in self._targets.items() if "layer" in target]

    def __repr__(self) -> str:
        return (
            f"CircuitInspector({self.circuit!r}, {len(self.heads)} heads, prompt {self.prompt} at query {self.query}); "
            "display it, or .write_html(path)"
        )

    def target(self, node: str) -> tuple[int, int, int]:
        """``(layer, head, query)`` a click on ``node`` opens: its layer and head, the prompt's final position.

        A node of the circuit that is no head (an MLP, an embedding, the logits), or a name that is
        no node of it, is refused (`InspectorError`, naming ``node``).
        """
        got = self._targets.get(node) if isinstance(node, str) else None
        if got is None:
            raise InspectorError(f"node {node!r} is not a node of this circuit (its heads: {', '.join(self.heads)})")
        if "layer" not in got:
            raise InspectorError(f"node {node!r}: {got['note']}")
        return got["layer"], got["head"], self.query

    def open(self, node: str) -> str:
        """Show head ``node`` in the inspector at the final position, its why panel sent: a click on its node.

        Returns the note the view shows under the figure. The why row is computed here
        (`Inspector.why`: from the first pass's record, no pass of its own) and sent to the
        front-end as the answer to the request a clicked cell would make, so the panel is drawn
        without a click on the heatmap.
        """
        layer, head, query = self.target(node)
        inspector = self.inspector
        with inspector.hold_sync():
            if query not in inspector.window.queries:  # moved away since: the opening window again
                inspector.tokens, inspector.start = self._window[1], self._window[0]
            inspector.group_kv = False  # the why panel splits one head, not a KV group
            inspector.view = "heatmap"
            inspector.layer, inspector.head, inspector.query = layer, head, query
        row = inspector.why(query, layer=layer, head=head)
        # The key the front-end files a why answer under (static/inspector.js, whyRows).
        key = f"{inspector.meta['key']}|{layer}/{head}/{query}"
        inspector.send({"type": "why", "key": key, "row": row})
        return self._targets[node]["note"]

    def page_data(self) -> dict[str, Any]:
        """What the static page embeds for the circuit (``static/circuit.js``'s ``CircuitData``)."""
        return {
            "figure": self.figure.to_plotly_json(),
            "query": self.query,
            "prompt": self.prompt,
            "nodes": self._targets,
            "caption": (
                f"Click a head of the circuit to open it in the inspector at query {self.query} "
                f"(prompt {self.prompt}'s final position) with its why panel; MLPs, embeddings and logits open nothing."
            ),
            "window": {"start": self._window[0], "tokens": self._window[1]},
        }

    @property
    def layers(self) -> list[int]:
        """The layers of the circuit's heads: those the page holds."""
        return sorted({self._targets[node]["layer"] for node in self.heads})

    def render_html(self, *, compact: bool | None = None) -> str:
        """The page of `write_html` as a string."""
        return self.inspector.render_html(
            layers=self.layers,
            start=self._window[0],
            tokens=self._window[1],
            why_queries=[self.query],
            compact=compact,
            circuit=self.page_data(),
        )

    def write_html(self, path: str | Path, *, compact: bool | None = None) -> Path:
        """One self-contained page: the circuit above the inspector, every circuit head opening offline.

        The page is the inspector's (`Inspector.write_html`) with the layers of the circuit's heads
        (`layers`: every head of them, so its menus work too) and their why rows at the final
        position (``why_queries=[query]``), in the window the view opened on (whatever window the live
        inspector shows now), costing no pass where the first view's recorded them.
        It opens on the head shown last (the first head of the circuit until one is opened).
        """
        return page.write(path, self.render_html(compact=compact))

    def circuit_image(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The circuit as an output (MIME bundle and metadata): a PNG (kaleido) and a line, naming the live widget.

        What a notebook shows of the circuit where its widget cannot run (no kernel, an export); the
        widget hides it while it is live. Without kaleido (or a Chromium) the line alone.
        """
        from contribution_lens.drawing import plot
        from contribution_lens.views.inspector.still import RUN_AGAIN

        data: dict[str, Any] = {"text/plain": f"The circuit ({self.circuit!r}). {RUN_AGAIN}"}
        metadata: dict[str, Any] = {"contribution_lens": {"circuit": True, "widget": self.inspector.model_id}}
        with tempfile.TemporaryDirectory(prefix="cl-circuit-") as folder:
            try:
                png = plot.save_image(self.figure, Path(folder) / "circuit.png", scale=2).read_bytes()
            except (RuntimeError, ValueError, OSError):
                return data, metadata
        data["image/png"] = base64.b64encode(png).decode("ascii")
        metadata["image/png"] = {"width": int.from_bytes(png[16:20], "big") // 2}  # the IHDR width, at scale 2
        return data, metadata

    def _ipython_display_(self, **kwargs: Any) -> None:
        """The circuit as an image, then the inspector (its still and its widget, which draws the circuit live).

        The circuit's image takes the place of the line of the pass that built the inspector in this
        cell, where there is one, so that it comes first.
        """
        from IPython.display import display, update_display

        inspector = self.inspector
        if not inspector.circuit:
            inspector.circuit = {**self.page_data(), "figure": json.loads(self.figure.to_json())}
        data, metadata = self.circuit_image()
        line = inspector.pass_line()
        if line is None:
            display(data, raw=True, metadata=metadata)
        else:
            update_display(data, raw=True, metadata=metadata, display_id=line)
        display(inspector)
