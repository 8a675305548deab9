// @ts-check
// The static page (write_html): every layer embedded, the view named in the URL fragment.

import { element } from "./controls.js";
import { inflate } from "./factors.js";
import { droppedFragment, fragment, readFragment } from "./fragment.js";
import { requestKey } from "./panels.js";
import { linkedSettings } from "./settings.js";
import { mount } from "./view.js";

/** @typedef {import("./types.js").Meta} Meta */
/** @typedef {import("./types.js").State} State */
/** @typedef {import("./types.js").Payload} Payload */
/** @typedef {import("./types.js").StepsPayload} StepsPayload */
/** @typedef {import("./types.js").PanelSpec} PanelSpec */

/**
 * What a page embeds (page.py, render): the meta, each layer's payload by layer, the explained steps, the
 * registered panels' modules and, for each panel the writer named, its queries and its data by request key.
 * @typedef {{meta: Meta, layers: Record<string, Payload>, steps: StepsPayload | null,
 *            panels?: PanelSpec[], panel_data?: Record<string, {queries: number[], data: Record<string, any>}>}} PageData
 */

/**
 * A panel's data for a request where the page carries it, else the queries it carries for that panel.
 * @param {PageData} data
 * @param {PanelSpec} spec
 * @param {Record<string, number>} request
 * @returns {import("./types.js").PanelAnswer}
 */
export function pageAnswer(data, spec, request) {
  const carried = data.panel_data && data.panel_data[spec.name];
  const key = requestKey(spec, request);
  if (carried && Object.prototype.hasOwnProperty.call(carried.data, key)) return { data: carried.data[key] };
  return { missing: carried ? carried.queries : [] };
}

/**
 * Rewrite the URL's fragment where the page may: JupyterLab's HTML viewer serves the page from a
 * blob: URL, where history.replaceState throws.
 * @param {State} state
 * @param {Meta} meta
 */
function showFragment(state, meta) {
  try {
    history.replaceState(null, "", fragment(state, meta));
  } catch (error) {
    // The view still changes; only the address does not name it.
  }
}

/**
 * The page's layers: a compact one is inflated on first view (asynchronously), then kept with the others.
 * @param {PageData} data
 */
function pageLayers(data) {
  /** @type {Map<number, Promise<Payload | null>>} */
  const inflating = new Map();
  /** @param {number} l */
  const waiting = (l) => {
    const payload = data.layers[String(l)];
    return Boolean(payload && "packed" in payload && payload.packed && !payload.buffer);
  };
  /** @param {number} l */
  const ready = (l) => {
    const payload = data.layers[String(l)];
    if (!waiting(l)) return Promise.resolve(payload || null);
    if (!inflating.has(l)) {
      inflating.set(l, inflate(payload).then((full) => (data.layers[String(l)] = full)));
    }
    return /** @type {Promise<Payload | null>} */ (inflating.get(l));
  };
  return {
    waiting,
    ready,
    /** @param {number} l */
    get: (l) => (waiting(l) ? null : data.layers[String(l)] || null),
  };
}

/**
 * Why a head clicked in the prediction view cannot be opened here ("" when it can): its layer or
 * the step's position is not on the page.
 * @param {Meta} meta
 * @param {number} position
 * @param {number} layer
 * @returns {string}
 */
function unopenable(meta, position, layer) {
  const [first, last] = [meta.queries[0], meta.queries[meta.queries.length - 1]];
  if (!meta.layers.includes(layer)) return "layer " + layer + " is not on this page (it holds layers " + meta.layers.join(", ") + ")";
  if (!meta.queries.includes(position)) return "position " + position + " is outside this page's queries " + first + "–" + last;
  return "";
}

/**
 * The address of the window around the page ("" where there is none, or it is another site's): JupyterLab's
 * HTML viewer, trusted, shows the page in a frame of JupyterLab's own origin, whose address it can read.
 * @returns {string}
 */
function outerHash() {
  try {
    return window.parent !== window ? window.parent.location.hash : "";
  } catch (error) {
    return ""; // another origin, or a sandbox without allow-same-origin: nothing to read
  }
}

/**
 * A view named in the address the page was opened from that the page did not receive: say so above the
 * inspector (shown only then; a page opened plainly, or from a link whose fragment left no trace, has no note).
 * @param {HTMLElement} root
 * @param {Meta} meta
 */
function noteDroppedFragment(root, meta) {
  const names = linkedSettings(meta).map((setting) => setting.name);
  const dropped = droppedFragment(window.location.hash, outerHash(), names);
  if (!dropped) return;
  const note = element("div", { className: "cl-note" });
  note.textContent =
    "This viewer dropped the view named in its address (#" + dropped + "): choose it in the menus, " +
    "or open the page in a browser tab to see the view a link names.";
  /** @type {ParentNode} */ (root.parentNode).insertBefore(note, root);
}

/**
 * The static page's inspector in `root`, from the data the page embeds.
 * @param {HTMLElement} root
 * @param {PageData} data
 * @returns {{refresh: () => Promise<unknown>, set: (partial: Partial<State>) => void}} `set` changes the view as
 *   the menus do (the circuit view's head nodes call it)
 */
export function page(root, data) {
  const meta = data.meta;
  const steps = data.steps && data.steps.steps && data.steps.steps.length ? data.steps : null;
  let { state, problems } = readFragment(meta, window.location.hash, steps);
  let refusal = ""; // why the last head clicked in the prediction view cannot be shown here
  const layers = pageLayers(data);
  // Drawn at once where the layer is ready (as before), after its inflation where not.
  const draw = () => (layers.waiting(state.layer) ? (view.refresh(), layers.ready(state.layer).then(() => view.refresh())) : view.refresh());
  const view = mount(root, {
    meta: () => meta,
    layer: layers.get,
    state: () => state,
    error: () => refusal || (problems.length ? "This link names a view the page cannot show: " + problems.join("; ") + "." : ""),
    steps: () => steps,
    set,
    open,
    panels: () => data.panels || [],
    panel: (spec, request) => pageAnswer(data, spec, request),
  });
  /** @param {Partial<State>} partial */
  function set(partial) {
    state = Object.assign({}, state, partial);
    // Choosing a step moves the query to its position, where the page's window holds it.
    if (partial.step !== undefined && steps && meta.queries.includes(steps.steps[partial.step].position)) {
      state.query = steps.steps[partial.step].position;
    }
    problems = [];
    refusal = "";
    showFragment(state, meta);
    draw();
  }
  // A head clicked in the prediction view: its per-layer view at the step's position, where the page holds both.
  /** @type {(step: number, layer: number, head: number) => void} */
  function open(step, layer, head) {
    const position = /** @type {StepsPayload} */ (steps).steps[step].position;
    const why = unopenable(meta, position, layer);
    if (!why) return set({ step, layer, head, view: "heatmap", query: position });
    refusal = "L" + layer + "H" + head + " at step " + step + " cannot be shown: " + why +
      ". Write the page with write_html(layers=..., start=...) to hold it.";
    draw();
  }
  window.addEventListener("hashchange", () => {
    ({ state, problems } = readFragment(meta, window.location.hash, steps));
    refusal = ""; // a new view: the last clicked head's refusal goes, as with set()
    draw();
  });
  noteDroppedFragment(root, meta);
  showFragment(state, meta);
  root.dataset.ready = "false";
  draw().then(() => (root.dataset.ready = "true"));
  return { refresh: view.refresh, set };
}
