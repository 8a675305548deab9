"""What MIB's pruning and greedy selection do to a curve: f and the edge count with and without each.

MIB always prunes (``apply_topn(..., prune=True)``: edges on no path from the embeddings to the logits are
dropped) and chooses information flow routes' circuits greedily from the logits (``apply_greedy``). In this
package a pruned edge changes nothing in the patched pass except where a post-attention norm mixes a layer's
heads, so pruning should leave f as it is (up to float error) and lower the edge count; greedy selection
chooses other edges. This prints, per model, method, level and selection (signed, ``|score|``): the largest
change of f over the sizes, and the edges kept, with and without.

    python benchmarks/circuit_selection.py --model smollm2-135m --model gemma3-270m --prompts 4
    python benchmarks/circuit_selection.py --fractions 0.001,0.01,0.1 --level node

``--routes-cost`` prints instead the cost of scoring with MIB's information flow routes and with the
final-position variant, in forward-pass equivalents a prompt: the fastest of two scorings over the median
time of one plain clean forward pass of the same prompts (`contribution_lens.circuits.runner.forward_seconds`).
"""

import argparse
import sys
import time

import torch

import contribution_lens as cl
from contribution_lens.circuits import runner
from contribution_lens.circuits.evaluation import FRACTIONS, SELECTIONS


def compare(model, task, scores, level: str, fractions: tuple[float, ...], what: str) -> list[str]:
    """Two curves, ``what`` (prune or greedy) on and off: the largest change of f and the edge counts, per selection."""
    options = {"prune": ({"prune": True}, {"prune": False}), "greedy": ({"greedy": True}, {"greedy": False})}[what]
    start = time.perf_counter()
    on, off = (cl.circuit_curve(model, task, scores, level, fractions=fractions, **o) for o in options)
    seconds = time.perf_counter() - start
    lines = []
    for row, selection in enumerate(SELECTIONS):
        change = float((on.faithfulness[row] - off.faithfulness[row]).abs().max())
        lines.append(
            f"{scores.method:>24} {level:>4} {selection:>8} {what:>6}: max |f(on) - f(off)| {change:.2e}; "
            f"edges on {on.edges[row].int().tolist()}, off {off.edges[row].int().tolist()}"
        )
    lines.append(
        f"{'':>24} CPR {on.cpr:.3f} / {off.cpr:.3f}, CMD {on.cmd:.3f} / {off.cmd:.3f} (on / off); {seconds:.0f} s"
    )
    return lines


def routes_cost(model, task) -> list[str]:
    """Scoring seconds of both information-flow routes over one plain pass's."""
    forward = runner.forward_seconds(model, task)
    lines = []
    for method in ("information-flow-routes", "information-flow-routes-last"):
        times = []
        for _ in range(2):
            start = time.perf_counter()
            cl.circuit_scores(model, task, method=method)
            times.append(time.perf_counter() - start)
        lines.append(f"{method:>30}: {min(times) / forward:.2f} forward-pass equivalents a prompt "
                     f"({min(times):.2f} s; one plain pass {forward:.3f} s)")  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", help="bundled name (repeatable; default: smollm2-135m)")
    parser.add_argument("--prompts", type=int, default=4, help="IOI prompts (MIB's s2-io-flip), in-sample")
    parser.add_argument("--fractions", default=",".join(map(str, FRACTIONS)), help="comma-separated sizes")
    parser.add_argument("--level", default="edge", choices=("edge", "node"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--routes-cost", action="store_true", help="time both information-flow routes instead")
    args = parser.parse_args(argv)
    fractions = tuple(float(x) for x in args.fractions.split(","))
    torch.set_grad_enabled(False)
    for name in args.model or ["smollm2-135m"]:
        model = cl.load_model(name)
        task = cl.Task.ioi(model, n=args.prompts, seed=args.seed)
        print(f"{name}: {task!r}")
        if args.routes_cost:
            print("\n".join(routes_cost(model, task)))
            continue
        eap = cl.circuit_scores(model, task, method="eap", seed=args.seed)
        for line in compare(model, task, eap, args.level, fractions, "prune"):
            print(line)
        if args.level == "edge":
            routes = cl.circuit_scores(model, task, method="information-flow-routes")
            for line in compare(model, task, routes, "edge", fractions, "greedy"):
                print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
