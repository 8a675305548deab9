"""Where the names of version 0.2 went: old module paths and names keep working, with a warning.

Version 0.3 grouped the flat modules into subpackages (`contribution_lens.methods`,
`contribution_lens.faithfulness`, `contribution_lens.analyses`, `contribution_lens.views`,
`contribution_lens.cli`). ``import contribution_lens.evaluation`` and the like still work: each
old module is a stand-in whose names are looked up in their new homes, and every read warns
(``DeprecationWarning``) with the new place. Nothing here is used by the package itself, except the
inspector's old names, whose table lives with the inspector (`views.inspector._deprecated`).
Standard library only at import.
"""

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from typing import Any

from contribution_lens._lazy import resolve

_F = "contribution_lens.faithfulness"
MOVED: dict[str, tuple[str, ...]] = {
    "evaluation": (f"{_F}.runner", f"{_F}.results", f"{_F}.settings", "contribution_lens._compat"),
    "stats": (f"{_F}.statistics",),
    "data": (f"{_F}.data",),
    "faithfulness_report": (f"{_F}.report", f"{_F}.protocols"),
    "report": ("contribution_lens.drawing.html",),
    "peers": (
        "contribution_lens.methods.alti",
        "contribution_lens.methods.value_zeroing",
        "contribution_lens.methods.gradient",
        "contribution_lens.methods.method",
        "contribution_lens.decomposition",
        "contribution_lens.losses",
    ),
    "geometry": ("contribution_lens.analyses.geometry",),
    "sinks": ("contribution_lens.analyses.sinks",),
    "sink_intervention": ("contribution_lens.analyses.sink_intervention",),
    "inspector": ("contribution_lens.views.inspector",),
    "_cli_checks": ("contribution_lens.cli.checks",),
    "_outdir": ("contribution_lens.cli.outdir",),
    "circuits.figures": ("contribution_lens.drawing.circuit_figures",),
    "circuits.curve_figure": ("contribution_lens.drawing.circuit_figures",),
}
"""Old module (under ``contribution_lens.``) -> the modules its names now live in, searched in order."""
ALIASES: dict[str, str] = {"plot": "contribution_lens.drawing.plot"}
"""Old module paths that stay public: ``contribution_lens.plot`` is `contribution_lens.drawing.plot` itself."""
RELOCATED: dict[str, str] = {
    "views.plot": "contribution_lens.drawing.plot",
    "views.html": "contribution_lens.drawing.html",
}
"""Modules that moved whole (under ``contribution_lens.``) -> their new path: importing the old one gives the
module itself and warns (``DeprecationWarning``) with the new path."""
RENAMED: dict[str, tuple[str, str]] = {
    "RunConfig": ("contribution_lens._compat:RunConfig", f"{_F}.DataSettings(data=...)"),
    "run_faithfulness": ("contribution_lens._compat:run_faithfulness", f"{_F}.run (it returns a FaithfulnessRun)"),
    "summarise": ("contribution_lens._compat:summarise", f"{_F}.FaithfulnessRun(records).summary"),
    "analyse": ("contribution_lens._compat:analyse", f"{_F}.FaithfulnessRun(records).summary and .tables"),
    "write_report": (f"{_F}.report:write_report", f"{_F}.FaithfulnessRun.report"),
    "summarise_decomposition": (
        "contribution_lens.analyses.geometry:layer_disagreement",
        "contribution_lens.analyses.geometry.layer_disagreement",
    ),
    "mean_next_token_nll": ("contribution_lens._compat:mean_next_token_nll", "contribution_lens.losses.mean_token_nll"),
    "PEER_METHODS": ("contribution_lens._compat:PEER_METHODS", "contribution_lens.available_methods()"),
    "curves_figure": (
        "contribution_lens.drawing.circuit_figures:faithfulness_figure",
        "contribution_lens.plot.faithfulness_figure (contribution_lens.drawing.circuit_figures)",
    ),
    "curve_figure": (
        "contribution_lens._compat:curve_figure",
        "contribution_lens.plot.faithfulness_figure(curve.table.assign(method=...)), or curve.figures()",
    ),
    "scores_figure": (
        "contribution_lens.drawing.circuit_figures:node_scores_figure",
        "contribution_lens.drawing.circuit_figures.node_scores_figure",
    ),
    "nodes_figure": (
        "contribution_lens._compat:nodes_figure",
        "contribution_lens.drawing.circuit_figures.circuit_nodes_figure(graph.components, kept)",
    ),
    "metrics_figure": (
        "contribution_lens.drawing.circuit_figures:prompt_metrics_figure",
        "contribution_lens.drawing.circuit_figures.prompt_metrics_figure",
    ),
}
"""Names that changed, wherever they were read from: (where the old behaviour lives, what to use instead)."""


def _lookup(old: str, name: str) -> tuple[Any, str]:
    if name in RENAMED:
        location, advice = RENAMED[name]
        return resolve(location), advice
    from contribution_lens.views.inspector._deprecated import INSPECTOR_NAMES

    if old == "inspector" and name in INSPECTOR_NAMES:  # the face forwards it: straight to where it lives
        home = INSPECTOR_NAMES[name]
        return getattr(importlib.import_module(home), name), f"{home}.{name}"
    for module in MOVED[old]:
        target = importlib.import_module(module)
        if hasattr(target, name):
            return getattr(target, name), f"{module}.{name}"
    raise AttributeError(f"module 'contribution_lens.{old}' has no attribute {name!r} (it moved: {MOVED[old][0]})")


def stand_in(old: str) -> types.ModuleType:
    """The stand-in module ``contribution_lens.<old>``: every name read warns and comes from its new home."""
    module = types.ModuleType(f"contribution_lens.{old}", f"Deprecated: moved to {MOVED[old][0]}.")

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value, where = _lookup(old, name)
        warnings.warn(f"contribution_lens.{old}.{name} is deprecated: use {where}", DeprecationWarning, stacklevel=2)
        return value

    module.__dict__["__getattr__"] = __getattr__
    return module


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers ``import contribution_lens.<old>`` with the stand-in (or, for `ALIASES` and `RELOCATED`, the
    module itself)."""

    def __init__(self) -> None:
        self._specs: dict[str, Any] = {}

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        package, _, old = fullname.partition(".")
        if package != "contribution_lens" or (old not in MOVED and old not in ALIASES and old not in RELOCATED):
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        old = spec.name.partition(".")[2]
        if old in ALIASES or old in RELOCATED:
            module = importlib.import_module(ALIASES.get(old) or RELOCATED[old])
            self._specs[module.__name__] = module.__spec__
            if old in RELOCATED:
                warnings.warn(f"{spec.name} is deprecated: use {module.__name__}", DeprecationWarning, stacklevel=2)
            return module
        return stand_in(old)

    def exec_module(self, module: types.ModuleType) -> None:
        if module.__name__ in self._specs:
            # The import system gave the real module the alias's spec: it keeps its own.
            module.__spec__ = self._specs.pop(module.__name__)
            return
        warnings.warn(
            f"{module.__name__} is deprecated: its names moved to {MOVED[module.__name__.partition('.')[2]][0]}",
            DeprecationWarning,
            stacklevel=2,
        )


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.append(_Finder())


# --- the old call signatures, kept as thin wrappers --------------------------------------------


def RunConfig(lm: tuple[str, ...] = (), choice: tuple[str, ...] = (), **sizes: Any) -> Any:
    """``evaluation.RunConfig(lm=..., choice=...)``: now `contribution_lens.faithfulness.DataSettings(data=...)`."""
    from contribution_lens.faithfulness import DataSettings

    return DataSettings(data=(*lm, *choice), **sizes)


def run_faithfulness(model: Any, config: Any, protocol: Any, out: Any, **options: Any) -> Any:
    """``evaluation.run_faithfulness``: now `contribution_lens.faithfulness.run`; this returns its summary."""
    from contribution_lens.faithfulness import RunOptions, run

    resamples = options.pop("resamples", 1000)
    rows = options.pop("rows_per_pass", None)
    result = run(model, protocol, config, out, options=RunOptions(resamples, rows), **options)
    return None if result is None else result.summary


def curve_figure(curves: Any) -> Any:
    """``circuits.curve_figure.curve_figure(curves)``: now `contribution_lens.plot.faithfulness_figure`."""
    import pandas as pd

    from contribution_lens.drawing.circuit_figures import faithfulness_figure

    tables = [curve.figure_table() for curve in curves]
    title = f"Faithfulness of circuits on {curves[0].task}/{curves[0].counterfactual}" if len(curves) else ""
    return faithfulness_figure(pd.concat(tables, ignore_index=True), title=title)


def nodes_figure(graph: Any, kept: Any) -> Any:
    """``circuits.curve_figure.nodes_figure(graph, kept)``: now ``circuit_nodes_figure(graph.components, kept)``."""
    from contribution_lens.drawing.circuit_figures import circuit_nodes_figure

    return circuit_nodes_figure(graph.components, kept)


def _run_of(records: list[dict[str, Any]], resamples: int, seed: int) -> Any:
    from contribution_lens.faithfulness import FaithfulnessRun

    return FaithfulnessRun(records, resamples=resamples, seed=seed)


def analyse(records: list[dict[str, Any]], *, resamples: int = 1000, seed: int = 0) -> Any:
    """``evaluation.analyse``: now `FaithfulnessRun.summary` and `FaithfulnessRun.tables`."""
    run = _run_of(records, resamples, seed)
    return run.summary, run.tables


def summarise(records: list[dict[str, Any]], *, resamples: int = 1000, seed: int = 0) -> Any:
    """``evaluation.summarise``: now `FaithfulnessRun.summary`."""
    return _run_of(records, resamples, seed).summary


def mean_next_token_nll(logits: Any, batch: Any) -> Any:
    """``peers.mean_next_token_nll``: now `contribution_lens.losses.mean_token_nll`."""
    from contribution_lens.losses import mean_token_nll

    return mean_token_nll(logits, batch.tokens, batch.attention_mask, what="grad_attention")


PEER_METHODS = ("alti", "alti_rollout", "value_zeroing", "grad_attention")
CONTROL = "random"
DECOMPOSITION_METHODS = ("attention", "value_weighted", "output_normalized", "contribution")
"""What ``contribution_lens.METHODS`` was: the measures read off one layer's decomposition."""


def visible(layer: Any) -> Any:
    """``methods.rollout.visible(layer)``: now the property `contribution_lens.LayerInputs.valid`."""
    return layer.valid


def __getattr__(name: str) -> Any:
    if name == "DEFAULT_METHODS":
        from contribution_lens.methods import default_methods

        return default_methods()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
