// @ts-check
/**
 * vramwidget frontend (anywidget ESM). Python computes, this file draws: it holds no
 * memory model. It renders the rows Python sends and reports user input by setting a
 * trait and calling model.save_changes().
 *
 * Traits (vramwidget/widget.py, class Calculator):
 *   inputs  (set here):  model, config_json, method, precision, quantization,
 *                        double_quant, quantized_groups, prepare_kbit, optimizer,
 *                        gradient_checkpointing, attn_implementation, batch_size, seq_len,
 *                        grad_accum_steps, lora_r, lora_alpha, lora_dropout, lora_targets,
 *                        trainable_layers, gpu, mode (training | inference),
 *                        multi-GPU training: num_gpus, strategy, tensor_parallel,
 *                        pipeline_parallel, offload_optimizer, offload_params,
 *                        inference: weights, kv_cache_dtype, context_len,
 *                        gpu_memory_utilization
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
 *   error                           the error banner (hidden when the error trait is "")
 *   summary                         peak, phase, device total, GPU fit
 *   control-mode                    the mode radios (control-mode-training, control-mode-inference)
 *   parallel, stages                the multi-GPU line and the pipeline-stage table (in summary)
 *   max-batch                       the largest micro-batch that fits the GPU (in summary)
 *   kv-cache, longest-context       inference: KV cache per token and in all; longest context
 *   suggestions                     changes that make the setup fit (shown when it does not);
 *                                   each row suggestion-<i>, its button suggestion-apply-<i>
 *   chart-detail, chart-comparison, chart-phases   the Vega charts (class vw-ready once drawn)
 *   table                           the component table
 *   formats                         the number-format panel
 * A disabled control has the `disabled` attribute and its reason as title and as
 * data-disabled-reason.
 */
import embed from "vega-embed";

/**
 * @typedef {{
 *   get(name: string): any,
 *   set(name: string, value: any): void,
 *   save_changes(): void,
 *   on(event: string, cb: () => void): void,
 *   off(event?: string | null, cb?: (() => void) | null): void,
 * }} Model
 * @typedef {[string, string]} Choice
 * @typedef {{ el: HTMLElement, view: any, token: number, pending: Promise<void> | null }} ChartSlot
 */

const CHARTS = [
  ["detail", "Where the memory goes at the peak (area ∝ bytes)"],
  ["comparison", "Scenarios on one scale (twice the memory, twice the area); dashed: the GPU"],
  ["phases", "Memory through one training step"],
];
/** Chart titles that differ by what is shown: multi-GPU training, inference. */
const TITLES = {
  parallel: {
    detail: "Where one GPU's memory goes at the peak (the worst GPU; area ∝ bytes)",
    comparison: "Scenarios per GPU on one scale (twice the memory, twice the area); dashed: one GPU",
    phases: "One GPU's memory through one training step",
  },
  inference: {
    detail: "Where the memory goes at the inference peak (area ∝ bytes)",
    comparison: "Weight formats at your context and batch, on one scale; dashed: the GPU",
    phases: "Memory through generate(): after load, prefill, decode",
  },
};

/** Select controls: trait, label, hint. Their choices come from options[trait]. */
const SELECTS = [
  ["method", "Method", "What trains: every weight, LoRA adapters, or the last layers"],
  ["precision", "Precision", "Storage and compute dtypes of weights, gradients and states"],
  ["optimizer", "Optimizer", "Optimizer state per trainable parameter"],
  ["gradient_checkpointing", "Checkpointing", "Recompute activations in the backward pass"],
  ["attn_implementation", "Attention", "eager materialises batch x heads x seq x seq scores"],
  ["quantization", "Base weights", "Storage format of the frozen base weights"],
  ["strategy", "Strategy", "How data-parallel replicas store parameters, gradients and optimizer states"],
  ["weights", "Weights", "Storage format of the weights for inference"],
  ["kv_cache_dtype", "KV cache", "dtype of the key/value cache (auto: the compute dtype)"],
];

/** Number inputs: trait, label, kind ("int" | "float" | "int?" | "float?"), min, step, hint. */
const NUMBERS = [
  ["batch_size", "Batch size", "int", 1, 1, "Sequences per forward pass (per GPU replica)"],
  ["seq_len", "Sequence length", "int", 1, 1],
  ["context_len", "Context length", "int", 1, 1, "Tokens per sequence at the end of generation (prompt + generated)"],
  ["grad_accum_steps", "Grad. accumulation", "int", 1, 1],
  ["lora_r", "LoRA rank r", "int", 1, 1],
  ["lora_alpha", "LoRA alpha", "float", 0, "any"],
  ["lora_dropout", "LoRA dropout", "float", 0, 0.05],
  ["trainable_layers", "Trainable last layers", "int?", 1, 1],
  ["num_gpus", "GPUs", "int", 1, 1, "GPUs of the run; above 1 needs a data-parallel strategy (DDP is picked)"],
  ["tensor_parallel", "Tensor parallel", "int", 1, 1, "Heads, MLP width and vocabulary split over this many GPUs"],
  ["pipeline_parallel", "Pipeline stages", "int", 1, 1, "Layers split into this many stages (1F1B)"],
  ["gpu_memory_utilization", "Serving budget", "float?", 0.05, 0.05, "Blank: generate(). A fraction such as 0.9: a vLLM-style server whose paged KV cache fills that share of the GPU"],
];

const INPUT_TRAITS = [
  "model", "config_json", "method", "precision", "quantization", "double_quant",
  "quantized_groups", "prepare_kbit", "optimizer", "gradient_checkpointing",
  "attn_implementation", "batch_size", "seq_len", "grad_accum_steps", "lora_r",
  "lora_alpha", "lora_dropout", "lora_targets", "trainable_layers", "gpu", "mode",
  "num_gpus", "strategy", "tensor_parallel", "pipeline_parallel", "offload_optimizer",
  "offload_params", "weights", "kv_cache_dtype", "context_len", "gpu_memory_utilization",
];
/** Controls (and groups) shown in one mode only; the other mode hides them. */
const MODE_OF = {
  seq_len: "training", grad_accum_steps: "training", trainable_layers: "training",
  context_len: "inference", gpu_memory_utilization: "inference",
};
const CHECKBOXES = ["double_quant", "prepare_kbit", "offload_optimizer", "offload_params"];

/** Vega parameter holding the colour of the lines between treemap boxes (charts.GAP_PARAM). */
const GAP_PARAM = "vw_gap";

let uid = 0;

/**
 * @param {string} tag
 * @param {Record<string, any>} [attrs]
 * @param {(Node | string)[]} [children]
 * @returns {HTMLElement}
 */
function h(tag, attrs = {}, children = []) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") el.className = v;
    else if (k === "text") el.textContent = v;
    else if (k === "testid") el.dataset.testid = v;
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children) el.append(c);
  return el;
}

/** @param {number | null | undefined} gib */
function fmtGiB(gib) {
  if (gib === null || gib === undefined || !isFinite(gib)) return "–";
  if (Math.abs(gib) >= 100) return `${gib.toFixed(0)} GiB`;
  if (Math.abs(gib) >= 10) return `${gib.toFixed(1)} GiB`;
  return `${gib.toFixed(2)} GiB`;
}

/** @param {number | null | undefined} n */
function fmtCount(n) {
  if (n === null || n === undefined) return "–";
  for (const [d, s] of [[1e12, "T"], [1e9, "B"], [1e6, "M"], [1e3, "K"]]) {
    if (n >= /** @type {number} */ (d)) return `${(n / /** @type {number} */ (d)).toPrecision(3)}${s}`;
  }
  return String(n);
}

/** @param {number | null | undefined} n */
function fmtInt(n) {
  return n === null || n === undefined ? "–" : Math.round(n).toLocaleString("en");
}

/** Bytes per token as KiB (or bytes below 1 KiB). @param {number} b */
function fmtPerToken(b) {
  return b >= 1024 ? `${Number((b / 1024).toPrecision(4))} KiB` : `${Math.round(b)} B`;
}

/** Exact for whole numbers below a million (65504, 57344, 448), else 4 significant digits.
 * @param {number} x */
function fmtNum(x) {
  if (x === 0) return "0";
  const a = Math.abs(x);
  if (Number.isInteger(x) && a < 1e6) return x.toLocaleString("en");
  if (a >= 1e6 || a < 1e-3) return x.toExponential(3).replace("e+", "e");
  return String(Number(x.toPrecision(4)));
}

/**
 * Colours of the page the widget sits in (JupyterLab light/dark, VS Code, marimo, Colab):
 * the inherited text colour decides, so it works without any --jp-* variable.
 * @param {HTMLElement} el
 */
function themeOf(el) {
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
function vegaConfig(theme) {
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
function withRows(spec, name, rows) {
  return { ...spec, datasets: { ...(spec.datasets || {}), [name]: rows || [] } };
}

/**
 * A single Altair/Vega-Lite chart (vramwidget.ChartView): the same bundled Vega, no CDN.
 * Trait `spec` holds the whole spec; a new spec re-embeds it.
 * @param {Model} model @param {HTMLElement} el
 */
function renderChart(model, el) {
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

export default {
  /** @param {{ model: Model }} ctx */
  initialize({ model }) {
    // Nothing to share across views; each view subscribes on render and cleans up.
    return () => {};
  },

  /** @param {{ model: Model, el: HTMLElement }} ctx */
  render({ model, el }) {
    if (model.get("_view_kind") === "chart") return renderChart(model, el);
    const id = `vw${++uid}`;
    /** @type {Array<[string, () => void]>} */
    const handlers = [];
    /** @param {string} ev @param {() => void} cb */
    const on = (ev, cb) => { model.on(ev, cb); handlers.push([ev, cb]); };
    /** @param {string} name @param {any} value */
    const send = (name, value) => { model.set(name, value); model.save_changes(); };

    /** @type {Record<string, HTMLElement>} every control by trait name */
    const controls = {};
    const root = h("div", { class: "vw-root", testid: "vramwidget" });
    const errorBox = h("div", { class: "vw-error", role: "alert", testid: "error", hidden: true });
    const summaryBox = h("div", { class: "vw-summary", testid: "summary", "aria-live": "polite" });
    const form = h("form", { class: "vw-controls", "aria-label": "training setup" });
    form.addEventListener("submit", (e) => e.preventDefault());

    /**
     * A labelled row around one control.
     * @param {string} name @param {string} label @param {HTMLElement} input @param {string} [hint]
     */
    const field = (name, label, input, hint) => {
      input.id = `${id}-${name}`;
      input.dataset.testid = `control-${name}`;
      input.setAttribute("name", name);
      controls[name] = input;
      const lab = h("label", { for: input.id, text: label, title: hint || label });
      return h("div", { class: "vw-field", "data-field": name }, [lab, input]);
    };

    // --- model: preset search, Hub id, pasted or uploaded config.json -----------------
    const datalist = h("datalist", { id: `${id}-presets` });
    const modelInput = /** @type {HTMLInputElement} */ (h("input", {
      type: "text", list: datalist.id, autocomplete: "off", spellcheck: "false",
      placeholder: "preset, Hub id (org/name) or 7B",
    }));
    modelInput.addEventListener("change", () => {
      const v = modelInput.value.trim();
      if (v) send("model", v);
    });
    const configText = /** @type {HTMLTextAreaElement} */ (h("textarea", {
      rows: 4, spellcheck: "false", placeholder: "paste a config.json here",
    }));
    configText.addEventListener("change", () => send("config_json", configText.value));
    const upload = /** @type {HTMLInputElement} */ (h("input", {
      type: "file", accept: ".json,application/json", testid: "config-upload",
      "aria-label": "upload a config.json",
    }));
    upload.addEventListener("change", async () => {
      const file = upload.files && upload.files[0];
      if (!file) return;
      const text = await file.text();
      configText.value = text;
      send("config_json", text);
      upload.value = "";
    });
    const clear = h("button", { type: "button", testid: "config-clear", text: "clear config" });
    clear.addEventListener("click", () => { configText.value = ""; send("config_json", ""); });
    const configBox = h("details", { class: "vw-config" }, [
      h("summary", { text: "config.json (paste or upload)" }),
      field("config_json", "config.json text", configText),
      h("div", { class: "vw-row" }, [upload, clear]),
    ]);

    const fsModel = h("fieldset", { class: "vw-group" }, [
      h("legend", { text: "Model" }),
      field("model", "Preset or Hub id", modelInput, "Type to search the presets; or a Hub id, e.g. meta-llama/Llama-3.1-8B"),
      datalist, configBox,
    ]);

    // --- selects ---------------------------------------------------------------------
    /** @type {Record<string, HTMLElement>} */
    const selectFields = {};
    for (const [name, label, hint] of SELECTS) {
      const sel = h("select");
      sel.addEventListener("change", () => send(name, /** @type {HTMLSelectElement} */ (sel).value));
      selectFields[name] = field(name, label, sel, hint);
    }
    const gpuSel = h("select");
    gpuSel.addEventListener("change", () => send("gpu", /** @type {HTMLSelectElement} */ (gpuSel).value));

    // --- numbers ---------------------------------------------------------------------
    /** @type {Record<string, HTMLElement>} */
    const numberFields = {};
    for (const [name, label, kind, min, step, hint] of NUMBERS) {
      const optional = kind === "int?" || kind === "float?";
      const float = kind === "float" || kind === "float?";
      const inp = /** @type {HTMLInputElement} */ (h("input", {
        type: "number", min, step, inputmode: float ? "decimal" : "numeric",
        placeholder: kind === "int?" ? "all" : kind === "float?" ? "none" : undefined,
      }));
      inp.addEventListener("change", () => {
        const raw = inp.value.trim();
        if (raw === "" && optional) { inp.removeAttribute("aria-invalid"); send(name, null); return; }
        const v = Number(raw);
        const ok = raw !== "" && isFinite(v) && (float || Number.isInteger(v));
        if (!ok) {
          inp.setAttribute("aria-invalid", "true");
          inp.title = float ? "enter a number" : "enter a whole number";
          return;
        }
        inp.removeAttribute("aria-invalid");
        send(name, v);
      });
      numberFields[name] = field(name, /** @type {string} */ (label), inp, /** @type {string | undefined} */ (hint));
    }

    // --- checkboxes and checkbox groups ----------------------------------------------
    /** @param {string} name @param {string} label @param {string} hint */
    const checkbox = (name, label, hint) => {
      const cb = /** @type {HTMLInputElement} */ (h("input", { type: "checkbox" }));
      cb.addEventListener("change", () => send(name, cb.checked));
      const f = field(name, label, cb, hint);
      f.classList.add("vw-check");
      return f;
    };
    /**
     * A fieldset of checkboxes whose checked values form a list trait.
     * @param {string} name @param {string} legend
     */
    const checkGroup = (name, legend) => {
      const fs = h("fieldset", { class: "vw-checks", testid: `control-${name}`, "data-field": name }, [
        h("legend", { text: legend }),
      ]);
      controls[name] = fs;
      return fs;
    };
    const groupsFs = checkGroup("quantized_groups", "Quantized module groups");
    const targetsFs = checkGroup("lora_targets", "LoRA targets");
    const allTargets = /** @type {HTMLInputElement} */ (h("input", {
      type: "checkbox", id: `${id}-lora_targets-all`, testid: "control-lora_targets-all",
    }));
    const targetsList = h("div", { class: "vw-checklist" });
    targetsFs.append(h("div", { class: "vw-check" }, [
      allTargets, h("label", { for: allTargets.id, text: "every linear layer" }),
    ]), targetsList);
    const checkedValues = (/** @type {HTMLElement} */ box) =>
      [...box.querySelectorAll("input[type=checkbox]:checked")].map((x) => /** @type {HTMLInputElement} */ (x).value);
    allTargets.addEventListener("change", () => {
      if (allTargets.checked) send("lora_targets", null);
      else {
        const picked = checkedValues(targetsList);
        send("lora_targets", picked.length ? picked : (model.get("options").lora_targets || []).map((/** @type {Choice} */ c) => c[0]));
      }
    });
    groupsFs.addEventListener("change", () => send("quantized_groups", checkedValues(groupsFs)));
    targetsList.addEventListener("change", () => send("lora_targets", checkedValues(targetsList)));

    // --- mode: training or inference (a segmented pair of radios) ------------------------
    const modeRow = h("div", { class: "vw-seg-row" });
    const modeFs = h("fieldset", { class: "vw-mode", testid: "control-mode", "data-field": "mode", role: "radiogroup" }, [
      h("legend", { text: "Estimate the memory of" }), modeRow,
    ]);
    controls.mode = modeFs;
    /** @type {Record<string, HTMLInputElement>} */
    const modeRadios = {};
    for (const [v, label, hint] of [["training", "Training", "One training step: weights, gradients, optimizer states, activations"],
      ["inference", "Inference", "generate() or a serving budget: weights and the KV cache"]]) {
      const rb = /** @type {HTMLInputElement} */ (h("input", {
        type: "radio", name: `${id}-mode`, value: v, id: `${id}-mode-${v}`, testid: `control-mode-${v}`,
      }));
      rb.addEventListener("change", () => { if (rb.checked) send("mode", v); });
      modeRadios[v] = rb;
      modeRow.append(h("label", { class: "vw-seg", for: rb.id, title: hint }, [rb, label]));
    }

    const fsTraining = h("fieldset", { class: "vw-group", "data-mode": "training" }, [
      h("legend", { text: "Training" }),
      selectFields.method, selectFields.precision, selectFields.optimizer,
      selectFields.gradient_checkpointing, selectFields.attn_implementation,
    ]);
    const fsInference = h("fieldset", { class: "vw-group", "data-mode": "inference" }, [
      h("legend", { text: "Inference" }),
      selectFields.weights, selectFields.kv_cache_dtype,
    ]);
    const fsBatch = h("fieldset", { class: "vw-group" }, [
      h("legend", { text: "Batch" }),
      numberFields.batch_size, numberFields.seq_len, numberFields.context_len,
      numberFields.grad_accum_steps, numberFields.trainable_layers,
    ]);
    for (const [name, mode] of Object.entries(MODE_OF)) numberFields[name].dataset.mode = mode;
    const fsParallel = h("fieldset", { class: "vw-group", "data-mode": "training" }, [
      h("legend", { text: "Multi-GPU training" }),
      numberFields.num_gpus, selectFields.strategy, numberFields.tensor_parallel,
      numberFields.pipeline_parallel,
      checkbox("offload_optimizer", "Optimizer states on the CPU", "DeepSpeed ZeRO-Offload (ZeRO-1, 2 or 3)"),
      checkbox("offload_params", "Parameters on the CPU", "ZeRO-3 parameter offload or FSDP CPUOffload"),
    ]);
    const fsQuant = h("fieldset", { class: "vw-group", "data-mode": "training" }, [
      h("legend", { text: "Quantization" }),
      selectFields.quantization,
      checkbox("double_quant", "Double quantization", "Quantize the 4-bit quantization constants too"),
      checkbox("prepare_kbit", "prepare_model_for_kbit_training", "Upcasts non-quantized parameters to fp32"),
      groupsFs,
    ]);
    const fsLora = h("fieldset", { class: "vw-group", "data-mode": "training" }, [
      h("legend", { text: "LoRA" }),
      numberFields.lora_r, numberFields.lora_alpha, numberFields.lora_dropout, targetsFs,
    ]);
    const fsGpu = h("fieldset", { class: "vw-group" }, [
      h("legend", { text: "GPU" }),
      field("gpu", "Fit on", gpuSel, "Draws the GPU's memory on the charts; with several GPUs, each is this kind"),
      numberFields.gpu_memory_utilization,
    ]);
    form.append(modeFs, fsModel, fsTraining, fsInference, fsBatch, fsGpu, fsParallel, fsQuant, fsLora);

    // --- charts, table, number formats -----------------------------------------------
    /** @type {Record<string, ChartSlot>} */
    const slots = {};
    const chartsBox = h("div", { class: "vw-charts" });
    /** @type {Record<string, HTMLElement>} */
    const chartTitles = {};
    for (const [name, title] of CHARTS) {
      const target = h("div", { class: "vw-chart", testid: `chart-${name}` });
      chartTitles[name] = h("h4", { text: title });
      chartsBox.append(h("section", { class: "vw-chart-box" }, [chartTitles[name], target]));
      slots[name] = { el: target, view: null, token: 0, pending: null };
    }
    const tableBox = h("div", { class: "vw-table", testid: "table" });
    const formatsBox = h("details", { class: "vw-formats", testid: "formats" });
    const suggBox = h("section", { class: "vw-suggestions", testid: "suggestions", hidden: true, "aria-live": "polite" });

    const main = h("div", { class: "vw-main" }, [suggBox, chartsBox, tableBox, formatsBox]);
    root.append(errorBox, summaryBox, h("div", { class: "vw-layout" }, [form, main]));
    el.append(root);

    // --- model -> DOM ---------------------------------------------------------------
    /**
     * Replace a select's choices, keeping its value.
     * @param {HTMLSelectElement} sel @param {Choice[]} choices @param {string} value
     */
    const fillSelect = (sel, choices, value) => {
      const key = JSON.stringify(choices);
      if (sel.dataset.choices !== key) {
        sel.replaceChildren(...choices.map(([v, l]) => h("option", { value: v, text: l })));
        sel.dataset.choices = key;
      }
      if (![...sel.options].some((o) => o.value === value)) {
        sel.append(h("option", { value, text: value }));  // an unknown value stays visible
        sel.dataset.choices = "";
      }
      sel.value = value;
    };
    /**
     * @param {HTMLElement} box @param {string} name @param {Choice[]} choices
     * @param {string[] | null} picked
     */
    const fillChecks = (box, name, choices, picked) => {
      const key = JSON.stringify(choices);
      if (box.dataset.choices !== key) {
        box.querySelectorAll(".vw-check-item").forEach((n) => n.remove());
        for (const [v, l] of choices) {
          const cb = h("input", { type: "checkbox", value: v, id: `${id}-${name}-${v}`, testid: `control-${name}-${v}` });
          box.append(h("div", { class: "vw-check vw-check-item" }, [cb, h("label", { for: cb.id, text: l })]));
        }
        box.dataset.choices = key;
      }
      const set = new Set(picked || []);
      box.querySelectorAll(".vw-check-item input").forEach((n) => {
        const cb = /** @type {HTMLInputElement} */ (n);
        cb.checked = picked === null ? true : set.has(cb.value);
      });
    };

    const syncOptions = () => {
      const opts = model.get("options") || {};
      for (const [name] of SELECTS) {
        fillSelect(/** @type {HTMLSelectElement} */ (controls[name]), opts[name] || [], model.get(name));
      }
      fillSelect(/** @type {HTMLSelectElement} */ (gpuSel), [["", "(none)"], ...(opts.gpus || [])], model.get("gpu"));
      datalist.replaceChildren(...(opts.presets || []).map((/** @type {Choice} */ [v, l]) => h("option", { value: v, label: l || v })));
      fillChecks(groupsFs, "quantized_groups", opts.quantized_groups || [], model.get("quantized_groups"));
      fillChecks(targetsList, "lora_targets", opts.lora_targets || [], model.get("lora_targets"));
      allTargets.checked = model.get("lora_targets") === null;
      syncDisabled();
    };

    const syncInputs = () => {
      const active = el.ownerDocument.activeElement;
      if (active !== modelInput) modelInput.value = model.get("model") || "";
      if (active !== configText) configText.value = model.get("config_json") || "";
      configBox.toggleAttribute("open", !!(model.get("config_json") || "").trim() || configBox.hasAttribute("open"));
      for (const [name] of NUMBERS) {
        const inp = /** @type {HTMLInputElement} */ (controls[name]);
        const v = model.get(name);
        if (active === inp && inp.getAttribute("aria-invalid") === "true") continue;  // keep the typing
        inp.value = v === null ? "" : String(v);
        inp.removeAttribute("aria-invalid");
      }
      for (const name of CHECKBOXES) {
        /** @type {HTMLInputElement} */ (controls[name]).checked = !!model.get(name);
      }
      syncMode();
      syncOptions();
    };

    /** Show the controls of the current mode; the attention choice serves both. */
    const syncMode = () => {
      const mode = model.get("mode") === "inference" ? "inference" : "training";
      root.dataset.vwMode = mode;
      for (const [v, rb] of Object.entries(modeRadios)) rb.checked = v === model.get("mode");
      root.querySelectorAll("[data-mode]").forEach((n) => {
        /** @type {HTMLElement} */ (n).hidden = /** @type {HTMLElement} */ (n).dataset.mode !== mode;
      });
      const home = mode === "inference" ? fsInference : fsTraining;
      if (selectFields.attn_implementation.parentElement !== home) home.append(selectFields.attn_implementation);
    };

    const syncDisabled = () => {
      const off = model.get("disabled") || {};
      const errField = model.get("error") ? model.get("error_field") : "";
      for (const [name, ctl] of Object.entries(controls)) {
        const reason = off[name];
        const wrap = /** @type {HTMLElement} */ (ctl.closest("[data-field]") || ctl);
        ctl.toggleAttribute("disabled", !!reason);
        if (reason) {
          ctl.title = reason;
          ctl.dataset.disabledReason = reason;
          wrap.title = reason;
        } else {
          ctl.removeAttribute("title");
          delete ctl.dataset.disabledReason;
          wrap.removeAttribute("title");
        }
        wrap.classList.toggle("vw-off", !!reason);
        wrap.classList.toggle("vw-bad", name === errField);
      }
      targetsList.querySelectorAll("input").forEach((n) => {
        n.toggleAttribute("disabled", !!off.lora_targets || allTargets.checked);
      });
      allTargets.toggleAttribute("disabled", !!off.lora_targets);
    };

    const syncError = () => {
      const msg = model.get("error") || "";
      errorBox.textContent = msg ? `⚠ ${msg} (showing the last valid estimate)` : "";
      errorBox.hidden = !msg;
      syncDisabled();
    };

    const syncSummary = () => {
      const s = model.get("summary") || {};
      const par = s.parallel || null;
      const inf = s.inference || null;
      const titles = inf ? TITLES.inference : par ? TITLES.parallel : null;
      for (const [name, title] of CHARTS) {
        chartTitles[name].textContent = (titles && titles[/** @type {"detail"} */ (name)]) || title;
      }
      if (s.peak_gib === undefined) { summaryBox.textContent = ""; return; }
      const fit = s.fits === null || s.fits === undefined ? null
        : h("span", { class: `vw-badge ${s.fits ? "vw-fits" : "vw-over"}`, "data-fits": String(s.fits),
          text: s.fits ? `fits ${par ? `${par.num_gpus} × ` : ""}${s.gpu}: ${fmtGiB(s.headroom_gib)} to spare`
            : `does not fit ${par ? `${par.num_gpus} × ` : ""}${s.gpu}: ${fmtGiB(-s.headroom_gib)} over` });
      const perGpu = par ? ` per GPU (the worst of ${par.num_gpus})` : "";
      const head = h("div", { class: "vw-headline" }, [
        h("span", { class: "vw-peak", "data-peak-gib": s.peak_gib.toFixed(4) }, [
          h("strong", { text: fmtGiB(s.peak_gib) }), ` peak allocated${perGpu}, at ${s.peak_phase_label}`,
        ]),
        h("span", { title: "what nvidia-smi would show: memory PyTorch's caching allocator reserves (allocated + cached blocks) plus the CUDA context",
          text: `device total ${fmtGiB(s.device_total_gib)} (reserved by PyTorch ${fmtGiB(s.reserved_gib)} + CUDA context ${fmtGiB(s.cuda_context_gib)})` }),
        ...(fit ? [fit] : []),
      ]);
      const params = inf ? `${fmtCount(s.params_total)} parameters`
        : `${fmtCount(s.params_total)} parameters, ${fmtCount(s.params_trainable)} trainable`;
      const sub = h("div", { class: "vw-sub", text: `${s.model} · ${params}` + (!inf && s.recompute_overhead ? ` · recompute +${Math.round(100 * s.recompute_overhead)}% compute` : "") });
      /** @type {HTMLElement[]} */
      const facts = [];
      if (par) {
        const parts = [`${par.strategy_label} on ${par.num_gpus} GPU${par.num_gpus > 1 ? "s" : ""}`];
        const dims = [`${par.data_parallel} data-parallel`];
        if (par.tensor_parallel > 1) dims.push(`${par.tensor_parallel} tensor-parallel`);
        if (par.pipeline_parallel > 1) dims.push(`${par.pipeline_parallel} pipeline stages`);
        parts.push(dims.join(" × "));
        if (par.shard > 1) parts.push(`model states sharded ${par.shard} ways`);
        if (par.nodes > 1) parts.push(`${par.nodes} nodes`);
        const cpu = par.cpu_per_gpu_gib > 0
          ? h("span", { class: "vw-cpu", title: "host memory the offloaded states need; per node with the framework's buffer factor",
            text: `CPU offload: ${fmtGiB(par.cpu_per_gpu_gib)} per GPU, ${fmtGiB(par.cpu_per_node_gib)} per node` })
          : null;
        facts.push(h("div", { class: "vw-fact", testid: "parallel" }, [parts.join(" · "), ...(cpu ? [" · ", cpu] : [])]));
        if (par.stages && par.stages.length) {
          const rows = par.stages.map((/** @type {any} */ st) => h("tr", { class: st.worst ? "vw-worst" : undefined }, [
            h("th", { scope: "row", text: `${st.stage + 1}${st.worst ? " (worst)" : ""}` }),
            h("td", { text: st.layers }),
            h("td", { text: st.holds || "–" }),
            h("td", { class: "vw-num", text: String(st.in_flight) }),
            h("td", { class: "vw-num", text: fmtGiB(st.peak_gib) }),
            h("td", { class: "vw-num", text: fmtGiB(st.device_total_gib) }),
            ...(par.cpu_per_gpu_gib > 0 ? [h("td", { class: "vw-num", text: fmtGiB(st.cpu_gib) })] : []),
          ]));
          const cols = ["stage", "layers", "also holds", "micro-batches in flight", "peak", "device total",
            ...(par.cpu_per_gpu_gib > 0 ? ["CPU"] : [])];
          facts.push(h("table", { class: "vw-stages", testid: "stages" }, [
            h("caption", { text: "Pipeline stages (1F1B), per GPU" }),
            h("thead", {}, [h("tr", {}, cols.map((c) => h("th", { scope: "col", text: c })))]),
            h("tbody", {}, rows),
          ]));
        }
      }
      if (s.max_batch_size !== null && s.max_batch_size !== undefined && !inf) {
        facts.push(h("div", { class: "vw-fact", testid: "max-batch", "data-value": String(s.max_batch_size),
          text: s.max_batch_size > 0 ? `largest micro-batch that fits ${s.gpu}: ${fmtInt(s.max_batch_size)} (at sequence length ${fmtInt(model.get("seq_len"))})`
            : `not even a micro-batch of 1 fits ${s.gpu}` }));
      }
      if (inf) {
        facts.push(h("div", { class: "vw-fact", testid: "kv-cache", "data-kv-bytes": String(inf.kv_cache_bytes) }, [
          "KV cache ", h("strong", { text: fmtPerToken(inf.kv_bytes_per_token) }), " per token",
          ` (${inf.kv_cache_dtype}); ${fmtInt(inf.context_len)} tokens × batch ${inf.batch_size}: `,
          h("strong", { text: fmtGiB(inf.kv_cache_gib) }),
          ` · weights (${inf.weights}) ${fmtGiB(inf.weights_gib)}`,
        ]));
        if (inf.serving) {
          const sv = inf.serving;
          facts.push(h("div", { class: "vw-fact", testid: "serving",
            text: `serving at ${Math.round(100 * sv.gpu_memory_utilization)}% of the GPU: ${fmtInt(sv.kv_tokens)} KV tokens, ${fmtInt(sv.max_concurrent_sequences)} sequences of ${fmtInt(sv.context_len)} tokens at once` }));
        }
        if (inf.longest_context !== null && inf.longest_context !== undefined) {
          const limit = inf.max_position_embeddings;
          const extra = inf.longest_context_capped ? " (the search limit)" : limit && inf.longest_context > limit ? ` (the model's position limit is ${fmtInt(limit)})` : "";
          facts.push(h("div", { class: "vw-fact", testid: "longest-context", "data-value": String(inf.longest_context) }, [
            `longest context that fits ${s.gpu}: `, h("strong", { text: `${fmtInt(inf.longest_context)} tokens` }),
            `${inf.batch_size > 1 ? ` (batch ${inf.batch_size})` : ""}${extra}`,
          ]));
        }
      }
      const notes = [...(s.warnings || []).map((/** @type {string} */ w) => h("li", { class: "vw-warn", text: w })),
        ...(s.notes || []).map((/** @type {string} */ n) => h("li", { text: n }))];
      summaryBox.replaceChildren(head, sub, ...facts, ...(notes.length ? [h("ul", { class: "vw-notes" }, notes)] : []));
      syncSuggestions();
    };

    const syncSuggestions = () => {
      const status = model.get("suggestions_status") || "";
      const items = model.get("suggestions") || [];
      const s = model.get("summary") || {};
      suggBox.hidden = !status;
      suggBox.dataset.status = status;
      if (!status) { suggBox.replaceChildren(); return; }
      const where = s.parallel ? `${s.parallel.num_gpus} × ${s.gpu}` : s.gpu || "the GPU";
      const headline = h("h4", { text: `Does not fit ${where}: single changes that lower the memory` });
      /** @type {HTMLElement} */
      let body;
      if (status === "computing") body = h("p", { class: "vw-sub", text: "working out which changes make it fit…" });
      else if (status.startsWith("failed")) body = h("p", { class: "vw-warn", text: status });
      else if (!items.length) body = h("p", { class: "vw-sub", text: "no single change found that lowers the memory" });
      else {
        body = h("table", {}, [
          h("thead", {}, [h("tr", {}, ["change", "saves", "total", "", "cost", ""].map((c) => h("th", { scope: "col", text: c })))]),
          h("tbody", {}, items.map((/** @type {any} */ x, /** @type {number} */ i) => {
            const apply = h("button", { type: "button", testid: `suggestion-apply-${i}`, text: "apply",
              title: `set ${Object.entries(x.changes).map(([k, v]) => `${k} = ${v}`).join(", ")}` });
            apply.addEventListener("click", () => {
              for (const [k, v] of Object.entries(x.changes)) model.set(k, v);
              model.save_changes();
            });
            return h("tr", { testid: `suggestion-${i}`, "data-fits": String(x.fits) }, [
              h("td", { text: x.title }),
              h("td", { class: "vw-num", text: `−${fmtGiB(x.saved_gib)}` }),
              h("td", { class: "vw-num", text: fmtGiB(x.device_total_gib) }),
              h("td", { class: x.fits ? "vw-yes" : "vw-no", text: x.fits ? "✓ fits" : "✗ not enough" }),
              h("td", { class: "vw-note", text: x.cost }),
              h("td", {}, [apply]),
            ]);
          })),
        ]);
      }
      suggBox.replaceChildren(headline, body);
    };

    const syncTable = () => {
      const rows = model.get("table") || [];
      const total = rows.reduce((/** @type {number} */ a, /** @type {any} */ r) => a + r.gib, 0);
      const body = rows.map((/** @type {any} */ r) => h("tr", { title: (r.groups || []).map((/** @type {any} */ g) => `${g.name}: ${fmtGiB(g.gib)}`).join("\n") }, [
        h("td", {}, [h("span", { class: "vw-swatch", style: `background:${r.color}` }), r.component]),
        h("td", { class: "vw-num", text: fmtGiB(r.gib) }),
        h("td", { class: "vw-num", text: `${(100 * r.share).toFixed(1)}%` }),
        h("td", { class: "vw-groups", text: (r.groups || []).slice(0, 4).map((/** @type {any} */ g) => `${g.name} ${fmtGiB(g.gib)}`).join(", ") }),
      ]));
      tableBox.replaceChildren(h("table", {}, [
        h("caption", { text: `Memory live at the peak, by component${(model.get("summary") || {}).parallel ? " (one GPU: the worst)" : ""}` }),
        h("thead", {}, [h("tr", {}, ["component", "GiB", "share", "largest parts"].map((c) => h("th", { scope: "col", text: c })))]),
        h("tbody", {}, body),
        h("tfoot", {}, [h("tr", {}, [h("th", { scope: "row", text: "total" }), h("td", { class: "vw-num", text: fmtGiB(total) }), h("td", { class: "vw-num", text: "100%" }), h("td")])]),
      ]));
    };

    const syncFormats = () => {
      const fmts = model.get("formats") || [];
      const bits = (/** @type {any} */ f) => {
        const spans = [h("span", { class: "vw-bit vw-bit-s", title: "sign" })];
        for (let i = 0; i < f.exponent; i++) spans.push(h("span", { class: "vw-bit vw-bit-e", title: "exponent" }));
        for (let i = 0; i < f.mantissa; i++) spans.push(h("span", { class: "vw-bit vw-bit-m", title: f.exponent ? "mantissa" : "value" }));
        return h("span", { class: "vw-bits", "aria-label": `${f.bits} bits` }, spans);
      };
      const body = fmts.map((/** @type {any} */ f) => h("tr", {}, [
        h("th", { scope: "row", text: f.name }),
        h("td", {}, [bits(f)]),
        h("td", { class: "vw-num", text: f.exponent ? `1 / ${f.exponent} / ${f.mantissa}` : `${f.bits}-bit` }),
        h("td", { class: "vw-num", text: fmtNum(f.max) }),
        h("td", { class: "vw-num", text: fmtNum(f.min_normal) }),
        h("td", { class: "vw-num", text: fmtNum(f.epsilon) }),
        h("td", { class: "vw-num", text: String(f.decimal_digits) }),
        h("td", { class: "vw-note", text: f.note }),
      ]));
      const open = formatsBox.hasAttribute("open");
      formatsBox.replaceChildren(
        h("summary", { text: "Number formats: bits, range, precision" }),
        h("table", {}, [
          h("thead", {}, [h("tr", {}, ["format", "bits", "sign/exp/mantissa", "max", "min normal", "epsilon", "digits", ""].map((c) => h("th", { scope: "col", text: c })))]),
          h("tbody", {}, body),
        ]));
      formatsBox.toggleAttribute("open", open);
    };

    // --- charts: embed once per spec, then swap rows in place ---------------------------
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

    // --- subscriptions: one loop over the traits -------------------------------------
    for (const name of INPUT_TRAITS) on(`change:${name}`, syncInputs);
    on("change:options", syncOptions);
    on("change:disabled", syncDisabled);
    on("change:error", syncError);
    on("change:error_field", syncDisabled);
    on("change:summary", syncSummary);
    on("change:suggestions", syncSuggestions);
    on("change:suggestions_status", syncSuggestions);
    on("change:table", syncTable);
    on("change:formats", syncFormats);
    on("change:rows", updateRows);
    on("change:specs", embedAll);

    syncInputs();
    syncError();
    syncSummary();
    syncTable();
    syncFormats();
    // embed after the element is attached so the theme colours can be read
    requestAnimationFrame(() => { theme = themeOf(root); embedAll(); });

    return () => {
      for (const [ev, cb] of handlers) model.off(ev, cb);
      observer.disconnect();
      for (const slot of Object.values(slots)) {
        slot.token++;
        if (slot.view) slot.view.finalize();
        slot.view = null;
      }
    };
  },
};
