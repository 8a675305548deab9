"""The circuit tasks measured on the bundled models: which tasks each model does, and how well.

For each model and task: the prompts built, the clean accuracy (answer logit above the foil's) and the
mean logit difference with its 95 % bootstrap interval (`contribution_lens.circuits.task_report`).
Besides the built-in tasks (IOI, induction, capitals) it measures the candidates the third task was
chosen from, built as paired prompts: successors of days, months, letters and numbers, and a pronoun.

    python benchmarks/circuit_tasks.py                      # the three bundled decoders
    python benchmarks/circuit_tasks.py smollm2-135m         # one of them
"""

import sys
import time
import warnings

import contribution_lens as cl
from contribution_lens.circuits.task import Task
from contribution_lens.circuits.task_builders import _paired
from contribution_lens.circuits.task_checks import task_report

DAYS = "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split()
MONTHS = "January February March April May June July August September October November December".split()
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
MALE = "John Tom James Michael David Peter Paul Mark George Robert".split()
FEMALE = "Mary Sarah Lisa Emma Anna Kate Susan Helen Laura Julia".split()


def _cycle(words: list[str]) -> tuple[tuple[str, str], ...]:
    """Three consecutive words of a cycle, then the fourth as the answer."""
    n = len(words)
    return tuple(
        (f"{words[i]}, {words[(i + 1) % n]}, {words[(i + 2) % n]},", f" {words[(i + 3) % n]}") for i in range(n)
    )


CANDIDATES = {
    "successor-days": _cycle(DAYS),
    "successor-months": _cycle(MONTHS),
    "successor-letters": tuple((" ".join(LETTERS[i : i + 4]), f" {LETTERS[i + 4]}") for i in range(len(LETTERS) - 4)),
    "successor-numbers": tuple((f"{i}, {i + 1}, {i + 2}, {i + 3},", f" {i + 4}") for i in range(1, 40)),
    "pronoun": tuple((f"{name} went to the store because", " he") for name in MALE)
    + tuple((f"{name} went to the store because", " she") for name in FEMALE),
}


def main(names: list[str]) -> None:
    print("| model | task | prompts | accuracy | logit difference [95 % interval] | seconds |")
    print("|---|---|---|---|---|---|")
    for name in names:
        model = cl.load_model() if name == "smollm2-135m" else cl.load_model(name)
        builders = {
            "ioi": lambda m=model: Task.ioi(m, n=64, seed=0),
            "induction": lambda m=model: Task.induction(m, n=64, length=10, seed=0),
            "capitals": lambda m=model: Task.capitals(m, n=64, seed=0),
            **{
                task: lambda m=model, t=task, items=items: _paired(Task, m, t, items, n=64, seed=0)
                for task, items in CANDIDATES.items()
            },
        }
        for task_name, build in builders.items():
            start = time.perf_counter()
            try:
                task = build()
            except ValueError as error:
                print(f"| {name} | {task_name} | refused: {error} | | | |", flush=True)
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                r = task_report(model, task)
            seconds = time.perf_counter() - start
            print(
                f"| {name} | {task_name} | {len(task)} | {r.accuracy:.3f} | {r.mean:.2f} [{r.low:.2f}, {r.high:.2f}] "
                f"| {seconds:.1f} |",
                flush=True,
            )
        del model


if __name__ == "__main__":
    main(sys.argv[1:] or ["smollm2-135m", "gemma3-270m", "qwen2.5-0.5b"])
