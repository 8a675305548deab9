"""``contribution`` and ``information-flow-routes`` beside EAP on a bundled model: CPR, CMD and cost.

For each method: its edge-level faithfulness curve (`contribution_lens.circuit_curve`, MIB's ten
sizes) with CPR and CMD and their 95 % bootstrap intervals, and the seconds `circuit_scores` takes,
also as forward-pass equivalents: the same run times a plain forward pass of the task's clean batch.

    python benchmarks/circuit_new_methods.py                      # SmolLM2-135M, IOI, 8 prompts
    python benchmarks/circuit_new_methods.py smollm2-135m 16      # a model and a number of prompts

Measured on SmolLM2-135M, IOI, 8 prompts of 20 tokens, on a shared two-core CPU (so seconds are
noisy; the ratios come from one run), edge level:

    eap                      CPR 0.870 [0.723, 0.973]  CMD 0.129 [0.072, 0.276]  12.5 forward passes
    contribution             CPR 0.659 [0.510, 0.773]  CMD 0.340 [0.226, 0.489]  16.7 forward passes
    information-flow-routes  CPR 0.051 [-0.573, 0.531] CMD 0.948 [0.468, 1.572]   2.8 forward passes
"""

import sys
import time

import torch

import contribution_lens as cl

METHODS = ("eap", "contribution", "information-flow-routes")


def _forward_seconds(model, task, repeats: int = 5) -> float:
    with torch.inference_mode():
        model(task.clean)  # warm
        start = time.perf_counter()
        for _ in range(repeats):
            model(task.clean)
    return (time.perf_counter() - start) / repeats


def main(name: str | None = None, n: int = 8) -> None:
    model = cl.load_model() if name is None else cl.load_model(name)
    task = cl.Task.ioi(model, n=n)
    forward = _forward_seconds(model, task)
    print(f"{name or 'default'}: IOI, {n} prompts, {tuple(task.clean.shape)}; plain forward {forward:.3f} s")
    for method in METHODS:
        cl.circuit_scores(model, task, method=method) if method == METHODS[0] else None  # warm once
        start = time.perf_counter()
        scores = cl.circuit_scores(model, task, method=method)
        seconds = time.perf_counter() - start
        curve = cl.circuit_curve(model, task, scores, level="edge")
        low, high = curve.cpr_interval
        c_low, c_high = curve.cmd_interval
        print(
            f"{method:>24}: CPR {curve.cpr:.3f} [{low:.3f}, {high:.3f}]"
            f"  CMD {curve.cmd:.3f} [{c_low:.3f}, {c_high:.3f}]"
            f"  {seconds:.2f} s = {seconds / forward:.1f} forward passes"
        )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None, int(sys.argv[2]) if len(sys.argv) > 2 else 8)
