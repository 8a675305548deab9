"""The inspector: per-head contribution heatmaps, live in Jupyter and as one light shareable HTML file.

Three parts: `payload` (what is sent: one layer's numbers for a token window, with their codecs:
fine for the widget, `compact_payload` for large pages), `widget` (`Inspector`, the live anywidget,
which refuses bad values with `InspectorError` and names the reason in its ``error`` trait) and
`page` (the static file). Both front-ends run the
same ES module, ``static/inspector.js``, whose elements are found inside its own root, so several
inspectors live on one page.
"""

from collections.abc import Sequence

from torch import Tensor

from contribution_lens import adapter
from contribution_lens.views.inspector.payload import (
    ATTENTION_CODES,
    CODECS,
    COMPACT_ATTENTION_ERROR,
    COMPACT_CODECS,
    COSINE_CODES,
    DEFAULT_TOKENS,
    Window,
    combine_cells,
    compact_payload,
    compute_payloads,
    compute_windows,
    cosine_error_bound,
    decode_compact,
    dequantise_attention,
    dequantise_cosine,
    hide_sink,
    kv_groups,
    layer_payload,
    quantise_attention,
    quantise_cosine,
    token_label,
    token_window,
    unit_factors,
)
from contribution_lens.views.inspector.widget import Inspector, InspectorError

__all__ = [
    "ATTENTION_CODES",
    "CODECS",
    "COMPACT_ATTENTION_ERROR",
    "COMPACT_CODECS",
    "COSINE_CODES",
    "DEFAULT_TOKENS",
    "Inspector",
    "InspectorError",
    "Window",
    "combine_cells",
    "compact_payload",
    "compute_payloads",
    "compute_windows",
    "cosine_error_bound",
    "decode_compact",
    "dequantise_attention",
    "dequantise_cosine",
    "hide_sink",
    "inspect",
    "kv_groups",
    "layer_payload",
    "quantise_attention",
    "quantise_cosine",
    "token_label",
    "token_window",
    "unit_factors",
]


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
    hide_sink: bool = False,
    group_kv: bool = False,
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
        hide_sink: hide key 0 and renormalise the other keys' shares (`hide_sink`).
        group_kv: show the KV group of ``head`` (the heads sharing its value head) combined.

    The first view runs one forward pass for every layer and every window of ``tokens``
    queries; switching layer or window afterwards sends what is ready. A bad value is refused
    before anything changes, with `InspectorError` (a ``ValueError``).

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
        hide_sink=hide_sink,
        group_kv=group_kv,
    )
