"""Minimal figures of circuit results: the faithfulness curve, node scores, per-prompt metrics.

Each function takes a result (or its table) and returns a `plotly.graph_objects.Figure`; none
calls ``.show()``. Several curves on one figure compare methods:

    >>> import torch
    >>> from contribution_lens.circuits.evaluation import CircuitCurve
    >>> sizes = torch.tensor([[1.0, 2.0]] * 2, dtype=torch.float64)
    >>> curve = CircuitCurve("demo", "eap", "edge", torch.tensor([0.5, 1.0], dtype=torch.float64), torch.ones(3),
    ...                      torch.zeros(3), torch.tensor([[[0.5] * 3, [1.0] * 3]] * 2), sizes, sizes)
    >>> len(curve_figure([curve]).data)  # a band and a line for each selection
    4
"""

from collections.abc import Sequence
from typing import TYPE_CHECKING

import pandas as pd
import plotly.graph_objects as go

if TYPE_CHECKING:
    from contribution_lens.circuits.evaluation import CircuitCurve
    from contribution_lens.circuits.graph import Graph

DIVERGING = "RdBu_r"


def curve_figure(curves: Sequence["CircuitCurve"]) -> go.Figure:
    """Faithfulness against the fraction kept (log axis), one line a curve and selection (signed: CPR's circuits,
    ``|score|``: CMD's, dashed), its 95 % interval shaded."""
    figure = go.Figure()
    for curve in curves:
        x = curve.fractions.numpy() * 100
        intervals, values = curve.faithfulness_interval.numpy(), curve.faithfulness.numpy()
        areas = {"signed": f"CPR {curve.cpr:.2f}", "absolute": f"CMD {curve.cmd:.2f}"}
        for row, (selection, area) in enumerate(areas.items()):
            interval = intervals[row]
            figure.add_scatter(
                x=[*x, *x[::-1]],
                y=[*interval[:, 1], *interval[::-1, 0]],
                fill="toself",
                opacity=0.2,
                line={"width": 0},
                hoverinfo="skip",
                showlegend=False,
            )
            figure.add_scatter(
                x=x,
                y=values[row],
                mode="lines+markers",
                name=f"{curve.method}, {selection} ({area})",
                line={"dash": "solid" if selection == "signed" else "dash"},
                customdata=curve.edges[row].numpy(),
                hovertemplate="%{x}% kept (%{customdata:.0f} edges)<br>faithfulness %{y:.3f}<extra>"
                + f"{curve.method}, {selection}</extra>",
            )
    task = curves[0].task if curves else ""
    figure.update_layout(
        title=f"Faithfulness of circuits on {task}",
        xaxis={"title": "share kept (%)", "type": "log"},
        yaxis={"title": "faithfulness f(C)"},
    )
    return figure


def _grid(names: list[str], values: list[float]) -> tuple[list[list[float | None]], list[list[str]]]:
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


def scores_figure(nodes: pd.DataFrame, title: str) -> go.Figure:
    """Each head's and MLP's score: layers bottom-up, heads then the MLP across, centred at 0."""
    z, text = _grid(list(nodes["node"]), [float(v) for v in nodes["score"]])
    columns = [f"H{h}" for h in range(len(z[0]) - 1)] + ["mlp"]
    heatmap = go.Heatmap(
        z=z, x=columns, text=text, colorscale=DIVERGING, zmid=0, hovertemplate="%{text}: %{z:.4g}<extra></extra>"
    )
    figure = go.Figure(heatmap)
    figure.update_layout(title=f"Node scores: {title}", yaxis={"title": "layer"})
    return figure


def nodes_figure(graph: "Graph", kept: Sequence[str]) -> go.Figure:
    """Which heads and MLPs a circuit holds (1) or leaves out (0), layer by layer."""
    chosen = set(kept)
    z, text = _grid(graph.components, [float(name in chosen) for name in graph.components])
    columns = [f"H{h}" for h in range(len(z[0]) - 1)] + ["mlp"]
    figure = go.Figure(
        go.Heatmap(
            z=z, x=columns, text=text, colorscale="Blues", hovertemplate="%{text}<extra></extra>", zmin=0, zmax=1
        )
    )
    figure.update_layout(title="Nodes in the circuit", yaxis={"title": "layer"})
    return figure


def metrics_figure(metrics: pd.DataFrame, task: str) -> go.Figure:
    """Each prompt's metric in the clean, counterfactual and patched passes."""
    figure = go.Figure()
    for column in ("clean", "corrupted", "patched"):
        figure.add_scatter(x=list(range(len(metrics))), y=metrics[column], mode="markers", name=column)
    figure.update_layout(title=f"Metric per prompt: {task}", xaxis={"title": "prompt"}, yaxis={"title": "metric"})
    return figure
