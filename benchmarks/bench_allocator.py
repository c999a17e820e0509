"""Benchmark the caching-allocator replay behind ``Estimate.reserved_bytes``.

A replay lays out one setup's load and three training steps as allocations and frees
(``events.training_events``) and runs them through the allocator model (``allocator.replay``).
It runs once per setup, on first access of ``reserved_bytes`` (or the device total, the
verdict, the components' "allocator reserve"), and is cached.  Timed here, for uncached
setups: the event stream, the replay, and both together; the estimate without the replay is
printed beside them.  Then the stream template (``events.StreamTemplate``: built once per setup,
it gives the stream at any batch and sequence length without regenerating it): its build,
the stream at a new size from it, and ``replay_training`` at a new size with the template
kept (what the widget and ``fit_map`` pay per new size).

    python benchmarks/bench_allocator.py [--repeat 20] [--strict]

Target: the event stream + replay under 50 ms median for Llama 3.2 1B (bf16, batch 2 x 2048)
and under 250 ms for Llama 3.1 8B QLoRA (batch 4 x 2048, checkpointing) on a 2-core container.
``--strict`` exits 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import fmt_ms, percentile, time_calls  # noqa: E402

from vramwidget.model import architecture  # noqa: E402
from vramwidget.allocator.caching import replay  # noqa: E402
from vramwidget.estimate import estimate_setup  # noqa: E402
from vramwidget.events import clear_caches, replay_training, stream_template, training_events  # noqa: E402
from vramwidget.training import TrainingSetup  # noqa: E402

CASES = (
    ("llama-3.2-1b", dict(batch_size=2, seq_len=2048), 0.050),
    ("llama-3.1-8b", dict(method="qlora", batch_size=4, seq_len=2048, gradient_checkpointing="full"), 0.250),
)


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def events_mod_clear_replays() -> None:
    """Forget the cached replays but keep the stream templates."""
    from vramwidget import events

    with events._LOCK:
        events._REPLAYS.clear()
        events._BY_SHAPE.clear()
        events._BY_STREAM.clear()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--strict", action="store_true")
    a = ap.parse_args()
    ok = True
    for model, kw, target in CASES:
        arch = architecture.load(model)
        s = TrainingSetup.from_kwargs(**kw)
        events = training_events(arch, s)
        t_events = time_calls(lambda: training_events(arch, s), a.repeat, warmup=2)
        t_replay = time_calls(lambda: replay(events), a.repeat, warmup=2)

        def both():
            replay(training_events(arch, s))

        t_both = time_calls(both, a.repeat, warmup=2)

        def plain():
            clear_caches()
            estimate_setup(arch, s)

        t_est = time_calls(plain, a.repeat, warmup=2)
        # the stream from the setup's template (built once per setup, at the second size asked
        # for): one numpy expression over the sizes instead of regenerating the stream
        clear_caches()
        import numpy  # noqa: F401  (imported by the template; not timed)
        t0 = time.perf_counter()
        tpl = stream_template(arch, s)
        t_build = time.perf_counter() - t0
        sizes = [(kw["batch_size"] + k, kw["seq_len"]) for k in range(1, a.repeat + 3)]
        t_tpl = sorted(_time(lambda b=b, q=q: list(tpl.events_at(b, q))) for b, q in sizes)

        t_new = []
        for b, q in sizes:
            events_mod_clear_replays()
            t0 = time.perf_counter()
            replay_training(arch, s.replace(batch_size=b, seq_len=q))
            t_new.append(time.perf_counter() - t0)
        t_new.sort()
        med = percentile(t_both, 0.5)
        verdict = "ok" if med <= target else "MISSED"
        ok = ok and med <= target
        print(f"{model} {kw}: {len(events)} events")
        print(f"  event stream {fmt_ms(percentile(t_events, 0.5))}   replay {fmt_ms(percentile(t_replay, 0.5))}   "
              f"both {fmt_ms(med)} (target {fmt_ms(target)}: {verdict})   estimate without it "
              f"{fmt_ms(percentile(t_est, 0.5))}")
        print(f"  stream template: built once in {fmt_ms(t_build)}; the stream at a new size "
              f"{fmt_ms(percentile(t_tpl, 0.5))}; replay_training at a new size (template kept) "
              f"{fmt_ms(percentile(t_new, 0.5))}")
    return 0 if ok or not a.strict else 1


if __name__ == "__main__":
    sys.exit(main())
