"""`TangentsApart`: forward-mode products computed as two plain products, the same primal, tangent and gradient."""

import pytest
import torch
import torch.autograd.forward_ad as forward_ad
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from contribution_lens.circuits.tangents import TangentsApart

WEIGHT = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
BIAS = torch.randn(5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
SCALE = torch.rand(3, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(2)) + 0.5

PRODUCTS = {
    "linear with bias": lambda x: F.linear(x, WEIGHT, BIAS),
    "matmul operator": lambda x: x @ WEIGHT.T,
    "matmul, dual on the right": lambda x: WEIGHT @ x.T,
    "einsum": lambda x: torch.einsum("pd,ed->pe", x, WEIGHT),
    "mul by a weight": lambda x: x * WEIGHT[0, :4],
    "quotient's numerator": lambda x: x / SCALE,
    "quotient's denominator (not apart)": lambda x: SCALE / (x**2 + 1),
    "both operands dual (not apart)": lambda x: x * x,
}


def _run(product, apart: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The primal, the tangent and the gradient of the primal's squared sum at ``x``."""
    x = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).requires_grad_(True)
    tangent = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(x, tangent)
        if apart:
            with TangentsApart():
                y = product(dual)
        else:
            y = product(dual)
        primal, dy = forward_ad.unpack_dual(y)
        (gradient,) = torch.autograd.grad((primal**2).sum(), x)
    return primal.detach(), dy.detach(), gradient


@pytest.mark.parametrize("name", list(PRODUCTS))
def test_apart_gives_pytorchs_primal_tangent_and_gradient(name) -> None:
    want = _run(PRODUCTS[name], apart=False)
    got = _run(PRODUCTS[name], apart=True)
    assert float(want[1].abs().max()) > 0
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def test_apart_makes_two_products_and_no_copy_of_the_weight() -> None:
    """PyTorch's forward mode makes the weight's zero tangent dense and multiplies by it: three products."""
    x = torch.randn(6, 4)
    weight = torch.randn(5, 4)
    counts = {}
    for apart in (False, True):
        with forward_ad.dual_level():
            dual = forward_ad.make_dual(x, torch.randn_like(x))
            with _Count() as count:
                if apart:
                    with TangentsApart():
                        F.linear(dual, weight)
                else:
                    F.linear(dual, weight)
        counts[apart] = [c for c in count.calls if c in ("aten.mm", "aten.addmm", "aten.copy_", "aten.clone")]
    assert counts[True] == ["aten.mm", "aten.mm"], counts
    assert len(counts[False]) > 2, counts
