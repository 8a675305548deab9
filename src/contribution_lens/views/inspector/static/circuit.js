// @ts-check
// The circuit view of the static page (circuit_view.py, CircuitInspector.write_html): the circuit drawn above
// the inspector; a click on a head node opens that head at the task's final position, its why panel drawn from
// the rows the page carries; a click on any other node (an MLP, the embeddings, the logits) opens nothing and
// says so. What each node does is written by the Python side (page_data's `nodes`), so both front-ends say
// the same.

import { element } from "./controls.js";
import { plot } from "./figures.js";

/** @typedef {import("./types.js").State} State */

/**
 * A node of the circuit: a head opens (layer, head) at the page's query; every node has a note.
 * @typedef {{layer?: number, head?: number, note: string}} CircuitNode
 */

/**
 * What a page with a circuit embeds (circuit_view.py, page_data): the figure (plotly's JSON), the query
 * (the task's final position), the prompt, what each node does, and the caption.
 * @typedef {{figure: {data: object[], layout: object}, query: number, prompt: number, caption: string,
 *            nodes: Record<string, CircuitNode>}} CircuitData
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
 * The circuit in `root`, above the page's inspector (`host`, what page() returns): a click on a node's
 * marker sets the inspector's view (`circuitTarget`) and writes the node's note under the figure.
 * @param {HTMLElement} root
 * @param {CircuitData} circuit
 * @param {{set: (partial: Partial<State>) => void}} host
 * @returns {Promise<unknown>}
 */
export function circuitView(root, circuit, host) {
  element("div", { className: "cl-note cl-circuit-caption", textContent: circuit.caption }, root);
  const figure = element("div", { className: "cl-circuit-figure" }, root);
  const note = element("div", { className: "cl-note cl-circuit-note" }, root);
  note.style.display = "none";
  root.dataset.ready = "false";
  /** @param {any} event */
  const clicked = (event) => {
    const point = event.points && event.points.find((/** @type {any} */ p) => p.data && p.data.name === "nodes");
    if (!point) return; // an edge's hover marker: nothing to open
    const { state, note: said } = circuitTarget(circuit, String(point.text));
    note.textContent = said;
    note.style.display = "";
    note.dataset.node = String(point.text);
    if (state) host.set(state);
  };
  return plot(figure, circuit.figure.data, circuit.figure.layout, clicked).then(() => (root.dataset.ready = "true"));
}
