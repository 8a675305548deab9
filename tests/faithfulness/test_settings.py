"""The settings of a run: each option checked once, with one message for the Python API and the CLI."""

import pytest

from conftest import raises_bad_input
from contribution_lens import faithfulness

PROTOCOL_NAMES = "every_layer, one_layer, input_deletion"


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            {"protocols": ("everywhere",)},
            f"protocols: expected 'all' or a comma-separated subset of {PROTOCOL_NAMES}, got 'everywhere'",
        ),
        (
            {"protocols": ("input_deletion",), "granularity": "head"},
            "granularity: expected 'token' with protocols input_deletion (it ranks tokens), got 'head'",
        ),
        ({"methods": ("attention", "saliency")}, "methods: expected 'all' or a comma-separated subset of attention,"),
        ({"ratios": (0.0, 1.0)}, "ratios: expected comma-separated numbers in [0, 1), got (0.0, 1.0)"),
        ({"ratios": (-0.1,)}, "ratios: expected comma-separated numbers in [0, 1), got (-0.1,)"),
        (
            {"modes": ("both",)},
            "modes: expected a comma-separated subset of comprehensiveness, sufficiency, got 'both'",
        ),
        ({"scope": "heads"}, "scope: expected one of inter, intra, got 'heads'"),
        ({"layers": (1, "x")}, "layers: expected comma-separated integers, got (1, 'x')"),
    ],
    ids=["protocol", "granularity", "method", "ratio-1", "ratio-negative", "mode", "scope", "layers"],
)
def test_bad_settings_name_the_field_what_was_expected_and_what_was_given(settings, message) -> None:
    with raises_bad_input(message):
        faithfulness.Settings(**settings)


def test_all_means_the_registered_defaults_and_every_protocol() -> None:
    import contribution_lens as cl

    settings = faithfulness.Settings(methods="all", protocols="all")
    assert settings.methods == cl.default_methods() == ("attention", "value_weighted", "output_normalized",
                                                        "contribution", "random")  # fmt: skip
    assert settings.protocols == tuple(faithfulness.PROTOCOLS)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"data": ("wiki=x",)}, "data: expected NAME=PATH with NAME one of gsm8k, fineweb, text, mmlu"),
        ({"data": ("gsm8k",), "chunk_length": 1}, "chunk_length: expected an integer >= 2, got 1"),
        ({"data": ("gsm8k",), "batch_size": 0}, "batch_size: expected a positive integer, got 0"),
        ({"data": ("gsm8k",), "choice_ratios": (2.0,)}, "choice_ratios: expected comma-separated numbers in [0, 1)"),
        ({}, "nothing to evaluate"),
    ],
    ids=["name", "chunk", "batch", "choice-ratios", "empty"],
)
def test_bad_data_settings_are_refused(data, message) -> None:
    with raises_bad_input(message):
        faithfulness.DataSettings(**data)


def test_data_settings_split_text_and_multiple_choice_sets() -> None:
    data = faithfulness.DataSettings(data=("gsm8k", "boolq", "text", "MMLU"))
    assert data.lm == ("gsm8k", "text") and data.choice == ("boolq", "MMLU")
    assert data.to_dict()["lm"] == ["gsm8k", "text"]


def test_signed_ranking_is_reported_only_where_it_differs() -> None:
    settings = faithfulness.Settings(methods=("attention", "contribution", "random"))
    labels = [faithfulness.Condition(m, r, "sufficiency", 0.1).label for m, r in settings.variants()]
    assert labels == ["attention", "contribution", "contribution:signed", "random"]


def test_threads_default_to_the_cores_shared_by_the_processes_of_the_machine(monkeypatch) -> None:
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert faithfulness.RunOptions().cpu_threads() == 16
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun --nproc_per_node 2
    assert faithfulness.RunOptions().cpu_threads() == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")
    assert faithfulness.RunOptions().cpu_threads() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert faithfulness.RunOptions().cpu_threads() == 3, "OMP_NUM_THREADS, where set, is the most"
    assert faithfulness.RunOptions(threads=5).cpu_threads() == 5, "the option wins"
    with raises_bad_input("threads: expected a positive integer, got 0"):
        faithfulness.RunOptions(threads=0)
