"""The full faithfulness curves lesson 11 shows from a file: EAP's and the random control's, at MIB's ten sizes.

Lesson 11 (``notebooks/11_finding_a_circuit.ipynb``) computes EAP's curve live at three sizes only, so that it
runs in a few minutes; the ten-size curves of both methods (two edge-level curves: a few minutes on a
2-core CPU) are read from ``notebooks/data/11_curves.csv`` and their areas from ``notebooks/data/11_areas.csv``,
which this script writes, on the lesson's task (``cl.Task.ioi(model, n=4, seed=0)``). The lesson checks that
its live sizes agree with the file: a change of the evaluation that moves the numbers fails there, and this
script is run again.

    python benchmarks/lesson11_curves.py
"""

import time
from pathlib import Path

import pandas as pd

import contribution_lens as cl

OUT = Path(__file__).resolve().parents[1] / "notebooks" / "data"
METHODS = {"eap, edges": "eap", "random, edges": "random"}


def main() -> None:
    started = time.perf_counter()
    model = cl.load_model()
    task = cl.Task.ioi(model, n=4, seed=0)
    tables, areas = [], []
    for name, method in METHODS.items():
        curve = cl.circuit_curve(model, task, cl.circuit_scores(model, task, method=method), level="edge")
        tables.append(curve.table.assign(method=name))
        areas.append({"method": name, "cpr": curve.cpr, "cpr_low": curve.cpr_interval[0],
                      "cpr_high": curve.cpr_interval[1], "cmd": curve.cmd, "cmd_low": curve.cmd_interval[0],
                      "cmd_high": curve.cmd_interval[1]})  # fmt: skip
    OUT.mkdir(parents=True, exist_ok=True)
    columns = ["method", "fraction", "size", "faithfulness", "low", "high"]
    pd.concat(tables, ignore_index=True)[columns].to_csv(OUT / "11_curves.csv", index=False, float_format="%.6g")
    pd.DataFrame(areas).to_csv(OUT / "11_areas.csv", index=False, float_format="%.6g")
    print(f"wrote {OUT / '11_curves.csv'} and {OUT / '11_areas.csv'} in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
