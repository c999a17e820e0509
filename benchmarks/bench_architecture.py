"""Benchmark: build an Architecture from a 70B config.json dict and count its parameters.

Target (issue 2): under 1 ms median for the llama-3.1-70b preset's config.
``architecture.from_config(cfg)`` is called directly, so the ``load()`` cache is bypassed
and every call parses the config and lists every tensor anew.

    python benchmarks/bench_architecture.py [--repeat N] [--model PRESET] [--strict]

Prints median and p90; with ``--strict`` exits 1 when the median misses the target.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import ROOT, fmt_ms, percentile, time_calls  # noqa: E402,F401


# the package (from this checkout when it is not installed)
from vramwidget.model import architecture, presets  # noqa: E402

TARGET_S = 1e-3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-70b", help="preset whose config is built (default llama-3.1-70b)")
    ap.add_argument("--repeat", type=int, default=2000, help="timed calls (default 2000)")
    ap.add_argument("--strict", action="store_true", help="exit 1 if the median misses the 1 ms target")
    args = ap.parse_args(argv)

    cfg = dict(presets.get(args.model)["config"])

    def build_and_count():
        arch = architecture.from_config(cfg)
        return arch.params_total

    n = build_and_count()
    times = time_calls(build_and_count, args.repeat)
    med, p90 = percentile(times, 0.5), percentile(times, 0.9)
    ok = med < TARGET_S
    print(f"architecture: from_config({args.model}) + params_total ({n:,} params), {args.repeat} calls")
    print(f"  median {fmt_ms(med)}   p90 {fmt_ms(p90)}   min {fmt_ms(times[0])}   "
          f"target < {fmt_ms(TARGET_S)} median: {'ok' if ok else 'MISSED'}")
    return 1 if (args.strict and not ok) else 0


if __name__ == "__main__":
    sys.exit(main())
