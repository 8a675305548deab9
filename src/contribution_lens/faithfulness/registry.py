"""The removal-protocol registry: where and how a condition removes keys, found by name.

A protocol is a `RemovalProtocol` (``name``, ``description``, `keep`; `contribution_lens.faithfulness.removal`).
`PROTOCOLS` declares the package's own by name (``every_layer``, ``one_layer``, ``input_deletion``,
``prediction``: `contribution_lens.faithfulness.protocols`), imported when one of them is first read, so
``--protocol``'s help lists them without importing torch; `register_protocol` adds one of yours, and the
run, the command line and the reports then take it by name.

Example:
    >>> from contribution_lens import faithfulness
    >>> list(faithfulness.PROTOCOLS)
    ['every_layer', 'one_layer', 'input_deletion', 'prediction']
    >>> describe("input_deletion")
    'input-token deletion'
"""

from typing import TYPE_CHECKING, Any

from contribution_lens._registry import Registry

if TYPE_CHECKING:
    from contribution_lens.faithfulness.removal import RemovalProtocol


def _a_protocol(entry: Any) -> None:
    from contribution_lens.faithfulness.removal import RemovalProtocol

    if not isinstance(entry, RemovalProtocol):
        raise TypeError(f"a removal protocol is registered as a RemovalProtocol, got {type(entry).__name__}")


PROTOCOLS: "Registry[RemovalProtocol]" = Registry(
    "removal protocol",
    {"contribution_lens.faithfulness.protocols:BUILT_IN": ("every_layer", "one_layer", "input_deletion", "prediction")},
    check=_a_protocol,
)
"""Every removal protocol by name: the package's own, then those added with `register_protocol`."""


def register_protocol(protocol: "RemovalProtocol", *, replace: bool = False) -> "RemovalProtocol":
    """Add a removal protocol to `PROTOCOLS` under its name; a name taken is refused unless ``replace`` (a built-in
    always)."""
    return PROTOCOLS.add(protocol, replace=replace)


def describe(name: str) -> str:
    """``"masking at every layer"`` for ``"every_layer"``; the name itself for unknown protocols."""
    return PROTOCOLS[name].description if name in PROTOCOLS else name
