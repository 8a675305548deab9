// @ts-check
// The static page's view, named in its URL fragment: #layer=L&head=H&factor=F&scope=S&query=Q and each other
// setting where it is not the default (meta.settings says which, in what order, and the defaults).

import { viewsOf } from "./controls.js";
import { linkValue, linkedSettings } from "./settings.js";

/** @typedef {import("./types.js").Meta} Meta */
/** @typedef {import("./types.js").State} State */
/** @typedef {import("./types.js").StepsPayload} StepsPayload */
/** @typedef {import("./types.js").Setting} Setting */

/**
 * A decimal integer, or NaN.
 * @param {string} text
 * @returns {number}
 */
const integer = (text) => (/^-?[0-9]+$/.test(text) ? Number(text) : NaN);

/**
 * @typedef {object} Reading
 * @property {Meta} meta
 * @property {StepsPayload | null} steps
 * @property {URLSearchParams} params
 * @property {State} state the view so far (settings are read in order)
 * @property {(name: string, value: string, why: string, shown: string) => void} refuse
 */

/**
 * How each setting of a fragment that needs the page's own data is read: it sets `state` or says why it
 * cannot (`refuse`). A boolean setting is read as a flag (`readerOf`).
 * @type {Record<string, (reading: Reading, value: string) => void>}
 */
export const READERS = {
  layer({ meta, state, refuse }, value) {
    if (meta.layers.includes(integer(value))) state.layer = integer(value);
    else refuse("layer", value, "is not on this page (it holds layers " + meta.layers.join(", ") + ")", "layer " + state.layer);
  },
  head({ meta, state, refuse }, value) {
    const h = integer(value);
    if (value === "all") state.head = "all";
    else if (h >= 0 && h < meta.n_heads) state.head = h;
    else refuse("head", value, "does not exist (heads 0–" + (meta.n_heads - 1) + " or all)", state.head === "all" ? "all heads" : "head " + state.head);
  },
  factor: (reading, value) => oneOf(reading, "factor", value, reading.meta.factors),
  scope: (reading, value) => oneOf(reading, "scope", value, reading.meta.scopes),
  query({ meta, state, refuse }, value) {
    const q = integer(value);
    const [first, last] = [meta.queries[0], meta.queries[meta.queries.length - 1]];
    if (meta.queries.includes(q)) state.query = q;
    else refuse("query", value, "is outside this page's queries " + first + "–" + last, "query " + state.query);
  },
  view({ steps, state, refuse }, value) {
    const views = viewsOf(steps);
    if (views.some(([v]) => v === value)) state.view = value;
    else refuse("view", value, "is not one of " + views.map(([v]) => v).join(", "), String(state.view));
  },
  step({ meta, steps, params, state, refuse }, value) {
    const k = integer(value);
    const nSteps = steps ? steps.steps.length : 0;
    if (steps && k >= 0 && k < nSteps) {
      state.step = k;
      // The step's position is the query, where the page holds it (as choosing the step does).
      if (!params.has("query") && meta.queries.includes(steps.steps[k].position)) state.query = steps.steps[k].position;
    } else {
      const why = nSteps ? "does not exist (steps 0–" + (nSteps - 1) + ")" : "names a step, and this page explains none";
      refuse("step", value, why, nSteps ? "step " + state.step : "no step");
    }
  },
};

/**
 * How a setting of the fragment is read (null: the front-end cannot read it).
 * @param {Setting} setting
 * @returns {((reading: Reading, value: string) => void) | null}
 */
export function readerOf(setting) {
  if (setting.name in READERS) return READERS[setting.name];
  return setting.type === "bool" ? (reading, value) => flag(reading, setting.name, value) : null;
}

/**
 * A setting whose value must be one of `allowed`.
 * @param {Reading} reading
 * @param {"factor" | "scope"} name
 * @param {string} value
 * @param {string[]} allowed
 */
function oneOf({ state, refuse }, name, value, allowed) {
  if (allowed.includes(value)) state[name] = value;
  else refuse(name, value, "is not one of " + allowed.join(", "), state[name]);
}

/**
 * A setting that is on (1) or off (0).
 * @param {Reading} reading
 * @param {string} name
 * @param {string} value
 */
function flag({ state, refuse }, name, value) {
  const flags = /** @type {Record<string, unknown>} */ (state);
  if (value === "1" || value === "0") flags[name] = value === "1";
  else refuse(name, value, "is not 1 or 0", flags[name] ? "1" : "0");
}

/**
 * The view a fragment names, and why each setting it names that the page cannot show was refused
 * (the page then shows its own choice and says so: a link never changes meaning silently).
 * @param {Meta} meta
 * @param {string} hash
 * @param {StepsPayload | null} [steps]
 * @returns {{state: State, problems: string[]}}
 */
export function readFragment(meta, hash, steps = null) {
  const linked = linkedSettings(meta);
  /** @type {State} */
  const state = Object.assign(Object.fromEntries(linked.map((setting) => [setting.name, setting.default])), meta.initial);
  if (!steps && state.view === "prediction") state.view = "heatmap";
  /** @type {string[]} */
  const problems = [];
  const params = new URLSearchParams(hash.replace(/^#/, ""));
  /** @type {Reading} */
  const reading = {
    meta, steps, params, state,
    refuse: (name, value, why, shown) => problems.push(name + "=" + value + " " + why + "; showing " + shown),
  };
  for (const [name, value] of params) {
    const setting = linked.find((s) => s.name === name);
    const read = setting ? readerOf(setting) : null;
    if (read) read(reading, value);
    else problems.push(name + "=" + value + " is not a view setting (" + linked.map((s) => s.name).join(", ") + "); ignored");
  }
  return { state, problems };
}

/**
 * The view settings a page was meant to open on but did not receive ("" when none was dropped): `outer`
 * (the address of the window around the page, where it can be read) names a view with its settings
 * (`layer=`, `head=`, ...) and the page's own fragment `own` names none. JupyterLab's HTML viewer
 * shows a page from a blob: URL, without the fragment of the address it was opened from
 * (`/lab/tree/page.html#layer=2`); a link clicked in a notebook leaves no trace at all, so nothing
 * is reported for it.
 * @param {string} own the page's own `location.hash`
 * @param {string} outer the enclosing window's `location.hash` ("" when there is none or it cannot be read)
 * @param {string[]} settings the names a fragment may hold (`linkedSettings`)
 * @returns {string}
 */
export function droppedFragment(own, outer, settings) {
  /** @param {string} hash */
  const names = (hash) => [...new URLSearchParams(hash.replace(/^#/, "")).keys()].some((name) => settings.includes(name));
  return !names(own) && names(outer) ? outer.replace(/^#/, "") : "";
}

/**
 * The fragment naming a view: each linked setting in the table's order, those at their default left out
 * where the table says so (view, the toggles, step).
 * @param {State} state
 * @param {Meta} meta
 * @returns {string}
 */
export function fragment(state, meta) {
  const values = /** @type {Record<string, unknown>} */ (state);
  const named = linkedSettings(meta).filter(
    (s) => s.link === "always" || (values[s.name] !== undefined && values[s.name] !== s.default),
  );
  return "#" + named.map((s) => s.name + "=" + linkValue(s, values[s.name])).join("&");
}
