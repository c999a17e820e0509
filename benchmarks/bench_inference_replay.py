"""Benchmark the caching-allocator replay behind an inference estimate's reserved memory.

``estimate_inference(...).reserved_bytes`` replays generate(): loading, the prefill and every
decode step (``inference_events.inference_runs``: the decode steps as ``StepRun`` s) through
``allocator.replay_runs``.  Timed here, uncached (``inference_events.clear_caches`` before
each call), for Llama 3.1 8B bf16 on one GPU:

* 8k context, the whole context as the prompt (the default: no decode steps);
* 8k context, 7,000-token prompt (1,192 decode steps, ~1 million events written out);
* 8k context, 128-token prompt (8,064 new tokens, ~6.8 million events written out);

and, for the 1,192-step case, the same result from the written-out stream through
``allocator.replay`` (what replay_runs is tested to equal byte for byte).

    python benchmarks/bench_inference_replay.py [--repeat 3] [--strict]

Target (issue 13): under ~1 s for an ``infer`` estimate with its replay at 8k context.
``--strict`` exits 1 when the default case misses it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _timing  # noqa: E402,F401  (puts the checkout on sys.path)

import vramwidget as vw  # noqa: E402
from vramwidget.allocator import expand_runs, replay  # noqa: E402
from vramwidget.architecture import load  # noqa: E402
from vramwidget.inference import InferenceSetup  # noqa: E402
from vramwidget.inference_events import clear_caches, inference_runs  # noqa: E402

CASES = (
    ("8k context, prompt = context", dict(context_len=8192), 1.0),
    ("8k context, 7,000-token prompt", dict(context_len=8192, prompt_len=7000), None),
    ("8k context, 128-token prompt (8,064 new tokens)", dict(context_len=8192, prompt_len=128), None),
)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--strict", action="store_true")
    args = ap.parse_args()
    arch = load("llama-3.1-8b")
    vw.estimate_inference(arch, context_len=256).reserved_bytes     # imports (numpy) done
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
        print(f"{name:50s} {times[0]:7.3f} s best, {times[len(times) // 2]:7.3f} s median; {n_events:>9,} events; "
              f"reserved {reserved / 2**20:,.0f} MiB, peak allocated {est.peak_allocated_bytes / 2**20:,.0f} MiB "
              f"(the old rule: {1.02 * est.peak_allocated_bytes / 2**20:,.0f} MiB) {verdict}")
    kw = CASES[1][1]
    s = InferenceSetup.from_kwargs(**kw)
    t0 = time.perf_counter()
    full = replay(expand_runs(inference_runs(arch, s)))
    print(f"{'... the same written out, allocator.replay':50s} {time.perf_counter() - t0:7.3f} s; "
          f"reserved {full.max_reserved_bytes / 2**20:,.0f} MiB")
    return 1 if (missed and args.strict) else 0


if __name__ == "__main__":
    sys.exit(main())
