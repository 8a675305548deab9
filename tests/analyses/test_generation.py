"""explain_generation's result saves and loads itself: every step, its attribution and its flow, in one file."""

import dataclasses

import pytest
import torch
from safetensors import safe_open

import contribution_lens as cl
from conftest import tiny_bridge
from contribution_lens.analyses.generation import GenerationExplanation

IDS = torch.tensor([1, 5, 7, 9, 3, 2, 11, 4])


def explained(flow: bool) -> GenerationExplanation:
    result = cl.explain_generation(tiny_bridge("gqa", biases=True), IDS[:5], answer=IDS[5:], flow=flow)
    # A tensor prompt is kept as None; a text prompt (which needs a tokenizer) must come back too.
    return dataclasses.replace(result, prompt="a prompt, ünïcode included")


def assert_same_fields(loaded: object, original: object, *, skip: tuple[str, ...] = ()) -> None:
    """Every dataclass field but ``skip`` equal: tensors exactly and in their dtype, the rest with ``==`` and type."""
    assert dataclasses.is_dataclass(original)
    for field in dataclasses.fields(original):
        got, want = getattr(loaded, field.name), getattr(original, field.name)
        if field.name in skip:
            continue
        if isinstance(want, torch.Tensor):
            assert got.dtype == want.dtype and torch.equal(got, want), field.name
        else:
            assert got == want and type(got) is type(want), (field.name, got, want)


def assert_same_flow(loaded: cl.Flow, original: cl.Flow) -> None:
    assert (loaded.positions, loaded.threshold, loaded.n_layers) == (
        original.positions,
        original.threshold,
        original.n_layers,
    )
    assert loaded.str_tokens == original.str_tokens and loaded.layers == original.layers
    assert torch.equal(loaded.tokens, original.tokens) and torch.equal(loaded.attention_mask, original.attention_mask)
    for layer in original.layers:
        assert_same_fields(loaded[layer], original[layer], skip=("edges",))
        assert_same_fields(loaded[layer].edges, original[layer].edges)
    assert torch.equal(loaded.rollout, original.rollout)


@pytest.mark.parametrize("flow", [True, False], ids=["flow", "no-flow"])
def test_save_and_load_round_trip_every_field(tmp_path, flow: bool) -> None:
    original = explained(flow)
    loaded = GenerationExplanation.load(original.save(tmp_path / "answer.safetensors"))
    assert_same_fields(loaded, original, skip=("steps",))
    assert len(loaded) == len(original) == 3 and repr(loaded) == repr(original)
    for got, want in zip(loaded, original, strict=True):
        assert_same_fields(got, want, skip=("attribution", "flow"))
        assert_same_fields(got.attribution, want.attribution)
        assert got.attribution.has_biases == want.attribution.has_biases != ()
        if flow:
            assert_same_flow(got.flow, want.flow)
        else:
            assert got.flow is None
    assert loaded.to_dataframe().equals(original.to_dataframe())
    assert loaded.key_matrix().equals(original.key_matrix())


def test_the_steps_share_one_flow_in_the_file_and_after_loading(tmp_path) -> None:
    original = explained(flow=True)
    path = original.save(tmp_path / "answer.safetensors")
    with safe_open(str(path), framework="pt") as handle:
        mixings = [name for name in handle.keys() if name.endswith(".mixing")]
    assert len(mixings) == original[0].flow.n_layers  # once, not once per step
    loaded = GenerationExplanation.load(path)
    assert all(step.flow[0] is loaded[0].flow[0] for step in loaded)
    assert [step.flow.position for step in loaded] == [step.position for step in original] == [4, 5, 6]
    # Saved again, it is the same file's content: loading does not undo the sharing.
    again = GenerationExplanation.load(loaded.save(tmp_path / "again.safetensors"))
    assert_same_flow(again[2].flow, original[2].flow)


def test_a_truncated_foreign_or_missing_file_or_a_folder_is_named(tmp_path) -> None:
    path = explained(flow=False).save(tmp_path / "answer.safetensors")
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    what = "a GenerationExplanation written by GenerationExplanation.save"
    with pytest.raises(ValueError, match=rf"^{truncated} is not {what} \(SafetensorError"):
        GenerationExplanation.load(truncated)
    foreign = cl.logit_attribution(tiny_bridge(), IDS, target=4).save(tmp_path / "logit.safetensors")
    with pytest.raises(
        ValueError, match=rf"^{foreign} is not {what} .*its format is 'contribution_lens.LogitAttribution/2'"
    ):
        GenerationExplanation.load(foreign)
    with pytest.raises(FileNotFoundError, match=rf"^no saved GenerationExplanation at {tmp_path / 'missing'}$"):
        GenerationExplanation.load(tmp_path / "missing")
    with pytest.raises(IsADirectoryError, match=rf"^{tmp_path} is a folder; give a file path such as {tmp_path}/"):
        explained(flow=False).save(tmp_path)
    with pytest.raises(IsADirectoryError, match=rf"^{tmp_path} is a folder; give the file GenerationExplanation.save"):
        GenerationExplanation.load(tmp_path)
