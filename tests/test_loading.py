"""What loading a model leaves on screen: nothing by default, the weight-loading bar when asked for."""

import pytest

import architectures
import contribution_lens as cl


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return str(architectures.build("LlamaForCausalLM", tmp_path_factory.mktemp("llama") / "llama"))


def test_load_model_shows_no_progress_bar_by_default_and_restores_the_setting(checkpoint, capsys) -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.enable_progress_bar()
    cl.load_model(checkpoint)
    # In a notebook the bar is a widget saved at its first frame: "Loading weights: 0%" in every export.
    assert "Loading weights" not in capsys.readouterr().err
    assert hf_logging.is_progress_bar_enabled(), "the user's own setting was not restored"
    cl.load_model(checkpoint, progress=True)
    assert "Loading weights" in capsys.readouterr().err


def test_the_gguf_readers_bar_is_off_unless_progress_is_asked_for(capsys) -> None:
    # Failed before: the first load of a bundled model (its dequantisation) left "Converting and de-quantizing GGUF
    # tensors...: 0%" in the notebook cell that loaded it, and in its exports: transformers' GGUF reader uses tqdm
    # itself, which load_model's progress switch did not reach.
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    from contribution_lens.loading import _gguf_bar_follows_transformers, _progress_bars

    def read() -> str:  # what the reader's loop prints, as it loops over the file's tensors
        for _ in gguf_utils.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."):
            pass
        return capsys.readouterr().err

    with _progress_bars(False), _gguf_bar_follows_transformers():
        assert read() == ""
    with _progress_bars(True), _gguf_bar_follows_transformers():
        assert "de-quantizing GGUF tensors" in read()
    assert gguf_utils.tqdm.__module__.startswith("tqdm")  # put back
