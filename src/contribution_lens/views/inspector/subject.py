"""What an inspector looks at, and the values it accepts: every check of the inspector, in one place.

A `Subject` is the model, one text (its tokens and labels), the layers offered and, for
explained predictions, the steps; it is built once, by `Subject.of`, which checks the text and
the layers. `Subject.refusal` says why a value of a setting (each of
`contribution_lens.views.inspector.state.CHECKED`) cannot be shown, and `Subject.opening` checks
the first view and places its token window, before the model runs.
"""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import traitlets
from torch import Tensor

from contribution_lens import adapter
from contribution_lens.analyses.generation import GenerationExplanation
from contribution_lens.analyses.logit_attribution import LogitAttribution
from contribution_lens.choices import FACTORS, SCOPES
from contribution_lens.views.inspector.state import ARGUMENTS, CHECKED, VIEWS
from contribution_lens.views.inspector.steps import Steps
from contribution_lens.views.inspector.windows import Window, token_label, token_window, window_start

Explained = GenerationExplanation | LogitAttribution | Sequence[LogitAttribution]
"""Explained predictions of one text, which the inspector shows with a step control and the prediction view."""


class InspectorError(traitlets.TraitError, ValueError):
    """A value the inspector refuses; its message is also in the widget's ``error`` trait."""


@dataclass(frozen=True, eq=False)
class Subject:
    """The model, one text, the layers offered and the explained steps (or None) of one inspector.

    ``labels[i]`` is token ``i`` as the page writes it (`token_label`); ``n_kv_heads`` is the
    model's value heads (for memory estimates: each payload names its own KV groups).
    """

    model: adapter.Model
    batch: adapter.TokenBatch
    labels: list[str]
    layers: list[int]
    steps: Steps | None
    n_heads: int
    n_kv_heads: int
    causal: bool

    @classmethod
    def of(
        cls,
        model: adapter.Model,
        text: str | Tensor | Explained,
        layers: Sequence[int] | None = None,
        prepend_bos: bool | None = None,
    ) -> "Subject":
        """Check ``text`` (one text, or explained predictions this model made) and ``layers`` (default: all).

        ``prepend_bos``: BOS before a text (None: the model's own choice, ``cfg.default_prepend_bos``).
        """
        steps = Steps.of(text)
        batch = adapter.to_token_batch(model, text if steps is None else steps.tokens, prepend_bos=prepend_bos)  # type: ignore[arg-type]
        if batch.tokens.shape[0] != 1:
            raise ValueError("inspect takes one text")
        offered = adapter.check_layers(model, layers)
        labels = [token_label(i, t) for i, t in enumerate(batch.str_tokens[0])]
        if steps is not None:
            steps.check_model(model, labels)
        facts = adapter.anatomy_of(model)
        return cls(model, batch, labels, offered, steps, facts.n_heads, facts.n_kv_heads, facts.causal)

    def window(self, start: int, tokens: int) -> Window:
        """The token window of ``tokens`` queries from ``start`` (`token_window`)."""
        return token_window(len(self.labels), start=start, tokens=tokens, causal=self.causal)

    def refusal(self, name: str, value: Any, window: Window | None = None) -> str:
        """Why setting ``name`` cannot take ``value`` ("" when it can); ``query`` is checked against ``window``.

        Example:
            >>> import contribution_lens as cl
            >>> subject = Subject.of(cl.load_model(), "The cat sat.", layers=[0, 1])
            >>> subject.refusal("layer", 5), subject.refusal("head", 2)
            ('layer 5 is not among the inspected layers [0, 1]', '')
        """
        return RULES[name](self, value, window)

    def check(self, name: str, value: Any, window: Window | None = None) -> None:
        """Raise `InspectorError` with the `refusal` of ``name = value``, if any."""
        message = self.refusal(name, value, window)
        if message:
            raise InspectorError(message)

    def opening(self, chosen: Mapping[str, Any]) -> dict[str, Any]:
        """The first view's settings from `inspect`'s arguments ``chosen``, checked (`InspectorError`) before any pass.

        What ``chosen`` leaves out takes `contribution_lens.views.inspector.state.ARGUMENTS`; a
        `CHOSEN` one is picked here: ``layer`` the last offered, ``head`` all heads (-1), ``view``
        ``prediction`` with explained steps (else ``heatmap``), ``step`` 0 with steps. The window
        starts at ``start`` (default 0); with steps, where it does not hold the step's position,
        at the first menu window that does (`window_start`), and the query is that position; else
        the window's last query.
        """
        given = {**ARGUMENTS, **chosen}
        step = given["step"]
        if self.steps is None and step is not None:
            raise InspectorError(
                f"step={step} needs explained predictions: "
                "inspect cl.explain_generation(...) or cl.logit_attribution(...)"
            )
        shown = {
            **given,
            "step": -1 if self.steps is None else 0 if step is None else step,
            "view": given["view"] or ("heatmap" if self.steps is None else "prediction"),
            "layer": self.layers[-1] if given["layer"] is None else given["layer"],
            "head": -1 if given["head"] is None else given["head"],
            "start": 0 if given["start"] is None else given["start"],
        }
        for name in CHECKED:
            if name != "query":  # placed below, in the checked window
                self.check(name, shown[name])
        first, tokens = shown["start"], shown["tokens"]
        shown["query"] = self.window(first, tokens).queries[-1]
        if self.steps is not None:
            shown["query"] = self.steps.positions[shown["step"]]
            if shown["query"] not in self.window(first, tokens).queries:
                shown["start"] = window_start(len(self.labels), shown["query"], tokens)
        return shown


def _layer(subject: Subject, value: int, window: Window | None) -> str:
    return "" if value in subject.layers else f"layer {value} is not among the inspected layers {subject.layers}"


def _head(subject: Subject, value: int, window: Window | None) -> str:
    n = subject.n_heads
    return "" if -1 <= value < n else f"head {value} does not exist: -1 (all heads) or 0..{n - 1}"


def _factor(subject: Subject, value: str, window: Window | None) -> str:
    return "" if value in FACTORS else f"unknown factor {value!r}; expected one of {FACTORS}"


def _scope(subject: Subject, value: str, window: Window | None) -> str:
    return "" if value in SCOPES else f"unknown scope {value!r}; expected one of {SCOPES}"


def _start(subject: Subject, value: int, window: Window | None) -> str:
    n = len(subject.labels)
    return "" if 0 <= value < n else f"start {value} is outside the text of {n} tokens (0..{n - 1})"


def _tokens(subject: Subject, value: int, window: Window | None) -> str:
    return "" if value >= 1 else f"tokens must be a positive integer, got {value}"


def _view(subject: Subject, value: str, window: Window | None) -> str:
    if value not in VIEWS:
        return f"unknown view {value!r}; expected one of {VIEWS}"
    if value == "prediction" and subject.steps is None:
        return (
            "the prediction view needs explained predictions: inspect cl.explain_generation(...) "
            "or cl.logit_attribution(...) instead of a text"
        )
    return ""


def _step(subject: Subject, value: int, window: Window | None) -> str:
    if subject.steps is None:
        if value == -1:
            return ""
        return f"step {value}: this inspector has no explained predictions (inspect cl.explain_generation(...))"
    n = len(subject.steps.results)
    return "" if 0 <= value < n else f"step {value} does not exist: the inspector explains steps 0..{n - 1}"


def _query(subject: Subject, value: int, window: Window | None) -> str:
    if window is None or value in window.queries:
        return ""
    queries = window.queries
    return f"query {value} is not in the token window {queries[0]}..{queries[-1]}: set start first"


RULES: dict[str, Callable[[Subject, Any, Window | None], str]] = {
    "layer": _layer,
    "head": _head,
    "factor": _factor,
    "scope": _scope,
    "start": _start,
    "tokens": _tokens,
    "view": _view,
    "step": _step,
    "query": _query,
}
"""Each checked setting and its rule: the reason a value is refused, or ""."""
