"""The one registry type under the importance measures, the circuit methods and the removal protocols."""

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from contribution_lens._registry import Registry


@dataclass(frozen=True)
class Entry:
    name: str
    size: int = 0


@pytest.fixture
def family(tmp_path, monkeypatch) -> str:
    """A module of built-ins that no test has imported yet: its name, on ``sys.path``."""
    name = f"registry_family_{tmp_path.name.replace('-', '_')}"
    source = "from test_registry_type import Entry\nENTRIES = (Entry('small', 1), Entry('large', 9))\n"
    (tmp_path / f"{name}.py").write_text(source, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_names_are_listed_without_importing_the_built_ins_and_read_on_first_use(family) -> None:
    registry: Registry[Entry] = Registry("thing", {f"{family}:ENTRIES": ("small", "large")})
    registry.add(Entry("mine", 3))
    assert list(registry) == ["small", "large", "mine"] and len(registry) == 3
    assert "large" in registry and "other" not in registry and registry.is_builtin("small")
    assert not registry.is_builtin("mine")
    assert family not in sys.modules, "listing the names imported the built-ins"
    assert registry["large"] == Entry("large", 9)
    assert family in sys.modules
    assert [entry.size for entry in registry.values()] == [1, 9, 3]


def test_a_built_in_module_that_holds_other_names_than_declared_is_refused(family) -> None:
    registry: Registry[Entry] = Registry("thing", {f"{family}:ENTRIES": ("small", "medium")})
    with pytest.raises(RuntimeError, match=rf"{family}:ENTRIES holds the things \('small', 'large'\); the registry "):
        registry["small"]


def test_a_name_declared_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="the thing 'small' is declared twice: in a:X and b:Y"):
        Registry("thing", {"a:X": ("small",), "b:Y": ("small",)})


def test_add_replace_and_the_built_ins_protection(family) -> None:
    registry: Registry[Entry] = Registry("thing", {f"{family}:ENTRIES": ("small", "large")})
    registry.add(Entry("mine", 1))
    with pytest.raises(ValueError, match=r"^a thing named 'mine' is already registered; pass replace=True to replace"):
        registry.add(Entry("mine", 2))
    registry.add(Entry("mine", 2), replace=True)
    assert registry["mine"].size == 2
    with pytest.raises(ValueError, match=r"^a thing named 'small' is already registered; it is built in$"):
        registry.add(Entry("small", 5), replace=True)
    assert family not in sys.modules, "a built-in's name is protected without importing it"
    with pytest.raises(ValueError, match=r"^'small' is built in and cannot be unregistered$"):
        registry.unregister("small")
    registry.unregister("mine")
    assert "mine" not in registry
    with pytest.raises(KeyError, match="no thing named 'mine' is registered"):
        registry.unregister("mine")


def test_an_unknown_name_lists_the_registered_ones_and_the_nearest() -> None:
    registry: Registry[Entry] = Registry("colour", {}, listing="known")
    for name in ("red", "green", "blue"):
        registry.add(Entry(name))
    with pytest.raises(ValueError) as error:
        registry.lookup("gren")
    assert str(error.value) == "unknown colour 'gren'; known: red, green, blue; did you mean 'green'?"
    with pytest.raises(KeyError, match="unknown colour 'purple'; known: red, green, blue"):
        registry["purple"]
    assert Registry("colour", {}).unknown("x") == "unknown colour 'x'; registered colours: "


def test_the_check_runs_on_every_entry_taken_the_built_ins_included(family) -> None:
    seen = []

    def check(entry: Entry) -> None:
        seen.append(entry.name)
        if entry.size > 5:
            raise ValueError(f"{entry.name} is too large")

    registry: Registry[Entry] = Registry("thing", {f"{family}:ENTRIES": ("small", "large")}, check=check)
    registry.add(Entry("mine", 1))
    with pytest.raises(ValueError, match=r"^huge is too large$"):
        registry.add(Entry("huge", 6))
    assert "huge" not in registry
    with pytest.raises(ValueError, match=r"^large is too large$"):
        registry["small"]
    assert seen == ["mine", "huge", "small", "large"]


@pytest.mark.usefixtures("as_a_user")
def test_an_entry_without_a_name_is_refused() -> None:
    registry: Registry[Entry] = Registry("thing", {})
    with pytest.raises(ValueError, match=r"^a thing needs a name, got Entry with name ''$"):
        registry.add(Entry(""))
    with pytest.raises(ValueError, match=r"^a thing needs a name, got str with name None$"):
        registry.add("small")  # type: ignore[arg-type]


def test_the_decorator_registers_what_it_makes_and_returns_the_function() -> None:
    registry: Registry[Entry] = Registry("thing", {})

    @registry.decorator(lambda function: Entry(function.__name__, function()))
    def seven() -> int:
        return 7

    assert seven() == 7 and registry["seven"] == Entry("seven", 7)


@pytest.mark.parametrize(
    ("module", "registry", "listed"),
    [
        ("contribution_lens.methods.registry", "METHODS", "contribution_lens.methods.factors"),
        ("contribution_lens.circuits.registry", "CIRCUIT_METHODS", "contribution_lens.circuits.attribution"),
        ("contribution_lens.faithfulness.registry", "PROTOCOLS", "contribution_lens.faithfulness.protocols"),
    ],
)
def test_the_packages_registries_list_their_names_without_torch(module: str, registry: str, listed: str) -> None:
    """Each registry's names come from its declaration alone: no family, and no torch, is imported to list them."""
    import subprocess

    code = (
        f"import sys\nfrom {module} import {registry}\nnames = list({registry})\n"
        f"print(len(names), 'torch' in sys.modules, {listed!r} in sys.modules)"
    )
    src = Path(__file__).resolve().parents[1] / "src"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=src, timeout=120)
    assert result.returncode == 0, result.stderr
    count, torch_imported, family_imported = result.stdout.split()
    assert int(count) >= 4 and torch_imported == "False" and family_imported == "False"


@dataclass(frozen=True)
class Scorer:
    name: str
    score_fn: object = None


def test_calls_are_checked_when_an_entry_is_taken_not_when_it_is_first_used() -> None:
    registry: Registry[Scorer] = Registry("scorer", {}, calls={"score_fn": "model, task, context"})
    registry.add(Scorer("three", lambda model, task, context: 0))
    registry.add(Scorer("many", lambda *args: 0))  # takes three as well
    with pytest.raises(ValueError) as error:
        registry.add(Scorer("text", "eap"))
    assert (
        str(error.value) == "score_fn: a scorer's score_fn is called as score_fn(model, task, context); got str 'eap'"
    )

    def two(model, task):
        return 0

    with pytest.raises(ValueError) as error:
        registry.add(Scorer("two", two))
    assert str(error.value) == (
        "score_fn: a scorer's score_fn is called as score_fn(model, task, context); 'two' cannot be (too many "
        "positional arguments)"
    )
    assert list(registry) == ["three", "many"]


def test_a_name_that_differs_only_in_case_is_refused_and_suggested() -> None:
    registry: Registry[Entry] = Registry("thing", {})
    registry.add(Entry("small"))
    with pytest.raises(
        ValueError, match=r"^a thing named 'Small' would differ from the registered 'small' only in case"
    ):
        registry.add(Entry("Small"))
    with pytest.raises(ValueError, match=r"^unknown thing 'SMALL'; registered things: small; did you mean 'small'\?$"):
        registry.lookup("SMALL")
