// @ts-check
/**
 * The banner: why the current input cannot be used, naming the input and its value
 * (Python's error, or a value the frontend refused before sending it), while the charts
 * keep the last valid estimate, dimmed (the root gets class vw-stale). Its space is
 * always kept, so nothing moves when it appears.
 */
import { h } from "./dom.js";

/** @typedef {import("./types.js").Ctx} Ctx */

/**
 * @param {Ctx} ctx @param {() => void} onChange  called after each change (the controls mark the bad field)
 * @returns {{ el: HTMLElement, sync: () => void, setLocal: (field: string, message: string) => void }}
 */
export function errorPanel(ctx, onChange) {
  const { model, root } = ctx;
  const errorBox = h("div", { class: "vw-error", role: "alert", testid: "error", "aria-hidden": "true" });
  /** @type {Record<string, string>} refused inputs, by field */
  const local = {};
  const syncError = () => {
    const msg = model.get("error") || "";
    const mine = Object.values(local).filter(Boolean);
    const text = mine.length ? mine[mine.length - 1] : msg;
    errorBox.textContent = text ? `⚠ ${text} (the charts show the last valid estimate)` : "";
    errorBox.title = errorBox.textContent;
    errorBox.dataset.shown = String(!!text);
    errorBox.setAttribute("aria-hidden", String(!text));
    root.classList.toggle("vw-stale", !!text);
    onChange();
  };
  /** @param {string} field @param {string} message */
  const setLocal = (field, message) => {
    if (message) local[field] = message;
    else delete local[field];
    syncError();
  };
  return { el: errorBox, sync: syncError, setLocal };
}
