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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from jaxtyping import Float
from plotly.colors import get_colorscale
from torch import Tensor

from contribution_lens import adapter
from contribution_lens.choices import FACTORS, SCOPES, Factor, Scope
from contribution_lens.decomposition import Decomposition
from contribution_lens.engine import map_layers
from contribution_lens.views.plot import DIVERGING, SEQUENTIAL

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
}  # fmt: skip
"""Each array of a layer's payload and the codec it is written in (where its values fit)."""
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


def token_label(position: int, token: str) -> str:
    """``"{position}:{token}"`` with line breaks and tabs shown as ``\\n``, ``\\r``, ``\\t``.

    Example:
        >>> token_label(3, "\\n")
        '3:\\\\n'
    """
    return f"{position}:" + token.replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")


def quantise(values: np.ndarray, codec: str) -> np.ndarray:
    """``values`` in the codec's numbers (`CODECS`)."""
    spec = CODECS[codec]
    if spec["kind"] == "sqrt":
        return np.rint(np.sqrt(np.clip(values, 0.0, 1.0)) * spec["levels"]).astype(np.uint16)
    if spec["kind"] == "linear":
        return (np.rint(np.clip(values, -1.0, 1.0) * spec["levels"]) + spec["offset"]).astype(np.uint16)
    return np.asarray(values, dtype=np.float16 if spec["kind"] == "float16" else np.float32)


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


def layer_payload(inter: Decomposition, intra: Decomposition, window: Window, *, index: int = 0) -> dict[str, Any]:
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
    if inter.scope != Scope.INTER or intra.scope != Scope.INTRA:
        raise ValueError(
            f"layer_payload takes the inter then the intra decomposition, got {inter.scope}, {intra.scope}"
        )
    keys, queries = torch.tensor(window.keys), torch.tensor(window.queries)
    arrays = {
        "attention": _cut(inter.attention[index], window),
        "cosine_inter": _cut(inter.cosine[index], window),
        "cosine_intra": _cut(intra.cosine[index], window),
        "value_norm": inter.value_norm[index][:, keys].float().cpu().numpy(),
        "output_norm_intra": intra.output_norm[index][:, queries].float().cpu().numpy(),
        "output_norm_inter": inter.output_norm[index][0, queries].float().cpu().numpy(),
    }
    for scope, d in (("inter", inter), ("intra", intra)):
        combined = d.token_factors()
        if scope == "inter":
            arrays["all_attention"] = _cut(combined["attention"][index], window)
        for factor in ("cosine", "relative_norm", "contribution"):
            arrays[f"all_{factor}_{scope}"] = _cut(combined[factor][index], window)
    codecs = {name: codec_for(name, values) for name, values in arrays.items()}
    return {**{name: _b64(values, codecs[name]) for name, values in arrays.items()}, "codecs": codecs}


def compute_payloads(
    model: adapter.Model, batch: adapter.TokenBatch, layers: Sequence[int], window: Window
) -> dict[int, dict[str, Any]]:
    """`layer_payload` of each layer, on the per-layer engine (the pass stops after the last of them)."""
    results = map_layers(
        model, batch, lambda inputs: layer_payload(inputs.decompose("inter"), inputs.decompose("intra"), window),
        layers=list(layers),
    )  # fmt: skip
    return dict(results.items())


def meta(labels: list[str], window: Window, layers: list[int], n_heads: int, initial: dict) -> dict[str, Any]:
    """What the page needs besides the layers' numbers: tokens, window, layers, codecs, colour scales."""
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
        "key": window.key,
        "factors": list(FACTORS),
        "signed": [str(factor) for factor in Factor if factor.signed],
        "scopes": list(SCOPES),
        "codecs": CODECS,
        "colorscales": {"diverging": get_colorscale(DIVERGING), "sequential": get_colorscale(SEQUENTIAL)},
    }
