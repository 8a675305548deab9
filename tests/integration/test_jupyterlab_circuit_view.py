"""The circuit view live in a real JupyterLab (the harness of `test_jupyterlab`): a click on a head node of the
circuit's figure reaches the kernel, which opens that head in the inspector beside it at the final position, and
the *why* panel draws that head's row without a click on the heatmap; an MLP node says why it opens nothing. Then
the notebook's life: the still follows each click (the notebook marked changed), live, after the tab is closed and
opened again with its kernel running, then with the kernel shut down (a click says no kernel answered) and the
notebook reopened without it (the circuit and the last view as images); the server's own export shows images."""

import json
import time
import urllib.request

import numpy as np
import pytest
from test_jupyterlab import PANEL, add_cell, drawn, kernel, kernel_follows, lab, page  # noqa: F401  (fixtures)

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
  const gd = root && root.querySelector('.cl-why-bars');  // drawn by the why panel's module, once it is loaded
  if (!figure || !gd) return null;
  const menu = (name) => root.querySelector("select[data-control='" + name + "']").value;
  const notes = [...document.querySelectorAll('.cl-circuit-note')].map((e) => e.textContent);
  return {caption: root.querySelector('.cl-why-caption').textContent, layer: menu('layer'), head: menu('head'),
          query: menu('query'), note: notes.length ? notes[notes.length - 1] : '',
          bars: gd.offsetHeight > 0 && gd.data ? gd.data.map((t) => ({y: t.y, x: t.x})) : null};
}"""


FIGURE = "[...document.querySelectorAll('.js-plotly-plot')].find((g) => (g.data || []).some((t) => t.name === 'nodes'))"


def click_node(tab, node: str) -> None:
    """A mouse click on ``node``'s marker in the live circuit figure, once plotly's hover is on it."""
    for _ in range(5):
        x, y = tab.evaluate(
            f"""(node) => {{
              const gd = {FIGURE};
              gd.scrollIntoView();
              const fl = gd._fullLayout, t = gd.data.find((d) => d.name === 'nodes'), n = t.customdata.indexOf(node);
              const r = gd.getBoundingClientRect();
              return [r.left + fl._size.l + fl.xaxis.l2p(t.x[n]), r.top + fl._size.t + fl.yaxis.l2p(t.y[n])];
            }}""",
            node,
        )
        tab.mouse.move(x - 3, y - 3)
        tab.mouse.move(x, y)
        try:  # plotly clicks the point it last hovered (the figure may still be settling to its pane's width)
            tab.wait_for_function(
                f"(node) => ({FIGURE})._hoverdata?.some((p) => p.data.name === 'nodes' && p.customdata === node)",
                arg=node, timeout=2_000,
            )  # fmt: skip
        except Exception:
            continue
        tab.wait_for_timeout(400)  # a click within 300 ms of the last is a double click
        tab.mouse.click(x, y)
        return
    raise AssertionError(f"plotly's hover never reached {node}")


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
        assert shown["note"].startswith(f"{node} opened in the inspector at query 4"), shown["note"]
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


CELL = """() => {
  if (!window.jupyterapp || !window.jupyterapp.shell) return null;  // the page is (re)loading
  const panel = [...window.jupyterapp.shell.widgets('main')].find((w) => w.content && w.sessionContext);
  if (!panel) return null;
  const index = panel.context.model.toJSON().cells.findIndex((c) => c.source.includes('cl.inspect_circuit('));
  if (index < 0) return null;
  const cell = panel.context.model.toJSON().cells[index];
  const children = [...panel.content.widgets[index].node.querySelectorAll('.jp-OutputArea-child')];
  return {dirty: panel.context.model.dirty, outputs: (cell.outputs || []).map((o, i) => ({
    mimes: Object.keys(o.data || {}), lens: (o.metadata || {}).contribution_lens || null,
    shown: children[i] ? children[i].offsetHeight > 0 : null,
    image: children[i] ? [...children[i].querySelectorAll('img')].map((img) => img.naturalWidth) : []}))};
}"""
"""The circuit cell's outputs in JupyterLab's model (MIME types, our metadata), whether each is shown, its images."""


def still_of_cell(tab) -> dict | None:
    """The view the circuit cell's still records, and who drew it."""
    cell = tab.evaluate(CELL)
    stills = [o["lens"] for o in (cell or {}).get("outputs", []) if o["lens"] and "still" in o["lens"]]
    return stills[0] if stills else None


def save(tab) -> None:
    tab.evaluate(f"async () => await ({PANEL}).context.save()")


def test_the_circuit_views_still_follows_every_click_live_reopened_and_without_a_kernel(page, lab) -> None:  # noqa: F811
    # Failed before: the still took the place of the pass's line, above the circuit, where the widget (looking for the
    # output just before its own) never found it: it stayed shown over the live view, kept the first head after a
    # live reopen, and the notebook was not marked changed; the figure's widget printed its repr into exports.
    drawn(page, "d.caption !== undefined", SHOWN, timeout=120_000)
    cell = page.evaluate(CELL)
    lenses = [o["lens"] for o in cell["outputs"] if o["lens"]]
    assert [("circuit" in x, "still" in x) for x in lenses] == [(True, False), (False, True)], cell
    widget = [o for o in cell["outputs"] if "application/vnd.jupyter.widget-view+json" in o["mimes"]]
    assert len(widget) == 1 and len(cell["outputs"]) == 3, cell  # the circuit's image, the still, one widget
    page.wait_for_function(f"({CELL})().outputs.filter((o) => o.lens).every((o) => o.shown === false)", timeout=30_000)
    # Live: a click moves the still to the head opened, and the notebook is changed.
    save(page)
    click_node(page, "L2H3")
    drawn(page, "d.layer === '2' && d.head === '3' && d.bars", SHOWN)
    page.wait_for_function(
        f"(() => {{ const c = ({CELL})(); const s = c.outputs.find((o) => o.lens && o.lens.still);"
        " return c.dirty && s.lens.still.layer === 2 && s.lens.still.head === 3 && s.lens.drawn_by === 'browser'; })()",
        timeout=90_000,
    )
    save(page)
    # The tab closed (the kernel keeps running) and opened again: live again; a click, then File > Save.
    page.evaluate(
        f"""async () => {{
          const panel = {PANEL};
          panel.close();
          await new Promise((resolve) => setTimeout(resolve, 1000));
          await window.jupyterapp.commands.execute('docmanager:open', {{path: 'inspect.ipynb'}});
        }}"""
    )
    page.wait_for_function(f"({PANEL})?.sessionContext.session?.kernel?.connectionStatus === 'connected'",
                           timeout=120_000)  # fmt: skip
    drawn(page, "d.caption !== undefined && d.layer === '2'", SHOWN, timeout=120_000)
    click_node(page, "L0H1")
    drawn(page, "d.layer === '0' && d.head === '1' && d.bars", SHOWN)
    page.wait_for_function(
        f"(() => {{ const c = ({CELL})(); const s = c.outputs.find((o) => o.lens && o.lens.still);"
        " return c.dirty && s.lens.still.layer === 0 && s.lens.still.head === 1 && s.lens.drawn_by === 'browser'"
        " && c.outputs.filter((o) => o.lens).every((o) => o.shown === false); })()",
        timeout=120_000,
    )
    save(page)
    view = json.loads(kernel(page, "import json; print(json.dumps(view.inspector.view_state()))"))
    saved = json.loads((lab["root"] / "inspect.ipynb").read_text())
    (circuit_cell,) = [c for c in saved["cells"] if "cl.inspect_circuit(" in "".join(c["source"])]
    (still,) = [o for o in circuit_cell["outputs"] if "still" in o.get("metadata", {}).get("contribution_lens", {})]
    assert still["metadata"]["contribution_lens"]["still"] == view and "image/png" in still["data"], view
    # The server's own export (File > Save and Export Notebook As > HTML, sanitized): images, no widget's repr.
    address = f"{lab['url']}/nbconvert/html/inspect.ipynb?download=true&sanitize_html=true&token={lab['token']}"
    exported = urllib.request.urlopen(address, timeout=120).read().decode()
    assert "FigureWidget" not in exported and exported.count('src="data:image/png;base64,') >= 3
    # Kernel > Shut Down Kernel, then a click: the note says no kernel answered, within seconds.
    page.evaluate("window.jupyterapp.commands.execute('kernelmenu:shutdown')")
    page.wait_for_timeout(1000)
    if page.locator(".jp-Dialog .jp-mod-accept").count():
        page.click(".jp-Dialog .jp-mod-accept")
    page.wait_for_function(f"!({PANEL}).sessionContext.session?.kernel", timeout=60_000)
    clicked = time.monotonic()
    click_node(page, "L2H3")
    said = drawn(page, "d.note.startsWith('L2H3: no kernel answered')", SHOWN, timeout=20_000)
    assert time.monotonic() - clicked < 12 and "run the cell again" in said["note"], said
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "jupyterlab_circuit_view_shut_down.png"), full_page=True)
    # Reopened without a kernel (no widget state saved): the circuit and the last view, as images.
    page.reload()
    page.wait_for_function(f"({CELL})()?.outputs.length === 3", timeout=120_000)
    page.wait_for_function(
        f"({CELL})().outputs.filter((o) => o.lens).every((o) => o.shown && o.image.length && o.image[0] > 300)",
        timeout=60_000,
    )
    assert still_of_cell(page)["still"] == view
    page.screenshot(path=str(ARTIFACTS / "jupyterlab_circuit_view_reopened.png"), full_page=True)
