"""The live inspector: `inspect` builds it, an anywidget that sends one layer's payload when the front-end asks.

The widget holds its `contribution_lens.views.inspector.subject.Subject` (the model, the text,
the layers) and the payloads computed so far; `contribution_lens.views.inspector.page` makes
the static page. Its front-end is the ES module of ``static/`` (shared with the page, assembled
by `contribution_lens.views.inspector.page.module`), which loads plotly.js once per notebook
page: the first widget that finds no ``globalThis.Plotly`` asks the kernel for it in one custom
message. Displaying it writes a still of the view before the widget
(`contribution_lens.views.inspector.still`): what a notebook shows once the kernel is gone, and
what an HTML export shows.
"""

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import plotly.offline
import traitlets
from torch import Tensor

from contribution_lens import adapter
from contribution_lens.choices import as_count
from contribution_lens.views.inspector import page, panel, still
from contribution_lens.views.inspector.caches import LayerCache, WhyCache
from contribution_lens.views.inspector.exports import Export, opening_view
from contribution_lens.views.inspector.payload import meta
from contribution_lens.views.inspector.progress import Progress, kernel_shell
from contribution_lens.views.inspector.state import ARGUMENTS, CHECKED, NAMES, ViewTraits
from contribution_lens.views.inspector.steps import steps_payload
from contribution_lens.views.inspector.subject import Explained, InspectorError, Subject
from contribution_lens.views.inspector.windows import Window, window_start
from contribution_lens.views.inspector.writing import Writing

if TYPE_CHECKING:
    pass


def inspect(
    model: adapter.Model,
    text: str | Tensor | Explained,
    layer: int | None = ARGUMENTS["layer"],
    head: int | None = ARGUMENTS["head"],
    *,
    layers: Sequence[int] | None = None,
    factor: str = ARGUMENTS["factor"],
    scope: str = ARGUMENTS["scope"],
    start: int | None = ARGUMENTS["start"],
    tokens: int = ARGUMENTS["tokens"],
    hide_sink: bool = ARGUMENTS["hide_sink"],
    group_kv: bool = ARGUMENTS["group_kv"],
    view: str | None = ARGUMENTS["view"],
    step: int | None = ARGUMENTS["step"],
    prepend_bos: bool | None = None,
) -> "Inspector":
    """A live inspector of every layer, head, factor and scope of one text (display it in Jupyter).

    For layer ``l``, head ``h``, query ``i`` and key ``j`` it draws the contribution weight
    ``c_ij = alpha_ij * ||vt_j||/||o_i|| * cos(o_i, vt_j)`` or one of its three factors, per
    head or summed over heads (token level), as a query x key heatmap of a token window, the
    text coloured by one query's row, and that row's factors as bars.

    Args:
        model: a TransformerLens ``TransformerBridge``.
        text: the text (BOS as ``prepend_bos`` says) or token ids; or explained predictions of one text (a
            `contribution_lens.GenerationExplanation`, a `contribution_lens.LogitAttribution` or a
            list of them): their tokens, with a step control and the ``prediction`` view.
        layer: open on this layer (default: the last of ``layers``).
        layers: layers offered (default: all).
        head: open on this head (default: all heads, token level).
        factor: ``attention``, ``relative_norm``, ``cosine`` or ``contribution``.
        scope: ``inter`` or ``intra``.
        start: first query position of the token window (default: 0, or the window holding the step).
        tokens: queries in the token window (keys are the same positions plus the sink).
        hide_sink: hide key 0 and renormalise the other keys' shares (`contribution_lens.drawing.plot.hide_sink`).
        group_kv: show the KV group of ``head`` (the heads sharing its value head) combined.
        view: ``heatmap``, ``text`` or ``prediction`` (default: ``prediction`` for explained
            predictions, else ``heatmap``).
        step: the explained step shown (default 0); the query starts at its position.
        prepend_bos: BOS before a text (None: the model's own choice, ``cfg.default_prepend_bos``).

    Each setting's default, type and accepted values are `contribution_lens.views.inspector.state.SETTINGS`'s.
    Every value is checked once, here, before the model runs: a bad one raises `InspectorError`
    (a ``ValueError``). The first view then runs one forward pass for every layer and every
    window of ``tokens`` queries; switching layer or window afterwards sends what is ready.

    Example:
        >>> import contribution_lens as cl
        >>> model = cl.load_model()
        >>> inspector = cl.inspect(model, "The cat sat on the mat.", layer=3)
        >>> inspector.layer, inspector.meta["key_labels"][:2]
        (3, ['0:<|im_start|>', '1:The'])
    """
    given = locals()  # the arguments, before any other name is bound
    chosen = {name: given[name] for name in ARGUMENTS}
    chosen["tokens"] = as_count(tokens, "tokens")  # before the text is read or any window is laid out
    subject = Subject.of(model, text, layers, prepend_bos=prepend_bos)
    return Inspector(subject, subject.opening(chosen))


class Inspector(Writing, ViewTraits):
    """The live inspector (built by `inspect`): every layer's payload computed once, in one forward pass.

    ``head`` is -1 for all heads (token level); ``query`` is the position whose per-key factors
    are drawn as bars; ``hide_sink`` hides key 0 and renormalises the other keys' shares
    (`contribution_lens.drawing.plot.hide_sink`); ``group_kv`` shows, in place of ``head``, the KV
    group it belongs to (the heads sharing its value head, combined: meta ``kv_groups``, payload
    ``group_*``). Head, factor, scope, query, ``hide_sink`` and ``group_kv`` are drawn by the
    front-end from the payload already sent.

    With explained predictions (``steps``, from `contribution_lens.explain_generation` or
    `contribution_lens.logit_attribution`) the ``prediction`` view draws step ``step``'s direct
    terms per layer and head and per key; choosing a step moves the query (and, where needed,
    the token window) to the position it was predicted at, and `show_step` (a click on a head in
    that view) opens that head's per-layer view there.

    The first view runs one forward pass that decomposes every layer once and cuts from it the
    payload of every half-overlapping window of ``tokens`` queries
    (`contribution_lens.views.inspector.caches.PRECOMPUTE_BYTES` at most beyond the shown
    window): a later layer or window switch only sends what is ready. A new
    ``tokens`` (or a start off those windows) runs one more pass.

    Under the view, each registered panel (`contribution_lens.views.inspector.panel.PANELS`) draws
    what it computes of the view (`panel`), asked of the kernel by the front-end; the first view's
    pass records the QK splits a panel may read (`contribution_lens.views.inspector.caches.WhyCache`).

    The settings are `contribution_lens.views.inspector.state.ViewTraits`' traits (one table,
    `contribution_lens.views.inspector.state.SETTINGS`, which the front-end reads too); what it
    keeps between views is a `LayerCache` and the QK splits, what it writes an `Export`. A bad value
    (each setting of `contribution_lens.views.inspector.state.CHECKED`) is refused before
    anything changes: Python gets an `InspectorError` (a ``TraitError`` and a ``ValueError``),
    the front-end the reason in the ``error`` trait ("" when all is well) and the value it had.
    """

    _esm = page.module()
    _css = page.asset("inspector.css")
    steps = traitlets.Dict().tag(sync=True)
    error = traitlets.Unicode("").tag(sync=True)
    meta = traitlets.Dict().tag(sync=True)
    payload = traitlets.Dict().tag(sync=True)
    model_ref = traitlets.Unicode("").tag(sync=True)
    """The widget's own model id: a front-end without a kernel (restored from saved widget state, or its kernel
    restarted) finds by it the stills of its outputs (their metadata names it), and writes the view it draws there."""
    circuit = traitlets.Dict().tag(sync=True)
    """A circuit drawn beside the view, whose head nodes open that head (`contribution_lens.inspect_circuit` sets it:
    `contribution_lens.views.circuit_view.CircuitInspector.page_data`); empty for a plain inspector."""
    panels: "traitlets.List[dict[str, Any]]" = traitlets.List().tag(sync=True)
    """The registered panels' names, titles, settings and modules (`contribution_lens.views.inspector.panel.specs`)."""

    def __init__(self, subject: Subject, opening: dict[str, Any]) -> None:
        """The widget of ``subject`` opened on ``opening`` (both checked: build it with `inspect`)."""
        self._subject = subject
        self._ready = False
        self._last_pass: Progress | None = None
        self._splits = WhyCache(subject)
        self._payloads = LayerCache(subject, self._splits, self._progress)
        self._exports = Export(subject, self._payloads, self._splits)
        sent = {} if subject.steps is None else {"steps": steps_payload(subject.steps, subject.labels)}
        super().__init__(**opening, **sent, panels=panel.specs())
        self.model_ref = self.model_id
        self._still = still.Still(self.view_state, self._view_figure, self._send_still, self.model_id)
        self._ready = True
        self._refresh_window()
        self.on_msg(self._on_message)

    # --- checks: a refused value changes nothing and names the reason -------------------------------

    def _check(self, name: str, value: Any) -> None:
        # Only a query needs the window; while a new start is cross-validated the window may not exist.
        message = self._subject.refusal(name, value, self.window if name == "query" else None)
        if message:
            self.error = message
            raise InspectorError(message)

    @traitlets.validate(*CHECKED)
    def _valid(self, proposal: dict) -> Any:
        if self._ready:
            self._check(proposal["trait"].name, proposal["value"])
        return proposal["value"]

    @traitlets.observe(*NAMES)
    def _accepted(self, change: dict) -> None:
        self.error = ""

    def set_state(self, sync_data: dict) -> None:
        """A change from the front-end: a refused one leaves ``error`` set and sends back the values kept."""
        try:
            super().set_state(sync_data)
        except traitlets.TraitError as refused:
            self.error = str(refused)
            self.send_state([name for name in sync_data if name in self.keys])

    def __repr__(self) -> str:
        """The view shown, in the still's words (`contribution_lens.views.inspector.still.caption`)."""
        queries = self.meta["queries"]
        return (
            f"Inspector({still.caption(self.view_state())}; tokens {queries[0]}..{queries[-1]} of "
            f"{len(self._subject.labels)}); display it, or .write_html(path)"
        )

    def _progress(self) -> "Progress | bool":
        """What a pass reports its layers to: the widget and the cell in a kernel, else a text bar (tqdm)."""
        if kernel_shell() is None:
            return True
        self._last_pass = Progress(self.send)
        return self._last_pass

    # --- what changes send: a window's meta, a layer's payload, a step's query -----------------------

    @property
    def window(self) -> Window:
        """The token window shown (`contribution_lens.views.inspector.windows.token_window`)."""
        return self._subject.window(self.start, self.tokens)

    @traitlets.observe("start", "tokens")
    def _window_changed(self, change: dict) -> None:
        if not self._ready:
            return
        if change["name"] == "tokens":
            # A larger window late in the text would be clipped at its end (the same window, nothing
            # redrawn): it starts earlier instead, so that it holds ``tokens`` queries where the text has them.
            fitted = min(self.start, max(0, len(self._subject.labels) - self.tokens))
            if fitted != self.start:
                self.start = fitted  # observed: the window is laid out once, for the new start
                return
        self._refresh_window()

    @traitlets.observe("layer")
    def _layer_changed(self, change: dict) -> None:
        if self._ready:
            self._compute()

    @traitlets.observe("step")
    def _step_changed(self, change: dict) -> None:
        if self._ready and change["new"] >= 0:
            self._follow_step()

    def _follow_step(self) -> None:
        """The query moves to the step's position; the window too, where it does not hold it."""
        assert self._subject.steps is not None
        position = self._subject.steps.positions[self.step]
        with self.hold_sync():
            if position not in self.window.queries:
                self.start = window_start(len(self._subject.labels), position, self.tokens)
            self.query = position

    def show_step(self, step: int, *, layer: int | None = None, head: int | None = None) -> None:
        """Explain step ``step``; with ``layer`` (and ``head``), open that per-layer view at the step's position.

        What a click on a head of the prediction view does. Every value is checked before anything
        changes (`InspectorError`).
        """
        for name, value in (("step", step), ("layer", layer), ("head", head)):
            if value is not None:
                self._check(name, value)
        with self.hold_sync():
            if self.step != step:
                self.step = step
            else:
                self._follow_step()
            if layer is not None:
                self.layer = layer
                self.head = -1 if head is None else head
                self.view = "heatmap"

    def _layer_payload(self, window: Window, layer: int) -> dict[str, Any]:
        """``layer``'s payload of ``window`` (`LayerCache.payload`: the first pass if nothing is here yet).

        One not computed yet is computed now (from what the first pass kept, no pass): the status
        line says so meanwhile, since the view waits for it.
        """
        cache = self._payloads
        waits = cache.records and not cache.ready(window, layer)
        if waits:
            ready = sum(cache.ready(window, other) for other in self._subject.layers)
            text = f"inspector: layer {layer} is not decomposed yet ({ready} of {len(self._subject.layers)} ready)"
            self.send({"type": "progress", "text": text})
        try:
            return cache.payload(window, layer, self.window, self.tokens)
        finally:
            if waits:
                self.send({"type": "progress", "text": ""})

    def _refresh_window(self) -> None:
        window = self.window
        if self.query not in window.queries:
            self.query = window.queries[-1]
        groups = self._layer_payload(window, self.layer)["kv_groups"]
        initial = opening_view(self.view_state(), head="all", query=self.query)
        subject = self._subject
        self.meta = meta(subject.labels, window, subject.layers, subject.n_heads, initial, kv_groups=groups)
        self._compute()

    def _compute(self) -> None:
        window = self.window
        payload = self._layer_payload(window, self.layer)
        self.payload = {**payload, "layer": self.layer, "key": f"{window.key}/{self.layer}"}
        # The view's neighbours next, in a thread, while the kernel stays free for the front-end.
        self._payloads.prefetch(window, self.layer, self.tokens)

    def _on_message(self, widget: Any, content: dict, buffers: list) -> None:
        kind = content.get("type")
        if kind == "need_plotly":
            # Hide module/define so the UMD bundle sets globalThis.Plotly whatever loader the page has.
            source = "(function (module, exports, define) {\n" + plotly.offline.get_plotlyjs() + "\n})();"
            self.send({"type": "plotly", "source": source})
        elif kind == "ping":  # the front-end asks whether a kernel is there
            self.send({"type": "pong"})
        elif kind == "open":  # a head clicked in the prediction view
            try:
                self.show_step(int(content["step"]), layer=int(content["layer"]), head=int(content["head"]))
            except (InspectorError, KeyError, TypeError, ValueError) as refused:
                self.error = str(refused)
        elif kind == "snapshot":  # the view the front-end settled on, as it drew it
            self._snapshot(content)
        elif kind == "panel":  # a panel's data for a request (the settings it names)
            self._answer_panel(content)

    # --- the panels: what each computes of the view, on demand ---------------------------------------

    def panel(self, name: str, query: int | None = None, *, layer: int | None = None, head: int | None = None) -> Any:
        """Panel ``name``'s data of the window at ``layer``, ``head`` and ``query`` (defaults: the widget's).

        What the front-end asks the kernel for (`contribution_lens.views.inspector.panel.Panel.compute`
        of the settings the panel names); a layer, head or query the inspector does not show, or an
        unknown name, is refused (`InspectorError`).
        """
        try:
            shown = panel.PANELS.lookup(name)
        except ValueError as unknown:
            raise InspectorError(str(unknown)) from None
        given = {"layer": layer, "head": head, "query": query}
        request: dict[str, int] = {n: getattr(self, n) for n in shown.on}
        request.update({n: value for n, value in given.items() if n in request and value is not None})
        window = self.window
        for setting, value in request.items():
            self._subject.check(setting, value, window)  # unlike self._check, leaves `error` alone
        return shown.compute(panel.PanelSource(self._subject, window, window, self._splits), request)

    def why(self, query: int | None = None, *, layer: int | None = None, head: int | None = None) -> dict[str, Any]:
        """The *why* panel's numbers of one head at ``query``: `panel` ``"why"``.

        Example:
            >>> import contribution_lens as cl
            >>> inspector = cl.inspect(cl.load_model(), "The cat sat on the mat.", layer=3, head=0)
            >>> row = inspector.why()
            >>> row["keys"] == inspector.window.keys, len(row["key_side"][0]["names"])
            (True, 8)
        """
        return self.panel("why", query, layer=layer, head=head)

    def _answer_panel(self, content: dict) -> None:
        """The front-end's request for a panel's data (the settings it names): the data, or why it cannot be had."""
        name = content.get("panel")
        try:
            request = {n: int(content[n]) for n in panel.PANELS.lookup(str(name)).on}
            answer: dict[str, Any] = {"data": self.panel(str(name), **request)}
        except (InspectorError, KeyError, TypeError, ValueError, RuntimeError) as refused:
            answer = {"error": str(refused)}
        self.send({"type": "panel", "panel": name, "key": content.get("key"), **answer})

    def send_panels(self) -> None:
        """Every panel's data of the view shown, sent as the answers to the requests the front-end would make."""
        for name, shown in panel.PANELS.items():
            request = {n: getattr(self, n) for n in shown.on}
            key = f"{self.meta['key']}|{name}|{panel.request_key(shown, request)}"
            self._answer_panel({"panel": name, "key": key, **request})
