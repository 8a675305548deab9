"""The maths on plain tensors: identities, the float64 oracle, masking and bad input."""

import pytest
import torch

import contribution_lens as cl
from conftest import assert_close, raises_bad_input
from contribution_lens.decomposition import decompose_layer, head_outputs
from helpers import PATTERN, SCORES, SHAPES, W_O, V, random_layer
from reference import reference_contributions


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


@pytest.mark.parametrize("scope", ["intra", "inter"])
def test_a_half_precision_hook_z_is_rebuilt_and_a_precise_one_is_taken(scope: str) -> None:
    """One rule in `head_outputs` and `decompose_layer`: a z rounded to bfloat16 is rebuilt, a float32 z is used."""
    pattern, v, W_O = (t.bfloat16() for t in random_layer("gqa", seed=3))
    rebuilt = decompose_layer(pattern, v, W_O, scope=cl.Scope(scope), causal=True)
    rounded = head_outputs(pattern, v).bfloat16()  # what a bfloat16 model's hook_z holds
    assert_close(head_outputs(pattern, v, z=rounded), head_outputs(pattern, v), rtol=0, atol=0)
    given = decompose_layer(pattern, v, W_O, scope=cl.Scope(scope), causal=True, z=rounded)
    assert_close(given.contribution, rebuilt.contribution, rtol=0, atol=0)
    # A float32 z is the model's own and is taken as it is: a changed one changes the weights.
    changed = head_outputs(pattern, v) * 1.5
    assert_close(head_outputs(pattern, v, z=changed), changed, rtol=0, atol=0)
    taken = decompose_layer(pattern, v, W_O, scope=cl.Scope(scope), causal=True, z=changed)
    assert not torch.allclose(taken.contribution, rebuilt.contribution)


def test_bad_input_messages() -> None:
    pattern, v, W_O = random_layer("gqa")
    with raises_bad_input("scope must be one of"):
        cl.decompose(pattern, v, W_O, scope="heads")  # type: ignore[arg-type]
    with raises_bad_input("unknown method 'norm'"):
        cl.importance(pattern, v, W_O, method="norm")  # type: ignore[arg-type]
    with raises_bad_input("does not divide"):
        cl.decompose(pattern, torch.randn(2, 7, 4, 5), torch.randn(6, 5, 12))
    with raises_bad_input("dtype must be torch.float32 or torch.float64"):
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


@pytest.mark.usefixtures("as_a_user")
@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (
            {"pattern": PATTERN[0]},
            "pattern must be 4-D [batch head query key] (hook_pattern), got shape (2, 4, 4) "
            "(add the batch axis: tensor[None])",
        ),
        (
            {"v": V[0]},
            "v must be 4-D [batch key kv_head d_head] (hook_v), got shape (4, 2, 3) (add the batch axis: tensor[None])",
        ),
        ({"W_O": W_O[0]}, "W_O must be 3-D [head d_head d_model], got shape (3, 5)"),
        (
            {"z": torch.zeros(1, 2, 4, 3)},
            "z must be [batch query head d_head] (hook_z) = (1, 4, 2, 3), got shape (1, 2, 4, 3)",
        ),
        ({"v": V.long()}, "v must be a floating point tensor, got dtype torch.int64"),
        ({"attention_mask": torch.ones(1, 3)}, "attention_mask must be [batch key] = (1, 4), got shape (1, 3)"),
    ],
    ids=["pattern-3d", "v-3d", "W_O-2d", "z-layout", "v-int", "mask-shape"],
)
def test_ranks_layouts_and_dtypes(arguments: dict, message: str) -> None:
    inputs = {"pattern": PATTERN, "v": V, "W_O": W_O} | arguments
    pattern, v, w = inputs.pop("pattern"), inputs.pop("v"), inputs.pop("W_O")
    with pytest.raises(ValueError) as error:
        cl.decompose(pattern, v, w, **inputs)
    assert str(error.value) == message


@pytest.mark.usefixtures("as_a_user")
def test_pre_softmax_scores_are_not_a_pattern() -> None:
    with pytest.raises(ValueError, match=r"pattern must hold attention probabilities .* row sums in \[") as error:
        cl.decompose(SCORES, V, W_O)
    assert "Pre-softmax scores (hook_attn_scores)? Apply softmax over keys first" in str(error.value)


@pytest.mark.usefixtures("as_a_user")
@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("v", float("nan"), "v has 1 non-finite entries (NaN or inf) at real positions"),
        ("pattern", float("inf"), "pattern has 1 non-finite entries (NaN or inf) at real positions"),
        ("W_O", float("nan"), "W_O has 1 non-finite entries (NaN or inf) at real positions"),
    ],
)
def test_non_finite_values_are_refused(name: str, value: float, message: str) -> None:
    inputs = {"pattern": PATTERN.clone(), "v": V.clone(), "W_O": W_O.clone()}
    inputs[name].view(-1)[0] = value
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        cl.decompose(inputs["pattern"], inputs["v"], inputs["W_O"])


@pytest.mark.usefixtures("as_a_user")
def test_non_finite_padding_is_ignored_and_checks_can_be_switched_off() -> None:
    pattern, v = PATTERN.clone(), V.clone()
    mask = torch.tensor([[True, True, True, False]])
    v[0, 3] = float("nan")  # a padded key: never enters the result
    d = cl.decompose(pattern, v, W_O, attention_mask=mask)
    assert bool(torch.isfinite(d.contribution).all())
    unchecked = cl.decompose(SCORES.softmax(-1) * 2, V, W_O, check_values=False)  # the caller vouches for it
    assert unchecked.attention.shape == (1, 2, 4, 4)


@pytest.mark.usefixtures("as_a_user")
def test_the_result_does_not_alias_the_callers_pattern() -> None:
    pattern = PATTERN.clone()
    d = cl.decompose(pattern, V, W_O)
    before = d.contribution.clone()
    pattern.zero_()
    assert torch.equal(d.attention, PATTERN) and torch.equal(d.contribution, before)


@pytest.mark.usefixtures("as_a_user")
def test_half_precision_inputs_accumulate_finitely() -> None:
    big_v = (V * 300).to(torch.float16)  # ||vt||^2 overflows float16's 65504
    d = cl.decompose(PATTERN.to(torch.float16), big_v, W_O.to(torch.float16))
    assert d.contribution.dtype == torch.float32 and bool(torch.isfinite(d.contribution).all())
    torch.testing.assert_close(d.sum_over_heads().sum(-1), torch.ones(1, 4), atol=1e-3, rtol=0)
