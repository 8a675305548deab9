"""The circuit wiring's shared-input projection: each head's own gradient from one norm and one product."""

import tempfile
from pathlib import Path

import pytest
import torch
import torch.autograd.forward_ad as forward_ad
from torch import nn

import contribution_lens as cl
from conftest import tiny_bridge
from contribution_lens.adapter import circuit_wiring
from contribution_lens.adapter.anatomy import Norm, anatomy_of, read_norm
from contribution_lens.adapter.circuit_wiring import _one_input_expanded, _projected, _SharedInput

GENERATOR = torch.Generator().manual_seed(0)
HEADS, D_MODEL, D_HEAD = 3, 6, 2


class OffsetRMSNorm(nn.Module):
    """Gemma's RMS norm: ``x / sqrt(mean(x^2) + eps) * (1 + w)``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(D_MODEL, generator=GENERATOR, dtype=torch.float64) - 0.5)
        self.eps = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


def _norms() -> dict[str, tuple[object, Norm | None]]:
    """Per case, the norm as a pass applies it and, where its products are taken in closed form, its `Norm`."""
    layer, rms = nn.LayerNorm(D_MODEL).double(), nn.RMSNorm(D_MODEL, eps=1e-5).double()
    offset = OffsetRMSNorm()
    with torch.no_grad():
        for module in (layer, rms):
            module.weight.copy_(torch.rand(D_MODEL, generator=GENERATOR, dtype=torch.float64) + 0.5)
        layer.bias.copy_(torch.randn(D_MODEL, generator=GENERATOR, dtype=torch.float64))
    scale = torch.rand(2, 4, 1, generator=GENERATOR, dtype=torch.float64) + 0.5
    return {
        "LayerNorm": (layer, None),
        "RMSNorm": (rms, None),
        "frozen scale": (lambda x: x * layer.weight / scale[..., None], None),
        "LayerNorm, closed form": (layer, Norm(True, 1e-5, module=layer, gained=True, biased=True, closed=True)),
        "RMSNorm, closed form": (rms, Norm(False, 1e-5, module=rms, gained=True, closed=True)),
        "offset RMSNorm, closed form": (offset, Norm(False, 1e-6, 1.0, module=offset, gained=True, closed=True)),
    }


CLOSED = ["LayerNorm, closed form", "RMSNorm, closed form", "offset RMSNorm, closed form"]


@pytest.mark.parametrize("name", ["LayerNorm", "RMSNorm", "frozen scale", *CLOSED])
def test_each_heads_gradient_is_the_one_of_its_own_normed_input(name, monkeypatch) -> None:
    """Against the per-head way: every head normed apart, in float64, with a different gradient a head; a norm
    of known form (a closed `Norm`: LayerNorm, RMSNorm, Gemma's offset gain) takes the closed-form product, any
    other autograd's."""
    norm, form = _norms()[name]
    closed = []
    vjp = circuit_wiring._norm_vjp
    monkeypatch.setattr(circuit_wiring, "_norm_vjp", lambda *args: closed.append(1) or vjp(*args))
    W = torch.randn(HEADS, D_MODEL, D_HEAD, generator=GENERATOR, dtype=torch.float64)
    stream = torch.randn(2, 4, D_MODEL, generator=GENERATOR, dtype=torch.float64).requires_grad_(True)
    upstream = torch.randn(2, 4, HEADS, D_HEAD, generator=GENERATOR, dtype=torch.float64)
    found = []
    for shared in (True, False):
        x = stream[:, :, None].expand(-1, -1, HEADS, -1)
        assert _one_input_expanded(x)
        out = _SharedInput.apply(x, W, norm, form) if shared else torch.einsum("bphd,hde->bphe", norm(x), W)
        per_head, whole = torch.autograd.grad((out * upstream).sum(), [x, stream])
        found.append((out.detach(), per_head, whole))
    for mine, theirs in zip(found[0], found[1], strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(found[0][1][:, :, 0], found[0][1][:, :, 1])  # the heads' gradients differ
    assert len(closed) == (name in CLOSED)


def test_the_norms_of_the_bundled_families_are_known_forms() -> None:
    """GPT-2's LayerNorm and the RMS norms of Llama-like and Gemma models take the closed-form product (with the
    model's own eps); a norm of another kind keeps autograd's."""
    import architectures

    for name, centre in (("LlamaForCausalLM", False), ("Gemma3ForCausalLM", False), ("GPT2LMHeadModel", True)):
        model = cl.load_model(str(architectures.build(name, Path(tempfile.mkdtemp()) / name)))
        norm = anatomy_of(model).layers[0].ln1
        module = model.blocks[0].ln1.original_component
        assert norm is not None and norm.closed and norm.centre == centre and norm.module is module, name
        assert norm.eps == getattr(module, "variance_epsilon", getattr(module, "eps", None)), name
    assert not read_norm(nn.Identity()).closed


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


@pytest.mark.parametrize("biases", [False, True])
def test_eaps_gradient_pass_norms_each_layers_input_once_a_side(monkeypatch, biases) -> None:
    """A clean gradient pass projects every layer's q, k and v inputs the shared way (3 a layer), taking the
    model's own projections as their values (none computed twice); the scores are those of projections of its own."""
    model = tiny_bridge("gqa", biases=biases)
    calls = []
    apply = _SharedInput.apply
    monkeypatch.setattr(circuit_wiring._SharedInput, "apply", lambda *args: calls.append(args[4]) or apply(*args))
    ids = torch.randint(0, 50, (2, 5), generator=GENERATOR)
    task = cl.Task("t", ids, ids.flip(0), ids[:, 0], ids[:, 1], cl.Task.full_length(ids))
    reused = cl.circuit_scores(model, task, method="eap").edge_scores
    assert len(calls) == 3 * model.cfg.n_layers
    assert all(own is not None for own in calls), "a projection computed twice"
    monkeypatch.setattr(circuit_wiring, "_expands", lambda x, stream: False)
    calls.clear()
    own = cl.circuit_scores(model, task, method="eap").edge_scores
    assert len(calls) == 3 * model.cfg.n_layers and all(x is None for x in calls)
    torch.testing.assert_close(reused, own, rtol=1e-5, atol=1e-6)
    assert bool(reused.abs().max() > 1e-3)


@pytest.mark.parametrize("name", CLOSED)
def test_each_heads_own_input_is_normed_and_projected_in_closed_form(name) -> None:
    """A patched pass's inputs differ by head: ``N(x^h) W^h`` in closed form is the module's own norm of each
    head's input, projected (float64; inputs whose mean is far from 0, where centring matters)."""
    _, form = _norms()[name]
    assert form is not None and form.closed
    W = torch.randn(HEADS, D_MODEL, D_HEAD, generator=GENERATOR, dtype=torch.float64)
    x = 3 * torch.randn(2, 4, HEADS, D_MODEL, generator=GENERATOR, dtype=torch.float64) + 2
    want = torch.einsum("bphd,hde->bphe", form.module(x), W)
    torch.testing.assert_close(_projected(form, x, W), want, rtol=1e-12, atol=1e-12)
