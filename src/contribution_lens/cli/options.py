"""Command-line options built from settings dataclasses: one definition, one check, one message.

`add_options` gives a parser one argument per option field of a settings class (its flag, help,
default and type); `build` turns the parsed strings back into the settings object, so the
class's own checks run, and reports a bad value as the one line ``--flag: expected ..., got ...``
with the text the user typed. Standard library only.

Example:
    >>> import argparse
    >>> from contribution_lens.faithfulness.settings import RunOptions
    >>> parser = argparse.ArgumentParser()
    >>> add_options(parser, RunOptions)
    >>> build(RunOptions, parser.parse_args(["--bootstrap", "0"]))
    Traceback (most recent call last):
    ...
    contribution_lens.cli.checks.UsageError: --bootstrap: expected a positive integer, got 0
"""

import argparse
import dataclasses
import typing
from typing import Any

from contribution_lens._settings import Invalid, Option, SettingError, options_of
from contribution_lens.cli.checks import UsageError


def flag_of(cls: Any, name: str) -> str:
    """The command line's flag of field ``name`` of ``cls``."""
    for f, meta in options_of(cls):
        if f.name == name:
            return meta.flag or "--" + name.replace("_", "-")
    return "--" + name.replace("_", "-")


def _shown(value: Any) -> Any:
    """A default as the help shows it: sequences comma-joined."""
    return ",".join(map(str, value)) if isinstance(value, tuple | list) else value


def _int_field(f: dataclasses.Field) -> bool:
    return f.type is int or int in typing.get_args(f.type)


def add_options(
    parser: argparse.ArgumentParser, cls: Any, *, defaults: dict[str, Any] | None = None, required: tuple[str, ...] = ()
) -> None:
    """One argument per option of ``cls`` (``defaults`` and ``required`` override the class's)."""
    for f, meta in options_of(cls):
        if not meta.cli:
            continue
        default = (defaults or {}).get(f.name, f.default)
        kwargs: dict[str, Any] = {"help": meta.help() if callable(meta.help) else meta.help, "dest": f.name}
        if isinstance(default, bool):
            kwargs.update(action="store_true", default=default)
        elif meta.many:
            kwargs.update(action="append", default=None, required=meta.required or f.name in required)
        else:
            kwargs["default"] = default if meta.parse is None else _shown(default)
            if meta.parse is None and meta.choices is None and (isinstance(default, int) or _int_field(f)):
                kwargs["type"] = int
            if meta.choices is not None:
                kwargs["choices"] = meta.choices
            if meta.required or f.name in required:
                kwargs.update(required=True, default=None)
        flag = meta.flag or "--" + f.name.replace("_", "-")
        if kwargs.get("action") != "store_true":  # a switch takes no value to name
            kwargs["metavar"] = None if "action" in kwargs else flag[2:].upper().replace("-", "_")
        parser.add_argument(flag, **kwargs)


def build(cls: Any, args: argparse.Namespace, **extra: Any) -> Any:
    """``cls`` from the parsed arguments (its checks run); a bad value raises `UsageError`."""
    values, raw = {}, {}
    for f, meta in options_of(cls):
        if not meta.cli or not hasattr(args, f.name):
            continue
        given = getattr(args, f.name)
        if meta.many and given is not None:
            given = tuple(given)
        raw[f.name] = given
        values[f.name] = _parsed(cls, f.name, meta, given)
    values.update(extra)
    try:
        return cls(**values)
    except SettingError as error:
        # Show what the user typed where a parser turned it into something else (``'0,1'``).
        wrong = next((m for f, m in options_of(cls) if f.name == error.name), None)
        typed = (
            wrong is not None and wrong.parse is not None and not wrong.many and isinstance(raw.get(error.name), str)
        )
        got = raw[error.name] if typed else error.got
        raise UsageError(error.sentence(flag_of(cls, error.name), lambda name: flag_of(cls, name), got)) from None


def _parsed(cls: Any, name: str, meta: Option, given: Any) -> Any:
    if meta.parse is None or not isinstance(given, str):
        return given
    try:
        return meta.parse(given)
    except Invalid as error:
        raise UsageError(SettingError(name, error.expected, given, error.why).sentence(
            flag_of(cls, name), lambda other: flag_of(cls, other)
        )) from None  # fmt: skip
