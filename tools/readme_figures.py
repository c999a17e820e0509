"""Regenerate every accuracy and performance figure README.md quotes, from the code.

    python tools/readme_figures.py            # compute all (slow ones too), write tests/data/readme_figures.json
    python tools/readme_figures.py --fast     # the cheap ones only; keep the slow ones of the file
    python tools/readme_figures.py --check    # compute nothing: say where README.md and the file disagree
    python tools/readme_figures.py --only decode   # recompute some groups, keep the others

Each figure is the README's own words (``snippet``) with the number the code gives today,
rendered here; ``tests/test_readme_figures.py`` fails when a snippet is not in README.md
(whitespace and line breaks aside) and recomputes the cheap groups to fail when the file is
stale.  A README figure changes by running this script and pasting its snippet, never by hand.

Groups (cheap unless marked):

``validation``  the 45 measured H200 cases through ``vramwidget.measure.validate``: peak allocated,
                weights, persistent and max reserved |error| (median, p90, worst), the step
                time by kind of case, the verdict's band (verdict.uncertainty)
``published``   the published figures of other stacks (tests/test_knobs.py's setups)
``serving``     vLLM's start-up logs (tests/test_serving_logs.py's cases)
``examples``    the numbers in the README's examples and Limits
``scenarios``   the seed write-ups' scenarios (vramwidget.fit.scenarios)
``trace``       (slow) the measured cases through the tracing backend
``decode``      (slow) a long decode's reserve (its replay takes seconds)
``speed``       (slow) how long a replay and a trace take here
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

DATA = os.path.join(ROOT, "tests", "data", "readme_figures.json")
README = os.path.join(ROOT, "README.md")
GIB = 2 ** 30


def pct(x: float, digits: int = 2) -> str:
    return f"{x * 100:.{digits}f}%"


def fig(fid: str, value: Any, snippet: str) -> Dict[str, Any]:
    return {"id": fid, "value": value, "snippet": snippet}


# ---------------------------------------------------------------------------------------
# validation: the measured H200 cases
# ---------------------------------------------------------------------------------------

#: the step-time table's rows: label -> which cases (their ``training`` record)
TIME_KINDS = (
    ("all", lambda t: True),
    ("full fine-tuning", lambda t: t.get("method", "full") == "full"),
    ("with checkpointing", lambda t: bool(t.get("gradient_checkpointing"))),
    ("fp32 (no TF32)", lambda t: t.get("weights_dtype") == "float32" and not t.get("autocast_dtype")
     and not t.get("tf32")),
    ("mixed precision (autocast)", lambda t: bool(t.get("autocast_dtype"))),
    ("LoRA", lambda t: t.get("method") == "lora"),
    ("QLoRA", lambda t: t.get("method") == "qlora"),
    ("other optimizers (fused, 8-bit, Adafactor, SGD)", lambda t: t.get("optimizer", "adamw") != "adamw"),
    ("eager attention", lambda t: t.get("attn_implementation") == "eager"),
)


def validation() -> List[Dict[str, Any]]:
    from vramwidget.measure import validate as V
    from vramwidget.fit.verdict import uncertainty

    result = V.validate(V.BUILTIN_CASES)
    s = result["summary"]
    rows = [r for r in result["cases"] if "error" in r]
    out = []
    labels = (("peak_allocated_mib", "peak allocated (the scored number)"), ("weights_mib", "weights after load"),
              ("persistent_after_step_mib", "persistent between steps"),
              ("max_reserved_mib", "max reserved (the caching allocator replayed over the step's allocations)"))
    for field, label in labels:
        st = s[field]
        out.append(fig(f"validation.{field}", [st["median"], st["p90"], st["max"]],
                       f"| {label} | {pct(st['median'])} | {pct(st['p90'])} | {pct(st['max'])} |"))
    n = s["peak_allocated_mib"]["n"]
    out.append(fig("validation.intro_peak", s["peak_allocated_mib"]["median"],
                   f"median error {pct(s['peak_allocated_mib']['median'])} on {n} measured training steps"))
    out.append(fig("validation.intro_time", s["step_seconds"]["median"],
                   f"(step time: median error {pct(s['step_seconds']['median'], 0)} on the same {n} steps)"))
    band = uncertainty()
    out.append(fig("validation.band", band["rel_error"],
                   f"±{pct(band['rel_error'], 1)} of the predicted reserved memory, the 90th percentile of its "
                   f"error on the {band['n_cases']} measured cases"))
    for label, pick in TIME_KINDS:
        errs = sorted(abs(r["error"]["step_seconds"]) for r in rows
                      if r["error"].get("step_seconds") is not None and pick(r["training"]))
        med = statistics.median(errs)
        out.append(fig(f"validation.time.{label}", [len(errs), med, errs[-1]],
                       f"| {label} | {len(errs)} | {pct(med, 1)} | {pct(errs[-1], 0)} |"))
    out.append(fig("validation.time_p90", s["step_seconds"]["p90"],
                   f"90th percentile {pct(s['step_seconds']['p90'], 1)}; `tests/test_timing.py` fails above"))
    return out


# ---------------------------------------------------------------------------------------
# published figures of other stacks, and vLLM's start-up logs
# ---------------------------------------------------------------------------------------

def _params(test: Callable) -> List[Any]:
    """The parameter rows of a parametrized test (its ``pytest.mark.parametrize``)."""
    return [tuple(p.values) if hasattr(p, "values") else p for p in test.pytestmark[-1].args[1]]


def published() -> List[Dict[str, Any]]:
    import test_knobs as K

    import vramwidget as vw

    out = []
    labels = {"+ Packed Dataset": "Llama 3.2 3B full, batch 2 x 4096 packed",
              "+ Activation Checkpointing": "+ compile, chunked CE, activation checkpointing",
              "+ Fuse optimizer step into backward": "+ optimizer in backward",
              "+ Activation Offloading": "+ activation offloading", "LoRA": "LoRA (r 64, all linear)",
              "QLoRA": "QLoRA (torchao NF4)"}
    for row, published_gib, kw in _params(K.test_torchtune_readme_optimization_flags):
        gib = vw.estimate("llama-3.2-3b", **K.TT, **kw).peak_allocated_bytes / GIB
        out.append(fig(f"published.torchtune.{row}", gib, f"| {labels[row]} | {published_gib:.1f} GiB | {gib:.1f} GiB |"))
    lit: Dict[Any, float] = {}
    for model, mb, quantize, published_gb in _params(K.test_litgpt_resource_tables_lora):
        kw = {} if quantize is None else dict(method="qlora", double_quant=quantize.endswith("-dq"))
        est = vw.estimate(model, **{"stack": "litgpt", "method": "lora", "batch_size": mb, "seq_len": 1304,
                                    "versions": {"bitsandbytes": "0.41.1"}, **kw})
        lit[(model, mb, quantize)] = (published_gb, est.peak_allocated_bytes / 1e9)
    names = {"llama-2-7b": "Llama 2 7B", "llama-2-13b": "Llama 2 13B"}
    for (model, mb, q), (pub, gb) in lit.items():
        if q is None:
            out.append(fig(f"published.litgpt.{model}.{mb}", gb,
                           f"| {names[model]} LoRA, micro-batch {mb} | {pub:.2f} GB | {gb:.2f} GB |"))
    for model in names:
        a, b = lit[(model, 1, "bnb.nf4")], lit[(model, 1, "bnb.nf4-dq")]
        out.append(fig(f"published.litgpt.{model}.4bit", [a[1], b[1]],
                       f"| {names[model]}, bnb.nf4 / bnb.nf4-dq | {a[0]:.2f} / {b[0]:.2f} GB | "
                       f"{a[1]:.2f} / {b[1]:.2f} GB |"))
    for strategy, published_gb in _params(K.test_peft_docs_70b_qlora_on_two_gpus):
        pe = vw.estimate_parallel("llama-2-70b", strategy=strategy, num_gpus=2, versions=K.PEFT_MARCH_2024,
                                  **K.QLORA_70B)
        gb = pe.per_gpu.device_total_bytes / 1e9
        label = "Llama-2-70B QLoRA, 2 GPUs, FSDP" if strategy == "fsdp_full_shard" else "the same with ZeRO-3"
        out.append(fig(f"published.peft.{strategy}", gb, f"| {label} | {published_gb:.1f} GB | {gb:.1f} GB |"))
    return out


def serving() -> List[Dict[str, Any]]:
    import test_serving_logs as S

    import vramwidget as vw

    out = []
    within = []
    for case in S.CASES + S.NOT_REPRODUCED:
        tokens = S.predicted_tokens(case)
        err = tokens / case["tokens"] - 1
        if case in S.CASES:
            within.append(abs(err))
        shown = f"{err * 100:+.1f}%" if abs(err) < 0.1 else f"**{err * 100:+.0f}%**"
        out.append(fig(f"serving.{case['id']}", tokens, f"| {tokens:,} | {shown} |"))
    out.append(fig("serving.within", max(within), f"are within {pct(max(within), 1)}"))
    tp8 = next(c for c in S.CASES if c["id"] == "qwen3-235b-fp8-8xl40s-tp8-ep-v1")
    p = vw.estimate_inference(tp8["model"], engine="vllm", **tp8["kw"]).plan
    w, act, nt = p.weights_bytes / GIB, p.activation_bytes / GIB, p.non_torch_bytes / GIB
    out.append(fig("serving.tp8_terms", [w, act, nt], f"is matched term by term ({w:.2f}, {act:.2f}, {nt:.2f})"))
    out.append(fig("serving.tp8_graphs", p.cuda_graph_bytes / GIB,
                   f"reports 3.45 GiB of graphs where this gives {p.cuda_graph_bytes / GIB:.2f} GiB"))
    # the one SGLang log (vllm#21348): Qwen3-235B-FP8 on 4 x H100, --mem-fraction-static 0.93, 367,404 tokens
    sg = vw.estimate_inference(S.QWEN3_235B, engine="sglang", gpu="H100 80GB", weights="fp8", tensor_parallel=4,
                               mem_fraction_static=0.93, context_len=40960).serving["kv_tokens"]
    out.append(fig("serving.sglang", sg, f"367,404 tokens) is estimated {sg / 367_404 * 100 - 100:.0f}% high ({sg:,})"))
    return out


# ---------------------------------------------------------------------------------------
# the README's examples and Limits
# ---------------------------------------------------------------------------------------

def examples() -> List[Dict[str, Any]]:
    import vramwidget as vw

    out = []
    est = vw.estimate("meta-llama/Llama-3.1-8B", method="qlora", batch_size=4, seq_len=2048,
                      gradient_checkpointing="full")
    out.append(fig("examples.api_peak", est.peak_gib, f"# {est.peak_gib:.2f} GiB, '{est.peak_phase}'"))
    t4 = vw.estimate("llama-3.2-1b", method="full", batch_size=2, seq_len=1024, gpu="T4")
    mib = 2 ** 20
    out.append(fig("examples.t4_reserve", [t4.unlimited_reserved_bytes / mib, t4.reserved_bytes / mib],
                   f"on a T4: {t4.unlimited_reserved_bytes / mib:,.0f} MiB reserved without a limit, "
                   f"{t4.reserved_bytes / mib:,.0f} MiB on the card"))
    return out


def scenarios() -> List[Dict[str, Any]]:
    """The seed write-ups' scenarios (vramwidget.fit.scenarios), as the README sums them up."""
    from vramwidget.fit import scenarios as SC

    out = []
    t = SC.thirteen_b_states()
    out.append(fig("scenarios.13b", [t["weights_gb"], t["adam_moments_gb"]],
                   f"13B: weights {t['weights_gb']:.1f} GB (bf16) and Adam moments {t['adam_moments_gb']:.1f} GB"))
    rows = {(r["scenario"], r["checkpointing"]): r for r in SC.seven_b_fp32_vs_bf16()["rows"]}
    lo = rows[("BF16 + fp32 Adam states", "none")]["activations_gb"]
    hi = rows[("FP32", "none")]["activations_gb"]
    out.append(fig("scenarios.7b_activations", [lo, hi], f"activations alone are {lo:.0f}-{hi:.0f} GB (BF16 + fp32 "
                                                         f"states to FP32)"))
    a, b = rows[("FP32", "full")]["estimate_peak_gb"], rows[("BF16 + fp32 Adam states", "full")]["estimate_peak_gb"]
    out.append(fig("scenarios.7b_checkpointing", [a, b], f"with checkpointing the estimate is {a:.1f} GB (FP32) and "
                                                         f"{b:.1f} GB (BF16 + fp32 states)"))
    full = next(r for r in SC.checkpointing_tradeoff()["rows"] if r["checkpointing"] == "full")
    out.append(fig("scenarios.recompute", full["extra_compute"],
                   f"full recomputation costs ~{full['extra_compute'] * 100:.0f}% more compute"))
    four = SC.four_bit_loading()["rows"]
    w16, w4 = four["full bf16"]["weights_gb"], four["QLoRA nf4 base"]["weights_gb"]
    out.append(fig("scenarios.4bit", [w16, w4], f"shrinks the weights ({w16:.1f} -> {w4:.1f} GB for Llama-2-7B)"))
    return out


# ---------------------------------------------------------------------------------------
# slow groups: the tracing backend over the measured cases, and how long things take
# ---------------------------------------------------------------------------------------

def trace() -> List[Dict[str, Any]]:
    from vramwidget.measure import validate as V

    st = V.validate(V.BUILTIN_CASES, backend="trace")["summary"]["peak_allocated_mib"]
    return [fig("trace.peak", [st["median"], st["p90"], st["max"]],
                f"peak allocated within {pct(st['median'])} median, {pct(st['p90'])} p90, {pct(st['max'])} worst "
                f"on the {st['n']} H200 cases")]


def decode() -> List[Dict[str, Any]]:
    """A long generation from a short prompt fragments the large pool (the README's Limits)."""
    import vramwidget as vw

    kw = dict(context_len=32768, prompt_len=128)
    e = vw.estimate_inference("llama-3.1-8b", **kw)
    r, p = e.reserved_bytes / GIB, e.peak_allocated_bytes / GIB
    return [fig("decode.fragmentation", [r, p],
                f"128-token prompt: {r:.1f} GiB reserved for a {p:.1f} GiB allocated peak")]


def speed() -> List[Dict[str, Any]]:
    import vramwidget as vw
    from vramwidget.allocator import replays

    out = []
    times = []
    for model, kw in (("llama-3.2-1b", dict(batch_size=2, seq_len=2048)),
                      ("llama-3.1-8b", dict(method="qlora", batch_size=4, seq_len=2048,
                                            gradient_checkpointing="full"))):
        replays.clear_caches()
        est = vw.estimate(model, **kw)
        t0 = time.process_time()
        est.reserved_bytes
        times.append(time.process_time() - t0)
    lo, hi = min(times), max(times)
    out.append(fig("speed.replay", times, f"A replay costs {_round_ms(lo)}-{_round_ms(hi)} ms, once per setup"))
    from vramwidget import trace as T

    if T.available():
        T.cache_clear()
        vw.estimate("llama-3.2-1b", backend="trace", seq_len=256)      # torch and transformers imported
        T.cache_clear()
        t0 = time.perf_counter()
        vw.estimate("llama-3.1-8b", backend="trace")
        secs = time.perf_counter() - t0
        out.append(fig("speed.trace_8b", secs, f"(an 8B model about {secs:.0f} s once torch is loaded"))
    return out


def _round_ms(seconds: float) -> int:
    ms = seconds * 1e3
    step = 10 if ms >= 10 else 1
    return int(round(ms / step) * step) or 1


CHEAP = {"validation": validation, "published": published, "serving": serving, "examples": examples,
         "scenarios": scenarios}
SLOW = {"trace": trace, "decode": decode, "speed": speed}


def compute(groups) -> List[Dict[str, Any]]:
    out = []
    for name in groups:
        fn = {**CHEAP, **SLOW}[name]
        t0 = time.perf_counter()
        figs = fn()
        for f in figs:
            f["group"] = name
        out.extend(figs)
        print(f"{name}: {len(figs)} figures in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return out


def normalized(text: str) -> str:
    return " ".join(text.split())


def missing_from_readme(figures: List[Dict[str, Any]], readme: str) -> List[Dict[str, Any]]:
    text = normalized(readme)
    return [f for f in figures if normalized(f["snippet"]) not in text]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fast", action="store_true", help="the cheap groups only; the slow ones kept from the file")
    ap.add_argument("--check", action="store_true", help="only compare README.md with the file")
    ap.add_argument("--only", nargs="+", metavar="GROUP", help="recompute these groups; keep the others of the file")
    a = ap.parse_args(argv)
    old: List[Dict[str, Any]] = []
    if os.path.exists(DATA):
        with open(DATA) as f:
            old = json.load(f)["figures"]
    if a.check:
        figures = old
    else:
        groups = a.only or (list(CHEAP) + ([] if a.fast else list(SLOW)))
        figures = compute(groups)
        figures += [f for f in old if f.get("group") not in groups]
        with open(DATA, "w") as f:
            json.dump({"how": "python tools/readme_figures.py (tests/test_readme_figures.py checks README.md)",
                       "figures": figures}, f, indent=1)
            f.write("\n")
    with open(README) as f:
        gone = missing_from_readme(figures, f.read())
    for g in gone:
        print(f"README.md lacks ({g['id']}): {g['snippet']}")
    return 1 if gone else 0


if __name__ == "__main__":
    sys.exit(main())
