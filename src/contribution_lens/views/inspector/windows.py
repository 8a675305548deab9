"""The token window an inspector shows, and how its tokens are labelled.

A text of ``n`` tokens is shown a window at a time: queries ``start .. start + tokens - 1``
(clipped to the text), keys the same positions plus the sink at 0 (every query of a causal
model sees it). The widget's menu offers the half-overlapping windows of `window_starts`.
``inspector.js`` computes the same starts (``windowStarts``) and the same cells (``cellIndex``);
the golden test holds them together.
"""

from dataclasses import dataclass

import numpy as np
import torch
from jaxtyping import Float
from torch import Tensor

DEFAULT_TOKENS = 128
"""Queries in a token window unless told otherwise: 128 x 129 cells draw in about a second."""


@dataclass(frozen=True)
class Window:
    """The token positions shown: queries ``first..last``, keys the same plus the sink at 0.

    Example:
        >>> Window([2, 3], [0, 2, 3], causal=True).mask.tolist()
        [[True, True, False], [True, True, True]]
    """

    queries: list[int]
    keys: list[int]
    causal: bool

    @property
    def mask(self) -> np.ndarray:
        """``[query key]`` True where the cell is displayable (``key <= query`` if causal)."""
        keys, queries = np.asarray(self.keys), np.asarray(self.queries)
        if not self.causal:
            return np.ones((len(queries), len(keys)), dtype=bool)
        return keys[None, :] <= queries[:, None]

    @property
    def cells(self) -> int:
        """How many (query, key) cells the window displays."""
        return int(self.mask.sum())

    @property
    def key(self) -> str:
        """A name for the window, ``"first-last"``."""
        return f"{self.queries[0]}-{self.queries[-1]}"


def token_window(n: int, *, start: int = 0, tokens: int = DEFAULT_TOKENS, causal: bool = True) -> Window:
    """Positions ``start .. start + tokens - 1`` (clipped to the text) as queries; keys add the sink 0.

    Example:
        >>> token_window(10, start=6, tokens=3).keys
        [0, 6, 7, 8]
    """
    if tokens < 1:
        raise ValueError(f"tokens must be a positive integer, got {tokens}")
    if not 0 <= start < n:
        raise ValueError(f"start {start} is outside the text of {n} tokens")
    queries = list(range(start, min(n, start + tokens)))
    keys = queries if start == 0 else [0, *queries]
    return Window(queries, keys, causal)


def window_starts(n: int, tokens: int) -> list[int]:
    """The starts of the half-overlapping windows of ``tokens`` queries over ``n`` tokens (the widget's menu).

    Starts step by ``s = max(1, tokens // 2)`` and stop at the first window reaching the text's end.

    Example:
        >>> window_starts(15, 8)
        [0, 4, 8]
    """
    step = max(1, tokens // 2)
    return [start for start in range(0, max(1, n - tokens + step), step) if start < n]


def window_start(n: int, position: int, tokens: int) -> int:
    """The start of the first menu window (`window_starts`) holding ``position``: its keys reach furthest back.

    Example:
        >>> window_start(15, 9, 8), window_start(15, 3, 8)
        (4, 0)
    """
    return next(start for start in window_starts(n, tokens) if start + tokens > position)


def token_label(position: int, token: str) -> str:
    """``"{position}:{token}"`` with line breaks and tabs shown as ``\\n``, ``\\r``, ``\\t``.

    Example:
        >>> token_label(3, "\\n")
        '3:\\\\n'
    """
    return f"{position}:" + token.replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")


def cut(values: Float[Tensor, "*head query key"], window: Window) -> np.ndarray:
    """``[*head cell]``: the window's displayable cells of a ``[query key]`` tensor, row-major, float32."""
    rows = values[..., window.queries, :][..., window.keys].to(torch.float32).cpu().numpy()
    return rows[..., window.mask]
