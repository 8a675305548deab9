"""How the live inspector shows a pass's progress without leaving anything in the notebook.

A pass (the first view's, a new ``tokens``, a page's) reports each layer done (a `Progress`,
given to `contribution_lens.views.inspector.compute.compute_windows`). The widget shows it on its
status line (a custom message: trait changes made while the kernel handles a front-end change
are held until it returns, messages are not). A pass run by a cell (``cl.inspect`` itself, before
any widget is drawn) also shows it as one line of text under a display id, replaced in place; the
inspector displayed in that cell then turns that line into its still (`Progress.cell_output`), so
the cell holds the still and the widget only. No progress widget is left in the cell (a reopened
notebook showed "Error displaying widget: model not found" for it, an export its first frame,
"0%"). Passes under `QUIET_S` seconds show nothing. Outside a kernel (a script) the pass prints a
text bar (tqdm).

Example:
    >>> line(12, 30, 3.2)
    'inspector: one pass over the text, layer 12 of 30 (3 s)'
    >>> line(30, 30, 6.4)
    'inspector: one pass over the text, 30 layers in 6 s'
"""

import time
import uuid
from collections.abc import Callable
from typing import Any

QUIET_S = 1.0
"""A pass shorter than this shows no progress (the first line appears after it)."""


def line(done: int, total: int, elapsed: float) -> str:
    """The progress line after ``done`` of ``total`` layers and ``elapsed`` seconds (the pass's time at the end)."""
    if done >= total:
        return f"inspector: one pass over the text, {total} layers in {elapsed:.0f} s"
    return f"inspector: one pass over the text, layer {done} of {total} ({elapsed:.0f} s)"


def kernel_shell() -> Any:
    """IPython's shell when a Jupyter kernel runs this (None in a script or a plain IPython)."""
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover - IPython comes with anywidget
        return None
    shell = get_ipython()
    return shell if shell is not None and getattr(shell, "kernel", None) is not None else None


class Progress:
    """One pass's progress: to the widget's status line (``send``) and, in a cell, as a text output.

    Called ``(done, total)`` by `contribution_lens.views.inspector.compute.compute_windows`
    (``done == total`` at the end, whether the pass finished or failed).
    """

    def __init__(self, send: Callable[[dict[str, Any]], None]) -> None:
        self._send = send
        self._started = time.monotonic()
        shell = kernel_shell()
        header = getattr(shell, "parent_header", None) or {}
        # A front-end's change (a comm message) has no cell to write to: its output would go nowhere.
        self._in_cell = header.get("header", {}).get("msg_type") == "execute_request"
        self._cell = header.get("header", {}).get("msg_id")
        self._display_id: str | None = None

    def __call__(self, done: int, total: int) -> None:
        elapsed = time.monotonic() - self._started
        ended = done >= total
        if not ended and elapsed < QUIET_S:
            return
        self._send({"type": "progress", "text": "" if ended else line(done, total, elapsed)})
        if self._in_cell:
            self._show(line(done, total, elapsed), ended)

    def cell_output(self) -> str | None:
        """The display id of this pass's line where it is in the cell running now (None: none, or another cell's)."""
        shell = kernel_shell()
        header = (getattr(shell, "parent_header", None) or {}).get("header", {})
        return self._display_id if self._display_id is not None and header.get("msg_id") == self._cell else None

    def _show(self, text: str, ended: bool) -> None:
        from IPython.display import display, update_display

        if self._display_id is None:
            if ended:
                return  # a pass over before its first line: nothing was shown
            self._display_id = f"cl-progress-{uuid.uuid4().hex}"
            display({"text/plain": text}, raw=True, display_id=self._display_id)
        else:
            update_display({"text/plain": text}, raw=True, display_id=self._display_id)
