"""The inspector: per-head contribution heatmaps, live in Jupyter and as one light shareable HTML file.

Three parts: `payload` (what is sent: one layer's numbers for a token window, with their codecs),
`widget` (`Inspector`, the live anywidget) and `page` (the static file). Both front-ends run the
same ES module, ``static/inspector.js``, whose elements are found inside its own root, so several
inspectors live on one page.
"""

from collections.abc import Sequence

from torch import Tensor

from contribution_lens import adapter
from contribution_lens.views.inspector.payload import (
    ATTENTION_CODES,
    CODECS,
    COSINE_CODES,
    DEFAULT_TOKENS,
    Window,
    compute_payloads,
    dequantise_attention,
    dequantise_cosine,
    layer_payload,
    quantise_attention,
    quantise_cosine,
    token_label,
    token_window,
)
from contribution_lens.views.inspector.widget import Inspector

__all__ = [
    "ATTENTION_CODES",
    "CODECS",
    "COSINE_CODES",
    "DEFAULT_TOKENS",
    "Inspector",
    "Window",
    "compute_payloads",
    "dequantise_attention",
    "dequantise_cosine",
    "inspect",
    "layer_payload",
    "quantise_attention",
    "quantise_cosine",
    "token_label",
    "token_window",
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
