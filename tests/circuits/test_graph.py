"""The circuit graph: its nodes, inputs and edges, counted and named, for every attention form."""

import pytest

import contribution_lens as cl
from conftest import VARIANTS, tiny_bridge


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_edges_join_every_upstream_node_to_every_downstream_input(variant) -> None:
    graph = cl.circuit_graph(tiny_bridge(variant))
    n_heads, n_kv = VARIANTS[variant]
    assert (graph.n_layers, graph.n_heads, graph.n_kv_heads, graph.pos_embed) == (2, n_heads, n_kv, False)
    assert graph.nodes == ["embed", *[f"L0H{h}" for h in range(4)], "L0.mlp", *[f"L1H{h}" for h in range(4)],
                           "L1.mlp", "logits"]  # fmt: skip
    attention_inputs = n_heads + 2 * n_kv
    # layer 0 reads embed; its MLP also its heads; layer 1 reads all of layer 0; the logits read every writer
    want = attention_inputs * 1 + 5 + attention_inputs * 6 + 10 + 11
    assert len(graph.edges) == want == len(set(graph.edges))
    assert "L0H1->L1H2<q>" in graph.edge_ids and "L0.mlp->logits" in graph.edge_ids
    assert "L1H0->L1.mlp" in graph.edge_ids and "L1H0->L1H1<q>" not in graph.edge_ids


def test_key_and_value_inputs_are_one_per_key_head_under_gqa() -> None:
    gqa = cl.circuit_graph(tiny_bridge("gqa"))
    assert gqa.inputs[:8] == [
        "L0H0<q>",
        "L0H1<q>",
        "L0H2<q>",
        "L0H3<q>",
        "L0KV0<k>",
        "L0KV1<k>",
        "L0KV0<v>",
        "L0KV1<v>",
    ]
    assert gqa.input_nodes[5] == ["L0H2", "L0H3"]
    mha = cl.circuit_graph(tiny_bridge("mha"))
    assert mha.inputs[4:6] == ["L0H0<k>", "L0H1<k>"], "under MHA the names are MIB's"


def test_learned_positions_are_a_node(tmp_path) -> None:
    import architectures

    model = cl.load_model(str(architectures.build("GPT2LMHeadModel", tmp_path / "gpt2")))
    graph = cl.circuit_graph(model)
    assert graph.nodes[:3] == ["embed", "pos_embed", "L0H0"]
    assert "pos_embed->L0H0<k>" in graph.edge_ids


def test_a_node_level_circuit_keeps_every_edge_out_of_its_nodes() -> None:
    graph = cl.circuit_graph(tiny_bridge("gqa"))
    circuit = cl.Circuit.from_nodes(graph, ["L0H2"])
    assert circuit.nodes == ["embed", "L0H2", "logits"]
    assert set(circuit.edges) == {e for e in graph.edges if e.split("->")[0] in ("embed", "L0H2")}
    edge = cl.Circuit.from_edges(graph, ["L0H1->L1KV0<k>"])
    assert edge.nodes == ["L0H1", "L1H0", "L1H1"] and edge.edges == ["L0H1->L1KV0<k>"]
