// @ts-check
// The circuit view (circuit_view.py): the circuit drawn beside the inspector (above it on a narrow screen), on the
// static page (CircuitInspector.write_html) and in the live widget alike. A click on a head node opens that head at the
// task's final position, its why panel asked for (the page holds the rows; the widget asks its kernel); a click on any
// other node (an MLP, the embeddings, the logits) opens nothing and says so. The answer is brought into sight: its
// note sits at the top of the inspector, which is scrolled to where it is out of view. What each node does is written
// by the Python side (page_data's `nodes`), so both front-ends say the same.

import { element } from "./controls.js";
import { plot } from "./figures.js";
import { scroller } from "./view.js";

/** @typedef {import("./types.js").State} State */

/**
 * A node of the circuit: a head opens (layer, head) at the page's query; every node has a note.
 * @typedef {{layer?: number, head?: number, note: string}} CircuitNode
 */

/**
 * What a circuit view embeds (circuit_view.py, page_data): the figure (plotly's JSON), the query (the task's final
 * position), the prompt, what each node does, the caption, and the window the inspector opened on.
 * @typedef {{figure: {data: object[], layout: object}, query: number, prompt: number, caption: string,
 *            nodes: Record<string, CircuitNode>, window?: {start: number, tokens: number}}} CircuitData
 */

/**
 * What the circuit view needs of its inspector: set a view; ask for a why row (the widget: its kernel); say
 * whether a kernel is missing (the widget, after a click: null while it may answer).
 * @typedef {{set: (partial: Partial<State>) => void, why?: (layer: number, head: number, query: number,
 *            ask: boolean) => unknown, missing?: () => string | null}} CircuitHost
 */

/**
 * What a click on `node` does: the view to show (null: none) and the note said.
 * @param {CircuitData} circuit
 * @param {string} node
 * @returns {{state: Partial<State> | null, note: string}}
 */
export function circuitTarget(circuit, node) {
  const entry = Object.prototype.hasOwnProperty.call(circuit.nodes, node) ? circuit.nodes[node] : null;
  if (!entry) return { state: null, note: node + " is not a node of this circuit" };
  if (entry.layer === undefined || entry.head === undefined) return { state: null, note: entry.note };
  // One head, its own view (not its KV group): the why panel splits one head's scores.
  const state = { layer: entry.layer, head: entry.head, query: circuit.query, view: "heatmap", group_kv: false };
  return { state, note: entry.note };
}

/**
 * The two panes of a circuit view in `parent`: the circuit's (left, or on top where the output is narrow) and the
 * inspector's (right, or under it), in one wrapping row (inspector.css, .cl-circuit-layout).
 * @param {HTMLElement} parent
 * @returns {{circuit: HTMLElement, inspector: HTMLElement}}
 */
export function circuitPanes(parent) {
  const layout = element("div", { className: "cl-circuit-layout" }, parent);
  return {
    circuit: element("div", { className: "cl-circuit-root" }, layout),
    inspector: element("div", { className: "cl-circuit-answer" }, layout),
  };
}

/** Where the answer's top must be for it to count as in sight: in the top part of the view, as a share of its height. */
const IN_SIGHT = 0.3;

/**
 * The answer (the inspector's top: the note, the menus, the heatmap) brought into sight where it is not: beside the
 * figure on a wide output it is already; under it on a narrow one it is scrolled to the top of the view.
 * @param {HTMLElement} answer
 */
export function revealAnswer(answer) {
  const outer = scroller(answer);
  const frame = outer ? outer.getBoundingClientRect() : { top: 0, bottom: globalThis.innerHeight };
  const top = answer.getBoundingClientRect().top;
  if (top >= frame.top - 1 && top <= frame.top + IN_SIGHT * (frame.bottom - frame.top)) return;
  answer.scrollIntoView({ block: "start" });
}

/**
 * The circuit in `root`, beside its inspector (`answer`, the element the inspector is drawn in): a click on a node's
 * marker sets the inspector's view (`circuitTarget`), asks for the head's why row, and writes the node's note at
 * the top of the inspector, brought into sight.
 * @param {HTMLElement} root
 * @param {CircuitData} circuit
 * @param {CircuitHost} host
 * @param {HTMLElement} answer
 * @returns {Promise<unknown>}
 */
export function circuitView(root, circuit, host, answer) {
  element("div", { className: "cl-note cl-circuit-caption", textContent: circuit.caption }, root);
  const figure = element("div", { className: "cl-circuit-figure" }, root);
  const note = element("div", { className: "cl-note cl-circuit-note" });
  answer.insertBefore(note, answer.firstChild);
  note.style.display = "none";
  root.dataset.ready = "false";
  /** @type {ReturnType<typeof setTimeout> | null} */
  let waiting = null;
  /** @param {any} event */
  const clicked = (event) => {
    const point = event.points && event.points.find((/** @type {any} */ p) => p.data && p.data.name === "nodes");
    if (!point) return; // an edge's hover marker: nothing to open
    const node = String(point.customdata);
    const { state, note: said } = circuitTarget(circuit, node);
    note.textContent = said;
    note.style.display = "";
    note.dataset.node = node;
    if (state) {
      host.set(state);
      try {
        if (host.why) host.why(Number(state.layer), Number(state.head), Number(state.query), true);
      } catch (error) {
        // A closed comm (no kernel holds the widget): the note says so below.
      }
    }
    revealAnswer(answer);
    // Without a kernel, the note says so once the kernel's silence is known (the inspector's line says why too).
    if (waiting) clearTimeout(waiting);
    const missing = host.missing;
    if (state && missing) {
      const check = () => {
        const gone = missing();
        if (gone === null) waiting = setTimeout(check, 500);
        else if (gone && note.dataset.node === node) note.textContent = node + ": " + gone;
      };
      waiting = setTimeout(check, 500);
    }
  };
  return plot(figure, circuit.figure.data, circuit.figure.layout, clicked).then(() => {
    fitWidth(figure);
    root.dataset.ready = "true";
  });
}

/**
 * The figure redrawn to its pane's width whenever that changes (the panes settle once the inspector beside is drawn,
 * and a resized output moves them): a figure drawn wider than its pane would run under the inspector.
 * @param {HTMLElement} figure
 */
function fitWidth(figure) {
  const Plotly = /** @type {any} */ (globalThis).Plotly;
  const gd = /** @type {any} */ (figure);
  if (!Plotly) return;
  const fit = () => {
    const width = figure.getBoundingClientRect().width;
    if (width > 0 && gd._fullLayout && Math.abs(width - gd._fullLayout.width) >= 2) Plotly.Plots.resize(figure);
  };
  fit();
  if (globalThis.ResizeObserver) new ResizeObserver(fit).observe(figure);
}
