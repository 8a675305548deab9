"""The inspector's static page: plotly.js once, every embedded layer's payload once, the view in the URL fragment.

One self-contained file that opens offline. The drawing code is the inspector's ES module
(`module`: ``static/*.js`` assembled into one), inlined once in a ``<script type="module">`` that
mounts it on the page's root element; the data sits in a ``<script type="application/json">`` block.
"""

import functools
import html
import json
import os
import re
from importlib import resources
from pathlib import Path
from typing import Any

import plotly.offline

from contribution_lens.files import write_text


def asset(name: str) -> str:
    """A front-end file of the inspector (``static/``)."""
    return (resources.files("contribution_lens.views.inspector") / "static" / name).read_text(encoding="utf-8")


MODULES = (
    "codecs.js",
    "windows.js",
    "factors.js",
    "captions.js",
    "colours.js",
    "settings.js",
    "controls.js",
    "figures.js",
    "why.js",
    "prediction.js",
    "view.js",
    "fragment.js",
    "page.js",
    "circuit.js",
    "inspector.js",
)
"""The front-end's files, each after those it imports; ``inspector.js`` (the widget's entry) last."""
_IMPORT = re.compile(r'^import \{[^}]*\} from "\./([a-z]+\.js)";\n', re.MULTILINE)


@functools.cache
def module() -> str:
    """The front-end's ES module as the widget and the page load it: `MODULES` in one, their imports removed.

    The widget's module is loaded from a string (anywidget's ``_esm``) and the page's is inline,
    so neither can fetch a file: each file's ``import { ... } from "./x.js";`` lines go, the
    names they import being defined earlier in the same module. Every other line is kept
    (``export`` included: the one module exports what every file does).
    """
    parts = []
    for position, name in enumerate(MODULES):
        text = asset(name)
        for imported in _IMPORT.findall(text):
            if imported not in MODULES[:position]:
                raise RuntimeError(f"static/{name} imports {imported}, which is not among the modules before it")
        parts.append(f"// --- {name} ---\n" + _IMPORT.sub("", text))
    return "\n".join(parts)


TRUST_HINT = (
    "This page draws the inspector with JavaScript, which has not run. In JupyterLab's HTML viewer, press "
    "<b>Trust HTML</b> at the top of the viewer; elsewhere, open the file in a browser with scripts allowed."
)
"""What a page shows where its scripts do not run (JupyterLab's viewer opens it untrusted); its script removes it."""


def render(
    meta: dict[str, Any],
    payloads: dict[int, dict[str, Any]],
    steps: dict[str, Any] | None = None,
    why: dict[str, Any] | None = None,
    circuit: dict[str, Any] | None = None,
) -> str:
    """The page for `contribution_lens.views.inspector.payload.meta`, those layers' payloads and explained steps.

    ``steps`` (`contribution_lens.views.inspector.steps.steps_payload`) adds the step control and
    the prediction view; ``why`` (``{"queries": [...], "rows": {"layer/head/query": row}}``, rows of
    `contribution_lens.views.inspector.why.why_row`) the *why* panel of those queries; ``circuit``
    (`contribution_lens.views.circuit_view.CircuitInspector.page_data`) a circuit drawn beside the
    inspector (above it on a narrow page), whose head nodes open that head (``static/circuit.js``).
    """
    data = {
        "meta": meta,
        "layers": {str(layer): {**payload, "key": str(layer)} for layer, payload in payloads.items()},
        "steps": steps,
        "why": why,
        "circuit": circuit,
    }
    blob = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    queries = meta["queries"]
    title = f"contribution-lens inspector: tokens {queries[0]}..{queries[-1]} of {meta['n_tokens']}"
    return "\n".join(
        [
            "<!DOCTYPE html><html><head><meta charset='utf-8'>",
            f"<title>{html.escape(title)}</title><style>{asset('inspector.css')}</style>",
            f"<script type='text/javascript'>{plotly.offline.get_plotlyjs()}</script>",
            f"</head><body><h1>{html.escape(title)}</h1>",
            f"<div class='cl-note cl-trust'>{TRUST_HINT}</div>",
            # A circuit beside the inspector (above it where the page is narrow): circuit.js, circuitPanes.
            "<div class='cl-circuit-layout'><div class='cl-circuit-root'></div>" if circuit else "",
            f"<div class='cl-page-root{' cl-circuit-answer' if circuit else ''}'></div>",
            "</div>" if circuit else "",
            f"<script type='application/json' class='cl-data'>{blob}</script>",
            "<script type='module'>",
            module(),
            "document.querySelector('.cl-trust').remove();  // scripts run: the hint is not needed",
            "const root = document.querySelector('.cl-page-root');",
            "const data = JSON.parse(document.querySelector('.cl-data').textContent);",
            "const shown = page(root, data);",
            "if (data.circuit) circuitView(document.querySelector('.cl-circuit-root'), data.circuit, shown, root);",
            "</script>",
            "</body></html>",
        ]
    )


def write(path: str | os.PathLike, text: str) -> Path:
    """Write a rendered page atomically."""
    return write_text(path, text)
