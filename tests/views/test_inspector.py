"""The inspector's Python side: the widget model sends the selected layer's numbers, the page stays light."""

import base64
import json
import re

import numpy as np
import plotly.offline
import pytest
import torch
import traitlets

import contribution_lens as cl
from conftest import tiny_bridge, tiny_encoder
from contribution_lens.views import inspector as ins
from contribution_lens.views.inspector import payload


def codes(payload: dict, name: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(payload[name]), dtype="<u2")


def library_codes(model, ids, layer: int, window: ins.Window) -> dict[str, np.ndarray]:
    """What the payload must hold, from `cl.attention_geometry` (float32)."""
    by_scope = {s: cl.attention_geometry(model, ids, layers=[layer], scope=s)[layer] for s in cl.SCOPES}
    cut = {name: payload._cut(tensor[0], window) for name, tensor in [
        ("attention", by_scope["inter"].attention), ("cosine_inter", by_scope["inter"].cosine),
        ("cosine_intra", by_scope["intra"].cosine)]}  # fmt: skip
    return {
        "attention": ins.quantise_attention(cut["attention"]).ravel(),
        "cosine_inter": ins.quantise_cosine(cut["cosine_inter"]).ravel(),
        "cosine_intra": ins.quantise_cosine(cut["cosine_intra"]).ravel(),
    }


def assert_payload(inspector, model, ids, layer: int) -> None:
    assert inspector.payload["layer"] == layer
    want = library_codes(model, ids, layer, inspector.window)
    for name, expected in want.items():
        got = codes(inspector.payload, name)
        assert got.shape == expected.shape, name
        # One code of slack: float rounding in the hooks vs the library's own pass.
        assert np.abs(got.astype(int) - expected.astype(int)).max() <= 1, name


def test_widget_traits_select_what_is_sent() -> None:
    model = tiny_bridge("gqa", biases=True, n_layers=3)
    ids = torch.randint(0, 50, (1, 20), generator=torch.Generator().manual_seed(0))
    inspector = cl.inspect(model, ids, layer=1, tokens=8, start=10)
    assert inspector.window.queries == list(range(10, 18)) and inspector.window.keys == [0, *range(10, 18)]
    assert inspector.meta["key_labels"][1].startswith("10:") and inspector.query == 17
    assert_payload(inspector, model, ids, 1)
    assert repr(inspector) == (
        "Inspector(layer=1, head=all, factor=contribution, scope=inter, tokens 10..17 of 20); "
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
    attention = ins.dequantise_attention(codes(inspector.payload, "attention")).reshape(4, 6, 6)
    assert attention[:, 0, 1:].sum() > 0.1


@pytest.mark.slow
def test_static_page_is_compact_and_first_widget_payload_small(bundled_model) -> None:
    text = " ".join(["The quick brown fox jumps over the lazy dog."] * 60)
    ids = cl.to_token_batch(bundled_model, text).tokens[:, :512]
    inspector = cl.inspect(bundled_model, ids)
    first = json.dumps({"meta": inspector.meta, "payload": inspector.payload})
    assert len(first) < 1_000_000, f"first widget payload {len(first)} bytes"
    html = inspector.render_html(tokens=64)
    n_layers, n_heads = 30, 9
    cells = n_layers * n_heads * (64 * 65 // 2) * 7  # attention + 3 factors x 2 scopes
    beyond_plotly = len(html.encode()) - len(plotly.offline.get_plotlyjs().encode())
    assert beyond_plotly / cells <= 1.5, f"{beyond_plotly / cells:.3f} bytes per displayable cell"
