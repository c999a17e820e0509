"""Step time, throughput, MFU and run cost (timing.py), judged against the 45 timed H200 steps.

The measured values come from ``vramwidget/data/h200_training_a.jsonl`` (``step_seconds``: the
fastest steady step of three, wall clock with a CUDA synchronize after forward, backward and
the optimizer step).
"""

import math

import pytest
from hypothesis import given, settings, strategies as st

import vramwidget as vw
from vramwidget import timing
from vramwidget.measure.validate import BUILTIN_CASES, load_cases, validate


@pytest.fixture(scope="module")
def measured():
    return {c["id"]: c for c in load_cases(BUILTIN_CASES)}


def _case_est(case, **changes):
    from vramwidget.model.architecture import from_config
    from vramwidget.estimate import estimate_setup
    from vramwidget.training import setup_from_case

    s = setup_from_case(case["training"])
    if changes:
        s = s.replace(**changes)
    return estimate_setup(from_config(case["model"], name=case["name"]), s, gpu="H200")


def test_step_time_accuracy_on_the_visible_cases():
    """Must show: median |error| <= 15%, p90 <= 30% over the 45 timed H200 steps, with one set
    of GPU-level constants (timing.CONSTANTS) and nothing per model or case."""
    summary = validate(BUILTIN_CASES)["summary"]["step_seconds"]
    assert summary["n"] == 45
    assert summary["median"] <= 0.15
    assert summary["p90"] <= 0.30


def test_no_gpu_no_time():
    est = vw.estimate("llama-3.2-1b", batch_size=2, seq_len=2048)
    assert est.step_seconds is None and est.tokens_per_second is None and est.mfu is None
    assert est.time_breakdown is None
    assert est.to_dict()["time"] is None
    with pytest.raises(vw.VramError, match="gpu"):
        est.run_cost(tokens=1e9)


def test_breakdown_adds_up_and_names_what_dominates(measured):
    est = _case_est(measured["a01"])
    b = est.time_breakdown
    assert b["step_seconds"] == pytest.approx(sum(b["phases_seconds"].values()))
    assert b["step_seconds"] == pytest.approx(est.step_seconds)
    assert b["dominant"] in b["kinds_seconds"]
    assert est.tokens_per_second == pytest.approx(2 * 2048 / est.step_seconds)
    # a 1B model in bf16 on an H200: tens of percent MFU, not more than the matmul efficiency
    assert 0.1 < est.mfu < timing.MATMUL_EFFICIENCY
    assert est.to_dict()["time"]["step_seconds"] == pytest.approx(est.step_seconds)


def test_full_checkpointing_recomputes_one_forward_of_the_blocks(measured):
    """Full activation checkpointing reruns every block's forward in backward: +1/3 of the
    forward + backward FLOPs of the blocks (Korthikanti et al. 2022, 'Reducing Activation
    Recomputation in Large Transformer Models', sec. 5: full recomputation adds one forward);
    the output head is not recomputed, so the whole step's ratio is a little under 1/3."""
    case = measured["a16"]                      # llama-2-7b, full fine-tuning, bf16, checkpointing
    gc = _case_est(case)
    no = _case_est(case, gradient_checkpointing="none")
    fl = lambda e: sum(p["flops"] for p in e.time_breakdown["phases"].values())   # noqa: E731
    ratio = (fl(gc) - fl(no)) / fl(no)
    assert 0.30 < ratio < 1 / 3
    assert gc.time_breakdown["recompute_seconds"] > 0 and no.time_breakdown["recompute_seconds"] == 0
    # the estimate's own FLOPs count agrees on the recompute share
    assert gc.recompute_overhead == pytest.approx(ratio, rel=0.05)


def test_foreach_and_fused_adamw_differ_by_the_measured_step(measured):
    """foreach AdamW runs ~9 kernels over the parameters (40 B per bf16 element moved),
    fused AdamW one (14 B): measured a12 - a11 (llama-3.2-1b, bf16, b8 s512) = 10.1 ms."""
    foreach, fused = _case_est(measured["a12"]), _case_est(measured["a11"])
    measured_ms = (measured["a12"]["measured"]["step_seconds"] - measured["a11"]["measured"]["step_seconds"]) * 1e3
    predicted_ms = (foreach.step_seconds - fused.step_seconds) * 1e3
    assert measured_ms == pytest.approx(10.1, abs=0.05)
    assert predicted_ms == pytest.approx(measured_ms, rel=0.30)
    # only the optimizer step differs
    assert foreach.time_breakdown["phases_seconds"]["forward"] == pytest.approx(
        fused.time_breakdown["phases_seconds"]["forward"])
    n = foreach.params_trainable
    assert fused.time_breakdown["phases"]["optimizer_step"]["memory_bytes"] == pytest.approx(14 * n)
    assert foreach.time_breakdown["phases"]["optimizer_step"]["memory_bytes"] == pytest.approx(40 * n)


def test_optimizer_step_is_bandwidth_bound_and_scales_with_parameters():
    """The update reads and writes every parameter, gradient and state: its time grows with the
    parameter count (llama-2-7b has 6,738,415,616 parameters, llama-3.2-1b 1,235,814,400)."""
    small = vw.estimate("llama-3.2-1b", gpu="H200", optimizer="adamw_fused")
    big = vw.estimate("llama-2-7b", gpu="H200", optimizer="adamw_fused")
    assert big.params_trainable == 6_738_415_616 and small.params_trainable == 1_235_814_400
    t = lambda e: e.time_breakdown["phases"]["optimizer_step"]   # noqa: E731
    assert t(small)["bound"] == t(big)["bound"] == "memory bandwidth"
    ratio = t(big)["seconds"] / t(small)["seconds"]
    assert ratio == pytest.approx(6_738_415_616 / 1_235_814_400, rel=0.03)
    # bitsandbytes' 8-bit AdamW: measured a20 - a12-style step difference scales the same way
    eight = vw.estimate("llama-2-7b", gpu="H200", optimizer="adamw_8bit")
    assert t(eight)["seconds"] > t(big)["seconds"]


def test_tf32_speeds_up_fp32_matmuls_only():
    """fp32 matmuls run on CUDA cores (67 TFLOP/s on an H200) unless TF32 is enabled (494.5)."""
    off = vw.estimate("llama-3.2-1b", gpu="H200", precision="fp32", batch_size=2)
    on = vw.estimate("llama-3.2-1b", gpu="H200", precision="fp32", batch_size=2, tf32=True)
    mm = lambda e: e.time_breakdown["phases"]["forward"]["matmul_seconds"]   # noqa: E731
    assert mm(off) / mm(on) == pytest.approx(494.5 / 67, rel=1e-6)
    assert on.peak_allocated_bytes == off.peak_allocated_bytes
    bf = vw.estimate("llama-3.2-1b", gpu="H200", batch_size=2)
    assert mm(bf) == pytest.approx(mm(vw.estimate("llama-3.2-1b", gpu="H200", batch_size=2, tf32=True)))


def test_run_cost():
    est = vw.estimate("llama-3.2-1b", gpu="H200", batch_size=4, seq_len=2048, grad_accum_steps=8)
    c = est.run_cost(tokens=1e9)
    tokens_per_step = 4 * 2048 * 8
    assert c["steps"] == math.ceil(1e9 / tokens_per_step)
    assert c["hours"] == pytest.approx(c["steps"] * est.step_seconds / 3600)
    assert c["usd_per_gpu_hour"] == 6.35 and "2026" in c["price_source"]
    assert c["dollars"] == pytest.approx(c["hours"] * 6.35)
    mine = est.run_cost(tokens=1e9, usd_per_gpu_hour=2.0)
    assert mine["dollars"] == pytest.approx(c["hours"] * 2.0)
    nop = vw.estimate("llama-3.2-1b", gpu="A100 40GB").run_cost(tokens=1e6)
    assert nop["dollars"] is None and nop["hours"] > 0
    for bad in (0, -1, float("nan"), "1e9", True):
        with pytest.raises(vw.VramError, match="tokens"):
            est.run_cost(tokens=bad)
    with pytest.raises(vw.VramError, match="usd_per_gpu_hour"):
        est.run_cost(tokens=1e6, usd_per_gpu_hour=-1)


def test_every_catalogue_gpu_has_sourced_figures():
    from vramwidget.gpus import list_gpus

    for g in list_gpus():
        assert g.spec_source and g.memory_bandwidth_gb_per_s and g.pcie_gb_per_s, g.name
        assert g.peak_flops_per_second("float32") and g.peak_flops_per_second("float16"), g.name
        if g.bf16:
            assert g.peak_flops_per_second("bfloat16") >= g.peak_flops_per_second("float32"), g.name
        if g.usd_per_gpu_hour is not None:
            assert g.price_source, g.name
        assert vw.estimate("llama-3.2-1b", gpu=g.name).step_seconds > 0


@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 16), s=st.sampled_from([128, 512, 2048]),
       method=st.sampled_from(["full", "lora", "qlora"]), gc=st.sampled_from(["none", "full"]))
def test_more_tokens_never_take_less_time(b, s, method, gc):
    kw = dict(gpu="H100 80GB", method=method, gradient_checkpointing=gc, seq_len=s)
    one = vw.estimate("qwen2.5-0.5b", batch_size=b, **kw)
    two = vw.estimate("qwen2.5-0.5b", batch_size=b + 1, **kw)
    assert 0 < one.step_seconds <= two.step_seconds
    assert one.time_breakdown["phases_seconds"]["optimizer_step"] == pytest.approx(
        two.time_breakdown["phases_seconds"]["optimizer_step"])


def _cli(capsys, *argv):
    from vramwidget import cli

    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_estimate_prints_time_and_cost(capsys):
    code, out, err = _cli(capsys, "estimate", "llama-3.2-1b", "--gpu", "H200", "--batch-size", "2",
                          "--tokens", "2e9", "--usd-per-gpu-hour", "3")
    assert code == 0, err
    est = vw.estimate("llama-3.2-1b", gpu="H200", batch_size=2)
    assert f"step time         {est.step_seconds * 1e3:.3g} ms on H200" in out
    assert f"{est.tokens_per_second:,.0f} tokens/s" in out
    cost = est.run_cost(tokens=2e9, usd_per_gpu_hour=3)
    assert f"${cost['dollars']:,.2f} at $3/GPU-hour (given)" in out
    # without --gpu: no time lines; --tokens alone is a usage error
    code, out, err = _cli(capsys, "estimate", "llama-3.2-1b")
    assert code == 0 and "step time" not in out
    code, out, err = _cli(capsys, "estimate", "llama-3.2-1b", "--tokens", "1e9")
    assert code == 2 and "--gpu" in err and len(err.strip().splitlines()) == 1


def test_cli_estimate_json_carries_time_and_cost(capsys):
    import json

    code, out, err = _cli(capsys, "estimate", "llama-3.2-1b", "--gpu", "H100 80GB", "--tf32", "--precision", "fp32",
                          "--json")
    assert code == 0, err
    d = json.loads(out)
    est = vw.estimate("llama-3.2-1b", gpu="H100 80GB", precision="fp32", tf32=True)
    assert d["setup"]["tf32"] is True
    assert d["time"]["step_seconds"] == pytest.approx(est.step_seconds)
    assert d["time"]["breakdown"]["dominant"] == est.time_breakdown["dominant"]
    assert d["run_cost"]["tokens"] == 1e9 and d["run_cost"]["dollars"] == pytest.approx(est.run_cost(1e9)["dollars"])


def test_parallel_none_is_the_single_gpu_time():
    one = vw.estimate("llama-3.2-1b", gpu="H100 80GB", batch_size=4)
    par = vw.estimate_parallel("llama-3.2-1b", gpu="H100 80GB", batch_size=4)
    assert par.step_seconds == pytest.approx(one.step_seconds)
    assert par.tokens_per_second == pytest.approx(one.tokens_per_second)


def test_parallel_communication_volumes_follow_the_zero_paper():
    """ZeRO paper (Rajbhandari et al. 2020) sec. 7: DDP and ZeRO-2 move 2 x Psi per step
    (all-reduce, or reduce-scatter + all-gather), ZeRO-3 3 x Psi (parameters gathered in
    forward and backward): 1.5x.  A ring all-reduce over n ranks moves 2 (n-1)/n of the
    gradients per GPU (llama-3.2-1b: 1,235,814,400 bf16 gradients; H100 NVLink 450 GB/s per
    direction at timing.COMM_EFFICIENCY)."""
    kw = dict(gpu="H100 80GB", batch_size=4, num_gpus=8)
    comm = lambda p: p.time_breakdown["communication"]["collectives_seconds"]   # noqa: E731
    ddp = comm(vw.estimate_parallel("llama-3.2-1b", strategy="ddp", **kw))
    expected = 2 * 7 / 8 * 1_235_814_400 * 2 / (450e9 * timing.COMM_EFFICIENCY)
    assert ddp["gradient all-reduce"] == pytest.approx(expected)
    z2 = comm(vw.estimate_parallel("llama-3.2-1b", strategy="zero2", **kw))
    z3 = comm(vw.estimate_parallel("llama-3.2-1b", strategy="zero3", **kw))
    assert sum(z2.values()) == pytest.approx(expected)
    assert sum(z3.values()) == pytest.approx(1.5 * expected)


def test_parallel_overlap_and_throughput():
    kw = dict(gpu="H100 80GB", batch_size=4, seq_len=2048)
    one = vw.estimate("llama-3.2-1b", **kw)
    ddp = vw.estimate_parallel("llama-3.2-1b", strategy="ddp", num_gpus=8, **kw)
    # DDP's all-reduce (~6.6 ms) hides behind the backward pass: eight times the tokens per second
    assert ddp.time_breakdown["communication_seconds"] == 0.0
    assert ddp.tokens_per_second == pytest.approx(8 * one.tokens_per_second)
    # ZeRO-2 without overlap_comm (DeepSpeed's default) exposes its collectives
    z2 = vw.estimate_parallel("llama-3.2-1b", strategy="zero2", num_gpus=8, **kw)
    assert z2.time_breakdown["communication_seconds"] > 0
    # CPU offload of the optimizer: PCIe traffic and a host-side step every step
    off = vw.estimate_parallel("llama-3.2-1b", strategy="zero2", num_gpus=8, offload_optimizer=True, **kw)
    assert off.step_seconds > z2.step_seconds
    # a run's cost counts every GPU
    c = ddp.run_cost(tokens=1e9)
    assert c["gpus"] == 8 and c["gpu_hours"] == pytest.approx(8 * c["hours"])
    # pipeline parallel: (p - 1) micro-batch slots idle per step
    pp = vw.estimate_parallel("llama-3.2-1b", strategy="ddp", num_gpus=2, pipeline_parallel=2, micro_batches=4, **kw)
    b = pp.time_breakdown
    assert b["pipeline_bubble_seconds"] == pytest.approx(
        b["phases"]["forward"]["seconds"] + b["phases"]["backward"]["seconds"])


def test_suggestions_rank_by_time_per_token():
    """Changes that fit are ranked by what they cost the user (fit.RANK_TIERS: free, GPU
    time, quality, slow, more GPUs); within the free and the time tiers by the GPU time (so
    the money) a training token costs with them; checkpointing's cost is its recompute,
    offload's the PCIe and host-side step."""
    sug = [x for x in vw.suggestions("llama-3.2-1b", "L40S", batch_size=4, seq_len=2048) if x.fits]
    tiers = [x.tier() for x in sug]
    assert tiers == sorted(tiers)
    for tier in (0, 1):
        same = [x for x in sug if x.tier() == tier and x.state == "fits"]
        assert [x.gpu_seconds_per_token for x in same] == sorted(x.gpu_seconds_per_token for x in same)
    by = {x.title: x for x in sug}
    sel, full = by["selective activation checkpointing"], by["full activation checkpointing"]
    assert 0 < sel.time_change < 0.05 < full.time_change < 1 / 3
    # ZeRO-Offload alone lands on the card's limit as the base does (no saving on the card):
    # it is listed with the fused AdamW, which changes nothing on the GPU under offload
    off = next(x for x in sug if x.title.endswith("DeepSpeed ZeRO-Offload: optimizer on the CPU"))
    assert off.time_change > full.time_change
    assert off.usd_per_million_tokens == pytest.approx(off.gpu_seconds_per_token * 1e6 / 3600 * 1.40)


def test_fit_answers_carry_time_and_cost(capsys):
    from vramwidget.fit.solver import answers

    a = answers("llama-3.2-1b", "RTX 4090", batch_size=2)
    est = vw.estimate("llama-3.2-1b", gpu="RTX 4090", batch_size=2)
    assert a["time"]["step_seconds"] == pytest.approx(est.step_seconds)
    assert a["run_cost"]["dollars"] == pytest.approx(est.run_cost(tokens=1e9)["dollars"])
    code, out, err = _cli(capsys, "fit", "llama-3.2-1b", "--gpu", "RTX 4090", "--batch-size", "2")
    assert code == 0, err
    assert f"step time         {est.step_seconds:.3g} s" in out and "run cost" in out


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_seed_checkpointing_tradeoff_in_time(attn):
    """The seeds: full checkpointing ~36% extra compute, selective ~4%.  In FLOPs full adds
    one forward of the blocks (~1/3); in time a little less, since the loss, the memory-bound
    optimizer step and the head are not recomputed; selective recomputes only the attention
    core (llama-2-7b, b8 x s2048, on an H100)."""
    from vramwidget.fit.scenarios import checkpointing_tradeoff

    rows = {r["checkpointing"]: r for r in checkpointing_tradeoff(attn_implementation=attn)["rows"]}
    assert rows["none"]["extra_time"] == 0.0
    assert 0.0 < rows["selective"]["extra_time"] < 0.05
    assert 0.25 < rows["full"]["extra_time"] < rows["full"]["extra_compute"] < 1 / 3


def test_widget_shows_time_beside_the_verdict():
    """The widget's summary carries the step time, tokens/s and a run's cost when a GPU is
    chosen (the frontend draws them beside the fits badge), none without a GPU."""
    calc = vw.Calculator("llama-3.2-1b")
    assert calc.summary["time"] is None
    calc.gpu = "H100 80GB"
    t = calc.summary["time"]
    est = vw.estimate("llama-3.2-1b", gpu="H100 80GB", **{k: v for k, v in calc.setup().items() if k != "model"})
    assert t["step_seconds"] == pytest.approx(est.step_seconds)
    assert t["tokens_per_second"] == pytest.approx(est.tokens_per_second)
    cost = est.run_cost(tokens=1e9)
    assert t["run_dollars"] == pytest.approx(cost["dollars"]) and t["run_gpu_hours"] == pytest.approx(cost["gpu_hours"])
    assert t["text"] in calc.summary["text"]


def test_eight_bit_adamw_costs_what_was_measured(measured):
    """bitsandbytes' blockwise 8-bit AdamW runs far below the bandwidth a fused update reaches:
    measured a10 - a12 (llama-3.2-1b, bf16, b8 s512, 8-bit vs foreach AdamW) = 23.3 ms; with
    1,235,814,400 parameters that is the 8-bit kernel's cost net of foreach's."""
    eight, foreach = _case_est(measured["a10"]), _case_est(measured["a12"])
    m = (measured["a10"]["measured"]["step_seconds"] - measured["a12"]["measured"]["step_seconds"]) * 1e3
    assert m == pytest.approx(23.3, abs=0.05)
    assert (eight.step_seconds - foreach.step_seconds) * 1e3 == pytest.approx(m, rel=0.30)
    # llama-2-7b (a20): the optimizer step is most of the step
    big = _case_est(measured["a20"])
    assert big.time_breakdown["phases_seconds"]["optimizer_step"] > 0.4 * big.step_seconds


def test_activation_offloading_costs_pcie_time_where_it_outlasts_compute():
    """torchtune's OffloadActivations copies every saved activation to pinned host memory in
    forward and back in backward on a side stream: the copies cost time only when PCIe is
    slower than the phase's kernels (H100: PCIe Gen5, 64 GB/s per direction)."""
    kw = dict(gpu="H100 80GB", batch_size=8, seq_len=2048, stack="torchtune")
    plain = vw.estimate("llama-3.2-3b", **kw)
    off = vw.estimate("llama-3.2-3b", activation_offloading=True, **kw)
    fwd = off.time_breakdown["phases"]["forward"]
    moved = plain.phases_bytes["forward"] - off.phases_bytes["forward"]   # what left the GPU
    assert fwd["pcie_seconds"] == pytest.approx(moved / (64e9 * timing.COMM_EFFICIENCY), rel=0.05)
    assert fwd["bound"] == "PCIe" and off.step_seconds > 2 * plain.step_seconds
    # with full checkpointing only the layer inputs move: the copies hide behind the kernels
    gc = dict(kw, gradient_checkpointing="full")
    assert vw.estimate("llama-3.2-3b", activation_offloading=True, **gc).step_seconds == pytest.approx(
        vw.estimate("llama-3.2-3b", **gc).step_seconds)


def test_smaller_micro_batches_pay_the_fixed_costs_again():
    """Micro-batch 1 with 8 accumulation steps runs the FLOPs of micro-batch 8, but every
    micro-step pays the host's op dispatch and the kernel launches again: a small model
    becomes host-bound (qwen2.5-0.5b), a large one barely notices (llama-3.1-8b)."""
    def ratio(model):
        kw = dict(gpu="H100 80GB", seq_len=1024)
        big = vw.estimate(model, batch_size=8, **kw)
        small = vw.estimate(model, batch_size=1, grad_accum_steps=8, **kw)
        fl = lambda e: sum(p["flops"] * (8 if n != "optimizer_step" and e is small else 1)  # noqa: E731
                           for n, p in e.time_breakdown["phases"].items())
        assert fl(small) == pytest.approx(fl(big), rel=1e-9)
        assert small.tokens_per_second < big.tokens_per_second
        return small.step_seconds / big.step_seconds
    assert ratio("qwen2.5-0.5b") > 2.0
    assert 1.0 < ratio("llama-3.1-8b") < 1.2
    assert vw.estimate("qwen2.5-0.5b", gpu="H100 80GB", batch_size=1, seq_len=1024,
                       grad_accum_steps=8).time_breakdown["phases"]["forward"]["bound"] == "host (op dispatch)"
