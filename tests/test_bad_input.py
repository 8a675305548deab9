"""Bad input gets a clear error naming the argument, before any expensive work.

These tests switch jaxtyping's runtime checks off, so they see exactly what a user sees (the
checks run only under pytest).
"""

from collections.abc import Iterator

import jaxtyping
import pytest
import torch

import contribution_lens as cl
from conftest import tiny_bridge
from contribution_lens import adapter

G = torch.Generator().manual_seed(0)
SCORES = torch.randn(1, 2, 4, 4, generator=G)
PATTERN = SCORES.masked_fill(torch.ones(4, 4).triu(1).bool(), -torch.inf).softmax(-1)
V = torch.randn(1, 4, 2, 3, generator=G)
W_O = torch.randn(2, 3, 5, generator=G)


@pytest.fixture(autouse=True)
def as_a_user() -> Iterator[None]:
    jaxtyping.config.update("jaxtyping_disable", True)
    yield
    jaxtyping.config.update("jaxtyping_disable", False)


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


def test_pre_softmax_scores_are_not_a_pattern() -> None:
    with pytest.raises(ValueError, match=r"pattern must hold attention probabilities .* row sums in \[") as error:
        cl.decompose(SCORES, V, W_O)
    assert "Pre-softmax scores (hook_attn_scores)? Apply softmax over keys first" in str(error.value)


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


def test_non_finite_padding_is_ignored_and_checks_can_be_switched_off() -> None:
    pattern, v = PATTERN.clone(), V.clone()
    mask = torch.tensor([[True, True, True, False]])
    v[0, 3] = float("nan")  # a padded key: never enters the result
    d = cl.decompose(pattern, v, W_O, attention_mask=mask)
    assert bool(torch.isfinite(d.contribution).all())
    unchecked = cl.decompose(SCORES.softmax(-1) * 2, V, W_O, check_values=False)  # the caller vouches for it
    assert unchecked.attention.shape == (1, 2, 4, 4)


def test_the_result_does_not_alias_the_callers_pattern() -> None:
    pattern = PATTERN.clone()
    d = cl.decompose(pattern, V, W_O)
    before = d.contribution.clone()
    pattern.zero_()
    assert torch.equal(d.attention, PATTERN) and torch.equal(d.contribution, before)


def test_half_precision_inputs_accumulate_finitely() -> None:
    big_v = (V * 300).to(torch.float16)  # ||vt||^2 overflows float16's 65504
    d = cl.decompose(PATTERN.to(torch.float16), big_v, W_O.to(torch.float16))
    assert d.contribution.dtype == torch.float32 and bool(torch.isfinite(d.contribution).all())
    torch.testing.assert_close(d.sum_over_heads().sum(-1), torch.ones(1, 4), atol=1e-3, rtol=0)


def test_token_ids_and_layers_and_caches() -> None:
    model = tiny_bridge("gqa")
    with pytest.raises(ValueError, match=r"token id 50 is outside the model's vocabulary of 50 ids \(0..49\)"):
        cl.attention_geometry(model, torch.tensor([[1, 2, 50]]))
    with pytest.raises(ValueError, match=r"token id -1 is outside the model's vocabulary"):
        cl.map_layers(model, torch.tensor([[1, -1, 3]]), lambda layer: None)
    with pytest.raises(ValueError, match=r"layer -3 does not exist: the model has 2 layers \(0..1\)"):
        cl.attention_geometry(model, torch.tensor([[1, 2, 3]]), layers=[-3])
    assert cl.attention_geometry(model, torch.tensor([[1, 2, 3]]), layers=[-1]).layers == [1]
    _, cache = model.run_with_cache(torch.tensor([[1, 2, 3]]), remove_batch_dim=True)
    with pytest.raises(ValueError, match=r"the cache has no batch axis \(made with remove_batch_dim=True\)"):
        cl.attention_geometry(model, cache)


def test_a_one_token_summary_is_refused() -> None:
    model = tiny_bridge("mha")
    with pytest.raises(ValueError, match="it needs a text of at least two tokens"):
        cl.attention_geometry(model, torch.tensor([[7]])).layer_summary()
    with pytest.raises(ValueError, match="it needs a text of at least two tokens"):
        cl.layer_summary(model, torch.tensor([[7]]))


def test_methods_and_scopes_name_what_exists() -> None:
    with pytest.raises(ValueError, match="unknown method 'norm' for importance"):
        cl.importance(PATTERN, V, W_O, method="norm")
    with pytest.raises(ValueError, match="scope must be one of"):
        cl.ScoreContext(scope="heads")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="a method name is letters, digits"):
        cl.Method("bad name!", lambda layer, context: layer.pattern)


def test_a_method_returning_the_wrong_shape_is_named() -> None:
    model = tiny_bridge("mha")
    bad = cl.Method("flat", lambda layer, context: layer.pattern[:, 0, 0])
    with pytest.raises(ValueError, match=r"method 'flat' returned \(1, 3\), expected \[batch head query key\]"):
        cl.map_layers(model, torch.tensor([[1, 2, 3]]), lambda layer: bad.token_scores(layer, cl.ScoreContext()))


def test_bad_sink_positions() -> None:
    model = tiny_bridge("mha")
    with pytest.raises(ValueError, match="sink position 9 is outside the sequence of 3 tokens"):
        cl.sink_analysis(model, torch.tensor([[1, 2, 3]]), sinks=[9])
    with pytest.raises(ValueError, match="sinks must be positions, a mask or 'auto', got 'first'"):
        cl.sink_analysis(model, torch.tensor([[1, 2, 3]]), sinks="first")


def test_pad_rows_checks_vocabulary_through_to_token_batch() -> None:
    model = tiny_bridge("mha")
    with pytest.raises(ValueError, match="attention_mask is not right-padded"):
        adapter.to_token_batch(model, torch.tensor([[1, 2, 3]]), attention_mask=torch.tensor([[1, 0, 1]]))
