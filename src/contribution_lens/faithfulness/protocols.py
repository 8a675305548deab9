"""Removal protocols: where a condition removes keys, and how (registered by name, like methods).

* ``every_layer`` -- at every scored layer ``l``, the keys ranked by layer ``l``'s scores lose
  their projected value: ``alpha_ij^h`` is zeroed for all heads *without renormalising*, so
  ``o_i`` becomes ``o_i - sum_h alpha_ij^h vt_j^h`` (`contribution_lens.interventions`).
* ``one_layer`` -- the same removal at one scored layer at a time, the others untouched; a
  text's result is the mean over the scored layers. TransformerBridge's ``start_at_layer``
  still executes the blocks below the start (it only swaps the residual in), so each masked
  pass runs the whole model: this protocol costs one pass per scored layer and condition.
* ``input_deletion`` -- the token-level score averaged over the scored layers,
  ``s_ij = (1/|L|) sum_l sum_h s_ij^{h,l}``, ranks the keys of each query once; the chosen keys
  are deleted from that query's view at *every* layer: their attention weights are zeroed and
  the softmax renormalised over the remaining keys, ``alpha'_ij = alpha_ij k_ij / sum_j'
  alpha_ij' k_ij'``, which is exactly what removing those tokens from the input means for
  query ``i`` (position encodings of the remaining tokens are kept).

* ``prediction`` -- one prediction per text, the last: position ``e = n - 2`` predicting token
  ``n - 1``. Its input tokens ``j < e`` are ranked once by the method's scores at ``e`` in the last
  scored layer (for the rollouts ``flow``, ``attention_rollout``, ``alti_rollout``: the share of
  each input token in ``e``'s residual stream after that layer); the chosen tokens are deleted from
  *every* query's view at every layer (softmax renormalised, as ``input_deletion``, each position
  keeping itself), which is removing them from the input with the positions of the others kept.
  The loss is the target's negative log-probability alone. Sufficiency at ratio ``r`` keeps the
  top ``1 - r`` of the tokens.

A new protocol subclasses `RemovalProtocol` (``name``, ``description``, `keep`) and is added with
`register_protocol` (`contribution_lens.faithfulness.registry`); the run, the CLI's ``--protocol`` and the
reports then take it by name.
"""

from collections.abc import Sequence

import torch
from torch import Tensor

from contribution_lens import adapter
from contribution_lens.faithfulness.registry import PROTOCOLS, describe, register_protocol  # noqa: F401  (read here before)
from contribution_lens.faithfulness.removal import CleanRun, Condition, RemovalProtocol, removal_keep_mask


class EveryLayer(RemovalProtocol):
    name, description = "every_layer", "masking at every layer"

    def keep(self, clean: CleanRun, condition: Condition, layer: int) -> Tensor | None:
        if condition.ratio == 0:
            return None
        return self._ranked(clean, condition, clean[layer].scores[condition.method], layer)


class OneLayer(RemovalProtocol):
    name, description = "one_layer", "masking at one layer at a time"

    def variants(self, layers: Sequence[int]) -> list[int | None]:
        return list(layers)

    def keep(self, clean: CleanRun, condition: Condition, layer: int) -> Tensor | None:
        if condition.ratio == 0 or condition.layer != layer:
            return None
        return self._ranked(clean, condition, clean[layer].scores[condition.method], layer)


class InputDeletion(RemovalProtocol):
    name, description, renormalise = "input_deletion", "input-token deletion", True

    def hooked_layers(self, clean: CleanRun) -> list[int]:
        return list(range(clean.n_layers))

    def keep(self, clean: CleanRun, condition: Condition, layer: int) -> Tensor | None:
        if condition.ratio == 0:
            return None
        if condition not in clean.cache:
            mean_key = ("mean", condition.method)
            if mean_key not in clean.cache:
                per_layer = [clean[scored].scores[condition.method] for scored in clean.layers]
                clean.cache[mean_key] = torch.stack(per_layer).mean(0)
            clean.cache[condition] = self._ranked(clean, condition, clean.cache[mean_key], "mean")
        return clean.cache[condition]


def explained_positions(valid: Tensor) -> Tensor:
    """``n - 2`` per text (``valid``: ``[batch query key]``): the query predicting the last real token."""
    return valid.any(-1).sum(-1) - 2


class Prediction(RemovalProtocol):
    name, description, renormalise, text_only = "prediction", "deleting a prediction's input tokens", True, True

    def hooked_layers(self, clean: CleanRun) -> list[int]:
        return list(range(clean.n_layers))

    def loss_mask(self, batch: adapter.TokenBatch) -> Tensor:
        explained = batch.attention_mask.sum(-1) - 2
        positions = torch.arange(batch.tokens.shape[1], device=batch.tokens.device)
        return (positions[None] == explained[:, None]) | (positions[None] == explained[:, None] + 1)

    def keep(self, clean: CleanRun, condition: Condition, layer: int) -> Tensor | None:
        if condition.ratio == 0:
            return None
        if condition not in clean.cache:
            scores = clean[clean.layers[-1]].scores[condition.method]
            if scores.ndim == 4:  # granularity="head": a token is deleted whole
                scores = scores.sum(1)
            valid = clean.valid
            rows = torch.arange(valid.shape[0], device=valid.device)
            explained = explained_positions(valid)
            if bool((explained < 1).any()):
                raise ValueError("the prediction protocol needs texts of at least 3 tokens")
            keys = torch.arange(valid.shape[-1], device=valid.device)
            candidates = valid[rows, explained] & (keys[None] != explained[:, None])
            kept = removal_keep_mask(
                scores[rows, explained][:, None],
                candidates[:, None],
                ratio=condition.ratio,
                mode=condition.mode,
                rank_by=condition.rank_by,
            )  # [batch 1 key]
            eye = torch.eye(valid.shape[-1], dtype=torch.bool, device=valid.device)
            clean.cache[condition] = kept | eye[None]
        return clean.cache[condition]


BUILT_IN = (EveryLayer(), OneLayer(), InputDeletion(), Prediction())
"""The package's own protocols, in the order `PROTOCOLS` lists them."""
