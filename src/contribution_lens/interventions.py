"""Interventions on projected values, all as edits of ``hook_pattern`` (see `contribution_lens.map_layers`).

Removing key ``j``'s projected value from query ``i``'s output at a layer (all heads) is
exactly multiplying ``alpha_ij^h`` by 0 *without renormalising*: the output becomes
``o_i - sum_h alpha_ij^h vt_j^h``. Rescaling ``vt_j^h`` by ``s`` is multiplying
``alpha_ij^h`` by ``s``. Both are scalings of the pattern, so one kind of edit serves every
intervention in this package.
"""

from collections.abc import Callable, Mapping

import einops
import torch
from jaxtyping import Bool, Float
from torch import Tensor

from contribution_lens.adapter import PatternEdit

Scale = Callable[[int, Tensor, Tensor], Float[Tensor, "batch head query key"]]


def remove_keys(keep: Mapping[int, Bool[Tensor, "batch query key"]]) -> PatternEdit:
    """An edit zeroing ``alpha_ij^h`` (all heads) wherever ``keep[layer][b, i, j]`` is False.

    Layers missing from ``keep`` are left as they are.
    """

    def edit(layer: int, pattern: Tensor, v: Tensor) -> Tensor | None:
        if layer not in keep:
            return None
        keep_hqk = einops.rearrange(keep[layer].to(pattern.device), "batch query key -> batch 1 query key")
        return torch.where(keep_hqk, pattern, torch.zeros((), dtype=pattern.dtype, device=pattern.device))

    return edit


def scale_pattern(scale: Scale, layers: set[int] | None = None) -> PatternEdit:
    """An edit multiplying the pattern by ``scale(layer, pattern, v)`` (at ``layers``, or all)."""

    def edit(layer: int, pattern: Tensor, v: Tensor) -> Tensor | None:
        if layers is not None and layer not in layers:
            return None
        factor = scale(layer, pattern, v)
        return (pattern.to(factor.dtype) * factor).to(pattern.dtype)

    return edit
