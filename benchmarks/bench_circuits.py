"""Cost of finding and testing circuits, in forward-pass equivalents per prompt, and peak memory.

On one model and one task (random-token induction prompts: a random half repeated, the
counterfactual's first half resampled; or ``--task ioi`` where the package has ``Task.ioi``), each
measured against ``plain``, one forward pass over the clean prompts (batched as the methods batch):

* ``eap``: ``cl.circuit_scores(model, task, method="eap")`` (target: at most 3 on Qwen2.5-0.5B, 64 IOI prompts);
* ``contribution``: the same with ``method="contribution"`` (target: at most 5 at that setting);
* ``eap-ig``: the same with ``method="eap-ig"`` (MIB's 5 steps);
* ``activation-patching``: the same with ``method="activation-patching"`` (one pass a head and MLP: run it on
  few prompts);
* ``curve``: ``cl.circuit_curve(model, task, scores)``, the ten sizes at edge level (target: at most 12;
  ``--level node``: at node level).

With ``--parts``, the CPU time of each part of ``eap`` and ``contribution`` is printed too (in plain
passes): the counterfactual's recording pass, the clean gradient pass, the forward-mode pass, the
backward pass and the products of differences and gradients.

Time: in one process the methods alternate ``--repeats`` times and the fastest run of each counts;
its ratio to ``plain`` is the number of forward-pass equivalents, by wall clock and by the
process's CPU time (on a CPU shared with other jobs the second is the steadier: with one torch
thread it counts only this process's work). ``plain`` is timed again before every method and its
median counts: one plain pass is short, and its time alone moved by 15 % between runs on a quiet
virtual machine, while a method's longer time averages such swings out. Memory: the peak CUDA memory of
each method (``torch.cuda.max_memory_allocated``, reset before it) on a GPU, else the growth of the
process's peak RSS (``VmHWM``) over the loaded model, in the order run. Run:
``python benchmarks/bench_circuits.py --prompts 8`` (bundled SmolLM2), or
``python benchmarks/bench_circuits.py --model qwen2.5-0.5b --prompts 64 --task ioi --device cuda``.
``--edges mib`` measures the same on MIB's ungrouped graph (every query head its own k and v inputs).
"""

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import contribution_lens as cl


def induction_task(model: Any, n: int, half: int, seed: int) -> cl.Task:
    """Random halves repeated (the answer: the token after the repeat's start); counterfactual: other first halves."""
    generator = torch.Generator().manual_seed(seed)
    vocab = int(model.cfg.d_vocab)
    first = torch.randint(100, min(vocab, 20000), (n, half), generator=generator)
    other = torch.randint(100, min(vocab, 20000), (n, half), generator=generator)
    clean = torch.cat([first, first[:, :-1]], 1)
    corrupted = torch.cat([other, first[:, :-1]], 1)
    return cl.Task("induction", clean, corrupted, first[:, -1], other[:, -1], cl.Task.full_length(clean))


def _peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _load() -> str:
    """The 1, 5 and 15 minute load averages (other jobs on the machine make timings noisy)."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def _timed(fn: Callable[[], Any], cuda: bool) -> tuple[float, float, float]:
    """Wall-clock seconds, the process's CPU seconds (its work, whatever else the machine runs) and peak MiB."""
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = _peak_rss_mb()
    start, cpu = time.perf_counter(), time.process_time()
    fn()
    if cuda:
        torch.cuda.synchronize()
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else _peak_rss_mb() - before
    return elapsed, cpu, peak


PARTS = {
    "recording pass": ("contribution_lens.circuits.interchange", "record"),
    "clean gradient pass": ("contribution_lens.circuits.attribution", "_gradient_pass"),
    "forward-mode pass": ("contribution_lens.circuits.contribution", "_linearised_pass"),
    "embeddings": ("contribution_lens.circuits.interchange", "embeddings"),
    "backward pass": ("contribution_lens.circuits.interchange", "input_gradients"),
    "products": ("contribution_lens.circuits.interchange", "add_products"),
}
"""Parts of the scoring methods timed by ``--parts``: the module and function each is."""


def time_parts(spent: dict[str, float]) -> None:
    """Wrap every function of `PARTS` so that its CPU seconds add up in ``spent`` (outer parts count their inner)."""
    import importlib

    for part, (module_name, name) in PARTS.items():
        module = importlib.import_module(module_name)
        inner = getattr(module, name)

        def timed(*args: Any, _inner: Any = inner, _part: str = part, **kwargs: Any) -> Any:
            start = time.process_time()
            try:
                return _inner(*args, **kwargs)
            finally:
                spent[_part] = spent.get(_part, 0.0) + time.process_time() - start

        setattr(module, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a name cl.load_model takes (default: the bundled SmolLM2)")
    parser.add_argument("--task", default="induction", choices=("induction", "ioi"))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--half", type=int, default=10, help="tokens in an induction prompt's random half")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--memory", type=int, default=2**30, help="bytes a batch's activation differences may take")
    parser.add_argument(
        "--methods",
        default="eap,contribution,eap-ig,curve",
        help="comma-separated: eap, contribution, eap-ig, activation-patching, curve",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads on a CPU (default: torch's own)")
    parser.add_argument("--level", default="edge", choices=("edge", "node"), help="the curve's circuits")
    parser.add_argument("--parts", action="store_true", help="print the CPU time of each part of eap and contribution")
    parser.add_argument("--edges", default="native", choices=("native", "mib"), help="the graph's edge counting")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = cl.load_model(args.model) if args.model else cl.load_model()
    model = model.to(args.device)
    cuda = args.device.startswith("cuda")
    if args.task == "ioi":
        task = cl.Task.ioi(model, n=args.prompts, seed=0)  # type: ignore[attr-defined]
    else:
        task = induction_task(model, args.prompts, args.half, seed=0)
    graph = cl.circuit_graph(model, edges=args.edges)
    options = {"memory": args.memory, "edges": args.edges}
    scores = cl.circuit_scores(model, task, method="eap", **options)  # warm-up, and the curve's scores
    size = cl.circuits.interchange.batch_size(task, len(graph.writers), int(model.cfg.d_model), 2.0, args.memory)

    def plain() -> None:
        with torch.inference_mode():
            for rows in cl.circuits.interchange.batches(task, size):
                model(task.clean[rows].to(args.device))

    methods: dict[str, Callable[[], Any]] = {
        "plain": plain,
        "eap": lambda: cl.circuit_scores(model, task, method="eap", **options),
        "contribution": lambda: cl.circuit_scores(model, task, method="contribution", **options),
        "eap-ig": lambda: cl.circuit_scores(model, task, method="eap-ig", **options),
        "activation-patching": lambda: cl.circuit_scores(model, task, method="activation-patching", **options),
        "curve": lambda: cl.circuit_curve(model, task, scores, args.level, memory=args.memory),
    }
    chosen = args.methods.split(",")
    unknown = sorted(set(chosen) - set(methods))
    if unknown:
        raise SystemExit(f"--methods: unknown {', '.join(unknown)}; known: {', '.join(list(methods)[1:])}")
    methods = {name: fn for name, fn in methods.items() if name == "plain" or name in chosen}
    spent: dict[str, float] = {}
    parts: dict[str, dict[str, float]] = {}
    if args.parts:
        time_parts(spent)
    load = _load()
    best = {name: float("inf") for name in methods}
    best_cpu = {name: float("inf") for name in methods}
    peaks = {name: 0.0 for name in methods}
    plains: list[tuple[float, float]] = []
    for repeat in range(args.repeats):
        for name, fn in methods.items():
            if name != "plain":  # the plain pass again, beside each method
                elapsed, cpu, _ = _timed(plain, cuda)
                plains.append((elapsed, cpu))
            spent.clear()
            elapsed, cpu, peak = _timed(fn, cuda)
            if name == "plain":
                plains.append((elapsed, cpu))
            if cpu < best_cpu[name]:
                parts[name] = dict(spent)
            best[name], best_cpu[name] = min(best[name], elapsed), min(best_cpu[name], cpu)
            peaks[name] = max(peaks[name], peak)
            print(f"  run {repeat + 1}: {name} {elapsed:.2f} s, {cpu:.2f} CPU s, load {_load()}", flush=True)
    best["plain"], best_cpu["plain"] = (float(torch.tensor(column).median()) for column in zip(*plains, strict=True))
    print(
        f"{args.model or 'SmolLM2-135M'} on {args.device}, {args.task}: {len(task)} prompts of "
        f"{task.clean.shape[1]} tokens, {len(graph.edges)} edges ({args.edges} counting), {len(graph.components)} "
        f"nodes, batches of {size}"
    )
    unit = "peak CUDA MiB" if cuda else "peak RSS growth MiB"
    print(f"torch threads {torch.get_num_threads()}, load average before and after: {load} / {_load()}")
    cpus = sorted(cpu for _, cpu in plains)
    print(f"plain: the median of {len(plains)} timings (CPU s from {cpus[0]:.2f} to {cpus[-1]:.2f})")
    print(f"{'method':<19} {'seconds':>9} {'forward passes':>15} {'CPU s':>9} {'by CPU':>7} {unit:>20}")
    for name in methods:
        ratio, by_cpu = best[name] / best["plain"], best_cpu[name] / best_cpu["plain"]
        print(
            f"{name:<19} {best[name]:>9.3f} {ratio:>15.2f} {best_cpu[name]:>9.2f} {by_cpu:>7.2f} {peaks[name]:>20.1f}"
        )
    for name in ("eap", "contribution"):
        if parts.get(name):
            shares = ", ".join(f"{part} {seconds / best_cpu['plain']:.2f}" for part, seconds in parts[name].items())
            print(f"{name}, parts in plain passes of CPU time (the fastest run): {shares}")
    if "curve" in methods:
        print(
            f"curve ({args.level} level), layers whose heads and MLP each size's patched pass computes, of "
            f"{graph.n_layers}:",
            writers_run(scores, args),
        )


def writers_run(scores: cl.CircuitScores, args: argparse.Namespace) -> str:
    """The layers whose heads and MLP a patched pass computes at each of the curve's sizes (the others take the
    counterfactual's output): ``size: heads/mlps``."""
    graph, counts = scores.graph, []
    for fraction in cl.circuits.FRACTIONS[:-1]:  # the whole model is the clean pass: no patched pass
        idle = cl.circuits.interchange.idle_writers(graph, scores.circuit(fraction, args.level).patch())
        run = [graph.n_layers - sum(kind == wanted for kind, _ in idle) for wanted in ("heads", "mlp")]
        counts.append(f"{fraction:g}: {run[0]}/{run[1]}")
    return ", ".join(counts)


if __name__ == "__main__":
    main()
