"""cl.block_forms: each layer's attention-block form, public, read before a pass of your own that scores ALTI."""

import pytest
import torch

import contribution_lens as cl
from conftest import assert_close, tiny_bridge

IDS = torch.tensor([1, 5, 7, 9, 3, 2, 11, 4])


def alti_scores(model, context: cl.ScoreContext) -> cl.LayerResults:
    alti = cl.get_method("alti")
    return cl.map_layers(model, IDS, lambda layer: alti.token_scores(layer, context), capture=alti.capture)


def test_read_before_the_pass_block_forms_let_alti_score_inside_your_own_pass() -> None:
    model = tiny_bridge("gqa")  # a fresh model: its forms were never read
    # Inside a pass the probe that reads the forms cannot run: the message says what to call instead.
    message = r"cannot run inside another pass on the same model: call cl\.block_forms\(model\) once before the pass"
    with pytest.raises(ValueError, match=message):
        alti_scores(model, cl.ScoreContext(model=model))
    forms = cl.block_forms(model)
    assert forms == {0: "pre-LN", 1: "pre-LN"}
    got = alti_scores(model, cl.ScoreContext(model=model))
    # The same scores as the method's own preparation gives them (what the faithfulness harness does).
    prepared = cl.get_method("alti").prepare(model, None, [0, 1])
    expected = alti_scores(model, cl.ScoreContext(model=model, prepared=prepared))
    for layer in (0, 1):
        assert_close(got[layer], expected[layer], rtol=0, atol=0)
        assert_close(got[layer].sum(-1)[0], torch.ones(len(IDS)), rtol=1e-5, atol=1e-5)  # rows of shares
    forms[0] = "edited"  # the caller's copy; ALTI still reads the model's
    assert cl.block_forms(model)[0] == "pre-LN"
