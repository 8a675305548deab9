"""What an inspector writes besides its live view: the view as a figure or an image, and the static page.

`Export` draws a view state (`contribution_lens.views.inspector.state.NAMES`' values) from the
payloads an inspector holds (`contribution_lens.views.inspector.caches.LayerCache`): the figure
of its still and of ``save_image``, the selected query's bars, and the page of ``write_html``
(every requested layer, opened on that view, with the panels' data it was asked to carry:
`contribution_lens.views.inspector.panel.page_data`).
"""

import inspect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from contribution_lens import adapter
from contribution_lens.views.inspector import figure, page, panel
from contribution_lens.views.inspector.caches import LayerCache, WhyCache
from contribution_lens.views.inspector.payload import meta, payload_bytes
from contribution_lens.views.inspector.state import LINKED
from contribution_lens.views.inspector.subject import InspectorError, Subject

if TYPE_CHECKING:
    import plotly.graph_objects as go

COMPACT_ABOVE_BYTES = 20_000_000
"""A page whose fine payloads would pass this many bytes is written in the compact codec (`write_html`)."""


def settings_of(function: Callable[..., Any], state: dict[str, Any]) -> dict[str, Any]:
    """The settings of ``state`` that ``function`` takes as keywords (a figure takes the ones it draws).

    Example:
        >>> settings_of(figure.view_caption, {"layer": 3, "head": 1, "scope": "inter", "hide_sink": True})
        {'layer': 3, 'head': 1, 'hide_sink': True}
    """
    return {name: state[name] for name in inspect.signature(function).parameters if name in state}


def opening_view(state: dict[str, Any], *, head: int | str, query: int) -> dict[str, Any]:
    """The view a front-end opens on (``meta.initial``): the settings a page's link names, with head and query."""
    return {**{name: state[name] for name in LINKED}, "head": head, "query": query}


class Export:
    """The figures and the page of one inspector's subject, from the payloads and the QK splits it keeps."""

    def __init__(self, subject: Subject, layers: LayerCache, splits: WhyCache) -> None:
        self._subject, self._layers, self._splits = subject, layers, splits

    def _payload(self, state: dict[str, Any]) -> dict[str, Any]:
        """The payload of the state's layer and window: already here, the figure needs no forward pass."""
        window = self._subject.window(state["start"], state["tokens"])
        return self._layers.payload(window, state["layer"], window, state["tokens"])

    def view_figure(self, state: dict[str, Any]) -> "go.Figure":
        """The view ``state`` as a figure: the heatmap with its query outlined, or the prediction view's heads."""
        steps = self._subject.steps
        if state["view"] == "prediction" and steps is not None:
            step = max(0, state["step"])
            return figure.prediction_figure(steps.results[step], step)
        window = self._subject.window(state["start"], state["tokens"])
        shown = settings_of(figure.inspector_figure, state)
        return figure.inspector_figure(self._payload(state), window, self._subject.labels, **shown)

    def bars_figure(self, state: dict[str, Any]) -> "go.Figure":
        """The selected query's bars of ``state``, with their caption."""
        window = self._subject.window(state["start"], state["tokens"])
        shown = settings_of(figure.bars_figure, state)
        return figure.bars_figure(self._payload(state), window, self._subject.labels, **shown)

    def render_html(
        self,
        state: dict[str, Any],
        steps: dict[str, Any] | None,
        *,
        layers: Sequence[int] | None,
        start: int | None,
        tokens: int | None,
        compact: bool | None,
        panels: dict[str, tuple[str, Sequence[int]]],
        circuit: dict[str, Any] | None = None,
    ) -> str:
        """The self-contained page opened on ``state`` (``inspector.write_html``'s arguments; see there).

        ``panels``: by panel name, the argument that named its queries (for messages) and the queries.
        """
        subject = self._subject
        wanted = subject.layers if layers is None else adapter.check_layers(subject.model, layers)
        window = subject.window(
            state["start"] if start is None else start, state["tokens"] if tokens is None else tokens
        )
        if compact is None:
            fine = payload_bytes(window, subject.n_heads, subject.n_kv_heads) * len(wanted)
            compact = fine > COMPACT_ABOVE_BYTES
        chosen = self._panel_queries(window, panels)
        payloads = self._layers.page_payloads(window, wanted, compact)
        # The page opens on the window's last query, whatever the widget's query, or on the explained step's position.
        query = window.queries[-1]
        if subject.steps is not None and subject.steps.positions[max(0, state["step"])] in window.queries:
            query = subject.steps.positions[max(0, state["step"])]
        initial = opening_view(state, head="all" if state["head"] < 0 else state["head"], query=query)
        initial["layer"] = state["layer"] if state["layer"] in wanted else wanted[-1]
        groups = next(iter(payloads.values()))["kv_groups"]
        about = meta(subject.labels, window, wanted, subject.n_heads, initial, kv_groups=groups, compact=compact)
        shown = subject.window(state["start"], state["tokens"])
        source = panel.PanelSource(subject, window, shown, self._splits)
        carried = panel.page_data(source, list(wanted), chosen)
        return page.render(about, payloads, steps=steps, panels=carried, circuit=circuit)

    def _panel_queries(self, window: Any, panels: dict[str, tuple[str, Sequence[int]]]) -> dict[str, list[int]]:
        """Each named panel's queries checked (before any pass): positions (negative from the end) of the window's."""
        chosen = {}
        for name, (label, queries) in panels.items():
            if name not in panel.PANELS:
                raise InspectorError(f"{label}: {panel.PANELS.unknown(name)}")
            chosen[name] = panel.checked_queries(label, queries, len(self._subject.labels), window)
        return chosen
