"""Benchmark the estimator: one estimate, and a sweep of 10,000 setups.

Targets (issue 3): one ``estimate_setup(arch, setup)`` under 1 ms median; a sweep of
10,000 setups (batch, sequence length, method, precision, optimizer, checkpointing,
attention over a few presets) under 1 s in total.

The sweep's setups are validated (``TrainingSetup.from_kwargs``) and the architectures
resolved before the clock starts, so the targets time the estimator itself; the time of
the whole ``vramwidget.estimate(...)`` path (validation included) is printed beside it.

    python benchmarks/bench_estimate.py [--n 10000] [--repeat 500] [--strict] [--profile]

``--strict`` exits 1 when a target is missed; ``--profile`` prints where the sweep's time
goes (cProfile, top functions by own time and by cumulative time).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import ROOT, fmt_ms, percentile, time_calls  # noqa: E402,F401


# the package (from this checkout when it is not installed)
from vramwidget.model import architecture  # noqa: E402
from vramwidget.errors import VramError  # noqa: E402
from vramwidget.estimate import estimate_setup  # noqa: E402
from vramwidget.training import TrainingSetup  # noqa: E402

ONE_TARGET_S = 1e-3
SWEEP_TARGET_S = 1.0

#: the single-estimate case: Llama 3.1 8B, QLoRA, batch 4 x 2048, checkpointing
ONE_MODEL = "llama-3.1-8b"
ONE_SETUP = dict(method="qlora", batch_size=4, seq_len=2048, gradient_checkpointing="full")

SWEEP_MODELS = ("llama-3.2-1b", "llama-3.1-8b", "qwen2.5-7b", "gemma-2-2b", "mixtral-8x7b", "gpt2")
AXES = {
    "method": ("full", "lora", "qlora", "freeze"),
    "precision": ("bf16", "amp_bf16", "fp32", "bf16_fp32_states", "fp16"),
    "optimizer": ("adamw", "adamw_fused", "adamw_8bit", "adafactor", "sgd", "lion"),
    "gradient_checkpointing": ("none", "selective", "full"),
    "attn_implementation": ("sdpa", "eager"),
    "batch_size": (1, 2, 4, 8, 16, 32),
    "seq_len": (256, 512, 1024, 2048, 4096, 8192),
}


def sweep_setups(n: int, seed: int = 0):
    """``n`` valid (architecture, setup, kwargs) triples, drawn deterministically."""
    rng = random.Random(seed)
    archs = {m: architecture.load(m) for m in SWEEP_MODELS}
    out = []
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > 20 * n:
            raise RuntimeError("could not draw enough valid setups")
        model = rng.choice(SWEEP_MODELS)
        kw = {k: rng.choice(v) for k, v in AXES.items()}
        if kw["method"] == "freeze":
            kw["trainable_layers"] = rng.choice((1, 2, 4))
        if kw["method"] == "qlora" and kw["precision"] not in ("bf16", "fp16"):
            kw["precision"] = "bf16"
        try:
            s = TrainingSetup.from_kwargs(**kw)
            estimate_setup(archs[model], s)  # drop setups the estimator rejects (e.g. a model's limits)
        except VramError:
            continue
        out.append((model, archs[model], s, kw))
    return out


def run_sweep(items) -> float:
    t0 = time.perf_counter()
    for _, arch, s, _ in items:
        estimate_setup(arch, s)
    return time.perf_counter() - t0


def run_sweep_api(items) -> float:
    import vramwidget as vw

    t0 = time.perf_counter()
    for model, _, _, kw in items:
        vw.estimate(model, **kw)
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=10_000, help="setups in the sweep (default 10000)")
    ap.add_argument("--repeat", type=int, default=500, help="timed single estimates (default 500)")
    ap.add_argument("--rounds", type=int, default=3, help="sweep rounds; the best is reported (default 3)")
    ap.add_argument("--strict", action="store_true", help="exit 1 if a target is missed")
    ap.add_argument("--profile", action="store_true", help="profile the sweep with cProfile")
    args = ap.parse_args(argv)

    arch = architecture.load(ONE_MODEL)
    setup = TrainingSetup.from_kwargs(**ONE_SETUP)
    times = time_calls(lambda: estimate_setup(arch, setup), args.repeat)
    med, p90 = percentile(times, 0.5), percentile(times, 0.9)
    one_ok = med < ONE_TARGET_S
    desc = ", ".join(f"{k}={v}" for k, v in ONE_SETUP.items())
    print(f"one estimate: estimate_setup({ONE_MODEL}, {desc}), {args.repeat} calls")
    print(f"  median {fmt_ms(med)}   p90 {fmt_ms(p90)}   min {fmt_ms(times[0])}   "
          f"target < {fmt_ms(ONE_TARGET_S)} median: {'ok' if one_ok else 'MISSED'}")

    items = sweep_setups(args.n)
    by_method = {}
    for _, _, s, _ in items:
        by_method[s.method] = by_method.get(s.method, 0) + 1
    run_sweep(items[: min(200, len(items))])  # warm-up
    rounds = sorted(run_sweep(items) for _ in range(max(1, args.rounds)))
    best = rounds[0]
    sweep_ok = best < SWEEP_TARGET_S
    print(f"sweep: {len(items):,} setups over {', '.join(SWEEP_MODELS)} "
          f"({', '.join(f'{k} {v}' for k, v in sorted(by_method.items()))})")
    print(f"  estimate_setup only: best {best:.3f} s of {len(rounds)} rounds "
          f"({best / len(items) * 1e6:.1f} us per setup; rounds {', '.join(f'{r:.3f}' for r in rounds)})   "
          f"target < {SWEEP_TARGET_S:.1f} s: {'ok' if sweep_ok else 'MISSED'}")
    api = run_sweep_api(items)
    print(f"  vramwidget.estimate(model, **kw), validation and cached load() included: {api:.3f} s "
          f"({api / len(items) * 1e6:.1f} us per setup)")

    if args.profile or not (one_ok and sweep_ok):
        prof = cProfile.Profile()
        prof.enable()
        run_sweep(items)
        prof.disable()
        buf = io.StringIO()
        st = pstats.Stats(prof, stream=buf)
        st.sort_stats("tottime").print_stats(15)
        st.sort_stats("cumulative").print_stats(15)
        print("\nprofile of the sweep (cProfile adds overhead; compare shares, not totals):")
        print(buf.getvalue())
    return 1 if (args.strict and not (one_ok and sweep_ok)) else 0


if __name__ == "__main__":
    sys.exit(main())
