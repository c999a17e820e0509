"""Layout checks run inside the page, on the widget as drawn (issue 25, "Must show").

Each is one JavaScript function taking the widget's root element and returning a list of
problems (an empty list: it holds):

``FIRST_VIEWPORT_JS``  the verdict and, when it does not fit, the first fix with its apply
                       button lie inside the first viewport (the window, less whatever the
                       host clips: JupyterLab scrolls its notebook panel);
``CHART_WIDTHS_JS``    no chart draws wider than its container;
``OVERLAPS_JS``        no two boxes of text overlap (HTML text nodes, one box per line, and
                       SVG text; clipped by every ancestor that clips);
``CONTRAST_JS``        every visible text has a WCAG 2 contrast ratio >= 4.5:1 with what is
                       under it (HTML: the ancestors' background colours composited; SVG:
                       the filled mark under the text's centre, else the page), opacity
                       applied; disabled controls are exempt (WCAG 1.4.3: "inactive user
                       interface components").

``SETTLED_JS`` is the condition to wait for after a resize or a theme change: the
background work done, every chart drawn at the width its column has now.
"""

from __future__ import annotations

#: shared helpers: visibility, clipping by ancestors, colours
_HELPERS = r"""
// the parent, across a shadow root's boundary (marimo draws widgets in one)
const up = (n) => n.parentElement || (n.getRootNode && n.getRootNode().host) || null;
const visible = (el) => el && el.checkVisibility && el.checkVisibility({visibilityProperty: true, opacityProperty: true});
const clipOf = (el) => {
  let r = {left: 0, top: 0, right: innerWidth, bottom: innerHeight};
  // the body's and the root's overflow clip the viewport, which the start already is
  for (let n = up(el); n && n !== document.body && n !== document.documentElement; n = up(n)) {
    const cs = getComputedStyle(n);
    if (cs.overflowX !== 'visible' || cs.overflowY !== 'visible' || cs.contain.includes('paint')) {
      const b = n.getBoundingClientRect();
      r = {left: Math.max(r.left, b.left), top: Math.max(r.top, b.top),
           right: Math.min(r.right, b.right), bottom: Math.min(r.bottom, b.bottom)};
    }
  }
  return r;
};
const cut = (b, c) => {
  const r = {left: Math.max(b.left, c.left), top: Math.max(b.top, c.top),
             right: Math.min(b.right, c.right), bottom: Math.min(b.bottom, c.bottom)};
  return r.right - r.left > 0.5 && r.bottom - r.top > 0.5 ? r : null;
};
const parse = (c) => {
  if (!c || c === 'none' || c === 'transparent') return [0, 0, 0, 0];
  let m = c.match(/^rgba?\(([^)]+)\)/);
  if (m) { const p = m[1].split(/[ ,/]+/).filter(Boolean).map(Number); return [p[0], p[1], p[2], p.length > 3 ? p[3] : 1]; }
  m = c.match(/^color\(srgb ([^)]+)\)/);
  if (m) { const p = m[1].split(/[ /]+/).filter(Boolean).map(Number); return [p[0] * 255, p[1] * 255, p[2] * 255, p.length > 3 ? p[3] : 1]; }
  m = c.match(/^#([0-9a-f]{6})/i);
  if (m) return [0, 2, 4].map(i => parseInt(m[1].slice(i, i + 2), 16)).concat([1]);
  return null;
};
const over = (top, under) => {   // top (with alpha) composited over an opaque colour
  const a = top[3];
  return [0, 1, 2].map(i => top[i] * a + under[i] * (1 - a)).concat([1]);
};
const lum = (c) => { const v = c.slice(0, 3).map(x => { x /= 255; return x <= 0.03928 ? x / 12.92 : ((x + 0.055) / 1.055) ** 2.4; });
  return 0.2126 * v[0] + 0.7152 * v[1] + 0.0722 * v[2]; };
const ratio = (a, b) => { const [h, l] = [lum(a), lum(b)].sort((x, y) => y - x); return (h + 0.05) / (l + 0.05); };
const pageBg = () => {
  for (const n of [document.body, document.documentElement]) {
    const c = parse(getComputedStyle(n).backgroundColor);
    if (c && c[3] > 0) return over(c, [255, 255, 255]);
  }
  return [255, 255, 255, 1];
};
const bgOf = (el) => {   // the ancestors' background colours, composited from the first opaque one up
  const layers = [];
  for (let n = el; n && n.nodeType === 1; n = up(n)) {
    const c = parse(getComputedStyle(n).backgroundColor);
    if (c && c[3] > 0) { layers.push(c); if (c[3] >= 1) break; }
  }
  let bg = layers.length && layers[layers.length - 1][3] >= 1 ? layers.pop() : pageBg();
  for (let i = layers.length - 1; i >= 0; i--) bg = over(layers[i], bg);
  return bg;
};
const opacityOf = (el) => { let o = 1; for (let n = el; n && n.nodeType === 1; n = up(n)) o *= +getComputedStyle(n).opacity; return o; };
const inactive = (el) => !!el.closest('[disabled], .vw-off, [aria-disabled="true"]');
const textBoxes = (root) => {   // [{text, rect, el}] for every visible line of HTML text and every SVG text
  const out = [];
  const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
  for (let t = walker.nextNode(); t; t = walker.nextNode()) {
    const el = t.parentElement;
    if (!t.textContent.trim() || !el || el.closest('svg, option, select, script, style, datalist') || !visible(el)) continue;
    const range = document.createRange();
    range.selectNodeContents(t);
    const clip = clipOf(el);
    for (const r of range.getClientRects()) {
      const c = cut(r, clip);
      if (c) out.push({text: t.textContent.trim().slice(0, 40), rect: c, el, node: t});
    }
  }
  for (const el of root.querySelectorAll('svg text')) {
    if (!el.textContent.trim() || !visible(el) || +getComputedStyle(el).opacity === 0) continue;
    const c = cut(el.getBoundingClientRect(), clipOf(el));
    if (c) out.push({text: el.textContent.trim().slice(0, 40), rect: c, el, node: el});
  }
  return out;
};
"""

FIRST_VIEWPORT_JS = "(root) => {" + _HELPERS + r"""
  const out = [];
  const inView = (sel, what) => {
    const el = root.querySelector(sel);
    if (!el || !visible(el)) { out.push(`${what}: not shown`); return; }
    const b = el.getBoundingClientRect();
    const c = clipOf(el);
    const seen = {left: Math.max(0, c.left), top: Math.max(0, c.top), right: Math.min(innerWidth, c.right), bottom: Math.min(innerHeight, c.bottom)};
    if (b.top < seen.top - 0.5 || b.bottom > seen.bottom + 0.5 || b.left < seen.left - 0.5 || b.right > seen.right + 0.5)
      out.push(`${what} at ${Math.round(b.left)},${Math.round(b.top)}-${Math.round(b.right)},${Math.round(b.bottom)} outside ${Math.round(seen.left)},${Math.round(seen.top)}-${Math.round(seen.right)},${Math.round(seen.bottom)}`);
  };
  inView('[data-testid=headline]', 'the need');
  inView('[data-testid=verdict-badge]', 'the verdict');
  const state = (root.querySelector('[data-testid=verdict-badge]') || {dataset: {}}).dataset.state;
  if (state === 'does_not_fit') {
    inView('[data-testid=suggestion-0]', 'the first fix');
    inView('[data-testid=suggestion-apply-0]', 'its apply button');
  }
  return out;
}"""

CHART_WIDTHS_JS = "(root) => {" + _HELPERS + r"""
  const out = [];
  for (const chart of root.querySelectorAll('.vw-chart')) {
    const svg = chart.querySelector('svg');
    if (!svg || !visible(chart)) continue;
    const box = chart.parentElement.getBoundingClientRect();
    const b = svg.getBoundingClientRect();
    if (b.width > box.width + 1 || b.right > box.right + 1 || b.left < box.left - 1)
      out.push(`${chart.dataset.testid}: drawn ${Math.round(b.width)} px wide in a ${Math.round(box.width)} px column`);
  }
  return out;
}"""

OVERLAPS_JS = "(root) => {" + _HELPERS + r"""
  const boxes = textBoxes(root);
  const out = [];
  for (let i = 0; i < boxes.length; i++) {
    for (let j = i + 1; j < boxes.length; j++) {
      const a = boxes[i], b = boxes[j];
      if (a.node === b.node) continue;
      const w = Math.min(a.rect.right, b.rect.right) - Math.max(a.rect.left, b.rect.left);
      const h = Math.min(a.rect.bottom, b.rect.bottom) - Math.max(a.rect.top, b.rect.top);
      if (w > 1 && h > 1) out.push(`"${a.text}" over "${b.text}" (${Math.round(w)} x ${Math.round(h)} px)`);
      if (out.length > 20) return out;
    }
  }
  return out;
}"""

CONTRAST_JS = "(root) => {" + _HELPERS + r"""
  const out = [];
  const seen = new Set();
  for (const box of textBoxes(root)) {
    const el = box.el;
    if (seen.has(box.node) || inactive(el)) continue;
    seen.add(box.node);
    const cs = getComputedStyle(el);
    let fg, bg;
    if (el.namespaceURI === 'http://www.w3.org/2000/svg') {
      fg = parse(cs.fill);
      if (fg) fg[3] *= +cs.fillOpacity;
      const r = box.rect;
      const doc = el.getRootNode().elementsFromPoint ? el.getRootNode() : document;
      const under = doc.elementsFromPoint((r.left + r.right) / 2, (r.top + r.bottom) / 2)
        .filter(e => e !== el && !e.closest('text'));
      bg = null;
      for (const e of under) {
        if (e.namespaceURI === 'http://www.w3.org/2000/svg') {
          if (!['path', 'rect', 'circle'].includes(e.tagName)) continue;
          const f = parse(getComputedStyle(e).fill);
          const fo = +getComputedStyle(e).fillOpacity * +getComputedStyle(e).opacity;
          if (f && f[3] * fo > 0.05) { f[3] *= fo; bg = over(f, bgOf(e.closest('svg').parentElement)); break; }
        } else { bg = bgOf(e); break; }
      }
      if (!bg) bg = bgOf(el.closest('svg').parentElement);
    } else {
      fg = parse(cs.color);
      bg = bgOf(el);
    }
    if (!fg) { out.push(`"${box.text}": colour ${el.namespaceURI === 'http://www.w3.org/2000/svg' ? cs.fill : cs.color} not understood`); continue; }
    fg = [fg[0], fg[1], fg[2], fg[3] * opacityOf(el)];
    const r = ratio(over(fg, bg), bg);
    if (r < 4.5) out.push(`"${box.text}": ${r.toFixed(2)}:1 (${fg.map(x => Math.round(x * 100) / 100)} on ${bg.map(Math.round)})`);
  }
  return out;
}"""

#: everything drawn for the current inputs at the width each chart has now, and nothing
#: moved for 400 ms (a host lays its panels out after a resize in its own time)
SETTLED_JS = r"""(root) => {
  const st = root.querySelector('[data-testid=status]');
  const sg = root.querySelector('[data-testid=suggestions]');
  if (!st || st.dataset.status !== 'idle' || (sg && (sg.dataset.status === 'computing' || sg.dataset.status === 'partial'))) return false;
  const sig = [root.getBoundingClientRect().width, innerWidth, innerHeight];
  for (const chart of root.querySelectorAll('.vw-chart')) {
    if (!chart.checkVisibility()) continue;
    const svg = chart.querySelector('svg');
    if (!chart.classList.contains('vw-ready') || !svg) return false;
    const box = chart.parentElement.clientWidth;
    const w = svg.getBoundingClientRect().width;
    const fit = chart.dataset.testid === 'chart-phases' || chart.dataset.testid === 'chart-fitmap';
    if (fit ? Math.abs(w - box) > 1 : (w > box || box - w >= 8)) return false;
    sig.push(box, w, svg.getBoundingClientRect().height);
  }
  const now = performance.now(), key = JSON.stringify(sig);
  const last = window.__vwSettle;
  if (!last || last.key !== key) { window.__vwSettle = {key, since: now}; return false; }
  return now - last.since >= 400;
}"""


def problems(locator) -> dict:
    """Every check on the widget under ``locator``, as {check: [problem]} (empty: all hold)."""
    out = {name: locator.evaluate(js) for name, js in (
        ("first viewport", FIRST_VIEWPORT_JS), ("chart widths", CHART_WIDTHS_JS),
        ("overlaps", OVERLAPS_JS), ("contrast", CONTRAST_JS))}
    return {k: v for k, v in out.items() if v}
