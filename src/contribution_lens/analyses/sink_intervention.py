"""Removing the sink's value norm: zero ``vt_j`` for the sink keys (or rescale it to the mean tail norm).

Both variants scale ``alpha_ij^h`` for sink keys ``j < k`` (see `contribution_lens.interventions`):
by 0 (``"zero"``), or by ``mean_{j>=k} ||vt_j^h|| / ||vt_sink^h||`` (``"mean_tail"``), which keeps
the sink's direction and gives it a typical token's norm. Measured on the same chunks:
ΔPPL and Δloss, the mean output norm per layer, and the cone cosine of the outputs that had
the lowest norms in the clean run (bottom quartile per layer and head).
"""

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import einops
import pandas as pd
import torch
from torch import Tensor
from tqdm.auto import tqdm

from contribution_lens import adapter
from contribution_lens.analyses.sinks import SinkLayer, detect_sinks, sink_layer, sink_mask
from contribution_lens.choices import as_count
from contribution_lens.decomposition import head_gram
from contribution_lens.engine import map_layers
from contribution_lens.files import Saves
from contribution_lens.interventions import scale_pattern
from contribution_lens.losses import perplexity, token_nll

if TYPE_CHECKING:
    import plotly.graph_objects as go

VARIANTS = ("zero", "mean_tail")
RUNS = ("clean", "intervened")


def sink_scale(variant: str, k: int | None, W_O: Tensor) -> Callable[[int, Tensor, Tensor], Tensor]:
    """The pattern multiplier of one layer for a variant (1 outside the sink columns).

    The sink is the first ``k`` keys, or, with ``k=None``, the keys `detect_sinks` finds in the
    pattern being edited (for texts without a BOS at position 0).
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; expected one of {VARIANTS}")
    gram = head_gram(W_O.float())

    def scale(layer: int, pattern: Tensor, v: Tensor) -> Tensor:
        batch, _, _, n_key = pattern.shape
        is_sink = detect_sinks(pattern) if k is None else sink_mask(None, k, batch, n_key, pattern.device)
        sink_keys = einops.rearrange(is_sink, "b key -> b 1 1 key")
        factor = torch.ones((*pattern.shape[:2], 1, n_key), dtype=torch.float32, device=pattern.device)
        if variant == "zero":
            return factor.masked_fill_(sink_keys, 0)
        group = pattern.shape[1] // v.shape[2]
        values = einops.repeat(v.float(), "b key kv d -> b (kv group) key d", group=group)
        norms = einops.einsum(values, gram, values, "b h key d, h d e, b h key e -> b h key").clamp_min(0).sqrt()
        tail_keys = (~is_sink)[:, None, :].float()
        tail = (norms * tail_keys).sum(-1, keepdim=True) / tail_keys.sum(-1, keepdim=True).clamp_min(1)
        rescaled = torch.where(norms > 0, tail / norms.clamp_min(1e-30), 0)
        return torch.where(sink_keys, rescaled[:, :, None, :], factor)

    return scale


@dataclass(frozen=True)
class SinkIntervention(Saves):
    """Clean vs intervened, per layer (rows) and overall (``ppl``, ``delta_ppl``, ``delta_loss``).

    ``save(path)`` / ``SinkIntervention.load(path)`` keep it in one file; ``figures()`` draws the
    per-layer means clean against intervened, ``report(path)`` writes them with every number.
    """

    variant: str
    per_layer: pd.DataFrame
    ppl_clean: float
    ppl: float
    delta_loss: float

    @property
    def delta_ppl(self) -> float:
        return self.ppl - self.ppl_clean

    def effect(self) -> dict[str, float]:
        """Perplexity before and after, and the changes."""
        return {
            "ppl_clean": self.ppl_clean,
            "ppl": self.ppl,
            "delta_ppl": self.delta_ppl,
            "delta_loss": self.delta_loss,
        }

    def claims(self) -> dict[str, float]:
        """The numbers the sink-norm claim is judged on, keyed ``{variant}_...`` (`claim_verdicts` reads them)."""
        out = {f"{self.variant}_{name}": float(value) for name, value in self.effect().items()}
        for column in ("output_norm", "low_norm_cone_cosine"):
            for run in RUNS:
                out[f"{self.variant}_mean_{column}_{run}"] = float(self.per_layer[f"{column}_{run}"].mean())
        rises = self.per_layer["low_norm_cone_cosine_intervened"] > self.per_layer["low_norm_cone_cosine_clean"]
        out[f"{self.variant}_layers_where_low_norm_cone_cosine_rises"] = float(rises.sum())
        return out

    def figures(self) -> "dict[str, go.Figure]":
        """Per layer, clean against intervened: the mean output norm, and the cone cosine of the low-norm outputs."""
        from contribution_lens.drawing import plot

        x = list(self.per_layer.index)
        out = {}
        for column, title in (("output_norm", "Mean output norm"), ("low_norm_cone_cosine", "Cone cosine")):
            series = {f"{run} ({self.variant})": self.per_layer[f"{column}_{run}"].tolist() for run in RUNS}
            out[f"{title}, clean vs intervened"] = plot.lines(series, title=f"{title.lower()} per layer", x=x)
        return out

    def report(self, path: str | os.PathLike) -> Path:
        """One self-contained HTML page: the effect on perplexity, the figures, the per-layer table."""
        from contribution_lens.drawing import html

        effect = pd.DataFrame([self.effect()], index=pd.Index([self.variant], name="variant"))
        sections: list[html.Section] = [
            ("Perplexity, clean and intervened", effect),
            *self.figures().items(),
            ("Per layer", self.per_layer),
        ]
        return html.write_html(path, f"SinkIntervention: the sink's value norm, {self.variant}", sections)


def _layer_means(s: SinkLayer, low: Tensor) -> dict[str, float]:
    q = einops.rearrange(s.queries, "b q -> b 1 q").expand_as(s.output_norm)
    low = low & q
    return {
        "output_norm": s.output_norm[q].mean().item(),
        "low_norm_cone_cosine": s.cone_cosine[low].mean().item() if low.any() else float("nan"),
        "cone_cosine": s.cone_cosine[q].mean().item(),
    }


def _measure(k: int | None) -> Callable[[adapter.LayerInputs], SinkLayer]:
    """The sink geometry of a layer, the sink being the first ``k`` keys (None: `detect_sinks`)."""

    def on_layer(layer: adapter.LayerInputs) -> SinkLayer:
        mask = layer.padding_mask
        sinks = None if k is not None else detect_sinks(layer.pattern, attention_mask=mask)
        return sink_layer(
            layer.pattern, layer.v, layer.W_O, k=k or 1, sinks=sinks, attention_mask=mask, causal=layer.causal,
            gram=layer.gram,
        )  # fmt: skip

    return on_layer


def run_sink_intervention(
    model: adapter.Model,
    chunks: Tensor,
    *,
    variant: str = "zero",
    k: int | None = None,
    layers: int | Sequence[int] | None = None,
    batch_size: int = 8,
    progress: bool = True,
) -> SinkIntervention:
    """Run clean and intervened passes over token ``chunks [n pos]``.

    Both passes are `contribution_lens.map_layers` with the sink geometry as the per-layer
    function; the intervened one edits the pattern of ``layers`` (default all) with `sink_scale`.
    The sink is the first ``k`` positions; by default (None) position 0 where every chunk starts
    with the model's BOS, else the keys `contribution_lens.analyses.sinks.detect_sinks` finds per
    layer.
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; expected one of {VARIANTS}")
    if not isinstance(chunks, Tensor) or chunks.ndim != 2 or chunks.shape[0] == 0:
        shape = tuple(chunks.shape) if isinstance(chunks, Tensor) else type(chunks).__name__
        raise ValueError(f"chunks must be a non-empty [n pos] token tensor, got {shape}")
    batch_size = as_count(batch_size, "batch_size")
    wanted = set(adapter.check_layers(model, layers))
    weights = {layer: adapter.output_weights(model, layer)[0] for layer in wanted}
    sums = {"clean": [0.0, 0], "intervened": [0.0, 0]}
    rows: dict[tuple[str, int], list[dict[str, float]]] = {}
    for start in tqdm(range(0, chunks.shape[0], batch_size), desc=f"sink {variant}", disable=not progress):
        batch = adapter.to_token_batch(model, chunks[start : start + batch_size])
        first = k if k is not None else 1 if batch.bos_first else None
        edit = _sink_edit({layer: sink_scale(variant, first, weights[layer]) for layer in wanted})
        low: dict[int, Tensor] = {}
        for run, run_edit in zip(RUNS, (None, edit), strict=True):
            result = map_layers(model, batch, _measure(first), edit=run_edit, keep_logits=True)
            assert result.logits is not None
            nll, count = token_nll(result.logits, batch.tokens, batch.attention_mask)
            sums[run][0] += nll.sum().item()
            sums[run][1] += int(count.sum().item())
            for layer, s in result.items():
                if run == "clean":
                    low[layer] = _low_norm(s)
                rows.setdefault((run, layer), []).append(_layer_means(s, low[layer]))

    table = []
    for layer in adapter.check_layers(model, None):
        row: dict[str, float | int | bool] = {"layer": layer, "intervened_layer": layer in wanted}
        for run in RUNS:
            frame = pd.DataFrame(rows[(run, layer)])
            for column in frame:
                row[f"{column}_{run}"] = float(frame[column].mean())
        table.append(row)
    clean_loss = sums["clean"][0] / sums["clean"][1]
    loss = sums["intervened"][0] / sums["intervened"][1]
    return SinkIntervention(
        variant=variant,
        per_layer=pd.DataFrame(table).set_index("layer"),
        ppl_clean=perplexity(sums["clean"][0], int(sums["clean"][1])),
        ppl=perplexity(sums["intervened"][0], int(sums["intervened"][1])),
        delta_loss=loss - clean_loss,
    )


def _sink_edit(scales: dict[int, Callable[[int, Tensor, Tensor], Tensor]]) -> adapter.PatternEdit:
    """The pattern edit scaling each layer of ``scales`` by its own multiplier."""
    return scale_pattern(lambda layer, pattern, v: scales[layer](layer, pattern, v), set(scales))


def _low_norm(s: SinkLayer) -> Tensor:
    """The outputs in the lowest quarter of norms (per layer) in the clean run."""
    norms = torch.where(einops.rearrange(s.queries, "b q -> b 1 q"), s.output_norm, float("inf"))
    real = norms[torch.isfinite(norms)]
    threshold = torch.quantile(real, 0.25) if real.numel() else torch.tensor(0.0)
    return norms <= threshold
