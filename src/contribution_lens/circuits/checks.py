"""What the circuit API takes, checked in one place: one function an argument, and a task against its model.

Every entry point (`Task` and its constructors, `circuit_scores`, `evaluate_circuit`, `circuit_curve`,
`CircuitScores.circuit`, `task_report`, `run_circuits` and the ``circuit`` command) checks an argument
with the one function here, so a mistake gets the same message wherever it is made, before any pass:

* numbers: `check_count` (prompts, batch sizes), `check_seed`, `check_steps`, `check_memory` (bytes),
  `check_fraction` and `check_fractions` (the sizes of a curve), `check_level` and `check_levels`,
  `check_switch`, `check_confidence`;
* token ids (`token_ids`: any integer array, never floats or bools) and a task's layout
  (`layout_problem`: right padding, each prompt's last real token, no left padding);
* a task against a model (`check_task`): its tokenizer, its ids, its length, its counterfactual;
* a circuit method's scores (`checked_scores`): a tensor of one finite number an edge (or node).

Example:
    >>> check_fractions([1.0, 0.1, 0.5])  # sorted for you
    (0.1, 0.5, 1.0)
    >>> check_memory("2GB")
    Traceback (most recent call last):
    ...
    ValueError: memory must be a positive whole number of bytes (2**30 is 1 GiB), got '2GB'
"""

import math
import numbers
import warnings
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from jaxtyping import Int
from torch import Tensor

from contribution_lens import adapter
from contribution_lens.circuits.registry import LEVELS

if TYPE_CHECKING:
    from contribution_lens.circuits.task import Task


def integer(value: Any) -> int | None:
    """``value`` as an int where it is an integer (Python, NumPy or a 0-d integer tensor; not a bool), else None."""
    if isinstance(value, bool | np.bool_):
        return None
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, Tensor) and value.ndim == 0 and not (value.dtype.is_floating_point or value.dtype.is_complex):
        return None if value.dtype == torch.bool else int(value)
    return None


def check_count(n: Any, name: str) -> int:
    """A positive integer: a number of prompts, a batch size, resamples."""
    count = integer(n)
    if count is None or count < 1:
        raise ValueError(f"{name} must be a positive integer (the number of prompts), got {n!r}")
    return count


def check_seed(seed: Any, name: str = "seed") -> int:
    """A non-negative integer: ``random.Random(-3)`` draws as ``Random(3)`` and ``Random("3")`` as another seed."""
    value = integer(seed)
    if value is None or value < 0:
        raise ValueError(
            f"{name} must be a non-negative integer, got {seed!r} (a negative seed or a string would draw "
            "another seed's prompts)"
        )
    return value


def check_steps(steps: Any) -> int:
    """Integrated-gradient steps: a positive integer."""
    value = integer(steps)
    if value is None or value < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    return value


def check_memory(memory: Any) -> int:
    """Bytes a batch's activation differences may take: a positive whole number (``2**30``, ``1e9``), as an int."""
    value = integer(memory)
    if value is None and isinstance(memory, float | np.floating) and math.isfinite(memory) and memory == int(memory):
        value = int(memory)
    if value is None or value < 1:
        raise ValueError(f"memory must be a positive whole number of bytes (2**30 is 1 GiB), got {memory!r}")
    return value


def check_fraction(fraction: Any) -> float:
    """A share of the edges (or nodes) kept, in (0, 1]."""
    number = fraction.item() if isinstance(fraction, np.generic | Tensor) and np.ndim(fraction) == 0 else fraction
    if isinstance(number, bool) or not isinstance(number, int | float) or not 0 < number <= 1:
        raise ValueError(f"fraction must be a number in (0, 1] (the share of edges or nodes kept), got {fraction!r}")
    return float(number)


def check_sizes(fractions: Any) -> tuple[float, ...]:
    """Circuit sizes, sorted: a non-empty sequence of shares in (0, 1], each once (`circuit_stability`'s sizes).

    Example:
        >>> check_sizes([0.1, 0.01])
        (0.01, 0.1)
    """
    values = _shares(fractions)
    if not values:
        raise ValueError("fractions must hold at least one size (a share in (0, 1]), got none")
    return values


def check_fractions(fractions: Any) -> tuple[float, ...]:
    """The sizes of a curve, sorted (as `check_sizes`): at least two, 1 (the whole model) among them.

    CPR and CMD are trapezoid areas over the fractions up to the whole model, so a curve without 1
    would be another area than MIB's and a curve of one size has none.
    """
    values = _shares(fractions)
    if 1.0 not in values or len(values) < 2:
        raise ValueError(
            "fractions must hold at least two sizes, 1 (the whole model) among them: CPR and CMD are areas over "
            f"the fractions up to 1; got {values}"
        )
    return values


def _shares(fractions: Any) -> tuple[float, ...]:
    """A sequence of shares in (0, 1], each once, sorted (empty where it is empty: each caller says what it needs)."""
    if isinstance(fractions, str) or not isinstance(fractions, Sequence | np.ndarray | Tensor):
        raise ValueError(f"fractions must be a sequence of shares of the edges (or nodes) kept, got {fractions!r}")
    values = []
    for fraction in list(fractions):
        try:
            values.append(check_fraction(fraction))
        except ValueError:
            raise ValueError(
                f"fractions: {fraction!r} is not a number in (0, 1] (a share of edges or nodes kept)"
            ) from None
    seen: set[float] = set()
    for value in values:
        if value in seen:
            raise ValueError(f"fractions: {value:g} is given twice; give each size once")
        seen.add(value)
    return tuple(sorted(values))


def check_level(level: Any) -> str:
    """``"edge"`` or ``"node"``."""
    if not isinstance(level, str) or level not in LEVELS:
        raise ValueError(f"level must be 'edge' or 'node', got {level!r}")
    return level


def check_levels(levels: Any) -> tuple[str, ...]:
    """Levels of a run: at least one, each of `LEVELS` once."""
    if isinstance(levels, str) or not isinstance(levels, Sequence) or not levels:
        raise ValueError(f"levels must be a non-empty sequence of 'edge' and 'node', got {levels!r}")
    checked = tuple(check_level(level) for level in levels)
    if len(set(checked)) != len(checked):
        raise ValueError(f"levels: each level once, got {levels!r}")
    return checked


def check_switch(value: Any, name: str, *, optional: bool = False) -> bool | None:
    """``value`` if it is True or False (or None where ``optional``), else a ValueError naming ``name``."""
    if (value is None and optional) or isinstance(value, bool):
        return value
    if optional:
        raise ValueError(f"{name} must be True, False or None (the method's own), got {value!r}")
    raise ValueError(f"{name} must be True or False, got {value!r}")


def check_confidence(level: Any) -> float:
    """The level of an interval, in (0, 1)."""
    if isinstance(level, bool) or not isinstance(level, int | float) or not 0 < level < 1:
        raise ValueError(f"level must lie in (0, 1), got {level!r}")
    return float(level)


MIN_INTERVAL_PROMPTS = 10
"""The fewest prompts an interval over prompts is reported without a caveat. The percentile bootstrap's 95 %
interval of a mean of ``n`` normal values is ``1.96 sqrt((n - 1) / n) / t_{0.975, n-1}`` of Student's t
interval: 0.82 at 10 prompts, 0.80 at 9, 0.63 at 5, 0 at 1 (a zero-width interval)."""


def few_prompts(n: int) -> str:
    """``"too few prompts for an interval: 3 < 10"`` where ``n < MIN_INTERVAL_PROMPTS``, else ``""``.

    Example:
        >>> few_prompts(3), few_prompts(64)
        ('too few prompts for an interval: 3 < 10', '')
    """
    return f"too few prompts for an interval: {n} < {MIN_INTERVAL_PROMPTS}" if n < MIN_INTERVAL_PROMPTS else ""


# --- token ids and a task's layout ------------------------------------------------------------------------------


def token_ids(value: Any, name: str, ndim: int) -> Tensor:
    """``value`` as int64 token ids (or positions, ``last``) of ``ndim`` axes: a tensor, a NumPy array or lists.

    Floats (even whole ones), bools and ragged lists are refused naming ``name``: ids are integers.
    Another number of axes is returned as it is, for the caller to name the shape it expects.
    """
    kind = "positions" if name == "last" else "token ids"
    if isinstance(value, Tensor):
        tensor = value
    else:
        try:
            array: np.ndarray | None = np.asarray(value)
        except (ValueError, TypeError):  # ragged lists
            array = None
        if array is None or array.dtype.kind not in "biuf":
            raise ValueError(
                f"{name} must hold integer {kind} (a tensor, a NumPy array or lists of one length), "
                f"got {type(value).__name__} {_shown(value)}"
            )
        tensor = torch.from_numpy(np.ascontiguousarray(array))
    if tensor.is_meta:
        raise ValueError(f"{name}: {kind} on the meta device have a shape but no values")
    if tensor.dtype == torch.bool or tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        hint = " (.long() if they are whole numbers)" if tensor.dtype.is_floating_point else ""
        dtype = str(tensor.dtype).replace("torch.", "")
        raise ValueError(f"{name} must hold integer {kind}, got {dtype} values{hint}")
    return tensor.to(torch.long)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_task_fields(task: "Task", metrics: Collection[str], parts: Collection[str]) -> None:
    """What `Task` checks where it is made: shapes, ``last``, answer and foil, the names, and the padding it shows.

    The padding is read from the task itself: where the positions after ``last`` hold one id (its
    pad), a prompt whose last real token is that id, or that begins with it, is refused
    (`layout_problem`); a model's own pad id is checked again by `check_task`, before any pass.
    """
    clean, corrupted = task.clean, task.corrupted
    if clean.ndim != 2 or clean.shape[0] == 0:
        raise ValueError(f"clean must be token ids [prompt pos] with at least one prompt, got {tuple(clean.shape)}")
    if clean.shape != corrupted.shape:
        raise ValueError(
            f"clean and corrupted must have the same shape (one token count a prompt), "
            f"got {tuple(clean.shape)} and {tuple(corrupted.shape)}"
        )
    for field in ("answer", "foil", "last"):
        if tuple(getattr(task, field).shape) != (clean.shape[0],):
            raise ValueError(
                f"{field} must hold one id a prompt, shape ({clean.shape[0]},), got {tuple(getattr(task, field).shape)}"
            )
    same = torch.nonzero(task.answer == task.foil)[:, 0].tolist()
    if same:
        which = f"prompt {same[0]} has" if len(same) == 1 else f"prompts {_listed(same)} have"
        raise ValueError(
            f"foil must differ from answer in every prompt; {which} one id as both ({int(task.answer[same[0]])} in "
            f"prompt {same[0]})"
        )
    if bool(((task.last < 0) | (task.last >= clean.shape[1])).any()):
        raise ValueError(f"last must index a position of the prompts, 0..{clean.shape[1] - 1}")
    if not isinstance(task.name, str) or not task.name:
        raise ValueError(f"name must be a non-empty string, got {task.name!r}")
    if task.metric not in metrics:
        raise ValueError(f"metric must be one of {sorted(metrics)}, got {task.metric!r}")
    if not isinstance(task.counterfactual, str) or not task.counterfactual:
        raise ValueError(f"counterfactual must be a non-empty name, got {task.counterfactual!r}")
    if task.part not in parts:
        raise ValueError(f"part must be one of {', '.join(parts)}, got {task.part!r}")
    if task.tokenizer is not None and not isinstance(task.tokenizer, str):
        raise ValueError(
            f"tokenizer must be a tokenizer's identity (adapter.tokenizer_identity) or None, got {task.tokenizer!r}"
        )
    problem = layout_problem(clean, corrupted, task.last, inferred_pad(clean, corrupted, task.last))
    if problem is not None:
        raise ValueError(problem)


def _listed(rows: Sequence[int]) -> str:
    return ", ".join(map(str, rows[:5])) + (", ..." if len(rows) > 5 else "")


def inferred_pad(clean: Tensor, corrupted: Tensor, last: Tensor) -> int | None:
    """The one id the positions after ``last`` hold in every prompt (its right padding), None if none or several."""
    positions = torch.arange(clean.shape[1], device=clean.device)
    after = positions[None, :] > last[:, None].to(clean.device)
    values = torch.cat([clean[after], corrupted[after].to(clean.device)]).unique()
    return int(values[0]) if values.numel() == 1 else None


def _leading(ids: Tensor, token: int) -> Tensor:
    """How many positions each row begins with ``token``."""
    return torch.cumprod((ids == token).long(), dim=1).sum(1)


def layout_problem(
    clean: Int[Tensor, "prompt pos"],
    corrupted: Int[Tensor, "prompt pos"],
    last: Int[Tensor, " prompt"],
    pad: int | None,
    bos: int | None = None,
) -> str | None:
    """What is wrong with a task's padding where its pad id is known (its own, or its model's), else None.

    A prompt is right-padded: its last real token at ``last[p]`` is not the pad id in either run (a
    corrupted prompt shorter than its clean one has padding inside, where the metric would be read),
    and it does not begin with padding (a left-padded prompt attends to its pads): two pad ids first,
    or one where the pad is not the BOS the model begins a text with and another prompt begins otherwise.
    """
    if pad is None:
        return None
    rows = torch.arange(clean.shape[0], device=clean.device)
    at_last = last.to(clean.device)
    for name, ids, other in (("corrupted", corrupted, clean), ("clean", clean, corrupted)):
        ends = (ids[rows, at_last] == pad) & (other[rows, at_last] != pad) & (at_last > 0)
        if bool(ends.any()):
            p = int(torch.nonzero(ends)[0, 0])
            return (
                f"{name}: prompt {p} ends in padding (id {pad}) at last[{p}] = {int(last[p])}, where its "
                f"{'clean' if name == 'corrupted' else 'corrupted'} prompt has a token: clean and corrupted must "
                "have the same token count (a prompt padded inside reads its metric at a pad)"
            )
    both = (clean[rows, at_last] == pad) & (corrupted[rows, at_last] == pad) & (at_last > 0)
    if bool(both.any()):
        p = int(torch.nonzero(both)[0, 0])
        return (
            f"last: last[{p}] = {int(last[p])} is a padding position (id {pad}); it must index prompt {p}'s last "
            "real token"
        )
    for name, ids in (("clean", clean), ("corrupted", corrupted)):
        leading = _leading(ids, pad)
        left = (leading >= 2) if pad == bos else (leading >= 2) | ((leading >= 1) & bool((leading == 0).any()))
        if bool(left.any()):
            p = int(torch.nonzero(left)[0, 0])
            return (
                f"{name}: prompt {p} begins with the padding id {pad}: a left-padded batch, whose prompts would "
                "attend to their padding; pad on the right and set last to each prompt's last real token"
            )
    return None


# --- a task against its model ------------------------------------------------------------------------------------


def check_task_model(model: Any, *, tokenizer: bool) -> None:
    """Refuse, before any pass, a model a circuit task cannot run on."""
    if not adapter.is_causal_model(model):
        raise ValueError(
            "model: an encoder (bidirectional attention) has no next-token prediction to explain; "
            "circuit tasks need a causal language model"
        )
    try:
        adapter.unembedding(model)
    except ValueError as error:
        raise ValueError(f"model: {error}") from None
    if tokenizer and getattr(model, "tokenizer", None) is None:
        raise ValueError("model: this task is built from text and the model has no tokenizer")


def check_tokenizer(model: Any, recorded: str | None, what: str) -> None:
    """Refuse ``what`` (a task, scores) recorded with another tokenizer than ``model``'s (None: not recorded)."""
    if recorded is None:
        return
    mine = adapter.tokenizer_identity(model)
    if recorded != mine:
        raise ValueError(
            f"{what}: its ids are of another tokenizer ({recorded}) than the model's ({mine}), so they would read as "
            "other words: build the task with this model (Task.ioi(model, ...), Task.from_jsonl(model, path))"
        )


def check_counterfactual_differs(task: "Task") -> None:
    """Refuse a task whose every corrupted prompt is its clean prompt; warn where some are."""
    same = [
        p
        for p in range(len(task))
        if torch.equal(task.clean[p, : int(task.last[p]) + 1], task.corrupted[p, : int(task.last[p]) + 1])
    ]
    if len(same) == len(task):
        raise ValueError(
            "task: every corrupted prompt is identical to its clean prompt: the counterfactual changes nothing, "
            "so no patch can move the metric (faithfulness would divide by m(clean) - m(corrupted) = 0)"
        )
    if same:
        which = "prompt" if len(same) == 1 else "prompts"
        warnings.warn(
            f"task: {len(same)} of {len(task)} prompts have a corrupted prompt identical to the clean one "
            f"({which} {_listed(same)}): the counterfactual changes nothing there, so they add nothing to "
            "faithfulness and dilute the scores' mean",
            UserWarning,
            stacklevel=3,
        )


# --- a circuit method's scores -----------------------------------------------------------------------------------


def checked_scores(values: Any, names: Sequence[str], method: str, what: str) -> Tensor:
    """A method's scores as float32 ``[item]``: one finite number for each of ``names`` (edges, or heads and MLPs).

    A NumPy array is read as a tensor; anything else, a bool or complex dtype, another shape or a NaN
    or infinite score is refused naming the method: a NaN has no place in a ranking.
    """
    if isinstance(values, np.ndarray) and values.dtype.kind in "iuf":
        values = torch.from_numpy(np.ascontiguousarray(values))
    if not isinstance(values, Tensor):
        raise ValueError(
            f"circuit method {method!r} returned a {type(values).__name__}; a score function returns a torch "
            f"tensor of one score {what}"
        )
    if values.dtype == torch.bool or values.dtype.is_complex:
        raise ValueError(f"circuit method {method!r} returned {values.dtype} scores; scores are real numbers")
    if tuple(values.shape) != (len(names),):
        plural = {"an edge": "edges", "a head or MLP": "heads and MLPs"}.get(what, "items")
        raise ValueError(
            f"circuit method {method!r}: scores of shape {tuple(values.shape)} for a graph of {len(names)} {plural}; "
            f"expected ({len(names)},)"
        )
    scores = values.detach().float().cpu()
    bad = ~torch.isfinite(scores)
    if bool(bad.any()):
        first = int(torch.nonzero(bad)[0, 0])
        raise ValueError(
            f"circuit method {method!r}: {int(bad.sum())} of {len(names)} scores are NaN or infinite (the first "
            f"{names[first]!r}: {float(scores[first])}); a circuit cannot be chosen from them"
        )
    return scores
