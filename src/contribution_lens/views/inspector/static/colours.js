// @ts-check
// Plotly's colour scales sampled in the page: the text views colour tokens as the heatmap colours cells.

/** @typedef {import("./types.js").Colorscale} Colorscale */

/**
 * A colour of a plotly colour scale, "rgb(r, g, b)" or "#rrggbb", as [r, g, b].
 * @param {string} colour
 * @returns {number[]}
 */
function rgb(colour) {
  if (colour.startsWith("#")) return [1, 3, 5].map((i) => parseInt(colour.slice(i, i + 2), 16));
  return colour.replace(/[^0-9.,]/g, "").split(",").slice(0, 3).map(Number);
}

/**
 * The colour of a plotly colour scale at t in [0, 1] (clamped; NaN is 0), linear between its stops, as [r, g, b].
 * @param {Colorscale} scale
 * @param {number} t
 * @returns {number[]}
 */
export function colourAt(scale, t) {
  const x = Math.min(1, Math.max(0, Number.isFinite(t) ? t : 0));
  for (let i = 1; i < scale.length; i++) {
    if (x <= scale[i][0] || i === scale.length - 1) {
      const [t0, c0] = scale[i - 1];
      const [t1, c1] = scale[i];
      const f = t1 > t0 ? (x - t0) / (t1 - t0) : 0;
      const a = rgb(c0);
      const b = rgb(c1);
      return a.map((v, k) => Math.round(v + f * (b[k] - v)));
    }
  }
  return rgb(scale[0][1]);
}

/**
 * The colour scale as a CSS gradient, left to right (the legend of a text view).
 * @param {Colorscale} scale
 * @returns {string}
 */
export function gradient(scale) {
  const stops = scale.map(([t]) => "rgb(" + colourAt(scale, t).join(",") + ") " + (100 * t).toFixed(1) + "%");
  return "linear-gradient(to right, " + stops.join(", ") + ")";
}

/**
 * A token's background and its text colour (white on dark, black on light: luma 0.299 r + 0.587 g + 0.114 b < 140).
 * @param {HTMLElement} span
 * @param {number[]} colour [r, g, b]
 */
export function paint(span, colour) {
  const [r, g, b] = colour;
  span.style.background = "rgb(" + r + "," + g + "," + b + ")";
  span.style.color = 0.299 * r + 0.587 * g + 0.114 * b < 140 ? "#fff" : "#000";
}
