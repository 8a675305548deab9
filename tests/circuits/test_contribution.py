"""The ``contribution`` method against a float64 oracle: its terms add up, across every cut of the graph, to
the metric's change in the linearised model, computed here independently by running the model with the
clean pass's patterns and norm scales put back through hooks."""

import pytest
import torch
from circuit_helpers import random_task

import contribution_lens as cl
from conftest import tiny_bridge
from contribution_lens.circuits import contribution as contribution_method


@torch.no_grad()
def _frozen_metric(model, task, shift: float) -> torch.Tensor:
    """Mean logit difference with the clean pass's patterns and norm scales put back, the embeddings moved
    ``shift`` of the way to the counterfactual's."""
    kept: dict[str, torch.Tensor] = {}
    names = [n for n in model.hook_dict if n.endswith((".hook_scale", "attn.hook_pattern"))]

    def keep(tensor, hook):
        kept[hook.name] = tensor.clone()

    model.run_with_hooks(task.clean, fwd_hooks=[(n, keep) for n in [*names, "embed.hook_out"]])
    clean_embed = kept.pop("embed.hook_out")
    model.run_with_hooks(task.corrupted, fwd_hooks=[("embed.hook_out", keep)])
    corrupted_embed = kept.pop("embed.hook_out")

    def put_back(tensor, hook):
        return kept[hook.name]

    def moved(tensor, hook):
        return clean_embed + shift * (corrupted_embed - clean_embed)

    logits = model.run_with_hooks(task.clean, fwd_hooks=[(n, put_back) for n in names] + [("embed.hook_out", moved)])
    at_last = logits[torch.arange(len(task)), task.last]
    return (at_last.gather(1, task.answer[:, None]) - at_last.gather(1, task.foil[:, None])).mean()


def _cuts(graph):
    """Every point in the forward order between two layers' attention or MLP: the edges that cross it."""
    writers, inputs = graph.edge_index
    upstream = graph.upstream[inputs]
    carried = ~contribution_method.attention_inputs(graph)[inputs]
    points = [graph.layer_start(layer) + offset for layer in range(graph.n_layers) for offset in (0, graph.n_heads)]
    return {point: (writers < point) & (upstream >= point) & carried for point in [*points, len(graph.writers)]}


def _without_mlps(model):
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".mlp." in name:
                param.zero_()
    return model


@pytest.mark.parametrize("variant", ["mha", "gqa"])
def test_terms_add_up_to_the_linearised_metric_across_every_cut(variant) -> None:
    """No MLPs: the frozen model is affine, so one pass on the counterfactual's embeddings is the oracle."""
    model = _without_mlps(tiny_bridge(variant, biases=True).to(torch.float64))
    task = random_task(model)
    want = float(_frozen_metric(model, task, 1.0) - _frozen_metric(model, task, 0.0))
    scores = cl.circuit_scores(model, task, method="contribution")
    terms = scores.edge_scores.double()
    assert abs(want) > 1e-3
    for point, crossing in _cuts(scores.graph).items():
        assert abs(float(terms[crossing].sum()) - want) <= 1e-5 * abs(want) + 1e-6, point


def test_terms_add_up_with_mlps_linearised() -> None:
    """With MLPs, ``L`` expands them at the clean pass: the oracle is the frozen model's central difference."""
    model = tiny_bridge("gqa", biases=True).to(torch.float64)
    task = random_task(model)
    step = 1e-4
    want = float((_frozen_metric(model, task, step) - _frozen_metric(model, task, -step)) / (2 * step))
    graph = cl.circuit_graph(model)
    _, difference = contribution_method.linearised_differences(model, task, graph, torch.arange(len(task)))
    assert abs(float(difference.mean()) - want) <= 1e-6 * abs(want) + 1e-8
    terms = cl.circuit_scores(model, task, method="contribution").edge_scores.double()
    for point, crossing in _cuts(graph).items():
        assert abs(float(terms[crossing].sum()) - want) <= 1e-5 * abs(want) + 1e-6, point


def test_query_and_key_edges_are_scored_and_node_scores_sum_edges() -> None:
    model = tiny_bridge("gqa").to(torch.float64)
    task = random_task(model)
    scores = cl.circuit_scores(model, task, method="contribution")
    graph = scores.graph
    attention = contribution_method.attention_inputs(graph)[graph.edge_index[1]]
    assert bool((scores.edge_scores[attention] != 0).any())
    assert bool((scores.edge_scores[~attention] != 0).any())
    assert len(scores.circuit(0.1).edges) == int(0.1 * len(graph.edges))


def test_query_and_key_edges_are_the_change_when_the_component_is_removed_from_the_scores() -> None:
    """``t(u -> h<k>) = -o_u . dm_h/dx``: against central differences of removing a share of ``o_u`` from that
    input alone, every norm's scale put back at its clean value (LN1's of that input too) and every other
    layer's patterns too (the head's own layer computes its patterns; its other heads do not see the change)."""
    from contribution_lens.adapter import circuit_pass
    from contribution_lens.circuits import interchange as ic

    model = tiny_bridge("gqa", biases=True).to(torch.float64)
    task = random_task(model)
    graph = cl.circuit_graph(model)
    scores = cl.circuit_scores(model, task, method="contribution")
    rows = torch.arange(len(task))
    writers, inputs = graph.edge_index
    clean: dict[str, torch.Tensor] = {}
    names = [n for n in model.hook_dict if n.endswith((".hook_scale", "attn.hook_pattern"))]
    model.run_with_hooks(
        task.clean, fwd_hooks=[(n, lambda x, hook: clean.update({hook.name: x.detach()})) for n in names]
    )
    # Edges into layer 0 have a later layer whose pattern the change would move were it live.
    for name in ["embed->L1H0<q>", "L0H1->L1KV0<k>", "L0.mlp->L1KV1<k>", "embed->L0H1<q>", "embed->L0KV0<k>"]:
        layer = int(name.split("->L")[1].split("H")[0].split("K")[0])
        kept = [n for n in names if not n.startswith(f"blocks.{layer}.attn.hook_pattern")]
        put_back = [(n, lambda x, hook: clean[hook.name]) for n in kept]
        edge = graph.edge_ids[name]
        values = []
        for t in (1e-4, -1e-4):
            patch = torch.zeros(graph.valid.shape, dtype=torch.float64)
            patch[writers[edge], inputs[edge]] = t
            zero = torch.zeros(len(graph.writers), len(task), task.clean.shape[1], 32, dtype=torch.float64)
            stream = ic.Interchange(graph, zero, patch)  # its reads see 0 - o_u: the input loses t o_u
            with torch.inference_mode(), model.hooks(fwd_hooks=put_back):
                logits = circuit_pass(model, task.clean, stream, freeze_norms=True)
            values.append(ic.metric(task, logits, rows).mean())
        want = float((values[0] - values[1]) / 2e-4)
        got = float(scores.edge_scores[edge])
        assert abs(got - want) <= 1e-5 + 1e-4 * abs(want), (name, got, want)


def _eap_in_the_linearised_model(model, task, step: float = 1e-4) -> torch.Tensor:
    """EAP run in ``L``, from its definition: ``mean_p sum_pos (r_u^L - o_u) . dm_L/dx_i`` for every edge.

    ``L`` is the frozen model ``F`` (every norm's scale and attention pattern put back at the clean pass's
    values by hooks) with its MLPs expanded at the clean pass, so ``L(e) = F(e_o) + J_F(e_o) (e - e_o)``:
    ``r_u^L - o_u`` is the central difference of ``F``'s outputs with the embeddings moved ``+-step`` towards
    the counterfactual's (the embeddings' own: ``e_r - e_o``), and ``dm_L/dx_i`` is ``F``'s gradient at the
    clean pass (an MLP and its expansion share their Jacobian there). Neither uses the forward-mode pass
    `contribution` runs.
    """
    from contribution_lens.adapter import circuit_pass
    from contribution_lens.circuits import interchange as ic

    graph = cl.circuit_graph(model)
    rows = torch.arange(len(task))
    clean: dict[str, torch.Tensor] = {}
    names = [n for n in model.hook_dict if n.endswith((".hook_scale", "attn.hook_pattern"))]
    model.run_with_hooks(
        task.clean, fwd_hooks=[(n, lambda x, hook: clean.update({hook.name: x.detach()})) for n in names]
    )
    put_back = [(n, lambda x, hook: clean[hook.name]) for n in names]
    corrupted, _ = ic.record(model, task, graph, rows, corrupted=True)
    moved = []
    for shift in (step, -step):
        record = ic.Record(graph)
        with torch.no_grad(), model.hooks(fwd_hooks=put_back):  # embeddings e_o + shift (e_r - e_o)
            circuit_pass(model, task.clean, ic.Gradient(graph, corrupted, 1.0 - shift, record), freeze_norms=True)
        moved.append(record.outputs)
    difference = (moved[0] - moved[1]) / (2 * step)
    n = graph.n_embeddings  # a record keeps the clean embeddings (the shift is added after): r - o there exactly
    difference[:n] = corrupted[:n] - moved[0][:n]
    stream = ic.Gradient(graph, corrupted, 1.0)
    with torch.enable_grad(), model.hooks(fwd_hooks=put_back):
        value = ic.metric(task, circuit_pass(model, task.clean, stream, freeze_norms=True), rows).sum()
    scores = torch.zeros(graph.valid.shape, dtype=torch.float64)
    ic.gradient_scores(graph, stream, value, difference, scores)
    return ic.per_edge(graph, scores, len(task)).double()


@pytest.mark.parametrize("variant", ["mha", "gqa"])
def test_eap_in_the_linearised_model_is_contribution_on_every_edge_but_q_and_k(variant) -> None:
    """In ``L`` gradient x difference is exact, so EAP there is ``contribution``'s v-, MLP- and logits-edge terms;
    EAP's q- and k-edges are 0 in ``L`` (patterns frozen), where ``contribution`` scores them by the QK split."""
    model = tiny_bridge(variant, biases=True).to(torch.float64)
    task = random_task(model)
    graph = cl.circuit_graph(model)
    want = _eap_in_the_linearised_model(model, task)
    got = cl.circuit_scores(model, task, method="contribution").edge_scores.double()
    attention = contribution_method.attention_inputs(graph)[graph.edge_index[1]]
    carried = ~attention
    assert float(want[carried].abs().max()) > 1e-3
    torch.testing.assert_close(got[carried], want[carried], rtol=1e-6, atol=1e-7)
    assert bool((want[attention] == 0).all())
    assert float(got[attention].abs().max()) > 1e-3


@torch.no_grad()
def _path_derivative(model, task, points, step: float = 1e-5) -> torch.Tensor:
    """Each prompt's ``mean_k dm/dt`` at ``e_o + t_k (e_r - e_o)`` by central differences of the plain model (no
    pattern, scale or MLP frozen): what ``contribution-ig``'s terms must add up to."""
    kept: dict[str, torch.Tensor] = {}
    model.run_with_hooks(task.clean, fwd_hooks=[("embed.hook_out", lambda x, hook: kept.update(clean=x.clone()))])
    model.run_with_hooks(task.corrupted, fwd_hooks=[("embed.hook_out", lambda x, hook: kept.update(cf=x.clone()))])
    rows = torch.arange(len(task))

    def metric(t: float) -> torch.Tensor:
        moved = kept["clean"] + t * (kept["cf"] - kept["clean"])
        logits = model.run_with_hooks(task.clean, fwd_hooks=[("embed.hook_out", lambda x, hook: moved)])
        at = logits[rows, task.last]
        return at.gather(1, task.answer[:, None])[:, 0] - at.gather(1, task.foil[:, None])[:, 0]

    return torch.stack([(metric(t + step) - metric(t - step)) / (2 * step) for t in points]).mean(0)


@pytest.mark.parametrize("variant", ["gqa", "mqa"])
def test_contribution_ig_terms_add_up_across_every_cut_to_its_own_metric_change(variant) -> None:
    """q and k edges included: with nothing frozen every edge carries its part of the model's own derivative."""
    model = tiny_bridge(variant, biases=True).to(torch.float64)
    task = random_task(model)
    graph = cl.circuit_graph(model)
    writers, inputs = graph.edge_index
    upstream = graph.upstream[inputs]
    points = [graph.layer_start(layer) + offset for layer in range(graph.n_layers) for offset in (0, graph.n_heads)]
    for steps in (1, 3):
        want = float(_path_derivative(model, task, contribution_method.path_points(steps)).mean())
        terms = cl.circuit_scores(model, task, method="contribution-ig", steps=steps).edge_scores.double()
        assert abs(want) > 1e-3
        attention = contribution_method.attention_inputs(graph)[inputs]
        assert float(terms[attention].abs().max()) > 1e-4  # the q and k edges carry a part
        for point in [*points, len(graph.writers)]:
            crossing = (writers < point) & (upstream >= point)
            assert abs(float(terms[crossing].sum()) - want) <= 1e-5 * abs(want) + 1e-6, (steps, point)


def test_contribution_ig_in_windows_of_positions_gives_the_same_scores() -> None:
    """A budget of three positions: one prompt at a time, its positions in windows, each its own passes."""
    from contribution_lens.circuits import interchange as ic

    model = tiny_bridge("gqa", biases=True)
    task = random_task(model, n=2, seed=4)
    graph = cl.circuit_graph(model)
    whole = cl.circuit_scores(model, task, method="contribution-ig", steps=2).edge_scores
    per_position = len(graph.writers) * int(model.cfg.d_model) * 4 * contribution_method.COPIES
    memory = int(3 * per_position)
    assert ic.window_length(task.clean.shape[1], len(graph.writers), 32, contribution_method.COPIES, memory) == 3
    part = cl.circuit_scores(model, task, method="contribution-ig", steps=2, memory=memory).edge_scores
    torch.testing.assert_close(part, whole, rtol=1e-4, atol=1e-6)


def test_contribution_ig_scores_a_circuit_and_its_curve() -> None:
    model = tiny_bridge("mha", biases=True)
    task = random_task(model)
    scores = cl.circuit_scores(model, task, method="contribution-ig", steps=2)
    assert bool(torch.isfinite(scores.edge_scores).all()) and scores.method == "contribution-ig"
    curve = cl.circuit_curve(model, task, scores, level="edge", fractions=(0.5, 1.0))
    assert float((curve.faithfulness[:, -1] - 1.0).abs().max()) < 1e-4  # both selections, the whole graph
