"""Circuits: which heads and MLPs work together on a task, through which connections.

The face of the circuits subpackage: tasks (`Task`), the graph of nodes and edges, circuit scoring
methods (a registry), and MIB-style evaluation of a circuit by interchange patching.
"""

from contribution_lens.circuits.task import Task

__all__ = ["Task"]
