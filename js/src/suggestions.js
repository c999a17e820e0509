// @ts-check
/**
 * The fixes, inside the answer band under the verdict: when the setup does not fit (or is
 * tight), the changes that make it fit with the estimate's margin, alone or up to three
 * combined, ranked by what they cost the user (fit.RANK_TIERS: free knobs, GPU time,
 * quality, slow / host memory, more GPUs, fewer first), the first three with their cost by
 * axis and an apply button, the rest one click away. "apply" sets the changes, names every
 * control that changed (the linked ones too), opens their groups and brings the verdict
 * into view; "undo" puts back what was there before. While the input has an error the
 * apply buttons are off. When it fits: the step time and a run's cost, the largest
 * micro-batch. The area keeps its height, so nothing under the band moves.
 */
import { fmtBytes, fmtInt, h } from "./dom.js";
import { inferenceBrief } from "./inference.js";
import { STATE_MARK, cards, timeFact, verdictText } from "./verdict.js";

/** @typedef {import("./types.js").Ctx} Ctx */

const MARK = { fits: "✓ fits", tight: "≈ tight", does_not_fit: "✗ not enough" };
/** Fixes shown at once; the rest under "more". */
const FIRST = 3;

/**
 * @param {Ctx} ctx
 * @param {{ names: string[], labelOf: (n: string) => string, textOf: (n: string, v: any) => string,
 *   mark: (names: string[]) => void }} controls
 * @param {() => HTMLElement} verdictEl  the band, scrolled into view after an apply
 * @returns {{ el: HTMLElement, sync: () => void }}
 */
export function suggestionsPanel(ctx, controls, verdictEl) {
  const { model } = ctx;
  const box = h("div", { class: "vw-fixes", testid: "suggestions", "aria-live": "polite" });
  /** @type {{ before: Record<string, any>, title: string } | null} the inputs before the last apply */
  let applied = null;
  let moreOpen = false;

  const inputs = () => Object.fromEntries(controls.names.map((n) => [n, model.get(n)]));
  const same = (/** @type {any} */ a, /** @type {any} */ b) => JSON.stringify(a) === JSON.stringify(b);
  /** what an apply changed: every input that differs from before it (linked ones too) */
  const changed = () => {
    if (!applied) return [];
    const before = applied.before;
    return controls.names.filter((n) => !same(before[n], model.get(n)));
  };

  /** @param {any} x @param {number} i */
  const item = (x, i) => {
    const err = !!model.get("error");
    const apply = h("button", { type: "button", class: "vw-apply", testid: `suggestion-apply-${i}`, text: "apply",
      disabled: err, title: err ? "fix the input named above first" :
        `set ${Object.entries(x.changes).map(([k, val]) => `${controls.labelOf(k)} = ${controls.textOf(k, val)}`).join(", ")}` });
    apply.addEventListener("click", () => {
      applied = { before: inputs(), title: x.title };
      for (const [k, val] of Object.entries(x.changes)) model.set(k, val);
      model.save_changes();
      sync();
      const band = verdictEl();
      if (band && band.scrollIntoView) band.scrollIntoView({ block: "nearest" });
    });
    const costs = x.costs || {};
    // the measured figure where there is one ("+12% GPU time per token"); the words in the tooltip
    const short = (/** @type {string} */ k) => {
      if (k !== "time") return costs[k];
      const m = String(costs[k]).match(/[+-]\d+% GPU time per token/);
      return m ? m[0] : costs[k];
    };
    const costLine = ["quality", "time", "hardware"].filter((k) => costs[k])
      .map((k) => h("span", { class: `vw-cost vw-cost-${k}`, text: `${k}: ${short(k)}` }));
    // two lines each (what to change; what it costs, where it lands, apply): the area's height
    // is known before the fixes arrive
    return h("li", { testid: `suggestion-${i}`, "data-state": x.state || "", "data-fits": String(x.fits), title: x.cost }, [
      h("div", { class: "vw-sugg-line" }, [
        h("span", { class: `vw-mark vw-${x.state}`, text: MARK[/** @type {"fits"} */ (x.state)] || "" }), " ",
        h("span", { class: "vw-sugg-title", text: x.title }),
      ]),
      h("div", { class: "vw-sugg-costs" }, [
        ...(costLine.length ? costLine : [h("span", { class: "vw-cost", text: "free" })]),
        h("span", { class: "vw-num", text: `→ ${fmtBytes(x.device_total_bytes)}` }),
        apply,
      ]),
    ]);
  };

  /** the note after an apply: every control that changed, and undo */
  const appliedNote = () => {
    const names = changed();
    if (!applied) return null;
    const undo = h("button", { type: "button", class: "vw-undo", testid: "suggestion-undo", text: "undo",
      title: `put back ${names.map((n) => `${controls.labelOf(n)} = ${controls.textOf(n, applied && applied.before[n])}`).join(", ")}` });
    undo.addEventListener("click", () => {
      const back = applied ? applied.before : {};
      const names2 = changed();
      applied = null;
      for (const n of names2) model.set(n, back[n]);
      model.save_changes();
      controls.mark([]);
      sync();
    });
    const parts = names.map((n) => h("span", { class: "vw-changed-item", testid: `changed-${n}` },
      [h("strong", { text: controls.labelOf(n) }), ` ${controls.textOf(n, applied && applied.before[n])} → ${controls.textOf(n, model.get(n))}`]));
    return h("div", { class: "vw-applied", testid: "applied" }, [
      h("span", { text: `Applied “${applied.title}”: ` }), ...joined(parts), " ", undo]);
  };

  const sync = () => {
    const s = model.get("summary") || {};
    const v = model.get("verdict") || {};
    const status = model.get("suggestions_status") || "";
    const items = model.get("suggestions") || [];
    box.dataset.status = status;
    /** @type {(HTMLElement | string)[]} */
    const body = [];
    const note = appliedNote();
    if (applied) controls.mark(changed());
    if (s.inference) {
      body.push(...inferenceBrief(s));
      // what to change for inference: the weight formats of the comparison, with their verdicts
      const formats = ((model.get("rows") || {}).comparison || [])
        .filter((/** @type {any} */ r) => r.level === "title" && r.state && r.scenario !== "your setup");
      if (formats.length && v.gpu) {
        body.push(h("div", { class: "vw-fact", testid: "format-verdicts" }, [`weight formats on ${cards(v)}: `,
          ...joined(formats.map((/** @type {any} */ r) => h("span", { class: `vw-${r.state}`,
            text: `${STATE_MARK[/** @type {"fits"} */ (r.state)] || ""} ${r.scenario}` })))]));
      }
    } else if (status) {
      const where = v.gpu ? cards(v) : "the GPU";
      if (status === "computing" || (status === "partial" && !items.length)) body.push(h("p", { class: "vw-sub", text: `working out which changes make it fit ${where}…` }));
      else if (status.startsWith("failed")) body.push(h("p", { class: "vw-warn", text: status }));
      else if (!items.length) body.push(h("p", { class: "vw-sub", text: "no change found that lowers the memory" }));
      else {
        const none = !items.some((/** @type {any} */ x) => x.fits);
        const partial = status === "partial";    // the single changes; combinations still being worked out
        body.push(h("div", { class: "vw-fixes-head" }, [none
          ? (partial ? `No single change fits ${where}; these lower it most:` : `Nothing of up to 3 changes fits ${where}; these lower it most:`)
          : `To fit ${where}${v.state === "tight" ? " with margin" : ""}, cheapest first:`]));
        if (partial) body.push(h("p", { class: "vw-sub", testid: "suggestions-partial", text: "working out combinations of changes…" }));
        body.push(h("ol", { class: "vw-sugg-list" }, items.slice(0, FIRST).map(item)));
        if (items.length > FIRST) {
          const more = h("details", { class: "vw-more", testid: "suggestions-more" }, [
            h("summary", { text: `${items.length - FIRST} more` }),
            h("ol", { class: "vw-sugg-list", start: String(FIRST + 1) }, items.slice(FIRST, 12).map((/** @type {any} */ x, /** @type {number} */ j) => item(x, FIRST + j))),
          ]);
          if (moreOpen) more.setAttribute("open", "");
          more.addEventListener("toggle", () => { moreOpen = more.hasAttribute("open"); });
          body.push(more);
        }
      }
    } else if (v.state) {
      const facts = [];
      if (s.time) facts.push(timeFact(s.time));
      if (s.max_batch_size !== null && s.max_batch_size !== undefined) {
        facts.push(h("span", { class: "vw-fact", testid: "max-batch", "data-value": String(s.max_batch_size),
          text: `largest micro-batch that fits: ${fmtInt(s.max_batch_size)} (at sequence ${fmtInt(model.get("seq_len"))})` }));
      }
      body.push(h("div", { class: "vw-facts" }, /** @type {HTMLElement[]} */ (facts.filter(Boolean))));
    } else {
      body.push(h("div", { class: "vw-fixes-head", text: "No GPU chosen. Where it fits (a click on a GPU below chooses it):" }));
      body.push(h("ul", { class: "vw-gpu-list", testid: "gpu-verdicts" }, (s.gpu_row || []).map((/** @type {any} */ g) =>
        h("li", { class: `vw-${g.state}` }, [`${STATE_MARK[/** @type {"fits"} */ (g.state)] || ""} ${verdictText(g)}`]))));
    }
    box.replaceChildren(...body, ...(note ? [note] : []));
  };
  return { el: box, sync };
}

/** @param {HTMLElement[]} parts @returns {(HTMLElement | string)[]} */
function joined(parts) {
  /** @type {(HTMLElement | string)[]} */
  const out = [];
  parts.forEach((p, i) => { if (i) out.push(" · "); out.push(p); });
  return out;
}
