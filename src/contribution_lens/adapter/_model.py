"""What every part of the adapter reads of a model: its loose type, a hook function's type, its device and dtype."""

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

Model = Any  # a TransformerBridge; typed loosely so tests can pass any bridge-like object
HookFn = Callable[[Tensor, Any], Tensor | None]


def _model_device(model: Model) -> torch.device:
    try:
        return next(model.parameters()).device
    except (AttributeError, StopIteration):
        return torch.device("cpu")


def model_dtype(model: Model) -> torch.dtype:
    try:
        return next(model.parameters()).dtype
    except (AttributeError, StopIteration):
        return torch.float32
