"""Cost of the sink analyses: time and peak memory against a plain forward pass, at 512 and 1,024 tokens.

On the bundled SmolLM2-135M, one random token sequence per length (BOS first), each measured

* ``plain``: ``model(tokens)`` under ``inference_mode``;
* ``sink_analysis``: ``cl.sink_analysis(model, tokens)``: every layer's sink geometry and its
  sink/tail factors in both scopes (intra and inter), with the inter scope's tail quantiles (the
  default), from one pass. The issue's number: ``sink_analysis / plain``, target at most 2x;
* ``all_quantiles``: the same with the intra scope's tail quantiles too
  (``quantiles=("intra", "inter")``, what the analysis computed before it had the option);
* ``sink_study``: ``cl.sink_study(model, tokens)``: that analysis, then the two sink-norm
  interventions (``zero``, ``mean_tail``), each a clean and an intervened pass with the sink
  geometry of every layer (four more full passes by construction).

Time: in one process, the methods alternate ``--repeats`` times per length and the fastest run of
each counts (the others absorb other jobs on the machine); the ratio to ``plain`` is the number to
read. Memory: each method runs once more in a fresh process, and the growth of its peak RSS
(``VmHWM``) over the loaded, warmed-up model is reported. Run: ``python benchmarks/bench_sinks.py``
(a few minutes on 2 idle cores) or ``--lengths 512 --repeats 2 --no-memory``. ``METHODS`` is the
table to add a method to.
"""

from typing import Any

import torch

import _ratios

LENGTHS = (512, 1024)


def _sink_analysis(model: Any, tokens: torch.Tensor) -> None:
    import contribution_lens as cl

    cl.sink_analysis(model, tokens)


def _all_quantiles(model: Any, tokens: torch.Tensor) -> None:
    import contribution_lens as cl

    cl.sink_analysis(model, tokens, quantiles=("intra", "inter"))


def _sink_study(model: Any, tokens: torch.Tensor) -> None:
    import contribution_lens as cl

    cl.sink_study(model, tokens, progress=False)


METHODS: dict[str, _ratios.Method] = {
    "plain": _ratios.plain,
    "sink_analysis": _sink_analysis,
    "all_quantiles": _all_quantiles,
    "sink_study": _sink_study,
}


if __name__ == "__main__":
    _ratios.main(METHODS, __doc__ or "", __file__, lengths=LENGTHS)
