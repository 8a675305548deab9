"""Tokens: texts and ids to a right-padded `TokenBatch`, with the model's own BOS convention.

Texts are tokenised as the model's own convention has it: TransformerLens records per model
whether a BOS token is prepended (``cfg.default_prepend_bos``; True for the bundled models, where
BOS is SmolLM2's ``<|im_start|>``, id 1, and position 0 the attention sink; False for Qwen2,
Phi, GPT-NeoX, ...), and ``prepend_bos=True``/``False`` overrides it (`prepends_bos`). Token
tensors are used as given. Batches of texts are right-padded, so causal attention of the real
tokens is the same as for each text alone.
"""

import contextlib
import hashlib
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import einops
import torch
from jaxtyping import Bool, Int
from torch import Tensor

from contribution_lens.adapter._model import Model, _model_device
from contribution_lens.adapter.anatomy import anatomy_of


@dataclass(frozen=True)
class TokenBatch:
    """Tokens of a right-padded batch, with the mask of real positions and string labels."""

    tokens: Int[Tensor, "batch pos"]
    attention_mask: Bool[Tensor, "batch pos"]
    str_tokens: list[list[str]]
    """Per text, one string per real token (padding excluded)."""
    bos_first: bool = True
    """Every text starts with the model's BOS (the attention sink analyses then take position 0)."""

    def __post_init__(self) -> None:
        if self.tokens.shape != self.attention_mask.shape:
            raise ValueError(
                f"tokens {tuple(self.tokens.shape)} and attention_mask {tuple(self.attention_mask.shape)} differ"
            )
        if len(self.str_tokens) != self.tokens.shape[0]:
            raise ValueError(f"{len(self.str_tokens)} token label lists for a batch of {self.tokens.shape[0]}")
        check_labels(self.str_tokens, self.attention_mask)

    @property
    def lengths(self) -> Int[Tensor, " batch"]:
        return self.attention_mask.sum(-1)

    @property
    def padded(self) -> bool:
        return not bool(self.attention_mask.all())


def check_labels(str_tokens: Sequence[Sequence[str]], attention_mask: Tensor) -> None:
    """One string label per real token of every text: labels that do not fit would silently drop rows."""
    lengths = attention_mask.sum(-1).tolist()
    for index, (labels, length) in enumerate(zip(str_tokens, lengths, strict=True)):
        if isinstance(labels, str) or len(labels) != length:
            got = f"a str {labels!r}" if isinstance(labels, str) else f"{len(labels)} labels"
            raise ValueError(f"text {index} has {got} for its {length} real tokens: str_tokens must match the tokens")


def context_length(model: Model) -> int | None:
    return anatomy_of(model).n_ctx


def check_length(model: Model, length: int, what: str) -> None:
    n_ctx = context_length(model)
    if n_ctx is not None and length > n_ctx:
        raise ValueError(f"{what} is {length} tokens long, more than the model's context of {n_ctx} tokens")


def check_token_ids(model: Model, tokens: Tensor) -> None:
    """Every id lies in the model's vocabulary ``[0, d_vocab)``."""
    d_vocab = anatomy_of(model).d_vocab
    if tokens.numel() == 0 or d_vocab is None:
        return
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= int(d_vocab):
        bad = low if low < 0 else high
        raise ValueError(f"token id {bad} is outside the model's vocabulary of {d_vocab} ids (0..{int(d_vocab) - 1})")


def _check_text_ids(model: Model, ids: Tensor, index: int) -> None:
    """A text's ids lie in the model's vocabulary: a tokenizer may hold added tokens the model has no row for."""
    d_vocab = anatomy_of(model).d_vocab
    if d_vocab is None or ids.numel() == 0 or int(ids.max()) < int(d_vocab):
        return
    bad = int(ids.max())
    raise ValueError(
        f"input text {index} holds the token {token_labels(model, [bad])[0]!r} (id {bad}), outside the model's "
        f"vocabulary of {d_vocab} ids (0..{int(d_vocab) - 1}): the tokenizer has tokens the model has no embedding for"
    )


def token_labels(model: Model, ids: Sequence[int]) -> list[str]:
    tokenizer = anatomy_of(model).tokenizer
    if tokenizer is None:
        return [f"<{i}>" for i in ids]
    return [tokenizer.decode([i]) for i in ids]


def start_ids(model: Model) -> set[int]:
    """The ids a text starts with where the tokenizer begins it (BOS, or ``[CLS]`` for BERT-style tokenizers)."""
    return anatomy_of(model).start_ids()


_IDENTITIES: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()


def tokenizer_identity(model: Model) -> str:
    """What token ids mean for ``model``: its vocabulary's size and hash, and the BOS it puts before a text.

    ``"49152 tokens #5c1d3a9e07f2, BOS 1"``: the hash (BLAKE2b, 48 bits) is of every ``(id, token)`` pair of
    the tokenizer's vocabulary, its added tokens included; ``BOS`` is the id texts start with by the model's
    convention (`bos_to_prepend`), or ``none``. A model without a tokenizer reads bare ids:
    ``"no tokenizer, BOS none"``. Two models whose identities are equal read every id list as the same text;
    a task records its tokenizer's (``Task.tokenizer``) so that one built for another model is refused.

    Example:
        >>> from types import SimpleNamespace
        >>> tokenizer_identity(SimpleNamespace(cfg=SimpleNamespace(default_prepend_bos=False), tokenizer=None))
        'no tokenizer, BOS none'
    """
    tokenizer = getattr(model, "tokenizer", None)
    bos = bos_to_prepend(model)
    convention = f"BOS {'none' if bos is None else bos}"
    if tokenizer is None:
        return f"no tokenizer, {convention}"
    try:
        vocabulary = _IDENTITIES.get(tokenizer)
    except TypeError:  # a tokenizer that cannot be weakly referenced: hashed on every call
        vocabulary = None
    if vocabulary is None:
        pairs = sorted((int(i), str(token)) for token, i in tokenizer.get_vocab().items())
        digest = hashlib.blake2b("\n".join(f"{i}\t{token}" for i, token in pairs).encode(), digest_size=6)
        vocabulary = f"{len(pairs)} tokens #{digest.hexdigest()}"
        with contextlib.suppress(TypeError):
            _IDENTITIES[tokenizer] = vocabulary
    return f"{vocabulary}, {convention}"


def pad_id(model: Model) -> int:
    """The id padding is written with: the tokenizer's pad id, else its EOS id, else 0."""
    return anatomy_of(model).pad_id()


def prepends_bos(model: Model, prepend_bos: Any = None) -> bool:
    """Whether texts get the tokenizer's BOS prepended: ``prepend_bos``, or else the model's own choice.

    The model's choice is TransformerLens's ``cfg.default_prepend_bos`` (True where a config has
    none). ``prepend_bos`` must be True, False or None.

    Example:
        >>> from types import SimpleNamespace
        >>> qwen = SimpleNamespace(cfg=SimpleNamespace(default_prepend_bos=False))
        >>> prepends_bos(qwen), prepends_bos(qwen, True)
        (False, True)
    """
    if prepend_bos is None:
        return anatomy_of(model).prepends_bos
    if isinstance(prepend_bos, bool) or str(getattr(prepend_bos, "dtype", "")) in ("bool", "torch.bool"):
        if getattr(prepend_bos, "ndim", 0) == 0:
            return bool(prepend_bos)
    raise TypeError(
        "prepend_bos must be True, False or None (None: the model's own choice, cfg.default_prepend_bos), "
        f"got {type(prepend_bos).__name__} {prepend_bos!r}"
    )


def bos_to_prepend(model: Model, prepend_bos: Any = None) -> int | None:
    """The BOS id to put before token sequences built by hand (chunks, items), or None for none.

    None where `prepends_bos` says no BOS (``prepend_bos``, else the model's own choice) or the
    tokenizer has no BOS; ``prepend_bos=True`` on a tokenizer without one is refused.
    """
    wanted = prepends_bos(model, prepend_bos)
    bos = anatomy_of(model).bos_id()
    if wanted and bos is None and prepend_bos:
        raise ValueError("prepend_bos=True, but this model's tokenizer has no BOS token (bos_token_id is None)")
    return bos if wanted else None


def to_token_batch(
    model: Model,
    inputs: str | Sequence[str] | Tensor,
    *,
    attention_mask: Tensor | None = None,
    prepend_bos: bool | None = None,
) -> TokenBatch:
    """Tokenise text(s) as the model does (BOS or not) with right padding, or wrap a token tensor.

    Args:
        inputs: one text, a list of texts, or token ids ``[pos]`` / ``[batch pos]``.
        attention_mask: only with token ids: 1 for real tokens, 0 for padding.
        prepend_bos: prepend the tokenizer's BOS to texts; None: the model's own choice
            (``cfg.default_prepend_bos``, `prepends_bos`). Token ids are never changed.
    """
    bos = prepends_bos(model, prepend_bos)
    device = _model_device(model)
    if device.type == "meta":
        raise ValueError(
            "the model's weights are on the meta device (a model built without its weights): "
            "load it with contribution_lens.load_model or move real weights onto it"
        )
    if isinstance(inputs, Tensor):
        tokens = _checked_ids(inputs)
        check_length(model, tokens.shape[1], "the token sequence")
        if attention_mask is not None:
            attention_mask = _checked_mask(attention_mask, tokens.shape)
        real_ids = tokens if attention_mask is None else tokens[attention_mask.reshape(tokens.shape).bool()]
        check_token_ids(model, real_ids)
        if attention_mask is None:
            mask = torch.ones_like(tokens, dtype=torch.bool)
        else:
            mask = attention_mask.reshape(tokens.shape).to(torch.bool)
            if not bool(mask[:, 0].all()):
                raise ValueError("attention_mask marks position 0 as padding: pad on the right")
            if bool((mask[:, 1:] & ~mask[:, :-1]).any()):
                raise ValueError("attention_mask is not right-padded (a real token follows padding)")
        labels = [token_labels(model, row[m].tolist()) for row, m in zip(tokens, mask, strict=True)]
        starts = set(tokens[:, 0].tolist())
        return TokenBatch(tokens.to(device), mask.to(device), labels, bos_first=starts <= start_ids(model))

    if attention_mask is not None:
        raise ValueError("attention_mask is only accepted with token ids; texts are padded here")
    texts = [inputs] if isinstance(inputs, str) else list(inputs)
    if not texts:
        raise ValueError("no input texts given")
    if anatomy_of(model).tokenizer is None:
        raise ValueError("this model has no tokenizer: pass token ids instead of text")
    rows = []
    for index, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"input {index} is a {type(text).__name__}, not a str")
        if not text.strip():
            raise ValueError(f"input text {index} is empty")
        ids = model.to_tokens(text, prepend_bos=bos, truncate=False)[0]
        check_length(model, ids.shape[0], f"input text {index}")
        _check_text_ids(model, ids, index)
        rows.append(ids.to(device))
    return replace(pad_rows(model, rows), bos_first=bos)


def _checked_ids(inputs: Tensor) -> Int[Tensor, "batch pos"]:
    """Token ids as ``[batch pos]`` int64: any integer dtype is read, bool, floats and meta tensors are refused."""
    if inputs.is_meta:
        raise ValueError("token ids are on the meta device: they have a shape but no values")
    if inputs.dtype == torch.bool:
        raise ValueError(
            "token ids must be integers, got a bool tensor (an attention mask? pass it as attention_mask=)"
        )
    if inputs.dtype.is_floating_point or inputs.dtype.is_complex:
        raise ValueError(f"token ids must be an integer tensor [pos] or [batch pos], got dtype {inputs.dtype}")
    tokens = einops.rearrange(inputs, "pos -> 1 pos") if inputs.ndim == 1 else inputs
    if tokens.ndim != 2:
        raise ValueError(f"token ids must be an integer tensor [pos] or [batch pos], got {tuple(inputs.shape)}")
    if tokens.shape[0] == 0 or tokens.shape[1] == 0:
        raise ValueError(f"token tensor is empty: shape {tuple(tokens.shape)}")
    # uint8, int16, int32 ids are ids all the same; the embedding takes int64.
    return tokens.long()


def _checked_mask(attention_mask: Tensor, shape: torch.Size) -> Tensor:
    if not isinstance(attention_mask, Tensor):
        raise TypeError(f"attention_mask must be a tensor [batch pos], got {type(attention_mask).__name__}")
    if attention_mask.is_meta:
        raise ValueError("attention_mask is on the meta device: it has a shape but no values")
    if attention_mask.numel() != shape.numel():
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, the token ids {tuple(shape)}")
    return attention_mask.reshape(shape)


def pad_rows(model: Model, rows: Sequence[Tensor]) -> TokenBatch:
    """Right-pad token sequences of different lengths into one batch."""
    if not rows:
        raise ValueError("no token sequences given")
    device = _model_device(model)
    length = max(row.shape[0] for row in rows)
    check_length(model, length, "the longest token sequence")
    tokens = torch.full((len(rows), length), pad_id(model), dtype=torch.long, device=device)
    mask = torch.zeros((len(rows), length), dtype=torch.bool, device=device)
    for index, row in enumerate(rows):
        tokens[index, : row.shape[0]] = row
        mask[index, : row.shape[0]] = True
    return TokenBatch(tokens, mask, [token_labels(model, row.tolist()) for row in rows])
