"""Benchmark the fit map: a 64 x 64 batch x sequence grid at once vs 4,096 estimate() calls.

Target (issue 10): ``vw.fit_map(model, gpu, batch_sizes=64 values, seq_lens=64 values)``
at least 50x faster than calling ``vw.estimate(model, batch_size=b, seq_len=s)`` for each
of the 4,096 cells (the same public calls a user would make; the model name is resolved
from the cache in both, the reserved-memory band is computed before the clock starts).
Both give the same numbers (tests/test_fitmap.py checks every cell).

    python benchmarks/bench_fitmap.py [--model llama-3.1-8b] [--gpu "RTX 4090"] [--strict]

``--strict`` exits 1 when the target is missed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _timing  # noqa: E402,F401  (puts the checkout on sys.path)

import vramwidget as vw  # noqa: E402
from vramwidget import verdict  # noqa: E402

TARGET_RATIO = 50.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--gpu", default="RTX 4090")
    ap.add_argument("--rounds", type=int, default=3, help="best of N rounds for the grid")
    ap.add_argument("--strict", action="store_true")
    args = ap.parse_args()
    setup = dict(method="qlora", gradient_checkpointing="full")
    batch_sizes = list(range(1, 65))
    seq_lens = [128 * k for k in range(1, 65)]
    verdict.uncertainty()                       # computed once per process, not timed
    vw.fit_map(args.model, args.gpu, batch_sizes=[1], seq_lens=[128], **setup)   # warm caches

    grid = []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        df = vw.fit_map(args.model, args.gpu, batch_sizes=batch_sizes, seq_lens=seq_lens, **setup)
        grid.append(time.perf_counter() - t0)
    t_grid = min(grid)
    assert len(df) == 4096

    t0 = time.perf_counter()
    for b in batch_sizes:
        for s in seq_lens:
            vw.estimate(args.model, batch_size=b, seq_len=s, **setup).device_total_bytes
    t_loop = time.perf_counter() - t0

    ratio = t_loop / t_grid
    print(f"fit map, {args.model} on {args.gpu}, QLoRA + full checkpointing, 64 x 64 cells")
    print(f"  vw.fit_map (one call, best of {args.rounds})   {t_grid * 1e3:9.2f} ms")
    print(f"  4,096 vw.estimate() calls                {t_loop * 1e3:9.2f} ms")
    print(f"  ratio                                    {ratio:9.1f}x   (target >= {TARGET_RATIO:g}x)")
    ok = ratio >= TARGET_RATIO
    print("target met" if ok else "target MISSED")
    return 0 if ok or not args.strict else 1


if __name__ == "__main__":
    sys.exit(main())
