"""The hooks a circuit pass runs on: where each node of the circuit graph writes and reads.

Part of the adapter: every hook name and TransformerLens detail the circuits need is here,
and `contribution_lens.circuits` works on the tensors these hooks hand over. A pass calls a
`Stream` (model-agnostic) at every place a node writes into the residual stream or reads it:

* writes: ``embed`` (``embed.hook_out``), ``pos_embed`` (``pos_embed.hook_out``, learned positions),
  the heads of layer ``l`` (``o^h = z^h W_O^h`` from ``attn.hook_z``, ``[batch pos head d_model]``)
  and its MLP (``hook_mlp_out``: the MLP and any norm after it);
* reads: the q inputs of layer ``l``'s heads (one per query head), its k and v inputs (one per key
  head: a grouped-query model's group shares them), its MLP input (``ln2.hook_in``) and the logits'
  input (``ln_final.hook_in``), each given the residual stream of this pass at that point.

A read that returns inputs ``x`` ``[batch pos slot d_model]`` replaces what the model reads: a
head's query is then ``LN1(x^h) W_Q^h + b_Q^h`` (each head's input normed with its own scale),
written into ``attn.hook_q`` (before the q norm and the rotary embedding, which the model then
applies as usual); keys and values likewise per key head. A write may return a correction
``[batch pos d_model]`` added where that output joins the stream. A stream whose
``supplies("mlp", layer)`` is true writes that MLP's output itself (by its correction): the MLP
then skips its products; one whose ``replaces(layer)`` is true hands every head of that layer its
own q, k and v inputs, and the model's own projections of the stream there are skipped
(`_skipped_work`).
The output projection never runs in a circuit pass: the heads' outputs, computed for the writes,
summed with ``b_O`` are its output.

Ungrouped passes (``circuit_pass(..., ungroup=True)``, MIB's ``ungroup_grouped_query_attention``):
a grouped-query model's k and v inputs are read one per query head, ``[batch pos head d_model]``, and
query head ``h``'s key is ``LN1(x^h) W_K^g + b_K^g`` with ``g`` its key head (values likewise): the
key head's weights repeated over its group (`_ungrouped_weights`), and the attention told to use the
keys and values it is handed, one per query head, instead of repeating each key head's over its
group (`_ungrouped_attention`). A layer whose k and v inputs the stream does not read gets the
model's own keys and values repeated over the group: the same numbers the model computes.

Post-attention norms (Gemma 2/3's ``ln1_post``): the stream receives ``N(sum_h o^h + b_O)``. With
the norm's scale ``s`` of this pass frozen, ``N`` is linear, and head ``h``'s output is its share
``N_lin(o^h; s) = P(o^h) * gain / s``; the shares plus ``N_lin(b_O; s) + bias`` are the norm's
output exactly, so a pass that keeps every edge is the model's own pass, and one that patches
every edge (each share replaced by the counterfactual's, with the counterfactual's scale) is the
counterfactual's pass.
"""

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Protocol, runtime_checkable

import einops
import torch
from jaxtyping import Float, Int
from torch import Tensor
from torch.autograd import forward_ad

from contribution_lens.adapter._model import HookFn, Model, _model_device, model_dtype
from contribution_lens.adapter.anatomy import (
    EMBED_PARTS,
    FINAL_IN,
    LN1_IN,
    LN1_SCALE,
    LN2_IN,
    MLP_OUT,
    NORM_OUT,
    O_OUT,
    PATTERN,
    QK_K,
    QK_Q,
    QK_V,
    RESID_PRE,
    SCALE,
    UNEMBED_IN,
    Anatomy,
    Layer,
    Norm,
    Z,
    anatomy_of,
    block_hook,
)
from contribution_lens.adapter.forms import PRE_LN, block_forms
from contribution_lens.adapter.hooks import StopForward, hooked, output_weights
from contribution_lens.adapter.logit_readout import unembedding

_PROJECTIONS = {"q": QK_Q, "k": QK_K, "v": QK_V}
"""Each head's query, key and value: where the wiring writes the heads' own projections."""
READS = ("q", "k", "v", "mlp", "logits")
"""Where a node reads the stream: a head's q, k or v input, an MLP's input, the logits' input."""
WRITES = ("embed", "pos_embed", "heads", "mlp")
"""Where nodes write into the stream."""


@dataclass(frozen=True)
class Layout:
    """The sizes a circuit graph is built from, read from the model's config."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    pos_embed: bool


@runtime_checkable
class Stream(Protocol):
    """What a circuit pass calls: ``write`` at each node's output, ``read`` at each node's input."""

    def write(
        self, kind: str, layer: int, out: Float[Tensor, "batch pos node d_model"]
    ) -> Float[Tensor, "batch pos d_model"] | None: ...

    def read(
        self, kind: str, layer: int, stream: Float[Tensor, "batch pos d_model"]
    ) -> Float[Tensor, "batch pos slot d_model"] | None: ...


def circuit_refusal(model: Model) -> str | None:
    """Why the circuit graph cannot be wired into ``model``, in words, or None."""
    facts = anatomy_of(model)
    if not facts.causal:
        return (
            "it is an encoder (bidirectional attention): a circuit's metric is read at each prompt's last "
            "position, which every position of an encoder sees, so right-padded prompts are not separable"
        )
    needed_hooks = [EMBED_PARTS["embed"], FINAL_IN]
    needed_hooks += [block_hook(0, name) for name in (RESID_PRE, LN1_IN, LN2_IN, MLP_OUT, Z)]
    needed_hooks += [block_hook(0, _PROJECTIONS[side]) for side in "qkv"]
    for needed in needed_hooks:
        if needed not in facts.hook_names:
            return f"its bridge has no {needed} hook"
    for layer, form in block_forms(model).items():
        if form != PRE_LN and not form.startswith("pre-LN with a norm on the attention output"):
            return f"layer {layer} is {form}; circuits follow pre-LN blocks (with or without post-attention norms)"
    return None


def hidden_bias_path(model: Model) -> bool:
    """Whether a post-attention norm scales an output bias ``b_O`` by this pass's own scale.

    That term, ``N_lin(b_O; s)``, joins the stream without being any node's output: through it a
    layer's heads reach every later input whatever the circuit keeps, so no node can be taken as
    idle (`contribution_lens.circuits.interchange.active_writers`). Gemma's attention has no bias.
    """
    return any(
        facts.post_norm is not None and (bias := output_weights(model, layer)[1]) is not None and bool(bias.any())
        for layer, facts in enumerate(anatomy_of(model).layers)
    )


def check_circuit_model(model: Model, *, ungrouped: bool = False) -> None:
    """Refuse a model whose circuit graph cannot be wired, with the reason (before any circuit pass).

    ``ungrouped``: the graph gives every query head its own k and v inputs (`ungrouping_refusal`).
    """
    problem = circuit_refusal(model)
    if problem is not None:
        raise ValueError(f"model: circuits cannot be found in {anatomy_of(model).name}: {problem}")
    problem = ungrouping_refusal(model) if ungrouped else None
    if problem is not None:
        raise ValueError(f"edges: MIB's ungrouped graph cannot be wired into {anatomy_of(model).name}: {problem}")


def ungrouping_refusal(model: Model) -> str | None:
    """Why ``model``'s keys and values cannot be computed one per query head (`_ungrouped_attention`), or None.

    Nothing to do under multi-head attention. A key norm over every key head at once (OLMo-2's) or
    with weights of its own per key head has no per-query-head form.
    """
    facts = anatomy_of(model)
    if facts.n_kv_heads == facts.n_heads:
        return None
    for layer, this in enumerate(facts.layers):
        if this.ungrouping is None:
            return (
                f"layer {layer}'s attention ({this.attention}) repeats its key heads in a way the "
                "circuit wiring cannot switch off; use edges='native'"
            )
        if this.qk_norm_over_heads or this.key_norm_per_key_head:
            return f"layer {layer} norms its keys with weights per key head; use edges='native'"
    return None


def layout(model: Model | Anatomy) -> Layout:
    """The `Layout` of ``model`` (or of its `Anatomy`): layers, heads, key heads and whether it has learned
    positions."""
    facts = anatomy_of(model)
    return Layout(
        n_layers=facts.n_layers,
        n_heads=facts.n_heads,
        n_kv_heads=facts.n_kv_heads,
        pos_embed=EMBED_PARTS["pos_embed"] in facts.hook_names,
    )


def _in_dtype(norm: Norm, dtype: torch.dtype) -> Callable[[Tensor], Tensor]:
    """A layer's pre-attention norm on any ``[..., d_model]``: the model's own module, in its dtype, then float32
    at least."""
    return lambda x: _up(norm.module(x.to(dtype)))


def _folded(form: Norm, W: Float[Tensor, "head d_model d_head"]) -> tuple[Tensor, Tensor | None]:
    """``W`` with the gain folded in, ``gain[:, None] * W^h``, and the bias's projection ``bias W^h`` (or None)."""
    gain, bias = form.gain, form.bias
    W_gain = W if gain is None else W * _up(gain).to(W.dtype)[None, :, None]
    return W_gain, None if bias is None else einops.einsum(_up(bias).to(W.dtype), W, "d, h d e -> h e")


def _projected(
    form: Norm, x: Float[Tensor, "batch pos head d_model"], W: Float[Tensor, "head d_model d_head"]
) -> Float[Tensor, "batch pos head d_head"]:
    """``N(x^h) W^h`` for every head's own input, in closed form (``form.closed``: `Norm`).

    Known forms, ``N(x) = gain * P(x) / r(x) + bias`` with ``r(x) = sqrt(mean(P(x)^2) + eps)``: a
    ``torch.nn.LayerNorm`` (``P`` subtracts the mean) and a Hugging Face ``*RMSNorm`` (``P`` is the
    identity; Gemma's ``1 + w`` as the gain); any other module keeps autograd's product.
    ``(gain * P(x) / r + bias) W = (x W_gain - mean(x) 1 W_gain) / r + bias W`` with ``W_gain``
    the gain folded into ``W``: the scale ``r`` a head and position, and no normed copy of
    ``[batch pos head d_model]`` (the module's own norm makes several, elementwise).
    """
    assert form.eps is not None
    x = _up(x)
    W_gain, bias = _folded(form, W.to(x.dtype))
    out = einops.einsum(x, W_gain, "b p h d, h d e -> b p h e")
    if form.centre:
        mean = x.mean(-1, keepdim=True)
        square = (x - mean).pow(2).mean(-1, keepdim=True)
        out = out - mean * W_gain.sum(1)
    else:
        square = torch.linalg.vector_norm(x, dim=-1, keepdim=True).pow(2) / x.shape[-1]
    out = out * torch.rsqrt(square + form.eps)
    return out if bias is None else out + bias


@dataclass(frozen=True)
class _LayerWeights:
    W: dict[str, Float[Tensor, "head d_model d_head"]]
    b: dict[str, Float[Tensor, "head d_head"] | None]
    W_O: Float[Tensor, "head d_head d_model"]
    b_O: Float[Tensor, " d_model"] | None
    norm: Callable[[Tensor], Tensor]
    """The pre-attention norm as the pass applies it (the model's module, or frozen at this pass's scale)."""
    form: Norm | None
    """That norm where its products are taken in closed form (`Norm.closed`), else None."""
    post: Norm | None
    post_name: str | None


def _up(tensor: Tensor) -> Tensor:
    """``tensor`` in float32 at least: float32 accumulation whatever the model's dtype (float64 stays)."""
    return tensor if tensor.dtype == torch.float64 else tensor.float()


def _weights(model: Model, facts: Layer, layer: int, dtype: torch.dtype) -> _LayerWeights:
    attn = model.blocks[layer].attn

    def bias(name: str) -> Tensor | None:
        value = getattr(attn, name, None)
        return _up(value.detach()) if isinstance(value, Tensor) else None

    W_O, b_O = output_weights(model, layer)
    ln1 = facts.ln1
    assert ln1 is not None  # `circuit_refusal` asks for ln1's hooks
    return _LayerWeights(
        W={side: _up(getattr(attn, f"W_{side.upper()}").detach()) for side in "qkv"},
        b={side: bias(f"b_{side.upper()}") for side in "qkv"},
        W_O=_up(W_O),
        b_O=None if b_O is None else _up(b_O),
        norm=_in_dtype(ln1, dtype),
        form=ln1 if ln1.closed else None,
        post=facts.post_norm,
        post_name=facts.post_attention,
    )


def _project(
    weights: _LayerWeights,
    side: str,
    x: Float[Tensor, "batch pos head d_model"],
    own: Float[Tensor, "batch pos head d_head"] | None = None,
) -> Tensor:
    """``LN1(x^h) W^h + b^h`` per head: each head's own input normed with its own scale.

    ``own``: the model's own projection of ``x``, where ``x`` is the stream the model read expanded
    over heads: its value is then this one, and only the heads' gradients are added (`_SharedInput`).
    """
    bias = weights.b[side]
    if _one_input_expanded(x):
        unbiased = own if own is None or bias is None else own - bias
        out = _SharedInput.apply(x, weights.W[side], weights.norm, weights.form, unbiased)
    elif weights.form is not None:
        out = _projected(weights.form, x, weights.W[side])
    else:
        out = einops.einsum(weights.norm(x), weights.W[side], "b p h d, h d e -> b p h e")
    return out if bias is None else out + bias


def _expands(x: Tensor, stream: Tensor) -> bool:
    """Whether ``x`` ``[batch pos head d_model]`` is ``stream`` ``[batch pos d_model]`` itself, expanded over heads."""
    return (
        x.data_ptr() == stream.data_ptr()
        and x.shape[:2] == stream.shape[:2]
        and x.shape[3] == stream.shape[2]
        and (x.stride(0), x.stride(1), x.stride(2), x.stride(3))
        == (stream.stride(0), stream.stride(1), 0, stream.stride(2))
    )


def _one_input_expanded(x: Tensor) -> bool:
    """Whether ``x`` is one ``[batch pos d_model]`` tensor expanded over heads, in a pass autograd records."""
    return (
        x.shape[2] > 1
        and x.stride(2) == 0
        and x.requires_grad
        and torch.is_grad_enabled()
        and forward_ad.unpack_dual(x).tangent is None
    )


class _SharedInput(torch.autograd.Function):
    """``LN1(x^h) W^h`` for heads whose inputs ``x^h`` are one tensor ``s``, with each head's own gradient.

    The gradient methods need ``dm/dx^h`` for every head apart, ``J_LN1(s)^T W^h dm/dq^h``; the
    per-head forward pass that gives it autograd's way norms ``s`` once a head, and that pass and
    its backward, elementwise on ``[batch pos head d_model]``, cost a third of a forward pass of
    Qwen2.5-0.5B. Here ``s`` is normed once and projected by every head in one product, or, given
    ``own``, the model's own projection of ``s`` (bias apart) is the value. In the backward pass a
    norm of known form (``form``, a `Norm` whose ``closed`` is true) takes its product in closed form: with
    ``n = P(s) / r``, ``u = gain * (W^h g^h)`` and ``d`` the width,

        J^T u = (P(u) - n (n . u) / d) / r,

    where ``n . u = (gain * n) W^h . g^h`` is read off this pass's projection: one product and one
    rank-one correction a head, nothing elementwise on ``[batch pos head d_model]`` beyond them. Any
    other norm applies its own vector-Jacobian product to every head's gradient at once (batched),
    recomputing the norm. Forward-mode tangents are not defined: a pass that carries them takes the
    per-head way (`_one_input_expanded`).
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        W: Tensor,
        norm: Callable[[Tensor], Tensor],
        form: Norm | None = None,
        own: Tensor | None = None,
    ) -> Tensor:
        shared = x[:, :, :1].detach()  # ``[batch pos 1 d_model]``: the norm takes a head axis
        ctx.norm = norm
        with torch.no_grad():
            # The model's own projection where it computed this one (bias apart): not computed twice.
            out = einops.einsum(norm(shared)[:, :, 0], W, "b p d, h d e -> b p h e") if own is None else own.detach()
            if form is None:
                ctx.save_for_backward(shared, W)
                return out
            assert form.eps is not None
            s, centre = shared[:, :, 0], form.centre
            centred = s - s.mean(-1, keepdim=True) if centre else s
            r = (centred.pow(2).mean(-1, keepdim=True) + form.eps).sqrt()
            W_gain, bias = _folded(form, W)
        ctx.centre = centre
        ctx.save_for_backward(centred / r, r, W_gain, out if bias is None else out - bias)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None, None]:
        if len(ctx.saved_tensors) == 4:
            return _norm_vjp(ctx.centre, grad, *ctx.saved_tensors), None, None, None, None
        shared, W = ctx.saved_tensors
        grad_normed = einops.einsum(grad, W.to(grad.dtype), "b p h e, h d e -> h b p d")[:, :, :, None]
        with torch.enable_grad():
            leaf = shared.detach().requires_grad_(True)
            (grads,) = torch.autograd.grad(ctx.norm(leaf), leaf, grad_normed, is_grads_batched=True)
        return grads[:, :, :, 0].permute(1, 2, 0, 3), None, None, None, None


def _norm_vjp(
    centre: bool,
    grad: Float[Tensor, "batch pos head d_head"],
    n: Float[Tensor, "batch pos d_model"],
    r: Float[Tensor, "batch pos 1"],
    W_gain: Float[Tensor, "head d_model d_head"],
    linear: Float[Tensor, "batch pos head d_head"],
) -> Float[Tensor, "batch pos head d_model"]:
    """``(P(u) - n (n . u) / d) / r`` for every head, ``u = gain * (W^h g^h)`` (`_SharedInput`).

    ``W_gain`` is ``W`` with the gain folded in and ``linear`` the projection ``(gain * n) W^h``:
    then ``u / r = W_gain (g / r)``, ``(n . u) / r = linear . (g / r)`` and ``mean(u) / r = mean_d(W_gain) . (g / r)``.
    The result is laid out heads first (a view ``[batch pos head d_model]``), as the products of
    differences and gradients read each head's gradient: one contiguous block a head.
    """
    batch, pos = grad.shape[:2]
    scaled = grad / r[..., None].to(grad.dtype)
    W_gain = W_gain.to(grad.dtype)
    out = torch.bmm(einops.rearrange(scaled, "b p h e -> h (b p) e"), W_gain.transpose(1, 2))
    d_model = out.shape[-1]
    along_n = einops.rearrange((linear.to(grad.dtype) * scaled).sum(-1), "b p h -> h (b p) 1")
    out.addcmul_(along_n, n.to(grad.dtype).reshape(1, batch * pos, d_model), value=-1.0 / d_model)
    if centre:  # P(u) = u - mean(u); n is centred already
        mean = einops.einsum(scaled, W_gain.mean(1), "b p h e, h e -> h b p")
        out.sub_(einops.rearrange(mean, "h b p -> h (b p) 1"))
    return einops.rearrange(out, "h (b p) d -> b p h d", b=batch, p=pos)


def _layer_hooks(
    model: Model, facts: Layer, layer: int, stream: Stream, dtype: torch.dtype, frozen: bool = False, group: int = 1
) -> list[tuple[str, HookFn]]:
    """The hooks of layer ``layer`` (``facts``: its anatomy); ``group`` > 1: its k and v computed one a query head
    (`_ungrouped_weights`)."""
    weights = _ungrouped_weights(_weights(model, facts, layer, dtype), group)
    kept: dict[str, Tensor] = {}
    edited = {"attention_in": False}  # whether this pass replaced the layer's attention input (`read_shared`)
    if frozen:
        # LN1 with this pass's scale, detached: the q, k, v inputs are read through a frozen norm too.
        ln1 = facts.ln1
        assert ln1 is not None
        weights = replace(weights, norm=lambda x: ln1.apply(_up(x), _up(kept["scale1"])), form=None)

    def keep_resid(tensor: Tensor, hook: Any) -> None:
        kept["resid"] = tensor

    def attention_in(tensor: Tensor, hook: Any) -> Tensor | None:
        share = getattr(stream, "read_shared", None)  # one input for every head: the model's own projections
        x = None if share is None else share(layer, _up(tensor))
        edited["attention_in"] = x is not None
        return None if x is None else x.to(tensor.dtype)

    def keep_scale1(tensor: Tensor, hook: Any) -> None:
        kept["scale1"] = tensor.detach().reshape(*tensor.shape[:2], 1)

    def heads(tensor: Tensor, hook: Any) -> None:
        z = _up(tensor.reshape(*tensor.shape[:2], weights.W_O.shape[0], -1))
        kept["heads"] = einops.einsum(z, weights.W_O, "b p h e, h e d -> b p h d")

    def summed_heads(tensor: Tensor, hook: Any) -> Tensor:
        # The output projection did not run (`_skipped_work`): its output is the heads' outputs, summed.
        out = kept["heads"].sum(2)
        return (out if weights.b_O is None else out + weights.b_O).to(tensor.dtype)

    def scale(tensor: Tensor, hook: Any) -> None:
        kept["scale"] = _up(tensor)

    def attention_out(tensor: Tensor, hook: Any) -> Tensor | None:
        out = kept.pop("heads")
        if weights.post is not None:
            out = weights.post.linear(out, kept.pop("scale"))
        return _corrected(tensor, stream.write("heads", layer, out))

    def mlp_in(tensor: Tensor, hook: Any) -> Tensor | None:
        x = stream.read("mlp", layer, _up(tensor))
        return None if x is None else x[:, :, 0].to(tensor.dtype)

    def mlp_out(tensor: Tensor, hook: Any) -> Tensor | None:
        return _corrected(tensor, stream.write("mlp", layer, _up(tensor)[:, :, None]))

    post = weights.post_name
    out_hook = block_hook(layer, O_OUT if post is None else f"{post}.{NORM_OUT}")
    hooks: list[tuple[str, HookFn]] = [
        (block_hook(layer, RESID_PRE), keep_resid),
        (block_hook(layer, LN1_IN), attention_in),
    ]
    if frozen:
        hooks.append((block_hook(layer, LN1_SCALE), keep_scale1))
    replaced = _replaces(stream, layer)
    hooks += [
        (
            block_hook(layer, _PROJECTIONS[side]),
            _projection_hook(stream, weights, (layer, side), kept, edited, replaced, 1 if side == "q" else group),
        )
        for side in "qkv"
    ]
    hooks += [(block_hook(layer, Z), heads)]
    if "o" in facts.skippable:
        hooks.append((block_hook(layer, O_OUT), summed_heads))  # before any write there: it fills the output
    if post is not None:
        hooks.append((block_hook(layer, f"{post}.{SCALE}"), scale))
    hooks += [(out_hook, attention_out), (block_hook(layer, LN2_IN), mlp_in), (block_hook(layer, MLP_OUT), mlp_out)]
    return hooks


def _projection_hook(
    stream: Stream,
    weights: _LayerWeights,
    where: tuple[int, str],
    kept: dict[str, Tensor],
    edited: dict[str, bool],
    replaced: bool,
    group: int = 1,
) -> HookFn:
    """The hook at layer ``layer``'s ``side`` projection (``attn.hook_{side}``): each head's own input projected.

    ``where``: ``(layer, side)``. ``kept["resid"]`` is the stream the layer read;
    ``edited["attention_in"]`` whether this pass replaced the layer's attention input
    (`read_shared`); ``replaced`` whether the stream declared it replaces the layer's projections
    (`_replaces`), which then did not run. ``group`` > 1: the keys or values are handed on one per
    query head (an ungrouped pass), flat ``[batch pos head * d_head]``.
    """
    layer, side = where

    def hook(tensor: Tensor, hook: Any) -> Tensor | None:
        resid = _up(kept["resid"])
        x = stream.read(side, layer, resid)
        if x is None:
            if replaced:  # the model's own projection was skipped (`_skipped_work`): it must not be used
                raise RuntimeError(f"layer {layer}'s {side} inputs were to be replaced, but the stream read none")
            return None if group == 1 else _repeated(tensor, weights.W[side].shape[0] // group, group)
        # The stream read as it is, expanded over heads: the model projected that very input (and its
        # projection carries no forward-mode tangent, which the shared way does not define).
        reusable = (
            not replaced
            and not edited["attention_in"]
            and _expands(x, resid)
            and forward_ad.unpack_dual(tensor).tangent is None
        )
        own = _up(tensor).reshape(*x.shape[:2], x.shape[2] // group, -1) if reusable else None
        own = own.repeat_interleave(group, 2) if own is not None and group > 1 else own
        out = _project(weights, side, x, own)
        return (out.reshape(tensor.shape) if group == 1 else out.flatten(2)).to(tensor.dtype)

    return hook


def _ungrouped_weights(weights: _LayerWeights, group: int) -> _LayerWeights:
    """``weights`` with each key head's k and v weights and biases repeated over its ``group`` query heads."""
    if group == 1:
        return weights
    W = {side: w if side == "q" else w.repeat_interleave(group, 0) for side, w in weights.W.items()}
    b = {side: v if side == "q" or v is None else v.repeat_interleave(group, 0) for side, v in weights.b.items()}
    return replace(weights, W=W, b=b)


def _repeated(tensor: Tensor, n_kv_heads: int, group: int) -> Tensor:
    """The model's own keys (values), ``[batch pos kv_head d_head]`` or flat, repeated over each group: flat, one a
    query head, as an ungrouped attention takes them."""
    heads = tensor.reshape(*tensor.shape[:2], n_kv_heads, -1).repeat_interleave(group, 2)
    return heads.flatten(2)


@contextmanager
def _ungrouped_attention(model: Model, anatomy: Anatomy, group: int) -> Iterator[None]:
    """Every attention takes the keys and values handed to it as one a query head, for one pass (`Layer.ungrouping`)."""
    changed: list[tuple[Any, str, Any]] = []
    if group > 1:
        for layer, facts in enumerate(anatomy.layers):
            settings = facts.ungrouping
            if settings is None:
                raise ValueError(f"edges: layer {layer}'s attention cannot be ungrouped ({ungrouping_refusal(model)})")
            module = model.blocks[layer].attn.original_component
            changed += [(module, name, getattr(module, name)) for name in settings]
            for name, value in settings.items():
                setattr(module, name, value)
    try:
        yield
    finally:
        for module, name, value in changed:
            setattr(module, name, value)


def _corrected(tensor: Tensor, correction: Tensor | None) -> Tensor | None:
    return None if correction is None else (_up(tensor) + correction).to(tensor.dtype)


def _embedding_hook(stream: Stream, kind: str) -> HookFn:
    def hook(tensor: Tensor, hook: Any) -> Tensor | None:
        return _corrected(tensor, stream.write(kind, 0, _up(tensor)[:, :, None]))

    return hook


def _final_hook(stream: Stream) -> HookFn:
    def hook(tensor: Tensor, hook: Any) -> Tensor | None:
        x = stream.read("logits", 0, _up(tensor))
        return None if x is None else x[:, :, 0].to(tensor.dtype)

    return hook


def circuit_pass(
    model: Model,
    tokens: Int[Tensor, "batch pos"],
    stream: Stream,
    *,
    freeze_norms: bool = False,
    freeze_patterns: bool = False,
    patterns: dict[int, Tensor] | None = None,
    last: Int[Tensor, " batch"] | None = None,
    columns: Int[Tensor, "batch column"] | None = None,
    ungroup: bool = False,
) -> Float[Tensor, "batch logit_pos d_vocab"]:
    """The logits of one forward pass on ``tokens`` with ``stream`` called at every write and read.

    Autograd follows the caller's mode (a gradient method runs it with gradients on). Prompts are
    right-padded and the model causal, so no attention mask is needed: a real position never sees
    the padding after it.

    ``freeze_norms``: every norm's scale (each ``hook_scale``: pre-attention, pre-MLP, post-attention,
    final, q and k norms) is detached, so neither a gradient nor a forward-mode tangent goes through
    it, and the q, k, v inputs a stream hands over are normed with this pass's LN1 scale, detached.
    ``freeze_patterns``: every attention pattern (``attn.hook_pattern``) is detached likewise. The
    values are this pass's own: only the derivatives see them as constants. ``patterns`` (a dict)
    receives every layer's attention pattern ``[batch head query key]``, detached. ``last`` (one
    position a prompt): the unembedding reads only those positions and the logits are
    ``[batch 1 d_vocab]``; a circuit's metric reads nothing else, and the unembedding of every
    position is a quarter of a forward pass of a model with a large vocabulary (Qwen2.5-0.5B).
    ``columns`` (with ``last``; a few vocabulary ids a prompt): the logits of those ids alone,
    ``[batch 1 column]`` in float32 (the model's logit soft-cap applied); the pass stops at the
    unembedding (or, in a bridge without an unembedding hook, reads them off the full logits). A
    metric that reads two logits then reads two columns of ``W_U``, not all of it: on a CPU the
    unembedding of a few rows is bound by reading its weights (545 MB in Qwen2.5-0.5B), once in
    the pass and once more in a backward pass. ``ungroup``: a grouped-query model's k and v inputs
    are read one per query head and the attention uses one key and value head a query head (the
    module docstring; MIB's ungrouped graph).
    """
    anatomy = anatomy_of(model)  # every fact of the model the pass wires, read here and handed down
    dtype = model_dtype(model)
    shape = layout(anatomy)
    group = shape.n_heads // shape.n_kv_heads if ungroup else 1
    hooks = freezing_hooks(anatomy, norms=freeze_norms, patterns=freeze_patterns)
    hooks += _embedding_hooks(anatomy, stream)
    for layer, facts in enumerate(anatomy.layers):
        hooks += _layer_hooks(model, facts, layer, stream, dtype, frozen=freeze_norms, group=group)
    hooks.append((FINAL_IN, _final_hook(stream)))
    if patterns is not None:
        hooks += [(block_hook(layer, PATTERN), _keeper(patterns, layer)) for layer in range(shape.n_layers)]
    found: dict[str, Tensor] = {}
    if last is not None and UNEMBED_IN in anatomy.hook_names:
        cap = anatomy.logit_softcap
        read = _at_positions(last) if columns is None else _columns_at(model, cap, last, columns, found)
        hooks.append((UNEMBED_IN, read))
    with (
        hooked(model, hooks),
        _weights_need_no_gradient(model),
        _skipped_work(model, anatomy, stream),
        _ungrouped_attention(model, anatomy, group),
        warnings.catch_warnings(),
    ):
        # A detached hook_scale counts as an edit: the bridge then rebuilds the norm's output from it.
        warnings.filterwarnings("ignore", message=".*edited hook_scale.*")
        try:
            logits = model(tokens.to(_model_device(model)))
        except StopForward:
            if "logits" not in found:
                raise
            return found["logits"]
    if columns is None or last is None:
        return logits
    # No unembedding hook to stop at: the columns of the full logits at ``last``.
    rows = torch.arange(logits.shape[0], device=logits.device)
    at_last = _up(logits[rows, last.to(logits.device)])
    return at_last.gather(1, columns.to(logits.device))[:, None]


@contextmanager
def _weights_need_no_gradient(model: Model) -> Iterator[None]:
    """The weights marked as needing no gradient for one pass, then as they were.

    The circuit methods differentiate with respect to activations only: a pass that records no
    weight in autograd's graph keeps fewer tensors, and its backward pass computes no weight
    gradient (7 % of ``eap``'s time on SmolLM2). Nothing is changed where autograd is off.
    """
    parameters = getattr(model, "parameters", None)
    marked = [p for p in parameters() if p.requires_grad] if parameters and torch.is_grad_enabled() else []
    for weight in marked:
        weight.requires_grad_(False)
    try:
        yield
    finally:
        for weight in marked:
            weight.requires_grad_(True)


def _replaces(stream: Stream, layer: int) -> bool:
    """Whether ``stream`` declares, before the pass, that it replaces layer ``layer``'s q, k and v projections."""
    replaces = getattr(stream, "replaces", None)
    return replaces is not None and bool(replaces(layer))


@contextmanager
def _skipped_work(model: Model, anatomy: Anatomy, stream: Stream) -> Iterator[None]:
    """The products whose result ``stream`` replaces are skipped for one pass.

    An MLP whose output the stream supplies (its ``supplies("mlp", layer)``) hands zeros through its
    own ``hook_out``, and the stream's write where the MLP joins the stream (``hook_mlp_out``)
    replaces them: an MLP is most of a layer's products. A q, k or v projection the stream replaces
    with each head's own (``replaces(layer)``) hands zeros through its ``hook_out`` too, where
    the projection hook writes the heads' (checked: a replaced projection the stream then reads no
    input for is an error, not zeros). Every pass skips a layer's output projection: the circuit hooks
    compute each head's output ``z^h W_O^h`` anyway, and their sum (plus ``b_O``) is written in its
    place (`_layer_hooks`). A bridge of another kind, or a Hugging Face module that is not a plain
    MLP or ``nn.Linear``, computes as usual (the stream's write replaces its output all the same):
    which are plain is `Layer.skippable`.
    """
    supplies = getattr(stream, "supplies", None)
    skipped: list[tuple[Any, Callable[..., Tensor]]] = []
    for layer, facts in enumerate(anatomy.layers):
        block = model.blocks[layer]
        if supplies is not None and supplies("mlp", layer) and "mlp" in facts.skippable:
            skipped.append((block.mlp, _zeros_through(block.mlp)))
        sides = ("q", "k", "v", "o") if _replaces(stream, layer) else ("o",)
        for side in sides:
            if side in facts.skippable:
                linear = getattr(block.attn, side)
                skipped.append((linear, _zeros_projected(linear)))
    for module, forward in skipped:
        # In the instance's own dict: a bridge's setattr hands attributes on to the wrapped module.
        vars(module)["forward"] = forward
    try:
        yield
    finally:
        for module, _ in skipped:
            vars(module).pop("forward", None)


def _zeros_through(mlp: Any) -> Callable[..., Tensor]:
    def forward(hidden: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return mlp.hook_out(torch.zeros_like(hidden))

    return forward


def _zeros_projected(linear: Any) -> Callable[..., Tensor]:
    """A `LinearBridge`'s forward that hands zeros of its output's shape through its ``hook_out``."""
    width = linear.original_component.out_features

    def forward(hidden: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        # The bridge's protocol, as its own forward keeps it: its hook_in (the output projection's is
        # hook_z) fires unless skipped once, and its container learns that hook_out fired.
        if linear._suppress_next_hook_in:
            object.__setattr__(linear, "_suppress_next_hook_in", False)
        else:
            hidden = linear.hook_in(hidden)
        out = linear.hook_out(hidden.new_zeros(*hidden.shape[:-1], width))
        object.__setattr__(linear, "_fired_hook_out", True)
        return out

    return forward


def embedding_pass(model: Model, tokens: Int[Tensor, "batch pos"], stream: Stream) -> None:
    """Call ``stream.write`` at the embeddings of ``tokens`` (``embed``, ``pos_embed``) and stop: no block runs."""
    hooks = [*_embedding_hooks(model, stream), (block_hook(0, RESID_PRE), _stop)]
    with hooked(model, hooks):
        try:
            model(tokens.to(_model_device(model)))
        except StopForward:
            pass


def _embedding_hooks(model: Model | Anatomy, stream: Stream) -> list[tuple[str, HookFn]]:
    """``stream.write`` at the embeddings: ``embed``, and ``pos_embed`` where the model has learned positions."""
    kinds = ("embed", "pos_embed") if layout(model).pos_embed else ("embed",)
    return [(EMBED_PARTS[kind], _embedding_hook(stream, kind)) for kind in kinds]


def _stop(tensor: Tensor, hook: Any) -> None:
    raise StopForward


def _at_positions(last: Tensor) -> HookFn:
    """The unembedding's input at each prompt's position ``last``: ``[batch 1 d_model]``."""

    def hook(tensor: Tensor, hook: Any) -> Tensor:
        rows = torch.arange(tensor.shape[0], device=tensor.device)
        return tensor[rows, last.to(tensor.device)][:, None]

    return hook


def _columns_at(model: Model, cap: float | None, last: Tensor, columns: Tensor, found: dict[str, Tensor]) -> HookFn:
    """``z[b, c] = x_b . W_U[:, columns[b, c]] (+ b_U)`` at each prompt's ``last``, kept in ``found``; then stop.

    The soft-cap ``cap * tanh(z / cap)`` (Gemma 2) is what the model applies after the unembedding.
    """
    W_U, b_U = unembedding(model)

    def hook(tensor: Tensor, hook: Any) -> None:
        rows = torch.arange(tensor.shape[0], device=tensor.device)
        chosen = columns.to(tensor.device)
        x = _up(tensor[rows, last.to(tensor.device)])
        z = einops.einsum(x, _up(W_U[:, chosen]).to(x.dtype), "batch d, d batch column -> batch column")
        if b_U is not None:
            z = z + _up(b_U[chosen]).to(x.dtype)
        found["logits"] = (z if cap is None else cap * torch.tanh(z / cap))[:, None]
        raise StopForward

    return hook


def _keeper(store: dict[int, Tensor], layer: int) -> HookFn:
    def hook(tensor: Tensor, hook: Any) -> None:
        store[layer] = tensor.detach()

    return hook


def _detach(tensor: Tensor, hook: Any) -> Tensor:
    return tensor.detach()


def freezing_hooks(model: Model | Anatomy, *, norms: bool, patterns: bool) -> list[tuple[str, HookFn]]:
    """Hooks that detach every norm's scale (``norms``) and every attention pattern (``patterns``) of ``model``
    (or of its `Anatomy`)."""
    names = sorted(anatomy_of(model).hook_names)
    chosen = [name for name in names if norms and name.endswith(f".{SCALE}")]
    chosen += [name for name in names if patterns and name.endswith(PATTERN)]
    return [(name, _detach) for name in chosen]
