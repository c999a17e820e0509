// @ts-check
/**
 * The status slot: what the kernel's background worker is doing for the current inputs.
 * "refining…" while the device totals shown are provisional (the exact caching-allocator
 * replays are running: quiet, the verdict badge is drawn dashed); "tracing org/name…"
 * while a model with no analytic family is traced (the last estimate stays on screen,
 * dimmed: the root gets class vw-busy). The slot sits at the end of the verdict line and
 * keeps its place when empty, so nothing moves when it fills or clears.
 */
import { h } from "./dom.js";

/** @typedef {import("./types.js").Ctx} Ctx */

/** @param {Ctx} ctx @returns {{ el: HTMLElement, sync: () => void }} */
export function statusPanel(ctx) {
  const { model, root } = ctx;
  const el = h("span", { class: "vw-status", testid: "status", role: "status", "aria-live": "polite" });
  const sync = () => {
    const status = model.get("status") || "idle";
    const text = status === "idle" ? "" : (model.get("status_text") || `${status}…`);
    el.textContent = text;
    el.title = text;
    el.dataset.status = status;
    root.classList.toggle("vw-busy", status === "tracing");
    root.classList.toggle("vw-refining", status === "refining");
  };
  return { el, sync };
}
