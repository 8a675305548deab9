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
//   settings.js the view state's settings, as the Python side describes them (meta.settings)
//   types.js    the shapes of the payload, the state and the host (JSDoc only)

import { stillCaption } from "./captions.js";
import { circuitPanes, circuitView } from "./circuit.js";
import { element } from "./controls.js";
import { settingNames } from "./settings.js";
import { mount } from "./view.js";
import { windowStarts } from "./windows.js";

/** @typedef {import("./types.js").WidgetModel} WidgetModel */
/** @typedef {import("./types.js").Host} Host */
/** @typedef {import("./types.js").State} State */

/** A request the kernel has not answered within this long is reported (a busy kernel answers later). */
const KERNEL_WAIT_S = 4;
const KERNEL_WAIT_MS = KERNEL_WAIT_S * 1000;
const NO_KERNEL =
  "No answer from the kernel for " + KERNEL_WAIT_S + " s: it is busy, or gone (restarted, shut down, or this notebook " +
  "was reopened). This view is the last one drawn; run the cell again to explore it (the page of write_html needs no kernel).";
/** The still's line (still.py's RUN_AGAIN), drawn above the view sent to the kernel. */
const RUN_AGAIN = "The inspector's last view: run the cell again to explore it.";
/** The why panel before a click: the kernel splits a head's score only for a clicked cell (widget.py's _split). */
const CLICK_A_CELL = "click a cell of the heatmap: the kernel splits this head's score there";
/** How long a view must stay unchanged before it is sent to the kernel as the still. */
const SETTLE_MS = 1000;
/** Said with NO_KERNEL where a change could not be drawn and was undone (one state: the menus show what is drawn). */
const UNDONE = "The change that needed it was undone: the menus show the view drawn.";
/** The MIME type of a widget's output (its model_id names the widget). */
const WIDGET_VIEW = "application/vnd.jupyter.widget-view+json";
/** What a circuit's note says after a click no kernel answered. */
const NO_KERNEL_CIRCUIT = "no kernel answered, so the inspector cannot open it: run the cell again to explore the circuit " +
  "(the page of write_html needs no kernel).";

/**
 * plotly.js, loaded once per notebook page: a widget that finds no globalThis.Plotly asks its kernel for
 * the plotly.min.js of the installed plotly package (one custom message) and evaluates it; every widget
 * waiting in the page then draws with it. Nothing is fetched from the network. Each widget asks at most
 * once, and only where no question is pending (asked within KERNEL_WAIT_MS), so that a notebook run whole
 * is sent plotly.js once. A widget whose kernel has answered a ping asks even then, unless the pending
 * question came from such a widget too: a widget restored from saved widget state asks a kernel that is
 * gone, and must not keep the live widget of the cell run again waiting on its question.
 * @param {WidgetModel} model
 * @param {{readonly missing: boolean, readonly answered: boolean}} kernel this widget's kernelWatch
 * @returns {Promise<unknown>}
 */
function ensurePlotly(model, kernel) {
  const shared = /** @type {any} */ (globalThis);
  if (shared.Plotly) return Promise.resolve(shared.Plotly);
  const loading = (shared.__contributionLensPlotly ||= { waiting: [], asked: -Infinity, live: false });
  let asked = false;
  return new Promise((resolve) => {
    loading.waiting.push(resolve);
    model.on("msg:custom", (message) => {
      if (!message || message.type !== "plotly") return;
      if (!shared.Plotly) new Function(message.source)();
      for (const waiting of loading.waiting.splice(0)) waiting(shared.Plotly);
    });
    const ask = () => {
      const live = kernel.answered && !kernel.missing;
      if (asked || (Date.now() - loading.asked < KERNEL_WAIT_MS && (loading.live || !live))) return;
      asked = true;
      loading.asked = Date.now();
      loading.live = live;
      try {
        model.send({ type: "need_plotly" });
      } catch (error) {
        // A closed comm (no kernel holds this model): another widget's kernel may answer.
      }
    };
    ask();
    // Asked again as the kernel answers its ping, or as another widget's question goes unanswered.
    const again = setInterval(() => (shared.Plotly || asked ? clearInterval(again) : ask()), KERNEL_WAIT_MS / 8);
  });
}

/**
 * The traits that make a view (state.py's SETTINGS, as meta.settings names them), as the kernel holds them
 * (head -1 for all heads): what the view draws, what a still records, what an undone change goes back to.
 * @param {WidgetModel} model
 * @returns {Record<string, unknown>}
 */
function viewTraits(model) {
  return Object.fromEntries(settingNames(model.get("meta")).map((name) => [name, model.get(name)]));
}

/**
 * Whether the kernel is there: every request is followed by a ping (widget.py answers with a pong);
 * none within KERNEL_WAIT_MS marks the kernel missing (restarted, shut down, or a notebook reopened
 * without it) until a later pong. A kernel that answered once may be gone now: each request asks again.
 * @param {WidgetModel} model
 * @param {() => void} onChange called when the kernel goes missing, answers, or comes back
 * @returns {{readonly missing: boolean, readonly answered: boolean, readonly checking: boolean, check: () => void}}
 */
export function kernelWatch(model, onChange) {
  let answered = false;
  let missing = false;
  // True while the views redraw on a ping's silence: that silence answers their own checks too.
  let settling = false;
  /** @type {ReturnType<typeof setTimeout> | null} */
  let timer = null;
  model.on("msg:custom", (message) => {
    if (!message || message.type !== "pong") return;
    if (timer) clearTimeout(timer);
    timer = null;
    const changed = missing || !answered;
    answered = true;
    missing = false;
    if (changed) onChange();
  });
  return {
    get missing() {
      return missing;
    },
    get answered() {
      return answered;
    },
    /** Whether a ping is on its way: until its answer or silence, a kernel thought missing may be back. */
    get checking() {
      return timer !== null;
    },
    check() {
      if (timer || settling) return; // a ping is on its way, or just went unanswered: that settles this request too
      try {
        model.send({ type: "ping" });
      } catch (error) {
        // A closed comm (the kernel is gone) throws: the timer below reports it.
      }
      timer = setTimeout(() => {
        timer = null;
        missing = true;
        settling = true;
        try {
          onChange();
        } finally {
          settling = false;
        }
      }, KERNEL_WAIT_MS);
    },
  };
}

/**
 * The why panel's rows, asked of the kernel once per window, layer, head and query, and only for a
 * clicked cell (`ask`: a head chosen in the menu costs the kernel nothing), kept as they arrive (a
 * repeated click asks nothing); `onAnswer` is called when one arrives.
 * @param {WidgetModel} model
 * @param {ReturnType<typeof kernelWatch>} kernel
 * @param {() => void} onAnswer
 * @returns {(layer: number, head: number, query: number, ask: boolean) => import("./types.js").WhyRow | string | null}
 */
export function whyRows(model, kernel, onAnswer) {
  /** @type {Map<string, {row?: import("./types.js").WhyRow, error?: string}>} */
  const answers = new Map();
  const asked = new Set();
  model.on("msg:custom", (message) => {
    if (!message || message.type !== "why" || typeof message.key !== "string") return;
    answers.set(message.key, message);
    onAnswer();
  });
  return (layer, head, query, ask) => {
    const key = model.get("meta").key + "|" + layer + "/" + head + "/" + query;
    const answer = answers.get(key);
    if (answer) return answer.row || "the kernel could not split this score: " + answer.error;
    if (!asked.has(key) && !ask) return CLICK_A_CELL;
    if (!asked.has(key)) {
      asked.add(key);
      try {
        model.send({ type: "why", key, layer, head, query });
      } catch (error) {
        // A closed comm (the kernel is gone): the check below finds it missing.
      }
    }
    kernel.check();
    if (!kernel.missing) return null;
    asked.delete(key); // asked again once the kernel answers
    return "not drawn: no kernel answered";
  };
}

/**
 * The widget's model as the view's host: the state is the traits, a change is saved to the kernel,
 * which answers with the window's meta and the layer's payload (and, asked, a why row).
 * @param {WidgetModel} model
 * @param {ReturnType<typeof kernelWatch>} kernel
 * @param {ReturnType<typeof whyRows>} why
 * @param {() => void} undo called when a change cannot be drawn: no kernel answered it
 * @returns {Host}
 */
function widgetHost(model, kernel, why, undo) {
  return {
    why,
    meta: () => model.get("meta"),
    layer: (l) => {
      const payload = model.get("payload");
      return payload && payload.layer === l && payload.key === model.get("meta").key + "/" + l ? payload : null;
    },
    state: () => {
      const state = /** @type {State} */ (viewTraits(model));
      state.head = /** @type {number} */ (state.head) < 0 ? "all" : state.head;
      return state;
    },
    error: () => model.get("error") || "",
    steps: () => model.get("steps") || null,
    // The kernel moves the window where the step's position needs it (Inspector.show_step).
    open: (step, layer, head) => model.send({ type: "open", step, layer, head }),
    pending: (state) => {
      kernel.check();
      if (kernel.missing && !kernel.checking) {
        setTimeout(undo); // after this drawing: the menus go back to the view drawn, which is drawn again
        return "not drawn: no kernel answered";
      }
      // A kernel thought missing is asked again first: one that is back draws this change.
      if (kernel.missing) return "waiting for the kernel…";
      return state ? "computing layer " + state.layer + "…" : "waiting for the kernel…";
    },
    // Windows of the widget's size, half-overlapping, over the whole text.
    windows: () => windowStarts(model.get("meta").n_tokens, model.get("tokens"), model.get("meta").queries[0]),
    set(partial) {
      for (const [name, value] of Object.entries(partial)) model.set(name, name === "head" && value === "all" ? -1 : value);
      model.save_changes();
      kernel.check(); // every change asks whether the kernel is still there to answer it
    },
  };
}

/**
 * The output just before this widget's, where it is the inspector's still (a notebook written before stills named
 * their widget): JupyterLab's output area, or null elsewhere.
 * @param {HTMLElement} el
 * @returns {HTMLElement | null}
 */
function stillOutput(el) {
  const child = el.closest(".jp-OutputArea-child");
  const before = child ? /** @type {HTMLElement | null} */ (child.previousElementSibling) : null;
  if (!before) return null;
  const text = before.textContent || "";
  return before.querySelector(".jp-RenderedImage img") || text.includes(RUN_AGAIN) ? before : null;
}

/**
 * Whether output `output` is this widget's own (its still, a circuit's image): its metadata names the widget, or,
 * in a notebook written before stills named their widget, it is a still just before the widget's output `next`.
 * @param {{metadata?: Record<string, any>}} output
 * @param {{data?: Record<string, any>} | undefined} next
 * @param {string} id the widget's model id
 * @returns {boolean}
 */
export function ownOutput(output, next, id) {
  const lens = (output.metadata || {}).contribution_lens;
  if (!lens) return false;
  if (lens.widget !== undefined) return lens.widget === id;
  const view = next && next.data ? next.data[WIDGET_VIEW] : null;
  return lens.still !== undefined && Boolean(view) && view.model_id === id;
}

/**
 * This widget's own outputs in its cell as JupyterLab draws them (its still, a circuit's image), found by identity
 * in the notebook's model (their metadata names the widget: a cell may hold other outputs between them); by
 * position (the output just before the widget's) where there is no notebook model.
 * @param {WidgetModel} model
 * @param {HTMLElement} el
 * @returns {HTMLElement[]}
 */
function ownOutputs(model, el) {
  const child = el.closest(".jp-OutputArea-child");
  const area = child ? child.parentElement : null;
  const manager = model.widget_manager;
  const notebook = manager && manager.context && manager.context.model;
  if (child && area && notebook && notebook.cells) {
    const children = [...area.children].filter((node) => node.classList.contains("jp-OutputArea-child"));
    const index = children.indexOf(child);
    const id = model.get("model_ref");
    for (let c = 0; c < notebook.cells.length; c++) {
      const outputs = notebook.cells.get(c).outputs;
      if (!outputs || index >= outputs.length) continue;
      const view = outputs.get(index).data[WIDGET_VIEW];
      if (!view || view.model_id !== id) continue; // not this cell: its output there is not this widget
      const mine = [];
      for (let i = 0; i < outputs.length; i++) {
        if (ownOutput(outputs.get(i), i + 1 < outputs.length ? outputs.get(i + 1) : undefined, id) && children[i]) {
          mine.push(/** @type {HTMLElement} */ (children[i]));
        }
      }
      return mine;
    }
  }
  const before = stillOutput(el);
  return before ? [before] : [];
}

/**
 * What the view draws now as one PNG (its visible figures where they sit, under the still's line),
 * or null when it draws no figure (the text view).
 * @param {HTMLElement} root
 * @returns {Promise<{png: string, width: number} | null>}
 */
export async function drawnImage(root) {
  const Plotly = /** @type {any} */ (globalThis).Plotly;
  const shown = /** @type {HTMLElement[]} */ ([...root.querySelectorAll(".js-plotly-plot")]).filter(
    (gd) => gd.offsetWidth > 0 && gd.offsetHeight > 0,
  );
  if (!Plotly || !shown.length) return null;
  const line = 22;
  const origin = root.getBoundingClientRect();
  const boxes = shown.map((gd) => gd.getBoundingClientRect());
  const width = Math.ceil(Math.max(...boxes.map((box) => box.right - origin.left)));
  const height = Math.ceil(line + Math.max(...boxes.map((box) => box.bottom - origin.top)) - Math.min(...boxes.map((box) => box.top - origin.top)));
  const top = Math.min(...boxes.map((box) => box.top));
  const scale = Math.min(2, Math.max(1, globalThis.devicePixelRatio || 1));
  const canvas = document.createElement("canvas");
  canvas.width = Math.round(width * scale);
  canvas.height = Math.round(height * scale);
  const context = /** @type {CanvasRenderingContext2D} */ (canvas.getContext("2d"));
  context.scale(scale, scale);
  context.fillStyle = "#ffffff";
  context.fillRect(0, 0, width, height);
  context.fillStyle = "#444444";
  context.font = "italic 13px sans-serif";
  context.fillText(RUN_AGAIN, 6, 15);
  for (const [i, gd] of shown.entries()) {
    const box = boxes[i];
    const url = await Plotly.toImage(gd, { format: "png", width: gd.offsetWidth, height: gd.offsetHeight, scale });
    const image = new Image();
    await new Promise((resolve, reject) => {
      image.onload = resolve;
      image.onerror = reject;
      image.src = url;
    });
    context.drawImage(image, box.left - origin.left, line + box.top - top, box.width, box.height);
  }
  return { png: canvas.toDataURL("image/png").split(",")[1], width };
}

/**
 * The still of a view drawn without a kernel, as the kernel writes it (still.py's bundle): the still's line
 * naming the view, the PNG the widget drew (none for the text view) and the view in its metadata.
 * @param {WidgetModel} model
 * @param {Record<string, any>} state the view's traits (`viewTraits`)
 * @param {{png: string, width: number} | null} drawn
 * @returns {{model_id: string, data: Record<string, unknown>, metadata: Record<string, unknown>}}
 */
export function ownStill(model, state, drawn) {
  /** @type {Record<string, unknown>} */
  const data = { "text/plain": RUN_AGAIN + " (" + stillCaption(state) + ": its numbers come from the Python kernel.)" };
  /** @type {Record<string, unknown>} */
  const metadata = { contribution_lens: { still: state, drawn_by: drawn ? "browser" : null, widget: model.get("model_ref") } };
  if (drawn) {
    data["image/png"] = drawn.png;
    metadata["image/png"] = { width: drawn.width };
  }
  return { model_id: model.get("model_ref"), data, metadata };
}

/**
 * The still kept current: the view the widget settles on (drawn SETTLE_MS unchanged) is sent to the
 * kernel, which replaces the still through its display id; where no kernel answers (restarted, shut
 * down, or a notebook reopened with its widget state and a new kernel) the widget writes it into its
 * notebook itself (`ownStill`), so the still is the last view drawn in every life of the notebook.
 * @param {WidgetModel} model
 * @param {HTMLElement} root
 * @param {ReturnType<typeof kernelWatch>} kernel
 * @returns {() => void} call after every drawing
 */
function stillKeeper(model, root, kernel) {
  /** @type {ReturnType<typeof setTimeout> | null} */
  let timer = null;
  let sent = "";
  const send = async () => {
    timer = null;
    const status = root.querySelector(".cl-status");
    if (status && status.textContent) return; // not drawn yet
    // Whether a kernel keeps the still is being asked: sent once that is known.
    if (kernel.checking) return void (timer = setTimeout(send, SETTLE_MS));
    const state = viewTraits(model);
    const key = JSON.stringify([state, model.get("meta").key, root.getBoundingClientRect().width, kernel.missing]);
    if (key === sent) return;
    const drawn = state.view === "text" ? null : await drawnImage(root).catch(() => null);
    if (kernel.missing) {
      writeStill(model, ownStill(model, state, drawn), true);
      sent = key;
      return;
    }
    try {
      model.send({ type: "snapshot", state, png: drawn ? drawn.png : null, width: drawn ? drawn.width : null });
      sent = key;
    } catch (error) {
      // A closed comm (the notebook's tab closed, or the kernel gone): nobody keeps this still now.
    }
  };
  return () => {
    if (timer) clearTimeout(timer);
    timer = setTimeout(send, SETTLE_MS);
  };
}

/**
 * Whether a still's metadata `a` (`contribution_lens`) records, drawn, the view `b` records (the order of
 * the settings aside: a saved notebook's keys are sorted).
 * @param {{still?: Record<string, unknown>, drawn_by?: string | null} | undefined} a
 * @param {{still?: Record<string, unknown>, drawn_by?: string | null} | undefined} b
 * @returns {boolean}
 */
function sameView(a, b) {
  if (!a || !b || !a.drawn_by || !a.still || !b.still) return false;
  const [one, other] = [a.still, b.still];
  const names = Object.keys(one);
  return names.length === Object.keys(other).length && names.every((name) => JSON.stringify(one[name]) === JSON.stringify(other[name]));
}

/**
 * The still of this widget written into JupyterLab's notebook model, every output of it (found by `ownOutput`): what the kernel's update of its display id does, for a front-end that
 * did not see the still displayed (a notebook reopened while its kernel runs), whose file kept an older
 * view. True where a still was written; nothing happens elsewhere (no notebook model: the page, VS Code).
 * `keepView`: a still that already shows the same view, drawn, is kept (a widget without a kernel redrawing the
 * view of its still leaves the notebook unchanged).
 * @param {WidgetModel} model
 * @param {{model_id?: string, data?: Record<string, unknown>, metadata?: Record<string, any>}} still
 * @param {boolean} [keepView]
 * @returns {boolean}
 */
export function writeStill(model, still, keepView = false) {
  const manager = model.widget_manager;
  const notebook = manager && manager.context && manager.context.model;
  if (!notebook || !notebook.cells || !still.model_id || !still.data) return false;
  const cells = notebook.cells;
  let written = false;
  for (let c = 0; c < cells.length; c++) {
    const outputs = cells.get(c).outputs;
    if (!outputs) continue;
    for (let i = 0; i < outputs.length; i++) {
      const before = outputs.get(i);
      const metadata = before.metadata || {};
      // The widget's still, by identity (not its circuit's image): wherever it is in the cell.
      const next = i + 1 < outputs.length ? outputs.get(i + 1) : undefined;
      if (!ownOutput(before, next, still.model_id) || metadata.contribution_lens.still === undefined) continue;
      if (JSON.stringify(before.data) === JSON.stringify(still.data)) continue; // already this still
      if (keepView && sameView(metadata.contribution_lens, (still.metadata || {}).contribution_lens)) continue;
      outputs.set(i, { output_type: "display_data", data: still.data, metadata: still.metadata || {} });
      written = true;
    }
  }
  return written;
}

/**
 * One state: the traits of the view last drawn, and a change that cannot be drawn (no kernel answered
 * it) undone back to them, sent to the kernel too (a busy kernel that answers later then draws that view).
 * @param {WidgetModel} model
 * @param {HTMLElement} root
 * @returns {{drawn: () => void, undo: () => boolean}}
 */
export function drawnState(model, root) {
  /** @type {Record<string, unknown> | null} */
  let last = null;
  return {
    drawn() {
      const status = root.querySelector(".cl-status");
      if (status && status.textContent) return; // waiting for a layer: not what is drawn
      last = viewTraits(model);
    },
    undo() {
      if (!last) return false;
      const kept = /** @type {Record<string, unknown>} */ (last);
      const changed = Object.keys(kept).filter((name) => JSON.stringify(model.get(name)) !== JSON.stringify(kept[name]));
      if (!changed.length) return false;
      for (const name of changed) model.set(name, kept[name]);
      try {
        model.save_changes();
      } catch (error) {
        // A closed comm (the kernel is gone): the menus still show the view drawn.
      }
      return true;
    },
  };
}

/**
 * A circuit view's circuit, drawn in its pane beside the inspector: a click on a head sets the widget's view (back
 * to the window it opened on where the query has left the window) and asks the kernel for its why row.
 * @param {WidgetModel} model
 * @param {{circuit: HTMLElement, inspector: HTMLElement}} panes
 * @param {import("./circuit.js").CircuitData} circuit
 * @param {Host} host
 * @param {ReturnType<typeof kernelWatch>} kernel
 */
function liveCircuit(model, panes, circuit, host, kernel) {
  /** @param {Partial<State>} partial */
  const set = (partial) => {
    const shown = model.get("meta").queries || [];
    const back = circuit.window && !shown.includes(partial.query) ? circuit.window : {};
    host.set(Object.assign({}, back, partial));
  };
  const missing = () => (kernel.checking ? null : kernel.missing ? NO_KERNEL_CIRCUIT : "");
  return circuitView(panes.circuit, circuit, { set, why: host.why, missing }, panes.inspector);
}

/**
 * anywidget's entry point: the inspector in `el`, redrawn whenever a trait changes. While the
 * kernel answers, the still before it is hidden and kept current; when it stops answering, a line
 * above the view says so.
 * @param {{model: WidgetModel, el: HTMLElement}} widget
 * @returns {Promise<() => void>} what undoes it
 */
async function render({ model, el }) {
  // A circuit view (circuit_view.py) draws its circuit beside the inspector, which is drawn in its own pane.
  const circuit = /** @type {import("./circuit.js").CircuitData | null} */ (model.get("circuit"));
  const panes = circuit && circuit.figure ? circuitPanes(el) : null;
  const root = panes ? panes.inspector : el;
  const line = element("div", { className: "cl-kernel" }, root);
  /** @type {{refresh: () => Promise<unknown>} | null} */
  let view = null;
  let undone = false;
  const drawn = drawnState(model, root);
  const undo = () => {
    if (drawn.undo()) undone = true;
    line.textContent = kernel.missing ? NO_KERNEL + (undone ? " " + UNDONE : "") : "";
  };
  // The live widget shows the view: its still and a circuit's image, found in its cell by identity, are hidden.
  const hideOwn = () => {
    if (kernel.answered) for (const output of ownOutputs(model, el)) output.style.display = "none";
  };
  const kernel = kernelWatch(model, () => {
    if (!kernel.missing) undone = false;
    line.textContent = kernel.missing ? NO_KERNEL + (undone ? " " + UNDONE : "") : "";
    hideOwn();
    if (view) view.refresh();
  });
  // A pass under way in the kernel (progress.py): which layer it is on, "" once it ends.
  const busy = element("div", { className: "cl-progress" }, root);
  model.on("msg:custom", (message) => {
    if (!message) return;
    if (message.type === "progress") {
      busy.textContent = typeof message.text === "string" ? message.text : "";
    } else if (message.type === "still") {
      writeStill(model, message);
      hideOwn(); // a still written anew is drawn anew
    }
  });
  kernel.check();
  const waiting = element("div", { className: "cl-status", textContent: "waiting for the kernel…" }, root);
  await ensurePlotly(model, kernel);
  waiting.remove();
  const why = whyRows(model, kernel, () => view && view.refresh());
  const host = widgetHost(model, kernel, why, undo);
  view = mount(root, host);
  if (panes && circuit) liveCircuit(model, panes, circuit, host, kernel);
  const settled = stillKeeper(model, root, kernel);
  const redraw = () =>
    /** @type {{refresh: () => Promise<unknown>}} */ (view).refresh().then(() => {
      drawn.drawn();
      settled();
      hideOwn();
    });
  const names = [...settingNames(model.get("meta")), "payload", "meta", "error", "steps"];
  for (const name of names) model.on("change:" + name, redraw);
  await redraw();
  return () => {
    for (const name of names) model.off("change:" + name, redraw);
  };
}

export default { render };
