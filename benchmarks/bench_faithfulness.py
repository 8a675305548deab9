"""Cost of the faithfulness protocol per evaluated chunk, against one clean forward pass.

A chunk costs 1 scoring pass (clean logits + every method's scores at every layer), 1 pass at
ratio 0 (shared by all methods) and one masked pass per (method, mode, nonzero ratio): with the
defaults 5 x 2 x 9 = 90, so 92 passes. This script measures, on the bundled model with 256-token
chunks in batches of 4: a plain forward, the scoring pass and one masked pass, counts the passes
of a real run (ratios 0 and 0.5, all methods), and prints the ratios.
Run: ``python benchmarks/bench_faithfulness.py``.
"""

import statistics
import tempfile
import time
from pathlib import Path

import torch

import contribution_lens as cl
from contribution_lens import adapter, data, evaluation, faithfulness

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "test.jsonl"


def timed(fn, repeats: int = 3) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    model = cl.load_model()
    spec = f"gsm8k={SHARED}" if SHARED.is_file() else "gsm8k"
    chunks = data.chunk_tokens(
        model.tokenizer, data.load_texts(spec), length=256, bos_token_id=model.tokenizer.bos_token_id, max_chunks=4
    )
    batch = adapter.to_token_batch(model, chunks)
    protocol = faithfulness.Protocol()
    plain = timed(lambda: adapter.forward(model, batch))
    scoring = timed(lambda: faithfulness.clean_run(model, batch, protocol))
    clean = faithfulness.clean_run(model, batch, protocol)
    masked = timed(
        lambda: faithfulness.masked_logits(model, batch, clean, method="contribution", mode="sufficiency", ratio=0.5)
    )

    calls = {"n": 0}
    original = adapter.forward

    def counting(*args, **kwargs):
        calls["n"] += 1
        return original(*args, **kwargs)

    adapter.forward = counting
    try:
        small = faithfulness.Protocol(ratios=(0.0, 0.5))
        config = evaluation.RunConfig(lm=(spec,), chunk_length=256, max_chunks=4, batch_size=4)
        with tempfile.TemporaryDirectory() as out:
            evaluation.run_faithfulness(model, config, small, out, progress=False)
    finally:
        adapter.forward = original
    full_passes = 2 + len(protocol.methods) * len(protocol.modes) * sum(r > 0 for r in protocol.ratios)
    per_chunk_full = (scoring + masked * (full_passes - 1)) / chunks.shape[0]
    print(f"bundled SmolLM2-135M, {chunks.shape[0]} chunks x 256 tokens per batch, {torch.get_num_threads()} threads")
    print(f"plain forward per batch:          {plain:.2f} s")
    print(f"scoring pass / plain forward:     {scoring / plain:.2f}x")
    print(f"masked pass / plain forward:      {masked / plain:.2f}x")
    print(f"passes counted in a run (ratios 0, 0.5; 5 methods, 2 modes): {calls['n']} for 1 batch (expected 12)")
    print(f"full protocol: {full_passes} passes per batch, {per_chunk_full:.1f} s per chunk")
    print(f"  = {per_chunk_full * chunks.shape[0] / plain:.0f}x one clean forward of the chunk")


if __name__ == "__main__":
    main()
