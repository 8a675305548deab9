"""Information flow routes. The final-position variant (``information-flow-routes-last``): non-negative, each
input's local importances normalised as the paper says (they sum to 1), the paper's proximity computed here from
the recorded outputs, and ALTI's own maths behind it. MIB's (``information-flow-routes``): a float64 port of
its formula (every position, averaged), written here with hooks of our own, and greedy selection by default."""

import pytest
import torch
from circuit_helpers import random_task

import contribution_lens as cl
from conftest import assert_close, tiny_bridge
from contribution_lens.circuits import interchange as ic
from contribution_lens.methods import alti


@pytest.mark.parametrize("variant", ["mha", "gqa"])
def test_scores_are_non_negative_and_normalised(variant) -> None:
    model = tiny_bridge(variant, biases=True).to(torch.float64)
    task = random_task(model)
    scores = cl.circuit_scores(model, task, method="information-flow-routes-last")
    graph = scores.graph
    assert bool((scores.edge_scores >= 0).all())
    writers, inputs = graph.edge_index
    into_logits = scores.edge_scores[inputs == len(graph.inputs) - 1].double()
    assert abs(float(into_logits.sum()) - 1.0) < 1e-5  # the logits' local importances, N(logits) = 1
    # A node's importance N(u) is spread over its inputs' edges: what reaches the last MLP it passes on.
    mlp = graph.writers.index(f"L{graph.n_layers - 1}.mlp")
    reaching = float(scores.edge_scores[(writers == mlp)].double().sum())
    lo, _ = graph.input_range("mlp", graph.n_layers - 1)
    assert abs(float(scores.edge_scores[inputs == lo].double().sum()) - reaching) < 1e-5


def test_the_logits_edges_are_the_papers_proximities() -> None:
    """``prox(c, x) = max(0, -||x - c||_1 + ||x||_1)`` normalised over the contributions, written out here."""
    model = tiny_bridge("gqa").to(torch.float64)
    task = random_task(model)
    graph = cl.circuit_graph(model)
    outputs, _ = ic.record(model, task, graph, torch.arange(len(task)), corrupted=False)
    final = []
    model.run_with_hooks(task.clean, fwd_hooks=[("ln_final.hook_in", lambda x, hook: final.append(x.detach()))])
    want = torch.zeros(len(graph.writers), dtype=torch.float64)
    for p in range(len(task)):
        x = final[0][p, task.last[p]]
        proximity = [max(0.0, float(-(x - c).abs().sum() + x.abs().sum())) for c in outputs[:, p, task.last[p]]]
        want += torch.tensor(proximity) / sum(proximity)
    scores = cl.circuit_scores(model, task, method="information-flow-routes-last")
    writers, inputs = graph.edge_index
    got = scores.edge_scores[inputs == len(graph.inputs) - 1].double()
    assert_close(got, want[writers[inputs == len(graph.inputs) - 1]] / len(task), atol=1e-6, rtol=1e-5)


def test_the_proximity_is_altis() -> None:
    """ALTI's contributions are its `manhattan_proximity` of each token's transformed vector, normalised."""
    generator = torch.Generator().manual_seed(0)
    pattern = torch.softmax(torch.randn(1, 2, 3, 3, generator=generator), -1).tril()
    pattern = pattern / pattern.sum(-1, keepdim=True)
    v = torch.randn(1, 3, 2, 4, generator=generator)
    W_O = torch.randn(2, 4, 5, generator=generator)
    resid = torch.randn(1, 3, 5, generator=generator)
    valid = torch.ones(3, 3, dtype=torch.bool).tril()[None]
    got = alti.alti_contributions(pattern, v, W_O, None, resid, valid)
    vt = torch.einsum("bkhd,hde->bhke", v, W_O)
    parts = (
        torch.einsum("bhqk,bhke->bqke", pattern, vt)
        + torch.diag_embed(torch.ones(3))[None, :, :, None] * resid[:, :, None]
    )
    proximity = torch.where(valid, alti.manhattan_proximity(parts, parts.sum(2)), 0)
    assert_close(got, proximity / proximity.sum(-1, keepdim=True), atol=1e-6, rtol=1e-5)


def _mib_reference(model, task, graph) -> torch.Tensor:
    """MIB's ``get_scores_information_flow_routes`` in float64, written out: at every real position of every prompt,
    each upstream output's proximity to the stream an input reads, normalised over the upstream outputs (0 where none
    is positive), averaged over the positions, then over the prompts. ``[writer input]``."""
    outputs, _ = ic.record(model, task, graph, torch.arange(len(task)), corrupted=False)
    streams: dict[str, torch.Tensor] = {}

    def keep(name):
        def hook(x, hook):
            streams[name] = x.detach().double()

        return hook

    groups = [("logits", 0, "ln_final.hook_in")]
    groups += [
        (kind, layer, f"blocks.{layer}.hook_resid_{side}")
        for layer in range(graph.n_layers)
        for kind, side in (("q", "pre"), ("mlp", "mid"))
    ]
    model.run_with_hooks(task.clean, fwd_hooks=[(name, keep(name)) for _, _, name in groups])
    want = torch.zeros(graph.valid.shape, dtype=torch.float64)
    for kind, layer, name in groups:
        start, end = graph.input_group(kind, layer)
        upstream = int(graph.upstream[start])
        for p in range(len(task)):
            total = torch.zeros(upstream, dtype=torch.float64)
            for t in range(int(task.last[p]) + 1):
                x = streams[name][p, t]
                proximity = torch.tensor(
                    [
                        max(0.0, float(x.abs().sum() - (x - outputs[u, p, t].double()).abs().sum()))
                        for u in range(upstream)
                    ]
                )
                total += proximity / proximity.sum() if float(proximity.sum()) > 0 else proximity
            want[:upstream, start:end] += (total / (int(task.last[p]) + 1))[:, None]
    return want / len(task)


@pytest.mark.parametrize("variant", ["mha", "gqa"])
def test_mibs_routes_match_a_float64_port_of_their_formula(variant) -> None:
    model = tiny_bridge(variant, biases=True).to(torch.float64)
    task = random_task(model)  # its last prompt right-padded: padding positions are left out of the mean
    graph = cl.circuit_graph(model)
    scores = cl.circuit_scores(model, task, method="information-flow-routes")
    writers, inputs = graph.edge_index
    want = _mib_reference(model, task, graph)[writers, inputs]
    assert_close(scores.edge_scores.double(), want, atol=1e-6, rtol=1e-5)
    # Every input's scores sum to 1 over its upstream nodes (each position's importances do).
    sums = torch.zeros(len(graph.inputs), dtype=torch.float64).index_add_(0, inputs, scores.edge_scores.double())
    assert_close(sums, torch.ones_like(sums), atol=1e-5, rtol=0)


def test_mibs_routes_differ_from_the_final_position_variant_and_are_chosen_greedily() -> None:
    model = tiny_bridge("gqa", biases=True)
    task = random_task(model)
    mib = cl.circuit_scores(model, task, method="information-flow-routes")
    last = cl.circuit_scores(model, task, method="information-flow-routes-last")
    assert float((mib.edge_scores - last.edge_scores).abs().max()) > 1e-2
    assert (mib.orientation.name, mib.greedy, last.orientation.name, last.greedy) == (
        "importance",
        True,
        "importance",
        False,
    )
    graph = mib.graph
    greedy, top = mib.ranking(greedy=None), mib.ranking(greedy=False)
    assert not torch.equal(greedy, top)
    into_logits = graph.edge_index[1][greedy[0]] == len(graph.inputs) - 1
    assert bool(into_logits)  # greedy starts from the logits
    assert mib.circuit(0.1).edges == mib.circuit(0.1, greedy=True).edges != mib.circuit(0.1, greedy=False).edges
    # Non-negative scores: signed and |score| selections are one circuit.
    assert torch.equal(mib.ranking(absolute=False), mib.ranking(absolute=True))
