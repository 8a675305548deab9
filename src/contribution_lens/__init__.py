"""contribution-lens: which tokens really feed an attention head's output.

The contribution weight of key ``j`` to the attention output ``o_i`` through head ``h``,

    c_ij^h = <o_i, alpha_ij^h vt_j^h> / ||o_i||^2
           = alpha_ij^h * (||vt_j^h|| / ||o_i||) * cos(o_i, vt_j^h),

splits into selection (attention), magnitude (relative norm) and direction (cosine).

Names are imported on first use (PEP 562), so ``import contribution_lens`` and the command
line's ``--help`` do not pay for torch.
"""

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.2.0"

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    "FACTORS": "decomposition",
    "METHODS": "decomposition",
    "SCOPES": "decomposition",
    "Decomposition": "decomposition",
    "Scope": "decomposition",
    "decompose": "decomposition",
    "importance": "decomposition",
    "LayerInputs": "adapter",
    "TokenBatch": "adapter",
    "to_token_batch": "adapter",
    "LayerResults": "engine",
    "map_layers": "engine",
    "Method": "methods",
    "ScoreContext": "methods",
    "available_methods": "methods",
    "get_method": "methods",
    "register_method": "methods",
    "unregister_method": "methods",
    "Geometry": "geometry",
    "attention_geometry": "geometry",
    "layer_summary": "geometry",
    "inspect": "inspector",
    "load_model": "loading",
    "SinkAnalysis": "sinks",
    "SinkLayer": "sinks",
    "sink_analysis": "sinks",
    "SinkIntervention": "sink_intervention",
    "run_sink_intervention": "sink_intervention",
}
_SUBMODULES = ("plot",)

__all__ = [
    "FACTORS",
    "METHODS",
    "SCOPES",
    "Decomposition",
    "Geometry",
    "LayerInputs",
    "LayerResults",
    "Method",
    "Scope",
    "ScoreContext",
    "SinkAnalysis",
    "SinkIntervention",
    "SinkLayer",
    "TokenBatch",
    "attention_geometry",
    "available_methods",
    "decompose",
    "get_method",
    "importance",
    "inspect",
    "layer_summary",
    "load_model",
    "map_layers",
    "plot",
    "register_method",
    "run_sink_intervention",
    "sink_analysis",
    "to_token_batch",
    "unregister_method",
]


def __getattr__(name: str) -> Any:
    # __all__ and _EXPORTS list the same names (a test checks it).
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"contribution_lens.{_EXPORTS[name]}"), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"contribution_lens.{name}")
    else:
        raise AttributeError(f"module 'contribution_lens' has no attribute {name!r}")
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])


if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from contribution_lens import plot
    from contribution_lens.adapter import LayerInputs, TokenBatch, to_token_batch
    from contribution_lens.decomposition import (
        FACTORS,
        METHODS,
        SCOPES,
        Decomposition,
        Scope,
        decompose,
        importance,
    )
    from contribution_lens.engine import LayerResults, map_layers
    from contribution_lens.geometry import Geometry, attention_geometry, layer_summary
    from contribution_lens.inspector import inspect
    from contribution_lens.loading import load_model
    from contribution_lens.methods import (
        Method,
        ScoreContext,
        available_methods,
        get_method,
        register_method,
        unregister_method,
    )
    from contribution_lens.sink_intervention import SinkIntervention, run_sink_intervention
    from contribution_lens.sinks import SinkAnalysis, SinkLayer, sink_analysis
