"""Imports run one way: every module imports only from its own layer or the layers below it.

The layers, bottom first, and why each sits where it does:

1. **maths** (`_lazy`, `_registry`, `_settings`, `files`, `choices`, `losses`, `decomposition`): tensors, files,
   settings and the one registry type; no model, no TransformerLens.
2. **adapter** (`adapter`): the one place that knows a TransformerLens model (hooks, ``W_O``, the readout, the
   hooks a circuit is patched through), one module a concern.
3. **engine** (`engine`, `mixing`, `interventions`, `loading`, `processes`): what runs on a model through the adapter:
   the per-layer pass, the per-layer token mixing, pattern edits, loading.
4. **drawing** (`drawing`: `plot`, `html`): figures and pages from tensors and tables. A figure function
   takes a result by what it offers (its type named under ``TYPE_CHECKING`` only), so every result's
   ``figures()`` and ``report()`` can draw with it: drawing sits *below* the results, not above them.
5. **analyses**: model-level results (`Geometry`, `Flow`, `LogitAttribution`, the sink studies) and their
   lifecycle (``save``/``load``, ``figures()``, ``report()``).
6. **methods**: the registry and the importance measures; a measure may be built on an analysis
   (``logit_attribution`` is), never the other way round.
7. **circuits**: tasks, the graph of heads and MLPs, circuit scores (a registry) and their evaluation by
   interchange patching; built on the analyses (logit attribution, the QK split) and the methods (ALTI).
8. **views**: what compares measures (the registry's `compare_measures`), the inspector, notebook export.
9. **faithfulness**: the causal harness, which scores every registered measure and draws its report.
10. **replication**: the paper's claims judged on one model, from the faithfulness runs and the sink
   study (it runs them; none of them knows it).
11. **cli**: the commands, thin wrappers of the layers below.
12. **face**: the package's own ``__init__`` and `_compat` (the 0.2 names): they name everything, lazily.

Every ``import`` counts wherever it is written, inside a function included: a function-level import
that climbs the layers is the same circle waiting for its first call. Imports under
``if TYPE_CHECKING:`` do not run and do not count. ``from package import name`` counts as an import of
``package.name`` where that is a module, else of the package's face.
"""

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import contribution_lens as cl

SRC = Path(cl.__file__).parent
PACKAGE = "contribution_lens"
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("maths", ("_lazy", "_registry", "_settings", "files", "choices", "losses", "decomposition", "qk", "tiles")),
    ("adapter", ("adapter",)),
    ("engine", ("engine", "mixing", "interventions", "loading", "processes")),
    ("drawing", ("drawing",)),
    ("analyses", ("analyses",)),
    ("methods", ("methods",)),
    ("circuits", ("circuits",)),
    ("views", ("views",)),
    ("faithfulness", ("faithfulness",)),
    ("replication", ("replication",)),
    ("cli", ("cli",)),
    ("face", ("", "_compat")),
)
"""Each layer's modules, named relative to the package (a name covers its submodules; ``""`` is the package)."""


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join((PACKAGE, *parts))


MODULES = {module_name(path): path for path in sorted(SRC.rglob("*.py"))}


def layer_of(module: str) -> int:
    """The index in `LAYERS` of ``module``: the layer whose longest name covers it."""
    relative = module.removeprefix(PACKAGE).removeprefix(".")
    best, best_length = None, -1
    for index, (_, names) in enumerate(LAYERS):
        for name in names:
            covers = relative == name or (name and relative.startswith(name + "."))
            if covers and len(name) > best_length:
                best, best_length = index, len(name)
    assert best is not None, f"{module} belongs to no layer: add it to LAYERS"
    return best


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_nodes(node: ast.AST) -> Iterator[ast.AST]:
    """Every node under ``node`` except the bodies of ``if TYPE_CHECKING:`` (their ``else`` runs)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child):
            for branch in child.orelse:
                yield branch
                yield from _runtime_nodes(branch)
            continue
        yield child
        yield from _runtime_nodes(child)


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def imports(module: str, *, module_level: bool = False) -> Iterator[tuple[int, str]]:
    """``(line, imported module)`` of every import of the package that runs, function-level ones included
    (``module_level``: only those that run when the module is imported)."""
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    nodes = tree.body if module_level else _runtime_nodes(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, node)
            targets = list(
                dict.fromkeys(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names)
            )
        else:
            continue
        for target in targets:
            if target == PACKAGE or target.startswith(PACKAGE + "."):
                # ``import a.b.c`` runs a.b.c; a name that is no module (a typo) fails elsewhere.
                while target not in MODULES and "." in target:
                    target = target.rpartition(".")[0]
                yield node.lineno, target


def test_every_module_is_in_one_layer() -> None:
    for module in MODULES:
        layer_of(module)


def test_imports_run_down_the_layers() -> None:
    upward = []
    for module in MODULES:
        here = layer_of(module)
        for line, target in imports(module):
            there = layer_of(target)
            if there > here:
                upward.append(f"{module}:{line} ({LAYERS[here][0]}) imports {target} ({LAYERS[there][0]})")
    assert not upward, "imports that climb the layers:\n" + "\n".join(upward)


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (as the modules along it), or None."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (found := visit(target)):
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_module_imports_itself_round_a_circle() -> None:
    graph = {module: {target for _, target in imports(module) if target != module} for module in MODULES}
    cycle = _cycle(graph)
    assert cycle is None, "an import circle: " + " -> ".join(cycle or [])


@pytest.mark.parametrize("face", sorted(m for m, p in MODULES.items() if p.name == "__init__.py"))
def test_a_face_imports_nothing_above_its_lowest_module(face: str) -> None:
    """Importing ``package.module`` runs ``package/__init__.py`` first, so a face sits, in effect, in the
    layer of its lowest module: the drawing's face, importing anything above drawing, would pull it into
    every ``from contribution_lens.drawing import plot`` an analysis makes."""
    lowest = min(layer_of(m) for m in MODULES if m == face or m.startswith(face + "."))
    ran = list(imports(face))
    if face == PACKAGE:
        # The package's face runs before any module of it: on import it runs `_lazy` and `_compat`, and they
        # import nothing of the package at module level (what they name is imported when it is read).
        lowest = 0
        ran = [hit for helper in (face, f"{PACKAGE}._compat") for hit in imports(helper, module_level=True)]
        ran = [(line, target) for line, target in ran if target != f"{PACKAGE}._compat"]
    above = [f"{target} ({LAYERS[layer_of(target)][0]})" for _, target in ran if layer_of(target) > lowest]
    assert not above, f"{face} runs imports above {LAYERS[lowest][0]}: {above}"


def test_the_layers_catch_a_circle(tmp_path, monkeypatch) -> None:
    """The order test fails on an import that climbs: here, a drawing module importing an analysis."""
    fake = tmp_path / "plot.py"
    fake.write_text("def f():\n    from contribution_lens.analyses.flow import Flow\n", encoding="utf-8")
    monkeypatch.setitem(MODULES, f"{PACKAGE}.drawing.plot", fake)
    with pytest.raises(AssertionError, match=r"drawing\.plot:2 \(drawing\) imports contribution_lens\.analyses\.flow "):
        test_imports_run_down_the_layers()


def _folder(module: str) -> str:
    """The folder a module sits in (its first-level subpackage), or the module itself at the package's top."""
    parts = module.split(".")[1:]
    return parts[0] if parts else "(face)"


def test_drawn_by_folder_the_package_has_no_circle_and_no_arrow_back_up() -> None:
    """The folders are the layers: importing a folder's module runs the folder's face first, so a folder sits at
    its lowest module's layer, and no folder imports one placed above it (`benchmarks/structure.py` measures
    the same)."""
    place: dict[str, int] = {}
    for module in MODULES:
        place[_folder(module)] = min(place.get(_folder(module), len(LAYERS)), layer_of(module))
    graph: dict[str, set[str]] = {folder: set() for folder in place}
    for module in MODULES:
        graph[_folder(module)] |= {_folder(target) for _, target in imports(module)} - {_folder(module)}
    up = [f"{a} -> {b}" for a, targets in graph.items() for b in targets if place[b] > place[a]]
    assert not up, f"arrows back up between folders: {up}"
    cycle = _cycle(graph)
    assert cycle is None, "a circle between folders: " + " -> ".join(cycle or [])
