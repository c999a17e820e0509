"""Llama: the decoder most families are written as a variation of.

Parameters (transformers ``models/llama/modeling_llama.py``, ``LlamaForCausalLM``):
``model.embed_tokens``; per layer ``input_layernorm``, ``self_attn.{q,k,v,o}_proj``,
``post_attention_layernorm``, ``mlp.{gate,up,down}_proj``; ``model.norm``; ``lm_head``
(unless tied).  Block: RMSNorm -> q/k/v -> RoPE -> attention core -> o_proj -> residual ->
RMSNorm -> gated MLP -> residual.

The class is written as hooks (which norms, which attention projections, which MLP) that
the other families override; each hook emits tensors in the same order as the module
declares them.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Tuple

from .base import Family, register
from .blocks import experts_per_token
from .blocks import (F32, ParamBuilder, config_get, positive_count, required_count, restrict_layers, attention_params, dims,
                     Router, experts_params, gated_mlp, gated_mlp_params, linear, moe, residual, rms_norm, rotary,
                     sdpa_core, shared_mlp_params)
from ...errors import VramError


@register
class Llama(Family):
    model_types = ("llama",)
    #: tie_word_embeddings when the config does not say
    default_tie: bool = False
    #: Gemma-style RMSNorm: the weight multiplies the fp32 normalised tensor (``1 + w``)
    gemma_norm: bool = False
    #: the final norm is Gemma-style too
    gemma_final_norm: bool = False
    #: a norm before attention and before the MLP (False: OLMo 2 normalises outputs only)
    pre_norms: bool = True
    #: norms on the attention and MLP outputs (Gemma 2/3 sandwich, OLMo 2)
    out_norms: bool = False
    #: q_norm/k_norm: None, "head" (over d, Qwen3/Gemma 3) or "full" (over a*d, OLMo 2/OLMoE)
    qk_norm: Optional[str] = None
    #: a routed mixture of experts replaces the MLP when the config names experts
    moe: bool = False
    #: the expert MLP size's config field
    expert_size_field: str = "moe_intermediate_size"
    #: the family reads ``sliding_window`` (Mistral-style local attention)
    sliding: bool = False
    #: soft-capping of attention scores and final logits (Gemma 2/3)
    softcapping: bool = False
    #: one fused gate_up_proj (Phi-3)
    fused_gate_up: bool = False

    # -- parameters ---------------------------------------------------------------------
    def params(self, cfg: Mapping[str, Any], mt: str) -> Dict[str, Any]:
        D = dims(cfg)
        h, L, a, kv, V, d = D["h"], D["L"], D["a"], D["kv"], D["V"], D["d"]
        tied = bool(config_get(cfg, "tie_word_embeddings", default=self.default_tie))
        i = config_get(cfg, "intermediate_size", "n_inner", "ffn_dim")
        i = positive_count(cfg, i, "intermediate_size") if i is not None else None
        b = ParamBuilder(L)
        P = "model.layers.{i}."
        b.top("model.embed_tokens.weight", (V, h), "embedding", "embed_tokens")
        info: Dict[str, Any] = dict(hidden_size=h, num_layers=L, num_heads=a, num_kv_heads=kv, head_dim=d,
                                    vocab_size=V, tie_word_embeddings=tied)
        self.attention_params(b, cfg, P, info)
        self.qk_norm_params(b, P, info, cfg)
        self.mlp_params(b, cfg, P, info, i)
        self.norm_params(b, P, h)
        self.final_norm_params(b, h)
        if not tied:
            b.top("lm_head.weight", (V, h), "output_head", "lm_head")
        if self.sliding:
            self.sliding_info(cfg, L, info)
        if self.softcapping:
            info["attn_logit_softcapping"] = config_get(cfg, "attn_logit_softcapping")
            info["final_logit_softcapping"] = config_get(cfg, "final_logit_softcapping")
        info["tensors"] = b.tensors
        info["mlp_kind"] = self.mlp_kind
        info["norm_kind"] = self.norm_kind
        return info

    def attention_bias(self, cfg: Mapping[str, Any]) -> bool:
        """Biases on q, k, v and o (``attention_bias``, default false)."""
        return bool(config_get(cfg, "attention_bias", default=False))

    def attention_params(self, b: ParamBuilder, cfg: Mapping[str, Any], P: str, info: Dict[str, Any]) -> None:
        """The attention projections of one layer (q, k, v, o here)."""
        bias = self.attention_bias(cfg)
        attention_params(b, P, info["hidden_size"], info["num_heads"], info["num_kv_heads"], info["head_dim"],
                         qkv_bias=bias, o_bias=bias)

    def qk_norm_of(self, cfg: Mapping[str, Any]) -> Optional[str]:
        """This config's q/k norm: None, "head" or "full" (the class's ``qk_norm``)."""
        return self.qk_norm

    def qk_norm_params(self, b: ParamBuilder, P: str, info: Dict[str, Any], cfg: Mapping[str, Any]) -> None:
        """q_norm / k_norm weights when the family normalises queries and keys."""
        a, kv, d = info["num_heads"], info["num_kv_heads"], info["head_dim"]
        kind = self.qk_norm_of(cfg)
        if kind == "head":
            b.norm(P + "self_attn.q_norm", d, role="attn_norm")
            b.norm(P + "self_attn.k_norm", d, role="attn_norm")
        elif kind == "full":
            b.norm(P + "self_attn.q_norm", a * d, role="attn_norm")
            b.norm(P + "self_attn.k_norm", kv * d, role="attn_norm")

    def num_experts(self, cfg: Mapping[str, Any]) -> int:
        """Routed experts the config names (0: a dense MLP)."""
        return int(config_get(cfg, "num_local_experts", "num_experts", "n_routed_experts", default=0) or 0)

    def check_moe(self, cfg: Mapping[str, Any], E: int) -> int:
        """Validate the MoE layout; returns how many leading layers are dense."""
        return 0

    def shared_expert(self, cfg: Mapping[str, Any], i_e: int) -> Tuple[int, str, str]:
        """(size, module prefix, gate module or "") of the shared expert; size 0: none."""
        return 0, "", ""

    def mlp_params(self, b: ParamBuilder, cfg: Mapping[str, Any], P: str, info: Dict[str, Any],
                   i: Optional[int]) -> None:
        """The MLP of one layer, or (for an MoE family with experts) the dense prefix layers, the
        router, the fused experts and any shared expert."""
        h = info["hidden_size"]
        mlp_bias = bool(config_get(cfg, "mlp_bias", default=False))
        E = self.num_experts(cfg)
        dense_first = self.check_moe(cfg, E)
        if E and self.moe:
            k = experts_per_token(cfg, E)
            i_e = required_count(cfg, "expert intermediate size", self.expert_size_field)
            if dense_first:
                i_dense = required_count(cfg, "dense intermediate size", "intermediate_size")
                gated_mlp_params(b, P + "mlp.", h, i_dense, bias=mlp_bias)
                b.tensors[-3:] = [restrict_layers(t, 0, dense_first) for t in b.tensors[-3:]]
            # (DeepSeek-V3's e_score_correction_bias is a buffer in transformers, not a parameter)
            experts_params(b, P, E, h, i_e, first=dense_first)
            shared, pre, gate_name = self.shared_expert(cfg, i_e)
            if shared:
                shared_mlp_params(b, pre, h, shared, first=dense_first)
                if gate_name:
                    b.layer(P + "mlp." + gate_name + ".weight", (1, h), "router", first=dense_first)
            info.update(num_experts=E, experts_per_token=k, expert_intermediate_size=i_e,
                        shared_expert_intermediate_size=shared, dense_layers=dense_first,
                        intermediate_size=i if i else i_e)
        else:
            if i is None:
                raise VramError("config: missing field 'intermediate_size' (MLP size)", field="intermediate_size")
            gated_mlp_params(b, P + "mlp.", h, i, bias=mlp_bias, fused=self.fused_gate_up)
            info.update(intermediate_size=i)

    def norm_params(self, b: ParamBuilder, P: str, h: int) -> None:
        """The per-layer norms, in the order the decoder layer declares them."""
        if self.pre_norms:
            b.norm(P + "input_layernorm", h)
        b.norm(P + "post_attention_layernorm", h)
        if self.out_norms:
            if self.pre_norms:
                b.norm(P + "pre_feedforward_layernorm", h)
            b.norm(P + "post_feedforward_layernorm", h)

    def final_norm_params(self, b: ParamBuilder, h: int) -> None:
        """The norm after the last layer (``model.norm``)."""
        b.norm("model.norm", h, per_layer=False)

    def default_sliding_layers(self, cfg: Mapping[str, Any], L: int) -> int:
        """Sliding-window layers when the config has no ``layer_types`` list: all of them."""
        return L

    def sliding_info(self, cfg: Mapping[str, Any], L: int, info: Dict[str, Any]) -> None:
        """Sliding-window size and how many layers use it (``layer_types`` when given)."""
        sw = config_get(cfg, "sliding_window")
        use_sw = config_get(cfg, "use_sliding_window", default=True)
        if sw and use_sw:
            info["sliding_window"] = int(sw)
            types = cfg.get("layer_types")
            if isinstance(types, list) and types:
                info["sliding_layers"] = sum(1 for t in types if t == "sliding_attention")
            else:
                info["sliding_layers"] = self.default_sliding_layers(cfg, L)

    # -- training trace -----------------------------------------------------------------
    def norm(self, tr: Any, ctx: Any, x: Any, name: str, dim: float, group: str = "norms") -> Any:
        """The family's RMSNorm (Llama-style, or Gemma-style with ``gemma_norm``)."""
        return rms_norm(tr, ctx, x, name, dim, group, gemma=self.gemma_norm)

    def block(self, tr: Any, ctx: Any, x: Any) -> Any:
        arch, T = ctx.arch, ctx.T
        h = arch.hidden_size
        n1 = self.norm(tr, ctx, x, "input_layernorm", h) if self.pre_norms else x
        o_in = self.attention(tr, ctx, n1)
        o = linear(tr, ctx, o_in, "o_proj", h, "o_proj output", "attention", in_features=o_in.numel / T)
        if self.out_norms:
            o = self.norm(tr, ctx, o, "post_attention_layernorm", h)
        x1 = residual(tr, x, o, "residual after attention")
        if self.pre_norms:
            n2 = self.norm(tr, ctx, x1, "pre_feedforward_layernorm" if self.out_norms else "post_attention_layernorm",
                           h)
        else:
            n2 = x1
        m = self.mlp(tr, ctx, n2)
        if self.out_norms:
            m = self.norm(tr, ctx, m, "post_feedforward_layernorm", h)
        return tr.new("block output", x.numel, _promote_t(x1, m), True, "T x h", "norms")

    def qkv(self, tr: Any, ctx: Any, n1: Any) -> Tuple[Any, Any, Any]:
        """The q, k, v projections (before any q/k norm and RoPE)."""
        arch, T = ctx.arch, ctx.T
        a, kv, d = arch.num_heads, arch.num_kv_heads, arch.head_dim
        q = linear(tr, ctx, n1, "q_proj", a * d, "q_proj output", "attention")
        k = linear(tr, ctx, n1, "k_proj", kv * d, "k_proj output", "attention")
        v = linear(tr, ctx, n1, "v_proj", kv * d, "v", "attention")
        return q, k, v

    def attention(self, tr: Any, ctx: Any, n1: Any) -> Any:
        """Projections, q/k norms, RoPE and the attention core; returns the o_proj input."""
        arch, T = ctx.arch, ctx.T
        a, kv, d = arch.num_heads, arch.num_kv_heads, arch.head_dim
        q, k, v = self.qkv(tr, ctx, n1)
        kind = self.qk_norm_of(arch.config)
        if kind == "head":
            q = self.norm(tr, ctx, q, "q_norm", d, "attention")
            k = self.norm(tr, ctx, k, "k_norm", d, "attention")
        elif kind == "full":
            q = self.norm(tr, ctx, q, "q_norm", a * d, "attention")
            k = self.norm(tr, ctx, k, "k_norm", kv * d, "attention")
        qr, kr = rotary(tr, ctx, q, k, T * a * d, T * kv * d)
        return sdpa_core(tr, ctx, qr, kr, v, d, softcap=bool(arch.attn_logit_softcapping),
                         dropout_p=float(arch.config.get("attention_dropout") or 0.0),
                         q_heads_major=self.q_heads_major)

    #: q built by torch.cat (partial RoPE or a fused qkv split): flash output copied (Phi-3)
    q_heads_major: bool = False

    def mlp(self, tr: Any, ctx: Any, n2: Any) -> Any:
        """The MLP of one block: routed experts, or a gated MLP (dense layers of an MoE model
        use ``intermediate_size``)."""
        arch = ctx.arch
        if arch.is_moe and not ctx.dense_layer:
            return moe(tr, ctx, n2, shared_gate=self.shared_expert_gate)
        i = arch.intermediate_size
        if arch.is_moe:
            i = int(arch.config.get("intermediate_size") or i)
        return gated_mlp(tr, ctx, n2, i, fused=self.fused_gate_up)

    #: a sigmoid gate scales the shared expert's output (Qwen2-MoE)
    shared_expert_gate: bool = False

    def router(self, cfg: Mapping[str, Any]) -> Router:
        """The softmax top-k router of :func:`~vramwidget.model.activations.moe`: Qwen2/3-MoE, Qwen3-Next
        and OLMoE (``Qwen3MoeTopKRouter.forward`` in models/qwen3_moe/modeling_qwen3_moe.py, the
        same lines in qwen2_moe, qwen3_next and olmoe) divide the top-k weights by their sum
        when ``norm_topk_prob`` and cast them to the logits' dtype."""
        return Router(normalises=bool(config_get(cfg, "norm_topk_prob", default=False)))

    def final_norm(self, tr: Any, ctx: Any, x: Any) -> Any:
        return rms_norm(tr, ctx, x, "final norm", ctx.arch.hidden_size, group="output head",
                        gemma=self.gemma_final_norm)

    # -- inference ----------------------------------------------------------------------
    def inference_mlp(self, arch: Any, T: int, c: float) -> List[Tuple[str, float, str]]:
        i = arch.intermediate_size
        if self.fused_gate_up:
            return [("gate_up output", 2 * T * i * c, "T x 2i"), ("act(gate), product", 2 * T * i * c, "2 x T x i")]
        return [("act(gate), up, product", 3 * T * i * c, "3 x T x i")]


def _promote_t(a: Any, b: Any) -> str:
    return F32 if F32 in (a.dtype, b.dtype) else b.dtype
