"""Encoders trained as masked language models (``task="masked_lm"``; BERT itself is
:mod:`.bert`).

* ModernBERT (``models/modernbert/modeling_modernbert.py``, ``ModernBertForMaskedLM``):
  pre-norm blocks (no attention norm in layer 0) with bias-free LayerNorms, a fused
  ``attn.Wqkv``, RoPE, local (128-token) attention on all but every
  ``global_attn_every_n_layers``-th layer, a GeGLU MLP (``mlp.Wi`` -> 2i, ``mlp.Wo``), a
  final norm, the head (``head.dense`` + GELU + ``head.norm``) and a decoder tied to the
  token embeddings with a bias.

Attention is bidirectional; the loss is a cross-entropy over every position's logits (the
masked positions carry labels), so the logits are b x s x V as for a causal LM.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Tuple

from .base import register
from .blocks import _Builder, _get, _require, layer_norm, linear, sdpa_core
from .gpt2 import GPT2


@register
class ModernBert(GPT2):
    model_types = ("modernbert",)
    task = "masked_lm"
    tasks = ("masked_lm",)
    gguf_arch = "modern-bert"
    rotary = True
    names = ("Wqkv", "Wo", "Wi", "Wo")
    default_lora_targets = ("Wqkv", "Wo", "Wi")
    softmax_fp32 = True
    embd_dropout = False
    q_heads_major = False

    def params(self, cfg: Mapping[str, Any], mt: str) -> Dict[str, Any]:
        h = _require(cfg, "hidden size", "hidden_size")
        L = _require(cfg, "number of layers", "num_hidden_layers")
        a = _require(cfg, "attention heads", "num_attention_heads")
        V = _require(cfg, "vocabulary size", "vocab_size")
        i = _require(cfg, "MLP size", "intermediate_size")
        nb = bool(_get(cfg, "norm_bias", default=False))
        ab = bool(_get(cfg, "attention_bias", default=False))
        mb = bool(_get(cfg, "mlp_bias", default=False))
        b = _Builder(L)
        b.top("model.embeddings.tok_embeddings.weight", (V, h), "embedding", "tok_embeddings")
        for part in ("weight", "bias") if nb else ("weight",):
            b.top(f"model.embeddings.norm.{part}", (h,), "embedding_norm", "norm")
        P = "model.layers.{i}."
        b.linear(P + "attn.Wqkv", 3 * h, h, "attn_qkv", bias=ab)
        b.linear(P + "attn.Wo", h, h, "attn_o", bias=ab)
        b.norm(P + "mlp_norm", h, bias=nb)
        b.linear(P + "mlp.Wi", 2 * i, h, "mlp_gate_up", bias=mb)
        b.linear(P + "mlp.Wo", h, i, "mlp_down", bias=mb)
        b.norm(P + "attn_norm", h, bias=nb, first=1)
        b.norm("model.final_norm", h, bias=nb, per_layer=False)
        b.top("head.dense.weight", (h, h), "output_head", "dense")
        if _get(cfg, "classifier_bias", default=False):
            b.top("head.dense.bias", (h,), "output_head", "dense")
        for part in ("weight", "bias") if nb else ("weight",):
            b.top(f"head.norm.{part}", (h,), "output_head", "norm")
        if _get(cfg, "decoder_bias", default=True):
            b.top("decoder.bias", (V,), "output_head", "decoder")
        tied = bool(_get(cfg, "tie_word_embeddings", default=True))
        if not tied:
            b.top("decoder.weight", (V, h), "output_head", "decoder")
        return self.info(h, L, a, a, h // a, i, V, tied, b)

    def resid_dropout(self, cfg: Mapping[str, Any]) -> float:
        return float(_get(cfg, "mlp_dropout", default=0.0) or 0.0)

    def qkv(self, tr: Any, ctx: Any, n1: Any) -> Tuple[Any, Any, Any]:
        arch, T = ctx.arch, ctx.T
        h = arch.hidden_size
        qkv = linear(tr, ctx, n1, "Wqkv", 3 * h, "Wqkv output", "attention")
        q = tr.new("q after rope", T * h, ctx.c, qkv.rg, "T x h", "attention")
        k = tr.new("k after rope", T * h, ctx.c, qkv.rg, "T x h", "attention")
        v = tr.new("v (contiguous)", T * h, ctx.c, qkv.rg, "T x h", "attention")
        return q, k, v

    def block(self, tr: Any, ctx: Any, x: Any) -> Any:
        """Pre-norm: x + Wo(attn(attn_norm(x))); x + Wo(act(input) * gate) with (input, gate) = Wi(mlp_norm(x))."""
        arch, T = ctx.arch, ctx.T
        h, d, i = arch.hidden_size, arch.head_dim, arch.intermediate_size
        n1 = layer_norm(tr, ctx, x, "attn_norm", h)
        q, k, v = self.qkv(tr, ctx, n1)
        o_in = sdpa_core(tr, ctx, q, k, v, d, dropout_p=self.attn_dropout(arch.config), softmax_fp32=True)
        o = linear(tr, ctx, o_in, "Wo", h, "attention Wo output", "attention", in_features=h)
        x1 = tr.new("residual after attention", x.numel, o.dtype, True, "T x h", "norms")
        n2 = layer_norm(tr, ctx, x1, "mlp_norm", h)
        wi = linear(tr, ctx, n2, "Wi", 2 * i, "Wi output (input, gate)", "mlp")
        rg = wi.rg
        if rg:
            tr.save(wi)
        act = tr.new("GELU(input)", T * i, wi.dtype, rg, "T x i", "mlp")
        if rg:
            tr.save(act)
        p = tr.new("GELU(input) * gate", T * i, wi.dtype, rg, "T x i", "mlp")
        linear(tr, ctx, p, "Wo", h, "mlp Wo output", "mlp", in_features=i)
        return tr.new("block output", x.numel, x.dtype, True, "T x h", "norms")

    def final_norm(self, tr: Any, ctx: Any, x: Any) -> Any:
        """final_norm -> head.dense -> GELU -> head.norm."""
        h = ctx.arch.hidden_size
        n = layer_norm(tr, ctx, x, "final_norm", h, group="output head")
        t = linear(tr, ctx, n, "head.dense", h, "head dense", "output head")
        if t.rg:
            tr.save(t)
        g = tr.new("head GELU", t.numel, t.dtype, t.rg, "T x h", "output head")
        return layer_norm(tr, ctx, g, "head.norm", h, group="output head")

    def inference_mlp(self, arch: Any, T: int, c: float) -> List[Tuple[str, float, str]]:
        return [("Wi output + GELU + product", 4 * T * arch.intermediate_size * c, "4 x T x i")]
