"""DeepSeek-V2/V3: Llama with multi-head latent attention (MLA) and DeepSeekMoE.

MLA (transformers ``models/deepseek_v3/modular_deepseek_v3.py``): an optional low-rank
query (``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj``), a compressed KV latent
(``kv_a_proj_with_mqa``: kv_lora_rank + qk_rope_head_dim) normalised (``kv_a_layernorm``)
and expanded by ``kv_b_proj`` to every head's k_nope and v.  The first
``first_k_dense_replace`` layers have a dense MLP; the rest route to ``n_routed_experts``
plus ``n_shared_experts`` shared ones (one MLP n_shared x moe_intermediate_size wide).
"""

from typing import Any, Dict, Mapping, Tuple

from .base import register
from .blocks import ParamBuilder, Router, config_get, positive_count, required_count, linear, rms_norm, sdpa_core
from .llama import Llama
from ..activations import promote_dtype
from ...errors import VramError


@register
class DeepseekV2(Llama):
    model_types = ("deepseek_v2", "deepseek_v3")
    gguf_arch = "deepseek2"
    moe = True

    def attention_params(self, b: ParamBuilder, cfg: Mapping[str, Any], P: str, info: Dict[str, Any]) -> None:
        """MLA: low-rank q (or q_proj), the compressed KV latent and its norm, kv_b_proj, o_proj."""
        h, a = info["hidden_size"], info["num_heads"]
        attn_bias = self.attention_bias(cfg)
        q_lora = config_get(cfg, "q_lora_rank")
        kv_lora = required_count(cfg, "MLA latent rank", "kv_lora_rank")
        rope_d = required_count(cfg, "MLA rope head dim", "qk_rope_head_dim")
        nope_d = required_count(cfg, "MLA no-rope head dim", "qk_nope_head_dim")
        v_d = required_count(cfg, "MLA value head dim", "v_head_dim")
        q_head = rope_d + nope_d
        if q_lora:
            q_lora = positive_count(cfg, q_lora, "q_lora_rank")
            b.linear(P + "self_attn.q_a_proj", q_lora, h, "attn_q_a", bias=attn_bias)
            b.norm(P + "self_attn.q_a_layernorm", q_lora, role="attn_norm")
            b.linear(P + "self_attn.q_b_proj", a * q_head, q_lora, "attn_q_b")
        else:
            b.linear(P + "self_attn.q_proj", a * q_head, h, "attn_q")
        b.linear(P + "self_attn.kv_a_proj_with_mqa", kv_lora + rope_d, h, "attn_kv_a", bias=attn_bias)
        b.norm(P + "self_attn.kv_a_layernorm", kv_lora, role="attn_norm")
        b.linear(P + "self_attn.kv_b_proj", a * (nope_d + v_d), kv_lora, "attn_kv_b")
        b.linear(P + "self_attn.o_proj", h, a * v_d, "attn_o", bias=attn_bias)
        info.update(head_dim=q_head, num_kv_heads=a, mla=dict(kv_lora_rank=kv_lora, q_lora_rank=q_lora or 0,
                                                                qk_rope_head_dim=rope_d, qk_nope_head_dim=nope_d,
                                                                v_head_dim=v_d))

    def check_moe(self, cfg: Mapping[str, Any], E: int) -> int:
        dense_first = int(config_get(cfg, "first_k_dense_replace", default=0) or 0)
        if E and int(config_get(cfg, "moe_layer_freq", default=1) or 1) != 1:
            raise VramError("config: moe_layer_freq other than 1 is not supported", field="moe_layer_freq")
        return dense_first

    def shared_expert(self, cfg: Mapping[str, Any], i_e: int) -> Tuple[int, str, str]:
        n_shared = int(config_get(cfg, "n_shared_experts", default=0) or 0)
        return n_shared * i_e, "model.layers.{i}.mlp.shared_experts.", ""

    def router(self, cfg: Mapping[str, Any]) -> Router:
        """``DeepseekV2TopkRouter.forward`` (models/deepseek_v2/modeling_deepseek_v2.py):
        ``F.linear(x.float(), W.float())``, fp32 softmax, top-k (``greedy``), scaled by
        ``routed_scaling_factor`` (a scalar product keeps nothing), not normalised, left fp32."""
        return Router(weights_fp32=True, fp32_linear=True)

    def attention(self, tr: Any, ctx: Any, n1: Any) -> Any:
        arch, T = ctx.arch, ctx.T
        a = arch.num_heads
        m = arch.mla
        rope_dtype = promote_dtype(ctx.resid, ctx.c) if (ctx.setup.autocast or ctx.quant_base) else ctx.c
        qh = m["qk_rope_head_dim"] + m["qk_nope_head_dim"]
        if m["q_lora_rank"]:
            qa = linear(tr, ctx, n1, "q_a_proj", m["q_lora_rank"], "q_a", "attention")
            qa_n = rms_norm(tr, ctx, qa, "q_a_layernorm", m["q_lora_rank"], "attention")
            linear(tr, ctx, qa_n, "q_b_proj", a * qh, "q", "attention", in_features=m["q_lora_rank"])
        else:
            linear(tr, ctx, n1, "q_proj", a * qh, "q", "attention")
        kva = linear(tr, ctx, n1, "kv_a_proj_with_mqa", m["kv_lora_rank"] + m["qk_rope_head_dim"], "kv_a",
                     "attention")
        # the latent (kv_lora_rank wide) is normalised; the rope part goes through complex RoPE
        latent = tr.new("kv latent", T * m["kv_lora_rank"], kva.dtype, kva.rg, "T x kv_lora_rank", "attention")
        kvn = rms_norm(tr, ctx, latent, "kv_a_layernorm", m["kv_lora_rank"], "attention")
        kvb = linear(tr, ctx, kvn, "kv_b_proj", a * (m["qk_nope_head_dim"] + m["v_head_dim"]), "kv_b output",
                     "attention", in_features=m["kv_lora_rank"])
        # query = cat(q_nope, rope(q_pe)) and key = a new tensor filled from k_nope and rope(k_pe);
        # value is a view of kv_b_proj's output, so the attention keeps all of that output
        qr = tr.new("q (nope + rope, concatenated)", T * a * qh, rope_dtype, True, "T x a x (nope+rope)",
                    "attention")
        kr = tr.new("k (nope + rope, new tensor)", T * a * qh, rope_dtype, True, "T x a x (nope+rope)",
                    "attention")
        return sdpa_core(tr, ctx, qr, kr, kvb, m["v_head_dim"])
