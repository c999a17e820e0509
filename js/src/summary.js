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

/**
 * The step time and a run's cost beside the verdict (timing.py, through the summary's
 * ``time``): seconds per step, tokens/s, MFU, GPU-hours and dollars for the run.
 * @param {any} t @returns {HTMLElement | null}
 */
function timeFact(t) {
  if (!t) return null;
  const secs = t.step_seconds >= 10 ? t.step_seconds.toFixed(0) : t.step_seconds.toPrecision(3);
  const cost = t.run_dollars === null || t.run_dollars === undefined ? ""
    : `, $${fmtInt(t.run_dollars)} at $${t.usd_per_gpu_hour}/GPU-hour`;
  return h("span", {
    class: "vw-time", testid: "step-time", "data-step-seconds": String(t.step_seconds),
    title: `what dominates: ${t.dominant} (${Math.round(100 * t.dominant_share)}% of the step)`
      + (t.price_source ? `; price: ${t.price_source}` : ""),
    text: `${secs} s per step · ${fmtInt(t.tokens_per_second)} tokens/s · MFU ${Math.round(100 * t.mfu)}% · `
      + `${fmtCount(t.run_tokens)} tokens: ${t.run_gpu_hours.toFixed(1)} GPU-hours${cost}`,
  });
}

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
      h("span", { testid: "device-total", "data-context-bytes": String(s.cuda_context_gib * 2 ** 30),
        title: "what nvidia-smi would show: memory PyTorch's caching allocator reserves (allocated + cached blocks) " +
          `plus the CUDA context. CUDA context: ${s.cuda_context_source || ""}`,
        text: `device total ${fmtBytes(s.device_total_bytes)} = reserved ${fmtGiB(s.reserved_gib)} + CUDA context ` +
          `${fmtBytes(s.cuda_context_gib * 2 ** 30)} (${s.gpu ? `${s.gpu}'s` : "no GPU chosen: the H200's measured"})` }),
      ...(inf ? [] : [timeFact(s.time)].filter((x) => x !== null)),
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
