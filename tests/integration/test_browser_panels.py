"""A panel added in this file alone is drawn by the inspector, on its static page and live: the panel seam.

The toy panel is a compute function and a small ES module, both defined here and registered in
`contribution_lens.views.inspector.panel.PANELS`; no other module names it. Headless Chromium opens the
page `write_html` writes and the widget's front-end (the host page of test_browser.py, whose kernel this
test plays), and reads the text the toy module drew from the data its compute function returned.
"""

from pathlib import Path

import pytest
import torch
from test_browser import control, wait_ready, widget_page

import contribution_lens as cl
from conftest import tiny_bridge
from contribution_lens.views.inspector.panel import Panel, PanelSource, register_panel, unregister_panel
from helpers import NEEDS_CHROMIUM

pytestmark = [pytest.mark.browser, NEEDS_CHROMIUM]

TOY_SCRIPT = """// @ts-check
export function draw(element, context) {
  const answer = context.answer();
  element.classList.add("cl-toy");
  element.textContent = answer.data ? "toy: " + answer.data.text
    : answer.missing ? "toy: query " + context.request.query + " not carried (" + answer.missing.join(",") + ")"
    : answer.pending ? "toy: asked" : "toy: " + JSON.stringify(answer);
}
"""


def toy_compute(source: PanelSource, request: dict[str, int]) -> dict[str, str]:
    """The keys the query sees in the window, and the layer: a text only this compute function writes."""
    seen = [key for key in source.window.keys if key <= request["query"]]
    return {"text": f"layer {request['layer']} query {request['query']} sees {len(seen)} keys, last {seen[-1]}"}


@pytest.fixture
def toy():
    """The toy panel, registered for the test and taken away after it."""
    panel = register_panel(Panel("toy", "toy panel", toy_compute, TOY_SCRIPT, on=("layer", "query")))
    yield panel
    unregister_panel("toy")


def toy_text(browser, want: str) -> str:
    """The toy panel's text once it holds ``want``."""
    from selenium.webdriver.support.ui import WebDriverWait

    read = "const t = document.querySelector('.cl-inspector .cl-toy'); return t ? t.textContent : ''"
    WebDriverWait(browser, 30).until(lambda b: want in b.execute_script(read))
    return browser.execute_script(read)


def test_a_toy_panel_is_drawn_on_the_static_page(browser, toy, tmp_path) -> None:
    from selenium.webdriver.support.ui import Select

    inspector = cl.inspect(tiny_bridge("gqa"), torch.arange(12), layer=1, tokens=6, start=6)
    page = inspector.write_html(tmp_path / "toy.html", panels={"toy": [8, 11]})
    browser.get(page.resolve().as_uri() + "#layer=1&head=all&factor=contribution&scope=inter&query=11")
    wait_ready(browser)
    # The window holds keys 0 (the sink) and 6..11: query 11 sees 7 of them.
    assert toy_text(browser, "toy: layer") == "toy: layer 1 query 11 sees 7 keys, last 11"
    Select(control(browser, "layer")).select_by_value("0")
    Select(control(browser, "query")).select_by_value("8")
    assert toy_text(browser, "query 8") == "toy: layer 0 query 8 sees 4 keys, last 8"
    Select(control(browser, "query")).select_by_value("7")
    assert toy_text(browser, "not carried") == "toy: query 7 not carried (8,11)"
    errors = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert not errors, errors


def test_a_toy_panel_is_drawn_live_from_the_kernels_answer(browser, toy, tmp_path: Path, monkeypatch) -> None:
    inspector = cl.inspect(tiny_bridge("mha"), torch.arange(10), layer=1, tokens=4, start=6)
    host = widget_page(inspector, tmp_path, monkeypatch)
    sent: list[dict] = []
    monkeypatch.setattr(inspector, "send", sent.append)
    browser.get(host.resolve().as_uri())
    wait_ready(browser, hash_too=False)
    assert toy_text(browser, "toy: asked") == "toy: asked"
    # The kernel's side: the page's request answered by the widget, the answer handed to the page.
    asked = browser.execute_script("return window.host.messages.filter((m) => m.panel === 'toy')")
    assert [(m["layer"], m["query"]) for m in asked] == [(1, 9)], asked
    inspector._on_message(inspector, asked[-1], [])
    (answer,) = sent
    # The window holds keys 0 (the sink) and 6..9: query 9 sees 5 of them.
    assert answer["data"] == {"text": "layer 1 query 9 sees 5 keys, last 9"}, answer
    browser.execute_script("window.host.emit('msg:custom', arguments[0])", answer)
    assert toy_text(browser, "sees") == "toy: layer 1 query 9 sees 5 keys, last 9"
    errors = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert not errors, errors
