"""Circuit stability: identical resamples overlap fully, random scores overlap as chance says (computed here by
enumeration and compared with the closed form), the intervals bracket, and every mistake is refused first."""

import itertools
from fractions import Fraction

import pytest
import torch
from circuit_helpers import random_task
from test_circuit_bad_inputs import no_pass

import contribution_lens as cl
from conftest import tiny_bridge
from contribution_lens.circuits import stability as st


@pytest.fixture(scope="module")
def model():
    return tiny_bridge("gqa", biases=True)


def test_identical_resamples_give_a_jaccard_index_of_one(model) -> None:
    """Four copies of one prompt: every resample is the task itself, so EAP's circuits are one circuit."""
    task = random_task(model, n=1, seed=2)
    repeated = st.prompts(task, torch.zeros(4, dtype=torch.long))
    result = cl.circuit_stability(model, repeated, "eap", resamples=3, fractions=(0.05, 0.2, 0.5), progress=False)
    assert result.rows.shape == (3, 4)
    assert bool((result.kept.sum(-1) == result.sizes[None]).all()) and float(result.sizes.min()) > 0
    torch.testing.assert_close(result.jaccard, torch.ones(3, dtype=torch.float64), rtol=0, atol=0)
    torch.testing.assert_close(result.jaccard_to_full, torch.ones(3, dtype=torch.float64), rtol=0, atol=0)
    assert set(result.frequency.unique().tolist()) == {0.0, 1.0}
    assert bool((result.chance < 1).all())  # a random circuit of that size would not overlap fully


def test_the_chance_overlap_is_the_mean_over_every_pair_of_subsets() -> None:
    for n, k in ((6, 2), (7, 3), (5, 5), (8, 1)):
        subsets = [set(c) for c in itertools.combinations(range(n), k)]
        pairs = [Fraction(len(a & b), len(a | b)) for a in subsets for b in subsets]
        assert st.chance_jaccard(n, k) == pytest.approx(float(sum(pairs) / len(pairs)), abs=1e-12), (n, k)


def test_random_scores_overlap_as_chance_says(model) -> None:
    """The random control draws anew for each resample: its circuits are uniform random subsets of their size."""
    task = random_task(model, n=5)
    fractions = (0.1, 0.3, 0.6)
    result = cl.circuit_stability(model, task, "random", resamples=200, fractions=fractions, progress=False)
    chance = result.chance
    assert float(chance[0]) < 0.1  # far from 1: the comparison can fail
    torch.testing.assert_close(result.jaccard, chance, rtol=0, atol=0.01)
    torch.testing.assert_close(result.jaccard_to_full, chance, rtol=0, atol=0.02)
    for interval, mean in (
        (result.jaccard_interval, result.jaccard),
        (result.jaccard_to_full_interval, result.jaccard_to_full),
    ):
        assert bool((interval[:, 0] <= mean).all() and (mean <= interval[:, 1]).all())
        assert bool((interval[:, 0] < interval[:, 1]).all())
    table = result.table
    assert table["size"].tolist() == [int(f * len(result.graph.edges)) for f in fractions]
    # Every edge as often in a random circuit as any other: about the fraction kept.
    assert abs(float(result.frequency[1].mean()) - float(result.sizes[1]) / len(result.graph.edges)) < 1e-9


def test_the_overlap_of_hand_made_circuits() -> None:
    """Circuits {0, 1}, {1, 2}, {0, 1} of the edges, the full one {0, 1}: pairs 1/3, 1, 1/3; to the full 1, 1/3, 1."""
    graph = cl.circuits.Graph(n_layers=1, n_heads=1, n_kv_heads=1, pos_embed=False)
    kept = torch.zeros(3, 1, len(graph.edges), dtype=torch.bool)
    for resample, edges in enumerate(([0, 1], [1, 2], [0, 1])):
        kept[resample, 0, edges] = True
    result = st.CircuitStability(
        "t", "m", "edge", "bootstrap", graph, torch.tensor([0.25], dtype=torch.float64),
        kept[0].clone(), kept, torch.zeros(3, 2, dtype=torch.long), 2,
    )  # fmt: skip
    assert float(result.jaccard[0]) == pytest.approx((1 / 3 + 1 + 1 / 3) / 3)
    assert result.to_full[:, 0].tolist() == pytest.approx([1.0, 1 / 3, 1.0])
    assert result.frequency[0, :4].tolist() == pytest.approx([2 / 3, 1.0, 1 / 3, 0.0])
    assert result.inclusion(0.25)["item"].tolist() == [graph.edges[1], graph.edges[0], graph.edges[2]]
    with pytest.raises(ValueError, match=r"^fraction: 0.5 is not one of this result's \[0.25\]$"):
        result.inclusion(0.5)


def test_node_level_and_half_samples(model) -> None:
    task = random_task(model, n=6, seed=1)
    result = cl.circuit_stability(
        model, task, "random", "node", resamples=3, fractions=(0.5,), sampling="subsample", progress=False
    )
    assert result.kept.shape == (3, 1, len(result.graph.components)) and result.items == result.graph.components
    assert result.rows.shape == (3, 3)
    assert all(len(set(row)) == 3 for row in result.rows.tolist())  # without replacement


@pytest.mark.usefixtures("as_a_user")
def test_mistakes_are_refused_before_any_pass(model) -> None:
    task = random_task(model)
    cases = [
        (dict(method="acdc"), "method: unknown circuit method 'acdc'"),
        (dict(level="head"), "level must be 'edge' or 'node', got 'head'"),
        (dict(method="activation-patching"), "level: 'activation-patching' scores nodes only; ask for level='node'"),
        (dict(resamples=1), "resamples must be an integer of at least 2 (pairs of resamples are compared), got 1"),
        (dict(resamples=True), "resamples must be an integer of at least 2"),
        (dict(sampling="jackknife"), "sampling must be one of bootstrap, subsample, got 'jackknife'"),
        (dict(fractions=()), "fractions must be a non-empty sequence of numbers in (0, 1], got ()"),
        (dict(fractions="0.1"), "fractions must be a non-empty sequence of numbers in (0, 1], got '0.1'"),
        (dict(fractions=(0.1, 1.5)), "fraction must be a number in (0, 1] (the share of edges or nodes kept), got 1.5"),
        (dict(seed="0"), "seed must be an integer (resample r is scored with seed + 1 + r), got '0'"),
        (dict(steps=0), "steps must be a positive integer, got 0"),
        (dict(memory=0), "memory must be a positive number of bytes, got 0"),
    ]  # fmt: skip
    for arguments, message in cases:
        with no_pass(model), pytest.raises(ValueError) as error:
            cl.circuit_stability(model, task, **{"method": "eap", **arguments}, progress=False)
        assert message in str(error.value), (arguments, str(error.value))
    with no_pass(model), pytest.raises(ValueError, match=r"^task: resampling needs at least 2 prompts, got 1$"):
        cl.circuit_stability(model, random_task(model, n=1), progress=False)
