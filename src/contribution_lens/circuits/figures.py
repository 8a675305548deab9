"""Circuits drawn: the graph of a (pruned) circuit, and every method's faithfulness curve on one figure.

Both functions take tidy tables, not result objects, so any circuit scorer's output draws:

* `circuit_figure(nodes, edges, n_layers=, n_heads=)`: the model's layers bottom-up, ``embed`` (and
  ``pos_embed``) at the bottom, then per layer ``l`` its heads ``L{l}H{h}`` in a row and its MLP
  ``L{l}.mlp`` right of them, half a row up, ``logits`` on top. Nodes are coloured by their score
  (diverging, centred at 0); an edge is drawn from its upstream node to its downstream node's input,
  coloured by the sign of its score (red +, blue −, paler for smaller; the package's diverging
  scale), as wide as ``|score|`` (relative to the largest drawn), and dashed by that input: a head's
  q input dotted, k dashed, v dash-dotted, the input of an MLP or of the logits solid; each kind is
  a legend entry that shows or hides it. An edge into a head ends at one of three points under it (q
  left, k middle, v right). Hovering near an edge's midpoint shows its upstream and downstream
  names, its input and score. Only the edges given are drawn: pass the circuit's (pruned) edges.
* `curves_figure(curves)`: faithfulness against the fraction of edges (or nodes) kept, log x axis,
  one line per method with its interval as a band, and ``f = 1`` (the whole model) dotted.

    >>> import pandas as pd
    >>> nodes = pd.DataFrame({"node": ["embed", "L0H1", "logits"], "score": [0.0, 0.5, 0.0]})
    >>> edges = pd.DataFrame({"upstream": ["embed", "L0H1"], "downstream": ["L0H1", "logits"],
    ...                       "input": ["v", ""], "score": [0.4, -0.2]})
    >>> figure = circuit_figure(nodes, edges, n_layers=1, n_heads=2)
    >>> [trace.hovertext[0] for trace in figure.data if trace.name.startswith("edges")]
    ['embed → L0H1 (v)<br>score=0.4', 'L0H1 → logits<br>score=-0.2']
"""

import re

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
INPUT_DROP = 0.15
"""Where under a head an edge into its q, k or v input ends (x offset, and ``INPUT_DROP`` below it)."""

_HEAD = re.compile(r"^L(\d+)H(\d+)$")
_MLP = re.compile(r"^L(\d+)\.mlp$")


def node_position(node: str, *, n_layers: int, n_heads: int) -> tuple[float, float]:
    """``(x, y)`` of a node: layer ``l``'s heads in a row at ``y = l + 1``, its MLP right of them, half a row up.

    ``embed`` and ``pos_embed`` lie at ``y = 0``, ``logits`` at ``n_layers + 1``, both under the heads'
    centre; head ``h`` at ``x = h``, the MLPs in a column of their own at ``x = n_heads + 0.5``.

    Example:
        >>> node_position("L1H2", n_layers=2, n_heads=4), node_position("L1.mlp", n_layers=2, n_heads=4)
        ((2.0, 2.0), (4.5, 2.5))
    """
    centre = (n_heads - 1) / 2
    if node == "embed":
        return centre - 0.5, 0.0
    if node == "pos_embed":
        return centre + 0.5, 0.0
    if node == "logits":
        return centre, n_layers + 1.0
    if head := _HEAD.match(node):
        layer, index = int(head.group(1)), int(head.group(2))
        if layer < n_layers and index < n_heads:
            return float(index), layer + 1.0
    elif mlp := _MLP.match(node):
        if int(mlp.group(1)) < n_layers:
            return n_heads + 0.5, int(mlp.group(1)) + 1.5
    raise ValueError(
        f"node {node!r} is not a node of a {n_layers}-layer model with {n_heads} heads "
        "(embed, pos_embed, L{l}H{h}, L{l}.mlp, logits)"
    )


def _check_columns(table: pd.DataFrame, name: str, columns: tuple[str, ...]) -> None:
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


def _edge_traces(edges: pd.DataFrame, *, n_layers: int, n_heads: int) -> list[go.Scatter]:
    """One line per edge (weakest first, so the strongest lie on top) and one hover trace per input kind."""
    largest = float(edges["score"].abs().max()) if len(edges) else 1.0
    largest = largest if largest > 0 else 1.0
    shades = plotly.colors.sample_colorscale(DIVERGING, list(0.5 + 0.5 * edges["score"].to_numpy() / largest))
    edges = edges.assign(colour=shades)
    lines: list[go.Scatter] = []
    for _, row in edges.iloc[np.argsort(edges["score"].abs().to_numpy(), kind="stable")].iterrows():
        x0, y0 = node_position(row["upstream"], n_layers=n_layers, n_heads=n_heads)
        x1, y1 = node_position(row["downstream"], n_layers=n_layers, n_heads=n_heads)
        x1, y1 = x1 + INPUT_OFFSET[row["input"]], y1 - (INPUT_DROP if row["input"] else 0.0)
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
            ends = [node_position(d, n_layers=n_layers, n_heads=n_heads) for d in part["downstream"]]
            starts = [node_position(u, n_layers=n_layers, n_heads=n_heads) for u in part["upstream"]]
            hovers.append(
                go.Scatter(
                    x=[(a[0] + b[0] + INPUT_OFFSET[kind]) / 2 for a, b in zip(starts, ends, strict=True)],
                    y=[(a[1] + b[1] - (INPUT_DROP if kind else 0.0)) / 2 for a, b in zip(starts, ends, strict=True)],
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


def circuit_figure(
    nodes: pd.DataFrame, edges: pd.DataFrame, *, n_layers: int, n_heads: int, title: str = "Circuit"
) -> go.Figure:
    """A circuit drawn as a graph: layers bottom-up, heads and MLPs as nodes, the given edges between them.

    Args:
        nodes: columns ``node`` (``embed``, ``pos_embed``, ``L{l}H{h}``, ``L{l}.mlp``, ``logits``) and
            ``score``: the nodes drawn, coloured by score. An edge's end missing here is drawn too,
            without a score.
        edges: columns ``upstream``, ``downstream`` (node names), ``input`` (``"q"``, ``"k"`` or
            ``"v"`` for an edge into a head, ``""`` otherwise) and ``score``: the edges drawn.
        n_layers: the model's number of layers, which places the nodes by row.
        n_heads: its number of heads a layer, which places them in the row.
        title: the figure's title (the edge legend is added to it).
    """
    _check_columns(nodes, "nodes", ("node", "score"))
    _check_columns(edges, "edges", ("upstream", "downstream", "input", "score"))
    for name, value in (("n_layers", n_layers), ("n_heads", n_heads)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    edges = edges.reset_index(drop=True).assign(input=edges["input"].fillna("").astype(str).to_numpy())
    _check_edges(edges, n_layers=n_layers, n_heads=n_heads)
    scores = dict(zip(nodes["node"], nodes["score"], strict=True))
    names = list(dict.fromkeys([*nodes["node"], *edges["upstream"], *edges["downstream"]]))
    places = [node_position(name, n_layers=n_layers, n_heads=n_heads) for name in names]
    values = np.array([float(scores.get(name, np.nan)) for name in names])
    bound = float(np.nanmax(np.abs(values))) if np.isfinite(values).any() else 1.0
    figure = go.Figure(_edge_traces(edges, n_layers=n_layers, n_heads=n_heads))
    figure.add_trace(
        go.Scatter(
            x=[x for x, _ in places], y=[y for _, y in places], mode="markers+text", text=names,
            textposition="top center", textfont={"size": 9}, name="nodes", showlegend=False,
            hovertext=[f"{name}<br>score={value:.4g}" if np.isfinite(value) else f"{name}<br>score: none"
                       for name, value in zip(names, values, strict=True)],
            hoverinfo="text",
            marker={"size": 14, "color": np.nan_to_num(values), "colorscale": DIVERGING, "cmid": 0,
                    "cmin": -bound or -1, "cmax": bound or 1, "line": {"width": 1, "color": "#333333"},
                    "colorbar": {"title": "node score", "x": 1.02}},
        )
    )  # fmt: skip
    rows = [0.0, *[layer + 1.0 + half for layer in range(n_layers) for half in (0.0, 0.5)], n_layers + 1.0]
    labels = ["embed", *[f"L{layer} {part}" for layer in range(n_layers) for part in ("heads", "mlp")], "logits"]
    figure.update_layout(
        title=f"{title}: {len(edges)} edges (colour: sign, width: |score|, dash: the input entered)",
        xaxis={"visible": False, "range": [-1, n_heads + 1.5]},
        yaxis={
            "title": "layer",
            "tickvals": rows,
            "ticktext": labels,
            "zeroline": False,
            "range": [-0.5, n_layers + 1.5],
        },
        height=max(450, 45 * (n_layers + 2) + 150),
        legend={"title": "edges", "orientation": "h", "x": 0, "y": -0.02, "yanchor": "top"},
    )
    return figure


def _band_colour(colour: str, alpha: float = 0.2) -> str:
    red, green, blue = plotly.colors.hex_to_rgb(colour) if colour.startswith("#") else plotly.colors.unlabel_rgb(colour)
    return f"rgba({red}, {green}, {blue}, {alpha})"


def curves_figure(curves: pd.DataFrame, *, title: str = "Faithfulness by circuit size") -> go.Figure:
    """Every method's faithfulness curve on one figure, the fraction of the graph kept on a log x axis.

    Args:
        curves: columns ``method``, ``fraction`` (in (0, 1]), ``faithfulness``, ``low`` and
            ``high`` (its interval, drawn as a band): one row per method and size.
        title: the figure's title.

    Example:
        >>> import pandas as pd
        >>> curves = pd.DataFrame({"method": ["eap"] * 2, "fraction": [0.1, 1.0], "faithfulness": [0.5, 1.0],
        ...                        "low": [0.4, 1.0], "high": [0.6, 1.0]})
        >>> [trace.name for trace in curves_figure(curves).data]
        ['eap (interval)', 'eap (interval)', 'eap', 'whole model']
    """
    _check_columns(curves, "curves", ("method", "fraction", "faithfulness", "low", "high"))
    fractions = curves["fraction"].to_numpy(dtype=float)
    if len(curves) and not ((fractions > 0) & (fractions <= 1)).all():
        raise ValueError(f"curves: every fraction must lie in (0, 1], got {sorted(set(fractions.tolist()))}")
    palette = plotly.colors.qualitative.Plotly
    figure = go.Figure()
    for index, (method, part) in enumerate(curves.groupby("method", sort=False)):
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
                legendgroup=str(method),
                hovertext=[f"{method}<br>{100 * row.fraction:.3g} % kept<br>faithfulness={row.faithfulness:.3f} "
                           f"[{row.low:.3f}, {row.high:.3f}]" for row in part.itertuples()],
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
