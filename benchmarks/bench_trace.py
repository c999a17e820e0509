"""Benchmark the tracing backend: one traced training step of an 8B and a 70B model.

Targets (issue 11): a trace of an 8B model in <= 10 s and of a 70B model in <= 60 s on 2
cores.  A trace builds the transformers model from its config under FakeTensorMode (no
memory), runs forward, loss, backward and the optimizer step with the allocation ledger,
and labels every storage.  The first trace of a process also imports torch, transformers
and peft and their model modules (printed as "cold"); the targets time a trace in a
process that has traced before ("warm": the widget's case after its first estimate).
After a profile exists, another batch or sequence is a replay (printed as "replay").

    python benchmarks/bench_trace.py [--models llama-3.1-8b,llama-3.1-70b] [--strict]

Needs the trace extra (pip install "vramwidget[trace]").
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import ROOT  # noqa: E402,F401

TARGETS_S = {"llama-3.1-8b": 10.0, "llama-3.1-70b": 60.0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama-3.1-8b,llama-3.1-70b")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    args = ap.parse_args(argv)

    from vramwidget.trace import profile, resolve_config
    from vramwidget.trace.step import trace_step
    from vramwidget.training import TrainingSetup

    s = TrainingSetup.from_kwargs(batch_size=1, seq_len=2048, backend="trace")
    t0 = time.perf_counter()
    name, cfg = resolve_config("smollm2-135m")
    trace_step(cfg, s)
    print(f"cold start (imports + a 135M trace): {time.perf_counter() - t0:.1f} s")
    missed = False
    for model in args.models.split(","):
        name, cfg = resolve_config(model)
        t0 = time.perf_counter()
        log = trace_step(cfg, s)
        dt = time.perf_counter() - t0
        target = TARGETS_S.get(model)
        verdict = "" if target is None else (" ok" if dt <= target else " MISSED")
        missed |= target is not None and dt > target
        print(f"{model}: one traced step (b=1, s=2048, bf16, AdamW) {dt:.1f} s, {len(log.allocs)} storages, "
              f"{log.params_total:,} params; target {target} s{verdict}")
        prof = profile.profile_for(cfg, s)          # a second trace at (2, 4096), then the fit
        t0 = time.perf_counter()
        if prof.size_fns is not None:
            prof.sizes(4, 1000)
        print(f"   size profile {'fitted' if prof.size_fns else 'NOT fitted'}; replay at (4, 1000): "
              f"{(time.perf_counter() - t0) * 1e3:.1f} ms")
    return 1 if (missed and args.strict) else 0


if __name__ == "__main__":
    sys.exit(main())
