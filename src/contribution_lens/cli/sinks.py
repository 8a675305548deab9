"""``contribution-lens sinks``: the attention-sink study of text chunks (`contribution_lens.sink_study`)."""

import argparse
from dataclasses import dataclass
from pathlib import Path

from contribution_lens._settings import (
    SettingError,
    at_least,
    check_fields,
    check_prepend_bos,
    option,
    parse_prepend_bos,
)
from contribution_lens.cli import checks, common, options
from contribution_lens.faithfulness.settings import LM_TASKS, check_data_specs


@dataclass(frozen=True)
class SinksArgs:
    """Which text is studied, cut how."""

    data: tuple[str, ...] = option(
        (),
        f"NAME=PATH or NAME of a text set ({', '.join(LM_TASKS)}); repeatable",
        check=check_data_specs(LM_TASKS, text_only=True),
        many=True,
        required=True,
    )
    k: int | None = option(
        None,
        "number of sink positions (default: position 0 where the chunks start with BOS, else found per layer)",
    )
    chunk_length: int = option(256, "tokens per chunk, BOS included where there is one", check=at_least(2))
    max_chunks: int = option(16, "chunks per data set", check=at_least(1))
    batch_size: int = option(8, "chunks per forward pass", check=at_least(1))
    prepend_bos: bool | None = option(
        None,
        "start every chunk with the tokenizer's BOS: yes, no or model (default: the model's own choice, "
        "cfg.default_prepend_bos)",
        parse=parse_prepend_bos,
        check=check_prepend_bos,
        show="model",
    )

    def __post_init__(self) -> None:
        check_fields(self)
        if self.k is not None and (
            isinstance(self.k, bool) or not isinstance(self.k, int) or not 1 <= self.k < self.chunk_length
        ):
            expected = f"an integer from 1 to {{chunk_length}} - 1 ({self.chunk_length - 1})"
            raise SettingError("k", expected, self.k)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    options.add_options(parser, SinksArgs)


def check(args: argparse.Namespace) -> None:
    args.settings = options.build(SinksArgs, args)
    common.check(args)
    checks.context("--chunk-length", args.settings.chunk_length, args.model)


def run(args: argparse.Namespace) -> int:
    import pandas as pd

    from contribution_lens.analyses import sink_study
    from contribution_lens.faithfulness import data

    model = common.load(args)
    settings = args.settings
    chunks = data.text_chunks(
        model, settings.data, length=settings.chunk_length, max_chunks=settings.max_chunks,
        prepend_bos=settings.prepend_bos,
    )  # fmt: skip
    study = sink_study(model, chunks, k=settings.k, batch_size=settings.batch_size, model_name=args.model)
    study.save(args.out)
    with pd.option_context("display.width", 160, "display.float_format", "{:.4f}".format):
        print(pd.Series(study.claims).to_string())
        print(study.verdicts().to_string(index=False))
    print(common.written(Path(args.out), ("sinks.html", "sink_heads.csv", "sink_claims.json")))
    return 0
