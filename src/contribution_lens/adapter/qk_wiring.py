"""QK attribution's wiring: what one layer's scores read, and every component of the residual stream."""

from dataclasses import dataclass

import torch
from jaxtyping import Float
from torch import Tensor

from contribution_lens.adapter._model import HookFn, Model
from contribution_lens.adapter.anatomy import (
    ATTN_OUT,
    EMBED_NORM_SCALE,
    EMBED_PARTS,
    LN1_SCALE,
    LN2_SCALE,
    MLP_OUT,
    POS_EMBED,
    QK_COS,
    QK_K,
    QK_NORM_SCALES,
    QK_Q,
    QK_SCORES,
    QK_SIN,
    RESID_POST,
    RESID_PRE,
    SCALE,
    Norm,
    anatomy_of,
    block_hook,
)
from contribution_lens.adapter.forms import POST_LN, PRE_LN, block_forms
from contribution_lens.adapter.hooks import LayerInputs
from contribution_lens.adapter.logit_readout import residual_capture

# --- QK attribution: what one layer's scores read, and every component of the residual stream -----
#
# Layer ``l``'s query and key are linear in the residual stream ``x`` entering it, once every norm's
# scale is frozen at its value in this pass: the pre-attention norm ``ln1`` (``hook_scale``),
# ``W_Q``/``W_K`` with ``b_Q``/``b_K``, a per-head q/k norm (``attn.q_norm``, ``attn.k_norm``), the
# rotary embedding (``attn.hook_cos``/``hook_sin``), the scale (``query_pre_attn_scalar`` in Gemma).
# ``x`` is written by the embedding and by every earlier block: its heads (``z^h W_O^h``, through a
# post-attention norm where there is one), ``b_O``, its MLP (``hook_resid_post - hook_resid_pre -
# hook_attn_out``). In a post-LN block (BERT) the whole stream passes ``ln1`` and ``ln2``: those are
# *stream norms*, each adding its bias as a component. `qk_plan` says which, `layer_writes` hands
# each block's components over as they are produced, `target_reads` reads what the target layer did.


@dataclass(frozen=True)
class QKForm:
    """How layer ``layer`` turns the residual stream into its scores ``s = scale <q, k>``.

    ``W_Q`` ``[head d_model d_head]`` and ``W_K`` ``[kv_head d_model d_head]`` (fewer key heads under
    GQA: query head ``h`` reads key head ``h // (head / kv_head)``), their biases (None where absent),
    the per-head q/k norms (None where absent; their scale is frozen per head and position), whether
    the rotary embedding applies, ``scale`` and the soft-cap ``c`` of ``c tanh(s / c)`` (Gemma 2).
    """

    layer: int
    W_Q: Float[Tensor, "head d_model d_head"]
    b_Q: Float[Tensor, "head d_head"] | None
    W_K: Float[Tensor, "kv_head d_model d_head"]
    b_K: Float[Tensor, "kv_head d_head"] | None
    q_norm: Norm | None
    k_norm: Norm | None
    rotary: bool
    scale: float
    softcap: float | None
    causal: bool
    architecture: str
    rotary_adjacent: bool = False
    """Rotary pairs are ``(0, 1), (2, 3), ...`` (TransformerLens's native attention), not the two halves."""
    rotary_tables: tuple[Tensor, Tensor] | None = None
    """``cos``/``sin`` ``[position rotary]`` where the bridge has no ``hook_cos`` (native attention's own tables)."""

    @property
    def group(self) -> int:
        """Query heads per key head (1 without GQA)."""
        return self.W_Q.shape[0] // self.W_K.shape[0]


def _qk_refusal(model: Model, layer: int) -> str | None:
    """The attention form of ``layer`` whose scores cannot be split here, in words, or None."""
    facts = anatomy_of(model)
    this = facts.layers[layer]
    forms = [
        (this.alibi, "ALiBi position biases"),
        (this.sinks, "learned attention-sink logits (an extra softmax column, GPT-OSS)"),
        (this.values_heads_first, "multi-head latent attention (compressed keys and values)"),
        (facts.rotary_adjacent_pairs, "a rotary embedding on adjacent pairs (GLM, ERNIE, Cohere)"),
        (this.query_scale_by_position, "a position-dependent query scale (Llama 4 / Ministral 3)"),
        (facts.qk_norm_after_rope, "a q/k norm after the rotary embedding"),
        (this.qk_norm_over_heads, "a q/k norm over all heads together (OLMo 2)"),
        (this.scale_by_inverse_layer, "scores scaled by the inverse layer index"),
    ]
    for applies, form in forms:
        if applies:
            return form
    hooked = block_hook(layer, QK_COS) in facts.hook_names
    if facts.positions == "rotary" and not hooked and this.native_rotary is None:
        return "a rotary embedding whose angles the bridge does not expose (no attn.hook_cos)"
    return None


def qk_form(model: Model, layer: int) -> QKForm:
    """`QKForm` of ``layer``, read from the model now; a form that cannot be split is refused, naming it."""
    facts = anatomy_of(model)
    problem = _qk_refusal(model, layer)
    if problem is not None:
        raise ValueError(
            f"qk_attribution cannot split the scores of {facts.name} layer {layer}: its attention "
            f"uses {problem}, which is not a sum of per-component terms this adapter reads"
        )
    this = facts.layers[layer]
    attn = model.blocks[layer].attn
    d_head = int(attn.W_Q.shape[-1])
    rotary = facts.positions == "rotary"
    native = None if block_hook(layer, QK_COS) in facts.hook_names or not rotary else this.native_rotary

    def bias(name: str) -> Tensor | None:
        value = getattr(attn, name, None)
        return value.detach() if isinstance(value, Tensor) else None

    return QKForm(
        layer=layer,
        W_Q=attn.W_Q.detach(),
        b_Q=bias("b_Q"),
        W_K=attn.W_K.detach(),
        b_K=bias("b_K"),
        q_norm=this.q_norm,
        k_norm=this.k_norm,
        rotary=rotary,
        scale=float(d_head**-0.5 if this.scale is None else this.scale),
        softcap=this.softcap,
        causal=facts.causal,
        architecture=facts.name,
        rotary_adjacent=native is not None,
        rotary_tables=None if native is None else (native.cos_cached.detach(), native.sin_cached.detach()),
    )


@dataclass(frozen=True)
class StreamNorm:
    """A norm the whole residual stream passes between a component's write and layer ``l``'s projections.

    ``name`` prefixes its bias component (``f"{name}.b"``); its scale is frozen per position.
    """

    name: str
    norm: Norm


@dataclass(frozen=True)
class QKPlan:
    """Which stream norms lie between the components and the target layer, and what the pass captures.

    ``norms`` in forward order: ``embed_ln`` where the embedding is normed (BERT), then, in post-LN
    blocks, every earlier layer's ``ln1`` and ``ln2``, and last the target layer's own pre-attention
    norm (pre-LN). A component written at *stage* ``t`` passes ``norms[t:]``.
    """

    layer: int
    post_ln: bool
    norms: tuple[StreamNorm, ...]
    embed_norm: bool
    capture: tuple[str, ...]

    def block_stage(self, layer: int) -> int:
        """The stage of layer ``layer``'s attention writes (its MLP's is one more in post-LN blocks)."""
        offset = int(self.embed_norm)
        return offset + 2 * layer if self.post_ln else offset


_PRE_FORMS = (PRE_LN, "parallel attention and MLP", "pre-LN with a norm on the attention output")


def qk_plan(model: Model, layer: int) -> QKPlan:
    """The `QKPlan` of the residual stream entering ``layer``; refuses a block form it cannot follow.

    Reads the block forms (`block_forms`, a probe pass the first time): call it before any pass.
    """
    forms = block_forms(model)
    facts = anatomy_of(model)
    kinds = set()
    for earlier in range(layer + 1):
        form = forms[earlier]
        if form == POST_LN:
            kinds.add("post")
        elif form.startswith(_PRE_FORMS):
            kinds.add("pre")
        else:
            raise ValueError(
                f"qk_attribution cannot follow the residual stream of {facts.name}: layer {earlier} is {form}"
            )
    post = kinds == {"post"}
    if len(kinds) > 1:
        raise ValueError(f"qk_attribution cannot follow {facts.name}: it mixes pre-LN and post-LN blocks")
    names, this = facts.hook_names, facts.layers[layer]
    embed_norm = facts.embed_norm is not None
    norms = [_stream_norm("embed_ln", facts.embed_norm)] if embed_norm else []
    if post:
        for earlier in range(layer):
            block = facts.layers[earlier]
            norms += [_stream_norm(f"L{earlier}.ln1", block.ln1), _stream_norm(f"L{earlier}.ln2", block.ln2)]
    elif this.ln1 is not None and block_hook(layer, LN1_SCALE) in names:
        norms.append(_stream_norm(f"L{layer}.ln1", this.ln1))
    capture = [*residual_capture(model), QK_SCORES, QK_Q, QK_K]
    capture += [LN1_SCALE, LN2_SCALE, MLP_OUT] if post else ([LN1_SCALE] if norms[int(embed_norm) :] else [])
    rotary = facts.positions == "rotary" and block_hook(layer, QK_COS) in names
    capture += [QK_COS, QK_SIN] if rotary else []
    capture += [QK_NORM_SCALES[side] for side, norm in (("q", this.q_norm), ("k", this.k_norm)) if norm is not None]
    return QKPlan(layer, post, tuple(norms), embed_norm, tuple(dict.fromkeys(capture)))


def _stream_norm(name: str, norm: Norm | None) -> StreamNorm:
    if norm is None:
        raise ValueError(f"qk_attribution cannot follow the residual stream: {name} is not a norm this adapter reads")
    return StreamNorm(name, norm)


def embedding_hooks(model: Model, plan: QKPlan, store: dict[str, Tensor]) -> list[tuple[str, HookFn]]:
    """Hooks keeping the embedding's parts (batch element 0) in ``store``: what `embedding_writes` reads.

    With an embedding norm: the word, position and token-type embeddings before it, and its scale;
    else the learned position embedding where the model has one (``hook_pos_embed``).
    """

    def keep(key: str) -> HookFn:
        return lambda tensor, hook: store.__setitem__(key, tensor.detach()[0])

    facts = anatomy_of(model)
    if plan.embed_norm:
        hooks = [(hook, keep(part)) for part, hook in EMBED_PARTS.items() if hook in facts.hook_names]
        return [*hooks, (EMBED_NORM_SCALE, keep("embed_ln.scale"))]
    if facts.positions == "learned" and POS_EMBED in facts.hook_names:
        return [(POS_EMBED, keep("pos_embed"))]
    return []


@dataclass(frozen=True)
class Write:
    """Components written into the residual stream, as produced: each passes ``plan.norms[stage:]``.

    ``value`` is ``[pos d_model]`` (or ``[d_model]``, the same at every position: a bias), one
    component named ``names[0]``; or, with ``W_O``, the heads' ``z`` ``[pos head d_head]``, one
    component ``z^h W_O^h`` per head, named ``names[h]``. ``norm`` is a norm of these components
    alone before they join the stream (Gemma's post-attention norm) with its ``scale`` ``[pos]``.
    """

    names: tuple[str, ...]
    value: Tensor
    stage: int
    W_O: Float[Tensor, "head d_head d_model"] | None = None
    norm: Norm | None = None
    scale: Float[Tensor, " pos"] | None = None


def embedding_writes(model: Model, plan: QKPlan, layer: LayerInputs, store: dict[str, Tensor]) -> list[Write]:
    """The embedding's components (given layer 0's `LayerInputs`): ``embed``, ``pos_embed``, ..., its norm's bias."""
    if plan.embed_norm:
        writes = [Write((part,), store[part], 0) for part in EMBED_PARTS if part in store]
        bias = plan.norms[0].norm.bias
        return writes + ([Write(("embed_ln.b",), bias, 1)] if bias is not None else [])
    first = layer.captured[RESID_PRE][0]
    if "pos_embed" in store:
        return [Write(("embed",), first - store["pos_embed"], 0), Write(("pos_embed",), store["pos_embed"], 0)]
    return [Write(("embed",), first, 0)]


def layer_writes(model: Model, plan: QKPlan, layer: LayerInputs) -> list[Write]:
    """What block ``layer.layer`` (before the target) writes into the stream: heads, ``b_O``, norm biases, MLP."""
    m, stage = layer.layer, plan.block_stage(layer.layer)
    heads = tuple(f"L{m}H{h}" for h in range(layer.W_O.shape[0]))
    z = layer.z if layer.z is not None else None
    if z is None:
        raise ValueError(f"layer {m} of {anatomy_of(model).name} has no hook_z: its heads' outputs cannot be read")
    pre, post = layer.captured[RESID_PRE][0], layer.captured[RESID_POST][0]
    if plan.post_ln:
        # y = LN2(LN1(x + o) + mlp): the heads and b_O pass ln1 then ln2; ln1's bias and the MLP pass ln2.
        writes = [Write(heads, z[0], stage, W_O=layer.W_O)]
        writes += [Write((f"L{m}.b_O",), layer.b_O, stage)] if layer.b_O is not None else []
        writes += _bias_writes(plan.norms[stage], stage + 1)
        writes.append(Write((f"L{m}.mlp",), layer.captured[MLP_OUT][0], stage + 1))
        return writes + _bias_writes(plan.norms[stage + 1], stage + 2)
    this = anatomy_of(model).layers[m]
    norm, name = this.post_norm, this.post_attention
    own = None if name is None else layer.captured[f"{name}.{SCALE}"][0].reshape(-1)
    writes = [Write(heads, z[0], stage, W_O=layer.W_O, norm=norm, scale=own)]
    writes += [Write((f"L{m}.b_O",), layer.b_O, stage, norm=norm, scale=own)] if layer.b_O is not None else []
    bias = None if norm is None else norm.bias
    if bias is not None:
        writes.append(Write((f"L{m}.{name}.b",), bias, stage))
    mlp = post - pre - layer.captured[ATTN_OUT][0]
    return [*writes, Write((f"L{m}.mlp",), mlp, stage)]


def _bias_writes(norm: StreamNorm, stage: int) -> list[Write]:
    return [] if norm.norm.bias is None else [Write((f"{norm.name}.b",), norm.norm.bias, stage)]


def stream_scales(plan: QKPlan, layer: LayerInputs, store: dict[str, Tensor]) -> dict[int, Tensor]:
    """The frozen scales ``[pos]`` of the stream norms this layer's hooks caught, by their index in ``plan.norms``."""
    scales: dict[int, Tensor] = {}
    if plan.embed_norm and layer.layer == 0:
        scales[0] = store["embed_ln.scale"].reshape(-1)
    if plan.post_ln and layer.layer < plan.layer:
        stage = plan.block_stage(layer.layer)
        scales[stage] = layer.captured[LN1_SCALE][0].reshape(-1)
        scales[stage + 1] = layer.captured[LN2_SCALE][0].reshape(-1)
    elif not plan.post_ln and layer.layer == plan.layer and len(plan.norms) > int(plan.embed_norm):
        scales[len(plan.norms) - 1] = layer.captured[LN1_SCALE][0].reshape(-1)
    return scales


def target_writes(plan: QKPlan) -> list[Write]:
    """The target layer's pre-attention norm's bias (a component after every stream norm), where it has one."""
    if plan.post_ln or len(plan.norms) == int(plan.embed_norm):
        return []
    return _bias_writes(plan.norms[-1], len(plan.norms))


@dataclass(frozen=True)
class TargetReads:
    """What the target layer computed in this pass, for one batch element.

    ``scores`` ``[head query key]`` are the model's own pre-softmax scores (after any soft-cap, masked
    keys at the dtype's minimum or ``-inf``), None where the bridge fires ``hook_attn_scores`` with the
    pattern instead (it delegates attention: BERT); then ``q``/``k`` ``[pos head d_head]`` are its own
    projections (``hook_q``/``hook_k``). ``q_scale``/``k_scale`` ``[head pos]``: the q/k norms' scales.
    """

    pattern: Float[Tensor, "head query key"]
    scores: Float[Tensor, "head query key"] | None
    q: Float[Tensor, "pos head d_head"]
    k: Float[Tensor, "pos kv_head d_head"]
    cos: Float[Tensor, "pos rotary"] | None
    sin: Float[Tensor, "pos rotary"] | None
    q_scale: Float[Tensor, "head pos"] | None
    k_scale: Float[Tensor, "kv_head pos"] | None


def target_reads(layer: LayerInputs, form: QKForm) -> TargetReads:
    """`TargetReads` from the target layer's `LayerInputs` (captured with ``qk_plan(...).capture``)."""
    got = layer.captured
    pattern = layer.pattern[0]
    length = pattern.shape[-1]
    tables = form.rotary_tables
    cos = got[QK_COS][0] if QK_COS in got else None if tables is None else tables[0][:length]
    sin = got[QK_SIN][0] if QK_SIN in got else None if tables is None else tables[1][:length]
    scores = got[QK_SCORES][0]
    delegated = scores.shape != pattern.shape or torch.equal(scores, pattern)

    def norm_scale(side: str) -> Tensor | None:
        scale = got.get(QK_NORM_SCALES[side])
        return None if scale is None else scale[0].reshape(scale.shape[1], scale.shape[2])

    return TargetReads(
        pattern=pattern,
        scores=None if delegated else scores,
        q=got[QK_Q][0],
        k=got[QK_K][0],
        cos=cos,
        sin=sin,
        q_scale=norm_scale("q"),
        k_scale=norm_scale("k"),
    )
