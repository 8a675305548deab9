"""The HTML the package writes, opened in headless Chromium: renders offline, draws SVG, no console errors."""

import shutil
from pathlib import Path

import pytest

import contribution_lens as cl
from conftest import ARTIFACTS, assert_self_contained
from contribution_lens import report

CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")
pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(
        CHROMIUM is None or CHROMEDRIVER is None,
        reason="needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)",
    ),
]


@pytest.fixture(scope="module")
def browser():
    webdriver = pytest.importorskip("selenium.webdriver")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--window-size=1400,1000",
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path=CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


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
    from contribution_lens import evaluation, faithfulness

    protocol = faithfulness.Protocol(methods=("attention", "contribution"), ratios=(0.0, 0.5))
    config = evaluation.RunConfig(
        lm=(f"gsm8k={shared_data / 'gsm8k' / 'test.jsonl'}",), chunk_length=32, max_chunks=2, batch_size=2
    )
    evaluation.run_faithfulness(bundled_model, config, protocol, tmp_path, progress=False)
    page = tmp_path / "report.html"
    assert_self_contained(page.read_text())
    open_and_check(browser, page, "faithfulness_report.png", min_plots=2)


def test_inspector_renders_and_its_controls_work(browser, bundled_model, tmp_path) -> None:
    figure = cl.inspect(bundled_model, "When Mary and John went to the store, John gave a drink to", layers=[2, 9])
    page = report.write_html(tmp_path / "inspect.html", "inspector", [("inspector", figure)])
    assert_self_contained(page.read_text())
    open_and_check(browser, page, "inspector.png", min_plots=1)
    # Move the layer slider and pick another head: the visible heatmap must change.
    before = browser.execute_script(
        "return document.querySelector('.js-plotly-plot').data.filter(t => t.visible === true).length"
    )
    browser.execute_script(
        "const gd = document.querySelector('.js-plotly-plot');"
        "const step = gd.layout.sliders[0].steps[0]; Plotly.restyle(gd, step.args[0]);"
        "Plotly.relayout(gd, gd.layout.updatemenus[0].buttons[3].args[0]);"
    )
    visible_layer_traces = browser.execute_script(
        "const gd = document.querySelector('.js-plotly-plot'); return gd.data.filter(t => t.visible === true).length"
    )
    assert before == visible_layer_traces == 10 * 7  # one layer's traces: (9 heads + all) x 7 views
    domain = browser.execute_script("return document.querySelector('.js-plotly-plot').layout.xaxis4.domain")
    assert domain == [0, 0.9]
    errors = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert not errors, errors
    browser.save_screenshot(str(ARTIFACTS / "inspector_head3_layer2.png"))
