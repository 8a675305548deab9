"""The per-layer engine, the method registry and results that behave like data."""

import subprocess
import sys

import pandas as pd
import pytest
import torch

import contribution_lens as cl
from conftest import assert_close, tiny_bridge
from contribution_lens import adapter, faithfulness
from reference import reference_contributions

IDS = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(0))


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


def test_layer_inputs_hold_what_the_layer_offers() -> None:
    model = tiny_bridge("mqa", biases=True, seed=2)
    seen = cl.map_layers(model, IDS, lambda layer: layer, layers=[-1])[-1]
    _, cache = model.run_with_cache(IDS)
    assert seen.layer == 1 and seen.causal
    assert_close(seen.pattern, cache[adapter.pattern_hook(1)])
    assert_close(seen.v, cache[adapter.value_hook(1)])
    assert_close(seen.z, cache["blocks.1.attn.hook_z"])
    assert_close(seen.hook_out, cache[adapter.output_hook(1, model)])
    assert seen.b_O is not None and seen.W_O.shape == (4, 8, 32)
    assert torch.equal(seen.tokens, IDS) and bool(seen.attention_mask.all()) and seen.padding_mask is None


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


def test_tidy_table_with_filters_and_token_strings(bundled_model) -> None:
    g = cl.attention_geometry(bundled_model, "The cat sat on the mat.", layers=[2, 3])
    table = g.to_dataframe(layers=3, heads=[0, 1], queries=[-1])
    n = len(g.str_tokens[0])
    assert len(table) == 2 * n  # one row per visible key of the last query, for two heads
    assert list(table.columns) == [
        "layer",
        "head",
        "query",
        "key",
        "query_token",
        "key_token",
        "attention",
        "relative_norm",
        "cosine",
        "contribution",
    ]
    row = table[(table["head"] == 1) & (table["key"] == 2)].iloc[0]
    assert row["query_token"] == g.str_tokens[0][-1] and row["key_token"] == g.str_tokens[0][2]
    assert row["contribution"] == pytest.approx(g[3].contribution[0, 1, n - 1, 2].item())
    causal = g.to_dataframe(layers=2, heads=0)
    assert (causal["key"] <= causal["query"]).all() and len(causal) == n * (n + 1) // 2


def test_save_and_load_round_trip(tmp_path) -> None:
    model = tiny_bridge("gqa", biases=True)
    g = cl.attention_geometry(model, IDS, scope="intra")
    path = g.save(tmp_path / "g.safetensors")
    back = cl.Geometry.load(path)
    assert back.scope == "intra" and back.layers == g.layers and back.str_tokens == g.str_tokens
    assert back.n_layers == g.n_layers and torch.equal(back.tokens, g.tokens)
    for layer in g:
        for name in cl.FACTORS:
            assert torch.equal(back[layer].factor(name), g[layer].factor(name))
    (tmp_path / "other.safetensors").write_bytes(b"not a file")
    with pytest.raises(Exception):  # noqa: B017 - safetensors' own error for a corrupt file
        cl.Geometry.load(tmp_path / "other.safetensors")
    with pytest.raises(FileNotFoundError, match="no saved Geometry at"):
        cl.Geometry.load(tmp_path / "missing.safetensors")


def test_layer_summary_streams_the_same_numbers_as_the_kept_geometry(bundled_model) -> None:
    text = "Alice gave Bob the book because she had read it."
    streamed = cl.layer_summary(bundled_model, text, layers=[0, 10, 29])
    kept = cl.attention_geometry(bundled_model, text, layers=[0, 10, 29]).layer_summary()
    pd.testing.assert_frame_equal(streamed, kept)


def test_a_registered_method_runs_through_the_faithfulness_scoring() -> None:
    model = tiny_bridge("gqa", biases=True)

    @cl.register_method("value_norm_only", description="||vt|| alone")
    def value_norm_only(layer: cl.LayerInputs, context: cl.ScoreContext) -> torch.Tensor:
        d = layer.decompose(context.scope)
        return d.value_norm[:, :, None, :] * d.valid[:, None].to(d.value_norm.dtype)

    try:
        assert "value_norm_only" in cl.available_methods()
        with pytest.raises(ValueError, match="a method named 'value_norm_only' is already registered"):
            cl.register_method("value_norm_only", value_norm_only)
        protocol = faithfulness.Protocol(methods=("value_norm_only", "attention"), ratios=(0.0, 0.5))
        batch = adapter.to_token_batch(model, IDS)
        clean = faithfulness.clean_run(model, batch, protocol)
        d = cl.attention_geometry(model, IDS)[0]
        expected = (d.value_norm[:, :, None, :] * d.valid[:, None]).sum(1)
        assert_close(clean.scores["value_norm_only"][0], expected)
        condition = faithfulness.Condition("value_norm_only", "abs", "sufficiency", 0.5)
        removal = faithfulness.PROTOCOLS["every_layer"]
        [(_, logits)] = faithfulness.masked_forward(model, batch, clean, removal, [condition])
        assert logits.shape[:2] == IDS.shape
    finally:
        cl.unregister_method("value_norm_only")
    assert "value_norm_only" not in cl.available_methods()
    with pytest.raises(ValueError, match="unknown method 'value_norm_only'; registered methods: attention"):
        cl.get_method("value_norm_only")
    with pytest.raises(ValueError, match="'contribution' is built in and cannot be unregistered"):
        cl.unregister_method("contribution")


def test_random_control_ignores_batching_and_padding() -> None:
    model = tiny_bridge("mha")
    method = cl.get_method("random")
    texts = [IDS[0], IDS[1, :5]]
    alone = [cl.map_layers(model, t, lambda layer: method.token_scores(layer, cl.ScoreContext()))[1] for t in texts]
    batch = adapter.pad_rows(model, texts)
    together = cl.map_layers(model, batch, lambda layer: method.token_scores(layer, cl.ScoreContext()))[1]
    assert torch.equal(together[0], alone[0][0])
    assert torch.equal(together[1, :5, :5], alone[1][0])
    assert bool((together[1, 5:] == 0).all()) and bool((together[1, :, 5:] == 0).all())
    other_seed = cl.map_layers(model, texts[0], lambda layer: method.token_scores(layer, cl.ScoreContext(seed=1)))
    assert not torch.equal(other_seed[1][0], alone[0][0])


def test_public_names_and_no_shadowed_submodule() -> None:
    import contribution_lens

    assert sorted(contribution_lens.__all__) == sorted([*contribution_lens._EXPORTS, "plot"])
    for name in contribution_lens.__all__:
        value = getattr(cl, name)
        module = sys.modules.get(f"contribution_lens.{name}")
        assert module is None or value is module, f"cl.{name} shadows the submodule contribution_lens.{name}"


def test_importing_the_package_does_not_import_torch() -> None:
    code = "import sys, contribution_lens; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def readme_block(marker: str) -> str:
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    blocks = readme.split("```python\n")[1:]
    return next(block.split("```")[0] for block in blocks if marker in block)


def test_the_readmes_examples_run(bundled_model) -> None:
    namespace = {"cl": cl, "model": bundled_model}
    exec(readme_block("def sink_vs_rest"), namespace)
    assert set(namespace["shares"][-1]) == {"sink", "negative"} and namespace["shares"].layers == [0, 10, 29]
    registration = readme_block("@cl.register_method").split("from contribution_lens import")[0]
    try:
        exec(registration, namespace)
        method = cl.get_method("value_norm_only")
        scores = cl.map_layers(bundled_model, "a b c", lambda layer: method.token_scores(layer, cl.ScoreContext()))
        assert scores[0].shape == (1, 4, 4) and bool((scores[0].triu(1) == 0).all())
    finally:
        cl.unregister_method("value_norm_only")
