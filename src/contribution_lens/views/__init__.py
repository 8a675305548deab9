"""What people look at, above the methods: the inspector (`inspector`), a circuit opened in it (`circuit_view`),
every registered measure compared (`overview`), notebooks exported as pages (`export`).

The drawing these use (figures and pages from tensors and results) is `contribution_lens.drawing`, below the
analyses; its old places here (``views.plot``, ``views.html``, ``views.write_html``, ``views.render_html``)
keep working with a ``DeprecationWarning`` naming the new one. Names are imported on first use.
"""

from typing import TYPE_CHECKING

from contribution_lens._lazy import face

_EXPORTS = {
    "inspector": "contribution_lens.views.inspector",
    "overview": "contribution_lens.views.overview",
    "compare_measures": "contribution_lens.views.overview:compare_measures",
    "export": "contribution_lens.views.export",
    "export_notebook": "contribution_lens.views.export:export_notebook",
    "inspect": "contribution_lens.views.inspector:inspect",
    "Inspector": "contribution_lens.views.inspector:Inspector",
    "circuit_view": "contribution_lens.views.circuit_view",
    "inspect_circuit": "contribution_lens.views.circuit_view:inspect_circuit",
    "CircuitInspector": "contribution_lens.views.circuit_view:CircuitInspector",
}
_D = "contribution_lens.drawing"
_MOVED = {name: (f"{_D}.{name}", f"use {_D}.{name}") for name in ("plot", "html")} | {
    name: (f"{_D}.html:{name}", f"use {_D}.html.{name}") for name in ("write_html", "render_html")
}
"""The drawing's old names here, now in `contribution_lens.drawing`: each read warns with its new place."""
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = face(__name__, _EXPORTS, _MOVED)

if TYPE_CHECKING:
    from contribution_lens.views import circuit_view, export, inspector, overview
    from contribution_lens.views.circuit_view import CircuitInspector, inspect_circuit
    from contribution_lens.views.export import export_notebook
    from contribution_lens.views.inspector import Inspector, inspect
    from contribution_lens.views.overview import compare_measures
