"""Exact edge effects: each against a patched pass built here from TransformerLens hooks alone (float64), EAP
agreeing with them to first order as the counterfactual approaches the clean prompt, the top edges of every
kind, the rank correlation and its interval, and every mistake refused before any pass."""

import math

import pytest
import torch
from circuit_helpers import random_task
from test_circuit_bad_inputs import no_pass

import contribution_lens as cl
from conftest import tiny_bridge
from contribution_lens.circuits import edge_effects as ee


def _outputs(model, tokens) -> dict[str, torch.Tensor]:
    """Every writer's output ``[batch pos d_model]`` in a plain run of ``tokens``, by node name."""
    found: dict[str, torch.Tensor] = {}
    hooks = [("embed.hook_out", lambda x, hook: found.update(embed=x.detach().clone()))]
    for layer in range(model.cfg.n_layers):
        W_O = model.blocks[layer].attn.W_O.detach()

        def heads(z, hook, layer=layer, W_O=W_O):
            for h in range(z.shape[2]):
                found[f"L{layer}H{h}"] = z[:, :, h].detach() @ W_O[h]

        def mlp(x, hook, layer=layer):
            found[f"L{layer}.mlp"] = x.detach().clone()

        hooks += [(f"blocks.{layer}.attn.o.hook_in", heads), (f"blocks.{layer}.hook_mlp_out", mlp)]
    model.run_with_hooks(tokens, fwd_hooks=hooks)
    return found


def _projected(model, layer: int, side: str, head: int, x: torch.Tensor) -> torch.Tensor:
    """``LN1(x) W^h + b^h`` of head (key head) ``head``: the model's own norm module and weights."""
    attn = model.blocks[layer].attn
    normed = model.blocks[layer].ln1.original_component(x)
    W, b = getattr(attn, f"W_{side.upper()}")[head], getattr(attn, f"b_{side.upper()}")[head]
    return normed @ W + b


@torch.no_grad()
def _direct_effect(model, task, edge: str) -> float:
    """``mean_p m_p - m_p(clean)`` with input ``i`` of ``u -> i`` reading ``s_i + (r_u - o_u)``, by hooks alone."""
    source, target = edge.split("->")
    difference = _outputs(model, task.corrupted)[source] - _outputs(model, task.clean)[source]
    kept: dict[str, torch.Tensor] = {}

    def add(x, hook):
        return x + difference

    if target == "logits":
        hooks = [("ln_final.hook_in", add)]
    elif target.endswith(".mlp"):
        hooks = [(f"blocks.{target[1:].split('.')[0]}.ln2.hook_in", add)]
    else:
        layer, side = int(target[1:].split("H")[0].split("K")[0]), target[-2]
        head = int(target.split("H" if "KV" not in target else "KV")[1].split("<")[0])

        def resid(x, hook):
            kept["resid"] = x

        def project(x, hook):
            x = x.clone()
            x[:, :, head] = _projected(model, layer, side, head, kept["resid"] + difference)
            return x

        hooks = [(f"blocks.{layer}.hook_resid_pre", resid), (f"blocks.{layer}.attn.{side}.hook_out", project)]
    logits = model.run_with_hooks(task.clean, fwd_hooks=hooks)
    clean = model(task.clean)
    rows = torch.arange(len(task))

    def metric(z):
        at = z[rows, task.last]
        return at.gather(1, task.answer[:, None])[:, 0] - at.gather(1, task.foil[:, None])[:, 0]

    return float((metric(logits) - metric(clean)).mean())


EDGES = ["embed->L0H1<q>", "L0H2->L1KV1<k>", "L0.mlp->L1KV0<v>", "L0H1->L1.mlp", "L0H0->L0.mlp", "L1H3->logits"]


@pytest.mark.parametrize("variant", ["gqa", "mha"])
def test_each_effect_is_the_patched_pass_computed_by_hooks(variant) -> None:
    model = tiny_bridge(variant, biases=True).to(torch.float64)
    task = random_task(model, n=4, seed=5)
    edges = [e.replace("KV", "H") if variant == "mha" else e for e in EDGES]
    result = cl.exact_edge_effects(model, task, edges, progress=False)
    for edge, got in zip(edges, result.effects.tolist(), strict=True):
        want = _direct_effect(model, task, edge)
        assert abs(want) > 1e-5, edge  # the edge does something: the comparison can fail
        assert abs(got - want) <= 1e-9 + 1e-8 * abs(want), (edge, got, want)
    assert result.table["kind"].tolist() == ["q", "k", "v", "mlp", "mlp", "logits"]
    assert bool(torch.isnan(result.scores).all()) and result.method == ""


def test_a_small_memory_budget_gives_the_same_effects() -> None:
    model = tiny_bridge("gqa", biases=True)
    task = random_task(model, n=3, seed=1)
    whole = cl.exact_edge_effects(model, task, EDGES[::2], progress=False)
    with pytest.warns(UserWarning, match="held whole"):
        one_by_one = cl.exact_edge_effects(model, task, EDGES[::2], memory=1, progress=False)
    torch.testing.assert_close(one_by_one.patched, whole.patched, rtol=1e-5, atol=1e-6)


def _nearby_task(model, epsilon: float):
    """A task whose counterfactual differs from the clean prompt in one token, whose embedding is moved to lie
    ``epsilon`` of the way from the clean token's to its own (the model's ``W_E`` edited)."""
    task = random_task(model, n=3, seed=2)
    clean = task.clean.clone()
    clean[clean == 49] = 48  # token 49 appears only as the counterfactual's
    corrupted = clean.clone()
    with torch.no_grad():
        own = model.W_E[49].clone()
        model.W_E[49] = model.W_E[clean[0, 2]] + epsilon * (own - model.W_E[clean[0, 2]])
    corrupted[:, 2] = torch.where(clean[:, 2] == clean[0, 2], 49, clean[:, 2])
    return cl.Task("nearby", clean, corrupted, task.answer, task.foil, task.last)


def test_eap_agrees_with_the_exact_effect_to_first_order_as_the_counterfactual_approaches_the_clean_prompt() -> None:
    """``exact = eap + O(epsilon^2)`` while both are ``O(epsilon)``: the relative gap shrinks with ``epsilon``."""
    gaps = []
    for epsilon in (1e-1, 1e-2, 1e-3):
        model = tiny_bridge("gqa", biases=True).to(torch.float64)
        task = _nearby_task(model, epsilon)
        scores = cl.circuit_scores(model, task, method="eap")
        result = cl.exact_edge_effects(model, task, scores, count=2, progress=False)
        assert set(result.kinds) == set(ee.KINDS)
        effects, eap = result.effects, result.scores.double()
        gaps.append(float((eap - effects).abs().max() / effects.abs().max()))
    assert gaps[1] < gaps[0] / 5 and gaps[2] < gaps[1] / 5, gaps
    assert gaps[2] < 1e-2, gaps


def test_top_edges_of_each_kind_are_the_largest_of_that_kind() -> None:
    model = tiny_bridge("gqa")
    scores = cl.circuit_scores(model, random_task(model), method="random")
    chosen = ee.top_edges(scores, 3, per_kind=True)
    table = scores.edges.assign(kind=[ee.input_kind(edge) for edge in scores.edges["edge"]])
    for kind in ee.KINDS:
        of_kind = table[table["kind"] == kind]
        want = of_kind.reindex(of_kind["score"].abs().sort_values(ascending=False).index)["edge"].head(3).tolist()
        assert [edge for edge in chosen if ee.input_kind(edge) == kind] == want, kind
    overall = table.reindex(table["score"].abs().sort_values(ascending=False).index)["edge"].head(4).tolist()
    assert ee.top_edges(scores, 4) == overall


def test_the_rank_correlation_and_its_interval() -> None:
    """A hand-made result: scores ranked as the effects give 1, reversed give -1, and the interval brackets."""
    edges = (*(f"L0H{h}->logits" for h in range(4)), "L0.mlp->logits")
    generator = torch.Generator().manual_seed(0)
    patched = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])[:, None] + 0.3 * torch.randn(5, 12, generator=generator)
    clean = torch.zeros(12)
    same = ee.EdgeEffects("t", "m", edges, torch.tensor([10.0, 20.0, 30.0, 40.0, 50.0]), clean, patched)
    assert same.spearman == pytest.approx(1.0)
    noisy = ee.EdgeEffects("t", "m", edges, same.scores, clean, patched + 3 * torch.randn(5, 12, generator=generator))
    low, high = noisy.spearman_interval
    assert -1 <= low <= noisy.spearman <= high <= 1 and low < high
    reversed_ = ee.EdgeEffects("t", "m", edges, -same.scores, clean, patched)
    assert reversed_.spearman == pytest.approx(-1.0)
    # Ties take their average rank: ranks 1.5, 1.5, 3, 4, 5 against 1 .. 5, Pearson's r of the ranks.
    tied = ee.EdgeEffects("t", "m", edges, torch.tensor([1.0, 1.0, 2.0, 3.0, 4.0]), clean, patched)
    assert tied.spearman == pytest.approx(9.5 / math.sqrt(9.5 * 10.0), abs=1e-12)
    table = same.correlations()
    assert table["kind"].tolist() == ["all", "logits"] and table["edges"].tolist() == [5, 5]


@pytest.mark.usefixtures("as_a_user")
def test_mistakes_are_refused_before_any_pass() -> None:
    model = tiny_bridge("gqa")
    task = random_task(model)
    node_scores = cl.CircuitScores("t", "activation-patching", cl.circuit_graph(model), torch.zeros(10))
    cases = [
        (dict(edges=[]), "edges must be a non-empty list of edge names or a CircuitScores, got []"),
        (dict(edges="L0H0->logits"), "edges must be a non-empty list of edge names or a CircuitScores"),
        (dict(edges=["L9H0->logits"]), "edges: unknown edge 'L9H0->logits'; edges are named as in Graph.edges"),
        (dict(edges=["L0H0->logits"] * 2), "edges: an edge is named twice"),
        (dict(edges=["L0H0->logits"], memory=0), "memory must be a positive number of bytes, got 0"),
        (dict(edges=["L0H0->logits"], scores="eap"), "scores must be a CircuitScores of this model's graph"),
        (dict(edges=node_scores), "scores: 'activation-patching' scores nodes only"),
        (dict(edges=node_scores.__class__("t", "r", node_scores.graph, torch.zeros(10), torch.zeros(82)), count=0),
         "count must be a positive integer (edges a kind), got 0"),
    ]  # fmt: skip
    for arguments, message in cases:
        with no_pass(model), pytest.raises(ValueError) as error:
            cl.exact_edge_effects(model, task, progress=False, **arguments)
        assert message in str(error.value), (arguments, str(error.value))
