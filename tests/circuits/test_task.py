"""Circuit tasks: equal token counts, one-token names, the BOS convention, the metrics, the report, refusals."""

import json
import warnings
from types import SimpleNamespace

import pytest
import torch

from conftest import tiny_bridge, tiny_encoder
from contribution_lens import adapter, loading
from contribution_lens.circuits import task_builders
from contribution_lens.circuits.task import METRICS, Task
from contribution_lens.circuits.task_builders import IOI_NAMES
from contribution_lens.circuits.task_checks import task_report

BUNDLED = {"smollm2": loading.BUNDLED, "gemma3": loading.GEMMA, "qwen2.5": loading.QWEN}
BOS_FIRST = {"smollm2": True, "gemma3": True, "qwen2.5": False}
"""The models' own convention (``cfg.default_prepend_bos``): Qwen2.5 reads texts without BOS."""


@pytest.fixture(scope="module", params=list(BUNDLED), ids=list(BUNDLED))
def skeleton(request):
    """A bundled model's config and tokenizer without its weights: building a task needs no pass."""
    try:
        return request.param, loading.load_skeleton(BUNDLED[request.param])
    except (ModuleNotFoundError, FileNotFoundError) as error:  # pragma: no cover - depends on the install
        pytest.skip(f"bundled model unavailable: {error}")


def real_tokens(task: Task, prompt: int, which: str = "clean") -> list[int]:
    return getattr(task, which)[prompt, : int(task.last[prompt]) + 1].tolist()


def check_layout(task: Task, model, *, bos_first: bool) -> None:
    """Equal token counts, right padding with the model's pad id, and the model's BOS convention."""
    assert task.clean.shape == task.corrupted.shape
    pad = adapter.pad_id(model)
    bos = model.tokenizer.bos_token_id
    for prompt in range(len(task)):
        last = int(task.last[prompt])
        assert (task.clean[prompt, last + 1 :] == pad).all() and (task.corrupted[prompt, last + 1 :] == pad).all()
        assert task.clean[prompt, last] != pad
        assert (task.clean[prompt, 0] == bos) == bos_first
        assert (task.corrupted[prompt, 0] == bos) == bos_first
        if not bos_first:
            assert bos not in real_tokens(task, prompt)


def test_ioi_names_are_one_token_and_the_abc_counterfactual_has_three_other_names(skeleton) -> None:
    key, model = skeleton
    task = Task.ioi(model, n=24, seed=3, counterfactual="abc")
    assert task.counterfactual == "abc"
    check_layout(task, model, bos_first=BOS_FIRST[key])
    tokenizer = model.tokenizer
    names = {tokenizer.encode(name, add_special_tokens=False)[0]: name for name in IOI_NAMES}
    for prompt in range(len(task)):
        io, s = int(task.answer[prompt]), int(task.foil[prompt])
        assert io in names and s in names and io != s  # one token each, with the leading space
        clean, corrupted = real_tokens(task, prompt), real_tokens(task, prompt, "corrupted")
        assert clean.count(io) == 1 and clean.count(s) == 2  # the subject repeated, the indirect object once
        assert io not in corrupted and s not in corrupted  # ABC: three other names
        assert sum(token in names for token in corrupted) == 3
        # The text around the names is the same: only the three name positions differ.
        differ = [i for i, (a, b) in enumerate(zip(clean, corrupted, strict=True)) if a != b]
        assert len(differ) == 3 and all(clean[i] in names for i in differ)
        # The answer is the token that would follow the prompt as the model tokenises it.
        text = tokenizer.decode(clean[1:] if BOS_FIRST[key] else clean) + names[io]
        assert tokenizer.encode(text, add_special_tokens=False)[-1] == io
    # Both orders of Wang et al.: ABBA (the indirect object first) and BABA.
    first_name = [next(t for t in real_tokens(task, p) if t in names) for p in range(len(task))]
    assert {a == int(io) for a, io in zip(first_name, task.answer, strict=True)} == {True, False}


def test_ioi_defaults_to_mibs_s2_io_flip_the_subjects_second_mention_replaced_by_the_indirect_object(skeleton) -> None:
    _, model = skeleton
    task = Task.ioi(model, n=24, seed=3)
    assert task.counterfactual == "s2-io-flip" and "counterfactual s2-io-flip" in repr(task)
    assert torch.equal(task.clean, Task.ioi(model, n=24, seed=3, counterfactual="abc").clean)  # one seed, one prompt
    for prompt in range(len(task)):
        io, s = int(task.answer[prompt]), int(task.foil[prompt])
        clean, corrupted = real_tokens(task, prompt), real_tokens(task, prompt, "corrupted")
        differ = [i for i, (a, b) in enumerate(zip(clean, corrupted, strict=True)) if a != b]
        # One position differs: the subject's second (last) mention, which now names the indirect object.
        assert differ == [max(i for i, t in enumerate(clean) if t == s)]
        assert corrupted[differ[0]] == io and corrupted.count(io) == 2 and corrupted.count(s) == 1


@pytest.mark.usefixtures("as_a_user")
@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda m: Task.ioi(m, n=2, counterfactual="ABC"),
            "counterfactual: Task.ioi offers s2-io-flip, abc; got 'ABC'",
        ),
        (
            lambda m: Task.induction(m, n=2, counterfactual="abc"),
            "counterfactual: Task.induction offers first-copy-resampled; got 'abc'",
        ),
        (
            lambda m: Task.capitals(m, n=2, counterfactual=None),
            "counterfactual: Task.capitals offers other-country; got None",
        ),
    ],
    ids=["ioi", "induction", "capitals"],
)
def test_an_unknown_counterfactual_is_refused_with_the_tasks_list(build, message) -> None:
    with pytest.raises(ValueError) as error:
        build(loading.load_skeleton(loading.BUNDLED))
    assert str(error.value) == message


def numbered_task(n: int, duplicates: int = 0) -> Task:
    """``n`` distinct prompts, then the first ``duplicates`` of them again."""
    ids = torch.arange(2 * n).reshape(n, 2)
    ids = torch.cat([ids, ids[:duplicates]])
    answer = torch.zeros(len(ids), dtype=torch.long)
    return Task("numbered", ids, ids + 100, answer, answer + 1, Task.full_length(ids), counterfactual="numbers")


def test_a_split_is_disjoint_deterministic_and_keeps_equal_prompts_together() -> None:
    task = numbered_task(20, duplicates=5)
    scoring, evaluation = task.split(0.5, seed=4)
    again = task.split(0.5, seed=4)
    assert torch.equal(again[0].clean, scoring.clean) and torch.equal(again[1].clean, evaluation.clean)
    assert not torch.equal(task.split(0.5, seed=5)[0].clean, scoring.clean)
    assert (scoring.part, evaluation.part, scoring.counterfactual) == ("scoring", "evaluation", "numbers")
    assert len(scoring) + len(evaluation) == len(task)
    assert not set(scoring.fingerprints().tolist()) & set(evaluation.fingerprints().tolist())
    assert scoring.prompts.overlap(evaluation.prompts) == 0 and task.prompts.overlap(scoring.prompts) == len(scoring)
    assert len(set(scoring.fingerprints().tolist())) == 10  # half of the 20 distinct prompts
    for part in numbered_task(10).split(0.3):  # each part keeps the task's order
        assert part.clean[:, 0].tolist() == sorted(part.clean[:, 0].tolist())
    assert "scoring part" in repr(scoring)
    small, large = task.split(0.01)[0], task.split(0.99)[1]
    assert len(small) >= 1 and len(large) >= 1  # never empty


@pytest.mark.usefixtures("as_a_user")
@pytest.mark.parametrize(
    ("task", "fraction", "message"),
    [
        (numbered_task(4), 0, "fraction must be a number in (0, 1) (the share of prompts scored), got 0"),
        (numbered_task(4), 1.0, "fraction must be a number in (0, 1) (the share of prompts scored), got 1.0"),
        (numbered_task(4), True, "fraction must be a number in (0, 1) (the share of prompts scored), got True"),
        (numbered_task(1), 0.5, "task: 1 prompts, 1 distinct, cannot be split into two non-empty parts"),
        (numbered_task(1, duplicates=1), 0.5, "task: 2 prompts, 1 distinct, cannot be split"),
    ],
    ids=["zero", "one", "bool", "one prompt", "one distinct"],
)
def test_a_bad_split_is_refused_naming_the_argument(task, fraction, message) -> None:
    with pytest.raises(ValueError) as error:
        task.split(fraction)
    assert message in str(error.value)


def test_capitals_pair_two_countries_of_equal_length(skeleton) -> None:
    key, model = skeleton
    task = Task.capitals(model, n=16, seed=1)
    check_layout(task, model, bos_first=BOS_FIRST[key])
    capitals = {model.tokenizer.encode(capital, add_special_tokens=False)[0] for _, capital in task_builders.CAPITALS}
    assert set(task.answer.tolist()) <= capitals and set(task.foil.tolist()) <= capitals
    assert (task.clean != task.corrupted).sum(1).tolist() == [1] * 16  # only the country differs (one token here)


def test_induction_repeats_the_first_copy_and_the_counterfactual_resamples_it(skeleton) -> None:
    key, model = skeleton
    length = 6
    task = Task.induction(model, n=8, length=length, seed=0)
    check_layout(task, model, bos_first=BOS_FIRST[key])
    start = int(BOS_FIRST[key])
    special = set(model.tokenizer.all_special_ids)
    for prompt in range(len(task)):
        clean, corrupted = real_tokens(task, prompt), real_tokens(task, prompt, "corrupted")
        assert len(clean) == start + 2 * length - 1
        first, second = clean[start : start + length], clean[start + length :]
        assert second == first[:-1] and int(task.answer[prompt]) == first[-1]
        assert corrupted[start + length :] == second
        assert not set(corrupted[start : start + length]) & set(first)
        assert int(task.foil[prompt]) not in clean + corrupted
        tokens = clean[start:] + corrupted[start:] + [int(task.foil[prompt])]
        assert not set(tokens) & special
        assert all(model.tokenizer.decode([t]).strip().isalpha() for t in tokens)  # ordinary words


def test_induction_on_a_tiny_bridge_without_tokenizer() -> None:
    model = tiny_bridge("gqa")
    task = Task.induction(model, n=5, length=4, seed=2)
    assert task.clean.shape == (5, 7) and task.last.tolist() == [6] * 5
    assert (task.clean[:, 4:] == task.clean[:, :3]).all() and (task.answer == task.clean[:, 3]).all()
    assert (task.corrupted[:, 4:] == task.clean[:, 4:]).all() and (task.corrupted[:, :4] != task.clean[:, :4]).all()
    assert int(task.clean.max()) < model.cfg.d_vocab
    assert torch.equal(Task.induction(model, n=5, length=4, seed=2).clean, task.clean)  # the seed fixes it


def logits_at_last(model, task: Task) -> torch.Tensor:
    """Each prompt run alone, unpadded: the oracle of the padded batch."""
    rows = []
    for prompt in range(len(task)):
        tokens = task.clean[prompt : prompt + 1, : int(task.last[prompt]) + 1]
        with torch.no_grad():
            rows.append(model(tokens)[0, -1])
    return torch.stack(rows)


def padded_task(model, n: int = 3) -> Task:
    """``n`` prompts of different lengths, right-padded."""
    generator = torch.Generator().manual_seed(0)
    clean = torch.randint(1, model.cfg.d_vocab, (n, 7), generator=generator)
    corrupted = torch.randint(1, model.cfg.d_vocab, (n, 7), generator=generator)
    last = torch.tensor([6, 3, 4] * n)[:n]
    for row, end in enumerate(last.tolist()):
        clean[row, end + 1 :] = 0
        corrupted[row, end + 1 :] = 0
    answer = torch.tensor([3, 4, 5] * n)[:n]
    return Task("toy", clean, corrupted, answer, answer + 4, last)


def test_metric_values_against_a_direct_computation() -> None:
    model = tiny_bridge("mha", biases=True)
    task = padded_task(model)
    with torch.no_grad():
        logits, corrupted = model(task.clean), model(task.corrupted)
    alone = logits_at_last(model, task)
    rows = torch.arange(3)
    torch.testing.assert_close(task.metric_values(logits), alone[rows, task.answer] - alone[rows, task.foil])
    torch.testing.assert_close(task.metric_values(alone), task.metric_values(logits))  # [prompt d_vocab] as well
    probability = task.with_metric("probability").metric_values(logits)
    torch.testing.assert_close(probability, alone.softmax(-1)[rows, task.answer])
    kl = task.with_metric("kl")
    torch.testing.assert_close(kl.metric_values(logits, logits), torch.zeros(3), atol=1e-6, rtol=0)
    at_last = corrupted[rows, task.last]
    expected = torch.nn.functional.kl_div(
        at_last.log_softmax(-1), alone.log_softmax(-1), log_target=True, reduction="none"
    )
    torch.testing.assert_close(kl.metric_values(corrupted, logits), expected.sum(-1), rtol=1e-4, atol=1e-6)
    assert (kl.metric_values(corrupted, logits) > 0).all()
    assert set(METRICS) == {"logit_diff", "probability", "kl"}


@pytest.mark.usefixtures("as_a_user")
def test_metric_values_refusals() -> None:
    ids = torch.zeros(2, 3, dtype=torch.long)
    task = Task("toy", ids, ids, torch.tensor([1, 2]), torch.tensor([0, 0]), Task.full_length(ids), "kl")
    with pytest.raises(ValueError, match="clean_logits: the metric 'kl'"):
        task.metric_values(torch.zeros(2, 3, 5))
    with pytest.raises(ValueError, match=r"logits must be \[prompt pos d_vocab\] or \[prompt d_vocab\] with 2 prompts"):
        task.metric_values(torch.zeros(3, 5))


@pytest.mark.usefixtures("as_a_user")
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"corrupted": torch.zeros(2, 4, dtype=torch.long)}, "clean and corrupted must have the same shape"),
        ({"foil": torch.tensor([1, 0])}, "foil must differ from answer in every prompt"),
        ({"answer": torch.tensor([1, 2, 3])}, "answer must hold one id a prompt"),
        ({"last": torch.tensor([2, 3])}, "last must index a position of the prompts, 0..2"),
        ({"metric": "accuracy"}, "metric must be one of ['kl', 'logit_diff', 'probability'], got 'accuracy'"),
    ],
    ids=["lengths", "foil", "answer shape", "last", "metric"],
)
def test_task_refuses_bad_fields(change, message) -> None:
    ids = torch.zeros(2, 3, dtype=torch.long)
    fields = {"name": "toy", "clean": ids, "corrupted": ids, "answer": torch.tensor([1, 2]),
              "foil": torch.tensor([0, 0]), "last": torch.tensor([2, 2])}  # fmt: skip
    with pytest.raises(ValueError) as error:
        Task(**(fields | change))
    assert message in str(error.value)


NO_UNEMBEDDING = SimpleNamespace(cfg=SimpleNamespace(attention_dir="causal", d_vocab=10), hook_dict={}, tokenizer=None)


@pytest.mark.usefixtures("as_a_user")
@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda m: Task.induction(m, n=0), "n must be a positive integer (the number of prompts), got 0"),
        (lambda m: Task.induction(m, n=True), "n must be a positive integer"),
        (
            lambda m: Task.induction(m, n=2, length=1),
            "length must be an integer of at least 2 (tokens repeated), got 1",
        ),
        (lambda m: Task.induction(m, n=2, length=40), "length=40: the prompt is 81 tokens long, more than the model's"),
        (lambda m: Task.ioi(m, n=2), "model: this task is built from text and the model has no tokenizer"),
        (lambda m: Task.capitals(m, n=2), "model: this task is built from text and the model has no tokenizer"),
        (lambda m: Task.induction(tiny_encoder(), n=2), "model: an encoder (bidirectional attention)"),
        (lambda m: Task.induction(NO_UNEMBEDDING, n=2), "model: SimpleNamespace has no unembedding (LM head)"),
    ],
    ids=[
        "n 0",
        "n bool",
        "length 1",
        "length too long",
        "ioi without tokenizer",
        "capitals without tokenizer",
        "encoder",
        "no unembedding",
    ],
)
def test_builders_refuse_bad_arguments_naming_them(build, message) -> None:
    with pytest.raises(ValueError) as error:
        build(tiny_bridge("gqa"))
    assert message in str(error.value)


def write_lines(path, rows) -> str:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return str(path)


GOOD = {
    "clean": "The capital of France is",
    "corrupted": "The capital of Japan is",
    "answer": " Paris",
    "foil": " Tokyo",
}


def test_from_jsonl_reads_a_users_task(skeleton, tmp_path) -> None:
    key, model = skeleton
    second = {"clean": "When Mary and John went out, John gave a drink to", "answer": " Mary", "foil": " John",
              "corrupted": "When Anna and Paul went out, Kate gave a drink to", "note": "ignored"}  # fmt: skip
    task = Task.from_jsonl(model, write_lines(tmp_path / "mine.jsonl", [GOOD, "", second]), metric="probability")
    assert task.name == "mine" and len(task) == 2 and task.metric == "probability"
    check_layout(task, model, bos_first=BOS_FIRST[key])
    encode = model.tokenizer.encode
    assert task.answer.tolist() == [
        encode(" Paris", add_special_tokens=False)[0],
        encode(" Mary", add_special_tokens=False)[0],
    ]
    start = int(BOS_FIRST[key])
    assert real_tokens(task, 0)[start:] == encode(GOOD["clean"], add_special_tokens=False)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({k: v for k, v in GOOD.items() if k != "foil"}, "line 3: field 'foil' is missing"),
        (GOOD | {"answer": 5}, "line 3: field 'answer' must be a non-empty string, got 5"),
        (GOOD | {"clean": ""}, "line 3: field 'clean' must be a non-empty string"),
        (
            GOOD | {"corrupted": "The capital city of Japan is"},
            "line 3: field 'corrupted' is 7 tokens long and field 'clean' 6",
        ),
        (
            GOOD | {"answer": " Parisian capital"},
            "line 3: field 'answer' (' Parisian capital') is 3 tokens; it must be one token",
        ),
        (GOOD | {"foil": " Paris"}, "line 3: field 'foil' is the same token as field 'answer' (' Paris')"),
        (
            GOOD | {"answer": "Paris"},
            "line 3: field 'answer' ('Paris') is glued to the last word of field 'clean' (the text would read "
            "'isParis'); write it with its leading space, as the built-in tasks do (' Paris')",
        ),
        (
            GOOD | {"clean": "The capital of France is ", "corrupted": "The capital of Japan is ", "answer": "Paris"},
            "line 3: field 'answer' ('Paris') is not the token read after field 'clean': the clean text ends in "
            "[' '], but with 'Paris' after it the end reads [' Paris']; write it as the text goes on",
        ),
        ("{not json", "line 3: not a JSON object"),
        ("[1, 2]", "line 3: not a JSON object with fields clean, corrupted, answer, foil"),
    ],
    ids=[
        "missing",
        "not a string",
        "empty",
        "lengths",
        "answer tokens",
        "foil is answer",
        "glued",
        "merged",
        "bad json",
        "a list",
    ],
)
def test_from_jsonl_refuses_a_bad_line_naming_it_and_the_field(row, message, tmp_path) -> None:
    model = loading.load_skeleton()
    path = write_lines(tmp_path / "task.jsonl", [GOOD, "   ", row])
    with pytest.raises(ValueError) as error:
        Task.from_jsonl(model, path)
    assert f"{path}, {message}" in str(error.value)


def test_from_jsonl_refuses_a_missing_or_empty_file(tmp_path) -> None:
    model = loading.load_skeleton()
    with pytest.raises(ValueError, match="path: no such file"):
        Task.from_jsonl(model, tmp_path / "absent.jsonl")
    with pytest.raises(ValueError, match="holds no task line"):
        Task.from_jsonl(model, write_lines(tmp_path / "empty.jsonl", ["", " "]))
    with pytest.raises(ValueError, match="metric must be one of"):
        Task.from_jsonl(model, write_lines(tmp_path / "one.jsonl", [GOOD]), metric="accuracy")


def test_report_reads_each_prompt_at_its_last_position_and_warns_on_a_model_that_does_not_do_it() -> None:
    model = tiny_bridge("gqa", biases=True)
    task = padded_task(model)
    alone = logits_at_last(model, task)
    with pytest.warns(UserWarning, match="the model does not do the task 'toy'") as caught:
        report = task_report(model, task, batch_size=2, resamples=200)
    assert "interval of its mean logit difference" in str(caught[0].message)
    expected = alone[torch.arange(3), task.answer] - alone[torch.arange(3), task.foil]
    torch.testing.assert_close(report.logit_diff, expected, rtol=1e-5, atol=1e-5)
    assert report.accuracy == pytest.approx(float((expected > 0).float().mean()))
    assert report.mean == pytest.approx(float(expected.double().mean()))
    assert report.low <= report.mean <= report.high and not report.done
    assert repr(report).startswith("TaskReport('toy', 3 prompts: accuracy")


def test_report_on_a_task_done_does_not_warn(monkeypatch) -> None:
    model = tiny_bridge("mha")
    task = padded_task(model, 12)  # twelve prompts: enough for an interval
    # Logits that prefer every answer by 2: the interval lies above 0.
    fake = torch.zeros(12, 7, model.cfg.d_vocab)
    fake[:, :, task.answer.unique()] = 2.0
    monkeypatch.setattr(adapter, "forward", lambda model, batch: fake[: batch.tokens.shape[0]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = task_report(model, task, batch_size=8)
    assert report.done and report.accuracy == 1.0 and report.low == report.high == 2.0


@pytest.mark.usefixtures("as_a_user")
@pytest.mark.parametrize(
    ("keywords", "message"),
    [
        ({"batch_size": 0}, "batch_size must be a positive integer"),
        ({"resamples": 0}, "resamples must be a positive"),
        ({"level": 1.0}, "level must lie in (0, 1), got 1.0"),
    ],
    ids=["batch_size", "resamples", "level"],
)
def test_report_refuses_bad_arguments_before_any_pass(keywords, message, monkeypatch) -> None:
    model = tiny_bridge("gqa")
    monkeypatch.setattr(adapter, "forward", lambda *args, **kwargs: pytest.fail("a pass ran"))
    with pytest.raises(ValueError) as error:
        task_report(model, padded_task(model), **keywords)
    assert message in str(error.value)
    with pytest.raises(ValueError, match="model: an encoder"):
        task_report(tiny_encoder(), padded_task(model))


def test_ioi_on_a_tiny_checkpoint_with_a_wordpiece_tokenizer(tiny_decoder) -> None:
    import contribution_lens as cl

    model = cl.load_model(str(tiny_decoder))
    task = Task.ioi(model, n=6, seed=0)
    check_layout(task, model, bos_first=adapter.prepends_bos(model))
    with pytest.warns(UserWarning, match="does not do the task 'ioi'"):
        task_report(model, task)


MEASURED = {"ioi": 0.9, "induction": 0.9, "capitals": 0.9}
"""The least clean accuracy each task must reach on every bundled model (measured: 0.97 to 1.00, 64 prompts)."""


def check_real_model(model, *, bos_first: bool) -> None:
    tasks = [Task.ioi(model, n=32), Task.induction(model, n=32, length=10), Task.capitals(model, n=32)]
    for task in tasks:
        check_layout(task, model, bos_first=bos_first)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            report = task_report(model, task)
        assert report.done and report.accuracy >= MEASURED[task.name], report


@pytest.mark.slow
def test_the_bundled_model_does_every_task(bundled_model) -> None:
    check_real_model(bundled_model, bos_first=True)


@pytest.mark.slow
def test_gemma_does_every_task(gemma) -> None:
    check_real_model(gemma, bos_first=True)


@pytest.mark.slow
def test_qwen_does_every_task(qwen) -> None:
    check_real_model(qwen, bos_first=False)
