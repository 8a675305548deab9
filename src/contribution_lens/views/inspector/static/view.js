// @ts-check
// One inspector in a root element: its controls and figures, drawn from what its host holds.
//
// host: the static page (page.js) or the widget's model (inspector.js), as types.js's Host says:
// it answers meta(), layer(L) (the payload, or null while it is not here), state() and set(partial),
// and, where it has them, windows(), error(), pending(state), steps() and open(step, layer, head).
// state: the settings of meta.settings (state.py's SETTINGS): layer, head ("all" or a number), factor, scope,
// query, view ("heatmap", "text" or "prediction") and, where the host has them, the window and the toggles.

import { decodeSteps } from "./codecs.js";
import { buildParts, showControls } from "./controls.js";
import { decode, outsideShares, shownFactors, viewLevel } from "./factors.js";
import { cellPx, drawBars, drawHeatmap, drawText } from "./figures.js";
import { drawPrediction } from "./prediction.js";
import { drawWhy } from "./why.js";

/** @typedef {import("./types.js").Host} Host */
/** @typedef {import("./types.js").Meta} Meta */
/** @typedef {import("./types.js").State} State */
/** @typedef {import("./types.js").View} View */
/** @typedef {import("./types.js").Entry} Entry */
/** @typedef {import("./types.js").Payload} Payload */
/** @typedef {import("./types.js").Steps} Steps */
/** @typedef {import("./types.js").Factors} Factors */

/** The decoded layers a view keeps: switching back to one of the last few decodes nothing. */
const KEPT_LAYERS = 4;

/**
 * The decoded layer of `payload` in this window, decoded once while it is among the last few.
 * @param {View} view
 * @param {Meta} meta
 * @param {Payload} payload
 * @returns {Entry}
 */
function decoded(view, meta, payload) {
  const key = meta.key + "/" + payload.key;
  let entry = view.cache.get(key);
  if (!entry) {
    if (view.cache.size >= KEPT_LAYERS) view.cache.delete(/** @type {string} */ (view.cache.keys().next().value));
    entry = { d: decode(meta, payload), views: new Map() };
    view.cache.set(key, entry);
  }
  return entry;
}

/**
 * What distinguishes one view's numbers from another's within a layer: its level and the sink.
 * @param {Meta} meta
 * @param {State} state
 * @returns {string}
 */
function viewKey(meta, state) {
  const { kind, index } = viewLevel(meta, state);
  return kind + index + (state.hide_sink ? "/no-sink" : "");
}

/**
 * The factors the view draws in one scope (`shownFactors`), computed once per layer and view.
 * @param {Meta} meta
 * @param {Entry} entry
 * @param {State} state
 * @param {string} scope
 * @returns {Factors}
 */
function factors(meta, entry, state, scope) {
  const key = viewKey(meta, state) + "/" + scope;
  if (!entry.views.has(key)) entry.views.set(key, shownFactors(meta, entry.d, state, scope));
  return entry.views.get(key);
}

/**
 * Each query's share on keys outside the window in both scopes (`outsideShares`), once per layer and view.
 * @param {Meta} meta
 * @param {Entry} entry
 * @param {State} state
 * @returns {{intra: import("./types.js").Outside, inter: import("./types.js").Outside}}
 */
function outside(meta, entry, state) {
  const key = viewKey(meta, state) + "/outside";
  if (!entry.views.has(key)) {
    entry.views.set(key, { intra: outsideShares(meta, entry.d, state, "intra"), inter: outsideShares(meta, entry.d, state, "inter") });
  }
  return entry.views.get(key);
}

/**
 * The width the figures may take: the output's (JupyterLab's output area, the page's body).
 * @param {HTMLElement} root
 * @returns {number}
 */
function available(root) {
  const width = root.getBoundingClientRect().width || (root.parentNode && /** @type {HTMLElement} */ (root.parentNode).clientWidth) || 900;
  return Math.max(300, Math.floor(width) - 8); // an output 368 px wide (a phone) scrolls no figure sideways
}

/** The narrowest output with the bars beside the heatmap (narrower, the heatmap keeps the width). */
const BESIDE_FROM = 1200;
/** The bars' width beside the heatmap: their longest caption line (all heads, 11 px) fits. */
const BARS_BESIDE = 600;
/** The gap between the heatmap and the bars beside it (inspector.css, .cl-figures). */
const FIGURE_GAP = 16;

/**
 * The widths of the heatmap and the bars in an output `width` px wide: the bars beside the heatmap from
 * BESIDE_FROM px where the heatmap, narrowed for them, still labels every key (cells of 7 px or more),
 * else under it (a long window keeps the whole width for its cells).
 * @param {View} view
 * @param {Meta} meta
 * @param {number} width
 * @param {boolean} heatmap whether the heatmap is drawn (the text view: the bars under the text)
 */
function layOut(view, meta, width, heatmap) {
  const narrowed = width - BARS_BESIDE - FIGURE_GAP;
  const beside = heatmap && width >= BESIDE_FROM && cellPx(meta, narrowed) >= 7;
  view.drawnWidth = width;
  view.heatmapWidth = beside ? narrowed : width;
  view.barsWidth = beside ? BARS_BESIDE : Math.min(1000, width);
}

/**
 * The host's explained steps, decoded once per steps payload (null without steps).
 * @param {View} view
 * @returns {Steps | null}
 */
function currentSteps(view) {
  const steps = view.host.steps ? view.host.steps() : null;
  if (!steps || !steps.steps || !steps.steps.length) return null;
  if (!view.decodedSteps || view.decodedSteps[0] !== steps) view.decodedSteps = [steps, decodeSteps(steps)];
  return { about: steps, steps: view.decodedSteps[1] };
}

/**
 * The state to draw: the host's, with a query the window holds and a head that exists.
 * @param {Meta} meta
 * @param {State} hosted
 * @returns {State}
 */
function drawable(meta, hosted) {
  const state = Object.assign({}, hosted);
  // A query outside this window (the kernel has not moved it yet) is drawn as the window's last query.
  if (!meta.queries.includes(state.query)) state.query = meta.queries[meta.queries.length - 1];
  if (!(state.head === "all" || (state.head >= 0 && state.head < meta.n_heads))) state.head = "all";
  return state;
}

/**
 * The per-layer views (heatmap or text, and the bars) of the state's layer, or what the host waits for.
 * @param {View} view
 * @param {Meta} meta
 * @param {State} state
 * @param {string} shown "heatmap" or "text"
 * @returns {Promise<unknown>}
 */
function drawLayer(view, meta, state, shown) {
  const { parts, host } = view;
  parts.bars.style.display = "";
  const payload = meta.layers.includes(state.layer) ? host.layer(state.layer) : null;
  if (!payload) {
    parts.status.textContent = host.pending ? host.pending(state) : "computing layer " + state.layer + "…";
    return Promise.resolve();
  }
  parts.status.textContent = "";
  const entry = decoded(view, meta, payload);
  const both = { intra: factors(meta, entry, state, "intra"), inter: factors(meta, entry, state, "inter") };
  view.current = { queries: meta.queries, qLabels: meta.query_labels, keys: meta.keys, kLabels: meta.key_labels };
  parts.flow.style.display = shown === "text" ? "" : "none";
  parts.heatmap.style.display = shown === "text" ? "none" : "";
  layOut(view, meta, available(view.root), shown !== "text");
  const extra = { textKey: "text/" + viewKey(meta, state), outside: outside(meta, entry, state) };
  const drawn = shown === "text" ? drawText(view, meta, entry, both, state) : drawHeatmap(view, meta, entry, both, state, extra);
  const bars = drawBars(view, meta, entry, both[/** @type {"intra" | "inter"} */ (state.scope)], state);
  return Promise.all([drawn, bars, drawWhy(view, meta, state)]).then(() => {
    // A click's effect: the bars of the clicked query come into view, its row of the heatmap kept in view too.
    if (view.reveal) reveal(view, shown === "text" ? -1 : meta.queries.indexOf(state.query));
    view.reveal = false;
  });
}

/**
 * The nearest ancestor of `node` that scrolls (JupyterLab's notebook), or null (the page itself scrolls).
 * @param {HTMLElement} node
 * @returns {HTMLElement | null}
 */
export function scroller(node) {
  for (let p = node.parentElement; p; p = p.parentElement) {
    const overflow = getComputedStyle(p).overflowY;
    if ((overflow === "auto" || overflow === "scroll") && p.scrollHeight > p.clientHeight) return p;
  }
  return null;
}

/** The bars a click brings into view under the heatmap, px: their caption and first keys. */
const BARS_SHOWN_PX = 160;
/** The space kept above the clicked row, px. */
const ROW_MARGIN_PX = 40;

/**
 * A click's scroll: the bars under the heatmap (their caption and first keys) come into view while the
 * clicked row stays in view, by the least scroll that shows both; where they are too far apart for one
 * view (or beside each other, or with no row: the text view), the bars as before.
 * @param {View} view
 * @param {number} row the clicked query's row of the heatmap (-1: none)
 */
function reveal(view, row) {
  const { heatmap, bars } = view.parts;
  const gd = /** @type {any} */ (heatmap);
  const under = bars.getBoundingClientRect().top >= heatmap.getBoundingClientRect().bottom - 1;
  const layout = gd._fullLayout;
  if (row < 0 || !under || !layout || !layout.yaxis) {
    bars.scrollIntoView({ block: "nearest" });
    return;
  }
  const box = heatmap.getBoundingClientRect();
  const rowY = box.top + layout._size.t + layout.yaxis.l2p(row);
  const barsBox = bars.getBoundingClientRect();
  const want = barsBox.top + Math.min(BARS_SHOWN_PX, barsBox.height);
  const outer = scroller(view.root);
  const frame = outer ? outer.getBoundingClientRect() : { top: 0, bottom: globalThis.innerHeight };
  // A scroll by `delta` keeps the row in view while rowY - delta >= top + margin, and shows the bars while want - delta <= bottom.
  const least = want - frame.bottom;
  const most = rowY - frame.top - ROW_MARGIN_PX;
  if (least > most) {
    bars.scrollIntoView({ block: "nearest" });
    return;
  }
  const delta = Math.min(Math.max(0, least), most);
  if (!delta) return;
  if (outer) outer.scrollTop += delta;
  else globalThis.scrollBy(0, delta);
}

/**
 * Everything drawn again from what the host holds now.
 * @param {View} view
 * @returns {Promise<unknown>}
 */
function refresh(view) {
  const { parts, host } = view;
  const meta = host.meta();
  const message = host.error ? host.error() : "";
  parts.problem.textContent = message || "";
  parts.problem.style.display = message ? "" : "none";
  if (!meta || !meta.queries) {
    parts.status.textContent = host.pending ? host.pending(null) : "";
    return Promise.resolve();
  }
  const state = drawable(meta, host.state());
  const steps = currentSteps(view);
  const shown = state.view === "text" ? "text" : state.view === "prediction" && steps ? "prediction" : "heatmap";
  showControls(parts, host, meta, state, shown, steps);
  parts.prediction.style.display = shown === "prediction" ? "" : "none";
  if (shown !== "prediction") return drawLayer(view, meta, state, shown);
  parts.flow.style.display = parts.heatmap.style.display = parts.bars.style.display = parts.why.style.display = "none";
  parts.status.textContent = "";
  // The click handlers of the hidden views read `current`; the resize observer needs it set to redraw.
  view.current = { queries: meta.queries, qLabels: meta.query_labels };
  view.drawnWidth = available(view.root);
  return drawPrediction(view, meta, /** @type {Steps} */ (steps), state);
}

/**
 * A new output width (a resized window or panel) draws the figures again to fit it.
 * @param {View} view
 * @param {() => unknown} redraw
 */
function redrawOnResize(view, redraw) {
  if (!globalThis.ResizeObserver) return;
  let queued = false;
  new ResizeObserver(() => {
    if (queued || !view.current || Math.abs(available(view.root) - view.drawnWidth) < 24) return;
    queued = true;
    requestAnimationFrame(() => {
      queued = false;
      redraw();
    });
  }).observe(view.root);
}

/**
 * An inspector in `root`, drawn from `host`: call `refresh()` whenever what the host holds changes.
 * @param {HTMLElement} root
 * @param {Host} host
 * @returns {{refresh: () => Promise<unknown>}}
 */
export function mount(root, host) {
  /** @type {View} */
  const view = { root, parts: buildParts(root, host), host, cache: new Map(), decodedSteps: null, current: null, drawnWidth: 0 };
  view.parts.flow.addEventListener("click", (event) => {
    const target = /** @type {HTMLElement} */ (event.target);
    const position = Number(target.dataset && target.dataset.position);
    if (view.current && view.current.queries.includes(position)) host.set({ query: position });
  });
  const redraw = () => refresh(view);
  view.redraw = redraw;
  redrawOnResize(view, redraw);
  return { refresh: redraw };
}
