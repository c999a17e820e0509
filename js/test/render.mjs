// Headless check of the widget's chart path, no browser: compile a Vega-Lite spec the
// way vega-embed does, run it, swap the rows of its named dataset in place with
// view.data(name, rows) (what the widget does on every change), render to SVG.
//
//   node test/render.mjs < input.json     (input: {"spec": {...}, "updates": [{name: rows}, ...]})
//
// Prints JSON: the Vega dataset names, the row count of each named dataset after each
// update, the SVG length, and any Vega warnings.
import * as vega from "vega";
import { compile } from "vega-lite";

const chunks = [];
for await (const c of process.stdin) chunks.push(c);
const input = JSON.parse(Buffer.concat(chunks).toString("utf8"));

const warnings = [];
const logger = vega.logger(vega.Warn);
logger.warn = (...args) => { warnings.push(args.join(" ")); return logger; };

const vgSpec = compile(input.spec, { logger }).spec;
const view = new vega.View(vega.parse(vgSpec), { renderer: "none", logger });
await view.runAsync();
const names = (vgSpec.data || []).map((d) => d.name);
const counts = [];
const named = Object.keys(input.updates?.[0] || {});
counts.push(Object.fromEntries(named.map((n) => [n, view.data(n).length])));
for (const update of input.updates || []) {
  for (const [name, rows] of Object.entries(update)) view.data(name, rows);
  await view.runAsync();
  counts.push(Object.fromEntries(Object.keys(update).map((n) => [n, view.data(n).length])));
}
const svg = await view.toSVG();
view.finalize();
console.log(JSON.stringify({ names, counts, svg_length: svg.length, svg, warnings }));
