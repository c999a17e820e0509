// @ts-check
/** The error banner: why the current input cannot be estimated (the charts keep the last valid estimate). */
import { h } from "./dom.js";

/** @typedef {import("./types.js").Ctx} Ctx */

/**
 * @param {Ctx} ctx @param {() => void} onChange  called after each change (the controls mark the bad field)
 * @returns {{ el: HTMLElement, sync: () => void }}
 */
export function errorPanel(ctx, onChange) {
  const { model } = ctx;
  const errorBox = h("div", { class: "vw-error", role: "alert", testid: "error", hidden: true });
  const syncError = () => {
    const msg = model.get("error") || "";
    errorBox.textContent = msg ? `⚠ ${msg} (showing the last valid estimate)` : "";
    errorBox.hidden = !msg;
    onChange();
  };
  return { el: errorBox, sync: syncError };
}
