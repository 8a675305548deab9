"""The circuit figure in headless Chromium: the edges drawn, their hover text, two circuits drawn differently, and a
lesson-sized circuit readable at every width: no label over another or outside the figure, none under an edge."""

import numpy as np
import pandas as pd
import pytest

from conftest import ARTIFACTS
from contribution_lens import files
from contribution_lens.drawing.circuit_figures import circuit_figure
from helpers import CHROMEDRIVER, CHROMIUM, NO_CHROMIUM, chromium_driver

pytestmark = [pytest.mark.browser, pytest.mark.skipif(CHROMIUM is None or CHROMEDRIVER is None, reason=NO_CHROMIUM)]

N_LAYERS, N_HEADS = 2, 3
NODES = pd.DataFrame({"node": ["embed", "L0H0", "L0H2", "L0.mlp", "L1H1", "L1.mlp", "logits"],
                      "score": [0.0, 0.8, -0.3, 0.2, 1.5, -0.1, 0.0]})  # fmt: skip
EDGES = pd.DataFrame(
    [("embed", "L0H0", "v", 0.5), ("embed", "L0H2", "k", -0.25), ("L0H0", "L1H1", "q", 1.0),
     ("L0H2", "L1H1", "k", -2.0), ("L0H0", "L1H1", "v", 0.1), ("L0.mlp", "L1.mlp", "", 0.4),
     ("L1H1", "logits", "", 1.5)],
    columns=["upstream", "downstream", "input", "score"],
)  # fmt: skip

DRAWN = """
const gd = document.querySelector('.js-plotly-plot');
const paths = [...gd.querySelectorAll('.scatterlayer .trace path.js-line')]
  .filter((p) => (p.getAttribute('d') || '').length > 0);
// A dash pattern in units of max(width, 3 px), plotly's unit of dashes.
const unit = (p) => Math.max(parseFloat(p.style.strokeWidth), 3);
const dash = (p) => (p.style.strokeDasharray || 'solid').split(',')
  .map((v) => (v === 'solid' ? v : Math.round((parseFloat(v) / unit(p)) * 10) / 10)).join(',');
return {lines: paths.length, dashes: paths.map(dash),
        hover: gd.data.filter((t) => t.name.startsWith('edges')).map((t) => t.hovertext).flat(),
        legend: [...gd.querySelectorAll('.legend .traces .legendtext')].map((e) => e.textContent)};
"""
HOVER = """
const gd = document.querySelector('.js-plotly-plot');
const curve = gd.data.findIndex((t) => t.name === arguments[0]);
Plotly.Fx.unhover(gd);
Plotly.Fx.hover(gd, [{curveNumber: curve, pointNumber: arguments[1]}]);
"""
HOVER_TEXT = "return [...document.querySelectorAll('.hoverlayer .hovertext')].map((e) => e.textContent);"


def hover_text(browser, trace: str, point: int, *expected: str) -> list[str]:
    """The hover label plotly draws over a point (hovering is throttled: wait for the label's text)."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    def shown(b) -> bool:
        b.execute_script(HOVER, trace, point)
        return any(all(part in text for part in expected) for text in b.execute_script(HOVER_TEXT))

    try:
        WebDriverWait(browser, 10, poll_frequency=0.2).until(shown)
    except TimeoutException:
        pytest.fail(f"no hover label with {expected} over {trace}[{point}]: {browser.execute_script(HOVER_TEXT)}")
    return browser.execute_script(HOVER_TEXT)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    driver = chromium_driver(tmp_path_factory.mktemp("chromium-profile"))
    yield driver
    driver.quit()


def show(browser, figure, path) -> dict:
    from selenium.webdriver.support.ui import WebDriverWait

    files.write_text(path, figure.to_html(include_plotlyjs=True, full_html=True))
    browser.get_log("browser")
    browser.get(path.resolve().as_uri())
    WebDriverWait(browser, 60).until(
        lambda b: b.execute_script("return document.querySelectorAll('.js-plotly-plot .main-svg').length") > 0
    )
    assert not [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    return browser.execute_script(DRAWN)


def test_circuit_figure_draws_its_edges_with_their_hover_text(browser, tmp_path) -> None:
    drawn = show(browser, circuit_figure(NODES, EDGES, n_layers=N_LAYERS, n_heads=N_HEADS), tmp_path / "circuit.html")
    assert drawn["lines"] == len(EDGES)
    assert len(set(drawn["dashes"])) == 4  # q, k, v and the single input each drawn with their own dash
    assert "L0H2 → L1H1 (k)<br>score=-2" in drawn["hover"] and len(drawn["hover"]) == len(EDGES)
    assert drawn["legend"] == [
        "into a head's query (q)",
        "into a head's key (k)",
        "into a head's value (v)",
        "into an MLP or the logits",
    ]
    hover_text(browser, "edges k", 1, "L0H2 → L1H1 (k)", "score=-2")
    hover_text(browser, "edges resid", 1, "L1H1 → logits", "score=1.5")
    hover_text(browser, "nodes", 4, "L1H1", "score=1.5")


def test_two_circuits_draw_differently(browser, tmp_path) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    full = show(browser, circuit_figure(NODES, EDGES, n_layers=N_LAYERS, n_heads=N_HEADS), tmp_path / "full.html")
    first = browser.get_screenshot_as_png()
    assert browser.save_screenshot(str(ARTIFACTS / "circuit_full.png"))
    top = EDGES.loc[EDGES["score"].abs().nlargest(2).index]
    pruned = show(browser, circuit_figure(NODES, top, n_layers=N_LAYERS, n_heads=N_HEADS), tmp_path / "top.html")
    assert browser.save_screenshot(str(ARTIFACTS / "circuit_top2.png"))
    assert (full["lines"], pruned["lines"]) == (7, 2)
    assert sorted(pruned["hover"]) == ["L0H2 → L1H1 (k)<br>score=-2", "L1H1 → logits<br>score=1.5"]
    assert browser.get_screenshot_as_png() != first


def lesson_sized_circuit() -> tuple[pd.DataFrame, pd.DataFrame]:
    """A circuit shaped like lesson 11's (SmolLM2: 30 layers, 9 heads in 3 KV groups): 40 edges in 11 of its layers,
    those into a shared key or value drawn into each of the group's query heads (more lines than edges)."""
    generator = np.random.default_rng(0)
    layers = [0, 13, 14, 17, 18, 20, 21, 22, 23, 24, 29]
    heads = [f"L{layer}H{h}" for layer in layers[1:] for h in generator.choice(9, 2, replace=False)]
    writers = ["embed", "L0.mlp", "L18.mlp", "L21.mlp", *heads]
    rows = []
    for e in range(40):
        upstream = writers[e % len(writers)]
        below = -1 if upstream == "embed" else int(upstream[1:].split("H")[0].split(".")[0])
        later = [h for h in heads if int(h[1:].split("H")[0]) > below]
        if not later or e % 5 == 0:
            rows.append((upstream, "logits", "", float(generator.normal()), f"{upstream}->logits"))
            continue
        target = later[int(generator.integers(len(later)))]
        kind = "qkv"[e % 3]
        layer, head = (int(x) for x in target[1:].split("H"))
        group = range(3 * (head // 3), 3 * (head // 3) + 3) if kind != "q" else [head]
        name = f"{upstream}->L{layer}KV{head // 3}<{kind}>" if kind != "q" else f"{upstream}->{target}<q>"
        score = float(generator.normal())
        rows += [(upstream, f"L{layer}H{h}", kind, score, name) for h in group]
    edges = pd.DataFrame(rows, columns=["upstream", "downstream", "input", "score", "edge"])
    names = sorted(set(edges["upstream"]) | set(edges["downstream"]))
    return pd.DataFrame({"node": names, "score": generator.normal(size=len(names))}), edges


TEXTS = """
const gd = document.querySelector('.js-plotly-plot');
const svg = gd.querySelector('.main-svg').getBoundingClientRect();
const box = (e) => { const r = e.getBoundingClientRect(); return {l: r.left, r: r.right, t: r.top, b: r.bottom}; };
const texts = [];
const add = (kind, e) => {
  const b = box(e);
  if (b.r - b.l > 0 && e.textContent.trim()) texts.push({kind, text: e.textContent, ...b});
};
gd.querySelectorAll('.ytick text').forEach((e) => add('tick', e));
gd.querySelectorAll('.gtitle, .annotation-text').forEach((e) => add('title', e));
gd.querySelectorAll('.legend .legendtext, .legend .legendtitletext').forEach((e) => add('legend', e));
gd.querySelectorAll('.colorbar text').forEach((e) => add('colorbar', e));
const traces = [...gd.querySelectorAll('.scatterlayer .trace')];
const index = gd.data.findIndex((t) => t.name === 'nodes');
const nodes = traces[index];
const labels = [...nodes.querySelectorAll('.textpoint text')];
labels.forEach((e) => add('node', e));
const discs = [...nodes.querySelectorAll('.points path')].map(box);
return {svg: {l: svg.left, r: svg.right, t: svg.top, b: svg.bottom}, texts, discs, labels: labels.map(box),
        nodesLast: index === gd.data.filter((t) => t.type === 'scatter' || !t.type).length - 1,
        scroll: document.documentElement.scrollWidth, width: document.documentElement.clientWidth};
"""


def overlaps(texts: list[dict]) -> list[tuple[str, str]]:
    """Pairs of texts whose boxes overlap by more than half a pixel each way."""
    found = []
    for i, a in enumerate(texts):
        for b in texts[i + 1 :]:
            if min(a["r"], b["r"]) - max(a["l"], b["l"]) > 0.5 and min(a["b"], b["b"]) - max(a["t"], b["t"]) > 0.5:
                found.append((f"{a['kind']} {a['text']!r}", f"{b['kind']} {b['text']!r}"))
    return found


@pytest.mark.parametrize("width", [368, 620, 968, 1280])
def test_a_lesson_sized_circuit_reads_at_every_width(browser, tmp_path, width) -> None:
    # Failed before: at 368 px 345 pairs of labels overlapped, the title was cut, and edges crossed the labels.
    from selenium.webdriver.support.ui import WebDriverWait

    nodes, edges = lesson_sized_circuit()
    assert edges["edge"].nunique() == 40 and len(edges) > 40
    figure = circuit_figure(nodes, edges, n_layers=30, n_heads=9, title="The 40 edges of largest |EAP score|")
    page = tmp_path / f"circuit_{width}.html"
    html = figure.to_html(include_plotlyjs=True, full_html=True, default_width="100%", config={"responsive": True})
    files.write_text(page, html.replace("<body>", "<body style='margin: 0'>"))
    browser.set_window_size(width, 1000)
    try:
        browser.get(page.resolve().as_uri())
        WebDriverWait(browser, 60).until(
            lambda b: b.execute_script("return document.querySelectorAll('.js-plotly-plot .main-svg').length") > 0
        )
        seen = browser.execute_script(TEXTS)
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(ARTIFACTS / f"circuit_figure_{width}.png"))
    finally:
        browser.set_window_size(1400, 1000)
    assert abs(seen["width"] - width) <= 20, f"the window is {seen['width']} px wide, not {width}"
    assert seen["scroll"] <= seen["width"], f"the page scrolls sideways: {seen['scroll']} > {seen['width']}"
    assert not overlaps(seen["texts"]), overlaps(seen["texts"])[:10]
    svg = seen["svg"]
    outside = [
        t["kind"] + " " + repr(t["text"])
        for t in seen["texts"]
        if t["l"] < svg["l"] - 0.5 or t["r"] > svg["r"] + 0.5 or t["t"] < svg["t"] - 0.5 or t["b"] > svg["b"] + 0.5
    ]
    assert not outside, f"cut at the figure's edge: {outside}"  # fmt: skip
    # Every node label sits on its own disc, and the nodes are drawn after (over) every edge.
    assert seen["nodesLast"] and len(seen["labels"]) == len(seen["discs"]) == len(nodes)
    for label, disc in zip(seen["labels"], seen["discs"], strict=True):
        assert disc["l"] <= label["l"] + 0.5 and label["r"] <= disc["r"] + 0.5, (label, disc)
