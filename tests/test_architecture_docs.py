"""The architecture's docs cannot drift from the code: docs/package.md's tables name every module of the
package (and no module that is not there), the layer order printed in docs/package.md and CONTRIBUTING.md is
the import-order test's, CONTRIBUTING.md's recipe for a new analysis names every place one touches, and each
registry's guide names every built-in the registry declares."""

import re
from pathlib import Path

import pytest

import contribution_lens as cl
from helpers import ROOT
from test_import_order import LAYERS, PACKAGE, SRC, layer_of

PACKAGE_DOC = ROOT / "docs" / "package.md"
CONTRIBUTING = ROOT / "CONTRIBUTING.md"
SECTIONS = {"views/inspector": "The inspector", "views/inspector/static": "The inspector"}
"""Folders whose modules are listed by file name in the tables of their own section of docs/package.md."""
CODE = re.compile(r"`([^`]+)`")


def _rows(text: str) -> list[list[str]]:
    """The cells of every table row of a markdown text (header and separator rows left out)."""
    rows = []
    for line in text.splitlines():
        if line.startswith("|") and not re.fullmatch(r"\|[-| ]+\|", line):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return [row for row in rows if row[0] not in ("place", "layer", "module", "file", "JavaScript", "field")]


def _section(text: str, heading: str) -> str:
    start = text.index(f"## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else len(text)]


def _documented_files(folder: str, text: str) -> set[str]:
    """The file names docs/package.md's tables give ``folder`` (relative to the package; ``""`` is its top)."""
    if folder in SECTIONS:
        rows = _rows(_section(text, SECTIONS[folder]))
        return {name for row in rows for name in CODE.findall(row[0])}
    rows = _rows(_section(text, "The layout"))
    if not folder:
        return {name for row in rows for name in CODE.findall(row[0]) if not name.endswith("/")}
    return {
        name.rpartition("/")[2]
        for row in rows
        if f"`{folder}/`" in row[0]
        for cell in row[1:]
        for name in CODE.findall(cell)
        if re.fullmatch(r"[\w/]+\.(py|js)", name)
    }


def _package_files() -> dict[str, set[str]]:
    """Folder (relative to the package) -> the modules and front-end files in it (faces left out; a ``__main__.py``
    is a module like any other, and is named)."""
    files: dict[str, set[str]] = {}
    for path in [*SRC.rglob("*.py"), *SRC.rglob("*.js")]:
        relative = path.relative_to(SRC)
        if "__pycache__" in relative.parts or path.name in ("__init__.py", "types.js"):
            continue
        files.setdefault(str(relative.parent).replace(".", ""), set()).add(path.name)
    return files


def test_every_module_is_in_the_architecture_tables_and_every_one_named_there_exists() -> None:
    text = PACKAGE_DOC.read_text(encoding="utf-8")
    missing, absent = [], []
    for folder, names in sorted(_package_files().items()):
        if not folder:
            # The top's private helpers (`_lazy`, `_compat`, ...) are named in the layers' table instead.
            layers = {name for row in _rows(_section(text, "Layers: which module may import which")) for name in row}
            names = {name for name in names if not (name.startswith("_") and f"`{name[:-3]}`" in str(layers))}
        documented = _documented_files(folder, text)
        missing += [f"{folder}/{name}".lstrip("/") for name in sorted(names - documented)]
        if folder and folder not in SECTIONS:
            absent += [f"{folder}/{name}" for name in sorted(documented - names)]
    assert not missing, f"modules docs/package.md's tables do not name (add them): {missing}"
    assert not absent, f"files docs/package.md's tables name that do not exist: {absent}"


def _printed_layers(text: str) -> list[tuple[str, list[str]]]:
    """``(layer, module names)`` of each row of docs/package.md's layers table."""
    rows = _rows(_section(text, "Layers: which module may import which"))
    return [(row[0], [m.removesuffix(".*") for m in CODE.findall(row[1]) if not m.endswith(".py")]) for row in rows]


def test_the_layers_printed_in_docs_package_md_are_the_import_order_tests() -> None:
    printed = _printed_layers(PACKAGE_DOC.read_text(encoding="utf-8"))
    assert [name for name, _ in printed] == [name for name, _ in LAYERS]
    for index, (name, modules) in enumerate(printed):
        for module in modules:
            full = f"{PACKAGE}.{module}".removesuffix(f".{PACKAGE}")
            assert layer_of(full) == index, f"docs/package.md puts {module} in {name}; the import-order test does not"


def test_the_layer_order_in_contributing_md_is_the_import_order_tests() -> None:
    text = CONTRIBUTING.read_text(encoding="utf-8")
    start = text.index("Imports run one way")
    sentence = " ".join(text[text.index(":", start) + 1 : text.index(". ", start)].split())
    printed = [re.sub(r"[`\s]", " ", part).split()[0] for part in re.sub(r"\([^)]*\)", "", sentence).split(" < ")]
    assert printed == [name for name, _ in LAYERS], sentence


def _lists_of_analyses() -> set[str]:
    """Files that name every analysis's result type: the lists a new analysis joins."""
    results = [
        name
        for name, location in cl._EXPORTS.items()
        if location.startswith(f"{PACKAGE}.analyses.") and hasattr(getattr(cl, name), "save")
    ]
    places = set()
    candidates = [*SRC.rglob("*.py"), *(ROOT / "docs").rglob("*.md"), *(ROOT / "tests").rglob("*.py")]
    for path in candidates:
        text = path.read_text(encoding="utf-8")
        if path.name != Path(__file__).name and all(re.search(rf"\b{name}\b", text) for name in results):
            places.add(str(path.relative_to(ROOT)).removeprefix(f"src/{PACKAGE}/"))
    return places


def test_the_recipe_for_an_analysis_names_every_place_one_touches() -> None:
    """A new analysis joins every list of the analyses (found here: the files naming every result type) and
    draws in `drawing/plot.py`; CONTRIBUTING.md's row for it names each of them."""
    text = CONTRIBUTING.read_text(encoding="utf-8")
    row = next(line for line in text.splitlines() if line.startswith("| an analysis |"))
    places = _lists_of_analyses() | {"drawing/plot.py"}
    assert {"analyses/__init__.py", "__init__.py", "tests/test_files.py", "docs/api/analyses.md"} <= places
    unnamed = sorted(place for place in places if f"`{place}`" not in row and f"/{place}`" not in row)
    assert not unnamed, f"CONTRIBUTING.md's recipe for an analysis does not name: {unnamed}"


def test_the_docstrings_that_list_a_set_name_all_of_it() -> None:
    """The command line's face names every command, the registry every family that registers itself."""
    from contribution_lens import cli
    from contribution_lens.cli.app import COMMANDS
    from contribution_lens.methods import registry

    assert cli.__doc__ and all(f"``{name}``" in cli.__doc__ for name in COMMANDS), cli.__doc__
    families = [location.partition(":")[0].rpartition(".")[2] for location in registry.METHODS.declared]
    assert registry.__doc__ and all(f"``{name}``" in registry.__doc__ for name in families), families


@pytest.mark.parametrize(
    ("registry", "page", "heading", "written"),
    [
        ("contribution_lens.methods.registry:METHODS", "maths.md", "The registered measures", "`{}`"),
        ("contribution_lens.circuits.registry:CIRCUIT_METHODS", "circuits.md", "The methods", "**`{}`**"),
        ("contribution_lens.faithfulness.registry:PROTOCOLS", "faithfulness.md", "Removal protocols", "| `{}` |"),
    ],
)
def test_each_registrys_guide_names_every_built_in(registry: str, page: str, heading: str, written: str) -> None:
    """The names a guide gives are the registry's: a built-in added to a registry is described in its guide."""
    from contribution_lens._lazy import resolve

    section = _section((ROOT / "docs" / page).read_text(encoding="utf-8"), heading)
    unnamed = [name for name in resolve(registry) if written.format(name) not in section]
    assert not unnamed, f"docs/{page}'s section {heading!r} does not name: {unnamed}"
