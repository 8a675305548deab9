"""Each layer's `contribution_lens.adapter.attention.AttentionForm`, learned on a probe pass and checked there.

Run on a probe of `PROBE_LENGTH` tokens, once a model: a pass in tiles hands each layer's scale,
soft-cap, sliding window and causality to the attention function (`attention_forms` reads them
there), then the ordinary pass checks that the queries and keys it records make its own pattern
and that the tiled pass's heads' outputs are its own. A model that fails gets no forms, and
`tiles_problem` says why.
"""

import weakref
from typing import Any

import torch
from torch import Tensor

from contribution_lens.adapter._model import Model, model_dtype
from contribution_lens.adapter.anatomy import QK_K, QK_Q, ROTATED_K, ROTATED_Q, anatomy_of, block_hook
from contribution_lens.adapter.attention import AttentionForm
from contribution_lens.adapter.hooks import (
    PROBE_LENGTH,
    LayerInputs,
    StopForward,
    _relative_error,
    forward,
    is_causal_model,
    layer_hooks,
    n_layers,
)
from contribution_lens.adapter.tokens import TokenBatch, to_token_batch
from contribution_lens.tiles import QueryKeys, Tile

_FORMS: "weakref.WeakKeyDictionary[Any, dict[int, AttentionForm] | str]" = weakref.WeakKeyDictionary()


def attention_forms(model: Model) -> dict[int, AttentionForm]:
    """Each layer's `AttentionForm`, learned and checked on a probe the first time, then remembered for the model.

    Raises ``ValueError`` saying why where the model has none (`tiles_problem`).
    """
    found = _FORMS.get(model)
    if found is None:
        try:
            found = _probe_forms(model)
        except Exception as error:  # the tiled probe itself fails: say how, in one line
            message = str(error).strip().splitlines()[0] if str(error).strip() else ""
            found = f"its tiled pass fails on a probe ({type(error).__name__}: {message[:200]})"
        _FORMS[model] = found
    if isinstance(found, str):
        raise ValueError(f"{type(model).__name__} cannot read its attention in tiles: {found}")
    return found


def tiles_problem(model: Model) -> str | None:
    """Why ``model``'s layers cannot be read as queries and keys (`attention_forms`); None where they can."""
    try:
        attention_forms(model)
    except ValueError as error:
        return str(error)
    return None


def _probe_forms(model: Model) -> dict[int, AttentionForm] | str:
    """`attention_forms` without its cache: a tiled probe pass, then the ordinary one to check it against."""
    total = n_layers(model)
    d_vocab = anatomy_of(model).d_vocab or PROBE_LENGTH + 1
    batch = to_token_batch(model, (torch.arange(PROBE_LENGTH) + 1) % d_vocab)
    received: dict[int, QueryKeys] = {}
    tiled_z: dict[int, Tensor | None] = {}
    with layer_hooks(model, batch, list(range(total)), lambda layer: tiled_z.__setitem__(layer.layer, layer.z),
                     qk="tiles", receive=received.__setitem__, stop_after_last=True):  # fmt: skip
        try:
            forward(model, batch)
        except StopForward:
            pass
    missing = [layer for layer in range(total) if layer not in received]
    if missing:
        return f"the attention of layers {missing} does not go through transformers' attention functions"
    names = anatomy_of(model).hook_names
    forms = {}
    for layer, qk in received.items():
        rotated = block_hook(layer, ROTATED_Q) in names and block_hook(layer, ROTATED_K) in names
        q_hook, k_hook = (ROTATED_Q, ROTATED_K) if rotated else (QK_Q, QK_K)
        forms[layer] = AttentionForm(qk.scale, qk.softcap, qk.window, qk.causal, q_hook, k_hook)
    problem = _check_forms(model, batch, forms, tiled_z)
    return forms if problem is None else problem


def _check_forms(
    model: Model, batch: TokenBatch, forms: dict[int, AttentionForm], tiled_z: dict[int, Tensor | None]
) -> str | None:
    """Whether the ordinary pass's pattern is what its recorded queries and keys make, and its ``z`` the tiled one's."""
    tolerance = 3e-2 if model_dtype(model) in (torch.float16, torch.bfloat16) else 1e-4
    problems: dict[int, str] = {}

    def check(layer: LayerInputs) -> None:
        form = forms[layer.layer]
        if form.causal != is_causal_model(model):
            problems[layer.layer] = f"its attention is {'causal' if form.causal else 'bidirectional'}, its config not"
        elif layer.qk is None or layer.qk.shape != tuple(layer.pattern.shape):
            problems[layer.layer] = f"its {form.q_hook} and {form.k_hook} do not make its pattern's shape"
        elif (error := _relative_error(layer.qk.pattern(Tile(0, *layer.pattern.shape[2:])), layer.pattern)) > tolerance:
            problems[layer.layer] = f"its pattern rebuilt from {form.q_hook} and {form.k_hook} is {error:.2g} off"
        elif (
            (tiled := tiled_z[layer.layer]) is not None
            and layer.z is not None
            and (error := _relative_error(tiled, layer.z)) > tolerance
        ):
            problems[layer.layer] = f"its heads' outputs in tiles are {error:.2g} off"

    with layer_hooks(model, batch, sorted(forms), check, qk="record", forms=forms, stop_after_last=True):
        try:
            forward(model, batch)
        except StopForward:
            pass
    if problems:
        layer = min(problems)
        return f"on a probe input, layer {layer}: {problems[layer]}"
    return None
