"""Peak memory of a per-layer summary of every layer against a plain forward pass, 512 to 8,192 tokens.

For each length, two fresh processes each load the bundled SmolLM2-135M (context 8,192) and
run one pass over the same token sequence:

* ``plain``: ``model(tokens)`` under ``inference_mode`` (eager attention, as the bridge runs it);
* ``summary``: ``cl.layer_summary(model, tokens)``, all 30 layers: each layer is decomposed in
  its hooks, summarised to four numbers and dropped (`contribution_lens.map_layers`).

Peak memory is the growth of the process's peak RSS (``VmHWM``) over the loaded, warmed-up
model; the ratio summary / plain is the number to read (target: at most 2.5x). Run:
``python benchmarks/bench_memory.py`` (about 15 minutes on 2 cores) or ``--lengths 512 2048``.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

LENGTHS = (512, 1024, 2048, 4096, 8192)


def _status(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def worker(method: str, length: int) -> dict:
    import contribution_lens as cl

    model = cl.load_model()
    generator = torch.Generator().manual_seed(0)
    body = torch.randint(1000, 40000, (1, length - 1), generator=generator)
    tokens = torch.cat([torch.tensor([[model.tokenizer.bos_token_id]]), body], dim=1)
    with torch.inference_mode():
        model(tokens[:, :16])  # kernels and lazy buffers, before the baseline
    baseline = _status("VmRSS:")
    Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark
    start = time.perf_counter()
    if method == "plain":
        with torch.inference_mode():
            model(tokens)
    else:
        cl.layer_summary(model, tokens)
    return {"seconds": time.perf_counter() - start, "peak_mb": _status("VmHWM:") - baseline}


def measure(method: str, length: int) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--worker", method, str(length)], check=True, capture_output=True, text=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worker", nargs=2, metavar=("METHOD", "LENGTH"))
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], int(args.worker[1]))))
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, bundled SmolLM2-135M, all 30 layers")
    print("| tokens | plain forward MB | layer summary MB | summary / plain | plain s | summary s |")
    print("|---|---|---|---|---|---|")
    for length in args.lengths:
        plain, summary = measure("plain", length), measure("summary", length)
        print(
            f"| {length} | {plain['peak_mb']:.0f} | {summary['peak_mb']:.0f} | "
            f"{summary['peak_mb'] / plain['peak_mb']:.2f}x | {plain['seconds']:.1f} | {summary['seconds']:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
