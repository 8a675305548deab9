"""Each method's top edges against their exact effects, per input kind; the linearisation's own error.

For a bundled model on IOI: the linearisation error of ``contribution`` and ``contribution-ig``
(`contribution_lens.linearisation_error`: the change their terms add up to against the true
``m(counterfactual) - m(clean)``), then, for each method, its ``--count`` largest ``|score|`` edges of
each input kind (q, k, v, mlp, logits; `contribution_lens.circuits.top_edges`), each patched alone
(`contribution_lens.exact_edge_effects`: one patched pass an edge, every method's edges computed
once), and Spearman's rank correlation of score with exact effect per kind, signed and of
``|score|`` against ``|effect|``, with 95 % bootstrap intervals (edges and prompts resampled together).

    python benchmarks/circuit_edges.py                              # SmolLM2-135M, IOI, 16 prompts, 5 a kind
    python benchmarks/circuit_edges.py --n 32 --count 10 --steps 5  # more prompts, more edges
    python benchmarks/circuit_edges.py --model qwen2.5-0.5b --device cuda

Cost, in forward-pass equivalents a prompt: the scorings (eap 3, eap-ig 2 + 2 steps, contribution
4, contribution-ig 4 steps), the linearisation errors (2 + 2 and 2 + 2 steps, forward only), and
``2 + E`` for the exact effects of the ``E`` distinct edges chosen (at most 4 methods x 5 kinds x count).

A small run, to check that it works (SmolLM2-135M, IOI with its ABC counterfactual, 16 prompts, 4 edges
a kind, 5 steps; one thread of a shared two-core CPU, load average about 6):

    contribution     linearised change -5.088, true -3.739, error -1.349 [-2.903, 0.290] (36.1 %); mean |error| 2.835
    contribution-ig  linearised change -3.632, true -3.739, error  0.107 [-0.774, 0.872] ( 2.9 %); mean |error| 1.167
    scoring: eap 17 s, eap-ig 50 s, contribution 17 s, contribution-ig 87 s; 37 distinct edges patched in 139 s
    Spearman of score with exact effect, all 20 edges of each method (signed):
      eap 0.635 [0.120, 0.980], eap-ig 0.908 [0.674, 0.974], contribution 0.850 [0.533, 0.952],
      contribution-ig 0.904 [0.684, 0.974]

Per kind, 4 edges give intervals of [-1, 1]: the per-kind claims need ``--count`` of 20 or more and more
prompts (a run for the results, not this check).
"""

import argparse
import time

import pandas as pd
import torch

import contribution_lens as cl
from contribution_lens.circuits import top_edges

METHODS = ("eap", "eap-ig", "contribution", "contribution-ig")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a bundled model name (default: SmolLM2-135M)")
    parser.add_argument("--n", type=int, default=16, help="IOI prompts")
    parser.add_argument("--count", type=int, default=5, help="top edges of each input kind, per method")
    parser.add_argument("--steps", type=int, default=5, help="steps of eap-ig and contribution-ig")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated circuit methods")
    parser.add_argument("--device", default=None, help="cuda, cpu (default: where the model loads)")
    args = parser.parse_args()
    model = cl.load_model() if args.model is None else cl.load_model(args.model)
    if args.device:
        model = model.to(args.device)
    task = cl.Task.ioi(model, n=args.n)
    pd.set_option("display.width", 160)
    print(f"{args.model or 'SmolLM2-135M'}: {task!r}, steps {args.steps}, top {args.count} edges a kind")

    for method in ("contribution", "contribution-ig"):
        start = time.perf_counter()
        result = cl.linearisation_error(model, task, method, steps=args.steps)
        print(f"{result!r}  [{time.perf_counter() - start:.0f} s]")
        print(f"    mean |error| over prompts {result.mean_absolute_error:.4g}")

    scores = {}
    for method in args.methods.split(","):
        start = time.perf_counter()
        scores[method] = cl.circuit_scores(model, task, method=method, steps=args.steps)
        print(f"{method}: scored in {time.perf_counter() - start:.0f} s")
    chosen = {method: top_edges(s, args.count, per_kind=True) for method, s in scores.items()}
    union = sorted({edge for edges in chosen.values() for edge in edges})
    start = time.perf_counter()
    exact = cl.exact_edge_effects(model, task, union, progress=True)
    print(f"exact effects of {len(union)} distinct edges in {time.perf_counter() - start:.0f} s")
    row = {edge: i for i, edge in enumerate(union)}

    for method, edges in chosen.items():
        index = torch.tensor([row[edge] for edge in edges])
        graph_index = torch.tensor([scores[method].graph.edge_ids[edge] for edge in edges])
        edge_scores = scores[method].edge_scores
        assert edge_scores is not None
        result = cl.EdgeEffects(
            task.name, method, tuple(edges), edge_scores[graph_index], exact.clean, exact.patched[index]
        )
        signed = result.correlations()
        absolute = result.correlations(absolute=True)
        table = signed.merge(absolute, on=["kind", "edges"], suffixes=("", "_abs"))
        print(f"\n{method}: Spearman of score with exact effect (signed; |score| with |effect|)")
        print(table.to_string(index=False, float_format=lambda x: f"{x:.3f}"))


if __name__ == "__main__":
    main()
