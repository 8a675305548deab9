"""A circuit run's folder can hold one run only: a fingerprint of every input, compared before anything is reused.

``config.json`` records what the results depend on: the model (its name, dtype and tokenizer), the
task (its name, counterfactual, prompt counts and `task_fingerprint`, a hash of every prompt's ids,
answer and foil, and, for a task file, the hash of its bytes), the settings (split, seed, steps,
selection, edge counting, bootstrap resamples) and the package's version. A rerun into the folder
resumes only where all of them are the same; otherwise it is refused, naming each input that
changed (`check_run_folder`), unless asked to start afresh (`clear_run`: ``restart=True``, the
command's ``--restart``), which removes the run's own files and nothing else. The methods are not
an input of the folder: a rerun may add methods, one command at a time. Each result kept is
checked again against the prompts of the run that reuses it (`check_kept`), so no table or report
mixes two runs.

Example:
    >>> changes({"seed": 0, "version": "0.3.0"}, {"seed": 1, "version": "0.3.0"})
    ['seed 0 then, 1 now']
"""

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from contribution_lens.circuits.task import Prompts, Task

if TYPE_CHECKING:
    from contribution_lens.circuits.runner import RunSettings

CONFIG = "config.json"
WRITTEN = ("circuit_scores.safetensors", "curve-*.safetensors", "timing.json", "*.part-*.safetensors")
"""The files a run writes in each method's folder (`clear_run` removes these and nothing else)."""
TOP = (CONFIG, "circuits.csv", "report.html")
"""The files a run writes in the folder itself."""


def package_version() -> str:
    """The installed contribution-lens version (``"unknown"`` where no distribution is installed)."""
    from importlib import metadata

    try:
        return metadata.version("contribution-lens")
    except metadata.PackageNotFoundError:
        return "unknown"


def task_fingerprint(task: Task) -> str:
    """A hash of the task's prompts (`Task.fingerprints`, in order), metric, counterfactual and tokenizer.

    Example:
        >>> import torch
        >>> ids = torch.tensor([[1, 5], [2, 6]])
        >>> task = Task("toy", ids, ids + 1, torch.tensor([3, 3]), torch.tensor([4, 4]), Task.full_length(ids))
        >>> task_fingerprint(task) == task_fingerprint(task.subset(torch.tensor([0, 1]))), len(task_fingerprint(task))
        (True, 16)
    """
    digest = hashlib.blake2b(task.fingerprints().numpy().tobytes(), digest_size=8)
    digest.update(json.dumps([task.metric, task.counterfactual, task.tokenizer]).encode())
    return digest.hexdigest()


def file_fingerprint(path: str | os.PathLike) -> str:
    """The SHA-256 of a file's bytes: an edited task file is another input even where its path is the same."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def run_config(task: Task, settings: "RunSettings", extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every input of a run as ``config.json`` records it (``extra``: the model's name and dtype, the task's spec)."""
    scoring, evaluation = settings.parts(task)
    return {
        **(extra or {}),
        "task": task.name,
        "counterfactual": task.counterfactual,
        "prompts": len(task),
        "scoring_prompts": len(scoring),
        "evaluation_prompts": len(evaluation),
        "task_fingerprint": task_fingerprint(task),
        "tokenizer": task.tokenizer,
        "split": "in-sample" if settings.split is None else settings.split,
        "seed": settings.seed,
        "steps": settings.steps,
        "prune": settings.prune,
        "greedy": settings.greedy,
        "edges": settings.edges,
        "scored_limit": settings.scored,
        "bootstrap": settings.resamples,
        "version": package_version(),
    }


NAMES = {
    "task_file_sha256": "the task file's contents (SHA-256)",
    "task_fingerprint": "the prompts (their fingerprint)",
    "version": "the package version",
}
"""How a change of an input is named where its key alone would not say it."""


def changes(previous: dict[str, Any], config: dict[str, Any]) -> list[str]:
    """Each input that differs, in words: ``"seed 0 then, 1 now"``."""
    said = []
    for key in sorted(set(previous) | set(config)):
        if previous.get(key, ...) == config.get(key, ...):
            continue
        then = repr(previous[key]) if key in previous else "not recorded"
        now = repr(config[key]) if key in config else "not recorded"
        if key == "version" and key not in previous:
            then = "not recorded (an earlier version)"
        said.append(f"{NAMES.get(key, key)} {then} then, {now} now")
    return said


def check_run_folder(out: str | os.PathLike, config: dict[str, Any]) -> None:
    """Refuse a folder that holds a run of other inputs, naming each input that changed."""
    path = Path(out) / CONFIG
    if not path.exists():
        return
    try:
        previous = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not a run's config ({error}); pass --restart to start afresh") from None
    if not isinstance(previous, dict):
        raise ValueError(f"{path} is not a run's config (not a JSON object); pass --restart to start afresh")
    differ = changes(previous, config)
    if differ:
        raise ValueError(
            f"{Path(out)} holds a run of other inputs ({path}): {'; '.join(differ)}. Its results cannot be reused: "
            "pass --restart (restart=True) to discard them and start afresh, or use another --out folder"
        )


def clear_run(out: str | os.PathLike) -> None:
    """Remove what a run wrote in ``out`` (its config, table, report, and each method's results and timing)."""
    folder = Path(out)
    if not folder.is_dir():
        return
    for name in TOP:
        (folder / name).unlink(missing_ok=True)
    for method in (p for p in folder.iterdir() if p.is_dir()):
        for pattern in WRITTEN:
            for file in method.glob(pattern):
                file.unlink()
        if not any(method.iterdir()):
            shutil.rmtree(method)


def check_kept(path: Path, recorded: Prompts | None, prompts: Prompts) -> None:
    """Refuse a result kept in the folder that was computed on other prompts than this run's (None: not recorded)."""
    if recorded is None:
        raise ValueError(
            f"{path} does not record its prompts (an earlier version): pass --restart (restart=True) to compute "
            "it again"
        )
    same = len(recorded) == len(prompts) and torch.equal(
        torch.sort(recorded.fingerprints).values, torch.sort(prompts.fingerprints).values
    )
    if not same or recorded.tokenizer != prompts.tokenizer:
        raise ValueError(
            f"{path} was computed on other prompts than this run's {prompts.part} prompts ({recorded!r}, not "
            f"{prompts!r}): the folder mixes two runs; pass --restart (restart=True) to start afresh"
        )
