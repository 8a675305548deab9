"""What an inspector keeps between views: each layer's payload of the precomputed windows, and the *why* splits.

`LayerCache` holds every layer's payload of the windows the last pass cut (the shown one and
the half-overlapping windows of its size, `PRECOMPUTE_BYTES` at most beyond it): a layer or
window switch among them sends what is ready. `WhyCache` holds the QK tape that pass recorded
(`contribution_lens.analyses.qk_attribution.QKTape`, `WHY_TAPE_BYTES` at most), the last
`WHY_KEPT` heads' splits and every *why* row computed, so a repeated click costs nothing.
"""

from collections.abc import Callable, Sequence
from typing import Any

from contribution_lens.analyses.qk_attribution import QKAttribution, QKTape, qk_attribution
from contribution_lens.views.inspector.compute import compute_windows
from contribution_lens.views.inspector.payload import payload_bytes
from contribution_lens.views.inspector.progress import Progress
from contribution_lens.views.inspector.subject import Subject
from contribution_lens.views.inspector.why import row_key, why_row
from contribution_lens.views.inspector.windows import Window, window_starts

PRECOMPUTE_BYTES = 400_000_000
"""The most payload bytes one pass precomputes beyond the window shown (other windows of the same size)."""
WHY_KEPT = 3
"""The (layer, head) splits the *why* panel keeps: a click on another query of one of them computes no pass."""
WHY_TAPE_BYTES = 1_000_000_000
"""The most bytes the first view's pass keeps for the *why* panel (`contribution_lens.analyses.qk_attribution.QKTape`).

Every precomputed window's queries where they fit, else the shown window's, else none (each
split then runs its own pass); set it to 0 to keep nothing. Upper bounds (`QKTape.estimate_bytes`)
for SmolLM2 in float32: 802 MB for all 512 queries of 512 tokens (kept: no click needs a pass);
at 1,024 tokens 2.7 GB for all, 755 MB for a window of 128 (kept)."""
Reporter = Callable[[], "Progress | bool"]
"""What a pass reports its layers to (`contribution_lens.views.inspector.widget.Inspector`'s progress)."""


class WhyCache:
    """One inspector's *why* splits: the recorded tape, the last `WHY_KEPT` heads' splits, every row computed."""

    def __init__(self, subject: Subject) -> None:
        self._subject = subject
        self.tape: QKTape | None = None
        """The tape the last pass recorded (None: none fitted `WHY_TAPE_BYTES`)."""
        self.splits: dict[tuple[int, int, str], QKAttribution] = {}
        self.rows: dict[tuple[int, int, int, str], dict[str, Any]] = {}

    def plan(self, choices: list[list[int]]) -> QKTape | None:
        """The tape to record of the first rows among ``choices`` that fit `WHY_TAPE_BYTES` (None: none fits)."""
        subject = self._subject
        length, last = len(subject.labels), max(subject.layers)
        for rows in choices:
            if QKTape.estimate_bytes(subject.model, length, len(rows), last) <= WHY_TAPE_BYTES:
                return QKTape.plan(subject.model, subject.batch, last, rows)
        return None

    def split(self, layer: int, head: int | None, queries: list[int], shown: Window) -> QKAttribution:
        """The split of ``layer``'s ``head`` (None: all) at ``queries``: from a tape if one fits, else a pass.

        A tape not holding ``queries`` (another window) is recorded again, in a pass of its own,
        for the ``shown`` window and them: one pass, and then no pass for any other head there.
        """
        tape = self.tape
        if tape is None or not tape.covers(layer, queries):
            fresh = self.plan([sorted(set(shown.queries) | set(queries))])
            if fresh is not None:  # else the tape kept still serves the queries it holds
                self.tape = tape = fresh.run()
        if tape is not None and tape.covers(layer, queries):
            return tape.attribution(layer, head, queries)
        return qk_attribution(self._subject.model, self._subject.batch.tokens[0], layer, head, queries)

    def row(self, layer: int, head: int, query: int, window: Window) -> dict[str, Any]:
        """The *why* row of (``layer``, ``head``, ``query``) over ``window``'s keys, computed once (values checked)."""
        key = (layer, head, query, window.key)
        if key not in self.rows:
            self.rows[key] = why_row(self._head_split(layer, head, window), head, query, window.keys)
        return self.rows[key]

    def _head_split(self, layer: int, head: int, window: Window) -> QKAttribution:
        """One head's split for the window's queries, computed once while among the last `WHY_KEPT`."""
        key = (layer, head, window.key)
        split = self.splits.pop(key, None)
        if split is None:
            split = self.split(layer, head, window.queries, window)
        self.splits[key] = split  # last in: the most recently used
        while len(self.splits) > WHY_KEPT:
            del self.splits[next(iter(self.splits))]
        return split

    def page_rows(self, window: Window, layers: list[int], chosen: list[int], shown: Window) -> dict[str, Any]:
        """The *why* rows a page embeds: every head of ``layers`` at each ``chosen`` query, ``window``'s keys."""
        rows = {}
        for layer in layers:
            split = self.split(layer, None, chosen, shown)
            for head in split.heads:
                for query in chosen:
                    rows[row_key(layer, head, query)] = why_row(split, head, query, window.keys)
        return {"queries": chosen, "rows": rows}


class LayerCache:
    """Every layer's payload of the windows one pass cut: the shown window's size only."""

    def __init__(self, subject: Subject, why: WhyCache, progress: Reporter) -> None:
        self._subject, self._why, self._progress = subject, why, progress
        self.computed: dict[str, dict[int, dict[str, Any]]] = {}
        """By window key, each layer's payload."""

    def payload(self, window: Window, layer: int, shown: Window, tokens: int) -> dict[str, Any]:
        """``layer``'s payload of ``window``; where it is not here, one pass around the ``shown`` window of ``tokens``.

        The pass cuts every window of `to_precompute` and records the *why* tape of their
        queries where it fits (else the shown window's): windows of an earlier size are dropped.
        """
        if window.key not in self.computed:
            subject, windows = self._subject, self.to_precompute(shown, tokens)
            every = sorted({query for each in windows for query in each.queries})
            self._why.tape = tape = self._why.plan([every, shown.queries])
            computed = compute_windows(
                subject.model, subject.batch, subject.layers, windows, progress=self._progress(), tape=tape
            )
            self.computed = {w.key: {layer: computed[layer][w.key] for layer in subject.layers} for w in windows}
        return self.computed[window.key][layer]

    def to_precompute(self, shown: Window, tokens: int) -> list[Window]:
        """The shown window first, then the other half-overlapping windows of its size, nearest first, within budget."""
        subject = self._subject
        first = shown.queries[0]
        starts = sorted(set(window_starts(len(subject.labels), tokens)) - {first}, key=lambda s: (abs(s - first), s))
        chosen, budget = [shown], PRECOMPUTE_BYTES
        for start in starts:
            window = subject.window(start, tokens)
            budget -= payload_bytes(window, subject.n_heads, subject.n_kv_heads) * len(subject.layers)
            if budget < 0:
                break
            chosen.append(window)
        return chosen

    def page_payloads(self, window: Window, layers: Sequence[int], compact: bool) -> dict[int, dict[str, Any]]:
        """Each layer's payload of ``window``: those computed already, else from one more pass (not kept)."""
        cached = None if compact else self.computed.get(window.key)
        if cached is not None:
            return {layer: cached[layer] for layer in layers}
        subject = self._subject
        computed = compute_windows(
            subject.model, subject.batch, list(layers), [window], progress=self._progress(), compact=compact
        )
        return {layer: by_window[window.key] for layer, by_window in computed.items()}
