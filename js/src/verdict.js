// @ts-check
/**
 * The verdict bar: does it fit? One measure everywhere: what the GPU must hold (device
 * total = PyTorch's reserved memory + that card's own CUDA context) against what CUDA
 * reports as the card's total (torch.cuda.mem_get_info()'s total),
 * in three states (fits, tight: within the estimate's own uncertainty, does not fit),
 * with the headroom in bytes and percent. Allocated memory is said beside it, as a part.
 * Below, a row of common GPUs (24, 40, 48, 80, 141 GB classes) with their verdicts; a
 * click chooses that GPU. The bar has a fixed height: nothing below it moves when a
 * verdict appears or changes. A provisional verdict (the exact replay still running) is
 * drawn with a dashed badge; the status slot beside it says "refining…".
 */
import { fmtBytes, h } from "./dom.js";

/** @typedef {import("./types.js").Ctx} Ctx */

const STATE_TEXT = { fits: "fits", tight: "tight", does_not_fit: "does not fit" };
const STATE_MARK = { fits: "✓", tight: "≈", does_not_fit: "✗" };

/**
 * The verdict's words: "fits RTX 4090: 3.2 GiB (13%) to spare", "tight on ...", "does not fit ...".
 * @param {any} v
 */
export function verdictText(v) {
  const who = v.num_gpus > 1 ? `${v.num_gpus} × ${v.gpu}` : v.gpu;
  const room = v.headroom_bytes;
  if (v.state === "fits") return `fits ${who}: ${fmtBytes(room)} (${Math.round(v.headroom_pct)}%) to spare`;
  if (v.state === "tight") {
    const side = room >= 0 ? `${fmtBytes(room)} to spare` : `${fmtBytes(-room)} over`;
    return `tight on ${who}: ${side}, within ±${fmtBytes(v.band_bytes)}`;
  }
  return `does not fit ${who}: ${fmtBytes(-room)} over`;
}

/** @param {any} band */
function bandHint(band) {
  if (!band || band.rel_error === undefined) return "";
  return `Tight = within ±${(100 * band.rel_error).toFixed(1)}% of the predicted reserved memory: ` +
    `the 90th percentile of its error over ${band.n_cases} measured cases (median ${(100 * band.median).toFixed(1)}%, ` +
    `worst ${(100 * band.max).toFixed(1)}%; ${band.source})`;
}

/**
 * @param {Ctx} ctx @param {HTMLElement | null} [status]  the status slot, kept at the end of the verdict line
 * @returns {{ el: HTMLElement, sync: () => void }}
 */
export function verdictPanel(ctx, status = null) {
  const { model, send } = ctx;
  const box = h("div", { class: "vw-verdict", testid: "verdict", "aria-live": "polite" });
  const sync = () => {
    const s = model.get("summary") || {};
    if (s.peak_bytes === undefined) { box.replaceChildren(); return; }
    const v = model.get("verdict") || {};
    const par = s.parallel || null;
    const perGpu = par ? ` per GPU (the worst of ${par.num_gpus})` : "";
    const need = h("span", { class: "vw-need", testid: "headline", "data-need-bytes": String(s.device_total_bytes),
      title: "What nvidia-smi would show: the memory PyTorch's caching allocator reserves (allocated tensors + cached blocks) plus the chosen card's CUDA context. The verdict and the phase chart use this figure." }, [
      h("strong", { text: fmtBytes(s.device_total_bytes) }), ` on the GPU${perGpu}`,
      h("span", { class: "vw-muted", text: ` · allocated ${fmtBytes(s.peak_bytes)} at ${s.peak_phase_label}` }),
    ]);
    /** @type {HTMLElement} */
    let badge;
    if (v.state) {
      badge = h("span", { class: `vw-badge vw-${v.state}`, testid: "verdict-badge", "data-state": v.state,
        "data-fits": String(v.state !== "does_not_fit"), "data-provisional": String(!!v.provisional),
        title: [v.provisional ? "provisional: the exact reserved memory is being worked out." : "",
          bandHint(s.band), v.context_note, v.allocator_note].filter(Boolean).join("\n"),
      }, [verdictText(v)]);
    } else {
      badge = h("span", { class: "vw-badge vw-none", testid: "verdict-badge", "data-state": "",
        text: "no GPU chosen: where it fits ↓" });
    }
    const chips = (s.gpu_row || []).map((/** @type {any} */ g) => {
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
    box.replaceChildren(
      h("div", { class: "vw-verdict-line" }, [need, badge, ...(status ? [status] : [])]),
      h("div", { class: "vw-chips", role: "group", "aria-label": "common GPUs" }, [
        h("span", { class: "vw-muted", text: "common GPUs:" }), ...chips, ...(defaults ? [defaults] : []),
      ]),
    );
  };
  return { el: box, sync };
}

export { STATE_TEXT };
