"""Replication: every claim of the paper measured on one model, by the package's own runs, in one folder.

One call (or ``contribution-lens replicate``) runs the text faithfulness run, the multiple-choice
runs (clean accuracy first; removal only where the model is above chance), the opening case
(`contribution_lens.layer_summary` per text) and the sink study, then judges each claim: its number
with a 95 % interval, a verdict in {supported, partly, not supported, no verdict}, one line a reader
can check and the command that reproduces it. One module a role:

* `settings`: what is measured and at which `Size` (``quick``, ``paper``);
* `runner`: the resumable, shardable `run`; `planning`: `plan`, passes and time before anything runs, no weights read;
* `claims`: `Claim`, the verdict rules; `results`: `Replication` (``claims.json``, ``claims.md``, ``report.html``).

Example:
    >>> from contribution_lens import replication
    >>> replication.SIZES["quick"].max_chunks, replication.VERDICTS[-1]
    (8, 'no verdict')
"""

from typing import TYPE_CHECKING

from contribution_lens._lazy import face

_HERE = "contribution_lens.replication"
_EXPORTS = {
    **{name: f"{_HERE}.settings:{name}" for name in ("SIZES", "Size", "ReplicateArgs", "data_settings",
                                                      "text_settings", "choice_settings", "TEXT_METHODS",
                                                      "CHOICE_METHODS")},
    **{name: f"{_HERE}.claims:{name}" for name in ("Claim", "Cell", "VERDICTS", "STATEMENTS", "AT_CHANCE")},
    **{name: f"{_HERE}.runner:{name}" for name in ("run", "part_commands")},
    **{name: f"{_HERE}.planning:{name}" for name in ("plan", "ReplicationPlan")},
    "Replication": f"{_HERE}.results:Replication",
    **{name: f"{_HERE}.{name}" for name in ("settings", "claims", "runner", "planning", "results")},
}  # fmt: skip
__all__ = [
    "AT_CHANCE",
    "CHOICE_METHODS",
    "SIZES",
    "STATEMENTS",
    "TEXT_METHODS",
    "VERDICTS",
    "Cell",
    "Claim",
    "ReplicateArgs",
    "Replication",
    "ReplicationPlan",
    "Size",
    "choice_settings",
    "claims",
    "data_settings",
    "part_commands",
    "plan",
    "planning",
    "results",
    "run",
    "runner",
    "settings",
    "text_settings",
]
__getattr__, __dir__ = face(__name__, _EXPORTS)

if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from contribution_lens.replication import claims, planning, results, runner, settings
    from contribution_lens.replication.claims import AT_CHANCE, STATEMENTS, VERDICTS, Cell, Claim
    from contribution_lens.replication.planning import ReplicationPlan, plan
    from contribution_lens.replication.results import Replication
    from contribution_lens.replication.runner import part_commands, run
    from contribution_lens.replication.settings import (
        CHOICE_METHODS,
        SIZES,
        TEXT_METHODS,
        ReplicateArgs,
        Size,
        choice_settings,
        data_settings,
        text_settings,
    )
