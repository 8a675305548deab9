"""Command line: ``contribution-lens demo | faithfulness | sinks | replicate | circuit``.

Every argument, and the output folder, is checked before a model is loaded; a mistake prints one
line ``contribution-lens: error: ...`` and exits with status 2. A run holds a lock on its output
folder, so a second run on the same folder is refused. Only the standard library is imported at
module level: ``--help`` and ``--version`` answer without importing torch.

Each subcommand is one module with ``add_arguments``, ``check`` and ``run``; its options are
fields of settings dataclasses (`contribution_lens.cli.options`).
"""

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from contribution_lens.cli import circuit, common, demo, faithfulness, options, outdir, replicate, sinks

PROG = "contribution-lens"
DESCRIPTION = (
    "Which tokens really feed an attention head's output. Every argument is checked before the model "
    "is loaded; one run at a time per output folder; an interrupted faithfulness, replicate or circuit run "
    "resumes "
    "when the same command is run again."
)
COMMANDS = {
    "demo": (demo, "per-layer table and an HTML figure for one text", "demo_out"),
    "faithfulness": (faithfulness, "causal masking of projected values: ΔPPL and accuracy", None),
    "sinks": (sinks, "attention-sink analysis and the sink-norm intervention", None),
    "replicate": (replicate, "every claim of the paper on one model: claims.json, claims.md, report.html", None),
    "circuit": (circuit, "circuit methods scored on a task: faithfulness curves, CPR and CMD (resumable)", None),
}
"""name -> (module, help, default output folder or None for a required --out)."""


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each default, unless there is none or the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or action.default is argparse.SUPPRESS or "default:" in text:
            return text
        return super()._get_help_string(action) or text


class _Parser(argparse.ArgumentParser):
    """argparse whose mistakes print one line, like the checks after it."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{PROG}: error: {message} (see {self.prog} --help)\n")


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("contribution-lens")
    except metadata.PackageNotFoundError:  # a source tree on PYTHONPATH: read __init__.py, import nothing
        for line in Path(__file__).parents[1].joinpath("__init__.py").read_text(encoding="utf-8").splitlines():
            if line.startswith("__version__"):
                return line.partition("=")[2].strip().strip("\"'")
        return "unknown"


class _VersionAction(argparse.Action):
    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help="print the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        print(f"{PROG} {_version()}")
        parser.exit(0)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description=DESCRIPTION, formatter_class=_Formatter)
    parser.add_argument("--version", action=_VersionAction)
    commands = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    for name, (module, help_text, out_default) in COMMANDS.items():
        command = commands.add_parser(name, help=help_text, formatter_class=_Formatter)
        required = () if out_default else ("out",)
        options.add_options(command, common.ModelArgs, defaults={"out": out_default}, required=required)
        module.add_arguments(command)
        command.set_defaults(check=module.check, run=module.run)
    return parser


def _lock(args: argparse.Namespace) -> Any:
    """The output folder's lock; under torchrun only rank 0 takes it (the ranks share the folder)."""
    import contextlib

    if os.environ.get("RANK", "0") != "0":
        return contextlib.nullcontext(args.out)
    return outdir.locked(args.out)


def _fail(message: str, status: int = 2) -> int:
    print(f"{PROG}: error: {' '.join(message.split())}", file=sys.stderr)
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, check every argument, lock the output folder, then load the model and run."""
    args = build_parser().parse_args(argv)
    try:
        args.check(args)
        with _lock(args):
            return int(args.run(args))
    except outdir.FolderInUseError as error:
        return _fail(f"--out {error}")
    except (ValueError, TypeError, FileNotFoundError, ModuleNotFoundError, NotADirectoryError) as error:
        return _fail(str(error))
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
