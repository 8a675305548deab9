"""The circuit methods: EAP against finite differences of the patched pass in float64, activation patching
against the node-level evaluation, EAP-IG's steps, the random control and a user's own method."""

import pytest
import torch
from circuit_helpers import random_task

import contribution_lens as cl
from conftest import assert_close, tiny_bridge
from contribution_lens.circuits import interchange as ic


def _finite_difference(model, task, graph, edge: int, step: float = 1e-4) -> float:
    """``d/dt mean_p m_p`` with a share ``t`` of edge ``edge``'s difference patched in, by central differences."""
    rows = torch.arange(len(task))
    record, _ = ic.record(model, task, graph, rows, corrupted=True)
    writers, inputs = graph.edge_index
    values = []
    for t in (step, -step):
        patch = torch.zeros(graph.valid.shape, dtype=torch.float64)
        patch[writers[edge], inputs[edge]] = t
        values.append(ic.patched_metric(model, task, rows, ic.Interchange(graph, record.clone(), patch)).mean())
    return float((values[0] - values[1]) / (2 * step))


@pytest.mark.parametrize("variant", ["mha", "gqa", "mqa"])
def test_eap_is_gradient_times_difference(variant) -> None:
    """Every kind of edge (into q, k, v, an MLP and the logits) against finite differences in float64."""
    model = tiny_bridge(variant, biases=True).to(torch.float64)
    task = random_task(model)
    graph = cl.circuit_graph(model)
    scores = cl.circuit_scores(model, task, method="eap")
    into_layer_1 = ["L1H0<q>", "<k>", "<v>", "L1.mlp"]
    chosen = [
        next(i for i, name in enumerate(graph.edges) if name.startswith("L0H1->L1") and name.endswith(end))
        for end in into_layer_1
    ]
    chosen.append(graph.edge_ids["L0.mlp->logits"])
    chosen += [i for i, name in enumerate(graph.edges) if name.startswith("L0H1->")][:4]
    for edge in chosen:
        want = _finite_difference(model, task, graph, edge)
        got = float(scores.edge_scores[edge])
        assert abs(got - want) <= 1e-5 + 1e-4 * abs(want), (graph.edges[edge], got, want)


def test_eap_node_scores_are_the_sums_of_their_edges() -> None:
    model = tiny_bridge("gqa")
    scores = cl.circuit_scores(model, random_task(model), method="eap")
    edges = scores.edges
    for node, score in zip(scores.nodes["node"], scores.nodes["score"], strict=True):
        assert abs(edges.loc[edges["source"] == node, "score"].sum() - score) < 1e-5, node


def test_activation_patching_is_the_node_level_evaluation_of_all_but_one() -> None:
    model = tiny_bridge("gqa", biases=True)
    task = random_task(model, n=4, seed=2)
    scores = cl.circuit_scores(model, task, method="activation-patching")
    assert scores.edge_scores is None and scores.edges.empty
    graph = scores.graph
    for index, name in enumerate(graph.components):
        result = cl.evaluate_circuit(
            model, task, cl.Circuit.from_nodes(graph, [n for n in graph.components if n != name])
        )
        assert_close(scores.component_scores[index], (result.patched - result.clean).mean(), rtol=0, atol=1e-5)


def test_eap_ig_takes_mibs_five_steps_and_its_first_step_alone_differs_from_eap() -> None:
    model = tiny_bridge("mha")
    task = random_task(model)
    five = cl.circuit_scores(model, task, method="eap-ig")
    assert torch.equal(five.edge_scores, cl.circuit_scores(model, task, method="eap-ig", steps=5).edge_scores)
    one = cl.circuit_scores(model, task, method="eap-ig", steps=1)  # the gradient at the counterfactual's embeddings
    eap = cl.circuit_scores(model, task, method="eap")  # the gradient at the clean ones
    assert not torch.allclose(one.edge_scores, eap.edge_scores)
    assert bool(torch.isfinite(five.edge_scores).all())


def test_random_scores_follow_the_seed() -> None:
    model = tiny_bridge("mqa")
    task = random_task(model)
    a, b = (cl.circuit_scores(model, task, method="random", seed=s).edge_scores for s in (0, 0))
    assert torch.equal(a, b)
    assert not torch.equal(a, cl.circuit_scores(model, task, method="random", seed=1).edge_scores)


def test_a_users_method_is_one_call() -> None:
    model = tiny_bridge("gqa")
    task = random_task(model)

    def later_first(model, task, context):
        return torch.arange(len(context.graph.components), dtype=torch.float32)

    cl.register_circuit_method("later-first", later_first, level="node")
    try:
        scores = cl.circuit_scores(model, task, method="later-first")
        assert scores.circuit(0.2, level="node").nodes[-2:] == ["L1.mlp", "logits"]
        curve = cl.circuit_curve(model, task, scores, level="node")
        assert curve.faithfulness.shape == (2, 10)  # signed and |score| selections, ten sizes
        assert (curve.faithfulness[:, -1] - 1).abs().max() < 1e-5
    finally:
        cl.unregister_circuit_method("later-first")
    assert "later-first" not in cl.available_circuit_methods()


def test_the_curve_sums_trapezoids_as_mib_does() -> None:
    from contribution_lens.circuits.evaluation import FRACTIONS, areas

    f = torch.tensor([0.0, 0.1, 0.2, 0.3, 0.5, 0.6, 0.8, 0.9, 1.1, 1.0], dtype=torch.float64)
    x = torch.tensor(FRACTIONS, dtype=torch.float64)
    cpr, cmd = areas(f, x)
    want_cpr = sum((x[i + 1] - x[i]) * (f[i] + f[i + 1]) / 2 for i in range(9))
    want_cmd = sum((x[i + 1] - x[i]) * (abs(1 - f[i]) + abs(1 - f[i + 1])) / 2 for i in range(9))
    assert abs(float(cpr) - float(want_cpr)) < 1e-12 and abs(float(cmd) - float(want_cmd)) < 1e-12


def test_batches_under_a_small_memory_budget_give_the_same_scores_and_curve() -> None:
    """One prompt a batch (a budget smaller than one prompt's differences) against all prompts at once."""
    model = tiny_bridge("gqa", biases=True)
    task = random_task(model, n=4, seed=3)
    whole = cl.circuit_scores(model, task, method="eap")
    one_by_one = cl.circuit_scores(model, task, method="eap", memory=1)
    assert_close(one_by_one.edge_scores, whole.edge_scores, rtol=1e-4, atol=1e-6)
    whole_curve = cl.circuit_curve(model, task, whole)
    # A patched pass reads every position's differences at once: a prompt over the budget is held whole, and said so.
    with pytest.warns(UserWarning, match=r"memory=1 bytes: one prompt of \d+ positions .* held whole"):
        small_curve = cl.circuit_curve(model, task, whole, memory=1)
    assert_close(small_curve.patched, whole_curve.patched, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["eap", "eap-ig", "contribution", "curve"])
def test_a_budget_of_two_prompts_holds_two_prompts_differences_and_keeps_the_scores(method, monkeypatch) -> None:
    """A budget of two prompts' ``[writer batch pos d_model]`` copies: every recorded pass holds at most two
    prompts (batches 2, 2, 1 of five), and the scores (the curve's metrics) are those of one batch of five."""
    from contribution_lens.circuits import attribution, contribution

    model = tiny_bridge("gqa", biases=True)
    task = random_task(model, n=5, seed=3)
    graph = cl.circuit_graph(model)
    copies = {"eap": attribution.GRADIENT_COPIES, "eap-ig": attribution.GRADIENT_COPIES}
    copies |= {"contribution": contribution.COPIES, "curve": 2.0}
    per_prompt = task.clean.shape[1] * len(graph.writers) * int(model.cfg.d_model) * 4 * copies[method]

    eap = cl.circuit_scores(model, task, method="eap")

    def run(memory: int) -> torch.Tensor:
        if method == "curve":
            return cl.circuit_curve(model, task, eap, memory=memory).patched
        return cl.circuit_scores(model, task, method=method, memory=memory).edge_scores

    whole = run(2**30)
    held: list[int] = []
    write = ic.Record.write

    def counted(self, kind, layer, out):
        held.append(out.shape[0])
        return write(self, kind, layer, out)

    monkeypatch.setattr(ic.Record, "write", counted)
    two = run(int(2 * per_prompt))
    assert sorted(set(held)) == [1, 2]
    assert_close(two, whole, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("method", ["eap", "eap-ig", "contribution"])
def test_a_prompt_longer_than_the_budget_is_scored_in_windows_of_positions_with_the_same_scores(
    method, monkeypatch
) -> None:
    """A budget of a third of one prompt's copies: every difference (tangent) and gradient the products read spans
    at most a third of the positions, one prompt at a time, and the windows add up to the whole prompts' scores."""
    from contribution_lens.circuits import attribution, contribution

    model = tiny_bridge("gqa", biases=True)
    task = random_task(model, n=3, seed=4)
    graph = cl.circuit_graph(model)
    copies = {
        "eap": attribution.GRADIENT_COPIES,
        "eap-ig": attribution.GRADIENT_COPIES,
        "contribution": contribution.COPIES,
    }
    length = task.clean.shape[1]
    per_position = len(graph.writers) * int(model.cfg.d_model) * 4 * copies[method]
    window = length // 3
    whole = cl.circuit_scores(model, task, method=method).edge_scores

    read: list[tuple[int, int, int]] = []
    add_products = ic.add_products

    def counted(graph, found, delta, scores):
        read.append((delta.shape[1], delta.shape[2], max(grad.shape[1] for _, _, grad in found)))
        return add_products(graph, found, delta, scores)

    monkeypatch.setattr(ic, "add_products", counted)
    windowed = cl.circuit_scores(model, task, method=method, memory=int(window * per_position)).edge_scores
    assert length >= 6 and read
    assert {batch for batch, _, _ in read} == {1}
    assert max(max(positions, grads) for _, positions, grads in read) == window
    assert_close(windowed, whole, rtol=1e-4, atol=1e-6)


def test_the_cost_benchmarks_parts_name_functions_the_methods_call() -> None:
    """``bench_circuits.py --parts`` times functions by name: each must exist (a renamed one failed only when run)."""
    import importlib
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[2] / "benchmarks" / "bench_circuits.py"
    spec = importlib.util.spec_from_file_location("bench_circuits", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert len(bench.PARTS) >= 5
    for part, (module, name) in bench.PARTS.items():
        assert callable(getattr(importlib.import_module(module), name, None)), part
