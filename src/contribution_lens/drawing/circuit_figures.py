"""Circuits drawn: a circuit as a graph, faithfulness by circuit size, node scores, the nodes kept, per-prompt metrics.

Every function takes tidy tables (or a result's plain fields), not result objects, so any circuit
scorer's output draws, and the circuits layer, above this one, calls them from its results'
``figures()``. The public names are also ``contribution_lens.plot.circuit_figure`` and
``contribution_lens.plot.faithfulness_figure``.

* `circuit_figure(nodes, edges, n_layers=, n_heads=)`: the layers that hold a node, bottom-up
  (``embed`` and ``pos_embed`` at the bottom, ``logits`` on top); per layer its heads in a row,
  each a disc labelled ``H{h}`` (the row's tick names the layer), and its MLP right of them, half a
  row up. Nodes are coloured by their score (diverging, centred at 0) and drawn over the edges, so
  no edge hides a label. An edge runs from its upstream node to its downstream node's input,
  coloured by the sign of its score (red +, blue −, paler for smaller), as wide as ``|score|``
  (relative to the largest drawn), and dashed by that input: a head's q input dotted, k dashed, v
  dash-dotted, an MLP's or the logits' solid, each kind a legend entry that shows or hides it. An
  edge into a head ends at one of three points under it (q left, k middle, v right). Hovering a node
  or an edge's midpoint names it and gives its score.
* `faithfulness_figure(table)`: faithfulness against the fraction of edges (or nodes) kept, log x
  axis, one line per method with its interval as a band, ``f = 1`` (the whole model) dotted.
* `node_scores_figure`, `circuit_nodes_figure`, `prompt_metrics_figure`: a score per head and MLP,
  the nodes a circuit keeps, the metric per prompt in the clean, counterfactual and patched passes.

Example:
    >>> import pandas as pd
    >>> nodes = pd.DataFrame({"node": ["embed", "L0H1", "logits"], "score": [0.0, 0.5, 0.0]})
    >>> edges = pd.DataFrame({"upstream": ["embed", "L0H1"], "downstream": ["L0H1", "logits"],
    ...                       "input": ["v", ""], "score": [0.4, -0.2]})
    >>> figure = circuit_figure(nodes, edges, n_layers=1, n_heads=2)
    >>> [trace.hovertext[0] for trace in figure.data if trace.name.startswith("edges")]
    ['embed → L0H1 (v)<br>score=0.4', 'L0H1 → logits<br>score=-0.2']
"""

import re
import textwrap
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
import plotly.colors
import plotly.graph_objects as go

from contribution_lens.drawing.plot import DIVERGING

INPUTS = {"q": "dot", "k": "dash", "v": "dashdot", "": "solid"}
"""The dash of an edge by the input it enters: a head's q, k or v input, or the only input of an MLP or the logits."""

INPUT_NAMES = {
    "q": "into a head's query (q)",
    "k": "into a head's key (k)",
    "v": "into a head's value (v)",
    "": "into an MLP or the logits",
}
INPUT_OFFSET = {"q": -0.22, "k": 0.0, "v": 0.22, "": 0.0}
INPUT_DROP = 0.3
"""Where under a head an edge into its q, k or v input ends: x offset, and ``INPUT_DROP`` rows below its disc."""
ROW_PX = 50
"""The height of a row of heads, px (a disc is 22 px)."""
TITLE_CHARACTERS = 46
"""The longest title line: at 13 px it fits a figure 368 px wide."""

_HEAD = re.compile(r"^L(\d+)H(\d+)$")
_MLP = re.compile(r"^L(\d+)\.mlp$")


def _layer(node: str) -> int | None:
    found = _HEAD.match(node) or _MLP.match(node)
    return int(found.group(1)) if found else None


def node_position(
    node: str, *, n_layers: int, n_heads: int, layers: Sequence[int] | None = None
) -> tuple[float, float]:
    """``(x, y)`` of a node: the ``k``-th layer drawn has its heads in a row at ``y = k + 1``, its MLP half a row up.

    ``layers`` are the layers drawn, bottom-up (default: all ``n_layers``); ``embed`` and
    ``pos_embed`` lie at ``y = 0``, ``logits`` at ``len(layers) + 1``, under and over the heads'
    centre; head ``h`` at ``x = h``, the MLPs in a column of their own at ``x = n_heads + 0.5``.

    Example:
        >>> node_position("L1H2", n_layers=2, n_heads=4), node_position("L1.mlp", n_layers=2, n_heads=4)
        ((2.0, 2.0), (4.5, 2.5))
        >>> node_position("L7H2", n_layers=9, n_heads=4, layers=[3, 7])  # only layers 3 and 7 drawn
        (2.0, 2.0)
    """
    rows = {layer: k for k, layer in enumerate(range(n_layers) if layers is None else layers)}
    centre = (n_heads - 1) / 2
    if node == "embed":
        return centre - 1.5, 0.0
    if node == "pos_embed":
        return centre + 1.5, 0.0
    if node == "logits":
        return centre, len(rows) + 1.0
    if head := _HEAD.match(node):
        layer, index = int(head.group(1)), int(head.group(2))
        if layer < n_layers and index < n_heads and layer in rows:
            return float(index), rows[layer] + 1.0
    elif mlp := _MLP.match(node):
        if int(mlp.group(1)) < n_layers and int(mlp.group(1)) in rows:
            return n_heads + 0.5, rows[int(mlp.group(1))] + 1.5
    raise ValueError(
        f"node {node!r} is not a node of a {n_layers}-layer model with {n_heads} heads "
        "(embed, pos_embed, L{l}H{h}, L{l}.mlp, logits)"
    )


def node_label(node: str) -> str:
    """The short label drawn on a node's disc: ``H{h}`` for a head (its row names the layer), ``mlp``, ``embed``.

    Example:
        >>> [node_label(node) for node in ("L23H0", "L4.mlp", "embed", "pos_embed", "logits")]
        ['H0', 'mlp', 'embed', 'pos', 'logits']
    """
    if head := _HEAD.match(node):
        return f"H{head.group(2)}"
    if _MLP.match(node):
        return "mlp"
    return "pos" if node == "pos_embed" else node


def check_columns(table: pd.DataFrame, name: str, columns: tuple[str, ...]) -> None:
    """``table`` is a DataFrame with ``columns``; else an error naming ``name`` and what it lacks."""
    if not isinstance(table, pd.DataFrame):
        raise TypeError(
            f"{name} must be a pandas DataFrame with columns {', '.join(columns)}, got {type(table).__name__}"
        )
    missing = [column for column in columns if column not in table.columns]
    if missing:
        raise ValueError(
            f"{name} lacks the column(s) {', '.join(missing)} (it has {', '.join(map(str, table.columns))})"
        )


def _check_edges(edges: pd.DataFrame, *, n_layers: int, n_heads: int) -> None:
    for row in edges.itertuples(index=False):
        node_position(row.upstream, n_layers=n_layers, n_heads=n_heads)
        node_position(row.downstream, n_layers=n_layers, n_heads=n_heads)
        into_head = bool(_HEAD.match(row.downstream))
        if (row.input not in ("q", "k", "v")) if into_head else row.input != "":
            expected = "'q', 'k' or 'v'" if into_head else "'' (one input)"
            raise ValueError(
                f"edges: the input of {row.upstream} → {row.downstream} is {row.input!r}; expected {expected}"
            )


def _edge_hover(row: pd.Series) -> str:
    kind = f" ({row['input']})" if row["input"] else ""
    return f"{row['upstream']} → {row['downstream']}{kind}<br>score={row['score']:.4g}"


def _edge_traces(edges: pd.DataFrame, place: dict[str, tuple[float, float]]) -> list[go.Scatter]:
    """One line per edge (weakest first, so the strongest lie on top) and one hover trace per input kind."""
    largest = float(edges["score"].abs().max()) if len(edges) else 1.0
    largest = largest if largest > 0 else 1.0
    shades = plotly.colors.sample_colorscale(DIVERGING, list(0.5 + 0.5 * edges["score"].to_numpy() / largest))
    edges = edges.assign(colour=shades)

    def end(row: pd.Series) -> tuple[float, float]:
        x, y = place[row["downstream"]]
        return x + INPUT_OFFSET[row["input"]], y - (INPUT_DROP if row["input"] else 0.0)

    lines: list[go.Scatter] = []
    for _, row in edges.iloc[np.argsort(edges["score"].abs().to_numpy(), kind="stable")].iterrows():
        (x0, y0), (x1, y1) = place[row["upstream"]], end(row)
        lines.append(
            go.Scatter(
                x=[x0, x1], y=[y0, y1], mode="lines", hoverinfo="skip", opacity=0.8,
                line={"width": round(0.5 + 7.5 * abs(row["score"]) / largest, 2), "color": row["colour"],
                      "dash": INPUTS[row["input"]]},
                name=f"{row['upstream']} → {row['downstream']}", legendgroup=row["input"], showlegend=False,
            )
        )  # fmt: skip
    hovers: list[go.Scatter] = []
    for kind in INPUTS:
        part = edges[edges["input"] == kind]
        if len(part):
            starts = [place[u] for u in part["upstream"]]
            ends = [end(row) for _, row in part.iterrows()]
            hovers.append(
                go.Scatter(
                    x=[(a[0] + b[0]) / 2 for a, b in zip(starts, ends, strict=True)],
                    y=[(a[1] + b[1]) / 2 for a, b in zip(starts, ends, strict=True)],
                    mode="markers", marker={"size": 7, "color": list(part["colour"]), "opacity": 0.5},
                    hovertext=[_edge_hover(row) for _, row in part.iterrows()], hoverinfo="text",
                    name=f"edges {kind or 'resid'}", legendgroup=kind, showlegend=False,
                )
            )  # fmt: skip
    legend = [
        go.Scatter(
            x=[None], y=[None], mode="lines", line={"color": "#555555", "dash": INPUTS[kind]},
            name=INPUT_NAMES[kind], legendgroup=kind, hoverinfo="skip",
        )
        for kind in INPUTS
        if (edges["input"] == kind).any()
    ]  # fmt: skip
    return [*lines, *hovers, *legend]


def _node_trace(names: list[str], values: np.ndarray, place: dict[str, tuple[float, float]]) -> go.Scatter:
    """The nodes as discs with their short label inside, drawn over the edges; hover: full name and score.

    A head's or an MLP's disc is 22 px across; the embeddings' and the logits', whose labels are longer, 36 px.
    """
    bound = float(np.nanmax(np.abs(values))) if np.isfinite(values).any() else 1.0
    bound = bound or 1.0
    # A label reads on its disc: white on the scale's dark ends, dark on its pale middle.
    ink = ["#ffffff" if np.isfinite(v) and abs(v) > 0.55 * bound else "#222222" for v in values]
    return go.Scatter(
        x=[place[name][0] for name in names], y=[place[name][1] for name in names], mode="markers+text",
        text=[node_label(name) for name in names], customdata=names, textposition="middle center",
        textfont={"size": 9, "color": ink}, name="nodes", showlegend=False,
        hovertext=[f"{name}<br>score={value:.4g}" if np.isfinite(value) else f"{name}<br>score: none"
                   for name, value in zip(names, values, strict=True)],
        hoverinfo="text", cliponaxis=False,
        marker={"size": [22 if _layer(name) is not None else 36 for name in names], "color": np.nan_to_num(values),
                "colorscale": DIVERGING, "cmid": 0, "cmin": -bound,
                "cmax": bound, "line": {"width": 1, "color": "#333333"},
                "colorbar": {"title": {"text": "node<br>score", "side": "top"}, "thickness": 10, "len": 0.6,
                             "x": 1.0, "xpad": 6}},
    )  # fmt: skip


def circuit_title(title: str, edges: pd.DataFrame) -> str:
    """The figure's title: ``title``, what is drawn, and why there are more lines than edges where there are.

    With an ``edge`` column (the graph's edge of each drawn line), an edge into a key or value input
    shared by a group of query heads is one edge drawn into each of them: the title says so. Lines are
    broken at `TITLE_CHARACTERS` so that the title fits a narrow figure.

    Example:
        >>> edges = pd.DataFrame({"edge": ["a", "a", "b"]})
        >>> circuit_title("IOI", edges).replace("<br>", " | ")
        'IOI: 2 edges drawn as 3 lines (an edge into a | key or value shared by query heads goes into | each)'
    """
    n = len(edges)
    if "edge" in edges.columns and edges["edge"].nunique() != n:
        said = (
            f"{title}: {edges['edge'].nunique()} edges drawn as {n} lines (an edge into a key or value shared by "
            "query heads goes into each)"
        )
    else:
        said = f"{title}: {n} edges"
    return "<br>".join(textwrap.wrap(said, TITLE_CHARACTERS))


def circuit_figure(
    nodes: pd.DataFrame, edges: pd.DataFrame, *, n_layers: int, n_heads: int, title: str = "Circuit"
) -> go.Figure:
    """A circuit drawn as a graph: the layers that hold a node, bottom-up, heads and MLPs as nodes, the given edges.

    Args:
        nodes: columns ``node`` (``embed``, ``pos_embed``, ``L{l}H{h}``, ``L{l}.mlp``, ``logits``) and
            ``score``: the nodes drawn, coloured by score. An edge's end missing here is drawn too,
            without a score.
        edges: columns ``upstream``, ``downstream`` (node names), ``input`` (``"q"``, ``"k"`` or
            ``"v"`` for an edge into a head, ``""`` otherwise) and ``score``: the lines drawn; an
            optional ``edge`` column names the graph's edge each line draws (an edge into a key or
            value input shared by several query heads is one line into each), which the title counts.
        n_layers: the model's number of layers.
        n_heads: its number of heads a layer, which places them in their row.
        title: what the figure shows; the number of edges (and lines) is added (`circuit_title`).
    """
    check_columns(nodes, "nodes", ("node", "score"))
    check_columns(edges, "edges", ("upstream", "downstream", "input", "score"))
    for name, value in (("n_layers", n_layers), ("n_heads", n_heads)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    edges = edges.reset_index(drop=True).assign(input=edges["input"].fillna("").astype(str).to_numpy())
    names = list(dict.fromkeys([*nodes["node"], *edges["upstream"], *edges["downstream"]]))
    for name in names:
        node_position(name, n_layers=n_layers, n_heads=n_heads)  # every name checked before anything is drawn
    _check_edges(edges, n_layers=n_layers, n_heads=n_heads)
    layers = sorted({layer for name in names if (layer := _layer(name)) is not None})
    place = {name: node_position(name, n_layers=n_layers, n_heads=n_heads, layers=layers) for name in names}
    scores = dict(zip(nodes["node"], nodes["score"], strict=True))
    values = np.array([float(scores.get(name, np.nan)) for name in names])
    figure = go.Figure([*_edge_traces(edges, place), _node_trace(names, values, place)])
    drawn_mlps = {layer for name in names if _MLP.match(name) and (layer := _layer(name)) is not None}
    drawn_heads = {layer for name in names if _HEAD.match(name) and (layer := _layer(name)) is not None}
    ticks = [(0.0, "embed"), (len(layers) + 1.0, "logits")]
    ticks += [(k + 1.0, f"L{layer}") for k, layer in enumerate(layers) if layer in drawn_heads]
    ticks += [(k + 1.5, f"L{layer} mlp") for k, layer in enumerate(layers) if layer in drawn_mlps]
    ticks.sort()
    heading = circuit_title(title, edges)
    top = 20 + 17 * (heading.count("<br>") + 1)
    height = top + 110 + ROW_PX * (len(layers) + 2)
    figure.update_layout(
        # The title as an annotation: plotly places a title of several lines partly above the figure.
        annotations=[{"text": heading, "font": {"size": 13}, "x": 0, "y": 1, "xref": "paper", "yref": "paper",
                      "xanchor": "left", "yanchor": "bottom", "yshift": 8, "align": "left", "showarrow": False,
                      "name": "title"}],
        xaxis={"visible": False, "range": [-0.8, n_heads + 1.3]},
        yaxis={"tickvals": [t for t, _ in ticks], "ticktext": [label for _, label in ticks], "zeroline": False,
               "showgrid": False, "range": [-0.6, len(layers) + 1.5], "fixedrange": True, "tickfont": {"size": 10}},
        height=height,
        margin={"t": top, "l": 10, "r": 10, "b": 10},
        legend={"title": {"text": "edges"}, "orientation": "h", "x": 0, "y": -0.01, "yanchor": "top",
                "font": {"size": 10}},
        plot_bgcolor="#ffffff",
        hovermode="closest",
    )  # fmt: skip
    return figure


def _band_colour(colour: str, alpha: float = 0.2) -> str:
    red, green, blue = plotly.colors.hex_to_rgb(colour) if colour.startswith("#") else plotly.colors.unlabel_rgb(colour)
    return f"rgba({red}, {green}, {blue}, {alpha})"


def _curve_hover(method: str, row: Any) -> str:
    size = f" ({row.size:.0f})" if hasattr(row, "size") and np.isfinite(row.size) else ""
    return (
        f"{method}<br>{100 * row.fraction:.3g} % kept{size}<br>faithfulness={row.faithfulness:.3f} "
        f"[{row.low:.3f}, {row.high:.3f}]"
    )


def faithfulness_figure(table: pd.DataFrame, *, title: str = "Faithfulness by circuit size") -> go.Figure:
    """Faithfulness against the fraction of the graph kept (log x axis): one line a method, its interval a band.

    Args:
        table: columns ``method``, ``fraction`` (in (0, 1]), ``faithfulness``, ``low`` and ``high``
            (its interval): one row per method and size; a ``size`` column (edges or nodes kept), where
            there is one, is in the hover text. A `contribution_lens.CircuitCurve`'s ``table`` with a
            ``method`` column added (its ``figures()`` does so).
        title: the figure's title.

    Example:
        >>> import pandas as pd
        >>> table = pd.DataFrame({"method": ["eap"] * 2, "fraction": [0.1, 1.0], "faithfulness": [0.5, 1.0],
        ...                       "low": [0.4, 1.0], "high": [0.6, 1.0]})
        >>> [trace.name for trace in faithfulness_figure(table).data]
        ['eap (interval)', 'eap (interval)', 'eap', 'whole model']
    """
    check_columns(table, "table", ("method", "fraction", "faithfulness", "low", "high"))
    fractions = table["fraction"].to_numpy(dtype=float)
    if len(table) and not ((fractions > 0) & (fractions <= 1)).all():
        raise ValueError(f"table: every fraction must lie in (0, 1], got {sorted(set(fractions.tolist()))}")
    palette = plotly.colors.qualitative.Plotly
    figure = go.Figure()
    for index, (method, part) in enumerate(table.groupby("method", sort=False)):
        part = part.sort_values("fraction")
        colour = palette[index % len(palette)]
        x = part["fraction"].tolist()
        figure.add_trace(go.Scatter(x=x, y=part["high"].tolist(), mode="lines", line={"width": 0},
                                    name=f"{method} (interval)", legendgroup=str(method), showlegend=False,
                                    hoverinfo="skip"))  # fmt: skip
        figure.add_trace(go.Scatter(x=x, y=part["low"].tolist(), mode="lines", line={"width": 0}, fill="tonexty",
                                    fillcolor=_band_colour(colour), name=f"{method} (interval)",
                                    legendgroup=str(method), showlegend=False, hoverinfo="skip"))  # fmt: skip
        figure.add_trace(
            go.Scatter(
                x=x, y=part["faithfulness"].tolist(), mode="lines+markers", line={"color": colour}, name=str(method),
                legendgroup=str(method), hovertext=[_curve_hover(str(method), row) for row in part.itertuples()],
                hoverinfo="text",
            )
        )  # fmt: skip
    figure.add_trace(
        go.Scatter(x=[min(fractions, default=0.001), 1.0], y=[1.0, 1.0], mode="lines", name="whole model",
                   line={"dash": "dot", "color": "#777777"}, hoverinfo="skip")
    )  # fmt: skip
    figure.update_layout(
        title=title,
        xaxis={"type": "log", "title": "fraction of the graph kept", "tickformat": ".3~%"},
        yaxis={"title": "faithfulness f(C)"},
        legend={"title": "method"},
    )
    return figure


def _grid(names: Sequence[str], values: Sequence[float]) -> tuple[list[list[float | None]], list[list[str]]]:
    """Layers as rows, heads then the MLP as columns."""
    layers = [int(name[1:].split("H")[0].split(".")[0]) for name in names]
    heads = [int(name.split("H")[1]) if "H" in name else -1 for name in names]
    n_layers, n_heads = max(layers) + 1, max(heads) + 1
    z: list[list[float | None]] = [[None] * (n_heads + 1) for _ in range(n_layers)]
    text = [[""] * (n_heads + 1) for _ in range(n_layers)]
    for name, layer, head, value in zip(names, layers, heads, values, strict=True):
        column = head if head >= 0 else n_heads
        z[layer][column] = value
        text[layer][column] = name
    return z, text


def node_scores_figure(nodes: pd.DataFrame, title: str) -> go.Figure:
    """Each head's and MLP's score (``nodes``: columns ``node``, ``score``): layers bottom-up, heads then the MLP."""
    z, text = _grid(list(nodes["node"]), [float(v) for v in nodes["score"]])
    columns = [f"H{h}" for h in range(len(z[0]) - 1)] + ["mlp"]
    heatmap = go.Heatmap(
        z=z, x=columns, text=text, colorscale=DIVERGING, zmid=0, hovertemplate="%{text}: %{z:.4g}<extra></extra>"
    )
    figure = go.Figure(heatmap)
    figure.update_layout(title=f"Node scores: {title}", yaxis={"title": "layer"})
    return figure


def circuit_nodes_figure(components: Sequence[str], kept: Sequence[str]) -> go.Figure:
    """Which heads and MLPs (of ``components``, a graph's) a circuit keeps (1) or leaves out (0), layer by layer."""
    chosen = set(kept)
    z, text = _grid(components, [float(name in chosen) for name in components])
    columns = [f"H{h}" for h in range(len(z[0]) - 1)] + ["mlp"]
    figure = go.Figure(
        go.Heatmap(
            z=z, x=columns, text=text, colorscale="Blues", hovertemplate="%{text}<extra></extra>", zmin=0, zmax=1
        )
    )
    figure.update_layout(title="Nodes in the circuit", yaxis={"title": "layer"})
    return figure


def prompt_metrics_figure(metrics: pd.DataFrame, task: str) -> go.Figure:
    """Each prompt's metric in the clean, counterfactual and patched passes (``metrics``' columns of those names)."""
    figure = go.Figure()
    for column in ("clean", "corrupted", "patched"):
        figure.add_scatter(x=list(range(len(metrics))), y=metrics[column], mode="markers", name=column)
    figure.update_layout(title=f"Metric per prompt: {task}", xaxis={"title": "prompt"}, yaxis={"title": "metric"})
    return figure
