"""The inspector's *why* panel: why one head attends from a query to a key, its largest terms per side.

Layer ``l``, head ``h``, query ``i``, key ``j`` (the maths: `contribution_lens.qk`). The score
``s_ij = scale <q_i, k_j>`` splits exactly over the residual stream's upstream components ``c``
(``embed``, ``L{m}H{g}``, ``L{m}.mlp``, the biases), on the key side ``K_ij^c = scale <q_i, k_j^c>``
and on the query side ``Q_ij^c = scale <q_i^c, k_j>``. What softmax sees is the advantage over the
query's mean key,

    A_ij^c = T_ij^c - sum_k alpha_ik T_ik^c,        sum_c A_ij^c = log alpha_ij + H(alpha_i)

(``T`` either side's terms, ``alpha_i`` the head's attention row, ``H`` its entropy). A *why row*
(`why_row`) holds, for one head and query and each key of a window, each side's ``top`` largest
``|A_ij^c|`` (name and value, largest first), the ``other`` components' sum (the rest of the side,
so that the drawn bars add up to the total), the side's total, ``alpha_ij`` and ``log alpha_ij +
H(alpha_i)``. The numbers are `contribution_lens.QKAttribution.advantage`'s: the panel computes none
of its own.

`PANEL` puts it on the inspector's panel seam (`contribution_lens.views.inspector.panel`): a row is
computed for a request (layer, head, query) from the splits the first view's pass recorded
(`contribution_lens.views.inspector.caches.WhyCache`), and drawn by ``static/panels/why.js``.
"""

from collections.abc import Sequence
from typing import Any

import numpy as np

from contribution_lens.analyses.qk_attribution import QKAttribution
from contribution_lens.views.inspector.panel import Panel, PanelSource, static_script
from contribution_lens.views.inspector.subject import InspectorError

TOP = 8
"""The terms drawn per side (the rest are one "other components" bar)."""
OTHER = "other components"
"""The name of the bar holding the sum of the components not drawn."""
PICK_ONE_HEAD = "the why panel splits one head's scores: choose one head (not all heads, not a KV group)"
"""What the panel says (and the kernel answers) where the view is not one head."""


def _number(value: float) -> float | None:
    """A JSON number (rounded to 1e-6: far below the 1e-4 the panel is checked to), None for -inf."""
    return round(float(value), 6) if np.isfinite(value) else None


def _side(column: np.ndarray, names: Sequence[str], top: int) -> dict[str, Any]:
    """One side of one key: the ``top`` largest ``|A^c|`` (largest first), the rest's sum and the total."""
    order = np.argsort(-np.abs(column), kind="stable")[:top]
    total = float(column.sum())
    shown = column[order]
    return {
        "names": [names[c] for c in order],
        "values": [_number(v) for v in shown],
        "other": _number(total - float(shown.sum())),
        "total": _number(total),
    }


def why_row(
    result: QKAttribution, head: int, query: int, keys: Sequence[int] | None = None, *, top: int = TOP
) -> dict[str, Any]:
    """The *why* panel's numbers of one head and query: each key's largest advantage terms on both sides.

    For every key ``j`` of ``keys`` the query sees (default: all it sees), each side's ``top``
    components of largest ``|A_ij^c|`` with their values, ``other`` (the sum of the rest), ``total``
    (``sum_c A_ij^c``) and, per key, ``alpha_ij`` and ``log alpha_ij + H(alpha_i)`` (None where
    ``alpha_ij`` underflowed to 0: ``-inf``). Without a soft-cap each total equals ``log alpha + H``.

    Args:
        result: a `contribution_lens.QKAttribution` holding ``head`` and ``query``.
        head: the head (of the layer), as `QKAttribution.heads` names it.
        query: the query position.
        keys: the key positions wanted (those the query does not see are left out).
        top: terms per side (a positive integer).

    Example:
        >>> import contribution_lens as cl
        >>> model = cl.load_model()
        >>> result = cl.qk_attribution(model, "The cat sat on the mat. The cat", layer=3, head=0, query=-1)
        >>> row = why_row(result, 0, result.queries[0])
        >>> side = row["key_side"][-1]  # the query's own key
        >>> bool(abs(sum(side["values"]) + side["other"] - row["log_alpha_plus_entropy"][-1]) < 1e-4)
        True
    """
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise ValueError(f"top must be a positive integer, got {top!r}")
    key_side = result.advantage("key", head=head, query=query)  # components x seen keys
    query_side = result.advantage("query", head=head, query=query)
    target = result.log_alpha_plus_entropy(head=head, query=query)
    seen = list(key_side.columns)
    visible = set(seen)
    shown = seen if keys is None else [j for j in keys if j in visible]
    h, i = result.heads.index(head), result.queries.index(query)
    alpha = result.pattern[h, i].double().numpy()
    key_values, query_values = key_side[shown].to_numpy(), query_side[shown].to_numpy()
    return {
        "layer": result.layer,
        "head": head,
        "query": query,
        "top": top,
        "softcap": result.softcap,
        "keys": shown,
        "alpha": [_number(alpha[j]) for j in shown],
        "log_alpha_plus_entropy": [_number(target[j]) for j in shown],
        "key_side": [_side(key_values[:, n], result.key_components, top) for n in range(len(shown))],
        "query_side": [_side(query_values[:, n], result.query_components, top) for n in range(len(shown))],
    }


def row_key(layer: int, head: int, query: int) -> str:
    """How a row is named in a page's ``why.rows`` and in the front-end's cache: ``"layer/head/query"``."""
    return f"{layer}/{head}/{query}"


def panel_row(source: PanelSource, request: dict[str, int]) -> dict[str, Any]:
    """The panel's data of one request: the row of its head and query over the window's keys (kept once computed)."""
    if request["head"] == -1:
        raise InspectorError(PICK_ONE_HEAD)
    return source.splits.row(request["layer"], request["head"], request["query"], source.window)


def page_rows(source: PanelSource, layers: list[int], queries: list[int]) -> dict[str, Any]:
    """The rows a page carries: every head of ``layers`` at each query, one split a layer."""
    return source.splits.page_rows(source.window, layers, queries, source.shown)["rows"]


PANEL = Panel(
    name="why",
    title="why this head attends",
    compute=panel_row,
    script=static_script("why.js"),
    on=("layer", "head", "query"),
    page=page_rows,
)
"""The *why* panel on the inspector's seam."""
PANELS = (PANEL,)
"""The built-in panels this module defines (`contribution_lens.views.inspector.panel.PANELS` declares them)."""
