"""FSDP2 and DTensor tensor parallel run for real on the CPU, against the per-rank plan.

PyTorch 2.13 runs ``fully_shard`` and ``parallelize_module`` on a CPU device mesh under its
fake process group (``torch.testing._internal.distributed.fake_pg``: one process plays rank 0
of ``ws`` ranks; collectives allocate their outputs and move nothing), on real tiny models
built by transformers.  ``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker`` and
``mem_tracker.MemTracker`` attribute every live tensor to a category; each category's most
bytes at once over a steady step (the second of two; every module's snapshots) is compared
with vramwidget.parallel.fsdp's plan and the estimator.

What cannot run without CUDA: CPU offload (``CPUOffloadPolicy``) runs on a CPU mesh, but its
target and the compute device are then the same device, so nothing moves and the tracker
sees the run without offload (test_cpu_offload_moves_nothing_on_a_cpu_mesh); the split
between GPU and host is the plan's, read from _fsdp_param.py.  Kernel choices (SDPA's CUDA
backends) are the estimator's CUDA ones; on the CPU SDPA keeps q, k, v, output and
logsumexp as flash attention does, so the activations compare.
"""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
dist = pytest.importorskip("torch.distributed")

import vramwidget as vw  # noqa: E402
from vramwidget.parallel import fsdp  # noqa: E402
from vramwidget.model.architecture import load  # noqa: E402
from vramwidget.plan.params import param_storage as _params  # noqa: E402
from vramwidget.training import TrainingSetup  # noqa: E402

#: a small Llama and a small Qwen3-MoE (8 experts, top 2), 2 blocks each, untied head
LLAMA = dict(model_type="llama", hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, max_position_embeddings=512, tie_word_embeddings=False)
MOE = dict(model_type="qwen3_moe", hidden_size=128, intermediate_size=344, moe_intermediate_size=64, num_experts=8,
           num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
           vocab_size=512, max_position_embeddings=512, tie_word_embeddings=False, decoder_sparse_step=1,
           mlp_only_layers=[], norm_topk_prob=True)
MODELS = {"llama": LLAMA, "moe": MOE}
B, S = 2, 64
#: (model, world size, reshard_after_forward, checkpointing, fp32 parameters + MixedPrecisionPolicy(bf16))
RUNS = [(m, ws, True, False, False) for m in MODELS for ws in (2, 4, 8)] + \
       [(m, 4, False, False, False) for m in MODELS] + [(m, 4, True, True, False) for m in MODELS] + \
       [("llama", 4, True, False, True)]


def _build(cfg, dtype):
    c = transformers.AutoConfig.for_model(**cfg)
    c._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(c).to(dtype)


def _maxima(tracker):
    """Each category's most bytes over every module's snapshots."""
    out = {}
    for _mod, stats in tracker.memory_tracking.items():
        for snaps in stats.snapshots.values():
            for snap in snaps:
                for per_dev in snap.values():
                    for k, v in per_dev.items():
                        k = str(k).split(".")[-1]
                        out[k] = max(out.get(k, 0), v)
    return out


def _steps(model, opt, tracker, ids, loss_fn=None):
    with tracker:
        for i in range(2):
            loss = model(input_ids=ids, labels=ids).loss if loss_fn is None else loss_fn(model, ids)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if i == 0:
                tracker.reset_mod_stats()


def _fsdp_run(name, ws, reshard, gc, amp, offload=False):
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=ws)
    try:
        model = _build(MODELS[name], torch.float32 if amp else torch.bfloat16)
        if gc:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        kw = dict(mesh=init_device_mesh("cpu", (ws,)), reshard_after_forward=reshard)
        if amp:
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        if offload:
            kw["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
        for layer in model.model.layers:
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        ids = torch.randint(0, 512, (B, S))
        tracker = FSDPMemTracker(model, opt)
        tracker.track_inputs((ids,))
        _steps(model, opt, tracker, ids)
        return _maxima(tracker)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def fsdp_runs():
    return {run: _fsdp_run(*run) for run in RUNS}


def _plan(name, ws, reshard, gc, amp):
    arch = load(MODELS[name])
    s = TrainingSetup(precision="amp_bf16" if amp else "bf16", gradient_checkpointing="full" if gc else "none")
    P = _params(arch, s)
    # AdamW keeps exp_avg and exp_avg_sq in the sharded parameter's dtype
    return fsdp.fsdp2_plan(fsdp.units(arch, P), ws, param_dtype_bytes=2.0, reduce_dtype_bytes=2.0,
                           state_bytes_per_elem=8.0 if amp else 4.0, reshard_after_forward=reshard,
                           checkpointing=gc)


@pytest.mark.parametrize("run", RUNS, ids=lambda r: f"{r[0]}-ws{r[1]}-reshard{int(r[2])}-gc{int(r[3])}-mp{int(r[4])}")
def test_fsdp2_per_rank_categories_match_the_plan(fsdp_runs, run):
    """Every FSDP category within 1% of the plan: sharded parameters (padded dim-0 chunks),
    unsharded parameters (root + the running block, or every block without
    reshard_after_forward), the all-gather output kept until the next one (two under
    checkpointing), sharded and unsharded gradients, the reduce-scatter input, the optimizer
    states (the tracker also counts AdamW's 4-byte step scalars: 4 B x parameters)."""
    got = fsdp_runs[run]
    plan = _plan(*run).categories()
    for cat, want in plan.items():
        assert got[cat] == pytest.approx(want, rel=0.01, abs=1), (cat, got[cat], want)


def test_activations_are_the_single_gpu_steps(fsdp_runs):
    """FSDP leaves the activations alone: each rank's activation peak is the estimator's
    single-GPU forward (activations + logits and loss) of the same model, within 1% (Llama;
    without checkpointing: under checkpointing the tracker files the recomputed block's
    tensors as temporaries)."""
    est = vw.estimate(LLAMA, batch_size=B, seq_len=S, precision="bf16")
    f = est.component_bytes("forward")
    want = f["activations"] + f["logits and loss"]
    for run, got in fsdp_runs.items():
        if run[0] == "llama" and not run[3]:
            assert got["ACT"] == pytest.approx(want, rel=0.01), run
    # and the same at every world size and resharding choice
    acts = {run: got["ACT"] for run, got in fsdp_runs.items() if not run[3]}
    for name in MODELS:
        assert len({v for run, v in acts.items() if run[0] == name}) == 1


def test_moe_activations_within_one_percent(fsdp_runs):
    """The small Qwen3-MoE's activations at the tracker's peak, every world size and resharding
    choice.  Was a strict xfail at -1.25% (2,348,544 against 2,378,332 B): the MoE block left
    out 76 B per token and layer of router and grouped_mm bookkeeping (top-k indices, the
    norm_topk_prob division's values and sum, perm // k, perm and inv_perm), now in
    activations.moe."""
    est = vw.estimate(MOE, batch_size=B, seq_len=S, precision="bf16")
    f = est.component_bytes("forward")
    for run, got in fsdp_runs.items():
        if run[0] == "moe" and not run[3]:
            assert got["ACT"] == pytest.approx(f["activations"] + f["logits and loss"], rel=0.01), run


def test_cpu_offload_moves_nothing_on_a_cpu_mesh(fsdp_runs):
    """CPUOffloadPolicy on a CPU mesh: the offload target is the compute device, so the tracker
    sees exactly the run without offload; the plan's host/GPU split needs a CUDA device."""
    off = _fsdp_run("llama", 4, True, False, False, offload=True)
    assert off == fsdp_runs[("llama", 4, True, False, False)]
    plan = fsdp.fsdp2_plan(fsdp.units(load(LLAMA), _params(load(LLAMA), TrainingSetup())), 4,
                           param_dtype_bytes=2.0, reduce_dtype_bytes=2.0, state_bytes_per_elem=4.0, offload=True)
    assert plan.on_host["sharded parameters"] == off["SHARDED_PARAM"]
    assert plan.on_host["optimizer states"] == pytest.approx(off["OPT"], rel=0.01)


def test_the_estimate_carries_the_fsdp2_plan():
    """estimate_parallel(..., fsdp_version=2) puts the plan's gathered units, gradients and
    reduce-scatter input into the per-GPU model states."""
    pe = vw.estimate_parallel(LLAMA, strategy="fsdp_full_shard", num_gpus=4, fsdp_version=2, batch_size=B, seq_len=S)
    plan = _plan("llama", 4, True, False, False)
    ms = pe.model_states
    assert ms["gathered parameters"] == plan.unsharded_params + plan.all_gather
    assert ms["gathered gradients"] == plan.unsharded_grads
    assert ms["reduce-scatter buffers"] == plan.reduce_scatter
    assert ms["weights"] == plan.sharded_params
    flat = vw.estimate_parallel(LLAMA, strategy="fsdp_full_shard", num_gpus=4, fsdp_version=2, batch_size=B, seq_len=S,
                                reshard_after_forward=False)
    assert flat.model_states["gathered parameters"] > ms["gathered parameters"]


# ---------------------------------------------------------------------------------------
# Tensor parallel (DTensor) on the CPU
# ---------------------------------------------------------------------------------------

#: multi-head attention, so that 8 ranks split 8 KV heads
TP_LLAMA = dict(LLAMA, num_attention_heads=8, num_key_value_heads=8)


def _tp_run(tp):
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, loss_parallel,
                                                   parallelize_module)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    try:
        mesh = init_device_mesh("cpu", (tp,))
        model = _build(TP_LLAMA, torch.bfloat16)
        # Megatron's split: q/k/v and gate/up by columns, o and down by rows, the embedding
        # and the head by vocabulary rows, the loss on the vocabulary-parallel logits
        plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
                "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel()}
        for layer in model.model.layers:
            parallelize_module(layer, mesh, plan)
        parallelize_module(model, mesh, {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
                                         "lm_head": ColwiseParallel(output_layouts=Shard(-1),
                                                                    use_local_output=False)})
        # foreach=False: the replicated norm weights are plain tensors beside the DTensors
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
        ids = torch.randint(0, 512, (B, S))
        tracker = MemTracker()
        tracker.track_external(model, opt, ids)

        def loss_fn(m, x):
            logits = m(input_ids=x).logits
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), x.flatten(0, 1))

        with loss_parallel():
            _steps(model, opt, tracker, ids, loss_fn)
        return _maxima(tracker)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tensor_parallel_per_rank_model_states(tp):
    """Each rank's parameters and optimizer states are the estimator's tensor-parallel slice
    (parallel.stage_slice: heads, MLP width and vocabulary over t; norms whole), byte for byte
    within 1%.  Gradients: the slice's, plus the vocabulary-parallel embedding's gradient,
    which DTensor's RowwiseParallel embedding keeps replicated (V x h on every rank at the end
    of the backward; Megatron's VocabParallelEmbedding keeps its own rows)."""
    got = _tp_run(tp)
    pe = vw.estimate_parallel(TP_LLAMA, strategy="none", num_gpus=tp, tensor_parallel=tp, batch_size=B, seq_len=S)
    o = pe.per_gpu.component_bytes("optimizer_step")
    assert got["PARAM"] == pytest.approx(o["weights"], rel=0.01)
    assert got["OPT"] == pytest.approx(o["optimizer states"], rel=0.01)
    V, h = TP_LLAMA["vocab_size"], TP_LLAMA["hidden_size"]
    assert got["GRAD"] == pytest.approx(o["gradients"] + V * h * 2 * (1 - 1 / tp), rel=0.01)
