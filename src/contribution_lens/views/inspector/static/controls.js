// @ts-check
// The inspector's elements: its menus and toggles, the messages, and the places figures are drawn.
// Every element is found inside the inspector's own root: several inspectors live on one page.

import { LABELS, headLabel } from "./captions.js";
import { toggleSettings } from "./settings.js";

/** @typedef {import("./types.js").Host} Host */
/** @typedef {import("./types.js").Meta} Meta */
/** @typedef {import("./types.js").State} State */
/** @typedef {import("./types.js").Steps} Steps */
/** @typedef {import("./types.js").Parts} Parts */

/**
 * A new element with `attrs`, appended to `parent` where there is one.
 * @template {keyof HTMLElementTagNameMap} K
 * @param {K} tag
 * @param {Record<string, any>} attrs
 * @param {Element} [parent]
 * @returns {HTMLElementTagNameMap[K]}
 */
export function element(tag, attrs, parent) {
  const node = document.createElement(tag);
  Object.assign(node, attrs);
  if (parent) parent.appendChild(node);
  return node;
}

/**
 * A labelled menu, `data-control` = name, calling onChange with the value chosen.
 * @param {Element} parent
 * @param {string} name
 * @param {(value: string) => void} onChange
 * @returns {HTMLSelectElement}
 */
function select(parent, name, onChange) {
  const label = element("label", { className: "cl-control" }, parent);
  label.appendChild(document.createTextNode(name + " "));
  const node = element("select", { className: "cl-select" }, label);
  node.dataset.control = name;
  node.addEventListener("change", () => onChange(node.value));
  return node;
}

/**
 * A labelled checkbox, `data-control` = name, calling onChange with its state.
 * @param {Element} parent
 * @param {string} name
 * @param {string} text
 * @param {(on: boolean) => void} onChange
 * @returns {HTMLInputElement}
 */
function checkbox(parent, name, text, onChange) {
  const label = element("label", { className: "cl-control" }, parent);
  const node = element("input", { type: "checkbox", className: "cl-check" }, label);
  node.dataset.control = name;
  label.appendChild(document.createTextNode(" " + text));
  node.addEventListener("change", () => onChange(node.checked));
  return node;
}

/**
 * The menu holds `options` and shows `value`; the caller passes a value the options hold (another
 * would blank the menu).
 * @param {HTMLSelectElement} node
 * @param {Array<[string | number, string]>} options [value, text]
 * @param {string | number} value
 */
export function setOptions(node, options, value) {
  const key = JSON.stringify(options);
  if (node.dataset.options !== key) {
    node.innerHTML = "";
    for (const [v, text] of options) element("option", { value: String(v), textContent: text }, node);
    node.dataset.options = key;
  }
  node.value = String(value);
}

/** @type {Array<[string, string]>} */
const VIEWS = [
  ["heatmap", "heatmap"],
  ["text", "text"],
  ["prediction", "prediction"],
];
/** The per-layer menus, hidden in the prediction view (they would change nothing drawn). */
const PER_LAYER = ["layer", "head", "factor", "scope", "query"];

/**
 * The views a host offers: the prediction view only with explained steps.
 * @param {unknown} steps
 * @returns {Array<[string, string]>}
 */
export function viewsOf(steps) {
  return steps ? VIEWS : VIEWS.filter(([v]) => v !== "prediction");
}

/**
 * The inspector's elements inside `root`, each control setting the host's state.
 * @param {HTMLElement} root
 * @param {Host} host
 * @returns {Parts}
 */
export function buildParts(root, host) {
  root.classList.add("cl-inspector");
  const bar = element("div", { className: "cl-controls" }, root);
  /** @type {Record<string, HTMLSelectElement>} */
  const controls = {};
  /** @type {Record<string, (value: string) => any>} */
  const parse = { layer: Number, head: (v) => (v === "all" ? "all" : Number(v)), query: Number };
  for (const name of PER_LAYER) controls[name] = select(bar, name, (value) => host.set({ [name]: (parse[name] || String)(value) }));
  // The token window is a control only where the host can recompute it (the widget).
  if (host.windows) controls.window = select(bar, "window", (value) => host.set({ start: Number(value) }));
  controls.view = select(bar, "view", (value) => host.set({ view: value }));
  // The explained step: shown where the host has steps (an explained answer or logit).
  controls.step = select(bar, "step", (value) => host.set({ step: Number(value) }));
  // The boolean settings (meta.settings: sink hiding, KV grouping, computed by the library): a toggle each,
  // shown where the host has the setting.
  /** @type {Record<string, HTMLInputElement>} */
  const toggles = {};
  for (const { name, label } of toggleSettings(host.meta())) {
    toggles[name] = checkbox(bar, name, label, (on) => host.set({ [name]: on }));
  }
  const status = element("span", { className: "cl-status" }, bar);
  const problem = element("div", { className: "cl-error" }, root);
  problem.setAttribute("role", "alert");
  const flow = element("div", { className: "cl-text" }, root);
  // The heatmap and the bars in one wrapping row: the bars sit beside the heatmap where both fit (view.js sizes them).
  const figures = element("div", { className: "cl-figures" }, root);
  const heatmap = element("div", { className: "cl-heatmap" }, figures);
  const bars = element("div", { className: "cl-bars" }, figures);
  // The registered panels (panels.js), each in an element of its own made on its first draw.
  const panels = element("div", { className: "cl-panels" }, root);
  const prediction = element("div", { className: "cl-prediction" }, root);
  const predictionCaption = element("div", { className: "cl-text-caption" }, prediction);
  const heads = element("div", { className: "cl-heads" }, prediction);
  const keyText = element("div", { className: "cl-text cl-keys" }, prediction);
  return { controls, toggles, status, problem, flow, heatmap, bars, panels, prediction, predictionCaption, heads,
           keyText };
}

/**
 * A menu or toggle shown or hidden (its label with it).
 * @param {HTMLElement} node
 * @param {boolean} shown
 */
function showControl(node, shown) {
  /** @type {HTMLElement} */ (node.parentNode).style.display = shown ? "" : "none";
}

/**
 * The controls of the view drawn: each menu's options and value, the ones that would change nothing hidden.
 * @param {Parts} parts
 * @param {Host} host
 * @param {Meta} meta
 * @param {State} state
 * @param {string} view the view drawn
 * @param {Steps | null} steps
 */
export function showControls(parts, host, meta, state, view, steps) {
  const { controls, toggles } = parts;
  // The prediction view needs only the step: the per-layer controls would change nothing drawn.
  const perLayer = view !== "prediction";
  for (const name of PER_LAYER) showControl(controls[name], perLayer);
  showControl(controls.step, Boolean(steps));
  if (steps) {
    const options = steps.steps.map((s, k) => /** @type {[number, string]} */ ([k, k + ": " + JSON.stringify(s.token) + " at " + s.position]));
    setOptions(controls.step, options, Math.max(0, state.step ?? -1));
  }
  setOptions(controls.layer, meta.layers.map((l) => [l, String(l)]), state.layer);
  /** @type {Array<[string | number, string]>} */
  const heads = [["all", "all heads"]];
  setOptions(controls.head, heads.concat([...Array(meta.n_heads).keys()].map((h) => [h, headLabel(meta, h)])), state.head);
  setOptions(controls.factor, meta.factors.map((f) => [f, LABELS[f]]), state.factor);
  setOptions(controls.scope, meta.scopes.map((s) => [s, s]), state.scope);
  setOptions(controls.query, meta.queries.map((q, i) => [q, meta.query_labels[i]]), state.query);
  setOptions(controls.view, viewsOf(steps), view);
  if (controls.window && host.windows) {
    const starts = host.windows();
    setOptions(controls.window, starts.map(([start, end]) => [start, "tokens " + start + "–" + end]), meta.queries[0]);
    showControl(controls.window, starts.length > 1 && perLayer);
  }
  const values = /** @type {Record<string, unknown>} */ (state);
  for (const { name, offered } of toggleSettings(meta)) {
    if (!toggles[name]) continue; // a setting the host's first meta did not describe
    // `offered`: the Python side shows KV grouping only where a value head serves several query heads.
    showControl(toggles[name], typeof values[name] === "boolean" && offered && perLayer);
    toggles[name].checked = Boolean(values[name]);
  }
}
