"""Quick per-head inspection: the inspector's first view, the sink analysis and long texts, each against a forward pass.

Three tables, each measured in this process against a plain forward pass of the same tokens in the
same run (alternating, the fastest of ``--repeats``), with the machine's load average printed
before and after, on one random token sequence per length (BOS first):

* ``first-view``: ``cl.inspect(model, tokens, layer=last)`` (one pass that decomposes the layer shown
  and keeps every layer's queries and keys, with the *why* tape; nothing computed ahead in a thread
  while timed), on the bundled SmolLM2-135M and Qwen2.5-0.5B; then a switch to a layer computed
  ahead (the worst of every layer once the thread is done) and to one not computed yet (on demand,
  from what the pass kept), and how long the thread took for every layer of the shown window;
* ``sinks``: ``cl.sink_analysis(model, tokens)`` (every layer, both scopes, the inter scope's tail
  quantiles: the default), on SmolLM2 with one torch thread and with two;
* ``long``: on SmolLM2 at 8,192 and 32,768 tokens, each in a fresh process (time, and the growth of the
  process's peak resident memory over the loaded model): a forward pass in tiles (attention a tile of
  queries at a time, no pattern held: ``cl.map_layers(..., qk="tiles")``), the model's own forward pass
  where its patterns fit, ``cl.layer_summary(..., tiles=True)``, ``cl.sink_analysis(..., tiles=True)``
  and the inspector's first view (its last window). ``--layers K`` runs layers 0..K-1 alone (a pass
  stops after its last layer): each row then also gives the whole model's time, computed as the
  measured time per layer times the layers (memory is one layer's at a time, but for the
  inspector's records: the computed row adds the other layers' records, measured per layer).
  SmolLM2's context is 8,192 tokens: a longer text runs with its ``cfg.n_ctx`` raised to the
  length, which measures the cost, not numbers a user should read.

Run: ``python benchmarks/quick_inspection.py first-view`` (``sinks``, ``long``; ``all`` runs the three;
``--lengths``, ``--repeats``, ``--models``, ``--threads``, ``--layers``).
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

import _ratios

MODELS = {"smollm2": None, "qwen2.5-0.5b": "qwen2.5-0.5b"}


def load_average() -> str:
    return Path("/proc/loadavg").read_text().split()[0]


def model_of(name: str) -> Any:
    import contribution_lens as cl

    return cl.load_model(MODELS[name]) if MODELS[name] else cl.load_model()


def tokens_of(model: Any, length: int) -> torch.Tensor:
    """``length`` tokens: BOS where the model has one, then random ids (`_ratios.tokens_of`)."""
    bos = model.tokenizer.bos_token_id
    if bos is not None:
        return _ratios.tokens_of(model, length)
    generator = torch.Generator().manual_seed(0)
    return torch.randint(1000, 20000, (1, length), generator=generator)


def fastest(methods: dict[str, Any], repeats: int) -> dict[str, float]:
    best = dict.fromkeys(methods, float("inf"))
    for _ in range(repeats):
        for name, method in methods.items():
            start = time.perf_counter()
            method()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def first_view(args: argparse.Namespace) -> None:
    import contribution_lens as cl
    from contribution_lens.views.inspector import background

    print(
        f"\n## first view: torch {torch.__version__}, {torch.get_num_threads()} threads, load average {load_average()}"
    )
    print("| model | tokens | plain s | first view s | first view / plain | switch to a layer computed ahead s | "
          "switch to a layer not computed yet s | thread, every layer of the window s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for name in args.models:
        model = model_of(name)
        last = model.cfg.n_layers - 1
        for length in args.lengths:
            tokens = tokens_of(model, length)
            background.ENABLED = False  # nothing in a thread while the first view is timed
            _ratios.plain(model, tokens[:, :40]), cl.inspect(model, tokens[:, :40], layer=last)
            timed = fastest(
                {
                    "plain": lambda model=model, tokens=tokens: _ratios.plain(model, tokens),
                    "first": lambda model=model, tokens=tokens, last=last: cl.inspect(model, tokens, layer=last),
                },
                args.repeats,
            )
            inspector = cl.inspect(model, tokens, layer=last)
            start = time.perf_counter()
            inspector.layer = last - 1  # not computed yet: from what the pass kept
            on_demand = time.perf_counter() - start
            background.ENABLED = True
            start = time.perf_counter()
            inspector.layer = last
            inspector._payloads.prefetching.join()
            thread = time.perf_counter() - start
            switches = []
            for layer in range(model.cfg.n_layers):
                start = time.perf_counter()
                inspector.layer = layer
                switches.append(time.perf_counter() - start)
                inspector._payloads.prefetching.stop()
            print(
                f"| {name} | {length:,} | {timed['plain']:.2f} | {timed['first']:.2f} | "
                f"{timed['first'] / timed['plain']:.2f}x | {max(switches):.4f} | {on_demand:.3f} | {thread:.1f} |",
                flush=True,
            )
            del inspector
    print(f"load average at the end {load_average()}")


def sinks(args: argparse.Namespace) -> None:
    import contribution_lens as cl

    model = model_of("smollm2")
    for threads in args.threads:
        torch.set_num_threads(threads)
        print(f"\n## sink analysis: torch {torch.__version__}, {threads} threads, load average {load_average()}")
        print("| tokens | plain s | sink_analysis s | sink_analysis / plain |")
        print("|---|---|---|---|")
        for length in args.lengths:
            tokens = tokens_of(model, length)
            _ratios.plain(model, tokens[:, :40]), cl.sink_analysis(model, tokens[:, :40])
            timed = fastest(
                {
                    "plain": lambda tokens=tokens: _ratios.plain(model, tokens),
                    "sinks": lambda tokens=tokens: cl.sink_analysis(model, tokens),
                },
                args.repeats,
            )
            print(f"| {length:,} | {timed['plain']:.2f} | {timed['sinks']:.2f} | "
                  f"{timed['sinks'] / timed['plain']:.2f}x |", flush=True)  # fmt: skip
        print(f"load average at the end {load_average()}")


LONG = ("forward in tiles", "model's own forward", "layer_summary", "sink_analysis", "inspector first view")


def long_worker(method: str, length: int, layers: int) -> dict[str, float]:
    """One method at one length, in this fresh process: seconds, peak MB over the loaded model, records MB."""
    import contribution_lens as cl

    model = model_of("smollm2")
    if length > model.cfg.n_ctx:  # past the trained context (8,192): what it costs, not what it means
        model.cfg.n_ctx = length
    chosen = list(range(layers))
    warm = tokens_of(model, 64)
    cl.map_layers(model, warm, lambda layer: None, qk="tiles"), cl.layer_summary(model, warm, tiles=True)
    tokens = tokens_of(model, length)
    baseline = _ratios._status("VmRSS:")
    Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark
    start = time.perf_counter()
    kept: Any = None
    records = 0.0
    if method == "forward in tiles":
        cl.map_layers(model, tokens, lambda layer: None, layers=chosen, qk="tiles")
    elif method == "model's own forward":
        cl.map_layers(model, tokens, lambda layer: None, layers=chosen)
    elif method == "layer_summary":
        kept = cl.layer_summary(model, tokens, layers=chosen, tiles=True)
    elif method == "sink_analysis":
        kept = cl.sink_analysis(model, tokens, layers=chosen, tiles=True)
    else:
        from contribution_lens.views.inspector import background

        background.ENABLED = False
        kept = cl.inspect(model, tokens, layers=chosen, start=length - 128)
        for found in kept._payloads.records.values():
            records += sum(t.numel() * t.element_size() for t in (found.qk.q, found.qk.k, found.v, found.z,
                                                                  found.hook_out) if t is not None) / 1e6  # fmt: skip
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "peak_mb": _ratios._status("VmHWM:") - baseline, "records_mb": records}


def long_texts(args: argparse.Namespace) -> None:
    print(f"\n## long texts: torch {torch.__version__}, {torch.get_num_threads()} threads, load average "
          f"{load_average()}, bundled SmolLM2-135M, layers 0..{args.layers - 1} of 30")  # fmt: skip
    print("| tokens | method | s | / forward in tiles | peak MB | 30 layers: s (computed) | 30 layers: peak MB |")
    print("|---|---|---|---|---|---|---|")
    for length in args.lengths:
        found = {}
        for method in LONG:
            if method == "model's own forward" and 9 * length * length * 4 * 3 > 20e9:
                print(f"| {length:,} | {method} | does not fit | | {9 * length**2 * 4 / 1e9:.1f} GB a pattern | | |")
                continue
            command = [sys.executable, __file__, "--worker", method, str(length), str(args.layers)]
            out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            found[method] = json.loads(out.strip().splitlines()[-1])
            row = found[method]
            ratio = row["seconds"] / found["forward in tiles"]["seconds"]
            whole = row["seconds"] * 30 / args.layers
            peak = row["peak_mb"] + row["records_mb"] * (30 - args.layers) / args.layers
            print(f"| {length:,} | {method} | {row['seconds']:.1f} | {ratio:.2f}x | {row['peak_mb']:.0f} | "
                  f"{whole:.0f} | {peak:.0f} |", flush=True)  # fmt: skip
    print(f"load average at the end {load_average()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("table", nargs="?", default="all", choices=["first-view", "sinks", "long", "all"])
    parser.add_argument("--worker", nargs=3, metavar=("METHOD", "LENGTH", "LAYERS"))
    parser.add_argument("--lengths", type=int, nargs="+")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--layers", type=int, default=30)
    args = parser.parse_args()
    if args.worker:
        method, length, layers = args.worker
        print(json.dumps(long_worker(method, int(length), int(layers))))
        return
    tables = {
        "first-view": (first_view, [512, 2048]),
        "sinks": (sinks, [512, 2048]),
        "long": (long_texts, [8192, 32768]),
    }
    for name, (table, lengths) in tables.items():
        if args.table in (name, "all"):
            table(argparse.Namespace(**{**vars(args), "lengths": args.lengths or lengths}))


if __name__ == "__main__":
    main()
