// @ts-check
/**
 * The details panel (the side column): the allocated peak and what makes up the device
 * total, the model line, the facts of the current mode (multi-GPU layout and stages, the
 * serving engine's start-up lines and command) and the notes and warnings. The verdict,
 * the fixes and the step time are the answer band's (verdict.js, suggestions.js).
 */
import { fmtBytes, fmtCount, fmtGiB, h } from "./dom.js";
import { inferenceFacts } from "./inference.js";
import { parallelFacts } from "./parallel.js";

/** @typedef {import("./types.js").Ctx} Ctx */

/** @param {Ctx} ctx @returns {{ el: HTMLElement, sync: () => void }} */
export function summaryPanel(ctx) {
  const { model } = ctx;
  const summaryBox = h("section", { class: "vw-summary", testid: "summary", "aria-live": "polite" });
  const syncSummary = () => {
    const s = model.get("summary") || {};
    const par = s.parallel || null;
    const inf = s.inference || null;
    if (s.peak_gib === undefined) { summaryBox.textContent = ""; return; }
    const n = par ? par.num_gpus : inf && inf.serving ? inf.serving.num_gpus : 1;
    const perGpu = n > 1 ? ` per GPU (the fullest of ${n})` : "";
    const head = h("div", { class: "vw-headline" }, [
      h("span", { class: "vw-peak", "data-peak-gib": s.peak_gib.toFixed(4) }, [
        h("strong", { text: fmtBytes(s.peak_bytes) }), ` peak allocated${perGpu}, at ${s.peak_phase_label}`,
      ]),
      h("span", { testid: "device-total", "data-context-bytes": String(s.cuda_context_gib * 2 ** 30),
        title: "what nvidia-smi would show: memory PyTorch's caching allocator reserves (allocated + cached blocks) " +
          `plus the CUDA context. CUDA context: ${s.cuda_context_source || ""}`,
        text: `device total ${fmtBytes(s.device_total_bytes)} = reserved ${fmtGiB(s.reserved_gib)} + CUDA context ` +
          `${fmtBytes(s.cuda_context_gib * 2 ** 30)} (${s.gpu ? `${s.gpu}'s` : "no GPU chosen: the H200's measured"})` }),
    ]);
    const params = inf ? `${fmtCount(s.params_total)} parameters`
      : s.params_trainable >= s.params_total ? `${fmtCount(s.params_total)} parameters, all trainable`
        : `${fmtCount(s.params_total)} parameters, ${fmtCount(s.params_trainable)} trainable${s.params_scope || ""}`;
    const sub = h("div", { class: "vw-sub", text: `${s.model} · ${params}` + (!inf && s.recompute_overhead ? ` · recompute +${Math.round(100 * s.recompute_overhead)}% compute` : "") });
    /** @type {HTMLElement[]} */
    const facts = [];
    if (par) facts.push(...parallelFacts(par));
    if (inf) facts.push(...inferenceFacts(s));
    const notes = [...(s.warnings || []).map((/** @type {string} */ w) => h("li", { class: "vw-warn", text: w })),
      ...(s.notes || []).map((/** @type {string} */ n) => h("li", { text: n }))];
    summaryBox.replaceChildren(h("h4", { text: "Details" }), head, sub, ...facts,
      ...(notes.length ? [h("ul", { class: "vw-notes" }, notes)] : []));
  };
  return { el: summaryBox, sync: syncSummary };
}
