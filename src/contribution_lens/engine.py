"""The streaming primitive: one forward pass, a per-layer function at every requested layer.

Every model-level analysis in this package is a function ``fn(layer: LayerInputs) -> T`` run by
`map_layers`; what ``fn`` returns is all that is kept, so memory follows what the caller keeps:

    >>> import contribution_lens as cl
    >>> model = cl.load_model()
    >>> def sink_share(layer):  # token-level contribution of key 0, averaged over queries 1..
    ...     return layer.decompose("inter").sum_over_heads()[0, 1:, 0].mean().item()
    >>> shares = cl.map_layers(model, "The cat sat on the mat.", sink_share, layers=[0, -1])
    >>> shares.layers
    [0, 29]
    >>> isinstance(shares[-1], float)
    True
"""

import html
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, Generic, TypeVar

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from contribution_lens import adapter
from contribution_lens.adapter import as_index
from contribution_lens.files import Saves

T = TypeVar("T")
WHOLE_PATTERN_BYTES = 1 << 30
"""Where ``qk="auto"`` runs a pass in tiles: one layer's pattern in float32 would pass this (SmolLM2's 9 heads:
past 5,461 tokens; 2.4 GB a layer at 8,192). Below it the pass keeps the model's own pattern."""


class LayerResults(Saves, Mapping[int, T], Generic[T]):
    """Per-layer results of one batch: a read-only mapping ``layer -> value``, with its tokens.

    Negative indices count from the model's last layer, as in Python: ``results[-1]`` is layer
    ``n_layers - 1`` (if it was computed). Iteration is in layer order. ``save(path)`` writes the
    layers (tensors, or dataclasses of them) and the tokens to one file, ``load(path)`` reads it.
    """

    STORED: ClassVar[tuple[str, ...]] = ()
    """A subclass's own constructor arguments, kept by ``save`` beside the layers and the tokens."""
    BATCH: ClassVar[tuple[str, ...]] = ("tokens", "attention_mask", "str_tokens", "n_layers", "logits", "bos_first")
    """The batch's fields every result carries beside its layers (keyword arguments of the constructor): the one
    list `batch_fields`, `from_results`, `map`, `stored_fields` (all but the logits) and the subclasses read."""

    def __init__(
        self,
        values: Mapping[int, T],
        *,
        tokens: Int[Tensor, "batch pos"],
        attention_mask: Bool[Tensor, "batch pos"],
        str_tokens: list[list[str]],
        n_layers: int | None = None,
        logits: Float[Tensor, "batch pos d_vocab"] | None = None,
        bos_first: bool = True,
    ) -> None:
        if not values:
            raise ValueError("no layers: a result needs at least one computed layer")
        if tokens.shape != attention_mask.shape:
            raise ValueError(f"tokens {tuple(tokens.shape)} and attention_mask {tuple(attention_mask.shape)} differ")
        if len(str_tokens) != tokens.shape[0]:
            raise ValueError(f"{len(str_tokens)} token label lists for a batch of {tokens.shape[0]}")
        adapter.check_labels(str_tokens, attention_mask)
        self._values = dict(sorted(values.items()))
        self.tokens = tokens
        self.attention_mask = attention_mask
        self.str_tokens = str_tokens
        self.n_layers = max(self._values) + 1 if n_layers is None else int(n_layers)
        self.logits = logits
        self.bos_first = bool(bos_first)
        """Every text starts with the model's BOS (`contribution_lens.adapter.TokenBatch.bos_first`)."""

    @classmethod
    def from_results(cls, results: "LayerResults[Any]", values: Mapping[int, Any] | None = None, **extra: Any) -> Any:
        """A result of this class holding ``values`` (default: those of ``results``) and its tokens.

        How an analysis turns what `map_layers` returned into its own result type, e.g.
        ``Geometry.from_results(results, scope="inter")``; ``extra`` are the class's own fields.
        """
        return cls(dict(results.items()) if values is None else values, **results.batch_fields(), **extra)

    def batch_fields(self) -> dict[str, Any]:
        """The batch's fields (`BATCH`) by name: what a result built from this one passes on."""
        return {name: getattr(self, name) for name in self.BATCH}

    def stored_fields(self) -> dict[str, Any]:
        """What ``save`` keeps: the layers, the tokens, their labels and the subclass's `STORED` (not the logits)."""
        own = {name: getattr(self, name) for name in self.STORED}
        batch = {name: value for name, value in self.batch_fields().items() if name != "logits"}
        return {"layers": dict(self.items()), **batch, **own}

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any]) -> "LayerResults[Any]":
        """The result `stored_fields` described."""
        rest = dict(fields)
        return cls(rest.pop("layers"), **rest)

    @property
    def layers(self) -> list[int]:
        """The computed layers, ascending."""
        return list(self._values)

    def resolve(self, layer: Any) -> int:
        """The non-negative index of ``layer`` (negative counts from ``n_layers``).

        Any integer works (``int``, a NumPy integer, a 0-d integer tensor); ``bool`` does not.
        """
        layer = as_index(layer, "layers are indexed by int")
        resolved = layer + self.n_layers if layer < 0 else layer
        if resolved not in self._values:
            given = f"{layer} (= {resolved})" if layer < 0 else str(layer)
            raise KeyError(f"layer {given} was not computed; computed layers: {self.layers}")
        return resolved

    def __getitem__(self, layer: Any) -> T:
        return self._values[self.resolve(layer)]

    def __contains__(self, layer: object) -> bool:
        try:
            layer = as_index(layer, "")
        except TypeError:
            return False
        return (layer + self.n_layers if layer < 0 else layer) in self._values

    def __iter__(self) -> Iterator[int]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def labels(self, index: int = 0) -> list[str]:
        """Unique axis labels ``"{position}:{token}"`` for batch element ``index``."""
        if not 0 <= index < len(self.str_tokens):
            raise IndexError(f"index {index} is outside the batch of {len(self.str_tokens)}")
        return [f"{i}:{token}" for i, token in enumerate(self.str_tokens[index])]

    def map(self, fn: Callable[[T], Any]) -> "LayerResults[Any]":
        """A new result with ``fn`` applied to every layer's value."""
        return LayerResults({layer: fn(value) for layer, value in self._values.items()}, **self.batch_fields())

    def _describe_value(self) -> str:
        first = next(iter(self._values.values()))
        if isinstance(first, Tensor):
            return f"Tensor{tuple(first.shape)}"
        return type(first).__name__

    def _layer_span(self) -> str:
        layers = self.layers
        if layers == list(range(layers[0], layers[-1] + 1)) and len(layers) > 2:
            return f"{layers[0]}..{layers[-1]}"
        return ", ".join(map(str, layers))

    def __repr__(self) -> str:
        batch, pos = self.tokens.shape
        return (
            f"{type(self).__name__}(layers=[{self._layer_span()}] of {self.n_layers}, batch={batch}, "
            f"pos={pos}, value={self._describe_value()})"
        )

    def _repr_html_(self) -> str:
        batch, pos = self.tokens.shape
        preview = " ".join(self.str_tokens[0][:12]) + (" …" if len(self.str_tokens[0]) > 12 else "")
        rows = [
            ("layers", f"[{self._layer_span()}] of {self.n_layers}"),
            ("batch × pos", f"{batch} × {pos}"),
            ("value", self._describe_value()),
            ("text 0", preview),
        ]
        body = "".join(
            f"<tr><th style='text-align:left'>{k}</th><td style='text-align:left'>{html.escape(v)}</td></tr>"
            for k, v in rows
        )
        return f"<b>{type(self).__name__}</b><table>{body}</table>"

    def to(self, target: torch.device | str | torch.dtype) -> "LayerResults[T]":
        """Every value with a ``.to`` moved to a device or cast to a dtype (others kept)."""
        moved = self.map(lambda value: value.to(target) if hasattr(value, "to") else value)
        if not isinstance(target, torch.dtype):
            moved.tokens, moved.attention_mask = self.tokens.to(target), self.attention_mask.to(target)
        return moved


def map_layers(
    model: adapter.Model,
    inputs: str | Sequence[str] | Tensor | adapter.TokenBatch,
    fn: Callable[[adapter.LayerInputs], T],
    *,
    layers: int | Sequence[int] | None = None,
    attention_mask: Tensor | None = None,
    prepend_bos: bool | None = None,
    edit: adapter.PatternEdit | None = None,
    capture: Sequence[str] = (),
    keep_logits: bool = False,
    whole_pass: bool = False,
    extra_hooks: Sequence[tuple[str, adapter.HookFn]] = (),
    qk: str | None = None,
) -> LayerResults[T]:
    """Run ``fn`` on every requested layer during one forward pass; keep only what it returns.

    ``fn`` receives an `contribution_lens.adapter.LayerInputs` (layer index, pattern, ``v``,
    ``W_O``, ``b_O``, ``z``, ``hook_out``, tokens, padding mask, model config, and a cached
    ``decompose(scope)``). Unless the logits are kept, the forward pass stops after the last
    requested layer.

    The pass runs in eval mode (no dropout; each module's own mode is restored afterwards) and
    holds the model: hooks live on the model, so a second thread's pass on the same model waits
    for this one (`contribution_lens.adapter.exclusive`) instead of reading its numbers.

    Args:
        model: a TransformerLens ``TransformerBridge`` (decoder or encoder).
        inputs: a text, a list of texts (right-padded), token ids ``[pos]``/``[batch pos]``,
            or a `contribution_lens.adapter.TokenBatch`.
        fn: the per-layer function.
        layers: layer indices (negative ones count from the end); None for all.
        attention_mask: padding mask for token ids (1 = real token).
        prepend_bos: prepend the tokenizer's BOS to texts; None: the model's own choice (`adapter.prepends_bos`).
        edit: ``edit(layer, pattern, v)`` returning a replacement pattern, applied in the hook
            before ``fn`` sees it (an intervention); the rest of the pass uses the edited one.
        capture: extra hooks per layer, relative to ``blocks.{l}`` (e.g. ``"hook_resid_pre"``).
        keep_logits: run the whole pass and keep its logits in ``.logits``.
        whole_pass: run the whole pass without keeping its logits (for ``extra_hooks`` that
            read the final norm or the unembedding, and may cut its rows).
        extra_hooks: further ``(hook name, function)`` pairs active during the pass.
        qk: ``"record"``: ``fn`` also gets each layer's queries and keys (``layer.qk``); ``"tiles"``: the
            pass runs attention a tile of queries at a time and holds no pattern, which ``fn`` then
            reads a tile at a time (``layer.tiles()``, ``layer.pattern_rows(tile)``,
            ``layer.decompose_rows(scope, tile)``; `contribution_lens.adapter.layer_hooks`). Either
            needs a model whose attention goes through transformers (`contribution_lens.adapter.attention_forms`).
            ``"auto"``: ``"tiles"`` where one layer's pattern would pass `WHOLE_PATTERN_BYTES` and the
            model allows it, else the ordinary pass (for an ``fn`` that reads the pattern in tiles).
    """
    wanted = adapter.check_layers(model, layers)
    batch = _token_batch(model, inputs, attention_mask, prepend_bos)
    adapter.is_causal_model(model)  # an unknown attention_dir fails before the pass
    if qk == "auto":
        qk = "tiles" if not pattern_fits(model, batch) and adapter.tiles_problem(model) is None else None
    forms = None if qk is None else adapter.attention_forms(model)  # its probe pass, before this one
    results: dict[int, T] = {}

    def on_layer(layer: adapter.LayerInputs) -> None:
        results[layer.layer] = fn(layer)

    logits = None
    hooks = adapter.layer_hooks(
        model, batch, wanted, on_layer, edit=edit, capture=capture, stop_after_last=not (keep_logits or whole_pass),
        extra=extra_hooks, qk=qk, forms=forms,
    )  # fmt: skip
    with hooks:
        try:
            logits = adapter.forward(model, batch)
        except adapter.StopForward:
            pass
    if missing := [layer for layer in wanted if layer not in results]:
        raise RuntimeError(f"the forward pass never reached the hooks of layers {missing}")
    return LayerResults(
        results, tokens=batch.tokens, attention_mask=batch.attention_mask, str_tokens=batch.str_tokens,
        n_layers=adapter.n_layers(model), logits=logits if keep_logits else None, bos_first=batch.bos_first,
    )  # fmt: skip


def _token_batch(
    model: adapter.Model,
    inputs: str | Sequence[str] | Tensor | adapter.TokenBatch,
    attention_mask: Tensor | None,
    prepend_bos: bool | None,
) -> adapter.TokenBatch:
    """`map_layers`'s ``inputs`` as a batch of token ids (a batch already made is used as it is)."""
    if isinstance(inputs, adapter.TokenBatch):
        return inputs
    return adapter.to_token_batch(model, inputs, attention_mask=attention_mask, prepend_bos=prepend_bos)


def pattern_fits(model: adapter.Model, batch: adapter.TokenBatch) -> bool:
    """Whether one layer's pattern of ``batch``, in float32, fits `WHOLE_PATTERN_BYTES` (else read it in tiles)."""
    texts, length = batch.tokens.shape
    return texts * int(model.cfg.n_heads) * length * length * 4 <= WHOLE_PATTERN_BYTES


def tiles_mode(tiles: bool | None) -> str | None:
    """The ``qk`` of `map_layers` for an analysis's ``tiles``: True ``"tiles"``, False None, None ``"auto"``."""
    if tiles is not None and not isinstance(tiles, bool):
        raise ValueError(f"tiles must be True, False or None (the length decides), got {tiles!r}")
    return "auto" if tiles is None else "tiles" if tiles else None
