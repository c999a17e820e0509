// @ts-check
/** The component table: memory live at the peak, by component, with its largest parts. */
import { fmtGiB, h } from "./dom.js";

/** @typedef {import("./types.js").Ctx} Ctx */

/** @param {Ctx} ctx @returns {{ el: HTMLElement, sync: () => void }} */
export function tablePanel(ctx) {
  const { model } = ctx;
  const tableBox = h("div", { class: "vw-table", testid: "table" });
  const syncTable = () => {
    const rows = model.get("table") || [];
    const total = rows.reduce((/** @type {number} */ a, /** @type {any} */ r) => a + r.gib, 0);
    const body = rows.map((/** @type {any} */ r) => h("tr", { title: (r.groups || []).map((/** @type {any} */ g) => `${g.name}: ${fmtGiB(g.gib)}`).join("\n") }, [
      h("td", {}, [h("span", { class: "vw-swatch", style: `background:${r.color}` }), r.component]),
      h("td", { class: "vw-num", text: fmtGiB(r.gib) }),
      h("td", { class: "vw-num", text: `${(100 * r.share).toFixed(1)}%` }),
      h("td", { class: "vw-groups", text: (r.groups || []).slice(0, 4).map((/** @type {any} */ g) => `${g.name} ${fmtGiB(g.gib)}`).join(", ") }),
    ]));
    tableBox.replaceChildren(h("table", {}, [
      h("caption", { text: `Memory live at the peak, by component${(model.get("summary") || {}).parallel ? " (one GPU: the fullest)" : ""}` }),
      h("thead", {}, [h("tr", {}, ["component", "GiB", "share", "largest parts"].map((c) => h("th", { scope: "col", text: c })))]),
      h("tbody", {}, body),
      h("tfoot", {}, [h("tr", {}, [h("th", { scope: "row", text: "total" }), h("td", { class: "vw-num", text: fmtGiB(total) }), h("td", { class: "vw-num", text: "100%" }), h("td")])]),
    ]));
  };
  return { el: tableBox, sync: syncTable };
}
