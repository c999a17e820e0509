// @ts-check
/**
 * The controls panel, built from the `controls` trait (Python's one list of the inputs,
 * vramwidget/widget/controls.py): about a dozen core controls in fixed slots (a slot holds
 * a training control and its inference counterpart, so nothing moves when the mode
 * changes), then named groups (<details>) that open on a click and remember whether they
 * are open (localStorage). Each control reports one trait (ctx.send); the model's traits
 * set the controls back (syncInputs), their choices (syncOptions) and which ones apply now
 * (syncDisabled: a disabled control carries its reason as title and data-disabled-reason).
 *
 * A typed number is applied when the typing pauses (or on Enter / Tab); until then its
 * field is marked pending (class vw-pending, "typed: applies when you pause").
 */
import { h } from "./dom.js";

/** @typedef {import("./types.js").Ctx} Ctx @typedef {import("./types.js").Choice} Choice */

/** How long a typed number waits before it is applied (ms). */
const TYPE_PAUSE_MS = 700;
const GROUPS_KEY = "vramwidget:open-groups";

/** @returns {Record<string, boolean>} */
function openGroups() {
  try { return JSON.parse(localStorage.getItem(GROUPS_KEY) || "{}") || {}; } catch (_) { return {}; }
}
/** @param {string} key @param {boolean} open */
function rememberGroup(key, open) {
  try { localStorage.setItem(GROUPS_KEY, JSON.stringify({ ...openGroups(), [key]: open })); } catch (_) { /* private mode */ }
}

/**
 * @param {Ctx} ctx
 * @returns {{ el: HTMLElement, importBox: HTMLElement, names: string[], syncInputs: () => void,
 *   syncOptions: () => void, syncDisabled: () => void, labelOf: (name: string) => string,
 *   textOf: (name: string, value: any) => string, mark: (names: string[]) => void }}
 */
export function controlsPanel(ctx) {
  const { model, el, root, id, send, setLocalError } = ctx;
  /** @type {any[]} */
  const specs = model.get("controls") || [];
  /** @type {any[]} */
  const groupSpecs = model.get("control_groups") || [];
  /** @type {Record<string, any>} */
  const specOf = Object.fromEntries(specs.map((s) => [s.name, s]));
  /** @type {Record<string, HTMLElement>} every control by trait name */
  const controls = {};
  /** @type {Record<string, HTMLElement>} the field (label + control) of each */
  const fields = {};
  /** @type {Record<string, (() => void)>} what sets each control from its trait */
  const setters = {};
  const form = h("form", { class: "vw-controls", "aria-label": "setup" });
  form.addEventListener("submit", (e) => e.preventDefault());

  /** @param {any} spec @param {HTMLElement} input @param {boolean} [labelled] */
  const field = (spec, input, labelled = true) => {
    input.id = `${id}-${spec.name}`;
    if (!input.dataset.testid) input.dataset.testid = `control-${spec.name}`;
    input.setAttribute("name", spec.name);
    controls[spec.name] = input;
    const kids = labelled ? [h("label", { for: input.id, text: spec.label, title: spec.hint }), input] : [input];
    const f = h("div", { class: `vw-field vw-${spec.kind}`, "data-field": spec.name }, kids);
    if (spec.mode) f.dataset.mode = spec.mode;
    fields[spec.name] = f;
    return f;
  };

  // --- one builder per kind -------------------------------------------------------------
  /** @type {Record<string, (spec: any) => HTMLElement>} */
  const build = {
    select: (spec) => {
      const sel = /** @type {HTMLSelectElement} */ (h("select"));
      sel.addEventListener("change", () => send(spec.name, sel.value));
      return field(spec, sel);
    },
    number: (spec) => {
      const float = spec.number === "float";
      const inp = /** @type {HTMLInputElement} */ (h("input", {
        type: "number", min: spec.min, max: spec.max, step: spec.step, inputmode: float ? "decimal" : "numeric",
        placeholder: spec.placeholder || undefined,
      }));
      const f = field(spec, inp);
      /** @type {any} */
      let timer = null;
      const pending = (on) => {
        f.classList.toggle("vw-pending", on);
        if (on) f.title = "typed: applies when you pause (or press Enter)";
        else if (f.title.startsWith("typed")) f.removeAttribute("title");
      };
      /** @param {boolean} quiet  a pause in the typing: say nothing about a half-typed value */
      const commit = (quiet = false) => {
        clearTimeout(timer);
        const raw = inp.value.trim();
        const name = spec.name;
        if (raw === "" && spec.optional) {
          pending(false); inp.removeAttribute("aria-invalid"); setLocalError(name, "");
          if (model.get(name) !== null) send(name, null);
          return;
        }
        const v = Number(raw);
        let why = "";
        if (raw === "" || !isFinite(v)) why = `${raw === "" ? "an empty box" : JSON.stringify(raw)} is not a number`;
        else if (!float && !Number.isInteger(v)) why = `${raw} is not a whole number`;
        else if (v < spec.min) why = `${raw} is below the minimum ${spec.min}`;
        else if (spec.max !== undefined && v > spec.max) why = `${raw} is above the maximum ${spec.max}`;
        if (why) {
          if (quiet) return;
          pending(false);
          inp.setAttribute("aria-invalid", "true");
          const now = model.get(name);
          setLocalError(name, `${name}: ${why}; still using ${name} = ${now === null ? "none" : now}`);
          return;
        }
        pending(false);
        inp.removeAttribute("aria-invalid");
        setLocalError(name, "");
        if (v !== model.get(name)) send(name, v);
      };
      inp.addEventListener("input", () => {
        pending(String(model.get(spec.name) ?? "") !== inp.value.trim());
        clearTimeout(timer);
        timer = setTimeout(() => commit(true), TYPE_PAUSE_MS);
      });
      inp.addEventListener("change", () => commit());
      inp.addEventListener("keydown", (e) => { if (e.key === "Enter") { e.preventDefault(); commit(); } });
      setters[spec.name] = () => {
        const v = model.get(spec.name);
        if (el.ownerDocument.activeElement === inp && (inp.getAttribute("aria-invalid") === "true"
          || f.classList.contains("vw-pending"))) return;   // keep the typing
        inp.value = v === null || v === undefined ? "" : String(v);
        inp.removeAttribute("aria-invalid");
        pending(false);
      };
      return f;
    },
    checkbox: (spec) => {
      const cb = /** @type {HTMLInputElement} */ (h("input", { type: "checkbox" }));
      cb.addEventListener("change", () => send(spec.name, cb.checked));
      setters[spec.name] = () => { cb.checked = !!model.get(spec.name); };
      const f = field(spec, cb);
      f.classList.add("vw-check");
      f.title = spec.hint;
      return f;
    },
    checks: (spec) => {
      const fs = h("fieldset", { class: "vw-checks", testid: `control-${spec.name}`, "data-field": spec.name,
        "data-mode": spec.mode }, [h("legend", { text: spec.label, title: spec.hint })]);
      controls[spec.name] = fs;
      fields[spec.name] = fs;
      const list = h("div", { class: "vw-checklist" });
      /** @type {HTMLInputElement | null} */
      let all = null;
      if (spec.all_label) {
        all = /** @type {HTMLInputElement} */ (h("input", { type: "checkbox", id: `${id}-${spec.name}-all`,
          testid: `control-${spec.name}-all` }));
        fs.append(h("div", { class: "vw-check" }, [all, h("label", { for: all.id, text: spec.all_label })]));
        all.addEventListener("change", () => {
          if (/** @type {HTMLInputElement} */ (all).checked) send(spec.name, null);
          else {
            const picked = checkedValues(list);
            send(spec.name, picked.length ? picked : ((model.get("options") || {})[spec.name] || []).map((/** @type {Choice} */ c) => c[0]));
          }
        });
      }
      fs.append(list);
      list.addEventListener("change", () => send(spec.name, checkedValues(list)));
      fs.dataset.all = all ? "1" : "";
      /** @type {any} */ (fs).vwList = list;
      /** @type {any} */ (fs).vwAll = all;
      return fs;
    },
    model: (spec) => {
      const datalist = h("datalist", { id: `${id}-presets` });
      const inp = /** @type {HTMLInputElement} */ (h("input", {
        type: "text", list: datalist.id, autocomplete: "off", spellcheck: "false",
        placeholder: "preset, Hub id (org/name) or 7B",
      }));
      const commitModel = () => {
        const v = inp.value.trim();
        fields.model.classList.remove("vw-pending");
        if (v && v !== model.get("model")) send("model", v);
      };
      inp.addEventListener("input", () => fields.model.classList.toggle("vw-pending", inp.value.trim() !== model.get("model")));
      inp.addEventListener("change", commitModel);
      inp.addEventListener("keydown", (e) => { if (e.key === "Enter") { e.preventDefault(); commitModel(); } });
      setters.model = () => {
        if (el.ownerDocument.activeElement !== inp) { inp.value = model.get("model") || ""; fields.model.classList.remove("vw-pending"); }
      };
      /** @type {any} */ (inp).vwDatalist = datalist;
      const f = field(spec, inp);
      f.append(datalist);
      return f;
    },
    mode: (spec) => {
      const row = h("div", { class: "vw-seg-row" });
      const fs = h("fieldset", { class: "vw-mode", testid: "control-mode", "data-field": "mode", role: "radiogroup" }, [
        h("legend", { text: spec.label, title: spec.hint }), row,
      ]);
      controls.mode = fs;
      fields.mode = fs;
      /** @type {Record<string, HTMLInputElement>} */
      const radios = {};
      for (const [v, label, hint] of [["training", "Training", "One training step: weights, gradients, optimizer states, activations"],
        ["inference", "Inference", "generate() or a serving budget: weights and the KV cache"]]) {
        const rb = /** @type {HTMLInputElement} */ (h("input", {
          type: "radio", name: `${id}-mode`, value: v, id: `${id}-mode-${v}`, testid: `control-mode-${v}`,
        }));
        rb.addEventListener("change", () => { if (rb.checked) send("mode", v); });
        radios[v] = rb;
        row.append(h("label", { class: "vw-seg", for: rb.id, title: hint }, [rb, label]));
      }
      setters.mode = () => { for (const [v, rb] of Object.entries(radios)) rb.checked = v === model.get("mode"); };
      return fs;
    },
    config: (spec) => {
      const text = /** @type {HTMLTextAreaElement} */ (h("textarea", {
        rows: 3, spellcheck: "false", placeholder: "paste a config.json here", "aria-label": "config.json text",
      }));
      text.addEventListener("change", () => send("config_json", text.value));
      const upload = /** @type {HTMLInputElement} */ (h("input", {
        type: "file", accept: ".json,application/json", testid: "config-upload", "aria-label": "upload a config.json",
      }));
      upload.addEventListener("change", async () => {
        const file = upload.files && upload.files[0];
        if (!file) return;
        text.value = await file.text();
        send("config_json", text.value);
        upload.value = "";
      });
      const clear = h("button", { type: "button", testid: "config-clear", text: "clear config" });
      clear.addEventListener("click", () => { text.value = ""; send("config_json", ""); });
      setters.config_json = () => {
        if (el.ownerDocument.activeElement !== text) text.value = model.get("config_json") || "";
      };
      const f = field(spec, text);
      f.classList.add("vw-wide");
      f.append(h("div", { class: "vw-row" }, [upload, clear]));
      return f;
    },
  };

  const checkedValues = (/** @type {HTMLElement} */ box) =>
    [...box.querySelectorAll("input[type=checkbox]:checked")].map((x) => /** @type {HTMLInputElement} */ (x).value);

  // --- the core slots and the groups ----------------------------------------------------
  const core = h("div", { class: "vw-core", testid: "controls-core" });
  /** @type {HTMLElement[]} */
  const slots = [];
  /** @type {Record<string, HTMLElement>} */
  const groupBody = {};
  /** @type {Record<string, HTMLDetailsElement>} */
  const groupBox = {};
  const remembered = openGroups();
  const groupsEl = h("div", { class: "vw-group-list" });
  for (const g of groupSpecs) {
    const summary = h("summary", { text: g.title, title: g.hint, testid: `group-${g.key}-toggle` });
    const body = h("div", { class: "vw-group-body" });
    const box = /** @type {HTMLDetailsElement} */ (h("details", { class: "vw-group", testid: `group-${g.key}`,
      "data-group": g.key }, [summary, body]));
    if (remembered[g.key]) box.open = true;
    box.addEventListener("toggle", () => rememberGroup(g.key, box.open));
    groupBody[g.key] = body;
    groupBox[g.key] = box;
    groupsEl.append(box);
  }
  for (const spec of specs) {
    const make = build[spec.kind] || build.select;
    const f = make(spec);
    if (spec.group === "core") {
      const i = spec.slot;
      slots[i] = slots[i] || h("div", { class: "vw-slot", "data-slot": String(i) });
      slots[i].append(f);
    } else (groupBody[spec.group] || groupBody[groupSpecs[0].key]).append(f);
  }
  for (const s of slots) if (s) core.append(s);
  form.append(core, groupsEl);
  /** where widget.js puts the training-config import */
  const importBox = groupBody.import || groupsEl;

  // --- model -> DOM ---------------------------------------------------------------------
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
  /** @param {HTMLElement} box @param {string} name @param {Choice[]} choices @param {string[] | null} picked */
  const fillChecks = (box, name, choices, picked) => {
    const key = JSON.stringify(choices);
    if (box.dataset.choices !== key) {
      box.replaceChildren(...choices.map(([v, l]) => {
        const cb = h("input", { type: "checkbox", value: v, id: `${id}-${name}-${v}`, testid: `control-${name}-${v}` });
        return h("div", { class: "vw-check vw-check-item" }, [cb, h("label", { for: cb.id, text: l })]);
      }));
      box.dataset.choices = key;
    }
    const set = new Set(picked || []);
    box.querySelectorAll("input").forEach((n) => {
      const cb = /** @type {HTMLInputElement} */ (n);
      cb.checked = picked === null ? true : set.has(cb.value);
    });
  };

  const syncOptions = () => {
    const opts = model.get("options") || {};
    for (const spec of specs) {
      const ctl = controls[spec.name];
      if (spec.kind === "select") {
        const choices = spec.name === "gpu"
          ? [["", "(none)", "no GPU: the verdict shows the common GPUs"], ...(opts.gpus || [])]
          : opts[spec.name] || [];
        fillSelect(/** @type {HTMLSelectElement} */ (ctl), choices, model.get(spec.name));
      } else if (spec.kind === "checks") {
        const any = /** @type {any} */ (ctl);
        fillChecks(any.vwList, spec.name, opts[spec.name] || [], model.get(spec.name));
        if (any.vwAll) any.vwAll.checked = model.get(spec.name) === null;
      } else if (spec.kind === "model") {
        /** @type {any} */ (ctl).vwDatalist.replaceChildren(...(opts.presets || []).map(
          (/** @type {Choice} */ [v, l]) => h("option", { value: v, label: l || v })));
      }
    }
    syncDisabled();
  };

  /** @type {Record<string, string> | null} the values last shown */
  let shownValues = null;
  const syncInputs = () => {
    for (const spec of specs) (setters[spec.name] || (() => {}))();
    syncMode();
    syncOptions();
    openSetGroups();
  };

  /** A closed group opens when one of its controls is set away from its default elsewhere
   * (from Python, a config, a linked control): at the first drawing, and when it changes. */
  const openSetGroups = () => {
    const off = model.get("disabled") || {};
    const now = Object.fromEntries(specs.map((spec) => [spec.name, JSON.stringify(model.get(spec.name))]));
    for (const spec of specs) {
      if (spec.group === "core" || off[spec.name] || !("default" in spec)) continue;
      const changed = !shownValues || shownValues[spec.name] !== now[spec.name];
      if (changed && now[spec.name] !== JSON.stringify(spec.default)) {
        const box = groupBox[spec.group];
        if (box && !box.open && !box.contains(el.ownerDocument.activeElement)) box.open = true;
      }
    }
    shownValues = now;
  };

  /** Show the controls of the current mode; the others keep their slot's place. */
  const syncMode = () => {
    const mode = model.get("mode") === "inference" ? "inference" : "training";
    root.dataset.vwMode = mode;
    for (const f of Object.values(fields)) {
      if (f.dataset.mode) f.classList.toggle("vw-other-mode", f.dataset.mode !== mode);
    }
    for (const g of groupSpecs) {
      const box = groupBox[g.key];
      const mine = [...groupBody[g.key].querySelectorAll(":scope > [data-field]")];
      box.hidden = !!mine.length && mine.every((f) => /** @type {HTMLElement} */ (f).dataset.mode && /** @type {HTMLElement} */ (f).dataset.mode !== mode);
      /** @type {HTMLElement} */ (box.querySelector("summary")).textContent = mode === "inference" ? g.title_inference : g.title;
    }
    syncSlots();
  };

  /** A slot with nothing to show in this mode keeps its space; one whose control applies
   * to other models only (an encoder-decoder's target length) takes none. */
  const syncSlots = () => {
    for (const s of slots) {
      if (!s) continue;
      const kids = [...s.children].map((x) => /** @type {HTMLElement} */ (x));
      const shown = kids.filter((f) => !f.classList.contains("vw-other-mode") && !f.classList.contains("vw-not-this-model"));
      s.classList.toggle("vw-slot-empty", !shown.length);
      s.hidden = kids.every((f) => f.classList.contains("vw-not-this-model"));
    }
  };

  const syncDisabled = () => {
    const off = model.get("disabled") || {};
    const errField = model.get("error") ? model.get("error_field") : "";
    for (const [name, ctl] of Object.entries(controls)) {
      const reason = off[name];
      const wrap = fields[name] || ctl;
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
        if (!wrap.classList.contains("vw-pending")) wrap.removeAttribute("title");
      }
      wrap.classList.toggle("vw-off", !!reason);
      wrap.classList.toggle("vw-bad", name === errField);
      if ((specOf[name] || {}).hidden_unless_enabled) wrap.classList.toggle("vw-not-this-model", !!reason);
      const any = /** @type {any} */ (ctl);
      if (any.vwList) {
        any.vwList.querySelectorAll("input").forEach((/** @type {HTMLInputElement} */ n) => {
          n.toggleAttribute("disabled", !!reason || (any.vwAll && any.vwAll.checked));
        });
        if (any.vwAll) any.vwAll.toggleAttribute("disabled", !!reason);
      }
    }
    syncSlots();
  };

  /** The label a control is known by ("Base weights"). @param {string} name */
  const labelOf = (name) => (specOf[name] || {}).label || name;
  /** A trait value as the control shows it (a select's option label). @param {string} name @param {any} v */
  const textOf = (name, v) => {
    const opts = (model.get("options") || {})[name === "gpu" ? "gpus" : name];
    const hit = Array.isArray(opts) ? opts.find((/** @type {Choice} */ c) => c[0] === v) : null;
    if (hit) return hit[1];
    if (v === null || v === undefined || v === "") return name === "gpu" ? "none" : "–";
    if (typeof v === "boolean") return v ? "on" : "off";
    if (Array.isArray(v)) return v.join(", ") || "none";
    return String(v);
  };
  /** Mark controls an apply changed (their groups open, a highlight for a few seconds). @param {string[]} names */
  const mark = (names) => {
    for (const f of Object.values(fields)) f.classList.remove("vw-changed");
    for (const name of names) {
      const f = fields[name];
      if (!f) continue;
      f.classList.add("vw-changed");
      const box = /** @type {HTMLDetailsElement | null} */ (f.closest("details.vw-group"));
      if (box && !box.open) box.open = true;
    }
  };

  return { el: form, importBox, names: specs.map((s) => s.name), syncInputs, syncOptions, syncDisabled, labelOf, textOf, mark };
}
