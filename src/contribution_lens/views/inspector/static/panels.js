// @ts-check
// The inspector's panels (panel.py): each registered panel's ES module, loaded once from its source, draws
// its data into an element of its own under the view; the host (the widget's kernel, or the page) answers
// each panel's request (the settings it names) with the data, or why there is none.

import { fmt } from "./captions.js";
import { element } from "./controls.js";
import { plot } from "./figures.js";

/** @typedef {import("./types.js").Meta} Meta */
/** @typedef {import("./types.js").State} State */
/** @typedef {import("./types.js").View} View */
/** @typedef {import("./types.js").PanelSpec} PanelSpec */
/** @typedef {import("./types.js").PanelContext} PanelContext */
/** @typedef {{spec: PanelSpec, module: {draw: (element: HTMLElement, context: PanelContext) => unknown}}} Loaded */

/** Each panel's module, by its source: one import a source, however many inspectors a page holds. */
const modules = new Map();

/**
 * Each panel's module, imported from its source (a blob: URL, as anywidget loads the widget's own module).
 * @param {PanelSpec[]} specs
 * @returns {Promise<Loaded[]>}
 */
export function loadPanels(specs) {
  return Promise.all(
    specs.map((spec) => {
      if (!modules.has(spec.script)) {
        const url = URL.createObjectURL(new Blob([spec.script], { type: "text/javascript" }));
        modules.set(spec.script, import(url));
      }
      return modules.get(spec.script).then(
        (/** @type {Loaded["module"]} */ module) => ({ spec, module }),
        // A module that does not load: its element says so, and the other panels and the view are drawn.
        (/** @type {unknown} */ error) => ({ spec, module: { draw: (/** @type {HTMLElement} */ box) => {
          box.textContent = spec.title + " could not be loaded: " + error;
        } } }),
      );
    }),
  );
}

/**
 * The request of a panel for a state: the settings it names (head -1 for all heads).
 * @param {PanelSpec} spec
 * @param {Partial<State>} state
 * @returns {Record<string, number>}
 */
export function panelRequest(spec, state) {
  /** @type {Record<string, number>} */
  const request = {};
  for (const name of spec.on) {
    const value = /** @type {Record<string, unknown>} */ (state)[name];
    request[name] = name === "head" && value === "all" ? -1 : Number(value);
  }
  return request;
}

/**
 * How a request's data is named (panel.py, request_key): its settings' values in the panel's order.
 * @param {PanelSpec} spec
 * @param {Record<string, number>} request
 * @returns {string}
 */
export function requestKey(spec, request) {
  return spec.on.map((name) => request[name]).join("/");
}

/**
 * Every loaded panel drawn for the state, each in its own element (made on its first draw).
 * @param {View} view
 * @param {Meta} meta
 * @param {State} state
 * @returns {Promise<unknown>}
 */
export function drawPanels(view, meta, state) {
  const { host, parts } = view;
  parts.panels.style.display = "";
  const selected = view.selected && view.selected.query === state.query ? view.selected : null;
  return Promise.all(
    (view.panels || []).map(({ spec, module }) => {
      const own = parts.panels.querySelector("[data-panel='" + spec.name + "']") ||
        element("div", { className: "cl-panel" }, parts.panels);
      const box = /** @type {HTMLElement} */ (own);
      box.dataset.panel = spec.name;
      const request = panelRequest(spec, state);
      const memos = view.panelMemo || (view.panelMemo = {});
      /** @type {PanelContext} */
      const context = {
        name: spec.name, title: spec.title, state, meta, request, selected, width: view.drawnWidth,
        memo: memos[spec.name] || (memos[spec.name] = {}),
        answer: (ask = true) => (host.panel ? host.panel(spec, request, ask) : { gone: true }),
        set: host.set, redraw: () => (view.redraw ? view.redraw() : Promise.resolve()), plot, fmt,
      };
      try {
        return Promise.resolve(module.draw(box, context));
      } catch (error) {
        box.textContent = spec.title + " could not be drawn: " + error;
        return Promise.resolve();
      }
    }),
  );
}
