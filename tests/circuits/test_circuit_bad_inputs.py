"""Mistakes refused with a message that names the argument, before any pass runs on the model."""

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from circuit_helpers import random_task

import contribution_lens as cl
from conftest import tiny_bridge

pytestmark = pytest.mark.usefixtures("as_a_user")


@contextmanager
def no_pass(model) -> Iterator[None]:
    """Fail if ``model`` runs a forward pass inside the block."""

    def refuse(module, args):
        raise AssertionError("a forward pass ran before the mistake was refused")

    handle = model.register_forward_pre_hook(refuse)
    try:
        yield
    finally:
        handle.remove()


@pytest.fixture(scope="module")
def model():
    built = tiny_bridge("gqa")
    cl.circuit_graph(built)  # the block forms' probe runs once, here
    return built


@pytest.fixture(scope="module")
def scores(model):
    return cl.circuit_scores(model, random_task(model), method="random")


def test_an_unknown_method_is_refused(model) -> None:
    with no_pass(model), pytest.raises(ValueError) as error:
        cl.circuit_scores(model, random_task(model), method="acdc")
    assert str(error.value) == (
        "method: unknown circuit method 'acdc'; registered: eap, eap-ig, activation-patching, random, "
        "contribution, contribution-ig, information-flow-routes, information-flow-routes-last"
    )


@pytest.mark.parametrize("fraction", [0, -0.5, 1.5, float("nan"), True, "10%"])
def test_a_fraction_outside_zero_to_one_is_refused(scores, fraction) -> None:
    with pytest.raises(ValueError) as error:
        scores.circuit(fraction)
    assert str(error.value) == (
        f"fraction must be a number in (0, 1] (the share of edges or nodes kept), got {fraction!r}"
    )


def test_an_unknown_level_and_a_node_method_at_edge_level_are_refused(model, scores) -> None:
    with pytest.raises(ValueError, match=r"^level must be 'edge' or 'node', got 'head'$"):
        scores.circuit(0.5, level="head")
    with no_pass(model), pytest.raises(ValueError, match=r"^level must be 'edge' or 'node', got 'head'$"):
        cl.circuit_curve(model, random_task(model), scores, level="head")
    node_only = cl.CircuitScores("t", "activation-patching", scores.graph, scores.component_scores)
    with pytest.raises(ValueError, match=r"^level: 'activation-patching' scores nodes only; ask for level='node'$"):
        node_only.circuit(0.5)


def test_an_unknown_node_or_edge_is_refused(model) -> None:
    graph = cl.circuit_graph(model)
    with pytest.raises(ValueError) as error:
        cl.Circuit.from_nodes(graph, ["L0H1", "L2H0"])
    assert str(error.value) == (
        "nodes: unknown node 'L2H0'; nodes are 'embed', 'L{layer}H{head}' (layer < 2, head < 4), "
        "'L{layer}.mlp' and 'logits'"
    )
    with pytest.raises(ValueError, match=r"^edges: unknown edge 'L1H0->L0H0<q>'; edges are named as in Graph.edges"):
        cl.Circuit.from_edges(graph, ["L1H0->L0H0<q>"])


def test_an_encoder_is_refused_with_the_reason() -> None:
    encoder = tiny_bridge("mha", attention_dir="bidirectional")
    with no_pass(encoder), pytest.raises(ValueError) as error:
        cl.circuit_scores(encoder, random_task(encoder), method="eap")
    assert str(error.value).startswith("model: circuits cannot be found in ")
    assert str(error.value).endswith(
        ": it is an encoder (bidirectional attention): a circuit's metric is read at each prompt's last position, "
        "which every position of an encoder sees, so right-padded prompts are not separable"
    )


def test_a_task_the_model_cannot_read_is_refused(model) -> None:
    task = random_task(model)
    wide = cl.Task("wide", task.clean + 100, task.corrupted, task.answer, task.foil, task.last)
    with no_pass(model), pytest.raises(ValueError, match=r"^task.clean: token ids must lie in \[0, 50\)"):
        cl.circuit_scores(model, wide, method="eap")
    odd = cl.Task("odd", task.clean, task.corrupted, task.answer, task.foil, task.last, metric="kl")
    with (
        no_pass(model),
        pytest.raises(
            ValueError,
            match=r"^task.metric: circuits read logit_diff or probability at the last position, not 'kl' "
            r"\(use task.with_metric\('logit_diff'\)\)$",
        ),
    ):
        cl.circuit_scores(model, odd, method="eap")
    with no_pass(model), pytest.raises(ValueError, match=r"^task must be a contribution_lens Task, got tuple$"):
        cl.circuit_scores(model, (task.clean, task.corrupted), method="eap")


def test_a_circuit_of_another_model_is_refused(model) -> None:
    other = cl.circuit_graph(tiny_bridge("mha"))
    circuit = cl.Circuit.from_nodes(other, ["L0H0"])
    with (
        no_pass(model),
        pytest.raises(ValueError, match=r"^circuit: its graph Graph\(n_layers=2, n_heads=4, n_kv_heads=4"),
    ):
        cl.evaluate_circuit(model, random_task(model), circuit)


@pytest.mark.parametrize(("name", "value", "message"), [
    ("steps", 0, "steps must be a positive integer, got 0"),
    ("memory", -1, "memory must be a positive whole number of bytes (2**30 is 1 GiB), got -1"),
])  # fmt: skip
def test_bad_settings_are_refused(model, name, value, message) -> None:
    with no_pass(model), pytest.raises(ValueError) as error:
        cl.circuit_scores(model, random_task(model), method="eap-ig", **{name: value})
    assert str(error.value) == message
