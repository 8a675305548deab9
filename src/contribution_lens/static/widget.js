// The Jupyter widget (anywidget): inspector.js is prepended to this module by inspector.py.
//
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
  const view = ContributionLens.mount(el, {
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
