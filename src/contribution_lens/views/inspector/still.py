"""The inspector's still: a PNG of the last view drawn, in its own output beside the live widget.

A widget output draws nothing once its kernel is gone: JupyterLab shows "Error displaying
widget: model not found" for a notebook reopened without saved widget state, and an HTML export
(nbconvert, JupyterLab's own, sanitized or not) has no widget manager. So displaying an
inspector writes two outputs: first the still, an ``image/png`` under a display id, then the
widget. The still's metadata names the widget (`bundle`'s ``widget``), so the widget finds it in
its cell by identity, not by position (a cell may hold other outputs, a circuit's image among them).
While its kernel answers, the widget hides the still and keeps it current: each view it settles on
(one second without a change) is sent to the kernel as a PNG of what it drew, and `Still.update`
replaces the still through the display id.
A view changed from Python (``inspector.layer = 5`` in a later cell, or a notebook run with no
browser at all) is drawn by kaleido after that cell (`Still.after_cell`), when kaleido is
installed. The image carries one line saying to run the cell again; an ``image/png`` is what
every exporter and sanitizer keeps as it is.

Example:
    >>> caption({"view": "heatmap", "layer": 3, "head": -1, "factor": "contribution", "scope": "inter",
    ...          "query": 7, "step": -1})
    'L3, all heads, contribution (inter), query 7'
"""

import base64
import binascii
import tempfile
import uuid
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import plotly.graph_objects as go

RUN_AGAIN = "The inspector's last view: run the cell again to explore it."
"""The line every still carries (drawn into the image, and its ``text/plain``)."""
MAX_PNG_BYTES = 8_000_000
"""The largest PNG the front-end may send (a 4x device-pixel drawing of a wide output is under 2 MB)."""
_PNG = b"\x89PNG\r\n\x1a\n"


def caption(state: dict[str, Any]) -> str:
    """The view ``state`` (`contribution_lens.views.inspector.state.NAMES`' values) in words, as the still says it."""
    if state["view"] == "prediction":
        return f"prediction view, step {max(0, state['step'])}"
    head = "all heads" if state["head"] < 0 else f"head {state['head']}"
    shown = "text view, " if state["view"] == "text" else ""
    return f"{shown}L{state['layer']}, {head}, {state['factor']} ({state['scope']}), query {state['query']}"


def bundle(
    png: bytes | None, width: int | None, state: dict[str, Any], drawn_by: str = "kaleido", widget: str | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The still's MIME bundle and metadata: ``image/png`` (when there is one) and the line as ``text/plain``.

    ``width`` is the image's width in CSS pixels (a front-end drawing is sent at the screen's
    pixel density); the metadata records under ``contribution_lens`` the view (``still``: every setting,
    `contribution_lens.views.inspector.state.NAMES`),
    who drew it (``drawn_by``: ``"browser"``, the widget itself, or ``"kaleido"``, in the kernel) and
    whose still it is (``widget``: the widget's model id), by which the widget finds it in its cell,
    wherever it is there (a cell may hold other outputs between them).
    """
    line = f"{RUN_AGAIN} ({caption(state)}: its numbers come from the Python kernel.)"
    data: dict[str, Any] = {"text/plain": line}
    metadata: dict[str, Any] = {"contribution_lens": {"still": dict(state), "drawn_by": drawn_by if png else None}}
    if widget is not None:
        metadata["contribution_lens"]["widget"] = widget
    if png is not None:
        data["image/png"] = base64.b64encode(png).decode("ascii")
        if width:
            metadata["image/png"] = {"width": int(width)}
    return data, metadata


def front_end_png(content: dict[str, Any]) -> tuple[bytes, int] | None:
    """The PNG and its CSS width in a ``snapshot`` message from the front-end, or None if it is not one."""
    encoded, width = content.get("png"), content.get("width")
    if not isinstance(encoded, str) or not isinstance(width, int | float) or not 0 < width < 10_000:
        return None
    if len(encoded) > MAX_PNG_BYTES * 4 // 3 + 4:
        return None
    try:
        png = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        return None
    return (png, int(width)) if png.startswith(_PNG) else None


def kernel_png(figure: "go.Figure") -> tuple[bytes, int] | None:
    """``figure`` with the still's line above it, drawn by kaleido; None without kaleido or a Chromium."""
    from contribution_lens.drawing import plot

    shown = type(figure)(figure)  # a copy: the caller's figure keeps its title
    title = shown.layout.title.text or ""
    top = (shown.layout.margin.t or 80) + 24
    shown.update_layout(title_text=f"<i>{RUN_AGAIN}</i><br>{title}", title_font_size=13, margin_t=top)
    with tempfile.TemporaryDirectory(prefix="cl-still-") as folder:
        try:
            path = plot.save_image(shown, Path(folder) / "still.png", scale=2)
        except (RuntimeError, ValueError, OSError):
            return None  # no kaleido or no Chromium: a browser's still replaces the line alone
        png = path.read_bytes()
    width = int.from_bytes(png[16:20], "big") // 2  # the IHDR width, at scale 2
    return png, width


class Still:
    """One inspector's still: its display id, the view it shows, and how to replace it.

    ``draw`` gives the current view's figure (`Export.view_figure`); ``state`` its settings (`ViewTraits.view_state`);
    ``widget`` is the widget's model id, recorded in every still (`bundle`); ``sent`` (when given) is called with
    each new still's bundle and metadata: the widget sends them
    to its front-end, which writes them into a notebook whose front-end never saw the still
    displayed (reopened while its kernel ran: the display id's update reaches no output there).
    """

    def __init__(
        self,
        state: Callable[[], dict[str, Any]],
        draw: Callable[[], "go.Figure"],
        sent: Callable[[dict[str, Any], dict[str, Any]], None] | None = None,
        widget: str | None = None,
    ) -> None:
        self.display_id = f"cl-still-{uuid.uuid4().hex}"
        self._state, self._draw, self._sent, self.widget = state, draw, sent, widget
        self.shown: dict[str, Any] | None = None
        """The view the still shows (None before it is displayed)."""
        self._hooked = False

    def display(self, into: str | None = None) -> None:
        """Write the still as a new output, drawn by kaleido (the line alone without it).

        The outputs written before it are replaced too: every output of one inspector shows its
        one live widget, so a notebook shows the same view in each (two views need two inspectors).
        ``into``: the display id of an output of the cell to become the still instead (the line of
        the pass that built the inspector, `contribution_lens.views.inspector.progress`), where
        the still was never shown.
        """
        from IPython.display import display, update_display

        state = self._state()
        png, width = self._kernel_drawing() or (None, None)
        if self.shown is not None and state != self.shown:
            self.update(png, width, state)  # earlier outputs show the same live widget, so the same view
        data, metadata = bundle(png, width, state, widget=self.widget)
        if into is not None and self.shown is None:
            self.display_id = into
            update_display(data, raw=True, metadata=metadata, display_id=self.display_id)
        else:
            display(data, raw=True, metadata=metadata, display_id=self.display_id)
        self.shown = state
        self._hook()

    def update(self, png: bytes | None, width: int | None, state: dict[str, Any], drawn_by: str = "kaleido") -> None:
        """Replace every output of this still with ``png`` of ``state`` (drawn by ``drawn_by``, see `bundle`)."""
        from IPython.display import update_display

        data, metadata = bundle(png, width, state, drawn_by, self.widget)
        update_display(data, raw=True, metadata=metadata, display_id=self.display_id)
        self.shown = dict(state)
        if self._sent is not None:
            self._sent(data, metadata)

    def redraw(self) -> None:
        """Draw the current view here (kaleido) and replace the still with it."""
        state = self._state()
        png, width = self._kernel_drawing() or (None, None)
        self.update(png, width, state)

    def after_cell(self) -> None:
        """After a cell: a view changed from Python since the still was drawn is drawn again (kaleido)."""
        if self.shown is not None and self._state() != self.shown:
            self.redraw()

    def _kernel_drawing(self) -> tuple[bytes, int] | None:
        try:
            figure = self._draw()
        except Exception:  # the live widget must still show: the still is for when it cannot
            return None
        return kernel_png(figure)

    def _hook(self) -> None:
        """Call `after_cell` after every cell while the inspector lives (IPython's ``post_run_cell``)."""
        from IPython import get_ipython

        shell = get_ipython()
        if shell is None or self._hooked:
            return
        self._hooked = True
        mine = weakref.ref(self)

        def after(*args: Any) -> None:
            still = mine()
            if still is None:
                shell.events.unregister("post_run_cell", after)
            else:
                still.after_cell()

        shell.events.register("post_run_cell", after)
