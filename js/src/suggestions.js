// @ts-check
/** The suggestions panel: changes that make the setup fit the GPU, each with an apply button. */
import { fmtGiB, h } from "./dom.js";

/** @typedef {import("./types.js").Ctx} Ctx */

/** @param {Ctx} ctx @returns {{ el: HTMLElement, sync: () => void }} */
export function suggestionsPanel(ctx) {
  const { model } = ctx;
  const suggBox = h("section", { class: "vw-suggestions", testid: "suggestions", hidden: true, "aria-live": "polite" });
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
  return { el: suggBox, sync: syncSuggestions };
}
