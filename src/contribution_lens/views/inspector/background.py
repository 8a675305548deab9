"""The inspector's payloads computed ahead of the view, in a thread of their own, while the kernel stays free.

The first view's pass decomposes the one layer shown and keeps what every other layer needs
(`contribution_lens.views.inspector.compute.keep`); `Prefetch` then computes the payloads the
view is likely to ask for next (the shown window's other layers, nearest first, then the other
windows of its size), one at a time, each under the cache's lock, so that the kernel answers the
front-end between them and a payload the view asks for is computed once. The thread runs torch on
one thread (its own OpenMP setting: the kernel's keeps its own), so that the cell a user runs
meanwhile gets the other core; it holds no hook and runs no pass, and never touches the widget's
traits or comm (the kernel's thread sends what it computed, when the view asks).
"""

import atexit
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

ENABLED = True
"""Whether an inspector computes ahead in a thread (else each payload when its view asks for it)."""

_RUNNING: "weakref.WeakSet[Prefetch]" = weakref.WeakSet()
"""The threads started and not yet finished, which the interpreter's exit stops first (`_stop_all`)."""


class Prefetch:
    """Calls ``compute(item)`` for each of ``items`` in a daemon thread until done or `stop`ped.

    ``compute`` is the cache's: it takes the cache's lock and does nothing for an item already
    computed. ``done`` counts the items handed over.

    Example:
        >>> seen = []
        >>> worker = Prefetch(seen.append, [1, 2, 3])
        >>> worker.start().join()
        >>> seen, worker.done
        ([1, 2, 3], 3)
    """

    def __init__(self, compute: Callable[[Any], object], items: Iterable[Any]) -> None:
        self._compute, self._items = compute, list(items)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="contribution-lens-prefetch", daemon=True)
        self.done = 0
        self.error: BaseException | None = None
        """What stopped the thread early, if anything (the view computes that payload itself when it asks)."""

    def start(self) -> "Prefetch":
        if ENABLED:
            _RUNNING.add(self)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Ask the thread to end after the item it is on (it does not wait for it)."""
        self._stopped.set()

    def join(self, timeout: float | None = None) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with torch.inference_mode():
                for item in self._items:
                    if self._stopped.is_set():
                        return
                    self._compute(item)
                    self.done += 1
        except BaseException as error:
            self.error = error
        finally:
            torch.set_num_threads(before)  # what this thread changed for threads started after it


@atexit.register
def _stop_all() -> None:
    """Stop every running thread and wait for the item it is on: a daemon thread killed inside torch's
    kernels at the interpreter's exit aborts the process ("terminate called without an active exception")."""
    running = list(_RUNNING)
    # The thread and event themselves: at exit the runtime type checks of the methods may no longer run.
    for worker in running:
        worker._stopped.set()
    for worker in running:
        if worker._thread.is_alive():
            worker._thread.join(timeout=120)
