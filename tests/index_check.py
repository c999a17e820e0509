"""A plan's index read off its copied spans equals the index read event by event.

``plan.views.PlanIndex`` reads a span a plan wrote as a copy of an earlier one
(``StepPlan.copies``: a step that repeats the one before) off its source's arrays; with
``views.COPY_AWARE_INDEX`` off it reads every event.  ``same_index`` builds both from one
plan's events (each on its own copy of the plan) and lists what differs; the step-plan and
GPU-plan tests call it on random setups.
"""

from __future__ import annotations

from typing import List

import numpy as np

from vramwidget.plan import views
from vramwidget.plan.builder import StepPlan, copies_hold

FIELDS = ("codes", "slots", "signs", "rows", "alloc_at", "free_at", "keys", "symbolic", "sizes", "coef", "basis")


def _twin(p: StepPlan) -> StepPlan:
    return StepPlan(list(p.events), p.info, p.marks, p.steps, p.notes, p.host_bytes, p.repeats, p.passes_copied,
                    p.copies)


def index_differences(plan: StepPlan) -> List[str]:
    """What differs between the two indexes of ``plan`` (empty: none), and whether its copies
    are what its events are (``builder.copies_hold``)."""
    out = [] if copies_hold(plan) else ["a copy record is not what the events are"]
    fast_plan, slow_plan = _twin(plan), _twin(plan)
    try:
        views.COPY_AWARE_INDEX = False
        slow = views.PlanIndex(slow_plan)
    finally:
        views.COPY_AWARE_INDEX = True
    fast = views.PlanIndex(fast_plan)
    return out + _differences(fast, slow, fast_plan, slow_plan)


def derived_index_differences(ix: views.PlanIndex, lay) -> List[str]:
    """What differs between the GPU index ``per_gpu.startup_buffers_plan`` reads off the
    slice's index ``ix`` (DDP's layout ``lay``) and the GPU plan's own index (read event by
    event); ["not derived"] where it gives none."""
    from vramwidget.plan import per_gpu

    both = per_gpu.startup_buffers_plan(ix, lay)
    if both is None:
        return ["not derived"]
    plan, derived = both
    twin = _twin(plan)
    try:
        views.COPY_AWARE_INDEX = False
        own = views.PlanIndex(twin)
    finally:
        views.COPY_AWARE_INDEX = True
    return _differences(derived, own, plan, twin)


def _differences(fast, slow, fast_plan, slow_plan) -> List[str]:
    out = []
    for f in FIELDS:
        a, b = getattr(fast, f), getattr(slow, f)
        if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
            same = a is not None and b is not None and a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b)
        else:
            same = a == b
        if not same:
            out.append(f)
    for name, a, b in zip(("kinds", "keys", "sizes", "labels"), fast.columns[:4], slow.columns[:4]):
        if a != b or [type(x) for x in a] != [type(x) for x in b]:
            out.append(f"column {name}")
    if not np.array_equal(fast.columns[4], slow.columns[4]):
        out.append("allocation events")
    if list(fast_plan.events) != list(slow_plan.events):
        out.append("events")
    return out
