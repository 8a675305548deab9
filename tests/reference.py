"""Slow float64 oracle: materialises every weighted projected value ``alpha_ij^h vt_j^h``.

Deliberately the naive way, with plain loops over heads; the package must agree with it.
"""

import torch
import torch.nn.functional as F


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


# --- ports of the authors' formulas (float64, batch of one, every vector materialised) -------


def _l_transform(x: torch.Tensor, w_ln: torch.Tensor) -> torch.Tensor:
    """ALTI's linear part of a LayerNorm, as a matrix product: centring, then the Hadamard gamma."""
    d = w_ln.size(0)
    mean_transf = torch.eye(d, dtype=x.dtype) - torch.ones(d, d, dtype=x.dtype) / d
    return torch.einsum("... e, e f, f g -> ... g", x, mean_transf, torch.diag(w_ln))


def authors_alti(
    hidden_states: torch.Tensor,
    attention_probs: torch.Tensor,
    value_layer: torch.Tensor,
    dense_weight: torch.Tensor,
    dense_bias: torch.Tensor | None,
    *,
    ln: tuple[torch.Tensor, torch.Tensor | None, float] | None = None,
    pre_ln_states: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ALTI of one layer as mt-upc/transformer-contributions computes it (``get_contributions``, ``min_sum``).

    Args, as the authors' names: ``hidden_states`` ``[1, seq, d]`` (the layer's input),
    ``attention_probs`` ``[1, heads, seq, seq]``, ``value_layer`` ``[1, heads, seq, head_size]``
    (the value projection's output, ``b_V`` included), ``dense_weight`` the o-projection's
    ``nn.Linear`` weight ``[d, heads * head_size]``; ``ln`` (weight, bias, eps) of LayerNorm 1 and
    ``pre_ln_states`` (its input) for the post-LN form, None for ``pre_layer_norm``.

    Returns the normalised contributions ``[seq, seq]`` and the resultant ``[seq, d]``.
    """
    f64 = torch.float64
    x, probs, values = hidden_states.to(f64), attention_probs.to(f64), value_layer.to(f64)
    n_heads, head_size = values.shape[1], values.shape[-1]
    dense = dense_weight.to(f64).view(dense_weight.shape[0], n_heads, head_size)
    transformed_layer = torch.einsum("bhsv,dhv->bhsd", values, dense)
    weighted_layer = torch.einsum("bhks,bhsd->bhksd", probs, transformed_layer)
    summed_weighted_layer = weighted_layer.sum(dim=1)
    residual = torch.einsum("sk,bsd->bskd", torch.eye(x.shape[1], dtype=f64), x)
    residual_weighted_layer = summed_weighted_layer + residual
    bias = torch.zeros(x.shape[-1], dtype=f64) if dense_bias is None else dense_bias.to(f64)
    if ln is None:
        transformed_vectors_std = residual_weighted_layer
        resultant = transformed_vectors_std.sum(dim=2) + bias
    else:
        assert pre_ln_states is not None
        ln_weight, ln_bias, ln_eps = ln[0].to(f64), ln[1], ln[2]
        attn_output = _l_transform(residual_weighted_layer, ln_weight).sum(dim=2)
        dense_bias_term = _l_transform(bias, ln_weight)
        # As in their code: std of (pre_ln_states + eps), population form.
        ln_std_coef = 1 / (pre_ln_states.to(f64) + ln_eps).std(-1, unbiased=False).view(1, -1, 1)
        resultant = (attn_output + dense_bias_term) * ln_std_coef + (0 if ln_bias is None else ln_bias.to(f64))
        transformed_vectors_std = _l_transform(residual_weighted_layer, ln_weight) * ln_std_coef.unsqueeze(-1)
    importance = -F.pairwise_distance(transformed_vectors_std, resultant.unsqueeze(2), p=1)
    resultant_norm = torch.norm(resultant, p=1, dim=-1)
    normalised = (importance + resultant_norm.unsqueeze(-1).abs()).clip(min=0)
    return (normalised / normalised.sum(dim=-1, keepdim=True))[0], resultant[0]


def kobayashi_norms(
    attention_probs: torch.Tensor, value_layer: torch.Tensor, dense_weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Kobayashi et al.'s (2020) ``||alpha f(x)||`` per head and ``||sum_h alpha f(x)||``, float64.

    The formula of their ``BertNormOutput``: ``f(x) = value_layer @ W_O^h`` (the value projection's
    output, ``b_V`` included, through the head's slice of the o-projection weight ``[d, heads *
    head_size]``; ``b_O`` left out), ``alpha f(x)`` per head, then summed over heads. Returns
    ``[batch head query key]`` and ``[batch query key]``.
    """
    f64 = torch.float64
    probs, values = attention_probs.to(f64), value_layer.to(f64)
    n_heads, head_size = values.shape[1], values.shape[-1]
    dense = dense_weight.to(f64).view(dense_weight.shape[0], n_heads, head_size).permute(1, 2, 0)
    transformed = torch.einsum("bhsv,hvd->bhsd", values, dense)
    weighted = torch.einsum("bhks,bhsd->bhksd", probs, transformed)
    return weighted.norm(dim=-1), weighted.sum(dim=1).norm(dim=-1)
