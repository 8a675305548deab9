"""Cost of explaining a prediction: time and peak memory against a plain forward pass, 128 to 1,024 tokens.

On the bundled SmolLM2-135M, one random token sequence per length (BOS first), each measured

* ``plain``: ``model(tokens)`` under ``inference_mode``;
* ``logit_attribution``: ``cl.logit_attribution(model, tokens)`` (the last position, its top
  prediction): one forward pass with the per-layer hooks, then the contraction of every term;
* ``32 positions``: the last 32 positions' logit attributions from one pass (what
  ``explain_generation`` does after generating a 32-token answer; generation itself not timed);
* ``flow``: ``cl.flow(model, tokens)``: every layer's ``[query key]`` mixing and edges from one pass
  (the rollout is computed when read, and is not timed);
* ``logit_attribution + flow``: ``cl.explain_generation(model, tokens[:-1], answer=tokens[-1:])``:
  the last token's logit attribution and the flow explaining it, from ONE pass over all the
  tokens (what ``explain_generation`` does for each step of an answer). This is the issue's
  number: ``(logit attribution + flow) / plain``, target at most 1.5x.

Time: in one process, the methods alternate ``--repeats`` times per length and the fastest run of
each counts (the others absorb other jobs on the machine); the ratio to ``plain`` is the number to
read (target: at most 1.5x for ``logit_attribution + flow``). Memory: each method runs once more in a
fresh process, and the growth of its peak RSS (``VmHWM``) over the loaded, warmed-up model is
reported. Run: ``python benchmarks/bench_explain.py`` (about 6 minutes on 2 idle cores) or
``--lengths 128 --repeats 2``. ``METHODS`` is the table to add a method to.
"""

from typing import Any

import torch

import _ratios


def _logit_attribution(model: Any, tokens: torch.Tensor) -> None:
    import contribution_lens as cl

    cl.logit_attribution(model, tokens[0])


def _many_positions(model: Any, tokens: torch.Tensor) -> None:
    from contribution_lens import adapter
    from contribution_lens.analyses.logit_attribution import attribute_positions

    length = tokens.shape[1]
    positions = list(range(length - 33, length - 1))
    targets = tokens[0, length - 32 :].tolist()
    batch = adapter.to_token_batch(model, tokens)
    attribute_positions(model, batch, positions, targets, [None] * len(positions))


def _flow(model: Any, tokens: torch.Tensor) -> None:
    import contribution_lens as cl

    cl.flow(model, tokens[0])


def _logit_attribution_and_flow(model: Any, tokens: torch.Tensor) -> None:
    import contribution_lens as cl

    cl.explain_generation(model, tokens[0, :-1], answer=tokens[0, -1:])


METHODS: dict[str, _ratios.Method] = {
    "plain": _ratios.plain,
    "logit_attribution": _logit_attribution,
    "32 positions": _many_positions,
    "flow": _flow,
    "logit_attribution + flow": _logit_attribution_and_flow,
}


if __name__ == "__main__":
    _ratios.main(METHODS, __doc__ or "", __file__)
