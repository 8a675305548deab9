"""Hooks and layer inputs: hook names, ``W_O``/``b_O``, `LayerInputs` and the one place that wires hooks.

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
"""

import threading
import weakref
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import einops
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from contribution_lens import tiles as tiling
from contribution_lens.adapter._model import HookFn, Model, model_dtype
from contribution_lens.adapter.anatomy import (
    ATTN_HOOK_OUT,
    NORMED_VALUES,
    O_OUT,
    PATTERN,
    RESID_PRE,
    VALUES,
    Z,
    anatomy_of,
    block_hook,
)
from contribution_lens.adapter.attention import AttentionForm, tiled_attention
from contribution_lens.adapter.tokens import TokenBatch, to_token_batch
from contribution_lens.choices import as_index
from contribution_lens.decomposition import (
    Decomposition,
    KeySide,
    Scope,
    accumulation_dtype,
    head_gram,
    head_outputs,
    valid_positions,
)
from contribution_lens.tiles import QueryKeys, Tile, query_tiles


def pattern_hook(layer: int) -> str:
    return block_hook(layer, PATTERN)


def _hook_names(model: "Model | None", known: Collection[str] | None) -> Collection[str] | None:
    """``known`` if given, else the model's hook names (a bridge rebuilds ``hook_dict`` on every read: read it once)."""
    return known if known is not None or model is None else anatomy_of(model).hook_names


def value_hook(layer: int, model: "Model | None" = None, *, known: Collection[str] | None = None) -> str:
    """The hook of the values the pattern weighs: ``attn.hook_v``, or ``attn.v_norm.hook_out`` where the bridge has it.

    Gemma 3n and Gemma 4 RMS-normalise every value head after ``v_proj`` (``v_norm``); the bridge
    fires ``hook_v`` before that norm, so there ``pattern @ hook_v`` is not ``hook_z``. ``known``:
    the model's ``hook_dict`` where the caller has read it already.
    """
    normed = block_hook(layer, NORMED_VALUES)
    names = _hook_names(model, known)
    if names is not None and normed in names:
        return normed
    return block_hook(layer, VALUES)


def values_heads_first(model: Model, layer: int) -> bool:
    """Whether ``hook_v`` of ``layer`` is ``[batch head key d_head]`` rather than ``[batch key kv_head d_head]``.

    TransformerLens 4.3's multi-head latent attention bridge (``MLAAttentionBridge``: DeepSeek-V2/V3,
    GLM-4 MoE Lite, GLM MoE DSA, Youtu) fires ``hook_v`` on the decompressed values it multiplies the
    pattern with, heads first, one value head per query head. Every other bridge fires it positions first.
    """
    return anatomy_of(model).layers[layer].values_heads_first


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
    name = block_hook(layer, O_OUT)
    names = _hook_names(model, known)
    if names is not None and name not in names:
        return block_hook(layer, ATTN_HOOK_OUT)
    return name


def n_layers(model: Model) -> int:
    return anatomy_of(model).n_layers


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


def check_hooks(model: Model, layers: Sequence[int]) -> Collection[str]:
    """Raise if the model lacks the hooks that contribution weights need; return its hook names."""
    hook_dict = anatomy_of(model).hook_names
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
        W_O = einops.rearrange(weight, "d_model (head d_head) -> head d_head d_model", head=anatomy_of(model).n_heads)
    b_O = getattr(attn, "b_O", None)
    return W_O, None if b_O is None else b_O.detach()


def z_hook(layer: int) -> str:
    return block_hook(layer, Z)


def resid_pre_hook(layer: int) -> str:
    """``blocks.{l}.hook_resid_pre``: the residual stream entering block ``l``."""
    return block_hook(layer, RESID_PRE)


def is_causal_model(model: Model) -> bool:
    """``cfg.attention_dir``: "causal" for decoders, "bidirectional" for BERT-style encoders (`Anatomy.causal`)."""
    return anatomy_of(model).causal


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
    qk: QueryKeys | None = field(default=None, repr=False)
    """The layer's queries and keys as they enter ``q k^T`` (`contribution_lens.tiles.QueryKeys`), where the
    pass kept them (``record_qk``) or ran in tiles; then ``pattern`` may be a shape alone (`whole`)."""
    _cache: dict[Any, Any] = field(default_factory=dict, repr=False)

    @property
    def whole(self) -> bool:
        """Whether ``pattern`` holds the pattern; else (a pass in tiles) it is a shape on the meta device, and the
        pattern is read a tile of queries at a time (`pattern_rows`, recomputed from `qk`)."""
        return not self.pattern.is_meta

    def tiles(self, budget: int | None = None) -> list[Tile]:
        """The layer's queries in tiles of ``budget`` bytes a pattern-sized tensor (default
        `contribution_lens.tiles.TILE_BYTES`; `contribution_lens.tiles.query_tiles`).

        A per-layer function that reads the pattern tile by tile (`pattern_rows`, `decompose_rows`)
        works whether the pass kept the pattern or not: it then never holds a whole one.
        """
        batch, heads, n_query, n_key = self.pattern.shape
        budget = tiling.TILE_BYTES if budget is None else budget
        return query_tiles(n_query, n_key, heads=heads, batch=batch, causal=self.causal, budget=budget)

    def pattern_rows(self, tile: Tile) -> Float[Tensor, "batch head row key"]:
        """The pattern's rows of ``tile``'s queries over its keys: cut from ``pattern``, or recomputed from `qk`."""
        if self.whole:
            return self.pattern[:, :, tile.queries, : tile.keys]
        if self.qk is None:
            raise ValueError(f"layer {self.layer} kept neither its pattern nor its queries and keys")
        return self.qk.pattern(tile)

    def key_side(self, dtype: torch.dtype | str | None = None) -> KeySide:
        """What every query reads of the layer's keys (`contribution_lens.decomposition.KeySide`), computed once."""
        tensors = (self.v, self.W_O) if not self.whole else (self.pattern, self.v, self.W_O)
        acc = accumulation_dtype(dtype, *tensors)
        key = ("key_side", acc)
        if key not in self._cache:
            self._cache[key] = KeySide.of(self.v, self.W_O, dtype=acc, attention_mask=self.padding_mask, gram=self.gram)
        return self._cache[key]

    def decompose_rows(
        self,
        scope: Scope | str,
        tile: Tile,
        *,
        pattern: Tensor | None = None,
        dtype: torch.dtype | str | None = None,
    ) -> Decomposition:
        """The `Decomposition` of ``tile``'s queries over its keys: the rows of `decompose`'s.

        ``pattern``: those rows of the pattern where the caller has them already (`pattern_rows`).
        """
        rows = self.pattern_rows(tile) if pattern is None else pattern
        n_key = self.pattern.shape[-1]
        first = n_key - self.pattern.shape[2] + tile.start
        z = None if self.z is None else self.z[:, first : first + tile.rows]
        output = self.output_without_bias(slice(first, first + tile.rows))
        scope = Scope.of(scope)
        reading = None
        if scope == Scope.INTER:
            back, norm_sq = self._reading(dtype)
            reading = (back[..., tile.queries, :], norm_sq[..., tile.queries])
        return self.key_side(dtype).decompose(
            rows, scope=scope, causal=self.causal, first_query=first, z=z, output=output, reading=reading
        )

    def _reading(self, dtype: torch.dtype | str | None = None) -> tuple[Tensor, Tensor]:
        """`contribution_lens.decomposition.KeySide.reading` of every query of the layer, computed once."""
        keys = self.key_side(dtype)
        key = ("reading", keys.dtype)
        if key not in self._cache:
            first = self.pattern.shape[-1] - self.pattern.shape[2]
            z = None if self.z is None else self.z[:, first:]
            self._cache[key] = keys.reading(z, self.output_without_bias(slice(first, None)), first)
        return self._cache[key]

    def inter_reading(self, dtype: torch.dtype | str | None = None) -> Float[Tensor, "batch head query d_head"]:
        """``o_i W_O^h^T`` per head (``o_i`` the layer's output less ``b_O``): ``<o_i, x W_O^h> = inter_reading . x``.

        What the inter scope's weights read of each query, computed once a layer (the decomposition's,
        brought back from its exact power-of-two scaling).
        """
        keys = self.key_side(dtype)
        back = self._reading(dtype)[0] / (keys.v_scale * keys.w_scale.square())[:, None, None, None, None]
        return einops.rearrange(back, "batch kv group query d -> batch (kv group) query d")

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
            if not self.whole:
                raise ValueError(
                    f"layer {self.layer} was read in tiles: its pattern was never held whole, so it has no whole "
                    "decomposition; read it a tile at a time (layer.tiles(), layer.decompose_rows(scope, tile))"
                )
            self._cache[key] = self.key_side(dtype).decompose(
                self.pattern,
                scope=scope,
                causal=self.causal,
                z=self.head_outputs(dtype),
                output=self.output_without_bias(),
            )
        return self._cache[key]

    def output_without_bias(self, queries: slice = slice(None)) -> Float[Tensor, "batch query d_model"] | None:
        """``sum_h z^h W_O^h`` read off ``hook_out`` (at ``queries``), where that is at least float32 (else None).

        A half-precision ``hook_out`` is rounded once more than the float32 sum of ``z W_O``.
        """
        if self.hook_out is None or self.hook_out.dtype not in (torch.float32, torch.float64):
            return None
        out = self.hook_out[:, queries]
        return out if self.b_O is None else out - self.b_O


LayerFn = Callable[[LayerInputs], Any]
PatternEdit = Callable[[int, Tensor, Tensor], Tensor | None]
"""``edit(layer, pattern, v)`` -> a new pattern (or None to keep it), applied in ``hook_pattern``."""


class StopForward(Exception):
    """Raised in a hook once the last requested layer is done: nothing after it is needed."""


def _check_capture(known: Collection[str], layers: Sequence[int], capture: Sequence[str]) -> None:
    for name in capture:
        missing = [block_hook(layer, name) for layer in layers if block_hook(layer, name) not in known]
        if missing:
            raise ValueError(f"model has no hook {missing[0]!r} to capture")


def has_capture(model: Model, layers: Sequence[int], capture: Sequence[str]) -> bool:
    """Whether every layer of ``layers`` has every ``capture`` hook (else `layer_hooks` would refuse them)."""
    try:
        _check_capture(anatomy_of(model).hook_names, layers, capture)
    except ValueError:
        return False
    return True


def _layer_inputs(
    model: Model, batch: TokenBatch, layer: int, slot: dict[str, Any], form: "AttentionForm | None" = None
) -> LayerInputs:
    """What one layer offers, from the tensors its hooks caught (and its queries and keys, where ``form`` says how)."""
    W_O, b_O = output_weights(model, layer)
    qk = slot.get("qk")
    if form is not None and "q" in slot:
        dtype = slot["pattern"].dtype if "pattern" in slot else None
        padding = batch.attention_mask.to(torch.bool) if batch.padded else None
        qk = form.query_keys(slot["q"], slot["k"], padding, dtype=dtype)
    if "pattern" in slot:
        pattern = slot["pattern"]
    else:  # a pass in tiles holds no pattern: its shape alone, on the meta device (`LayerInputs.whole`)
        assert qk is not None, f"layer {layer} caught neither its pattern nor its queries and keys"
        pattern = torch.empty(qk.shape, device="meta", dtype=qk.q.dtype)
    return LayerInputs(
        gram_of=lambda: layer_gram(model, layer, W_O),
        layer=layer,
        pattern=pattern,
        v=slot["v"],
        W_O=W_O,
        b_O=b_O,
        z=_per_head(slot.get("z"), pattern.shape[1]),
        hook_out=slot.get("hook_out"),
        tokens=batch.tokens,
        attention_mask=batch.attention_mask,
        str_tokens=batch.str_tokens,
        cfg=model.cfg,
        bos_first=batch.bos_first,
        captured={k.split(":", 1)[1]: t for k, t in slot.items() if k.startswith("captured:")},
        qk=qk,
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


QK_MODES = ("record", "tiles")
"""How a pass reads each layer's queries and keys (`layer_hooks`' ``qk``; `contribution_lens.adapter.attention`)."""


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
    qk: str | None = None,
    forms: "dict[int, AttentionForm] | None" = None,
    receive: Callable[[int, QueryKeys], None] | None = None,
) -> Iterator[None]:
    """The one place that wires hooks: call ``fn(LayerInputs)`` for each layer in the forward pass.

    Per layer the hooks read ``hook_v``, ``hook_pattern`` (after ``edit``, if given, has replaced it), ``hook_z``
    and ``attn.hook_out`` where the model has them, and any ``capture`` names relative to ``blocks.{l}``; ``fn``
    runs once all have fired, whatever their order. Nothing is kept afterwards: only one layer's activations
    are alive at a time. With ``stop_after_last``, `StopForward` is raised after the last layer's ``fn``.
    ``extra`` (hook name, function) pairs are attached with them, after them.

    ``qk`` (`QK_MODES`): ``"record"`` also reads each layer's queries and keys into
    `LayerInputs.qk`; ``"tiles"`` runs attention a tile of queries at a time
    (`contribution_lens.adapter.attention.tiled_attention`): ``LayerInputs.pattern`` is then its
    shape alone and ``fn`` reads the pattern through ``LayerInputs.pattern_rows``. ``forms``: each
    layer's `contribution_lens.adapter.attention.AttentionForm` (``contribution_lens.adapter.attention_forms``,
    learned on a probe that cannot run inside another pass: needed to record); ``receive(layer, qk)``
    sees each tiled layer's queries and keys.
    """
    _check_qk(qk, edit, forms)
    known = check_hooks(model, layers)
    _check_capture(known, layers, capture)
    optional = [("z", z_hook), ("hook_out", lambda layer: output_hook(layer, known=known))]
    pending: dict[int, dict[str, Any]] = {}
    last = max(layers)

    def slots(layer: int) -> list[tuple[str, str]]:
        names = [("v", value_hook(layer, known=known))]
        names += [] if qk == "tiles" else [("pattern", pattern_hook(layer))]
        names += [(kind, make(layer)) for kind, make in optional if make(layer) in known]
        if qk == "record" and forms is not None:
            names += [("q", block_hook(layer, forms[layer].q_hook)), ("k", block_hook(layer, forms[layer].k_hook))]
        return names + [(f"captured:{name}", block_hook(layer, name)) for name in capture]

    needed = {layer: len(slots(layer)) + (qk == "tiles") for layer in layers}

    def fill(layer: int, kind: str, value: Any) -> None:
        slot = pending.setdefault(layer, {})
        slot[kind] = value
        if len(slot) == needed[layer]:
            form = None if forms is None or qk != "record" else forms[layer]
            fn(_layer_inputs(model, batch, layer, pending.pop(layer), form))
            if stop_after_last and layer == last:
                raise StopForward

    def capture_hook(layer: int, kind: str) -> HookFn:
        def hook(tensor: Tensor, hook: Any) -> Tensor | None:
            replaced = None
            if kind == "pattern" and edit is not None:
                replaced = _edited(edit, layer, tensor, pending.get(layer, {}))
            kept = (tensor if replaced is None else replaced).detach()
            fill(layer, kind, read_values(model, layer, kept) if kind == "v" else kept)
            return replaced

        return hook

    def received(layer: int, found: QueryKeys) -> None:
        if receive is not None:
            receive(layer, found)
        if layer in needed:
            fill(layer, "qk", found)

    fwd_hooks = [(name, capture_hook(layer, kind)) for layer in layers for kind, name in slots(layer)]
    in_tiles = tiled_attention(model, batch, received) if qk == "tiles" else nullcontext()
    try:
        with hooked(model, [*fwd_hooks, *extra]), in_tiles:
            yield
    finally:
        pending.clear()


def _check_qk(qk: str | None, edit: PatternEdit | None, forms: "dict[int, AttentionForm] | None") -> None:
    """`layer_hooks`'s ``qk`` against its other arguments, before any hook is attached."""
    if qk is not None and qk not in QK_MODES:
        raise ValueError(f"qk must be one of {QK_MODES} or None, got {qk!r}")
    if qk == "tiles" and edit is not None:
        raise ValueError("a pass in tiles holds no pattern to edit: run pattern edits with qk=None")
    if qk == "record" and forms is None:
        raise ValueError("qk='record' needs the layers' forms (contribution_lens.adapter.attention_forms)")


def forward(
    model: Model,
    batch: TokenBatch,
    fwd_hooks: Sequence[tuple[str, HookFn]] = (),
    *,
    grad: bool = False,
) -> Float[Tensor, "batch pos d_vocab"]:
    """Logits of one forward pass without autograd, with optional extra hooks.

    With ``grad``, the pass records autograd's graph (inference mode off, grad on; the tokens copied, so
    they are no inference tensor), for a method that differentiates through it (``grad_attention``).
    """
    kwargs = {"attention_mask": batch.attention_mask.long()} if batch.padded else {}
    if grad:
        with torch.inference_mode(False), torch.enable_grad(), hooked(model, fwd_hooks):
            return model(batch.tokens.clone(), **kwargs)
    with torch.inference_mode(), hooked(model, fwd_hooks):
        return model(batch.tokens, **kwargs)


def block_calls(model: Model, batch: TokenBatch, layers: Sequence[int]) -> dict[int, tuple]:
    """``(args, kwargs, output)`` of each requested block (``model.blocks[l]``) in one clean forward pass.

    What a method that reruns a block on its own reads (value zeroing): the arguments it got, read with a
    PyTorch forward hook on the block, since no TransformerLens hook sees them. The pass stops after the
    last requested block.
    """
    calls: dict[int, tuple] = {}
    handles = []
    last = max(layers)

    def record(layer: int) -> Any:
        def hook(module: Any, args: tuple, kwargs: dict, output: Any) -> None:
            calls[layer] = (args, kwargs, output[0] if isinstance(output, tuple) else output)
            if layer == last:
                raise StopForward

        return hook

    with exclusive(model):  # no other thread's pass may fire these hooks
        try:
            for layer in layers:
                handles.append(model.blocks[layer].register_forward_hook(record(layer), with_kwargs=True))
            try:
                forward(model, batch)
            except StopForward:
                pass
        finally:
            for handle in handles:
                handle.remove()
    missing = [layer for layer in layers if layer not in calls]
    if missing:
        raise RuntimeError(f"the forward pass never called blocks {missing}")
    return calls


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
    hook_dict = anatomy_of(model).hook_names
    missing = [layer for layer in range(total) if {pattern_hook(layer), value_hook(layer, known=hook_dict)} - hook_dict]
    hooks = "blocks.{l}.attn.hook_pattern and hook_v"
    if len(missing) == total:
        return f"its bridge has no attention pattern on any layer (no {hooks})"
    if missing:
        return f"its bridge has no attention pattern on layers {missing} of {total} (no {hooks})"
    d_vocab = anatomy_of(model).d_vocab or PROBE_LENGTH + 1
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
