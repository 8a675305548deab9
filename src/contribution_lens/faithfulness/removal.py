"""Removal: rank the keys of each query by a measure, then take away the highest or lowest ranked.

Scoring. A clean forward pass (`contribution_lens.faithfulness.runner.clean_run`) scores every
visible key ``j`` for every query ``i`` at every scored layer into a `CleanRun`; the token-level
score is the sum over heads of the method's per-head score, or, with ``granularity="head"``, each
head keeps its own score and ranking.

Ranking. For query ``i`` with ``n_i`` visible keys, ``floor(r * n_i)`` are removed: the highest
ranked (*comprehensiveness*: a faithful measure hurts most) or the lowest ranked (*sufficiency*:
a faithful measure hurts least). Ranking is by ``|score|`` (``"abs"``) or by the signed score
(``"signed"``); only methods with signed scores differ between the two, so the signed variant
is reported as ``"contribution:signed"``.

Removal itself is a pattern edit (`removal_edit`); where and how it applies is the
`RemovalProtocol`'s (registered ones in `contribution_lens.faithfulness.protocols`).

Example:
    >>> import torch
    >>> scores = torch.tensor([[[3.0, -5.0, 1.0]]])  # one query, three keys
    >>> valid = torch.ones(1, 1, 3, dtype=torch.bool)
    >>> removal_keep_mask(scores, valid, ratio=0.34, mode="comprehensiveness").tolist()  # |-5| goes first
    [[[True, False, True]]]
"""

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import einops
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from contribution_lens import adapter
from contribution_lens.adapter import PatternEdit
from contribution_lens.choices import MODES
from contribution_lens.engine import LayerResults, map_layers
from contribution_lens.methods import get_method


def is_signed(method: str) -> bool:
    """Whether a registered method's scores can be negative: only those rank differently by sign."""
    return get_method(method).signed


@dataclass(frozen=True)
class Condition:
    """One removal: a method ranked one way, a mode, a ratio, and (one_layer) the masked layer."""

    method: str
    rank_by: str
    mode: str
    ratio: float
    layer: int | None = None

    @property
    def label(self) -> str:
        """The method as reported: ``"contribution:signed"`` for the signed ranking of signed scores."""
        return f"{self.method}:signed" if self.rank_by == "signed" and is_signed(self.method) else self.method


NOTHING_REMOVED = Condition("-", "abs", "-", 0.0)


def n_removed(ratio: float, n_candidates: Tensor) -> Tensor:
    """``floor(ratio * n)``, robust to ``0.7 * 10 = 7.000000000000001``-style rounding."""
    return torch.floor(ratio * n_candidates.double() + 1e-9).long()


def removal_keep_mask(
    scores: Float[Tensor, "*batch query key"],
    valid: Bool[Tensor, "*batch query key"],
    *,
    ratio: float,
    mode: str,
    rank_by: str = "abs",
) -> Bool[Tensor, "*batch query key"]:
    """Which (query, key) pairs keep their projected value.

    For each query the ``floor(ratio * n_valid)`` valid keys with the highest
    (comprehensiveness) or lowest (sufficiency) rank value are removed. Ties keep the key order.
    """
    return keep_from_rank(removal_rank(scores, valid, mode=mode, rank_by=rank_by), valid, ratio)


def removal_rank(
    scores: Float[Tensor, "*batch query key"], valid: Bool[Tensor, "*batch query key"], *, mode: str, rank_by: str
) -> Int[Tensor, "*batch query key"]:
    """Each key's place in its query's removal order (0 = removed first); the same for every ratio."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
    value = (scores.abs() if rank_by == "abs" else scores).double()
    # Invalid keys sort last in either direction, so they are never removed.
    descending = mode == "comprehensiveness"
    value = torch.where(valid, value, -math.inf if descending else math.inf)
    order = torch.argsort(value, dim=-1, descending=descending, stable=True)
    rank = torch.argsort(order, dim=-1, stable=True)
    return rank.to(torch.int16 if rank.shape[-1] < 2**15 else torch.int32)  # kept across ratios: keep it small


def keep_from_rank(
    rank: Int[Tensor, "*batch query key"], valid: Bool[Tensor, "*batch query key"], ratio: float
) -> Bool[Tensor, "*batch query key"]:
    remove = rank < n_removed(ratio, valid.sum(-1))[..., None]
    return ~(remove & valid)


@dataclass(frozen=True)
class LayerScores:
    """One scored layer of the clean run: every method's scores and which keys each query sees."""

    scores: dict[str, Float[Tensor, "batch *head query key"]]
    valid: Bool[Tensor, "batch query key"]


class CleanRun(LayerResults[LayerScores]):
    """The clean pass of a batch: its logits and, per scored layer, the scores of every method.

    ``clean[layer].scores[method]`` (or ``clean.scores[method][layer]``) is ``[batch query key]``,
    or ``[batch head query key]`` with ``granularity="head"``. ``cache`` keeps rankings across
    ratios and input deletion's keep masks per condition.
    """

    def __init__(self, layers: Mapping[int, LayerScores], **results: Any) -> None:
        super().__init__(layers, **results)
        if self.logits is None:
            raise ValueError("a clean run keeps its logits: run map_layers with keep_logits=True")
        self.cache: dict[Any, Tensor] = {}

    @property
    def scores(self) -> dict[str, dict[int, Tensor]]:
        """``scores[method][layer]``."""
        methods = next(iter(self.values())).scores
        return {name: {layer: value.scores[name] for layer, value in self.items()} for name in methods}

    @property
    def valid(self) -> Bool[Tensor, "batch query key"]:
        """Which keys each query sees (the same at every layer)."""
        return self[self.layers[-1]].valid


class RemovalProtocol:
    """How a condition removes keys: which layers are hooked and the keep mask at each.

    Subclass, give ``name`` and ``description``, implement `keep`, and add it with
    `register_protocol`; every harness then takes it by name.
    """

    name: str = ""
    description: str = ""
    renormalise: bool = False
    """Renormalise the softmax over the kept keys (deletion) or not (removal of values)."""

    text_only: bool = False
    """Refuses multiple-choice data (its measure is one position's next token)."""

    def variants(self, layers: Sequence[int]) -> list[int | None]:
        """The layer each condition masks alone, or ``[None]`` for one condition over all layers."""
        return [None]

    def loss_mask(self, batch: adapter.TokenBatch) -> Bool[Tensor, "batch pos"]:
        """The positions whose next-token loss a text record sums (default: every real token)."""
        return batch.attention_mask

    def hooked_layers(self, clean: CleanRun) -> list[int]:
        return clean.layers

    def keep(self, clean: CleanRun, condition: Condition, layer: int) -> Tensor | None:
        """Keep mask ``[batch (head) query key]`` at ``layer``, or None for no change there."""
        raise NotImplementedError

    def _ranked(self, clean: CleanRun, condition: Condition, scores: Tensor, where: Any) -> Tensor:
        """Keep mask of ``condition`` from ``scores``; the ranking is cached across ratios."""
        valid = clean.valid if scores.ndim == 3 else clean.valid[:, None].expand_as(scores)
        key = ("rank", where, condition.method, condition.rank_by, condition.mode)
        if key not in clean.cache:
            # Conditions come ratio after ratio: a few rankings per place are enough.
            stale = [k for k in clean.cache if isinstance(k, tuple) and k[:2] == ("rank", where)]
            for old in stale[: max(0, len(stale) - 3)]:
                del clean.cache[old]
            clean.cache[key] = removal_rank(scores, valid, mode=condition.mode, rank_by=condition.rank_by)
        return keep_from_rank(clean.cache[key], valid, condition.ratio)


def removal_edit(clean: CleanRun, removal: RemovalProtocol, stacked: Sequence[Condition]) -> PatternEdit:
    """The pattern edit for a batch made of ``len(stacked)`` copies of the clean batch, one per condition."""

    def edit(layer: int, pattern: Tensor, v: Tensor) -> Tensor | None:
        masks = [removal.keep(clean, condition, layer) for condition in stacked]
        if all(mask is None for mask in masks):
            return None
        full = torch.ones_like(clean.valid)
        parts = [full[:, None] if m is None else m if m.ndim == 4 else m[:, None] for m in masks]
        keep = torch.cat([p.expand(-1, pattern.shape[1], -1, -1) for p in parts]).to(pattern.device)
        kept = torch.where(keep, pattern, torch.zeros((), dtype=pattern.dtype, device=pattern.device))
        if not removal.renormalise:
            return kept
        # Only rows that lost a key are renormalised, so nothing-removed rows stay exact.
        changed = (~keep).any(-1, keepdim=True)
        total = kept.sum(-1, keepdim=True).clamp_min(torch.finfo(kept.dtype).tiny)
        return torch.where(changed, kept / total, kept)

    return edit


def _nothing(layer: adapter.LayerInputs) -> None:
    """Masked passes keep only their logits."""


def masked_forward(
    model: adapter.Model,
    batch: adapter.TokenBatch,
    clean: CleanRun,
    removal: RemovalProtocol,
    todo: Sequence[Condition],
    *,
    rows_per_pass: int | None = None,
) -> Iterator[tuple[Condition, Float[Tensor, "batch pos d_vocab"]]]:
    """Logits of each condition; conditions are stacked along the batch, ``rows_per_pass`` rows a pass.

    ``None`` stacks 64 rows on a GPU and none on a CPU, where a bigger batch is no faster per row
    and its logits (``rows x pos x d_vocab``) crowd the memory.
    """
    size = batch.tokens.shape[0]
    if rows_per_pass is None:
        rows_per_pass = 64 if batch.tokens.device.type == "cuda" else size
    per_pass = max(1, rows_per_pass // size)
    for start in range(0, len(todo), per_pass):
        stacked = list(todo[start : start + per_pass])
        copies = len(stacked)
        tiled = adapter.TokenBatch(
            einops.repeat(batch.tokens, "batch pos -> (copy batch) pos", copy=copies),
            einops.repeat(batch.attention_mask, "batch pos -> (copy batch) pos", copy=copies),
            batch.str_tokens * copies,
        )
        edit = removal_edit(clean, removal, stacked)
        result = map_layers(model, tiled, _nothing, layers=removal.hooked_layers(clean), edit=edit, keep_logits=True)
        assert result.logits is not None
        logits = result.logits
        for index, condition in enumerate(stacked):
            yield condition, logits[index * size : (index + 1) * size]
