"""Cost of a faithfulness sweep against ``passes x one forward`` (the batching benchmark ratio).

A sweep of one unit is 1 scoring pass (clean logits + every method's scores) and one masked
copy of the unit per condition; `faithfulness.masked_forward` stacks conditions along the batch
(``rows_per_pass`` rows a call), so a sweep should cost about ``passes x`` one plain forward:

    benchmark ratio = time(sweep) / (passes x time(plain forward of the unit)).

It also prints the pass count of the default grid (every protocol) and `faithfulness.plan_run`'s
estimate beside the measured time. Run:
``python benchmarks/bench_faithfulness.py [--chunks 4] [--length 256] [--rows-per-pass N] [--device cuda]``;
with ``--threads 1 2`` it times a forward pass of the unit with each torch thread count instead (the
counts taken in turn, five times, in one run) and prints each against the first.
"""

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

import contribution_lens as cl
from contribution_lens import adapter, faithfulness
from contribution_lens.faithfulness import data, runner
from contribution_lens.losses import token_nll

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "test.jsonl"


def timed(fn, repeats: int = 3) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def sweep(model, batch, protocol: faithfulness.Settings, rows_per_pass: int | None) -> int:
    """Every condition of ``protocol`` on one unit; returns the number of passes."""
    clean = faithfulness.clean_run(model, batch, protocol)
    passes = 1
    for name in protocol.protocols:
        removal = faithfulness.PROTOCOLS[name]
        todo = faithfulness.conditions(protocol, protocol.ratios, removal.variants(clean.layers))
        for _condition, logits in faithfulness.masked_forward(
            model, batch, clean, removal, todo, rows_per_pass=rows_per_pass
        ):
            token_nll(logits, batch.tokens, batch.attention_mask)
            passes += 1
    return passes


def compare_threads(model, batch, counts: list[int], rounds: int = 5) -> None:
    """A forward pass of the unit with each thread count, the counts taken in turn ``rounds`` times.

    Taken in turn, the counts meet the same drift of the machine's load; a sweep is passes of this kind.
    """
    before = torch.get_num_threads()
    times: dict[int, list[float]] = {n: [] for n in counts}
    try:
        adapter.forward(model, batch)  # warm-up
        for _ in range(rounds):
            for n in counts:
                torch.set_num_threads(n)
                start = time.perf_counter()
                adapter.forward(model, batch)
                times[n].append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"bundled SmolLM2-135M, {batch.tokens.shape[0]} chunks x {batch.tokens.shape[1]} tokens, "
        f"{os.cpu_count()} cores, load average {load:.2f}; median of {rounds} passes, counts in turn"
    )
    first = statistics.median(times[counts[0]])
    for n in counts:
        median = statistics.median(times[n])
        print(f"threads {n}: {median:.3f} s a pass, {median / first:.2f}x {counts[0]} thread(s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--rows-per-pass", type=int, default=None, help="default: 64 on a GPU, the unit on a CPU")
    parser.add_argument("--device", default=None)
    parser.add_argument(
        "--threads", type=int, nargs="+", default=None, help="compare a pass's time with these torch thread counts"
    )
    args = parser.parse_args()
    model = cl.load_model(device=args.device)
    spec = f"gsm8k={SHARED}" if SHARED.is_file() else "gsm8k"
    chunks = data.chunk_tokens(
        model.tokenizer,
        data.load_texts(spec),
        length=args.length,
        bos_token_id=model.tokenizer.bos_token_id,
        max_chunks=args.chunks,
    )
    batch = adapter.to_token_batch(model, chunks)
    protocol = faithfulness.Settings(ratios=(0.05, 0.2), protocols=("every_layer",))
    if args.threads:
        compare_threads(model, batch, args.threads)
        return
    plain = timed(lambda: adapter.forward(model, batch))
    scoring = timed(lambda: faithfulness.clean_run(model, batch, protocol))
    passes = sweep(model, batch, protocol, args.rows_per_pass)
    start = time.perf_counter()  # the first sweep was the warm-up
    sweep(model, batch, protocol, args.rows_per_pass)
    swept = time.perf_counter() - start
    plain = min(plain, timed(lambda: adapter.forward(model, batch)))  # again: other load shifts timings
    rows = args.rows_per_pass or (64 if torch.cuda.is_available() else batch.tokens.shape[0])
    copies = max(1, rows // batch.tokens.shape[0])
    tiled = adapter.pad_rows(model, list(batch.tokens) * copies)
    stacked = timed(lambda: adapter.forward(model, tiled))
    device = next(model.parameters()).device
    print(
        f"bundled SmolLM2-135M on {device}, {chunks.shape[0]} chunks x {args.length} tokens, "
        f"{torch.get_num_threads()} threads"
    )
    print(f"plain forward of the unit:        {plain:.3f} s")
    print(f"scoring pass / plain forward:     {scoring / plain:.2f}x")
    print(f"sweep (every_layer, {passes} passes, {rows} rows a pass): {swept:.2f} s")
    print(f"plain forward of {copies} stacked copies / ({copies} x plain forward): {stacked / (copies * plain):.2f}")
    print(f"benchmark ratio sweep / (passes x forward): {swept / (passes * plain):.2f}")

    full = faithfulness.Settings(protocols=tuple(faithfulness.PROTOCOLS))
    config = faithfulness.DataSettings(
        data=(spec,), chunk_length=args.length, max_chunks=args.chunks, batch_size=args.chunks
    )
    units = runner.build_units(model, config)
    for name in faithfulness.PROTOCOLS:
        one = faithfulness.Settings(protocols=(name,))
        work = runner.plan_units(model, units, config, one)
        print(f"default grid, {name}: {sum(w.passes for w in work)} passes per unit of {args.chunks} chunks")
    plan = faithfulness.plan_run(model, full, config)
    print(f"dry run, every protocol, default grid: {plan.describe()}")


if __name__ == "__main__":
    main()
