"""The package's closed sets of names, as enums: scopes, factors, removal modes, rankings, granularities.

Each member compares, hashes, prints and serialises as its string (``Scope.INTER == "inter"``),
so records and files hold plain names; ``Scope.of(value)`` is the one check of a value where it
enters the package. Open sets (methods, removal protocols) are registries instead. Standard
library only: the command line reads these names without importing torch.

Example:
    >>> Scope.of("intra") is Scope.INTRA, f"{Scope.INTER}", Factor.of("cosine").signed
    (True, 'inter', True)
"""

import enum
import math
import numbers
import operator
from typing import Any, TypeVar

C = TypeVar("C", bound="Choice")


class Choice(enum.StrEnum):
    """A closed set of names: compares, hashes, prints, formats and reprs as its string."""

    def __repr__(self) -> str:
        return repr(self.value)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(str(member.value) for member in cls)

    @classmethod
    def of(cls: type[C], value: Any) -> C:
        """``value`` as a member, or a ``ValueError`` naming the choices."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(cls._unknown(value)) from None

    @classmethod
    def _unknown(cls, value: Any) -> str:
        return f"unknown {cls.__name__.lower()} {value!r}; expected one of {cls.names()}"


class Scope(Choice):
    """Which output a weight is measured against: the head's ``o_i^h`` or the layer's ``o_i``."""

    INTRA = "intra"
    INTER = "inter"

    @classmethod
    def _unknown(cls, value: Any) -> str:
        return f"scope must be one of {cls.names()}, got {value!r}"


class Factor(Choice):
    """The three factors of a contribution weight, and their product."""

    ATTENTION = "attention"
    RELATIVE_NORM = "relative_norm"
    COSINE = "cosine"
    CONTRIBUTION = "contribution"

    @property
    def signed(self) -> bool:
        """Cosine and contribution can be negative: they get a diverging colour scale centred at 0."""
        return self in (Factor.COSINE, Factor.CONTRIBUTION)


class Mode(Choice):
    """Remove what a measure ranks highest (comprehensiveness) or lowest (sufficiency)."""

    COMPREHENSIVENESS = "comprehensiveness"
    SUFFICIENCY = "sufficiency"


class Ranking(Choice):
    """Rank keys by ``|score|`` or by the signed score."""

    ABS = "abs"
    SIGNED = "signed"


class Granularity(Choice):
    """Rank tokens (heads summed) or each head's keys separately."""

    TOKEN = "token"
    HEAD = "head"


SCOPES: tuple[str, ...] = Scope.names()
FACTORS: tuple[str, ...] = Factor.names()
MODES: tuple[str, ...] = Mode.names()
RANKINGS: tuple[str, ...] = Ranking.names()


def as_index(value: Any, what: str) -> int:
    """``value`` as a Python ``int`` where it is an integer of any kind (not ``bool``); else a ``TypeError``.

    Example:
        >>> import numpy as np, torch
        >>> as_index(np.int64(3), "layer"), as_index(torch.tensor(-1), "layer")
        (3, -1)
    """
    # A bool (or a bool tensor or array) is an answer, not a position: True would silently be 1.
    if not isinstance(value, bool) and str(getattr(value, "dtype", "")) not in ("torch.bool", "bool"):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise TypeError(f"{what}, got {type(value).__name__} {value!r}")


def as_count(value: Any, what: str) -> int:
    """``value`` as a positive Python ``int`` (any integer kind, as `as_index`); else an error naming ``what``.

    Example:
        >>> import numpy as np
        >>> as_count(np.int64(2), "max_new_tokens")
        2
        >>> as_count(2.5, "k")
        Traceback (most recent call last):
        ...
        TypeError: k must be a positive integer, got float 2.5
    """
    number = as_index(value, f"{what} must be a positive integer")
    if number < 1:
        raise ValueError(f"{what} must be a positive integer, got {number}")
    return number


def as_threshold(value: Any, what: str = "threshold") -> float:
    """``value`` as a positive, finite ``float``: a real number of any kind (NumPy, a 0-d tensor), not a str or bool.

    Example:
        >>> as_threshold(0.05)
        0.05
        >>> as_threshold(float("nan"))
        Traceback (most recent call last):
        ...
        ValueError: threshold must be a positive finite number, got nan
    """
    scalar = getattr(value, "ndim", None) == 0 and "bool" not in str(getattr(value, "dtype", "bool"))
    if isinstance(value, bool) or not (isinstance(value, numbers.Real) or scalar):
        raise TypeError(f"{what} must be a positive finite number, got {type(value).__name__} {value!r}")
    number = float(value)
    if not math.isfinite(number) or number <= 0:
        raise ValueError(f"{what} must be a positive finite number, got {number}")
    return number


def as_position(value: Any, length: int) -> int:
    """``value`` as a token position ``p`` in ``0..length-1``; ``-length <= value < 0`` counts from the end.

    ``p = value mod length`` when ``-length <= value < length``; anything else is refused with
    the text's length and the positions it has (a non-integer: a ``TypeError``, as `as_index`).

    Example:
        >>> as_position(-1, 15), as_position(3, 15)
        (14, 3)
        >>> as_position(30, 15)
        Traceback (most recent call last):
        ...
        ValueError: position 30 does not exist: the text has 15 tokens (positions -15..14)
    """
    index = as_index(value, "position must be an integer")
    if not -length <= index < length:
        raise ValueError(
            f"position {index} does not exist: the text has {length} tokens (positions {-length}..{length - 1})"
        )
    return index % length


def as_indices(value: Any, what: str) -> list[int]:
    """One integer or a sequence of them (NumPy and 0-d tensor integers too) as a list of Python ints.

    ``what`` names the values in the message, e.g. ``"layers"``: ``"layers must be integers, got ..."``.

    Example:
        >>> import numpy as np, torch
        >>> as_indices(np.int64(3), "layers"), as_indices(torch.tensor([0, -1]), "layers")
        ([3], [0, -1])
    """
    if isinstance(value, str) or getattr(value, "ndim", 1) == 0 or not hasattr(value, "__iter__"):
        return [as_index(value, f"{what} must be integers")]
    return [as_index(item, f"{what} must be integers") for item in value]
