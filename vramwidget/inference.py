"""Inference memory: weights in any storage format, the KV cache, prefill and decode, serving.

``estimate_inference(model, **setup)`` answers "will it run": what ``model.generate()``
holds on one GPU (Hugging Face transformers 5.x, the installed 5.23 read for every rule
below), or, given ``gpu_memory_utilization``, how many KV-cache tokens and concurrent
sequences a vLLM-style server with a paged KV cache fits.  Phases of ``generate()``:

after_load    weights (+ quantization constants) as stored on the GPU
prefill       + the KV cache of the prompt + the working set of the largest step of one
              layer at b x prompt tokens + the first forward's logits (generate sets
              ``logits_to_keep=1``: only the last position's b x V logits) + workspaces
decode        + the KV cache at ``context_len`` tokens + one decode step's transients
              (the cache's ``torch.cat`` copy of one layer, eager attention's repeated
              K/V, MLA's expanded K/V, MoE expert weights gathered by ``batched_mm``)

The peak is the larger of prefill and decode.  Each mechanism is one function below
with its formula; the symbols are those of :mod:`vramwidget.architecture` (h, L, a, kv,
d, i, V, E, k) plus b (batch), p (prompt tokens), S (tokens in the cache), T = b x p.

What transformers 5.23 does (read from its source; a GPU measurement is still to come):

* ``DynamicCache(config=...)`` (what generate builds) keeps sliding-window layers
  (Mistral v0.1, Gemma 2/3's local layers) as ``DynamicSlidingWindowLayer``: after a
  decode step each such layer's storage is ``min(S, W)`` tokens (it keeps the last W-1
  as a view of a W-token ``torch.cat`` result).  Right after the prefill the sliced view
  still holds the whole prompt's storage, so the prefill peak has the full cache.
* DeepSeek-V2/V3 attention caches the *compressed* latent: ``kv_a_layernorm(c_kv)``
  (kv_lora_rank) and the rotary key (qk_rope_head_dim), one "head", per layer and token,
  then expands it to per-head K and V with ``kv_b_proj`` at every step (a transient of
  S x a x (d_nope + d_v) + S x a x d_qk for one layer).  ``mla_cache="decompressed"``
  gives the per-head K/V cache of older transformers and of servers without MLA kernels.
* SDPA with no padding passes ``enable_gqa`` (no K/V copies); eager attention repeats K
  and V to every head (``repeat_kv``) and materialises b x a x q x S scores, an fp32
  softmax and its cast back.
* On a GPU, MoE decode switches ``grouped_mm`` experts to ``batched_mm``, which gathers
  every selected expert's weights: b x k x 3 x i_e x h weight elements for one layer.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from .architecture import Architecture, ParamTensor, load
from .errors import VramError
from .gpus import context_for
from .inputs import (MAX_BYTES, MAX_GPUS, check_bool, check_total, check_int, check_keywords, check_number, check_text,
                     close_match, shown)
from .estimate import CUBLAS_WORKSPACE_BYTES
from .plan.params import quant_const_bytes, quantizable
from .result import Estimate, EstimateSources, Node
from .units import DTYPE_BYTES, GIB, canonical_dtype

Model = Union[str, Dict[str, Any], Architecture]

# ----------------------------------------------------------------------------------
# The choices
# ----------------------------------------------------------------------------------

#: weight storage formats -> what they are
WEIGHT_FORMATS: Dict[str, str] = {
    "bf16": "bfloat16 weights",
    "fp16": "float16 weights",
    "fp32": "float32 weights",
    "fp8": "fp8 linear weights + one fp32 scale per output channel (FBGEMM / compressed-tensors); "
           "embeddings, head and norms 16-bit",
    "int8": "bitsandbytes LLM.int8: int8 linear weights + one fp32 scale per output row",
    "nf4": "bitsandbytes 4-bit NF4: 4-bit linear weights + absmax per 64 weights",
    "fp4": "bitsandbytes 4-bit FP4: 4-bit linear weights + absmax per 64 weights",
    "gptq-4bit": "GPTQ 4-bit: int32-packed qweight, fp16 scales and packed zeros per group, int32 g_idx",
    "gptq-8bit": "GPTQ 8-bit: int32-packed qweight, fp16 scales and packed zeros per group, int32 g_idx",
    "awq-4bit": "AWQ 4-bit (GEMM): int32-packed qweight, packed zeros and fp16 scales per group",
    "mxfp4": "MXFP4 experts as gpt-oss ships them (transformers' Mxfp4 path with the Triton kernels): 4-bit e2m1 "
             "values in uint8 pairs + one uint8 e8m0 scale per 32 weights; expert biases fp32; attention, router, "
             "embeddings and head 16-bit",
    "fp8-block": "block-wise FP8 (DeepSeek-V3, Qwen3-FP8): e4m3 linear weights + one fp32 scale per 128 x 128 block "
                 "(weight_scale_inv); embeddings, head, norms and router 16-bit",
    "ct-w4a16": "compressed-tensors pack-quantized int4 (llm-compressor W4A16): int32-packed weights + a 16-bit "
                "scale per group of group_size",
    "ct-w8a8": "compressed-tensors int8 (llm-compressor W8A8): int8 weights + a 16-bit scale per output channel",
    "ct-fp8": "compressed-tensors float-quantized FP8 (llm-compressor FP8): e4m3 weights + an fp32 scale per output "
              "channel",
    "gguf-q2_k": "llama.cpp Q2_K mix", "gguf-q3_k_s": "llama.cpp Q3_K_S", "gguf-q3_k_m": "llama.cpp Q3_K_M mix",
    "gguf-q3_k_l": "llama.cpp Q3_K_L mix", "gguf-q4_0": "llama.cpp Q4_0", "gguf-q4_1": "llama.cpp Q4_1",
    "gguf-q4_k_s": "llama.cpp Q4_K_S mix", "gguf-q4_k_m": "llama.cpp Q4_K_M mix", "gguf-q5_0": "llama.cpp Q5_0",
    "gguf-q5_1": "llama.cpp Q5_1", "gguf-q5_k_s": "llama.cpp Q5_K_S", "gguf-q5_k_m": "llama.cpp Q5_K_M mix",
    "gguf-q6_k": "llama.cpp Q6_K", "gguf-q8_0": "llama.cpp Q8_0", "gguf-f16": "llama.cpp F16",
}

_FORMAT_ALIASES = {
    "bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32",
    "float8": "fp8", "fp8_e4m3": "fp8", "8bit": "int8", "bnb-8bit": "int8", "llm.int8": "int8", "int4": "nf4",
    "4bit": "nf4", "bnb-4bit": "nf4", "bnb-nf4": "nf4", "bnb-fp4": "fp4", "gptq": "gptq-4bit", "gptq-int4": "gptq-4bit",
    "gptq-int8": "gptq-8bit", "awq": "awq-4bit", "awq-int4": "awq-4bit", "fp8-blockwise": "fp8-block",
    "fp8-e4m3-block": "fp8-block", "w4a16": "ct-w4a16", "w8a8": "ct-w8a8", "compressed-tensors-fp8": "ct-fp8",
}

KV_CACHE_DTYPES = ("bf16", "fp16", "fp32", "fp8")
ENGINES = ("hf", "vllm", "sglang")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")
MLA_CACHE_CHOICES = ("compressed", "decompressed")
LOGITS_CHOICES = ("last", "all")

#: vLLM's KV-cache block (page) size in tokens
BLOCK_SIZE = 16
#: vLLM defaults used for serving (both are parameters)
DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192

#: llama.cpp (ggml) bits per weight of each tensor type: block bytes x 8 / block weights
GGML_BPW = {
    "Q2_K": 2.625,    # 84 B per 256
    "Q3_K": 3.4375,   # 110 B per 256
    "Q4_K": 4.5,      # 144 B per 256
    "Q5_K": 5.5,      # 176 B per 256
    "Q6_K": 6.5625,   # 210 B per 256
    "Q4_0": 4.5,      # 18 B per 32
    "Q4_1": 5.0,      # 20 B per 32
    "Q5_0": 5.5,      # 22 B per 32
    "Q5_1": 6.0,      # 24 B per 32
    "Q8_0": 8.5,      # 34 B per 32
    "IQ4_NL": 4.5,    # 18 B per 32
    "F16": 16.0,
    "F32": 32.0,
}
_GGML_BLOCK = {"Q2_K": 256, "Q3_K": 256, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256, "Q4_0": 32, "Q4_1": 32,
               "Q5_0": 32, "Q5_1": 32, "Q8_0": 32, "IQ4_NL": 32, "F16": 1, "F32": 1}
#: llama.cpp's fallback when a row length is not a multiple of the k-quant block (256)
_GGML_FALLBACK = {"Q2_K": "IQ4_NL", "Q3_K": "IQ4_NL", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
#: GGUF mix -> its default tensor type
_GGUF_BASE = {"q2_k": "Q2_K", "q3_k_s": "Q3_K", "q3_k_m": "Q3_K", "q3_k_l": "Q3_K", "q4_0": "Q4_0",
              "q4_1": "Q4_1", "q4_k_s": "Q4_K", "q4_k_m": "Q4_K", "q5_0": "Q5_0", "q5_1": "Q5_1",
              "q5_k_s": "Q5_K", "q5_k_m": "Q5_K", "q6_k": "Q6_K", "q8_0": "Q8_0", "f16": "F16"}

#: the caching-allocator replay of generate(), registered by inference_events.py (imported by
#: the package): "hooks" (arch, setup, peak) -> (reserved, replay, provisional) callables and
#: "reserved_by_decode_steps" (arch, setup) -> reserved bytes after k decode steps; as
#: estimate.ALLOCATOR_REPLAY is for training, so that this module does not import that one
GENERATE_REPLAY: Dict[str, Any] = {}

_CHILD_ORDER = ("weights", "quantization constants", "kv cache", "activations", "logits", "generation", "workspace",
                "allocator reserve", "cuda context")


# ----------------------------------------------------------------------------------
# The setup
# ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class InferenceSetup:
    """One inference run's configuration (validated by :meth:`from_kwargs`)."""

    weights: str = "bf16"
    dtype: str = "bfloat16"              # activations / 16-bit parts (compute dtype)
    group_size: int = 128                # GPTQ/AWQ group (-1: one group per column, GPTQ only)
    double_quant: bool = False           # bitsandbytes 4-bit (BitsAndBytesConfig default: off)
    kv_cache_dtype: str = "bfloat16"
    batch_size: int = 1
    context_len: int = 4096
    prompt_len: int = 4096
    attn_implementation: str = "sdpa"
    mla_cache: str = "compressed"
    use_sliding_window: bool = True
    logits: str = "last"
    gpu: Optional[str] = None
    gpu_memory_utilization: Optional[float] = None
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: Optional[int] = None   # None: the engine's default for the release
    block_size: int = BLOCK_SIZE
    engine: str = "hf"                   # "hf" (generate()), "vllm" or "sglang"
    versions: Dict[str, str] = field(default_factory=dict)
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    data_parallel: int = 1
    expert_parallel: int = 1
    enforce_eager: bool = False
    enable_chunked_prefill: Optional[bool] = None
    mem_fraction_static: Optional[float] = None
    disable_custom_all_reduce: bool = False
    #: the caching allocator's settings for generate()'s replay: "default", "expandable_segments"
    #: or a PYTORCH_CUDA_ALLOC_CONF string (allocator.parse_alloc_conf)
    allocator: str = "default"
    #: ``generate(min_new_tokens=...)``: with an EOS token, two logits processors copy the
    #: scores every step (generate_ops.sample)
    min_new_tokens: int = 0
    #: the batch's attention mask masks some positions (padded prompts, or a prompt holding
    #: ``pad_token_id`` when generate() infers the mask): a (b, 1, q, kv) mask is built, and
    #: SDPA repeats K/V to every head and runs its memory-efficient kernel
    padding: bool = False

    FIELDS = ("weights", "dtype", "group_size", "double_quant", "kv_cache_dtype", "batch_size", "context_len",
              "prompt_len", "attn_implementation", "mla_cache", "use_sliding_window", "logits", "gpu",
              "gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens", "block_size", "engine",
              "versions", "tensor_parallel", "pipeline_parallel", "data_parallel", "expert_parallel",
              "enforce_eager", "enable_chunked_prefill", "mem_fraction_static", "disable_custom_all_reduce",
              "allocator", "min_new_tokens", "padding")

    @property
    def serving(self) -> bool:
        """A serving engine (vLLM, SGLang) sizes a paged KV cache instead of generate()."""
        return self.engine in ("vllm", "sglang")

    @property
    def chunked_prefill_set(self) -> bool:
        return self.enable_chunked_prefill is not None and bool(self.enable_chunked_prefill)

    @property
    def num_gpus(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel * self.data_parallel

    @property
    def fmt_kind(self) -> str:
        w = self.weights
        if w in ("bf16", "fp16", "fp32"):
            return "dense"
        if w.startswith("gguf-"):
            return "gguf"
        if w.startswith("gptq"):
            return "gptq"
        if w.startswith("awq"):
            return "awq"
        if w.startswith("ct-"):
            return "ct"
        return w  # fp8, fp8-block, mxfp4, int8, nf4, fp4

    def to_dict(self) -> Dict[str, Any]:
        """A plain dict of this object (JSON-able)."""
        return {k: getattr(self, k) for k in self.FIELDS}

    def stored_weights_bytes(self, arch: Architecture) -> float:
        """Bytes of ``arch``'s weights + quantization constants as this setup's weight format
        stores them on the GPU (:func:`weight_storage`; ``engines.plan`` prices a GPU's share
        with it)."""
        return sum(x.weight_bytes + x.const_bytes for x in weight_storage(arch, self))

    @classmethod
    def from_kwargs(cls, **kw: Any) -> "InferenceSetup":
        check_keywords("inference setting", kw, cls.FIELDS)
        for name in ("weights", "dtype", "kv_cache_dtype", "attn_implementation", "mla_cache", "logits", "engine"):
            if kw.get(name) is not None:
                check_text(name, kw[name], max_chars=64, what="must be a name (text)")
        v: Dict[str, Any] = {}
        w = kw.get("weights")
        v["weights"] = _weights_format(w if w is not None else "bf16")
        kind = cls(weights=v["weights"]).fmt_kind
        d = kw.get("dtype")
        if v["weights"] in ("bf16", "fp16", "fp32"):
            natural = canonical_dtype(v["weights"])
            if d is not None and _dtype16("dtype", d, allow32=True) != natural:
                raise VramError(f"dtype: {v['weights']} weights compute in {natural}; leave dtype unset or use "
                                f"another weights format", field="dtype")
            v["dtype"] = natural
        else:
            default = "float16" if kind in ("gptq", "awq") else "bfloat16"
            v["dtype"] = _dtype16("dtype", d, allow32=False) if d is not None else default
        if kw.get("group_size") is not None:
            g = check_int("group_size", kw["group_size"], lo=1, also=(-1,),
                          what="must be a positive whole number (or -1 for GPTQ's one group per column)")
            if int(g) == -1 and kind == "awq":
                raise VramError("group_size: AWQ needs a positive group size (e.g. 128); -1 is GPTQ-only",
                                field="group_size")
            v["group_size"] = int(g)
        if kw.get("double_quant") is not None:
            check_bool("double_quant", kw["double_quant"])
            v["double_quant"] = kw["double_quant"]
        kvd = kw.get("kv_cache_dtype")
        if kvd is None or (isinstance(kvd, str) and kvd.strip().lower() == "auto"):
            v["kv_cache_dtype"] = v["dtype"]
        else:
            key = str(kvd).strip().lower()
            try:
                cd = canonical_dtype(key)
            except KeyError:
                cd = None
            if cd not in ("bfloat16", "float16", "float32", "float8"):
                raise VramError(f"kv_cache_dtype: unknown {shown(kvd)}; allowed: {', '.join(KV_CACHE_DTYPES)} (or auto: "
                                f"the compute dtype)", field="kv_cache_dtype")
            v["kv_cache_dtype"] = cd
        for name in ("batch_size", "context_len", "max_num_seqs", "max_num_batched_tokens", "block_size"):
            if kw.get(name) is not None:
                v[name] = _posint(name, kw[name])
        ctx = v.get("context_len", cls.context_len)
        if kw.get("prompt_len") is not None:
            p = _posint("prompt_len", kw["prompt_len"])
            if p > ctx:
                raise VramError(f"prompt_len: the prompt ({p} tokens) cannot be longer than context_len ({ctx}): "
                                f"context_len counts prompt and generated tokens", field="prompt_len")
            v["prompt_len"] = p
        else:
            v["prompt_len"] = ctx
        for name, allowed in (("attn_implementation", ATTN_IMPLEMENTATIONS), ("mla_cache", MLA_CACHE_CHOICES),
                              ("logits", LOGITS_CHOICES)):
            if kw.get(name) is not None:
                val = str(kw[name]).strip().lower()
                if val == "flash_attention" or val == "fa2":
                    val = "flash_attention_2"
                if val not in allowed:
                    raise VramError(f"{name}: unknown {shown(kw[name])}; allowed: {', '.join(allowed)}", field=name)
                v[name] = val
        if kw.get("use_sliding_window") is not None:
            check_bool("use_sliding_window", kw["use_sliding_window"])
            v["use_sliding_window"] = kw["use_sliding_window"]
        g = kw.get("gpu")
        if g is not None and g != "":
            from .gpus import get_gpu

            v["gpu"] = get_gpu(g).name
        for name in ("gpu_memory_utilization", "mem_fraction_static"):
            u = kw.get(name)
            if u is not None:
                check_number(name, u, lo=0, hi=1, lo_open=True, what="must be a fraction in (0, 1], e.g. 0.9")
                if v.get("gpu") is None:
                    raise VramError(f"{name}: a serving budget needs a GPU (set gpu, e.g. 'H100-80GB')",
                                    field="gpu")
                v[name] = float(u)
        eng = kw.get("engine")
        if eng is None or eng == "":
            eng = ("sglang" if v.get("mem_fraction_static") is not None
                   else "vllm" if v.get("gpu_memory_utilization") is not None else "hf")
        eng = str(eng).strip().lower()
        eng = {"transformers": "hf", "generate": "hf", "huggingface": "hf"}.get(eng, eng)
        if eng not in ENGINES:
            raise VramError(f"engine: unknown {shown(kw.get('engine'))}; allowed: {', '.join(ENGINES)}", field="engine")
        v["engine"] = eng
        if eng == "hf" and v.get("gpu_memory_utilization") is not None:
            raise VramError("engine: generate() ('hf') has no gpu_memory_utilization; use engine='vllm'",
                            field="engine")
        if eng in ("vllm", "sglang") and v.get("gpu") is None:
            raise VramError(f"gpu: the {eng} engine sizes its KV cache from a GPU's memory (set gpu, e.g. "
                            f"'H100-80GB')", field="gpu")
        if eng == "sglang" and v.get("gpu_memory_utilization") is not None:
            raise VramError("gpu_memory_utilization: the sglang engine's budget is mem_fraction_static", field="engine")
        if eng == "vllm" and v.get("mem_fraction_static") is not None:
            raise VramError("mem_fraction_static: that is the sglang engine's setting; the vllm engine uses "
                            "gpu_memory_utilization", field="engine")
        ver = kw.get("versions")
        if ver is not None:
            if isinstance(ver, str):
                ver = {eng if eng != "hf" else "vllm": ver}
            if not isinstance(ver, dict):
                raise VramError(f"versions: a dict like {{'vllm': '0.6.4'}}, got {shown(ver)}", field="versions")
            from .engines import check_release, parse_version

            for k2, val in ver.items():
                if k2 not in ("vllm", "vllm_runtime", "sglang", "transformers"):
                    raise VramError(f"versions: unknown key {shown(k2)}; allowed: vllm, vllm_runtime (v0 or v1), "
                                    f"sglang, transformers", field="versions")
                if k2 in ("vllm", "sglang"):
                    check_release(k2, val)
                elif k2 != "vllm_runtime":
                    parse_version(val)
            if "vllm" in ver or "vllm_runtime" in ver:
                from .engines import vllm_release

                vllm_release(ver.get("vllm"), ver.get("vllm_runtime"))
            v["versions"] = {str(k2): str(val) for k2, val in ver.items()}
        for name in ("tensor_parallel", "pipeline_parallel", "data_parallel", "expert_parallel"):
            if kw.get(name) is not None:   # GPUs of one deployment: at most inputs.MAX_GPUS
                v[name] = check_int(name, kw[name], lo=1, hi=MAX_GPUS)
        for name in ("enforce_eager", "disable_custom_all_reduce", "enable_chunked_prefill"):
            if kw.get(name) is not None:
                v[name] = check_bool(name, kw[name])
        if kw.get("allocator") is not None:
            from .training import check_allocator_conf

            v["allocator"] = check_allocator_conf(kw["allocator"])
        if kw.get("min_new_tokens") is not None:
            v["min_new_tokens"] = check_int("min_new_tokens", kw["min_new_tokens"], lo=0)
        if kw.get("padding") is not None:
            v["padding"] = check_bool("padding", kw["padding"])
        return cls(**v)


#: the transformers release assumed when ``versions`` does not name one (the installed 5.23,
#: whose source every rule here was read from)
DEFAULT_TRANSFORMERS = (5, 23, 0)


def transformers_version(s: "InferenceSetup") -> Tuple[int, ...]:
    """The transformers release ``s`` models, as a tuple of ints (``versions={"transformers": ...}``)."""
    v = (s.versions or {}).get("transformers")
    if not v:
        return DEFAULT_TRANSFORMERS
    from .engines import parse_version

    return tuple(parse_version(v))


def _weights_format(w: Any) -> str:
    if w is not None:
        check_text("weights", w, max_chars=64, what="must be a weights format name (text)")
    key = str(w).strip().lower().replace("_", "-") if w is not None else ""
    key = key.replace("gguf-", "gguf-", 1)
    if key.startswith("gguf-"):
        key = "gguf-" + key[5:].replace("-", "_")
    elif key.startswith("q") and key.replace("-", "_") in _GGUF_BASE:
        key = "gguf-" + key.replace("-", "_")
    key = _FORMAT_ALIASES.get(key, key)
    if key not in WEIGHT_FORMATS:
        close = close_match(key, list(WEIGHT_FORMATS), n=2)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise VramError(f"weights: unknown format {shown(w)}{hint}; allowed: {', '.join(WEIGHT_FORMATS)}",
                        field="weights")
    return key


def _dtype16(name: str, value: Any, allow32: bool) -> str:
    try:
        d = canonical_dtype(str(value))
    except KeyError:
        d = None
    ok = ("bfloat16", "float16") + (("float32",) if allow32 else ())
    if d not in ok:
        raise VramError(f"{name}: must be one of {', '.join(ok)}, got {shown(value)}", field=name)
    return d


def _posint(name: str, value: Any) -> int:
    return check_int(name, value, lo=1)


# ----------------------------------------------------------------------------------
# Weights by storage format
# ----------------------------------------------------------------------------------

@dataclass
class _Stored:
    """How one ParamTensor (all its repeats) is stored."""

    tensor: ParamTensor
    parts: List[Tuple[str, float, str, str]]   # (label, bytes, dtype, formula) of the weight itself
    consts: List[Tuple[str, float, str]]       # (label, bytes, formula) scales / zeros / g_idx / absmax

    @property
    def weight_bytes(self) -> float:
        return sum(p[1] for p in self.parts)

    @property
    def const_bytes(self) -> float:
        return sum(c[1] for c in self.consts)


def _dims(t: ParamTensor) -> Tuple[int, int, int]:
    """(matrices, in_features, out_features) of a linear tensor: experts x layers matrices."""
    n = t.repeat * max(t.experts, 1)
    return n, t.in_features, t.out_features


def weight_storage(arch: Architecture, s: InferenceSetup) -> List[_Stored]:
    """Every weight tensor as the chosen format stores it on the GPU."""
    kind = s.fmt_kind
    if kind == "gguf":
        return _gguf_storage(arch, s)
    out = []
    for t in arch.tensors:
        out.append(_store_one(arch, t, s, kind))
    return out


def _dense(t: ParamTensor, dtype: str, why: str = "") -> _Stored:
    b = DTYPE_BYTES[dtype]
    shape = " x ".join(map(str, t.shape))
    return _Stored(t, [(dtype, t.numel * b, dtype, f"{t.repeat} x {shape} x {b:g} B ({dtype}){why}")], [])


def _store_one(arch: Architecture, t: ParamTensor, s: InferenceSetup, kind: str) -> _Stored:
    c = s.dtype
    if kind == "dense":
        return _dense(t, canonical_dtype(s.weights))
    if kind in ("nf4", "fp4", "int8"):
        return _bnb(t, s, c)
    if kind == "mxfp4":
        return _mxfp4(t, c)
    linear = t.linear and not t.is_bias and t.role not in ("router",)
    if not linear:
        return _dense(t, "float16" if kind in ("gptq", "awq") else c,
                      "" if t.role not in ("embedding", "output_head") else ", not quantized")
    if kind == "fp8":
        n, _, o = _dims(t)
        return _Stored(t, [("float8", t.numel * 1.0, "float8", "n x 1 B (fp8 e4m3)")],
                       [("weight_scale (fp32 per output channel)", n * o * 4.0, f"{n} x {o} x 4 B")])
    if kind == "fp8-block":
        return _fp8_block(t, s)
    if kind == "ct":
        return _compressed_tensors(t, s)
    if kind == "gptq":
        return _gptq(t, s)
    if kind == "awq":
        return _awq(t, s)
    raise AssertionError(kind)


def _bnb(t: ParamTensor, s: InferenceSetup, c: str) -> _Stored:
    """bitsandbytes through transformers: the blocks' nn.Linear become Linear4bit/Linear8bitLt.

    4-bit (NF4/FP4): n/2 bytes + one fp32 absmax per 64 weights (0.5 bit/weight), or with
    double quantization an 8-bit absmax + one fp32 scale per 256 absmax (0.127 bit/weight).
    LLM.int8: n bytes + one fp32 scale (SCB) per output row.  Embeddings, the output head,
    norms and fused MoE expert tensors (not nn.Linear) stay in the compute dtype.
    """
    q = s.weights
    groups = ("attn_qk", "attn_vo", "mlp")
    if not quantizable(t, groups, experts_linear=transformers_version(s) < (5, 0)):
        why = ", not nn.Linear (stays 16-bit)" if t.experts else ""
        return _dense(t, c, why)
    if q == "int8":
        n, _, o = _dims(t)
        return _Stored(t, [("int8", t.numel * 1.0, "int8", "n x 1 B (int8 CB)")],
                       [("SCB (fp32 per output row)", n * o * 4.0, f"{n} x {o} x 4 B")])
    consts = quant_const_bytes(t.numel, q, s.double_quant)
    f = ("n/64 x 1 B (8-bit absmax) + n/64/256 x 4 B (fp32 scales)" if s.double_quant
         else "n/64 x 4 B (fp32 absmax)")
    return _Stored(t, [(q, t.numel * 0.5, q, "n x 0.5 B (4-bit)")], [("absmax", consts, f)])


def _mxfp4(t: ParamTensor, c: str) -> _Stored:
    """gpt-oss's experts as transformers' MXFP4 path holds them (``integrations/mxfp4.py``,
    ``Mxfp4GptOssExperts``: ``gate_up_proj`` (E, 2i, h/32, 16) and ``down_proj`` (E, h, i/32,
    16) uint8 blocks, two e2m1 values a byte; one uint8 e8m0 scale per 32 weights; the expert
    biases fp32), swizzled in place for the Triton kernels (``swizzle_mxfp4``); everything the
    checkpoint's ``modules_to_not_convert`` names (attention, router, embeddings, head) and the
    norms stay 16-bit.  Without the kernels (compute capability < 7.5, no Triton >= 3.4 or no
    ``kernels`` package) transformers dequantizes the experts to bf16 instead
    (``Mxfp4HfQuantizer.validate_environment``): weights='bf16'."""
    if t.experts and t.linear and not t.is_bias:
        n = t.numel
        return _Stored(t, [("mxfp4 blocks (uint8, 2 values a byte)", n / 2.0, "uint8", "n / 2 B")],
                       [("mxfp4 scales (uint8 e8m0 per 32)", n / 32.0, "n / 32 B")])
    if t.role in ("expert_gate_up", "expert_down") and not t.linear:
        return _dense(t, "float32", ", expert bias (fp32 in Mxfp4GptOssExperts)")
    return _dense(t, c, "" if t.role not in ("embedding", "output_head") else ", not quantized")


def _fp8_block(t: ParamTensor, s: InferenceSetup) -> _Stored:
    """Block-wise FP8 as transformers' ``FineGrainedFP8HfQuantizer`` loads it
    (``integrations/finegrained_fp8.py``, ``FP8Linear``): the weight (out, in) in e4m3 (1 B) and
    ``weight_scale_inv`` (ceil(out/B), ceil(in/B)) fp32 for blocks of B x B (``weight_block_size``,
    128 x 128 in DeepSeek-V3's and Qwen3's FP8 checkpoints; ``group_size`` here)."""
    n, i, o = _dims(t)
    blk = s.group_size if s.group_size > 0 else 128
    rows, cols = -(-o // blk), -(-i // blk)
    return _Stored(t, [("float8 e4m3", t.numel * 1.0, "float8", "n x 1 B")],
                   [(f"weight_scale_inv (fp32 per {blk} x {blk} block)", n * rows * cols * 4.0,
                     f"{n} x ceil({o}/{blk}) x ceil({i}/{blk}) x 4 B")])


def _compressed_tensors(t: ParamTensor, s: InferenceSetup) -> _Stored:
    """compressed-tensors checkpoints (llm-compressor) as transformers' ``CompressedTensorsHfQuantizer``
    keeps them compressed (``run_compressed``: ``CompressedLinear``): ``ct-w4a16`` pack-quantized
    int4, ``weight_packed`` int32 (out, in/8) + ``weight_scale`` (out, ceil(in/g)) in the compute
    dtype + ``weight_shape``; ``ct-w8a8`` int8 (out, in) + a per-channel scale; ``ct-fp8`` e4m3 +
    an fp32 per-channel scale."""
    n, i, o = _dims(t)
    c = DTYPE_BYTES[s.dtype]
    if s.weights == "ct-w4a16":
        G = _groups(i, s.group_size)
        return _Stored(t, [("weight_packed (int32, 8 x 4-bit)", t.numel * 0.5, "int32", "n / 2 B")],
                       [(f"weight_scale ({s.dtype} per group)", n * o * G * c, f"{n} x {o} x ceil({i}/{s.group_size}) x {c:g} B")])
    if s.weights == "ct-w8a8":
        return _Stored(t, [("int8", t.numel * 1.0, "int8", "n x 1 B")],
                       [(f"weight_scale ({s.dtype} per output channel)", n * o * c, f"{n} x {o} x {c:g} B")])
    return _Stored(t, [("float8 e4m3", t.numel * 1.0, "float8", "n x 1 B")],
                   [("weight_scale (fp32 per output channel)", n * o * 4.0, f"{n} x {o} x 4 B")])


def _groups(in_f: int, g: int) -> int:
    return 1 if g == -1 else -(-in_f // g)


def _gptq(t: ParamTensor, s: InferenceSetup) -> _Stored:
    """GPTQ (AutoGPTQ / GPTQModel layout), ``bits`` b and group size g (G = in/g groups):

    qweight int32 (in x b/32, out) = n x b/8 bytes; qzeros int32 (G, out x b/32) = G x out x b/8;
    scales fp16 (G, out) = G x out x 2; g_idx int32 (in) = in x 4 per matrix.
    (AutoGPTQ files also carry a zero fp16 bias per linear; transformers drops it for
    bias-free models, so it is not counted.)
    """
    bits = 8 if s.weights == "gptq-8bit" else 4
    n, i, o = _dims(t)
    G = _groups(i, s.group_size)
    gs = "in" if s.group_size == -1 else str(s.group_size)
    return _Stored(t, [(f"qweight (int32, {bits}-bit packed)", t.numel * bits / 8, "int32",
                        f"n x {bits}/8 B")],
                   [("scales (fp16)", n * G * o * 2.0, f"{n} x ceil({i}/{gs}) x {o} x 2 B"),
                    ("qzeros (int32, packed)", n * G * o * bits / 8, f"{n} x ceil({i}/{gs}) x {o} x {bits}/8 B"),
                    ("g_idx (int32)", n * i * 4.0, f"{n} x {i} x 4 B")])


def _awq(t: ParamTensor, s: InferenceSetup) -> _Stored:
    """AWQ GEMM layout, group size g (G = in/g): qweight int32 (in, out/8) = n/2 bytes;
    qzeros int32 (G, out/8) = G x out / 2 bytes; scales fp16 (G, out) = G x out x 2 bytes."""
    n, i, o = _dims(t)
    G = _groups(i, s.group_size)
    return _Stored(t, [("qweight (int32, 4-bit packed)", t.numel * 0.5, "int32", "n x 0.5 B")],
                   [("scales (fp16)", n * G * o * 2.0, f"{n} x ceil({i}/{s.group_size}) x {o} x 2 B"),
                    ("qzeros (int32, packed)", n * G * o * 0.5, f"{n} x ceil({i}/{s.group_size}) x {o} x 0.5 B")])


def _use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's rule for the half of attn_v / ffn_down layers a *_K_M mix keeps wider:
    the first and last eighth of the layers and every third layer between them."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def gguf_tensor_type(mix: str, category: str, layer: int, n_layers: int, arch: Architecture,
                     row: int) -> str:
    """The ggml type llama.cpp's ``llama_tensor_get_type`` picks for one 2-D tensor.

    ``mix`` is the ftype (``q4_k_m``), ``category`` one of token_embd, output, attn_q,
    attn_k, attn_v, attn_output, attn_qkv, ffn_down, other; ``row`` the row length (in
    features).  The rules, from llama.cpp's llama-quant.cpp (the mixes' published
    descriptions say the same; TheBloke's Llama-2 GGUF files of Aug 2023 agree to 3 digits):

    * output (and a tied token_embd): Q6_K (Q8_0 for Q8_0, Falcon, or a row that is not a
      multiple of the block); an untied token_embd keeps the mix's default type.
    * attn_v: Q4_K_M/Q5_K_M -> Q6_K on :func:`_use_more_bits` layers (half of them);
      Q4_K_S -> Q5_K on the first 4; Q3_K_M -> Q5_K on the first 2, Q4_K after; Q3_K_L ->
      Q5_K; Q2_K -> Q4_K with >= 4 query heads per KV head, else Q3_K.  Llama-70B-type
      (80 layers, GQA): Q3_K/Q4_K -> Q5_K.  8-expert models: Q8_0 (attn_k too).
    * ffn_down: Q4_K_M/Q5_K_M -> Q6_K on use_more_bits layers (Falcon Q4_K_M: Q6_K on the
      first 16th, Q5_K on use_more_bits, else Q4_K); Q4_K_S -> Q5_K on the first 8th;
      Q3_K_M -> Q5_K on the first 16th, Q4_K after; Q3_K_L -> Q5_K; Q2_K -> Q3_K.
    * attn_output: Q3_K_M -> Q4_K; Q3_K_L -> Q5_K; Q2_K -> Q3_K; 8 experts with a
      Q2-Q4 mix -> Q5_K.  Fused attn_qkv: Q4_K_M -> Q5_K, Q5_K_M -> Q6_K, Q3_K_M/L -> Q4_K.
    * A row length that is not a multiple of 256 falls back: Q2_K/Q3_K -> IQ4_NL,
      Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0 (F16 if not a multiple of 32 either).
    """
    base = _GGUF_BASE[mix]
    t = base
    if base == "F16":
        return "F16"
    gqa = arch.num_heads // max(arch.num_kv_heads, 1)
    n_expert = arch.num_experts
    falcon = arch.family.gguf_arch == "falcon"
    is70b = arch.family.gguf_arch == "llama" and arch.num_layers == 80 and arch.num_kv_heads < arch.num_heads
    if category == "output" or (category == "token_embd" and arch.tie_word_embeddings):
        if falcon or row % _GGML_BLOCK[base] != 0:
            t = "Q8_0"
        elif base != "Q8_0":
            t = "Q6_K"
    elif category == "token_embd":
        t = base
    elif category == "attn_v":
        if mix == "q2_k":
            t = "Q4_K" if gqa >= 4 else "Q3_K"
        elif mix == "q3_k_m":
            t = "Q5_K" if layer < 2 else "Q4_K"
        elif mix == "q3_k_l":
            t = "Q5_K"
        elif mix in ("q4_k_m", "q5_k_m") and _use_more_bits(layer, n_layers):
            t = "Q6_K"
        elif mix == "q4_k_s" and layer < 4:
            t = "Q5_K"
        if is70b and t in ("Q3_K", "Q4_K"):
            t = "Q5_K"
        if n_expert == 8:
            t = "Q8_0"
    elif category == "attn_k":
        if n_expert == 8:
            t = "Q8_0"
    elif category == "ffn_down":
        if mix == "q2_k":
            t = "Q3_K"
        elif mix == "q3_k_m":
            t = "Q5_K" if layer < n_layers // 16 else ("Q4_K" if not falcon or _use_more_bits(layer, n_layers)
                                                         else "Q3_K")
        elif mix == "q3_k_l":
            t = "Q4_K" if falcon else "Q5_K"
        elif mix == "q4_k_m":
            if falcon:
                t = "Q6_K" if layer < n_layers // 16 else ("Q5_K" if _use_more_bits(layer, n_layers) else "Q4_K")
            elif _use_more_bits(layer, n_layers):
                t = "Q6_K"
        elif mix == "q5_k_m" and _use_more_bits(layer, n_layers):
            t = "Q6_K"
        elif mix == "q4_k_s" and not falcon and layer < n_layers // 8:
            t = "Q5_K"
    elif category == "attn_output":
        if not falcon:
            if n_expert == 8:
                if mix in ("q2_k", "q3_k_s", "q3_k_m", "q4_k_s", "q4_k_m"):
                    t = "Q5_K"
            elif mix == "q2_k":
                t = "Q3_K"
            elif mix == "q3_k_m":
                t = "Q4_K"
            elif mix == "q3_k_l":
                t = "Q5_K"
        elif mix == "q3_k_l":
            t = "Q4_K"
    elif category == "attn_qkv":
        if mix in ("q3_k_m", "q3_k_l"):
            t = "Q4_K"
        elif mix == "q4_k_m":
            t = "Q5_K"
        elif mix == "q5_k_m":
            t = "Q6_K"
    if row % _GGML_BLOCK[t] != 0:
        t = _GGML_FALLBACK.get(t, t)
        if row % _GGML_BLOCK[t] != 0:
            t = "F16"
    return t


def _gguf_category(t: ParamTensor) -> Optional[str]:
    """llama.cpp's tensor category; None for tensors GGUF keeps in F32 (1-D, router)."""
    if len(t.shape) < 2 or t.is_bias or t.role in ("router", "norm", "embedding_norm", "attn_norm",
                                                      "position_embedding"):
        return None
    r = t.role
    if r == "embedding":
        return "token_embd"
    if r == "output_head":
        return "output"
    if r in ("attn_v",):
        return "attn_v"
    if r in ("attn_k",):
        return "attn_k"
    if r == "attn_o":
        return "attn_output"
    if r == "attn_qkv":
        return "attn_qkv"
    if r in ("mlp_down", "expert_down") or (r == "shared_expert" and t.module == "down_proj"):
        return "ffn_down"
    return "other"


def _gguf_storage(arch: Architecture, s: InferenceSetup) -> List[_Stored]:
    """Weights as llama.cpp holds a GGUF file's tensors: each 2-D tensor in the type
    :func:`gguf_tensor_type` picks (bytes = weights x bits per weight / 8, the ggml block
    sizes of :data:`GGML_BPW`); 1-D tensors (norms, biases) and the MoE router in F32."""
    mix = s.weights[5:]
    out = []
    for t in arch.tensors:
        cat = _gguf_category(t)
        shape = " x ".join(map(str, t.shape))
        if cat is None:
            out.append(_Stored(t, [("F32", t.numel * 4.0, "F32", f"{t.repeat} x {shape} x 4 B (F32)")], []))
            continue
        row = t.shape[-1]
        if t.layers is None:
            gt = gguf_tensor_type(mix, cat, 0, arch.num_layers, arch, row)
            out.append(_Stored(t, [(gt, t.numel * GGML_BPW[gt] / 8, gt,
                                    f"{shape} x {GGML_BPW[gt]:g}/8 B ({gt})")], []))
            continue
        first, last = t.layers
        counts: Dict[str, int] = {}
        for layer in range(first, last + 1):
            gt = gguf_tensor_type(mix, cat, layer, arch.num_layers, arch, row)
            counts[gt] = counts.get(gt, 0) + 1
        parts = []
        for gt, nl in counts.items():
            parts.append((f"{gt} ({nl} layers)" if len(counts) > 1 else gt, t.numel_each * nl * GGML_BPW[gt] / 8, gt,
                          f"{nl} x {shape} x {GGML_BPW[gt]:g}/8 B ({gt})"))
        out.append(_Stored(t, parts, []))
    return out


def weights_bytes(model: Model, weights: str = "bf16", **kw: Any) -> float:
    """Bytes of the weights plus their quantization constants in a storage format."""
    arch = load(model)
    s = InferenceSetup.from_kwargs(weights=weights, **kw)
    return sum(x.weight_bytes + x.const_bytes for x in weight_storage(arch, s))


# ----------------------------------------------------------------------------------
# The KV cache
# ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class KVLayout:
    """What one layer caches per token: ``k_elems`` + ``v_elems`` elements of ``elem_bytes``."""

    k_elems: int
    v_elems: int
    elem_bytes: float
    full_layers: int
    sliding_layers: int
    window: Optional[int]
    kind: str            # "kv heads" or "mla latent" or "mla decompressed"
    formula: str
    #: a hybrid's other layers: a fixed-size state per sequence (conv / linear attention / SSM)
    state_bytes_per_seq: float = 0.0

    @property
    def layer_bytes_per_token(self) -> float:
        return (self.k_elems + self.v_elems) * self.elem_bytes

    @property
    def bytes_per_token(self) -> float:
        """All layers, no window: what each new token of one sequence adds (until a window fills)."""
        return self.layer_bytes_per_token * (self.full_layers + self.sliding_layers)

    def layer_tokens(self, tokens: int, sliding: bool) -> int:
        """Tokens whose storage a layer holds: a sliding layer min(S, W) after a decode step."""
        if sliding and self.window:
            return min(tokens, self.window)
        return tokens


def kv_layout(arch: Architecture, kv_dtype: str = "bfloat16", mla_cache: str = "compressed",
              use_sliding_window: bool = True) -> KVLayout:
    """Per layer and token: keys and values of every KV head, 2 x kv x d elements (GQA/MQA
    share heads; MoE changes nothing).  MLA (DeepSeek-V2/V3) as transformers 5 caches it:
    the normalised latent (kv_lora_rank) + the rotary key (qk_rope_head_dim); decompressed:
    a x (d_nope + d_rope) keys + a x d_v values."""
    eb = DTYPE_BYTES[kv_dtype]
    L = arch.num_layers if arch.kv_cache_layers is None else arch.kv_cache_layers
    sl = arch.sliding_layers if (use_sliding_window and arch.sliding_window) else 0
    window = arch.sliding_window if sl else None
    if arch.mla:
        m = arch.mla
        if mla_cache == "compressed":
            k, v = m["kv_lora_rank"], m["qk_rope_head_dim"]
            return KVLayout(k, v, eb, L - sl, sl, window, "mla latent",
                            f"(kv_lora_rank {k} + qk_rope_head_dim {v}) x {eb:g} B")
        a = arch.num_heads
        k = a * (m["qk_nope_head_dim"] + m["qk_rope_head_dim"])
        v = a * m["v_head_dim"]
        return KVLayout(k, v, eb, L - sl, sl, window, "mla decompressed",
                        f"a x (d_nope + d_rope) + a x d_v = {k} + {v} elements x {eb:g} B")
    kvd = arch.num_kv_heads * arch.head_dim
    # the fixed-size states live in the model's dtype (transformers' hybrid caches allocate
    # them like the keys), whatever the KV cache's own dtype
    return KVLayout(kvd, kvd, eb, L - sl, sl, window, "kv heads",
                    f"2 x kv {arch.num_kv_heads} x d {arch.head_dim} x {eb:g} B",
                    state_bytes_per_seq=arch.state_elems_per_seq * max(eb, 2.0))


def kv_cache_bytes(model: Model, tokens: int, *, batch_size: int = 1, kv_cache_dtype: str = "bfloat16",
                   mla_cache: str = "compressed", use_sliding_window: bool = True) -> float:
    """KV-cache bytes of ``batch_size`` sequences of ``tokens`` tokens each (after a decode
    step: sliding layers hold min(tokens, W))."""
    arch = load(model)
    s = InferenceSetup.from_kwargs(kv_cache_dtype=kv_cache_dtype, batch_size=batch_size, context_len=tokens,
                                   mla_cache=mla_cache, use_sliding_window=use_sliding_window)
    lay = kv_layout(arch, s.kv_cache_dtype, s.mla_cache, s.use_sliding_window)
    return _kv_node(lay, s.batch_size, tokens, window_applies=True).bytes


def _kv_node(lay: KVLayout, b: int, tokens: int, window_applies: bool) -> Node:
    node = Node("kv cache")
    if lay.state_bytes_per_seq:
        node.add(Node("fixed-size state of the conv / linear-attention layers", bytes=b * lay.state_bytes_per_seq,
                      formula=f"b {b} x {lay.state_bytes_per_seq:g} B per sequence (does not grow with S)"))
    names = ("latent (kv_lora_rank)", "rotary key (qk_rope_head_dim)") if lay.kind == "mla latent" \
        else ("keys", "values")
    for label, n_layers, sliding in (("full-attention layers", lay.full_layers, False),
                                     ("sliding-window layers", lay.sliding_layers, True)):
        if not n_layers:
            continue
        S = lay.layer_tokens(tokens, sliding) if window_applies else tokens
        grp = node.add(Node(f"{label} ({n_layers})"))
        why = f", min(S, W={lay.window})" if sliding and window_applies and lay.window else ""
        for nm, el in zip(names, (lay.k_elems, lay.v_elems)):
            grp.add(Node(nm, bytes=b * S * n_layers * el * lay.elem_bytes, count=b * S * n_layers * el,
                         formula=f"b {b} x S {S}{why} x {n_layers} layers x {el} x {lay.elem_bytes:g} B"))
    return node.finalize()


# ----------------------------------------------------------------------------------
# Working sets of one layer (prefill) and one decode step
# ----------------------------------------------------------------------------------

def attention_kernel(arch: Architecture, s: InferenceSetup, masked: bool) -> str:
    """The attention kernel: eager, flash/efficient (no scores kept), or math (scores)."""
    from .activations import attention_backend

    if s.attn_implementation == "eager":
        return "eager"
    be = attention_backend(arch, SimpleNamespace(attn_implementation=s.attn_implementation,
                                                 gradient_checkpointing="none"), s.dtype)
    if be == "eager":
        return "eager"
    if masked and be == "flash":
        return "efficient"   # a materialised mask rules out the flash kernel
    return be


def _items(*pairs: Tuple[str, float, str]) -> List[Tuple[str, float, str]]:
    return [p for p in pairs if p[1] > 0]


def layer_steps(arch: Architecture, s: InferenceSetup, q: int, S: int) -> Dict[str, List[Tuple[str, float, str]]]:
    """The live tensors at each step of one decoder layer for b x q new tokens against S
    cached ones (prefill: q = S = p; decode: q = 1), without the KV cache itself.

    residual stream and the normed input (T x h each) are live throughout; then
    norm        RMSNorm's fp32 upcast and product: T x h x 8 B
    q/k/v+rope  q, k, v projections + RoPE's temporaries for q: T x ((a + 2kv) d + 3 a d)
    attention   q after RoPE + the backend's tensors (eager: repeated K/V 2 x b x a x S x d,
                scores (2c + 4) x b x a x q x S; flash: output + its transposed copy, 2 T a d)
    mlp         gated: act(gate), up and their product, 3 x T x i (Phi-3 fused: 4 T i;
                plain GELU MLPs: fc output + activation, 2-4 x T x i)
    experts     sorted token copies + gate_up + act + product: T k (h + 4 i_e) (grouped_mm)
    """
    c = DTYPE_BYTES[s.dtype]
    b = s.batch_size
    T = b * q
    h, a, kv, d = arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim
    base = [("residual stream", T * h * c, "T x h"), ("normed layer input", T * h * c, "T x h")]
    steps: Dict[str, List[Tuple[str, float, str]]] = {}
    steps["norm"] = _items(("residual stream", T * h * c, "T x h"),
                           ("RMSNorm fp32 upcast + product", T * h * 8.0, "T x h x 2 x 4 B"))
    masked = bool(arch.sliding_window and arch.sliding_layers and s.use_sliding_window
                  and S >= arch.sliding_window and q > 1)
    be = attention_kernel(arch, s, masked)
    n_rep = a // max(kv, 1)
    if arch.mla:
        m = arch.mla
        qh = m["qk_nope_head_dim"] + m["qk_rope_head_dim"]
        steps["q/k/v projections"] = base + _items(
            ("q projection", T * a * qh * c, "T x a x (d_nope + d_rope)"),
            ("query_states (q_nope, q_rope concatenated)", T * a * qh * c, "T x a x d_qk"),
            ("compressed kv", T * (m["kv_lora_rank"] + m["qk_rope_head_dim"]) * c, "T x (r_kv + d_rope)"))
        expand = [("kv_b_proj output (k_nope, v of every head)", b * S * a * (m["qk_nope_head_dim"] + m["v_head_dim"]) * c,
                   "b x S x a x (d_nope + d_v)"),
                  ("key_states (expanded)", b * S * a * qh * c, "b x a x S x d_qk")]
        if s.mla_cache == "decompressed":
            expand = []
        core = _core(arch, s, be, b, q, S, qh, m["v_head_dim"], 1, c)
        steps["attention"] = base + _items(("query_states", T * a * qh * c, "T x a x d_qk"), *expand, *core)
    else:
        steps["q/k/v projections + RoPE"] = base + _items(
            ("q, k, v projections", T * (a + 2 * kv) * d * c, "T x (a + 2 kv) x d"),
            ("RoPE temporaries (q x cos, rotate_half(q) x sin, sum)", 3 * T * a * d * c, "3 x T x a x d"))
        core = _core(arch, s, be, b, q, S, d, d, n_rep, c, masked=masked)
        steps["attention"] = base + _items(("q after RoPE", T * a * d * c, "T x a x d"), *core)
    i = arch.intermediate_size
    if arch.is_moe:
        E, k, ie = arch.num_experts, arch.experts_per_token, arch.expert_intermediate_size
        Tk = T * k
        steps["experts"] = base + _items(
            ("router logits + fp32 softmax", T * E * (c + 4), "T x E x (c + 4 B)"),
            ("tokens sorted to experts", Tk * h * c, f"T x k x h (k={k})"),
            ("expert gate_up output", Tk * 2 * ie * c, "T x k x 2 i_e"),
            ("act(gate) and act(gate) * up", Tk * 2 * ie * c, "2 x T x k x i_e"))
        if arch.shared_expert_intermediate_size:
            ish = arch.shared_expert_intermediate_size
            steps["shared experts"] = base + _items(("routed experts output", T * h * c, "T x h"),
                                                    ("shared expert act, up, product", 3 * T * ish * c,
                                                     "3 x T x i_shared"))
        if arch.dense_layers:
            i_dense = int(arch.config.get("intermediate_size") or i)
            steps["mlp (dense layers)"] = base + _items(("act(gate), up, product", 3 * T * i_dense * c, "3 x T x i"))
    else:
        steps["mlp"] = base + _items(*arch.family.inference_mlp(arch, T, c))
    return steps


def _core(arch: Architecture, s: InferenceSetup, be: str, b: int, q: int, S: int, dqk: int, dv: int, n_rep: int,
          c: float, masked: bool = False) -> List[Tuple[str, float, str]]:
    a = arch.num_heads
    T = b * q
    out: List[Tuple[str, float, str]] = []
    scores = b * a * q * S
    if be == "eager":
        if n_rep > 1:
            out.append(("K and V repeated to every head (repeat_kv)", 2 * b * a * S * dqk * c, "2 x b x a x S x d"))
        out.append(("scores, fp32 softmax, probabilities", scores * (2 * c + 4), "b x a x q x S x (2c + 4 B)"))
        if arch.attn_logit_softcapping:
            out.append(("soft-capped scores (tanh)", scores * c, "b x a x q x S"))
        out.append(("attention output", T * a * dv * c, "T x a x d_v"))
        return out
    if be == "math":
        if n_rep > 1:
            out.append(("K and V repeated to every head (math kernel)", 2 * b * a * S * dqk * c, "2 x b x a x S x d"))
        out.append(("scores and softmax (math SDPA kernel)", 2 * scores * c, "2 x b x a x q x S"))
        out.append(("attention output + transposed copy", 2 * T * a * dv * c, "2 x T x a x d_v"))
        return out
    if masked and q > 1:
        if n_rep > 1:
            out.append(("K and V repeated to every head (a mask disables enable_gqa)", 2 * b * a * S * dqk * c,
                        "2 x b x a x S x d"))
        out.append(("bool mask converted to an additive mask by SDPA", b * q * S * c, "b x q x S x c"))
    out.append(("attention output + transposed copy", 2 * T * a * dv * c, "2 x T x a x d_v"))
    return out


def _pick(steps: Dict[str, List[Tuple[str, float, str]]]) -> Tuple[str, List[Tuple[str, float, str]]]:
    name = max(steps, key=lambda k: sum(x[1] for x in steps[k]))
    return name, steps[name]


def _persistent_prefill(arch: Architecture, s: InferenceSetup, q: int, S: int) -> List[Tuple[str, float, str]]:
    """Tensors that live for the whole forward: RoPE's cos/sin and any attention mask."""
    c = DTYPE_BYTES[s.dtype]
    b = s.batch_size
    out = []
    rope = arch.mla["qk_rope_head_dim"] if arch.mla else arch.head_dim
    if arch.family.rotary:
        out.append(("RoPE cos and sin", 2 * b * q * rope * c, "2 x b x q x d_rope"))
    if attention_kernel(arch, s, False) == "eager":
        n_masks = 2 if (arch.sliding_layers and arch.sliding_layers < arch.num_layers) else 1
        out.append(("causal mask (additive)", n_masks * b * q * S * c,
                    f"{n_masks} x b x q x S" if n_masks > 1 else "b x q x S"))
    elif arch.sliding_window and arch.sliding_layers and s.use_sliding_window and S >= arch.sliding_window and q > 1:
        out.append(("sliding-window mask (bool)", b * q * S * 1.0, "b x q x S x 1 B"))
    return out


def dequant_transients(stored: List[_Stored], s: InferenceSetup, tokens: int) -> List[Tuple[str, float, str]]:
    """bitsandbytes dequantizes a 4-bit weight to 16-bit for a matmul of more than one token;
    LLM.int8 makes int8 inputs and an int32 accumulator (T x out x 4 B)."""
    c = DTYPE_BYTES[s.dtype]
    if s.weights in ("nf4", "fp4") and tokens > 1:
        big = max((x.tensor.numel_each for x in stored if x.consts), default=0)
        return _items(("dequantized 4-bit weight (largest linear)", big * c, "largest linear x c"))
    if s.weights == "int8":
        lin = [x.tensor for x in stored if x.consts]
        if lin:
            o = max(t.out_features for t in lin)
            i = max(t.in_features for t in lin)
            return _items(("LLM.int8 int8 input + int32 accumulator", tokens * (i + 4 * o), "T x (in + 4 x out)"))
    return []


def decode_transients(arch: Architecture, s: InferenceSetup, lay: KVLayout, stored: List[_Stored]
                      ) -> List[Tuple[str, float, str]]:
    """One decode step (q = 1, T = b) at S = context_len cached tokens, beyond the cache:

    * ``DynamicLayer.update`` appends with ``torch.cat``: the old and new keys (or values)
      of one layer coexist, max(k, v) x b x S bytes (HF's fp8 cache instead dequantizes a
      layer's keys and values: b x S x kv x d x (2c + 8) B);
    * eager attention: repeat_kv copies and b x a x S scores (see :func:`layer_steps`);
    * MLA: the expanded K/V of one layer;
    * MoE on a GPU: ``batched_mm`` gathers the selected experts' weights, b x k x 3 x i_e x h.
    """
    b = s.batch_size
    S = s.context_len
    c = DTYPE_BYTES[s.dtype]
    out: List[Tuple[str, float, str]] = []
    if s.kv_cache_dtype == "float8" and not s.serving:
        out.append(("fp8 cache dequantized for one layer (k in c, v in fp32 x 2 + c)",
                    b * S * lay.k_elems * (2 * c + 8), "b x S x kv x d x (2c + 8 B)"))
    else:
        el = max(lay.k_elems, lay.v_elems)
        out.append(("torch.cat copy of one layer's keys (cache growth)", b * S * el * lay.elem_bytes,
                    f"b x S x {el} x {lay.elem_bytes:g} B"))
    steps = layer_steps(arch, s, 1, S)
    att = [x for x in steps["attention"] if x[0] not in ("residual stream", "normed layer input")]
    out += [x for x in att if x[1] > 0]
    if arch.is_moe:
        ex = [x for x in stored if x.tensor.experts]
        wb = max((x.weight_bytes / max(x.tensor.numel, 1) for x in ex), default=c)
        if wb >= 2:   # 16/32-bit fused experts go through batched_mm
            k, ie, h = arch.experts_per_token, arch.expert_intermediate_size, arch.hidden_size
            out.append(("expert weights gathered by batched_mm (one layer)", b * k * 3 * ie * h * wb,
                        f"b x k x 3 x i_e x h x {wb:g} B"))
    return out


def logits_items(arch: Architecture, s: InferenceSetup, q: int, first: bool) -> List[Tuple[str, float, str]]:
    """generate() sets ``logits_to_keep=1``: the head runs on the last position only, b x V
    in the compute dtype, and generate keeps an fp32 copy (``.to(copy=True, dtype=float32)``).
    ``logits="all"`` (a plain forward) computes b x q x V and no fp32 copy."""
    c = DTYPE_BYTES[s.dtype]
    b, V = s.batch_size, arch.vocab_size
    if first and s.logits == "all":
        return _items(("logits (every position)", b * q * V * c, "b x q x V"))
    items = _items(("logits (last position)", b * V * c, "b x V"),
                   ("next-token logits, fp32 copy", b * V * 4.0, "b x V x 4 B"))
    return items if first else items + generation_temporaries(arch, s)


def generation_temporaries(arch: Architecture, s: "InferenceSetup") -> List[Tuple[str, float, str]]:
    """What ``generate()``'s decoding loop holds beyond the model's forward and the current
    step's logits (transformers/generation/utils.py ``_sample``).

    ``next_token_logits = outputs.logits[:, -1, :].to(copy=True, dtype=torch.float32)`` and
    ``next_token_scores = logits_processor(input_ids, next_token_logits)`` are plain
    variables of the loop: the previous step's fp32 scores are still referenced while the
    next step's forward runs and its fp32 copy is made (b x V x 4 B).  Seen in a CPU trace of
    real ``generate()`` calls (tests/test_inference_trace.py).  Logits processors add more
    when they are on (``min_new_tokens``/``min_length``: ``scores.clone()`` and a
    ``torch.where`` result, b x V x 4 B each, plus an int64 arange and a bool mask over the
    vocabulary); attention-mask, ``cache_position`` and token-id growth are b x tokens
    integers, and greedy ``argmax`` b values: negligible beside these.
    """
    b, V = s.batch_size, arch.vocab_size
    return _items(("previous step's next-token scores (fp32, held by the loop)", b * V * 4.0, "b x V x 4 B"))


# ----------------------------------------------------------------------------------
# The estimate
# ----------------------------------------------------------------------------------

class InferenceEstimate(Estimate):
    """An :class:`~vramwidget.result.Estimate` of inference, with the KV-cache figures.

    ``kv_cache_bytes``: the cache at ``context_len`` tokens for the batch (decode);
    ``kv_cache_prefill_bytes``: the cache right after the prefill (sliding layers still
    hold the prompt); ``kv_bytes_per_token``: every layer's K/V for one token (no window);
    ``weights_bytes``: weights + quantization constants; ``serving``: with
    ``gpu_memory_utilization``, the paged KV budget (tokens, blocks, concurrent sequences);
    ``fits``: whether the device total fits the GPU (when a GPU is given).
    """

    def __init__(self, *args: Any, kv_cache_bytes: float = 0.0, kv_cache_prefill_bytes: float = 0.0,
                 kv_bytes_per_token: float = 0.0, weights_bytes: float = 0.0,
                 serving: Optional[Dict[str, Any]] = None, gpu: Optional[str] = None,
                 gpu_usable_bytes: Optional[float] = None, fits: Optional[bool] = None, **kw: Any):
        super().__init__(*args, **kw)
        self.kv_cache_bytes = kv_cache_bytes
        self.kv_cache_prefill_bytes = kv_cache_prefill_bytes
        self.kv_bytes_per_token = kv_bytes_per_token
        self.weights_bytes = weights_bytes
        self.serving = serving
        self.gpu = gpu
        self.gpu_usable_bytes = gpu_usable_bytes
        self._fits = fits

    @property
    def fits(self) -> Optional[bool]:
        """Whether the device total fits the GPU's usable memory (None without a GPU); a
        serving budget sets it from the KV pool.  Read lazily: it runs the allocator replay."""
        if self._fits is not None or self.gpu_usable_bytes is None:
            return self._fits
        from .gpus import fits

        return fits(self.device_total_bytes, self.gpu_usable_bytes)

    @fits.setter
    def fits(self, value: Optional[bool]) -> None:
        self._fits = value

    @property
    def assumes(self) -> str:
        """The weight format and the transformers (or engine) behaviour this estimate assumes."""
        return assumptions(self)

    def to_dict(self) -> Dict[str, Any]:
        """A plain dict of this object (JSON-able)."""
        d = super().to_dict()
        d.update({"mode": "serving" if self.serving else "generate", "assumes": self.assumes,
                  "kv_cache_bytes": int(round(self.kv_cache_bytes)),
                  "kv_cache_gib": round(self.kv_cache_bytes / GIB, 4),
                  "kv_cache_prefill_bytes": int(round(self.kv_cache_prefill_bytes)),
                  "kv_bytes_per_token": self.kv_bytes_per_token,
                  "weights_bytes": int(round(self.weights_bytes)),
                  "gpu": self.gpu, "fits": self.fits, "serving": self.serving})
        d.pop("params_trainable", None)
        d.pop("flops_per_step", None)
        d.pop("recompute_overhead", None)
        return d

    def __repr__(self) -> str:
        extra = ""
        if self.serving:
            extra = f", serving {self.serving['kv_tokens']} KV tokens / {self.serving['max_concurrent_sequences']} seqs"
        return (f"InferenceEstimate({self.model_name!r}, peak {self.peak_gib:.2f} GiB at {self.peak_phase}, "
                f"KV cache {self.kv_cache_bytes / GIB:.2f} GiB{extra})")


def format_from_config(config: Any) -> Tuple[Dict[str, Any], str]:
    """The weight format a checkpoint ships in, from its config.json's ``quantization_config``
    (the keys transformers' quantizers read: ``quant_method`` and their own), as
    :func:`estimate_inference` keywords and a note; ``({}, "")`` when it names none we model.

    mxfp4 (gpt-oss) -> ``mxfp4``; fp8 with ``weight_block_size`` -> ``fp8-block``, without ->
    ``fp8``; gptq (``bits``, ``group_size``) -> ``gptq-4bit`` / ``gptq-8bit``; awq -> ``awq-4bit``;
    bitsandbytes (``load_in_4bit`` + ``bnb_4bit_quant_type``, ``load_in_8bit``) -> nf4 / fp4 /
    int8; compressed-tensors (the first ``config_groups`` entry's ``weights``: int 4 -> ct-w4a16,
    int 8 -> ct-w8a8, float 8 -> ct-fp8)."""
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    if not isinstance(qc, dict):
        return {}, ""
    m = str(qc.get("quant_method", "")).lower()
    kw: Dict[str, Any] = {}
    if m == "mxfp4":
        kw["weights"] = "mxfp4"
    elif m == "fp8":
        blk = qc.get("weight_block_size")
        if isinstance(blk, (list, tuple)) and blk:
            kw.update(weights="fp8-block", group_size=int(blk[0]))
        else:
            kw["weights"] = "fp8"
    elif m == "gptq":
        kw["weights"] = "gptq-8bit" if int(qc.get("bits", 4) or 4) == 8 else "gptq-4bit"
        if qc.get("group_size") is not None:
            kw["group_size"] = int(qc["group_size"])
    elif m == "awq":
        kw["weights"] = "awq-4bit"
        if qc.get("group_size") or qc.get("q_group_size"):
            kw["group_size"] = int(qc.get("group_size") or qc.get("q_group_size"))
    elif m == "bitsandbytes":
        if qc.get("load_in_4bit"):
            kw["weights"] = str(qc.get("bnb_4bit_quant_type", "nf4") or "nf4").lower()
            kw["double_quant"] = bool(qc.get("bnb_4bit_use_double_quant", False))
        elif qc.get("load_in_8bit"):
            kw["weights"] = "int8"
    elif m == "compressed-tensors":
        groups = qc.get("config_groups") or {}
        first = next(iter(groups.values()), {}) if isinstance(groups, dict) else {}
        w = first.get("weights") or {} if isinstance(first, dict) else {}
        bits, typ = int(w.get("num_bits", 8) or 8), str(w.get("type", "int")).lower()
        if typ == "float":
            kw["weights"] = "ct-fp8"
        elif bits == 4:
            kw["weights"] = "ct-w4a16"
            if w.get("group_size"):
                kw["group_size"] = int(w["group_size"])
        else:
            kw["weights"] = "ct-w8a8"
    if not kw:
        return {}, ""
    desc = ", ".join(f"{k}={v}" for k, v in kw.items())
    return kw, (f"weights: the checkpoint's config.json ships quantization_config (quant_method {m}): {desc} "
                f"assumed; pass weights= to override")


def _legacy_attention(setup: Dict[str, Any]) -> Tuple[Dict[str, Any], str]:
    """transformers < 4.36 had no SDPA path for its decoders (``_supports_sdpa`` came with 4.36):
    generate() ran the eager attention there, whatever ``sdpa`` asked."""
    ver = (setup.get("versions") or {}).get("transformers") if isinstance(setup.get("versions"), dict) else None
    if not ver:
        return setup, ""
    from .engines import parse_version

    if tuple(parse_version(ver)) < (4, 36) and str(setup.get("attn_implementation") or "sdpa").lower() == "sdpa":
        return {**setup, "attn_implementation": "eager"}, (f"attention: transformers {ver} has no SDPA path (4.36 "
                                                           f"added it): eager attention assumed")
    return setup, ""


def assumptions(est: "InferenceEstimate") -> str:
    """One line: the weight format and the transformers (or engine) behaviour the estimate assumes."""
    s = est.setup
    fmt = s.get("weights", "bf16")
    what = WEIGHT_FORMATS.get(fmt, fmt).split(":")[0]
    if est.serving:
        v = est.serving
        return f"weights {fmt} ({what}); {v['engine']} {v['version']} ({v['runtime']}) start-up: {v['budget_rule']}"
    ver = tuple((s.get("versions") or {}).get("transformers", "").split(".")) if (s.get("versions") or {}).get(
        "transformers") else None
    v = transformers_version(InferenceSetup(versions=s.get("versions") or {}))
    parts = [f"weights {fmt} ({what})",
             f"transformers {'.'.join(map(str, v[:2]))}{'' if ver else ' (the installed release)'} generate()"]
    parts.append("the legacy tuple cache: the previous step's keys and values live until the next step "
                 "(< 4.36)" if v < (4, 36) else "DynamicCache grown by torch.cat, one layer at a time")
    parts.append("every position's logits upcast in the model (< 4.45)" if v < (4, 45)
                 else "the last position's logits (logits_to_keep=1) and an fp32 copy")
    if s.get("min_new_tokens"):
        parts.append("min_new_tokens' logits processors")
    parts.append("a padded batch's mask" if s.get("padding") else "no padding (no mask for SDPA)")
    parts.append(f"{s.get('attn_implementation')} attention")
    return "; ".join(parts)


def with_shipped_format(arch: Architecture, setup: Dict[str, Any]) -> Tuple[Dict[str, Any], str]:
    """``setup`` with the checkpoint's own format (:func:`format_from_config`) where it names no
    ``weights``, and the note that says which was assumed; an explicit ``weights`` wins (the
    note then says what the checkpoint ships)."""
    shipped, note = format_from_config(arch.config)
    if not shipped:
        return dict(setup), ""
    if setup.get("weights") is None:
        return {**shipped, **{k: v for k, v in setup.items() if v is not None}}, note
    if _weights_format(setup["weights"]) != shipped["weights"]:
        return dict(setup), (f"weights: {setup['weights']} as asked; the checkpoint ships {shipped['weights']} "
                             f"(its config.json's quantization_config)")
    return dict(setup), ""


def estimate_inference(model: Model, **setup: Any) -> InferenceEstimate:
    """Estimate the GPU memory of running ``model`` for inference.

    Parameters
    ----------
    model:
        A preset name, config.json path or dict, Hub id, Architecture or parameter count.
    weights:
        Storage format: ``bf16``, ``fp16``, ``fp32``, ``fp8``, ``int8``, ``nf4``, ``fp4``,
        ``gptq-4bit``, ``gptq-8bit``, ``awq-4bit``, ``gguf-q4_k_m`` and the other GGUF mixes
        (:data:`WEIGHT_FORMATS`).  GGUF sizes are llama.cpp's resident weights (transformers
        dequantizes a GGUF file on load: use bf16 for that).
    dtype:
        Compute dtype of quantized formats (default bf16; fp16 for GPTQ/AWQ).
    group_size, double_quant:
        GPTQ/AWQ group size (default 128; -1 = none, GPTQ); bitsandbytes double quantization.
    kv_cache_dtype:
        ``bf16``, ``fp16``, ``fp32`` or ``fp8`` (default: the compute dtype).
    batch_size, context_len, prompt_len:
        Sequences, tokens per sequence at the end (prompt + generated), prompt tokens
        (default: the whole context is the prompt, the worst case for the prefill).
    attn_implementation:
        ``sdpa`` (default), ``eager`` or ``flash_attention_2``.
    mla_cache, use_sliding_window, logits:
        ``compressed``/``decompressed`` MLA cache; False caches sliding layers in full;
        ``last`` (generate) or ``all`` (a plain forward's logits for every position).
    gpu, gpu_memory_utilization, max_num_seqs, max_num_batched_tokens, block_size:
        A GPU from the catalog (fit check); with a utilization, the vLLM-style serving
        budget instead of generate().
    device_map, max_memory:
        generate() on transformers' ``device_map`` split (``"auto"``, ``"balanced"``,
        ``"balanced_low_0"``, ``"sequential"`` or a mapping) with ``max_memory`` per device: a
        :class:`vramwidget.device_map.SplitInference` with each GPU's estimate.

    Raises
    ------
    VramError
        naming the field that is wrong and what is allowed.
    """
    if "device_map" in setup or "max_memory" in setup:
        # transformers' device_map split: each GPU's own estimate (vramwidget/device_map.py)
        from .device_map import estimate_inference_split

        return estimate_inference_split(model, setup.pop("device_map", "auto"), setup.pop("max_memory", None), **setup)
    arch = load(model)
    setup, note = with_shipped_format(arch, setup)
    setup, eager_note = _legacy_attention(setup)
    s = InferenceSetup.from_kwargs(**setup)
    est = estimate_inference_setup(arch, s)
    for n in (eager_note, note):
        if n:
            est.notes.insert(0, n)
    if est.provisional_device_total_bytes > MAX_BYTES:   # an input error, not an estimate (no replay run)
        field = "model" if est.phases_bytes.get("after_load", 0.0) > MAX_BYTES else "context_len"
        check_total(est.provisional_device_total_bytes, "this inference run" if field != "model" else f"{arch.name}'s weights",
                    {field: arch.name if field == "model" else s.context_len, "batch_size": s.batch_size})
    return est


def _group_node(name: str, stored: List[_Stored], consts: bool) -> Node:
    top = Node(name)
    groups: Dict[str, Node] = {}
    for x in stored:
        g = groups.get(x.tensor.group)
        if g is None:
            g = groups[x.tensor.group] = top.add(Node(x.tensor.group))
        if consts:
            for label, nbytes, formula in x.consts:
                g.add(Node(f"{x.tensor.name} {label}", bytes=nbytes, formula=formula))
        elif len(x.parts) == 1:
            label, nbytes, dtype, formula = x.parts[0]
            g.add(Node(x.tensor.name, bytes=nbytes, dtype=dtype, count=x.tensor.numel, formula=formula))
        else:
            sub = g.add(Node(x.tensor.name))
            for label, nbytes, dtype, formula in x.parts:
                sub.add(Node(label, bytes=nbytes, dtype=dtype, formula=formula))
    return top.finalize()


def _list_node(name: str, items: List[Tuple[str, float, str]], formula: str = "") -> Node:
    n = Node(name, formula=formula)
    for label, nbytes, f in items:
        n.add(Node(label, bytes=nbytes, formula=f))
    return n.finalize()


#: the categories of the generate() stream's labels (generate_ops) -> the tree's components
_LIVE_GROUPS = ("kv cache", "activations", "logits", "generation", "workspace")


def _live_nodes(live: Dict[Any, Tuple[int, Any]], where: str) -> List[Node]:
    """The tensors live at a phase's peak (key -> (bytes, (category, name))), one node per
    category, one child per name (summed over the layers that hold one)."""
    groups: Dict[str, Dict[str, List[int]]] = {}
    for nbytes, label in live.values():
        cat, name = label if isinstance(label, tuple) and len(label) == 2 else ("activations", str(label))
        if cat in ("weights", "quantization constants"):
            continue
        groups.setdefault(cat, {}).setdefault(name, []).append(nbytes)
    out = []
    for cat in _LIVE_GROUPS:
        if cat not in groups:
            continue
        node = Node(cat, formula=f"live at the peak of {where}")
        for name, sizes in sorted(groups[cat].items(), key=lambda kv: -sum(kv[1])):
            n = len(sizes)
            node.add(Node(name, bytes=float(sum(sizes)),
                          formula=(f"{n} tensors, {sizes[0]:,} B each" if n > 1 and len(set(sizes)) == 1 else
                                   f"{n} tensors" if n > 1 else f"{sizes[0]:,} B")))
        out.append(node.finalize())
    return out


def _order(nodes: List[Node]) -> List[Node]:
    idx = {k: i for i, k in enumerate(_CHILD_ORDER)}
    return sorted([n for n in nodes if n.bytes > 0], key=lambda n: idx.get(n.name, 99))


def estimate_inference_setup(arch: Architecture, s: InferenceSetup) -> InferenceEstimate:
    """The estimate for a resolved architecture and a validated setup."""
    notes: List[str] = []
    if not arch.exact:
        notes.append(arch.assumption)
    if not s.serving and (s.tensor_parallel > 1 or s.pipeline_parallel > 1 or s.expert_parallel > 1):
        from .engines import check_layout, gpu_share

        check_layout(arch, s.tensor_parallel, s.pipeline_parallel, s.expert_parallel)
        arch = gpu_share(arch, s.tensor_parallel, s.pipeline_parallel, s.expert_parallel, stage=-1)
        notes.append(f"generate() with tensor_parallel={s.tensor_parallel}, pipeline_parallel="
                     f"{s.pipeline_parallel}: the last stage's rank-0 share (transformers' tp_plan column/row "
                     f"split; KV heads replicated when fewer than the TP size)")
    if s.weights == "mxfp4":
        if not getattr(arch.family, "mxfp4_experts", False):
            raise VramError(f"weights: mxfp4 is transformers' MXFP4 path for gpt-oss's experts; {arch.name} has none "
                            f"it converts (use fp8, fp8-block, nf4, gptq-4bit or awq-4bit)", field="weights")
        notes.append("MXFP4: the experts stay 4-bit with transformers' Triton kernels (compute capability >= 7.5, "
                     "Triton >= 3.4 and the kernels package); without them transformers dequantizes them to bf16 "
                     "(weights='bf16')")
    stored = weight_storage(arch, s)
    w_node = _group_node("weights", stored, consts=False)
    q_node = _group_node("quantization constants", stored, consts=True)
    w_bytes = w_node.bytes + q_node.bytes
    lay = kv_layout(arch, s.kv_cache_dtype, s.mla_cache, s.use_sliding_window)
    c = DTYPE_BYTES[s.dtype]
    if s.fmt_kind == "gguf":
        notes.append("GGUF: weight bytes as llama.cpp holds the file's tensors; the KV cache and activations "
                     "follow transformers' generate() (llama.cpp preallocates the KV cache for n_ctx and keeps "
                     "its own compute buffers)")
    if arch.max_position_embeddings and s.context_len > arch.max_position_embeddings:
        notes.append(f"context_len {s.context_len} is beyond the model's max_position_embeddings "
                     f"({arch.max_position_embeddings})")
    gpu = None
    if s.gpu:
        from .gpus import get_gpu

        gpu = get_gpu(s.gpu)
    if s.serving:
        return _serving_estimate(arch, s, lay, gpu, notes)

    b, p, ctx = s.batch_size, s.prompt_len, s.context_len
    if arch.mla and s.mla_cache == "compressed":
        notes.append("MLA: transformers 5 caches the compressed latent (kv_lora_rank + qk_rope_head_dim per layer "
                     "and token) and re-expands K/V for one layer at a time")
    if b > 1:
        notes.append("batch: prompts of equal length (no padding); padded prompts give SDPA a mask, which "
                     "repeats K/V to every head and rules out the flash kernel")
    # prefill and decode: what the generate() stream (generate_ops, inference_events) has live at
    # each phase's largest moment, in the bytes the caching allocator counts
    kv_pre = _kv_node(lay, b, p, window_applies=False)
    kv_pre.name = "kv cache"
    kv_dec = _kv_node(lay, b, ctx, window_applies=True)
    peaks = GENERATE_REPLAY["peaks"](arch, s)
    prefill_nodes = _order([w_node, q_node] + _live_nodes(peaks["prefill"][1], f"prefill of b x p = {b} x {p} tokens"))
    prefill = float(peaks["prefill"][0])
    dec = peaks.get("decode", (0.0, {}))
    decode_nodes = _order([w_node, q_node] + _live_nodes(dec[1], f"a decode step (the cache up to {ctx} tokens)"))
    decode = float(dec[0])

    after_nodes = _order([w_node, q_node])
    phases = {"after_load": float(peaks["after_load"]), "prefill": prefill}
    if "decode" in peaks:
        phases["decode"] = decode
    peak_phase = "prefill" if prefill >= decode else "decode"
    peak = phases[peak_phase]
    phase_components = {"after_load": after_nodes, "prefill": prefill_nodes, "decode": decode_nodes}

    # the GPU's own CUDA context (the H200's without one): gpus.context_for, as training counts it
    context, context_src = context_for(gpu)

    def components_at(reserved_value: float, exact: bool = True) -> List[Node]:
        """The peak phase's components, the allocator reserve at ``reserved_value`` (the
        replayed one, or a provisional one until the replay has run) and the CUDA context."""
        formula = ("caching allocator: max_memory_reserved of a replay of CUDACachingAllocator over this "
                   "generate() call's allocations (inference_events.py) minus the allocated peak, on a card "
                   "with room for it (short of memory, torch frees its cached segments before it fails: "
                   "Estimate.replay(capacity_bytes=...).oom)")
        if not exact:
            formula = ("provisional, the replay has not run yet: allocated peak x the training cases' median "
                       "reserved / allocated ratio (inference_events.provisional_reserved_bytes)")
        return list(phase_components[peak_phase]) + [
            Node("allocator reserve", bytes=max(0.0, reserved_value - peak), formula=formula),
            Node("cuda context", bytes=context, formula=context_src)]

    reserved, replay_fn, provisional_fn = GENERATE_REPLAY["hooks"](arch, s, peak)
    if s.attn_implementation == "eager":
        notes.append("eager attention materialises b x a x q x S scores and repeats K/V to every head")
    if lay.sliding_layers and lay.window and p > lay.window:
        notes.append(f"sliding window {lay.window}: during the prefill the sliding layers still hold the whole "
                     f"prompt (the cached window is a view of it); after the first decode step they hold "
                     f"min(S, {lay.window}) tokens")
    est = InferenceEstimate(
        model_name=arch.name, setup=s.to_dict(), params_total=arch.params_total, params_trainable=0,
        components=None, phases_bytes=phases, peak_phase=peak_phase, peak_allocated_bytes=peak,
        reserved_bytes=reserved, cuda_context_bytes=context, cuda_context_source=context_src, notes=notes,
        phase_components=phase_components, kv_cache_bytes=kv_dec.bytes, kv_cache_prefill_bytes=kv_pre.bytes,
        kv_bytes_per_token=lay.bytes_per_token, weights_bytes=w_bytes,
        sources=EstimateSources(components_at=components_at, replay=replay_fn, provisional=provisional_fn,
                                # the resolved architecture and setup (longest_context reuses them)
                                inference=(arch, s), replay_key=(arch, s)))
    # on a card, the reserve is judged as a training step's is (gpus.judge_on): where the
    # unlimited reserve is over the card and the allocated peak is not, generate() is replayed
    # with the card's capacity, where torch frees its cached segments and retries
    est.capacity_judged = True
    if gpu is not None:
        from .gpus import capacity_bytes

        est.gpu = gpu.name
        # whether it fits is read lazily (InferenceEstimate.fits: it runs the allocator replay)
        est.gpu_usable_bytes = capacity_bytes(gpu)
    return est


# ----------------------------------------------------------------------------------
# Serving: a paged KV cache inside a gpu_memory_utilization budget
# ----------------------------------------------------------------------------------

def serving_budget(plan: Any, lay: KVLayout, s: InferenceSetup) -> Dict[str, Any]:
    """The engine's KV budget as a dict: the engine's own start-up figures (blocks, tokens,
    maximum concurrency for ``context_len``) plus how many sequences of ``context_len`` fit
    when sliding-window layers hold at most ceil(W / block) + 1 blocks."""
    blk = plan.block_size
    budget = plan.kv_budget_bytes
    seq_blocks = -(-s.context_len // blk)
    bpt = plan.kv_bytes_per_token
    per_layer_token = bpt / max(lay.full_layers + lay.sliding_layers, 1)
    per_seq = seq_blocks * blk * bpt
    if lay.sliding_layers and lay.window and s.engine == "vllm":
        sl = lay.sliding_layers
        wb = min(seq_blocks, -(-lay.window // blk) + 1)
        per_seq = seq_blocks * blk * per_layer_token * (lay.full_layers) + wb * blk * per_layer_token * sl
    seqs = int(max(budget, 0) // per_seq) if per_seq else 0
    return {
        "engine": plan.engine,
        "version": plan.version,
        "runtime": plan.runtime,
        "budget_rule": plan.rule,
        "tensor_parallel": plan.tensor_parallel,
        "pipeline_parallel": plan.pipeline_parallel,
        "data_parallel": plan.data_parallel,
        "expert_parallel": plan.expert_parallel,
        "num_gpus": plan.num_gpus,
        "gpu_memory_utilization": plan.utilization,
        "capacity_bytes": int(round(plan.total_bytes)),
        "budget_bytes": int(round(plan.utilization * plan.total_bytes)),
        "weights_bytes": int(round(plan.weights_bytes)),
        "activation_peak_bytes": int(round(plan.activation_bytes)),
        "profile_tokens": plan.profile_tokens,
        "non_torch_bytes": int(round(plan.non_torch_bytes)),
        "kv_budget_bytes": int(round(budget)),
        "kv_bytes_per_token": bpt,
        "block_size": blk,
        "kv_blocks": plan.num_blocks,
        "kv_tokens": plan.kv_tokens,
        "max_concurrency": round(plan.max_concurrency, 4),
        "bytes_per_sequence": per_seq,
        "max_concurrent_sequences": seqs,
        "running_sequences": min(seqs, s.max_num_seqs),
        "context_len": s.context_len,
        "cuda_graph_bytes": int(round(plan.cuda_graph_bytes)),
        "cuda_graphs": plan.cuda_graph_count,
        "startup_lines": plan.startup_lines(),
        "fits": budget > 0 and plan.kv_tokens >= s.context_len,
    }


def _serving_estimate(arch: Architecture, s: InferenceSetup, lay: KVLayout, gpu: Any, notes: List[str]
                      ) -> InferenceEstimate:
    """Serving: the engine's start-up on one GPU of the layout (:mod:`vramwidget.engines`):
    after load, the profiling forward, then the KV pool filling the budget, then CUDA graphs."""
    from .engines import plan as engine_plan

    p = engine_plan(arch, s, gpu)
    notes.extend(p.notes)
    w_node = Node("weights", children=[Node(f"weight shard (tp {p.tensor_parallel}, pp {p.pipeline_parallel}"
                                            f"{', ep ' + str(p.expert_parallel) if p.expert_parallel > 1 else ''})",
                                            bytes=p.weights_bytes,
                                            formula="this GPU's share of every tensor in the stored format "
                                                    "(+ vLLM's rotary cos/sin cache)")])
    w_node.finalize()
    act = _list_node("activations", p.activation_items,
                     formula=f"profiling forward of {p.profile_tokens} tokens" if p.profile_tokens else "")
    nt = _list_node("non-torch memory", p.non_torch_items)
    pool = max(p.num_blocks * p.block_size * p.kv_bytes_per_token, 0.0)
    unit = "tokens" if p.engine == "sglang" else f"blocks of {p.block_size} tokens"
    kv = Node("kv cache", children=[Node(f"paged KV pool ({p.num_blocks} {unit})", bytes=pool,
                                         formula=f"{p.kv_tokens} tokens x {p.kv_bytes_per_token:g} B per token "
                                                 f"(this GPU's layers and KV heads)")])
    kv.finalize()
    graphs = Node("cuda graphs", bytes=p.cuda_graph_bytes,
                  formula=f"{p.cuda_graph_count} captured decode graphs (enforce_eager: none)")
    after = _order([w_node])
    profile = _order([w_node, act])
    serving = _order([w_node, kv, act])
    phases = {"after_load": p.weights_bytes, "profile": p.weights_bytes + p.activation_bytes,
              "serving": p.weights_bytes + p.activation_bytes + pool}
    peak = phases["serving"]
    reserved = max(peak, p.utilization * p.total_bytes - p.non_torch_bytes)
    components = list(serving) + [
        Node("allocator reserve", bytes=reserved - peak, formula="budget not used by whole KV blocks"),
        Node("cuda context", bytes=gpu.cuda_context_bytes, formula=gpu.cuda_context_source)]
    if nt.bytes:
        comm = [x for x in p.non_torch_items if x[0] != "CUDA context"]
        if comm:
            components.append(_list_node("communication buffers", comm))
    if graphs.bytes:
        components.append(graphs)
    info = serving_budget(p, lay, s)
    if not info["fits"]:
        notes.append(f"does not start: the KV cache holds {p.kv_tokens:,} tokens, less than one "
                     f"{s.context_len:,}-token request (budget {p.kv_budget_bytes / GIB:.2f} GiB after weights, "
                     f"activations and non-torch memory)")
    from .gpus import capacity_bytes

    ctx = gpu.cuda_context_bytes
    est = InferenceEstimate(
        model_name=arch.name, setup=s.to_dict(), params_total=arch.params_total, params_trainable=0,
        components=components, phases_bytes=phases, peak_phase="serving", peak_allocated_bytes=peak,
        reserved_bytes=reserved + sum(x[1] for x in p.non_torch_items if x[0] != "CUDA context")
        + p.cuda_graph_bytes, cuda_context_bytes=ctx, cuda_context_source=gpu.cuda_context_source, notes=notes,
        phase_components={"after_load": after, "profile": profile, "serving": serving},
        kv_cache_bytes=pool, kv_cache_prefill_bytes=0.0, kv_bytes_per_token=p.kv_bytes_per_token,
        weights_bytes=p.weights_bytes, serving=info, gpu=gpu.name, gpu_usable_bytes=capacity_bytes(gpu),
        fits=info["fits"])
    est.plan = p
    return est


# ----------------------------------------------------------------------------------
# The longest context that fits
# ----------------------------------------------------------------------------------

#: the search stops here (2**24 tokens = 16.8M)
MAX_SEARCH_TOKENS = 1 << 24
#: the most generated tokens longest_context replays from a fixed prompt (one replay holds every
#: decode step's allocator events: 131,072 steps of gpt2 are ~0.6 GiB of them)
MAX_DECODE_STEPS = 1 << 17


def longest_context(model: Model, gpu: Any, **kw: Any) -> int:
    """The longest ``context_len`` (a multiple of ``block_size``, 16) whose estimate fits
    ``gpu`` for the batch: that context fits, one more block does not.  0 if not even one
    block fits.

    generate() mode: the device total (reserve + the GPU's own CUDA context) must stay
    within what CUDA reports as its total (:mod:`vramwidget.verdict`); the prompt is the whole context unless ``prompt_len`` is given (then
    min(prompt_len, context)).  Serving mode (``gpu_memory_utilization``): at least
    ``batch_size`` sequences of that context must fit the paged KV pool.
    """
    arch = load(model)
    if gpu is None:    # the card's memory is what bounds the context (None would be "no GPU")
        raise VramError("gpu: longest_context needs the GPU whose memory bounds the context (e.g. 'L4')", field="gpu")
    kw, _note = with_shipped_format(arch, kw)
    kw["gpu"] = gpu
    kw.pop("context_len", None)
    prompt = kw.pop("prompt_len", None)
    serving = InferenceSetup.from_kwargs(**kw).serving   # validate once, with the field names
    if prompt is not None:
        prompt = _posint("prompt_len", prompt)
    blk = _posint("block_size", kw.get("block_size", BLOCK_SIZE))
    batch = kw.get("batch_size") or 1

    def estimate_at(n_blocks: int) -> InferenceEstimate:
        ctx = n_blocks * blk
        p = min(prompt, ctx) if prompt else None
        return estimate_inference_setup(arch, InferenceSetup.from_kwargs(context_len=ctx, prompt_len=p, **kw))

    cap = max(MAX_SEARCH_TOKENS // blk, 1)
    if serving:
        return _largest_true(lambda n: bool((e := estimate_at(n)).serving
                                            and e.serving["max_concurrent_sequences"] >= batch), cap) * blk
    from .gpus import fits as fits_rule

    # reserved memory is at least the allocated peak: the peak alone bounds the answer (no
    # replay); the replays then decide below that bound
    bound = _largest_true(lambda n: fits_rule((e := estimate_at(n)).peak_allocated_bytes + e.cuda_context_bytes,
                                              e.gpu_usable_bytes), cap)
    if bound == 0:
        return 0
    if not prompt or prompt >= bound * blk:
        # the whole context is the prompt: each estimate replays a prefill (no decode steps)
        return _largest_true(lambda n: bool(estimate_at(n).fits), bound) * blk
    # That replay holds every decode step's events: above MAX_DECODE_STEPS (gpt2 from a 128-token
    # prompt on an H100: a million steps, 4.4 GiB of events, then 16 GiB) it is not attempted
    if (bound * blk - prompt) > MAX_DECODE_STEPS:
        raise VramError(f"prompt_len: from a {prompt:,}-token prompt, {arch.name} fits {gpu} up to about "
                        f"{bound * blk:,} tokens by its allocated memory alone; a search through more than "
                        f"{MAX_DECODE_STEPS:,} generated tokens is not replayed (its allocator stream takes gigabytes): "
                        f"give a prompt_len nearer the context you serve, or check one context_len with "
                        f"estimate_inference", field="prompt_len")
    # a fixed prompt: the stream of a shorter context is the first events of the bound's, and so
    # is its replay at the card's capacity.  A context fits exactly when that replay runs without
    # an out-of-memory error (the verdict's rule, gpus.judge_on: the unlimited reserve fitting, or
    # the free-and-retry at the limit saving it), so one capacity replay of the bound decides
    # every context: the longest is the one whose last decode step ends before the failing
    # request (inference_events.steps_before_oom)
    top = estimate_at(bound)
    capacity = top.gpu_usable_bytes - top.cuda_context_bytes
    steps = GENERATE_REPLAY["steps_before_oom"](*top.sources.inference, capacity)
    if steps is None:
        return bound * blk
    last = prompt + steps                        # the cache of the last step that ran whole
    return _largest_true(lambda n: n * blk <= max(last, prompt) and (n * blk > prompt or bool(estimate_at(n).fits)),
                         bound) * blk


def _largest_true(pred: Any, cap: int) -> int:
    """The largest n in [1, cap] with ``pred(n)`` (true up to some n, false after), 0 if none."""
    if not pred(1):
        return 0
    lo, hi = 1, 2
    while hi <= cap and pred(hi):
        lo = hi
        hi *= 2
    if hi > cap:
        if pred(cap):
            return cap
        hi = cap
    while hi - lo > 1:       # pred(lo), not pred(hi)
        mid = (lo + hi) // 2
        if pred(mid):
            lo = mid
        else:
            hi = mid
    return lo


# ----------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------

#: (flag, dest, type, help)
_CLI_OPTIONS = (
    ("--weights", "weights", str, "weight format: " + ", ".join(WEIGHT_FORMATS)),
    ("--dtype", "dtype", str, "compute dtype of quantized formats (bf16 or fp16)"),
    ("--group-size", "group_size", int, "GPTQ/AWQ group size (default 128; -1: GPTQ without groups)"),
    ("--kv-cache-dtype", "kv_cache_dtype", str, "KV cache dtype: " + ", ".join(KV_CACHE_DTYPES)),
    ("--batch-size", "batch_size", int, "sequences (default 1)"),
    ("--context-len", "context_len", int, "tokens per sequence: prompt + generated (default 4096); serving: "
                                          "the engine's max_model_len (--max-model-len)"),
    ("--prompt-len", "prompt_len", int, "prompt tokens (default: the whole context)"),
    ("--attn-implementation", "attn_implementation", str, "sdpa, eager or flash_attention_2"),
    ("--mla-cache", "mla_cache", str, "MLA cache: compressed (transformers 5) or decompressed"),
    ("--logits", "logits", str, "last (generate) or all (a plain forward)"),
    ("--gpu", "gpu", str, "a GPU from the catalog (e.g. H100-80GB): fit check"),
    ("--gpu-memory-utilization", "gpu_memory_utilization", float,
     "serving: fraction of the GPU a vLLM-style server may use (e.g. 0.9)"),
    ("--max-num-seqs", "max_num_seqs", int, f"serving: most sequences at once (default {DEFAULT_MAX_NUM_SEQS})"),
    ("--max-num-batched-tokens", "max_num_batched_tokens", int,
     "serving: tokens of the profiling forward (default: the engine release's own)"),
    ("--engine", "engine", str, "hf (generate(), default), vllm or sglang: whose start-up to reproduce"),
    ("--tensor-parallel-size", "tensor_parallel", int, "GPUs a layer is split over (default 1)"),
    ("--pipeline-parallel-size", "pipeline_parallel", int, "pipeline stages (default 1)"),
    ("--data-parallel-size", "data_parallel", int, "model replicas (default 1)"),
    ("--expert-parallel-size", "expert_parallel", int, "GPUs the experts are spread over (default 1)"),
    ("--vllm-version", "vllm_version", str, "the vLLM release whose memory profile to use (e.g. 0.6.4)"),
    ("--sglang-version", "sglang_version", str, "the SGLang release"),
    ("--mem-fraction-static", "mem_fraction_static", float, "SGLang's share of the GPU for weights + KV pool"),
    ("--concurrency", "concurrency", int,
     "with --engine vllm/sglang and --gpu: the fewest GPUs (and TP/PP layout) that hold this many "
     "requests of --context-len tokens at once"),
)

#: options that are not estimate_inference() settings
_RUN_ONLY = ("vllm_version", "sglang_version", "concurrency")


def add_arguments(parser: argparse.ArgumentParser, *, model: bool = True) -> argparse.ArgumentParser:
    """Add the inference options to ``parser`` (an ``infer`` subcommand, or ``estimate``
    with ``--inference``).  Options the parser already has (``--batch-size``,
    ``--attn-implementation``) are left alone and read by :func:`run` all the same."""
    have = getattr(parser, "_option_string_actions", {})
    if model:
        parser.add_argument("model", metavar="MODEL", help="a preset name, config.json path, Hub id or a "
                                                           "parameter count like 7B")
    for flag, dest, typ, text in _CLI_OPTIONS:
        if flag in have:
            continue
        aliases = {"--context-len": ("--max-model-len",), "--tensor-parallel-size": ("--tp",),
                   "--pipeline-parallel-size": ("--pp",)}.get(flag, ())
        parser.add_argument(flag, *[a for a in aliases if a not in have], dest=dest, type=typ, default=None,
                            help=text)
    for flag, dest, val, text in (("--double-quant", "double_quant", True, "bitsandbytes 4-bit double quantization"),
                                  ("--enforce-eager", "enforce_eager", True, "serving: no CUDA graphs"),
                                  ("--no-sliding-window", "use_sliding_window", False,
                                   "cache sliding-window layers in full"),
                                  ("--longest-context", "longest_context", True,
                                   "with --gpu: print the longest context that fits")):
        if flag not in have:
            parser.add_argument(flag, dest=dest, action="store_const", const=val, default=None, help=text)
    if "--json" not in have:
        parser.add_argument("--json", action="store_true", help="print JSON")
    return parser


def setup_from_args(args: argparse.Namespace) -> Dict[str, Any]:
    """The keyword arguments of :func:`estimate_inference` that ``args`` sets."""
    kw: Dict[str, Any] = {}
    for _, dest, _, _ in _CLI_OPTIONS:
        v = getattr(args, dest, None)
        if v is not None and dest not in _RUN_ONLY:
            kw[dest] = v
    versions = {k: getattr(args, f"{k}_version", None) for k in ("vllm", "sglang")}
    versions = {k: v for k, v in versions.items() if v}
    if versions:
        kw["versions"] = versions
    for dest in ("double_quant", "use_sliding_window", "enforce_eager"):
        v = getattr(args, dest, None)
        if v is not None:
            kw[dest] = v
    return kw


def run(args: argparse.Namespace, out=None) -> int:
    """Run the inference estimate for parsed ``args``; prints a table or JSON, returns 0.
    Raises VramError on bad input (the caller prints it as one line).  With ``--concurrency``
    (and a serving engine and GPU) it plans the deployment instead: the fewest GPUs and the
    TP/PP layout."""
    out = out or sys.stdout
    kw = setup_from_args(args)
    concurrency = getattr(args, "concurrency", None)
    if concurrency is not None:
        return _run_plan(args.model, kw, _posint("concurrency", concurrency), out, getattr(args, "json", False))
    est = estimate_inference(args.model, **kw)
    longest = None
    if getattr(args, "longest_context", None):
        if not kw.get("gpu"):
            raise VramError("longest_context: needs --gpu", field="gpu")
        longest = longest_context(args.model, **kw)
    extra: Dict[str, Any] = {}
    if est.serving:
        extra = serving_report(args.model, kw)
    if getattr(args, "json", False):
        d = est.to_dict()
        if longest is not None:
            d["longest_context"] = longest
        d.update(extra)
        out.write(json.dumps(d, indent=2) + "\n")
        return 0
    out.write(format_table(est, longest) + "\n")
    if extra:
        out.write(f"  largest max_model_len that starts: {extra['largest_max_model_len']:,} tokens\n")
        if extra["command_note"]:
            out.write(f"  {'command' if extra['command'] else 'no command'}: {extra['command_note']}\n")
        if extra["command"]:
            out.write(f"  command: {extra['command']}\n")
    return 0


def serving_report(model: Model, kw: Dict[str, Any]) -> Dict[str, Any]:
    """What a serving estimate adds: the engine's start-up lines, the largest
    ``max_model_len`` that starts with this layout, and a copyable command line."""
    from .engines import plan, startable_command
    from .gpus import get_gpu

    arch = load(model)
    s = InferenceSetup.from_kwargs(**kw)
    gpu = get_gpu(s.gpu)
    p = plan(arch, s, gpu)
    command, why, largest = startable_command(arch, s, gpu, arch.hub_id or arch.name)
    return {"startup_lines": p.startup_lines(), "largest_max_model_len": largest, "command": command,
            "command_note": why}


def _run_plan(model: Model, kw: Dict[str, Any], concurrency: int, out, as_json: bool) -> int:
    from .engines import fewest_gpus
    from .gpus import get_gpu

    if not kw.get("gpu"):
        raise VramError("concurrency: planning needs --gpu (the card to deploy on)", field="gpu")
    if kw.get("engine", "vllm") == "hf" or "engine" not in kw:
        kw = {**kw, "engine": kw.get("engine") if kw.get("engine") not in (None, "hf") else "vllm"}
    arch = load(model)
    s = InferenceSetup.from_kwargs(**kw)
    p = fewest_gpus(arch, s, get_gpu(s.gpu), concurrency)
    name = arch.hub_id or arch.name
    if p is None:
        msg = (f"{arch.name}: no layout of up to 64 x {s.gpu} holds {concurrency} requests of {s.context_len:,} "
               f"tokens")
        if as_json:
            out.write(json.dumps({"model": arch.name, "fits": False, "message": msg}, indent=2) + "\n")
        else:
            out.write(msg + "\n")
        return 0
    d = {"model": arch.name, "gpu": s.gpu, "engine": p.engine, "version": p.version, "concurrency": concurrency,
         "context_len": s.context_len, "num_gpus": p.num_gpus, "tensor_parallel": p.tensor_parallel,
         "pipeline_parallel": p.pipeline_parallel, "kv_tokens_per_replica": p.kv_tokens,
         "max_concurrency": round(p.max_concurrency, 2), "startup_lines": p.startup_lines(),
         "command": p.command(name), "plan": p.to_dict()}
    if as_json:
        out.write(json.dumps(d, indent=2) + "\n")
        return 0
    out.write(f"{arch.name} on {s.gpu} with {p.engine} {p.version}: {concurrency} requests of "
              f"{s.context_len:,} tokens at once\n")
    out.write(f"  fewest GPUs: {p.num_gpus} (tensor parallel {p.tensor_parallel}, pipeline parallel "
              f"{p.pipeline_parallel})\n")
    out.write(f"  per GPU: weights {p.weights_bytes / GIB:.2f} GiB, profile activations "
              f"{p.activation_bytes / GIB:.2f} GiB, non-torch {p.non_torch_bytes / GIB:.2f} GiB, KV cache "
              f"{p.kv_budget_bytes / GIB:.2f} GiB; CUDA graphs {p.cuda_graph_bytes / GIB:.2f} GiB on top\n")
    out.write("  the engine will print:\n")
    for line in p.startup_lines():
        out.write(f"    {line}\n")
    out.write(f"  command: {p.command(name)}\n")
    return 0


def format_table(est: InferenceEstimate, longest: Optional[int] = None) -> str:
    """An inference estimate as the text the CLI prints."""
    s = est.setup
    lines = [f"{est.model_name}: inference, weights {s['weights']}, KV cache {s['kv_cache_dtype']}, "
             f"batch {s['batch_size']} x {s['context_len']} tokens (prompt {s['prompt_len']}), "
             f"{s['attn_implementation']}"]
    lines.append(f"  assumes: {est.assumes}")
    lines.append(f"  KV cache: {est.kv_bytes_per_token:,.0f} B per token (all layers); "
                 f"{est.kv_cache_bytes / GIB:.3f} GiB")
    for ph, v in est.phases_bytes.items():
        mark = "  <- peak" if ph == est.peak_phase else ""
        lines.append(f"  {ph:<12} {v / GIB:10.3f} GiB{mark}")
    lines.append(f"  components at the peak ({est.peak_phase}):")
    for c in est.components:
        lines.append(f"    {c.name:<24} {c.bytes / GIB:10.3f} GiB")
    lines.append(f"  device total (reserve + CUDA context): {est.device_total_gib:.3f} GiB")
    if est.serving:
        v = est.serving
        lines.append(f"  {v['engine']} {v['version']} ({v['runtime']}) on {v['num_gpus']} x {est.gpu}: tensor parallel "
                     f"{v['tensor_parallel']}, pipeline parallel {v['pipeline_parallel']}; per GPU: weights "
                     f"{v['weights_bytes'] / GIB:.2f} GiB, profile activations {v['activation_peak_bytes'] / GIB:.2f} "
                     f"GiB ({v['profile_tokens']} tokens), non-torch {v['non_torch_bytes'] / GIB:.2f} GiB, CUDA "
                     f"graphs {v['cuda_graph_bytes'] / GIB:.2f} GiB")
        lines.append("  the engine prints:")
        for line in v["startup_lines"]:
            lines.append(f"    {line}")
        lines.append(f"  serving on {est.gpu} at {v['gpu_memory_utilization']:g}: KV budget "
                     f"{v['kv_budget_bytes'] / GIB:.2f} GiB = {v['kv_tokens']:,} tokens ({v['kv_blocks']:,} blocks), "
                     f"{v['max_concurrent_sequences']} sequences of {v['context_len']} tokens "
                     f"(running at once: {v['running_sequences']})")
    elif est.gpu:
        room = est.gpu_usable_bytes - est.device_total_bytes
        state = ("fits, tight (only by the allocator freeing its cached blocks at the limit)" if est.fits and est.squeezed
                 else "fits" if est.fits else "does NOT fit")
        lines.append(f"  {est.gpu}: {state}: device total "
                     f"{est.device_total_bytes / GIB:.2f} GiB of {est.gpu_usable_bytes / GIB:.2f} GiB CUDA total "
                     f"({abs(room) / GIB:.2f} GiB {'to spare' if room >= 0 else 'over'}, "
                     f"{abs(room) / est.gpu_usable_bytes * 100:.0f}%)")
    if est.gpu and not est.serving and est.allocator_note:
        lines.append(f"  allocator: {est.allocator_note}")
    if longest is not None:
        lines.append(f"  longest context that fits: {longest:,} tokens")
    for n in est.notes:
        lines.append(f"  note: {n}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``vramwidget infer MODEL [options]`` as a standalone entry point."""
    parser = argparse.ArgumentParser(prog="vramwidget infer",
                                     description="GPU memory of running MODEL for inference.")
    add_arguments(parser)
    try:
        args = parser.parse_args(list(argv) if argv is not None else None)
        return run(args)
    except VramError as e:
        sys.stderr.write(f"vramwidget: error: {e}\n")
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
