"""contribution-lens: which tokens really feed an attention head's output.

The contribution weight of key ``j`` to the attention output ``o_i`` through head ``h``,

    c_ij^h = <o_i, alpha_ij^h vt_j^h> / ||o_i||^2
           = alpha_ij^h * (||vt_j^h|| / ||o_i||) * cos(o_i, vt_j^h),

splits into selection (attention), magnitude (relative norm) and direction (cosine).
"""

from contribution_lens import plot
from contribution_lens.adapter import TokenBatch, to_token_batch
from contribution_lens.decomposition import (
    FACTORS,
    METHODS,
    SCOPES,
    Decomposition,
    Method,
    Scope,
    decompose,
    importance,
)
from contribution_lens.geometry import Geometry, attention_geometry
from contribution_lens.inspector import inspect
from contribution_lens.loading import load_model
from contribution_lens.sink_intervention import SinkIntervention, sink_intervention
from contribution_lens.sinks import SinkAnalysis, SinkLayer, sink_analysis

__all__ = [
    "FACTORS",
    "METHODS",
    "SCOPES",
    "Decomposition",
    "Geometry",
    "Method",
    "Scope",
    "SinkAnalysis",
    "SinkIntervention",
    "SinkLayer",
    "TokenBatch",
    "attention_geometry",
    "decompose",
    "importance",
    "inspect",
    "load_model",
    "plot",
    "sink_analysis",
    "sink_intervention",
    "to_token_batch",
]
__version__ = "0.1.0"
