"""Logit attribution by key: a next-token logit (or a logit difference) split into exact signed terms.

At position ``i`` the logit of token ``t`` is ``<N(x_i), W_U[:, t]> + b_U[t]``, with ``x_i`` the
residual stream after the last block and ``N`` the final norm. With ``N``'s scale frozen at ``i``
(its value in this forward pass) ``N`` is affine, so with ``u = W_U[:, t] - W_U[:, f]`` (``f`` the
foil; no foil: ``u = W_U[:, t]``) seen through the norm, ``u_N = P(g * u) / s_i``,

    logit = <x_i, u_N> + <b_N, u> + b_U[t] - b_U[f]
    x_i   = embed_i + sum_l (attn_out_l,i + mlp_l,i)
    <attn_out_l,i, u_N> = sum_h sum_j alpha_ij^h <vt_j^h, u_l> + <b_O, u_l>

where ``vt_j^h = v_j^h W_O^h`` and ``u_l = u_N``, or, where the attention output is normed before it
joins the residual stream (Gemma 2/3), that norm's own pull-back of ``u_N`` with its scale frozen
at ``i`` too (its bias then adds a term). Each key's term is computed as
``alpha * (v @ (W_O u_l))``: no ``[head key d_model]`` vector is ever formed. Every term is a direct
effect: what that component writes into the residual stream, read by the unembedding. What it
causes through later layers is counted in those layers' terms, not in its own.

Exact: the terms add up to the logit the model's weights give its own residual stream, evaluated
in float32 (float64 for a float64 model) by `contribution_lens.adapter.Readout.logit` from the
stream ``x_i`` and final-norm scale the pass captured (where a model soft-caps its logits, Gemma
2's ``c * tanh(z / c)``, the ``z`` before the cap), to 1e-4 relative, checked on every call and
whatever the model's dtype. That value is ``logit``; the model's own, as it computed it in its
dtype, is ``model_value``, and ``rounding_gap = model_value - logit`` is its rounding of the final
norm and unembedding (0 to about 1e-6 in float32, a few hundredths in bfloat16). A gap larger than
`contribution_lens.adapter.Readout.rounding_bound` warns. In half precision a model also rounds
each layer's attention output: ``attention_rounding[l]`` is that rounding's term, so the rebuilt
head terms stay exact products of the model's own pattern, values and ``W_O``.

Frozen: the final norm's scale (and the post-attention norms' scales): a term says what the logit
would lose if that component's output were removed *and the scales stayed as they are*.

    >>> import contribution_lens as cl
    >>> model = cl.load_model()
    >>> text = "When Mary and John went to the store, John gave a drink to"
    >>> result = cl.logit_attribution(model, text, target=" Mary", foil=" John")
    >>> bool(abs(result.to_dataframe()["value"].sum() - result.logit) < 1e-4 * max(1.0, abs(result.logit)))
    True
    >>> result.str_tokens[int(result.by_key().idxmax())]
    ' Mary'
"""

import math
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import einops
import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor

from contribution_lens import adapter
from contribution_lens.choices import as_count, as_position
from contribution_lens.decomposition import accumulation_dtype
from contribution_lens.engine import LayerResults, map_layers
from contribution_lens.files import Saves

if TYPE_CHECKING:
    import plotly.graph_objects as go

TOLERANCE = 1e-4
"""Relative gap between the sum of the terms and the float readout of the logit above which a call fails."""


@dataclass(frozen=True, eq=False)
class LogitAttribution(Saves):
    """Signed terms that add up to one next-token logit (or logit difference) of a decoder.

    ``attention[l, h, j]`` is key ``j``'s term through head ``h`` of layer ``l``; the others are
    one number per layer (``mlp``, ``attention_bias`` = ``b_O``, ``post_norm_bias``, and in half
    precision ``attention_rounding``) or per model (``embed``, ``final_norm_bias``, ``unembed_bias``).
    Biases a model does not have are 0 and get no table row.

    Three values of the explained quantity ``z``:

    - ``logit``: ``z`` evaluated in float32 (float64 for a float64 model) by the model's readout
      from the residual stream the pass captured (`contribution_lens.adapter.Readout.logit`): what
      the terms add up to, checked to 1e-4 relative on every call;
    - ``total()``: the terms' sum, equal to ``logit`` up to float32 rounding;
    - ``model_value``: ``z`` as the model computed it, in its own dtype; ``rounding_gap`` is
      ``model_value - logit``, the model's rounding of its final norm and unembedding (about 1e-6
      in float32, up to a few hundredths in bfloat16), bounded by
      `contribution_lens.adapter.Readout.rounding_bound`.

    ``save(path)`` / ``LogitAttribution.load(path)`` keep it in one file, ``model_value`` included.

    Example:
        >>> import contribution_lens as cl, torch
        >>> half = cl.load_model(dtype=torch.bfloat16)
        >>> r = cl.logit_attribution(half, "The capital of France is")
        >>> bool(abs(r.total() - r.logit) < 1e-4 * abs(r.logit)), bool(r.rounding_gap == r.model_value - r.logit)
        (True, True)
    """

    tokens: Int[Tensor, " pos"]
    str_tokens: list[str]
    position: int
    target: int
    target_token: str
    foil: int | None
    foil_token: str | None
    logit: float
    attention: Float[Tensor, "layer head key"]
    attention_bias: Float[Tensor, " layer"]
    post_norm_bias: Float[Tensor, " layer"]
    mlp: Float[Tensor, " layer"]
    embed: float
    final_norm_bias: float = 0.0
    unembed_bias: float = 0.0
    has_biases: tuple[str, ...] = ()
    """Which bias terms the model has: among ``b_O``, ``post_norm``, ``final_norm``, ``unembed``."""
    softcap: float | None = None
    """Where the model soft-caps its logits (Gemma 2: ``c * tanh(z / c)``), ``c``: `logit` is then ``z``,
    the unembedding's output before the cap, which is what the terms add up to."""
    model_value: float | None = None
    """The explained quantity as the model computed it, in its own dtype (None: not recorded)."""
    attention_rounding: Float[Tensor, " layer"] | None = None
    """Per layer, ``<attn_out_l - rebuilt_l, u_l>``: the model's attention output less the sum of
    its rebuilt head terms and biases, i.e. its own rounding of that output. Kept where the model
    computes in half precision (None in float32 and float64, where it is float rounding)."""

    def __post_init__(self) -> None:
        n_layers = self.attention.shape[0]
        names = ("attention_bias", "post_norm_bias", "mlp")
        for name in names if self.attention_rounding is None else (*names, "attention_rounding"):
            if getattr(self, name).shape != (n_layers,):
                raise ValueError(f"{name} has shape {tuple(getattr(self, name).shape)}, expected ({n_layers},)")
        if self.attention.shape[-1] != len(self.str_tokens) or self.tokens.shape != (len(self.str_tokens),):
            raise ValueError(
                f"attention covers {self.attention.shape[-1]} keys, tokens {tuple(self.tokens.shape)} "
                f"and {len(self.str_tokens)} labels"
            )
        if not 0 <= self.position < len(self.str_tokens):
            raise ValueError(f"position {self.position} is outside the {len(self.str_tokens)} tokens")

    @property
    def n_layers(self) -> int:
        return int(self.attention.shape[0])

    @property
    def quantity(self) -> str:
        """What is explained, in words: ``logit(' Mary')`` or ``logit(' Mary') - logit(' John')``."""
        if self.foil is None:
            return f"logit({self.target_token!r})"
        return f"logit({self.target_token!r}) - logit({self.foil_token!r})"

    @property
    def rounding_gap(self) -> float | None:
        """``model_value - logit``: how far the model's own rounding put its value (None where not recorded)."""
        return None if self.model_value is None else self.model_value - self.logit

    def total(self) -> float:
        """The sum of every term: equals `logit` up to float rounding."""
        parts = [self.attention.sum(), self.attention_bias.sum(), self.post_norm_bias.sum(), self.mlp.sum()]
        if self.attention_rounding is not None:
            parts.append(self.attention_rounding.sum())
        return float(sum(float(p) for p in parts) + self.embed + self.final_norm_bias + self.unembed_bias)

    def by_key(self) -> pd.Series:
        """Attention terms summed over layers and heads, per key position (index ``key``)."""
        values = self.attention[..., : self.visible].sum((0, 1)).double().numpy()
        return pd.Series(values, index=pd.RangeIndex(self.visible, name="key"), name="value")

    def by_head(self) -> pd.DataFrame:
        """Attention terms summed over keys: rows are layers, columns heads."""
        table = pd.DataFrame(self.attention.sum(-1).double().numpy())
        table.index.name, table.columns.name = "layer", "head"
        return table

    def by_layer(self) -> pd.DataFrame:
        """Per layer: the attention terms (heads and keys summed, ``b_O`` and post-norm bias apart) and the MLP's.

        A half-precision model's results add an ``attention_rounding`` column (`attention_rounding`).
        """
        columns = {
            "attention": self.attention.sum((1, 2)).double().numpy(),
            "attention_bias": (self.attention_bias + self.post_norm_bias).double().numpy(),
            "mlp": self.mlp.double().numpy(),
        }
        if self.attention_rounding is not None:
            columns["attention_rounding"] = self.attention_rounding.double().numpy()
        return pd.DataFrame(columns, index=pd.RangeIndex(self.n_layers, name="layer"))

    @property
    def visible(self) -> int:
        """How many keys the position sees (a decoder's keys ``0..position``)."""
        return self.position + 1

    def to_dataframe(self) -> pd.DataFrame:
        """One row per term: ``component, term, layer, head, key, key_token, value``; ``value`` sums to `logit`.

        ``component`` is ``"embed"``, ``"attention"`` (one row per layer, head and visible key),
        ``"mlp"`` (one per layer), ``"bias"`` (``term`` says which: ``b_O``, ``post_norm``,
        ``final_norm``, ``unembed``) or, for a half-precision model, ``"rounding"`` (one per layer,
        term ``attention output``: `attention_rounding`); ``layer``/``head``/``key`` are missing where
        they do not apply.
        """
        n_heads, keys = self.attention.shape[1], self.visible
        grid = torch.cartesian_prod(torch.arange(self.n_layers), torch.arange(n_heads), torch.arange(keys))
        rows = [_rows("embed", "embed", [self.embed])]
        rows.append(
            pd.DataFrame(
                {
                    "component": "attention",
                    "term": "alpha v W_O",
                    "layer": grid[:, 0].numpy(),
                    "head": grid[:, 1].numpy(),
                    "key": grid[:, 2].numpy(),
                    "key_token": [self.str_tokens[j] for j in grid[:, 2].tolist()],
                    "value": self.attention[..., :keys].reshape(-1).double().numpy(),
                }
            )
        )
        rows.append(_rows("mlp", "mlp", self.mlp.tolist(), layers=True))
        if self.attention_rounding is not None:
            rows.append(_rows("rounding", "attention output", self.attention_rounding.tolist(), layers=True))
        per_layer = {"b_O": self.attention_bias, "post_norm": self.post_norm_bias}
        for name, values in per_layer.items():
            if name in self.has_biases:
                rows.append(_rows("bias", name, values.tolist(), layers=True))
        for name, value in (("final_norm", self.final_norm_bias), ("unembed", self.unembed_bias)):
            if name in self.has_biases:
                rows.append(_rows("bias", name, [value]))
        table = pd.concat(rows, ignore_index=True)
        for column in ("layer", "head", "key"):
            table[column] = table[column].astype("Int64")
        return table

    def top(self, k: int = 10) -> pd.DataFrame:
        """The ``k`` terms of largest magnitude (any component), largest first."""
        k = as_count(k, "k")
        table = self.to_dataframe()
        return table.loc[table["value"].abs().sort_values(ascending=False).index[:k]].reset_index(drop=True)

    def figures(self) -> "dict[str, go.Figure]":
        """``heads`` (layers x heads heatmap), ``keys`` (per-key bars with tokens), ``layers`` (attention vs MLP)."""
        from contribution_lens.drawing import plot

        return {"heads": plot.logit_heads(self), "keys": plot.logit_keys(self), "layers": plot.logit_layers(self)}

    def __repr__(self) -> str:
        key = int(self.by_key().idxmax())
        return (
            f"LogitAttribution({self.quantity} = {self.logit:.4g} at position {self.position}, "
            f"layers={self.n_layers}, heads={self.attention.shape[1]}, top key {key}:{self.str_tokens[key]!r})"
        )

    def report(self, path: str | os.PathLike) -> Path:
        """One self-contained HTML page: the figures, the largest terms and the terms per layer."""
        from contribution_lens.drawing import html

        sections: list[html.Section] = [
            ("Text", "".join(self.str_tokens)),
            ("What is explained", f"{self.quantity} = {self.logit:.4f} at position {self.position}; "
             f"the terms add up to {self.total():.4f}" + self._as_computed()),
            *self.figures().items(),
            ("The 20 largest terms", self.top(20)),
            ("Per layer", self.by_layer()),
        ]  # fmt: skip
        return html.write_html(path, f"LogitAttribution of {self.quantity}", sections)

    def _as_computed(self) -> str:
        if self.model_value is None:
            return ""
        return (
            f"; the model computed {self.model_value:.4f} in its own precision (rounding gap {self.rounding_gap:.2g})"
        )


def _rows(component: str, term: str, values: list[float], *, layers: bool = False) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "component": component,
            "term": term,
            "layer": list(range(len(values))) if layers else [None] * len(values),
            "head": None,
            "key": None,
            "key_token": None,
            "value": [float(v) for v in values],
        }
    )


TokenLike = str | int
"""A token as a string that is exactly one token (``" Mary"``, leading space included) or an id."""


@dataclass(frozen=True, eq=False)
class _LayerRecord:
    """What one layer keeps for the positions being explained (everything else is dropped in the pass)."""

    alpha: Float[Tensor, "head pos key"]
    v: Float[Tensor, "key kv_head d_head"]
    W_O: Float[Tensor, "head d_head d_model"]
    b_O: Float[Tensor, " d_model"] | None
    resid_pre: Float[Tensor, "pos d_model"] | None
    """``hook_resid_pre`` of layer 0 (the embedding); None at the other layers."""
    update: Float[Tensor, "pos d_model"]
    """``resid_post - resid_pre`` in float32 (or float64): the whole block's write into the residual stream."""
    attn_out: Float[Tensor, "pos d_model"]
    """``hook_attn_out``: attention's share of ``update`` (after the post-attention norm where there is one)."""
    post_scale: Float[Tensor, " pos"] | None
    resid_post: Float[Tensor, "pos d_model"] | None = None
    """``hook_resid_post`` of the last layer (what the final norm reads); None at the others."""


def check_decoder(model: adapter.Model) -> adapter.Readout:
    """Refuse, before any pass, a model whose next-token logits this analysis cannot split; else its readout."""
    adapter.n_layers(model)
    if not adapter.is_causal_model(model):
        raise ValueError(
            "logit attribution explains a decoder's next-token logit; this model's attention is bidirectional "
            "(an encoder such as BERT), and its masked-LM head transforms the residual stream non-linearly"
        )
    readout = adapter.readout(model)
    readout.unembedding()
    return readout


def token_id(model: adapter.Model, token: TokenLike, what: str, readout: adapter.Readout | None = None) -> int:
    """``token`` as an id of the model's vocabulary; a string must be exactly one token.

    Example:
        >>> import contribution_lens as cl
        >>> from contribution_lens.analyses.logit_attribution import token_id
        >>> model = cl.load_model()
        >>> model.tokenizer.decode([token_id(model, " Mary", "target")])
        ' Mary'
        >>> token_id(model, 9, "target")
        9
    """
    d_vocab = int((readout or adapter.readout(model)).unembedding()[0].shape[1])
    if isinstance(token, str):
        tokenizer = getattr(model, "tokenizer", None)
        if tokenizer is None:
            raise ValueError(f"{what} {token!r} is a string, but this model has no tokenizer: pass a token id")
        ids = tokenizer.encode(token, add_special_tokens=False)
        if len(ids) != 1:
            pieces = [tokenizer.decode([i]) for i in ids]
            raise ValueError(
                f"{what} {token!r} is {len(ids)} tokens for this tokenizer ({pieces}); give exactly one token, "
                "as a string or an id (a leading space is part of a token: ' Mary', not 'Mary')"
            )
        if not 0 <= ids[0] < d_vocab:
            raise ValueError(
                f"{what} {token!r} is token id {ids[0]}, outside the model's vocabulary of {d_vocab} ids "
                f"(0..{d_vocab - 1}): the tokenizer has tokens the model has no embedding for"
            )
        return int(ids[0])
    index = adapter.as_index(token, f"{what} must be a token string or an integer id")
    if not 0 <= index < d_vocab:
        raise ValueError(f"{what} id {index} is outside the model's vocabulary of {d_vocab} ids (0..{d_vocab - 1})")
    return index


def one_text(model: adapter.Model, text: str | Tensor, prepend_bos: bool | None) -> adapter.TokenBatch:
    """One text (or one row of token ids) as a batch of one."""
    if not isinstance(text, str | Tensor):
        raise TypeError(f"text must be one string or a tensor of token ids, got {type(text).__name__}")
    if isinstance(text, Tensor) and text.ndim == 2 and text.shape[0] != 1:
        raise ValueError(f"logit attribution explains one text at a time; got a batch of {text.shape[0]}")
    return adapter.to_token_batch(model, text, prepend_bos=prepend_bos)


def _recorder(readout: adapter.Readout, positions: Tensor) -> Any:
    last = len(readout.post_norms) - 1

    def record(layer: adapter.LayerInputs) -> _LayerRecord:
        pre = layer.captured[adapter.RESID_PRE][0]
        post = layer.captured[adapter.RESID_POST][0]
        scale = readout.post_scale(layer)
        rows = positions.to(pre.device)
        # The difference of two half-precision numbers is exact in float32 (rounded in their own
        # dtype it is not): the blocks' writes then add back up to the last stream exactly.
        wide = torch.promote_types(post.dtype, torch.float32)
        return _LayerRecord(
            alpha=layer.pattern[0][:, rows, :],
            v=layer.v[0],
            W_O=layer.W_O,
            b_O=layer.b_O,
            resid_pre=pre[rows] if layer.layer == 0 else None,
            update=post[rows].to(wide) - pre[rows].to(wide),
            attn_out=layer.captured[adapter.ATTN_OUT][0][rows],
            post_scale=None if scale is None else scale[0, rows],
            resid_post=post[rows] if layer.layer == last else None,
        )

    return record


def _dot(bias: Tensor | None, direction: Tensor) -> Tensor:
    if bias is None:
        return torch.zeros(direction.shape[:-1], dtype=direction.dtype, device=direction.device)
    return direction @ bias.to(direction)


def _layer_terms(
    readout: adapter.Readout, layer: int, record: _LayerRecord, u: Float[Tensor, "pos d_model"]
) -> dict[str, Tensor]:
    """One layer's terms for every explained position: ``attention`` ``[pos head key]``, the rest ``[pos]``."""
    dtype = u.dtype
    norm = readout.post_norms[layer]
    u_layer = u if norm is None or record.post_scale is None else norm.pull_back(u, record.post_scale)
    # <alpha_ij vt_j, u> = alpha_ij * (v_j @ (W_O u)): the projected values are never formed.
    read = einops.einsum(record.W_O.to(dtype), u_layer, "head d_head d_model, pos d_model -> pos head d_head")
    n_heads, n_kv = record.alpha.shape[0], record.v.shape[1]
    values = record.v.to(dtype).repeat_interleave(n_heads // n_kv, dim=1)
    per_key = einops.einsum(values, read, "key head d_head, pos head d_head -> pos head key")
    alpha = einops.rearrange(record.alpha.to(dtype), "head pos key -> pos head key")
    terms = {
        "attention": alpha * per_key,
        "attention_bias": _dot(record.b_O, u_layer),
        "post_norm_bias": _dot(None if norm is None else norm.bias, u),
        "mlp": ((record.update.to(dtype) - record.attn_out.to(dtype)) * u).sum(-1),
    }
    # What the model added is its attention output as it rounded it, not the float sum of its heads:
    # the difference (up to 1e-3 of the logit in bfloat16 over 30 layers) is a term of its own.
    written = (record.attn_out.to(dtype) * u).sum(-1)
    terms["attention_rounding"] = written - terms["attention"].sum((-2, -1)) - terms["attention_bias"]
    terms["attention_rounding"] -= terms["post_norm_bias"]
    return terms


def _check_total(readout: adapter.Readout, result: LogitAttribution, bound: float, dtype: torch.dtype) -> None:
    """Raise unless the terms add up to the float readout; warn where the model's value is further than ``bound``."""
    values = (result.logit, result.model_value if result.model_value is not None else 0.0)
    if not all(math.isfinite(value) for value in values):
        largest = torch.finfo(dtype).max
        raise FloatingPointError(
            f"{result.quantity} at position {result.position} is {result.model_value} in the model's {dtype} pass "
            f"(the float readout of its residual stream: {result.logit}): the pass overflowed ({dtype} holds at most "
            f"{largest:.6g}); load the model in torch.bfloat16 or torch.float32"
        )
    total = result.total()
    gap = abs(total - result.logit) / max(1.0, abs(result.logit))
    if not gap <= TOLERANCE:
        raise RuntimeError(
            f"the terms of {result.quantity} at position {result.position} add up to {total:.6g} but the float "
            f"readout of the model's residual stream is {result.logit:.6g} (relative gap {gap:.2g}): "
            f"{readout.model_name}'s residual stream or norms are not wired the way the adapter reads them"
        )
    rounding = result.rounding_gap
    if rounding is not None and not abs(rounding) <= bound:
        warnings.warn(
            f"{result.quantity} at position {result.position}: the model computed {result.model_value:.6g}, the float "
            f"readout of its residual stream gives {result.logit:.6g}; the gap {rounding:.3g} is more than the "
            f"{bound:.3g} that {dtype} rounding of the final norm and unembedding explains: {readout.model_name}'s "
            "final norm or unembedding may not be read the way the model computes it (the terms add up to the readout)",
            RuntimeWarning,
            stacklevel=2,
        )


def attribute_positions(
    model: adapter.Model,
    batch: adapter.TokenBatch,
    positions: Sequence[int],
    targets: Sequence[int | None],
    foils: Sequence[int | None],
    *,
    dtype: torch.dtype | str = torch.float32,
    readout: adapter.Readout | None = None,
) -> list[LogitAttribution]:
    """`LogitAttribution` at every position of ``positions`` of a batch of one, from one forward pass.

    ``targets[k]`` is the token explained at ``positions[k]`` (None: the model's top prediction
    there); ``foils[k]`` the token it is contrasted with, or None. Memory: per layer the pattern's
    rows at those positions and ``hook_v``; the largest intermediate is ``[pos head key]``.
    ``readout`` is the model's `contribution_lens.adapter.Readout` where the caller has built it.
    """
    return attribute_with(model, batch, positions, targets, foils, dtype=dtype, readout=readout)[0]


def attribute_with(
    model: adapter.Model,
    batch: adapter.TokenBatch,
    positions: Sequence[int],
    targets: Sequence[int | None],
    foils: Sequence[int | None],
    *,
    dtype: torch.dtype | str = torch.float32,
    also: Callable[[adapter.LayerInputs], Any] | None = None,
    also_capture: Sequence[str] = (),
    readout: adapter.Readout | None = None,
) -> tuple[list[LogitAttribution], LayerResults[Any] | None]:
    """`attribute_positions`, and another per-layer function ``also`` run in the same pass (its results second)."""
    dtype = accumulation_dtype(dtype)
    readout = readout or adapter.readout(model)
    store: dict[str, Tensor] = {}
    rows = torch.tensor(list(positions), dtype=torch.long)
    record = _recorder(readout, rows)
    capture = list(dict.fromkeys([*readout.residual_capture, *also_capture]))
    both = map_layers(
        model,
        batch,
        record if also is None else (lambda layer: (record(layer), also(layer))),
        capture=capture,
        whole_pass=True,  # the unembedding sees the explained positions only (`Readout.final_hooks`)
        extra_hooks=readout.final_hooks(rows.tolist(), store),
    )
    records = both if also is None else both.map(lambda pair: pair[0])
    extra = None if also is None else both.map(lambda pair: pair[1])
    return _assemble(readout, model, batch, rows.tolist(), targets, foils, records, store, dtype), extra


def _assemble(
    readout: adapter.Readout,
    model: adapter.Model,
    batch: adapter.TokenBatch,
    positions: list[int],
    targets: Sequence[int | None],
    foils: Sequence[int | None],
    records: LayerResults[_LayerRecord],
    store: dict[str, Tensor],
    dtype: torch.dtype,
) -> list[LogitAttribution]:
    """The terms of every explained position from what the pass kept, each checked against the float readout."""
    own = store["logits"]
    logits = own.to(dtype)
    chosen = [int(logits[k].argmax()) if t is None else int(t) for k, t in enumerate(targets)]
    for position, target, foil in zip(positions, chosen, foils, strict=True):
        if foil is not None and foil == target:
            raise ValueError(f"foil {foil} is the top prediction at position {position}: the difference would be 0")
    direction, unembed_bias = readout.direction(chosen, list(foils), dtype)
    final = readout.final_norm
    u = direction if final is None else final.pull_back(direction, store["final_scale"].reshape(-1))
    final_bias = _dot(None if final is None else final.bias, direction)
    first = records[0].resid_pre
    assert first is not None  # layer 0 keeps the embedding
    embed = (first.to(dtype) * u).sum(-1)
    per_layer = [_layer_terms(readout, layer, record, u) for layer, record in records.items()]
    stacked = {name: torch.stack([terms[name] for terms in per_layer], dim=1).cpu() for name in per_layer[0]}
    resid = records[max(records)].resid_post
    assert resid is not None  # the last layer keeps the stream the final norm reads
    scale = store["final_scale"].reshape(-1) if "final_scale" in store else None
    wide = torch.promote_types(dtype, resid.dtype)
    float_value = readout.logit(resid, scale, chosen, list(foils), dtype=wide).cpu()
    bounds = readout.rounding_bound(resid, scale, chosen, list(foils), dtype=own.dtype).cpu()
    if own.dtype.itemsize >= 4:
        del stacked["attention_rounding"]  # float rounding of the heads' sum: noise, not a term
    has_b_O = any(record.b_O is not None for record in records.values())
    has = ("b_O", *readout.biases) if has_b_O else readout.biases
    results = []
    for k, (position, target, foil) in enumerate(zip(positions, chosen, foils, strict=True)):
        # The model's own logits are exact in float64: their difference is the model's, unrounded.
        value = own[k, target].double() - (0.0 if foil is None else own[k, foil].double())
        result = LogitAttribution(
            tokens=batch.tokens[0].cpu(),
            str_tokens=batch.str_tokens[0],
            position=position,
            target=target,
            target_token=adapter.token_labels(model, [target])[0],
            foil=foil,
            foil_token=None if foil is None else adapter.token_labels(model, [foil])[0],
            logit=float(float_value[k]),
            **{name: tensor[k] for name, tensor in stacked.items()},
            embed=float(embed[k]),
            final_norm_bias=float(final_bias[k]),
            unembed_bias=float(unembed_bias[k]),
            has_biases=has,
            softcap=readout.softcap,
            model_value=float(value),
        )
        _check_total(readout, result, float(bounds[k]), own.dtype)
        results.append(result)
    return results


def logit_attribution(
    model: adapter.Model,
    text: str | Tensor,
    target: TokenLike | None = None,
    foil: TokenLike | None = None,
    position: int = -1,
    *,
    prepend_bos: bool | None = None,
    dtype: torch.dtype | str = torch.float32,
) -> LogitAttribution:
    """Split the logit of ``target`` at ``position`` (or ``logit(target) - logit(foil)``) into exact signed terms.

    Every layer, head and key gets ``alpha_ij^h <vt_j^h, u_l>``; the embedding, every MLP, ``b_O``,
    the norms' biases and the unembedding bias get the rest, and all of them add up to the model's
    own value (see the module's docstring for the maths and what is frozen).

    Args:
        model: a decoder ``TransformerBridge`` with an LM head.
        text: one text (tokenised as the model does, see ``prepend_bos``) or token ids ``[pos]``.
        target: the token whose logit is explained, as a one-token string (``" Mary"``) or an id;
            None: the model's top prediction at ``position``.
        foil: a token to contrast with ("why Mary and not John"): the difference is explained.
        position: the position whose next-token prediction is explained (negative: from the end).
        prepend_bos: prepend the tokenizer's BOS to a text; None: the model's own choice
            (``cfg.default_prepend_bos``).
        dtype: accumulation dtype of the terms: ``torch.float32``, or ``torch.float64`` for a tighter
            sum, or its name (`contribution_lens.decomposition.accumulation_dtype`).

    Example:
        >>> import contribution_lens as cl
        >>> model = cl.load_model()
        >>> result = cl.logit_attribution(model, "The capital of France is")
        >>> result.target_token, result.by_head().shape
        (' Paris', (30, 9))
    """
    dtype = accumulation_dtype(dtype)
    readout = check_decoder(model)
    target_id = None if target is None else token_id(model, target, "target", readout)
    foil_id = None if foil is None else token_id(model, foil, "foil", readout)
    if foil_id is not None and foil_id == target_id:
        raise ValueError(f"foil {foil!r} is the target: logit(target) - logit(foil) would be 0 by definition")
    batch = one_text(model, text, prepend_bos)
    index = as_position(position, batch.tokens.shape[1])
    return attribute_positions(model, batch, [index], [target_id], [foil_id], dtype=dtype, readout=readout)[0]
