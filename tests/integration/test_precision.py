"""The bundled models in half precision (and float64): every analysis accumulates in float32 whatever the dtype.

A model loaded with ``dtype=torch.bfloat16`` (half the memory: what an 8B model on a GPU uses) or
``torch.float16`` gives its own half-precision activations; the weights, mixings and payloads made
from them are float32 sums of those numbers, so they add up as in float32 (to about 1e-6), not to
the weights' rounding (2e-3 in bfloat16). Explanations are exact against the float readout of the
model's own residual stream, and the model's own value differs from it by its rounding
(``rounding_gap``), within `contribution_lens.adapter.Readout.rounding_bound`. A short text and a
few layers keep each test small.
"""

import base64
import warnings

import numpy as np
import pytest
import torch

import architectures
import contribution_lens as cl
from conftest import assert_close
from contribution_lens import adapter, faithfulness, loading
from contribution_lens.views.inspector import codecs, windows
from reference import reference_contributions

pytestmark = pytest.mark.slow

TEXT = "When Mary and John went to the store, John gave a drink to"
HALF = ["bfloat16", "float16"]


@pytest.fixture(scope="module", params=HALF)
def half(request: pytest.FixtureRequest):
    """The bundled SmolLM2 in a half-precision dtype (one load per dtype for the module)."""
    try:
        model = cl.load_model(dtype=request.param)
    except ModuleNotFoundError as error:  # pragma: no cover - depends on the install
        pytest.skip(f"bundled model unavailable: {error}")
    assert next(model.parameters()).dtype == getattr(torch, request.param)
    return model


@pytest.mark.usefixtures("as_a_user")
def test_a_dtype_that_is_not_floating_is_refused_before_any_weight_is_read(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(loading, "_load", lambda *a, **k: pytest.fail("weights were read"))
    names = "torch.float32, torch.float16, torch.bfloat16, torch.float64 (or its name, e.g. 'bfloat16')"
    for dtype in (torch.int64, torch.float8_e4m3fn, "float8", "cuda", 32, None):
        with pytest.raises(ValueError) as error:
            cl.load_model(dtype=dtype)
        assert str(error.value) == f"dtype must be a floating torch dtype: {names}, got {dtype!r}"
    assert loading.check_dtype("bfloat16") is torch.bfloat16 and loading.check_dtype("torch.float64") is torch.float64


def test_a_dtype_given_by_name_loads_the_weights_in_it(tmp_path) -> None:
    folder = architectures.build("Qwen2ForCausalLM", tmp_path / "tiny-qwen2")
    model = cl.load_model(str(folder), dtype="float64")
    assert next(model.parameters()).dtype == torch.float64
    d = cl.attention_geometry(model, architectures.TEXT, layers=[0])[0]
    assert d.attention.dtype == torch.float64  # float64 weights are accumulated in float64


def test_weights_add_up_as_in_float32_and_match_the_float64_oracle(half) -> None:
    seen = {}

    def keep(layer):
        seen[layer.layer] = (layer.pattern.clone(), layer.v.clone(), layer.W_O.clone())

    cl.map_layers(half, TEXT, keep, layers=[0, 29])
    for scope in ("inter", "intra"):
        geometry = cl.attention_geometry(half, TEXT, layers=[0, 29], scope=scope)
        for layer, d in geometry.items():
            assert d.attention.dtype == torch.float32
            rows = d.sum_over_heads().sum(-1) if scope == "inter" else d.contribution.sum(-1)
            assert_close(rows, torch.ones_like(rows), rtol=0, atol=1e-5)
            oracle = reference_contributions(*seen[layer], scope)  # float64, from the model's own half tensors
            assert_close(d.contribution, oracle["contribution"].float(), rtol=1e-3, atol=1e-5)
    table = cl.layer_summary(half, TEXT, layers=[0, 29])
    assert table.notna().all().all()


def test_sink_parts_add_up(half) -> None:
    heads = cl.sink_analysis(half, TEXT, layers=[3]).head_table()
    parts = heads["intra_sink_contribution"] + heads["intra_tail_contribution"]
    assert_close(torch.tensor(parts.to_numpy()), torch.ones(len(parts), dtype=torch.float64), rtol=0, atol=1e-5)


def test_flow_rows_sum_to_one(any_dtype) -> None:
    f = cl.flow(any_dtype, TEXT)
    for layer in (0, 15, 29):
        rows = f.mixing[layer].sum(-1)
        assert_close(rows, torch.ones_like(rows), rtol=0, atol=1e-5)
    assert_close(f.rollout.sum(-1), torch.ones(30), rtol=0, atol=1e-5)
    assert len(f.graph()) > 0


def test_the_inspectors_payload_is_the_librarys(half) -> None:
    inspector = cl.inspect(half, TEXT, layer=3)
    sent = inspector.payload
    totals = codecs.dequantise(np.frombuffer(base64.b64decode(sent["all_total_inter"]), dtype="<f4"), "exact")
    np.testing.assert_allclose(totals, 1, atol=1e-5)
    d = cl.attention_geometry(half, TEXT, layers=[3])[3]
    window = inspector.window
    drawn = np.frombuffer(base64.b64decode(sent["attention"]), dtype="<u2")
    library = codecs.quantise_attention(windows.cut(d.attention[0], window)).ravel()
    assert drawn.shape == library.shape
    assert np.abs(drawn.astype(int) - library.astype(int)).max() <= 1  # one code of slack, as in float32


def test_a_tiny_faithfulness_run(half, tmp_path) -> None:
    source = tmp_path / "notes.txt"
    source.write_text(" ".join([TEXT] * 12), encoding="utf-8")
    settings = faithfulness.Settings(methods=("attention", "contribution"), ratios=(0.0, 0.2), modes=("sufficiency",))
    data = faithfulness.DataSettings(data=(f"text={source}",), chunk_length=24, max_chunks=2, batch_size=2)
    run = faithfulness.run(half, settings, data, tmp_path / "run", progress=False)
    frame = run.frame
    assert np.isfinite(frame["nll"]).all() and len(frame) > 0
    clean = frame[frame["ratio"] == 0.0]
    np.testing.assert_allclose(clean["nll"], clean["clean"], rtol=1e-5)  # ratio 0: the hooks change nothing


def final_stream(model, tokens: torch.Tensor, position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the final norm reads at ``position``, and its scale, from a plain pass with two hooks."""
    kept = {}
    hooks = [
        ("ln_final.hook_in", lambda x, hook: kept.update(x=x[0, position : position + 1].clone())),
        ("ln_final.hook_scale", lambda s, hook: kept.update(s=s[0, position : position + 1, 0].clone())),
    ]
    adapter.forward(model, adapter.to_token_batch(model, tokens), hooks)
    return kept["x"], kept["s"]


def check_exact(model, result: cl.LogitAttribution) -> None:
    """The terms add up to the float readout of the stream; the gap is the model's value less it, within its bound."""
    dtype = next(model.parameters()).dtype
    wide = torch.promote_types(dtype, torch.float32)
    x, scale = final_stream(model, result.tokens, result.position)
    readout = adapter.readout(model)
    foils = [result.foil]
    value = float(readout.logit(x, scale, [result.target], foils, dtype=wide)[0])
    assert result.logit == pytest.approx(value, rel=1e-5, abs=1e-6)
    assert abs(result.total() - value) <= 1e-4 * max(1.0, abs(value))
    assert result.model_value is not None and result.rounding_gap == result.model_value - result.logit
    bound = float(readout.rounding_bound(x, scale, [result.target], foils, dtype=dtype)[0])
    assert abs(result.rounding_gap) <= bound
    if dtype.itemsize == 2:  # the model's own value carries its rounding, and the attention outputs' is a term
        assert result.rounding_gap != 0 and result.attention_rounding is not None
    else:
        assert result.attention_rounding is None


def explain(model):
    return cl.explain_generation(model, "The capital of France is", max_new_tokens=2)


@pytest.fixture(scope="module", params=[*HALF, "float64"])
def any_dtype(request: pytest.FixtureRequest):
    """The bundled SmolLM2 in bfloat16, float16 and float64 (one load per dtype for the module)."""
    return cl.load_model(dtype=request.param)


@pytest.fixture
def no_rounding_warning():
    """A rounding gap over its bound warns: in these tests it fails."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        yield


@pytest.mark.usefixtures("no_rounding_warning")
def test_logit_attribution_is_exact_against_the_float_readout(any_dtype, tmp_path) -> None:
    result = cl.logit_attribution(any_dtype, TEXT, target=" Mary", foil=" John")
    check_exact(any_dtype, result)
    with torch.inference_mode():
        own = any_dtype(result.tokens[None])[0, result.position].double()
    dtype = next(any_dtype.parameters()).dtype
    # The model's value is its own: the logits it gives in a plain pass, up to one rounding of them.
    ulp = torch.finfo(dtype).eps * max(abs(float(own[result.target])), abs(float(own[result.foil])))
    assert abs(result.model_value - float(own[result.target] - own[result.foil])) <= ulp
    assert result.str_tokens[int(result.by_key().idxmax())] == " Mary"
    bars = {bar.name: bar for bar in result.figures()["layers"].data}
    if result.attention_rounding is not None:  # the layers figure draws the rounding term
        np.testing.assert_allclose(bars["attention's rounding"].y, result.attention_rounding.double().numpy())
    else:
        assert "attention's rounding" not in bars
    loaded = cl.LogitAttribution.load(result.save(tmp_path / "r.safetensors"))
    assert (loaded.logit, loaded.model_value, loaded.rounding_gap) == (
        result.logit,
        result.model_value,
        result.rounding_gap,
    )


@pytest.mark.usefixtures("no_rounding_warning")
def test_every_step_of_an_explained_answer_is_exact(any_dtype, tmp_path) -> None:
    answer = explain(any_dtype)
    assert len(answer) == 2
    for step in answer:
        check_exact(any_dtype, step.attribution)
        assert (step.model_value, step.rounding_gap) == (step.attribution.model_value, step.attribution.rounding_gap)
    table = answer.to_dataframe()
    np.testing.assert_allclose(table["rounding_gap"], table["model_value"] - table["logit"], rtol=0, atol=1e-12)
    loaded = cl.GenerationExplanation.load(answer.save(tmp_path / "answer.safetensors"))
    assert [s.rounding_gap for s in loaded] == [s.rounding_gap for s in answer]


@pytest.mark.usefixtures("no_rounding_warning")
def test_the_prediction_views_parts_add_up_to_the_logit(half) -> None:
    answer = explain(half)
    sent = cl.inspect(half, answer).steps["steps"]
    for shown, step in zip(sent, answer, strict=True):
        result = step.attribution
        assert sum(shown["parts"].values()) == pytest.approx(result.logit, rel=1e-5)
        assert shown["parts"]["rounding"] == pytest.approx(float(result.attention_rounding.double().sum()))
        assert shown["parts"]["rounding"] != 0 and shown["model_value"] == result.model_value
        assert shown["logit"] == result.logit


@pytest.fixture(scope="module")
def gemma_half():
    return cl.load_model("gemma3-270m", dtype=torch.bfloat16)


@pytest.mark.usefixtures("no_rounding_warning")
def test_gemma_in_bfloat16_is_exact_against_the_float_readout(gemma_half) -> None:
    for text in (TEXT, "The capital of France is"):
        result = cl.logit_attribution(gemma_half, text)
        check_exact(gemma_half, result)


def test_gemma_in_float16_overflows_and_says_so() -> None:
    model = cl.load_model("gemma3-270m", dtype=torch.float16)
    with pytest.raises(FloatingPointError, match=r"the pass overflowed \(torch.float16 holds at most 65504\); load"):
        cl.logit_attribution(model, TEXT)
