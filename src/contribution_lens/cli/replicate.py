"""``contribution-lens replicate``: every claim of the paper measured on one model (`contribution_lens.replication`).

Its options are the fields of `contribution_lens.replication.ReplicateArgs` (``--size``,
``--dry-run``), `contribution_lens.faithfulness.DataSettings` (the data and their sizes; those a
size sets default to it) and `contribution_lens.faithfulness.RunOptions`; this file reads the
model's config for the context length and runs the library.
"""

import argparse
from pathlib import Path

from contribution_lens.cli import checks, common, options
from contribution_lens.faithfulness.settings import DataSettings, RunOptions
from contribution_lens.replication.settings import SIZED, SIZES, ReplicateArgs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    options.add_options(parser, ReplicateArgs)
    options.add_options(parser, DataSettings, defaults=dict.fromkeys(SIZED))
    options.add_options(parser, RunOptions)


def check(args: argparse.Namespace) -> None:
    args.replicate = options.build(ReplicateArgs, args)
    size = SIZES[args.replicate.size]
    preset = {name: getattr(size, name) for name in SIZED if getattr(args, name) is None}
    args.data_settings = options.build(DataSettings, args, **preset)
    args.run_options = options.build(RunOptions, args)
    common.check(args)
    checks.context("--chunk-length", args.data_settings.chunk_length, args.model)
    if args.data_settings.choice:
        checks.context("--max-item-tokens", args.data_settings.max_item_tokens, args.model)


def model_flags(args: argparse.Namespace) -> list[str]:
    """``--model``, ``--device`` and ``--dtype`` as given: each claim's command repeats them."""
    words = ["--model", args.model]
    if args.device is not None:
        words += ["--device", args.device]
    if args.dtype != "float32":
        words += ["--dtype", args.dtype]
    return words


def run(args: argparse.Namespace) -> int:
    from contribution_lens import replication

    size = args.replicate.size
    if args.replicate.dry_run:
        import torch

        from contribution_lens import loading

        skeleton = loading.load_skeleton(args.model)  # config and tokenizer only: no weight is read
        dtype = getattr(torch, args.dtype)
        print(replication.plan(skeleton, args.data_settings, args.out, size=size, device=args.device, dtype=dtype)
              .describe())  # fmt: skip
        return 0
    model = common.load(args)
    result = replication.run(
        model, args.data_settings, args.out, size=size, options=args.run_options, model_name=args.model,
        model_flags=model_flags(args),
    )  # fmt: skip
    if result is not None:
        for claim in result.claims:
            print(f"{claim.id}: {claim.kind}: {claim.line}")
        print(common.written(Path(args.out), ("claims.json", "claims.md", "report.html")))
    return 0
