"""Peer methods (alti, value_zeroing, grad_attention) against plain oracles, and through the harnesses."""

import pytest
import torch
import torch.nn.functional as F

import contribution_lens as cl
from conftest import assert_close, tiny_bridge
from contribution_lens import adapter, peers
from contribution_lens.faithfulness import Protocol, clean_run
from contribution_lens.methods import ScoreContext, get_method

TEXT = "The cat sat on the mat because it was warm."


def tiny_batch(model) -> adapter.TokenBatch:
    """Two texts, the second right-padded, so padding is exercised everywhere."""
    tokens = torch.tensor([[1, 5, 9, 3, 7, 2, 8], [4, 6, 11, 13, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0, 0]])
    return adapter.to_token_batch(model, tokens, attention_mask=mask)


def method_scores(model, batch, name: str, layers: list[int]) -> dict[int, torch.Tensor]:
    """A registered method's raw scores, run the way the harnesses run it."""
    method = get_method(name)
    prepared = method.prepare(model, batch, layers) if method.prepare is not None else None
    context = ScoreContext(model=model, prepared=prepared)
    result = cl.map_layers(
        model, batch, lambda layer: method.score_fn(layer, context), layers=layers, capture=method.capture
    )
    return dict(result.items())


def test_peer_methods_are_registered() -> None:
    for name in ("alti", "alti_rollout", "value_zeroing", "grad_attention"):
        assert name in cl.available_methods(), f"{name} missing from {cl.available_methods()}"
    assert get_method("grad_attention").signed, "alpha * grad is signed"
    assert get_method("alti").capture == ("hook_resid_pre",)


# --- alti ----------------------------------------------------------------------------------


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

    def alti(max_elements: int):
        def fn(layer):
            valid = layer.decompose("inter").valid
            x = layer.captured["hook_resid_pre"]
            return peers.alti_contributions(
                layer.pattern, layer.v, layer.W_O, layer.b_O, x, valid, max_elements=max_elements
            )

        return cl.map_layers(model, batch, fn, layers=[1], capture=("hook_resid_pre",))[1]

    one_query_at_a_time = alti(1)
    all_at_once = alti(2**30)
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


def naive_value_zeroing(model, batch, layer: int) -> torch.Tensor:
    """One full model pass per zeroed token, reading hook_resid_post: Mohebbi et al.'s loop."""
    post = f"blocks.{layer}.hook_resid_post"

    def run(key: int | None) -> torch.Tensor:
        kept: dict[str, torch.Tensor] = {}

        def zero(v: torch.Tensor, hook) -> torch.Tensor:
            v = v.clone()
            v[:, key] = 0
            return v

        hooks = [(post, lambda t, hook: kept.__setitem__("y", t.clone()))]
        if key is not None:
            hooks.append((adapter.value_hook(layer), zero))
        adapter.forward(model, batch, hooks)
        return kept["y"]

    clean = run(None)
    n_pos = batch.tokens.shape[1]
    distance = torch.stack([1 - F.cosine_similarity(clean, run(j), dim=-1) for j in range(n_pos)], dim=-1)
    causal = torch.ones(n_pos, n_pos, dtype=torch.bool).tril()
    mask = batch.attention_mask
    visible = causal & mask[:, None, :] & mask[:, :, None]
    distance = torch.where(visible & (distance >= peers.VALUE_ZEROING_THRESHOLD), distance, 0)
    total = distance.sum(-1, keepdim=True)
    return distance / torch.where(total == 0, 1, total)


@pytest.mark.parametrize("variant", ["mha", "gqa"])
def test_value_zeroing_batched_equals_one_token_loop(variant: str) -> None:
    model = tiny_bridge(variant, biases=True)
    batch = tiny_batch(model)
    batched = peers.value_zeroing_scores(model, batch, [0, 1])
    looped = peers.value_zeroing_scores(model, batch, [0, 1], chunk_size=1)
    for layer in (0, 1):
        # float32 kernels round differently for other batch shapes and thread counts (seen: 1e-5 at 2 threads)
        assert_close(batched[layer], looped[layer], rtol=1e-4, atol=1e-5)
        assert_close(batched[layer], naive_value_zeroing(model, batch, layer), rtol=1e-4, atol=1e-5)


def test_value_zeroing_on_bundled_model_equals_full_passes(bundled_model) -> None:
    batch = adapter.to_token_batch(bundled_model, ["Peers: the cat sat.", "A dog"])
    got = method_scores(bundled_model, batch, "value_zeroing", [2])[2]
    assert_close(got, naive_value_zeroing(bundled_model, batch, 2), rtol=1e-3, atol=1e-4)
    sums = got.sum(-1)[batch.attention_mask]
    assert_close(sums, torch.ones_like(sums), rtol=1e-5, atol=1e-5)


# --- grad x attention ----------------------------------------------------------------------


def autograd_alpha_times_grad(model, batch, layer: int) -> torch.Tensor:
    """alpha * dL/dalpha with alpha of one layer swapped for a leaf tensor (the rest of the graph intact)."""
    leaf: dict[str, torch.Tensor] = {}

    def swap(pattern: torch.Tensor, hook) -> torch.Tensor:
        leaf["alpha"] = pattern.detach().clone().requires_grad_(True)
        return leaf["alpha"]

    kwargs = {"attention_mask": batch.attention_mask.long()} if batch.padded else {}
    with torch.enable_grad(), model.hooks(fwd_hooks=[(adapter.pattern_hook(layer), swap)]):
        logits = model(batch.tokens, **kwargs)
    log_probs = torch.log_softmax(logits[:, :-1].double(), dim=-1)
    nll = -log_probs.gather(-1, batch.tokens[:, 1:, None])[..., 0]
    predicted = batch.attention_mask[:, 1:] & batch.attention_mask[:, :-1]
    nll[predicted].mean().backward()
    alpha = leaf["alpha"]
    assert alpha.grad is not None, "the loss must depend on the swapped pattern"
    visible = torch.ones(alpha.shape[-2:], dtype=torch.bool).tril() & batch.attention_mask[:, None, None, :]
    return torch.where(visible, alpha.detach() * alpha.grad, 0)


def test_grad_attention_equals_autograd_on_a_leaf_pattern() -> None:
    model = tiny_bridge("gqa", biases=True)
    batch = tiny_batch(model)
    got = method_scores(model, batch, "grad_attention", [0, 1])
    for layer in (0, 1):
        expected = autograd_alpha_times_grad(model, batch, layer)
        assert bool(got[layer].abs().sum() > 0), f"layer {layer}: no gradient reached the pattern"
        assert_close(got[layer], expected.float(), rtol=1e-4, atol=1e-7)


def test_grad_attention_on_bundled_model_and_needs_two_tokens(bundled_model) -> None:
    batch = adapter.to_token_batch(bundled_model, "Peers: the cat sat.")
    got = method_scores(bundled_model, batch, "grad_attention", [5])[5]
    assert_close(got, autograd_alpha_times_grad(bundled_model, batch, 5).float(), rtol=1e-3, atol=1e-7)
    one_token = adapter.to_token_batch(bundled_model, torch.tensor([[1]]))
    with pytest.raises(ValueError, match="grad_attention needs at least two tokens in a text"):
        peers.attention_gradients(bundled_model, one_token, [0])


def test_prepared_scores_are_required() -> None:
    model = tiny_bridge("mha")
    method = get_method("value_zeroing")
    with pytest.raises(ValueError, match="no prepared scores for layer 0: run the method's prepare"):
        cl.map_layers(
            model, torch.tensor([[1, 2, 3]]), lambda layer: method.score_fn(layer, ScoreContext()), layers=[0]
        )


# --- through the harness -------------------------------------------------------------------


def test_peer_methods_run_through_the_faithfulness_clean_run(bundled_model) -> None:
    batch = adapter.to_token_batch(bundled_model, [TEXT, "A short one."])
    protocol = Protocol(methods=("alti", "value_zeroing", "grad_attention"), layers=(0, 15, -1))
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
