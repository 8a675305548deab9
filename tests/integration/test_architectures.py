"""Every architecture TransformerLens 4.3's bridge supports, loaded by ``cl.load_model`` from a tiny random checkpoint.

For each name of ``SUPPORTED_ARCHITECTURES``, `architectures.build` writes a 2-layer checkpoint with
transformers' own classes (nothing is downloaded) and `architectures.EXPECTED` says what must happen:

* works: every fact the adapter's wiring reads of the model is the one its modules probed before it
  read them once (``tests/probes.py``); on every layer the weights sum to 1 (per query over heads and keys
  in the inter scope, per head and query in the intra scope), ``sum_h z^h W_O^h + b_O`` reconstructs the hook the
  adapter reads as the o-projection output, ``hook_z`` is ``pattern @ v``, the decomposition
  agrees with the float64 oracle of ``tests/reference.py``, and a pattern edit reaches that output
  (or, where the bridge fires ``hook_pattern`` after making the output, is refused);
* refused: ``load_model`` raises `UnsupportedModelError` with the exact message naming it and why;
* skipped: nothing can be built here, and the skip says why.

The whole file takes one to four minutes on a shared 2-core CPU, by load (nothing in it is marked slow).
"""

import json
import re

import pytest
import torch
from transformer_lens.factories.architecture_adapter_factory import SUPPORTED_ARCHITECTURES

import architectures
import contribution_lens as cl
import probes
from contribution_lens import adapter, loading

EXPECTED = architectures.EXPECTED


def names(kind: str) -> list[str]:
    return [name for name, expected in EXPECTED.items() if expected.kind == kind]


def test_every_supported_architecture_has_an_expectation() -> None:
    assert list(EXPECTED) == list(SUPPORTED_ARCHITECTURES)
    counts = {kind: len(names(kind)) for kind in ("works", "refused", "skipped")}
    assert sum(counts.values()) == len(SUPPORTED_ARCHITECTURES) == 162
    for name, expected in EXPECTED.items():
        assert expected.kind == "works" or expected.reason, f"{name} is {expected.kind} without a reason"


def load(name: str, tmp_path) -> object:
    if name == architectures.NATIVE:
        return architectures.native_bridge()
    return cl.load_model(str(architectures.build(name, tmp_path / name)))


@pytest.mark.parametrize("name", names("works"))
def test_works(name: str, tmp_path) -> None:
    model = load(name, tmp_path)
    # Every fact the adapter's wiring reads is the one its modules probed (`probes`), read before any pass.
    found = probes.differences(probes.probed_facts(model), probes.read_facts(model))
    assert found == probes.corrected(name)
    inputs = architectures.native_tokens() if name == architectures.NATIVE else architectures.TEXT
    measured = architectures.measure(model, inputs)
    assert measured.n_layers == architectures.N_LAYERS == model.cfg.n_layers
    assert measured.output_hook == "blocks.0.attn.o.hook_out"
    assert measured.sums < 1e-5, measured
    assert measured.reconstruction < 1e-5, measured
    assert measured.z < 1e-5, measured
    assert measured.oracle < 1e-10, measured
    assert measured.engine < 1e-5, measured
    if name in architectures.PATTERN_AFTER_OUTPUT:
        assert measured.edited is None, f"{name} now takes pattern edits: update PATTERN_AFTER_OUTPUT"
    else:
        assert measured.edited is not None and measured.edited < 1e-5, measured


def test_loading_a_multimodal_model_installs_nothing(tmp_path, monkeypatch) -> None:
    # TransformerLens 4.3 runs `pip install torchvision` when a multimodal processor does not load.
    import subprocess

    calls = []
    monkeypatch.setattr(subprocess, "check_call", lambda *args, **kwargs: calls.append(args))
    name = "LlavaOnevisionForConditionalGeneration"
    model = cl.load_model(str(architectures.build(name, tmp_path / name)))
    assert calls == [] and model.cfg.n_layers == architectures.N_LAYERS


@pytest.mark.parametrize("name", names("refused"))
def test_refused(name: str, tmp_path) -> None:
    folder = architectures.build(name, tmp_path / name)
    with pytest.raises(loading.UnsupportedModelError) as error:
        cl.load_model(str(folder))
    assert str(error.value) == EXPECTED[name].message


@pytest.mark.parametrize("name", names("skipped"))
def test_skipped(name: str) -> None:
    pytest.skip(f"{name}: {EXPECTED[name].reason}")


# --- the refusals' exact texts, and what the adapter reads ------------------------------------


def test_roberta_boots_as_its_masked_lm_and_is_bidirectional(tmp_path) -> None:
    """The issue's case: RobertaForCausalLM, which the bridge rejects, is no longer chosen."""
    model = cl.load_model(str(architectures.build("RobertaForMaskedLM", tmp_path / "roberta")))
    assert type(model.original_model).__name__ == "RobertaForMaskedLM"
    assert model.cfg.attention_dir == "bidirectional"


@pytest.mark.parametrize(
    ("name", "head"),
    [
        ("RobertaForMaskedLM", "RobertaForMaskedLM"),
        ("BertForMaskedLM", "BertForMaskedLM"),
        ("LlamaForCausalLM", "LlamaForCausalLM"),
        ("BloomForCausalLM", "BloomForCausalLM"),
    ],
)
def test_a_config_without_architectures_gets_the_bridged_head(name: str, head: str, tmp_path) -> None:
    """As GGUF-derived configs have it: the head is chosen from the model type."""
    folder = architectures.build(name, tmp_path / name)
    config = json.loads((folder / "config.json").read_text())
    del config["architectures"]
    (folder / "config.json").write_text(json.dumps(config))
    assert type(cl.load_model(str(folder)).original_model).__name__ == head


def test_an_architecture_the_bridge_lacks_is_refused_naming_what_transformers_offers(tmp_path) -> None:
    folder = architectures.build("AlbertForMaskedLM", tmp_path / "albert")
    with pytest.raises(loading.UnsupportedModelError) as error:
        cl.load_model(str(folder))
    assert str(error.value) == (
        "contribution-lens cannot analyse AlbertForMaskedLM (model type 'albert'): TransformerLens's bridge "
        "supports none of the classes transformers offers for it (AlbertForMaskedLM)"
    )


def test_a_bad_config_of_a_known_model_type_is_not_called_remote_code(tmp_path) -> None:
    folder = architectures.build("LlamaForCausalLM", tmp_path / "llama")
    config = json.loads((folder / "config.json").read_text())
    config["num_attention_heads"] = 5  # 64 is not divisible by 5
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception) as error:  # transformers' own validation error, passed on
        cl.load_model(str(folder))
    assert not isinstance(error.value, loading.UnsupportedModelError)
    assert "The hidden size (64) is not a multiple of the number of attention heads (5)" in str(error.value)


def test_mamba_refusal_text(tmp_path) -> None:
    with pytest.raises(loading.UnsupportedModelError) as error:
        cl.load_model(str(architectures.build("MambaForCausalLM", tmp_path / "mamba")))
    assert str(error.value) == (
        "contribution-lens cannot analyse MambaForCausalLM (model type 'mamba'): it has no attention layers "
        "(a state-space or recurrent model): there is no attention pattern to decompose"
    )


def test_t5_refusal_text(tmp_path) -> None:
    with pytest.raises(loading.UnsupportedModelError) as error:
        cl.load_model(str(architectures.build("T5ForConditionalGeneration", tmp_path / "t5")))
    assert str(error.value) == (
        "contribution-lens cannot analyse T5ForConditionalGeneration (model type 't5'): it is an encoder-decoder "
        "model: the bridge splits it into encoder and decoder stacks that need decoder inputs, and "
        "contribution-lens analyses one stack of blocks fed token ids"
    )


def test_remote_code_refusal_text(tmp_path) -> None:
    import transformers

    with pytest.raises(loading.UnsupportedModelError) as error:
        cl.load_model(str(architectures.build("InternLM2ForCausalLM", tmp_path / "internlm2")))
    assert str(error.value) == (
        f"contribution-lens cannot analyse InternLM2ForCausalLM: transformers {transformers.__version__} has no "
        "class for model type 'internlm2' (its code ships with the checkpoint, and load_model does not run a "
        "checkpoint's own code)"
    )


# Every model type loading.py refuses from its config is refused by the check after boot too
# (adapter.attention_problem), with one of these reasons.
AFTER_BOOT = (
    r"its bridge has no attention pattern on any layer \(no blocks\.\{l\}\.attn\.hook_pattern and hook_v\)",
    r"its bridge has no attention pattern on layers \[0\] of 2 \(no blocks\.\{l\}\.attn\.hook_pattern and hook_v\)",
    r"on a probe input, layer 0: hook_z differs from pattern @ v by [0-9.e+-]+ \(relative\): the heads' outputs "
    r"are changed \(gated or normalised\) before the o-projection, which would make contribution weights wrong",
    r"its TransformerLens bridge fails on a forward pass \(.+\)",
    r"its TransformerLens bridge cannot wrap it \(.+\)",
    r"its TransformerLens bridge needs a package that is not installed \(.+\)",
)


@pytest.mark.parametrize(
    "name", [name for name in names("refused") if architectures.model_type(name) in loading._REFUSED_TYPES]
)
def test_the_check_after_boot_refuses_it_too(name: str, tmp_path, monkeypatch) -> None:
    folder = architectures.build(name, tmp_path / name)
    monkeypatch.delitem(loading._REFUSED_TYPES, architectures.model_type(name))
    with pytest.raises(loading.UnsupportedModelError) as error:
        cl.load_model(str(folder))
    prefix = re.escape(f"contribution-lens cannot analyse {name} (model type {architectures.model_type(name)!r}): ")
    assert any(re.fullmatch(prefix + reason, str(error.value)) for reason in AFTER_BOOT), str(error.value)


def test_the_check_after_boot_names_a_hybrids_attention_free_layers(tmp_path, monkeypatch) -> None:
    folder = architectures.build("Qwen3NextForCausalLM", tmp_path / "qwen3next")
    monkeypatch.delitem(loading._REFUSED_TYPES, "qwen3_next")
    with pytest.raises(loading.UnsupportedModelError) as error:
        cl.load_model(str(folder))
    assert str(error.value) == (
        "contribution-lens cannot analyse Qwen3NextForCausalLM (model type 'qwen3_next'): its bridge has no "
        "attention pattern on layers [0] of 2 (no blocks.{l}.attn.hook_pattern and hook_v)"
    )


def test_the_check_after_boot_measures_a_gate(tmp_path, monkeypatch) -> None:
    folder = architectures.build("AfmoeForCausalLM", tmp_path / "afmoe")
    monkeypatch.delitem(loading._REFUSED_TYPES, "afmoe")
    with pytest.raises(loading.UnsupportedModelError) as error:
        cl.load_model(str(folder))
    assert str(error.value) == (
        "contribution-lens cannot analyse AfmoeForCausalLM (model type 'afmoe'): on a probe input, layer 0: "
        "hook_z differs from pattern @ v by 0.62 (relative): the heads' outputs are changed (gated or "
        "normalised) before the o-projection, which would make contribution weights wrong"
    )


def test_multi_head_latent_attention_values_and_z_are_read_per_head(tmp_path) -> None:
    """DeepSeek-V3's bridge fires hook_v heads first and hook_z split by the rotary width (8), not 24."""
    model = cl.load_model(str(architectures.build("DeepseekV3ForCausalLM", tmp_path / "dsv3")))
    tokens = cl.to_token_batch(model, architectures.TEXT).tokens
    _, cache = model.run_with_cache(tokens)
    n = tokens.shape[1]
    assert cache[adapter.value_hook(0, model)].shape == (1, 4, n, 24)
    assert cache[adapter.z_hook(0)].shape == (1, n, 12, 8)
    seen = cl.map_layers(model, tokens, lambda layer: (tuple(layer.v.shape), tuple(layer.z.shape)))
    assert seen[0] == ((1, n, 4, 24), (1, n, 4, 24))
    # attention_geometry on a cache reads the same layout.
    from_cache = cl.attention_geometry(model, cache, tokens=tokens)
    live = cl.attention_geometry(model, tokens)
    torch.testing.assert_close(from_cache[0].contribution, live[0].contribution, rtol=1e-4, atol=1e-6)


def test_gemma4_values_are_read_after_v_norm_and_the_wide_global_layer_splits(tmp_path) -> None:
    model = cl.load_model(str(architectures.build("Gemma4ForCausalLM", tmp_path / "gemma4")))
    assert adapter.value_hook(0, model) == "blocks.0.attn.v_norm.hook_out"
    W_O = [adapter.output_weights(model, layer)[0] for layer in range(2)]
    # Layer 1 is global: 32-dim heads against cfg.d_head 16 (the bridge's W_O refuses to split it).
    assert [tuple(w.shape) for w in W_O] == [(4, 16, 64), (4, 32, 64)]


def test_an_edit_on_a_bridge_that_fires_the_pattern_late_is_refused(tmp_path) -> None:
    """BERT's bridge delegates attention to transformers and fires hook_pattern after the output."""
    model = cl.load_model(str(architectures.build("BertForMaskedLM", tmp_path / "bert")))
    with pytest.raises(RuntimeError) as error:
        cl.map_layers(model, architectures.TEXT, lambda layer: None, edit=lambda layer, pattern, v: pattern)
    assert str(error.value) == (
        "hook_pattern of layer 0 fires after the attention output: an edited pattern would not change this "
        "model's output"
    )


def test_value_zeroing_zeroes_keys_where_multi_head_latent_attention_puts_them(tmp_path, monkeypatch) -> None:
    from contribution_lens.methods import value_zeroing as peers

    v = torch.ones(2, 4, 5, 3)  # [variant head key d_head], as the MLA bridge fires hook_v
    zeroed = peers._zero_values(torch.tensor([1, 3]), key_dim=2)(v, None)
    assert zeroed[0, :, 1].abs().sum() == 0 and zeroed[1, :, 3].abs().sum() == 0
    assert zeroed.sum() == v.sum() - 2 * 4 * 3
    model = cl.load_model(str(architectures.build("DeepseekV3ForCausalLM", tmp_path / "dsv3")))
    assert [adapter.value_key_dim(model, layer) for layer in range(2)] == [2, 2]
    batch = cl.to_token_batch(model, architectures.TEXT)
    scores = peers.value_zeroing_scores(model, batch, [0, 1])
    # Keys indexed along the head dimension instead (the positions-first layout): 11 keys, 4 heads.
    monkeypatch.setattr(adapter, "value_key_dim", lambda model, layer: 1)
    with pytest.raises(IndexError):
        peers.value_zeroing_scores(model, batch, [0, 1])
    for layer, rows in scores.items():
        torch.testing.assert_close(rows.sum(-1), torch.ones_like(rows.sum(-1)), msg=f"layer {layer}")


@pytest.mark.parametrize("name", ["LlamaForCausalLM", "DeepseekV3ForCausalLM", "Qwen2_5_VLForConditionalGeneration"])
def test_a_build_is_the_same_every_run(name: str, tmp_path) -> None:
    from safetensors.torch import load_file

    first, second = (load_file(architectures.build(name, tmp_path / run) / "model.safetensors") for run in "ab")
    assert first.keys() == second.keys() and len(first) > 10
    assert all(torch.equal(first[key], second[key]) for key in first)
