"""Benchmark the caching-allocator replay behind ``Estimate.reserved_bytes``.

A replay runs one setup's step plan (``vramwidget.plan``: the load and three training
steps, the plan built once per setup shape with sizes as polynomials) through the
allocator model (``allocator.replay``).  It runs once per setup, on first access of
``reserved_bytes`` (or the device total, the verdict, the components' "allocator
reserve"), and is cached.  Timed here: the plan's events at a new size
(``PlanView.events``), the replay (unlimited), the replay with a capacity above the reserve
(the fast loop until a segment would pass the capacity: here never) and below it (the fast
loop until the limit, then the full model's free-and-retry), and the same with
``fast_until_limit=False`` (the full model from the start, the reference); the estimate
without a replay beside them.

    python benchmarks/bench_allocator.py [--repeat 10] [--strict]

Target: the events + replay under 50 ms median for Llama 3.2 1B (bf16, batch 2 x 2048)
and under 250 ms for Llama 3.1 8B QLoRA (batch 4 x 2048, checkpointing) on a 2-core container.
``--strict`` exits 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import fmt_ms, percentile, time_calls  # noqa: E402

from vramwidget.model import architecture  # noqa: E402
from vramwidget.allocator import caching, replays  # noqa: E402
from vramwidget.allocator.caching import replay  # noqa: E402
from vramwidget.estimate import estimate_setup  # noqa: E402
from vramwidget.plan import plan_view  # noqa: E402
from vramwidget.training import TrainingSetup  # noqa: E402

CASES = (
    ("llama-3.2-1b", dict(batch_size=2, seq_len=2048), 0.050),
    ("llama-3.1-8b", dict(method="qlora", batch_size=4, seq_len=2048, gradient_checkpointing="full"), 0.250),
)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--strict", action="store_true")
    a = ap.parse_args()
    ok = True
    print(f"load average {os.getloadavg()[0]:.2f}")
    for model, kw, target in CASES:
        arch = architecture.load(model)
        s = TrainingSetup.from_kwargs(**kw)
        view = plan_view(arch, s)                         # the plan built once (not timed)
        events = view.events()
        t_events = time_calls(view.events, a.repeat, warmup=1)
        res = replay(events)
        above = res.max_reserved_bytes + (64 << 20)
        below = (res.max_allocated_bytes + res.max_reserved_bytes) / 2
        # (compiled, Python fast loop, CachingAllocator) for each capacity
        times = {}
        for name, cap in (("unlimited", None), ("above", above), ("below", below)):
            row = [time_calls(lambda: replay(events, None, cap), a.repeat, warmup=1)]
            caching.COMPILED, was = False, caching.COMPILED
            try:
                row.append(time_calls(lambda: replay(events, None, cap), a.repeat, warmup=1))
            finally:
                caching.COMPILED = was
            row.append(time_calls(lambda: replay(events, None, cap, fast=False), max(1, a.repeat // 3), warmup=0))
            times[name] = [percentile(t, 0.5) for t in row]

        def plain():
            replays.clear_caches()
            estimate_setup(arch, s)

        t_est = time_calls(plain, a.repeat, warmup=1)
        both = percentile(t_events, 0.5) + times["unlimited"][0]
        verdict = "ok" if both <= target else "MISSED"
        ok = ok and both <= target
        print(f"{model} {kw}: {len(events)} events; compiled replay {'on' if caching.COMPILED else 'OFF'}")
        print(f"  events at a size {fmt_ms(percentile(t_events, 0.5))}   replay {fmt_ms(times['unlimited'][0])}"
              f"   both {fmt_ms(both)} (target {fmt_ms(target)}: {verdict})   estimate with its plan built, no "
              f"replay {fmt_ms(percentile(t_est, 0.5))}")
        for name, label in (("unlimited", "no capacity"), ("above", "a capacity above the reserve"),
                            ("below", "a capacity below it (free-and-retry)")):
            c, py, ref = times[name]
            print(f"  {label:40s} compiled {fmt_ms(c)}   Python fast loop {fmt_ms(py)} ({py / c:,.0f}x)   "
                  f"CachingAllocator {fmt_ms(ref)} ({ref / c:,.0f}x)")
    return 0 if ok or not a.strict else 1


if __name__ == "__main__":
    sys.exit(main())
