"""Each layer's attention as queries and keys: kept from a pass, or the pass itself run a tile of queries at a time.

A layer's pattern can be rebuilt from what enters ``q k^T`` (`contribution_lens.tiles.QueryKeys`):
the rotated (and normed) queries and keys, the scale, a soft-cap, a sliding window, the padding.
Each layer's `AttentionForm` says what the model applies (its scale, soft-cap and window, read where
transformers hands them to the attention function; `contribution_lens.adapter.qk_forms` learns and
checks them on a probe); the forms serve two passes of `contribution_lens.adapter.layer_hooks`:

* ``qk="record"``: the ordinary pass, which also keeps each layer's queries and keys (``hook_rot_q``
  and ``hook_rot_k`` where the bridge rotates them, else ``hook_q`` and ``hook_k``): what the
  inspector keeps to decompose the layers it did not show yet, without another pass;
* ``qk="tiles"`` (`tiled_attention`): every attention layer runs through transformers' own attention
  module with an attention function of this package's, which computes the output a tile of queries
  at a time (`contribution_lens.tiles.attend`): no ``[batch head query key]`` tensor is ever held, and
  ``hook_pattern`` does not fire. What a 32,768-token text needs: SmolLM2's 9 heads hold 38 GB of
  pattern a layer in float32.

Bridges whose attention does not go through transformers' attention functions (TransformerLens's
native attention) have no forms (`contribution_lens.adapter.qk_forms.tiles_problem` says why), and
their passes keep the pattern.
"""

import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import einops
import torch
from torch import Tensor

from contribution_lens.adapter._model import Model
from contribution_lens.adapter.tokens import TokenBatch
from contribution_lens.tiles import QueryKeys, attend

TILED = "contribution_lens_tiles"
"""The name this package's attention function is registered under in transformers (`tiled_attention`)."""


@dataclass(frozen=True)
class AttentionForm:
    """How one layer turns its queries and keys into its pattern (`contribution_lens.tiles.QueryKeys`' fields),
    and the hooks a pass reads them from (relative to ``blocks.{l}``, ``[batch pos head d_head]``)."""

    scale: float
    softcap: float | None
    window: int | None
    causal: bool
    q_hook: str
    k_hook: str

    def query_keys(
        self, q: Tensor, k: Tensor, attention_mask: Tensor | None, dtype: torch.dtype | None = None
    ) -> QueryKeys:
        """The layer's `QueryKeys` from ``q`` and ``k`` as the hooks fire them (``[batch pos head d_head]``)."""
        return QueryKeys(
            einops.rearrange(q, "batch pos head d_head -> batch head pos d_head"),
            einops.rearrange(k, "batch pos head d_head -> batch head pos d_head"),
            scale=self.scale,
            softcap=self.softcap,
            causal=self.causal,
            window=self.window,
            attention_mask=attention_mask,
            dtype=dtype,
        )


_RECEIVERS: dict[int, tuple[int, Callable[[int, QueryKeys], None], Tensor | None]] = {}
"""While a tiled pass runs: per attention module (by id), its layer, where its queries and keys go, the padding."""


def _attention(
    module: Any,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention-function interface, a tile of queries at a time (`tiled_attention`).

    ``query`` is ``[batch head query d_head]``, ``key`` and ``value`` ``[batch kv_head key d_head]``, as
    transformers hands them to every attention function (rotated and normed); the output is
    ``[batch query head d_head]``, and no pattern is returned.
    """
    found = _RECEIVERS.get(id(module))
    if found is None:
        raise RuntimeError(f"the attention function {TILED!r} ran outside contribution_lens.adapter.tiled_attention")
    if kwargs.get("s_aux") is not None:
        raise ValueError("learned attention-sink logits (an extra softmax column, GPT-OSS) cannot be tiled")
    layer, receive, padding = found
    qk = QueryKeys(
        query,
        key,
        scale=query.shape[-1] ** -0.5 if scaling is None else float(scaling),
        softcap=float(softcap) if softcap else None,
        causal=bool(getattr(module, "is_causal", True)),
        window=None if sliding_window is None else int(sliding_window),
        attention_mask=padding,
        dtype=query.dtype,
    )
    receive(layer, qk)
    return attend(qk, value.to(query.dtype)), None


def _register() -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if TILED not in ALL_ATTENTION_FUNCTIONS:
        # Not registered as a mask function too: transformers then builds no mask for it (the padding and
        # the causal and sliding-window structure are the attention function's own, `QueryKeys.visible`).
        ALL_ATTENTION_FUNCTIONS.register(TILED, _attention)


@contextmanager
def tiled_attention(model: Model, batch: TokenBatch, receive: Callable[[int, QueryKeys], None]) -> Iterator[None]:
    """While it lasts, every attention layer of ``model`` runs a tile of queries at a time; ``receive(layer, qk)``.

    The bridge's own reimplementation of attention (which holds the pattern) gives way to
    TransformerLens's delegation to the transformers module, whose attention function is this
    package's (`_attention`, registered as `TILED`): ``hook_v``, ``hook_z`` and the o-projection's
    hooks fire as before, ``hook_attn_scores`` and ``hook_pattern`` do not. Everything is restored
    afterwards. Call it inside `contribution_lens.adapter.exclusive` (`layer_hooks` does).
    """
    from transformer_lens.model_bridge.generalized_components.attention import AttentionBridge

    _register()
    padding = None if not batch.padded else batch.attention_mask.to(torch.bool)
    configs: dict[int, tuple[Any, str]] = {}
    delegated: list[Any] = []
    try:
        for layer, block in enumerate(model.blocks):
            bridge = block.attn
            for module in bridge.original_component.modules():
                _RECEIVERS[id(module)] = (layer, receive, padding)
                config: Any = getattr(module, "config", None)
                if hasattr(config, "_attn_implementation") and id(config) not in configs:
                    configs[id(config)] = (config, config._attn_implementation)
            if isinstance(bridge, AttentionBridge) and type(bridge).forward is not AttentionBridge.forward:
                # The bridge's own forward builds the pattern; the base class's delegates to transformers.
                bridge.__dict__["forward"] = types.MethodType(AttentionBridge.forward, bridge)
                delegated.append(bridge)
        for config, _ in configs.values():
            config._attn_implementation = TILED
        yield
    finally:
        for config, implementation in configs.values():
            config._attn_implementation = implementation
        for bridge in delegated:
            bridge.__dict__.pop("forward", None)
        for block in model.blocks:
            for module in block.attn.original_component.modules():
                _RECEIVERS.pop(id(module), None)
