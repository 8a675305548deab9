"""Settings dataclasses: each option is defined once, and the Python API and the command line read it.

A settings class is a frozen dataclass whose fields are made with `option`: a default, one line
of help, and optionally how the command line parses its string (``parse``) and what makes a value
good (``check``). `check_fields` runs every check (the class's ``__post_init__`` calls it); the
command line builds its parser from the same fields (`contribution_lens.cli.options`). Both raise
or print the same sentence: ``name: expected ..., got ...``. Standard library only, so that
``--help`` imports nothing heavy.

Example:
    >>> from dataclasses import dataclass
    >>> @dataclass(frozen=True)
    ... class Run:
    ...     steps: int = option(10, "how many steps", check=at_least(1))
    ...     def __post_init__(self):
    ...         check_fields(self)
    >>> Run(steps=0)
    Traceback (most recent call last):
    ...
    contribution_lens._settings.SettingError: steps: expected a positive integer, got 0
"""

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any


class Invalid(ValueError):
    """Raised by a check or a parser: what was expected, and optionally the part that was wrong."""

    def __init__(self, expected: str, *, got: Any = dataclasses.MISSING, why: str = "") -> None:
        super().__init__(expected)
        self.expected, self.got, self.why = expected, got, why


class SettingError(ValueError):
    """A setting that cannot be used: ``name: expected ..., got ...``.

    ``expected`` may name other settings as ``{other}``; the message fills in their names (the
    command line, their flags).
    """

    def __init__(self, name: str, expected: str, got: Any, why: str = "") -> None:
        self.name, self.expected, self.got, self.why = name, expected, got, why
        super().__init__(self.sentence(name, lambda other: other))

    def sentence(self, label: str, name_of: Callable[[str], str], got: Any = dataclasses.MISSING) -> str:
        """The message with this setting called ``label`` and the others ``name_of(other)``."""
        expected = self.expected.format_map(_Names(name_of))
        shown = self.got if got is dataclasses.MISSING else got
        return f"{label}: expected {expected}, got {shown!r}" + (f" ({self.why})" if self.why else "")


class _Names(dict):
    def __init__(self, name_of: Callable[[str], str]) -> None:
        super().__init__()
        self.name_of = name_of

    def __missing__(self, key: str) -> str:
        return self.name_of(key)


@dataclasses.dataclass(frozen=True)
class Option:
    """What a settings field says about itself (kept in the field's metadata)."""

    help: str | Callable[[], str]
    """One line; a function where it names what a registry holds (read when the command line is built)."""
    parse: Callable[[str], Any] | None = None
    """From the command line's string to the value (None: the default's type, or the string)."""
    check: Callable[[Any], None] | None = None
    """Raises `Invalid` for a value that cannot be used."""
    flag: str | None = None
    """The command line's flag (default: ``--`` and the name with ``-`` for ``_``)."""
    cli: bool = True
    """Offered on the command line."""
    choices: tuple[str, ...] | None = None
    show: str | None = None
    """The default as the command line's help shows it (default: derived from the value)."""
    many: bool = False
    """Given once per value on the command line (``--data a --data b``)."""
    required: bool = False
    """The command line refuses to run without it."""


def option(
    default: Any,
    help: str | Callable[[], str],
    *,
    parse: Callable[[str], Any] | None = None,
    check: Callable[[Any], None] | None = None,
    flag: str | None = None,
    cli: bool = True,
    choices: Sequence[str] | None = None,
    show: str | None = None,
    many: bool = False,
    required: bool = False,
) -> Any:
    """A dataclass field with its help, parser and check (see the module docstring)."""
    meta = Option(help, parse, check, flag, cli, None if choices is None else tuple(choices), show, many, required)
    return dataclasses.field(default=default, metadata={"option": meta})


def options_of(cls: Any) -> list[tuple[dataclasses.Field, Option]]:
    """The fields of a settings class that are options, in order."""
    return [(f, f.metadata["option"]) for f in dataclasses.fields(cls) if "option" in f.metadata]


def check_fields(settings: Any) -> None:
    """Run every field's check; the first that fails raises `SettingError` naming the field."""
    for f, meta in options_of(settings):
        value = getattr(settings, f.name)
        if meta.choices is not None and value not in meta.choices:
            raise SettingError(f.name, f"one of {', '.join(meta.choices)}", value)
        if meta.check is not None:
            try:
                meta.check(value)
            except Invalid as error:
                got = value if error.got is dataclasses.MISSING else error.got
                raise SettingError(f.name, error.expected, got, error.why) from None


# --- checks and parsers shared by the settings classes -------------------------------------


def at_least(minimum: int, *, optional: bool = False) -> Callable[[Any], None]:
    """An integer ``>= minimum`` (or None where ``optional``)."""
    expected = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"

    def check(value: Any) -> None:
        if value is None and optional:
            return
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise Invalid(expected)

    return check


RATIOS = "comma-separated numbers in [0, 1)"


def check_ratios(value: Any) -> None:
    """A non-empty sequence of removal ratios in [0, 1)."""
    if isinstance(value, str) or not value or any(not isinstance(r, int | float) or not 0 <= r < 1 for r in value):
        raise Invalid(RATIOS)


def parse_ratios(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise Invalid(RATIOS) from None
    check_ratios(values)
    return values


PREPEND_BOS = "yes, no or model (the model's own choice, cfg.default_prepend_bos)"
_BOS_WORDS = {"yes": True, "true": True, "no": False, "false": False, "model": None}


def parse_prepend_bos(text: str) -> bool | None:
    """``yes``/``true`` -> True, ``no``/``false`` -> False, ``model`` -> None (the model's own choice)."""
    word = text.strip().lower()
    if word not in _BOS_WORDS:
        raise Invalid(PREPEND_BOS)
    return _BOS_WORDS[word]


def check_prepend_bos(value: Any) -> None:
    """True, False or None."""
    if value is not None and not isinstance(value, bool):
        raise Invalid("True, False or None (the model's own choice, cfg.default_prepend_bos)")


def parse_names(text: str) -> tuple[str, ...] | str:
    """Comma-separated names, or the word ``all``."""
    if text.strip() == "all":
        return "all"
    return tuple(x.strip() for x in text.split(",") if x.strip())


def parse_integers(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise Invalid("comma-separated integers") from None
    if not values:
        raise Invalid("comma-separated integers")
    return values


def subset(what: Callable[[], Sequence[str]], *, all_word: bool = False) -> Callable[[Any], None]:
    """A non-empty sequence of names from ``what()`` (or, with ``all_word``, the word ``all``)."""

    def check(value: Any) -> None:
        if all_word and value == "all":
            return
        known = tuple(what())
        prefix = "'all' or " if all_word else ""
        if isinstance(value, str) or not value or any(name not in known for name in value):
            raise Invalid(f"{prefix}a comma-separated subset of {', '.join(known)}", got=_shown(value))

    return check


def _shown(value: Any) -> Any:
    """A sequence of names as the command line would have written it."""
    return ",".join(map(str, value)) if isinstance(value, tuple | list) else value


def flags(settings: Any) -> list[str]:
    """The command line that gives ``settings``: ``--flag value`` for every option that differs from its default.

    Sequences are comma-joined (``many`` options repeat their flag), ``True`` switches (options whose
    default is a bool) are the flag alone; a bool of an option that takes a value (``--prepend-bos``,
    default None) is written ``yes``/``no``; a value the command line cannot write (None over a
    default) is left out.

    Example:
        >>> @dataclasses.dataclass(frozen=True)
        ... class Run:
        ...     ratios: tuple[float, ...] = option((0.0, 0.5), "ratios")
        ...     data: tuple[str, ...] = option((), "data", many=True)
        ...     seed: int = option(0, "seed")
        >>> flags(Run(ratios=(0.0, 0.1), data=("a", "b")))
        ['--ratios', '0.0,0.1', '--data', 'a', '--data', 'b']
        >>> @dataclasses.dataclass(frozen=True)
        ... class Bos:
        ...     prepend_bos: bool | None = option(None, "BOS", parse=parse_prepend_bos)
        >>> flags(Bos(prepend_bos=False)), flags(Bos(prepend_bos=True)), flags(Bos())
        (['--prepend-bos', 'no'], ['--prepend-bos', 'yes'], [])
    """
    words: list[str] = []
    for f, meta in options_of(settings):
        value = getattr(settings, f.name)
        if not meta.cli or value == f.default or value is None:
            continue
        flag = meta.flag or "--" + f.name.replace("_", "-")
        if isinstance(value, bool) and isinstance(f.default, bool):
            words += [flag] if value else []
        elif isinstance(value, bool):
            words += [flag, "yes" if value else "no"]
        elif meta.many:
            for item in value:
                words += [flag, str(item)]
        else:
            words += [flag, _shown(value) if isinstance(value, tuple | list) else str(value)]
    return words
