"""Treemap layout: where each box of memory is drawn, as a list of small dicts.

Area is proportional to bytes.  The hierarchy is component > module group: each group's
rectangle lies inside its component's rectangle, and the groups of a component tile it
exactly.  Layout is squarified (Bruls, Huizing and van Wijk, via the ``squarify``
package) and done here in Python, so the frontend only draws rectangles.

Coordinates are in chart pixels, x to the right and y downwards from the top-left
corner; a chart draws them with linear scales whose domains are fixed at
``[0, width]`` and ``[0, height]``.

Two layouts:

:func:`layout_rows`
    one estimate filling a ``width`` x ``height`` box (the detail treemap).
:func:`comparison_rows`
    several estimates on one shared scale: each scenario is a square whose area is
    ``bytes * scale`` with the same ``scale`` for all, so twice the memory is twice the
    area; an optional GPU capacity square is outlined at each scenario's corner.

Every row has the keys ``scenario, level, component, kind, group, label, text, bytes,
gib, share, formula, x, y, x2, y2`` (``kind`` is the colour key: the component's name,
or ``"other"`` for a name outside :data:`KNOWN_COMPONENTS`).  ``level`` is ``"component"`` or ``"group"`` for boxes,
``"capacity"`` for the GPU outline and ``"title"`` for a scenario's caption; ``text`` is
what is printed inside the box ("" when the box is too small to hold it).

A comparison scales each scenario's :class:`UnitBox` (its layout in the unit square), so
a scenario seen before costs no new layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import squarify

from ..result import COMPONENT_KINDS, Estimate, Node
from ..units import GIB, fmt_bytes

Row = Dict[str, Any]

#: components that get their own colour; any other top-level name is drawn as "other"
KNOWN_COMPONENTS: Tuple[str, ...] = tuple(COMPONENT_KINDS)
_KNOWN = frozenset(KNOWN_COMPONENTS)


def component_kind(name: str) -> str:
    """The colour key of a component: its name if known, else ``"other"``."""
    return name if name in _KNOWN else "other"

#: a box narrower or lower than this (pixels) prints no text
_MIN_TEXT_W = 34.0
_MIN_TEXT_H = 14.0
_TWO_LINES_H = 28.0
_CHAR_W = 6.2  # average glyph width at the 10-11 px font the charts use


def fmt_gib(nbytes: float) -> str:
    """Bytes as the charts print them: automatic binary units and thousands separators
    (:func:`vramwidget.units.fmt_bytes`: '612 MiB', '12.3 GiB', '1.21 TiB')."""
    return fmt_bytes(nbytes)


def _fit_text(names: "str | Sequence[str]", nbytes: float, w: float, h: float) -> str:
    """The text a box of w x h pixels can show: the first of ``names`` that fits on its
    line, then the size; the size only; or nothing.  Never a cut word."""
    if w < _MIN_TEXT_W or h < _MIN_TEXT_H:
        return ""
    size = fmt_gib(nbytes)
    max_chars = int((w - 6) / _CHAR_W)
    if len(size) > max_chars:
        return ""
    if h < _TWO_LINES_H:
        return size
    for name in ([names] if isinstance(names, str) else names):
        if name and len(name) <= max_chars:
            return f"{name}\n{size}"
    return size


def _node_formula(node: Node, limit: int = 4) -> str:
    """A node's own formula, else its children's, joined ('+ n more' past ``limit``)."""
    if node.formula:
        return node.formula
    if len(node.children) == 1:
        return _node_formula(node.children[0], limit)
    parts = []
    for c in node.children[:limit]:
        f = c.formula or _node_formula(c, limit=1)
        if f:
            parts.append(f"{c.name}: {f}")
    more = len(node.children) - limit
    if more > 0:
        parts.append(f"+ {more} more")
    return "; ".join(parts)


def _squarify(nodes: Sequence[Node], x: float, y: float, dx: float, dy: float
              ) -> List[Tuple[Node, float, float, float, float]]:
    """Squarified rectangles (node, x, y, x2, y2) tiling the box, area ∝ node.bytes."""
    items = sorted((n for n in nodes if n.bytes > 0), key=lambda n: (-n.bytes, n.name))
    if not items or dx <= 0 or dy <= 0:
        return []
    total = sum(n.bytes for n in items)
    k = dx * dy / total
    rects = squarify.squarify([n.bytes * k for n in items], x, y, dx, dy)
    # squarify places the last strip from a difference of two near-equal widths; with a
    # 1e8:1 range of sizes that can poke out of the box by ~1e-6 px: clamp it back
    # (this moves a rectangle's area by far less than one part in a million)
    x_end, y_end = x + dx, y + dy
    return [(n, r["x"], r["y"], min(r["x"] + r["dx"], x_end), min(r["y"] + r["dy"], y_end))
            for n, r in zip(items, rects)]


def _box_rows(components: Sequence[Node], x: float, y: float, dx: float, dy: float,
              scenario: str, total: float) -> List[Row]:
    """Component rows, then the group rows nested in them, for one box."""
    total = total or 1.0
    comp_rows: List[Row] = []
    group_rows: List[Row] = []
    for comp, cx, cy, cx2, cy2 in _squarify(components, x, y, dx, dy):
        kind = component_kind(comp.name)
        comp_rows.append({
            "scenario": scenario, "level": "component", "component": comp.name, "kind": kind,
            "group": comp.name, "label": comp.name, "text": "",
            "bytes": comp.bytes, "gib": comp.bytes / GIB, "share": comp.bytes / total,
            "formula": _node_formula(comp), "x": cx, "y": cy, "x2": cx2, "y2": cy2,
        })
        groups = comp.children if comp.children else [comp]
        for i, (g, gx, gy, gx2, gy2) in enumerate(_squarify(groups, cx, cy, cx2 - cx, cy2 - cy)):
            label = g.name if g is not comp else comp.name
            # the largest group names its component too ("weights · mlp"), so the same group
            # name in several colours reads as the parts of different components
            head = f"{comp.name} · {label}" if (i == 0 and g is not comp) else ""
            group_rows.append({
                "scenario": scenario, "level": "group", "component": comp.name, "kind": kind,
                "group": label, "head": head, "label": label if g is comp else f"{comp.name}: {label}",
                "text": _fit_text((head, label), g.bytes, gx2 - gx, gy2 - gy),
                "bytes": g.bytes, "gib": g.bytes / GIB, "share": g.bytes / total,
                "formula": _node_formula(g), "x": gx, "y": gy, "x2": gx2, "y2": gy2,
            })
    return comp_rows + group_rows


def total_bytes(est: Estimate, phase: Optional[str] = None) -> float:
    """Sum of the top-level components drawn for ``est`` (its peak, or ``phase``)."""
    comps = est.components if phase is None else est.phase_components.get(phase, [])
    return float(sum(c.bytes for c in comps))


def layout_rows(est: Estimate, width: float = 640.0, height: float = 360.0, *,
                scenario: str = "", phase: Optional[str] = None) -> List[Row]:
    """The detail treemap of one estimate, filling ``width`` x ``height``.

    ``phase`` picks another phase's components (default: those live at the peak).
    """
    comps = est.components if phase is None else est.phase_components.get(phase, [])
    total = float(sum(c.bytes for c in comps))
    return _box_rows(comps, 0.0, 0.0, float(width), float(height), scenario, total)


@dataclass(frozen=True)
class UnitBox:
    """One scenario laid out in the unit square, ready to be scaled into a comparison.

    A squarified layout of a square is the same at every size, so the widget computes this
    once per scenario setup, keeps it (it holds only plain rows, no estimate tree) and
    only scales it when the shared scale changes.
    """

    scenario: str
    total_bytes: float
    device_total_bytes: float
    rows: Tuple[Row, ...]
    reserved_bytes: float = 0.0   # the predicted reserved part (the verdict's band scales it)
    squeezed: bool = False        # fits only by the allocator freeing cached blocks at the limit (gpus.judge_on)


def unit_box(est: Estimate, scenario: str = "") -> UnitBox:
    """``est``'s peak components laid out in the unit square (no text yet)."""
    total = total_bytes(est)
    rows = _box_rows(est.components, 0.0, 0.0, 1.0, 1.0, scenario, total)
    return UnitBox(scenario, total, float(est.device_total_bytes), tuple(rows), float(est.reserved_bytes),
                   bool(getattr(est, "squeezed", False)))


def _place(box: UnitBox, x0: float, y0: float, side: float, scenario: str) -> List[Row]:
    """The unit box's rows scaled to a square of ``side`` pixels at (x0, y0).

    Formulas are left out (the detail treemap shows them): they are most of the bytes an
    update would send."""
    out = []
    for r in box.rows:
        q = dict(r, scenario=scenario, formula="", x=x0 + r["x"] * side, y=y0 + r["y"] * side,
                 x2=x0 + r["x2"] * side, y2=y0 + r["y2"] * side)
        if r["level"] == "group":
            q["text"] = _fit_text((r.get("head", ""), r["group"]), r["bytes"], (r["x2"] - r["x"]) * side,
                                  (r["y2"] - r["y"]) * side)
        out.append(q)
    return out


def shared_scale(totals: Sequence[float], width: float, height: float, *,
                 capacity_bytes: Optional[float] = None, gap: float = 18.0,
                 header: float = 34.0, min_slot: "float | Sequence[float]" = 0.0) -> float:
    """Pixels² per byte so that every scenario square (and capacity outline) fits.

    Scenario i is a square of side ``sqrt(bytes_i * scale)`` in a slot as wide as the
    largest of it, the capacity square and ``min_slot`` (room for its caption: one figure
    for all, or one per scenario); the slots sit side by side with ``gap`` between them,
    under a ``header`` band.
    """
    cap = capacity_bytes or 0.0
    roots = [math.sqrt(max(t, cap, 0.0)) for t in totals]
    mins = [float(min_slot)] * len(roots) if isinstance(min_slot, (int, float)) else [float(m) for m in min_slot]
    if not roots or max(roots) <= 0:
        return 0.0
    avail_w = width - gap * (len(roots) - 1)
    avail_h = height - header
    unit = min(avail_w / sum(roots), avail_h / max(roots))
    # slots narrower than their minimum are widened; shrink the scale until all fit
    for _ in range(len(roots) + 1):
        fixed = [i for i, r in enumerate(roots) if r * unit < mins[i]]
        free = sum(r for i, r in enumerate(roots) if r * unit >= mins[i])
        if not fixed or free <= 0:
            break
        new_unit = min((avail_w - sum(mins[i] for i in fixed)) / free, avail_h / max(roots))
        if new_unit >= unit - 1e-12:
            break
        unit = max(new_unit, 0.0)
    return max(unit, 0.0) ** 2


#: the comparison's caption font: 11 px, this many pixels per character at most (digits and
#: capitals of the sans-serif fonts notebooks use), and the line height
CAPTION_CHAR_W = 7.0
CAPTION_LINE_H = 13.0


def caption_width(text: str) -> float:
    """Pixels the widest line of a caption needs (with a few pixels of air)."""
    return max((len(line) for line in text.splitlines()), default=0) * CAPTION_CHAR_W + 6.0


def caption_rows(captions: Sequence[str], width: float, gap: float = 18.0, max_rows: int = 3) -> int:
    """How many rows of scenarios the comparison needs at ``width`` so that no two captions
    overlap: the fewest rows (up to ``max_rows``) whose slots, each as wide as its caption,
    fit side by side."""
    widths = [caption_width(c) for c in captions]
    for k in range(1, max_rows + 1):
        per = -(-len(widths) // k)
        if all(sum(widths[i:i + per]) + gap * (len(widths[i:i + per]) - 1) <= width
               for i in range(0, len(widths), per)):
            return k
    return max_rows


def comparison_rows(scenarios: Sequence[Tuple[str, "Estimate | UnitBox"]], width: float = 640.0,
                    height: float = 260.0, *, capacity_bytes: Optional[float] = None,
                    capacity_label: str = "", gap: float = 18.0, header: float = 34.0,
                    min_slot: float = 84.0, captions: Optional[Dict[str, str]] = None,
                    rows_of: int = 1) -> List[Row]:
    """Several estimates side by side on ONE scale: area = bytes x the same factor.

    ``scenarios`` is a list of (name, Estimate or :class:`UnitBox`).  Each scenario is a
    square of area ``bytes * scale``.  With ``capacity_bytes`` a dashed square of that
    area (the GPU) is outlined at the top-left corner of every scenario, so a scenario
    that spills out of it does not fit.  ``captions`` (name -> text) replace the default
    caption (name and total) and widen each slot to its caption's width
    (:func:`caption_width`), so captions never overlap; ``rows_of`` lays the scenarios out
    in that many rows (:func:`caption_rows` says how many a width needs), each
    ``height / rows_of`` tall, on the same scale.
    """
    boxes = [(name, b if isinstance(b, UnitBox) else unit_box(b, name)) for name, b in scenarios]
    totals = [b.total_bytes for _, b in boxes]
    k = max(1, min(int(rows_of), len(boxes) or 1))
    per = -(-len(boxes) // k) if boxes else 1
    mins = [max(min_slot, caption_width(captions[n])) if captions and n in captions else min_slot
            for n, _ in boxes]
    row_h = height / k
    scale = min((shared_scale(totals[i:i + per], width, row_h, capacity_bytes=capacity_bytes, gap=gap,
                              header=header, min_slot=mins[i:i + per])
                 for i in range(0, len(boxes), per)), default=0.0)
    cap_side = math.sqrt((capacity_bytes or 0.0) * scale)
    rows: List[Row] = []
    titles: List[Row] = []
    caps: List[Row] = []
    for j, ((name, box), tot, m) in enumerate(zip(boxes, totals, mins)):
        if j % per == 0:
            x, y0 = 0.0, row_h * (j // per)
        side = math.sqrt(tot * scale)
        rows.extend(_place(box, x, y0 + header, side, name))
        fits = capacity_bytes is None or box.device_total_bytes <= capacity_bytes
        text = captions[name] if captions and name in captions else \
            f"{name}\n{fmt_gib(tot)}" + ("" if fits else " ✗")
        titles.append({
            "reserved_bytes": box.reserved_bytes,
            "squeezed": box.squeezed,
            "scenario": name, "level": "title", "component": "", "kind": "", "group": "",
            "label": name, "text": text,
            "bytes": tot, "gib": tot / GIB, "share": 1.0, "formula": "",
            "x": x, "y": y0 + 2.0, "x2": x + side, "y2": y0 + 2.0,
        })
        if capacity_bytes:
            caps.append({
                "scenario": name, "level": "capacity", "component": "", "kind": "", "group": "",
                "label": capacity_label or "GPU", "text": "",
                "bytes": capacity_bytes, "gib": capacity_bytes / GIB,
                "share": capacity_bytes / (tot or 1.0), "formula": "",
                "x": x, "y": y0 + header, "x2": x + cap_side, "y2": y0 + header + cap_side,
            })
        x += max(side, cap_side, m) + gap
    return rows + caps + titles
