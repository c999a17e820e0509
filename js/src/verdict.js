// @ts-check
/**
 * The answer band, at the top: does it fit? One measure everywhere: what the GPU must hold
 * (device total = PyTorch's reserved memory + that card's own CUDA context) against what
 * CUDA reports as the card's total (torch.cuda.mem_get_info()'s total), in three states
 * with one meaning each: fits (with more room than the estimate's uncertainty), tight
 * (under the line by less than that, or only with the allocator freeing its cache at the
 * limit) and does not fit (over the line; "it may run" where the allocator could free its
 * cache there). The margin is said in GiB and %. Under the verdict: when it does not fit,
 * the first fixes with their cost and an apply button (suggestions.js); when it fits, the
 * step time and a run's cost; then the common GPUs with their verdicts (a click picks one).
 * The fixes' area keeps its height, so nothing below moves when they arrive. A provisional
 * verdict (the exact replay still running) is drawn with a dashed badge; the status slot
 * beside it says "refining…".
 */
import { fmtBytes, fmtCount, fmtInt, h } from "./dom.js";

/** @typedef {import("./types.js").Ctx} Ctx */

const STATE_TEXT = { fits: "fits", tight: "tight", does_not_fit: "does not fit" };
const STATE_MARK = { fits: "✓", tight: "≈", does_not_fit: "✗" };

/** "RTX 4090", "2 × RTX 4090" @param {any} v */
export function cards(v) {
  return v.num_gpus > 1 ? `${v.num_gpus} × ${v.gpu}` : v.gpu;
}

/**
 * The verdict's words: "fits RTX 4090: 3.2 GiB (13%) to spare", "tight on ...", "does not fit ...".
 * @param {any} v
 */
export function verdictText(v) {
  const who = cards(v);
  const room = v.headroom_bytes;
  const pct = Math.abs(v.headroom_pct) >= 1 ? Math.round(Math.abs(v.headroom_pct)) : Math.abs(v.headroom_pct).toFixed(1);
  if (v.state === "fits") return `fits ${who}: ${fmtBytes(room)} (${pct}%) to spare`;
  if (v.state === "tight") {
    if (v.squeezed) return `tight on ${who}: fits only with the allocator freeing its cache at the limit`;
    return `tight on ${who}: ${fmtBytes(room)} (${pct}%) to spare, within ±${fmtBytes(v.band_bytes)}`;
  }
  const over = `does not fit ${who}: ${fmtBytes(-room)} (${pct}%) over`;
  if (v.may_free) return `${over}; it may run with the allocator freeing its cache at the limit`;
  return -room <= v.band_bytes ? `${over}, within ±${fmtBytes(v.band_bytes)}` : over;
}

/** @param {any} band */
function bandHint(band) {
  if (!band || band.rel_error === undefined) return "";
  return `Tight = under the line by less than ±${(100 * band.rel_error).toFixed(1)}% of the predicted reserved memory: ` +
    `the 90th percentile of its error over ${band.n_cases} measured cases (median ${(100 * band.median).toFixed(1)}%, ` +
    `worst ${(100 * band.max).toFixed(1)}%; ${band.source})`;
}

/**
 * The step time and a run's cost (timing.py, through the summary's ``time``), for a setup
 * that fits: seconds per step, tokens/s, MFU, GPU-hours and dollars for the run.
 * @param {any} t @returns {HTMLElement | null}
 */
export function timeFact(t) {
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

/**
 * @param {Ctx} ctx @param {HTMLElement} status  the status slot, kept at the end of the verdict line
 * @param {HTMLElement} fixes  the fixes' area (suggestions.js), under the verdict line
 * @returns {{ el: HTMLElement, sync: () => void }}
 */
export function verdictPanel(ctx, status, fixes) {
  const { model, send } = ctx;
  const line = h("div", { class: "vw-verdict-line" });
  const chips = h("div", { class: "vw-chips", role: "group", "aria-label": "common GPUs" });
  const box = h("section", { class: "vw-answer", testid: "verdict", "aria-live": "polite" }, [line, fixes, chips]);
  const sync = () => {
    const s = model.get("summary") || {};
    if (s.peak_bytes === undefined) { line.replaceChildren(); chips.replaceChildren(); return; }
    const v = model.get("verdict") || {};
    const par = s.parallel || null;
    const inf = s.inference || null;
    const n = par ? par.num_gpus : inf && inf.serving ? inf.serving.num_gpus : 1;
    const where = n > 1 ? ` per GPU (the fullest of ${n})` : " on the GPU";
    const need = h("span", { class: "vw-need", testid: "headline", "data-need-bytes": String(s.device_total_bytes),
      title: "What nvidia-smi would show: the memory PyTorch's caching allocator reserves (allocated tensors + cached blocks) plus the chosen card's CUDA context. The verdict and the phase chart use this figure." }, [
      h("strong", { text: fmtBytes(s.device_total_bytes) }), where,
    ]);
    const allocated = h("span", { class: "vw-muted vw-alloc", text: `allocated ${fmtBytes(s.peak_bytes)} at ${s.peak_phase_label}` });
    /** @type {HTMLElement} */
    let badge;
    if (v.state) {
      badge = h("span", { class: `vw-badge vw-${v.state}`, testid: "verdict-badge", "data-state": v.state,
        "data-fits": String(v.state !== "does_not_fit"), "data-provisional": String(!!v.provisional),
        title: [v.provisional ? "provisional: the exact reserved memory is being worked out." : "",
          bandHint(s.band), v.context_note, v.allocator_note].filter(Boolean).join("\n"),
      }, [`${STATE_MARK[/** @type {"fits"} */ (v.state)]} ${verdictText(v)}`]);
    } else {
      badge = h("span", { class: "vw-badge vw-none", testid: "verdict-badge", "data-state": "",
        text: "no GPU chosen: pick one below to see whether it fits" });
    }
    line.replaceChildren(need, badge, allocated, status);
    const row = (s.gpu_row || []).map((/** @type {any} */ g) => {
      const chip = h("button", { type: "button", class: `vw-chip vw-${g.state}`, "data-state": g.state,
        testid: `gpu-chip-${g.gpu.replace(/[^A-Za-z0-9]+/g, "-")}`,
        title: `${g.label}: ${verdictText(g)}. Click to fit on it.`,
        "aria-pressed": String(g.gpu === s.gpu) }, [
        `${STATE_MARK[/** @type {"fits"} */ (g.state)] || ""} ${g.gpu}`,
      ]);
      chip.addEventListener("click", () => send("gpu", g.gpu));
      return chip;
    });
    const defaults = (s.defaults || []).length
      ? h("span", { class: "vw-defaults", title: (s.defaults || []).join("; "), text: `defaults: ${(s.defaults || []).join("; ")}` })
      : null;
    chips.replaceChildren(h("span", { class: "vw-muted", text: n > 1 ? `each of ${n} GPUs, as:` : "common GPUs:" }),
      ...row, ...(defaults ? [defaults] : []));
  };
  return { el: box, sync };
}

export { STATE_TEXT, STATE_MARK };
