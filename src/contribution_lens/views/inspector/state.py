"""The inspector's view state, described once: each setting's name, type, default and what it accepts.

`SETTINGS` is the one table. From it follow the widget's synced traits (`ViewTraits`), the
defaults of `contribution_lens.views.inspector.widget.inspect` (`ARGUMENTS`), the settings
`contribution_lens.views.inspector.subject.Subject` checks (`CHECKED`), the view a still records
and, sent in every page's and widget's meta (`schema`), what the JavaScript reads: the names, the
defaults, which settings a page's URL fragment names and the toggles' labels. The JavaScript
repeats none of them (``static/settings.js`` reads the schema; the golden test pins both sides).

Example:
    >>> NAMES[:5], ARGUMENTS["factor"], ARGUMENTS["layer"]
    (('layer', 'head', 'factor', 'scope', 'query'), 'contribution', None)
"""

from dataclasses import dataclass
from typing import Any, Literal

import anywidget
import traitlets

from contribution_lens.choices import FACTORS, SCOPES
from contribution_lens.views.inspector.windows import DEFAULT_TOKENS

VIEWS = ("heatmap", "text", "prediction")
"""The inspector's views: the per-layer heatmap, the text coloured by it, and (with explained steps) the prediction."""
CHOSEN = None
"""An argument default meaning: chosen from what is inspected (`Subject.opening`: the last layer, all heads...)."""
Link = Literal["always", "changed", "never"]


@dataclass(frozen=True)
class Setting:
    """One setting of the view.

    ``default`` is what the widget holds before anything is chosen (its trait's default);
    ``argument`` is `inspect`'s default (`CHOSEN`: picked from the subject), ``None`` in
    ``argued=False`` settings that `inspect` does not take. ``link``: whether a page's URL fragment
    names it ``always``, where it is not the default (``changed``) or ``never``. ``label``: a
    toggle's text (a ``bool`` setting is a checkbox). ``checked``: `Subject` has a rule for it.
    """

    name: str
    kind: type[int] | type[str] | type[bool]
    default: int | str | bool
    argument: int | str | bool | None
    accepts: str
    link: Link = "changed"
    label: str = ""
    argued: bool = True
    checked: bool = True


SETTINGS: tuple[Setting, ...] = (
    Setting("layer", int, 0, CHOSEN, "a layer among those inspected (default: the last)", "always"),
    Setting("head", int, -1, CHOSEN, "a head, or -1: all heads (token level; the default)", "always"),
    Setting("factor", str, "contribution", "contribution", f"one of {FACTORS}", "always"),
    Setting("scope", str, "inter", "inter", f"one of {SCOPES}", "always"),
    Setting("query", int, -1, None, "a query of the token window (default: its last)", "always", argued=False),
    Setting("view", str, "heatmap", CHOSEN, f"one of {VIEWS} (prediction: with explained steps, and their default)"),
    Setting("hide_sink", bool, False, False, "hide key 0 (the rest renormalised)", label="hide sink", checked=False),
    Setting("group_kv", bool, False, False, "the head's KV group combined", label="group KV heads", checked=False),
    Setting("step", int, -1, CHOSEN, "an explained step (-1: none; default 0 with steps)"),
    Setting("start", int, 0, CHOSEN, "the token window's first query (default 0, or the step's window)", "never"),
    Setting("tokens", int, DEFAULT_TOKENS, DEFAULT_TOKENS, "the token window's queries, at least 1", "never"),
)  # fmt: skip
"""Every setting of the inspector's view, in the order a page's URL fragment names them."""
NAMES = tuple(setting.name for setting in SETTINGS)
"""The settings' names: the traits that make a view (what a still records)."""
ARGUMENTS: dict[str, Any] = {setting.name: setting.argument for setting in SETTINGS if setting.argued}
"""`inspect`'s keyword defaults, by name (`CHOSEN`: picked by `Subject.opening`)."""
CHECKED = tuple(setting.name for setting in SETTINGS if setting.checked)
"""The settings whose values `Subject.refusal` checks before they change anything."""
LINKED = tuple(setting.name for setting in SETTINGS if setting.link != "never")
"""The settings a page opens on (``meta.initial``) and names in its URL fragment."""
_KINDS = {int: "int", str: "str", bool: "bool"}


def schema(kv_groups: list[list[int]]) -> list[dict[str, Any]]:
    """The settings as the JavaScript reads them (``meta.settings``): name, type, default, link, label, offered.

    ``offered``: whether the front-end shows the setting's control; grouping KV heads only where
    some value head serves several query heads (``kv_groups``).
    """
    shared = any(len(heads) > 1 for heads in kv_groups)
    return [
        {"name": s.name, "type": _KINDS[s.kind], "default": s.default, "link": s.link, "label": s.label,
         "offered": shared or s.name != "group_kv"}
        for s in SETTINGS
    ]  # fmt: skip


def _trait(name: str) -> Any:
    """The synced trait of setting ``name``: its type and default from `SETTINGS`."""
    setting = next(s for s in SETTINGS if s.name == name)
    kinds = {int: traitlets.Int, str: traitlets.Unicode, bool: traitlets.Bool}
    return kinds[setting.kind](setting.default).tag(sync=True)


class ViewTraits(anywidget.AnyWidget):
    """The settings as the widget's synced traits, each typed and defaulted by `SETTINGS` (a test checks all)."""

    layer = _trait("layer")
    head = _trait("head")
    factor = _trait("factor")
    scope = _trait("scope")
    query = _trait("query")
    view = _trait("view")
    hide_sink = _trait("hide_sink")
    group_kv = _trait("group_kv")
    step = _trait("step")
    start = _trait("start")
    tokens = _trait("tokens")

    def view_state(self) -> dict[str, Any]:
        """The view shown: every setting's value (what a still records, `NAMES`)."""
        return {name: getattr(self, name) for name in NAMES}
