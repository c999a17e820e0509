// @ts-check
/** Inference facts: the KV cache of your sequences and (serving) the engine's pool, said apart
 * and per GPU; the longest context (capped at the model's limit, and said so); the engine's
 * start-up lines and its command, one flag a line, with a copy button. */
import { fmtBytes, fmtGiB, fmtInt, fmtPerToken, h } from "./dom.js";

/** The line that says what a figure counts: per GPU on a layout of several. @param {any} sv */
const perGpu = (sv) => (sv && sv.num_gpus > 1 ? " per GPU" : "");

/**
 * The answer band's inference lines: your sequences' KV cache, the engine's pool (serving),
 * the longest context that fits.
 * @param {any} s the summary @returns {HTMLElement[]}
 */
export function inferenceBrief(s) {
  const inf = s.inference;
  const sv = inf.serving;
  /** @type {HTMLElement[]} */
  const out = [];
  out.push(h("div", { class: "vw-fact", testid: "kv-cache", "data-kv-bytes": String(inf.kv_requested_bytes) }, [
    `your sequences' KV cache (${fmtInt(inf.batch_size)} × ${fmtInt(inf.context_len)} tokens, `,
    h("strong", { text: fmtPerToken(inf.kv_bytes_per_token) }), ` per token${perGpu(sv)}, ${inf.kv_cache_dtype}): `,
    h("strong", { text: fmtBytes(inf.kv_requested_bytes) }), perGpu(sv),
    ` · weights (${inf.weights}) ${fmtGiB(inf.weights_gib)}${perGpu(sv)}`,
  ]));
  if (inf.assumes) {
    out.push(h("div", { class: "vw-fact", testid: "assumes" }, ["assumes: ", inf.assumes]));
  }
  if (inf.allocator_note) {
    out.push(h("div", { class: "vw-fact", testid: "allocator-note" }, [inf.allocator_note]));
  }
  if (sv) {
    const layout = sv.num_gpus > 1 ? ` on ${sv.num_gpus} GPUs (TP ${sv.tensor_parallel}, PP ${sv.pipeline_parallel})` : "";
    out.push(h("div", { class: "vw-fact", testid: "serving", "data-pool-bytes": String(inf.kv_pool_bytes) }, [
      `the engine's KV pool (${sv.engine} ${sv.version}${layout}, ${Math.round(100 * sv.gpu_memory_utilization)}% of each GPU): `,
      h("strong", { text: fmtBytes(inf.kv_pool_bytes) }), perGpu(sv),
      ` = ${fmtInt(sv.kv_tokens)} tokens: ${fmtInt(sv.max_concurrent_sequences)} sequences of ${fmtInt(sv.context_len)} tokens at once`,
    ]));
  }
  if (inf.longest_context !== null && inf.longest_context !== undefined) {
    const limit = inf.max_position_embeddings;
    const extra = inf.longest_context_by_model ? ` (the model's limit, ${fmtInt(limit)}, binds before memory does)`
      : inf.longest_context_capped ? " (the search limit)" : "";
    out.push(h("div", { class: "vw-fact", testid: "longest-context", "data-value": String(inf.longest_context) }, [
      `longest context that fits ${s.gpu}: `, h("strong", { text: `${fmtInt(inf.longest_context)} tokens` }),
      `${inf.batch_size > 1 ? ` (batch ${inf.batch_size})` : ""}${extra}`,
    ]));
  }
  return out;
}

/**
 * Copy text to the clipboard (the Clipboard API where the page allows it, else a hidden
 * textarea and execCommand); says "copied" on the button.
 * @param {HTMLButtonElement} btn @param {string} text
 */
function copy(btn, text) {
  const done = () => { btn.textContent = "copied"; setTimeout(() => { btn.textContent = "copy"; }, 1500); };
  const fallback = () => {
    const ta = /** @type {HTMLTextAreaElement} */ (h("textarea", { style: "position:fixed;opacity:0" }));
    ta.value = text;
    document.body.append(ta);
    ta.select();
    try { document.execCommand("copy"); } catch (_) { /* nothing more to try */ }
    ta.remove();
    done();
  };
  if (navigator.clipboard && window.isSecureContext) navigator.clipboard.writeText(text).then(done, fallback);
  else fallback();
}

/**
 * The side panel's serving facts: the lines the engine prints, the largest max_model_len
 * that starts, the command (one flag a line, never broken inside one) with a copy button.
 * @param {any} s the summary @returns {HTMLElement[]}
 */
export function inferenceFacts(s) {
  const sv = s.inference.serving;
  /** @type {HTMLElement[]} */
  const facts = [];
  if (!sv) return facts;
  if (sv.startup_lines && sv.startup_lines.length) {
    facts.push(h("div", { class: "vw-fact vw-startup", testid: "startup-lines" }, [
      "the engine prints at start-up:",
      ...sv.startup_lines.map((/** @type {string} */ line) => h("code", { class: "vw-line", text: line })),
    ]));
  }
  if (sv.largest_max_model_len !== undefined) {
    facts.push(h("div", { class: "vw-fact", testid: "largest-max-model-len", "data-value": String(sv.largest_max_model_len) }, [
      "largest max_model_len that starts: ", h("strong", { text: `${fmtInt(sv.largest_max_model_len)} tokens` }),
    ]));
  }
  if (sv.command) {
    const lines = String(sv.command).split(/ (?=--)/);
    const btn = /** @type {HTMLButtonElement} */ (h("button", { type: "button", class: "vw-copy", testid: "serve-command-copy",
      text: "copy", title: "copy the command" }));
    btn.addEventListener("click", () => copy(btn, sv.command));
    facts.push(h("div", { class: "vw-fact vw-command", testid: "serve-command", "data-command": sv.command }, [
      h("pre", { class: "vw-cmd" }, [h("code", { text: lines.join(" \\\n  ") })]), btn,
    ]));
  }
  return facts;
}
