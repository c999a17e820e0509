// @ts-check
/**
 * The chart panel: the detail treemap, the scenario comparison and the phase chart. Each
 * spec is embedded once; afterwards only its rows are swapped in place
 * (view.data(name, rows)), so an update moves a few kilobytes.
 */
import embed from "vega-embed";
import { h } from "./dom.js";

/** @typedef {import("./types.js").Ctx} Ctx @typedef {import("./types.js").ChartSlot} ChartSlot */

const CHARTS = [
  ["phases", "On the GPU through one step (bar: device total; tick: allocated)"],
  ["detail", "Where the memory goes at the peak (area ∝ bytes)"],
  ["comparison", "Scenarios on one scale (twice the memory, twice the area)"],
  ["fitmap", "Where it fits (click a cell to use it)"],
];
/** Charts drawn beside the others (the side column), not in the main one. */
const SIDE = new Set(["fitmap"]);
/** Chart titles that differ by what is shown: multi-GPU training, inference. */
const TITLES = {
  parallel: {
    detail: "Where the worst GPU's memory goes at the peak (area ∝ bytes)",
    comparison: "Scenarios per GPU on one scale (area ∝ bytes)",
    phases: "One GPU through one step (bar: device total; tick: allocated)",
    fitmap: "Fit map: single-GPU training only",
  },
  inference: {
    detail: "Where the memory goes at the inference peak (area ∝ bytes)",
    comparison: "Weight formats at your context and batch (area ∝ bytes)",
    phases: "On the GPU through generate() (bar: device total; tick: allocated)",
    fitmap: "Fit map: training only",
  },
};

/** Vega parameter holding the colour of the lines between treemap boxes (charts.GAP_PARAM). */
const GAP_PARAM = "vw_gap";

/**
 * Colours of the page the widget sits in (JupyterLab light/dark, VS Code, marimo, Colab):
 * the inherited text colour decides, so it works without any --jp-* variable.
 * @param {HTMLElement} el
 */
export function themeOf(el) {
  const cs = getComputedStyle(el);
  const fg = cs.getPropertyValue("--jp-ui-font-color1").trim() || cs.color || "#222";
  const muted = cs.getPropertyValue("--jp-ui-font-color2").trim() || fg;
  const m = fg.match(/\d+(\.\d+)?/g);
  let dark = false;
  if (m && m.length >= 3) dark = 0.299 * +m[0] + 0.587 * +m[1] + 0.114 * +m[2] > 150;
  else if (/^#(f|e|d|c)/i.test(fg)) dark = true;
  // the page background, for the lines between treemap boxes
  let bg = cs.getPropertyValue("--jp-layout-color0").trim();
  for (let n = /** @type {HTMLElement | null} */ (el); !bg && n; n = n.parentElement) {
    const c = getComputedStyle(n).backgroundColor;
    if (c && c !== "transparent" && !/rgba\(.*,\s*0\)$/.test(c)) bg = c;
  }
  // a real font list, not a var(): Vega measures label widths with it
  const font = cs.fontFamily || "sans-serif";
  return { fg, muted, dark, font, bg: bg || (dark ? "#111111" : "#ffffff") };
}

/** @typedef {{fg: string, muted: string, dark: boolean, font: string, bg: string}} Theme */
/** @param {Theme} theme */
export function vegaConfig(theme) {
  const grid = theme.dark ? "#555" : "#ddd";
  return {
    background: null,
    view: { stroke: null },
    font: theme.font,
    axis: {
      labelColor: theme.fg, titleColor: theme.fg, domainColor: theme.muted,
      tickColor: theme.muted, gridColor: grid,
    },
    legend: { labelColor: theme.fg, titleColor: theme.fg },
    title: { color: theme.fg, subtitleColor: theme.muted },
    text: { color: theme.fg },
  };
}

/**
 * @param {any} spec
 * @param {string} name
 * @param {any[]} rows
 */
export function withRows(spec, name, rows) {
  return { ...spec, datasets: { ...(spec.datasets || {}), [name]: rows || [] } };
}


/**
 * @param {Ctx} ctx
 * @returns {{ el: HTMLElement, side: HTMLElement, syncTitles: () => void, syncLegend: () => void,
 *   embedAll: () => void, updateRows: () => void, start: () => void, dispose: () => void }}
 */
export function chartsPanel(ctx) {
  const { model, root, el } = ctx;
  /** @type {Record<string, ChartSlot>} */
  const slots = {};
  const chartsBox = h("div", { class: "vw-charts" });
  const sideBox = h("div", { class: "vw-side-charts" });
  /** @type {Record<string, HTMLElement>} */
  const chartTitles = {};
  const legend = h("div", { class: "vw-legend", testid: "legend" });
  for (const [name, title] of CHARTS) {
    const target = h("div", { class: `vw-chart vw-chart-${name}`, testid: `chart-${name}` });
    chartTitles[name] = h("h4", { text: title, title });
    const section = h("section", { class: "vw-chart-box", "data-chart": name },
      name === "detail" ? [chartTitles[name], target, legend] : [chartTitles[name], target]);
    (SIDE.has(name) ? sideBox : chartsBox).append(section);
    slots[name] = { el: target, view: null, token: 0, pending: null };
  }

  /** The detail's legend: the parts present, from the table (Python's colours). */
  const syncLegend = () => {
    const rows = model.get("table") || [];
    legend.replaceChildren(...rows.map((/** @type {any} */ r) => h("span", { class: "vw-legend-item", title: r.formula || r.component }, [
      h("span", { class: "vw-swatch", style: `background:${r.color}` }), r.component,
    ])));
  };

  /** A click on a fit-map cell sets batch and sequence (one message). @param {any} view */
  const listenFitmap = (view) => {
    view.addEventListener("click", (/** @type {any} */ _e, /** @type {any} */ item) => {
      const d = item && item.datum;
      if (!d || d.level !== "cell") return;
      model.set("batch_size", d.batch_size);
      model.set("seq_len", d.seq_len);
      model.save_changes();
    });
  };

  /** Chart titles follow what is shown (one GPU, the worst of several, inference). */
  const syncTitles = () => {
    const s = model.get("summary") || {};
    const titles = s.inference ? TITLES.inference : s.parallel ? TITLES.parallel : null;
    for (const [name, title] of CHARTS) {
      chartTitles[name].textContent = (titles && titles[/** @type {"detail"} */ (name)]) || title;
    }
  };

  let theme = themeOf(root);
  /** @param {string} name */
  const embedChart = (name) => {
    const slot = slots[name];
    const spec = (model.get("specs") || {})[name];
    const token = ++slot.token;
    if (slot.view) { slot.view.finalize(); slot.view = null; }
    slot.el.classList.remove("vw-ready");
    if (!spec) return;
    const rows = (model.get("rows") || {})[name] || [];
    slot.pending = embed(slot.el, withRows(spec, name, rows), {
      actions: false, renderer: "svg", config: vegaConfig(theme),
      tooltip: { theme: theme.dark ? "dark" : "light" },
    }).then((res) => {
      if (token !== slot.token) { res.finalize(); return; }
      slot.view = res.view;
      slot.el.classList.add("vw-ready");
      if (name === "fitmap") listenFitmap(res.view);
      try { res.view.signal(GAP_PARAM, theme.bg); } catch (_) { /* chart without the parameter */ }
      // rows may have changed while the spec was being compiled
      const now = (model.get("rows") || {})[name] || [];
      if (now !== rows) res.view.data(name, now);
      return res.view.runAsync().then(() => {});
    }).catch((err) => {
      slot.el.textContent = `chart failed: ${err && err.message ? err.message : err}`;
    });
  };
  const embedAll = () => { for (const [name] of CHARTS) embedChart(name); };
  const updateRows = () => {
    const all = model.get("rows") || {};
    for (const [name] of CHARTS) {
      const slot = slots[name];
      if (slot.view && all[name]) slot.view.data(name, all[name]).runAsync();
      // not embedded yet: embedChart picks up the latest rows when it resolves
    }
  };

  // re-embed when the notebook theme changes (JupyterLab toggles body attributes)
  const observer = new MutationObserver(() => {
    const next = themeOf(root);
    if (next.fg !== theme.fg) { theme = next; embedAll(); }
  });
  observer.observe(el.ownerDocument.body, { attributes: true, attributeFilter: ["class", "data-jp-theme-light", "data-jp-theme-name", "data-theme"] });

  return {
    el: chartsBox, side: sideBox, syncTitles, syncLegend, embedAll, updateRows,
    // embed after the element is attached so the theme colours can be read
    start: () => requestAnimationFrame(() => { theme = themeOf(root); embedAll(); }),
    dispose: () => {
      observer.disconnect();
      for (const slot of Object.values(slots)) {
        slot.token++;
        if (slot.view) slot.view.finalize();
        slot.view = null;
      }
    },
  };
}
