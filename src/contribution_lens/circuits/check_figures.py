"""Figures of the circuit checks: the linearisation error.

Each function takes a result by what it offers (its type named under ``TYPE_CHECKING`` only) and
returns a `plotly.graph_objects.Figure`; none calls ``.show()``.

* `linearisation_figure`: each prompt's linearised metric change against its true one, with the
  line where they agree.

    >>> import torch
    >>> from contribution_lens.circuits.linearisation import Linearisation
    >>> result = Linearisation("demo", "contribution", 1, torch.tensor([1.0, 2.0]), torch.tensor([1.5, 2.0]))
    >>> [trace.name for trace in linearisation_figure(result).data]
    ['linearised = true', 'prompts']
"""

from typing import TYPE_CHECKING

import plotly.graph_objects as go

if TYPE_CHECKING:
    from contribution_lens.circuits.linearisation import Linearisation


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
