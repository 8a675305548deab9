// contribution-lens inspector: the drawing code shared by the static page and the Jupyter widget.
//
// The library computes, per layer and displayable (query, key) cell of the token window, three
// quantised numbers per head (attention, cosine intra, cosine inter) and three small float32
// vectors (value norm ||vt_j^h||, output norm ||o_i^h|| intra and ||o_i|| inter). Everything else
// is derived here exactly as contribution_lens does it:
//   relative_norm = value_norm / output_norm (0 where output_norm = 0)
//   contribution  = attention * relative_norm * cosine
//   all heads: attention = mean over heads, contribution = sum over heads,
//              relative_norm and cosine = attention-weighted mean over heads.
// Quantisation (see inspector.py): attention code = round(sqrt(a) * 65535),
// cosine code = round(c * 32767) + 32767, both little-endian uint16.
const ContributionLens = (() => {
  "use strict";
  const FACTORS = ["attention", "relative_norm", "cosine", "contribution"];
  const SIGNED = new Set(["cosine", "contribution"]);
  const SCOPES = ["intra", "inter"];
  const FACTOR_LABELS = {
    attention: "attention",
    relative_norm: "relative norm",
    cosine: "cosine",
    contribution: "contribution",
  };

  function bytes(b64) {
    const text = atob(b64);
    const out = new Uint8Array(text.length);
    for (let i = 0; i < text.length; i++) out[i] = text.charCodeAt(i);
    return out.buffer;
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

  function decode(meta, payload) {
    const { index, cells } = cellIndex(meta);
    const H = meta.n_heads;
    const attCodes = new Uint16Array(bytes(payload.attention));
    const attention = new Float64Array(attCodes.length);
    for (let i = 0; i < attCodes.length; i++) {
      const s = attCodes[i] / 65535;
      attention[i] = s * s;
    }
    const cosine = {};
    for (const scope of SCOPES) {
      const codes = new Uint16Array(bytes(payload["cosine_" + scope]));
      const values = new Float64Array(codes.length);
      for (let i = 0; i < codes.length; i++) values[i] = (codes[i] - 32767) / 32767;
      cosine[scope] = values;
    }
    return {
      index,
      cells,
      H,
      attention,
      cosine,
      valueNorm: new Float32Array(bytes(payload.value_norm)),
      outputNorm: {
        intra: new Float32Array(bytes(payload.output_norm_intra)),
        inter: new Float32Array(bytes(payload.output_norm_inter)),
      },
    };
  }

  // The four factors of one head (h >= 0) or of all heads (h < 0), one scope, per cell.
  function headFactors(meta, d, h, scope) {
    const nq = meta.queries.length;
    const nk = meta.keys.length;
    const C = d.cells;
    const out = {
      attention: new Float64Array(C),
      relative_norm: new Float64Array(C),
      cosine: new Float64Array(C),
      contribution: new Float64Array(C),
    };
    const heads = h >= 0 ? [h] : [...Array(d.H).keys()];
    const total = new Float64Array(C);
    for (const head of heads) {
      for (let qi = 0; qi < nq; qi++) {
        const o = scope === "intra" ? d.outputNorm.intra[head * nq + qi] : d.outputNorm.inter[qi];
        for (let ki = 0; ki < nk; ki++) {
          const c = d.index[qi * nk + ki];
          if (c < 0) continue;
          const a = d.attention[head * C + c];
          const cos = d.cosine[scope][head * C + c];
          const rn = o > 0 ? d.valueNorm[head * nk + ki] / o : 0;
          out.attention[c] += a;
          out.contribution[c] += a * rn * cos;
          out.relative_norm[c] += a * rn;
          out.cosine[c] += a * cos;
          total[c] += a;
        }
      }
    }
    for (let c = 0; c < C; c++) {
      const w = Math.max(total[c], 1e-30);
      out.relative_norm[c] /= w;
      out.cosine[c] /= w;
      out.attention[c] /= heads.length;
    }
    if (h >= 0) {
      // One head: relative_norm and cosine are the head's own numbers, also where attention is 0.
      for (let qi = 0; qi < nq; qi++) {
        const o = scope === "intra" ? d.outputNorm.intra[h * nq + qi] : d.outputNorm.inter[qi];
        for (let ki = 0; ki < nk; ki++) {
          const c = d.index[qi * nk + ki];
          if (c < 0) continue;
          out.relative_norm[c] = o > 0 ? d.valueNorm[h * nk + ki] / o : 0;
          out.cosine[c] = d.cosine[scope][h * C + c];
        }
      }
    }
    return out;
  }

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
    const node = element("select", { id: "cl-" + name }, label);
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

  // host: {meta(), layer(L) -> payload or null, state(), set(partial)}
  function mount(root, host) {
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
    const heatmap = element("div", { id: "cl-heatmap" }, root);
    const bars = element("div", { id: "cl-bars" }, root);
    const cache = new Map();
    let clickBound = false;

    function decoded(meta, payload) {
      const key = payload.key;
      if (!cache.has(key)) {
        if (cache.size > 3) cache.delete(cache.keys().next().value);
        cache.set(key, { d: decode(meta, payload), views: new Map() });
      }
      return cache.get(key);
    }

    function factors(meta, entry, head, scope) {
      const key = head + "/" + scope;
      if (!entry.views.has(key)) entry.views.set(key, headFactors(meta, entry.d, head === "all" ? -1 : head, scope));
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
      setOptions(controls.factor, FACTORS.map((f) => [f, FACTOR_LABELS[f]]), state.factor);
      setOptions(controls.scope, SCOPES.map((s) => [s, s]), state.scope);
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
      const signed = SIGNED.has(state.factor);
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
        colorbar: { title: { text: FACTOR_LABELS[state.factor] }, thickness: 14 },
        hoverongaps: false,
      };
      const layout = {
        title: { text: FACTOR_LABELS[state.factor] + scopeText + ", " + where, x: 0.02, xanchor: "left" },
        xaxis: Object.assign(axis("key", kLabels), { tickangle: -60 }),
        yaxis: Object.assign(axis("query", qLabels), { autorange: "reversed" }),
        width: Math.max(560, cell * nk + 260),
        height: Math.max(460, cell * nq + 200),
        margin: { t: 50, r: 20 },
      };
      const drawn = heatmap.data ? Plotly.react(heatmap, [trace], layout) : Plotly.newPlot(heatmap, [trace], layout);
      if (!clickBound) {
        clickBound = true;
        heatmap.on("plotly_click", (event) => {
          const point = event.points[0];
          host.set({ query: meta.queries[qLabels.indexOf(point.y)] });
        });
      }
      return Promise.all([drawn, drawBars(meta, entry, both[state.scope], state, kLabels)]);
    }

    function drawBars(meta, entry, values, state, kLabels) {
      const nk = meta.keys.length;
      const qi = meta.queries.indexOf(state.query);
      const traces = [];
      const keys = [];
      const rows = FACTORS.map(() => []);
      for (let ki = 0; ki < nk; ki++) {
        const c = qi < 0 ? -1 : entry.d.index[qi * nk + ki];
        if (c < 0) continue;
        keys.push(kLabels[ki]);
        FACTORS.forEach((f, i) => rows[i].push(values[f][c]));
      }
      FACTORS.forEach((f, i) => {
        traces.push({
          type: "bar",
          orientation: "h",
          name: FACTOR_LABELS[f],
          y: keys,
          x: rows[i],
          xaxis: i ? "x" + (i + 1) : "x",
          yaxis: "y",
          hovertemplate: "%{y}: %{x:.4g}<extra>" + FACTOR_LABELS[f] + "</extra>",
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
      FACTORS.forEach((f, i) => {
        layout[i ? "xaxis" + (i + 1) : "xaxis"] = {
          title: { text: FACTOR_LABELS[f] },
          domain: [i / 4 + 0.02, (i + 1) / 4 - 0.02],
          anchor: "y",
          zeroline: true,
        };
      });
      return Plotly.react(bars, traces, layout);
    }

    return { refresh };
  }

  // --- the static page: every layer embedded, the view named in the URL fragment -----------------

  function readFragment(meta) {
    const state = Object.assign({}, meta.initial);
    const params = new URLSearchParams(window.location.hash.slice(1));
    if (params.has("layer") && meta.layers.includes(Number(params.get("layer")))) state.layer = Number(params.get("layer"));
    if (params.has("head")) {
      const h = params.get("head");
      if (h === "all") state.head = "all";
      else if (Number(h) >= 0 && Number(h) < meta.n_heads) state.head = Number(h);
    }
    if (FACTORS.includes(params.get("factor"))) state.factor = params.get("factor");
    if (SCOPES.includes(params.get("scope"))) state.scope = params.get("scope");
    if (params.has("query") && meta.queries.includes(Number(params.get("query")))) state.query = Number(params.get("query"));
    return state;
  }

  function fragment(state) {
    return "#layer=" + state.layer + "&head=" + state.head + "&factor=" + state.factor + "&scope=" + state.scope +
      "&query=" + state.query;
  }

  function page(root, data) {
    const meta = data.meta;
    let state = readFragment(meta);
    const view = mount(root, {
      meta: () => meta,
      layer: (l) => data.layers[String(l)] || null,
      state: () => state,
      set(partial) {
        state = Object.assign({}, state, partial);
        history.replaceState(null, "", fragment(state));
        view.refresh();
      },
    });
    window.addEventListener("hashchange", () => {
      state = readFragment(meta);
      view.refresh();
    });
    history.replaceState(null, "", fragment(state));
    root.dataset.ready = "false";
    view.refresh().then(() => (root.dataset.ready = "true"));
    return view;
  }

  return { FACTORS, SCOPES, decode, headFactors, mount, page, fragment, readFragment };
})();
globalThis.ContributionLens = ContributionLens;
