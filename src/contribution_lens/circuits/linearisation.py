"""How far a linearised circuit method's own metric change is from the true one: `linearisation_error`.

``contribution``'s terms of every cut of the graph add up exactly to ``m_L(counterfactual) - m(clean)``,
the metric's change in its linearised model ``L`` (patterns and norm scales frozen at the clean pass,
MLPs replaced by their Jacobians there); ``contribution-ig``'s to the mean of the model's own metric
tangents at the midpoints of the path from the clean embeddings to the counterfactual's
(`contribution_lens.circuits.contribution`). Neither is the true change. For prompt ``p``,

    error_p = linearised_p - true_p,   linearised_p = (the method's own change),
    true_p = m_p(counterfactual) - m_p(clean),

and what bounds the method is that gap: terms that add up exactly to a change that is not the
model's explain ``L``, not the model. `Linearisation` keeps both per prompt; its interval is the
95 % percentile bootstrap of the mean error over prompts.

Cost, in forward-pass equivalents a prompt: two plain passes (the clean and the counterfactual
prompts, for ``true``) and the method's forward-mode passes without a backward pass: one for
``contribution`` (its primal and its tangent, two passes' work), ``steps`` for ``contribution-ig``.

Example (``cl.linearisation_error(model, task)`` makes such a result; here one is made by hand):
    >>> import torch
    >>> result = Linearisation("demo", "contribution", 1, torch.tensor([-5.0, -1.0]), torch.tensor([-4.0, -2.0]))
    >>> result.error.tolist(), result.mean_error, result.relative_error, result.mean_absolute_error
    ([-1.0, 1.0], 0.0, 0.0, 1.0)
"""

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from contribution_lens.adapter import Model
from contribution_lens.circuits import interchange as ic
from contribution_lens.circuits.contribution import LINEARISED_CHANGES
from contribution_lens.circuits.graph import circuit_graph
from contribution_lens.circuits.registry import DEFAULT_MEMORY
from contribution_lens.circuits.resampling import RESAMPLES, check_memory, check_steps, draws, percentile_interval
from contribution_lens.circuits.scoring import check_task
from contribution_lens.circuits.task import Task
from contribution_lens.files import Saves


@dataclass(frozen=True)
class Linearisation(Saves):
    """A linearised method's own metric change beside the true one, per prompt.

    ``linearised[p]``: the change the method's terms add up to; ``true[p]``:
    ``m_p(counterfactual) - m_p(clean)``; ``steps``: the path's points (``contribution-ig``; 1 otherwise).
    """

    task: str
    method: str
    steps: int
    linearised: Float[Tensor, " prompt"]
    true: Float[Tensor, " prompt"]
    seed: int = 0
    resamples: int = RESAMPLES

    def __post_init__(self) -> None:
        if self.linearised.shape != self.true.shape or self.linearised.ndim != 1:
            raise ValueError(
                f"linearised and true must be one value a prompt, got {tuple(self.linearised.shape)} "
                f"and {tuple(self.true.shape)}"
            )

    @property
    def error(self) -> Float[Tensor, " prompt"]:
        """``linearised - true`` per prompt."""
        return self.linearised.double() - self.true.double()

    @property
    def mean_error(self) -> float:
        """The mean over prompts of `error`: how far the change the terms add up to is from the true one."""
        return float(self.error.mean())

    @property
    def relative_error(self) -> float:
        """``|mean error| / |mean true change|``: the share of the true change the linearisation misses or adds
        (NaN where the counterfactual changes the metric by nothing on average)."""
        true = abs(float(self.true.double().mean()))
        return abs(self.mean_error) / true if true > 0 else math.nan

    @property
    def mean_absolute_error(self) -> float:
        """The mean over prompts of ``|error|`` (errors of both signs do not cancel)."""
        return float(self.error.abs().mean())

    @property
    def interval(self) -> tuple[float, float]:
        """The 95 % percentile bootstrap interval of `mean_error` over prompts."""
        rows = draws(len(self.true), self.resamples, self.seed)
        low, high = percentile_interval(self.error[rows].mean(1)).tolist()
        return low, high

    @property
    def table(self) -> pd.DataFrame:
        """One row a prompt: ``prompt``, ``true``, ``linearised``, ``error``."""
        return pd.DataFrame(
            {
                "prompt": range(len(self.true)),
                "true": self.true.double().numpy(),
                "linearised": self.linearised.double().numpy(),
                "error": self.error.numpy(),
            }
        )

    def __repr__(self) -> str:
        low, high = self.interval
        points = f"{self.steps} point{'s' if self.steps > 1 else ''}"
        return (
            f"Linearisation({self.method} on {self.task}, {points}: linearised change "
            f"{float(self.linearised.double().mean()):.4g}, true {float(self.true.double().mean()):.4g}, "
            f"error {self.mean_error:.4g} [{low:.4g}, {high:.4g}] ({100 * self.relative_error:.1f} %), "
            f"{len(self.true)} prompts)"
        )

    def figures(self) -> dict[str, Any]:
        """``prompts``: each prompt's linearised change against its true change, beside the line where they agree."""
        from contribution_lens.drawing.circuit_check_figures import linearisation_figure

        return {"prompts": linearisation_figure(self)}

    def report(self, path: str | os.PathLike) -> Path:
        from contribution_lens.drawing import html

        return html.write_html(path, repr(self), [*self.figures().items(), ("Per prompt", self.table)])


def linearisation_error(
    model: Model,
    task: Task,
    method: str = "contribution",
    *,
    steps: int = 5,
    memory: int = DEFAULT_MEMORY,
    seed: int = 0,
) -> Linearisation:
    """``method``'s own metric change (what its terms of every cut add up to) beside the true one, per prompt.

    ``method``: ``"contribution"`` or ``"contribution-ig"`` (`LINEARISED_CHANGES`); ``steps``: the path's
    points for ``contribution-ig``. Prompts are batched so that one ``[writer batch pos d_model]`` copy of the
    tangents fits ``memory`` bytes. Everything is checked before any pass.
    """
    if method not in LINEARISED_CHANGES:
        raise ValueError(
            f"method: {method!r} has no metric change of its own to compare; one of {', '.join(LINEARISED_CHANGES)}"
        )
    check_task(model, task)
    steps = check_steps(steps)
    memory = check_memory(memory)
    graph = circuit_graph(model)
    own = LINEARISED_CHANGES[method]
    # One [writer batch pos d_model] copy: the tangents every forward-mode pass keeps (no gradients, no outputs).
    size = ic.batch_size(task, len(graph.writers), int(model.cfg.d_model), 1.0, memory)
    linearised, true = [], []
    for rows in ic.batches(task, size):
        linearised.append(own.change(model, task, graph, rows, steps).double().cpu())
        with torch.inference_mode():
            corrupted = ic.metric_pass(model, task, rows, ic.Null(), corrupted=True)
            clean = ic.metric_pass(model, task, rows, ic.Null())
        true.append((corrupted.double() - clean.double()).cpu())
    return Linearisation(task.name, method, steps if own.path else 1, torch.cat(linearised), torch.cat(true), seed)
