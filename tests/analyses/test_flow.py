"""cl.flow: signed token mixing per layer, its rollout, the pruned graph, save/load, figures."""

import numpy as np
import pytest
import torch

import contribution_lens as cl
from conftest import assert_close, tiny_bridge, tiny_encoder
from contribution_lens import adapter
from contribution_lens.analyses.flow import Flow
from contribution_lens.methods.rollout import compose
from contribution_lens.mixing import layer_mixing

IDS = torch.tensor([1, 5, 9, 3, 7, 2, 8, 11])


def _oracle(model, ids):
    """Float64, every part materialised: ``M_ij = sum_h <r_i, alpha vt_j^h> / ||r_i||^2 + [i == j] rho_i``."""
    _, cache = model.run_with_cache(ids[None])
    causal = adapter.is_causal_model(model)
    out = []
    for layer in range(model.cfg.n_layers):
        pattern = cache[adapter.pattern_hook(layer)][0].double()
        v = cache[adapter.value_hook(layer, model)][0].double()
        W_O, b_O = adapter.output_weights(model, layer)
        v = v.repeat_interleave(pattern.shape[0] // v.shape[1], dim=1)
        vt = torch.einsum("khd,hdm->hkm", v, W_O.double())  # [head key d_model]
        parts = torch.einsum("hqk,hkm->hqkm", pattern, vt)  # the oracle may materialise
        x = cache[adapter.resid_pre_hook(layer)][0].double()
        bias = torch.zeros(x.shape[-1], dtype=torch.float64) if b_O is None else b_O.double()
        r = x + parts.sum((0, 2)) + bias
        if causal:  # the decoder's own residual sum after attention
            assert_close(r.float(), cache[f"blocks.{layer}.hook_resid_mid"][0], rtol=1e-4, atol=1e-4)
        squared = (r * r).sum(-1)
        mixing = torch.einsum("qm,hqkm->qk", r, parts) / squared[:, None]
        mixing += torch.diag((r * (x + bias)).sum(-1) / squared)
        out.append(mixing)
    return out


@pytest.mark.parametrize("variant", ["mha", "gqa", "mqa"])
@pytest.mark.parametrize("encoder", [False, True], ids=["decoder", "encoder"])
def test_mixing_matches_a_float64_oracle_and_rows_sum_to_one(variant, encoder):
    model = (tiny_encoder if encoder else tiny_bridge)(variant, biases=True)
    f = cl.flow(model, IDS)
    expected = _oracle(model, IDS)
    for layer in f.layers:
        assert_close(f.mixing[layer], expected[layer].float(), rtol=1e-4, atol=1e-5)
        assert_close(f.mixing[layer].sum(-1), torch.ones(len(IDS)), rtol=0, atol=1e-5)
    if not encoder:  # causal: no share of a future token
        assert float(f.mixing[0].triu(1).abs().max()) == 0


def test_rollout_is_the_composed_mixing_at_the_explained_position():
    model = tiny_bridge("gqa", biases=True, n_layers=3)
    f = cl.flow(model, IDS, position=5)
    composed = compose([f.mixing[layer][None].double() for layer in f.layers])
    expected = torch.stack([rolled[0, 5] for rolled in composed]).float()
    assert f.rollout.shape == (3, len(IDS))
    assert_close(f.rollout, expected, rtol=1e-5, atol=1e-6)
    assert_close(f.rollout.sum(-1), torch.ones(3), rtol=0, atol=1e-5)
    assert float(f.rollout[:, 6:].abs().max()) == 0  # a decoder's position 5 never sees 6, 7


def test_several_positions_share_one_pass():
    model = tiny_bridge("gqa", biases=True)
    both = cl.flow(model, IDS, position=[-1, 2])
    assert both.positions == [7, 2]
    with pytest.raises(ValueError, match=r"flow.at\(position\)"):
        both.rollout  # noqa: B018
    alone = cl.flow(model, IDS, position=2)
    assert_close(both.at(2).rollout, alone.rollout)
    assert_close(both.at(-1).rollout, cl.flow(model, IDS).rollout)


def test_edges_hold_the_three_factors_and_the_graph_is_pruned_top_down():
    model = tiny_bridge("mha", biases=True)
    f = cl.flow(model, IDS, threshold=0.01)
    table = f.to_dataframe()
    heads = table[table["head"] >= 0]
    assert (heads["weight"].abs() >= 0.01).all()
    product = heads["attention"] * heads["relative_norm"] * heads["cosine"]
    assert ((product - heads["weight"]).abs() < 1e-5).all()
    assert (heads["cosine"].abs() <= 1 + 1e-5).all()
    d = cl.attention_geometry(model, IDS, layers=[1])[1]
    row = heads[heads["layer"] == 1].iloc[0]
    assert abs(row["attention"] - float(d.attention[0, row["head"], row["target"], row["source"]])) < 1e-6
    graph = f.graph(threshold=0.05)
    top = graph[graph["layer"] == 1]
    assert set(top["target"]) == {7}
    assert set(graph[graph["layer"] == 0]["target"]) <= set(top["source"])
    assert (graph["weight"].abs() >= 0.05).all()
    with pytest.raises(ValueError, match="below"):
        f.graph(threshold=0.001)


def test_post_attention_norm_parts_rebuild_the_residual_stream(tmp_path):
    """Gemma 3's ln1_post: every part passes the norm's linear part with its scale frozen."""
    from architectures import build

    model = cl.load_model(str(build("Gemma3ForCausalLM", tmp_path / "gemma3")))
    assert adapter.post_attention_norm(model, 0) is not None
    seen = {}

    def per_layer(layer):
        update = adapter.attention_update(model, layer)
        mixing = layer_mixing(layer, update)
        stream = update.resid_pre + update.added
        # No biases in Gemma: what is not a token's part is the stream entering the block.
        expected = (stream * update.resid_pre).sum(-1) / (stream * stream).sum(-1)
        seen[layer.layer] = (mixing.residual, expected, mixing.mixing.sum(-1))

    cl.map_layers(model, IDS[:6], per_layer, capture=adapter.flow_capture(model))
    for residual, expected, rows in seen.values():
        assert_close(residual, expected, rtol=1e-3, atol=1e-4)
        assert_close(rows, torch.ones_like(rows), rtol=0, atol=1e-4)


def test_save_load_repr_and_figures(tmp_path):
    model = tiny_bridge("gqa", biases=True)
    f = cl.flow(model, IDS, position=[-1, 3])
    loaded = Flow.load(f.save(tmp_path / "flow.safetensors"))
    assert loaded.positions == [7, 3] and loaded.threshold == f.threshold
    assert_close(loaded.at(3).rollout, f.at(3).rollout)
    assert loaded.to_dataframe().equals(f.to_dataframe())
    assert repr(f) == "Flow(layers=[0, 1] of 2, batch=1, pos=8, value=FlowLayer, positions=[7, 3], threshold=0.02)"
    figures = f.at(-1).figures()
    graph, rollout = figures["graph"], figures["rollout"]
    edges = f.at(-1).graph()
    hover = " ".join(str(t) for trace in graph.data for t in (trace.hovertext or []))
    head_row = edges[edges["head"] >= 0].iloc[0]
    assert f"L{head_row['layer']}H{head_row['head']}" in hover and "cosine" in hover
    widths = sorted({trace.line.width for trace in graph.data if trace.mode == "lines"})
    assert len(widths) > 1  # width follows |weight|
    assert list(rollout.data[0].z.shape) == [2, 8] and rollout.data[0].zmid == 0


def test_a_truncated_or_foreign_file_is_named_in_the_error(tmp_path):
    path = cl.flow(tiny_bridge(), IDS).save(tmp_path / "flow.safetensors")
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ValueError, match=rf"^{truncated} is not a Flow written by Flow.save \(SafetensorError"):
        Flow.load(truncated)
    geometry = cl.attention_geometry(tiny_bridge(), IDS).save(tmp_path / "g.safetensors")
    with pytest.raises(ValueError, match=rf"^{geometry} is not a Flow .*its format is 'contribution_lens.Geometry/2'"):
        Flow.load(geometry)


@pytest.mark.usefixtures("as_a_user")
def test_bad_input_is_refused_before_the_pass_and_a_bad_position_after_it():
    model = tiny_bridge()
    # One check of positions, one message, in flow as in logit_attribution.
    with pytest.raises(ValueError, match=r"^position 9 does not exist: the text has 8 tokens \(positions -8\.\.7\)$"):
        cl.flow(model, IDS, position=9)
    with pytest.raises(ValueError, match="one text"):
        cl.flow(model, IDS.repeat(2, 1))
    with pytest.raises(ValueError, match=r"^threshold must be a positive finite number, got 0\.0$"):
        cl.flow(model, IDS, threshold=0)
    with pytest.raises(TypeError, match=r"positions must be integers, got float 2\.0"):
        cl.flow(model, IDS, position=2.0)
    computed = cl.flow(model, IDS)
    for refused in (lambda: computed.at(8), lambda: computed.rollout_at(-9), lambda: computed.graph(position=8)):
        with pytest.raises(ValueError, match=r"does not exist: the text has 8 tokens \(positions -8\.\.7\)$"):
            refused()


@pytest.mark.usefixtures("as_a_user")
def test_numpy_and_0d_tensor_integers_are_positions_and_layers():
    model = tiny_bridge("gqa", biases=True)
    f = cl.flow(model, IDS, position=[-1, 2])
    assert cl.flow(model, IDS, position=np.int64(2)).positions == [2]
    assert cl.flow(model, IDS, position=torch.tensor(-1)).positions == [7]
    assert cl.flow(model, IDS, position=np.array([-1, 2])).positions == [7, 2]
    assert f.to_dataframe(layers=torch.tensor(1)).equals(f.to_dataframe(layers=1))
    assert f.to_dataframe(layers=np.array([0])).equals(f.to_dataframe(layers=[0]))


def test_bundled_model_rows_sum_to_one(bundled_model):
    f = cl.flow(bundled_model, "The cat sat on the mat because it was warm.")
    for layer in (0, 15, 29):
        assert_close(f.mixing[layer].sum(-1), torch.ones(f.tokens.shape[1]), rtol=0, atol=1e-4)
    assert_close(f.rollout.sum(-1), torch.ones(30), rtol=0, atol=1e-3)
