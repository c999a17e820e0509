// Build the widget bundle: js/src/widget.js (+ vega, vega-lite, vega-embed) ->
// ../vramwidget/static/widget.js, minified ESM, nothing fetched at run time.
// Every bundled package's licence text is appended (once per distinct text), so the
// wheel carries the notices its BSD/ISC/MIT licences ask for.
// Deterministic: the same sources and esbuild version give byte-identical output
// (tests/test_bundle.py rebuilds and compares).
import * as esbuild from "esbuild";
import { readdirSync, readFileSync, statSync } from "node:fs";
import { dirname, resolve } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
// `node build.mjs --outdir=DIR` writes elsewhere (tests rebuild into a temporary folder
// and compare with the committed bundle)
const outArg = process.argv.find((a) => a.startsWith("--outdir="));
const outdir = outArg ? resolve(outArg.slice("--outdir=".length)) : resolve(here, "..", "vramwidget", "static");

/** Packages (node_modules/<name>) whose code ends up in the bundle, sorted. */
function bundledPackages(metafile) {
  const names = new Set();
  for (const input of Object.keys(metafile.inputs)) {
    const m = input.match(/node_modules\/((?:@[^/]+\/)?[^/]+)\/(?!.*node_modules)/);
    if (m) names.add(m[1]);
  }
  return [...names].sort();
}

/** Each distinct licence text once, with the packages (name@version) it covers. */
function licenceFooter(names) {
  const byText = new Map();
  for (const n of names) {
    const dir = resolve(here, "node_modules", n);
    const pkg = JSON.parse(readFileSync(resolve(dir, "package.json"), "utf8"));
    const file = readdirSync(dir).find((f) => /^(licen[cs]e|copying)/i.test(f));
    const text = file ? readFileSync(resolve(dir, file), "utf8").trim() : `${pkg.license} (no licence file shipped)`;
    if (!byText.has(text)) byText.set(text, []);
    byText.get(text).push(`${n}@${pkg.version}`);
  }
  const parts = [...byText].map(([text, pkgs]) => `${pkgs.join(", ")}:\n\n${text.replaceAll("*/", "* /")}`);
  return "/*! Licences of the bundled packages\n\n" + parts.join("\n\n----\n\n") + "\n*/";
}

// a first pass finds what is bundled, for the banner and licences; the second writes
const probe = await esbuild.build({
  entryPoints: [resolve(here, "src", "widget.js")],
  bundle: true, format: "esm", platform: "browser", write: false, metafile: true, logLevel: "silent",
});
const bundled = bundledPackages(probe.metafile);
const banner = "/*! vramwidget frontend (MIT). Bundles " + bundled.length
  + " packages (vega, vega-lite, vega-embed and their dependencies); their licences are at the end. */";

const result = await esbuild.build({
  entryPoints: [resolve(here, "src", "widget.js"), resolve(here, "src", "widget.css")],
  bundle: true,
  minify: true,
  format: "esm",
  target: ["es2020", "chrome90", "firefox90", "safari15"],
  platform: "browser",
  legalComments: "eof",
  banner: { js: banner },
  footer: { js: licenceFooter(bundled) },
  outdir,
  entryNames: "[name]",
  charset: "utf8",
  metafile: true,
  logLevel: "warning",
});

const js = resolve(outdir, "widget.js");
const size = statSync(js).size;
const budget = 1_000_000;
console.log(`${js}: ${size.toLocaleString("en")} bytes (budget ${budget.toLocaleString("en")})`);
if (size > budget) {
  console.error("bundle over budget");
  process.exit(1);
}
if (process.argv.includes("--analyze")) {
  console.log(await esbuild.analyzeMetafile(result.metafile, { verbose: false }));
}
