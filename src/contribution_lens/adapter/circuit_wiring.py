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
``[batch pos d_model]`` added where that output joins the stream.

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

from contribution_lens.adapter._model import HookFn, Model, model_dtype
from contribution_lens.adapter.forms import PRE_LN, block_forms
from contribution_lens.adapter.hooks import StopForward, hooked, is_causal_model, output_weights
from contribution_lens.adapter.logit_readout import FrozenNorm, _frozen_norm, post_attention_norm
from contribution_lens.adapter.qk_wiring import architecture_name

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
    if not is_causal_model(model):
        return (
            "it is an encoder (bidirectional attention): a circuit's metric is read at each prompt's last "
            "position, which every position of an encoder sees, so right-padded prompts are not separable"
        )
    names = model.hook_dict
    needed_hooks = ["embed.hook_out", "ln_final.hook_in"]
    needed_hooks += [
        f"blocks.0.{n}" for n in ("hook_resid_pre", "ln1.hook_in", "ln2.hook_in", "hook_mlp_out", "attn.hook_z")
    ]
    needed_hooks += [f"blocks.0.attn.hook_{side}" for side in "qkv"]
    for needed in needed_hooks:
        if needed not in names:
            return f"its bridge has no {needed} hook"
    for layer, form in block_forms(model).items():
        if form != PRE_LN and not form.startswith("pre-LN with a norm on the attention output"):
            return f"layer {layer} is {form}; circuits follow pre-LN blocks (with or without post-attention norms)"
    return None


def check_circuit_model(model: Model) -> None:
    """Refuse a model whose circuit graph cannot be wired, with the reason (before any circuit pass)."""
    problem = circuit_refusal(model)
    if problem is not None:
        raise ValueError(f"model: circuits cannot be found in {architecture_name(model)}: {problem}")


def layout(model: Model) -> Layout:
    """The `Layout` of ``model``: layers, heads, key heads and whether it has learned positions."""
    cfg = model.cfg
    n_heads = int(cfg.n_heads)
    return Layout(
        n_layers=int(cfg.n_layers),
        n_heads=n_heads,
        n_kv_heads=int(getattr(cfg, "n_key_value_heads", None) or n_heads),
        pos_embed="pos_embed.hook_out" in model.hook_dict,
    )


@dataclass(frozen=True)
class _LayerWeights:
    W: dict[str, Float[Tensor, "head d_model d_head"]]
    b: dict[str, Float[Tensor, "head d_head"] | None]
    W_O: Float[Tensor, "head d_head d_model"]
    norm: Callable[[Tensor], Tensor]
    post: FrozenNorm | None
    post_name: str | None


def _up(tensor: Tensor) -> Tensor:
    """``tensor`` in float32 at least: float32 accumulation whatever the model's dtype (float64 stays)."""
    return tensor if tensor.dtype == torch.float64 else tensor.float()


def _norm_fn(component: Any, dtype: torch.dtype) -> Callable[[Tensor], Tensor]:
    """The model's own pre-attention norm on any ``[..., d_model]`` (in the model's dtype, then float32 at least)."""
    module = getattr(component, "original_component", None) or component
    return lambda x: _up(module(x.to(dtype)))


def _weights(model: Model, layer: int, dtype: torch.dtype) -> _LayerWeights:
    attn = model.blocks[layer].attn

    def bias(name: str) -> Tensor | None:
        value = getattr(attn, name, None)
        return _up(value.detach()) if isinstance(value, Tensor) else None

    W_O, _ = output_weights(model, layer)
    aliases = getattr(model.blocks[layer], "hook_aliases", {})
    target = aliases.get("hook_attn_out", "attn.hook_out")
    post_name = None if target.split(".")[0] == "attn" else target.rsplit(".", 1)[0]
    return _LayerWeights(
        W={side: _up(getattr(attn, f"W_{side.upper()}").detach()) for side in "qkv"},
        b={side: bias(f"b_{side.upper()}") for side in "qkv"},
        W_O=_up(W_O),
        norm=_norm_fn(model.blocks[layer].ln1, dtype),
        post=post_attention_norm(model, layer),
        post_name=post_name,
    )


def _project(weights: _LayerWeights, side: str, x: Float[Tensor, "batch pos head d_model"]) -> Tensor:
    """``LN1(x^h) W^h + b^h`` per head: each head's own input normed with its own scale."""
    if _one_input_expanded(x):
        out = _SharedInput.apply(x, weights.W[side], weights.norm)
    else:
        out = einops.einsum(weights.norm(x), weights.W[side], "b p h d, h d e -> b p h e")
    bias = weights.b[side]
    return out if bias is None else out + bias


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
    Qwen2.5-0.5B. Here ``s`` is normed once and projected by every head in one product; the
    backward pass applies the norm's own vector-Jacobian product to every head's gradient at once
    (batched), recomputing the norm. Forward-mode tangents are not defined: a pass that carries
    them takes the per-head way (`_one_input_expanded`).
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, W: Tensor, norm: Callable[[Tensor], Tensor]) -> Tensor:
        shared = x[:, :, :1].detach()  # ``[batch pos 1 d_model]``: the norm takes a head axis
        ctx.norm = norm
        ctx.save_for_backward(shared, W)
        with torch.no_grad():
            return einops.einsum(norm(shared)[:, :, 0], W, "b p d, h d e -> b p h e")

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        shared, W = ctx.saved_tensors
        grad_normed = einops.einsum(grad, W.to(grad.dtype), "b p h e, h d e -> h b p d")[:, :, :, None]
        with torch.enable_grad():
            leaf = shared.detach().requires_grad_(True)
            (grads,) = torch.autograd.grad(ctx.norm(leaf), leaf, grad_normed, is_grads_batched=True)
        return grads[:, :, :, 0].permute(1, 2, 0, 3), None, None


def _layer_hooks(
    model: Model, layer: int, stream: Stream, dtype: torch.dtype, frozen: bool = False
) -> list[tuple[str, HookFn]]:
    weights = _weights(model, layer, dtype)
    kept: dict[str, Tensor] = {}
    block = f"blocks.{layer}"
    if frozen:
        # LN1 with this pass's scale, detached: the q, k, v inputs are read through a frozen norm too.
        ln1 = _frozen_norm(model.blocks[layer].ln1)
        weights = replace(weights, norm=lambda x: ln1.apply(_up(x), _up(kept["scale1"])))

    def keep_resid(tensor: Tensor, hook: Any) -> None:
        kept["resid"] = tensor

    def attention_in(tensor: Tensor, hook: Any) -> Tensor | None:
        share = getattr(stream, "read_shared", None)  # one input for every head: the model's own projections
        x = None if share is None else share(layer, _up(tensor))
        return None if x is None else x.to(tensor.dtype)

    def keep_scale1(tensor: Tensor, hook: Any) -> None:
        kept["scale1"] = tensor.detach().reshape(*tensor.shape[:2], 1)

    def projection(side: str) -> HookFn:
        def hook(tensor: Tensor, hook: Any) -> Tensor | None:
            x = stream.read(side, layer, _up(kept["resid"]))
            return None if x is None else _project(weights, side, x).reshape(tensor.shape).to(tensor.dtype)

        return hook

    def heads(tensor: Tensor, hook: Any) -> None:
        z = _up(tensor.reshape(*tensor.shape[:2], weights.W_O.shape[0], -1))
        kept["heads"] = einops.einsum(z, weights.W_O, "b p h e, h e d -> b p h d")

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

    out_hook = f"{block}.attn.o.hook_out" if weights.post_name is None else f"{block}.{weights.post_name}.hook_out"
    hooks: list[tuple[str, HookFn]] = [(f"{block}.hook_resid_pre", keep_resid), (f"{block}.ln1.hook_in", attention_in)]
    if frozen:
        hooks.append((f"{block}.ln1.hook_scale", keep_scale1))
    hooks += [(f"{block}.attn.hook_{side}", projection(side)) for side in "qkv"]
    hooks += [(f"{block}.attn.hook_z", heads)]
    if weights.post_name is not None:
        hooks.append((f"{block}.{weights.post_name}.hook_scale", scale))
    hooks += [(out_hook, attention_out), (f"{block}.ln2.hook_in", mlp_in), (f"{block}.hook_mlp_out", mlp_out)]
    return hooks


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
    """
    dtype = model_dtype(model)
    shape = layout(model)
    hooks = freezing_hooks(model, norms=freeze_norms, patterns=freeze_patterns)
    hooks.append(("embed.hook_out", _embedding_hook(stream, "embed")))
    if shape.pos_embed:
        hooks.append(("pos_embed.hook_out", _embedding_hook(stream, "pos_embed")))
    for layer in range(shape.n_layers):
        hooks += _layer_hooks(model, layer, stream, dtype, frozen=freeze_norms)
    hooks.append(("ln_final.hook_in", _final_hook(stream)))
    if patterns is not None:
        hooks += [(f"blocks.{layer}.attn.hook_pattern", _keeper(patterns, layer)) for layer in range(shape.n_layers)]
    if last is not None and "unembed.hook_in" in model.hook_dict:
        hooks.append(("unembed.hook_in", _at_positions(last)))
    with hooked(model, hooks), _weights_need_no_gradient(model), warnings.catch_warnings():
        # A detached hook_scale counts as an edit: the bridge then rebuilds the norm's output from it.
        warnings.filterwarnings("ignore", message=".*edited hook_scale.*")
        return model(tokens.to(_device(model)))


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


def embedding_pass(model: Model, tokens: Int[Tensor, "batch pos"], stream: Stream) -> None:
    """Call ``stream.write`` at the embeddings of ``tokens`` (``embed``, ``pos_embed``) and stop: no block runs."""
    hooks = [("embed.hook_out", _embedding_hook(stream, "embed"))]
    if layout(model).pos_embed:
        hooks.append(("pos_embed.hook_out", _embedding_hook(stream, "pos_embed")))
    hooks.append(("blocks.0.hook_resid_pre", _stop))
    with hooked(model, hooks):
        try:
            model(tokens.to(_device(model)))
        except StopForward:
            pass


def _stop(tensor: Tensor, hook: Any) -> None:
    raise StopForward


def _at_positions(last: Tensor) -> HookFn:
    """The unembedding's input at each prompt's position ``last``: ``[batch 1 d_model]``."""

    def hook(tensor: Tensor, hook: Any) -> Tensor:
        rows = torch.arange(tensor.shape[0], device=tensor.device)
        return tensor[rows, last.to(tensor.device)][:, None]

    return hook


def _keeper(store: dict[int, Tensor], layer: int) -> HookFn:
    def hook(tensor: Tensor, hook: Any) -> None:
        store[layer] = tensor.detach()

    return hook


def _detach(tensor: Tensor, hook: Any) -> Tensor:
    return tensor.detach()


def freezing_hooks(model: Model, *, norms: bool, patterns: bool) -> list[tuple[str, HookFn]]:
    """Hooks that detach every norm's scale (``norms``) and every attention pattern (``patterns``)."""
    names = list(model.hook_dict)
    chosen = [name for name in names if norms and name.endswith(".hook_scale")]
    chosen += [name for name in names if patterns and name.endswith("attn.hook_pattern")]
    return [(name, _detach) for name in chosen]


def _device(model: Model) -> torch.device:
    try:
        return next(model.parameters()).device
    except (AttributeError, StopIteration):
        return torch.device("cpu")
