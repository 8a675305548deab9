"""Self-contained HTML reports: plotly.js embedded once (no CDN: reports open offline)."""

import html
import os
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go

from contribution_lens.files import write_text

Section = tuple[str, go.Figure | pd.DataFrame | str]


def render_html(title: str, sections: Sequence[Section]) -> str:
    """One HTML page of headed sections: figures, tables or paragraphs of text."""
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<title>{html.escape(title)}</title>",
        "<style>body{font-family:sans-serif;margin:2em;max-width:1400px}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}</style>",
        f"</head><body><h1>{html.escape(title)}</h1>",
    ]
    embedded = False
    for heading, content in sections:
        parts.append(f"<h2>{html.escape(heading)}</h2>")
        if isinstance(content, go.Figure):
            # No "Share chart" button: Chart Studio needs the network and an account a report never has.
            config = {"displaylogo": False, "showSendToCloud": False}
            parts.append(content.to_html(full_html=False, include_plotlyjs=not embedded, config=config))
            embedded = True
        elif isinstance(content, pd.DataFrame):
            parts.append(content.to_html(float_format=lambda x: f"{x:.4f}"))
        else:
            parts.append(f"<p>{html.escape(content)}</p>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_html(path: str | os.PathLike, title: str, sections: Sequence[Section]) -> Path:
    """Write `render_html` to ``path`` atomically (a half-written report never appears)."""
    return write_text(path, render_html(title, sections))
