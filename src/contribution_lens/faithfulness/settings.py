"""The settings of a faithfulness run: what it measures, on which data, and how it runs.

Three frozen dataclasses, each option defined once (`contribution_lens._settings.option`): the
Python API takes them, the command line builds ``contribution-lens faithfulness``'s flags and
their checks from them, and `Settings` and `DataSettings` are recorded in the run's
``config.json`` (a resumed run must match them). Standard library only at import.

Example:
    >>> Settings(methods=("attention", "contribution"), ratios=(0.0, 0.1)).variants()
    [('attention', 'abs'), ('contribution', 'abs'), ('contribution', 'signed')]
    >>> DataSettings(data=("gsm8k",), max_chunks=0)
    Traceback (most recent call last):
    ...
    contribution_lens._settings.SettingError: max_chunks: expected a positive integer, got 0
"""

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from contribution_lens._settings import (
    Invalid,
    SettingError,
    at_least,
    check_fields,
    check_prepend_bos,
    check_ratios,
    option,
    parse_integers,
    parse_names,
    parse_prepend_bos,
    parse_ratios,
    subset,
)
from contribution_lens.choices import MODES, RANKINGS, SCOPES, Granularity

LM_TASKS: tuple[str, ...] = ("gsm8k", "fineweb", "text")
"""Text sets for language modelling (``NAME=PATH``; see `contribution_lens.faithfulness.data`)."""
CHOICE_TASKS: tuple[str, ...] = ("mmlu", "winogrande", "boolq")
"""Multiple-choice sets."""
DEFAULT_RATIOS: tuple[float, ...] = (0.0, 0.01, 0.05, 0.1, 0.2, 0.5)
"""Low ratios, where the curves separate; ratio 0 checks that the hooks change nothing."""


def _methods() -> tuple[str, ...]:
    from contribution_lens.methods import available_methods

    return available_methods()


def _protocols() -> tuple[str, ...]:
    from contribution_lens.faithfulness.registry import PROTOCOLS

    return tuple(PROTOCOLS)


def _methods_help() -> str:
    return f"comma-separated registered methods ({', '.join(_methods())}), or 'all' (the four measures and random)"


def _protocols_help() -> str:
    return f"comma-separated removal protocols ({', '.join(_protocols())}), or 'all' (each one: docs/faithfulness.md)"


def _layers(value: Any) -> None:
    if value is not None and (isinstance(value, str) or not all(isinstance(x, int) for x in value) or not value):
        raise Invalid("comma-separated integers")


@dataclass(frozen=True)
class Settings:
    """What a faithfulness run measures: methods, removal protocols, modes, ratios, ranking (recorded)."""

    methods: tuple[str, ...] | str = option(
        "all",
        _methods_help,
        parse=parse_names,
        check=subset(_methods, all_word=True),
    )
    modes: tuple[str, ...] = option(MODES, "comma-separated", parse=parse_names, check=subset(lambda: MODES))
    ratios: tuple[float, ...] = option(
        DEFAULT_RATIOS, "removal ratios in [0, 1)", parse=parse_ratios, check=check_ratios
    )
    layers: tuple[int, ...] | None = option(
        None, "comma-separated layers to mask (default: all)", parse=parse_integers, check=_layers
    )
    """Layers whose scores rank keys (and where the masking protocols mask); None = all."""
    rank_by: tuple[str, ...] | str = option(
        RANKINGS,
        "rank keys by |score|, by the signed score, or both (comma-separated)",
        parse=parse_names,
        check=subset(lambda: RANKINGS),
    )
    scope: str = option("inter", "||o|| of the layer (inter) or of each head (intra) in the scores", choices=SCOPES)
    """See `contribution_lens.faithfulness` for why value_weighted and output_normalized tie under inter."""
    seed: int = option(0, "seed of the random control")
    protocols: tuple[str, ...] | str = option(
        ("every_layer",),
        _protocols_help,
        flag="--protocol",
        parse=parse_names,
        check=subset(_protocols, all_word=True),
    )
    granularity: str = option(
        "token",
        "rank tokens (heads summed) or each head's keys (masking protocols only)",
        choices=Granularity.names(),
    )

    def __post_init__(self) -> None:
        if isinstance(self.rank_by, str):
            object.__setattr__(self, "rank_by", (self.rank_by,))
        for name in ("methods", "modes", "ratios", "rank_by", "protocols", "layers"):
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
        check_fields(self)
        if self.methods == "all":
            from contribution_lens.methods import default_methods

            object.__setattr__(self, "methods", default_methods())
        if self.protocols == "all":
            object.__setattr__(self, "protocols", _protocols())
        if self.granularity == Granularity.HEAD and "input_deletion" in self.protocols:
            raise SettingError(
                "granularity", "'token' with {protocols} input_deletion (it ranks tokens)", self.granularity
            )
        if self.granularity == Granularity.HEAD:
            from contribution_lens.methods import get_method

            tokens_only = [name for name in self.methods if get_method(name).token_level]
            if tokens_only:
                raise SettingError(
                    "granularity", f"'token' with {', '.join(tokens_only)} (token-level scores)", self.granularity
                )

    def to_dict(self) -> dict[str, Any]:
        listed = ("methods", "modes", "ratios", "rank_by", "protocols")
        return {**asdict(self), **{name: list(getattr(self, name)) for name in listed}}

    def variants(self) -> list[tuple[str, str]]:
        """(method, ranking) pairs to run: the signed ranking only where it differs from ``|score|``."""
        from contribution_lens.methods import get_method

        pairs = []
        for method in self.methods:
            for rank in self.rank_by:
                if rank == "signed" and not get_method(method).signed and "abs" in self.rank_by:
                    continue
                pairs.append((method, rank))
        return pairs


def check_data_specs(known: tuple[str, ...], *, text_only: bool = False) -> Any:
    """``NAME=PATH`` (a known NAME and an existing path) or a bare ``NAME`` (a packaged or HF set)."""

    def check(specs: Any) -> None:
        if isinstance(specs, str):
            raise Invalid("a sequence of NAME=PATH or NAME")
        for spec in specs:
            name, sep, path = (part.strip() for part in str(spec).partition("="))
            if not name or (sep and not path):
                raise Invalid("NAME=PATH or NAME", got=spec)
            if sep and name.lower() not in known:
                raise Invalid(f"NAME=PATH with NAME one of {', '.join(known)}", got=spec)
            if sep and not Path(path).exists():
                raise Invalid("NAME=PATH with an existing file or folder", got=spec, why=f"{path} does not exist")
            if text_only and name.lower() in CHOICE_TASKS:
                raise Invalid(f"a text set ({', '.join(LM_TASKS)})", got=spec)

    return check


def _optional_ratios(value: Any) -> None:
    if value is not None:
        check_ratios(value)


@dataclass(frozen=True)
class DataSettings:
    """What a faithfulness run is measured on: text and multiple-choice sets, and their sizes (recorded)."""

    data: tuple[str, ...] = option(
        (),
        f"NAME=PATH or NAME, NAME one of {', '.join(LM_TASKS + CHOICE_TASKS)}; repeatable",
        check=check_data_specs(LM_TASKS + CHOICE_TASKS),
        many=True,
        required=True,
    )
    chunk_length: int = option(256, "tokens per text chunk, BOS included where there is one", check=at_least(2))
    max_chunks: int | None = option(200, "text chunks per data set", check=at_least(1, optional=True))
    max_items: int | None = option(200, "items per multiple-choice set", check=at_least(1, optional=True))
    max_item_tokens: int = option(512, "longer items are skipped", check=at_least(1))
    batch_size: int = option(8, "sequences per forward pass", check=at_least(1))
    choice_ratios: tuple[float, ...] | None = option(
        None,
        "ratios for multiple-choice sets (default: those of --ratios)",
        parse=parse_ratios,
        check=_optional_ratios,
    )
    """Ratios for multiple-choice tasks (they cost one pass per option); None = the settings' ratios."""
    prepend_bos: bool | None = option(
        None,
        "start every chunk and item with the tokenizer's BOS: yes, no or model (default: the model's own "
        "choice, cfg.default_prepend_bos)",
        parse=parse_prepend_bos,
        check=check_prepend_bos,
        show="model",
    )
    """BOS at the start of every sequence; None: the model's own choice (recorded only where given)."""

    def __post_init__(self) -> None:
        for name in ("data", "choice_ratios"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        check_fields(self)
        if not self.data:
            raise ValueError("nothing to evaluate: give at least one text or multiple-choice data set")

    @property
    def lm(self) -> tuple[str, ...]:
        """The text sets (language modelling)."""
        return tuple(spec for spec in self.data if task_name(spec) not in CHOICE_TASKS)

    @property
    def choice(self) -> tuple[str, ...]:
        """The multiple-choice sets."""
        return tuple(spec for spec in self.data if task_name(spec) in CHOICE_TASKS)

    def to_dict(self) -> dict[str, Any]:
        return {
            "lm": list(self.lm),
            "choice": list(self.choice),
            "chunk_length": self.chunk_length,
            "max_chunks": self.max_chunks,
            "max_items": self.max_items,
            "max_item_tokens": self.max_item_tokens,
            "batch_size": self.batch_size,
            "choice_ratios": None if self.choice_ratios is None else list(self.choice_ratios),
            # Absent unless given: a run recorded before the option existed resumes with the same settings.
            **({} if self.prepend_bos is None else {"prepend_bos": self.prepend_bos}),
        }


@dataclass(frozen=True)
class RunOptions:
    """How a run is carried out: never recorded, never changes a record."""

    resamples: int = option(
        1000, "paired bootstrap resamples over texts for the 95%% intervals", flag="--bootstrap", check=at_least(1)
    )
    rows_per_pass: int | None = option(
        None, "rows stacked in one forward pass (default: 64 on a GPU, none on a CPU)", check=at_least(1, optional=True)
    )
    threads: int | None = option(
        None,
        "torch threads of each process on a CPU (default: the cores this process may use divided by the "
        "processes on this machine, LOCAL_WORLD_SIZE under torchrun, and at most OMP_NUM_THREADS where set)",
        check=at_least(1, optional=True),
    )

    def __post_init__(self) -> None:
        check_fields(self)

    def cpu_threads(self) -> int:
        """The torch threads a CPU run uses: `threads`, else the default its help states (never oversubscribed).

        Example:
            >>> RunOptions(threads=3).cpu_threads()
            3
        """
        if self.threads is not None:
            return self.threads
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads = max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
        limit = os.environ.get("OMP_NUM_THREADS", "")
        return min(threads, int(limit)) if limit.isdigit() and int(limit) > 0 else threads


def task_name(spec: str) -> str:
    """The data set's name in a ``NAME=PATH`` or ``NAME`` spec, lower case."""
    return spec.partition("=")[0].strip().lower()
