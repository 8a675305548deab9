"""Cross-check ``value_zeroing`` against inseq 0.7.1 on the bundled SmolLM2-135M: rank agreement and speed.

inseq's value zeroing (Mohebbi et al. 2023) runs one full model pass per zeroed token and compares
each block's output with and without the zeroed value; ours reruns each block alone with the
zeroed variants stacked along the batch axis (`contribution_lens.methods.value_zeroing.value_zeroing_scores`).
Both threshold distances below 1e-5 and normalise each query's row to sum to 1. This script runs
both on the same token ids (no BOS: inseq's tokenisation of each text) and prints, per layer, the
Spearman rank correlation over the keys of each query (mean over every query inseq returns, i.e.
positions 0..n-2, and for the last of them alone), the largest absolute score difference, and
the wall-clock time of each side on every layer at once (model loading excluded, one warm-up).

inseq's last-layer states are the model's final hidden states, *after* the final RMSNorm (HF's
``hidden_states[-1]``); ours are ``hook_resid_post`` of the last block, before it. Cosine is
not invariant to the norm's per-dimension weight, so the last layer agrees less by construction.

Measured on 2 CPU cores with ``OMP_NUM_THREADS=1`` (4 texts of 11-16 tokens): Spearman >= 0.9996
on every layer 0..28 (largest score difference 4e-3), 0.9915 on layer 29 (the final norm, above),
and ours 3.8x faster (3.6 s against 13.6 s for all 30 layers).

Set-up (once; inseq is not a dependency of the project, it lives in its own venv). inseq 0.7.1's
value zeroing needs transformers < 4.54 (later decoder layers return a bare tensor where its hook
expects a tuple), so that venv pins transformers 4.53.3::

    python3.11 -m venv /work/venv-inseq
    /work/venv-inseq/bin/pip install -c constraints-cpu.txt inseq==0.7.1 transformers==4.53.3

(drop ``-c constraints-cpu.txt`` off this CPU machine). Then, with the project's environment::

    OMP_NUM_THREADS=1 python benchmarks/bench_value_zeroing.py --inseq-python /work/venv-inseq/bin/python

The script calls itself in that venv (``--worker``) to run inseq on the dequantised checkpoint
folder of the bundled model (`contribution_lens.loading._dequantised_checkpoint`, created on
first use) and reads its scores back as JSON.
"""

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

TEXTS = (
    "The cat sat on the mat because it was warm.",
    "When Mary and John went to the store, John gave a drink to",
    "The capital of France is Paris, and the capital of Italy is",
    "Value zeroing measures how much each token's value vector matters to the others.",
)
WARM_UP = "A short warm-up text."


def run_inseq(checkpoint: str, texts: list[str]) -> list[dict]:
    """In the inseq venv: ids, scores ``[key, query, layer]`` (None for NaN) and seconds per text."""
    import inseq
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    folder = Path(checkpoint)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    # The checkpoint was saved by transformers 5 (tokenizer class "TokenizersBackend", unknown to
    # 4.53): build the fast tokenizer from tokenizer.json and its special tokens.
    special = {
        k: config[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token") if isinstance(config.get(k), str)
    }
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), **special)
    # transformers 5 writes the rotary base under rope_parameters, which 4.53 ignores (it would
    # fall back to 10000 instead of SmolLM2's 100000 and compute a different model).
    hf_config = AutoConfig.from_pretrained(folder)
    rope = getattr(hf_config, "rope_parameters", None) or {}
    if "rope_theta" in rope:
        hf_config.rope_theta = rope["rope_theta"]
    hf_model = AutoModelForCausalLM.from_pretrained(folder, config=hf_config, torch_dtype=torch.float32)
    model = inseq.load_model(hf_model, "value_zeroing", tokenizer=tokenizer)
    results = []
    for text in [WARM_UP, *texts]:
        first = tokenizer.decode(tokenizer(text)["input_ids"][:1])
        start = time.perf_counter()
        out = model.attribute(input_texts=first, generated_texts=text, show_progress=False)
        seconds = time.perf_counter() - start
        attribution = out.sequence_attributions[0]
        scores = attribution.target_attributions.float()
        ids = [token.id for token in attribution.target]
        results.append(
            {
                "ids": ids,
                "seconds": seconds,
                "scores": torch.where(torch.isnan(scores), -1.0, scores).tolist(),
            }
        )
    return results[1:]


def average_ranks(values: Any) -> Any:
    """Ranks of a numpy vector, ties sharing their mean rank."""
    order = np.argsort(values, kind="stable")
    ranks = np.empty(len(values))
    ranks[order] = np.arange(len(values), dtype=float)
    for value in np.unique(values):  # ties share their mean rank
        tied = values == value
        ranks[tied] = ranks[tied].mean()
    return ranks


def spearman(a: Any, b: Any) -> float:
    """Spearman's rho of two numpy vectors (NaN when one is constant)."""
    ra, rb = average_ranks(np.asarray(a)), average_ranks(np.asarray(b))
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


@functools.cache
def bundled_model() -> Any:
    import contribution_lens as cl

    return cl.load_model()


def run_ours(ids: list[int]) -> tuple[Any, float]:
    """Our scores ``[layer query key]`` for one text's ids, and the seconds they took."""
    import torch

    from contribution_lens import adapter
    from contribution_lens.methods import value_zeroing

    model = bundled_model()
    batch = adapter.to_token_batch(model, torch.tensor([ids]))
    layers = list(range(model.cfg.n_layers))
    start = time.perf_counter()
    scores = value_zeroing.value_zeroing_scores(model, batch, layers)
    return torch.stack([scores[layer][0] for layer in layers]), time.perf_counter() - start


def compare(inseq_results: list[dict]) -> None:
    run_ours([1, 504, 2644])  # warm-up
    per_layer_all: dict[int, list[float]] = {}
    per_layer_last: dict[int, list[float]] = {}
    max_diff: dict[int, float] = {}
    inseq_seconds = ours_seconds = 0.0
    for result in inseq_results:
        theirs = np.asarray(result["scores"])  # [key, query, layer], query k = position k
        ours, seconds = run_ours(result["ids"])
        ours_seconds += seconds
        inseq_seconds += result["seconds"]
        n_query = theirs.shape[1]
        for layer in range(theirs.shape[2]):
            mine = ours[layer].numpy()  # [query key]
            rhos = []
            for query in range(2, n_query):  # at least three keys to rank
                rho = spearman(mine[query, : query + 1], theirs[: query + 1, query, layer])
                if not np.isnan(rho):
                    rhos.append(rho)
                diff = np.abs(mine[query, : query + 1] - theirs[: query + 1, query, layer]).max()
                max_diff[layer] = max(max_diff.get(layer, 0.0), float(diff))
            per_layer_all.setdefault(layer, []).extend(rhos)
            last = n_query - 1
            per_layer_last.setdefault(layer, []).append(
                spearman(mine[last, : last + 1], theirs[: last + 1, last, layer])
            )
    print(f"{len(inseq_results)} texts, lengths {[len(r['ids']) for r in inseq_results]} tokens")
    print("layer  spearman(all queries)  spearman(last query)  max |diff|")
    for layer in sorted(per_layer_all):
        print(
            f"{layer:5d}  {np.nanmean(per_layer_all[layer]):21.4f}  {np.nanmean(per_layer_last[layer]):20.4f}"
            f"  {max_diff[layer]:10.2e}"
        )
    print(
        f"mean over layers 0..{len(per_layer_all) - 2}: "
        f"{np.mean([np.nanmean(per_layer_all[layer]) for layer in sorted(per_layer_all)[:-1]]):.4f}"
    )
    print(f"inseq {inseq_seconds:.2f} s, ours {ours_seconds:.2f} s: ours is {inseq_seconds / ours_seconds:.1f}x faster")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inseq-python", default=os.environ.get("INSEQ_PYTHON", "/work/venv-inseq/bin/python"))
    parser.add_argument("--worker", nargs=3, metavar=("CHECKPOINT", "TEXTS_JSON", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        checkpoint, texts, out = args.worker
        Path(out).write_text(json.dumps(run_inseq(checkpoint, json.loads(texts))))
        return
    from contribution_lens.loading import _dequantised_checkpoint

    checkpoint = str(_dequantised_checkpoint())
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "inseq.json"
        command = [args.inseq_python, __file__, "--worker", checkpoint, json.dumps(list(TEXTS)), str(out)]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            tail = done.stderr[-3000:]
            sys.exit(f"the inseq worker failed (is inseq 0.7.1 installed in {args.inseq_python}?):\n{tail}")
        results = json.loads(out.read_text())
    compare(results)


if __name__ == "__main__":
    main()
