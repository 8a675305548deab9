"""The random control: a function of (seed, token ids, layer, position) only."""

import torch

import contribution_lens as cl
from conftest import tiny_bridge
from contribution_lens import adapter
from helpers import IDS


def test_random_control_ignores_batching_and_padding() -> None:
    model = tiny_bridge("mha")
    method = cl.get_method("random")
    texts = [IDS[0], IDS[1, :5]]
    alone = [cl.map_layers(model, t, lambda layer: method.token_scores(layer, cl.ScoreContext()))[1] for t in texts]
    batch = adapter.pad_rows(model, texts)
    together = cl.map_layers(model, batch, lambda layer: method.token_scores(layer, cl.ScoreContext()))[1]
    assert torch.equal(together[0], alone[0][0])
    assert torch.equal(together[1, :5, :5], alone[1][0])
    assert bool((together[1, 5:] == 0).all()) and bool((together[1, :, 5:] == 0).all())
    other_seed = cl.map_layers(model, texts[0], lambda layer: method.token_scores(layer, cl.ScoreContext(seed=1)))
    assert not torch.equal(other_seed[1][0], alone[0][0])
