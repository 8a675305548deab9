"""Command line: ``contribution-lens demo | faithfulness | sinks``.

Every argument, and the output folder, is checked before a model is loaded; a mistake prints one
line ``contribution-lens: error: ...`` and exits with status 2. A run holds a lock on its output
folder, so a second run on the same folder is refused. Only the standard library is imported at
module level: ``--help`` and ``--version`` answer without importing torch.
"""

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from contribution_lens import _cli_checks as check
from contribution_lens import _outdir

PROG = "contribution-lens"
DEMO_TEXT = (
    "Alice put the red ball in the box and left the room. While she was away, Bob moved the ball "
    "from the box to the basket. When Alice came back, she looked for the ball in the box."
)
DTYPES = ("float32", "bfloat16", "float16")
LM_TASKS = ("gsm8k", "fineweb", "text")  # data.LM_TASKS and data.CHOICE_TASKS, without importing data
CHOICE_TASKS = ("mmlu", "winogrande", "boolq")


def _dtype(name: str) -> Any:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _load(args: argparse.Namespace) -> Any:
    from contribution_lens import loading

    return loading.load_model(args.model, device=args.device, dtype=_dtype(args.dtype))


def _check_demo(args: argparse.Namespace) -> None:
    """Cheap checks first; the model's config and the device (they import torch) last."""
    if not args.text.strip():
        raise check.UsageError(f"--text: expected some text, got {args.text!r}")
    args.out = check.out_folder("--out", args.out)
    args.model = check.model("--model", args.model)
    if args.layer is not None:
        (args.layer,) = check.layers("--layer", (args.layer,), args.model)
    args.device = check.device("--device", args.device)


def _demo(args: argparse.Namespace) -> int:
    import pandas as pd
    import torch

    from contribution_lens import attention_geometry, plot, report

    model = _load(args)
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


def _check_faithfulness(args: argparse.Namespace) -> None:
    args.ratios = check.ratios("--ratios", args.ratios)
    if args.choice_ratios is not None:
        args.choice_ratios = check.ratios("--choice-ratios", args.choice_ratios)
    args.data = check.data_specs("--data", args.data, LM_TASKS + CHOICE_TASKS)
    args.chunk_length = check.at_least("--chunk-length", args.chunk_length, 2)
    for option in ("--max-chunks", "--max-items", "--max-item-tokens", "--batch-size"):
        name = option[2:].replace("-", "_")
        setattr(args, name, check.at_least(option, getattr(args, name)))
    layers = None if args.layers is None else check.integers("--layers", args.layers)
    args.out = check.out_folder("--out", args.out)
    from contribution_lens import faithfulness
    from contribution_lens.methods import available_methods

    registered = available_methods()
    args.methods = check.choose("--methods", args.methods, registered, all_means=faithfulness.ALL_METHODS)
    args.modes = check.choose("--modes", args.modes, faithfulness.MODES)
    args.model = check.model("--model", args.model)
    args.layers = None if layers is None else check.layers("--layers", layers, args.model)
    args.device = check.device("--device", args.device)


def _faithfulness(args: argparse.Namespace) -> int:
    import pandas as pd

    from contribution_lens import evaluation, faithfulness

    protocol = faithfulness.Protocol(
        methods=args.methods,
        modes=args.modes,
        ratios=args.ratios,
        layers=args.layers,
        rank_by=args.rank_by,
        scope=args.scope,
        seed=args.seed,
    )
    lm = tuple(spec for spec in args.data if evaluation.task_name(spec) not in CHOICE_TASKS)
    choice = tuple(spec for spec in args.data if evaluation.task_name(spec) in CHOICE_TASKS)
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
    model = _load(args)
    summary = evaluation.run_faithfulness(model, config, protocol, args.out, model_name=args.model)
    if summary is not None:
        with pd.option_context("display.width", 160, "display.max_rows", 500, "display.float_format", "{:.4f}".format):
            print(evaluation.mean_over_ratios(summary).to_string())
        print(f"wrote {args.out}/records.jsonl, summary.csv and report.html")
    return 0


def _check_sinks(args: argparse.Namespace) -> None:
    args.data = check.data_specs("--data", args.data, LM_TASKS)
    for spec in args.data:
        if spec.partition("=")[0].strip().lower() in CHOICE_TASKS:
            raise check.UsageError(f"--data: expected a text set ({', '.join(LM_TASKS)}), got {spec!r}")
    args.chunk_length = check.at_least("--chunk-length", args.chunk_length, 2)
    if not 1 <= args.k < args.chunk_length:
        raise check.UsageError(
            f"--k: expected an integer from 1 to --chunk-length - 1 ({args.chunk_length - 1}), got {args.k}"
        )
    args.max_chunks = check.at_least("--max-chunks", args.max_chunks)
    args.batch_size = check.at_least("--batch-size", args.batch_size)
    args.out = check.out_folder("--out", args.out)
    args.model = check.model("--model", args.model)
    args.device = check.device("--device", args.device)


def _sinks(args: argparse.Namespace) -> int:
    import json

    import pandas as pd
    import torch

    from contribution_lens import data, plot, report, run_sink_intervention, sink_analysis
    from contribution_lens.sinks import claim_verdicts

    model = _load(args)
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
    claims["n_layers"] = float(model.cfg.n_layers)
    (out / "sink_claims.json").write_text(json.dumps(claims, indent=2))
    verdicts = claim_verdicts(claims)
    layer_means = heads.groupby("layer").mean()
    top = heads["sink_ratio"].idxmax()
    queries = [q for q in (8, 64, 128, args.chunk_length - 1) if q < args.chunk_length]
    sections: list = [
        ("The claims, measured on this model", verdicts),
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
        ("Every number behind the claims", pd.DataFrame({"value": claims})),
        ("Per head", heads),
    ]
    # Norms and cosines live on different scales: one figure each.
    for column, title in (("output_norm", "mean output norm"), ("low_norm_cone_cosine", "cone cosine")):
        series = {f"{run} ({v})": per_layer.loc[v][f"{column}_{run}"].tolist() for v in interventions for run in RUNS}
        figure = plot.lines(series, title=f"{title} per layer", x=list(range(model.cfg.n_layers)), yaxis_title=title)
        sections.insert(-2, (f"{title.capitalize()}, clean vs intervened", figure))
    report.write_html(out / "sinks.html", f"Attention sinks: {args.model}", sections)
    with pd.option_context("display.width", 160, "display.float_format", "{:.4f}".format):
        print(pd.Series(claims).to_string())
        print(verdicts.to_string(index=False))
    print(f"wrote {out}/sinks.html, sink_heads.csv, sink_claims.json")
    return 0


RUNS = ("clean", "intervened")

DESCRIPTION = (
    "Which tokens really feed an attention head's output. Every argument is checked before the model "
    "is loaded; one run at a time per output folder; an interrupted faithfulness run resumes when the "
    "same command is run again."
)


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
        for line in Path(__file__).with_name("__init__.py").read_text(encoding="utf-8").splitlines():
            if line.startswith("__version__"):
                return line.partition("=")[2].strip().strip("\"'")
        return "unknown"


class _VersionAction(argparse.Action):
    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help="print the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        print(f"{PROG} {_version()}")
        parser.exit(0)


def _common(command: argparse.ArgumentParser, *, out_default: str | None = None) -> None:
    command.add_argument("--model", default=check.BUNDLED, help="bundled name, Hugging Face id or checkpoint folder")
    if out_default is None:
        command.add_argument("--out", required=True, help="output folder (created; one run at a time)")
    else:
        command.add_argument("--out", default=out_default, help="output folder (created; one run at a time)")
    command.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: TransformerLens chooses)")
    command.add_argument("--dtype", choices=DTYPES, default="float32", help="weights' dtype")


def build_parser() -> argparse.ArgumentParser:
    formatter = _Formatter
    parser = _Parser(prog=PROG, description=DESCRIPTION, formatter_class=formatter)
    parser.add_argument("--version", action=_VersionAction)
    commands = parser.add_subparsers(dest="command", required=True, metavar="{demo,faithfulness,sinks}")
    demo = commands.add_parser(
        "demo", help="per-layer table and an HTML figure for one text", formatter_class=formatter
    )
    _common(demo, out_default="demo_out")
    demo.add_argument("--text", default=DEMO_TEXT, help="the text to analyse")
    demo.add_argument(
        "--layer",
        type=int,
        default=None,
        help="layer of the token heatmap (negative: from the end; default: "
        "the layer where contribution and attention to BOS differ most)",
    )
    demo.set_defaults(check=_check_demo, run=_demo)

    faith = commands.add_parser(
        "faithfulness", help="causal masking of projected values: ΔPPL and accuracy", formatter_class=formatter
    )
    _common(faith)
    faith.add_argument(
        "--data",
        action="append",
        required=True,
        help=f"NAME=PATH or NAME, NAME one of {', '.join(LM_TASKS + CHOICE_TASKS)}; repeatable",
    )
    faith.add_argument(
        "--methods",
        default="all",
        help="comma-separated registered methods, or 'all' (the four measures + random); the peers alti, "
        "alti_rollout, value_zeroing (about one block pass per token and layer) and grad_attention by name",
    )
    faith.add_argument("--modes", default="comprehensiveness,sufficiency", help="comma-separated")
    faith.add_argument("--ratios", default="0,0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9", help="removal ratios in [0, 1)")
    faith.add_argument(
        "--choice-ratios", default=None, help="ratios for multiple-choice sets (default: those of --ratios)"
    )
    faith.add_argument("--layers", default=None, help="comma-separated layers to mask (default: all)")
    faith.add_argument("--rank-by", choices=("abs", "signed"), default="abs", help="rank keys by |score| or score")
    faith.add_argument(
        "--scope",
        choices=("inter", "intra"),
        default="inter",
        help="||o|| of the layer (inter) or of each head (intra) in the scores",
    )
    faith.add_argument("--seed", type=int, default=0, help="seed of the random control")
    faith.add_argument("--chunk-length", type=int, default=256, help="tokens per text chunk, BOS included")
    faith.add_argument("--max-chunks", type=int, default=200, help="text chunks per data set")
    faith.add_argument("--max-items", type=int, default=200, help="items per multiple-choice set")
    faith.add_argument("--max-item-tokens", type=int, default=512, help="longer items are skipped")
    faith.add_argument("--batch-size", type=int, default=8, help="sequences per forward pass")
    faith.set_defaults(check=_check_faithfulness, run=_faithfulness)

    sinks = commands.add_parser(
        "sinks", help="attention-sink analysis and the sink-norm intervention", formatter_class=formatter
    )
    _common(sinks)
    sinks.add_argument(
        "--data",
        action="append",
        required=True,
        help=f"NAME=PATH or NAME of a text set ({', '.join(LM_TASKS)}); repeatable",
    )
    sinks.add_argument("--k", type=int, default=1, help="number of sink positions")
    sinks.add_argument("--chunk-length", type=int, default=256, help="tokens per chunk, BOS included")
    sinks.add_argument("--max-chunks", type=int, default=16, help="chunks per data set")
    sinks.add_argument("--batch-size", type=int, default=8, help="chunks per forward pass")
    sinks.set_defaults(check=_check_sinks, run=_sinks)
    return parser


def _lock(args: argparse.Namespace) -> Any:
    """The output folder's lock; under torchrun only rank 0 takes it (the ranks share the folder)."""
    import contextlib

    if os.environ.get("RANK", "0") != "0":
        return contextlib.nullcontext(args.out)
    return _outdir.locked(args.out)


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
    except _outdir.FolderInUseError as error:
        return _fail(f"--out {error}")
    except (ValueError, TypeError, FileNotFoundError, ModuleNotFoundError, NotADirectoryError) as error:
        return _fail(str(error))
    except KeyboardInterrupt:
        return _fail("interrupted", 130)


if __name__ == "__main__":
    raise SystemExit(main())
