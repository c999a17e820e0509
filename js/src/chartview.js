// @ts-check
/** A single Altair/Vega-Lite chart (vramwidget.ChartView), drawn with the bundled Vega. */
import embed from "vega-embed";
import { h } from "./dom.js";

/** @typedef {import("./types.js").Model} Model */

/**
 * A single Altair/Vega-Lite chart (vramwidget.ChartView): the same bundled Vega, no CDN.
 * Trait `spec` holds the whole spec; a new spec re-embeds it.
 * @param {Model} model @param {HTMLElement} el
 */
export function renderChart(model, el) {
  const box = h("div", { class: "vw-root vw-chart-only", testid: "chart-view" });
  el.appendChild(box);
  /** @type {any} */
  let view = null;
  let token = 0;
  const draw = async () => {
    const mine = ++token;
    const spec = model.get("spec");
    if (view) { view.finalize(); view = null; }
    if (!spec || !Object.keys(spec).length) return;
    const result = await embed(box, spec, { actions: false, renderer: "svg" });
    if (mine !== token) { result.finalize(); return; }
    view = result;
    box.classList.add("vw-ready");
  };
  const onSpec = () => { draw(); };
  model.on("change:spec", onSpec);
  draw();
  return () => {
    token++;
    model.off("change:spec", onSpec);
    if (view) view.finalize();
  };
}
