"""The Jupyter server extension that makes JupyterLab's own HTML export readable.

JupyterLab's *File › Save and Export Notebook As › HTML* asks the server for
``/nbconvert/html/PATH?download=true&sanitize_html=true`` ("Sanitize HTML output" ticked, the
default), and the server exports with nbconvert's ``HTMLExporter`` under its own config. nbconvert's
sanitizing filter (``clean_html``) escapes every markdown paragraph and heading into visible tags and
prints a DataFrame's CSS and a script's source as text; its formulas wait for a MathJax from a CDN.
A server reads ``jupyter_server_config.d/`` only to enable extensions, so a config file installed
there cannot change the exporter: this extension, which the package's file there enables, does. When
the server starts it makes `contribution_lens.views.export.clean_html` the exporter's ``clean_html``
filter (markdown's tags kept, scripts and styles dropped whole, formulas as MathML), unless the
server's own config names one.

Example:
    >>> from traitlets.config import Config
    >>> config = Config()
    >>> configure(config)
    >>> config.HTMLExporter.filters["clean_html"]
    'contribution_lens.views.export.clean_html'
"""

from typing import Any

FILTERS = {"clean_html": "contribution_lens.views.export.clean_html"}
"""The ``HTMLExporter`` filters the extension sets, by name: where each is defined."""


def configure(config: Any) -> None:
    """Set `FILTERS` in ``config``'s ``HTMLExporter`` section, keeping any filter the config names already."""
    filters = dict(config.HTMLExporter.get("filters", {}) or {})
    for name, where in FILTERS.items():
        filters.setdefault(name, where)
    config.HTMLExporter.filters = filters


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    """The extension's module, as jupyter_server asks for it."""
    return [{"module": "contribution_lens.views.server_extension"}]


def _load_jupyter_server_extension(serverapp: Any) -> None:
    """At the server's start: the exporter of every later export request reads this config."""
    configure(serverapp.config)
    serverapp.log.info("contribution_lens: JupyterLab's HTML export keeps markdown and draws formulas offline")
