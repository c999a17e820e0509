// @ts-check
/**
 * The suggestions panel (beside the charts, in space kept for it): changes, alone or up to
 * three combined, that make the setup fit the GPU with the estimate's margin, ranked by
 * cost, each with its cost by axis (quality, time, hardware). "apply" sets the changes;
 * "undo" puts back what was there before. Nothing outside the panel moves.
 */
import { fmtBytes, h } from "./dom.js";

/** @typedef {import("./types.js").Ctx} Ctx */

const MARK = { fits: "✓ fits", tight: "≈ tight", does_not_fit: "✗ not enough" };

/** @param {Ctx} ctx @returns {{ el: HTMLElement, sync: () => void }} */
export function suggestionsPanel(ctx) {
  const { model } = ctx;
  const suggBox = h("section", { class: "vw-suggestions", testid: "suggestions", "aria-live": "polite" });
  /** @type {Record<string, any> | null} the values an apply replaced */
  let undo = null;
  const syncSuggestions = () => {
    const status = model.get("suggestions_status") || "";
    const items = model.get("suggestions") || [];
    const v = model.get("verdict") || {};
    suggBox.dataset.status = status;
    const where = v.gpu ? (v.num_gpus > 1 ? `${v.num_gpus} × ${v.gpu}` : v.gpu) : "the GPU";
    const inference = model.get("mode") === "inference";
    const title = !status ? (inference ? "Suggestions: for training (switch the mode)"
      : v.state === "fits" ? `Fits ${where} with margin: nothing to change` : "Suggestions: choose a GPU")
      : status === "ready" && items.length && !items.some((/** @type {any} */ x) => x.fits)
        ? `Nothing of up to 3 changes fits ${where}: these lower it most`
        : `To fit ${where}: changes ranked by cost`;
    /** @type {HTMLElement[]} */
    const head = [h("h4", { text: title })];
    if (undo) {
      const btn = h("button", { type: "button", class: "vw-undo", testid: "suggestion-undo", text: "undo",
        title: `put back ${Object.entries(undo).map(([k, x]) => `${k} = ${x}`).join(", ")}` });
      btn.addEventListener("click", () => {
        const back = undo || {};
        undo = null;
        for (const [k, x] of Object.entries(back)) model.set(k, x);
        model.save_changes();
        syncSuggestions();
      });
      head.push(btn);
    }
    /** @type {HTMLElement} */
    let body;
    if (!status) body = h("p", { class: "vw-sub", text: v.state === "fits" ? "the verdict has margin to spare" : "" });
    else if (status === "computing") body = h("p", { class: "vw-sub", text: "working out which changes make it fit…" });
    else if (status.startsWith("failed")) body = h("p", { class: "vw-warn", text: status });
    else if (!items.length) body = h("p", { class: "vw-sub", text: "no change found that lowers the memory" });
    else {
      body = h("ol", { class: "vw-sugg-list" }, items.slice(0, 8).map((/** @type {any} */ x, /** @type {number} */ i) => {
        const apply = h("button", { type: "button", testid: `suggestion-apply-${i}`, text: "apply",
          title: `set ${Object.entries(x.changes).map(([k, val]) => `${k} = ${val}`).join(", ")}` });
        apply.addEventListener("click", () => {
          /** @type {Record<string, any>} */
          const before = {};
          for (const k of Object.keys(x.changes)) before[k] = model.get(k);
          undo = before;
          for (const [k, val] of Object.entries(x.changes)) model.set(k, val);
          model.save_changes();
        });
        const costs = x.costs || {};
        const costLine = ["quality", "time", "hardware"].filter((k) => costs[k])
          .map((k) => h("span", { class: `vw-cost vw-cost-${k}`, text: `${k}: ${costs[k]}` }));
        return h("li", { testid: `suggestion-${i}`, "data-state": x.state || "", "data-fits": String(x.fits), title: x.cost }, [
          h("div", { class: "vw-sugg-title" }, [
            h("span", { class: `vw-mark vw-${x.state}`, text: MARK[/** @type {"fits"} */ (x.state)] || "" }),
            " ", x.title,
          ]),
          h("div", { class: "vw-sugg-costs" }, [
            ...(costLine.length ? costLine : [h("span", { class: "vw-cost", text: "free" })]),
            h("span", { class: "vw-num", text: `→ ${fmtBytes(x.device_total_bytes)}` }), apply,
          ]),
        ]);
      }));
    }
    suggBox.replaceChildren(h("div", { class: "vw-sugg-head" }, head), body);
  };
  return { el: suggBox, sync: syncSuggestions };
}
