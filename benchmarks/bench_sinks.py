"""Cost of the sink analyses: time and peak memory against a plain forward pass, at 512 and 1,024 tokens.

On the bundled SmolLM2-135M, one random token sequence per length (BOS first), each measured

* ``plain``: ``model(tokens)`` under ``inference_mode``;
* ``sink_analysis``: ``cl.sink_analysis(model, tokens)``: every layer's sink geometry and its
  sink/tail factors in both scopes (intra and inter), with the tail distributions' quantiles,
  from one pass. The issue's number: ``sink_analysis / plain``, target at most 2x;
* ``sink_study``: ``cl.sink_study(model, tokens)``: that analysis, then the two sink-norm
  interventions (``zero``, ``mean_tail``), each a clean and an intervened pass with the sink
  geometry of every layer (four more full passes by construction).

Time: in one process, the methods alternate ``--repeats`` times per length and the fastest run of
each counts (the others absorb other jobs on the machine); the ratio to ``plain`` is the number to
read. Memory: each method runs once more in a fresh process, and the growth of its peak RSS
(``VmHWM``) over the loaded, warmed-up model is reported. Run: ``python benchmarks/bench_sinks.py``
(about 3 minutes on 2 idle cores) or ``--lengths 512 --repeats 2 --no-memory``. ``METHODS`` is the
table to add a method to.
"""

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

LENGTHS = (512, 1024)


def _plain(model: Any, tokens: torch.Tensor) -> None:
    with torch.inference_mode():
        model(tokens)


def _sink_analysis(model: Any, tokens: torch.Tensor) -> None:
    import contribution_lens as cl

    cl.sink_analysis(model, tokens)


def _sink_study(model: Any, tokens: torch.Tensor) -> None:
    import contribution_lens as cl

    cl.sink_study(model, tokens, progress=False)


METHODS: dict[str, Callable[[Any, torch.Tensor], None]] = {
    "plain": _plain,
    "sink_analysis": _sink_analysis,
    "sink_study": _sink_study,
}


def _status(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _tokens(model: Any, length: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    body = torch.randint(1000, 40000, (1, length - 1), generator=generator)
    return torch.cat([torch.tensor([[model.tokenizer.bos_token_id]]), body], dim=1)


def _load() -> Any:
    import contribution_lens as cl

    model = cl.load_model()
    for method in METHODS.values():  # kernels, lazy buffers and caches, before anything is measured
        method(model, _tokens(model, 40))
    return model


def memory_worker(method: str, length: int) -> dict:
    model = _load()
    tokens = _tokens(model, length)
    baseline = _status("VmRSS:")
    Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark
    METHODS[method](model, tokens)
    return {"peak_mb": _status("VmHWM:") - baseline}


def peak_mb(method: str, length: int) -> float:
    out = subprocess.run(
        [sys.executable, __file__, "--worker", method, str(length)], check=True, capture_output=True, text=True
    ).stdout
    return float(json.loads(out.strip().splitlines()[-1])["peak_mb"])


def fastest(model: Any, length: int, repeats: int) -> dict[str, float]:
    tokens = _tokens(model, length)
    best = dict.fromkeys(METHODS, float("inf"))
    for _ in range(repeats):
        for name, method in METHODS.items():
            start = time.perf_counter()
            method(model, tokens)
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", nargs=2, metavar=("METHOD", "LENGTH"))
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-memory", action="store_true", help="skip the fresh-process memory runs")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(memory_worker(args.worker[0], int(args.worker[1]))))
        return
    load = Path("/proc/loadavg").read_text().split()[0]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {load}, bundled SmolLM2-135M")
    model = _load()
    names = list(METHODS)
    others = names[1:]
    header = ["tokens", *[f"{n} s" for n in names], *[f"{n} / plain" for n in others]]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for length in args.lengths:
        seconds = fastest(model, length, args.repeats)
        cells = [f"{length:,}", *[f"{seconds[n]:.3f}" for n in names]]
        cells += [f"{seconds[n] / seconds['plain']:.2f}x" for n in others]
        print("| " + " | ".join(cells) + " |", flush=True)
    if args.no_memory:
        return
    del model
    header = ["tokens", *[f"{n} MB" for n in names], *[f"{n} / plain" for n in others]]
    print("\n| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for length in args.lengths:
        peaks = {n: peak_mb(n, length) for n in names}
        cells = [f"{length:,}", *[f"{peaks[n]:.0f}" for n in names]]
        cells += [f"{peaks[n] / peaks['plain']:.2f}x" for n in others]
        print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
