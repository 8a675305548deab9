"""Importance measures as registered objects: every harness (faithfulness, plots, CLI) takes any of them.

A `Method` turns one layer (`contribution_lens.adapter.LayerInputs`) into scores
``[batch head query key]`` (per head; the token-level score is their sum over heads) or
``[batch query key]``. The built-ins:

* ``attention``: ``alpha_ij^h``;
* ``value_weighted``: ``alpha_ij^h ||vt_j^h||``, the norm-based measure of Kobayashi et al. (2020);
* ``output_normalized``: ``alpha_ij^h ||vt_j^h|| / ||o||``. Under the inter scope ``||o|| = ||o_i||``
  is one number per query, shared by every (head, key), so it ranks the keys of a query exactly
  as ``value_weighted`` does; only the intra scope (``||o_i^h||`` per head) tells them apart;
* ``contribution``: ``c_ij^h = alpha_ij^h (||vt_j^h|| / ||o||) cos(o, vt_j^h)``;
* ``random``: the control, uniform scores that depend on (seed, the text's token ids, layer,
  position) alone, so batching and padding never change them.

Registering your own takes a function of the layer:

    >>> import contribution_lens as cl
    >>> @cl.register_method("value_norm_only", description="||vt_j^h|| alone, ignoring attention")
    ... def value_norm_only(layer, context):
    ...     d = layer.decompose(context.scope)
    ...     return d.value_norm[:, :, None, :] * d.valid[:, None].to(d.value_norm.dtype)
    >>> "value_norm_only" in cl.available_methods()
    True
    >>> cl.unregister_method("value_norm_only")
"""

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import einops
import torch
from jaxtyping import Float
from torch import Tensor

from contribution_lens.adapter import LayerInputs, Model, TokenBatch
from contribution_lens.decomposition import SCOPES, Scope, scores_from


@dataclass(frozen=True)
class ScoreContext:
    """What a method may need beyond the layer: the scope, the seed, the model, prepared state."""

    scope: Scope = "inter"
    seed: int = 0
    model: Model | None = None
    prepared: Any = None
    """What the method's ``prepare`` returned for this batch (None without one)."""

    def __post_init__(self) -> None:
        if self.scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, got {self.scope!r}")


ScoreFn = Callable[[LayerInputs, ScoreContext], Tensor]
PrepareFn = Callable[[Model, TokenBatch, list[int]], Any]


@dataclass(frozen=True)
class Method:
    """An importance measure: a name, what it needs, and a per-layer score function.

    Attributes:
        name: the registry key (used by the CLI, the records and the plots).
        score_fn: ``(layer, context) -> [batch head query key]`` or ``[batch query key]``.
        description: one line for listings and reports.
        signed: whether scores can be negative (ranking by ``|score|`` then differs).
        capture: extra hooks the score reads from ``layer.captured`` (relative to ``blocks.{l}``).
        prepare: ``(model, batch, layers) -> state`` run once per batch before the scoring
            pass (e.g. a backward pass for gradients); the state reaches ``context.prepared``.
        control: a baseline that measures nothing (reports keep it apart).
    """

    name: str
    score_fn: ScoreFn = field(repr=False)
    description: str = ""
    signed: bool = False
    capture: tuple[str, ...] = ()
    prepare: PrepareFn | None = field(default=None, repr=False)
    control: bool = False

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"a method name is letters, digits, '_' or '-', got {self.name!r}")

    def token_scores(self, layer: LayerInputs, context: ScoreContext) -> Float[Tensor, "batch query key"]:
        """Scores summed over heads, float32 at least, exactly 0 where a key is not visible."""
        scores = self._checked(layer, context)
        return einops.reduce(scores, "batch head query key -> batch query key", "sum") if scores.ndim == 4 else scores

    def head_scores(self, layer: LayerInputs, context: ScoreContext) -> Float[Tensor, "batch head query key"]:
        """Per-head scores; refused for a method that scores tokens only."""
        scores = self._checked(layer, context)
        if scores.ndim != 4:
            raise ValueError(f"method {self.name!r} scores tokens, not heads: per-head ranking needs per-head scores")
        return scores

    def _checked(self, layer: LayerInputs, context: ScoreContext) -> Tensor:
        scores = self.score_fn(layer, context)
        batch, n_heads, n_query, n_key = layer.pattern.shape
        shapes = {(batch, n_heads, n_query, n_key), (batch, n_query, n_key)}
        if tuple(scores.shape) not in shapes:
            raise ValueError(
                f"method {self.name!r} returned {tuple(scores.shape)}, expected [batch head query key] "
                f"{tuple(layer.pattern.shape)} or [batch query key] {(batch, n_query, n_key)}"
            )
        scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
        if not bool(torch.isfinite(scores).all()):
            raise ValueError(f"method {self.name!r} returned non-finite scores at layer {layer.layer}")
        return scores


_REGISTRY: dict[str, Method] = {}


def register_method(
    name: str | Method,
    score_fn: ScoreFn | None = None,
    *,
    description: str = "",
    signed: bool = False,
    capture: tuple[str, ...] = (),
    prepare: PrepareFn | None = None,
    control: bool = False,
    replace: bool = False,
) -> Any:
    """Register a `Method` (or a score function under ``name``); usable as a decorator.

    ``register_method(Method(...))``, ``register_method("name", fn)`` and
    ``@register_method("name")`` all work. A name already taken is refused unless
    ``replace=True``.
    """

    def add(method: Method) -> Method:
        if method.name in _REGISTRY and not replace:
            raise ValueError(f"a method named {method.name!r} is already registered; pass replace=True to replace it")
        _REGISTRY[method.name] = method
        return method

    if isinstance(name, Method):
        return add(name)

    def method_of(fn: ScoreFn) -> Method:
        return Method(name, fn, description, signed, tuple(capture), prepare, control)

    def build(fn: ScoreFn) -> ScoreFn:
        add(method_of(fn))
        return fn

    return build if score_fn is None else add(method_of(score_fn))


def unregister_method(name: str) -> None:
    """Remove a user's method (built-ins stay)."""
    from contribution_lens.peers import PEER_METHODS

    if name in BUILTIN_METHODS or name in PEER_METHODS:
        raise ValueError(f"{name!r} is built in and cannot be unregistered")
    if name not in _REGISTRY:
        raise KeyError(f"no method named {name!r} is registered")
    del _REGISTRY[name]


def get_method(name: str | Method) -> Method:
    """The registered method called ``name`` (a `Method` is returned as it is)."""
    if isinstance(name, Method):
        return name
    if name not in _REGISTRY:
        raise ValueError(f"unknown method {name!r}; registered methods: {', '.join(available_methods())}")
    return _REGISTRY[name]


def available_methods() -> tuple[str, ...]:
    """Names of every registered method, built-ins first."""
    return tuple(_REGISTRY)


def _decomposition_score(method: str) -> ScoreFn:
    def score(layer: LayerInputs, context: ScoreContext) -> Tensor:
        return scores_from(layer.decompose(context.scope), method)

    return score


def text_seed(seed: int, token_ids: list[int], layer: int) -> int:
    """A 32-bit seed from (seed, a text's token ids, layer): nothing about its batch."""
    payload = f"{seed}:{layer}:" + ",".join(map(str, token_ids))
    return zlib.crc32(payload.encode())


def random_score(layer: LayerInputs, context: ScoreContext) -> Tensor:
    """Uniform scores per (text, layer, head, query, key), padding-free and batch-free."""
    batch, n_heads, n_query, n_key = layer.pattern.shape
    out = torch.zeros(batch, n_heads, n_query, n_key, dtype=torch.float64)
    lengths = layer.attention_mask.sum(-1).tolist()
    for row, length in enumerate(lengths):
        ids = layer.tokens[row, :length].tolist()
        generator = torch.Generator().manual_seed(text_seed(context.seed, ids, layer.layer))
        out[row, :, :length, :length] = torch.rand(n_heads, length, length, generator=generator, dtype=torch.float64)
    out = out.to(layer.pattern.device)
    valid = einops.rearrange(layer.decompose(context.scope).valid, "batch query key -> batch 1 query key")
    return torch.where(valid, out, 0)


BUILTIN_METHODS: tuple[str, ...] = ("attention", "value_weighted", "output_normalized", "contribution", "random")
for _name, _description, _signed in (
    ("attention", "attention weight alpha", False),
    ("value_weighted", "alpha ||vt||: Kobayashi et al.'s norm-based measure", False),
    ("output_normalized", "alpha ||vt|| / ||o||", False),
    ("contribution", "contribution weight c = alpha (||vt|| / ||o||) cos(o, vt)", True),
):
    register_method(Method(_name, _decomposition_score(_name), _description, _signed))
register_method(Method("random", random_score, "seeded uniform scores (control)", control=True))
from contribution_lens import peers  # noqa: E402, F401  (registers alti, value_zeroing, grad_attention)
