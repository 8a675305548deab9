"""The ``random`` control: uniform scores that depend on (seed, the text's token ids, layer, position) alone.

So batching and padding never change a text's control, and a rerun draws the same numbers.

Example:
    >>> text_seed(0, [1, 2, 3], 4) == text_seed(0, [1, 2, 3], 4) != text_seed(1, [1, 2, 3], 4)
    True
"""

import zlib

import einops
import torch
from jaxtyping import Float
from torch import Tensor

from contribution_lens.adapter import LayerInputs
from contribution_lens.methods.method import Method, ScoreContext


def text_seed(seed: int, token_ids: list[int], layer: int) -> int:
    """A 32-bit seed from (seed, a text's token ids, layer): nothing about its batch."""
    payload = f"{seed}:{layer}:" + ",".join(map(str, token_ids))
    return zlib.crc32(payload.encode())


def random_score(layer: LayerInputs, context: ScoreContext) -> Float[Tensor, "batch head query key"]:
    """Uniform scores per (text, layer, head, query, key), padding-free and batch-free."""
    batch, n_heads, n_query, n_key = layer.pattern.shape
    out = torch.zeros(batch, n_heads, n_query, n_key, dtype=torch.float64)
    lengths = layer.attention_mask.sum(-1).tolist()
    for row, length in enumerate(lengths):
        ids = layer.tokens[row, :length].tolist()
        generator = torch.Generator().manual_seed(text_seed(context.seed, ids, layer.layer))
        out[row, :, :length, :length] = torch.rand(n_heads, length, length, generator=generator, dtype=torch.float64)
    out = out.to(layer.pattern.device)
    valid = einops.rearrange(layer.decompose(context.scope).valid, "batch query key -> batch 1 query key")
    return torch.where(valid, out, 0)


METHODS: tuple[Method, ...] = (
    Method("random", random_score, "seeded uniform scores (control)", control=True, default=True, builtin=True),
)
