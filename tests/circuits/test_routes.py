"""Information flow routes: non-negative, each input's local importances normalised as the paper says (they
sum to 1), the paper's proximity computed here from the recorded outputs, and ALTI's own maths behind it."""

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
    scores = cl.circuit_scores(model, task, method="information-flow-routes")
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
    scores = cl.circuit_scores(model, task, method="information-flow-routes")
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
