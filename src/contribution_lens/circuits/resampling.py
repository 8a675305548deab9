"""What the circuit checks share: percentile bootstrap draws, intervals, ranks, and checks of their arguments.

Each check (`contribution_lens.circuits.stability`, `~.linearisation`, `~.edge_effects`) draws its
resamples from one seeded generator, so a result computes the same interval every time it is read.

Example:
    >>> import torch
    >>> draws(3, 2, seed=0).shape
    torch.Size([2, 3])
    >>> percentile_interval(torch.arange(101.0)[:, None]).round(decimals=6).tolist()
    [[2.5, 97.5]]
    >>> average_ranks(torch.tensor([[3.0, 1.0, 3.0]])).tolist()
    [[2.5, 1.0, 2.5]]
"""

from typing import Any

import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor

RESAMPLES = 1000
"""Bootstrap resamples of an interval (as the faithfulness curve's)."""
LEVEL = 0.95


def draws(n: int, resamples: int, seed: int) -> Int[Tensor, "resample n"]:
    """``resamples`` rows of ``n`` indices drawn from ``0 .. n - 1`` with replacement."""
    return torch.randint(0, n, (resamples, n), generator=torch.Generator().manual_seed(seed))


def percentile_interval(values: Float[Tensor, "resample ..."]) -> Float[Tensor, "... 2"]:
    """The 2.5 and 97.5 percentiles over the first axis (NaN values ignored), ``[..., 2]``."""
    tail = (1 - LEVEL) / 2
    values = values.double()
    return torch.stack([values.nanquantile(tail, dim=0), values.nanquantile(1 - tail, dim=0)], dim=-1)


def average_ranks(values: Float[Tensor, "row item"]) -> Float[Tensor, "row item"]:
    """Each row's ranks from 1, ties given their average rank (as Spearman's correlation needs)."""
    ranked = pd.DataFrame(values.double().numpy()).rank(axis=1, method="average")
    return torch.from_numpy(ranked.to_numpy(dtype="float64", copy=True))


def spearman(x: Float[Tensor, "row item"], y: Float[Tensor, "row item"]) -> Float[Tensor, " row"]:
    """Spearman's rank correlation of each row of ``x`` with the same row of ``y`` (NaN where one is constant)."""
    rx, ry = average_ranks(x), average_ranks(y)
    rx = rx - rx.mean(1, keepdim=True)
    ry = ry - ry.mean(1, keepdim=True)
    norm = (rx.pow(2).sum(1) * ry.pow(2).sum(1)).sqrt()
    return torch.where(norm > 0, (rx * ry).sum(1) / norm.clamp_min(1e-300), torch.full_like(norm, float("nan")))


def check_steps(steps: Any) -> int:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    return steps


def check_memory(memory: Any) -> int:
    if isinstance(memory, bool) or not isinstance(memory, int) or memory < 1:
        raise ValueError(f"memory must be a positive number of bytes, got {memory!r}")
    return memory
