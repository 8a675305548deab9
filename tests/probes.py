"""A model's facts as the adapter's modules probed them, each its own way, before it read them once.

The oracle of the anatomy's tests: `probed_facts` reads every fact the wiring needs with the probes the
adapter used (copied from ``hooks.py``, ``forms.py``, ``logit_readout.py``, ``qk_wiring.py``,
``circuit_wiring.py`` and ``tokens.py`` as they were), and `read_facts` reads the same facts through the
adapter as it is. `differences` names every fact on which they disagree. Norms are compared by their
values (centring, the gain as applied, the bias, epsilon), read from the model at the time of the call.

Where the old probes disagreed with each other, the oracle follows the readout's and `CORRECTED` says where
and why the anatomy holds the other: the post-attention norm (``logit_readout`` took any submodule owning
``hook_attn_out`` other than ``attn``, ``attn.o`` of Bloom included; ``circuit_wiring`` only one outside
``attn``).
"""

from typing import Any

import torch
from torch import Tensor

from contribution_lens import adapter

# --- the old probes, as they were ------------------------------------------------------------------------


def _old_architecture_name(model: Any) -> str:
    name = getattr(model.cfg, "architecture", None) or getattr(model.cfg, "original_architecture", None)
    return str(name) if name else type(model).__name__


def _old_causal(model: Any) -> bool | str:
    direction = getattr(model.cfg, "attention_dir", "causal")
    if direction not in ("causal", "bidirectional"):
        return f"model.cfg.attention_dir is {direction!r}; expected 'causal' or 'bidirectional'"
    return direction == "causal"


def _old_frozen_norm(component: Any) -> dict[str, Any]:
    """``logit_readout._frozen_norm``: a norm bridge's frozen affine form."""
    rms = bool(getattr(component, "uses_rms_norm", False))
    weight = getattr(getattr(component, "original_component", None), "weight", None)
    if isinstance(weight, Tensor) and type(component).__name__ not in ("LayerNormPreBridge", "RMSNormPreBridge"):
        gain = weight.detach() + 1.0 if getattr(component, "uses_weight_offset", False) else weight.detach()
    else:
        gain = None
    bias = getattr(getattr(component, "original_component", None), "bias", None)
    return {"centre": not rms, "gain": gain, "bias": bias.detach() if isinstance(bias, Tensor) and not rms else None}


def _old_post_norm(model: Any, layer: int) -> dict[str, Any] | str:
    """``forms.post_norm``: the LayerNorm ``ln1`` of a post-LN block (weight, bias, epsilon)."""
    norm = model.blocks[layer].ln1
    try:
        weight = norm.weight.detach()
    except AttributeError as error:
        return f"AttributeError: {error}"
    if getattr(norm, "uses_weight_offset", False):
        weight = 1 + weight
    component = getattr(norm, "original_component", None)
    bias = getattr(component, "bias", None)
    eps = getattr(component, "eps", None)
    return {
        "gain": weight,
        "bias": None if bias is None else bias.detach(),
        "eps": float(model.cfg.eps if eps is None else eps),
    }


def _old_closed_norm(component: Any) -> dict[str, Any]:
    """``circuit_wiring._Norm.of``: whether a norm's products are taken in closed form, and its epsilon there."""
    module = getattr(component, "original_component", None) or component
    form, eps = _old_frozen_norm(component), getattr(module, "variance_epsilon", getattr(module, "eps", None))
    layer_norm = isinstance(module, torch.nn.LayerNorm)
    known = (layer_norm and form["centre"]) or (type(module).__name__.endswith("RMSNorm") and not form["centre"])
    if not known or not isinstance(eps, float):
        return {"closed": False, "module": module}
    return {"closed": True, "module": module, "eps": eps, **form}


def _old_post_name_readout(model: Any, layer: int) -> str | None:
    target = getattr(model.blocks[layer], "hook_aliases", {}).get("hook_attn_out", "attn.hook_out")
    owner = target.rsplit(".", 1)[0]
    return None if owner == "attn" or not target.endswith(".hook_out") else owner


def _old_logit_softcap(model: Any) -> float | None:
    cap = getattr(model.cfg, "output_logits_soft_cap", None)
    if cap is None:
        config = getattr(getattr(model, "original_model", None), "config", None)
        cap = getattr(config, "final_logit_softcapping", None)
    return float(cap) if cap is not None and float(cap) > 0 else None


def _old_values_heads_first(model: Any, layer: int) -> bool:
    from transformer_lens.model_bridge.generalized_components import MLAAttentionBridge

    blocks = getattr(model, "blocks", None)
    return blocks is not None and isinstance(getattr(blocks[layer], "attn", None), MLAAttentionBridge)


def _old_native_rotary(model: Any, layer: int) -> Any:
    rotary = getattr(getattr(model.blocks[layer].attn, "original_component", None), "rotary", None)
    return rotary if isinstance(getattr(rotary, "cos_cached", None), Tensor) else None


def _old_qk_refusal(model: Any, layer: int) -> str | None:
    cfg, attn = model.cfg, model.blocks[layer].attn
    hf = getattr(attn, "original_component", None)
    rope = getattr(getattr(hf, "config", None), "rope_parameters", None)
    forms = [
        (cfg.positional_embedding_type == "alibi" or "alibi" in type(attn).__name__.lower(), "ALiBi position biases"),
        (getattr(hf, "sinks", None) is not None, "learned attention-sink logits (an extra softmax column, GPT-OSS)"),
        (_old_values_heads_first(model, layer), "multi-head latent attention (compressed keys and values)"),
        (bool(getattr(cfg, "rotary_adjacent_pairs", False) or getattr(cfg, "rotary_interleaved_cos_sin", False)),
         "a rotary embedding on adjacent pairs (GLM, ERNIE, Cohere)"),
        (isinstance(rope, dict) and rope.get("llama_4_scaling_beta") is not None,
         "a position-dependent query scale (Llama 4 / Ministral 3)"),
        (bool(getattr(cfg, "qk_norm_after_rope", False)), "a q/k norm after the rotary embedding"),
        (getattr(attn, "_qk_norm_phase", None) == "pre_reshape", "a q/k norm over all heads together (OLMo 2)"),
        (bool(getattr(cfg, "scale_attn_by_inverse_layer_idx", False)) and not hasattr(hf, "scaling"),
         "scores scaled by the inverse layer index"),
    ]  # fmt: skip
    for applies, form in forms:
        if applies:
            return form
    if cfg.positional_embedding_type == "rotary" and f"blocks.{layer}.attn.hook_cos" not in model.hook_dict:
        if _old_native_rotary(model, layer) is None:
            return "a rotary embedding whose angles the bridge does not expose (no attn.hook_cos)"
    return None


def _old_qk_form(model: Any, layer: int) -> dict[str, Any]:
    attn = model.blocks[layer].attn
    hf = getattr(attn, "original_component", None)
    norms = {side: getattr(attn, f"{side}_norm", None) for side in ("q", "k")}
    d_head = int(attn.W_Q.shape[-1])
    scale = getattr(hf, "scaling", None)
    cap = getattr(hf, "attn_logit_softcapping", None)
    hooked = f"blocks.{layer}.attn.hook_cos" in model.hook_dict
    native = None if hooked or model.cfg.positional_embedding_type != "rotary" else _old_native_rotary(model, layer)

    def bias(name: str) -> bool:
        return isinstance(getattr(attn, name, None), Tensor)

    return {
        "b_Q": bias("b_Q"),
        "b_K": bias("b_K"),
        "q_norm": None if norms["q"] is None else _old_frozen_norm(norms["q"]),
        "k_norm": None if norms["k"] is None else _old_frozen_norm(norms["k"]),
        "rotary": model.cfg.positional_embedding_type == "rotary",
        "scale": float(d_head**-0.5 if scale is None else scale),
        "softcap": float(cap) if cap is not None and float(cap) > 0 else None,
        "rotary_adjacent": native is not None,
    }


def _old_ungrouping(attention: Any) -> dict[str, int] | None:
    module: Any = getattr(attention, "original_component", None)
    bridge = type(attention).__name__
    if bridge == "PositionEmbeddingsAttentionBridge" and isinstance(getattr(module, "num_key_value_groups", None), int):
        return {"num_key_value_groups": 1}
    if bridge == "AttentionBridge" and type(module).__name__ == "NativeAttention":
        return {"n_kv_heads": int(module.n_heads), "kv_repeats": 1}
    return None


def _old_key_norm_per_key_head(attention: Any) -> bool:
    per_key_head = getattr(attention, "_qk_norm_per_head", False)
    return bool(getattr(attention, "_qk_norm_phase", None) == "pre_reshape" or per_key_head)


def _old_skippable(block: Any) -> dict[str, bool]:
    def linear(module: Any) -> bool:
        return type(module).__name__ == "LinearBridge" and isinstance(
            getattr(module, "original_component", None), torch.nn.Linear
        )

    mlp = getattr(block, "mlp", None)
    original = type(getattr(mlp, "original_component", None)).__name__
    plain = type(mlp).__name__ in ("MLPBridge", "GatedMLPBridge", "JointGateUpMLPBridge") and original.endswith("MLP")
    return {"mlp": plain, **{side: linear(getattr(block.attn, side, None)) for side in "qkvo"}}


def _old_bos(model: Any) -> dict[str, Any]:
    tokenizer = getattr(model, "tokenizer", None)
    pad = None if tokenizer is None else tokenizer.pad_token_id
    if pad is None:
        pad = None if tokenizer is None else tokenizer.eos_token_id
    ids = (getattr(tokenizer, name, None) for name in ("bos_token_id", "cls_token_id"))
    return {
        "prepends_bos": bool(getattr(getattr(model, "cfg", None), "default_prepend_bos", True)),
        "bos_id": getattr(tokenizer, "bos_token_id", None),
        "start_ids": {int(i) for i in ids if isinstance(i, int)},
        "pad_id": 0 if pad is None else int(pad),
    }


def _old_layer(model: Any, layer: int) -> dict[str, Any]:
    names = model.hook_dict
    block = model.blocks[layer]
    v_norm = f"blocks.{layer}.attn.v_norm.hook_out"
    o_out = f"blocks.{layer}.attn.o.hook_out"
    facts: dict[str, Any] = {
        "value_hook": v_norm if v_norm in names else f"blocks.{layer}.attn.hook_v",
        "output_hook": o_out if o_out in names else f"blocks.{layer}.attn.hook_out",
        "values_heads_first": _old_values_heads_first(model, layer),
        "post_name": _old_post_name_readout(model, layer),
        "qk_refusal": _old_qk_refusal(model, layer),
        "ungrouping": _old_ungrouping(block.attn),
        "key_norm_per_key_head": _old_key_norm_per_key_head(block.attn),
        "skippable": _old_skippable(block),
    }
    name = facts["post_name"]
    facts["post_norm"] = None if name is None else _old_frozen_norm(block.get_submodule(name))
    for side in ("ln1", "ln2"):
        component = getattr(block, side, None)
        facts[side] = None if component is None else _old_frozen_norm(component)
    if getattr(block, "ln1", None) is not None:
        facts["ln1_rms"] = bool(getattr(block.ln1, "uses_rms_norm", False))
        facts["ln1_post_ln"] = _old_post_norm(model, layer)
        facts["ln1_closed"] = _old_closed_norm(block.ln1)
    if facts["qk_refusal"] is None:
        facts["qk_form"] = attempt(lambda: _old_qk_form(model, layer))
    return facts


def probed_facts(model: Any) -> dict[str, Any]:
    """Every fact the wiring reads of ``model``, as the adapter's modules probed it (each its own way)."""
    cfg, names = model.cfg, model.hook_dict
    n_heads = int(cfg.n_heads)
    unembed = getattr(model, "unembed", None)
    unembed_bias = getattr(getattr(unembed, "original_component", None), "bias", None)
    final = getattr(model, "ln_final", None)
    return {
        "name": _old_architecture_name(model),
        "causal": _old_causal(model),
        **_old_bos(model),
        "n_ctx": None if getattr(cfg, "n_ctx", None) is None else int(cfg.n_ctx),
        "d_vocab": getattr(cfg, "d_vocab", None),
        "n_layers": int(cfg.n_layers),
        "n_heads": n_heads,
        "n_kv_heads": int(getattr(cfg, "n_key_value_heads", None) or n_heads),
        "pos_embed_hook": "pos_embed.hook_out" in names,
        "learned_positions": cfg.positional_embedding_type == "standard" and "hook_pos_embed" in names,
        "rotary": cfg.positional_embedding_type == "rotary",
        "parallel_attn_mlp": bool(getattr(cfg, "parallel_attn_mlp", False)),
        "logit_softcap": _old_logit_softcap(model),
        "final_norm": None if final is None else _old_frozen_norm(final),
        "final_scale_hook": final is not None and "ln_final.hook_scale" in names,
        "unembedding": unembed is not None and "unembed.hook_out" in names,
        "unembedding_bias": isinstance(unembed_bias, Tensor),
        "cuts_unembedding": "unembed.hook_in" in names,
        "embed_norm": (
            _old_frozen_norm(model.embed_ln)
            if "embed_ln.hook_scale" in names and getattr(model, "embed_ln", None) is not None
            else None
        ),
        "layers": [_old_layer(model, layer) for layer in range(int(cfg.n_layers))],
    }


# --- the same facts, read through the adapter as it is ----------------------------------------------------


def _norm(norm: Any) -> dict[str, Any] | None:
    return None if norm is None else {"centre": norm.centre, "gain": norm.gain, "bias": norm.bias}


def _layer(model: Any, layer: int) -> dict[str, Any]:
    from contribution_lens.adapter import qk_wiring

    this = adapter.anatomy_of(model).layers[layer]
    facts: dict[str, Any] = {
        "value_hook": this.value_hook,
        "output_hook": this.output_hook,
        "values_heads_first": this.values_heads_first,
        "post_name": this.post_attention,
        "qk_refusal": qk_wiring._qk_refusal(model, layer),
        "ungrouping": this.ungrouping,
        "key_norm_per_key_head": this.qk_norm_over_heads or this.key_norm_per_key_head,
        "skippable": {part: part in this.skippable for part in ("mlp", "q", "k", "v", "o")},
        "post_norm": _norm(this.post_norm),
        "ln1": _norm(this.ln1),
        "ln2": _norm(this.ln2),
    }
    if this.ln1 is not None:
        facts["ln1_rms"] = not this.ln1.centre
        facts["ln1_post_ln"] = {"gain": this.ln1.gain, "bias": this.ln1.bias, "eps": this.ln1.eps}
        facts["ln1_closed"] = {"closed": this.ln1.closed, "module": this.ln1.module}
        if this.ln1.closed:
            facts["ln1_closed"].update(eps=this.ln1.eps, **_norm(this.ln1))
    if facts["qk_refusal"] is None:
        facts["qk_form"] = attempt(lambda: _qk_form(adapter.qk_form(model, layer)))
    return facts


def _qk_form(form: Any) -> dict[str, Any]:
    return {
        "b_Q": form.b_Q is not None,
        "b_K": form.b_K is not None,
        "q_norm": _norm(form.q_norm),
        "k_norm": _norm(form.k_norm),
        "rotary": form.rotary,
        "scale": form.scale,
        "softcap": form.softcap,
        "rotary_adjacent": form.rotary_adjacent,
    }


def read_facts(model: Any) -> dict[str, Any]:
    """The facts of `probed_facts`, read from the model's anatomy (`adapter.anatomy`) and the wiring that reads it."""
    facts = adapter.anatomy_of(model)
    readout = adapter.readout(model)
    return {
        "name": facts.name,
        "causal": attempt(lambda: facts.causal, ValueError, message_only=True),
        "prepends_bos": facts.prepends_bos,
        "bos_id": facts.bos_id(),
        "start_ids": facts.start_ids(),
        "pad_id": facts.pad_id(),
        "n_ctx": facts.n_ctx,
        "d_vocab": facts.d_vocab,
        "n_layers": facts.n_layers,
        "n_heads": facts.n_heads,
        "n_kv_heads": facts.n_kv_heads,
        "pos_embed_hook": adapter.layout(model).pos_embed,
        "learned_positions": bool(adapter.embedding_hooks(model, adapter.QKPlan(0, False, (), False, ()), {})),
        "rotary": facts.positions == "rotary",
        "parallel_attn_mlp": facts.parallel_attn_mlp,
        "logit_softcap": facts.logit_softcap,
        "final_norm": _norm(facts.final_norm),
        "final_scale_hook": readout.final_scale_hook,
        "unembedding": facts.unembedding,
        "unembedding_bias": facts.unembedding_bias,
        "cuts_unembedding": readout.cuts_unembedding,
        "embed_norm": _norm(facts.embed_norm),
        "layers": [_layer(model, layer) for layer in range(facts.n_layers)],
    }


def attempt(read: Any, errors: Any = Exception, *, message_only: bool = False, none: bool = False) -> Any:
    """``read()``, or what it raised as ``"Type: message"`` (``message_only``: the message; ``none``: None)."""
    try:
        return read()
    except errors as error:
        return None if none else str(error) if message_only else f"{type(error).__name__}: {error}"


_BLOOM = (
    "hook_attn_out is attn.o.hook_out, the o-projection itself (Bloom's attention adds the residual stream "
    "inside): no norm follows the attention. The readout took attn.o for one and failed, the circuit wiring "
    "took none; the anatomy holds none"
)
_NO_WEIGHT = (
    "forms.post_norm read ln1's weight and raised AttributeError on a norm without one (an Identity, an "
    "affine-free LayerNorm or RMSNorm); the anatomy reads it as a norm without a gain (a pre-LN block: ALTI "
    "never reads it)"
)
CORRECTED: dict[str, tuple[tuple[str, ...], str]] = {
    "BloomForCausalLM": (
        ("layers.0.post_name", "layers.0.post_norm", "layers.1.post_name", "layers.1.post_norm"),
        _BLOOM,
    ),
    "BloomModel": (("layers.0.post_name", "layers.0.post_norm", "layers.1.post_name", "layers.1.post_norm"), _BLOOM),
    "ModernBertDecoderForCausalLM": (("layers.0.ln1_post_ln",), _NO_WEIGHT),
    "NanoChatForCausalLM": (("layers.0.ln1_post_ln", "layers.1.ln1_post_ln"), _NO_WEIGHT),
    "OlmoForCausalLM": (("layers.0.ln1_post_ln", "layers.1.ln1_post_ln"), _NO_WEIGHT),
}
"""Where the anatomy holds another reading than the oracle's: the facts (keys of `differences`), and why. The
first is a fact on which the adapter's modules disagreed; the second a probe that failed where a fact exists."""


def corrected(name: str) -> list[str]:
    """The fact keys of `differences` on which ``name``'s anatomy is meant to differ from the oracle."""
    return sorted(CORRECTED.get(name, ((), ""))[0])


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return isinstance(a, Tensor) and isinstance(b, Tensor) and a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.nn.Module) or isinstance(b, torch.nn.Module):
        return a is b
    return type(a) is type(b) and a == b


def differences(expected: dict[str, Any], actual: dict[str, Any], where: str = "") -> list[str]:
    """The keys (``layers.3.post_norm``) on which two fact tables differ."""
    found = []
    for key in sorted(expected.keys() | actual.keys()):
        path = f"{where}{key}"
        a, b = expected.get(key, "<absent>"), actual.get(key, "<absent>")
        if isinstance(a, dict) and isinstance(b, dict) and key != "ungrouping":
            found += differences(a, b, path + ".")
        elif key == "layers" and isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            for index, (x, y) in enumerate(zip(a, b, strict=True)):
                found += differences(x, y, f"{path}.{index}.")
        elif not _same(a, b):
            found.append(path)
    return found
