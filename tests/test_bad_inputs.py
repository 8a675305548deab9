"""Odd or bad inputs: each gets the right answer or a clear error, never a silently wrong number or a traceback."""

import json
import threading
import warnings

import numpy as np
import pytest
import torch

import contribution_lens as cl
from conftest import assert_close, tiny_bridge
from contribution_lens import adapter, files
from contribution_lens.decomposition import decompose_layer, head_gram
from contribution_lens.faithfulness import data
from helpers import IDS, random_layer

# --- norms: finite inputs give finite, scale-invariant weights --------------------------------------------


@pytest.mark.parametrize("scope", ["intra", "inter"])
@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("scale", [1e19, 1e-23])
def test_weights_do_not_change_with_the_scale_of_the_values(scale, dtype, atol, scope) -> None:
    # c_ij = <o, alpha vt_j> / ||o||^2 is invariant to the scale of v, but ||o||^2 overflows at
    # v ~ 1e19 in float32 or bfloat16 (NaN weights) and underflows at v ~ 1e-23 (rows summing to 0).
    pattern, v, W_O = random_layer("gqa")
    pattern, W_O = pattern.to(dtype), W_O.to(dtype)
    base = cl.decompose(pattern, v.to(dtype), W_O, scope=scope)
    scaled = cl.decompose(pattern, (v * scale).to(dtype), W_O, scope=scope)
    assert bool(torch.isfinite(scaled.contribution).all())
    assert_close(scaled.contribution, base.contribution, rtol=0, atol=atol)
    assert_close(scaled.cosine, base.cosine, rtol=0, atol=atol)
    # The norms themselves keep their units.
    assert_close(scaled.value_norm / scale, base.value_norm, rtol=atol * 10, atol=0)
    rows = scaled.sum_over_heads().sum(-1) if scope == "inter" else scaled.contribution.sum(-1)
    assert_close(rows, torch.ones_like(rows), rtol=0, atol=atol)


def test_scale_invariance_holds_on_the_engines_path_with_z_output_and_gram() -> None:
    pattern, v, W_O = random_layer("mha")
    z = torch.einsum("bhqk,bkhd->bqhd", pattern, v)
    output = torch.einsum("bqhd,hdm->bqm", z, W_O)

    def weights(s: float, w: float):
        return decompose_layer(
            pattern,
            v * s,
            W_O * w,
            scope=cl.Scope.INTER,
            causal=True,
            z=z * s,
            output=output * s * w,
            gram=head_gram(W_O * w),
        ).contribution

    assert_close(weights(1e19, 1.0), weights(1.0, 1.0), rtol=0, atol=1e-5)
    assert_close(weights(1e-23, 1e-3), weights(1.0, 1.0), rtol=0, atol=1e-5)


@pytest.mark.usefixtures("as_a_user")
def test_norms_beyond_the_dtypes_range_are_refused_not_infinite() -> None:
    pattern, v, W_O = random_layer("mha")
    huge = v / v.abs().max() * 3e38  # finite, but ||vt|| is not a float32 number
    with pytest.raises(ValueError, match=r"value_norm exceeds the range of torch.float32 .*pass dtype=torch.float64"):
        cl.decompose(pattern, huge, W_O * 10)
    d = cl.decompose(pattern, huge.double(), W_O * 10)
    assert bool(torch.isfinite(d.contribution).all())


def test_gradients_through_decompose_raise_no_warning_from_its_checks() -> None:
    pattern, v, W_O = random_layer("gqa")
    pattern, v = pattern.clone().requires_grad_(True), v.clone().requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        d = cl.decompose(pattern, v, W_O)
        (d.contribution[..., 0] ** 2).sum().backward()
    assert pattern.grad is not None and v.grad is not None and bool(v.grad.abs().sum() > 0)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_float8_patterns_are_read_as_float32(dtype) -> None:
    pattern, v, W_O = random_layer("gqa")
    d = cl.decompose(pattern.to(dtype), v.to(dtype), W_O)
    expected = cl.decompose(pattern.to(dtype).float(), v.to(dtype).float(), W_O, check_values=False)
    assert d.contribution.dtype == torch.float32
    assert_close(d.contribution, expected.contribution, rtol=0, atol=0)
    assert_close(d.sum_over_heads().sum(-1), torch.ones(2, 7), rtol=0, atol=1e-5)


# --- the pass: eval mode, one thread at a time -------------------------------------------------------------


def test_a_model_left_in_train_mode_gives_its_eval_weights_and_keeps_its_mode(tmp_path) -> None:
    import architectures

    folder = architectures.build("GPT2LMHeadModel", tmp_path / "gpt2")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "attn_pdrop": 0.5}))
    model = cl.load_model(str(folder))
    ids = torch.randint(0, 1000, (2, 9), generator=torch.Generator().manual_seed(0))
    expected = cl.attention_geometry(model, ids)
    model.train()  # attention dropout 0.5: rows would sum to ~1.4 and change on every call
    for _ in range(2):
        g = cl.attention_geometry(model, ids)
        for layer in g:
            rows = g[layer].attention.sum(-1)
            assert_close(rows, torch.ones_like(rows), rtol=0, atol=1e-5)
            assert_close(g[layer].contribution, expected[layer].contribution, rtol=0, atol=0)
    dropouts = [m for m in model.original_model.modules() if isinstance(m, torch.nn.Dropout)]
    assert model.training and dropouts and all(m.training for m in dropouts), "the model's own mode is restored"


def test_two_threads_sharing_one_model_get_their_own_numbers() -> None:
    model = tiny_bridge("gqa", biases=True)
    inputs = [IDS, (IDS + 7) % 50]
    expected = [cl.attention_geometry(model, x)[1].contribution for x in inputs]
    got: list[list[torch.Tensor]] = [[], []]
    errors: list[BaseException] = []

    def slow(layer: cl.LayerInputs) -> torch.Tensor:
        threading.Event().wait(0.002)  # the other thread runs in between, as on a busy machine
        return layer.decompose().contribution

    def work(index: int) -> None:
        try:
            for _ in range(8):
                got[index].append(cl.map_layers(model, inputs[index], slow)[1])
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for index in range(2):
        assert len(got[index]) == 8
        for weights in got[index]:
            assert_close(weights, expected[index], rtol=0, atol=0)


# --- token ids, positions, heads, sinks ------------------------------------------------------------------


@pytest.mark.usefixtures("as_a_user")
def test_meta_tensors_are_refused_clearly() -> None:
    model = tiny_bridge("mha")
    with pytest.raises(ValueError, match="token ids are on the meta device: they have a shape but no values"):
        cl.attention_geometry(model, IDS.to("meta"))
    pattern, v, W_O = random_layer("mha")
    with pytest.raises(ValueError, match="v is on the meta device: it has a shape but no values"):
        cl.decompose(pattern, v.to("meta"), W_O)
    with pytest.raises(ValueError, match="the model's weights are on the meta device"):
        cl.attention_geometry(tiny_bridge("mha").to("meta"), IDS)


@pytest.mark.usefixtures("as_a_user")
def test_token_ids_of_any_integer_dtype_are_read_and_bool_ids_refused() -> None:
    model = tiny_bridge("mha")
    expected = cl.attention_geometry(model, IDS)[0].contribution
    for dtype in (torch.uint8, torch.int16, torch.int32):
        assert_close(cl.attention_geometry(model, IDS.to(dtype))[0].contribution, expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"token ids must be integers, got a bool tensor \(an attention mask\?"):
        cl.attention_geometry(model, IDS.bool())
    with pytest.raises(ValueError, match="attention_mask has shape \\(5,\\), the token ids \\(2, 9\\)"):
        cl.attention_geometry(model, IDS, attention_mask=torch.ones(5))


@pytest.mark.usefixtures("as_a_user")
def test_numpy_and_0d_integers_index_layers_heads_and_positions_and_floats_do_not() -> None:
    model = tiny_bridge("gqa")
    g = cl.attention_geometry(model, IDS, layers=np.int64(1))
    assert g.layers == [1] and cl.attention_geometry(model, IDS, layers=torch.tensor(-1)).layers == [1]
    table = g.to_dataframe(layers=np.int64(1), heads=torch.tensor(2), queries=np.array([3, 4]), keys=np.int32(0))
    assert sorted(set(table["head"])) == [2] and sorted(set(table["query"])) == [3, 4] and set(table["key"]) == {0}
    assert_close(g[1].head_contribution(np.int64(2)), g[1].contribution[:, 2], rtol=0, atol=0)
    with pytest.raises(TypeError, match=r"heads must be integers, got float 1\.0"):
        g.to_dataframe(heads=1.0)
    with pytest.raises(TypeError, match=r"head must be an integer, got float 1\.0"):
        g[1].head_contribution(1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="queries must be integers, got bool True"):
        g.to_dataframe(queries=True)
    with pytest.raises(IndexError, match=r"head 4 does not exist: the layer has 4 heads \(0..3\)"):
        g[1].head_contribution(4)


@pytest.mark.usefixtures("as_a_user")
def test_sink_positions_are_checked_never_nan() -> None:
    model = tiny_bridge("gqa")
    g = cl.attention_geometry(model, IDS)
    with pytest.raises(ValueError, match=r"sink must be a key position from 0 to 8, got -1 \(positions do not count"):
        g.layer_summary(sink=-1)
    with pytest.raises(ValueError, match="sink must be a key position from 0 to 8, got 9"):
        cl.layer_summary(model, IDS, sink=9)
    with pytest.raises(ValueError, match="no real query other than the sink sees key 8"):
        g.layer_summary(sink=8)  # causal: only the last token itself sees the last token
    assert not g.layer_summary(sink=np.int64(2)).isna().any().any()
    with pytest.raises(ValueError, match=r"no real query sees both a sink key \(sinks=\[-1\]\) and a tail key"):
        cl.sink_analysis(model, IDS, sinks=[-1], layers=[0])
    with pytest.raises(TypeError, match=r"sink positions must be integers, got float 1\.5"):
        cl.sink_analysis(model, IDS, sinks=[1.5], layers=[0])  # type: ignore[list-item]
    scalar = cl.sink_analysis(model, IDS, sinks=np.int64(0), layers=[0])  # type: ignore[arg-type]
    listed = cl.sink_analysis(model, IDS, sinks=[0], layers=[0])
    assert scalar.claims() == listed.claims()


@pytest.mark.usefixtures("as_a_user")
def test_labels_that_do_not_fit_the_tokens_are_refused_when_built_and_when_loaded(tmp_path) -> None:
    g = cl.attention_geometry(tiny_bridge("mha"), IDS)
    short = [labels[:-2] for labels in g.str_tokens]
    with pytest.raises(ValueError, match="text 0 has 7 labels for its 9 real tokens: str_tokens must match the tokens"):
        cl.Geometry(dict(g.items()), g.tokens, g.attention_mask, short, "inter")
    path = g.save(tmp_path / "g.safetensors")
    labels = json.dumps({"list": [{"list": labels} for labels in g.str_tokens]})
    edited = _rewritten(path, lambda tree: tree.replace(labels, json.dumps({"list": [{"list": s} for s in short]})))
    with pytest.raises(ValueError, match=rf"{edited} is not a Geometry written by Geometry.save .*text 0 has 7 labels"):
        cl.Geometry.load(edited)


# --- files: every error names the file ------------------------------------------------------------------------


def _rewritten(path, edit):
    """A copy of a saved result with ``edit`` applied to its JSON tree (a string)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), "pt") as handle:
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
        saved = handle.metadata()
        edited = edit(saved["tree"])
        assert edited != saved["tree"], "the edit changed nothing"
        saved["tree"] = edited
    target = path.with_name("edited.safetensors")
    save_file(tensors, str(target), metadata=saved)
    return target


@pytest.mark.usefixtures("as_a_user")
def test_a_geometry_file_that_is_truncated_or_edited_is_named_in_the_error(tmp_path) -> None:
    g = cl.attention_geometry(tiny_bridge("mha"), IDS)
    path = g.save(tmp_path / "g.safetensors")
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ValueError, match=rf"^{truncated} is not a Geometry written by Geometry.save \(SafetensorError"):
        cl.Geometry.load(truncated)
    for edit, reason in [
        (lambda tree: tree[:-7], "JSONDecodeError"),
        (
            lambda tree: tree.replace('"layers.1.cosine"', '"layers.5.cosine"'),
            "ValueError: it names a tensor 'layers.5",
        ),
        (lambda tree: tree.replace('"n_layers": 2', '"n_layers": "two"'), "ValueError: invalid literal"),
        (lambda tree: tree.replace('"value": "inter"', '"value": "sideways"'), "ValueError: scope must be one of"),
    ]:
        edited = _rewritten(path, edit)
        with pytest.raises(ValueError, match=rf"^{edited} is not a Geometry written by Geometry.save \({reason}"):
            cl.Geometry.load(edited)


def test_a_write_refused_by_the_folder_names_the_file_not_a_temporary_one(tmp_path, monkeypatch) -> None:
    # (Tests may run as root, who may write anywhere: the refusal is what the OS would raise.)
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(tmp_path / ".g.safetensors.x1y2.tmp"))

    monkeypatch.setattr(files.tempfile, "mkstemp", refuse)
    g = cl.attention_geometry(tiny_bridge("mha"), IDS)
    target = tmp_path / "read-only" / "g.safetensors"
    with pytest.raises(PermissionError, match=rf"^cannot write {target}: Permission denied$"):
        g.save(target)


@pytest.mark.parametrize(
    ("spec", "name", "content"),
    [
        ("text={path}", "notes.txt", "café au lait\n"),
        ("fineweb={path}", "rows.jsonl", '{"text": "café"}\n'),
        ("mmlu={path}", "food_test.csv", "question,choice0,choice1,choice2,choice3,answer\ncafé?,a,b,c,d,0\n"),
    ],
)
def test_a_latin1_data_file_is_named_with_the_fix(tmp_path, spec, name, content) -> None:
    path = tmp_path / name
    path.write_bytes(content.encode("latin-1"))
    load = data.load_choices if spec.startswith("mmlu") else data.load_texts
    with pytest.raises(data.DataFormatError, match=rf"^{path} is not UTF-8 text \(it holds the byte 0xe9\); re-save"):
        load(spec.format(path=path))


def test_other_data_file_mistakes_are_named(tmp_path) -> None:
    broken = tmp_path / "rows.jsonl.gz"
    broken.write_bytes(b"not gzip")
    with pytest.raises(data.DataFormatError, match=rf"^{broken} is not a complete gzip file"):
        data.load_texts(f"fineweb={broken}")
    csv = tmp_path / "food_test.csv"
    csv.write_text("question,choice0,choice1,choice2,choice3,answer\nq,a,b,c,d,B\n")
    with pytest.raises(data.DataFormatError, match=rf"^{csv} row 2: answer 'B' is not an option index 0..3$"):
        data.load_choices(f"mmlu={csv}")


def test_adapter_exclusive_is_reentrant_in_one_thread() -> None:
    model = tiny_bridge("mha")
    with adapter.exclusive(model), adapter.exclusive(model):
        assert cl.map_layers(model, IDS, lambda layer: layer.layer).layers == [0, 1]


# --- the last inputs that gave a traceback or a silently wrong result --------------------------------------

ONE = torch.tensor([1, 5, 9, 3, 7, 2, 8, 11])


@pytest.fixture(scope="module")
def added_token(tmp_path_factory: pytest.TempPathFactory):
    """A tiny Qwen2 whose tokenizer holds one token more than the model's vocabulary (as chat tokenizers may)."""
    import architectures

    model = cl.load_model(str(architectures.build("Qwen2ForCausalLM", tmp_path_factory.mktemp("qwen2") / "q")))
    model.tokenizer.add_tokens(["<tool>"])
    assert model.tokenizer.convert_tokens_to_ids("<tool>") == model.cfg.d_vocab
    return model


@pytest.mark.usefixtures("as_a_user")
def test_a_text_or_target_token_past_the_vocabulary_is_named(added_token) -> None:
    said = (
        "input text 0 holds the token '<tool>' (id 30522), outside the model's vocabulary of 30522 ids (0..30521): "
        "the tokenizer has tokens the model has no embedding for"
    )
    for call in (cl.logit_attribution, cl.flow, cl.attention_geometry):
        with pytest.raises(ValueError) as error:
            call(added_token, "please call <tool> now")
        assert str(error.value) == said
    with pytest.raises(ValueError) as error:
        cl.logit_attribution(added_token, "please call the tool now", target="<tool>")
    assert str(error.value) == (
        "target '<tool>' is token id 30522, outside the model's vocabulary of 30522 ids (0..30521): "
        "the tokenizer has tokens the model has no embedding for"
    )


def test_a_flows_rollout_is_a_copy(bundled_model) -> None:
    f = cl.flow(bundled_model, "The cat sat on the mat because it was warm.")
    before = f.rollout.clone()
    hidden = f.rollout
    hidden[:, 0] = 0  # hiding the sink in a notebook
    assert torch.equal(f.rollout, before) and torch.equal(f.at(-1).rollout, before)
    assert torch.equal(f.rollout_at(f.position), before)
    drawn = np.asarray(f.figures()["rollout"].data[0].z, dtype=np.float64)
    assert_close(torch.from_numpy(drawn), before.double(), rtol=1e-6, atol=1e-6)


def test_a_decompositions_contribution_is_a_copy() -> None:
    pattern, v, W_O = random_layer("gqa")
    d = cl.decompose(pattern, v, W_O)
    before = d.contribution.clone()
    d.contribution[..., 0] = 0
    d.contribution.zero_()
    assert torch.equal(d.contribution, before)
    assert torch.equal(d.sum_over_heads(), before.sum(1))
    assert torch.equal(d.head_contribution(1), before[:, 1])
    d.head_contribution(1).zero_()
    assert torch.equal(d.head_contribution(1), before[:, 1])


def test_a_faithfulness_runs_tables_are_copies() -> None:
    from contribution_lens import faithfulness

    rows = [
        {"protocol": "every_layer", "task": "gsm8k", "kind": "lm", "seq": str(seq), "method": method,
         "mode": "comprehensiveness", "ratio": ratio, "tokens": 10, "clean": 20.0 + seq,
         "nll": 20.0 + seq + (5 + (method == "contribution") + 0.1 * seq) * 10 * ratio}
        for seq in range(6) for method in ("attention", "contribution") for ratio in (0.0, 0.5)
    ]  # fmt: skip
    settings = faithfulness.Settings(
        methods=("attention", "contribution"), modes=("comprehensiveness",), ratios=(0.0, 0.5), rank_by="abs"
    )
    run = faithfulness.FaithfulnessRun(rows, settings, faithfulness.DataSettings(data=("gsm8k",)), resamples=100)
    summary, verdicts = run.summary, run.verdicts()
    frame, tables, shown, judged = run.frame, run.tables, run.summary, run.verdicts()
    frame["nll"] = 0.0  # a notebook editing what it was handed
    frame.drop(frame.index[:6], inplace=True)
    tables.delta_loss["ci_low"] = 0.0
    shown["delta_loss"] = 0.0
    judged["verdict"] = "changed"
    assert len(run.frame) == len(rows) and run.summary.equals(summary) and run.verdicts().equals(verdicts)


@pytest.mark.usefixtures("as_a_user")
def test_thresholds_are_positive_finite_numbers_everywhere() -> None:
    model = tiny_bridge()
    f = cl.flow(model, ONE)
    for threshold, error, said in (
        (float("nan"), ValueError, "threshold must be a positive finite number, got nan"),
        (float("inf"), ValueError, "threshold must be a positive finite number, got inf"),
        ("0.05", TypeError, "threshold must be a positive finite number, got str '0.05'"),
        (True, TypeError, "threshold must be a positive finite number, got bool True"),
    ):
        for call in (lambda t: f.graph(threshold=t), lambda t: cl.flow(model, ONE, threshold=t)):
            with pytest.raises(error) as raised:
                call(threshold)
            assert str(raised.value) == said
    with pytest.raises(TypeError, match=r"threshold must be a positive finite number, got str '0\.05'"):
        cl.explain_generation(model, ONE[:4], max_new_tokens=1, threshold="0.05")
    # Every real number type is a number: NumPy, a 0-d tensor.
    assert f.graph(threshold=np.float32(0.05)).equals(f.graph(threshold=0.05))
    assert f.graph(threshold=torch.tensor(0.05, dtype=torch.float64)).equals(f.graph(threshold=0.05))


@pytest.mark.parametrize("scope", ["intra", "inter"])
@pytest.mark.parametrize("scale", [1e-40, 1e-44])
def test_subnormal_values_give_the_weights_of_their_own_numbers(scale, scope) -> None:
    # v * 1e-40 is a float32 subnormal: its norms would be too, and the weights (their ratios) NaN.
    pattern, v, W_O = random_layer("gqa")
    small = v * scale  # these inputs, as float32 holds them
    d = cl.decompose(pattern, small, W_O, scope=scope)
    exact = cl.decompose(pattern, small.double() * 2.0**140, W_O, scope=scope)  # an exact power of two
    assert d.contribution.dtype == torch.float64  # accumulated where the norms fit
    assert bool(torch.isfinite(d.contribution).all())
    assert_close(d.contribution, exact.contribution, rtol=1e-9, atol=1e-12)
    assert_close(d.value_norm * 2.0**140, exact.value_norm, rtol=1e-9, atol=0)
    scaled_w = cl.decompose(pattern, v, W_O * scale, scope=scope)
    assert_close(
        scaled_w.contribution,
        cl.decompose(pattern, v, (W_O * scale).double() * 2.0**140, scope=scope).contribution,
        rtol=1e-9,
        atol=1e-12,
    )


@pytest.mark.usefixtures("as_a_user")
def test_zero_length_inputs_are_refused_by_name() -> None:
    v, W_O = torch.zeros(1, 0, 2, 3), torch.zeros(4, 3, 5)
    with pytest.raises(ValueError) as error:
        cl.decompose(torch.zeros(1, 4, 0, 0), v, W_O)
    assert str(error.value) == (
        "pattern is empty: shape (1, 4, 0, 0) has no query, no key (expected [batch head query key] (hook_pattern))"
    )
    with pytest.raises(ValueError, match=r"^v is empty: shape \(1, 3, 2, 0\) has no d_head"):
        cl.decompose(torch.ones(1, 4, 3, 3) / 3, torch.zeros(1, 3, 2, 0), torch.zeros(4, 0, 5))
    g = cl.attention_geometry(tiny_bridge(), ONE, layers=[0])
    for name, what in (("queries", "query"), ("keys", "key"), ("heads", "head")):
        with pytest.raises(ValueError) as error:
            g.to_dataframe(**{name: []})
        assert str(error.value) == f"{name} is empty: give at least one {what}, or None for all {name}"


@pytest.mark.usefixtures("as_a_user")
def test_integers_are_read_one_way_everywhere() -> None:
    model = tiny_bridge()
    result = cl.logit_attribution(model, ONE)
    g = cl.attention_geometry(model, ONE, layers=[0])
    from contribution_lens.drawing import plot

    # NumPy and 0-d tensor integers are integers, in every argument.
    assert result.top(np.int64(3)).equals(result.top(3)) and result.top(torch.tensor(3)).equals(result.top(3))
    drawn = plot.token_heatmap(g, layer=0, head=np.int64(1)).data[0].z
    assert np.array_equal(drawn, plot.token_heatmap(g, layer=0, head=1).data[0].z, equal_nan=True)
    explained = cl.explain_generation(model, ONE[:4], max_new_tokens=np.int64(2), flow=False)
    assert len(explained) == 2
    assert len(cl.explain_generation(model, ONE[:4], max_new_tokens=torch.tensor(1), flow=False)) == 1
    # Anything else is refused, naming the argument and what it got.
    for call, said in (
        (lambda: result.top(2.5), "k must be a positive integer, got float 2.5"),
        (lambda: result.top("3"), "k must be a positive integer, got str '3'"),
        (lambda: result.top(True), "k must be a positive integer, got bool True"),
        (
            lambda: plot.token_heatmap(g, layer=0, head=1.0),
            "head must be an integer (or None: every head), got float 1.0",
        ),
        (
            lambda: cl.explain_generation(model, ONE[:4], max_new_tokens=2.0),
            "max_new_tokens must be a positive integer, got float 2.0",
        ),
    ):
        with pytest.raises(TypeError) as error:
            call()
        assert str(error.value) == said
    with pytest.raises(ValueError, match=r"^k must be a positive integer, got 0$"):
        result.top(0)


@pytest.mark.usefixtures("as_a_user")
def test_inspect_checks_tokens_before_any_window(bundled_model) -> None:
    answer = cl.explain_generation(bundled_model, "The capital of France is", max_new_tokens=2, flow=False)
    for tokens, error, said in (
        (-5, ValueError, "tokens must be a positive integer, got -5"),
        (0, ValueError, "tokens must be a positive integer, got 0"),
        (2.5, TypeError, "tokens must be a positive integer, got float 2.5"),
    ):
        with pytest.raises(error) as raised:
            cl.inspect(bundled_model, answer, tokens=tokens)
        assert str(raised.value) == said
    assert cl.inspect(bundled_model, answer, tokens=np.int64(4)).tokens == 4


# --- dtype=: the accumulation dtype is checked at the door, by one rule --------------------------------------


def _accumulating_calls() -> dict:
    """Every public function that takes an accumulation ``dtype=``, called on a tiny model or layer."""
    model = tiny_bridge("gqa")
    pattern, v, W_O = random_layer("gqa")
    ids = torch.tensor([1, 5, 7, 9, 3, 2])
    tape = cl.analyses.QKTape.plan(model, cl.to_token_batch(model, ids), last=1, rows=[-1])
    assert tape is not None
    tape.run()
    return {
        "decompose": lambda dtype: cl.decompose(pattern, v, W_O, dtype=dtype).contribution,
        "head_outputs": lambda dtype: cl.decomposition.head_outputs(pattern, v, dtype=dtype),
        "importance": lambda dtype: cl.importance(pattern, v, W_O, method="contribution", dtype=dtype),
        "attention_geometry": lambda dtype: cl.attention_geometry(model, ids, layers=[1], dtype=dtype)[1].contribution,
        "logit_attribution": lambda dtype: cl.logit_attribution(model, ids, dtype=dtype).attention,
        "explain_generation": lambda dtype: (
            cl.explain_generation(model, ids[:4], answer=ids[4:], flow=False, dtype=dtype)[0].attribution.attention
        ),
        "qk_attribution": lambda dtype: cl.qk_attribution(model, ids, 1, 0, dtype=dtype).key_parts,
        "QKTape.attribution": lambda dtype: tape.attribution(1, 0, dtype=dtype).key_parts,
        "LayerInputs.decompose": lambda dtype: cl.map_layers(
            model, ids, lambda layer: layer.decompose("inter", dtype).contribution, layers=[0]
        )[0],
    }


ACCUMULATING = list(_accumulating_calls())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int64, torch.bool, "float16", "int64", "cuda"])
@pytest.mark.parametrize("function", ACCUMULATING)
def test_an_accumulation_dtype_narrower_than_float32_is_refused_naming_dtype(function, dtype) -> None:
    call = _accumulating_calls()[function]
    with pytest.raises(ValueError, match=r"^dtype must be torch\.float32 or torch\.float64 \(or its name"):
        call(dtype)


@pytest.mark.parametrize("function", ACCUMULATING)
def test_an_accumulation_dtype_given_by_name_is_taken(function) -> None:
    call = _accumulating_calls()[function]
    for name, dtype in [("float64", torch.float64), ("torch.float64", torch.float64), ("float32", torch.float32)]:
        assert call(name).dtype == dtype, (function, name)
    assert call(torch.float64).dtype == torch.float64


def test_a_bad_accumulation_dtype_is_refused_before_any_pass() -> None:
    model = tiny_bridge("gqa")
    passes: list[int] = []
    model.hook_dict["hook_embed"].add_hook(lambda tensor, hook: passes.append(1))
    try:
        for call in (
            lambda: cl.logit_attribution(model, IDS[0], dtype=torch.float16),
            lambda: cl.explain_generation(model, IDS[0, :4], answer=IDS[0, 4:], dtype="bfloat16"),
            lambda: cl.attention_geometry(model, IDS[0], dtype=torch.int64),
            lambda: cl.qk_attribution(model, IDS[0], 1, 0, dtype="float16"),
        ):
            with pytest.raises(ValueError, match="dtype must be"):
                call()
        assert passes == []
    finally:
        model.hook_dict["hook_embed"].remove_hooks()
