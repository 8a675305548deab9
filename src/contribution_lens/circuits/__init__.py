"""Circuits: which heads and MLPs work together on a task, through which connections.

The face of the circuits subpackage: tasks (`Task`), the graph of nodes and edges (`Graph`,
`circuit_graph`; its edges counted natively or as MIB counts them), circuit methods (a registry:
`register_circuit_method`), their scores (`circuit_scores` -> `CircuitScores`), the circuits they
choose (`Circuit`), MIB-style evaluation by interchange patching (`evaluate_circuit`,
`circuit_curve`), MIB's graph files (`Circuit.to_mib`, `Circuit.from_mib`), and checks of the scores: how
much a circuit depends on its prompts (`circuit_stability`), how far a linearised method's own metric
change is from the true one (`linearisation_error`) and each chosen edge's exact effect
(`exact_edge_effects`). It imports on first use, so listing the circuit methods' names
(`available_circuit_methods`) imports no torch.
"""

from typing import TYPE_CHECKING

from contribution_lens._lazy import face

_HERE = "contribution_lens.circuits"
_EXPORTS = {
    **{name: f"{_HERE}.edge_effects:{name}" for name in ("EdgeEffects", "exact_edge_effects", "top_edges")},
    **{name: f"{_HERE}.evaluation:{name}" for name in ("FRACTIONS", "CircuitCurve", "CircuitEvaluation",
                                                      "circuit_curve", "evaluate_circuit")},
    **{name: f"{_HERE}.graph:{name}" for name in ("Graph", "circuit_graph")},
    **{name: f"{_HERE}.linearisation:{name}" for name in ("Linearisation", "linearisation_error")},
    **{
        name: f"{_HERE}.registry:{name}"
        for name in ("CircuitContext", "CircuitMethod", "available_circuit_methods", "get_circuit_method",
                     "register_circuit_method", "unregister_circuit_method")
    },
    **{name: f"{_HERE}.scoring:{name}" for name in ("Circuit", "CircuitScores", "circuit_scores")},
    **{name: f"{_HERE}.stability:{name}" for name in ("CircuitStability", "circuit_stability")},
    **{name: f"{_HERE}.task:{name}" for name in ("METRICS", "Task")},
    **{name: f"{_HERE}.task_checks:{name}" for name in ("TaskReport", "task_report")},
}  # fmt: skip
__all__ = sorted(_EXPORTS)
_DEPRECATED = {
    "circuit_figure": (
        "contribution_lens.drawing.circuit_figures:circuit_figure",
        "use contribution_lens.plot.circuit_figure (contribution_lens.drawing.circuit_figures)",
    ),
    "curves_figure": (
        "contribution_lens.drawing.circuit_figures:faithfulness_figure",
        "use contribution_lens.plot.faithfulness_figure (contribution_lens.drawing.circuit_figures)",
    ),
}
"""The circuits' figures moved to `contribution_lens.drawing` with every other figure: each warns, comes from there."""
__getattr__, __dir__ = face(__name__, _EXPORTS, _DEPRECATED)

if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from contribution_lens.circuits.edge_effects import EdgeEffects, exact_edge_effects, top_edges
    from contribution_lens.circuits.evaluation import (
        FRACTIONS,
        CircuitCurve,
        CircuitEvaluation,
        circuit_curve,
        evaluate_circuit,
    )
    from contribution_lens.circuits.graph import Graph, circuit_graph
    from contribution_lens.circuits.linearisation import Linearisation, linearisation_error
    from contribution_lens.circuits.registry import (
        CircuitContext,
        CircuitMethod,
        available_circuit_methods,
        get_circuit_method,
        register_circuit_method,
        unregister_circuit_method,
    )
    from contribution_lens.circuits.scoring import Circuit, CircuitScores, circuit_scores
    from contribution_lens.circuits.stability import CircuitStability, circuit_stability
    from contribution_lens.circuits.task import METRICS, Task
    from contribution_lens.circuits.task_checks import TaskReport, task_report
