"""The views above the methods: every registered measure compared (`compare_measures`)."""

import pytest
import torch

import contribution_lens as cl
from conftest import assert_close, tiny_bridge
from contribution_lens.views import overview


@pytest.fixture(scope="module")
def geometry() -> cl.Geometry:
    model = tiny_bridge("gqa", biases=True)
    return cl.attention_geometry(model, torch.tensor([[3, 7, 7, 7, 2, 9, 7, 1]]))


def test_compare_measures_draws_a_token_level_measure_as_it_is(geometry) -> None:
    def summed_attention(d):
        return d.attention.sum(1)  # [batch query key]

    method = cl.Method.from_decomposition("summed_attention", summed_attention, "attention summed over heads")
    cl.register_method(method)
    try:
        figure = overview.compare_measures(geometry, layer=1, query=5)
        drawn = next(trace for trace in figure.data if trace.name == "summed_attention")
        expected = geometry[1].attention[0, :, 5, :6].sum(0).double()
        assert_close(torch.tensor(drawn.y), expected / expected.abs().sum(), atol=1e-6)
    finally:
        cl.unregister_method("summed_attention")


def test_compare_measures_draws_what_measure_bars_draws_for_the_registry(geometry) -> None:
    """The four built-ins are the decomposition's own four: the same bars as `Geometry.figures` draws."""
    registered = overview.compare_measures(geometry, layer=1, query=7)
    own = list(geometry.figures(layer=1).values())[-1]
    assert [trace.name for trace in registered.data] == [trace.name for trace in own.data]
    for a, b in zip(registered.data, own.data, strict=True):
        assert_close(torch.tensor(a.y), torch.tensor(b.y))
