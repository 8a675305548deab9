"""Notebooks as offline HTML pages that show what the notebook showed: figures, formulas, the inspector's view.

An export made by ``jupyter nbconvert --to html`` loses three things offline: MathJax comes from a
CDN (formulas stay raw TeX), widgets need a widget manager from a CDN (the inspector leaves its
text repr, a progress bar its first frame, "0%"), and plotly's default MIME bundle draws nothing.
No script of the page comes from the network.
`export_notebook` writes the page with a local MathJax beside it (from the PyPI package
``jupyter-server-mathjax``), a widget's static fallback instead of the widget (the inspector's is
its still, a PNG of its last view written before it), each progress bar's last frame, and
figures drawn live (a figure `contribution_lens.plot.use_in_notebook` showed as plotly's bundle and a
PNG is drawn from the bundle, plotly.js once in the page).

Example:
    >>> import nbformat, tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> cell = nbformat.v4.new_markdown_cell("The weights $c_{ij}$ sum to 1.")
    >>> page = export_notebook(nbformat.v4.new_notebook(cells=[cell]), folder / "lesson.html")
    >>> sorted(path.name for path in folder.iterdir()), "mathjax/MathJax.js" in page.read_text()
    (['lesson.html', 'mathjax'], True)
"""

import copy
import html as html_text
import importlib.util
import re
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import plotly.graph_objects as go

from contribution_lens import files
from contribution_lens._lazy import face

if TYPE_CHECKING:
    import nbformat

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
MATHJAX_FOLDER = "mathjax"
# MathJax 2.7 as jupyter-server-mathjax ships it: TeX in, HTML-CSS out with the STIX-Web fonts
# (the only ones it ships); "local/offline" is the small config `write_mathjax` adds for them.
MATHJAX_URL = f"{MATHJAX_FOLDER}/MathJax.js?config=TeX-AMS-MML_HTMLorMML-full,Safe,local/offline"
_OFFLINE_CONFIG = """\
MathJax.Hub.Config({"HTML-CSS": {availableFonts: ["STIX-Web"], preferredFont: "STIX-Web",
                                 webFont: "STIX-Web", imageFont: null}});
MathJax.Ajax.loadComplete("[MathJax]/config/local/offline.js");
"""


def export_notebook(
    notebook: "nbformat.NotebookNode | str | Path",
    path: str | Path,
    *,
    execute: bool = False,
    timeout: int = 600,
) -> Path:
    """Write ``notebook`` as an HTML page that shows offline what the notebook showed.

    The page loads MathJax from the ``mathjax/`` folder written beside it (shared by every page
    in that folder, about 10 MB once); everything else is in the page.

    Args:
        notebook: a notebook, or the path of an ``.ipynb`` file.
        path: the HTML file to write (atomically).
        execute: run the notebook first, top to bottom, in its own folder (python3 kernel).
        timeout: seconds one cell may run when ``execute`` is set.

    Returns:
        ``path`` as a ``Path``.

    Raises:
        ModuleNotFoundError: ``nbconvert`` (or ``nbclient`` to execute) or ``jupyter-server-mathjax``
            is not installed; the message says what to install.
    """
    reader = _need("nbformat", "nbformat")
    if isinstance(notebook, str | Path):
        source: Path | None = Path(notebook)
        node = reader.read(source, as_version=4)
    else:
        source, node = None, notebook
    if execute:
        from nbclient import NotebookClient

        folder = source.parent if source is not None else Path.cwd()
        NotebookClient(
            node, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(folder)}}
        ).execute()
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    return files.write_text(target, render_notebook(node, mathjax_url=write_mathjax(target.parent)))


def render_notebook(notebook: "nbformat.NotebookNode", *, mathjax_url: str = MATHJAX_URL) -> str:
    """The HTML of `export_notebook` as a string; MathJax is loaded from ``mathjax_url``."""
    _need("nbconvert", "nbconvert")
    from nbconvert import HTMLExporter
    from traitlets.config import Config

    # Merged streams with carriage returns applied: a text progress bar keeps its last frame only.
    config = Config({"CoalesceStreamsPreprocessor": {"enabled": True}})
    exporter = HTMLExporter(config=config, mathjax_url=mathjax_url, raw_template=_NO_REQUIRE_JS)
    page, _ = exporter.from_notebook_node(static_notebook(notebook))
    return page


# JupyterLab's page template loads require.js from a CDN for widgets; no output here needs it.
_NO_REQUIRE_JS = """{%- extends "index.html.j2" -%}
{%- block html_head_js_requirejs -%}{%- endblock html_head_js_requirejs -%}
"""
PLOTLY_MIME = "application/vnd.plotly.v1+json"


def static_notebook(notebook: "nbformat.NotebookNode") -> "nbformat.NotebookNode":
    """A copy of ``notebook`` whose outputs need neither a kernel nor a widget manager.

    A widget that carries a static fallback (``text/html``, an image) shows it; the inspector's
    widget goes, its still (the image written before it) showing its last view; a progress bar
    (tqdm's widget) becomes the text of its last frame, read from the saved widget state, or
    goes when no state was saved; the widget state goes (without its JavaScript, which comes
    from a CDN, it draws nothing offline).
    """
    from contribution_lens.drawing.plot import PLOTLY_MATHJAX

    static = copy.deepcopy(notebook)
    widgets = static.metadata.pop("widgets", {})
    # plotly.js goes in once: with the first figure drawn from plotly's bundle, unless an HTML figure has it.
    plotly_js = any(
        "plotly.js v" in str(output.get("data", {}).get("text/html", ""))
        for cell in static.cells
        for output in cell.get("outputs", [])
    )
    state = widgets.get(WIDGET_STATE, {}).get("state", {})
    for cell in static.cells:
        if cell.cell_type != "code":
            continue
        kept = []
        previous = None
        for output in cell.get("outputs", []):
            after_still, previous = previous is not None and _is_still(previous), output
            data = output.get("data", {})
            if isinstance(data.get("text/html"), str):
                # Plotly's notebook renderer loads MathJax 3 from a CDN with every figure (for TeX in
                # figures, which ours have none of); online it would replace the page's MathJax 2.
                data["text/html"] = PLOTLY_MATHJAX.sub("", data["text/html"])
            elif PLOTLY_MIME in data:  # `use_in_notebook`'s bundle and PNG: the page draws the figure live
                data["text/html"] = _live_figure(data[PLOTLY_MIME], plotly_js=not plotly_js)
                plotly_js = True
            if WIDGET_VIEW not in data:
                kept.append(output)
                continue
            if after_still:
                continue  # the inspector's widget: its still, just before it, shows its last view
            model = state.get(data[WIDGET_VIEW].get("model_id"), {})
            bar = progress_text(state, model) if model.get("model_name") == "HBoxModel" else None
            if set(data) - {WIDGET_VIEW, "text/plain"}:
                del data[WIDGET_VIEW]
                kept.append(output)
            elif bar is not None:
                data.clear()
                data["text/plain"] = bar
                kept.append(output)
            elif not _looks_like_a_progress_bar(data.get("text/plain", "")):
                del data[WIDGET_VIEW]
                kept.append(output)
        cell.outputs = kept
    return static


def _live_figure(figure: dict[str, Any], *, plotly_js: bool) -> str:
    """The HTML of a figure from plotly's MIME bundle (as the notebook renderer writes it, no MathJax)."""
    import plotly.io as pio

    return pio.to_html(
        figure, include_plotlyjs=plotly_js, include_mathjax=False, full_html=False, default_width="100%",
        default_height=525, validate=False,
    )  # fmt: skip


SAFE_TAGS = (
    *("p", "br", "hr", "h1", "h2", "h3", "h4", "h5", "h6", "img", "sub", "sup", "del", "s", "kbd"),
    *("table", "thead", "tbody", "tr", "th", "td", "div", "span", "pre", "code", "details", "summary"),
)
"""Tags `clean_html` keeps beside bleach's own (``a``, ``b``, ``blockquote``, ``code``, ``em``, ``li``, ...)."""


_SCRIPT_OR_STYLE = re.compile(r"<(script|style)\b[^>]*>.*?</\1\s*>", flags=re.S | re.I)
_CODE = re.compile(r"(<(pre|code)\b.*?</\2\s*>)", flags=re.S | re.I)
_DISPLAY_MATH = re.compile(r"\$\$(.+?)\$\$", flags=re.S)
# Pandoc's rule for inline maths: no space just inside the dollars, no digit just after the closing one ("$5 and $6").
_INLINE_MATH = re.compile(r"(?<![\\$])\$(?![\s$])([^$]+?)(?<![\s\\])\$(?!\d)")
MATHML_TAGS = (
    *("math", "semantics", "annotation", "mrow", "mi", "mn", "mo", "ms", "mtext", "mspace", "msub", "msup"),
    *("msubsup", "mfrac", "msqrt", "mroot", "mover", "munder", "munderover", "mtable", "mtr", "mtd", "mstyle"),
    *("mpadded", "mphantom", "menclose", "merror", "mfenced"),
)
"""The MathML elements `clean_html` keeps: what `math_html` writes for the formulas of markdown."""
MATHML_ATTRIBUTES = (
    *("xmlns", "display", "mathvariant", "stretchy", "fence", "separator", "lspace", "rspace", "width", "height"),
    *("depth", "accent", "accentunder", "linethickness", "columnalign", "rowspacing", "columnspacing"),
    *("movablelimits", "symmetric", "largeop", "minsize", "maxsize", "form", "scriptlevel", "displaystyle"),
    *("notation", "open", "close", "separators", "encoding"),
)


def math_html(text: str) -> str:
    """``$...$`` and ``$$...$$`` formulas of rendered markdown as MathML, which a browser draws with no script.

    A sanitized export (JupyterLab's default) keeps the formulas' TeX for a MathJax it loads from a CDN:
    offline they stay ``$...$`` source. MathML needs no script and no network (``latex2mathml``, pure
    Python; without it, or for a formula it cannot read, the TeX stays). Code (``<pre>``, ``<code>``) is
    left as it is.

    Example:
        >>> math_html("<p>Weights $c_{ij}$ cost $5 and $6.</p>")[:60]
        '<p>Weights <math xmlns="http://www.w3.org/1998/Math/MathML" '
    """
    try:
        from latex2mathml.converter import convert
    except ImportError:  # formulas stay TeX: MathJax draws them online
        return text

    def formula(display: str) -> Any:
        def replace(match: re.Match) -> str:
            try:
                return str(convert(html_text.unescape(match.group(1)), display=display))
            except Exception:  # a formula latex2mathml cannot read stays TeX
                return match.group(0)

        return replace

    parts = _CODE.split(text)
    for i in range(0, len(parts), 3):  # code at 1, 4, ...: its tag name at 2, 5, ...
        converted = _DISPLAY_MATH.sub(formula("block"), parts[i])
        parts[i] = _INLINE_MATH.sub(formula("inline"), converted)
    return "".join(part for i, part in enumerate(parts) if i % 3 != 2)


def clean_html(element: str | bytes) -> str:
    """nbconvert's ``clean_html`` filter (a sanitized export's cells) keeping what markdown writes.

    nbconvert 7's filter keeps bleach's tags and a few more, but no ``<p>``, heading or ``<img>``:
    in JupyterLab's default export (*Save and Export Notebook As › HTML*, "Sanitize HTML output"
    ticked) every markdown cell's paragraphs and headings are escaped into visible tags. This one
    keeps those as well (`SAFE_TAGS`) and is otherwise stricter: a ``<script>`` or ``<style>``
    element goes whole (nbconvert's escapes it into visible text: plotly.js's source, a
    DataFrame's CSS), no event handler or ``javascript:`` link gets through (bleach escapes any
    other tag into text), and an image may only be ``data:``, ``http(s):`` or relative. Formulas
    become MathML (`math_html`), drawn offline. The package's Jupyter server extension
    (`contribution_lens.views.server_extension`, enabled when the package is installed) makes it the
    ``clean_html`` filter of JupyterLab's HTML export.

    Example:
        >>> clean_html("<h1 id='a'>Title</h1><p>Text<script>alert(1)</script> <iframe></iframe></p>")
        '<h1 id="a">Title</h1><p>Text &lt;iframe&gt;&lt;/iframe&gt;</p>'
    """
    import bleach
    from bleach.css_sanitizer import CSSSanitizer

    text = element.decode() if isinstance(element, bytes) else str(element)
    text = math_html(_SCRIPT_OR_STYLE.sub("", text))
    return bleach.clean(
        text,
        tags={*bleach.ALLOWED_TAGS, *SAFE_TAGS, *MATHML_TAGS},
        attributes={
            **bleach.ALLOWED_ATTRIBUTES,
            "*": ["class", "id"],
            **{tag: list(MATHML_ATTRIBUTES) for tag in MATHML_TAGS},
            "img": ["src", "alt", "title", "width", "height"],
            "th": ["align"],
            "td": ["align"],
        },
        protocols={"http", "https", "mailto", "data"},
        css_sanitizer=CSSSanitizer(),
    )


def _is_still(output: "nbformat.NotebookNode") -> bool:
    """An inspector's still (`contribution_lens.views.inspector.still`): the output written before its widget."""
    return "still" in output.get("metadata", {}).get("contribution_lens", {})


def progress_text(state: dict[str, Any], box: dict[str, Any]) -> str | None:
    """The last frame of a tqdm notebook bar (a box of label, progress, label) as text, e.g. ``"work: 100% 3/3"``.

    None when the box is not such a bar.
    """
    children = [state.get(str(ref).removeprefix("IPY_MODEL_"), {}) for ref in box.get("state", {}).get("children", [])]
    names = [child.get("model_name") for child in children]
    if names != ["HTMLModel", "FloatProgressModel", "HTMLModel"]:
        return None
    left, bar, right = (child.get("state", {}) for child in children)
    # tqdm writes "desc: 100%" in the left label, "3/3 [00:01<00:00]" in the right one.
    words = [html_text.unescape(str(part.get("value", ""))) for part in (left, right)]
    total = bar.get("max") or 0
    if "%" not in words[0] and total:
        words.insert(1, f"{100 * (bar.get('value') or 0) / total:.0f}%")
    return " ".join(" ".join(words).replace("\u2007", " ").split())


def _looks_like_a_progress_bar(text: str) -> bool:
    """tqdm's text repr: ``"desc:  0%|          | 0/3 [00:00<?, ?it/s]"``."""
    return re.search(r"\d+%\|.*\| *\d+/", text) is not None


def write_mathjax(folder: str | Path) -> str:
    """Copy MathJax 2.7 from ``jupyter-server-mathjax`` into ``folder/mathjax`` (once) and return its URL.

    The URL is relative (``mathjax/MathJax.js?config=...``): a page in ``folder`` finds it offline,
    from a ``file://`` address too.
    """
    spec = importlib.util.find_spec("jupyter_server_mathjax")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "rendering formulas offline needs MathJax from jupyter-server-mathjax: pip install jupyter-server-mathjax"
        )
    source = Path(next(iter(spec.submodule_search_locations))) / "static"
    target = Path(folder) / MATHJAX_FOLDER
    config = Path("config") / "local" / "offline.js"
    if (target / config).is_file() and (target / "MathJax.js").is_file():
        return MATHJAX_URL
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".mathjax-", dir=target.parent))
    try:
        # English is built in: the 2 MB of other languages stay behind.
        shutil.copytree(source, staging / MATHJAX_FOLDER, ignore=shutil.ignore_patterns("localization"))
        (staging / MATHJAX_FOLDER / config).parent.mkdir(parents=True, exist_ok=True)
        (staging / MATHJAX_FOLDER / config).write_text(_OFFLINE_CONFIG, encoding="utf-8")
        shutil.rmtree(target, ignore_errors=True)  # an earlier copy without the config
        (staging / MATHJAX_FOLDER).replace(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return MATHJAX_URL


def figure_html(figure: go.Figure) -> str:
    """The HTML that showing ``figure`` here gives: the notebook renderer's when it is the default
    (`contribution_lens.plot.use_in_notebook`: plotly.js once per notebook), else a self-contained
    figure with plotly.js inside (about 4.7 MB).
    """
    import plotly.io as pio

    # Plotly's own display path (pio.show) builds the bundle this way: pending renderers, such as
    # the one embedding plotly.js in the notebook, are activated once, not once per figure.
    build = getattr(pio.renderers, "_build_mime_bundle", None)
    bundle = build(figure.to_dict()) if build is not None else {}
    page = bundle.get("text/html")
    return page if isinstance(page, str) else figure.to_html(full_html=False, include_plotlyjs=True)


def _need(module: str, package: str) -> Any:
    if importlib.util.find_spec(module) is None:
        raise ModuleNotFoundError(f"exporting notebooks needs {package}: pip install {package}")
    return importlib.import_module(module)


_DEPRECATED = {
    "inspector_figure": (
        "contribution_lens.views.inspector.figure:inspector_figure",
        "use contribution_lens.views.inspector.figure.inspector_figure",
    )
}
"""Names that moved out of this module: each warns and comes from its new place."""
if not TYPE_CHECKING:  # type checkers see this module's own names only
    __getattr__ = face(__name__, {}, _DEPRECATED)[0]
