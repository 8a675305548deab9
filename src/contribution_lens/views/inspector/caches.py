"""What an inspector keeps between views: each layer's payloads, what the first pass kept, and the *why* splits.

`LayerCache` holds what the first pass kept of every layer (its queries and keys, not its pattern)
and every layer's payload of the windows computed so far, the shown one's first, then those a
thread computes ahead of the view (the half-overlapping windows of its size, `PRECOMPUTE_BYTES` at
most beyond it): a layer or window switch among them sends what is ready, any other is cut from
the records without a pass. `WhyCache` holds the QK tape that pass recorded
(`contribution_lens.analyses.qk_attribution.QKTape`, `WHY_TAPE_BYTES` at most), the last
`WHY_KEPT` heads' splits and every *why* row computed, so a repeated click costs nothing.
"""

import threading
from collections.abc import Callable, Sequence
from typing import Any

from contribution_lens import adapter
from contribution_lens.analyses.qk_attribution import QKAttribution, QKTape, qk_attribution
from contribution_lens.engine import WHOLE_PATTERN_BYTES, pattern_fits
from contribution_lens.views.inspector.background import Prefetch
from contribution_lens.views.inspector.compute import Records, compute_windows, window_payload_of
from contribution_lens.views.inspector.payload import payload_bytes
from contribution_lens.views.inspector.progress import Progress
from contribution_lens.views.inspector.subject import InspectorError, Subject
from contribution_lens.views.inspector.why import row_key, why_row
from contribution_lens.views.inspector.windows import Window, window_starts

PRECOMPUTE_BYTES = 400_000_000
"""The most payload bytes computed ahead of the view beyond the window shown (other windows of the same size)."""
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
        subject, tape = self._subject, self.tape
        if not pattern_fits(subject.model, subject.batch):
            raise InspectorError(
                f"the why panel splits the scores the model computes, which at {len(subject.labels):,} tokens "
                f"it cannot hold (one layer's pattern would pass {WHOLE_PATTERN_BYTES / 1e9:.1f} GB): "
                "inspect a shorter text"
            )
        if tape is None or not tape.covers(layer, queries):
            fresh = self.plan([sorted(set(shown.queries) | set(queries))])
            if fresh is not None:  # else the tape kept still serves the queries it holds
                self.tape = tape = fresh.run()
        if tape is not None and tape.covers(layer, queries):
            return tape.attribution(layer, head, queries)
        return qk_attribution(subject.model, subject.batch.tokens[0], layer, head, queries)

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
    """Every layer's payload of the windows computed so far, and what the first pass kept to compute the rest.

    The first pass (`first_pass`) decomposes the layer it is asked for and keeps every layer's inputs
    without its pattern (`records`: the queries and keys instead, `compute.keep`); any other layer
    or window is then cut from them, with no pass (`payload`), by the view when it asks or ahead of
    it by a `background.Prefetch` (`prefetch`). A model whose layers cannot be read as queries and
    keys (`contribution_lens.adapter.tiles_problem`) keeps no records: its pass decomposes every
    layer and cuts every window of `to_precompute` at once, and a window of another size runs
    another pass. A text whose layers' patterns would not fit (`contribution_lens.engine.pattern_fits`)
    runs its pass in tiles (no pattern is ever held); the *why* panel then keeps no tape.
    """

    def __init__(self, subject: Subject, why: WhyCache, progress: Reporter) -> None:
        self._subject, self._why, self._progress = subject, why, progress
        self.computed: dict[str, dict[int, dict[str, Any]]] = {}
        """By window key, each layer's payload."""
        self.records: Records = {}
        """What the first pass kept of each layer (empty before it, and for a model that keeps nothing)."""
        self.lock = threading.RLock()
        """Held while a payload is computed: by the view's thread or the prefetching one, one at a time."""
        self.prefetching: Prefetch | None = None

    @property
    def qk(self) -> str | None:
        """How the first pass reads the layers' queries and keys: ``"record"``, ``"tiles"``, or None (not at all)."""
        subject = self._subject
        if adapter.tiles_problem(subject.model) is not None:
            return None
        return "record" if pattern_fits(subject.model, subject.batch) else "tiles"

    def ready(self, window: Window, layer: int) -> bool:
        """Whether ``layer``'s payload of ``window`` is here (a switch to it only sends it)."""
        return layer in self.computed.get(window.key, {})

    def payload(self, window: Window, layer: int, shown: Window, tokens: int) -> dict[str, Any]:
        """``layer``'s payload of ``window``: kept, else cut from the records, else from the first pass."""
        with self.lock:
            found = self.computed.get(window.key, {}).get(layer)
            if found is None:
                if layer in self.records:
                    found = window_payload_of(self.records[layer], window)
                    self.computed.setdefault(window.key, {})[layer] = found
                else:
                    self.first_pass(window, layer, shown, tokens)
                    found = self.computed[window.key][layer]
            return found

    def first_pass(self, window: Window, layer: int, shown: Window, tokens: int) -> None:
        """The one pass: ``layer``'s payload of ``window`` and every layer's record (or every window, keeping none).

        It records the *why* tape of the precomputed windows' queries where it fits (else the shown
        window's). Without records, windows of an earlier size are dropped.
        """
        subject, windows, mode = self._subject, self.to_precompute(shown, tokens), self.qk
        every = sorted({query for each in windows for query in each.queries})
        self._why.tape = tape = None if mode == "tiles" else self._why.plan([every, shown.queries])
        if mode is None:
            computed = compute_windows(
                subject.model, subject.batch, subject.layers, windows, progress=self._progress(), tape=tape
            )
            self.computed = {w.key: {layer: computed[layer][w.key] for layer in subject.layers} for w in windows}
            return
        records: Records = {}
        computed = compute_windows(
            subject.model, subject.batch, subject.layers, [window], progress=self._progress(), tape=tape,
            records=records, shown=layer, qk=mode,
        )  # fmt: skip
        self.records = records
        self.computed.setdefault(window.key, {})[layer] = computed[layer][window.key]

    def prefetch(self, shown: Window, layer: int, tokens: int) -> None:
        """Compute in a thread the shown window's other layers (nearest ``layer`` first), then its size's other windows.

        The thread of an earlier view is stopped; nothing happens before the first pass or without records.
        """
        if self.prefetching is not None:
            self.prefetching.stop()
        if not self.records:
            return
        layers = sorted(self._subject.layers, key=lambda other: (abs(other - layer), other))
        items = [(window, other) for window in self.to_precompute(shown, tokens) for other in layers]
        todo = [item for item in items if not self.ready(*item)]
        self.prefetching = Prefetch(lambda item: self.payload(item[0], item[1], shown, tokens), todo).start()

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
        """Each layer's payload of ``window``: kept, or cut from the records, else from one more pass (not kept)."""
        if self.records and all(layer in self.records for layer in layers):
            with self.lock:
                if compact:
                    return {layer: window_payload_of(self.records[layer], window, compact=True) for layer in layers}
                return {layer: self.payload(window, layer, window, len(window.queries)) for layer in layers}
        cached = None if compact else self.computed.get(window.key)
        if cached is not None and all(layer in cached for layer in layers):
            return {layer: cached[layer] for layer in layers}
        subject = self._subject
        computed = compute_windows(
            subject.model, subject.batch, list(layers), [window], progress=self._progress(), compact=compact,
            qk=None if pattern_fits(subject.model, subject.batch) else "tiles",
        )  # fmt: skip
        return {layer: by_window[window.key] for layer, by_window in computed.items()}
