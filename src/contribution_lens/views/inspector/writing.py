"""What an inspector leaves where its kernel cannot run: its still, its view as an image, its page.

`Writing` is the part of `contribution_lens.views.inspector.widget.Inspector` that outlives the kernel:
the still a notebook shows once the widget is gone (`contribution_lens.views.inspector.still`, kept in
step with the front-end's drawing), and the images and self-contained pages drawn from the view the widget
shows (``view_state``) through its `contribution_lens.views.inspector.exports.Export`.
"""

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from contribution_lens.drawing import plot
from contribution_lens.views.inspector import page, still
from contribution_lens.views.inspector.progress import kernel_shell

if TYPE_CHECKING:
    import plotly.graph_objects as go

    from contribution_lens.views.inspector.exports import Export

WIDGET_TEXT = "(the live inspector: it needs its kernel; the image above is the last view it drew)"
"""The widget output's ``text/plain``: what a front-end without the widget shows in its place."""


class Writing:
    """The inspector's still and writing (mixed into the widget, ahead of its traits): `save_image`, `render_html`,
    `write_html`, and the still's part of displaying it."""

    if TYPE_CHECKING:  # what the widget gives it: its export, its steps and its view (`state.ViewTraits`)
        _exports: "Export"
        _still: still.Still
        _last_pass: Any
        steps: Any
        model_id: str

        def send(self, content: dict[str, Any]) -> None: ...

        def _repr_mimebundle_(self, **kwargs: Any) -> Any: ...

        def view_state(self) -> dict[str, Any]: ...

    def _send_still(self, data: dict[str, Any], metadata: dict[str, Any]) -> None:
        """A new still to the front-end, which writes it into its notebook (`still.Still`'s ``sent``)."""
        if kernel_shell() is not None:
            self.send({"type": "still", "model_id": self.model_id, "data": data, "metadata": metadata})

    def _snapshot(self, content: dict) -> None:
        """The still replaced by the front-end's drawing, if it shows the view the kernel holds.

        A drawing of an older view (a change is on its way) is dropped; a view the front-end
        does not draw as a figure (the text view) comes without an image and is drawn here.
        """
        state = self.view_state()
        drawn = content.get("state")
        if not isinstance(drawn, dict) or any(state.get(name) != value for name, value in drawn.items()):
            return
        png = still.front_end_png(content)
        if png is None:
            self._still.redraw()
        else:
            self._still.update(*png, state, drawn_by="browser")

    def pass_line(self) -> str | None:
        """The display id of the line the first pass wrote in the cell running now, taken (None: there is none).

        Displaying the inspector turns that line into its still; a view that displays something before
        the inspector (a circuit's image) takes it instead, so that the cell's outputs keep their order.
        """
        line = None if self._last_pass is None else self._last_pass.cell_output()
        self._last_pass = None
        return line

    def _ipython_display_(self, **kwargs: Any) -> None:
        """Two outputs: the still (a PNG of the view, under a display id) and the live widget.

        The still is what a reopened notebook or an HTML export shows; the live widget hides it
        (`contribution_lens.views.inspector.still`).
        """
        from IPython.display import display

        self._still.display(into=self.pass_line())  # the line of the pass that built it in this cell, if any
        bundle = self._repr_mimebundle_(**kwargs)
        if bundle is not None:
            # Its text is what a front-end without the widget prints (an export, a reopened notebook): it names
            # no view, which would go stale as the widget changes; the still above names the one it shows.
            data = {**bundle[0], "text/plain": WIDGET_TEXT}
            display(data, raw=True, metadata=bundle[1])

    def _view_figure(self) -> "go.Figure":
        """The view shown as a figure (`Export.view_figure`): what the still and ``save_image`` draw."""
        return self._exports.view_figure(self.view_state())

    def save_image(self, path: str | Path, *, scale: int | float = 2, include: str = "view") -> Path:
        """Write what the widget draws as an image, PNG, SVG or PDF by the suffix (`contribution_lens.plot.save_image`).

        ``include="view"``: the current view (the heatmap with its query outlined, or the prediction
        view's heads, layer 0 at the top); ``include="bars"``: the selected query's bars, with
        their caption. Both in the widget's orientation, labels and plain white template.
        """
        if include not in ("view", "bars"):
            raise ValueError(f"include must be 'view' or 'bars', got {include!r}")
        shown = self._exports.bars_figure(self.view_state()) if include == "bars" else self._view_figure()
        return plot.save_image(shown, path, scale=scale)

    def render_html(
        self,
        *,
        layers: Sequence[int] | None = None,
        start: int | None = None,
        tokens: int | None = None,
        compact: bool | None = None,
        why_queries: Sequence[int] | None = None,
        panels: dict[str, Sequence[int]] | None = None,
        circuit: dict[str, Any] | None = None,
    ) -> str:
        """The self-contained page of `write_html` as a string (``circuit``: drawn above it, `page.render`)."""
        named = {name: (f"panels[{name!r}]", queries) for name, queries in (panels or {}).items()}
        if why_queries is not None:
            named["why"] = ("why_queries", why_queries)
        return self._exports.render_html(
            self.view_state(), self.steps or None, layers=layers, start=start, tokens=tokens, compact=compact,
            panels=named, circuit=circuit,
        )  # fmt: skip

    def write_html(
        self,
        path: str | Path,
        *,
        layers: Sequence[int] | None = None,
        start: int | None = None,
        tokens: int | None = None,
        compact: bool | None = None,
        why_queries: Sequence[int] | None = None,
        panels: dict[str, Sequence[int]] | None = None,
    ) -> Path:
        """One self-contained HTML file (plotly.js once, every requested layer's data once, offline).

        Args:
            path: where to write (atomically: a half-written page never appears).
            layers: layers to embed (default: the inspector's).
            start: first query position of the token window (default: the widget's).
            tokens: queries in the window (default: the widget's, 128); keys add the sink.
            compact: code each layer as `contribution_lens.views.inspector.compact.compact_payload`
                (attention in one byte, ``|da| <= 0.5/255``; cosines from int8 unit vectors, within
                `contribution_lens.views.inspector.compact.cosine_error_bound`, about 0.03 at most
                for ``d_head = 64``) instead of the fine codecs (``|da|, |dcos| <= 1.5e-5``).
                None (default): compact when the fine page would pass
                `contribution_lens.views.inspector.exports.COMPACT_ABOVE_BYTES`
                (all 30 layers of SmolLM2 at 512 tokens: 290 MB fine, under 50 MB compact).
            why_queries: query positions (of the window) whose *why* panel the page carries
                (`why`): for each, every head of every embedded layer, every key of the window,
                the `contribution_lens.views.inspector.why.TOP` largest advantage terms per side.
                Each (layer, head, query) row is about 35 bytes per key and drawn term (about
                35 KB at 128 keys), so one query of 30 layers x 9 heads adds about 10 MB; it
                costs no pass where the first view's recorded the queries
                (`contribution_lens.views.inspector.caches.WHY_TAPE_BYTES`),
                else one pass that records them (or, past that budget, one
                `contribution_lens.qk_attribution` pass per layer). The panel of any
                other query says it was not embedded and names this argument. Default: none.
            panels: by panel name (`contribution_lens.views.inspector.panel.PANELS`), the query positions
                whose data the page carries, every layer and head of them (``why_queries=q`` is
                ``panels={"why": q}``). Default: none.

        The page opens on the window's last query, in the view named in its URL fragment,
        ``#layer=L&head=H&factor=F&scope=S&query=Q`` (``H`` a head or ``all``), and rewrites the
        fragment when the view changes.
        """
        html = self.render_html(
            layers=layers, start=start, tokens=tokens, compact=compact, why_queries=why_queries, panels=panels
        )
        return page.write(path, html)
