"""Slow float64 oracle of the QK split: materialises every residual component in ``d_model`` and every pair.

Deliberately the naive way, from a full ``run_with_cache``: each component ``x^c`` is built as a
``[pos d_model]`` vector (the heads as ``z^h W_O^h``), carried through every norm with its scale
frozen (read from the norm's own ``hook_scale``), projected by ``W_Q``/``W_K``, normed per head,
rotated by transformers' own ``apply_rotary_pos_emb`` and paired: ``[A B query key]`` holds
``scale <q_i^a, k_j^b>`` for every query component ``a`` and key component ``b``. Each step is
checked against the model's own hook (the stream against ``hook_resid_pre``, the normed input
against ``ln1.hook_out``, ``q`` against ``hook_q``, the scores against ``hook_attn_scores``), so
the oracle cannot drift from the model it describes. The package must agree with it.
"""

from dataclasses import dataclass

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from conftest import assert_close

Components = dict[str, torch.Tensor]


@dataclass
class OraclePairs:
    query_components: list[str]
    key_components: list[str]
    pairs: torch.Tensor
    """``[A B query key]`` float64: ``scale <q_i^a, k_j^b>``."""
    scores: torch.Tensor
    """``[query key]``: the model's own pre-softmax scores (after any soft-cap)."""


def _norm_parts(module) -> tuple[bool, torch.Tensor | None, torch.Tensor | None]:
    """(centre, gain, bias) of a norm bridge, in float64, as the model applies it."""
    inner = module.original_component
    rms = "RMS" in type(inner).__name__ or getattr(module, "uses_rms_norm", False)
    weight = inner.weight.detach().double() if getattr(inner, "weight", None) is not None else None
    if weight is not None and getattr(module, "uses_weight_offset", False):
        weight = weight + 1
    bias = getattr(inner, "bias", None)
    return (not rms), weight, None if bias is None or rms else bias.detach().double()


def _through(components: Components, module, scale: torch.Tensor, bias_name: str | None) -> Components:
    """Every component through a norm frozen at ``scale`` ``[... 1]``: ``P(x) g / s``, the norm's bias a component."""
    centre, gain, bias = _norm_parts(module)
    out = {}
    for name, value in components.items():
        value = value - value.mean(-1, keepdim=True) if centre else value
        value = value / scale
        out[name] = value * gain if gain is not None else value
    if bias is not None and bias_name is not None:
        out[bias_name] = bias.expand_as(next(iter(out.values())))
    return out


def _total(components: Components) -> torch.Tensor:
    return torch.stack(list(components.values())).sum(0)


def _embedding(model, cache, post_ln: bool) -> Components:
    get = lambda name: cache[name][0].double()  # noqa: E731
    if "embed_ln.hook_scale" in cache:
        parts = {n: get(h) for n, h in [("embed", "embed.hook_out"), ("pos_embed", "pos_embed.hook_out"),
                                        ("token_type_embed", "token_type_embed.hook_out")] if h in cache}  # fmt: skip
        return _through(parts, model.embed_ln, get("embed_ln.hook_scale"), "embed_ln.b")
    first = get("blocks.0.hook_resid_pre")
    if model.cfg.positional_embedding_type == "standard" and "hook_pos_embed" in cache:
        return {"embed": first - get("hook_pos_embed"), "pos_embed": get("hook_pos_embed")}
    return {"embed": first}


def _block(model, cache, m: int, stream: Components, post_ln: bool) -> Components:
    get = lambda name: cache[name][0].double()  # noqa: E731
    attn = model.blocks[m].attn
    z, W_O = get(f"blocks.{m}.attn.hook_z"), attn.W_O.detach().double()
    written = {f"L{m}H{h}": z[:, h] @ W_O[h] for h in range(W_O.shape[0])}
    if getattr(attn, "b_O", None) is not None:
        written[f"L{m}.b_O"] = attn.b_O.detach().double().expand(z.shape[0], -1)
    if post_ln:
        block = model.blocks[m]
        stream = _through({**stream, **written}, block.ln1, get(f"blocks.{m}.ln1.hook_scale"), f"L{m}.ln1.b")
        stream[f"L{m}.mlp"] = get(f"blocks.{m}.hook_mlp_out")
        return _through(stream, block.ln2, get(f"blocks.{m}.ln2.hook_scale"), f"L{m}.ln2.b")
    if f"blocks.{m}.ln1_post.hook_scale" in cache:  # Gemma: the attention output is normed before the sum
        written = _through(written, model.blocks[m].ln1_post, get(f"blocks.{m}.ln1_post.hook_scale"), None)
    update = get(f"blocks.{m}.hook_resid_post") - get(f"blocks.{m}.hook_resid_pre")
    return {**stream, **written, f"L{m}.mlp": update - get(f"blocks.{m}.hook_attn_out")}


def _rotated(model, cache, layer: int, side: torch.Tensor) -> torch.Tensor:
    """``[component pos d_head]`` rotated with the layer's own angles by transformers' rotate-half formula.

    TransformerLens's native attention has no ``hook_cos``: its own ``apply_rope`` turns the parts.
    """
    if f"blocks.{layer}.attn.hook_cos" not in cache:
        turned, _ = model.blocks[layer].attn.original_component.rotary.apply_rope(side[:, None], side[:, None])
        return turned[:, 0]
    cos, sin = cache[f"blocks.{layer}.attn.hook_cos"][0].double(), cache[f"blocks.{layer}.attn.hook_sin"][0].double()
    width = cos.shape[-1]
    turned, _ = apply_rotary_pos_emb(side[:, None, :, :width], side[:, None, :, :width], cos[None], sin[None])
    return torch.cat([turned[:, 0], side[..., width:]], dim=-1)


def oracle_pairs(model, ids: torch.Tensor, layer: int, head: int, *, post_ln: bool = False) -> OraclePairs:
    """Every ``scale <q_i^a, k_j^b>`` of ``layer``'s ``head`` on ``ids`` (a batch of one), in float64."""
    _, cache = model.run_with_cache(ids[None])
    get = lambda name: cache[name][0].double()  # noqa: E731
    stream = _embedding(model, cache, post_ln)
    for m in range(layer):
        stream = _block(model, cache, m, stream, post_ln)
    assert_close(_total(stream), get(f"blocks.{layer}.hook_resid_pre"), rtol=1e-4, atol=1e-4)
    attn = model.blocks[layer].attn
    if not post_ln:
        stream = _through(stream, model.blocks[layer].ln1, get(f"blocks.{layer}.ln1.hook_scale"), f"L{layer}.ln1.b")
        assert_close(_total(stream), get(f"blocks.{layer}.ln1.hook_out"), rtol=1e-4, atol=1e-4)
    group = attn.W_Q.shape[0] // attn.W_K.shape[0]
    sides = {}
    for side, weights, bias, kv in (("q", attn.W_Q, attn.b_Q, head), ("k", attn.W_K, attn.b_K, head // group)):
        parts = {name: value @ weights[kv].detach().double() for name, value in stream.items()}
        if bias is not None:
            parts[f"b_{side.upper()}"] = bias[kv].detach().double().expand(ids.shape[0], -1)
        assert_close(_total(parts), get(f"blocks.{layer}.attn.hook_{side}")[:, kv], rtol=1e-4, atol=1e-4)
        stacked = torch.stack(list(parts.values()))  # [component pos d_head]
        norm = getattr(attn, f"{side}_norm", None)
        if norm is not None:
            _, gain, _ = _norm_parts(norm)
            stacked = stacked * gain / get(f"blocks.{layer}.attn.{side}_norm.hook_scale")[kv]
        if model.cfg.positional_embedding_type == "rotary":
            stacked = _rotated(model, cache, layer, stacked)
        sides[side] = (list(parts), stacked)
    scale = getattr(attn.original_component, "scaling", None) or attn.W_Q.shape[-1] ** -0.5
    pairs = scale * torch.einsum("aid,bjd->abij", sides["q"][1], sides["k"][1])
    return OraclePairs(sides["q"][0], sides["k"][0], pairs, get(f"blocks.{layer}.attn.hook_attn_scores")[head])
