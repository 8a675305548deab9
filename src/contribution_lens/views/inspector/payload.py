"""What the inspector sends to the browser: one layer's numbers for a token window, compact and self-describing.

For one layer, head ``h``, query ``i`` and key ``j`` of a token window the inspector shows

    c_ij^h = alpha_ij^h * (||vt_j^h|| / ||o||) * cos(o, vt_j^h)

and its three factors in both scopes (``o = o_i^h`` intra, ``o = o_i`` inter), per head or at
token level ("all heads", `contribution_lens.Decomposition.token_factors`). The library computes;
the page only decodes and, per head, multiplies. Per layer, `layer_payload` holds, for every
displayable (query, key) cell of the window:

* per head: attention ``a`` (code ``round(sqrt(a) * 65535)``, so ``|a_hat - a| <= 2 sqrt(a) d + d^2``
  with ``d = 0.5 / 65535``: at most 1.53e-5, relatively finer for small weights) and the cosine
  in each scope (code ``round(c * 32767) + 32767``, ``|c_hat - c| <= 0.5 / 32767`` = 1.53e-5, 0
  exact), plus ``value_norm [head key]`` and ``output_norm`` intra ``[head query]`` and inter
  ``[query]``, exact (float32). ``relative_norm = value_norm / output_norm`` is then exact and
  ``|c_hat - c| <= relative_norm * (|a_hat - a| |cos| + (a + |a_hat - a|) |cos_hat - cos|)``;
* all heads (token level): attention and cosines in the same codes, relative norm and
  contribution as float16 (``|x_hat - x| <= 2^-11 |x|``, finer than the 4 digits shown; an
  array with a value beyond float16's range is sent as float32 instead).

How each array is coded travels with the data (`CODECS` in ``meta``, each payload's ``codecs``),
as do the colour scales: the page holds no constant of its own.
"""

import base64
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import einops
import numpy as np
import torch
from jaxtyping import Float, Int
from plotly.colors import get_colorscale
from torch import Tensor
from tqdm.auto import tqdm

from contribution_lens import adapter
from contribution_lens.analyses.generation import GenerationExplanation
from contribution_lens.analyses.logit_attribution import LogitAttribution
from contribution_lens.choices import FACTORS, SCOPES, Factor, Scope
from contribution_lens.decomposition import Decomposition
from contribution_lens.engine import map_layers
from contribution_lens.views.plot import DIVERGING, SEQUENTIAL, hide_sink

__all__ = ["hide_sink"]  # defined with the figures, which hide the sink the same way

ATTENTION_CODES = 65535
COSINE_CODES = 32767
DEFAULT_TOKENS = 128

CODECS: dict[str, dict[str, Any]] = {
    "attention": {"kind": "sqrt", "dtype": "uint16", "levels": ATTENTION_CODES},
    "cosine": {"kind": "linear", "dtype": "uint16", "levels": COSINE_CODES, "offset": COSINE_CODES},
    "exact": {"kind": "float32", "dtype": "float32"},
    "half": {"kind": "float16", "dtype": "float16"},
}
"""How the page turns each payload array back into numbers (`dequantise`), sent in ``meta``."""
ARRAYS: dict[str, str] = {
    "attention": "attention",
    "cosine_intra": "cosine",
    "cosine_inter": "cosine",
    "value_norm": "exact",
    "output_norm_intra": "exact",
    "output_norm_inter": "exact",
    "all_attention": "attention",
    **{f"all_{factor}_{scope}": codec for scope in SCOPES for factor, codec in
       (("cosine", "cosine"), ("relative_norm", "half"), ("contribution", "half"))},
    "group_attention": "attention",
    **{f"group_{factor}_{scope}": codec for scope in SCOPES for factor, codec in
       (("cosine", "cosine"), ("relative_norm", "half"), ("contribution", "half"))},
    **{f"total_{scope}": "exact" for scope in SCOPES},
    **{f"all_total_{scope}": "exact" for scope in SCOPES},
    **{f"group_total_{scope}": "exact" for scope in SCOPES},
}  # fmt: skip
"""Each array of a layer's payload and the codec it is written in (where its values fit).

``group_*`` (``[kv_head cell]``, only where several query heads share a value head) combine the
heads of one KV group as ``all_*`` combine every head. ``total_{scope}`` ``[head query]``,
``all_total_{scope}`` ``[query]`` and ``group_total_{scope}`` ``[kv_head query]`` are each
query's contribution summed over all its keys (inside the window or not): `hide_sink` needs them.
"""
HALF_MAX = float(np.finfo(np.float16).max)


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

    @property
    def key(self) -> str:
        """A name for the window, ``"first-last"``."""
        return f"{self.queries[0]}-{self.queries[-1]}"


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


def window_starts(n: int, tokens: int) -> list[int]:
    """The starts of the half-overlapping windows of ``tokens`` queries over ``n`` tokens (the widget's menu).

    Example:
        >>> window_starts(15, 8)
        [0, 4, 8]
    """
    step = max(1, tokens // 2)
    return [start for start in range(0, max(1, n - tokens + step), step) if start < n]


def window_start(n: int, position: int, tokens: int) -> int:
    """The start of the first menu window (`window_starts`) holding ``position``: its keys reach furthest back.

    Example:
        >>> window_start(15, 9, 8), window_start(15, 3, 8)
        (4, 0)
    """
    return next(start for start in window_starts(n, tokens) if start + tokens > position)


def token_label(position: int, token: str) -> str:
    """``"{position}:{token}"`` with line breaks and tabs shown as ``\\n``, ``\\r``, ``\\t``.

    Example:
        >>> token_label(3, "\\n")
        '3:\\\\n'
    """
    return f"{position}:" + token.replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")


def quantise(values: np.ndarray, codec: str) -> np.ndarray:
    """``values`` in the codec's numbers (`CODECS`); torch does the arithmetic (NumPy's float16 cast is slow)."""
    spec = CODECS[codec]
    # Copied only where read-only (a pandas column's array) or not contiguous: torch cannot wrap those.
    x = torch.from_numpy(np.require(values, requirements=("C", "W")))
    if spec["kind"] == "sqrt":
        return (
            x.to(torch.float32)
            .clamp(0.0, 1.0)
            .sqrt_()
            .mul_(spec["levels"])
            .round_()
            .to(torch.int32)
            .numpy()
            .astype(np.uint16)
        )
    if spec["kind"] == "linear":
        codes = x.to(torch.float32).clamp(-1.0, 1.0).mul_(spec["levels"]).round_().add_(spec["offset"])
        return codes.to(torch.int32).numpy().astype(np.uint16)
    return x.to(torch.float16 if spec["kind"] == "float16" else torch.float32).numpy()


def dequantise(codes: np.ndarray, codec: str) -> np.ndarray:
    """What the page computes from the codes: the inverse of `quantise` up to its rounding."""
    spec = CODECS[codec]
    if spec["kind"] == "sqrt":
        return (codes.astype(np.float64) / spec["levels"]) ** 2
    if spec["kind"] == "linear":
        return (codes.astype(np.float64) - spec["offset"]) / spec["levels"]
    return codes.astype(np.float64)


def quantise_attention(attention: np.ndarray) -> np.ndarray:
    """uint16 codes ``round(sqrt(a) * 65535)`` of attention weights in ``[0, 1]``."""
    return quantise(attention, "attention")


def quantise_cosine(cosine: np.ndarray) -> np.ndarray:
    """uint16 codes ``round(c * 32767) + 32767`` of cosines in ``[-1, 1]``."""
    return quantise(cosine, "cosine")


def dequantise_attention(codes: np.ndarray) -> np.ndarray:
    return dequantise(codes, "attention")


def dequantise_cosine(codes: np.ndarray) -> np.ndarray:
    return dequantise(codes, "cosine")


_LITTLE_ENDIAN = {"uint16": "<u2", "float16": "<f2", "float32": "<f4"}


def codec_for(name: str, values: np.ndarray) -> str:
    """The codec array ``name`` is written in: `ARRAYS`' choice, or float32 where float16 would overflow."""
    codec = ARRAYS[name]
    if codec == "half" and values.size and float(np.abs(values).max()) > HALF_MAX:
        return "exact"
    return codec


def _b64(array: np.ndarray, codec: str) -> str:
    data = np.ascontiguousarray(quantise(array, codec), dtype=_LITTLE_ENDIAN[CODECS[codec]["dtype"]])
    return base64.b64encode(data.tobytes()).decode("ascii")


def _cut(values: Float[Tensor, "*head query key"], window: Window) -> np.ndarray:
    """``[*head cell]``: the displayable cells of the window, row-major over (query, key)."""
    rows = values[..., window.queries, :][..., window.keys].to(torch.float32).cpu().numpy()
    return rows[..., window.mask]


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
    """Each KV group's heads combined, ``[kv_head cell]`` per factor, as `Decomposition.token_factors` combines all.

    Attention averaged, contribution summed, relative norm and cosine their attention-weighted
    mean over the group, ``sum_h alpha_ij^h x_ij^h / sum_h alpha_ij^h`` (0 where no head of the
    group attends). ``n_groups=1`` is the token level ("all heads"). The page computes the same.
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
    """One layer over the whole text, coded once: windows are cuts of it (`window_payload`).

    ``codes`` holds each array of `ARRAYS` in its codec (``codecs``): by cell ``[*head cell]``
    (the displayable (query, key) pairs of the text, row-major), by query ``[*head query]``
    (`PER_QUERY`) or by key (``value_norm [head key]``); ``cell [query key]`` numbers the cells
    (-1 where not displayable); ``attention [head cell]`` is kept in float32 for the compact codec.
    """

    codes: dict[str, np.ndarray]
    codecs: dict[str, str]
    cell: np.ndarray
    attention: np.ndarray
    kv_groups: list[list[int]]


def _numpy(tensor: Tensor) -> np.ndarray:
    return tensor.detach().to("cpu", torch.float32).numpy()


def layer_arrays(
    inter: Decomposition, intra: Decomposition, n_kv_heads: int | None = None, *, index: int = 0
) -> LayerArrays:
    """Everything a payload of this layer needs, for every query and key, coded (`LayerArrays`)."""
    if inter.scope != Scope.INTER or intra.scope != Scope.INTRA:
        raise ValueError(
            f"layer_payload takes the inter then the intra decomposition, got {inter.scope}, {intra.scope}"
        )
    n_heads, n = inter.shape[1], inter.shape[2]
    groups = kv_groups(n_heads, n_heads if n_kv_heads is None else n_kv_heads)
    valid = inter.valid[index].cpu().numpy()
    flat = torch.from_numpy(np.flatnonzero(valid))
    cell = np.full(valid.shape, -1, dtype=np.int64)
    cell[valid] = np.arange(flat.numel())
    query_of, key_of = np.nonzero(valid)
    if not valid.any(1).all():
        raise ValueError("every query must see at least one key")
    row_starts = np.concatenate([[0], np.cumsum(valid.sum(1))[:-1]])

    def cells(x: Tensor) -> np.ndarray:
        return _numpy(x[index].reshape(n_heads, n * n).index_select(1, flat))

    attention = cells(inter.attention)
    value_norm = _numpy(inter.value_norm[index])
    arrays = {"attention": attention, "value_norm": value_norm}
    for scope, d in (("inter", inter), ("intra", intra)):
        cosine = cells(d.cosine)
        output_norm = _numpy(d.output_norm[index])
        arrays[f"cosine_{scope}"] = cosine
        arrays[f"output_norm_{scope}"] = output_norm if scope == "intra" else output_norm[0]
        out = output_norm[:, query_of]
        relative_norm = np.divide(value_norm[:, key_of], out, out=np.zeros_like(out), where=out > 0)
        products = {"relative_norm": attention * relative_norm, "cosine": attention * cosine}
        products["contribution"] = products["relative_norm"] * cosine
        # Cells are row-major: each query's cells are one run, summed in one reduceat.
        arrays[f"total_{scope}"] = np.add.reduceat(products["contribution"], row_starts, axis=1)
        levels = {"all": 1, "group": len(groups)} if 1 < len(groups) < n_heads else {"all": 1}
        for level, n_groups in levels.items():
            combined = combine_products(attention, products, n_groups)
            if level == "all":
                combined = {name: x[0] for name, x in combined.items()}
            per_group = arrays[f"total_{scope}"].reshape(n_groups, -1, n).sum(1)
            arrays[f"{level}_total_{scope}"] = per_group[0] if level == "all" else per_group
            if scope == "inter":
                arrays[f"{level}_attention"] = combined["attention"]
            for factor in ("cosine", "relative_norm", "contribution"):
                arrays[f"{level}_{factor}_{scope}"] = combined[factor]
    codecs = {name: codec_for(name, values) for name, values in arrays.items()}
    codes = {name: quantise(values, codecs[name]) for name, values in arrays.items()}
    return LayerArrays(codes, codecs, cell, attention, groups)


PER_QUERY = {"output_norm_intra", "output_norm_inter"} | {f"{level}total_{scope}" for level in ("", "all_", "group_")
                                                          for scope in SCOPES}  # fmt: skip
"""Arrays indexed by query only (``[*head query]``); ``value_norm`` is by key, every other array by cell."""


def window_cells(arrays: LayerArrays, window: Window) -> np.ndarray:
    """The numbers (in ``arrays.cell``) of the window's displayable cells, row-major over (query, key)."""
    return arrays.cell[np.ix_(window.queries, window.keys)][window.mask]


def window_payload(arrays: LayerArrays, window: Window) -> dict[str, Any]:
    """The window's cells of `layer_arrays`, each array base64 in its codec (named in ``codecs``)."""
    ids, queries, keys = window_cells(arrays, window), np.asarray(window.queries), np.asarray(window.keys)
    out: dict[str, Any] = {}
    for name, codes in arrays.codes.items():
        cut = codes[:, keys] if name == "value_norm" else codes[..., queries] if name in PER_QUERY else codes[..., ids]
        data = np.ascontiguousarray(cut, dtype=_LITTLE_ENDIAN[CODECS[arrays.codecs[name]]["dtype"]])
        out[name] = base64.b64encode(data.tobytes()).decode("ascii")
    return {**out, "codecs": dict(arrays.codecs), "kv_groups": arrays.kv_groups}


def layer_payload(
    inter: Decomposition, intra: Decomposition, window: Window, *, index: int = 0, n_kv_heads: int | None = None
) -> dict[str, Any]:
    """What the page needs of one layer: each array of `ARRAYS` base64 in its codec, named in ``codecs``.

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
    return window_payload(layer_arrays(inter, intra, n_kv_heads, index=index), window)


def compute_payloads(
    model: adapter.Model, batch: adapter.TokenBatch, layers: Sequence[int], window: Window
) -> dict[int, dict[str, Any]]:
    """`layer_payload` of each layer, on the per-layer engine (the pass stops after the last of them)."""
    return {
        layer: by_window[window.key] for layer, by_window in compute_windows(model, batch, layers, [window]).items()
    }


def compute_windows(
    model: adapter.Model,
    batch: adapter.TokenBatch,
    layers: Sequence[int],
    windows: Sequence[Window],
    *,
    progress: bool = False,
    compact: bool = False,
) -> dict[int, dict[str, dict[str, Any]]]:
    """The payload of every layer for every window (by `Window.key`), all from one forward pass.

    Each layer is decomposed once, over the whole text; each window is then a cut of it, in
    the fine codecs (`window_payload`) or, with ``compact``, those of `compact_payload`.
    """
    wanted = list(layers)
    # leave=True: a closed bar shows its last frame, so a saved notebook does not keep its first one (0%).
    bar = tqdm(total=len(wanted), desc="inspector: layers", unit="layer", disable=not progress, leave=True)

    def per_layer(inputs: adapter.LayerInputs) -> dict[str, dict[str, Any]]:
        arrays = layer_arrays(inputs.decompose("inter"), inputs.decompose("intra"), n_kv_heads=inputs.v.shape[2])
        if compact:
            factors = unit_factors(inputs)
            out = {w.key: compact_payload(arrays, factors, w) for w in windows}
        else:
            out = {window.key: window_payload(arrays, window) for window in windows}
        bar.update()
        return out

    try:
        results = map_layers(model, batch, per_layer, layers=wanted)
    finally:
        bar.close()
    return dict(results.items())


def _decoded(payload: dict[str, Any], name: str) -> np.ndarray:
    codec = payload["codecs"][name]
    codes = np.frombuffer(base64.b64decode(payload[name]), dtype=_LITTLE_ENDIAN[CODECS[codec]["dtype"]])
    return dequantise(codes, codec)


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

    ``head`` -1 is all heads; with ``group_kv`` the head's KV group. Per head, relative norm
    and contribution are derived from the coded attention, cosines and exact norms (as
    ``inspector.js`` does); NaN marks cells the view does not draw (future keys, the hidden sink).

    Example:
        >>> import torch
        >>> from contribution_lens import decompose
        >>> future = torch.ones(3, 3, dtype=torch.bool).triu(1)
        >>> pattern = torch.softmax(torch.randn(1, 2, 3, 3).masked_fill(future, -torch.inf), -1)
        >>> v, W_O = torch.randn(1, 3, 1, 4), torch.randn(2, 4, 8)
        >>> both = [decompose(pattern, v, W_O, scope=s) for s in ("inter", "intra")]
        >>> grid = view_factors(layer_payload(*both, token_window(3)), token_window(3), head=-1, scope="inter")
        >>> bool(np.isnan(grid["attention"][0, 1])), round(float(np.nansum(grid["contribution"][2])), 2)
        (True, 1.0)
    """
    queries, keys, mask = np.asarray(window.queries), np.asarray(window.keys), window.mask
    query_of, key_of = np.nonzero(mask)
    groups = payload["kv_groups"]
    grouped = group_kv and head >= 0 and "group_attention" in payload
    if head < 0 or grouped:
        level, index = ("all", 0) if head < 0 else ("group", next(g for g, hs in enumerate(groups) if head in hs))
        take = (lambda x: x) if head < 0 else (lambda x: x.reshape(len(groups), -1)[index])
        cells = {"attention": take(_decoded(payload, f"{level}_attention"))}
        for factor in ("relative_norm", "cosine", "contribution"):
            cells[factor] = take(_decoded(payload, f"{level}_{factor}_{scope}"))
        totals = take(_decoded(payload, f"{level}_total_{scope}"))
    else:
        h = groups[next(g for g, hs in enumerate(groups) if head in hs)][0] if group_kv else head
        n_heads = len(_decoded(payload, "value_norm")) // len(keys)
        per_head = lambda name: _decoded(payload, name).reshape(n_heads, -1)[h]  # noqa: E731
        output = per_head("output_norm_intra") if scope == "intra" else _decoded(payload, "output_norm_inter")
        value_norm, out = per_head("value_norm")[key_of], output[query_of]
        cells = {"attention": per_head("attention"), "cosine": per_head(f"cosine_{scope}")}
        cells["relative_norm"] = np.divide(value_norm, out, out=np.zeros_like(out), where=out > 0)
        cells["contribution"] = cells["attention"] * cells["relative_norm"] * cells["cosine"]
        totals = per_head(f"total_{scope}")
    grids = {}
    for factor, values in cells.items():
        grid = np.full(mask.shape, np.nan)
        grid[mask] = values
        grids[factor] = grid
    if hide_sink and keys[0] == 0:
        # Attention rows total 1; contribution rows total the query's sum over every key (sent as totals).
        grids["attention"] = _hide_sink_grid(grids["attention"], np.ones(len(queries)))
        grids["contribution"] = _hide_sink_grid(grids["contribution"], totals)
    return grids


def _hide_sink_grid(grid: np.ndarray, totals: np.ndarray) -> np.ndarray:
    hidden = hide_sink(np.nan_to_num(grid), totals)
    return np.where(np.isnan(grid), np.nan, hidden)


def payload_bytes(window: Window, n_heads: int, n_kv_heads: int) -> int:
    """About how many bytes one layer's `window_payload` takes (base64 of the 2-byte codes per cell)."""
    levels = n_heads * 3 + 7 + (7 * n_kv_heads if n_kv_heads < n_heads else 0)
    return window.cells * levels * 2 * 4 // 3


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
    """What the page needs besides the layers' numbers: tokens, window, layers, KV groups, codecs, colour scales."""
    return {
        "queries": window.queries,
        "keys": window.keys,
        "query_labels": [labels[i] for i in window.queries],
        "key_labels": [labels[j] for j in window.keys],
        "causal": window.causal,
        "n_heads": n_heads,
        "kv_groups": kv_groups or [[h] for h in range(n_heads)],
        "n_tokens": len(labels),
        "layers": layers,
        "initial": initial,
        "key": window.key,
        "factors": list(FACTORS),
        "signed": [str(factor) for factor in Factor if factor.signed],
        "scopes": list(SCOPES),
        "codecs": {**CODECS, **COMPACT_CODECS} if compact else CODECS,
        "compact": compact,
        "colorscales": {"diverging": get_colorscale(DIVERGING), "sequential": get_colorscale(SEQUENTIAL)},
    }


# --- the compact codec of static pages ---------------------------------------------------------

COMPACT_CODECS: dict[str, dict[str, Any]] = {
    "attention8": {"kind": "linear", "dtype": "uint8", "levels": 255, "offset": 0},
    "vector8": {"kind": "int8", "dtype": "int8"},
    "exact": CODECS["exact"],
}
"""How a compact page codes its arrays (`compact_payload`); sent in ``meta.codecs`` beside `CODECS`."""
COMPACT_ATTENTION_ERROR = 0.5 / 255
"""``|a_hat - a|`` of a compact page (one byte per weight, linear)."""


def cosine_error_bound(query_scale: np.ndarray, key_scale: np.ndarray, d_head: int) -> np.ndarray:
    """The bound on ``|cos_hat - cos|`` of a compact page for unit-or-shorter vectors coded as ``round(x / s)``.

    Each coordinate is off by at most ``s / 2``, a vector by ``e = sqrt(d_head) s / 2``, so
    ``|q_hat . k_hat - q . k| <= e_q + e_k + e_q e_k`` (``|q| <= 1``, ``|k| = 1``).

    Example:
        >>> float(cosine_error_bound(np.array(0.5 / 127), np.array(0.5 / 127), 64)[()]) < 0.032
        True
    """
    e_q, e_k = np.sqrt(d_head) * np.asarray(query_scale) / 2, np.sqrt(d_head) * np.asarray(key_scale) / 2
    return np.asarray(e_q + e_k + e_q * e_k)


def _vectors8(vectors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int8 codes ``round(x / s)`` and float32 scales ``s = max |x| / 127`` of each vector (last axis)."""
    scale = (np.abs(vectors).max(-1) / 127).astype(np.float32)
    codes = np.rint(vectors / np.where(scale > 0, scale, 1)[..., None]).clip(-127, 127).astype(np.int8)
    return codes, scale


def unit_factors(inputs: adapter.LayerInputs, index: int = 0) -> dict[str, np.ndarray]:
    """Per head, unit vectors whose dot products are the cosines of both scopes, ``[head pos d_head]``.

    With ``W_O^h = U S V^T`` (SVD), ``vt_j^h = (v_j U S) V^T``: in the orthonormal basis ``V`` of
    the head's output space, key ``j`` is ``k_j = v_j U S`` (``||k_j|| = ||vt_j^h||``), the head's
    output ``o_i^h = (z_i U S) V^T``, and the layer output projects onto it as ``o_i V``. So
    ``cos(o_i^h, vt_j^h) = q_i^h . k_j/||k_j||`` with ``q_i^h = z_i U S / ||o_i^h||`` and
    ``cos(o_i, vt_j^h) = (o_i V / ||o_i||) . k_j/||k_j||``: ``d_head`` numbers per head and
    position instead of one per (query, key) pair.
    """
    W_O = inputs.W_O.to(torch.float32)
    n_heads, n_kv = W_O.shape[0], inputs.v.shape[2]
    U, S, Vt = torch.linalg.svd(W_O, full_matrices=False)  # [head d_head r], [head r], [head r d_model]
    US = U * S[:, None, :]
    v = inputs.v[index].to(torch.float32)  # [key kv_head d_head]
    v_heads = einops.repeat(v, "key kv_head d_head -> (kv_head group) key d_head", group=n_heads // n_kv)
    z = inputs.z[index].to(torch.float32) if inputs.z is not None else None
    if z is None:
        pattern = inputs.pattern[index].to(torch.float32)
        z = einops.rearrange(pattern @ v_heads, "head query d_head -> query head d_head")
    keys = einops.einsum(v_heads, US, "head key d_head, head d_head r -> head key r")
    intra = einops.einsum(z, US, "query head d_head, head d_head r -> head query r")
    output = einops.einsum(z, W_O, "query head d_head, head d_head d_model -> query d_model")
    inter = einops.einsum(output, Vt, "query d_model, head r d_model -> head query r")

    def unit(x: Tensor, norm: Tensor) -> np.ndarray:
        return (x / torch.where(norm > 0, norm, 1)[..., None]).numpy()

    return {
        "key": unit(keys, keys.norm(dim=-1)),
        "query_intra": unit(intra, intra.norm(dim=-1)),
        "query_inter": unit(inter, output.norm(dim=-1)[None]),
    }


def compact_payload(arrays: LayerArrays, factors: dict[str, np.ndarray], window: Window) -> dict[str, Any]:
    """A layer of a compact page: one zlib stream (base64) of attention in one byte, cosines as unit vectors.

    Holds, for the window: ``attention`` (``round(a * 255)``, ``|a_hat - a| <= 0.5/255``),
    the norms and contribution totals exact (float32), and per head and position the unit
    vectors of `unit_factors` in int8 with a float32 scale each (their cosines within
    `cosine_error_bound`). The page derives each cell's cosines, then every factor and the
    all-heads and KV-group numbers as `combine_cells` does. ``layout`` names each
    array's codec, byte offset and length in the inflated stream.
    """
    keys, queries = np.asarray(window.keys), np.asarray(window.queries)
    attention = arrays.attention[:, window_cells(arrays, window)]
    parts: dict[str, tuple[np.ndarray, str]] = {
        "attention": (np.rint(np.clip(attention, 0, 1) * 255).astype(np.uint8), "attention8"),
        "value_norm": (arrays.codes["value_norm"][:, keys], "exact"),
    }
    for name in ("output_norm_intra", "output_norm_inter", "total_inter", "total_intra"):
        parts[name] = (np.asarray(arrays.codes[name][..., queries], dtype=np.float32), "exact")
    for name, positions in (("key", keys), ("query_intra", queries), ("query_inter", queries)):
        codes, scale = _vectors8(factors[name][:, positions])
        parts[f"{name}_vectors"], parts[f"{name}_scales"] = (codes, "vector8"), (scale, "exact")
    layout, chunks, offset = {}, [], 0
    for name, (values, codec) in parts.items():
        data = np.ascontiguousarray(values, dtype=values.dtype.newbyteorder("<")).tobytes()
        layout[name] = [codec, offset, len(data)]
        chunks.append(data)
        offset += len(data) + (-len(data)) % 4  # float32 views need 4-byte alignment
        chunks.append(b"\0" * ((-len(data)) % 4))
    packed = base64.b64encode(zlib.compress(b"".join(chunks), 6)).decode("ascii")
    return {"packed": packed, "layout": layout, "d_head": int(factors["key"].shape[-1]), "kv_groups": arrays.kv_groups}


def unpack_compact(payload: dict[str, Any]) -> dict[str, np.ndarray]:
    """The arrays of a `compact_payload`, as the page reads them (codes, not yet numbers)."""
    data = zlib.decompress(base64.b64decode(payload["packed"]))
    dtypes = {"attention8": "<u1", "vector8": "<i1", "exact": "<f4"}
    return {
        name: np.frombuffer(data, dtype=dtypes[codec], count=length // np.dtype(dtypes[codec]).itemsize, offset=offset)
        for name, (codec, offset, length) in payload["layout"].items()
    }


def decode_compact(payload: dict[str, Any], window: Window) -> dict[str, np.ndarray]:
    """What the page computes from a `compact_payload`: per head ``attention`` and both cosines ``[head cell]``.

    The reference for ``inspector.js`` (the same formulas), and what the tests hold to the bounds.
    """
    raw = unpack_compact(payload)
    d_head = payload["d_head"]
    n_keys, n_queries = len(window.keys), len(window.queries)
    key = raw["key_vectors"].reshape(-1, n_keys, d_head) * raw["key_scales"].reshape(-1, n_keys, 1)
    out = {"attention": raw["attention"].reshape(key.shape[0], -1) / 255.0}
    for scope in SCOPES:
        query = raw[f"query_{scope}_vectors"].reshape(-1, n_queries, d_head)
        query = query * raw[f"query_{scope}_scales"].reshape(-1, n_queries, 1)
        full = np.einsum("hqr,hkr->hqk", query.astype(np.float64), key.astype(np.float64))
        out[f"cosine_{scope}"] = full[:, window.mask]
    return out


# --- the prediction view: explained next-token logits ----------------------------------------------

VIEWS = ("heatmap", "text", "prediction")
"""The inspector's views: the per-layer heatmap, the text coloured by it, and (with explained steps) the prediction."""


@dataclass(frozen=True, eq=False)
class Steps:
    """Explained next-token predictions of one text: one `LogitAttribution` a step, and its flow rollout if any.

    ``rollouts[k]`` is the last layer's row of step ``k``'s `contribution_lens.Flow` rollout
    (``[key]``: each input token's signed share of the position's residual stream), or None.
    """

    results: tuple[LogitAttribution, ...]
    rollouts: tuple[Tensor | None, ...]

    @classmethod
    def of(cls, explained: Any) -> "Steps | None":
        """The steps of a `GenerationExplanation`, a `LogitAttribution` or a sequence of them (one text); else None."""
        if isinstance(explained, GenerationExplanation):
            rollouts = tuple(None if s.flow is None else s.flow.rollout[-1] for s in explained)
            return cls(tuple(step.attribution for step in explained), rollouts)
        if isinstance(explained, LogitAttribution):
            return cls((explained,), (None,))
        if isinstance(explained, Sequence) and explained and all(isinstance(r, LogitAttribution) for r in explained):
            first = explained[0]
            if any(not torch.equal(r.tokens, first.tokens) for r in explained):
                raise ValueError("the logit attributions explain different texts: the inspector shows one text")
            return cls(tuple(explained), (None,) * len(explained))
        return None

    @property
    def tokens(self) -> Int[Tensor, " pos"]:
        return self.results[0].tokens

    @property
    def positions(self) -> list[int]:
        return [result.position for result in self.results]

    def check_model(self, model: adapter.Model, labels: list[str]) -> None:
        """Refuse steps another model made: the layer and head counts and the tokens' labels must match."""
        n_layers, n_heads = self.results[0].attention.shape[:2]
        mine = (adapter.n_layers(model), int(model.cfg.n_heads))
        if (n_layers, n_heads) != mine:
            raise ValueError(
                f"these predictions were explained on a model of {n_layers} layers and {n_heads} heads; "
                f"this one has {mine[0]} and {mine[1]}: inspect them with the model that made them"
            )
        theirs = [token_label(i, t) for i, t in enumerate(self.results[0].str_tokens)]
        if theirs != labels:
            raise ValueError(
                "these predictions' tokens read differently with this model's tokenizer: "
                "inspect them with the model that made them"
            )


def steps_payload(steps: Steps, labels: list[str]) -> dict[str, Any]:
    """What the prediction view draws of each step: the head and key terms, float32 (`CODECS` ``exact``).

    Per step ``k``: ``heads [layer head]``, the attention terms summed over keys
    (`LogitAttribution.by_head`), ``keys [position + 1]``, summed over layers and heads
    (`LogitAttribution.by_key`), ``rollout`` (the flow's last-layer shares, when there is one),
    the explained quantity and how the logit splits: ``parts`` (attention, MLPs, embedding,
    biases) add up to ``logit`` up to float rounding.

    Example:
        >>> import torch
        >>> from contribution_lens import LogitAttribution
        >>> r = LogitAttribution(tokens=torch.tensor([5, 6]), str_tokens=["a", "b"], position=1, target=7,
        ...     target_token="c", foil=None, foil_token=None, logit=1.5, attention=torch.full((2, 3, 2), 0.125),
        ...     attention_bias=torch.zeros(2), post_norm_bias=torch.zeros(2), mlp=torch.zeros(2), embed=0.0)
        >>> sent = steps_payload(Steps((r,), (None,)), ["0:a", "1:b"])["steps"][0]
        >>> sent["quantity"], sent["parts"]["attention"], len(base64.b64decode(sent["heads"])) // 4
        ("logit('c')", 1.5, 6)
    """
    n_layers, n_heads = steps.results[0].attention.shape[:2]
    sent = []
    for result, rollout in zip(steps.results, steps.rollouts, strict=True):
        biases = result.attention_bias.sum() + result.post_norm_bias.sum()
        parts = {
            "attention": float(result.attention.double().sum()),
            "mlp": float(result.mlp.double().sum()),
            "embedding": result.embed,
            "biases": float(biases) + result.final_norm_bias + result.unembed_bias,
        }
        sent.append(
            {
                "position": result.position,
                "token": result.target_token,
                "quantity": result.quantity,
                "logit": result.logit,
                "parts": parts,
                "heads": _b64(result.by_head().to_numpy(), "exact"),
                "keys": _b64(result.by_key().to_numpy(), "exact"),
                "rollout": None if rollout is None else _b64(rollout[: result.visible].cpu().numpy(), "exact"),
            }
        )
    return {"labels": labels, "n_layers": int(n_layers), "n_heads": int(n_heads), "steps": sent}
