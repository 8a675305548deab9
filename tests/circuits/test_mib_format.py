"""MIB's graph files both ways: circuits and scores written as EAP-IG's ``Graph.to_json`` writes them and read back,
a file written here the way MIB's code writes one (its naming rules, not this package's writer), grouped circuits
expanded to the group's query heads, the embeddings as MIB's one input node, and every bad file refused by name."""

import json
import re
from pathlib import Path

import pytest
import torch
from circuit_helpers import random_task

import architectures
import contribution_lens as cl
from conftest import assert_close, tiny_bridge


def mib_script_file(path: Path, cfg: dict, kept_of, score_of, node_score_of=None) -> dict:
    """A graph file as EAP-IG's ``Graph.from_model`` and ``to_json`` make one, from MIB's naming rules alone.

    Nodes: ``input``, per layer ``a{l}.h{h}`` then ``m{l}``, then ``logits``. Edges, in the order ``from_model``
    adds them: per layer, each node of the residual stream so far into every head's q, k and v
    (``parent->a{l}.h{h}<q>``), then each (the layer's heads now among them) into ``m{l}``; last, each into
    ``logits``. ``kept_of`` and ``score_of`` give an edge's ``in_graph`` and ``score`` by name;
    ``node_score_of`` (node-level files) a node's score. A node's ``in_graph`` is MIB's ``apply_topn``'s: an
    edge out of it kept and (but the input) one into it; the logits are always in the graph.
    """
    edges: dict[str, dict] = {}
    order = ["input"]
    residual = ["input"]
    for layer in range(cfg["n_layers"]):
        heads = [f"a{layer}.h{h}" for h in range(cfg["n_heads"])]
        for parent in residual:
            for head in heads:
                for qkv in "qkv":
                    edges[f"{parent}->{head}<{qkv}>"] = {}
        residual = [*residual, *heads]
        for parent in residual:
            edges[f"{parent}->m{layer}"] = {}
        residual.append(f"m{layer}")
        order += [*heads, f"m{layer}"]
    for parent in residual:
        edges[f"{parent}->logits"] = {}
    for name in edges:
        edges[name] = {"score": score_of(name), "in_graph": kept_of(name)}
    nodes: dict[str, dict] = {}
    for node in order:
        out = any(info["in_graph"] for name, info in edges.items() if name.split("->")[0] == node)
        into = node == "input" or any(
            info["in_graph"] for name, info in edges.items() if re.sub(r"<.>$", "", name.split("->")[1]) == node
        )
        nodes[node] = {"in_graph": out and into}
        if node_score_of is not None and node != "input":
            nodes[node]["score"] = node_score_of(node)
    nodes["logits"] = {"in_graph": True}
    content = {"cfg": cfg, "nodes": nodes, "edges": edges}
    with open(path, "w") as f:
        json.dump(content, f)
    return content


def ours(name: str) -> str:
    """MIB's node or edge name in this package's names (the embeddings as ``embed``)."""
    name = re.sub(r"a(\d+)\.h(\d+)", r"L\1H\2", name)
    return re.sub(r"\bm(\d+)", r"L\1.mlp", name).replace("input", "embed")


def theirs(name: str) -> str:
    name = re.sub(r"L(\d+)H(\d+)", r"a\1.h\2", name)
    return re.sub(r"L(\d+)\.mlp", r"m\1", name).replace("pos_embed", "input").replace("embed", "input")


@pytest.fixture(scope="module")
def model():
    return tiny_bridge("gqa", biases=True)


def _cfg(model, **extra) -> dict:
    return {"n_layers": 2, "n_heads": 4, "parallel_attn_mlp": False, "d_model": 32, **extra}


def _by_name(seed: int):
    """A reproducible pseudo-random number for any name (not this package's edge order)."""
    return lambda name: float(torch.randn(1, generator=torch.Generator().manual_seed(hash((seed, name)) % 2**31)))


def test_a_file_written_as_mibs_code_writes_it_is_read_edge_by_edge(model, tmp_path) -> None:
    score = _by_name(0)
    content = mib_script_file(tmp_path / "mib.json", _cfg(model), lambda name: score(name) > 0.5, score)
    circuit = cl.Circuit.from_mib(model, tmp_path / "mib.json")
    graph = circuit.graph
    assert graph.counting == "mib" and len(graph.edges) == len(content["edges"])
    assert set(circuit.edges) == {ours(name) for name, info in content["edges"].items() if info["in_graph"]}
    scores = cl.CircuitScores.from_mib(model, tmp_path / "mib.json")
    assert (scores.task, scores.method, scores.edge_scores is not None) == ("mib", "mib", True)
    want = torch.tensor([content["edges"][theirs(name)]["score"] for name in graph.edges])
    assert_close(scores.edge_scores, want)
    assert_close(scores.component_scores, torch.tensor([
        sum(info["score"] for name, info in content["edges"].items() if name.split("->")[0] == theirs(node))
        for node in graph.components
    ]), atol=1e-5)  # fmt: skip


def test_what_is_written_is_the_file_mibs_code_writes(model, tmp_path) -> None:
    """A circuit (every score 0) and edge scores (nothing in the graph but the logits), written here and by the
    script: the same JSON, key for key and in the same order."""
    task = random_task(model)
    scores = cl.circuit_scores(model, task, method="eap", edges="mib")
    circuit = scores.circuit(0.2)
    kept = set(circuit.edges)
    want = mib_script_file(tmp_path / "circuit-want.json", _cfg(model, model_name="native"),
                           lambda name: ours(name) in kept, lambda name: 0.0)  # fmt: skip
    got = json.loads(circuit.to_mib(tmp_path / "circuit.json").read_text())
    assert got == want and list(got["edges"]) == list(want["edges"]) and list(got["nodes"]) == list(want["nodes"])
    values = dict(zip(scores.graph.edges, scores.edge_scores.tolist(), strict=True))
    cfg = _cfg(model, model_name="native", task="random", method="eap")
    # MIB's sign: larger means keep, so an effect m(patched) - m(clean) is written negated
    want = mib_script_file(tmp_path / "scores-want.json", cfg, lambda name: False, lambda name: -values[ours(name)])
    assert json.loads(scores.to_mib(tmp_path / "scores.json").read_text()) == want


def test_circuits_and_scores_make_the_round_trip(model, tmp_path) -> None:
    task = random_task(model)
    scores = cl.circuit_scores(model, task, method="eap", edges="mib")
    back = cl.CircuitScores.from_mib(model, scores.to_mib(tmp_path / "scores.json"))
    assert (back.task, back.method, back.graph) == (scores.task, scores.method, scores.graph)
    assert_close(back.edge_scores, -scores.edge_scores, rtol=0, atol=0)
    for fraction, absolute in [(0.05, False), (0.05, True), (0.3, False)]:
        assert back.circuit(fraction, absolute=absolute).edges == scores.circuit(fraction, absolute=absolute).edges
    for circuit in (scores.circuit(0.1), scores.circuit(0.5, "node")):
        read = cl.Circuit.from_mib(model, circuit.to_mib(tmp_path / "circuit.json"))
        assert read.edges == circuit.edges and read.graph == circuit.graph


def test_node_level_scores_are_written_as_mibs_node_scores(model, tmp_path) -> None:
    task = random_task(model)
    scores = cl.circuit_scores(model, task, method="activation-patching", edges="mib")
    content = json.loads(scores.to_mib(tmp_path / "nodes.json").read_text())
    assert "score" not in content["nodes"]["input"] and "score" not in content["nodes"]["logits"]
    assert content["nodes"]["a1.h2"]["score"] == -float(scores.component_scores[scores.graph.components.index("L1H2")])
    assert all(info == {"score": 0.0, "in_graph": False} for info in content["edges"].values())
    back = cl.CircuitScores.from_mib(model, tmp_path / "nodes.json")
    assert back.edge_scores is None and torch.equal(back.component_scores, -scores.component_scores)
    node_file = mib_script_file(tmp_path / "script.json", _cfg(model), lambda n: False, lambda n: 0.0, _by_name(2))
    read = cl.CircuitScores.from_mib(model, tmp_path / "script.json")
    want = [node_file["nodes"][theirs(name)]["score"] for name in read.graph.components]
    assert_close(read.component_scores, torch.tensor(want))


def test_a_native_grouped_circuit_is_written_with_each_key_heads_edges_as_its_query_heads(model, tmp_path) -> None:
    native = cl.circuit_graph(model)
    circuit = cl.Circuit.from_edges(native, ["embed->L1KV1<k>", "L0H3->L1KV0<v>", "L0.mlp->L1H1<q>"])
    content = json.loads(circuit.to_mib(tmp_path / "grouped.json").read_text())
    kept = {name for name, info in content["edges"].items() if info["in_graph"]}
    assert kept == {"input->a1.h2<k>", "input->a1.h3<k>", "a0.h3->a1.h0<v>", "a0.h3->a1.h1<v>", "m0->a1.h1<q>"}
    assert cl.Circuit.from_mib(model, tmp_path / "grouped.json", edges="native").edges == circuit.edges
    scores = cl.circuit_scores(model, random_task(model), method="eap")
    with pytest.warns(UserWarning, match="split evenly over its group's query heads"):
        scores.to_mib(tmp_path / "native-scores.json")
    back = cl.CircuitScores.from_mib(model, tmp_path / "native-scores.json", edges="native")
    assert_close(back.edge_scores, -scores.edge_scores, atol=1e-6)


def test_the_embeddings_are_mibs_one_input_node(tmp_path) -> None:
    """Learned positions: ``input``'s edge is kept where either embedding's is, and scores their sum; read back,
    both are kept and share the score evenly, so what was read writes the same file again."""
    gpt2 = cl.load_model(str(architectures.build("GPT2LMHeadModel", tmp_path / "gpt2")))
    graph = cl.circuit_graph(gpt2, edges="mib")
    circuit = cl.Circuit.from_edges(graph, ["embed->L0H1<q>", "pos_embed->L0H1<q>", "pos_embed->L1.mlp"])
    with pytest.warns(UserWarning, match="1 inputs keep the edge from embed or from pos_embed but not both"):
        content = json.loads(circuit.to_mib(tmp_path / "circuit.json").read_text())
    kept = {name for name, info in content["edges"].items() if info["in_graph"]}
    assert kept == {"input->a0.h1<q>", "input->m1"}
    assert set(cl.Circuit.from_mib(gpt2, tmp_path / "circuit.json").edges) == {
        "embed->L0H1<q>", "pos_embed->L0H1<q>", "embed->L1.mlp", "pos_embed->L1.mlp"
    }  # fmt: skip
    scores = cl.circuit_scores(gpt2, random_task(gpt2), method="eap", edges="mib")
    first = json.loads(scores.to_mib(tmp_path / "scores.json").read_text())
    e = scores.edge_scores
    want = -(float(e[graph.edge_ids["embed->L1H2<v>"]]) + float(e[graph.edge_ids["pos_embed->L1H2<v>"]]))
    assert first["edges"]["input->a1.h2<v>"]["score"] == pytest.approx(want, rel=1e-6)
    read = cl.CircuitScores.from_mib(gpt2, tmp_path / "scores.json")
    assert float(read.edge_scores[graph.edge_ids["embed->L1H2<v>"]]) == pytest.approx(want / 2, rel=1e-6)
    again = json.loads(read.to_mib(tmp_path / "again.json").read_text())
    assert list(again["edges"]) == list(first["edges"])
    values = [[info["score"] for info in content["edges"].values()] for content in (again, first)]
    assert values[0] == pytest.approx(values[1], rel=1e-6, abs=1e-9)


def _write(path: Path, content) -> Path:
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


@pytest.mark.parametrize(("change", "message"), [
    ({"n_layers": 3}, "n_layers 3 in the file, 2 in the model"),
    ({"n_heads": 8, "d_model": 64}, "n_heads 8 in the file, 4 in the model; d_model 64 in the file, 32 in the model"),
    ({"model_name": "gpt2"}, "model_name 'gpt2' in the file, 'native' in the model"),
    ({"parallel_attn_mlp": True}, "parallel_attn_mlp true in the file"),
])  # fmt: skip
def test_a_file_of_another_model_is_refused_naming_what_differs_before_anything_else(model, tmp_path, change, message):
    content = mib_script_file(tmp_path / "mib.json", _cfg(model), lambda n: False, lambda n: 0.0)
    content["cfg"] |= change
    content["nodes"]["a9.h0"] = {"in_graph": True}  # unknown here: the cfg is refused first
    path = _write(tmp_path / "other.json", content)
    for read in (cl.Circuit.from_mib, cl.CircuitScores.from_mib):
        with pytest.raises(ValueError, match=rf"^path: {re.escape(str(path))}: a graph of another model: .*{message}"):
            read(model, path)


def test_bad_files_are_refused_naming_the_file(model, tmp_path) -> None:
    good = mib_script_file(tmp_path / "good.json", _cfg(model), lambda n: False, lambda n: 0.0)
    cases = {
        "missing.json": (None, "no such file"),
        "folder": (None, "not a file"),
        "broken.json": ('{"cfg": ', ": not a JSON file"),
        "list.json": ([1, 2], ": not a MIB graph: the JSON is not an object"),
        "no-edges.json": ({"cfg": good["cfg"], "nodes": good["nodes"]}, ": not a MIB graph: it has no 'edges'"),
        "cfg.json": ({**good, "cfg": {"n_layers": 2}}, ": its cfg has no 'n_heads'"),
        "node.json": ({**good, "nodes": {**good["nodes"], "a0.h7": {"in_graph": False}}}, ": unknown node 'a0.h7'"),
        "edge.json": ({**good, "edges": {"m1->a0.h0<q>": {"score": 0.0, "in_graph": True}}}, ": unknown edge 'm1->a0"),
        "info.json": ({**good, "edges": {"input->m0": {"score": "high", "in_graph": True}}}, "score must be a number"),
        "flag.json": ({**good, "edges": {"input->m0": {"score": 1.0}}}, ": edge 'input->m0' must be an object with"),
    }
    (tmp_path / "folder").mkdir()
    partial = {**good["nodes"], "a0.h0": {"in_graph": False, "score": 1.0}}
    cases["scores.json"] = ({**good, "nodes": partial}, ": node 'a0.h1' has no score where other heads")
    for name, (content, message) in cases.items():
        path = tmp_path / name if content is None else _write(tmp_path / name, content)
        for read in (cl.Circuit.from_mib, cl.CircuitScores.from_mib):
            with pytest.raises(ValueError, match=f"^path: {re.escape(str(path))}: .*{re.escape(message.lstrip(': '))}"):
                read(model, path)
    with pytest.raises(ValueError, match=r"^edges must be 'native' .*, got 'grouped'"):
        cl.Circuit.from_mib(model, tmp_path / "good.json", edges="grouped")
    by_hand = cl.circuits.Graph(2, 4, 2, False, "mib")  # no model: its width is unknown
    with pytest.raises(ValueError, match=r"^graph: MIB's files carry the model's width \(d_model\)"):
        cl.Circuit(by_hand, torch.zeros(len(by_hand.edges), dtype=torch.bool)).to_mib(tmp_path / "x.json")
