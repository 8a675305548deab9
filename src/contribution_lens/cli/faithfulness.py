"""``contribution-lens faithfulness``: causal removal of projected values, Δloss and accuracy, verdicts.

Its options are the fields of `contribution_lens.faithfulness.Settings`, `DataSettings` and
`RunOptions`; this file only reads the model's config for the layers and runs the library.
"""

import argparse
from pathlib import Path

from contribution_lens.cli import checks, common, options
from contribution_lens.faithfulness.settings import DataSettings, RunOptions, Settings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for cls in (Settings, DataSettings, RunOptions):
        options.add_options(parser, cls)
    parser.add_argument(
        "--dry-run", action="store_true", help="print the number of passes and an estimated time, then stop"
    )


def check(args: argparse.Namespace) -> None:
    args.data_settings = options.build(DataSettings, args)
    args.run_options = options.build(RunOptions, args)
    args.settings = options.build(Settings, args)
    common.check(args)
    if args.settings.layers is not None:
        layers = checks.layers("--layers", args.settings.layers, args.model)
        args.settings = options.build(Settings, args, layers=layers)
    checks.context("--chunk-length", args.data_settings.chunk_length, args.model)
    checks.text_protocols("--protocol", args.settings.protocols, args.data_settings.choice)
    if args.data_settings.choice:
        # An item the length limit lets through must still fit in the model's context.
        checks.context("--max-item-tokens", args.data_settings.max_item_tokens, args.model)


def run(args: argparse.Namespace) -> int:
    from contribution_lens import faithfulness

    model = common.load(args)
    settings, data = args.settings, args.data_settings
    if args.dry_run:
        print(faithfulness.plan_run(model, settings, data, out=args.out, options=args.run_options).describe())
        return 0
    result = faithfulness.run(model, settings, data, args.out, options=args.run_options, model_name=args.model)
    if result is not None:
        for sentence in result.verdict_sentences(with_task=True):
            print(sentence)
        print(
            common.written(Path(args.out), ("records.jsonl", "summary.csv", "aopc.csv", "verdicts.csv", "report.html"))
        )
    return 0
