"""The method registry: registering, finding and refusing methods, and every method through the harnesses."""

import pytest
import torch

import contribution_lens as cl
from conftest import assert_close, tiny_bridge
from contribution_lens import adapter, faithfulness
from contribution_lens.faithfulness import Settings, clean_run
from contribution_lens.methods import ScoreContext, get_method
from helpers import IDS, PATTERN, TEXT, W_O, V


def test_peer_methods_are_registered() -> None:
    for name in ("alti", "alti_rollout", "value_zeroing", "grad_attention"):
        assert name in cl.available_methods(), f"{name} missing from {cl.available_methods()}"
    assert get_method("grad_attention").signed, "alpha * grad is signed"
    assert get_method("alti").capture == ("hook_resid_pre",)


def test_prepared_scores_are_required() -> None:
    model = tiny_bridge("mha")
    method = get_method("value_zeroing")
    with pytest.raises(ValueError, match="no prepared scores for layer 0: run the method's prepare"):
        cl.map_layers(
            model, torch.tensor([[1, 2, 3]]), lambda layer: method.score_fn(layer, ScoreContext()), layers=[0]
        )


def test_peer_methods_run_through_the_faithfulness_clean_run(bundled_model) -> None:
    batch = adapter.to_token_batch(bundled_model, [TEXT, "A short one."])
    protocol = Settings(methods=("alti", "value_zeroing", "grad_attention"), layers=(0, 15, -1))
    run = clean_run(bundled_model, batch, protocol)
    assert run.layers == [0, 15, 29]
    for name in protocol.methods:
        for layer in run.layers:
            scores = run.scores[name][layer]
            assert scores.shape == run.valid.shape, f"{name} layer {layer}: {tuple(scores.shape)}"
            assert bool((scores[~run.valid] == 0).all()), f"{name} scores a key it cannot see"
            assert bool(scores[run.valid].abs().sum() > 0), f"{name} layer {layer} is all zeros"
    alti_sums = run.scores["alti"][15].sum(-1)[batch.attention_mask]
    assert_close(alti_sums, torch.ones_like(alti_sums), rtol=1e-5, atol=1e-5)
    # A value-zeroing row is all 0 where no zeroed value moves the output by 1e-5 (inseq's threshold).
    vz_sums = run.scores["value_zeroing"][15].sum(-1)[batch.attention_mask]
    moved = vz_sums > 0
    assert int(moved.sum()) >= len(vz_sums) - 2, f"value zeroing rows that sum to 0: {vz_sums.tolist()}"
    assert_close(vz_sums[moved], torch.ones_like(vz_sums[moved]), rtol=1e-5, atol=1e-5)


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
        protocol = faithfulness.Settings(methods=("value_norm_only", "attention"), ratios=(0.0, 0.5))
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
    with pytest.raises(ValueError, match="a method named 'contribution' is already registered; it is built in"):
        cl.register_method("contribution", value_norm_only, replace=True)
    assert cl.get_method("contribution").builtin and cl.get_method("contribution").signed


@pytest.mark.usefixtures("as_a_user")
def test_methods_and_scopes_name_what_exists() -> None:
    with pytest.raises(ValueError, match="unknown method 'norm' for importance"):
        cl.importance(PATTERN, V, W_O, method="norm")
    with pytest.raises(ValueError, match="scope must be one of"):
        cl.ScoreContext(scope="heads")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="a method name is letters, digits"):
        cl.Method("bad name!", lambda layer, context: layer.pattern)


@pytest.mark.usefixtures("as_a_user")
def test_a_method_returning_the_wrong_shape_is_named() -> None:
    model = tiny_bridge("mha")
    bad = cl.Method("flat", lambda layer, context: layer.pattern[:, 0, 0])
    with pytest.raises(
        ValueError, match=r"method 'flat' returned \(1, 3\) at layer 0, expected \[batch head query key\]"
    ):
        cl.map_layers(model, torch.tensor([[1, 2, 3]]), lambda layer: bad.token_scores(layer, cl.ScoreContext()))


def test_the_registry_knows_no_method_and_every_built_in_comes_from_a_family_file() -> None:
    """The registry imports the type of a method, never a family: it declares each family's names, and the
    family's ``METHODS`` tuple holds exactly those, in that order."""
    import ast
    import importlib
    import inspect

    from contribution_lens.methods import registry

    imported = {
        node.module
        for node in ast.walk(ast.parse(inspect.getsource(registry)))
        if isinstance(node, ast.ImportFrom) and node.module
    }
    assert {m for m in imported if m.startswith("contribution_lens.methods")} == {"contribution_lens.methods.method"}
    families = [importlib.import_module(location.partition(":")[0]) for location in registry.METHODS.declared]
    from_families = [m.name for family in families for m in family.METHODS]
    assert list(cl.available_methods()[: len(from_families)]) == from_families
    assert all(cl.get_method(name).builtin and registry.METHODS.is_builtin(name) for name in from_families)
    defaults = [m.name for family in families for m in family.METHODS if m.default]
    assert cl.default_methods() == tuple(defaults) == ("attention", "value_weighted", "output_normalized",
                                                        "contribution", "random")  # fmt: skip


@pytest.mark.parametrize(
    ("returned", "error", "message"),
    [
        (lambda p: p.tolist(), TypeError, r"method 'bad_scores' returned list at layer 0; expected a torch.Tensor"),
        (lambda p: p.numpy(), TypeError, r"method 'bad_scores' returned ndarray at layer 0; expected a torch.Tensor"),
        (
            lambda p: p.to(torch.float8_e4m3fn),
            TypeError,
            r"method 'bad_scores' returned scores of dtype float8_e4m3fn at layer 0; expected one of float16, "
            r"bfloat16, float32, float64",
        ),
        (
            lambda p: p.to(torch.int64),
            TypeError,
            r"method 'bad_scores' returned scores of dtype int64 at layer 0",
        ),
        (
            lambda p: p[:, :, :, :-1],
            ValueError,
            r"method 'bad_scores' returned \(2, 4, 9, 8\) at layer 0, expected \[batch head query key\] "
            r"\(2, 4, 9, 9\) or \[batch query key\] \(2, 9, 9\)",
        ),
        (lambda p: p * torch.nan, ValueError, r"method 'bad_scores' returned non-finite scores at layer 0"),
    ],
    ids=["list", "numpy", "float8", "int", "shape", "nan"],
)
def test_what_a_method_returns_is_checked_and_the_method_named(returned, error, message) -> None:
    model = tiny_bridge("gqa")
    method = cl.Method("bad_scores", lambda layer, context: returned(layer.pattern.clone()))
    with pytest.raises(error, match=message):
        cl.map_layers(model, IDS, lambda layer: method.token_scores(layer, ScoreContext()), layers=[0])


def test_a_token_level_method_must_return_token_level_scores() -> None:
    model = tiny_bridge("gqa")
    method = cl.Method("tokens_only", lambda layer, context: layer.pattern.clone(), token_level=True)
    with pytest.raises(ValueError, match=r"method 'tokens_only' is token level but returned per-head scores"):
        cl.map_layers(model, IDS, lambda layer: method.token_scores(layer, ScoreContext()), layers=[0])
    with pytest.raises(ValueError, match=r"method 'tokens_only' scores tokens, not heads"):
        cl.map_layers(model, IDS, lambda layer: method.head_scores(layer, ScoreContext()), layers=[0])
