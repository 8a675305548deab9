"""The paper's claims judged from results the package already computes: a number, its interval, a verdict.

Every claim is a `Claim`: what it says, the number it is judged on with a 95 % interval, one of
`VERDICTS`, one line a reader can check against the run's own tables, and the command that
reproduces it. Claims judged in several settings (removal protocol x data set x mode) keep one
`Cell` per setting; the claim's number and interval are those of its *weakest* cell (the one least
in its favour), so a claim reads "supported" only where every cell says so:

* supported: every cell is "better"; partly: some are; not supported: none is;
* no verdict: nothing to judge (no data given for it, or the model is at chance on the task).

Sources: `contribution_lens.faithfulness.FaithfulnessRun` (its verdicts, AOPC and accuracy tables;
`contribution_lens.faithfulness.statistics.accuracy_verdicts`), `contribution_lens.SinkStudy`
(its per-head table, per-layer interventions and `contribution_lens.claim_verdicts`'s rules) and
per-text `contribution_lens.layer_summary` rows. Intervals: the faithfulness run's paired bootstrap
over texts or items; over texts for the opening case; over (layer, head) pairs for the sink
geometry (each head's statistic is a mean over the same queries, so the mean over heads is the
pooled share); over layers for the sink-norm removal.

Example:
    >>> import pandas as pd
    >>> cells = pd.DataFrame([{"protocol": "every_layer", "task": "gsm8k", "mode": "sufficiency",
    ...     "better": "contribution", "worse": "attention", "difference": -0.012, "ci_low": -0.021,
    ...     "ci_high": -0.002, "verdict": "better"}])
    >>> claim = pair_claim("contribution_beats_attention", cells, "contribution", "attention", command="...")
    >>> claim.verdict
    'supported'
    >>> claim.line.split("; ")[0], (claim.number, claim.low, claim.high)
    ('better in 1 of 1 settings', (-0.012, -0.021, -0.002))

"""

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from contribution_lens.faithfulness.statistics import percentile_interval, resample_counts

VERDICTS: tuple[str, ...] = ("supported", "partly", "not supported", "no verdict")
NEGATIVE_HEADS = "share_heads_negative_intra_sink_contribution"
AT_CHANCE = "no verdict: the model is at chance"

STATEMENTS: dict[str, str] = {
    "opening_case": "Attention to the first token overstates what it contributes to the heads' outputs",
    "hierarchy_chain": "Faithfulness rises along attention < value-weighted < output-normalised < contribution",
    "value_weighted_beats_attention": "Value-weighted attention is more faithful than attention",
    "output_normalized_beats_value_weighted": "Output-normalised weights are more faithful than value-weighted ones",
    "contribution_beats_output_normalized": "Contribution is more faithful than output-normalised weights",
    "contribution_beats_attention": "Contribution is more faithful than attention",
    "contribution_beats_kobayashi": "Contribution is more faithful than Kobayashi et al.'s layer-level norm",
    "contribution_beats_random": "Contribution is more faithful than the random control",
    "downstream_mmlu": "On MMLU, removing what contribution ranks highest costs more accuracy than attention's",
    "downstream_winogrande": "On Winogrande, removing what contribution ranks highest costs more accuracy than "
    "attention's",
    "downstream_boolq": "On BoolQ, removing what contribution ranks highest costs more accuracy than attention's",
    "sink_factors": "The sink is attended but small: its relative norm is below the tail's and it contributes less "
    "than its attention",
    "sink_anti_alignment": "The sink's value points against the semantic tokens' output (anti-aligned)",
    "sink_interior_minimum": "The output norm is convex in the sink ratio with an interior minimum",
    "sink_active_suppression": "Sinks are active suppressors (their contribution is negative)",
    "sink_norm_removal": "Removing the sink's value norm collapses outputs into the semantic cone and raises "
    "perplexity",
}
"""Every claim a replication judges, by id, in the report's order."""
PAIRS: dict[str, tuple[str, str]] = {
    "value_weighted_beats_attention": ("value_weighted", "attention"),
    "output_normalized_beats_value_weighted": ("output_normalized", "value_weighted"),
    "contribution_beats_output_normalized": ("contribution", "output_normalized"),
    "contribution_beats_attention": ("contribution", "attention"),
    "contribution_beats_kobayashi": ("contribution", "kobayashi"),
    "contribution_beats_random": ("contribution", "random"),
}
CHAIN = (
    "value_weighted_beats_attention",
    "output_normalized_beats_value_weighted",
    "contribution_beats_output_normalized",
)


@dataclass(frozen=True)
class Cell:
    """One setting a claim is judged in: its number, interval and the library's verdict there."""

    where: str
    number: float
    low: float
    high: float
    verdict: str
    line: str
    strength: float
    """The interval's bound least in the claim's favour, signed so that > 0 favours it."""


@dataclass(frozen=True)
class Claim:
    """One claim: its number with a 95 % interval, a verdict from `VERDICTS`, a line to check, a command."""

    id: str
    statement: str
    verdict: str
    line: str
    command: str
    number: float | None = None
    low: float | None = None
    high: float | None = None
    cells: tuple[Cell, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS and not self.verdict.startswith("no verdict: "):
            raise ValueError(f"verdict must be one of {VERDICTS}, got {self.verdict!r}")

    @property
    def kind(self) -> str:
        """The verdict's word from `VERDICTS` (``no verdict: ...`` gives ``no verdict``)."""
        return "no verdict" if self.verdict.startswith("no verdict") else self.verdict

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["verdict"], out["reason"] = self.kind, self.verdict.partition(": ")[2] or None
        return {key: _finite(value) for key, value in out.items()}


def _finite(value: Any) -> Any:
    """NaN as None, so that claims.json is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    return value


def no_verdict(claim_id: str, why: str, command: str = "") -> Claim:
    """A claim nothing was measured for: ``no verdict: why``."""
    return Claim(claim_id, STATEMENTS[claim_id], f"no verdict: {why}", why, command)


def from_cells(claim_id: str, cells: Sequence[Cell], command: str, *, what: str = "settings") -> Claim:
    """A claim judged in several settings: its verdict from the cells', its number from the weakest."""
    if not cells:
        return no_verdict(claim_id, "nothing was measured for it (see the data given)", command)
    better = sum(cell.verdict == "better" for cell in cells)
    worse = [cell.where for cell in cells if cell.verdict == "worse"]
    verdict = "supported" if better == len(cells) else "partly" if better else "not supported"
    weakest = min(cells, key=lambda cell: cell.strength)
    line = f"better in {better} of {len(cells)} {what}"
    if worse:
        line += f", worse in {len(worse)}"
    line += f"; weakest: {weakest.line}"
    return Claim(
        claim_id, STATEMENTS[claim_id], verdict, line, command, weakest.number, weakest.low, weakest.high, tuple(cells)
    )


def pair_cells(verdicts: pd.DataFrame, better: str, worse: str, *, measure: str = "AOPC") -> list[Cell]:
    """The cells of "``better`` is more faithful than ``worse``" from a verdicts table (one row a setting)."""
    rows = verdicts[(verdicts["better"] == better) & (verdicts["worse"] == worse)]
    cells = []
    for _, row in rows.sort_values(["protocol", "task", "mode"]).iterrows():
        sign = 1.0 if row["mode"] == "comprehensiveness" else -1.0
        where = f"{row['protocol']} · {row['task']} · {row['mode']}"
        direction = "higher" if sign > 0 else "lower"
        line = (
            f"{where}: {measure}({better}) - {measure}({worse}) = {row['difference']:+.4f} "
            f"[{row['ci_low']:+.4f}, {row['ci_high']:+.4f}] ({direction} is better)"
        )
        if row["ci_low"] == row["ci_high"] == row["difference"] == 0:
            line += "; identical rankings"
        strength = min(sign * row["ci_low"], sign * row["ci_high"])
        cells.append(
            Cell(where, float(row["difference"]), float(row["ci_low"]), float(row["ci_high"]), row["verdict"], line,
                 float(strength))
        )  # fmt: skip
    return cells


def pair_claim(claim_id: str, verdicts: pd.DataFrame, better: str, worse: str, *, command: str) -> Claim:
    """ "``better`` is more faithful than ``worse``" in every setting of a faithfulness run's verdicts."""
    return from_cells(claim_id, pair_cells(verdicts, better, worse), command)


def chain_claim(verdicts: pd.DataFrame, *, command: str) -> Claim:
    """The hierarchy as a chain: in a setting it holds when each of its three links is "better"."""
    links = [pair_cells(verdicts, *PAIRS[link]) for link in CHAIN]
    by_setting: dict[str, list[Cell]] = {}
    for cells in links:
        for cell in cells:
            by_setting.setdefault(cell.where, []).append(cell)
    cells = []
    for where, found in sorted(by_setting.items()):
        weakest = min(found, key=lambda cell: cell.strength)
        holds = len(found) == len(CHAIN) and all(cell.verdict == "better" for cell in found)
        verdict = (
            "better" if holds else "worse" if any(cell.verdict == "worse" for cell in found) else "indistinguishable"
        )
        cells.append(Cell(where, weakest.number, weakest.low, weakest.high, verdict, weakest.line, weakest.strength))
    claim = from_cells("hierarchy_chain", cells, command)
    line = claim.line.replace("better in", "the chain holds in", 1).replace(", worse in", ", a link is worse in", 1)
    return Claim(**{**asdict(claim), "line": line.replace("weakest:", "weakest link:", 1), "cells": claim.cells})


def downstream_claim(
    task: str, accuracy: pd.DataFrame, verdicts: pd.DataFrame | None, *, command: str, clean_command: str
) -> Claim:
    """Contribution vs attention in accuracy drop on ``task``, or no verdict where the model is at chance.

    ``accuracy`` is the clean run's accuracy table (`FaithfulnessRun.tables.accuracy`): the clean
    accuracy, its interval and chance. Only where the interval's lower end is above chance are the
    removal run's ``verdicts`` (`contribution_lens.faithfulness.statistics.accuracy_verdicts`) read.
    """
    claim_id = f"downstream_{task}"
    rows = accuracy[accuracy["task"] == task]
    if rows.empty:
        return no_verdict(claim_id, f"no {task} data given (--data {task}=PATH)", clean_command)
    row = rows.iloc[0]
    clean = (
        f"clean accuracy {row['clean_accuracy']:.3f} [{row['clean_ci_low']:.3f}, {row['clean_ci_high']:.3f}] "
        f"over {int(row['n'])} items, chance {row['chance']:.3f}"
    )
    if not bool(row["above_chance"]):
        line = f"{clean}: the model is at chance (not above it by its interval): a drop under removal means nothing"
        return Claim(
            claim_id, STATEMENTS[claim_id], AT_CHANCE, line, clean_command,
            float(row["clean_accuracy"]), float(row["clean_ci_low"]), float(row["clean_ci_high"]),
        )  # fmt: skip
    if verdicts is None:
        return no_verdict(claim_id, f"{clean}; the removal run has not finished", command)
    cells = pair_cells(verdicts[verdicts["task"] == task], "contribution", "attention", measure="accuracy drop")
    claim = from_cells(claim_id, cells, command)
    return Claim(**{**asdict(claim), "line": f"{clean}; {claim.line}", "cells": claim.cells})


def bootstrap_mean(values: np.ndarray, *, resamples: int = 1000, seed: int = 0) -> tuple[float, float, float]:
    """Mean of ``values`` and its 95 % percentile-bootstrap interval (resampling the values)."""
    values = np.asarray(values, dtype=float)
    values = values[np.isfinite(values)]
    if values.size == 0:
        return float("nan"), float("nan"), float("nan")
    counts = resample_counts(values.size, resamples=resamples, seed=seed) / values.size
    low, high = percentile_interval(counts @ values)
    return float(values.mean()), float(low), float(high)


def opening_claim(
    summaries: pd.DataFrame, heads: pd.DataFrame | None, *, command: str, resamples: int = 1000, seed: int = 0
) -> Claim:
    """Attention vs contribution of the first token, per layer (`layer_summary` rows, one set a text) and head.

    ``summaries`` has ``text, layer, sink_attention, sink_contribution``; the number is the mean over
    texts of the layer-averaged gap ``attention - contribution`` (token level, heads summed), with a
    bootstrap interval over texts. ``heads`` (a sink study's per-head table) adds the share of heads
    whose intra-head sink attention exceeds the sink's contribution.

    Verdict: supported where the interval lies above 0 and attention exceeds contribution in more
    than half the layers; partly where one of the two holds; else not supported.
    """
    if summaries.empty:
        return no_verdict("opening_case", "no text data given (--data gsm8k=PATH)", command)
    gap = summaries.assign(gap=summaries["sink_attention"] - summaries["sink_contribution"])
    per_text = gap.groupby("text")["gap"].mean().to_numpy()
    number, low, high = bootstrap_mean(per_text, resamples=resamples, seed=seed)
    per_layer = gap.groupby("layer")[["sink_attention", "sink_contribution", "gap"]].mean()
    above = int((per_layer["gap"] > 0).sum())
    line = (
        f"attention to the first token minus its contribution, mean over {len(per_layer)} layers and "
        f"{len(per_text)} texts: {number:+.4f} [{low:+.4f}, {high:+.4f}]; "
        f"attention {per_layer['sink_attention'].mean():.3f} "
        f"vs contribution {per_layer['sink_contribution'].mean():.3f}; larger in {above} of {len(per_layer)} layers"
    )
    if heads is not None and {"intra_sink_attention", "intra_sink_contribution"} <= set(heads.columns):
        share = float((heads["intra_sink_attention"] > heads["intra_sink_contribution"]).mean())
        line += f" and in {share:.0%} of {len(heads)} heads (intra-head)"
    majority = above > len(per_layer) / 2
    verdict = "supported" if low > 0 and majority else "partly" if low > 0 or majority else "not supported"
    return Claim("opening_case", STATEMENTS["opening_case"], verdict, line, command, number, low, high)


def _sink_verdict(text: str) -> str:
    """`claim_verdicts`'s verdict in `VERDICTS`'s words (its reason kept in the line)."""
    if text.startswith("supported"):
        return "supported"
    return "partly" if text.startswith("partly") else "not supported"


def sink_claims(
    heads: pd.DataFrame,
    claims: dict[str, float],
    library: pd.DataFrame,
    per_layer: pd.DataFrame | None,
    *,
    command: str,
    resamples: int = 1000,
    seed: int = 0,
) -> list[Claim]:
    """The five sink claims from a `SinkStudy`: its head table, claim numbers and `claim_verdicts` rows.

    The anti-alignment, interior-minimum, suppression and sink-norm verdicts are
    `contribution_lens.claim_verdicts`'s (``contribution-lens sinks`` prints the same); the
    intervals are bootstrap intervals over heads (over layers for the sink-norm removal).
    """

    def over_heads(column: str) -> tuple[float, float, float]:
        return bootstrap_mean(heads[column].to_numpy(), resamples=resamples, seed=seed)

    def rule(start: str) -> tuple[str, str]:
        row = library[library["claim"].str.startswith(start)]
        if row.empty:
            return "no verdict: not measured", ""
        text = str(row.iloc[0]["verdict"])
        # The library's verdict, where it says more than the word (``partly (a majority, not a rule)``).
        return _sink_verdict(text), "" if text in VERDICTS else f"; {text}"

    out = [_sink_factor_claim(heads, command, resamples, seed)]
    anti, anti_low, anti_high = over_heads("negative_sink_tail_share")
    verdict, text = rule("The sink's value points against")
    out.append(
        Claim("sink_anti_alignment", STATEMENTS["sink_anti_alignment"], verdict,
              f"cos(s_i, t_i) < 0 for {anti:.1%} [{anti_low:.1%}, {anti_high:.1%}] of (head, query) pairs "
              f"(> 90 % supported, > 50 % partly){text}", command, anti, anti_low, anti_high)
    )  # fmt: skip
    interior, low, high = over_heads("interior_minimum_share")
    verdict, text = rule("The output norm is convex")
    out.append(
        Claim("sink_interior_minimum", STATEMENTS["sink_interior_minimum"], verdict,
              f"minimum strictly inside (0, 1) for {interior:.1%} [{low:.1%}, {high:.1%}] of (head, query) pairs "
              f"(> 50 % supported; median |beta* - alpha_0| = {claims['median_abs_beta_star_minus_ratio']:.3f}){text}",
              command, interior, low, high)
    )  # fmt: skip
    sink, low, high = over_heads("intra_sink_contribution")
    verdict, text = rule("Sinks are active suppressors")
    out.append(
        Claim("sink_active_suppression", STATEMENTS["sink_active_suppression"], verdict,
              f"mean intra-head contribution of the sink {sink:+.4f} [{low:+.4f}, {high:+.4f}] over {len(heads)} heads "
              f"(< 0 supported); negative in {claims.get(NEGATIVE_HEADS, float('nan')):.1%} "
              f"of heads{text}", command, sink, low, high)
    )  # fmt: skip
    out.append(_sink_norm_claim(claims, per_layer, rule, command, resamples, seed))
    return out


def _sink_factor_claim(heads: pd.DataFrame, command: str, resamples: int, seed: int) -> Claim:
    needed = {"intra_sink_relative_norm", "intra_tail_relative_norm", "intra_sink_attention", "intra_sink_contribution"}
    if not needed <= set(heads.columns):
        return no_verdict("sink_factors", "the sink study has no intra-head factors", command)
    gap = (heads["intra_tail_relative_norm"] - heads["intra_sink_relative_norm"]).to_numpy()
    smaller, low, high = bootstrap_mean(gap, resamples=resamples, seed=seed)
    attention = float(heads["intra_sink_attention"].mean())
    contribution = float(heads["intra_sink_contribution"].mean())
    cosine = float(heads.get("intra_sink_cosine", pd.Series([float("nan")])).mean())
    holds = [low > 0, contribution < attention]
    verdict = "supported" if all(holds) else "partly" if any(holds) else "not supported"
    line = (
        f"tail minus sink relative norm {smaller:+.3f} [{low:+.3f}, {high:+.3f}] (sink "
        f"{heads['intra_sink_relative_norm'].mean():.3f}, tail {heads['intra_tail_relative_norm'].mean():.3f}); "
        f"sink attention {attention:.3f}, contribution {contribution:+.3f}, cosine {cosine:+.3f} (intra-head means "
        f"over {len(heads)} heads)"
    )
    return Claim("sink_factors", STATEMENTS["sink_factors"], verdict, line, command, smaller, low, high)


def _sink_norm_claim(
    claims: dict[str, float], per_layer: pd.DataFrame | None, rule: Any, command: str, resamples: int, seed: int
) -> Claim:
    if per_layer is None or "zero_delta_ppl" not in claims:
        return no_verdict("sink_norm_removal", "the sink-norm intervention was not run", command)
    zero = per_layer.loc["zero"] if "zero" in per_layer.index.get_level_values(0) else per_layer
    rise = (zero["low_norm_cone_cosine_intervened"] - zero["low_norm_cone_cosine_clean"]).to_numpy()
    number, low, high = bootstrap_mean(rise, resamples=resamples, seed=seed)
    verdict, _ = rule("Removing the sink's value norm")
    rises = int(claims["zero_layers_where_low_norm_cone_cosine_rises"])
    line = (
        f"zeroing the sink's value: cone cosine of low-norm outputs rises by {number:+.3f} [{low:+.3f}, {high:+.3f}] "
        f"(mean over {len(rise)} layers), in {rises} of {len(rise)} layers; perplexity {claims['zero_ppl_clean']:.2f} "
        f"-> {claims['zero_ppl']:.2f} (ΔPPL {claims['zero_delta_ppl']:+.2f}); supported needs > half the layers "
        "and ΔPPL > 0"
    )
    return Claim("sink_norm_removal", STATEMENTS["sink_norm_removal"], verdict, line, command, number, low, high)
