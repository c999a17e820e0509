"""Benchmark what a candidate setup costs before any replay: its step plan and the plan's index.

Every answer that estimates a new setup shape (the suggestions' candidates, the widget's
comparison) writes the shape's plan once (``plan.step.build_plan``, sizes as polynomials)
and indexes it (``plan.views.PlanIndex``: the events as arrays the totals, the trees and
the compiled replay read).  Timed here, per setup: the build, the index read off the
plan's copy records (``StepPlan.copies``: repeated steps and blocks, read off their
sources' arrays) and the index read event by event (``views.COPY_AWARE_INDEX`` off, the
reference the tests hold it equal to); best of ``--repeat`` with the cyclic collector off
(as the solvers run), so the numbers say what the code costs rather than what the
machine's noise adds.

    python benchmarks/bench_plan_index.py [--repeat 4] [--model llama-2-70b]

No target: issue 23's targets are the answers' (``bench_answers.py``); this says where a
candidate's time goes.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _timing  # noqa: E402,F401  (puts the checkout on sys.path)

from vramwidget.model.architecture import load  # noqa: E402
from vramwidget.plan import views  # noqa: E402
from vramwidget.plan.builder import StepPlan  # noqa: E402
from vramwidget.plan.size import Size  # noqa: E402
from vramwidget.plan.step import build_plan  # noqa: E402
from vramwidget.training import TrainingSetup  # noqa: E402

SETUPS = [
    ("full", dict()),
    ("LoRA", dict(method="lora", precision="bf16")),
    ("QLoRA + full checkpointing", dict(method="qlora", precision="bf16", quantization="nf4",
                                        gradient_checkpointing="full")),
    ("full + activation offloading", dict(activation_offloading=True)),
]


def _best(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=4)
    ap.add_argument("--model", action="append", help="a preset (default: llama-2-7b and llama-2-70b)")
    args = ap.parse_args()
    gc.disable()
    print(f"{'model':14s} {'setup':30s} {'events':>8s} {'copies':>7s} {'build':>9s} {'index':>9s} "
          f"{'event by event':>15s}")
    for model in args.model or ["llama-2-7b", "llama-2-70b"]:
        arch = load(model)
        for name, kw in SETUPS:
            s = TrainingSetup.from_kwargs(**kw)

            def build():
                return build_plan(arch, s, Size.var("b"), Size.var("s"))

            plan = build()
            t_build = _best(build, args.repeat)

            def index(copy_aware: bool) -> None:
                twin = StepPlan(list(plan.events), plan.info, plan.marks, plan.steps, plan.notes, plan.host_bytes,
                                plan.repeats, plan.passes_copied, plan.copies)
                views.COPY_AWARE_INDEX = copy_aware
                try:
                    views.PlanIndex(twin)
                finally:
                    views.COPY_AWARE_INDEX = True

            t_fast = _best(lambda: index(True), args.repeat)
            t_slow = _best(lambda: index(False), args.repeat)
            print(f"{model:14s} {name:30s} {len(plan.events):8d} {len(plan.copies):7d} {t_build * 1e3:7.1f}ms "
                  f"{t_fast * 1e3:7.1f}ms {t_slow * 1e3:13.1f}ms")


if __name__ == "__main__":
    main()
