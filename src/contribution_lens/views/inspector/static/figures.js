// @ts-check
// The per-layer views: the query x key heatmap, the text coloured by one query's row, and that
// row's factors as bars. Each draws what `shownFactors` computed; a click makes a query the host's.

import { LABELS, fmt, hoverCell, hoverText, title, where } from "./captions.js";
import { colourAt, gradient, paint } from "./colours.js";
import { element } from "./controls.js";
import { shownToken, tokenText } from "./windows.js";

/** @typedef {import("./types.js").Meta} Meta */
/** @typedef {import("./types.js").State} State */
/** @typedef {import("./types.js").View} View */
/** @typedef {import("./types.js").Entry} Entry */
/** @typedef {import("./types.js").Factors} Factors */
/** @typedef {import("./types.js").BothScopes} BothScopes */

/**
 * A clickable figure: drawn with its click handler the first time, redrawn in place after (the
 * handler stays: it reads what is drawn now, not what was drawn when it was attached).
 * @param {HTMLElement} node
 * @param {object[]} traces
 * @param {object} layout
 * @param {(event: any) => void} onClick
 * @returns {Promise<unknown>}
 */
export function plot(node, traces, layout, onClick) {
  const Plotly = /** @type {any} */ (globalThis).Plotly;
  const gd = /** @type {any} */ (node);
  const config = { displaylogo: false, responsive: false };
  if (gd.data) return Plotly.react(node, traces, layout, config);
  const drawn = Plotly.newPlot(node, traces, layout, config);
  gd.on("plotly_click", onClick);
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

/**
 * The heatmap's size and axes for `width` px: the query labels and the colour bar take about 240
 * px, the cells share the rest. Where a label fits its cell (7 px and more) every token is
 * labelled; below, plotly labels a readable subset and a dragged box zooms in until each cell is
 * labelled (double-click goes back).
 * @param {Meta} meta
 * @param {number} width
 */
function heatmapAxes(meta, width) {
  const nq = meta.queries.length;
  const nk = meta.keys.length;
  const cell = Math.max(1, Math.min(18, Math.floor((width - 240) / nk)));
  const every = cell >= 7;
  const font = every ? Math.min(12, Math.max(7, cell - 3)) : 10;
  const axis = (/** @type {string} */ name, /** @type {string[]} */ names, /** @type {number} */ length) =>
    Object.assign(
      { title: { text: name }, type: "category", tickfont: { size: font }, automargin: true },
      every
        ? { tickmode: "array", tickvals: names, ticktext: names }
        : { tickmode: "auto", nticks: Math.max(4, Math.floor((cell * length) / 24)) },
    );
  return {
    hint: every ? "" : " · drag a box to zoom, double-click to reset",
    xaxis: Object.assign(axis("key", meta.key_labels, nk), { tickangle: -60 }),
    yaxis: Object.assign(axis("query", meta.query_labels, nq), { autorange: "reversed" }),
    height: Math.max(420, cell * nq + 200),
  };
}

/**
 * The query x key heatmap of the state's factor and scope; hovering a cell shows all four numbers
 * in both scopes, a click makes its row the query.
 * @param {View} view
 * @param {Meta} meta
 * @param {Entry} entry
 * @param {BothScopes} both
 * @param {State} state
 * @param {string} textKey the hover text's cache key (it depends on the head only)
 */
export function drawHeatmap(view, meta, entry, both, state, textKey) {
  const qLabels = meta.query_labels;
  const kLabels = meta.key_labels;
  // The hover text depends on the head only: built once per (layer, head), reused by every factor and scope.
  if (!entry.views.has(textKey)) entry.views.set(textKey, hoverText(entry.d.index, both, qLabels, kLabels));
  const signed = meta.signed.includes(state.factor);
  // The figure fits the output's width whatever the length, colour bar included.
  const { hint, xaxis, yaxis, height } = heatmapAxes(meta, view.drawnWidth);
  const trace = {
    type: "heatmap",
    x: kLabels,
    y: qLabels,
    z: grid(meta, entry.d.index, both[/** @type {"intra" | "inter"} */ (state.scope)][/** @type {keyof Factors} */ (state.factor)]),
    text: entry.views.get(textKey),
    hovertemplate: "%{text}<extra></extra>",
    colorscale: signed ? meta.colorscales.diverging : meta.colorscales.sequential,
    zmid: signed ? 0 : undefined,
    colorbar: { title: { text: LABELS[state.factor] }, thickness: 14 },
    hoverongaps: false,
  };
  const layout = {
    title: { text: title(meta, state) + hint, x: 0.02, xanchor: "left" },
    xaxis,
    yaxis,
    width: view.drawnWidth,
    height,
    margin: { t: 50, r: 20 },
  };
  return plot(view.parts.heatmap, [trace], layout, (event) => {
    const current = /** @type {NonNullable<View["current"]>} */ (view.current);
    const point = event.points[0];
    let row = current.qLabels.indexOf(point.y);
    if (row < 0 && Array.isArray(point.pointNumber)) row = point.pointNumber[0];
    if (row >= 0 && row < current.queries.length) view.host.set({ query: current.queries[row] });
  });
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

/**
 * The selected query's keys and their four factors, side by side as horizontal bars.
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
  const rows = meta.factors.map(() => []);
  for (let ki = 0; ki < nk; ki++) {
    const c = qi < 0 ? -1 : entry.d.index[qi * nk + ki];
    if (c < 0 || Number.isNaN(values.attention[c])) continue;
    keys.push(meta.key_labels[ki]);
    meta.factors.forEach((f, i) => rows[i].push(values[/** @type {keyof Factors} */ (f)][c]));
  }
  const traces = meta.factors.map((f, i) => ({
    type: "bar",
    orientation: "h",
    name: LABELS[f],
    y: keys,
    x: rows[i],
    xaxis: i ? "x" + (i + 1) : "x",
    yaxis: "y",
    hovertemplate: "%{y}: %{x:.4g}<extra>" + LABELS[f] + "</extra>",
  }));
  /** @type {Record<string, any>} */
  const layout = {
    title: {
      text: "query " + meta.query_labels[qi] + ": per-key factors (" + state.scope + ", " + where(meta, state) +
        "), their product is the contribution",
      x: 0.02,
      xanchor: "left",
    },
    showlegend: false,
    yaxis: { autorange: "reversed", type: "category", tickfont: { size: keys.length > 129 ? 7 : 10 }, automargin: true },
    height: Math.max(300, (keys.length > 129 ? 8 : 13) * keys.length + 140),
    width: Math.min(1000, view.drawnWidth),
    margin: { t: 60 },
  };
  const n = meta.factors.length;
  meta.factors.forEach((f, i) => {
    layout[i ? "xaxis" + (i + 1) : "xaxis"] = { title: { text: LABELS[f] }, domain: [i / n + 0.02, (i + 1) / n - 0.02], anchor: "y", zeroline: true };
  });
  return /** @type {any} */ (globalThis).Plotly.react(view.parts.bars, traces, layout, { displaylogo: false });
}
