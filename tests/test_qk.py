"""The QK maths on tensors: pull-backs through frozen norms, rotations, the sides and the advantage identity."""

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from conftest import assert_close
from contribution_lens import qk

GEN = torch.Generator().manual_seed(0)


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN, dtype=torch.float64)


@pytest.mark.parametrize("centre", [True, False], ids=["layernorm", "rmsnorm"])
def test_a_read_matrix_pulled_back_reads_the_frozen_norms_output(centre: bool) -> None:
    x, gain, read, scale = randn(5, 8), randn(8), randn(8, 3), randn(5).abs() + 0.5
    normed = (x - x.mean(-1, keepdim=True) if centre else x) / scale[:, None] * gain
    assert_close(x @ qk.pull_back(read, gain, centre) / scale[:, None], normed @ read)


def test_heads_are_projected_without_forming_their_outputs() -> None:
    z, W_O, read = randn(6, 4, 3), randn(4, 3, 8), randn(8, 5)
    expected = torch.stack([(z[:, h] @ W_O[h]) @ read for h in range(4)])
    assert_close(qk.project_heads(z, W_O, read), expected)


@pytest.mark.parametrize("width", [8, 4], ids=["full", "partial"])
def test_rotation_is_transformers_rotate_half_and_minus_sin_undoes_it(width: int) -> None:
    x, angles = randn(2, 5, 3, 8), randn(5, width // 2)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    turned = qk.rotate(x, cos[:, None], sin[:, None])
    half_x = x[..., :width].transpose(1, 2)  # [batch head pos d_head], as transformers lays it out
    expected, _ = apply_rotary_pos_emb(half_x, half_x, cos[None], sin[None])
    assert_close(turned[..., :width], expected.transpose(1, 2))
    assert_close(turned[..., width:], x[..., width:])
    assert_close(qk.rotate(turned, cos[:, None], -sin[:, None]), x)


def test_adjacent_pairs_turn_dims_two_by_two() -> None:
    x, angles = randn(4, 6), randn(4, 3)
    cos, sin = angles.cos().repeat_interleave(2, -1), angles.sin().repeat_interleave(2, -1)
    turned = qk.rotate(x, cos, sin, adjacent=True)
    assert_close(turned[:, 0::2], x[:, 0::2] * angles.cos() - x[:, 1::2] * angles.sin())
    assert_close(turned[:, 1::2], x[:, 1::2] * angles.cos() + x[:, 0::2] * angles.sin())
    # A rotation: every pair keeps its length, and the score of two rotated vectors depends on the angle difference.
    assert_close(turned.pow(2).sum(-1), x.pow(2).sum(-1))


def test_both_sides_and_every_pair_add_up_to_the_scores() -> None:
    query_parts, key_parts = randn(3, 2, 4), randn(5, 6, 4)
    q, k = query_parts.sum(0), key_parts.sum(0)
    assert_close(qk.key_side(q, key_parts).sum(1), q @ k.T)
    assert_close(qk.query_side(query_parts, k).sum(1), q @ k.T)
    assert_close(qk.pair_terms(query_parts[:, 1], key_parts[:, 4]).sum(), q[1] @ k[4])


def test_advantages_add_up_to_log_alpha_plus_entropy_over_the_seen_keys() -> None:
    terms = randn(2, 3, 5)
    visible = torch.tensor([[True, True, False, False, False], [True] * 5])
    scores = terms.sum(1).masked_fill(~visible, -torch.inf)
    alpha = torch.softmax(scores, -1)
    advantage = qk.advantage(terms, alpha, visible)
    target = qk.log_alpha_plus_entropy(alpha, visible)
    assert_close(advantage.sum(1), target)
    assert bool((advantage[0, :, 2:] == 0).all()) and bool((target[0, 2:] == 0).all())
    # Adding the same amount to every key of a query changes no advantage: softmax ignores it.
    shifted = terms + randn(2, 3, 1)
    assert_close(qk.advantage(shifted, alpha, visible), advantage)


def test_the_gap_is_relative_to_the_largest_expected_entry() -> None:
    expected = torch.tensor([[100.0, -2.0], [1.0, 0.0]])
    actual = expected + torch.tensor([[0.0, 0.01], [0.0, 5.0]])
    where = torch.tensor([[True, True], [True, False]])
    assert qk.relative_gap(actual, expected, where) == pytest.approx(1e-4)
    assert qk.softcapped(torch.tensor([100.0]), 50.0).item() == pytest.approx(50 * torch.tanh(torch.tensor(2.0)).item())
