"""Token mixing across layers: the signed ``flow`` rollout and ``attention_rollout`` (Abnar & Zuidema).

One layer's signed token mixing ``M`` (``[batch query key]``, rows summing to 1) is
`contribution_lens.mixing.layer_mixing`: attention's parts of the residual stream after
attention, each projected on that stream by the contribution rule, and the residual term on the
diagonal. Here the layers are composed.

Composition: ``R^l = M^l R^{l-1}``, ``R^{-1} = I``; row ``i`` of ``R^l`` sums to 1 and is the
signed share of each *input* token in the residual stream at position ``i`` after layer ``l``.
The MLPs and the norms act on each position alone: the composition takes the stream entering
layer ``l + 1`` to carry the same token shares as ``r_i`` (what the MLP writes is credited to the
tokens in the proportions of its input; its non-linearity is ignored), and the pre-attention
norm's scale of ``x_j`` is taken as given inside ``vt_j``. In post-LN encoders (BERT) ``r_i``
is the sum before its LayerNorm, whose per-position affine map is ignored the same way.

``attention_rollout`` is Abnar & Zuidema (2020): ``A^l = (mean_h alpha^h + I) / 2`` composed the
same way (unsigned, no values, no norms).

Example (one head, two tokens, no norm):
    >>> import torch
    >>> from contribution_lens.methods.rollout import compose
    >>> mixing = torch.tensor([[[1.0, 0.0], [0.5, 0.5]]])
    >>> compose([mixing, mixing])[-1][0].tolist()
    [[1.0, 0.0], [0.75, 0.25]]
"""

from collections.abc import Callable, Sequence

import einops
import torch
from jaxtyping import Float
from torch import Tensor

from contribution_lens import adapter, mixing
from contribution_lens._lazy import face
from contribution_lens.engine import map_layers
from contribution_lens.methods.method import Method, prepared_score

_MOVED = {
    name: (f"contribution_lens.mixing:{name}", f"use contribution_lens.mixing.{name}")
    for name in ("layer_mixing", "LayerMixing", "StrongParts")
}
_MOVED["visible"] = ("contribution_lens._compat:visible", "use LayerInputs.valid")
__getattr__, _ = face(__name__, {}, _MOVED)  # the per-layer mixing moved to the core; its old names warn


def compose(mixings: Sequence[Float[Tensor, "batch query key"]]) -> list[Float[Tensor, "batch query key"]]:
    """``R^l = M^l R^{l-1}`` for every ``l`` (``R^0 = M^0``)."""
    out: list[Tensor] = []
    for layer in mixings:
        out.append(layer if not out else torch.bmm(layer, out[-1]))
    return out


LayerFn = Callable[[adapter.LayerInputs], tuple[Tensor, Tensor]]


def _rollout(
    model: adapter.Model, batch: adapter.TokenBatch, layers: Sequence[int], per_layer: LayerFn, capture: list[str]
) -> dict[int, Tensor]:
    wanted = set(layers)
    out: dict[int, Tensor] = {}
    state: list[Tensor] = []

    def step(layer: adapter.LayerInputs) -> None:
        mixing, valid = per_layer(layer)
        rolled = mixing if not state else torch.bmm(mixing, state.pop())
        state.append(rolled)
        if layer.layer in wanted:
            out[layer.layer] = torch.where(valid, rolled, 0)

    map_layers(model, batch, step, layers=list(range(max(layers) + 1)), capture=capture)
    return out


def flow_scores(
    model: adapter.Model, batch: adapter.TokenBatch, layers: Sequence[int]
) -> dict[int, Float[Tensor, "batch query key"]]:
    """The signed rollout ``R^l`` of every requested layer: each position's input-token shares (one pass)."""

    readout = adapter.readout(model)

    def per_layer(layer: adapter.LayerInputs) -> tuple[Tensor, Tensor]:
        mixed = mixing.layer_mixing(layer, readout.attention_update(layer))
        return mixed.mixing, mixed.valid

    return _rollout(model, batch, layers, per_layer, list(readout.flow_capture))


def attention_rollout_scores(
    model: adapter.Model, batch: adapter.TokenBatch, layers: Sequence[int]
) -> dict[int, Float[Tensor, "batch query key"]]:
    """Abnar & Zuidema's rollout: ``A^l = (mean_h alpha^h + I) / 2`` composed from layer 0 (one pass)."""

    def per_layer(layer: adapter.LayerInputs) -> tuple[Tensor, Tensor]:
        valid = layer.valid
        acc = torch.promote_types(layer.pattern.dtype, torch.float32)
        mean = einops.reduce(torch.where(valid[:, None], layer.pattern.to(acc), 0), "b h q k -> b q k", "mean")
        eye = torch.eye(mean.shape[-1], dtype=acc, device=mean.device)
        return (mean + eye) / 2, valid

    return _rollout(model, batch, layers, per_layer, [])


METHODS: tuple[Method, ...] = (
    Method(
        "flow",
        prepared_score,
        "signed rollout of the residual stream's token mixing (attention projected on the residual sum)",
        signed=True,
        prepare=flow_scores,
        builtin=True,
    ),
    Method(
        "attention_rollout",
        prepared_score,
        "attention rollout: (mean-head attention + identity) / 2 composed over layers (Abnar & Zuidema)",
        prepare=attention_rollout_scores,
        builtin=True,
    ),
)
