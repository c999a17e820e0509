"""The fast paths give what the straightforward ones give, to the byte and the word.

* ``plan.views.tree`` (the component trees, grouped with numpy) against the loop it
  replaced, written out here: every box's name, bytes, formula and dtype, in order;
* ``fit.suggestions`` with its cheap bounds (a candidate is judged on its allocated peak
  before its replay) against the same search replaying every candidate it estimates
  (``fit._CHEAP_BOUNDS`` off): the same suggestions, states and figures.
"""

from typing import Dict, List, Tuple

import pytest

import vramwidget as vw
from vramwidget.model.architecture import load
from vramwidget.plan import plan_view
from vramwidget.plan.views import live_rows
from vramwidget.result import COMPONENT_KINDS, Node
from vramwidget.training import TrainingSetup


def _tree_by_loop(ix, tot, at) -> List[Node]:
    """The trees as they were built row by row (the reference)."""
    info = ix.plan.info
    groups: Dict[Tuple[str, str, str], list] = {}
    rounding = 0
    for row in live_rows(ix, at):
        i = info[ix.keys[row]]
        g = groups.setdefault((i.component, i.group or i.component, i.name), [0, 0, i.formula, i.dtype])
        g[0] += int(tot.requested_bytes[row])
        g[1] += 1
        rounding += int(tot.rounded_bytes[row]) - int(tot.requested_bytes[row])
    comps: Dict[str, Node] = {}
    for (comp, group, name), (nbytes, count, formula, dtype) in groups.items():
        c = comps.setdefault(comp, Node(comp))
        gnode = next((x for x in c.children if x.name == group), None) or c.add(Node(group))
        gnode.add(Node(name, bytes=float(nbytes), dtype=dtype or None,
                       formula=(f"{count} x {formula}" if count > 1 and formula else formula)))
    if rounding:
        comps["allocator rounding"] = Node("allocator rounding", bytes=float(rounding),
                                           formula="each request rounded up to a multiple of 512 B (round_size)")
    order = {k: j for j, k in enumerate(COMPONENT_KINDS)}
    out = [n.finalize() for n in sorted(comps.values(), key=lambda n: order.get(n.name, 99))]
    return [n for n in out if n.bytes > 0]


TREE_SETUPS = [
    ("llama-3.2-1b", dict(method="qlora", gradient_checkpointing="full", batch_size=2, seq_len=1000)),
    ("gemma-2-2b", dict(attn_implementation="eager", method="lora", seq_len=300)),
    ("qwen2.5-0.5b", dict(precision="fp32", grad_accum_steps=2, optimizer="adamw_8bit")),
    ("llama-3.2-1b", dict(loss="liger", activation_offloading=True, gradient_checkpointing="full")),
    ("mixtral-8x7b", dict(method="qlora", seq_len=256)),
]


@pytest.mark.parametrize("model, kw", TREE_SETUPS)
def test_trees_equal_the_row_by_row_trees(model, kw):
    arch = load(model)
    view = plan_view(arch, TrainingSetup.from_kwargs(**kw))
    fast = view.trees()
    for phase, at in ((p, view.totals.phase_events[p]) for p in fast):
        ref = _tree_by_loop(view.index, view.totals, at)
        assert [n.to_dict() for n in fast[phase]] == [n.to_dict() for n in ref], (model, phase)
        assert fast[phase], "a tree that is empty compares nothing"


# -- a replay with a capacity: the fast loop (free-and-retry included) against the full model ----

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from vramwidget.fit import solver as fit  # noqa: E402
from vramwidget.allocator.caching import parse_alloc_conf, replay  # noqa: E402
from vramwidget.units import MIB  # noqa: E402


def _fields(res):
    oom = res.oom
    return (res.max_reserved_bytes, res.max_allocated_bytes, res.max_block_allocated_bytes, res.reserved_bytes,
            res.allocated_bytes, res.fragmentation_at_max_bytes, res.segments_allocated, res.num_events,
            res.num_alloc_retries, None if oom is None else (oom.index, oom.size, oom.label, oom.reserved, oom.allocated, oom.capacity))


def _stream(ops):
    """Events from (free?, bytes) pairs: a free drops a live key, every 7th op ends a step,
    the 3rd resets the peak (the plan's own event kinds)."""
    events, live, key = [], [], 0
    for j, (is_free, nbytes) in enumerate(ops):
        if is_free and live:
            events.append(("free", live.pop(nbytes % len(live)), 0, ""))
        else:
            key += 1
            live.append(key)
            events.append(("alloc", key, nbytes, f"t{key}"))
        if j == 3:
            events.append(("reset_peak", 0, 0, ""))
        if j % 7 == 6:
            events.append(("step_end", j // 7 + 1, 0, ""))
    return events


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(min_value=1, max_value=48 * MIB)), min_size=1, max_size=150),
       st.integers(min_value=2, max_value=400))
def test_capacity_replay_of_the_fast_loop_equals_the_full_model(ops, capacity_mib):
    """Every field of the result (the out-of-memory point included) is the full model's
    (``CachingAllocator``), whether or not the capacity is reached, cached segments released
    or a request refused; and without a capacity too.  The Python fast loop (the compiled
    replay is off here; tests/test_creplay.py compares that one)."""
    from vramwidget.allocator import caching

    caching.COMPILED, compiled = False, caching.COMPILED
    try:
        _fast_loop_equals_the_full_model(ops, capacity_mib)
    finally:
        caching.COMPILED = compiled


def _fast_loop_equals_the_full_model(ops, capacity_mib):
    events = _stream(ops)
    cap = capacity_mib * MIB
    capped = replay(events, None, cap)
    assert _fields(capped) == _fields(replay(events, None, cap, fast=False))
    assert _fields(replay(events)) == _fields(replay(events, fast=False))
    # without a retry the capacity replay is the unlimited one, field for field (fit_map and
    # the solvers take it as the unlimited replay, replays.adopt_capacity_replay); with one the
    # unlimited reserve is over the capacity
    if capped.num_alloc_retries == 0:
        assert _fields(capped) == _fields(replay(events))
    else:
        assert replay(events).max_reserved_bytes > cap


@pytest.mark.parametrize("model, kw", [
    ("llama-3.2-1b", dict(method="qlora", batch_size=4, seq_len=2048)),
    ("qwen2.5-0.5b", dict(precision="fp32", grad_accum_steps=2, batch_size=2, seq_len=1000)),
])
def test_capacity_replay_of_a_step_plan(model, kw, monkeypatch):
    """Capacities below the allocated peak, between it and the reserve, and above the reserve
    (the Python fast loop; the compiled replay: tests/test_creplay.py)."""
    from vramwidget.allocator import caching

    monkeypatch.setattr(caching, "COMPILED", False)
    arch = load(model)
    s = TrainingSetup.from_kwargs(**kw)
    events = plan_view(arch, s).events()
    free = replay(events, parse_alloc_conf(s.allocator))
    for cap in (0.9 * free.max_allocated_bytes, (free.max_allocated_bytes + free.max_reserved_bytes) / 2,
                free.max_reserved_bytes, free.max_reserved_bytes + 64 * MIB):
        assert _fields(replay(events, None, cap)) == _fields(replay(events, None, cap, fast=False)), cap


# -- fit's answers with and without the cheap bounds ---------------------------------------------

def _both(monkeypatch, fn):
    from vramwidget.allocator import replays

    out = []
    for cheap in (True, False):
        monkeypatch.setattr(fit, "CHEAP_BOUNDS", cheap)
        replays.clear_caches()        # nothing one run replayed helps the other
        out.append(fn())
    return out


@pytest.mark.parametrize("model, gpu, kw", [
    ("llama-3.2-1b", "RTX 4090", dict(method="full", seq_len=2048)),
    ("qwen2.5-0.5b", "T4", dict(precision="amp_fp16", gradient_checkpointing="full")),
])
def test_max_batch_and_seq_are_the_same(monkeypatch, model, gpu, kw):
    """The same largest batch; a sequence length on the same line.  The replayed allocator's
    reserve on a card is not monotone in the length (a request's 512-byte and 2 MiB
    roundings decide what a freed block can be reused for), so the line ripples over a few
    tokens, and the guided search (probes where the last failure's shortfall says the line
    is: ``fit.solver._bracket``) can stop at another boundary than plain bisection: each
    answer fits with one token more not fitting, and the two are within 1% of each other
    (qwen2.5-0.5b on a T4: 3,499 and 3,492 tokens)."""
    no_seq = {k: v for k, v in kw.items() if k != "seq_len"}
    fast, slow = _both(monkeypatch, lambda: (fit.max_batch_size(model, gpu, **kw),
                                             fit.max_seq_len(model, gpu, **no_seq)))
    assert fast[0] == slow[0]
    assert fast[0] > 0 and fast[1] > 0, "a search that finds nothing compares nothing"
    for n in (fast[1], slow[1]):
        assert fit.check(model, gpu, seq_len=n, **no_seq).fits and not fit.check(model, gpu, seq_len=n + 1, **no_seq).fits, n
    assert abs(fast[1] - slow[1]) <= 0.01 * slow[1], (fast[1], slow[1])


@pytest.mark.parametrize("model, gpu, kw", [
    ("llama-3.2-1b", "T4", dict(method="full", precision="fp32", batch_size=4, seq_len=1024, combine=2,
                                max_gpus=2)),
])
def test_suggestions_are_the_same(monkeypatch, model, gpu, kw):
    """The same suggestions in the same order, each with the same state and figures."""
    fast, slow = _both(monkeypatch, lambda: [x.to_dict() for x in fit.suggestions(model, gpu, **kw)])
    assert fast == slow
    assert any(x["parts"] for x in fast), "combinations are compared too"


def test_searches_pause_the_garbage_collector_and_restore_it():
    """fit's searches run with the cyclic collector paused (allocator.collector.gc_paused)
    and leave it as they found it, nested or not, on or off."""
    import gc

    from vramwidget.allocator import collector

    seen = []
    inner = collector.with_gc_paused(lambda: seen.append(gc.isenabled()))
    outer = collector.with_gc_paused(lambda: (inner(), seen.append(gc.isenabled())))
    was = gc.isenabled()
    try:
        gc.enable()
        outer()
        assert seen == [False, False] and gc.isenabled()
        gc.disable()
        outer()
        assert not gc.isenabled()
        gc.enable()
        with pytest.raises(ZeroDivisionError):
            collector.with_gc_paused(lambda: 1 / 0)()
        assert gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()


def test_a_plan_is_written_with_the_collector_paused(monkeypatch):
    """plan.plan_index and a sharded GPU's plan are written with the cyclic collector paused
    (their event tuples live only until the index keeps the events as columns: a collection
    meanwhile would move them to the oldest generation and set off full collections of the
    whole process later), and it is back on after."""
    import gc

    import vramwidget as vw
    from vramwidget import plan as plan_mod
    from vramwidget.allocator.replays import clear_caches
    from vramwidget.parallel import estimate as pest

    seen = []
    real_build, real_gpu = plan_mod.build_plan, pest.per_gpu_plan
    monkeypatch.setattr(plan_mod, "build_plan", lambda *a, **k: seen.append(("slice", gc.isenabled()))
                        or real_build(*a, **k))
    monkeypatch.setattr(pest, "per_gpu_plan", lambda *a, **k: seen.append(("gpu", gc.isenabled()))
                        or real_gpu(*a, **k))
    was = gc.isenabled()
    try:
        gc.enable()
        clear_caches()
        vw.estimate_parallel("qwen2.5-0.5b", method="lora", strategy="zero3", num_gpus=2, batch_size=3, seq_len=96)
        assert gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()
        clear_caches()
    assert ("slice", False) in seen and ("gpu", False) in seen and all(not on for _, on in seen)
