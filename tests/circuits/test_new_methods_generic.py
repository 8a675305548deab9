"""``contribution`` and both information-flow routes through the generic path every circuit method takes:
scores, a circuit at a fraction, the faithfulness curve; an encoder refused before any pass."""

import pytest
import torch
from circuit_helpers import random_task
from test_circuit_bad_inputs import no_pass

import contribution_lens as cl
from conftest import tiny_bridge

METHODS = ["contribution", "information-flow-routes", "information-flow-routes-last"]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("variant", ["mha", "gqa", "mqa"])
def test_scores_circuit_and_curve(method, variant) -> None:
    model = tiny_bridge(variant, biases=True)
    task = random_task(model)
    scores = cl.circuit_scores(model, task, method=method)
    assert scores.method == method and bool(torch.isfinite(scores.edge_scores).all())
    assert len(scores.edges) == len(scores.graph.edges) and len(scores.nodes) == len(scores.graph.components)
    circuit = scores.circuit(0.2)
    assert len(circuit.edges) == int(0.2 * len(scores.graph.edges))
    curve = cl.circuit_curve(model, task, scores, level="edge", fractions=(0.5, 1.0))
    assert float((curve.faithfulness[:, -1] - 1.0).abs().max()) < 1e-4
    node_curve = cl.circuit_curve(model, task, scores, level="node", fractions=(0.5, 1.0))
    assert float((node_curve.faithfulness[:, -1] - 1.0).abs().max()) < 1e-4


@pytest.mark.parametrize("method", METHODS)
def test_an_encoder_is_refused(method) -> None:
    encoder = tiny_bridge("mha", attention_dir="bidirectional")
    with no_pass(encoder), pytest.raises(ValueError, match=r"^model: circuits cannot be found in .*: it is an encoder"):
        cl.circuit_scores(encoder, random_task(encoder), method=method)
