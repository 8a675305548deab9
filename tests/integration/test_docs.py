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

import ast
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
from helpers import NEEDS_CHROMIUM, ROOT, docstring_ids

FACES = (
    "contribution_lens",
    "contribution_lens.analyses",
    "contribution_lens.circuits",
    "contribution_lens.cli",
    "contribution_lens.faithfulness",
    "contribution_lens.methods",
    "contribution_lens.replication",
    "contribution_lens.views",
    "contribution_lens.views.inspector",
)
"""The package and its subpackages' faces: every name in their ``__all__`` is in the API reference."""


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


TROUBLESHOOTING = ROOT / "docs" / "troubleshooting.md"
SPEAKER = re.compile(r"^(contribution-lens: error: |[A-Z]\w*Error: )")
"""What precedes a message on screen: the command's prefix, an exception's class."""
VALUES = re.compile(r"'[^']*'|\"[^\"]*\"|\[[^\]]*\]")
WORDS = re.compile(r"(?<![\w/.:=-])[A-Za-z]{3,}(?![\w/.=-])")


def prose(text: str) -> bool:
    """Whether ``text`` holds words of its own (three or more, quoted values and shapes aside)."""
    return len(WORDS.findall(VALUES.sub(" ", text))) >= 3


class CodeMessages:
    """Every message the package can write, read from its source: each string a pattern.

    An f-string's fields, and a ``{name}`` of a string formatted later, match any text; docstrings
    are left out (they quote messages, and may quote an old one). A field may hold prose only where
    that prose is itself in the code (a hint kept in a constant, another message passed on) or is a
    library's own error (``SafetensorError: ...``); what a field holds beyond that is not checked.
    """

    def __init__(self) -> None:
        self.patterns: list[re.Pattern[str]] = []
        self.long: list[re.Pattern[str]] = []  # at least 10 characters of their own
        self.tails: list[tuple[str, re.Pattern[str]]] = []  # f"{what}, got ..." of a helper that adds to a message
        pieces: set[str] = set()
        for path in sorted((ROOT / "src" / "contribution_lens").rglob("*.py")):
            for parts in self._strings(ast.parse(path.read_text(encoding="utf-8"))):
                literal = sum(len(part) for part in parts if part)
                pieces.update(part for part in parts if part and len(part.strip()) >= 8)
                if parts[0] is None and len(parts) > 1 and parts[1] and len(parts[1].strip()) >= 3:
                    self.tails.append((parts[1], self._pattern(parts[1:])))
                if literal >= 10:
                    self.long.append(self._pattern(parts))
                if literal >= 10 or None not in parts:
                    self.patterns.append(self._pattern(parts))
        self.pieces = sorted(
            pieces, key=len, reverse=True
        )  # the longest first: a piece inside another is not taken alone

    @staticmethod
    def _strings(tree: ast.AST) -> Iterator[list[str | None]]:
        """Each string of the code as its literal parts, None for a field."""
        docstrings = docstring_ids(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.JoinedStr):
                values: list[str | None] = [str(v.value) if isinstance(v, ast.Constant) else None for v in node.values]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                values = [node.value]
            else:
                continue
            parts: list[str | None] = []
            for value in values:  # "{chunk_length}" in a string formatted later is a field too
                for index, text in enumerate(re.split(r"\{\w*\}", value) if value is not None else [None]):
                    parts += ([None] if index else []) + ([text] if text != "" else [])
            yield parts or [""]

    @staticmethod
    def _pattern(parts: list[str | None]) -> re.Pattern[str]:
        return re.compile("".join(re.escape(part) if part is not None else "(.+?)" for part in parts), re.S)

    def _field_fits(self, text: str, depth: int) -> bool:
        if not prose(text) or SPEAKER.match(text):
            return True
        rest = text
        for piece in self.pieces:
            rest = rest.replace(piece, "\0")
        return not any(prose(gap) for gap in rest.split("\0")) or (depth > 0 and self.wrote(text, depth - 1))

    def _fits(self, pattern: re.Pattern[str], text: str, depth: int) -> bool:
        match = pattern.fullmatch(text)
        return match is not None and all(self._field_fits(field, depth) for field in match.groups())

    def wrote(self, message: str, depth: int = 1) -> bool:
        """Whether the code can write ``message``: one of its strings, or one passed through a helper's."""
        message = SPEAKER.sub("", message)
        if any(self._fits(pattern, message, depth) for pattern in self.patterns):
            return True
        return any(
            start
            and self._fits(tail, message[start:], depth)
            and any(self._fits(pattern, message[:start], depth) for pattern in self.long)
            for literal, tail in self.tails
            for start in (found.start() for found in re.finditer(re.escape(literal), message))
        )


def troubleshooting_messages() -> list[str]:
    """The messages of the troubleshooting tables: the code spans of each row's last cell that are prose."""
    messages = []
    for line in TROUBLESHOOTING.read_text(encoding="utf-8").splitlines():
        if line.startswith("| ") and not line.startswith(("| mistake", "|---")):
            said = line.rstrip(" |").split(" | ")[-1]
            messages += [span for span in re.findall(r"`([^`]+)`", said) if " " in span and prose(span)]
    return messages


NOT_THE_PACKAGES_PYTHON = {
    # JupyterLab's own words for a widget whose state the notebook did not save.
    "Error displaying widget: model not found": None,
    # argparse's own wording of a refused choice, with the package's "(see ... --help)".
    "contribution-lens: error: argument --size: invalid choice: 'huge' (choose from 'quick', 'paper') "
    "(see contribution-lens replicate --help)": "src/contribution_lens/cli/app.py:(see {self.prog} --help)",
    # Written by the inspector's page, in JavaScript or in HTML: a piece of its source, verbatim.
    "No answer from the kernel for 4 s: it is busy, or gone (restarted, shut down, or this notebook was reopened). "
    "This view is the last one drawn; run the cell again to explore it (the page of write_html needs no kernel).": (
        "src/contribution_lens/views/inspector/static/inspector.js:"
        's: it is busy, or gone (restarted, shut down, or this notebook "'
    ),
    "This viewer dropped the view named in its address (#layer=2&head=1): choose it in the menus, or open the page "
    "in a browser tab to see the view a link names.": (
        "src/contribution_lens/views/inspector/static/page.js:"
        '"or open the page in a browser tab to see the view a link names."'
    ),
    "query 3's panel was not embedded in this page (it carries queries 11): write it with write_html(..., "
    "why_queries=[3]), or open the live inspector, which computes it for the clicked cell.": (
        'src/contribution_lens/views/inspector/static/panels/why.js:panel was not embedded in this page (it carries "'
    ),
    "This page draws the inspector with JavaScript, which has not run. In JupyterLab's HTML viewer, press Trust "
    "HTML at the top of the viewer; elsewhere, open the file in a browser with scripts allowed.": (
        "src/contribution_lens/views/inspector/page.py:This page draws the inspector with JavaScript, which has"
    ),
}
"""Messages the troubleshooting page quotes that the package's Python strings do not hold whole, each with
``file:piece`` that its source holds (None: another program's words)."""


def test_every_troubleshooting_message_is_one_the_code_writes() -> None:
    code = CodeMessages()
    messages = troubleshooting_messages()
    assert len(messages) >= 50, messages  # both tables, their rows and their second messages
    root = Path(__file__).resolve().parents[2]
    for where in filter(None, NOT_THE_PACKAGES_PYTHON.values()):
        path, piece = where.split(":", 1)
        assert piece in (root / path).read_text(encoding="utf-8"), f"{path} no longer holds {piece!r}"
    stale = [message for message in messages if message not in NOT_THE_PACKAGES_PYTHON and not code.wrote(message)]
    assert not stale, "docs/troubleshooting.md quotes messages the code no longer writes:\n" + "\n".join(stale)
    # The check reads words, not only shapes: each of these differs from a message the code writes.
    for reworded in (
        "tokens must be at least 1, got -5",  # what the inspector said before its integer helper
        "pattern is in the meta device: it has a shape but no values (materialise it on a real device first)",
        "heads must be integer values, got float 1.0",
        "contribution-lens: error: --layer: expected a layer between -30 and 29 (smollm2-135m has 30 layers), got 99",
        "pattern must be 4-D [batch head query key] (hook_pattern), got shape (2, 4, 4) (please add a batch axis)",
    ):
        assert not code.wrote(reworded), reworded
    assert code.wrote(
        "contribution-lens: error: --layer: expected a layer from -30 to 29 (smollm2-135m has 30 layers), got 99"
    )


def resolve(identifier: str) -> Any:
    """The object an API entry's anchor names (``contribution_lens.drawing.plot.token_heatmap``), else None."""
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


@NEEDS_CHROMIUM
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


@NEEDS_CHROMIUM
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


@NEEDS_CHROMIUM
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


@NEEDS_CHROMIUM
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
