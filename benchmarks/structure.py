"""The package's structure drawn by folder: folders, import arrows between them, circles, arrows back up, the
longest file; at any commit, measured the same way every time.

    python benchmarks/structure.py            # the working tree
    python benchmarks/structure.py 132264e    # any commit (read with ``git show``; nothing is checked out)

A *unit* is a folder of the package (a subpackage, with everything under it) or one of the flat modules at
its top (``engine.py``, ``_compat.py``); the package's own ``__init__.py`` is the unit ``(face)``. Imports are
read with ``ast`` as ``tests/test_import_order.py`` reads them: every ``import`` that runs, function-level
ones included, those under ``if TYPE_CHECKING:`` left out; ``from package import name`` is an import of
``package.name`` where that is a module. An *arrow* is one unit importing another; a *circle* is a set of
units that import each other round a loop (a strongly connected component of more than one unit); an
*arrow back up* is one from a unit to a unit placed above it, each unit placed at the lowest layer of its
modules in that commit's ``LAYERS`` (the import-order test's list): importing any module of a folder runs
the folder's face first, so a folder sits, in effect, where its lowest module does.
"""

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = "src/contribution_lens"
PACKAGE = "contribution_lens"


def read_tree(revision: str | None) -> dict[str, str]:
    """Path under the repository -> text, of every ``.py`` file under ``src/contribution_lens`` and the test."""
    wanted = lambda path: path.startswith(SRC + "/") and path.endswith(".py")  # noqa: E731
    test = "tests/test_import_order.py"
    if revision is None:
        return {
            str(path.relative_to(ROOT)): path.read_text(encoding="utf-8")
            for path in [*sorted((ROOT / SRC).rglob("*.py")), ROOT / test]
            if "__pycache__" not in path.parts
        }
    git = ["git", "-C", str(ROOT)]
    names = subprocess.run([*git, "ls-tree", "-r", "--name-only", revision], check=True, capture_output=True, text=True)
    paths = [*(path for path in names.stdout.splitlines() if wanted(path)), test]
    return {
        path: subprocess.run([*git, "show", f"{revision}:{path}"], check=True, capture_output=True, text=True).stdout
        for path in paths
    }


def module_name(path: str) -> str:
    parts = path.removeprefix(SRC + "/").removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join((PACKAGE, *parts))


def layers(test_source: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """``LAYERS`` of the import-order test, read from its source."""
    for node in ast.parse(test_source).body:
        if isinstance(node, ast.AnnAssign | ast.Assign):
            targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
            if any(isinstance(t, ast.Name) and t.id == "LAYERS" for t in targets) and node.value is not None:
                return ast.literal_eval(node.value)
    raise ValueError("no LAYERS in tests/test_import_order.py")


def layer_of(module: str, order: tuple[tuple[str, tuple[str, ...]], ...]) -> int:
    relative = module.removeprefix(PACKAGE).removeprefix(".")
    best, best_length = len(order), -1
    for index, (_, names) in enumerate(order):
        for name in names:
            covers = relative == name or (name and relative.startswith(name + "."))
            if covers and len(name) > best_length:
                best, best_length = index, len(name)
    return best


def _runtime_nodes(node: ast.AST) -> Iterator[ast.AST]:
    for child in ast.iter_child_nodes(node):
        test = child.test if isinstance(child, ast.If) else None
        if test is not None and (
            (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
        ):
            for branch in child.orelse:  # type: ignore[union-attr]
                yield branch
                yield from _runtime_nodes(branch)
            continue
        yield child
        yield from _runtime_nodes(child)


def imports(module: str, source: str, modules: dict[str, str]) -> Iterator[str]:
    """Every module of the package that ``module`` imports at run time."""
    for node in _runtime_nodes(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = module if modules[module].endswith("__init__.py") else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{node.module}" if node.module else package
            else:
                base = node.module or ""
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            if target == PACKAGE or target.startswith(PACKAGE + "."):
                while target not in modules and "." in target:
                    target = target.rpartition(".")[0]
                yield target


def unit_of(module: str) -> str:
    parts = module.split(".")[1:]
    return parts[0] if parts else "(face)"


def components(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            part = []
            while True:
                top = stack.pop()
                part.append(top)
                if top == node:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def measure(revision: str | None) -> dict[str, object]:
    files = read_tree(revision)
    order = layers(files.pop("tests/test_import_order.py"))
    modules = {module_name(path): path for path in files}
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        graph.setdefault(unit_of(module), set())
        for target in imports(module, files[path], modules):
            if unit_of(target) != unit_of(module):
                graph[unit_of(module)].add(unit_of(target))
    place = {
        unit: min(layer_of(m, order) for m in modules if unit_of(m) == unit) for unit in graph
    }  # the lowest layer of its modules
    back_up = sorted(
        f"{unit} ({order[place[unit]][0]}) -> {target} ({order[place[target]][0]})"
        for unit, targets in graph.items()
        for target in targets
        if place[target] > place[unit]
    )
    lengths = {path.removeprefix(SRC + "/"): len(text.splitlines()) for path, text in files.items()}
    longest = max(lengths, key=lambda path: lengths[path])
    folders = sorted({str(Path(path).parent) for path in lengths if "/" in path})
    return {
        "folders": len(folders) + 1,
        "folder names": folders,
        "units": len(graph),
        "arrows": sum(len(targets) for targets in graph.values()),
        "circles": components(graph),
        "arrows back up": back_up,
        "longest file": f"{longest} ({lengths[longest]} lines)",
        "modules": len(modules),
        "lines": sum(lengths.values()),
    }


if __name__ == "__main__":
    revision = sys.argv[1] if len(sys.argv) > 1 else None
    for key, value in measure(revision).items():
        if isinstance(value, list):
            print(f"{key}: {len(value)}")
            for item in value:
                print(f"    {item}")
        else:
            print(f"{key}: {value}")
