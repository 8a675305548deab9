"""The inspector's panels: what one computes from the view (Python) and how it draws it (an ES module), by name.

A `Panel` is one Python module's work and one JavaScript module's. Its ``compute(source, request)``
turns the view into JSON-able data: ``source`` (`PanelSource`) holds the subject inspected, the token
window and the QK splits the first pass recorded; ``request`` holds the view settings the panel
names in ``on`` (of ``layer``, ``head`` (-1: all heads) and ``query``), so a change of any of them
asks for new data, a change of any other redraws the data already there. Its ``script`` (the text of
an ES module) exports ``draw(element, context)``, which draws into its own element from
``context.answer(ask)`` (the data, or why there is none yet: types.js's ``PanelAnswer``).

`PANELS` is the one place a panel is registered (`register_panel`, `unregister_panel`); the widget,
its kernel's answers, the static page and the tests iterate it. Live, the front-end asks the kernel
for a request's data once (``{"type": "panel", "panel": name, "key": key, **request}``, answered by
`contribution_lens.views.inspector.widget.Inspector.panel`); a page carries each panel's module and
the data of the queries its writer named (`page_data`), every layer and head of them.
"""

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from itertools import product
from typing import TYPE_CHECKING, Any

from contribution_lens._registry import Registry
from contribution_lens.choices import as_indices, as_position
from contribution_lens.views.inspector.subject import InspectorError, Subject
from contribution_lens.views.inspector.windows import Window

if TYPE_CHECKING:
    from contribution_lens.views.inspector.caches import WhyCache

SETTINGS = ("layer", "head", "query")
"""The view settings a panel's request may name (``on``), in this order in a request's key."""


@dataclass(frozen=True)
class PanelSource:
    """What a panel computes from: the subject inspected, the token window of the data and the QK splits kept."""

    subject: Subject
    window: Window
    """The window the data is for (a page's may differ from the widget's)."""
    shown: Window
    """The widget's window: the one the first pass recorded its QK tape around."""
    splits: "WhyCache"
    """The QK splits of the first pass's tape, kept between views (`contribution_lens.views.inspector.caches`)."""


@dataclass(frozen=True)
class Panel:
    """One inspector panel: its name and title, what it computes, which settings ask for new data, how it draws.

    Args:
        name: the panel's name (lower case, digits and ``_``), the key of its data on a page and in messages.
        title: what the page and messages call it.
        compute: ``compute(source, request)``: the JSON-able data of ``request`` (the settings of ``on``),
            or an `InspectorError` (a ``ValueError``) saying why there is none.
        script: the text of an ES module exporting ``draw(element, context)``; it imports nothing (what it
            needs of the inspector, ``plot`` and ``fmt`` among it, comes in ``context``).
        on: the settings a request names (of `SETTINGS`): a change of one asks for new data.
        page: ``page(source, layers, queries)``: the data a page carries, by `request_key`, for every layer of
            ``layers`` and each query of ``queries`` (default: ``compute`` of each request, every head too).
    """

    name: str
    title: str
    compute: Callable[[PanelSource, dict[str, int]], Any]
    script: str
    on: tuple[str, ...] = SETTINGS
    page: Callable[[PanelSource, list[int], list[int]], dict[str, Any]] | None = None


def _check(panel: Panel) -> None:
    if not isinstance(panel, Panel):
        raise ValueError(f"an inspector panel is a Panel, got {type(panel).__name__}")
    if not re.fullmatch(r"[a-z][a-z0-9_]*", panel.name):
        raise ValueError(f"name: a panel's name is lower case letters, digits and _, got {panel.name!r}")
    if not panel.on or len(set(panel.on)) != len(panel.on) or not set(panel.on) <= set(SETTINGS):
        raise ValueError(f"on: a panel's settings are some of {', '.join(SETTINGS)}, each once, got {panel.on!r}")
    if not isinstance(panel.script, str) or "export function draw(" not in panel.script:
        raise ValueError(f"script: the panel {panel.name!r}'s module must export function draw(element, context)")


PANELS: Registry[Panel] = Registry(
    "panel",
    {"contribution_lens.views.inspector.why:PANELS": ("why",)},
    check=_check,
    calls={"compute": "source, request"},
)
"""Every inspector panel, in the order drawn: the built-in *why* panel, then those registered."""


def register_panel(panel: Panel, *, replace: bool = False) -> Panel:
    """Add ``panel`` to `PANELS`: every inspector made afterwards computes and draws it, live and on its page."""
    return PANELS.add(panel, replace=replace)


def unregister_panel(name: str) -> None:
    """Take a registered panel away (a built-in cannot be)."""
    PANELS.unregister(name)


def static_script(name: str) -> str:
    """A panel's ES module shipped in the package (``static/panels/<name>``)."""
    folder = resources.files("contribution_lens.views.inspector") / "static" / "panels"
    return (folder / name).read_text(encoding="utf-8")


def specs() -> list[dict[str, Any]]:
    """What a front-end loads: each panel's name, title, settings and module, in `PANELS`' order."""
    return [{"name": p.name, "title": p.title, "on": list(p.on), "script": p.script} for p in PANELS.values()]


def request_key(panel: Panel, request: Mapping[str, int]) -> str:
    """How a request's data is named on a page and in a front-end's cache: its settings' values, ``/`` between.

    Example:
        >>> request_key(PANELS["why"], {"layer": 3, "head": 1, "query": 9})
        '3/1/9'
    """
    return "/".join(str(request[name]) for name in panel.on)


def checked_queries(label: str, queries: Sequence[int] | None, n_tokens: int, window: Window) -> list[int]:
    """``queries`` (negative from the end) checked before any pass: sorted positions of ``window``'s queries."""
    try:
        chosen = sorted({as_position(q, n_tokens) for q in as_indices(queries, label)})
    except ValueError as error:
        raise InspectorError(f"{label}: {error}") from error
    outside = [q for q in chosen if q not in window.queries]
    if outside or not chosen:
        first, last = window.queries[0], window.queries[-1]
        raise InspectorError(
            f"{label} {outside or list(queries or [])} are not queries of the page's window {first}..{last}: "
            "name positions the page shows (or set start= and tokens=)"
        )
    return chosen


def page_data(source: PanelSource, layers: list[int], named: Mapping[str, list[int]]) -> dict[str, Any]:
    """The data a page carries: for each panel of ``named``, its queries and its data of every layer there."""
    carried = {}
    for name, queries in named.items():
        panel = PANELS[name]
        if panel.page is not None:
            data = panel.page(source, layers, queries)
        else:
            values = {"layer": layers, "head": range(-1, source.subject.n_heads), "query": queries}
            requests = [dict(zip(panel.on, each, strict=True)) for each in product(*(values[n] for n in panel.on))]
            data = {request_key(panel, request): panel.compute(source, request) for request in requests}
        carried[name] = {"queries": queries, "data": data}
    return carried
