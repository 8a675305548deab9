"""Peer measures as registered methods: ``alti``, ``alti_rollout``, ``value_zeroing``, ``grad_attention``.

Notation as in `contribution_lens.decomposition`: at layer ``l``, ``alpha_ij^h`` is the pattern,
``vt_j^h = v_j^h W_O^h`` the projected value (``hook_v`` times ``W_O``), ``x_i`` the residual
stream entering the block (``hook_resid_pre``).

**alti** (Ferrando et al. 2022, ALTI, in its pre-LayerNorm decoder form). The attention block
``y_i = x_i + Attn(LN(x))_i`` splits exactly into one vector per source token:

    T_i(x_j) = sum_h alpha_ij^h vt_j^h + [i == j] x_i,        y_i = sum_j T_i(x_j) + b_O

(``y_i`` is ``hook_resid_mid``). The contribution is the Manhattan-distance proximity,
normalised over the keys:

    p_ij = max(0, ||y_i||_1 - ||y_i - T_i(x_j)||_1),          c_ij = p_ij / sum_k p_ik

In post-LN BERT the original ALTI maps each ``T_i(x_j)`` through the linear part of the LayerNorm
that follows the block. In a pre-LN decoder (Llama, SmolLM2) the norm comes *before* the
attention: it acts on ``x_j`` on the way to ``W_V`` and is already inside ``vt_j`` (its scale
``1 / rms(x_j)`` is taken as given with the input, as in the reference implementation's
``pre_layer_norm`` branch), and nothing follows the residual sum, so ``T_i(x_j)`` is used as it
is. For a post-LN encoder this form is the split of the sum *before* its LayerNorm. ``alti``
scores are per layer and token level ``[batch query key]``; ``alti_rollout`` multiplies them
through the layers, ``R^l = C^l R^{l-1}`` (``R^0 = C^0``): the share of each *input* token.
Queries are processed in chunks so that ``[batch query key d_model]`` never exceeds
`ALTI_MAX_ELEMENTS` numbers.

**value_zeroing** (Mohebbi et al. 2023). With ``y_i`` the block output (``hook_resid_post``,
attention and MLP) and ``y_i^{(-j)}`` the same block rerun from the same ``x`` with ``v_j`` zeroed
in every head:

    s_ij = 1 - cos(y_i, y_i^{(-j)})  for j <= i,              c_ij = s_ij / sum_k s_ik

(scores below ``1e-5`` count as 0, as in inseq). The block is rerun on its own, from the
arguments it got in one clean forward (captured by a PyTorch forward hook on ``model.blocks[l]``),
with the zeroed variants of many ``(text, j)`` stacked along the batch axis: one block call per
chunk, not one model pass per token. This runs in the method's ``prepare``. (The bridge's
``forward(start_at_layer=l)`` still runs blocks ``0..l-1``, so it would cost a pass per layer.)

**grad_attention**. With ``L`` the mean next-token negative log-likelihood of the batch (real
tokens only) and one backward pass through the unmodified forward:

    g_ij^h = alpha_ij^h * dL / d alpha_ij^h                   (signed, per head)

The derivative is the total one: it follows ``alpha^l``'s effect through every later layer,
their patterns included.

How they relate to the built-ins (`contribution_lens.methods`): ``attention`` is ``alpha_ij^h``;
``value_weighted``, ``alpha_ij^h ||vt_j^h||``, is the norm-based measure of Kobayashi et al.
(2020); ALTI goes one step further, adding the residual ``x_i`` and comparing whole vectors
with the block output rather than taking norms; value zeroing and ``grad_attention`` are causal
(an intervention, a derivative) instead of read from the decomposition.

Cross-check: `benchmarks/bench_value_zeroing.py` runs inseq 0.7.1's value zeroing on the same
model and tokens. Spearman rank agreement over keys is >= 0.9996 per query on layers 0..28 and
0.99 on the last layer (where inseq reads the states after the final norm), and ours is 3.8x
faster on one CPU thread.

Example (ALTI on tensors: one head, two tokens):
    >>> import torch
    >>> pattern = torch.tensor([[[[1.0, 0.0], [0.5, 0.5]]]])
    >>> v = torch.tensor([[[[1.0, 0.0]], [[0.0, 1.0]]]])  # [batch key kv_head d_head]
    >>> W_O = torch.eye(2)[None]  # [head d_head d_model]
    >>> resid_pre = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    >>> valid = torch.tensor([[[True, False], [True, True]]])
    >>> alti_contributions(pattern, v, W_O, None, resid_pre, valid)[0, 1].tolist()
    [0.25, 0.75]
"""

from collections.abc import Sequence
from typing import Any

import einops
import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float
from torch import Tensor

from contribution_lens import adapter
from contribution_lens.decomposition import valid_positions
from contribution_lens.engine import map_layers
from contribution_lens.methods import Method, ScoreContext, register_method

ALTI_MAX_ELEMENTS = 2**24
"""Largest ``[batch query key d_model]`` block ALTI builds (chunks of queries stay under it)."""
VALUE_ZEROING_MAX_ELEMENTS = 2**24
"""Largest ``[variant head query key]`` pattern one value-zeroing block call may build."""
VALUE_ZEROING_THRESHOLD = 1e-5
"""Distances below this are 0 before normalising (inseq's ``min_score_threshold``)."""


def _normalise_rows(scores: Float[Tensor, "batch query key"]) -> Float[Tensor, "batch query key"]:
    total = scores.sum(-1, keepdim=True)
    return scores / torch.where(total == 0, 1, total)


def projected_values(
    v: Float[Tensor, "batch key kv_head d_head"], W_O: Float[Tensor, "head d_head d_model"]
) -> Float[Tensor, "batch head key d_model"]:
    """``vt_j^h = v_j^h W_O^h``, with kv heads shared by ``head / kv_head`` query heads (GQA)."""
    W_O_g = einops.rearrange(W_O, "(kv_head group) d_head d_model -> kv_head group d_head d_model", kv_head=v.shape[2])
    vt = einops.einsum(
        v, W_O_g, "batch key kv_head d_head, kv_head group d_head d_model -> batch kv_head group key d_model"
    )
    return einops.rearrange(vt, "batch kv_head group key d_model -> batch (kv_head group) key d_model")


def alti_contributions(
    pattern: Float[Tensor, "batch head query key"],
    v: Float[Tensor, "batch key kv_head d_head"],
    W_O: Float[Tensor, "head d_head d_model"],
    b_O: Float[Tensor, " d_model"] | None,
    resid_pre: Float[Tensor, "batch query d_model"],
    valid: Bool[Tensor, "batch query key"],
    *,
    max_elements: int = ALTI_MAX_ELEMENTS,
) -> Float[Tensor, "batch query key"]:
    """ALTI ``c_ij`` of one pre-LN attention block (see the module docstring), rows summing to 1.

    Accumulates in float32 at least. Queries go in chunks so that the transformed vectors
    ``T_i(x_j)`` of a chunk, ``[batch chunk key d_model]``, hold at most ``max_elements`` numbers.
    """
    acc = torch.promote_types(pattern.dtype, torch.float32)
    batch, _, n_query, n_key = pattern.shape
    alpha = torch.where(einops.rearrange(valid, "batch query key -> batch 1 query key"), pattern.to(acc), 0)
    vt = projected_values(v.to(acc), W_O.to(acc))
    x = resid_pre.to(acc)
    chunk = max(1, max_elements // max(1, batch * n_key * W_O.shape[-1]))
    out = torch.zeros(batch, n_query, n_key, dtype=acc, device=pattern.device)
    for start in range(0, n_query, chunk):
        stop = min(start + chunk, n_query)
        out[:, start:stop] = _alti_chunk(alpha[:, :, start:stop], vt, x, b_O, start, n_key - n_query)
    return _normalise_rows(torch.where(valid, out, 0))


def _alti_chunk(
    alpha: Float[Tensor, "batch head query key"],
    vt: Float[Tensor, "batch head key d_model"],
    x: Float[Tensor, "batch query_all d_model"],
    b_O: Tensor | None,
    start: int,
    offset: int,
) -> Float[Tensor, "batch query key"]:
    """Proximities ``p_ij`` for the queries ``start .. start + chunk`` (``offset``: key index of query 0)."""
    transformed = einops.einsum(alpha, vt, "batch head query key, batch head key d_model -> batch query key d_model")
    queries = torch.arange(start, start + alpha.shape[2], device=alpha.device)
    # The residual x_i belongs to the query's own token: T_i(x_i) gains x_i.
    transformed[:, queries - start, queries + offset] += x[:, queries]
    y = transformed.sum(2) + (0 if b_O is None else b_O.to(transformed.dtype))
    distance = (y[:, :, None] - transformed).abs().sum(-1)
    return (y.abs().sum(-1, keepdim=True) - distance).clamp(min=0)


def alti_score(layer: adapter.LayerInputs, context: ScoreContext) -> Float[Tensor, "batch query key"]:
    """Registered ``alti``: `alti_contributions` of the layer, reading ``hook_resid_pre``."""
    valid = layer.decompose(context.scope).valid
    return alti_contributions(layer.pattern, layer.v, layer.W_O, layer.b_O, layer.captured["hook_resid_pre"], valid)


def alti_rollout_scores(
    model: adapter.Model, batch: adapter.TokenBatch, layers: Sequence[int]
) -> dict[int, Float[Tensor, "batch query key"]]:
    """ALTI rolled out over layers ``0..l`` for every requested ``l``: ``R^l = C^l R^{l-1}``, ``R^0 = C^0``.

    ``R^l_ij`` is the share of input token ``j`` in the residual stream at position ``i`` after
    block ``l`` (the MLP acts on each position alone, so it mixes nothing). One forward pass runs
    ALTI on every layer up to the last requested one.
    """
    wanted = set(layers)
    out: dict[int, Tensor] = {}
    rollout: list[Tensor] = []

    def step(layer: adapter.LayerInputs) -> None:
        contributions = alti_score(layer, ScoreContext())
        if rollout:
            contributions = einops.einsum(
                contributions, rollout.pop(), "batch query mid, batch mid key -> batch query key"
            )
        rollout.append(contributions)
        if layer.layer in wanted:
            out[layer.layer] = contributions

    map_layers(model, batch, step, layers=list(range(max(layers) + 1)), capture=("hook_resid_pre",))
    return out


# --- value zeroing -------------------------------------------------------------------------


def _block_calls(model: adapter.Model, batch: adapter.TokenBatch, layers: Sequence[int]) -> dict[int, tuple]:
    """``(args, kwargs, output)`` of each requested block in one clean forward pass."""
    calls: dict[int, tuple] = {}
    handles = []
    last = max(layers)

    def record(layer: int) -> Any:
        def hook(module: Any, args: tuple, kwargs: dict, output: Any) -> None:
            calls[layer] = (args, kwargs, output[0] if isinstance(output, tuple) else output)
            if layer == last:
                raise adapter.StopForward

        return hook

    try:
        for layer in layers:
            handles.append(model.blocks[layer].register_forward_hook(record(layer), with_kwargs=True))
        try:
            adapter.forward(model, batch)
        except adapter.StopForward:
            pass
    finally:
        for handle in handles:
            handle.remove()
    missing = [layer for layer in layers if layer not in calls]
    if missing:
        raise RuntimeError(f"the forward pass never called blocks {missing}")
    return calls


def _select_rows(value: Any, rows: Tensor, batch_size: int) -> Any:
    """Index the batch axis of every tensor (in tuples too) whose leading axis is the batch."""
    if isinstance(value, Tensor):
        if value.ndim >= 2 and value.shape[0] == batch_size and batch_size > 1:
            return value.index_select(0, rows.to(value.device))
        return value
    if isinstance(value, tuple):
        return tuple(_select_rows(item, rows, batch_size) for item in value)
    return value


def _variant_kwargs(kwargs: dict, rows: Tensor, batch_size: int) -> dict:
    """The block's keyword arguments for stacked variants of batch rows ``rows``, without a KV cache."""
    out = {}
    for name, value in kwargs.items():
        if type(value).__name__.endswith("Cache"):
            continue  # a KV cache would append the variants' keys to the clean ones
        out[name] = False if name == "use_cache" else _select_rows(value, rows, batch_size)
    return out


def _zero_values(rows_keys: Tensor, key_dim: int = 1) -> adapter.HookFn:
    """A ``hook_v`` hook zeroing key ``rows_keys[c]`` of variant ``c`` in every (kv) head.

    ``key_dim`` is the dimension of the hook's tensor that indexes keys (`adapter.value_key_dim`).
    """

    def hook(v: Tensor, hook: Any) -> Tensor:
        zeroed = v.clone()
        index = (torch.arange(v.shape[0], device=v.device), rows_keys.to(v.device))
        zeroed.movedim(key_dim, 1)[index] = 0
        return zeroed

    return hook


def value_zeroing_layer(
    model: adapter.Model,
    layer: int,
    call: tuple,
    batch: adapter.TokenBatch,
    *,
    chunk_size: int | None = None,
) -> Float[Tensor, "batch query key"]:
    """Value-zeroing distances ``s_ij`` of one layer from its recorded block call (not normalised)."""
    args, kwargs, clean = call
    hidden = args[0] if args else kwargs["hidden_states"]
    rest = {k: v for k, v in kwargs.items() if k != "hidden_states"}
    n_batch, n_pos, _ = hidden.shape
    lengths = batch.attention_mask.sum(-1).tolist()
    variants = torch.tensor([(b, j) for b in range(n_batch) for j in range(lengths[b])], dtype=torch.long)
    if chunk_size is None:
        chunk_size = max(1, VALUE_ZEROING_MAX_ELEMENTS // (model.cfg.n_heads * n_pos * n_pos))
    distances = torch.zeros(n_batch, n_pos, n_pos, dtype=torch.float32, device=hidden.device)
    block = model.blocks[layer]
    for chunk in variants.split(chunk_size):
        rows, keys = chunk[:, 0].to(hidden.device), chunk[:, 1]
        zero = _zero_values(keys, adapter.value_key_dim(model, layer))
        with torch.inference_mode(), model.hooks(fwd_hooks=[(adapter.value_hook(layer, model), zero)]):
            zeroed = block(hidden.index_select(0, rows), *args[1:], **_variant_kwargs(rest, rows, n_batch))
        zeroed = zeroed[0] if isinstance(zeroed, tuple) else zeroed
        cosine = F.cosine_similarity(clean.index_select(0, rows).float(), zeroed.float(), dim=-1)
        distances[rows, :, keys.to(hidden.device)] = 1 - cosine
    return distances


def value_zeroing_scores(
    model: adapter.Model,
    batch: adapter.TokenBatch,
    layers: Sequence[int],
    *,
    chunk_size: int | None = None,
) -> dict[int, Float[Tensor, "batch query key"]]:
    """Value-zeroing ``c_ij`` of every requested layer (rows sum to 1 over visible keys).

    One clean forward records each block's call; then, per layer, the zeroed variants of every
    ``(text, key)`` pair run through that block alone, ``chunk_size`` at a time (default: as many
    as keep the pattern under `VALUE_ZEROING_MAX_ELEMENTS`). ``chunk_size=1`` is the
    one-token-at-a-time loop.
    """
    calls = _block_calls(model, batch, layers)
    n_pos = batch.tokens.shape[1]
    mask = batch.attention_mask if batch.padded else None
    causal = adapter.is_causal_model(model)
    valid = valid_positions(
        n_pos, n_pos, attention_mask=mask, batch=batch.tokens.shape[0], causal=causal, device=batch.tokens.device
    )
    out = {}
    for layer in layers:
        distances = value_zeroing_layer(model, layer, calls.pop(layer), batch, chunk_size=chunk_size)
        distances = torch.where(valid & (distances >= VALUE_ZEROING_THRESHOLD), distances, 0)
        out[layer] = _normalise_rows(distances)
    return out


def prepared_score(layer: adapter.LayerInputs, context: ScoreContext) -> Tensor:
    """The scores the method's ``prepare`` computed for this layer (``value_zeroing``, ``alti_rollout``)."""
    if not isinstance(context.prepared, dict) or layer.layer not in context.prepared:
        raise ValueError(f"no prepared scores for layer {layer.layer}: run the method's prepare on this batch first")
    return context.prepared[layer.layer].to(layer.pattern.device)


# --- gradient x attention ------------------------------------------------------------------


def mean_next_token_nll(logits: Float[Tensor, "batch pos d_vocab"], batch: adapter.TokenBatch) -> Float[Tensor, ""]:
    """Mean negative log-likelihood of every real next token of the batch."""
    log_probs = F.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = log_probs.gather(-1, batch.tokens[:, 1:, None])[..., 0]
    predicted = batch.attention_mask[:, 1:] & batch.attention_mask[:, :-1]
    if not bool(predicted.any()):
        raise ValueError("grad_attention needs at least two tokens in a text: there is no next token to predict")
    return -picked[predicted].mean()


def attention_gradients(
    model: adapter.Model, batch: adapter.TokenBatch, layers: Sequence[int]
) -> dict[int, Float[Tensor, "batch head query key"]]:
    """``dL / d alpha^l`` for every requested layer from one forward and one backward pass.

    The residual stream entering block 0 is made a leaf requiring grad, so the patterns are in
    the graph whether or not the parameters require grad; parameter gradients are not computed.
    """
    patterns: dict[int, Tensor] = {}

    def keep(layer: int) -> adapter.HookFn:
        def hook(pattern: Tensor, hook: Any) -> None:
            patterns[layer] = pattern

        return hook

    def leaf(resid: Tensor, hook: Any) -> Tensor:
        return resid.detach().requires_grad_(True)

    hooks = [("blocks.0.hook_resid_pre", leaf)] + [(adapter.pattern_hook(layer), keep(layer)) for layer in layers]
    kwargs = {"attention_mask": batch.attention_mask.long()} if batch.padded else {}
    with torch.inference_mode(False), torch.enable_grad(), model.hooks(fwd_hooks=hooks):
        loss = mean_next_token_nll(model(batch.tokens.clone(), **kwargs), batch)
        grads = torch.autograd.grad(loss, [patterns[layer] for layer in layers], allow_unused=True)
    missing = [layer for layer, grad in zip(layers, grads, strict=True) if grad is None]
    if missing:
        raise RuntimeError(f"the loss does not depend on hook_pattern of layers {missing}")
    return {layer: grad.detach() for layer, grad in zip(layers, grads, strict=True)}


def grad_attention_score(layer: adapter.LayerInputs, context: ScoreContext) -> Float[Tensor, "batch head query key"]:
    """Registered ``grad_attention``: ``alpha * dL/dalpha`` per head, 0 where a key is not visible."""
    grad = prepared_score(layer, context)
    valid = einops.rearrange(layer.decompose(context.scope).valid, "batch query key -> batch 1 query key")
    return torch.where(valid, layer.pattern.float() * grad.float(), 0)


PEER_METHODS: tuple[str, ...] = ("alti", "alti_rollout", "value_zeroing", "grad_attention")
for _method in (
    Method(
        "alti",
        alti_score,
        "ALTI: Manhattan proximity of each token's transformed vector to the block output (Ferrando et al.)",
        capture=("hook_resid_pre",),
    ),
    Method(
        "alti_rollout",
        prepared_score,
        "ALTI rolled out from the input tokens through every layer up to this one (Ferrando et al.)",
        prepare=alti_rollout_scores,
    ),
    Method(
        "value_zeroing",
        prepared_score,
        "value zeroing: cosine distance of the block output with v_j zeroed (Mohebbi et al.)",
        prepare=lambda model, batch, layers: value_zeroing_scores(model, batch, layers),
    ),
    Method(
        "grad_attention",
        grad_attention_score,
        "alpha * dL/dalpha: attention times the gradient of the next-token loss",
        signed=True,
        prepare=attention_gradients,
    ),
):
    register_method(_method, replace=True)
