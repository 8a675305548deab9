"""Circuits: which heads and MLPs work together on a task, through which connections.

The face of the circuits subpackage: tasks (`Task`), the graph of nodes and edges (`Graph`,
`circuit_graph`), circuit methods (a registry: `register_circuit_method`), their scores
(`circuit_scores` -> `CircuitScores`), the circuits they choose (`Circuit`), and MIB-style
evaluation by interchange patching (`evaluate_circuit`, `circuit_curve`).
"""

from typing import TYPE_CHECKING

from contribution_lens._lazy import face
from contribution_lens.circuits import (
    attribution,  # noqa: F401  (registers the package's circuit methods)
    contribution,  # noqa: F401
    routes,  # noqa: F401
)
from contribution_lens.circuits.evaluation import (
    FRACTIONS,
    CircuitCurve,
    CircuitEvaluation,
    circuit_curve,
    evaluate_circuit,
)
from contribution_lens.circuits.graph import Graph, circuit_graph
from contribution_lens.circuits.registry import (
    CircuitContext,
    CircuitMethod,
    available_circuit_methods,
    get_circuit_method,
    register_circuit_method,
    unregister_circuit_method,
)
from contribution_lens.circuits.scoring import Circuit, CircuitScores, circuit_scores
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
    "Graph",
    "Task",
    "TaskReport",
    "available_circuit_methods",
    "circuit_curve",
    "circuit_graph",
    "circuit_scores",
    "evaluate_circuit",
    "get_circuit_method",
    "register_circuit_method",
    "task_report",
    "unregister_circuit_method",
]

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
if not TYPE_CHECKING:  # type checkers see this package's own names only
    __getattr__ = face(__name__, {}, _DEPRECATED)[0]
