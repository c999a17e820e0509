// @ts-check
/** The multi-GPU part of the summary: the layout line, CPU offload and the pipeline-stage table. */
import { fmtGiB, h } from "./dom.js";

/**
 * The facts a parallel run adds to the summary (summary.parallel).
 * @param {any} par @returns {HTMLElement[]}
 */
export function parallelFacts(par) {
  /** @type {HTMLElement[]} */
  const facts = [];
  const parts = [par.device_map
    ? `device_map="auto": layers split over ${par.num_gpus} GPU${par.num_gpus > 1 ? "s" : ""}, one at work at a time`
    : `${par.strategy_label} on ${par.num_gpus} GPU${par.num_gpus > 1 ? "s" : ""}`];
  const dims = [`${par.data_parallel} data-parallel`];
  if (par.tensor_parallel > 1) dims.push(`${par.tensor_parallel} tensor-parallel`);
  if (par.pipeline_parallel > 1 && !par.device_map) dims.push(`${par.pipeline_parallel} pipeline stages`);
  if (!par.device_map) parts.push(dims.join(" × "));
  if (par.shard > 1) parts.push(`model states sharded ${par.shard} ways`);
  if (par.nodes > 1) parts.push(`${par.nodes} nodes`);
  const cpu = par.cpu_per_gpu_gib > 0
    ? h("span", { class: "vw-cpu", title: "host memory the offloaded states need; per node with the framework's buffer factor",
      text: `CPU offload: ${fmtGiB(par.cpu_per_gpu_gib)} per GPU, ${fmtGiB(par.cpu_per_node_gib)} per node` })
    : null;
  facts.push(h("div", { class: "vw-fact", testid: "parallel" }, [parts.join(" · "), ...(cpu ? [" · ", cpu] : [])]));
  if (par.model_states && par.model_states.length) {
    // the worst GPU's model states by part: ZeRO's partitions, master and buckets, FSDP's shards and units
    facts.push(h("div", { class: "vw-fact", testid: "model-states",
      title: "per GPU, each state counted once where it lives (vramwidget.parallel.zero / vramwidget.parallel.fsdp)",
      text: "Per-GPU model states: " + par.model_states.slice(0, 6)
        .map((/** @type {any} */ kv) => `${kv[0]} ${fmtGiB(kv[1])}`).join(", ") }));
  }
  if (par.stages && par.stages.length) {
    const rows = par.stages.map((/** @type {any} */ st) => h("tr", { class: st.worst ? "vw-worst" : undefined }, [
      h("th", { scope: "row", text: `${par.device_map ? "GPU " + st.gpu : st.stage + 1}${st.worst ? " (worst)" : ""}` }),
      h("td", { text: st.layers }),
      h("td", { text: st.holds || "–" }),
      h("td", { class: "vw-num", text: String(st.in_flight) }),
      h("td", { class: "vw-num", text: fmtGiB(st.peak_gib) }),
      h("td", { class: "vw-num", text: fmtGiB(st.device_total_gib) }),
      ...(par.cpu_per_gpu_gib > 0 ? [h("td", { class: "vw-num", text: fmtGiB(st.cpu_gib) })] : []),
    ]));
    const cols = [par.device_map ? "GPU" : "stage", "layers", "also holds", "micro-batches in flight", "peak", "device total",
      ...(par.cpu_per_gpu_gib > 0 ? ["CPU"] : [])];
    facts.push(h("table", { class: "vw-stages", testid: "stages" }, [
      h("caption", { text: par.device_map ? "device_map split, per GPU" : "Pipeline stages (1F1B), per GPU" }),
      h("thead", {}, [h("tr", {}, cols.map((c) => h("th", { scope: "col", text: c })))]),
      h("tbody", {}, rows),
    ]));
  }
  return facts;
}
