// @ts-check
/**
 * The summary panel (beside the charts): allocated peak and what makes up the device total,
 * the model line, the facts of the current mode (multi-GPU layout, largest micro-batch,
 * inference) and the notes and warnings. The verdict itself is verdict.js's.
 */
import { fmtBytes, fmtCount, fmtGiB, fmtInt, h } from "./dom.js";
import { inferenceFacts } from "./inference.js";
import { parallelFacts } from "./parallel.js";

/** @typedef {import("./types.js").Ctx} Ctx */

/** @param {Ctx} ctx @returns {{ el: HTMLElement, sync: () => void }} */
export function summaryPanel(ctx) {
  const { model } = ctx;
  const summaryBox = h("div", { class: "vw-summary", testid: "summary", "aria-live": "polite" });
  const syncSummary = () => {
    const s = model.get("summary") || {};
    const par = s.parallel || null;
    const inf = s.inference || null;
    if (s.peak_gib === undefined) { summaryBox.textContent = ""; return; }
    const perGpu = par ? ` per GPU (the worst of ${par.num_gpus})` : "";
    const head = h("div", { class: "vw-headline" }, [
      h("span", { class: "vw-peak", "data-peak-gib": s.peak_gib.toFixed(4) }, [
        h("strong", { text: fmtBytes(s.peak_bytes) }), ` peak allocated${perGpu}, at ${s.peak_phase_label}`,
      ]),
      h("span", { title: "what nvidia-smi would show: memory PyTorch's caching allocator reserves (allocated + cached blocks) plus the CUDA context",
        text: `device total ${fmtBytes(s.device_total_bytes)} = reserved ${fmtGiB(s.reserved_gib)} + CUDA context ${fmtGiB(s.cuda_context_gib)}` }),
    ]);
    const params = inf ? `${fmtCount(s.params_total)} parameters`
      : `${fmtCount(s.params_total)} parameters, ${fmtCount(s.params_trainable)} trainable`;
    const sub = h("div", { class: "vw-sub", text: `${s.model} · ${params}` + (!inf && s.recompute_overhead ? ` · recompute +${Math.round(100 * s.recompute_overhead)}% compute` : "") });
    /** @type {HTMLElement[]} */
    const facts = [];
    if (par) facts.push(...parallelFacts(par));
    if (s.max_batch_size !== null && s.max_batch_size !== undefined && !inf) {
      facts.push(h("div", { class: "vw-fact", testid: "max-batch", "data-value": String(s.max_batch_size),
        text: s.max_batch_size > 0 ? `largest micro-batch that fits ${s.gpu}: ${fmtInt(s.max_batch_size)} (at sequence length ${fmtInt(model.get("seq_len"))})`
          : `not even a micro-batch of 1 fits ${s.gpu}` }));
    }
    if (inf) facts.push(...inferenceFacts(s));
    const notes = [...(s.warnings || []).map((/** @type {string} */ w) => h("li", { class: "vw-warn", text: w })),
      ...(s.notes || []).map((/** @type {string} */ n) => h("li", { text: n }))];
    summaryBox.replaceChildren(head, sub, ...facts, ...(notes.length ? [h("ul", { class: "vw-notes" }, notes)] : []));
  };
  return { el: summaryBox, sync: syncSummary };
}
