"""The readout: the residual stream, the norms around it and the unembedding (`Readout`, `readout`)."""

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from contribution_lens.adapter._model import HookFn, Model
from contribution_lens.adapter.anatomy import (
    ATTN_OUT,
    FINAL_SCALE,
    RESID_POST,
    RESID_PRE,
    SCALE,
    UNEMBED_IN,
    UNEMBED_OUT,
    Norm,
    anatomy_of,
)
from contribution_lens.adapter.hooks import LayerInputs, output_hook

# --- The readout: the residual stream, the norms around it and the unembedding ---------------------
#
# The residual stream at the last block's output is the embedding plus every block's update,
# ``x = resid_pre_0 + sum_l (resid_post_l - resid_pre_l)``, and attention's share of an update
# is ``hook_attn_out``: the o-projection output, or that output after a post-attention norm
# (Gemma 2/3 ``ln1_post``). With the norms' scales frozen at a position every step from the
# residual stream to the logit is affine, so the logit splits exactly into per-component terms.
#
# Block ``l`` adds attention's update ``a_i`` to the residual stream ``x_i`` (``hook_resid_pre``):
# ``r_mid_i = x_i + a_i``. ``a_i`` is the o-projection output ``o_i + b_O`` (``attn.o.hook_out``),
# or, where a norm follows the attention, that norm's output with the scale frozen at the
# position: ``a_i = N(o_i + b_O)``, ``N(p) = P(p) * gain / scale_i + bias``. In post-LN encoders
# (BERT) the norm comes after the sum and ``r_mid`` is the sum before it.


def post_attention_norm(model: Model, layer: int) -> Norm | None:
    """Layer ``layer``'s norm of the attention output before it joins the residual stream (Gemma), or None."""
    return anatomy_of(model).layers[layer].post_norm


def final_norm(model: Model) -> Norm | None:
    """The norm between the residual stream and the unembedding (``ln_final``), or None where there is none."""
    return anatomy_of(model).final_norm


def _no_unembedding(name: str) -> str:
    return f"{name} has no unembedding (LM head): logit attribution explains next-token logits"


def unembedding(model: Model) -> tuple[Float[Tensor, "d_model d_vocab"], Float[Tensor, " d_vocab"] | None]:
    """``W_U`` and ``b_U`` (None when the unembedding has no bias); raises where the model has no LM head."""
    if not anatomy_of(model).unembedding:
        raise ValueError(_no_unembedding(type(model).__name__))
    return _unembedding_weights(model)


def _unembedding_weights(model: Model) -> tuple[Tensor, Tensor | None]:
    """``W_U`` and ``b_U``, read from the model now."""
    unembed = model.unembed
    bias = unembed.original_component.bias.detach() if anatomy_of(model).unembedding_bias else None
    return unembed.W_U.detach(), bias


def logit_softcap(model: Model) -> float | None:
    """The cap ``c`` of a model whose output logits are ``c * tanh(z / c)`` (Gemma 2), or None.

    The unembedding's output ``z`` (``unembed.hook_out``) comes before the cap (`Anatomy.logit_softcap`).
    """
    return anatomy_of(model).logit_softcap


@dataclass(frozen=True)
class AttentionUpdate:
    """One layer's residual sum ``r_mid = resid_pre + added`` and the frozen norm between heads and sum."""

    resid_pre: Float[Tensor, "batch query d_model"]
    added: Float[Tensor, "batch query d_model"]
    norm: Norm | None
    """The post-attention norm (None where the o-projection output is added as it is)."""
    scale: Float[Tensor, "batch query"] | None
    """That norm's ``hook_scale`` per position (None without a norm)."""


@dataclass(frozen=True, eq=False)
class Readout:
    """How a model reads its residual stream, read off the model once: norms, unembedding, soft-cap, hooks.

    At position ``i`` the logit of token ``t`` is ``z_t = <N(x_i), W_U[:, t]> + b_U[t]`` (`logit`), ``x_i``
    the residual stream after the last block and ``N`` the final norm, ``N(x) = P(x) * g / s_i + b``
    with its scale ``s_i`` frozen (`Norm`); a model that soft-caps shows ``c * tanh(z / c)``.
    Where a norm follows the attention (Gemma's ``ln1_post``) `post_norms` holds it per layer.

    Everything an analysis needs from the model between the residual stream and the logit is here:
    logit attribution, the flow and the explaining pass build one (`readout`) and read it, instead
    of asking the model again for each piece.

    Attributes:
        final_norm: ``N`` (None where the model has no final norm).
        post_norms: per layer, the norm of the attention output before it joins the stream, or None.
        W_U: ``[d_model d_vocab]``, None where the model has no LM head (an encoder: the flow still runs).
        b_U: ``[d_vocab]`` or None.
        softcap: ``c`` where the model soft-caps its logits, else None.
        residual_capture: the per-layer hooks (relative to ``blocks.{l}``) logit attribution captures.
        flow_capture: the per-layer hooks `attention_update` reads.
        model_name: the model's class, for messages.
    """

    final_norm: Norm | None
    post_norms: tuple[Norm | None, ...]
    W_U: Float[Tensor, "d_model d_vocab"] | None
    b_U: Float[Tensor, " d_vocab"] | None
    softcap: float | None
    residual_capture: tuple[str, ...]
    flow_capture: tuple[str, ...]
    model_name: str = ""
    post_scale_hooks: tuple[str | None, ...] = field(default=(), repr=False)
    """Per layer, the ``captured`` name of the post-attention norm's ``hook_scale`` (None without one)."""
    final_scale_hook: bool = field(default=False, repr=False)
    """Whether ``ln_final.hook_scale`` exists (the final norm's scale can be kept)."""
    cuts_unembedding: bool = field(default=False, repr=False)
    """Whether ``unembed.hook_in`` exists (the unembedding can be given the explained rows only)."""

    def unembedding(self) -> tuple[Float[Tensor, "d_model d_vocab"], Float[Tensor, " d_vocab"] | None]:
        """``(W_U, b_U)``, refused where the model has no LM head."""
        if self.W_U is None:
            raise ValueError(_no_unembedding(self.model_name))
        return self.W_U, self.b_U

    @property
    def biases(self) -> tuple[str, ...]:
        """Which of the readout's bias terms the model has: among ``post_norm``, ``final_norm``, ``unembed``."""
        names = []
        if any(norm is not None and norm.bias is not None for norm in self.post_norms):
            names.append("post_norm")
        if self.final_norm is not None and self.final_norm.bias is not None:
            names.append("final_norm")
        if self.b_U is not None:
            names.append("unembed")
        return tuple(names)

    def post_scale(self, layer: LayerInputs) -> Float[Tensor, "batch pos"] | None:
        """The post-attention norm's ``hook_scale`` of ``layer`` (captured with `residual_capture`), or None."""
        name = self.post_scale_hooks[layer.layer]
        if name is None:
            return None
        scale = layer.captured[name]
        return scale.reshape(scale.shape[:2])

    def attention_update(self, layer: LayerInputs) -> AttentionUpdate:
        """What layer ``layer`` adds to which residual stream, from the hooks `flow_capture` names."""
        resid_pre = layer.captured[RESID_PRE]
        norm = self.post_norms[layer.layer]
        if norm is not None:
            return AttentionUpdate(resid_pre, layer.captured[ATTN_OUT], norm, self.post_scale(layer))
        if layer.hook_out is not None:
            return AttentionUpdate(resid_pre, layer.hook_out, None, None)
        raise ValueError(f"layer {layer.layer} has no o-projection output hook ({output_hook(layer.layer)})")

    def final_hooks(self, positions: Sequence[int], store: dict[str, Tensor]) -> list[tuple[str, HookFn]]:
        """Hooks that keep, at ``positions`` of batch element 0, the final norm's scale and the unembedding's output.

        ``store["final_scale"]`` is ``[pos]`` (absent without a final norm), ``store["logits"]``
        ``[pos d_vocab]``: the unembedding's output before any logit soft-capping. Where the bridge
        has ``unembed.hook_in``, the unembedding is given those rows only, so the pass's own logits
        are ``[1 pos d_vocab]`` at ``positions``: the product with the vocabulary at every other
        position is a long pass's largest single cost (about a tenth of a plain pass at 1,024 tokens
        on SmolLM2) and its largest tensor.
        """
        rows = list(positions)

        def keep(key: str, index: list[int] | slice) -> HookFn:
            def hook(tensor: Tensor, hook: Any) -> None:
                store[key] = tensor.detach()[0, index].reshape(len(rows), -1)

            return hook

        def cut(tensor: Tensor, hook: Any) -> Tensor:
            return tensor[:1, rows]

        hooks: list[tuple[str, HookFn]] = [(UNEMBED_IN, cut)] if self.cuts_unembedding else []
        hooks.append((UNEMBED_OUT, keep("logits", slice(None) if self.cuts_unembedding else rows)))
        if self.final_scale_hook:
            hooks.append((FINAL_SCALE, keep("final_scale", rows)))
        return hooks

    def direction(
        self, targets: Sequence[int], foils: Sequence[int | None], dtype: torch.dtype
    ) -> tuple[Float[Tensor, "row d_model"], Float[Tensor, " row"]]:
        """``W_U[:, t] - W_U[:, f]`` per row (no foil: ``W_U[:, t]``), and ``b_U[t] - b_U[f]``, in ``dtype``."""
        W_U, b_U = self.unembedding()
        chosen = list(targets)
        rows = W_U[:, chosen].T.to(dtype)
        bias = torch.zeros(len(chosen), dtype=dtype, device=rows.device) if b_U is None else b_U[chosen].to(dtype)
        for index, foil in enumerate(foils):
            if foil is not None:
                rows[index] -= W_U[:, foil].to(dtype)
                if b_U is not None:
                    bias[index] -= b_U[foil].to(dtype)
        return rows, bias

    def logit(
        self,
        resid: Float[Tensor, "row d_model"],
        final_scale: Float[Tensor, " row"] | None,
        targets: Sequence[int],
        foils: Sequence[int | None] | None = None,
        *,
        dtype: torch.dtype = torch.float64,
    ) -> Float[Tensor, " row"]:
        """``z = <N(x), W_U[:, t] - W_U[:, f]> + b_U[t] - b_U[f]`` per row, evaluated in ``dtype``.

        ``resid`` is the residual stream after the last block at the explained positions, ``final_scale``
        the final norm's scale there (``hook_scale``, frozen; ignored without a final norm). Every weight
        and activation is cast to ``dtype`` first: in float64 this is the logit the model's own weights
        give that stream, free of the model's rounding, so the gap to the model's value is its rounding.
        The value is before any soft-cap, as `LogitAttribution.logit` is.

        Example:
            >>> import contribution_lens as cl
            >>> from contribution_lens.adapter import forward
            >>> model = cl.load_model()
            >>> kept = {}
            >>> hooks = [("ln_final.hook_in", lambda x, hook: kept.update(x=x[0, -1:])),
            ...          ("ln_final.hook_scale", lambda s, hook: kept.update(s=s[0, -1:, 0]))]
            >>> logits = forward(model, cl.to_token_batch(model, "The capital of France is"), hooks)
            >>> top = int(logits[0, -1].argmax())
            >>> value = readout(model).logit(kept["x"], kept["s"], [top])
            >>> bool(abs(value.item() - logits[0, -1, top].item()) < 1e-3)
            True
        """
        direction, bias = self.direction(targets, [None] * len(targets) if foils is None else foils, dtype)
        x = resid.to(dtype)
        if self.final_norm is not None:
            if final_scale is None:
                raise ValueError("final_scale is needed: this model's final norm scales each position")
            x = self.final_norm.apply(x, final_scale.to(dtype))
        return (x * direction.to(x.device)).sum(-1) + bias.to(x.device)

    def rounding_bound(
        self,
        resid: Float[Tensor, "row d_model"],
        final_scale: Float[Tensor, " row"] | None,
        targets: Sequence[int],
        foils: Sequence[int | None] | None = None,
        *,
        dtype: torch.dtype,
    ) -> Float[Tensor, " row"]:
        """How far a model computing in ``dtype`` may put its logit from `logit`'s, from the same stream.

        ``B = (u + u_n) (|z_t| + |z_f|) + 2 lambda u_n ||n * d||_2 + sqrt(d_model) u_acc S`` per row,
        with ``u`` the unit roundoff of ``dtype`` (half its ``eps``: ``2**-8`` in bfloat16,
        ``2**-11`` in float16, ``2**-24`` in float32), ``u_n = max(u, 2**-24)`` the final norm's
        (Hugging Face's norms compute in float32, even in a float64 model), ``u_acc`` that of the
        products' accumulation (float32, or float64 for a float64 model), ``n = N(x)`` the normed
        stream, ``d = W_U[:, t] - W_U[:, f]`` (no foil: ``W_U[:, t]``), ``z_t`` and ``z_f`` the
        target's and foil's logits (no foil: 0), ``S = sum_k |n_k| (|W_U[k, t]| + |W_U[k, f]|)``
        and ``lambda = 6``.

        Derivation: both values read the same residual stream ``x`` (the model's depth is in it,
        so no depth factor), and differ only by the rounding of the last two steps. (1) The model
        rounds each logit once to ``dtype``, at most ``u |z|``; the norm's scale is one rounded
        number shared by every ``n_k``, which moves each logit by at most ``u_n |z|``. (2) The
        norm rounds each ``n_k`` twice more (by the scale, by the gain): ``n_k (1 + e_k)`` with
        ``|e_k| <= 2 u_n``, moving ``<n, d>`` by ``sum_k e_k n_k d_k``; for independent roundings,
        Hoeffding's inequality puts that sum beyond ``lambda * 2 u_n ||n * d||_2`` with
        probability below ``2 exp(-lambda**2 / 2)`` (``3e-8``). (3) The unembedding accumulates
        ``d_model`` products: about ``sqrt(d_model) u_acc S`` (Higham and Mary's probabilistic
        bound). In float32 and float64 ``B`` is float rounding (about ``5e-6`` of the logit).

        Example:
            >>> import torch
            >>> r = Readout(None, (), torch.eye(2), None, None, (), ())
            >>> r.rounding_bound(torch.tensor([[3.0, 1.0]]), None, [0], [1], dtype=torch.bfloat16)
            tensor([0.1795], dtype=torch.float64)
        """
        W_U, b_U = self.unembedding()
        acc = torch.promote_types(dtype, torch.float32)
        u, u_acc = torch.finfo(dtype).eps / 2, torch.finfo(acc).eps / 2
        u_n = max(u, torch.finfo(torch.float32).eps / 2)
        x = resid.to(torch.float64)
        if self.final_norm is not None:
            if final_scale is None:
                raise ValueError("final_scale is needed: this model's final norm scales each position")
            x = self.final_norm.apply(x, final_scale.to(torch.float64))
        given = list(foils) if foils is not None else [None] * len(targets)
        has_foil = torch.tensor([f is not None for f in given], dtype=x.dtype, device=x.device)
        target = W_U[:, list(targets)].T.to(x)
        foil = W_U[:, [t if f is None else f for t, f in zip(targets, given, strict=True)]].T.to(x)
        foil = foil * has_foil[:, None]
        z_t, z_f = (x * target).sum(-1), (x * foil).sum(-1)
        if b_U is not None:
            z_t = z_t + b_U[list(targets)].to(x)
            z_f = z_f + b_U[[t if f is None else f for t, f in zip(targets, given, strict=True)]].to(x) * has_foil
        spread = (x.abs() * (target.abs() + foil.abs())).sum(-1)
        lam = 6.0
        return (
            (u + u_n) * (z_t.abs() + z_f.abs())
            + 2 * lam * u_n * (x * (target - foil)).norm(dim=-1)
            + x.shape[-1] ** 0.5 * u_acc * spread
        )


def readout(model: Model) -> Readout:
    """The model's `Readout`: its final norm, post-attention norms, unembedding, soft-cap and the hooks to read them.

    Its facts come from the model's `Anatomy` (read once), its unembedding weights from the model now: an
    analysis builds one per call and passes it around, and a weight edited since is seen by the next call.

    Example:
        >>> import contribution_lens as cl
        >>> r = readout(cl.load_model())
        >>> tuple(r.W_U.shape), r.softcap, r.post_norms[0], r.final_norm.centre  # RMSNorm: no centring
        ((576, 49152), None, None, False)
    """
    facts = anatomy_of(model)
    post = [layer.post_attention for layer in facts.layers]
    scales = tuple(None if name is None else f"{name}.{SCALE}" for name in post)
    W_U, b_U = _unembedding_weights(model) if facts.unembedding else (None, None)
    # Every layer's norm has the same name where there is one (the first layer's, as the capture asks).
    first = () if scales[0] is None else (scales[0],)
    return Readout(
        final_norm=facts.final_norm,
        post_norms=tuple(layer.post_norm for layer in facts.layers),
        W_U=W_U,
        b_U=b_U,
        softcap=facts.logit_softcap,
        residual_capture=(RESID_PRE, RESID_POST, ATTN_OUT, *first),
        flow_capture=(RESID_PRE, *((ATTN_OUT, *first) if first else ())),
        model_name=type(model).__name__,
        post_scale_hooks=scales,
        final_scale_hook=facts.final_norm is not None and FINAL_SCALE in facts.hook_names,
        cuts_unembedding=UNEMBED_IN in facts.hook_names,
    )


# The per-piece functions below are `Readout`'s, for a caller that needs one piece once.


def residual_capture(model: Model) -> list[str]:
    """The per-layer ``capture`` names logit attribution reads (`Readout.residual_capture`).

    ``hook_resid_pre``, ``hook_resid_post`` and ``hook_attn_out`` on every layer; where the
    attention output is normed before it is added (Gemma), that norm's ``hook_scale`` too.
    """
    return list(readout(model).residual_capture)


def flow_capture(model: Model) -> list[str]:
    """The ``capture`` names (relative to ``blocks.{l}``) that `attention_update` reads (`Readout.flow_capture`)."""
    return list(readout(model).flow_capture)


def captured_post_scale(model: Model, layer: LayerInputs) -> Tensor | None:
    """The post-attention norm's ``hook_scale`` of ``layer`` as ``[batch pos]``, or None (`Readout.post_scale`)."""
    return readout(model).post_scale(layer)


def final_hooks(model: Model, positions: Sequence[int], store: dict[str, Tensor]) -> list[tuple[str, HookFn]]:
    """`Readout.final_hooks` of the model."""
    return readout(model).final_hooks(positions, store)


def attention_update(model: Model, layer: LayerInputs) -> AttentionUpdate:
    """What layer ``layer`` adds to which residual stream (`Readout.attention_update`)."""
    return readout(model).attention_update(layer)
