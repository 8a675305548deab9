"""Speed and size of the inspector on the bundled SmolLM2-135M (30 layers, 9 heads, 3 KV heads), CPU.

On a 512-token text: the widget's first view (one forward pass that decomposes every layer once
and cuts every window from it), then the time of every layer switch and every window switch
after it (they only send what is ready), for the default 128-token windows and for one
512-token window; the static page of all 30 layers at 512 tokens in the compact codec (size,
build time, the fine codec's size for comparison) and its error against the library's float32
numbers beside the stated bounds, and the memory headless Chromium needs to show it (Debian's
``chromium`` and ``chromedriver``; skipped where they are missing). In the browser: the time a
layer switch takes to draw (decode, factors, heatmap, bars) in windows of 128, 512 and 800 tokens
(fine codecs, as the widget sends them; all heads, and one head at 800), and the JS heap after it. The
*why* panel after the first view (``why``: one head's score split at the clicked cell, layer 29, the
costliest): the first view with and without the tape its pass records for the panel (and the tape's
size), then the first click on a head (its split from the tape, no pass), a click on another query of
that head, a repeated click, another head, an early layer, the first click in another window (from
the tape where it holds that window) and another head there, and the first click in another window
where the budget holds only the shown one's (one pass records it), each against a plain forward pass
of the text measured in the same run. Run:
``python benchmarks/bench_inspector.py`` (``... browser`` for the browser's table only, ``... why`` for
the why panel's only, ``... tokens`` for what ``insp.tokens = 800`` costs after the first view).
"""

import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import plotly.offline
import torch

import contribution_lens as cl
from contribution_lens.analyses.qk_attribution import QKTape
from contribution_lens.views.inspector import caches as caches_module
from contribution_lens.views.inspector import codecs, compact, payload, windows

DATA = Path(os.environ.get("CONTRIBUTION_LENS_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
SHARED = DATA / "fineweb_edu" / "sample-10BT_first150.jsonl"
TEXT = (
    " ".join(json.loads(line)["text"] for line in SHARED.read_text().splitlines()[:4])
    if SHARED.is_file()
    else " ".join(["The quick brown fox jumps over the lazy dog."] * 120)
)
N_TOKENS = 512
LONG_TOKENS = 800
SWITCH = """
const done = arguments[arguments.length - 1];
const [layer, head] = arguments;
const gd = document.querySelector('.cl-inspector .cl-heatmap');
const began = performance.now();
location.hash = '#layer=' + layer + '&head=' + head + '&factor=contribution&scope=inter';
const drawnTitle = 'L' + layer + (head === 'all' ? ',' : ' head ' + head);
(function check() {
  const title = (gd.layout && gd.layout.title && gd.layout.title.text) || '';
  const drawn = () => done(performance.now() - began);
  if (title.includes(drawnTitle)) requestAnimationFrame(() => requestAnimationFrame(drawn));
  else setTimeout(check, 2);
})();
"""


def timed(action) -> float:
    began = time.perf_counter()
    action()
    return time.perf_counter() - began


def widget(model, ids, tokens: int) -> None:
    inspector = None

    def first() -> None:
        nonlocal inspector
        inspector = cl.inspect(model, ids, layer=29, tokens=tokens)

    first_view = timed(first)
    assert inspector is not None
    layers = [timed(lambda layer=layer: setattr(inspector, "layer", layer)) for layer in range(30)]
    starts = [0, *range(tokens // 2, N_TOKENS - tokens + tokens // 2, tokens // 2)] if tokens < N_TOKENS else []
    windows = [timed(lambda start=start: setattr(inspector, "start", start)) for start in reversed(starts)]
    window_text = f"max {max(windows):.3f} s over {len(windows)} windows" if windows else "one window"
    print(
        f"| {tokens} | {first_view:.1f} | {max(layers):.4f} (median {statistics.median(layers):.4f}) "
        f"| {window_text} | {max(layers) / first_view:.1e} |"
    )


def page_errors(model, ids, data: dict, window: windows.Window) -> tuple[float, float, float]:
    """Largest |attention error|, |cosine error| and cosine bound over layers 0, 15 and 29 of the page."""
    attention_error = cosine_error = bound = 0.0
    rows, columns = np.nonzero(window.mask)
    for layer in (0, 15, 29):
        sent = data["layers"][str(layer)]
        got, raw = compact.decode_compact(sent, window), compact.unpack_compact(sent)
        truth = {s: cl.attention_geometry(model, ids, layers=[layer], scope=s)[layer] for s in cl.SCOPES}
        attention = windows.cut(truth["inter"].attention[0], window)
        attention_error = max(attention_error, float(np.abs(got["attention"] - attention).max()))
        key_scale = raw["key_scales"].reshape(9, -1)[:, columns]
        for scope in cl.SCOPES:
            query_scale = raw[f"query_{scope}_scales"].reshape(9, -1)[:, rows]
            cells_bound = compact.cosine_error_bound(query_scale, key_scale, sent["d_head"])
            error = np.abs(got[f"cosine_{scope}"] - windows.cut(truth[scope].cosine[0], window))
            assert (error <= cells_bound + 1e-6).all()
            cosine_error, bound = max(cosine_error, float(error.max())), max(bound, float(cells_bound.max()))
    return attention_error, cosine_error, bound


def _chromium_kb(root: int) -> int:
    """Resident memory of a process and all its descendants (Chromium's browser, GPU and renderer processes)."""
    children: dict[int, list[int]] = {}
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
        except OSError:
            continue
        children.setdefault(int(fields["PPid"]), []).append(int(status.parent.name))
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            rss = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmRSS:"))
            total += int(rss.split()[1])
        except (OSError, StopIteration):
            continue
    return total


def browser_memory(page: Path) -> tuple[float, float, float] | None:
    """MB of Chromium's processes on a blank page and on this page once drawn, and its JS heap MB (None: none)."""
    if not (shutil.which("chromium") and shutil.which("chromedriver")):
        return None
    from selenium import webdriver
    from selenium.webdriver.support.ui import WebDriverWait

    options = _chromium_options()
    service = webdriver.ChromeService(executable_path=shutil.which("chromedriver"))
    with tempfile.TemporaryDirectory() as profile:
        options.add_argument(f"--user-data-dir={profile}")
        driver = webdriver.Chrome(service=service, options=options)
        try:
            driver.get("about:blank")
            time.sleep(2)
            blank = _chromium_kb(service.process.pid)
            driver.get(page.resolve().as_uri())
            WebDriverWait(driver, 300).until(
                lambda d: d.execute_script("return document.querySelector('.cl-page-root').dataset.ready") == "true"
            )
            time.sleep(2)
            drawn = _chromium_kb(service.process.pid)
            driver.execute_cdp_cmd("Performance.enable", {})
            metrics = {m["name"]: m["value"] for m in driver.execute_cdp_cmd("Performance.getMetrics", {})["metrics"]}
        finally:
            driver.quit()
    return blank / 1024, drawn / 1024, metrics["JSHeapUsedSize"] / 2**20


def _chromium_options():
    """Headless Chromium's options for every browser measurement here (1400 x 1000, nothing in the background)."""
    from selenium import webdriver

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    flags = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run",
             "--disable-component-update", "--disable-sync", "--disable-quic", "--window-size=1400,1000")  # fmt: skip
    for flag in flags:
        options.add_argument(flag)
    return options


def _chromium():
    from selenium import webdriver

    service = webdriver.ChromeService(executable_path=shutil.which("chromedriver"))
    return webdriver.Chrome(service=service, options=_chromium_options())


def browser_layer_switch(model, ids, tokens: int, head: str = "all") -> None:
    """Headless Chromium: the worst of three layer switches drawn (two new layers, one kept), and the JS heap after."""
    from selenium.webdriver.support.ui import WebDriverWait

    inspector = cl.inspect(model, ids[:, :tokens], layers=[27, 28, 29], layer=29, tokens=tokens)
    with tempfile.TemporaryDirectory() as folder:
        path = inspector.write_html(Path(folder) / "switch.html", compact=False)
        driver = _chromium()
        try:
            driver.set_script_timeout(120)
            driver.get(path.resolve().as_uri())
            WebDriverWait(driver, 300).until(
                lambda d: d.execute_script("return document.querySelector('.cl-page-root').dataset.ready") == "true"
            )
            times = [driver.execute_async_script(SWITCH, layer, head) / 1000 for layer in (28, 27, 28)]
            driver.execute_cdp_cmd("HeapProfiler.collectGarbage", {})
            driver.execute_cdp_cmd("Performance.enable", {})
            metrics = {m["name"]: m["value"] for m in driver.execute_cdp_cmd("Performance.getMetrics", {})["metrics"]}
        finally:
            driver.quit()
    cells, shown = inspector.window.cells, f"{tokens}" if head == "all" else f"{tokens}, head {head}"
    print(
        f"| {shown} | {cells} | {max(times[:2]):.2f} (new layers: {times[0]:.2f}, {times[1]:.2f}) "
        f"| {times[2]:.2f} | {metrics['JSHeapUsedSize'] / 2**20:.0f} |"
    )


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def first_views(model, ids, repeats: int = 3) -> dict[str, float]:
    """The widget's first view with and without the why panel's tape, interleaved, best of ``repeats`` each."""
    n, budget = ids.shape[1], caches_module.WHY_TAPE_BYTES
    times: dict[str, list[float]] = {"with": [], "without": []}
    try:
        for _ in range(repeats):
            for kept, name in ((budget, "with"), (0, "without")):
                caches_module.WHY_TAPE_BYTES = kept
                began = time.perf_counter()
                inspector = cl.inspect(model, ids, layer=29, head=0, start=n - 128)
                times[name].append(time.perf_counter() - began)
                inspector.close()  # a closed widget is freed: each view allocates as a notebook's first does
                del inspector
                gc.collect()
    finally:
        caches_module.WHY_TAPE_BYTES = budget
    return {name: min(values) for name, values in times.items()}


def why_panel(model, ids) -> None:
    """The why panel's cost after the widget's first view, each click against a plain forward pass of ``ids``."""
    n = ids.shape[1]
    cl.inspect(model, ids[:, :32])  # warm: the block forms' probe, the first allocations
    views = first_views(model, ids)
    inspector = cl.inspect(model, ids, layer=29, head=0, tokens=128, start=n - 128)
    tape = inspector._splits.tape
    with torch.inference_mode():
        plain = min(timed(lambda: model(ids)) for _ in range(2))
    clicks = [
        ("first click on L29H0 (its split, from the first view's tape)", lambda: inspector.why(n - 1)),
        ("another query of L29H0", lambda: inspector.why(n - 2)),
        ("the same cell again", lambda: inspector.why(n - 1)),
        ("first click on L29H4 (another head)", lambda: inspector.why(n - 1, head=4)),
        ("first click on L3H0 (an early layer)", lambda: inspector.why(n - 1, layer=3, head=0)),
        ("first click in another window (start 0, query 63)", lambda: move_and_click(inspector, 0, 63)),
        ("another head in that window", lambda: inspector.why(63, head=5)),
    ]
    print(f"why panel, {n} tokens, {torch.get_num_threads()} torch threads; plain forward {plain:.3f} s; load {load()}")
    print(
        f"first view {views['with']:.2f} s with the tape ({tape.nbytes / 1e6:.0f} MB, {len(tape.rows)} query rows), "
        f"{views['without']:.2f} s without: {views['with'] / views['without']:.2f}x"
    )
    print("| click | s | / plain forward |")
    print("|---|---|---|")
    for name, click in clicks:
        took = timed(click)
        print(f"| {name} | {took:.3f} | {took / plain:.2f}x |")
    print(f"| first click in a window off the tape (room for one window: one pass records it) | "
          f"{(off := off_the_tape(model, ids)):.3f} | {off / plain:.2f}x |")  # fmt: skip
    print(f"load average after: {load()}")


def off_the_tape(model, ids) -> float:
    """The first click in another window where the budget holds only the shown window's queries."""
    n, budget = ids.shape[1], caches_module.WHY_TAPE_BYTES
    caches_module.WHY_TAPE_BYTES = QKTape.estimate_bytes(model, n, 128, model.cfg.n_layers - 1)
    try:
        inspector = cl.inspect(model, ids, layer=29, head=0, start=n - 128)
        took = timed(lambda: move_and_click(inspector, 0, 63))
        inspector.close()
    finally:
        caches_module.WHY_TAPE_BYTES = budget
    return took


def new_tokens(model, long_ids) -> None:
    """What ``insp.tokens = 800`` costs after the default first view (128 tokens) of an 800-token text.

    Wall-clock and this process's CPU time: on a machine shared with other jobs the CPU time is the steadier.
    """
    n = long_ids.shape[1]
    cl.inspect(model, long_ids[:, :32]).close()  # warm: the block forms' probe, the first allocations

    def both(action) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        action()
        return time.perf_counter() - wall, time.process_time() - cpu

    with torch.inference_mode():
        plain = min(both(lambda: model(long_ids)) for _ in range(2))
    print(f"insp.tokens = {n}, {n}-token text, {torch.get_num_threads()} torch threads; load {load()}")
    shown: list = []
    first = both(lambda: shown.append(cl.inspect(model, long_ids, layer=29)))
    inspector = shown[0]
    change = both(lambda: setattr(inspector, "tokens", n))
    again = both(lambda: setattr(inspector, "layer", 3))
    print("| step | wall s | CPU s | CPU / plain forward's |")
    print("|---|---|---|---|")
    rows = [
        (f"plain forward pass of the {n} tokens", plain),
        (f"first view (default {windows.DEFAULT_TOKENS}-token windows)", first),
        (f"insp.tokens = {n} (one pass: every layer decomposed again)", change),
        ("then insp.layer = 3 (sent from what that pass kept)", again),
    ]
    for name, (wall, cpu) in rows:
        print(f"| {name} | {wall:.2f} | {cpu:.2f} | {cpu / plain[1]:.2f}x |")
    print(f"load average after: {load()}")
    inspector.close()


def move_and_click(inspector, start: int, query: int) -> None:
    inspector.start = start  # a precomputed window's payload: no pass
    inspector.why(query)


def main() -> None:
    model = cl.load_model()
    long_ids = cl.to_token_batch(model, TEXT).tokens[:, :LONG_TOKENS]
    ids = long_ids[:, :N_TOKENS]
    print(f"load average {load()}")
    if sys.argv[1:] == ["why"]:  # the why panel's table only, at the machine's thread count (as a notebook runs)
        why_panel(model, ids)
        return
    if sys.argv[1:] == ["tokens"]:  # a new window size only, at the machine's thread count (as a notebook runs)
        new_tokens(model, long_ids)
        return
    torch.set_num_threads(1)
    if shutil.which("chromium") and shutil.which("chromedriver"):
        print("headless Chromium, a layer switch drawn (the page's layers in fine codecs, as the widget sends them):")
        print("| window tokens | cells | layer switch s, new layer (worst of 2) | switch s, kept layer | JS heap MB |")
        print("|---|---|---|---|---|")
        for tokens in (128, 512, LONG_TOKENS):
            browser_layer_switch(model, long_ids, tokens)
        browser_layer_switch(model, long_ids, LONG_TOKENS, head="2")  # one head: its own arrays decoded
    if sys.argv[1:] == ["browser"]:  # the browser's table only
        return
    print(f"bundled SmolLM2-135M, CPU, one torch thread; a {N_TOKENS}-token text; the widget opens on layer 29")
    print("| window tokens | first view s | layer switch s, worst of 30 | window switch | worst switch / first view |")
    print("|---|---|---|---|---|")
    for tokens in (128, 512):
        widget(model, ids, tokens)
    inspector = cl.inspect(model, ids, layer=29, tokens=8)
    window = windows.token_window(N_TOKENS, tokens=N_TOKENS)
    fine = payload.payload_bytes(window, 9, 3) * 30 + len(plotly.offline.get_plotlyjs())
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "inspect.html"
        built = timed(lambda: inspector.write_html(path, tokens=N_TOKENS))
        size = path.stat().st_size
        html = path.read_text()
        memory = browser_memory(path)
    data = json.loads(html.split("class='cl-data'>")[1].split("</script>")[0].replace("<\\/", "</"))
    attention_error, cosine_error, bound = page_errors(model, ids, data, window)
    print(
        f"page, all 30 layers, {N_TOKENS} tokens, compact: {size / 1e6:.1f} MB "
        f"(fine codecs with the KV-group arrays: about {fine / 1e6:.0f} MB), "
        f"built in {built:.1f} s; opens on query {data['meta']['initial']['query']}"
    )
    print(
        f"page error (layers 0, 15, 29): |attention| {attention_error:.2e} "
        f"(bound {codecs.COMPACT_ATTENTION_ERROR:.2e}), "
        f"|cosine| {cosine_error:.2e} (bound of the worst cell {bound:.2e})"
    )
    if memory is None:
        print("browser memory: not measured (needs Debian's chromium and chromedriver)")
    else:
        blank, drawn, heap = memory
        print(
            f"headless Chromium showing the page (layer 29 drawn): {drawn:.0f} MB in all its processes "
            f"({drawn - blank:.0f} MB more than a blank page), JS heap {heap:.0f} MB"
        )


if __name__ == "__main__":
    main()
