"""Size and speed of the inspector on the bundled SmolLM2-135M (30 layers, 9 heads), CPU.

For 64, 128, 256 and 512 tokens: the static page with every layer and the whole text as its
token window (total size, size beyond plotly.js, payload bytes per displayable cell counting the
attention plus three factors in two scopes for every layer, head and causal pair, build time),
and the widget (first payload, with its default 128-token window; time to switch layer, which
runs the model; head, factor and scope switches run in the front-end only, from the payload
already sent). Run: ``python benchmarks/bench_inspector.py``.
"""

import json
import shutil
import tempfile
import time
from pathlib import Path

import plotly.offline

import contribution_lens as cl

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "fineweb_edu" / "sample-10BT_first150.jsonl"
TEXT = (
    json.loads(SHARED.read_text().splitlines()[0])["text"]
    if SHARED.is_file()
    else " ".join(["The quick brown fox jumps over the lazy dog."] * 80)
)
PLOTLY_BYTES = len(plotly.offline.get_plotlyjs().encode())
SWITCH = """
const views = [['head', '3'], ['factor', 'cosine'], ['scope', 'intra'], ['head', 'all'], ['factor', 'attention']];
const times = [];
for (const [name, value] of views) {
  const t0 = performance.now();
  const node = document.getElementById('cl-' + name);
  node.value = value;
  node.dispatchEvent(new Event('change'));
  times.push(performance.now() - t0);
}
return times.reduce((a, b) => a + b) / times.length;
"""


def browser():
    """Headless Chromium, or None where Debian's chromium and chromium-driver are missing."""
    if shutil.which("chromium") is None or shutil.which("chromedriver") is None:
        return None
    from selenium import webdriver

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"):  # fmt: skip
        options.add_argument(flag)
    service = webdriver.ChromeService(executable_path=shutil.which("chromedriver"))
    return webdriver.Chrome(service=service, options=options)


def front_end_switch_ms(driver, page: Path) -> float:
    """Mean time of a head, factor or scope switch in the page (decode once, then derive and redraw)."""
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(page.resolve().as_uri())
    WebDriverWait(driver, 300).until(
        lambda d: d.execute_script("return document.getElementById('cl-root').dataset.ready") == "true"
    )
    return driver.execute_script(SWITCH)


def main() -> None:
    model = cl.load_model()
    all_tokens = cl.to_token_batch(model, TEXT).tokens
    print(f"bundled SmolLM2-135M, CPU; plotly.js is {PLOTLY_BYTES / 1e6:.2f} MB, embedded once per page")
    print("widget: 128-token window (the default); layer switch runs the model up to that layer (first visit),")
    print("head/factor/scope switch is front-end only (same JS as the page, timed in headless Chromium)")
    print("| tokens | page MB | page MB beyond plotly.js | bytes / displayable cell | page build s "
          "| widget first payload KB | layer switch s (L7 / L15 / L29) | head/factor/scope switch ms (widget window) "
          "| same, whole-text page window |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    driver = browser()
    with tempfile.TemporaryDirectory() as folder:
        for n in (64, 128, 256, 512):
            ids = all_tokens[:, :n]
            inspector = cl.inspect(model, ids, layer=0)
            first = len(json.dumps({"meta": inspector.meta, "payload": inspector.payload}).encode())
            switches = []
            for layer in (7, 15, 29):
                began = time.perf_counter()
                inspector.layer = layer
                switches.append(time.perf_counter() - began)
            widget_ms = page_ms = float("nan")
            if driver is not None:
                one = inspector.write_html(Path(folder) / "one.html", layers=[29])
                widget_ms = front_end_switch_ms(driver, one)
                one = inspector.write_html(Path(folder) / "one.html", layers=[29], tokens=n)
                page_ms = front_end_switch_ms(driver, one)
            began = time.perf_counter()
            path = inspector.write_html(Path(folder) / f"inspect{n}.html", tokens=n)
            built = time.perf_counter() - began
            size = path.stat().st_size
            cells = 30 * 9 * (n * (n + 1) // 2) * 7
            print(
                f"| {n} | {size / 1e6:.1f} | {(size - PLOTLY_BYTES) / 1e6:.2f} | {(size - PLOTLY_BYTES) / cells:.3f} "
                f"| {built:.1f} | {first / 1e3:.0f} | {' / '.join(f'{t:.2f}' for t in switches)} "
                f"| {widget_ms:.0f} | {page_ms:.0f} |"
            )
            path.unlink()
    if driver is not None:
        driver.quit()


if __name__ == "__main__":
    main()
