"""plan.step.state_floor_bytes: the lower bound the solvers pass a one-GPU setup over by
before its plan is written (fit.solver._Query.estimate), and plan.per_gpu.floor_bytes's
ZeRO gradient partition (the ``until_step`` buffers).

* it is never above the plan's allocated peak (random setups: models, methods, optimizers,
  precisions, stacks, the optimizer in backward, gradients kept between steps);
* it is exactly what the plan itself holds of the load and the optimizer states: the
  after-load level (less the cuBLAS workspaces, made before the load) plus the plan's own
  "optimizer states" boxes at the optimizer step (Llama 2 7B full fine-tune, AdamW);
* ZeRO-Offload's gradient partition counts in the per-GPU bound (Llama 2 7B full on one GPU:
  without it the bound was 13.8 GiB against a peak of 27.4, and the solvers wrote the plan).
"""

from hypothesis import given, settings
from hypothesis import strategies as st

import vramwidget as vw
from vramwidget.errors import VramError
from vramwidget.estimate import estimate_setup
from vramwidget.model.architecture import load
from vramwidget.parallel.estimate import giving_up_above
from vramwidget.plan.step import state_floor_bytes
from vramwidget.training import TrainingSetup
from vramwidget.units import GIB

MODELS = ["gpt2", "smollm2-135m", "qwen2.5-0.5b", "flan-t5-base", "olmoe-1b-7b"]


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(MODELS), st.sampled_from(["full", "lora", "qlora", "freeze"]),
       st.sampled_from(["adamw", "adamw_fused", "adamw_8bit", "sgd", "adafactor", "paged_adamw", "galore_adamw"]),
       st.sampled_from(["bf16", "fp32", "amp_bf16", "amp_fp16"]), st.booleans(), st.booleans(),
       st.sampled_from(["hf", "torchtune", "axolotl", "unsloth"]), st.sampled_from(["none", "full"]))
def test_the_floor_is_never_above_the_peak(model, method, optimizer, precision, in_backward, set_to_none, stack,
                                           ckpt):
    try:
        arch = load(model)
        s = TrainingSetup.from_kwargs(method=method, optimizer=optimizer, precision=precision,
                                      optimizer_in_backward=in_backward, zero_grad_set_to_none=set_to_none,
                                      stack=stack, gradient_checkpointing=ckpt, batch_size=2, seq_len=128)
        est = estimate_setup(arch, s)
    except VramError:
        return       # a combination the input contract refuses
    floor = state_floor_bytes(arch, s)
    assert 0 < floor <= est.peak_allocated_bytes, (model, s.to_dict(), floor - est.peak_allocated_bytes)
    # at least the model the load leaves, as requested (the after-load tree holds the cuBLAS
    # workspaces too, made before the load, and the allocator's rounding as a box of its own)
    loaded = sum(n.bytes for n in est.phase_components["after_load"]
                 if n.name != "workspace" and "rounding" not in n.name)
    assert floor >= loaded


def test_the_floor_is_the_plans_own_load_and_states():
    arch = load("llama-2-7b")
    s = TrainingSetup.from_kwargs(method="full", optimizer="adamw")
    est = estimate_setup(arch, s)
    states = sum(n.bytes for n in est.phase_components["optimizer_step"] if n.name == "optimizer states")
    # AdamW's two moments per trainable parameter (6,738,415,616 of them) in the parameters'
    # dtype (pure bf16 training): 4 B each
    assert states == 4 * est.params_trainable == 4 * 6_738_415_616
    floor = state_floor_bytes(arch, s)
    loaded = sum(n.bytes for n in est.phase_components["after_load"] if n.name != "workspace")
    assert floor == loaded + states
    assert floor / GIB > 24     # an RTX 4090 is ruled out without a plan (fit.suggestions' combinations)


def test_zero_offloads_gradient_partition_is_in_the_per_gpu_floor():
    floors = []
    with giving_up_above(lambda f: floors.append(f) or False):
        pe = vw.estimate_parallel("llama-2-7b", strategy="zero2", offload_optimizer=True, num_gpus=1,
                                  gradient_checkpointing="full", optimizer="adamw_8bit")
    peak = pe.per_gpu.peak_allocated_bytes
    partition = 2 * 6_738_415_616          # the bf16 gradient partition, every parameter on one GPU
    # the last bound is the one read from the slice's plan (one before it where no plan was
    # built yet: the slice's first forward, which ZeRO-2 keeps whole)
    assert all(f <= peak for f in floors)
    assert floors[-1] >= partition + 2 * 6_738_415_616 * 0.99   # weights + partition (was weights alone)


@settings(max_examples=15, deadline=None)
@given(st.sampled_from(MODELS + ["llama-3.2-1b"]), st.sampled_from(["full", "lora", "qlora"]),
       st.sampled_from(["adamw", "adamw_8bit", "adafactor"]), st.integers(1, 64), st.integers(1, 8192))
def test_the_floor_does_not_depend_on_the_sizes(model, method, optimizer, b, sq):
    """It is kept per setup shape (fit's bisections over the batch and the length ask for it
    at every size): written at another size, the load and the states are the same bytes."""
    from vramwidget.plan import step

    arch = load(model)
    try:
        s = TrainingSetup.from_kwargs(method=method, optimizer=optimizer, batch_size=b, seq_len=sq)
        other = s.replace(batch_size=1 + b % 7, seq_len=1 + (sq * 3) % 5000)
    except VramError:
        return
    step.clear_floors()
    first = state_floor_bytes(arch, s)
    step.clear_floors()
    assert state_floor_bytes(arch, other) == first


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(MODELS + ["llama-3.2-1b"]), st.sampled_from(["full", "lora", "qlora", "freeze"]),
       st.sampled_from(["adamw", "adamw_8bit", "sgd"]), st.sampled_from(["bf16", "fp32", "amp_bf16"]),
       st.sampled_from(["hf", "torchtune", "axolotl", "unsloth"]), st.sampled_from(["none", "selective", "full"]),
       st.sampled_from(["sdpa", "eager"]), st.booleans(), st.integers(1, 8), st.integers(16, 1024))
def test_the_forward_floor_is_the_plans_first_forward_and_never_above_the_peak(
        model, method, optimizer, precision, stack, ckpt, attn, offload, b, sq):
    """``step.forward_floor_bytes`` (what ``fit.suggestions`` passes a one-GPU combination over
    by): its events are the plan's own first events, key for key (``build_plan``'s
    prefix), its figure the most requested bytes live from step 1's forward on, and never
    above the plan's allocated peak."""
    from vramwidget.plan.step import build_plan, forward_floor_bytes, forward_prefix

    arch = load(model)
    try:
        s = TrainingSetup.from_kwargs(method=method, optimizer=optimizer, precision=precision, stack=stack,
                                      gradient_checkpointing=ckpt, attn_implementation=attn,
                                      activation_offloading=offload, batch_size=b, seq_len=sq)
        est = estimate_setup(arch, s)
    except VramError:
        return
    events, start = forward_prefix(arch, s)
    plan = build_plan(arch, s)
    assert events == plan.events[:len(events)], (model, s.to_dict())
    assert next(i for p, st_, i in plan.marks if p == "forward") == start
    floor = forward_floor_bytes(arch, s)
    assert 0 < floor <= est.peak_allocated_bytes, (model, s.to_dict(), floor - est.peak_allocated_bytes)


def test_the_forward_floor_rules_out_lora_on_llama_2_7b_without_checkpointing():
    """Llama 2 7B LoRA (r 16), no checkpointing, batch 1 x 4,096 (the defaults), on an RTX
    4090: the load (~12.6 GiB of bf16 weights) is under the card, the first forward's
    activations are not, so the combinations with it are passed over without their plans."""
    from vramwidget.plan.step import forward_floor_bytes

    arch = load("llama-2-7b")
    s = TrainingSetup.from_kwargs(method="lora", lora_r=16, gradient_checkpointing="none")
    est = estimate_setup(arch, s)
    floor = forward_floor_bytes(arch, s)
    assert state_floor_bytes(arch, s) / GIB < 14
    assert 24 < floor / GIB <= est.peak_allocated_bytes / GIB
