"""The live inspector: an anywidget that computes one layer's payload when the front-end asks for it.

The widget holds the model and the text; `contribution_lens.views.inspector.payload` makes each
layer's numbers and `contribution_lens.views.inspector.page` the static page. Its front-end is
the ES module ``static/inspector.js`` (shared with the page), which loads plotly.js once per
notebook page: the first widget that finds no ``globalThis.Plotly`` asks the kernel for it in one
custom message.
"""

import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anywidget
import plotly.offline
import traitlets

from contribution_lens import adapter
from contribution_lens.choices import FACTORS, SCOPES
from contribution_lens.views import export, plot
from contribution_lens.views.inspector import page
from contribution_lens.views.inspector.payload import (
    DEFAULT_TOKENS,
    VIEWS,
    Steps,
    Window,
    compute_windows,
    meta,
    payload_bytes,
    steps_payload,
    token_label,
    token_window,
    window_start,
    window_starts,
)

if TYPE_CHECKING:
    import plotly.graph_objects as go

COMPACT_ABOVE_BYTES = 20_000_000
"""A page whose fine payloads would pass this many bytes is written in the compact codec (`write_html`)."""
PRECOMPUTE_BYTES = 400_000_000
"""The most payload bytes one pass precomputes beyond the window shown (other windows of the same size)."""


class InspectorError(traitlets.TraitError, ValueError):
    """A value the inspector refuses; its message is also in the widget's ``error`` trait."""


class Inspector(anywidget.AnyWidget):
    """The live inspector: every layer's payload computed once, in one forward pass; switches send one.

    ``head`` is -1 for all heads (token level); ``query`` is the position whose per-key factors
    are drawn as bars; ``hide_sink`` hides key 0 and renormalises the other keys' shares
    (`contribution_lens.views.inspector.payload.hide_sink`); ``group_kv`` shows, in place of
    ``head``, the KV group it belongs to (the heads sharing its value head, combined: meta
    ``kv_groups``, payload ``group_*``). Head, factor, scope, query, ``hide_sink`` and
    ``group_kv`` are drawn by the front-end from the payload already sent.

    With explained predictions (``steps``, from `contribution_lens.explain_generation` or
    `contribution_lens.logit_attribution`) the ``prediction`` view draws step ``step``'s direct
    terms per layer and head and per key; choosing a step moves the query (and, where needed,
    the token window) to the position it was predicted at, and `show_step` (a click on a head in
    that view) opens that head's per-layer view there.

    The first view runs one forward pass that decomposes every layer once and cuts from it the
    payload of every half-overlapping window of ``tokens`` queries (`PRECOMPUTE_BYTES` at most
    beyond the shown window): a later layer or window switch only sends what is ready. A new
    ``tokens`` (or a start off those windows) runs one more pass.

    A bad value (``start``, ``tokens``, ``layer``, ``head``, ``query``, ``factor``, ``scope``) is
    refused before anything changes: Python gets an `InspectorError` (a ``TraitError`` and a
    ``ValueError``), the front-end the reason in the ``error`` trait ("" when all is well) and
    the value it had.
    """

    _esm = page.asset("inspector.js")
    _css = page.asset("inspector.css")
    layer = traitlets.Int().tag(sync=True)
    head = traitlets.Int(-1).tag(sync=True)
    factor = traitlets.Unicode("contribution").tag(sync=True)
    scope = traitlets.Unicode("inter").tag(sync=True)
    query = traitlets.Int(-1).tag(sync=True)
    start = traitlets.Int(0).tag(sync=True)
    tokens = traitlets.Int(DEFAULT_TOKENS).tag(sync=True)
    hide_sink = traitlets.Bool(False).tag(sync=True)
    group_kv = traitlets.Bool(False).tag(sync=True)
    view = traitlets.Unicode("heatmap").tag(sync=True)
    step = traitlets.Int(-1).tag(sync=True)
    steps = traitlets.Dict().tag(sync=True)
    error = traitlets.Unicode("").tag(sync=True)
    meta = traitlets.Dict().tag(sync=True)
    payload = traitlets.Dict().tag(sync=True)

    def __init__(
        self,
        model: adapter.Model,
        batch: adapter.TokenBatch,
        layers: Sequence[int] | None = None,
        *,
        steps: Steps | None = None,
        **kwargs: Any,
    ) -> None:
        self._model = model
        self._layers = adapter.check_layers(model, layers)
        self._batch = batch
        self._labels = [token_label(i, t) for i, t in enumerate(batch.str_tokens[0])]
        if steps is not None:
            steps.check_model(model, self._labels)
        self._steps = steps
        self._ready = False
        self._computed: dict[str, dict[int, dict[str, Any]]] = {}
        self._n_heads = int(model.cfg.n_heads)
        # For the memory estimate only: each payload names its own groups (read off hook_v).
        self._n_kv_heads = int(getattr(model.cfg, "n_key_value_heads", None) or self._n_heads)
        self._causal = adapter.is_causal_model(model)
        check: dict[str, Callable[[Any], None]] = {
            name: getattr(self, f"_check_{name}")
            for name in ("layer", "head", "factor", "scope", "start", "tokens", "view", "step")
        }
        for name, value in kwargs.items():
            if name in check:
                check[name](value)
        if steps is not None:
            kwargs["steps"] = steps_payload(steps, self._labels)
        super().__init__(**kwargs)
        self._check_query(self.query, allow_unset=True)
        self._ready = True
        self._refresh_window()
        if self.step >= 0:
            self._follow_step()
        self.on_msg(self._on_message)

    def _refuse(self, message: str) -> InspectorError:
        self.error = message
        return InspectorError(message)

    def _check_layer(self, value: int) -> None:
        if value not in self._layers:
            raise self._refuse(f"layer {value} is not among the inspected layers {self._layers}")

    def _check_head(self, value: int) -> None:
        if not -1 <= value < self._n_heads:
            raise self._refuse(f"head {value} does not exist: -1 (all heads) or 0..{self._n_heads - 1}")

    def _check_factor(self, value: str) -> None:
        if value not in FACTORS:
            raise self._refuse(f"unknown factor {value!r}; expected one of {FACTORS}")

    def _check_scope(self, value: str) -> None:
        if value not in SCOPES:
            raise self._refuse(f"unknown scope {value!r}; expected one of {SCOPES}")

    def _check_start(self, value: int) -> None:
        n = len(self._labels)
        if not 0 <= value < n:
            raise self._refuse(f"start {value} is outside the text of {n} tokens (0..{n - 1})")

    def _check_tokens(self, value: int) -> None:
        if value < 1:
            raise self._refuse(f"tokens must be at least 1, got {value}")

    def _check_view(self, value: str) -> None:
        if value not in VIEWS:
            raise self._refuse(f"unknown view {value!r}; expected one of {VIEWS}")
        if value == "prediction" and self._steps is None:
            raise self._refuse(
                "the prediction view needs explained predictions: inspect cl.explain_generation(...) "
                "or cl.logit_attribution(...) instead of a text"
            )

    def _check_step(self, value: int) -> None:
        if self._steps is None:
            if value != -1:
                raise self._refuse(
                    f"step {value}: this inspector has no explained predictions (inspect cl.explain_generation(...))"
                )
        elif not 0 <= value < len(self._steps.results):
            raise self._refuse(
                f"step {value} does not exist: the inspector explains steps 0..{len(self._steps.results) - 1}"
            )

    def _check_query(self, value: int, allow_unset: bool = False) -> None:
        if allow_unset and value == -1:
            return
        queries = self.window.queries
        if value not in queries:
            raise self._refuse(f"query {value} is not in the token window {queries[0]}..{queries[-1]}: set start first")

    @traitlets.validate("layer", "head", "factor", "scope", "start", "tokens", "query", "view", "step")
    def _valid(self, proposal: dict) -> Any:
        name, value = proposal["trait"].name, proposal["value"]
        if self._ready:
            getattr(self, f"_check_{name}")(value)
        return value

    @traitlets.observe(
        "layer", "head", "factor", "scope", "start", "tokens", "query", "hide_sink", "group_kv", "view", "step"
    )
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
        head = "all" if self.head < 0 else self.head
        queries = self.meta["queries"]
        return (
            f"Inspector(layer={self.layer}, head={head}, factor={self.factor}, scope={self.scope}, "
            f"tokens {queries[0]}..{queries[-1]} of {len(self._labels)}); display it, or .write_html(path)"
        )

    @property
    def window(self) -> Window:
        return token_window(len(self._labels), start=self.start, tokens=self.tokens, causal=self._causal)

    @traitlets.observe("start", "tokens")
    def _window_changed(self, change: dict) -> None:
        if self._ready:
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
        assert self._steps is not None
        position = self._steps.positions[self.step]
        with self.hold_sync():
            if position not in self.window.queries:
                self.start = window_start(len(self._labels), position, self.tokens)
            self.query = position

    def show_step(self, step: int, *, layer: int | None = None, head: int | None = None) -> None:
        """Explain step ``step``; with ``layer`` (and ``head``), open that per-layer view at the step's position.

        What a click on a head of the prediction view does. Every value is checked before anything
        changes (`InspectorError`).
        """
        self._check_step(step)
        if layer is not None:
            self._check_layer(layer)
        if head is not None:
            self._check_head(head)
        with self.hold_sync():
            if self.step != step:
                self.step = step
            else:
                self._follow_step()
            if layer is not None:
                self.layer = layer
                self.head = -1 if head is None else head
                self.view = "heatmap"

    def _refresh_window(self) -> None:
        window = self.window
        if self.query not in window.queries:
            self.query = window.queries[-1]
        groups = self._layer_payload(window, self.layer)["kv_groups"]
        initial = {"layer": self.layer, "head": "all", "factor": self.factor, "scope": self.scope,
                   "query": self.query, "hide_sink": self.hide_sink, "group_kv": self.group_kv,
                   "view": self.view, "step": self.step}  # fmt: skip
        self.meta = meta(self._labels, window, self._layers, self._n_heads, initial, kv_groups=groups)
        self._compute()

    def _windows_to_precompute(self) -> list[Window]:
        """The shown window first, then the other half-overlapping windows of its size, nearest first, within budget."""
        n, size, shown = len(self._labels), self.tokens, self.window
        starts = sorted(
            sorted(set(window_starts(n, size)) - {shown.queries[0]}), key=lambda s: abs(s - shown.queries[0])
        )
        chosen, budget = [shown], PRECOMPUTE_BYTES
        for start in starts:
            window = token_window(n, start=start, tokens=size, causal=self._causal)
            budget -= payload_bytes(window, self._n_heads, self._n_kv_heads) * len(self._layers)
            if budget < 0:
                break
            chosen.append(window)
        return chosen

    def _layer_payload(self, window: Window, layer: int) -> dict[str, Any]:
        if window.key not in self._computed:
            windows = self._windows_to_precompute()
            computed = compute_windows(self._model, self._batch, self._layers, windows, progress=True)
            # Windows of an earlier size are dropped: the memory goes to the size in use.
            self._computed = {w.key: {layer: computed[layer][w.key] for layer in self._layers} for w in windows}
        return self._computed[window.key][layer]

    def _compute(self) -> None:
        window = self.window
        payload = self._layer_payload(window, self.layer)
        self.payload = {**payload, "layer": self.layer, "key": f"{window.key}/{self.layer}"}

    def _on_message(self, widget: Any, content: dict, buffers: list) -> None:
        if content.get("type") == "need_plotly":
            # Hide module/define so the UMD bundle sets globalThis.Plotly whatever loader the page has.
            source = "(function (module, exports, define) {\n" + plotly.offline.get_plotlyjs() + "\n})();"
            self.send({"type": "plotly", "source": source})
        elif content.get("type") == "ping":  # the front-end asks whether a kernel is there
            self.send({"type": "pong"})
        elif content.get("type") == "open":  # a head clicked in the prediction view
            try:
                self.show_step(int(content["step"]), layer=int(content["layer"]), head=int(content["head"]))
            except (InspectorError, KeyError, TypeError, ValueError) as refused:
                self.error = str(refused)

    def _repr_mimebundle_(self, **kwargs: Any) -> tuple[dict, dict] | None:
        """The widget view and, as ``text/html`` beside it, a figure of the current view.

        Jupyter draws the widget; an exported notebook (nbconvert) or a static viewer, which
        cannot run it, shows the figure (`contribution_lens.views.export.inspector_figure`).
        """
        bundle = super()._repr_mimebundle_(**kwargs)
        if bundle is None:
            return None
        data, metadata = bundle
        try:
            figure = self._view_figure()
        except Exception as error:  # the live widget must still show: the fallback is for exports
            warnings.warn(f"the inspector's static figure failed ({error}); an export will show its repr", stacklevel=2)
            return data, metadata
        return {**data, "text/html": export.figure_html(figure)}, metadata

    def save_image(self, path: str | Path, *, scale: int | float = 2) -> Path:
        """Write the current view as an image, PNG, SVG or PDF by the suffix (`contribution_lens.plot.save_image`)."""
        return plot.save_image(self._view_figure(), path, scale=scale)

    def _view_figure(self) -> "go.Figure":
        if self.view == "prediction" and self._steps is not None:
            step = max(0, self.step)
            figure = plot.logit_heads(self._steps.results[step])
            return figure.update_layout(title=f"Inspector: prediction, step {step}. {figure.layout.title.text}")
        # The payload of the layer shown is already here: the figure needs no forward pass.
        return export.inspector_figure(
            self._layer_payload(self.window, self.layer), self.window, self._labels,
            layer=self.layer, head=self.head, factor=self.factor, scope=self.scope, query=self.query,
            hide_sink=self.hide_sink, group_kv=self.group_kv,
        )  # fmt: skip

    def render_html(
        self,
        *,
        layers: Sequence[int] | None = None,
        start: int | None = None,
        tokens: int | None = None,
        compact: bool | None = None,
    ) -> str:
        """The self-contained page of `write_html` as a string."""
        wanted = self._layers if layers is None else adapter.check_layers(self._model, layers)
        first = self.start if start is None else start
        window = token_window(
            len(self._labels), start=first, tokens=self.tokens if tokens is None else tokens, causal=self._causal
        )
        if compact is None:
            fine = payload_bytes(window, self._n_heads, self._n_kv_heads) * len(wanted)
            compact = fine > COMPACT_ABOVE_BYTES
        cached = None if compact else self._computed.get(window.key)
        if cached is not None:
            payloads = {layer: cached[layer] for layer in wanted}
        else:
            computed = compute_windows(self._model, self._batch, wanted, [window], progress=True, compact=compact)
            payloads = {layer: by_window[window.key] for layer, by_window in computed.items()}
        shown = self.layer if self.layer in wanted else wanted[-1]
        head: int | str = "all" if self.head < 0 else self.head
        # The page opens on the window's last query, whatever the widget's query.
        initial = {"layer": shown, "head": head, "factor": self.factor, "scope": self.scope,
                   "query": window.queries[-1], "hide_sink": self.hide_sink, "group_kv": self.group_kv,
                   "view": self.view, "step": self.step}  # fmt: skip
        if self._steps is not None and self._steps.positions[max(0, self.step)] in window.queries:
            initial["query"] = self._steps.positions[max(0, self.step)]  # the explained step's position
        groups = next(iter(payloads.values()))["kv_groups"]
        about = meta(self._labels, window, wanted, self._n_heads, initial, kv_groups=groups, compact=compact)
        return page.render(about, payloads, steps=self.steps or None)

    def write_html(
        self,
        path: str | Path,
        *,
        layers: Sequence[int] | None = None,
        start: int | None = None,
        tokens: int | None = None,
        compact: bool | None = None,
    ) -> Path:
        """One self-contained HTML file (plotly.js once, every requested layer's data once, offline).

        Args:
            path: where to write (atomically: a half-written page never appears).
            layers: layers to embed (default: the inspector's).
            start: first query position of the token window (default: the widget's).
            tokens: queries in the window (default: the widget's, 128); keys add the sink.
            compact: code each layer as `contribution_lens.views.inspector.payload.compact_payload`
                (attention in one byte, ``|da| <= 0.5/255``; cosines from int8 unit vectors, within
                `contribution_lens.views.inspector.payload.cosine_error_bound`, about 0.03 at most
                for ``d_head = 64``) instead of the fine codecs (``|da|, |dcos| <= 1.5e-5``).
                None (default): compact when the fine page would pass `COMPACT_ABOVE_BYTES`
                (all 30 layers of SmolLM2 at 512 tokens: 290 MB fine, under 50 MB compact).

        The page opens on the window's last query, in the view named in its URL fragment,
        ``#layer=L&head=H&factor=F&scope=S&query=Q`` (``H`` a head or ``all``), and rewrites the
        fragment when the view changes.
        """
        return page.write(path, self.render_html(layers=layers, start=start, tokens=tokens, compact=compact))
