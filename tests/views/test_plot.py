"""Figures: what they show is the numbers of the decomposition, labelled and coloured as promised."""

import os
import re

import numpy as np
import plotly.graph_objects as go
import pytest
import torch

import contribution_lens as cl
from conftest import assert_close, raises_bad_input, tiny_bridge
from contribution_lens.views import overview


@pytest.fixture(scope="module")
def geometry() -> cl.Geometry:
    model = tiny_bridge("gqa", biases=True)
    ids = torch.tensor([[3, 7, 7, 7, 2, 9, 7, 1]])  # repeated tokens: labels must stay unique
    return cl.attention_geometry(model, ids)


def test_token_heatmap_shows_the_factor_with_all_four_on_hover(geometry) -> None:
    figure = cl.plot.token_heatmap(geometry, layer=1, head=2, factor="contribution")
    assert isinstance(figure, go.Figure)
    heatmap = figure.data[0]
    assert len(set(heatmap.x)) == 8 and heatmap.x[2] == "2:<7>"
    assert heatmap.zmid == 0 and heatmap.colorscale[0][1] != heatmap.colorscale[-1][1]
    z = np.asarray(heatmap.z, dtype=float)
    assert np.isnan(z[np.triu_indices(8, 1)]).all()
    d = geometry[1]
    assert_close(torch.tensor(np.tril(np.nan_to_num(z))), d.contribution[0, 2].double(), atol=1e-6)
    hover = np.asarray(heatmap.customdata, dtype=float)
    for channel, name in enumerate(cl.FACTORS):
        assert_close(torch.tensor(hover[..., channel]), d.factor(name)[0, 2].double(), atol=1e-6)
    assert "cosine" in heatmap.hovertemplate and "relative norm" in heatmap.hovertemplate
    unsigned = cl.plot.token_heatmap(geometry, layer=1, head=2, factor="attention").data[0]
    assert unsigned.zmid is None


def test_token_level_heatmap_sums_contributions_over_heads(geometry) -> None:
    z = np.asarray(cl.plot.token_heatmap(geometry, layer=0).data[0].z, dtype=float)
    assert_close(torch.tensor(np.nansum(z, axis=1)), torch.ones(8, dtype=torch.float64), atol=1e-5)


def test_head_grid_factor_bars_and_measures(geometry) -> None:
    grid = cl.plot.head_grid(geometry.head_summary("cosine"), title="cos", signed=True).data[0]
    assert np.asarray(grid.z).shape == (2, 4) and grid.zmid == 0 and grid.text[1][3] == "L1H3"
    bars = cl.plot.factor_bars(geometry, layer=1, query=5, head=0)
    assert [trace.name for trace in bars.data] == list(cl.FACTORS)
    assert_close(torch.tensor(bars.data[3].x), geometry[1].contribution[0, 0, 5, :6].double(), atol=1e-6)
    assert len({trace.xaxis for trace in bars.data}) == 4  # one scale per factor
    measures = overview.compare_measures(geometry, layer=1, query=7)
    assert len(measures.data) == 4
    for trace in measures.data:
        assert np.abs(trace.y).sum() == pytest.approx(1.0, abs=1e-5)


def test_plot_errors(geometry) -> None:
    with raises_bad_input("head 4 does not exist: the layer has 4 heads"):
        cl.plot.token_heatmap(geometry, layer=0, head=4)
    with raises_bad_input("unknown factor 'norm'"):
        cl.plot.token_heatmap(geometry, layer=0, factor="norm")
    with raises_bad_input("query 8 is outside the text of 8 tokens"):
        cl.plot.factor_bars(geometry, layer=0, query=8)
    with pytest.raises(KeyError, match="layer 5 was not computed"):
        cl.plot.token_heatmap(geometry, layer=5)


def test_an_encoders_heatmap_and_bars_show_every_key() -> None:
    from conftest import tiny_bridge

    model = tiny_bridge("gqa", attention_dir="bidirectional")
    g = cl.attention_geometry(model, torch.randint(0, 50, (1, 6), generator=torch.Generator().manual_seed(0)))
    z = np.asarray(cl.plot.token_heatmap(g, layer=0, head=1).data[0].z, dtype=float)
    assert not np.isnan(z).any(), "a bidirectional pattern has no future keys to blank"
    bars = cl.plot.factor_bars(g, layer=0, query=2, head=1)
    assert len(bars.data[0].y) == 6
    assert len(overview.compare_measures(g, layer=0, query=2).data[0].x) == 6


def png_pixels(data: bytes) -> np.ndarray:
    """The RGB pixels ``[row column channel]`` of an 8-bit PNG (no PIL here: zlib and PNG's five row filters)."""
    import struct
    import zlib

    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    chunks: dict[bytes, bytes] = {}
    at = 8
    while at < len(data):
        (length,) = struct.unpack(">I", data[at : at + 4])
        kind = data[at + 4 : at + 8]
        chunks[kind] = chunks.get(kind, b"") + data[at + 8 : at + 8 + length]
        at += 12 + length
    width, height, depth, colour = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert depth == 8 and colour in (2, 6), f"bit depth {depth}, colour type {colour}"
    step = 3 if colour == 2 else 4
    raw = np.frombuffer(zlib.decompress(chunks[b"IDAT"]), np.uint8).reshape(height, 1 + width * step)
    rows = np.zeros((height + 1, width * step), np.int64)  # rows[0]: the zero row above the first
    for row in range(height):
        kind, line, up = raw[row, 0], raw[row, 1:].astype(np.int64), rows[row]
        if kind in (0, 2):
            out = line + (up if kind == 2 else 0)
        elif kind == 1:  # each byte adds the decoded byte one pixel left: a running sum per channel
            out = np.cumsum(line.reshape(width, step), axis=0).reshape(-1)
        else:
            out = np.zeros_like(line)
            for i in range(len(line)):
                left, corner = (out[i - step], up[i - step]) if i >= step else (0, 0)
                if kind == 3:
                    predicted = (left + up[i]) // 2
                else:
                    p = left + up[i] - corner
                    pa, pb, pc = abs(p - left), abs(p - up[i]), abs(p - corner)
                    predicted = left if pa <= pb and pa <= pc else up[i] if pb <= pc else corner
                out[i] = (line[i] + predicted) & 0xFF
        rows[row + 1] = out & 0xFF
    return rows[1:].reshape(height, width, step)[..., :3]


def coloured_share(pixels: np.ndarray) -> float:
    """Share of pixels that are neither white, grey nor black: drawn data, not axes or text."""
    return float((pixels.max(-1) - pixels.min(-1) > 40).mean())


def all_figures(geometry: cl.Geometry) -> dict[str, go.Figure]:
    """One figure of every plot function (beta curves aside: they need a sink analysis)."""
    import pandas as pd

    table = pd.DataFrame(
        {"intra_sink_cosine": np.linspace(-1, 1, 8)},
        index=pd.MultiIndex.from_product([[0, 1], range(4)], names=["layer", "head"]),
    )
    per_query = pd.DataFrame(
        {"layer": [0, 0, 1, 1], "head": [0, 1, 0, 1], "query": [1, 2, 1, 2], "sink_ratio": [0.1, 0.9, 0.5, 0.3],
         "output_norm": [1.0, 0.2, 0.6, 0.8]}
    )  # fmt: skip
    return {
        "token_heatmap": cl.plot.token_heatmap(geometry, layer=1, head=2),
        "head_grid": cl.plot.head_grid(geometry.head_summary("cosine"), title="cosine"),
        "factor_bars": cl.plot.factor_bars(geometry, layer=1, query=5, head=0),
        "compare_measures": overview.compare_measures(geometry, layer=1, query=7),
        "lines": cl.plot.lines({"a": [1, 2, 3], "b": [3, 1, 2]}, title="lines"),
        "sink_head_grid": cl.plot.sink_head_grid(table, "intra_sink_cosine"),
        "sink_ratio_scatter": cl.plot.sink_ratio_scatter(per_query),  # WebGL, drawn headless too
    }


def needs_image_writer() -> None:
    import shutil

    pytest.importorskip("kaleido", reason="writing images needs kaleido (a dev extra)")
    if shutil.which("chromium") is None and not os.environ.get("BROWSER_PATH"):
        pytest.skip("writing images needs Debian's chromium (apt-get install chromium)")


FIGURES = ["token_heatmap", "head_grid", "factor_bars", "compare_measures", "lines", "sink_head_grid",
           "sink_ratio_scatter"]  # fmt: skip


@pytest.fixture(scope="module")
def empty(tmp_path_factory) -> dict[str, float]:
    """What an empty figure leaves: its share of coloured PNG pixels (320 x 240) and its PDF size (700 x 500)."""
    needs_image_writer()
    folder = tmp_path_factory.mktemp("empty")
    png = cl.plot.save_image(go.Figure(layout={"width": 320, "height": 240}), folder / "empty.png", scale=1)
    pdf = cl.plot.save_image(go.Figure(layout={"width": 700, "height": 500}), folder / "empty.pdf")
    return {"coloured": coloured_share(png_pixels(png.read_bytes())), "pdf_bytes": pdf.stat().st_size}


@pytest.mark.parametrize("name", FIGURES)
def test_every_figure_saves_as_png_svg_and_pdf_with_something_drawn(geometry, empty, name, tmp_path) -> None:
    figure = all_figures(geometry)[name].update_layout(width=700, height=500)
    small = go.Figure(figure).update_layout(width=320, height=240)
    pixels = png_pixels(cl.plot.save_image(small, tmp_path / f"{name}.png", scale=1).read_bytes())
    assert pixels.shape == (240, 320, 3)
    # An empty figure's background edges colour about 0.1% of the pixels; lines or bars, 2% or more.
    assert empty["coloured"] < 0.005
    assert coloured_share(pixels) > 10 * empty["coloured"], f"{name}: {coloured_share(pixels):.2%} coloured"
    svg = cl.plot.save_image(figure, tmp_path / f"{name}.svg").read_text()
    assert svg.startswith("<svg") and svg.rstrip().endswith("</svg>")
    assert re.search(r'<g class="trace|<image ', svg), f"{name}: the SVG holds no trace"
    pdf = cl.plot.save_image(figure, tmp_path / f"{name}.pdf").read_bytes()
    assert pdf.startswith(b"%PDF-") and pdf.rstrip().endswith(b"%%EOF")
    assert len(pdf) > 1.5 * empty["pdf_bytes"], f"{name}: the PDF is no bigger than an empty figure's"


def test_save_image_writes_at_twice_the_layout_size_by_default(geometry, tmp_path) -> None:
    needs_image_writer()
    figure = cl.plot.token_heatmap(geometry, layer=0, head=1)
    data = cl.plot.save_image(figure, tmp_path / "deep" / "heatmap.PNG").read_bytes()
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (2 * figure.layout.width, 2 * figure.layout.height)
    assert [p.name for p in (tmp_path / "deep").iterdir()] == ["heatmap.PNG"]  # no partial file left


def test_save_image_refuses_an_unknown_suffix_before_drawing(geometry, tmp_path) -> None:
    with pytest.raises(
        ValueError, match=r"cannot write '.*heatmap\.gif': the suffix must be one of \.png, \.svg, \.pdf"
    ):
        cl.plot.save_image(cl.plot.lines({"a": [1]}, title="t"), tmp_path / "heatmap.gif")
    assert not list(tmp_path.iterdir())


def test_save_image_says_what_to_install_without_a_browser(monkeypatch, tmp_path) -> None:
    pytest.importorskip("kaleido")
    monkeypatch.setenv("BROWSER_PATH", str(tmp_path / "no-chromium"))
    with pytest.raises(RuntimeError, match=r"needs a Chromium for kaleido: BROWSER_PATH=.*no-chromium' names no file"):
        cl.plot.save_image(cl.plot.lines({"a": [1]}, title="t"), tmp_path / "a.png")


def test_save_image_says_what_to_install_without_kaleido(monkeypatch, tmp_path) -> None:
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "kaleido" else find_spec(name, *a)
    )
    message = "writing images needs kaleido: pip install 'contribution-lens[images]' (or 'kaleido>=1')"
    with pytest.raises(RuntimeError, match=re.escape(message)):
        cl.plot.save_image(cl.plot.lines({"a": [1]}, title="t"), tmp_path / "a.svg")


def test_hiding_the_sink_drops_key_0_and_renormalises_the_rest(geometry) -> None:
    d = geometry[1]
    attention = cl.plot.token_heatmap(geometry, layer=1, head=2, factor="attention", hide_sink=True)
    heatmap = attention.data[0]
    assert heatmap.x[0] == "1:<7>" and len(heatmap.x) == 7 and "sink hidden" in attention.layout.title.text
    z = np.asarray(heatmap.z, dtype=float)
    a = d.attention[0, 2].double()
    expected = a[:, 1:] / (1 - a[:, :1])
    assert np.isnan(z[0]).all()
    assert_close(torch.tensor(np.nan_to_num(z[1:])), torch.tril(expected[1:], 0), atol=1e-6)
    # Token-level inter-head contribution still sums to 1 over the keys left.
    z = np.asarray(cl.plot.token_heatmap(geometry, layer=0, hide_sink=True).data[0].z, dtype=float)
    assert_close(torch.tensor(np.nansum(z[1:], axis=1)), torch.ones(7, dtype=torch.float64), atol=1e-5)
    bars = cl.plot.factor_bars(geometry, layer=1, query=5, head=2, hide_sink=True)
    assert list(bars.data[0].y) == [f"{j}:{t}" for j, t in enumerate(geometry.str_tokens[0])][1:6]
    assert_close(torch.tensor(np.asarray(bars.data[0].x, dtype=float)), expected[5, :5], atol=1e-6)


# --- bars whose title states a sum draw the whole sum ---------------------------------------------------------


def title_number(title: str, name: str) -> float:
    """The number the title gives after ``name`` (``"advantages sum to 0.312"``)."""
    found = re.search(rf"{name} (-?\d+\.\d+)", title)
    assert found, (name, title)
    return float(found.group(1))


@pytest.mark.parametrize("top", [3, 15, 100])
def test_the_qk_key_bars_of_each_side_add_up_to_the_sum_in_the_title(top) -> None:
    ids = torch.tensor([1, 5, 7, 9, 3, 2, 11, 4, 7, 9])
    result = cl.qk_attribution(tiny_bridge("gqa", biases=True), ids, 1, 1, query=7)
    cell = result.cell()
    figure = cl.plot.qk_key_bars(result, head=1, query=7, top=top)
    total = title_number(figure.layout.title.text, "advantages sum to")
    assert total == pytest.approx(cell.total, abs=5e-4)
    for trace, side in zip(figure.data, (cell.key_side, cell.query_side), strict=True):
        drawn = dict(zip(trace.y, trace.x, strict=True))
        assert sum(drawn.values()) == pytest.approx(total, abs=1e-3), "the bars drawn add up to the title"
        rest = [label for label in drawn if label not in side.index]
        if len(side) > top:
            assert rest == [f"other {len(side) - top} components"], drawn.keys()
            assert len(drawn) == top + 1
            others = side.drop([label for label in drawn if label in side.index])
            assert drawn[rest[0]] == pytest.approx(float(others.sum()), abs=1e-6)
        else:
            assert rest == [] and len(drawn) == len(side)


def test_the_logit_layers_bars_and_the_terms_the_title_names_add_up_to_its_total() -> None:
    import dataclasses

    ids = torch.tensor([1, 5, 7, 9, 3, 2, 11, 4])
    result = cl.logit_attribution(tiny_bridge("gqa", biases=True), ids, target=4)
    # A model with a final norm bias and an unembedding bias (GPT-2's kind): terms the bars do not draw.
    result = dataclasses.replace(result, final_norm_bias=0.75, unembed_bias=-0.25, logit=result.logit + 0.5,
                                 model_value=None)  # fmt: skip
    figure = cl.plot.logit_layers(result)
    title = figure.layout.title.text
    drawn = sum(float(np.sum(trace.y)) for trace in figure.data)
    named = title_number(title, "embedding") + title_number(title, "final norm and unembedding biases")
    assert drawn + named == pytest.approx(title_number(title, "total"), abs=3e-3), title
