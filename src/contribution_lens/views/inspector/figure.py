"""One view of the inspector, as the page draws it: its numbers (`view_factors`) and a figure (`inspector_figure`).

The figure is what an exported notebook shows in place of the live widget and what
``Inspector.save_image`` writes; it is drawn from the layer's payload the widget already holds
(no forward pass), with the numbers ``inspector.js`` draws (``shownFactors``, pinned to
`view_factors` by the golden test).
"""

from typing import TYPE_CHECKING, Any

import numpy as np
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from contribution_lens.drawing import plot
from contribution_lens.views.inspector.codecs import decode
from contribution_lens.views.inspector.windows import Window

if TYPE_CHECKING:
    from contribution_lens.analyses.logit_attribution import LogitAttribution


def _decoded(payload: dict[str, Any], name: str) -> np.ndarray:
    return decode(payload[name], payload["codecs"][name])


def group_of(kv_groups: list[list[int]], head: int) -> int:
    """The KV group (the heads sharing one value head) that ``head`` belongs to.

    Example:
        >>> group_of([[0, 1], [2, 3]], 2)
        1
    """
    return next(g for g, heads in enumerate(kv_groups) if head in heads)


def _combined_cells(payload: dict[str, Any], head: int, scope: str) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """All heads (``head`` -1) or the KV group of ``head``: the library's combined cells and row totals."""
    level, group = ("all", 0) if head < 0 else ("group", group_of(payload["kv_groups"], head))
    n_groups = 1 if head < 0 else len(payload["kv_groups"])

    def take(name: str) -> np.ndarray:
        return _decoded(payload, f"{level}_{name}").reshape(n_groups, -1)[group]

    cells = {"attention": take("attention")}
    for factor in ("relative_norm", "cosine", "contribution"):
        cells[factor] = take(f"{factor}_{scope}")
    return cells, take(f"total_{scope}")


def _head_cells(
    payload: dict[str, Any], window: Window, head: int, scope: str
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """One head's cells: ``r_ij = ||vt_j|| / ||o_i||`` (0 where ``||o_i|| = 0``), ``c_ij = a_ij r_ij cos_ij``."""
    query_of, key_of = np.nonzero(window.mask)
    n_heads = len(_decoded(payload, "value_norm")) // len(window.keys)

    def per_head(name: str) -> np.ndarray:
        return _decoded(payload, name).reshape(n_heads, -1)[head]

    output = per_head("output_norm_intra") if scope == "intra" else _decoded(payload, "output_norm_inter")
    value_norm, out = per_head("value_norm")[key_of], output[query_of]
    cells = {"attention": per_head("attention"), "cosine": per_head(f"cosine_{scope}")}
    cells["relative_norm"] = np.divide(value_norm, out, out=np.zeros_like(out), where=out > 0)
    cells["contribution"] = cells["attention"] * cells["relative_norm"] * cells["cosine"]
    return cells, per_head(f"total_{scope}")


def _hide_sink_grid(grid: np.ndarray, totals: np.ndarray) -> np.ndarray:
    hidden = plot.hide_sink(np.nan_to_num(grid), totals)
    return np.where(np.isnan(grid), np.nan, hidden)


def _level(payload: dict[str, Any], window: Window, head: int, scope: str, group_kv: bool) -> tuple[
    dict[str, np.ndarray], np.ndarray, list[int]
]:  # fmt: skip
    """The view's cells ``[cell]`` per factor, its row totals ``S_i`` and the heads it combines."""
    groups = payload["kv_groups"]
    n_heads = sum(len(heads) for heads in groups)
    if head < 0:
        return (*_combined_cells(payload, head, scope), list(range(n_heads)))
    if group_kv and "group_attention" in payload:
        return (*_combined_cells(payload, head, scope), groups[group_of(groups, head)])
    shown = groups[group_of(groups, head)][0] if group_kv else head
    return (*_head_cells(payload, window, shown, scope), [shown])


def view_factors(
    payload: dict[str, Any],
    window: Window,
    *,
    head: int,
    scope: str,
    group_kv: bool = False,
    hide_sink: bool = False,
) -> dict[str, np.ndarray]:
    """The four factors ``[query key]`` of one view of a `window_payload`, as the page draws them.

    ``head`` -1 is all heads (the library's token-level numbers); with ``group_kv`` the head's
    KV group (the library's group numbers; a group of one head is its first head). Per head,
    relative norm and contribution are derived from the coded attention, cosines and exact norms:
    ``r_ij = ||vt_j|| / ||o_i||``, ``c_ij = a_ij r_ij cos_ij``. ``hide_sink`` renormalises
    attention and contribution without key 0 (`contribution_lens.drawing.plot.hide_sink`, the
    row totals ``S_i`` sent with the payload). NaN marks cells the view does not draw (future
    keys, the hidden sink).

    Example:
        >>> import torch
        >>> from contribution_lens import decompose
        >>> from contribution_lens.views.inspector.payload import layer_payload
        >>> from contribution_lens.views.inspector.windows import token_window
        >>> future = torch.ones(3, 3, dtype=torch.bool).triu(1)
        >>> pattern = torch.softmax(torch.randn(1, 2, 3, 3).masked_fill(future, -torch.inf), -1)
        >>> v, W_O = torch.randn(1, 3, 1, 4), torch.randn(2, 4, 8)
        >>> both = [decompose(pattern, v, W_O, scope=s) for s in ("inter", "intra")]
        >>> grid = view_factors(layer_payload(*both, token_window(3)), token_window(3), head=-1, scope="inter")
        >>> bool(np.isnan(grid["attention"][0, 1])), round(float(np.nansum(grid["contribution"][2])), 2)
        (True, 1.0)
    """
    cells, totals, _ = _level(payload, window, head, scope, group_kv)
    grids = {}
    for factor, values in cells.items():
        grid = np.full(window.mask.shape, np.nan)
        grid[window.mask] = values
        grids[factor] = grid
    if hide_sink and window.keys[0] == 0:
        # Attention rows total 1; contribution rows total the query's sum over every key (sent as totals).
        grids["attention"] = _hide_sink_grid(grids["attention"], np.ones(len(window.queries)))
        grids["contribution"] = _hide_sink_grid(grids["contribution"], totals)
    return grids


def outside_view(
    payload: dict[str, Any],
    window: Window,
    *,
    head: int,
    scope: str,
    group_kv: bool = False,
    hide_sink: bool = False,
) -> dict[str, np.ndarray]:
    """Per query ``[query]``, the view's attention and contribution on keys outside the window, as the page draws them.

    For the view's heads ``H`` (one head, its KV group, or all ``m`` heads) and the payload's
    per-head shares ``A_i^h``, ``C_i^h`` (`contribution_lens.views.inspector.payload.outside_shares`):
    attention ``sum_{h in H} A_i^h / |H|`` (the mean, as the view's attention is) and contribution
    ``sum_{h in H} C_i^h``. With ``hide_sink`` both are renormalised as the window's cells are:
    ``x' = x S_i / (S_i - x_i0)`` (``S_i`` 1 for attention, the row total for contribution, ``x_i0``
    the sink's cell), NaN where nothing but the sink is left.

    Example:
        >>> import torch
        >>> from contribution_lens import decompose
        >>> from contribution_lens.views.inspector.payload import layer_payload
        >>> from contribution_lens.views.inspector.windows import token_window
        >>> future = torch.ones(5, 5, dtype=torch.bool).triu(1)
        >>> pattern = torch.softmax(torch.zeros(1, 1, 5, 5).masked_fill(future, -torch.inf), -1)
        >>> v, W_O = torch.randn(1, 5, 1, 4), torch.randn(1, 4, 8)
        >>> window = token_window(5, start=3, tokens=2)
        >>> sent = layer_payload(*[decompose(pattern, v, W_O, scope=s) for s in ("inter", "intra")], window)
        >>> outside_view(sent, window, head=0, scope="inter")["attention"].round(4).tolist()
        [0.5, 0.4]
    """
    cells, totals, heads = _level(payload, window, head, scope, group_kv)
    n_heads = sum(len(group) for group in payload["kv_groups"])
    attention = _decoded(payload, "outside_attention").reshape(n_heads, -1)[heads].mean(0)
    contribution = _decoded(payload, f"outside_{scope}").reshape(n_heads, -1)[heads].sum(0)
    out = {"attention": attention, "contribution": contribution}
    if hide_sink and window.keys[0] == 0:
        rows = np.nonzero(window.mask)[0]
        sink = np.flatnonzero(np.r_[True, np.diff(rows) > 0])  # each row's first cell is key 0
        for name, total in (("attention", np.ones_like(totals)), ("contribution", totals)):
            rest = total - cells[name][sink]
            empty = np.abs(rest) <= 1e-6 * np.maximum(1.0, np.abs(total))
            out[name] = np.where(empty, np.nan, out[name] * total / np.where(empty, 1.0, rest))
    return out


def view_caption(
    payload: dict[str, Any], *, layer: int, head: int, group_kv: bool = False, hide_sink: bool = False
) -> str:
    """Where the view looks, as its title says it: ``L3, all heads``, ``L3H2`` or ``L3 KV group 1 (heads 2, 3)``.

    Example:
        >>> view_caption({"kv_groups": [[0, 1], [2, 3]], "group_attention": ""}, layer=3, head=2, group_kv=True)
        'L3 KV group 1 (heads 2, 3)'
    """
    if head < 0:
        where = f"L{layer}, all heads"
    elif group_kv and "group_attention" in payload:
        group = group_of(payload["kv_groups"], head)
        where = f"L{layer} KV group {group} (heads {', '.join(map(str, payload['kv_groups'][group]))})"
    else:
        where = f"L{layer}H{head}"
    return where + (", sink hidden" if hide_sink else "")


def bars_caption(payload: dict[str, Any], *, layer: int, head: int, scope: str, query_label: str, **view: bool) -> str:
    """The bars' caption, as the page writes it (``barsTitle``): true for one head and for several.

    One head: ``attention × relative norm × cosine = contribution``. Several heads (all, or a KV
    group of ``m``): attention is their mean, relative norm and cosine attention-weighted means,
    contribution their sum, and the product of the three is not the contribution.

    Example:
        >>> bars_caption({"kv_groups": [[0], [1]]}, layer=2, head=-1, scope="inter", query_label="5:cat")
        'query 5:cat: per-key factors (inter, L2, all heads)<br>attention: mean over the 2 heads; relative norm, cosine: their attention-weighted means;<br>contribution: sum over the heads (not the product of the three)'
    """  # noqa: E501
    groups = payload["kv_groups"]
    group_kv = view.get("group_kv", False) and "group_attention" in payload
    m = sum(map(len, groups)) if head < 0 else len(groups[group_of(groups, head)]) if group_kv else 1
    where = view_caption(payload, layer=layer, head=head, **view).replace(f"L{layer}H{head}", f"L{layer} head {head}")
    top = f"query {query_label}: per-key factors ({scope}, {where})"
    if m == 1:
        return top + ": attention × relative norm × cosine = contribution"
    return (
        f"{top}<br>attention: mean over the {m} heads; relative norm, cosine: their attention-weighted means;"
        "<br>contribution: sum over the heads (not the product of the three)"
    )


def bars_figure(
    payload: dict[str, Any], window: Window, labels: list[str], *, layer: int, head: int, scope: str, query: int,
    hide_sink: bool = False, group_kv: bool = False,
) -> go.Figure:  # fmt: skip
    """The selected query's keys and their four factors as horizontal bars, side by side, as the page draws them."""
    grids = view_factors(payload, window, head=head, scope=scope, group_kv=group_kv, hide_sink=hide_sink)
    row = window.queries.index(query) if query in window.queries else len(window.queries) - 1
    shown = ~np.isnan(grids["attention"][row])
    keys = [labels[j] for j, keep in zip(window.keys, shown, strict=True) if keep]
    names = {"attention": "attention", "relative_norm": "relative norm", "cosine": "cosine",
             "contribution": "contribution"}  # fmt: skip
    figure = make_subplots(rows=1, cols=4, shared_yaxes=True, horizontal_spacing=0.03)
    for i, (factor, name) in enumerate(names.items()):
        figure.add_bar(
            x=grids[factor][row][shown], y=keys, orientation="h", name=name, row=1, col=i + 1,
            hovertemplate="%{y}: %{x:.4g}<extra>" + name + "</extra>",
        )  # fmt: skip
        figure.update_xaxes(title_text=name, zeroline=True, row=1, col=i + 1)
    caption = bars_caption(
        payload, layer=layer, head=head, scope=scope, query_label=labels[window.queries[row]],
        hide_sink=hide_sink, group_kv=group_kv,
    )  # fmt: skip
    return figure.update_layout(
        title={"text": caption, "x": 0.02, "xanchor": "left"}, showlegend=False, template="none",
        yaxis={"autorange": "reversed", "type": "category"}, height=max(300, 13 * len(keys) + 140), width=1000,
        margin={"t": 80},
    )  # fmt: skip


def prediction_figure(result: "LogitAttribution", step: int) -> go.Figure:
    """The prediction view's heads as the page draws them: ``[layer head]`` direct terms, layer 0 at the top.

    ``result.attention.sum(-1)`` per (layer, head) on a diverging scale centred at 0, rows ``L0..``
    top to bottom, columns ``H0..``, the hover naming the head and its term.
    """
    values = result.attention.sum(-1).to(torch.float32).numpy()
    n_layers, n_heads = values.shape
    layers, heads = [f"L{layer}" for layer in range(n_layers)], [f"H{h}" for h in range(n_heads)]
    figure = go.Figure(
        go.Heatmap(
            z=values, x=heads, y=layers, colorscale=plot.DIVERGING, zmid=0, colorbar={"title": "logit"},
            hovertemplate="layer %{y}, head %{x}<br>direct term %{z:.4g}<extra></extra>",
        )
    )  # fmt: skip
    title = f"Inspector: prediction, step {step}. Direct attention terms of {result.quantity} at position "
    return figure.update_layout(
        title={"text": f"{title}{result.position}, per head", "x": 0.02, "xanchor": "left"}, template="none",
        xaxis={"title": "head", "type": "category"},
        yaxis={"title": "layer", "type": "category", "autorange": "reversed"},
        width=max(420, 46 * n_heads + 260), height=max(360, 20 * n_layers + 150),
    )  # fmt: skip


def inspector_figure(
    payload: dict[str, Any],
    window: Window,
    labels: list[str],
    *,
    layer: int,
    head: int,
    factor: str,
    scope: str,
    query: int,
    hide_sink: bool = False,
    group_kv: bool = False,
) -> go.Figure:
    """The inspector's view as a figure: the query x key heatmap of its window, the selected query outlined.

    Drawn from the layer's payload the widget already holds (no forward pass), with the numbers
    the page draws (`view_factors`: within the fine codecs' bounds of the library's) and all
    four of them in the hover (`contribution_lens.drawing.plot.factor_grid`). ``head`` -1 is token
    level (all heads); ``hide_sink`` and ``group_kv`` as in the widget.
    """
    grids = view_factors(payload, window, head=head, scope=scope, group_kv=group_kv, hide_sink=hide_sink)
    queries, keys = [labels[i] for i in window.queries], [labels[j] for j in window.keys]
    figure = plot.factor_grid(grids, factor=factor, queries=queries, keys=keys)
    row = window.queries.index(query) if query in window.queries else len(queries) - 1
    figure.add_shape(
        type="rect", xref="paper", x0=0, x1=1, y0=row - 0.5, y1=row + 0.5, line={"color": "black", "width": 2}
    )
    where = view_caption(payload, layer=layer, head=head, group_kv=group_kv, hide_sink=hide_sink)
    # The page's look: plotly.js's plain template (white, light grid), not plotly.py's grey default.
    title = {"text": f"Inspector: {factor} ({scope}), {where}, query {queries[row]}", "x": 0.02, "xanchor": "left"}
    return figure.update_layout(title=title, template="none")
