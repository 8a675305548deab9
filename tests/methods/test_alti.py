"""ALTI and its rollout against float64 oracles: a naive one and a port of the authors' code, pre-LN and post-LN."""

import pytest
import torch

import architectures
import contribution_lens as cl
from conftest import assert_close, tiny_bridge
from contribution_lens import adapter
from contribution_lens.methods import alti
from helpers import authors_inputs, method_scores, tiny_batch
from reference import authors_alti

TEXT = "Peers: the cat sat on the mat."


def authors_layers(model, batch, layers: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per layer: the authors' ALTI, their resultant, and the model's own block output to check it by."""
    out = {}
    for layer, got in authors_inputs(model, batch, layers).items():
        post = adapter.block_forms(model)[layer] == adapter.POST_LN
        norm = adapter.post_norm(model, layer) if post else None
        contributions, resultant = authors_alti(
            got["hidden"],
            got["probs"],
            got["values"],
            got["dense_weight"],
            got["dense_bias"],
            ln=None if norm is None else (norm.gain, norm.bias, norm.eps),
            pre_ln_states=got["pre_ln"] if post else None,
        )
        out[layer] = contributions, resultant, (got["post_ln"] if post else got["mid"])[0]
    return out


def assert_matches_authors(model, text: str, *, tolerance: float = 2e-4) -> None:
    batch = adapter.to_token_batch(model, text)
    layers = list(range(model.cfg.n_layers))
    got = method_scores(model, batch, "alti", layers)
    for layer, (expected, resultant, block_output) in authors_layers(model, batch, layers).items():
        # The authors' own check: their resultant is the block's output.
        assert_close(resultant, block_output, rtol=1e-4, atol=1e-4)
        error = float((got[layer][0].double() - expected).abs().max())
        assert error <= tolerance, f"layer {layer}: ALTI differs from the authors' by {error:.2e}"


def test_block_forms_are_read_from_the_model(tiny_bert, bundled_model) -> None:
    assert set(adapter.block_forms(tiny_bert).values()) == {adapter.POST_LN}
    assert set(adapter.block_forms(bundled_model).values()) == {adapter.PRE_LN}
    assert set(adapter.block_forms(tiny_bridge("gqa")).values()) == {adapter.PRE_LN}


def test_post_ln_alti_matches_the_authors_on_a_tiny_bert(tiny_bert) -> None:
    assert_matches_authors(tiny_bert, TEXT)


def test_post_ln_alti_matches_the_authors_on_minilm(encoder_model) -> None:
    assert_matches_authors(encoder_model, TEXT)


def test_pre_ln_alti_matches_the_authors_on_smollm2(bundled_model) -> None:
    assert_matches_authors(bundled_model, TEXT)


def test_post_ln_alti_is_not_the_split_before_the_norm(encoder_model) -> None:
    """The post-LN form is what is computed: the pre-LN split of the same block differs from it."""
    batch = adapter.to_token_batch(encoder_model, TEXT)
    got = method_scores(encoder_model, batch, "alti", [2])[2]

    def split_before_norm(layer):
        return alti.alti_layer(layer, None)

    before = cl.map_layers(encoder_model, batch, split_before_norm, layers=[2], capture=("hook_resid_pre",))[2]
    assert float((got - before).abs().max()) > 1e-2


def test_post_ln_alti_with_padding_equals_each_text_alone(tiny_bert) -> None:
    texts = [TEXT, "A short one."]
    batch = adapter.to_token_batch(tiny_bert, texts)
    together = method_scores(tiny_bert, batch, "alti", [0, 1])
    for row, text in enumerate(texts):
        alone = method_scores(tiny_bert, adapter.to_token_batch(tiny_bert, text), "alti", [0, 1])
        n = int(batch.lengths[row])
        for layer in (0, 1):
            assert_close(together[layer][row, :n, :n], alone[layer][0], rtol=1e-4, atol=1e-5)
            assert bool((together[layer][row, n:] == 0).all()), "padded queries score 0"
    sums = together[1].sum(-1)[batch.attention_mask]
    assert_close(sums, torch.ones_like(sums))


def test_a_block_form_alti_does_not_implement_is_refused_by_name(tmp_path) -> None:
    model = cl.load_model(str(architectures.build("Gemma3ForCausalLM", tmp_path / "gemma3")))
    batch = adapter.to_token_batch(model, TEXT)
    expected = (
        "ALTI is not implemented for the attention block of layer 0: pre-LN with a norm on the attention "
        "output before the residual sum (as in Gemma); it is implemented for pre-LN blocks"
    )
    for name in ("alti", "alti_rollout"):
        with pytest.raises(ValueError, match=expected.replace("(", r"\(").replace(")", r"\)")):
            method_scores(model, batch, name, [0])


def naive_alti(model, batch, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float64 ALTI materialising every T_i(x_j); also returns sum_j T_i(x_j) + b_O and hook_resid_mid."""
    cache: dict[str, torch.Tensor] = {}
    names = [f"blocks.{layer}.{n}" for n in ("hook_resid_pre", "hook_resid_mid", "attn.hook_pattern", "attn.hook_v")]

    def keep(name: str):
        return lambda t, hook: cache.__setitem__(name, t.detach().double())

    hooks = [(name, keep(name)) for name in names]
    adapter.forward(model, batch, hooks)
    x, mid, pattern, v = (cache[name] for name in names)
    W_O, b_O = adapter.output_weights(model, layer)
    W_O = W_O.double()
    n_batch, n_heads, n_pos, _ = pattern.shape
    group = n_heads // v.shape[2]
    scores = torch.zeros(n_batch, n_pos, n_pos, dtype=torch.float64)
    resultant = torch.zeros(n_batch, n_pos, x.shape[-1], dtype=torch.float64)
    for b in range(n_batch):
        length = int(batch.attention_mask[b].sum())
        for i in range(length):
            T = []
            for j in range(i + 1):
                t = sum(pattern[b, h, i, j] * (v[b, j, h // group] @ W_O[h]) for h in range(n_heads))
                T.append(t + (x[b, i] if i == j else 0))
            y = sum(T) + (0 if b_O is None else b_O.double())
            resultant[b, i] = y
            prox = torch.stack([(y.abs().sum() - (y - t).abs().sum()).clamp(min=0) for t in T])
            scores[b, i, : i + 1] = prox / prox.sum()
    return scores, resultant, mid


@pytest.mark.parametrize(
    ("variant", "biases"), [("mha", False), ("gqa", True), ("mqa", True)], ids=["mha", "gqa-bias", "mqa-bias"]
)
def test_alti_matches_naive_float64(variant: str, biases: bool) -> None:
    model = tiny_bridge(variant, biases=biases)
    batch = tiny_batch(model)
    got = method_scores(model, batch, "alti", [0, 1])
    for layer in (0, 1):
        expected, resultant, mid = naive_alti(model, batch, layer)
        real = batch.attention_mask
        # The decoder form is exact: sum_j T_i(x_j) + b_O is the block's hook_resid_mid.
        assert_close(resultant[real], mid[real], rtol=1e-5, atol=1e-6)
        assert_close(got[layer].double(), expected, rtol=1e-4, atol=1e-5)


def test_alti_on_bundled_model_matches_naive_and_sums_to_one(bundled_model) -> None:
    batch = adapter.to_token_batch(bundled_model, "Peers: the cat sat.")
    got = method_scores(bundled_model, batch, "alti", [3])[3]
    expected, resultant, mid = naive_alti(bundled_model, batch, 3)
    assert_close(resultant[0], mid[0], rtol=1e-6, atol=1e-6)
    assert_close(got.double(), expected, rtol=1e-3, atol=1e-5)
    assert bool((got >= 0).all()), "ALTI proximities are clamped at 0"
    assert_close(got.sum(-1), torch.ones_like(got.sum(-1)), rtol=1e-5, atol=1e-5)


def test_alti_chunking_over_queries_changes_nothing() -> None:
    model = tiny_bridge("gqa", biases=True)
    batch = tiny_batch(model)

    def chunked(max_elements: int):
        def fn(layer):
            valid = layer.decompose("inter").valid
            x = layer.captured["hook_resid_pre"]
            return alti.alti_contributions(
                layer.pattern, layer.v, layer.W_O, layer.b_O, x, valid, max_elements=max_elements
            )

        return cl.map_layers(model, batch, fn, layers=[1], capture=("hook_resid_pre",))[1]

    one_query_at_a_time = chunked(1)
    all_at_once = chunked(2**30)
    assert_close(one_query_at_a_time, all_at_once, rtol=1e-5, atol=1e-6)
    sums = all_at_once.sum(-1)[batch.attention_mask]
    assert_close(sums, torch.ones_like(sums))
    assert bool((all_at_once[1, 4:] == 0).all()), "padded queries score 0"


def test_alti_rollout_is_the_product_of_the_naive_layers() -> None:
    model = tiny_bridge("gqa", biases=True, n_layers=3)
    batch = tiny_batch(model)
    got = method_scores(model, batch, "alti_rollout", [0, 2])
    per_layer = [naive_alti(model, batch, layer)[0] for layer in range(3)]
    expected = per_layer[2] @ per_layer[1] @ per_layer[0]
    assert_close(got[0].double(), per_layer[0], rtol=1e-4, atol=1e-5)
    assert_close(got[2].double(), expected, rtol=1e-4, atol=1e-5)
    sums = got[2].sum(-1)[batch.attention_mask]
    assert_close(sums, torch.ones_like(sums))


# --- value zeroing -------------------------------------------------------------------------


# --- grad x attention ----------------------------------------------------------------------


# --- through the harness -------------------------------------------------------------------


def test_alti_without_prepare_reads_the_form_from_the_context_model_or_says_what_it_needs() -> None:
    model = tiny_bridge("gqa", biases=True)
    batch = tiny_batch(model)
    method = cl.get_method("alti")
    prepared = method_scores(model, batch, "alti", [1])[1]

    def score(context):
        return cl.map_layers(
            model, batch, lambda layer: method.token_scores(layer, context), layers=[1], capture=method.capture
        )[1]

    assert_close(score(cl.ScoreContext(model=model)), prepared)
    with pytest.raises(ValueError, match=r"ALTI needs the block form of layer 1: pass ScoreContext\(model=model\)"):
        score(cl.ScoreContext())
