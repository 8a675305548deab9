"""Sink analyses whose every number is kept in ``sink_numbers.safetensors``, to hold later versions to them.

The file was written by the code of before the sink analysis was made cheaper (``python
tests/analyses/sink_cases.py`` at that commit), and written once more when the tail's mean came to be
divided by the tail's own attention mass instead of ``1 - a_i``: that changed numbers by at most 7e-4
relative where ``a_i`` is near 1, and corrected layer 15 of the padded batch, where ``a_i`` rounds to 1
(``tail_sq`` NaN or 10 % off, ``cross`` -1e23, cone cosines 0). A change that is meant to keep the
numbers must leave it as it is (`test_sinks.test_sink_analysis_keeps_its_numbers`). The analyses then computed
the tail quantiles of every scope: the cases ask for them (``quantiles=BOTH``).
"""

from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

import contribution_lens as cl

NUMBERS = Path(__file__).with_name("sink_numbers.safetensors")
TEXTS = ["The capital of France is Paris, and it is a big city.", "Rain fell on the old stone bridge."]
BOTH = {"quantiles": ("intra", "inter")}
IDS = torch.tensor([[1, 5, 9, 3, 7, 2, 8, 11, 4, 6, 12, 3], [1, 4, 6, 11, 13, 2, 9, 5, 3, 7, 10, 8]])


def cases(bundled: Any, tiny: Callable[..., Any]) -> dict[str, Callable[[], cl.SinkAnalysis]]:
    """Each case's analysis: the bundled SmolLM2 (a padded batch; the sink found) and tiny random bridges."""
    return {
        "bundled padded batch": lambda: cl.sink_analysis(bundled, TEXTS, layers=[0, 5, 15, 29], **BOTH),
        "bundled auto sinks": lambda: cl.sink_analysis(bundled, TEXTS[0], sinks="auto", layers=[3, 20], **BOTH),
        "tiny gqa k=2": lambda: cl.sink_analysis(tiny("gqa"), IDS, k=2, **BOTH),
        "tiny mha biases": lambda: cl.sink_analysis(tiny("mha", biases=True), IDS, scopes=("inter",)),
        "tiny mqa encoder": lambda: cl.sink_analysis(
            tiny("mqa", attention_dir="bidirectional"), IDS, sinks="auto", **BOTH
        ),
    }


def numbers(analysis: cl.SinkAnalysis) -> dict[str, Tensor]:
    """Every tensor of ``analysis``, by ``layer/field`` and ``layer/factors/scope/name``."""
    out: dict[str, Tensor] = {}
    for layer, s in analysis.items():
        for f in fields(s):
            if f.name != "factors":
                out[f"{layer}/{f.name}"] = getattr(s, f.name)
        for scope, per_head in s.factors.items():
            for name, value in per_head.items():
                out[f"{layer}/factors/{scope}/{name}"] = value
    return {key: value.contiguous() for key, value in out.items()}


if __name__ == "__main__":
    import sys

    from safetensors.torch import save_file

    sys.path.insert(0, str(Path(__file__).parents[1]))
    from conftest import tiny_bridge

    model = cl.load_model()
    kept = {
        f"{case}|{key}": value
        for case, run in cases(model, tiny_bridge).items()
        for key, value in numbers(run()).items()
    }
    save_file(kept, str(NUMBERS))
