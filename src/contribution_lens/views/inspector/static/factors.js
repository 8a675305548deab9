// @ts-check
// A layer's payload decoded, and the four factors of one view, as the Python side computes them.
//
// The library computes; this module decodes and, per head, multiplies. Each layer's payload holds,
// per displayable (query, key) cell of the token window: attention and the cosine in both scopes
// per head, the value norms ||vt_j^h|| and output norms (||o_i^h|| intra, ||o_i|| inter), and the
// token-level ("all heads") and KV-group factors the library combined. Per head:
//   relative_norm = value_norm / output_norm (0 where output_norm = 0)
//   contribution  = attention * relative_norm * cosine
// Each function here has a Python twin, and the golden test (tests/views/inspector_golden.test.mjs)
// holds the two together: combine = payload.combine_cells, decodeCompact = compact.decode_compact,
// hideSink = plot.hide_sink, viewFactors and shownFactors = figure.view_factors, outsideShares =
// figure.outside_view.

import { bytes, dequantise } from "./codecs.js";
import { cellIndex } from "./windows.js";

/** @typedef {import("./types.js").Meta} Meta */
/** @typedef {import("./types.js").Arrays} Arrays */
/** @typedef {import("./types.js").Decoded} Decoded */
/** @typedef {import("./types.js").Factors} Factors */
/** @typedef {import("./types.js").Numbers} Numbers */
/** @typedef {import("./types.js").State} State */
/** @typedef {import("./types.js").CompactPayload} CompactPayload */
/** @typedef {import("./types.js").Payload} Payload */

/** The per-head arrays [head query] of each query's attention and contribution outside the window (payload.py, OUTSIDE). */
const OUTSIDE = ["outside_attention", "outside_inter", "outside_intra"];

/**
 * A compact page's layer (compact.py, compact_payload) is one zlib stream: inflated once, before decode.
 * @template {Payload} P
 * @param {P} payload
 * @returns {Promise<P>}
 */
export async function inflate(payload) {
  if (!("packed" in payload) || !payload.packed || payload.buffer) return payload;
  const stream = new Blob([bytes(payload.packed)]).stream().pipeThrough(new DecompressionStream("deflate"));
  return Object.assign({}, payload, { buffer: await new Response(stream).arrayBuffer() });
}

/**
 * Heads combined as the library does (payload.py, combine_cells), into a[prefix + name]: for the
 * heads h of each group, attention sum_h a^h / m (m heads), contribution sum_h a^h r^h cos^h, relative
 * norm r and cosine their attention-weighted mean sum_h a^h x^h / sum_h a^h (0 where no head attends),
 * and each query's total contribution summed over the group; one array [group cell] per factor and scope.
 * @param {Pick<Meta, "queries" | "keys" | "scopes">} meta
 * @param {Arrays} a per head: attention, cosine_{scope} [head cell], value_norm [head key],
 *   output_norm_intra [head query], output_norm_inter [query], total_{scope} [head query]
 * @param {Int32Array} index
 * @param {number} cells
 * @param {number[][]} groups the heads of each group
 * @param {string} prefix "all_" or "group_"
 */
export function combine(meta, a, index, cells, groups, prefix) {
  const nq = meta.queries.length;
  const nk = meta.keys.length;
  const G = groups.length;
  a[prefix + "attention"] = new Float64Array(G * cells);
  for (const scope of meta.scopes) {
    for (const f of ["relative_norm", "cosine", "contribution"]) a[prefix + f + "_" + scope] = new Float64Array(G * cells);
    a[prefix + "total_" + scope] = new Float64Array(G * nq);
  }
  groups.forEach((heads, g) => {
    for (let qi = 0; qi < nq; qi++) {
      for (const scope of meta.scopes) {
        let total = 0;
        for (const h of heads) total += a["total_" + scope][h * nq + qi];
        a[prefix + "total_" + scope][g * nq + qi] = total;
      }
      for (let ki = 0; ki < nk; ki++) {
        const c = index[qi * nk + ki];
        if (c >= 0) combineCell(meta, a, { qi, ki, c, g, cells }, heads, prefix);
      }
    }
  });
}

/**
 * One cell (query qi, key ki, cell c) of group g in `combine`.
 * @param {Pick<Meta, "queries" | "keys" | "scopes">} meta
 * @param {Arrays} a
 * @param {{qi: number, ki: number, c: number, g: number, cells: number}} at
 * @param {number[]} heads
 * @param {string} prefix
 */
function combineCell(meta, a, at, heads, prefix) {
  const { qi, ki, c, g, cells } = at;
  const nq = meta.queries.length;
  const nk = meta.keys.length;
  let sa = 0;
  for (const h of heads) sa += a.attention[h * cells + c];
  a[prefix + "attention"][g * cells + c] = sa / heads.length;
  for (const scope of meta.scopes) {
    let rnSum = 0;
    let cosSum = 0;
    let contribution = 0;
    for (const h of heads) {
      const o = scope === "intra" ? a.output_norm_intra[h * nq + qi] : a.output_norm_inter[qi];
      const rn = o > 0 ? a.value_norm[h * nk + ki] / o : 0;
      const at = a.attention[h * cells + c];
      const cos = a["cosine_" + scope][h * cells + c];
      rnSum += at * rn;
      cosSum += at * cos;
      contribution += at * rn * cos;
    }
    a[prefix + "relative_norm_" + scope][g * cells + c] = sa > 0 ? rnSum / sa : 0;
    a[prefix + "cosine_" + scope][g * cells + c] = sa > 0 ? cosSum / sa : 0;
    a[prefix + "contribution_" + scope][g * cells + c] = contribution;
  }
}

/**
 * The cosines of every cell of a compact layer: cos_ij = (s_i q_i) . (s_j k_j), with q the int8 unit
 * vector of query i in the scope, k that of key j (shared by both scopes) and s their scales.
 * @param {Pick<Meta, "queries" | "keys" | "n_heads">} meta
 * @param {Arrays} raw the layout's arrays: query_{scope}_vectors [head query d_head], key_vectors
 *   [head key d_head], and their scales [head query], [head key]
 * @param {string} scope
 * @param {{index: Int32Array, cells: number, d_head: number}} at
 * @returns {Float64Array} [head cell]
 */
export function compactCosines(meta, raw, scope, at) {
  const { index, cells, d_head: D } = at;
  const H = meta.n_heads;
  const nq = meta.queries.length;
  const nk = meta.keys.length;
  const kv = raw.key_vectors;
  const ks = raw.key_scales;
  const qv = raw["query_" + scope + "_vectors"];
  const qs = raw["query_" + scope + "_scales"];
  const cos = new Float64Array(H * cells);
  for (let h = 0; h < H; h++) {
    for (let qi = 0; qi < nq; qi++) {
      const q0 = (h * nq + qi) * D;
      for (let ki = 0; ki < nk; ki++) {
        const c = index[qi * nk + ki];
        if (c < 0) continue;
        const k0 = (h * nk + ki) * D;
        let dot = 0;
        for (let r = 0; r < D; r++) dot += qv[q0 + r] * kv[k0 + r];
        cos[h * cells + c] = dot * qs[h * nq + qi] * ks[h * nk + ki];
      }
    }
  }
  return cos;
}

/**
 * The arrays of a compact layer (compact.py, decode_compact): attention in one byte, each cell's
 * cosines from the unit vectors (`compactCosines`), then the combined heads (`combine`).
 * @param {Meta} meta
 * @param {CompactPayload} payload inflated (`inflate`)
 * @param {Int32Array} index
 * @param {number} cells
 * @returns {Arrays}
 */
export function decodeCompact(meta, payload, index, cells) {
  const buffer = /** @type {ArrayBuffer} */ (payload.buffer);
  /** @type {Arrays} */
  const raw = {};
  for (const [name, [codec, offset, length]] of Object.entries(payload.layout)) {
    raw[name] = dequantise(buffer.slice(offset, offset + length), meta.codecs[codec]);
  }
  /** @type {Arrays} */
  const a = {};
  const kept = ["attention", "value_norm", "output_norm_intra", "output_norm_inter", "total_inter", "total_intra"];
  for (const name of kept.concat(OUTSIDE)) a[name] = raw[name];
  for (const scope of meta.scopes) a["cosine_" + scope] = compactCosines(meta, raw, scope, { index, cells, d_head: payload.d_head });
  combine(meta, a, index, cells, [[...Array(meta.n_heads).keys()]], "all_");
  const groups = payload.kv_groups || meta.kv_groups;
  if (groups && groups.some((heads) => heads.length > 1)) combine(meta, a, index, cells, groups, "group_");
  return a;
}

/**
 * A layer's payload, decoded: a fine one array by array, a compact one (inflated) by `decodeCompact`.
 * @param {Meta} meta
 * @param {Payload} payload
 * @returns {Decoded}
 */
export function decode(meta, payload) {
  const { index, cells } = cellIndex(meta);
  /** @type {Arrays} */
  let arrays = {};
  if ("layout" in payload && payload.layout) {
    const compact = /** @type {CompactPayload} */ (payload);
    if (!compact.buffer) throw new Error("a compact layer must be inflated (inflate) before decode");
    arrays = decodeCompact(meta, compact, index, cells);
  } else {
    const fine = /** @type {import("./types.js").FinePayload} */ (payload);
    // Each array is decoded when a view first reads it: a view of all heads never decodes the per-head cosines.
    for (const [name, codec] of Object.entries(fine.codecs)) {
      /** @type {import("./types.js").Numbers | null} */
      let value = null;
      Object.defineProperty(arrays, name, {
        enumerable: true,
        get: () => value || (value = dequantise(fine[name], meta.codecs[codec])),
        set: (/** @type {import("./types.js").Numbers} */ v) => (value = v),
      });
    }
  }
  return { index, cells, H: meta.n_heads, arrays };
}

/**
 * The KV group (meta kv_groups) head h belongs to.
 * @param {Pick<Meta, "kv_groups">} meta
 * @param {number} h
 * @returns {number}
 */
export function groupOf(meta, h) {
  return Math.max(0, meta.kv_groups.findIndex((heads) => heads.includes(h)));
}

/**
 * Shares without the sink, renormalised as plot.hide_sink does: x'_ij = x_ij S_i / (S_i - x_i0)
 * for attention (S_i = 1) and contribution (S_i the query's total over all its keys, sent as
 * total_*), the sink's own cell NaN, a row with nothing but the sink (|S_i - x_i0| <= 1e-6 max(1, |S_i|))
 * NaN. Relative norm and cosine are properties of a key, not shares: they stay as they are.
 * @param {Pick<Meta, "queries" | "keys">} meta
 * @param {Pick<Decoded, "index" | "cells">} d
 * @param {Factors} f
 * @param {ArrayLike<number>} totals S_i per query
 * @returns {Factors}
 */
export function hideSink(meta, d, f, totals) {
  const nq = meta.queries.length;
  const nk = meta.keys.length;
  const out = Object.assign({}, f);
  /** @type {Array<["attention" | "contribution", (qi: number) => number]>} */
  const shared = [["attention", () => 1], ["contribution", (qi) => totals[qi]]];
  for (const [name, total] of shared) {
    const shares = new Float64Array(d.cells);
    for (let qi = 0; qi < nq; qi++) {
      const sink = meta.keys[0] === 0 ? d.index[qi * nk] : -1;
      const S = total(qi);
      const rest = S - (sink >= 0 ? f[name][sink] : 0);
      const empty = Math.abs(rest) <= 1e-6 * Math.max(1, Math.abs(S));
      for (let ki = 0; ki < nk; ki++) {
        const c = d.index[qi * nk + ki];
        if (c >= 0) shares[c] = c === sink || empty ? NaN : (f[name][c] * S) / rest;
      }
    }
    out[name] = shares;
  }
  return out;
}

/**
 * The four factors of one head (h >= 0) or of all heads (h < 0), one scope, per cell; with
 * group = true, h is a KV group and its heads are combined (payload group_*; a group of one head
 * is that head). Per head: relative_norm = value_norm / output_norm, contribution = a r cos.
 * @param {Pick<Meta, "queries" | "keys" | "kv_groups">} meta
 * @param {Decoded} d
 * @param {number} h
 * @param {string} scope
 * @param {boolean} [group]
 * @returns {Factors}
 */
export function viewFactors(meta, d, h, scope, group = false) {
  const a = d.arrays;
  const C = d.cells;
  if (group && a.group_attention) {
    const take = (/** @type {string} */ name) => a[name].subarray(h * C, (h + 1) * C);
    return { attention: take("group_attention"), relative_norm: take("group_relative_norm_" + scope),
             cosine: take("group_cosine_" + scope), contribution: take("group_contribution_" + scope) };
  }
  if (group) h = meta.kv_groups[h][0];
  if (h < 0) {
    return { attention: a.all_attention, relative_norm: a["all_relative_norm_" + scope], cosine: a["all_cosine_" + scope],
             contribution: a["all_contribution_" + scope] };
  }
  const nq = meta.queries.length;
  const nk = meta.keys.length;
  const out = { attention: a.attention.subarray(h * C, (h + 1) * C), relative_norm: new Float64Array(C),
                cosine: a["cosine_" + scope].subarray(h * C, (h + 1) * C), contribution: new Float64Array(C) };
  for (let qi = 0; qi < nq; qi++) {
    const o = scope === "intra" ? a.output_norm_intra[h * nq + qi] : a.output_norm_inter[qi];
    for (let ki = 0; ki < nk; ki++) {
      const c = d.index[qi * nk + ki];
      if (c < 0) continue;
      const rn = o > 0 ? a.value_norm[h * nk + ki] / o : 0;
      out.relative_norm[c] = rn;
      out.contribution[c] = out.attention[c] * rn * out.cosine[c];
    }
  }
  return out;
}

/**
 * What a view shows: all heads, one head, or (group_kv) the KV group of the head.
 * @param {Pick<Meta, "kv_groups">} meta
 * @param {Pick<State, "head" | "group_kv">} state
 * @returns {{kind: "all" | "group" | "head", index: number}}
 */
export function viewLevel(meta, state) {
  if (state.head === "all") return { kind: "all", index: -1 };
  if (state.group_kv && meta.kv_groups) return { kind: "group", index: groupOf(meta, state.head) };
  return { kind: "head", index: state.head };
}

/**
 * Each query's total contribution over all its keys (S_i of `hideSink`) for the view's level.
 * @param {Pick<Meta, "queries" | "kv_groups">} meta
 * @param {Decoded} d
 * @param {{kind: "all" | "group" | "head", index: number}} level
 * @param {string} scope
 * @returns {Numbers}
 */
export function rowTotals(meta, d, level, scope) {
  const a = d.arrays;
  const nq = meta.queries.length;
  const { kind, index } = level;
  if (kind === "all") return a["all_total_" + scope];
  if (kind === "group" && a["group_total_" + scope]) return a["group_total_" + scope].subarray(index * nq, (index + 1) * nq);
  const head = kind === "group" ? meta.kv_groups[index][0] : index;
  return a["total_" + scope].subarray(head * nq, (head + 1) * nq);
}

/**
 * The factors a view draws (figure.py, view_factors): its level's (`viewFactors`), the sink hidden
 * where the state says so (`hideSink`, with the level's row totals).
 * @param {Meta} meta
 * @param {Decoded} d
 * @param {Pick<State, "head" | "group_kv" | "hide_sink">} state
 * @param {string} scope
 * @returns {Factors}
 */
export function shownFactors(meta, d, state, scope) {
  const level = viewLevel(meta, state);
  const f = viewFactors(meta, d, level.index, scope, level.kind === "group");
  return state.hide_sink ? hideSink(meta, d, f, rowTotals(meta, d, level, scope)) : f;
}

/**
 * Each query's attention and contribution on the keys outside the window, for the view's heads H
 * (figure.py, outside_view): attention sum_{h in H} A_i^h / |H|, contribution sum_{h in H} C_i^h, from
 * the payload's per-head outside_attention and outside_{scope} [head query]; with the sink hidden,
 * x' = x S_i / (S_i - x_i0) as `hideSink` does (S_i 1 for attention, the row total for contribution,
 * x_i0 the sink's cell of the view), NaN where nothing but the sink is left.
 * @param {Meta} meta
 * @param {Decoded} d
 * @param {Pick<State, "head" | "group_kv" | "hide_sink">} state
 * @param {string} scope
 * @returns {{attention: Float64Array, contribution: Float64Array}}
 */
export function outsideShares(meta, d, state, scope) {
  const a = d.arrays;
  const nq = meta.queries.length;
  const nk = meta.keys.length;
  const level = viewLevel(meta, state);
  const heads = level.kind === "all" ? [...Array(meta.n_heads).keys()]
    : level.kind === "group" && a.group_attention ? meta.kv_groups[level.index]
    : [level.kind === "group" ? meta.kv_groups[level.index][0] : level.index];
  const out = { attention: new Float64Array(nq), contribution: new Float64Array(nq) };
  for (let qi = 0; qi < nq; qi++) {
    for (const h of heads) {
      out.attention[qi] += a.outside_attention[h * nq + qi];
      out.contribution[qi] += a["outside_" + scope][h * nq + qi];
    }
    out.attention[qi] /= heads.length;
  }
  if (!state.hide_sink || meta.keys[0] !== 0) return out;
  const f = viewFactors(meta, d, level.index, scope, level.kind === "group");
  const totals = rowTotals(meta, d, level, scope);
  for (const [name, total] of /** @type {Array<["attention" | "contribution", (qi: number) => number]>} */ (
    [["attention", () => 1], ["contribution", (qi) => totals[qi]]])) {
    for (let qi = 0; qi < nq; qi++) {
      const S = total(qi);
      const left = S - f[name][d.index[qi * nk]];
      out[name][qi] = Math.abs(left) <= 1e-6 * Math.max(Math.abs(S), 1) ? NaN : (out[name][qi] * S) / left;
    }
  }
  return out;
}
