"""The HTML the package writes, opened in headless Chromium: what is drawn is what the library computes."""

import base64
import json
import random
import re
from pathlib import Path

import numpy as np
import plotly.offline
import pytest
import torch
import traitlets

import contribution_lens as cl
from conftest import ARTIFACTS, assert_self_contained
from contribution_lens.drawing.plot import token_factors
from contribution_lens.views import inspector as ins
from contribution_lens.views.inspector import codecs, windows
from helpers import NEEDS_CHROMIUM

pytestmark = [pytest.mark.browser, NEEDS_CHROMIUM]


def open_and_check(browser, page: Path, screenshot: str, min_plots: int) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get_log("browser")  # drop what earlier pages logged
    browser.get(page.resolve().as_uri())
    WebDriverWait(browser, 60).until(
        lambda b: b.execute_script("return document.querySelectorAll('.js-plotly-plot .main-svg').length") >= min_plots
    )
    plots = browser.execute_script("return document.querySelectorAll('.js-plotly-plot').length")
    drawn = browser.execute_script("return document.querySelectorAll('.js-plotly-plot .main-svg').length")
    assert plots >= min_plots and drawn >= min_plots
    errors = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert not errors, errors
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    assert browser.save_screenshot(str(ARTIFACTS / screenshot))
    assert (ARTIFACTS / screenshot).stat().st_size > 10_000


def test_faithfulness_report_renders(browser, bundled_model, shared_data, tmp_path) -> None:
    from contribution_lens import faithfulness

    settings = faithfulness.Settings(methods=("attention", "contribution"), ratios=(0.0, 0.5))
    data = faithfulness.DataSettings(
        data=(f"gsm8k={shared_data / 'gsm8k' / 'test.jsonl'}",), chunk_length=32, max_chunks=2, batch_size=2
    )
    faithfulness.run(bundled_model, settings, data, tmp_path, progress=False)
    page = tmp_path / "report.html"
    assert_self_contained(page.read_text())
    open_and_check(browser, page, "faithfulness_report.png", min_plots=2)


def test_replication_report_renders_every_claim(browser, tiny_replication) -> None:
    """The page lists each claim of claims.json with its verdict, and draws the opening case and the head grids."""
    page = tiny_replication / "report.html"
    assert_self_contained(page.read_text())
    open_and_check(browser, page, "replication_report.png", min_plots=3)
    saved = json.loads((tiny_replication / "claims.json").read_text())
    rows = browser.execute_script(
        "const table = [...document.querySelectorAll('h2')].find(h => h.textContent === 'The claims')"
        ".nextElementSibling; return [...table.querySelectorAll('tbody tr')].map("
        "tr => [...tr.querySelectorAll('td')].map(td => td.textContent));"
    )
    assert [row[0] for row in rows] == [claim["id"] for claim in saved["claims"]]
    shown = [row[2] for row in rows]
    expected = [claim["verdict"] + (f": {claim['reason']}" if claim["reason"] else "") for claim in saved["claims"]]
    assert shown == expected
    titles = browser.execute_script(
        "return [...document.querySelectorAll('.js-plotly-plot')].map(p => p.layout.title ? p.layout.title.text : '')"
    )
    assert titles[0] == "first token, mean over texts"
    traces = browser.execute_script("return document.querySelectorAll('.js-plotly-plot')[0].data.map(t => t.y.length)")
    assert traces == [2, 2], "attention and contribution, one point a layer"


TEXT = "When Mary and John went to the store, John gave a drink to"
LAYERS = [2, 9]
# Documented quantisation steps (inspector.py): attention via sqrt on 16 bits, cosine on 16 bits.
D_SQRT = 0.5 / codecs.ATTENTION_CODES
D_COS = 0.5 / codecs.COSINE_CODES
NUMBER = r"(-?[0-9.]+(?:e[-+]?[0-9]+)?)"
HOVER = re.compile(
    rf"query (.+)<br>key (.+)<br>attention {NUMBER}<br>relative norm intra {NUMBER}, inter {NUMBER}"
    rf"<br>cosine intra {NUMBER}, inter {NUMBER}<br>contribution intra {NUMBER}, inter {NUMBER}$"
)
DRAWN = """
const root = document.querySelectorAll('.cl-inspector')[arguments[0] || 0];
const gd = root.querySelector('.cl-heatmap');
const visible = (gd.data || []).filter(t => t.type === 'heatmap' && t.visible !== false && t.name !== 'outside');
const t = visible[0] || {};
return {visible: visible.length, z: t.z, text: t.text, x: t.x, y: t.y, hash: location.hash,
        ready: root.dataset.ready};
"""


@pytest.fixture(scope="module")
def page(bundled_model, tmp_path_factory) -> Path:
    inspector = cl.inspect(bundled_model, TEXT, layers=LAYERS)
    return inspector.write_html(tmp_path_factory.mktemp("inspector") / "inspect.html")


def geometries(model, text, layers: list[int]) -> dict[str, cl.Geometry]:
    """The library's numbers of ``text`` (a text or ids ``[1 pos]``) in both scopes: what the heatmaps must draw."""
    return {scope: cl.attention_geometry(model, text, layers=layers, scope=scope) for scope in cl.SCOPES}


@pytest.fixture(scope="module")
def library(bundled_model) -> dict[str, cl.Geometry]:
    return geometries(bundled_model, TEXT, LAYERS)


def quantised(d: cl.Decomposition) -> cl.Decomposition:
    """The decomposition the page receives: attention and cosine through the documented codes."""
    attention = codecs.dequantise_attention(codecs.quantise_attention(d.attention.double().numpy()))
    cosine = codecs.dequantise_cosine(codecs.quantise_cosine(d.cosine.double().numpy()))
    return cl.Decomposition(
        torch.from_numpy(attention), torch.from_numpy(cosine), d.value_norm.double(), d.output_norm.double(),
        d.valid, d.scope,
    )  # fmt: skip


def expected(library, layer: int, head: int | None, scope: str) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Library factors ``[query key]`` of one view, and the tolerance the payload's codecs allow.

    Per head, attention and cosine go through their codes and the rest is derived; all heads, the
    library's token-level numbers are sent (attention and cosine coded, the rest exact float32).
    """
    d = library[scope][layer]
    n = d.attention.shape[-1]
    exact = {k: v.double().numpy() for k, v in token_factors(d, head, 0, n).items()}
    a = exact["attention"]
    attention = 2 * np.sqrt(a) * D_SQRT + D_SQRT**2 + 1e-7
    if head is None:
        return exact, {
            "attention": attention,
            "cosine": np.full_like(a, D_COS + 1e-6),
            # float16: half a unit in the last place, 2^-11 relative (and 2^-25 among subnormals).
            "relative_norm": 2**-11 * np.abs(exact["relative_norm"]) + 1e-7,
            "contribution": 2**-11 * np.abs(exact["contribution"]) + 1e-7,
        }
    tolerance = {
        "attention": attention,
        "cosine": np.full_like(a, D_COS + 1e-6),
        "relative_norm": 1e-5 * np.abs(exact["relative_norm"]) + 1e-7,
        "contribution": contribution_bound(d, head)[0] + 1e-6 + 1e-5 * np.abs(exact["contribution"]),
    }
    return exact, tolerance


def contribution_bound(d: cl.Decomposition, head) -> np.ndarray:
    """``relative_norm * (|da| |cos| + (a + |da|) |dcos|)`` per head: the documented contribution error."""
    a = d.attention[0, head].double().numpy().reshape(-1, *d.attention.shape[-2:])
    rn = d.relative_norm[0, head].double().numpy().reshape(a.shape)
    cos = np.abs(d.cosine[0, head].double().numpy().reshape(a.shape))
    da = 2 * np.sqrt(a) * D_SQRT + D_SQRT**2
    return rn * (da * cos + (a + da) * D_COS)


def wait_ready(browser, *, hash_too: bool = True, index: int = 0) -> dict:
    """What the ``index``-th inspector on the page draws, once it is ready."""
    from selenium.webdriver.support.ui import WebDriverWait

    ready = "const r = document.querySelectorAll('.cl-inspector')[arguments[0]]; return r && r.dataset.ready"
    WebDriverWait(browser, 60).until(lambda b: b.execute_script(ready, index) == "true")
    drawn = browser.execute_script(DRAWN, index)
    if not hash_too:
        drawn.pop("hash")
    return drawn


HEATMAP_TITLE = "return document.querySelector('.cl-heatmap').layout.title.text.replace(/<br>/g, ' ')"
"""The heatmap's title, its lines joined (it is wrapped to the figure's width: a space becomes a line break)."""


def open_view(browser, page: Path, fragment: str) -> dict:
    browser.get("about:blank")
    browser.get(page.resolve().as_uri() + fragment)
    return wait_ready(browser)


def check_drawn(
    drawn: dict, library, layer: int, head: int | None, factor: str, scope: str, window: windows.Window | None = None
) -> None:
    """The one visible heatmap shows ``factor`` of this view, and every hover label all eight numbers.

    ``window``: the token window drawn (default: the whole text).
    """
    assert drawn["visible"] == 1, f"{drawn['visible']} visible heatmap traces"
    n = library[scope][layer].attention.shape[-1]
    window = window or windows.token_window(n)
    cut = np.ix_(window.queries, window.keys)
    other = "inter" if scope == "intra" else "intra"
    by_scope = {}
    for s in (scope, other):
        values, tolerance = expected(library, layer, head, s)
        by_scope[s] = ({k: v[cut] for k, v in values.items()}, {k: v[cut] for k, v in tolerance.items()})
    values, tolerance = by_scope[scope]
    labels = [windows.token_label(i, t) for i, t in enumerate(library[scope].str_tokens[0])]
    assert drawn["y"] == [labels[i] for i in window.queries] and drawn["x"] == [labels[j] for j in window.keys]
    z = np.array([[np.nan if v is None else v for v in row] for row in drawn["z"]], dtype=float)
    causal = window.mask
    assert np.isnan(z[~causal]).all(), "future keys must be blank"
    error = np.abs(z - values[factor])[causal]
    assert np.all(error <= tolerance[factor][causal]), f"{factor}: worst error {error.max():.3g}"
    nq, nk = causal.shape
    for i, j in [(nq - 1, 0), (nq - 1, nk - 2), (nq // 2, 1), (3, 3)]:
        match = HOVER.match(drawn["text"][i][j])
        assert match, drawn["text"][i][j]
        assert (match[1], match[2]) == (drawn["y"][i], drawn["x"][j])
        shown = dict(zip(["attention", "rn_intra", "rn_inter", "cos_intra", "cos_inter", "c_intra", "c_inter"],
                         map(float, match.groups()[2:]), strict=True))  # fmt: skip
        for key, name, s in [("attention", "attention", scope), ("rn_intra", "relative_norm", "intra"),
                             ("rn_inter", "relative_norm", "inter"), ("cos_intra", "cosine", "intra"),
                             ("cos_inter", "cosine", "inter"), ("c_intra", "contribution", "intra"),
                             ("c_inter", "contribution", "inter")]:  # fmt: skip
            want, tol = by_scope[s]
            # Four significant digits on screen.
            assert abs(shown[key] - want[name][i, j]) <= tol[name][i, j] + 6e-4 * abs(want[name][i, j]) + 1e-12, (
                f"hover {key} at ({i}, {j}): {shown[key]} vs library {want[name][i, j]}"
            )


VIEWS = [
    (2, 3, "contribution", "intra"),
    (9, None, "cosine", "inter"),
    (2, None, "relative_norm", "intra"),
    (9, 0, "attention", "inter"),
    (9, 7, "contribution", "inter"),
]


def fragment(layer, head, factor, scope) -> str:
    return f"#layer={layer}&head={'all' if head is None else head}&factor={factor}&scope={scope}"


@pytest.mark.slow
@pytest.mark.parametrize("view", VIEWS, ids=lambda v: fragment(*v)[1:])
def test_inspector_draws_the_view_named_in_the_fragment(browser, page, library, view) -> None:
    drawn = open_view(browser, page, fragment(*view))
    assert drawn["hash"].startswith(fragment(*view))
    check_drawn(drawn, library, *view)
    errors = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert not errors, errors


@pytest.mark.slow
def test_inspector_page_with_a_token_window(browser, bundled_model, library, tmp_path) -> None:
    inspector = cl.inspect(bundled_model, TEXT, layers=LAYERS)
    page = inspector.write_html(tmp_path / "window.html", layers=[9], start=5, tokens=6)
    window = windows.token_window(15, start=5, tokens=6)
    assert window.keys == [0, 5, 6, 7, 8, 9, 10]
    for view in [(9, 4, "contribution", "intra"), (9, None, "relative_norm", "inter")]:
        check_drawn(open_view(browser, page, fragment(*view)), library, *view, window)
    # A layer the page does not hold falls back to the one it does.
    assert open_view(browser, page, "#layer=2&head=1")["hash"].startswith("#layer=9&head=1&")


@pytest.mark.slow
def test_inspector_controls_redraw_and_rewrite_the_fragment(browser, page, library) -> None:
    from selenium.webdriver.support.ui import Select

    open_view(browser, page, "")
    for layer, head, factor, scope in [(9, 5, "contribution", "inter"), (2, None, "attention", "intra"),
                                       (2, 1, "cosine", "intra")]:  # fmt: skip
        for name, value in [("layer", layer), ("head", "all" if head is None else head), ("factor", factor),
                            ("scope", scope)]:  # fmt: skip
            Select(control(browser, name)).select_by_value(str(value))
        drawn = wait_ready(browser)
        assert drawn["hash"].startswith(fragment(layer, head, factor, scope)), drawn["hash"]
        check_drawn(drawn, library, layer, head, factor, scope)
    # The query menu redraws the per-key bars of that query.
    Select(control(browser, "query")).select_by_value("5")
    bars = browser.execute_script(
        "return document.querySelector('.cl-inspector .cl-bars').data.map(t => [t.name, t.x.length])"
    )
    assert bars == [["attention", 6], ["relative norm", 6], ["cosine", 6], ["contribution", 6]]
    assert "&query=5" in browser.execute_script("return location.hash")


def control(browser, name: str, index: int = 0):
    """The ``name`` menu of the ``index``-th inspector on the page."""
    roots = browser.find_elements("css selector", ".cl-inspector")
    return roots[index].find_element("css selector", f"select[data-control='{name}']")


def heatmap_pixels(browser) -> bytes:
    element = browser.find_element("css selector", ".cl-inspector .cl-heatmap")
    return base64.b64decode(element.screenshot_as_base64)


@pytest.mark.slow
def test_two_views_draw_different_pixels(browser, page) -> None:
    # Failed on the previous inspector: its head menu left the drawn heatmap unchanged.
    open_view(browser, page, fragment(2, 0, "contribution", "inter"))
    head0 = heatmap_pixels(browser)
    open_view(browser, page, fragment(2, 3, "contribution", "inter"))
    head3 = heatmap_pixels(browser)
    open_view(browser, page, fragment(2, 3, "cosine", "inter"))
    cosine = heatmap_pixels(browser)
    assert head0 != head3, "head 0 and head 3 draw identical pixels"
    assert head3 != cosine, "contribution and cosine draw identical pixels"
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    browser.set_window_size(1400, 1500)
    open_view(browser, page, fragment(9, None, "contribution", "inter"))
    assert browser.save_screenshot(str(ARTIFACTS / "inspector.png"))
    browser.set_window_size(1400, 1000)


@pytest.mark.slow
def test_inspector_page_is_self_contained(browser, page) -> None:
    text = page.read_text()
    assert_self_contained(text)
    ours = text.replace(plotly.offline.get_plotlyjs(), "")
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", ours), "the page references the network"
    open_view(browser, page, "")
    remote = browser.execute_script(
        "return performance.getEntriesByType('resource').map(e => e.name).filter(n => !n.startsWith('file:'))"
    )
    assert remote == []
    # Scripts ran: no hint to trust the page, no Chart Studio ("Share chart") button in any figure.
    assert browser.execute_script("return document.querySelectorAll('.cl-trust').length") == 0
    buttons = browser.execute_script("return [...document.querySelectorAll('.modebar-btn')].map(b => b.dataset.title)")
    assert buttons and not [b for b in buttons if b.startswith("Share chart")], buttons


def test_inspector_page_without_scripts_says_to_trust_it(browser, page) -> None:
    # Failed before: JupyterLab's viewer opens the page untrusted (no scripts): a heading and blank space.
    browser.execute_cdp_cmd("Emulation.setScriptExecutionDisabled", {"value": True})
    try:
        browser.get("about:blank")
        browser.get(page.resolve().as_uri())
        hint = browser.find_element("css selector", ".cl-trust")
        assert hint.is_displayed() and "press Trust HTML at the top of the viewer" in hint.text, hint.text
    finally:
        browser.execute_cdp_cmd("Emulation.setScriptExecutionDisabled", {"value": False})


WIDGET_HOST = """<!DOCTYPE html><html><head><meta charset='utf-8'></head><body>ROOTS
<script type='application/json' id='states'>STATES</script>
<script type='application/json' id='esm'>ESM</script>
<script type='application/json' id='plotly'>PLOTLY</script>
<script type='application/json' id='restored'>RESTORED</script>
<script type='module'>
// A minimal anywidget host, as a notebook page holds it: one model per widget (the interface render()
// uses), one ES module shared by all, and a kernel that answers need_plotly and ping (the test answers the rest).
const states = JSON.parse(document.getElementById('states').textContent);
// Widgets restored from saved widget state with no kernel behind them: their messages go nowhere.
const restored = JSON.parse(document.getElementById('restored').textContent);
const esm = JSON.parse(document.getElementById('esm').textContent);
const widget = await import(URL.createObjectURL(new Blob([esm], { type: 'text/javascript' })));
window.hosts = [];
const roots = document.querySelectorAll('.widget-root');
for (const [index, state] of states.entries()) {
  const listeners = {};
  const emit = (name, value) => (listeners[name] || []).forEach((f) => f(value));
  // saved: the whole state at each save; changes: what each save sends the kernel (the traits set since).
  const host = { sent: [], messages: [], saved: [], changes: [], dirty: {}, state, restored: restored.includes(index) };
  // The kernel's side: a trait it changed arrives.
  host.receive = (k, v) => { state[k] = v; emit('change:' + k); };
  host.model = {
    get: (k) => state[k],
    set: (k, v) => { host.dirty[k] = v; host.receive(k, v); },
    on: (e, f) => (listeners[e] = listeners[e] || []).push(f),
    off: (e, f) => (listeners[e] = (listeners[e] || []).filter((g) => g !== f)),
    save_changes: () => {
      host.saved.push(JSON.stringify(state));
      host.changes.push(JSON.stringify(host.dirty));
      host.dirty = {};
    },
    // sent: each message's type; messages: the messages a test hands to the kernel (e.g. 'open').
    send: (message) => {
      host.sent.push(message.type);
      host.messages.push(message);
      if (message.type === 'need_plotly') host.askedAt = performance.now();
      if (host.restored) return;
      if (message.type === 'ping') {
        if (!host.deaf) setTimeout(() => emit('msg:custom', { type: 'pong' }), 0);
      } else if (message.type === 'need_plotly') {
        const source = JSON.parse(document.getElementById('plotly').textContent);
        setTimeout(() => emit('msg:custom', { type: 'plotly', source }), 0);
      }
    },
  };
  host.emit = emit; // the kernel's custom messages, handed to the page by a test that answers them
  window.hosts.push(host);
  host.renderedAt = performance.now();
  const rendered = widget.default.render({ model: host.model, el: roots[index] });
  // A restored widget waits for plotly.js from another widget; the cell run again comes a moment later.
  if (host.restored) await new Promise((resolve) => setTimeout(resolve, 500));
  else await rendered;
  roots[index].dataset.ready = 'true';
}
window.host = window.hosts[0];
</script></body></html>"""


def widget_state(inspector) -> dict:
    names = ("layer", "head", "factor", "scope", "query", "start", "tokens", "view", "step", "steps", "meta", "payload")
    names = (*names, "panels")
    return {name: getattr(inspector, name) for name in names}


def script_json(value) -> str:
    return json.dumps(value).replace("</", "<\\/")


def widget_page(inspector, folder: Path, monkeypatch, *others, restored: tuple[int, ...] = ()) -> Path:
    """The widgets' ESM in `WIDGET_HOST`, with each widget's state and the kernel's plotly.js reply.

    ``restored``: the widgets (by index) restored from saved widget state, whose kernel is gone.
    """
    plotly_message = []
    monkeypatch.setattr(inspector, "send", plotly_message.append)
    inspector._on_message(inspector, {"type": "need_plotly"}, [])
    widgets = [inspector, *others]
    host = folder / "widget.html"
    host.write_text(
        WIDGET_HOST.replace("ROOTS", "<div class='widget-root'></div>" * len(widgets))
        .replace("STATES", script_json([widget_state(w) for w in widgets]))
        .replace("ESM", script_json(inspector._esm))
        .replace("PLOTLY", script_json(plotly_message[0]["source"]))
        .replace("RESTORED", script_json(list(restored)))
    )
    return host


@pytest.mark.slow
def test_widget_front_end_draws_the_library_numbers(browser, bundled_model, library, tmp_path, monkeypatch) -> None:
    inspector = cl.inspect(bundled_model, TEXT, layers=LAYERS, layer=2)
    browser.get(widget_page(inspector, tmp_path, monkeypatch).resolve().as_uri())
    check_drawn(wait_ready(browser, hash_too=False), library, 2, None, "contribution", "inter")
    # The page asks the kernel once for plotly.js (and pings it, to report a kernel that does not answer).
    assert [m for m in browser.execute_script("return window.host.sent") if m != "ping"] == ["need_plotly"]
    # 15 tokens fit the 128-token window: no window menu.
    assert control(browser, "window").find_element("xpath", "..").value_of_css_property("display") == "none"
    from selenium.webdriver.support.ui import Select

    for name, value in [("head", "3"), ("factor", "cosine"), ("scope", "intra")]:
        Select(control(browser, name)).select_by_value(value)
    check_drawn(wait_ready(browser, hash_too=False), library, 2, 3, "cosine", "intra")
    saved = json.loads(browser.execute_script("return window.host.saved.at(-1)"))
    assert (saved["head"], saved["factor"], saved["scope"]) == (3, "cosine", "intra")
    # A new layer: the front-end asks the kernel (a trait change) and draws when the payload arrives.
    Select(control(browser, "layer")).select_by_value("9")
    assert json.loads(browser.execute_script("return window.host.saved.at(-1)"))["layer"] == 9
    assert browser.execute_script("return document.querySelector('.cl-status').textContent") == "computing layer 9…"
    inspector.layer = 9
    browser.execute_script("window.host.model.set('payload', arguments[0])", inspector.payload)
    check_drawn(wait_ready(browser, hash_too=False), library, 9, 3, "cosine", "intra")
    errors = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert not errors, errors


@pytest.mark.slow
def test_a_widget_restored_without_its_kernel_keeps_no_new_widget_waiting_for_plotly(
    browser, bundled_model, library, tmp_path, monkeypatch
) -> None:
    # Failed before: a widget asked for plotly.js only where no other widget had asked within 4 s, and a widget
    # restored from saved state asks its gone kernel again every 4 s. The live widget of the cell run again waited
    # at least 4 s, and for ever where restored widgets out of step kept asking (the JupyterLab test saw it in CI).
    restored = cl.inspect(bundled_model, TEXT, layers=LAYERS, layer=9)
    inspector = cl.inspect(bundled_model, TEXT, layers=LAYERS, layer=2)
    browser.get(widget_page(restored, tmp_path, monkeypatch, inspector, restored=(0,)).resolve().as_uri())
    check_drawn(wait_ready(browser, hash_too=False, index=1), library, 2, None, "contribution", "inter")
    # Once its kernel answers a ping, the live widget asks, whoever asked before it.
    waited = browser.execute_script("return window.hosts[1].askedAt - window.hosts[1].renderedAt")
    assert waited < 2000, f"the live widget asked for plotly.js {waited:.0f} ms after it was drawn"
    asked = browser.execute_script("return window.hosts.map((h) => h.sent.filter((m) => m === 'need_plotly').length)")
    assert asked == [1, 1], f"need_plotly asked {asked} times (restored widget, live widget): each asks once"
    # The restored widget draws the view it holds with the plotly.js the live one received.
    check_drawn(wait_ready(browser, hash_too=False, index=0), library, 9, None, "contribution", "inter")


@pytest.mark.slow
def test_widget_token_window_menu(browser, bundled_model, library, tmp_path, monkeypatch) -> None:
    from selenium.webdriver.support.ui import Select

    inspector = cl.inspect(bundled_model, TEXT, layers=LAYERS, layer=9, tokens=8)
    browser.get(widget_page(inspector, tmp_path, monkeypatch).resolve().as_uri())
    check_drawn(wait_ready(browser, hash_too=False), library, 9, None, "contribution", "inter", inspector.window)
    menu = Select(control(browser, "window"))
    assert [option.text for option in menu.options] == ["tokens 0–7", "tokens 4–11", "tokens 8–14"]
    menu.select_by_value("4")
    assert json.loads(browser.execute_script("return window.host.saved.at(-1)"))["start"] == 4
    inspector.start = 4  # what the kernel does with that trait change
    browser.execute_script(
        "for (const [k, v] of Object.entries(arguments[0])) window.host.model.set(k, v)",
        {"meta": inspector.meta, "query": inspector.query, "payload": inspector.payload},
    )
    check_drawn(wait_ready(browser, hash_too=False), library, 9, None, "contribution", "inter", inspector.window)
    assert inspector.window.keys == [0, *range(4, 12)]


def figure_page(figures: dict[str, "object"], folder: Path) -> Path:
    from contribution_lens.drawing import html

    return html.write_html(folder / "figures.html", "figures", list(figures.items()))


def drawn(browser, index: int, selector: str) -> list[dict]:
    """Bounding boxes and text of the elements ``selector`` inside the ``index``-th plot."""
    return browser.execute_script(
        "const plot = document.querySelectorAll('.js-plotly-plot')[arguments[0]];"
        "return [...plot.querySelectorAll(arguments[1])].map(e => {const r = e.getBoundingClientRect();"
        "return {text: e.textContent, left: r.left, right: r.right, width: r.width, dash: e.style.strokeDasharray};});",
        index,
        selector,
    )


@pytest.mark.slow
def test_figures_draw_every_label_a_clear_colour_bar_separate_scales_and_distinct_lines(
    browser, bundled_model, tmp_path
) -> None:
    text = "One two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen."
    g = cl.attention_geometry(bundled_model, text, layers=[4])
    n = len(g.str_tokens[0])
    same = [0.1 * k for k in range(5)]
    figures = {
        "heatmap": cl.plot.token_heatmap(g, layer=4, head=2),
        "bars": cl.plot.factor_bars(g, layer=4, query=n - 1, head=2),
        "lines": cl.plot.lines({"a": same, "b": same, "c": [0.5] * 5}, title="three lines"),
    }
    open_and_check(browser, figure_page(figures, tmp_path), "figures.png", min_plots=3)
    # Every token label is drawn on both axes (plotly would otherwise thin them out).
    assert [t["text"] for t in drawn(browser, 0, ".ytick text")] == g.labels()
    assert len(drawn(browser, 0, ".xtick text")) == n
    # The colour bar starts right of the heatmap's last column.
    cells = drawn(browser, 0, ".heatmaplayer image")[0]
    colorbar = drawn(browser, 0, ".colorbar .cbfills")[0]
    assert colorbar["left"] >= cells["right"]
    # One panel per factor: the contribution bars get their own scale and a visible length.
    contribution = g[4].contribution[0, 2, n - 1].abs().max().item()
    relative = g[4].relative_norm[0, 2, n - 1].max().item()
    assert relative / contribution > 5  # on one shared axis the contribution bars would be 5x shorter
    bars = drawn(browser, 1, ".trace.bars .point path")
    longest = [max(b["width"] for b in bars[k * n : (k + 1) * n]) for k in range(4)]
    assert min(longest) > 0.5 * max(longest), longest
    # Identical series stay distinguishable: each line has its own dash pattern.
    dashes = [line["dash"] for line in drawn(browser, 2, ".scatterlayer .js-line")]
    assert len(dashes) == 3 and len(set(dashes)) == 3, dashes


@pytest.mark.slow
def test_two_inspectors_on_one_page_each_draw_their_own_view(
    browser, bundled_model, library, tmp_path, monkeypatch
) -> None:
    # Each front-end finds its elements inside its own root (no ids): the two never touch each other.
    from selenium.webdriver.support.ui import Select

    first = cl.inspect(bundled_model, TEXT, layers=LAYERS, layer=2)
    second = cl.inspect(bundled_model, TEXT, layers=LAYERS, layer=9, head=4, factor="cosine", scope="intra")
    browser.get(widget_page(first, tmp_path, monkeypatch, second).resolve().as_uri())
    check_drawn(wait_ready(browser, hash_too=False, index=0), library, 2, None, "contribution", "inter")
    check_drawn(wait_ready(browser, hash_too=False, index=1), library, 9, 4, "cosine", "intra")
    # Each page asks its kernel for plotly.js once between them (pings, to report a kernel gone, aside).
    sent = browser.execute_script("return window.hosts.map(h => h.sent.filter(m => m !== 'ping').length)")
    assert sent == [1, 0], "plotly.js asked for once"
    # A control of the second changes the second alone.
    Select(control(browser, "head", 1)).select_by_value("1")
    check_drawn(wait_ready(browser, hash_too=False, index=1), library, 9, 1, "cosine", "intra")
    check_drawn(wait_ready(browser, hash_too=False, index=0), library, 2, None, "contribution", "inter")
    assert browser.execute_script("return window.hosts[0].saved.length") == 0
    assert json.loads(browser.execute_script("return window.hosts[1].saved.at(-1)"))["head"] == 1
    errors = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert not errors, errors


KERNEL_TRAITS = ("step", "view", "layer", "head", "start", "query", "meta", "payload", "error")
"""The traits the kernel sends back, in this order: those a step or an opened head sets, then query, meta, payload."""


def kernel_answers(browser, inspector, index: int = 0) -> None:
    """What the kernel does with the front-end's saved changes: set those traits, send back what changed.

    The traits come back one message each (`KERNEL_TRAITS`), query before meta before payload, as
    ipywidgets sends the changes an observer makes: the front-end draws every intermediate state on
    the way. Traits the kernel changed on its own (`Inspector.show_step` from an ``open`` message,
    handed to ``inspector._on_message`` by the test) come back the same way.
    """
    changes = browser.execute_script(
        "const h = window.hosts[arguments[0]]; const c = h.changes; h.changes = []; return c", index
    )
    for change in changes:
        for name, value in json.loads(change).items():
            setattr(inspector, name, value)
    for name in KERNEL_TRAITS:
        browser.execute_script(
            "const h = window.hosts[arguments[0]];"
            "if (JSON.stringify(h.model.get(arguments[1])) !== JSON.stringify(arguments[2]))"
            "  h.receive(arguments[1], arguments[2]);",
            index,
            name,
            getattr(inspector, name),
        )


TEXT_VIEW = """
const root = document.querySelectorAll('.cl-inspector')[0];
return [...root.querySelectorAll('.cl-flow .cl-token')].map(s => ({
  position: Number(s.dataset.position), value: s.dataset.value === undefined ? null : Number(s.dataset.value),
  title: s.title, query: s.classList.contains('cl-query'), text: s.textContent}));
"""


def check_text_view(browser, library, inspector) -> None:
    """Each token of the window coloured by the library's factor for the selected query, all numbers on hover."""
    head = None if inspector.head < 0 else inspector.head
    values, tolerance = expected(library, inspector.layer, head, inspector.scope)
    window = inspector.window
    tokens = browser.execute_script(TEXT_VIEW)
    assert [t["position"] for t in tokens] == window.keys
    labels = library["inter"].str_tokens[0]
    q = inspector.query
    for token in tokens:
        j = token["position"]
        assert token["text"] == labels[j].replace("\n", "↵").replace("\t", "⇥")
        assert token["query"] == (j == q)
        if j > q:
            assert token["value"] is None and "after the query" in token["title"]
            continue
        want = values[inspector.factor][q, j]
        assert abs(token["value"] - want) <= tolerance[inspector.factor][q, j], (j, token["value"], want)
        assert HOVER.match(token["title"].replace("\n", "<br>")), token["title"]


def click_heatmap_cell(browser, row: int, column: int, selector: str = ".cl-inspector .cl-heatmap") -> None:
    """A real mouse click on the cell (row, column) of the heatmap in ``selector`` (default: the per-layer one)."""
    from selenium.webdriver.common.action_chains import ActionChains

    element = browser.find_element("css selector", selector)
    dx, dy = browser.execute_script(
        "const gd = arguments[0], fl = gd._fullLayout, r = gd.getBoundingClientRect();"
        "return [fl.xaxis.l2p(arguments[2]) + fl._size.l - r.width / 2,"
        "        fl.yaxis.l2p(arguments[1]) + fl._size.t - r.height / 2];",
        element,
        row,
        column,
    )
    ActionChains(browser).move_to_element_with_offset(element, int(dx), int(dy)).click().perform()


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 3])
def test_widget_controls_in_random_orders_never_dead_end(
    browser, bundled_model, library, tmp_path, monkeypatch, seed
) -> None:
    # Failed before: after a window change a click on a cell kept the first window's labels, the bars
    # read "query undefined" and the query menu went blank.
    from selenium.webdriver.support.ui import Select

    inspector = cl.inspect(bundled_model, TEXT, layers=LAYERS, layer=9, tokens=8)
    browser.get(widget_page(inspector, tmp_path, monkeypatch).resolve().as_uri())
    wait_ready(browser, hash_too=False)
    rng = random.Random(seed)
    view = "heatmap"
    drawn_before = None
    # Every control after every other: first a walk through the orders that dead-ended, then random ones.
    first = ["window", "click", "query", "view", "click", "window", "view", "layer", "click", "head", "window"]
    actions = ["layer", "head", "factor", "scope", "query", "window", "view", "click", "click"]
    for step, action in enumerate(first[seed:] + [rng.choice(actions) for _ in range(8)]):
        if action == "view":
            view = "text" if view == "heatmap" else "heatmap"
            Select(control(browser, "view")).select_by_value(view)
        elif action == "click" and view == "text":
            q = rng.choice(inspector.window.queries)
            browser.find_element("css selector", f".cl-flow .cl-token[data-position='{q}']").click()
        elif action == "click":
            row = rng.randrange(len(inspector.window.queries))
            column = rng.choice(
                [j for j, key in enumerate(inspector.window.keys) if key <= inspector.window.queries[row]]
            )
            click_heatmap_cell(browser, row, column)
        else:
            menu = Select(control(browser, action))
            values = [
                o.get_attribute("value")
                for o in menu.options
                if o.get_attribute("value") != menu.first_selected_option.get_attribute("value")
            ]
            if not values:
                continue
            menu.select_by_value(rng.choice(values))
        kernel_answers(browser, inspector)
        wait_ready(browser, hash_too=False)
        # The menus show the kernel's state, none blank; the bars belong to the query.
        for name in ("layer", "head", "factor", "scope", "query", "window"):
            value = Select(control(browser, name)).first_selected_option.get_attribute("value")
            want = {"head": "all" if inspector.head < 0 else inspector.head, "window": inspector.start}.get(
                name, getattr(inspector, name, None)
            )
            assert value == str(want), f"step {step} ({action}): {name} menu shows {value!r}, the kernel {want!r}"
        label = inspector.meta["query_labels"][inspector.window.queries.index(inspector.query)]
        bars_title = browser.execute_script("return document.querySelector('.cl-bars').layout.title.text")
        assert bars_title.startswith(f"query {label}:"), bars_title
        head = None if inspector.head < 0 else inspector.head
        if view == "heatmap":
            drawn = wait_ready(browser, hash_too=False)
            check_drawn(drawn, library, inspector.layer, head, inspector.factor, inspector.scope, inspector.window)
            state = (inspector.layer, inspector.head, inspector.factor, inspector.scope, inspector.start)
            if drawn_before and drawn_before[0] != state and action in ("layer", "head", "factor", "scope"):
                assert drawn["z"] != drawn_before[1], f"step {step}: {action} changed and the heatmap did not"
            drawn_before = (state, drawn["z"])
        else:
            check_text_view(browser, library, inspector)
    errors = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert not errors, errors


@pytest.mark.slow
@pytest.mark.parametrize(
    ("link", "shown", "reason"),
    [
        ("#layer=5&head=1", "#layer=9&head=1&", "layer=5 is not on this page (it holds layers 9); showing layer 9"),
        ("#head=9", "#layer=9&head=all&", "head=9 does not exist (heads 0–8 or all); showing all heads"),
        ("#factor=norm&scope=intra", "&factor=contribution&scope=intra", "factor=norm is not one of attention"),
        ("#query=2", "&query=10", "query=2 is outside this page's queries 5–10; showing query 10"),
        ("#layer=9&colour=red", "#layer=9&", "colour=red is not a view setting"),
    ],
)
def test_page_refuses_a_bad_fragment_and_says_why(browser, bundled_model, tmp_path, link, shown, reason) -> None:
    # Failed before: a bad value was replaced by the page's own choice without a word.
    inspector = cl.inspect(bundled_model, TEXT, layers=LAYERS)
    page = inspector.write_html(tmp_path / "window.html", layers=[9], start=5, tokens=6)
    drawn = open_view(browser, page, link)
    assert shown in drawn["hash"], drawn["hash"]
    message = browser.execute_script(
        "const e = document.querySelector('.cl-error'); return [e.textContent, e.offsetHeight]"
    )
    assert reason in message[0] and message[1] > 0, message
    # The message goes with the first change of view; a good link shows none.
    from selenium.webdriver.support.ui import Select

    Select(control(browser, "factor")).select_by_value("cosine")
    wait_ready(browser)
    assert browser.execute_script("return document.querySelector('.cl-error').offsetHeight") == 0
    open_view(browser, page, "#layer=9&head=2&factor=cosine&scope=inter&query=7&view=text")
    assert browser.execute_script("return document.querySelector('.cl-error').offsetHeight") == 0


@pytest.mark.slow
@pytest.mark.parametrize("width", [800, 1000, 1440])
def test_long_window_heatmap_fits_the_width_with_its_colour_bar(browser, bundled_model, tmp_path, width) -> None:
    # Failed before: at 128 tokens and more the heatmap was ~1,900 px wide, its colour bar cut off.
    text = " ".join(["the quick brown fox jumps over the lazy dog"] * 30)
    inspector = cl.inspect(bundled_model, text, layers=[3], tokens=200)
    page = inspector.write_html(tmp_path / "long.html")
    browser.set_window_size(width, 1000)
    try:
        open_view(browser, page, "")
        box = browser.execute_script(
            "const gd = document.querySelector('.cl-heatmap'); const r = gd.getBoundingClientRect();"
            "const c = gd.querySelector('.colorbar').getBoundingClientRect();"
            "return {right: r.right, bar: c.right, page: document.documentElement.clientWidth,"
            " scroll: document.documentElement.scrollWidth,"
            " cells: gd.querySelector('.heatmaplayer image').getBoundingClientRect().width,"
            " ticks: gd.querySelectorAll('.xtick').length}"
        )
        assert box["bar"] <= box["page"] and box["right"] <= box["page"], box
        assert box["scroll"] <= box["page"], f"the page scrolls sideways: {box}"
        # Every title line inside the page: the heatmap's, and the bars' caption (all heads: three lines).
        titles = browser.execute_script(
            "return [...document.querySelectorAll('.cl-inspector .gtitle')].map(t => t.getBoundingClientRect().right)"
        )
        assert len(titles) == 2 and max(titles) <= box["page"], (titles, box)
        assert box["cells"] > 0.5 * box["page"], box
        # Zoom: a smaller key range labels more of its tokens than the whole window does.
        browser.execute_script(
            "return Plotly.relayout(document.querySelector('.cl-heatmap'),"
            " {'xaxis.range': [-0.5, 20.5], 'yaxis.range': [20.5, -0.5]})"
        )
        zoomed = browser.execute_script(
            "return [...document.querySelectorAll('.cl-heatmap .xaxislayer-above .xtick text')].map(t => t.textContent)"
        )
        assert set(inspector.meta["key_labels"][:21]) <= set(zoomed), zoomed
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        assert browser.save_screenshot(str(ARTIFACTS / f"inspector_200_tokens_{width}px.png"))
    finally:
        browser.set_window_size(1400, 1000)


FIGURE_BOXES = """
const box = (name) => document.querySelector('.cl-inspector .' + name).getBoundingClientRect();
const [heatmap, bars] = [box('cl-heatmap'), box('cl-bars')];
const titles = [...document.querySelectorAll('.cl-inspector .gtitle')].map((t) => t.getBoundingClientRect().right);
return {heatmap: [heatmap.left, heatmap.top, heatmap.right, heatmap.bottom], bars: [bars.left, bars.top, bars.right,
        bars.bottom], page: document.documentElement.clientWidth, scroll: document.documentElement.scrollWidth, titles};
"""


@pytest.mark.slow
@pytest.mark.parametrize("width", [800, 1400])
def test_the_bars_sit_beside_the_heatmap_where_the_width_allows(browser, page, width) -> None:
    # Failed before: the bars were always under the heatmap, so a click's effect was below the fold even at 1400 px.
    browser.set_window_size(width, 1000)
    try:
        open_view(browser, page, fragment(9, None, "contribution", "inter") + "&query=12")
        box = browser.execute_script(FIGURE_BOXES)
        (_, h_top, h_right, h_bottom), (b_left, b_top, b_right, b_bottom) = box["heatmap"], box["bars"]
        if width == 1400:
            assert b_left >= h_right - 1 and b_top < h_bottom and b_bottom > h_top, f"the bars are not beside: {box}"
        else:
            assert b_top >= h_bottom - 1 and b_left < h_right, f"the bars are not under the heatmap: {box}"
        # Either way everything fits: no sideways scroll, every title (the all-heads caption's lines) inside the page.
        assert max(h_right, b_right, *box["titles"]) <= box["page"] and box["scroll"] <= box["page"], box
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        assert browser.save_screenshot(str(ARTIFACTS / f"inspector_bars_{width}px.png"))
    finally:
        browser.set_window_size(1400, 1000)


@pytest.mark.slow
def test_text_view_reads_at_a_thousand_tokens(browser, bundled_model, library, tmp_path) -> None:
    text = " ".join(["Alice gave Bob the book, and then Bob read it to Carol."] * 75)
    inspector = cl.inspect(bundled_model, text, layers=[2], tokens=1000)
    assert len(inspector.window.queries) >= 1000
    page = inspector.write_html(tmp_path / "thousand.html")
    open_view(browser, page, "#layer=2&head=3&factor=attention&view=text")
    tokens = browser.execute_script(TEXT_VIEW)
    assert len(tokens) == len(inspector.window.keys)
    style = browser.execute_script(
        "const s = getComputedStyle(document.querySelector('.cl-flow .cl-token'));"
        "const f = document.querySelector('.cl-flow').getBoundingClientRect();"
        "return {size: parseFloat(s.fontSize), width: f.width, page: document.documentElement.clientWidth}"
    )
    assert style["size"] >= 13 and style["width"] <= style["page"], style
    # A click on a token makes it the query: the link and the coloured row follow.
    browser.find_element("css selector", ".cl-flow .cl-token[data-position='40']").click()
    wait_ready(browser)
    assert "&query=40" in browser.execute_script("return location.hash")
    tokens = browser.execute_script(TEXT_VIEW)
    assert [t["position"] for t in tokens if t["query"]] == [40]
    assert all(t["value"] is None for t in tokens if t["position"] > 40)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    assert browser.save_screenshot(str(ARTIFACTS / "inspector_text_1000_tokens.png"))


def drawn_z(drawn: dict) -> np.ndarray:
    return np.array([[np.nan if v is None else v for v in row] for row in drawn["z"]], dtype=float)


@pytest.mark.slow
@pytest.mark.parametrize("factor", ["attention", "relative_norm", "cosine", "contribution"])
def test_kv_group_view_draws_the_group_combined(browser, page, library, factor) -> None:
    # SmolLM2: 9 query heads read 3 value heads; head 4 is in group 1 (heads 3, 4, 5).
    drawn = open_view(browser, page, f"#layer=9&head=4&factor={factor}&scope=intra&group_kv=1")
    d = library["intra"][9]
    heads = [3, 4, 5]
    a = d.attention[0, heads].double().numpy()
    weight = a.sum(0)
    combined = {
        "attention": a.mean(0),
        "contribution": d.contribution[0, heads].double().numpy().sum(0),
        **{
            name: np.divide((a * getattr(d, name)[0, heads].double().numpy()).sum(0), weight,
                            out=np.zeros_like(weight), where=weight > 0)
            for name in ("relative_norm", "cosine")
        },
    }  # fmt: skip
    z = drawn_z(drawn)
    causal = windows.token_window(z.shape[0]).mask
    error = np.abs(z - combined[factor])[causal]
    assert np.all(error <= 2e-4 + 1e-3 * np.abs(combined[factor][causal])), f"worst {error.max():.3g}"
    title = browser.execute_script(HEATMAP_TITLE)
    assert "KV group 1 (heads 3, 4, 5)" in title, title
    assert "&group_kv=1" in drawn["hash"]


@pytest.mark.slow
@pytest.mark.parametrize(("head", "factor", "scope"), [(3, "attention", "inter"), (None, "contribution", "inter"),
                                                       (3, "contribution", "intra")])  # fmt: skip
def test_hidden_sink_renormalises_the_other_keys(browser, page, library, head, factor, scope) -> None:
    from contribution_lens.drawing.plot import hide_sink

    name = "all" if head is None else head
    drawn = open_view(browser, page, f"#layer=2&head={name}&factor={factor}&scope={scope}&hide_sink=1")
    values, tolerance = expected(library, 2, head, scope)
    totals = values[factor].sum(-1)  # the whole text is the window: every key is in the row
    want = hide_sink(values[factor], totals)
    z = drawn_z(drawn)
    assert np.isnan(z[:, 0]).all(), "the sink column is hidden"
    causal = windows.token_window(z.shape[0]).mask
    causal[:, 0] = False
    ok = ~np.isnan(want) & causal
    # x' = x S / (S - x0): |dx'| <= S / |S - x0| (|dx| + |x| |dx0| / |S - x0|).
    rest = np.abs(totals[:, None] - values[factor][:, :1])
    t = tolerance[factor]
    with np.errstate(divide="ignore", invalid="ignore"):  # query 0 has nothing but the sink: NaN, not compared
        bound = np.abs(totals)[:, None] / rest * (t + np.abs(values[factor]) * t[:, :1] / rest)
    error = np.abs(z - want)[ok]
    assert np.all(error <= bound[ok] + 1e-6), f"worst {error.max():.3g}"
    bars = browser.execute_script("return document.querySelector('.cl-bars').data[0].y")
    assert not any(label.startswith("0:") for label in bars)


@pytest.mark.slow
def test_widget_without_its_kernel_says_so(browser, bundled_model, tmp_path, monkeypatch) -> None:
    # Failed before: a notebook reopened with its saved widget and no kernel said "computing layer 9…" forever.
    inspector = cl.inspect(bundled_model, TEXT, layers=LAYERS, layer=2)
    browser.get(widget_page(inspector, tmp_path, monkeypatch).resolve().as_uri())
    wait_ready(browser, hash_too=False)
    browser.execute_script("window.host.deaf = true")  # the kernel is gone: nothing answers
    from selenium.webdriver.support.ui import Select, WebDriverWait

    Select(control(browser, "layer")).select_by_value("9")
    status = "return document.querySelector('.cl-status').textContent"
    assert browser.execute_script(status) == "computing layer 9…"
    # No answer in 4 s: the change is undone (one state: the menus show the view drawn, layer 2), and said so.
    WebDriverWait(browser, 30).until(
        lambda b: control(b, "layer").get_attribute("value") == "2" and b.execute_script(status) == ""
    )
    line = browser.execute_script("return document.querySelector('.cl-kernel').textContent")
    assert line.startswith("No answer from the kernel for 4 s") and "run the cell again" in line, line
    assert "was undone: the menus show the view drawn" in line, line
    assert "ping" in browser.execute_script("return window.host.sent")
    # A kernel that answers late still draws the change asked again.
    browser.execute_script("window.host.deaf = false")
    Select(control(browser, "layer")).select_by_value("9")
    inspector.layer = 9
    browser.execute_script("window.host.receive('payload', arguments[0])", inspector.payload)
    wait_ready(browser, hash_too=False)
    assert browser.execute_script(status) == ""


@pytest.mark.slow
def test_widget_shows_the_kernels_refusal(browser, bundled_model, tmp_path, monkeypatch) -> None:
    inspector = cl.inspect(bundled_model, TEXT, layers=LAYERS, layer=2)
    browser.get(widget_page(inspector, tmp_path, monkeypatch).resolve().as_uri())
    wait_ready(browser, hash_too=False)
    with pytest.raises(traitlets.TraitError):
        inspector.start = 99
    browser.execute_script("window.host.receive('error', arguments[0])", inspector.error)
    message = browser.execute_script(
        "const e = document.querySelector('.cl-error'); return [e.textContent, e.offsetHeight]"
    )
    assert message[0] == inspector.error and "start 99 is outside the text" in message[0] and message[1] > 0
    browser.execute_script("window.host.receive('error', '')")
    assert browser.execute_script("return document.querySelector('.cl-error').offsetHeight") == 0


# --- explained predictions: the prediction view, its step menu and a head opened from it ----------------

PROMPT = "The capital of France is"
PAGE_LAYERS = [3, 9, 29]
OPENED = (9, 4)  # the head clicked in the prediction view: (layer, head), a layer every page below holds
HEADS = ".cl-inspector .cl-heads"
PER_LAYER = ("layer", "head", "factor", "scope", "query", "hide_sink", "group_kv")
"""The controls the prediction view hides: they change nothing it draws."""
PREDICTION_HOVER = re.compile(
    rf"layer (\d+), head (\d+)<br>direct term {NUMBER} of (.+) = {NUMBER}<br>click: L(\d+)H(\d+) at query (.+)$"
)
KEY_TITLE = re.compile(rf"key (.+)\ndirect term {NUMBER} of (.+)\nflow share after the last layer {NUMBER}$")
PREDICTION = """
const root = document.querySelectorAll('.cl-inspector')[arguments[0] || 0];
const gd = root.querySelector('.cl-heads');
const t = (gd.data || [])[0] || {};
const menu = (name) => root.querySelector("select[data-control='" + name + "']");
const error = root.querySelector('.cl-error');
return {z: t.z, text: t.text, x: t.x, y: t.y,
  keys: [...root.querySelectorAll('.cl-keys .cl-flow .cl-token')].map((s) => ({position: Number(s.dataset.position),
    value: s.dataset.value === undefined ? null : Number(s.dataset.value), title: s.title, classes: [...s.classList]})),
  step: menu('step').value, view: menu('view').value, query: menu('query').value,
  options: [...menu('step').options].map((o) => [o.value, o.textContent]),
  hidden: [...root.querySelectorAll('[data-control]')].filter((e) => e.offsetParent === null)
    .map((e) => e.dataset.control),
  shown: {heads: gd.offsetHeight > 0, heatmap: root.querySelector('.cl-heatmap').offsetHeight > 0},
  error: [error.textContent, error.offsetHeight], hash: location.hash};
"""


@pytest.fixture(scope="module")
def explanation(bundled_model) -> cl.GenerationExplanation:
    return cl.explain_generation(bundled_model, PROMPT, max_new_tokens=3)


@pytest.fixture(scope="module")
def explained(bundled_model, explanation) -> ins.Inspector:
    """The inspector of the explanation, never changed: the pages below are written from it."""
    return cl.inspect(bundled_model, explanation, layers=PAGE_LAYERS)


@pytest.fixture(scope="module")
def explained_page(explained, tmp_path_factory) -> Path:
    return explained.write_html(tmp_path_factory.mktemp("explained") / "explained.html")


@pytest.fixture(scope="module")
def explained_library(bundled_model, explanation) -> dict[str, cl.Geometry]:
    return geometries(bundled_model, explanation.tokens[None], [OPENED[0]])


def four_digits(shown: float, want: float) -> bool:
    """``shown`` is ``want`` written with four significant digits."""
    return abs(shown - want) <= 6e-4 * abs(want) + 1e-12


def check_prediction(shown: dict, explanation: cl.GenerationExplanation, k: int) -> None:
    """The prediction view draws step ``k``: its direct terms per head (heatmap and hover) and per key (the text).

    The terms are float32 on the page: ``by_head()`` and ``by_key()`` to float32's precision; hover
    texts and titles show four significant digits.
    """
    step = explanation[k]
    result = step.attribution
    heads = result.by_head().to_numpy()
    n_layers, n_heads = heads.shape
    assert shown["x"] == [f"H{h}" for h in range(n_heads)] and shown["y"] == [f"L{layer}" for layer in range(n_layers)]
    np.testing.assert_allclose(np.array(shown["z"], dtype=float), heads, rtol=1e-6, atol=1e-12)
    labels = [windows.token_label(i, t) for i, t in enumerate(explanation.str_tokens)]
    strongest = tuple(int(i) for i in np.unravel_index(np.abs(heads).argmax(), heads.shape))
    for layer, head in [(0, 0), (n_layers - 1, n_heads - 1), OPENED, strongest]:
        match = PREDICTION_HOVER.match(shown["text"][layer][head])
        assert match, shown["text"][layer][head]
        assert [int(match[i]) for i in (1, 2, 6, 7)] == [layer, head, layer, head]
        assert (match[4], match[8]) == (result.quantity, labels[step.position])
        assert four_digits(float(match[3]), heads[layer, head]), (match[3], heads[layer, head])
        assert four_digits(float(match[5]), result.logit), (match[5], result.logit)
    assert shown["step"] == str(k)
    assert shown["options"] == [
        [str(i), f"{i}: {json.dumps(s.token)} at {s.position}"] for i, s in enumerate(explanation)
    ]
    keys = result.by_key().to_numpy()
    rollout = step.flow.rollout[-1].double().numpy()
    spans = shown["keys"]
    assert [s["position"] for s in spans] == list(range(len(labels)))
    for span in spans:
        j = span["position"]
        assert ("cl-query" in span["classes"]) == (j == step.position), j
        assert ("cl-target" in span["classes"]) == (j == step.position + 1), j  # the explained token follows
        if j > step.position:
            assert span["value"] is None and "cl-future" in span["classes"], span
            continue
        assert span["value"] == pytest.approx(keys[j], rel=1e-6, abs=1e-12), (j, span["value"], keys[j])
        match = KEY_TITLE.match(span["title"])
        assert match, span["title"]
        assert (match[1], match[3]) == (labels[j], result.quantity)
        assert four_digits(float(match[2]), keys[j]) and four_digits(float(match[4]), rollout[j]), (span, rollout[j])


def prediction(browser, index: int = 0) -> dict:
    return browser.execute_script(PREDICTION, index)


@pytest.mark.slow
def test_explained_page_draws_each_steps_terms_and_the_step_menu_redraws(browser, explained_page, explanation) -> None:
    from selenium.webdriver.support.ui import Select

    open_view(browser, explained_page, "#view=prediction&step=1")
    one = prediction(browser)
    check_prediction(one, explanation, 1)
    assert one["hash"].endswith(f"&query={explanation[1].position}&view=prediction&step=1"), one["hash"]
    assert (one["view"], one["query"]) == ("prediction", str(explanation[1].position))
    assert one["shown"] == {"heads": True, "heatmap": False} and one["error"][1] == 0
    assert set(PER_LAYER) <= set(one["hidden"]) and not {"step", "view"} & set(one["hidden"]), one["hidden"]
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    assert browser.save_screenshot(str(ARTIFACTS / "inspector_prediction.png"))
    # The step menu: step 0's numbers, its position the query, the fragment rewritten.
    Select(control(browser, "step")).select_by_value("0")
    zero = prediction(browser)
    check_prediction(zero, explanation, 0)
    assert zero["z"] != one["z"], "steps 0 and 1 draw the same terms"
    assert zero["hash"].endswith(f"&query={explanation[0].position}&view=prediction&step=0"), zero["hash"]
    errors = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert not errors, errors


@pytest.mark.slow
def test_explained_page_opens_a_clicked_head_at_the_steps_position_or_says_why_not(
    browser, explained, explained_page, explanation, explained_library, tmp_path
) -> None:
    from selenium.webdriver.support.ui import Select, WebDriverWait

    layer, head = OPENED
    position = explanation[1].position
    open_view(browser, explained_page, "#view=prediction&step=1")
    click_heatmap_cell(browser, layer, head, HEADS)  # rows are layers, columns heads
    hash_now = "return location.hash"
    WebDriverWait(browser, 30).until(lambda b: b.execute_script(hash_now).startswith(f"#layer={layer}&head={head}&"))
    drawn = wait_ready(browser)
    assert drawn["hash"] == f"#layer={layer}&head={head}&factor=contribution&scope=inter&query={position}&step=1"
    check_drawn(drawn, explained_library, layer, head, "contribution", "inter")
    menus = {name: Select(control(browser, name)).first_selected_option.get_attribute("value")
             for name in ("view", "layer", "head", "query", "step")}  # fmt: skip
    assert menus == {"view": "heatmap", "layer": str(layer), "head": str(head), "query": str(position), "step": "1"}
    label = windows.token_label(position, explanation.str_tokens[position])
    bars = browser.execute_script("return document.querySelector('.cl-inspector .cl-bars').layout.title.text")
    assert bars.startswith(f"query {label}:"), bars
    # A layer the page does not hold: the page says why and stays on the prediction.
    open_view(browser, explained_page, "#view=prediction&step=1")
    click_heatmap_cell(browser, 27, head, HEADS)
    shown = prediction(browser)
    why = f"L27H{head} at step 1 cannot be shown: layer 27 is not on this page (it holds layers 3, 9, 29)"
    assert why in shown["error"][0] and shown["error"][1] > 0, shown["error"]
    assert (shown["view"], shown["shown"]) == ("prediction", {"heads": True, "heatmap": False})
    assert shown["hash"].endswith("&view=prediction&step=1"), shown["hash"]
    # The message goes with the next change of view, a new fragment too (a link followed, the address edited).
    browser.execute_script("location.hash = '#view=prediction&step=0'")
    WebDriverWait(browser, 30).until(lambda b: prediction(b)["step"] == "0")
    shown = prediction(browser)
    check_prediction(shown, explanation, 0)
    assert shown["error"][1] == 0, shown["error"]
    # A page whose token window ends before the step's position: the same, with that reason.
    narrow = explained.write_html(tmp_path / "narrow.html", layers=[layer], tokens=4)
    open_view(browser, narrow, "#view=prediction&step=1")
    click_heatmap_cell(browser, layer, head, HEADS)
    shown = prediction(browser)
    assert f"position {position} is outside this page's queries 0–3" in shown["error"][0], shown["error"]
    assert shown["view"] == "prediction" and shown["error"][1] > 0
    errors = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert not errors, errors


@pytest.mark.slow
def test_widget_prediction_view_steps_with_the_kernel_and_opens_a_head(
    browser, bundled_model, explanation, explained_library, tmp_path, monkeypatch
) -> None:
    from selenium.webdriver.support.ui import Select

    layer, head = OPENED
    # Four queries a window: step 1 (position 6) is outside step 0's window (queries 2-5).
    inspector = cl.inspect(bundled_model, explanation, layers=PAGE_LAYERS, tokens=4)
    assert (inspector.view, inspector.step, inspector.start, inspector.query) == ("prediction", 0, 2, 5)
    browser.get(widget_page(inspector, tmp_path, monkeypatch).resolve().as_uri())
    wait_ready(browser, hash_too=False)
    zero = prediction(browser)
    check_prediction(zero, explanation, 0)
    assert set(PER_LAYER) | {"window"} <= set(zero["hidden"]), zero["hidden"]
    # The step menu saves the step and draws it; the kernel moves the window and the query to its position.
    Select(control(browser, "step")).select_by_value("1")
    assert json.loads(browser.execute_script("return window.host.changes.at(-1)")) == {"step": 1}
    one = prediction(browser)
    check_prediction(one, explanation, 1)
    assert one["z"] != zero["z"], "steps 0 and 1 draw the same terms"
    kernel_answers(browser, inspector)
    assert (inspector.step, inspector.start, inspector.query) == (1, 4, 6)
    shown = prediction(browser)
    check_prediction(shown, explanation, 1)
    window = control(browser, "window").get_attribute("value")
    assert (shown["query"], window, browser.execute_script("return window.host.state.start")) == ("6", "4", 4)
    opened = "return window.host.messages.filter((m) => m.type === 'open')"
    # A head on a layer the kernel does not inspect: the front-end asks, the kernel refuses, the page says why.
    click_heatmap_cell(browser, 0, head, HEADS)
    assert browser.execute_script(opened) == [{"type": "open", "step": 1, "layer": 0, "head": head}]
    inspector._on_message(inspector, browser.execute_script(opened)[-1], [])
    assert inspector.error == "layer 0 is not among the inspected layers [3, 9, 29]"
    assert (inspector.view, inspector.layer) == ("prediction", 29)
    kernel_answers(browser, inspector)
    shown = prediction(browser)
    assert shown["error"][0] == inspector.error and shown["error"][1] > 0, shown["error"]
    assert shown["view"] == "prediction"
    # A head the kernel has: it opens the per-layer view there, the traits come back, the heatmap is drawn.
    click_heatmap_cell(browser, layer, head, HEADS)
    message = browser.execute_script(opened)[-1]
    assert message == {"type": "open", "step": 1, "layer": layer, "head": head}
    inspector._on_message(inspector, message, [])
    assert (inspector.view, inspector.step, inspector.layer, inspector.head, inspector.query) == (
        "heatmap", 1, layer, head, 6
    )  # fmt: skip
    assert inspector.error == ""
    kernel_answers(browser, inspector)
    check_drawn(wait_ready(browser, hash_too=False), explained_library, layer, head, "contribution", "inter",
                inspector.window)  # fmt: skip
    menus = {name: Select(control(browser, name)).first_selected_option.get_attribute("value")
             for name in ("view", "layer", "head", "query", "step", "window")}  # fmt: skip
    assert menus == {
        "view": "heatmap",
        "layer": str(layer),
        "head": str(head),
        "query": "6",
        "step": "1",
        "window": "4",
    }
    assert browser.execute_script("return document.querySelector('.cl-error').offsetHeight") == 0
    assert browser.execute_script("return document.querySelector('.cl-status').textContent") == ""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    assert browser.save_screenshot(str(ARTIFACTS / "widget_prediction_opened_head.png"))
    errors = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert not errors, errors


@pytest.mark.slow
@pytest.mark.parametrize(
    ("pages", "link", "reasons"),
    [
        ("explained_page", "#view=prediction&step=9", ["step=9 does not exist (steps 0–2); showing step 0"]),
        ("explained_page", "#step=first&view=prediction", ["step=first does not exist (steps 0–2); showing step 0"]),
        (
            "page",
            "#view=prediction&step=1",
            [
                "view=prediction is not one of heatmap, text; showing heatmap",
                "step=1 names a step, and this page explains none; showing no step",
            ],
        ),
    ],
    ids=["step=9", "step=first", "no-steps"],
)
def test_page_refuses_a_step_it_does_not_explain_and_says_why(
    browser, request, explanation, pages, link, reasons
) -> None:
    from selenium.webdriver.support.ui import Select

    open_view(browser, request.getfixturevalue(pages), link)
    shown = prediction(browser)
    assert all(reason in shown["error"][0] for reason in reasons) and shown["error"][1] > 0, shown["error"]
    if pages == "page":  # a page of a text: the heatmap, no step anywhere
        assert "step" not in shown["hash"] and shown["shown"] == {"heads": False, "heatmap": True}
        assert [o.get_attribute("value") for o in Select(control(browser, "view")).options] == ["heatmap", "text"]
        return
    # The page's own step is drawn, and named in the rewritten link.
    assert shown["hash"].endswith("&view=prediction&step=0"), shown["hash"]
    check_prediction(shown, explanation, 0)
    # The message goes with the first change of view.
    Select(control(browser, "step")).select_by_value("1")
    assert prediction(browser)["error"][1] == 0


# --- long texts: a window late in 800 tokens, and an 800-token window -------------------------------------------

LONG = 800
OUTSIDE = """
const gd = document.querySelector('.cl-inspector .cl-heatmap');
const t = gd.data.find(d => d.name === 'outside');
const shapes = (gd.layout.shapes || []).map(s => ({name: s.name, x0: s.x0, y0: s.y0}));
const bars = document.querySelector('.cl-inspector .cl-bars');
return {z: t && t.z.map(r => r[0]), text: t && t.text.map(r => r[0]), x: t && t.x, shapes,
        title: bars.layout.title.text, bars: bars.data.map(b => [b.name, b.y, b.x]),
        barsTop: bars.getBoundingClientRect().top, barsBottom: bars.getBoundingClientRect().bottom,
        viewport: window.innerHeight};
"""
OUTSIDE_HOVER = re.compile(
    rf"query (.+)<br>keys (.+) \(outside the window\)<br>attention {NUMBER}"
    rf"<br>contribution intra {NUMBER}, inter {NUMBER}$"
)


@pytest.fixture(scope="module")
def long_ids(bundled_model) -> torch.Tensor:
    """800 tokens of real text (FineWeb-Edu's first documents, or a repeated sentence without the data)."""
    from conftest import SHARED_DATA

    sample = SHARED_DATA / "fineweb_edu" / "sample-10BT_first150.jsonl"
    lines = sample.read_text().splitlines()[:4] if sample.is_file() else []
    text = " ".join(json.loads(line)["text"] for line in lines) or " ".join(["The fox jumps over the dog."] * 200)
    ids = cl.to_token_batch(bundled_model, text).tokens[:, :LONG]
    assert ids.shape[1] == LONG
    return ids


def point_at(browser, row: int, column: int, click: bool = True) -> None:
    """A real mouse move (and click) on cell (row, column), the page scrolled so the cell is in view."""
    from selenium.webdriver.common.action_chains import ActionChains

    gd = browser.find_element("css selector", ".cl-inspector .cl-heatmap")
    x, y = browser.execute_script(
        "const gd = arguments[0], fl = gd._fullLayout;"
        "const r = () => gd.getBoundingClientRect();"
        "const y = fl.yaxis.l2p(arguments[1]) + fl.yaxis._offset;"
        "window.scrollTo(0, window.scrollY + r().top + y - window.innerHeight / 2);"
        "return [r().left + fl.xaxis.l2p(arguments[2]) + fl.xaxis._offset, r().top + y];",
        gd,
        row,
        column,
    )
    actions = ActionChains(browser)
    actions.w3c_actions.pointer_action.move_to_location(round(x), round(y))
    if click:
        actions.w3c_actions.pointer_action.click()
    actions.perform()


@pytest.mark.slow
def test_a_window_late_in_a_long_text_shows_the_rest_of_each_row(browser, bundled_model, long_ids, tmp_path) -> None:
    # Failed before: a 128-token window late in 800 tokens drew rows that summed to 0.854 at L10H2, query 754,
    # with nothing showing the 0.146 the library puts on keys before the window.
    inspector = cl.inspect(bundled_model, long_ids, layers=[10], tokens=128, start=672)
    page = inspector.write_html(tmp_path / "late.html")
    library = geometries(bundled_model, long_ids, [10])
    window = inspector.window
    assert window.queries[0] == 672 and window.keys[:2] == [0, 672]
    outside = list(range(1, 672))
    for head, factor in ((2, "attention"), (2, "contribution"), (None, "attention"), (None, "contribution")):
        open_view(browser, page, fragment(10, head, factor, "inter") + "&query=754")
        drawn = browser.execute_script(OUTSIDE)
        assert drawn["x"] == ["outside 1–671"], drawn["x"]
        want = {s: token_factors(library[s][10], head, 0, LONG) for s in cl.SCOPES}
        rest = {s: {f: want[s][f][:, outside].sum(-1).double().numpy() for f in ("attention", "contribution")}
                for s in cl.SCOPES}  # fmt: skip
        # The column: the factor's share outside the window, for every query, as the library sums it.
        z = np.array(drawn["z"], dtype=float)
        np.testing.assert_allclose(z, rest["inter"][factor][window.queries], atol=2e-6, rtol=1e-5)
        row = window.queries.index(754)
        if head == 2 and factor == "attention":
            # The window's row and the column make the whole row.
            assert abs(z[row] + np.nansum(drawn_z(wait_ready(browser))[row]) - 1) < 1e-3
        match = OUTSIDE_HOVER.match(drawn["text"][row])
        assert match and match[1] == inspector.meta["query_labels"][row] and match[2] == "1–671", drawn["text"][row]
        stated = (
            rest["inter"]["attention"][754],
            rest["intra"]["contribution"][754],
            rest["inter"]["contribution"][754],
        )
        for got, want_value in zip(map(float, match.groups()[2:]), stated, strict=True):
            assert abs(got - want_value) <= 6e-4 * abs(want_value) + 1e-6, (got, want_value)
    # The hidden sink renormalises the column as the window's cells: attention's row then totals 1 again.
    open_view(browser, page, fragment(10, 2, "attention", "inter") + "&query=754&hide_sink=1")
    hidden = drawn_z(wait_ready(browser))
    column = np.array(browser.execute_script(OUTSIDE)["z"], dtype=float)
    np.testing.assert_allclose(np.nansum(hidden, 1) + column, 1, atol=2e-3)


def bars_drawn(browser) -> tuple[str, dict[str, np.ndarray]]:
    drawn = browser.execute_script(OUTSIDE)
    # Lines joined: a caption is wrapped to its figure's width (a space becomes a line break).
    return drawn["title"].replace("<br>", " "), {name: np.array(x, dtype=float) for name, _, x in drawn["bars"]}


@pytest.mark.slow
def test_each_caption_states_what_is_drawn(browser, page, library) -> None:
    # Failed before: with all heads the bars said "their product is the contribution" (0.3851 x 0.2375 x 0.0672 =
    # 0.0061 against 0.0597); the intra all-heads heatmap said nothing of its scale up to the number of heads.
    open_view(browser, page, fragment(9, 3, "contribution", "inter") + "&query=12")
    title, bars = bars_drawn(browser)
    assert title.endswith("(inter, L9 head 3): attention × relative norm × cosine = contribution"), title
    product = bars["attention"] * bars["relative norm"] * bars["cosine"]
    np.testing.assert_allclose(product, bars["contribution"], rtol=1e-9, atol=1e-12)
    open_view(browser, page, fragment(9, None, "contribution", "inter") + "&query=12")
    title, bars = bars_drawn(browser)
    assert "attention: mean over the 9 heads; relative norm, cosine: their attention-weighted means;" in title, title
    assert "contribution: sum over the heads (not the product of the three)" in title, title
    product = bars["attention"] * bars["relative norm"] * bars["cosine"]
    assert np.abs(product - bars["contribution"]).max() > 1e-3, "the caption says the product does not hold"
    want = token_factors(library["inter"][9], None, 0, library["inter"][9].attention.shape[-1])
    per_head = library["inter"][9].attention[0, :, 12, :13].double().numpy()
    np.testing.assert_allclose(bars["attention"], per_head.mean(0), atol=2e-5)
    np.testing.assert_allclose(
        bars["contribution"], want["contribution"][12, :13].double().numpy(), rtol=2e-3, atol=1e-6
    )
    open_view(browser, page, fragment(9, None, "contribution", "intra"))
    heatmap = browser.execute_script(HEATMAP_TITLE)
    assert "the sum over 9 heads of each head's share of its own output" in heatmap, heatmap
    assert "(each head's row sums to 1, so a row sums to 9)" in heatmap, heatmap
    np.testing.assert_allclose(np.nansum(drawn_z(wait_ready(browser)), 1), 9, rtol=2e-3)


@pytest.mark.slow
def test_an_800_token_window_rows_hit_hover_and_mark_the_click(browser, bundled_model, long_ids, tmp_path) -> None:
    # Failed before: rows under 1 px (a click on row 700 selected 699), every hover text built beforehand.
    inspector = cl.inspect(bundled_model, long_ids, layers=[10], tokens=LONG)
    page = inspector.write_html(tmp_path / "long.html")
    drawn = open_view(browser, page, fragment(10, 2, "attention", "inter"))
    assert drawn["text"] is None, "an 800-token window builds each hover text on demand"
    point_at(browser, 700, 650)
    browser.execute_script("return new Promise(r => setTimeout(r, 500))")
    wait_ready(browser)
    state = browser.execute_script(OUTSIDE)
    assert "&query=700" in browser.execute_script("return location.hash")
    assert {"name": "query", "x0": -0.5, "y0": 699.5} in state["shapes"], state["shapes"]
    assert {"name": "key", "x0": 649.5, "y0": 699.5} in state["shapes"], state["shapes"]
    assert state["title"].startswith("query " + inspector.meta["query_labels"][700]), state["title"]
    assert state["barsTop"] < state["viewport"] - 100 and state["barsBottom"] > 100, f"bars not in view: {state}"
    # Keys of 0.9 px: some have no pixel of their own. Zoomed in (a dragged box), a click reaches each of them,
    # and the zoom stays through the click's redraw (it went back to the whole window before).
    zoom = "{'xaxis.range': [90.5, 110.5], 'yaxis.range': [710.5, 690.5]}"
    browser.execute_script(f"return Plotly.relayout(document.querySelector('.cl-inspector .cl-heatmap'), {zoom})")
    for key in (100, 101):
        point_at(browser, 700, key)
        browser.execute_script("return new Promise(r => setTimeout(r, 500))")
        state = browser.execute_script(OUTSIDE)
        assert {"name": "key", "x0": key - 0.5, "y0": 699.5} in state["shapes"], (key, state["shapes"])
        ranges = browser.execute_script(
            "const fl = document.querySelector('.cl-inspector .cl-heatmap')._fullLayout;"
            "return [fl.xaxis.range, fl.yaxis.range]"
        )
        assert ranges == [[90.5, 110.5], [710.5, 690.5]], f"the zoom went after a click: {ranges}"
    whole = "{'xaxis.autorange': true, 'yaxis.autorange': 'reversed'}"
    browser.execute_script(f"return Plotly.relayout(document.querySelector('.cl-inspector .cl-heatmap'), {whole})")
    point_at(browser, 760, 300, click=False)
    box = browser.find_element("css selector", ".cl-inspector .cl-hover")
    match = HOVER.match(box.text.replace("\n", "<br>"))
    assert box.is_displayed() and match, box.text
    assert (match[1], match[2]) == (inspector.meta["query_labels"][760], inspector.meta["key_labels"][300])
    d = cl.attention_geometry(bundled_model, long_ids, layers=[10], scope="inter")[10]
    assert abs(float(match[3]) - float(d.attention[0, 2, 760, 300])) <= 6e-4 * float(d.attention[0, 2, 760, 300]) + 2e-5
    browser.execute_cdp_cmd("HeapProfiler.collectGarbage", {})
    browser.execute_cdp_cmd("Performance.enable", {})
    metrics = {m["name"]: m["value"] for m in browser.execute_cdp_cmd("Performance.getMetrics", {})["metrics"]}
    assert metrics["JSHeapUsedSize"] < 400 * 2**20, f"JS heap {metrics['JSHeapUsedSize'] / 2**20:.0f} MB"


@pytest.mark.slow
def test_the_step_caption_escapes_a_line_break_once(browser, bundled_model, tmp_path) -> None:
    # Failed before: the caption read the token "\\n" where the step menu and the labels write "\n".
    explanation = cl.explain_generation(bundled_model, "Name a colour.\n", max_new_tokens=1)
    assert "\n" in explanation[0].attribution.str_tokens[explanation[0].position]
    page = cl.inspect(bundled_model, explanation, layers=[2]).write_html(tmp_path / "newline.html")
    open_view(browser, page, "#view=prediction&step=0")
    caption = browser.execute_script("return document.querySelector('.cl-prediction .cl-text-caption').textContent")
    assert '\\n")' in caption and "\\\\n" not in caption, caption


CAPTION = re.compile(
    rf"= {NUMBER} = attention {NUMBER} \+ MLPs {NUMBER} \+ embedding {NUMBER} \+ biases {NUMBER} "
    rf"\+ attention's rounding {NUMBER} \(direct terms; norms' scales frozen\); the model computed {NUMBER} "
    rf"in its own precision \(rounding gap {NUMBER}\)\."
)


@pytest.mark.slow
def test_a_bfloat16_prediction_caption_adds_up_and_names_the_models_own_value(browser, tmp_path) -> None:
    model = cl.load_model(dtype=torch.bfloat16)
    answer = cl.explain_generation(model, PROMPT, max_new_tokens=2)
    page = cl.inspect(model, answer, layers=[29]).write_html(tmp_path / "half.html")
    for k, step in enumerate(answer):
        open_view(browser, page, f"#view=prediction&step={k}")
        caption = browser.execute_script("return document.querySelector('.cl-prediction .cl-text-caption').textContent")
        match = CAPTION.search(caption)
        assert match, caption
        logit, *parts, own, gap = (float(value) for value in match.groups())
        result = step.attribution
        assert four_digits(logit, result.logit) and four_digits(own, result.model_value), (caption, result)
        assert four_digits(gap, result.rounding_gap) and four_digits(parts[-1], float(result.attention_rounding.sum()))
        # Each part is shown to four digits: their sum is the logit to that precision.
        assert abs(sum(parts) - logit) <= 6e-4 * sum(abs(p) for p in parts) + 6e-4 * abs(logit), caption


# --- readable at every width JupyterLab gives an output ------------------------------------------------------

OUTPUT_WIDTHS = (368, 620, 968, 1220)
"""JupyterLab 4.6's output widths: 800 px window with the file browser open, then 620, 968 and 1,220 px."""
TEXT_BOXES = """
const root = document.querySelector('.cl-inspector');
const box = (e) => { const r = e.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
const texts = (gd, selector) => [...gd.querySelectorAll(selector)].filter((t) => t.textContent.trim() &&
  t.getBoundingClientRect().width > 0).map((t) => ({text: t.textContent, box: box(t)}));
const figure = (name) => {
  const gd = root.querySelector('.' + name);
  return {box: box(gd), width: gd.layout.width, title: texts(gd, '.gtitle'),
          axes: texts(gd, '.xtitle, .x2title, .x3title, .x4title, .ytitle, .y2title, .cbtitle text'),
          ticks: texts(gd, '.xtick text, .x2tick text, .x3tick text, .x4tick text')};
};
return {root: box(root), heatmap: figure('cl-heatmap'), bars: figure('cl-bars')};
"""


def overlapping(boxes: list[dict]) -> list[tuple[str, str]]:
    """The pairs of texts whose boxes overlap by more than a pixel each way."""
    pairs = []
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            (l1, t1, r1, b1), (l2, t2, r2, b2) = a["box"], b["box"]
            if min(r1, r2) - max(l1, l2) > 1 and min(b1, b2) - max(t1, t2) > 1:
                pairs.append((a["text"], b["text"]))
    return pairs


@pytest.fixture(scope="module")
def window_page(bundled_model, long_ids, tmp_path_factory) -> Path:
    """A page of 128 queries of real text at layer 1 (a pass of two layers): the bars go under the heatmap."""
    inspector = cl.inspect(bundled_model, long_ids[:, :160], layers=[1], tokens=128, start=32)
    return inspector.write_html(tmp_path_factory.mktemp("widths") / "widths.html")


@pytest.mark.parametrize("head", [None, 1], ids=["all-heads", "head-1"])
@pytest.mark.parametrize("width", OUTPUT_WIDTHS)
def test_captions_wrap_titles_never_overlap_and_a_click_keeps_row_and_bars_in_view(
    browser, window_page, width, head
) -> None:
    # Failed before: at 368 px the bars' caption was cut at "(inter, L9 head", their four axis titles overlapped and
    # their tick labels collided; captions were cut up to 1,220 px; at 128 tokens in 968 px a click scrolled the
    # bars into view and the heatmap entirely out of it.
    from selenium.webdriver.support.ui import WebDriverWait

    page = window_page
    browser.set_window_size(1400, 1000)
    open_view(browser, page, fragment(1, head, "contribution", "inter"))
    browser.execute_script(f"document.querySelector('.cl-inspector').style.width = '{width}px'")
    fits = f"const r = document.querySelector('.cl-inspector .cl-bars'); return r.layout.width <= {width}"
    WebDriverWait(browser, 30).until(lambda b: b.execute_script(fits))
    browser.execute_script("return new Promise((r) => setTimeout(r, 300))")
    boxes = browser.execute_script(TEXT_BOXES)
    right = boxes["root"][0] + width
    for name in ("heatmap", "bars"):
        figure = boxes[name]
        left, _, fig_right, _ = figure["box"]
        assert figure["width"] <= width and fig_right <= right + 1, (name, figure["box"], right)
        for text in figure["title"] + figure["axes"]:  # every line inside its figure: nothing cut
            assert text["box"][0] >= left - 1 and text["box"][2] <= left + figure["width"] + 1, (name, text, left)
        assert not overlapping(figure["title"] + figure["axes"]), (name, overlapping(figure["title"] + figure["axes"]))
    # The bars: no title, axis title or tick label on another.
    bars = boxes["bars"]["title"] + boxes["bars"]["axes"] + boxes["bars"]["ticks"]
    assert not overlapping(bars), overlapping(bars)
    title = browser.execute_script("return document.querySelector('.cl-inspector .cl-bars').layout.title.text")
    assert "attention" in title and title.replace("<br>", " ").startswith("query "), title
    # A click on a row near the top and one near the bottom of the window: that row and the bars' caption in view.
    for row in (3, 120):
        point_at(browser, row, 1 + row // 2)  # the row scrolled to the middle of the window, as a reader clicks it
        query = f"query={row + 32}"
        WebDriverWait(browser, 30).until(
            lambda b, query=query: re.search(rf"[#&]{query}(&|$)", b.execute_script("return location.hash"))
        )
        browser.execute_script("return new Promise((r) => setTimeout(r, 500))")
        seen = browser.execute_script(
            "const gd = document.querySelector('.cl-inspector .cl-heatmap'), fl = gd._fullLayout;"
            "const y = gd.getBoundingClientRect().top + fl._size.t + fl.yaxis.l2p(arguments[0]);"
            "const bars = document.querySelector('.cl-inspector .cl-bars').getBoundingClientRect();"
            "return {row: y, bars: bars.top, caption: bars.top + 60, view: window.innerHeight};",
            row,
        )
        assert 0 <= seen["row"] <= seen["view"], f"the clicked row {row} is out of view: {seen}"
        assert 0 <= seen["bars"] and seen["caption"] <= seen["view"], f"the bars' caption is out of view: {seen}"
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(ARTIFACTS / f"inspector_{width}px_{'all' if head is None else 'head'}.png"))
