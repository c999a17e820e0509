"""Altair charts of an estimate: the detail treemap, the scenario comparison, the phases.

Each chart reads ONE named data source (``alt.NamedData(name)``): the widget embeds the
spec once and then swaps the rows in place (``view.data(name, rows)`` in the frontend),
so a change of batch size moves no spec over the wire.  Called on their own, the chart
functions put the rows into the spec's top-level ``datasets`` under that same name, so the
chart displays and saves (``chart.save("x.html")``) without the widget.

Scales are fixed: treemap x/x2/y/y2 are linear with domains ``[0, width]`` and
``[0, height]`` (the layout is already in pixels), and the colour of a component never
changes (:data:`COMPONENT_COLORS`), whichever components an estimate has.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import altair as alt

from ..result import PHASES, Estimate
from .treemap import KNOWN_COMPONENTS, comparison_rows, component_kind, fmt_gib, layout_rows
from ..units import GIB, fmt_bytes

#: one colour per component kind, readable on a light and a dark notebook background;
#: weights (blue), workspace (gold), CUDA context (slate grey: visible on a dark page too) and the allocator reserve
#: (light warm grey) are far apart, so the parts outside the model read as such.  Text
#: on a box is black or white, whichever contrasts more (:func:`text_color`: >= 4.5:1).
COMPONENT_COLORS: Dict[str, str] = {
    "weights": "#3b6ea8",
    "quantization constants": "#2a8c8c",
    "adapters": "#8e5bb5",
    "gradients": "#cf7026",
    "optimizer states": "#c2404a",
    "activations": "#4f9a4a",
    "logits and loss": "#a67c1f",
    "optimizer temporaries": "#c0578f",
    "kv cache": "#2f8f6b",
    "logits": "#a67c1f",
    "workspace": "#e3c03b",
    "cuda context": "#6e7781",
    "allocator reserve": "#c9c0b6",
    "other": "#9a9a9a",
}


def _luminance(hex_color: str) -> float:
    """WCAG 2 relative luminance of '#rrggbb'."""
    rgb = [int(hex_color[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    lin = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in rgb]
    return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]


def contrast_ratio(a: str, b: str) -> float:
    """WCAG 2 contrast ratio of two '#rrggbb' colours (1 to 21)."""
    la, lb = sorted((_luminance(a), _luminance(b)), reverse=True)
    return (la + 0.05) / (lb + 0.05)


def text_color(fill: str) -> str:
    """Black or white, whichever contrasts more with ``fill`` (one of them always reaches
    4.5:1, WCAG AA for small text)."""
    return "#000000" if contrast_ratio(fill, "#000000") >= contrast_ratio(fill, "#ffffff") else "#ffffff"


#: the text colour on each component's boxes
TEXT_COLORS: Dict[str, str] = {k: text_color(v) for k, v in COMPONENT_COLORS.items()}
#: the phase chart's colour for a phase the estimate gives only as a total
ALL_COMPONENTS = "all components"
_PHASE_EXTRA = {ALL_COMPONENTS: "#7d8794"}


def component_color(name: str) -> str:
    """The fixed colour of a component (grey for one outside the known kinds)."""
    return COMPONENT_COLORS.get(component_kind(name), COMPONENT_COLORS["other"])


#: how each phase is called on the phase chart
PHASE_LABELS: Dict[str, str] = {
    "after_load": "after load",
    "forward": "end of forward",
    "backward": "backward peak",
    "optimizer_step": "optimizer step",
}

DETAIL = "detail"
COMPARISON = "comparison"
PHASES_DATA = "phases"

_FONT = 11
#: charts drawn at the width they are given, axes included (the widget gives them their box's)
_FIT = alt.AutoSizeParams(type="fit", contains="padding")


#: the colour of the lines between boxes: a parameter, so the frontend can set it to the
#: notebook's background (white lines on a light page, dark lines on a dark one)
GAP_PARAM = "vw_gap"


def _gap_param() -> alt.Parameter:
    return alt.param(name=GAP_PARAM, value="#ffffff")


def _color(legend: bool, extra: bool = False,
           legend_values: Optional[Sequence[str]] = None) -> alt.Color:
    """Colour by the ``kind`` field on a fixed scale: the same colour for a component in
    every chart and every update, whichever components an estimate has.

    ``legend_values`` limits the legend to those kinds (default: every known kind)."""
    colors = dict(COMPONENT_COLORS, **(_PHASE_EXTRA if extra else {}))
    domain = list(KNOWN_COMPONENTS) + [k for k in colors if k not in KNOWN_COMPONENTS]
    values = list(legend_values) if legend_values is not None else list(KNOWN_COMPONENTS)
    return alt.Color(
        "kind:N",
        scale=alt.Scale(domain=domain, range=[colors[k] for k in domain]),
        legend=alt.Legend(title=None, orient="bottom", columns=6, symbolType="square",
                          labelLimit=160, values=values) if legend else None,
    )


def _tooltip(with_scenario: bool) -> List[alt.Tooltip]:
    tips = [
        alt.Tooltip("label:N", title="part"),
        alt.Tooltip("gib:Q", title="GiB", format=".3f"),
        alt.Tooltip("bytes:Q", title="bytes", format=",.0f"),
        alt.Tooltip("share:Q", title="share", format=".1%"),
    ]
    if with_scenario:  # the comparison: which scenario, no formulas (the detail has them)
        tips.insert(0, alt.Tooltip("scenario:N", title="scenario"))
    else:
        tips.append(alt.Tooltip("formula:N", title="formula"))
    return tips


def _treemap_layers(name: str, width: float, height: float, *, legend: bool,
                    with_scenario: bool, legend_values: Optional[Sequence[str]] = None
                    ) -> List[alt.Chart]:
    base = alt.Chart(alt.NamedData(name))
    # the layout is in pixels (x right, y down from the top-left corner): no scale
    x = alt.X("x:Q", scale=None, axis=None)
    y = alt.Y("y:Q", scale=None, axis=None)
    groups = base.transform_filter(alt.datum.level == "group").mark_rect(
        stroke=alt.expr(GAP_PARAM), strokeWidth=0.75, strokeOpacity=0.8,
    ).encode(x=x, x2="x2:Q", y=y, y2="y2:Q", color=_color(legend, legend_values=legend_values),
             tooltip=_tooltip(with_scenario))
    components = base.transform_filter(alt.datum.level == "component").mark_rect(
        fill=None, stroke=alt.expr(GAP_PARAM), strokeWidth=2.5,
    ).encode(x=x, x2="x2:Q", y=y, y2="y2:Q", tooltip=_tooltip(with_scenario))
    text = base.transform_filter((alt.datum.level == "group") & (alt.datum.text != "")).mark_text(
        align="left", baseline="top", dx=4, dy=3, fontSize=_FONT, lineBreak="\n", lineHeight=13,
    ).encode(x=x, y=y, text="text:N",
             fill=alt.Fill("kind:N", legend=None, scale=alt.Scale(
                 domain=list(TEXT_COLORS), range=list(TEXT_COLORS.values()))))
    return [groups, components, text]


def _with_rows(chart, name: str, rows: Optional[List[Dict[str, Any]]]):
    """Put rows inline under the chart's data name (standalone use), or leave it named."""
    if rows is None:
        return chart
    return chart.properties(datasets={name: rows})


def detail_spec_chart(width: float = 640, height: float = 360, *, name: str = DETAIL,
                      title: Optional[str] = None,
                      legend_values: Optional[Sequence[str]] = None, legend: bool = True) -> alt.LayerChart:
    """The detail treemap reading data named ``name`` (no rows inline); ``legend=False``
    leaves the legend to the caller (the widget draws one of the parts present)."""
    chart = alt.layer(*_treemap_layers(name, width, height, legend=legend, with_scenario=False,
                                       legend_values=legend_values)
                      ).add_params(_gap_param())
    props: Dict[str, Any] = dict(width=width, height=height, padding=0, autosize="none")
    if title:
        props["title"] = title
    return chart.properties(**props).configure_view(stroke=None)


def detail_chart(est: Optional[Estimate] = None, *, width: float = 640, height: float = 360,
                 rows: Optional[List[Dict[str, Any]]] = None, name: str = DETAIL,
                 title: Optional[str] = None) -> alt.LayerChart:
    """The treemap of one estimate: component > module group, area ∝ bytes.

    With ``est`` (or ``rows``) the rows are inlined, so the chart works without the
    widget; with neither, the chart reads the named data ``name`` supplied later.
    """
    if rows is None and est is not None:
        rows = layout_rows(est, width, height)
    if title is None and est is not None:
        title = (f"{est.model_name}: peak {fmt_gib(est.peak_allocated_bytes)} "
                 f"at {PHASE_LABELS.get(est.peak_phase, est.peak_phase)}")
    present = None
    if rows is not None:  # standalone: the legend lists only what is drawn
        kinds = {r["kind"] for r in rows if r.get("level") == "group"}
        present = [k for k in COMPONENT_COLORS if k in kinds]
    return _with_rows(detail_spec_chart(width, height, name=name, title=title,
                                        legend_values=present), name, rows)


def comparison_chart(scenarios: Optional[Sequence[Tuple[str, Estimate]]] = None, *,
                     width: float = 640, height: float = 260,
                     capacity_bytes: Optional[float] = None, capacity_label: str = "",
                     rows: Optional[List[Dict[str, Any]]] = None,
                     name: str = COMPARISON) -> alt.LayerChart:
    """Scenarios side by side on one scale (twice the memory, twice the area).

    A dashed square outlines the GPU's capacity at each scenario's corner.
    """
    if rows is None and scenarios is not None:
        rows = comparison_rows(scenarios, width, height, capacity_bytes=capacity_bytes,
                               capacity_label=capacity_label)
    base = alt.Chart(alt.NamedData(name))
    # the layout is in pixels (x right, y down from the top-left corner): no scale
    x = alt.X("x:Q", scale=None, axis=None)
    y = alt.Y("y:Q", scale=None, axis=None)
    layers = _treemap_layers(name, width, height, legend=False, with_scenario=True)
    capacity = base.transform_filter(alt.datum.level == "capacity").mark_rect(
        fill=None, stroke="#e45756", strokeWidth=1.5, strokeDash=[5, 3],
    ).encode(x=x, x2="x2:Q", y=y, y2="y2:Q",
             tooltip=[alt.Tooltip("label:N", title="GPU"),
                      alt.Tooltip("gib:Q", title="GiB", format=".1f")])
    captions = base.transform_filter(alt.datum.level == "title").mark_text(
        align="left", baseline="top", fontSize=_FONT, lineBreak="\n", lineHeight=13,
    ).encode(x=x, y=y, text="text:N")
    chart = alt.layer(*layers[:2], capacity, layers[2], captions, data=alt.NamedData(name)
                      ).add_params(_gap_param()).properties(
        width=width, height=height, padding=0, autosize="none").configure_view(stroke=None)
    return _with_rows(chart, name, rows)


#: what the GPU holds besides the allocated tensors (drawn on top of each phase's bar)
_NOT_ALLOCATED = ("allocator reserve", "cuda context")


def phase_rows(est: Estimate, *, capacity_bytes: Optional[float] = None, capacity_label: str = "",
               phases: Optional[Sequence[str]] = None, labels: Optional[Dict[str, str]] = None
               ) -> List[Dict[str, Any]]:
    """Rows for the phase bars: what the GPU holds at each phase of one step, on the
    verdict's measure (:mod:`vramwidget.fit.verdict`).

    Each bar is the phase's allocated components plus the CUDA context; the peak phase's
    bar also holds the allocator's reserve, so its top is the device total (reserved + CUDA
    context) that the verdict compares with the GPU line.  ``level`` is ``"bar"`` (one per
    phase and component), ``"total"`` (one per phase: the bar's top, labelled),
    ``"allocated"`` (one per phase: the allocated tensors, a tick inside the bar) or
    ``"capacity"`` (the GPU line).  ``phases`` and ``labels`` default to a training step's.
    """
    rows: List[Dict[str, Any]] = []
    order = {k: i for i, k in enumerate(KNOWN_COMPONENTS)}
    phases = list(PHASES) if phases is None else list(phases)
    labels = PHASE_LABELS if labels is None else labels
    context = float(est.cuda_context_bytes)
    reserve = max(float(est.reserved_bytes) - float(est.peak_allocated_bytes), 0.0)

    def bar(label: str, i: int, name: str, kind: str, corder: int, nbytes: float) -> None:
        rows.append({"level": "bar", "phase": label, "order": i, "component": name, "kind": kind,
                     "corder": corder, "bytes": nbytes, "gib": nbytes / GIB, "text": ""})

    for i, phase in enumerate(phases):
        label = labels.get(phase, phase)
        total = est.phases_bytes.get(phase)
        comps = est.phase_components.get(phase)
        if phase == est.peak_phase and not comps:
            comps = est.components
        comps = [c for c in comps or [] if c.name not in _NOT_ALLOCATED]
        if comps:
            for c in comps:
                bar(label, i, c.name, component_kind(c.name), order.get(c.name, 99), c.bytes)
            if total is None:
                total = sum(c.bytes for c in comps)
        elif total is not None:
            bar(label, i, ALL_COMPONENTS, ALL_COMPONENTS, 99, total)
        if total is None:
            continue
        peak = phase == est.peak_phase
        bar(label, i, "cuda context", "cuda context", order.get("cuda context", 99), context)
        held = total + context
        if peak:
            bar(label, i, "allocator reserve", "allocator reserve", order.get("allocator reserve", 99), reserve)
            held += reserve
        rows.append({"level": "total", "phase": label, "order": i, "component": "", "kind": "",
                     "corder": 0, "bytes": held, "gib": held / GIB, "peak": peak,
                     "text": fmt_bytes(held)})
        rows.append({"level": "allocated", "phase": label, "order": i, "component": "allocated", "kind": "",
                     "corder": 0, "bytes": total, "gib": total / GIB,
                     "text": f"allocated {fmt_bytes(total)}" if peak else ""})
    # the GPU line; without a GPU an invisible one at 0, so the layer's data is never
    # empty (Vega warns about an infinite extent otherwise)
    cap = capacity_bytes or 0.0
    rows.append({"level": "capacity", "phase": "", "order": 0, "component": "", "kind": "",
                 "corder": 0, "bytes": cap, "gib": cap / GIB,
                 "text": (capacity_label or fmt_bytes(cap)) if cap else ""})
    # room above the tallest bar for its two-line label (an invisible point the y scale spans)
    top = max([r["bytes"] for r in rows if r["level"] in ("total", "capacity")] or [0.0]) * 1.22
    rows.append({"level": "pad", "phase": labels.get(phases[0], phases[0]) if phases else "", "order": 0,
                 "component": "", "kind": "", "corder": 0, "bytes": top, "gib": top / GIB, "text": ""})
    return rows


def phase_chart(est: Optional[Estimate] = None, *, width: float = 640, height: float = 200,
                capacity_bytes: Optional[float] = None, capacity_label: str = "",
                rows: Optional[List[Dict[str, Any]]] = None,
                name: str = PHASES_DATA) -> alt.LayerChart:
    """What the GPU holds after load, at the end of forward, at the backward peak and in
    the optimizer step, stacked by component (plus the CUDA context, and the allocator's
    reserve at the peak: the device total), the allocated tensors as a tick in each bar,
    and the GPU's capacity as a dashed rule."""
    if rows is None and est is not None:
        rows = phase_rows(est, capacity_bytes=capacity_bytes, capacity_label=capacity_label)
    base = alt.Chart(alt.NamedData(name))
    phase_order = [PHASE_LABELS.get(p, p) for p in PHASES]
    y_axis = alt.Axis(title="GiB on the GPU", grid=True, gridOpacity=0.3)
    # phase names on two lines where they have two words, so narrow bars keep them apart
    x = alt.X("phase:N", sort=phase_order, title=None,
              axis=alt.Axis(labelAngle=0, labelLineHeight=12, labelExpr=(
                  "length(datum.label) > 10 && lastindexof(datum.label, ' ') > 0 ? "
                  "[substring(datum.label, 0, lastindexof(datum.label, ' ')), "
                  "substring(datum.label, lastindexof(datum.label, ' ') + 1)] : datum.label")))
    bars = base.transform_filter(alt.datum.level == "bar").mark_bar().encode(
        x=x,
        y=alt.Y("sum(gib):Q", axis=y_axis, stack="zero"),
        color=_color(False, extra=True),
        order=alt.Order("corder:Q"),
        tooltip=[alt.Tooltip("phase:N"), alt.Tooltip("component:N"),
                 alt.Tooltip("sum(gib):Q", title="GiB", format=",.3f")],
    )
    # one line above each bar (the peak's in bold): its device total; allocated is the tick
    totals = alt.layer(*(base.transform_filter((alt.datum.level == "total") & (alt.datum.peak == peak)).mark_text(
        baseline="bottom", dy=-3, fontSize=_FONT, fontWeight="bold" if peak else "normal",
    ).encode(x=x, y=alt.Y("gib:Q"), text="text:N") for peak in (False, True)))
    # the allocated tensors: a tick inside each bar (the peak's figure is in its label)
    allocated = base.transform_filter(alt.datum.level == "allocated").mark_tick(
        color="#111111", thickness=2, size=28, opacity=0.85,
    ).encode(x=x, y=alt.Y("gib:Q"), tooltip=[alt.Tooltip("phase:N"),
                                             alt.Tooltip("gib:Q", title="GiB allocated", format=",.2f")])
    label_opacity = alt.condition(alt.datum.text == "", alt.value(0), alt.value(1))
    rule = base.transform_filter(alt.datum.level == "capacity").mark_rule(
        color="#e45756", strokeDash=[5, 3], strokeWidth=1.5,
    ).encode(y=alt.Y("gib:Q"), opacity=label_opacity, tooltip=[alt.Tooltip("text:N", title="GPU")])
    # the GPU's name is said beside the chart (the widget's note, the tooltip here), not on the
    # plot, where a bar above the line would run through it
    pad = base.transform_filter(alt.datum.level == "pad").mark_point(opacity=0).encode(x=x, y=alt.Y("gib:Q"))
    chart = alt.layer(bars, allocated, totals, rule, pad).properties(width=width, height=height, autosize=_FIT)
    return _with_rows(chart.configure_view(stroke=None), name, rows)


FITMAP = "fitmap"
#: the fit map's colours: fits, tight (the estimate's uncertainty decides), does not fit
STATE_COLORS: Dict[str, str] = {"fits": "#2e7d32", "tight": "#e0a100", "does_not_fit": "#c62828"}
STATE_LABELS: Dict[str, str] = {"fits": "fits", "tight": "tight", "does_not_fit": "does not fit"}


def fitmap_rows(df: Any, *, batch_size: Optional[int] = None, seq_len: Optional[int] = None,
                capacity_bytes: Optional[float] = None) -> List[Dict[str, Any]]:
    """Rows of the fit map from :func:`vramwidget.fit_map`'s frame (or rows with its
    columns): one ``cell`` per (batch, sequence), a box spanning half a power of two on each
    side on log-2 axes, and the ``current`` point.  A cell whose device total was not
    replayed (``reserved_exact`` False: its state is known from where it lies, its total is
    the provisional one) shows "about" before its figures."""
    rows: List[Dict[str, Any]] = []
    records = df.to_dict("records") if hasattr(df, "to_dict") else list(df)
    for r in records:
        b, s = int(r["batch_size"]), int(r["seq_len"])
        need = float(r["device_total_bytes"])
        room = (capacity_bytes - need) if capacity_bytes else None
        about = "" if r.get("reserved_exact", True) else "about "
        rows.append({
            "level": "cell", "batch_size": b, "seq_len": s, "state": r["state"],
            "state_label": STATE_LABELS.get(r["state"], r["state"]),
            "x": b / 2 ** 0.5, "x2": b * 2 ** 0.5, "y": s / 2 ** 0.5, "y2": s * 2 ** 0.5,
            "need": about + fmt_bytes(need),
            "room": "" if room is None else about + (f"{fmt_bytes(room)} to spare" if room >= 0
                                                     else f"{fmt_bytes(-room)} over"),
        })
    if batch_size and seq_len:
        rows.append({"level": "current", "batch_size": int(batch_size), "seq_len": int(seq_len), "state": "",
                     "state_label": "", "x": float(batch_size), "x2": float(batch_size),
                     "y": float(seq_len), "y2": float(seq_len), "need": "", "room": ""})
    return rows


def fitmap_chart(df: Any = None, *, width: float = 300, height: float = 200,
                 batch_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64),
                 seq_lens: Sequence[int] = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768),
                 rows: Optional[List[Dict[str, Any]]] = None, name: str = FITMAP,
                 batch_size: Optional[int] = None, seq_len: Optional[int] = None) -> alt.LayerChart:
    """Where a setup fits: micro-batch x sequence length on log-2 axes, each cell coloured
    fits / tight / does not fit; the current setup as a diamond.  In the widget a click on
    a cell sets batch and sequence."""
    if rows is None and df is not None:
        rows = fitmap_rows(df, batch_size=batch_size, seq_len=seq_len)
    base = alt.Chart(alt.NamedData(name))
    lo_b, hi_b = min(batch_sizes) / 2 ** 0.5, max(batch_sizes) * 2 ** 0.5
    lo_s, hi_s = min(seq_lens) / 2 ** 0.5, max(seq_lens) * 2 ** 0.5
    x = alt.X("x:Q", title="micro-batch size", scale=alt.Scale(type="log", base=2, domain=[lo_b, hi_b], nice=False),
              axis=alt.Axis(values=list(batch_sizes), format="d", grid=False))
    y = alt.Y("y:Q", title=None, scale=alt.Scale(type="log", base=2, domain=[lo_s, hi_s], nice=False),
              axis=alt.Axis(values=list(seq_lens), grid=False, titlePadding=6,
                            labelExpr="datum.value >= 1024 ? (datum.value / 1024) + 'k' : datum.value"))
    states = list(STATE_COLORS)
    cells = base.transform_filter(alt.datum.level == "cell").mark_rect(
        stroke=alt.expr(GAP_PARAM), strokeWidth=1, cursor="pointer",
    ).encode(
        x=x, x2="x2:Q", y=y, y2="y2:Q",
        color=alt.Color("state:N", scale=alt.Scale(domain=states, range=[STATE_COLORS[k] for k in states]),
                        legend=None),
        tooltip=[alt.Tooltip("batch_size:Q", title="micro-batch", format="d"),
                 alt.Tooltip("seq_len:Q", title="sequence length", format=",d"),
                 alt.Tooltip("state_label:N", title="verdict"),
                 alt.Tooltip("need:N", title="on the GPU"), alt.Tooltip("room:N", title="headroom")],
    )
    current = base.transform_filter(alt.datum.level == "current").mark_point(
        shape="diamond", filled=True, size=140, color="#ffffff", stroke="#000000", strokeWidth=2,
    ).encode(x=x, y=y, tooltip=[alt.Tooltip("batch_size:Q", title="your micro-batch", format="d"),
                                alt.Tooltip("seq_len:Q", title="your sequence length", format=",d")])
    chart = alt.layer(cells, current).add_params(_gap_param()).properties(width=width, height=height,
                                                                          autosize=_FIT)
    return _with_rows(chart.configure_view(stroke=None), name, rows)
