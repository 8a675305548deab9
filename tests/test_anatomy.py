"""A model's anatomy: every fact the adapter's wiring reads of a model, equal to what its modules probed.

`probes.probed_facts` reads the facts with the probes the adapter's modules used, each its own way;
`probes.read_facts` reads them through the adapter. Every architecture the project accepts is checked in
``tests/integration/test_architectures.py``; here the tiny native bridges, the bundled model, and that a
weight edited between two calls is seen by the second.
"""

import pytest
import torch

import probes
from conftest import tiny_bridge


@pytest.mark.parametrize("attention_dir", ["causal", "bidirectional"])
@pytest.mark.parametrize("variant", ["mha", "gqa", "mqa"])
def test_the_facts_are_those_the_old_probes_read(variant: str, attention_dir: str) -> None:
    model = tiny_bridge(variant, biases=True, attention_dir=attention_dir)
    assert probes.differences(probes.probed_facts(model), probes.read_facts(model)) == []


def test_the_bundled_models_facts_are_those_the_old_probes_read(bundled_model) -> None:
    assert probes.differences(probes.probed_facts(bundled_model), probes.read_facts(bundled_model)) == []


def test_a_weight_edited_between_two_calls_is_seen_by_the_second(tmp_path) -> None:
    """Gemma 3: offset gains (``1 + w``), post-attention and q/k norms. One weight edited in place, one replaced."""
    import architectures
    import contribution_lens as cl

    model = cl.load_model(str(architectures.build("Gemma3ForCausalLM", tmp_path / "gemma3")))
    before = probes.read_facts(model)
    block = model.blocks[1]
    with torch.no_grad():
        model.ln_final.original_component.weight.mul_(2.0)
        block.attn.q_norm.original_component.weight.add_(0.5)
    post = block.get_submodule(before["layers"][1]["post_name"]).original_component
    post.weight = torch.nn.Parameter(post.weight.detach() * 3.0)
    after = probes.read_facts(model)
    assert probes.differences(probes.probed_facts(model), after) == []
    changed = probes.differences(before, after)
    for fact in ("final_norm.gain", "layers.1.post_norm.gain", "layers.1.qk_form.q_norm.gain"):
        assert fact in changed, changed
    assert not any(fact.startswith("layers.0.") for fact in changed), changed


def test_the_old_names_of_the_norm_warn_and_give_the_one_norm() -> None:
    from contribution_lens import adapter

    for old in ("FrozenNorm", "PostNorm"):
        with pytest.warns(DeprecationWarning, match=rf"adapter\.{old} is now contribution_lens\.adapter\.Norm"):
            assert getattr(adapter, old) is adapter.Norm
