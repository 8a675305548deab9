"""The linearisation's own error: zero on a model the linearisation is exact for, each side against an oracle of
its own on a model it is not (float64), ``contribution-ig``'s shrinking with its steps, mistakes refused first."""

import pytest
import torch
from circuit_helpers import random_task
from test_circuit_bad_inputs import no_pass
from test_contribution import _frozen_metric, _path_derivative
from transformer_lens.config import TransformerBridgeConfig
from transformer_lens.model_bridge import TransformerBridge

import contribution_lens as cl
from conftest import tiny_bridge


def _affine_bridge():
    """A model that is affine in its embeddings, so any linearisation of it is exact.

    Its queries are 0 (every pattern uniform over the keys a query sees, whatever the input), its MLPs are 0,
    and its norms are linear: with ``eps = 1e20`` a LayerNorm's scale ``sqrt(var + eps)`` is ``1e10`` to the last
    bit of a float64 while ``var`` stays under 8192 (half the spacing of floats near ``1e20``), and the gains are
    multiplied by ``1e10`` to undo it. Nothing is frozen by hand: the model itself has nothing to freeze.
    """
    cfg = TransformerBridgeConfig(
        d_model=32, d_head=8, n_heads=4, n_layers=2, n_ctx=64, d_vocab=50, n_key_value_heads=2, act_fn="gelu",
        normalization_type="LN", positional_embedding_type="rotary", attention_dir="causal", seed=0, eps=1e20,
    )  # fmt: skip
    model = TransformerBridge.boot_native(cfg).to(torch.float64)
    with torch.no_grad():
        norms = [module for module in model.modules() if isinstance(module, torch.nn.LayerNorm)]
        assert len(norms) == 2 * cfg.n_layers + 1
        for norm in norms:
            norm.weight.mul_(1e10)
        for layer in range(cfg.n_layers):
            for module in (model.blocks[layer].mlp, model.blocks[layer].attn.q):
                for param in module.parameters():
                    param.zero_()
    model.eval()
    return model


@pytest.mark.parametrize("method", ["contribution", "contribution-ig"])
def test_the_error_is_zero_where_the_linearisation_is_exact(method) -> None:
    model = _affine_bridge()
    task = random_task(model)
    result = cl.linearisation_error(model, task, method, steps=2)
    assert float(result.true.abs().max()) > 1e-2  # the counterfactual changes the metric
    torch.testing.assert_close(result.linearised, result.true, rtol=1e-9, atol=1e-12)


@torch.no_grad()
def _true_change(model, task) -> torch.Tensor:
    rows = torch.arange(len(task))

    def metric(tokens):
        at = model(tokens)[rows, task.last]
        return at.gather(1, task.answer[:, None])[:, 0] - at.gather(1, task.foil[:, None])[:, 0]

    return metric(task.corrupted) - metric(task.clean)


def test_each_side_against_its_oracle_on_a_model_that_is_not_linear() -> None:
    """``linearised``: ``L``'s change, the frozen model's derivative along ``e_r - e_o`` (central differences,
    patterns and norm scales put back by hooks); ``true``: the plain model's change. They differ."""
    model = tiny_bridge("gqa", biases=True).to(torch.float64)
    task = random_task(model, n=4, seed=1)
    result = cl.linearisation_error(model, task)
    step = 1e-4
    want = float((_frozen_metric(model, task, step) - _frozen_metric(model, task, -step)) / (2 * step))
    assert abs(float(result.linearised.mean()) - want) <= 1e-6 * abs(want) + 1e-8
    torch.testing.assert_close(result.true, _true_change(model, task), rtol=1e-9, atol=1e-12)
    assert result.mean_absolute_error > 1e-3 and result.steps == 1
    low, high = result.interval
    assert low <= result.mean_error <= high
    assert result.table.columns.tolist() == ["prompt", "true", "linearised", "error"]


def test_contribution_ig_is_its_path_derivative_and_its_error_shrinks_with_its_steps() -> None:
    model = tiny_bridge("gqa", biases=True).to(torch.float64)
    task = random_task(model, n=4, seed=1)
    errors = []
    for steps in (1, 4, 16):
        result = cl.linearisation_error(model, task, "contribution-ig", steps=steps)
        want = _path_derivative(model, task, [(k + 0.5) / steps for k in range(steps)])
        torch.testing.assert_close(result.linearised, want, rtol=1e-6, atol=1e-8)
        errors.append(result.mean_absolute_error)
    # The midpoint rule: the error of a smooth path falls as 1 / steps^2.
    assert errors[1] < errors[0] / 4 and errors[2] < errors[1] / 4, errors


@pytest.mark.usefixtures("as_a_user")
def test_mistakes_are_refused_before_any_pass() -> None:
    model = tiny_bridge("gqa")
    task = random_task(model)
    cases = [
        (dict(method="eap"), "method: 'eap' has no metric change of its own to compare; one of contribution, "),
        (dict(steps=0), "steps must be a positive integer, got 0"),
        (dict(steps=2.0), "steps must be a positive integer, got 2.0"),
        (dict(memory=-1), "memory must be a positive number of bytes, got -1"),
    ]
    for arguments, message in cases:
        with no_pass(model), pytest.raises(ValueError) as error:
            cl.linearisation_error(model, task, **arguments)
        assert message in str(error.value), (arguments, str(error.value))
    with no_pass(model), pytest.raises(ValueError, match="task must be a contribution_lens Task"):
        cl.linearisation_error(model, "ioi")
