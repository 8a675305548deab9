"""The inspector's still: the PNG output written before the widget, what is left once the kernel is gone."""

import base64
import re

import numpy as np
import pytest
import torch
from test_plot import coloured_share, needs_image_writer, png_pixels

import contribution_lens as cl
from conftest import tiny_bridge
from contribution_lens.views import export
from contribution_lens.views.inspector import page, still
from contribution_lens.views.inspector.state import NAMES

IDS = torch.tensor([[3, 7, 7, 7, 2, 9, 7, 1, 4, 5]])


@pytest.fixture(scope="module")
def model():
    return tiny_bridge("gqa", biases=True)


@pytest.fixture
def shown(monkeypatch):
    """What the inspector publishes: each ``display``/``update_display`` call's (kind, data, metadata, display id)."""
    import IPython.display

    published: list[tuple[str, dict, dict, str | None]] = []

    def publisher(kind):
        def publish(data, *, raw=False, metadata=None, display_id=None):
            assert raw, "the inspector publishes raw MIME bundles"
            published.append((kind, data, metadata or {}, display_id))

        return publish

    monkeypatch.setattr(IPython.display, "display", publisher("display"))
    monkeypatch.setattr(IPython.display, "update_display", publisher("update"))
    return published


def png_of(pixels: np.ndarray) -> bytes:
    """A tiny RGB PNG of ``pixels`` ``[row column 3]`` (what a browser's canvas sends)."""
    import struct
    import zlib

    rows = b"".join(b"\x00" + bytes(row.astype(np.uint8).ravel()) for row in pixels)
    height, width = pixels.shape[:2]

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


def test_displaying_an_inspector_writes_a_still_of_its_view_then_the_widget(model, shown) -> None:
    needs_image_writer()
    inspector = cl.inspect(model, IDS, layer=1, head=2, factor="attention", start=4, tokens=4)
    inspector._ipython_display_()
    (kind, data, metadata, display_id), (_, widget, _, widget_id) = shown
    assert kind == "display" and display_id == inspector._still.display_id and widget_id is None
    assert set(data) == {"image/png", "text/plain"}, "a still needs no script: exporters and sanitizers keep a PNG"
    assert (
        data["text/plain"].startswith(still.RUN_AGAIN)
        and "L1, head 2, attention (inter), query 7" in data["text/plain"]
    )
    assert metadata["contribution_lens"]["still"] == {**inspector.view_state(), "head": 2, "layer": 1, "query": 7}
    pixels = png_pixels(base64.b64decode(data["image/png"]))
    assert pixels.shape[1] == 2 * metadata["image/png"]["width"] and coloured_share(pixels) > 0.02
    assert export.WIDGET_VIEW in widget and "text/html" not in widget, "the widget output carries no plotly.js"


def test_a_view_changed_from_python_is_drawn_again_after_the_cell(model, shown, monkeypatch) -> None:
    drawn = []
    monkeypatch.setattr(still, "kernel_png", lambda figure: drawn.append(figure.layout.title.text) or (b"png", 10))
    inspector = cl.inspect(model, IDS, layer=0)
    inspector._ipython_display_()
    inspector._still.after_cell()  # nothing changed: nothing drawn again
    assert [kind for kind, *_ in shown] == ["display", "display"] and len(drawn) == 1
    inspector.layer, inspector.head = 1, 3
    inspector._still.after_cell()
    kind, data, metadata, display_id = shown[-1]
    assert kind == "update" and display_id == inspector._still.display_id
    assert "Inspector: contribution (inter), L1H3" in drawn[-1]
    assert metadata["contribution_lens"]["still"]["layer"] == 1 and "L1, head 3," in data["text/plain"]


def test_the_front_ends_drawing_replaces_the_still_when_it_shows_the_kernels_view(model, shown, monkeypatch) -> None:
    monkeypatch.setattr(still, "kernel_png", lambda figure: None)  # no kaleido: the line alone
    inspector = cl.inspect(model, IDS, layer=0)
    inspector._ipython_display_()
    assert "image/png" not in shown[0][1] and shown[0][1]["text/plain"].startswith(still.RUN_AGAIN)
    drawing = png_of(np.full((3, 4, 3), (200, 30, 30)))
    state = {**inspector.view_state(), "query": 2}  # drawn before the kernel moved the query: an older view
    inspector._on_message(
        inspector, {"type": "snapshot", "state": state, "png": base64.b64encode(drawing).decode(), "width": 2}, []
    )
    assert len(shown) == 2, "a drawing of another view replaced the still"
    message = {"type": "snapshot", "state": inspector.view_state(), "width": 2}
    inspector._on_message(inspector, {**message, "png": base64.b64encode(drawing).decode()}, [])
    kind, data, metadata, display_id = shown[-1]
    assert kind == "update" and display_id == inspector._still.display_id
    assert base64.b64decode(data["image/png"]) == drawing and metadata["image/png"] == {"width": 2}
    assert metadata["contribution_lens"]["drawn_by"] == "browser"
    inspector._on_message(inspector, {**message, "png": base64.b64encode(b"<script>").decode()}, [])
    assert "image/png" not in shown[-1][1], "what is not a PNG is not shown as one"


def test_the_widget_and_its_still_share_the_line_and_the_view_traits(model) -> None:
    # The front-end draws the line into its PNG and sends the traits meta.settings names: the view a still records.
    source = page.asset("inspector.js")
    assert f'const RUN_AGAIN = "{still.RUN_AGAIN}";' in source
    inspector = cl.inspect(model, IDS, layer=0)
    assert [setting["name"] for setting in inspector.meta["settings"]] == list(inspector.view_state()) == list(NAMES)
    assert 'settingNames(model.get("meta"))' in source
    assert 'type: "snapshot"' in source and "KERNEL_WAIT_S = 4" in source


def test_the_still_shows_the_line_alone_when_the_figure_fails(model, shown, monkeypatch) -> None:
    inspector = cl.inspect(model, IDS, layer=0)

    def fail(*args, **kwargs):
        raise RuntimeError("no memory")

    monkeypatch.setattr(inspector._exports, "view_figure", fail)
    inspector._still._draw = fail
    inspector._ipython_display_()
    (_, data, _, _), (_, widget, _, _) = shown
    assert data == {"text/plain": data["text/plain"]} and data["text/plain"].startswith(still.RUN_AGAIN)
    assert export.WIDGET_VIEW in widget


def test_a_pass_in_a_cell_leaves_no_progress_widget_and_empties_its_line(model, shown, monkeypatch) -> None:
    # Failed before: the first view's pass wrote a tqdm progress widget into the inspector's cell (reopened, a
    # second "Error displaying widget: model not found"; exported, "inspector: layers: 0%| | 0/30"), and the
    # widget's text named the view it opened on beside a still of a later one.
    from contribution_lens.views.inspector import compute, progress, widget, writing

    class Shell:  # a kernel running a cell
        def __init__(self) -> None:
            self.kernel = object()
            self.parent_header = {"header": {"msg_type": "execute_request"}}

    monkeypatch.setattr(progress, "kernel_shell", Shell)
    monkeypatch.setattr(widget, "kernel_shell", Shell)
    monkeypatch.setattr(writing, "kernel_shell", Shell)
    monkeypatch.setattr(progress, "QUIET_S", 0.0)  # the tiny model's pass is quicker than the quiet second
    monkeypatch.setattr(compute, "tqdm", None)  # any text or widget bar would fail here
    monkeypatch.setattr(still, "kernel_png", lambda figure: (b"png", 10))
    sent = []
    monkeypatch.setattr(widget.Inspector, "send", lambda self, content, buffers=None: sent.append(content))
    inspector = cl.inspect(model, IDS, layer=1, head=2)
    lines = [data["text/plain"] for _, data, _, _ in shown]
    assert all(line.startswith("inspector: one pass over the text, layer ") for line in lines[:-1]), lines
    assert re.fullmatch(r"inspector: one pass over the text, \d+ layers in \d+ s", lines[-1]), lines[-1]
    assert {display_id for *_, display_id in shown} == {shown[0][3]}, "one line, replaced in place"
    assert [m["text"] for m in sent][-1] == "" and all(m["type"] == "progress" for m in sent)
    line_id = shown[0][3]
    shown.clear()
    inspector._ipython_display_()  # in the same cell: the pass's line becomes the still, the widget follows
    (kind, still_data, _, still_id), (_, widget_data, _, _) = shown
    assert kind == "update" and still_id == line_id == inspector._still.display_id
    assert "L1, head 2, contribution (inter), query 9" in still_data["text/plain"]
    assert widget_data["text/plain"] == writing.WIDGET_TEXT and export.WIDGET_VIEW in widget_data
    assert "L1, head 2, contribution (inter), query 9" in repr(inspector)
