"""The circuit-method registry: ways to score a task's edges (or nodes), found by name.

A `CircuitMethod`'s ``score_fn(model, task, context)`` returns one score an edge (``[edge]``,
in `Graph.edges` order; ``level="edge"``) or one a head or MLP (``[component]``, in
`Graph.components` order; ``level="node"``). A method says which way its scores point
(``orientation``, a `ScoreOrientation`): `EFFECT`, an estimate of what patching that edge (node)
with the counterfactual does to the metric, ``m(patched) - m(clean)`` (MIB's scores are the
negative of these), or `IMPORTANCE`, a size of importance where larger means keep (information
flow routes). Signed selection keeps first the scores that most say "keep this clean" (the most
negative effects, the largest importances); ``|score|`` selection the largest ``|score|``. A method
also says whether MIB evaluates it with greedy selection from the logits (``greedy``). An edge
method's node scores are the sums over each node's outgoing edges (for gradient methods that is
the same estimate at the node's output). This module knows no method: `CIRCUIT_METHODS` declares
the package's own by name, with the file that defines them (``attribution``, ``contribution``,
``routes``, each with a ``METHODS`` tuple), imported when one of them is first read; the names are
listed (the command line's ``--help``) without importing torch.

Registering your own takes one call, or a decorator (``@register_circuit_method("name", level=...)``,
or bare, ``@register_circuit_method``, under the function's name):

    >>> import torch
    >>> import contribution_lens as cl
    >>> def by_layer(model, task, context):
    ...     return -torch.arange(len(context.graph.components), dtype=torch.float32)
    >>> _ = cl.register_circuit_method("later-first", by_layer, level="node", description="later nodes first")
    >>> "later-first" in cl.available_circuit_methods()
    True
    >>> cl.unregister_circuit_method("later-first")

What is registered is checked then: the score function must take ``(model, task, context)``, the
name must not be a registered one in another case; what it returns is checked when it is called
(`contribution_lens.circuits.checks.checked_scores`: one finite score an edge or node, naming the method).
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from contribution_lens._registry import Registry

if TYPE_CHECKING:
    from torch import Tensor

    from contribution_lens.circuits.graph import Graph

LEVELS = ("edge", "node")
DEFAULT_MEMORY = 2**30
"""Bytes the activation differences of one batch of prompts may take (float32): 1 GiB."""


@dataclass(frozen=True)
class CircuitContext:
    """What a circuit method may need beside the model and the task."""

    graph: "Graph"
    memory: int = DEFAULT_MEMORY
    seed: int = 0
    steps: int = 5
    """Integrated-gradient steps (MIB's default, ``--ig-steps 5``)."""


ScoreFn = Callable[[Any, Any, CircuitContext], "Tensor"]


@dataclass(frozen=True)
class ScoreOrientation:
    """Which way a method's scores point: signed selection keeps the largest ``keep_sign * score`` first.

    Example:
        >>> import torch
        >>> EFFECT.keep_key(torch.tensor([-2.0, 1.0])).tolist()  # the most negative effect is kept first
        [2.0, -1.0]
    """

    name: str
    keep_sign: float
    """+1: a larger score says keep; -1: a more negative score says keep."""
    description: str = ""

    def keep_key(self, scores: "Tensor") -> "Tensor":
        """``keep_sign * scores``: what signed selection ranks, largest first (MIB's score for `EFFECT`)."""
        return scores * self.keep_sign


EFFECT = ScoreOrientation(
    "effect",
    -1.0,
    "an estimate of m(patched) - m(clean): the most negative score is the edge whose clean activation most "
    "restores the clean metric (MIB's score is its negative)",
)
"""Scores that estimate ``m(patched) - m(clean)``: signed selection keeps the most negative first (MIB's largest)."""
IMPORTANCE = ScoreOrientation("importance", 1.0, "a size of importance: the largest score is kept first")
"""Scores that measure importance (information flow routes): signed selection keeps the largest first."""
ORIENTATIONS: dict[str, ScoreOrientation] = {o.name: o for o in (EFFECT, IMPORTANCE)}
"""The orientations a circuit method may declare, by name."""


def check_orientation(orientation: Any) -> ScoreOrientation:
    """A `ScoreOrientation`, or the name of one of `ORIENTATIONS`."""
    if isinstance(orientation, ScoreOrientation):
        return orientation
    if isinstance(orientation, str) and orientation in ORIENTATIONS:
        return ORIENTATIONS[orientation]
    raise ValueError(f"orientation must be a ScoreOrientation or one of {', '.join(ORIENTATIONS)}, got {orientation!r}")


@dataclass(frozen=True)
class CircuitMethod:
    """A circuit method: a name, the level it scores, its score function, and which way its scores point.

    ``orientation`` (`EFFECT` or `IMPORTANCE`, or their names): what signed selection keeps first.
    ``greedy``: whether MIB evaluates the method's circuits with greedy selection from the logits
    (its ``apply_greedy``; information flow routes) rather than the top scores (``apply_topn``).
    """

    name: str
    score_fn: ScoreFn = field(repr=False)
    level: str = "edge"
    description: str = ""
    builtin: bool = False
    orientation: ScoreOrientation = EFFECT
    greedy: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or not self.name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"a circuit method name is letters, digits, '_' or '-', got {self.name!r}")
        if self.level not in LEVELS:
            raise ValueError(f"level must be 'edge' or 'node', got {self.level!r}")
        object.__setattr__(self, "orientation", check_orientation(self.orientation))
        if not isinstance(self.greedy, bool):
            raise ValueError(f"greedy must be True or False, got {self.greedy!r}")
        if self.greedy and self.level == "node":
            raise ValueError(
                "greedy: greedy selection from the logits chooses edges; a node-level method cannot use it"
            )


def _a_circuit_method(entry: Any) -> None:
    if not isinstance(entry, CircuitMethod):
        raise TypeError(f"a circuit method is registered as a CircuitMethod, got {type(entry).__name__}")


_HERE = "contribution_lens.circuits"
CIRCUIT_METHODS: Registry[CircuitMethod] = Registry(
    "circuit method",
    {
        f"{_HERE}.attribution:METHODS": ("eap", "eap-ig", "activation-patching", "random"),
        f"{_HERE}.contribution:METHODS": ("contribution", "contribution-ig"),
        f"{_HERE}.routes:METHODS": ("information-flow-routes", "information-flow-routes-last"),
    },
    check=_a_circuit_method,
    listing="registered",
    calls={"score_fn": "model, task, context"},
)
"""Every registered circuit method by name: the package's own (a new file is one line here), then the user's."""


def register_circuit_method(
    name: str | CircuitMethod,
    score_fn: ScoreFn | None = None,
    *,
    level: str = "edge",
    description: str = "",
    replace: bool = False,
    orientation: ScoreOrientation | str = EFFECT,
    greedy: bool = False,
) -> Any:
    """Register a `CircuitMethod` (or a score function under ``name``); usable as a decorator.

    ``register_circuit_method(CircuitMethod(...))``, ``register_circuit_method("name", fn)``,
    ``@register_circuit_method("name", level="node")`` and the bare ``@register_circuit_method`` (the
    function's own name) all work; the decorators hand the function back. ``orientation`` and
    ``greedy`` as in `CircuitMethod`. A name already taken is refused unless ``replace=True``, a
    built-in always, and so is a name that differs from a registered one only in case; a score
    function that cannot be called as ``score_fn(model, task, context)`` is refused here.
    """
    if isinstance(name, CircuitMethod):
        return CIRCUIT_METHODS.add(name, replace=replace)
    if callable(name) and score_fn is None:  # the bare decorator: the function is its own name
        function: Any = name
        CIRCUIT_METHODS.add(
            CircuitMethod(
                str(function.__name__), function, level, description, orientation=check_orientation(orientation),
                greedy=greedy,
            ),
            replace=replace,
        )  # fmt: skip
        return function

    def method_of(fn: ScoreFn) -> CircuitMethod:
        return CircuitMethod(name, fn, level, description, orientation=check_orientation(orientation), greedy=greedy)

    if score_fn is None:
        return CIRCUIT_METHODS.decorator(method_of, replace=replace)
    return CIRCUIT_METHODS.add(method_of(score_fn), replace=replace)


def unregister_circuit_method(name: str) -> None:
    """Remove a user's circuit method (built-ins stay)."""
    CIRCUIT_METHODS.unregister(name)


def available_circuit_methods() -> list[str]:
    """The registered circuit methods' names, the package's own first (read without importing any method)."""
    return list(CIRCUIT_METHODS)


def get_circuit_method(name: str | CircuitMethod) -> CircuitMethod:
    """The registered circuit method called ``name`` (a `CircuitMethod` is returned as it is)."""
    if isinstance(name, CircuitMethod):
        return name
    try:
        return CIRCUIT_METHODS.lookup(name)
    except ValueError as error:
        raise ValueError(f"method: {error}") from None
