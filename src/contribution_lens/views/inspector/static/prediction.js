// @ts-check
// The prediction view: an explained step's direct terms per (layer, head) as a heatmap (a click
// opens that head's per-layer view at the step's position) and per key as the text, coloured,
// with the flow's shares.

import { fmt } from "./captions.js";
import { colourAt, paint } from "./colours.js";
import { element } from "./controls.js";
import { legendCaption, plot } from "./figures.js";
import { escapeToken, shownToken, tokenText } from "./windows.js";

/** @typedef {import("./types.js").Meta} Meta */
/** @typedef {import("./types.js").State} State */
/** @typedef {import("./types.js").View} View */
/** @typedef {import("./types.js").Step} Step */
/** @typedef {import("./types.js").Steps} Steps */

/**
 * What the step explains and how its logit splits, as one sentence.
 * @param {Step} step
 * @param {number} k
 * @param {string[]} labels
 * @returns {string}
 */
function stepCaption(step, k, labels) {
  const p = step.parts;
  return "step " + k + ": " + JSON.stringify(step.token) + ", predicted at position " + step.position + " (the token " +
    // The label's token is already escaped ("\n" as backslash-n): quoted as it is, not escaped twice.
    '"' + tokenText(labels[step.position]) + '"). ' +
    step.quantity + " = " + fmt(step.logit) + " = attention " + fmt(p.attention) + " + MLPs " + fmt(p.mlp) +
    " + embedding " + fmt(p.embedding) + " + biases " + fmt(p.biases) +
    (p.rounding ? " + attention's rounding " + fmt(p.rounding) : "") + " (direct terms; norms' scales frozen)" +
    ownValue(step) + ". Click a head to open its per-layer view at query " + step.position + ".";
}

/**
 * Where the model's own value differs from the float readout the terms add up to, what it computed.
 * @param {Step} step
 * @returns {string}
 */
function ownValue(step) {
  const own = step.model_value;
  if (own === null || own === undefined || fmt(own) === fmt(step.logit)) return "";
  return "; the model computed " + fmt(own) + " in its own precision (rounding gap " + fmt(own - step.logit) + ")";
}

/**
 * The step's direct attention terms as a [layer head] heatmap trace, with its hover text.
 * @param {Meta} meta
 * @param {Step} step
 * @param {Steps["about"]} about
 */
function headsTrace(meta, step, about) {
  const { n_layers: L, n_heads: H, labels } = about;
  const z = [];
  const text = [];
  for (let l = 0; l < L; l++) {
    z.push(Array.from(step.heads.subarray(l * H, (l + 1) * H)));
    text.push(z[l].map((v, h) =>
      "layer " + l + ", head " + h + "<br>direct term " + fmt(v) + " of " + step.quantity + " = " + fmt(step.logit) +
      "<br>click: L" + l + "H" + h + " at query " + labels[step.position]));
  }
  return {
    type: "heatmap",
    x: [...Array(H).keys()].map((h) => "H" + h),
    y: [...Array(L).keys()].map((l) => "L" + l),
    z,
    text,
    hovertemplate: "%{text}<extra></extra>",
    colorscale: meta.colorscales.diverging,
    zmid: 0,
    colorbar: { title: { text: "logit" }, thickness: 14 },
  };
}

/**
 * The explained step of the state: its caption, its terms per head (a click opens the head) and per key.
 * @param {View} view
 * @param {Meta} meta
 * @param {Steps} steps
 * @param {State} state
 */
export function drawPrediction(view, meta, steps, state) {
  const k = Math.min(Math.max(0, state.step ?? 0), steps.steps.length - 1);
  const step = steps.steps[k];
  const { n_layers: L, n_heads: H, labels } = steps.about;
  view.parts.predictionCaption.textContent = stepCaption(step, k, labels);
  const layout = {
    title: { text: "Direct attention terms of " + step.quantity + " per head (step " + k + ")", x: 0.02, xanchor: "left" },
    xaxis: { title: { text: "head" }, type: "category" },
    yaxis: { title: { text: "layer" }, type: "category", autorange: "reversed" },
    width: Math.min(view.drawnWidth, Math.max(420, 46 * H + 260)),
    height: Math.max(360, 20 * L + 150),
    margin: { t: 50, r: 20 },
  };
  const drawn = plot(view.parts.heads, [headsTrace(meta, step, steps.about)], layout, (event) => {
    const point = event.points[0];
    const shown = view.host.state();
    const at = Math.min(Math.max(0, shown.step ?? 0), steps.steps.length - 1);
    if (view.host.open) view.host.open(at, Number(String(point.y).slice(1)), Number(String(point.x).slice(1)));
  });
  drawKeys(view, meta, step, labels);
  return drawn;
}

/**
 * The text up to the explained position, each token coloured by its direct term (summed over
 * layers and heads); the predicted token follows, outlined; the rest of the text is greyed.
 * @param {View} view
 * @param {Meta} meta
 * @param {Step} step
 * @param {string[]} labels
 */
function drawKeys(view, meta, step, labels) {
  const keyText = view.parts.keyText;
  const scale = meta.colorscales.diverging;
  let top = 0;
  for (const v of step.keys) top = Math.max(top, Math.abs(v));
  keyText.innerHTML = "";
  legendCaption(keyText, "Direct attention terms per key, colour ", scale, -top, top, step.rollout ? " · hover: the term and the flow's share" : "");
  const body = element("div", { className: "cl-flow" }, keyText);
  // The text's own next token is the explained one for a generated answer; else it is shown after the position.
  const next = step.position + 1 < labels.length && tokenText(labels[step.position + 1]) === escapeToken(step.token);
  labels.forEach((label, j) => {
    const raw = tokenText(label);
    const span = element("span", { className: "cl-token", textContent: shownToken(raw) }, body);
    span.dataset.position = String(j);
    if (j < step.keys.length) {
      const v = step.keys[j];
      paint(span, colourAt(scale, top > 0 ? (v + top) / (2 * top) : 0.5));
      span.dataset.value = String(v);
      span.title = "key " + label + "\ndirect term " + fmt(v) + " of " + step.quantity +
        (step.rollout ? "\nflow share after the last layer " + fmt(step.rollout[j]) : "");
    } else {
      span.classList.add("cl-future");
      span.title = next && j === step.position + 1 ? "the explained token " + JSON.stringify(step.token) : "after the explained position";
    }
    if (j === step.position) span.classList.add("cl-query");
    if (next && j === step.position + 1) span.classList.add("cl-target");
    if (raw.includes("\\n")) body.appendChild(document.createElement("br"));
    if (!next && j === step.position) {
      const shown = step.token.replaceAll("\n", "↵").replaceAll("\t", "⇥");
      const target = element("span", { className: "cl-target cl-explained", textContent: " → " + shown + " " }, body);
      target.title = "the explained token " + JSON.stringify(step.token) + " (" + step.quantity + ")";
    }
  });
}
