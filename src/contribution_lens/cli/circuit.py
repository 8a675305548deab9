"""``contribution-lens circuit``: every chosen method's circuit scores and faithfulness curves on one task.

Its options are the fields of `CircuitArgs`. Before any weight is read the task is built from the
model's skeleton (its config and tokenizer: `contribution_lens.loading.load_skeleton`) and split,
so a bad ``--task`` file, a tokenizer without one-token names or a task too small to split is
refused first; ``--dry-run`` prints the passes from the graph's size before the model loads, then
times one plain pass for the estimate. By default the methods score ``--split`` of the prompts and
their circuits are evaluated on the others (as MIB scores on its train split); ``--in-sample``
scores and evaluates every prompt. The run itself is
`contribution_lens.circuits.runner.run_circuits` (resumable, split over ``torchrun``'s processes).
Before the model loads, too, a ``--out`` folder that holds a run of other inputs (another task file's
contents, seed, split, ..., or another package version: `contribution_lens.circuits.run_folder`) is
refused naming what changed; ``--restart`` discards that run's results and starts afresh.
"""

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contribution_lens._settings import Invalid, SettingError, at_least, check_fields, option
from contribution_lens.cli import checks, common, options

TASKS = ("ioi", "induction", "capitals")
LEVELS = ("edge", "node")
COUNTERFACTUALS = {
    "ioi": ("s2-io-flip", "abc"),
    "induction": ("first-copy-resampled",),
    "capitals": ("other-country",),
}
"""Each built-in task's counterfactuals, its default first (`contribution_lens.circuits.task`'s tables; a test
holds them equal): listed here so that a bad name is refused before torch is imported."""
GREEDY = {"method": None, "yes": True, "no": False}
"""``--greedy``: each method's own choice (MIB's: greedy for information flow routes), always, or never."""


def check_split(value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1:
        raise Invalid("a number in (0, 1) (the share of prompts scored; the rest are evaluated)")


def parse_split(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise Invalid("a number in (0, 1) (the share of prompts scored; the rest are evaluated)") from None


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
    counterfactual: str = option(
        "", "what the corrupted prompts ask: ioi s2-io-flip (MIB's default) or abc (Wang et al.'s); induction "
        "first-copy-resampled; capitals other-country (default: the task's first; a .jsonl file gives its own)",
        show="the task's",
    )  # fmt: skip
    split: float = option(0.5, "share of the prompts scored; the circuits are evaluated on the others",
                          parse=parse_split, check=check_split)  # fmt: skip
    in_sample: bool = option(False, "score and evaluate every prompt (in-sample; labelled so in the table)")
    scored: int = option(
        0, "score at most this many of the scoring part's prompts, its first (0: all); the evaluation part is "
        "unchanged, so a costly method (activation-patching) is scored on fewer prompts and evaluated on the same",
        check=at_least(0),
    )  # fmt: skip
    no_prune: bool = option(False, "keep the edges on no path from the embeddings to the logits (MIB prunes them)")
    greedy: str = option(
        "method",
        "greedy selection from the logits: method (each method's own, MIB's), yes or no",
        choices=tuple(GREEDY),
    )
    dry_run: bool = option(False, "print the passes and an estimated time, then stop")
    restart: bool = option(
        False, "discard the results of an earlier run in --out (its config, scores, curves, table and report) and "
        "start afresh; without it a folder of a run of other inputs is refused",
    )  # fmt: skip

    def __post_init__(self) -> None:
        check_fields(self)
        if len(set(self.method)) != len(self.method):
            raise SettingError("method", "each method once", ",".join(self.method))
        if self.counterfactual and self.task not in COUNTERFACTUALS:
            raise SettingError("counterfactual", "none with a task file (its corrupted prompts are its own)",
                               self.counterfactual)  # fmt: skip
        known = COUNTERFACTUALS.get(self.task, ())
        if self.counterfactual and self.counterfactual not in known:
            raise SettingError("counterfactual", f"one of {self.task}'s: {', '.join(known)}", self.counterfactual)

    @property
    def counterfactual_name(self) -> str:
        """The counterfactual asked for, or the task's default."""
        return self.counterfactual or COUNTERFACTUALS.get(self.task, ("custom",))[0]


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
    if not args.settings.in_sample:
        try:
            args.task_object.split(args.settings.split, seed=args.settings.seed)
        except ValueError as error:
            raise checks.UsageError(f"--split: {error} (or pass --in-sample)") from None
    if not args.settings.restart and not args.settings.dry_run:
        from contribution_lens.circuits import run_folder

        config = run_folder.run_config(args.task_object, run_settings(args.settings), run_inputs(args))
        run_folder.check_run_folder(args.out, config)


def run_inputs(args: argparse.Namespace) -> dict[str, Any]:
    """What the run folder records beside the task and the settings: the model, its dtype, the task as given."""
    settings = args.settings
    inputs = {"model": str(args.model), "dtype": args.dtype, "task_spec": settings.task, "length": settings.length}
    if settings.task not in TASKS:
        from contribution_lens.circuits import run_folder

        inputs["task_file_sha256"] = run_folder.file_fingerprint(settings.task)
    return inputs


def build_task(model: Any, settings: CircuitArgs, *, skeleton: bool = False) -> Any:
    """The task of ``settings`` for ``model`` (a loaded model, or its name with ``skeleton``: tokenizer only)."""
    from contribution_lens.circuits import Task

    if skeleton:
        from contribution_lens import loading

        model = loading.load_skeleton(str(model))
    counterfactual = settings.counterfactual_name
    if settings.task == "ioi":
        return Task.ioi(model, n=settings.n, seed=settings.seed, counterfactual=counterfactual)
    if settings.task == "induction":
        return Task.induction(
            model, n=settings.n, length=settings.length, seed=settings.seed, counterfactual=counterfactual
        )
    if settings.task == "capitals":
        return Task.capitals(model, n=settings.n, seed=settings.seed, counterfactual=counterfactual)
    return Task.from_jsonl(model, settings.task)


def run_settings(settings: CircuitArgs) -> Any:
    """The runner's settings of a command's."""
    from contribution_lens.circuits import runner

    return runner.RunSettings(
        settings.method, settings.level, settings.seed, settings.steps, settings.bootstrap,
        split=None if settings.in_sample else settings.split, prune=not settings.no_prune,
        greedy=GREEDY[settings.greedy], edges=settings.edges, scored=settings.scored or None,
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from contribution_lens.circuits import Graph, runner

    settings, task = args.settings, args.task_object
    chosen = run_settings(settings)
    if settings.dry_run:
        from contribution_lens import loading
        from contribution_lens.adapter import layout

        skeleton = loading.load_skeleton(str(args.model))  # the config's sizes: no weight is read
        shape = layout(skeleton)
        graph = Graph(shape.n_layers, shape.n_heads, shape.n_kv_heads, shape.pos_embed, settings.edges)
        sizes = {"length": int(task.clean.shape[1]), "d_model": int(skeleton.cfg.d_model)}
        plans = runner.plan_passes(graph, settings.method, settings.level, steps=settings.steps, **sizes)
        scoring, evaluation = chosen.parts(task)
        print(f"{task!r}; {graph}: {len(graph.components)} nodes, {len(graph.edges)} edges ({settings.edges} counting)")
        print(f"scoring {len(scoring)} prompts, evaluating {len(evaluation)}" + " (in-sample)" * settings.in_sample)
        counts = {"scored": len(scoring), "evaluated": len(evaluation)}
        print(runner.describe_plan(plans, len(task), **counts))
        model = common.load(args)
        forward = runner.forward_seconds(model, task)
        print(runner.describe_plan(plans, len(task), forward, **counts).splitlines()[-1])
        return 0
    model = common.load(args)
    table = runner.run_circuits(model, task, chosen, args.out, config=run_inputs(args), restart=settings.restart)
    if table is not None:
        import pandas as pd

        with pd.option_context("display.width", 200, "display.float_format", "{:.3f}".format):
            print(table.drop(columns=["forward_seconds"]).to_string(index=False))
        print(common.written(Path(args.out), (runner.TABLE, runner.REPORT, "{method}/*.safetensors")))
    return 0
