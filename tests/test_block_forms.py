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


def test_a_half_precision_stream_far_larger_than_a_blocks_output_is_still_read_as_pre_ln() -> None:
    model = tiny_bridge("gqa").to(torch.bfloat16)
    with torch.no_grad():
        model.embed.W_E.mul_(400.0)  # as in Qwen2.5: a stream hundreds of times a block's output
    caught: dict[str, torch.Tensor] = {}
    hooks = [(f"blocks.1.{name}", lambda t, hook, name=name: caught.__setitem__(name, t.detach()))
             for name in ("hook_resid_pre", "hook_resid_mid")]  # fmt: skip
    with torch.no_grad():
        model.run_with_hooks(IDS[None], fwd_hooks=hooks)
    added = (caught["hook_resid_mid"].double() - caught["hook_resid_pre"].double()).abs().max()
    assert float(caught["hook_resid_pre"].abs().max()) > 100 * float(added)
    # The bfloat16 rounding of the sum alone is then far above 3e-2 of the output, which is not a
    # different block form.
    assert cl.block_forms(model) == {0: "pre-LN", 1: "pre-LN"}
