"""T5 / mT5 / Flan-T5: encoder-decoder, counted as ``T5ForConditionalGeneration``
(``task="seq2seq_lm"``; transformers ``models/t5/modeling_t5.py``, ``models/mt5``).

Parameters: ``shared`` embeddings (the encoder's and decoder's ``embed_tokens`` tie to it);
per encoder block ``layer.0.SelfAttention.{q,k,v,o}`` (a x d_kv inner width, no biases) and
its ``layer_norm`` (RMS, no bias), ``layer.1.DenseReluDense`` (``wi`` or, for
``gated-gelu``, ``wi_0``/``wi_1``, then ``wo``) and ``layer_norm``; decoder blocks add
``EncDecAttention`` between them; block 0 of each stack holds
``relative_attention_bias`` (buckets x heads); both stacks end in ``final_layer_norm``;
``lm_head``, which transformers 5 always ties to ``shared`` (``T5Config`` forces
``tie_word_embeddings = True``; a config's ``false`` now only means "do not scale the
decoder output by d^-0.5", so Flan-T5-XL counts 2.78B, not the 2.85B of its checkpoint).
transformers keeps ``wo`` in fp32 (``_keep_in_fp32_modules``).

The step: the encoder runs over the source, the decoder over the target (both ``seq_len``
tokens here), the loss over the decoder's logits.  Each stack is a kind of block
(``layer_kinds``); dropout (``dropout_rate``, 0.1) follows attention, feed-forward and the
attention probabilities.  The relative position bias is added as a float SDPA mask: the
encoder's is shared by all its layers; each causal decoder layer builds its own (a x s x s,
counted per sequence here, an overestimate for batch > 1).
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Tuple

from .base import register
from .blocks import F32, _Builder, _get, _require, dropout, linear, sdpa_core
from .llama import Llama


@register
class T5(Llama):
    model_types = ("t5", "mt5")
    task = "seq2seq_lm"
    tasks = ("seq2seq_lm",)
    encoder_decoder = True
    gguf_arch = "t5"
    rotary = False
    default_lora_targets = ("q", "k", "v", "o", "wi", "wi_0", "wi_1", "wo")

    def params(self, cfg: Mapping[str, Any], mt: str) -> Dict[str, Any]:
        d = _require(cfg, "model width", "d_model", "hidden_size")
        Le = _require(cfg, "encoder layers", "num_layers")
        Ld = int(_get(cfg, "num_decoder_layers", default=Le) or Le)
        a = _require(cfg, "attention heads", "num_heads")
        dk = _require(cfg, "head dim", "d_kv")
        ff = _require(cfg, "feed-forward size", "d_ff")
        V = _require(cfg, "vocabulary size", "vocab_size")
        nb = int(_get(cfg, "relative_attention_num_buckets", default=32) or 32)
        gated = str(_get(cfg, "feed_forward_proj", default="relu")).startswith("gated")
        # transformers 5 always ties lm_head to ``shared`` (T5Config.__post_init__ forces
        # tie_word_embeddings = True; a config's false only turns off the d^-0.5 output scaling)
        tied = True
        inner = a * dk
        tensors = []
        top = _Builder(1)
        top.top("shared.weight", (V, d), "embedding", "shared")
        tensors += top.tensors
        for stack, L, layers in (("encoder", Le, ("SelfAttention",)),
                                 ("decoder", Ld, ("SelfAttention", "EncDecAttention"))):
            b = _Builder(L)
            P = f"{stack}.block.{{i}}."
            for j, att in enumerate(layers):
                for nm, o, inp, role in (("q", inner, d, "attn_q"), ("k", inner, d, "attn_k"),
                                         ("v", inner, d, "attn_v"), ("o", d, inner, "attn_o")):
                    b.linear(f"{P}layer.{j}.{att}.{nm}", o, inp, role)
                b.norm(f"{P}layer.{j}.layer_norm", d)
            f = len(layers)
            if gated:
                b.linear(f"{P}layer.{f}.DenseReluDense.wi_0", ff, d, "mlp_gate")
                b.linear(f"{P}layer.{f}.DenseReluDense.wi_1", ff, d, "mlp_up")
            else:
                b.linear(f"{P}layer.{f}.DenseReluDense.wi", ff, d, "mlp_up")
            b.linear(f"{P}layer.{f}.DenseReluDense.wo", d, ff, "mlp_down")
            b.tensors[-1] = _keep32(b.tensors[-1])
            b.norm(f"{P}layer.{f}.layer_norm", d)
            b.top(f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight", (nb, a), "attn_norm",
                  "relative_attention_bias")
            b.norm(f"{stack}.final_layer_norm", d, per_layer=False)
            # the stacks' layer indices follow each other (encoder 0..Le-1, decoder Le..)
            off = 0 if stack == "encoder" else Le
            tensors += [t if t.layers is None else _shift(t, off) for t in b.tensors]
        if not tied:
            h = _Builder(1)
            h.top("lm_head.weight", (V, d), "output_head", "lm_head")
            tensors += h.tensors
        return dict(hidden_size=d, num_layers=Le + Ld, num_heads=a, num_kv_heads=a, head_dim=dk, intermediate_size=ff,
                    vocab_size=V, tie_word_embeddings=tied, tensors=tensors, mlp_kind="gated" if gated else "plain",
                    norm_kind="rms", layer_kinds=[("encoder", Le), ("decoder", Ld)], kv_cache_layers=Ld)

    def t5_norm(self, tr: Any, ctx: Any, x: Any, name: str) -> Any:
        """T5LayerNorm: the variance from an fp32 copy, ``x * rsqrt`` (x as it is, fp32 result),
        cast to the weight's 16-bit dtype, ``weight * .``."""
        h = ctx.arch.hidden_size
        rows = x.numel / h
        if x.rg:
            if x.dtype != F32:
                tr.save(tr.new(f"{name} input as fp32", x.numel, F32, True, "T x h fp32", "norms"))
            tr.save(x)
            tr.save(tr.new(f"{name} rsqrt", rows, F32, True, "T x 1 fp32", "norms"))
        n = tr.new(f"{name} normalised", x.numel, ctx.c if ctx.c != F32 else F32, x.rg or ctx.norms_train,
                   "T x h", "norms")
        if ctx.norms_train:
            tr.save(n)
        return tr.new(f"{name} output", x.numel, n.dtype, True, "T x h", "norms")

    def t5_attention(self, tr: Any, ctx: Any, xq: Any, xkv: Any, label: str, causal_bias: bool) -> Any:
        """Self- or cross-attention (q from ``xq``, k and v from ``xkv``), dropout after ``o``."""
        arch = ctx.arch
        d, a, dk = arch.hidden_size, arch.num_heads, arch.head_dim
        q = linear(tr, ctx, xq, "q", a * dk, f"{label} q", "attention")
        k = linear(tr, ctx, xkv, "k", a * dk, f"{label} k", "attention")
        v = linear(tr, ctx, xkv, "v", a * dk, f"{label} v", "attention")
        if causal_bias and (q.rg or k.rg) and ctx.attn_backend != "eager":
            tr.save(tr.new(f"{label} causal position-bias mask", a * ctx.s * ctx.s, ctx.c, True, "a x s x s",
                           "attention"))
        p = float(arch.config.get("dropout_rate", 0.1) or 0.0)
        o_in = sdpa_core(tr, ctx, q, k, v, dk, dropout_p=p, softmax_fp32=False)
        o = linear(tr, ctx, o_in, "o", d, f"{label} o output", "attention", in_features=a * dk)
        return dropout(tr, o, p, f"{label} output", ctx.cpu)

    def block(self, tr: Any, ctx: Any, x: Any) -> Any:
        arch, T = ctx.arch, ctx.T
        d, ff = arch.hidden_size, arch.intermediate_size
        decoder = (ctx.kind or "encoder") == "decoder"
        n = self.t5_norm(tr, ctx, x, "self-attention layer_norm")
        o = self.t5_attention(tr, ctx, n, n, "self-attention", causal_bias=decoder)
        x = tr.new("residual after self-attention", x.numel, o.dtype, True, "T x h", "norms")
        if decoder:
            n = self.t5_norm(tr, ctx, x, "cross-attention layer_norm")
            enc = tr.new("encoder output (shared by every decoder layer)", T * d, x.dtype, True, "T x h", "attention")
            o = self.t5_attention(tr, ctx, n, enc, "cross-attention", causal_bias=False)
            x = tr.new("residual after cross-attention", x.numel, o.dtype, True, "T x h", "norms")
        n = self.t5_norm(tr, ctx, x, "feed-forward layer_norm")
        p = float(arch.config.get("dropout_rate", 0.1) or 0.0)
        if arch.mlp_kind == "gated":
            g = linear(tr, ctx, n, "wi_0", ff, "wi_0 output", "mlp")
            u = linear(tr, ctx, n, "wi_1", ff, "wi_1 output", "mlp")
            if g.rg:
                # gelu_new is a Python composite (0.5 x (1 + tanh(...))): it keeps its input, the tanh
                # output, 0.5 x and 1 + tanh; the product keeps GELU(wi_0) and wi_1
                tr.save(g)
                for nm in ("gelu tanh output", "gelu 0.5 * x", "gelu 1 + tanh", "GELU(wi_0)"):
                    tr.save(tr.new(nm, T * ff, g.dtype, True, "T x ff", "mlp"))
                tr.save(u)
            h = tr.new("GELU(wi_0) * wi_1", T * ff, g.dtype, g.rg or u.rg, "T x ff", "mlp")
        else:
            f = linear(tr, ctx, n, "wi", ff, "wi output", "mlp")
            h = tr.new("ReLU(wi)", T * ff, f.dtype, f.rg, "T x ff", "mlp")
            if f.rg:
                tr.save(h)
        h = dropout(tr, h, p, "feed-forward hidden", ctx.cpu)
        # wo stays fp32: the hidden state is cast up before it (DenseReluDense.forward)
        h32 = tr.cast(h, F32, "feed-forward hidden as fp32 (wo is fp32)") if ctx.c != F32 else h
        o = linear(tr, ctx, h32, "wo", d, "wo output", "mlp", in_features=ff)
        o = dropout(tr, o, p, "feed-forward output", ctx.cpu)
        return tr.new("block output", x.numel, x.dtype, True, "T x h", "norms")

    def final_norm(self, tr: Any, ctx: Any, x: Any) -> Any:
        return self.t5_norm(tr, ctx, x, "decoder final_layer_norm")

    def inference_mlp(self, arch: Any, T: int, c: float) -> List[Tuple[str, float, str]]:
        return [("wi output(s) + activation", 3 * T * arch.intermediate_size * c, "3 x T x ff")]


def _keep32(t: Any) -> Any:
    from dataclasses import replace

    return replace(t, keep_fp32=True)


def _shift(t: Any, off: int) -> Any:
    from dataclasses import replace

    return replace(t, layers=(t.layers[0] + off, t.layers[1] + off))
