"""``contribution-lens circuit``: every chosen method's circuit scores and faithfulness curves on one task.

Its options are the fields of `CircuitArgs`. Before any weight is read the task is built from the
model's skeleton (its config and tokenizer: `contribution_lens.loading.load_skeleton`), so a bad
``--task`` file or a tokenizer without one-token names is refused first; ``--dry-run`` prints the
passes from the graph's size before the model loads, then times one plain pass for the estimate.
The run itself is `contribution_lens.circuits.runner.run_circuits` (resumable, split over
``torchrun``'s processes).
"""

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contribution_lens._settings import Invalid, SettingError, at_least, check_fields, option
from contribution_lens.cli import checks, common, options

TASKS = ("ioi", "induction", "capitals")
LEVELS = ("edge", "node")


def _registered() -> list[str]:
    from contribution_lens.circuits.registry import available_circuit_methods

    return available_circuit_methods()


def _method_help() -> str:
    return f"a registered circuit method ({', '.join(_registered())}; yours with register_circuit_method); repeatable"


def check_task(value: Any) -> None:
    """A built-in task's name or an existing ``.jsonl`` file."""
    expected = f"{', '.join(TASKS)} or a .jsonl file of prompts"
    if value in TASKS:
        return
    if not isinstance(value, str) or not value.endswith(".jsonl"):
        raise Invalid(expected)
    path = Path(value)
    if not path.is_file():
        raise Invalid(expected, why="no such file" if not path.exists() else "not a file")


def _each_of(what: Any, name: str) -> Any:
    """Each value one of ``what()`` (the first that is not is named)."""

    def check(values: Any) -> None:
        known = tuple(what())
        if isinstance(values, str) or not values:
            raise Invalid(f"at least one {name}: {', '.join(known)}", got=values)
        for value in values:
            if value not in known:
                raise Invalid(f"{name}: {', '.join(known)}", got=value)

    return check


@dataclass(frozen=True)
class CircuitArgs:
    """The task, the circuit methods and the sizes of a circuit run."""

    task: str = option("ioi", f"{', '.join(TASKS)} or FILE.jsonl (one prompt a line)", check=check_task)
    method: tuple[str, ...] = option(
        (),
        _method_help,
        check=_each_of(_registered, "a registered circuit method"),
        many=True,
        required=True,
    )
    level: tuple[str, ...] = option(
        LEVELS, "edge or node; repeatable (default: both; a method that scores nodes has node level only)",
        check=_each_of(lambda: LEVELS, "a level"), many=True,
    )  # fmt: skip
    n: int = option(64, "prompts (built-in tasks; a file gives its own)", check=at_least(1))
    seed: int = option(0, "seed of the prompts, the random method and the bootstrap", check=at_least(0))
    length: int = option(10, "tokens a copy (induction)", check=at_least(1))
    steps: int = option(5, "integrated-gradient steps (eap-ig)", check=at_least(1))
    edges: str = option(
        "native", "edge counting: native (a grouped-query model's k and v inputs one per key head) or mib (one per "
        "query head, MIB's ungrouped graph)", choices=("native", "mib"),
    )  # fmt: skip
    bootstrap: int = option(1000, "bootstrap resamples of the intervals", check=at_least(1))
    dry_run: bool = option(False, "print the passes and an estimated time, then stop")

    def __post_init__(self) -> None:
        check_fields(self)
        if len(set(self.method)) != len(self.method):
            raise SettingError("method", "each method once", ",".join(self.method))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    options.add_options(parser, CircuitArgs)
    # torchrun's own parser reads ``--n`` as an abbreviation of its options: under torchrun, say --prompts.
    parser.add_argument(
        "--prompts", dest="n", type=int, default=argparse.SUPPRESS, metavar="N", help="the same as --n (for torchrun)"
    )


def check(args: argparse.Namespace) -> None:
    levels = {} if args.level else {"level": LEVELS}
    args.settings = options.build(CircuitArgs, args, **levels)
    common.check(args)
    try:
        args.task_object = build_task(args.model, args.settings, skeleton=True)
    except ValueError as error:
        raise checks.UsageError(f"--task: {error}") from None


def build_task(model: Any, settings: CircuitArgs, *, skeleton: bool = False) -> Any:
    """The task of ``settings`` for ``model`` (a loaded model, or its name with ``skeleton``: tokenizer only)."""
    from contribution_lens.circuits import Task

    if skeleton:
        from contribution_lens import loading

        model = loading.load_skeleton(str(model))
    if settings.task == "ioi":
        return Task.ioi(model, n=settings.n, seed=settings.seed)
    if settings.task == "induction":
        return Task.induction(model, n=settings.n, length=settings.length, seed=settings.seed)
    if settings.task == "capitals":
        return Task.capitals(model, n=settings.n, seed=settings.seed)
    return Task.from_jsonl(settings.task, model)


def run(args: argparse.Namespace) -> int:
    from contribution_lens.circuits import Graph, runner

    settings, task = args.settings, args.task_object
    run_settings = runner.RunSettings(
        settings.method, settings.level, settings.seed, settings.steps, settings.bootstrap, settings.edges
    )
    if settings.dry_run:
        from contribution_lens import loading
        from contribution_lens.adapter import layout

        skeleton = loading.load_skeleton(str(args.model))  # the config's sizes: no weight is read
        shape = layout(skeleton)
        graph = Graph(shape.n_layers, shape.n_heads, shape.n_kv_heads, shape.pos_embed, settings.edges)
        sizes = {"length": int(task.clean.shape[1]), "d_model": int(skeleton.cfg.d_model)}
        plans = runner.plan_passes(graph, settings.method, settings.level, steps=settings.steps, **sizes)
        print(f"{task!r}; {graph}: {len(graph.components)} nodes, {len(graph.edges)} edges ({settings.edges} counting)")
        print(runner.describe_plan(plans, len(task)))
        model = common.load(args)
        forward = runner.forward_seconds(model, task)
        print(runner.describe_plan(plans, len(task), forward).splitlines()[-1])
        return 0
    model = common.load(args)
    config = {"model": str(args.model), "dtype": args.dtype, "task_spec": settings.task, "length": settings.length}
    table = runner.run_circuits(model, task, run_settings, args.out, config=config)
    if table is not None:
        import pandas as pd

        with pd.option_context("display.width", 200, "display.float_format", "{:.3f}".format):
            print(table.drop(columns=["forward_seconds"]).to_string(index=False))
        print(common.written(Path(args.out), (runner.TABLE, runner.REPORT, "{method}/*.safetensors")))
    return 0
