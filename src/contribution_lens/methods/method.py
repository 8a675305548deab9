"""What an importance measure is: a `Method` (a name, what it needs, a per-layer score function) and its scores' checks.

A `Method` turns one layer (`contribution_lens.adapter.LayerInputs`) into scores
``[batch head query key]`` (per head; the token-level score is their sum over heads) or
``[batch query key]`` (token level only), checked by `check_scores`. The registry
(`contribution_lens.methods.registry`) finds methods by name; the families (``factors.py``, ``alti.py``,
...) build theirs from this module, with the helpers their score functions share (`prepared_score`,
`normalise_rows`).
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import einops
import torch
from jaxtyping import Float
from torch import Tensor

from contribution_lens.adapter import LayerInputs, Model, TokenBatch
from contribution_lens.decomposition import Decomposition, Scope


@dataclass(frozen=True)
class ScoreContext:
    """What a method may need beyond the layer: the scope, the seed, the model, prepared state."""

    scope: Scope | str = Scope.INTER
    seed: int = 0
    model: Model | None = None
    prepared: Any = None
    """What the method's ``prepare`` returned for this batch (None without one)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "scope", Scope.of(self.scope))


ScoreFn = Callable[[LayerInputs, ScoreContext], Tensor]
PrepareFn = Callable[[Model, TokenBatch, list[int]], Any]
DecompositionScore = Callable[[Decomposition], Tensor]


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
        label: how figures name it (default: ``name``).
        decomposition_score: the score read off one layer's `Decomposition` alone, where it
            needs nothing else (then `contribution_lens.importance` and the plots can use it).
        default: one of the measures a faithfulness run compares unless told otherwise.
        builtin: shipped with the package (cannot be unregistered).
        token_level: it scores tokens only, ``[batch query key]`` (ALTI, Kobayashi's layer-level
            norm): a per-head ranking (``granularity="head"``) refuses it before any pass runs.
    """

    name: str
    score_fn: ScoreFn = field(repr=False)
    description: str = ""
    signed: bool = False
    capture: tuple[str, ...] = ()
    prepare: PrepareFn | None = field(default=None, repr=False)
    control: bool = False
    label: str = ""
    decomposition_score: DecompositionScore | None = field(default=None, repr=False)
    default: bool = False
    builtin: bool = False
    token_level: bool = False

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"a method name is letters, digits, '_' or '-', got {self.name!r}")
        if not self.label:
            object.__setattr__(self, "label", self.name)

    @classmethod
    def from_decomposition(cls, name: str, score: DecompositionScore, description: str, **options: Any) -> "Method":
        """A method whose score is a function of the layer's `Decomposition` in the context's scope."""

        def score_fn(layer: LayerInputs, context: ScoreContext) -> Tensor:
            return score(layer.decompose(context.scope))

        return cls(name, score_fn, description, decomposition_score=score, **options)

    def token_scores(self, layer: LayerInputs, context: ScoreContext) -> Float[Tensor, "batch query key"]:
        """Scores summed over heads, float32 at least, exactly 0 where a key is not visible."""
        scores = self._checked(layer, context)
        return einops.reduce(scores, "batch head query key -> batch query key", "sum") if scores.ndim == 4 else scores

    def head_scores(self, layer: LayerInputs, context: ScoreContext) -> Float[Tensor, "batch head query key"]:
        """Per-head scores; refused for a method that scores tokens only."""
        if self.token_level:
            raise ValueError(f"method {self.name!r} scores tokens, not heads: per-head ranking needs per-head scores")
        scores = self._checked(layer, context)
        if scores.ndim != 4:
            raise ValueError(f"method {self.name!r} scores tokens, not heads: per-head ranking needs per-head scores")
        return scores

    def _checked(self, layer: LayerInputs, context: ScoreContext) -> Tensor:
        scores = self.score_fn(layer, context)
        return check_scores(self, scores, layer.pattern.shape, layer.layer)


SCORE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""The dtypes a method's scores may have (they are ranked in float32 at least)."""


def check_scores(method: Method, scores: Any, pattern_shape: tuple[int, ...], layer: int) -> Tensor:
    """``scores`` of ``method`` at ``layer`` as float32 at least, after checking what the method returned.

    A method returns a floating-point `torch.Tensor` (one of `SCORE_DTYPES`) shaped like the
    pattern ``[batch head query key]`` or token level ``[batch query key]`` (required for a
    ``token_level`` method), with finite values; anything else is refused with the method's name.
    """
    batch, _, n_query, n_key = pattern_shape
    expected = f"[batch head query key] {tuple(pattern_shape)} or [batch query key] {(batch, n_query, n_key)}"
    if not isinstance(scores, Tensor):
        raise TypeError(
            f"method {method.name!r} returned {type(scores).__name__} at layer {layer}; expected a torch.Tensor "
            f"{expected}"
        )
    if scores.dtype not in SCORE_DTYPES:
        names = ", ".join(str(dtype).removeprefix("torch.") for dtype in SCORE_DTYPES)
        raise TypeError(
            f"method {method.name!r} returned scores of dtype {str(scores.dtype).removeprefix('torch.')} at layer "
            f"{layer}; expected one of {names}"
        )
    if tuple(scores.shape) not in {tuple(pattern_shape), (batch, n_query, n_key)}:
        raise ValueError(f"method {method.name!r} returned {tuple(scores.shape)} at layer {layer}, expected {expected}")
    if method.token_level and scores.ndim == 4:
        raise ValueError(
            f"method {method.name!r} is token level but returned per-head scores {tuple(scores.shape)} at layer {layer}"
        )
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
    if not bool(torch.isfinite(scores).all()):
        raise ValueError(f"method {method.name!r} returned non-finite scores at layer {layer}")
    return scores


def prepared_score(layer: LayerInputs, context: ScoreContext) -> Tensor:
    """The scores the method's ``prepare`` computed for this layer (``value_zeroing``, ``alti_rollout``)."""
    if not isinstance(context.prepared, dict) or layer.layer not in context.prepared:
        raise ValueError(f"no prepared scores for layer {layer.layer}: run the method's prepare on this batch first")
    return context.prepared[layer.layer].to(layer.pattern.device)


def normalise_rows(scores: Float[Tensor, "*batch query key"]) -> Float[Tensor, "*batch query key"]:
    """Each query's scores divided by their sum over keys (rows of zeros stay zero)."""
    total = scores.sum(-1, keepdim=True)
    return scores / torch.where(total == 0, 1, total)
