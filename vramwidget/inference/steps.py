"""Working sets of one decoder layer (prefill) and of one decode step: the live tensors at each
step, with their formulas (the symbols of :mod:`vramwidget.model.architecture`: h, a, kv, d, i, V, E,
k, plus b, q new tokens, S cached ones, T = b x q)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Dict, List, Tuple

from ..model.architecture import Architecture
from ..units import DTYPE_BYTES
from .kv import KVLayout
from .setup import InferenceSetup
from .weights import StoredTensor


def attention_kernel(arch: Architecture, s: InferenceSetup, masked: bool) -> str:
    """The attention kernel: eager, flash/efficient (no scores kept), or math (scores)."""
    from ..model.activations import attention_backend

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


def dequant_transients(stored: List[StoredTensor], s: InferenceSetup, tokens: int) -> List[Tuple[str, float, str]]:
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


def decode_transients(arch: Architecture, s: InferenceSetup, lay: KVLayout, stored: List[StoredTensor]
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
