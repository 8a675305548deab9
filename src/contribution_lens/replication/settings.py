"""What a replication measures, and at which size: the faithfulness runs' settings and the sink study's chunks.

A replication is made of runs the package already has, each with its own settings dataclass:

* ``text``: `contribution_lens.faithfulness.run` on the text sets with `TEXT_METHODS` (the four
  measures, Kobayashi's layer-level norm and the random control), masking at every layer and
  deleting input tokens, both modes, both rankings;
* ``choice-clean``: the same run on the multiple-choice sets with nothing removed (ratio 0): the
  model's clean accuracy, its interval and chance;
* ``choice``: the removal run on the multiple-choice sets whose clean accuracy is above chance
  (`CHOICE_METHODS`, masking at every layer, the top-ranked keys removed);
* ``sinks``: `contribution_lens.sink_study` on the first `Size.sink_chunks` chunks of each text
  set, cut as the faithfulness run cuts them; ``opening``: `contribution_lens.layer_summary` of
  each of those chunks.

`Size` presets set the data sizes and ratios (``quick`` for a laptop, ``paper`` for the scale of the
faithfulness command's defaults); any field of `contribution_lens.faithfulness.DataSettings` given
explicitly wins. Standard library only at import.

Example:
    >>> size = SIZES["quick"]
    >>> data = data_settings(("gsm8k",), size)
    >>> data.chunk_length, data.max_chunks, text_settings(size).ratios
    (128, 8, (0.0, 0.1, 0.5))
"""

from dataclasses import dataclass, fields
from typing import Any

from contribution_lens._settings import option
from contribution_lens.faithfulness.settings import DEFAULT_RATIOS, DataSettings, Settings

TEXT_METHODS: tuple[str, ...] = (
    "attention",
    "value_weighted",
    "output_normalized",
    "contribution",
    "kobayashi",
    "random",
)
"""The hierarchy's four measures, Kobayashi et al.'s layer-level norm and the random control."""
CHOICE_METHODS: tuple[str, ...] = ("attention", "value_weighted", "output_normalized", "contribution", "random")
TEXT_PROTOCOLS: tuple[str, ...] = ("every_layer", "input_deletion")
CHOICE_PROTOCOLS: tuple[str, ...] = ("every_layer",)
PARTS: tuple[str, ...] = ("text", "choice-clean", "choice", "opening", "sinks")
"""The sub-folders of a replication's output folder, in the order they run."""


@dataclass(frozen=True)
class Size:
    """The data sizes and removal ratios of one preset."""

    name: str
    chunk_length: int
    """Tokens per text chunk, BOS included where the model takes one."""
    max_chunks: int
    """Text chunks per text set in the faithfulness run."""
    max_items: int
    """Items per multiple-choice set."""
    ratios: tuple[float, ...]
    """Removal ratios of the text run."""
    choice_ratios: tuple[float, ...]
    """Removal ratios of the multiple-choice run (each costs one pass per option)."""
    sink_chunks: int
    """Chunks per text set in the sink study and the opening case (the first ones of the text run)."""


SIZES: dict[str, Size] = {
    "quick": Size("quick", 128, 8, 32, (0.0, 0.1, 0.5), (0.0, 0.1), 8),
    "paper": Size("paper", 256, 200, 200, DEFAULT_RATIOS, DEFAULT_RATIOS, 32),
}
"""``quick``: minutes on a laptop CPU for a 135M model; ``paper``: the faithfulness command's defaults
(200 chunks of 256 tokens and 200 items a set, ratios 0-50 %), a GPU's work for an 8B model."""


@dataclass(frozen=True)
class ReplicateArgs:
    """The replication's own options: its size and whether to stop after the plan."""

    size: str = option(
        "quick",
        "data sizes and ratios: quick (text: 8 chunks of 128 tokens a set, ratios 0,0.1,0.5; multiple "
        "choice: 32 items, ratios 0,0.1; sinks: 8 chunks a set) or paper (200 chunks of 256 tokens, "
        "200 items, ratios 0-0.5; sinks: 32 chunks a set); --chunk-length, --max-chunks, --max-items and "
        "--choice-ratios override it",
        choices=tuple(SIZES),
    )
    dry_run: bool = option(False, "print the number of passes and an estimated time, load no weights, then stop")


SIZED = ("chunk_length", "max_chunks", "max_items", "choice_ratios")
"""`DataSettings` fields a `Size` sets unless given."""


def data_settings(data: tuple[str, ...], size: Size, **given: Any) -> DataSettings:
    """`DataSettings` of a replication: ``given`` fields (not None) win over the size's."""
    preset = {name: getattr(size, name) for name in SIZED}
    chosen = {name: value for name, value in given.items() if value is not None}
    known = {f.name for f in fields(DataSettings)}
    return DataSettings(data=tuple(data), **{**preset, **{k: v for k, v in chosen.items() if k in known}})


def text_settings(size: Size) -> Settings:
    """The text run: every measure, both removal protocols, both modes, both rankings."""
    return Settings(methods=TEXT_METHODS, protocols=TEXT_PROTOCOLS, ratios=size.ratios)


def clean_settings() -> Settings:
    """The multiple-choice clean run: nothing is removed (one clean and one ratio-0 pass a unit).

    (A function: building `Settings` checks the method names against the registry, which imports torch.)
    """
    return Settings(methods=("random",), modes=("comprehensiveness",), ratios=(0.0,), rank_by=("abs",))


def choice_settings(ratios: tuple[float, ...]) -> Settings:
    """The multiple-choice removal run: the top-ranked keys removed at every layer."""
    return Settings(
        methods=CHOICE_METHODS,
        protocols=CHOICE_PROTOCOLS,
        modes=("comprehensiveness",),
        ratios=ratios,
        rank_by=("abs",),
    )
