"""Checks of the command line's arguments, run before any model is loaded.

Each check takes the option's name and the value given, returns the value in the form the run
uses, and raises :class:`UsageError` with one line ``--option: expected ..., got ...``. Only the
standard library is imported here at module level; checks that need the package import it
inside.
"""

import json
import os
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

BUNDLED = "smollm2-135m"  # loading.BUNDLED, ENCODER and GEMMA, repeated so that --help imports nothing heavy
BUNDLED_NAMES = (BUNDLED, "minilm-l6", "gemma3-270m")
NAMES = ", ".join(map(repr, BUNDLED_NAMES))


class UsageError(ValueError):
    """A mistake in the command line; the message says what to fix."""


def _expected(option: str, expected: str, got: Any, why: str = "") -> UsageError:
    return UsageError(f"{option}: expected {expected}, got {got!r}" + (f" ({why})" if why else ""))


def at_least(option: str, value: int, minimum: int = 1) -> int:
    """``value`` if it is ``>= minimum``.

    Example:
        >>> at_least("--max-chunks", -1)
        Traceback (most recent call last):
        ...
        contribution_lens._cli_checks.UsageError: --max-chunks: expected a positive integer, got -1
    """
    if value < minimum:
        raise _expected(option, "a positive integer" if minimum == 1 else f"an integer >= {minimum}", value)
    return value


def ratios(option: str, text: str) -> tuple[float, ...]:
    """Comma-separated removal ratios, each in [0, 1)."""
    expected = "comma-separated numbers in [0, 1)"
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise _expected(option, expected, text) from None
    if not values or any(not 0 <= r < 1 for r in values):
        raise _expected(option, expected, text)
    return values


def choose(option: str, text: str, names: Sequence[str], *, all_means: Sequence[str] | None = None) -> tuple[str, ...]:
    """A comma-separated subset of ``names`` (``all`` = ``all_means`` when that is given)."""
    if all_means is not None and text.strip() == "all":
        return tuple(all_means)
    chosen = tuple(x.strip() for x in text.split(",") if x.strip())
    unknown = [x for x in chosen if x not in names]
    if not chosen or unknown:
        prefix = "'all' or " if all_means is not None else ""
        raise _expected(option, f"{prefix}a comma-separated subset of {', '.join(names)}", text)
    return chosen


def data_specs(option: str, specs: Sequence[str], known: Sequence[str]) -> tuple[str, ...]:
    """``NAME=PATH`` (a known NAME and an existing path) or a bare ``NAME`` (a packaged or HF set)."""
    for spec in specs:
        name, sep, path = (part.strip() for part in spec.partition("="))
        if not name or (sep and not path):
            raise _expected(option, "NAME=PATH or NAME", spec)
        if sep and name.lower() not in known:
            raise _expected(option, f"NAME=PATH with NAME one of {', '.join(known)}", spec)
        if sep and not Path(path).exists():
            raise _expected(option, "NAME=PATH with an existing file or folder", spec, f"{path} does not exist")
    return tuple(specs)


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


def integers(option: str, text: str) -> tuple[int, ...]:
    """Comma-separated integers."""
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise _expected(option, "comma-separated integers", text) from None
    if not values:
        raise _expected(option, "comma-separated integers", text)
    return values


def layers(option: str, values: Sequence[int], model: str) -> tuple[int, ...]:
    """Layers of ``model``, negative ones counted from the end; read from its config, not its weights."""
    total = n_layers(model)
    for layer in values:
        if not -total <= layer < total:
            raise _expected(option, f"a layer from {-total} to {total - 1} ({model} has {total} layers)", layer)
    return tuple(layer % total for layer in values)


def model(option: str, name: str) -> str:
    """A model whose config can be read (the bundled one, a checkpoint folder or a Hugging Face id)."""
    n_layers(name)
    return name


@lru_cache
def n_layers(model: str) -> int:
    """The number of layers of ``model``, from its config file; no weight is read."""
    config = _model_config(model)
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
        # A chunked GGUF has no readable header until joined: dequantise once (load_model would).
        checkpoint = loading._dequantised_checkpoint(name) / "config.json"
        return json.loads(checkpoint.read_text(encoding="utf-8"))
    gguf = loading.bundled_gguf()
    checkpoint = loading._checkpoint_for(gguf) / "config.json"
    if checkpoint.is_file():
        return json.loads(checkpoint.read_text(encoding="utf-8"))
    from gguf import GGUFReader  # the header only; the weights stay on disk

    field = GGUFReader(gguf).fields["llama.block_count"]
    return {"num_hidden_layers": int(field.parts[field.data[0]][0])}
