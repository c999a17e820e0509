// @ts-check
/**
 * The training-config panel: paste or upload your own training config (axolotl, torchtune,
 * LLaMA-Factory, LitGPT YAML; HF/TRL or DeepSpeed JSON; accelerate YAML). Its text goes to
 * the `training_config` trait; Python maps it and sets the controls. The report below says
 * what was applied and which fields were not used (vramwidget/widget/trainingconfig.py).
 */
import { h } from "./dom.js";

/** Reasons the report does not list one by one (they are counted). */
const QUIET = ["no effect on memory", "off: no effect on memory", "read: the default, nothing to change"];

/**
 * @param {import("./types.js").Ctx} ctx
 * @returns {{ el: HTMLElement, sync: () => void }}
 */
export function trainingConfigPanel(ctx) {
  const { model, id, send } = ctx;
  const text = /** @type {HTMLTextAreaElement} */ (h("textarea", {
    rows: 4, spellcheck: "false", id: `${id}-training_config`, testid: "control-training_config",
    "aria-label": "training config (YAML or JSON)",
    placeholder: "paste an axolotl / torchtune / LLaMA-Factory / LitGPT YAML, TrainingArguments or DeepSpeed JSON",
  }));
  const apply = h("button", { type: "button", testid: "training-config-apply", text: "apply" });
  // the same text twice is still a request: clear first so the trait changes
  const submit = (/** @type {string} */ value) => { send("training_config", ""); send("training_config", value); };
  apply.addEventListener("click", () => submit(text.value));
  text.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) { e.preventDefault(); submit(text.value); }
  });
  const upload = /** @type {HTMLInputElement} */ (h("input", {
    type: "file", accept: ".yaml,.yml,.json", testid: "training-config-upload",
    "aria-label": "upload a training config",
  }));
  upload.addEventListener("change", async () => {
    const file = upload.files && upload.files[0];
    if (!file) return;
    text.value = await file.text();
    submit(text.value);
    upload.value = "";
  });
  const report = h("div", { class: "vw-tc-report", testid: "training-config-report", role: "status" });
  const el = h("details", { class: "vw-tconfig", testid: "training-config" }, [
    h("summary", { text: "Import training config", title: "Fill the controls from your own training config file" }),
    text,
    h("div", { class: "vw-row" }, [upload, apply]),
    report,
  ]);

  const sync = () => {
    const r = model.get("training_config_report") || {};
    report.replaceChildren();
    if (r.error) {
      report.append(h("p", { class: "vw-tc-error", text: r.error }));
      return;
    }
    if (!r.format) return;
    const applied = Object.entries(r.applied || {});
    const ignored = (r.ignored || []).filter((/** @type {[string, string]} */ x) => !QUIET.includes(x[1]));
    const quiet = (r.ignored || []).length - ignored.length;
    report.append(h("p", { text: `${r.format}: ${applied.length} control(s) set` +
      (quiet ? `, ${quiet} field(s) with no effect on memory skipped` : "") }));
    const list = h("ul");
    for (const [f, why] of ignored) list.append(h("li", { text: `${f}: ${why}` }));
    for (const k of r.not_controls || []) list.append(h("li", { text: `${k}: no control here (vw.from_training_config(...).estimate() uses it)` }));
    for (const n of r.notes || []) list.append(h("li", { text: `note: ${n}` }));
    if (list.childElementCount) report.append(list);
  };
  return { el, sync };
}
