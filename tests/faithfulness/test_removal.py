"""Removal: the intervention's exactness, the ranking rule, stacking, deletion, per-head ranking."""

import math

import pytest
import torch

import contribution_lens as cl
from conftest import assert_close, tiny_bridge
from contribution_lens import adapter, faithfulness
from contribution_lens.interventions import remove_keys
from helpers import tiny_clean
from reference import reference_contributions


def test_removal_is_exactly_the_sum_of_the_remaining_terms() -> None:
    model = tiny_bridge("gqa", biases=True)
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    batch = adapter.to_token_batch(model, ids)
    keep = torch.rand(2, 8, 8, generator=torch.Generator().manual_seed(1)) > 0.4
    layer = 1
    captured = cl.map_layers(model, batch, lambda inputs: inputs, layers=[layer], edit=remove_keys({layer: keep}))[
        layer
    ]
    # The pattern the layer used after the edit holds only the surviving terms.
    W_O, b_O = captured.W_O, captured.b_O
    pattern = captured.pattern
    assert bool((pattern[~keep[:, None].expand_as(pattern)] == 0).all())
    remaining = reference_contributions(pattern, captured.v, W_O, "inter")["layer_output"]
    assert_close(remaining + b_O.double(), captured.hook_out.double(), rtol=1e-5, atol=1e-5)


def test_removal_keeps_the_other_weights_unrenormalised() -> None:
    model = tiny_bridge("mha")
    ids = torch.randint(0, 50, (1, 6), generator=torch.Generator().manual_seed(2))
    batch = adapter.to_token_batch(model, ids)
    keep = torch.ones(1, 6, 6, dtype=torch.bool)
    keep[0, 5, 0] = False
    _, cache = model.run_with_cache(ids)
    seen = {
        "pattern": cl.map_layers(model, batch, lambda inputs: inputs.pattern, layers=[0], edit=remove_keys({0: keep}))[
            0
        ]
    }
    clean = cache[adapter.pattern_hook(0)]
    assert bool((seen["pattern"][0, :, 5, 0] == 0).all())
    assert_close(seen["pattern"][0, :, 5, 1:], clean[0, :, 5, 1:])  # not rescaled to sum to 1


@pytest.mark.parametrize("mode", faithfulness.MODES)
@pytest.mark.parametrize("rank_by", ["abs", "signed"])
def test_removal_mask_follows_the_ranking_rule(mode: str, rank_by: str) -> None:
    pos = 10
    scores = torch.randn(2, pos, pos, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    valid = torch.ones(pos, pos, dtype=torch.bool).tril().expand(2, pos, pos).clone()
    valid[1, :, 7:] = False  # padded keys of the second sequence
    valid[1, 7:] = False
    for ratio in (0.0, 0.3, 0.7, 0.9):
        keep = faithfulness.removal_keep_mask(scores, valid, ratio=ratio, mode=mode, rank_by=rank_by)
        assert bool(keep[~valid].all()), "invalid keys are never removed"
        for b in range(2):
            for i in range(pos):
                candidates = valid[b, i].nonzero()[:, 0]
                removed = (~keep[b, i]).nonzero()[:, 0]
                assert len(removed) == math.floor(ratio * len(candidates) + 1e-9)
                if len(removed) == 0 or len(removed) == len(candidates):
                    continue
                value = scores[b, i].abs() if rank_by == "abs" else scores[b, i]
                kept = [int(j) for j in candidates if int(j) not in removed.tolist()]
                if mode == "comprehensiveness":
                    assert value[removed].min() >= value[kept].max()
                else:
                    assert value[removed].max() <= value[kept].min()


def test_inter_scope_output_normalisation_does_not_change_the_ranking() -> None:
    """Per query, ||o_i|| is shared by every (head, key) in the inter scope; per head it is not."""
    from contribution_lens.decomposition import decompose

    g = torch.Generator().manual_seed(5)
    pattern = torch.randn(1, 4, 9, 9, generator=g).masked_fill(~torch.ones(9, 9).tril().bool(), -torch.inf).softmax(-1)
    v, W_O = torch.randn(1, 9, 2, 6, generator=g), torch.randn(4, 6, 16, generator=g)
    masks = {}
    for scope in ("inter", "intra"):
        d = decompose(pattern, v, W_O, scope=scope)
        for method in ("value_weighted", "output_normalized"):
            token_scores = cl.get_method(method).decomposition_score(d).sum(1)
            masks[scope, method] = faithfulness.removal_keep_mask(
                token_scores, d.valid, ratio=0.5, mode="comprehensiveness"
            )
    assert torch.equal(masks["inter", "value_weighted"], masks["inter", "output_normalized"])
    assert not torch.equal(masks["intra", "value_weighted"], masks["intra", "output_normalized"])


@pytest.mark.parametrize("name", list(faithfulness.PROTOCOLS))
def test_stacked_conditions_give_the_logits_of_one_condition_per_pass(name: str) -> None:
    protocol = faithfulness.Settings(methods=("contribution", "random"), protocols=(name,))
    model, batch, clean = tiny_clean(protocol)
    removal = faithfulness.PROTOCOLS[name]
    todo = faithfulness.conditions(protocol, (0.3, 0.6), removal.variants(clean.layers))
    stacked = dict(faithfulness.masked_forward(model, batch, clean, removal, todo, rows_per_pass=64))
    alone = dict(faithfulness.masked_forward(model, batch, clean, removal, todo, rows_per_pass=1))
    assert len(stacked) == len(todo) == 3 * 2 * 2 * len(removal.variants(clean.layers))
    for condition in todo:
        valid = batch.attention_mask
        assert_close(stacked[condition][valid], alone[condition][valid], rtol=1e-4, atol=1e-4)
    nothing = dict(faithfulness.masked_forward(model, batch, clean, removal, [faithfulness.NOTHING_REMOVED]))
    assert_close(nothing[faithfulness.NOTHING_REMOVED], clean.logits, rtol=1e-5, atol=1e-5)


def test_input_deletion_renormalises_over_the_remaining_keys_at_every_layer() -> None:
    protocol = faithfulness.Settings(methods=("contribution",), protocols=("input_deletion",), layers=(1,))
    model, batch, clean = tiny_clean(protocol)
    removal = faithfulness.PROTOCOLS["input_deletion"]
    condition = faithfulness.Condition("contribution", "abs", "comprehensiveness", 0.5)
    keep = removal.keep(clean, condition, 0)
    assert keep is removal.keep(clean, condition, 1), "one ranking per query, the same at every layer"
    edit = faithfulness.removal_edit(clean, removal, [condition])
    seen = cl.map_layers(model, batch, lambda layer: layer.pattern, layers=[0, 1], edit=edit)
    valid = batch.attention_mask
    for layer in (0, 1):
        pattern = seen[layer]
        assert bool((pattern[~keep[:, None].expand_as(pattern)] == 0).all()), "deleted keys get no weight"
        sums = pattern.sum(-1)[valid[:, None].expand(-1, pattern.shape[1], -1)]
        assert_close(sums, torch.ones_like(sums), rtol=1e-5, atol=1e-5)


def test_head_granularity_ranks_each_heads_keys() -> None:
    protocol = faithfulness.Settings(methods=("output_normalized", "random"), granularity="head", scope="intra")
    *_, clean = tiny_clean(protocol)
    assert clean.scores["output_normalized"][0].shape == (2, 4, 8, 8)
    assert clean.scores["random"][1].shape == (2, 4, 8, 8)
    condition = faithfulness.Condition("output_normalized", "abs", "comprehensiveness", 0.5)
    keep = faithfulness.PROTOCOLS["every_layer"].keep(clean, condition, 0)
    assert keep.shape == (2, 4, 8, 8) and not torch.equal(keep[:, 0], keep[:, 1]), "heads choose their own keys"
    assert ((~keep).sum(-1)[0, :, 7] == 4).all(), "each head removes floor(0.5 * 8) keys of query 7"


@pytest.mark.parametrize("mode", faithfulness.MODES)
def test_prediction_deletes_the_explained_tokens_inputs_for_every_query_at_every_layer(mode: str) -> None:
    protocol = faithfulness.Settings(methods=("flow", "random"), protocols=("prediction",))
    model, batch, clean = tiny_clean(protocol, lengths=(8, 6))
    removal = faithfulness.PROTOCOLS["prediction"]
    condition = faithfulness.Condition("flow", "abs", mode, 0.5)
    keep = removal.keep(clean, condition, 0)
    assert keep is removal.keep(clean, condition, 1), "one choice of tokens, the same at every layer"
    for row, explained in enumerate((6, 4)):  # the query predicting the last real token
        deleted = (~keep[row, explained, :explained]).nonzero()[:, 0].tolist()
        assert len(deleted) == explained // 2  # floor(0.5 * the explained position's input tokens)
        assert bool(keep[row, explained, explained]), "the explained position keeps itself"
        assert bool((~keep[row, :, deleted]).sum(0).ge(keep.shape[1] - len(deleted)).all()), "gone for every query"
        share = clean[clean.layers[-1]].scores["flow"][row, explained, :explained].abs()
        kept = [j for j in range(explained) if j not in deleted]
        if mode == "comprehensiveness":
            assert share[deleted].min() >= share[kept].max()
        else:  # sufficiency keeps the top shares
            assert share[deleted].max() <= share[kept].min()
    edit = faithfulness.removal_edit(clean, removal, [condition])
    seen = cl.map_layers(model, batch, lambda layer: layer.pattern, edit=edit)
    for layer in (0, 1):
        pattern = seen[layer]
        assert bool((pattern[~keep[:, None].expand_as(pattern)] == 0).all())
        sums = pattern.sum(-1)[batch.attention_mask[:, None].expand(-1, pattern.shape[1], -1)]
        assert_close(sums, torch.ones_like(sums), rtol=1e-5, atol=1e-5)


def test_prediction_records_measure_the_target_token_alone() -> None:
    from contribution_lens.faithfulness.runner import Unit, _unit_records, check_protocols
    from contribution_lens.losses import _next_token_logprobs

    protocol = faithfulness.Settings(methods=("random",), protocols=("prediction",))
    _, batch, clean = tiny_clean(protocol, lengths=(8, 6))
    unit = Unit("text", "lm", ["0", "1"], list(batch.tokens), [], [])
    records = _unit_records(unit, clean.logits, batch, "prediction")
    logprobs = _next_token_logprobs(clean.logits, batch.tokens)
    assert [r["tokens"] for r in records] == [1, 1]
    assert records[0]["nll"] == pytest.approx(-float(logprobs[0, 6]), rel=1e-6)  # predicts token 7
    assert records[1]["nll"] == pytest.approx(-float(logprobs[1, 4]), rel=1e-6)  # predicts token 5
    choice = Unit("boolq", "choice", [], [], [], [])
    with pytest.raises(ValueError, match="does not take multiple-choice data"):
        check_protocols(protocol, [unit, choice])


def test_logit_attribution_scores_the_last_prediction_as_the_analysis_does() -> None:
    protocol = faithfulness.Settings(methods=("logit_attribution",), protocols=("prediction",))
    model, batch, clean = tiny_clean(protocol, lengths=(8, 6))
    scores = clean[clean.layers[-1]].scores["logit_attribution"]
    expected = cl.logit_attribution(model, batch.tokens[1, :6], target=int(batch.tokens[1, 5]), position=4)
    assert_close(scores[1, 4, :5], torch.tensor(expected.by_key().to_numpy(), dtype=torch.float32))
    assert float(scores[1, :4].abs().max()) == 0 and float(scores[0, 6].abs().sum()) > 0
