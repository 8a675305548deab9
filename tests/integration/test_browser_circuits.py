"""The circuit figure in headless Chromium: the edges drawn, their hover text, two circuits drawn differently."""

import pandas as pd
import pytest

from conftest import ARTIFACTS
from contribution_lens import files
from contribution_lens.circuits.figures import circuit_figure
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
