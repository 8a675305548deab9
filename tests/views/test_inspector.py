"""The inspector's Python side: the widget model sends the selected layer's numbers, the page stays light."""

import base64
import json
import re

import numpy as np
import pytest
import torch
import traitlets

import contribution_lens as cl
from conftest import tiny_bridge, tiny_encoder
from contribution_lens.drawing import plot
from contribution_lens.views import inspector as ins
from contribution_lens.views.inspector import caches, codecs, compact, widget, windows


def codes(payload: dict, name: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(payload[name]), dtype="<u2")


def library_codes(model, ids, layer: int, window: windows.Window) -> dict[str, np.ndarray]:
    """What the payload must hold, from `cl.attention_geometry` (float32)."""
    by_scope = {s: cl.attention_geometry(model, ids, layers=[layer], scope=s)[layer] for s in cl.SCOPES}
    cut = {name: windows.cut(tensor[0], window) for name, tensor in [
        ("attention", by_scope["inter"].attention), ("cosine_inter", by_scope["inter"].cosine),
        ("cosine_intra", by_scope["intra"].cosine)]}  # fmt: skip
    return {
        "attention": codecs.quantise_attention(cut["attention"]).ravel(),
        "cosine_inter": codecs.quantise_cosine(cut["cosine_inter"]).ravel(),
        "cosine_intra": codecs.quantise_cosine(cut["cosine_intra"]).ravel(),
    }


def assert_payload(inspector, model, ids, layer: int) -> None:
    assert inspector.payload["layer"] == layer
    want = library_codes(model, ids, layer, inspector.window)
    for name, expected in want.items():
        got = codes(inspector.payload, name)
        assert got.shape == expected.shape, name
        # One code of slack: float rounding in the hooks vs the library's own pass.
        assert np.abs(got.astype(int) - expected.astype(int)).max() <= 1, name


def test_a_larger_window_late_in_the_text_is_drawn_whole_and_sends_the_rest_of_each_row() -> None:
    # Failed before: tokens=16 at start 10 of 20 tokens kept the clipped window 10..19 (nothing redrawn).
    model = tiny_bridge("gqa", biases=True, n_layers=3)
    ids = torch.randint(0, 50, (1, 20), generator=torch.Generator().manual_seed(0))
    inspector = cl.inspect(model, ids, layer=1, tokens=8, start=10)
    assert inspector.meta["outside"] == [[1, 9]]
    sent = {
        name: codecs.decode(inspector.payload[name], "exact").reshape(4, -1)
        for name in ("outside_attention", "outside_inter")
    }
    d = cl.attention_geometry(model, ids, layers=[1], scope="inter")[1]
    outside = list(range(1, 10))
    for head in range(4):
        for row, query in enumerate(inspector.window.queries):
            want_a = float(d.attention[0, head, query, outside].sum())
            want_c = float(d.contribution[0, head, query, outside].sum())
            assert sent["outside_attention"][head, row] == pytest.approx(want_a, abs=1e-6)
            assert sent["outside_inter"][head, row] == pytest.approx(want_c, abs=1e-6)
    inspector.tokens = 16
    assert inspector.start == 4 and inspector.window.queries == list(range(4, 20))
    assert inspector.meta["queries"] == list(range(4, 20)) and inspector.meta["outside"] == [[1, 3]]
    inspector.tokens = 20
    assert inspector.start == 0 and inspector.meta["outside"] == []
    assert not codecs.decode(inspector.payload["outside_attention"], "exact").any()


def test_widget_traits_select_what_is_sent() -> None:
    model = tiny_bridge("gqa", biases=True, n_layers=3)
    ids = torch.randint(0, 50, (1, 20), generator=torch.Generator().manual_seed(0))
    inspector = cl.inspect(model, ids, layer=1, tokens=8, start=10)
    assert inspector.window.queries == list(range(10, 18)) and inspector.window.keys == [0, *range(10, 18)]
    assert inspector.meta["key_labels"][1].startswith("10:") and inspector.query == 17
    assert_payload(inspector, model, ids, 1)
    assert repr(inspector) == (
        "Inspector(L1, all heads, contribution (inter), query 17; tokens 10..17 of 20); "
        "display it, or .write_html(path)"
    )
    inspector.layer = 2
    assert_payload(inspector, model, ids, 2)
    # Head, factor and scope are drawn by the front-end from the payload already sent.
    sent = dict(inspector.payload)
    inspector.head, inspector.factor, inspector.scope = 3, "cosine", "intra"
    assert inspector.payload == sent
    inspector.start = 0
    assert inspector.meta["queries"] == list(range(8)) and inspector.query == 7
    assert_payload(inspector, model, ids, 2)
    with pytest.raises(traitlets.TraitError, match="unknown factor 'norm'"):
        inspector.factor = "norm"
    with pytest.raises(traitlets.TraitError, match=re.escape("head 4 does not exist: -1 (all heads) or 0..3")):
        inspector.head = 4
    with pytest.raises(traitlets.TraitError, match=re.escape("layer 5 is not among the inspected layers [0, 1, 2]")):
        inspector.layer = 5
    with pytest.raises(ValueError, match="start 20 is outside the text of 20 tokens"):
        cl.inspect(model, ids, start=20)


def test_widget_sends_plotly_once_on_request(monkeypatch) -> None:
    inspector = cl.inspect(tiny_bridge("mha"), torch.arange(6))
    sent = []
    monkeypatch.setattr(inspector, "send", sent.append)
    inspector._on_message(inspector, {"type": "need_plotly"}, [])
    assert len(sent) == 1 and sent[0]["type"] == "plotly" and "plotly.js v" in sent[0]["source"]
    assert "Plotly" in inspector._esm and "need_plotly" in inspector._esm


def test_bidirectional_models_show_every_pair() -> None:
    model = tiny_encoder("mha")
    ids = torch.arange(6)
    inspector = cl.inspect(model, ids, layer=0)
    assert inspector.window.cells == 36 and inspector.meta["causal"] is False
    assert_payload(inspector, model, ids, 0)
    # Future keys carry weight in an encoder: the payload has them.
    attention = codecs.dequantise_attention(codes(inspector.payload, "attention")).reshape(4, 6, 6)
    assert attention[:, 0, 1:].sum() > 0.1


@pytest.mark.slow
def test_static_page_of_every_layer_at_512_tokens_is_under_50_mb(bundled_model) -> None:
    text = " ".join(["The quick brown fox jumps over the lazy dog."] * 60)
    ids = cl.to_token_batch(bundled_model, text).tokens[:, :512]
    inspector = cl.inspect(bundled_model, ids)
    first = json.dumps({"meta": inspector.meta, "payload": inspector.payload})
    # 128 x 128 cells of 9 heads, plus the KV-group and per-query total arrays that hide_sink and group_kv draw
    # (all heads' and each KV group's relative norm and contribution in float32: 1.62 MB, 1.27 MB in float16).
    assert len(first) < 1_700_000, f"first widget payload {len(first)} bytes"
    html = inspector.render_html(tokens=512)  # compact: the fine codecs would take about 290 MB
    assert len(html.encode()) <= 50_000_000, f"{len(html.encode()) / 1e6:.1f} MB"
    data = json.loads(re.search(r"class='cl-data'>(.*?)</script>", html).group(1).replace("<\\/", "</"))
    assert sorted(map(int, data["layers"])) == list(range(30)) and data["meta"]["initial"]["query"] == 511
    window = windows.token_window(512, tokens=512)
    got = compact.decode_compact(data["layers"]["29"], window)
    truth = cl.attention_geometry(bundled_model, ids, layers=[29], scope="intra")[29]
    assert (
        np.abs(got["attention"] - windows.cut(truth.attention[0], window)).max()
        <= codecs.COMPACT_ATTENTION_ERROR + 1e-7
    )
    assert np.abs(got["cosine_intra"] - windows.cut(truth.cosine[0], window)).max() <= 0.05


BAD_VALUES = [
    ("start", 300, "start 300 is outside the text of 20 tokens (0..19)"),
    ("start", -1, "start -1 is outside the text of 20 tokens (0..19)"),
    ("tokens", 0, "tokens must be a positive integer, got 0"),
    ("layer", 5, "layer 5 is not among the inspected layers [0, 1, 2]"),
    ("head", 9, "head 9 does not exist: -1 (all heads) or 0..3"),
    ("query", 3, "query 3 is not in the token window 10..17: set start first"),
    ("factor", "norm", "unknown factor 'norm'; expected one of"),
    ("scope", "outer", "unknown scope 'outer'; expected one of"),
]


@pytest.fixture(scope="module")
def gqa_inspector():
    model = tiny_bridge("gqa", biases=True, n_layers=3)
    ids = torch.randint(0, 50, (1, 20), generator=torch.Generator().manual_seed(0))
    return model, ids, cl.inspect(model, ids, layer=1, tokens=8, start=10)


@pytest.mark.parametrize(("name", "value", "message"), BAD_VALUES, ids=[f"{n}={v}" for n, v, _ in BAD_VALUES])
def test_bad_values_are_refused_before_anything_changes(gqa_inspector, monkeypatch, name, value, message) -> None:
    _, _, inspector = gqa_inspector
    before = {key: getattr(inspector, key) for key in ("layer", "head", "factor", "scope", "query", "start", "tokens")}
    sent, shown = dict(inspector.payload), dict(inspector.meta)
    with pytest.raises(ins.InspectorError, match=re.escape(message)) as refused:
        setattr(inspector, name, value)
    assert isinstance(refused.value, ValueError) and isinstance(refused.value, traitlets.TraitError)
    assert inspector.error.startswith(message)
    after = {key: getattr(inspector, key) for key in before}
    assert after == before and inspector.payload == sent and inspector.meta == shown
    # From the front-end: no exception in the kernel, the reason in `error`, the kept value sent back.
    resent = []
    inspector.error = ""
    monkeypatch.setattr(inspector, "send_state", lambda key=None: resent.append(key))
    inspector.set_state({name: value})
    assert inspector.error.startswith(message) and getattr(inspector, name) == before[name]
    assert [name] in resent
    # A good change clears the reason.
    inspector.head = 1 if inspector.head != 1 else 2
    assert inspector.error == ""


def test_a_bad_keyword_is_refused_before_the_model_runs(monkeypatch) -> None:
    model = tiny_bridge("mha")
    monkeypatch.setattr(caches, "compute_windows", lambda *a, **k: pytest.fail("the model ran"))
    with pytest.raises(ins.InspectorError, match=re.escape("start 300 is outside the text of 6 tokens")):
        cl.inspect(model, torch.arange(6), start=300)
    with pytest.raises(ins.InspectorError, match="head 7 does not exist"):
        cl.inspect(model, torch.arange(6), head=7)


def test_every_layer_and_window_is_ready_after_the_first_view(monkeypatch) -> None:
    model = tiny_bridge("gqa", biases=True, n_layers=3)
    ids = torch.randint(0, 50, (1, 20), generator=torch.Generator().manual_seed(1))
    passes = []
    original = caches.compute_windows
    monkeypatch.setattr(caches, "compute_windows", lambda *a, **k: passes.append(1) or original(*a, **k))
    inspector = cl.inspect(model, ids, layer=0, tokens=8)
    assert len(passes) == 1
    for layer, start in [(2, 0), (1, 4), (2, 12), (0, 8), (2, 12)]:  # the windows the front-end offers
        inspector.start, inspector.layer = start, layer
        assert_payload(inspector, model, ids, layer)
    assert len(passes) == 1, "a layer or window switch ran the model again"
    inspector.tokens = 5  # a new size is one more pass
    assert_payload(inspector, model, ids, 2) and len(passes) == 2


def dequantised(payload_: dict, name: str) -> np.ndarray:
    dtype = {"attention": "<u2", "cosine": "<u2", "half": "<f2", "exact": "<f4"}[payload_["codecs"][name]]
    return codecs.dequantise(np.frombuffer(base64.b64decode(payload_[name]), dtype=dtype), payload_["codecs"][name])


def test_kv_groups_and_the_totals_hide_sink_needs(gqa_inspector) -> None:
    model, ids, inspector = gqa_inspector
    inspector.layer, inspector.start = 1, 10
    window, sent = inspector.window, inspector.payload
    assert inspector.meta["kv_groups"] == [[0, 1], [2, 3]] == sent["kv_groups"]
    d = cl.attention_geometry(model, ids, layers=[1], scope="inter")[1]
    attention = windows.cut(d.attention[0], window)
    contribution = windows.cut(d.contribution[0], window)
    group_attention = dequantised(sent, "group_attention").reshape(2, -1)
    np.testing.assert_allclose(group_attention, attention.reshape(2, 2, -1).mean(1), atol=4e-5)
    group_contribution = dequantised(sent, "group_contribution_inter").reshape(2, -1)
    np.testing.assert_allclose(group_contribution, contribution.reshape(2, 2, -1).sum(1), rtol=2e-3, atol=1e-4)
    # Totals cover every key, those left of the window included: the weights of a query sum to 1.
    totals = dequantised(sent, "total_inter").reshape(4, -1)
    np.testing.assert_allclose(totals.sum(0), 1, atol=1e-5)
    np.testing.assert_allclose(dequantised(sent, "all_total_inter"), 1, atol=1e-5)
    np.testing.assert_allclose(totals, d.contribution[0].sum(-1)[:, window.queries].numpy(), atol=1e-5)
    # Hidden sink: the other keys keep the row's total; key 0 is not drawn.
    full = d.contribution[0].sum(0).numpy()
    hidden = plot.hide_sink(full, full.sum(-1))
    assert np.isnan(hidden[:, 0]).all() and np.isnan(hidden[0]).all()
    np.testing.assert_allclose(np.nansum(hidden[1:], -1), 1, atol=1e-5)
    np.testing.assert_allclose(hidden[5, 1:6] / hidden[5, 1], full[5, 1:6] / full[5, 1], rtol=1e-5)
    for name in ("hide_sink", "group_kv"):
        setattr(inspector, name, True)
        assert inspector.payload == sent, "drawn by the front-end from what was sent"
        setattr(inspector, name, False)


def test_all_heads_carry_the_precision_of_one_head(gqa_inspector) -> None:
    # Failed before: all heads' relative norm and contribution were sent as float16, 2^-11 relative (about 3e-4
    # off where a head's contribution is within 1.2e-5): now float32, as the library combined them.
    model, ids, inspector = gqa_inspector
    inspector.layer, inspector.start = 1, 10
    sent = inspector.payload
    for scope in cl.SCOPES:
        d = cl.attention_geometry(model, ids, layers=[1], scope=scope)[1]
        combined = d.token_factors()
        for factor in ("relative_norm", "contribution"):
            name = f"all_{factor}_{scope}"
            assert sent["codecs"][name] == "exact", name
            want = windows.cut(combined[factor][0], inspector.window)
            np.testing.assert_allclose(dequantised(sent, name), want, rtol=2e-6, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("variant", ["mha", "gqa", "mqa"])
def test_compact_page_is_within_its_stated_bounds_and_opens_on_the_last_query(variant) -> None:
    model = tiny_bridge(variant, biases=True, n_layers=2)
    ids = torch.randint(0, 50, (1, 24), generator=torch.Generator().manual_seed(2))
    inspector = cl.inspect(model, ids, layer=1, tokens=10, start=9)
    inspector.query = 12
    html = inspector.render_html(compact=True)
    data = json.loads(re.search(r"class='cl-data'>(.*?)</script>", html).group(1).replace("<\\/", "</"))
    assert data["meta"]["initial"]["query"] == 18 and data["meta"]["compact"] is True
    window = inspector.window
    for layer in (0, 1):
        sent = data["layers"][str(layer)]
        got = compact.decode_compact(sent, window)
        raw = compact.unpack_compact(sent)
        by_scope = {s: cl.attention_geometry(model, ids, layers=[layer], scope=s)[layer] for s in cl.SCOPES}
        truth = windows.cut(by_scope["inter"].attention[0], window)
        assert np.abs(got["attention"] - truth).max() <= codecs.COMPACT_ATTENTION_ERROR + 1e-7
        n_heads, nq, nk = truth.shape[0], len(window.queries), len(window.keys)
        rows, columns = np.nonzero(window.mask)
        key_scale = raw["key_scales"].reshape(n_heads, nk)[:, columns]
        for scope in cl.SCOPES:
            query_scale = raw[f"query_{scope}_scales"].reshape(n_heads, nq)[:, rows]
            bound = compact.cosine_error_bound(query_scale, key_scale, sent["d_head"])
            error = np.abs(got[f"cosine_{scope}"] - windows.cut(by_scope[scope].cosine[0], window))
            assert (error <= bound + 1e-6).all(), f"{scope}: {error.max()} beyond {bound.max()}"
            assert error.max() > 0, "the codes are lossy: a zero error means the test compares the codes to themselves"


def test_widget_answers_the_front_ends_ping(monkeypatch) -> None:
    # The front-end says "no kernel" when a ping goes unanswered for 4 s; a live kernel answers at once.
    inspector = cl.inspect(tiny_bridge("mha"), torch.arange(6))
    sent = []
    monkeypatch.setattr(inspector, "send", sent.append)
    inspector._on_message(inspector, {"type": "ping"}, [])
    assert sent == [{"type": "pong"}]


def test_every_codec_takes_a_read_only_array_without_a_warning() -> None:
    """A pandas column's array is read-only (the prediction view sends `by_head().to_numpy()`)."""
    import warnings

    values = np.linspace(-0.9, 0.9, 7)
    frozen = values.copy()
    frozen.setflags(write=False)
    for codec in codecs.CODECS:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            codes = codecs.quantise(frozen, codec)
        np.testing.assert_array_equal(codes, codecs.quantise(values, codec))


# --- explained predictions: the step control and the prediction view --------------------------------


def exact(b64: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(b64), dtype="<f4")


@pytest.fixture(scope="module")
def explained():
    model = tiny_bridge("gqa", biases=True, n_layers=3)
    ids = torch.randint(0, 50, (14,), generator=torch.Generator().manual_seed(3))
    return model, cl.explain_generation(model, ids, max_new_tokens=4, stop_at_eos=False)


def test_an_explained_answer_opens_on_its_prediction_with_every_steps_terms(explained) -> None:
    model, answer = explained
    inspector = cl.inspect(model, answer, layer=1)
    assert (inspector.view, inspector.step, inspector.query) == ("prediction", 0, answer[0].position)
    sent = inspector.steps
    assert sent["labels"] == inspector.meta["key_labels"] and (sent["n_layers"], sent["n_heads"]) == (3, 4)
    assert [s["position"] for s in sent["steps"]] == [step.position for step in answer]
    for shown, step in zip(sent["steps"], answer, strict=True):
        result = step.attribution
        assert shown["token"] == step.token and shown["quantity"] == result.quantity
        np.testing.assert_allclose(exact(shown["heads"]), result.by_head().to_numpy().ravel(), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(exact(shown["keys"]), result.by_key().to_numpy(), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(exact(shown["rollout"]), step.flow.rollout[-1][: step.position + 1], atol=1e-7)
        assert sum(shown["parts"].values()) == pytest.approx(result.logit, rel=1e-4, abs=1e-5)
    # Two steps explain two different logits: what the view draws differs.
    assert sent["steps"][0]["heads"] != sent["steps"][1]["heads"]


def test_a_step_moves_the_query_and_the_window_to_its_position(explained) -> None:
    model, answer = explained
    inspector = cl.inspect(model, answer, tokens=6)  # 18 tokens in half-overlapping windows of 6
    first = answer[0].position
    assert first in inspector.window.queries and inspector.query == first
    inspector.start = 0  # a window without the answer
    inspector.step = 3
    assert inspector.query == answer[3].position and inspector.start == 12
    assert inspector.payload["key"].startswith(inspector.window.key)  # the payload follows the window
    inspector.query = 15  # the query is free afterwards: the step stays
    assert inspector.step == 3 and inspector.view == "prediction"


def test_a_head_opens_its_per_layer_view_at_the_steps_position(explained, monkeypatch) -> None:
    model, answer = explained
    inspector = cl.inspect(model, answer, tokens=6)
    inspector.query = answer[0].position - 1
    inspector.show_step(0, layer=2, head=3)  # the step is unchanged: the query still moves back
    assert (inspector.view, inspector.layer, inspector.head, inspector.query) == ("heatmap", 2, 3, answer[0].position)
    assert inspector.payload["layer"] == 2
    # The front-end's click is a custom message; a refused one names the reason and changes nothing.
    inspector._on_message(inspector, {"type": "open", "step": 2, "layer": 1, "head": 0}, [])
    assert (inspector.step, inspector.layer, inspector.head, inspector.query) == (2, 1, 0, answer[2].position)
    before = (inspector.step, inspector.layer, inspector.head, inspector.view)
    inspector._on_message(inspector, {"type": "open", "step": 1, "layer": 7, "head": 0}, [])
    assert inspector.error.startswith("layer 7 is not among the inspected layers")
    assert (inspector.step, inspector.layer, inspector.head, inspector.view) == before


def test_the_export_figure_of_the_prediction_view_is_the_steps_heads(explained) -> None:
    model, answer = explained
    inspector = cl.inspect(model, answer, step=1)
    figure = inspector._view_figure()
    np.testing.assert_allclose(np.asarray(figure.data[0].z, float), answer[1].attribution.by_head().to_numpy())
    title = figure.layout.title.text
    assert title.startswith("Inspector: prediction, step 1.") and f"position {answer[1].position}" in title
    inspector.view = "heatmap"
    assert figure.layout.title.text != inspector._view_figure().layout.title.text


def test_save_image_draws_what_the_widget_draws(explained, tmp_path) -> None:
    # Failed before: the prediction heads were flipped (layer 0 at the bottom) on plotly's grey template, and
    # the bars could not be saved at all.
    from views.test_plot import needs_image_writer, png_pixels

    model, answer = explained
    inspector = cl.inspect(model, answer, step=1)
    heads = inspector._view_figure()
    assert list(heads.data[0].y) == [f"L{layer}" for layer in range(3)] and heads.layout.yaxis.autorange == "reversed"
    assert list(heads.data[0].x) == [f"H{h}" for h in range(4)]
    inspector.view, inspector.head, inspector.query = "heatmap", 2, answer[0].position
    with pytest.raises(ValueError, match="include must be 'view' or 'bars', got 'both'"):
        inspector.save_image(tmp_path / "x.png", include="both")
    needs_image_writer()
    pixels = {
        name: png_pixels(inspector.save_image(tmp_path / f"{name}.png", scale=1, include=name).read_bytes())
        for name in ("view", "bars")
    }
    for name, image in pixels.items():
        # The widget's white page, not plotly.py's grey plot area (229, 236, 246).
        grey = np.all(image == np.array([229, 236, 246]), axis=-1).mean()
        assert grey < 0.01, f"{name}: {grey:.1%} of the image is plotly's grey"
    bars = ins.figure.bars_figure(
        inspector._layer_payload(inspector.window, inspector.layer), inspector.window, inspector._subject.labels,
        layer=inspector.layer, head=2, scope="inter", query=inspector.query,
    )  # fmt: skip
    assert [t.name for t in bars.data] == ["attention", "relative norm", "cosine", "contribution"]
    assert bars.layout.title.text.endswith(": attention × relative norm × cosine = contribution")
    a, r, c, contribution = (np.asarray(t.x, float) for t in bars.data)
    np.testing.assert_allclose(a * r * c, contribution, rtol=1e-6, atol=1e-9)
    assert pixels["bars"].shape[1] == 1000


def test_a_page_of_an_explanation_holds_its_steps_and_opens_on_the_step(explained) -> None:
    model, answer = explained
    inspector = cl.inspect(model, answer, step=2, layers=[0, 2])
    data = json.loads(re.search(r"class='cl-data'>(.*?)</script>", inspector.render_html()).group(1))
    assert data["steps"] == json.loads(json.dumps(inspector.steps))
    initial = data["meta"]["initial"]
    assert (initial["view"], initial["step"], initial["query"]) == ("prediction", 2, answer[2].position)
    plain = cl.inspect(model, answer.tokens)
    data = json.loads(re.search(r"class='cl-data'>(.*?)</script>", plain.render_html()).group(1))
    assert data["steps"] is None and data["meta"]["initial"]["view"] == "heatmap"


def test_one_logit_attribution_or_several_of_one_text_are_steps(explained) -> None:
    model, answer = explained
    single = cl.logit_attribution(model, answer.tokens, position=5)
    inspector = cl.inspect(model, single)
    assert (
        len(inspector.steps["steps"]) == 1 and inspector.query == 5 and inspector.steps["steps"][0]["rollout"] is None
    )
    several = [cl.logit_attribution(model, answer.tokens, position=p) for p in (3, 9)]
    assert [s["position"] for s in cl.inspect(model, several).steps["steps"]] == [3, 9]
    other = cl.logit_attribution(model, answer.tokens[:10], position=3)
    with pytest.raises(ValueError, match="explain different texts"):
        cl.inspect(model, [several[0], other])


STEP_REFUSALS = [
    ({"step": 4}, "step 4 does not exist: the inspector explains steps 0..3"),
    ({"view": "diagram"}, "unknown view 'diagram'"),
]


@pytest.mark.parametrize(("keywords", "message"), STEP_REFUSALS, ids=["step", "view"])
def test_bad_steps_and_views_are_refused_before_the_model_runs(explained, monkeypatch, keywords, message) -> None:
    model, answer = explained
    monkeypatch.setattr(caches, "compute_windows", lambda *a, **k: pytest.fail("the model ran"))
    with pytest.raises(ins.InspectorError, match=re.escape(message)):
        cl.inspect(model, answer, **keywords)


def test_steps_need_explained_predictions_of_this_model(explained, monkeypatch) -> None:
    model, answer = explained
    monkeypatch.setattr(caches, "compute_windows", lambda *a, **k: pytest.fail("the model ran"))
    with pytest.raises(ValueError, match=re.escape("step=1 needs explained predictions")):
        cl.inspect(model, answer.tokens, step=1)
    with pytest.raises(ins.InspectorError, match="the prediction view needs explained predictions"):
        cl.inspect(model, answer.tokens, view="prediction")
    with pytest.raises(ValueError, match="explained on a model of 3 layers and 4 heads; this one has 2 and 4"):
        cl.inspect(tiny_bridge("gqa", n_layers=2), answer)


# --- the package's shape: one constructor, one check of each value, the old names kept ------------------


def test_inspect_checks_the_layers_and_places_the_window_once(explained, monkeypatch) -> None:
    import sys

    from contribution_lens import adapter

    model, answer = explained
    calls = {"check_layers": 0, "window_start": 0}

    def counted(name, function):
        def count(*args, **kwargs):
            # The inspector's own calls (the engine checks the layers it runs, once per pass).
            calls[name] += sys._getframe(1).f_globals["__name__"].startswith("contribution_lens.views.inspector")
            return function(*args, **kwargs)

        return count

    monkeypatch.setattr(adapter, "check_layers", counted("check_layers", adapter.check_layers))
    for module in [m for n, m in sys.modules.items() if n.startswith("contribution_lens.views.inspector")]:
        if hasattr(module, "window_start") and "window_start" in vars(module):
            monkeypatch.setattr(module, "window_start", counted("window_start", vars(module)["window_start"]))
    inspector = cl.inspect(model, answer, tokens=6, step=3, layers=[0, 2])  # step 3's position is past 0..5
    assert calls == {"check_layers": 1, "window_start": 1}
    assert inspector.query == answer[3].position and inspector.query in inspector.window.queries


def test_the_face_offers_what_users_call_and_the_old_names_warn_with_their_place() -> None:
    import importlib

    from contribution_lens.views import export
    from contribution_lens.views.inspector import _deprecated

    panels = ["PANELS", "Panel", "PanelSource", "register_panel", "unregister_panel"]  # the panel seam (panel.py)
    assert sorted(ins.__all__) == sorted(["Inspector", "InspectorError", "inspect", *panels])
    assert ins.register_panel is importlib.import_module("contribution_lens.views.inspector.panel").register_panel
    assert ins.inspect is widget.inspect and issubclass(ins.InspectorError, ValueError)
    for name, home in _deprecated.INSPECTOR_NAMES.items():
        moved = re.escape(f"contribution_lens.views.inspector.{name} is deprecated: use {home}.{name}")
        with pytest.warns(DeprecationWarning, match=moved):
            value = getattr(ins, name)
        assert value is getattr(importlib.import_module(home), name)
    with pytest.warns(DeprecationWarning, match=r"payload\.token_window is deprecated: use .*windows\.token_window"):
        from contribution_lens.views.inspector.payload import token_window
    assert token_window is windows.token_window
    with pytest.warns(
        DeprecationWarning, match=r"export\.inspector_figure is deprecated: use .*figure\.inspector_figure"
    ):
        assert export.inspector_figure is importlib.import_module(f"{ins.__name__}.figure").inspector_figure
    with pytest.warns(DeprecationWarning, match="contribution_lens.inspector is deprecated"):
        import contribution_lens.inspector as old  # the 0.2 path
    with pytest.warns(DeprecationWarning, match=r"inspector\.Window is deprecated: use .*inspector\.windows\.Window"):
        assert old.Window is windows.Window


def test_a_layers_arrays_are_c_contiguous() -> None:
    """A Fortran-ordered copy (NumPy's ``values[:, cells]``) made every later step 2-3x slower (bench_inspector)."""
    from contribution_lens.views.inspector import payload

    model = tiny_bridge("gqa", n_layers=1)
    both = cl.map_layers(model, torch.arange(12)[None], lambda i: (i.decompose("inter"), i.decompose("intra")))[0]
    arrays = payload.window_arrays(*both, windows.token_window(12, start=4, tokens=6), n_kv_heads=2)
    assert arrays.attention.flags.c_contiguous
    assert all(codes.flags.c_contiguous for codes in arrays.codes.values())
