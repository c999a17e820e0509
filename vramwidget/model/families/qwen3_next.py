"""Qwen3-Next: a hybrid of Gated DeltaNet linear attention (3 of every 4 layers) and gated
full attention, with a Qwen2-MoE style mixture of experts (transformers
``models/qwen3_next/modeling_qwen3_next.py``, ``Qwen3NextForCausalLM``).

* Norms are zero-centred RMSNorms (``x * rsqrt(.) * (1 + w)`` in fp32, Gemma-style).
* Full-attention layers (every ``full_attention_interval``-th): ``q_proj`` outputs the
  query and an output gate (2 x a x d), per-head q/k RMSNorm, partial RoPE, attention, the
  output multiplied by ``sigmoid(gate)``, ``o_proj``.
* Linear-attention layers (Qwen3NextGatedDeltaNet): ``in_proj_qkvz`` (q, k, v, z) and
  ``in_proj_ba`` (beta, a), a depthwise causal ``conv1d`` over q, k, v (kernel
  ``linear_conv_kernel_dim``) with SiLU, the chunked gated delta rule, a gated RMSNorm
  (``norm``, over the value head dim, gated by z) and ``out_proj``.  Their generation state
  is a fixed-size recurrent state (value heads x d_k x d_v) plus the conv window, not a KV
  cache.
* MLP: router ``mlp.gate``, fused experts, a shared expert and its sigmoid gate
  (``mlp.shared_expert_gate``); ``mlp_only_layers`` are dense.

The linear-attention layers' saved tensors are modelled for the fused kernels
(flash-linear-attention's ``chunk_gated_delta_rule`` and causal-conv1d, which transformers
uses when they are installed): the projections, the conv input and output, q, k, v, the gates
g and beta, the rule's output and the gated norm.  This block is not yet checked against
autograd (the CPU runs transformers' pure-torch fallback, which keeps per-chunk states).
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping

from .base import register
from .blocks import experts_per_token
from .blocks import F32, ParamBuilder, config_get, promote_dtype, required_count, dims, gated_mlp, linear, moe, residual, rms_norm, \
    rotary, sdpa_core
from .llama import Llama


@register
class Qwen3Next(Llama):
    model_types = ("qwen3_next",)
    gguf_arch = "qwen3next"
    gemma_norm = True
    gemma_final_norm = True
    moe = True
    shared_expert_gate = True
    q_heads_major = True

    def layer_types(self, cfg: Mapping[str, Any], L: int) -> List[str]:
        """``layer_types``, or every ``full_attention_interval``-th layer full attention."""
        types = cfg.get("layer_types")
        if isinstance(types, list) and len(types) == L:
            return [str(t) for t in types]
        n = int(config_get(cfg, "full_attention_interval", default=4) or 4)
        return ["full_attention" if (j + 1) % n == 0 else "linear_attention" for j in range(L)]

    def params(self, cfg: Mapping[str, Any], mt: str) -> Dict[str, Any]:
        D = dims(cfg)
        h, L, a, kv, V, d = D["h"], D["L"], D["a"], D["kv"], D["V"], D["d"]
        nk = required_count(cfg, "linear key heads", "linear_num_key_heads")
        nv = required_count(cfg, "linear value heads", "linear_num_value_heads")
        dk = required_count(cfg, "linear key head dim", "linear_key_head_dim")
        dv = required_count(cfg, "linear value head dim", "linear_value_head_dim")
        K = int(config_get(cfg, "linear_conv_kernel_dim", default=4) or 4)
        E = required_count(cfg, "experts", "num_experts")
        k = experts_per_token(cfg, E)
        i_e = required_count(cfg, "expert intermediate size", "moe_intermediate_size")
        i_sh = int(config_get(cfg, "shared_expert_intermediate_size", default=0) or 0)
        i = int(config_get(cfg, "intermediate_size", default=0) or 0)
        tied = bool(config_get(cfg, "tie_word_embeddings", default=False))
        types = self.layer_types(cfg, L)
        full = [j for j, t in enumerate(types) if t == "full_attention"]
        lin = [j for j, t in enumerate(types) if t != "full_attention"]
        step = int(config_get(cfg, "decoder_sparse_step", default=1) or 1)
        dense = set(cfg.get("mlp_only_layers") or [])
        moe_layers = [j for j in range(L) if j not in dense and (j + 1) % step == 0]
        dense_layers = [j for j in range(L) if j not in set(moe_layers)]
        P = "model.layers.{i}."
        b = ParamBuilder(L)
        b.top("model.embed_tokens.weight", (V, h), "embedding", "embed_tokens")
        conv_dim = 2 * nk * dk + nv * dv

        def linear_attn(sub: ParamBuilder) -> None:
            sub.layer(P + "linear_attn.dt_bias", (nv,), "mixer")
            sub.layer(P + "linear_attn.A_log", (nv,), "mixer")
            sub.layer(P + "linear_attn.conv1d.weight", (conv_dim, 1, K), "mixer")
            sub.linear(P + "linear_attn.in_proj_qkvz", 2 * nk * dk + 2 * nv * dv, h, "mixer_proj")
            sub.linear(P + "linear_attn.in_proj_ba", 2 * nv, h, "mixer_proj")
            sub.norm(P + "linear_attn.norm", dv, role="mixer")
            sub.linear(P + "linear_attn.out_proj", h, nv * dv, "mixer_proj")

        def attn(sub: ParamBuilder) -> None:
            sub.linear(P + "self_attn.q_proj", 2 * a * d, h, "attn_q")
            sub.linear(P + "self_attn.k_proj", kv * d, h, "attn_k")
            sub.linear(P + "self_attn.v_proj", kv * d, h, "attn_v")
            sub.linear(P + "self_attn.o_proj", h, a * d, "attn_o")
            sub.norm(P + "self_attn.q_norm", d, role="attn_norm")
            sub.norm(P + "self_attn.k_norm", d, role="attn_norm")

        def experts(sub: ParamBuilder) -> None:
            sub.layer(P + "mlp.gate.weight", (E, h), "router")
            sub.layer(P + "mlp.experts.gate_up_proj", (E, 2 * i_e, h), "expert_gate_up", linear=True, experts=E)
            sub.layer(P + "mlp.experts.down_proj", (E, h, i_e), "expert_down", linear=True, experts=E)
            if i_sh:
                for nm, o, inp in (("gate_proj", i_sh, h), ("up_proj", i_sh, h), ("down_proj", h, i_sh)):
                    sub.linear(P + "mlp.shared_expert." + nm, o, inp, "shared_expert")
                sub.layer(P + "mlp.shared_expert_gate.weight", (1, h), "router")

        def dense_mlp(sub: ParamBuilder) -> None:
            for nm, o, inp, role in (("gate_proj", i, h, "mlp_gate"), ("up_proj", i, h, "mlp_up"),
                                     ("down_proj", h, i, "mlp_down")):
                sub.linear(P + "mlp." + nm, o, inp, role)

        b.in_layers(lin, linear_attn)
        b.in_layers(full, attn)
        b.in_layers(moe_layers, experts)
        b.in_layers(dense_layers, dense_mlp)
        b.norm(P + "input_layernorm", h)
        b.norm(P + "post_attention_layernorm", h)
        b.norm("model.norm", h, per_layer=False)
        if not tied:
            b.top("lm_head.weight", (V, h), "output_head", "lm_head")
        kinds = [(kd, n) for kd, n in (("linear_attention", len(lin)), ("full_attention", len(full))) if n]
        return dict(hidden_size=h, num_layers=L, num_heads=a, num_kv_heads=kv, head_dim=d, vocab_size=V,
                    tie_word_embeddings=tied, intermediate_size=i or i_e, num_experts=E, experts_per_token=k,
                    expert_intermediate_size=i_e, shared_expert_intermediate_size=i_sh, tensors=b.tensors,
                    mlp_kind="gated", norm_kind="rms", layer_kinds=kinds, kv_cache_layers=len(full),
                    layer_order=["full_attention" if t == "full_attention" else "linear_attention" for t in types],
                    state_elems_per_seq=len(lin) * (nv * dk * dv + conv_dim * K))

    def block(self, tr: Any, ctx: Any, x: Any) -> Any:
        arch = ctx.arch
        h = arch.hidden_size
        n1 = self.norm(tr, ctx, x, "input_layernorm", h)
        if (ctx.kind or arch.layer_kinds[0][0]) == "full_attention":
            o = self.gated_attention(tr, ctx, n1)
        else:
            o = gated_delta_net(tr, ctx, n1)
        x1 = residual(tr, x, o, "residual after the mixer")
        n2 = self.norm(tr, ctx, x1, "post_attention_layernorm", h)
        m = moe(tr, ctx, n2, shared_gate=True) if arch.is_moe else gated_mlp(tr, ctx, n2, arch.intermediate_size)
        return tr.new("block output", x.numel, promote_dtype(x1.dtype, m.dtype), True, "T x h", "norms")

    def gated_attention(self, tr: Any, ctx: Any, n1: Any) -> Any:
        """q (+ gate) / k / v, per-head norms, partial RoPE, attention, * sigmoid(gate), o_proj."""
        arch, T = ctx.arch, ctx.T
        a, kv, d, h = arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.hidden_size
        qg = linear(tr, ctx, n1, "q_proj", 2 * a * d, "q_proj output (query, gate)", "attention")
        k = linear(tr, ctx, n1, "k_proj", kv * d, "k_proj output", "attention")
        v = linear(tr, ctx, n1, "v_proj", kv * d, "v", "attention")
        q = tr.new("query (view of q_proj output)", T * a * d, qg.dtype, qg.rg, "T x a*d", "attention")
        q = self.norm(tr, ctx, q, "q_norm", d, "attention")
        k = self.norm(tr, ctx, k, "k_norm", d, "attention")
        qr, kr = rotary(tr, ctx, q, k, T * a * d, T * kv * d)
        o = sdpa_core(tr, ctx, qr, kr, v, d, q_heads_major=True)
        if o.rg:
            tr.save(o)
            tr.save(tr.new("sigmoid(gate)", T * a * d, o.dtype, True, "T x a*d", "attention"))
        g = tr.new("attention output * sigmoid(gate)", T * a * d, o.dtype, o.rg, "T x a*d", "attention")
        return linear(tr, ctx, g, "o_proj", h, "o_proj output", "attention", in_features=a * d)


def gated_delta_net(tr: Any, ctx: Any, x: Any) -> Any:
    """Qwen3NextGatedDeltaNet with the fused kernels (see the module docstring)."""
    arch, T = ctx.arch, ctx.T
    cfg = arch.config
    h = arch.hidden_size
    nk, nv = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
    dk, dv = int(cfg["linear_key_head_dim"]), int(cfg["linear_value_head_dim"])
    key, val = nk * dk, nv * dv
    qkvz = linear(tr, ctx, x, "in_proj_qkvz", 2 * key + 2 * val, "in_proj_qkvz output", "mixer")
    ba = linear(tr, ctx, x, "in_proj_ba", 2 * nv, "in_proj_ba output", "mixer")
    rg = qkvz.rg or ba.rg
    c = qkvz.dtype
    if rg:
        tr.save(tr.new("conv input (q, k, v)", T * (2 * key + val), c, True, "T x conv_dim", "mixer"))
        tr.save(tr.new("conv output before SiLU", T * (2 * key + val), c, True, "T x conv_dim", "mixer"))
        tr.save(tr.new("q, k, v after SiLU (rule inputs)", T * (2 * key + val), c, True, "T x conv_dim", "mixer"))
        tr.save(tr.new("decay g = -exp(A) softplus(a + dt_bias) (fp32)", T * nv, F32, True, "T x nv fp32", "mixer"))
        tr.save(tr.new("beta = sigmoid(b)", T * nv, c, True, "T x nv", "mixer"))
        tr.save(tr.new("gated delta rule output", T * val, c, True, "T x nv*dv", "mixer"))
        tr.save(tr.new("z (the norm's gate)", T * val, c, True, "T x nv*dv", "mixer"))
    rms_norm(tr, ctx, tr.new("rule output (normed per value head)", T * val, c, rg, "T x nv*dv", "mixer"),
                 "gated norm", dv, "mixer", gemma=False)
    if rg:
        tr.save(tr.new("SiLU(z) (gate)", T * val, F32, True, "T x nv*dv fp32", "mixer"))
    g = tr.new("normed output * SiLU(z)", T * val, c, rg, "T x nv*dv", "mixer")

    return linear(tr, ctx, g, "out_proj", h, "out_proj output", "mixer", in_features=val)


