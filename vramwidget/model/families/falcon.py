"""Falcon: GPT-NeoX's rotary fused-qkv block with multi-query (or, in the new decoder
architecture, grouped) attention, a parallel block that feeds attention and MLP from one
LayerNorm (or two: ``ln_attn``/``ln_mlp``), optional biases and a softmax in the compute
dtype (transformers ``models/falcon/modeling_falcon.py``).  llama.cpp's quantization mixes
treat it as its own architecture."""

from typing import Any, Dict, Mapping

from .base import register
from .blocks import ParamBuilder, config_get, positive_count, required_count
from .gpt_neox import GPTNeoX
from ...errors import VramError


@register
class Falcon(GPTNeoX):
    model_types = ("falcon",)
    gguf_arch = "falcon"
    softmax_fp32 = False
    q_heads_major = False

    def params(self, cfg: Mapping[str, Any], mt: str) -> Dict[str, Any]:
        h = required_count(cfg, "hidden size", "hidden_size")
        L = required_count(cfg, "number of layers", "num_hidden_layers", "n_layer")
        a = required_count(cfg, "attention heads", "num_attention_heads", "n_head")
        V = required_count(cfg, "vocabulary size", "vocab_size")
        if h % a:
            raise VramError(f"config: num_attention_heads ({a}) does not divide hidden_size ({h})",
                            field="num_attention_heads")
        d = h // a
        new_arch = bool(config_get(cfg, "new_decoder_architecture", default=False))
        if new_arch:
            kv = positive_count(cfg, config_get(cfg, "num_kv_heads", default=a), "num_kv_heads")
        elif config_get(cfg, "multi_query", default=True):
            kv = 1
        else:
            kv = a
        bias = bool(config_get(cfg, "bias", default=False))
        i = positive_count(cfg, config_get(cfg, "ffn_hidden_size", default=4 * h), "ffn_hidden_size")
        b = ParamBuilder(L)
        P = "transformer.h.{i}."
        b.top("transformer.word_embeddings.weight", (V, h), "embedding", "word_embeddings")
        b.linear(P + "self_attention.query_key_value", (a + 2 * kv) * d, h, "attn_qkv", bias=bias)
        b.linear(P + "self_attention.dense", h, h, "attn_o", bias=bias)
        b.linear(P + "mlp.dense_h_to_4h", i, h, "mlp_up", bias=bias)
        b.linear(P + "mlp.dense_4h_to_h", h, i, "mlp_down", bias=bias)
        parallel = bool(config_get(cfg, "parallel_attn", default=True))
        n_ln = int(config_get(cfg, "num_ln_in_parallel_attn", default=2) or 2) if new_arch else 1
        if new_arch and n_ln == 2:
            b.norm(P + "ln_attn", h, bias=True)
            b.norm(P + "ln_mlp", h, bias=True)
        else:
            b.norm(P + "input_layernorm", h, bias=True)
            if not parallel:
                b.norm(P + "post_attention_layernorm", h, bias=True)
        b.norm("transformer.ln_f", h, bias=True, per_layer=False)
        tied = bool(config_get(cfg, "tie_word_embeddings", default=True))
        if not tied:
            b.top("lm_head.weight", (V, h), "output_head", "lm_head")
        return self.info(h, L, a, kv, d, i, V, tied, b)

    def parallel(self, cfg: Mapping[str, Any]) -> bool:
        return bool(cfg.get("parallel_attn", True))

    def mlp_norm_input(self, tr: Any, ctx: Any, x: Any, n1: Any) -> Any:
        return n1
