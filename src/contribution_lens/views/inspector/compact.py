"""The compact codec of large static pages: attention in one byte, cosines as int8 unit vectors.

A fine page sends every (query, key) cell's cosines; a compact one sends, per head and position,
``d_head`` numbers whose dot products are those cosines (`unit_factors`), in int8 with a float32
scale each, and attention as ``round(a * 255)``. The page (``decodeCompact`` in
``inspector.js``) rebuilds each cell's cosines, every factor and the all-heads and KV-group
numbers; `decode_compact` is its reference, pinned to it by the golden test.
"""

import base64
import zlib
from typing import Any

import einops
import numpy as np
import torch
from torch import Tensor

from contribution_lens import adapter
from contribution_lens.choices import SCOPES
from contribution_lens.views.inspector.payload import LayerArrays
from contribution_lens.views.inspector.windows import Window


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


def vectors8(vectors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int8 codes ``round(x / s)`` and float32 scales ``s = max |x| / 127`` of each vector (last axis).

    Example:
        >>> codes, scale = vectors8(np.array([[0.5, -1.0]]))
        >>> codes.tolist(), scale.tolist()
        ([[64, -127]], [0.007874015718698502])
    """
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

    ``arrays`` are the window's (`contribution_lens.views.inspector.payload.window_arrays`), ``factors``
    the layer's `unit_factors` at every position.

    Holds, for the window: ``attention`` (``round(a * 255)``, ``|a_hat - a| <= 0.5/255``),
    the norms, contribution totals and shares outside the window exact (float32), and per head and position the unit
    vectors of `unit_factors` in int8 with a float32 scale each (their cosines within
    `cosine_error_bound`). The page derives each cell's cosines, then every factor and the
    all-heads and KV-group numbers as `contribution_lens.views.inspector.payload.combine_cells`
    does. ``layout`` names each array's codec, byte offset and length in the inflated stream.
    """
    keys, queries = np.asarray(window.keys), np.asarray(window.queries)
    parts: dict[str, tuple[np.ndarray, str]] = {
        "attention": (np.rint(np.clip(arrays.attention, 0, 1) * 255).astype(np.uint8), "attention8"),
        "value_norm": (arrays.codes["value_norm"], "exact"),
    }
    for name in ("output_norm_intra", "output_norm_inter", "total_inter", "total_intra"):
        parts[name] = (np.asarray(arrays.codes[name], dtype=np.float32), "exact")
    for name, values in arrays.outside.items():
        parts[name] = (values, "exact")
    for name, positions in (("key", keys), ("query_intra", queries), ("query_inter", queries)):
        codes, scale = vectors8(factors[name][:, positions])
        parts[f"{name}_vectors"], parts[f"{name}_scales"] = (codes, "vector8"), (scale, "exact")
    layout, chunks, offset = {}, [], 0
    for name, (values, codec) in parts.items():
        data = np.ascontiguousarray(values, dtype=values.dtype.newbyteorder("<")).tobytes()
        layout[name] = [codec, offset, len(data)]
        padding = (-len(data)) % 4  # float32 views need 4-byte alignment
        chunks += [data, b"\0" * padding]
        offset += len(data) + padding
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

    ``a = code / 255``; ``cos_ij = (s_i q_i) . (s_j k_j)`` with ``q``, ``k`` the int8 unit vectors
    of query ``i`` (in the scope) and key ``j`` and ``s`` their scales. The reference for
    ``inspector.js`` (``decodeCompact``, the same formulas), and what the tests hold to the bounds.
    """
    raw = unpack_compact(payload)
    d_head = payload["d_head"]
    n_keys, n_queries = len(window.keys), len(window.queries)
    # float64 throughout, as the page computes: the int8 dot products are exact, then scaled.
    key = raw["key_vectors"].astype(np.float64).reshape(-1, n_keys, d_head)
    out = {"attention": raw["attention"].reshape(key.shape[0], -1) / 255.0}
    for scope in SCOPES:
        query = raw[f"query_{scope}_vectors"].astype(np.float64).reshape(-1, n_queries, d_head)
        query_scale = raw[f"query_{scope}_scales"].astype(np.float64).reshape(-1, n_queries, 1)
        key_scale = raw["key_scales"].astype(np.float64).reshape(-1, 1, n_keys)
        cosine = np.einsum("hqr,hkr->hqk", query, key) * query_scale * key_scale
        out[f"cosine_{scope}"] = cosine[:, window.mask]
    return out
