"""A one-page overview of a `Geometry`: what ``contribution-lens demo`` writes.

The attention to, and the contribution of, the first token (BOS) per layer and head; then, at one
layer, the token-level contribution heatmap and every registered measure for the last query.
"""

import os
from pathlib import Path

import plotly.graph_objects as go
import torch

from contribution_lens.analyses.geometry import Geometry
from contribution_lens.views import html, plot


def figures(geometry: Geometry, *, layer: int | None = None, index: int = 0) -> list[tuple[str, go.Figure]]:
    """The overview's figures; ``layer`` defaults to `Geometry.sink_layer` of key 0 (where the two disagree most).

    Key 0 is BOS where the texts start with one, else the text's first token (named as such).
    """
    shown = geometry.sink_layer(0) if layer is None else geometry.resolve(layer)
    query = len(geometry.str_tokens[index]) - 1
    sink_attention = torch.stack([d.attention[index, :, 1:, 0].mean(-1) for d in geometry.values()])
    sink_contribution = torch.stack([d.contribution[index, :, 1:, 0].mean(-1) for d in geometry.values()])
    first = "BOS" if geometry.bos_first else f"the first token, {geometry.str_tokens[index][0]!r}"
    title = f"contribution of {first} ({geometry.scope}-head)"
    return [
        (
            f"Attention to the first token ({first}), per head",
            plot.head_grid(sink_attention, title=f"attention to {first}", layers=geometry.layers),
        ),
        (
            f"Contribution of the first token ({first}), per head",
            plot.head_grid(sink_contribution, title=title, layers=geometry.layers, signed=True),
        ),
        (f"Token-level contribution at layer {shown}", plot.token_heatmap(geometry, layer=shown, index=index)),
        (
            f"Every measure for the last query at layer {shown}",
            plot.compare_measures(geometry, layer=shown, query=query, index=index),
        ),
    ]


def write(
    geometry: Geometry,
    path: str | os.PathLike,
    *,
    title: str = "contribution-lens",
    layer: int | None = None,
    text: str = "",
) -> Path:
    """One self-contained HTML page: the text, the per-layer summary and `figures` (of batch element 0).

    Example:
        >>> import contribution_lens as cl, tempfile
        >>> model = cl.load_model()
        >>> g = cl.attention_geometry(model, "The cat sat on the mat.")
        >>> write(g, tempfile.mkdtemp() + "/demo.html").stat().st_size > 1_000_000  # plotly.js is embedded
        True
    """
    sections: list[html.Section] = [
        ("Text", text or "".join(geometry.str_tokens[0])),
        ("Per-layer summary", geometry.layer_summary()),
        *figures(geometry, layer=layer),
    ]
    return html.write_html(path, title, sections)
