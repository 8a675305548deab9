"""Paired bootstrap over texts: intervals for Δloss, AOPC, accuracy, and verdicts between methods.

For one task, text ``s`` has summed clean and masked negative log-likelihoods ``n_s``, ``m_s``
over its ``t_s`` predicted tokens. The token-weighted change in loss of a condition is

    Δloss = sum_s (m_s - n_s) / sum_s t_s,

and a bootstrap replicate draws texts with replacement (counts ``w_s``, ``sum_s w_s = S``):
``Δloss* = sum_s w_s (m_s - n_s) / sum_s w_s t_s``. The same draws serve every method, mode,
ratio and protocol (a *paired* bootstrap), so differences between methods keep their pairing.
Intervals are percentile intervals (95% by default).

The area over the perturbation curve of a method is the mean Δloss over the run's *nonzero*
ratios (with the default grid: 1, 5, 10, 20 and 50%):

    AOPC = (1 / |R|) sum_{r in R, r > 0} Δloss(r).

Ratio 0 removes nothing, so including it would only scale every AOPC by the same factor.

A verdict compares two methods ``a`` (claimed better) and ``b`` by ``AOPC(a) - AOPC(b)``:
under comprehensiveness a faithful measure removes what matters, so *larger* Δloss is better;
under sufficiency it keeps what matters, so *smaller* is better. The verdict is "better" or
"worse" when the interval of the difference lies beyond ``±tolerance`` on one side, else
"indistinguishable".

Example:
    >>> counts = resample_counts(4, resamples=3, seed=0)
    >>> counts.shape, counts.sum(axis=1).tolist()
    ((3, 4), [4, 4, 4])
"""

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

CLAIMED_ORDER: tuple[str, ...] = ("attention", "value_weighted", "output_normalized", "contribution")
"""The claimed ordering, least to most faithful."""
REFERENCE = "contribution"
COMPARED_WITH: dict[str, tuple[str, ...]] = {"kobayashi": ("attention", "value_weighted")}
"""Methods judged against the ones they are read beside: the layer-level norm against attention and
against ``value_weighted`` (the per-head norm, summed over heads at token level)."""
VERDICTS: tuple[str, ...] = ("better", "worse", "indistinguishable")
TOLERANCE = 1e-6
"""Differences within ±1e-6 nats are numerical noise (identical rankings computed twice)."""


def resample_counts(n: int, *, resamples: int, seed: int) -> np.ndarray:
    """How often each of ``n`` texts is drawn in each replicate: ``[resamples, n]`` counts."""
    if n < 1:
        raise ValueError("cannot bootstrap an empty set of texts")
    if resamples < 1:
        raise ValueError(f"resamples must be positive, got {resamples}")
    draws = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    counts = np.zeros((resamples, n), dtype=np.int64)
    np.add.at(counts, (np.arange(resamples)[:, None], draws), 1)
    return counts


def percentile_interval(samples: np.ndarray, level: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
    """Lower and upper percentile bounds over the first axis (the replicates)."""
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(samples, [tail, 100 - tail], axis=0)
    return np.asarray(low), np.asarray(high)


def judge(low: float, high: float, mode: str, tolerance: float = TOLERANCE) -> str:
    """Verdict on "a is more faithful than b" from the interval of ``AOPC(a) - AOPC(b)``."""
    if mode not in ("comprehensiveness", "sufficiency"):
        raise ValueError(f"unknown mode {mode!r}")
    sign = 1 if mode == "comprehensiveness" else -1
    low, high = sorted((sign * low, sign * high))
    if low > tolerance:
        return "better"
    if high < -tolerance:
        return "worse"
    return "indistinguishable"


def claimed_pairs(methods: Sequence[str]) -> list[tuple[str, str]]:
    """(better, worse) pairs to judge: the claimed chain's neighbours, contribution vs the rest, then `COMPARED_WITH`.

    Example:
        >>> claimed_pairs(["random", "attention", "contribution"])
        [('contribution', 'attention'), ('contribution', 'random')]
        >>> claimed_pairs(["attention", "value_weighted", "kobayashi"])
        [('value_weighted', 'attention'), ('kobayashi', 'attention'), ('kobayashi', 'value_weighted')]
    """
    chain = [m for m in CLAIMED_ORDER if m in methods]
    pairs = [(better, worse) for worse, better in itertools.pairwise(chain)]
    if REFERENCE in methods:
        pairs += [(REFERENCE, m) for m in methods if m != REFERENCE and (REFERENCE, m) not in pairs]
    for method, others in COMPARED_WITH.items():
        if method in methods:
            pairs += [(method, m) for m in others if m in methods and {(method, m), (m, method)}.isdisjoint(pairs)]
    return pairs


@dataclass(frozen=True)
class Tables:
    """Every number with its interval: Δloss per ratio, AOPC, verdicts and multiple-choice accuracy."""

    delta_loss: pd.DataFrame
    """protocol, task, mode, method, ratio, n, delta_loss, ci_low, ci_high."""
    aopc: pd.DataFrame
    """protocol, task, mode, method, aopc, ci_low, ci_high, ratios."""
    verdicts: pd.DataFrame
    """protocol, task, mode, better, worse, difference, ci_low, ci_high, verdict."""
    accuracy: pd.DataFrame
    """protocol, task, mode, method, ratio, n, accuracy, ci_low, ci_high, clean_accuracy,
    clean_ci_low, clean_ci_high, chance, above_chance."""


def bootstrap_tables(records: pd.DataFrame, *, resamples: int = 1000, seed: int = 0, level: float = 0.95) -> Tables:
    """All intervals of a faithfulness run from its records (one row per text and condition).

    Text records need ``protocol, task, kind="lm", seq, method, mode, ratio, nll, clean, tokens``;
    multiple-choice records ``kind="choice"``, ``correct``, ``clean`` and ``logprobs``.
    Texts missing a condition are left out of their task (the pairing needs every condition).
    """
    frame = records if "protocol" in records else records.assign(protocol="every_layer")
    loss: list[pd.DataFrame] = []
    aopc: list[pd.DataFrame] = []
    verdicts: list[pd.DataFrame] = []
    accuracy: list[pd.DataFrame] = []
    for (protocol, task, kind), group in frame.groupby(["protocol", "task", "kind"], sort=True):
        if kind == "lm":
            parts = _lm_tables(group, resamples=resamples, seed=seed, level=level)
            for table, part in zip((loss, aopc, verdicts), parts, strict=True):
                table.append(part.assign(protocol=protocol, task=task))
        else:
            accuracy.append(_choice_table(group, resamples=resamples, seed=seed, level=level).assign(
                protocol=protocol, task=task
            ))  # fmt: skip
    columns = {
        "delta_loss": ["protocol", "task", "mode", "method", "ratio", "n", "delta_loss", "ci_low", "ci_high"],
        "aopc": ["protocol", "task", "mode", "method", "aopc", "ci_low", "ci_high", "ratios"],
        "verdicts": ["protocol", "task", "mode", "better", "worse", "difference", "ci_low", "ci_high", "verdict"],
        "accuracy": [
            "protocol", "task", "mode", "method", "ratio", "n", "accuracy", "ci_low", "ci_high",
            "clean_accuracy", "clean_ci_low", "clean_ci_high", "chance", "above_chance",
        ],
    }  # fmt: skip
    tables = {"delta_loss": loss, "aopc": aopc, "verdicts": verdicts, "accuracy": accuracy}
    return Tables(**{name: _concat(parts, columns[name]) for name, parts in tables.items()})


def _concat(parts: list[pd.DataFrame], columns: list[str]) -> pd.DataFrame:
    # A task can contribute no row (no pair of methods to compare): it must not drop the columns.
    filled = [part for part in parts if not part.empty]
    if not filled:
        return pd.DataFrame(columns=columns)
    return pd.concat(filled, ignore_index=True).reindex(columns=columns)


def _complete(group: pd.DataFrame, value: str) -> pd.DataFrame:
    """``seq x (mode, method, ratio)`` table of ``value``, keeping texts present in every column."""
    table = group.pivot_table(index="seq", columns=["mode", "method", "ratio"], values=value, aggfunc="first")
    return table.dropna(axis=0, how="any")


def _lm_tables(
    group: pd.DataFrame, *, resamples: int, seed: int, level: float
) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    frame = group.assign(change=group["nll"].astype(float) - group["clean"].astype(float))
    change = _complete(frame, "change")
    tokens = frame.groupby("seq")["tokens"].first().reindex(change.index).to_numpy(float)
    counts = resample_counts(len(change), resamples=resamples, seed=seed)
    values = change.to_numpy(float)
    point = values.sum(0) / tokens.sum()
    samples = (counts @ values) / (counts @ tokens)[:, None]
    low, high = percentile_interval(samples, level)
    loss = pd.DataFrame(
        {
            "mode": change.columns.get_level_values("mode"),
            "method": change.columns.get_level_values("method"),
            "ratio": change.columns.get_level_values("ratio").astype(float),
            "n": len(change),
            "delta_loss": point,
            "ci_low": low,
            "ci_high": high,
        }
    )
    areas: dict[tuple[str, str], tuple[float, np.ndarray]] = {}
    aopc_rows = []
    for (mode, method), rows in loss.groupby(["mode", "method"], sort=True):
        nonzero = rows.index[rows["ratio"] > 0]
        if len(nonzero) == 0:
            continue
        area, area_samples = point[nonzero].mean(), samples[:, nonzero].mean(1)
        areas[mode, method] = (area, area_samples)
        a_low, a_high = percentile_interval(area_samples, level)
        ratios = ",".join(f"{r:g}" for r in sorted(rows.loc[nonzero, "ratio"]))
        aopc_rows.append(
            {
                "mode": mode,
                "method": method,
                "aopc": area,
                "ci_low": float(a_low),
                "ci_high": float(a_high),
                "ratios": ratios,
            }
        )
    verdict_rows = []
    for mode in sorted({mode for mode, _ in areas}):
        present = [method for m, method in areas if m == mode]
        for better, worse in claimed_pairs(present):
            difference = areas[mode, better][0] - areas[mode, worse][0]
            d_low, d_high = percentile_interval(areas[mode, better][1] - areas[mode, worse][1], level)
            verdict_rows.append(
                {
                    "mode": mode,
                    "better": better,
                    "worse": worse,
                    "difference": difference,
                    "ci_low": float(d_low),
                    "ci_high": float(d_high),
                    "verdict": judge(float(d_low), float(d_high), mode),
                }
            )
    return loss, pd.DataFrame(aopc_rows), pd.DataFrame(verdict_rows)


def _choice_table(group: pd.DataFrame, *, resamples: int, seed: int, level: float) -> pd.DataFrame:
    correct = _complete(group.assign(correct=group["correct"].astype(float)), "correct")
    per_item = group.groupby("seq").first().reindex(correct.index)
    clean = per_item["clean"].astype(float).to_numpy()
    chance = float(np.mean([1 / len(options) for options in per_item["logprobs"]]))
    counts = resample_counts(len(correct), resamples=resamples, seed=seed)
    weights = counts / len(correct)
    values = correct.to_numpy(float)
    low, high = percentile_interval(weights @ values, level)
    clean_low, clean_high = percentile_interval(weights @ clean, level)
    return pd.DataFrame(
        {
            "mode": correct.columns.get_level_values("mode"),
            "method": correct.columns.get_level_values("method"),
            "ratio": correct.columns.get_level_values("ratio").astype(float),
            "n": len(correct),
            "accuracy": values.mean(0),
            "ci_low": low,
            "ci_high": high,
            "clean_accuracy": clean.mean(),
            "clean_ci_low": float(clean_low),
            "clean_ci_high": float(clean_high),
            "chance": chance,
            "above_chance": bool(clean_low > chance),
        }
    )


def accuracy_verdicts(
    records: pd.DataFrame, *, resamples: int = 1000, seed: int = 0, level: float = 0.95
) -> pd.DataFrame:
    """The claimed ordering judged on multiple-choice accuracy, pair by pair (`claimed_pairs`).

    For item ``s`` and condition ``(method, ratio)`` the accuracy drop is ``clean_s - correct_s``;
    a method's area is its mean drop over the nonzero ratios, ``D = (1/|R|) sum_{r>0} mean_s
    (clean_s - correct_s)``, the accuracy counterpart of AOPC. ``D(a) - D(b)`` gets a paired
    bootstrap interval over items (the same draws for every method) and a verdict by `judge`: in
    comprehensiveness a faithful measure's removal hurts more (larger ``D`` is better), in
    sufficiency less.

    Args:
        records: multiple-choice records (``kind="choice"``) with ``protocol, task, seq, method,
            mode, ratio, correct, clean``.

    Returns:
        protocol, task, mode, better, worse, difference, ci_low, ci_high, verdict.

    Example:
        >>> rows = [
        ...     {"protocol": "every_layer", "task": "t", "kind": "choice", "seq": str(s), "method": m,
        ...      "mode": "comprehensiveness", "ratio": r, "clean": True,
        ...      "correct": r == 0 or (m == "attention" and s % 2 == 0)}
        ...     for s in range(8) for m in ("attention", "contribution") for r in (0.0, 0.5)
        ... ]
        >>> accuracy_verdicts(pd.DataFrame(rows), resamples=200)[["better", "difference", "verdict"]].values.tolist()
        [['contribution', 0.5, 'better']]
    """
    columns = ["protocol", "task", "mode", "better", "worse", "difference", "ci_low", "ci_high", "verdict"]
    frame = records[records["kind"] == "choice"] if "kind" in records else records
    if "protocol" not in frame:
        frame = frame.assign(protocol="every_layer")
    rows = []
    for (protocol, task, mode), group in frame.groupby(["protocol", "task", "mode"], sort=True):
        drop = group["clean"].astype(float) - group["correct"].astype(float)
        table = _complete(group.assign(drop=drop), "drop")
        nonzero = [column for column in table.columns if float(column[2]) > 0]
        if not nonzero or table.empty:
            continue
        counts = resample_counts(len(table), resamples=resamples, seed=seed) / len(table)
        areas = {}
        for method in sorted({column[1] for column in nonzero}):
            values = table[[c for c in nonzero if c[1] == method]].to_numpy(float).mean(1)
            areas[method] = (float(values.mean()), counts @ values)
        for better, worse in claimed_pairs(list(areas)):
            low, high = percentile_interval(areas[better][1] - areas[worse][1], level)
            rows.append(
                {
                    "protocol": protocol,
                    "task": task,
                    "mode": mode,
                    "better": better,
                    "worse": worse,
                    "difference": areas[better][0] - areas[worse][0],
                    "ci_low": float(low),
                    "ci_high": float(high),
                    "verdict": judge(float(low), float(high), str(mode)),
                }
            )
    return pd.DataFrame(rows, columns=columns)
