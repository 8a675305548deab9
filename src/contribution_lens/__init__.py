"""contribution-lens: which tokens really feed an attention head's output.

The contribution weight of key ``j`` to the attention output ``o_i`` through head ``h``,

    c_ij^h = <o_i, alpha_ij^h vt_j^h> / ||o_i||^2
           = alpha_ij^h * (||vt_j^h|| / ||o_i||) * cos(o_i, vt_j^h),

splits into selection (attention), magnitude (relative norm) and direction (cosine).

The layout shows the architecture, one folder a layer. The core is small: the maths on tensors
(`decomposition`, `choices`, `qk`, `losses`, `files`), `adapter` (the one place that knows
TransformerLens, one module a concern behind its face), `engine` (`map_layers`, the per-layer streaming
primitive), `mixing`, `interventions`, `loading`. Around it, one subpackage a role, bottom first:
`drawing` (figures and pages), `analyses` (geometry, flow, logit attribution, sinks), `methods` (the
registry and the measures), `circuits`, `views` (the inspector, measures compared, notebook export),
`faithfulness` (the causal harness), `replication` and `cli`.

Names are imported on first use (PEP 562), so ``import contribution_lens`` and the command
line's ``--help`` do not pay for torch.
"""

from typing import TYPE_CHECKING

from contribution_lens import _compat
from contribution_lens._lazy import face

__version__ = "0.3.0"

_A = "contribution_lens.analyses"
# The public names, written once: name -> where it is defined. `__all__` follows from it, and the imports
# under TYPE_CHECKING below (written out for type checkers) are checked against it by tests/test_package.py.
_EXPORTS: dict[str, str] = {
    "FACTORS": "contribution_lens.choices:FACTORS",
    "SCOPES": "contribution_lens.choices:SCOPES",
    "Factor": "contribution_lens.choices:Factor",
    "Scope": "contribution_lens.choices:Scope",
    "Decomposition": "contribution_lens.decomposition:Decomposition",
    "decompose": "contribution_lens.decomposition:decompose",
    "LayerInputs": "contribution_lens.adapter:LayerInputs",
    "TokenBatch": "contribution_lens.adapter:TokenBatch",
    "to_token_batch": "contribution_lens.adapter:to_token_batch",
    "block_forms": "contribution_lens.adapter:block_forms",
    "LayerResults": "contribution_lens.engine:LayerResults",
    "map_layers": "contribution_lens.engine:map_layers",
    "load_model": "contribution_lens.loading:load_model",
    **{
        name: f"contribution_lens.methods:{name}"
        for name in ("Method", "ScoreContext", "available_methods", "default_methods", "get_method", "importance",
                     "register_method", "unregister_method")
    },
    **{name: f"{_A}.geometry:{name}" for name in ("Geometry", "attention_geometry", "layer_summary")},
    **{name: f"{_A}.flow:{name}" for name in ("Flow", "flow")},
    **{name: f"{_A}.generation:{name}" for name in ("GenerationExplanation", "GenerationStep", "explain_generation")},
    **{name: f"{_A}.logit_attribution:{name}" for name in ("LogitAttribution", "logit_attribution")},
    **{name: f"{_A}.qk_attribution:{name}" for name in ("QKAttribution", "qk_attribution")},
    **{name: f"{_A}.sinks:{name}" for name in ("SinkAnalysis", "SinkLayer", "sink_analysis")},
    **{name: f"{_A}.sink_intervention:{name}" for name in ("SinkIntervention", "run_sink_intervention")},
    **{name: f"{_A}.sink_claims:{name}" for name in ("SinkStudy", "sink_study")},
    **{name: f"contribution_lens.circuits:{name}" for name in (
        "Circuit", "CircuitCurve", "CircuitEvaluation", "CircuitMethod", "CircuitScores", "Task",
        "TaskReport", "task_report", "CircuitStability", "circuit_stability", "EdgeEffects", "exact_edge_effects",
        "Linearisation", "linearisation_error",
        "available_circuit_methods", "circuit_curve", "circuit_graph", "circuit_scores", "evaluate_circuit",
        "register_circuit_method", "unregister_circuit_method")},
    "inspect": "contribution_lens.views.inspector:inspect",
    "Inspector": "contribution_lens.views.inspector:Inspector",
    "inspect_circuit": "contribution_lens.views.circuit_view:inspect_circuit",
    "CircuitInspector": "contribution_lens.views.circuit_view:CircuitInspector",
    "plot": "contribution_lens.drawing.plot",
    **{name: f"contribution_lens.{name}"
       for name in ("analyses", "circuits", "drawing", "faithfulness", "methods", "views")},
}  # fmt: skip
_DEPRECATED = {
    "METHODS": ("contribution_lens._compat:DECOMPOSITION_METHODS", "use contribution_lens.available_methods()"),
}
__all__ = sorted(_EXPORTS)  # the table above is the one list of public names
__getattr__, __dir__ = face(__name__, _EXPORTS, _DEPRECATED)
_compat.install()  # ``import contribution_lens.evaluation`` and other 0.2 paths keep working, with a warning

if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from contribution_lens import analyses, circuits, drawing, faithfulness, methods, views
    from contribution_lens.adapter import LayerInputs, TokenBatch, block_forms, to_token_batch
    from contribution_lens.analyses.flow import Flow, flow
    from contribution_lens.analyses.generation import GenerationExplanation, GenerationStep, explain_generation
    from contribution_lens.analyses.geometry import Geometry, attention_geometry, layer_summary
    from contribution_lens.analyses.logit_attribution import LogitAttribution, logit_attribution
    from contribution_lens.analyses.qk_attribution import QKAttribution, qk_attribution
    from contribution_lens.analyses.sink_claims import SinkStudy, sink_study
    from contribution_lens.analyses.sink_intervention import SinkIntervention, run_sink_intervention
    from contribution_lens.analyses.sinks import SinkAnalysis, SinkLayer, sink_analysis
    from contribution_lens.choices import FACTORS, SCOPES, Factor, Scope
    from contribution_lens.circuits import (
        Circuit,
        CircuitCurve,
        CircuitEvaluation,
        CircuitMethod,
        CircuitScores,
        CircuitStability,
        EdgeEffects,
        Linearisation,
        Task,
        TaskReport,
        available_circuit_methods,
        circuit_curve,
        circuit_graph,
        circuit_scores,
        circuit_stability,
        evaluate_circuit,
        exact_edge_effects,
        linearisation_error,
        register_circuit_method,
        task_report,
        unregister_circuit_method,
    )
    from contribution_lens.decomposition import Decomposition, decompose
    from contribution_lens.drawing import plot
    from contribution_lens.engine import LayerResults, map_layers
    from contribution_lens.loading import load_model
    from contribution_lens.methods import (
        Method,
        ScoreContext,
        available_methods,
        default_methods,
        get_method,
        importance,
        register_method,
        unregister_method,
    )
    from contribution_lens.views.circuit_view import CircuitInspector, inspect_circuit
    from contribution_lens.views.inspector import Inspector, inspect
