"""The IOI circuits at MIB's scale: every command of docs/results.md#circuits-at-mibs-scale, run in order.

    python benchmarks/mib_runs.py --list              # the commands, in the order they run
    python benchmarks/mib_runs.py --workers 2         # run them, two at a time (each resumes where it stopped)
    python benchmarks/mib_runs.py --only gemma3-270m  # the commands whose text holds this

Each command is one `contribution-lens circuit` run into its own folder under ``runs/mib/``: IOI with
1,000 prompts, 500 scored and 500 evaluated (``--split 0.5``, seed 0), every circuit method at edge
and node level on MIB's ten sizes, for each counterfactual (``s2-io-flip``, MIB's default, then
``abc``) and each bundled decoder. Activation patching (one patched pass a node) is scored on the
first 100 of the same 500 scoring prompts (``--scored 100``) and its circuits evaluated on the same
500 prompts as every other method's; it runs into a folder of its own. Then EAP and EAP-IG on MIB's
ungrouped edge counting (``--edges mib``), to measure what the counting does to CPR and CMD. A run
that stopped resumes where it stopped (each method's scores and curves are files); a finished one
is skipped. ``python benchmarks/circuit_table.py runs/mib/*`` prints the table.

Every process runs one torch thread (``OMP_NUM_THREADS=1``), so ``--workers 2`` fills two cores.
"""

import argparse
import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("smollm2-135m", "gemma3-270m", "qwen2.5-0.5b")
COUNTERFACTUALS = ("s2-io-flip", "abc")
METHODS = ("eap", "eap-ig", "contribution", "contribution-ig", "information-flow-routes", "random")
COMMON = ("--task", "ioi", "--n", "1000", "--split", "0.5", "--seed", "0")


def commands(out: Path) -> list[list[str]]:
    """Every run, the default counterfactual first, each model's main run before its activation patching."""
    runs: list[list[str]] = []
    for counterfactual in COUNTERFACTUALS:
        for model in MODELS:
            base = ["contribution-lens", "circuit", "--model", model, *COMMON, "--counterfactual", counterfactual]
            folder = out / f"{model}-ioi-{counterfactual}"
            methods = [word for method in METHODS for word in ("--method", method)]
            runs.append([*base, *methods, "--level", "edge", "--level", "node", "--out", str(folder)])
            runs.append([*base, "--method", "activation-patching", "--level", "node", "--scored", "100",
                         "--out", f"{folder}-ap"])  # fmt: skip
    for model in MODELS:
        base = ["contribution-lens", "circuit", "--model", model, *COMMON, "--counterfactual", "s2-io-flip"]
        runs.append([*base, "--method", "eap", "--method", "eap-ig", "--level", "edge", "--level", "node",
                     "--edges", "mib", "--out", str(out / f"{model}-ioi-s2-io-flip-mib")])  # fmt: skip
    return runs


def finished(command: list[str]) -> bool:
    return (Path(command[command.index("--out") + 1]) / "circuits.csv").exists()


def run(command: list[str], logs: Path) -> int:
    folder = Path(command[command.index("--out") + 1])
    log = logs / f"{folder.name}.log"
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    executable = Path(sys.executable).parent / command[0]
    start = time.time()
    with log.open("a", encoding="utf-8") as handle:
        handle.write(f"$ {shlex.join(command)}\n")
        handle.flush()
        status = subprocess.call(
            [str(executable), *command[1:]], stdout=handle, stderr=subprocess.STDOUT, env=environment
        )
        handle.write(f"# exit {status} after {time.time() - start:.0f} s\n")
    print(f"{'done' if status == 0 else f'FAILED ({status})'}: {folder.name} ({time.time() - start:.0f} s)", flush=True)
    return status


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "mib")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--only", default="", help="run the commands whose text holds this")
    parser.add_argument("--list", action="store_true", help="print the commands and stop")
    args = parser.parse_args()
    chosen = [c for c in commands(args.out) if args.only in shlex.join(c)]
    if args.list:
        for command in chosen:
            print(("# done: " if finished(command) else "") + shlex.join(command))
        return 0
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    todo = [command for command in chosen if not finished(command)]
    with ThreadPoolExecutor(args.workers) as pool:
        statuses = list(pool.map(lambda command: run(command, logs), todo))
    return int(any(statuses))


if __name__ == "__main__":
    raise SystemExit(main())
