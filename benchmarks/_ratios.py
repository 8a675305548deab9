"""The harness the ratio benchmarks share: each method's time and peak memory against a plain forward pass.

A benchmark script defines ``METHODS`` (name -> ``method(model, tokens)``, ``"plain"`` first) and calls
`main`. On the bundled SmolLM2-135M, one random token sequence per length (BOS first):

* time: in one process, the methods alternate ``--repeats`` times per length and the fastest run of
  each counts (the others absorb other jobs on the machine); the ratio to ``plain`` is the number to read;
* memory: each method runs once more in a fresh process (the script itself, ``--worker METHOD LENGTH``),
  and the growth of its peak RSS (``VmHWM``) over the loaded, warmed-up model is reported, its
  result kept until the peak is read.
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

Method = Callable[[Any, torch.Tensor], Any]
LENGTHS = (128, 512, 1024)


def plain(model: Any, tokens: torch.Tensor) -> None:
    """The reference: ``model(tokens)`` under ``inference_mode``."""
    with torch.inference_mode():
        model(tokens)


def _status(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def tokens_of(model: Any, length: int) -> torch.Tensor:
    """``length`` tokens: the model's BOS, then random ids drawn with a fixed seed."""
    generator = torch.Generator().manual_seed(0)
    body = torch.randint(1000, 40000, (1, length - 1), generator=generator)
    return torch.cat([torch.tensor([[model.tokenizer.bos_token_id]]), body], dim=1)


def _load(methods: dict[str, Method]) -> Any:
    import contribution_lens as cl

    model = cl.load_model()
    for method in methods.values():  # kernels, lazy buffers and caches, before anything is measured
        method(model, tokens_of(model, 40))
    return model


def _memory_worker(methods: dict[str, Method], method: str, length: int) -> dict:
    model = _load(methods)
    tokens = tokens_of(model, length)
    baseline = _status("VmRSS:")
    Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark
    kept = methods[method](model, tokens)  # the result is kept until the peak is read
    peak = _status("VmHWM:") - baseline
    del kept
    return {"peak_mb": peak}


def _peak_mb(script: str, method: str, length: int) -> float:
    out = subprocess.run(
        [sys.executable, script, "--worker", method, str(length)], check=True, capture_output=True, text=True
    ).stdout
    return float(json.loads(out.strip().splitlines()[-1])["peak_mb"])


def _fastest(methods: dict[str, Method], model: Any, length: int, repeats: int) -> dict[str, float]:
    tokens = tokens_of(model, length)
    best = dict.fromkeys(methods, float("inf"))
    for _ in range(repeats):
        for name, method in methods.items():
            start = time.perf_counter()
            method(model, tokens)
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def _table(lengths: list[int], names: list[str], unit: str, measure: Callable[[int], dict[str, float]]) -> None:
    others = names[1:]
    header = ["tokens", *[f"{n} {unit}" for n in names], *[f"{n} / plain" for n in others]]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for length in lengths:
        found = measure(length)
        cells = [f"{length:,}", *[f"{found[n]:.3f}" if unit == "s" else f"{found[n]:.0f}" for n in names]]
        cells += [f"{found[n] / found['plain']:.2f}x" for n in others]
        print("| " + " | ".join(cells) + " |", flush=True)


def _time_table(methods: dict[str, Method], lengths: list[int], repeats: int) -> None:
    model = _load(methods)  # freed on return, before the memory runs load their own
    _table(lengths, list(methods), "s", lambda length: _fastest(methods, model, length, repeats))


def main(methods: dict[str, Method], description: str, script: str, lengths: tuple[int, ...] = LENGTHS) -> None:
    """Print the time table, then (unless ``--no-memory``) the memory table, of ``methods`` at each length."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", nargs=2, metavar=("METHOD", "LENGTH"))
    parser.add_argument("--lengths", type=int, nargs="+", default=list(lengths))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-memory", action="store_true", help="skip the fresh-process memory runs")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(_memory_worker(methods, args.worker[0], int(args.worker[1]))))
        return
    load = Path("/proc/loadavg").read_text().split()[0]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {load}, bundled SmolLM2-135M")
    names = list(methods)
    _time_table(methods, args.lengths, args.repeats)
    if args.no_memory:
        return
    print()
    _table(args.lengths, names, "MB", lambda length: {n: _peak_mb(script, n, length) for n in names})
