"""A model's anatomy: every fact the adapter's wiring reads of a model, read once (`anatomy_of`, `Anatomy`).

The other modules of the adapter read a model's facts here instead of probing the model: its norms (one
type, `Norm`, for the pre-attention, pre-MLP, post-attention, q/k, embedding and final norms: where each
is, whether it centres, its gain convention and its epsilon), the soft-caps (the attention scores' and
the final logits'), the architecture's name, its sizes, the positional scheme and what the QK split needs
of it, the attention's form (causal or bidirectional, query and key heads, the values' layout, the scores'
scale), the hook names the bridge has, and the BOS convention. A new architecture's quirk is one fact
here, read where the others are read, and every module that needs it finds it in the same place.

What is kept, and what is not. ``anatomy_of(model)`` is built the first time it is asked for and kept on the
model (``model.__dict__``, so a copy of the model copies it with its modules); each of its facts is read
on first use, then kept. It keeps facts, never weights: a `Norm` keeps its module and reads its gain and
bias from it whenever they are asked for, and every weight matrix is read by the code that uses it, at
the call, so a weight edited between two calls (in place, or replaced by a new ``Parameter``) is seen by
the second. The tokenizer's special ids are read from the tokenizer when asked (`bos_id`, `start_ids`,
`pad_id`): a pad token set after loading is seen.

The hook names every module uses are the constants below (a layer's relative to its block, `block_hook`).
"""

from collections.abc import Collection
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from jaxtyping import Float
from torch import Tensor, nn

from contribution_lens.adapter._model import Model

# --- hook names: a layer's relative to ``blocks.{l}`` (`block_hook`), the others from the model's root -------

RESID_PRE = "hook_resid_pre"
"""The residual stream entering a block, as a ``capture`` name (relative to ``blocks.{l}``)."""
RESID_MID = "hook_resid_mid"
RESID_POST = "hook_resid_post"
ATTN_OUT = "hook_attn_out"
MLP_OUT = "hook_mlp_out"
PATTERN = "attn.hook_pattern"
VALUES = "attn.hook_v"
NORMED_VALUES = "attn.v_norm.hook_out"
"""The values after a norm of each value head (Gemma 3n and 4), where the bridge has it (`Layer.value_hook`)."""
Z = "attn.hook_z"
O_OUT = "attn.o.hook_out"
"""The o-projection's output ``sum_h z^h W_O^h + b_O``, before any norm (`Layer.output_hook`)."""
ATTN_HOOK_OUT = "attn.hook_out"
QK_SCORES = "attn.hook_attn_scores"
QK_Q, QK_K, QK_V = "attn.hook_q", "attn.hook_k", "attn.hook_v"
ROTATED_Q, ROTATED_K = "attn.hook_rot_q", "attn.hook_rot_k"
"""The queries and keys after the rotary embedding, where the bridge rotates them (what the pattern is made of)."""
QK_COS, QK_SIN = "attn.hook_cos", "attn.hook_sin"
QK_NORM_SCALES = {"q": "attn.q_norm.hook_scale", "k": "attn.k_norm.hook_scale"}
LN1_IN, LN1_OUT, LN1_SCALE = "ln1.hook_in", "ln1.hook_out", "ln1.hook_scale"
LN2_IN, LN2_SCALE = "ln2.hook_in", "ln2.hook_scale"
SCALE = "hook_scale"
"""A norm's scale ``sigma`` at each position, relative to the norm (``ln1_post.hook_scale``)."""
NORM_OUT = "hook_out"
EMBED_PARTS = {
    "embed": "embed.hook_out",
    "pos_embed": "pos_embed.hook_out",
    "token_type_embed": "token_type_embed.hook_out",
}
"""The embedding's parts and their hooks (learned positions and token types where the model has them)."""
EMBED_NORM_SCALE = "embed_ln.hook_scale"
POS_EMBED = "hook_pos_embed"
FINAL_IN, FINAL_SCALE = "ln_final.hook_in", "ln_final.hook_scale"
UNEMBED_IN, UNEMBED_OUT = "unembed.hook_in", "unembed.hook_out"


def block_hook(layer: int, name: str) -> str:
    """``blocks.{layer}.{name}``: a layer's hook from its relative name (`RESID_PRE`, `PATTERN`, ...)."""
    return f"blocks.{layer}.{name}"


# --- one normalisation -------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Norm:
    """One normalisation of the model: ``N(x) = P(x) * g / sigma + b``, ``sigma = sqrt(mean(P(x)^2) + eps)``.

    ``P`` subtracts the mean over ``d_model`` (LayerNorm, ``centre``) or is the identity (RMSNorm). The
    gain ``g = offset + w`` is the module's weight ``w`` as the norm applies it (``offset`` 1 for Gemma's
    ``1 + w``, 0 otherwise), None where the norm has none; ``b`` its bias, None where it has none; ``eps``
    the module's own epsilon, else the model's (``cfg.eps``). With the scale ``sigma`` frozen at a
    position (the norm's ``hook_scale`` in a pass), ``N`` is affine (`linear`, `pull_back`, `apply`);
    `normalise` computes ``sigma`` itself. The same type serves every norm: before the attention and the
    MLP (``ln1``, ``ln2``), after the attention (Gemma's ``ln1_post``), on q and k, on the embedding, last.

    The facts are kept; ``g`` and ``b`` are read from ``module`` whenever they are asked for (`gain`,
    `bias`), so a weight edited since the norm was read is seen. `Norm.fixed` makes one of given tensors.

    Example:
        >>> import torch
        >>> norm = Norm.fixed(centre=True, gain=torch.tensor([2.0, 2.0]), bias=torch.tensor([1.0, 0.0]))
        >>> norm.apply(torch.tensor([3.0, 1.0]), torch.tensor(2.0)).tolist()
        [2.0, -1.0]
    """

    centre: bool
    eps: float | None = None
    offset: float = 0.0
    module: Any = field(default=None, repr=False)
    """The module holding ``weight`` and ``bias`` (and computing ``N``: the circuit wiring calls it)."""
    gained: bool = False
    """Whether the module's weight is the gain (TransformerLens's folded ``*PreBridge`` norms have none)."""
    biased: bool = False
    """Whether the module's bias is added (never by an RMSNorm)."""
    closed: bool = False
    """Whether ``module`` computes exactly this formula with ``eps`` (a ``torch.nn.LayerNorm``, a Hugging Face
    ``*RMSNorm`` with its own epsilon): the circuit wiring takes its products in closed form."""

    @classmethod
    def fixed(
        cls,
        centre: bool,
        gain: Float[Tensor, " d_model"] | None = None,
        bias: Float[Tensor, " d_model"] | None = None,
        eps: float | None = None,
    ) -> "Norm":
        """A norm of the given gain and bias (no module of a model behind it)."""
        return cls(centre, eps, 0.0, _Fixed(gain, bias), gain is not None, bias is not None)

    @property
    def gain(self) -> Float[Tensor, " d_model"] | None:
        """``g = offset + w``, read from the module now (None: no gain)."""
        if not self.gained:
            return None
        weight = self.module.weight.detach()
        return weight + self.offset if self.offset else weight

    @property
    def bias(self) -> Float[Tensor, " d_model"] | None:
        """``b``, read from the module now (None: no bias)."""
        return self.module.bias.detach() if self.biased else None

    def pull_back(
        self, direction: Float[Tensor, "*rows d_model"], scale: Float[Tensor, "*rows"]
    ) -> Float[Tensor, "*rows d_model"]:
        """The direction ``P(g * u) / sigma`` in the norm's input space that reads the same as ``u`` read its output.

        ``<N(x), u> = <x, pull_back(u, sigma)> + <b, u>``: the adjoint of ``P`` is ``P``.
        """
        gain = self.gain
        if gain is not None:
            direction = direction * gain.to(direction.dtype)
        if self.centre:
            direction = direction - direction.mean(-1, keepdim=True)
        return direction / scale.to(direction.dtype)[..., None]

    def linear(
        self, parts: Float[Tensor, "*rows d_model"], scale: Float[Tensor, "*scale"] | None
    ) -> Float[Tensor, "*rows d_model"]:
        """The norm's linear part ``P(p) * g / sigma`` (no bias: it belongs to no part; no scale: 1).

        ``scale`` broadcasts against ``parts`` without its ``d_model`` axis.
        """
        if self.centre:
            parts = parts - parts.mean(-1, keepdim=True)
        gain = self.gain
        if gain is not None:
            parts = parts * gain.to(parts.dtype)
        return parts if scale is None else parts / scale.to(parts.dtype)[..., None]

    def apply(
        self, x: Float[Tensor, "*rows d_model"], scale: Float[Tensor, "*scale"]
    ) -> Float[Tensor, "*rows d_model"]:
        """``N(x)`` in the dtype of ``x``, with the scale ``sigma`` as given."""
        out = self.linear(x, scale)
        bias = self.bias
        return out if bias is None else out + bias.to(out.dtype)

    def normalise(self, x: Float[Tensor, "*batch d_model"]) -> Float[Tensor, "*batch d_model"]:
        """``N(x)`` in the dtype of ``x``, its own scale ``sigma = sqrt(mean(P(x)^2) + eps)`` computed here.

        The order of ALTI's post-LN form (the centred sum, its population variance, then the gain and bias).
        """
        if self.eps is None:
            raise ValueError("this norm's epsilon is unknown: it cannot compute its own scale")
        centred = x - x.mean(-1, keepdim=True) if self.centre else x
        sigma = (centred.pow(2).mean(-1, keepdim=True) + self.eps).sqrt()
        gain = self.gain
        out = centred / sigma if gain is None else centred / sigma * gain.to(x.dtype)
        bias = self.bias
        return out if bias is None else out + bias.to(x.dtype)


@dataclass(frozen=True)
class _Fixed:
    """What `Norm.fixed` reads its gain and bias from."""

    weight: Tensor | None
    bias: Tensor | None


_FOLDED = ("LayerNormPreBridge", "RMSNormPreBridge")
"""TransformerLens's norms with their weights folded into the next layer: no gain of their own."""


def read_norm(component: Any, model_eps: float | None = None) -> Norm:
    """The `Norm` of a normalisation bridge (or of a plain module): the one place a norm's form is read.

    The form: RMSNorm where the bridge says so (``uses_rms_norm``), else LayerNorm; Gemma's ``1 + w`` where
    it says so (``uses_weight_offset``); the epsilon of the wrapped module (``variance_epsilon`` or ``eps``),
    else ``model_eps``.
    """
    module = getattr(component, "original_component", None) or component
    rms = bool(getattr(component, "uses_rms_norm", False))
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    own = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    layer_norm = isinstance(module, nn.LayerNorm) and not rms
    known = layer_norm or (type(module).__name__.endswith("RMSNorm") and rms)
    return Norm(
        centre=not rms,
        eps=float(own) if isinstance(own, int | float) else model_eps,
        offset=1.0 if getattr(component, "uses_weight_offset", False) else 0.0,
        module=module,
        gained=isinstance(weight, Tensor) and type(component).__name__ not in _FOLDED,
        biased=isinstance(bias, Tensor) and not rms,
        closed=known and isinstance(own, float),
    )


# --- one layer ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Layer:
    """The facts of one block: its norms, its attention's form, and the hooks that read them."""

    value_hook: str
    """The hook of the values the pattern weighs: ``attn.hook_v``, or ``attn.v_norm.hook_out`` where the bridge
    has it (Gemma 3n and 4 norm every value head after ``v_proj``; ``hook_v`` fires before that norm)."""
    output_hook: str
    """The hook equal to ``sum_h z^h W_O^h + b_O``: ``attn.o.hook_out``, else ``attn.hook_out`` (the same tensor in
    a decoder; in a BERT-style encoder ``attn.hook_out`` is ``LayerNorm(o + resid_pre)``)."""
    ln1: Norm | None
    ln2: Norm | None
    post_attention: str | None
    """The submodule (``ln1_post``) whose output is ``hook_attn_out`` where a norm follows the attention, else None."""
    post_norm: Norm | None
    """That norm (Gemma 2/3)."""
    q_norm: Norm | None
    k_norm: Norm | None
    values_heads_first: bool
    """``hook_v`` is ``[batch head key d_head]`` (multi-head latent attention: DeepSeek-V2/V3, GLM-4 MoE Lite, ...)."""
    scale: float | None
    """The scores' scale where the attention says it (``scaling``; Gemma's ``query_pre_attn_scalar``), else None
    (``d_head ** -0.5``)."""
    softcap: float | None
    """``c`` of the scores' soft-cap ``c tanh(s / c)`` (Gemma 2), else None."""
    alibi: bool
    sinks: bool
    """Learned attention-sink logits: an extra softmax column (GPT-OSS)."""
    query_scale_by_position: bool
    """A position-dependent query scale (Llama 4's ``llama_4_scaling_beta``, Ministral 3)."""
    qk_norm_over_heads: bool
    """The q/k norm runs over every head at once, before the heads are split (OLMo 2)."""
    key_norm_per_key_head: bool
    """The key norm has weights per key head."""
    scale_by_inverse_layer: bool
    """The scores are scaled by the inverse layer index without a ``scaling`` the attention states."""
    native_rotary: Any
    """TransformerLens's native attention's rotary module (adjacent pairs, ``cos_cached``), or None."""
    ungrouping: dict[str, int] | None
    """The attributes of the attention's module under which it takes one key and value head a query head, or None."""
    attention: str
    """The attention's bridge and module, for messages (``PositionEmbeddingsAttentionBridge over LlamaAttention``)."""
    skippable: frozenset[str]
    """What a circuit pass may skip of this block: ``mlp`` (a plain MLP bridge), ``q``, ``k``, ``v``, ``o`` (plain
    ``LinearBridge`` projections over ``torch.nn.Linear``)."""


_SKIPPABLE_MLPS = ("MLPBridge", "GatedMLPBridge", "JointGateUpMLPBridge")
"""Bridges whose forward maps ``[batch pos d_model]`` to ``[batch pos d_model]`` alone."""


def _post_attention(block: Any) -> str | None:
    """The submodule whose ``hook_out`` is ``hook_attn_out`` where that is a norm of the attention output.

    Outside ``attn``: Bloom's ``hook_attn_out`` is ``attn.o.hook_out``, the o-projection itself, since its
    attention adds the residual stream inside.
    """
    target = getattr(block, "hook_aliases", {}).get(ATTN_OUT, ATTN_HOOK_OUT)
    owner = target.rsplit(".", 1)[0]
    return None if owner.split(".")[0] == "attn" or not target.endswith(f".{NORM_OUT}") else owner


def _ungrouping(attention: Any) -> dict[str, int] | None:
    """See `Layer.ungrouping`.

    A Hugging Face attention the bridge reimplements (``PositionEmbeddingsAttentionBridge``) repeats each key
    head ``num_key_value_groups`` times after the projection hooks; TransformerLens's own ``NativeAttention``
    splits its keys into ``n_kv_heads`` and repeats them ``kv_repeats`` times.
    """
    module: Any = getattr(attention, "original_component", None)
    bridge = type(attention).__name__
    if bridge == "PositionEmbeddingsAttentionBridge" and isinstance(getattr(module, "num_key_value_groups", None), int):
        return {"num_key_value_groups": 1}
    if bridge == "AttentionBridge" and type(module).__name__ == "NativeAttention":
        return {"n_kv_heads": int(module.n_heads), "kv_repeats": 1}
    return None


def _skippable(block: Any) -> frozenset[str]:
    def linear(module: Any) -> bool:
        return type(module).__name__ == "LinearBridge" and isinstance(
            getattr(module, "original_component", None), nn.Linear
        )

    mlp = getattr(block, "mlp", None)
    plain = type(mlp).__name__ in _SKIPPABLE_MLPS and type(getattr(mlp, "original_component", None)).__name__.endswith(
        "MLP"
    )
    sides = [side for side in "qkvo" if linear(getattr(block.attn, side, None))]
    return frozenset(["mlp"] * plain + sides)


def _multi_head_latent(attention: Any) -> bool:
    try:
        from transformer_lens.model_bridge.generalized_components import MLAAttentionBridge
    except ImportError:  # pragma: no cover - a TransformerLens without it has no such models
        return False
    return isinstance(attention, MLAAttentionBridge)


def _read_layer(model: Model, layer: int, names: Collection[str], cfg_eps: float | None) -> Layer:
    """One block's `Layer`, read from the model."""
    block = model.blocks[layer]
    attn = block.attn
    hf = getattr(attn, "original_component", None)
    rope = getattr(getattr(hf, "config", None), "rope_parameters", None)
    post = _post_attention(block)
    scale, cap = getattr(hf, "scaling", None), getattr(hf, "attn_logit_softcapping", None)
    rotary = getattr(hf, "rotary", None)

    def norm(owner: Any, name: str) -> Norm | None:
        component = getattr(owner, name, None)
        return None if component is None else read_norm(component, cfg_eps)

    return Layer(
        value_hook=block_hook(layer, NORMED_VALUES if block_hook(layer, NORMED_VALUES) in names else VALUES),
        output_hook=block_hook(layer, O_OUT if block_hook(layer, O_OUT) in names else ATTN_HOOK_OUT),
        ln1=norm(block, "ln1"),
        ln2=norm(block, "ln2"),
        post_attention=post,
        post_norm=None if post is None else read_norm(block.get_submodule(post), cfg_eps),
        q_norm=norm(attn, "q_norm"),
        k_norm=norm(attn, "k_norm"),
        values_heads_first=_multi_head_latent(attn),
        scale=None if scale is None else float(scale),
        softcap=float(cap) if cap is not None and float(cap) > 0 else None,
        alibi=model.cfg.positional_embedding_type == "alibi" or "alibi" in type(attn).__name__.lower(),
        sinks=getattr(hf, "sinks", None) is not None,
        query_scale_by_position=isinstance(rope, dict) and rope.get("llama_4_scaling_beta") is not None,
        qk_norm_over_heads=getattr(attn, "_qk_norm_phase", None) == "pre_reshape",
        key_norm_per_key_head=bool(getattr(attn, "_qk_norm_per_head", False)),
        scale_by_inverse_layer=bool(getattr(model.cfg, "scale_attn_by_inverse_layer_idx", False))
        and not hasattr(hf, "scaling"),
        native_rotary=rotary if isinstance(getattr(rotary, "cos_cached", None), Tensor) else None,
        ungrouping=_ungrouping(attn),
        attention=f"{type(attn).__name__} over {type(hf).__name__}",
        skippable=_skippable(block),
    )


# --- the model -----------------------------------------------------------------------------------------------


class Anatomy:
    """Every fact the adapter's wiring reads of one model, each read on first use and then kept (`anatomy_of`).

    Example:
        >>> import contribution_lens as cl
        >>> facts = anatomy_of(cl.load_model())
        >>> facts.name, facts.positions, facts.n_heads, facts.n_kv_heads, facts.final_norm.centre
        ('LlamaForCausalLM', 'rotary', 9, 3, False)
    """

    def __init__(self, model: Model) -> None:
        self._model = model

    def __repr__(self) -> str:
        return f"Anatomy({type(self._model).__name__})"

    @cached_property
    def hook_names(self) -> frozenset[str]:
        """Every hook the bridge has (a bridge rebuilds ``hook_dict`` on every read: read once here)."""
        names = getattr(self._model, "hook_dict", None)
        if names is None or getattr(self._model, "cfg", None) is None:
            raise TypeError(
                f"{type(self._model).__name__} has no hook_dict: expected a TransformerLens TransformerBridge"
            )
        return frozenset(names)

    @cached_property
    def name(self) -> str:
        """The checkpoint's architecture (``config.architectures[0]``), else the bridge's class name."""
        cfg = self._model.cfg
        name = getattr(cfg, "architecture", None) or getattr(cfg, "original_architecture", None)
        return str(name) if name else type(self._model).__name__

    @cached_property
    def n_layers(self) -> int:
        """Blocks; a model that is no bridge is refused (`hook_names`)."""
        return int(self._model.cfg.n_layers) if self.hook_names is not None else 0

    @cached_property
    def n_heads(self) -> int:
        return int(self._model.cfg.n_heads)

    @cached_property
    def n_kv_heads(self) -> int:
        """Key and value heads (``n_heads`` without grouped-query attention)."""
        return int(getattr(self._model.cfg, "n_key_value_heads", None) or self.n_heads)

    @cached_property
    def d_vocab(self) -> int | None:
        d_vocab = getattr(self._model.cfg, "d_vocab", None)
        return None if d_vocab is None else int(d_vocab)

    @cached_property
    def n_ctx(self) -> int | None:
        """The context length, None where the config has none."""
        n_ctx = getattr(self._model.cfg, "n_ctx", None)
        return None if n_ctx is None else int(n_ctx)

    @cached_property
    def causal(self) -> bool:
        """``cfg.attention_dir``: "causal" for decoders, "bidirectional" for BERT-style encoders."""
        direction = getattr(self._model.cfg, "attention_dir", "causal")
        if direction not in ("causal", "bidirectional"):
            raise ValueError(f"model.cfg.attention_dir is {direction!r}; expected 'causal' or 'bidirectional'")
        return direction == "causal"

    @cached_property
    def positions(self) -> str:
        """The positional scheme: ``"learned"`` (added embeddings), ``"rotary"``, ``"alibi"``, or the config's word."""
        kind = str(self._model.cfg.positional_embedding_type)
        return "learned" if kind == "standard" else kind

    @cached_property
    def rotary_adjacent_pairs(self) -> bool:
        """The rotary embedding turns adjacent pairs ``(0, 1), (2, 3), ...`` (GLM, ERNIE, Cohere), not two halves."""
        cfg = self._model.cfg
        return bool(getattr(cfg, "rotary_adjacent_pairs", False) or getattr(cfg, "rotary_interleaved_cos_sin", False))

    @cached_property
    def qk_norm_after_rope(self) -> bool:
        return bool(getattr(self._model.cfg, "qk_norm_after_rope", False))

    @cached_property
    def parallel_attn_mlp(self) -> bool:
        """One residual sum for attention and MLP (GPT-J)."""
        return bool(getattr(self._model.cfg, "parallel_attn_mlp", False))

    @cached_property
    def eps(self) -> float | None:
        """The config's norm epsilon (what a norm module that hides its own is taken to use)."""
        eps = getattr(self._model.cfg, "eps", None)
        return None if eps is None else float(eps)

    @cached_property
    def logit_softcap(self) -> float | None:
        """``c`` of a model whose output logits are ``c * tanh(z / c)`` (Gemma 2), or None."""
        cap = getattr(self._model.cfg, "output_logits_soft_cap", None)
        if cap is None:
            config = getattr(getattr(self._model, "original_model", None), "config", None)
            cap = getattr(config, "final_logit_softcapping", None)
        return float(cap) if cap is not None and float(cap) > 0 else None

    @cached_property
    def final_norm(self) -> Norm | None:
        """The norm between the residual stream and the unembedding (``ln_final``), or None."""
        component = getattr(self._model, "ln_final", None)
        return None if component is None else read_norm(component, self.eps)

    @cached_property
    def embed_norm(self) -> Norm | None:
        """The norm of the embedding (``embed_ln``, BERT) where its scale has a hook, else None."""
        component = getattr(self._model, "embed_ln", None)
        return None if component is None or EMBED_NORM_SCALE not in self.hook_names else read_norm(component, self.eps)

    @cached_property
    def unembedding(self) -> bool:
        """Whether the model has an unembedding (LM head) with its hook."""
        return getattr(self._model, "unembed", None) is not None and UNEMBED_OUT in self.hook_names

    @cached_property
    def unembedding_bias(self) -> bool:
        """Whether the unembedding adds a bias ``b_U``."""
        unembed = getattr(self._model, "unembed", None)
        return isinstance(getattr(getattr(unembed, "original_component", None), "bias", None), Tensor)

    @cached_property
    def layers(self) -> tuple[Layer, ...]:
        """Every block's `Layer`."""
        return tuple(_read_layer(self._model, layer, self.hook_names, self.eps) for layer in range(self.n_layers))

    # --- the BOS convention ---------------------------------------------------------------------------------

    @cached_property
    def prepends_bos(self) -> bool:
        """Whether texts get a BOS by the model's own choice: ``cfg.default_prepend_bos`` (True where it has none)."""
        return bool(getattr(getattr(self._model, "cfg", None), "default_prepend_bos", True))

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (None without one), read now."""
        return getattr(self._model, "tokenizer", None)

    def bos_id(self) -> int | None:
        """The tokenizer's BOS id, read now (None without one)."""
        bos = getattr(self.tokenizer, "bos_token_id", None)
        return None if bos is None else int(bos)

    def start_ids(self) -> set[int]:
        """The ids a text starts with where the tokenizer begins it (BOS, or ``[CLS]`` for BERT-style tokenizers)."""
        ids = (getattr(self.tokenizer, name, None) for name in ("bos_token_id", "cls_token_id"))
        return {int(i) for i in ids if isinstance(i, int)}

    def pad_id(self) -> int:
        """The id padding is written with: the tokenizer's pad id, else its EOS id, else 0 (read now)."""
        tokenizer = self.tokenizer
        pad = None if tokenizer is None else tokenizer.pad_token_id
        if pad is None:
            pad = None if tokenizer is None else tokenizer.eos_token_id
        return 0 if pad is None else int(pad)


_KEY = "_contribution_lens_anatomy"


def anatomy_of(model: Model) -> Anatomy:
    """The model's `Anatomy`: built on the first call, then the same object, kept on the model.

    A model that takes no attribute (a stand-in object) gets a new one each call; an `Anatomy` is its own (a
    function that takes a model takes the anatomy a caller already read).

    Example:
        >>> import contribution_lens as cl
        >>> model = cl.load_model()
        >>> facts = anatomy_of(model)
        >>> anatomy_of(model) is facts, anatomy_of(facts) is facts, facts.logit_softcap
        (True, True, None)
    """
    if isinstance(model, Anatomy):
        return model
    own = getattr(model, "__dict__", None)  # not setattr: a bridge hands attributes on to the model it wraps
    kept = own.get(_KEY) if isinstance(own, dict) else None
    if kept is None:
        kept = Anatomy(model)
        if isinstance(own, dict):
            own[_KEY] = kept
    return kept


def architecture_name(model: Model) -> str:
    """The checkpoint's architecture (``config.architectures[0]``), else the bridge's class name (`Anatomy.name`)."""
    return anatomy_of(model).name
