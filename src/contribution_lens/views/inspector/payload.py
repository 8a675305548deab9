"""What the inspector sends to the browser: one layer's numbers for a token window, compact and self-describing.

For one layer, head ``h``, query ``i`` and key ``j`` of a token window the inspector shows

    c_ij^h = alpha_ij^h * (||vt_j^h|| / ||o||) * cos(o, vt_j^h)

and its three factors in both scopes (``o = o_i^h`` intra, ``o = o_i`` inter), per head or at
token level ("all heads", `contribution_lens.Decomposition.token_factors`). The library computes;
the page only decodes and, per head, multiplies. Per layer, `layer_payload` holds, for every
displayable (query, key) cell of the window:

* per head: attention ``a`` and the cosine in each scope in the fine codecs
  (`contribution_lens.views.inspector.codecs`: ``|a_hat - a|, |c_hat - c| <= 1.53e-5``), plus
  ``value_norm [head key]`` and ``output_norm`` intra ``[head query]`` and inter ``[query]``,
  exact (float32). ``relative_norm = value_norm / output_norm`` is then exact and
  ``|c_hat - c| <= relative_norm * (|a_hat - a| |cos| + (a + |a_hat - a|) |cos_hat - cos|)``;
* all heads (token level) and each KV group: attention and cosines in the same codes, relative
  norm and contribution exact (float32, as the library combined them: float16 rounded them to
  ``2^-11`` relative, 40 times coarser than a head's contribution), combined as `combine_cells` says.

How each array is coded travels with the data (``meta.codecs``, each payload's ``codecs``), as
do the colour scales: the page holds no constant of its own.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from plotly.colors import get_colorscale
from torch import Tensor

from contribution_lens._lazy import face
from contribution_lens.choices import FACTORS, SCOPES, Factor, Scope
from contribution_lens.decomposition import Decomposition
from contribution_lens.drawing.plot import DIVERGING, SEQUENTIAL
from contribution_lens.views.inspector._deprecated import inspector_names
from contribution_lens.views.inspector.codecs import CODECS, COMPACT_CODECS, HALF_MAX, quantise, to_base64
from contribution_lens.views.inspector.state import schema
from contribution_lens.views.inspector.windows import Window

_DEPRECATED = inspector_names(__name__)
"""What this module held before the inspector's split (codecs, windows, steps...): each name warns and comes from
its module."""
if not TYPE_CHECKING:  # type checkers see this module's own names only
    __getattr__ = face(__name__, {}, _DEPRECATED)[0]

COMBINED = ("cosine", "relative_norm", "contribution")
"""The factors combined over a group of heads beside attention (`combine_cells`)."""
ARRAYS: dict[str, str] = {
    "attention": "attention",
    "cosine_intra": "cosine",
    "cosine_inter": "cosine",
    "value_norm": "exact",
    "output_norm_intra": "exact",
    "output_norm_inter": "exact",
    **{f"{level}_attention": "attention" for level in ("all", "group")},
    **{f"{level}_{factor}_{scope}": "cosine" if factor == "cosine" else "exact"
       for level in ("all", "group") for scope in SCOPES for factor in COMBINED},
    **{f"{level}total_{scope}": "exact" for level in ("", "all_", "group_") for scope in SCOPES},
    "outside_attention": "exact",
    **{f"outside_{scope}": "exact" for scope in SCOPES},
}  # fmt: skip
"""Each array of a layer's payload and the codec it is written in (where its values fit).

``group_*`` (``[kv_head cell]``, only where several query heads share a value head) combine the
heads of one KV group as ``all_*`` combine every head. ``total_{scope}`` ``[head query]``,
``all_total_{scope}`` ``[query]`` and ``group_total_{scope}`` ``[kv_head query]`` are each
query's contribution summed over all its keys (inside the window or not): hiding the sink needs them.
``outside_attention`` and ``outside_{scope}`` ``[head query]`` are each query's attention and
contribution on the keys the window does not show (`outside_shares`): the rest of its row.
"""
OUTSIDE = ("outside_attention", *(f"outside_{scope}" for scope in SCOPES))
"""The arrays of `outside_shares`: cut per window, not per layer (`window_payload`)."""
PER_QUERY = {"output_norm_intra", "output_norm_inter"} | {f"{level}total_{scope}" for level in ("", "all_", "group_")
                                                          for scope in SCOPES}  # fmt: skip
"""Arrays indexed by query only (``[*head query]``); ``value_norm`` is by key, every other array by cell."""


def codec_for(name: str, values: np.ndarray) -> str:
    """The codec array ``name`` is written in: `ARRAYS`' choice, or float32 where float16 would overflow."""
    codec = ARRAYS[name]
    if codec == "half" and values.size and float(np.abs(values).max()) > HALF_MAX:
        return "exact"
    return codec


def kv_groups(n_heads: int, n_kv_heads: int) -> list[list[int]]:
    """The query heads reading each value head (GQA/MQA): head ``h`` reads kv head ``h // (n_heads / n_kv_heads)``.

    Example:
        >>> kv_groups(9, 3)
        [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    """
    if n_kv_heads < 1 or n_heads % n_kv_heads:
        raise ValueError(f"{n_kv_heads} kv heads do not divide {n_heads} query heads")
    size = n_heads // n_kv_heads
    return [list(range(g * size, (g + 1) * size)) for g in range(n_kv_heads)]


def combine_cells(
    attention: np.ndarray, relative_norm: np.ndarray, cosine: np.ndarray, n_groups: int
) -> dict[str, np.ndarray]:
    """Each group of consecutive heads combined, ``[group cell]`` per factor, as `Decomposition.token_factors` does.

    For the heads ``h`` of a group of ``m``: attention ``sum_h alpha^h / m``, contribution
    ``sum_h alpha^h r^h cos^h``, relative norm ``r`` and cosine their attention-weighted mean
    ``sum_h alpha^h x^h / sum_h alpha^h`` (0 where no head of the group attends). ``n_groups=1``
    is the token level ("all heads"). The page computes the same (``combine`` in
    ``inspector.js``, pinned by the golden test).

    Example:
        >>> a, r, c = np.array([[0.5], [0.1]]), np.array([[2.0], [4.0]]), np.array([[1.0], [-1.0]])
        >>> {k: round(float(v[0, 0]), 4) for k, v in combine_cells(a, r, c, 1).items()}
        {'attention': 0.3, 'relative_norm': 2.3333, 'cosine': 0.6667, 'contribution': 0.6}
    """
    products = {"relative_norm": attention * relative_norm, "cosine": attention * cosine}
    products["contribution"] = products["relative_norm"] * cosine
    return combine_products(attention, products, n_groups)


def combine_products(attention: np.ndarray, products: dict[str, np.ndarray], n_groups: int) -> dict[str, np.ndarray]:
    """`combine_cells` from ``alpha``, ``alpha * relative_norm``, ``alpha * cosine`` and the contribution."""
    shape = (n_groups, attention.shape[0] // n_groups, attention.shape[-1])
    total = attention.reshape(shape).sum(1)
    inverse = np.divide(1.0, total, out=np.zeros_like(total), where=total > 1e-30)
    combined = {"attention": total / shape[1]}
    for name, values in products.items():
        summed = values.reshape(shape).sum(1)
        combined[name] = summed if name == "contribution" else summed * inverse
    return combined


@dataclass(frozen=True)
class LayerArrays:
    """One layer's numbers for one token window, coded (`window_arrays`): what `window_payload` sends.

    ``codes`` holds each array of `ARRAYS` in its codec (``codecs``): by cell ``[*head cell]`` (the
    window's displayable (query, key) cells, row-major), by query ``[*head query]`` (`PER_QUERY`, the
    window's queries) or by key (``value_norm [head key]``, the window's keys); ``attention
    [head cell]`` is kept in float32 for the compact codec, ``contribution`` (``{scope: [head cell]}``,
    float32) beside it, and ``outside`` the shares of the keys the window does not show (`outside_shares`).
    """

    codes: dict[str, np.ndarray]
    codecs: dict[str, str]
    attention: np.ndarray
    kv_groups: list[list[int]]
    contribution: dict[str, np.ndarray]
    outside: dict[str, np.ndarray]


def _numpy(tensor: Tensor) -> np.ndarray:
    return tensor.detach().to("cpu", torch.float32).numpy()


def _scope_arrays(
    d: Decomposition, cells: Tensor, rows: Tensor, attention: np.ndarray, value_norm: np.ndarray, window: Window,
    groups: list[list[int]], index: int,
) -> dict[str, np.ndarray]:  # fmt: skip
    """One scope's arrays of `ARRAYS` for the window: per-head cosines and norms, totals, and the combined heads."""
    scope, n_heads = str(d.scope), attention.shape[0]
    query_of, key_of = np.nonzero(window.mask)
    cosine = _numpy(d.cosine[index].flatten(-2).index_select(1, cells))
    output_norm = _numpy(d.output_norm[index].index_select(1, rows))
    out = output_norm[:, query_of]
    relative_norm = np.divide(value_norm[:, key_of], out, out=np.zeros_like(out), where=out > 0)
    products = {"relative_norm": attention * relative_norm, "cosine": attention * cosine}
    products["contribution"] = products["relative_norm"] * cosine
    # Each query's contribution over every key it sees, in the window or not: its whole row.
    total = _numpy(d.contribution[index].index_select(1, rows).sum(-1))
    arrays = {
        f"contribution_{scope}": products["contribution"],
        f"cosine_{scope}": cosine,
        f"output_norm_{scope}": output_norm if scope == "intra" else output_norm[0],
        f"total_{scope}": total,
    }
    levels = {"all": 1, "group": len(groups)} if 1 < len(groups) < n_heads else {"all": 1}
    for level, n_groups in levels.items():
        combined = combine_products(attention, products, n_groups)
        per_group = total.reshape(n_groups, -1, total.shape[-1]).sum(1)
        squeeze = (lambda x: x[0]) if level == "all" else (lambda x: x)
        arrays[f"{level}_total_{scope}"] = squeeze(per_group)
        if scope == "inter":
            arrays[f"{level}_attention"] = squeeze(combined["attention"])
        for factor in COMBINED:
            arrays[f"{level}_{factor}_{scope}"] = squeeze(combined[factor])
    return arrays


def window_arrays(
    inter: Decomposition,
    intra: Decomposition,
    window: Window,
    *,
    first_query: int | None = None,
    n_kv_heads: int | None = None,
    index: int = 0,
) -> LayerArrays:
    """Everything a payload of ``window`` needs, coded (`LayerArrays`), from decompositions of rows holding its queries.

    ``inter`` and ``intra`` are the decompositions of queries ``first_query ..`` (default: the last
    rows of their keys; a layer's whole decomposition, or a tile's) over keys holding the window's:
    the window's cells are cut from them, each query's total and its shares outside the window read
    its whole row.
    """
    if inter.scope != Scope.INTER or intra.scope != Scope.INTRA:
        raise ValueError(
            f"window_arrays takes the inter then the intra decomposition, got {inter.scope}, {intra.scope}"
        )
    n_heads, n_rows, n_keys = inter.shape[1:]
    first = n_keys - n_rows if first_query is None else first_query
    groups = kv_groups(n_heads, n_heads if n_kv_heads is None else n_kv_heads)
    queries, keys = np.asarray(window.queries) - first, np.asarray(window.keys)
    if queries.min() < 0 or queries.max() >= n_rows or keys.max() >= n_keys:
        raise ValueError(f"window {window.key} is not within queries {first}..{first + n_rows - 1} of {n_keys} keys")
    if not inter.valid[index].index_select(0, torch.from_numpy(queries)).any(1).all():
        raise ValueError("every query must see at least one key")
    query_of, key_of = np.nonzero(window.mask)
    cells = torch.from_numpy(queries[query_of] * n_keys + keys[key_of])
    rows = torch.from_numpy(queries)
    attention = _numpy(inter.attention[index].flatten(-2).index_select(1, cells))
    value_norm = _numpy(inter.value_norm[index][:, keys])
    arrays = {"attention": attention, "value_norm": value_norm}
    for d in (inter, intra):
        arrays |= _scope_arrays(d, cells, rows, attention, value_norm, window, groups, index)
    contribution = {scope: arrays.pop(f"contribution_{scope}") for scope in SCOPES}
    codecs = {name: codec_for(name, values) for name, values in arrays.items()}
    codes = {name: quantise(values, codecs[name]) for name, values in arrays.items()}
    outside = outside_shares({"inter": inter, "intra": intra}, window, first, index)
    return LayerArrays(codes, codecs, attention, groups, contribution, outside)


def outside_keys(window: Window, n: int) -> list[int]:
    """The positions of a text of ``n`` tokens that are not keys of the window (before it, or after it for an encoder).

    Example:
        >>> from contribution_lens.views.inspector.windows import token_window
        >>> outside_keys(token_window(10, start=6, tokens=3), 10)
        [1, 2, 3, 4, 5]
    """
    shown = set(window.keys)
    last = window.queries[-1] if window.causal else n - 1
    return [j for j in range(last + 1) if j not in shown]


def outside_shares(
    decompositions: dict[str, Decomposition], window: Window, first_query: int, index: int = 0
) -> dict[str, np.ndarray]:
    """Per head and query of the window, attention and contribution on the keys it does not show, ``[head query]``.

    ``A_i^h = sum_{j not shown} alpha_ij^h`` and ``C_i^h = sum_{j not shown} c_ij^h`` in each scope
    (``j`` over the query's keys outside the window): with the window's own cells they make the
    whole row (``sum_j alpha_ij^h = 1``). Summed in float64 from the float32 numbers of the rows
    (queries from ``first_query``) of ``decompositions`` (``{scope: Decomposition}``).

    Example:
        >>> import torch
        >>> from contribution_lens import decompose
        >>> from contribution_lens.views.inspector.windows import token_window
        >>> future = torch.ones(5, 5, dtype=torch.bool).triu(1)
        >>> pattern = torch.softmax(torch.zeros(1, 1, 5, 5).masked_fill(future, -torch.inf), -1)
        >>> v, W_O = torch.randn(1, 5, 1, 4), torch.randn(1, 4, 8)
        >>> both = {s: decompose(pattern, v, W_O, scope=s) for s in ("inter", "intra")}
        >>> shares = outside_shares(both, token_window(5, start=3, tokens=2), first_query=0)  # keys 1, 2 are outside
        >>> [round(float(x), 4) for x in shares["outside_attention"][0]]  # queries 3 and 4 attend evenly
        [0.5, 0.4]
    """
    inter = decompositions["inter"]
    n_keys = inter.shape[-1]
    keys = torch.tensor([j for j in outside_keys(window, n_keys) if j < n_keys], dtype=torch.long)
    rows = torch.tensor(window.queries) - first_query
    named = {"outside_attention": inter.attention} | {f"outside_{s}": d.contribution for s, d in decompositions.items()}
    out = {}
    for name, values in named.items():
        # Only the keys each query sees count (0 elsewhere in every factor): a query's row sums its own.
        part = values[index].index_select(1, rows).index_select(2, keys).to(torch.float32)
        out[name] = part.sum(-1, dtype=torch.float64).to(torch.float32).numpy()
    return out


def window_payload(arrays: LayerArrays, window: Window) -> dict[str, Any]:
    """The window's `window_arrays`, each array base64 in its codec (named in ``codecs``)."""
    out: dict[str, Any] = {name: to_base64(codes, arrays.codecs[name]) for name, codes in arrays.codes.items()}
    out |= {name: to_base64(values, "exact") for name, values in arrays.outside.items()}
    codecs = {**arrays.codecs, **dict.fromkeys(OUTSIDE, "exact")}
    return {**out, "codecs": codecs, "kv_groups": arrays.kv_groups}


def layer_payload(
    inter: Decomposition, intra: Decomposition, window: Window, *, index: int = 0, n_kv_heads: int | None = None
) -> dict[str, Any]:
    """What the page needs of one layer: each array of `ARRAYS` base64 in its codec, named in ``codecs``.

    Example:
        >>> import base64, torch
        >>> from contribution_lens import decompose
        >>> from contribution_lens.views.inspector.windows import token_window
        >>> future = torch.ones(3, 3, dtype=torch.bool).triu(1)
        >>> pattern = torch.softmax(torch.randn(1, 2, 3, 3).masked_fill(future, -torch.inf), -1)
        >>> v, W_O = torch.randn(1, 3, 1, 4), torch.randn(2, 4, 8)
        >>> both = [decompose(pattern, v, W_O, scope=s) for s in ("inter", "intra")]
        >>> p = layer_payload(*both, token_window(3))
        >>> len(base64.b64decode(p["attention"]))  # 2 heads x 6 causal cells x 2 bytes
        24
    """
    return window_payload(window_arrays(inter, intra, window, n_kv_heads=n_kv_heads, index=index), window)


def payload_bytes(window: Window, n_heads: int, n_kv_heads: int) -> int:
    """About how many bytes one layer's `window_payload` takes (base64 of the 2-byte codes per cell)."""
    # A head: attention and two cosines; a combination (all heads, each KV group): those three plus
    # relative norm and contribution in both scopes in float32 (two 2-byte codes' worth each).
    combined = 3 + 2 * 4
    levels = n_heads * 3 + combined + (combined * n_kv_heads if n_kv_heads < n_heads else 0)
    return window.cells * levels * 2 * 4 // 3


def key_ranges(positions: list[int]) -> list[list[int]]:
    """Sorted positions as runs ``[first, last]`` (how the page names the keys outside a window).

    Example:
        >>> key_ranges([1, 2, 3, 7, 9, 10])
        [[1, 3], [7, 7], [9, 10]]
    """
    runs: list[list[int]] = []
    for j in positions:
        if runs and runs[-1][1] == j - 1:
            runs[-1][1] = j
        else:
            runs.append([j, j])
    return runs


def meta(
    labels: list[str],
    window: Window,
    layers: list[int],
    n_heads: int,
    initial: dict,
    *,
    kv_groups: list[list[int]] | None = None,
    compact: bool = False,
) -> dict[str, Any]:
    """What the page needs besides the layers' numbers: tokens, window, layers, KV groups, codecs, colour scales.

    ``settings`` is the view state's description (`contribution_lens.views.inspector.state.schema`):
    the front-end reads the settings' names, defaults and links from it, never from a list of its own.
    """
    groups = kv_groups or [[h] for h in range(n_heads)]
    return {
        "queries": window.queries,
        "keys": window.keys,
        "query_labels": [labels[i] for i in window.queries],
        "key_labels": [labels[j] for j in window.keys],
        "outside": key_ranges(outside_keys(window, len(labels))),
        "causal": window.causal,
        "n_heads": n_heads,
        "kv_groups": groups,
        "n_tokens": len(labels),
        "layers": layers,
        "initial": initial,
        "settings": schema(groups),
        "key": window.key,
        "factors": list(FACTORS),
        "signed": [str(factor) for factor in Factor if factor.signed],
        "scopes": list(SCOPES),
        "codecs": {**CODECS, **COMPACT_CODECS} if compact else CODECS,
        "compact": compact,
        "colorscales": {"diverging": get_colorscale(DIVERGING), "sequential": get_colorscale(SEQUENTIAL)},
    }
