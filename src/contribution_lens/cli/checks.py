"""The command line's checks that are not a setting's own: the output folder, the device, the model.

A settings class checks its own values (`contribution_lens._settings`); what only the command
line knows is checked here, before any model is loaded: the output folder can be written, the
device exists, the model's config can be read, and layers (from that config, no weight read)
exist. Each check takes the option's name and the value given, returns the value in the form the
run uses, and raises `UsageError` with one line ``--option: expected ..., got ...``. Only the
standard library is imported here at module level; checks that need the package import it
inside.

Example:
    >>> out_folder("--out", "/proc/version")
    Traceback (most recent call last):
    ...
    contribution_lens.cli.checks.UsageError: --out: expected a folder, got '/proc/version' (an existing file)
"""

import json
import os
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

BUNDLED = "smollm2-135m"  # loading.BUNDLED, ENCODER, GEMMA and QWEN, repeated so that --help imports nothing heavy
BUNDLED_NAMES = (BUNDLED, "minilm-l6", "gemma3-270m", "qwen2.5-0.5b")
NAMES = ", ".join(map(repr, BUNDLED_NAMES))


class UsageError(ValueError):
    """A mistake in the command line; the message says what to fix."""


def _expected(option: str, expected: str, got: Any, why: str = "") -> UsageError:
    return UsageError(f"{option}: expected {expected}, got {got!r}" + (f" ({why})" if why else ""))


def out_folder(option: str, out: str) -> Path:
    """A folder that exists or can be created: not a file, below a writable folder."""
    folder = Path(out)
    if folder.exists() and not folder.is_dir():
        raise _expected(option, "a folder", out, "an existing file")
    ancestor = folder.absolute()
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise _expected(option, "a folder that can be created", out, f"{ancestor} is a file")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise _expected(option, "a folder that can be written", out, f"no permission to write in {ancestor}")
    return folder


def device(option: str, name: str | None) -> str | None:
    """A device torch can use here (None lets TransformerLens choose)."""
    if name is None:
        return None
    import torch

    try:
        parsed = torch.device(name)
    except RuntimeError:
        raise _expected(option, "a torch device such as cpu, cuda or cuda:1", name) from None
    available = {
        "cpu": 1,
        "cuda": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "mps": int(torch.backends.mps.is_available()),
    }.get(parsed.type)
    if available is None:
        return name  # another backend: torch will say
    if available == 0:
        raise _expected(option, "a device that is available", name, f"torch finds no {parsed.type} device")
    if parsed.index is not None and parsed.index >= available:
        raise _expected(option, f"a {parsed.type} index below {available}", name, f"{available} device(s) found")
    return name


def text_protocols(option: str, protocols: Sequence[str], choice_data: Sequence[str]) -> tuple[str, ...]:
    """Protocols that take every data set given: a text-only one (``prediction``) refuses multiple choice."""
    from contribution_lens.faithfulness.registry import PROTOCOLS

    text_only = [name for name in protocols if PROTOCOLS[name].text_only]
    if text_only and choice_data:
        raise _expected(
            option,
            f"a protocol that takes multiple-choice data (--data {choice_data[0]})",
            ",".join(text_only),
            "it explains one next-token prediction of a text",
        )
    return tuple(protocols)


def layers(option: str, values: Sequence[int], model: str) -> tuple[int, ...]:
    """Layers of ``model``, negative ones counted from the end; read from its config, not its weights."""
    total = n_layers(model)
    for layer in values:
        if not -total <= layer < total:
            raise _expected(option, f"a layer from {-total} to {total - 1} ({model} has {total} layers)", layer)
    return tuple(layer % total for layer in values)


def context(option: str, length: int, model: str) -> int:
    """A length of at most ``model``'s context, read from its config (no weight is read)."""
    limit = context_length(model)
    if limit is not None and length > limit:
        raise _expected(option, f"at most {model}'s context of {limit} tokens", length)
    return length


@lru_cache
def context_length(model: str) -> int | None:
    """The longest input ``model`` takes, from its config; None where the config does not say."""
    for config in _configs(model):
        for key in ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "context_length"):
            if isinstance(config.get(key), int):
                return int(config[key])
    return None


def _configs(model: str) -> list[dict[str, Any]]:
    """The model's config, then the language model's where it nests one (``text_config``: Gemma 3, Llava, ...)."""
    config = _model_config(model)
    nested = [
        config[key] for key in ("text_config", "language_config", "llm_config") if isinstance(config.get(key), dict)
    ]
    return [config, *nested]


def model(option: str, name: str) -> str:
    """A model whose config can be read (the bundled one, a checkpoint folder or a Hugging Face id)."""
    n_layers(name)
    return name


@lru_cache
def n_layers(model: str) -> int:
    """The number of layers of ``model``, from its config file; no weight is read."""
    for config in _configs(model):
        for key in ("num_hidden_layers", "n_layer", "num_layers", "n_layers"):
            if isinstance(config.get(key), int):
                return int(config[key])
    raise _expected("--model", "a model whose config gives its number of layers", model)


def _model_config(model: str) -> dict[str, Any]:
    if model in BUNDLED_NAMES:
        return _bundled_config(model)
    folder = Path(model)
    if (folder / "config.json").is_file():
        return json.loads((folder / "config.json").read_text(encoding="utf-8"))
    if folder.exists() or model.startswith((".", "/", "~")):
        raise _expected("--model", f"{NAMES}, a checkpoint folder or a Hugging Face id", model, "no config.json")
    try:
        from transformers import AutoConfig

        return dict(AutoConfig.from_pretrained(model).to_dict())
    except (OSError, ValueError) as error:
        why = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise _expected("--model", f"{NAMES}, a checkpoint folder or a Hugging Face id", model, why) from None


def _bundled_config(name: str) -> dict[str, Any]:
    from contribution_lens import loading

    if name == loading.ENCODER:
        return json.loads((loading.bundled_encoder_dir() / "config.json").read_text(encoding="utf-8"))
    if name != BUNDLED:
        # A chunked GGUF has no readable header until joined: its cached checkpoint's, else the joined header.
        return loading.bundled_config(name)
    gguf = loading.bundled_gguf()
    checkpoint = loading._checkpoint_for(gguf) / "config.json"
    if checkpoint.is_file():
        return json.loads(checkpoint.read_text(encoding="utf-8"))
    from gguf import GGUFReader  # the header only; the weights stay on disk

    fields = GGUFReader(gguf).fields

    def number(key: str) -> int:
        return int(fields[key].parts[fields[key].data[0]][0])

    return {"num_hidden_layers": number("llama.block_count"), "max_position_embeddings": number("llama.context_length")}
