"""Figures: what they show is the numbers of the decomposition, labelled and coloured as promised."""

import numpy as np
import plotly.graph_objects as go
import pytest
import torch

import contribution_lens as cl
from conftest import assert_close, raises_bad_input, tiny_bridge


@pytest.fixture(scope="module")
def geometry() -> cl.Geometry:
    model = tiny_bridge("gqa", biases=True)
    ids = torch.tensor([[3, 7, 7, 7, 2, 9, 7, 1]])  # repeated tokens: labels must stay unique
    return cl.attention_geometry(model, ids)


def test_token_heatmap_shows_the_factor_with_all_four_on_hover(geometry) -> None:
    figure = cl.plot.token_heatmap(geometry, layer=1, head=2, factor="contribution")
    assert isinstance(figure, go.Figure)
    heatmap = figure.data[0]
    assert len(set(heatmap.x)) == 8 and heatmap.x[2] == "2:<7>"
    assert heatmap.zmid == 0 and heatmap.colorscale[0][1] != heatmap.colorscale[-1][1]
    z = np.asarray(heatmap.z, dtype=float)
    assert np.isnan(z[np.triu_indices(8, 1)]).all()
    d = geometry[1]
    assert_close(torch.tensor(np.tril(np.nan_to_num(z))), d.contribution[0, 2].double(), atol=1e-6)
    hover = np.asarray(heatmap.customdata, dtype=float)
    for channel, name in enumerate(cl.FACTORS):
        assert_close(torch.tensor(hover[..., channel]), d.factor(name)[0, 2].double(), atol=1e-6)
    assert "cosine" in heatmap.hovertemplate and "relative norm" in heatmap.hovertemplate
    unsigned = cl.plot.token_heatmap(geometry, layer=1, head=2, factor="attention").data[0]
    assert unsigned.zmid is None


def test_token_level_heatmap_sums_contributions_over_heads(geometry) -> None:
    z = np.asarray(cl.plot.token_heatmap(geometry, layer=0).data[0].z, dtype=float)
    assert_close(torch.tensor(np.nansum(z, axis=1)), torch.ones(8, dtype=torch.float64), atol=1e-5)


def test_head_grid_factor_bars_and_measures(geometry) -> None:
    grid = cl.plot.head_grid(geometry.head_summary("cosine"), title="cos", signed=True).data[0]
    assert np.asarray(grid.z).shape == (2, 4) and grid.zmid == 0 and grid.text[1][3] == "L1H3"
    bars = cl.plot.factor_bars(geometry, layer=1, query=5, head=0)
    assert [trace.name for trace in bars.data] == list(cl.FACTORS)
    assert_close(torch.tensor(bars.data[3].x), geometry[1].contribution[0, 0, 5, :6].double(), atol=1e-6)
    assert len({trace.xaxis for trace in bars.data}) == 4  # one scale per factor
    measures = cl.plot.compare_measures(geometry, layer=1, query=7)
    assert len(measures.data) == 4
    for trace in measures.data:
        assert np.abs(trace.y).sum() == pytest.approx(1.0, abs=1e-5)


def test_plot_errors(geometry) -> None:
    with raises_bad_input("head 4 does not exist: the layer has 4 heads"):
        cl.plot.token_heatmap(geometry, layer=0, head=4)
    with raises_bad_input("unknown factor 'norm'"):
        cl.plot.token_heatmap(geometry, layer=0, factor="norm")
    with raises_bad_input("query 8 is outside the text of 8 tokens"):
        cl.plot.factor_bars(geometry, layer=0, query=8)
    with pytest.raises(KeyError, match="layer 5 was not computed"):
        cl.plot.token_heatmap(geometry, layer=5)


def test_an_encoders_heatmap_and_bars_show_every_key() -> None:
    from conftest import tiny_bridge

    model = tiny_bridge("gqa", attention_dir="bidirectional")
    g = cl.attention_geometry(model, torch.randint(0, 50, (1, 6), generator=torch.Generator().manual_seed(0)))
    z = np.asarray(cl.plot.token_heatmap(g, layer=0, head=1).data[0].z, dtype=float)
    assert not np.isnan(z).any(), "a bidirectional pattern has no future keys to blank"
    bars = cl.plot.factor_bars(g, layer=0, query=2, head=1)
    assert len(bars.data[0].y) == 6
    assert len(cl.plot.compare_measures(g, layer=0, query=2).data[0].x) == 6


def test_hiding_the_sink_drops_key_0_and_renormalises_the_rest(geometry) -> None:
    d = geometry[1]
    attention = cl.plot.token_heatmap(geometry, layer=1, head=2, factor="attention", hide_sink=True)
    heatmap = attention.data[0]
    assert heatmap.x[0] == "1:<7>" and len(heatmap.x) == 7 and "sink hidden" in attention.layout.title.text
    z = np.asarray(heatmap.z, dtype=float)
    a = d.attention[0, 2].double()
    expected = a[:, 1:] / (1 - a[:, :1])
    assert np.isnan(z[0]).all()
    assert_close(torch.tensor(np.nan_to_num(z[1:])), torch.tril(expected[1:], 0), atol=1e-6)
    # Token-level inter-head contribution still sums to 1 over the keys left.
    z = np.asarray(cl.plot.token_heatmap(geometry, layer=0, hide_sink=True).data[0].z, dtype=float)
    assert_close(torch.tensor(np.nansum(z[1:], axis=1)), torch.ones(7, dtype=torch.float64), atol=1e-5)
    bars = cl.plot.factor_bars(geometry, layer=1, query=5, head=2, hide_sink=True)
    assert list(bars.data[0].y) == [f"{j}:{t}" for j, t in enumerate(geometry.str_tokens[0])][1:6]
    assert_close(torch.tensor(np.asarray(bars.data[0].x, dtype=float)), expected[5, :5], atol=1e-6)
