"""Timing helpers shared by the benchmarks (run them from a checkout or an install)."""

import os
import sys
import time
from typing import Callable, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, ROOT)


def percentile(sorted_vals: List[float], q: float) -> float:
    k = (len(sorted_vals) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (k - lo)


def time_calls(fn: Callable[[], object], repeat: int, warmup: int = 20) -> List[float]:
    """Seconds per call, sorted, for ``repeat`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    out = []
    clock = time.perf_counter
    for _ in range(repeat):
        t0 = clock()
        fn()
        out.append(clock() - t0)
    out.sort()
    return out


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"
