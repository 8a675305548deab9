"""The per-layer engine, the method registry and results that behave like data."""

import pytest
import torch

import contribution_lens as cl
from conftest import assert_close, tiny_bridge
from contribution_lens import adapter
from helpers import IDS
from reference import reference_contributions


def test_a_users_per_layer_analysis_runs_on_the_engine() -> None:
    model = tiny_bridge("gqa", biases=True)

    def head_output_norms(layer: cl.LayerInputs) -> torch.Tensor:
        # What the README shows: the user's own analysis is one function of the layer.
        return layer.decompose("intra").output_norm.mean((0, 2))

    norms = cl.map_layers(model, IDS, head_output_norms)
    assert norms.layers == [0, 1] and len(norms) == 2 and list(norms) == [0, 1]
    _, cache = model.run_with_cache(IDS)
    for layer in norms:
        pattern, v = cache[adapter.pattern_hook(layer)], cache[adapter.value_hook(layer)]
        ref = reference_contributions(pattern, v, adapter.output_weights(model, layer)[0], "intra")
        assert_close(norms[layer], ref["output_norm"].mean((0, 2)), rtol=1e-4, atol=1e-5)


def test_forward_stops_after_the_last_requested_layer() -> None:
    model = tiny_bridge("mha", n_layers=3)
    fired = []
    hooks = [
        (f"blocks.{layer}.hook_resid_post", lambda t, hook, layer=layer: fired.append(layer)) for layer in range(3)
    ]
    cl.map_layers(model, IDS, lambda layer: None, layers=[1], extra_hooks=hooks)
    assert fired == [0]  # layer 1's attention output was the last thing computed
    fired.clear()
    kept = cl.map_layers(model, IDS, lambda layer: None, layers=[1], keep_logits=True, extra_hooks=hooks)
    assert fired == [0, 1, 2] and kept.logits is not None and kept.logits.shape[:2] == IDS.shape


def test_results_behave_like_a_mapping() -> None:
    model = tiny_bridge("gqa")
    g = cl.attention_geometry(model, IDS, layers=[0, -1])
    assert g.layers == [0, 1] and g[-1] is g[1] and -1 in g and 5 not in g
    with pytest.raises(KeyError, match=r"layer -3 \(= -1\) was not computed; computed layers: \[0, 1\]"):
        g[-3]
    text = repr(g)
    assert text.startswith("Geometry(layers=[0, 1] of 2, batch=2, pos=9") and len(text) < 200
    assert "scope='inter'" in text and "<table>" in g._repr_html_()
    assert len(repr(g[0])) < 200
    doubled = g.to(torch.float64)
    assert doubled[0].contribution.dtype == torch.float64 and doubled.layers == g.layers


@pytest.mark.usefixtures("as_a_user")
def test_any_integer_indexes_layers_and_bool_does_not() -> None:
    import numpy as np

    model = tiny_bridge("mha")
    results = cl.map_layers(model, IDS, lambda layer: layer.layer, layers=np.array([0, 1]))
    assert results.layers == [0, 1]
    assert results[np.int64(1)] == results[torch.tensor(-1)] == 1 and np.int64(0) in results
    with pytest.raises(TypeError, match="layers are indexed by int, got bool True"):
        results[True]
    with pytest.raises(TypeError, match=r"layers must be integers, got float 1\.5"):
        cl.map_layers(model, IDS, lambda layer: None, layers=[1.5])
    with pytest.raises(TypeError, match="layers must be integers, got str '1'"):
        cl.map_layers(model, IDS, lambda layer: None, layers="1")
