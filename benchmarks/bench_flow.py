"""Wall time and peak memory of `cl.flow` against one plain forward pass, bundled model, all 30 layers.

At 128, 512 and 1,024 tokens (target: flow at most 1.5x the plain forward). Per length one fresh
process loads the model, warms up, then times the plain forward (``model(tokens)`` under
``inference_mode``) and ``cl.flow(model, tokens)`` *interleaved*, pair after pair, so both see the
same load; the ratio is the median of the per-pair ratios. Peak memory is the growth of the
process's resident high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``) over one
call of each, after the timings. Run: ``python benchmarks/bench_flow.py [--lengths 128 512]``.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

LENGTHS = (128, 512, 1024)


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _peak_growth(run) -> float:
    baseline = _status_mb("VmRSS:")
    Path("/proc/self/clear_refs").write_text("5")
    run()
    return _status_mb("VmHWM:") - baseline


def _timed(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def worker(length: int, repeats: int) -> dict:
    import contribution_lens as cl

    model = cl.load_model()
    generator = torch.Generator().manual_seed(0)
    body = torch.randint(1000, 40000, (1, length - 1), generator=generator)
    tokens = torch.cat([torch.tensor([[model.tokenizer.bos_token_id]]), body], dim=1)

    def forward() -> None:
        with torch.inference_mode():
            model(tokens)

    def flow() -> None:
        with torch.inference_mode():
            cl.flow(model, tokens)

    forward()
    flow()  # warm-up of kernels and lazy buffers
    pairs = [(_timed(forward), _timed(flow)) for _ in range(repeats)]
    return {
        "forward_s": statistics.median(f for f, _ in pairs),
        "flow_s": statistics.median(g for _, g in pairs),
        "ratio": statistics.median(g / f for f, g in pairs),
        "forward_mb": _peak_growth(forward),
        "flow_mb": _peak_growth(flow),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worker", nargs=2, metavar=("LENGTH", "REPEATS"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(int(args.worker[0]), int(args.worker[1]))))
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, bundled SmolLM2-135M, all 30 layers")
    print("| tokens | forward s | flow s | flow / forward (median of pairs) | forward peak MB | flow peak MB |")
    print("|---|---|---|---|---|---|")
    for length in args.lengths:
        out = subprocess.run(
            [sys.executable, __file__, "--worker", str(length), str(args.repeats)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        row = json.loads(out.strip().splitlines()[-1])
        print(
            f"| {length} | {row['forward_s']:.3f} | {row['flow_s']:.3f} | {row['ratio']:.2f}x "
            f"| {row['forward_mb']:.0f} | {row['flow_mb']:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
