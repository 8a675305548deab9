"""Interventions on projected values, all through ``hook_pattern``.

Removing key ``j``'s projected value from query ``i``'s output at a layer (all heads) is
exactly multiplying ``alpha_ij^h`` by 0 *without renormalising*: the output becomes
``o_i - sum_h alpha_ij^h vt_j^h``. Rescaling ``vt_j^h`` by ``s`` is multiplying
``alpha_ij^h`` by ``s``. Both are scalings of the pattern, so one hook serves every
intervention in this package.
"""

from collections.abc import Callable, Mapping
from typing import Any

import einops
import torch
from jaxtyping import Bool, Float
from torch import Tensor

from contribution_lens import adapter


def key_removal_hooks(
    keep: Mapping[int, Bool[Tensor, "batch query key"]],
) -> list[tuple[str, Callable[[Tensor, Any], Tensor]]]:
    """Hooks that zero ``alpha_ij^h`` (all heads) wherever ``keep[layer][b, i, j]`` is False."""

    def make(mask: Tensor) -> Callable[[Tensor, Any], Tensor]:
        def hook(pattern: Tensor, hook: Any) -> Tensor:
            keep_hqk = einops.rearrange(mask.to(pattern.device), "batch query key -> batch 1 query key")
            return torch.where(keep_hqk, pattern, torch.zeros((), dtype=pattern.dtype, device=pattern.device))

        return hook

    return [(adapter.pattern_hook(layer), make(mask)) for layer, mask in keep.items()]


def pattern_scaling_hooks(
    scale: Callable[[int, Tensor, Tensor], Float[Tensor, "batch head query key"]],
    layer: int,
) -> list[tuple[str, Callable[[Tensor, Any], Tensor | None]]]:
    """Hooks multiplying the pattern of ``layer`` by ``scale(layer, pattern, v)``.

    ``v`` is captured from ``hook_v`` of the same layer, which fires first.
    """
    captured: dict[str, Tensor] = {}

    def keep_v(v: Tensor, hook: Any) -> None:
        captured["v"] = v.detach()

    def apply(pattern: Tensor, hook: Any) -> Tensor:
        factor = scale(layer, pattern, captured.pop("v"))
        return (pattern.to(factor.dtype) * factor).to(pattern.dtype)

    return [(adapter.value_hook(layer), keep_v), (adapter.pattern_hook(layer), apply)]
