"""A task against a model: whether the model can read it (`check_task`) and whether it does it (`task_report`).

`check_task` is what every function that takes a model and a task runs first, before any pass:
the task's tokenizer against the model's (`contribution_lens.adapter.tokenizer_identity`), its ids,
its padding against the model's pad id, its length against the model's context, and, for what
patches, its metric and its counterfactual. `task_report` then runs the clean prompts: the model's
accuracy and mean logit difference with a bootstrap interval, with a warning where the interval
includes 0 (the model does not do the task) or rests on too few prompts (`MIN_INTERVAL_PROMPTS`).

Example:
    >>> import torch
    >>> from contribution_lens.loading import load_skeleton
    >>> from contribution_lens.circuits.task import Task
    >>> model = load_skeleton()
    >>> ids = torch.tensor([[1, 5, 7], [1, 6, 8]])
    >>> same = Task("toy", ids, ids, torch.tensor([3, 4]), torch.tensor([5, 6]), Task.full_length(ids))
    >>> check_task(model, same)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: task: every corrupted prompt is identical to its clean prompt: the counterfactual changes nothing, ...
"""

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from jaxtyping import Float
from torch import Tensor

from contribution_lens import adapter
from contribution_lens.circuits.checks import (
    MIN_INTERVAL_PROMPTS,
    check_confidence,
    check_count,
    check_counterfactual_differs,
    check_seed,
    check_task_model,
    check_tokenizer,
    few_prompts,
    layout_problem,
)
from contribution_lens.circuits.interchange import check_metric
from contribution_lens.circuits.task import Task

Model = Any  # a TransformerBridge
__all__ = ["MIN_INTERVAL_PROMPTS", "TaskReport", "bootstrap_mean_interval", "check_task", "task_report"]


def check_task(model: Any, task: Any, *, circuit: bool = True) -> "Task":
    """Refuse, before any pass, a task this model cannot answer (each message names what to fix).

    Not a `Task`; built for another tokenizer (`contribution_lens.adapter.tokenizer_identity`); ids
    outside the vocabulary; padding the model's pad id shows to be inside a prompt or on the left
    (`layout_problem`); a prompt longer than the model's context. With ``circuit`` (every function
    that patches, not `task_report`): a metric circuits do not read, and a counterfactual identical
    to the clean prompt in every prompt (faithfulness would divide by 0; warned where only some are).
    """
    if not isinstance(task, Task):
        raise ValueError(f"task must be a contribution_lens Task, got {type(task).__name__}")
    check_tokenizer(model, task.tokenizer, "task")
    vocab = int(model.cfg.d_vocab)
    for name in ("clean", "corrupted", "answer", "foil"):
        ids = getattr(task, name)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise ValueError(f"task.{name}: token ids must lie in [0, {vocab}) (the model's vocabulary)")
    if getattr(model, "tokenizer", None) is not None:
        problem = layout_problem(
            task.clean, task.corrupted, task.last, adapter.pad_id(model), adapter.bos_to_prepend(model)
        )
        if problem is not None:
            raise ValueError(f"task.{problem}")
    limit = adapter.context_length(model)
    longest = int(task.last.max()) + 1
    if limit is not None and longest > limit:
        p = int(task.last.argmax())
        raise ValueError(f"task: prompt {p} is {longest} tokens long, more than the model's context of {limit} tokens")
    if circuit:
        check_metric(task)
        check_counterfactual_differs(task)
    return task


@dataclass(frozen=True)
class TaskReport:
    """Whether a model does a task: clean accuracy and mean logit difference with a bootstrap interval.

    ``logit_diff[p] = z_p(t_p) - z_p(f_p)`` on the clean prompts; ``accuracy`` the share with
    ``logit_diff > 0``; ``low``, ``high`` the percentile bootstrap interval (``level``) of the mean
    over prompts. ``done`` is ``low > 0``: the interval excludes 0 on the side of the answer.
    With fewer than `MIN_INTERVAL_PROMPTS` prompts the interval is too narrow to judge by, and the
    report says so (``few``, its repr).
    """

    task: str
    logit_diff: Float[Tensor, " prompt"]
    accuracy: float
    mean: float
    low: float
    high: float
    level: float = 0.95

    @property
    def done(self) -> bool:
        return self.low > 0

    @property
    def few(self) -> str:
        """What the interval lacks where the prompts are too few for one (`few_prompts`), else ``""``."""
        return few_prompts(int(self.logit_diff.shape[0]))

    def __repr__(self) -> str:
        percent = round(100 * self.level)
        note = f"; {self.few}" if self.few else ""
        return (
            f"TaskReport({self.task!r}, {self.logit_diff.shape[0]} prompts: accuracy {self.accuracy:.3f}, "
            f"logit difference {self.mean:.3f} [{self.low:.3f}, {self.high:.3f}] ({percent} %{note}))"
        )


def bootstrap_mean_interval(
    values: np.ndarray, *, resamples: int = 1000, seed: int = 0, level: float = 0.95
) -> tuple[float, float]:
    """The percentile bootstrap interval of ``values``'s mean (``resamples`` draws with replacement)."""
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(values), size=(resamples, len(values)))
    means = values[draws].mean(axis=1)
    tail = (1 - level) / 2
    return float(np.quantile(means, tail)), float(np.quantile(means, 1 - tail))


def task_report(
    model: Model, task: Task, *, batch_size: int = 16, resamples: int = 1000, seed: int = 0, level: float = 0.95
) -> TaskReport:
    """Run the clean prompts and report the model's accuracy and mean logit difference on ``task``.

    Warns (``UserWarning``) where the interval of the mean logit difference includes 0 or lies
    below it: the model does not do the task, and a circuit found for it explains noise; and where
    the prompts are too few for an interval (`MIN_INTERVAL_PROMPTS`), whatever it says. The task is
    checked against the model first (`contribution_lens.circuits.checks.check_task`: its tokenizer,
    ids, padding and length).
    """
    check_task_model(model, tokenizer=False)
    batch_size, resamples = check_count(batch_size, "batch_size"), check_count(resamples, "resamples")
    seed, level = check_seed(seed), check_confidence(level)
    check_task(model, task, circuit=False)
    diff = task.with_metric("logit_diff")
    values = []
    for start in range(0, len(task), batch_size):
        rows = slice(start, start + batch_size)
        batch = adapter.to_token_batch(model, task.clean[rows], attention_mask=task.attention_mask[rows])
        logits = adapter.forward(model, batch)[:, : batch.tokens.shape[1]]
        values.append(task.subset(torch.arange(len(task))[rows]).with_metric("logit_diff").metric_values(logits).cpu())
    logit_diff = torch.cat(values)
    array = logit_diff.double().numpy()
    low, high = bootstrap_mean_interval(array, resamples=resamples, seed=seed, level=level)
    report = TaskReport(diff.name, logit_diff, float((array > 0).mean()), float(array.mean()), low, high, level)
    if not report.done:
        warnings.warn(
            f"the model does not do the task {task.name!r}: the {round(100 * level)} % interval of its mean logit "
            f"difference, [{low:.3g}, {high:.3g}], is not above 0 (accuracy {report.accuracy:.2f}); "
            "a circuit found for it would explain noise",
            UserWarning,
            stacklevel=2,
        )
    if report.few:
        warnings.warn(
            f"task {task.name!r}: {report.few}; its {round(100 * level)} % interval [{low:.3g}, {high:.3g}] is "
            "narrower than the evidence allows, so whether the model does the task is not settled",
            UserWarning,
            stacklevel=2,
        )
    return report
