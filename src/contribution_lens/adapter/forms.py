"""The form of the attention block (ALTI): pre-LN or post-LN, read once per model on a probe (`block_forms`)."""

import weakref
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from contribution_lens.adapter._model import HookFn, Model, model_dtype
from contribution_lens.adapter.anatomy import (
    ATTN_OUT,
    LN1_IN,
    LN1_OUT,
    RESID_MID,
    RESID_PRE,
    Norm,
    anatomy_of,
    block_hook,
)
from contribution_lens.adapter.hooks import PROBE_LENGTH, _relative_error, forward, n_layers, output_hook
from contribution_lens.adapter.tokens import to_token_batch

# --- the form of the attention block (ALTI) ---------------------------------------------------

PRE_LN = "pre-LN"
"""``y = x + Attn(LN(x))``: the residual sum is the block's output (``hook_resid_mid``); no norm after it."""
POST_LN = "post-LN"
"""``y = LayerNorm(x + Attn(x))`` (BERT, RoBERTa): the LayerNorm ``ln1`` follows the residual sum."""


def post_norm(model: Model, layer: int) -> Norm:
    """The LayerNorm ``ln1`` after a post-LN block's residual sum: ``LN(s) = (s - mean(s)) / sigma * g + b``.

    ``sigma = sqrt(var(s) + eps)``, ``var`` the population variance over ``d_model`` (`Norm.normalise`); its
    gain and bias are read from the model when used (edited weights are seen).
    """
    norm = anatomy_of(model).layers[layer].ln1
    if norm is None or norm.eps is None:
        raise ValueError(f"layer {layer} has no norm ln1 of a known epsilon")
    return norm


def apply_post_norm(norm: Norm, s: Float[Tensor, "*batch d_model"]) -> Float[Tensor, "*batch d_model"]:
    """``LN(s)`` with ``norm`` in the dtype of ``s`` (`Norm.normalise`)."""
    return norm.normalise(s)


_FORMS: "weakref.WeakKeyDictionary[Any, dict[int, str]]" = weakref.WeakKeyDictionary()


def _block_form(model: Model, layer: int, caught: dict[str, Tensor], tolerance: float) -> str:
    """`PRE_LN`, `POST_LN` or a description of another form, from one layer's probe activations.

    Each test compares what a hook adds to ``hook_resid_pre`` with the attention output, relative
    to that output: the residual stream can be far larger than what one block adds to it.
    """
    x, out = caught.get(RESID_PRE), caught.get("out")
    if anatomy_of(model).parallel_attn_mlp:
        return "parallel attention and MLP (one residual sum for both, as in GPT-J)"
    if x is None or out is None:
        return "unrecognised (hook_resid_pre or the o-projection output never fires)"
    x = x.double()

    def adds(name: str, added: Tensor) -> bool:
        if name not in caught:
            return False
        total = caught[name].double()
        # The sum is rounded to the model's dtype: in bfloat16, with a stream of 362 next to an output
        # of 0.56 (Qwen2.5, layer 3), that rounding alone is 0.24. One unit in the last place of each
        # element of the sum is allowed besides the tolerance (nothing, in float32).
        rounding = torch.finfo(caught[name].dtype).eps * total.abs()
        excess = ((total - x - added.double()).abs() - rounding).clamp(min=0)
        return float(excess.max()) <= tolerance * max(float(added.abs().max()), 1e-30)

    if adds(RESID_MID, out):
        return PRE_LN
    if adds(LN1_IN, out) and LN1_OUT in caught:
        norm = post_norm(model, layer)
        if not norm.centre:
            return "post-RMSNorm (RMSNorm after the residual sum; ALTI's post-LN form is for LayerNorm)"
        normed = apply_post_norm(norm, x + out.double())
        if _relative_error(caught[LN1_OUT], normed) <= tolerance:
            return POST_LN
        return "post-norm of an unrecognised kind (ln1 after the residual sum is not a LayerNorm)"
    if ATTN_OUT in caught and adds(RESID_MID, caught[ATTN_OUT]):
        return "pre-LN with a norm on the attention output before the residual sum (as in Gemma)"
    return "unrecognised (neither hook_resid_mid nor ln1's input is hook_resid_pre + the attention output)"


def block_forms(model: Model) -> dict[int, str]:
    """The form of every layer's attention block: ``"pre-LN"``, ``"post-LN"``, or what it is instead.

    pre-LN where ``hook_resid_mid = hook_resid_pre + o`` (``y = x + Attn(LN(x))``, with
    ``o = sum_h z^h W_O^h + b_O``, `output_hook`); post-LN where ``ln1``'s input is
    ``hook_resid_pre + o`` and its output that input through the LayerNorm `post_norm` reads
    (``y = LN(x + Attn(x))``); both to a relative 1e-3 (3e-2 in half precision). ALTI is defined
    for these two forms and refuses the others by the description given here.

    Read by a probe forward pass (ids 1..`PROBE_LENGTH`) the first time, then remembered for the
    model. The probe cannot run inside another pass on the same model: where your own
    `contribution_lens.map_layers` function scores ``alti``, call this once before it.

    Example:
        >>> import contribution_lens as cl
        >>> model = cl.load_model()
        >>> forms = cl.block_forms(model)  # before a pass that scores ALTI
        >>> len(forms), set(forms.values())
        (30, {'pre-LN'})
    """
    cached = _FORMS.get(model)
    if cached is not None:
        return dict(cached)  # a copy: what a caller changes is not what ALTI reads
    if model in _PROBING:
        # Asked again from inside the probe: the caller is a hook of a pass already running on this
        # model, whose hooks fire on the probe too. Refuse rather than recurse.
        raise ValueError(
            "the block form of each layer is read by a probe pass, which cannot run inside another pass on the "
            "same model: call cl.block_forms(model) once before the pass (the forms are remembered for the model)"
        )
    _PROBING.add(model)
    try:
        return dict(_probe_block_forms(model))
    finally:
        _PROBING.discard(model)


_PROBING: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _probe_block_forms(model: Model) -> dict[int, str]:
    """`block_forms` without its cache: one probe pass."""
    total = n_layers(model)
    facts = anatomy_of(model)
    batch = to_token_batch(model, (torch.arange(PROBE_LENGTH) + 1) % (facts.d_vocab or PROBE_LENGTH + 1))
    tolerance = 3e-2 if model_dtype(model) in (torch.float16, torch.bfloat16) else 1e-3
    caught: dict[int, dict[str, Tensor]] = {layer: {} for layer in range(total)}
    relative = (RESID_PRE, RESID_MID, ATTN_OUT, LN1_IN, LN1_OUT)

    def keep(layer: int, name: str) -> HookFn:
        return lambda tensor, hook: caught[layer].__setitem__(name, tensor.detach())

    hooks = [(output_hook(layer, model), keep(layer, "out")) for layer in range(total)]
    hooks += [
        (block_hook(layer, name), keep(layer, name))
        for layer in range(total)
        for name in relative
        if block_hook(layer, name) in facts.hook_names
    ]
    forward(model, batch, hooks)
    forms = {layer: _block_form(model, layer, caught[layer], tolerance) for layer in range(total)}
    _FORMS[model] = forms
    return forms
