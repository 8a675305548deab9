"""The method registry: importance measures as registered objects, found by name.

A `Method` (`contribution_lens.methods.method`) turns one layer into scores; every harness (the
faithfulness run, the plots, the CLI) takes any registered method, the user's own included. This
module knows no method: `METHODS` declares the package's own by name, family by family (``factors``,
``control``, ``kobayashi``, ``alti``, ``value_zeroing``, ``gradient``, ``rollout``, ``logit``, each a
file with a ``METHODS`` tuple), and a family is imported when one of its methods is first read, so
the names are listed (the command line's ``--help``) without importing torch.

Registering your own takes a function of the layer:

    >>> import contribution_lens as cl
    >>> @cl.register_method("value_norm_only", description="||vt_j^h|| alone, ignoring attention")
    ... def value_norm_only(layer, context):
    ...     d = layer.decompose(context.scope)
    ...     return d.value_norm[:, :, None, :] * d.valid[:, None].to(d.value_norm.dtype)
    >>> "value_norm_only" in cl.available_methods()
    True
    >>> cl.unregister_method("value_norm_only")
"""

from typing import TYPE_CHECKING, Any

from contribution_lens._lazy import face
from contribution_lens._registry import Registry

if TYPE_CHECKING:
    from contribution_lens.methods.method import DecompositionScore, Method, PrepareFn, ScoreFn


def _a_method(entry: Any) -> None:
    from contribution_lens.methods.method import Method

    if not isinstance(entry, Method):
        raise TypeError(f"a method is registered as a Method, got {type(entry).__name__}")


_HERE = "contribution_lens.methods"
METHODS: "Registry[Method]" = Registry(
    "method",
    {
        f"{_HERE}.factors:METHODS": ("attention", "value_weighted", "output_normalized", "contribution"),
        f"{_HERE}.control:METHODS": ("random",),
        f"{_HERE}.kobayashi:METHODS": ("kobayashi",),
        f"{_HERE}.alti:METHODS": ("alti", "alti_rollout"),
        f"{_HERE}.value_zeroing:METHODS": ("value_zeroing",),
        f"{_HERE}.gradient:METHODS": ("grad_attention",),
        f"{_HERE}.rollout:METHODS": ("flow", "attention_rollout"),
        f"{_HERE}.logit:METHODS": ("logit_attribution",),
    },
    check=_a_method,
    calls={"score_fn": "layer, context"},
)
"""Every registered method by name: the package's own (a new family is one line here), then the user's."""
_MOVED = ("Method", "ScoreContext", "ScoreFn", "PrepareFn", "DecompositionScore", "SCORE_DTYPES", "check_scores",
          "prepared_score", "normalise_rows")  # fmt: skip
__getattr__, _ = face(
    __name__, {}, {name: (f"{_HERE}.method:{name}", f"use contribution_lens.methods.method.{name}") for name in _MOVED}
)


def register_method(
    name: "str | Method",
    score_fn: "ScoreFn | None" = None,
    *,
    description: str = "",
    signed: bool = False,
    capture: tuple[str, ...] = (),
    prepare: "PrepareFn | None" = None,
    control: bool = False,
    label: str = "",
    token_level: bool = False,
    replace: bool = False,
) -> Any:
    """Register a `Method` (or a score function under ``name``); usable as a decorator.

    ``register_method(Method(...))``, ``register_method("name", fn)`` and
    ``@register_method("name")`` all work. A name already taken is refused unless
    ``replace=True``; a built-in is never replaced.
    """
    from contribution_lens.methods.method import Method

    if isinstance(name, Method):
        return METHODS.add(name, replace=replace)

    def method_of(fn: "ScoreFn") -> Method:
        return Method(name, fn, description, signed, tuple(capture), prepare, control, label, token_level=token_level)

    if score_fn is None:
        return METHODS.decorator(method_of, replace=replace)
    return METHODS.add(method_of(score_fn), replace=replace)


def unregister_method(name: str) -> None:
    """Remove a user's method (built-ins stay)."""
    METHODS.unregister(name)


def get_method(name: "str | Method") -> "Method":
    """The registered method called ``name`` (a `Method` is returned as it is)."""
    from contribution_lens.methods.method import Method

    return name if isinstance(name, Method) else METHODS.lookup(name)


def available_methods() -> tuple[str, ...]:
    """Names of every registered method, built-ins first (read without importing any method)."""
    return tuple(METHODS)


def default_methods() -> tuple[str, ...]:
    """The methods a faithfulness run compares unless told otherwise (``--methods all``)."""
    return tuple(name for name, method in METHODS.items() if method.default)


def decomposition_measures() -> "dict[str, DecompositionScore]":
    """Every registered method that reads one layer's `Decomposition` alone, by its label, in registration order.

    What a figure comparing measures draws (`contribution_lens.drawing.plot.measure_bars`): the four
    built-ins and any registered with `Method.from_decomposition`.

    Example:
        >>> import contribution_lens as cl
        >>> list(cl.methods.decomposition_measures())[:2]
        ['attention α', 'value-weighted α‖vt‖']
    """
    return {
        method.label: method.decomposition_score
        for method in METHODS.values()
        if method.decomposition_score is not None
    }
