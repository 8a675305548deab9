"""What each part of the sink analysis costs, per layer, against one layer's share of a plain forward pass.

On the bundled SmolLM2-135M, one random token sequence (BOS first) per length, the tensors of one
layer (``--layer``, default 10) are caught once; then each part of `cl.sink_analysis`'s per-layer
work runs on them alone:

* ``sink geometry``: `sink_layer` (sink and tail outputs, the quadratic forms, the cosines);
* ``decompose intra`` / ``decompose inter``: the contribution weights' factors of each scope;
* ``tail pairs``: the (query, tail key) pairs of the quantiles (`TailPairs.of`);
* ``quantiles inter`` / ``quantiles intra``: `tail_quantiles` of one scope (the default computes
  the inter scope's alone);
* ``part factors``: `part_factors` of both scopes, without the quantiles (their attention sums shared).

Each is the fastest of ``--repeats`` runs, in CPU time of this process on one thread (the parts
alternate with the forward pass, so a shared machine slows them alike); ``forward / layer`` is a
plain ``model(tokens)`` divided by the number of layers. Run: ``python benchmarks/sink_parts.py``
(a minute on one idle core) or ``--lengths 512 1024``.
"""

import argparse
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
    names = ("layer", "pattern", "v", "W_O", "b_O", "z", "hook_out", "tokens", "attention_mask", "str_tokens", "cfg")

    def fresh() -> adapter.LayerInputs:  # no decomposition cached yet
        return adapter.LayerInputs(**{name: getattr(caught, name) for name in names}, gram_of=caught.gram_of)

    geometry = sinks.sink_layer(caught.pattern, caught.v, caught.W_O, causal=caught.causal)
    intra, inter = caught.decompose("intra"), caught.decompose("inter")
    pairs = sinks.TailPairs.of(inter.attention, inter.valid, geometry.sinks, geometry.queries)
    n_layers = adapter.n_layers(model)
    return {
        "forward / layer": lambda: _ratios.plain(model, tokens),
        "sink geometry": lambda: sinks.sink_layer(caught.pattern, caught.v, caught.W_O, causal=caught.causal),
        "decompose intra": lambda: fresh().decompose("intra"),
        "decompose inter": lambda: fresh().decompose("inter"),
        "tail pairs": lambda: sinks.TailPairs.of(inter.attention, inter.valid, geometry.sinks, geometry.queries),
        "quantiles inter": lambda: sinks.tail_quantiles([inter], pairs),
        "quantiles intra": lambda: sinks.tail_quantiles([intra], pairs),
        "part factors": lambda: sinks._factor_means([intra, inter], geometry.sinks, geometry.queries),
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
        default = sum(v for name, v in found.items() if name not in ("forward / layer", "quantiles intra"))
        found["the default's parts"] = default
        found["with the intra quantiles"] = default + found["quantiles intra"]
        for name, seconds in found.items():
            print(f"| {length:,} | {name} | {seconds * 1e3:.1f} | {seconds / per_layer:.2f} |", flush=True)


if __name__ == "__main__":
    main()
