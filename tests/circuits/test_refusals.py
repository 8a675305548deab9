"""Circuits that refuse what they cannot answer: each class of mistake a researcher makes, refused (or warned about)
by name before any pass, never a silent non-answer or a traceback from inside the package."""

import json
import pickle
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from circuit_helpers import random_task
from safetensors import safe_open
from safetensors.torch import save_file
from test_circuit_bad_inputs import no_pass

import contribution_lens as cl
from conftest import tiny_bridge
from contribution_lens import adapter
from contribution_lens.circuits import runner

pytestmark = pytest.mark.usefixtures("as_a_user")


@pytest.fixture(scope="module")
def model():
    built = tiny_bridge("gqa")
    cl.circuit_graph(built)
    return built


@pytest.fixture(scope="module")
def decoder(tiny_decoder):
    """A tiny random Llama with a (WordPiece) tokenizer: pad 0, BOS 101 ([CLS])."""
    return cl.load_model(str(tiny_decoder))


def distinct_task(model, n: int = 12, seed: int = 0) -> cl.Task:
    """``n`` random prompts of 7 ordinary ids (no 0: the tokenizer's pad), each corrupted prompt another."""
    generator = torch.Generator().manual_seed(seed)
    clean = torch.randint(3, 50, (n, 7), generator=generator)
    corrupted = torch.randint(3, 50, (n, 7), generator=generator)
    answer = torch.arange(n) % 50
    return cl.Task("random", clean, corrupted, answer, (answer + 1) % 50, cl.Task.full_length(clean))


def every_call(model, task, scores=None):
    """Every function of the circuit API that takes a model and a task, ready to run."""
    graph = cl.circuit_graph(model)
    circuit = cl.Circuit.from_nodes(graph, graph.components[:2])
    return {
        "circuit_scores": lambda: cl.circuit_scores(model, task, method="random"),
        "evaluate_circuit": lambda: cl.evaluate_circuit(model, task, circuit),
        "circuit_curve": lambda: cl.circuit_curve(model, task, scores, "node"),
        "task_report": lambda: cl.task_report(model, task),
    }


# --- 1. a task is checked where it is made ----------------------------------------------------------------------


def test_ids_of_any_integer_array_type_are_read_and_floats_refused_naming_the_field(model) -> None:
    task = distinct_task(model)
    as_lists = cl.Task("lists", task.clean.tolist(), task.corrupted.tolist(), task.answer.tolist(),
                       task.foil.tolist(), task.last.tolist())  # fmt: skip
    as_numpy = cl.Task("numpy", task.clean.numpy().astype(np.int32), task.corrupted.numpy(), task.answer.numpy(),
                       task.foil.numpy(), task.last.numpy())  # fmt: skip
    for built in (as_lists, as_numpy):
        assert built.clean.dtype == torch.long and torch.equal(built.clean, task.clean)
        assert torch.equal(built.last, task.last) and torch.equal(built.answer, task.answer)
    cl.circuit_scores(model, as_numpy, method="random")  # used as a tensor task is
    with pytest.raises(ValueError) as error:
        cl.Task("f", task.clean.float(), task.corrupted, task.answer, task.foil, task.last)
    assert (
        str(error.value) == "clean must hold integer token ids, got float32 values (.long() if they are whole numbers)"
    )
    with pytest.raises(ValueError, match=r"^last must hold integer positions \(a tensor, a NumPy array or lists of"):
        cl.Task("r", task.clean, task.corrupted, task.answer, task.foil, [6, 6, "6"] * 4)
    with pytest.raises(ValueError, match=r"^clean must hold integer token ids \(.*got list \[\[1, 2\], \[3\]\]$"):
        cl.Task("r", [[1, 2], [3]], [[1, 2], [3]], [1, 2], [3, 4], [1, 0])


def test_answer_equal_to_foil_names_the_prompts(model) -> None:
    task = distinct_task(model)
    foil = torch.where(torch.arange(12) == 4, task.answer, task.foil)
    with pytest.raises(ValueError) as error:
        cl.Task("t", task.clean, task.corrupted, task.answer, foil, task.last)
    assert (
        str(error.value) == "foil must differ from answer in every prompt; prompt 4 has one id as both (4 in prompt 4)"
    )


def test_padding_inside_a_prompt_is_refused_where_the_task_shows_its_pad(model) -> None:
    task = distinct_task(model)
    clean, corrupted, last = task.clean.clone(), task.corrupted.clone(), task.last.clone()
    last[0] = 3
    clean[0, 4:], corrupted[0, 4:] = 0, 0  # prompt 0 right-padded with 0: the task's pad
    corrupted[2, 5:] = 0  # prompt 2's corrupted prompt two tokens shorter than its clean one
    with pytest.raises(ValueError) as error:
        cl.Task("t", clean, corrupted, task.answer, task.foil, last)
    assert str(error.value) == (
        "corrupted: prompt 2 ends in padding (id 0) at last[2] = 6, where its clean prompt has a token: clean and "
        "corrupted must have the same token count (a prompt padded inside reads its metric at a pad)"
    )


def test_padding_the_models_pad_id_shows_is_refused_before_any_pass(decoder) -> None:
    tokenizer = decoder.tokenizer
    left = tokenizer(["the cat sat on", "a dog"], padding=True, padding_side="left", return_tensors="pt")["input_ids"]
    shifted = torch.cat([left[1:], left[:1]])
    task = cl.Task("left", left, shifted, torch.tensor([1996, 2003]), torch.tensor([2010, 2011]),
                   cl.Task.full_length(left))  # fmt: skip
    for name, call in every_call(decoder, task).items():
        if name == "circuit_curve":
            continue
        with no_pass(decoder), pytest.raises(ValueError) as error:
            call()
        assert str(error.value) == (
            "task.clean: prompt 1 begins with the padding id 0: a left-padded batch, whose prompts would attend to "
            "their padding; pad on the right and set last to each prompt's last real token"
        ), name
    ids = tokenizer(["the cat sat on", "a dog ran to"], return_tensors="pt")["input_ids"]
    shorter = ids.flip(0).clone()
    shorter[1, -2:] = 0  # padding inside the corrupted prompt, where the metric is read
    task = cl.Task("short", ids, shorter, torch.tensor([1996, 2003]), torch.tensor([2010, 2011]),
                   cl.Task.full_length(ids))  # fmt: skip
    with no_pass(decoder), pytest.raises(ValueError, match=r"^task.corrupted: prompt 1 ends in padding \(id 0\) at "):
        cl.circuit_scores(decoder, task, method="eap")


def test_a_task_of_another_tokenizer_is_refused_by_every_call_before_any_pass(model, decoder, tmp_path) -> None:
    built_here = cl.Task.induction(decoder, n=12, length=3)  # ids of a WordPiece vocabulary, BOS 101
    assert built_here.tokenizer == adapter.tokenizer_identity(decoder) and built_here.tokenizer.startswith(
        "30522 tokens #"
    )
    elsewhere = cl.Task.induction(model, n=12, length=3)  # bare ids of a model without tokenizer
    assert elsewhere.tokenizer == "no tokenizer, BOS none"
    scores = cl.circuit_scores(model, elsewhere, method="random")
    for name, call in every_call(decoder, elsewhere, scores).items():
        with no_pass(decoder), pytest.raises(ValueError) as error:
            call()
        assert str(error.value) == (
            "task: its ids are of another tokenizer (no tokenizer, BOS none) than the model's "
            f"({built_here.tokenizer}), so they would read as other words: build the task with this model "
            "(Task.ioi(model, ...), Task.from_jsonl(model, path))"
        ), name
    # Saved and loaded elsewhere (pickled), the task keeps what it was built for.
    with no_pass(model), pytest.raises(ValueError, match=r"^task: its ids are of another tokenizer \(30522 tokens #"):
        cl.circuit_scores(model, pickle.loads(pickle.dumps(built_here)), method="random")
    # Scores keep it too: saved, loaded, and given to a curve on another model's task.
    assert cl.CircuitScores.load(scores.save(tmp_path / "s.safetensors")).prompts.tokenizer == "no tokenizer, BOS none"


def test_from_jsonl_takes_the_model_first_and_the_earlier_order_with_a_warning(decoder, tmp_path) -> None:
    row = {"clean": "the capital of france is", "corrupted": "the capital of japan is", "answer": " paris",
           "foil": " tokyo"}  # fmt: skip
    path = tmp_path / "capitals.jsonl"
    path.write_text(json.dumps(row) + "\n")
    task = cl.Task.from_jsonl(decoder, path)
    assert task.tokenizer == adapter.tokenizer_identity(decoder)
    with pytest.warns(FutureWarning, match=r"Task.from_jsonl\(path, model\) is the earlier order: pass the model"):
        again = cl.Task.from_jsonl(str(path), decoder)
    assert torch.equal(again.clean, task.clean)


def test_a_prompt_longer_than_the_context_is_refused_before_any_pass(model) -> None:
    ids = torch.randint(3, 50, (2, 70), generator=torch.Generator().manual_seed(0))
    task = cl.Task("long", ids, ids.flip(1), torch.tensor([1, 2]), torch.tensor([3, 4]), cl.Task.full_length(ids))
    with no_pass(model), pytest.raises(ValueError) as error:
        cl.circuit_scores(model, task, method="eap")
    assert str(error.value) == "task: prompt 0 is 70 tokens long, more than the model's context of 64 tokens"


# --- 2. no silent non-answers -----------------------------------------------------------------------------------


def test_a_counterfactual_identical_to_the_clean_prompt_is_refused_and_warned_where_only_some_are(model) -> None:
    task = distinct_task(model)
    same = cl.Task("same", task.clean, task.clean, task.answer, task.foil, task.last)
    scores = cl.circuit_scores(model, task, method="random")
    for name, call in every_call(model, same, scores).items():
        if name == "task_report":  # it reads the clean prompts alone
            continue
        with no_pass(model), pytest.raises(ValueError) as error:
            call()
        assert str(error.value) == (
            "task: every corrupted prompt is identical to its clean prompt: the counterfactual changes nothing, so no "
            "patch can move the metric (faithfulness would divide by m(clean) - m(corrupted) = 0)"
        ), name
    some = torch.where(torch.arange(12)[:, None] < 2, task.clean, task.corrupted)
    with pytest.warns(UserWarning, match=r"^task: 2 of 12 prompts have a corrupted prompt identical to the clean one "
                                         r"\(prompts 0, 1\): the counterfactual changes nothing there"):  # fmt: skip
        cl.circuit_scores(model, cl.Task("some", task.clean, some, task.answer, task.foil, task.last), method="random")


def flat_model():
    """A model whose every weight is 0: its logits are the same whatever the prompt, so no counterfactual moves them."""
    model = tiny_bridge("mha")
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
    return model


def test_faithfulness_is_never_nan_without_saying_why(tmp_path) -> None:
    model = flat_model()
    task = distinct_task(model)
    graph = cl.circuit_graph(model)
    with pytest.warns(UserWarning, match=r"^task 'random': faithfulness is undefined: the counterfactual does not "):
        evaluation = cl.evaluate_circuit(model, task, cl.Circuit.from_nodes(graph, ["L0H0"]))
    assert np.isnan(evaluation.faithfulness) and evaluation.undefined == (
        "the counterfactual does not move the metric: mean m(clean) - m(corrupted) = 0 over 12 prompts, and f "
        "divides by it"
    )
    assert f"faithfulness undefined ({evaluation.undefined})" in repr(evaluation)
    scores = cl.circuit_scores(model, task, method="random")
    with pytest.warns(UserWarning, match="faithfulness is undefined"):
        curve = cl.circuit_curve(model, task, scores, "node")
    assert np.isnan(curve.cpr) and f"CPR and CMD undefined ({curve.undefined})" in repr(curve)
    assert set(curve.table["note"]) == {f"f undefined: {curve.undefined}"}
    # A run refuses such a task before any method runs.
    calls = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runner, "circuit_scores", lambda *a, **k: calls.append(a) or pytest.fail("scored"))
        with pytest.raises(ValueError, match=r"^task: on the scoring prompts the counterfactual does not move the "):
            runner.run_circuits(model, task, runner.RunSettings(("random",)), tmp_path / "run")
    assert not calls


def test_intervals_from_too_few_prompts_say_so(model) -> None:
    one = distinct_task(model, n=1)
    with pytest.warns(UserWarning, match=r"task 'random': too few prompts for an interval: 1 < 10; its 95 % interval"):
        report = cl.task_report(model, one)
    assert repr(report).endswith("(95 %; too few prompts for an interval: 1 < 10))")
    graph = cl.circuit_graph(model)
    evaluation = cl.evaluate_circuit(model, distinct_task(model, n=3), cl.Circuit.from_nodes(graph, ["L0H0"]))
    assert repr(evaluation).endswith("3 prompts; too few prompts for an interval: 3 < 10)")
    assert "too few" not in repr(
        cl.evaluate_circuit(model, distinct_task(model), cl.Circuit.from_nodes(graph, ["L0H0"]))
    )


def test_repeated_prompts_are_warned_about(decoder) -> None:
    with pytest.warns(UserWarning, match=r"^task 'capitals': 2000 prompts, \d+ distinct: repeated prompts add no "):
        cl.Task.capitals(decoder, n=2000)
    task = distinct_task(decoder, n=3)
    rows = torch.tensor([0, 1, 1])
    with pytest.warns(UserWarning, match=r"^task 'twice': 3 prompts, 2 distinct"):
        cl.Task("twice", task.clean[rows], task.corrupted[rows], task.answer[rows], task.foil[rows], task.last[rows])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        task.subset(rows)  # a task's own subsets repeat on purpose (a bootstrap, a shard): no warning


@pytest.mark.parametrize("seed", [-1, "1", 1.5, True])
def test_a_seed_that_is_not_a_non_negative_integer_is_refused_everywhere(model, seed) -> None:
    message = (
        f"seed must be a non-negative integer, got {seed!r} (a negative seed or a string would draw another seed's "
        "prompts)"
    )
    task = distinct_task(model)
    graph = cl.circuit_graph(model)
    for call in (
        lambda: cl.Task.induction(model, n=2, length=3, seed=seed),
        lambda: task.split(0.5, seed=seed),
        lambda: cl.circuit_scores(model, task, method="random", seed=seed),
        lambda: cl.evaluate_circuit(model, task, cl.Circuit.from_nodes(graph, ["L0H0"]), seed=seed),
        lambda: runner.RunSettings(("random",), seed=seed),
    ):
        with no_pass(model), pytest.raises(ValueError) as error:
            call()
        assert str(error.value) == message


def task_file(tmp_path: Path, *rows: object, name: str = "task.jsonl", encoding: str = "utf-8") -> Path:
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding=encoding)
    return path


GOOD = {"clean": "the capital of france is", "corrupted": "the capital of japan is", "answer": " paris",
        "foil": " tokyo"}  # fmt: skip


def test_an_answer_in_a_file_follows_the_built_in_tasks_token_boundary_rule(decoder, tmp_path) -> None:
    path = task_file(tmp_path, GOOD, GOOD | {"answer": "paris"})
    with pytest.raises(ValueError) as error:
        cl.Task.from_jsonl(decoder, path)
    assert str(error.value) == (
        f"{path}, line 2: field 'answer' ('paris') is glued to the last word of field 'clean' (the text would read "
        "'isparis'); write it with its leading space, as the built-in tasks do (' paris')"
    )
    assert cl.Task.from_jsonl(decoder, task_file(tmp_path, GOOD, name="good.jsonl")).answer.tolist() == [
        decoder.tokenizer.encode(" paris", add_special_tokens=False)[0]
    ]


# --- 3. methods and their scores --------------------------------------------------------------------------------


def test_registration_checks_the_function_and_takes_the_bare_decorator() -> None:
    with pytest.raises(ValueError) as error:
        cl.register_circuit_method("named", "eap")
    assert str(error.value) == (
        "score_fn: a circuit method's score_fn is called as score_fn(model, task, context); got str 'eap'"
    )
    with pytest.raises(ValueError) as error:
        cl.register_circuit_method("two", lambda model, task: None)
    assert str(error.value) == (
        "score_fn: a circuit method's score_fn is called as score_fn(model, task, context); '<lambda>' cannot be "
        "(too many positional arguments)"
    )
    with pytest.raises(ValueError, match=r"^score_fn: .* cannot be"):
        cl.register_circuit_method("decorated")(lambda model: None)

    def later_layers(model, task, context):
        return torch.arange(len(context.graph.components), dtype=torch.float32)

    registered = cl.register_circuit_method(later_layers)
    try:
        assert registered is later_layers and "later_layers" in cl.available_circuit_methods()
    finally:
        cl.unregister_circuit_method("later_layers")


def test_a_name_that_differs_from_a_registered_one_only_in_case_is_refused_and_suggested(model) -> None:
    with pytest.raises(ValueError) as error:
        cl.register_circuit_method("EAP", lambda model, task, context: None)
    assert str(error.value) == (
        "a circuit method named 'EAP' would differ from the registered 'eap' only in case; choose another name"
    )
    with (
        no_pass(model),
        pytest.raises(ValueError, match=r"^method: unknown circuit method 'EAP'; .*did you mean 'eap'"),
    ):
        cl.circuit_scores(model, random_task(model), method="EAP")


@pytest.fixture
def method_returning():
    """Register a method that returns ``make(n_edges)`` under a fresh name, and take it away after."""
    names = []

    def register(make):
        name = f"returns-{len(names)}"
        cl.register_circuit_method(name, lambda model, task, context: make(len(context.graph.edges)))
        names.append(name)
        return name

    yield register
    for name in names:
        cl.unregister_circuit_method(name)


def test_scores_are_checked_before_a_circuit_is_chosen_naming_the_method(model, method_returning) -> None:
    task = distinct_task(model)
    graph = cl.circuit_graph(model)

    def with_nan(n):
        scores = torch.randn(n)
        scores[5] = float("nan")
        return scores

    name = method_returning(with_nan)
    with pytest.raises(ValueError) as error:
        cl.circuit_scores(model, task, method=name)
    assert str(error.value) == (
        f"circuit method {name!r}: 1 of {len(graph.edges)} scores are NaN or infinite (the first "
        f"{graph.edges[5]!r}: nan); a circuit cannot be chosen from them"
    )
    name = method_returning(lambda n: list(range(n)))
    with pytest.raises(
        ValueError, match=rf"^circuit method {name!r} returned a list; a score function returns a torch"
    ):
        cl.circuit_scores(model, task, method=name)
    name = method_returning(lambda n: torch.ones(n + 1))
    with pytest.raises(ValueError, match=rf"^circuit method {name!r}: scores of shape \({len(graph.edges) + 1},\) for"):
        cl.circuit_scores(model, task, method=name)
    name = method_returning(lambda n: np.linspace(-1.0, 1.0, n))  # NumPy is read as a tensor
    assert cl.circuit_scores(model, task, method=name).edge_scores.dtype == torch.float32
    name = method_returning(lambda n: torch.zeros(n))
    with pytest.warns(UserWarning, match=rf"^circuit method {name!r} scored every edge 0 on task 'random': a circuit"):
        cl.circuit_scores(model, task, method=name)
    with pytest.raises(
        ValueError, match=r"^circuit method 'hand': 2 of 10 scores are NaN or infinite \(the first 'L0H0'"
    ):
        cl.CircuitScores("t", "hand", graph, torch.tensor([float("nan"), float("inf"), *[0.0] * 8]))


# --- 4. arguments checked once, the same way everywhere ---------------------------------------------------------


@pytest.fixture(scope="module")
def scored(model):
    task = distinct_task(model)
    return task, cl.circuit_scores(model, task, method="random")


@pytest.mark.parametrize(
    ("fractions", "message"),
    [
        ((), "fractions must hold at least two sizes, 1 (the whole model) among them: CPR and CMD are areas over the "
             "fractions up to 1; got ()"),
        ((0.5,), "fractions must hold at least two sizes, 1 (the whole model) among them: CPR and CMD are areas over "
                 "the fractions up to 1; got (0.5,)"),
        ((0.1, 0.5), "fractions must hold at least two sizes, 1 (the whole model) among them: CPR and CMD are areas "
                     "over the fractions up to 1; got (0.1, 0.5)"),
        ((0.1, 0.1, 1.0), "fractions: 0.1 is given twice; give each size once"),
        ((0.0, 1.0), "fractions: 0.0 is not a number in (0, 1] (a share of edges or nodes kept)"),
        (0.5, "fractions must be a sequence of shares of the edges (or nodes) kept, got 0.5"),
    ],
    ids=["empty", "one", "no 1", "twice", "zero", "a number"],
)  # fmt: skip
def test_bad_fractions_are_refused_before_any_pass(model, scored, fractions, message) -> None:
    task, scores = scored
    with no_pass(model), pytest.raises(ValueError) as error:
        cl.circuit_curve(model, task, scores, "node", fractions=fractions)
    assert str(error.value) == message


def test_unsorted_fractions_are_sorted_for_the_user(model, scored) -> None:
    task, scores = scored
    shuffled = cl.circuit_curve(model, task, scores, "node", fractions=(1.0, 0.1, 0.5))
    ordered = cl.circuit_curve(model, task, scores, "node", fractions=(0.1, 0.5, 1.0))
    assert shuffled.fractions.tolist() == [0.1, 0.5, 1.0]
    assert shuffled.cpr == pytest.approx(ordered.cpr) and shuffled.cmd == pytest.approx(ordered.cmd)


@pytest.mark.parametrize("memory", ["2GB", -1, 0, 1.5, float("inf"), True])
def test_memory_is_refused_the_same_way_by_every_function(model, scored, memory) -> None:
    task, scores = scored
    graph = cl.circuit_graph(model)
    for call in (
        lambda: cl.circuit_scores(model, task, method="random", memory=memory),
        lambda: cl.evaluate_circuit(model, task, cl.Circuit.from_nodes(graph, ["L0H0"]), memory=memory),
        lambda: cl.circuit_curve(model, task, scores, "node", memory=memory),
        lambda: runner.plan_passes(graph, ["eap"], ["edge"], memory=memory),
    ):
        with no_pass(model), pytest.raises(ValueError) as error:
            call()
        assert str(error.value) == f"memory must be a positive whole number of bytes (2**30 is 1 GiB), got {memory!r}"


def test_memory_as_a_whole_float_is_bytes(model, scored) -> None:
    task, _ = scored
    assert cl.circuit_scores(model, task, method="random", memory=1e9).n_prompts == 12
    assert runner.plan_passes(cl.circuit_graph(model), ["eap"], ["edge"], memory=2.0**30)[0].windows == 1


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"steps": 2.5}, "steps must be a positive integer, got 2.5"),
        ({"levels": ("edge", "Edge")}, "level must be 'edge' or 'node', got 'Edge'"),
        ({"levels": ("node", "node")}, "levels: each level once, got ('node', 'node')"),
        ({"resamples": 0}, "resamples must be a positive integer (the number of prompts), got 0"),
        ({"split": 1.0}, "split must be a number in (0, 1) (the share of prompts scored) or None, got 1.0"),
    ],
    ids=["steps", "level", "levels twice", "resamples", "split"],
)
def test_a_runs_settings_are_checked_as_the_functions_check_them(settings, message) -> None:
    with pytest.raises(ValueError) as error:
        runner.RunSettings(("random",), **settings)
    assert str(error.value) == message


# --- 5. files that check themselves -----------------------------------------------------------------------------


def edited(path: Path, tree=None, tensors=None) -> Path:
    """``path`` rewritten with its metadata tree or its tensors changed (as a hand or a script might)."""
    with safe_open(str(path), "pt") as handle:
        metadata = handle.metadata()
        values = {name: handle.get_tensor(name) for name in handle.keys()}
    found = json.loads(metadata["tree"])
    if tree is not None:
        tree(found)
    if tensors is not None:
        tensors(values)
    save_file(values, str(path), metadata={**metadata, "tree": json.dumps(found)})
    return path


def test_a_results_metadata_is_checked_against_its_tensors_on_load(model, scored, tmp_path) -> None:
    task, scores = scored

    def more_layers(tree):
        tree["fields"]["graph"]["fields"]["n_layers"] = 3

    path = edited(scores.save(tmp_path / "scores.safetensors"), tree=more_layers)
    with pytest.raises(ValueError) as error:
        cl.CircuitScores.load(path)
    assert str(error.value) == (
        f"{path} is not a CircuitScores written by CircuitScores.save (ValueError: circuit method 'random': scores of "
        "shape (10,) for a graph of 15 heads and MLPs; expected (15,))"
    )

    def nan_score(values):
        values["edge_scores"][3] = float("nan")

    path = edited(scores.save(tmp_path / "nan.safetensors"), tensors=nan_score)
    with pytest.raises(ValueError, match=r"nan.safetensors is not a CircuitScores .*1 of 82 scores are NaN or infin"):
        cl.CircuitScores.load(path)
    curve = cl.circuit_curve(model, task, scores, "node", fractions=(0.1, 0.5, 1.0))

    def fewer_sizes(values):
        values["fractions"] = values["fractions"][:2]

    path = edited(curve.save(tmp_path / "curve.safetensors"), tensors=fewer_sizes)
    with pytest.raises(ValueError, match=r"curve.safetensors is not a CircuitCurve .*fractions has shape \(2,\); "):
        cl.CircuitCurve.load(path)
    evaluation = cl.evaluate_circuit(model, task, cl.Circuit.from_nodes(scores.graph, ["L0H0"]))

    def fewer_prompts(values):
        values["patched"] = values["patched"][:4]

    path = edited(evaluation.save(tmp_path / "evaluation.safetensors"), tensors=fewer_prompts)
    with pytest.raises(ValueError, match=r"evaluation.safetensors is not a CircuitEvaluation .*got shapes \(12,\), "):
        cl.CircuitEvaluation.load(path)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (json.dumps(GOOD).encode() + b"\n" + json.dumps(GOOD | {"clean": "the capital of b\u00e9nin is"},
                                                        ensure_ascii=False).encode("latin-1") + b"\n",
         "{path}, line 2: not UTF-8 text (the byte 0xe9 at column 28); save the file as UTF-8"),
        ((json.dumps(GOOD) + "\n").encode("utf-16"),
         "{path}: UTF-16 (little-endian) text (its byte-order mark); save the file as UTF-8"),
        ((json.dumps(GOOD) + "\n" + json.dumps(GOOD | {"clean": "word " * 300, "corrupted": "word " * 300})).encode(),
         "{path}, line 2: field 'clean' is 301 tokens long, more than the model's context of 256 tokens"),
    ],
    ids=["latin-1 line", "UTF-16", "longer than the context"],
)  # fmt: skip
def test_a_task_file_is_refused_naming_the_file_and_the_line(decoder, tmp_path, content, message) -> None:
    path = tmp_path / "task.jsonl"
    path.write_bytes(content)
    with pytest.raises(ValueError) as error:
        cl.Task.from_jsonl(decoder, path)
    assert str(error.value) == message.format(path=path)


def test_a_byte_order_mark_and_windows_line_ends_are_read(decoder, tmp_path) -> None:
    second = GOOD | {"clean": "the capital of italy is", "answer": " rome"}
    path = tmp_path / "windows.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + (json.dumps(GOOD) + "\r\n" + json.dumps(second) + "\r\n").encode())
    plain = task_file(tmp_path, GOOD, second, name="plain.jsonl")
    assert torch.equal(cl.Task.from_jsonl(decoder, path).clean, cl.Task.from_jsonl(decoder, plain).clean)
