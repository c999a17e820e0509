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

from .result import PHASES, Estimate
from .treemap import KNOWN_COMPONENTS, comparison_rows, component_kind, fmt_gib, layout_rows
from .units import GIB

#: one colour per component kind, mid-tone so white text reads on them and they read on
#: both a light and a dark notebook background
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
    "workspace": "#5b7f9e",
    "cuda context": "#707a85",
    "allocator reserve": "#8c7b66",
    "other": "#9a9a9a",
}
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
    x = alt.X("x:Q", scale=alt.Scale(domain=[0, width], nice=False, zero=False), axis=None)
    y = alt.Y("y:Q", scale=alt.Scale(domain=[0, height], nice=False, zero=False, reverse=True),
              axis=None)
    groups = base.transform_filter(alt.datum.level == "group").mark_rect(
        stroke=alt.expr(GAP_PARAM), strokeWidth=0.75, strokeOpacity=0.8,
    ).encode(x=x, x2="x2:Q", y=y, y2="y2:Q", color=_color(legend, legend_values=legend_values),
             tooltip=_tooltip(with_scenario))
    components = base.transform_filter(alt.datum.level == "component").mark_rect(
        fill=None, stroke=alt.expr(GAP_PARAM), strokeWidth=2.5,
    ).encode(x=x, x2="x2:Q", y=y, y2="y2:Q", tooltip=_tooltip(with_scenario))
    text = base.transform_filter((alt.datum.level == "group") & (alt.datum.text != "")).mark_text(
        align="left", baseline="top", dx=4, dy=3, color="#ffffff", fontSize=_FONT,
        lineBreak="\n", lineHeight=13,
    ).encode(x=x, y=y, text="text:N")
    return [groups, components, text]


def _with_rows(chart, name: str, rows: Optional[List[Dict[str, Any]]]):
    """Put rows inline under the chart's data name (standalone use), or leave it named."""
    if rows is None:
        return chart
    return chart.properties(datasets={name: rows})


def detail_spec_chart(width: float = 640, height: float = 360, *, name: str = DETAIL,
                      title: Optional[str] = None,
                      legend_values: Optional[Sequence[str]] = None) -> alt.LayerChart:
    """The detail treemap reading data named ``name`` (no rows inline)."""
    chart = alt.layer(*_treemap_layers(name, width, height, legend=True, with_scenario=False,
                                       legend_values=legend_values)
                      ).add_params(_gap_param())
    props: Dict[str, Any] = dict(width=width, height=height)
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
    x = alt.X("x:Q", scale=alt.Scale(domain=[0, width], nice=False, zero=False), axis=None)
    y = alt.Y("y:Q", scale=alt.Scale(domain=[0, height], nice=False, zero=False, reverse=True),
              axis=None)
    layers = _treemap_layers(name, width, height, legend=False, with_scenario=True)
    capacity = base.transform_filter(alt.datum.level == "capacity").mark_rect(
        fill=None, stroke="#e45756", strokeWidth=1.5, strokeDash=[5, 3],
    ).encode(x=x, x2="x2:Q", y=y, y2="y2:Q",
             tooltip=[alt.Tooltip("label:N", title="GPU"),
                      alt.Tooltip("gib:Q", title="GiB", format=".1f")])
    captions = base.transform_filter(alt.datum.level == "title").mark_text(
        align="left", baseline="top", fontSize=_FONT, lineBreak="\n", lineHeight=13,
        fontWeight="bold",
    ).encode(x=x, y=y, text="text:N")
    chart = alt.layer(*layers[:2], capacity, layers[2], captions, data=alt.NamedData(name)
                      ).add_params(_gap_param()).properties(
        width=width, height=height).configure_view(stroke=None)
    return _with_rows(chart, name, rows)


def phase_rows(est: Estimate, *, capacity_bytes: Optional[float] = None,
               capacity_label: str = "") -> List[Dict[str, Any]]:
    """Rows for the phase bars: memory by component at each phase of one step.

    ``level`` is ``"bar"`` (one per phase and component), ``"total"`` (one per phase,
    for the label over the bar) or ``"capacity"`` (the GPU line).
    """
    rows: List[Dict[str, Any]] = []
    order = {k: i for i, k in enumerate(KNOWN_COMPONENTS)}
    for i, phase in enumerate(PHASES):
        label = PHASE_LABELS.get(phase, phase)
        total = est.phases_bytes.get(phase)
        comps = est.phase_components.get(phase)
        if phase == est.peak_phase and not comps:
            comps = est.components
        if comps:
            for c in comps:
                rows.append({"level": "bar", "phase": label, "order": i,
                             "component": c.name, "kind": component_kind(c.name),
                             "corder": order.get(c.name, 99),
                             "bytes": c.bytes, "gib": c.bytes / GIB, "text": ""})
            if total is None:
                total = sum(c.bytes for c in comps)
        elif total is not None:
            rows.append({"level": "bar", "phase": label, "order": i, "component": ALL_COMPONENTS,
                         "kind": ALL_COMPONENTS,
                         "corder": 99, "bytes": total, "gib": total / GIB, "text": ""})
        if total is not None:
            peak = " (peak)" if phase == est.peak_phase else ""
            rows.append({"level": "total", "phase": label, "order": i, "component": "", "kind": "",
                         "corder": 0, "bytes": total, "gib": total / GIB,
                         "text": fmt_gib(total) + peak})
    # the GPU line; without a GPU an invisible one at 0, so the layer's data is never
    # empty (Vega warns about an infinite extent otherwise)
    cap = capacity_bytes or 0.0
    rows.append({"level": "capacity", "phase": "", "order": 0, "component": "", "kind": "",
                 "corder": 0, "bytes": cap, "gib": cap / GIB,
                 "text": (capacity_label or fmt_gib(cap)) if cap else ""})
    return rows


def phase_chart(est: Optional[Estimate] = None, *, width: float = 640, height: float = 200,
                capacity_bytes: Optional[float] = None, capacity_label: str = "",
                rows: Optional[List[Dict[str, Any]]] = None,
                name: str = PHASES_DATA) -> alt.LayerChart:
    """Memory after load, at the end of forward, at the backward peak and in the
    optimizer step, stacked by component, with the GPU's capacity as a dashed rule."""
    if rows is None and est is not None:
        rows = phase_rows(est, capacity_bytes=capacity_bytes, capacity_label=capacity_label)
    base = alt.Chart(alt.NamedData(name))
    phase_order = [PHASE_LABELS.get(p, p) for p in PHASES]
    y_axis = alt.Axis(title="GiB allocated", grid=True, gridOpacity=0.3)
    x = alt.X("phase:N", sort=phase_order, title=None, axis=alt.Axis(labelAngle=0))
    bars = base.transform_filter(alt.datum.level == "bar").mark_bar().encode(
        x=x,
        y=alt.Y("sum(gib):Q", axis=y_axis, stack="zero"),
        color=_color(False, extra=True),
        order=alt.Order("corder:Q"),
        tooltip=[alt.Tooltip("phase:N"), alt.Tooltip("component:N"),
                 alt.Tooltip("sum(gib):Q", title="GiB", format=".3f")],
    )
    totals = base.transform_filter(alt.datum.level == "total").mark_text(
        baseline="bottom", dy=-3, fontSize=_FONT,
    ).encode(x=x, y=alt.Y("gib:Q"), text="text:N")
    shown = alt.condition(alt.datum.text == "", alt.value(0), alt.value(1))
    rule = base.transform_filter(alt.datum.level == "capacity").mark_rule(
        color="#e45756", strokeDash=[5, 3], strokeWidth=1.5,
    ).encode(y=alt.Y("gib:Q"), opacity=shown, tooltip=[alt.Tooltip("text:N", title="GPU")])
    # the GPU's name at the left end of its line, above the first phase (after load: the
    # lowest bar), where it does not collide with the totals printed on the tall bars
    rule_text = base.transform_filter(alt.datum.level == "capacity").mark_text(
        align="left", baseline="bottom", dx=2, dy=-2, color="#e45756", fontSize=_FONT,
    ).encode(y=alt.Y("gib:Q"), x=alt.value(0), text="text:N")
    chart = alt.layer(bars, totals, rule, rule_text).properties(width=width, height=height)
    return _with_rows(chart.configure_view(stroke=None), name, rows)
