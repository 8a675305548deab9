"""The circuit view (`cl.inspect_circuit`): which head a node opens, what the page embeds, what is refused."""

import json
import re

import numpy as np
import pytest
import torch

import contribution_lens as cl
from circuits.circuit_helpers import random_task
from conftest import tiny_bridge
from contribution_lens.views.circuit_view import circuit_tables, node_targets
from contribution_lens.views.inspector import InspectorError

NODES = ["L0H1", "L1H2", "L1.mlp"]
"""The circuit most tests open: two heads on two layers and an MLP."""


@pytest.fixture(scope="module")
def model():
    return tiny_bridge("gqa", seed=3)


@pytest.fixture(scope="module")
def task(model) -> cl.Task:
    return random_task(model, n=3, length=7)  # the last prompt ends at position 4 (right-padded by two)


@pytest.fixture(scope="module")
def circuit(model) -> cl.Circuit:
    return cl.Circuit.from_nodes(cl.circuit_graph(model), NODES)


@pytest.fixture(scope="module")
def view(model, task, circuit) -> cl.CircuitInspector:
    return cl.inspect_circuit(model, task, circuit, prompt=2)


def page_data(html: str) -> dict:
    blob = re.search(r"<script type='application/json' class='cl-data'>(.*?)</script>", html, re.DOTALL)
    assert blob is not None
    return json.loads(blob[1].replace("<\\/", "</"))


def test_a_head_opens_its_layer_and_head_at_the_prompts_final_position(view, task) -> None:
    final = int(task.last[2])
    assert final == 4 and view.query == final
    assert view.heads == ["L0H1", "L1H2"]
    assert view.target("L0H1") == (0, 1, final) and view.target("L1H2") == (1, 2, final)
    # The inspector shows the prompt's clean ids up to the final position, which closes its window.
    assert view.inspector._subject.batch.tokens[0].tolist() == task.clean[2, : final + 1].tolist()
    assert view.inspector.window.queries[-1] == final


def test_open_moves_the_inspector_and_sends_the_heads_why_row(view, monkeypatch) -> None:
    sent: list[dict] = []
    monkeypatch.setattr(view.inspector, "send", sent.append)
    view.inspector.group_kv = True  # a KV group has no why panel: opening a head shows the head itself
    note = view.open("L1H2")
    inspector = view.inspector
    assert (inspector.layer, inspector.head, inspector.query, inspector.group_kv) == (1, 2, view.query, False)
    assert "L1H2 opened" in note and f"query {view.query}" in note
    (message,) = sent
    assert message["key"] == f"{inspector.meta['key']}|1/2/{view.query}"
    assert message["row"] == inspector.why(view.query, layer=1, head=2)
    assert (message["row"]["layer"], message["row"]["head"], message["row"]["query"]) == (1, 2, view.query)
    view.open("L0H1")
    assert sent[1]["row"]["key_side"] != message["row"]["key_side"], "two heads sent the same why row"


def test_open_and_the_page_go_back_to_the_window_of_the_final_position(view, monkeypatch) -> None:
    monkeypatch.setattr(view.inspector, "send", lambda message: None)
    view.inspector.tokens, view.inspector.start = 2, 0  # the user moved to a window without the final position
    assert view.query not in view.inspector.window.queries
    data = page_data(view.render_html())
    assert data["meta"]["queries"][-1] == view.query and data["why"]["queries"] == [view.query]
    view.open("L1H2")
    assert view.query in view.inspector.window.queries
    assert (view.inspector.layer, view.inspector.head, view.inspector.query) == (1, 2, view.query)


def test_displayed_the_view_is_the_circuits_image_then_one_widget_both_naming_it(view, monkeypatch) -> None:
    # Failed before: the cell held a plotly FigureWidget (its repr, 120k characters, in every export), an HTML note
    # widget and the inspector, whose still was found by its position (the output just before the widget's).
    import IPython.display

    shown: list = []
    monkeypatch.setattr(
        IPython.display, "display", lambda *objects, **kwargs: shown.extend((o, kwargs) for o in objects)
    )
    view._ipython_display_()
    (image, said), (widget, _) = shown
    assert widget is view.inspector  # one widget: it draws the circuit itself, beside its view
    assert said["metadata"]["contribution_lens"] == {"circuit": True, "widget": view.inspector.model_id}
    assert image["text/plain"].startswith("The circuit (Circuit(node level: 3 of 10 nodes)). The inspector's last view")
    circuit = view.inspector.circuit  # what the live widget draws and what a click opens
    assert circuit["nodes"] == view.page_data()["nodes"] and circuit["query"] == view.query
    assert circuit["window"] == {"start": view.inspector.start, "tokens": view.inspector.tokens}
    (nodes,) = [trace for trace in json.loads(json.dumps(circuit["figure"]))["data"] if trace.get("name") == "nodes"]
    assert set(nodes["customdata"]) == {"embed", *NODES, "logits"}
    # The inspector's still names the widget too, so that the widget finds it in the cell by identity.
    assert view.inspector._still.widget == view.inspector.model_id


def test_the_page_embeds_exactly_the_circuits_heads_at_the_final_position(view, model) -> None:
    data = page_data(view.render_html())
    circuit = data["circuit"]
    heads = {node: (t["layer"], t["head"]) for node, t in circuit["nodes"].items() if "layer" in t}
    assert heads == {"L0H1": (0, 1), "L1H2": (1, 2)}
    assert set(circuit["nodes"]) == {"embed", *NODES, "logits"}
    assert circuit["query"] == view.query and circuit["prompt"] == 2
    assert data["why"]["queries"] == [view.query]
    assert sorted(int(layer) for layer in data["layers"]) == data["meta"]["layers"] == [0, 1]
    rows = data["why"]["rows"]
    # Every head of the page's layers (its menus open them too), hence every head of the circuit.
    assert set(rows) == {f"{layer}/{h}/{view.query}" for layer in (0, 1) for h in range(model.cfg.n_heads)}
    for layer, head in heads.values():
        embedded, own = rows[f"{layer}/{head}/{view.query}"], view.inspector.why(view.query, layer=layer, head=head)
        assert (embedded["layer"], embedded["head"], embedded["keys"]) == (layer, head, own["keys"])
        for side in ("key_side", "query_side"):  # the page's split of every head agrees with the head's own
            assert [s["names"] for s in embedded[side]] == [s["names"] for s in own[side]]
            values = [[*s["values"], s["other"]] for s in embedded[side]]
            np.testing.assert_allclose(values, [[*s["values"], s["other"]] for s in own[side]], atol=1e-5)
    # The figure drawn is the circuit's: its nodes' marker names them all.
    (nodes,) = [trace for trace in circuit["figure"]["data"] if trace.get("name") == "nodes"]
    assert set(nodes["customdata"]) == {"embed", *NODES, "logits"}


def test_circuit_tables_draw_each_kept_edge_into_every_head_reading_it() -> None:
    graph = cl.circuits.Graph(n_layers=2, n_heads=4, n_kv_heads=2, pos_embed=False)
    circuit = cl.Circuit.from_edges(graph, ["embed->L1KV0<k>", "L0H1->L1H0<q>", "L1H1->logits", "L0.mlp->L1.mlp"])
    nodes, edges = circuit_tables(circuit)
    drawn = set(zip(edges["upstream"], edges["downstream"], edges["input"], strict=True))
    # The k input of KV group 0 is read by query heads 0 and 1; L1.mlp is in the circuit (its input is kept).
    assert drawn == {("embed", "L1H0", "k"), ("embed", "L1H1", "k"), ("L0H1", "L1H0", "q"), ("L1H1", "logits", ""),
                     ("L0.mlp", "L1.mlp", "")}  # fmt: skip
    assert edges["score"].eq(1.0).all() and nodes["score"].isna().all()
    assert set(circuit_tables(circuit, max_edges=2)[1].index) == {0, 1}


def test_node_targets_say_what_every_kind_of_node_does() -> None:
    targets = node_targets(["embed", "pos_embed", "L3H0", "L3.mlp", "logits"], query=9, prompt=1)
    assert targets["L3H0"] == {"layer": 3, "head": 0, "note": targets["L3H0"]["note"]}
    assert "query 9, prompt 1's final position" in targets["L3H0"]["note"]
    for node, what in (("embed", "an embedding"), ("pos_embed", "an embedding"), ("L3.mlp", "an MLP"),
                       ("logits", "the logits")):  # fmt: skip
        assert set(targets[node]) == {"note"} and targets[node]["note"].startswith(f"{node} is {what}:")


@pytest.mark.usefixtures("as_a_user")
@pytest.mark.parametrize(
    ("node", "message"),
    [
        ("L1.mlp", "node 'L1.mlp': L1.mlp is an MLP: it has no attention pattern"),
        ("L1H3", "node 'L1H3' is not a node of this circuit (its heads: L0H1, L1H2)"),
        ("logits", "node 'logits': logits is the logits"),
        (3, "node 3 is not a node of this circuit"),
    ],
)
def test_a_node_that_is_no_head_of_the_circuit_is_refused_naming_node(view, node, message) -> None:
    before = (view.inspector.layer, view.inspector.head, view.inspector.query)
    with pytest.raises(InspectorError, match=re.escape(message)):
        view.open(node)
    assert (view.inspector.layer, view.inspector.head, view.inspector.query) == before


@pytest.mark.usefixtures("as_a_user")
@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"prompt": 3}, "prompt 3 is not a prompt of the task: it has 3 prompts (0..2)"),
        ({"prompt": -1}, "prompt -1 is not a prompt of the task"),
        ({"prompt": 1.0}, "prompt must be the index of one of the task's 3 prompts (0..2)"),
        ({"prompt": True}, "prompt must be the index of one of the task's 3 prompts"),
        ({"fraction": 0.5}, "fraction: a Circuit is shown as it is"),
        ({"level": "node"}, "level: a Circuit is shown as it is"),
        ({"tokens": 0}, "tokens must be a positive integer, got 0"),
        ({"max_edges": "all"}, "max_edges must be a positive integer, got str"),
        ({"circuit": "L0H1"}, "circuit must be a Circuit or CircuitScores, got str"),
        ({"task": "ioi"}, "task must be a contribution_lens Task, got str"),
    ],
)
def test_bad_arguments_are_refused_naming_them_before_any_pass(model, task, circuit, monkeypatch, arguments, message):
    import contribution_lens.views.circuit_view as circuit_view

    def no_pass(*args, **kwargs):
        raise AssertionError("the inspector was built before the arguments were checked")

    monkeypatch.setattr(circuit_view, "inspect", no_pass)
    given = {"task": task, "circuit": circuit, **arguments}
    with pytest.raises((ValueError, TypeError), match=re.escape(message)):
        cl.inspect_circuit(model, given.pop("task"), given.pop("circuit"), **given)


@pytest.mark.usefixtures("as_a_user")
def test_a_circuit_without_heads_or_of_another_model_is_refused(model, task) -> None:
    graph = cl.circuit_graph(model)
    with pytest.raises(ValueError, match=re.escape("holds no attention head, so no node opens the inspector")):
        cl.inspect_circuit(model, task, cl.Circuit.from_nodes(graph, ["L0.mlp"]))
    other = cl.circuit_graph(tiny_bridge("mha"))
    with pytest.raises(ValueError, match=re.escape("circuit: its graph (2 layers, 4 heads) is not the model's")):
        cl.inspect_circuit(model, task, cl.Circuit.from_nodes(other, ["L0H0"]))


def test_scores_choose_the_circuit_and_colour_it(model, task) -> None:
    graph = cl.circuit_graph(model)
    scores = cl.CircuitScores(
        "random", "given", graph, torch.linspace(-1, 1, len(graph.components)),
        torch.linspace(-2, 2, len(graph.edges)),
    )  # fmt: skip
    with pytest.raises(ValueError, match="fraction: circuit scores need the fraction"):
        cl.inspect_circuit(model, task, scores)
    view = cl.inspect_circuit(model, task, scores, fraction=0.3, level="node")
    assert view.circuit.chosen == scores.circuit(0.3, "node").chosen
    size = f"node level: {len(view.circuit.chosen)} of {len(graph.components)} nodes"
    title = view.figure.layout.annotations[0].text.replace("<br>", " ")
    assert title.startswith(f"{size} of given on random: "), title
    (nodes,) = [trace for trace in view.figure.data if trace.name == "nodes"]
    expected = dict(zip(scores.nodes["node"], scores.nodes["score"], strict=True))
    for name, hover in zip(nodes.customdata, nodes.hovertext, strict=True):
        if name in expected:
            assert f"score={expected[name]:.4g}" in hover
