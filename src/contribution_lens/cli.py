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
        scope=args.scope,
        seed=args.seed,
    )
    lm = tuple(spec for spec in args.data if evaluation.task_name(spec) not in evaluation.data.CHOICE_TASKS)
    choice = tuple(spec for spec in args.data if evaluation.task_name(spec) in evaluation.data.CHOICE_TASKS)
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


def _sinks(args: argparse.Namespace) -> int:
    import json

    import pandas as pd

    from contribution_lens import data, load_model, plot, report, run_sink_intervention, sink_analysis

    model = load_model(args.model, device=args.device, dtype=DTYPES[args.dtype])
    chunks = []
    for spec in args.data:
        texts = data.load_texts(spec)
        bos = int(model.tokenizer.bos_token_id)
        chunks.append(
            data.chunk_tokens(
                model.tokenizer, texts, length=args.chunk_length, bos_token_id=bos, max_chunks=args.max_chunks
            )
        )
    tokens = torch.cat(chunks)
    analysis = sink_analysis(model, tokens, k=args.k)
    heads = analysis.head_table()
    claims = analysis.claims()
    interventions = {
        v: run_sink_intervention(model, tokens, variant=v, k=args.k, batch_size=args.batch_size)
        for v in ("zero", "mean_tail")
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    heads.to_csv(out / "sink_heads.csv")
    effect = pd.DataFrame(
        [
            {"variant": v, "ppl_clean": r.ppl_clean, "ppl": r.ppl, "delta_ppl": r.delta_ppl, "delta_loss": r.delta_loss}
            for v, r in interventions.items()
        ]
    ).set_index("variant")
    per_layer = pd.concat({v: r.per_layer for v, r in interventions.items()}, names=["variant"])
    per_layer.to_csv(out / "sink_intervention_layers.csv")
    claims |= {f"{v}_{k}": float(x) for v, r in effect.iterrows() for k, x in r.items()}
    for scope in ("intra", "inter"):
        claims[f"share_heads_negative_{scope}_sink_contribution"] = float(
            (heads[f"{scope}_sink_contribution"] < 0).mean()
        )
    for part in ("sink", "tail"):
        for factor in ("attention", "relative_norm", "cosine", "contribution"):
            claims[f"mean_intra_{part}_{factor}"] = float(heads[f"intra_{part}_{factor}"].mean())
    for v in interventions:
        layer_rows = per_layer.loc[v]
        for column in ("output_norm", "low_norm_cone_cosine"):
            for run in ("clean", "intervened"):
                claims[f"{v}_mean_{column}_{run}"] = float(layer_rows[f"{column}_{run}"].mean())
        rises = layer_rows["low_norm_cone_cosine_intervened"] > layer_rows["low_norm_cone_cosine_clean"]
        claims[f"{v}_layers_where_low_norm_cone_cosine_rises"] = float(rises.sum())
    (out / "sink_claims.json").write_text(json.dumps(claims, indent=2))
    layer_means = heads.groupby("layer").mean()
    top = heads["sink_ratio"].idxmax()
    queries = [q for q in (8, 64, 128, args.chunk_length - 1) if q < args.chunk_length]
    sections: list = [
        ("Claims: the numbers", pd.DataFrame({"value": claims})),
        ("Sink-norm intervention", effect),
        (
            "Per layer: sink ratio, sink contribution, interior minima",
            plot.lines(
                {
                    c: layer_means[c].tolist()
                    for c in (
                        "sink_ratio",
                        "intra_sink_contribution",
                        "inter_sink_contribution",
                        "interior_minimum_share",
                        "negative_sink_tail_share",
                    )
                },
                title="per-layer means over heads",
                x=list(layer_means.index),
            ),
        ),
    ]
    for part in ("sink", "tail"):
        for factor in ("attention", "relative_norm", "cosine", "contribution"):
            sections.append((f"{part} {factor} (intra-head)", plot.sink_head_grid(heads, f"intra_{part}_{factor}")))
    sections += [
        (f"beta curves, L{top[0]}H{top[1]}", plot.beta_curves(analysis.layers[top[0]], head=top[1], queries=queries)),
        ("Sink ratio vs output norm", plot.sink_ratio_scatter(analysis.per_query())),
        (
            "Output norm and cone cosine, clean vs intervened",
            plot.lines(
                {
                    f"{c} ({v})": per_layer.loc[v][c].tolist()
                    for v in interventions
                    for c in (
                        "output_norm_clean",
                        "output_norm_intervened",
                        "low_norm_cone_cosine_clean",
                        "low_norm_cone_cosine_intervened",
                    )
                },
                title="per layer",
                x=list(range(model.cfg.n_layers)),
            ),
        ),
        ("Per head", heads),
    ]
    report.write_html(out / "sinks.html", f"Attention sinks: {args.model}", sections)
    with pd.option_context("display.width", 160, "display.float_format", "{:.4f}".format):
        print(pd.Series(claims).to_string())
    print(f"wrote {out}/sinks.html, sink_heads.csv, sink_claims.json")
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
    faith.add_argument(
        "--scope",
        choices=("inter", "intra"),
        default="inter",
        help="||o|| of the layer (inter) or of each head (intra) in the scores",
    )
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

    sinks = commands.add_parser("sinks", help="attention-sink analysis and the sink-norm intervention")
    sinks.add_argument("--model", default="smollm2-135m")
    sinks.add_argument("--data", action="append", required=True, help="NAME=PATH or NAME of a text set; repeatable")
    sinks.add_argument("--k", type=int, default=1, help="number of sink positions")
    sinks.add_argument("--chunk-length", type=int, default=256)
    sinks.add_argument("--max-chunks", type=int, default=16)
    sinks.add_argument("--batch-size", type=int, default=8)
    sinks.add_argument("--out", required=True)
    sinks.add_argument("--device", default=None)
    sinks.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    sinks.set_defaults(run=_sinks)
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
