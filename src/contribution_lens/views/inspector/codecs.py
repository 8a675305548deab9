"""How the inspector writes numbers for the page, and how the page reads them back (the fine codecs).

* attention ``a`` in ``[0, 1]``: code ``round(sqrt(a) * 65535)`` (uint16), read back as
  ``(code / 65535)^2``, so ``|a_hat - a| <= 2 sqrt(a) d + d^2`` with ``d = 0.5 / 65535``: at most
  1.53e-5, relatively finer for small weights;
* a cosine ``c`` in ``[-1, 1]``: code ``round(c * 32767) + 32767`` (uint16), read back as
  ``(code - 32767) / 32767``: ``|c_hat - c| <= 0.5 / 32767`` = 1.53e-5, 0 exact;
* ``half``: float16, ``|x_hat - x| <= 2^-11 |x|`` (finer than the 4 digits shown);
* ``exact``: float32.

A compact page (`contribution_lens.views.inspector.compact`) adds attention in one byte
(``round(a * 255)``, ``|a_hat - a| <= 0.5 / 255``) and int8 vectors (`COMPACT_CODECS`).

Every array travels as base64 of its little-endian codes, with the codec's name beside it; the
specs (`CODECS`) travel in the page's ``meta``, so ``inspector.js`` holds no constant of its own
(its ``dequantise`` is pinned to `dequantise` by the golden test).
"""

import base64
from typing import Any

import numpy as np
import torch

ATTENTION_CODES = 65535
COSINE_CODES = 32767

CODECS: dict[str, dict[str, Any]] = {
    "attention": {"kind": "sqrt", "dtype": "uint16", "levels": ATTENTION_CODES},
    "cosine": {"kind": "linear", "dtype": "uint16", "levels": COSINE_CODES, "offset": COSINE_CODES},
    "exact": {"kind": "float32", "dtype": "float32"},
    "half": {"kind": "float16", "dtype": "float16"},
}
"""How the page turns each payload array back into numbers (`dequantise`), sent in ``meta``."""
HALF_MAX = float(np.finfo(np.float16).max)
"""The largest float16: a ``half`` array holding a larger value is sent ``exact`` instead."""
COMPACT_CODECS: dict[str, dict[str, Any]] = {
    "attention8": {"kind": "linear", "dtype": "uint8", "levels": 255, "offset": 0},
    "vector8": {"kind": "int8", "dtype": "int8"},
    "exact": CODECS["exact"],
}
"""How a compact page codes its arrays (`contribution_lens.views.inspector.compact.compact_payload`); sent in
``meta.codecs`` beside `CODECS`."""
COMPACT_ATTENTION_ERROR = 0.5 / 255
"""``|a_hat - a|`` of a compact page (one byte per weight, linear)."""
LITTLE_ENDIAN = {"uint8": "<u1", "int8": "<i1", "uint16": "<u2", "float16": "<f2", "float32": "<f4"}
"""The byte layout of each codec dtype on the wire (the page reads little-endian typed arrays)."""


def quantise(values: np.ndarray, codec: str) -> np.ndarray:
    """``values`` in the codec's numbers (`CODECS`); torch does the arithmetic (NumPy's float16 cast is slow).

    Example:
        >>> quantise(np.array([0.0, 0.25, 1.0]), "attention").tolist()
        [0, 32768, 65535]
    """
    spec = CODECS[codec]
    # Copied only where read-only (a pandas column's array) or not contiguous: torch cannot wrap those.
    x = torch.from_numpy(np.require(values, requirements=("C", "W")))
    if spec["kind"] == "sqrt":
        codes = x.to(torch.float32).clamp(0.0, 1.0).sqrt_().mul_(spec["levels"]).round_()
        return codes.to(torch.int32).numpy().astype(np.uint16)
    if spec["kind"] == "linear":
        codes = x.to(torch.float32).clamp(-1.0, 1.0).mul_(spec["levels"]).round_().add_(spec["offset"])
        return codes.to(torch.int32).numpy().astype(np.uint16)
    return x.to(torch.float16 if spec["kind"] == "float16" else torch.float32).numpy()


def dequantise(codes: np.ndarray, codec: str) -> np.ndarray:
    """What the page computes from the codes: the inverse of `quantise` up to its rounding, in float64.

    ``sqrt``: ``(code / L)^2``; ``linear``: ``(code - offset) / L`` (``L`` the codec's levels);
    float codecs: the values themselves.

    Example:
        >>> dequantise(np.array([0, 32767, 65534]), "cosine").tolist()
        [-1.0, 0.0, 1.0]
    """
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
    """Attention weights ``(code / 65535)^2`` of `quantise_attention`'s codes."""
    return dequantise(codes, "attention")


def dequantise_cosine(codes: np.ndarray) -> np.ndarray:
    """Cosines ``(code - 32767) / 32767`` of `quantise_cosine`'s codes."""
    return dequantise(codes, "cosine")


def to_base64(codes: np.ndarray, codec: str) -> str:
    """Codes already in ``codec``'s numbers as base64 of their little-endian bytes (what a payload holds)."""
    data = np.ascontiguousarray(codes, dtype=LITTLE_ENDIAN[CODECS[codec]["dtype"]])
    return base64.b64encode(data.tobytes()).decode("ascii")


def encode(values: np.ndarray, codec: str) -> str:
    """``values`` quantised in ``codec`` and written as base64 (`to_base64`).

    Example:
        >>> decode(encode(np.array([0.5, -0.25]), "exact"), "exact").tolist()
        [0.5, -0.25]
    """
    return to_base64(quantise(values, codec), codec)


def decode(text: str, codec: str) -> np.ndarray:
    """The numbers the page reads from one base64 array written in ``codec`` (`dequantise` of its codes)."""
    codes = np.frombuffer(base64.b64decode(text), dtype=LITTLE_ENDIAN[CODECS[codec]["dtype"]])
    return dequantise(codes, codec)
