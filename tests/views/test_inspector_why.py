"""The inspector's *why* panel: its rows are `cl.qk_attribution`'s numbers, cut to the largest terms.

Each row (one head, one query, every key of the window) against the library's own split: the same
components in the same order (largest ``|A|`` first), the same values, the rest's sum, and totals
that equal ``log alpha + H``; the widget's cache and refusals; what a static page embeds.
"""

import json
import re

import numpy as np
import pytest
import torch

import contribution_lens as cl
from conftest import tiny_bridge
from contribution_lens.analyses.qk_attribution import QKTape
from contribution_lens.views import inspector as ins
from contribution_lens.views.inspector import caches
from contribution_lens.views.inspector.compute import compute_windows
from contribution_lens.views.inspector.why import PICK_ONE_HEAD, TOP, why_row
from contribution_lens.views.inspector.windows import token_window

TEXT = "When Mary and John went to the store, John gave a drink to"


def check_row(row: dict, split: cl.QKAttribution, head: int, query: int, keys: list[int]) -> None:
    """``row`` is the library's split of ``head`` at ``query``: top terms, their order, the rest, the totals."""
    target = split.log_alpha_plus_entropy(head=head, query=query)
    seen = [j for j in keys if j <= query]
    assert row["keys"] == seen and (row["layer"], row["head"], row["query"]) == (split.layer, head, query)
    for side in ("key", "query"):
        library = split.advantage(side, head=head, query=query)  # components x seen keys, float64 from float32
        for n, j in enumerate(seen):
            column = library[j]
            drawn = row[f"{side}_side"][n]
            order = column.abs().sort_values(ascending=False, kind="stable")
            # The same components, largest |A| first (ties within float32 noise may swap).
            assert len(drawn["names"]) == TOP
            np.testing.assert_allclose(drawn["values"], column[drawn["names"]].to_numpy(), atol=2e-6)
            np.testing.assert_allclose(np.abs(drawn["values"]), order.to_numpy()[:TOP], atol=2e-6)
            assert np.all(np.diff(np.abs(drawn["values"])) <= 2e-6), drawn["values"]
            np.testing.assert_allclose(drawn["other"], column.sum() - column[drawn["names"]].sum(), atol=2e-6)
            # The bars add up to the total, and the total is log alpha + H (the softmax identity).
            assert abs(sum(drawn["values"]) + drawn["other"] - drawn["total"]) < 1e-5
            assert abs(drawn["total"] - target[j]) < 1e-4, (side, j, drawn["total"], float(target[j]))
            assert abs(row["log_alpha_plus_entropy"][n] - target[j]) < 1e-5
    alpha = split.pattern[split.heads.index(head), split.queries.index(query)]
    np.testing.assert_allclose(row["alpha"], alpha[seen].double().numpy(), atol=1e-6)


def test_why_row_is_the_librarys_split_on_the_bundled_model(bundled_model) -> None:
    inspector = cl.inspect(bundled_model, TEXT, layer=9, head=3)
    split = cl.qk_attribution(bundled_model, TEXT, 9, 3, query=None)
    window = inspector.window
    for query in (window.queries[-1], 5):
        row = inspector.why(query)
        check_row(row, split, 3, query, window.keys)
        # log alpha + H from the model's own pattern (not the split's): the totals are the model's.
        pattern = cl.attention_geometry(bundled_model, TEXT, layers=[9])[9].attention[0, 3, query, : query + 1].double()
        want = pattern.log() - (pattern * pattern.log()).sum()
        assert np.allclose([s["total"] for s in row["key_side"]], want.numpy(), atol=1e-4)
    # Two cells, two different explanations.
    assert inspector.why(5)["key_side"][0] != inspector.why(window.queries[-1])["key_side"][0]


def test_why_row_refuses_a_bad_top() -> None:
    model = tiny_bridge("mha")
    split = cl.qk_attribution(model, torch.arange(6), 1, 0, query=-1)
    for top in (0, -1):
        with pytest.raises(ValueError, match="top must be a positive integer"):
            why_row(split, 0, 5, top=top)
    row = why_row(split, 0, 5, top=3)
    assert [len(side["names"]) for side in row["key_side"]] == [3] * 6


@pytest.mark.parametrize("variant", ["mha", "gqa"])
def test_why_row_on_tiny_models_every_key(variant) -> None:
    model = tiny_bridge(variant, biases=True)
    inspector = cl.inspect(model, torch.arange(10), layer=1, head=1, tokens=4, start=6)
    split = cl.qk_attribution(model, torch.arange(10), 1, 1, query=None)
    row = inspector.why(8)
    check_row(row, split, 1, 8, inspector.window.keys)
    assert row["keys"] == [0, 6, 7, 8]  # the window's keys: the sink, then its queries up to the query


def test_widget_caches_each_split_and_row(monkeypatch) -> None:
    monkeypatch.setattr(caches, "WHY_TAPE_BYTES", 0)  # no tape: every split is a pass of its own
    model = tiny_bridge("mha")
    inspector = cl.inspect(model, torch.arange(12), layer=1, head=0)
    calls = []
    original = caches.qk_attribution

    def counted(*args, **kwargs):
        calls.append(args[2:4])
        return original(*args, **kwargs)

    monkeypatch.setattr(caches, "qk_attribution", counted)
    first = inspector.why(11)
    assert calls == [(1, 0)]
    assert inspector.why(11) is first and inspector.why(4) is not first and calls == [(1, 0)]
    inspector.why(4, head=2)
    inspector.why(4, layer=0, head=2)
    assert calls == [(1, 0), (1, 2), (0, 2)]
    inspector.why(3, layer=1, head=0)  # still among the last WHY_KEPT splits: now the most recent
    inspector.why(3, layer=0, head=1)  # a fourth: the least recently used split, (1, 2), goes
    inspector.why(2, layer=1, head=0)
    inspector.why(2, layer=1, head=2)
    assert calls == [(1, 0), (1, 2), (0, 2), (0, 1), (1, 2)]


def count_passes(model) -> list[int]:
    passes: list[int] = []
    model.hook_dict["hook_embed"].add_hook(lambda tensor, hook: passes.append(1))
    return passes


def test_after_the_first_view_a_click_on_any_head_runs_no_pass() -> None:
    model = tiny_bridge("gqa", biases=True)
    ids = torch.arange(3, 23)
    inspector = cl.inspect(model, ids, layer=1, head=0, tokens=8, start=12)
    passes = count_passes(model)
    try:
        rows = {(layer, head): inspector.why(17, layer=layer, head=head) for layer in (0, 1) for head in (0, 3)}
        assert passes == [], "the first view's pass recorded what every split reads"
    finally:
        model.hook_dict["hook_embed"].remove_hooks()
    queries = inspector.window.queries
    for (layer, head), row in rows.items():
        assert row == why_row(cl.qk_attribution(model, ids, layer, head, queries), head, 17, inspector.window.keys)


def test_a_window_off_the_tape_is_recorded_once_then_every_head_there_is_free(monkeypatch) -> None:
    model = tiny_bridge("mha")
    ids = torch.arange(3, 23)
    # Room for one window of 8 queries: the first view keeps the shown window's rows only.
    monkeypatch.setattr(caches, "WHY_TAPE_BYTES", QKTape.estimate_bytes(model, len(ids), 8, 1))
    inspector = cl.inspect(model, ids, layer=1, head=0, tokens=8, start=12)
    assert inspector._splits.tape is not None and list(inspector._splits.tape.rows) == inspector.window.queries
    inspector.start = 0
    passes = count_passes(model)
    try:
        first = inspector.why(5)
        assert len(passes) == 1, "the new window is recorded in one pass"
        second = inspector.why(5, layer=0, head=2)
        assert len(passes) == 1, "another head of the recorded window needs no pass"
    finally:
        model.hook_dict["hook_embed"].remove_hooks()
    queries, keys = inspector.window.queries, inspector.window.keys
    assert first == why_row(cl.qk_attribution(model, ids, 1, 0, queries), 0, 5, keys)
    assert second == why_row(cl.qk_attribution(model, ids, 0, 2, queries), 2, 5, keys)


def test_a_page_off_the_tape_leaves_the_widgets_tape_in_place(monkeypatch) -> None:
    model = tiny_bridge("mha")
    ids = torch.arange(3, 23)
    monkeypatch.setattr(caches, "WHY_TAPE_BYTES", QKTape.estimate_bytes(model, len(ids), 8, 1))
    inspector = cl.inspect(model, ids, layer=1, head=0, tokens=8, start=12)
    kept = inspector._splits.tape
    # The page's query is off the tape, and the shown window with it passes the budget: a pass per layer.
    page = inspector.render_html(start=0, tokens=8, why_queries=[5])
    assert "1/0/5" in page_data(page)["panel_data"]["why"]["data"]
    assert inspector._splits.tape is kept
    passes = count_passes(model)
    try:
        inspector.why(17)
        assert passes == [], "the shown window is still on the tape"
    finally:
        model.hook_dict["hook_embed"].remove_hooks()


def test_recording_the_tape_changes_no_payload() -> None:
    model = tiny_bridge("gqa")
    batch = cl.to_token_batch(model, torch.arange(3, 15))
    window = token_window(12, start=4, tokens=6)
    plain = compute_windows(model, batch, [1], [window])
    tape = QKTape.plan(model, batch, 1, window.queries)
    assert tape is not None
    assert compute_windows(model, batch, [1], [window], tape=tape) == plain
    assert sorted(tape.layers) == [0, 1] and tape.rows == tuple(window.queries)


def test_widget_refuses_what_it_cannot_split_and_answers_the_front_end() -> None:
    model = tiny_bridge("mha")
    inspector = cl.inspect(model, torch.arange(12), layers=[1], layer=1, tokens=4, start=8)
    with pytest.raises(ins.InspectorError, match=re.escape(PICK_ONE_HEAD)):
        inspector.why()  # all heads
    with pytest.raises(ins.InspectorError, match=r"layer 0 is not among the inspected layers \[1\]"):
        inspector.why(9, layer=0, head=0)
    with pytest.raises(ins.InspectorError, match=r"query 3 is not in the token window 8\.\.11"):
        inspector.why(3, head=0)
    sent: list[dict] = []
    inspector.send = sent.append  # type: ignore[method-assign]
    ask = {"type": "panel", "panel": "why", "key": "8-11|why|1/2/9", "layer": 1, "head": 2, "query": 9}
    inspector._on_message(inspector, ask, [])
    inspector._on_message(inspector, {**ask, "head": -1}, [])
    inspector._on_message(inspector, {**ask, "head": "x"}, [])
    answer = {"type": "panel", "panel": "why", "key": "8-11|why|1/2/9"}
    assert sent[0] == {**answer, "data": inspector.why(9, head=2)}
    assert sent[1] == {**answer, "error": PICK_ONE_HEAD}
    assert sent[2]["error"] == "invalid literal for int() with base 10: 'x'"
    assert inspector.error == "", "a refused why request leaves the widget's own settings alone"


def page_data(html: str) -> dict:
    blob = re.search(r"<script type='application/json' class='cl-data'>(.*?)</script>", html, re.DOTALL)
    assert blob
    return json.loads(blob[1].replace("<\\/", "</"))


def test_page_embeds_the_named_queries_rows_for_every_head_of_its_layers() -> None:
    model = tiny_bridge("gqa")
    ids = torch.arange(12)
    inspector = cl.inspect(model, ids, tokens=6, start=6)
    data = page_data(inspector.render_html(why_queries=[-1, 7]))
    assert data["panel_data"]["why"]["queries"] == [7, 11]
    n_heads = model.cfg.n_heads
    assert sorted(data["panel_data"]["why"]["data"]) == sorted(
        f"{layer}/{h}/{q}" for layer in (0, 1) for h in range(n_heads) for q in (7, 11)
    )
    split = cl.qk_attribution(model, ids, 1, None, query=[7, 11])
    for head in range(n_heads):
        check_row(data["panel_data"]["why"]["data"][f"1/{head}/11"], split, head, 11, inspector.window.keys)
    assert page_data(inspector.render_html())["panel_data"] == {}, "nothing embedded unless asked"


def test_page_refuses_why_queries_off_its_window_before_any_pass(monkeypatch) -> None:
    model = tiny_bridge("mha")
    inspector = cl.inspect(model, torch.arange(12), tokens=4, start=8)

    def no_pass(*args, **kwargs):
        raise AssertionError("a pass ran before why_queries was checked")

    monkeypatch.setattr(caches, "compute_windows", no_pass)
    monkeypatch.setattr(caches, "qk_attribution", no_pass)
    inspector._payloads.computed.clear()
    with pytest.raises(ins.InspectorError, match=r"why_queries \[3\] are not queries of the page's window 8..11"):
        inspector.render_html(why_queries=[3, 9])
    with pytest.raises(ins.InspectorError, match="why_queries: position 40 does not exist"):
        inspector.write_html("never.html", why_queries=[40])
    with pytest.raises(ins.InspectorError, match=r"why_queries \[\] are not queries of the page's window"):
        inspector.render_html(why_queries=[])
