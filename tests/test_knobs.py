"""The knobs people turn to make a run fit (issue 12): each mechanism pinned by a number
derived by hand here, invariants with hypothesis, and other projects' published figures.

Sources of the mechanisms are cited in vramwidget/plan/loss.py (the losses),
vramwidget/plan/blocks.py (activation offloading), vramwidget/plan/step.py (optimizer in
backward), vramwidget/model/activations.py (bitsandbytes < 0.43.2) and vramwidget/stacks.py.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import vramwidget as vw
from vramwidget import VramError, estimate
from vramwidget.model.architecture import load
from vramwidget.plan import plan_view
from vramwidget.training import CHOICES, TrainingSetup
from vramwidget.units import GIB


def loss_nodes(est, phase="forward"):
    """The output head's and the loss's tensors live at the phase's peak, by name (a name's
    chunks summed)."""
    node = next(n for n in est.phase_components[phase] if n.name == "logits and loss")
    return {leaf.name: leaf.bytes for _, leaf in node.leaves()}


# -- loss ---------------------------------------------------------------------------------

def test_liger_keeps_no_logits(monkeypatch):
    """Liger's fused linear cross-entropy on Llama 3.1 8B at 4 x 2048 (T = 8192, h = 4096,
    V = 128,256): the head input's gradient T x h x 2 B, one chunk of rows x V x 2 B with
    rows = next_pow2(ceil(8192 / ceil(128256 / 4096))) = next_pow2(8192 / 32) = 256, and a fp32
    loss per token; no T x V tensor at all."""
    kw = dict(method="lora", batch_size=4, seq_len=2048, gradient_checkpointing="full", loss="liger")
    est = estimate("llama-3.1-8b", **kw)
    got = plan_view(load("llama-3.1-8b"), TrainingSetup.from_kwargs(**kw)).tensors("logits and loss")
    T, h, V = 8192, 4096, 128256
    assert set(got["gradient of the head's input (Liger, kept)"]) == {T * h * 2}
    # 8192 / 256 = 32 chunks of 256 rows in every step; the plan writes the first
    # (loss.LIGER_CHUNKS_WRITTEN: each later one is served from the block it freed), and
    # all 32 where told to
    assert set(got["logits of one chunk of rows (Liger)"]) == {256 * V * 2}
    assert len(got["logits of one chunk of rows (Liger)"]) == 3
    from vramwidget.plan import loss as plan_loss
    from vramwidget.plan.step import build_plan

    monkeypatch.setattr(plan_loss, "LIGER_CHUNKS_WRITTEN", 10 ** 6)
    every = [e for e in build_plan(load("llama-3.1-8b"), TrainingSetup.from_kwargs(**kw)).events
             if e[0] == "alloc" and e[3] == "logits of one chunk of rows (Liger)"]
    assert len(every) == 3 * 32 and {int(e[2]) for e in every} == {256 * V * 2}
    monkeypatch.undo()
    assert set(got["per-token loss (fp32)"]) == {T * 4}
    assert not any(n >= T * V for sizes in got.values() for n in sizes)
    std = estimate("llama-3.1-8b", method="lora", batch_size=4, seq_len=2048, gradient_checkpointing="full")
    # most of the standard loss's 3 fp32 T x V backward tensors (12.6 GB) are gone
    assert std.peak_allocated_bytes - est.peak_allocated_bytes > 9e9


def test_chunked_loss_upcasts_one_chunk():
    """torchtune's CEWithChunkedOutputLoss with 8 chunks: the fp32 upcast is T/8 x V x 4 B; every
    chunk's log_softmax output is still saved (T x V x 4 B); backward needs one chunk's two
    gradients (2 x T/8 x V x 4 B) beside the saved outputs."""
    est = estimate("llama-3.1-8b", batch_size=4, seq_len=2048, gradient_checkpointing="full", loss="chunked",
                   loss_chunks=8)
    TV = 4 * 2048 * 128256
    f = loss_nodes(est)
    assert f["logits upcast to fp32"] == TV * 4 / 8
    assert f["log_softmax output (fp32)"] == TV * 4
    assert f["logits"] == TV * 2


def test_compiled_loss_keeps_input_and_logsumexp():
    """compile=True (torchtune compiles the loss): one fused kernel keeps its input and a fp32
    logsumexp per row; backward: the kept logits + one chunk's gradient in their dtype."""
    est = estimate("llama-3.2-3b", batch_size=2, seq_len=4096, gradient_checkpointing="full", loss="chunked",
                   compile=True)
    T, V = 8192, 128256
    f = loss_nodes(est)
    assert f == {"logits": T * V * 2, "per-row logsumexp (fused cross-entropy)": T * 4}


def test_old_transformers_logits():
    """transformers < 4.46: LlamaForCausalLM returns lm_head(h).float() (fp32 logits held, the
    bf16 ones transient) and the loss copies the shifted logits (.contiguous()); 4.46-4.48 the
    loss upcasts and copies; 4.49 (PR #35646) shifts the labels instead."""
    kw = dict(batch_size=1, seq_len=1024, gradient_checkpointing="full")
    TV = 1024 * 32000
    new = loss_nodes(estimate("llama-2-7b", **kw))
    mid = loss_nodes(estimate("llama-2-7b", versions={"transformers": "4.47.1"}, **kw))
    old = loss_nodes(estimate("llama-2-7b", versions={"transformers": "4.40"}, **kw))
    assert sum(new.values()) == TV * (2 + 4 + 4)
    assert sum(mid.values()) == TV * (2 + 4 + 4 + 4)
    assert old == {"logits upcast to fp32 in the model": TV * 4, "shifted logits copy (fp32)": TV * 4,
                   "log_softmax output (fp32)": TV * 4}


def test_litgpt_loss_runs_in_bf16():
    """LitGPT's chunked_cross_entropy (128-token chunks, no upcast): bf16 logits and bf16
    log_softmax outputs; 1304 tokens -> 11 chunks."""
    est = estimate("llama-2-7b", stack="litgpt", method="lora", seq_len=1304)
    assert est.setup["loss_chunks"] == 11
    f = loss_nodes(est)
    # the chunks are T / 11 tokens each here (LitGPT's are 128 tokens and a last one of 24):
    # the sums are the whole T x V to within a byte per chunk
    assert set(f) == {"logits", "log_softmax output"}
    assert f["logits"] == pytest.approx(1304 * 32000 * 2, abs=11)
    assert f["log_softmax output"] == pytest.approx(1304 * 32000 * 2, abs=11)


# -- versions -------------------------------------------------------------------------------

def test_old_bitsandbytes_keeps_4bit_matmul_inputs():
    """bitsandbytes < 0.43.2 (before "fix QLoRA mem bug", PR #1270): every 4-bit matmul whose
    input needs a gradient keeps that input.  Llama 2 7B QLoRA, no checkpointing: blocks 2-32
    keep the input_layernorm output (T x h), the post_attention_layernorm output (T x h) and
    down_proj's input (T x i) in bf16; block 1's first norm output needs no gradient (a frozen
    embedding feeds it), its o_proj input is the attention output SDPA keeps anyway."""
    T, h, i = 512, 4096, 11008
    kw = dict(method="qlora", gradient_checkpointing="none", seq_len=T, lora_targets=("q_proj", "v_proj"))
    new = estimate("llama-2-7b", **kw).phases_bytes["forward"]
    old = estimate("llama-2-7b", versions={"bitsandbytes": "0.41.1"}, **kw).phases_bytes["forward"]
    assert old - new == 31 * T * (2 * h + i) * 2 + T * (h + i) * 2
    fixed = estimate("llama-2-7b", versions={"bitsandbytes": "0.43.2"}, **kw).phases_bytes["forward"]
    assert fixed == new


def test_old_peft_keeps_adapters_in_the_base_dtype():
    """peft < 0.11 created LoRA weights in the base layer's dtype (autocast_adapter_dtype, which
    keeps them in fp32, came with peft PR #1706 in 0.11): Llama 3.2 1B all-linear r=16 adapters
    (11,272,192 values) at 2 B instead of 4 B, and no fp32 copy of each adapted input."""
    kw = dict(method="lora", seq_len=512, gradient_checkpointing="full")
    new = estimate("llama-3.2-1b", **kw)
    old = estimate("llama-3.2-1b", versions={"peft": "0.10.0"}, **kw)
    a_new = new.component_bytes("after_load")["adapters"]
    a_old = old.component_bytes("after_load")["adapters"]
    assert (a_new, a_old) == (11_272_192 * 4, 11_272_192 * 2)
    assert old.phases_bytes["forward"] < new.phases_bytes["forward"]
    q = estimate("llama-3.2-1b", method="qlora", versions={"peft": "0.10.0"}, seq_len=512)
    assert q.component_bytes("after_load")["adapters"] == 11_272_192 * 4


def test_versions_note_and_errors():
    est = estimate("llama-3.2-1b", versions={"bitsandbytes": "0.41.1"})
    assert any("bitsandbytes 0.41.1" in n and "current releases of transformers" in n for n in est.notes)
    with pytest.raises(VramError, match="versions: unknown package 'vllm'"):
        estimate("llama-3.2-1b", versions={"vllm": "0.5"})
    with pytest.raises(VramError, match="versions: 'new'"):
        estimate("llama-3.2-1b", versions={"peft": "new"})
    assert TrainingSetup.from_kwargs(versions={"bitsandbytes": "0.44.0rc1"}).before("bitsandbytes", "0.44.1")


# -- offloading and optimizer in backward ---------------------------------------------------

def test_offloading_stash_holds_the_newest_packs():
    """torchtune OffloadActivations (max_fwd_stash_size 5) with full checkpointing: the GPU
    copies of the 5 newest pack ids stay in the forward stash.  Each checkpointed layer packs
    two (torch.utils.checkpoint's empty placeholder and the layer input, T x h x 2 B); the
    final RMSNorm packs its fp32 input and its rsqrt twice each (pow and the product keep the
    input; rsqrt and the product keep rsqrt) and, when its weight trains, the normalised
    tensor.  Full fine-tuning of Llama 3.2 3B: 5 norm packs, no layer input left in the stash,
    all 28 go to the CPU; LoRA: 4 norm packs, the last layer's input stays, 27 go."""
    T, h = 8192, 3072
    kw = dict(batch_size=2, seq_len=4096, gradient_checkpointing="full")
    for method, moved in (("full", 28), ("lora", 27)):
        on = estimate("llama-3.2-3b", method=method, activation_offloading=True, **kw)
        off = estimate("llama-3.2-3b", method=method, **kw)
        assert off.phases_bytes["forward"] - on.phases_bytes["forward"] == moved * T * h * 2, method
        assert any("offloading keeps" in n for n in on.notes)
    from vramwidget.plan.params import param_storage
    from vramwidget.plan.profile import activations_at
    arch = load("llama-3.2-3b")
    for method, packs in (("full", 5), ("lora", 4)):
        s = TrainingSetup.from_kwargs(method=method, **kw)
        assert activations_at(arch, s, param_storage(arch, s)).head_packs == packs


def test_optimizer_in_backward_frees_gradients():
    """torchtune optimizer_in_bwd: one gradient at a time.  Llama 3.2 1B full fine-tune with
    fused AdamW: the optimizer step no longer holds every gradient (2 B x 1,235,814,400);
    at most the largest parameter's gradient (the tied embedding, 128,256 x 2048 x 2 B)."""
    kw = dict(gradient_checkpointing="full", optimizer="adamw_fused")
    a = estimate("llama-3.2-1b", **kw)
    b = estimate("llama-3.2-1b", optimizer_in_backward=True, **kw)
    assert a.phases_bytes["optimizer_step"] - a.phases_bytes["persistent"] == 2 * 1_235_814_400
    # every parameter has stepped in backward: the optimizer step holds nothing more, and the
    # backward's peak holds one gradient at most (the largest: the tied embedding)
    assert b.phases_bytes["optimizer_step"] == b.phases_bytes["persistent"]
    assert b.component_bytes("backward").get("gradients", 0.0) <= 128256 * 2048 * 2
    with pytest.raises(VramError, match="optimizer_in_backward"):
        estimate("llama-3.2-1b", optimizer_in_backward=True, grad_accum_steps=4)


def test_compile_refused_without_checkpointing():
    with pytest.raises(VramError, match="compile: without full activation checkpointing"):
        estimate("llama-3.2-1b", compile=True)


def test_dora_magnitude_and_weight_norm_working_set():
    """DoRA (peft tuners/lora/dora.py): one magnitude value per output feature of each adapted
    module (Llama 3.2 1B all-linear: 16 x (2048 + 512 + 512 + 2048 + 8192 + 8192 + 2048) =
    374,784 more trainable parameters than LoRA); while a module runs, its weight norm needs
    eye(in) + in x r + 4 x out x in in fp32: the largest is down_proj (in 8192, out 2048)."""
    lora = estimate("llama-3.2-1b", method="lora", seq_len=256, gradient_checkpointing="full")
    dora = estimate("llama-3.2-1b", method="lora", lora_variant="dora", seq_len=256, gradient_checkpointing="full")
    assert dora.params_trainable - lora.params_trainable == 16 * (2048 + 512 + 512 + 2048 + 8192 + 8192 + 2048)
    from vramwidget.plan.params import param_storage
    from vramwidget.plan.profile import dora_norm_bytes
    arch = load("llama-3.2-1b")
    s = TrainingSetup.from_kwargs(method="lora", lora_variant="dora")
    assert dora_norm_bytes(arch, s, param_storage(arch, s)) == (8192 * 8192 + 8192 * 16 + 4 * 2048 * 8192) * 4


def test_modules_to_save_trains_a_full_copy():
    """peft ModulesToSaveWrapper: the head stays frozen and a bf16 copy (V x h, untied from the
    embedding) trains beside the adapters: + V x h x 2 B of weights, gradients and (AdamW, bf16)
    2 x V x h x 2 B of moments."""
    kw = dict(method="lora", seq_len=256, gradient_checkpointing="full", optimizer="adamw_fused")
    a = estimate("llama-3.2-1b", **kw)
    b = estimate("llama-3.2-1b", modules_to_save=["lm_head"], **kw)
    Vh = 128256 * 2048
    assert b.phases_bytes["after_load"] - a.phases_bytes["after_load"] == Vh * 2
    assert b.phases_bytes["persistent"] - a.phases_bytes["persistent"] == Vh * 2 * 3
    assert b.params_trainable - a.params_trainable == Vh


def test_norms_only_tuning():
    """method='norms': the 2 x 16 + 1 RMSNorm weights of Llama 3.2 1B (67,584 values) train;
    gradients still flow through every frozen matmul."""
    est = estimate("llama-3.2-1b", method="norms", seq_len=256)
    assert est.params_trainable == 33 * 2048
    assert est.component_bytes("forward")["activations"] > 0


def test_galore_states():
    """GaLore AdamW, rank 128, Llama 3.2 1B in bf16: each block weight (m x n) keeps two bf16
    moments of 128 x max(m, n) and a 128 x min(m, n) projection; the tied embedding keeps two
    full moments."""
    est = estimate("llama-3.2-1b", optimizer="galore_adamw", galore_rank=128, gradient_checkpointing="full",
                   seq_len=256)
    arch = load("llama-3.2-1b")
    want = 0
    for t in arch.tensors:
        if t.linear and len(t.shape) == 2:
            m, n = t.shape
            want += (2 * 128 * max(m, n) + 128 * min(m, n)) * 2 * t.repeat
        else:
            want += 2 * t.numel * 2
    assert est.component_bytes("optimizer_step")["optimizer states"] == want
    eight = estimate("llama-3.2-1b", optimizer="galore_adamw_8bit", gradient_checkpointing="full", seq_len=256)
    assert eight.component_bytes("optimizer_step")["optimizer states"] < want * 0.6
    with pytest.raises(VramError, match="optimizer: GaLore"):
        estimate("llama-3.2-1b", method="lora", optimizer="galore_adamw")


def test_packing_needs_a_varlen_kernel():
    """Packed rows (no padding) keep the same per-token tensors as FlashAttention on a full
    row; HF's padding-free path needs flash_attention_2; torchtune runs packed batches through
    flex attention."""
    kw = dict(method="lora", batch_size=2, seq_len=2048, attn_implementation="flash_attention_2")
    assert estimate("llama-3.2-1b", packing=True, **kw).peak_allocated_bytes == \
        estimate("llama-3.2-1b", **kw).peak_allocated_bytes
    with pytest.raises(VramError, match="packing: .*flash_attention_2"):
        estimate("llama-3.2-1b", packing=True, method="lora")
    estimate("llama-3.2-1b", packing=True, stack="torchtune", method="lora")


def test_liger_refuses_a_lora_on_the_head():
    with pytest.raises(VramError, match="loss: Liger"):
        estimate("llama-3.2-1b", method="lora", loss="liger", lora_targets=["q_proj", "lm_head"])


def test_knob_choices_and_bad_values():
    assert [c for c, _ in CHOICES["loss"]] == ["standard", "chunked", "liger"]
    assert "norms" in [c for c, _ in CHOICES["method"]]
    assert {"galore_adamw", "galore_adamw_8bit"} <= {c for c, _ in CHOICES["optimizer"]}
    with pytest.raises(VramError, match="loss: 'fused'"):
        estimate("llama-3.2-1b", loss="fused")
    with pytest.raises(VramError, match="modules_to_save: 'score'"):
        estimate("llama-3.2-1b", method="lora", modules_to_save=["score"])
    with pytest.raises(VramError, match="activation_offloading: must be true or false"):
        estimate("llama-3.2-1b", activation_offloading="yes")
    with pytest.raises(VramError, match="stack: 'deepspeed'"):
        estimate("llama-3.2-1b", stack="deepspeed")


# -- stacks ---------------------------------------------------------------------------------

def test_stack_defaults_and_user_wins():
    """LitGPT finetune/lora.py: r=8, alpha=16, dropout 0.05, query and value; adapters in bf16
    (4,194,304 trainable parameters on Llama 2 7B, LitGPT's resource table); the user's r wins."""
    est = estimate("llama-2-7b", stack="litgpt", method="lora", seq_len=512)
    assert est.params_trainable == 4_194_304
    assert est.setup["lora_r"] == 8 and est.setup["lora_dropout"] == 0.05
    ad = next(n for n in est.phase_components["after_load"] if n.name == "adapters")
    assert ad.bytes == 4_194_304 * 2
    assert estimate("llama-2-7b", stack="litgpt", method="lora", lora_r=16, seq_len=512).setup["lora_r"] == 16
    assert estimate("llama-3.2-1b", stack="torchtune").setup["optimizer"] == "adamw_fused"


# -- invariants -----------------------------------------------------------------------------

setups = st.fixed_dictionaries({
    "model": st.sampled_from(["llama-3.2-1b", "qwen2.5-0.5b", "gpt2", "gemma-2-2b", "olmoe-1b-7b", "phi-3-mini"]),
    "method": st.sampled_from(["full", "lora", "qlora"]),
    "precision": st.sampled_from(["bf16", "amp_bf16", "fp32"]),
    "gradient_checkpointing": st.sampled_from(["none", "selective", "full"]),
    "batch_size": st.integers(1, 8),
    "seq_len": st.integers(1, 4096),
    "stack": st.sampled_from(["hf", "torchtune", "litgpt", "axolotl"]),
    # one "chunk" is no chunking: torchtune's in-model upcast then holds less (fp32 only)
    "loss_chunks": st.integers(2, 32),
})


def run(d, **over):
    d = dict(d, **over)
    model = d.pop("model")
    if d["method"] == "qlora":
        d["precision"] = "bf16"
    if d["stack"] == "litgpt" and model in ("gpt2", "phi-3-mini"):
        d["lora_targets"] = "all-linear"   # LitGPT's default q/v names are Llama's
    return estimate(model, **d)


@settings(max_examples=50, deadline=None)
@given(setups, st.sampled_from(["chunked", "liger"]))
def test_chunked_and_liger_never_need_more_than_standard(d, loss):
    """Up to one gradient of the head's input more: a chunked loss's backward runs each chunk's
    matmul, so the chunks' gradients of the hidden states (T/n x h each) live until autograd's
    SplitBackward joins them into one T x h gradient, while the standard loss makes that
    gradient in one matmul; where the step peaks at the loss backward (a tied head in full
    fine-tuning: its gradient summed chunk by chunk, 2 x V x h) this shows.  Bounded by the
    hidden-state gradient in fp32 plus a 512-byte block per chunk (llama-3.2-1b full amp_bf16,
    torchtune, 2 x 279 tokens, 19 chunks: +2,718,720 B of 20.9 GB, under 558 x 2,048 x 4 B).
    A tied head trained in full is used once per chunk, so autograd's input buffer holds the
    gradient accumulated so far beside the next chunk's (torch/csrc/autograd/input_buffer.cpp
    ``accumulate``: old + new, then in place): one more V x h gradient while the chunked
    backward runs, which the standard loss's single matmul never holds; for a short sequence
    its peak at the loss backward can pass the standard loss's at the end of the backward
    (llama-3.2-1b full amp_bf16 torchtune, 1 x 559, 19 chunks: +5,261,824 B)."""
    fused, standard = run(d, loss=loss), run(d, loss="standard")
    tokens = d["batch_size"] * d["seq_len"]
    arch = load(d["model"])
    slack = tokens * arch.hidden_size * 4 + d["loss_chunks"] * 512
    if loss == "chunked" and arch.tie_word_embeddings and d["method"] == "full":
        slack += arch.vocab_size * arch.hidden_size * 4
    assert fused.peak_allocated_bytes <= standard.peak_allocated_bytes + slack


@settings(max_examples=120, deadline=None)
@given(setups)
def test_offloading_never_needs_more(d):
    assert run(d, activation_offloading=True).peak_allocated_bytes <= run(d).peak_allocated_bytes


# -- published figures ------------------------------------------------------------------------

TT = dict(stack="torchtune", batch_size=2, seq_len=4096)   # packed to 4096, batch 2 (8,192 tokens)
TT_LORA = dict(lora_r=64, lora_alpha=128, lora_targets=("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                        "down_proj"))
AC = dict(compile=True, loss="chunked", gradient_checkpointing="full")


@pytest.mark.parametrize("row,published_gib,kw", [
    ("+ Packed Dataset", 60.0, dict(method="full")),
    ("+ Activation Checkpointing", 24.9, dict(method="full", **AC)),
    ("+ Fuse optimizer step into backward", 23.1, dict(method="full", optimizer_in_backward=True, **AC)),
    ("+ Activation Offloading", 21.8, dict(method="full", optimizer_in_backward=True, activation_offloading=True,
                                           **AC)),
    ("LoRA", 8.5, dict(method="lora", activation_offloading=True, **TT_LORA, **AC)),
    ("QLoRA", 4.6, dict(method="qlora", activation_offloading=True, **TT_LORA, **AC)),
])
def test_torchtune_readme_optimization_flags(row, published_gib, kw):
    """torchtune README.md, "Optimization flags" (added in PR #2003, Nov 2024): Llama 3.2 3B,
    full_finetune_single_device, batch 2, max seq len 4096, bf16, A100, "Peak Memory Active
    (GiB)"; each technique added on top of the previous one (LoRA and QLoRA without
    optimizer_in_bwd or 8-bit AdamW).  AdamW is torch.optim.AdamW with fused: True, as in
    torchtune's configs of that commit (recipes/configs/llama3_2/3B_full.yaml,
    3B_lora_single_device.yaml); LoRA: the config's rank 64, alpha 128 on q, v, output_proj
    and the MLP; QLoRA: the same on a torchao NF4 base (3B_qlora_single_device.yaml).  The
    LoRA rows peak in the loss's backward: every bf16 logits chunk (1.96 GiB) beside the
    persistent state; the offload stash holds the final norm's tensors and the last layer's
    input (estimate._offload).  The "+ Compile" and "+ Chunked Cross Entropy" rows (no
    checkpointing) are refused: compile without checkpointing is not modelled.  "+ 8-bit
    AdamW" is test_torchtune_readme_8bit_adamw."""
    est = estimate("llama-3.2-3b", **TT, **kw)
    assert est.peak_allocated_bytes / GIB == pytest.approx(published_gib, rel=0.10), row


@pytest.mark.xfail(strict=True, reason=(
    "torchtune README '+ 8-bit AdamW' 17.6 GiB does not name the optimizer class.  The recipe "
    "config's default (llama3_2/3B_full_single_device.yaml) is bitsandbytes PagedAdamW8bit, whose "
    "states come from cudaMallocManaged (bitsandbytes get_paged) outside PyTorch's allocator, so "
    "'Peak Memory Active' would not count them: about 8.4 GiB.  bitsandbytes AdamW8bit (in-place "
    "blockwise kernel): 14.5 GiB, -17%.  torchao AdamW8bit (the docs' other suggestion) steps each "
    "parameter in a torch.compile'd single_param_adam; inductor's CPU code (torch 2.13, torchao "
    "0.7.0) materialises the updated exp_avg and exp_avg_sq in fp32, 2 x 4 B per value of the "
    "parameter being stepped (+2.9 GiB for the tied embedding, stepped last): about 15.8 GiB, "
    "-10%, but what the CUDA build materialises is not verified here."))
def test_torchtune_readme_8bit_adamw():
    """torchtune README "+ 8-bit AdamW" (17.6 GiB), on top of optimizer_in_bwd and activation
    offloading; estimated with bitsandbytes AdamW8bit's states (1 B + fp32 absmax per 256)."""
    est = estimate("llama-3.2-3b", method="full", optimizer="adamw_8bit", optimizer_in_backward=True,
                   activation_offloading=True, **TT, **AC)
    assert est.peak_allocated_bytes / GIB == pytest.approx(17.6, rel=0.10)


@pytest.mark.parametrize("model,micro_batch,quantize,published_gb", [
    ("llama-2-7b", 1, None, 21.30), ("llama-2-13b", 1, None, 38.12), ("llama-2-7b", 2, None, 29.07),
    ("llama-2-7b", 1, "bnb.nf4", 14.14), ("llama-2-7b", 1, "bnb.nf4-dq", 13.84),
    ("llama-2-13b", 1, "bnb.nf4", 23.14), ("llama-2-13b", 1, "bnb.nf4-dq", 22.55)])
def test_litgpt_resource_tables_lora(model, micro_batch, quantize, published_gb):
    """LitGPT tutorials/resource-tables.md (10/20/2023, commit 8641822, A100-SXM4-40GB, PyTorch
    2.1.0, bitsandbytes 0.41.1, --precision bf16-true, finetune/lora.py, Alpaca: the longest
    Llama 2 sample is 1304 tokens and LitGPT runs it first), "Max GPU RAM" =
    max_memory_allocated()/1e9.  --quantize goes through Lightning's BitsandbytesPrecision:
    every nn.Linear (lm_head too) becomes a Linear4bit, "bnb.nf4" without and "bnb.nf4-dq"
    with double quantization; bitsandbytes 0.41.1's 4-bit matmuls keep their inputs.
    LoRAQKVLinear.zero_pad's index_copy keeps the q and v LoRA outputs (activations.linear).
    Caveat: at commit 8641822 LitGPT's RMSNorm ran in bf16 (the fp32 upcast came four days
    later, Lightning-AI/litgpt PR #606); the litgpt stack models today's fp32 norms, 2 x T x h
    x 2 B per layer more.  With bf16 norms the estimate would miss micro-batch 2 (-11%) and
    the 4-bit rows (-13% to -15%): about 0.5 MB per token at 7B is not explained."""
    kw = {} if quantize is None else dict(method="qlora", double_quant=quantize.endswith("-dq"))
    est = estimate(model, **{"stack": "litgpt", "method": "lora", "batch_size": micro_batch, "seq_len": 1304,
                             "versions": {"bitsandbytes": "0.41.1"}, **kw})
    assert est.peak_allocated_bytes / 1e9 == pytest.approx(published_gb, rel=0.10)


def test_litgpt_zero_pad_keeps_the_lora_output():
    """LitGPT LoRAQKVLinear with q and v adapted: zero_pad's index_copy keeps its source, the
    conv1d (lora_B) output, T x (4096 + 4096) x 2 B per block of Llama 2 7B; with q, k and v
    all adapted zero_pad returns its input and keeps nothing."""
    T = 512
    est = estimate("llama-2-7b", stack="litgpt", method="lora", seq_len=T, lora_dropout=0.0)
    acts = next(n for n in est.phase_components["forward"] if n.name == "activations")
    kept = {c.name: c.bytes for g in acts.children for c in g.children if "zero_pad" in c.name}
    n_saving = 32   # every block, the first too
    assert kept == {"qkv (fused LoRA) q_proj lora_B output (kept by zero_pad's index_copy)": n_saving * T * 4096 * 2,
                    "qkv (fused LoRA) v_proj lora_B output (kept by zero_pad's index_copy)": n_saving * T * 4096 * 2}
    qkv = estimate("llama-2-7b", stack="litgpt", method="lora", seq_len=T, lora_dropout=0.0,
                   lora_targets=("q_proj", "k_proj", "v_proj"))
    assert not any("zero_pad" in n for n in (c.name for g in next(
        n for n in qkv.phase_components["forward"] if n.name == "activations").children for c in g.children))


# -- multi-GPU QLoRA and communication buffers ---------------------------------------------

QLORA_70B = dict(method="qlora", batch_size=2, seq_len=2048, gradient_checkpointing="full",
                 attn_implementation="flash_attention_2", lora_r=8, lora_alpha=16, lora_dropout=0.1,
                 lora_targets="all-linear", grad_accum_steps=2)
#: what PEFT's FSDP/ZeRO-3 QLoRA docs ran (peft commit 6008f272a, 13 March 2024, peft
#: 0.9.1.dev0): examples/sft/requirements.txt installs transformers from git (4.39.0.dev0: the
#: bnb_4bit_quant_storage the docs use is new there; LlamaForCausalLM still returns fp32 logits)
#: and the latest bitsandbytes, 0.43.0 (its first release with FSDP-QLoRA's quant_storage;
#: 4-bit matmuls kept their inputs until 0.43.2)
PEFT_MARCH_2024 = {"transformers": "4.39", "bitsandbytes": "0.43.0", "peft": "0.9.1"}


@pytest.mark.parametrize("strategy", ["fsdp_full_shard", "zero3"])
@pytest.mark.parametrize("offload", [False, True])
def test_quant_state_stays_whole_on_every_gpu(strategy, offload):
    """bitsandbytes' QuantState is an attribute of Params4bit, not a parameter: FSDP and ZeRO-3
    shard only the packed storage and offload does not move the state.  Llama 2 70B NF4 with
    double quantization: 8 bits per 64 weights + one fp32 per 256 blocks, whole, on each GPU."""
    single = vw.estimate("llama-2-70b", **QLORA_70B)
    q1 = single.component_bytes("after_load")["quantization constants"]
    pe = vw.estimate_parallel("llama-2-70b", strategy=strategy, num_gpus=2, offload_params=offload, **QLORA_70B)
    assert pe.per_gpu.component_bytes("after_load")["quantization constants"] == q1
    linear = sum(t.numel for t in load("llama-2-70b").tensors if t.linear and not t.is_bias)
    assert q1 == pytest.approx(linear / 64 + linear / 64 / 256 * 4)
    assert pe.model_states["quantization constants + adapters"] >= q1


def test_nccl_buffers_from_their_configured_size():
    """NCCL_BUFFSIZE x 2 (send, receive) x channels per communicator: data parallel over 8
    GPUs with tensor parallel 2 is two communicators; NCCL_BUFFSIZE 8 MiB, 4 channels -> 128 MiB."""
    kw = dict(strategy="zero1", num_gpus=8, tensor_parallel=2, batch_size=1, seq_len=512)
    a = vw.estimate_parallel("llama-3.2-1b", **kw)
    b = vw.estimate_parallel("llama-3.2-1b", nccl_buffsize_mb=8, nccl_channels=4, **kw)
    assert a.model_states["NCCL buffers"] == 2 * 2 * 2 * 4 * 2**20
    assert b.model_states["NCCL buffers"] == 2 * 2 * 4 * 8 * 2**20
    assert b.per_gpu.phases_bytes["after_load"] - a.per_gpu.phases_bytes["after_load"] == (128 - 32) * 2**20
    assert "NCCL buffers" not in vw.estimate_parallel("llama-3.2-1b", batch_size=1, seq_len=512).model_states


def test_zero3_max_live_parameters_caps_the_gathered_set():
    """stage3_max_live_parameters caps what the coordinator prefetches (deepspeed
    partitioned_param_coordinator.py: ``min(max_live - available, prefetch_bucket_size)``);
    the module running is fetched whatever the cap (its 128256 x 4096 embedding here), and
    what stays gathered for reuse is not capped: tests/test_zero.py has each knob."""
    kw = dict(strategy="zero3", num_gpus=8, batch_size=1, seq_len=512)
    small = vw.estimate_parallel("llama-3.1-8b", max_live_parameters=10_000_000, zero_config={
        "stage3_max_reuse_distance": 0}, **kw).model_states
    assert small["prefetched parameters"] == 0
    assert small["gathered parameters"] == 128256 * 4096 * 2
    with pytest.raises(VramError, match="max_live_parameters"):
        vw.estimate_parallel("llama-3.1-8b", max_live_parameters=0, **kw)


@pytest.mark.parametrize("strategy,published_gb", [("fsdp_full_shard", 35.6), ("zero3", 36.6)])
def test_peft_docs_70b_qlora_on_two_gpus(strategy, published_gb):
    """PEFT docs/source/accelerate/fsdp.md ("When disabling CPU offloading, the GPU memory usage
    is 35.6 GB/GPU") and deepspeed.md ("the memory consumed per GPU is 36.6 GB"): Llama-2-70b,
    2 GPUs, examples/sft run_peft_qlora_fsdp.sh / run_peft_qlora_deepspeed_stage3.sh:
    per_device_train_batch_size 2, max_seq_len 2048 (packed), gradient checkpointing, flash
    attention 2, LoRA r 8 alpha 16 dropout 0.1 on all-linear, NF4 with nested quantization,
    bf16 storage, the libraries of March 2024 (PEFT_MARCH_2024).  Per GPU as nvidia-smi shows
    it: reserved + CUDA context.  Estimates: FSDP 32.5 GB (-8.8%), ZeRO-3 33.3 GB (-9.1%).  FSDP
    with fsdp_offload_params: test_peft_docs_70b_qlora_fsdp_cpu_offload."""
    pe = vw.estimate_parallel("llama-2-70b", strategy=strategy, num_gpus=2, versions=PEFT_MARCH_2024, **QLORA_70B)
    assert pe.device_total_bytes / 1e9 == pytest.approx(published_gb, rel=0.10)


@pytest.mark.xfail(strict=True, reason=(
    "PEFT docs/source/accelerate/fsdp.md: 19.6 GB per GPU with fsdp_offload_params "
    "(examples/sft/configs/fsdp_config_qlora.yaml, FSDP1, use_orig_params false); estimate 14.8 "
    "GB with the releases of March 2024, -24%.  The same setup "
    "without offload is reproduced (35.6 GB, estimate 32.5, -8.8%).  Published, offloading saved "
    "16.0 GB; the estimate saves 17.6 GB: the sharded NF4 storage it moves to the CPU (17.6 GB per "
    "GPU) and the shards' states and gradients, less the unit shard copied back for each all-gather "
    "(vramwidget.parallel.fsdp.fsdp1_plan: FlatParamHandle.pre_unshard).  What else FSDP1's CPU offload "
    "keeps on the GPU (about 3 GB here) is not identified from torch/distributed/fsdp/_flat_param.py "
    "or _runtime_utils.py, and the doc itself says 'GPU Memory saving when using CPU Offloading is "
    "untested' and does not say how memory was read."))
def test_peft_docs_70b_qlora_fsdp_cpu_offload():
    pe = vw.estimate_parallel("llama-2-70b", strategy="fsdp_full_shard", num_gpus=2, offload_params=True,
                              versions=PEFT_MARCH_2024, **QLORA_70B)
    assert pe.device_total_bytes / 1e9 == pytest.approx(19.6, rel=0.10)


@pytest.mark.parametrize("kw", [
    dict(method="lora", lora_variant="dora"), dict(method="lora", lora_targets=["q_proj", "lm_head", "embed_tokens"]),
    dict(method="lora", modules_to_save=["lm_head", "embed_tokens"]), dict(method="norms"),
    dict(optimizer="galore_adamw_8bit"), dict(stack="litgpt", method="qlora"), dict(stack="unsloth", method="lora"),
    dict(method="qlora", lora_variant="dora", gradient_checkpointing="full", compile=True, loss="chunked",
         activation_offloading=True)])
def test_every_knob_builds_a_whole_estimate(kw):
    """The component trees, the allocator's reserve and the parallel path take every knob."""
    est = estimate("llama-3.2-1b", seq_len=256, **kw)
    assert sum(n.bytes for n in est.phase_components[est.peak_phase]) == pytest.approx(est.peak_allocated_bytes)
    assert est.reserved_bytes >= est.peak_allocated_bytes
    pe = vw.estimate_parallel("llama-3.2-1b", strategy="fsdp_full_shard", num_gpus=2, seq_len=256, **kw)
    assert pe.per_gpu.peak_allocated_bytes <= est.peak_allocated_bytes + 2**30
