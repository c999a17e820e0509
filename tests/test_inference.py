"""Inference memory: KV-cache bytes by hand, weight formats against published checkpoints,
the serving budget by hand, longest_context's consistency, bad inputs, the CLI pieces.

Every number below is worked out in the comment next to it; nothing is measured here
(no GPU in this session: the generate() peak comparison is left for a session with one).
"""

from __future__ import annotations

import argparse
import io
import json
import os

import pytest

from vramwidget.model.architecture import load
from vramwidget.errors import VramError
from vramwidget.gpus import get_gpu
from vramwidget.inference.estimate import (GGML_BPW, WEIGHT_FORMATS, InferenceEstimate, add_arguments,
                                  estimate_inference, gguf_tensor_type, kv_cache_bytes, kv_layout,
                                  longest_context, main, run, weight_storage, weights_bytes, InferenceSetup)
from vramwidget.estimate import CUBLAS_WORKSPACE_BYTES, CUDA_CONTEXT_BYTES
from vramwidget.inference.weights import _use_more_bits

KIB, MIB, GIB = 2**10, 2**20, 2**30
DATA = os.path.join(os.path.dirname(__file__), "..", "vramwidget", "data", "quantized_checkpoints.json")


# ----------------------------------------------------------------------------------
# KV cache, by hand
# ----------------------------------------------------------------------------------

def test_llama2_7b_fp16_4096_tokens_is_2_gib():
    # 2 (K and V) x 32 layers x 4,096 tokens x 4,096 (32 heads x 128) x 2 B = 2 GiB
    hand = 2 * 32 * 4096 * 4096 * 2
    assert hand == 2 * GIB
    e = estimate_inference("llama-2-7b", weights="fp16", context_len=4096)
    assert e.kv_cache_bytes == hand
    assert kv_cache_bytes("llama-2-7b", 4096, kv_cache_dtype="fp16") == hand
    assert e.kv_bytes_per_token == 2 * 32 * 4096 * 2          # 512 KiB per token
    # generating the last tokens: at the decode peak the last layer's torch.cat has made its
    # 4,096-token values while the 4,095-token ones are still referenced (DynamicLayer.update),
    # every other layer holding 4,096 tokens: the cache + one layer's values of 4,095 tokens
    g = estimate_inference("llama-2-7b", weights="fp16", context_len=4096, prompt_len=4000)
    assert g.peak_phase == "prefill"
    assert g.component_bytes("decode")["kv cache"] == hand + 4095 * 4096 * 2


def test_llama31_8b_128k_tokens_is_16_gib():
    # 8 KV heads of 128 (GQA): 2 x 32 layers x 131,072 tokens x 8 x 128 x 2 B = 16 GiB
    hand = 2 * 32 * 131072 * 8 * 128 * 2
    assert hand == 16 * GIB
    e = estimate_inference("llama-3.1-8b", context_len=131072)
    assert e.setup["kv_cache_dtype"] == "bfloat16"
    assert e.kv_cache_bytes == hand
    assert e.kv_bytes_per_token == 128 * KIB


def test_batch_and_fp8_scale_the_cache():
    one = kv_cache_bytes("llama-3.1-8b", 8192)
    assert kv_cache_bytes("llama-3.1-8b", 8192, batch_size=4) == 4 * one
    assert kv_cache_bytes("llama-3.1-8b", 8192, kv_cache_dtype="fp8") == one / 2
    assert kv_cache_bytes("llama-3.1-8b", 8192, kv_cache_dtype="fp32") == one * 2


def test_mistral_7b_sliding_window_at_32k():
    # Mistral-7B-v0.1: sliding_window 4096 on all 32 layers, 8 KV heads of 128.
    arch = load("mistral-7b")
    assert arch.sliding_window == 4096 and arch.sliding_layers == 32
    per_token = 2 * 32 * 8 * 128 * 2                      # 131,072 B
    full = per_token * 32768                              # 4 GiB without the window
    windowed = per_token * 4096                           # 512 MiB: each layer keeps min(S, W) = 4096
    assert full == 4 * GIB and windowed == 512 * MIB
    with_w = estimate_inference("mistral-7b", context_len=32768)
    without = estimate_inference("mistral-7b", context_len=32768, use_sliding_window=False)
    assert with_w.kv_cache_bytes == windowed
    assert without.kv_cache_bytes == full
    # transformers 5.23: right after the prefill the sliding layers' window is a view of
    # the whole prompt's keys/values, so the prefill still holds the full cache.
    assert with_w.kv_cache_prefill_bytes == full
    assert with_w.component_bytes("prefill")["kv cache"] == full
    # a context inside the window is not cut
    assert kv_cache_bytes("mistral-7b", 2048) == per_token * 2048


def test_gemma2_only_local_layers_slide():
    # Gemma 2 9B: 42 layers alternate local (window 4096) and global; 8 KV heads of 256.
    arch = load("gemma-2-9b")
    assert arch.sliding_layers == 21 and arch.sliding_window == 4096
    per_layer_token = 2 * 8 * 256 * 2
    hand = 21 * per_layer_token * 8192 + 21 * per_layer_token * 4096
    assert kv_cache_bytes("gemma-2-9b", 8192) == hand


def test_deepseek_v2_lite_mla_cache():
    # transformers 5.23 caches MLA's compressed latent: kv_a_layernorm(c_kv) (kv_lora_rank 512)
    # and the rotary key (qk_rope_head_dim 64) per layer and token, bf16, 27 layers.
    per_token = (512 + 64) * 2 * 27                      # 31,104 B
    e = estimate_inference("deepseek-v2-lite", context_len=4096, prompt_len=4000)
    assert e.kv_bytes_per_token == per_token
    assert e.kv_cache_bytes == per_token * 4096          # 127,401,984 B = 121.5 MiB
    # decompressed (older transformers, servers without MLA kernels): 16 heads x
    # ((128 nope + 64 rope) keys + 128 values) x 2 B x 27 layers = 276,480 B per token
    dec = estimate_inference("deepseek-v2-lite", context_len=4096, mla_cache="decompressed")
    assert dec.kv_bytes_per_token == 16 * (192 + 128) * 2 * 27
    assert dec.kv_cache_bytes / e.kv_cache_bytes == pytest.approx(276480 / 31104)
    # the compressed cache is re-expanded for one layer at a time (decode transient)
    names = [c.name for c in e.phase_components["decode"] if c.name == "activations"][0]
    leaves = {n.name for n in [c for c in e.phase_components["decode"] if c.name == "activations"][0].children}
    assert names == "activations"
    assert "key_states (expanded)" in leaves
    # key_states b x a x S x d_qk at the last step (S = 4,095 cached tokens): 16 x 192 x 2 B each
    kst = [n for c in e.phase_components["decode"] if c.name == "activations" for n in c.children
           if n.name == "key_states (expanded)"][0]
    assert kst.bytes == 4095 * 16 * 192 * 2


def test_mqa_and_moe():
    # Falcon-7B: multi-query attention, one KV head of 64, 32 layers: 2 x 32 x 64 x 2 B
    assert kv_layout(load("falcon-7b")).bytes_per_token == 2 * 32 * 1 * 64 * 2
    # Mixtral's experts do not touch attention: same per-token cache as Mistral 7B
    assert kv_layout(load("mixtral-8x7b")).bytes_per_token == kv_layout(load("mistral-7b")).bytes_per_token


# ----------------------------------------------------------------------------------
# Weight formats
# ----------------------------------------------------------------------------------

def _checkpoints():
    with open(DATA, encoding="utf-8") as f:
        return json.load(f)["checkpoints"]


@pytest.mark.parametrize("ck", _checkpoints(), ids=lambda c: f"{c['repo']}@{c['branch']}:{c['weights']}")
def test_weight_bytes_within_1pct_of_published_checkpoints(ck):
    """Published sizes recorded in vramwidget/data/quantized_checkpoints.json, each with
    its source URL (Hugging Face file pages and README tables of TheBloke's Llama-2
    GPTQ/AWQ/GGUF repos, hugging-quants' Llama-3.1-8B AWQ-INT4, unsloth's Llama-3-70B NF4)."""
    assert ck["source"].startswith("https://huggingface.co/")
    kw = {k: ck[k] for k in ("group_size", "double_quant") if k in ck}
    est = weights_bytes(ck["preset"], ck["weights"], **kw)
    assert est == pytest.approx(ck["bytes"], rel=0.01)
    # in fact within 0.2% (every figure above is printed to 3 digits)
    assert abs(est / ck["bytes"] - 1) < 0.002


def test_gptq_tensor_by_hand():
    # Llama-2-7B q_proj (4096 x 4096), 4-bit, group 128 -> 32 groups, 32 layers:
    # qweight 4096 x 4096 / 2; scales 32 x 4096 x 2; qzeros 32 x 4096 / 2; g_idx 4096 x 4
    arch = load("llama-2-7b")
    s = InferenceSetup.from_kwargs(weights="gptq-4bit")
    q = [x for x in weight_storage(arch, s) if x.tensor.name.endswith("q_proj.weight")][0]
    assert q.weight_bytes == 32 * 4096 * 4096 / 2
    assert dict((lbl, b) for lbl, b, _ in q.consts) == {
        "scales (fp16)": 32 * 32 * 4096 * 2, "qzeros (int32, packed)": 32 * 32 * 4096 / 2,
        "g_idx (int32)": 32 * 4096 * 4}
    # AWQ keeps no g_idx; embeddings and lm_head stay fp16 in both
    s2 = InferenceSetup.from_kwargs(weights="awq-4bit")
    stored = {x.tensor.name: x for x in weight_storage(arch, s2)}
    assert [lbl for lbl, _, _ in stored["model.layers.{i}.self_attn.q_proj.weight"].consts] == [
        "scales (fp16)", "qzeros (int32, packed)"]
    assert stored["lm_head.weight"].weight_bytes == 32000 * 4096 * 2
    assert stored["model.embed_tokens.weight"].weight_bytes == 32000 * 4096 * 2


def test_bitsandbytes_formats():
    arch = load("llama-2-7b")
    lin = sum(t.numel for t in arch.tensors if t.linear)          # 6,476,005,376
    rest = arch.params_total - lin                                # embeddings, head, norms
    # NF4 without double quantization (BitsAndBytesConfig's default): n/2 + n/64 x 4 B
    assert weights_bytes("llama-2-7b", "nf4") == pytest.approx(lin / 2 + lin / 64 * 4 + rest * 2)
    # with double quantization: n/2 + n/64 x 1 B + n/64/256 x 4 B (0.127 bit/weight of constants)
    assert weights_bytes("llama-2-7b", "nf4", double_quant=True) == pytest.approx(
        lin / 2 + lin / 64 + lin / 64 / 256 * 4 + rest * 2)
    # LLM.int8: n x 1 B + one fp32 scale per output row: per layer outputs 4 x 4096 + 2 x 11008 + 4096
    rows = 32 * (4 * 4096 + 2 * 11008 + 4096)
    assert weights_bytes("llama-2-7b", "int8") == lin + rows * 4 + rest * 2


def test_gguf_q4_k_m_rule():
    # use_more_bits: the first and last eighth of the layers and every third between -> half of 32
    assert sum(_use_more_bits(i, 32) for i in range(32)) == 16
    arch = load("llama-2-7b")
    assert gguf_tensor_type("q4_k_m", "attn_v", 0, 32, arch, 4096) == "Q6_K"
    assert gguf_tensor_type("q4_k_m", "attn_v", 4, 32, arch, 4096) == "Q4_K"
    assert gguf_tensor_type("q4_k_m", "ffn_down", 31, 32, arch, 11008) == "Q6_K"
    assert gguf_tensor_type("q4_k_m", "output", 0, 32, arch, 4096) == "Q6_K"
    assert gguf_tensor_type("q4_k_m", "token_embd", 0, 32, arch, 4096) == "Q4_K"
    assert gguf_tensor_type("q8_0", "output", 0, 32, arch, 4096) == "Q8_0"
    # a row that is not a multiple of 256 falls back (Q4_K -> Q5_0)
    assert gguf_tensor_type("q4_k_m", "other", 0, 32, arch, 4096 + 32) == "Q5_0"
    # Llama-2-7B Q4_K_M by hand: 16 layers' attn_v (4096^2) and ffn_down (11008 x 4096) in
    # Q6_K (6.5625 bpw), the other linears and the embedding in Q4_K (4.5), output Q6_K,
    # norms F32
    lin = sum(t.numel for t in arch.tensors if t.linear)
    wide = 16 * (4096 * 4096 + 11008 * 4096)
    emb = 32000 * 4096
    norms = (2 * 32 + 1) * 4096
    hand = wide * 6.5625 / 8 + (lin - wide) * 4.5 / 8 + emb * 4.5 / 8 + emb * 6.5625 / 8 + norms * 4
    assert weights_bytes("llama-2-7b", "gguf-q4_k_m") == pytest.approx(hand)
    assert GGML_BPW["Q4_K"] == 4.5 and GGML_BPW["Q6_K"] == 6.5625 and GGML_BPW["Q8_0"] == 8.5


def test_formats_order_by_size():
    sizes = {w: weights_bytes("llama-3.1-8b", w) for w in ("fp32", "bf16", "fp8", "int8", "gguf-q8_0",
                                                          "gguf-q4_k_m", "awq-4bit", "nf4", "gguf-q2_k")}
    assert sizes["fp32"] == 2 * sizes["bf16"]
    assert sizes["bf16"] > sizes["fp8"] > sizes["gguf-q4_k_m"] > sizes["gguf-q2_k"]
    assert sizes["int8"] > sizes["awq-4bit"]


# ----------------------------------------------------------------------------------
# The phases of generate()
# ----------------------------------------------------------------------------------

def test_phases_add_up_and_trees_are_consistent():
    e = estimate_inference("llama-3.1-8b", weights="nf4", context_len=8192, prompt_len=8000, batch_size=2)
    assert isinstance(e, InferenceEstimate)
    for ph, comps in e.phase_components.items():
        assert sum(c.bytes for c in comps) == pytest.approx(e.phases_bytes[ph])
        for c in comps:
            for _, n in c.walk():
                if n.children:
                    assert n.bytes == pytest.approx(sum(k.bytes for k in n.children))
    assert e.peak_allocated_bytes == max(e.phases_bytes["prefill"], e.phases_bytes["decode"])
    # the phases count what the caching allocator counts: every tensor rounded up to 512 B
    assert e.weights_bytes <= e.phases_bytes["after_load"] < e.weights_bytes + 512 * len(e.to_dataframe())
    d = json.loads(e.to_json())
    assert d["kv_cache_bytes"] == 2 * 8192 * 128 * KIB and d["mode"] == "generate"
    assert e.rows() and e.device_total_bytes == pytest.approx(e.reserved_bytes + CUDA_CONTEXT_BYTES)


def test_generate_keeps_only_last_logits():
    # transformers 5.23 generate() passes logits_to_keep=1: b x V logits (+ an fp32 copy);
    # a plain forward computes b x p x V.  Llama-3.1-8B, b=1, p=8192, V=128,256, bf16:
    from vramwidget.inference.estimate import InferenceSetup
    from vramwidget.inference.events import inference_events

    arch = load("llama-3.1-8b")
    s = InferenceSetup.from_kwargs(context_len=8192, prompt_len=8000)
    allp = estimate_inference(arch, context_len=8192, logits="all")
    # the most vocabulary rows live at once in a decode step: its bf16 logits, their new fp32
    # copy and the previous step's, still held by generate's loop (traced on the CPU in
    # tests/test_generate_trace.py): 128,256 x 2 B + 2 x 128,256 x 4 B (each a multiple of 512 B)
    live, top, size = {}, 0, {}
    for kind, key, nbytes, label in inference_events(arch, s)[-3000:]:
        if kind == "alloc" and label[0] == "logits":
            size[key] = -(-int(nbytes) // 512) * 512
            live[key] = size[key]
            top = max(top, sum(live.values()))
        elif kind == "free":
            live.pop(key, None)
    assert top == 128256 * 2 + 2 * 128256 * 4
    assert allp.phases_bytes["prefill"] > estimate_inference(arch, context_len=8192).phases_bytes["prefill"]
    assert allp.component_bytes("prefill")["logits"] == 8192 * 128256 * 2


def test_eager_materialises_scores():
    # Llama-2-7B eager prefill at 4,096 tokens, b x a x p x p = 32 x 4096^2 scores: at the peak
    # softmax(scores + mask, dtype=float32) has its fp32 input and output (4 B each) beside the
    # masked bf16 scores (2 B): 10 B a score, 5 GiB (eager_attention_forward, traced on the CPU
    # in tests/test_generate_trace.py), above the MLP's working set
    e = estimate_inference("llama-2-7b", context_len=4096, attn_implementation="eager")
    acts = {n.name: n.bytes for c in e.phase_components["prefill"] if c.name == "activations" for n in c.children}
    n = 32 * 4096 * 4096
    assert acts["attention scores + mask"] == 2 * n
    assert acts["attention scores as fp32 (softmax input)"] == acts["softmax (fp32)"] == 4 * n
    sdpa = estimate_inference("llama-2-7b", context_len=4096)
    assert e.phases_bytes["prefill"] > sdpa.phases_bytes["prefill"] + 4 * GIB


def test_decode_cache_growth_transient():
    # DynamicLayer.update appends with torch.cat: one layer's old and new values coexist at the
    # decode peak.  Llama-2-7B, the last step of a 4,096-token context: 32 layers' keys and
    # values at 4,096 tokens (32 MiB each) + the last layer's 4,095-token values
    e = estimate_inference("llama-2-7b", context_len=4096, prompt_len=4000)
    kv = {n.name: n for c in e.phase_components["decode"] if c.name == "kv cache" for n in c.children}
    assert kv["keys (torch.cat)"].bytes == 32 * 32 * MIB
    assert kv["values (torch.cat)"].bytes == 32 * 32 * MIB + 4095 * 4096 * 2
    assert kv["values (torch.cat)"].formula == "33 tensors"


def test_fit_flag():
    assert estimate_inference("llama-3.1-8b", gpu="H100-80GB").fits is True
    assert estimate_inference("llama-2-70b", gpu="RTX 4090").fits is False


# ----------------------------------------------------------------------------------
# Serving: a paged KV cache in a gpu_memory_utilization budget, by hand
# ----------------------------------------------------------------------------------

def test_serving_tokens_by_hand():
    # Llama-2-7B fp16 on an H100 80GB (the torch-visible total, "total capacity of 79.11 GiB"
    # in vLLM issue 27508: 81,009 MiB), utilization 0.9, vLLM's default release (V1,
    # memory_profiling baseline: the CUDA context is not subtracted; one GPU: no communication buffers)
    C = 81009 * MIB
    weights = 6738415616 * 2 + 4096 * 128 * 2                # parameters + rotary cos/sin cache
    # profiling forward of 2,048 tokens (V1 serve default) over 256 sequences:
    layer = 2048 * (3 * 4096 + 3 * 11008) * 2                 # residual, normed, gate_up, act, down
    head = 2048 * 4096 * 2 + 256 * 32000 * 2 + 256 * 32000 * 38   # hidden, logits, sampler
    acts = max(layer, head)
    assert acts == head == 344457216
    budget = 0.9 * C - weights - acts
    per_token = 2 * 32 * 4096 * 2                             # 512 KiB
    blocks = int(budget // (16 * per_token))
    tokens = blocks * 16
    e = estimate_inference("llama-2-7b", weights="fp16", gpu="H100-80GB", gpu_memory_utilization=0.9,
                           context_len=4096)
    v = e.serving
    assert v["engine"] == "vllm" and v["runtime"] == "v1"
    assert v["activation_peak_bytes"] == acts
    assert v["weights_bytes"] == weights
    assert v["kv_budget_bytes"] == round(budget)
    assert v["kv_tokens"] == tokens
    assert v["kv_tokens"] % 16 == 0
    assert v["max_concurrent_sequences"] == tokens // 4096
    assert v["running_sequences"] == min(tokens // 4096, 256)
    assert e.kv_cache_bytes == tokens * per_token
    assert v["startup_lines"][1] == f"GPU KV cache size: {tokens:,} tokens"
    assert v["startup_lines"][2] == f"Maximum concurrency for 4,096 tokens per request: {tokens / 4096:.2f}x"


def test_serving_sliding_and_no_room():
    e = estimate_inference("gemma-2-9b", gpu="H100-80GB", gpu_memory_utilization=0.9, context_len=32768)
    v = e.serving
    # a local layer holds at most ceil(4096/16) + 1 blocks of a 32k sequence
    per_layer_token = 2 * 8 * 256 * 2
    per_seq = 2048 * 16 * per_layer_token * 21 + 257 * 16 * per_layer_token * 21
    assert v["bytes_per_sequence"] == per_seq
    assert v["max_concurrent_sequences"] == v["kv_budget_bytes"] // per_seq
    small = estimate_inference("llama-2-70b", gpu="RTX 4090", gpu_memory_utilization=0.9)
    assert small.serving["fits"] is False and small.serving["kv_tokens"] == 0


# ----------------------------------------------------------------------------------
# longest_context
# ----------------------------------------------------------------------------------

@pytest.mark.parametrize("model,gpu,kw", [
    ("llama-3.1-8b", "H100-80GB", {}),
    ("llama-3.1-8b", "RTX 4090", {"weights": "nf4", "batch_size": 2}),
    ("mistral-7b", "A100 40GB", {"attn_implementation": "eager"}),
    ("llama-2-7b", "L4", {"weights": "awq-4bit", "prompt_len": 512}),
])
def test_longest_context_is_consistent(model, gpu, kw):
    n = longest_context(model, gpu, **kw)
    assert n > 0 and n % 16 == 0
    p = kw.pop("prompt_len", None)
    at = estimate_inference(model, gpu=gpu, context_len=n, prompt_len=min(p, n) if p else None, **kw)
    more = estimate_inference(model, gpu=gpu, context_len=n + 16,
                              prompt_len=min(p, n + 16) if p else None, **kw)
    assert at.fits and not more.fits
    # the line: what CUDA reports as the card's total (verdict.capacity_bytes), the device
    # totals counting the card's own CUDA context
    assert at.device_total_bytes <= get_gpu(gpu).cuda_total_bytes < more.device_total_bytes
    assert at.cuda_context_bytes == get_gpu(gpu).cuda_context_bytes


def test_longest_context_serving_and_none():
    n = longest_context("llama-3.1-8b", "H100-80GB", gpu_memory_utilization=0.9, batch_size=8)
    assert n % 16 == 0
    at = estimate_inference("llama-3.1-8b", gpu="H100-80GB", gpu_memory_utilization=0.9, context_len=n)
    more = estimate_inference("llama-3.1-8b", gpu="H100-80GB", gpu_memory_utilization=0.9, context_len=n + 16)
    assert at.serving["max_concurrent_sequences"] >= 8 > more.serving["max_concurrent_sequences"]
    assert longest_context("llama-2-70b", "RTX 4090") == 0


# ----------------------------------------------------------------------------------
# Bad input: a VramError naming the field
# ----------------------------------------------------------------------------------

def _err(**kw) -> VramError:
    with pytest.raises(VramError) as info:
        estimate_inference("llama-2-7b", **kw)
    return info.value


def test_unknown_weights_format_lists_the_allowed_ones():
    e = _err(weights="q3")
    assert e.field == "weights"
    for w in ("bf16", "nf4", "gptq-4bit", "awq-4bit", "gguf-q4_k_m", "gguf-q8_0"):
        assert w in str(e)
    assert set(WEIGHT_FORMATS) >= {"bf16", "fp16", "fp32", "int8", "nf4", "fp4", "gptq-4bit", "awq-4bit",
                                   "gguf-q4_k_m", "gguf-q8_0"}


@pytest.mark.parametrize("kw,field", [
    ({"context_len": 0}, "context_len"),
    ({"context_len": -5}, "context_len"),
    ({"context_len": 1.5}, "context_len"),
    ({"batch_size": 0}, "batch_size"),
    ({"prompt_len": 5000, "context_len": 4096}, "prompt_len"),
    ({"kv_cache_dtype": "int4"}, "kv_cache_dtype"),
    ({"attn_implementation": "flashy"}, "attn_implementation"),
    ({"mla_cache": "zip"}, "mla_cache"),
    ({"group_size": 0}, "group_size"),
    ({"weights": "awq-4bit", "group_size": -1}, "group_size"),
    ({"gpu": "H1000"}, "gpu"),
    ({"gpu_memory_utilization": 0.9}, "gpu"),
    ({"gpu": "H100-80GB", "gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ({"gpu": "H100-80GB", "gpu_memory_utilization": 0}, "gpu_memory_utilization"),
    ({"weights": "nf4", "dtype": "int8"}, "dtype"),
    ({"weights": "bf16", "dtype": "fp16"}, "dtype"),
    ({"double_quant": "yes"}, "double_quant"),
    ({"contxt_len": 10}, "contxt_len"),
])
def test_bad_inputs_name_their_field(kw, field):
    e = _err(**kw)
    assert e.field == field
    assert field.lower() in str(e).lower()


def test_aliases():
    assert estimate_inference("llama-2-7b", weights="Q4_K_M").setup["weights"] == "gguf-q4_k_m"
    assert estimate_inference("llama-2-7b", weights="gptq").setup["weights"] == "gptq-4bit"
    assert estimate_inference("llama-2-7b", weights="4bit").setup["weights"] == "nf4"
    assert estimate_inference("llama-2-7b", weights="awq").setup["dtype"] == "float16"
    with pytest.raises(VramError) as info:
        longest_context("llama-2-7b", "H1000")
    assert info.value.field == "gpu"


# ----------------------------------------------------------------------------------
# CLI pieces
# ----------------------------------------------------------------------------------

def test_main_json_and_table(capsys):
    assert main(["llama-2-7b", "--weights", "fp16", "--context-len", "4096", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["kv_cache_bytes"] == 2 * GIB and d["setup"]["weights"] == "fp16"
    assert main(["llama-3.1-8b", "--gpu", "H100-80GB", "--gpu-memory-utilization", "0.9"]) == 0
    out = capsys.readouterr().out
    assert "KV budget" in out and "sequences" in out
    assert main(["llama-3.1-8b", "--gpu", "RTX 4090", "--weights", "nf4", "--longest-context"]) == 0
    assert "longest context that fits" in capsys.readouterr().out


def test_main_bad_input_is_one_line(capsys):
    assert main(["llama-2-7b", "--weights", "q3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("vramwidget: error: weights:")


def test_add_arguments_reuses_existing_options():
    # `vramwidget estimate MODEL --inference ...`: the estimate parser already has
    # --batch-size and --attn-implementation; add_arguments leaves them and run() reads them.
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--batch-size", dest="batch_size", type=int)
    p.add_argument("--attn-implementation", dest="attn_implementation")
    p.add_argument("--inference", action="store_true")
    add_arguments(p, model=False)
    args = p.parse_args(["llama-2-7b", "--inference", "--batch-size", "2", "--weights", "nf4", "--json"])
    buf = io.StringIO()
    assert run(args, out=buf) == 0
    d = json.loads(buf.getvalue())
    assert d["setup"]["batch_size"] == 2 and d["setup"]["weights"] == "nf4"
