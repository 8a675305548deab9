"""Figures of the circuits' checks: stability, linearisation error, exact edge effects.

Each function takes a result by what it offers (its type named under ``TYPE_CHECKING`` only) and
returns a `plotly.graph_objects.Figure`; none calls ``.show()``.

* `stability_figure`: the Jaccard index of circuits of resampled prompts against the circuit's
  size (log x axis), between resamples and against the circuit of all prompts, each with its 95 %
  band, and the overlap two random circuits of that size have by chance (dotted).
* `frequency_figure`: how often each of the most frequent edges (nodes) is in a resample's circuit.
* `linearisation_figure`: each prompt's linearised metric change against its true one, with the
  line where they agree.
* `edge_effects_figure`: each edge's score against its exact effect, one colour an input kind (q,
  k, v, mlp, logits), hover naming the edge, with the line ``score = effect``.

    >>> import torch
    >>> from contribution_lens.circuits.linearisation import Linearisation
    >>> result = Linearisation("demo", "contribution", 1, torch.tensor([1.0, 2.0]), torch.tensor([1.5, 2.0]))
    >>> [trace.name for trace in linearisation_figure(result).data]
    ['linearised = true', 'prompts']
"""

from typing import TYPE_CHECKING

import plotly.graph_objects as go

if TYPE_CHECKING:
    from contribution_lens.circuits.edge_effects import EdgeEffects
    from contribution_lens.circuits.linearisation import Linearisation
    from contribution_lens.circuits.stability import CircuitStability

KIND_COLOURS = {"q": "#1f77b4", "k": "#ff7f0e", "v": "#2ca02c", "mlp": "#9467bd", "logits": "#d62728"}
"""One colour an input kind (plotly's first qualitative colours)."""


def _band(figure: go.Figure, x: list[float], low: list[float], high: list[float], colour: str) -> None:
    figure.add_scatter(
        x=[*x, *x[::-1]],
        y=[*high, *low[::-1]],
        fill="toself",
        fillcolor=colour,
        opacity=0.2,
        line={"width": 0},
        hoverinfo="skip",
        showlegend=False,
    )


def stability_figure(result: "CircuitStability") -> go.Figure:
    """The overlap of circuits of resampled prompts against the share kept: between resamples, against all
    prompts, and by chance."""
    table = result.table.dropna(subset=["jaccard"])
    x = [100 * f for f in table["fraction"]]
    sizes = table["size"].tolist()
    figure = go.Figure()
    lines = (
        ("jaccard", "low", "high", "between resamples", "#1f77b4"),
        ("to_full", "to_full_low", "to_full_high", "each resample against all prompts", "#ff7f0e"),
    )
    for column, low, high, name, colour in lines:
        _band(figure, x, table[low].tolist(), table[high].tolist(), colour)
        figure.add_scatter(
            x=x,
            y=table[column],
            mode="lines+markers",
            name=name,
            line={"color": colour},
            customdata=sizes,
            hovertemplate="%{x}% kept (%{customdata:.0f})<br>Jaccard %{y:.3f}<extra>" + name + "</extra>",
        )
    figure.add_scatter(
        x=x,
        y=table["chance"],
        mode="lines",
        name="two random circuits (chance)",
        line={"dash": "dot", "color": "grey"},
        hovertemplate="%{x}% kept<br>chance %{y:.4f}<extra></extra>",
    )
    figure.update_layout(
        title=f"Stability of {result.method}'s circuits on {result.task} ({result.kept.shape[0]} {result.sampling} "
        f"resamples of {result.n_prompts} prompts, {result.level} level)",
        xaxis={"title": "share kept (%)", "type": "log"},
        yaxis={"title": "Jaccard index", "range": [0, 1.05]},
    )
    return figure


def frequency_figure(result: "CircuitStability", top: int = 40) -> go.Figure:
    """The share of resamples whose circuit holds each of the ``top`` most frequent items, at the size nearest
    1 %; items in the circuit of all prompts dark, the others pale."""
    table = result.inclusion().head(top)
    colours = ["#1f77b4" if full else "#aec7e8" for full in table["in_full"]]
    figure = go.Figure(
        go.Bar(
            x=table["item"],
            y=table["frequency"],
            marker={"color": colours},
            hovertemplate="%{x}<br>in %{y:.0%} of the resamples' circuits<extra></extra>",
        )
    )
    fraction = float(result.fractions[result._size(None)])
    figure.update_layout(
        title=f"How often an item is in a resample's circuit ({100 * fraction:g} % kept; dark: in all prompts')",
        xaxis={"title": "edge" if result.level == "edge" else "node"},
        yaxis={"title": "share of resamples", "range": [0, 1.05]},
    )
    return figure


def linearisation_figure(result: "Linearisation") -> go.Figure:
    """Each prompt's linearised metric change against its true change, and the line where they agree."""
    true = result.true.double().tolist()
    linearised = result.linearised.double().tolist()
    ends = [min(true + linearised), max(true + linearised)]
    figure = go.Figure()
    figure.add_scatter(x=ends, y=ends, mode="lines", name="linearised = true", line={"dash": "dot", "color": "grey"})
    figure.add_scatter(
        x=true,
        y=linearised,
        mode="markers",
        name="prompts",
        customdata=list(range(len(true))),
        hovertemplate="prompt %{customdata}<br>true %{x:.4g}<br>linearised %{y:.4g}<extra></extra>",
    )
    figure.update_layout(
        title=f"{result.method}'s own metric change against the true one on {result.task}",
        xaxis={"title": "m(counterfactual) − m(clean)"},
        yaxis={"title": "what the terms add up to"},
    )
    return figure


def edge_effects_figure(result: "EdgeEffects") -> go.Figure:
    """Each edge's score against its exact effect, one trace an input kind, hover naming the edge."""
    table = result.table
    figure = go.Figure()
    values = [*table["effect"].dropna(), *table["score"].dropna()]
    if values:
        ends = [min(values), max(values)]
        figure.add_scatter(x=ends, y=ends, mode="lines", name="score = effect", line={"dash": "dot", "color": "grey"})
    for kind, colour in KIND_COLOURS.items():
        rows = table[table["kind"] == kind]
        if rows.empty:
            continue
        figure.add_scatter(
            x=rows["effect"],
            y=rows["score"],
            mode="markers",
            name=f"into {kind}",
            marker={"color": colour},
            text=rows["edge"],
            customdata=rows[["low", "high"]].to_numpy(),
            hovertemplate="%{text}<br>exact effect %{x:.4g} [%{customdata[0]:.4g}, %{customdata[1]:.4g}]"
            "<br>score %{y:.4g}<extra></extra>",
        )
    method = result.method or "no method"
    figure.update_layout(
        title=f"{method}'s edge scores against their exact effects on {result.task}",
        xaxis={"title": "exact effect: m(edge patched alone) − m(clean)"},
        yaxis={"title": f"{method} score"},
    )
    return figure
