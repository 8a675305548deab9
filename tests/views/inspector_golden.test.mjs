// The inspector's front-end against the Python side: run by tests/views/test_inspector_front_end.py,
// which writes CL_GOLDEN/golden.json (payloads and the values the Python side computes of them) and
// CL_GOLDEN/inspector.mjs (the module exactly as the widget and the page load it) and CL_GOLDEN/why.mjs (the why
// panel's module). No browser.
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { test } from "node:test";
import { pathToFileURL } from "node:url";

const folder = process.env.CL_GOLDEN;
if (!folder) throw new Error("run through pytest (tests/views/test_inspector_front_end.py): CL_GOLDEN names the golden files");
const golden = JSON.parse(readFileSync(join(folder, "golden.json"), "utf8"));
const js = await import(pathToFileURL(join(folder, "inspector.mjs")).href);
const whyPanel = await import(pathToFileURL(join(folder, "why.mjs")).href); // a panel's module of its own

// |got - want| <= atol + rtol |want| for each number; null (NaN in Python) wants NaN.
function close(got, want, what, { atol = 0, rtol = 0 } = {}) {
  assert.equal(got.length, want.length, what + ": length");
  for (let i = 0; i < want.length; i++) {
    if (want[i] === null) {
      assert.ok(Number.isNaN(got[i]), `${what}[${i}]: ${got[i]}, want NaN`);
    } else {
      const error = Math.abs(got[i] - want[i]);
      assert.ok(error <= atol + rtol * Math.abs(want[i]), `${what}[${i}]: ${got[i]}, want ${want[i]} (off by ${error})`);
    }
  }
}

const TIGHT = { atol: 1e-15, rtol: 1e-12 }; // float64 twins: the same operations, up to their order

test("dequantise", () => {
  for (const layer of golden.layers) {
    for (const [name, codec] of Object.entries(layer.payload.codecs)) {
      close(js.dequantise(layer.payload[name], layer.meta.codecs[codec]), layer.dequantised[name], `${layer.name} ${name}`);
    }
  }
  close(js.dequantise(golden.half.sent, { kind: "float16", dtype: "float16" }), golden.half.expected, "float16 edge values");
});

test("cellIndex", () => {
  for (const layer of golden.layers) {
    const { index, cells } = js.cellIndex(layer.meta);
    assert.equal(cells, layer.cells.count, layer.name);
    assert.deepEqual(Array.from(index, (c) => c >= 0), layer.cells.mask, layer.name);
    assert.deepEqual(Array.from(index).filter((c) => c >= 0), [...Array(cells).keys()], layer.name + ": row-major");
  }
});

test("windowStarts", () => {
  for (const { n, tokens, current, expected } of golden.windows) {
    assert.deepEqual(js.windowStarts(n, tokens, current), expected, `n=${n} tokens=${tokens} current=${current}`);
  }
});

test("escapeToken", () => {
  for (const { token, label } of golden.labels) {
    assert.equal(js.escapeToken(token), js.tokenText(label), JSON.stringify(token));
    assert.equal(label.slice(0, label.indexOf(":") + 1) + js.escapeToken(token), label);
  }
});

test("combine", () => {
  for (const layer of golden.layers) {
    const { arrays, groups, expected } = layer.combine;
    const a = Object.fromEntries(Object.entries(arrays).map(([name, values]) => [name, Float64Array.from(values)]));
    const { index, cells } = js.cellIndex(layer.meta);
    js.combine(layer.meta, a, index, cells, [[...Array(layer.meta.n_heads).keys()]], "all_");
    js.combine(layer.meta, a, index, cells, groups, "group_");
    for (const [name, want] of Object.entries(expected)) close(a[name], want, `${layer.name} ${name}`, TIGHT);
  }
});

test("decodeCompact", async () => {
  for (const layer of golden.layers) {
    const d = js.decode(layer.meta, await js.inflate(layer.compact));
    for (const [name, want] of Object.entries(layer.decoded_compact)) close(d.arrays[name], want, `${layer.name} ${name}`, TIGHT);
    // The combined heads a compact page draws: combine_cells of the decoded per-head numbers.
    const groups = layer.combine.groups.some((heads) => heads.length > 1);
    for (const [name, want] of Object.entries(layer.combine.expected)) {
      if (name.startsWith("all_") || groups) close(d.arrays[name], want, `${layer.name} compact ${name}`, TIGHT);
    }
  }
});

test("hideSink", () => {
  const { meta, values, totals, expected } = golden.hide_sink;
  const d = js.cellIndex(meta);
  const f = { attention: Float64Array.from(values, (v) => v ?? NaN), contribution: Float64Array.from(values, (v) => v ?? NaN) };
  const hidden = js.hideSink(meta, d, f, totals);
  close(hidden.attention, expected.attention, "attention (rows total 1)", TIGHT);
  close(hidden.contribution, expected.contribution, "contribution (rows total S_i)", TIGHT);
  assert.equal(hidden.relative_norm, f.relative_norm, "relative norm is not a share: kept");
});

// The four factors of every view of a fine payload, before and after the sink is hidden.
function checkViews(name, factorsOf) {
  for (const layer of golden.layers) {
    const d = js.decode(layer.meta, layer.payload);
    for (const { state, scope, factors } of layer.views) {
      const got = factorsOf(layer.meta, d, state, scope);
      if (got === null) continue;
      for (const [factor, want] of Object.entries(factors)) {
        close(got[factor], want, `${layer.name} ${JSON.stringify(state)} ${scope} ${factor}`, TIGHT);
      }
    }
  }
}

test("viewFactors", () => {
  checkViews("viewFactors", (meta, d, state, scope) => {
    if (state.hide_sink) return null;
    const { kind, index } = js.viewLevel(meta, state);
    return js.viewFactors(meta, d, index, scope, kind === "group");
  });
});

test("shownFactors", () => {
  checkViews("shownFactors", (meta, d, state, scope) => js.shownFactors(meta, d, state, scope));
});

test("outsideShares", async () => {
  let late = 0;
  for (const layer of golden.layers) {
    for (const payload of [layer.payload, await js.inflate(layer.compact)]) {
      const d = js.decode(layer.meta, payload);
      for (const { state, scope, outside } of layer.views) {
        // A compact page sends the same float32 shares, but its sink cell (which hide_sink divides by) coarser.
        if (payload !== layer.payload && state.hide_sink) continue;
        const got = js.outsideShares(layer.meta, d, state, scope);
        for (const [name, want] of Object.entries(outside)) close(got[name], want, `${layer.name} ${JSON.stringify(state)} ${scope} outside ${name}`, TIGHT);
        late += outside.attention.some((x) => x !== null && x > 0) ? 1 : 0;
      }
    }
  }
  assert.ok(late > 0, "a golden window late in the text has attention outside it");
});

test("decodeSteps", () => {
  const decoded = js.decodeSteps(golden.steps.sent);
  assert.equal(decoded.length, golden.steps.expected.length);
  decoded.forEach((step, k) => {
    const want = golden.steps.expected[k];
    close(step.heads, want.heads, `step ${k} heads`);
    close(step.keys, want.keys, `step ${k} keys`);
    if (want.rollout === null) assert.equal(step.rollout, null);
    else close(step.rollout, want.rollout, `step ${k} rollout`);
  });
});

test("droppedFragment", () => {
  const names = golden.settings.linked;
  // JupyterLab's viewer opened at /lab/tree/page.html#layer=2&head=1: the view is in the outer address only.
  assert.equal(js.droppedFragment("", "#layer=2&head=1", names), "layer=2&head=1");
  // Opened plainly, from a notebook's link (which leaves no trace), or in a tab that kept its fragment: no note.
  assert.equal(js.droppedFragment("", "", names), "");
  assert.equal(js.droppedFragment("#layer=2&head=1", "#layer=2&head=1", names), "");
  assert.equal(js.droppedFragment("", "#Section-heading", names), "");
  assert.equal(js.droppedFragment("", "#view=prediction&step=3", names), "view=prediction&step=3");
});

test("settings", () => {
  // The view state described once (state.py's SETTINGS, sent as meta.settings): the front-end reads it, names no other.
  const { meta, steps, names, linked, toggles, labels, off_default: off, plain } = golden.settings;
  assert.deepEqual(js.settingNames(meta), names);
  assert.deepEqual(js.linkedSettings(meta).map((s) => s.name), linked);
  assert.deepEqual(js.toggleSettings(meta).map((s) => [s.name, s.label]), toggles.map((name, i) => [name, labels[i]]));
  for (const name of Object.keys(js.READERS)) assert.ok(names.includes(name), `the front-end reads ${name}, no setting of the table`);
  // A view off every default, written as a link and read back, is itself: every setting the table links is read.
  const link = js.fragment({ ...off, start: 7, tokens: 2 }, meta);
  assert.ok(!/start=|tokens=/.test(link), link + ": the window is not named in a link");
  const { state, problems } = js.readFragment(meta, link, steps);
  assert.deepEqual(problems, [], link);
  for (const [name, value] of Object.entries(off)) assert.deepEqual(state[name], value, `${name} from ${link}`);
  // The defaults are left out but for the settings a link always names, in the table's order.
  assert.equal(js.fragment(meta.initial, meta), plain);
  assert.deepEqual(js.readFragment(meta, plain, steps).state, meta.initial);
  assert.match(js.readFragment(meta, "#start=3", steps).problems[0], /^start=3 is not a view setting \(layer, head/);
});

test("why", () => {
  const { row, bars, heads, keys } = golden.why;
  // Each key's bars: the top terms then the other components, adding up to log alpha + H.
  row.key_side.forEach((side, n) => {
    for (const drawn of [whyPanel.whyBars(side), whyPanel.whyBars(row.query_side[n])]) {
      assert.deepEqual(drawn.names.slice(0, -1), side === drawn ? side.names : drawn.names.slice(0, -1));
      assert.equal(drawn.names.at(-1), whyPanel.OTHER);
      const sum = drawn.values.reduce((a, b) => a + b, 0);
      close([sum, drawn.total], [bars[n].total, bars[n].total], `key ${row.keys[n]}: the bars' sum and total`, { atol: 1e-4 });
    }
    assert.deepEqual(whyPanel.whyBars(side).names, bars[n].names);
  });
  // A component's head, as the Python side reads it: only L{m}H{h} opens a head.
  for (const [name, where] of Object.entries(heads)) assert.deepEqual(whyPanel.headOf(name), where, name);
  for (const [what, [clicked, want]] of Object.entries(keys)) assert.equal(row.keys[whyPanel.whyKey(row, clicked)], want, what);
});

// A widget model as anywidget gives it: traits, save_changes, and JupyterLab's notebook through its widget manager.
function fakeModel(traits, cells = []) {
  const saved = [];
  const list = (items) => ({ get length() { return items.length; }, get: (i) => items[i], set: (i, v) => { items[i] = v; } });
  return {
    saved,
    get: (name) => traits[name],
    set: (name, value) => { traits[name] = value; },
    save_changes: () => saved.push({ ...traits }),
    widget_manager: { context: { model: { cells: list(cells.map((outputs) => ({ outputs: list(outputs) }))) } } },
    cells,
  };
}

test("writeStill", () => {
  // Reopened while its kernel ran, the notebook's front-end never saw the still displayed: the widget writes it.
  const view = (id) => ({ data: { "application/vnd.jupyter.widget-view+json": { model_id: id } }, metadata: {} });
  const old = { data: { "image/png": "old" }, metadata: { contribution_lens: { still: { layer: 6 } } } };
  const other = { data: { "image/png": "other" }, metadata: { contribution_lens: { still: { layer: 1 } } } };
  const model = fakeModel({}, [[{ data: { "text/plain": "x" }, metadata: {} }, old, view("w1")], [other, view("w2")], [{ ...old }, view("w1")]]);
  const still = { model_id: "w1", data: { "image/png": "new" }, metadata: { contribution_lens: { still: { layer: 8 } } } };
  assert.equal(js.writeStill(model, still), true);
  const cells = model.widget_manager.context.model.cells;
  for (const [c, i] of [[0, 1], [2, 0]]) {
    assert.deepEqual(cells.get(c).outputs.get(i), { output_type: "display_data", data: still.data, metadata: still.metadata });
  }
  assert.equal(cells.get(1).outputs.get(0), other, "another inspector's still is its own");
  assert.equal(js.writeStill(model, still), false, "a still already written is not written again");
  assert.equal(js.writeStill({ get: () => null }, still), false, "no notebook model (the page, VS Code): nothing");
  // A widget without a kernel keeps a drawn still of the view it draws again (sorted keys, as a saved notebook has).
  const again = { model_id: "w1", data: { "image/png": "redrawn" },
                  metadata: { contribution_lens: { still: { view: "heatmap", layer: 8 }, drawn_by: "browser" } } };
  for (const [c, i] of [[0, 1], [2, 0]]) {
    cells.get(c).outputs.get(i).metadata = { contribution_lens: { still: { layer: 8, view: "heatmap" }, drawn_by: "browser" } };
  }
  assert.equal(js.writeStill(model, again, true), false, "the same view, drawn: kept");
  assert.equal(js.writeStill(model, { ...again, metadata: { contribution_lens: { still: { view: "text", layer: 8 } } } }, true), true);
});

test("ownStill", () => {
  // Without a kernel the widget writes its still itself: the kernel's bundle, line, image and metadata alike.
  for (const { state, caption } of golden.still.captions) assert.equal(js.stillCaption(state), caption, JSON.stringify(state));
  const model = { get: (name) => (name === "model_ref" ? "w1" : undefined) };
  const { drawn, undrawn } = golden.still;
  const own = js.ownStill(model, drawn.state, { png: drawn.png, width: drawn.width });
  assert.deepEqual(own, { model_id: "w1", data: drawn.data, metadata: drawn.metadata });
  assert.deepEqual(js.ownStill(model, undrawn.state, null), { model_id: "w1", data: undrawn.data, metadata: undrawn.metadata });
});

test("drawnState", () => {
  // One state: a change no kernel answered goes back to the view drawn, and the kernel is told.
  const traits = { layer: 1, head: -1, factor: "contribution", scope: "inter", query: 20, start: 16, hide_sink: false,
                   group_kv: false, view: "heatmap", step: -1, tokens: 16, meta: golden.settings.meta };
  const model = fakeModel(traits);
  const status = { textContent: "" };
  const state = js.drawnState(model, { querySelector: () => status });
  assert.equal(state.undo(), false, "nothing drawn yet: nothing to go back to");
  state.drawn();
  model.set("head", 3);
  state.drawn(); // a head is drawn from the payload held
  model.set("layer", 5);
  status.textContent = "not drawn: no kernel answered";
  state.drawn(); // not drawn: the state drawn stays layer 1, head 3
  assert.equal(state.undo(), true);
  assert.equal(model.get("layer"), 1);
  assert.equal(model.get("head"), 3);
  assert.deepEqual(model.saved.at(-1).layer, 1);
  assert.equal(state.undo(), false, "already the view drawn");
});
