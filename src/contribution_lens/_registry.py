"""One registry type: the package's registered objects (measures, circuit methods, protocols), found by name.

A `Registry` maps a name to an entry (any object with a ``name``). Where it is made it declares its
built-ins by name, with where they are defined: ``{"package.module:ATTRIBUTE": (name, ...)}``, the
attribute a tuple of entries in that order. Listing the names reads no module, so the command line's
``--help`` can list them without importing torch; the first time one of a module's entries is read,
the module is imported and its entries are checked against the names declared. Built-ins cannot be
replaced or unregistered; anything else is added with `Registry.add` (``replace=True`` to replace
one's own) and taken away with `Registry.unregister`. A registry made with ``check`` runs it on every
entry it takes, the built-ins included: the one place where what an entry must be is checked; one
made with ``calls`` checks that each of those attributes of an entry is a function that can be called
with the arguments named (a string or a function of another signature is refused when registered,
not when first used). Names are compared without case: a name that differs from a registered one only
in case is refused (``"EAP"`` beside ``"eap"``), and an unknown name's message suggests the registered one.

Example:
    >>> from dataclasses import dataclass
    >>> @dataclass(frozen=True)
    ... class Greeting:
    ...     name: str
    ...     text: str = ""
    >>> greetings = Registry("greeting", {})
    >>> greetings.add(Greeting("hello", "hi there")).text
    'hi there'
    >>> list(greetings), greetings["hello"].text
    (['hello'], 'hi there')
    >>> greetings.lookup("helo")
    Traceback (most recent call last):
    ...
    ValueError: unknown greeting 'helo'; registered greetings: hello; did you mean 'hello'?
"""

import difflib
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

from contribution_lens._lazy import resolve


@runtime_checkable
class Named(Protocol):
    """What a registry holds: anything with a ``name``."""

    @property
    def name(self) -> str: ...


T = TypeVar("T", bound=Named)
F = TypeVar("F")


class Registry(Mapping[str, T]):
    """Entries by name: the built-ins first (in the order declared), then the others in the order added.

    Args:
        kind: what one entry is called in messages (``"method"``, ``"circuit method"``).
        builtins: ``"package.module:ATTRIBUTE"`` -> the names of the entries that tuple holds, in order.
        check: run on every entry taken (raises for one that cannot be used).
        listing: the words before the names in the message for an unknown name (default
            ``"registered <kind>s"``).
        calls: an entry's attribute -> the arguments it is called with, as written in a call
            (``{"score_fn": "model, task, context"}``): each must be a function those arguments can be
            passed to, positionally.
    """

    def __init__(
        self,
        kind: str,
        builtins: Mapping[str, Sequence[str]],
        *,
        check: Callable[[T], None] | None = None,
        listing: str = "",
        calls: Mapping[str, str] | None = None,
    ) -> None:
        self.kind = kind
        self._declared = {location: tuple(names) for location, names in builtins.items()}
        self._where: dict[str, str] = {}
        for location, names in self._declared.items():
            for name in names:
                if name in self._where:
                    raise ValueError(f"the {kind} {name!r} is declared twice: in {self._where[name]} and {location}")
                self._where[name] = location
        self._check = check
        self._calls = dict(calls or {})
        self._listing = listing or f"registered {kind}s"
        self._builtin: dict[str, T] = {}
        self._added: dict[str, T] = {}

    # --- names: read without importing any module ----------------------------------------------

    def __iter__(self) -> Iterator[str]:
        return iter([*self._where, *self._added])

    def __len__(self) -> int:
        return len(self._where) + len(self._added)

    def __contains__(self, name: object) -> bool:
        return name in self._where or name in self._added

    @property
    def declared(self) -> dict[str, tuple[str, ...]]:
        """The built-ins as declared: ``"package.module:ATTRIBUTE"`` -> their names, in order."""
        return dict(self._declared)

    def is_builtin(self, name: str) -> bool:
        """Whether ``name`` is one of the package's own (declared where the registry is made)."""
        return name in self._where

    # --- entries -------------------------------------------------------------------------------

    def __getitem__(self, name: str) -> T:
        if name in self._added:
            return self._added[name]
        if name not in self._where:
            raise KeyError(self.unknown(name))
        if name not in self._builtin:
            self._load(self._where[name])
        return self._builtin[name]

    def lookup(self, name: str) -> T:
        """The entry called ``name``; an unknown name is a `ValueError` listing the registered ones."""
        if name not in self:
            raise ValueError(self.unknown(name))
        return self[name]

    def unknown(self, name: object) -> str:
        """The message for a name that is not registered: every registered name, and the nearest one."""
        message = f"unknown {self.kind} {name!r}; {self._listing}: {', '.join(self)}"
        near = (
            []
            if not isinstance(name, str)
            else self._same_but_case(name) or difflib.get_close_matches(name, list(self), n=1)
        )
        return message + (f"; did you mean {near[0]!r}?" if near else "")

    def _same_but_case(self, name: str) -> list[str]:
        """The registered names equal to ``name`` but for case (``name`` itself left out)."""
        return [known for known in self if known.casefold() == name.casefold() and known != name]

    def add(self, entry: T, *, replace: bool = False) -> T:
        """Register ``entry`` under its name; a name taken is refused unless ``replace``, a built-in always."""
        self._checked(entry)
        name = self._named(entry)
        twins = self._same_but_case(name)
        if twins:
            raise ValueError(
                f"a {self.kind} named {name!r} would differ from the registered {twins[0]!r} only in case; "
                "choose another name"
            )
        if name in self._where or (name in self._added and not replace):
            hint = "it is built in" if name in self._where else "pass replace=True to replace it"
            raise ValueError(f"a {self.kind} named {name!r} is already registered; {hint}")
        self._added[name] = entry
        return entry

    def decorator(self, make: Callable[[F], T], *, replace: bool = False) -> Callable[[F], F]:
        """A decorator that registers ``make(function)`` and hands the function back unchanged."""

        def register(function: F) -> F:
            self.add(make(function), replace=replace)
            return function

        return register

    def _checked(self, entry: T) -> None:
        """``check`` and ``calls`` on ``entry``: what it must be, and the functions it holds."""
        if self._check is not None:
            self._check(entry)
        for attribute, arguments in self._calls.items():
            check_callable(getattr(entry, attribute, None), attribute, arguments, f"a {self.kind}'s")

    def unregister(self, name: str) -> None:
        """Take away an entry that is not a built-in (`KeyError` for a name not registered)."""
        if name in self._where:
            raise ValueError(f"{name!r} is built in and cannot be unregistered")
        if name not in self._added:
            raise KeyError(f"no {self.kind} named {name!r} is registered")
        del self._added[name]

    def _named(self, entry: T) -> str:
        name = getattr(entry, "name", None)
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} needs a name, got {type(entry).__name__} with name {name!r}")
        return name

    def _load(self, location: str) -> None:
        """Import the module that defines the built-ins at ``location`` and take them, checked."""
        entries = tuple(resolve(location))
        names = tuple(self._named(entry) for entry in entries)
        if names != self._declared[location]:
            raise RuntimeError(
                f"{location} holds the {self.kind}s {names}; the registry declares {self._declared[location]}"
            )
        for entry in entries:
            self._checked(entry)
        self._builtin.update(zip(names, entries, strict=True))


def check_callable(function: Any, name: str, arguments: str, whose: str = "the") -> None:
    """Refuse ``function`` where it is not a function that ``arguments`` (``"model, task, context"``) can be passed
    to, positionally.

    Example:
        >>> check_callable("eap", "score_fn", "model, task, context", "a circuit method's")
        Traceback (most recent call last):
        ...
        ValueError: score_fn: a circuit method's score_fn is called as score_fn(model, task, context); got str 'eap'
    """
    call = f"{name}({arguments})"
    if not callable(function):
        raise ValueError(f"{name}: {whose} {name} is called as {call}; got {type(function).__name__} {function!r}")
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # a builtin without a signature: it is called as it is
        return
    try:
        signature.bind(*arguments.split(", "))
    except TypeError as error:
        named = getattr(function, "__name__", type(function).__name__)
        raise ValueError(f"{name}: {whose} {name} is called as {call}; {named!r} cannot be ({error})") from None
