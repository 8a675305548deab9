// @ts-check
// The why panel: for one head, query and key, the score's largest advantage terms on the key side and
// on the query side (why.py, why_row), as two bar charts that add up to log alpha + H; a click on a
// head's bar (L{m}H{h}) opens that head's view.

import { fmt } from "./captions.js";
import { plot } from "./figures.js";

/** @typedef {import("./types.js").Meta} Meta */
/** @typedef {import("./types.js").State} State */
/** @typedef {import("./types.js").View} View */
/** @typedef {import("./types.js").WhyRow} WhyRow */
/** @typedef {import("./types.js").WhySide} WhySide */

/** The bar holding the components not drawn (why.py's OTHER). */
export const OTHER = "other components";
/** What the panel says where the view is not one head (why.py's PICK_ONE_HEAD). */
export const PICK_ONE_HEAD = "the why panel splits one head's scores: choose one head (not all heads, not a KV group)";
const SIDES = /** @type {const} */ (["key_side", "query_side"]);
/** The narrowest panel with the two sides beside each other (narrower: the query side under the key side). */
const WHY_SIDE_BY_SIDE_PX = 760;
const SIDE_NAMES = { key_side: "key side", query_side: "query side" };

/**
 * One side's bars at one key: the largest terms, largest first, then the other components' sum, so
 * that the bars add up to the side's total (log alpha + H without a soft-cap).
 * @param {WhySide} side
 * @returns {{names: string[], values: number[], total: number}}
 */
export function whyBars(side) {
  return { names: side.names.concat(OTHER), values: side.values.concat(side.other), total: side.total };
}

/**
 * The layer and head a component's name holds ("L3H2" -> [3, 2], as qk.py's component_layer_head);
 * null for any other component (an MLP, a bias, the embedding, the other components).
 * @param {string} name
 * @returns {[number, number] | null}
 */
export function headOf(name) {
  const match = /^L(\d+)H(\d+)$/.exec(name);
  return match ? [Number(match[1]), Number(match[2])] : null;
}

/**
 * Which of the row's keys the panel explains: the clicked key where the row holds it, else the key
 * the head attends to most.
 * @param {Pick<WhyRow, "keys" | "alpha">} row
 * @param {number} clicked a key position, -1 for none
 * @returns {number} an index into row.keys
 */
export function whyKey(row, clicked) {
  const at = row.keys.indexOf(clicked);
  if (at >= 0) return at;
  let best = 0;
  row.alpha.forEach((a, n) => {
    if ((a ?? 0) > (row.alpha[best] ?? 0)) best = n;
  });
  return best;
}

/**
 * The panel's caption: what is split, and the identity the bars show.
 * @param {WhyRow} row
 * @param {number} n the key's index in the row
 * @param {string} query the query's label
 * @param {string} key the key's label
 * @returns {string}
 */
export function whyCaption(row, n, query, key) {
  const target = row.log_alpha_plus_entropy[n];
  const sum = target === null ? "−∞" : fmt(target);
  const alpha = row.alpha[n];
  const identity = row.softcap
    ? "The scores are soft-capped (c = " + row.softcap + "): each side adds up to s − Σ α s before the cap, not to log α + H = " + sum
    : "Each side adds up to log α + H(α) = " + sum;
  return (
    "Why L" + row.layer + "H" + row.head + " attends from query " + query + " to key " + key +
    " (α = " + (alpha === null ? "0" : fmt(alpha)) + "): its score split over upstream components, as advantages " +
    "A = T − Σₖ αₖ Tₖ. " + identity + " (key side " + fmt(row.key_side[n].total) + ", query side " +
    fmt(row.query_side[n].total) + "); \"" + OTHER + "\" is the rest. Click a head's bar (L…H…) to open that head."
  );
}

/**
 * The two bar traces (key side left, query side right) of key `n`, with hover text.
 * @param {WhyRow} row
 * @param {number} n
 */
function whyTraces(row, n) {
  return SIDES.map((side, i) => {
    const { names, values } = whyBars(row[side][n]);
    return {
      type: "bar",
      orientation: "h",
      name: SIDE_NAMES[side],
      y: names,
      x: values,
      text: names.map((name, k) => name + ": " + fmt(values[k]) + " (" + SIDE_NAMES[side] + ")"),
      textposition: "none",
      hovertemplate: "%{text}<extra></extra>",
      // The heatmaps' diverging scale (RdBu_r): red raises the score, blue lowers it.
      marker: { color: values.map((v) => (v >= 0 ? "#b2182b" : "#2166ac")) },
      xaxis: i ? "x2" : "x",
      yaxis: i ? "y2" : "y",
    };
  });
}

/**
 * The panel drawn for the view: one head's row, or why there is none (all heads, a KV group, not
 * embedded, the kernel busy or gone).
 * @param {View} view
 * @param {Meta} meta
 * @param {State} state
 * @returns {Promise<unknown>}
 */
export function drawWhy(view, meta, state) {
  const { why, whyCaption: caption, whyBars: figure } = view.parts;
  why.style.display = view.host.why ? "" : "none";
  if (!view.host.why) return Promise.resolve();
  const clicked = view.selected && view.selected.query === state.query ? view.selected.key : -1;
  const got = state.head === "all" || state.group_kv ? PICK_ONE_HEAD
    : view.host.why(state.layer, Number(state.head), state.query, Boolean(view.selected && view.selected.query === state.query));
  figure.style.display = got && typeof got !== "string" ? "" : "none";
  if (!got || typeof got === "string") {
    caption.textContent = "Why: " + (got || "computing L" + state.layer + "H" + state.head + " at query " + state.query + "…");
    return Promise.resolve();
  }
  const n = whyKey(got, clicked);
  const qLabel = meta.query_labels[meta.queries.indexOf(state.query)];
  const kLabel = meta.key_labels[meta.keys.indexOf(got.keys[n])];
  caption.textContent = whyCaption(got, n, qLabel, kLabel) + (view.whyNote ? " " + view.whyNote : "");
  view.whyShown = { row: got, n };
  const axis = (/** @type {string} */ text, /** @type {number[]} */ domain, /** @type {string} */ anchor) =>
    ({ title: { text, font: { size: 12 } }, domain, anchor, zeroline: true, automargin: true });
  const width = Math.min(1000, view.drawnWidth);
  // Side by side where both sides' labels and titles fit; one above the other on a narrow output (368, 620 px).
  const stacked = width < WHY_SIDE_BY_SIDE_PX;
  const chart = 60 + 22 * (got.top + 1);
  const keyTitle = stacked ? "key side (sum " : "key side: A of the key's components (sum ";
  const queryTitle = stacked ? "query side (sum " : "query side: A of the query's components (sum ";
  const [left, right] = stacked ? [[0, 1], [0, 1]] : [[0, 0.44], [0.56, 1]];
  const [upper, lower] = stacked ? [[0.56, 1], [0, 0.44]] : [[0, 1], [0, 1]];
  const layout = {
    showlegend: false,
    width,
    height: stacked ? 50 + 2 * chart + 40 : 50 + chart,
    margin: { t: 30, l: 10, r: 10 },
    xaxis: axis(keyTitle + fmt(got.key_side[n].total) + ")", left, "y"),
    xaxis2: axis(queryTitle + fmt(got.query_side[n].total) + ")", right, "y2"),
    yaxis: { autorange: "reversed", type: "category", automargin: true, anchor: "x", domain: upper },
    yaxis2: { autorange: "reversed", type: "category", automargin: true, anchor: "x2", domain: lower },
  };
  return plot(figure, whyTraces(got, n), layout, (event) => whyClicked(view, meta, event));
}

/**
 * A click on a bar: a head's bar opens that head's view (where the inspector shows its layer).
 * @param {View} view
 * @param {Meta} meta
 * @param {any} event
 */
function whyClicked(view, meta, event) {
  const head = headOf(String(event.points[0].y));
  if (!head) return;
  const [layer, h] = head;
  if (!meta.layers.includes(layer)) {
    view.whyNote = "L" + layer + "H" + h + " cannot be opened: layer " + layer + " is not among the inspected layers " +
      meta.layers.join(", ") + ".";
    if (view.redraw) view.redraw();
    return;
  }
  view.whyNote = "";
  view.host.set({ layer, head: h });
}

