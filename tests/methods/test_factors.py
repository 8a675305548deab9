"""The measures built from the factors, against their definitions."""

import contribution_lens as cl
from conftest import assert_close
from helpers import random_layer


def test_importance_methods_follow_their_definitions() -> None:
    pattern, v, W_O = random_layer("gqa", seed=4)
    d = cl.decompose(pattern, v, W_O)
    vn = d.value_norm[:, :, None, :]
    expected = {
        "attention": pattern,
        "value_weighted": pattern * vn,
        "output_normalized": pattern * vn / d.output_norm[..., None],
        "contribution": d.contribution,
    }
    for method in cl.METHODS:
        assert_close(cl.importance(pattern, v, W_O, method=method), expected[method].tril(), atol=1e-6)
