"""LFM2: a hybrid of gated short convolutions and grouped-query attention (Liquid AI;
transformers ``models/lfm2/modeling_lfm2.py``, ``Lfm2ForCausalLM``).

Each layer is ``operator_norm`` -> mixer -> residual -> ``ffn_norm`` -> SwiGLU (``w1``,
``w3``, ``w2``; the width ``intermediate_size`` is cut to 2/3, scaled by
``block_ffn_dim_multiplier`` and rounded up to ``block_multiple_of`` when
``block_auto_adjust_ff_dim``) -> residual.  The mixer is, per ``layer_types``:

* ``conv`` (Lfm2ShortConv): ``in_proj`` (h -> 3h) split into B, C, x; ``B * x``; a depthwise
  causal ``conv1d`` (kernel ``conv_L_cache``, no bias by default); ``C * conv``; ``out_proj``.
  It keeps the whole in_proj output (both products read views of it), the conv input and
  the conv output; its inference state is h x L_cache values per layer, not a KV cache.
* ``full_attention``: q/k/v/``out_proj`` with per-head RMSNorm on q and k (``q_layernorm``,
  ``k_layernorm``) before RoPE.

The final norm is ``model.embedding_norm``; the head is tied by default.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Tuple

from .base import register
from .blocks import ParamBuilder, config_get, promote_dtype, required_count, dims, gated_mlp, linear, residual, rms_norm, rotary, sdpa_core
from .llama import Llama


@register
class Lfm2(Llama):
    model_types = ("lfm2",)
    gguf_arch = "lfm2"
    default_tie = True

    def ff_dim(self, cfg: Mapping[str, Any]) -> int:
        """The SwiGLU width Lfm2MLP computes from the config."""
        i = required_count(cfg, "MLP size", "intermediate_size")
        if config_get(cfg, "block_auto_adjust_ff_dim", default=True):
            i = int(2 * i / 3)
            mult = config_get(cfg, "block_ffn_dim_multiplier", default=1.0)
            if mult is not None:
                i = int(mult * i)
            m = int(config_get(cfg, "block_multiple_of", default=256) or 256)
            i = m * ((i + m - 1) // m)
        return i

    def layer_types(self, cfg: Mapping[str, Any], L: int) -> List[str]:
        """``layer_types`` ("conv" / "full_attention"), or from ``full_attn_idxs``."""
        types = cfg.get("layer_types")
        if isinstance(types, list) and len(types) == L:
            return [str(t) for t in types]
        idx = cfg.get("full_attn_idxs")
        idx = set(idx) if isinstance(idx, list) else set(range(L))
        return ["full_attention" if j in idx else "conv" for j in range(L)]

    def params(self, cfg: Mapping[str, Any], mt: str) -> Dict[str, Any]:
        D = dims(cfg)
        h, L, a, kv, V, d = D["h"], D["L"], D["a"], D["kv"], D["V"], D["d"]
        i = self.ff_dim(cfg)
        K = int(config_get(cfg, "conv_L_cache", default=3) or 3)
        conv_bias = bool(config_get(cfg, "conv_bias", default=False))
        tied = bool(config_get(cfg, "tie_word_embeddings", default=True))
        types = self.layer_types(cfg, L)
        attn = [j for j, t in enumerate(types) if t == "full_attention"]
        conv = [j for j, t in enumerate(types) if t != "full_attention"]
        b = ParamBuilder(L)
        P = "model.layers.{i}."
        b.top("model.embed_tokens.weight", (V, h), "embedding", "embed_tokens")

        def conv_params(sub: ParamBuilder) -> None:
            sub.layer(P + "conv.conv.weight", (h, 1, K), "mixer")
            if conv_bias:
                sub.layer(P + "conv.conv.bias", (h,), "mixer")
            sub.linear(P + "conv.in_proj", 3 * h, h, "mixer_proj", bias=conv_bias)
            sub.linear(P + "conv.out_proj", h, h, "mixer_proj", bias=conv_bias)

        def attn_params(sub: ParamBuilder) -> None:
            for nm, o, inp, role in (("q_proj", a * d, h, "attn_q"), ("k_proj", kv * d, h, "attn_k"),
                                     ("v_proj", kv * d, h, "attn_v"), ("out_proj", h, a * d, "attn_o")):
                sub.linear(P + "self_attn." + nm, o, inp, role)
            sub.norm(P + "self_attn.q_layernorm", d, role="attn_norm")
            sub.norm(P + "self_attn.k_layernorm", d, role="attn_norm")

        b.in_layers(conv, conv_params)
        b.in_layers(attn, attn_params)
        b.linear(P + "feed_forward.w1", i, h, "mlp_gate")
        b.linear(P + "feed_forward.w3", i, h, "mlp_up")
        b.linear(P + "feed_forward.w2", h, i, "mlp_down")
        b.norm(P + "operator_norm", h)
        b.norm(P + "ffn_norm", h)
        b.norm("model.embedding_norm", h, per_layer=False)
        if not tied:
            b.top("lm_head.weight", (V, h), "output_head", "lm_head")
        kinds: List[Tuple[str, int]] = []
        for t in types:
            t = "full_attention" if t == "full_attention" else "conv"
            if t not in [k for k, _ in kinds]:
                kinds.append((t, 0))
        kinds = [(k, sum(1 for t in types if (t == "full_attention") == (k == "full_attention"))) for k, _ in kinds]
        return dict(hidden_size=h, num_layers=L, num_heads=a, num_kv_heads=kv, head_dim=d, vocab_size=V,
                    tie_word_embeddings=tied, intermediate_size=i, tensors=b.tensors, mlp_kind="gated",
                    norm_kind="rms", layer_kinds=kinds, kv_cache_layers=len(attn),
                    layer_order=["full_attention" if t == "full_attention" else "conv" for t in types], state_elems_per_seq=len(conv) * h * K)

    def block(self, tr: Any, ctx: Any, x: Any) -> Any:
        arch, T = ctx.arch, ctx.T
        h, a, kv, d = arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim
        n1 = rms_norm(tr, ctx, x, "operator_norm", h)
        if (ctx.kind or arch.layer_kinds[0][0]) == "full_attention":
            q = linear(tr, ctx, n1, "q_proj", a * d, "q_proj output", "attention")
            k = linear(tr, ctx, n1, "k_proj", kv * d, "k_proj output", "attention")
            v = linear(tr, ctx, n1, "v_proj", kv * d, "v", "attention")
            q = rms_norm(tr, ctx, q, "q_layernorm", d, "attention")
            k = rms_norm(tr, ctx, k, "k_layernorm", d, "attention")
            qr, kr = rotary(tr, ctx, q, k, T * a * d, T * kv * d)
            o_in = sdpa_core(tr, ctx, qr, kr, v, d)
            o = linear(tr, ctx, o_in, "out_proj", h, "out_proj output", "attention", in_features=a * d)
        else:
            o = short_conv(tr, ctx, n1)
        x1 = residual(tr, x, o, "residual after the mixer")
        n2 = rms_norm(tr, ctx, x1, "ffn_norm", h)
        m = gated_mlp(tr, ctx, n2, arch.intermediate_size, names=("w1", "w3", "w2"))
        return tr.new("block output", x.numel, promote_dtype(x1.dtype, m.dtype), True, "T x h", "norms")

    def final_norm(self, tr: Any, ctx: Any, x: Any) -> Any:
        return rms_norm(tr, ctx, x, "final norm (embedding_norm)", ctx.arch.hidden_size, group="output head")


def short_conv(tr: Any, ctx: Any, x: Any) -> Any:
    """Lfm2ShortConv without a cache: in_proj -> B * x -> depthwise causal conv1d -> C * conv
    -> out_proj.  Keeps the in_proj output (B, C, x are views of it), the conv input B * x
    and the conv output."""
    arch, T = ctx.arch, ctx.T
    h = arch.hidden_size
    bcx = linear(tr, ctx, x, "in_proj", 3 * h, "in_proj output (B, C, x)", "mixer")
    rg = bcx.rg or ctx.linear_trains
    c = bcx.dtype
    if bcx.rg:
        tr.save(bcx)
    bx = tr.new("B * x (conv input)", T * h, c, rg, "T x h", "mixer")
    if rg:
        tr.save(bx)
        tr.save(tr.new("conv1d output", T * h, c, True, "T x h", "mixer"))
    y = tr.new("C * conv (transposed copy)", T * h, c, rg, "T x h", "mixer")
    return linear(tr, ctx, y, "out_proj", h, "out_proj output", "mixer", in_features=h)
