"""Token mixing across layers: the signed ``flow`` rollout and ``attention_rollout`` (Abnar & Zuidema).

Notation as in `contribution_lens.decomposition`. At layer ``l`` the residual stream ``x_i``
(``hook_resid_pre``) gets attention's update ``a_i = sum_h sum_j alpha_ij^h vt_j^h + b_O``
(`contribution_lens.adapter.attention_update`; with a norm after the attention, as in Gemma,
every term goes through that norm's linear part with its scale frozen at position ``i``, and its
bias joins ``b_O``). With ``r_i = x_i + a_i`` (the residual stream after attention), each part is
projected on ``r_i`` -- the contribution rule applied to the whole residual sum:

    w_ij^h = <r_i, alpha_ij^h vt_j^h> / ||r_i||^2
           = alpha_ij^h * (||vt_j^h|| / ||r_i||) * cos(r_i, vt_j^h)
    rho_i  = <r_i, x_i + b_O> / ||r_i||^2                      (the residual term)
    M_ij   = sum_h w_ij^h + [i == j] rho_i,                    sum_j M_ij = 1

``M`` (``[batch query key]``) is the layer's signed token mixing. ``b_O`` (and a post-norm's
bias) belong to no token: they are counted in the position's own residual term, like the MLP.

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
from dataclasses import dataclass

import einops
import torch
from jaxtyping import Bool, Float
from torch import Tensor

from contribution_lens import adapter
from contribution_lens.decomposition import valid_positions
from contribution_lens.engine import map_layers
from contribution_lens.methods.registry import Method, prepared_score


@dataclass(frozen=True)
class LayerMixing:
    """One layer's signed mixing of the residual stream (see the module docstring), float32.

    ``weights[b, h, i, j]`` is ``w_ij^h``, ``residual[b, i]`` is ``rho_i``; ``value_norm`` is
    ``||vt_j^h||`` after the post-attention norm's gain (before its ``1/scale_i``) and
    ``stream_norm`` ``||r_i||`` (``value_norm`` only where factors were asked for).
    """

    weights: Float[Tensor, "batch head query key"]
    residual: Float[Tensor, "batch query"]
    valid: Bool[Tensor, "batch query key"]
    stream_norm: Float[Tensor, "batch query"]
    value_norm: Float[Tensor, "batch head key"] | None = None
    scale: Float[Tensor, "batch query"] | None = None
    """The post-attention norm's scale (the parts are divided by it), None without one."""

    def token_mixing(self) -> Float[Tensor, "batch query key"]:
        """``M_ij = sum_h w_ij^h + [i == j] rho_i``; rows of padding queries are those of the identity."""
        mixing = einops.reduce(self.weights, "batch head query key -> batch query key", "sum")
        diagonal = torch.diagonal(mixing, dim1=-2, dim2=-1)
        real = self.valid.any(-1)
        diagonal += torch.where(real, self.residual, 1.0)
        return mixing

    def relative_norm(self, batch: Tensor, head: Tensor, query: Tensor, key: Tensor) -> Tensor:
        """``||vt_j^h|| / ||r_i||`` (post-norm included) at the given index tensors."""
        if self.value_norm is None:
            raise ValueError("this mixing was computed without factors (factors=False)")
        norm = self.value_norm[batch, head, key]
        if self.scale is not None:
            norm = norm / self.scale[batch, query]
        stream = self.stream_norm[batch, query]
        return torch.where(stream > 0, norm / stream.clamp_min(torch.finfo(stream.dtype).tiny), 0)


def visible(layer: adapter.LayerInputs) -> Bool[Tensor, "batch query key"]:
    """Which keys each query of the layer sees (causality and padding)."""
    batch, _, n_query, n_key = layer.pattern.shape
    return valid_positions(
        n_query, n_key, attention_mask=layer.padding_mask, batch=batch, causal=layer.causal, device=layer.pattern.device
    )


def _frozen_apply(norm: adapter.FrozenNorm, parts: Tensor, scale: Tensor) -> Tensor:
    """The norm's linear part ``gain * P(p) / scale`` (its bias is not a part's)."""
    if norm.centre:
        parts = parts - parts.mean(-1, keepdim=True)
    if norm.gain is not None:
        parts = parts * norm.gain.to(parts.dtype)
    return parts / scale.to(parts.dtype)[..., None]


def layer_mixing(layer: adapter.LayerInputs, update: adapter.AttentionUpdate, *, factors: bool = False) -> LayerMixing:
    """`LayerMixing` of one layer from its hooks; ``factors`` adds the value norms (for the edges).

    Nothing larger than the pattern is built: ``<r_i, alpha vt_j^h> = alpha <r_i W_O^h^T, v_j^h>``
    (through the norm: ``<r_i, D_i vt> = <D_i^T r_i, vt>``).
    """
    acc = torch.promote_types(layer.pattern.dtype, torch.float32)
    n_heads = layer.pattern.shape[1]
    valid = visible(layer)
    alpha = torch.where(valid[:, None], layer.pattern.to(acc), 0)
    v = layer.v.to(acc).repeat_interleave(n_heads // layer.v.shape[2], dim=2)
    W_O = layer.W_O.to(acc)
    x, added = update.resid_pre.to(acc), update.added.to(acc)
    stream = x + added
    squared = (stream * stream).sum(-1)
    inverse = torch.where(squared > 0, 1 / squared.clamp_min(torch.finfo(acc).tiny), 0)
    scale = None if update.scale is None else update.scale.to(acc)
    direction = stream if update.norm is None else update.norm.pull_back(stream, scale)  # type: ignore[arg-type]
    read = einops.einsum(direction, W_O, "batch query d_model, head d_head d_model -> batch query head d_head")
    dots = einops.einsum(read, v, "batch query head d_head, batch key head d_head -> batch head query key")
    weights = alpha * dots * inverse[:, None, :, None]
    z = layer.z.to(acc) if layer.z is not None else None
    if z is None:
        z = einops.einsum(alpha, v, "batch head query key, batch key head d_head -> batch query head d_head")
    heads = einops.einsum(z, W_O, "batch query head d_head, head d_head d_model -> batch query d_model")
    if update.norm is not None:
        heads = _frozen_apply(update.norm, heads, scale)  # type: ignore[arg-type]
    # What is not a token's part: the stream itself plus the biases (added minus the heads).
    residual = (stream * (x + added - heads)).sum(-1) * inverse
    value_norm = None
    if factors:
        vt = einops.einsum(v, W_O, "batch key head d_head, head d_head d_model -> batch key head d_model")
        if update.norm is not None:
            vt = _frozen_apply(update.norm, vt, torch.ones(vt.shape[:-1], dtype=acc, device=vt.device))
        value_norm = einops.rearrange(vt.norm(dim=-1), "batch key head -> batch head key")
    return LayerMixing(weights, residual, valid, squared.sqrt(), value_norm, scale)


def compose(mixings: Sequence[Float[Tensor, "batch query key"]]) -> list[Float[Tensor, "batch query key"]]:
    """``R^l = M^l R^{l-1}`` for every ``l`` (``R^0 = M^0``)."""
    out: list[Tensor] = []
    for mixing in mixings:
        out.append(mixing if not out else torch.bmm(mixing, out[-1]))
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

    def per_layer(layer: adapter.LayerInputs) -> tuple[Tensor, Tensor]:
        mixing = layer_mixing(layer, adapter.attention_update(model, layer))
        return mixing.token_mixing(), mixing.valid

    return _rollout(model, batch, layers, per_layer, adapter.flow_capture(model))


def attention_rollout_scores(
    model: adapter.Model, batch: adapter.TokenBatch, layers: Sequence[int]
) -> dict[int, Float[Tensor, "batch query key"]]:
    """Abnar & Zuidema's rollout: ``A^l = (mean_h alpha^h + I) / 2`` composed from layer 0 (one pass)."""

    def per_layer(layer: adapter.LayerInputs) -> tuple[Tensor, Tensor]:
        valid = visible(layer)
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
