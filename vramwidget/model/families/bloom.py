"""BLOOM: GPT-2's block with ALiBi position biases (no SDPA path in transformers: eager,
flash_attention_2 or a recomputed core), a LayerNorm after the word embeddings, a fused
``query_key_value`` (nn.Linear) and its own GeLU autograd Function that keeps only its
input (transformers ``models/bloom/modeling_bloom.py``)."""

from typing import Any, Dict, Mapping

from .base import register
from .blocks import ParamBuilder, config_get, required_count
from .gpt2 import GPT2
from ...errors import VramError


@register
class Bloom(GPT2):
    model_types = ("bloom",)
    gguf_arch = "bloom"
    sdpa_supported = False
    names = ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h")
    default_lora_targets = None
    softmax_fp32 = True
    embd_dropout = False

    def params(self, cfg: Mapping[str, Any], mt: str) -> Dict[str, Any]:
        h = required_count(cfg, "hidden size", "hidden_size", "n_embed")
        L = required_count(cfg, "number of layers", "n_layer", "num_hidden_layers")
        a = required_count(cfg, "attention heads", "n_head", "num_attention_heads")
        V = required_count(cfg, "vocabulary size", "vocab_size")
        if h % a:
            raise VramError(f"config: n_head ({a}) does not divide hidden_size ({h})", field="n_head")
        b = ParamBuilder(L)
        P = "transformer.h.{i}."
        b.top("transformer.word_embeddings.weight", (V, h), "embedding", "word_embeddings")
        b.top("transformer.word_embeddings_layernorm.weight", (h,), "embedding_norm", "word_embeddings_layernorm")
        b.top("transformer.word_embeddings_layernorm.bias", (h,), "embedding_norm", "word_embeddings_layernorm")
        b.norm(P + "input_layernorm", h, bias=True)
        b.linear(P + "self_attention.query_key_value", 3 * h, h, "attn_qkv", bias=True)
        b.linear(P + "self_attention.dense", h, h, "attn_o", bias=True)
        b.norm(P + "post_attention_layernorm", h, bias=True)
        b.linear(P + "mlp.dense_h_to_4h", 4 * h, h, "mlp_up", bias=True)
        b.linear(P + "mlp.dense_4h_to_h", h, 4 * h, "mlp_down", bias=True)
        b.norm("transformer.ln_f", h, bias=True, per_layer=False)
        tied = bool(config_get(cfg, "tie_word_embeddings", default=True))
        if not tied:
            b.top("lm_head.weight", (V, h), "output_head", "lm_head")
        return self.info(h, L, a, a, h // a, 4 * h, V, tied, b)

    def composite_gelu(self, arch: Any) -> bool:
        return True

    def activation(self, tr: Any, ctx: Any, f: Any, i: int) -> Any:
        # BLOOM trains with its own autograd Function (GeLUFunction): it keeps only the input
        if not f.rg:
            return tr.new("activation output", f.numel, f.dtype, False, "T x i", "mlp")
        tr.save(f)
        return tr.new("activation output", f.numel, f.dtype, True, "T x i", "mlp")
