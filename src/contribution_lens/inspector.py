"""`inspect`: one interactive figure over layer, head, factor and scope, no plotting code needed.

Three controls must compose, and a plotly button can only set fixed values, so each control
owns a different attribute: the layer slider sets which traces are *visible*; the head menu
sets the *x-axis domains* (trace of head ``h`` lives on x-axis ``h``: only that axis gets the
plot width); the factor/scope menu sets the *y-axis domains* likewise. Every combination is
embedded, so the figure holds ``layers x (heads + 1) x 7`` small heatmaps; the tokens shown are
limited (``max_tokens`` queries, their keys plus the sink) to keep the HTML small.
"""

from collections.abc import Sequence

import numpy as np
import plotly.graph_objects as go
import torch
from torch import Tensor

from contribution_lens import adapter
from contribution_lens.decomposition import Decomposition
from contribution_lens.engine import map_layers
from contribution_lens.plot import DIVERGING, SEQUENTIAL, SIGNED, token_factors

# (factor, scope) pairs; attention does not depend on the scope.
VIEWS: tuple[tuple[str, str], ...] = (
    ("contribution", "inter"),
    ("contribution", "intra"),
    ("attention", "-"),
    ("relative_norm", "inter"),
    ("relative_norm", "intra"),
    ("cosine", "inter"),
    ("cosine", "intra"),
)
_HIDDEN = [0.0, 0.0001]  # a zero-width domain parks an axis (and its traces) out of sight


def _axis(kind: str, index: int) -> str:
    return f"{kind}axis" if index == 0 else f"{kind}axis{index + 1}"


def _ref(kind: str, index: int) -> str:
    return kind if index == 0 else f"{kind}{index + 1}"


def _window(n: int, max_tokens: int, start: int | None) -> tuple[list[int], list[int]]:
    """Queries shown, and keys shown (the sink at 0, then the queries' own positions)."""
    if max_tokens < 2:
        raise ValueError(f"max_tokens must be at least 2, got {max_tokens}")
    first = max(0, n - max_tokens) if start is None else start
    if not 0 <= first < n:
        raise ValueError(f"start {start} is outside the text of {n} tokens")
    queries = list(range(first, min(n, first + max_tokens)))
    keys = queries if first == 0 else [0, *queries]
    return queries, keys


def inspect(
    model: adapter.Model,
    text: str | Tensor,
    layer: int | None = None,
    head: int | None = None,
    *,
    layers: Sequence[int] | None = None,
    max_tokens: int = 20,
    start: int | None = None,
) -> go.Figure:
    """Interactive heatmaps of every factor, scope, layer and head for one text.

    Args:
        model: a TransformerLens ``TransformerBridge``.
        text: the text (BOS is prepended) or token ids.
        layer: open on this layer (default: the last computed).
        head: open on this head (default: all heads, token level).
        layers: layers to embed (default: all).
        max_tokens: queries shown (the last ones unless ``start`` is given); keys are the same
            positions plus the sink.
        start: first query position shown.

    Example:
        >>> import contribution_lens as cl
        >>> model = cl.load_model()
        >>> figure = cl.inspect(model, "The cat sat on the mat.", layers=[0, 1])
        >>> len(figure.data)  # 2 layers x (9 heads + all heads) x 7 factor/scope views
        140
    """
    wanted = adapter.check_layers(model, layers)
    adapter.check_hooks(model, wanted)
    batch = adapter.to_token_batch(model, text)
    if batch.tokens.shape[0] != 1:
        raise ValueError("inspect takes one text")
    n = batch.tokens.shape[1]
    queries, keys = _window(n, max_tokens, start)
    n_heads = int(model.cfg.n_heads)
    if head is not None and not 0 <= head < n_heads:
        raise ValueError(f"head {head} does not exist: the model has {n_heads} heads (0..{n_heads - 1})")
    shown = layer if layer is not None else wanted[-1]
    if shown not in wanted:
        raise ValueError(f"layer {layer} is not among the embedded layers {wanted}")

    # values[(layer, head_option, view)] -> [query key]; decomposed inside the hooks, then cut
    # to the window so a 512-token text never holds more than one layer's full tensors.
    values: dict[tuple[int, int, int], np.ndarray] = {}
    q_index, k_index = torch.tensor(queries), torch.tensor(keys)
    causal = np.asarray(keys)[None, :] <= np.asarray(queries)[:, None]

    def on_layer(inputs: adapter.LayerInputs) -> None:
        layer_ = inputs.layer
        by_scope: dict[str, Decomposition] = {scope: inputs.decompose(scope) for scope in ("inter", "intra")}
        for head_option in range(n_heads + 1):
            h = None if head_option == n_heads else head_option
            factors = {scope: token_factors(d, h, 0, n) for scope, d in by_scope.items()}
            for view, (factor, scope) in enumerate(VIEWS):
                full = factors["inter" if scope == "-" else scope][factor]
                cut = full[q_index][:, k_index].to(torch.float32).numpy()
                values[(layer_, head_option, view)] = np.where(causal, cut, np.nan).astype(np.float32)

    map_layers(model, batch, on_layer, layers=wanted)

    labels = [f"{i}:{t}" for i, t in enumerate(batch.str_tokens[0])]
    x_labels, y_labels = [labels[j] for j in keys], [labels[i] for i in queries]
    figure = go.Figure()
    head_shown = n_heads if head is None else head
    trace_layers = []
    for layer_ in wanted:
        for head_option in range(n_heads + 1):
            for view, (factor, _) in enumerate(VIEWS):
                figure.add_trace(
                    go.Heatmap(
                        # No x/y per trace: 2000 copies of the labels would double the page;
                        # the axes carry them as tick text instead.
                        z=values[(layer_, head_option, view)],
                        xaxis=_ref("x", head_option),
                        yaxis=_ref("y", view),
                        coloraxis=f"coloraxis{view + 1}" if view else "coloraxis",
                        visible=layer_ == shown,
                        hovertemplate="row %{y}, column %{x}<br>" + factor + " %{z:.4f}<extra></extra>",
                    )
                )
                trace_layers.append(layer_)

    def x_domains(active: int) -> dict:
        return {f"{_axis('x', i)}.domain": [0.0, 0.9] if i == active else _HIDDEN for i in range(n_heads + 1)} | {
            f"{_axis('x', i)}.visible": i == active for i in range(n_heads + 1)
        }

    def y_domains(active: int) -> dict:
        return (
            {f"{_axis('y', i)}.domain": [0.0, 1.0] if i == active else _HIDDEN for i in range(len(VIEWS))}
            | {f"{_axis('y', i)}.visible": i == active for i in range(len(VIEWS))}
            | {f"{'coloraxis' if i == 0 else f'coloraxis{i + 1}'}.showscale": i == active for i in range(len(VIEWS))}
        )

    layout: dict = {}
    for i in range(n_heads + 1):
        layout[_axis("x", i)] = {
            "domain": [0.0, 0.9] if i == head_shown else _HIDDEN,
            "visible": i == head_shown,
            "anchor": _ref("y", 0),
            "tickangle": -60,
            "title": {"text": "key"},
            "tickmode": "array",
            "tickvals": list(range(len(keys))),
            "ticktext": x_labels,
        }
    for i, (factor, _) in enumerate(VIEWS):
        layout[_axis("y", i)] = {
            "domain": [0.0, 1.0] if i == 0 else _HIDDEN,
            "visible": i == 0,
            "anchor": _ref("x", head_shown),
            "autorange": "reversed",
            "title": {"text": "query"},
            "tickmode": "array",
            "tickvals": list(range(len(queries))),
            "ticktext": y_labels,
        }
        scale = {"colorscale": DIVERGING, "cmid": 0} if factor in SIGNED else {"colorscale": SEQUENTIAL}
        colorbar = {"title": {"text": factor}, "x": 0.92}
        layout["coloraxis" if i == 0 else f"coloraxis{i + 1}"] = {**scale, "showscale": i == 0, "colorbar": colorbar}
    figure.update_layout(**layout)

    head_names = [f"head {h}" for h in range(n_heads)] + ["all heads (token level)"]
    figure.update_layout(
        title=f"contribution-lens inspector: {len(queries)} queries from position {queries[0]} of {n}",
        height=max(520, 18 * len(queries) + 260),
        width=max(760, 18 * len(keys) + 360),
        margin={"t": 120},
        updatemenus=[
            {
                "buttons": [
                    {"label": name, "method": "relayout", "args": [x_domains(i)]} for i, name in enumerate(head_names)
                ],
                "active": head_shown,
                "x": 0.0,
                "y": 1.14,
                "xanchor": "left",
            },
            {
                "buttons": [
                    {
                        "label": factor if scope == "-" else f"{factor} ({scope})",
                        "method": "relayout",
                        "args": [y_domains(i)],
                    }
                    for i, (factor, scope) in enumerate(VIEWS)
                ],
                "active": 0,
                "x": 0.35,
                "y": 1.14,
                "xanchor": "left",
            },
        ],
        sliders=[
            {
                "active": wanted.index(shown),
                "currentvalue": {"prefix": "layer "},
                "pad": {"t": 60},
                "steps": [
                    {
                        "label": str(layer_),
                        "method": "restyle",
                        "args": [{"visible": [t == layer_ for t in trace_layers]}],
                    }
                    for layer_ in wanted
                ],
            }
        ]
        if len(wanted) > 1
        else [],
    )
    return figure
