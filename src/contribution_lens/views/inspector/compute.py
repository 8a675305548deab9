"""The inspector's forward pass, and each layer's payload of a token window from what a pass kept.

`window_payload_of` cuts one layer's payload of one window from that layer's `LayerInputs`: from
the decomposition of the whole layer where the pass holds its pattern and several windows are
cut, else from the decomposition of the window's queries alone (a tile of rows,
`contribution_lens.adapter.LayerInputs.decompose_rows`). `compute_windows` runs the one forward
pass (`contribution_lens.map_layers`): it computes the payloads it is asked for in the pass and,
with ``records``, keeps every layer's inputs without its pattern (its queries and keys instead,
`contribution_lens.adapter.attention_forms`), from which any other layer and window is computed
later, without a pass (`contribution_lens.views.inspector.caches.LayerCache`).
"""

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from tqdm.auto import tqdm

from contribution_lens import adapter
from contribution_lens.analyses.qk_attribution import QKTape
from contribution_lens.engine import map_layers
from contribution_lens.tiles import Tile
from contribution_lens.views.inspector.compact import compact_payload, unit_factors
from contribution_lens.views.inspector.payload import window_arrays, window_payload
from contribution_lens.views.inspector.windows import Window

Records = dict[int, adapter.LayerInputs]
"""What a pass kept of each layer to decompose it later: its inputs, the pattern left out (`keep`)."""


def keep(inputs: adapter.LayerInputs) -> adapter.LayerInputs:
    """``inputs`` without its pattern (a shape on the meta device), its captured hooks or anything computed.

    What stays per layer: the queries and keys (``qk``), ``v``, ``z`` and the o-projection's output,
    all ``O(positions)``: the pattern is recomputed from the queries and keys a tile at a time.
    """
    if inputs.qk is None:
        raise ValueError(f"layer {inputs.layer} kept no queries and keys: its pattern could not be rebuilt")
    meta = torch.empty(inputs.pattern.shape, device="meta", dtype=inputs.pattern.dtype)
    return replace(inputs, pattern=meta, captured={}, _cache={})


def window_payload_of(inputs: adapter.LayerInputs, window: Window, *, compact: bool = False) -> dict[str, Any]:
    """One layer's payload of ``window`` (fine codecs, or with ``compact`` `compact_payload`).

    Where ``inputs`` holds the pattern, the layer's own decompositions (computed once, shared by
    every window cut from them); else the decompositions of the window's queries, over the keys
    they see (`Tile`), from the pattern's rows recomputed from the queries and keys.
    """
    n_kv_heads = inputs.v.shape[2]
    if inputs.whole:
        inter, intra, first = inputs.decompose("inter"), inputs.decompose("intra"), None
    else:
        first, n_key = window.queries[0], inputs.pattern.shape[-1]
        tile = Tile(first, window.queries[-1] + 1, window.queries[-1] + 1 if inputs.causal else n_key)
        rows = inputs.pattern_rows(tile)
        inter, intra = (inputs.decompose_rows(scope, tile, pattern=rows) for scope in ("inter", "intra"))
    arrays = window_arrays(inter, intra, window, first_query=first, n_kv_heads=n_kv_heads)
    return compact_payload(arrays, unit_factors(inputs), window) if compact else window_payload(arrays, window)


def compute_windows(
    model: adapter.Model,
    batch: adapter.TokenBatch,
    layers: Sequence[int],
    windows: Sequence[Window],
    *,
    progress: bool | Callable[[int, int], None] = False,
    compact: bool = False,
    tape: QKTape | None = None,
    records: Records | None = None,
    shown: int | None = None,
    qk: str | None = None,
) -> dict[int, dict[str, dict[str, Any]]]:
    """The payload of every layer of ``layers`` (only ``shown`` where given) for every window, from one forward pass.

    Each payload is `window_payload_of` the layer's inputs in the pass. With ``records`` (a dict to
    fill) the pass reads every layer's queries and keys (``qk``: ``"record"``, or ``"tiles"`` for a
    pass that holds no pattern, `contribution_lens.map_layers`) and keeps each layer's inputs
    there (`keep`); only layer ``shown``'s payloads are then computed in the pass. A ``tape``
    (`contribution_lens.analyses.qk_attribution.QKTape`) records, in the same pass, what the
    *why* panel's splits read: the pass then runs every layer up to ``tape.last``. ``progress``:
    a text bar (tqdm) when True, or a callable given (layers done, layers in the pass) before the
    first layer and after each (the live inspector's: `contribution_lens.views.inspector.widget`).

    Example:
        >>> import contribution_lens as cl
        >>> from contribution_lens.views.inspector.windows import token_window
        >>> model = cl.load_model()
        >>> batch = cl.to_token_batch(model, "The cat sat.")
        >>> payloads = compute_windows(model, batch, [0, 2], [token_window(batch.tokens.shape[1])])
        >>> sorted(payloads), list(payloads[2])
        ([0, 2], ['0-4'])
    """
    wanted = list(layers) if shown is None else [shown]
    passed = sorted(set(layers) | set(wanted) | (set() if tape is None else set(range(tape.last + 1))))
    if records is not None and qk is None:
        raise ValueError("records need the layers' queries and keys: qk='record' or 'tiles'")
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
        if records is not None and inputs.layer in layers:
            records[inputs.layer] = keep(inputs)
        out = None
        if inputs.layer in wanted:
            out = {window.key: window_payload_of(inputs, window, compact=compact) for window in windows}
        done += 1
        if bar is not None:
            bar.update()
        if report is not None:
            report(done, len(passed))
        return out

    capture, hooks = ((), []) if tape is None else (tape.capture, tape.hooks)
    try:
        results = map_layers(model, batch, per_layer, layers=passed, capture=capture, extra_hooks=hooks, qk=qk)
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
