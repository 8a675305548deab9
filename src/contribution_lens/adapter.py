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
from contribution_lens.decomposition import Decomposition, Scope, decompose_layer, head_gram

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

    def decompose(self, scope: Scope | str = Scope.INTER, dtype: torch.dtype | None = None) -> Decomposition:
        """`contribution_lens.decompose` of this layer (cached per scope and dtype)."""
        scope = Scope.of(scope)
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
                z=self.z,
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
        return name in caught and _relative_error(caught[name].double() - x, added) <= tolerance

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


# --- Logit attribution: the residual stream, the norms around it and the unembedding ---------------
#
# The residual stream at the last block's output is the embedding plus every block's update,
# ``x = resid_pre_0 + sum_l (resid_post_l - resid_pre_l)``, and attention's share of an update
# is ``hook_attn_out``: the o-projection output, or that output after a post-attention norm
# (Gemma 2/3 ``ln1_post``). With the norms' scales frozen at a position every step from the
# residual stream to the logit is affine, so the logit splits exactly into per-component terms.

RESID_POST = "hook_resid_post"
ATTN_OUT = "hook_attn_out"
POST_SCALE = "post_attention_norm_scale"
"""The ``LayerInputs.captured`` key of the post-attention norm's ``hook_scale``, where there is one."""


@dataclass(frozen=True)
class FrozenNorm:
    """A normalisation with its scale frozen: ``N(x) = P(x) * gain / scale + bias``.

    ``P`` subtracts the mean over ``d_model`` (LayerNorm, ``centre=True``) or is the identity
    (RMSNorm); ``gain`` is the weight as the norm applies it (Gemma's ``1 + w``), None when the
    norm has none; ``scale`` is the norm's own ``hook_scale`` at a position. Then
    ``<N(x), u> = <x, pull_back(u, scale)> + <bias, u>``: the adjoint of ``P`` is ``P``.
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


def unembedding(model: Model) -> tuple[Float[Tensor, "d_model d_vocab"], Float[Tensor, " d_vocab"] | None]:
    """``W_U`` and ``b_U`` (None when the unembedding has no bias); raises where the model has no LM head."""
    unembed = getattr(model, "unembed", None)
    if unembed is None or "unembed.hook_out" not in model.hook_dict:
        raise ValueError(
            f"{type(model).__name__} has no unembedding (LM head): logit attribution explains next-token logits"
        )
    bias = getattr(getattr(unembed, "original_component", None), "bias", None)
    return unembed.W_U.detach(), bias.detach() if isinstance(bias, Tensor) else None


def residual_capture(model: Model) -> list[str]:
    """The per-layer ``capture`` names logit attribution reads (relative to ``blocks.{l}``).

    ``hook_resid_pre``, ``hook_resid_post`` and ``hook_attn_out`` on every layer; where the
    attention output is normed before it is added (Gemma), that norm's ``hook_scale`` too.
    """
    names = [RESID_PRE, RESID_POST, ATTN_OUT]
    post = _post_attention_norm_name(model, 0)
    return names + ([f"{post}.hook_scale"] if post is not None else [])


def captured_post_scale(model: Model, layer: LayerInputs) -> Tensor | None:
    """The post-attention norm's ``hook_scale`` of ``layer`` as ``[batch pos]``, or None."""
    post = _post_attention_norm_name(model, layer.layer)
    if post is None:
        return None
    scale = layer.captured[f"{post}.hook_scale"]
    return scale.reshape(scale.shape[:2])


def final_hooks(model: Model, positions: Sequence[int], store: dict[str, Tensor]) -> list[tuple[str, HookFn]]:
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

    names = model.hook_dict  # a bridge rebuilds it on every read
    cuts = "unembed.hook_in" in names
    hooks: list[tuple[str, HookFn]] = [("unembed.hook_in", cut)] if cuts else []
    hooks.append(("unembed.hook_out", keep("logits", slice(None) if cuts else rows)))
    if getattr(model, "ln_final", None) is not None and "ln_final.hook_scale" in names:
        hooks.append(("ln_final.hook_scale", keep("final_scale", rows)))
    return hooks


def logit_softcap(model: Model) -> float | None:
    """The cap ``c`` of a model whose output logits are ``c * tanh(z / c)`` (Gemma 2), or None.

    The unembedding's output ``z`` (``unembed.hook_out``) comes before the cap.
    """
    cap = getattr(model.cfg, "output_logits_soft_cap", None)
    if cap is None:
        config = getattr(getattr(model, "original_model", None), "config", None)
        cap = getattr(config, "final_logit_softcapping", None)
    return float(cap) if cap is not None and float(cap) > 0 else None


# --- Flow: what attention adds to the residual stream, and what it is added to -----------------------
#
# Block ``l`` adds attention's update ``a_i`` to the residual stream ``x_i`` (``hook_resid_pre``):
# ``r_mid_i = x_i + a_i``. ``a_i`` is the o-projection output ``o_i + b_O`` (``attn.o.hook_out``),
# or, where a norm follows the attention (Gemma 2/3 ``ln1_post``), that norm's output with the
# scale frozen at the position: ``a_i = N(o_i + b_O)``, ``N(p) = P(p) * gain / scale_i + bias``.
# In post-LN encoders (BERT) the norm comes after the sum and ``r_mid`` is the sum before it.


@dataclass(frozen=True)
class AttentionUpdate:
    """One layer's residual sum ``r_mid = resid_pre + added`` and the frozen norm between heads and sum."""

    resid_pre: Float[Tensor, "batch query d_model"]
    added: Float[Tensor, "batch query d_model"]
    norm: FrozenNorm | None
    """The post-attention norm (None where the o-projection output is added as it is)."""
    scale: Float[Tensor, "batch query"] | None
    """That norm's ``hook_scale`` per position (None without a norm)."""


def flow_capture(model: Model) -> list[str]:
    """The ``capture`` names (relative to ``blocks.{l}``) that `attention_update` reads."""
    post = _post_attention_norm_name(model, 0)
    return [RESID_PRE] + ([ATTN_OUT, f"{post}.hook_scale"] if post is not None else [])


def attention_update(model: Model, layer: LayerInputs) -> AttentionUpdate:
    """What layer ``layer`` adds to which residual stream, read from the hooks `flow_capture` names."""
    resid_pre = layer.captured[RESID_PRE]
    norm = post_attention_norm(model, layer.layer)
    if norm is not None:
        return AttentionUpdate(resid_pre, layer.captured[ATTN_OUT], norm, captured_post_scale(model, layer))
    if layer.hook_out is not None:
        return AttentionUpdate(resid_pre, layer.hook_out, None, None)
    raise ValueError(f"layer {layer.layer} has no o-projection output hook ({output_hook(layer.layer)})")
