"""Sink analyses whose every number is kept in ``sink_numbers.safetensors``, to hold later versions to them.

The file was written by the code of before the sink analysis was made cheaper (``python
tests/analyses/sink_cases.py`` at that commit), and written once more when the tail's mean came to be
divided by the tail's own attention mass instead of ``1 - a_i``: that changed numbers by at most 7e-4
relative where ``a_i`` is near 1, and corrected layer 15 of the padded batch, where ``a_i`` rounds to 1
(``tail_sq`` NaN or 10 % off, ``cross`` -1e23, cone cosines 0). A change that is meant to keep the
numbers must leave it as it is (`test_sinks.test_sink_analysis_keeps_its_numbers`). The analyses then computed
the tail quantiles of every scope: the cases ask for them (``quantiles=BOTH``).

**The tolerance** of each kept number follows from how well its computation is conditioned, not from one
machine. Another CPU (other kernels, another summation order, another thread count) rounds float32
differently, by the order of float32's own rounding error amplified by the computation; the gap between
a float32 result and the same case computed in float64 (float64 copies of the models and the inputs,
`in_float64`) samples that error. ``sink_gaps.safetensors`` keeps, per element, the largest gap of three
float32 results: the kept one and this machine's with one and with two threads (`gaps`; ``python
tests/analyses/sink_cases.py gaps``, a few minutes; recomputing it at every test run would triple the
test's time). A number ``x`` computed now passes where

    |x - kept| <= FLOOR + FLOOR * |kept| + MARGIN * max(gap, r * |kept|),   r the median of gap / |kept| over its tensor

The floor (1e-6, eight float32 ulps of a number of order one) holds well-conditioned numbers; ``r`` stands
for an element whose own gap came out near zero by chance; ``MARGIN`` (4) covers two machines' errors,
each up to twice the largest sampled. Booleans and integers are compared exactly. The tolerances this
gives are 7.6e-6 relative at the median element; the floor for the tiny bridges (gaps under 2e-8); up to
1.3e-5 absolute for the cone cosines of layer 15 of the padded batch, where the sink takes nearly all the
attention (gaps up to 2.8e-6: another CPU was 2.5e-6 off there, over the 1e-6 allowed before); 6e-6 and
1.1e-5 relative at the median of the squared tail norms of layer 29 and the cross terms of layer 5. A
change of the analysis by 1e-4 relative fails (`test_sinks.test_the_kept_numbers_catch_a_small_change`).
"""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

import contribution_lens as cl

NUMBERS = Path(__file__).with_name("sink_numbers.safetensors")
GAPS = Path(__file__).with_name("sink_gaps.safetensors")
FLOOR = 1e-6
"""Absolute and relative floor of every tolerance: eight float32 ulps of a number of order one."""
MARGIN = 4.0
"""How many float32-vs-float64 gaps a float32 number computed elsewhere may lie from the kept one."""
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


def tolerance(kept: Tensor, gap: Tensor) -> Tensor:
    """Per element, how far a number computed now may lie from ``kept`` (the rule of the module docstring)."""
    relative = torch.where(kept != 0, gap / kept.abs(), torch.nan)
    typical = relative.nanmedian().nan_to_num(0) * kept.abs() if gap.numel() else gap
    return FLOOR + FLOOR * kept.abs() + MARGIN * torch.maximum(gap, typical)


def mismatches(got: Tensor, kept: Tensor, gap: Tensor | None) -> str:
    """What of ``got`` lies outside the tolerance of ``kept`` (empty where nothing does).

    ``gap`` is None for booleans and integers, compared exactly.
    """
    if got.shape != kept.shape or got.dtype != kept.dtype:
        return f"shape {tuple(got.shape)} {got.dtype}, kept {tuple(kept.shape)} {kept.dtype}"
    if gap is None:
        wrong = got != kept
        return f"{int(wrong.sum())} of {wrong.numel()} differ" if bool(wrong.any()) else ""
    off = (got.double() - kept.double()).abs()
    allowed = tolerance(kept.double(), gap.double())
    wrong = ~(off <= allowed)  # NaN is wrong
    if not bool(wrong.any()):
        return ""
    worst = int(torch.where(wrong, off / allowed, 0).flatten().nan_to_num(float("inf")).argmax())
    return (
        f"{int(wrong.sum())} of {wrong.numel()} outside the tolerance; the worst "
        f"{got.flatten()[worst].item():.9g} against {kept.flatten()[worst].item():.9g} "
        f"(off {off.flatten()[worst].item():.3g}, allowed {allowed.flatten()[worst].item():.3g})"
    )


@contextmanager
def in_float64() -> Iterator[None]:
    """The analyses' casts to float32 (``Tensor.float``, ``adapter.layer_gram``) leave float64 tensors float64.

    The library accumulates in float32 at least; for the float64 reference it must not round there.
    (Hugging Face's RMS norms still compute in float32 in a float64 model: the reference holds their
    rounding, a few float32 ulps of the norm's output, which the gap then counts once more.)
    """
    from contribution_lens import adapter
    from contribution_lens.decomposition import head_gram

    to_float, layer_gram = torch.Tensor.float, adapter.layer_gram

    def keep(self: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return self if self.dtype == torch.float64 else to_float(self, *args, **kwargs)

    def gram(model: Any, layer: int, W_O: Tensor) -> Tensor:
        return head_gram(W_O) if W_O.dtype == torch.float64 else layer_gram(model, layer, W_O)

    torch.Tensor.float, adapter.layer_gram = keep, gram  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.float, adapter.layer_gram = to_float, layer_gram  # type: ignore[method-assign]


def gaps(kept: dict[str, Tensor], tiny: Callable[..., Any]) -> dict[str, Tensor]:
    """Per floating number, the largest ``|float32 - float64|`` of the kept run and of runs with 1 and 2 threads.

    The float64 numbers are the same cases on float64 copies of the models (`in_float64`). A
    float32 run's error depends on its summation order: one thread sums long rows in one sequence,
    several split them, and the kept file's machine had its own order; the largest of the three
    samples the error of an order not seen here. Booleans and integers must come out equal.
    """
    exact: dict[str, Tensor] = {}
    with in_float64():
        model = cl.load_model(dtype="float64")
        for case, run in cases(model, lambda *a, **k: tiny(*a, **k).to(torch.float64)).items():
            exact.update({f"{case}|{key}": value for key, value in numbers(run()).items()})
    model = cl.load_model()
    samples = [kept]
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            samples.append(
                {f"{case}|{key}": v for case, run in cases(model, tiny).items() for key, v in numbers(run()).items()}
            )
    finally:
        torch.set_num_threads(before)
    out: dict[str, Tensor] = {}
    for name, expected in kept.items():
        if not expected.is_floating_point():
            assert all(torch.equal(s[name].to(expected.dtype), expected) for s in (exact, *samples[1:])), name
            continue
        reference = exact[name].double()
        out[name] = torch.stack([(s[name].double() - reference).abs() for s in samples]).amax(0).float().contiguous()
    return out


if __name__ == "__main__":
    import sys

    from safetensors.torch import load_file, save_file

    sys.path.insert(0, str(Path(__file__).parents[1]))
    from conftest import tiny_bridge

    if sys.argv[1:] == ["gaps"]:
        save_file(gaps(load_file(str(NUMBERS)), tiny_bridge), str(GAPS))
        sys.exit()
    model = cl.load_model()
    kept = {
        f"{case}|{key}": value
        for case, run in cases(model, tiny_bridge).items()
        for key, value in numbers(run()).items()
    }
    save_file(kept, str(NUMBERS))
