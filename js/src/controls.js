// @ts-check
/**
 * The controls panel: model, training, inference, batch, GPU, multi-GPU, quantization and
 * LoRA fieldsets. Each control reports one trait (ctx.send); the model's traits set the
 * controls back (syncInputs), their choices (syncOptions) and which ones apply now
 * (syncDisabled: a disabled control carries its reason as title and data-disabled-reason).
 */
import { h } from "./dom.js";

/** @typedef {import("./types.js").Ctx} Ctx @typedef {import("./types.js").Choice} Choice */

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
  ["engine", "Engine", "generate(), or a serving engine whose start-up memory profile sizes the KV cache"],
  ["stack", "Stack", "Training stack: its defaults and where its code keeps other tensors"],
  ["loss", "Loss", "Cross-entropy: full logits, chunked, or Liger's fused linear cross-entropy"],
  ["lora_variant", "LoRA variant", "LoRA or DoRA (weight-decomposed)"],
];

/**
 * Number inputs: trait, short label, kind ("int" | "float" | "int?" | "float?"), min, step,
 * hint (the tooltip), max (optional). A value outside [min, max] is refused here and named
 * in the banner.
 */
const NUMBERS = [
  ["batch_size", "Batch size", "int", 1, 1, "Micro-batch: sequences per forward pass (per GPU replica)"],
  ["seq_len", "Sequence", "int", 1, 1, "Sequence length: tokens per sequence (an encoder-decoder's input)"],
  ["target_len", "Target", "int?", 1, 1, "Encoder-decoders (T5, BART): target tokens per sample, what the decoder, head and loss read (blank: as long as the sequence)"],
  ["context_len", "Context", "int", 1, 1, "Context length: tokens per sequence at the end of generation (prompt + generated)"],
  ["grad_accum_steps", "Grad. accum.", "int", 1, 1, "Gradient accumulation steps (same peak, more sequences per step)"],
  ["lora_r", "LoRA rank", "int", 1, 1, "LoRA rank r"],
  ["lora_alpha", "LoRA alpha", "float", 0, "any", "LoRA alpha (scales the update; no memory effect)"],
  ["lora_dropout", "LoRA dropout", "float", 0, 0.05, "LoRA dropout probability, in [0, 1)", 0.99],
  ["trainable_layers", "Last layers", "int?", 1, 1, "Method 'last layers': how many of the last layers train (blank: all)"],
  ["loss_chunks", "Loss chunks", "int", 1, 1, "Chunks of the chunked cross-entropy"],
  ["num_gpus", "GPUs", "int", 1, 1, "GPUs of the run; above 1 needs a data-parallel strategy (DDP is picked)"],
  ["tensor_parallel", "Tensor par.", "int", 1, 1, "Tensor parallel: heads, MLP width and vocabulary split over this many GPUs"],
  ["pipeline_parallel", "Pipeline", "int", 1, 1, "Pipeline stages: layers split into this many stages (1F1B)"],
  ["max_gpus", "Max GPUs", "int", 1, 1, "The most GPUs a suggestion may use (8: one node)"],
  ["gpu_memory_utilization", "Serving", "float?", 0.05, 0.05, "Serving budget. Blank: generate(). A fraction such as 0.9: a vLLM-style server whose paged KV cache fills that share of the GPU", 1],
];

/** Placeholders of optional number boxes whose blank is not "all" / "none". */
const BLANK_MEANS = { target_len: "= sequence" };
/**
 * Controls that exist only for some models: hidden (not greyed) while ``disabled`` says they
 * do not apply, e.g. an encoder-decoder's target length for a decoder-only model.
 */
const MODEL_ONLY = ["target_len"];

/** Controls (and groups) shown in one mode only; the other mode hides them. */
const MODE_OF = {
  seq_len: "training", grad_accum_steps: "training", trainable_layers: "training",
  context_len: "inference", gpu_memory_utilization: "inference",
};
const CHECKBOXES = ["double_quant", "prepare_kbit", "offload_optimizer", "offload_params",
  "activation_offloading", "optimizer_in_backward", "packing", "compile"];

/**
 * @param {Ctx} ctx
 * @returns {{ el: HTMLElement, syncInputs: () => void, syncOptions: () => void, syncDisabled: () => void }}
 */
export function controlsPanel(ctx) {
  const { model, el, root, id, send, setLocalError } = ctx;
  /** @type {Record<string, HTMLElement>} every control by trait name */
  const controls = {};
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
  const commitModel = () => {
    const v = modelInput.value.trim();
    if (v && v !== model.get("model")) send("model", v);
  };
  modelInput.addEventListener("change", commitModel);
  // Enter commits (a datalist input does not always fire change on Enter)
  modelInput.addEventListener("keydown", (e) => { if (e.key === "Enter") { e.preventDefault(); commitModel(); } });
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
    field("model", "Model", modelInput, "Preset or Hub id: type to search the presets; or a Hub id, e.g. meta-llama/Llama-3.1-8B, or a size like 7B"),
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
  for (const [name, label, kind, min, step, hint, max] of NUMBERS) {
    const optional = kind === "int?" || kind === "float?";
    const float = kind === "float" || kind === "float?";
    const inp = /** @type {HTMLInputElement} */ (h("input", {
      type: "number", min, max, step, inputmode: float ? "decimal" : "numeric",
      placeholder: BLANK_MEANS[/** @type {keyof typeof BLANK_MEANS} */ (name)]
        || (kind === "int?" ? "all" : kind === "float?" ? "none" : undefined),
    }));
    const commit = () => {
      const raw = inp.value.trim();
      if (raw === "" && optional) { inp.removeAttribute("aria-invalid"); setLocalError(name, ""); send(name, null); return; }
      const v = Number(raw);
      /** @type {string} */
      let why = "";
      if (raw === "" || !isFinite(v)) why = `${raw === "" ? "an empty box" : JSON.stringify(raw)} is not a number`;
      else if (!float && !Number.isInteger(v)) why = `${raw} is not a whole number`;
      else if (v < /** @type {number} */ (min)) why = `${raw} is below the minimum ${min}`;
      else if (max !== undefined && v > /** @type {number} */ (max)) why = `${raw} is above the maximum ${max}`;
      if (why) {
        inp.setAttribute("aria-invalid", "true");
        setLocalError(name, `${name}: ${why}; still using ${name} = ${model.get(name) === null ? "none" : model.get(name)}`);
        return;
      }
      inp.removeAttribute("aria-invalid");
      setLocalError(name, "");
      if (v !== model.get(name)) send(name, v);
    };
    inp.addEventListener("change", commit);
    inp.addEventListener("keydown", (e) => { if (e.key === "Enter") { e.preventDefault(); commit(); } });
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
    selectFields.weights, selectFields.kv_cache_dtype, selectFields.engine,
  ]);
  const fsBatch = h("fieldset", { class: "vw-group" }, [
    h("legend", { text: "Batch" }),
    numberFields.batch_size, numberFields.seq_len, numberFields.target_len, numberFields.context_len,
    numberFields.grad_accum_steps, numberFields.trainable_layers,
  ]);
  for (const [name, mode] of Object.entries(MODE_OF)) numberFields[name].dataset.mode = mode;
  const fsParallel = h("fieldset", { class: "vw-group", "data-mode": "training" }, [
    h("legend", { text: "Multi-GPU training" }),
    numberFields.num_gpus, selectFields.strategy, numberFields.tensor_parallel,
    numberFields.pipeline_parallel, numberFields.max_gpus,
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
  const fsKnobs = h("fieldset", { class: "vw-group", "data-mode": "training" }, [
    h("legend", { text: "Stack and memory savers" }),
    selectFields.stack, selectFields.loss, numberFields.loss_chunks, selectFields.lora_variant,
    checkbox("activation_offloading", "Offload activations", "Saved activations in CPU memory (torchtune)"),
    checkbox("optimizer_in_backward", "Optimizer in backward", "Step each parameter as its gradient is ready"),
    checkbox("packing", "Packed sequences", "No padding: varlen attention (FlashAttention 2 on HF)"),
    checkbox("compile", "torch.compile", "Modelled with full checkpointing: the fused cross-entropy"),
  ]);
  const fsGpu = h("fieldset", { class: "vw-group" }, [
    h("legend", { text: "GPU" }),
    field("gpu", "Fit on", gpuSel, "Draws the GPU's memory on the charts; with several GPUs, each is this kind"),
    numberFields.gpu_memory_utilization,
  ]);
  form.append(modeFs, fsModel, fsTraining, fsInference, fsBatch, fsGpu, fsParallel, fsQuant, fsLora, fsKnobs);

  // --- model -> DOM ---------------------------------------------------------------
  /**
   * Replace a select's choices, keeping its value.
   * @param {HTMLSelectElement} sel @param {Choice[]} choices @param {string} value
   */
  const fillSelect = (sel, choices, value) => {
    const key = JSON.stringify(choices);
    if (sel.dataset.choices !== key) {
      sel.replaceChildren(...choices.map(([v, l, long]) => h("option", { value: v, text: l, title: long || l })));
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
    fillSelect(/** @type {HTMLSelectElement} */ (gpuSel), [["", "(none)", "no GPU: the verdict row shows common GPUs"], ...(opts.gpus || [])], model.get("gpu"));
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
    // one replica's GPUs (tensor parallel x pipeline stages) serve both modes
    const tpHome = mode === "inference" ? fsInference : fsParallel;
    for (const f of [numberFields.tensor_parallel, numberFields.pipeline_parallel]) {
      if (f.parentElement !== tpHome) tpHome.append(f);
    }
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
        if (ctl.tagName === "SELECT") {  // the chosen option's long label as the tooltip
          const o = /** @type {HTMLSelectElement} */ (ctl).selectedOptions[0];
          ctl.title = o ? o.title : "";
        } else ctl.removeAttribute("title");
        delete ctl.dataset.disabledReason;
        wrap.removeAttribute("title");
      }
      wrap.classList.toggle("vw-off", !!reason);
      wrap.classList.toggle("vw-bad", name === errField);
      if (MODEL_ONLY.includes(name)) wrap.hidden = !!reason;
    }
    targetsList.querySelectorAll("input").forEach((n) => {
      n.toggleAttribute("disabled", !!off.lora_targets || allTargets.checked);
    });
    allTargets.toggleAttribute("disabled", !!off.lora_targets);
  };

  return { el: form, syncInputs, syncOptions, syncDisabled };
}
