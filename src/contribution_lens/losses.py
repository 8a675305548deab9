"""Next-token losses of a forward pass: what every intervention is measured by.

For logits ``l`` and tokens ``t`` of one sequence, the negative log-likelihood of position ``p``'s
prediction is ``-log softmax(l_{p-1})[t_p]``; only pairs of real tokens count (padding predicts
nothing and is never predicted). Everything is accumulated in float32 and summed in float64.

Example:
    >>> import torch
    >>> logits = torch.zeros(1, 3, 4)  # uniform over 4 tokens
    >>> nll, count = token_nll(logits, torch.tensor([[0, 1, 2]]), torch.ones(1, 3, dtype=torch.bool))
    >>> round(float(nll[0]) / int(count[0]), 4), round(perplexity(float(nll[0]), int(count[0])), 4)
    (1.3863, 4.0)
"""

import math

import einops
import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor


def _next_token_logprobs(
    logits: Float[Tensor, "batch pos d_vocab"], tokens: Int[Tensor, "batch pos"]
) -> Float[Tensor, "batch pos_minus_1"]:
    """``log p(t_p | t_<p)`` for ``p = 1 .. pos-1``."""
    log_probs = F.log_softmax(logits[:, :-1].float(), dim=-1)
    return log_probs.gather(-1, einops.rearrange(tokens[:, 1:], "batch pos -> batch pos 1"))[..., 0]


def predicted_positions(attention_mask: Bool[Tensor, "batch pos"]) -> Bool[Tensor, "batch pos_minus_1"]:
    """Where a real token predicts a real token."""
    return attention_mask[:, 1:] & attention_mask[:, :-1]


def token_nll(
    logits: Float[Tensor, "batch pos d_vocab"],
    tokens: Int[Tensor, "batch pos"],
    attention_mask: Bool[Tensor, "batch pos"],
) -> tuple[Float[Tensor, " batch"], Int[Tensor, " batch"]]:
    """Summed next-token negative log-likelihood and number of predicted tokens, per sequence."""
    nll = -_next_token_logprobs(logits, tokens)
    predicted = predicted_positions(attention_mask)
    return torch.where(predicted, nll, 0).sum(-1).double(), predicted.sum(-1)


def mean_token_nll(
    logits: Float[Tensor, "batch pos d_vocab"],
    tokens: Int[Tensor, "batch pos"],
    attention_mask: Bool[Tensor, "batch pos"],
    *,
    what: str = "a next-token loss",
) -> Float[Tensor, ""]:
    """Mean negative log-likelihood of every real next token of the batch (differentiable).

    ``what`` names the caller in the error raised when no text has a next token.
    """
    predicted = predicted_positions(attention_mask)
    if not bool(predicted.any()):
        raise ValueError(f"{what} needs at least two tokens in a text: there is no next token to predict")
    return -_next_token_logprobs(logits, tokens)[predicted].mean()


def continuation_logprob(
    logits: Float[Tensor, "batch pos d_vocab"], tokens: Int[Tensor, "batch pos"], starts: Tensor, ends: Tensor
) -> Float[Tensor, " batch"]:
    """Log-likelihood of tokens ``[start, end)`` of each sequence given everything before."""
    picked = _next_token_logprobs(logits, tokens)
    positions = torch.arange(1, tokens.shape[1], device=tokens.device)
    inside = (positions[None, :] >= starts[:, None]) & (positions[None, :] < ends[:, None])
    return torch.where(inside, picked, 0).sum(-1).double()


def perplexity(nll_sum: float, n_tokens: int) -> float:
    """``exp(nll_sum / n_tokens)``."""
    return math.exp(nll_sum / n_tokens)
