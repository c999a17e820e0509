"""Benchmark the fit map: a 64 x 64 batch x sequence grid at once vs 4,096 estimate() calls.

Target (issue 10): ``vw.fit_map(model, gpu, batch_sizes=64 values, seq_lens=64 values)``
at least 50x faster than calling ``vw.estimate(model, batch_size=b, seq_len=s)`` for each
of the 4,096 cells and reading ``.device_total_bytes`` (what a cell of the map needs: the
allocator replay behind reserved memory).  Both start cold: every cached replay and stream
template is forgotten before each timed run (``events.clear_caches``), the model name is
resolved from the cache in both, and the verdict band is computed before the clock starts.
Both use the same replay machinery (stream templates; sizes with equal event streams share
one replay), so the ratio is what fit_map saves by replaying only the cells whose state
depends on it.  The number of replays each one ran is printed.

    python benchmarks/bench_fitmap.py [--model llama-3.1-8b] [--gpu "RTX 4090"] [--strict]
    python benchmarks/bench_fitmap.py --exact     # also time fit_map(exact=True)

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
from vramwidget import events  # noqa: E402
from vramwidget.fit import verdict

TARGET_RATIO = 50.0


class _Count:
    """Counts the allocator replays actually run (events.replay calls)."""

    def __init__(self) -> None:
        self.n = 0
        self._real = events.replay

    def __enter__(self) -> "_Count":
        def counted(*a, **k):
            self.n += 1
            return self._real(*a, **k)

        events.replay = counted
        return self

    def __exit__(self, *exc) -> None:
        events.replay = self._real


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--gpu", default="RTX 4090")
    ap.add_argument("--rounds", type=int, default=3, help="best of N cold rounds for the grid")
    ap.add_argument("--exact", action="store_true", help="also time fit_map(exact=True)")
    ap.add_argument("--strict", action="store_true")
    args = ap.parse_args()
    setup = dict(method="qlora", gradient_checkpointing="full")
    batch_sizes = list(range(1, 65))
    seq_lens = [128 * k for k in range(1, 65)]
    verdict.uncertainty()                       # computed once per process, not timed
    vw.fit_map(args.model, args.gpu, batch_sizes=[1], seq_lens=[128], **setup)   # imports, traces

    grid = []
    for _ in range(args.rounds):
        events.clear_caches()
        with _Count() as c:
            t0 = time.perf_counter()
            df = vw.fit_map(args.model, args.gpu, batch_sizes=batch_sizes, seq_lens=seq_lens, **setup)
            grid.append(time.perf_counter() - t0)
    t_grid = min(grid)
    assert len(df) == 4096
    n_exact = int(df["reserved_exact"].sum())

    t_exact = None
    if args.exact:
        events.clear_caches()
        with _Count() as c_exact:
            t0 = time.perf_counter()
            dx = vw.fit_map(args.model, args.gpu, batch_sizes=batch_sizes, seq_lens=seq_lens, exact=True, **setup)
            t_exact = time.perf_counter() - t0
        assert (dx["state"] == df["state"]).all(), "the states of the default map differ from the exact map's"

    events.clear_caches()
    with _Count() as c_loop:
        t0 = time.perf_counter()
        for b in batch_sizes:
            for s in seq_lens:
                vw.estimate(args.model, batch_size=b, seq_len=s, **setup).device_total_bytes
        t_loop = time.perf_counter() - t0

    ratio = t_loop / t_grid
    print(f"fit map, {args.model} on {args.gpu}, QLoRA + full checkpointing, 64 x 64 cells")
    print(f"  vw.fit_map (one call, cold, best of {args.rounds})  {t_grid * 1e3:10.1f} ms   "
          f"{c.n} replays run, {n_exact} cells exact (reserved_exact), states {df['state'].value_counts().to_dict()}")
    if t_exact is not None:
        print(f"  vw.fit_map(exact=True)                   {t_exact * 1e3:10.1f} ms   {c_exact.n} replays run")
    print(f"  4,096 vw.estimate().device_total_bytes   {t_loop * 1e3:10.1f} ms   {c_loop.n} replays run")
    print(f"  ratio                                    {ratio:10.1f}x   (target >= {TARGET_RATIO:g}x)")
    ok = ratio >= TARGET_RATIO
    print("target met" if ok else "target MISSED")
    return 0 if ok or not args.strict else 1


if __name__ == "__main__":
    sys.exit(main())
