"""The inspector: per-head contribution heatmaps, live in Jupyter and as one light shareable HTML file.

Three parts: `payload` (what is sent: one layer's numbers for a token window, with their codecs:
fine for the widget, `compact_payload` for large pages), `widget` (`Inspector`, the live anywidget,
which refuses bad values with `InspectorError` and names the reason in its ``error`` trait) and
`page` (the static file). Explained predictions (`contribution_lens.explain_generation`,
`contribution_lens.logit_attribution`) add the ``prediction`` view and a step control
(`Steps`, `steps_payload`). Both front-ends run the
same ES module, ``static/inspector.js``, whose elements are found inside its own root, so several
inspectors live on one page.
"""

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from contribution_lens import adapter
from contribution_lens.analyses.generation import GenerationExplanation
from contribution_lens.analyses.logit_attribution import LogitAttribution
from contribution_lens.choices import as_count
from contribution_lens.views.inspector.payload import (
    ATTENTION_CODES,
    CODECS,
    COMPACT_ATTENTION_ERROR,
    COMPACT_CODECS,
    COSINE_CODES,
    DEFAULT_TOKENS,
    VIEWS,
    Steps,
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
    steps_payload,
    token_label,
    token_window,
    unit_factors,
    window_start,
    window_starts,
)
from contribution_lens.views.inspector.widget import Inspector, InspectorError

__all__ = [
    "ATTENTION_CODES",
    "CODECS",
    "COMPACT_ATTENTION_ERROR",
    "COMPACT_CODECS",
    "COSINE_CODES",
    "DEFAULT_TOKENS",
    "VIEWS",
    "Inspector",
    "InspectorError",
    "Steps",
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
    "steps_payload",
    "token_label",
    "token_window",
    "unit_factors",
    "window_start",
    "window_starts",
]


def inspect(
    model: adapter.Model,
    text: str | Tensor | GenerationExplanation | LogitAttribution | Sequence[LogitAttribution],
    layer: int | None = None,
    head: int | None = None,
    *,
    layers: Sequence[int] | None = None,
    factor: str = "contribution",
    scope: str = "inter",
    start: int | None = None,
    tokens: int = DEFAULT_TOKENS,
    hide_sink: bool = False,
    group_kv: bool = False,
    view: str | None = None,
    step: int | None = None,
    prepend_bos: bool | None = None,
) -> Inspector:
    """A live inspector of every layer, head, factor and scope of one text (display it in Jupyter).

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
        hide_sink: hide key 0 and renormalise the other keys' shares (`hide_sink`).
        group_kv: show the KV group of ``head`` (the heads sharing its value head) combined.
        view: ``heatmap``, ``text`` or ``prediction`` (default: ``prediction`` for explained
            predictions, else ``heatmap``).
        step: the explained step shown (default 0); the query starts at its position.
        prepend_bos: BOS before a text (None: the model's own choice, ``cfg.default_prepend_bos``).

    The first view runs one forward pass for every layer and every window of ``tokens`` queries; switching
    layer or window afterwards sends what is ready. A bad value is refused first (`InspectorError`, a ``ValueError``).

    Example:
        >>> import contribution_lens as cl
        >>> model = cl.load_model()
        >>> inspector = cl.inspect(model, "The cat sat on the mat.", layer=3)
        >>> inspector.layer, inspector.meta["key_labels"][:2]
        (3, ['0:<|im_start|>', '1:The'])
    """
    tokens, steps = as_count(tokens, "tokens"), Steps.of(text)  # tokens checked before any window is laid out
    if steps is None and step is not None:
        raise ValueError(
            f"step={step} needs explained predictions: inspect cl.explain_generation(...) or cl.logit_attribution(...)"
        )
    batch = adapter.to_token_batch(model, text if steps is None else steps.tokens, prepend_bos=prepend_bos)  # type: ignore[arg-type]
    if batch.tokens.shape[0] != 1:
        raise ValueError("inspect takes one text")
    offered = adapter.check_layers(model, layers)
    shown = offered[-1] if layer is None else layer
    chosen: dict[str, Any] = {}
    if steps is not None:
        chosen = {"step": 0 if step is None else step, "view": view or "prediction"}
        if start is None and 0 <= chosen["step"] < len(steps.positions):
            start = window_start(batch.tokens.shape[1], steps.positions[chosen["step"]], tokens)
    elif view is not None:
        chosen = {"view": view}
    return Inspector(
        model,
        batch,
        offered,
        steps=steps,
        layer=shown,
        head=-1 if head is None else head,
        factor=factor,
        scope=scope,
        start=0 if start is None else start,
        tokens=tokens,
        hide_sink=hide_sink,
        group_kv=group_kv,
        **chosen,
    )
