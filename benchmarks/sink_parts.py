"""What each part of the sink analysis costs, per layer, against one layer's share of a plain forward pass.

On the bundled SmolLM2-135M, one random token sequence (BOS first) per length, the tensors of one
layer (``--layer``, default 10) are caught once; then each part of `cl.sink_analysis`'s per-layer
work (`analyses.sinks.analyse_layer`) runs on them alone, over every tile of queries
(`LayerInputs.tiles`):

* ``sink rows``: `SinkRows.add`, the one product of each row with the keys (sink and tail outputs,
  their weighted sums and masses) and which queries see a sink and a tail key;
* ``geometry``: `SinkRows.geometry` (the quadratic forms, the cosines, the cone);
* ``factors``: `SinkRows.factors` of both scopes (from the parts' outputs, no pattern);
* ``decompose inter``: the inter scope's decomposition of every tile (what its quantiles read);
* ``quantiles inter``: `TailQuantiles` of the inter scope (both sweeps), on those decompositions;
* ``decompose intra`` / ``quantiles intra``: the same for the intra scope, which the default leaves out.

Each is the fastest of ``--repeats`` runs, in CPU time of this process on one thread (the parts
alternate with the forward pass, so a shared machine slows them alike); ``forward / layer`` is a
plain ``model(tokens)`` divided by the number of layers. Run: ``python benchmarks/sink_parts.py``
(a minute on one idle core) or ``--lengths 512 2048``.
"""

import argparse
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import _ratios
import contribution_lens as cl
from contribution_lens import adapter
from contribution_lens.analyses import sinks


def _fastest(parts: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    best = dict.fromkeys(parts, float("inf"))
    for _ in range(repeats):
        for name, part in parts.items():
            start = time.process_time()
            part()
            best[name] = min(best[name], time.process_time() - start)
    return best


def parts_of(model: Any, tokens: torch.Tensor, layer: int) -> dict[str, Callable[[], Any]]:
    """The plain pass and each part of one layer's sink analysis, as functions to time."""
    caught = cl.map_layers(model, tokens, lambda inputs: inputs, layers=[layer])[layer]
    is_sink = sinks.sink_mask(None, 1, 1, tokens.shape[1], caught.v.device)
    tiles = caught.tiles()
    items = tokens.shape[1] * (tokens.shape[1] + 1) // 2

    def fresh() -> adapter.LayerInputs:  # nothing cached yet
        return dataclasses.replace(caught, _cache={})

    def sink_rows(layer: adapter.LayerInputs) -> sinks.SinkRows:
        rows = sinks.SinkRows(layer.v, layer.W_O, is_sink, gram=layer.gram)
        for tile in tiles:
            rows.add(layer.pattern_rows(tile), causal=layer.causal, first_query=tile.start)
        return rows

    rows = sink_rows(caught)
    decomposed = {scope: [caught.decompose_rows(scope, tile) for tile in tiles] for scope in cl.SCOPES}

    def quantiles(scope: str) -> None:
        tail = sinks.TailQuantiles(caught.W_O.shape[0], torch.float32, caught.v.device, items=items)
        for tile, d in zip(tiles, decomposed[scope], strict=True):
            tail.add(d, rows.is_sink, rows.queries, tile.start)
        tail.result()

    def decompose_all(scope: str) -> list:
        layer = fresh()  # one layer's key side and reading, shared by its tiles as in the analysis
        return [layer.decompose_rows(scope, tile) for tile in tiles]

    n_layers = adapter.n_layers(model)
    output, reading = caught.output_without_bias(), caught.inter_reading()
    return {
        "forward / layer": lambda: _ratios.plain(model, tokens),
        "sink rows": lambda: sink_rows(fresh()),
        "geometry": lambda: rows.geometry(),
        "factors": lambda: [rows.factors(scope, z=caught.z, output=output, reading=reading) for scope in cl.Scope],
        "decompose inter": lambda: decompose_all("inter"),
        "quantiles inter": lambda: quantiles("inter"),
        "decompose intra": lambda: decompose_all("intra"),
        "quantiles intra": lambda: quantiles("intra"),
        "_n_layers": lambda: n_layers,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512])
    parser.add_argument("--layer", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    load = Path("/proc/loadavg").read_text().split()[0]
    print(
        f"torch {torch.__version__}, 1 thread, CPU time, load average {load}, bundled SmolLM2-135M, layer {args.layer}"
    )
    model = cl.load_model()
    print("| tokens | part | ms | / forward layer |")
    print("|---|---|---|---|")
    for length in args.lengths:
        parts = parts_of(model, _ratios.tokens_of(model, length), args.layer)
        n_layers = parts.pop("_n_layers")()
        found = _fastest(parts, args.repeats)
        per_layer = found["forward / layer"] / n_layers
        found["forward / layer"] = per_layer
        intra = ("decompose intra", "quantiles intra")
        default = sum(v for name, v in found.items() if name not in ("forward / layer", *intra))
        found["the default's parts"] = default
        found["with the intra quantiles"] = default + sum(found[name] for name in intra)
        for name, seconds in found.items():
            print(f"| {length:,} | {name} | {seconds * 1e3:.1f} | {seconds / per_layer:.2f} |", flush=True)


if __name__ == "__main__":
    main()
