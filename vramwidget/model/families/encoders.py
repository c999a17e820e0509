"""Encoders trained as masked language models (``task="masked_lm"``; BERT itself is
:mod:`.bert`).

ModernBERT: a pre-LayerNorm encoder with RoPE, GeGLU and alternating global/local
attention, counted as ``ModernBertForMaskedLM``.

Parameters (transformers ``models/modernbert/modeling_modernbert.py``):
``model.embeddings.tok_embeddings`` and ``embeddings.norm`` (LayerNorm, bias only with
``norm_bias``); per layer ``attn_norm`` (none in layer 0: ``nn.Identity``), ``attn.Wqkv``
(3h x h), ``attn.Wo``, ``mlp_norm``, ``mlp.Wi`` (2i x h: input and gate), ``mlp.Wo``
(biases only with ``attention_bias`` / ``mlp_bias``); ``model.final_norm``; the MLM head
``head.dense`` + activation + ``head.norm``; ``decoder`` tied to the token embedding, with its
own bias (``decoder_bias``).

Block (``ModernBertEncoderLayer``): LayerNorm (Identity in layer 0) -> Wqkv (q, k, v are views
of the one output, which SDPA keeps whole through v) -> RoPE on q and k -> attention core
(``layer_types``: every ``global_attn_every_n_layers``-th layer global, the others a
``local_attention`` window: a mask, so the saved tensors are the same) -> Wo -> residual ->
LayerNorm -> Wi -> ``act(input) * gate`` (both halves are views of Wi's output: GELU keeps
the whole storage) -> Wo -> residual.  transformers 5 no longer unpads inside the model
(flash attention unpads only a padded batch, in its own utilities), so the training trace
has the padded layout, which is exact for unpadded batches.

The loss is ``ForMaskedLMLoss`` (fp32 upcast of the logits) over every position
(``sparse_prediction`` false, the released default).  An encoder keeps no KV cache.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Tuple

from .base import Family, register
from .blocks import ParamBuilder, config_get, required_count, dropout, layer_norm, linear, residual, rotary, sdpa_core
from .gpt2 import GPT2
from ...errors import VramError


@register
class ModernBert(Family):
    model_types = ("modernbert",)
    task = "masked_lm"
    tasks = ("masked_lm",)
    mlp_kind = "gated"
    norm_kind = "layernorm"
    rotary = True
    gguf_arch = "modern-bert"
    default_lora_targets = ("Wqkv", "Wo", "Wi")

    # -- parameters ---------------------------------------------------------------------
    def params(self, cfg: Mapping[str, Any], mt: str) -> Dict[str, Any]:
        h = required_count(cfg, "hidden size", "hidden_size", default=768)
        L = required_count(cfg, "number of layers", "num_hidden_layers", default=22)
        a = required_count(cfg, "attention heads", "num_attention_heads", default=12)
        i = required_count(cfg, "MLP size", "intermediate_size", default=1152)
        V = required_count(cfg, "vocabulary size", "vocab_size", default=50368)
        if h % a:
            raise VramError(f"config: num_attention_heads ({a}) does not divide hidden_size ({h})",
                            field="num_attention_heads")
        nb = bool(config_get(cfg, "norm_bias", default=False))
        ab = bool(config_get(cfg, "attention_bias", default=False))
        mb = bool(config_get(cfg, "mlp_bias", default=False))
        b = ParamBuilder(L)
        b.top("model.embeddings.tok_embeddings.weight", (V, h), "embedding", "tok_embeddings")
        b.norm("model.embeddings.norm", h, bias=nb, per_layer=False, role="embedding_norm")
        P = "model.layers.{i}."
        b.norm(P + "attn_norm", h, bias=nb, first=1)
        b.linear(P + "attn.Wqkv", 3 * h, h, "attn_qkv", bias=ab)
        b.linear(P + "attn.Wo", h, h, "attn_o", bias=ab)
        b.norm(P + "mlp_norm", h, bias=nb)
        b.linear(P + "mlp.Wi", 2 * i, h, "mlp_gate_up", bias=mb)
        b.linear(P + "mlp.Wo", h, i, "mlp_down", bias=mb)
        b.norm("model.final_norm", h, bias=nb, per_layer=False)
        b.top("head.dense.weight", (h, h), "output_head", "dense")
        if config_get(cfg, "classifier_bias", default=False):
            b.top("head.dense.bias", (h,), "output_head", "dense")
        b.norm("head.norm", h, bias=nb, per_layer=False, role="output_head")
        if config_get(cfg, "decoder_bias", default=True):
            b.top("decoder.bias", (V,), "output_head", "decoder")
        tied = bool(config_get(cfg, "tie_word_embeddings", default=True))
        if not tied:
            b.top("decoder.weight", (V, h), "output_head", "decoder")
        info: Dict[str, Any] = dict(hidden_size=h, num_layers=L, num_heads=a, num_kv_heads=a, head_dim=h // a,
                                    intermediate_size=i, vocab_size=V, tie_word_embeddings=tied, tensors=b.tensors,
                                    mlp_kind=self.mlp_kind, norm_kind=self.norm_kind, kv_cache_layers=0,
                                    layer_kinds=[("first (no attn_norm)", 1)] + ([("layer", L - 1)] if L > 1 else []))
        # the local layers only mask a window (the saved tensors do not change) and an encoder
        # keeps no KV cache, so the Architecture's sliding fields (a KV-cache matter) stay unset
        return info

    def local_layers(self, arch: Any) -> Tuple[int, int]:
        """(local-attention layers, window in tokens) of a config (``layer_types`` or every
        ``global_attn_every_n_layers``-th layer global, as ModernBertConfig derives them)."""
        cfg, L = arch.config, arch.num_layers
        types = cfg.get("layer_types")
        if not isinstance(types, list) or len(types) != L:
            n = int(config_get(cfg, "global_attn_every_n_layers", default=3))
            types = ["sliding_attention" if j % n else "full_attention" for j in range(L)]
        return sum(1 for t in types if t == "sliding_attention"), int(config_get(cfg, "local_attention", default=128))

    def notes(self, arch: Any) -> List[str]:
        n, w = self.local_layers(arch)
        return [f"ModernBERT: ModernBertForMaskedLM scores every position (sparse_prediction off) and the loss "
                f"upcasts the logits to fp32; {n} of {arch.num_layers} layers attend within a {w}-token window "
                f"(a mask: the same saved tensors); an encoder keeps no KV cache"]

    # -- training trace -----------------------------------------------------------------
    def act_name(self, cfg: Mapping[str, Any]) -> str:
        """ModernBERT names its MLP activation ``hidden_activation`` (GELU by default)."""
        return str(cfg.get("hidden_activation") or "gelu")

    def composite_gelu(self, arch: Any) -> bool:
        """Whether the activation is a tanh-approximated GELU built from several ops (each saves)."""
        return self.act_name(arch.config) in ("gelu_new", "gelu_fast")

    def block(self, tr: Any, ctx: Any, x: Any) -> Any:
        arch, T = ctx.arch, ctx.T
        h, a, d, i = arch.hidden_size, arch.num_heads, arch.head_dim, arch.intermediate_size
        cfg = arch.config
        n1 = x if ctx.kind.startswith("first") else layer_norm(tr, ctx, x, "attn_norm", h)
        qkv = linear(tr, ctx, n1, "Wqkv", 3 * h, "Wqkv output", "attention")
        qr, kr = rotary(tr, ctx, qkv, qkv, T * a * d, T * a * d)
        v = qkv     # SDPA keeps v, a view that holds Wqkv's whole output
        if ctx.attn_backend == "eager":
            # eager's matmul(probs, v) reshapes the non-contiguous view: it keeps a T x h copy
            v = tr.new("v (matmul's contiguous copy)", T * h, qkv.dtype, qkv.rg, "T x h", "attention")
        o_in = sdpa_core(tr, ctx, qr, kr, v, d, dropout_p=float(config_get(cfg, "attention_dropout", default=0.0) or 0.0))
        o = linear(tr, ctx, o_in, "Wo", h, "attention Wo output", "attention", in_features=h)
        o = dropout(tr, o, float(config_get(cfg, "attention_dropout", default=0.0) or 0.0), "attention output", ctx.cpu)
        x1 = residual(tr, x, o, "residual after attention")
        n2 = layer_norm(tr, ctx, x1, "mlp_norm", h)
        wi = linear(tr, ctx, n2, "Wi", 2 * i, "Wi output (input and gate)", "mlp")
        act = GPT2.activation(self, tr, ctx, wi, i)     # GELU keeps its input: a view of Wi's output
        act.numel = T * i
        rg = act.rg or wi.rg
        if rg:
            tr.save(act)
            tr.save(wi)                                   # the gate, a view of the same storage
        prod = tr.new("act(input) * gate", T * i, act.dtype, rg, "T x i", "mlp")
        prod = dropout(tr, prod, float(config_get(cfg, "mlp_dropout", default=0.0) or 0.0), "mlp hidden", ctx.cpu)
        m = linear(tr, ctx, prod, "Wo", h, "mlp Wo output", "mlp", in_features=i)
        return residual(tr, x1, m, "block output")

    def final_norm(self, tr: Any, ctx: Any, x: Any) -> Any:
        """The embedding norm (when the embedding trains), the model's final_norm, then the MLM
        head: dense -> activation -> norm (its output feeds the tied decoder)."""
        arch = ctx.arch
        h = arch.hidden_size
        if ctx.linear_trains:
            e = tr.new("token embeddings", x.numel, ctx.c if ctx.setup.autocast else x.dtype, True, "T x h", "embedding")
            en = layer_norm(tr, ctx, e, "embeddings norm", h, group="embedding")
            dropout(tr, en, float(config_get(arch.config, "embedding_dropout", default=0.0) or 0.0), "embeddings", ctx.cpu)
        n = layer_norm(tr, ctx, x, "final_norm", h, group="output head")
        t = linear(tr, ctx, n, "head.dense", h, "MLM head dense output", "output head")
        name = str(arch.config.get("classifier_activation") or "gelu")
        if t.rg and name != "relu":
            tr.save(t)      # GELU keeps its input
        act = tr.new("MLM head activation output", t.numel, t.dtype, t.rg, "T x h", "output head")
        return layer_norm(tr, ctx, act, "head.norm", h, group="output head")

    # -- inference ----------------------------------------------------------------------
    def inference_mlp(self, arch: Any, T: int, c: float) -> List[Tuple[str, float, str]]:
        i = arch.intermediate_size
        return [("Wi output, act(input), product", 4 * T * i * c, "2 x T x i + 2 x T x i")]

