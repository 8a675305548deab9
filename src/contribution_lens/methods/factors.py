"""The measures built from the factors of one layer's `Decomposition`.

``attention``, ``value_weighted``, ``output_normalized`` and ``contribution``.

Notation as in `contribution_lens.decomposition`:

* ``attention``: ``alpha_ij^h``;
* ``value_weighted``: ``alpha_ij^h ||vt_j^h||``, the per-head norm-based measure of Kobayashi
  et al. (2020), ``||alpha_ij^h f^h(x_j)||``. Summed over heads for a token-level ranking it is
  ``sum_h alpha_ij^h ||vt_j^h||``, not their layer-level ``||sum_h alpha_ij^h vt_j^h||``, which is
  the ``kobayashi`` method (`contribution_lens.methods.kobayashi`);
* ``output_normalized``: ``alpha_ij^h ||vt_j^h|| / ||o||``. Under the inter scope ``||o|| = ||o_i||``
  is one number per query, shared by every (head, key), so it ranks the keys of a query exactly
  as ``value_weighted`` does; only the intra scope (``||o_i^h||`` per head) tells them apart;
* ``contribution``: ``c_ij^h = alpha_ij^h (||vt_j^h|| / ||o||) cos(o, vt_j^h)``.

Example:
    >>> import torch
    >>> pattern = torch.softmax(torch.randn(1, 2, 3, 3), -1)
    >>> importance(pattern, torch.randn(1, 3, 2, 4), torch.randn(2, 4, 8), method="value_weighted").shape
    torch.Size([1, 2, 3, 3])
"""

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from contribution_lens.decomposition import MEASURES, Decomposition, Scope, decompose
from contribution_lens.methods.method import Method
from contribution_lens.methods.registry import available_methods, get_method


def attention(d: Decomposition) -> Float[Tensor, "batch head query key"]:
    """``alpha_ij^h``."""
    return d.attention


def value_weighted(d: Decomposition) -> Float[Tensor, "batch head query key"]:
    """``alpha_ij^h ||vt_j^h||``."""
    return d.value_weighted


def output_normalized(d: Decomposition) -> Float[Tensor, "batch head query key"]:
    """``alpha_ij^h ||vt_j^h|| / ||o||``."""
    return d.output_normalized


def contribution(d: Decomposition) -> Float[Tensor, "batch head query key"]:
    """``c_ij^h``."""
    return d.contribution


METHODS: tuple[Method, ...] = (
    Method.from_decomposition(
        "attention", attention, "attention weight alpha", label=MEASURES["attention"], default=True, builtin=True
    ),
    Method.from_decomposition(
        "value_weighted",
        value_weighted,
        "alpha ||vt||: Kobayashi et al.'s per-head norm (summed over heads at token level)",
        label=MEASURES["value_weighted"],
        default=True,
        builtin=True,
    ),
    Method.from_decomposition(
        "output_normalized",
        output_normalized,
        "alpha ||vt|| / ||o||",
        label=MEASURES["output_normalized"],
        default=True,
        builtin=True,
    ),
    Method.from_decomposition(
        "contribution",
        contribution,
        "contribution weight c = alpha (||vt|| / ||o||) cos(o, vt)",
        signed=True,
        label=MEASURES["contribution"],
        default=True,
        builtin=True,
    ),
)


def importance(
    pattern: Float[Tensor, "batch head query key"],
    v: Float[Tensor, "batch key kv_head d_head"],
    W_O: Float[Tensor, "head d_head d_model"],
    *,
    method: str,
    scope: Scope | str = Scope.INTER,
    attention_mask: Bool[Tensor, "batch key"] | None = None,
    causal: bool | None = None,
    dtype: torch.dtype | str | None = None,
) -> Float[Tensor, "batch head query key"]:
    """Per-head token importance of a registered method that needs only one layer's decomposition.

    ``attention``, ``value_weighted``, ``output_normalized`` and ``contribution`` (see the module
    docstring), or a user's method made with `Method.from_decomposition`. Measures that need more
    than the pattern, values and ``W_O`` (gradients, the residual stream) are scored on a model
    with `contribution_lens.map_layers`.
    """
    usable = [name for name in available_methods() if get_method(name).decomposition_score is not None]
    if method not in usable:
        raise ValueError(f"unknown method {method!r} for importance(); expected one of {', '.join(usable)}")
    d = decompose(pattern, v, W_O, scope=scope, attention_mask=attention_mask, causal=causal, dtype=dtype)
    score = get_method(method).decomposition_score
    assert score is not None
    return score(d)
