"""Attention a tile of queries at a time: the tiles cover every query once, a tile's pattern is the softmax of its
masked scores (a float64 oracle), the pattern rebuilt from a pass's queries and keys is the model's own, and a
pass in tiles (which never holds a pattern) gives the numbers of the ordinary pass, on tiny checkpoints of the
attention forms the engine supports (GQA, a soft-cap, sliding windows, bidirectional, padding) and on the real
bundled models."""

import dataclasses
import math
import re
from pathlib import Path

import pytest
import torch

import architectures
import contribution_lens as cl
from conftest import assert_close, raises_bad_input, tiny_bridge
from contribution_lens import adapter, tiles
from contribution_lens.tiles import QueryKeys, attend, query_tiles

SMALL = 2048
"""A tile budget of a few rows at these lengths: every layer is read in many tiles."""


@pytest.mark.parametrize(("n_query", "n_key", "causal"), [(37, 37, True), (5, 37, True), (37, 37, False), (1, 1, True)])
@pytest.mark.parametrize("budget", [1, 600, 1 << 30])
@pytest.mark.parametrize("min_rows", [1, 16])
def test_query_tiles_cover_every_query_once(n_query: int, n_key: int, causal: bool, budget: int, min_rows) -> None:
    found = query_tiles(n_query, n_key, heads=3, batch=2, causal=causal, budget=budget, min_rows=min_rows)
    assert [t.start for t in found] == [0, *[t.stop for t in found[:-1]]] and found[-1].stop == n_query
    offset = n_key - n_query
    for tile in found:
        assert tile.rows >= min(min_rows, n_query - tile.start)
        assert tile.keys == (offset + tile.stop if causal else n_key)
        if tile.rows > min_rows:  # more rows than the least only within the budget
            assert 2 * 3 * tile.rows * tile.keys * 4 <= budget
    if causal and n_query >= 8 * tiles.MIN_ROWS and budget > 1 << 20:
        assert len(found) >= tiles.CAUSAL_TILES  # the keys after each query a tile reads stay few


def oracle_pattern(qk: QueryKeys) -> torch.Tensor:
    """The pattern in float64, whole: repeated kv heads, scaled scores, soft-cap, every mask, softmax."""
    q, k = qk.q.double(), qk.k.double().repeat_interleave(qk.q.shape[1] // qk.k.shape[1], 1)
    scores = q @ k.mT * qk.scale
    if qk.softcap is not None:
        scores = torch.tanh(scores / qk.softcap) * qk.softcap
    n_query, n_key = scores.shape[-2:]
    i = torch.arange(n_key - n_query, n_key)[:, None]
    j = torch.arange(n_key)[None, :]
    seen = (j <= i) if qk.causal else torch.ones(n_query, n_key, dtype=torch.bool)
    if qk.window is not None:
        seen = seen & (j > i - qk.window)
    seen = seen[None, None] & qk.attention_mask[:, None, None, :] if qk.attention_mask is not None else seen
    return torch.softmax(scores.masked_fill(~seen, -math.inf), -1).nan_to_num(0.0)


FORMS = {
    "gqa causal": {},
    "soft-cap and window": {"softcap": 3.0, "window": 4},
    "bidirectional padded": {"causal": False, "attention_mask": torch.tensor([[True] * 11, [True] * 7 + [False] * 4])},
    "causal padded window": {"window": 3, "attention_mask": torch.tensor([[True] * 11, [True] * 6 + [False] * 5])},
}


@pytest.mark.parametrize("form", FORMS, ids=list(FORMS))
def test_a_tile_of_the_pattern_and_attention_in_tiles_are_the_oracles(form: str) -> None:
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, heads, 11, 8, generator=g) for heads in (4, 2, 2))
    qk = QueryKeys(q, k, scale=8**-0.5, **FORMS[form])
    whole = oracle_pattern(qk)
    for tile in qk.tiles(budget=100, min_rows=1):  # a row or two a tile
        assert_close(qk.pattern(tile), whole[:, :, tile.queries, : tile.keys].float(), rtol=1e-5, atol=1e-6)
        assert not bool(whole[:, :, tile.queries, tile.keys :].any())  # the keys a tile leaves out carry nothing
    z = whole @ v.double().repeat_interleave(2, 1)
    assert_close(attend(qk, v, budget=100), z.transpose(1, 2).float(), rtol=1e-5, atol=1e-6)  # torch's kernel if plain


def tiny_checkpoint(name: str, overrides: dict, folder: Path) -> adapter.Model:
    """A tiny random checkpoint of transformers' ``name`` (`architectures`), its config changed by ``overrides``."""
    config = architectures.tiny_config(name)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(1)
    model = architectures.model_class(name)(config).eval()
    architectures._randomise(model, 1)
    model.save_pretrained(folder)
    architectures.tokenizer().save_pretrained(folder)
    return cl.load_model(str(folder))


TINY = {
    "llama gqa": ("LlamaForCausalLM", {}),
    "gemma2 soft-cap, sliding window": (
        "Gemma2ForCausalLM",
        {"attn_logit_softcapping": 5.0, "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]},
    ),
    "gemma3 sliding window": ("Gemma3ForCausalLM", {"sliding_window": 4, "layer_types": ["sliding_attention"] * 2}),
    "bert bidirectional": ("BertForMaskedLM", {}),
}
TEXTS = ["The cat sat on the mat because it was warm and dry.", "Rain fell on the old bridge."]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, adapter.Model]:
    folder = tmp_path_factory.mktemp("tiles")
    return {label: tiny_checkpoint(name, overrides, folder / name) for label, (name, overrides) in TINY.items()}


@pytest.mark.parametrize("label", TINY, ids=list(TINY))
def test_the_pattern_rebuilt_from_a_pass_is_the_models(tiny, label: str, monkeypatch) -> None:
    """Each layer's queries and keys, as a pass records them, make its pattern, tile by tile (a padded batch)."""
    monkeypatch.setattr(tiles, "TILE_BYTES", SMALL)
    monkeypatch.setattr(tiles, "MIN_ROWS", 1)
    model, checked = tiny[label], []
    forms = adapter.attention_forms(model)
    assert (forms[0].window is not None) == ("window" in label) and (forms[0].softcap is not None) == ("cap" in label)

    def check(layer: adapter.LayerInputs) -> None:
        assert layer.qk is not None and len(layer.tiles()) > 2
        for tile in layer.tiles():
            rows = layer.qk.pattern(tile)
            real = layer.attention_mask[:, tile.queries, None, None].transpose(1, 2)  # padded queries hold anything
            assert_close(
                torch.where(real, rows, 0), torch.where(real, layer.pattern_rows(tile), 0), rtol=1e-5, atol=1e-6
            )
        checked.append(layer.layer)

    cl.map_layers(model, TEXTS, check, qk="record")
    assert checked == [0, 1]


def numbers(analysis: cl.SinkAnalysis) -> dict[str, torch.Tensor]:
    """Every tensor of a sink analysis, by ``layer/field`` and ``layer/scope/factor``."""
    out = {}
    for layer, found in analysis.items():
        out |= {f"{layer}/{f.name}": getattr(found, f.name) for f in dataclasses.fields(found) if f.name != "factors"}
        out |= {f"{layer}/{scope}/{name}": v for scope, fs in found.factors.items() for name, v in fs.items()}
    return out


def assert_same_numbers(tiled: cl.SinkAnalysis, whole: cl.SinkAnalysis) -> None:
    """Every number of two sink analyses, to float32's rounding of the attention computed another way."""
    got, expected = numbers(tiled), numbers(whole)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        if not value.is_floating_point():
            assert torch.equal(got[key], value), key
        else:
            scale = float(value.abs().max()) if value.numel() else 0.0
            assert_close(got[key], value, rtol=1e-5, atol=1e-5 * scale + 1e-7)


@pytest.mark.parametrize("label", TINY, ids=list(TINY))
def test_a_pass_in_tiles_gives_the_numbers_of_the_ordinary_pass(tiny, label: str, monkeypatch) -> None:
    """The layer summary and the sink analysis (both scopes' quantiles, the sink found where there is no BOS),
    from a pass that never holds a pattern, on a padded batch."""
    monkeypatch.setattr(tiles, "TILE_BYTES", SMALL)
    monkeypatch.setattr(tiles, "MIN_ROWS", 1)
    model = tiny[label]
    options = {"sinks": "auto"} if label.startswith("bert") else {}
    summaries = [cl.layer_summary(model, TEXTS, tiles=mode) for mode in (True, False)]
    assert_close(torch.tensor(summaries[0].to_numpy()), torch.tensor(summaries[1].to_numpy()), rtol=1e-5, atol=1e-7)
    analyses = [
        cl.sink_analysis(model, TEXTS, tiles=mode, quantiles=("intra", "inter"), **options) for mode in (True, False)
    ]
    assert_same_numbers(*analyses)


REAL = {"smollm2": "bundled_model", "gemma3": "gemma", "minilm encoder": "encoder_model"}


@pytest.mark.parametrize("label", REAL, ids=list(REAL))
def test_a_pass_in_tiles_on_the_real_models(label: str, request, monkeypatch) -> None:
    model = request.getfixturevalue(REAL[label])
    monkeypatch.setattr(tiles, "TILE_BYTES", SMALL * 8)
    monkeypatch.setattr(tiles, "MIN_ROWS", 1)
    text = " ".join(TEXTS * 3)
    layers = [0, 3, -1]
    summaries = [cl.layer_summary(model, text, layers=layers, tiles=mode) for mode in (True, False)]
    assert_close(torch.tensor(summaries[0].to_numpy()), torch.tensor(summaries[1].to_numpy()), rtol=1e-5, atol=1e-7)
    assert_same_numbers(*[cl.sink_analysis(model, text, layers=layers, tiles=mode) for mode in (True, False)])


def test_a_model_whose_attention_is_its_own_refuses_tiles_and_keeps_its_pattern() -> None:
    model, ids = tiny_bridge("gqa"), torch.arange(1, 9)[None]
    message = "the attention of layers [0, 1] does not go through transformers' attention functions"
    assert message in str(adapter.tiles_problem(model))
    with pytest.raises(ValueError, match=re.escape("cannot read its attention in tiles: " + message)):
        cl.layer_summary(model, ids, tiles=True)
    assert cl.layer_summary(model, ids).shape == (2, 4)  # the length decides: the ordinary pass
    with raises_bad_input("tiles must be True, False or None (the length decides), got 'yes'"):
        cl.sink_analysis(model, ids, tiles="yes")  # type: ignore[arg-type]
