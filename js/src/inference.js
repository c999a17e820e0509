// @ts-check
/** The inference part of the summary: KV cache per token and for the requested sequences, the
 * serving pool apart, the longest context (capped at the model's limit, and said so). */
import { fmtBytes, fmtGiB, fmtInt, fmtPerToken, h } from "./dom.js";

/**
 * The facts an inference estimate adds to the summary (summary.inference).
 * @param {any} s the summary @returns {HTMLElement[]}
 */
export function inferenceFacts(s) {
  const inf = s.inference;
  /** @type {HTMLElement[]} */
  const facts = [];
  facts.push(h("div", { class: "vw-fact", testid: "kv-cache", "data-kv-bytes": String(inf.kv_requested_bytes) }, [
    "KV cache ", h("strong", { text: fmtPerToken(inf.kv_bytes_per_token) }), " per token",
    ` (${inf.kv_cache_dtype}); your ${fmtInt(inf.batch_size)} × ${fmtInt(inf.context_len)} tokens: `,
    h("strong", { text: fmtBytes(inf.kv_requested_bytes) }),
    ` · weights (${inf.weights}) ${fmtGiB(inf.weights_gib)}`,
  ]));
  if (inf.assumes) {
    facts.push(h("div", { class: "vw-fact", testid: "assumes" }, ["assumes: ", inf.assumes]));
  }
  if (inf.allocator_note) {
    facts.push(h("div", { class: "vw-fact", testid: "allocator-note" }, [inf.allocator_note]));
  }
  if (inf.serving) {
    const sv = inf.serving;
    const layout = sv.num_gpus > 1 ? ` on ${sv.num_gpus} GPUs (TP ${sv.tensor_parallel}, PP ${sv.pipeline_parallel})` : "";
    facts.push(h("div", { class: "vw-fact", testid: "serving", "data-pool-bytes": String(inf.kv_pool_bytes) }, [
      `${sv.engine} ${sv.version}${layout} at ${Math.round(100 * sv.gpu_memory_utilization)}% of each GPU: KV pool `,
      h("strong", { text: fmtBytes(inf.kv_pool_bytes) }),
      ` (${fmtInt(sv.kv_tokens)} tokens), ${fmtInt(sv.max_concurrent_sequences)} sequences of ${fmtInt(sv.context_len)} tokens at once`,
    ]));
    if (sv.startup_lines && sv.startup_lines.length) {
      facts.push(h("div", { class: "vw-fact vw-startup", testid: "startup-lines" }, [
        "the engine prints: ",
        ...sv.startup_lines.map((/** @type {string} */ line) => h("code", { class: "vw-line", text: line })),
      ]));
    }
    if (sv.largest_max_model_len !== undefined) {
      facts.push(h("div", { class: "vw-fact", testid: "largest-max-model-len", "data-value": String(sv.largest_max_model_len) }, [
        "largest max_model_len that starts: ", h("strong", { text: `${fmtInt(sv.largest_max_model_len)} tokens` }),
      ]));
    }
    if (sv.command) {
      facts.push(h("div", { class: "vw-fact", testid: "serve-command" }, [h("code", { text: sv.command })]));
    }
  }
  if (inf.longest_context !== null && inf.longest_context !== undefined) {
    const limit = inf.max_position_embeddings;
    const extra = inf.longest_context_by_model ? ` (the model's limit, ${fmtInt(limit)}, binds before memory does)`
      : inf.longest_context_capped ? " (the search limit)" : "";
    facts.push(h("div", { class: "vw-fact", testid: "longest-context", "data-value": String(inf.longest_context) }, [
      `longest context that fits ${s.gpu}: `, h("strong", { text: `${fmtInt(inf.longest_context)} tokens` }),
      `${inf.batch_size > 1 ? ` (batch ${inf.batch_size})` : ""}${extra}`,
    ]));
  }
  return facts;
}
