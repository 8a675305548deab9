"""Explaining a generated answer: every new token's logit attribution from one teacher-forced pass.

Generation itself is a greedy loop (one forward pass per new token, no key-value cache: the
bridge's own ``generate()`` needs ``use_past_kv_cache=False`` for its hooks to see every position).
Then prompt and answer run once more, together: step ``k`` explains the logit of answer token
``k`` at the position before it, with every position's terms read from that single pass.

    >>> import contribution_lens as cl
    >>> model = cl.load_model()
    >>> explained = cl.explain_generation(model, "The capital of France is", max_new_tokens=3)
    >>> explained[0].token
    ' Paris'
    >>> all(abs(step.attribution.total() - step.attribution.logit) < 1e-3 for step in explained)
    True
    >>> import tempfile
    >>> path = explained.save(tempfile.mkdtemp() + "/answer.safetensors")  # one file, every step
    >>> cl.GenerationExplanation.load(path)[0].token
    ' Paris'
"""

import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, overload

import pandas as pd
import torch
from jaxtyping import Int
from torch import Tensor
from tqdm.auto import tqdm

from contribution_lens import adapter
from contribution_lens.analyses.flow import DEFAULT_THRESHOLD, Flow, _flow_layer
from contribution_lens.analyses.logit_attribution import (
    LogitAttribution,
    TokenLike,
    attribute_with,
    check_decoder,
    one_text,
    token_id,
)
from contribution_lens.choices import as_count, as_threshold
from contribution_lens.decomposition import accumulation_dtype
from contribution_lens.files import Saves

if TYPE_CHECKING:
    import plotly.graph_objects as go


@dataclass(frozen=True, eq=False)
class GenerationStep:
    """One generated token: which it is, where it was predicted, and why.

    ``attribution`` splits its logit into direct terms (`LogitAttribution`); ``flow`` is the
    token mixing of every layer, rolled out at ``position`` (`contribution_lens.flow`), or None
    when `explain_generation` ran with ``flow=False``.
    """

    token: str
    token_id: int
    position: int
    """The position whose next-token prediction this token is (the token itself sits at ``position + 1``)."""
    attribution: LogitAttribution
    flow: Flow | None = None

    @property
    def model_value(self) -> float | None:
        """The explained logit as the model computed it, in its own dtype (`LogitAttribution.model_value`)."""
        return self.attribution.model_value

    @property
    def rounding_gap(self) -> float | None:
        """``model_value - attribution.logit``: the model's own rounding (`LogitAttribution.rounding_gap`)."""
        return self.attribution.rounding_gap

    def __repr__(self) -> str:
        key = int(self.attribution.by_key().idxmax())
        return (
            f"GenerationStep({self.token!r} from position {self.position}, logit {self.attribution.logit:.4g}, "
            f"top key {key}:{self.attribution.str_tokens[key]!r})"
        )


@dataclass(frozen=True, eq=False)
class GenerationExplanation(Saves, Sequence[GenerationStep]):
    """A prompt, the answer generated from it and one `GenerationStep` per answer token.

    ``save(path)`` writes it all to one ``.safetensors`` file, ``GenerationExplanation.load(path)``
    reads it back. Steps whose flows come from one pass (all of `explain_generation`'s) share one
    copy of its layers, on disk as in memory.
    """

    prompt: str | None
    tokens: Int[Tensor, " pos"]
    str_tokens: list[str]
    prompt_length: int
    """Tokens of the prompt (BOS included where it has one): the answer starts at this position."""
    steps: tuple[GenerationStep, ...]

    @property
    def answer(self) -> str:
        return "".join(step.token for step in self.steps)

    @overload
    def __getitem__(self, index: int) -> GenerationStep: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[GenerationStep]: ...
    def __getitem__(self, index: int | slice) -> GenerationStep | Sequence[GenerationStep]:
        return self.steps[index]

    def __len__(self) -> int:
        return len(self.steps)

    def __iter__(self) -> Iterator[GenerationStep]:
        return iter(self.steps)

    def to_dataframe(self) -> pd.DataFrame:
        """One row per answer token: its logit, the key with the largest attention terms and theirs, the MLPs' sum.

        ``logit`` is what the terms add up to (the float readout), ``model_value`` the model's own value
        in its dtype and ``rounding_gap`` their difference (NaN for a result saved without them).
        """
        rows = []
        for index, step in enumerate(self.steps):
            keys = step.attribution.by_key()
            top = int(keys.idxmax())
            rows.append(
                {
                    "step": index,
                    "position": step.position,
                    "token": step.token,
                    "logit": step.attribution.logit,
                    "model_value": math.nan if step.model_value is None else step.model_value,
                    "rounding_gap": math.nan if step.rounding_gap is None else step.rounding_gap,
                    "top_key": top,
                    "top_key_token": self.str_tokens[top],
                    "top_key_value": float(keys[top]),
                    "attention": float(keys.sum()),
                    "mlp": float(step.attribution.mlp.sum()),
                }
            )
        return pd.DataFrame(rows).set_index("step")

    def key_matrix(self) -> pd.DataFrame:
        """Rows: answer tokens; columns: key positions; each cell the key's attention terms (0 where unseen)."""
        width = len(self.str_tokens)
        rows = {}
        for index, step in enumerate(self.steps):
            keys = step.attribution.by_key()
            rows[f"{index}:{step.token}"] = keys.reindex(range(width), fill_value=0.0).to_numpy()
        table = pd.DataFrame.from_dict(
            rows, orient="index", columns=[f"{j}:{t}" for j, t in enumerate(self.str_tokens)]
        )
        return table.iloc[:, : max(1, width - 1)]

    def figures(self) -> "dict[str, go.Figure]":
        """``keys``: the answer tokens x keys heatmap of attention terms."""
        from contribution_lens.drawing import plot

        return {"keys": plot.generation_keys(self)}

    def __repr__(self) -> str:
        return (
            f"GenerationExplanation({len(self.steps)} tokens: {self.answer!r}, prompt of {self.prompt_length} tokens)"
        )

    def report(self, path: str | os.PathLike) -> Path:
        """One self-contained HTML page: the prompt and answer, the figures and one row per answer token."""
        from contribution_lens.drawing import html

        sections: list[html.Section] = [
            ("Prompt and answer", "".join(self.str_tokens[: self.prompt_length]) + " ▸ " + self.answer),
            *self.figures().items(),
            ("Per answer token", self.to_dataframe()),
        ]
        return html.write_html(path, f"GenerationExplanation of {self.answer!r}", sections)


def greedy_tokens(
    model: adapter.Model, prompt: Int[Tensor, " pos"], max_new_tokens: int, *, stop_at_eos: bool = True
) -> Int[Tensor, " new"]:
    """Greedy continuation of ``prompt``: one full forward pass per new token (no key-value cache)."""
    tokens = prompt.clone()
    eos = getattr(getattr(model, "tokenizer", None), "eos_token_id", None)
    new: list[int] = []
    # The bar is left at its last frame (leave=True), so a saved notebook does not keep its first one.
    for _ in tqdm(range(max_new_tokens), desc="generating"):
        adapter.check_length(model, tokens.shape[0] + 1, "prompt and answer")
        next_id = int(adapter.forward(model, adapter.to_token_batch(model, tokens))[0, -1].argmax())
        new.append(next_id)
        tokens = torch.cat([tokens, torch.tensor([next_id], device=tokens.device)])
        if stop_at_eos and eos is not None and next_id == int(eos):
            break
    return torch.tensor(new, dtype=torch.long)


def _answer_ids(
    model: adapter.Model, answer: str | Sequence[TokenLike] | Tensor, readout: adapter.Readout
) -> list[int]:
    if isinstance(answer, str):
        ids = model.tokenizer.encode(answer, add_special_tokens=False)
    elif isinstance(answer, Tensor):
        ids = answer.reshape(-1).tolist()
    else:
        ids = [token_id(model, token, "answer token", readout) for token in answer]
    checked = [token_id(model, int(i), "answer token", readout) for i in ids]
    if not checked:
        raise ValueError("answer is empty: there is no token to explain")
    return checked


def explain_generation(
    model: adapter.Model,
    prompt: str | Tensor,
    max_new_tokens: int = 20,
    *,
    answer: str | Sequence[TokenLike] | Tensor | None = None,
    stop_at_eos: bool = True,
    flow: bool = True,
    threshold: float = DEFAULT_THRESHOLD,
    prepend_bos: bool | None = None,
    dtype: torch.dtype | str = torch.float32,
) -> GenerationExplanation:
    """Generate greedily from ``prompt`` (or take ``answer``) and explain every answer token's logit.

    Step ``k`` is `contribution_lens.logit_attribution` of answer token ``k`` at the position
    before it, and (with ``flow``) `contribution_lens.flow` rolled out at that position; all
    steps, attributions and flows, come from one teacher-forced forward pass over prompt + answer.

    Args:
        model: a decoder ``TransformerBridge`` with an LM head.
        prompt: a text (tokenised as the model does, see ``prepend_bos``) or token ids ``[pos]``.
        max_new_tokens: how many tokens to generate at most (greedy decoding).
        answer: explain this continuation instead of generating one (a text, tokens or ids).
        stop_at_eos: stop generating after the tokenizer's end-of-sequence token.
        flow: also compute every step's flow in the same pass (``step.flow``).
        threshold: the flow graph's smallest kept edge weight (see `contribution_lens.flow`).
        prepend_bos: prepend the tokenizer's BOS to a text prompt; None: the model's own choice
            (``cfg.default_prepend_bos``).
        dtype: accumulation dtype of the terms (float32 or float64, or its name:
            `contribution_lens.decomposition.accumulation_dtype`).
    """
    dtype = accumulation_dtype(dtype)
    readout = check_decoder(model)
    if answer is None:
        max_new_tokens = as_count(max_new_tokens, "max_new_tokens")
    threshold = as_threshold(threshold)
    batch = one_text(model, prompt, prepend_bos)
    prompt_ids = batch.tokens[0]
    if answer is None:
        new = greedy_tokens(model, prompt_ids, max_new_tokens, stop_at_eos=stop_at_eos).tolist()
    else:
        new = _answer_ids(model, answer, readout)
    full = torch.cat([prompt_ids, torch.tensor(new, dtype=torch.long, device=prompt_ids.device)])
    adapter.check_length(model, full.shape[0], "prompt and answer")
    whole = adapter.to_token_batch(model, full)
    start = prompt_ids.shape[0]
    positions = list(range(start - 1, start - 1 + len(new)))
    also = (lambda layer: _flow_layer(readout, layer, threshold)) if flow else None
    capture = readout.flow_capture if flow else ()
    explained, flows = attribute_with(
        model, whole, positions, new, [None] * len(new), dtype=dtype, also=also, also_capture=capture, readout=readout
    )
    shared = None if flows is None else Flow.from_results(flows, positions=positions, threshold=threshold)
    steps = tuple(
        GenerationStep(
            token=result.target_token,
            token_id=result.target,
            position=result.position,
            attribution=result,
            flow=None if shared is None else shared.at(result.position),
        )
        for result in explained
    )
    return GenerationExplanation(
        prompt=prompt if isinstance(prompt, str) else None,
        tokens=whole.tokens[0].cpu(),
        str_tokens=whole.str_tokens[0],
        prompt_length=start,
        steps=steps,
    )
