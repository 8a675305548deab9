"""`inspect`: per-head contribution heatmaps, live in Jupyter and as one light shareable HTML file.

For one layer, head ``h``, query ``i`` and key ``j`` of a token window the inspector shows

    c_ij^h = alpha_ij^h * (||vt_j^h|| / ||o||) * cos(o, vt_j^h)

and its three factors in both scopes (``o = o_i^h`` intra, ``o = o_i`` inter), or at token
level ("all heads": contribution summed over heads, attention averaged, relative norm and cosine
the attention-weighted head mean, as `contribution_lens.plot.token_factors`).

The library computes; the page only derives. Per layer, `layer_payload` keeps, for every head
and displayable (query, key) cell, three uint16 codes, and three small float32 vectors:

* attention ``a``: code ``round(sqrt(a) * 65535)``, so ``|a_hat - a| <= 2 sqrt(a) d + d^2``
  with ``d = 0.5 / 65535`` (at most 1.53e-5, and relatively finer for small weights);
* cosine ``c`` (intra and inter): code ``round(c * 32767) + 32767``, ``|c_hat - c| <= 0.5 / 32767``
  (1.53e-5), 0 exact;
* ``value_norm [head key]``, ``output_norm`` intra ``[head query]`` and inter ``[query]``, exact.

``relative_norm = value_norm / output_norm`` is then exact and
``|c_hat - c| <= relative_norm * (|a_hat - a| + a |cos_hat - cos|)`` for the contribution.
The drawing code is one JS file, ``static/inspector.js``, shared by the widget and the page.
The page embeds plotly.js (from the installed plotly package) once. The widget's module is
``inspector.js`` + ``static/widget.js``; it loads plotly.js once per notebook page: the first
widget that finds no ``globalThis.Plotly`` asks the kernel for it in one custom message.
"""

import base64
import html
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import anywidget
import numpy as np
import plotly.offline
import torch
import traitlets
from jaxtyping import Float
from plotly.colors import get_colorscale
from torch import Tensor

from contribution_lens import adapter
from contribution_lens.decomposition import FACTORS, SCOPES, Decomposition
from contribution_lens.engine import map_layers
from contribution_lens.plot import DIVERGING, SEQUENTIAL

ATTENTION_CODES = 65535
COSINE_CODES = 32767
DEFAULT_TOKENS = 128
RECENT_LAYERS = 4


def _asset(name: str) -> str:
    return (resources.files("contribution_lens") / "static" / name).read_text(encoding="utf-8")


@dataclass(frozen=True)
class Window:
    """The token positions shown: queries ``first..last``, keys the same plus the sink at 0."""

    queries: list[int]
    keys: list[int]
    causal: bool

    @property
    def mask(self) -> np.ndarray:
        """``[query key]`` True where the cell is displayable (``key <= query`` if causal)."""
        keys, queries = np.asarray(self.keys), np.asarray(self.queries)
        if not self.causal:
            return np.ones((len(queries), len(keys)), dtype=bool)
        return keys[None, :] <= queries[:, None]

    @property
    def cells(self) -> int:
        return int(self.mask.sum())


def token_window(n: int, *, start: int = 0, tokens: int = DEFAULT_TOKENS, causal: bool = True) -> Window:
    """Positions ``start .. start + tokens - 1`` (clipped to the text) as queries; keys add the sink 0.

    Example:
        >>> token_window(10, start=6, tokens=3).keys
        [0, 6, 7, 8]
    """
    if tokens < 1:
        raise ValueError(f"tokens must be at least 1, got {tokens}")
    if not 0 <= start < n:
        raise ValueError(f"start {start} is outside the text of {n} tokens")
    queries = list(range(start, min(n, start + tokens)))
    keys = queries if start == 0 else [0, *queries]
    return Window(queries, keys, causal)


def token_label(position: int, token: str) -> str:
    """``"{position}:{token}"`` with line breaks and tabs shown as ``\\n``, ``\\r``, ``\\t``.

    Example:
        >>> token_label(3, "\\n")
        '3:\\\\n'
    """
    return f"{position}:" + token.replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")


def _b64(array: np.ndarray, dtype: str) -> str:
    return base64.b64encode(np.ascontiguousarray(array, dtype=dtype).tobytes()).decode("ascii")


def quantise_attention(attention: np.ndarray) -> np.ndarray:
    """uint16 codes ``round(sqrt(a) * 65535)`` of attention weights in ``[0, 1]``."""
    return np.rint(np.sqrt(np.clip(attention, 0.0, 1.0)) * ATTENTION_CODES).astype(np.uint16)


def quantise_cosine(cosine: np.ndarray) -> np.ndarray:
    """uint16 codes ``round(c * 32767) + 32767`` of cosines in ``[-1, 1]``."""
    return (np.rint(np.clip(cosine, -1.0, 1.0) * COSINE_CODES) + COSINE_CODES).astype(np.uint16)


def dequantise_attention(codes: np.ndarray) -> np.ndarray:
    return (codes.astype(np.float64) / ATTENTION_CODES) ** 2


def dequantise_cosine(codes: np.ndarray) -> np.ndarray:
    return (codes.astype(np.float64) - COSINE_CODES) / COSINE_CODES


def _cut(values: Float[Tensor, "head query key"], window: Window) -> np.ndarray:
    """``[head cell]``: the displayable cells of the window, row-major over (query, key)."""
    rows = values[:, window.queries][:, :, window.keys].to(torch.float32).cpu().numpy()
    return rows[:, window.mask]


def layer_payload(inter: Decomposition, intra: Decomposition, window: Window, *, index: int = 0) -> dict[str, str]:
    """What the page needs of one layer, base64: attention and both cosines quantised, the norms exact.

    Example:
        >>> import torch
        >>> future = torch.ones(3, 3, dtype=torch.bool).triu(1)
        >>> pattern = torch.softmax(torch.randn(1, 2, 3, 3).masked_fill(future, -torch.inf), -1)
        >>> v, W_O = torch.randn(1, 3, 1, 4), torch.randn(2, 4, 8)
        >>> from contribution_lens import decompose
        >>> both = [decompose(pattern, v, W_O, scope=s) for s in ("inter", "intra")]
        >>> p = layer_payload(*both, token_window(3))
        >>> len(base64.b64decode(p["attention"]))  # 2 heads x 6 causal cells x 2 bytes
        24
    """
    if inter.scope != "inter" or intra.scope != "intra":
        raise ValueError(
            f"layer_payload takes the inter then the intra decomposition, got {inter.scope}, {intra.scope}"
        )
    keys, queries = torch.tensor(window.keys), torch.tensor(window.queries)
    return {
        "attention": _b64(quantise_attention(_cut(inter.attention[index], window)), "<u2"),
        "cosine_inter": _b64(quantise_cosine(_cut(inter.cosine[index], window)), "<u2"),
        "cosine_intra": _b64(quantise_cosine(_cut(intra.cosine[index], window)), "<u2"),
        "value_norm": _b64(inter.value_norm[index][:, keys].float().cpu().numpy(), "<f4"),
        "output_norm_intra": _b64(intra.output_norm[index][:, queries].float().cpu().numpy(), "<f4"),
        "output_norm_inter": _b64(inter.output_norm[index][0, queries].float().cpu().numpy(), "<f4"),
    }


def compute_payloads(
    model: adapter.Model, batch: adapter.TokenBatch, layers: Sequence[int], window: Window
) -> dict[int, dict[str, str]]:
    """`layer_payload` of each layer, on the per-layer engine (the pass stops after the last of them)."""
    results = map_layers(
        model, batch, lambda inputs: layer_payload(inputs.decompose("inter"), inputs.decompose("intra"), window),
        layers=list(layers),
    )  # fmt: skip
    return dict(results.items())


def _meta(labels: list[str], window: Window, layers: list[int], n_heads: int, initial: dict) -> dict[str, Any]:
    return {
        "queries": window.queries,
        "keys": window.keys,
        "query_labels": [labels[i] for i in window.queries],
        "key_labels": [labels[j] for j in window.keys],
        "causal": window.causal,
        "n_heads": n_heads,
        "n_tokens": len(labels),
        "layers": layers,
        "initial": initial,
        "key": f"{window.queries[0]}-{window.queries[-1]}",
        "colorscales": {"diverging": get_colorscale(DIVERGING), "sequential": get_colorscale(SEQUENTIAL)},
    }


class Inspector(anywidget.AnyWidget):
    """The live inspector: one layer's payload at a time, recomputed when ``layer`` or ``start`` changes.

    ``head`` is -1 for all heads (token level); ``query`` is the position whose per-key factors
    are drawn as bars. Head, factor, scope and query are drawn by the front-end from the payload
    already sent; only a new layer or token window runs the model.
    """

    _esm = _asset("inspector.js") + "\n" + _asset("widget.js")
    _css = _asset("inspector.css")
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
        self._computed: dict[str, dict[str, str]] = {}
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
        self.meta = _meta(self._labels, window, self._layers, self._n_heads, initial)
        self._compute()

    def _compute(self) -> None:
        key = f"{self.meta['key']}/{self.layer}"
        if key not in self._computed:
            self._computed[key] = compute_payloads(self._model, self._batch, [self.layer], self.window)[self.layer]
            # The last few layers shown (about 0.6 MB each at 128 tokens) come back without the model.
            while len(self._computed) > RECENT_LAYERS:
                del self._computed[next(iter(self._computed))]
        self.payload = {**self._computed[key], "layer": self.layer, "key": key}

    def _on_message(self, widget: Any, content: dict, buffers: list) -> None:
        if content.get("type") == "need_plotly":
            # Hide module/define so the UMD bundle sets globalThis.Plotly whatever loader the page has.
            source = "(function (module, exports, define) {\n" + plotly.offline.get_plotlyjs() + "\n})();"
            self.send({"type": "plotly", "source": source})

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
        data = {
            "meta": _meta(self._labels, window, wanted, self._n_heads, initial),
            "layers": {str(layer): {**payload, "key": str(layer)} for layer, payload in payloads.items()},
        }
        blob = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
        title = f"contribution-lens inspector: tokens {window.queries[0]}..{window.queries[-1]} of {len(self._labels)}"
        return "\n".join(
            [
                "<!DOCTYPE html><html><head><meta charset='utf-8'>",
                f"<title>{html.escape(title)}</title><style>{_asset('inspector.css')}</style>",
                f"<script type='text/javascript'>{plotly.offline.get_plotlyjs()}</script>",
                f"<script type='text/javascript'>{_asset('inspector.js')}</script>",
                f"</head><body><h1>{html.escape(title)}</h1><div id='cl-root'></div>",
                f"<script type='application/json' id='cl-data'>{blob}</script>",
                "<script type='text/javascript'>ContributionLens.page(document.getElementById('cl-root'),"
                " JSON.parse(document.getElementById('cl-data').textContent));</script>",
                "</body></html>",
            ]
        )

    def write_html(
        self,
        path: str | os.PathLike,
        *,
        layers: Sequence[int] | None = None,
        start: int | None = None,
        tokens: int | None = None,
    ) -> Path:
        """One self-contained HTML file (plotly.js once, every requested layer's data once, offline).

        Args:
            path: where to write.
            layers: layers to embed (default: the inspector's).
            start: first query position of the token window (default: the widget's).
            tokens: queries in the window (default: the widget's, 128); keys add the sink.

        The page opens the view named in its URL fragment, ``#layer=L&head=H&factor=F&scope=S``
        (``H`` a head or ``all``), and rewrites the fragment when the view changes.
        """
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(self.render_html(layers=layers, start=start, tokens=tokens), encoding="utf-8")
        return target


def inspect(
    model: adapter.Model,
    text: str | Tensor,
    layer: int | None = None,
    head: int | None = None,
    *,
    layers: Sequence[int] | None = None,
    factor: str = "contribution",
    scope: str = "inter",
    start: int = 0,
    tokens: int = DEFAULT_TOKENS,
) -> Inspector:
    """A live inspector of every layer, head, factor and scope of one text (display it in Jupyter).

    Args:
        model: a TransformerLens ``TransformerBridge``.
        text: the text (BOS is prepended) or token ids.
        layer: open on this layer (default: the last of ``layers``).
        layers: layers offered (default: all).
        head: open on this head (default: all heads, token level).
        factor: ``attention``, ``relative_norm``, ``cosine`` or ``contribution``.
        scope: ``inter`` or ``intra``.
        start: first query position of the token window.
        tokens: queries in the token window (keys are the same positions plus the sink).

    Example:
        >>> import contribution_lens as cl
        >>> model = cl.load_model()
        >>> inspector = cl.inspect(model, "The cat sat on the mat.", layer=3)
        >>> inspector.layer, inspector.meta["key_labels"][:2]
        (3, ['0:<|im_start|>', '1:The'])
    """
    batch = adapter.to_token_batch(model, text)
    if batch.tokens.shape[0] != 1:
        raise ValueError("inspect takes one text")
    offered = adapter.check_layers(model, layers)
    shown = offered[-1] if layer is None else layer
    return Inspector(
        model,
        batch,
        offered,
        layer=shown,
        head=-1 if head is None else head,
        factor=factor,
        scope=scope,
        start=start,
        tokens=tokens,
    )
