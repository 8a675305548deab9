"""The prediction view: explained next-token predictions of one text, and what the page draws of each step.

A step ``k`` explains one logit (or a logit difference against a foil) at position ``p_k``:
`contribution_lens.LogitAttribution` splits it into direct terms, attention heads' per key
and per head, MLPs, the embedding and biases, which add up to the logit. `steps_payload` sends
each step's terms; the page draws them per (layer, head) and per key, and a click on a head
opens that head's per-layer view at ``p_k``.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor

from contribution_lens import adapter
from contribution_lens.analyses.generation import GenerationExplanation
from contribution_lens.analyses.logit_attribution import LogitAttribution
from contribution_lens.views.inspector.codecs import encode
from contribution_lens.views.inspector.windows import token_label


@dataclass(frozen=True, eq=False)
class Steps:
    """Explained next-token predictions of one text: one `LogitAttribution` a step, and its flow rollout if any.

    ``rollouts[k]`` is the last layer's row of step ``k``'s `contribution_lens.Flow` rollout
    (``[key]``: each input token's signed share of the position's residual stream), or None.
    """

    results: tuple[LogitAttribution, ...]
    rollouts: tuple[Tensor | None, ...]

    @classmethod
    def of(cls, explained: Any) -> "Steps | None":
        """The steps of a `GenerationExplanation`, a `LogitAttribution` or a sequence of them (one text); else None."""
        if isinstance(explained, GenerationExplanation):
            rollouts = tuple(None if s.flow is None else s.flow.rollout[-1] for s in explained)
            return cls(tuple(step.attribution for step in explained), rollouts)
        if isinstance(explained, LogitAttribution):
            return cls((explained,), (None,))
        if isinstance(explained, Sequence) and explained and all(isinstance(r, LogitAttribution) for r in explained):
            first = explained[0]
            if any(not torch.equal(r.tokens, first.tokens) for r in explained):
                raise ValueError("the logit attributions explain different texts: the inspector shows one text")
            return cls(tuple(explained), (None,) * len(explained))
        return None

    @property
    def tokens(self) -> Int[Tensor, " pos"]:
        return self.results[0].tokens

    @property
    def positions(self) -> list[int]:
        return [result.position for result in self.results]

    def check_model(self, model: adapter.Model, labels: list[str]) -> None:
        """Refuse steps another model made: the layer and head counts and the tokens' labels must match."""
        n_layers, n_heads = self.results[0].attention.shape[:2]
        mine = (adapter.n_layers(model), int(model.cfg.n_heads))
        if (n_layers, n_heads) != mine:
            raise ValueError(
                f"these predictions were explained on a model of {n_layers} layers and {n_heads} heads; "
                f"this one has {mine[0]} and {mine[1]}: inspect them with the model that made them"
            )
        theirs = [token_label(i, t) for i, t in enumerate(self.results[0].str_tokens)]
        if theirs != labels:
            raise ValueError(
                "these predictions' tokens read differently with this model's tokenizer: "
                "inspect them with the model that made them"
            )


def steps_payload(steps: Steps, labels: list[str]) -> dict[str, Any]:
    """What the prediction view draws of each step: the head and key terms, float32 (the ``exact`` codec).

    Per step ``k``: ``heads [layer head]``, the attention terms summed over keys
    (`LogitAttribution.by_head`), ``keys [position + 1]``, summed over layers and heads
    (`LogitAttribution.by_key`), ``rollout`` (the flow's last-layer shares, when there is one),
    the explained quantity and how the logit splits: ``parts`` (attention, MLPs, embedding,
    biases, and ``rounding``: a half-precision model's rounding of its attention outputs, else 0)
    add up to ``logit`` (the float readout) up to float rounding; ``model_value`` is the value the
    model computed in its own dtype (None where not recorded).

    Example:
        >>> import base64, torch
        >>> from contribution_lens import LogitAttribution
        >>> r = LogitAttribution(tokens=torch.tensor([5, 6]), str_tokens=["a", "b"], position=1, target=7,
        ...     target_token="c", foil=None, foil_token=None, logit=1.5, attention=torch.full((2, 3, 2), 0.125),
        ...     attention_bias=torch.zeros(2), post_norm_bias=torch.zeros(2), mlp=torch.zeros(2), embed=0.0)
        >>> sent = steps_payload(Steps((r,), (None,)), ["0:a", "1:b"])["steps"][0]
        >>> sent["quantity"], sent["parts"]["attention"], len(base64.b64decode(sent["heads"])) // 4
        ("logit('c')", 1.5, 6)
    """
    n_layers, n_heads = steps.results[0].attention.shape[:2]
    sent = []
    for result, rollout in zip(steps.results, steps.rollouts, strict=True):
        biases = result.attention_bias.sum() + result.post_norm_bias.sum()
        parts = {
            "attention": float(result.attention.double().sum()),
            "mlp": float(result.mlp.double().sum()),
            "embedding": result.embed,
            "biases": float(biases) + result.final_norm_bias + result.unembed_bias,
            "rounding": 0.0 if result.attention_rounding is None else float(result.attention_rounding.double().sum()),
        }
        sent.append(
            {
                "position": result.position,
                "token": result.target_token,
                "quantity": result.quantity,
                "logit": result.logit,
                "model_value": result.model_value,
                "parts": parts,
                "heads": encode(result.by_head().to_numpy(), "exact"),
                "keys": encode(result.by_key().to_numpy(), "exact"),
                "rollout": None if rollout is None else encode(rollout[: result.visible].cpu().numpy(), "exact"),
            }
        )
    return {"labels": labels, "n_layers": int(n_layers), "n_heads": int(n_heads), "steps": sent}
