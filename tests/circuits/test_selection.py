"""MIB's protocol: CPR and CMD from the two selections, signed and ``|score|`` selection, greedy selection from the
logits and pruning, on graphs whose scores and faithfulness are chosen by hand; then against literal ports of
MIB's ``apply_greedy`` and ``prune`` on random scores, and through `circuit_curve` on tiny models."""

import heapq
import json

import pytest
import torch
from circuit_helpers import random_task
from safetensors import safe_open

import contribution_lens as cl
from conftest import assert_close, tiny_bridge
from contribution_lens import files
from contribution_lens.circuits import evaluation
from contribution_lens.circuits.evaluation import FRACTIONS, SELECTIONS, CircuitCurve, mib_areas
from contribution_lens.circuits.graph import Graph
from contribution_lens.circuits.scoring import CircuitScores, _reads, greedy_order, prune_edges

# Hand-chosen faithfulness at MIB's ten sizes. The signed selection's circuits overshoot the whole model (f > 1:
# they leave out what works against the task); the |score| selection's approach it from below.
SIGNED = [0.2, 0.4, 0.8, 1.1, 1.3, 1.4, 1.5, 1.4, 1.2, 1.0]
ABSOLUTE = [0.0, 0.1, 0.2, 0.3, 0.5, 0.6, 0.8, 0.9, 1.1, 1.0]
# Trapezoids over the fractions 0.001 .. 1 (widths 0.001, 0.003, 0.005, 0.01, 0.03, 0.05, 0.1, 0.3, 0.5), by hand:
CPR = (
    0.001 * 0.3
    + 0.003 * 0.6
    + 0.005 * 0.95
    + 0.01 * 1.2
    + 0.03 * 1.35
    + 0.05 * 1.45
    + 0.1 * 1.45
    + 0.3 * 1.3
    + 0.5 * 1.1
)
CMD = 0.001 * 0.95 + 0.003 * 0.85 + 0.005 * 0.75 + 0.01 * 0.6 + 0.03 * 0.45 + 0.05 * 0.3 + 0.1 * 0.15 + 0.3 * 0.1
CMD += 0.5 * 0.05
AREA = 0.001 * 0.05 + 0.003 * 0.15 + 0.005 * 0.25 + 0.01 * 0.4 + 0.03 * 0.55 + 0.05 * 0.7 + 0.1 * 0.85 + 0.3 * 1.0
AREA += 0.5 * 1.05


def hand_curve() -> CircuitCurve:
    """Two prompts whose clean metrics average 3 and counterfactual metrics 0: f is the patched mean over 3."""
    f = torch.tensor([SIGNED, ABSOLUTE], dtype=torch.float64)
    patched = torch.stack([3 * f + 0.5, 3 * f - 0.5], dim=-1)  # [selection size prompt]
    sizes = torch.ones(2, len(FRACTIONS), dtype=torch.float64)
    return CircuitCurve(
        "hand", "hand", "edge", torch.tensor(FRACTIONS, dtype=torch.float64), torch.tensor([2.0, 4.0]),
        torch.tensor([1.0, -1.0]), patched, sizes, sizes,
    )  # fmt: skip


def test_cpr_cmd_and_the_absolute_area_are_mibs_trapezoids_of_hand_chosen_curves() -> None:
    curve = hand_curve()
    assert_close(curve.faithfulness, torch.tensor([SIGNED, ABSOLUTE], dtype=torch.float64), atol=1e-12, rtol=0)
    assert curve.cpr == pytest.approx(CPR, abs=1e-12) and curve.cpr == pytest.approx(1.21685, abs=1e-12)
    assert curve.cpr > 1  # MIB's best methods' CPR exceeds 1; the |score| area can hardly
    assert curve.cmd == pytest.approx(CMD, abs=1e-12) and curve.cmd == pytest.approx(0.11175, abs=1e-12)
    assert curve.absolute_area == pytest.approx(AREA, abs=1e-12) and curve.absolute_area == pytest.approx(0.96725)
    cpr, cmd, area = mib_areas(torch.tensor(SIGNED), torch.tensor(ABSOLUTE), torch.tensor(FRACTIONS))
    assert (float(cpr), float(cmd), float(area)) == pytest.approx((CPR, CMD, AREA), abs=1e-6)
    table = curve.table
    assert list(table["selection"]) == [*["signed"] * 10, *["absolute"] * 10]
    assert table["faithfulness"].tolist() == pytest.approx(SIGNED + ABSOLUTE)
    # Counts are counts: a table a notebook shows reads 70 edges, not 70.0 (kept as float64 in the result's tensors).
    assert table["chosen"].dtype.kind == "i" and table["edges"].dtype.kind == "i", table.dtypes
    low, high = curve.cpr_interval
    assert low <= curve.cpr <= high


# A one-layer graph, one head: its eight edges in `Graph.edges` order, and effects m(patched) - m(clean) by hand.
GRAPH = Graph(n_layers=1, n_heads=1, n_kv_heads=1, pos_embed=False)
EDGES = ["embed->L0H0<q>", "embed->L0H0<k>", "embed->L0H0<v>", "embed->L0.mlp", "L0H0->L0.mlp", "embed->logits",
         "L0H0->logits", "L0.mlp->logits"]  # fmt: skip
EFFECTS = torch.tensor([-0.5, 0.1, -0.2, 0.05, 0.3, -0.9, 2.0, -0.1])


def hand_scores(values: torch.Tensor = EFFECTS, **kwargs) -> CircuitScores:
    return CircuitScores("hand", "hand", GRAPH, torch.zeros(2), values, **kwargs)


def names(circuit: cl.Circuit) -> list[str]:
    return sorted(circuit.edges)


def test_signed_selection_keeps_the_most_negative_effects_and_absolute_the_largest_magnitudes() -> None:
    assert GRAPH.edges == EDGES
    scores = hand_scores()
    # |score|: 2.0, 0.9, 0.5, 0.3, 0.2, then 0.1 twice (the earlier edge first), 0.05.
    assert [EDGES[i] for i in scores.ranking(absolute=True).tolist()][:3] == EDGES[6:4:-1] + EDGES[:1]
    # Signed: the most negative effect is the edge whose clean activation most restores the clean metric.
    assert scores.ranking(absolute=False).tolist() == [5, 0, 2, 7, 3, 1, 4, 6]
    assert names(scores.circuit(0.25)) == ["L0H0->logits", "embed->logits"]
    assert names(scores.circuit(0.25, absolute=False)) == ["embed->L0H0<q>", "embed->logits"]
    # An importance (larger keeps) is ranked the other way round.
    importance = hand_scores(orientation=cl.circuits.registry.IMPORTANCE)
    assert importance.ranking(absolute=False).tolist()[:2] == [6, 4]


def test_greedy_selection_grows_from_the_logits_and_pruning_drops_what_reaches_nothing() -> None:
    scores = hand_scores()
    # Candidates: the edges into the logits; taking L0.mlp->logits makes L0.mlp's input edges candidates, and so on.
    assert scores.ranking(absolute=False, greedy=True).tolist() == [5, 7, 3, 4, 0, 2, 1, 6]
    greedy = scores.circuit(0.5, absolute=False, greedy=True)
    assert names(greedy) == ["L0.mlp->logits", "L0H0->L0.mlp", "embed->L0.mlp", "embed->logits"]
    # L0H0 reads no kept edge: its edge into the MLP lies on no path from the embedding.
    pruned = scores.circuit(0.5, absolute=False, greedy=True, prune=True)
    assert names(pruned) == ["L0.mlp->logits", "embed->L0.mlp", "embed->logits"]
    top = scores.circuit(0.5, absolute=False)
    assert names(top) == ["L0.mlp->logits", "embed->L0H0<q>", "embed->L0H0<v>", "embed->logits"]
    # L0H0 writes nothing kept and the MLP reads nothing kept: only the direct path is left.
    assert names(scores.circuit(0.5, absolute=False, prune=True)) == ["embed->logits"]
    assert names(scores.circuit(0.25, prune=True)) == ["embed->logits"]


def test_an_edge_into_a_key_head_reaches_every_head_of_its_group() -> None:
    graph = Graph(n_layers=2, n_heads=2, n_kv_heads=1, pos_embed=False)
    kept = torch.zeros(len(graph.edges), dtype=torch.bool)
    for name in ("embed->L0KV0<v>", "L0H1->logits", "L0H0->L1H0<q>"):
        kept[graph.edge_ids[name]] = True
    got = [graph.edges[i] for i in torch.nonzero(prune_edges(graph, kept))[:, 0].tolist()]
    assert got == ["embed->L0KV0<v>", "L0H1->logits"]  # L1H0 writes nothing kept: its input edge goes


def mib_prune(graph: Graph, kept: torch.Tensor) -> torch.Tensor:
    """MIB's ``Graph.prune`` (EAP-IG's graph.py), literally: remove nodes with no kept incoming or outgoing edge, then
    edges with a removed end, until nothing changes (the embeddings count as having incoming edges)."""
    in_graph = graph.edge_mask(kept)
    forward_to_backward = _reads(graph).float()
    while True:
        outgoing = in_graph.any(1)
        ingoing = (in_graph.any(0).float() @ forward_to_backward.T) > 0
        ingoing[: graph.n_embeddings] = True
        nodes = outgoing & ingoing
        backward = nodes.float() @ forward_to_backward
        backward[-1] = 1  # the logits are always in
        before = in_graph.clone()
        in_graph &= (nodes.float()[:, None] * backward[None, :]) > 0
        if torch.equal(before, in_graph):
            writers, inputs = graph.edge_index
            return in_graph[writers, inputs]


def mib_greedy(graph: Graph, key: torch.Tensor) -> list[int]:
    """MIB's ``apply_greedy`` (EAP-IG's graph.py), literally: heapq.merge of sorted candidate lists, largest first."""
    writers, inputs = graph.edge_index
    edges_into: dict[int, list[int]] = {}
    for e, i in enumerate(inputs.tolist()):
        edges_into.setdefault(i, []).append(e)
    reads = _reads(graph)
    score = key.tolist()

    def parent_edges(u: int) -> list[int]:
        found = [e for i in torch.nonzero(reads[u])[:, 0].tolist() for e in edges_into[i]]
        return sorted(dict.fromkeys(found), key=lambda e: score[e], reverse=True)

    in_graph = [False] * len(graph.writers)
    candidates = sorted(edges_into[len(graph.inputs) - 1], key=lambda e: score[e], reverse=True)
    merged = heapq.merge(candidates, key=lambda e: score[e], reverse=True)
    order = []
    for _ in range(len(graph.edges)):
        edge = next(merged)
        order.append(edge)
        parent = int(writers[edge])
        if not in_graph[parent]:
            in_graph[parent] = True
            merged = heapq.merge(merged, parent_edges(parent), key=lambda e: score[e], reverse=True)
    return order


@pytest.mark.parametrize(("heads", "kv", "pos_embed"), [(2, 2, True), (4, 2, False), (3, 1, False)])
def test_greedy_and_pruning_equal_literal_ports_of_mibs_code_on_random_scores(heads, kv, pos_embed) -> None:
    graph = Graph(n_layers=3, n_heads=heads, n_kv_heads=kv, pos_embed=pos_embed)
    generator = torch.Generator().manual_seed(heads)
    for _ in range(3):
        key = torch.randn(len(graph.edges), generator=generator, dtype=torch.float64)
        order = greedy_order(graph, key)
        if kv == heads:  # MIB pushes a head's k and v edges once; a shared key head's are pushed once here too
            assert order.tolist() == mib_greedy(graph, key)
        assert sorted(order.tolist()) == list(range(len(graph.edges)))
        for share in (0.01, 0.05, 0.2, 0.6):
            kept = torch.rand(len(graph.edges), generator=generator) < share
            assert torch.equal(prune_edges(graph, kept), mib_prune(graph, kept))
            chosen = torch.zeros(len(graph.edges), dtype=torch.bool)
            chosen[order[: int(share * len(order))]] = True
            assert torch.equal(prune_edges(graph, chosen), mib_prune(graph, chosen))


@pytest.mark.parametrize("variant", ["mha", "gqa"])
def test_the_curve_runs_each_distinct_circuit_once_and_pruning_keeps_f(variant, monkeypatch) -> None:
    model = tiny_bridge(variant, biases=True)
    task = random_task(model, n=3)
    eap = cl.circuit_scores(model, task, method="eap")
    routes = cl.circuit_scores(model, task, method="information-flow-routes")
    runs: list[int] = []
    patched = evaluation._patched

    def counted(model, task, batch, circuit):
        runs.append(int(circuit.kept.sum()))
        return patched(model, task, batch, circuit)

    monkeypatch.setattr(evaluation, "_patched", counted)
    curve = cl.circuit_curve(model, task, routes)  # non-negative scores: both selections choose one circuit
    distinct = {tuple(c.kept.tolist()) for c in [routes.circuit(f, prune=True) for f in FRACTIONS]}
    assert len(runs) <= len(distinct) and torch.equal(curve.patched[0], curve.patched[1])
    assert curve.greedy and curve.prune
    runs.clear()
    pruned, whole = cl.circuit_curve(model, task, eap), cl.circuit_curve(model, task, eap, prune=False)
    assert len(runs) <= 2 * 2 * (len(FRACTIONS) - 1)
    assert not torch.equal(pruned.patched[0], pruned.patched[1])  # EAP's signed and |score| circuits differ
    # Pruned edges change nothing here (no post-attention norm): f is the same, the edge count smaller.
    assert_close(pruned.patched, whole.patched, rtol=1e-5, atol=1e-5)
    assert bool((pruned.edges <= whole.edges).all()) and bool((pruned.edges < whole.edges).any())
    assert torch.equal(whole.edges, whole.chosen)  # unpruned, an edge-level circuit is what was chosen
    assert pruned.chosen[0].tolist() == [int(f * len(eap.graph.edges)) for f in FRACTIONS]
    assert_close(pruned.faithfulness[:, -1], torch.ones(2, dtype=torch.float64), atol=1e-5, rtol=0)


def test_a_curve_says_whether_it_was_evaluated_on_the_prompts_it_was_scored_on() -> None:
    model = tiny_bridge("gqa")
    task = random_task(model, n=6, seed=2)
    scoring, held_out = task.split(0.5, seed=1)
    scores = cl.circuit_scores(model, scoring, method="random")
    inside = cl.circuit_curve(model, scoring, scores, fractions=(0.5, 1.0))
    outside = cl.circuit_curve(model, held_out, scores, fractions=(0.5, 1.0))
    assert (inside.in_sample, inside.overlap, outside.in_sample, outside.overlap) == (True, 3, False, 0)
    assert "in-sample" in repr(inside) and "in-sample" not in repr(outside)
    assert "scored on scoring (3), evaluated on evaluation (3)" in repr(outside)
    assert repr(outside).startswith("CircuitCurve(random on random/custom, edge level: CPR ")
    whole = cl.circuit_curve(model, task, scores, fractions=(0.5, 1.0))
    assert whole.overlap == 3 and whole.in_sample  # all prompts evaluated, the scored half among them


def _rewritten(path, tmp_path, change) -> object:
    """The file at ``path`` with its stored tree changed by ``change`` (a file of another layout)."""
    with safe_open(str(path), "pt") as handle:
        metadata = handle.metadata()
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    tree = json.loads(metadata["tree"])
    change(tree["fields"])
    metadata["tree"] = json.dumps(tree)
    old = tmp_path / f"old-{path.name}"
    files.save_tensors(old, tensors, metadata, format=metadata["format"], example=path.name)
    return old


def test_results_of_the_layout_before_are_refused_with_what_to_do(tmp_path) -> None:
    model = tiny_bridge("gqa")
    task = random_task(model)
    scores = cl.circuit_scores(model, task, method="random")
    curve = cl.circuit_curve(model, task, scores, fractions=(0.5, 1.0))
    saved = curve.save(tmp_path / "curve.safetensors")
    assert cl.CircuitCurve.load(saved).cpr == pytest.approx(curve.cpr)
    old = _rewritten(saved, tmp_path, lambda fields: fields.pop("chosen"))
    with pytest.raises(
        ValueError,
        match=r"saved by an earlier version, whose CPR chose circuits by absolute score \(MIB's CPR chooses them by ",
    ):
        cl.CircuitCurve.load(old)
    saved = scores.save(tmp_path / "scores.safetensors")
    assert cl.CircuitScores.load(saved).prompts.counterfactual == "custom"
    old = _rewritten(saved, tmp_path, lambda fields: fields.pop("orientation"))
    with pytest.raises(ValueError, match="did not record which way they point"):
        cl.CircuitScores.load(old)


@pytest.mark.usefixtures("as_a_user")
def test_selections_are_named_and_bad_switches_refused() -> None:
    assert SELECTIONS == ("signed", "absolute")
    scores = hand_scores()
    with pytest.raises(ValueError, match="absolute must be True or False, got 'yes'"):
        scores.circuit(0.5, absolute="yes")
    with pytest.raises(ValueError, match="prune must be True or False, got 1"):
        scores.circuit(0.5, prune=1)
    with pytest.raises(ValueError, match=r"greedy must be True, False or None \(the method's own\), got 'no'"):
        scores.circuit(0.5, greedy="no")
    with pytest.raises(ValueError, match="greedy: greedy selection from the logits chooses edges"):
        scores.circuit(0.5, "node", greedy=True)
    with pytest.raises(ValueError, match="orientation must be a ScoreOrientation or one of effect, importance"):
        cl.register_circuit_method("sideways", lambda m, t, c: None, orientation="sideways")
