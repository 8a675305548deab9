// @ts-check
// What the inspector writes: factor names, numbers to 4 digits, a view's title and a cell's hover text.

import { viewLevel } from "./factors.js";

/** @typedef {import("./types.js").Meta} Meta */
/** @typedef {import("./types.js").State} State */
/** @typedef {import("./types.js").BothScopes} BothScopes */

/** Each factor as the inspector names it. */
export const LABELS = /** @type {Record<string, string>} */ ({
  attention: "attention",
  relative_norm: "relative norm",
  cosine: "cosine",
  contribution: "contribution",
});

/** A character's width in em, an upper bound for sans-serif text (digits and most letters are 0.5 to 0.56 em). */
const EM_PER_CHAR = 0.6;
/** A title line's height in em. */
const LINE_EM = 1.3;

/**
 * A plotly title (its pseudo-HTML: <br>, <span style='font-size: Npx'>) wrapped to `width` px: plotly
 * draws each line whole, so a line longer than the figure is cut at its edge. A break goes at the last
 * space before a line would pass `width`; text inside a font-size span is measured at its size.
 * @param {string} text
 * @param {number} width
 * @param {number} size the title's font size, px
 * @returns {{text: string, height: number, lines: number}} the text, its height in px and its lines
 */
export function wrapTitle(text, width, size) {
  const fonts = [size];
  let out = "";
  let used = 0;
  let space = -1; // where the current line's last space is in `out`
  let afterSpace = 0; // the width used after that space
  let lineFont = size;
  let height = 0;
  let lines = 1;
  const newLine = () => {
    height += LINE_EM * lineFont;
    lines += 1;
    lineFont = fonts[fonts.length - 1];
  };
  for (const part of text.split(/(<[^>]*>)/)) {
    if (part.startsWith("<")) {
      const sized = /font-size:\s*(\d+(?:\.\d+)?)px/.exec(part);
      if (/^<br\s*\/?>$/i.test(part)) {
        newLine();
        used = 0;
        space = -1;
      } else if (/^<span/i.test(part)) {
        fonts.push(sized ? Number(sized[1]) : fonts[fonts.length - 1]);
        if (used === 0) lineFont = fonts[fonts.length - 1];
      } else if (/^<\/span/i.test(part) && fonts.length > 1) {
        fonts.pop();
      }
      out += part;
      continue;
    }
    for (const char of part) {
      const w = EM_PER_CHAR * fonts[fonts.length - 1];
      if (used + w > width && space >= 0 && char !== " ") {
        out = out.slice(0, space) + "<br>" + out.slice(space + 1);
        newLine();
        used = afterSpace;
        space = -1;
      }
      if (char === " ") {
        space = out.length;
        afterSpace = 0;
      } else {
        afterSpace += w;
      }
      out += char;
      used += w;
    }
  }
  height += LINE_EM * lineFont;
  return { text: out, height: Math.ceil(height), lines };
}

/**
 * A number to 4 significant digits, without trailing zeros.
 * @param {number} x
 * @returns {string}
 */
export const fmt = (x) => Number(x.toPrecision(4)).toString();

/**
 * A head as the menus and titles name it.
 * @param {Pick<Meta, "head_labels">} meta
 * @param {number} h
 * @returns {string}
 */
export function headLabel(meta, h) {
  return meta.head_labels ? meta.head_labels[h] : "head " + h;
}

/**
 * Where the view looks: "L3, all heads", "L3 head 2" or "L3 KV group 1 (heads 2, 3)", and whether the sink is hidden.
 * @param {Meta} meta
 * @param {State} state
 * @returns {string}
 */
export function where(meta, state) {
  const { kind, index } = viewLevel(meta, state);
  const shown = kind === "all" ? ", all heads"
    : kind === "group" ? " KV group " + index + " (heads " + meta.kv_groups[index].join(", ") + ")"
    : " " + headLabel(meta, /** @type {number} */ (state.head));
  return "L" + state.layer + shown + (state.hide_sink ? ", sink hidden" : "");
}

/**
 * The heatmap's title: the factor, its scope (attention has none) and `where`.
 * @param {Meta} meta
 * @param {State} state
 * @returns {string}
 */
export function title(meta, state) {
  const scopeText = state.factor === "attention" ? "" : " (" + state.scope + ")";
  return LABELS[state.factor] + scopeText + ", " + where(meta, state);
}

/**
 * The heatmap's title: `title`, and for the summed intra contribution of several heads what its numbers are.
 * @param {Meta} meta
 * @param {State} state
 * @returns {string}
 */
export function heatmapTitle(meta, state) {
  const { kind, index } = viewLevel(meta, state);
  const m = kind === "all" ? meta.n_heads : kind === "group" ? meta.kv_groups[index].length : 1;
  if (m === 1 || state.factor !== "contribution" || state.scope !== "intra") return title(meta, state);
  return title(meta, state) + "<br><span style='font-size: 11px'>the sum over " + m + " heads of each head's share " +
    "of its own output<br>(each head's row sums to 1, so a row sums to " + m + "): not a share of the layer's output</span>";
}

/**
 * What the bars of one query show, true for the view's level: per head the product of the three
 * factors is the contribution; for several heads, how each factor is aggregated, and that their
 * product is not the contribution.
 * @param {Meta} meta
 * @param {State} state
 * @param {string} qLabel
 * @returns {string}
 */
export function barsTitle(meta, state, qLabel) {
  const { kind, index } = viewLevel(meta, state);
  const head = "query " + qLabel + ": per-key factors (" + state.scope + ", " + where(meta, state) + ")";
  const m = kind === "all" ? meta.n_heads : kind === "group" ? meta.kv_groups[index].length : 1;
  if (m === 1) return head + ": attention × relative norm × cosine = contribution";
  // Two short lines, not one long one: a title does not wrap, and an 800 px output would cut it off.
  return head + "<br><span style='font-size: 11px'>attention: mean over the " + m + " heads; relative norm, cosine: " +
    "their attention-weighted means;<br>contribution: sum over the heads (not the product of the three)</span>";
}

/**
 * The outside column's hover: query, the keys outside the window and the row's share on them.
 * @param {{intra: import("./types.js").Outside, inter: import("./types.js").Outside}} outside
 * @param {number} qi
 * @param {string} qLabel
 * @param {string} label the keys, "outside 1–671"
 * @returns {string}
 */
export function hoverOutside(outside, qi, qLabel, label) {
  return (
    "query " + qLabel + "<br>keys " + label.replace(/^outside /, "") + " (outside the window)" +
    "<br>attention " + fmt(outside.inter.attention[qi]) +
    "<br>contribution intra " + fmt(outside.intra.contribution[qi]) + ", inter " + fmt(outside.inter.contribution[qi])
  );
}

/**
 * Query and key labels and all four numbers in both scopes (attention has no scope), of cell c.
 * @param {number} c
 * @param {BothScopes} both
 * @param {string} qLabel
 * @param {string} kLabel
 * @returns {string}
 */
export function hoverCell(c, both, qLabel, kLabel) {
  return (
    "query " + qLabel + "<br>key " + kLabel +
    "<br>attention " + fmt(both.inter.attention[c]) +
    "<br>relative norm intra " + fmt(both.intra.relative_norm[c]) + ", inter " + fmt(both.inter.relative_norm[c]) +
    "<br>cosine intra " + fmt(both.intra.cosine[c]) + ", inter " + fmt(both.inter.cosine[c]) +
    "<br>contribution intra " + fmt(both.intra.contribution[c]) + ", inter " + fmt(both.inter.contribution[c])
  );
}

/**
 * The hover text of every cell, [query][key] ("" where the cell is not displayable).
 * @param {Int32Array} index
 * @param {BothScopes} both
 * @param {string[]} qLabels
 * @param {string[]} kLabels
 * @returns {string[][]}
 */
export function hoverText(index, both, qLabels, kLabels) {
  const nk = kLabels.length;
  return qLabels.map((qLabel, qi) => {
    const row = new Array(nk).fill("");
    for (let ki = 0; ki < nk; ki++) {
      const c = index[qi * nk + ki];
      if (c >= 0) row[ki] = hoverCell(c, both, qLabel, kLabels[ki]);
    }
    return row;
  });
}

/**
 * The view a still shows, in words (still.py's caption): the state as the kernel holds it (head -1: all heads).
 * @param {Record<string, any>} state
 * @returns {string}
 */
export function stillCaption(state) {
  if (state.view === "prediction") return "prediction view, step " + Math.max(0, state.step);
  const head = state.head < 0 ? "all heads" : "head " + state.head;
  const shown = state.view === "text" ? "text view, " : "";
  return shown + "L" + state.layer + ", " + head + ", " + state.factor + " (" + state.scope + "), query " + state.query;
}
