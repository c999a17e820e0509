"""The treemap layout: area proportional to bytes, nested, non-overlapping, one scale.

The estimates here are built by hand (vramwidget.result), so these tests pin the
geometry alone; the numbers (GiB) are arbitrary but exact.
"""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vramwidget.result import Estimate, Node
from vramwidget.show.treemap import (
    comparison_rows,
    fmt_gib,
    layout_rows,
    shared_scale,
    total_bytes,
)
from vramwidget.units import GIB

REL = 1e-6


def make_estimate(parts, name="hand-built", scale=1.0):
    """parts: {component: {group: GiB}} or {component: GiB} (a leaf component)."""
    comps = []
    for cname, groups in parts.items():
        if isinstance(groups, dict):
            c = Node(cname)
            for gname, gib in groups.items():
                g = c.add(Node(gname))
                g.add(Node(f"{gname}.weight", bytes=gib * GIB * scale, formula=f"{gname}: {gib} GiB"))
        else:
            c = Node(cname, bytes=groups * GIB * scale, formula="fixed")
        comps.append(c.finalize())
    tot = sum(c.bytes for c in comps)
    return Estimate(name, {}, None, None, comps, {"backward": tot}, "backward", tot, tot, 0.0)


LLAMA_LIKE = {
    "weights": {"embedding": 0.98, "attention": 0.5, "mlp": 1.5, "norms": 0.0001},
    "gradients": {"embedding": 0.98, "attention": 0.5, "mlp": 1.5},
    "optimizer states": {"exp_avg": 2.3, "exp_avg_sq": 2.3},
    "activations": {"attention": 3.0, "mlp": 4.5, "residual": 1.0},
    "logits and loss": {"logits": 0.98, "fp32 logits": 1.96, "grad": 1.96},
    "cuda context": 0.5,
}


def area(r):
    return (r["x2"] - r["x"]) * (r["y2"] - r["y"])


def overlap(a, b):
    w = min(a["x2"], b["x2"]) - max(a["x"], b["x"])
    h = min(a["y2"], b["y2"]) - max(a["y"], b["y"])
    return max(w, 0.0) * max(h, 0.0)


def inside(inner, outer, tol=1e-7):
    return (inner["x"] >= outer["x"] - tol and inner["y"] >= outer["y"] - tol
            and inner["x2"] <= outer["x2"] + tol and inner["y2"] <= outer["y2"] + tol)


def check_box(rows, total_area=None):
    """Areas ∝ bytes, groups inside their component, nothing overlaps."""
    boxes = [r for r in rows if r["level"] in ("component", "group")]
    px_per_byte = [area(r) / r["bytes"] for r in boxes]
    k = px_per_byte[0]
    for v in px_per_byte:
        assert v == pytest.approx(k, rel=REL)
    comps = [r for r in rows if r["level"] == "component"]
    groups = [r for r in rows if r["level"] == "group"]
    if total_area is not None:
        assert sum(area(c) for c in comps) == pytest.approx(total_area, rel=REL)
    for g in groups:
        parent = [c for c in comps if c["component"] == g["component"] and c["scenario"] == g["scenario"]]
        assert len(parent) == 1 and inside(g, parent[0])
    for level in (comps, groups):
        for a, b in itertools.combinations(level, 2):
            assert overlap(a, b) <= 1e-6 * min(area(a), area(b)) + 1e-9
    # each component is tiled exactly by its groups
    for c in comps:
        kids = [g for g in groups if g["component"] == c["component"] and g["scenario"] == c["scenario"]]
        assert sum(area(g) for g in kids) == pytest.approx(area(c), rel=REL)
    return k


def test_detail_fills_the_box_with_area_proportional_to_bytes():
    est = make_estimate(LLAMA_LIKE)
    rows = layout_rows(est, 640, 360)
    k = check_box(rows, total_area=640 * 360)
    assert k == pytest.approx(640 * 360 / total_bytes(est), rel=REL)
    for r in rows:
        assert 0 <= r["x"] <= r["x2"] <= 640 + 1e-9 and 0 <= r["y"] <= r["y2"] <= 360 + 1e-9


def test_rows_carry_what_the_tooltip_shows():
    est = make_estimate(LLAMA_LIKE)
    rows = layout_rows(est, 640, 360, scenario="mine")
    keys = {"scenario", "level", "component", "group", "label", "text", "bytes", "gib", "share",
            "formula", "x", "y", "x2", "y2"}
    for r in rows:
        assert keys <= set(r)
        assert r["gib"] == pytest.approx(r["bytes"] / GIB)
        assert r["scenario"] == "mine"
    groups = [r for r in rows if r["level"] == "group"]
    assert sum(r["share"] for r in groups) == pytest.approx(1.0)
    mlp = next(r for r in groups if r["component"] == "activations" and r["group"] == "mlp")
    assert mlp["bytes"] == 4.5 * GIB
    assert mlp["formula"] == "mlp: 4.5 GiB"  # a one-child group shows its tensor's formula
    assert mlp["text"] == "activations · mlp\n4.50 GiB"  # the largest group names its component
    # a leaf component (no groups) is drawn as its own single group
    ctx = [r for r in rows if r["component"] == "cuda context"]
    assert [r["level"] for r in ctx] == ["component", "group"]
    assert ctx[1]["formula"] == "fixed"
    # boxes too small for text print nothing
    tiny = next(r for r in groups if r["group"] == "norms")
    assert tiny["text"] == ""


def test_zero_byte_parts_are_not_drawn():
    est = make_estimate({"weights": {"mlp": 1.0, "empty": 0.0}, "adapters": 0.0})
    rows = layout_rows(est, 100, 100)
    assert {r["group"] for r in rows} == {"weights", "mlp"}


def test_comparison_uses_one_scale_twice_the_bytes_twice_the_area():
    a = make_estimate(LLAMA_LIKE, "a")
    b = make_estimate(LLAMA_LIKE, "b", scale=2.0)
    c = make_estimate(LLAMA_LIKE, "c", scale=0.25)
    rows = comparison_rows([("one", a), ("two", b), ("quarter", c)], 640, 260)
    by = {}
    for name in ("one", "two", "quarter"):
        box = [r for r in rows if r["scenario"] == name]
        by[name] = sum(area(r) for r in box if r["level"] == "component")
        check_box(box)
    assert by["two"] / by["one"] == pytest.approx(2.0, rel=REL)
    assert by["quarter"] / by["one"] == pytest.approx(0.25, rel=REL)
    # one px²/byte for every box of every scenario
    boxes = [r for r in rows if r["level"] in ("component", "group")]
    k = area(boxes[0]) / boxes[0]["bytes"]
    for r in boxes:
        assert area(r) / r["bytes"] == pytest.approx(k, rel=REL)


def test_scenarios_sit_side_by_side_inside_the_chart():
    ests = [(f"s{i}", make_estimate(LLAMA_LIKE, scale=s)) for i, s in enumerate((1, 4, 3, 2, 0.3))]
    rows = comparison_rows(ests, 640, 260, capacity_bytes=24 * GIB, capacity_label="RTX 4090")
    outer = {}
    for name, _ in ests:
        comps = [r for r in rows if r["scenario"] == name and r["level"] == "component"]
        outer[name] = dict(x=min(r["x"] for r in comps), y=min(r["y"] for r in comps),
                           x2=max(r["x2"] for r in comps), y2=max(r["y2"] for r in comps))
        b = outer[name]
        assert 0 <= b["x"] and b["x2"] <= 640 + 1e-9 and 0 <= b["y"] and b["y2"] <= 260 + 1e-9
        assert (b["x2"] - b["x"]) == pytest.approx(b["y2"] - b["y"], rel=REL)  # a square
    for (n1, b1), (n2, b2) in itertools.combinations(outer.items(), 2):
        assert overlap(b1, b2) == 0
    titles = [r for r in rows if r["level"] == "title"]
    assert [t["scenario"] for t in titles] == [n for n, _ in ests]


def test_capacity_outline_is_on_the_same_scale():
    a = make_estimate(LLAMA_LIKE)
    cap = 24 * GIB
    rows = comparison_rows([("a", a)], 640, 260, capacity_bytes=cap, capacity_label="RTX 4090")
    comp_area = sum(area(r) for r in rows if r["level"] == "component")
    caps = [r for r in rows if r["level"] == "capacity"]
    assert len(caps) == 1 and caps[0]["label"] == "RTX 4090"
    assert area(caps[0]) / cap == pytest.approx(comp_area / total_bytes(a), rel=REL)
    # the outline shares the scenario's top-left corner
    comps = [r for r in rows if r["level"] == "component"]
    assert caps[0]["x"] == pytest.approx(min(r["x"] for r in comps))
    assert caps[0]["y"] == pytest.approx(min(r["y"] for r in comps))


def test_title_marks_a_scenario_that_does_not_fit():
    small = make_estimate({"weights": 10.0}, "small")
    big = make_estimate({"weights": 30.0}, "big")
    rows = comparison_rows([("small", small), ("big", big)], 640, 260, capacity_bytes=24 * GIB)
    titles = {r["scenario"]: r["text"] for r in rows if r["level"] == "title"}
    assert titles["small"] == "small\n10.0 GiB"
    assert titles["big"] == "big\n30.0 GiB ✗"


def test_shared_scale_is_limited_by_width_and_height():
    # two equal scenarios, no caption minimum: each square's side is (640 - 18) / 2
    s = shared_scale([GIB, GIB], 640, 1000, gap=18, header=0)
    assert math.sqrt(GIB * s) == pytest.approx(311.0)
    # a tall chart limit: the side is the height available
    s = shared_scale([GIB], 10_000, 200, gap=18, header=34)
    assert math.sqrt(GIB * s) == pytest.approx(166.0)
    # narrow scenarios get a minimum slot for their caption; all still fit
    totals = [100 * GIB, GIB, GIB, GIB]
    s = shared_scale(totals, 640, 260, gap=18, header=34, min_slot=84)
    widths = [max(math.sqrt(t * s), 84) for t in totals]
    assert sum(widths) + 18 * 3 <= 640 + 1e-6


def test_fmt_gib():
    """Automatic binary units with thousands separators (units.fmt_bytes)."""
    assert fmt_gib(123.4 * GIB) == "123 GiB"
    assert fmt_gib(12.34 * GIB) == "12.3 GiB"
    assert fmt_gib(0.5 * GIB) == "512 MiB"
    assert fmt_gib(1234 * GIB) == "1.21 TiB"
    assert fmt_gib(1) == "1 B"


# -- property tests ----------------------------------------------------------------------

group_bytes = st.floats(min_value=1e3, max_value=1e12, allow_nan=False, allow_infinity=False)
components = st.dictionaries(
    st.sampled_from(["weights", "gradients", "optimizer states", "activations", "logits and loss",
                     "adapters", "quantization constants", "optimizer temporaries"]),
    st.dictionaries(st.text("abcdefgh", min_size=1, max_size=6), group_bytes, min_size=1, max_size=8),
    min_size=1, max_size=8,
)


def _est(parts):
    return make_estimate({c: {g: b / GIB for g, b in gs.items()} for c, gs in parts.items()})


@settings(max_examples=150, deadline=None)
@given(parts=components, width=st.floats(50, 2000), height=st.floats(50, 2000))
def test_property_detail_layout(parts, width, height):
    rows = layout_rows(_est(parts), width, height)
    check_box(rows, total_area=width * height)


@settings(max_examples=100, deadline=None)
@given(parts=st.lists(components, min_size=1, max_size=5),
       cap=st.one_of(st.none(), st.floats(1e6, 1e12)))
def test_property_comparison_shared_scale(parts, cap):
    ests = [(f"s{i}", _est(p)) for i, p in enumerate(parts)]
    rows = comparison_rows(ests, 640, 260, capacity_bytes=cap)
    boxes = [r for r in rows if r["level"] in ("component", "group")]
    k = area(boxes[0]) / boxes[0]["bytes"]
    assert k > 0
    for r in boxes:
        assert area(r) / r["bytes"] == pytest.approx(k, rel=REL)
    for name, _ in ests:
        check_box([r for r in rows if r["scenario"] == name])
    for r in rows:
        if r["level"] != "title":
            assert r["x2"] <= 640 + 1e-6 and r["y2"] <= 260 + 1e-6
