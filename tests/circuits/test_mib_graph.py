"""MIB's ungrouped edge counting (``edges="mib"``): every query head its own k and v inputs, for real.

The graph's names and counts; the interchange identities on grouped- and multi-query checkpoints (every edge
kept is the clean pass, none the counterfactual's, a node-level circuit is node patching, a grouped circuit is
the native graph's); an oracle that computes ungrouped attention without the wiring (a multi-head twin whose
key and value heads are the grouped model's repeated); EAP against finite differences; every method scoring
the graph; bfloat16."""

from pathlib import Path

import pytest
import torch
from circuit_helpers import random_task
from test_attribution import _finite_difference

import architectures
import contribution_lens as cl
from conftest import VARIANTS, assert_close, tiny_bridge
from contribution_lens.circuits import interchange as ic
from contribution_lens.circuits.graph import Graph

CHECKPOINTS = ("Qwen2ForCausalLM", "Gemma3ForCausalLM")
FORMS = ["gqa-biases", "mqa", *CHECKPOINTS]
METHODS = ["eap", "eap-ig", "contribution", "activation-patching", "random", "information-flow-routes"]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, object]:
    built = {"gqa-biases": tiny_bridge("gqa", biases=True), "mqa": tiny_bridge("mqa")}
    folder = tmp_path_factory.mktemp("mib-checkpoints")
    for name in CHECKPOINTS:
        built[name] = cl.load_model(str(architectures.build(name, Path(folder) / name)))
    return built


def _mib_count(n_layers: int, n_heads: int) -> int:
    """Edges of MIB's ``Graph.from_model``: per layer, every upstream node into each head's q, k and v and into
    the MLP; every node into the logits (its ``n_forward`` nodes are the input, then each layer's heads and MLP)."""
    upstream = [1 + layer * (n_heads + 1) for layer in range(n_layers)]
    return sum(3 * n_heads * u + u + n_heads for u in upstream) + 1 + n_layers * (n_heads + 1)


def test_mibs_counting_gives_every_query_head_its_own_k_and_v_inputs() -> None:
    graph = Graph(n_layers=2, n_heads=4, n_kv_heads=2, pos_embed=False, counting="mib")
    assert graph.inputs[:13] == [
        *[f"L0H{h}<q>" for h in range(4)], *[f"L0H{h}<k>" for h in range(4)], *[f"L0H{h}<v>" for h in range(4)],
        "L0.mlp",
    ]  # fmt: skip
    assert graph.input_nodes[5] == ["L0H1"] and graph.input_nodes[9] == ["L0H1"]
    native = graph.recounted("native")
    assert native.inputs[4:8] == ["L0KV0<k>", "L0KV1<k>", "L0KV0<v>", "L0KV1<v>"]
    # each query head's k (v) input maps to its key head's: heads 0, 1 to key head 0, heads 2, 3 to key head 1
    assert [native.inputs[i] for i in graph.native_input[4:12].tolist()] == [
        "L0KV0<k>", "L0KV0<k>", "L0KV1<k>", "L0KV1<k>", "L0KV0<v>", "L0KV0<v>", "L0KV1<v>", "L0KV1<v>",
    ]  # fmt: skip
    assert len(graph.edges) == graph.n_edges() == native.n_edges("mib") == _mib_count(2, 4)
    assert len(native.edges) == native.n_edges() == graph.n_edges("native") < graph.n_edges()
    qwen = Graph(n_layers=24, n_heads=14, n_kv_heads=2, pos_embed=False)  # Qwen2.5-0.5B's sizes
    assert qwen.n_edges("mib") == _mib_count(24, 14) == 179_749 and qwen.n_edges() == 79_813


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_models_mib_graph_counts_its_heads_inputs(variant) -> None:
    model = tiny_bridge(variant)
    mib, native = cl.circuit_graph(model, edges="mib"), cl.circuit_graph(model)
    assert (mib.counting, native.counting) == ("mib", "native") and mib.d_model == 32
    assert len(mib.edges) == _mib_count(2, 4) and mib.n_edges("native") == len(native.edges)
    if variant == "mha":  # one query head a key head: the two countings are one graph
        assert (mib.inputs, mib.edges, mib.input_nodes) == (native.inputs, native.edges, native.input_nodes)
        assert torch.equal(mib.valid, native.valid)


def test_under_multi_head_attention_the_two_countings_score_and_evaluate_alike() -> None:
    model = tiny_bridge("mha", biases=True)
    task = random_task(model)
    mib = cl.circuit_scores(model, task, method="eap", edges="mib")
    native = cl.circuit_scores(model, task, method="eap")
    assert_close(mib.edge_scores, native.edge_scores, rtol=0, atol=1e-6)
    circuit = native.circuit(0.3)
    same = cl.Circuit.from_edges(mib.graph, circuit.edges)
    assert_close(cl.evaluate_circuit(model, task, same).patched, cl.evaluate_circuit(model, task, circuit).patched)


def test_a_grouped_circuit_moves_between_the_countings_and_an_ungrouped_one_has_no_native_form() -> None:
    native = Graph(n_layers=2, n_heads=4, n_kv_heads=2, pos_embed=True)
    circuit = cl.Circuit.from_edges(native, ["embed->L1KV1<k>", "L0H2->L1KV0<v>", "L0.mlp->L1H3<q>"])
    mib = circuit.with_edges("mib")
    assert set(mib.edges) == {"embed->L1H2<k>", "embed->L1H3<k>", "L0H2->L1H0<v>", "L0H2->L1H1<v>", "L0.mlp->L1H3<q>"}
    assert mib.with_edges("native").edges == circuit.edges and mib.with_edges("mib") is mib
    ungrouped = cl.Circuit.from_edges(mib.graph, ["embed->L1H2<k>"])  # head 3 of the group does not keep it
    with pytest.raises(ValueError, match=r"^edges: the circuit keeps 'embed->L1H2<k>' differently from another "):
        ungrouped.with_edges("native")
    nodes = cl.Circuit.from_nodes(native, ["L0H1", "L1.mlp"]).with_edges("mib")
    assert nodes.level == "node" and nodes.chosen == ("L0H1", "L1.mlp") and nodes.graph == mib.graph
    with pytest.raises(ValueError, match=r"^edges must be 'native' .* or 'mib' .*, got 'ungrouped'"):
        circuit.with_edges("ungrouped")


def _passes(model, task, graph):
    rows = torch.arange(len(task))
    record, corrupted = ic.record(model, task, graph, rows, corrupted=True)
    _, clean = ic.record(model, task, graph, rows, corrupted=False)
    return rows, record, clean, corrupted


@pytest.mark.parametrize("form", FORMS)
def test_every_edge_kept_is_the_clean_pass_and_none_the_counterfactual(models, form) -> None:
    model = models[form]
    task = random_task(model)
    graph = cl.circuit_graph(model, edges="mib")
    rows, record, clean, corrupted = _passes(model, task, graph)
    # skip_unpatched=False: every query head's k and v recomputed from its own input, ungrouped.
    kept = ic.Interchange(
        graph, record.clone(), torch.zeros(graph.valid.shape), skip_unpatched=False, share_identical=False
    )
    assert_close(ic.patched_metric(model, task, rows, kept), clean, rtol=0, atol=1e-5)
    for share in (True, False):
        none = ic.Interchange(graph, record.clone(), graph.valid.float(), share_identical=share)
        assert_close(ic.patched_metric(model, task, rows, none), corrupted, rtol=0, atol=1e-5)
    every = cl.Circuit(graph, torch.ones(len(graph.edges), dtype=torch.bool))
    everything_but_one = cl.Circuit(graph, torch.arange(len(graph.edges)) != graph.edge_ids["embed->L1H1<k>"])
    assert abs(cl.evaluate_circuit(model, task, every).faithfulness - 1) < 1e-5
    assert abs(cl.evaluate_circuit(model, task, everything_but_one).faithfulness - 1) > 1e-7, "nothing was patched"


@pytest.mark.parametrize("form", FORMS)
def test_a_node_level_circuit_is_node_patching_and_a_grouped_one_the_native_graphs(models, form) -> None:
    model = models[form]
    task = random_task(model, seed=1)
    graph = cl.circuit_graph(model, edges="mib")
    rows, record, _, _ = _passes(model, task, graph)
    chosen = graph.components[::2]
    left_out = torch.tensor([name in graph.components and name not in chosen for name in graph.writers])
    direct = ic.patched_metric(model, task, rows, ic.NodePatch(graph, record, left_out))
    node_circuit = cl.Circuit.from_nodes(graph, chosen)
    assert_close(cl.evaluate_circuit(model, task, node_circuit).patched, direct, rtol=0, atol=1e-5)
    native = cl.circuit_graph(model)
    kept = torch.rand(len(native.edges), generator=torch.Generator().manual_seed(0)) < 0.5
    grouped = cl.Circuit(native, kept)
    on_mib = grouped.with_edges("mib")
    assert len(on_mib.edges) > len(grouped.edges)  # each kept k and v edge is its group's query heads' edges
    assert_close(
        cl.evaluate_circuit(model, task, on_mib).patched, cl.evaluate_circuit(model, task, grouped).patched, atol=1e-5
    )


def _multi_head_twin(model, variant: str):
    """A multi-head model computing what ``model`` computes, each key and value head repeated for its group."""
    twin = tiny_bridge("mha", biases=True)
    n_heads, n_kv = VARIANTS[variant]
    group = n_heads // n_kv
    source = dict(model.named_parameters())
    with torch.no_grad():
        for name, param in twin.named_parameters():
            value = source[name]
            if value.shape != param.shape:  # a k or v projection: [kv_head * d_head (, d_model)]
                heads = value.reshape(n_kv, -1, *value.shape[1:]).repeat_interleave(group, 0)
                value = heads.reshape(param.shape)
            param.copy_(value)
    return twin


@pytest.mark.parametrize("variant", ["gqa", "mqa"])
def test_ungrouped_attention_is_a_multi_head_twins(variant) -> None:
    """The twin's heads each have their own k and v projection: its native graph is the grouped model's MIB graph,
    edge for edge, computed without any ungrouping. A circuit keeping one query head's k edge and patching another
    head's of the same group, and EAP's scores, are the twin's."""
    model = tiny_bridge(variant, biases=True)
    twin = _multi_head_twin(model, variant)
    task = random_task(model, n=4, seed=3)
    graph, twins = cl.circuit_graph(model, edges="mib"), cl.circuit_graph(twin)
    assert graph.edges == twins.edges
    assert_close(ic.patched_metric(twin, task, torch.arange(4), ic.Null()),
                 ic.patched_metric(model, task, torch.arange(4), ic.Null()), atol=1e-5)  # fmt: skip
    kept = torch.rand(len(graph.edges), generator=torch.Generator().manual_seed(1)) < 0.5
    kept[graph.edge_ids["embed->L1H0<k>"]], kept[graph.edge_ids["embed->L1H1<k>"]] = True, False
    kept[graph.edge_ids["L0H2->L1H0<v>"]], kept[graph.edge_ids["L0H2->L1H1<v>"]] = False, True
    ours = cl.evaluate_circuit(model, task, cl.Circuit(graph, kept)).patched
    assert_close(ours, cl.evaluate_circuit(twin, task, cl.Circuit(twins, kept)).patched, atol=1e-5)
    every = cl.Circuit(graph, torch.ones_like(kept))
    assert not torch.allclose(ours, cl.evaluate_circuit(model, task, every).patched)
    eap = cl.circuit_scores(model, task, method="eap", edges="mib").edge_scores
    assert_close(eap, cl.circuit_scores(twin, task, method="eap").edge_scores, atol=1e-6)


@pytest.mark.parametrize("variant", ["gqa", "mqa"])
def test_eap_on_mibs_graph_is_gradient_times_difference(variant) -> None:
    """Every kind of edge, two query heads of one group apart, against central differences in float64."""
    model = tiny_bridge(variant, biases=True).to(torch.float64)
    task = random_task(model)
    graph = cl.circuit_graph(model, edges="mib")
    scores = cl.circuit_scores(model, task, method="eap", edges="mib")
    names = ["L0H1->L1H0<q>", "L0H1->L1H0<k>", "L0H1->L1H1<k>", "L0H1->L1H2<v>", "L0H1->L1H3<v>", "L0H1->L1.mlp"]
    for edge in [graph.edge_ids[name] for name in [*names, "embed->L0H3<k>", "L0.mlp->logits"]]:
        want = _finite_difference(model, task, graph, edge)
        got = float(scores.edge_scores[edge])
        assert abs(got - want) <= 1e-5 + 1e-4 * abs(want), (graph.edges[edge], got, want)


@pytest.mark.parametrize("method", METHODS)
def test_every_method_scores_mibs_graph_and_regrouped_its_scores_are_the_native_ones(models, method) -> None:
    """A gradient method's score of a shared input is the sum of its readers' (its gradient is the sum of theirs);
    the other methods' differ where the group's heads are told apart, but sum the same way for their own reasons:
    routes' k and v scores are sums over each input's readers, activation patching scores nodes."""
    model = models["gqa-biases"]
    task = random_task(model)
    mib = cl.circuit_scores(model, task, method=method, edges="mib")
    native = cl.circuit_scores(model, task, method=method)
    assert mib.graph.counting == "mib" and len(mib.graph.edges) == _mib_count(2, 4)
    if method == "random":
        assert mib.edge_scores.shape == (len(mib.graph.edges),)
    elif mib.edge_scores is None:
        assert_close(mib.component_scores, native.component_scores)
    elif method == "information-flow-routes":
        # MIB's routes score an input by the stream it reads, not by its readers: each query head's own k or v
        # input scores what the shared one does, so regrouped (summed over the group) they count the group's size
        group = native.graph.group
        times = torch.tensor([group if "KV" in name.split("->")[1] else 1 for name in native.graph.edges])
        assert_close(mib.with_edges("native").edge_scores, native.edge_scores * times, rtol=1e-5, atol=1e-6)
    else:
        assert_close(mib.with_edges("native").edge_scores, native.edge_scores, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(mib.edge_scores, mib.with_edges("native").with_edges("mib").edge_scores)
    level = "node" if mib.edge_scores is None else "edge"
    curve = cl.circuit_curve(model, task, mib, level, fractions=(0.5, 1.0))
    assert float((curve.faithfulness[:, -1] - 1.0).abs().max()) < 1e-4  # both selections, the whole graph


def test_a_bfloat16_pass_on_mibs_graph_stays_within_the_models_own_rounding(tmp_path) -> None:
    """bfloat16 weights, float32 sums: every edge kept and none kept are the model's own passes up to its rounding
    (the gap between its bfloat16 and float32 metrics), on both countings."""
    folder = architectures.build("Qwen2ForCausalLM", tmp_path / "qwen2")
    full, half = cl.load_model(str(folder)), cl.load_model(str(folder), dtype=torch.bfloat16)
    task = random_task(half, n=4)
    rows = torch.arange(len(task))
    _, full_clean = ic.record(full, task, cl.circuit_graph(full), rows, corrupted=False)
    for edges in ("native", "mib"):
        graph = cl.circuit_graph(half, edges=edges)
        record, corrupted = ic.record(half, task, graph, rows, corrupted=True)
        _, clean = ic.record(half, task, graph, rows, corrupted=False)
        rounding = float((clean - full_clean).abs().max())
        assert 0 < rounding < 0.1
        kept = ic.Interchange(graph, record.clone(), torch.zeros(graph.valid.shape), skip_unpatched=False,
                              share_identical=False)  # fmt: skip
        assert float((ic.patched_metric(half, task, rows, kept) - clean).abs().max()) <= 2 * rounding, edges
        none = ic.Interchange(graph, record.clone(), graph.valid.float(), share_identical=False)
        assert float((ic.patched_metric(half, task, rows, none) - corrupted).abs().max()) <= 2 * rounding, edges


def test_a_model_whose_keys_cannot_be_ungrouped_is_refused_for_mibs_graph(monkeypatch) -> None:
    import dataclasses

    from contribution_lens import adapter

    model = tiny_bridge("gqa")
    facts = adapter.anatomy_of(model)  # an attention whose key-head repeat the wiring cannot switch off
    monkeypatch.setattr(facts, "layers", tuple(dataclasses.replace(layer, ungrouping=None) for layer in facts.layers))
    with pytest.raises(ValueError, match=r"^edges: MIB's ungrouped graph cannot be wired into .*: layer 0's attention"):
        cl.circuit_graph(model, edges="mib")
    assert cl.circuit_graph(model).counting == "native"
    assert cl.circuit_graph(tiny_bridge("mha"), edges="mib").counting == "mib"  # nothing to ungroup
    with pytest.raises(ValueError, match=r"^edges must be 'native' .*, got 'MIB'"):
        cl.circuit_scores(model, random_task(model), method="random", edges="MIB")
