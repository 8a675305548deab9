"""Slow float64 oracle: materialises every weighted projected value ``alpha_ij^h vt_j^h``.

Deliberately the naive way, with plain loops over heads; the package must agree with it.
"""

import torch


def reference_contributions(
    pattern: torch.Tensor,
    v: torch.Tensor,
    W_O: torch.Tensor,
    scope: str,
    dtype: torch.dtype = torch.float64,
    *,
    causal: bool = True,
) -> dict[str, torch.Tensor]:
    pattern, v, W_O = pattern.to(dtype), v.to(dtype), W_O.to(dtype)
    _, n_heads, n_query, n_key = pattern.shape
    group = n_heads // v.shape[2]
    # vt[b, h, k, m] = v[b, k, h // group] @ W_O[h]
    vt = torch.stack([v[:, :, h // group, :] @ W_O[h] for h in range(n_heads)], dim=1)
    weighted = pattern[..., None] * vt[:, :, None, :, :]  # [b h q k m]: the thing never to build
    head_out = weighted.sum(3)  # [b h q m]
    if scope == "intra":
        out = head_out
    else:
        out = head_out.sum(1, keepdim=True).expand_as(head_out)
    out_norm = out.norm(dim=-1)  # [b h q]
    dots = (out[:, :, :, None, :] * weighted).sum(-1)  # <o, alpha vt>
    contribution = dots / out_norm[..., None] ** 2
    value_norm = vt.norm(dim=-1)  # [b h k]
    cos = (out[:, :, :, None, :] * vt[:, :, None, :, :]).sum(-1) / (out_norm[..., None] * value_norm[:, :, None, :])
    visible = torch.ones(n_query, n_key, dtype=torch.bool)
    causal = visible.tril() if causal else visible
    return {
        "contribution": contribution * causal,
        "cosine": cos * causal,
        "relative_norm": value_norm[:, :, None, :] / out_norm[..., None] * causal,
        "value_norm": value_norm,
        "output_norm": out_norm,
        "layer_output": head_out.sum(1),
    }
