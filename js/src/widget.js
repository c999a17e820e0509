// @ts-check
/**
 * vramwidget frontend (anywidget ESM). Python computes, the frontend draws: it holds no
 * memory model. It renders the rows Python sends and reports user input by setting a
 * trait and calling model.save_changes().
 *
 * One file per panel (each exports a function that builds its element and a sync):
 *   controls.js     every input control, built from the `controls` trait (Python's one list
 *                   of the inputs, vramwidget/widget/controls.py): the core slots and the
 *                   collapsible groups, their choices and disabled reasons
 *   error.js        the banner (an input that cannot be used, named with its value)
 *   verdict.js      the answer band: does it fit (device total vs the GPU, three states, the
 *                   margin in GiB and %), the common GPUs; suggestions.js inside it: the
 *                   first fixes with their cost and apply, or the step time when it fits
 *   status.js       the status slot: "refining…" (provisional totals), "tracing <id>…"
 *   summary.js      the details: allocated peak, device total, model line, notes; parallel.js
 *                   and inference.js add their facts
 *   charts.js       the four Vega charts (embedded once, rows swapped in place, each as wide
 *                   as its column), the theme
 *   table.js        the component table
 *   formats.js      the number-format panel
 *   trainingconfig.js  import a training config (YAML/JSON) that fills the controls
 *   chartview.js    vramwidget.ChartView (one Altair chart)
 *   dom.js          h() and the number formatters; types.js the shared JSDoc types
 * This file joins them: it builds the layout and subscribes each panel to its traits.
 *
 * Layout: the banner, then the answer band (verdict, fixes or step time, common GPUs) first;
 * where there is room the controls run down the left from the top (the band's height never
 * moves them), the band tops the rest, the charts (phases, treemap, comparison) under it and
 * the side column (fit map, details) beside them.
 *
 * Traits (vramwidget/widget/state.py, class State):
 *   inputs  (set here):  every trait named in `controls` (the keyword arguments of
 *                        estimate(), estimate_parallel() and estimate_inference(), plus
 *                        config_json, gpu, mode and max_gpus); training_config (the import);
 *                        chart_width (the main chart column's width in pixels)
 *   outputs (read here): controls, control_groups, specs {name: vega-lite spec},
 *                        rows {name: [row]}, chart_sizes {name: [w, h]}, summary, verdict, table,
 *                        disabled {trait: reason}, options {trait: [[value, label]]},
 *                        formats [number format], error, error_field, suggestions [change],
 *                        suggestions_status, status (idle | refining | tracing), status_text
 *
 * data-testid attributes (stable, for browser tests):
 *   vramwidget                      the root element
 *   control-<trait>                 each input control; quantized_groups and lora_targets are
 *                                   fieldsets whose checkboxes are control-<trait>-<value>,
 *                                   plus control-lora_targets-all ("every linear layer")
 *   config-upload, config-clear     the config.json file picker and its clear button
 *   training-config, control-training_config, training-config-upload, training-config-apply,
 *   training-config-report          import a training config: the box, its text, file picker,
 *                                   apply button and what it set / did not use
 *   error                           the banner (data-shown="false" when there is nothing to say;
 *                                   its space is kept)
 *   verdict, verdict-badge          the answer band and its badge (data-state fits | tight |
 *                                   does_not_fit, "" without a GPU); headline: what the GPU holds
 *                                   (data-provisional="true" while the exact replay runs)
 *   controls-core, group-<key>,     the core controls; each named group (a <details>) and its
 *   group-<key>-toggle              summary
 *   status                          the status slot (data-status idle | refining | tracing;
 *                                   its space is kept)
 *   gpu-chip-<name>                 the common GPUs with their verdicts (a click picks one)
 *   summary                         peak allocated, device total, the mode's facts, notes
 *   control-mode                    the mode radios (control-mode-training, control-mode-inference)
 *   parallel, stages                the multi-GPU line and the pipeline-stage table (in summary)
 *   max-batch                       the largest micro-batch that fits the GPU (in summary)
 *   kv-cache, longest-context       inference: KV cache per token and in all; longest context
 *   serving, startup-lines          a serving engine's KV budget and the lines it prints at start-up;
 *   largest-max-model-len,          the largest max_model_len that starts, and the
 *   serve-command, serve-command-copy  `vllm serve` / `sglang.launch_server` command and its copy button
 *   suggestions                     the fixes' area in the answer band: each change
 *                                   suggestion-<i>, its button suggestion-apply-<i>, the rest in
 *                                   suggestions-more; after an apply, applied (changed-<trait>
 *                                   for each control that changed) and suggestion-undo
 *   step-time, max-batch            a setup that fits: its step time and cost, largest micro-batch
 *   gpu-line-note                   the phase chart's line, said in words
 *   chart-detail, chart-comparison, chart-phases, chart-fitmap   the Vega charts (class
 *                                   vw-ready once drawn); legend: the detail's parts present
 *   table                           the component table
 *   formats                         the number-format panel
 * A disabled control has the `disabled` attribute and its reason as title and as
 * data-disabled-reason.
 */
import { chartsPanel } from "./charts.js";
import { renderChart } from "./chartview.js";
import { controlsPanel } from "./controls.js";
import { h } from "./dom.js";
import { errorPanel } from "./error.js";
import { formatsPanel } from "./formats.js";
import { suggestionsPanel } from "./suggestions.js";
import { statusPanel } from "./status.js";
import { summaryPanel } from "./summary.js";
import { tablePanel } from "./table.js";
import { trainingConfigPanel } from "./trainingconfig.js";
import { verdictPanel } from "./verdict.js";

/** @typedef {import("./types.js").Model} Model @typedef {import("./types.js").Ctx} Ctx */

let uid = 0;

export default {
  /** @param {{ model: Model }} ctx */
  initialize({ model }) {
    // Nothing to share across views; each view subscribes on render and cleans up.
    return () => {};
  },

  /** @param {{ model: Model, el: HTMLElement }} args */
  render({ model, el }) {
    if (model.get("_view_kind") === "chart") return renderChart(model, el);
    /** @type {Array<[string, () => void]>} */
    const handlers = [];
    /** @type {Ctx} */
    const ctx = {
      model, el,
      root: h("div", { class: "vw-root", testid: "vramwidget" }),
      id: `vw${++uid}`,
      send: (name, value) => { model.set(name, value); model.save_changes(); },
      on: (ev, cb) => { model.on(ev, cb); handlers.push([ev, cb]); },
      setLocalError: (field, message) => error.setLocal(field, message),
    };
    const { root, on } = ctx;

    const controls = controlsPanel(ctx);
    /** @type {ReturnType<typeof errorPanel>} */
    const error = errorPanel(ctx, controls.syncDisabled);
    const status = statusPanel(ctx);
    /** @type {ReturnType<typeof verdictPanel> | null} */
    let verdict = null;
    const suggestions = suggestionsPanel(ctx, controls, () => (verdict ? verdict.el : root));
    verdict = verdictPanel(ctx, status.el, suggestions.el);
    const summary = summaryPanel(ctx);
    const charts = chartsPanel(ctx);
    const table = tablePanel(ctx);
    const formats = formatsPanel(ctx);
    const trainingConfig = trainingConfigPanel(ctx);
    controls.importBox.append(trainingConfig.el);

    // Layout: the banner keeps its place; the answer band spans the width; then the controls,
    // the charts and the side column (fit map, details), side by side where there is room.
    const main = h("div", { class: "vw-main" }, [charts.el, table.el, formats.el]);
    const side = h("div", { class: "vw-side" }, [charts.side, summary.el]);
    root.append(error.el, h("div", { class: "vw-layout" }, [verdict.el, controls.el, main, side]));
    el.append(root);

    // --- subscriptions: one loop over the inputs Python names --------------------------
    for (const name of controls.names) on(`change:${name}`, controls.syncInputs);
    on("change:options", controls.syncOptions);
    on("change:disabled", controls.syncDisabled);
    on("change:error", error.sync);
    on("change:error", suggestions.sync);
    on("change:error_field", controls.syncDisabled);
    on("change:summary", summary.sync);
    on("change:summary", verdict.sync);
    on("change:verdict", verdict.sync);
    on("change:verdict", suggestions.sync);
    on("change:summary", charts.syncTitles);
    on("change:summary", suggestions.sync);
    on("change:table", charts.syncLegend);
    on("change:suggestions", suggestions.sync);
    on("change:suggestions_status", suggestions.sync);
    on("change:table", table.sync);
    on("change:formats", formats.sync);
    on("change:training_config_report", trainingConfig.sync);
    on("change:rows", charts.updateRows);
    on("change:rows", suggestions.sync);
    on("change:chart_sizes", charts.updateRows);
    on("change:status", status.sync);
    on("change:status_text", status.sync);
    on("change:specs", charts.embedAll);

    controls.syncInputs();
    error.sync();
    summary.sync();
    verdict.sync();
    status.sync();
    charts.syncTitles();
    charts.syncLegend();
    suggestions.sync();
    table.sync();
    formats.sync();
    trainingConfig.sync();
    charts.start();

    return () => {
      for (const [ev, cb] of handlers) model.off(ev, cb);
      charts.dispose();
    };
  },
};
