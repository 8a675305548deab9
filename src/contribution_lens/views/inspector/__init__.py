"""The inspector: per-head contribution heatmaps, live in Jupyter and as one light shareable HTML file.

Users call `inspect` (it returns an `Inspector`, the live widget, whose ``write_html`` writes the
static page) and may catch `InspectorError`, the ``ValueError`` a refused value raises; a panel of
their own under the view is a `Panel` given to `register_panel` (`PANELS` holds them all). Inside,
one module a concern, each importing only those before it:

* `windows`: the token window shown (`windows.Window`, the half-overlapping menu) and token labels;
* `state`: the view state described once (`state.SETTINGS`): inspect's defaults, the traits, the front-end's list;
* `codecs`: how numbers are written for the page and read back (`codecs.CODECS`);
* `payload`: one layer's numbers for a window, all heads and KV groups combined (`payload.layer_payload`);
* `compact`: the compact codec of large pages (cosines from int8 unit vectors);
* `compute`: the one forward pass that codes every layer and cuts every window;
* `steps`: explained predictions, for the prediction view;
* `subject`: the model, text and layers inspected, and every check of a setting's value;
* `figure`: one view as numbers and as a figure (what exports and ``save_image`` show);
* `panel`: the panel seam (`Panel`: what a panel computes of the view, and its ES module; `PANELS`, the registry);
* `why`: the *why* panel, one head's score split at a query (`contribution_lens.qk_attribution`'s advantages);
* `caches`: what the widget keeps (precomputed windows, *why* splits); `exports`: the figures and page it writes;
* `widget`: `inspect` and `Inspector`; `page`: the static page and the front-end's module.

Both front-ends run the same ES module, assembled from ``static/*.js`` (``static/inspector.js`` is
its entry), whose elements are found inside its own root, so several inspectors live on one page.
The maths it shares with the Python side is pinned by a golden test (``node --test``).
"""

from typing import TYPE_CHECKING

from contribution_lens._lazy import face
from contribution_lens.views.inspector._deprecated import inspector_names

_EXPORTS = {
    "inspect": "contribution_lens.views.inspector.widget:inspect",
    "Inspector": "contribution_lens.views.inspector.widget:Inspector",
    "InspectorError": "contribution_lens.views.inspector.subject:InspectorError",
    "PANELS": "contribution_lens.views.inspector.panel:PANELS",
    "Panel": "contribution_lens.views.inspector.panel:Panel",
    "PanelSource": "contribution_lens.views.inspector.panel:PanelSource",
    "register_panel": "contribution_lens.views.inspector.panel:register_panel",
    "unregister_panel": "contribution_lens.views.inspector.panel:unregister_panel",
}
_DEPRECATED = inspector_names(__name__)
"""What this face re-exported before the split: each name warns and comes from its module."""
__all__ = [
    "PANELS",
    "Inspector",
    "InspectorError",
    "Panel",
    "PanelSource",
    "inspect",
    "register_panel",
    "unregister_panel",
]
__getattr__, __dir__ = face(__name__, _EXPORTS, _DEPRECATED)

if TYPE_CHECKING:
    from contribution_lens.views.inspector.panel import PANELS, Panel, PanelSource, register_panel, unregister_panel
    from contribution_lens.views.inspector.subject import InspectorError
    from contribution_lens.views.inspector.widget import Inspector, inspect
