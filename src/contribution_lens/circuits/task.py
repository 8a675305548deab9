"""A task a circuit is found for: prompts with counterfactuals, an answer and a foil per prompt.

The metric is read at each prompt's last real position ``last[p]``; by default the logit difference

    m_p = logit_p(answer_p) - logit_p(foil_p).
"""

from dataclasses import dataclass

import torch
from jaxtyping import Int
from torch import Tensor


@dataclass(frozen=True)
class Task:
    """Clean and corrupted token ids of equal shape, right-padded, one answer and one foil per prompt.

    ``last[p]`` is the index of prompt ``p``'s last real token (where the metric is read); positions
    after it are padding, which a causal model's earlier positions never see.
    """

    name: str
    clean: Int[Tensor, "prompt pos"]
    corrupted: Int[Tensor, "prompt pos"]
    answer: Int[Tensor, " prompt"]
    foil: Int[Tensor, " prompt"]
    last: Int[Tensor, " prompt"]
    metric: str = "logit_diff"

    def __post_init__(self) -> None:
        if self.clean.shape != self.corrupted.shape:
            raise ValueError(
                f"clean and corrupted must have the same shape (one token count a prompt), "
                f"got {tuple(self.clean.shape)} and {tuple(self.corrupted.shape)}"
            )
        if bool((self.answer == self.foil).any()):
            raise ValueError("foil must differ from answer in every prompt")

    def __len__(self) -> int:
        return int(self.clean.shape[0])

    @property
    def n_prompts(self) -> int:
        return len(self)

    @staticmethod
    def full_length(clean: Tensor) -> Tensor:
        """``last`` for unpadded prompts: every prompt's last position."""
        return torch.full((clean.shape[0],), clean.shape[1] - 1, dtype=torch.long)
