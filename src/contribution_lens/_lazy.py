"""Package faces that import on first use (PEP 562), with deprecated names that say where they went.

A face lists its public names and where each is defined; nothing is imported until a name is
read, so ``import contribution_lens`` and the command line's ``--help`` do not pay for torch.

Example:
    >>> import sys, types
    >>> sys.modules["demo_face"] = types.ModuleType("demo_face")
    >>> getattr_, dir_ = face("demo_face", {"sqrt": "math:sqrt"}, {"root": ("math:sqrt", "use demo_face.sqrt")})
    >>> getattr_("sqrt")(9.0), "sqrt" in dir_()
    (3.0, True)
"""

import importlib
import sys
import warnings
from collections.abc import Callable
from typing import Any


def resolve(location: str) -> Any:
    """``"package.module:attr"`` (or ``"package.module"``) to the object it names."""
    module, _, attr = location.partition(":")
    value = importlib.import_module(module)
    return getattr(value, attr) if attr else value


def face(
    package: str, exports: dict[str, str], deprecated: dict[str, tuple[str, str]] | None = None
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``.

    Args:
        package: the package's ``__name__``.
        exports: public name -> ``"module:attr"`` (absolute) of its definition.
        deprecated: old name -> (``"module:attr"`` of what replaces it, what to use instead); reading
            one warns with a ``DeprecationWarning`` naming the new one.
    """
    moved = deprecated or {}

    def __getattr__(name: str) -> Any:
        if name in exports:
            value = resolve(exports[name])
            globals_of(package)[name] = value  # later look-ups skip this function
            return value
        if name in moved:
            location, advice = moved[name]
            warnings.warn(f"{package}.{name} is deprecated: {advice}", DeprecationWarning, stacklevel=2)
            return resolve(location)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted({*globals_of(package), *exports})

    return __getattr__, __dir__


def globals_of(package: str) -> dict[str, Any]:
    return vars(sys.modules[package])
