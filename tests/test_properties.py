"""Invariants over random setups (hypothesis)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from vramwidget import estimate
from vramwidget.architecture import load

MODELS = ["llama-3.2-1b", "qwen2.5-0.5b", "gpt2", "mistral-7b", "olmoe-1b-7b", "gemma-2-2b", "phi-3-mini", "opt-1.3b",
          "mixtral-8x7b", "deepseek-v2-lite", "bloom-7b1", "pythia-1b", "falcon-7b", "gemma-3-1b", "qwen1.5-moe-a2.7b"]

setups = st.fixed_dictionaries({
    "model": st.sampled_from(MODELS),
    "method": st.sampled_from(["full", "lora", "qlora"]),
    "precision": st.sampled_from(["bf16", "fp32", "amp_bf16", "bf16_fp32_states", "fp16", "fp8"]),
    "optimizer": st.sampled_from(["adamw", "adamw_fused", "adamw_8bit", "sgd_momentum", "adafactor", "lion"]),
    "gradient_checkpointing": st.sampled_from(["none", "selective", "full"]),
    "attn_implementation": st.sampled_from(["sdpa", "eager", "flash_attention_2"]),
    "batch_size": st.integers(1, 16),
    "seq_len": st.integers(1, 4096),
    "lora_r": st.integers(1, 128),
})


def run(d, **over):
    d = dict(d, **over)
    model = d.pop("model")
    if d["method"] == "qlora" and d["precision"] in ("fp32", "amp_bf16", "amp_fp16", "fp8"):
        d["precision"] = "bf16"   # a 4-bit base computes in 16 bits
    return estimate(model, **d)


@settings(max_examples=150, deadline=None)
@given(setups, st.integers(1, 8))
def test_more_batch_never_needs_less(d, extra):
    assert run(d, batch_size=d["batch_size"] + extra).peak_allocated_bytes >= run(d).peak_allocated_bytes


@settings(max_examples=150, deadline=None)
@given(setups, st.integers(1, 2048))
def test_longer_sequences_never_need_less(d, extra):
    assert run(d, seq_len=d["seq_len"] + extra).peak_allocated_bytes >= run(d).peak_allocated_bytes


@settings(max_examples=150, deadline=None)
@given(setups)
def test_checkpointing_never_needs_more(d):
    """Up to one block's input in fp32 plus its checkpoint and the norm's statistics
    (8 x T x h + 8 x T bytes): with PEFT, checkpointing calls enable_input_require_grads, so
    the first block keeps its norm's fp32 input that it otherwise would not; this shows only
    at a handful of tokens."""
    none = run(d, gradient_checkpointing="none").peak_allocated_bytes
    sel = run(d, gradient_checkpointing="selective").peak_allocated_bytes
    full = run(d, gradient_checkpointing="full").peak_allocated_bytes

    tokens = d["batch_size"] * d["seq_len"]
    slack = 8 * tokens * load(d["model"]).hidden_size + 8 * tokens
    assert full <= none + slack and sel <= none + slack


@settings(max_examples=40, deadline=None)
@given(setups)
def test_qlora_weights_below_lora(d):
    lora = run(d, method="lora", precision="bf16")
    qlora = run(d, method="qlora", precision="bf16")
    assert qlora.phases_bytes["after_load"] < lora.phases_bytes["after_load"]


@settings(max_examples=150, deadline=None)
@given(setups)
def test_tree_leaves_sum_to_totals(d):
    est = run(d)
    root = est.tree()
    leaves = sum(n.bytes for _, n in root.leaves())
    assert abs(leaves - root.bytes) <= 1e-6 * root.bytes
    assert abs(root.bytes - est.device_total_bytes) <= 1e-6 * root.bytes
    allocated = sum(c.bytes for c in est.components if c.name not in ("cuda context", "allocator reserve"))
    assert abs(allocated - est.peak_allocated_bytes) <= 1e-6 * est.peak_allocated_bytes
    for phase, nodes in est.phase_components.items():
        assert abs(sum(n.bytes for n in nodes) - est.phases_bytes[phase]) <= 1e-6 * est.phases_bytes[phase], phase


@settings(max_examples=40, deadline=None)
@given(setups)
def test_every_number_is_positive_and_finite(d):
    est = run(d)
    for _, n in est.tree().walk():
        assert n.bytes >= 0 and n.bytes == n.bytes and n.bytes < 1e18
