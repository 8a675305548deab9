// @ts-check
// contribution-lens inspector: the Jupyter widget (`render`, anywidget's entry point) and, from the
// modules it imports, the static page (`page`). One ES module for both: page.py assembles this
// folder's modules into one (the widget and the page load it offline, from no URL of their own).
//
//   codecs.js   payload arrays back to numbers          windows.js     the token window, labels
//   factors.js  a layer decoded, a view's factors       captions.js    names, titles, hover text
//   colours.js  colour scales sampled                   controls.js    the menus and elements
//   figures.js  heatmap, text and bars of a layer       prediction.js  the prediction view
//   view.js     mount(): one inspector drawn from its host
//   fragment.js, page.js  the static page               inspector.js   the widget (this file)
//   types.js    the shapes of the payload, the state and the host (JSDoc only)

import { element } from "./controls.js";
import { mount } from "./view.js";
import { windowStarts } from "./windows.js";

/** @typedef {import("./types.js").WidgetModel} WidgetModel */
/** @typedef {import("./types.js").Host} Host */
/** @typedef {import("./types.js").State} State */

const NO_KERNEL =
  "No kernel answered: this inspector's numbers come from the Python kernel, and a notebook reopened " +
  "from disk keeps only the last view drawn. Run the cell again to use it (the page of write_html needs no kernel).";
const KERNEL_WAIT_MS = 10000;

/**
 * plotly.js, loaded once per notebook page: the first widget that finds no globalThis.Plotly asks
 * the kernel for the plotly.min.js of the installed plotly package (one custom message) and
 * evaluates it; every later widget in the page reuses it. Nothing is fetched from the network.
 * @param {WidgetModel} model
 * @returns {Promise<unknown>}
 */
function ensurePlotly(model) {
  const shared = /** @type {any} */ (globalThis);
  if (shared.Plotly) return Promise.resolve(shared.Plotly);
  if (!shared.__contributionLensPlotly) {
    shared.__contributionLensPlotly = new Promise((resolve) => {
      model.on("msg:custom", (message) => {
        if (message.type !== "plotly" || shared.Plotly) return;
        new Function(message.source)();
        resolve(shared.Plotly);
      });
      model.send({ type: "need_plotly" });
    });
  }
  return shared.__contributionLensPlotly;
}

const TRAITS = ["layer", "head", "factor", "scope", "query", "start", "hide_sink", "group_kv", "view", "step"];

/**
 * Whether the kernel is there: a ping it answers with a pong (widget.py); none within
 * KERNEL_WAIT_MS means a widget restored from the notebook file without its kernel.
 * @param {WidgetModel} model
 * @param {() => void} onChange called when the kernel goes missing or comes back
 * @returns {{readonly missing: boolean, check: () => void}}
 */
function kernelWatch(model, onChange) {
  let answered = false;
  let missing = false;
  /** @type {ReturnType<typeof setTimeout> | null} */
  let timer = null;
  model.on("msg:custom", (message) => {
    if (message.type !== "pong") return;
    answered = true;
    if (timer) clearTimeout(timer);
    timer = null;
    if (missing) {
      missing = false;
      onChange();
    }
  });
  return {
    get missing() {
      return missing;
    },
    check() {
      if (answered || timer) return;
      model.send({ type: "ping" });
      timer = setTimeout(() => {
        timer = null;
        if (!answered) {
          missing = true;
          onChange();
        }
      }, KERNEL_WAIT_MS);
    },
  };
}

/**
 * The widget's model as the view's host: the state is the traits, a change is saved to the kernel,
 * which answers with the window's meta and the layer's payload.
 * @param {WidgetModel} model
 * @param {ReturnType<typeof kernelWatch>} kernel
 * @returns {Host}
 */
function widgetHost(model, kernel) {
  return {
    meta: () => model.get("meta"),
    layer: (l) => {
      const payload = model.get("payload");
      return payload && payload.layer === l && payload.key === model.get("meta").key + "/" + l ? payload : null;
    },
    state: () => {
      const state = /** @type {State} */ (Object.fromEntries(TRAITS.map((name) => [name, model.get(name)])));
      state.head = /** @type {number} */ (state.head) < 0 ? "all" : state.head;
      return state;
    },
    error: () => model.get("error") || "",
    steps: () => model.get("steps") || null,
    // The kernel moves the window where the step's position needs it (Inspector.show_step).
    open: (step, layer, head) => model.send({ type: "open", step, layer, head }),
    pending: (state) => {
      kernel.check();
      if (kernel.missing) return NO_KERNEL;
      return state ? "computing layer " + state.layer + "…" : "waiting for the kernel…";
    },
    // Windows of the widget's size, half-overlapping, over the whole text.
    windows: () => windowStarts(model.get("meta").n_tokens, model.get("tokens"), model.get("meta").queries[0]),
    set(partial) {
      for (const [name, value] of Object.entries(partial)) model.set(name, name === "head" && value === "all" ? -1 : value);
      model.save_changes();
    },
  };
}

/**
 * anywidget's entry point: the inspector in `el`, redrawn whenever a trait changes.
 * @param {{model: WidgetModel, el: HTMLElement}} widget
 * @returns {Promise<() => void>} what undoes it
 */
async function render({ model, el }) {
  const waiting = element("div", { className: "cl-status", textContent: "waiting for the kernel…" }, el);
  const slow = setTimeout(() => (waiting.textContent = NO_KERNEL), KERNEL_WAIT_MS);
  await ensurePlotly(model);
  clearTimeout(slow);
  waiting.remove();
  const kernel = kernelWatch(model, () => view.refresh());
  const view = mount(el, widgetHost(model, kernel));
  const redraw = () => view.refresh();
  const names = [...TRAITS, "payload", "meta", "error", "steps"];
  for (const name of names) model.on("change:" + name, redraw);
  await view.refresh();
  return () => {
    for (const name of names) model.off("change:" + name, redraw);
  };
}

export default { render };
