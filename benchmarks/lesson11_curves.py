"""The full faithfulness curves lesson 11 shows from a file, under MIB's protocol: ten sizes, two selections.

Lesson 11 (``notebooks/11_finding_a_circuit.ipynb``) builds ``cl.Task.ioi(model, n=16, seed=0)`` (MIB's
``s2-io-flip`` counterfactual), splits it with ``task.split(0.5, seed=0)`` into 8 scoring and 8 evaluation
prompts, scores the scoring prompts and computes a few sizes live on the evaluation prompts. The ten-size
curves (MIB's fractions, each size chosen by signed score, which MIB's CPR reads, and by ``|score|``, which
its CMD reads) of EAP, EAP-IG and the random control, and EAP's curve evaluated in-sample on the prompts it
was scored on (to show what that flatters), are read from the files this script writes:

* ``notebooks/data/11_curves.csv``: one row a run, selection and size (``method``, ``evaluated_on``:
  ``evaluation``, or ``scoring`` for the in-sample run, ``selection``, ``fraction``, ``chosen``, ``edges``
  after MIB's pruning, ``faithfulness`` and its 95 % interval);
* ``notebooks/data/11_areas.csv``: one row a run: the counterfactual, the prompts scored and evaluated,
  whether they overlap, MIB's CPR and CMD with their intervals, and the ``|score|`` selection's area.

The lesson checks that its live sizes agree with the file: a change of the task, the scoring or the
evaluation that moves the numbers fails there, and this script is run again (147 s on a
2-core CPU shared with other jobs, one torch thread).

    OMP_NUM_THREADS=1 python benchmarks/lesson11_curves.py
"""

import time
from pathlib import Path

import pandas as pd

import contribution_lens as cl

OUT = Path(__file__).resolve().parents[1] / "notebooks" / "data"
N, SEED, SPLIT, COUNTERFACTUAL = 16, 0, 0.5, "s2-io-flip"
"""The lesson's task: prompts, seed (of the prompts and of the split), share scored, counterfactual."""
RUNS = (("eap", "evaluation"), ("eap", "scoring"), ("eap-ig", "evaluation"), ("random", "evaluation"))
"""Each run: the method, scored on the scoring part, and the part its circuits are evaluated on."""


def main() -> None:
    started = time.perf_counter()
    model = cl.load_model()
    task = cl.Task.ioi(model, n=N, seed=SEED, counterfactual=COUNTERFACTUAL)
    parts = dict(zip(("scoring", "evaluation"), task.split(SPLIT, seed=SEED), strict=True))
    scores = {method: cl.circuit_scores(model, parts["scoring"], method=method) for method in dict(RUNS)}
    tables, areas = [], []
    for method, evaluated_on in RUNS:
        curve = cl.circuit_curve(model, parts[evaluated_on], scores[method], level="edge")
        tables.append(curve.table.assign(method=method, evaluated_on=evaluated_on))
        areas.append({"method": method, "evaluated_on": evaluated_on, "counterfactual": curve.counterfactual,
                      "scored": curve.scored.label, "evaluated": curve.evaluated.label, "in_sample": curve.in_sample,
                      "cpr": curve.cpr, "cpr_low": curve.cpr_interval[0], "cpr_high": curve.cpr_interval[1],
                      "cmd": curve.cmd, "cmd_low": curve.cmd_interval[0], "cmd_high": curve.cmd_interval[1],
                      "absolute_area": curve.absolute_area})  # fmt: skip
        print(f"{method} on {evaluated_on}: {curve!r} ({time.perf_counter() - started:.0f} s)", flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    columns = ["method", "evaluated_on", "selection", "fraction", "chosen", "edges", "faithfulness", "low", "high"]
    curves = pd.concat(tables, ignore_index=True)[columns].astype({"chosen": int, "edges": int})
    curves.to_csv(OUT / "11_curves.csv", index=False, float_format="%.6g")
    pd.DataFrame(areas).to_csv(OUT / "11_areas.csv", index=False, float_format="%.6g")
    print(f"wrote {OUT / '11_curves.csv'} and {OUT / '11_areas.csv'} in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
