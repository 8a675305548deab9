"""Cost of splitting a head's scores (``cl.qk_attribution``): time and peak memory against a plain forward pass.

On the bundled SmolLM2-135M, one random token sequence per length (BOS first), 128 to 1,024 tokens,
at the last layer (the costliest: every earlier layer's components are projected), each measured

* ``plain``: ``model(tokens)`` under ``inference_mode``;
* ``one head``: ``cl.qk_attribution(model, tokens, -1, 0, query=None)``: one head, every query
  (target: at most 2x plain at 512 tokens);
* ``every head``: ``cl.qk_attribution(model, tokens, -1, None, query=None)``: the layer's 9 heads,
  every query (target: at most 3x);
* ``every head, last query``: the same for the last query alone (what a quick look at one
  prediction needs).

Each includes the per-call exactness check (the rebuilt scores against ``hook_attn_scores``, their
softmax against ``hook_pattern``), not the on-demand tables (``key_side`` etc.). Time: in one
process, the methods alternate ``--repeats`` times per length and the fastest run of each counts;
the ratio to ``plain`` is the number to read. Memory: each method runs once more in a fresh process,
and the growth of its peak RSS (``VmHWM``) over the loaded, warmed-up model is reported (the result,
kept, is part of it). Run: ``python benchmarks/bench_qk.py`` (about 5 minutes on 2 idle cores) or
``--lengths 128 --repeats 2``.
"""

from typing import Any

import torch

import _ratios


def _one_head(model: Any, tokens: torch.Tensor) -> Any:
    import contribution_lens as cl

    return cl.qk_attribution(model, tokens[0], -1, 0, query=None)


def _every_head(model: Any, tokens: torch.Tensor) -> Any:
    import contribution_lens as cl

    return cl.qk_attribution(model, tokens[0], -1, None, query=None)


def _every_head_last_query(model: Any, tokens: torch.Tensor) -> Any:
    import contribution_lens as cl

    return cl.qk_attribution(model, tokens[0], -1, None, query=-1)


METHODS: dict[str, _ratios.Method] = {
    "plain": _ratios.plain,
    "one head": _one_head,
    "every head": _every_head,
    "every head, last query": _every_head_last_query,
}


if __name__ == "__main__":
    _ratios.main(METHODS, __doc__ or "", __file__)
