"""Logit attribution: the terms add up to the float readout of the logit, each key's term is alpha <vt, u>."""

import dataclasses
import json
import tempfile
import warnings
from pathlib import Path

import pytest
import torch

import architectures
import contribution_lens as cl
from conftest import VARIANTS, assert_close, tiny_bridge, tiny_encoder
from contribution_lens import adapter
from contribution_lens.analyses import logit_attribution as logit_attribution_module
from contribution_lens.analyses.logit_attribution import LogitAttribution, attribute_positions

ARCHS = [pytest.param(v, b, id=f"{v}-{'bias' if b else 'nobias'}") for v in VARIANTS for b in (False, True)]
IOI = "When Mary and John went to the store, John gave a drink to"
IDS = torch.tensor([1, 5, 7, 9, 3, 2, 11, 4])


def assert_adds_up(result: LogitAttribution, rtol: float = 1e-4) -> None:
    table = result.to_dataframe()
    total = float(table["value"].sum())
    assert abs(total - result.logit) <= rtol * max(1.0, abs(result.logit)), (total, result.logit)
    assert abs(result.total() - total) <= 1e-6 * max(1.0, abs(total))


def model_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(ids[None])[0]


def reference_terms(model, ids: torch.Tensor, position: int, target: int, foil: int | None) -> dict:
    """Float64 oracle from a full cache: materialise every head's ``alpha_ij vt_j`` and read it with the frozen norm."""
    _, cache = model.run_with_cache(ids[None])
    W_U = model.unembed.W_U.detach().double()
    u = W_U[:, target] - (0 if foil is None else W_U[:, foil])
    ln = model.ln_final
    x = cache["ln_final.hook_in"][0, position].double()
    scale = cache["ln_final.hook_scale"][0, position].double().reshape(())
    weight, bias = ln.original_component.weight.detach().double(), ln.original_component.bias.detach().double()
    # The oracle's own frozen LayerNorm reproduces the model's final norm output at this position.
    normed = (x - x.mean()) / scale * weight + bias
    assert_close(normed, cache["ln_final.hook_out"][0, position].double(), rtol=1e-5, atol=1e-5)
    read = weight * u
    read = (read - read.mean()) / scale  # <(x - mean) w / s, u> = <x, centre(w u) / s>
    per_key = []
    for layer in range(model.cfg.n_layers):
        pattern = cache[adapter.pattern_hook(layer)][0, :, position].double()  # [head key]
        v = cache[adapter.value_hook(layer)][0].double()  # [key kv_head d_head]
        W_O = model.blocks[layer].attn.W_O.detach().double()
        group = pattern.shape[0] // v.shape[1]
        vt = torch.stack([v[:, h // group] @ W_O[h] for h in range(pattern.shape[0])])  # [head key d_model]
        per_key.append(pattern[..., None] * vt @ read)  # [head key]
    return {
        "attention": torch.stack(per_key),
        "embed": float(cache["blocks.0.hook_resid_pre"][0, position].double() @ read),
    }


@pytest.mark.parametrize(("variant", "biases"), ARCHS)
def test_every_key_term_is_alpha_vt_read_through_the_frozen_final_norm(variant: str, biases: bool) -> None:
    model = tiny_bridge(variant, biases=biases)
    result = cl.logit_attribution(model, IDS, target=4, foil=7, position=6)
    expected = reference_terms(model, IDS, 6, 4, 7)
    assert_close(result.attention.double(), expected["attention"], rtol=1e-4, atol=1e-5)
    assert result.embed == pytest.approx(expected["embed"], rel=1e-4, abs=1e-6)
    assert_adds_up(result)
    logits = model_logits(model, IDS)
    assert result.logit == pytest.approx(float(logits[6, 4] - logits[6, 7]), rel=1e-5, abs=1e-6)
    assert ("b_O" in result.has_biases) and ("final_norm" in result.has_biases)


def test_default_target_is_the_top_prediction_and_the_tables_agree() -> None:
    model = tiny_bridge("gqa", biases=True)
    result = cl.logit_attribution(model, IDS)
    logits = model_logits(model, IDS)
    assert result.target == int(logits[-1].argmax()) and result.position == len(IDS) - 1 and result.foil is None
    assert result.logit == pytest.approx(float(logits[-1].max()), rel=1e-5)
    table = result.to_dataframe()
    assert list(table.columns) == ["component", "term", "layer", "head", "key", "key_token", "value"]
    assert set(table["component"]) == {"embed", "attention", "mlp", "bias"}
    attention = table[table["component"] == "attention"]
    by_key = attention.groupby("key")["value"].sum()
    assert_close(torch.tensor(result.by_key().to_numpy()), torch.tensor(by_key.to_numpy()), rtol=1e-6, atol=1e-7)
    by_head = attention.groupby(["layer", "head"])["value"].sum().unstack()
    assert_close(torch.tensor(result.by_head().to_numpy()), torch.tensor(by_head.to_numpy()), rtol=1e-6, atol=1e-7)
    top = result.top(3)
    assert len(top) == 3 and list(top["value"].abs()) == sorted(top["value"].abs(), reverse=True)
    assert top["value"].abs().iloc[0] == table["value"].abs().max()
    assert repr(result).startswith(f"LogitAttribution(logit({result.target_token!r}) = ")


def test_an_earlier_position_sees_only_its_own_keys() -> None:
    model = tiny_bridge("mha")
    result = cl.logit_attribution(model, IDS, target=3, position=2)
    assert bool((result.attention[..., 3:] == 0).all())
    assert list(result.by_key().index) == [0, 1, 2]
    assert_adds_up(result)


def test_save_and_load_round_trip(tmp_path) -> None:
    result = cl.logit_attribution(tiny_bridge("gqa", biases=True), IDS, target=4, foil=9)
    loaded = LogitAttribution.load(result.save(tmp_path / "r.safetensors"))
    assert_close(loaded.attention, result.attention, rtol=0, atol=0)
    assert (loaded.target, loaded.foil, loaded.position, loaded.logit) == (4, 9, result.position, result.logit)
    assert loaded.to_dataframe().equals(result.to_dataframe())
    with pytest.raises(FileNotFoundError):
        LogitAttribution.load(tmp_path / "missing.safetensors")


def test_a_truncated_file_is_named_in_the_error(tmp_path) -> None:
    path = cl.logit_attribution(tiny_bridge("gqa"), IDS, target=4).save(tmp_path / "r.safetensors")
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(
        ValueError, match=rf"^{truncated} is not a LogitAttribution written by LogitAttribution.save \(SafetensorError"
    ):
        LogitAttribution.load(truncated)


def test_figures_draw_the_tables() -> None:
    model = tiny_bridge("gqa")
    result = cl.logit_attribution(model, IDS, target=4)
    figures = result.figures()
    heads = figures["heads"].data[0]
    assert_close(torch.tensor(heads.z), torch.tensor(result.by_head().to_numpy()).float(), rtol=1e-5, atol=1e-6)
    assert heads.zmid == 0
    keys = figures["keys"].data[0]
    assert list(keys.x) == [f"{j}:{result.str_tokens[j]}" for j in range(len(IDS))]
    assert_close(torch.tensor(keys.y), torch.tensor(result.by_key().to_numpy()), rtol=1e-6, atol=1e-7)
    layers = figures["layers"]
    assert [trace.name for trace in layers.data][-1] == "MLP"
    assert_close(torch.tensor(layers.data[-1].y), result.mlp.double(), rtol=1e-6, atol=1e-7)


@pytest.mark.usefixtures("as_a_user")
def test_bad_inputs_are_refused_with_what_was_wrong() -> None:
    model = tiny_bridge("gqa")
    with pytest.raises(ValueError, match=r"target id 50 is outside the model's vocabulary of 50 ids \(0\.\.49\)"):
        cl.logit_attribution(model, IDS, target=50)
    with pytest.raises(ValueError, match=r"position 8 does not exist: the text has 8 tokens \(positions -8\.\.7\)"):
        cl.logit_attribution(model, IDS, position=8)
    with pytest.raises(ValueError, match="foil 4 is the target"):
        cl.logit_attribution(model, IDS, target=4, foil=4)
    with pytest.raises(ValueError, match="is a string, but this model has no tokenizer"):
        cl.logit_attribution(model, IDS, target="a")
    with pytest.raises(TypeError, match="target must be a token string or an integer id, got float"):
        cl.logit_attribution(model, IDS, target=1.5)
    with pytest.raises(ValueError, match="one text at a time; got a batch of 2"):
        cl.logit_attribution(model, torch.stack([IDS, IDS]))
    with pytest.raises(ValueError, match="this model's attention is bidirectional"):
        cl.logit_attribution(tiny_encoder(), IDS)


@pytest.mark.usefixtures("as_a_user")
def test_a_string_that_is_not_one_token_is_refused(bundled_model) -> None:
    with pytest.raises(ValueError) as error:
        cl.logit_attribution(bundled_model, IOI, target=" Mary Poppins")
    assert str(error.value).startswith(
        "target ' Mary Poppins' is 4 tokens for this tokenizer ([' Mary', ' Pop', 'p', 'ins']); "
    )
    assert "give exactly one token" in str(error.value)


def test_the_bundled_model_names_the_indirect_object(bundled_model) -> None:
    result = cl.logit_attribution(bundled_model, IOI, target=" Mary", foil=" John")
    assert_adds_up(result)
    logits = model_logits(bundled_model, cl.to_token_batch(bundled_model, IOI).tokens[0])
    mary, john = (bundled_model.tokenizer.encode(t, add_special_tokens=False)[0] for t in (" Mary", " John"))
    assert result.logit == pytest.approx(float(logits[-1, mary] - logits[-1, john]), rel=1e-5)
    assert result.logit > 0  # the model prefers the indirect object
    keys = result.by_key()
    assert result.str_tokens[int(keys.idxmax())] == " Mary" and int(keys.idxmax()) == 2
    plain = cl.logit_attribution(bundled_model, IOI)
    assert plain.target_token == " Mary"
    assert_adds_up(plain)


def test_copying_a_repeated_sequence_draws_on_its_earlier_occurrence(bundled_model) -> None:
    generator = torch.Generator().manual_seed(0)
    first = torch.randint(1000, 10000, (20,), generator=generator)
    ids = torch.cat([torch.tensor([bundled_model.tokenizer.bos_token_id]), first, first])
    explained = cl.explain_generation(bundled_model, ids[:22], answer=ids[22:])
    table = explained.to_dataframe()
    # Predicting the token at p + 1 in the second copy: its earlier occurrence sits 20 positions back.
    earlier = table["position"] + 1 - 20
    assert (table["top_key"] == earlier).mean() >= 0.5, table
    shares = [step.attribution.by_key()[p + 1 - 20] for step, p in zip(explained, table["position"], strict=True)]
    assert sum(shares) / len(shares) > 1.0


def test_explain_generation_is_one_pass_and_matches_each_position_alone() -> None:
    model = tiny_bridge("gqa", biases=True)
    passes = []
    model.hook_dict["hook_embed"].add_hook(lambda tensor, hook: passes.append(tensor.shape[1]))
    try:
        explained = cl.explain_generation(model, IDS[:5], answer=IDS[5:])
    finally:
        model.hook_dict["hook_embed"].remove_hooks()
    assert passes == [len(IDS)]  # attributions and flows of every step from one pass
    assert [step.token_id for step in explained] == IDS[5:].tolist()
    flows = cl.flow(model, IDS, position=[step.position for step in explained])
    for step in explained:
        alone = cl.logit_attribution(model, IDS, target=step.token_id, position=step.position)
        assert_close(step.attribution.attention, alone.attention, rtol=1e-5, atol=1e-6)
        assert step.attribution.logit == pytest.approx(alone.logit, rel=1e-6)
        assert_adds_up(step.attribution)
        assert step.flow is not None and step.flow.position == step.position
        assert_close(step.flow.rollout, flows.at(step.position).rollout, rtol=1e-5, atol=1e-6)
    assert all(step.flow is None for step in cl.explain_generation(model, IDS[:5], answer=IDS[5:], flow=False))


def test_the_unembedding_reads_only_the_explained_positions() -> None:
    """The product with the vocabulary at every position is a long pass's largest cost: explained rows only."""
    model = tiny_bridge("gqa", biases=True)
    rows = []
    model.hook_dict["unembed.hook_out"].add_hook(lambda tensor, hook: rows.append(tuple(tensor.shape[:2])))
    try:
        result = cl.logit_attribution(model, IDS, target=4, position=3)
        explained = cl.explain_generation(model, IDS[:5], answer=IDS[5:])
    finally:
        model.hook_dict["unembed.hook_out"].remove_hooks()
    assert rows == [(1, 1), (1, len(IDS) - 5)]
    logits = model_logits(model, IDS)
    assert result.logit == pytest.approx(float(logits[3, 4]), rel=1e-5, abs=1e-6)
    assert [step.attribution.logit for step in explained] == pytest.approx(
        [float(logits[p, t]) for p, t in zip(range(4, len(IDS) - 1), IDS[5:].tolist(), strict=True)], rel=1e-5
    )
    assert all(step.flow is not None and step.flow.logits is None for step in explained)


def test_a_pass_reads_the_models_hook_names_as_often_whatever_its_depth(monkeypatch) -> None:
    """A bridge rebuilds ``hook_dict`` (aliases and all) on every read: read per layer, it cost ~3 ms a layer."""
    reads = []
    built = type(tiny_bridge()).hook_dict  # the property, read off the class

    def counted(self):
        reads.append(1)
        return built.fget(self)

    def count(n_layers: int) -> int:
        model = tiny_bridge("gqa", biases=True, n_layers=n_layers)
        monkeypatch.setattr(type(model), "hook_dict", property(counted))
        reads.clear()
        cl.logit_attribution(model, IDS)
        cl.explain_generation(model, IDS[:5], answer=IDS[5:])  # logit attribution and flow in one pass
        monkeypatch.undo()
        return len(reads)

    assert count(2) == count(6)


def test_generation_is_greedy() -> None:
    model = tiny_bridge("mqa")
    explained = cl.explain_generation(model, IDS[:4], max_new_tokens=5, stop_at_eos=False)
    assert len(explained) == 5 and explained.prompt_length == 4
    logits = model_logits(model, explained.tokens)
    for step in explained:
        assert step.token_id == int(logits[step.position].argmax())
        assert step.attribution.target == step.token_id
    figure = explained.figures()["keys"].data[0]
    assert list(figure.y) == [f"{k}:{step.token}" for k, step in enumerate(explained)]
    with pytest.raises(ValueError, match="max_new_tokens must be a positive integer, got 0"):
        cl.explain_generation(model, IDS[:4], max_new_tokens=0)


@pytest.mark.slow
def test_gemma_post_attention_norm_is_linearised_and_the_terms_add_up(gemma) -> None:
    assert adapter.post_attention_norm(gemma, 0) is not None  # ln1_post: hook_attn_out is normed
    result = cl.logit_attribution(gemma, IOI, target=" Mary", foil=" John")
    assert_adds_up(result)
    assert result.str_tokens[int(result.by_key().idxmax())] == " Mary"
    generated = cl.explain_generation(gemma, "Monday, Tuesday, Wednesday,", max_new_tokens=2)
    assert generated[0].token == " Thursday"
    for step in generated:
        assert_adds_up(step.attribution)


TINY = ["GPT2LMHeadModel", "LlamaForCausalLM", "GPTNeoXForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
        "PhiForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", TINY)
def test_the_terms_add_up_on_tiny_checkpoints_of_each_family(name: str, tmp_path) -> None:
    model = cl.load_model(str(architectures.build(name, tmp_path / name)))
    ids = model.tokenizer.encode(architectures.TEXT, return_tensors="pt")[0]
    logits, cache = model.run_with_cache(ids[None], names_filter="unembed.hook_out")
    raw = cache["unembed.hook_out"][0]
    cap = adapter.logit_softcap(model)
    # Gemma 2 caps its output logits; the terms add up to the unembedding's output before the cap.
    assert (cap is not None) == (name == "Gemma2ForCausalLM")
    assert_close(logits[0], raw if cap is None else cap * torch.tanh(raw / cap), rtol=1e-5, atol=1e-5)
    for position, foil in ((-1, None), (4, 7)):
        target = int(raw[position].argmin())
        result = cl.logit_attribution(model, ids, target=target, foil=foil, position=position)
        assert_adds_up(result)
        assert result.softcap == cap
        expected = raw[position, target] - (0 if foil is None else raw[position, foil])
        assert result.logit == pytest.approx(float(expected), rel=1e-4, abs=1e-5), json.dumps(result.has_biases)


def test_an_explaining_pass_reads_the_model_once_through_its_readout(monkeypatch) -> None:
    """The unembedding, the norms, the soft-cap and the hooks come from one `Readout` per call, not from the model
    again for each piece (a bridge rebuilds its hook table on every read)."""
    model = tiny_bridge("gqa", biases=True)
    built = []
    original = adapter.readout

    def counting(model):
        built.append(model)
        return original(model)

    monkeypatch.setattr(adapter, "readout", counting)
    pieces = ("unembedding", "post_attention_norm", "final_hooks", "residual_capture", "flow_capture",
              "captured_post_scale", "attention_update")  # fmt: skip
    for piece in pieces:
        monkeypatch.setattr(adapter, piece, lambda *args, piece=piece: pytest.fail(f"adapter.{piece} was called"))
    cl.logit_attribution(model, IDS, target=3)
    cl.flow(model, IDS)
    cl.explain_generation(model, IDS[:4], answer=[5, 6])
    assert len(built) == 3


def final_stream(model, result: LogitAttribution) -> tuple[torch.Tensor, torch.Tensor]:
    """What the final norm reads at the explained position, and its scale, from a plain pass with two hooks."""
    kept = {}
    at = result.position
    hooks = [
        ("ln_final.hook_in", lambda x, hook: kept.update(x=x[0, at : at + 1].clone())),
        ("ln_final.hook_scale", lambda s, hook: kept.update(s=s[0, at : at + 1, 0].clone())),
    ]
    adapter.forward(model, adapter.to_token_batch(model, result.tokens), hooks)
    return kept["x"], kept["s"]


def test_the_terms_add_up_to_the_float_readout_and_the_gap_is_the_models_own() -> None:
    model = tiny_bridge("gqa", biases=True)
    result = cl.logit_attribution(model, IDS, target=4, foil=9)
    x, scale = final_stream(model, result)
    readout = adapter.readout(model).logit(x, scale, [4], [9], dtype=torch.float32)
    assert result.logit == pytest.approx(float(readout), rel=1e-6)
    own = model_logits(model, IDS)[-1]
    assert result.model_value == pytest.approx(float(own[4] - own[9]), rel=1e-6)
    assert result.rounding_gap == result.model_value - result.logit
    assert result.attention_rounding is None  # float32: the heads' sum is the attention output
    loaded = LogitAttribution.load(result.save(Path(tempfile.mkdtemp()) / "r.safetensors"))
    assert (loaded.model_value, loaded.rounding_gap) == (result.model_value, result.rounding_gap)


def test_in_bfloat16_the_terms_stay_exact_and_the_attention_rounding_is_a_term() -> None:
    model = tiny_bridge("gqa", biases=True).to(torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # within its bound: no warning
        result = cl.logit_attribution(model, IDS, target=4, foil=9)
    x, scale = final_stream(model, result)
    readout = adapter.readout(model)
    assert result.logit == pytest.approx(float(readout.logit(x, scale, [4], [9], dtype=torch.float32)), rel=1e-6)
    assert_adds_up(result, rtol=1e-5)
    own = model_logits(model, IDS)[-1].double()
    assert result.model_value == float(own[4] - own[9])  # as the model rounded it
    bound = float(readout.rounding_bound(x, scale, [4], [9], dtype=torch.bfloat16)[0])
    assert 0 < abs(result.rounding_gap) <= bound
    assert result.attention_rounding is not None and bool(result.attention_rounding.abs().sum() > 0)
    rows = result.to_dataframe().query("component == 'rounding'")
    assert rows["layer"].tolist() == [0, 1] and set(rows["term"]) == {"attention output"}
    assert list(result.by_layer().columns) == ["attention", "attention_bias", "mlp", "attention_rounding"]


def test_a_model_value_beyond_its_rounding_bound_warns_naming_both_numbers() -> None:
    model = tiny_bridge("mha")
    readout = adapter.readout(model)
    # A readout that believes in an unembedding bias the model does not have: terms and readout agree, the model not.
    bias = torch.zeros(model.cfg.d_vocab)
    bias[4] = 0.5
    wrong = dataclasses.replace(readout, b_U=bias)
    batch = adapter.to_token_batch(model, IDS)
    with pytest.warns(RuntimeWarning) as caught:
        (result,) = attribute_positions(model, batch, [7], [4], [None], readout=wrong)
    message = str(caught[0].message)
    assert f"the model computed {result.model_value:.6g}" in message
    assert f"the float readout of its residual stream gives {result.logit:.6g}" in message
    assert "final norm or unembedding may not be read the way the model computes it" in message
    assert result.rounding_gap == pytest.approx(-0.5, abs=1e-5)


def test_terms_that_miss_the_float_readout_are_a_wiring_error(monkeypatch) -> None:
    def off(*args):
        terms = layer_terms(*args)
        return {**terms, "mlp": terms["mlp"] + 1.0}  # a block write the adapter would misread

    layer_terms = logit_attribution_module._layer_terms
    monkeypatch.setattr(logit_attribution_module, "_layer_terms", off)
    with pytest.raises(RuntimeError, match=r"add up to .* but the float readout of the model's residual stream is"):
        cl.logit_attribution(tiny_bridge("mha"), IDS, target=4)


def test_a_pass_that_overflows_is_named_not_taken_for_a_wiring_error() -> None:
    model = tiny_bridge("mha").to(torch.float16)
    with torch.no_grad():
        for weights in (model.ln_final.original_component.weight, model.unembed.original_component.weight):
            weights.mul_(3e4)  # finite weights, logits past float16's 65504
    with pytest.raises(FloatingPointError, match=r"the pass overflowed \(torch.float16 holds at most 65504\)"):
        cl.logit_attribution(model, IDS, target=4)
