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

// The four factors of one head (h >= 0) or of all heads (h < 0), one scope, per cell.
export function viewFactors(meta, d, h, scope) {
  const a = d.arrays;
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

// Query and key labels and all four numbers in both scopes (attention has no scope), per cell.
function hoverText(index, both, qLabels, kLabels) {
  const nk = kLabels.length;
  return qLabels.map((qLabel, qi) => {
    const row = new Array(nk).fill("");
    for (let ki = 0; ki < nk; ki++) {
      const c = index[qi * nk + ki];
      if (c < 0) continue;
      row[ki] =
        "query " + qLabel + "<br>key " + kLabels[ki] +
        "<br>attention " + fmt(both.inter.attention[c]) +
        "<br>relative norm intra " + fmt(both.intra.relative_norm[c]) + ", inter " + fmt(both.inter.relative_norm[c]) +
        "<br>cosine intra " + fmt(both.intra.cosine[c]) + ", inter " + fmt(both.inter.cosine[c]) +
        "<br>contribution intra " + fmt(both.intra.contribution[c]) + ", inter " + fmt(both.inter.contribution[c]);
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

function setOptions(node, options, value) {
  const key = JSON.stringify(options);
  if (node.dataset.options !== key) {
    node.innerHTML = "";
    for (const [v, text] of options) element("option", { value: String(v), textContent: text }, node);
    node.dataset.options = key;
  }
  node.value = String(value);
}

// host: {meta(), layer(L) -> payload or null, state(), set(partial), windows?()}
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
  const status = element("span", { className: "cl-status" }, bar);
  const heatmap = element("div", { className: "cl-heatmap" }, root);
  const bars = element("div", { className: "cl-bars" }, root);
  const cache = new Map();
  let current = null; // what the last drawing showed: the click handler reads it, never a stale window

  function decoded(meta, payload) {
    const key = meta.key + "/" + payload.key;
    if (!cache.has(key)) {
      if (cache.size > 3) cache.delete(cache.keys().next().value);
      cache.set(key, { d: decode(meta, payload), views: new Map() });
    }
    return cache.get(key);
  }

  function factors(meta, entry, head, scope) {
    const key = head + "/" + scope;
    if (!entry.views.has(key)) entry.views.set(key, viewFactors(meta, entry.d, head === "all" ? -1 : head, scope));
    return entry.views.get(key);
  }

  function refresh() {
    const meta = host.meta();
    const state = host.state();
    const qLabels = meta.query_labels;
    const kLabels = meta.key_labels;
    setOptions(controls.layer, meta.layers.map((l) => [l, String(l)]), state.layer);
    const heads = [["all", "all heads"]].concat([...Array(meta.n_heads).keys()].map((h) => [h, "head " + h]));
    setOptions(controls.head, heads, state.head);
    setOptions(controls.factor, meta.factors.map((f) => [f, LABELS[f]]), state.factor);
    setOptions(controls.scope, meta.scopes.map((s) => [s, s]), state.scope);
    setOptions(controls.query, meta.queries.map((q, i) => [q, qLabels[i]]), state.query);
    if (controls.window) {
      const starts = host.windows();
      setOptions(controls.window, starts.map(([start, end]) => [start, "tokens " + start + "–" + end]), meta.queries[0]);
      controls.window.parentNode.style.display = starts.length > 1 ? "" : "none";
    }
    const payload = host.layer(state.layer);
    if (!payload) {
      status.textContent = "computing layer " + state.layer + "…";
      return Promise.resolve();
    }
    status.textContent = "";
    const entry = decoded(meta, payload);
    const both = { intra: factors(meta, entry, state.head, "intra"), inter: factors(meta, entry, state.head, "inter") };
    const shown = both[state.scope][state.factor];
    const nq = meta.queries.length;
    const nk = meta.keys.length;
    const z = [];
    for (let qi = 0; qi < nq; qi++) {
      const zRow = new Array(nk).fill(null);
      for (let ki = 0; ki < nk; ki++) {
        const c = entry.d.index[qi * nk + ki];
        if (c >= 0) zRow[ki] = shown[c];
      }
      z.push(zRow);
    }
    // The hover text depends on the head only: built once per (layer, head), reused by every factor and scope.
    const textKey = "text/" + state.head;
    if (!entry.views.has(textKey)) entry.views.set(textKey, hoverText(entry.d.index, both, qLabels, kLabels));
    const text = entry.views.get(textKey);
    const signed = meta.signed.includes(state.factor);
    const where = "L" + state.layer + (state.head === "all" ? ", all heads" : "H" + state.head);
    const scopeText = state.factor === "attention" ? "" : " (" + state.scope + ")";
    // Every label readable up to 128 tokens: one tick per row and column, sized to the cell.
    const cell = nk > 129 ? 8 : nk > 65 ? 13 : nk > 33 ? 15 : 18;
    const font = nk > 129 ? 7 : nk > 65 ? 10 : nk > 33 ? 11 : 12;
    const axis = (title, names) => ({
      title: { text: title },
      type: "category",
      tickmode: "array",
      tickvals: names,
      ticktext: names,
      tickfont: { size: font },
      automargin: true,
    });
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
    const layout = {
      title: { text: LABELS[state.factor] + scopeText + ", " + where, x: 0.02, xanchor: "left" },
      xaxis: Object.assign(axis("key", kLabels), { tickangle: -60 }),
      yaxis: Object.assign(axis("query", qLabels), { autorange: "reversed" }),
      width: Math.max(560, cell * nk + 260),
      height: Math.max(460, cell * nq + 200),
      margin: { t: 50, r: 20 },
    };
    const first = !heatmap.data;
    const drawn = first ? Plotly.newPlot(heatmap, [trace], layout) : Plotly.react(heatmap, [trace], layout);
    current = { queries: meta.queries, qLabels };
    if (first) {
      heatmap.on("plotly_click", (event) => {
        const row = current.qLabels.indexOf(event.points[0].y);
        if (row >= 0) host.set({ query: current.queries[row] });
      });
    }
    return Promise.all([drawn, drawBars(meta, entry, both[state.scope], state, kLabels)]);
  }

  function drawBars(meta, entry, values, state, kLabels) {
    const nk = meta.keys.length;
    const qi = meta.queries.indexOf(state.query);
    const traces = [];
    const keys = [];
    const rows = meta.factors.map(() => []);
    for (let ki = 0; ki < nk; ki++) {
      const c = qi < 0 ? -1 : entry.d.index[qi * nk + ki];
      if (c < 0) continue;
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
        text: "query " + state.query + ": per-key factors (" + state.scope + "), their product is the contribution",
        x: 0.02,
        xanchor: "left",
      },
      showlegend: false,
      yaxis: { autorange: "reversed", type: "category", tickfont: { size: keys.length > 129 ? 7 : 10 }, automargin: true },
      height: Math.max(300, (keys.length > 129 ? 8 : 13) * keys.length + 140),
      width: 1000,
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
    return Plotly.react(bars, traces, layout);
  }

  return { refresh };
}

// --- the static page: every layer embedded, the view named in the URL fragment -----------------

export function readFragment(meta, hash) {
  const state = Object.assign({}, meta.initial);
  const params = new URLSearchParams(hash.slice(1));
  if (params.has("layer") && meta.layers.includes(Number(params.get("layer")))) state.layer = Number(params.get("layer"));
  if (params.has("head")) {
    const h = params.get("head");
    if (h === "all") state.head = "all";
    else if (Number(h) >= 0 && Number(h) < meta.n_heads) state.head = Number(h);
  }
  if (meta.factors.includes(params.get("factor"))) state.factor = params.get("factor");
  if (meta.scopes.includes(params.get("scope"))) state.scope = params.get("scope");
  if (params.has("query") && meta.queries.includes(Number(params.get("query")))) state.query = Number(params.get("query"));
  return state;
}

export function fragment(state) {
  return "#layer=" + state.layer + "&head=" + state.head + "&factor=" + state.factor + "&scope=" + state.scope +
    "&query=" + state.query;
}

// Rewrite the URL's fragment where the page may (a blob: URL, as JupyterLab's HTML viewer serves, refuses).
function showFragment(state) {
  try {
    history.replaceState(null, "", fragment(state));
  } catch (error) {
    // The view still changes; only the address does not name it.
  }
}

export function page(root, data) {
  const meta = data.meta;
  let state = readFragment(meta, window.location.hash);
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
    set(partial) {
      state = Object.assign({}, state, partial);
      showFragment(state);
      draw();
    },
  });
  window.addEventListener("hashchange", () => {
    state = readFragment(meta, window.location.hash);
    draw();
  });
  showFragment(state);
  root.dataset.ready = "false";
  draw().then(() => (root.dataset.ready = "true"));
  return view;
}

// --- the Jupyter widget (anywidget) ------------------------------------------------------------

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

const TRAITS = ["layer", "head", "factor", "scope", "query", "start"];

async function render({ model, el }) {
  await ensurePlotly(model);
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
    // Windows of the widget's size, half-overlapping, over the whole text.
    windows: () => {
      const n = model.get("meta").n_tokens;
      const size = model.get("tokens");
      const starts = [];
      for (let start = 0; start < n; start += Math.max(1, Math.floor(size / 2))) {
        starts.push([start, Math.min(n, start + size) - 1]);
        if (start + size >= n) break;
      }
      const current = model.get("start");
      if (!starts.some(([s]) => s === current)) starts.push([current, Math.min(n, current + size) - 1]);
      return starts.sort((a, b) => a[0] - b[0]);
    },
    set(partial) {
      for (const [name, value] of Object.entries(partial)) model.set(name, name === "head" && value === "all" ? -1 : value);
      model.save_changes();
    },
  });
  const redraw = () => view.refresh();
  for (const name of [...TRAITS, "payload", "meta"]) model.on("change:" + name, redraw);
  await view.refresh();
  return () => {
    for (const name of [...TRAITS, "payload", "meta"]) model.off("change:" + name, redraw);
  };
}

export default { render };
