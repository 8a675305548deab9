"""The maths on plain tensors: identities, the float64 oracle, masking and bad input."""

import pytest
import torch

import contribution_lens as cl
from conftest import assert_close, raises_bad_input
from reference import reference_contributions

SHAPES = {"mha": (4, 4), "gqa": (6, 2), "mqa": (4, 1)}


def random_layer(variant: str, *, batch: int = 2, pos: int = 7, d_head: int = 5, d_model: int = 12, seed: int = 0):
    n_heads, n_kv = SHAPES[variant]
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(batch, n_heads, pos, pos, generator=g)
    causal = torch.ones(pos, pos, dtype=torch.bool).tril()
    pattern = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    v = torch.randn(batch, pos, n_kv, d_head, generator=g)
    W_O = torch.randn(n_heads, d_head, d_model, generator=g)
    return pattern, v, W_O


@pytest.mark.parametrize("scope", ["intra", "inter"])
@pytest.mark.parametrize("variant", list(SHAPES))
def test_agrees_with_float64_oracle(variant: str, scope: str) -> None:
    pattern, v, W_O = random_layer(variant)
    d = cl.decompose(pattern, v, W_O, scope=scope, dtype=torch.float64)
    ref = reference_contributions(pattern, v, W_O, scope)
    for name in ("contribution", "cosine", "relative_norm", "value_norm", "output_norm"):
        assert_close(getattr(d, name), ref[name], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("variant", list(SHAPES))
def test_float32_close_to_oracle(variant: str) -> None:
    pattern, v, W_O = random_layer(variant, seed=3)
    d = cl.decompose(pattern, v, W_O)
    assert d.contribution.dtype == torch.float32
    assert_close(
        d.contribution, reference_contributions(pattern, v, W_O, "inter")["contribution"], rtol=1e-4, atol=1e-5
    )


@pytest.mark.parametrize("variant", list(SHAPES))
def test_weights_sum_to_one(variant: str) -> None:
    pattern, v, W_O = random_layer(variant, seed=1)
    intra = cl.decompose(pattern, v, W_O, scope="intra")
    inter = cl.decompose(pattern, v, W_O, scope="inter")
    batch, n_heads, pos, _ = pattern.shape
    assert_close(intra.contribution.sum(-1), torch.ones(batch, n_heads, pos), atol=1e-5)
    assert_close(inter.sum_over_heads().sum(-1), torch.ones(batch, pos), atol=1e-5)


@pytest.mark.parametrize("scope", ["intra", "inter"])
def test_factors_multiply_back(scope: str) -> None:
    pattern, v, W_O = random_layer("gqa", seed=2)
    d = cl.decompose(pattern, v, W_O, scope=scope)
    assert_close(d.attention * d.relative_norm * d.cosine, d.contribution, atol=1e-6)
    assert bool((d.cosine.abs() <= 1).all())
    # The sign of a weight is the sign of its cosine: negative weights are real here.
    assert bool((d.contribution < 0).any())
    assert bool(((d.contribution < 0) == (d.cosine < 0))[d.attention > 0].all())


def test_destructive_interference_example() -> None:
    # Two tokens, one head, identity W_O: o = 0.5*(1,0) + 0.5*(-3,0) = (-1,0).
    pattern = torch.tensor([[[[1.0, 0.0], [0.5, 0.5]]]])
    v = torch.tensor([[[[1.0, 0.0]], [[-3.0, 0.0]]]])
    d = cl.decompose(pattern, v, torch.eye(2)[None], scope="intra")
    assert_close(d.contribution[0, 0, 1], torch.tensor([-0.5, 1.5]))
    assert_close(d.relative_norm[0, 0, 1], torch.tensor([1.0, 3.0]))
    assert_close(d.cosine[0, 0, 1], torch.tensor([-1.0, 1.0]))


def test_future_keys_are_exactly_zero() -> None:
    pattern, v, W_O = random_layer("mha")
    d = cl.decompose(pattern, v, W_O)
    future = ~torch.ones(7, 7, dtype=torch.bool).tril()
    for name in ("attention", "relative_norm", "cosine", "contribution"):
        assert bool((d.factor(name)[..., future] == 0).all()), name


def test_padding_is_zero_and_never_nan() -> None:
    pattern, v, W_O = random_layer("gqa")
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1, 4:] = False
    # A model may leave NaN in fully padded rows; they must not leak.
    pattern = pattern.clone()
    pattern[1, :, 4:, :] = float("nan")
    v = v.clone()
    v[1, 4:] = float("nan")
    d = cl.decompose(pattern, v, W_O, attention_mask=mask)
    for name in ("attention", "relative_norm", "cosine", "contribution"):
        tensor = d.factor(name)
        assert bool(torch.isfinite(tensor).all()), name
        assert bool((tensor[1, :, 4:, :] == 0).all()) and bool((tensor[1, :, :, 4:] == 0).all()), name
    assert bool((d.value_norm[1, :, 4:] == 0).all())
    alone = cl.decompose(pattern[1:, :, :4, :4], v[1:, :4], W_O)
    assert_close(d.contribution[1:, :, :4, :4], alone.contribution)
    assert_close(alone.sum_over_heads().sum(-1), torch.ones(1, 4), atol=1e-5)


def test_zero_output_is_defined() -> None:
    pattern, v, W_O = random_layer("mha", batch=1)
    v = torch.zeros_like(v)
    d = cl.decompose(pattern, v, W_O, scope="intra")
    for name in ("relative_norm", "cosine", "contribution"):
        assert bool((d.factor(name) == 0).all()), name
    assert_close(d.attention, pattern)


def test_half_precision_inputs_accumulate_in_float32() -> None:
    pattern, v, W_O = random_layer("gqa", seed=5)
    d16 = cl.decompose(pattern.bfloat16(), v.bfloat16(), W_O.bfloat16())
    assert d16.contribution.dtype == torch.float32
    assert bool(torch.isfinite(d16.contribution).all())
    ref = reference_contributions(pattern.bfloat16(), v.bfloat16(), W_O.bfloat16(), "inter")["contribution"]
    assert_close(d16.contribution, ref, rtol=1e-4, atol=1e-5)


def test_importance_methods_follow_their_definitions() -> None:
    pattern, v, W_O = random_layer("gqa", seed=4)
    d = cl.decompose(pattern, v, W_O)
    vn = d.value_norm[:, :, None, :]
    expected = {
        "attention": pattern,
        "value_weighted": pattern * vn,
        "output_normalized": pattern * vn / d.output_norm[..., None],
        "contribution": d.contribution,
    }
    for method in cl.METHODS:
        assert_close(cl.importance(pattern, v, W_O, method=method), expected[method].tril(), atol=1e-6)


def test_bad_input_messages() -> None:
    pattern, v, W_O = random_layer("gqa")
    with raises_bad_input("scope must be one of"):
        cl.decompose(pattern, v, W_O, scope="heads")  # type: ignore[arg-type]
    with raises_bad_input("unknown method 'norm'"):
        cl.importance(pattern, v, W_O, method="norm")  # type: ignore[arg-type]
    with raises_bad_input("does not divide"):
        cl.decompose(pattern, torch.randn(2, 7, 4, 5), torch.randn(6, 5, 12))
    with raises_bad_input("floating point"):
        cl.decompose(pattern, v, W_O, dtype=torch.int64)


@pytest.mark.parametrize(
    ("case", "message"),
    [("W_O", "W_O has shape"), ("v", "v has shape"), ("mask", "attention_mask has shape")],
)
def test_shape_mismatch_is_refused(case: str, message: str) -> None:
    pattern, v, W_O = random_layer("gqa")
    kwargs = {"attention_mask": torch.ones(2, 3, dtype=torch.bool)} if case == "mask" else {}
    args = {"W_O": (pattern, v, W_O[:, :3]), "v": (pattern, v[:, :5], W_O), "mask": (pattern, v, W_O)}[case]
    with raises_bad_input(message):
        cl.decompose(*args, **kwargs)
