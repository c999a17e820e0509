// @ts-check
/** The number-format panel: FP32 ... NF4 by sign/exponent/mantissa bits, range and precision. */
import { fmtNum, h } from "./dom.js";

/** @typedef {import("./types.js").Ctx} Ctx */

/** @param {Ctx} ctx @returns {{ el: HTMLElement, sync: () => void }} */
export function formatsPanel(ctx) {
  const { model } = ctx;
  const formatsBox = h("details", { class: "vw-formats", testid: "formats" });
  const syncFormats = () => {
    const fmts = model.get("formats") || [];
    const bits = (/** @type {any} */ f) => {
      const spans = [h("span", { class: "vw-bit vw-bit-s", title: "sign" })];
      for (let i = 0; i < f.exponent; i++) spans.push(h("span", { class: "vw-bit vw-bit-e", title: "exponent" }));
      for (let i = 0; i < f.mantissa; i++) spans.push(h("span", { class: "vw-bit vw-bit-m", title: f.exponent ? "mantissa" : "value" }));
      return h("span", { class: "vw-bits", "aria-label": `${f.bits} bits` }, spans);
    };
    const body = fmts.map((/** @type {any} */ f) => h("tr", {}, [
      h("th", { scope: "row", text: f.name }),
      h("td", {}, [bits(f)]),
      h("td", { class: "vw-num", text: f.exponent ? `1 / ${f.exponent} / ${f.mantissa}` : `${f.bits}-bit` }),
      h("td", { class: "vw-num", text: fmtNum(f.max) }),
      h("td", { class: "vw-num", text: fmtNum(f.min_normal) }),
      h("td", { class: "vw-num", text: fmtNum(f.epsilon) }),
      h("td", { class: "vw-num", text: String(f.decimal_digits) }),
      h("td", { class: "vw-note", text: f.note }),
    ]));
    const open = formatsBox.hasAttribute("open");
    formatsBox.replaceChildren(
      h("summary", { text: "Number formats: bits, range, precision" }),
      h("table", {}, [
        h("thead", {}, [h("tr", {}, ["format", "bits", "sign/exp/mantissa", "max", "min normal", "epsilon", "digits", ""].map((c) => h("th", { scope: "col", text: c })))]),
        h("tbody", {}, body),
      ]));
    formatsBox.toggleAttribute("open", open);
  };
  return { el: formatsBox, sync: syncFormats };
}
