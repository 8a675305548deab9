"""The documentation site as a reader meets it: built with ``--strict``, served offline, opened in Chromium.

The site is built once for this file, the way ``make docs`` builds it (``mkdocs build --strict``:
a broken link or anchor, a page missing from the nav or an API entry that does not resolve fails
the build, and the build's warnings are the failure message). Without a browser we check that
every public name has an entry in the API reference. In headless Chromium, served by a thread on
127.0.0.1: a page renders with its title and headings, its formulas are typeset by the site's own
MathJax, the search finds a word and links to the page holding it, one API entry shows the
function's signature and docstring, and nothing is requested from anywhere but that server.
Screenshots go to ``test-artifacts/docs/``.
"""

import functools
import http.server
import importlib
import inspect
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import ARTIFACTS
from helpers import CHROMEDRIVER, CHROMIUM, NO_CHROMIUM, ROOT, chromium_driver

FACES = (
    "contribution_lens",
    "contribution_lens.analyses",
    "contribution_lens.cli",
    "contribution_lens.faithfulness",
    "contribution_lens.methods",
    "contribution_lens.replication",
    "contribution_lens.views",
    "contribution_lens.views.inspector",
)
"""The package and its subpackages' faces: every name in their ``__all__`` is in the API reference."""
needs_chromium = pytest.mark.skipif(CHROMIUM is None or CHROMEDRIVER is None, reason=NO_CHROMIUM)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built as ``make docs`` builds it, into a temporary folder."""
    pytest.importorskip("mkdocs", reason="the documentation tools are dev extras: pip install -e '.[dev]'")
    target = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    # The hook that copies MathJax imports the package: the subprocess sees this source tree.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT / "src"), env.get("PYTHONPATH"))))
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(target)]
    built = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    warnings = [line for line in built.stderr.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert built.returncode == 0, "mkdocs build --strict failed:\n" + "\n".join(warnings or [built.stderr[-3000:]])
    return target


def test_the_site_has_every_page_of_the_nav_and_its_own_mathjax(site) -> None:
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)  # mkdocs's own tags (!relative)
    config = yaml.load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"), Loader=Loader)

    def pages(nav: Any) -> Iterator[str]:
        for entry in nav if isinstance(nav, list) else [nav]:
            if isinstance(entry, str):
                yield entry
            else:
                for value in entry.values():
                    yield from pages(value)

    sources = list(pages(config["nav"]))
    assert {"index.md", "maths.md", "results.md", "troubleshooting.md", "api/index.md"} <= set(sources)
    for source in sources:
        assert (site / source).with_suffix(".html").is_file(), f"{source} is in the nav but was not built"
    assert (site / "mathjax" / "MathJax.js").is_file() and (
        site / "mathjax" / "config" / "local" / "offline.js"
    ).is_file()


def test_the_readmes_links_lead_to_files_that_exist() -> None:
    """The README is outside the site's --strict build: its relative links are checked here."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    relative = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert len(relative) >= 15, relative  # the page table, the picture, CONTRIBUTING.md
    broken = [link for link in relative if not (ROOT / link).exists()]
    assert not broken, f"the README links to files that do not exist: {broken}"


def resolve(identifier: str) -> Any:
    """The object an API entry's anchor names (``contribution_lens.views.plot.token_heatmap``), else None."""
    parts = identifier.split(".")
    for split in range(len(parts), 0, -1):
        try:
            value: Any = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        try:
            for name in parts[split:]:
                value = getattr(value, name)
        except AttributeError:
            return None
        return value
    return None


def api_entries(site: Path) -> dict[str, Any]:
    """Every entry of the API reference, by its anchor, and the object it documents."""
    anchors = {
        anchor
        for page in (site / "api").glob("*.html")
        for anchor in re.findall(r'id="(contribution_lens(?:\.\w+)*)"', page.read_text(encoding="utf-8"))
    }
    return {anchor: resolve(anchor) for anchor in sorted(anchors)}


def test_every_public_name_has_an_api_entry(site) -> None:
    entries = api_entries(site)
    by_identity = {id(value) for value in entries.values() if value is not None}
    missing = []
    for face_name in FACES:
        face = importlib.import_module(face_name)
        for name in face.__all__:
            value = getattr(face, name)
            here = f"{face_name}.{name}"
            # A name exported from two faces (cl.Geometry, cl.analyses.Geometry) is documented once;
            # plain values (strings, numbers, tuples) must have an entry of their own name.
            shared = not isinstance(value, str | int | float | tuple | frozenset | type(None))
            if here not in entries and not (shared and id(value) in by_identity):
                missing.append(here)
    assert not missing, f"public names with no entry in docs/api/ (add a '::: name' line): {missing}"
    assert (
        entries["contribution_lens.attention_geometry"]
        is importlib.import_module("contribution_lens").attention_geometry
    )


@pytest.fixture(scope="module")
def server(site) -> Iterator[str]:
    """The built site over HTTP on 127.0.0.1 (the search index is fetched, which a file:// page cannot do)."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:  # the test's output stays the test's
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()
    httpd.server_close()
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def browser(tmp_path_factory) -> Iterator[Any]:
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip(NO_CHROMIUM)
    driver = chromium_driver(tmp_path_factory.mktemp("chromium-profile"))
    yield driver
    driver.quit()


def open_page(browser, url: str) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get_log("browser")  # drop what earlier pages logged
    browser.get(url)
    WebDriverWait(browser, 30).until(lambda b: b.execute_script("return document.readyState") == "complete")


def screenshot(browser, name: str) -> None:
    (ARTIFACTS / "docs").mkdir(parents=True, exist_ok=True)
    assert browser.save_screenshot(str(ARTIFACTS / "docs" / name))


def offsite_requests(browser) -> list[str]:
    return browser.execute_script(
        "return performance.getEntriesByType('resource').map(e => e.name)"
        ".filter(name => !name.startsWith(location.origin) && !name.startsWith('data:'))"
    )


def severe_errors(browser) -> list[dict]:
    # MathJax 2 declares a "MathJax_Blank" font at about:blank to time web-font loading; Chromium
    # logs refusing it, and nothing is missing from the page because of it.
    return [
        entry
        for entry in browser.get_log("browser")
        if entry["level"] == "SEVERE" and "about:blank" not in entry["message"]
    ]


def typeset(browser) -> list[dict]:
    """Every formula of the open page once MathJax is done: its TeX, whether it was drawn, its error."""
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(browser, 15).until(
        lambda b: b.execute_script("return !!(window.MathJax && MathJax.Hub)"),
        message="MathJax did not load from the site (site/mathjax/, copied by docs/_hooks/mathjax.py)",
    )
    WebDriverWait(browser, 60).until(
        lambda b: b.execute_script("return MathJax.Hub.queue.running === 0 && MathJax.Hub.queue.pending === 0"),
        message="MathJax loaded but did not finish typesetting the page",
    )
    # arithmatex marks each formula; MathJax 2 draws it into an element whose id ends in "-Frame",
    # and shows TeX it cannot read in a .noError (or .merror) box instead of failing.
    return browser.execute_script(
        "return [...document.querySelectorAll('.arithmatex')].map(el => {"
        " const frame = el.querySelector('[id$=\"-Frame\"]');"
        " const error = el.querySelector('.noError, .merror');"
        " return {tex: el.textContent.trim().slice(0, 120),"
        "         drawn: !!frame && frame.getBoundingClientRect().width > 0,"
        "         error: error ? error.textContent : null}; })"
    )


def assert_typeset(formulas: list[dict], page: str) -> None:
    undrawn = [formula["tex"] for formula in formulas if not formula["drawn"]]
    assert not undrawn, f"{page}: formulas left as raw TeX: {undrawn[:5]}"
    errors = [formula["error"] for formula in formulas if formula["error"] is not None]
    assert not errors, f"{page}: TeX that MathJax could not read: {errors[:5]}"


@needs_chromium
@pytest.mark.browser
def test_a_page_renders_with_typeset_formulas_and_no_network(browser, server) -> None:
    from selenium.webdriver.common.by import By

    source = (ROOT / "docs" / "maths.md").read_text(encoding="utf-8")
    title = source.splitlines()[0].removeprefix("# ")
    headings = re.findall(r"^## (.+)$", source, flags=re.M)
    open_page(browser, server + "maths.html")
    assert browser.title.startswith(title) and "contribution-lens" in browser.title, browser.title
    assert browser.find_element(By.CSS_SELECTOR, "article h1").text == title
    shown = [element.text for element in browser.find_elements(By.CSS_SELECTOR, "article h2")]
    assert shown == headings, f"the page shows {shown}, the source has {headings}"
    formulas = typeset(browser)
    assert len(formulas) >= 20, f"{len(formulas)} formulas on the maths page"
    assert_typeset(formulas, "maths.html")
    article = browser.find_element(By.TAG_NAME, "article").text
    assert "\\(" not in article and r"\alpha" not in article, "raw TeX is shown on the page"
    assert not offsite_requests(browser), offsite_requests(browser)
    assert not severe_errors(browser)
    screenshot(browser, "maths.png")


@needs_chromium
@pytest.mark.browser
def test_the_search_finds_a_word_and_links_to_its_page(browser, server) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    word = "Kobayashi"
    assert word in (ROOT / "docs" / "maths.md").read_text(encoding="utf-8")
    open_page(browser, server + "index.html")
    box = browser.find_element(By.CSS_SELECTOR, "input.md-search__input")
    box.click()
    box.send_keys(word)
    WebDriverWait(browser, 30).until(
        lambda b: b.find_elements(By.CSS_SELECTOR, ".md-search-result__item a[href*='maths.html']"),
        message=f"the search for {word!r} shows no result linking to maths.html",
    )
    results = browser.find_elements(By.CSS_SELECTOR, ".md-search-result__item")
    assert results and any(word in result.text for result in results), [result.text for result in results]
    meta = browser.find_element(By.CSS_SELECTOR, ".md-search-result__meta").text
    assert re.search(r"\d+ matching document", meta), meta
    screenshot(browser, "search.png")
    assert not offsite_requests(browser), offsite_requests(browser)
    assert not severe_errors(browser)


@needs_chromium
@pytest.mark.browser
def test_an_api_entry_shows_the_signature_and_the_docstring(browser, server) -> None:
    from selenium.webdriver.common.by import By

    import contribution_lens as cl

    function = cl.attention_geometry
    open_page(browser, server + "api/analyses.html#contribution_lens.attention_geometry")
    heading = browser.find_element(By.ID, "contribution_lens.attention_geometry")
    entry = heading.find_element(By.XPATH, "./ancestor::div[contains(@class, 'doc-object')][1]")
    assert "contribution_lens.attention_geometry" in heading.text, heading.text
    signature = entry.find_element(By.CSS_SELECTOR, ".doc-signature").text
    assert signature.startswith("attention_geometry("), signature
    for parameter in inspect.signature(function).parameters:
        assert parameter in signature, f"{parameter} is not in the signature shown: {signature}"
    contents = entry.find_element(By.CSS_SELECTOR, ".doc-contents").text
    summary = inspect.getdoc(function).splitlines()[0]
    assert summary in contents, f"{summary!r} is not in the entry"
    assert ">>> g = cl.attention_geometry(model" in contents  # the example, as code
    assert heading.is_displayed() and browser.execute_script("return window.scrollY") > 0  # the anchor was followed
    screenshot(browser, "api_entry.png")
    assert not severe_errors(browser)


@needs_chromium
@pytest.mark.browser
def test_every_formula_of_the_site_is_typeset(browser, server, site) -> None:
    pages = sorted(
        str(page.relative_to(site))
        for page in site.rglob("*.html")
        if 'class="arithmatex"' in page.read_text(encoding="utf-8")
    )
    assert {"index.html", "maths.html", "sinks.html", "faithfulness.html"} <= set(pages), pages
    for page in pages:
        open_page(browser, server + page)
        formulas = typeset(browser)
        assert formulas, f"{page} has formulas in its HTML and none on screen"
        assert_typeset(formulas, page)
        assert not severe_errors(browser), page
