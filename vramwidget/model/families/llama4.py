"""Llama 4 (text): Llama with NoPE layers, L2-normalised q/k, chunked local attention and a
mixture of experts that runs every expert on every token (transformers
``models/llama4/modeling_llama4.py``, ``Llama4ForCausalLM``).

* Every ``no_rope_layer_interval``-th layer (4) has no RoPE and scales q by a position
  temperature; the others apply complex RoPE (``view_as_complex``, fp32) and, with
  ``use_qk_norm``, a weightless L2 norm of q and k; RoPE layers attend in chunks of
  ``attention_chunk_size`` (a mask: SDPA's memory-efficient kernel).
* MoE layers (``moe_layers``, every ``interleave_moe_layer_step``-th by default): a sigmoid
  router over E experts (top-k), a shared expert (``intermediate_size``), and experts that
  ``repeat`` the tokens E times and weight them by the (mostly zero) router scores, so the
  expert tensors are E x T rows, not k x T (``Llama4TextMoe.forward``).  Dense layers use
  ``intermediate_size_mlp``.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Tuple

from .base import register
from .blocks import experts_per_token
from .blocks import F32, ParamBuilder, config_get, required_count, dims, gated_mlp, gated_mlp_params, linear, sdpa_core
from .llama import Llama


@register
class Llama4Text(Llama):
    model_types = ("llama4_text",)
    gguf_arch = "llama4"
    moe = True
    sliding = False

    def layout(self, cfg: Mapping[str, Any], L: int) -> Tuple[List[int], List[int]]:
        """(MoE layer indices, RoPE layer indices) as Llama4TextConfig derives them."""
        step = int(config_get(cfg, "interleave_moe_layer_step", default=1) or 1)
        moe = cfg.get("moe_layers")
        moe = list(moe) if isinstance(moe, list) else list(range(step - 1, L, step))
        nr = cfg.get("no_rope_layers")
        interval = int(config_get(cfg, "no_rope_layer_interval", default=4) or 4)
        if not isinstance(nr, list) or not nr:
            nr = [int((j + 1) % interval != 0) for j in range(L)]
        rope = [j for j in range(L) if nr[j]]
        return [j for j in moe if j < L], rope

    def params(self, cfg: Mapping[str, Any], mt: str) -> Dict[str, Any]:
        D = dims(cfg)
        h, L, a, kv, V, d = D["h"], D["L"], D["a"], D["kv"], D["V"], D["d"]
        E = required_count(cfg, "experts", "num_local_experts")
        k = experts_per_token(cfg, E)
        i = required_count(cfg, "expert intermediate size", "intermediate_size")
        i_mlp = required_count(cfg, "dense MLP size", "intermediate_size_mlp")
        bias = bool(config_get(cfg, "attention_bias", default=False))
        tied = bool(config_get(cfg, "tie_word_embeddings", default=False))
        moe_layers, rope_layers = self.layout(cfg, L)
        dense_layers = [j for j in range(L) if j not in set(moe_layers)]
        b = ParamBuilder(L)
        P = "model.layers.{i}."
        b.top("model.embed_tokens.weight", (V, h), "embedding", "embed_tokens")
        for nm, o, inp, role in (("q_proj", a * d, h, "attn_q"), ("k_proj", kv * d, h, "attn_k"),
                                 ("v_proj", kv * d, h, "attn_v"), ("o_proj", h, a * d, "attn_o")):
            b.linear(P + "self_attn." + nm, o, inp, role, bias=bias)

        def dense(sub: ParamBuilder) -> None:
            gated_mlp_params(sub, P + "feed_forward.", h, i_mlp)

        def experts(sub: ParamBuilder) -> None:
            sub.layer(P + "feed_forward.experts.gate_up_proj", (E, h, 2 * i), "expert_gate_up", linear=True,
                      experts=E, transposed=True)
            sub.layer(P + "feed_forward.experts.down_proj", (E, i, h), "expert_down", linear=True, experts=E,
                      transposed=True)
            sub.layer(P + "feed_forward.router.weight", (E, h), "router")
            for nm, o, inp in (("gate_proj", i, h), ("up_proj", i, h), ("down_proj", h, i)):
                sub.linear(P + "feed_forward.shared_expert." + nm, o, inp, "shared_expert")

        b.in_layers(dense_layers, dense)
        b.in_layers(moe_layers, experts)
        b.norm(P + "input_layernorm", h)
        b.norm(P + "post_attention_layernorm", h)
        b.norm("model.norm", h, per_layer=False)
        if not tied:
            b.top("lm_head.weight", (V, h), "output_head", "lm_head")
        n_rope = len(rope_layers)
        moe_set = set(moe_layers)
        order = [("rope" if j in set(rope_layers) else "nope") + ("+moe" if j in moe_set else "+dense")
                 for j in range(L)]
        kinds: Dict[str, int] = {}
        for key in order:
            kinds[key] = kinds.get(key, 0) + 1
        info: Dict[str, Any] = dict(hidden_size=h, num_layers=L, num_heads=a, num_kv_heads=kv, head_dim=d,
                                    vocab_size=V, tie_word_embeddings=tied, intermediate_size=i_mlp,
                                    num_experts=E, experts_per_token=k, expert_intermediate_size=i,
                                    shared_expert_intermediate_size=i, tensors=b.tensors, mlp_kind="gated",
                                    norm_kind="rms", layer_kinds=list(kinds.items()), layer_order=order)
        chunk = config_get(cfg, "attention_chunk_size")
        if chunk and n_rope:
            # chunked attention keeps at most one chunk of keys per RoPE layer (a window for the cache)
            info["sliding_window"] = int(chunk)
            info["sliding_layers"] = n_rope
        return info

    def kind_of(self, ctx: Any) -> Tuple[bool, bool]:
        """(RoPE layer, MoE layer) of the block being traced."""
        kind = ctx.kind or ctx.arch.layer_kinds[0][0]
        return kind.startswith("rope"), kind.endswith("moe")

    def attention(self, tr: Any, ctx: Any, n1: Any) -> Any:
        arch, T = ctx.arch, ctx.T
        a, kv, d = arch.num_heads, arch.num_kv_heads, arch.head_dim
        rope, _ = self.kind_of(ctx)
        q, k, v = self.qkv(tr, ctx, n1)
        c = ctx.c
        if rope:
            # view_as_complex(x.float()) * freqs_cis: the product keeps only freqs_cis (shared by all
            # layers); the rotated q, k come back as new tensors in the compute dtype
            q = tr.new("q after complex rope", T * a * d, c, q.rg, "T x a*d", "attention")
            k = tr.new("k after complex rope", T * kv * d, c, k.rg, "T x kv*d", "attention")
            if arch.config.get("use_qk_norm", True):
                q = l2_norm(tr, q, a, d, "q")
                k = l2_norm(tr, k, kv, d, "k")
            if self.chunk_masked(arch, ctx.setup) and ctx.attn_backend in ("flash", "efficient") and a != kv:
                # a chunked mask: transformers' use_gqa_in_sdpa is false, so repeat_kv copies k and v
                # to every head before SDPA (integrations/sdpa_attention.py)
                k = tr.new("k repeated to all heads (masked SDPA)", T * a * d, c, k.rg, "T x a*d", "attention")
                v = tr.new("v repeated to all heads (masked SDPA)", T * a * d, c, v.rg, "T x a*d", "attention")
        elif arch.config.get("attn_temperature_tuning", True):
            # (q * attn_scales).to(dtype): the fp32 product is cast back; only the scales are kept
            q = tr.new("q scaled by the NoPE temperature", T * a * d, c, q.rg, "T x a*d", "attention")
        # Llama 4's eager softmax stays in the compute dtype (no fp32 upcast)
        return sdpa_core(tr, ctx, q, k, v, d, dropout_p=float(arch.config.get("attention_dropout") or 0.0),
                         softmax_fp32=False)

    def chunk_masked(self, arch: Any, setup: Any) -> bool:
        """RoPE layers get an attention mask only when the sequence is longer than a chunk."""
        chunk = arch.config.get("attention_chunk_size")
        return bool(chunk) and setup.seq_len > int(chunk)

    def trace_key(self, arch: Any, setup: Any) -> Any:
        return self.chunk_masked(arch, setup)

    def mlp(self, tr: Any, ctx: Any, n2: Any) -> Any:
        _, is_moe = self.kind_of(ctx)
        if not is_moe:
            return gated_mlp(tr, ctx, n2, int(ctx.arch.config.get("intermediate_size_mlp") or
                                              ctx.arch.intermediate_size))
        return all_experts_moe(tr, ctx, n2)

    def inference_mlp(self, arch: Any, T: int, c: float) -> List[Tuple[str, float, str]]:
        E, i, h = arch.num_experts, arch.expert_intermediate_size, arch.hidden_size
        return [("tokens repeated to every expert + gate_up + act + product", E * T * (2 * h + 4 * i) * c,
                 "E x T x (2h + 4 i_e)")]


def l2_norm(tr: Any, x: Any, heads: int, d: int, label: str) -> Any:
    """Llama4TextL2Norm: ``x.float() * rsqrt(mean(x^2) + eps)`` cast back; keeps the fp32
    copy and the per-head rsqrt."""
    rows = x.numel / d
    if x.rg:
        tr.save(tr.new(f"{label} L2 norm input as fp32", x.numel, F32, True, "T x heads*d fp32", "attention"))
        tr.save(tr.new(f"{label} L2 norm rsqrt", rows, F32, True, "T x heads fp32", "attention"))
    return tr.new(f"{label} after L2 norm", x.numel, x.dtype, x.rg, "T x heads*d", "attention")


def all_experts_moe(tr: Any, ctx: Any, x: Any) -> Any:
    """Llama4TextMoe: sigmoid router scores for all E experts (zero but the top k), the
    tokens repeated E times and multiplied by them, two bmm over every expert, the shared
    expert, and the sum over experts."""
    arch, T = ctx.arch, ctx.T
    E, k, i, h = arch.num_experts, arch.experts_per_token, arch.expert_intermediate_size, arch.hidden_size
    c = ctx.c
    logits = linear(tr, ctx, x, "router", E, "router logits", "router")
    trains = ctx.linear_trains
    rg = x.rg or trains or logits.rg
    ET = E * T
    if logits.rg:
        tr.save(tr.new("top-k indices (int64, topk and scatter)", T * k, "int64", True, "T x k x 8 B", "router"))
        tr.save(tr.new("router sigmoid (fp32)", T * E, F32, True, "T x E fp32", "router"))
    if rg:
        tr.save(tr.new("tokens repeated to every expert", ET * h, x.dtype, True, "E*T x h", "experts"))
        tr.save(tr.new("router scores, one column per expert copy", ET, c, True, "E*T", "router"))
        if trains:
            tr.save(tr.new("expert input (repeat x score)", ET * h, c, True, "E*T x h", "experts"))
        tr.save(tr.new("expert gate_up output", ET * 2 * i, c, True, "E*T x 2i", "experts"))
        tr.save(tr.new("expert act(gate)", ET * i, c, True, "E*T x i", "experts"))
        if trains:
            tr.save(tr.new("expert up * act(gate)", ET * i, c, True, "E*T x i", "experts"))
    shared = gated_mlp(tr, ctx, x, arch.shared_expert_intermediate_size, prefix="shared expert ", group="experts")
    return tr.new("moe output", T * h, shared.dtype, True, "T x h", "experts")


