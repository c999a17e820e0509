"""Weights by storage format: every weight tensor as the chosen format stores it on the GPU.

The formats (:data:`WEIGHT_FORMATS`), their spellings and llama.cpp's tables; the storage of
each tensor (bitsandbytes, fp8, MXFP4, compressed-tensors, GPTQ, AWQ, GGUF).  The functions read
five settings of an :class:`~vramwidget.inference.setup.InferenceSetup` (:class:`WeightSettings`),
which prices its own weights with :func:`weight_storage`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Protocol, Tuple

from ..model.architecture import Architecture, ParamTensor
from ..errors import VramError
from ..inputs import check_text, close_match, shown
from ..plan.params import quant_const_bytes, quantizable
from ..units import DTYPE_BYTES, canonical_dtype
from .versions import transformers_version

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


def canonical_weights_format(w: Any) -> str:
    """The format ``w`` names (an alias or a bare GGUF mix resolved); a VramError naming the allowed ones."""
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


def format_kind(weights: str) -> str:
    """The storage family of a weights format: dense, gguf, gptq, awq, ct, or the format itself
    (fp8, fp8-block, mxfp4, int8, nf4, fp4)."""
    w = weights
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


class WeightSettings(Protocol):
    """What weight storage reads of a setup (an :class:`~vramwidget.inference.setup.InferenceSetup`)."""

    weights: str
    dtype: str
    group_size: int
    double_quant: bool
    versions: Dict[str, str]


@dataclass
class StoredTensor:
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


def weight_storage(arch: Architecture, s: WeightSettings) -> List[StoredTensor]:
    """Every weight tensor as the chosen format stores it on the GPU."""
    kind = format_kind(s.weights)
    if kind == "gguf":
        return _gguf_storage(arch, s)
    out = []
    for t in arch.tensors:
        out.append(_store_one(arch, t, s, kind))
    return out


def _dense(t: ParamTensor, dtype: str, why: str = "") -> StoredTensor:
    b = DTYPE_BYTES[dtype]
    shape = " x ".join(map(str, t.shape))
    return StoredTensor(t, [(dtype, t.numel * b, dtype, f"{t.repeat} x {shape} x {b:g} B ({dtype}){why}")], [])


def _store_one(arch: Architecture, t: ParamTensor, s: WeightSettings, kind: str) -> StoredTensor:
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
        return StoredTensor(t, [("float8", t.numel * 1.0, "float8", "n x 1 B (fp8 e4m3)")],
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


def _bnb(t: ParamTensor, s: WeightSettings, c: str) -> StoredTensor:
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
        return StoredTensor(t, [("int8", t.numel * 1.0, "int8", "n x 1 B (int8 CB)")],
                       [("SCB (fp32 per output row)", n * o * 4.0, f"{n} x {o} x 4 B")])
    consts = quant_const_bytes(t.numel, q, s.double_quant)
    f = ("n/64 x 1 B (8-bit absmax) + n/64/256 x 4 B (fp32 scales)" if s.double_quant
         else "n/64 x 4 B (fp32 absmax)")
    return StoredTensor(t, [(q, t.numel * 0.5, q, "n x 0.5 B (4-bit)")], [("absmax", consts, f)])


def _mxfp4(t: ParamTensor, c: str) -> StoredTensor:
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
        return StoredTensor(t, [("mxfp4 blocks (uint8, 2 values a byte)", n / 2.0, "uint8", "n / 2 B")],
                       [("mxfp4 scales (uint8 e8m0 per 32)", n / 32.0, "n / 32 B")])
    if t.role in ("expert_gate_up", "expert_down") and not t.linear:
        return _dense(t, "float32", ", expert bias (fp32 in Mxfp4GptOssExperts)")
    return _dense(t, c, "" if t.role not in ("embedding", "output_head") else ", not quantized")


def _fp8_block(t: ParamTensor, s: WeightSettings) -> StoredTensor:
    """Block-wise FP8 as transformers' ``FineGrainedFP8HfQuantizer`` loads it
    (``integrations/finegrained_fp8.py``, ``FP8Linear``): the weight (out, in) in e4m3 (1 B) and
    ``weight_scale_inv`` (ceil(out/B), ceil(in/B)) fp32 for blocks of B x B (``weight_block_size``,
    128 x 128 in DeepSeek-V3's and Qwen3's FP8 checkpoints; ``group_size`` here)."""
    n, i, o = _dims(t)
    blk = s.group_size if s.group_size > 0 else 128
    rows, cols = -(-o // blk), -(-i // blk)
    return StoredTensor(t, [("float8 e4m3", t.numel * 1.0, "float8", "n x 1 B")],
                   [(f"weight_scale_inv (fp32 per {blk} x {blk} block)", n * rows * cols * 4.0,
                     f"{n} x ceil({o}/{blk}) x ceil({i}/{blk}) x 4 B")])


def _compressed_tensors(t: ParamTensor, s: WeightSettings) -> StoredTensor:
    """compressed-tensors checkpoints (llm-compressor) as transformers' ``CompressedTensorsHfQuantizer``
    keeps them compressed (``run_compressed``: ``CompressedLinear``): ``ct-w4a16`` pack-quantized
    int4, ``weight_packed`` int32 (out, in/8) + ``weight_scale`` (out, ceil(in/g)) in the compute
    dtype + ``weight_shape``; ``ct-w8a8`` int8 (out, in) + a per-channel scale; ``ct-fp8`` e4m3 +
    an fp32 per-channel scale."""
    n, i, o = _dims(t)
    c = DTYPE_BYTES[s.dtype]
    if s.weights == "ct-w4a16":
        G = _groups(i, s.group_size)
        return StoredTensor(t, [("weight_packed (int32, 8 x 4-bit)", t.numel * 0.5, "int32", "n / 2 B")],
                       [(f"weight_scale ({s.dtype} per group)", n * o * G * c, f"{n} x {o} x ceil({i}/{s.group_size}) x {c:g} B")])
    if s.weights == "ct-w8a8":
        return StoredTensor(t, [("int8", t.numel * 1.0, "int8", "n x 1 B")],
                       [(f"weight_scale ({s.dtype} per output channel)", n * o * c, f"{n} x {o} x {c:g} B")])
    return StoredTensor(t, [("float8 e4m3", t.numel * 1.0, "float8", "n x 1 B")],
                   [("weight_scale (fp32 per output channel)", n * o * 4.0, f"{n} x {o} x 4 B")])


def _groups(in_f: int, g: int) -> int:
    return 1 if g == -1 else -(-in_f // g)


def _gptq(t: ParamTensor, s: WeightSettings) -> StoredTensor:
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
    return StoredTensor(t, [(f"qweight (int32, {bits}-bit packed)", t.numel * bits / 8, "int32",
                        f"n x {bits}/8 B")],
                   [("scales (fp16)", n * G * o * 2.0, f"{n} x ceil({i}/{gs}) x {o} x 2 B"),
                    ("qzeros (int32, packed)", n * G * o * bits / 8, f"{n} x ceil({i}/{gs}) x {o} x {bits}/8 B"),
                    ("g_idx (int32)", n * i * 4.0, f"{n} x {i} x 4 B")])


def _awq(t: ParamTensor, s: WeightSettings) -> StoredTensor:
    """AWQ GEMM layout, group size g (G = in/g): qweight int32 (in, out/8) = n/2 bytes;
    qzeros int32 (G, out/8) = G x out / 2 bytes; scales fp16 (G, out) = G x out x 2 bytes."""
    n, i, o = _dims(t)
    G = _groups(i, s.group_size)
    return StoredTensor(t, [("qweight (int32, 4-bit packed)", t.numel * 0.5, "int32", "n x 0.5 B")],
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


def _gguf_storage(arch: Architecture, s: WeightSettings) -> List[StoredTensor]:
    """Weights as llama.cpp holds a GGUF file's tensors: each 2-D tensor in the type
    :func:`gguf_tensor_type` picks (bytes = weights x bits per weight / 8, the ggml block
    sizes of :data:`GGML_BPW`); 1-D tensors (norms, biases) and the MoE router in F32."""
    mix = s.weights[5:]
    out = []
    for t in arch.tensors:
        cat = _gguf_category(t)
        shape = " x ".join(map(str, t.shape))
        if cat is None:
            out.append(StoredTensor(t, [("F32", t.numel * 4.0, "F32", f"{t.repeat} x {shape} x 4 B (F32)")], []))
            continue
        row = t.shape[-1]
        if t.layers is None:
            gt = gguf_tensor_type(mix, cat, 0, arch.num_layers, arch, row)
            out.append(StoredTensor(t, [(gt, t.numel * GGML_BPW[gt] / 8, gt,
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
        out.append(StoredTensor(t, parts, []))
    return out
