"""Importance measures as registered objects: every harness (faithfulness, plots, CLI) takes any of them.

The registry (`contribution_lens.methods.registry`) knows no method; this face registers the
package's own families, one file each:

* `factors`: ``attention``, ``value_weighted``, ``output_normalized``, ``contribution``;
* `control`: the ``random`` baseline;
* `kobayashi`: ``kobayashi``, the layer-level norm ``||sum_h alpha f_h(x)||`` (Kobayashi et al.);
* `alti`: ``alti`` and ``alti_rollout`` (Ferrando et al.);
* `value_zeroing`: ``value_zeroing`` (Mohebbi et al.);
* `gradient`: ``grad_attention``;
* `rollout`: ``flow`` (the signed rollout of `contribution_lens.flow`) and ``attention_rollout``;
* `logit`: ``logit_attribution`` (each key's direct effect on a text's last next-token logit).

A new family is one file with a ``METHODS`` tuple, added to ``_FAMILIES`` below.
"""

from contribution_lens.methods import alti, control, factors, gradient, kobayashi, logit, rollout, value_zeroing
from contribution_lens.methods.factors import importance
from contribution_lens.methods.registry import (
    Method,
    ScoreContext,
    available_methods,
    decomposition_measures,
    default_methods,
    get_method,
    register_method,
    unregister_method,
)

_FAMILIES = (factors, control, kobayashi, alti, value_zeroing, gradient, rollout, logit)
for _family in _FAMILIES:
    for _method in _family.METHODS:
        register_method(_method)

__all__ = [
    "Method",
    "ScoreContext",
    "available_methods",
    "decomposition_measures",
    "default_methods",
    "get_method",
    "importance",
    "register_method",
    "unregister_method",
]
