"""The inspector's one forward pass: every layer decomposed once, every window cut from it.

`compute_windows` runs the per-layer engine (`contribution_lens.map_layers`) once over the whole
text; each layer's numbers are coded once (`contribution_lens.views.inspector.payload.layer_arrays`)
and each token window is a cut of them, in the fine codecs or, for large static pages, the
compact one (`contribution_lens.views.inspector.compact.compact_payload`).
"""

from collections.abc import Callable, Sequence
from typing import Any

from tqdm.auto import tqdm

from contribution_lens import adapter
from contribution_lens.analyses.qk_attribution import QKTape
from contribution_lens.engine import map_layers
from contribution_lens.views.inspector.compact import compact_payload, unit_factors
from contribution_lens.views.inspector.payload import layer_arrays, window_payload
from contribution_lens.views.inspector.windows import Window


def compute_windows(
    model: adapter.Model,
    batch: adapter.TokenBatch,
    layers: Sequence[int],
    windows: Sequence[Window],
    *,
    progress: bool | Callable[[int, int], None] = False,
    compact: bool = False,
    tape: QKTape | None = None,
) -> dict[int, dict[str, dict[str, Any]]]:
    """The payload of every layer for every window (by `Window.key`), all from one forward pass.

    Each layer is decomposed once, over the whole text; each window is then a cut of it, in
    the fine codecs (`contribution_lens.views.inspector.payload.window_payload`) or, with
    ``compact``, those of `contribution_lens.views.inspector.compact.compact_payload`. A ``tape``
    (`contribution_lens.analyses.qk_attribution.QKTape`) records, in the same pass, what the *why*
    panel's splits read: the pass then runs every layer up to ``tape.last``. ``progress``: a text
    bar (tqdm) when True, or a callable given (layers done, layers in the pass) before the first
    layer and after each (the live inspector's: `contribution_lens.views.inspector.widget`).

    Example:
        >>> import contribution_lens as cl
        >>> from contribution_lens.views.inspector.windows import token_window
        >>> model = cl.load_model()
        >>> batch = cl.to_token_batch(model, "The cat sat.")
        >>> payloads = compute_windows(model, batch, [0, 2], [token_window(batch.tokens.shape[1])])
        >>> sorted(payloads), list(payloads[2])
        ([0, 2], ['0-4'])
    """
    wanted = list(layers)
    passed = wanted if tape is None else sorted(set(wanted) | set(range(tape.last + 1)))
    report = progress if callable(progress) else None
    # leave=True: a closed bar shows its last frame, so a saved notebook does not keep its first one (0%).
    bar = tqdm(total=len(passed), desc="inspector: layers", unit="layer", leave=True) if progress is True else None
    done = 0
    if report is not None:
        report(0, len(passed))

    def per_layer(inputs: adapter.LayerInputs) -> dict[str, dict[str, Any]] | None:
        nonlocal done
        if tape is not None:
            tape.record(inputs)
        out = None
        if inputs.layer in wanted:
            arrays = layer_arrays(inputs.decompose("inter"), inputs.decompose("intra"), n_kv_heads=inputs.v.shape[2])
            if compact:
                factors = unit_factors(inputs)
                out = {w.key: compact_payload(arrays, factors, w) for w in windows}
            else:
                out = {window.key: window_payload(arrays, window) for window in windows}
        done += 1
        if bar is not None:
            bar.update()
        if report is not None:
            report(done, len(passed))
        return out

    capture, hooks = ((), []) if tape is None else (tape.capture, tape.hooks)
    try:
        results = map_layers(model, batch, per_layer, layers=passed, capture=capture, extra_hooks=hooks)
    finally:
        if bar is not None:
            bar.close()
        if report is not None and done < len(passed):
            report(len(passed), len(passed))  # a pass that failed or stopped early: its progress goes too
    return {layer: out for layer, out in results.items() if out is not None}


def compute_payloads(
    model: adapter.Model, batch: adapter.TokenBatch, layers: Sequence[int], window: Window
) -> dict[int, dict[str, Any]]:
    """`layer_payload` of each layer for one window, on the per-layer engine (the pass stops after the last)."""
    return {
        layer: by_window[window.key] for layer, by_window in compute_windows(model, batch, layers, [window]).items()
    }
