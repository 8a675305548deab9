"""Command line: ``contribution-lens demo`` (and the analyses registered below)."""

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

DEMO_TEXT = (
    "Alice put the red ball in the box and left the room. While she was away, Bob moved the ball "
    "from the box to the basket. When Alice came back, she looked for the ball in the box."
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _demo(args: argparse.Namespace) -> int:
    import pandas as pd

    from contribution_lens import attention_geometry, load_model, plot, report

    model = load_model(args.model, device=args.device, dtype=DTYPES[args.dtype])
    geometry = attention_geometry(model, args.text, scope="inter")
    table = geometry.layer_summary()
    with pd.option_context("display.width", 120, "display.float_format", "{:.4f}".format):
        print(f"Per-layer contribution geometry of {len(geometry.str_tokens[0])} tokens on {args.model}:")
        print(table.to_string())
    layer = (
        args.layer
        if args.layer is not None
        else int(table["sink_contribution"].sub(table["sink_attention"]).abs().idxmax())
    )
    query = len(geometry.str_tokens[0]) - 1
    sink_attention = torch.stack([geometry[layer].attention[0, :, 1:, 0].mean(-1) for layer in sorted(geometry.layers)])
    sink_contribution = torch.stack(
        [geometry[layer].contribution[0, :, 1:, 0].mean(-1) for layer in sorted(geometry.layers)]
    )
    path = report.write_html(
        Path(args.out) / "demo.html",
        f"contribution-lens demo: {args.model}",
        [
            ("Text", args.text),
            ("Per-layer summary", table),
            ("Attention to the first token (BOS), per head", plot.head_grid(sink_attention, title="attention to BOS")),
            (
                "Contribution of the first token (BOS), per head",
                plot.head_grid(sink_contribution, title="contribution of BOS (inter-head)", signed=True),
            ),
            (f"Token-level contribution at layer {layer}", plot.token_heatmap(geometry, layer=layer)),
            (
                f"Four measures for the last query at layer {layer}",
                plot.compare_measures(geometry, layer=layer, query=query),
            ),
        ],
    )
    print(f"wrote {path}")
    return 0


def _ratios(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"ratios must be comma-separated numbers, got {text!r}") from error
    return values


def _faithfulness(args: argparse.Namespace) -> int:
    import pandas as pd

    from contribution_lens import evaluation, faithfulness, load_model

    methods = faithfulness.ALL_METHODS if args.methods == "all" else tuple(args.methods.split(","))
    protocol = faithfulness.Protocol(
        methods=methods,
        modes=tuple(args.modes.split(",")),
        ratios=args.ratios,
        layers=None if args.layers is None else tuple(int(x) for x in args.layers.split(",")),
        rank_by=args.rank_by,
        seed=args.seed,
    )
    lm = tuple(spec for spec in args.data if evaluation._task_name(spec) not in evaluation.data.CHOICE_TASKS)
    choice = tuple(spec for spec in args.data if evaluation._task_name(spec) in evaluation.data.CHOICE_TASKS)
    config = evaluation.RunConfig(
        lm=lm,
        choice=choice,
        chunk_length=args.chunk_length,
        max_chunks=args.max_chunks,
        max_items=args.max_items,
        max_item_tokens=args.max_item_tokens,
        batch_size=args.batch_size,
        choice_ratios=args.choice_ratios,
    )
    model = load_model(args.model, device=args.device, dtype=DTYPES[args.dtype])
    summary = evaluation.run_faithfulness(model, config, protocol, args.out, model_name=args.model)
    if summary is not None:
        with pd.option_context("display.width", 160, "display.max_rows", 500, "display.float_format", "{:.4f}".format):
            print(evaluation.mean_over_ratios(summary).to_string())
        print(f"wrote {args.out}/records.jsonl, summary.csv and report.html")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="contribution-lens", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="per-layer table and an HTML figure for one text")
    demo.add_argument("--model", default="smollm2-135m", help="bundled name, HF id or checkpoint path")
    demo.add_argument("--text", default=DEMO_TEXT)
    demo.add_argument("--layer", type=int, default=None, help="layer for the token heatmap")
    demo.add_argument("--out", default="demo_out", help="output folder")
    demo.add_argument("--device", default=None)
    demo.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    demo.set_defaults(run=_demo)

    faith = commands.add_parser("faithfulness", help="causal masking of projected values: ΔPPL and accuracy")
    faith.add_argument("--model", default="smollm2-135m")
    faith.add_argument(
        "--data",
        action="append",
        required=True,
        help="NAME=PATH or NAME (gsm8k, fineweb, text, mmlu, winogrande, boolq); repeatable",
    )
    faith.add_argument("--methods", default="all", help="comma-separated, or 'all' (four measures + random)")
    faith.add_argument("--modes", default="comprehensiveness,sufficiency")
    faith.add_argument("--ratios", type=_ratios, default=(0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9))
    faith.add_argument("--choice-ratios", type=_ratios, default=None, help="ratios for multiple-choice sets")
    faith.add_argument("--layers", default=None, help="comma-separated layers to mask (default: all)")
    faith.add_argument("--rank-by", choices=("abs", "signed"), default="abs")
    faith.add_argument("--seed", type=int, default=0)
    faith.add_argument("--chunk-length", type=int, default=256)
    faith.add_argument("--max-chunks", type=int, default=200)
    faith.add_argument("--max-items", type=int, default=200)
    faith.add_argument("--max-item-tokens", type=int, default=512)
    faith.add_argument("--batch-size", type=int, default=8)
    faith.add_argument("--out", required=True)
    faith.add_argument("--device", default=None)
    faith.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    faith.set_defaults(run=_faithfulness)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except (ValueError, FileNotFoundError, ModuleNotFoundError) as error:
        print(f"contribution-lens: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
