"""The inspector's panel seam: one registry of panels, each computed by the widget and carried by its page.

A panel registered here (a compute function and an ES module defined in this file) is computed by the
widget for a request, answered to the front-end's message, carried by ``write_html`` for every layer and
the named queries, and sent to a front-end with its module; bad panels and bad queries are refused by
name, before any pass.
"""

import json
import re

import pytest
import torch

import contribution_lens as cl
from conftest import tiny_bridge
from contribution_lens.views.inspector import caches, panel
from contribution_lens.views.inspector import widget as ins
from contribution_lens.views.inspector.panel import PANELS, Panel, PanelSource, register_panel, unregister_panel

SCRIPT = 'export function draw(element, context) { element.textContent = "count " + context.answer().data; }'


def count_keys(source: PanelSource, request: dict[str, int]) -> int:
    """The window's keys up to the query, times the layer plus one: a number only this function computes."""
    return (request["layer"] + 1) * sum(key <= request["query"] for key in source.window.keys)


@pytest.fixture
def counted():
    """A toy panel registered for the test and taken away after it."""
    yield register_panel(Panel("counted", "keys counted", count_keys, SCRIPT, on=("layer", "query")))
    unregister_panel("counted")


def page_data(html: str) -> dict:
    blob = re.search(r"<script type='application/json' class='cl-data'>(.*?)</script>", html, re.DOTALL)
    assert blob
    return json.loads(blob[1].replace("<\\/", "</"))


def test_the_why_panel_is_the_one_built_in_panel() -> None:
    assert list(PANELS) == ["why"] and PANELS.is_builtin("why")
    why = PANELS["why"]
    assert why.on == ("layer", "head", "query") and "export function draw(" in why.script
    with pytest.raises(ValueError, match="'why' is built in and cannot be unregistered"):
        unregister_panel("why")


def test_a_registered_panel_is_computed_answered_and_carried(counted, monkeypatch) -> None:
    inspector = cl.inspect(tiny_bridge("gqa"), torch.arange(12), layer=1, tokens=6, start=6)
    # Sent to the front-end with its module, after the built-in panel.
    assert [spec["name"] for spec in inspector.panels] == ["why", "counted"]
    assert inspector.panels[1] == {
        "name": "counted",
        "title": "keys counted",
        "on": ["layer", "query"],
        "script": SCRIPT,
    }
    # Computed for a request: the window 6..11 holds keys 0 and 6..11.
    assert inspector.panel("counted", 8, layer=0) == 4 and inspector.panel("counted") == 2 * 7
    with pytest.raises(ins.InspectorError, match=r"query 3 is not in the token window 6\.\.11"):
        inspector.panel("counted", 3)
    with pytest.raises(
        ins.InspectorError, match=r"unknown panel 'count'; registered panels: why, counted; did you mean 'counted'\?"
    ):
        inspector.panel("count")
    # The front-end's request answered under its key.
    sent: list[dict] = []
    monkeypatch.setattr(inspector, "send", sent.append)
    ask = {"type": "panel", "panel": "counted", "key": "k", "layer": 0, "query": 9}
    inspector._on_message(inspector, ask, [])
    inspector._on_message(inspector, {**ask, "query": 2}, [])
    assert sent[0] == {"type": "panel", "panel": "counted", "key": "k", "data": 5}
    assert "query 2 is not in the token window" in sent[1]["error"]
    # Carried by a page for every layer at the named queries, with every panel's module.
    data = page_data(inspector.render_html(panels={"counted": [-1, 8]}))
    assert [spec["name"] for spec in data["panels"]] == ["why", "counted"]
    assert data["panel_data"] == {"counted": {"queries": [8, 11], "data": {"0/8": 4, "0/11": 7, "1/8": 8, "1/11": 14}}}


def test_a_page_refuses_an_unknown_panel_and_queries_off_its_window_before_any_pass(counted, monkeypatch) -> None:
    inspector = cl.inspect(tiny_bridge("mha"), torch.arange(12), tokens=4, start=8)

    def no_pass(*args, **kwargs):
        raise AssertionError("a pass ran before the panels' queries were checked")

    monkeypatch.setattr(caches, "compute_windows", no_pass)
    inspector._payloads.computed.clear()
    with pytest.raises(ins.InspectorError, match=r"panels\['counts'\]: unknown panel 'counts'"):
        inspector.render_html(panels={"counts": [9]})
    with pytest.raises(ins.InspectorError, match=r"panels\['counted'\] \[3\] are not queries of the page's window"):
        inspector.render_html(panels={"counted": [3, 9]})


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"name": "Toy"}, "name: a panel's name is lower case letters, digits and _, got 'Toy'"),
        ({"on": ("layer", "step")}, "on: a panel's settings are some of layer, head, query, each once"),
        ({"on": ()}, "on: a panel's settings are some of layer, head, query, each once"),
        ({"script": "function draw() {}"}, "script: the panel 'toy''s module must export function draw"),
        (
            {"compute": lambda source: 0},
            r"compute: a panel's compute is called as compute\(source, request\)",
        ),
        ({"name": "why"}, "a panel named 'why' is already registered; it is built in"),
    ],
)
def test_a_bad_panel_is_refused_when_registered(changes, message) -> None:
    fields = {"name": "toy", "title": "toy", "compute": count_keys, "script": SCRIPT, **changes}
    with pytest.raises(ValueError, match=message):
        register_panel(Panel(**fields))
    assert "toy" not in PANELS


def test_a_request_is_keyed_by_its_settings_in_the_panels_order() -> None:
    toy = Panel("toy", "toy", count_keys, SCRIPT, on=("query", "layer"))
    assert panel.request_key(toy, {"layer": 2, "head": 5, "query": 7}) == "7/2"
