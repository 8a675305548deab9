"""``logit_attribution`` as a measure: each key's direct effect on a text's last next-token logit.

For a text of ``n`` tokens the explained prediction is position ``e = n - 2`` and its target the
text's own last token ``t_{n-1}``. `contribution_lens.logit_attribution` splits that logit into
exact terms; the score of key ``j`` is the sum of its attention terms over every layer and head,

    s_ej = sum_l sum_h alpha_ej^{h,l} <vt_j^{h,l}, u_l>

(``u_l`` the unembedding direction of ``t_{n-1}`` pulled back through the frozen norms). Only
row ``e`` is scored (every other row is 0) and it is the same at every layer: the measure is meant
for the ``prediction`` faithfulness protocol, which reads exactly that row. One forward pass per
text (decoders with an LM head only).
"""

from collections.abc import Sequence

import torch
from jaxtyping import Float
from torch import Tensor

from contribution_lens import adapter
from contribution_lens.analyses.logit_attribution import attribute_positions
from contribution_lens.methods.method import Method, prepared_score


def last_prediction_scores(
    model: adapter.Model, batch: adapter.TokenBatch, layers: Sequence[int]
) -> dict[int, Float[Tensor, "batch query key"]]:
    """Per requested layer, ``[batch query key]`` zeros but for row ``n - 2`` of each text: ``s_ej``."""
    batch_size, length = batch.tokens.shape
    scores = torch.zeros(batch_size, length, length, dtype=torch.float32, device=batch.tokens.device)
    for row, n in enumerate(batch.lengths.tolist()):
        if n < 3:
            raise ValueError(f"logit_attribution scores a text's last prediction: text {row} has {n} tokens")
        tokens = batch.tokens[row, :n]
        one = adapter.TokenBatch(tokens[None], batch.attention_mask[row, :n][None], [batch.str_tokens[row]])
        (result,) = attribute_positions(model, one, [n - 2], [int(tokens[n - 1])], [None])
        values = torch.tensor(result.by_key().to_numpy(copy=True), dtype=torch.float32)
        scores[row, n - 2, : values.shape[0]] = values.to(scores.device)
    return {layer: scores for layer in layers}


METHODS: tuple[Method, ...] = (
    Method(
        "logit_attribution",
        prepared_score,
        "each key's direct effect on the text's last next-token logit, summed over layers and heads "
        "(row n - 2 only: for the prediction protocol)",
        signed=True,
        prepare=last_prediction_scores,
        builtin=True,
    ),
)
