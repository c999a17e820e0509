"""gpt-oss: Llama-shaped attention with biases and learned attention sinks, alternating
sliding-window (128) and full layers, and a top-k MoE whose experts use a clamped SwiGLU
with biases (transformers ``models/gpt_oss/modeling_gpt_oss.py``, ``GptOssForCausalLM``).

Parameters: q/k/v/o with biases (``attention_bias``, default true), ``self_attn.sinks``
(one logit per head), ``mlp.router`` (E x h weight + E bias), fused experts stored
transposed (``gate_up_proj`` E x h x 2i, ``down_proj`` E x i x h, plus their biases), and
RMSNorms that transformers keeps in fp32 (``_keep_in_fp32_modules``).

Assumption (stated on every estimate): training runs on the bf16 weights.  The released
checkpoints store the experts in MXFP4; transformers dequantizes them to bf16 when the
model is loaded for training (``Mxfp4Config(dequantize=True)``), which is what is counted.

Attention: transformers has no SDPA path for the sinks (``_supports_sdpa = False``); the
eager path concatenates the sink logit to each row, so it keeps (b, a, s, s + 1) softmax
probabilities in the compute dtype and the int64 indices of the row max (see
:func:`sink_attention`).  flash_attention_2 takes the sinks as ``s_aux``.

Experts (``integrations/moe.py``, grouped_mm): each token is copied to its k experts;
``_apply_gate`` clamps the interleaved gate and up halves of the (T*k, 2i) projection
(both clamps keep that output), then ``(up + 1) * gate * sigmoid(alpha * gate)`` keeps the
clamped gate, the sigmoid, the glu and ``up + 1``.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping

from .base import register
from .blocks import experts_per_token
from .blocks import ParamBuilder, config_get, required_count, dims, linear, rotary
from .llama import Llama


@register
class GptOss(Llama):
    model_types = ("gpt_oss",)
    gguf_arch = "gpt-oss"
    gemma_norm = True          # (w * x).to(dtype): the weight multiplies in fp32
    gemma_final_norm = True
    sliding = True
    moe = True
    sdpa_supported = False
    q_heads_major = True       # RoPE by chunk + cat builds q heads-major
    #: transformers' MXFP4 path (integrations/mxfp4.py) replaces this family's experts
    mxfp4_experts = True

    def params(self, cfg: Mapping[str, Any], mt: str) -> Dict[str, Any]:
        D = dims(cfg)
        h, L, a, kv, V, d = D["h"], D["L"], D["a"], D["kv"], D["V"], D["d"]
        E = required_count(cfg, "experts", "num_local_experts")
        k = experts_per_token(cfg, E)
        i = required_count(cfg, "expert intermediate size", "intermediate_size")
        bias = bool(config_get(cfg, "attention_bias", default=True))
        tied = bool(config_get(cfg, "tie_word_embeddings", default=False))
        b = ParamBuilder(L)
        P = "model.layers.{i}."
        b.top("model.embed_tokens.weight", (V, h), "embedding", "embed_tokens")
        b.layer(P + "self_attn.sinks", (a,), "attn_sink")
        b.linear(P + "self_attn.q_proj", a * d, h, "attn_q", bias=bias)
        b.linear(P + "self_attn.k_proj", kv * d, h, "attn_k", bias=bias)
        b.linear(P + "self_attn.v_proj", kv * d, h, "attn_v", bias=bias)
        b.linear(P + "self_attn.o_proj", h, a * d, "attn_o", bias=bias)
        b.layer(P + "mlp.router.weight", (E, h), "router")
        b.layer(P + "mlp.router.bias", (E,), "router")
        b.layer(P + "mlp.experts.gate_up_proj", (E, h, 2 * i), "expert_gate_up", linear=True, experts=E,
                transposed=True)
        b.layer(P + "mlp.experts.gate_up_proj_bias", (E, 2 * i), "expert_gate_up")
        b.layer(P + "mlp.experts.down_proj", (E, i, h), "expert_down", linear=True, experts=E, transposed=True)
        b.layer(P + "mlp.experts.down_proj_bias", (E, h), "expert_down")
        b.norm(P + "input_layernorm", h, keep_fp32=True)
        b.norm(P + "post_attention_layernorm", h, keep_fp32=True)
        b.norm("model.norm", h, per_layer=False, keep_fp32=True)
        if not tied:
            b.top("lm_head.weight", (V, h), "output_head", "lm_head")
        info: Dict[str, Any] = dict(hidden_size=h, num_layers=L, num_heads=a, num_kv_heads=kv, head_dim=d,
                                    vocab_size=V, tie_word_embeddings=tied, intermediate_size=i, num_experts=E,
                                    experts_per_token=k, expert_intermediate_size=i, tensors=b.tensors,
                                    mlp_kind="gated", norm_kind="rms")
        self.sliding_info(cfg, L, info)
        return info

    def notes(self, arch: Any) -> List[str]:
        """The MXFP4 assumption."""
        return ["gpt-oss: the released checkpoints store the experts in MXFP4; training dequantizes them to bf16 "
                "(transformers' Mxfp4Config(dequantize=True)), which is what is counted"]

    def default_sliding_layers(self, cfg: Mapping[str, Any], L: int) -> int:
        return (L + 1) // 2    # sliding on even layers when no layer_types are given

    def attention(self, tr: Any, ctx: Any, n1: Any) -> Any:
        arch, T = ctx.arch, ctx.T
        a, kv, d = arch.num_heads, arch.num_kv_heads, arch.head_dim
        q, k, v = self.qkv(tr, ctx, n1)
        qr, kr = rotary(tr, ctx, q, k, T * a * d, T * kv * d)
        if ctx.attn_backend != "eager":
            from .blocks import sdpa_core

            return sdpa_core(tr, ctx, qr, kr, v, d, q_heads_major=True)
        return sink_attention(tr, ctx, qr, kr, v)

    def mlp(self, tr: Any, ctx: Any, n2: Any) -> Any:
        return clamped_swiglu_experts(tr, ctx, n2)


def sink_attention(tr: Any, ctx: Any, q: Any, k: Any, v: Any) -> Any:
    """gpt-oss's eager attention: ``cat([q k^T * scale + mask, sinks])``, minus the row max,
    softmax in the compute dtype, drop the sink column, ``@ v``.  Keeps q, the repeated k
    and v (repeat_kv copies when kv < a), the (b, a, s, s + 1) probabilities and the row
    max's int64 indices (b, a, s)."""
    arch = ctx.arch
    a, kv, d = arch.num_heads, arch.num_kv_heads, arch.head_dim
    b, s, T, c = ctx.b, ctx.s, ctx.T, ctx.c
    rg = q.rg or k.rg or v.rg
    if rg:
        tr.save(q)
        if a != kv:
            tr.save(tr.new("k repeated to all heads", T * a * d, c, True, "T x a*d (repeat_kv copy)", "attention"))
            tr.save(tr.new("v repeated to all heads", T * a * d, c, True, "T x a*d (repeat_kv copy)", "attention"))
        else:
            tr.save(k)
            tr.save(v)
        tr.save(tr.new("row max indices (int64)", b * a * s, "int64", True, "b x a x s x 8 B", "attention"))
        tr.save(tr.new("softmax output with the sink column", b * a * s * (s + 1), c, True, "b x a x s x (s+1)",
                       "attention"))
    return tr.new("attention output", T * a * d, c, rg, "T x a*d (transposed copy)", "attention")


def clamped_swiglu_experts(tr: Any, ctx: Any, x: Any) -> Any:
    """Router (linear with bias, top-k, softmax over the k) and grouped_mm experts with
    biases and gpt-oss's clamped SwiGLU; every tensor is T*k rows."""
    arch, T = ctx.arch, ctx.T
    E, k, i, h = arch.num_experts, arch.experts_per_token, arch.expert_intermediate_size, arch.hidden_size
    logits = linear(tr, ctx, x, "router", E, "router logits", "router")
    trains = ctx.linear_trains
    rg = x.rg or trains
    if logits.rg:
        tr.save(tr.new("top-k indices (int64)", T * k, "int64", True, "T x k x 8 B", "router"))
        tr.save(tr.new("routing softmax over the top k", T * k, logits.dtype, True, "T x k", "router"))
    Tk = T * k
    c = ctx.c
    if trains:
        tr.save(tr.new("tokens copied to experts", Tk * h, x.dtype, x.rg, f"T*k x h (k={k})", "experts"))
    if rg:
        tr.save(tr.new("token -> expert copy indices (int64)", Tk, "int64", True, "T*k x 8 B", "experts"))
        for nm, n in (("expert gate_up output (kept by both clamps)", Tk * 2 * i),
                      ("clamped gate", Tk * i), ("sigmoid(alpha * gate)", Tk * i), ("gate * sigmoid", Tk * i),
                      ("up + 1", Tk * i)):
            tr.save(tr.new(nm, n, c, True, "T*k x " + ("2i" if "gate_up" in nm else "i"), "experts"))
        if trains:
            tr.save(tr.new("expert act output (down input)", Tk * i, c, True, "T*k x i", "experts"))
        tr.save(tr.new("expert down output", Tk * h, c, True, "T*k x h", "experts"))
        tr.save(tr.new("routing weights (sorted)", Tk, c, True, "T*k", "router"))
        tr.save(tr.new("inverse permutation indices (int64)", Tk, "int64", True, "T*k x 8 B", "experts"))
    return tr.new("experts output", T * h, c, rg, "T x h", "experts")


