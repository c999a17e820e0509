"""Invariants over random setups (hypothesis), over every method ``CHOICES`` lists.

The setups and the invariants are in ``tests/invariants.py`` (``benchmarks/bench_fuzz.py``
checks the same invariants over 100,000 setups).  A method the estimator refuses
(``norms`` until it is modelled) is a rejected draw; once it is modelled it is drawn like
the others.
"""

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from invariants import MIXED_STACKS, SPACE, kwargs, run, valid, violations
from vramwidget import CHOICES
from vramwidget.model.architecture import load

setups = st.fixed_dictionaries({
    k: st.sampled_from(v) if isinstance(v, list) else st.integers(*v) for k, v in SPACE.items()})
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])


def drawn(d):
    """The estimate of a drawn setup; a combination the estimator refuses is rejected."""
    est = valid(d)
    assume(est is not None)
    return est


@settings(max_examples=150, **SETTINGS)
@given(setups, st.integers(1, 8))
def test_more_batch_never_needs_less(d, extra):
    drawn(d)
    assert run(d, batch_size=d["batch_size"] + extra).peak_allocated_bytes >= run(d).peak_allocated_bytes


@settings(max_examples=150, **SETTINGS)
@given(setups, st.integers(1, 2048))
def test_longer_sequences_never_need_less(d, extra):
    drawn(d)
    assert run(d, seq_len=d["seq_len"] + extra).peak_allocated_bytes >= run(d).peak_allocated_bytes


@settings(max_examples=60, **SETTINGS)
@given(setups)
def test_checkpointing_never_needs_more(d):
    """Up to one block's input in fp32 plus its checkpoint and the norm's statistics
    (8 x T x h + 16 x T bytes): with PEFT, checkpointing calls enable_input_require_grads, so
    the first block keeps its norm's fp32 input that it otherwise would not; this shows only
    at a handful of tokens (10 x T x h + 16 x T bytes and the 512-byte rounding of two small
    tensors, below).  Statistics: mean and rstd (8 B a token) of each norm that reads
    the block input, two in GPT-NeoX's parallel block (pythia-1b, QLoRA, one token: 8 x h +
    16 bytes more with full checkpointing)."""
    drawn(d)
    none = run(d, gradient_checkpointing="none").peak_allocated_bytes
    sel = run(d, gradient_checkpointing="selective").peak_allocated_bytes
    full = run(d, gradient_checkpointing="full").peak_allocated_bytes

    tokens = d["batch_size"] * d["seq_len"]
    arch = load(d["model"])
    # ... and, while the first block's backward runs, the gradient of its norm's output
    # (2 x T x h); each of the small tensors rounded up to a 512-byte block (glm-4.5-air QLoRA,
    # one token: 33,280 B more with full checkpointing, its peak in the first block's backward)
    slack = 10 * tokens * arch.hidden_size + 16 * tokens + 2 * 512
    assert full <= none + slack
    assert sel <= none + slack


def test_t5_cross_attention_reads_the_encoder_output_in_its_norm_dtype():
    """Was an open exception: t0-3b, QLoRA + prepare_kbit, 1 token needed 183,360 B more with
    selective checkpointing than without (7.6 KB a token per decoder layer at any length).
    The decoder's encoder output was drawn in bf16 while the encoder's final_layer_norm gives
    fp32 under prepare_kbit (fp32 norm weights); without checkpointing k and v were counted
    in bf16, with it they showed up as fp32 casts.  Now both read the fp32 output: the
    decoder's cross-attention k and v are twice their bytes without prepare_kbit (bf16
    there), with and without checkpointing."""
    d = dict(model="t0-3b", method="qlora", precision="bf16", optimizer="adamw", gradient_checkpointing="none",
             attn_implementation="sdpa", batch_size=1, seq_len=64, grad_accum_steps=1, lora_r=1,
             trainable_layers=1, prepare_kbit=True)
    none, sel = run(d), run(d, gradient_checkpointing="selective")
    assert sel.peak_allocated_bytes <= none.peak_allocated_bytes

    def kept(est):
        return {path[-1]: n.bytes for path, n in est.tree("forward").leaves() if path[-1].startswith("cross-attention")}

    bf16 = kept(run(d, prepare_kbit=False))
    for est in (none, sel):
        got = kept(est)
        for name in ("cross-attention k output", "cross-attention v"):     # every decoder layer's
            assert got[name] == 2 * bf16[name] > 0


def test_checkpointing_freeze_under_autocast_keeps_no_head_copy():
    """The issue's example (bloom-7b1, freeze 30 layers, amp_fp16): full checkpointing
    needed 95.61 GiB against 94.11 without, because the first block's backward counted the
    tied head's fp16 autocast copy, which is freed with the head's backward.  Now full is
    within one block's checkpointed input (T x h x 2 B = 9.5 MiB here) of none."""
    d = dict(model="bloom-7b1", method="freeze", trainable_layers=30, precision="amp_fp16",
             optimizer="adamw_fused", attn_implementation="flash_attention_2", batch_size=6, seq_len=202,
             gradient_checkpointing="none", grad_accum_steps=1, lora_r=16, prepare_kbit=False)
    none = run(d).peak_allocated_bytes
    full = run(d, gradient_checkpointing="full").peak_allocated_bytes
    assert full - none <= 6 * 202 * 4096 * 2 * 2   # the checkpoint, and the first block's input again



def test_selective_checkpointing_recomputes_the_kernel_transformers_runs():
    """Fuzz case 44,497 (benchmarks/bench_fuzz.py, seed 0): gemma-2-2b QLoRA + prepare_kbit with
    attn_implementation="sdpa" at b7 x 25.  transformers runs Gemma 2 eagerly whatever SDPA was
    asked for (soft-capping), and the eager kernel reads q, k, v cast to the compute dtype; the
    selective checkpoint kept the fp32 q, k, v as an SDPA core would, 10.8 MiB more than no
    checkpointing.  Selective now keeps the casts, and sdpa and eager give one estimate."""
    d = dict(model="gemma-2-2b", method="qlora", precision="bf16", optimizer="adamw",
             gradient_checkpointing="none", attn_implementation="sdpa", batch_size=7, seq_len=25,
             grad_accum_steps=4, lora_r=100, trainable_layers=6, prepare_kbit=True)
    none = run(d).peak_allocated_bytes
    selective = run(d, gradient_checkpointing="selective").peak_allocated_bytes
    assert selective < none
    assert selective == run(d, gradient_checkpointing="selective", attn_implementation="eager").peak_allocated_bytes
    assert violations(d) == []

@settings(max_examples=40, **SETTINGS)
@given(setups, st.booleans())
def test_qlora_weights_below_lora_or_a_note_says_why(d, prepare_kbit):
    """A 4-bit base is smaller than the 16-bit one, except where bitsandbytes leaves weights
    unquantized (fused MoE experts are 3-D parameters, not nn.Linear) and
    prepare_model_for_kbit_training upcasts them to fp32: then a note says so."""
    d = dict(d, method="qlora", precision="bf16", prepare_kbit=prepare_kbit)
    drawn(d)
    lora = run(d, method="lora")
    qlora = run(d)
    if qlora.phases_bytes["after_load"] >= lora.phases_bytes["after_load"]:
        assert any("unquantized" in n for n in qlora.notes), qlora.notes


def test_mixtral_qlora_with_prepare_kbit_says_why_it_is_larger():
    """The issue's case: mixtral-8x7b QLoRA with prepare_kbit 169.6 GiB of weights against
    LoRA's 87.0: the experts (45.1B of 46.7B parameters, 3-D nn.Parameters) stay bf16 and
    peft upcasts them to fp32 (45.1e9 x 4 B = 168.0 GiB)."""
    q = run(dict(model="mixtral-8x7b", method="qlora", precision="bf16", prepare_kbit=True, batch_size=1,
                 seq_len=512, optimizer="adamw", gradient_checkpointing="none", attn_implementation="sdpa",
                 grad_accum_steps=1, lora_r=16, trainable_layers=1))
    assert round(q.phases_bytes["after_load"] / 2**30, 1) == 169.7
    assert any("fused MoE expert weights unquantized (168.00 GiB in fp32)" in n for n in q.notes), q.notes


@settings(max_examples=50, **SETTINGS)
@given(setups)
def test_every_invariant_holds(d):
    """All of tests/invariants.py at once: monotone in batch and sequence, checkpointing,
    QLoRA below LoRA or a note, trees add up, every number finite and below 1 PiB.  A seeded
    slice of 50 draws (each invariant also has its own test above and below); the long run,
    100,000 draws of the same space, is ``benchmarks/bench_fuzz.py``."""
    drawn(d)
    assert violations(d) == []


@settings(max_examples=60, **SETTINGS)
@given(setups, st.sampled_from(MIXED_STACKS), st.integers(1, 4))
def test_freeze_on_mixed_stacks_keeps_every_invariant(d, model, k):
    """freeze trains the last layers: on a mixed stack (T5, BART, ModernBERT, the hybrids,
    GLM/DeepSeek's leading dense layers) a few trained layers are of other kinds than the
    first listed (issue 14's open fuzz cases, tests/test_mixed_stacks.py)."""
    d = dict(d, model=model, method="freeze", trainable_layers=k)
    drawn(d)
    assert violations(d) == []


def test_mixed_stacks_are_drawn():
    """Encoder-decoders, hybrids and leading-dense MoE presets are in the mixed-stack draw."""
    assert {"t5-base", "bart-large", "glm-4.5-air", "qwen3-next-80b-a3b", "lfm2-1.2b",
            "llama-4-scout-17b-16e", "modernbert-base"} <= set(MIXED_STACKS)
    assert "llama-3.2-1b" not in MIXED_STACKS


def test_every_method_is_drawn():
    """The space covers every method and precision that CHOICES lists (freeze and norms too)."""
    assert SPACE["method"] == [c for c, _ in CHOICES["method"]]
    assert {"freeze", "full", "lora", "qlora"} <= set(SPACE["method"])
    assert kwargs(dict(SPACE_EXAMPLE, method="freeze", trainable_layers=99))["trainable_layers"] == 16


SPACE_EXAMPLE = dict(model="llama-3.2-1b", method="full", precision="bf16", optimizer="adamw",
                     gradient_checkpointing="none", attn_implementation="sdpa", batch_size=1, seq_len=128,
                     grad_accum_steps=1, lora_r=8, trainable_layers=2, prepare_kbit=False)


def _enc_dec(name):
    from vramwidget.plan.profile import has_target
    return has_target(load(name))


#: presets with a decoder stack of their own (T5, mT5, T0, BART): the ones target_len applies to
ENCODER_DECODERS = [p for p in SPACE["model"] if _enc_dec(p)]


@settings(max_examples=30, **SETTINGS)
@given(setups, st.sampled_from(ENCODER_DECODERS), st.integers(1, 4096), st.integers(1, 2048))
def test_target_len_keeps_every_invariant_and_a_longer_target_never_needs_less(d, model, t, extra):
    """An encoder-decoder with its own target length (the five-term profile): every invariant
    of tests/invariants.py (monotone in batch and input length, checkpointing, trees add up,
    finite), and more target tokens never need less memory."""
    d = dict(d, model=model, target_len=t)
    drawn(d)
    assert violations(d) == []
    assert run(d, target_len=t + extra).peak_allocated_bytes >= run(d).peak_allocated_bytes


def test_encoder_decoders_are_drawn_with_a_target():
    assert {"t5-base", "flan-t5-xl", "bart-large"} <= set(ENCODER_DECODERS)
    assert not {"llama-3.2-1b", "bert-base-uncased", "modernbert-base"} & set(ENCODER_DECODERS)
