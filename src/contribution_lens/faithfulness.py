"""Faithfulness by removal: take away what a measure ranks highest (or lowest), see the loss change.

Scoring. A clean forward pass scores every key ``j <= i`` for every query ``i`` at every scored
layer; the token-level score is the sum over heads of the method's per-head score
(`importance`), or, with ``granularity="head"``, each head keeps its own score and ranking.

Ranking. For query ``i``, ``floor(r * (i + 1))`` candidates are removed: the highest ranked
(*comprehensiveness*: a faithful measure hurts most) or the lowest ranked (*sufficiency*: a
faithful measure hurts least). Ranking is by ``|score|`` (``"abs"``) or by the signed score
(``"signed"``); both are run by default. Only methods with signed scores (contribution) differ
between the two, so the signed variant is reported as ``"contribution:signed"``.

Removal protocols (`PROTOCOLS`, selected by name in ``Protocol.protocols``):

* ``every_layer`` -- at every scored layer ``l``, the keys ranked by layer ``l``'s scores lose
  their projected value: ``alpha_ij^h`` is zeroed for all heads *without renormalising*, so
  ``o_i`` becomes ``o_i - sum_h alpha_ij^h vt_j^h`` (`contribution_lens.interventions`).
* ``one_layer`` -- the same removal at one scored layer at a time, the others untouched; a
  text's result is the mean over the scored layers. TransformerBridge's ``start_at_layer``
  still executes the blocks below the start (it only swaps the residual in), so each masked
  pass runs the whole model: this protocol costs one pass per scored layer and condition.
* ``input_deletion`` -- the token-level score averaged over the scored layers,
  ``s_ij = (1/|L|) sum_l sum_h s_ij^{h,l}``, ranks the keys of each query once; the chosen keys
  are deleted from that query's view at *every* layer: their attention weights are zeroed and
  the softmax renormalised over the remaining keys, ``alpha'_ij = alpha_ij k_ij / sum_j'
  alpha_ij' k_ij'``, which is exactly what removing those tokens from the input means for
  query ``i`` (position encodings of the remaining tokens are kept).

The ``random`` control draws uniform scores from a hash of (seed, the text's token ids,
layer, head, query, key), so a text's control never depends on its batch or padding.

Metric: the change in mean negative log-likelihood over the same predicted tokens (Δloss),
and beside it the change in perplexity.

Why ``value_weighted`` and ``output_normalized`` tie under ``scope="inter"``: the
output-normalised score is ``alpha_ij^h ||vt_j^h|| / ||o_i||`` and in the inter scope
``||o_i||`` is the norm of the whole layer output, shared by every head and key of query
``i``. Dividing all of a query's candidates by the same positive number does not change
their order, so both measures remove the same keys and give identical curves (the
verdict between them is "indistinguishable" by construction). Under ``scope="intra"`` the
norm is per head, ``||o_i^h||``, which reorders the keys once heads are summed, or use
``granularity="head"``.
"""

import math
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import einops
import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor

from contribution_lens import adapter
from contribution_lens.adapter import PatternEdit
from contribution_lens.engine import map_layers
from contribution_lens.methods import BUILTIN_METHODS, ScoreContext, available_methods, get_method

CONTROL = "random"
ALL_METHODS: tuple[str, ...] = BUILTIN_METHODS
MODES: tuple[str, ...] = ("comprehensiveness", "sufficiency")
RANKINGS: tuple[str, ...] = ("abs", "signed")


def is_signed(method: str) -> bool:
    """Whether a registered method's scores can be negative: only those rank differently by sign."""
    return get_method(method).signed


DEFAULT_RATIOS: tuple[float, ...] = (0.0, 0.01, 0.05, 0.1, 0.2, 0.5)
"""Low ratios, where the curves separate; ratio 0 checks that the hooks change nothing."""


@dataclass(frozen=True)
class Protocol:
    """Settings of one faithfulness run (all recorded next to the results)."""

    methods: tuple[str, ...] = ALL_METHODS
    modes: tuple[str, ...] = MODES
    ratios: tuple[float, ...] = DEFAULT_RATIOS
    layers: tuple[int, ...] | None = None
    """Layers whose scores rank keys (and where the masking protocols mask); None = all."""
    rank_by: tuple[str, ...] | str = RANKINGS
    scope: str = "inter"
    """``||o||`` of the layer or of each head (see the module docstring for the inter tie)."""
    seed: int = 0
    """Seed of the random control."""
    protocols: tuple[str, ...] = ("every_layer",)
    """Names in `PROTOCOLS`."""
    granularity: Literal["token", "head"] = "token"
    """Rank tokens (heads summed) or each head's keys separately (masking protocols only)."""

    def __post_init__(self) -> None:
        if isinstance(self.rank_by, str):
            object.__setattr__(self, "rank_by", (self.rank_by,))
        _check_names("method(s)", self.methods, available_methods())
        _check_names("mode(s)", self.modes, MODES)
        _check_names("ranking(s)", self.rank_by, RANKINGS)
        _check_names("protocol(s)", self.protocols, tuple(PROTOCOLS))
        if not self.ratios:
            raise ValueError("no ratios given")
        for ratio in self.ratios:
            if not 0 <= ratio < 1:
                raise ValueError(f"ratio {ratio} is outside [0, 1)")
        if self.scope not in ("inter", "intra"):
            raise ValueError(f"scope must be 'inter' or 'intra', got {self.scope!r}")
        if self.granularity not in ("token", "head"):
            raise ValueError(f"granularity must be 'token' or 'head', got {self.granularity!r}")
        if self.granularity == "head" and "input_deletion" in self.protocols:
            raise ValueError("input_deletion ranks tokens: granularity='head' needs the masking protocols")

    def to_dict(self) -> dict:
        listed = ("methods", "modes", "ratios", "rank_by", "protocols")
        return {**asdict(self), **{name: list(getattr(self, name)) for name in listed}}

    def variants(self) -> list[tuple[str, str]]:
        """(method, ranking) pairs to run: the signed ranking only where it differs from ``|score|``."""
        pairs = []
        for method in self.methods:
            for rank in self.rank_by:
                if rank == "signed" and not is_signed(method) and "abs" in self.rank_by:
                    continue
                pairs.append((method, rank))
        return pairs


def _check_names(what: str, given: Sequence[str], known: Sequence[str]) -> None:
    unknown = [name for name in given if name not in known]
    if unknown or not given:
        raise ValueError(f"unknown {what} {unknown}; expected some of {tuple(known)}")


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


@dataclass
class CleanRun:
    """Clean-run logits and the per-layer scores of every method."""

    logits: Float[Tensor, "batch pos d_vocab"]
    scores: dict[str, dict[int, Float[Tensor, "batch *head query key"]]]
    valid: Bool[Tensor, "batch query key"]
    layers: list[int] = field(default_factory=list)
    n_layers: int = 0
    cache: dict[Any, Tensor] = field(default_factory=dict)
    """Rankings reused across ratios, and input deletion's keep mask per condition."""


def clean_run(model: adapter.Model, batch: adapter.TokenBatch, protocol: Protocol) -> CleanRun:
    """One forward pass scoring every key at every scored layer for every method (a per-layer function).

    Scores are token level (summed over heads) or, with ``granularity="head"``, per head.
    """
    layers = adapter.check_layers(model, list(protocol.layers) if protocol.layers is not None else None)
    chosen = [get_method(name) for name in protocol.methods]
    prepared = {m.name: m.prepare(model, batch, layers) for m in chosen if m.prepare is not None}
    capture = tuple(sorted({name for m in chosen for name in m.capture}))
    per_head = protocol.granularity == "head"

    def on_layer(layer: adapter.LayerInputs) -> tuple[dict[str, Tensor], Tensor]:
        scores = {}
        for m in chosen:
            context = ScoreContext(protocol.scope, protocol.seed, model, prepared.get(m.name))  # type: ignore[arg-type]
            scores[m.name] = m.head_scores(layer, context) if per_head else m.token_scores(layer, context)
        return scores, layer.decompose(protocol.scope).valid  # type: ignore[arg-type]

    result = map_layers(model, batch, on_layer, layers=layers, capture=capture, keep_logits=True)
    assert result.logits is not None
    scores = {m.name: {layer: value[0][m.name] for layer, value in result.items()} for m in chosen}
    return CleanRun(result.logits, scores, result[layers[-1]][1], layers, adapter.n_layers(model))


class RemovalProtocol:
    """How a condition removes keys: which layers are hooked and the keep mask at each.

    Subclass, give ``name`` and ``description``, implement `keep`, and add it with
    `register_protocol`; every harness then takes it by name.
    """

    name: str = ""
    description: str = ""
    renormalise: bool = False
    """Renormalise the softmax over the kept keys (deletion) or not (removal of values)."""

    def variants(self, layers: Sequence[int]) -> list[int | None]:
        """The layer each condition masks alone, or ``[None]`` for one condition over all layers."""
        return [None]

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


class EveryLayer(RemovalProtocol):
    name, description = "every_layer", "masking at every layer"

    def keep(self, clean: CleanRun, condition: Condition, layer: int) -> Tensor | None:
        if condition.ratio == 0:
            return None
        return self._ranked(clean, condition, clean.scores[condition.method][layer], layer)


class OneLayer(RemovalProtocol):
    name, description = "one_layer", "masking at one layer at a time"

    def variants(self, layers: Sequence[int]) -> list[int | None]:
        return list(layers)

    def keep(self, clean: CleanRun, condition: Condition, layer: int) -> Tensor | None:
        if condition.ratio == 0 or condition.layer != layer:
            return None
        return self._ranked(clean, condition, clean.scores[condition.method][layer], layer)


class InputDeletion(RemovalProtocol):
    name, description, renormalise = "input_deletion", "input-token deletion", True

    def hooked_layers(self, clean: CleanRun) -> list[int]:
        return list(range(clean.n_layers))

    def keep(self, clean: CleanRun, condition: Condition, layer: int) -> Tensor | None:
        if condition.ratio == 0:
            return None
        if condition not in clean.cache:
            mean_key = ("mean", condition.method)
            if mean_key not in clean.cache:
                per_layer = clean.scores[condition.method]
                clean.cache[mean_key] = torch.stack([per_layer[layer] for layer in clean.layers]).mean(0)
            clean.cache[condition] = self._ranked(clean, condition, clean.cache[mean_key], "mean")
        return clean.cache[condition]


PROTOCOLS: dict[str, RemovalProtocol] = {}


def register_protocol(protocol: RemovalProtocol) -> RemovalProtocol:
    """Add a removal protocol to `PROTOCOLS` under its name (replacing one of the same name)."""
    if not protocol.name:
        raise ValueError("a removal protocol needs a name")
    PROTOCOLS[protocol.name] = protocol
    return protocol


for _protocol in (EveryLayer(), OneLayer(), InputDeletion()):
    register_protocol(_protocol)


def conditions(protocol: Protocol, ratios: Sequence[float], layers: Sequence[int | None]) -> list[Condition]:
    """Every (method, ranking, mode, nonzero ratio, layer variant) of a run, in a fixed order."""
    return [
        Condition(method, rank, mode, ratio, layer)
        for method, rank in protocol.variants()
        for mode in protocol.modes
        for ratio in ratios
        if ratio > 0
        for layer in layers
    ]


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
