"""Drawing: figures (`plot`; the circuits' in `circuit_figures`) and self-contained pages (`html`) from results.

Drawing sits *below* the results: a figure function takes a result by what it offers (its type named
for type checkers only, under ``TYPE_CHECKING``) and knows no method registry, so every result's
``figures()`` and ``report()`` draw with it without an import circle. What draws with the registry
(`contribution_lens.views.compare_measures`), the inspector and notebook export sit above, in
`contribution_lens.views`.

Every figure function returns a ``plotly.graph_objects.Figure`` and never shows it; every page opens
offline (plotly.js embedded once) and is written atomically. Names are imported on first use.
"""

from typing import TYPE_CHECKING

from contribution_lens._lazy import face

_EXPORTS = {
    "plot": "contribution_lens.drawing.plot",
    "html": "contribution_lens.drawing.html",
    "write_html": "contribution_lens.drawing.html:write_html",
    "render_html": "contribution_lens.drawing.html:render_html",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = face(__name__, _EXPORTS)

if TYPE_CHECKING:
    from contribution_lens.drawing import html, plot
    from contribution_lens.drawing.html import render_html, write_html
