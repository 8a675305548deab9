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
