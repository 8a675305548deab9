"""What people look at: figures (`plot`), the inspector (`inspector`), self-contained pages (`html`, `overview`,
notebooks exported by `export`).

`plot` and `html` are the bottom of the views (below the analyses, whose ``figures()`` and ``report()``
draw with them: they import no result type at run time and no registry); `overview` (every
registered measure compared), `inspector` and `export` sit above the methods.

Every figure function returns a ``plotly.graph_objects.Figure`` and never shows it; every page
opens offline (plotly.js embedded once) and is written atomically. Names are imported on first use.
"""

from typing import TYPE_CHECKING

from contribution_lens._lazy import face

_EXPORTS = {
    "plot": "contribution_lens.views.plot",
    "html": "contribution_lens.views.html",
    "inspector": "contribution_lens.views.inspector",
    "overview": "contribution_lens.views.overview",
    "compare_measures": "contribution_lens.views.overview:compare_measures",
    "export": "contribution_lens.views.export",
    "export_notebook": "contribution_lens.views.export:export_notebook",
    "inspect": "contribution_lens.views.inspector:inspect",
    "Inspector": "contribution_lens.views.inspector:Inspector",
    "write_html": "contribution_lens.views.html:write_html",
    "render_html": "contribution_lens.views.html:render_html",
}
__all__ = [
    "Inspector",
    "compare_measures",
    "export",
    "export_notebook",
    "html",
    "inspect",
    "inspector",
    "overview",
    "plot",
    "render_html",
    "write_html",
]
__getattr__, __dir__ = face(__name__, _EXPORTS)

if TYPE_CHECKING:
    from contribution_lens.views import export, html, inspector, overview, plot
    from contribution_lens.views.export import export_notebook
    from contribution_lens.views.html import render_html, write_html
    from contribution_lens.views.inspector import Inspector, inspect
    from contribution_lens.views.overview import compare_measures
