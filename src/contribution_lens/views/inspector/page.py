"""The inspector's static page: plotly.js once, every embedded layer's payload once, the view in the URL fragment.

One self-contained file that opens offline. The drawing code is the inspector's ES module
(`module`, ``static/inspector.js``), inlined once in a ``<script type="module">`` that
mounts it on the page's root element; the data sits in a ``<script type="application/json">`` block.
"""

import html
import json
import os
from importlib import resources
from pathlib import Path
from typing import Any

import plotly.offline

from contribution_lens.files import write_text


def asset(name: str) -> str:
    """A front-end file of the inspector (``static/``)."""
    return (resources.files("contribution_lens.views.inspector") / "static" / name).read_text(encoding="utf-8")


def module() -> str:
    """The front-end's ES module, as the widget and the page load it."""
    return asset("inspector.js")


def render(meta: dict[str, Any], payloads: dict[int, dict[str, Any]], steps: dict[str, Any] | None = None) -> str:
    """The page for `contribution_lens.views.inspector.payload.meta`, those layers' payloads and explained steps.

    ``steps`` (`contribution_lens.views.inspector.steps.steps_payload`) adds the step control and
    the prediction view.
    """
    data = {
        "meta": meta,
        "layers": {str(layer): {**payload, "key": str(layer)} for layer, payload in payloads.items()},
        "steps": steps,
    }
    blob = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    queries = meta["queries"]
    title = f"contribution-lens inspector: tokens {queries[0]}..{queries[-1]} of {meta['n_tokens']}"
    return "\n".join(
        [
            "<!DOCTYPE html><html><head><meta charset='utf-8'>",
            f"<title>{html.escape(title)}</title><style>{asset('inspector.css')}</style>",
            f"<script type='text/javascript'>{plotly.offline.get_plotlyjs()}</script>",
            f"</head><body><h1>{html.escape(title)}</h1><div class='cl-page-root'></div>",
            f"<script type='application/json' class='cl-data'>{blob}</script>",
            "<script type='module'>",
            module(),
            "const root = document.querySelector('.cl-page-root');",
            "page(root, JSON.parse(document.querySelector('.cl-data').textContent));",
            "</script>",
            "</body></html>",
        ]
    )


def write(path: str | os.PathLike, text: str) -> Path:
    """Write a rendered page atomically."""
    return write_text(path, text)
