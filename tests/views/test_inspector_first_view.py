"""The inspector's first view in about one pass: the pass decomposes the layer shown and keeps every other layer's
queries and keys (not its pattern); any other layer, window or window size is cut from them without a pass, ahead
of the view in a thread or when the view asks (saying so meanwhile), with the numbers of the library; a text
whose patterns would not fit runs its pass in tiles."""

import re

import numpy as np
import pytest
import torch
from test_inspector import assert_payload, codes, library_codes

import contribution_lens as cl
from contribution_lens import engine
from contribution_lens.views import inspector as ins
from contribution_lens.views.inspector import background, caches, compute, windows


@pytest.fixture(scope="module")
def llama(tiny_decoder):
    """A tiny transformers Llama (GQA: 4 query heads on 2 value heads, 2 layers): its attention reads in tiles."""
    return cl.load_model(str(tiny_decoder))


IDS = torch.randint(1000, 9000, (1, 24), generator=torch.Generator().manual_seed(3))


@pytest.fixture
def counted(monkeypatch):
    """Passes and payloads computed, counted; nothing computed ahead in a thread (each payload when asked)."""
    monkeypatch.setattr(background, "ENABLED", False)
    counts = {"passes": 0, "payloads": []}
    run, cut = caches.compute_windows, compute.window_payload_of

    def passes(*args, **kwargs):
        counts["passes"] += 1
        return run(*args, **kwargs)

    def payloads(inputs, window, **kwargs):
        counts["payloads"].append((inputs.layer, window.key))
        return cut(inputs, window, **kwargs)

    monkeypatch.setattr(caches, "compute_windows", passes)
    monkeypatch.setattr(compute, "window_payload_of", payloads)
    monkeypatch.setattr(caches, "window_payload_of", payloads)
    return counts


def test_the_first_view_decomposes_one_layer_and_keeps_every_layers_queries_and_keys(llama, counted) -> None:
    inspector = cl.inspect(llama, IDS, layer=1, tokens=8, start=8)
    assert counted["passes"] == 1 and counted["payloads"] == [(1, "8-15")]
    records = inspector._payloads.records
    assert sorted(records) == [0, 1]
    for record in records.values():  # the pass's pattern is not kept: its queries and keys are
        assert record.pattern.is_meta and record.qk is not None and not record.captured
    assert_payload(inspector, llama, IDS, 1)
    for layer, start in [(0, 8), (0, 0), (1, 16), (1, 4)]:
        inspector.start, inspector.layer = start, layer
        assert_payload(inspector, llama, IDS, layer)
    inspector.tokens = 5  # another window size: cut from the records too
    assert_payload(inspector, llama, IDS, 1)
    assert counted["passes"] == 1, "a switch ran the model again"


def test_a_layer_not_decomposed_yet_says_so_while_it_is(llama, counted, monkeypatch) -> None:
    inspector = cl.inspect(llama, IDS, layer=1, tokens=8)
    sent = []
    monkeypatch.setattr(inspector, "send", sent.append)
    inspector.layer = 0
    assert sent == [
        {"type": "progress", "text": "inspector: layer 0 is not decomposed yet (1 of 2 ready)"},
        {"type": "progress", "text": ""},
    ]
    sent.clear()
    inspector.layer = 1  # ready: sent at once, nothing said
    assert sent == [] and counted["payloads"][-1] == (0, "0-7")


def test_the_thread_computes_the_views_neighbours_as_the_view_would(llama, monkeypatch) -> None:
    monkeypatch.setattr(background, "ENABLED", True)
    inspector = cl.inspect(llama, IDS, layer=1, tokens=8)
    worker = inspector._payloads.prefetching
    worker.join(60.0)
    assert worker.error is None and not worker.running
    cache = inspector._payloads
    planned = cache.to_precompute(inspector.window, 8)
    assert all(cache.ready(window, layer) for window in planned for layer in (0, 1))
    ahead = cache.computed[inspector.window.key][0]
    monkeypatch.setattr(background, "ENABLED", False)
    asked = cl.inspect(llama, IDS, layer=1, tokens=8)
    asked.layer = 0
    assert asked.payload == {**ahead, "layer": 0, "key": "0-7/0"}


def test_pages_and_stills_need_no_pass_after_the_first_view(llama, counted, tmp_path) -> None:
    inspector = cl.inspect(llama, IDS, layer=1, tokens=8, start=8)
    inspector.write_html(tmp_path / "fine.html", start=0, tokens=24)
    inspector.write_html(tmp_path / "compact.html", compact=True)
    inspector._view_figure()  # the still's figure
    assert counted["passes"] == 1


def test_a_text_whose_patterns_would_not_fit_runs_its_pass_in_tiles(llama, counted, monkeypatch) -> None:
    """Its numbers are the library's; its why panel says why it cannot split the scores."""
    monkeypatch.setattr(engine, "WHOLE_PATTERN_BYTES", 1000)  # 4 heads x 24 x 24 floats pass it
    monkeypatch.setattr(caches, "pattern_fits", engine.pattern_fits)
    inspector = cl.inspect(llama, IDS, layer=1, head=2, tokens=8, start=8)
    assert inspector._payloads.qk == "tiles" and inspector._splits.tape is None
    expected = library_codes(llama, IDS, 1, inspector.window)
    for name, want in expected.items():
        assert np.abs(codes(inspector.payload, name).astype(int) - want.astype(int)).max() <= 1, name
    with pytest.raises(ins.InspectorError, match=re.escape("the why panel splits the scores the model computes")):
        inspector.why()


def test_a_model_whose_attention_is_its_own_decomposes_every_layer_in_its_pass(counted) -> None:
    """TransformerLens's native attention: no queries and keys to keep, so the one pass cuts every window."""
    from conftest import tiny_bridge

    model = tiny_bridge("gqa", n_layers=3)
    inspector = cl.inspect(model, IDS % 50, layer=0, tokens=8)
    assert not inspector._payloads.records and counted["passes"] == 1
    planned = inspector._payloads.to_precompute(inspector.window, 8)
    assert len(counted["payloads"]) == 3 * len(planned)
    assert all(inspector._payloads.ready(window, layer) for window in planned for layer in range(3))
    assert windows.token_window(24, tokens=8).key in inspector._payloads.computed


def test_the_interpreter_exits_cleanly_while_a_prefetch_thread_computes() -> None:
    """A daemon thread killed inside torch's kernels at exit aborted the process (exit 134, "terminate called
    without an active exception"): a notebook's kernel or a test session ending while an inspector computed ahead."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import torch
        from contribution_lens.views.inspector.background import Prefetch
        a = torch.randn(400, 400)
        def work(_):
            for _ in range(20):
                a @ a
        Prefetch(work, range(1000)).start()  # the interpreter ends at once, the thread mid-item
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.returncode, done.stderr[-500:])
