"""Benchmark the caching-allocator replay behind an inference estimate's reserved memory.

``estimate_inference(...).reserved_bytes`` replays generate(): loading, the prefill and every
decode step (``inference_events.inference_runs``: the decode steps as ``StepRun`` s) through
``allocator.replay_runs``.  Timed here, uncached (``inference_events.clear_caches`` before
each call), for Llama 3.1 8B bf16 on one GPU:

* 8k context, the whole context as the prompt (the default: no decode steps);
* 8k context, 7,000-token prompt (1,192 decode steps, ~1 million events written out);
* 8k context, 128-token prompt (8,064 new tokens, ~6.8 million events written out);

and the compiled replay's result (``caching.COMPILED``, allocator/creplay.c) against the
Python ones, every field: the 1,192-step case written out through ``CachingAllocator``, the
32k decode through the pure-Python ``replay_runs`` (its skip-ahead).

    python benchmarks/bench_inference_replay.py [--repeat 3] [--strict]

Targets: under ~1 s for an ``infer`` estimate with its replay at 8k context (issue 13) and for the
32k decode's reserve (issue 23).  Times are also printed as
ratios to one training ``estimate()``.  ``--strict`` exits 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _timing  # noqa: E402,F401  (puts the checkout on sys.path)

import vramwidget as vw  # noqa: E402
from vramwidget.allocator.caching import expand_runs, replay, replay_runs  # noqa: E402
from vramwidget.model.architecture import load  # noqa: E402
from vramwidget.inference.estimate import InferenceSetup  # noqa: E402
from vramwidget.inference.events import clear_caches, inference_runs, replay_parts  # noqa: E402

CASES = (
    ("8k context, prompt = context", dict(context_len=8192), 1.0),
    ("8k context, 7,000-token prompt", dict(context_len=8192, prompt_len=7000), None),
    ("8k context, 128-token prompt (8,064 new tokens)", dict(context_len=8192, prompt_len=128), None),
    ("32k context, 128-token prompt (32,640 new tokens)", dict(context_len=32768, prompt_len=128), 1.0),
)


def _one_estimate_seconds() -> float:
    """One training estimate() (Llama 3.1 8B QLoRA, b4 x 2048): the unit the times are given in."""
    t0 = time.perf_counter()
    for _ in range(20):
        vw.estimate("llama-3.1-8b", method="qlora", batch_size=4, seq_len=2048).peak_allocated_bytes
    return (time.perf_counter() - t0) / 20


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--strict", action="store_true")
    ap.add_argument("--skip-reference", action="store_true", help="do not replay the written-out stream")
    args = ap.parse_args()
    arch = load("llama-3.1-8b")
    vw.estimate_inference(arch, context_len=256).reserved_bytes     # imports (numpy) done
    unit = _one_estimate_seconds()
    print(f"one estimate(): {unit * 1000:.2f} ms")
    missed = False
    for name, kw, target in CASES:
        times = []
        for _ in range(args.repeat):
            clear_caches()
            t0 = time.perf_counter()
            est = vw.estimate_inference(arch, **kw)
            reserved = est.reserved_bytes
            times.append(time.perf_counter() - t0)
        times.sort()
        s = InferenceSetup.from_kwargs(**kw)
        n_events = sum(len(p) if isinstance(p, list) else p.n_steps * len(p.events) for p in inference_runs(arch, s))
        verdict = "" if target is None else ("ok" if times[0] <= target else "MISSED")
        missed |= verdict == "MISSED"
        print(f"{name:50s} {times[0]:7.3f} s ({times[0] / unit:,.0f} x estimate()); {n_events:>10,} events; "
              f"reserved {reserved / 2**20:,.0f} MiB, peak allocated {est.peak_allocated_bytes / 2**20:,.0f} MiB "
              f"{verdict}")
    clear_caches()
    t0 = time.perf_counter()
    est = vw.estimate_inference(arch, context_len=32768, prompt_len=128, gpu="RTX 4090")
    fits = est.fits
    dt = time.perf_counter() - t0
    print(f"{'32k decode judged on an RTX 4090 (unlimited + capacity replay)':50s} {dt:7.3f} s ({dt / unit:,.0f} x "
          f"estimate()); fits {fits}, squeezed {est.squeezed}, reserved on the card {est.reserved_bytes / 2**30:.2f} GiB")
    t0 = time.perf_counter()
    n = vw.longest_context(arch, "RTX 4090", prompt_len=128)
    dt = time.perf_counter() - t0
    print(f"{'longest_context on an RTX 4090, 128-token prompt':50s} {dt:7.3f} s ({dt / unit:,.0f} x estimate()); "
          f"{n:,} tokens")
    if not args.skip_reference:
        # the compiled replay (caching.COMPILED) against the Python ones, every field: the
        # 7,000-token case written out through CachingAllocator itself, the 32k decode through
        # replay_runs' skip-ahead (tested against the written-out stream in
        # tests/test_inference_replay.py)
        from vramwidget.allocator import caching

        for name, kw, how in ((CASES[1][0], CASES[1][1], "written out, CachingAllocator"),
                              (CASES[3][0], CASES[3][1], "pure-Python replay_runs")):
            parts = replay_parts(inference_runs(arch, InferenceSetup.from_kwargs(**kw)))
            t0 = time.perf_counter()
            compiled = replay_runs(parts)
            t_c = time.perf_counter() - t0
            caching.COMPILED, was = False, caching.COMPILED
            try:
                t0 = time.perf_counter()
                ref = replay(expand_runs(parts), fast=False) if "written" in how else replay_runs(parts)
                t_r = time.perf_counter() - t0
            finally:
                caching.COMPILED = was
            equal = compiled == ref
            missed |= not equal
            print(f"{'... ' + name + ': ' + how:50s} {t_r:7.3f} s vs compiled {t_c:.3f} s; every field equal: "
                  f"{equal}")
    return 1 if (missed and args.strict) else 0


if __name__ == "__main__":
    sys.exit(main())
