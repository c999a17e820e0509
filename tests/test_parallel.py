"""Per-GPU memory under parallelism (vramwidget.parallel.estimate).

Reference figures come from ../shared/REFERENCES.md ("Papers and docs"); each test names
its source.  Sizes: GB = 10**9 B, GiB = 2**30 B, as each source uses them.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vramwidget import VramError, custom, estimate, from_param_count
from vramwidget.parallel.estimate import STRATEGIES, estimate_parallel
from vramwidget.units import GB, GIB


def rel(a, b):
    return abs(a - b) / b


# ---------------------------------------------------------------------------------------
# ZeRO paper, Figure 1
# ---------------------------------------------------------------------------------------

def test_zero_paper_figure1_model_states():
    """REFERENCES.md, ZeRO (Rajbhandari et al. 2019), Figure 1: a 7.5B-parameter model,
    mixed-precision Adam (K = 12: fp32 master weights, momentum, variance), 64 data-parallel
    GPUs.  Per-GPU model states -- 16-bit parameters + 16-bit gradients + K bytes of
    optimizer state per parameter -- are 120 GB (baseline), 31.4 GB (P_os), 16.6 GB
    (P_os+g) and 1.9 GB (P_os+g+p).  Here: DeepSpeed stages 0-3 with bf16 weights; DeepSpeed's
    optimizer adds the fp32 master copy to the Adam moments (K = 4 + 8)."""
    arch = from_param_count("7.5B")
    assert arch.params_total == pytest.approx(7.5e9, rel=1e-3)
    expected = {"zero0": 120.0, "zero1": 31.4, "zero2": 16.6, "zero3": 1.9}
    for strategy, gb in expected.items():
        pe = estimate_parallel(arch, strategy=strategy, num_gpus=64, precision="bf16")
        ms = pe.model_states
        states = ms["weights"] + ms["gradients"] + ms["fp32 master weights"] + ms["optimizer states"]
        assert rel(states / GB, gb) < 0.02, (strategy, states / GB, gb)


# ---------------------------------------------------------------------------------------
# DeepSpeed's ZeRO-3 estimator, T0_3B
# ---------------------------------------------------------------------------------------

def t0_3b_standin():
    """T0_3B is a T5 encoder-decoder (T5 v1.1 XL: d_model 2048, vocab 32128); DeepSpeed's
    estimator reads only two numbers off it: 2,783M parameters (AutoModel, shared embedding
    counted once) and the largest layer, the 32128 x 2048 = 65.8M shared embedding.  This
    decoder-only stand-in has the same two numbers (56 Llama blocks of h = 2048, i = 5168,
    tied embeddings)."""
    arch = custom(hidden_size=2048, num_layers=56, num_heads=32, vocab_size=32128, intermediate_size=5168,
                  tied=True, name="T0_3B stand-in")
    assert rel(arch.params_total, 2783e6) < 0.001
    modules = {}
    for t in arch.tensors:
        key = t.name.rsplit(".", 1)[0]
        modules[key] = modules.get(key, 0) + t.numel_each
    assert max(modules.values()) == 32128 * 2048   # 65.8M: int(65.8) = 65 in DeepSpeed's "65M"
    return arch


def test_deepspeed_zero3_t0_3b():
    """REFERENCES.md, DeepSpeed docs, ZeRO-3 estimator for T0_3B (2,783M params, largest
    layer 65M, 1 GPU): no offload 46.91 GB GPU; optimizer offloaded 5.43 GB GPU / 62.23 GB
    CPU; everything offloaded 0.25 GB GPU / 70.00 GB CPU (DeepSpeed prints GiB as "GB").

    DeepSpeed's ``estimate_zero3_model_states_mem_needs`` (deepspeed/runtime/zero/stage3.py)
    counts, per GPU: ``largest_layer_memory = 4 * largest_layer_params`` -- the module being
    run, gathered as 2-byte parameters, and its 2-byte gradients before they are
    reduce-scattered -- plus ``18 * params / total_gpus``: the 16-bit parameter partition
    (2), and the optimizer's fp32 partition copy (4), fp32 gradients (4), momentum (4) and
    variance (4) (its docs: "16b for fp32: 4b params, 4b grads, 4b momentum and 4b variance,
    +2b for fp16 params").  Offloading the optimizer moves those 16 bytes to the CPU
    (``16 * params``), offloading parameters too moves the 2-byte partition as well
    (``18 * params``); host memory is per node times ``additional_buffer_factor = 1.5``.
    Those are exactly the parts vramwidget.parallel.estimate names: weights, fp32 master weights,
    fp32 gradients, optimizer states, gathered parameters and gradients, under the settings
    where the estimator's definitions hold: the whole partition's gradients converted to fp32
    at once (sub_group_size at the Stage3 constructor's 1e12), only the module running
    gathered (no prefetch, nothing kept for reuse).  Under optimizer offload the 16-bit
    gradient partitions sit on the host too (``self.device`` is the CPU then), which the
    estimator leaves out: tests/test_zero.py compares with DeepSpeed's own functions."""
    arch = t0_3b_standin()
    cfg = {"sub_group_size": int(1e12), "stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0}

    pe = estimate_parallel(arch, strategy="zero3", num_gpus=1, precision="bf16", zero_config=cfg)
    ms = pe.model_states
    gpu = (ms["weights"] + ms["fp32 master weights"] + ms["fp32 gradients"] + ms["optimizer states"]
           + ms["gathered parameters"] + ms["gathered gradients"])
    assert rel(gpu / GIB, 46.91) < 0.02
    assert pe.cpu_bytes_per_node == 0
    assert pe.device_total_bytes > gpu   # activations, buffers, context come on top

    pe = estimate_parallel(arch, strategy="zero3", num_gpus=1, precision="bf16", offload_optimizer=True,
                           zero_config=cfg)
    ms = pe.model_states
    gpu = ms["weights"] + ms["gathered parameters"] + ms["gathered gradients"]
    assert rel(gpu / GIB, 5.43) < 0.02
    cpu = pe.stages[0].cpu
    assert set(cpu) == {"fp32 master weights", "fp32 gradients", "optimizer states", "gradient partitions"}
    host = (pe.cpu_bytes_per_node - cpu["gradient partitions"] * pe.cpu_buffer_factor)
    assert rel(host / GIB, 62.23) < 0.02

    pe = estimate_parallel(arch, strategy="zero3", num_gpus=1, precision="bf16", offload_optimizer=True,
                           offload_params=True, zero_config=cfg)
    ms = pe.model_states
    gpu = ms["gathered parameters"] + ms["gathered gradients"]
    # 4 x 65.8M = 0.2451 GiB, which DeepSpeed prints as "0.25"
    assert round(gpu / GIB, 2) == 0.25
    assert rel(gpu / GIB, 0.25) < 0.02
    host = pe.cpu_bytes_per_node - pe.stages[0].cpu["gradient partitions"] * pe.cpu_buffer_factor
    assert rel(host / GIB, 70.00) < 0.02


def test_deepspeed_offload_moves_states_off_the_gpu():
    """The same documented cases, on the whole per-GPU estimate: each offload lowers the
    device total by at least the model states it moves."""
    arch = t0_3b_standin()
    kw = dict(strategy="zero3", num_gpus=1, precision="bf16", seq_len=512)
    none = estimate_parallel(arch, **kw)
    opt = estimate_parallel(arch, offload_optimizer=True, **kw)
    both = estimate_parallel(arch, offload_optimizer=True, offload_params=True, **kw)
    cpu = opt.stages[0].cpu
    # what the GPU held at every phase: the master, the moments and the gradient partitions
    moved = cpu["fp32 master weights"] + cpu["optimizer states"] + cpu["gradient partitions"]
    assert none.per_gpu.peak_allocated_bytes - opt.per_gpu.peak_allocated_bytes >= 0.9 * moved - 1
    assert both.device_total_bytes < opt.device_total_bytes < none.device_total_bytes


# ---------------------------------------------------------------------------------------
# Megatron-LM, Llama-3.1-8B TP2 DP2
# ---------------------------------------------------------------------------------------

def test_megatron_llama31_8b_tp2_dp2_weights_and_optimizer():
    """REFERENCES.md, Megatron-LM unit test: Llama-3.1-8B (h 4096, ffn 14336, 32 layers,
    8 KV groups, vocab 128256 untied), TP2 PP1 DP2 with the distributed optimizer: weights +
    optimizer about 44.87 GiB per GPU.  Megatron's theoretical memory counts 6 + 12/DP bytes
    per parameter of the most loaded shard: bf16 weights (2) and fp32 main gradients (4),
    plus fp32 master weights and Adam moments (12) sharded over DP."""
    pe = estimate_parallel("llama-3.1-8b", strategy="megatron_distopt", num_gpus=4, tensor_parallel=2,
                           precision="bf16")
    assert pe.layout["data_parallel"] == 2
    ms = pe.model_states
    total = ms["weights"] + ms["fp32 gradients"] + ms["fp32 master weights"] + ms["optimizer states"]
    assert rel(total / GIB, 44.87) < 0.02
    # the shard: everything split by TP except the norms
    assert rel(pe.stages[0].params_local, 8_030_261_248 / 2) < 0.001


# ---------------------------------------------------------------------------------------
# One GPU, no sharding: the single-GPU estimate, exactly
# ---------------------------------------------------------------------------------------

SETUPS = [
    dict(),
    dict(batch_size=4, seq_len=1024, gradient_checkpointing="full"),
    dict(method="qlora", batch_size=2),
    dict(method="lora", precision="amp_bf16", grad_accum_steps=4),
    dict(precision="fp32", optimizer="adamw_8bit", attn_implementation="eager", seq_len=512),
]


@pytest.mark.parametrize("model", ["llama-3.1-8b", "gpt2", "mixtral-8x7b", "gemma-2-2b", "deepseek-v2-lite"])
@pytest.mark.parametrize("setup", SETUPS)
def test_one_gpu_no_sharding_is_the_single_gpu_estimate(model, setup):
    """Issue 6: per-GPU totals with one GPU and no sharding equal the single-GPU estimate."""
    ref = estimate(model, **setup)
    pe = estimate_parallel(model, strategy="none", num_gpus=1, **setup)
    est = pe.per_gpu
    assert est.phases_bytes == ref.phases_bytes
    assert est.peak_allocated_bytes == ref.peak_allocated_bytes
    assert est.reserved_bytes == ref.reserved_bytes
    assert est.device_total_bytes == ref.device_total_bytes
    assert est.peak_phase == ref.peak_phase
    assert est.component_bytes() == ref.component_bytes()
    assert len(pe.stages) == 1 and pe.cpu_bytes_per_gpu == 0


@settings(max_examples=40, deadline=None)
@given(model=st.sampled_from(["qwen2.5-0.5b", "llama-3.2-1b", "gpt2-medium", "olmoe-1b-7b", "phi-3-mini"]),
       batch=st.integers(1, 16), seq=st.sampled_from([128, 512, 2048, 4096]),
       precision=st.sampled_from(["bf16", "amp_bf16", "fp32", "bf16_fp32_states"]),
       gc=st.sampled_from(["none", "full", "selective"]), method=st.sampled_from(["full", "lora", "qlora"]))
def test_identity_property(model, batch, seq, precision, gc, method):
    kw = dict(batch_size=batch, seq_len=seq, precision=precision, gradient_checkpointing=gc, method=method)
    if method == "qlora" and precision == "fp32":
        kw["precision"] = "bf16"
    ref = estimate(model, **kw)
    pe = estimate_parallel(model, **kw)
    assert pe.device_total_bytes == ref.device_total_bytes
    assert pe.per_gpu.phases_bytes == ref.phases_bytes


# ---------------------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------------------

MODELS = ["qwen2.5-0.5b", "llama-3.2-1b", "gpt2-medium", "olmoe-1b-7b", "llama-3.1-8b", "mixtral-8x7b"]


@settings(max_examples=40, deadline=None)
@given(model=st.sampled_from(MODELS), batch=st.integers(1, 8), seq=st.sampled_from([256, 1024, 4096]),
       precision=st.sampled_from(["bf16", "amp_bf16", "bf16_fp32_states"]),
       gc=st.sampled_from(["none", "full"]), method=st.sampled_from(["full", "lora"]),
       offload=st.sampled_from([(False, False), (True, False), (True, True)]),
       gpus=st.lists(st.integers(1, 512), min_size=2, max_size=5, unique=True))
def test_more_gpus_never_need_more_memory_per_gpu_under_zero3(model, batch, seq, precision, gc, method, offload,
                                                              gpus):
    """Issue 6 property: under ZeRO-3 the allocated peak per GPU never grows with the GPU count
    (but for the NCCL communicator's buffers that a second GPU brings).  The device total adds
    the reserve of the caching allocator replayed over that GPU's tensors, whose cached free
    bytes move with the tensor sizes: a freed gathered block that the activations then split
    cannot take the next block (Mixtral-8x7B's 2.8 GB layers on 404 GPUs: a second segment), so
    it never grows by more than the estimate's own band (1.9%) plus the gathered parameters."""
    from vramwidget.parallel.estimate import NCCL_BUFFSIZE_BYTES, NCCL_CHANNELS

    kw = dict(batch_size=batch, seq_len=seq, precision=precision, gradient_checkpointing=gc, method=method,
              offload_optimizer=offload[0], offload_params=offload[1])
    ns = sorted(gpus)
    pes = [estimate_parallel(model, strategy="zero3", num_gpus=n, **kw) for n in ns]
    peaks = [pe.per_gpu.peak_allocated_bytes for pe in pes]
    totals = [pe.device_total_bytes for pe in pes]
    comm = 2 * NCCL_CHANNELS * NCCL_BUFFSIZE_BYTES * 1.05 + 1.0   # 1.05: the allocator reserve; 1 B: rounding
    assert all(b <= a + (comm if n == 1 else 0) for n, a, b in zip(ns, peaks, peaks[1:])), peaks
    gathered = [pe.model_states.get("gathered parameters", 0.0) for pe in pes]
    assert all(b <= a * 1.019 + g + (comm if n == 1 else 0)
               for n, a, b, g in zip(ns, totals, totals[1:], gathered[1:])), totals


@settings(max_examples=40, deadline=None)
@given(model=st.sampled_from(MODELS), batch=st.integers(1, 8), seq=st.sampled_from([256, 1024, 4096]),
       precision=st.sampled_from(["bf16", "amp_bf16", "fp32", "bf16_fp32_states"]),
       optimizer=st.sampled_from(["adamw", "adamw_fused", "adamw_8bit", "sgd"]),
       method=st.sampled_from(["full", "lora"]), gpus=st.integers(1, 1024))
def test_each_zero_stage_needs_no_more_than_the_one_before(model, batch, seq, precision, optimizer, method, gpus):
    """Issue 6 property: stage k+1 needs no more than stage k.  On the model states (the ZeRO
    paper's quantity: parameters, gradients, optimizer states incl. the fp32 master copy)
    for every stage; on the device total for stages 0 -> 1 -> 2 (stage 3 adds gathered
    modules, a persistent reduce bucket and a prefetch bucket, which exceed what it saves
    at small GPU counts: see test_zero3_can_exceed_zero2_on_few_gpus).  With fp32 parameters
    (fp32, amp_bf16) stage 0 runs torch's optimizer on the parameters themselves (engine.py
    _do_optimizer_sanity_check: no wrapper) while ZeRO-1 clones its fp32 partition
    (stage_1_and_2.py): stage 1 holds one more fp32 copy, which its partitioning pays for only
    when the optimizer keeps states.  ZeRO-1/2 also allocate IPG buffers of reduce_bucket_size
    elements whatever the gradients' size (stage_1_and_2.py setup_buckets), while stage 0
    all-reduces flat copies no larger than the gradients, and ZeRO-2's gradient partition is
    allocated whole at a backward's first gradient (``grads_in_partition``) where ZeRO-1's
    gradients grow one by one (so ZeRO-2 can peak above ZeRO-1 in the backward of a small
    model): the allocated peaks of stages 0 and 1 are ordered for full fine-tuning from 8 GPUs,
    where partitioning saves more than those buffers hold.  Not their device totals: the
    reserve on top is the caching allocator replayed over each stage's own requests, and
    fragmentation can put two close stages the other way round (GPT-2 medium, full, 8-bit
    AdamW, 2 x 4,096 tokens on 8 GPUs: ZeRO-1 allocates 0.87 GB less than ZeRO-0 at its peak
    and reserves 0.42 GB more, its eager attention's 1 GiB score blocks split differently)."""
    kw = dict(batch_size=batch, seq_len=seq, precision=precision, optimizer=optimizer, method=method,
              num_gpus=gpus)
    prev_states = prev_total = None
    stages = ("zero0", "zero1", "zero2", "zero3")
    if precision in ("fp32", "amp_bf16"):
        stages = stages[1:]
    for stage in stages:
        pe = estimate_parallel(model, strategy=stage, **kw)
        ms = pe.model_states
        states = ms["weights"] + ms["gradients"] + ms.get("fp32 master weights", 0.0) + ms["optimizer states"]
        if prev_states is not None:
            assert states <= prev_states * (1 + 1e-12), stage
        if prev_total is not None and stage == "zero1" and method == "full" and gpus >= 8:
            assert pe.peak_allocated_bytes <= prev_total * (1 + 1e-12), stage
        prev_states, prev_total = states, pe.peak_allocated_bytes


def test_zero3_can_exceed_zero2_on_few_gpus():
    """What the stage-ordering property leaves out, on purpose: ZeRO-3 on one GPU shards
    nothing but still gathers modules and keeps its reduce bucket allocated, so it needs
    more than ZeRO-2 (allocated: ZeRO-2's reserve on one GPU caches its step's fp32 copies);
    on many GPUs the sharded parameters win."""
    one = {s: estimate_parallel("llama-3.2-1b", strategy=s, num_gpus=1).peak_allocated_bytes for s in ("zero2", "zero3")}
    many = {s: estimate_parallel("llama-3.1-8b", strategy=s, num_gpus=64).device_total_bytes
            for s in ("zero2", "zero3")}
    assert one["zero3"] > one["zero2"]
    assert many["zero3"] < many["zero2"]


# ---------------------------------------------------------------------------------------
# Tensor / sequence parallel (Korthikanti et al. 2022)
# ---------------------------------------------------------------------------------------

def _acts(**kw):
    pe = estimate_parallel("llama-3.1-8b", strategy="none", batch_size=1, seq_len=4096, **kw)
    return pe.per_gpu.component_bytes("forward")["activations"]


def test_tensor_parallel_activations_follow_korthikanti():
    """REFERENCES.md, Korthikanti et al. 2022: per layer, tensor parallel leaves the
    non-parallel part whole and divides the rest by t -- sbh(10 + 24/t + 5as/(ht)) --, so
    activations are N + R/t for some N, R; with sequence parallel everything is divided by
    t -- sbh(34/t + 5as/(ht)), i.e. the t = 1 activations over t."""
    a1 = _acts(num_gpus=1)
    a = {t: _acts(num_gpus=t, tensor_parallel=t) for t in (2, 4, 8)}
    # linear in 1/t: N + R/t through three points
    R = (a[2] - a[4]) * 4
    N = a[2] - R / 2
    assert a[8] == pytest.approx(N + R / 8, rel=1e-9)
    assert a1 == pytest.approx(N + R, rel=1e-9)
    assert 0 < N < a1 and 0 < R < a1
    for t in (2, 4, 8):
        assert _acts(num_gpus=t, tensor_parallel=t, sequence_parallel=True) == pytest.approx(a1 / t, rel=1e-5)  # each tensor x its share in whole bytes; the peak event moves with them


def test_tensor_parallel_splits_weights_and_vocabulary():
    """Megatron's column/row split and vocab-parallel embedding/head: every weight but the
    norms is divided by t; the logits are b x s x V/t."""
    one = estimate_parallel("llama-3.1-8b", num_gpus=1)
    two = estimate_parallel("llama-3.1-8b", num_gpus=2, tensor_parallel=2)
    norms = 32 * 2 * 4096 + 4096
    assert two.stages[0].params_local == (one.stages[0].params_local - norms) / 2 + norms
    lg1 = one.per_gpu.component_bytes("forward")["logits and loss"]
    lg2 = two.per_gpu.component_bytes("forward")["logits and loss"]
    assert lg2 == pytest.approx(lg1 / 2)


def test_context_parallel_splits_the_sequence():
    full = estimate_parallel("llama-3.1-8b", num_gpus=1, seq_len=8192)
    cp = estimate_parallel("llama-3.1-8b", num_gpus=2, context_parallel=2, strategy="ddp", seq_len=8192)
    half = estimate("llama-3.1-8b", seq_len=4096)
    assert cp.per_gpu.component_bytes("forward")["activations"] == half.component_bytes("forward")["activations"]
    assert cp.device_total_bytes < full.device_total_bytes
    with pytest.raises(VramError) as e:
        estimate_parallel("llama-3.1-8b", num_gpus=3, context_parallel=3, strategy="ddp", seq_len=8192)
    assert e.value.field == "context_parallel"


# ---------------------------------------------------------------------------------------
# Pipeline parallel
# ---------------------------------------------------------------------------------------

def test_pipeline_stages_1f1b():
    """Issue 6: the first stage holds the embeddings, the last the output head and the
    logits; under 1F1B stage i keeps min(pp - i, m) micro-batches of activations."""
    pe = estimate_parallel("llama-3.1-8b", strategy="ddp", num_gpus=8, pipeline_parallel=4, micro_batches=8)
    assert [s.in_flight for s in pe.stages] == [4, 3, 2, 1]
    assert [s.layers for s in pe.stages] == [(0, 7), (8, 15), (16, 23), (24, 31)]
    assert [(s.embedding, s.head) for s in pe.stages] == [(True, False), (False, False), (False, False),
                                                         (False, True)]
    lg = [s.estimate.component_bytes("forward").get("logits and loss", 0.0) for s in pe.stages]
    assert lg[:3] == [0.0, 0.0, 0.0] and lg[3] > 0
    acts = [s.estimate.component_bytes("forward")["activations"] for s in pe.stages]
    assert acts[1] == pytest.approx(acts[2] * 3 / 2)       # same layers, 3 vs 2 micro-batches
    # every parameter sits on exactly one stage
    assert sum(s.params_local for s in pe.stages) == 8_030_261_248
    assert pe.worst_stage == max(range(4), key=lambda i: pe.stages[i].device_total_bytes)
    assert pe.per_gpu is pe.stages[pe.worst_stage].estimate
    # fewer micro-batches than stages: at most m in flight
    few = estimate_parallel("llama-3.1-8b", strategy="ddp", num_gpus=8, pipeline_parallel=4, micro_batches=2)
    assert [s.in_flight for s in few.stages] == [2, 2, 2, 1]


def test_pipeline_tied_head_is_a_copy_on_the_last_stage():
    pe = estimate_parallel("gemma-2-2b", strategy="ddp", num_gpus=2, pipeline_parallel=2, micro_batches=4)
    arch_params = estimate("gemma-2-2b").params_total
    vocab_h = 256000 * 2304
    assert sum(s.params_local for s in pe.stages) == arch_params + vocab_h


# ---------------------------------------------------------------------------------------
# Expert parallel, data-parallel buffers, errors
# ---------------------------------------------------------------------------------------

def test_expert_parallel_divides_expert_weights():
    one = estimate_parallel("mixtral-8x7b", strategy="ddp", num_gpus=8)
    ep = estimate_parallel("mixtral-8x7b", strategy="ddp", num_gpus=8, expert_parallel=8)

    def experts(pe):
        w = next(c for c in pe.per_gpu.phase_components["after_load"] if c.name == "weights")
        return next(c for c in w.children if c.name == "experts").bytes

    assert experts(ep) == pytest.approx(experts(one) / 8)
    # routed tokens per GPU are unchanged with balanced routing
    assert ep.per_gpu.component_bytes("forward")["activations"] == one.per_gpu.component_bytes("forward")["activations"]


def test_ddp_buckets_and_bucket_view():
    """PyTorch DDP docs: gradient_as_bucket_view=True saves memory equal to the total
    gradient size (the reducer's buckets otherwise hold a copy of every gradient)."""
    plain = estimate_parallel("llama-3.2-1b", strategy="ddp", num_gpus=8)
    view = estimate_parallel("llama-3.2-1b", strategy="ddp", num_gpus=8, ddp_bucket_view=True)
    grads = plain.model_states["gradients"]
    assert plain.model_states["communication buffers"] == grads
    step = plain.per_gpu.phases_bytes["optimizer_step"] - view.per_gpu.phases_bytes["optimizer_step"]
    assert step == pytest.approx(grads)


def test_cpu_offload_per_node_counts_the_node_gpus():
    kw = dict(strategy="zero3", offload_optimizer=True, precision="bf16")
    one_node = estimate_parallel("llama-3.1-8b", num_gpus=8, gpus_per_node=8, **kw)
    two_nodes = estimate_parallel("llama-3.1-8b", num_gpus=16, gpus_per_node=8, **kw)
    assert one_node.layout["nodes"] == 1 and two_nodes.layout["nodes"] == 2
    assert two_nodes.cpu_bytes_per_node == pytest.approx(one_node.cpu_bytes_per_node / 2)
    assert one_node.cpu_bytes_per_gpu == pytest.approx(two_nodes.cpu_bytes_per_gpu * 2)


@pytest.mark.parametrize("kw, field", [
    (dict(strategy="ddp", offload_optimizer=True), "offload_optimizer"),
    (dict(strategy="zero2", offload_params=True), "offload_params"),
    (dict(strategy="fsdp_full_shard", offload_optimizer=True), "offload_optimizer"),
    (dict(strategy="none", num_gpus=2), "strategy"),
    (dict(strategy="zero9"), "strategy"),
    (dict(num_gpus=3, tensor_parallel=2), "num_gpus"),
    (dict(tensor_parallel=3, num_gpus=3), "tensor_parallel"),
    (dict(expert_parallel=2, num_gpus=2, strategy="ddp"), "expert_parallel"),
    (dict(sequence_parallel=True), "sequence_parallel"),
    (dict(num_gpus=0), "num_gpus"),
])
def test_bad_layouts_name_their_field(kw, field):
    with pytest.raises(VramError) as e:
        estimate_parallel("llama-3.1-8b", **kw)
    assert e.value.field == field


def test_every_strategy_runs_and_reports():
    for strategy in STRATEGIES:
        n = 1 if strategy == "none" else 8
        pe = estimate_parallel("qwen2.5-0.5b", strategy=strategy, num_gpus=n)
        d = pe.to_dict()
        assert d["device_total_bytes"] > 0 and d["strategy"] == strategy
        assert sum(c.bytes for c in pe.per_gpu.components) == pytest.approx(pe.per_gpu.device_total_bytes)
