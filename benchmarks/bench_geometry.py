"""Wall time and peak memory of `attention_geometry` on the bundled model, all 30 layers.

Compared, at 128, 512 and 1024 tokens, with
  (a) one forward pass that caches every layer's pattern (``run_with_cache`` filtered to
      ``hook_pattern``), the cost of merely looking at attention, and
  (b) the naive float32 reference that materialises every weighted vector
      ``alpha_ij vt_j`` ([batch head query key d_model] per layer), where it fits in memory.
      At 512 tokens it takes about 14 s a layer on 2 cores, so (b) is timed on the first
      ``NAIVE_LAYERS`` layers (after the same full forward pass) and its per-layer time
      scaled to 30 layers: every layer has the same shapes, so the cost is linear.

Each measurement runs in a fresh process: peak RSS growth is read from ``VmHWM`` after the
model is loaded and warmed up (the high-water mark is reset through ``/proc/self/clear_refs``).
Time is the median of repeated runs. Run: ``python benchmarks/bench_geometry.py``.
"""

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
LENGTHS = (128, 512, 1024)
# The naive reference needs 9 * L^2 * 576 * 4 bytes per layer: 5.4 GB at 512, 22 GB at 1024.
NAIVE_LENGTHS = (128, 512)
NAIVE_LAYERS = 6


def _rss_peak_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _rss_now_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def worker(method: str, length: int, repeats: int) -> dict:
    import contribution_lens as cl
    from contribution_lens import adapter

    sys.path.insert(0, str(ROOT / "tests"))
    from reference import reference_contributions

    model = cl.load_model()
    # A fixed pseudo-random token sequence behind BOS (content does not change the cost).
    generator = torch.Generator().manual_seed(0)
    body = torch.randint(1000, 40000, (1, length - 1), generator=generator)
    tokens = torch.cat([torch.tensor([[model.tokenizer.bos_token_id]]), body], dim=1)
    layers = list(range(model.cfg.n_layers))

    def cached_patterns() -> None:
        with torch.inference_mode():
            model.run_with_cache(tokens, names_filter=lambda name: name.endswith("attn.hook_pattern"))

    def geometry() -> None:
        cl.attention_geometry(model, tokens)

    def geometry_and_contribution() -> None:
        # Contribution weights are computed on first access: read every layer's.
        g = cl.attention_geometry(model, tokens)
        for layer in g.layers:
            g[layer].contribution  # noqa: B018

    def naive() -> None:
        with torch.inference_mode():
            _, cache = model.run_with_cache(tokens, names_filter=lambda name: name.endswith(("hook_pattern", "hook_v")))
            for layer in layers[:NAIVE_LAYERS]:
                W_O = adapter.output_weights(model, layer)[0]
                reference_contributions(
                    cache[adapter.pattern_hook(layer)],
                    cache[adapter.value_hook(layer)],
                    W_O,
                    "inter",
                    dtype=torch.float32,
                )

    run = {
        "cached_patterns": cached_patterns,
        "geometry": geometry,
        "geometry_and_contribution": geometry_and_contribution,
        "naive": naive,
    }[method]
    with torch.inference_mode():
        model(tokens[:, :16])  # warm-up of kernels and lazy buffers
    baseline = _rss_now_mb()
    _reset_peak()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    if method == "naive":
        forward = statistics.median(_timed(cached_patterns) for _ in range(repeats))
        seconds = forward + (seconds - forward) * len(layers) / NAIVE_LAYERS
    return {"seconds": seconds, "peak_growth_mb": _rss_peak_mb() - baseline}


def _timed(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def measure(method: str, length: int, repeats: int) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--worker", method, str(length), str(repeats)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worker", nargs=3, metavar=("METHOD", "LENGTH", "REPEATS"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    parser.add_argument("--naive-lengths", type=int, nargs="*", default=list(NAIVE_LENGTHS), help="(b) is slow")
    args = parser.parse_args()
    if args.worker:
        method, length, repeats = args.worker
        print(json.dumps(worker(method, int(length), int(repeats))))
        return

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, bundled SmolLM2-135M, all 30 layers")
    print(
        "| tokens | (a) cached patterns s | geometry s | geometry + contribution s | (b) naive s "
        "| geometry / (a) | geometry+c / (a) | (b) / geometry+c | (a) MB | geometry MB | geometry+c MB | (b) MB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = {}
    for length in args.lengths:
        a = measure("cached_patterns", length, args.repeats)
        g = measure("geometry", length, args.repeats)
        gc = measure("geometry_and_contribution", length, args.repeats)
        b = measure("naive", length, 1) if length in args.naive_lengths else None
        rows[length] = gc
        naive_s = f"{b['seconds']:.2f}" if b else ("does not fit" if length not in NAIVE_LENGTHS else "not run")
        naive_ratio = f"{b['seconds'] / gc['seconds']:.1f}x" if b else "-"
        naive_mb = f"{b['peak_growth_mb']:.0f}" if b else "-"
        print(
            f"| {length} | {a['seconds']:.3f} | {g['seconds']:.3f} | {gc['seconds']:.3f} | {naive_s} "
            f"| {g['seconds'] / a['seconds']:.2f}x | {gc['seconds'] / a['seconds']:.2f}x | {naive_ratio} "
            f"| {a['peak_growth_mb']:.0f} | {g['peak_growth_mb']:.0f} | {gc['peak_growth_mb']:.0f} | {naive_mb} |",
            flush=True,
        )
    lengths = sorted(rows)
    for short, long in itertools.pairwise(lengths):
        growth = rows[long]["peak_growth_mb"] / max(rows[short]["peak_growth_mb"], 1e-9)
        quadratic = (long / short) ** 2
        print(f"geometry+c memory growth {short}->{long} tokens: {growth:.1f}x (quadratic: {quadratic:.0f}x)")


if __name__ == "__main__":
    main()
