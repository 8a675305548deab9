"""Contribution weights of one attention layer: pure tensor maths, no TransformerLens.

Notation, for one layer, batch element and query position ``i``:

* ``alpha_ij^h`` -- attention pattern of head ``h`` (``hook_pattern``);
* ``vt_j^h = v_j^h W_O^h`` -- the *projected value* of key ``j`` in head ``h``
  (``hook_v`` times ``W_O``; ``b_O`` belongs to no token and is left out);
* ``o_i^h = sum_j alpha_ij^h vt_j^h`` -- the head output, ``o_i = sum_h o_i^h`` the layer output.

The contribution weight of key ``j`` through head ``h`` is the share of the output that
its weighted value carries along the output direction:

    c_ij^h = <o, alpha_ij^h vt_j^h> / ||o||^2
           = alpha_ij^h * (||vt_j^h|| / ||o||) * cos(o, vt_j^h)

with ``o = o_i^h`` (``scope="intra"``: weights sum to 1 over keys, per head) or
``o = o_i`` (``scope="inter"``: weights sum to 1 over heads and keys together).

Nothing of shape ``[batch head query key d_model]`` is built: every inner product is
contracted through ``d_head`` (``<o, v W_O^h> = <o W_O^h^T, v>``; intra-head through the
Gram matrix ``W_O^h W_O^h^T``), so the largest intermediate has the size of the pattern.
"""

import dataclasses
import math
from dataclasses import dataclass
from functools import cached_property

import einops
import torch
from jaxtyping import Bool, Float
from torch import Tensor

from contribution_lens.choices import Factor, Scope, as_index


@dataclass(frozen=True)
class Decomposition:
    """The three factors of the contribution weights of one layer.

    ``contribution == attention * relative_norm * cosine`` everywhere. Positions that are
    masked (future keys, padding) hold exactly 0 in every factor. Where ``||o|| = 0`` there
    is nothing to decompose: ``relative_norm``, ``cosine`` and ``contribution`` are 0 there.

    Only ``attention`` (the pattern itself, uncopied where possible) and ``cosine`` are stored
    pattern-sized; ``relative_norm = value_norm / output_norm`` is derived on access and
    ``contribution = attention * cosine * value_norm / output_norm`` is computed on first
    access and then kept. A layer costs two pattern-sized tensors until its contribution is
    read, three after.

    Example:
        >>> import torch
        >>> pattern = torch.tensor([[[[1.0, 0.0], [0.5, 0.5]]]])  # one head, two tokens
        >>> v = torch.tensor([[[[1.0, 0.0]], [[-3.0, 0.0]]]])  # [batch key kv_head d_head]
        >>> W_O = torch.eye(2)[None]  # [head d_head d_model]
        >>> d = decompose(pattern, v, W_O, scope="intra")
        >>> d.contribution[0, 0, 1].tolist()  # token 0 is destructive interference
        [-0.5, 1.5]
    """

    attention: Float[Tensor, "batch head query key"]
    cosine: Float[Tensor, "batch head query key"]
    value_norm: Float[Tensor, "batch head key"]
    """``||vt_j^h||``, zero at padded keys."""
    output_norm: Float[Tensor, "batch head query"]
    """``||o_i^h||`` (intra) or ``||o_i||`` repeated over heads (inter); zero at padding."""
    valid: Bool[Tensor, "batch query key"]
    """True where key ``j`` is visible from query ``i`` (not a future key of a causal pattern, not padding)."""
    scope: Scope | str

    def __post_init__(self) -> None:
        object.__setattr__(self, "scope", Scope.of(self.scope))
        shape = self.attention.shape
        if self.cosine.shape != shape:
            raise ValueError(f"cosine has shape {tuple(self.cosine.shape)}, expected {tuple(shape)}")
        batch, head, query, key = shape
        if self.value_norm.shape != (batch, head, key):
            raise ValueError(f"value_norm has shape {tuple(self.value_norm.shape)}, expected {(batch, head, key)}")
        if self.output_norm.shape != (batch, head, query):
            raise ValueError(f"output_norm has shape {tuple(self.output_norm.shape)}, expected {(batch, head, query)}")
        if self.valid.shape != (batch, query, key):
            raise ValueError(f"valid has shape {tuple(self.valid.shape)}, expected {(batch, query, key)}")

    @property
    def relative_norm(self) -> Float[Tensor, "batch head query key"]:
        """``||vt_j^h|| / ||o||``, 0 where the position is masked or ``||o|| = 0``."""
        ratio = _safe_divide(
            einops.rearrange(self.value_norm, "batch head key -> batch head 1 key"),
            einops.rearrange(self.output_norm, "batch head query -> batch head query 1"),
        )
        return torch.where(einops.rearrange(self.valid, "batch query key -> batch 1 query key"), ratio, 0)

    @property
    def contribution(self) -> Float[Tensor, "batch head query key"]:
        """``c_ij^h = alpha_ij^h * (||vt_j^h|| / ||o||) * cos(o, vt_j^h)``; 0 where masked or ``||o|| = 0``.

        A copy of the kept tensor: writing to it (hiding the sink in a notebook) changes nothing
        that the decomposition, its sums or its figures read later.
        """
        return self._contribution.clone()

    @cached_property
    def _contribution(self) -> Float[Tensor, "batch head query key"]:
        """`contribution`, computed on first use and kept."""
        inv_out = _safe_divide(torch.ones_like(self.output_norm), self.output_norm)
        return (
            torch.mul(self.attention, self.cosine)
            .mul_(einops.rearrange(self.value_norm, "batch head key -> batch head 1 key"))
            .mul_(einops.rearrange(inv_out, "batch head query -> batch head query 1"))
        )

    @property
    def value_weighted(self) -> Float[Tensor, "batch head query key"]:
        """``alpha_ij^h ||vt_j^h||``: Kobayashi et al.'s per-head norm-based measure."""
        return self.attention * einops.rearrange(self.value_norm, "batch head key -> batch head 1 key")

    @property
    def output_normalized(self) -> Float[Tensor, "batch head query key"]:
        """``alpha_ij^h ||vt_j^h|| / ||o||``."""
        return self.attention * self.relative_norm

    def head_contribution(self, head: int) -> Float[Tensor, "batch query key"]:
        """``c_ij^h`` of one head, without building every head's (unless already computed)."""
        head = as_index(head, "head must be an integer")
        if not -self.shape[1] <= head < self.shape[1]:
            raise IndexError(
                f"head {head} does not exist: the layer has {self.shape[1]} heads (0..{self.shape[1] - 1})"
            )
        if "_contribution" in self.__dict__:
            return self._contribution[:, head].clone()
        inv_out = _safe_divide(torch.ones_like(self.output_norm[:, head]), self.output_norm[:, head])
        return (
            torch.mul(self.attention[:, head], self.cosine[:, head])
            .mul_(einops.rearrange(self.value_norm[:, head], "batch key -> batch 1 key"))
            .mul_(einops.rearrange(inv_out, "batch query -> batch query 1"))
        )

    def factor(self, name: Factor | str) -> Float[Tensor, "batch head query key"]:
        """One of ``attention``, ``relative_norm``, ``cosine``, ``contribution`` by name."""
        return getattr(self, Factor.of(name).value)

    def token_factors(self) -> dict[str, Float[Tensor, "batch query key"]]:
        """The four factors at token level, heads combined.

        Contribution is summed over heads (the token's share of the output; it sums to 1 over
        keys under ``scope="inter"``), attention averaged over heads. Relative norm and cosine
        are per-head quantities: they come out as their attention-weighted mean over heads,
        ``sum_h alpha_ij^h x_ij^h / sum_h alpha_ij^h`` (0 where no head attends).
        """
        attention = self.attention
        weights = attention / attention.sum(1, keepdim=True).clamp_min(1e-30)
        return {
            "attention": attention.mean(1),
            "relative_norm": (weights * self.relative_norm).sum(1),
            "cosine": (weights * self.cosine).sum(1),
            "contribution": self._contribution.sum(1),
        }

    def sum_over_heads(self) -> Float[Tensor, "batch query key"]:
        """Token-level contribution ``sum_h c_ij^h`` (sums to 1 over keys for ``scope="inter"``)."""
        return einops.reduce(self._contribution, "batch head query key -> batch query key", "sum")

    def to(self, target: torch.device | str | torch.dtype) -> "Decomposition":
        """A copy with every tensor moved to a device or cast to a floating dtype (``valid`` stays bool)."""
        if isinstance(target, torch.dtype) and not target.is_floating_point:
            raise ValueError(f"a Decomposition holds real numbers: cannot cast it to {target}")

        def move(tensor: Tensor) -> Tensor:
            return tensor.to(target)

        return Decomposition(
            attention=move(self.attention),
            cosine=move(self.cosine),
            value_norm=move(self.value_norm),
            output_norm=move(self.output_norm),
            valid=self.valid if isinstance(target, torch.dtype) else self.valid.to(target),
            scope=self.scope,
        )

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(batch, head, query, key)``."""
        batch, head, query, key = self.attention.shape
        return batch, head, query, key

    def __repr__(self) -> str:
        batch, head, query, key = self.shape
        return (
            f"Decomposition(scope={self.scope!r}, batch={batch}, head={head}, query={query}, key={key}, "
            f"dtype={self.attention.dtype}, device={self.attention.device})"
        )


MEASURES: dict[str, str] = {
    "attention": "attention α",
    "value_weighted": "value-weighted α‖vt‖",
    "output_normalized": "output-normalised α‖vt‖/‖o‖",
    "contribution": "contribution c",
}
"""The measures read off a `Decomposition`'s factors (its attributes of those names) and how figures label them."""


def _safe_divide(numerator: Tensor, denominator: Tensor) -> Tensor:
    """``numerator / denominator`` with 0 where the denominator is 0 (never NaN or inf)."""
    nonzero = denominator != 0
    return torch.where(nonzero, numerator / torch.where(nonzero, denominator, 1), 0)


ACCUMULATION_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float64": torch.float64}
"""The dtypes sums are accumulated in, by name: float32 at least, whatever the model's dtype."""


def accumulation_dtype(dtype: torch.dtype | str | None, *tensors: Tensor) -> torch.dtype:
    """The ``dtype=`` of every function that accumulates, checked: float32 or float64, or its name.

    None gives float32, or float64 where one of ``tensors`` is float64. Half precision (float16,
    bfloat16: 8 to 11 bits of mantissa) loses too much in ``||o||^2``, the Gram contractions and
    the logit's sum of thousands of terms, so a dtype narrower than float32 is refused, as is a
    name `torch` does not call a floating dtype. Every function of the package with a ``dtype=``
    for its sums calls this first, before any pass.

    Example:
        >>> accumulation_dtype("float64"), accumulation_dtype(None, torch.zeros(1, dtype=torch.float64))
        (torch.float64, torch.float64)
        >>> accumulation_dtype(torch.float16)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: dtype must be torch.float32 or torch.float64 (or its name, e.g. 'float64'): ...; got torch.float16
    """
    if dtype is None:
        return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in ACCUMULATION_DTYPES:
        return ACCUMULATION_DTYPES[dtype.removeprefix("torch.")]
    if isinstance(dtype, torch.dtype) and dtype in ACCUMULATION_DTYPES.values():
        return dtype
    raise ValueError(
        "dtype must be torch.float32 or torch.float64 (or its name, e.g. 'float64'): sums are accumulated "
        f"in float32 at least; got {dtype!r}"
    )


def head_gram(W_O: Float[Tensor, "head d_head d_model"]) -> Float[Tensor, "head d_head e_head"]:
    """``W_O^h W_O^h^T`` per head: ``<x W_O^h, y W_O^h> = x G^h y`` without going to d_model."""
    return einops.einsum(W_O, W_O, "head d_head d_model, head e_head d_model -> head d_head e_head")


def valid_positions(
    query: int,
    key: int,
    *,
    attention_mask: Bool[Tensor, "batch key"] | None = None,
    batch: int = 1,
    causal: bool = True,
    device: torch.device | str | None = None,
    first_query: int | None = None,
) -> Bool[Tensor, "batch query key"]:
    """Where key ``j`` is visible from query ``i``: ``j <= i`` (if causal) and neither is padding.

    Queries are the positions ``first_query .. first_query + query - 1``; by default the last ``query`` of
    the ``key`` positions, as in a KV cache (and as a causal tile of queries with the keys up to its last).

    Example:
        >>> valid_positions(2, 3, first_query=0).int().tolist()  # queries 0 and 1 of three keys
        [[[1, 0, 0], [1, 1, 0]]]
    """
    first = key - query if first_query is None else first_query
    if not 0 <= first <= key - query:
        raise ValueError(f"queries {first}..{first + query - 1} are not positions of the {key} keys")
    positions_q = torch.arange(first, first + query, device=device)
    positions_k = torch.arange(key, device=device)
    if causal:
        visible = positions_k[None, :] <= positions_q[:, None]
    else:
        visible = torch.ones(query, key, dtype=torch.bool, device=device)
    visible = einops.repeat(visible, "query key -> batch query key", batch=batch)
    if attention_mask is not None:
        if attention_mask.shape != (batch, key):
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, expected {(batch, key)}")
        keep = attention_mask.to(device=visible.device, dtype=torch.bool)
        visible = visible & keep[:, None, :] & keep[:, first : first + query, None]
    return visible


def _shape(tensor: Tensor) -> str:
    return f"shape {tuple(tensor.shape)}"


def check_shapes(
    pattern: Tensor,
    v: Tensor,
    W_O: Tensor,
    *,
    z: Tensor | None = None,
    attention_mask: Tensor | None = None,
) -> None:
    """Ranks, layouts and dtypes of one layer's tensors, each error naming the argument."""
    for name, tensor, layout in (
        ("pattern", pattern, "[batch head query key] (hook_pattern)"),
        ("v", v, "[batch key kv_head d_head] (hook_v)"),
        ("W_O", W_O, "[head d_head d_model]"),
    ):
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor {layout}, got {type(tensor).__name__}")
        rank = len(layout.split("]")[0].split())
        if tensor.ndim != rank:
            hint = " (add the batch axis: tensor[None])" if tensor.ndim == rank - 1 and name != "W_O" else ""
            raise ValueError(f"{name} must be {rank}-D {layout}, got {_shape(tensor)}{hint}")
        if not tensor.dtype.is_floating_point:
            raise ValueError(f"{name} must be a floating point tensor, got dtype {tensor.dtype}")
        if tensor.is_meta:
            raise ValueError(
                f"{name} is on the meta device: it has a shape but no values (materialise it on a real device first)"
            )
        if tensor.numel() == 0:
            empty = [
                axis for axis, size in zip(layout[1:].split("]")[0].split(), tensor.shape, strict=True) if not size
            ]
            raise ValueError(f"{name} is empty: {_shape(tensor)} has no {', no '.join(empty)} (expected {layout})")
    batch, n_heads, n_query, n_key = pattern.shape
    _, v_key, n_kv_heads, d_head = v.shape
    if v.shape[0] != batch or v_key != n_key:
        raise ValueError(
            f"v has {_shape(v)} but pattern {tuple(pattern.shape)} needs [batch={batch}, key={n_key}, ...]"
        )
    if W_O.shape[:2] != (n_heads, d_head):
        raise ValueError(f"W_O has {_shape(W_O)}, expected [head={n_heads}, d_head={d_head}, d_model]")
    if n_kv_heads == 0 or n_heads % n_kv_heads != 0:
        raise ValueError(f"v has kv_head={n_kv_heads}, which does not divide the pattern's head={n_heads}")
    if n_query > n_key:
        raise ValueError(f"pattern has more queries ({n_query}) than keys ({n_key})")
    if z is not None and tuple(z.shape) != (batch, n_query, n_heads, d_head):
        raise ValueError(
            f"z must be [batch query head d_head] (hook_z) = {(batch, n_query, n_heads, d_head)}, got {_shape(z)}"
        )
    if attention_mask is not None and tuple(attention_mask.shape) != (batch, n_key):
        raise ValueError(f"attention_mask must be [batch key] = {(batch, n_key)}, got {_shape(attention_mask)}")


def _real_queries(pattern: Tensor, attention_mask: Tensor | None) -> Tensor | None:
    if attention_mask is None:
        return None
    n_query = pattern.shape[2]
    return attention_mask.to(device=pattern.device, dtype=torch.bool)[:, -n_query:]


def check_finite_values(
    pattern: Tensor,
    v: Tensor,
    W_O: Tensor,
    *,
    z: Tensor | None = None,
    attention_mask: Tensor | None = None,
) -> None:
    """Every entry that enters the result is finite (padding may hold anything)."""
    pattern, v, W_O = pattern.detach(), v.detach(), W_O.detach()
    z = None if z is None else z.detach()
    real_q = _real_queries(pattern, attention_mask)
    real_k = None if attention_mask is None else attention_mask.to(device=v.device, dtype=torch.bool)
    tensors: list[tuple[str, Tensor]] = [
        ("pattern", pattern if real_q is None else pattern.transpose(1, 2)[real_q]),
        ("v", v if real_k is None else v[real_k]),
        ("W_O", W_O),
    ]
    if z is not None:
        tensors.append(("z", z if real_q is None else z[real_q.to(z.device)]))
    for name, tensor in tensors:
        finite = torch.isfinite(_widened(tensor))  # type: ignore[arg-type]
        if not bool(finite.all()):
            bad = int((~finite).sum())
            raise ValueError(
                f"{name} has {bad} non-finite entries (NaN or inf) at real positions; "
                "contribution weights would be NaN there"
            )


def probability_tolerance(dtype: torch.dtype) -> float:
    """How far a softmax row may sum from 1 in ``dtype`` (half precision rounds each entry).

    An 8-bit float rounds each entry by up to half its machine epsilon (e4m3: 6 %, e5m2: 12 %),
    so a row may miss 1 by that much: the tolerance is the epsilon itself.
    """
    if _is_float8(dtype):
        return float(torch.finfo(dtype).eps)
    return 2e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-3


def _is_float8(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and dtype.itemsize == 1


def _widened(tensor: Tensor | None) -> Tensor | None:
    """An 8-bit float tensor as float32 (most torch operations refuse float8), anything else as it is."""
    if isinstance(tensor, Tensor) and _is_float8(tensor.dtype):
        return tensor.float()
    return tensor


def check_probabilities(
    pattern: Tensor, *, attention_mask: Tensor | None = None, rounded_to: torch.dtype | None = None
) -> None:
    """Rows of real queries hold probabilities along the key axis: in [0, 1], summing to 1.

    ``rounded_to`` is the dtype the pattern was stored in, if wider now (float8 read as float32):
    the tolerance is that dtype's (`probability_tolerance`).
    """
    real_q = _real_queries(pattern, attention_mask)
    rows = pattern.detach() if real_q is None else pattern.detach().transpose(1, 2)[real_q]
    if rows.numel() == 0:
        return
    tol = probability_tolerance(rounded_to or pattern.dtype)
    rows = rows.float()
    sums = rows.sum(-1)
    low, high = float(rows.min()), float(rows.max())
    if low < -tol or high > 1 + tol or bool(((sums - 1).abs() > tol).any()):
        raise ValueError(
            "pattern must hold attention probabilities (hook_pattern: rows in [0, 1] summing to 1 over keys); "
            f"got entries in [{low:.3g}, {high:.3g}] and row sums in [{float(sums.min()):.3g}, "
            f"{float(sums.max()):.3g}]. Pre-softmax scores (hook_attn_scores)? Apply softmax over keys first"
        )


def is_causal(pattern: Float[Tensor, "batch head query key"]) -> bool:
    """True when no query puts weight on a later key (every entry above the diagonal is 0)."""
    n_query, n_key = pattern.shape[-2:]
    return not bool(pattern.triu(n_key - n_query + 1).any())


def decompose(
    pattern: Float[Tensor, "batch head query key"],
    v: Float[Tensor, "batch key kv_head d_head"],
    W_O: Float[Tensor, "head d_head d_model"],
    *,
    scope: Scope | str = Scope.INTER,
    attention_mask: Bool[Tensor, "batch key"] | None = None,
    causal: bool | None = None,
    dtype: torch.dtype | str | None = None,
    z: Float[Tensor, "batch query head d_head"] | None = None,
    check_values: bool = True,
) -> Decomposition:
    """Decompose each token's share of an attention output into three factors.

    ``c_ij^h = alpha_ij^h * (||vt_j^h|| / ||o||) * cos(o, vt_j^h)`` with ``vt_j^h = v_j^h W_O^h``
    and ``o`` the head output ``o_i^h`` (``scope="intra"``) or the layer output
    ``o_i = sum_h o_i^h`` (``scope="inter"``), ``b_O`` excluded.

    The pattern is the truth about which keys exist: a causal pattern (exact zeros above the
    diagonal) gives future keys no weight, a bidirectional one gives every key its share.
    Grouped-query attention needs no copy of ``v``: head ``h`` reads kv head
    ``h // (head / kv_head)``, the ``repeat_interleave`` order TransformerLens and HF use.

    Args:
        pattern: attention probabilities, ``hook_pattern`` (rows sum to 1 over keys).
        v: values, ``hook_v``; ``kv_head`` must divide ``head``.
        W_O: output projection per head.
        scope: ``"intra"`` or ``"inter"`` (see above).
        attention_mask: 1/True for real tokens, 0/False for padding; padded rows and columns
            come out as exactly 0.
        causal: whether future keys (``j > i``) are invisible. None (default) reads it off the
            pattern: causal exactly when every entry above the diagonal is 0. Models say it in
            ``cfg.attention_dir``; `contribution_lens.map_layers` passes that.
        dtype: accumulation dtype, ``torch.float32`` or ``torch.float64`` or its name
            (`accumulation_dtype`); float32 by default (float64 if an input is float64, or if a
            norm would be a float32 subnormal, below 1.2e-38: inputs ~1e-40), whatever the model dtype.
        z: the head outputs before ``W_O``, ``hook_z`` (``= pattern @ v`` per head). Passing
            what the model already computed saves one ``[head query key d_head]`` contraction.
        check_values: check that every tensor is finite and that the pattern holds
            probabilities. Each check is one pass over the pattern; switch them off only for
            inputs known to be good. Shapes are always checked.

    Returns:
        A `Decomposition` in the accumulation dtype, holding its own copies of the inputs.
        Where ``||o|| = 0`` every factor is 0, so weights then sum to 0, not 1.

    Example:
        >>> import torch
        >>> future = torch.ones(5, 5).triu(1).bool()
        >>> pattern = torch.softmax(torch.randn(1, 4, 5, 5).masked_fill(future, -torch.inf), -1)  # causal
        >>> d = decompose(pattern, torch.randn(1, 5, 2, 8), torch.randn(4, 8, 16))
        >>> d.sum_over_heads().sum(-1)  # inter-head weights sum to 1 for every query
        tensor([[1.0000, 1.0000, 1.0000, 1.0000, 1.0000]])
    """
    dtype = None if dtype is None else accumulation_dtype(dtype)
    check_shapes(pattern, v, W_O, z=z, attention_mask=attention_mask)
    scope = Scope.of(scope)
    stored = pattern.dtype
    given = pattern
    pattern, v, W_O, z = _widened(pattern), _widened(v), _widened(W_O), _widened(z)  # type: ignore[assignment]
    if check_values:
        # The checks read values only (detached): gradients through decompose see none of them.
        check_finite_values(pattern, v, W_O, z=z, attention_mask=attention_mask)
        check_probabilities(pattern, attention_mask=attention_mask, rounded_to=stored)
    if causal is None:
        causal = is_causal(pattern.detach())
    d = decompose_layer(pattern, v, W_O, scope=scope, attention_mask=attention_mask, causal=causal, dtype=dtype, z=z)
    if dtype is None and _subnormal_norms(d):
        # Norms too small for float32 (inputs ~1e-40) keep only some of their digits there, and the
        # weights, ratios of them, would be off or NaN: float64 holds them whole.
        d = decompose_layer(
            pattern, v, W_O, scope=scope, attention_mask=attention_mask, causal=causal, dtype=torch.float64, z=z
        )
    if check_values:
        _check_norms_finite(d)
    if d.attention.data_ptr() == given.data_ptr():
        # The result keeps the pattern: a caller who later edits theirs must not change it.
        d = dataclasses.replace(d, attention=d.attention.clone())
    return d


def _subnormal_norms(d: Decomposition) -> bool:
    """Whether a nonzero norm lies below the smallest normal number of its dtype (float32: 1.2e-38)."""
    return any(
        bool(((norms != 0) & (norms.abs() < torch.finfo(norms.dtype).tiny)).any())
        for norms in (d.value_norm.detach(), d.output_norm.detach())
    )


def _check_norms_finite(d: Decomposition) -> None:
    """Norms are computed on rescaled values, so only a norm beyond the dtype's own range is refused."""
    for name in ("value_norm", "output_norm"):
        norms = getattr(d, name).detach()
        if not bool(torch.isfinite(norms).all()):
            raise ValueError(
                f"{name} exceeds the range of {norms.dtype} ({torch.finfo(norms.dtype).max:.3g}): the inputs are "
                "too large for this dtype; pass dtype=torch.float64"
            )


GROUPED = "batch (kv_head group) query key -> batch kv_head group query key"
"""Query heads grouped by the kv head they read (GQA): head ``h`` reads kv head ``h // group``."""
UNGROUPED = "batch kv_head group ... -> batch (kv_head group) ..."


def decompose_layer(
    pattern: Float[Tensor, "batch head query key"],
    v: Float[Tensor, "batch key kv_head d_head"],
    W_O: Float[Tensor, "head d_head d_model"],
    *,
    scope: Scope,
    causal: bool,
    attention_mask: Bool[Tensor, "batch key"] | None = None,
    dtype: torch.dtype | str | None = None,
    z: Float[Tensor, "batch query head d_head"] | None = None,
    output: Float[Tensor, "batch query d_model"] | None = None,
    gram: Float[Tensor, "head d_head e_head"] | None = None,
) -> Decomposition:
    """`decompose` without input checks or copies, for tensors a model just produced.

    ``output`` is ``o_i = sum_h o_i^h`` (the o-projection's output less ``b_O``) where the model
    already computed it; it saves the inter scope one ``[query d_model]`` contraction per head.
    ``gram`` is `head_gram` of ``W_O`` computed earlier (used where its dtype is the accumulation's).
    Queries are the last ``query`` of the ``key`` positions (`valid_positions`). It is `KeySide.of` the
    layer's keys, then `KeySide.decompose` of every query at once.

    The result may hold ``pattern`` itself as ``attention`` (no copy where no cast or mask is
    needed): the model never writes to its hook outputs, a user may.
    """
    keys = KeySide.of(
        v, W_O, dtype=accumulation_dtype(dtype, pattern, v, W_O), attention_mask=attention_mask, gram=gram
    )
    return keys.decompose(pattern, scope=scope, causal=causal, z=z, output=output)


@dataclass(frozen=True, eq=False)
class KeySide:
    """What every query of one layer reads of its keys, computed once: each query's weights then follow from its
    own row of the pattern, its ``z`` and its output alone (`decompose`), a tile of queries at a time or all at once.

    Every weight is invariant to the scale of ``v`` (per text) and of ``W_O``, but their squared norms
    overflow (``v ~ 1e19`` in float32) or underflow (``v ~ 1e-23``): both are brought near 1 by powers of
    two (``v_scale``, ``w_scale``), which is exact, and the norms are scaled back at the end.

    Example:
        >>> v, W_O = torch.randn(1, 5, 2, 8), torch.randn(4, 8, 16)
        >>> future = torch.ones(5, 5).triu(1).bool()
        >>> pattern = torch.softmax(torch.randn(1, 4, 5, 5).masked_fill(future, -torch.inf), -1)
        >>> keys = KeySide.of(v, W_O, dtype=torch.float32)
        >>> whole = keys.decompose(pattern, scope=Scope.INTER, causal=True)
        >>> tile = keys.decompose(pattern[:, :, 2:4, :4], scope=Scope.INTER, causal=True, first_query=2)  # queries 2, 3
        >>> torch.allclose(tile.cosine, whole.cosine[:, :, 2:4, :4])
        True
    """

    values: Float[Tensor, "batch key kv_head d_head"]
    """``v`` in the accumulation dtype, 0 at padded keys, times ``v_scale``."""
    weights: Float[Tensor, "head d_head d_model"]
    """``W_O`` in the accumulation dtype, times ``w_scale``."""
    gram_g: Float[Tensor, "kv_head group d_head e_head"]
    v_gram: Float[Tensor, "batch kv_head group key e_head"]
    value_norm_sq: Float[Tensor, "batch kv_head group key"]
    values_t: Float[Tensor, "batch kv_head d_head key"]
    """``values`` with the keys last, contiguous: the right operand of the inter scope's products of a tile."""
    v_gram_t: Float[Tensor, "batch kv_head group e_head key"]
    """``v_gram`` with the keys last, contiguous: the right operand of the intra scope's."""
    v_scale: Float[Tensor, " batch"]
    w_scale: Float[Tensor, ""]
    attention_mask: Bool[Tensor, "batch key"] | None
    dtype: torch.dtype

    @classmethod
    def of(
        cls,
        v: Float[Tensor, "batch key kv_head d_head"],
        W_O: Float[Tensor, "head d_head d_model"],
        *,
        dtype: torch.dtype,
        attention_mask: Bool[Tensor, "batch key"] | None = None,
        gram: Float[Tensor, "head d_head e_head"] | None = None,
    ) -> "KeySide":
        """The key side of values ``v`` through ``W_O`` (``gram``: `head_gram` of ``W_O`` where the caller has it)."""
        values, weights = v.to(dtype=dtype), W_O.to(device=v.device, dtype=dtype)
        if attention_mask is not None:
            real = einops.rearrange(attention_mask.to(device=v.device, dtype=torch.bool), "batch key -> batch key 1 1")
            values = torch.where(real, values, 0)
        v_scale, w_scale = _unit_scale(values, (1, 2, 3)), _unit_scale(weights, (0, 1, 2))
        values, weights = values * v_scale[:, None, None, None], weights * w_scale
        n_kv_heads = v.shape[2]
        gram = head_gram(weights) if gram is None or gram.dtype != dtype else gram * w_scale.square()
        gram_g = einops.rearrange(
            gram, "(kv_head group) d_head e_head -> kv_head group d_head e_head", kv_head=n_kv_heads
        )
        v_gram = einops.einsum(
            values, gram_g, "batch key kv_head d_head, kv_head group d_head e_head -> batch kv_head group key e_head"
        )
        value_norm_sq = einops.einsum(
            v_gram, values, "batch kv_head group key e_head, batch key kv_head e_head -> batch kv_head group key"
        )
        mask = None if attention_mask is None else attention_mask.to(device=v.device, dtype=torch.bool)
        values_t = einops.rearrange(values, "batch key kv_head d_head -> batch kv_head d_head key").contiguous()
        v_gram_t = einops.rearrange(v_gram, "batch kv group key e_head -> batch kv group e_head key").contiguous()
        return cls(values, weights, gram_g, v_gram, value_norm_sq, values_t, v_gram_t, v_scale, w_scale, mask, dtype)

    def reading(
        self,
        z: Float[Tensor, "batch query head d_head"] | None,
        output: Float[Tensor, "batch query d_model"] | None,
        first_query: int = 0,
    ) -> tuple[Tensor, Tensor]:
        """`inter_reading` of queries ``first_query ..`` (``z`` and ``output`` theirs), scaled as `decompose` scales.

        One product of every query's output with ``W_O`` (``[query d_model] x [d_model head d_head]``):
        a layer read a tile of queries at a time computes it once and hands `decompose` each tile's rows.
        """
        n_kv_heads, n_heads = self.values.shape[2], self.weights.shape[0]
        if output is not None:
            output = (
                output.to(device=self.values.device, dtype=self.dtype) * (self.v_scale * self.w_scale)[:, None, None]
            )
            z_g = output.new_empty(output.shape[0], n_kv_heads, 0, output.shape[1], 0)  # the layout alone
        elif z is not None:
            scaled = z.to(device=self.values.device, dtype=self.dtype) * self.v_scale[:, None, None, None]
            z_g = einops.rearrange(scaled, "batch query (kv g) d -> batch kv g query d", kv=n_kv_heads)
        else:
            raise ValueError("the inter scope's reading needs the heads' outputs z or the layer's output")
        n_query = z_g.shape[3]
        real_q = None if self.attention_mask is None else self.attention_mask[:, first_query : first_query + n_query]
        return inter_reading(_layer_output(z_g, self.weights, output, real_q), self.weights, n_kv_heads, n_heads)

    def decompose(
        self,
        pattern: Float[Tensor, "batch head query key"],
        *,
        scope: Scope,
        causal: bool,
        first_query: int | None = None,
        z: Float[Tensor, "batch query head d_head"] | None = None,
        output: Float[Tensor, "batch query d_model"] | None = None,
        reading: tuple[Tensor, Tensor] | None = None,
    ) -> Decomposition:
        """The `Decomposition` of the queries whose pattern rows are ``pattern``, over its first ``key`` keys.

        ``first_query``: the position of the first row (default: the last rows of the keys, as a
        causal tile of queries with the keys up to its last one); ``z`` and ``output`` those rows'
        (as in `decompose_layer`); ``reading``: those rows of `reading` (the inter scope), where the
        caller computed it for the whole layer at once. A row's numbers are those of the whole
        layer's decomposition.
        """
        batch, n_heads, n_query, n_key = pattern.shape
        acc = self.dtype
        first = n_key - n_query if first_query is None else first_query
        mask = None if self.attention_mask is None else self.attention_mask[:, :n_key]
        valid = valid_positions(
            n_query, n_key, attention_mask=mask, batch=batch, causal=causal, device=pattern.device, first_query=first
        )
        # Zero masked entries first: a model may leave NaN rows for fully padded queries. A causal pattern
        # already holds exact zeros at future keys: no copy of it where nothing else needs masking.
        alpha = pattern if mask is None and pattern.dtype == acc else torch.where(valid[:, None], pattern.to(acc), 0)
        values, v_scale, w_scale = self.values[:, :n_key], self.v_scale, self.w_scale
        z = _precise_z(z, acc)  # before z is scaled and cast, which would hide its precision
        if z is not None:
            z = z.to(device=alpha.device, dtype=acc) * v_scale[:, None, None, None]
        # alpha and the values are masked already; a given z still loses the rows of queries that see nothing.
        z_g = einops.rearrange(
            head_outputs(alpha, values, valid=None if mask is None or z is None else valid, z=z, dtype=acc),
            "batch query (kv_head group) d_head -> batch kv_head group query d_head",
            kv_head=values.shape[2],
        )
        if output is not None:
            output = output.to(device=alpha.device, dtype=acc) * (v_scale * w_scale)[:, None, None]
        if scope == Scope.INTRA:
            dot, output_norm_sq = _intra_products(z_g, self.v_gram_t[..., :n_key], self.gram_g)
        else:
            real_q = None if mask is None else self.attention_mask[:, first : first + n_query]  # type: ignore[index]
            dot, output_norm_sq = _inter_products(
                z_g, self.values_t[..., :n_key], self.weights, output, real_q, n_heads, reading
            )
        cosine, value_norm, output_norm = _cosine_and_norms(dot, self.value_norm_sq[..., :n_key], output_norm_sq)
        unscale = einops.rearrange(v_scale * w_scale, "batch -> batch 1 1")
        value_norm, output_norm = value_norm / unscale, output_norm / unscale
        if mask is None and causal:
            cosine.tril_(first)  # several times faster than a broadcast boolean fill
        else:
            cosine.masked_fill_(~einops.rearrange(valid, "batch query key -> batch 1 query key"), 0)
        return Decomposition(
            attention=alpha, cosine=cosine, value_norm=value_norm, output_norm=output_norm, valid=valid, scope=scope
        )


def _unit_scale(x: Tensor, dims: tuple[int, ...]) -> Tensor:
    """``2^-e`` with ``max |x| * 2^-e`` in [0.5, 1) over ``dims`` (1 where ``x`` is 0): an exact rescaling.

    The exponent is clamped so that the factor itself is a normal number of ``x.dtype``.
    """
    peak = x.detach().abs().amax(dim=dims)
    _, exponent = torch.frexp(peak)
    limit = int(math.log2(torch.finfo(x.dtype).max)) - 2
    return torch.pow(2.0, -exponent.clamp(-limit, limit).to(x.dtype))


def _precise_z(z: Tensor | None, acc: torch.dtype) -> Tensor | None:
    """``z`` where the model computed it at least as precisely as ``acc``; None where it must be rebuilt.

    A half-precision ``hook_z`` is ``pattern @ v`` rounded once more: rows built from it would sum to 1
    only to that rounding (2e-3 in bfloat16), so ``z`` is rebuilt from the pattern and v in ``acc``.
    """
    if z is None or z.dtype.itemsize < torch.tensor([], dtype=acc).element_size():
        return None
    return z


def head_outputs(
    pattern: Float[Tensor, "batch head query key"],
    v: Float[Tensor, "batch key kv_head d_head"],
    *,
    valid: Bool[Tensor, "batch query key"] | None = None,
    z: Float[Tensor, "batch query head d_head"] | None = None,
    dtype: torch.dtype | str | None = None,
) -> Float[Tensor, "batch query head d_head"]:
    """The head outputs before ``W_O``: ``z_i^h = sum_j alpha_ij^h v_j^h`` over the keys ``j`` query ``i`` sees.

    So ``o_i^h = z_i^h W_O^h``. One rule for what counts: ``valid`` (`valid_positions`) says which keys each
    query sees; a query that sees none (padding) has ``z_i^h = 0``, and a padded key adds nothing whatever
    its value holds. Without ``valid`` (no padding) the pattern's own zeros say it: a causal pattern is
    exactly 0 at future keys. Where the model computed ``z`` (``hook_z``) at least as precisely as ``dtype``
    it is taken as it is, the rows of queries that see nothing set to 0. Grouped-query attention needs no
    copy of ``v``: head ``h`` reads kv head ``h // (head / kv_head)``.

    Args:
        pattern: ``alpha``, ``[batch head query key]``.
        v: the values, ``[batch key kv_head d_head]``.
        valid: which keys each query sees; None where there is no padding.
        z: the model's own head outputs (``hook_z``), if it has them.
        dtype: accumulation dtype (`accumulation_dtype`); float32 by default (float64 if an input is float64).

    Example:
        >>> pattern = torch.tensor([[[[1.0, 0.0], [0.25, 0.75]]]])  # one head, two tokens
        >>> head_outputs(pattern, torch.tensor([[[[4.0]], [[8.0]]]]))[0, :, 0, 0].tolist()
        [4.0, 7.0]
    """
    acc = accumulation_dtype(dtype, pattern, v)
    z = _precise_z(z, acc)
    if z is not None:
        z = z.to(device=pattern.device, dtype=acc)
        if valid is None:
            return z
        return torch.where(einops.rearrange(valid.any(-1), "batch query -> batch query 1 1"), z, 0)
    alpha, values = pattern.to(acc), v.to(device=pattern.device, dtype=acc)
    if valid is not None:
        # Zero hidden entries rather than trust them: a model may leave NaN rows for fully padded queries.
        alpha = torch.where(einops.rearrange(valid, "batch query key -> batch 1 query key"), alpha, 0)
        values = torch.where(einops.rearrange(valid.any(-2), "batch key -> batch key 1 1"), values, 0)
    grouped = einops.einsum(
        einops.rearrange(alpha, GROUPED, kv_head=v.shape[2]),
        values,
        "batch kv_head group query key, batch key kv_head d_head -> batch query kv_head group d_head",
    )
    return einops.rearrange(grouped, "batch query kv_head group d_head -> batch query (kv_head group) d_head")


def _intra_products(z_g: Tensor, v_gram_t: Tensor, gram_g: Tensor) -> tuple[Tensor, Tensor]:
    """``<o_i^h, vt_j^h> = z_i^h G^h v_j^h`` and ``||o_i^h||^2 = z_i^h G^h z_i^h``, grouped by kv head.

    ``v_gram_t`` is ``[batch kv_head group e_head key]`` (keys last: one matrix product a head).
    """
    dot = torch.matmul(z_g, v_gram_t)
    z_gram = einops.einsum(
        z_g, gram_g, "batch kv_head group query d_head, kv_head group d_head e_head -> batch kv_head group query e_head"
    )
    output_norm_sq = einops.einsum(
        z_gram, z_g, "batch kv_head group query e_head, batch kv_head group query e_head -> batch kv_head group query"
    )
    return dot, output_norm_sq


def _inter_products(
    z_g: Tensor,
    values_t: Tensor,
    weights: Tensor,
    output: Tensor | None,
    real_q: Tensor | None,
    n_heads: int,
    reading: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """``<o_i, vt_j^h> = (o_i W_O^h^T) v_j^h`` and ``||o_i||^2`` repeated over heads, grouped by kv head.

    ``values_t`` is ``[batch kv_head d_head key]``; ``reading``: `inter_reading` of these queries where
    the caller has it (computed once for a layer), else computed here from ``output`` (or ``z_g``).
    """
    if reading is None:
        reading = inter_reading(_layer_output(z_g, weights, output, real_q), weights, z_g.shape[1], n_heads)
    output_back, output_norm_sq = reading
    batch, n_kv_heads, group, n_query, d_head = output_back.shape
    dot = torch.matmul(output_back.reshape(batch, n_kv_heads, group * n_query, d_head), values_t).view(
        batch, n_kv_heads, group, n_query, values_t.shape[-1]
    )
    return dot, output_norm_sq


def _layer_output(z_g: Tensor, weights: Tensor, output: Tensor | None, real_q: Tensor | None) -> Tensor:
    """``o_i``: the given ``output`` (0 at padded queries, ``real_q`` False), else ``sum_h z_i^h W_O^h``."""
    if output is None:
        W_O_g = einops.rearrange(
            weights, "(kv_head group) d_head d_model -> kv_head group d_head d_model", kv_head=z_g.shape[1]
        )
        return einops.einsum(
            z_g, W_O_g, "batch kv_head group query d_head, kv_head group d_head d_model -> batch query d_model"
        )
    output = output.to(device=z_g.device, dtype=z_g.dtype)
    if real_q is not None:
        output = torch.where(einops.rearrange(real_q.to(z_g.device), "batch query -> batch query 1"), output, 0)
    return output


def inter_reading(
    output: Float[Tensor, "batch query d_model"], weights: Float[Tensor, "head d_head d_model"], n_kv_heads: int,
    n_heads: int,
) -> tuple[Float[Tensor, "batch kv_head group query d_head"], Float[Tensor, "batch kv_head group query"]]:  # fmt: skip
    """``o_i W_O^h^T`` per head and ``||o_i||^2``: what the inter scope reads of its queries, grouped by kv head.

    ``o_i`` lives in d_model once per query; it is pulled back through each head's ``W_O``.
    """
    W_O_g = einops.rearrange(
        weights, "(kv_head group) d_head d_model -> kv_head group d_head d_model", kv_head=n_kv_heads
    )
    output_back = einops.einsum(
        output, W_O_g, "batch query d_model, kv_head group d_head d_model -> batch kv_head group query d_head"
    )
    output_norm_sq = einops.repeat(
        einops.einsum(output, output, "batch query d_model, batch query d_model -> batch query"),
        "batch query -> batch kv_head group query",
        kv_head=n_kv_heads,
        group=n_heads // n_kv_heads,
    )
    return output_back, output_norm_sq


def _cosine_and_norms(dot: Tensor, value_norm_sq: Tensor, output_norm_sq: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``cos = <o, vt> / (||o|| ||vt||)`` (0 where a norm is 0) and both norms, heads ungrouped."""
    dot = einops.rearrange(dot, UNGROUPED)
    # Rounding can push a squared norm of a zero vector slightly below 0.
    value_norm = einops.rearrange(value_norm_sq, UNGROUPED).clamp_min(0).sqrt()
    output_norm = einops.rearrange(output_norm_sq, UNGROUPED).clamp_min(0).sqrt()
    # Reciprocals on the small [batch head query] / [batch head key] tensors, then in-place
    # products on the pattern-sized ones: each full-size pass (and allocation) costs as much
    # as the contractions themselves.
    inv_out = einops.rearrange(_safe_divide(torch.ones_like(output_norm), output_norm), "b h q -> b h q 1")
    inv_value = einops.rearrange(_safe_divide(torch.ones_like(value_norm), value_norm), "b h k -> b h 1 k")
    cosine = dot.mul_(inv_out).mul_(inv_value).clamp_(-1, 1)
    return cosine, value_norm, output_norm


def projected_values(
    v: Float[Tensor, "batch key kv_head d_head"], W_O: Float[Tensor, "head d_head d_model"]
) -> Float[Tensor, "batch head key d_model"]:
    """``vt_j^h = v_j^h W_O^h``, with kv heads shared by ``head / kv_head`` query heads (GQA).

    This is ``[batch head key d_model]``: for methods that compare whole vectors (ALTI), never for
    the contribution weights, which contract through ``d_head``.
    """
    W_O_g = einops.rearrange(W_O, "(kv_head group) d_head d_model -> kv_head group d_head d_model", kv_head=v.shape[2])
    vt = einops.einsum(
        v, W_O_g, "batch key kv_head d_head, kv_head group d_head d_model -> batch kv_head group key d_model"
    )
    return einops.rearrange(vt, "batch kv_head group key d_model -> batch (kv_head group) key d_model")
