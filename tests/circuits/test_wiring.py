"""The circuit wiring's shared-input projection: each head's own gradient from one norm and one product."""

import pytest
import torch
import torch.autograd.forward_ad as forward_ad
from torch import nn

import contribution_lens as cl
from conftest import tiny_bridge
from contribution_lens.adapter import circuit_wiring
from contribution_lens.adapter.circuit_wiring import _one_input_expanded, _SharedInput

GENERATOR = torch.Generator().manual_seed(0)
HEADS, D_MODEL, D_HEAD = 3, 6, 2


def _norms() -> dict[str, nn.Module]:
    layer, rms = nn.LayerNorm(D_MODEL).double(), nn.RMSNorm(D_MODEL, eps=1e-5).double()
    with torch.no_grad():
        for module in (layer, rms):
            module.weight.copy_(torch.rand(D_MODEL, generator=GENERATOR, dtype=torch.float64) + 0.5)
        layer.bias.copy_(torch.randn(D_MODEL, generator=GENERATOR, dtype=torch.float64))
    scale = torch.rand(2, 4, 1, generator=GENERATOR, dtype=torch.float64) + 0.5
    return {"LayerNorm": layer, "RMSNorm": rms, "frozen scale": lambda x: x * layer.weight / scale[..., None]}


@pytest.mark.parametrize("name", ["LayerNorm", "RMSNorm", "frozen scale"])
def test_each_heads_gradient_is_the_one_of_its_own_normed_input(name) -> None:
    """Against the per-head way: every head normed apart, in float64, with a different gradient a head."""
    norm = _norms()[name]
    W = torch.randn(HEADS, D_MODEL, D_HEAD, generator=GENERATOR, dtype=torch.float64)
    stream = torch.randn(2, 4, D_MODEL, generator=GENERATOR, dtype=torch.float64).requires_grad_(True)
    upstream = torch.randn(2, 4, HEADS, D_HEAD, generator=GENERATOR, dtype=torch.float64)
    found = []
    for shared in (True, False):
        x = stream[:, :, None].expand(-1, -1, HEADS, -1)
        assert _one_input_expanded(x)
        out = _SharedInput.apply(x, W, norm) if shared else torch.einsum("bphd,hde->bphe", norm(x), W)
        per_head, whole = torch.autograd.grad((out * upstream).sum(), [x, stream])
        found.append((out.detach(), per_head, whole))
    for mine, theirs in zip(found[0], found[1], strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(found[0][1][:, :, 0], found[0][1][:, :, 1])  # the heads' gradients differ


def test_the_shared_way_is_taken_only_for_one_expanded_input_autograd_records() -> None:
    stream = torch.randn(2, 4, D_MODEL).requires_grad_(True)
    assert _one_input_expanded(stream[:, :, None].expand(-1, -1, HEADS, -1))
    assert not _one_input_expanded(stream[:, :, None].repeat(1, 1, HEADS, 1))  # inputs that may differ
    assert not _one_input_expanded(stream.detach()[:, :, None].expand(-1, -1, HEADS, -1))  # no autograd
    with torch.no_grad():
        assert not _one_input_expanded(stream[:, :, None].expand(-1, -1, HEADS, -1))
    with forward_ad.dual_level():  # a pass carrying tangents: the shared way defines none
        dual = forward_ad.make_dual(stream, torch.ones_like(stream))
        assert not _one_input_expanded(dual[:, :, None].expand(-1, -1, HEADS, -1))


def test_eaps_gradient_pass_norms_each_layers_input_once_a_side(monkeypatch) -> None:
    """A clean gradient pass projects every layer's q, k and v inputs the shared way (3 a layer)."""
    model = tiny_bridge("gqa")
    calls = []
    apply = _SharedInput.apply
    monkeypatch.setattr(circuit_wiring._SharedInput, "apply", lambda *args: calls.append(1) or apply(*args))
    ids = torch.randint(0, 50, (2, 5), generator=GENERATOR)
    task = cl.Task("t", ids, ids.flip(0), ids[:, 0], ids[:, 1], cl.Task.full_length(ids))
    cl.circuit_scores(model, task, method="eap")
    assert len(calls) == 3 * model.cfg.n_layers
