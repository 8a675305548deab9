"""Circuits: which heads and MLPs work together on a task, through which connections.

The face of the circuits subpackage: tasks (`Task`), the graph of nodes and edges (`Graph`,
`circuit_graph`), circuit methods (a registry: `register_circuit_method`), their scores
(`circuit_scores` -> `CircuitScores`), the circuits they choose (`Circuit`), and MIB-style
evaluation by interchange patching (`evaluate_circuit`, `circuit_curve`), and checks of the scores: how
much a circuit depends on its prompts (`circuit_stability`), how far a linearised method's own metric
change is from the true one (`linearisation_error`) and each chosen edge's exact effect (`exact_edge_effects`).
"""

from contribution_lens.circuits import (
    attribution,  # noqa: F401  (registers the package's circuit methods)
    contribution,  # noqa: F401
    routes,  # noqa: F401
)
from contribution_lens.circuits.edge_effects import EdgeEffects, exact_edge_effects, top_edges
from contribution_lens.circuits.evaluation import (
    FRACTIONS,
    CircuitCurve,
    CircuitEvaluation,
    circuit_curve,
    evaluate_circuit,
)
from contribution_lens.circuits.figures import circuit_figure, curves_figure
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
from contribution_lens.circuits.task import METRICS, Task, TaskReport, task_report

__all__ = [
    "FRACTIONS",
    "METRICS",
    "Circuit",
    "CircuitContext",
    "CircuitCurve",
    "CircuitEvaluation",
    "CircuitMethod",
    "CircuitScores",
    "CircuitStability",
    "EdgeEffects",
    "Graph",
    "Linearisation",
    "Task",
    "TaskReport",
    "available_circuit_methods",
    "circuit_curve",
    "circuit_figure",
    "circuit_graph",
    "circuit_scores",
    "circuit_stability",
    "curves_figure",
    "evaluate_circuit",
    "exact_edge_effects",
    "get_circuit_method",
    "linearisation_error",
    "register_circuit_method",
    "task_report",
    "top_edges",
    "unregister_circuit_method",
]
