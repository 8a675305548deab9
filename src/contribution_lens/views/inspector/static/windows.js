// @ts-check
// The token window and its labels, as windows.py makes them: the widget's window menu
// (`windowStarts`, windows.py's window_starts), the displayable cells (`cellIndex`, Window.mask)
// and the tokens of "position:token" labels (`escapeToken`, token_label's escapes).

/** @typedef {import("./types.js").Meta} Meta */

/**
 * The half-overlapping windows of `size` queries over `n` tokens, as [first, last] query: starts
 * step by max(1, floor(size / 2)) and stop at the first window reaching the text's end; the
 * window shown (starting at `current`) is offered too, sorted in.
 * @param {number} n
 * @param {number} size
 * @param {number} current
 * @returns {Array<[number, number]>}
 */
export function windowStarts(n, size, current) {
  /** @type {Array<[number, number]>} */
  const starts = [];
  for (let start = 0; start < n; start += Math.max(1, Math.floor(size / 2))) {
    starts.push([start, Math.min(n, start + size) - 1]);
    if (start + size >= n) break;
  }
  if (!starts.some(([s]) => s === current)) starts.push([current, Math.min(n, current + size) - 1]);
  return starts.sort((a, b) => a[0] - b[0]);
}

/**
 * Index of each displayable cell in the packed arrays, -1 elsewhere: [query][key] row-major, a
 * cell displayable where the key is not after the query (or always, for an encoder).
 * @param {Pick<Meta, "queries" | "keys" | "causal">} meta
 * @returns {{index: Int32Array, cells: number}}
 */
export function cellIndex(meta) {
  const nq = meta.queries.length;
  const nk = meta.keys.length;
  const index = new Int32Array(nq * nk).fill(-1);
  let c = 0;
  for (let qi = 0; qi < nq; qi++) {
    for (let ki = 0; ki < nk; ki++) {
      if (!meta.causal || meta.keys[ki] <= meta.queries[qi]) index[qi * nk + ki] = c++;
    }
  }
  return { index, cells: c };
}

/**
 * A label "position:token" back to the token as written (line breaks and tabs escaped).
 * @param {string} label
 * @returns {string}
 */
export function tokenText(label) {
  return label.slice(label.indexOf(":") + 1);
}

/**
 * A token as its label writes it: line breaks and tabs as \n, \r, \t (windows.py, token_label).
 * @param {string} token
 * @returns {string}
 */
export function escapeToken(token) {
  return token.replaceAll("\n", "\\n").replaceAll("\r", "\\r").replaceAll("\t", "\\t");
}

/**
 * A token (as written in a label) as the text views show it: ↵ for a line break, ⇥ for a tab.
 * @param {string} written
 * @returns {string}
 */
export function shownToken(written) {
  return written.replaceAll("\\n", "↵").replaceAll("\\t", "⇥");
}
