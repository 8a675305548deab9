"""The model's own rounding of its logit, per dtype: ``rounding_gap`` against its bound on the bundled models.

For each bundled decoder (SmolLM2-135M-Instruct, Gemma 3 270M) and dtype, ``cl.logit_attribution``
explains the next token of each text below (the model's top prediction) and, on the first text,
``logit(' Mary') - logit(' John')``; a second pass with two hooks keeps the stream the final norm
reads, from which `contribution_lens.adapter.Readout.rounding_bound` gives the bound ``B``.
Printed per model and dtype (one markdown row):

* ``terms vs readout``: the largest ``|total() - logit| / max(1, |logit|)`` (checked below 1e-4 on
  every call);
* ``|rounding_gap|``: the largest and the median of ``|model_value - logit|``;
* ``gap / B``: the largest ratio (at most 1: no warning);
* ``B / |logit|``: the median of the bound relative to the value it bounds.

A dtype in which a model overflows (Gemma 3 in float16) is reported as such. Run:
``python benchmarks/rounding_gaps.py`` (about a minute on 2 cores) or ``--dtypes bfloat16``.
"""

import argparse
import statistics
import warnings
from typing import Any

import torch

import contribution_lens as cl
from contribution_lens import adapter

TEXTS = (
    "When Mary and John went to the store, John gave a drink to",
    "The capital of France is",
    "def add(a, b):\n    return",
    "Once upon a time, there was a little girl who loved to",
    "1, 2, 3, 4, 5,",
    "The mitochondria is the powerhouse of the",
    "She opened the door and saw that the room was",
    "In 1492, Columbus sailed across the Atlantic",
)
MODELS = {"smollm2-135m": None, "gemma3-270m": "gemma3-270m"}


def bound(model: Any, result: cl.LogitAttribution) -> float:
    """`Readout.rounding_bound` at the explained position, from the stream the final norm reads."""
    kept: dict[str, torch.Tensor] = {}
    at = result.position
    hooks = [("ln_final.hook_in", lambda x, hook: kept.update(x=x[0, at : at + 1].detach()))]
    if "ln_final.hook_scale" in model.hook_dict:
        hooks.append(("ln_final.hook_scale", lambda s, hook: kept.update(s=s[0, at : at + 1, 0].detach())))
    adapter.forward(model, adapter.to_token_batch(model, result.tokens), hooks)
    dtype = next(model.parameters()).dtype
    r = adapter.readout(model)
    return float(r.rounding_bound(kept["x"], kept.get("s"), [result.target], [result.foil], dtype=dtype)[0])


def row(name: str, dtype: str) -> str:
    model = cl.load_model(dtype=dtype) if MODELS[name] is None else cl.load_model(MODELS[name], dtype=dtype)
    calls = [(text, None, None) for text in TEXTS] + [(TEXTS[0], " Mary", " John")]
    exact, gaps, ratios, relative = [], [], [], []
    for text, target, foil in calls:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", RuntimeWarning)  # a gap over its bound stops the table
                result = cl.logit_attribution(model, text, target=target, foil=foil)
        except FloatingPointError:
            return f"| {name} | {dtype} | overflows: the pass gives inf or NaN | | | |"
        assert result.model_value is not None and result.rounding_gap is not None
        b = bound(model, result)
        exact.append(abs(result.total() - result.logit) / max(1.0, abs(result.logit)))
        gaps.append(abs(result.rounding_gap))
        ratios.append(abs(result.rounding_gap) / b)
        relative.append(b / max(1.0, abs(result.logit)))
    return (
        f"| {name} | {dtype} | {max(exact):.1e} | {max(gaps):.2g} (median {statistics.median(gaps):.2g}) "
        f"| {max(ratios):.2f} | {statistics.median(relative):.1e} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16", "float32", "float64"])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = parser.parse_args()
    print("| model | dtype | terms vs readout | abs(rounding_gap) | gap / B | B / abs(logit) |")
    print("|---|---|---|---|---|---|")
    for name in args.models:
        for dtype in args.dtypes:
            print(row(name, dtype), flush=True)


if __name__ == "__main__":
    main()
