// @ts-check
/**
 * vramwidget frontend (anywidget ESM). Python computes, the frontend draws: it holds no
 * memory model. It renders the rows Python sends and reports user input by setting a
 * trait and calling model.save_changes().
 *
 * One file per panel (each exports a function that builds its element and a sync):
 *   controls.js     every input control (model, training, inference, batch, GPU, multi-GPU,
 *                   quantization, LoRA), their choices and disabled reasons
 *   error.js        the error banner
 *   summary.js      headline, model line, notes; parallel.js and inference.js add their facts
 *   suggestions.js  changes that make the setup fit
 *   charts.js       the three Vega charts (embedded once, rows swapped in place), the theme
 *   table.js        the component table
 *   formats.js      the number-format panel
 *   trainingconfig.js  import a training config (YAML/JSON) that fills the controls
 *   chartview.js    vramwidget.ChartView (one Altair chart)
 *   dom.js          h() and the number formatters; types.js the shared JSDoc types
 * This file joins them: it builds the layout and subscribes each panel to its traits.
 *
 * Traits (vramwidget/widget.py, class Calculator):
 *   inputs  (set here):  model, config_json, method, precision, quantization,
 *                        double_quant, quantized_groups, prepare_kbit, optimizer,
 *                        gradient_checkpointing, attn_implementation, batch_size, seq_len,
 *                        grad_accum_steps, lora_r, lora_alpha, lora_dropout, lora_targets,
 *                        trainable_layers, stack, loss, loss_chunks, lora_variant,
 *                        activation_offloading, optimizer_in_backward, packing, compile,
 *                        gpu, mode (training | inference),
 *                        multi-GPU training: num_gpus, strategy, tensor_parallel,
 *                        pipeline_parallel, offload_optimizer, offload_params,
 *                        inference: weights, kv_cache_dtype, context_len,
 *                        gpu_memory_utilization, engine (hf | vllm | sglang); a replica's
 *                        GPUs are tensor_parallel x pipeline_parallel in both modes
 *   outputs (read here): specs {name: vega-lite spec}, rows {name: [row]}, summary, table,
 *                        disabled {trait: reason}, options {trait: [[value, label]]},
 *                        formats [number format], error, error_field, suggestions [change],
 *                        suggestions_status
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
 *   error                           the error banner (hidden when the error trait is "")
 *   summary                         peak, phase, device total, GPU fit
 *   control-mode                    the mode radios (control-mode-training, control-mode-inference)
 *   parallel, stages                the multi-GPU line and the pipeline-stage table (in summary)
 *   max-batch                       the largest micro-batch that fits the GPU (in summary)
 *   kv-cache, longest-context       inference: KV cache per token and in all; longest context
 *   serving, startup-lines          a serving engine's KV budget and the lines it prints at start-up;
 *   largest-max-model-len,          the largest max_model_len that starts, and a copyable
 *   serve-command                   `vllm serve` / `sglang.launch_server` command
 *   suggestions                     changes that make the setup fit (shown when it does not);
 *                                   each row suggestion-<i>, its button suggestion-apply-<i>
 *   chart-detail, chart-comparison, chart-phases   the Vega charts (class vw-ready once drawn)
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
import { summaryPanel } from "./summary.js";
import { tablePanel } from "./table.js";
import { trainingConfigPanel } from "./trainingconfig.js";

/** @typedef {import("./types.js").Model} Model @typedef {import("./types.js").Ctx} Ctx */

const INPUT_TRAITS = [
  "model", "config_json", "method", "precision", "quantization", "double_quant",
  "quantized_groups", "prepare_kbit", "optimizer", "gradient_checkpointing",
  "attn_implementation", "batch_size", "seq_len", "grad_accum_steps", "lora_r",
  "lora_alpha", "lora_dropout", "lora_targets", "trainable_layers", "gpu", "mode",
  "num_gpus", "strategy", "tensor_parallel", "pipeline_parallel", "offload_optimizer",
  "offload_params", "weights", "kv_cache_dtype", "context_len", "gpu_memory_utilization",
  "engine", "stack", "loss", "loss_chunks", "lora_variant", "activation_offloading",
  "optimizer_in_backward", "packing", "compile",
];

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
    };
    const { root, on } = ctx;

    const controls = controlsPanel(ctx);
    const error = errorPanel(ctx, controls.syncDisabled);
    const summary = summaryPanel(ctx);
    const suggestions = suggestionsPanel(ctx);
    const charts = chartsPanel(ctx);
    const table = tablePanel(ctx);
    const formats = formatsPanel(ctx);
    const trainingConfig = trainingConfigPanel(ctx);
    controls.el.append(trainingConfig.el);

    const main = h("div", { class: "vw-main" }, [suggestions.el, charts.el, table.el, formats.el]);
    root.append(error.el, summary.el, h("div", { class: "vw-layout" }, [controls.el, main]));
    el.append(root);

    // --- subscriptions: one loop over the traits -------------------------------------
    for (const name of INPUT_TRAITS) on(`change:${name}`, controls.syncInputs);
    on("change:options", controls.syncOptions);
    on("change:disabled", controls.syncDisabled);
    on("change:error", error.sync);
    on("change:error_field", controls.syncDisabled);
    on("change:summary", summary.sync);
    on("change:summary", charts.syncTitles);
    on("change:summary", suggestions.sync);
    on("change:suggestions", suggestions.sync);
    on("change:suggestions_status", suggestions.sync);
    on("change:table", table.sync);
    on("change:formats", formats.sync);
    on("change:training_config_report", trainingConfig.sync);
    on("change:rows", charts.updateRows);
    on("change:specs", charts.embedAll);

    controls.syncInputs();
    error.sync();
    summary.sync();
    charts.syncTitles();
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
