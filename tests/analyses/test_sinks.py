"""Sink geometry: closed forms against brute force, and the intervention's mechanics."""

import dataclasses

import pytest
import torch

import contribution_lens as cl
from conftest import assert_close, raises_bad_input, tiny_bridge
from contribution_lens import adapter
from contribution_lens.analyses.sink_intervention import run_sink_intervention
from contribution_lens.analyses.sinks import sink_layer
from reference import reference_contributions


def random_layer(seed: int = 0, pos: int = 9, n_heads: int = 4, n_kv: int = 2):
    g = torch.Generator().manual_seed(seed)
    causal = torch.ones(pos, pos, dtype=torch.bool).tril()
    pattern = torch.randn(2, n_heads, pos, pos, generator=g).masked_fill(~causal, float("-inf")).softmax(-1)
    return pattern, torch.randn(2, pos, n_kv, 6, generator=g), torch.randn(n_heads, 6, 16, generator=g)


def brute_force(pattern, v, W_O, k):
    """Materialise s_i, t_i and S, U in d_model (float64) per head."""
    pattern, v, W_O = pattern.double(), v.double(), W_O.double()
    group = pattern.shape[1] // v.shape[2]
    vt = torch.stack([v[:, :, h // group] @ W_O[h] for h in range(pattern.shape[1])], dim=1)  # [b h k m]
    s = torch.einsum("bhqk,bhkm->bhqm", pattern[..., :k], vt[:, :, :k])
    t = torch.einsum("bhqk,bhkm->bhqm", pattern[..., k:], vt[:, :, k:])
    ratio = pattern[..., :k].sum(-1)
    return vt, s, t, s / ratio[..., None], t / (1 - ratio)[..., None], ratio


@pytest.mark.parametrize("k", [1, 2])
def test_closed_forms_match_brute_force(k: int) -> None:
    pattern, v, W_O = random_layer()
    s_layer = sink_layer(pattern, v, W_O, k=k)
    vt, s, t, S, U, ratio = brute_force(pattern, v, W_O, k)
    q = s_layer.queries[:, None, :]
    cos = torch.nn.functional.cosine_similarity
    assert_close(s_layer.sink_ratio, torch.where(q, ratio, 0), atol=1e-6)
    assert_close(s_layer.sink_sq, torch.where(q, (S * S).sum(-1), 0), rtol=1e-4, atol=1e-4)
    assert_close(s_layer.cross, torch.where(q, (S * U).sum(-1), 0), rtol=1e-4, atol=1e-4)
    assert_close(s_layer.sink_tail_cosine, torch.where(q, cos(s, t, dim=-1), 0), atol=1e-5)
    # o(beta) at beta = actual sink ratio is the head's own output.
    at_ratio = s_layer.curve(torch.tensor([0.0, 1.0]))  # ends: ||U|| and ||S||
    assert_close(at_ratio[0], torch.where(q, U.norm(dim=-1), 0), rtol=1e-4, atol=1e-4)
    assert_close(s_layer.output_norm, torch.where(q, (s + t).norm(dim=-1), 0), rtol=1e-4, atol=1e-4)
    sink_vec = vt[:, :, :k].mean(2, keepdim=True)
    expected = cos(sink_vec.expand_as(vt), vt, dim=-1)
    assert_close(s_layer.sink_token_cosine[:, :, k:], expected[:, :, k:], atol=1e-5)


def test_a_sink_ratio_that_rounds_to_one_keeps_the_tail_exact() -> None:
    """Where float32 rounds a_i to 1 the tail still holds attention: U = t_i / (tail mass), against float64.

    Dividing by ``1 - a_i`` gave NaN (0 clamped to 1e-30) or lost digits (1 - a_i cancels) there.
    """
    pattern, v, W_O = random_layer(seed=2)
    logits = pattern.double().log()
    logits[..., 0] += 22.0  # the sink's attention ~1 - 1e-8: 1 - a_i is at float32's resolution
    pattern64 = logits.softmax(-1)
    s_layer = sink_layer(pattern64.float(), v, W_O)
    _, _, t, S, _, ratio = brute_force(pattern64.float(), v, W_O, 1)
    U = t / pattern64.float().double()[..., 1:].sum(-1, keepdim=True)  # the tail's own mass, in float64
    q = s_layer.queries[:, None, :] & (ratio > 1 - 1e-6)
    assert bool(q.any()), "no query has a sink ratio that rounds near 1"
    assert bool(s_layer.tail_sq[q].isfinite().all())
    assert_close(s_layer.tail_sq[q], (U * U).sum(-1)[q], rtol=1e-3, atol=1e-4)
    assert_close(s_layer.cross[q], (S * U).sum(-1)[q], rtol=1e-3, atol=1e-3)


def test_beta_star_is_the_grid_minimum() -> None:
    pattern, v, W_O = random_layer(seed=1)
    s = sink_layer(pattern, v, W_O)
    grid = torch.linspace(0, 1, 2001)
    curve = s.curve(grid)  # [beta b h q]
    on_grid = grid[curve.argmin(0)]
    q = s.queries[:, None, :].expand_as(s.sink_ratio)
    assert (on_grid - s.beta_star)[q].abs().max() <= 1 / 2000 + 1e-6
    # Interior exactly when the minimum is not at an end of the grid.
    interior = (on_grid > 0) & (on_grid < 1)
    assert bool((interior == s.interior_minimum)[q].all())
    # The curve is convex: second differences are never negative.
    assert bool(((curve[2:] - 2 * curve[1:-1] + curve[:-2]) >= -1e-5).all())
    # And its value at the actual sink ratio is the real output norm.
    for b, h, i in q.nonzero()[::7].tolist():
        at_ratio = s.curve(s.sink_ratio[b, h, i][None])[0, b, h, i]
        assert at_ratio.item() == pytest.approx(s.output_norm[b, h, i].item(), rel=1e-4, abs=1e-5)


def test_the_curve_takes_a_grid_built_on_another_device() -> None:
    """A plot builds its grid of beta on the CPU while a GPU run's terms stay on the GPU.

    The meta device stands in for the GPU: mixing it with a CPU tensor raises as CUDA does.
    """
    s = sink_layer(*random_layer())
    elsewhere = dataclasses.replace(
        s, **{name: getattr(s, name).to("meta") for name in ("sink_sq", "cross", "tail_sq")}
    )
    curve = elsewhere.curve(torch.linspace(0, 1, 5))
    assert curve.device.type == "meta" and curve.shape == (5, *s.sink_sq.shape)


def test_sink_parts_add_up_on_the_bundled_model(bundled_model) -> None:
    analysis = cl.sink_analysis(bundled_model, "The capital of France is Paris, and it is a big city.", layers=[3, 20])
    table = analysis.head_table()
    assert len(table) == 2 * 9
    # Intra-head weights sum to 1 per query, so sink + tail contributions average to 1.
    assert_close(
        torch.tensor((table["intra_sink_contribution"] + table["intra_tail_contribution"]).to_numpy()),
        torch.ones(18, dtype=torch.float64),
        atol=1e-4,
    )
    assert_close(
        torch.tensor((table["intra_sink_attention"] + table["intra_tail_attention"]).to_numpy()),
        torch.ones(18, dtype=torch.float64),
        atol=1e-5,
    )
    # The sink ratio column and the attention factor of the sink are the same quantity.
    assert_close(
        torch.tensor(table["sink_ratio"].to_numpy()), torch.tensor(table["intra_sink_attention"].to_numpy()), atol=1e-5
    )
    claims = analysis.claims()
    assert 0 <= claims["share_queries_interior_minimum"] <= 1
    per_query = analysis.per_query()
    assert set(per_query["layer"]) == {3, 20} and (per_query["query"] >= 1).all()


def test_zero_intervention_is_removing_the_sink_column() -> None:
    model = tiny_bridge("gqa", biases=True)
    chunks = torch.randint(0, 50, (3, 10), generator=torch.Generator().manual_seed(0))
    result = run_sink_intervention(model, chunks, variant="zero", batch_size=2, progress=False)
    assert result.per_layer["output_norm_clean"].gt(0).all()
    # Same forward as hand-made removal of key 0 for every query at every layer.
    keep = {layer: torch.ones(3, 10, 10, dtype=torch.bool) for layer in range(2)}
    for mask in keep.values():
        mask[..., 0] = False
    from contribution_lens.interventions import remove_keys
    from contribution_lens.losses import token_nll

    batch = adapter.to_token_batch(model, chunks)
    masked = cl.map_layers(model, batch, lambda layer: None, edit=remove_keys(keep), keep_logits=True).logits
    nll, count = token_nll(masked, batch.tokens, batch.attention_mask)
    assert result.ppl == pytest.approx(torch.exp(nll.sum() / count.sum()).item(), rel=1e-5)
    clean_nll, _ = token_nll(adapter.forward(model, batch), batch.tokens, batch.attention_mask)
    assert result.delta_loss == pytest.approx(((nll.sum() - clean_nll.sum()) / count.sum()).item(), rel=1e-5, abs=1e-7)


def test_mean_tail_rescale_gives_the_sink_the_mean_tail_norm() -> None:
    model = tiny_bridge("mha", biases=True, seed=3)
    ids = torch.randint(0, 50, (1, 8), generator=torch.Generator().manual_seed(1))
    from contribution_lens.analyses.sink_intervention import sink_scale
    from contribution_lens.interventions import scale_pattern

    W_O, _ = adapter.output_weights(model, 0)
    _, cache = model.run_with_cache(ids)
    seen = {}

    def grab(layer):
        seen["pattern"] = layer.pattern.clone()

    cl.map_layers(model, ids, grab, layers=[0], edit=scale_pattern(sink_scale("mean_tail", 1, W_O), {0}))
    norms = reference_contributions(cache[adapter.pattern_hook(0)], cache[adapter.value_hook(0)], W_O, "intra")[
        "value_norm"
    ]  # [b h k]
    expected = norms[..., 1:].mean(-1) / norms[..., 0]
    ratio = seen["pattern"][0, :, :, 0] / cache[adapter.pattern_hook(0)][0, :, :, 0]
    assert_close(ratio, expected[0, :, None].expand_as(ratio).float(), rtol=1e-4, atol=1e-5)
    assert_close(seen["pattern"][0, :, :, 1:], cache[adapter.pattern_hook(0)][0, :, :, 1:])


def test_bad_sink_settings() -> None:
    pattern, v, W_O = random_layer()
    with raises_bad_input("the sink needs 1 <= k"):
        sink_layer(pattern, v, W_O, k=0)
    model = tiny_bridge("mha")
    with raises_bad_input("unknown variant 'half'"):
        run_sink_intervention(model, torch.zeros(1, 5, dtype=torch.long), variant="half", progress=False)


def test_the_last_token_of_a_causal_text_is_not_taken_for_a_sink() -> None:
    """Under causal attention the last key is seen by its own query alone: its share is that query's
    self-attention, which may be the largest on a text without BOS; nothing else could sink into it."""
    from contribution_lens.analyses.sinks import detect_sinks, sink_shares

    pos = 6
    causal = torch.ones(pos, pos, dtype=torch.bool).tril()
    scores = torch.zeros(1, 2, pos, pos)
    scores[..., -1, -1] = 9.0  # the last query attends to itself
    scores[..., 2] += 1.0  # every later query leans on key 2
    pattern = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    found = detect_sinks(pattern, epsilon=0.3)
    assert not bool(found[:, -1].any()) and bool(found[:, 2].all()), found
    # The layer summary's sink (the largest share, `geometry.sink_positions`) is not the last token either.
    assert sink_shares(pattern).argmax(-1).tolist() == [2]
    # No key above the threshold but the last: the fallback is the largest share among the others.
    found = detect_sinks(pattern, epsilon=0.99)
    assert found.sum().item() == 1 and not bool(found[:, -1].any()), found
    v, W_O = torch.randn(1, pos, 2, 4), torch.randn(2, 4, 8)
    assert bool(sink_layer(pattern, v, W_O, sinks=found).queries.any())


def test_a_sink_at_the_last_position_of_a_bidirectional_pattern() -> None:
    g = torch.Generator().manual_seed(4)
    pos, n_heads = 7, 4
    scores = torch.randn(2, n_heads, pos, pos, generator=g)
    scores[..., -1] += 4.0  # every query parks most of its attention on the last token ([SEP]-like)
    pattern = scores.softmax(-1)
    v, W_O = torch.randn(2, pos, 2, 6, generator=g), torch.randn(n_heads, 6, 16, generator=g)
    from contribution_lens.analyses.sinks import detect_sinks

    found = detect_sinks(pattern, epsilon=0.3)
    assert found[:, -1].all() and found.sum().item() == 2
    s = sink_layer(pattern, v, W_O, sinks=found)
    # The closed forms, checked by brute force with the sink moved to the front.
    order = [pos - 1, *range(pos - 1)]
    moved = sink_layer(pattern[..., order][:, :, order], v[:, order], W_O, k=1)
    assert_close(s.sink_ratio[..., :-1], moved.sink_ratio[..., 1:], atol=1e-6)
    assert_close(s.cross[..., :-1], moved.cross[..., 1:], rtol=1e-4, atol=1e-5)
    assert bool(s.queries[:, :-1].all()) and not bool(s.queries[:, -1].any())


@pytest.mark.slow
def test_the_encoders_sink_is_found_and_its_parts_add_up(encoder_model) -> None:
    text = "The quick brown fox jumps over the lazy dog near the river bank."
    analysis = cl.sink_analysis(encoder_model, text, sinks="auto", layers=[1, 2, 3])
    n = len(analysis.str_tokens[0])
    for layer, s in analysis.items():
        positions = s.sinks[0].nonzero()[:, 0].tolist()
        assert positions == [0], f"layer {layer}: sinks at {positions}, [CLS] expected"
        assert s.queries[0].sum().item() == n - 1  # every other token sees the sink: no causal mask
    table = analysis.head_table()
    parts = table["intra_sink_contribution"] + table["intra_tail_contribution"]
    assert_close(torch.tensor(parts.values), torch.ones(len(parts), dtype=torch.float64), atol=1e-4)


def test_claim_verdicts_state_each_claim_against_its_threshold() -> None:
    from contribution_lens.analyses.sinks import claim_verdicts

    claims = {
        "share_queries_sink_anti_aligned_with_tail": 0.585,
        "share_queries_interior_minimum": 0.91,
        "mean_sink_contribution_intra": 0.22,
        "zero_delta_ppl": 6.97,
        "zero_layers_where_low_norm_cone_cosine_rises": 28.0,
        "zero_mean_low_norm_cone_cosine_clean": 0.377,
        "zero_mean_low_norm_cone_cosine_intervened": 0.756,
        "n_layers": 30.0,
    }
    table = claim_verdicts(claims)
    assert list(table.columns) == ["claim", "measured here", "threshold", "verdict"]
    assert table["verdict"].tolist() == [
        "partly (a majority, not a rule)",
        "supported",
        "not supported: the sink adds to the output on average",
        "supported",
    ]
    assert "58.5% of (head, query) pairs" in table["measured here"][0]
    assert "0.377 -> 0.756 (rises in 28 of 30 layers)" in table["measured here"][3]
    flipped = claim_verdicts(claims | {"mean_sink_contribution_intra": -0.1, "zero_delta_ppl": -1.0})
    assert flipped["verdict"][2] == "supported" and flipped["verdict"][3] == "not supported"
    assert len(claim_verdicts({k: v for k, v in claims.items() if not k.startswith("zero")})) == 3


@pytest.mark.usefixtures("as_a_user")
def test_bad_sink_positions() -> None:
    model = tiny_bridge("mha")
    with pytest.raises(ValueError, match="sink position 9 is outside the sequence of 3 tokens"):
        cl.sink_analysis(model, torch.tensor([[1, 2, 3]]), sinks=[9])
    with pytest.raises(ValueError, match="sinks must be positions, a mask or 'auto', got 'first'"):
        cl.sink_analysis(model, torch.tensor([[1, 2, 3]]), sinks="first")


def naive_part_factors(d, is_sink, queries):
    """The sink/tail factors as first written (kept as the oracle): masked full tensors and torch.quantile per head."""
    from contribution_lens.decomposition import Factor

    q_weight = queries.float()[:, None, :]
    n_queries = q_weight.sum((0, 2)).clamp_min(1)
    out = {}
    for part, keys in (("sink", is_sink), ("tail", ~is_sink)):
        key_weight = keys.to(d.attention.dtype)[:, None, None, :]
        attention = d.attention * key_weight
        mass = attention.sum(-1)
        for factor in Factor:
            values = d.factor(factor) * key_weight
            if factor in (Factor.ATTENTION, Factor.CONTRIBUTION):
                per_query = values.sum(-1)
            else:
                per_query = (attention * values).sum(-1) / mass.clamp_min(1e-30)
            out[f"{part}_{factor}"] = (per_query * q_weight).sum((0, 2)) / n_queries
    tail_pairs = d.valid & (~is_sink)[:, None, :] & queries[:, :, None]
    for name in ("cosine", "relative_norm"):
        values = d.factor(name)
        for q in (10, 50, 90):
            per_head = []
            for head in range(values.shape[1]):
                selected = values[:, head][tail_pairs & (d.attention[:, head] > 0)]
                per_head.append(torch.quantile(selected, q / 100) if selected.numel() else torch.tensor(0.0))
            out[f"tail_{name}_q{q}"] = torch.stack(per_head)
    return out


QUANTILE_CASES = {
    "normal": lambda g: torch.randn(5, 2000, generator=g),
    "heavy tail": lambda g: torch.randn(5, 2000, generator=g).exp() ** 6,
    "ties and signed zeros": lambda g: (
        torch.randint(-2, 3, (5, 2000), generator=g).float().where(torch.rand(5, 2000, generator=g) < 0.8, -0.0)
    ),
    "tiny and huge": lambda g: (
        torch.randn(5, 2000, generator=g) * torch.tensor([1e-40, 1e-20, 1.0, 1e20, 1e37])[:, None]
    ),
    "one value": lambda g: torch.full((5, 7), 0.25),
}


@pytest.mark.parametrize("case", QUANTILE_CASES, ids=list(QUANTILE_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_masked_quantiles_are_torch_quantile_exactly(case: str, dtype: torch.dtype) -> None:
    from contribution_lens.analyses.sinks import masked_quantiles

    g = torch.Generator().manual_seed(7)
    values = QUANTILE_CASES[case](g).to(dtype)
    keep = torch.rand(values.shape, generator=g) < 0.7
    keep[3] = False  # a row with nothing kept gives 0, as before
    keep[4, :1] = True
    qs = (0.1, 0.5, 0.9, 0.0, 1.0)
    got = masked_quantiles(values, keep, qs)
    assert got.shape == (len(qs), values.shape[0]) and got.dtype == dtype
    for row in range(values.shape[0]):
        selected = values[row][keep[row]]
        for index, q in enumerate(qs):
            expected = torch.quantile(selected, q) if selected.numel() else torch.zeros((), dtype=dtype)
            # The same order statistics and the same interpolation: equal to the bit.
            assert got[index, row].item() == expected.item(), (row, q)
    unmasked = masked_quantiles(values, None, qs)
    assert torch.equal(unmasked, torch.quantile(values, torch.tensor(qs, dtype=dtype), dim=1))


DOMAINS = {
    "unit": lambda g: torch.cat(
        [torch.rand(4, 1500, generator=g) * 2 - 1, torch.tensor([[-1.0, 1.0, 0.0, -0.0]] * 4)], 1
    ),
    "non-negative": lambda g: torch.cat(
        [torch.randn(4, 1500, generator=g).exp() ** 8, torch.tensor([[0.0, 1e-40, 3e-12, 1e20]] * 4)], 1
    ),  # a subnormal, and values under 2**-32 and over 2**32 (the first and last bins)
    "any": lambda g: torch.randn(4, 1504, generator=g) * torch.tensor([1e-30, 1.0, 1e10, 3.0])[:, None],
}


@pytest.mark.parametrize("domain", DOMAINS, ids=list(DOMAINS))
@pytest.mark.parametrize("bits", [10, 16])
def test_tile_quantiles_in_parts_are_torch_quantile_exactly(domain: str, bits: int) -> None:
    """Two sweeps over the items in three parts (counts, then the values of the bins found) give torch.quantile."""
    from contribution_lens.analyses.sinks import TileQuantiles, order_bins

    g = torch.Generator().manual_seed(11)
    values = DOMAINS[domain](g)
    left_out = torch.rand(values.shape, generator=g) < 0.2
    left_out[2] = True  # nothing kept: 0
    fractions = (0.1, 0.5, 0.9, 0.0, 1.0)
    found = TileQuantiles(4, fractions, torch.float32, values.device, domain, bits)
    parts = [slice(0, 500), slice(500, 1001), slice(1001, None)]
    for part in parts:
        found.add(values[:, part], left_out[:, part])
    for part in parts:
        found.collect(values[:, part], found.bins(values[:, part], left_out[:, part]))
    got = found.result()
    for row in range(4):
        kept = values[row][~left_out[row]]
        for index, q in enumerate(fractions):
            expected = torch.quantile(kept, q).item() if kept.numel() else 0.0
            assert got[index, row].item() == expected, (row, q)
    ordered = values.flatten().sort().values
    assert bool((order_bins(ordered, domain, bits).diff() >= 0).all())  # the bins never decrease


def test_tail_quantiles_that_outgrow_their_room_read_the_tiles_twice(bundled_model, monkeypatch) -> None:
    """Where the tail pairs do not fit `TAIL_KEPT_BYTES`, a second sweep over the tiles gives the same numbers."""
    from contribution_lens.analyses import sinks

    ids = torch.randint(1000, 9000, (1, 60), generator=torch.Generator().manual_seed(2))
    kept = cl.sink_analysis(bundled_model, ids, layers=[3, 20], quantiles=("intra", "inter"))
    swept = []
    collect = sinks.TailQuantiles.collect
    monkeypatch.setattr(sinks, "TAIL_KEPT_BYTES", 0)
    monkeypatch.setattr(sinks.TailQuantiles, "collect", lambda self, *a: swept.append(1) or collect(self, *a))
    twice = cl.sink_analysis(bundled_model, ids, layers=[3, 20], quantiles=("intra", "inter"))
    assert swept  # the second sweep ran
    for scope, per_layer in kept.factors.items():
        for layer, factors in per_layer.items():
            for name, value in factors.items():
                assert torch.equal(twice.factors[scope][layer][name], value), (scope, layer, name)


def padded_layer(seed: int = 3):
    """A causal layer of two texts, the second padded after 6 of 9 tokens, with some attention exactly 0."""
    pattern, v, W_O = random_layer(seed=seed)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 6:] = False
    pattern = pattern.clone()
    pattern[:, 1, 5:, 2] = 0.0  # attention exactly 0: such pairs leave the tail distributions
    pattern = pattern / pattern.sum(-1, keepdim=True)
    return pattern, v, W_O, mask


@pytest.mark.parametrize("scope", ["intra", "inter"])
@pytest.mark.parametrize("sinks", [None, [0, 3]], ids=["bos", "two sinks"])
@pytest.mark.parametrize("budget", [1 << 20, 256], ids=["one tile", "tiles of a row or two"])
def test_sink_factors_match_the_masked_oracle(scope: str, sinks, budget: int) -> None:
    """The factors read from the sink and tail outputs (`SinkRows.factors`) and the tail quantiles
    (`TailQuantiles`), the rows added a tile at a time, are the masked full tensors' of the oracle."""
    from contribution_lens.analyses.sinks import SinkRows, TailQuantiles, sink_mask
    from contribution_lens.decomposition import KeySide
    from contribution_lens.tiles import query_tiles

    pattern, v, W_O, mask = padded_layer()
    d = cl.decompose(pattern, v, W_O, scope=scope, attention_mask=mask)
    rows = SinkRows(v, W_O, sink_mask(sinks, 1, 2, 9, pattern.device), attention_mask=mask)
    tail = TailQuantiles(4, torch.float32, pattern.device, items=81)
    keys = KeySide.of(v, W_O, dtype=torch.float32, attention_mask=mask)
    for tile in query_tiles(9, 9, heads=4, batch=2, causal=True, budget=budget, min_rows=1):
        rows.add(pattern[:, :, tile.queries, : tile.keys], causal=True, first_query=tile.start)
        part = keys.decompose(pattern[:, :, tile.queries, : tile.keys], scope=cl.Scope.of(scope), causal=True,
                              first_query=tile.start)  # fmt: skip
        tail.add(part, rows.is_sink, rows.queries, tile.start)
    geometry = rows.geometry(sinks)
    got = rows.factors(cl.Scope.of(scope)) | tail.result()
    expected = naive_part_factors(d, geometry.sinks, geometry.queries)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        # Sums in another order (and quantiles of cosines rounded in tiles): float32 rounding.
        assert_close(got[name], value, rtol=1e-5, atol=1e-6)


def test_sink_factors_on_the_bundled_model_match_the_oracle(bundled_model) -> None:
    text = "The capital of France is Paris, and it is a big city with many old streets."
    kept = {}

    def keep_oracle(layer):
        from contribution_lens.analyses.sinks import sink_layer as geometry_of

        geometry = geometry_of(layer.pattern, layer.v, layer.W_O)
        kept[layer.layer] = {
            scope: naive_part_factors(layer.decompose(scope), geometry.sinks, geometry.queries)
            for scope in ("intra", "inter")
        }

    cl.map_layers(bundled_model, text, keep_oracle, layers=[0, 15, 29])
    analysis = cl.sink_analysis(bundled_model, text, layers=[0, 15, 29], quantiles=("intra", "inter"))
    for scope, per_layer in analysis.factors.items():
        for layer, factors in per_layer.items():
            for name, value in kept[layer][str(scope)].items():
                # The analysis decomposes a tile of queries at a time: its products round in their own order.
                assert_close(factors[name], value, rtol=1e-5, atol=1e-6)


def kept_numbers() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The kept numbers and their float32-vs-float64 gaps, by ``case|key``."""
    import sink_cases
    from safetensors.torch import load_file

    return load_file(str(sink_cases.NUMBERS)), load_file(str(sink_cases.GAPS))


def kept_mismatches(case: str, got: dict[str, torch.Tensor]) -> list[str]:
    """Every number of ``case`` outside its tolerance (`sink_cases.tolerance`), one line each."""
    import sink_cases

    kept, gaps = kept_numbers()
    expected = {key.split("|", 1)[1]: value for key, value in kept.items() if key.startswith(f"{case}|")}
    assert expected and got.keys() == expected.keys(), case
    wrong = []
    for key, value in expected.items():
        assert not (value.is_floating_point() and bool(value.isnan().any())), f"{case} {key} holds NaN"
        gap = gaps[f"{case}|{key}"] if value.is_floating_point() else None
        message = sink_cases.mismatches(got[key], value, gap)
        if message:
            wrong.append(f"{case} {key}: {message}")
    return wrong


def test_sink_analysis_keeps_its_numbers(bundled_model) -> None:
    """Every number of every case is the one the analysis gave before it was made cheaper.

    To the tolerance its conditioning allows on any CPU (`sink_cases`'s docstring); the file's numbers
    are the fixed tail's, and none is NaN.
    """
    import sink_cases

    kept, gaps = kept_numbers()
    assert gaps.keys() == {key for key, value in kept.items() if value.is_floating_point()}
    wrong = [line for case, run in sink_cases.cases(bundled_model, tiny_bridge).items()
             for line in kept_mismatches(case, sink_cases.numbers(run()))]  # fmt: skip
    assert not wrong, "\n".join(wrong)


@pytest.fixture(scope="module")
def padded_batch(bundled_model) -> dict[str, torch.Tensor]:
    """The padded batch's numbers (the worst-conditioned case: the sink takes nearly all the attention)."""
    import sink_cases

    return sink_cases.numbers(sink_cases.cases(bundled_model, tiny_bridge)["bundled padded batch"]())


@pytest.mark.parametrize("change", [1e-4, -1e-4])
def test_the_kept_numbers_catch_a_small_change(padded_batch, change: float) -> None:
    """The tolerances are not so loose that a change of the analysis by 1e-4 relative would pass."""
    changed = {k: v * (1 + change) if v.is_floating_point() else v for k, v in padded_batch.items()}
    wrong = kept_mismatches("bundled padded batch", changed)
    assert len(wrong) > len(padded_batch) // 2, wrong
    assert not kept_mismatches("bundled padded batch", padded_batch)


def test_one_and_two_threads_agree_to_the_kept_tolerance(bundled_model, padded_batch) -> None:
    """One thread and two (another summation order in torch's kernels) both hold the kept numbers.

    Two thread counts sum in other orders, as two CPUs do: a run with each is within the tolerance of
    the kept file, and the two runs within that tolerance of each other.
    """
    import sink_cases

    before = torch.get_num_threads()
    runs = {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            runs[threads] = sink_cases.numbers(sink_cases.cases(bundled_model, tiny_bridge)["bundled padded batch"]())
    finally:
        torch.set_num_threads(before)
    for threads, got in runs.items():
        assert not kept_mismatches("bundled padded batch", got), threads
    _, gaps = kept_numbers()
    between = [
        f"{key}: {message}"
        for key, one in runs[1].items()
        if (message := sink_cases.mismatches(runs[2][key], one, gaps.get(f"bundled padded batch|{key}")))
    ]
    assert not between, "\n".join(between)


def test_tail_quantiles_are_computed_where_asked(bundled_model) -> None:
    """By default the inter scope's tail quantiles alone, the same numbers as when both are asked for."""
    import sink_cases

    both = cl.sink_analysis(bundled_model, sink_cases.TEXTS, layers=[5, 29], quantiles=("intra", "inter"))
    default = cl.sink_analysis(bundled_model, sink_cases.TEXTS, layers=[5, 29])
    none = cl.sink_analysis(bundled_model, sink_cases.TEXTS, layers=[5, 29], quantiles=())
    quantile_columns = [c for c in both.head_table() if "_q" in c]
    assert len(quantile_columns) == 12
    inter = [c for c in quantile_columns if c.startswith("inter_")]
    assert [c for c in default.head_table() if "_q" in c] == inter
    assert not [c for c in none.head_table() if "_q" in c]
    without = [c for c in both.head_table() if "_q" not in c]
    assert_close(
        torch.tensor(default.head_table()[without + inter].to_numpy()),
        torch.tensor(both.head_table()[without + inter].to_numpy()),
        rtol=0,
        atol=0,
    )
    assert_close(
        torch.tensor(none.head_table()[without].to_numpy()),
        torch.tensor(both.head_table()[without].to_numpy()),
        rtol=0,
        atol=0,
    )
    assert default.claims() == pytest.approx(both.claims(), nan_ok=True)
    assert list(default.figures()) == list(both.figures())


@pytest.mark.parametrize(
    ("quantiles", "message"),
    [
        ("intra", "quantiles must be a sequence of scopes, e.g. ('intra',), got the string 'intra'"),
        (("intra", "heads"), "quantiles must hold scopes of ('intra', 'inter'), got 'heads'"),
        (("intra",), "quantiles asks for the intra scope, which scopes=('inter',) does not compute"),
    ],
)
def test_bad_quantile_scopes(quantiles, message) -> None:
    with raises_bad_input(message):
        cl.sink_analysis(tiny_bridge("gqa"), torch.tensor([[1, 2, 3, 4]]), scopes=("inter",), quantiles=quantiles)
