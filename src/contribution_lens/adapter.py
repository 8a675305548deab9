"""The one place that knows TransformerLens: hook names, ``W_O``/``b_O``, tokens and padding.

Everything else in the package works on plain tensors (`contribution_lens.decomposition`)
or goes through the functions here. The hooks read, per layer ``l``:

* ``blocks.{l}.attn.hook_pattern`` -- ``[batch head query key]``;
* ``blocks.{l}.attn.hook_v`` -- ``[batch key kv_head d_head]`` (fewer heads under GQA), read
  through `read_values` (multi-head latent attention fires it heads first), or
  ``attn.v_norm.hook_out`` where values are normalised after ``v_proj`` (see `value_hook`);
* ``blocks.{l}.attn.hook_z`` -- ``pattern @ v`` per head, re-split by the head count where the
  bridge splits it otherwise (`_per_head`);
* ``blocks.{l}.attn.o.hook_out`` -- the o-projection output, ``sum_h z^h W_O^h + b_O``. This is
  the hook the head outputs reconstruct: with Gemma-style post-attention norms
  ``blocks.{l}.hook_attn_out`` is that output *after* the norm, and in BERT-style encoders
  ``attn.hook_out`` is ``LayerNorm(o + resid_pre)``.

`attention_problem` checks on a probe input that these hooks exist and fit together (what
``load_model`` refuses a model for); ``W_O`` comes from `output_weights`.

Texts are tokenised as the model's own convention has it: TransformerLens records per model
whether a BOS token is prepended (``cfg.default_prepend_bos``; True for the bundled models, where
BOS is SmolLM2's ``<|im_start|>``, id 1, and position 0 the attention sink; False for Qwen2,
Phi, GPT-NeoX, ...), and ``prepend_bos=True``/``False`` overrides it (`prepends_bos`). Token
tensors are used as given. Batches of texts are right-padded, so causal attention of the real
tokens is the same as for each text alone.
"""

import threading
import weakref
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import einops
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from contribution_lens.choices import as_index
from contribution_lens.decomposition import (
    Decomposition,
    Scope,
    accumulation_dtype,
    decompose_layer,
    head_gram,
    head_outputs,
    valid_positions,
)

Model = Any  # a TransformerBridge; typed loosely so tests can pass any bridge-like object
HookFn = Callable[[Tensor, Any], Tensor | None]


def pattern_hook(layer: int) -> str:
    return f"blocks.{layer}.attn.hook_pattern"


def _hook_names(model: "Model | None", known: Collection[str] | None) -> Collection[str] | None:
    """``known`` if given, else the model's hook names (a bridge rebuilds ``hook_dict`` on every read: read it once)."""
    return known if known is not None or model is None else model.hook_dict


def value_hook(layer: int, model: "Model | None" = None, *, known: Collection[str] | None = None) -> str:
    """The hook of the values the pattern weighs: ``attn.hook_v``, or ``attn.v_norm.hook_out`` where the bridge has it.

    Gemma 3n and Gemma 4 RMS-normalise every value head after ``v_proj`` (``v_norm``); the bridge
    fires ``hook_v`` before that norm, so there ``pattern @ hook_v`` is not ``hook_z``. ``known``:
    the model's ``hook_dict`` where the caller has read it already.
    """
    normed = f"blocks.{layer}.attn.v_norm.hook_out"
    names = _hook_names(model, known)
    if names is not None and normed in names:
        return normed
    return f"blocks.{layer}.attn.hook_v"


def values_heads_first(model: Model, layer: int) -> bool:
    """Whether ``hook_v`` of ``layer`` is ``[batch head key d_head]`` rather than ``[batch key kv_head d_head]``.

    TransformerLens 4.3's multi-head latent attention bridge (``MLAAttentionBridge``: DeepSeek-V2/V3,
    GLM-4 MoE Lite, GLM MoE DSA, Youtu) fires ``hook_v`` on the decompressed values it multiplies the
    pattern with, heads first, one value head per query head. Every other bridge fires it positions first.
    """
    try:
        from transformer_lens.model_bridge.generalized_components import MLAAttentionBridge
    except ImportError:  # pragma: no cover - a TransformerLens without it has no such models
        return False
    blocks = getattr(model, "blocks", None)
    return blocks is not None and isinstance(getattr(blocks[layer], "attn", None), MLAAttentionBridge)


def read_values(
    model: Model, layer: int, v: Float[Tensor, "batch _ _ d_head"]
) -> Float[Tensor, "batch key kv_head d_head"]:
    """``hook_v`` of ``layer`` as ``[batch key kv_head d_head]``, whatever layout the bridge fires it in."""
    return v.transpose(1, 2) if values_heads_first(model, layer) else v


def value_key_dim(model: Model, layer: int) -> int:
    """The dimension of ``hook_v`` of ``layer`` that indexes keys (positions): 1, or 2 where heads come first."""
    return 2 if values_heads_first(model, layer) else 1


def _per_head(z: Tensor | None, n_heads: int) -> Float[Tensor, "batch query head d_head"] | None:
    """``hook_z`` as ``[batch query head d_head]`` with ``n_heads`` (the pattern's) heads.

    The multi-head latent attention bridge fires ``hook_z`` (``o.hook_in``) split by ``cfg.d_head``,
    which there is the rotary width of a query head, not the value heads' width (DeepSeek-V3: 64
    against 128): its per-position row, head after head, is re-split by the head count.
    """
    if z is None or z.shape[2] == n_heads:
        return z
    return z.reshape(*z.shape[:2], n_heads, -1)


def output_hook(layer: int, model: "Model | None" = None, *, known: Collection[str] | None = None) -> str:
    """The hook that equals ``sum_h o^h + b_O``: the o-projection's output, before any norm.

    That is ``attn.o.hook_out`` where the bridge has it. ``attn.hook_out`` is the same tensor in
    decoders, but in BERT-style encoders it is ``LayerNorm(o + resid_pre)``. ``known`` as in `value_hook`.
    """
    name = f"blocks.{layer}.attn.o.hook_out"
    names = _hook_names(model, known)
    if names is not None and name not in names:
        return f"blocks.{layer}.attn.hook_out"
    return name


def n_layers(model: Model) -> int:
    if getattr(model, "hook_dict", None) is None or getattr(model, "cfg", None) is None:
        raise TypeError(f"{type(model).__name__} has no hook_dict: expected a TransformerLens TransformerBridge")
    return int(model.cfg.n_layers)


def check_layers(model: Model, layers: int | Sequence[int] | None) -> list[int]:
    """Normalise ``layers`` (None = all; negative indices count from the end) and check them."""
    total = n_layers(model)
    if layers is None:
        return list(range(total))
    if isinstance(layers, str):
        raise TypeError(f"layers must be integers, got str {layers!r}")
    # One integer (a NumPy or 0-d tensor integer too) or a sequence of them.
    sequence = hasattr(layers, "__iter__") and getattr(layers, "ndim", 1) != 0
    requested = list(layers) if sequence else [layers]  # type: ignore[arg-type]
    if not requested:
        raise ValueError("layers is empty; pass None for all layers")
    resolved = []
    for item in requested:
        layer = as_index(item, "layers must be integers")
        if not -total <= layer < total:
            raise ValueError(f"layer {layer} does not exist: the model has {total} layers (0..{total - 1})")
        resolved.append(layer % total)
    return sorted(set(resolved))


def check_hooks(model: Model, layers: Sequence[int]) -> dict[str, Any]:
    """Raise if the model lacks the hooks that contribution weights need; return its ``hook_dict``."""
    hook_dict = getattr(model, "hook_dict", None)
    if hook_dict is None:
        raise TypeError(f"{type(model).__name__} has no hook_dict: expected a TransformerLens TransformerBridge")
    for layer in layers:
        for name in (pattern_hook(layer), value_hook(layer, known=hook_dict)):
            if name not in hook_dict:
                raise ValueError(
                    f"model has no hook {name!r}; contribution weights need hook_pattern and hook_v "
                    "on every attention layer (is this an attention model booted as a TransformerBridge?)"
                )
    return hook_dict


_GRAMS: "weakref.WeakKeyDictionary[Any, dict[int, tuple[Tensor, Tensor]]]" = weakref.WeakKeyDictionary()


def layer_gram(model: Model, layer: int, W_O: Tensor) -> Float[Tensor, "head d_head e_head"]:
    """Float32 ``W_O^h W_O^h^T`` of one layer, computed once while ``W_O`` stays the same.

    Every pass of a faithfulness sweep reads the same weights: comparing them (one pass over
    ``W_O``) is far cheaper than the Gram product. Edited weights are seen and recomputed.
    """
    per_model = _GRAMS.setdefault(model, {})
    weights = W_O.to(torch.float32)
    hit = per_model.get(layer)
    if hit is not None and hit[0].shape == weights.shape and hit[0].device == weights.device:
        if torch.equal(hit[0], weights):
            return hit[1]
    gram = head_gram(weights)
    per_model[layer] = (weights.clone(), gram)
    return gram


def output_weights(model: Model, layer: int) -> tuple[Float[Tensor, "head d_head d_model"], Tensor | None]:
    """``W_O`` of one layer and its bias ``b_O`` (None when the model has none)."""
    attn = model.blocks[layer].attn
    try:
        W_O = attn.W_O.detach()
    except ValueError as error:
        # Gemma 4's global layers have wider heads (global_head_dim) than cfg.d_head; the bridge's
        # W_O refuses to split such a layer (PerLayerGeometryError, a ValueError) and says to read
        # the wrapped weight: the o-projection's [d_model, head * d_head], split by the head count.
        if type(error).__name__ != "PerLayerGeometryError":
            raise
        weight = attn.o.weight.detach()
        W_O = einops.rearrange(weight, "d_model (head d_head) -> head d_head d_model", head=int(model.cfg.n_heads))
    b_O = getattr(attn, "b_O", None)
    return W_O, None if b_O is None else b_O.detach()


@dataclass(frozen=True)
class TokenBatch:
    """Tokens of a right-padded batch, with the mask of real positions and string labels."""

    tokens: Int[Tensor, "batch pos"]
    attention_mask: Bool[Tensor, "batch pos"]
    str_tokens: list[list[str]]
    """Per text, one string per real token (padding excluded)."""
    bos_first: bool = True
    """Every text starts with the model's BOS (the attention sink analyses then take position 0)."""

    def __post_init__(self) -> None:
        if self.tokens.shape != self.attention_mask.shape:
            raise ValueError(
                f"tokens {tuple(self.tokens.shape)} and attention_mask {tuple(self.attention_mask.shape)} differ"
            )
        if len(self.str_tokens) != self.tokens.shape[0]:
            raise ValueError(f"{len(self.str_tokens)} token label lists for a batch of {self.tokens.shape[0]}")
        check_labels(self.str_tokens, self.attention_mask)

    @property
    def lengths(self) -> Int[Tensor, " batch"]:
        return self.attention_mask.sum(-1)

    @property
    def padded(self) -> bool:
        return not bool(self.attention_mask.all())


def check_labels(str_tokens: Sequence[Sequence[str]], attention_mask: Tensor) -> None:
    """One string label per real token of every text: labels that do not fit would silently drop rows."""
    lengths = attention_mask.sum(-1).tolist()
    for index, (labels, length) in enumerate(zip(str_tokens, lengths, strict=True)):
        if isinstance(labels, str) or len(labels) != length:
            got = f"a str {labels!r}" if isinstance(labels, str) else f"{len(labels)} labels"
            raise ValueError(f"text {index} has {got} for its {length} real tokens: str_tokens must match the tokens")


def context_length(model: Model) -> int | None:
    n_ctx = getattr(model.cfg, "n_ctx", None)
    return None if n_ctx is None else int(n_ctx)


def check_length(model: Model, length: int, what: str) -> None:
    n_ctx = context_length(model)
    if n_ctx is not None and length > n_ctx:
        raise ValueError(f"{what} is {length} tokens long, more than the model's context of {n_ctx} tokens")


def check_token_ids(model: Model, tokens: Tensor) -> None:
    """Every id lies in the model's vocabulary ``[0, d_vocab)``."""
    d_vocab = getattr(model.cfg, "d_vocab", None)
    if tokens.numel() == 0 or d_vocab is None:
        return
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= int(d_vocab):
        bad = low if low < 0 else high
        raise ValueError(f"token id {bad} is outside the model's vocabulary of {d_vocab} ids (0..{int(d_vocab) - 1})")


def _check_text_ids(model: Model, ids: Tensor, index: int) -> None:
    """A text's ids lie in the model's vocabulary: a tokenizer may hold added tokens the model has no row for."""
    d_vocab = getattr(model.cfg, "d_vocab", None)
    if d_vocab is None or ids.numel() == 0 or int(ids.max()) < int(d_vocab):
        return
    bad = int(ids.max())
    raise ValueError(
        f"input text {index} holds the token {token_labels(model, [bad])[0]!r} (id {bad}), outside the model's "
        f"vocabulary of {d_vocab} ids (0..{int(d_vocab) - 1}): the tokenizer has tokens the model has no embedding for"
    )


def token_labels(model: Model, ids: Sequence[int]) -> list[str]:
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None:
        return [f"<{i}>" for i in ids]
    return [tokenizer.decode([i]) for i in ids]


def start_ids(model: Model) -> set[int]:
    """The ids a text starts with where the tokenizer begins it (BOS, or ``[CLS]`` for BERT-style tokenizers)."""
    tokenizer = getattr(model, "tokenizer", None)
    ids = (getattr(tokenizer, name, None) for name in ("bos_token_id", "cls_token_id"))
    return {int(i) for i in ids if isinstance(i, int)}


def pad_id(model: Model) -> int:
    tokenizer = getattr(model, "tokenizer", None)
    pad = None if tokenizer is None else tokenizer.pad_token_id
    if pad is None:
        pad = None if tokenizer is None else tokenizer.eos_token_id
    return 0 if pad is None else int(pad)


def prepends_bos(model: Model, prepend_bos: Any = None) -> bool:
    """Whether texts get the tokenizer's BOS prepended: ``prepend_bos``, or else the model's own choice.

    The model's choice is TransformerLens's ``cfg.default_prepend_bos`` (True where a config has
    none). ``prepend_bos`` must be True, False or None.

    Example:
        >>> from types import SimpleNamespace
        >>> qwen = SimpleNamespace(cfg=SimpleNamespace(default_prepend_bos=False))
        >>> prepends_bos(qwen), prepends_bos(qwen, True)
        (False, True)
    """
    if prepend_bos is None:
        return bool(getattr(getattr(model, "cfg", None), "default_prepend_bos", True))
    if isinstance(prepend_bos, bool) or str(getattr(prepend_bos, "dtype", "")) in ("bool", "torch.bool"):
        if getattr(prepend_bos, "ndim", 0) == 0:
            return bool(prepend_bos)
    raise TypeError(
        "prepend_bos must be True, False or None (None: the model's own choice, cfg.default_prepend_bos), "
        f"got {type(prepend_bos).__name__} {prepend_bos!r}"
    )


def bos_to_prepend(model: Model, prepend_bos: Any = None) -> int | None:
    """The BOS id to put before token sequences built by hand (chunks, items), or None for none.

    None where `prepends_bos` says no BOS (``prepend_bos``, else the model's own choice) or the
    tokenizer has no BOS; ``prepend_bos=True`` on a tokenizer without one is refused.
    """
    wanted = prepends_bos(model, prepend_bos)
    bos = getattr(getattr(model, "tokenizer", None), "bos_token_id", None)
    if wanted and bos is None and prepend_bos:
        raise ValueError("prepend_bos=True, but this model's tokenizer has no BOS token (bos_token_id is None)")
    return int(bos) if wanted and bos is not None else None


def to_token_batch(
    model: Model,
    inputs: str | Sequence[str] | Tensor,
    *,
    attention_mask: Tensor | None = None,
    prepend_bos: bool | None = None,
) -> TokenBatch:
    """Tokenise text(s) as the model does (BOS or not) with right padding, or wrap a token tensor.

    Args:
        inputs: one text, a list of texts, or token ids ``[pos]`` / ``[batch pos]``.
        attention_mask: only with token ids: 1 for real tokens, 0 for padding.
        prepend_bos: prepend the tokenizer's BOS to texts; None: the model's own choice
            (``cfg.default_prepend_bos``, `prepends_bos`). Token ids are never changed.
    """
    bos = prepends_bos(model, prepend_bos)
    device = _model_device(model)
    if device.type == "meta":
        raise ValueError(
            "the model's weights are on the meta device (a model built without its weights): "
            "load it with contribution_lens.load_model or move real weights onto it"
        )
    if isinstance(inputs, Tensor):
        tokens = _checked_ids(inputs)
        check_length(model, tokens.shape[1], "the token sequence")
        if attention_mask is not None:
            attention_mask = _checked_mask(attention_mask, tokens.shape)
        real_ids = tokens if attention_mask is None else tokens[attention_mask.reshape(tokens.shape).bool()]
        check_token_ids(model, real_ids)
        if attention_mask is None:
            mask = torch.ones_like(tokens, dtype=torch.bool)
        else:
            mask = attention_mask.reshape(tokens.shape).to(torch.bool)
            if not bool(mask[:, 0].all()):
                raise ValueError("attention_mask marks position 0 as padding: pad on the right")
            if bool((mask[:, 1:] & ~mask[:, :-1]).any()):
                raise ValueError("attention_mask is not right-padded (a real token follows padding)")
        labels = [token_labels(model, row[m].tolist()) for row, m in zip(tokens, mask, strict=True)]
        starts = set(tokens[:, 0].tolist())
        return TokenBatch(tokens.to(device), mask.to(device), labels, bos_first=starts <= start_ids(model))

    if attention_mask is not None:
        raise ValueError("attention_mask is only accepted with token ids; texts are padded here")
    texts = [inputs] if isinstance(inputs, str) else list(inputs)
    if not texts:
        raise ValueError("no input texts given")
    if getattr(model, "tokenizer", None) is None:
        raise ValueError("this model has no tokenizer: pass token ids instead of text")
    rows = []
    for index, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"input {index} is a {type(text).__name__}, not a str")
        if not text.strip():
            raise ValueError(f"input text {index} is empty")
        ids = model.to_tokens(text, prepend_bos=bos, truncate=False)[0]
        check_length(model, ids.shape[0], f"input text {index}")
        _check_text_ids(model, ids, index)
        rows.append(ids.to(device))
    return replace(pad_rows(model, rows), bos_first=bos)


def _checked_ids(inputs: Tensor) -> Int[Tensor, "batch pos"]:
    """Token ids as ``[batch pos]`` int64: any integer dtype is read, bool, floats and meta tensors are refused."""
    if inputs.is_meta:
        raise ValueError("token ids are on the meta device: they have a shape but no values")
    if inputs.dtype == torch.bool:
        raise ValueError(
            "token ids must be integers, got a bool tensor (an attention mask? pass it as attention_mask=)"
        )
    if inputs.dtype.is_floating_point or inputs.dtype.is_complex:
        raise ValueError(f"token ids must be an integer tensor [pos] or [batch pos], got dtype {inputs.dtype}")
    tokens = einops.rearrange(inputs, "pos -> 1 pos") if inputs.ndim == 1 else inputs
    if tokens.ndim != 2:
        raise ValueError(f"token ids must be an integer tensor [pos] or [batch pos], got {tuple(inputs.shape)}")
    if tokens.shape[0] == 0 or tokens.shape[1] == 0:
        raise ValueError(f"token tensor is empty: shape {tuple(tokens.shape)}")
    # uint8, int16, int32 ids are ids all the same; the embedding takes int64.
    return tokens.long()


def _checked_mask(attention_mask: Tensor, shape: torch.Size) -> Tensor:
    if not isinstance(attention_mask, Tensor):
        raise TypeError(f"attention_mask must be a tensor [batch pos], got {type(attention_mask).__name__}")
    if attention_mask.is_meta:
        raise ValueError("attention_mask is on the meta device: it has a shape but no values")
    if attention_mask.numel() != shape.numel():
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, the token ids {tuple(shape)}")
    return attention_mask.reshape(shape)


def pad_rows(model: Model, rows: Sequence[Tensor]) -> TokenBatch:
    """Right-pad token sequences of different lengths into one batch."""
    if not rows:
        raise ValueError("no token sequences given")
    device = _model_device(model)
    length = max(row.shape[0] for row in rows)
    check_length(model, length, "the longest token sequence")
    tokens = torch.full((len(rows), length), pad_id(model), dtype=torch.long, device=device)
    mask = torch.zeros((len(rows), length), dtype=torch.bool, device=device)
    for index, row in enumerate(rows):
        tokens[index, : row.shape[0]] = row
        mask[index, : row.shape[0]] = True
    return TokenBatch(tokens, mask, [token_labels(model, row.tolist()) for row in rows])


def _model_device(model: Model) -> torch.device:
    try:
        return next(model.parameters()).device
    except (AttributeError, StopIteration):
        return torch.device("cpu")


def model_dtype(model: Model) -> torch.dtype:
    try:
        return next(model.parameters()).dtype
    except (AttributeError, StopIteration):
        return torch.float32


def z_hook(layer: int) -> str:
    return f"blocks.{layer}.attn.hook_z"


RESID_PRE = "hook_resid_pre"
"""The residual stream entering a block, as a ``capture`` name (relative to ``blocks.{l}``)."""


def resid_pre_hook(layer: int) -> str:
    """``blocks.{l}.hook_resid_pre``: the residual stream entering block ``l``."""
    return f"blocks.{layer}.{RESID_PRE}"


def is_causal_model(model: Model) -> bool:
    """``cfg.attention_dir``: "causal" for decoders, "bidirectional" for BERT-style encoders."""
    direction = getattr(model.cfg, "attention_dir", "causal")
    if direction not in ("causal", "bidirectional"):
        raise ValueError(f"model.cfg.attention_dir is {direction!r}; expected 'causal' or 'bidirectional'")
    return direction == "causal"


@dataclass(frozen=True, eq=False)
class LayerInputs:
    """What one attention layer offers to a per-layer function, read in its hooks.

    ``pattern``, ``v``, ``z`` and ``hook_out`` are the model's own (detached) activations of
    this forward pass: read them, do not write to them. ``decompose(scope)`` is computed once
    per scope and shared by every function that asks for it during the pass.
    """

    layer: int
    pattern: Float[Tensor, "batch head query key"]
    v: Float[Tensor, "batch key kv_head d_head"]
    W_O: Float[Tensor, "head d_head d_model"]
    b_O: Float[Tensor, " d_model"] | None
    z: Float[Tensor, "batch query head d_head"] | None
    """``hook_z`` where the model has it (``pattern @ v`` per head), else None."""
    hook_out: Float[Tensor, "batch query d_model"] | None
    """``attn.hook_out`` = ``sum_h z^h W_O^h + b_O``, before any post-attention norm; None if absent."""
    tokens: Int[Tensor, "batch pos"]
    attention_mask: Bool[Tensor, "batch pos"]
    """True for real tokens (all True without padding)."""
    str_tokens: list[list[str]]
    cfg: Any
    bos_first: bool = True
    """Every text starts with the model's BOS: position 0 is the sink (else analyses find it, `TokenBatch`)."""
    gram_of: Callable[[], Tensor] | None = field(default=None, repr=False)
    """What `gram` reads, when first asked for (None: no Gram matrix)."""
    captured: dict[str, Tensor] = field(default_factory=dict)
    """Extra per-layer hooks asked for with ``capture`` (e.g. ``"hook_resid_pre"``), by relative name."""
    _cache: dict[Any, Any] = field(default_factory=dict, repr=False)

    @property
    def causal(self) -> bool:
        return getattr(self.cfg, "attention_dir", "causal") == "causal"

    @property
    def gram(self) -> Float[Tensor, "head d_head e_head"] | None:
        """`decomposition.head_gram` of ``W_O`` in float32, remembered across passes (see `layer_gram`).

        Read on first use: a per-layer function that needs no Gram matrix pays nothing for it.
        """
        if "gram" not in self._cache:
            self._cache["gram"] = None if self.gram_of is None else self.gram_of()
        return self._cache["gram"]

    @property
    def padding_mask(self) -> Bool[Tensor, "batch pos"] | None:
        """``attention_mask`` where the batch has padding, else None (the fast path)."""
        return None if bool(self.attention_mask.all()) else self.attention_mask

    @property
    def valid(self) -> Bool[Tensor, "batch query key"]:
        """Which keys each query sees: ``j <= i`` in a decoder, every key in an encoder, never padding."""
        if "valid" not in self._cache:
            batch, _, n_query, n_key = self.pattern.shape
            self._cache["valid"] = valid_positions(
                n_query, n_key, attention_mask=self.padding_mask, batch=batch, causal=self.causal,
                device=self.pattern.device,
            )  # fmt: skip
        return self._cache["valid"]

    def head_outputs(self, dtype: torch.dtype | str | None = None) -> Float[Tensor, "batch query head d_head"]:
        """``z_i^h = sum_j alpha_ij^h v_j^h`` over the keys query ``i`` sees (`decomposition.head_outputs`).

        ``hook_z`` where the model has it, else ``alpha v``; 0 at a padding query. Derived once per
        dtype (float32 by default, float64 for a float64 model; `decomposition.accumulation_dtype`)
        and shared by every function of the pass.
        """
        acc = accumulation_dtype(dtype, self.pattern)
        key = ("head_outputs", acc)
        if key not in self._cache:
            valid = None if self.padding_mask is None else self.valid
            self._cache[key] = head_outputs(self.pattern, self.v, valid=valid, z=self.z, dtype=acc)
        return self._cache[key]

    def decompose(self, scope: Scope | str = Scope.INTER, dtype: torch.dtype | str | None = None) -> Decomposition:
        """`contribution_lens.decompose` of this layer (cached per scope and dtype)."""
        scope = Scope.of(scope)
        dtype = None if dtype is None else accumulation_dtype(dtype)
        key = ("decompose", scope, dtype)
        if key not in self._cache:
            self._cache[key] = decompose_layer(
                self.pattern,
                self.v,
                self.W_O,
                scope=scope,
                causal=self.causal,
                attention_mask=self.padding_mask,
                dtype=dtype,
                z=self.head_outputs(dtype),
                output=self.output_without_bias(),
                gram=self.gram,
            )
        return self._cache[key]

    def output_without_bias(self) -> Float[Tensor, "batch query d_model"] | None:
        """``sum_h z^h W_O^h`` read off ``hook_out``, where that is at least float32 (else None).

        A half-precision ``hook_out`` is rounded once more than the float32 sum of ``z W_O``.
        """
        if self.hook_out is None or self.hook_out.dtype not in (torch.float32, torch.float64):
            return None
        return self.hook_out if self.b_O is None else self.hook_out - self.b_O


LayerFn = Callable[[LayerInputs], Any]
PatternEdit = Callable[[int, Tensor, Tensor], Tensor | None]
"""``edit(layer, pattern, v)`` -> a new pattern (or None to keep it), applied in ``hook_pattern``."""


class StopForward(Exception):
    """Raised in a hook once the last requested layer is done: nothing after it is needed."""


def _check_capture(known: Collection[str], layers: Sequence[int], capture: Sequence[str]) -> None:
    for name in capture:
        missing = [f"blocks.{layer}.{name}" for layer in layers if f"blocks.{layer}.{name}" not in known]
        if missing:
            raise ValueError(f"model has no hook {missing[0]!r} to capture")


def has_capture(model: Model, layers: Sequence[int], capture: Sequence[str]) -> bool:
    """Whether every layer of ``layers`` has every ``capture`` hook (else `layer_hooks` would refuse them)."""
    try:
        _check_capture(model.hook_dict, layers, capture)
    except ValueError:
        return False
    return True


def _layer_inputs(model: Model, batch: TokenBatch, layer: int, slot: dict[str, Tensor]) -> LayerInputs:
    """What one layer offers, from the tensors its hooks caught."""
    W_O, b_O = output_weights(model, layer)
    return LayerInputs(
        gram_of=lambda: layer_gram(model, layer, W_O),
        layer=layer,
        pattern=slot["pattern"],
        v=slot["v"],
        W_O=W_O,
        b_O=b_O,
        z=_per_head(slot.get("z"), slot["pattern"].shape[1]),
        hook_out=slot.get("hook_out"),
        tokens=batch.tokens,
        attention_mask=batch.attention_mask,
        str_tokens=batch.str_tokens,
        cfg=model.cfg,
        bos_first=batch.bos_first,
        captured={k.split(":", 1)[1]: t for k, t in slot.items() if k.startswith("captured:")},
    )


def _edited(edit: PatternEdit, layer: int, pattern: Tensor, caught: dict[str, Tensor]) -> Tensor | None:
    """``edit`` applied to a layer's pattern, refused where the edit could not reach the output."""
    v = caught.get("v")
    if v is None:
        raise RuntimeError(f"hook_pattern of layer {layer} fired before hook_v: cannot edit it")
    if {"z", "hook_out"} & caught.keys():
        # Bridges that delegate attention to transformers (in TransformerLens 4.3: BERT,
        # RoBERTa, GPT-J, GPT-Neo, OPT, XGLM, Gemma 4, Llama 4, ...) fire hook_pattern from
        # the weights it returns, after the output is made: an edit would change nothing.
        raise RuntimeError(
            f"hook_pattern of layer {layer} fires after the attention output: an edited pattern "
            "would not change this model's output"
        )
    return edit(layer, pattern, v)


_LOCKS: "weakref.WeakKeyDictionary[Any, threading.RLock]" = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()
_INSIDE = threading.local()
"""Per thread, ``models``: the ids of the models whose `exclusive` block the thread is inside."""


def model_lock(model: Model) -> threading.RLock:
    """The lock that serialises hooked passes on ``model`` (one per model, reentrant)."""
    with _LOCKS_GUARD:
        lock = _LOCKS.get(model)
        if lock is None:
            lock = _LOCKS[model] = threading.RLock()
        return lock


@contextmanager
def exclusive(model: Model) -> Iterator[None]:
    """Hold ``model`` for one hooked pass: other threads wait, and every module is in eval mode.

    Hooks are attached to the model itself, so two threads running passes on one model at once
    would each fire the other's hooks and read the other's numbers: passes on one model are
    serialised (a second thread waits for the first; a nested pass in the same thread goes on).
    A model left in train mode would apply attention dropout, so each call would give other
    weights, with rows no longer summing to 1: the pass runs in eval mode and each module's own
    mode is restored afterwards.
    """
    with model_lock(model):
        inside: set[int] = _INSIDE.__dict__.setdefault("models", set())
        # Nested in this thread's own block (the hooks, then the forward): the outer one set eval mode.
        outer = id(model) not in inside
        training = [module for module in _all_modules(model) if module.training] if outer else []
        for module in training:
            module.training = False
        inside.add(id(model))
        try:
            yield
        finally:
            if outer:
                inside.discard(id(model))
            for module in training:
                module.training = True


def _all_modules(model: Model) -> list[torch.nn.Module]:
    """Every module of ``model`` and of the source model a bridge keeps outside its module tree."""
    found: dict[int, torch.nn.Module] = {}
    for root in (model, getattr(model, "original_model", None)):
        if isinstance(root, torch.nn.Module):
            found.update((id(module), module) for module in root.modules())
    return list(found.values())


@contextmanager
def hooked(model: Model, fwd_hooks: Sequence[tuple[str, HookFn]]) -> Iterator[None]:
    """``model.hooks(fwd_hooks)`` held `exclusive`: the only way this package attaches hooks."""
    with exclusive(model):
        if not fwd_hooks:  # nothing to attach: the bridge's hooks context would rebuild its hook names for nothing
            yield
            return
        with model.hooks(fwd_hooks=list(fwd_hooks)):
            yield


@contextmanager
def layer_hooks(
    model: Model,
    batch: TokenBatch,
    layers: Sequence[int],
    fn: LayerFn,
    *,
    edit: PatternEdit | None = None,
    capture: Sequence[str] = (),
    stop_after_last: bool = False,
    extra: Sequence[tuple[str, HookFn]] = (),
) -> Iterator[None]:
    """The one place that wires hooks: call ``fn(LayerInputs)`` for each layer in the forward pass.

    Per layer the hooks read ``hook_v``, ``hook_pattern`` (after ``edit``, if given, has
    replaced it), ``hook_z`` and ``attn.hook_out`` where the model has them, and any
    ``capture`` names relative to ``blocks.{l}``; ``fn`` runs once all have fired, whatever
    their order. Nothing is kept afterwards: only one layer's activations are alive at a time.
    With ``stop_after_last``, `StopForward` is raised after the last layer's ``fn``. ``extra``
    (hook name, function) pairs are attached with them, after them.
    """
    known = check_hooks(model, layers)
    _check_capture(known, layers, capture)
    optional = [("z", z_hook), ("hook_out", lambda layer: output_hook(layer, known=known))]
    pending: dict[int, dict[str, Tensor]] = {}
    last = max(layers)

    def slots(layer: int) -> list[tuple[str, str]]:
        names = [("v", value_hook(layer, known=known)), ("pattern", pattern_hook(layer))]
        names += [(kind, make(layer)) for kind, make in optional if make(layer) in known]
        return names + [(f"captured:{name}", f"blocks.{layer}.{name}") for name in capture]

    def capture_hook(layer: int, kind: str, needed: int) -> HookFn:
        def hook(tensor: Tensor, hook: Any) -> Tensor | None:
            replaced = None
            if kind == "pattern" and edit is not None:
                replaced = _edited(edit, layer, tensor, pending.get(layer, {}))
            slot = pending.setdefault(layer, {})
            kept = (tensor if replaced is None else replaced).detach()
            slot[kind] = read_values(model, layer, kept) if kind == "v" else kept
            if len(slot) == needed:
                fn(_layer_inputs(model, batch, layer, pending.pop(layer)))
                if stop_after_last and layer == last:
                    raise StopForward
            return replaced

        return hook

    fwd_hooks = []
    for layer in layers:
        names = slots(layer)
        fwd_hooks += [(name, capture_hook(layer, kind, len(names))) for kind, name in names]
    try:
        with hooked(model, [*fwd_hooks, *extra]):
            yield
    finally:
        pending.clear()


def forward(
    model: Model,
    batch: TokenBatch,
    fwd_hooks: Sequence[tuple[str, HookFn]] = (),
) -> Float[Tensor, "batch pos d_vocab"]:
    """Logits of one forward pass without autograd, with optional extra hooks."""
    kwargs = {"attention_mask": batch.attention_mask.long()} if batch.padded else {}
    with torch.inference_mode(), hooked(model, fwd_hooks):
        return model(batch.tokens, **kwargs)


PROBE_LENGTH = 6
"""Tokens of the probe sequence `attention_problem` runs."""


def _relative_error(actual: Tensor, expected: Tensor) -> float:
    expected = expected.to(torch.float64)
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    return float((actual.to(torch.float64) - expected).abs().max()) / max(scale, 1e-30)


def _layer_problem(layer: LayerInputs, tolerance: float) -> str | None:
    """What is wrong with one layer's hooks on the probe (see `attention_problem`), or None."""
    pattern, v = layer.pattern.to(torch.float64), layer.v.to(torch.float64)
    if pattern.shape[1] % v.shape[2] or layer.W_O.shape[0] != pattern.shape[1]:
        return (
            f"its hooks do not fit together: hook_pattern {tuple(pattern.shape)}, hook_v "
            f"{tuple(v.shape)}, W_O {tuple(layer.W_O.shape)}"
        )
    values = v.repeat_interleave(pattern.shape[1] // v.shape[2], dim=2)
    z = einops.einsum(pattern, values, "batch head query key, batch key head d_head -> batch query head d_head")
    if layer.z is not None and layer.z.shape != z.shape:
        return f"hook_z has shape {tuple(layer.z.shape)}, pattern @ v {tuple(z.shape)}"
    if layer.z is not None and (error := _relative_error(layer.z, z)) > tolerance:
        return (
            f"hook_z differs from pattern @ v by {error:.2g} (relative): the heads' outputs are changed (gated "
            "or normalised) before the o-projection, which would make contribution weights wrong"
        )
    if layer.hook_out is None:
        return None
    out = einops.einsum(
        z, layer.W_O.to(torch.float64), "batch query head d_head, head d_head d_model -> batch query d_model"
    )
    if layer.b_O is not None:
        out = out + layer.b_O.to(torch.float64)
    if (error := _relative_error(layer.hook_out, out)) > tolerance:
        return (
            f"the heads' outputs sum_h z^h W_O^h + b_O miss the o-projection output by {error:.2g} "
            "(relative): something between the attention heads and the o-projection (a gate or a norm) "
            "would make contribution weights wrong"
        )
    return None


def attention_problem(model: Model) -> str | None:
    """Why contribution weights cannot be computed on ``model``; None if they can.

    Every layer must have ``hook_pattern`` and ``hook_v``; then, on one forward pass of a probe
    sequence (ids 1..`PROBE_LENGTH`), every layer's hooks must fire, ``hook_z`` must equal
    ``pattern @ v`` and ``sum_h z^h W_O^h + b_O`` the o-projection output (`output_hook`), to a
    relative 1e-3 (3e-2 for half-precision weights). A gate or a norm between the heads and the
    o-projection, or hooks wired some other way, is found here rather than giving wrong weights.
    """
    total = n_layers(model)
    hook_dict = model.hook_dict
    missing = [
        layer for layer in range(total) if {pattern_hook(layer), value_hook(layer, known=hook_dict)} - hook_dict.keys()
    ]
    hooks = "blocks.{l}.attn.hook_pattern and hook_v"
    if len(missing) == total:
        return f"its bridge has no attention pattern on any layer (no {hooks})"
    if missing:
        return f"its bridge has no attention pattern on layers {missing} of {total} (no {hooks})"
    d_vocab = int(getattr(model.cfg, "d_vocab", None) or PROBE_LENGTH + 1)
    batch = to_token_batch(model, (torch.arange(PROBE_LENGTH) + 1) % d_vocab)
    tolerance = 3e-2 if model_dtype(model) in (torch.float16, torch.bfloat16) else 1e-3
    problems: dict[int, str] = {}
    seen: set[int] = set()

    def check(layer: LayerInputs) -> None:
        seen.add(layer.layer)
        try:
            problem = _layer_problem(layer, tolerance)
        except RuntimeError as error:  # shapes that do not broadcast
            problem = f"its hooks do not fit together ({str(error).strip().splitlines()[0][:200]})"
        if problem is not None:
            problems[layer.layer] = problem

    try:
        with layer_hooks(model, batch, list(range(total)), check, stop_after_last=True):
            try:
                forward(model, batch)
            except StopForward:
                pass
    except Exception as error:  # the bridge itself fails: say how, in one line
        message = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return f"its TransformerLens bridge fails on a forward pass ({type(error).__name__}: {message[:200]})"
    if problems:
        layer = min(problems)
        return f"on a probe input, layer {layer}: {problems[layer]}"
    never = [layer for layer in range(total) if layer not in seen]
    if never:
        return f"the attention hooks of layers {never} never fire on a forward pass"
    return None


# --- the form of the attention block (ALTI) ---------------------------------------------------

PRE_LN = "pre-LN"
"""``y = x + Attn(LN(x))``: the residual sum is the block's output (``hook_resid_mid``); no norm after it."""
POST_LN = "post-LN"
"""``y = LayerNorm(x + Attn(x))`` (BERT, RoBERTa): the LayerNorm ``ln1`` follows the residual sum."""


@dataclass(frozen=True)
class PostNorm:
    """The LayerNorm after a post-LN block's residual sum: ``LN(s) = (s - mean(s)) / sigma * weight + bias``.

    ``sigma = sqrt(var(s) + eps)``, ``var`` the population variance over ``d_model``.
    """

    weight: Float[Tensor, " d_model"]
    bias: Float[Tensor, " d_model"] | None
    eps: float


def post_norm(model: Model, layer: int) -> PostNorm:
    """The LayerNorm ``ln1`` of a post-LN block, read from the model now (edited weights are seen)."""
    norm = model.blocks[layer].ln1
    weight = norm.weight.detach()
    if getattr(norm, "uses_weight_offset", False):
        weight = 1 + weight
    component = getattr(norm, "original_component", None)
    bias = getattr(component, "bias", None)
    eps = getattr(component, "eps", None)
    return PostNorm(weight, None if bias is None else bias.detach(), float(model.cfg.eps if eps is None else eps))


def apply_post_norm(norm: PostNorm, s: Float[Tensor, "*batch d_model"]) -> Float[Tensor, "*batch d_model"]:
    """``LN(s)`` with ``norm`` in the dtype of ``s``."""
    centred = s - s.mean(-1, keepdim=True)
    sigma = (centred.pow(2).mean(-1, keepdim=True) + norm.eps).sqrt()
    out = centred / sigma * norm.weight.to(s.dtype)
    return out if norm.bias is None else out + norm.bias.to(s.dtype)


_FORMS: "weakref.WeakKeyDictionary[Any, dict[int, str]]" = weakref.WeakKeyDictionary()


def _block_form(model: Model, layer: int, caught: dict[str, Tensor], tolerance: float) -> str:
    """`PRE_LN`, `POST_LN` or a description of another form, from one layer's probe activations.

    Each test compares what a hook adds to ``hook_resid_pre`` with the attention output, relative
    to that output: the residual stream can be far larger than what one block adds to it.
    """
    x, out = caught.get(RESID_PRE), caught.get("out")
    if getattr(model.cfg, "parallel_attn_mlp", False):
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

    if adds("hook_resid_mid", out):
        return PRE_LN
    if adds("ln1.hook_in", out) and "ln1.hook_out" in caught:
        if getattr(model.blocks[layer].ln1, "uses_rms_norm", False):
            return "post-RMSNorm (RMSNorm after the residual sum; ALTI's post-LN form is for LayerNorm)"
        normed = apply_post_norm(post_norm(model, layer), x + out.double())
        if _relative_error(caught["ln1.hook_out"], normed) <= tolerance:
            return POST_LN
        return "post-norm of an unrecognised kind (ln1 after the residual sum is not a LayerNorm)"
    if "hook_attn_out" in caught and adds("hook_resid_mid", caught["hook_attn_out"]):
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
    d_vocab = int(getattr(model.cfg, "d_vocab", None) or PROBE_LENGTH + 1)
    batch = to_token_batch(model, (torch.arange(PROBE_LENGTH) + 1) % d_vocab)
    tolerance = 3e-2 if model_dtype(model) in (torch.float16, torch.bfloat16) else 1e-3
    caught: dict[int, dict[str, Tensor]] = {layer: {} for layer in range(total)}
    relative = (RESID_PRE, "hook_resid_mid", "hook_attn_out", "ln1.hook_in", "ln1.hook_out")

    def keep(layer: int, name: str) -> HookFn:
        return lambda tensor, hook: caught[layer].__setitem__(name, tensor.detach())

    hooks = [(output_hook(layer, model), keep(layer, "out")) for layer in range(total)]
    hooks += [
        (f"blocks.{layer}.{name}", keep(layer, name))
        for layer in range(total)
        for name in relative
        if f"blocks.{layer}.{name}" in model.hook_dict
    ]
    forward(model, batch, hooks)
    forms = {layer: _block_form(model, layer, caught[layer], tolerance) for layer in range(total)}
    _FORMS[model] = forms
    return forms


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

RESID_POST = "hook_resid_post"
ATTN_OUT = "hook_attn_out"


@dataclass(frozen=True)
class FrozenNorm:
    """A normalisation with its scale frozen: ``N(x) = P(x) * gain / scale + bias``.

    ``P`` subtracts the mean over ``d_model`` (LayerNorm, ``centre=True``) or is the identity
    (RMSNorm); ``gain`` is the weight as the norm applies it (Gemma's ``1 + w``), None when the
    norm has none; ``scale`` is the norm's own ``hook_scale`` at a position. Then
    ``<N(x), u> = <x, pull_back(u, scale)> + <bias, u>``: the adjoint of ``P`` is ``P``.

    Example:
        >>> norm = FrozenNorm(centre=True, gain=torch.tensor([2.0, 2.0]), bias=torch.tensor([1.0, 0.0]))
        >>> norm.apply(torch.tensor([3.0, 1.0]), torch.tensor(2.0)).tolist()
        [2.0, -1.0]
    """

    centre: bool
    gain: Float[Tensor, " d_model"] | None
    bias: Float[Tensor, " d_model"] | None

    def pull_back(
        self, direction: Float[Tensor, "*rows d_model"], scale: Float[Tensor, "*rows"]
    ) -> Float[Tensor, "*rows d_model"]:
        """The direction ``P(gain * u) / scale`` in the norm's input space that reads the same logit."""
        if self.gain is not None:
            direction = direction * self.gain.to(direction.dtype)
        if self.centre:
            direction = direction - direction.mean(-1, keepdim=True)
        return direction / scale.to(direction.dtype)[..., None]

    def linear(
        self, parts: Float[Tensor, "*rows d_model"], scale: Float[Tensor, "*scale"] | None
    ) -> Float[Tensor, "*rows d_model"]:
        """The norm's linear part ``P(p) * gain / scale`` (no bias: it belongs to no part; no scale: 1).

        ``scale`` broadcasts against ``parts`` without its ``d_model`` axis.
        """
        if self.centre:
            parts = parts - parts.mean(-1, keepdim=True)
        if self.gain is not None:
            parts = parts * self.gain.to(parts.dtype)
        return parts if scale is None else parts / scale.to(parts.dtype)[..., None]

    def apply(
        self, x: Float[Tensor, "*rows d_model"], scale: Float[Tensor, "*scale"]
    ) -> Float[Tensor, "*rows d_model"]:
        """``N(x)`` in the dtype of ``x``, the scale as given."""
        out = self.linear(x, scale)
        return out if self.bias is None else out + self.bias.to(out.dtype)


def _frozen_norm(component: Any) -> FrozenNorm:
    """The frozen affine form of a TransformerLens normalisation bridge (weight offset and bias included)."""
    rms = bool(getattr(component, "uses_rms_norm", False))
    weight = getattr(getattr(component, "original_component", None), "weight", None)
    if isinstance(weight, Tensor) and type(component).__name__ not in ("LayerNormPreBridge", "RMSNormPreBridge"):
        gain = weight.detach() + 1.0 if getattr(component, "uses_weight_offset", False) else weight.detach()
    else:
        gain = None
    bias = getattr(getattr(component, "original_component", None), "bias", None)
    return FrozenNorm(centre=not rms, gain=gain, bias=bias.detach() if isinstance(bias, Tensor) and not rms else None)


def _post_attention_norm_name(model: Model, layer: int) -> str | None:
    """The submodule whose ``hook_out`` is ``hook_attn_out`` when that is a norm of the attention output."""
    target = getattr(model.blocks[layer], "hook_aliases", {}).get(ATTN_OUT, "attn.hook_out")
    owner = target.rsplit(".", 1)[0]
    return None if owner == "attn" or not target.endswith(".hook_out") else owner


def post_attention_norm(model: Model, layer: int) -> FrozenNorm | None:
    """Layer ``layer``'s norm of the attention output before it joins the residual stream (Gemma), or None."""
    name = _post_attention_norm_name(model, layer)
    return None if name is None else _frozen_norm(model.blocks[layer].get_submodule(name))


def final_norm(model: Model) -> FrozenNorm | None:
    """The norm between the residual stream and the unembedding (``ln_final``), or None where there is none."""
    component = getattr(model, "ln_final", None)
    return None if component is None else _frozen_norm(component)


def _no_unembedding(name: str) -> str:
    return f"{name} has no unembedding (LM head): logit attribution explains next-token logits"


def unembedding(model: Model) -> tuple[Float[Tensor, "d_model d_vocab"], Float[Tensor, " d_vocab"] | None]:
    """``W_U`` and ``b_U`` (None when the unembedding has no bias); raises where the model has no LM head."""
    unembed = getattr(model, "unembed", None)
    if unembed is None or "unembed.hook_out" not in model.hook_dict:
        raise ValueError(_no_unembedding(type(model).__name__))
    return _unembedding_weights(unembed)


def _unembedding_weights(unembed: Any) -> tuple[Tensor, Tensor | None]:
    bias = getattr(getattr(unembed, "original_component", None), "bias", None)
    return unembed.W_U.detach(), bias.detach() if isinstance(bias, Tensor) else None


def logit_softcap(model: Model) -> float | None:
    """The cap ``c`` of a model whose output logits are ``c * tanh(z / c)`` (Gemma 2), or None.

    The unembedding's output ``z`` (``unembed.hook_out``) comes before the cap.
    """
    cap = getattr(model.cfg, "output_logits_soft_cap", None)
    if cap is None:
        config = getattr(getattr(model, "original_model", None), "config", None)
        cap = getattr(config, "final_logit_softcapping", None)
    return float(cap) if cap is not None and float(cap) > 0 else None


@dataclass(frozen=True)
class AttentionUpdate:
    """One layer's residual sum ``r_mid = resid_pre + added`` and the frozen norm between heads and sum."""

    resid_pre: Float[Tensor, "batch query d_model"]
    added: Float[Tensor, "batch query d_model"]
    norm: FrozenNorm | None
    """The post-attention norm (None where the o-projection output is added as it is)."""
    scale: Float[Tensor, "batch query"] | None
    """That norm's ``hook_scale`` per position (None without a norm)."""


@dataclass(frozen=True, eq=False)
class Readout:
    """How a model reads its residual stream, read off the model once: norms, unembedding, soft-cap, hooks.

    At position ``i`` the logit of token ``t`` is ``z_t = <N(x_i), W_U[:, t]> + b_U[t]`` (`logit`), ``x_i``
    the residual stream after the last block and ``N`` the final norm, ``N(x) = P(x) * g / s_i + b``
    with its scale ``s_i`` frozen (`FrozenNorm`); a model that soft-caps shows ``c * tanh(z / c)``.
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

    final_norm: FrozenNorm | None
    post_norms: tuple[FrozenNorm | None, ...]
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

        hooks: list[tuple[str, HookFn]] = [("unembed.hook_in", cut)] if self.cuts_unembedding else []
        hooks.append(("unembed.hook_out", keep("logits", slice(None) if self.cuts_unembedding else rows)))
        if self.final_scale_hook:
            hooks.append(("ln_final.hook_scale", keep("final_scale", rows)))
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

    Read from the model now (a few attribute reads and one look at its hooks): an analysis builds one
    per call and passes it around, and a weight edited since is seen by the next call.

    Example:
        >>> import contribution_lens as cl
        >>> r = readout(cl.load_model())
        >>> tuple(r.W_U.shape), r.softcap, r.post_norms[0], r.final_norm.centre  # RMSNorm: no centring
        ((576, 49152), None, None, False)
    """
    total = n_layers(model)
    names = model.hook_dict  # a bridge rebuilds it on every read: once here
    post = [_post_attention_norm_name(model, layer) for layer in range(total)]
    post_norms = tuple(
        None if name is None else _frozen_norm(model.blocks[layer].get_submodule(name))
        for layer, name in enumerate(post)
    )
    scales = tuple(None if name is None else f"{name}.hook_scale" for name in post)
    unembed = getattr(model, "unembed", None)
    W_U, b_U = (None, None) if unembed is None or "unembed.hook_out" not in names else _unembedding_weights(unembed)
    # Every layer's norm has the same name where there is one (the first layer's, as the capture asks).
    first = () if scales[0] is None else (scales[0],)
    return Readout(
        final_norm=final_norm(model),
        post_norms=post_norms,
        W_U=W_U,
        b_U=b_U,
        softcap=logit_softcap(model),
        residual_capture=(RESID_PRE, RESID_POST, ATTN_OUT, *first),
        flow_capture=(RESID_PRE, *((ATTN_OUT, *first) if first else ())),
        model_name=type(model).__name__,
        post_scale_hooks=scales,
        final_scale_hook=getattr(model, "ln_final", None) is not None and "ln_final.hook_scale" in names,
        cuts_unembedding="unembed.hook_in" in names,
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

QK_SCORES = "attn.hook_attn_scores"
QK_Q, QK_K = "attn.hook_q", "attn.hook_k"
QK_COS, QK_SIN = "attn.hook_cos", "attn.hook_sin"
QK_NORM_SCALES = {"q": "attn.q_norm.hook_scale", "k": "attn.k_norm.hook_scale"}
LN1_SCALE, LN2_SCALE, MLP_OUT = "ln1.hook_scale", "ln2.hook_scale", "hook_mlp_out"
_EMBED_PARTS = {
    "embed": "embed.hook_out",
    "pos_embed": "pos_embed.hook_out",
    "token_type_embed": "token_type_embed.hook_out",
}
_EMBED_NORM_SCALE = "embed_ln.hook_scale"


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
    q_norm: FrozenNorm | None
    k_norm: FrozenNorm | None
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


def architecture_name(model: Model) -> str:
    """The checkpoint's architecture (``config.architectures[0]``), else the bridge's class name."""
    name = getattr(model.cfg, "architecture", None) or getattr(model.cfg, "original_architecture", None)
    return str(name) if name else type(model).__name__


def _qk_refusal(model: Model, layer: int) -> str | None:
    """The attention form of ``layer`` whose scores cannot be split here, in words, or None."""
    cfg, attn = model.cfg, model.blocks[layer].attn
    hf = getattr(attn, "original_component", None)
    rope = getattr(getattr(hf, "config", None), "rope_parameters", None)
    forms = [
        (cfg.positional_embedding_type == "alibi" or "alibi" in type(attn).__name__.lower(), "ALiBi position biases"),
        (getattr(hf, "sinks", None) is not None, "learned attention-sink logits (an extra softmax column, GPT-OSS)"),
        (values_heads_first(model, layer), "multi-head latent attention (compressed keys and values)"),
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
    if cfg.positional_embedding_type == "rotary" and f"blocks.{layer}.{QK_COS}" not in model.hook_dict:
        if _native_rotary(model, layer) is None:
            return "a rotary embedding whose angles the bridge does not expose (no attn.hook_cos)"
    return None


def _native_rotary(model: Model, layer: int) -> Any:
    """TransformerLens's native attention's rotary module (adjacent pairs, ``cos_cached``), or None."""
    rotary = getattr(getattr(model.blocks[layer].attn, "original_component", None), "rotary", None)
    return rotary if isinstance(getattr(rotary, "cos_cached", None), Tensor) else None


def qk_form(model: Model, layer: int) -> QKForm:
    """`QKForm` of ``layer``, read from the model now; a form that cannot be split is refused, naming it."""
    problem = _qk_refusal(model, layer)
    if problem is not None:
        raise ValueError(
            f"qk_attribution cannot split the scores of {architecture_name(model)} layer {layer}: its attention "
            f"uses {problem}, which is not a sum of per-component terms this adapter reads"
        )
    attn = model.blocks[layer].attn
    hf = getattr(attn, "original_component", None)
    norms = {side: getattr(attn, f"{side}_norm", None) for side in ("q", "k")}
    d_head = int(attn.W_Q.shape[-1])
    scale = getattr(hf, "scaling", None)
    cap = getattr(hf, "attn_logit_softcapping", None)
    hooked = f"blocks.{layer}.{QK_COS}" in model.hook_dict
    native = None if hooked or model.cfg.positional_embedding_type != "rotary" else _native_rotary(model, layer)

    def bias(name: str) -> Tensor | None:
        value = getattr(attn, name, None)
        return value.detach() if isinstance(value, Tensor) else None

    return QKForm(
        layer=layer,
        W_Q=attn.W_Q.detach(),
        b_Q=bias("b_Q"),
        W_K=attn.W_K.detach(),
        b_K=bias("b_K"),
        q_norm=None if norms["q"] is None else _frozen_norm(norms["q"]),
        k_norm=None if norms["k"] is None else _frozen_norm(norms["k"]),
        rotary=model.cfg.positional_embedding_type == "rotary",
        scale=float(d_head**-0.5 if scale is None else scale),
        softcap=float(cap) if cap is not None and float(cap) > 0 else None,
        causal=is_causal_model(model),
        architecture=architecture_name(model),
        rotary_adjacent=native is not None,
        rotary_tables=None if native is None else (native.cos_cached.detach(), native.sin_cached.detach()),
    )


@dataclass(frozen=True)
class StreamNorm:
    """A norm the whole residual stream passes between a component's write and layer ``l``'s projections.

    ``name`` prefixes its bias component (``f"{name}.b"``); its scale is frozen per position.
    """

    name: str
    norm: FrozenNorm


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
    kinds = set()
    for earlier in range(layer + 1):
        form = forms[earlier]
        if form == POST_LN:
            kinds.add("post")
        elif form.startswith(_PRE_FORMS):
            kinds.add("pre")
        else:
            raise ValueError(
                f"qk_attribution cannot follow the residual stream of {architecture_name(model)}: layer {earlier} "
                f"is {form}"
            )
    post = kinds == {"post"}
    if len(kinds) > 1:
        raise ValueError(f"qk_attribution cannot follow {architecture_name(model)}: it mixes pre-LN and post-LN blocks")
    names = model.hook_dict
    embed_norm = _EMBED_NORM_SCALE in names and getattr(model, "embed_ln", None) is not None
    norms = [StreamNorm("embed_ln", _frozen_norm(model.embed_ln))] if embed_norm else []
    if post:
        for earlier in range(layer):
            block = model.blocks[earlier]
            norms += [StreamNorm(f"L{earlier}.ln1", _frozen_norm(block.ln1)),
                      StreamNorm(f"L{earlier}.ln2", _frozen_norm(block.ln2))]  # fmt: skip
    elif getattr(model.blocks[layer], "ln1", None) is not None and f"blocks.{layer}.{LN1_SCALE}" in names:
        norms.append(StreamNorm(f"L{layer}.ln1", _frozen_norm(model.blocks[layer].ln1)))
    capture = [*residual_capture(model), QK_SCORES, QK_Q, QK_K]
    capture += [LN1_SCALE, LN2_SCALE, MLP_OUT] if post else ([LN1_SCALE] if norms[int(embed_norm) :] else [])
    rotary = model.cfg.positional_embedding_type == "rotary" and f"blocks.{layer}.{QK_COS}" in names
    capture += [QK_COS, QK_SIN] if rotary else []
    capture += [
        name for side, name in QK_NORM_SCALES.items() if getattr(model.blocks[layer].attn, f"{side}_norm", None)
    ]
    return QKPlan(layer, post, tuple(norms), embed_norm, tuple(dict.fromkeys(capture)))


def embedding_hooks(model: Model, plan: QKPlan, store: dict[str, Tensor]) -> list[tuple[str, HookFn]]:
    """Hooks keeping the embedding's parts (batch element 0) in ``store``: what `embedding_writes` reads.

    With an embedding norm: the word, position and token-type embeddings before it, and its scale;
    else the learned position embedding where the model has one (``hook_pos_embed``).
    """

    def keep(key: str) -> HookFn:
        return lambda tensor, hook: store.__setitem__(key, tensor.detach()[0])

    names = model.hook_dict
    if plan.embed_norm:
        hooks = [(hook, keep(part)) for part, hook in _EMBED_PARTS.items() if hook in names]
        return [*hooks, (_EMBED_NORM_SCALE, keep("embed_ln.scale"))]
    if model.cfg.positional_embedding_type == "standard" and "hook_pos_embed" in names:
        return [("hook_pos_embed", keep("pos_embed"))]
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
    norm: FrozenNorm | None = None
    scale: Float[Tensor, " pos"] | None = None


def embedding_writes(model: Model, plan: QKPlan, layer: LayerInputs, store: dict[str, Tensor]) -> list[Write]:
    """The embedding's components (given layer 0's `LayerInputs`): ``embed``, ``pos_embed``, ..., its norm's bias."""
    if plan.embed_norm:
        writes = [Write((part,), store[part], 0) for part in _EMBED_PARTS if part in store]
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
        raise ValueError(f"layer {m} of {architecture_name(model)} has no hook_z: its heads' outputs cannot be read")
    pre, post = layer.captured[RESID_PRE][0], layer.captured[RESID_POST][0]
    if plan.post_ln:
        # y = LN2(LN1(x + o) + mlp): the heads and b_O pass ln1 then ln2; ln1's bias and the MLP pass ln2.
        writes = [Write(heads, z[0], stage, W_O=layer.W_O)]
        writes += [Write((f"L{m}.b_O",), layer.b_O, stage)] if layer.b_O is not None else []
        writes += _bias_writes(plan.norms[stage], stage + 1)
        writes.append(Write((f"L{m}.mlp",), layer.captured[MLP_OUT][0], stage + 1))
        return writes + _bias_writes(plan.norms[stage + 1], stage + 2)
    norm = post_attention_norm(model, m)
    scale = captured_post_scale(model, layer)
    own = None if scale is None else scale[0]
    writes = [Write(heads, z[0], stage, W_O=layer.W_O, norm=norm, scale=own)]
    writes += [Write((f"L{m}.b_O",), layer.b_O, stage, norm=norm, scale=own)] if layer.b_O is not None else []
    if norm is not None and norm.bias is not None:
        writes.append(Write((f"L{m}.{_post_attention_norm_name(model, m)}.b",), norm.bias, stage))
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
