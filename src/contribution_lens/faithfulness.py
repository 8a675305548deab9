"""Faithfulness by causal masking: remove the projected values a measure ranks highest or lowest.

Protocol (each default is a `Protocol` field):

1. A clean forward pass scores every key for every query at every layer; the token-level
   score is the sum over heads of the method's per-head score (`importance`).
2. For query ``i`` the candidates are the keys ``j <= i``. ``floor(r * (i + 1))`` of them are
   removed -- the highest ranked (*comprehensiveness*: a faithful measure hurts most) or the
   lowest ranked (*sufficiency*: a faithful measure hurts least). Ranking is by ``|score|``
   (``rank_by="abs"``, since contribution weights can be negative) or by the signed score.
3. Removal zeroes ``alpha_ij^h`` for all heads, without renormalising (see
   `contribution_lens.interventions`), at every layer in one forward pass.
4. The metric is the change in perplexity over the same predicted tokens, and beside it the
   change in mean negative log-likelihood (Δloss), which stays readable when PPL explodes.
"""

import math
from dataclasses import asdict, dataclass, field
from typing import Literal

import einops
import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor

from contribution_lens import adapter
from contribution_lens.engine import map_layers
from contribution_lens.interventions import remove_keys
from contribution_lens.methods import BUILTIN_METHODS, ScoreContext, available_methods, get_method

CONTROL = "random"
ALL_METHODS: tuple[str, ...] = BUILTIN_METHODS
MODES: tuple[str, ...] = ("comprehensiveness", "sufficiency")
DEFAULT_RATIOS: tuple[float, ...] = tuple(round(0.1 * k, 1) for k in range(10))


@dataclass(frozen=True)
class Protocol:
    """Settings of one faithfulness run (all recorded next to the results)."""

    methods: tuple[str, ...] = ALL_METHODS
    modes: tuple[str, ...] = MODES
    ratios: tuple[float, ...] = DEFAULT_RATIOS
    layers: tuple[int, ...] | None = None
    """Layers to mask (scores always come from the same layer); None = all."""
    rank_by: Literal["abs", "signed"] = "abs"
    scope: str = "inter"
    """``||o||`` of the layer or of each head. Under ``"inter"`` every (head, key) of a query
    shares ``||o_i||``, so ``output_normalized`` ranks exactly as ``value_weighted``."""
    seed: int = 0
    """Seed of the random control (combined with each sequence's id)."""

    def __post_init__(self) -> None:
        unknown = [m for m in self.methods if m not in available_methods()]
        if unknown or not self.methods:
            raise ValueError(f"unknown method(s) {unknown}; registered methods: {', '.join(available_methods())}")
        bad_modes = [m for m in self.modes if m not in MODES]
        if bad_modes or not self.modes:
            raise ValueError(f"unknown mode(s) {bad_modes}; expected some of {MODES}")
        if not self.ratios:
            raise ValueError("no ratios given")
        for ratio in self.ratios:
            if not 0 <= ratio < 1:
                raise ValueError(f"ratio {ratio} is outside [0, 1)")
        if self.scope not in ("inter", "intra"):
            raise ValueError(f"scope must be 'inter' or 'intra', got {self.scope!r}")
        if self.rank_by not in ("abs", "signed"):
            raise ValueError(f"rank_by must be 'abs' or 'signed', got {self.rank_by!r}")

    def to_dict(self) -> dict:
        return {**asdict(self), "methods": list(self.methods), "modes": list(self.modes), "ratios": list(self.ratios)}


def n_removed(ratio: float, n_candidates: Tensor) -> Tensor:
    """``floor(ratio * n)``, robust to ``0.7 * 10 = 7.000000000000001``-style rounding."""
    return torch.floor(ratio * n_candidates.double() + 1e-9).long()


def removal_keep_mask(
    scores: Float[Tensor, "batch query key"],
    valid: Bool[Tensor, "batch query key"],
    *,
    ratio: float,
    mode: str,
    rank_by: str = "abs",
) -> Bool[Tensor, "batch query key"]:
    """Which (query, key) pairs keep their projected value at one layer.

    For each query the ``floor(ratio * n_valid)`` valid keys with the highest
    (comprehensiveness) or lowest (sufficiency) rank value are removed. Ties keep the key order.
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
    value = scores.abs() if rank_by == "abs" else scores
    value = value.double()
    # Invalid keys sort last in either direction, so they are never removed.
    if mode == "comprehensiveness":
        value = torch.where(valid, value, -math.inf)
        order = torch.argsort(value, dim=-1, descending=True, stable=True)
    else:
        value = torch.where(valid, value, math.inf)
        order = torch.argsort(value, dim=-1, descending=False, stable=True)
    rank = torch.argsort(order, dim=-1, stable=True)
    remove = rank < einops.rearrange(n_removed(ratio, valid.sum(-1)), "batch query -> batch query 1")
    return ~(remove & valid)


@dataclass
class CleanRun:
    """Clean-run logits and per-layer token-level scores of every method."""

    logits: Float[Tensor, "batch pos d_vocab"]
    scores: dict[str, dict[int, Float[Tensor, "batch query key"]]]
    valid: Bool[Tensor, "batch query key"]
    layers: list[int] = field(default_factory=list)


def clean_run(model: adapter.Model, batch: adapter.TokenBatch, protocol: Protocol) -> CleanRun:
    """One forward pass scoring every key at every layer for every method (a per-layer function)."""
    layers = adapter.check_layers(model, list(protocol.layers) if protocol.layers is not None else None)
    chosen = [get_method(name) for name in protocol.methods]
    prepared = {m.name: m.prepare(model, batch, layers) for m in chosen if m.prepare is not None}
    capture = tuple(sorted({name for m in chosen for name in m.capture}))

    def on_layer(layer: adapter.LayerInputs) -> tuple[dict[str, Tensor], Tensor]:
        scores = {
            m.name: m.token_scores(
                layer,
                ScoreContext(
                    protocol.scope,  # type: ignore[arg-type]
                    protocol.seed,
                    model,
                    prepared.get(m.name),
                ),
            )
            for m in chosen
        }
        return scores, layer.decompose(protocol.scope).valid  # type: ignore[arg-type]

    result = map_layers(model, batch, on_layer, layers=layers, capture=capture, keep_logits=True)
    assert result.logits is not None
    scores = {m.name: {layer: value[0][m.name] for layer, value in result.items()} for m in chosen}
    return CleanRun(result.logits, scores, result[layers[-1]][1], layers)


def masked_logits(
    model: adapter.Model,
    batch: adapter.TokenBatch,
    clean: CleanRun,
    *,
    method: str,
    mode: str,
    ratio: float,
    rank_by: str = "abs",
) -> Float[Tensor, "batch pos d_vocab"]:
    """Logits with the chosen keys' projected values removed at every scored layer."""
    keep = {
        layer: removal_keep_mask(clean.scores[method][layer], clean.valid, ratio=ratio, mode=mode, rank_by=rank_by)
        for layer in clean.layers
    }
    result = map_layers(model, batch, lambda layer: None, layers=clean.layers, edit=remove_keys(keep), keep_logits=True)
    assert result.logits is not None
    return result.logits


def token_nll(
    logits: Float[Tensor, "batch pos d_vocab"],
    tokens: Int[Tensor, "batch pos"],
    attention_mask: Bool[Tensor, "batch pos"],
) -> tuple[Float[Tensor, " batch"], Int[Tensor, " batch"]]:
    """Summed next-token negative log-likelihood and number of predicted tokens, per sequence."""
    log_probs = F.log_softmax(logits[:, :-1].float(), dim=-1)
    target = tokens[:, 1:]
    nll = -log_probs.gather(-1, einops.rearrange(target, "batch pos -> batch pos 1"))[..., 0]
    predicted = attention_mask[:, 1:] & attention_mask[:, :-1]
    return torch.where(predicted, nll, 0).sum(-1).double(), predicted.sum(-1)


def continuation_logprob(
    logits: Float[Tensor, "batch pos d_vocab"], tokens: Int[Tensor, "batch pos"], starts: Tensor, ends: Tensor
) -> Float[Tensor, " batch"]:
    """Log-likelihood of tokens ``[start, end)`` of each sequence given everything before."""
    log_probs = F.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = log_probs.gather(-1, einops.rearrange(tokens[:, 1:], "batch pos -> batch pos 1"))[..., 0]
    positions = torch.arange(1, tokens.shape[1], device=tokens.device)
    inside = (positions[None, :] >= starts[:, None]) & (positions[None, :] < ends[:, None])
    return torch.where(inside, picked, 0).sum(-1).double()


def perplexity(nll_sum: float, n_tokens: int) -> float:
    return math.exp(nll_sum / n_tokens)
