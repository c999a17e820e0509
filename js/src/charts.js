// @ts-check
/**
 * The chart panel: the phase chart, the detail treemap and the scenario comparison (the
 * main column) and the fit map (the side column). Each spec is embedded once; afterwards
 * only its rows are swapped in place (view.data(name, rows)), so an update moves a few
 * kilobytes.
 *
 * Every chart takes its width from its container: the phase chart and the fit map are
 * sized by Vega (autosize fit) to the box they sit in; the treemaps are laid out in
 * Python for the main column's width, which this panel reports (the `chart_width` trait)
 * whenever the column changes size, and drawn at the size Python laid them out for
 * (`chart_sizes`). A panel with nothing to draw (the fit map without a GPU, or for a run
 * it does not cover) is hidden, not left as empty axes.
 */
import embed from "vega-embed";
import { fmtBytes, h } from "./dom.js";

/** @typedef {import("./types.js").Ctx} Ctx @typedef {import("./types.js").ChartSlot} ChartSlot */

const CHARTS = [
  ["phases", "On the GPU through one step (bar: device total; tick: allocated)"],
  ["detail", "Where the memory goes at the peak (area ∝ bytes)"],
  ["comparison", "Scenarios on one scale (twice the memory, twice the area)"],
  ["fitmap", "Where it fits by micro-batch and sequence (click a cell to use it)"],
];
/** Charts drawn beside the others (the side column), not in the main one. */
const SIDE = new Set(["fitmap"]);
/** Charts Vega sizes to their box; the others are laid out in Python for a width. */
const FIT = new Set(["phases", "fitmap"]);
/** Chart titles that differ by what is shown: multi-GPU training, inference, serving. */
const TITLES = {
  parallel: {
    detail: "Where the fullest GPU's memory goes at the peak (area ∝ bytes)",
    comparison: "Scenarios per GPU on one scale (area ∝ bytes)",
    phases: "The fullest GPU through one step (bar: device total; tick: allocated)",
  },
  inference: {
    detail: "Where the memory goes at the inference peak (area ∝ bytes)",
    comparison: "Weight formats at your context and batch (area ∝ bytes)",
    phases: "On the GPU through generate() (bar: device total; tick: allocated)",
  },
  serving: {
    detail: "Where each GPU's memory goes once the server has started (area ∝ bytes)",
    comparison: "Weight formats under the same serving budget (area ∝ bytes)",
    phases: "On each GPU at server start-up (bar: device total; tick: allocated)",
  },
};

/** Vega parameter holding the colour of the lines between treemap boxes (charts.GAP_PARAM). */
const GAP_PARAM = "vw_gap";

/**
 * A CSS colour as [r, g, b] in 0-255: rgb()/rgba() (JupyterLab), color(srgb ...) (what
 * browsers compute for marimo's colours), #rrggbb; null for anything else.
 * @param {string} c @returns {number[] | null}
 */
function rgbOf(c) {
  let m = c.match(/^rgba?\(([^)]+)\)/);
  if (m) return m[1].split(/[\s,/]+/).filter(Boolean).slice(0, 3).map(Number);
  m = c.match(/^color\(srgb ([^)]+)\)/);
  if (m) return m[1].split(/[\s/]+/).filter(Boolean).slice(0, 3).map((x) => 255 * Number(x));
  m = c.match(/^#([0-9a-f]{6})/i);
  if (m) return [0, 2, 4].map((i) => parseInt(m[1].slice(i, i + 2), 16));
  return null;
}

/**
 * Colours of the page the widget sits in (JupyterLab light/dark, VS Code, marimo, Colab):
 * the inherited text colour decides, so it works without any --jp-* variable.
 * @param {HTMLElement} el
 */
export function themeOf(el) {
  const cs = getComputedStyle(el);
  const fg = cs.getPropertyValue("--jp-ui-font-color1").trim() || cs.color || "#222";
  const rgb = rgbOf(fg);
  const dark = rgb ? 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2] > 150 : /^#(f|e|d|c)/i.test(fg);
  // the page background, for the lines between treemap boxes
  let bg = cs.getPropertyValue("--jp-layout-color0").trim();
  for (let n = /** @type {HTMLElement | null} */ (el); !bg && n; n = n.parentElement) {
    const c = getComputedStyle(n).backgroundColor;
    if (c && c !== "transparent" && !/rgba\(.*,\s*0\)$/.test(c)) bg = c;
  }
  // a real font list, not a var(): Vega measures label widths with it
  const font = cs.fontFamily || "sans-serif";
  // axis text: full-strength on the dark theme's background (the muted grey is under 4.5:1)
  const muted = dark ? "#c8c8c8" : "#555555";
  return { fg: dark ? "#e8e8e8" : "#1a1a1a", muted, dark, font, bg: bg || (dark ? "#111111" : "#ffffff") };
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

/** The width a chart may take: its section's (the chart's own box follows what it draws).
 * @param {HTMLElement} chart */
function boxWidth(chart) {
  const box = chart.parentElement;
  return box ? Math.floor(box.clientWidth) : 0;
}

/** The width a chart's drawing has now. @param {HTMLElement} chart */
function svgWidth(chart) {
  const svg = chart.querySelector("svg");
  return svg ? svg.getBoundingClientRect().width : 0;
}

/** Hide the tooltip Vega's handler leaves on the page (after a click, or when a view goes). */
function hideTooltip() {
  const t = document.getElementById("vg-tooltip-element");
  if (t) t.classList.remove("visible");
}

/**
 * @param {Ctx} ctx
 * @returns {{ el: HTMLElement, side: HTMLElement, syncTitles: () => void, syncLegend: () => void,
 *   embedAll: () => void, updateRows: () => void, resize: () => void, start: () => void, dispose: () => void }}
 */
export function chartsPanel(ctx) {
  const { model, root, el, send } = ctx;
  /** @type {Record<string, ChartSlot>} */
  const slots = {};
  const chartsBox = h("div", { class: "vw-charts" });
  const sideBox = h("div", { class: "vw-side-charts" });
  /** @type {Record<string, HTMLElement>} */
  const chartTitles = {};
  /** @type {Record<string, HTMLElement>} */
  const sections = {};
  const legend = h("div", { class: "vw-legend", testid: "legend" });
  const gpuNote = h("p", { class: "vw-chart-note", testid: "gpu-line-note" });
  for (const [name, title] of CHARTS) {
    const target = h("div", { class: `vw-chart vw-chart-${name}`, testid: `chart-${name}` });
    target.addEventListener("mouseleave", hideTooltip);
    chartTitles[name] = h("h4", { text: title });
    const kids = name === "detail" ? [chartTitles[name], target, legend]
      : name === "phases" ? [chartTitles[name], gpuNote, target] : [chartTitles[name], target];
    sections[name] = h("section", { class: "vw-chart-box", "data-chart": name }, kids);
    (SIDE.has(name) ? sideBox : chartsBox).append(sections[name]);
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
      hideTooltip();
      const d = item && item.datum;
      if (!d || d.level !== "cell") return;
      model.set("batch_size", d.batch_size);
      model.set("seq_len", d.seq_len);
      model.save_changes();
    });
  };

  /** Chart titles follow what is shown (one GPU, the fullest of several, inference, serving). */
  const syncTitles = () => {
    const s = model.get("summary") || {};
    const titles = s.inference ? (s.inference.serving ? TITLES.serving : TITLES.inference) : s.parallel ? TITLES.parallel : null;
    for (const [name, title] of CHARTS) {
      chartTitles[name].textContent = (titles && titles[/** @type {"detail"} */ (name)]) || title;
    }
    gpuNote.textContent = s.gpu && s.gpu_gib
      ? `dashed line: ${s.gpu}, ${fmtBytes(s.gpu_gib * 2 ** 30)} CUDA total${s.parallel || (s.inference && s.inference.serving && s.inference.serving.num_gpus > 1) ? " (each GPU)" : ""}`
      : "no GPU chosen: no line to compare with";
    syncEmpty();
  };

  /** A chart with nothing to draw is hidden (the fit map without its grid). */
  const syncEmpty = () => {
    const rows = (model.get("rows") || {}).fitmap || [];
    sections.fitmap.hidden = !rows.some((/** @type {any} */ r) => r.level === "cell");
  };

  /** Size a view: the box's width for the charts Vega fits, Python's layout size for the treemaps.
   * @param {string} name */
  const sizeView = (name) => {
    const slot = slots[name];
    if (!slot.view) return;
    if (FIT.has(name)) {
      const w = boxWidth(slot.el);
      // resize(): autosize "fit" lays the axes out again for the new width
      // (compared with what is drawn: with autosize "fit" the view's width() is the plot's, axes not
      // counted; setting the width it already has would change nothing and lay nothing out)
      if (w > 0 && Math.abs(svgWidth(slot.el) - w) >= 1) {
        const view = slot.view;
        const apply = () => view.width(w).resize().runAsync();
        if (Math.round(view.width()) === w) view.width(w - 1).runAsync().then(apply);
        else apply();
      }
    } else {
      const size = (model.get("chart_sizes") || {})[name];
      if (size && (slot.view.width() !== size[0] || slot.view.height() !== size[1])) {
        slot.view.width(size[0]).height(size[1]).runAsync();
      }
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
    const size = FIT.has(name) ? null : (model.get("chart_sizes") || {})[name];
    const sized = size ? { ...spec, width: size[0], height: size[1] } : spec;
    const width = FIT.has(name) && boxWidth(slot.el) > 0 ? { width: boxWidth(slot.el) } : {};
    slot.pending = embed(slot.el, withRows(sized, name, rows), {
      actions: false, renderer: "svg", config: vegaConfig(theme), ...width,
      tooltip: { theme: theme.dark ? "dark" : "light" },
    }).then((res) => {
      if (token !== slot.token) { res.finalize(); return; }
      slot.view = res.view;
      /** @type {any} */ (slot.el).vwView = res.view;   // for tests and debugging
      if (name === "fitmap") listenFitmap(res.view);
      try { res.view.signal(GAP_PARAM, theme.bg); } catch (_) { /* chart without the parameter */ }
      // rows may have changed while the spec was being compiled
      const now = (model.get("rows") || {})[name] || [];
      if (now !== rows) res.view.data(name, now);
      sizeView(name);
      return res.view.runAsync().then(() => { slot.el.classList.add("vw-ready"); });
    }).catch((err) => {
      slot.el.textContent = `chart failed: ${err && err.message ? err.message : err}`;
    });
  };
  const embedAll = () => { for (const [name] of CHARTS) embedChart(name); };
  const updateRows = () => {
    const all = model.get("rows") || {};
    syncEmpty();
    for (const [name] of CHARTS) {
      const slot = slots[name];
      if (slot.view && all[name]) {
        slot.view.data(name, all[name]);
        sizeView(name);
        slot.view.runAsync();
      }
      // not embedded yet: embedChart picks up the latest rows when it resolves
    }
  };

  /** Report the main column's width (the treemaps are laid out for it) and fit the others. */
  /** @type {any} */
  let widthTimer = null;
  const resize = () => {
    for (const name of FIT) sizeView(name);
    clearTimeout(widthTimer);
    widthTimer = setTimeout(() => {
      const w = Math.floor(boxWidth(slots.detail.el) / 4) * 4;
      if (w > 0 && w !== model.get("chart_width")) send("chart_width", w);
    }, 120);
  };
  const resizer = typeof ResizeObserver === "undefined" ? null : new ResizeObserver(() => resize());
  for (const name of ["detail", "fitmap"]) if (resizer) resizer.observe(/** @type {HTMLElement} */ (slots[name].el.parentElement));

  // re-embed when the notebook theme changes (JupyterLab toggles body attributes)
  const observer = new MutationObserver(() => {
    const next = themeOf(root);
    if (next.fg !== theme.fg || next.bg !== theme.bg) { theme = next; root.dataset.vwTheme = theme.dark ? "dark" : "light"; embedAll(); }
  });
  observer.observe(el.ownerDocument.body, { attributes: true, attributeFilter: ["class", "data-jp-theme-light", "data-jp-theme-name", "data-theme"] });
  observer.observe(el.ownerDocument.documentElement, { attributes: true, attributeFilter: ["class", "data-theme", "style"] });

  return {
    el: chartsBox, side: sideBox, syncTitles, syncLegend, embedAll, updateRows, resize,
    // embed after the element is attached so the theme colours and widths can be read
    start: () => requestAnimationFrame(() => {
      theme = themeOf(root);
      root.dataset.vwTheme = theme.dark ? "dark" : "light";
      resize();
      embedAll();
    }),
    dispose: () => {
      observer.disconnect();
      if (resizer) resizer.disconnect();
      clearTimeout(widthTimer);
      hideTooltip();
      for (const slot of Object.values(slots)) {
        slot.token++;
        if (slot.view) slot.view.finalize();
        slot.view = null;
      }
    },
  };
}
