"""Plotly figures of contribution weights. Every function returns a ``go.Figure``; none shows it.

Signed quantities (cosine, contribution) use a diverging scale centred at 0; axis labels are
unique ``"{position}:{token}"`` strings so repeated tokens stay apart.

Drawing is the bottom of the views: a function takes a result by what it offers (the result types
are named for type checkers only) and knows no registry, so every result's ``figures()`` draws
with these functions without an import circle.
"""

import base64
import os
import re
import shutil
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch
from plotly.io.base_renderers import MimetypeRenderer, NotebookRenderer, PlotlyRenderer
from plotly.subplots import make_subplots
from torch import Tensor

from contribution_lens import files
from contribution_lens._lazy import face
from contribution_lens.choices import FACTORS, Factor, as_index
from contribution_lens.decomposition import Decomposition
from contribution_lens.qk import component_layer_head

if TYPE_CHECKING:
    from contribution_lens.analyses.flow import Flow
    from contribution_lens.analyses.generation import GenerationExplanation
    from contribution_lens.analyses.geometry import Geometry
    from contribution_lens.analyses.logit_attribution import LogitAttribution
    from contribution_lens.analyses.qk_attribution import QKAttribution
    from contribution_lens.analyses.sinks import SinkLayer

__getattr__, _ = face(
    __name__,
    {  # the circuits' figures, drawn in their own module of this layer
        "circuit_figure": "contribution_lens.drawing.circuit_figures:circuit_figure",
        "faithfulness_figure": "contribution_lens.drawing.circuit_figures:faithfulness_figure",
    },
    {
        "compare_measures": (
            "contribution_lens.views.overview:compare_measures",
            "use contribution_lens.views.compare_measures (every registered measure), or "
            "Geometry.figures(measures=...)",
        )
    },
)  # `compare_measures` reads the method registry, which drawing does not know

DIVERGING = "RdBu_r"
SEQUENTIAL = "Viridis"


def _check_head(d: Decomposition, head: int | None) -> None:
    n_heads = d.attention.shape[1]
    head = None if head is None else as_index(head, "head must be an integer (or None: every head)")
    if head is not None and not 0 <= head < n_heads:
        raise ValueError(f"head {head} does not exist: the layer has {n_heads} heads (0..{n_heads - 1})")


def _check_index(geometry: "Geometry", index: int) -> int:
    batch = geometry.tokens.shape[0]
    if not 0 <= index < batch:
        raise ValueError(f"index {index} is outside the batch of {batch}")
    return len(geometry.str_tokens[index])


def _numpy(tensor: Tensor) -> np.ndarray:
    """A NumPy view where possible: copy before writing to it."""
    return tensor.detach().to("cpu", torch.float32).numpy()


def token_factors(d: Decomposition, head: int | None, index: int, n: int) -> dict[str, Tensor]:
    """All four factors ``[query key]`` of one head, or token level when ``head`` is None.

    Token level is `Decomposition.token_factors`: contribution summed over heads, attention
    averaged, relative norm and cosine their attention-weighted head mean.
    """
    if head is not None:
        return {name: d.factor(name)[index, head, :n, :n] for name in FACTORS}
    return {name: values[index, :n, :n] for name, values in d.token_factors().items()}


def hide_sink(values: np.ndarray, totals: np.ndarray, sink: int = 0) -> np.ndarray:
    """Shares without the sink, renormalised: ``x'_ij = x_ij * S_i / (S_i - x_i0)``, the sink column NaN.

    ``S_i`` is query ``i``'s total over all its keys (1 for attention and for inter-head
    token-level contribution): the other keys keep the row's total between them. A row with
    nothing left besides the sink (``|S_i - x_i0| <= 1e-6 max(1, |S_i|)``) is NaN. Relative
    norm and cosine are properties of a key, not shares: they are shown as they are. The page
    computes the same.

    Example:
        >>> hide_sink(np.array([[1.0, 0.0], [0.5, 0.25]]), np.array([1.0, 0.75])).tolist()
        [[nan, nan], [nan, 0.75]]
    """
    values = np.asarray(values, dtype=np.float64)
    totals = np.asarray(totals, dtype=np.float64)[..., None]
    rest = totals - values[..., sink : sink + 1]
    empty = np.abs(rest) <= 1e-6 * np.maximum(1.0, np.abs(totals))
    out = np.where(empty, np.nan, values * totals / np.where(empty, 1.0, rest))
    out[..., sink] = np.nan
    return out


SHARES = (Factor.ATTENTION, Factor.CONTRIBUTION)
"""The factors that are shares of a query's total, renormalised when the sink is hidden."""


def _without_sink(factors: dict[str, Tensor]) -> dict[str, Tensor]:
    """`hide_sink` of attention and contribution ``[query key]`` (rows total over every key), cosine and norm kept."""
    out = dict(factors)
    for name in SHARES:
        values = _numpy(factors[name]).astype(np.float64)
        out[name] = torch.from_numpy(hide_sink(values, values.sum(-1)))
    return out


def _hover(factors: dict[str, Tensor]) -> np.ndarray:
    arrays = [_numpy(factors[name]) for name in FACTORS]
    return np.stack(arrays, axis=-1)


HOVER_TEMPLATE = (
    "query %{y}<br>key %{x}<br>attention %{customdata[0]:.4f}<br>relative norm %{customdata[1]:.3f}"
    "<br>cosine %{customdata[2]:.3f}<br>contribution %{customdata[3]:.4f}<extra></extra>"
)


def _heatmap(values: np.ndarray, labels: list[str], factor: Factor, customdata: np.ndarray) -> go.Heatmap:
    signed = factor.signed
    kwargs: dict = {"colorscale": DIVERGING, "zmid": 0} if signed else {"colorscale": SEQUENTIAL}
    return go.Heatmap(
        z=values,
        x=labels,
        y=labels,
        customdata=customdata,
        hovertemplate=HOVER_TEMPLATE,
        # Left-anchored just right of the plot area: the colour bar never covers the last column.
        colorbar={"title": str(factor), "x": 1.02, "xanchor": "left"},
        **kwargs,
    )


def factor_grid(
    factors: dict[str, np.ndarray],
    *,
    factor: Factor | str,
    queries: Sequence[str],
    keys: Sequence[str],
) -> go.Figure:
    """Query x key heatmap of one factor, drawn from ``[query key]`` grids of all four (NaN cells blank).

    ``factors`` maps each of `contribution_lens.FACTORS` to its grid; the hover shows all four
    numbers of a cell. Every query and key is labelled (``queries``, ``keys``: unique labels).

    Example:
        >>> grid = np.array([[1.0, np.nan], [0.25, 0.75]])
        >>> figure = factor_grid({name: grid for name in FACTORS}, factor="attention", queries=["0:a", "1:b"],
        ...                      keys=["0:a", "1:b"])
        >>> figure.data[0].y, figure.layout.yaxis.autorange
        (('0:a', '1:b'), 'reversed')
    """
    factor = Factor.of(factor)
    hover = np.stack([np.asarray(factors[name]) for name in FACTORS], axis=-1)
    trace = _heatmap(np.asarray(factors[factor]), list(keys), factor, hover).update(y=list(queries))
    ticks = {"tickmode": "array", "tickvals": list(keys), "ticktext": list(keys)}
    return go.Figure(trace).update_layout(
        xaxis={"title": "key", "tickangle": -60, **ticks},
        yaxis={"title": "query", "autorange": "reversed", **ticks, "tickvals": list(queries),
               "ticktext": list(queries)},
        height=max(400, 14 * len(queries) + 200),
        width=max(500, 14 * len(keys) + 260),
    )  # fmt: skip


def token_heatmap(
    geometry: "Geometry",
    *,
    layer: int,
    head: int | None = None,
    factor: Factor | str = Factor.CONTRIBUTION,
    index: int = 0,
    hide_sink: bool = False,
) -> go.Figure:
    """Query x key heatmap of one factor for one layer and head (token level if ``head`` is None).

    Hovering a cell shows all four numbers; future keys are blank. ``hide_sink`` drops key 0
    and renormalises the other keys' attention and contribution (`hide_sink`), so the colour
    scale shows how the rest is shared.

    Example:
        >>> import torch, contribution_lens as cl
        >>> future = torch.ones(3, 3).triu(1).bool()
        >>> pattern = torch.softmax(torch.randn(1, 2, 3, 3).masked_fill(future, -torch.inf), -1)
        >>> d = cl.decompose(pattern, torch.randn(1, 3, 1, 4), torch.randn(2, 4, 8))
        >>> ids, mask = torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3, dtype=torch.bool)
        >>> g = cl.Geometry({0: d}, ids, mask, [["<s>", "a", "b"]], "inter")
        >>> token_heatmap(g, layer=0, head=1).data[0].x
        ('0:<s>', '1:a', '2:b')
    """
    factor = Factor.of(factor)
    d = geometry[layer]
    _check_head(d, head)
    n = _check_index(geometry, index)
    factors = token_factors(d, head, index, n)
    if hide_sink:
        factors = _without_sink(factors)
    values = _numpy(factors[factor]).copy()  # .numpy() shares memory with the result
    # Blank what the query cannot see: future keys of a causal model (an encoder sees every key).
    values[~d.valid[index, :n, :n].cpu().numpy()] = np.nan
    labels = geometry.labels(index)
    where = f"L{layer}H{head}" if head is not None else f"L{layer}, all heads"
    hover = _hover(factors)
    if hide_sink:
        where += ", sink hidden"
    figure = go.Figure(_heatmap(values, labels, factor, hover))
    if hide_sink:
        figure.update_traces(z=values[:, 1:], x=labels[1:], customdata=hover[:, 1:])
    # Every label, not every other one: plotly thins category ticks unless told which to draw.
    ticks = {"tickmode": "array", "tickvals": labels, "ticktext": labels, "tickfont": {"size": 10}}
    figure.update_layout(
        title=f"{factor} ({geometry.scope}-head), {where}",
        xaxis={"title": "key", "tickangle": -60, **ticks},
        yaxis={"title": "query", "autorange": "reversed", **ticks},
        height=max(400, 14 * n + 200),
        width=max(500, 14 * n + 260),
    )
    return figure


def head_grid(
    values: Tensor,
    *,
    title: str,
    layers: Sequence[int] | None = None,
    signed: bool | None = None,
    colorbar_title: str = "",
) -> go.Figure:
    """Layer x head heatmap of a per-head statistic ``[layer head]`` (labels ``L{l}H{h}`` on hover)."""
    if values.ndim != 2:
        raise ValueError(f"values must be [layer head], got shape {tuple(values.shape)}")
    array = _numpy(values)
    n_layers, n_heads = array.shape
    layer_ids = list(range(n_layers)) if layers is None else list(layers)
    if len(layer_ids) != n_layers:
        raise ValueError(f"{len(layer_ids)} layer labels for {n_layers} rows")
    if signed is None:
        signed = bool((array < 0).any())
    kwargs: dict = {"colorscale": DIVERGING, "zmid": 0} if signed else {"colorscale": SEQUENTIAL}
    text = [[f"L{layer}H{h}" for h in range(n_heads)] for layer in layer_ids]
    figure = go.Figure(
        go.Heatmap(
            z=array,
            x=list(range(n_heads)),
            y=layer_ids,
            text=text,
            hovertemplate="%{text}: %{z:.4f}<extra></extra>",
            colorbar={"title": colorbar_title},
            **kwargs,
        )
    )
    figure.update_layout(title=title, xaxis={"title": "head", "dtick": 1}, yaxis={"title": "layer"})
    return figure


def factor_bars(
    geometry: "Geometry",
    *,
    layer: int,
    query: int,
    head: int | None = None,
    index: int = 0,
    hide_sink: bool = False,
) -> go.Figure:
    """For one query, the three factors and their product per key: what makes this token count?

    ``hide_sink`` drops key 0 and renormalises the other keys' attention and contribution (`hide_sink`).
    """
    d = geometry[layer]
    _check_head(d, head)
    keys = _query_keys(geometry, index, query)
    seen = len(keys)
    factors = token_factors(d, head, index, len(geometry.str_tokens[index]))
    first = 0
    if hide_sink:
        factors, first = _without_sink(factors), 1
    where = f"L{layer}H{head}" if head is not None else f"L{layer}, all heads"
    # One panel and one scale per factor: on a shared axis the contribution bars (~0.01) vanish
    # beside relative norms (~1-5).
    figure = make_subplots(rows=1, cols=len(FACTORS), shared_yaxes=True, subplot_titles=[*FACTORS])
    for column, name in enumerate(FACTORS, start=1):
        values = _numpy(factors[name][query, first:seen])
        figure.add_bar(
            x=values, y=keys[first:], orientation="h", name=name, showlegend=False, row=1, col=column,
            hovertemplate="key %{y}<br>" + name + " %{x:.4f}<extra></extra>",
        )  # fmt: skip
    figure.update_yaxes(
        autorange="reversed", tickmode="array", tickvals=keys[first:], ticktext=keys[first:], row=1, col=1
    )
    figure.update_layout(
        title=f"Factors of the contribution of each key to query {geometry.labels(index)[query]!r}, {where}",
        height=max(360, 16 * len(keys) + 160),
    )
    return figure


Measure = Callable[[Decomposition], Tensor]
"""A score read off one layer's `Decomposition`: ``[batch head query key]`` per head or ``[batch query key]``."""


def measure_bars(
    geometry: "Geometry", measures: Mapping[str, Measure], *, layer: int, query: int, index: int = 0
) -> go.Figure:
    """Each measure's scores of the keys of one query, side by side, each scaled to unit total ``|score|``.

    ``measures`` maps a label to a score of the layer's `Decomposition`; a per-head score
    ``[batch head query key]`` is summed over heads, a token-level one ``[batch query key]`` drawn
    as it is. `Geometry.figures` passes the decomposition's own four (attention, value-weighted,
    output-normalised, contribution); `contribution_lens.views.overview.compare_measures` every
    registered measure.

    Example:
        >>> import torch, contribution_lens as cl
        >>> future = torch.ones(3, 3).triu(1).bool()
        >>> pattern = torch.softmax(torch.randn(1, 2, 3, 3).masked_fill(future, -torch.inf), -1)
        >>> d = cl.decompose(pattern, torch.randn(1, 3, 1, 4), torch.randn(2, 4, 8))
        >>> g = cl.Geometry({0: d}, torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3, dtype=torch.bool),
        ...                 [["<s>", "a", "b"]], "inter")
        >>> bars = measure_bars(g, {"attention": lambda d: d.attention}, layer=0, query=2)
        >>> round(float(abs(bars.data[0].y).sum()), 6)
        1.0
    """
    d = geometry[layer]
    keys = _query_keys(geometry, index, query)
    bars = {}
    for label, measure in measures.items():
        scores = measure(d)
        # Per head [batch head query key] is summed over heads; token level [batch query key] is as it is.
        score = scores[index, :, query].sum(0) if scores.ndim == 4 else scores[index, query]
        score = score[: len(keys)]
        bars[label] = score / score.abs().sum().clamp_min(1e-30)
    title = (
        f"Importance of each key for query {geometry.labels(index)[query]!r} at layer {layer} (sum over heads, scaled)"
    )
    return _grouped_bars(bars, keys, title, "share of total |score|")


def _query_keys(geometry: "Geometry", index: int, query: int) -> list[str]:
    """Labels of the keys query ``query`` sees, after checking the query exists.

    That is up to the query itself in a decoder, the whole text in an encoder.
    """
    n = _check_index(geometry, index)
    if not 0 <= query < n:
        raise ValueError(f"query {query} is outside the text of {n} tokens")
    d = next(iter(geometry.values()))
    last = int(d.valid[index, query].nonzero().max()) if bool(d.valid[index, query].any()) else query
    return geometry.labels(index)[: last + 1]


def _grouped_bars(bars: dict[str, Tensor], keys: list[str], title: str, yaxis_title: str) -> go.Figure:
    figure = go.Figure()
    for name, values in bars.items():
        figure.add_bar(name=name, x=keys, y=_numpy(values))
    figure.update_layout(
        barmode="group", title=title, xaxis={"title": "key", "tickangle": -60}, yaxis={"title": yaxis_title}
    )
    return figure


def lines(
    series: dict[str, Sequence[int | float]],
    *,
    title: str,
    x: Sequence[int | float] | None = None,
    xaxis_title: str = "layer",
    yaxis_title: str = "",
) -> go.Figure:
    """One line per named series, over layers (default ``x = 0, 1, ...``) or any other axis."""
    figure = go.Figure()
    for number, (name, values) in enumerate(series.items()):
        xs = list(range(len(values))) if x is None else [float(v) for v in x]
        # Dash and marker differ per line, so identical series stay visible on top of each other.
        figure.add_scatter(
            x=xs, y=[float(v) for v in values], mode="lines+markers", name=name,
            line={"dash": DASHES[number % len(DASHES)], "width": 2 + (number % 3)},
            marker={"symbol": SYMBOLS[number % len(SYMBOLS)], "size": 7 + 2 * (number % 3)}, opacity=0.85,
        )  # fmt: skip
    figure.update_layout(title=title, xaxis={"title": xaxis_title}, yaxis={"title": yaxis_title})
    return figure


DASHES = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")
SYMBOLS = ("circle", "square", "diamond", "triangle-up", "x", "cross", "star")


def use_in_notebook(images: bool | None = None) -> None:
    """Show figures in notebooks so that every export shows them too, offline, and no figure asks a CDN.

    Plotly's default Jupyter renderer writes a MIME bundle that only a live Jupyter front end
    draws: exported notebooks (``jupyter nbconvert --to html``) and static viewers show nothing.
    With images (the default where kaleido and a Chromium are installed, as the ``dev`` extra and
    the course have them) each output holds plotly's own bundle (``application/vnd.plotly.v1+json``,
    which JupyterLab's plotly extension draws live, offline) and a PNG of the figure drawn by kaleido,
    which every export shows, JupyterLab's default *sanitized* one (*Save and Export Notebook As ›
    HTML*) included; `contribution_lens.views.export_notebook` draws the figures live again. A
    figure costs about 0.5-2 s more to show on a loaded 2-core CPU and 27-64 KB of PNG in the
    notebook (measured in docs/course.md); the notebook holds no plotly.js. Without images (``images=False``, or where
    kaleido or a Chromium is missing) the renderer writes plain HTML, with plotly.js in the first
    figure's output: an unsanitized export draws each figure live, but a sanitized one prints its
    scripts as text. Neither mode loads MathJax from a CDN (plotly's notebook renderer asks one
    with every figure, for TeX in figures, which this package's have none of).

    Args:
        images: add a PNG to each figure's output, plotly's bundle in place of HTML: True (needs
            kaleido and a Chromium, checked here), False (HTML), or None (default): True where
            both are installed, else False.

    Raises:
        TypeError: ``images`` is not True, False or None.
        RuntimeError: ``images=True`` and kaleido or a Chromium is missing, saying what to install.

    Example:
        >>> import plotly.io as pio
        >>> before = pio.renderers.default
        >>> use_in_notebook(images=False)
        >>> pio.renderers.default
        'contribution_lens_html'
        >>> pio.renderers.default = before
    """
    import plotly.io as pio

    if images is not None and not isinstance(images, bool):
        raise TypeError(f"images must be True, False or None, got {type(images).__name__} {images!r}")
    if images is None:
        images = _image_writer_missing() is None
    if images:
        _start_image_writer()
        pio.renderers[_IMAGE_RENDERER] = _FigureAndImage()
    else:
        pio.renderers[_HTML_RENDERER] = _OfflineNotebookRenderer()
    pio.renderers.default = _IMAGE_RENDERER if images else _HTML_RENDERER


_IMAGE_RENDERER = "contribution_lens_images"
"""The name `use_in_notebook` gives `_FigureAndImage` among plotly's renderers (with images)."""
_HTML_RENDERER = "contribution_lens_html"
"""The name `use_in_notebook` gives `_OfflineNotebookRenderer` among plotly's renderers (``images=False``)."""
PLOTLY_MATHJAX = re.compile(r'<script src="https://cdnjs\.cloudflare\.com/ajax/libs/mathjax/[^"]*"></script>')
"""The MathJax 3 script plotly's notebook renderer puts in every figure's HTML (a CDN request)."""


class _OfflineNotebookRenderer(NotebookRenderer):
    """Plotly's ``"notebook"`` renderer (plotly.js once per notebook) without its MathJax request to a CDN."""

    def to_mimebundle(self, fig_dict: dict) -> dict:
        bundle = super().to_mimebundle(fig_dict)
        bundle["text/html"] = PLOTLY_MATHJAX.sub("", bundle["text/html"])
        return bundle


class _FigureAndImage(MimetypeRenderer):
    """Plotly's MIME bundle of a figure and a PNG of it: live front ends draw the first, exports show the second.

    A sanitizer keeps ``image/png`` and drops the plotly bundle; nbconvert, which has no plotly
    renderer, shows the PNG. The PNG is kaleido's (`save_image`'s writer, started beforehand).
    """

    def to_mimebundle(self, fig_dict: dict) -> dict:
        import plotly.io as pio

        bundle = PlotlyRenderer().to_mimebundle(fig_dict)
        with warnings.catch_warnings():
            # plotly passes its defaults to each call; the running server already has them.
            warnings.filterwarnings("ignore", message="The kopts argument is ignored")
            png = pio.to_image(fig_dict, format="png")
        bundle["image/png"] = base64.b64encode(png).decode("ascii")
        return bundle


IMAGE_FORMATS = {".png": "png", ".svg": "svg", ".pdf": "pdf", ".jpg": "jpeg", ".jpeg": "jpeg", ".webp": "webp"}
"""File suffix -> the format `save_image` writes."""
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "chrome")


def save_image(figure: go.Figure, path: str | Path, *, scale: int | float = 2) -> Path:
    """Write ``figure`` as a static image, the format chosen by the suffix: PNG, SVG, PDF, JPEG or WebP.

    Drawn by kaleido (the ``images`` extra: ``pip install 'contribution-lens[images]'``) in a headless
    Chromium: ``BROWSER_PATH`` names it, else the first of ``chromium``, ``google-chrome`` on ``PATH``
    is used (kaleido's own browser download needs the network). The file appears whole or not at all.

    Args:
        figure: any figure of this module (or any plotly figure).
        path: where to write; ``.png``, ``.svg``, ``.pdf``, ``.jpg``/``.jpeg`` or ``.webp``.
        scale: pixels per layout pixel for PNG, JPEG and WebP (2: sharp on a slide).

    Returns:
        ``path`` as a ``Path``.

    Raises:
        ValueError: the suffix is not one of those formats (checked before anything is drawn).
        RuntimeError: kaleido or a Chromium is missing, saying what to install.

    Example:
        >>> import plotly.graph_objects as go
        >>> save_image(go.Figure(go.Bar(y=[1, 2])), "bars.gif")
        Traceback (most recent call last):
        ...
        ValueError: cannot write 'bars.gif': the suffix must be one of .png, .svg, .pdf, .jpg, .jpeg, .webp
    """
    target = Path(path)
    image_format = IMAGE_FORMATS.get(target.suffix.lower())
    if image_format is None:
        raise ValueError(f"cannot write {str(path)!r}: the suffix must be one of {', '.join(IMAGE_FORMATS)}")
    _start_image_writer()
    with warnings.catch_warnings():
        # plotly passes its defaults to each call; the running server already has them.
        warnings.filterwarnings("ignore", message="The kopts argument is ignored")
        data = figure.to_image(format=image_format, scale=scale if image_format not in ("svg", "pdf") else 1)
    target.parent.mkdir(parents=True, exist_ok=True)
    with files.atomic_path(target) as staging:
        staging.write_bytes(data)
    return target


def _image_writer_missing() -> str | None:
    """What writing images lacks, said as `_start_image_writer` says it (None: kaleido and a Chromium are here)."""
    import importlib.util

    if importlib.util.find_spec("kaleido") is None:
        return "writing images needs kaleido: pip install 'contribution-lens[images]' (or 'kaleido>=1')"
    browser = os.environ.get("BROWSER_PATH") or next(filter(None, map(shutil.which, BROWSERS)), None)
    if browser is None or not Path(browser).exists():
        where = f"BROWSER_PATH={browser!r} names no file; " if browser else ""
        return (
            f"writing images needs a Chromium for kaleido: {where}install one (Debian: apt-get install chromium) "
            "or set BROWSER_PATH to its executable"
        )
    return None


def _start_image_writer() -> None:
    """Start kaleido's Chromium once per process (seconds), after checking kaleido and a Chromium are here.

    Later images reuse it (under a second each); it stops when Python exits.
    """
    missing = _image_writer_missing()
    if missing is not None:
        raise RuntimeError(missing)
    browser = os.environ.get("BROWSER_PATH") or next(filter(None, map(shutil.which, BROWSERS)))
    os.environ["BROWSER_PATH"] = str(browser)  # what kaleido's browser look-up reads
    global _image_writer_started
    if not _image_writer_started:
        import atexit

        import kaleido

        kaleido.start_sync_server(silence_warnings=True)
        atexit.register(kaleido.stop_sync_server, silence_warnings=True)
        _image_writer_started = True


_image_writer_started = False


def sink_head_grid(table: pd.DataFrame, column: str, *, title: str | None = None) -> go.Figure:
    """Layer x head heatmap of one column of `SinkAnalysis.head_table` (e.g. ``intra_sink_cosine``)."""
    if column not in table:
        raise ValueError(f"unknown column {column!r}; the table has {list(table.columns)}")
    grid = table[column].unstack("head")
    return head_grid(
        torch.tensor(grid.to_numpy()),
        title=title or column,
        layers=[int(layer) for layer in grid.index],
        colorbar_title=column,
    )


def beta_curves(
    layer: "SinkLayer", *, head: int, queries: Sequence[int], index: int = 0, points: int = 101
) -> go.Figure:
    """``||o(beta)||`` against the sink share ``beta`` for chosen queries of one head.

    Markers: the actual sink ratio (where the curve equals the real output norm) and the
    exact minimiser ``beta*``.
    """
    betas = torch.linspace(0, 1, points)
    curve = layer.curve(betas)[:, index, head]  # [beta query]
    figure = go.Figure()
    for query in queries:
        if not bool(layer.queries[index, query]):
            raise ValueError(f"query {query} is padding or a sink position")
        line = figure.add_scatter(x=_numpy(betas), y=_numpy(curve[:, query]), mode="lines", name=f"query {query}")
        color = line.data[-1].line.color
        ratio = layer.sink_ratio[index, head, query].item()
        star = layer.beta_star[index, head, query].item()
        figure.add_scatter(
            x=[ratio], y=[layer.output_norm[index, head, query].item()], mode="markers", showlegend=False,
            marker={"symbol": "circle", "size": 9, "color": color}, hovertext=f"actual sink ratio {ratio:.3f}",
        )  # fmt: skip
        figure.add_scatter(
            x=[star], y=[layer.curve(torch.tensor([star]))[0, index, head, query].item()], mode="markers",
            showlegend=False, marker={"symbol": "x", "size": 10, "color": color}, hovertext=f"beta* {star:.3f}",
        )  # fmt: skip
    figure.update_layout(
        title=f"||o(beta)|| for head {head} (circle: actual sink ratio, cross: minimiser)",
        xaxis={"title": "sink share beta"},
        yaxis={"title": "output norm"},
    )
    return figure


def sink_ratio_scatter(per_query: pd.DataFrame, *, layer: int | None = None, max_points: int = 5000) -> go.Figure:
    """Sink ratio against output norm, one point per (head, query), from `SinkAnalysis.per_query`."""
    frame = per_query if layer is None else per_query[per_query["layer"] == layer]
    if frame.empty:
        raise ValueError(f"no rows for layer {layer}")
    if len(frame) > max_points:
        frame = frame.sample(max_points, random_state=0)
    figure = go.Figure(
        go.Scattergl(
            x=frame["sink_ratio"],
            y=frame["output_norm"],
            mode="markers",
            marker={"size": 4, "color": frame["layer"], "colorscale": SEQUENTIAL, "colorbar": {"title": "layer"}},
            text=[f"L{lay}H{h} q{q}" for lay, h, q in zip(frame["layer"], frame["head"], frame["query"], strict=True)],
            hovertemplate="%{text}<br>sink ratio %{x:.3f}<br>output norm %{y:.3f}<extra></extra>",
        )
    )
    where = "all layers" if layer is None else f"layer {layer}"
    figure.update_layout(
        title=f"Sink ratio vs output norm ({where})", xaxis={"title": "sink ratio"}, yaxis={"title": "||o||"}
    )
    return figure


# --- Flow across layers -----------------------------------------------------------------------------


def _flow_hover(row: pd.Series, tokens: list[str]) -> str:
    source, target = f"{row['source']}:{tokens[row['source']]}", f"{row['target']}:{tokens[row['target']]}"
    if row["head"] < 0:
        return f"L{row['layer']} residual {source}<br>weight={row['weight']:.4f}"
    return (
        f"L{row['layer']}H{row['head']} {source} → {target}<br>attention={row['attention']:.4f}<br>"
        f"relative norm={row['relative_norm']:.4f}<br>cosine={row['cosine']:.4f}<br>weight={row['weight']:.4f}"
    )


def flow_graph(
    flow: "Flow", *, position: int | None = None, threshold: float | None = None, max_edges: int = 400
) -> go.Figure:
    """`Flow.graph` drawn: layers as columns, tokens as rows; width = ``|weight|``, colour = sign.

    Column ``l`` is the stream entering layer ``l`` (the last column: after the last layer); an
    edge of layer ``l`` joins column ``l`` to ``l + 1``. Hover: the head, the three factors and
    the weight (at each edge's midpoint). The ``max_edges`` strongest edges are drawn.
    """
    edges = flow.graph(position, threshold)
    if len(edges) > max_edges:
        edges = edges.loc[edges["weight"].abs().nlargest(max_edges).index].sort_index()
    tokens = flow.str_tokens[0]
    labels = flow.labels()
    largest = float(edges["weight"].abs().max()) if len(edges) else 1.0
    figure = go.Figure()
    for _, row in edges.iterrows():
        colour = "#2166ac" if row["weight"] >= 0 else "#b2182b"
        width = round(0.5 + 7.5 * abs(row["weight"]) / largest, 2)
        figure.add_trace(
            go.Scatter(
                x=[row["layer"], row["layer"] + 1],
                y=[row["source"], row["target"]],
                mode="lines",
                line={"width": width, "color": colour},
                opacity=0.7,
                hoverinfo="skip",
                showlegend=False,
            )
        )
    figure.add_trace(
        go.Scatter(
            x=(edges["layer"] + 0.5).tolist(),
            y=((edges["source"] + edges["target"]) / 2).tolist(),
            mode="markers",
            marker={"size": 6, "color": np.where(edges["weight"] >= 0, "#2166ac", "#b2182b"), "opacity": 0.4},
            hovertext=[_flow_hover(row, tokens) for _, row in edges.iterrows()],
            hoverinfo="text",
            showlegend=False,
            name="edges",
        )
    )
    nodes = {(int(r["layer"]), int(r["source"])) for _, r in edges.iterrows()}
    nodes |= {(int(r["layer"]) + 1, int(r["target"])) for _, r in edges.iterrows()}
    nodes.add((flow.n_layers, flow.position if position is None else position % len(tokens)))
    figure.add_trace(
        go.Scatter(
            x=[c for c, _ in sorted(nodes)],
            y=[p for _, p in sorted(nodes)],
            mode="markers",
            marker={"size": 7, "color": "#444444"},
            hovertext=[
                f"{'after the last layer' if c == flow.n_layers else f'into L{c}'}: {labels[p]}"
                for c, p in sorted(nodes)
            ],
            hoverinfo="text",
            showlegend=False,
            name="nodes",
        )
    )
    explained = labels[flow.position if position is None else position % len(tokens)]
    shown = flow.threshold if threshold is None else threshold
    figure.update_layout(
        title=f"Flow into {explained} (|weight| ≥ {shown:g}; blue +, red −)",
        xaxis={
            "title": "layer",
            "tickvals": list(range(flow.n_layers + 1)),
            "ticktext": ["emb"] + [f"L{layer}" for layer in range(flow.n_layers)],
        },
        yaxis={"title": "token", "tickvals": list(range(len(labels))), "ticktext": labels, "autorange": "reversed"},
        height=max(350, 22 * len(labels)),
    )
    return figure


def flow_rollout(flow: "Flow", *, position: int | None = None) -> go.Figure:
    """The rollout ``[layer key]`` of the explained position: each input token's signed share per layer."""
    rollout = flow.rollout if position is None else flow.rollout_at(position)
    labels = flow.labels()
    figure = go.Figure(
        go.Heatmap(
            z=_numpy(rollout),
            x=labels,
            y=[f"L{layer}" for layer in flow.layers],
            colorscale=DIVERGING,
            zmid=0,
            colorbar={"title": "share"},
            hovertemplate="%{y} · %{x}<br>share=%{z:.4f}<extra></extra>",
        )
    )
    target = labels[flow.position if position is None else position % len(labels)]
    figure.update_layout(
        title=f"Rollout of {target}: input-token shares after each layer", xaxis={"title": "input token"}
    )
    return figure


# --- Logit attribution ------------------------------------------------------------------------------


def logit_heads(result: "LogitAttribution") -> go.Figure:
    """Layer x head heatmap of each head's attention terms (summed over keys): who writes the logit."""
    values = result.attention.sum(-1)
    return head_grid(
        values,
        title=f"Direct attention terms of {result.quantity} at position {result.position}, per head",
        signed=True,
        colorbar_title="logit",
    )


def logit_keys(result: "LogitAttribution") -> go.Figure:
    """One bar per key the position sees: its attention terms summed over layers and heads, tokens labelled."""
    series = result.by_key()
    labels = [f"{j}:{result.str_tokens[j]}" for j in series.index]
    figure = go.Figure(
        go.Bar(
            x=labels,
            y=series.to_numpy(),
            marker={"color": ["#b2182b" if v >= 0 else "#2166ac" for v in series.to_numpy()]},
            hovertemplate="key %{x}<br>%{y:.4f}<extra></extra>",
        )
    )
    figure.update_layout(
        title=f"Direct attention terms of {result.quantity} at position {result.position}, per key",
        xaxis={"title": "key", "tickangle": -60, "tickmode": "array", "tickvals": labels, "ticktext": labels},
        yaxis={"title": "logit"},
    )
    return figure


def _own_value(model_value: float | None, logit: float) -> str:
    """``; the model computed 5.094`` where the model's own value differs from ``logit`` at 3 decimals."""
    if model_value is None or f"{model_value:.3f}" == f"{logit:.3f}":
        return ""
    return f"; the model computed {model_value:.3f} in its own precision"


def logit_layers(result: "LogitAttribution") -> go.Figure:
    """Per layer, the attention terms, attention's biases and the MLP's term side by side.

    A half-precision model's results add a fourth bar, its rounding of each attention output
    (`LogitAttribution.attention_rounding`); the title names the model's own value where it differs.
    """
    table = result.by_layer()
    figure = go.Figure()
    names = {"attention": "attention (heads x keys)", "attention_bias": "attention biases", "mlp": "MLP"}
    if "attention_rounding" in table:
        names["attention_rounding"] = "attention's rounding"
    for column, name in names.items():
        figure.add_bar(
            name=name,
            x=list(table.index),
            y=table[column].to_numpy(),
            hovertemplate=f"layer %{{x}}<br>{name} %{{y:.4f}}<extra></extra>",
        )
    # The bars and the terms the title names add up to its total: the final norm's and unembedding's
    # biases (GPT-2 has both, Llama neither) belong to no layer and are named where they are not 0.
    final = result.final_norm_bias + result.unembed_bias
    biases = f", final norm and unembedding biases {final:.3f}" if final else ""
    figure.update_layout(
        barmode="group",
        title=f"Direct terms of {result.quantity} per layer (embedding {result.embed:.3f}{biases}, "
        f"total {result.logit:.3f}" + _own_value(result.model_value, result.logit) + ")",
        xaxis={"title": "layer", "dtick": 1},
        yaxis={"title": "logit"},
    )
    return figure


def generation_keys(explanation: "GenerationExplanation") -> go.Figure:
    """Answer tokens x keys heatmap: each generated token's attention terms per key (diverging, centred at 0)."""
    table = explanation.key_matrix()
    figure = go.Figure(
        go.Heatmap(
            z=table.to_numpy(),
            x=list(table.columns),
            y=list(table.index),
            colorscale=DIVERGING,
            zmid=0,
            hovertemplate="generated %{y}<br>key %{x}<br>%{z:.4f}<extra></extra>",
            colorbar={"title": "logit", "x": 1.02, "xanchor": "left"},
        )
    )
    figure.update_layout(
        title="Direct attention terms of each generated token's logit, per key",
        xaxis={"title": "key", "tickangle": -60},
        yaxis={"title": "generated token", "autorange": "reversed"},
        height=max(360, 22 * len(table.index) + 200),
    )
    return figure


# --- why a head attends (`QKAttribution`) ---------------------------------------------------------


def _qk_title(result: "QKAttribution", head: int, query: int) -> str:
    return f"L{result.layer}H{head}, query {query}:{result.str_tokens[query]!r}"


def qk_advantage(result: "QKAttribution", *, head: int, query: int, side: str = "key") -> go.Figure:
    """Components x keys heatmap of the advantage ``A_ij^c`` of one head and query (diverging, centred at 0).

    Each column sums to ``log alpha_ij + H(alpha_i)``; the hover gives the component, the key,
    the advantage and the key's weight.
    """
    table = result.advantage(side, head=head, query=query)
    alpha = result.pattern[result.heads.index(head), result.queries.index(query % len(result.str_tokens))]
    keys = [f"{j}:{result.str_tokens[j]}" for j in table.columns]
    weights = np.array([[float(alpha[j]) for j in table.columns]] * len(table.index))
    figure = go.Figure(
        go.Heatmap(
            z=table.to_numpy(),
            x=keys,
            y=list(table.index),
            customdata=weights,
            colorscale=DIVERGING,
            zmid=0,
            hovertemplate="%{y} at key %{x}<br>advantage %{z:.4f}<br>alpha %{customdata:.4f}<extra></extra>",
            colorbar={"title": "advantage"},
        )
    )
    figure.update_layout(
        title=f"{side.capitalize()}-side advantage per component, {_qk_title(result, head, query)}",
        xaxis={"title": "key", "tickangle": -60},
        yaxis={"title": f"{side} component", "autorange": "reversed"},
        height=max(400, 14 * len(table.index)),
    )
    return figure


def qk_key_bars(result: "QKAttribution", *, head: int, query: int, key: int | None = None, top: int = 15) -> go.Figure:
    """Both sides' advantages at one key (default: the most attended), the ``top`` components of each by size.

    The title names the key's token, its weight, and the total beside ``log alpha + H``; the
    components past the ``top`` are one bar, ``other N components`` (their sum), so each side's
    bars add up to the total in the title.
    """
    cell = result.cell(query=query, key=key, head=head)
    figure = make_subplots(rows=1, cols=2, subplot_titles=("key side", "query side"), horizontal_spacing=0.25)
    for column, series in enumerate((cell.key_side, cell.query_side), start=1):
        chosen = largest_and_rest(series, top)[::-1]
        figure.add_trace(
            go.Bar(
                x=chosen.to_numpy(),
                y=list(chosen.index),
                orientation="h",
                marker={"color": ["#b2182b" if v >= 0 else "#2166ac" for v in chosen.to_numpy()]},
                hovertemplate="%{y}<br>advantage %{x:.4f}<extra></extra>",
                showlegend=False,
            ),
            row=1,
            col=column,
        )
    token = result.str_tokens[cell.key]
    figure.update_layout(
        title=(
            f"Why {_qk_title(result, head, cell.query)} attends to key {cell.key}:{token!r} (alpha {cell.alpha:.3f}): "
            f"advantages sum to {cell.total:.3f}, log alpha + H = {cell.log_alpha_plus_entropy:.3f}"
        ),
        height=max(400, 22 * top),
    )
    figure.update_xaxes(title_text="advantage")
    return figure


def largest_and_rest(series: pd.Series, top: int) -> pd.Series:
    """The ``top`` entries of ``series`` largest in size, then ``other N components``: the sum of the rest.

    So bars drawn from it add up to ``series.sum()``, the sum a title states.

    Example:
        >>> largest_and_rest(pd.Series({"a": 3.0, "b": -0.5, "c": 1.0, "d": 0.25}), 2).to_dict()
        {'a': 3.0, 'c': 1.0, 'other 2 components': -0.25}
    """
    order = series.abs().sort_values(ascending=False, kind="stable").index
    chosen = series.reindex(order[:top])
    if len(order) <= top:
        return chosen
    rest = pd.Series({f"other {len(order) - top} components": float(series.reindex(order[top:]).sum())})
    return pd.concat([chosen, rest])


def qk_heads(result: "QKAttribution", *, head: int, query: int, key: int | None = None) -> go.Figure:
    """Layers x heads grid of each earlier head's key-side advantage at one key (default: the most attended).

    What K-composition looks like: an earlier head whose output makes this key attractive.
    """
    cell = result.cell(query=query, key=key, head=head)
    n_heads = max((h for _, h in map(component_layer_head, cell.key_side.index) if h is not None), default=-1) + 1
    values = torch.zeros(max(result.layer, 1), max(n_heads, 1), dtype=torch.float64)
    for name, value in cell.key_side.items():
        layer, h = component_layer_head(str(name))
        if layer is not None and h is not None:
            values[layer, h] = float(value)
    return head_grid(
        values,
        title=f"Key-side advantage of each earlier head at key {cell.key}:{result.str_tokens[cell.key]!r}, "
        f"{_qk_title(result, head, cell.query)}",
        signed=True,
        colorbar_title="advantage",
    )
