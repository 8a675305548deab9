"""The inspector's view state, described once (`state.SETTINGS`): inspect's defaults, the traits, the checks, the JS.

Each test fails where one of them keeps a list or a default of its own that the table does not give.
"""

import ast
import inspect as pyinspect
import re
from pathlib import Path

import pytest
import torch

import contribution_lens as cl
from conftest import tiny_bridge
from contribution_lens.views.inspector import state, subject, widget
from contribution_lens.views.inspector.subject import RULES, InspectorError, Subject

STATIC = Path(state.__file__).parent / "static"
IDS = torch.tensor([[3, 7, 7, 7, 2, 9, 7, 1, 4, 5]])
DATA_TRAITS = {"steps", "error", "meta", "payload", "model_ref", "circuit"}
"""The widget's synced traits that are not settings: what the kernel sends, the refusal, a circuit drawn beside."""


@pytest.fixture(scope="module")
def model():
    return tiny_bridge("gqa", biases=True)


def test_inspects_defaults_are_the_tables_and_written_nowhere_else() -> None:
    parameters = pyinspect.signature(widget.inspect).parameters
    argued = [s.name for s in state.SETTINGS if s.argued]
    assert {name for name in parameters if name in state.NAMES} == set(argued), "a setting inspect does not take"
    for name in argued:
        assert parameters[name].default == state.ARGUMENTS[name], name
    # Written once: each default in inspect's source is the table's entry, never a literal of its own.
    tree = ast.parse(pyinspect.getsource(widget.inspect))
    arguments = tree.body[0].args  # type: ignore[attr-defined]
    named = arguments.args[-len(arguments.defaults) :] + arguments.kwonlyargs
    defaults = arguments.defaults + arguments.kw_defaults
    for argument, default in zip(named, defaults, strict=True):
        if argument.arg in state.NAMES:
            assert ast.unparse(default) == f"ARGUMENTS[{argument.arg!r}]", f"{argument.arg}'s default is its own"
    # Subject.opening takes inspect's arguments and fills the rest from the table: it has no defaults.
    opening = pyinspect.signature(Subject.opening).parameters
    assert all(p.default is pyinspect.Parameter.empty for p in opening.values())


def test_the_traits_are_the_settings_with_the_tables_types_and_defaults() -> None:
    traits = widget.Inspector.class_traits()
    kinds = {int: "Int", str: "Unicode", bool: "Bool"}
    for setting in state.SETTINGS:
        assert type(traits[setting.name]).__name__ == kinds[setting.kind], setting.name
        assert traits[setting.name].default_value == setting.default, setting.name
    # Every trait of ViewTraits is a setting, and every setting a trait; the widget adds only what the kernel sends.
    assert set(state.ViewTraits.class_own_traits()) == set(state.NAMES)
    assert set(widget.Inspector.class_own_traits(sync=True)) - {"_esm", "_css"} == DATA_TRAITS


def test_every_checked_setting_has_its_rule_and_no_rule_names_another() -> None:
    assert set(RULES) == set(state.CHECKED)
    assert subject.VIEWS is state.VIEWS


def test_a_changed_table_default_is_what_the_first_view_opens_with(model, monkeypatch) -> None:
    seen = Subject.of(model, IDS)
    assert seen.opening({})["factor"] == "contribution"
    monkeypatch.setitem(state.ARGUMENTS, "factor", "cosine")
    monkeypatch.setitem(state.ARGUMENTS, "hide_sink", True)
    opened = seen.opening({})
    assert (opened["factor"], opened["hide_sink"]) == ("cosine", True)
    monkeypatch.setitem(state.ARGUMENTS, "factor", "nonsense")
    with pytest.raises(InspectorError, match="unknown factor 'nonsense'"):
        seen.opening({})


def test_an_inspector_opens_on_the_tables_defaults_and_sends_them_to_the_front_end(model) -> None:
    inspector = cl.inspect(model, IDS)
    for setting in state.SETTINGS:
        if setting.argument is not state.CHOSEN:
            assert getattr(inspector, setting.name) == setting.argument, setting.name
    assert (inspector.layer, inspector.head, inspector.view, inspector.step, inspector.start) == (
        1,
        -1,
        "heatmap",
        -1,
        0,
    )
    sent = inspector.meta["settings"]
    assert [s["name"] for s in sent] == list(state.NAMES)
    assert {s["name"]: s["default"] for s in sent} == {s.name: s.default for s in state.SETTINGS}
    assert {s["name"] for s in sent if s["type"] == "bool"} == {"hide_sink", "group_kv"}
    assert set(inspector.meta["initial"]) == set(state.LINKED)


def test_group_kv_is_offered_only_where_heads_share_a_value_head() -> None:
    offered = {s["name"]: s["offered"] for s in state.schema([[0], [1]])}
    assert offered["group_kv"] is False and offered["hide_sink"] is True
    assert {s["name"]: s["offered"] for s in state.schema([[0, 1]])}["group_kv"] is True


def test_the_front_end_names_no_setting_the_table_lacks() -> None:
    # What the JavaScript reads of a view's state, and the State type it declares, are the table's settings.
    read = set()
    for path in STATIC.glob("*.js"):
        read |= set(re.findall(r"\bstate\.(?!py\b)([a-z_]+)\b", path.read_text(encoding="utf-8")))
    assert read <= set(state.NAMES), f"the front-end reads settings the table lacks: {read - set(state.NAMES)}"
    types = (STATIC / "types.js").read_text(encoding="utf-8")
    declared = re.search(r"@typedef \{object\} State\n(.*?)\*/", types, re.DOTALL).group(1)
    assert set(re.findall(r"@property \{[^}]*\} \[?(\w+)", declared)) == set(state.NAMES)
    # No front-end code lists the toggles (their menus, labels, links, traits): they come from meta.settings.
    toggles = [s.name for s in state.SETTINGS if s.kind is bool]
    for path in STATIC.glob("*.js"):
        code = [line for line in path.read_text(encoding="utf-8").splitlines() if not line.lstrip().startswith("*")]
        for name in toggles:
            assert not any(f'"{name}"' in line for line in code), f"{path.name} names the setting {name}"
