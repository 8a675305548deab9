"""A model's own BOS convention: texts are tokenised as TransformerLens tokenises them for that model.

TransformerLens records per architecture whether a BOS is prepended (``cfg.default_prepend_bos``):
True for the bundled models, False for Qwen2. The model here is a tiny random Qwen2 checkpoint
made with transformers' own classes and loaded from its folder, as a user's would be.
"""

import pytest
import torch

import architectures
import contribution_lens as cl
from conftest import assert_close
from contribution_lens import adapter
from contribution_lens.analyses.sinks import detect_sinks

TEXT = "When Mary and John went to the store, John gave a drink to"


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory):
    folder = architectures.build("Qwen2ForCausalLM", tmp_path_factory.mktemp("qwen2") / "tiny-qwen2")
    return cl.load_model(str(folder))


def test_the_tiny_qwen2_takes_no_bos_and_the_bundled_models_do(qwen, bundled_model) -> None:
    assert qwen.cfg.default_prepend_bos is False
    assert bundled_model.cfg.default_prepend_bos is True
    assert adapter.prepends_bos(qwen) is False and adapter.prepends_bos(bundled_model) is True


def test_logit_attribution_explains_what_the_model_says_on_the_text_as_it_tokenises_it(qwen) -> None:
    tokens = qwen.to_tokens(TEXT)  # the model's own convention: no BOS
    assert int(tokens[0, 0]) not in adapter.start_ids(qwen)
    with torch.inference_mode():
        logits = qwen(tokens)[0, -1]
    target, foil = int(logits.argmax()), int(logits.argmin())
    result = cl.logit_attribution(qwen, TEXT, target=target, foil=foil)
    assert result.str_tokens == adapter.token_labels(qwen, tokens[0].tolist())
    assert result.logit == pytest.approx(float(logits[target] - logits[foil]), rel=1e-4, abs=1e-5)
    with_bos = cl.logit_attribution(qwen, TEXT, target=target, foil=foil, prepend_bos=True)
    assert with_bos.str_tokens == [qwen.tokenizer.bos_token, *result.str_tokens]
    with torch.inference_mode():
        forced = qwen(qwen.to_tokens(TEXT, prepend_bos=True))[0, -1]
    assert with_bos.logit == pytest.approx(float(forced[target] - forced[foil]), rel=1e-4, abs=1e-5)
    assert with_bos.logit != pytest.approx(result.logit, rel=1e-3)  # the BOS changes the prediction explained


def labels_of(result) -> list[str]:
    return result.str_tokens[0] if isinstance(result.str_tokens[0], list) else result.str_tokens


@pytest.mark.parametrize(
    "call",
    [
        lambda model, **kw: cl.attention_geometry(model, TEXT, layers=[0], **kw),
        lambda model, **kw: cl.sink_analysis(model, TEXT, layers=[1], **kw),
        lambda model, **kw: cl.flow(model, TEXT, **kw),
        lambda model, **kw: cl.map_layers(model, TEXT, lambda layer: None, layers=[0], **kw),
        lambda model, **kw: cl.explain_generation(model, TEXT, max_new_tokens=1, flow=False, **kw)[0].attribution,
        lambda model, **kw: cl.inspect(model, TEXT, **kw).meta,
    ],
    ids=["attention_geometry", "sink_analysis", "flow", "map_layers", "explain_generation", "inspect"],
)
def test_every_text_taking_function_follows_the_model_and_prepend_bos_overrides_it(qwen, call) -> None:
    own = adapter.token_labels(qwen, qwen.to_tokens(TEXT)[0].tolist())
    bos = qwen.tokenizer.bos_token

    def labels(result) -> list[str]:
        if isinstance(result, dict):  # the inspector's meta: "position:token" key labels
            return [label.split(":", 1)[1] for label in result["key_labels"]]
        return labels_of(result)

    assert labels(call(qwen))[: len(own)] == own
    assert labels(call(qwen, prepend_bos=True))[: len(own) + 1] == [bos, *own]
    assert labels(call(qwen, prepend_bos=False))[: len(own)] == own


def test_layer_summary_follows_the_model(qwen) -> None:
    table = cl.layer_summary(qwen, TEXT, layers=[0])
    geometry = cl.attention_geometry(qwen, TEXT, layers=[0])
    assert not geometry.bos_first
    assert_close(torch.tensor(table.to_numpy()), torch.tensor(geometry.layer_summary().to_numpy()))


@pytest.mark.usefixtures("as_a_user")
def test_prepend_bos_is_true_false_or_none(qwen) -> None:
    with pytest.raises(TypeError, match=r"prepend_bos must be True, False or None \(None: the model's own choice, "):
        cl.layer_summary(qwen, TEXT, prepend_bos="yes")
    with pytest.raises(TypeError, match="got str 'yes'"):
        cl.flow(qwen, TEXT, prepend_bos="yes")


def test_without_bos_the_sink_is_found_not_assumed_at_position_0(qwen) -> None:
    ids = qwen.to_tokens(TEXT)[0]
    found = {}

    def keep(layer):
        found[layer.layer] = detect_sinks(layer.pattern)

    cl.map_layers(qwen, ids, keep)
    analysis = cl.sink_analysis(qwen, TEXT)
    for layer, s in analysis.items():
        assert torch.equal(s.sinks, found[layer]), layer
    auto = cl.sink_analysis(qwen, TEXT, sinks="auto")
    assert auto.head_table().equals(analysis.head_table())
    # The layer summary compares the key of largest attention share (here one per layer and text).
    geometry = cl.attention_geometry(qwen, TEXT)
    for layer, row in geometry.layer_summary().iterrows():
        d = geometry[layer]
        from contribution_lens.analyses.geometry import layer_disagreement, sink_positions

        sink = int(sink_positions(d, None, False, geometry.attention_mask))
        assert row.to_dict() == layer_disagreement(d, geometry.attention_mask, sink)
    # With a BOS prepended, position 0 is the sink again, as on the bundled models.
    with_bos = cl.sink_analysis(qwen, TEXT, prepend_bos=True, layers=[0])
    assert with_bos[0].sinks[0].nonzero().flatten().tolist() == [0]


def test_the_bundled_models_sink_stays_at_bos(bundled_model) -> None:
    text = "The capital of France is Paris, and it is a big city."
    default = cl.sink_analysis(bundled_model, text, layers=[2, 20])
    first = cl.sink_analysis(bundled_model, text, layers=[2, 20], k=1)
    assert default.head_table().equals(first.head_table())
    assert cl.attention_geometry(bundled_model, text, layers=[2]).bos_first


def test_chunks_and_items_follow_the_model(qwen, tmp_path) -> None:
    from contribution_lens.faithfulness import DataSettings, data
    from contribution_lens.faithfulness.runner import build_units

    source = tmp_path / "notes.txt"
    source.write_text(" ".join([TEXT] * 20), encoding="utf-8")
    plain = build_units(qwen, DataSettings(data=(f"text={source}",), chunk_length=16, max_chunks=2))
    bos = build_units(qwen, DataSettings(data=(f"text={source}",), chunk_length=16, max_chunks=2, prepend_bos=True))
    first = plain[0].tokens[0]
    assert first.shape == (16,) and int(first[0]) != qwen.tokenizer.bos_token_id
    assert int(bos[0].tokens[0][0]) == qwen.tokenizer.bos_token_id and bos[0].tokens[0].shape == (16,)
    assert torch.equal(bos[0].tokens[0][1:], first[:15])  # the same stream, a BOS in front
    chunks = data.chunk_tokens(qwen.tokenizer, [TEXT], length=5, bos_token_id=None)
    assert torch.equal(chunks[0], qwen.to_tokens(TEXT)[0, :5])
    assert (
        DataSettings(data=("gsm8k",)).to_dict().keys()
        == DataSettings(data=("gsm8k",), prepend_bos=None).to_dict().keys()
    )
    assert DataSettings(data=("gsm8k",), prepend_bos=False).to_dict()["prepend_bos"] is False


def test_text_chunks_and_the_faithfulness_run_cut_by_the_models_convention_unless_told(qwen, tmp_path) -> None:
    from contribution_lens.faithfulness import DataSettings
    from contribution_lens.faithfulness import data as text_data
    from contribution_lens.faithfulness.runner import build_units

    file = tmp_path / "story.txt"
    file.write_text(" ".join([TEXT] * 20), encoding="utf-8")
    spec, bos = f"text={file}", qwen.tokenizer.bos_token_id
    # The chunks the sink study and the opening case read: no BOS for Qwen2, unless prepend_bos says so.
    plain = text_data.text_chunks(qwen, [spec], length=16, max_chunks=3)
    forced = text_data.text_chunks(qwen, [spec], length=16, max_chunks=3, prepend_bos=True)
    assert plain.shape == forced.shape == (3, 16)
    assert not (plain[:, 0] == bos).any() and (forced[:, 0] == bos).all()
    assert torch.equal(forced[0, 1:], plain[0, :15])  # the same text after the BOS
    # The faithfulness run cuts the very same chunks (its --prepend-bos included): the parts of a replication agree.
    for prepend_bos, expected in ((None, plain), (True, forced)):
        settings = DataSettings(data=(spec,), chunk_length=16, max_chunks=3, batch_size=3, prepend_bos=prepend_bos)
        (unit,) = build_units(qwen, settings)
        assert torch.equal(torch.stack(unit.tokens), expected), prepend_bos
