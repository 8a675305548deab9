"""The GPU recipe's numbers: `contribution-lens replicate` on an 8B model in bfloat16, on one GPU.

Peak memory and time depend on a model's shapes (layers, widths, heads, vocabulary), not on its
weights' values, so this script builds a checkpoint with the shapes of Llama-3.1-8B and random
weights (no hub download is needed), saves it as a user's folder and runs the command on it, as the
documentation's recipe says, three times:

* ``quick``: the whole ``--size quick`` run (every part, every claim);
* ``paper-shaped``: ``--size paper`` cut to a few chunks and items (``--max-chunks``, ``--max-items``),
  so that every pass has the paper's shapes (256-token chunks, 64 rows a pass): its peak memory is
  the paper run's, and its time per pass scales to the paper run by the passes ``--dry-run`` counts;
* ``torchrun``: the quick run under ``torchrun --nproc_per_node=N`` (each rank holds the model and
  takes every N-th text: per-GPU memory is one rank's).

For each it prints the wall time, ``torch.cuda.max_memory_allocated`` (what the tensors took) and the
largest ``memory.used`` nvidia-smi reported while it ran (CUDA's context and caches included).
The random model answers at chance, so the multiple-choice removal part is skipped ("no verdict:
the model is at chance"): a real model above chance adds that part's passes (``--dry-run`` counts them).

Run (one GPU; the data folder as in the project's README)::

    python benchmarks/gpu_recipe.py --data ../shared/data --tokenizer PATH/TO/ANY/TOKENIZER --out runs/gpu-recipe
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

LLAMA_3_1_8B = {
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}
"""Llama-3.1-8B's shapes (its config.json), the rope scaling left out: it changes no shape."""


def data_flags(root: Path) -> list[str]:
    sets = {
        "gsm8k": root / "gsm8k" / "test.jsonl",
        "fineweb": root / "fineweb_edu" / "sample-10BT_first150.jsonl",
        "mmlu": root / "mmlu" / "test",
        "winogrande": root / "winogrande" / "dev.jsonl",
        "boolq": root / "boolq" / "val.jsonl",
    }
    return [flag for name, path in sets.items() for flag in ("--data", f"{name}={path}")]


def build(folder: Path, tokenizer: Path) -> None:
    """Save a Llama-3.1-8B-shaped checkpoint with random bfloat16 weights and ``tokenizer``'s files to ``folder``."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if (folder / "config.json").is_file():
        return
    tok = AutoTokenizer.from_pretrained(tokenizer)
    config = LlamaConfig(**LLAMA_3_1_8B, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    config.architectures = ["LlamaForCausalLM"]
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config)
    torch.set_default_dtype(torch.float32)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    del model
    torch.cuda.empty_cache()


class SmiPeak:
    """The largest ``memory.used`` (MiB) of GPU 0 nvidia-smi reports, read every 0.2 s while it runs."""

    def __init__(self) -> None:
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                check=False,
            ).stdout.split()
            if out:
                self.peak = max(self.peak, int(out[0]))
            time.sleep(0.2)

    def __enter__(self) -> "SmiPeak":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def run(label: str, command: list[str], log: Path) -> dict:
    """Run ``command`` (a replicate command line), report its time and peak GPU memory."""
    env = dict(os.environ, CL_PEAK_FILE=str(log.with_suffix(".peak")))
    started = time.perf_counter()
    with SmiPeak() as smi, log.open("w") as out:
        code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env, check=False).returncode
    seconds = time.perf_counter() - started
    peak_file = log.with_suffix(".peak")
    allocated = float(peak_file.read_text()) if peak_file.is_file() else float("nan")
    row = {"run": label, "exit": code, "seconds": round(seconds, 1), "smi_peak_gib": round(smi.peak / 1024, 2),
           "allocated_peak_gib": round(allocated / 2**30, 2), "command": " ".join(command)}  # fmt: skip
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True, help="the evaluation data folder")
    parser.add_argument("--tokenizer", type=Path, required=True, help="a folder with any tokenizer's files")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/llama-3.1-8b-shaped"))
    parser.add_argument("--gpus", type=int, default=1, help="ranks of the torchrun run")
    parser.add_argument("--only", nargs="*", default=["quick", "paper-shaped", "torchrun"])
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    build(args.model_dir, args.tokenizer)
    print(f"built {args.model_dir} in {time.perf_counter() - started:.0f} s", flush=True)
    peak = [sys.executable, str(Path(__file__).with_name("_peak_memory.py"))]
    common = ["replicate", "--model", str(args.model_dir), "--device", "cuda", "--dtype", "bfloat16",
              *data_flags(args.data)]  # fmt: skip
    runs = {
        "quick": [*peak, *common, "--out", str(args.out / "quick"), "--size", "quick"],
        "paper-shaped": [
            *peak,
            *common,
            "--out",
            str(args.out / "paper"),
            "--size",
            "paper",
            "--max-chunks",
            "4",
            "--max-items",
            "8",
        ],
        "torchrun": [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={args.gpus}",
            *peak[1:],
            *common,
            "--out",
            str(args.out / "torchrun"),
            "--size",
            "quick",
        ],
    }
    rows = []
    for label in args.only:
        rows.append(run(label, runs[label], args.out / f"{label}.log"))
        dry = [sys.executable, "-m", "contribution_lens.cli", *runs[label][runs[label].index("replicate") :]]
        dry[dry.index("--out") + 1] += "-dry"
        plan = subprocess.run([*dry, "--dry-run"], capture_output=True, text=True, check=False).stdout
        (args.out / f"{label}.plan.txt").write_text(plan)
    full = [sys.executable, "-m", "contribution_lens.cli", *common, "--out", str(args.out / "paper-dry"),
            "--size", "paper", "--dry-run"]  # fmt: skip
    (args.out / "paper-full.plan.txt").write_text(subprocess.run(full, capture_output=True, text=True).stdout)
    (args.out / "gpu_recipe.json").write_text(json.dumps(rows, indent=1))
    shutil.rmtree(args.out / "paper-dry", ignore_errors=True)


if __name__ == "__main__":
    main()
