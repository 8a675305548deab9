"""One lifecycle for every result: ``save`` then ``load`` gives it back, ``figures()`` is a dict of figures,
``report(path)`` writes a page that names it. Every result saves through `files.save_result`.
"""

import dataclasses
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import plotly.graph_objects as go
import pytest
import torch
from safetensors import safe_open

import contribution_lens as cl
from conftest import assert_self_contained, tiny_bridge
from contribution_lens import faithfulness, files
from contribution_lens.analyses.sink_intervention import SinkIntervention, run_sink_intervention
from contribution_lens.engine import LayerResults

IDS = torch.tensor([1, 5, 9, 3, 7, 2, 8, 11])
CHUNKS = torch.tensor([[1, 5, 9, 3, 7, 2, 8, 11, 4, 6], [1, 4, 6, 11, 13, 2, 9, 5, 3, 7]])


def _faithfulness_run() -> faithfulness.FaithfulnessRun:
    records = [
        {"protocol": "every_layer", "task": "t", "kind": "lm", "seq": str(s), "method": m, "mode": "sufficiency",
         "ratio": r, "nll": 10.0 + s + (r if m == "attention" else r / 2), "clean": 10.0 + s, "tokens": 5}
        for s in range(4) for m in ("attention", "contribution") for r in (0.0, 0.5)
    ]  # fmt: skip
    settings = faithfulness.Settings(methods=("attention", "contribution"), ratios=(0.0, 0.5), modes=("sufficiency",))
    return faithfulness.FaithfulnessRun(
        records, settings, faithfulness.DataSettings(data=("text",)), model_name="tiny", resamples=50
    )


def _replication() -> Any:
    from contribution_lens.replication import Replication, runner

    commands = {part: f"contribution-lens {part}" for part in ("text", "choice-clean", "choice", "sinks", "replicate")}
    claims = runner.judge(None, None, None, None, None, commands)  # every claim, each "no verdict: no data"
    opening = pd.DataFrame({"layer": [0, 1], "sink_attention": [0.5, 0.25], "sink_contribution": [0.125, 0.0625]})
    return Replication(claims, "tiny", "quick", {"lm": ["text"], "choice_ratios": None}, commands,
                       {"opening": opening}, "cpu", "float32")  # fmt: skip


def _circuit_results() -> dict[str, Any]:
    """The circuit results of one tiny task (computed once: seven cases read them)."""
    if not _CIRCUITS:
        model = tiny_bridge("gqa", biases=True)
        clean, corrupted = CHUNKS[:, :6], CHUNKS.flip(0)[:, :6]
        task = cl.Task("tiny", clean, corrupted, clean[:, 1], clean[:, 2], cl.Task.full_length(clean))
        scores = cl.circuit_scores(model, task, method="eap")
        circuit = scores.circuit(0.2)
        _CIRCUITS.update(
            CircuitScores=scores,
            Circuit=circuit,
            CircuitEvaluation=cl.evaluate_circuit(model, task, circuit),
            CircuitCurve=cl.circuit_curve(model, task, scores),
            CircuitStability=cl.circuit_stability(model, task, resamples=3, fractions=(0.1, 0.5), progress=False),
            Linearisation=cl.linearisation_error(model, task),
            EdgeEffects=cl.exact_edge_effects(model, task, scores, count=1, progress=False),
        )
    return _CIRCUITS


_CIRCUITS: dict[str, Any] = {}


# name: (how to make it, saved as a folder, what its page's title says)
RESULTS: dict[str, tuple[Callable[[], Any], bool, str]] = {
    "Geometry": (lambda: cl.attention_geometry(tiny_bridge("gqa", biases=True), IDS, scope="intra"), False, "Geometry"),
    "Flow": (lambda: cl.flow(tiny_bridge("gqa", biases=True), IDS, position=[-1, 3]), False, "Flow into 7:"),
    "LogitAttribution": (
        lambda: cl.logit_attribution(tiny_bridge("gqa", biases=True), IDS, target=4, foil=9),
        False,
        "LogitAttribution of logit(",
    ),
    "GenerationExplanation": (
        lambda: cl.explain_generation(tiny_bridge("mqa"), IDS[:5], answer=[4, 6, 2]),
        False,
        "GenerationExplanation of",
    ),
    "SinkAnalysis": (lambda: cl.sink_analysis(tiny_bridge("gqa"), CHUNKS), False, "SinkAnalysis of 2 texts"),
    "SinkIntervention": (
        lambda: run_sink_intervention(tiny_bridge("gqa"), CHUNKS, variant="mean_tail", progress=False),
        False,
        "SinkIntervention",
    ),
    "SinkStudy": (
        lambda: cl.sink_study(tiny_bridge("gqa"), CHUNKS, variants=("zero",), model_name="tiny", progress=False),
        True,
        "Attention sinks: tiny",
    ),
    "QKAttribution": (
        lambda: cl.qk_attribution(tiny_bridge("gqa", biases=True), IDS, 1, [0, 3], query=[3, -1]),
        False,
        "QKAttribution of layer 1",
    ),
    "FaithfulnessRun": (_faithfulness_run, True, "Faithfulness of importance measures: tiny"),
    "Replication": (_replication, True, "claims on tiny"),
    "CircuitScores": (lambda: _circuit_results()["CircuitScores"], False, "CircuitScores(eap on tiny"),
    "Circuit": (lambda: _circuit_results()["Circuit"], False, "Circuit(edge level"),
    "CircuitEvaluation": (lambda: _circuit_results()["CircuitEvaluation"], False, "CircuitEvaluation(Circuit"),
    "CircuitCurve": (lambda: _circuit_results()["CircuitCurve"], False, "CircuitCurve(eap on tiny"),
    "CircuitStability": (lambda: _circuit_results()["CircuitStability"], False, "CircuitStability(eap on tiny"),
    "Linearisation": (lambda: _circuit_results()["Linearisation"], False, "Linearisation(contribution on tiny"),
    "EdgeEffects": (lambda: _circuit_results()["EdgeEffects"], False, "EdgeEffects(5 edges on tiny beside eap"),
}


@pytest.fixture(scope="module", params=list(RESULTS))
def case(request) -> tuple[str, Any]:
    return request.param, RESULTS[request.param][0]()


def assert_same(got: Any, want: Any, where: str = "result") -> None:
    """Equal tensors (dtype and values), tables, numbers (NaN equal to NaN) and fields, all the way down."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype, where
        assert torch.equal(got, want.cpu()), where
    elif isinstance(want, pd.DataFrame):
        pd.testing.assert_frame_equal(got, want, check_exact=True, obj=where)
    elif isinstance(want, float):
        assert isinstance(got, float) and (got == want or (math.isnan(got) and math.isnan(want))), where
    elif isinstance(want, dict):
        assert list(got) == list(want), where
        for key in want:
            assert_same(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, list | tuple):
        assert type(got) is type(want) and len(got) == len(want), where
        for index, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_same(a, b, f"{where}[{index}]")
    elif isinstance(want, LayerResults):
        assert type(got) is type(want) and got.layers == want.layers, where
        fields = ["tokens", "attention_mask", "str_tokens", "n_layers", *type(want).STORED]
        for name in fields:
            assert_same(getattr(got, name), getattr(want, name), f"{where}.{name}")
        for layer in want.layers:
            assert_same(got[layer], want[layer], f"{where}[{layer}]")
    elif dataclasses.is_dataclass(want):
        assert type(got) is type(want), where
        for field in dataclasses.fields(want):
            assert_same(getattr(got, field.name), getattr(want, field.name), f"{where}.{field.name}")
    elif isinstance(want, faithfulness.FaithfulnessRun):
        for name in ("records", "settings", "data", "model_name", "resamples", "seed"):
            assert_same(getattr(got, name), getattr(want, name), f"{where}.{name}")
    else:
        assert got == want, where


def test_save_then_load_gives_every_tensor_and_field_back(case, tmp_path) -> None:
    name, result = case
    folder = RESULTS[name][1]
    saved = result.save(tmp_path / ("saved" if folder else "saved.safetensors"))
    loaded = type(result).load(saved)
    assert type(loaded) is type(result)
    assert_same(loaded, result)
    assert repr(loaded) == repr(result)
    # Through the one helper: a file of the result's own kind, in the one layout.
    state = saved / files.file_name(type(result)) if folder else saved
    with safe_open(str(state), framework="pt") as handle:
        assert handle.metadata()["format"] == f"contribution_lens.{name}/2"


def test_figures_are_a_dict_of_figures(case) -> None:
    _, result = case
    figures = result.figures()
    assert isinstance(figures, dict) and figures
    for title, figure in figures.items():
        assert isinstance(title, str) and title and isinstance(figure, go.Figure) and figure.data, title


def test_report_writes_a_page_that_names_the_result(case, tmp_path) -> None:
    name, result = case
    page = result.report(tmp_path / "report.html")
    text = Path(page).read_text(encoding="utf-8")
    title = re.search(r"<title>(.*?)</title>", text, flags=re.S)
    assert title is not None and RESULTS[name][2] in title.group(1), title
    assert_self_contained(text)
    assert text.count("plotly-graph-div") >= len(result.figures())


def test_a_result_file_names_no_class_outside_the_package(tmp_path) -> None:
    """A file says which classes to rebuild; one that names any other (here: a module that runs code) is refused."""
    path = cl.flow(tiny_bridge(), IDS).save(tmp_path / "flow.safetensors")
    with safe_open(str(path), framework="pt") as handle:
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
        metadata = handle.metadata()
    from safetensors.torch import save_file

    edited = tmp_path / "edited.safetensors"
    save_file(tensors, str(edited), metadata={**metadata, "tree": metadata["tree"].replace(
        "contribution_lens.analyses.flow:Flow", "os:system", 1)})  # fmt: skip
    with pytest.raises(ValueError, match=rf"^{edited} is not a Flow written by Flow.save .*'os:system'"):
        cl.Flow.load(edited)


def test_a_file_of_the_earlier_layout_is_named_as_such(tmp_path) -> None:
    from safetensors.torch import save_file

    old = tmp_path / "old.safetensors"
    save_file({"tokens": IDS}, str(old), metadata={"format": "contribution_lens.Flow/1"})
    with pytest.raises(ValueError, match=r"its format is 'contribution_lens.Flow/1', an earlier layout"):
        cl.Flow.load(old)


def test_a_table_keeps_its_index_dtypes_and_missing_values(tmp_path) -> None:
    table = pd.DataFrame(
        {"layer": [0, 0, 1], "head": [0, 1, 0], "x": [0.5, float("nan"), 2.0], "name": ["a", None, "c"],
         "kept": [True, False, True], "n": pd.array([1, None, 3], dtype="Int64")}
    ).set_index(["layer", "head"])  # fmt: skip
    table.columns.name = "column"
    intervention = SinkIntervention("zero", table, 1.0, 2.0, 0.5)
    loaded = SinkIntervention.load(intervention.save(tmp_path / "s.safetensors"))
    pd.testing.assert_frame_equal(loaded.per_layer, table, check_exact=True)
