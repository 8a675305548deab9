"""The inspector's *why* panel in headless Chromium: the bars drawn are `cl.qk_attribution`'s advantages.

A real click on a heatmap cell (one head shown) draws, for that query and key, the largest key-side
and query-side advantage terms and the "other components" bar; the test reads plotly's ``gd.data``
and the hover text of the rendered panel and checks them against the library's own split. A click
on a head's bar opens that head; two cells draw two different explanations; where there is no row
(all heads, a query the page does not carry, a kernel that does not answer) the panel says why.
"""

import json
import re
from pathlib import Path

import numpy as np
import pytest
from test_browser import click_heatmap_cell, control, wait_ready, widget_page

import contribution_lens as cl
from conftest import ARTIFACTS
from contribution_lens.views.inspector import windows
from contribution_lens.views.inspector.why import OTHER, PICK_ONE_HEAD, TOP
from helpers import NEEDS_CHROMIUM

pytestmark = [pytest.mark.browser, NEEDS_CHROMIUM]

TEXT = "When Mary and John went to the store, John gave a drink to"
LAYER, HEAD = 9, 3
WHY = """
const root = document.querySelectorAll('.cl-inspector')[0];
const gd = root.querySelector('.cl-why-bars');
return {caption: root.querySelector('.cl-why-caption').textContent, shown: gd.style.display !== 'none',
        bars: (gd.data || []).map((t) => ({name: t.name, y: t.y, x: t.x, text: t.text})),
        title: (root.querySelector('.cl-heatmap').layout || {title: {}}).title.text};
"""


@pytest.fixture(scope="module")
def splits(bundled_model) -> dict[int, cl.QKAttribution]:
    """The library's split of every head of two layers at every query: what the panel must draw."""
    return {layer: cl.qk_attribution(bundled_model, TEXT, layer, None, query=None) for layer in (LAYER, 2)}


def drawn_why(browser, caption: str) -> dict:
    """The panel once its caption holds ``caption``."""
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(browser, 30).until(lambda b: caption in b.execute_script(WHY)["caption"])
    return browser.execute_script(WHY)


def check_bars(shown: dict, split: cl.QKAttribution, head: int, query: int, key: int) -> None:
    """Both sides' bars are the library's advantages of (head, query, key): top terms in order, the rest, the total."""
    target = float(split.log_alpha_plus_entropy(head=head, query=query)[key])
    labels = [windows.token_label(i, t) for i, t in enumerate(split.str_tokens)]
    assert f"query {labels[query]} to key {labels[key]}" in shown["caption"], shown["caption"]
    written = re.search(r"log α \+ H\(α\) = (-?\d[\d.e+-]*)", shown["caption"].replace("−", "-"))
    assert written and abs(float(written[1]) - target) <= 6e-4 * abs(target), shown["caption"]
    assert shown["shown"] and [bars["name"] for bars in shown["bars"]] == ["key side", "query side"]
    for side, bars in zip(("key", "query"), shown["bars"], strict=True):
        column = split.advantage(side, head=head, query=query)[key]
        order = column.abs().sort_values(ascending=False, kind="stable")
        assert len(bars["y"]) == TOP + 1 and bars["y"][-1] == OTHER
        names, values = bars["y"][:-1], np.array(bars["x"][:-1])
        np.testing.assert_allclose(values, column[names].to_numpy(), atol=2e-6)
        np.testing.assert_allclose(np.abs(values), order.to_numpy()[:TOP], atol=2e-6)
        assert abs(bars["x"][-1] - (column.sum() - column[names].sum())) < 2e-6
        assert abs(sum(bars["x"]) - target) < 1e-4, (side, sum(bars["x"]), target)
        for name, value, text in zip(bars["y"], bars["x"], bars["text"], strict=True):
            match = re.fullmatch(rf"{re.escape(name)}: (-?[0-9.e+-]+) \({side} side\)", text)
            assert match and abs(float(match[1]) - value) <= 6e-4 * abs(value) + 1e-12, (text, value)


def open_head_bar(browser, shown: dict, layers: list[int]) -> tuple[int, int]:
    """A real click on the key side's largest bar of a head (L{m}H{h}) whose layer the inspector shows."""
    from selenium.webdriver.common.action_chains import ActionChains

    key_side = shown["bars"][0]
    heads = [(abs(x), n, name) for n, (name, x) in enumerate(zip(key_side["y"], key_side["x"], strict=True))
             if re.fullmatch(r"L(\d+)H(\d+)", name) and int(name[1:].split("H")[0]) in layers]  # fmt: skip
    assert heads, f"no head of layers {layers} among the drawn terms {key_side['y']}"
    _, n, name = max(heads)
    bar = browser.execute_script(
        "return document.querySelectorAll('.cl-inspector .cl-why-bars .barlayer .trace')[0]"
        ".querySelectorAll('.point path')[arguments[0]]",
        n,
    )
    ActionChains(browser).move_to_element(bar).click().perform()
    layer, head = (int(x) for x in name[1:].split("H"))
    return layer, head


@pytest.mark.slow
def test_page_why_panel_draws_the_library_split_and_opens_a_clicked_head(
    browser, bundled_model, splits, tmp_path
) -> None:
    from selenium.webdriver.support.ui import Select

    # Layers 0..9: every head a split of layer 9 can name is on the page.
    inspector = cl.inspect(bundled_model, TEXT, layers=range(LAYER + 1), layer=LAYER, head=HEAD)
    query = inspector.window.queries[-1]
    page = inspector.write_html(tmp_path / "why.html", why_queries=[query])
    browser.get(page.resolve().as_uri() + f"#layer={LAYER}&head={HEAD}&factor=contribution&scope=inter&query={query}")
    wait_ready(browser)
    split = splits[LAYER]
    # The panel opens on the key the head attends to most, then follows the clicked cell.
    first = drawn_why(browser, f"Why L{LAYER}H{HEAD} attends")
    most = int(split.pattern[HEAD, query, : query + 1].argmax())
    check_bars(first, split, HEAD, query, most)
    click_heatmap_cell(browser, query, 4)
    fourth = drawn_why(browser, "to key 4:")
    check_bars(fourth, split, HEAD, query, 4)
    click_heatmap_cell(browser, query, 6)
    sixth = drawn_why(browser, "to key 6:")
    check_bars(sixth, split, HEAD, query, 6)
    assert sixth["bars"] != fourth["bars"], "two cells draw the same bars"
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    assert browser.find_element("css selector", ".cl-inspector .cl-why").screenshot(str(ARTIFACTS / "why_panel.png"))
    # A head's bar opens that head: menus, heatmap and panel follow.
    layer, head = open_head_bar(browser, sixth, inspector.meta["layers"])
    opened = drawn_why(browser, f"Why L{layer}H{head} attends")
    assert (control(browser, "layer").get_attribute("value"), control(browser, "head").get_attribute("value")) == (
        str(layer), str(head)
    )  # fmt: skip
    assert f"L{layer} head {head}" in opened["title"], opened["title"]
    assert f"layer={layer}&head={head}" in browser.execute_script("return location.hash")
    # Another query: not carried by the page, and the panel says how to get it.
    Select(control(browser, "query")).select_by_value("3")
    missing = drawn_why(browser, "was not embedded")
    assert not missing["shown"]
    assert f"query 3's panel was not embedded in this page (it carries queries {query})" in missing["caption"]
    assert "write_html(..., why_queries=[3])" in missing["caption"]
    # All heads: the panel asks for one head instead of drawing an aggregate.
    Select(control(browser, "head")).select_by_value("all")
    assert PICK_ONE_HEAD in drawn_why(browser, "choose one head")["caption"]
    errors = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert not errors, errors


def kernel_page(inspector, folder: Path, monkeypatch) -> tuple[Path, list[dict]]:
    """`widget_page`, whose ``host.emit`` hands the kernel's custom messages to the page; what the kernel sent."""
    host = widget_page(inspector, folder, monkeypatch)
    sent: list[dict] = []
    monkeypatch.setattr(inspector, "send", sent.append)
    return host, sent


def answer_why(browser, inspector, sent: list[dict]) -> dict:
    """The kernel's side: the page's last why request answered, and the answer handed to the page."""
    asked = browser.execute_script("return window.host.messages.filter((m) => m.type === 'panel' && m.panel === 'why')")
    assert asked, "the page asked the kernel nothing"
    inspector._on_message(inspector, asked[-1], [])
    answer = sent.pop()
    browser.execute_script("window.host.emit('msg:custom', arguments[0])", answer)
    return asked[-1]


@pytest.mark.slow
def test_widget_why_panel_asks_the_kernel_once_per_cell_and_draws_its_answer(
    browser, bundled_model, splits, tmp_path, monkeypatch
) -> None:
    inspector = cl.inspect(bundled_model, TEXT, layers=[2, LAYER], layer=LAYER, head=HEAD)
    page, sent = kernel_page(inspector, tmp_path, monkeypatch)
    browser.get(page.resolve().as_uri())
    wait_ready(browser, hash_too=False)
    query = inspector.query
    split = splits[LAYER]
    # Before a click the kernel is asked nothing (a head chosen in the menu costs no pass): the panel says to click.
    assert not drawn_why(browser, "click a cell of the heatmap")["shown"]
    assert "panel" not in browser.execute_script("return window.host.sent")
    click_heatmap_cell(browser, query, 5)
    assert "computing" in drawn_why(browser, f"computing L{LAYER}H{HEAD} at query {query}")["caption"]
    asked = answer_why(browser, inspector, sent)
    assert {k: asked[k] for k in ("layer", "head", "query")} == {"layer": LAYER, "head": HEAD, "query": query}
    check_bars(drawn_why(browser, "to key 5:"), split, HEAD, query, 5)
    # Another key of the same query: drawn from the row already here, nothing asked.
    click_heatmap_cell(browser, query, 2)
    check_bars(drawn_why(browser, "to key 2:"), split, HEAD, query, 2)
    # Another query: asked once, drawn when the kernel answers; different numbers.
    click_heatmap_cell(browser, 8, 5)
    drawn_why(browser, "computing")
    answer_why(browser, inspector, sent)
    other = drawn_why(browser, "to key 5:")
    check_bars(other, split, HEAD, 8, 5)
    whys = [m for m in browser.execute_script("return window.host.messages") if m.get("panel") == "why"]
    assert [m["query"] for m in whys] == [query, 8], whys
    # A kernel that does not answer: the panel says so, by the widget's rule.
    browser.execute_script("window.host.deaf = true")
    click_heatmap_cell(browser, 7, 2)
    deaf = drawn_why(browser, "not drawn: no kernel answered")
    assert not deaf["shown"]
    browser.execute_script("window.host.deaf = false")
    click_heatmap_cell(browser, 8, 5)
    # A head's bar: the layer and head are saved for the kernel (which sends that layer's payload).
    layer, head = open_head_bar(browser, drawn_why(browser, "to key 5:"), [2, LAYER])
    saved = json.loads(browser.execute_script("return window.host.saved.at(-1)"))
    assert (saved["layer"], saved["head"]) == (layer, head)
    errors = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert not errors, errors
