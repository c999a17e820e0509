"""Benchmark the fit map: a 64 x 64 batch x sequence grid at once vs 4,096 estimate() calls.

Target (issue 23): ``vw.fit_map(model, gpu, batch_sizes=64 values, seq_lens=64 values)``
at least 50x faster than calling ``vw.estimate(model, gpu=gpu, batch_size=b, seq_len=s)``
for each of the 4,096 cells and reading ``.device_total_bytes`` (each replays where the map
would: the allocator replay behind reserved memory, with the card's capacity where the
reserve is over it), with every cell's state and allocated peak equal to the estimate's and
its device total equal wherever the map says ``reserved_exact``.  Both start cold: every
cached replay and plan is forgotten before each timed run (``replays.clear_caches``), the
model name is resolved from the cache in both.  Both use the same replay machinery (sizes
whose event streams are equal share one replay), so the ratio is what fit_map saves by
reading the plan's totals over the grid at once and replaying only the cells whose state
depends on it.  The number of replays each one ran is printed, and the ratio to one cold
estimate() of the setup.

    python benchmarks/bench_fitmap.py [--model llama-3.1-8b] [--gpu "H100 80GB"] [--strict]
    python benchmarks/bench_fitmap.py --no-loop     # the map alone (the loop takes minutes)

``--strict`` exits 1 when the target is missed or a cell differs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _timing  # noqa: E402,F401  (puts the checkout on sys.path)

import vramwidget as vw  # noqa: E402
from vramwidget.allocator import replays  # noqa: E402
from vramwidget.plan import PlanView  # noqa: E402
from vramwidget.fit import verdict

TARGET_RATIO = 50.0


class _Count:
    """Counts the allocator replays actually run (``PlanView.replay`` calls: unlimited and
    with a card's capacity)."""

    def __init__(self) -> None:
        self.n = 0
        self._real = PlanView.replay

    def __enter__(self) -> "_Count":
        real = self._real

        def counted(view, *a, **k):
            self.n += 1
            return real(view, *a, **k)

        PlanView.replay = counted
        return self

    def __exit__(self, *exc) -> None:
        PlanView.replay = self._real


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--gpu", default="H100 80GB")
    ap.add_argument("--rounds", type=int, default=1, help="best of N cold rounds for the grid")
    ap.add_argument("--no-loop", action="store_true", help="skip the 4,096 estimate() calls")
    ap.add_argument("--strict", action="store_true")
    args = ap.parse_args()
    setup = dict(method="lora", gradient_checkpointing="full")
    batch_sizes = list(range(1, 65))
    seq_lens = [128 * k for k in range(1, 65)]
    verdict.uncertainty()                       # read once per process, not timed
    vw.fit_map(args.model, args.gpu, batch_sizes=[1], seq_lens=[128], **setup)   # imports

    replays.clear_caches()
    t0 = time.perf_counter()
    vw.estimate(args.model, batch_size=4, seq_len=2048, **setup).peak_allocated_bytes
    unit = time.perf_counter() - t0

    grid = []
    for _ in range(args.rounds):
        replays.clear_caches()
        with _Count() as c:
            t0 = time.perf_counter()
            df = vw.fit_map(args.model, args.gpu, batch_sizes=batch_sizes, seq_lens=seq_lens, **setup)
            grid.append(time.perf_counter() - t0)
    t_grid = min(grid)
    assert len(df) == 4096
    n_exact = int(df["reserved_exact"].sum())
    print(f"fit map, {args.model} on {args.gpu}, LoRA + full checkpointing, 64 x 64 cells "
          f"(load average {os.getloadavg()[0]:.2f})")
    print(f"  one cold estimate()                      {unit * 1e3:10.1f} ms")
    print(f"  vw.fit_map (one call, cold, best of {args.rounds})  {t_grid * 1e3:10.1f} ms   "
          f"({t_grid / unit:,.0f} x estimate) {c.n} replays run, {n_exact} cells exact, "
          f"states {df['state'].value_counts().to_dict()}")
    if args.no_loop:
        return 0

    replays.clear_caches()
    differ = 0
    with _Count() as c_loop:
        t0 = time.perf_counter()
        cells = []
        for b in batch_sizes:
            for s in seq_lens:
                est = vw.estimate(args.model, gpu=args.gpu, batch_size=b, seq_len=s, **setup)
                cells.append((est.peak_allocated_bytes, est.device_total_bytes, est))
        t_loop = time.perf_counter() - t0
    for r, (peak, total, est) in zip(df.itertuples(), cells):
        same = r.peak_allocated_bytes == peak and r.state == verdict.verdict(est, args.gpu)["state"]
        if r.reserved_exact:
            same = same and r.device_total_bytes == total
        differ += not same
    ratio = t_loop / t_grid
    print(f"  4,096 vw.estimate(gpu=).device_total_bytes {t_loop * 1e3:8.1f} ms   "
          f"({t_loop / unit:,.0f} x estimate) {c_loop.n} replays run")
    print(f"  ratio                                    {ratio:10.1f}x   (target >= {TARGET_RATIO:g}x)")
    print(f"  cells whose state, peak or exact device total differ from estimate(gpu=...): {differ}")
    ok = ratio >= TARGET_RATIO and differ == 0
    print("target met" if ok else "target MISSED")
    return 0 if ok or not args.strict else 1


if __name__ == "__main__":
    sys.exit(main())
