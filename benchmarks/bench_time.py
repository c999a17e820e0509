"""Benchmark the step time: what naming a GPU adds to an estimate.

Target (issue 15): the widget re-estimates on every change, so timing the step must stay
cheap: ``estimate_setup(arch, setup, gpu=...)`` then ``.step_seconds`` under 0.5 ms median
more than the estimate alone (Llama 3.1 8B, QLoRA, batch 4 x 2048, full checkpointing, on
an H100), and the time is computed only when asked for (an estimate without ``gpu``, or one
whose ``step_seconds`` is never read, costs nothing extra).

    python benchmarks/bench_time.py [--repeat 500] [--strict]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import fmt_ms, percentile, time_calls  # noqa: E402

from vramwidget.model import architecture  # noqa: E402
from vramwidget.estimate import estimate_setup  # noqa: E402
from vramwidget.gpus import get_gpu  # noqa: E402
from vramwidget.training import TrainingSetup  # noqa: E402

EXTRA_TARGET_S = 0.5e-3
MODEL = "llama-3.1-8b"
SETUP = dict(method="qlora", batch_size=4, seq_len=2048, gradient_checkpointing="full")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=500)
    ap.add_argument("--strict", action="store_true", help="exit 1 when the target is missed")
    a = ap.parse_args(argv)
    arch = architecture.load(MODEL)
    s = TrainingSetup.from_kwargs(**SETUP)
    gpu = get_gpu("H100 80GB")
    plain = time_calls(lambda: estimate_setup(arch, s), a.repeat)
    lazy = time_calls(lambda: estimate_setup(arch, s, gpu=gpu), a.repeat)
    timed = time_calls(lambda: estimate_setup(arch, s, gpu=gpu).step_seconds, a.repeat)
    m_plain, m_lazy, m_timed = (percentile(x, 0.5) for x in (plain, lazy, timed))
    extra = m_timed - m_plain
    print(f"estimate alone                 median {fmt_ms(m_plain)}")
    print(f"with gpu=, time never read      median {fmt_ms(m_lazy)}")
    print(f"with gpu=, step_seconds read    median {fmt_ms(m_timed)}  (+{fmt_ms(extra)}; "
          f"target < +{fmt_ms(EXTRA_TARGET_S)}: {'ok' if extra < EXTRA_TARGET_S else 'MISSED'})")
    return 1 if a.strict and extra >= EXTRA_TARGET_S else 0


if __name__ == "__main__":
    sys.exit(main())
