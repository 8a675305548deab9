// contribution-lens inspector: one ES module for the static page (`page`) and the Jupyter widget
// (`render`, anywidget's entry point).
//
// The library computes; this module decodes and, per head, multiplies. Each layer's payload holds,
// per displayable (query, key) cell of the token window: attention and the cosine in both scopes
// per head, the value norms ||vt_j^h|| and output norms (||o_i^h|| intra, ||o_i|| inter), and the
// token-level ("all heads") factors the library combined. How each array is coded (payload.codecs
// naming entries of meta.codecs) and the colour scales come with the data. Per head:
//   relative_norm = value_norm / output_norm (0 where output_norm = 0)
//   contribution  = attention * relative_norm * cosine
// Every element is found inside the inspector's own root: several inspectors live on one page.

function bytes(b64) {
  const text = atob(b64);
  const out = new Uint8Array(text.length);
  for (let i = 0; i < text.length; i++) out[i] = text.charCodeAt(i);
  return out.buffer;
}

function half(h) {
  const sign = h & 0x8000 ? -1 : 1;
  const exponent = (h >> 10) & 0x1f;
  const fraction = h & 0x3ff;
  if (exponent === 0) return sign * 2 ** -14 * (fraction / 1024);
  if (exponent === 31) return fraction ? NaN : sign * Infinity;
  return sign * 2 ** (exponent - 15) * (1 + fraction / 1024);
}

// One payload array (base64, or the bytes themselves) back to numbers, as its codec says (payload.py, CODECS).
function dequantise(data, codec) {
  const buffer = typeof data === "string" ? bytes(data) : data;
  if (codec.kind === "float32") return new Float32Array(buffer);
  const codes = codec.dtype === "uint8" ? new Uint8Array(buffer) : codec.dtype === "int8" ? new Int8Array(buffer) : new Uint16Array(buffer);
  if (codec.kind === "int8") return codes;
  if (codec.kind === "float16") return Float64Array.from(codes, half);
  const values = new Float64Array(codes.length);
  if (codec.kind === "sqrt") {
    for (let i = 0; i < codes.length; i++) {
      const s = codes[i] / codec.levels;
      values[i] = s * s;
    }
  } else if (codec.kind === "linear") {
    for (let i = 0; i < codes.length; i++) values[i] = (codes[i] - codec.offset) / codec.levels;
  } else {
    throw new Error("unknown codec " + codec.kind);
  }
  return values;
}

// Index of each displayable cell in the packed arrays, -1 elsewhere: [query][key] row-major.
function cellIndex(meta) {
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

// A compact page's layer (payload.py, compact_payload) is one zlib stream: inflated once, before decode.
export async function inflate(payload) {
  if (!payload.packed || payload.buffer) return payload;
  const stream = new Blob([bytes(payload.packed)]).stream().pipeThrough(new DecompressionStream("deflate"));
  return Object.assign({}, payload, { buffer: await new Response(stream).arrayBuffer() });
}

// Heads combined as the library does (payload.py, combine_cells): attention averaged, contribution
// summed, relative norm and cosine attention-weighted; one array [group cell] per factor and scope.
function combine(meta, a, index, cells, groups, prefix) {
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
        if (c < 0) continue;
        let sa = 0;
        for (const h of heads) sa += a.attention[h * cells + c];
        a[prefix + "attention"][g * cells + c] = sa / heads.length;
        for (const scope of meta.scopes) {
          let rnSum = 0, cosSum = 0, contribution = 0;
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
    }
  });
}

// The arrays of a compact layer: each cell's cosines are dot products of the int8 unit vectors
// (query side per scope, key side shared), times their scales; then the combined heads.
function decodeCompact(meta, payload, index, cells) {
  const raw = {};
  for (const [name, [codec, offset, length]] of Object.entries(payload.layout)) {
    raw[name] = dequantise(payload.buffer.slice(offset, offset + length), meta.codecs[codec]);
  }
  const a = {};
  for (const name of ["attention", "value_norm", "output_norm_intra", "output_norm_inter", "total_inter", "total_intra"]) a[name] = raw[name];
  const H = meta.n_heads;
  const nq = meta.queries.length;
  const nk = meta.keys.length;
  const D = payload.d_head;
  const kv = raw.key_vectors;
  const ks = raw.key_scales;
  for (const scope of meta.scopes) {
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
    a["cosine_" + scope] = cos;
  }
  combine(meta, a, index, cells, [[...Array(H).keys()]], "all_");
  const groups = payload.kv_groups || meta.kv_groups;
  if (groups && groups.some((heads) => heads.length > 1)) combine(meta, a, index, cells, groups, "group_");
  return a;
}

export function decode(meta, payload) {
  const { index, cells } = cellIndex(meta);
  let arrays = {};
  if (payload.layout) {
    if (!payload.buffer) throw new Error("a compact layer must be inflated (inflate) before decode");
    arrays = decodeCompact(meta, payload, index, cells);
  } else {
    for (const [name, codec] of Object.entries(payload.codecs)) arrays[name] = dequantise(payload[name], meta.codecs[codec]);
  }
  return { index, cells, H: meta.n_heads, arrays };
}

// The KV group (payload kv_groups) head h belongs to.
export function groupOf(meta, h) {
  return Math.max(0, meta.kv_groups.findIndex((heads) => heads.includes(h)));
}

// Shares without the sink, renormalised as payload.hide_sink does: x'_ij = x_ij S_i / (S_i - x_i0)
// for attention (S_i = 1) and contribution (S_i the query's total over all its keys, sent as
// total_*), the sink's own cell NaN, a row with nothing but the sink NaN. Relative norm and
// cosine are properties of a key, not shares: they stay as they are.
export function hideSink(meta, d, f, totals) {
  const nq = meta.queries.length;
  const nk = meta.keys.length;
  const out = Object.assign({}, f);
  for (const [name, total] of [["attention", () => 1], ["contribution", (qi) => totals[qi]]]) {
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

// The four factors of one head (h >= 0) or of all heads (h < 0), one scope, per cell; with
// group = true, h is a KV group and its heads are combined (payload group_*; a group of one head
// is that head).
export function viewFactors(meta, d, h, scope, group = false) {
  const a = d.arrays;
  if (group && a.group_attention) {
    const C = d.cells;
    const take = (name) => a[name].subarray(h * C, (h + 1) * C);
    return {
      attention: take("group_attention"),
      relative_norm: take("group_relative_norm_" + scope),
      cosine: take("group_cosine_" + scope),
      contribution: take("group_contribution_" + scope),
    };
  }
  if (group) h = meta.kv_groups[h][0];
  if (h < 0) {
    return {
      attention: a.all_attention,
      relative_norm: a["all_relative_norm_" + scope],
      cosine: a["all_cosine_" + scope],
      contribution: a["all_contribution_" + scope],
    };
  }
  const nq = meta.queries.length;
  const nk = meta.keys.length;
  const C = d.cells;
  const out = {
    attention: a.attention.subarray(h * C, (h + 1) * C),
    relative_norm: new Float64Array(C),
    cosine: a["cosine_" + scope].subarray(h * C, (h + 1) * C),
    contribution: new Float64Array(C),
  };
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

const LABELS = { attention: "attention", relative_norm: "relative norm", cosine: "cosine", contribution: "contribution" };
const fmt = (x) => Number(x.toPrecision(4)).toString();

// Query and key labels and all four numbers in both scopes (attention has no scope), of cell c.
function hoverCell(c, both, qLabel, kLabel) {
  return (
    "query " + qLabel + "<br>key " + kLabel +
    "<br>attention " + fmt(both.inter.attention[c]) +
    "<br>relative norm intra " + fmt(both.intra.relative_norm[c]) + ", inter " + fmt(both.inter.relative_norm[c]) +
    "<br>cosine intra " + fmt(both.intra.cosine[c]) + ", inter " + fmt(both.inter.cosine[c]) +
    "<br>contribution intra " + fmt(both.intra.contribution[c]) + ", inter " + fmt(both.inter.contribution[c])
  );
}

// The hover text of every cell, [query][key] ("" where the cell is not displayable).
function hoverText(index, both, qLabels, kLabels) {
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

// --- the view -------------------------------------------------------------------------------

function element(tag, attrs, parent) {
  const node = document.createElement(tag);
  Object.assign(node, attrs);
  if (parent) parent.appendChild(node);
  return node;
}

function select(parent, name, onChange) {
  const label = element("label", { className: "cl-control" }, parent);
  label.appendChild(document.createTextNode(name + " "));
  const node = element("select", { className: "cl-select" }, label);
  node.dataset.control = name;
  node.addEventListener("change", () => onChange(node.value));
  return node;
}

function checkbox(parent, name, text, onChange) {
  const label = element("label", { className: "cl-control" }, parent);
  const node = element("input", { type: "checkbox", className: "cl-check" }, label);
  node.dataset.control = name;
  label.appendChild(document.createTextNode(" " + text));
  node.addEventListener("change", () => onChange(node.checked));
  return node;
}

// The menu holds `options` and shows `value`; the caller passes a value the options hold (another
// would blank the menu).
function setOptions(node, options, value) {
  const key = JSON.stringify(options);
  if (node.dataset.options !== key) {
    node.innerHTML = "";
    for (const [v, text] of options) element("option", { value: String(v), textContent: text }, node);
    node.dataset.options = key;
  }
  node.value = String(value);
}

// The colour of a plotly colour scale ([[t, "rgb(r, g, b)" or "#rrggbb"], ...]) at t in [0, 1], as [r, g, b].
function rgb(colour) {
  if (colour.startsWith("#")) return [1, 3, 5].map((i) => parseInt(colour.slice(i, i + 2), 16));
  return colour.replace(/[^0-9.,]/g, "").split(",").slice(0, 3).map(Number);
}

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

// A label "position:token" back to the token as written (line breaks and tabs were escaped).
function tokenText(label) {
  return label.slice(label.indexOf(":") + 1);
}

const VIEWS = [
  ["heatmap", "heatmap"],
  ["text", "text"],
  ["prediction", "prediction"],
];
const TOGGLES = [
  ["hide_sink", "hide sink"],
  ["group_kv", "group KV heads"],
];

// The explained predictions (payload.py, steps_payload), decoded once: per step its terms per
// (layer, head) [layer * n_heads + head], per key, and the flow's last-layer shares (or null).
function decodeSteps(steps) {
  const exact = { kind: "float32" };
  return steps.steps.map((step) =>
    Object.assign({}, step, {
      heads: dequantise(step.heads, exact),
      keys: dequantise(step.keys, exact),
      rollout: step.rollout ? dequantise(step.rollout, exact) : null,
    }),
  );
}

// The views a host offers: the prediction view only with explained steps.
function viewsOf(steps) {
  return steps ? VIEWS : VIEWS.filter(([v]) => v !== "prediction");
}

// host: {meta(), layer(L) -> payload or null, state(), set(partial), windows?(), error?(), pending?(state),
//        steps?() -> steps_payload or null, open?(step, layer, head)}
// state: layer, head ("all" or a number), factor, scope, query, view ("heatmap", "text" or "prediction")
// and, where the host has them, start, hide_sink, group_kv, step.
export function mount(root, host) {
  const Plotly = globalThis.Plotly;
  root.classList.add("cl-inspector");
  const bar = element("div", { className: "cl-controls" }, root);
  const controls = {};
  const parse = { layer: Number, head: (v) => (v === "all" ? "all" : Number(v)), query: Number };
  for (const name of ["layer", "head", "factor", "scope", "query"]) {
    controls[name] = select(bar, name, (value) => host.set({ [name]: (parse[name] || String)(value) }));
  }
  // The token window is a control only where the host can recompute it (the widget).
  if (host.windows) controls.window = select(bar, "window", (value) => host.set({ start: Number(value) }));
  controls.view = select(bar, "view", (value) => host.set({ view: value }));
  // The explained step: shown where the host has steps (an explained answer or logit).
  controls.step = select(bar, "step", (value) => host.set({ step: Number(value) }));
  // Sink hiding and KV grouping are computed by the library: a toggle shows where the host has the setting.
  const toggles = {};
  for (const [name, text] of TOGGLES) toggles[name] = checkbox(bar, name, text, (on) => host.set({ [name]: on }));
  const status = element("span", { className: "cl-status" }, bar);
  const problem = element("div", { className: "cl-error" }, root);
  problem.setAttribute("role", "alert");
  const flow = element("div", { className: "cl-text" }, root);
  const heatmap = element("div", { className: "cl-heatmap" }, root);
  const bars = element("div", { className: "cl-bars" }, root);
  const prediction = element("div", { className: "cl-prediction" }, root);
  const predictionCaption = element("div", { className: "cl-text-caption" }, prediction);
  const heads = element("div", { className: "cl-heads" }, prediction);
  const keyText = element("div", { className: "cl-text cl-keys" }, prediction);
  const cache = new Map();
  let decodedSteps = null; // [source steps, decoded]: decoded once per steps payload
  let current = null; // what the last drawing showed: the click handlers read it, never a stale window
  let drawnWidth = 0;

  function decoded(meta, payload) {
    const key = meta.key + "/" + payload.key;
    if (!cache.has(key)) {
      if (cache.size > 3) cache.delete(cache.keys().next().value);
      cache.set(key, { d: decode(meta, payload), views: new Map() });
    }
    return cache.get(key);
  }

  // What the view shows: all heads, one head, or (group_kv) the KV group of the head.
  function level(meta, state) {
    if (state.head === "all") return { kind: "all", index: -1 };
    if (state.group_kv && meta.kv_groups) return { kind: "group", index: groupOf(meta, state.head) };
    return { kind: "head", index: state.head };
  }

  function viewKey(meta, state) {
    const { kind, index } = level(meta, state);
    return kind + index + (state.hide_sink ? "/no-sink" : "");
  }

  function factors(meta, entry, state, scope) {
    const key = viewKey(meta, state) + "/" + scope;
    if (!entry.views.has(key)) {
      const { kind, index } = level(meta, state);
      let f = viewFactors(meta, entry.d, index, scope, kind === "group");
      if (state.hide_sink) {
        const a = entry.d.arrays;
        const nq = meta.queries.length;
        const head = (i) => (kind === "group" ? meta.kv_groups[i][0] : i);
        const totals =
          kind === "all" ? a["all_total_" + scope]
          : kind === "group" && a["group_total_" + scope] ? a["group_total_" + scope].subarray(index * nq, (index + 1) * nq)
          : a["total_" + scope].subarray(head(index) * nq, (head(index) + 1) * nq);
        f = hideSink(meta, entry.d, f, totals);
      }
      entry.views.set(key, f);
    }
    return entry.views.get(key);
  }

  // The width the figures may take: the output's (JupyterLab's output area, the page's body).
  function available() {
    const width = root.getBoundingClientRect().width || (root.parentNode && root.parentNode.clientWidth) || 900;
    return Math.max(360, Math.floor(width) - 8);
  }

  function headLabel(meta, h) {
    return meta.head_labels ? meta.head_labels[h] : "head " + h;
  }

  function currentSteps() {
    const steps = host.steps ? host.steps() : null;
    if (!steps || !steps.steps || !steps.steps.length) return null;
    if (!decodedSteps || decodedSteps[0] !== steps) decodedSteps = [steps, decodeSteps(steps)];
    return { about: steps, steps: decodedSteps[1] };
  }

  function showControls(meta, state, view, steps) {
    // The prediction view needs only the step: the per-layer controls would change nothing drawn.
    const perLayer = view !== "prediction";
    for (const name of ["layer", "head", "factor", "scope", "query"]) controls[name].parentNode.style.display = perLayer ? "" : "none";
    controls.step.parentNode.style.display = steps ? "" : "none";
    if (steps) {
      const options = steps.steps.map((s, k) => [k, k + ": " + JSON.stringify(s.token) + " at " + s.position]);
      setOptions(controls.step, options, Math.max(0, state.step));
    }
    setOptions(controls.layer, meta.layers.map((l) => [l, String(l)]), state.layer);
    const heads = [["all", "all heads"]].concat([...Array(meta.n_heads).keys()].map((h) => [h, headLabel(meta, h)]));
    setOptions(controls.head, heads, state.head);
    setOptions(controls.factor, meta.factors.map((f) => [f, LABELS[f]]), state.factor);
    setOptions(controls.scope, meta.scopes.map((s) => [s, s]), state.scope);
    setOptions(controls.query, meta.queries.map((q, i) => [q, meta.query_labels[i]]), state.query);
    setOptions(controls.view, viewsOf(steps), view);
    if (controls.window) {
      const starts = host.windows();
      setOptions(controls.window, starts.map(([start, end]) => [start, "tokens " + start + "–" + end]), meta.queries[0]);
      controls.window.parentNode.style.display = starts.length > 1 && perLayer ? "" : "none";
    }
    for (const [name] of TOGGLES) {
      const useful = name !== "group_kv" || (meta.kv_groups || []).some((heads) => heads.length > 1);
      toggles[name].parentNode.style.display = typeof state[name] === "boolean" && useful && perLayer ? "" : "none";
      toggles[name].checked = Boolean(state[name]);
    }
  }

  function refresh() {
    const meta = host.meta();
    const message = host.error ? host.error() : "";
    problem.textContent = message || "";
    problem.style.display = message ? "" : "none";
    if (!meta || !meta.queries) {
      status.textContent = host.pending ? host.pending(null) : "";
      return Promise.resolve();
    }
    const state = Object.assign({}, host.state());
    // A query outside this window (the kernel has not moved it yet) is drawn as the window's last query.
    if (!meta.queries.includes(state.query)) state.query = meta.queries[meta.queries.length - 1];
    if (!(state.head === "all" || (state.head >= 0 && state.head < meta.n_heads))) state.head = "all";
    const steps = currentSteps();
    const view = state.view === "text" ? "text" : state.view === "prediction" && steps ? "prediction" : "heatmap";
    showControls(meta, state, view, steps);
    prediction.style.display = view === "prediction" ? "" : "none";
    if (view === "prediction") {
      flow.style.display = heatmap.style.display = bars.style.display = "none";
      status.textContent = "";
      // The click handlers of the hidden views read `current`; the resize observer needs it set to redraw.
      current = { queries: meta.queries, qLabels: meta.query_labels };
      drawnWidth = available();
      return drawPrediction(meta, steps, state);
    }
    bars.style.display = "";
    const payload = meta.layers.includes(state.layer) ? host.layer(state.layer) : null;
    if (!payload) {
      status.textContent = host.pending ? host.pending(state) : "computing layer " + state.layer + "…";
      return Promise.resolve();
    }
    status.textContent = "";
    const entry = decoded(meta, payload);
    const both = { intra: factors(meta, entry, state, "intra"), inter: factors(meta, entry, state, "inter") };
    current = { queries: meta.queries, qLabels: meta.query_labels };
    flow.style.display = view === "text" ? "" : "none";
    heatmap.style.display = view === "text" ? "none" : "";
    drawnWidth = available();
    const drawn = view === "text" ? drawText(meta, entry, both, state) : drawHeatmap(meta, entry, both, state);
    return Promise.all([drawn, drawBars(meta, entry, both[state.scope], state)]);
  }

  function where(meta, state) {
    const { kind, index } = level(meta, state);
    const shown = kind === "all" ? ", all heads"
      : kind === "group" ? " KV group " + index + " (heads " + meta.kv_groups[index].join(", ") + ")"
      : " " + headLabel(meta, state.head);
    return "L" + state.layer + shown + (state.hide_sink ? ", sink hidden" : "");
  }

  function title(meta, state) {
    const scopeText = state.factor === "attention" ? "" : " (" + state.scope + ")";
    return LABELS[state.factor] + scopeText + ", " + where(meta, state);
  }

  // A clickable figure: drawn with its click handler the first time, redrawn in place after (the
  // handler stays: it reads what is drawn now, not what was drawn when it was attached).
  function plot(node, traces, layout, onClick) {
    const config = { displaylogo: false, responsive: false };
    if (node.data) return Plotly.react(node, traces, layout, config);
    const drawn = Plotly.newPlot(node, traces, layout, config);
    node.on("plotly_click", onClick);
    return drawn;
  }

  function drawHeatmap(meta, entry, both, state) {
    const qLabels = meta.query_labels;
    const kLabels = meta.key_labels;
    const shown = both[state.scope][state.factor];
    const nq = meta.queries.length;
    const nk = meta.keys.length;
    const z = [];
    for (let qi = 0; qi < nq; qi++) {
      const zRow = new Array(nk).fill(null);
      for (let ki = 0; ki < nk; ki++) {
        const c = entry.d.index[qi * nk + ki];
        if (c >= 0 && !Number.isNaN(shown[c])) zRow[ki] = shown[c];
      }
      z.push(zRow);
    }
    // The hover text depends on the head only: built once per (layer, head), reused by every factor and scope.
    const textKey = "text/" + viewKey(meta, state);
    if (!entry.views.has(textKey)) entry.views.set(textKey, hoverText(entry.d.index, both, qLabels, kLabels));
    const text = entry.views.get(textKey);
    const signed = meta.signed.includes(state.factor);
    // The figure fits the output's width whatever the length, colour bar included: the query labels
    // and the colour bar take about 240 px, the cells share the rest. Where a label fits its cell
    // (7 px and more) every token is labelled; below, plotly labels a readable subset and a dragged
    // box zooms in until each cell is labelled (double-click goes back).
    const width = drawnWidth;
    const cell = Math.max(1, Math.min(18, Math.floor((width - 240) / nk)));
    const every = cell >= 7;
    const font = every ? Math.min(12, Math.max(7, cell - 3)) : 10;
    const axis = (name, names, length) =>
      Object.assign(
        { title: { text: name }, type: "category", tickfont: { size: font }, automargin: true },
        every
          ? { tickmode: "array", tickvals: names, ticktext: names }
          : { tickmode: "auto", nticks: Math.max(4, Math.floor((cell * length) / 24)) },
      );
    const trace = {
      type: "heatmap",
      x: kLabels,
      y: qLabels,
      z,
      text,
      hovertemplate: "%{text}<extra></extra>",
      colorscale: signed ? meta.colorscales.diverging : meta.colorscales.sequential,
      zmid: signed ? 0 : undefined,
      colorbar: { title: { text: LABELS[state.factor] }, thickness: 14 },
      hoverongaps: false,
    };
    const hint = every ? "" : " · drag a box to zoom, double-click to reset";
    const layout = {
      title: { text: title(meta, state) + hint, x: 0.02, xanchor: "left" },
      xaxis: Object.assign(axis("key", kLabels, nk), { tickangle: -60 }),
      yaxis: Object.assign(axis("query", qLabels, nq), { autorange: "reversed" }),
      width,
      height: Math.max(420, cell * nq + 200),
      margin: { t: 50, r: 20 },
    };
    return plot(heatmap, [trace], layout, (event) => {
      const point = event.points[0];
      let row = current.qLabels.indexOf(point.y);
      if (row < 0 && Array.isArray(point.pointNumber)) row = point.pointNumber[0];
      if (row >= 0 && row < current.queries.length) host.set({ query: current.queries[row] });
    });
  }

  // The text as text: each token coloured by the factor's weight for the selected query (the
  // query's own row of the heatmap), its four numbers on hover, a click makes it the query.
  function drawText(meta, entry, both, state) {
    const nk = meta.keys.length;
    const qi = meta.queries.indexOf(state.query);
    const values = both[state.scope];
    const shown = values[state.factor];
    const signed = meta.signed.includes(state.factor);
    const scale = signed ? meta.colorscales.diverging : meta.colorscales.sequential;
    let top = 0;
    for (let ki = 0; ki < nk; ki++) {
      const c = entry.d.index[qi * nk + ki];
      if (c >= 0 && !Number.isNaN(shown[c])) top = Math.max(top, signed ? Math.abs(shown[c]) : shown[c]);
    }
    const low = signed ? -top : 0;
    flow.innerHTML = "";
    const caption = element("div", { className: "cl-text-caption" }, flow);
    caption.appendChild(
      document.createTextNode(title(meta, state) + ", query " + meta.query_labels[qi] + ": colour " + fmt(low) + " "),
    );
    const stops = scale.map(([t, c]) => "rgb(" + colourAt(scale, t).join(",") + ") " + (100 * t).toFixed(1) + "%");
    element("span", { className: "cl-legend", style: "background: linear-gradient(to right, " + stops.join(", ") + ")" }, caption);
    caption.appendChild(document.createTextNode(" " + fmt(top) + " · hover a token for its numbers, click it to make it the query"));
    const text = element("div", { className: "cl-flow" }, flow);
    for (let ki = 0; ki < nk; ki++) {
      if (ki > 0 && meta.keys[ki] !== meta.keys[ki - 1] + 1) element("span", { className: "cl-gap", textContent: " … " }, text);
      const raw = tokenText(meta.key_labels[ki]);
      const span = element("span", { className: "cl-token", textContent: raw.replaceAll("\\n", "↵").replaceAll("\\t", "⇥") }, text);
      span.dataset.position = String(meta.keys[ki]);
      const c = entry.d.index[qi * nk + ki];
      if (c >= 0 && Number.isNaN(shown[c])) {
        span.classList.add("cl-future");
        span.title = "key " + meta.key_labels[ki] + ": hidden (the sink)";
      } else if (c >= 0) {
        const t = top > 0 ? (shown[c] - low) / (top - low) : signed ? 0.5 : 0;
        const [r, g, b] = colourAt(scale, t);
        span.style.background = "rgb(" + r + "," + g + "," + b + ")";
        span.style.color = 0.299 * r + 0.587 * g + 0.114 * b < 140 ? "#fff" : "#000";
        span.dataset.value = String(shown[c]);
        span.title = hoverCell(c, both, meta.query_labels[qi], meta.key_labels[ki]).replaceAll("<br>", "\n");
      } else {
        span.classList.add("cl-future");
        span.title = "key " + meta.key_labels[ki] + ": after the query, no weight in a causal model";
      }
      if (meta.keys[ki] === state.query) span.classList.add("cl-query");
      if (raw.includes("\\n")) text.appendChild(document.createElement("br"));
    }
    return Promise.resolve();
  }

  // The explained step: its direct terms per (layer, head) as a heatmap (a click opens that head's
  // per-layer view at the step's position) and per key as the text, coloured, with the flow's shares.
  function drawPrediction(meta, steps, state) {
    const k = Math.min(Math.max(0, state.step), steps.steps.length - 1);
    const step = steps.steps[k];
    const { n_layers: L, n_heads: H, labels } = steps.about;
    const p = step.parts;
    predictionCaption.textContent =
      "step " + k + ": " + JSON.stringify(step.token) + ", predicted at position " + step.position + " (the token " +
      JSON.stringify(tokenText(labels[step.position])) + "). " +
      step.quantity + " = " + fmt(step.logit) + " = attention " + fmt(p.attention) + " + MLPs " + fmt(p.mlp) +
      " + embedding " + fmt(p.embedding) + " + biases " + fmt(p.biases) + " (direct terms; norms' scales frozen). " +
      "Click a head to open its per-layer view at query " + step.position + ".";
    const z = [];
    const text = [];
    for (let l = 0; l < L; l++) {
      z.push(Array.from(step.heads.subarray(l * H, (l + 1) * H)));
      text.push(z[l].map((v, h) =>
        "layer " + l + ", head " + h + "<br>direct term " + fmt(v) + " of " + step.quantity + " = " + fmt(step.logit) +
        "<br>click: L" + l + "H" + h + " at query " + labels[step.position]));
    }
    const trace = {
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
    const layout = {
      title: { text: "Direct attention terms of " + step.quantity + " per head (step " + k + ")", x: 0.02, xanchor: "left" },
      xaxis: { title: { text: "head" }, type: "category" },
      yaxis: { title: { text: "layer" }, type: "category", autorange: "reversed" },
      width: Math.min(drawnWidth, Math.max(420, 46 * H + 260)),
      height: Math.max(360, 20 * L + 150),
      margin: { t: 50, r: 20 },
    };
    const drawn = plot(heads, [trace], layout, (event) => {
      const point = event.points[0];
      const shown = host.state();
      const at = Math.min(Math.max(0, shown.step), steps.steps.length - 1);
      if (host.open) host.open(at, Number(String(point.y).slice(1)), Number(String(point.x).slice(1)));
    });
    drawKeys(meta, step, labels);
    return drawn;
  }

  // The text up to the explained position, each token coloured by its direct term (summed over
  // layers and heads); the predicted token follows, outlined; the rest of the text is greyed.
  function drawKeys(meta, step, labels) {
    const scale = meta.colorscales.diverging;
    let top = 0;
    for (const v of step.keys) top = Math.max(top, Math.abs(v));
    keyText.innerHTML = "";
    const caption = element("div", { className: "cl-text-caption" }, keyText);
    caption.appendChild(document.createTextNode("Direct attention terms per key, colour " + fmt(-top) + " "));
    const stops = scale.map(([t]) => "rgb(" + colourAt(scale, t).join(",") + ") " + (100 * t).toFixed(1) + "%");
    element("span", { className: "cl-legend", style: "background: linear-gradient(to right, " + stops.join(", ") + ")" }, caption);
    caption.appendChild(document.createTextNode(" " + fmt(top) + (step.rollout ? " · hover: the term and the flow's share" : "")));
    const body = element("div", { className: "cl-flow" }, keyText);
    // The text's own next token is the explained one for a generated answer; else it is shown after the position.
    const escaped = step.token.replaceAll("\n", "\\n").replaceAll("\r", "\\r").replaceAll("\t", "\\t");
    const next = step.position + 1 < labels.length && tokenText(labels[step.position + 1]) === escaped;
    labels.forEach((label, j) => {
      const raw = tokenText(label);
      const span = element("span", { className: "cl-token", textContent: raw.replaceAll("\\n", "↵").replaceAll("\\t", "⇥") }, body);
      span.dataset.position = String(j);
      if (j < step.keys.length) {
        const v = step.keys[j];
        const [r, g, b] = colourAt(scale, top > 0 ? (v + top) / (2 * top) : 0.5);
        span.style.background = "rgb(" + r + "," + g + "," + b + ")";
        span.style.color = 0.299 * r + 0.587 * g + 0.114 * b < 140 ? "#fff" : "#000";
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

  flow.addEventListener("click", (event) => {
    const position = Number(event.target.dataset && event.target.dataset.position);
    if (current && current.queries.includes(position)) host.set({ query: position });
  });

  function drawBars(meta, entry, values, state) {
    const kLabels = meta.key_labels;
    const nk = meta.keys.length;
    const qi = meta.queries.indexOf(state.query);
    const traces = [];
    const keys = [];
    const rows = meta.factors.map(() => []);
    for (let ki = 0; ki < nk; ki++) {
      const c = qi < 0 ? -1 : entry.d.index[qi * nk + ki];
      if (c < 0 || Number.isNaN(values.attention[c])) continue;
      keys.push(kLabels[ki]);
      meta.factors.forEach((f, i) => rows[i].push(values[f][c]));
    }
    meta.factors.forEach((f, i) => {
      traces.push({
        type: "bar",
        orientation: "h",
        name: LABELS[f],
        y: keys,
        x: rows[i],
        xaxis: i ? "x" + (i + 1) : "x",
        yaxis: "y",
        hovertemplate: "%{y}: %{x:.4g}<extra>" + LABELS[f] + "</extra>",
      });
    });
    const layout = {
      title: {
        text: "query " + meta.query_labels[qi] + ": per-key factors (" + state.scope + ", " + where(meta, state) +
          "), their product is the contribution",
        x: 0.02,
        xanchor: "left",
      },
      showlegend: false,
      yaxis: { autorange: "reversed", type: "category", tickfont: { size: keys.length > 129 ? 7 : 10 }, automargin: true },
      height: Math.max(300, (keys.length > 129 ? 8 : 13) * keys.length + 140),
      width: Math.min(1000, drawnWidth),
      margin: { t: 60 },
    };
    const n = meta.factors.length;
    meta.factors.forEach((f, i) => {
      layout[i ? "xaxis" + (i + 1) : "xaxis"] = {
        title: { text: LABELS[f] },
        domain: [i / n + 0.02, (i + 1) / n - 0.02],
        anchor: "y",
        zeroline: true,
      };
    });
    return Plotly.react(bars, traces, layout, { displaylogo: false });
  }

  // A new output width (a resized window or panel) draws the figures again to fit it.
  if (globalThis.ResizeObserver) {
    let queued = false;
    new ResizeObserver(() => {
      if (queued || !current || Math.abs(available() - drawnWidth) < 24) return;
      queued = true;
      requestAnimationFrame(() => {
        queued = false;
        refresh();
      });
    }).observe(root);
  }

  return { refresh };
}

// --- the static page: every layer embedded, the view named in the URL fragment -----------------

const SETTINGS = ["layer", "head", "factor", "scope", "query", "view", "hide_sink", "group_kv", "step"];

// The view a fragment names, and why each setting it names that the page cannot show was refused
// (the page then shows its own choice and says so: a link never changes meaning silently).
export function readFragment(meta, hash, steps = null) {
  const state = Object.assign({ view: "heatmap" }, meta.initial);
  if (!steps && state.view === "prediction") state.view = "heatmap";
  const nSteps = steps ? steps.steps.length : 0;
  const problems = [];
  const params = new URLSearchParams(hash.replace(/^#/, ""));
  const integer = (text) => (/^-?[0-9]+$/.test(text) ? Number(text) : NaN);
  const refuse = (name, value, why, shown) => problems.push(name + "=" + value + " " + why + "; showing " + shown);
  for (const [name, value] of params) {
    if (name === "layer") {
      if (meta.layers.includes(integer(value))) state.layer = integer(value);
      else refuse(name, value, "is not on this page (it holds layers " + meta.layers.join(", ") + ")", "layer " + state.layer);
    } else if (name === "head") {
      const h = integer(value);
      if (value === "all") state.head = "all";
      else if (h >= 0 && h < meta.n_heads) state.head = h;
      else refuse(name, value, "does not exist (heads 0–" + (meta.n_heads - 1) + " or all)", state.head === "all" ? "all heads" : "head " + state.head);
    } else if (name === "factor" || name === "scope") {
      const allowed = name === "factor" ? meta.factors : meta.scopes;
      if (allowed.includes(value)) state[name] = value;
      else refuse(name, value, "is not one of " + allowed.join(", "), state[name]);
    } else if (name === "query") {
      const q = integer(value);
      const [first, last] = [meta.queries[0], meta.queries[meta.queries.length - 1]];
      if (meta.queries.includes(q)) state.query = q;
      else refuse(name, value, "is outside this page's queries " + first + "–" + last, "query " + state.query);
    } else if (name === "view") {
      const views = viewsOf(steps);
      if (views.some(([v]) => v === value)) state.view = value;
      else refuse(name, value, "is not one of " + views.map(([v]) => v).join(", "), state.view);
    } else if (name === "step") {
      const k = integer(value);
      if (k >= 0 && k < nSteps) {
        state.step = k;
        // The step's position is the query, where the page holds it (as choosing the step does).
        if (!params.has("query") && meta.queries.includes(steps.steps[k].position)) state.query = steps.steps[k].position;
      } else {
        const why = nSteps ? "does not exist (steps 0–" + (nSteps - 1) + ")" : "names a step, and this page explains none";
        refuse(name, value, why, nSteps ? "step " + state.step : "no step");
      }
    } else if (name === "hide_sink" || name === "group_kv") {
      if (value === "1" || value === "0") state[name] = value === "1";
      else refuse(name, value, "is not 1 or 0", state[name] ? "1" : "0");
    } else {
      problems.push(name + "=" + value + " is not a view setting (" + SETTINGS.join(", ") + "); ignored");
    }
  }
  return { state, problems };
}

export function fragment(state) {
  return "#layer=" + state.layer + "&head=" + state.head + "&factor=" + state.factor + "&scope=" + state.scope +
    "&query=" + state.query + (state.view && state.view !== "heatmap" ? "&view=" + state.view : "") +
    (state.hide_sink ? "&hide_sink=1" : "") + (state.group_kv ? "&group_kv=1" : "") +
    (state.step >= 0 ? "&step=" + state.step : "");
}

// Rewrite the URL's fragment where the page may: JupyterLab's HTML viewer serves the page from a
// blob: URL, where history.replaceState throws.
function showFragment(state) {
  try {
    history.replaceState(null, "", fragment(state));
  } catch (error) {
    // The view still changes; only the address does not name it.
  }
}

export function page(root, data) {
  const meta = data.meta;
  const steps = data.steps && data.steps.steps && data.steps.steps.length ? data.steps : null;
  let { state, problems } = readFragment(meta, window.location.hash, steps);
  let refusal = ""; // why the last head clicked in the prediction view cannot be shown here
  // Compact layers are inflated on first view (asynchronously), then kept with the others.
  const inflating = new Map();
  function ready(l) {
    const payload = data.layers[String(l)];
    if (!payload || !payload.packed || payload.buffer) return Promise.resolve(payload || null);
    if (!inflating.has(l)) {
      inflating.set(l, inflate(payload).then((full) => {
        data.layers[String(l)] = full;
        return full;
      }));
    }
    return inflating.get(l);
  }
  const waiting = (l) => {
    const payload = data.layers[String(l)];
    return Boolean(payload && payload.packed && !payload.buffer);
  };
  // Drawn at once where the layer is ready (as before), after its inflation where not.
  const draw = () => (waiting(state.layer) ? (view.refresh(), ready(state.layer).then(() => view.refresh())) : view.refresh());
  const view = mount(root, {
    meta: () => meta,
    layer: (l) => (waiting(l) ? null : data.layers[String(l)] || null),
    state: () => state,
    error: () => refusal || (problems.length ? "This link names a view the page cannot show: " + problems.join("; ") + "." : ""),
    steps: () => steps,
    set,
    open,
  });
  function set(partial) {
    state = Object.assign({}, state, partial);
    // Choosing a step moves the query to its position, where the page's window holds it.
    if ("step" in partial && steps && meta.queries.includes(steps.steps[partial.step].position)) {
      state.query = steps.steps[partial.step].position;
    }
    problems = [];
    refusal = "";
    showFragment(state);
    draw();
  }
  // A head clicked in the prediction view: its per-layer view at the step's position, where the page holds both.
  function open(step, layer, head) {
    const position = steps.steps[step].position;
    const [first, last] = [meta.queries[0], meta.queries[meta.queries.length - 1]];
    const why = !meta.layers.includes(layer)
      ? "layer " + layer + " is not on this page (it holds layers " + meta.layers.join(", ") + ")"
      : !meta.queries.includes(position)
        ? "position " + position + " is outside this page's queries " + first + "–" + last
        : "";
    if (why) {
      refusal = "L" + layer + "H" + head + " at step " + step + " cannot be shown: " + why +
        ". Write the page with write_html(layers=..., start=...) to hold it.";
      draw();
      return;
    }
    set({ step, layer, head, view: "heatmap", query: position });
  }
  window.addEventListener("hashchange", () => {
    ({ state, problems } = readFragment(meta, window.location.hash, steps));
    refusal = ""; // a new view: the last clicked head's refusal goes, as with set()
    draw();
  });
  // JupyterLab's HTML viewer shows the page from a blob: URL and drops a link's fragment.
  if (window.location.protocol === "blob:") {
    const note = element("div", { className: "cl-note" });
    note.textContent =
      "Shown in JupyterLab's HTML viewer, which drops the #view of a link: choose the view in the menus, " +
      "or open the link in a browser tab (middle-click it) to see the view it names.";
    root.parentNode.insertBefore(note, root);
  }
  showFragment(state);
  root.dataset.ready = "false";
  draw().then(() => (root.dataset.ready = "true"));
  return view;
}

// --- the Jupyter widget (anywidget) ------------------------------------------------------------

const NO_KERNEL =
  "No kernel answered: this inspector's numbers come from the Python kernel, and a notebook reopened " +
  "from disk keeps only the last view drawn. Run the cell again to use it (the page of write_html needs no kernel).";
const KERNEL_WAIT_MS = 10000;

// plotly.js is loaded once per notebook page: the first widget that finds no globalThis.Plotly
// asks the kernel for the plotly.min.js of the installed plotly package (one custom message) and
// evaluates it; every later widget in the page reuses it. Nothing is fetched from the network.
function ensurePlotly(model) {
  if (globalThis.Plotly) return Promise.resolve(globalThis.Plotly);
  if (!globalThis.__contributionLensPlotly) {
    globalThis.__contributionLensPlotly = new Promise((resolve) => {
      model.on("msg:custom", (message) => {
        if (message.type !== "plotly" || globalThis.Plotly) return;
        new Function(message.source)();
        resolve(globalThis.Plotly);
      });
      model.send({ type: "need_plotly" });
    });
  }
  return globalThis.__contributionLensPlotly;
}

const TRAITS = ["layer", "head", "factor", "scope", "query", "start", "hide_sink", "group_kv", "view", "step"];

// Whether the kernel is there: a ping it answers with a pong (widget.py); none within
// KERNEL_WAIT_MS means a widget restored from the notebook file without its kernel.
function kernelWatch(model, onChange) {
  let answered = false;
  let missing = false;
  let timer = null;
  model.on("msg:custom", (message) => {
    if (message.type !== "pong") return;
    answered = true;
    clearTimeout(timer);
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

async function render({ model, el }) {
  const waiting = element("div", { className: "cl-status", textContent: "waiting for the kernel…" }, el);
  const slow = setTimeout(() => (waiting.textContent = NO_KERNEL), KERNEL_WAIT_MS);
  await ensurePlotly(model);
  clearTimeout(slow);
  waiting.remove();
  const kernel = kernelWatch(model, () => view.refresh());
  const view = mount(el, {
    meta: () => model.get("meta"),
    layer: (l) => {
      const payload = model.get("payload");
      return payload && payload.layer === l && payload.key === model.get("meta").key + "/" + l ? payload : null;
    },
    state: () => {
      const state = Object.fromEntries(TRAITS.map((name) => [name, model.get(name)]));
      state.head = state.head < 0 ? "all" : state.head;
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
    windows: () => {
      const n = model.get("meta").n_tokens;
      const size = model.get("tokens");
      const starts = [];
      for (let start = 0; start < n; start += Math.max(1, Math.floor(size / 2))) {
        starts.push([start, Math.min(n, start + size) - 1]);
        if (start + size >= n) break;
      }
      const current = model.get("meta").queries[0];
      if (!starts.some(([s]) => s === current)) starts.push([current, Math.min(n, current + size) - 1]);
      return starts.sort((a, b) => a[0] - b[0]);
    },
    set(partial) {
      for (const [name, value] of Object.entries(partial)) model.set(name, name === "head" && value === "all" ? -1 : value);
      model.save_changes();
    },
  });
  const redraw = () => view.refresh();
  const names = [...TRAITS, "payload", "meta", "error", "steps"];
  for (const name of names) model.on("change:" + name, redraw);
  await view.refresh();
  return () => {
    for (const name of names) model.off("change:" + name, redraw);
  };
}

export default { render };
