"""GPT-NeoX (Pythia): GPT-2's block with a fused ``query_key_value`` (nn.Linear), partial
rotary embeddings, a parallel residual (``use_parallel_residual``: attention and MLP both
read the block input, each through its own LayerNorm) and an untied ``embed_out`` head
(transformers ``models/gpt_neox/modular_gpt_neox.py``)."""

from typing import Any, Dict, Mapping, Tuple

from .base import register
from .blocks import ParamBuilder, config_get, required_count, linear
from .gpt2 import GPT2
from ...errors import VramError


@register
class GPTNeoX(GPT2):
    model_types = ("gpt_neox",)
    gguf_arch = "gptneox"
    rotary = True
    names = ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h")
    default_lora_targets = names
    softmax_fp32 = True
    q_heads_major = True
    embd_dropout = False

    def params(self, cfg: Mapping[str, Any], mt: str) -> Dict[str, Any]:
        h = required_count(cfg, "hidden size", "hidden_size")
        L = required_count(cfg, "number of layers", "num_hidden_layers")
        a = required_count(cfg, "attention heads", "num_attention_heads")
        V = required_count(cfg, "vocabulary size", "vocab_size")
        i = required_count(cfg, "MLP size", "intermediate_size", default=4 * h)
        if h % a:
            raise VramError(f"config: num_attention_heads ({a}) does not divide hidden_size ({h})",
                            field="num_attention_heads")
        bias = bool(config_get(cfg, "attention_bias", default=True))
        b = ParamBuilder(L)
        P = "gpt_neox.layers.{i}."
        b.top("gpt_neox.embed_in.weight", (V, h), "embedding", "embed_in")
        b.norm(P + "input_layernorm", h, bias=True)
        b.norm(P + "post_attention_layernorm", h, bias=True)
        b.linear(P + "attention.query_key_value", 3 * h, h, "attn_qkv", bias=bias)
        b.linear(P + "attention.dense", h, h, "attn_o", bias=bias)
        b.linear(P + "mlp.dense_h_to_4h", i, h, "mlp_up", bias=True)
        b.linear(P + "mlp.dense_4h_to_h", h, i, "mlp_down", bias=True)
        b.norm("gpt_neox.final_layer_norm", h, bias=True, per_layer=False)
        tied = bool(config_get(cfg, "tie_word_embeddings", default=False))
        if not tied:
            b.top("lm_head.weight", (V, h), "output_head", "lm_head")
        return self.info(h, L, a, a, h // a, i, V, tied, b)

    def composite_gelu(self, arch: Any) -> bool:
        return False

    def parallel(self, cfg: Mapping[str, Any]) -> bool:
        return bool(cfg.get("use_parallel_residual", True))

    def qkv(self, tr: Any, ctx: Any, n1: Any) -> Tuple[Any, Any, Any]:
        """Rotary embeddings make new q and k; the eager matmul copies the strided v view
        (then the fused qkv output is not kept)."""
        arch, T = ctx.arch, ctx.T
        a, kv, d = arch.num_heads, arch.num_kv_heads, arch.head_dim
        qkv = linear(tr, ctx, n1, self.names[0], (a + 2 * kv) * d, "qkv", "attention")
        q = tr.new("q after rope", T * a * d, ctx.c, qkv.rg, "T x a*d", "attention")
        k = tr.new("k after rope", T * kv * d, ctx.c, qkv.rg, "T x kv*d", "attention")
        v = qkv
        if ctx.attn_backend == "eager":
            v = tr.new("v (contiguous copy)", T * kv * d, ctx.c, qkv.rg, "T x kv*d", "attention")
        return q, k, v
