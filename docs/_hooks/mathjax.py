"""MkDocs hook: the built site carries its own MathJax, so formulas typeset with no network.

The pages load ``mathjax/MathJax.js`` (``extra_javascript`` in ``mkdocs.yml``); after the build this
copies MathJax 2.7 from the PyPI package ``jupyter-server-mathjax`` into ``site/mathjax/``, the
same copy and offline configuration that `contribution_lens.views.export_notebook` puts beside an
exported notebook.
"""

from typing import Any


def on_post_build(config: Any, **kwargs: Any) -> None:
    # Imported here: mkdocs loads hooks before it builds, and only this step needs the package.
    from contribution_lens.views.export import write_mathjax

    write_mathjax(config["site_dir"])
