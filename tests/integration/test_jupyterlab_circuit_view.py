"""The circuit view live in a real JupyterLab (the harness of `test_jupyterlab`): a click on a head node of the
circuit's figure reaches the kernel, which opens that head in the inspector below at the final position, and the
*why* panel draws that head's row without a click on the heatmap; an MLP node says why it opens nothing."""

import json

import numpy as np
import pytest
from test_jupyterlab import add_cell, drawn, kernel, kernel_follows, lab, page  # noqa: F401  (the fixtures)

from conftest import ARTIFACTS
from helpers import CHROMIUM

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium)"),
]

CIRCUIT = """\
from circuits.circuit_helpers import random_task

task = random_task(model, n=3, length=7)
circuit = cl.Circuit.from_nodes(cl.circuit_graph(model), ["L0H1", "L2H3", "L1.mlp"])
view = cl.inspect_circuit(model, task, circuit, prompt=2)
view"""
SHOWN = """() => {
  const roots = [...document.querySelectorAll('.cl-inspector')];
  const root = roots[roots.length - 1];
  const figure = [...document.querySelectorAll('.js-plotly-plot')].find((gd) => (gd.data || []).some(
    (t) => t.name === 'nodes'));
  if (!root || !figure) return null;
  const gd = root.querySelector('.cl-why-bars');
  const menu = (name) => root.querySelector("select[data-control='" + name + "']").value;
  const notes = [...document.querySelectorAll('.widget-html-content')].map((e) => e.textContent);
  return {caption: root.querySelector('.cl-why-caption').textContent, layer: menu('layer'), head: menu('head'),
          query: menu('query'), note: notes.length ? notes[notes.length - 1] : '',
          bars: gd.offsetHeight > 0 && gd.data ? gd.data.map((t) => ({y: t.y, x: t.x})) : null};
}"""


def click_node(tab, node: str) -> None:
    """A mouse click on ``node``'s marker in the live circuit figure."""
    x, y = tab.evaluate(
        """(node) => {
          const gd = [...document.querySelectorAll('.js-plotly-plot')].find((g) => (g.data || []).some(
            (t) => t.name === 'nodes'));
          gd.scrollIntoView();
          const fl = gd._fullLayout, t = gd.data.find((d) => d.name === 'nodes'), n = t.customdata.indexOf(node);
          const r = gd.getBoundingClientRect();
          return [r.left + fl._size.l + fl.xaxis.l2p(t.x[n]), r.top + fl._size.t + fl.yaxis.l2p(t.y[n])];
        }""",
        node,
    )
    # plotly clicks the point it last hovered, and a click within 300 ms of the last is a double click:
    # hover first, then click after that delay.
    tab.mouse.move(x, y)
    tab.wait_for_timeout(400)
    tab.mouse.click(x, y)


def test_a_head_node_opens_that_head_with_its_why_panel_in_jupyterlab(page) -> None:  # noqa: F811
    add_cell(page, CIRCUIT)
    drawn(page, "d.caption !== undefined", SHOWN, timeout=120_000)
    for node, (layer, head) in (("L2H3", (2, 3)), ("L0H1", (0, 1))):
        click_node(page, node)
        shown = drawn(
            page, f"d.layer === '{layer}' && d.head === '{head}' && d.bars && d.caption.includes('Why {node} attends')",
            SHOWN,
        )  # fmt: skip
        assert kernel_follows(page, "view.inspector.layer, view.inspector.head, view.inspector.query",
                              f"{layer} {head} 4") == f"{layer} {head} 4"  # fmt: skip
        assert shown["query"] == "4" and "from query 4:" in shown["caption"]
        assert shown["note"].startswith(f"{node} opened below at query 4"), shown["note"]
        row = json.loads(
            kernel(page, f"import json; print(json.dumps(view.inspector.why(4, layer={layer}, head={head})))")
        )
        n = int(np.argmax(row["alpha"]))
        for side, bars in zip(("key_side", "query_side"), shown["bars"], strict=True):
            assert bars["y"] == [*row[side][n]["names"], "other components"]
            np.testing.assert_allclose(bars["x"], [*row[side][n]["values"], row[side][n]["other"]], atol=1e-6)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "jupyterlab_circuit_view.png"), full_page=True)
    click_node(page, "L1.mlp")
    mlp = drawn(page, "d.note.startsWith('L1.mlp is an MLP')", SHOWN)
    assert (mlp["layer"], mlp["head"]) == ("0", "1")
    assert not page.errors, page.errors
