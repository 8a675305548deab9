"""``contribution-lens demo``: a per-layer table and an HTML page for one text."""

import argparse
from dataclasses import dataclass
from pathlib import Path

from contribution_lens._settings import Invalid, check_fields, option
from contribution_lens.cli import checks, common, options

DEMO_TEXT = (
    "Alice put the red ball in the box and left the room. While she was away, Bob moved the ball "
    "from the box to the basket. When Alice came back, she looked for the ball in the box."
)


def _some_text(text: str) -> None:
    if not text.strip():
        raise Invalid("some text")


@dataclass(frozen=True)
class DemoArgs:
    """What the demo analyses."""

    text: str = option(DEMO_TEXT, "the text to analyse", check=_some_text)
    layer: int | None = option(
        None,
        "layer of the token heatmap (negative: from the end; default: "
        "the layer where contribution and attention to BOS differ most)",
    )

    def __post_init__(self) -> None:
        check_fields(self)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    options.add_options(parser, DemoArgs)


def check(args: argparse.Namespace) -> None:
    args.settings = options.build(DemoArgs, args)
    common.check(args)
    if args.settings.layer is not None:
        (layer,) = checks.layers("--layer", (args.settings.layer,), args.model)
        args.settings = DemoArgs(args.settings.text, layer)


def run(args: argparse.Namespace) -> int:
    import pandas as pd

    from contribution_lens.analyses import attention_geometry
    from contribution_lens.methods import decomposition_measures

    model = common.load(args)
    geometry = attention_geometry(model, args.settings.text)
    with pd.option_context("display.width", 120, "display.float_format", "{:.4f}".format):
        print(f"Per-layer contribution geometry of {len(geometry.str_tokens[0])} tokens on {args.model}:")
        print(geometry.layer_summary().to_string())
    title = f"contribution-lens demo: {args.model}"
    path = geometry.report(
        Path(args.out) / "demo.html",
        title=title,
        layer=args.settings.layer,
        text=args.settings.text,
        measures=decomposition_measures(),
    )
    print(f"wrote {path}")
    return 0
