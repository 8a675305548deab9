"""Model-level contribution weights: one forward pass, every requested layer decomposed in its hook."""

from collections.abc import Sequence
from dataclasses import dataclass

import einops
import pandas as pd
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor
from transformer_lens import ActivationCache

from contribution_lens import adapter
from contribution_lens.decomposition import FACTORS, SCOPES, Decomposition, Scope, decompose


@dataclass(frozen=True)
class Geometry:
    """Per-layer `Decomposition` of a batch, with the tokens that label it.

    Index it by layer: ``geometry[3].contribution`` is ``[batch head query key]``.
    """

    layers: dict[int, Decomposition]
    tokens: Int[Tensor, "batch pos"]
    attention_mask: Bool[Tensor, "batch pos"]
    str_tokens: list[list[str]]
    scope: str

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("a Geometry needs at least one layer")
        for layer, d in self.layers.items():
            if d.attention.shape[0] != self.tokens.shape[0] or d.attention.shape[-1] != self.tokens.shape[1]:
                raise ValueError(
                    f"layer {layer} has shape {tuple(d.attention.shape)}, tokens {tuple(self.tokens.shape)}"
                )

    def __getitem__(self, layer: int) -> Decomposition:
        if layer not in self.layers:
            raise KeyError(f"layer {layer} was not computed; computed layers: {sorted(self.layers)}")
        return self.layers[layer]

    def labels(self, index: int = 0) -> list[str]:
        """Unique axis labels ``"{position}:{token}"`` for batch element ``index``."""
        return [f"{i}:{token}" for i, token in enumerate(self.str_tokens[index])]

    def head_summary(self, factor: str = "contribution") -> Float[Tensor, "layer head"]:
        """Mean of ``factor`` over every valid (query, key) pair of the batch, per layer and head.

        Rows follow ``sorted(self.layers)``.
        """
        if factor not in FACTORS:
            raise ValueError(f"unknown factor {factor!r}; expected one of {FACTORS}")
        rows = []
        for layer in sorted(self.layers):
            d = self.layers[layer]
            valid = einops.rearrange(d.valid, "batch query key -> batch 1 query key").to(d.attention.dtype)
            total = einops.reduce(d.factor(factor) * valid, "batch head query key -> head", "sum")
            rows.append(total / valid.sum().clamp_min(1))
        return torch.stack(rows)

    def layer_summary(self) -> pd.DataFrame:
        """One row per layer: how far attention and contribution disagree, token level.

        Columns: ``sink_attention`` and ``sink_contribution`` (mean over real queries
        ``i > 0`` of the head-averaged attention to, and the summed contribution of, key 0),
        ``negative_share`` (share of attended (head, query, key) triples whose weight is
        negative) and ``top1_agreement`` (share of queries whose most-attended key is also
        the key of largest contribution).
        """
        rows = []
        for layer in sorted(self.layers):
            d = self.layers[layer]
            real_query = self.attention_mask.to(d.attention.device).clone()
            real_query[:, 0] = False  # query 0 can only see itself
            attention = d.attention.mean(1)  # [batch query key]
            contribution = d.sum_over_heads()
            attended = d.attention > 0
            agree = attention.argmax(-1) == contribution.argmax(-1)
            rows.append(
                {
                    "layer": layer,
                    "sink_attention": attention[..., 0][real_query].mean().item(),
                    "sink_contribution": contribution[..., 0][real_query].mean().item(),
                    "negative_share": ((d.contribution < 0) & attended).sum().item() / max(1, attended.sum().item()),
                    "top1_agreement": agree[real_query].float().mean().item(),
                }
            )
        return pd.DataFrame(rows).set_index("layer")


def attention_geometry(
    model: adapter.Model,
    inputs: str | Sequence[str] | Tensor | ActivationCache,
    *,
    layers: int | Sequence[int] | None = None,
    scope: Scope = "inter",
    attention_mask: Tensor | None = None,
    tokens: Tensor | None = None,
    dtype: torch.dtype | None = None,
    prepend_bos: bool = True,
) -> Geometry:
    """Contribution weights and their factors for every requested layer, in one forward pass.

    Each layer is decomposed inside its ``hook_pattern``/``hook_v`` hooks (see
    `contribution_lens.decomposition.decompose`), so the activation cache is never stored.

    Args:
        model: a TransformerLens ``TransformerBridge``.
        inputs: a text, a list of texts (right-padded; padding carries no weight and is
            marked in ``attention_mask``), token ids ``[pos]``/``[batch pos]``, or an
            ``ActivationCache`` from ``model.run_with_cache`` (no forward pass then).
        layers: layer indices; None for all.
        scope: ``"inter"`` (weights over heads and keys sum to 1) or ``"intra"`` (per head).
        attention_mask: padding mask for token ids or a cache (1 = real token).
        tokens: the token ids a cache was computed from, for labels.
        dtype: accumulation dtype (float32 by default, whatever the model's dtype).
        prepend_bos: prepend BOS to texts (see `contribution_lens.adapter`).

    Example:
        >>> import contribution_lens as cl
        >>> model = cl.load_model()
        >>> g = cl.attention_geometry(model, "The cat sat on the mat.", layers=[0, 5])
        >>> g.str_tokens[0][:3]
        ['<|im_start|>', 'The', ' cat']
        >>> round(g[5].sum_over_heads()[0, -1].sum().item(), 4)
        1.0
    """
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    wanted = adapter.check_layers(model, layers)
    adapter.check_hooks(model, wanted)
    if isinstance(inputs, ActivationCache):
        return _from_cache(model, inputs, wanted, scope, attention_mask, tokens, dtype)

    batch = adapter.to_token_batch(model, inputs, attention_mask=attention_mask, prepend_bos=prepend_bos)
    weights = {layer: adapter.output_weights(model, layer)[0] for layer in wanted}
    mask = batch.attention_mask if batch.padded else None
    results: dict[int, Decomposition] = {}

    def on_layer(layer: int, pattern: Tensor, v: Tensor, z: Tensor | None) -> None:
        results[layer] = decompose(pattern, v, weights[layer], scope=scope, attention_mask=mask, dtype=dtype, z=z)

    with adapter.layer_hooks(model, wanted, on_layer, with_z=True):
        adapter.forward(model, batch)
    return Geometry(results, batch.tokens, batch.attention_mask, batch.str_tokens, scope)


def _from_cache(
    model: adapter.Model,
    cache: ActivationCache,
    layers: list[int],
    scope: Scope,
    attention_mask: Tensor | None,
    tokens: Tensor | None,
    dtype: torch.dtype | None,
) -> Geometry:
    results = {}
    for layer in layers:
        for name in (adapter.pattern_hook(layer), adapter.value_hook(layer)):
            if name not in cache:
                raise ValueError(f"the cache has no {name!r}: run run_with_cache without a names_filter that drops it")
        pattern = cache[adapter.pattern_hook(layer)]
        if pattern.ndim == 3:
            raise ValueError("the cache was made with remove_batch_dim=True; use the default batched cache")
        mask = None if attention_mask is None else attention_mask.to(torch.bool)
        results[layer] = decompose(
            pattern,
            cache[adapter.value_hook(layer)],
            adapter.output_weights(model, layer)[0],
            scope=scope,
            attention_mask=mask,
            dtype=dtype,
        )
    first = results[layers[0]]
    batch, _, _, length = first.attention.shape
    if tokens is None:
        token_ids = torch.full((batch, length), -1, dtype=torch.long)
        str_tokens = [[f"<{i}>" for i in range(length)] for _ in range(batch)]
    else:
        token_ids = tokens.reshape(batch, length)
        str_tokens = [adapter.token_labels(model, row.tolist()) for row in token_ids]
    full_mask = (
        torch.ones(batch, length, dtype=torch.bool) if attention_mask is None else attention_mask.to(torch.bool).cpu()
    )
    if attention_mask is not None:
        str_tokens = [labels[: int(m.sum())] for labels, m in zip(str_tokens, full_mask, strict=True)]
    return Geometry(results, token_ids, full_mask, str_tokens, scope)
