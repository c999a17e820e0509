"""Sweep: the per-GPU reserve of sharded strategies against the single-GPU replay's
fragmentation (the property tests/test_strategy_states.py checks on a seeded slice).

usage: python benchmarks/bench_parallel_reserve.py [--seed 1] [--n 150]
Prints each setup whose reserve above the allocated peak exceeds the single-GPU replay's
fragmentation + the strategy's own largest transient + 64 MiB + 10% of the peak, then a count.
"""

import argparse
import random
import time

import vramwidget as vw
from vramwidget.model.architecture import load
from vramwidget.estimate import estimate_setup
from vramwidget.parallel.estimate import STRATEGIES
from vramwidget.training import TrainingSetup

MODELS = ["qwen2.5-0.5b", "llama-3.2-1b", "olmoe-1b-7b", "llama-3.1-8b", "mixtral-8x7b"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--n", type=int, default=150)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    bad = runs = 0
    t0 = time.time()
    for _ in range(a.n):
        model = rng.choice(MODELS)
        strategy = rng.choice([k for k in STRATEGIES if k != "none"])
        n = rng.choice([2, 4, 8, 16])
        kw = dict(precision=rng.choice(["bf16", "amp_bf16", "fp32"]), method=rng.choice(["full", "lora"]),
                  batch_size=rng.choice([1, 2, 4]), seq_len=rng.choice([256, 1024, 4096]),
                  gradient_checkpointing=rng.choice(["none", "full"]))
        try:
            pe = vw.estimate_parallel(model, strategy=strategy, num_gpus=n, gpus_per_node=8, **kw)
        except vw.VramError:
            continue
        runs += 1
        e = pe.per_gpu
        one = vw.estimate_parallel(model, strategy="none" if strategy == "ddp" else strategy, num_gpus=1, **kw).per_gpu
        plain = estimate_setup(load(model), TrainingSetup.from_kwargs(**kw))
        single = max(one.reserved_bytes - one.peak_allocated_bytes, plain.reserved_bytes - plain.peak_allocated_bytes, 0)
        ms = pe.model_states
        own = max(ms.get("gathered parameters", 0.0) + ms.get("gathered gradients", 0.0),
                  ms.get("fp32 gradients", 0.0) + ms.get("step working set", 0.0),
                  ms.get("communication buffers", 0.0), ms.get("reduce-scatter buffers", 0.0))
        frag = e.reserved_bytes - e.peak_allocated_bytes
        if frag > single + own + 64 * 2**20 + 0.10 * e.peak_allocated_bytes:
            bad += 1
            print("over", model, strategy, n, kw, f"{frag / 2**20:,.0f} MiB vs single {single / 2**20:,.0f} MiB")
    print(f"{runs} setups, {bad} over the bound, {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
