"""Importance measures as registered objects: every harness (faithfulness, plots, CLI) takes any of them.

`method` says what a measure is (`Method`, `ScoreContext`); `registry` finds them by name (`METHODS`,
`register_method`, `get_method`, ...) and declares the package's own families, one file each, imported
when one of their methods is first read:

* `factors`: ``attention``, ``value_weighted``, ``output_normalized``, ``contribution``;
* `control`: the ``random`` baseline;
* `kobayashi`: ``kobayashi``, the layer-level norm ``||sum_h alpha f_h(x)||`` (Kobayashi et al.);
* `alti`: ``alti`` and ``alti_rollout`` (Ferrando et al.);
* `value_zeroing`: ``value_zeroing`` (Mohebbi et al.);
* `gradient`: ``grad_attention``;
* `rollout`: ``flow`` (the signed rollout of `contribution_lens.flow`) and ``attention_rollout``;
* `logit`: ``logit_attribution`` (each key's direct effect on a text's last next-token logit).

A new family is one file with a ``METHODS`` tuple and its line in `registry.METHODS`. This face imports
on first use, so listing the methods' names imports no torch.
"""

from typing import TYPE_CHECKING

from contribution_lens._lazy import face

_HERE = "contribution_lens.methods"
_EXPORTS = {
    **{name: f"{_HERE}.method:{name}" for name in ("Method", "ScoreContext")},
    "importance": f"{_HERE}.factors:importance",
    **{
        name: f"{_HERE}.registry:{name}"
        for name in ("available_methods", "decomposition_measures", "default_methods", "get_method",
                     "register_method", "unregister_method")
    },
}  # fmt: skip
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = face(__name__, _EXPORTS)

if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from contribution_lens.methods.factors import importance
    from contribution_lens.methods.method import Method, ScoreContext
    from contribution_lens.methods.registry import (
        available_methods,
        decomposition_measures,
        default_methods,
        get_method,
        register_method,
        unregister_method,
    )
