"""Exported notebooks: what survives without a kernel, a widget manager or the network."""

import re
from pathlib import Path

import nbformat
import numpy as np
import pytest
import torch

import contribution_lens as cl
from conftest import assert_close, tiny_bridge
from contribution_lens.views import export

WIDGET = export.WIDGET_VIEW
IDS = torch.tensor([[3, 7, 7, 7, 2, 9, 7, 1, 4, 5]])


@pytest.fixture(scope="module")
def model():
    return tiny_bridge("gqa", biases=True)


def tqdm_state(value: float, total: float) -> dict:
    """The widget state tqdm.notebook leaves: a box of label, progress bar and label."""

    def model(name: str, **state) -> dict:
        return {"model_name": name, "model_module": "@jupyter-widgets/controls", "state": state}

    return {
        "box": model("HBoxModel", children=["IPY_MODEL_left", "IPY_MODEL_bar", "IPY_MODEL_right"]),
        "left": model("HTMLModel", value="work:\u2007100%" if value == total else "work:\u2007\u200750%"),
        "bar": model("FloatProgressModel", value=value, max=total),
        "right": model("HTMLModel", value=f"\u2007{value:.0f}/{total:.0f}\u2007[00:01&lt;00:00,\u2007 2.9it/s]"),
    }


def widget_output(model_id: str, text: str, **more: str) -> nbformat.NotebookNode:
    data = {"text/plain": text, WIDGET: {"version_major": 2, "version_minor": 0, "model_id": model_id}, **more}
    return nbformat.v4.new_output("display_data", data=data)


def test_static_notebook_keeps_fallbacks_and_last_frames_and_drops_the_widget_state() -> None:
    first_frame = "work:   0%|          | 0/3 [00:00<?, ?it/s]"
    cells = [
        nbformat.v4.new_code_cell(
            "inspector", id="fallback", outputs=[widget_output("x", "Inspector(...)", **{"text/html": "<b>figure</b>"})]
        ),
        nbformat.v4.new_code_cell("bar", id="saved", outputs=[widget_output("box", first_frame)]),
        nbformat.v4.new_code_cell("bar", id="unsaved", outputs=[widget_output("gone", first_frame)]),
        nbformat.v4.new_code_cell("slider", id="other", outputs=[widget_output("slider", "IntSlider(value=3)")]),
    ]  # fmt: skip
    notebook = nbformat.v4.new_notebook(cells=cells)
    notebook.metadata["widgets"] = {export.WIDGET_STATE: {"state": tqdm_state(3, 3), "version_major": 2}}
    static = export.static_notebook(notebook)
    outputs = {cell.id: [dict(out.data) for out in cell.outputs] for cell in static.cells}
    assert outputs == {
        "fallback": [{"text/plain": "Inspector(...)", "text/html": "<b>figure</b>"}],
        "saved": [{"text/plain": "work: 100% 3/3 [00:01<00:00, 2.9it/s]"}],
        "unsaved": [],  # its first frame would say 0% for ever
        "other": [{"text/plain": "IntSlider(value=3)"}],
    }
    assert "widgets" not in static.metadata
    assert WIDGET in notebook.cells[0].outputs[0].data, "the notebook itself was changed"


def test_progress_text_says_where_an_interrupted_bar_stopped() -> None:
    state = tqdm_state(1, 2)
    assert export.progress_text(state, state["box"]) == "work: 50% 1/2 [00:01<00:00, 2.9it/s]"
    state["left"]["state"]["value"] = "work"
    assert export.progress_text(state, state["box"]) == "work 50% 1/2 [00:01<00:00, 2.9it/s]"
    assert export.progress_text(state, state["left"]) is None


def test_the_inspectors_figure_names_the_view_it_shows(model) -> None:
    # The still of a notebook run without a browser is this figure (test_still.py).
    inspector = cl.inspect(model, IDS, layer=1, head=2, factor="attention", start=4, tokens=4)
    assert inspector._view_figure().layout.title.text.startswith("Inspector: attention (inter), L1H2, query 7:")
    inspector.head, inspector.factor, inspector.scope, inspector.query = -1, "contribution", "intra", 5
    assert inspector._view_figure().layout.title.text.startswith(
        "Inspector: contribution (intra), L1, all heads, query 5:"
    )


def test_the_inspectors_figure_is_its_window_of_the_librarys_numbers(model) -> None:
    inspector = cl.inspect(model, IDS, layer=1, head=2, factor="cosine", scope="intra", start=4, tokens=4)
    inspector.query = 6
    figure = inspector._view_figure()
    heatmap = figure.data[0]
    labels = cl.attention_geometry(model, IDS, layers=[1]).labels(0)
    assert list(heatmap.y) == labels[4:8] and list(heatmap.x) == [labels[0], *labels[4:8]]
    d = cl.attention_geometry(model, IDS, layers=[1], scope="intra")[1]
    expected = d.cosine[0, 2][4:8][:, [0, 4, 5, 6, 7]].double()
    z = torch.tensor(np.asarray(heatmap.z, dtype=float))
    seen = ~torch.isnan(z)
    assert seen.sum() == 4 + 3 + 2 + 1 + 4  # causal: each query sees the sink and keys up to itself
    assert_close(z[seen], expected[seen], atol=1.6e-5)  # the cosine's 16-bit code: 0.5 / 32767
    (box,) = figure.layout.shapes
    assert (box.y0, box.y1) == (1.5, 2.5), "the selected query (6, the window's third row) is not outlined"


def test_the_inspectors_figure_needs_no_pass_and_shows_the_hidden_sink_and_kv_groups(model, monkeypatch) -> None:
    # Failed before: the figure ran the model again for its layer and ignored hide_sink and group_kv.
    inspector = cl.inspect(model, IDS, layer=1, head=3, factor="contribution", scope="inter")
    monkeypatch.setattr("contribution_lens.adapter.forward", lambda *a, **k: pytest.fail("a forward pass ran"))
    inspector.hide_sink, inspector.group_kv = True, True
    figure = inspector._view_figure()
    assert "KV group 1 (heads 2, 3), sink hidden" in figure.layout.title.text
    z = np.asarray(figure.data[0].z, dtype=float)
    assert np.isnan(z[:, 0]).all(), "the sink is drawn"
    monkeypatch.undo()
    geometry = cl.attention_geometry(model, IDS, layers=[1], scope="inter")[1]
    group = geometry.contribution[0, 2:4].sum(0).double().numpy()  # heads 2 and 3 share a value head
    totals = group.sum(-1, keepdims=True)
    rest = group[1:, 1:] * totals[1:] / (totals[1:] - group[1:, :1])  # query 0 sees only the sink
    seen = ~np.isnan(z[1:, 1:])
    assert seen.sum() == 9 * 10 // 2
    assert np.allclose(z[1:, 1:][seen], rest[seen], rtol=2e-3, atol=1e-4)  # float16 group codes


def test_inspector_save_image_writes_the_view(model, tmp_path) -> None:
    from test_plot import coloured_share, needs_image_writer, png_pixels

    needs_image_writer()
    inspector = cl.inspect(model, IDS, layer=0, head=1)
    pixels = png_pixels(inspector.save_image(tmp_path / "view.png", scale=1).read_bytes())
    assert pixels.shape[:2] == (400, 500) and coloured_share(pixels) > 0.02
    assert inspector.save_image(tmp_path / "view.svg").read_text().startswith("<svg")
    assert inspector.save_image(tmp_path / "view.pdf").read_bytes().startswith(b"%PDF-")


def test_export_notebook_writes_a_page_that_needs_no_network(tmp_path) -> None:
    pytest.importorskip("jupyter_server_mathjax", reason="formulas offline need jupyter-server-mathjax (a dev extra)")
    cells = [
        nbformat.v4.new_markdown_cell("Weights $c_{ij}$:\n\n$$\\sum_j c_{ij} = 1$$"),
        nbformat.v4.new_code_cell("figure", outputs=[nbformat.v4.new_output("display_data", data={
            "text/html": '<script src="https://cdnjs.cloudflare.com/ajax/libs/mathjax/3.2.2/es5/tex-svg.min.js">'
            '</script><div class="plotly-graph-div"></div>'})]),
    ]  # fmt: skip
    page = cl.views.export_notebook(nbformat.v4.new_notebook(cells=cells), tmp_path / "pages" / "lesson.html")
    html = page.read_text()
    assert re.findall(r"<script[^>]+src=[\"']([^\"']+)", html) == [export.MATHJAX_URL]
    assert "https://" not in "".join(re.findall(r"<(?:script|link)[^>]*>", html))
    mathjax = tmp_path / "pages" / "mathjax"
    assert (mathjax / "MathJax.js").is_file() and (mathjax / "config" / "TeX-AMS-MML_HTMLorMML-full.js").is_file()
    assert "STIX-Web" in (mathjax / "config" / "local" / "offline.js").read_text()
    assert not (mathjax / "localization").exists()
    source = tmp_path / "lesson.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=cells[:1]), source)
    again = cl.views.export_notebook(source, page)  # from a file, into a folder that has MathJax already
    assert again == page and sorted(path.name for path in page.parent.iterdir()) == ["lesson.html", "mathjax"]
    assert "c_{ij}" in page.read_text() and "plotly-graph-div" not in page.read_text()


def test_a_text_progress_bar_keeps_its_last_frame_only() -> None:
    frames = "work:   0%|          | 0/2\rwork:  50%|#####     | 1/2\rwork: 100%|##########| 2/2\n"
    stream = nbformat.v4.new_output("stream", name="stderr", text=frames)
    html = export.render_notebook(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("bar", outputs=[stream])]))
    assert re.findall(r"work: +\d+%", html) == ["work: 100%"]


def test_static_notebook_shows_the_inspectors_still_in_place_of_its_widget() -> None:
    still = nbformat.v4.new_output(
        "display_data", data={"image/png": "iVBORw0KGgo=", "text/plain": "The inspector's last view"},
        metadata={"contribution_lens": {"still": {"layer": 1}}},
    )  # fmt: skip
    widget = widget_output("w", "Inspector(layer=1, ...); display it, or .write_html(path)")
    other = widget_output("o", "IntSlider(value=3)")
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("inspector", outputs=[still, widget, other])])
    kept = export.static_notebook(notebook).cells[0].outputs
    assert [dict(out.data) for out in kept] == [dict(still.data), {"text/plain": "IntSlider(value=3)"}]


def shown(figure, monkeypatch, images) -> dict:
    """The MIME bundle ``figure.show()`` displays in a kernel after ``use_in_notebook(images=images)``."""
    import plotly.io as pio

    monkeypatch.setattr(pio.renderers, "default", pio.renderers.default)  # restored after the test
    if images is not False:
        pytest.importorskip("kaleido", reason="drawing the figures' images needs kaleido (a dev extra)")
        if cl.plot._image_writer_missing():
            pytest.skip(cl.plot._image_writer_missing())
    cl.plot.use_in_notebook() if images is None else cl.plot.use_in_notebook(images=images)
    return pio.renderers._build_mime_bundle(figure.to_dict())


@pytest.mark.parametrize("images", [None, False, True], ids=["default", "html", "images"])
def test_a_use_in_notebook_figure_asks_no_cdn(monkeypatch, images) -> None:
    """Shown offline, a figure's output makes no request: no script, image or style from the network (MathJax)."""
    import plotly.graph_objects as go

    bundle = shown(go.Figure(go.Bar(y=[1.0, 2.0]), layout={"width": 300, "height": 200}), monkeypatch, images)
    text = "\n".join(value for value in bundle.values() if isinstance(value, str))
    requests = re.findall(r"""<(?:script|link|img|iframe)\b[^>]*\b(?:src|href)=["']?(?:https?:)?//[^"' >]+""", text)
    assert not requests and "cdnjs.cloudflare.com" not in text, f"a request to the network: {requests}"
    assert ("text/html" in bundle) == (images is False)
    assert ("image/png" in bundle) == (images is not False)


@pytest.mark.slow
@pytest.mark.parametrize("images", [None, False, True], ids=["default", "html", "images"])
def test_a_sanitized_export_shows_use_in_notebook_figures_as_images(tmp_path, monkeypatch, images) -> None:
    # What JupyterLab's File > Save and Export Notebook As > HTML does with "Sanitize HTML" ticked: nbconvert's
    # sanitizer escapes a text/html output's scripts into text. The HTML figures (the default) are printed as script
    # source; images=True puts plotly's own bundle (no HTML) and a PNG in each output, and the page shows the image.
    import subprocess
    import sys

    import plotly.graph_objects as go

    figure = go.Figure(go.Heatmap(z=[[1.0, 2.0], [3.0, 4.0]]), layout={"width": 400, "height": 300})
    bundle = shown(figure, monkeypatch, images)
    notebook = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell("figure", outputs=[nbformat.v4.new_output("display_data", data=bundle)])]
    )
    nbformat.write(notebook, tmp_path / "figures.ipynb")
    subprocess.run(
        [sys.executable, "-m", "jupyter", "nbconvert", "--to", "html", "--HTMLExporter.sanitize_html=True",
         str(tmp_path / "figures.ipynb")],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    page = (tmp_path / "figures.html").read_text(encoding="utf-8")
    if images is False:
        assert "Plotly.newPlot" in page and "&lt;script" in page, "the limitation images lift is gone"
        return
    assert "Plotly.newPlot" not in page and "plotly.js" not in page and "&lt;script" not in page
    found = re.findall(r'<img[^>]+src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(found) == 1 and found[0] == bundle["image/png"], "the page's image is not the figure's PNG"
    assert found[0].startswith("iVBORw0KGgo") and len(found[0]) > 2000  # a PNG, and not an empty one


@pytest.mark.usefixtures("as_a_user")
def test_use_in_notebook_refuses_an_images_that_is_not_a_bool(monkeypatch) -> None:
    import plotly.io as pio

    monkeypatch.setattr(pio.renderers, "default", "plotly_mimetype")
    with pytest.raises(TypeError, match=r"^images must be True, False or None, got str 'yes'$"):
        cl.plot.use_in_notebook(images="yes")
    assert pio.renderers.default == "plotly_mimetype"  # refused before anything changed


def test_the_jupyter_server_config_ships_and_enables_the_extension_that_sets_the_filter() -> None:
    """pip installs ``jupyter_server_config.d/contribution_lens.json``, which enables the server extension (a server
    reads that folder only to enable extensions); at the server's start the extension makes `export.clean_html` the
    HTML exporter's filter, keeping a filter the server's own config names."""
    import json

    from traitlets.config import Config
    from traitlets.utils.importstring import import_item

    from contribution_lens.views import server_extension

    root = Path(__file__).resolve().parents[2]
    folder = "jupyter-config/jupyter_server_config.d"
    # (tomllib is Python 3.11's: the table is read as the text it is.)
    table = (root / "pyproject.toml").read_text().split("[tool.hatch.build.targets.wheel.shared-data]")[1]
    assert f'"{folder}" = "etc/jupyter/jupyter_server_config.d"' in table.split("\n[")[0]
    config = json.loads((root / folder / "contribution_lens.json").read_text())
    (enabled,) = config["ServerApp"]["jpserver_extensions"].items()
    assert enabled == ("contribution_lens.views.server_extension", True)
    assert server_extension._jupyter_server_extension_points() == [{"module": enabled[0]}]
    served = Config()
    server_extension.configure(served)
    assert import_item(served.HTMLExporter.filters["clean_html"]) is export.clean_html
    own = Config({"HTMLExporter": {"filters": {"clean_html": "my.filter", "other": "x.y"}}})
    server_extension.configure(own)
    assert dict(own.HTMLExporter.filters) == {"clean_html": "my.filter", "other": "x.y"}


@pytest.mark.parametrize(
    ("dirty", "clean"),
    [
        ('<p onclick="x()">a</p>', "<p>a</p>"),
        ('<img src="javascript:alert(1)">', "<img>"),
        ('<a href="javascript:alert(1)">a</a>', "<a>a</a>"),
        ("<style>p {}</style><p>kept</p>", "<p>kept</p>"),
        ("<script src=x></script><SCRIPT>\nalert(1)</SCRIPT >", ""),
        ("<script>unclosed", "&lt;script&gt;unclosed"),
        ('<img src="data:image/png;base64,AA" alt="x">', '<img src="data:image/png;base64,AA" alt="x">'),
    ],
)
def test_the_export_filter_keeps_markdown_and_nothing_that_runs(dirty, clean) -> None:
    assert export.clean_html(dirty) == clean


def test_clean_html_draws_formulas_as_mathml_and_leaves_prices_and_code_alone() -> None:
    # Failed before: JupyterLab's sanitized export left every formula as $...$ for a MathJax from a CDN (raw offline).
    page = export.clean_html(
        "<p>Weights $c_{ij} &lt; 1$ cost $5 and $6.</p><p>$$\\sum_j c_{ij} = 1$$</p><pre>s = '$a$'</pre>"
    )
    assert page.count("<math") == 2 and 'display="block"' in page and 'display="inline"' in page
    assert "<mi>c</mi>" in page and "&#x0003C;" in page  # the unescaped "<" of the formula, as MathML
    assert "cost $5 and $6." in page and "<pre>s = '$a$'</pre>" in page
    assert "$" not in page.replace("$5 and $6", "").replace("'$a$'", "")
