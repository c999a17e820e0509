// @ts-check
/** DOM and number helpers shared by every panel. */

/**
 * @param {string} tag
 * @param {Record<string, any>} [attrs]
 * @param {(Node | string)[]} [children]
 * @returns {HTMLElement}
 */
export function h(tag, attrs = {}, children = []) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") el.className = v;
    else if (k === "text") el.textContent = v;
    else if (k === "testid") el.dataset.testid = v;
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children) el.append(c);
  return el;
}

/**
 * Bytes with an automatic binary unit and thousands separators, the one format of the
 * widget, the notebooks and the CLI (vramwidget.units.fmt_bytes): 612 MiB, 9.96 GiB,
 * 23.5 GiB, 1,234 GiB is 1.21 TiB.
 * @param {number | null | undefined} b
 */
export function fmtBytes(b) {
  if (b === null || b === undefined || !isFinite(b)) return "–";
  const sign = b < 0 ? "-" : "";
  const a = Math.abs(b);
  const three = (/** @type {number} */ x, /** @type {string} */ u) =>
    `${sign}${x >= 100 ? Math.round(x).toLocaleString("en") : x >= 10 ? x.toFixed(1) : x.toFixed(2)} ${u}`;
  if (a >= 2 ** 40) return three(a / 2 ** 40, "TiB");
  if (a >= 2 ** 30) return three(a / 2 ** 30, "GiB");
  if (a >= 2 ** 20) return `${sign}${Math.round(a / 2 ** 20).toLocaleString("en")} MiB`;
  if (a >= 2 ** 10) return `${sign}${Math.round(a / 2 ** 10).toLocaleString("en")} KiB`;
  return `${sign}${Math.round(a).toLocaleString("en")} B`;
}

/** GiB (a float) in the same format. @param {number | null | undefined} gib */
export function fmtGiB(gib) {
  return gib === null || gib === undefined ? "–" : fmtBytes(gib * 2 ** 30);
}

/** @param {number | null | undefined} n */
export function fmtCount(n) {
  if (n === null || n === undefined) return "–";
  for (const [d, s] of [[1e12, "T"], [1e9, "B"], [1e6, "M"], [1e3, "K"]]) {
    if (n >= /** @type {number} */ (d)) return `${(n / /** @type {number} */ (d)).toPrecision(3)}${s}`;
  }
  return String(n);
}

/** @param {number | null | undefined} n */
export function fmtInt(n) {
  return n === null || n === undefined ? "–" : Math.round(n).toLocaleString("en");
}

/** Bytes per token as KiB (or bytes below 1 KiB). @param {number} b */
export function fmtPerToken(b) {
  return b >= 1024 ? `${Number((b / 1024).toPrecision(4))} KiB` : `${Math.round(b)} B`;
}

/** Exact for whole numbers below a million (65504, 57344, 448), else 4 significant digits.
 * @param {number} x */
export function fmtNum(x) {
  if (x === 0) return "0";
  const a = Math.abs(x);
  if (Number.isInteger(x) && a < 1e6) return x.toLocaleString("en");
  if (a >= 1e6 || a < 1e-3) return x.toExponential(3).replace("e+", "e");
  return String(Number(x.toPrecision(4)));
}
