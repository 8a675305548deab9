"""Why a head attends: the split matches a float64 oracle of every pair, adds up, is refused where not exact."""

import dataclasses

import pytest
import torch

import architectures
import contribution_lens as cl
from conftest import VARIANTS, assert_close, tiny_bridge
from contribution_lens import adapter
from contribution_lens.analyses import qk_attribution as qk_module
from contribution_lens.analyses.qk_attribution import QKAttribution, QKTape
from qk_reference import oracle_pairs

IDS = torch.tensor([1, 5, 7, 9, 3, 2, 11, 4, 7, 9])
ARCHS = [pytest.param(v, b, id=f"{v}-{'bias' if b else 'nobias'}") for v in VARIANTS for b in (False, True)]
TINY = ["GPT2LMHeadModel", "LlamaForCausalLM", "GPTNeoXForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
        "Qwen2ForCausalLM", "PhiForCausalLM", "BertForMaskedLM"]  # fmt: skip


def assert_matches_oracle(model, ids: torch.Tensor, layer: int, head: int, *, post_ln: bool = False) -> QKAttribution:
    """Every pair, both sides and the scores of every (query, seen key) against the float64 oracle."""
    oracle = oracle_pairs(model, ids, layer, head, post_ln=post_ln)
    result = cl.qk_attribution(model, ids, layer, head, query=None)
    assert list(result.query_components) == oracle.query_components
    assert list(result.key_components) == oracle.key_components
    scale = float(oracle.pairs.sum((0, 1)).abs().max())
    for i in range(len(ids)):
        keys = torch.nonzero(result.visible[i]).flatten().tolist()
        for j in keys[:: max(1, len(keys) // 4)] + keys[-1:]:
            pairs = torch.tensor(result.pairs(j, query=i).to_numpy())
            assert_close(pairs, oracle.pairs[:, :, i, j], rtol=1e-4, atol=1e-5 * scale)
        key_side = torch.tensor(result.advantage("key", query=i).to_numpy())
        assert key_side.shape == (len(oracle.key_components), len(keys))
        terms = result.terms("key", query=i)[0, 0][:, keys].double()
        assert_close(terms, oracle.pairs[:, :, i, keys].sum(0), rtol=1e-4, atol=1e-5 * scale)
        terms = result.terms("query", query=i)[0, 0][:, keys].double()
        assert_close(terms, oracle.pairs[:, :, i, keys].sum(1), rtol=1e-4, atol=1e-5 * scale)
    scores = oracle.pairs.sum((0, 1))
    if not torch.equal(oracle.scores, result.pattern[0].double()):  # a bridge that fires real scores
        rebuilt = scores if result.softcap is None else result.softcap * torch.tanh(scores / result.softcap)
        seen = result.visible
        assert_close(rebuilt[seen], oracle.scores[seen], rtol=1e-4, atol=1e-5 * scale)
    alpha = torch.softmax(
        scores.masked_fill(~result.visible, -torch.inf)
        if result.softcap is None
        else (result.softcap * torch.tanh(scores / result.softcap)).masked_fill(~result.visible, -torch.inf),
        -1,
    )
    assert_close(alpha, result.pattern[0].double(), rtol=1e-4, atol=1e-5)
    return result


@pytest.mark.parametrize(("variant", "biases"), ARCHS)
def test_every_pair_matches_the_float64_oracle_on_tiny_bridges(variant: str, biases: bool) -> None:
    model = tiny_bridge(variant, biases=biases)
    for head in (0, 3):
        assert_matches_oracle(model, IDS, 1, head)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Tiny checkpoints of each family, built with transformers' own classes and loaded as a user's folder."""
    folder = tmp_path_factory.mktemp("qk")
    return {name: cl.load_model(str(architectures.build(name, folder / name))) for name in TINY}


@pytest.mark.slow
@pytest.mark.parametrize("name", TINY)
def test_every_pair_matches_the_float64_oracle_on_tiny_checkpoints(name: str, checkpoints: dict) -> None:
    model = checkpoints[name]
    ids = model.tokenizer.encode(architectures.TEXT, return_tensors="pt")[0][:12]
    result = assert_matches_oracle(model, ids, 1, 3, post_ln=name == "BertForMaskedLM")
    expected = {
        "GPT2LMHeadModel": {"pos_embed", "L0.b_O", "L1.ln1.b", "b_Q"},
        "GPTNeoXForCausalLM": {"L0.b_O", "L1.ln1.b", "b_Q"},
        "Qwen2ForCausalLM": {"b_Q"},
        "PhiForCausalLM": {"L1.ln1.b", "b_Q"},
        "BertForMaskedLM": {"pos_embed", "token_type_embed", "embed_ln.b", "L0.ln1.b", "L0.ln2.b", "b_Q"},
    }.get(name, set())
    assert expected <= set(result.query_components), result.query_components
    assert (result.cos is not None) == (model.cfg.positional_embedding_type == "rotary")
    if name == "Gemma2ForCausalLM":
        assert result.softcap == 50.0  # the terms add up to the score before the cap
    if name == "GPTNeoXForCausalLM":
        assert result.cos is not None and result.cos.shape[-1] < model.cfg.d_head  # partial rotary
    if name == "BertForMaskedLM":
        assert bool(result.visible.all())  # bidirectional: every query sees every key


def test_every_head_and_query_at_once_agrees_with_one_head_at_a_time() -> None:
    model = tiny_bridge("gqa", biases=True)
    every = cl.qk_attribution(model, IDS, 1, None, query=None)
    assert every.heads == (0, 1, 2, 3) and every.kv_index == (0, 0, 1, 1)
    for head in (1, 2):
        alone = cl.qk_attribution(model, IDS, 1, head, query=[3, -1])
        assert_close(every.terms("key", head=head, query=[3, 9]), alone.terms("key"), rtol=1e-5, atol=1e-6)
        assert_close(every.terms("query", head=head, query=[3, 9]), alone.terms("query"), rtol=1e-5, atol=1e-6)
    assert cl.qk_attribution(model, IDS, 1, heads=[2, 0]).heads == (0, 2)


def test_sides_add_up_to_the_scores_and_advantages_to_log_alpha_plus_entropy() -> None:
    model = tiny_bridge("gqa", biases=True)
    result = cl.qk_attribution(model, IDS, 1, 2, query=6)  # one head, one query: pandas
    scores = result.scores
    assert list(scores.index) == list(range(7)) and scores.name == "score"
    for table in (result.key_side, result.query_side):
        assert list(table.columns) == list(range(7))
        assert_close(torch.tensor(table.sum().to_numpy()), torch.tensor(scores.to_numpy()), rtol=1e-5, atol=1e-6)
    target = result.log_alpha_plus_entropy()
    for side in ("key", "query"):
        total = result.advantage(side).sum()
        assert_close(torch.tensor(total.to_numpy()), torch.tensor(target.to_numpy()), rtol=1e-4, atol=1e-5)
    alpha = torch.softmax(torch.tensor(scores.to_numpy()), -1)
    assert_close(alpha, result.pattern[0, 0, :7].double(), rtol=1e-4, atol=1e-6)
    pairs = result.pairs(4)
    assert pairs.index.name == "query component" and pairs.columns.name == "key component"
    assert float(pairs.to_numpy().sum()) == pytest.approx(float(scores[4]), rel=1e-4, abs=1e-6)
    cell = result.cell(key=4)
    assert_close(torch.tensor(cell.key_side.to_numpy()), torch.tensor(result.advantage("key")[4].to_numpy()))
    assert_close(torch.tensor(cell.query_side.to_numpy()), torch.tensor(result.advantage("query")[4].to_numpy()))
    assert cell.total == pytest.approx(cell.log_alpha_plus_entropy, abs=1e-4)
    assert repr(cell).startswith(f"QKCell(head=2, query=6, key=4, alpha={cell.alpha:.3g}, total=")
    assert cell.score == pytest.approx(float(scores[4]), rel=1e-5)
    assert result.cell().key == int(result.pattern[0, 0].argmax())  # default: the key it attends to most


def test_several_queries_give_tensors_and_the_table_holds_every_term() -> None:
    model = tiny_bridge("mqa", biases=True)
    result = cl.qk_attribution(model, IDS, 1, 0, query=[2, 5])
    assert result.key_side.shape == (2, len(result.key_components), 6)  # [query component key]
    assert bool((result.key_side[0, :, 3:] == 0).all())  # query 2 sees keys 0..2 only
    table = result.to_dataframe()
    assert list(table.columns) == ["side", "target_head", "query", "key", "key_token", "component", "layer", "head",
                                   "value", "advantage"]  # fmt: skip
    assert len(table) == 2 * (3 + 6) * len(result.key_components)
    sums = table[table["side"] == "key"].groupby(["query", "key"])["value"].sum()
    assert sums[(5, 4)] == pytest.approx(float(result.score_table(query=5)[4]), rel=1e-5)
    heads = table.dropna(subset=["head"])
    assert set(heads["component"]) == {"L0H0", "L0H1", "L0H2", "L0H3"} and set(heads["layer"]) == {0}
    top = result.top(5, side="query", key=1, query=5)
    assert len(top) == 5 and set(top["key"]) == {1} and set(top["side"]) == {"query"}
    assert list(top["advantage"].abs()) == sorted(top["advantage"].abs(), reverse=True)


def test_a_half_precision_model_is_split_in_float32_within_its_own_rounding() -> None:
    model = tiny_bridge("gqa", biases=True).to(torch.bfloat16)
    result = cl.qk_attribution(model, IDS, 1, 1, query=None)
    assert result.query_parts.dtype == result.key_parts.dtype == torch.float32
    # The model's own bfloat16 scores are rounded to 8 bits: the check allows that (3e-2), the sums are exact.
    assert_close(result.terms("key").sum(2)[0], result.score_table().masked_fill(~result.visible, 0.0))
    assert float(result.cell(query=-1).total) == pytest.approx(result.cell(query=-1).log_alpha_plus_entropy, abs=0.05)


def test_save_and_load_round_trip(tmp_path) -> None:
    result = cl.qk_attribution(tiny_bridge("gqa", biases=True), IDS, 1, [0, 3], query=[4, 8])
    loaded = QKAttribution.load(result.save(tmp_path / "qk.safetensors"))
    assert (loaded.heads, loaded.queries, loaded.layer) == (result.heads, result.queries, result.layer)
    assert loaded.query_components == result.query_components
    assert loaded.to_dataframe().equals(result.to_dataframe())
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes((tmp_path / "qk.safetensors").read_bytes()[:100])
    with pytest.raises(ValueError, match=rf"^{truncated} is not a QKAttribution written by QKAttribution.save"):
        QKAttribution.load(truncated)


def test_figures_draw_the_tables() -> None:
    result = cl.qk_attribution(tiny_bridge("gqa", biases=True), IDS, 1, 1, query=7)
    figures = result.figures()
    assert set(figures) == {"advantage", "key", "heads"}
    heat = figures["advantage"].data[0]
    assert heat.zmid == 0 and list(heat.y) == list(result.key_components)
    assert_close(torch.tensor(heat.z), torch.tensor(result.advantage("key").to_numpy()), rtol=1e-6, atol=1e-7)
    cell = result.cell()
    bars = figures["key"].data[0]
    drawn = {label: x for label, x in zip(bars.y, bars.x, strict=True) if not label.startswith("other ")}
    assert drawn == pytest.approx(cell.key_side.loc[list(drawn)].to_dict())
    assert f"key {cell.key}:" in figures["key"].layout.title.text
    grid = figures["heads"].data[0]
    assert grid.z[0][2] == pytest.approx(cell.key_side["L0H2"])


def count_passes(model) -> list[int]:
    passes: list[int] = []
    model.hook_dict["hook_embed"].add_hook(lambda tensor, hook: passes.append(1))
    return passes


@pytest.mark.usefixtures("as_a_user")
def test_bad_inputs_are_refused_before_any_pass() -> None:
    model = tiny_bridge("gqa")
    passes = count_passes(model)
    try:
        with pytest.raises(ValueError, match=r"layer 2 does not exist: the model has 2 layers \(0\.\.1\)"):
            cl.qk_attribution(model, IDS, 2, 0)
        with pytest.raises(ValueError, match=r"head 4 does not exist: layers of this model have 4 heads \(0\.\.3\)"):
            cl.qk_attribution(model, IDS, 1, 4)
        with pytest.raises(ValueError, match=r"position 10 does not exist: the text has 10 tokens"):
            cl.qk_attribution(model, IDS, 1, 0, query=[3, 10])
        with pytest.raises(ValueError, match="give head= or heads=, not both"):
            cl.qk_attribution(model, IDS, 1, 0, heads=[1])
        with pytest.raises(ValueError, match="one text at a time; got a batch of 2"):
            cl.qk_attribution(model, torch.stack([IDS, IDS]), 1, 0)
        with pytest.raises(
            ValueError, match=r"dtype must be torch.float32 or torch.float64 \(or its name.*; got torch.float16"
        ):
            cl.qk_attribution(model, IDS, 1, 0, dtype=torch.float16)
        with pytest.raises(TypeError, match="layer must be one integer, got list"):
            cl.qk_attribution(model, IDS, [0, 1], 0)
        assert passes == []
    finally:
        model.hook_dict["hook_embed"].remove_hooks()
    result = cl.qk_attribution(model, IDS, 1, [0, 1], query=[3, 6])
    with pytest.raises(
        ValueError, match=r"key 5 is not seen by query 3 \(a decoder's query sees the keys up to itself"
    ):
        result.pairs(5, query=3, head=0)
    with pytest.raises(ValueError, match=r"side must be 'key' or 'query', got 'value'"):
        result.advantage("value")
    with pytest.raises(ValueError, match=r"head 2 was not computed; this result holds heads \[0, 1\]"):
        result.cell(query=3, head=2)
    with pytest.raises(ValueError, match=r"query 4 was not computed; this result holds queries \[3, 6\]"):
        result.cell(query=4, head=0)
    with pytest.raises(ValueError, match=r"this result holds heads \[0, 1\]: pass head="):
        result.pairs(1, query=3)


def doubled_scale(monkeypatch) -> None:
    """A scale that is not the model's: the rebuilt scores miss its own."""
    form = adapter.qk_form

    def doubled(model, layer):
        return dataclasses.replace(form(model, layer), scale=2 * form(model, layer).scale)

    monkeypatch.setattr(adapter, "qk_form", doubled)


def test_a_wrongly_wired_model_fails_the_check_naming_the_architecture(monkeypatch) -> None:
    model = tiny_bridge("gqa")
    doubled_scale(monkeypatch)
    with pytest.raises(RuntimeError) as error:
        cl.qk_attribution(model, IDS, 1, 0)
    assert str(error.value).startswith("the scores rebuilt from the terms of layer 1 heads [0] miss the model's: ")
    assert "its pattern (after softmax) by 0." in str(error.value)
    assert "TransformerLensNative's attention is not wired the way the adapter reads it" in str(error.value)


@pytest.mark.slow
def test_the_check_compares_the_models_own_pre_softmax_scores(checkpoints: dict, monkeypatch) -> None:
    model = checkpoints["LlamaForCausalLM"]
    doubled_scale(monkeypatch)
    # Scores twice the model's miss them by exactly 1 (relative), the pattern by less.
    with pytest.raises(RuntimeError, match=r"its pre-softmax scores by 1 and its pattern .*: LlamaForCausalLM's"):
        cl.qk_attribution(model, architectures.TEXT, 1, 0)


@pytest.mark.slow
def test_alibi_is_refused_naming_the_form(tmp_path) -> None:
    model = cl.load_model(str(architectures.build("BloomForCausalLM", tmp_path / "bloom")))
    passes = count_passes(model)
    with pytest.raises(ValueError, match=r"cannot split the scores of BloomForCausalLM layer 1: its attention uses "
                                         r"ALiBi position biases"):  # fmt: skip
        cl.qk_attribution(model, architectures.TEXT, 1, 0)
    assert passes == []


def test_text_follows_the_engines_bos_default(bundled_model) -> None:
    text = "The cat sat on the mat."
    result = cl.qk_attribution(bundled_model, text, 2, 0)
    assert torch.equal(result.tokens, cl.to_token_batch(bundled_model, text).tokens[0])
    without = cl.qk_attribution(bundled_model, text, 2, 0, prepend_bos=False)
    assert len(without.tokens) == len(result.tokens) - 1


@pytest.mark.slow
def test_the_bundled_models_match_the_oracle(bundled_model, gemma, encoder_model) -> None:
    ids = cl.to_token_batch(bundled_model, "When Mary and John went to the store, John gave").tokens[0]
    assert_matches_oracle(bundled_model, ids, 6, 4)
    ids = cl.to_token_batch(gemma, "When Mary and John went to the store, John gave").tokens[0]
    assert_matches_oracle(gemma, ids, 5, 1)
    ids = cl.to_token_batch(encoder_model, "The cat sat on the mat because it was warm.").tokens[0]
    assert_matches_oracle(encoder_model, ids, 2, 3, post_ln=True)


# --- a kept pass: the same splits, from what one pass recorded --------------------------------------


def assert_same_split(kept: QKAttribution, fresh: QKAttribution) -> None:
    """Bit for bit: the tape feeds the pass's own tensors to the pass's own projector."""
    assert (kept.heads, kept.queries) == (fresh.heads, fresh.queries)
    assert (kept.query_components, kept.key_components) == (fresh.query_components, fresh.key_components)
    for side in ("key", "query"):
        assert torch.equal(kept.terms(side), fresh.terms(side)), side
        assert torch.equal(kept.advantage(side), fresh.advantage(side)), side
    assert torch.equal(kept.pattern, fresh.pattern) and torch.equal(kept.visible, fresh.visible)


def recorded(model, ids: torch.Tensor, rows: list[int]) -> QKTape:
    batch = cl.to_token_batch(model, ids)
    tape = QKTape.plan(model, batch, last=model.cfg.n_layers - 1, rows=rows)
    assert tape is not None
    tape.run()
    assert tape.nbytes <= QKTape.estimate_bytes(model, batch.tokens.shape[1], len(rows), tape.last)
    return tape


@pytest.mark.parametrize(("variant", "biases"), ARCHS)
def test_a_tape_gives_the_split_of_a_pass_on_tiny_bridges(variant: str, biases: bool) -> None:
    model = tiny_bridge(variant, biases=biases)
    tape = recorded(model, IDS, [2, 5, 9])
    for layer in (0, 1):
        for head, rows in ((0, [5, 9]), (None, [2])):
            assert_same_split(tape.attribution(layer, head, rows), cl.qk_attribution(model, IDS, layer, head, rows))


@pytest.mark.slow
@pytest.mark.parametrize("name", TINY)
def test_a_tape_gives_the_split_of_a_pass_on_tiny_checkpoints(name: str, checkpoints: dict) -> None:
    model = checkpoints[name]
    ids = model.tokenizer.encode(architectures.TEXT, return_tensors="pt")[0][:12]
    tape = recorded(model, ids, [3, 11])
    assert_same_split(tape.attribution(1, None, [3, 11]), cl.qk_attribution(model, ids, 1, None, [3, 11]))


@pytest.mark.slow
def test_a_tape_gives_the_split_of_a_pass_on_the_bundled_models(bundled_model, gemma, encoder_model) -> None:
    for model, layer in ((bundled_model, 29), (gemma, 5), (encoder_model, 5)):
        ids = cl.to_token_batch(model, "When Mary and John went to the store, John gave").tokens[0]
        rows = [len(ids) - 4, len(ids) - 1]
        tape = recorded(model, ids, rows)
        for head in (0, 2):
            assert_same_split(tape.attribution(layer, head), cl.qk_attribution(model, ids, layer, head, rows))


def test_a_tape_refuses_what_it_did_not_record_and_checks_like_a_pass(monkeypatch) -> None:
    model = tiny_bridge("gqa")
    tape = recorded(model, IDS, [3, 6])
    with pytest.raises(
        ValueError, match=r"the tape holds layers \[0, 1\] and queries \[3, 6\]: not layer 1 at queries \[4\]"
    ):
        tape.attribution(1, 0, [4])
    with pytest.raises(ValueError, match=r"layer 2 does not exist: the model has 2 layers \(0\.\.1\)"):
        tape.attribution(2, 0)
    with pytest.raises(ValueError, match=r"head 4 does not exist"):
        tape.attribution(1, 4)
    with pytest.raises(ValueError, match=r"position 10 does not exist: the text has 10 tokens"):
        QKTape.plan(model, cl.to_token_batch(model, IDS), 1, [3, 10])
    with pytest.raises(ValueError, match=r"layer 2 does not exist: the model has 2 layers"):
        QKTape.plan(model, cl.to_token_batch(model, IDS), 2, [3])
    with pytest.raises(ValueError, match="a QKTape records one text, got a batch of 2"):
        QKTape.plan(model, cl.to_token_batch(model, torch.stack([IDS, IDS])), 1, [3])
    doubled_scale(monkeypatch)
    with pytest.raises(RuntimeError, match="is not wired the way the adapter reads it"):
        tape.attribution(1, 0)


@pytest.mark.slow
def test_no_tape_where_the_split_is_refused(tmp_path) -> None:
    model = cl.load_model(str(architectures.build("BloomForCausalLM", tmp_path / "bloom")))
    assert QKTape.plan(model, cl.to_token_batch(model, IDS), 1, [3]) is None  # ALiBi: qk_attribution refuses it


# --- known answers on the bundled models ------------------------------------------------------------


def repeated_sequence(model, length: int = 20) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    first = torch.randint(1000, 10000, (length,), generator=generator)
    return torch.cat([torch.tensor([model.tokenizer.bos_token_id]), first, first])


def induction_and_previous_token_scores(model, ids: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per layer and head: mean attention from the second copy to the token after the first occurrence; to the last."""
    second = torch.arange(length + 1, len(ids))
    positions = torch.arange(2, len(ids))
    scores = cl.map_layers(
        model,
        ids,
        lambda layer: torch.stack(
            [layer.pattern[0][:, second, second - length + 1].mean(-1),
             layer.pattern[0][:, positions, positions - 1].mean(-1)]
        ),
    )  # fmt: skip
    stacked = torch.stack([scores[layer] for layer in scores.layers])  # [layer 2 head]
    return stacked[:, 0], stacked[:, 1]


def k_composition(model, threshold: float = 0.3, length: int = 20) -> list[tuple[str, str, float]]:
    """For each induction head: the component with the largest mean key-side advantage at the induction key.

    With the previous-token score of that component where it is an earlier head (0.0 otherwise).
    """
    ids = repeated_sequence(model, length)
    induction, previous = induction_and_previous_token_scores(model, ids, length)
    second = list(range(length + 1, len(ids)))
    keys = torch.tensor(second) - length + 1
    found = []
    for layer in sorted({layer for layer, _ in (induction > threshold).nonzero().tolist()}):
        heads = (induction[layer] > threshold).nonzero().flatten().tolist()
        result = cl.qk_attribution(model, ids, layer, heads, query=second)  # one pass for the layer's heads
        for head in heads:
            advantage = result.advantage("key", head=head)[torch.arange(len(second)), :, keys].mean(0)
            top = result.key_components[int(advantage.argmax())]
            source_layer, source_head = qk_module.component_layer_head(top)
            score = 0.0 if source_head is None else float(previous[source_layer, source_head])
            found.append((f"L{layer}H{head}", top, score if score >= 0.4 else 0.0))
    return found


@pytest.mark.slow
def test_induction_heads_are_k_composed_with_a_previous_token_head(bundled_model, gemma) -> None:
    for model, heads, composed in ((bundled_model, 8, 6), (gemma, 5, 4)):
        found = k_composition(model)
        assert len(found) == heads, found
        yes = [(head, top) for head, top, score in found if score > 0]
        assert len(yes) == composed, found  # the others: an MLP (SmolLM2's L23H2 and L23H7, Gemma's L13H3)
        for head, top in yes:  # the previous-token head sits in an earlier layer
            assert qk_module.component_layer_head(top)[0] < qk_module.component_layer_head(head)[0]


SINK_TEXT = (
    "The quick brown fox jumps over the lazy dog. Alice went to the market to buy apples, and Bob stayed home to "
    "read a book."
)


def sink_sources(model, layers: list[int], threshold: float = 0.8) -> dict[str, str]:
    """For every head of ``layers`` that parks on key 0: the component with the largest key-side advantage there."""
    shares = cl.map_layers(model, SINK_TEXT, lambda layer: layer.pattern[0][:, 4:, 0].mean(-1), layers=layers)
    found = {}
    for layer in layers:
        heads = (shares[layer] > threshold).nonzero().flatten().tolist()
        result = cl.qk_attribution(model, SINK_TEXT, layer, heads, query=list(range(4, len(shares.str_tokens[0]))))
        for head in heads:
            advantage = result.advantage("key", head=head)[:, :, 0].mean(0)  # [component], averaged over queries
            found[f"L{layer}H{head}"] = result.key_components[int(advantage.argmax())]
    return found


@pytest.mark.slow
def test_what_makes_the_sink_attractive_is_an_mlps_write_at_bos(bundled_model, gemma) -> None:
    smol = sink_sources(bundled_model, [14, 21, 26])
    assert len(smol) >= 4 and set(smol.values()) == {"L11.mlp"}, smol
    gem = sink_sources(gemma, [1, 5, 17])
    assert len(gem) >= 4 and all(name.endswith(".mlp") for name in gem.values()), gem
