"""Forward-mode products without the weights' zero tangents: the primal and the tangent as two plain products.

In forward mode a product ``y = x W`` has the tangent ``dy = dx W + x dW``. PyTorch computes both
terms even where the weight carries no tangent: ``dW`` becomes a dense zero tensor the size of the
weight (a copy of every weight, the unembedding's too) and ``x dW`` a third product. Every product
of a dual activation by a weight without tangent is linear in the activation alone, so

    y = x_p W,    dy = dx W

is exact: two products instead of three and no copy of the weight.

Example:
    >>> import torch, torch.autograd.forward_ad as forward_ad
    >>> w = torch.eye(2) * 3
    >>> with forward_ad.dual_level(), TangentsApart():
    ...     y = forward_ad.make_dual(torch.ones(2), torch.tensor([1.0, 0.0])) @ w
    ...     forward_ad.unpack_dual(y).tangent
    tensor([3., 0.])
"""

from typing import Any

import torch.autograd.forward_ad as forward_ad
from torch import Tensor
from torch.overrides import TorchFunctionMode

LINEAR_IN_EACH_OPERAND = frozenset(
    {"linear", "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "einsum", "mul", "__mul__", "__rmul__"}
)
"""Products linear in each tensor operand (``linear``'s bias aside): the tangent of one operand passes through."""
LINEAR_IN_FIRST_OPERAND = frozenset({"linear", "div", "__truediv__"})
"""Linear in the first operand only (a quotient in its numerator): apart only where that operand is the dual one."""


class TangentsApart(TorchFunctionMode):
    """Within it, a product with one dual operand ``x`` is computed as ``y = f(.., x_p, ..)``, ``dy = f(.., dx, ..)``.

    Products are matrix products, ``einsum``, elementwise ``mul`` and a quotient's numerator. Any other
    call runs as PyTorch defines it (both operands dual, keyword tensors, anything else).
    Reverse mode is unchanged: the primal is computed from the operands' primals, which keep their
    autograd history, and ``make_dual`` passes gradients on to it.
    """

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        linear = LINEAR_IN_EACH_OPERAND | LINEAR_IN_FIRST_OPERAND
        if name not in linear or any(isinstance(v, Tensor) for v in kwargs.values()):
            return func(*args, **kwargs)
        tensors = [i for i, a in enumerate(args) if isinstance(a, Tensor)]
        dual = [i for i in tensors if forward_ad.unpack_dual(args[i]).tangent is not None]
        if len(dual) != 1 or (name in LINEAR_IN_FIRST_OPERAND and dual[0] != 0):
            return func(*args, **kwargs)
        primals = [forward_ad.unpack_dual(a).primal if isinstance(a, Tensor) else a for a in args]
        moved = list(primals)
        moved[dual[0]] = forward_ad.unpack_dual(args[dual[0]]).tangent
        if name == "linear":  # the bias is no operand of the product: the tangent has none
            moved = moved[:2]
        return forward_ad.make_dual(func(*primals, **kwargs), func(*moved, **kwargs))
