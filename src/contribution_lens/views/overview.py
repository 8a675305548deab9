"""Every registered measure side by side (`compare_measures`), and the old free functions of a `Geometry`'s page.

`compare_measures` reads the method registry, so it lives here, above the methods, not in the
drawing below them (`contribution_lens.drawing.plot.measure_bars` draws it). A `Geometry`'s overview
is its own: `Geometry.figures` and `Geometry.report` (what ``contribution-lens demo`` writes);
`figures` and `write` here keep working, with a warning that says so.
"""

import os
import warnings
from pathlib import Path

import plotly.graph_objects as go

from contribution_lens.analyses.geometry import Geometry
from contribution_lens.drawing import plot
from contribution_lens.methods import decomposition_measures


def compare_measures(geometry: Geometry, *, layer: int, query: int, index: int = 0) -> go.Figure:
    """Every registered measure read off the decomposition for one query, each scaled to unit total |score|.

    The built-ins are attention, value-weighted, output-normalised and contribution; a user's
    method made with `contribution_lens.Method.from_decomposition` joins them, per head (summed
    over heads here) or token level ``[batch query key]``.

    Example:
        >>> import torch, contribution_lens as cl
        >>> future = torch.ones(3, 3).triu(1).bool()
        >>> pattern = torch.softmax(torch.randn(1, 2, 3, 3).masked_fill(future, -torch.inf), -1)
        >>> d = cl.decompose(pattern, torch.randn(1, 3, 1, 4), torch.randn(2, 4, 8))
        >>> g = cl.Geometry({0: d}, torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3, dtype=torch.bool),
        ...                 [["<s>", "a", "b"]], "inter")
        >>> [trace.name for trace in compare_measures(g, layer=0, query=2).data][:2]
        ['attention α', 'value-weighted α‖vt‖']
    """
    return plot.measure_bars(geometry, decomposition_measures(), layer=layer, query=query, index=index)


def figures(geometry: Geometry, *, layer: int | None = None, index: int = 0) -> list[tuple[str, go.Figure]]:
    """Deprecated: `Geometry.figures` (a dict, titled as here), which this returns as (title, figure) pairs."""
    warnings.warn(
        "contribution_lens.views.overview.figures is deprecated: use Geometry.figures(layer=..., index=...) "
        "(a dict of titled figures)",
        DeprecationWarning,
        stacklevel=2,
    )
    return list(geometry.figures(layer=layer, index=index, measures=decomposition_measures()).items())


def write(
    geometry: Geometry,
    path: str | os.PathLike,
    *,
    title: str = "contribution-lens",  # the page's title before it was Geometry.report's
    layer: int | None = None,
    text: str = "",
) -> Path:
    """Deprecated: `Geometry.report`."""
    warnings.warn(
        "contribution_lens.views.overview.write is deprecated: use Geometry.report(path, title=..., text=...)",
        DeprecationWarning,
        stacklevel=2,
    )
    return geometry.report(path, title=title, layer=layer, text=text, measures=decomposition_measures())
