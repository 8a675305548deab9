"""The live inspector: an anywidget that computes one layer's payload when the front-end asks for it.

The widget holds the model and the text; `contribution_lens.views.inspector.payload` makes each
layer's numbers and `contribution_lens.views.inspector.page` the static page. Its front-end is
the ES module ``static/inspector.js`` (shared with the page), which loads plotly.js once per
notebook page: the first widget that finds no ``globalThis.Plotly`` asks the kernel for it in one
custom message.
"""

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anywidget
import plotly.offline
import traitlets

from contribution_lens import adapter
from contribution_lens.choices import FACTORS, SCOPES
from contribution_lens.views.inspector import page
from contribution_lens.views.inspector.payload import (
    DEFAULT_TOKENS,
    Window,
    compute_payloads,
    meta,
    token_label,
    token_window,
)

RECENT_LAYERS = 4
"""Layers kept in the kernel (about 0.6 MB each at 128 tokens): they come back without the model."""


class Inspector(anywidget.AnyWidget):
    """The live inspector: one layer's payload at a time, recomputed when ``layer`` or ``start`` changes.

    ``head`` is -1 for all heads (token level); ``query`` is the position whose per-key factors
    are drawn as bars. Head, factor, scope and query are drawn by the front-end from the payload
    already sent; only a new layer or token window runs the model.
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
    meta = traitlets.Dict().tag(sync=True)
    payload = traitlets.Dict().tag(sync=True)

    def __init__(
        self, model: adapter.Model, batch: adapter.TokenBatch, layers: Sequence[int] | None = None, **kwargs: Any
    ) -> None:
        self._model = model
        self._layers = adapter.check_layers(model, layers)
        self._batch = batch
        self._labels = [token_label(i, t) for i, t in enumerate(batch.str_tokens[0])]
        self._ready = False
        self._computed: dict[str, dict[str, Any]] = {}
        self._n_heads = int(model.cfg.n_heads)
        self._causal = adapter.is_causal_model(model)
        super().__init__(**kwargs)
        self._ready = True
        self._refresh_window()
        self.on_msg(self._on_message)

    @traitlets.validate("layer")
    def _valid_layer(self, proposal: dict) -> int:
        if proposal["value"] not in self._layers:
            raise traitlets.TraitError(f"layer {proposal['value']} is not among the inspected layers {self._layers}")
        return proposal["value"]

    @traitlets.validate("head")
    def _valid_head(self, proposal: dict) -> int:
        if not -1 <= proposal["value"] < self._n_heads:
            raise traitlets.TraitError(
                f"head {proposal['value']} does not exist: -1 (all heads) or 0..{self._n_heads - 1}"
            )
        return proposal["value"]

    @traitlets.validate("factor", "scope")
    def _valid_choice(self, proposal: dict) -> str:
        name, value = proposal["trait"].name, proposal["value"]
        allowed = FACTORS if name == "factor" else SCOPES
        if value not in allowed:
            raise traitlets.TraitError(f"unknown {name} {value!r}; expected one of {allowed}")
        return value

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

    def _refresh_window(self) -> None:
        window = self.window
        if self.query not in window.queries:
            self.query = window.queries[-1]
        initial = {"layer": self.layer, "head": "all", "factor": self.factor, "scope": self.scope, "query": self.query}
        self.meta = meta(self._labels, window, self._layers, self._n_heads, initial)
        self._compute()

    def _compute(self) -> None:
        key = f"{self.meta['key']}/{self.layer}"
        if key not in self._computed:
            self._computed[key] = compute_payloads(self._model, self._batch, [self.layer], self.window)[self.layer]
            while len(self._computed) > RECENT_LAYERS:
                del self._computed[next(iter(self._computed))]
        self.payload = {**self._computed[key], "layer": self.layer, "key": key}

    def _on_message(self, widget: Any, content: dict, buffers: list) -> None:
        if content.get("type") == "need_plotly":
            # Hide module/define so the UMD bundle sets globalThis.Plotly whatever loader the page has.
            source = "(function (module, exports, define) {\n" + plotly.offline.get_plotlyjs() + "\n})();"
            self.send({"type": "plotly", "source": source})
        elif content.get("type") == "ping":  # the front-end asks whether a kernel is there
            self.send({"type": "pong"})

    def render_html(
        self, *, layers: Sequence[int] | None = None, start: int | None = None, tokens: int | None = None
    ) -> str:
        """The self-contained page of `write_html` as a string."""
        wanted = self._layers if layers is None else adapter.check_layers(self._model, layers)
        first = self.start if start is None else start
        window = token_window(
            len(self._labels), start=first, tokens=self.tokens if tokens is None else tokens, causal=self._causal
        )
        payloads = compute_payloads(self._model, self._batch, wanted, window)
        shown = self.layer if self.layer in wanted else wanted[-1]
        query = self.query if self.query in window.queries else window.queries[-1]
        head: int | str = "all" if self.head < 0 else self.head
        initial = {"layer": shown, "head": head, "factor": self.factor, "scope": self.scope, "query": query}
        return page.render(meta(self._labels, window, wanted, self._n_heads, initial), payloads)

    def write_html(
        self,
        path: str | Path,
        *,
        layers: Sequence[int] | None = None,
        start: int | None = None,
        tokens: int | None = None,
    ) -> Path:
        """One self-contained HTML file (plotly.js once, every requested layer's data once, offline).

        Args:
            path: where to write (atomically: a half-written page never appears).
            layers: layers to embed (default: the inspector's).
            start: first query position of the token window (default: the widget's).
            tokens: queries in the window (default: the widget's, 128); keys add the sink.

        The page opens the view named in its URL fragment, ``#layer=L&head=H&factor=F&scope=S``
        (``H`` a head or ``all``), and rewrites the fragment when the view changes.
        """
        return page.write(path, self.render_html(layers=layers, start=start, tokens=tokens))
