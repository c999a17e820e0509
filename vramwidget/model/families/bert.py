"""BERT: the post-LayerNorm encoder, counted as ``BertForMaskedLM``.

Parameters (transformers ``models/bert/modeling_bert.py``): ``bert.embeddings`` (word,
learned absolute position and token-type embeddings, a LayerNorm with bias); per layer
``attention.self.{query,key,value}``, ``attention.output.dense`` and its ``LayerNorm``,
``intermediate.dense``, ``output.dense`` and its ``LayerNorm`` (every Linear and LayerNorm
with a bias); no pooler (``BertForMaskedLM`` builds ``BertModel(add_pooling_layer=False)``);
the MLM head ``cls.predictions``: ``transform.dense`` + activation + ``transform.LayerNorm``,
the ``decoder`` tied to the word embeddings and its own ``bias`` (V).

Block (``BertLayer``): q, k, v -> attention core (scaled, softmax in the compute dtype,
dropout ``attention_probs_dropout_prob``) -> ``attention.output.dense`` -> dropout ->
LayerNorm(x + .) -> ``intermediate.dense`` -> GELU -> ``output.dense`` -> dropout ->
LayerNorm(. + residual): the norms come after the residual sums (post-LN).

The logits cover every position (``BertForMaskedLM`` scores all T tokens and the loss
ignores the unmasked ones by label -100), and ``CrossEntropyLoss`` runs on them as they are
(no fp32 upcast).  An encoder keeps no KV cache.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Tuple

from .base import Family, register
from .blocks import ParamBuilder, config_get, required_count, dropout, layer_norm, linear, sdpa_core
from .gpt2 import GPT2
from ...errors import VramError


@register
class Bert(Family):
    model_types = ("bert",)
    task = "masked_lm"
    tasks = ("masked_lm",)
    mlp_kind = "plain"
    norm_kind = "layernorm"
    rotary = False
    gguf_arch = "bert"
    default_lora_targets = ("query", "value")   # peft's mapping for "bert"
    loss_upcast = False

    # -- parameters ---------------------------------------------------------------------
    def params(self, cfg: Mapping[str, Any], mt: str) -> Dict[str, Any]:
        h = required_count(cfg, "hidden size", "hidden_size", default=768)
        L = required_count(cfg, "number of layers", "num_hidden_layers", default=12)
        a = required_count(cfg, "attention heads", "num_attention_heads", default=12)
        i = required_count(cfg, "MLP size", "intermediate_size", default=3072)
        V = required_count(cfg, "vocabulary size", "vocab_size", default=30522)
        npos = required_count(cfg, "positions", "max_position_embeddings", default=512)
        types = required_count(cfg, "token types", "type_vocab_size", default=2)
        if h % a:
            raise VramError(f"config: num_attention_heads ({a}) does not divide hidden_size ({h})",
                            field="num_attention_heads")
        b = ParamBuilder(L)
        E = "bert.embeddings."
        b.top(E + "word_embeddings.weight", (V, h), "embedding", "word_embeddings")
        b.top(E + "position_embeddings.weight", (npos, h), "position_embedding", "position_embeddings")
        b.top(E + "token_type_embeddings.weight", (types, h), "position_embedding", "token_type_embeddings")
        b.norm(E + "LayerNorm", h, bias=True, per_layer=False, role="embedding_norm")
        P = "bert.encoder.layer.{i}."
        b.linear(P + "attention.self.query", h, h, "attn_q", bias=True)
        b.linear(P + "attention.self.key", h, h, "attn_k", bias=True)
        b.linear(P + "attention.self.value", h, h, "attn_v", bias=True)
        b.linear(P + "attention.output.dense", h, h, "attn_o", bias=True)
        b.norm(P + "attention.output.LayerNorm", h, bias=True)
        b.linear(P + "intermediate.dense", i, h, "mlp_up", bias=True)
        b.linear(P + "output.dense", h, i, "mlp_down", bias=True)
        b.norm(P + "output.LayerNorm", h, bias=True)
        # the MLM head (its decoder weight is the word embedding; decoder.bias is cls.predictions.bias)
        C = "cls.predictions."
        b.top(C + "bias", (V,), "output_head", "predictions")
        b.top(C + "transform.dense.weight", (h, h), "output_head", "dense")
        b.top(C + "transform.dense.bias", (h,), "output_head", "dense")
        b.norm(C + "transform.LayerNorm", h, bias=True, per_layer=False, role="output_head")
        return dict(hidden_size=h, num_layers=L, num_heads=a, num_kv_heads=a, head_dim=h // a, intermediate_size=i,
                    vocab_size=V, tie_word_embeddings=True, tensors=b.tensors, mlp_kind=self.mlp_kind,
                    norm_kind=self.norm_kind, kv_cache_layers=0)

    def notes(self, arch: Any) -> List[str]:
        return ["BERT: BertForMaskedLM scores every position (logits b x seq_len x V) and the loss runs on "
                "16-bit logits; an encoder keeps no KV cache"]

    # -- training trace -----------------------------------------------------------------
    def hidden_dropout(self, cfg: Mapping[str, Any]) -> float:
        """``hidden_dropout_prob`` (0.1 by default)."""
        return float(config_get(cfg, "hidden_dropout_prob", default=0.1) or 0.0)

    def act_name(self, cfg: Mapping[str, Any]) -> str:
        """The MLP's activation function name (``hidden_act``)."""
        return str(cfg.get("hidden_act") or "gelu")

    def composite_gelu(self, arch: Any) -> bool:
        """The activation is a Python composite GELU."""
        return self.act_name(arch.config) in ("gelu_new", "gelu_fast")

    def block(self, tr: Any, ctx: Any, x: Any) -> Any:
        arch = ctx.arch
        h, a, d, i = arch.hidden_size, arch.num_heads, arch.head_dim, arch.intermediate_size
        cfg = arch.config
        p = self.hidden_dropout(cfg)
        q = linear(tr, ctx, x, "query", h, "query output", "attention")
        k = linear(tr, ctx, x, "key", h, "key output", "attention")
        v = linear(tr, ctx, x, "value", h, "value output", "attention")
        o_in = sdpa_core(tr, ctx, q, k, v, d, dropout_p=float(config_get(cfg, "attention_probs_dropout_prob",
                                                                    default=0.1) or 0.0),
                         softmax_fp32=False)
        o = linear(tr, ctx, o_in, "dense", h, "attention output dense", "attention", in_features=a * d)
        o = dropout(tr, o, p, "attention output", ctx.cpu)
        s1 = tr.new("attention residual sum", x.numel, o.dtype, True, "T x h", "norms")
        # post-LN: the normalised sum is the residual stream the MLP's sum adds to
        a1 = tr.residual_stream(layer_norm(tr, ctx, s1, "attention.output.LayerNorm", h))
        f = linear(tr, ctx, a1, "dense", i, "intermediate output", "mlp")
        act = GPT2.activation(self, tr, ctx, f, i)
        m = linear(tr, ctx, act, "dense", h, "output dense", "mlp", in_features=i)
        m = dropout(tr, m, p, "mlp output", ctx.cpu)
        s2 = tr.new("mlp residual sum", x.numel, m.dtype, True, "T x h", "norms")
        return layer_norm(tr, ctx, s2, "output.LayerNorm", h)

    def final_norm(self, tr: Any, ctx: Any, x: Any) -> Any:
        """The embeddings' sum -> LayerNorm -> dropout (when the embeddings train), then the MLM
        head's transform: dense -> activation -> LayerNorm (its output feeds the decoder)."""
        arch = ctx.arch
        h = arch.hidden_size
        if ctx.linear_trains:
            e = tr.new("embeddings sum", x.numel, ctx.c if ctx.setup.autocast else x.dtype, True, "T x h", "embedding")
            en = layer_norm(tr, ctx, e, "embeddings LayerNorm", h, group="embedding")
            dropout(tr, en, self.hidden_dropout(arch.config), "embeddings", ctx.cpu)
        t = linear(tr, ctx, x, "transform.dense", h, "MLM transform dense output", "output head")
        act = GPT2.activation(self, tr, ctx, t, h)
        act.group = "output head"
        return layer_norm(tr, ctx, act, "MLM transform LayerNorm", h, group="output head")

    # -- inference ----------------------------------------------------------------------
    def inference_mlp(self, arch: Any, T: int, c: float) -> List[Tuple[str, float, str]]:
        i = arch.intermediate_size
        return [("intermediate output + activation", 2 * T * i * c, "2 x T x i")]
