"""Faithfulness by removal: take away what a measure ranks highest (or lowest), see the loss change.

Scoring. A clean forward pass scores every key ``j <= i`` for every query ``i`` at every scored
layer; the token-level score is the sum over heads of the method's per-head score
(`importance`), or, with ``granularity="head"``, each head keeps its own score and ranking.

Ranking. For query ``i``, ``floor(r * (i + 1))`` candidates are removed: the highest ranked
(*comprehensiveness*: a faithful measure hurts most) or the lowest ranked (*sufficiency*: a
faithful measure hurts least). Ranking is by ``|score|`` (``"abs"``) or by the signed score
(``"signed"``); both are run by default. Only methods with signed scores (contribution) differ
between the two, so the signed variant is reported as ``"contribution:signed"``.

Removal protocols (`PROTOCOLS`, selected by name in ``Settings.protocols``; each is defined in
`contribution_lens.faithfulness.protocols`): ``every_layer`` removes the ranked keys' projected
values at every scored layer (no renormalising), ``one_layer`` at one scored layer at a time, and
``input_deletion`` deletes the keys ranked by the layer-averaged score from each query's view at
every layer (the softmax renormalised over the rest).

The ``random`` control draws uniform scores from a hash of (seed, the text's token ids,
layer, head, query, key), so a text's control never depends on its batch or padding.

Metric: the change in mean negative log-likelihood over the same predicted tokens (Δloss),
and beside it the change in perplexity.

Why ``value_weighted`` and ``output_normalized`` tie under ``scope="inter"``: the
output-normalised score is ``alpha_ij^h ||vt_j^h|| / ||o_i||`` and in the inter scope
``||o_i||`` is the norm of the whole layer output, shared by every head and key of query
``i``. Dividing all of a query's candidates by the same positive number does not change
their order, so both measures remove the same keys and give identical curves (the
verdict between them is "indistinguishable" by construction). Under ``scope="intra"`` the
norm is per head, ``||o_i^h||``, which reorders the keys once heads are summed, or use
``granularity="head"``.

The face of the harness, one module a role:

* `settings`: `Settings` (what is measured), `DataSettings` (on what), `RunOptions` (how it runs);
* `removal`: ranking, keep masks, the clean run and masked passes; `protocols`: where keys go;
* `run`: the resumable, shardable run (`run`, `plan_run`); `results`: `FaithfulnessRun`;
* `statistics`: paired bootstrap, AOPC, verdicts; `report`: the HTML report; `data`: the loaders.

Example (a real run, on the bundled model):
    >>> import contribution_lens as cl, tempfile
    >>> from contribution_lens import faithfulness
    >>> model = cl.load_model()
    >>> text = tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False)
    >>> _ = text.write("The cat sat on the mat because it was warm, and the dog slept by the door. " * 4)
    >>> text.close()
    >>> settings = faithfulness.Settings(methods=("attention", "random"), ratios=(0.0, 0.5), layers=(0,))
    >>> data = faithfulness.DataSettings(data=(f"text={text.name}",), chunk_length=16, max_chunks=2)
    >>> result = faithfulness.run(model, settings, data, tempfile.mkdtemp(), progress=False)
    >>> sorted(result.summary["method"].unique())
    ['attention', 'random']
"""

from typing import TYPE_CHECKING

from contribution_lens._lazy import face

_HERE = "contribution_lens.faithfulness"
_EXPORTS = {
    **{name: f"{_HERE}.settings:{name}" for name in ("Settings", "DataSettings", "RunOptions", "LM_TASKS",
                                                      "CHOICE_TASKS", "DEFAULT_RATIOS")},
    **{
        name: f"{_HERE}.runner:{name}"
        for name in ("run", "plan_run", "RunPlan", "merge_records", "clean_run", "conditions")
    },
    **{name: f"{_HERE}.results:{name}" for name in ("FaithfulnessRun", "mean_over_ratios", "read_records")},
    **{name: f"{_HERE}.registry:{name}" for name in ("PROTOCOLS", "register_protocol")},
    **{
        name: f"{_HERE}.removal:{name}"
        for name in ("RemovalProtocol", "CleanRun", "Condition", "masked_forward", "removal_edit",
                     "removal_keep_mask", "removal_rank", "keep_from_rank", "n_removed", "is_signed",
                     "NOTHING_REMOVED")
    },
    "MODES": "contribution_lens.choices:MODES",
    "RANKINGS": "contribution_lens.choices:RANKINGS",
    **{name: f"{_HERE}.{name}" for name in ("data", "statistics", "report", "settings", "removal", "protocols",
                                            "results", "runner")},
}  # fmt: skip
_DEPRECATED = {
    "Protocol": (f"{_HERE}.settings:Settings", "use contribution_lens.faithfulness.Settings"),
    "ALL_METHODS": (
        "contribution_lens._compat:DEFAULT_METHODS",
        "use contribution_lens.methods.default_methods()",
    ),
    "CONTROL": ("contribution_lens._compat:CONTROL", "use Method.control of the registered methods"),
    "token_nll": ("contribution_lens.losses:token_nll", "use contribution_lens.losses.token_nll"),
    "continuation_logprob": (
        "contribution_lens.losses:continuation_logprob",
        "use contribution_lens.losses.continuation_logprob",
    ),
    "perplexity": ("contribution_lens.losses:perplexity", "use contribution_lens.losses.perplexity"),
}
__all__ = [
    "CHOICE_TASKS",
    "DEFAULT_RATIOS",
    "LM_TASKS",
    "MODES",
    "NOTHING_REMOVED",
    "PROTOCOLS",
    "RANKINGS",
    "CleanRun",
    "Condition",
    "DataSettings",
    "FaithfulnessRun",
    "RemovalProtocol",
    "RunOptions",
    "RunPlan",
    "Settings",
    "clean_run",
    "conditions",
    "data",
    "is_signed",
    "keep_from_rank",
    "masked_forward",
    "mean_over_ratios",
    "merge_records",
    "n_removed",
    "plan_run",
    "protocols",
    "read_records",
    "register_protocol",
    "removal",
    "removal_edit",
    "removal_keep_mask",
    "removal_rank",
    "report",
    "results",
    "run",
    "runner",
    "settings",
    "statistics",
]
__getattr__, __dir__ = face(__name__, _EXPORTS, _DEPRECATED)

if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from contribution_lens.choices import MODES, RANKINGS
    from contribution_lens.faithfulness import data, protocols, removal, report, results, runner, settings, statistics
    from contribution_lens.faithfulness.registry import PROTOCOLS, register_protocol
    from contribution_lens.faithfulness.removal import (
        NOTHING_REMOVED,
        CleanRun,
        Condition,
        RemovalProtocol,
        is_signed,
        keep_from_rank,
        masked_forward,
        n_removed,
        removal_edit,
        removal_keep_mask,
        removal_rank,
    )
    from contribution_lens.faithfulness.results import FaithfulnessRun, mean_over_ratios, read_records
    from contribution_lens.faithfulness.runner import RunPlan, clean_run, conditions, merge_records, plan_run, run
    from contribution_lens.faithfulness.settings import (
        CHOICE_TASKS,
        DEFAULT_RATIOS,
        LM_TASKS,
        DataSettings,
        RunOptions,
        Settings,
    )
