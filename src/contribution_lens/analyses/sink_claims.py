"""The attention-sink study of a corpus: the sink geometry, the sink-norm interventions, the claims judged.

`sink_study` runs `contribution_lens.sink_analysis` on every chunk (sink = the first ``k``
positions) and `contribution_lens.run_sink_intervention` in both variants (the sink's value norm
zeroed, and rescaled to the mean tail norm), and keeps what the four published claims are judged
on (`contribution_lens.analyses.sinks.claim_verdicts`). The result, a `SinkStudy`, owns its
lifecycle: `SinkStudy.verdicts`, `SinkStudy.figures`, `SinkStudy.report`, `SinkStudy.save` and
`SinkStudy.load`. The command ``contribution-lens sinks`` is this function and ``save``.
"""

import json
import os
from dataclasses import dataclass, fields
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
from torch import Tensor

from contribution_lens import adapter
from contribution_lens.analyses.sink_intervention import RUNS, VARIANTS, SinkIntervention, run_sink_intervention
from contribution_lens.analyses.sinks import PARTS, SinkLayer, claim_verdicts, sink_analysis
from contribution_lens.choices import Factor
from contribution_lens.files import load_result, save_result, write_text

MAX_POINTS = 5000
"""(head, query) points kept for the sink-ratio scatter."""
FILES = {
    "heads": "sink_heads.csv",
    "claims": "sink_claims.json",
    "layers": "sink_intervention_layers.csv",
    "points": "sink_points.csv",
    "study": "sink_study.safetensors",
    "report": "sinks.html",
}
"""What `SinkStudy.save` writes into its folder."""


@dataclass
class SinkStudy:
    """What a sink study measured: per-head statistics, every number behind the claims, the interventions.

    Attributes:
        heads: one row per (layer, head), `SinkAnalysis.head_table`.
        claims: the numbers the claims are judged on (`SinkAnalysis.claims` and each
            `SinkIntervention.claims`), with their documented keys.
        interventions: per variant (``"zero"``, ``"mean_tail"``), clean vs intervened.
        points: a sample of `SinkAnalysis.per_query` (at most `MAX_POINTS` rows) for the scatter.
        beta: the `SinkLayer` of the layer whose head has the largest sink ratio (its beta curves).
        beta_head: that (layer, head).
        queries: the queries whose beta curves are drawn.
        model_name: what was studied.
    """

    heads: pd.DataFrame
    claims: dict[str, float]
    interventions: dict[str, SinkIntervention]
    points: pd.DataFrame
    beta: SinkLayer
    beta_head: tuple[int, int]
    queries: list[int]
    model_name: str = ""

    def __repr__(self) -> str:
        n_layers = self.heads.index.get_level_values("layer").nunique()
        return (
            f"SinkStudy(model={self.model_name!r}, layers={n_layers}, heads={len(self.heads)}, "
            f"variants={list(self.interventions)})"
        )

    def verdicts(self) -> pd.DataFrame:
        """The four sink claims: what was measured, the threshold, the verdict."""
        return claim_verdicts(self.claims)

    def effect(self) -> pd.DataFrame:
        """Per intervention variant: perplexity clean and intervened, ΔPPL, Δloss."""
        return pd.DataFrame([{"variant": v, **r.effect()} for v, r in self.interventions.items()]).set_index("variant")

    def per_layer(self) -> pd.DataFrame:
        """Per variant and layer: mean output norm and cone cosines, clean and intervened."""
        return pd.concat({v: r.per_layer for v, r in self.interventions.items()}, names=["variant"])

    def figures(self) -> dict[str, go.Figure]:
        """Every figure of the report under its title: per-layer means, per-head grids, beta curves, scatter, norms."""
        from contribution_lens.drawing import plot

        layer_means = self.heads.groupby("layer").mean()
        columns = (
            "sink_ratio",
            "intra_sink_contribution",
            "inter_sink_contribution",
            "interior_minimum_share",
            "negative_sink_tail_share",
        )
        figures = [
            (
                "Per layer: sink ratio, sink contribution, interior minima",
                plot.lines(
                    {c: layer_means[c].tolist() for c in columns if c in layer_means},
                    title="per-layer means over heads",
                    x=list(layer_means.index),
                ),
            )
        ]
        for part in PARTS:
            for factor in Factor:
                column = f"intra_{part}_{factor}"
                figures.append((f"{part} {factor} (intra-head)", plot.sink_head_grid(self.heads, column)))
        layer, head = self.beta_head
        figures.append((f"beta curves, L{layer}H{head}", plot.beta_curves(self.beta, head=head, queries=self.queries)))
        figures.append(("Sink ratio vs output norm", plot.sink_ratio_scatter(self.points)))
        per_layer = self.per_layer()
        # Norms and cosines live on different scales: one figure each.
        for column, title in (("output_norm", "mean output norm"), ("low_norm_cone_cosine", "cone cosine")):
            series = {
                f"{run} ({v})": per_layer.loc[v][f"{column}_{run}"].tolist() for v in self.interventions for run in RUNS
            }
            x = list(per_layer.loc[next(iter(self.interventions))].index)
            figures.append(
                (f"{title.capitalize()}, clean vs intervened", plot.lines(series, title=f"{title} per layer", x=x))
            )
        return dict(figures)

    def report(self, path: str | os.PathLike) -> Path:
        """One self-contained HTML page: the claims judged first, then the figures and every number."""
        from contribution_lens.drawing import html

        sections: list[html.Section] = [
            ("The claims, measured on this model", self.verdicts()),
            ("Sink-norm intervention", self.effect()),
            *self.figures().items(),
            ("Every number behind the claims", pd.DataFrame({"value": self.claims})),
            ("Per head", self.heads),
        ]
        return html.write_html(path, f"Attention sinks: {self.model_name}", sections)

    def save(self, folder: str | os.PathLike) -> Path:
        """Write `FILES` into ``folder`` (each atomically): the tables and the page for people, and the study itself.

        The study is one file (`contribution_lens.files.save_result`, as every result is saved); `load` reads it.
        """
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        write_text(out / FILES["heads"], self.heads.to_csv())
        write_text(out / FILES["claims"], json.dumps(self.claims, indent=2))
        write_text(out / FILES["layers"], self.per_layer().to_csv())
        write_text(out / FILES["points"], self.points.to_csv(index=False))
        save_result(out / FILES["study"], self, example=FILES["study"])
        self.report(out / FILES["report"])
        return out

    @classmethod
    def load(cls, folder: str | os.PathLike) -> "SinkStudy":
        """The study `save` wrote into ``folder``."""
        source = Path(folder)
        if not (source / FILES["study"]).is_file():
            raise FileNotFoundError(f"{source} holds no saved sink study: {FILES['study']} missing")
        return load_result(source / FILES["study"], cls)


def sink_study(
    model: adapter.Model,
    chunks: Tensor,
    *,
    k: int | None = None,
    batch_size: int = 8,
    variants: tuple[str, ...] = VARIANTS,
    model_name: str = "",
    progress: bool = True,
) -> SinkStudy:
    """The sink geometry of every layer and head of token ``chunks [n pos]``, and the sink-norm interventions.

    Args:
        chunks: token ids (`contribution_lens.faithfulness.data.chunk_tokens`), each row starting with
            BOS where the model prepends one.
        k: the sink is the first ``k`` positions; None (default): position 0 where every chunk starts
            with the model's BOS, else the keys `contribution_lens.analyses.sinks.detect_sinks` finds.
        batch_size: chunks per forward pass of the interventions.
        variants: which interventions to run (`contribution_lens.analyses.sink_intervention.VARIANTS`).
        progress: progress bars: the analysis ("sink analysis", one step a layer), then each
            intervention ("sink zero", "sink mean_tail", one step a batch of chunks).

    Example:
        >>> import contribution_lens as cl
        >>> model = cl.load_model()
        >>> chunks = model.to_tokens(["The cat sat on the mat and looked out of the window at the birds."])
        >>> study = cl.sink_study(model, chunks, variants=("zero",), progress=False)
        >>> len(study.verdicts()), study.beta_head[0] < model.cfg.n_layers
        (4, True)
    """
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        raise ValueError(f"variants must be some of {VARIANTS}, got {list(variants)}")
    if not isinstance(chunks, Tensor) or chunks.ndim != 2 or chunks.shape[0] == 0:
        shape = tuple(chunks.shape) if isinstance(chunks, Tensor) else type(chunks).__name__
        raise ValueError(f"chunks must be a non-empty [n pos] token tensor, got {shape}")
    analysis = sink_analysis(model, chunks, k=k, progress=progress)
    heads = analysis.head_table()
    claims = analysis.claims()
    interventions = {
        v: run_sink_intervention(model, chunks, variant=v, k=k, batch_size=batch_size, progress=progress)
        for v in variants
    }
    for intervention in interventions.values():
        claims |= intervention.claims()
    top_layer, top_head = (int(x) for x in heads["sink_ratio"].idxmax())
    length = chunks.shape[1]
    queries = [
        q for q in (8, 64, 128, length - 1) if (k or 1) <= q < length and bool(analysis[top_layer].queries[0, q])
    ]
    points = analysis.per_query()
    if len(points) > MAX_POINTS:
        points = points.sample(MAX_POINTS, random_state=0).sort_index()
    beta = analysis[top_layer]
    return SinkStudy(
        heads=heads,
        claims=claims,
        interventions=interventions,
        points=points.reset_index(drop=True),
        beta=SinkLayer(**{f.name: getattr(beta, f.name) for f in fields(SinkLayer) if f.name != "factors"}),
        beta_head=(top_layer, top_head),
        queries=sorted(set(queries)),
        model_name=model_name,
    )
