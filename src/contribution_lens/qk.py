"""Attention scores split exactly over the residual stream's components: the maths on tensors.

Layer ``l``, head ``h``, query ``i``, key ``j``. The pre-softmax score is ``s_ij = scale <q_i, k_j>``.
The residual stream entering layer ``l`` is a sum of components, ``x = sum_c x^c`` (the embedding,
every earlier head's output ``z^h W_O^h``, every earlier MLP's output, the biases). Every map from
``x`` to ``q`` and ``k`` is linear once the norms' scales are frozen at their values in this pass:
a norm ``N(x) = P(x) g / s + b`` (``P`` centres for LayerNorm and is the identity for RMSNorm, ``g``
the gain, ``s`` the scale at that position, ``b`` the bias), the projection ``W_Q``, a per-head q/k
norm (the same form on ``d_head``), and the rotary embedding ``R_i`` (a rotation of each query and
key by its position). So ``q_i = sum_a q_i^a`` and ``k_j = sum_b k_j^b``, the biases (``b_Q``, a
norm's ``b``) being components of their own, and

    s_ij = scale * sum_a sum_b <q_i^a, k_j^b>                                  exactly
    key side    K_ij^b = scale <q_i, k_j^b>       query side    Q_ij^a = scale <q_i^a, k_j>

each summing over its components to ``s_ij``. Softmax ignores what is common to every key of a
query, so what explains the pattern ``alpha_i = softmax(s_i)`` is the **advantage**

    A_ij^b = K_ij^b - sum_k alpha_ik K_ik^b,        sum_b A_ij^b = log alpha_ij + H(alpha_i)

with ``H(alpha_i) = -sum_k alpha_ik log alpha_ik`` the entropy of the row (the same on the query
side). Here ``scale`` is folded into the query parts, so every function takes scaled queries.

Nothing here knows TransformerLens: `contribution_lens.adapter` reads the weights and hooks.

    >>> import torch
    >>> query_parts = torch.randn(3, 2, 4, dtype=torch.float64)  # [component query d_head]
    >>> key_parts = torch.randn(5, 6, 4, dtype=torch.float64)  # [component key d_head]
    >>> q, k = query_parts.sum(0), key_parts.sum(0)
    >>> terms = key_side(q, key_parts)  # [query component key]
    >>> torch.allclose(terms.sum(1), q @ k.T)
    True
    >>> visible = torch.ones(2, 6, dtype=torch.bool)
    >>> alpha = torch.softmax(q @ k.T, -1)
    >>> torch.allclose(advantage(terms, alpha, visible).sum(1), log_alpha_plus_entropy(alpha, visible))
    True
"""

import re

import einops
import torch
from jaxtyping import Bool, Float
from torch import Tensor


def pull_back(
    read: Float[Tensor, "d_model n"], gain: Float[Tensor, " d_model"] | None, centre: bool
) -> Float[Tensor, "d_model n"]:
    """The read matrix ``r`` seen through a norm with frozen scale, up to ``1 / s``: ``P(g * r)``.

    ``<N(x), r> = <P(x) g / s + b, r> = <x, P(g r)> / s + <b, r>``: ``P`` (centring over
    ``d_model``) is its own adjoint. ``gain`` None: a norm without a weight.
    """
    if gain is not None:
        read = read * gain.to(read.dtype)[:, None]
    if centre:
        read = read - read.mean(0, keepdim=True)
    return read


def project_heads(
    z: Float[Tensor, "pos head d_head"],
    W_O: Float[Tensor, "head d_head d_model"],
    read: Float[Tensor, "d_model n"],
) -> Float[Tensor, "head pos n"]:
    """``(z^h W_O^h) r`` for every head ``h`` without forming ``z^h W_O^h``: ``z^h (W_O^h r)``."""
    through = einops.einsum(W_O.to(read.dtype), read, "head d_head d_model, d_model n -> head d_head n")
    return einops.einsum(z.to(read.dtype), through, "pos head d_head, head d_head n -> head pos n")


def rotate(
    x: Float[Tensor, "*batch d_head"],
    cos: Float[Tensor, "*angles rotary"],
    sin: Float[Tensor, "*angles rotary"],
    *,
    adjacent: bool = False,
) -> Float[Tensor, "*batch d_head"]:
    """The rotary embedding of ``x``: ``x cos + rotate_half(x) sin`` on the first ``rotary`` dims.

    ``cos``/``sin`` broadcast against ``x[..., :rotary]`` (one angle set per position: give them the
    position axis where ``x`` has it). Dimension ``d`` turns with its partner: ``d + rotary / 2``
    (the halves layout of Llama and GPT-NeoX, ``rotate_half(x) = (-x_2, x_1)``) or, with
    ``adjacent``, ``d + 1`` (pairs ``(0, 1), (2, 3), ...``, TransformerLens's native layout). Dims past
    ``rotary`` (partial rotary) pass unchanged. Linear in ``x``, so it applies to every component
    alone; ``-sin`` undoes it.
    """
    width = cos.shape[-1]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    out = x.clone() if width < x.shape[-1] else torch.empty_like(x)
    half = width // 2
    to_first, to_second = (slice(0, width, 2), slice(1, width, 2)) if adjacent else (slice(0, half), slice(half, width))
    first, second = x[..., to_first], x[..., to_second]
    # Written half by half into one output: the parts tensors are large, so no full-size temporaries.
    torch.mul(first, cos[..., to_first], out=out[..., to_first])
    out[..., to_first].addcmul_(second, sin[..., to_first], value=-1.0)
    torch.mul(second, cos[..., to_second], out=out[..., to_second])
    out[..., to_second].addcmul_(first, sin[..., to_second])
    return out


def key_side(
    query: Float[Tensor, "query d_head"], key_parts: Float[Tensor, "component key d_head"]
) -> Float[Tensor, "query component key"]:
    """``K_ij^b = <q_i, k_j^b>`` (``q`` scaled): summed over components, the score ``s_ij``."""
    return einops.einsum(query, key_parts, "query d_head, component key d_head -> query component key")


def query_side(
    query_parts: Float[Tensor, "component query d_head"], key: Float[Tensor, "key d_head"]
) -> Float[Tensor, "query component key"]:
    """``Q_ij^a = <q_i^a, k_j>`` (``q^a`` scaled): summed over components, the score ``s_ij``."""
    return einops.einsum(query_parts, key, "component query d_head, key d_head -> query component key")


def pair_terms(
    query_parts: Float[Tensor, "q_component d_head"], key_parts: Float[Tensor, "k_component d_head"]
) -> Float[Tensor, "q_component k_component"]:
    """``<q_i^a, k_j^b>`` for every pair of components of one query and one key: summed, ``s_ij``."""
    return einops.einsum(query_parts, key_parts, "q_component d_head, k_component d_head -> q_component k_component")


def advantage(
    terms: Float[Tensor, "query component key"],
    alpha: Float[Tensor, "query key"],
    visible: Bool[Tensor, "query key"],
) -> Float[Tensor, "query component key"]:
    """``A_ij^c = T_ij^c - sum_k alpha_ik T_ik^c`` over the keys query ``i`` sees (0 at the others).

    Summed over components: ``s_ij - sum_k alpha_ik s_ik = log alpha_ij + H(alpha_i)`` where
    ``alpha = softmax(s)``.
    """
    kept = torch.where(visible[:, None, :], terms, torch.zeros((), dtype=terms.dtype, device=terms.device))
    mean = einops.einsum(kept, alpha.to(terms.dtype), "query component key, query key -> query component")
    return torch.where(visible[:, None, :], kept - mean[..., None], torch.zeros((), dtype=terms.dtype))


def log_alpha_plus_entropy(
    alpha: Float[Tensor, "query key"], visible: Bool[Tensor, "query key"]
) -> Float[Tensor, "query key"]:
    """``log alpha_ij + H(alpha_i)``, what the advantages of a key add up to (0 where the key is not seen).

    A visible key whose weight underflowed to 0 gets ``-inf``, as its log does.
    """
    alpha = alpha.to(torch.float64)
    logs = torch.where(alpha > 0, alpha.log(), torch.full((), -torch.inf, dtype=alpha.dtype))
    entropy = -torch.where(alpha > 0, alpha * logs, torch.zeros((), dtype=alpha.dtype)).sum(-1, keepdim=True)
    return torch.where(visible, logs + entropy, torch.zeros((), dtype=alpha.dtype))


def softcapped(scores: Tensor, cap: float | None) -> Tensor:
    """``cap * tanh(s / cap)`` (Gemma 2's attention soft-cap), or ``s`` where there is no cap."""
    return scores if cap is None else cap * torch.tanh(scores / cap)


def relative_gap(actual: Tensor, expected: Tensor, where: Tensor) -> float:
    """``max |actual - expected| / max |expected|`` over the entries ``where`` marks (float64)."""
    if not bool(where.any()):
        return 0.0
    actual, expected = actual.to(torch.float64)[where], expected.to(torch.float64)[where]
    return float((actual - expected).abs().max()) / max(float(expected.abs().max()), 1e-30)


_COMPONENT = re.compile(r"^L(\d+)(?:H(\d+))?")


def component_layer_head(name: str) -> tuple[int | None, int | None]:
    """The layer and head in a component's name: ``"L3H2"`` -> (3, 2), ``"L3.mlp"`` -> (3, None), else None."""
    match = _COMPONENT.match(name)
    if match is None:
        return None, None
    return int(match.group(1)), None if match.group(2) is None else int(match.group(2))
