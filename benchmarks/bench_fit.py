"""Benchmark the fit solver: ``max_batch_size`` queries, end to end.

Target (issue 6): a fit query under 50 ms median.  A query is the whole public call --
``vramwidget.fit.solver.max_batch_size(model, gpu, **setup)``: the model name resolved (cached),
the setup validated, then a doubling-and-bisection search over the estimator (each probe a
full estimate, or a per-GPU parallel estimate).  Also printed, without a target: the first
(cold) call of each case, ``min_gpus``, ``suggestions`` and everything ``vramwidget fit``
prints (``fit.answers``).

    python benchmarks/bench_fit.py [--repeat 200] [--strict]

``--strict`` exits 1 when the target is missed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import fmt_ms, percentile, time_calls  # noqa: E402

from vramwidget.fit import solver as fit  # noqa: E402

TARGET_S = 50e-3

CASES = [
    ("llama-3.1-8b LoRA, 1 x H100", "llama-3.1-8b", "H100-80GB", dict(method="lora", seq_len=2048)),
    ("llama-3.1-8b QLoRA + checkpointing, 1 x RTX 4090", "llama-3.1-8b", "RTX 4090",
     dict(method="qlora", seq_len=1024, gradient_checkpointing="full")),
    ("qwen2.5-0.5b fp16 mixed, 1 x T4", "qwen2.5-0.5b", "T4", dict(precision="amp_fp16", seq_len=512)),
    ("llama-3.1-70b full, ZeRO-3 on 64 x H100", "llama-3.1-70b", "H100-80GB",
     dict(strategy="zero3", num_gpus=64, seq_len=4096, gradient_checkpointing="full")),
    ("mixtral-8x7b full, TP2 PP4 SP EP2 distopt, 64 x H200", "mixtral-8x7b", "H200",
     dict(strategy="megatron_distopt", num_gpus=64, tensor_parallel=2, pipeline_parallel=4,
          sequence_parallel=True, expert_parallel=2, micro_batches=8, seq_len=4096)),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--strict", action="store_true")
    args = ap.parse_args(argv)

    print(f"{'max_batch_size query':58} {'answer':>7} {'cold':>10} {'median':>10} {'p90':>10}  target < 50 ms")
    worst = 0.0
    for label, model, gpu, kw in CASES:
        t0 = time.perf_counter()
        answer = fit.max_batch_size(model, gpu, **kw)
        cold = time.perf_counter() - t0
        times = time_calls(lambda: fit.max_batch_size(model, gpu, **kw), args.repeat, warmup=5)
        med = percentile(times, 0.5)
        worst = max(worst, med)
        print(f"{label:58} {answer:7d} {fmt_ms(cold):>10} {fmt_ms(med):>10} {fmt_ms(percentile(times, 0.9)):>10}  "
              f"{'ok' if med < TARGET_S else 'MISSED'}")

    print()
    print("other queries (no target):")
    extra = [
        ("max_seq_len, llama-3.1-8b LoRA, 1 x H100",
         lambda: fit.max_seq_len("llama-3.1-8b", "H100-80GB", method="lora")),
        ("min_gpus zero3, llama-3.1-70b full, H100",
         lambda: fit.min_gpus("llama-3.1-70b", "H100-80GB", "zero3", gradient_checkpointing="full")),
        ("suggestions, llama-3.1-8b full batch 4, H100",
         lambda: fit.suggestions("llama-3.1-8b", "H100-80GB", batch_size=4)),
        ("fit.answers (the whole `vramwidget fit` output), same",
         lambda: fit.answers("llama-3.1-8b", "H100-80GB", batch_size=4)),
    ]
    for label, fn in extra:
        times = time_calls(fn, max(10, args.repeat // 10), warmup=2)
        print(f"  {label:58} median {fmt_ms(percentile(times, 0.5)):>10}")
    print()
    verdict = "ok" if worst < TARGET_S else "MISSED"
    print(f"slowest max_batch_size median: {fmt_ms(worst)} (target < 50 ms): {verdict}")
    return 1 if (args.strict and worst >= TARGET_S) else 0


if __name__ == "__main__":
    sys.exit(main())
