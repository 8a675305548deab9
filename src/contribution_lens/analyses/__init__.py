"""Model-level analyses, each a per-layer function on `contribution_lens.map_layers`.

* `geometry`: `attention_geometry` (every layer's `Decomposition`, as a `Geometry`) and the
  streamed `layer_summary`;
* `sinks`: sink vs tail geometry, sink detection, the convex sink-ratio curve (`sink_analysis`);
* `sink_intervention`: removing or rescaling the sink's value norm (`run_sink_intervention`);
* `sink_claims`: both on a corpus, the published claims judged, with figures and a report (`sink_study`);
* `logit_attribution`: a next-token logit (or logit difference) split into exact signed terms per
  layer, head and key (`LogitAttribution`; the function is ``contribution_lens.logit_attribution``,
  not exported here, where the name is the module's);
* `flow`: the signed token mixing of every layer, its rollout at a prediction and the pruned graph
  (`Flow`; the function is ``contribution_lens.flow``, likewise);
* `qk_attribution`: why a head attends: every pre-softmax score of a head split exactly over the
  query's and the key's upstream components, with the advantage that explains the pattern
  (`QKAttribution`; the function is ``contribution_lens.qk_attribution``, likewise), and `QKTape`,
  what one pass keeps so that any head's split of that text needs no pass of its own;
* `generation`: every token of a generated answer explained from one teacher-forced pass (`explain_generation`).

A new analysis is one file here: a per-layer function and a result type with the one lifecycle
every result has: ``save(path)``/``load(path)`` through `contribution_lens.files.save_result`
(a `LayerResults` subclass names its own fields in ``STORED``; a dataclass mixes in
`contribution_lens.files.Saves`), ``figures() -> dict[str, go.Figure]`` and ``report(path)``;
exported below. Analyses draw with `contribution_lens.drawing.plot` (below them) and never import
a method (above them).
"""

from contribution_lens.analyses.flow import Flow, FlowEdges, FlowLayer
from contribution_lens.analyses.generation import GenerationExplanation, GenerationStep, explain_generation
from contribution_lens.analyses.geometry import Geometry, attention_geometry, layer_summary
from contribution_lens.analyses.logit_attribution import LogitAttribution
from contribution_lens.analyses.qk_attribution import QKAttribution, QKCell, QKTape
from contribution_lens.analyses.sink_claims import SinkStudy, sink_study
from contribution_lens.analyses.sink_intervention import SinkIntervention, run_sink_intervention
from contribution_lens.analyses.sinks import SinkAnalysis, SinkLayer, claim_verdicts, sink_analysis

__all__ = [
    "Flow",
    "FlowEdges",
    "FlowLayer",
    "GenerationExplanation",
    "GenerationStep",
    "Geometry",
    "LogitAttribution",
    "QKAttribution",
    "QKCell",
    "QKTape",
    "SinkAnalysis",
    "SinkIntervention",
    "SinkLayer",
    "SinkStudy",
    "attention_geometry",
    "claim_verdicts",
    "explain_generation",
    "layer_summary",
    "run_sink_intervention",
    "sink_analysis",
    "sink_study",
]
