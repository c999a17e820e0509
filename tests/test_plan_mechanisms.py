"""Mechanisms of the step plan, each pinned by a figure derived independently of the plan
(from the model's config or the library's source).  Each of these once separated the
allocator replay from the totals, when a step was written down twice (issue 13, issue 22);
with one plan they are checked against their own derivation instead."""

import pytest

import vramwidget as vw
from vramwidget.model.architecture import load
from vramwidget.plan.params import param_storage
from vramwidget.training import TrainingSetup


def _round(n):
    """CUDACachingAllocator round_size: a request rounded up to 512 B."""
    return max(512, -(-int(n) // 512) * 512)


def test_freeze_autocast_keeps_only_the_trained_blocks_copies():
    """llama-3.2-1b, the last 2 of 16 layers trained, amp_bf16: the copies held are the two
    trained blocks' matmul weights (2 x (2 x 2048^2 + 2 x 2048 x 512 + 3 x 2048 x 8192) x 2 B,
    config of meta-llama/Llama-3.2-1B) and the tied head's (128256 x 2048 x 2 B: the head sits
    above the trained blocks, so its matmul saves the copy).  aten/src/ATen/autocast_mode.cpp
    caches only leaves that require grad; a frozen block below the trained ones runs outside
    autograd's graph and keeps no copy."""
    e = vw.estimate("llama-3.2-1b", method="freeze", trainable_layers=2, precision="amp_bf16",
                    batch_size=2, seq_len=256)
    held = sum(n.bytes for path, n in e.tree("forward").leaves() if "autocast copies (16-bit)" in path)
    assert held == 2 * (2 * 2048 ** 2 + 2 * 2048 * 512 + 3 * 2048 * 8192) * 2 + 128256 * 2048 * 2


@pytest.mark.parametrize("model", ["qwen2.5-vl-7b", "gemma-3-4b-vision"])
def test_vision_tower_weights_load_block_by_block(model):
    """A VLM's vision tower repeats each tensor once per tower block (layers=None, repeat =
    the tower's depth: 32 in Qwen2.5-VL's config, 27 in SigLIP's for Gemma 3): every
    instance is its own parameter, each rounded by the allocator, so the weights after the
    load are the sum over instances (+ the 64 MiB cuBLAS workspace)."""
    kw = dict(method="full", batch_size=2, seq_len=256)
    e = vw.estimate(model, **kw)
    P = param_storage(load(model), TrainingSetup.from_kwargs(**kw))
    per_instance = sum(_round(nb / t.repeat) * t.repeat for t, dt, nb, tr in P.weights)
    assert e.phases_bytes["after_load"] == per_instance + 64 * 2 ** 20


@pytest.mark.parametrize("model,V", [("gemma-2-2b", 256000), ("gemma-2-9b", 256000)])
def test_final_logit_softcapping_keeps_tanhs_output(model, V):
    """Gemma 2 soft-caps its logits (modeling_gemma2.py: logits / cap, tanh, * cap; config
    final_logit_softcapping = 30): tanh saves its T x V output for backward, in the logits'
    dtype (bf16 here: b2 x 256 x 256,000 x 2 B)."""
    e = vw.estimate(model, method="lora", batch_size=2, seq_len=256)
    kept = [n.bytes for path, n in e.tree("backward").leaves() if n.name == "soft-capped logits tanh (saved)"]
    assert kept == [2 * 256 * V * 2]


@pytest.mark.parametrize("model,h", [("gpt2-medium", 1024), ("gpt2-large", 1280)])
def test_lora_on_a_repeated_module_name_has_its_own_shape(model, h):
    """GPT-2 names two modules c_proj (attn.c_proj, h x h, and mlp.c_proj, 4h x h; peft
    targets both): each adapter has its own module's in_features (r x h and r x 4h, fp32)."""
    L = {"gpt2-medium": 24, "gpt2-large": 36}[model]
    e = vw.estimate(model, method="lora", gradient_checkpointing="full", batch_size=2, seq_len=256)
    a = {(path[2], n.name): n.bytes for path, n in e.tree("after_load").leaves() if "adapters" in path}
    assert a[("attention", "c_proj lora_A")] == L * 16 * h * 4
    assert a[("mlp", "c_proj lora_A")] == L * 16 * 4 * h * 4


@pytest.mark.parametrize("model", ["llama-3.1-8b", "mistral-7b"])
def test_optimizer_in_backward_holds_one_gradient_at_a_time(model):
    """torchtune's optimizer_in_bwd (training/memory.py register_optim_in_bwd_hooks): each
    parameter's own optimizer steps in its post-accumulate-grad hook and frees the gradient,
    so the gradients live at the backward peak are the largest parameter's alone (the
    embedding, V x h x 2 B), never the whole set."""
    e = vw.estimate(model, method="full", optimizer_in_backward=True, batch_size=2, seq_len=256)
    arch = load(model)
    assert e.component_bytes("backward").get("gradients", 0.0) <= arch.vocab_size * arch.hidden_size * 2


def test_a_tied_embedding_sums_out_of_place_without_autocast():
    """A tied head's gradient waits in autograd's input buffer for the embedding's; the
    engine adds in place only into a plain tensor it holds the last reference to
    (torch/csrc/autograd/input_buffer.cpp can_accumulate_inplace).  In pure bf16 the head's
    arrives as a transposed view of its mm: the sum is a third V x h tensor beside the two;
    under autocast the head's arrives as the fp32 cast of its mm and the embedding's is
    added into it.  qwen2.5-0.5b (tied, V 151,936 x h 896), full fine-tuning, fp32, SGD."""
    V, h = 151936, 896
    kw = dict(method="full", optimizer="sgd", batch_size=1, seq_len=128)
    e = vw.estimate("qwen2.5-0.5b", precision="fp32", **kw)
    grads = e.phases_bytes["backward"] - e.phases_bytes["after_load"]
    all_grads = sum(t.numel for t in load("qwen2.5-0.5b").tensors) * 4
    # every gradient + the head's and the embedding's contributions beside their sum
    assert grads >= all_grads + 2 * V * h * 4
