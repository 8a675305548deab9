// @ts-check
// The per-layer views: the query x key heatmap, the text coloured by one query's row, and that
// row's factors as bars. Each draws what `shownFactors` computed; a click makes a query the host's.

import { LABELS, barsTitle, fmt, heatmapTitle, hoverCell, hoverOutside, hoverText, title, wrapTitle } from "./captions.js";
import { colourAt, gradient, paint } from "./colours.js";
import { element } from "./controls.js";
import { shownToken, tokenText } from "./windows.js";

/** @typedef {import("./types.js").Meta} Meta */
/** @typedef {import("./types.js").State} State */
/** @typedef {import("./types.js").View} View */
/** @typedef {import("./types.js").Entry} Entry */
/** @typedef {import("./types.js").Factors} Factors */
/** @typedef {import("./types.js").BothScopes} BothScopes */

/** Plotly's settings for every inspector figure: no logo, and no "Share chart" (Chart Studio needs the network). */
export const CONFIG = { displaylogo: false, responsive: false, showSendToCloud: false };

/**
 * A clickable figure: drawn with its click handler the first time, redrawn in place after (the
 * handler stays: it reads what is drawn now, not what was drawn when it was attached).
 * @param {HTMLElement} node
 * @param {object[]} traces
 * @param {object} layout
 * @param {(event: any) => void} [onClick] a figure without one draws and takes no clicks
 * @returns {Promise<unknown>}
 */
export function plot(node, traces, layout, onClick) {
  const Plotly = /** @type {any} */ (globalThis).Plotly;
  const gd = /** @type {any} */ (node);
  const config = CONFIG;
  if (gd.data) return Plotly.react(node, traces, layout, config);
  const drawn = Plotly.newPlot(node, traces, layout, config);
  if (onClick) gd.on("plotly_click", onClick);
  return drawn;
}

/**
 * The shown factor's values [query][key], null where nothing is drawn (future keys, the hidden sink).
 * @param {Meta} meta
 * @param {Int32Array} index
 * @param {ArrayLike<number>} shown
 * @returns {Array<Array<number | null>>}
 */
function grid(meta, index, shown) {
  const nq = meta.queries.length;
  const nk = meta.keys.length;
  const z = [];
  for (let qi = 0; qi < nq; qi++) {
    /** @type {Array<number | null>} */
    const zRow = new Array(nk).fill(null);
    for (let ki = 0; ki < nk; ki++) {
      const c = index[qi * nk + ki];
      if (c >= 0 && !Number.isNaN(shown[c])) zRow[ki] = shown[c];
    }
    z.push(zRow);
  }
  return z;
}

/** The smallest row a click can hit, px: a long window's heatmap grows taller (the page scrolls) rather than thinner. */
const ROW_PX = 4;
/** The share of the window's height a heatmap's rows may take, where rows of ROW_PX allow: a click's row and the bars under it then fit in view together. */
const ROWS_IN_VIEW = 0.75;
/** The figures' title size, px (what `wrapTitle` measures). */
export const TITLE_PX = 16;

/**
 * A figure's title wrapped to its width (`wrapTitle`), drawn from the top down, and the top margin it needs.
 * @param {string} text
 * @param {number} width the figure's width, px
 * @param {number} least the top margin without a title, px
 * @returns {{title: object, top: number}}
 */
export function titled(text, width, least) {
  const wrapped = wrapTitle(text, Math.max(120, width - 40), TITLE_PX);
  // plotly sets a title of several lines 14 px higher than one line from the same anchor: it was cut at the top.
  const pad = wrapped.text.includes("<br>") ? 8 + 14 : 8;
  return {
    title: { text: wrapped.text, x: 0.02, xanchor: "left", y: 1, yref: "container", yanchor: "top", pad: { t: pad }, font: { size: TITLE_PX } },
    top: Math.max(least, wrapped.height + 40),
  };
}
/** Windows with more cells than this build each hover text when the pointer is on the cell, not all beforehand. */
export const LAZY_HOVER_CELLS = 40000;

/**
 * One axis of the heatmap: every token labelled where a label fits its `cell` px (7 and more),
 * else a readable subset that a dragged box zooms in on.
 * @param {string} name
 * @param {string[]} names
 * @param {number} cell
 */
function axis(name, names, cell) {
  const every = cell >= 7;
  return Object.assign(
    { title: { text: name }, type: "category", tickfont: { size: every ? Math.min(12, Math.max(7, cell - 3)) : 10 }, automargin: true },
    every
      ? { tickmode: "array", tickvals: names, ticktext: names }
      : { tickmode: "auto", nticks: Math.max(4, Math.floor((cell * names.length) / 20)) },
  );
}

/**
 * The width of a key's cell in a heatmap `width` px wide (1 to 18 px): what the query labels, the
 * colour bar (about 240 px) and the outside column (36 px, where keys are outside the window) leave.
 * @param {Meta} meta
 * @param {number} width
 * @returns {number}
 */
export function cellPx(meta, width) {
  const column = meta.outside && meta.outside.length ? 36 : 0;
  return Math.max(1, Math.min(18, Math.floor((width - 240 - column) / meta.keys.length)));
}

/**
 * The heatmap's size and axes for `width` px: the query labels and the colour bar take about 240
 * px, the outside column (where keys are outside the window) 36 more, the cells share the rest.
 * Rows are at least ROW_PX tall, so a click hits the row it is on; a dragged box zooms in until
 * each cell is labelled (double-click goes back).
 * @param {Meta} meta
 * @param {number} width
 */
function heatmapAxes(meta, width) {
  const nq = meta.queries.length;
  const nk = meta.keys.length;
  const column = meta.outside && meta.outside.length ? 36 : 0;
  const cell = cellPx(meta, width);
  // Labels in a subset: as many as the axis's pixels hold (one per 20 px), whatever the rounding of `cell`.
  const keyPx = Math.max(cell, (width - 240 - column) / nk);
  // Rows as tall as cells are wide, but no taller than lets the rows fit ROWS_IN_VIEW of the window (down to ROW_PX).
  const fit = Math.floor((ROWS_IN_VIEW * (globalThis.innerHeight || 1000) - 200) / nq);
  const row = Math.max(ROW_PX, Math.min(cell, fit));
  const share = column / Math.max(1, width - 240);
  return {
    hint: cell >= 7 && row >= 7 ? "" : "drag a box to zoom, double-click to reset",
    xaxis: Object.assign(axis("key", meta.key_labels, cell >= 7 ? cell : keyPx), { tickangle: -60, domain: [0, 1 - share] }),
    xaxis2: { domain: [1 - share + 8 / Math.max(1, width - 240), 1], type: "category", tickangle: -60, automargin: true, fixedrange: true },
    yaxis: Object.assign(axis("query", meta.query_labels, row), { autorange: "reversed" }),
    height: Math.max(420, row * nq + 200),
  };
}

/**
 * The keys outside the window as one label: "outside 1–671" (runs of meta.outside).
 * @param {Pick<Meta, "outside">} meta
 * @returns {string}
 */
export function outsideLabel(meta) {
  return "outside " + meta.outside.map(([a, b]) => (a === b ? String(a) : a + "–" + b)).join(", ");
}

/**
 * The outside column: per query, the share of the row on keys outside the window, on the heatmap's
 * colour scale where the factor is a share (attention, contribution), else attention's in grey.
 * @param {Meta} meta
 * @param {{intra: import("./types.js").Outside, inter: import("./types.js").Outside}} outside
 * @param {State} state
 */
function outsideTrace(meta, outside, state) {
  const shares = state.factor === "contribution" || state.factor === "attention";
  const drawn = state.factor === "contribution" ? outside[/** @type {"intra" | "inter"} */ (state.scope)].contribution : outside.inter.attention;
  const label = outsideLabel(meta);
  const z = meta.query_labels.map((_, qi) => [Number.isNaN(drawn[qi]) ? null : drawn[qi]]);
  const text = meta.query_labels.map((q, qi) => [hoverOutside(outside, qi, q, label)]);
  return Object.assign(
    { type: "heatmap", name: "outside", x: [label], y: meta.query_labels, z, text, xaxis: "x2", yaxis: "y",
      hovertemplate: "%{text}<extra></extra>", hoverongaps: false },
    shares ? { coloraxis: "coloraxis" } : { colorscale: [[0, "#f4f4f4"], [1, "#555"]], zmin: 0, zmax: 1, showscale: false },
  );
}

/**
 * The marks of what was clicked: the query's row outlined across the window, the clicked key's cell
 * inside it (while that query is the selected one).
 * @param {View} view
 * @param {Meta} meta
 * @param {State} state
 */
function marks(view, meta, state) {
  const row = meta.queries.indexOf(state.query);
  const nk = meta.keys.length;
  const shapes = [{ type: "rect", name: "query", xref: "x", yref: "y", x0: -0.5, x1: nk - 0.5, y0: row - 0.5, y1: row + 0.5,
                    line: { color: "black", width: 2 }, fillcolor: "rgba(0,0,0,0)" }];
  const key = view.selected && view.selected.query === state.query ? meta.keys.indexOf(view.selected.key) : -1;
  if (key >= 0) {
    shapes.push({ type: "rect", name: "key", xref: "x", yref: "y", x0: key - 0.5, x1: key + 0.5, y0: row - 0.5, y1: row + 0.5,
                  line: { color: "#d62728", width: 2 }, fillcolor: "rgba(0,0,0,0)" });
  }
  return shapes;
}

/**
 * The query x key heatmap of the state's factor and scope, with the outside column where the window
 * leaves keys out; hovering a cell shows all four numbers in both scopes, a click makes its row the
 * query and marks the cell.
 * @param {View} view
 * @param {Meta} meta
 * @param {Entry} entry
 * @param {BothScopes} both
 * @param {State} state
 * @param {{textKey: string, outside: {intra: import("./types.js").Outside, inter: import("./types.js").Outside}}} extra
 *   the hover text's cache key (it depends on the head only), and the outside shares in both scopes
 */
export function drawHeatmap(view, meta, entry, both, state, extra) {
  const qLabels = meta.query_labels;
  const kLabels = meta.key_labels;
  const lazy = entry.d.cells > LAZY_HOVER_CELLS;
  // Small windows: the hover text is built once per (layer, head) and reused by every factor and scope.
  if (!lazy && !entry.views.has(extra.textKey)) entry.views.set(extra.textKey, hoverText(entry.d.index, both, qLabels, kLabels));
  view.hoverAt = (qi, ki) => {
    const c = entry.d.index[qi * kLabels.length + ki];
    return c >= 0 ? hoverCell(c, both, qLabels[qi], kLabels[ki]) : "";
  };
  const signed = meta.signed.includes(state.factor);
  // The figure fits the output's width whatever the length, colour bar included.
  const { hint, xaxis, xaxis2, yaxis, height } = heatmapAxes(meta, view.heatmapWidth || view.drawnWidth);
  const trace = Object.assign(
    { type: "heatmap", x: kLabels, y: qLabels, coloraxis: "coloraxis", hoverongaps: false,
      z: grid(meta, entry.d.index, both[/** @type {"intra" | "inter"} */ (state.scope)][/** @type {keyof Factors} */ (state.factor)]) },
    lazy ? { hoverinfo: "none" } : { text: entry.views.get(extra.textKey), hovertemplate: "%{text}<extra></extra>" },
  );
  const traces = meta.outside && meta.outside.length ? [trace, outsideTrace(meta, extra.outside, state)] : [trace];
  const width = view.heatmapWidth || view.drawnWidth;
  const head = titled(heatmapTitle(meta, state) + (hint ? "<br><span style='font-size: 11px'>" + hint + "</span>" : ""), width, 70);
  const layout = {
    title: head.title,
    xaxis, xaxis2, yaxis, width, height: height + head.top - 70, margin: { t: head.top, r: 20 },
    coloraxis: { colorscale: signed ? meta.colorscales.diverging : meta.colorscales.sequential, cmid: signed ? 0 : undefined,
                 colorbar: { title: { text: LABELS[state.factor] }, thickness: 14 } },
    shapes: marks(view, meta, state),
    // A zoom stays through a click's redraw (the same window and layer): at 800 keys of 0.9 px, zoomed in,
    // a click reaches every key, and the next click there needs no zoom again.
    uirevision: meta.key + "/" + state.layer,
  };
  const drawn = plot(view.parts.heatmap, traces, layout, (event) => clicked(view, event));
  return drawn.then(() => lazyHover(view));
}

/**
 * A click on the heatmap: its row becomes the query, its key is marked, and the bars come into view.
 * @param {View} view
 * @param {any} event
 */
function clicked(view, event) {
  const current = /** @type {NonNullable<View["current"]>} */ (view.current);
  const point = event.points[0];
  let row = current.qLabels.indexOf(point.y);
  if (row < 0 && Array.isArray(point.pointNumber)) row = point.pointNumber[0];
  if (row < 0 || row >= current.queries.length) return;
  const keys = current.keys || [];
  const column = point.curveNumber === 0 && current.kLabels ? current.kLabels.indexOf(point.x) : -1;
  view.selected = { query: current.queries[row], key: column >= 0 ? keys[column] : -1 };
  view.reveal = true;
  view.panelMemo = {}; // a panel's notes last until the next click
  // Another key of the query shown: no setting changes (the widget's model sends no change), so redraw here.
  const same = view.host.state().query === current.queries[row];
  view.host.set({ query: current.queries[row] });
  if (same && view.redraw) view.redraw();
}

/**
 * The hover box of a window too large to hold every cell's text: built for the cell under the pointer.
 * @param {View} view
 */
function lazyHover(view) {
  const gd = /** @type {any} */ (view.parts.heatmap);
  if (gd.dataset.lazyHover) return;
  gd.dataset.lazyHover = "true";
  const box = element("div", { className: "cl-hover" }, view.root);
  box.style.display = "none";
  gd.on("plotly_hover", (/** @type {any} */ event) => {
    const point = event.points[0];
    const text = point.curveNumber === 0 && point.data.hoverinfo === "none" && view.hoverAt
      ? view.hoverAt(point.pointNumber[0], point.pointNumber[1]) : "";
    box.style.display = text ? "" : "none";
    if (!text) return;
    box.textContent = text.replaceAll("<br>", "\n"); // text, not HTML: token labels are the user's text
    box.style.left = event.event.clientX + 14 + "px";
    box.style.top = event.event.clientY + 14 + "px";
  });
  gd.on("plotly_unhover", () => (box.style.display = "none"));
}

/**
 * The caption of a coloured text: what is shown, the colour legend from `low` to `top`, and `after`.
 * @param {HTMLElement} parent
 * @param {string} before
 * @param {import("./types.js").Colorscale} scale
 * @param {number} top
 * @param {number} low
 * @param {string} after
 */
export function legendCaption(parent, before, scale, low, top, after) {
  const caption = element("div", { className: "cl-text-caption" }, parent);
  caption.appendChild(document.createTextNode(before + fmt(low) + " "));
  element("span", { className: "cl-legend", style: "background: " + gradient(scale) }, caption);
  caption.appendChild(document.createTextNode(" " + fmt(top) + after));
}

/**
 * The text as text: each token coloured by the factor's weight for the selected query (the
 * query's own row of the heatmap), its four numbers on hover, a click makes it the query.
 * @param {View} view
 * @param {Meta} meta
 * @param {Entry} entry
 * @param {BothScopes} both
 * @param {State} state
 */
export function drawText(view, meta, entry, both, state) {
  const flow = view.parts.flow;
  const nk = meta.keys.length;
  const qi = meta.queries.indexOf(state.query);
  const shown = both[/** @type {"intra" | "inter"} */ (state.scope)][/** @type {keyof Factors} */ (state.factor)];
  const signed = meta.signed.includes(state.factor);
  const scale = signed ? meta.colorscales.diverging : meta.colorscales.sequential;
  let top = 0;
  for (let ki = 0; ki < nk; ki++) {
    const c = entry.d.index[qi * nk + ki];
    if (c >= 0 && !Number.isNaN(shown[c])) top = Math.max(top, signed ? Math.abs(shown[c]) : shown[c]);
  }
  const low = signed ? -top : 0;
  flow.innerHTML = "";
  const before = title(meta, state) + ", query " + meta.query_labels[qi] + ": colour ";
  legendCaption(flow, before, scale, low, top, " · hover a token for its numbers, click it to make it the query");
  const text = element("div", { className: "cl-flow" }, flow);
  for (let ki = 0; ki < nk; ki++) {
    if (ki > 0 && meta.keys[ki] !== meta.keys[ki - 1] + 1) element("span", { className: "cl-gap", textContent: " … " }, text);
    const raw = tokenText(meta.key_labels[ki]);
    const span = element("span", { className: "cl-token", textContent: shownToken(raw) }, text);
    span.dataset.position = String(meta.keys[ki]);
    const c = entry.d.index[qi * nk + ki];
    if (c >= 0 && Number.isNaN(shown[c])) {
      span.classList.add("cl-future");
      span.title = "key " + meta.key_labels[ki] + ": hidden (the sink)";
    } else if (c >= 0) {
      paint(span, colourAt(scale, top > 0 ? (shown[c] - low) / (top - low) : signed ? 0.5 : 0));
      span.dataset.value = String(shown[c]);
      span.title = hoverCell(c, both, meta.query_labels[qi], meta.key_labels[ki]).replaceAll("<br>", "\n");
    } else {
      span.classList.add("cl-future");
      span.title = "key " + meta.key_labels[ki] + ": after the query, no weight in a causal model";
    }
    if (meta.keys[ki] === state.query) span.classList.add("cl-query");
    if (raw.includes("\\n")) text.appendChild(document.createElement("br"));
  }
  return Promise.resolve();
}

/** The narrowest panel of bars side by side, px: narrower, the four panels go two by two. */
const BAR_PANEL_PX = 120;
/** The space between two rows of bar panels, px: the upper row's axis titles and ticks. */
const BAR_ROW_GAP_PX = 80;
/** The space between two panels of bars side by side, px. */
const BAR_GAP_PX = 36;
/** An axis title's character width at 12 px, an upper bound, px. */
const EM_PX = 7.2;

/**
 * The x axis of the bars' panel in column `c` and row `r` of `columns`, each `panelPx` wide.
 * @param {string} label the factor's name
 * @param {number} c
 * @param {number} r
 * @param {number} columns
 * @param {number} panelPx
 */
function barAxis(label, c, r, columns, panelPx) {
  // A title wider than its panel goes on two lines ("relative<br>norm"): titles never overlap.
  const text = EM_PX * label.length > panelPx - 8 ? label.replace(" ", "<br>") : label;
  // BAR_GAP_PX between panels: the last tick label of one and the first of the next never meet.
  const gap = Math.min(0.08, BAR_GAP_PX / 2 / Math.max(1, columns * panelPx));
  return {
    title: { text, font: { size: 12 } }, domain: [c / columns + gap, (c + 1) / columns - gap], anchor: r ? "y" + (r + 1) : "y",
    zeroline: true, nticks: Math.max(3, Math.floor(panelPx / 60)), tickfont: { size: 10 }, automargin: true,
  };
}

/**
 * The selected query's keys and their four factors, side by side as horizontal bars (two by two where narrow).
 * @param {View} view
 * @param {Meta} meta
 * @param {Entry} entry
 * @param {Factors} values the scope's factors
 * @param {State} state
 */
export function drawBars(view, meta, entry, values, state) {
  const nk = meta.keys.length;
  const qi = meta.queries.indexOf(state.query);
  /** @type {string[]} */
  const keys = [];
  /** @type {number[][]} */
  const series = meta.factors.map(() => []);
  for (let ki = 0; ki < nk; ki++) {
    const c = qi < 0 ? -1 : entry.d.index[qi * nk + ki];
    if (c < 0 || Number.isNaN(values.attention[c])) continue;
    keys.push(meta.key_labels[ki]);
    meta.factors.forEach((f, i) => series[i].push(values[/** @type {keyof Factors} */ (f)][c]));
  }
  const width = view.barsWidth || Math.min(1000, view.drawnWidth);
  const n = meta.factors.length;
  // Side by side where each panel has room for its title and ticks, else two by two (an output of 368 px).
  const labelPx = Math.min(160, 10 + 6 * Math.max(0, ...keys.map((k) => k.length)));
  const columns = (width - labelPx - 30) / n < BAR_PANEL_PX ? 2 : n;
  const rows = Math.ceil(n / columns);
  const panelPx = (width - labelPx - 30) / columns;
  const keyRows = (keys.length > 129 ? 8 : 13) * keys.length;
  const head = titled(barsTitle(meta, state, meta.query_labels[qi]), width, 90);
  const bottom = 80;
  const gap = rows > 1 ? BAR_ROW_GAP_PX : 0;
  const height = Math.max(300, head.top + bottom + rows * Math.max(keyRows - 30, 120) + gap * (rows - 1));
  const area = height - head.top - bottom;
  const span = (area - gap * (rows - 1)) / rows;
  const traces = meta.factors.map((f, i) => ({
    type: "bar",
    orientation: "h",
    name: LABELS[f],
    y: keys,
    x: series[i],
    xaxis: i ? "x" + (i + 1) : "x",
    yaxis: Math.floor(i / columns) ? "y" + (Math.floor(i / columns) + 1) : "y",
    hovertemplate: "%{y}: %{x:.4g}<extra>" + LABELS[f] + "</extra>",
  }));
  /** @type {Record<string, any>} */
  const layout = { title: head.title, showlegend: false, height, width, margin: { t: head.top, b: bottom } };
  for (let r = 0; r < rows; r++) {
    const top = r * (span + gap);
    layout[r ? "yaxis" + (r + 1) : "yaxis"] = {
      autorange: "reversed", type: "category", tickfont: { size: keys.length > 129 ? 7 : 10 }, automargin: true,
      domain: [Math.max(0, 1 - (top + span) / area), Math.min(1, 1 - top / area)],
    };
  }
  meta.factors.forEach((f, i) => {
    layout[i ? "xaxis" + (i + 1) : "xaxis"] = barAxis(LABELS[f], i % columns, Math.floor(i / columns), columns, panelPx);
  });
  return /** @type {any} */ (globalThis).Plotly.react(view.parts.bars, traces, layout, CONFIG);
}
