"""OPT: GPT-2's block with separate ``q_proj``/``k_proj``/``v_proj``/``out_proj`` and
``fc1``/``fc2`` (nn.Linear), learned positions offset by 2, an optional
``word_embed_proj_dim`` projection, ReLU, and dropout 0.1 unless the config says otherwise
(transformers ``models/opt/modeling_opt.py``)."""

from typing import Any, Dict, Mapping, Tuple

from .base import register
from .blocks import ParamBuilder, config_get, positive_count, required_count, linear
from .gpt2 import GPT2
from ...errors import VramError


@register
class OPT(GPT2):
    model_types = ("opt",)
    gguf_arch = "opt"
    names = ("q_proj", "out_proj", "fc1", "fc2")
    default_lora_targets = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")
    softmax_fp32 = True
    embd_dropout = False

    def params(self, cfg: Mapping[str, Any], mt: str) -> Dict[str, Any]:
        h = required_count(cfg, "hidden size", "hidden_size")
        L = required_count(cfg, "number of layers", "num_hidden_layers")
        a = required_count(cfg, "attention heads", "num_attention_heads")
        V = required_count(cfg, "vocabulary size", "vocab_size")
        i = required_count(cfg, "MLP size", "ffn_dim", "intermediate_size", default=4 * h)
        npos = required_count(cfg, "positions", "max_position_embeddings", default=2048)
        we = positive_count(cfg, config_get(cfg, "word_embed_proj_dim", default=h), "word_embed_proj_dim")
        if h % a:
            raise VramError(f"config: num_attention_heads ({a}) does not divide hidden_size ({h})",
                            field="num_attention_heads")
        bias = bool(config_get(cfg, "enable_bias", default=True))
        ln_aff = bool(config_get(cfg, "layer_norm_elementwise_affine", default=True))
        b = ParamBuilder(L)
        P = "model.decoder.layers.{i}."
        b.top("model.decoder.embed_tokens.weight", (V, we), "embedding", "embed_tokens")
        b.top("model.decoder.embed_positions.weight", (npos + 2, h), "position_embedding", "embed_positions")
        if we != h:
            b.top("model.decoder.project_out.weight", (we, h), "output_head", "project_out")
            b.top("model.decoder.project_in.weight", (h, we), "embedding", "project_in")
        for nm, role in (("k_proj", "attn_k"), ("v_proj", "attn_v"), ("q_proj", "attn_q")):
            b.linear(P + "self_attn." + nm, h, h, role, bias=bias)
        b.linear(P + "self_attn.out_proj", h, h, "attn_o", bias=bias)
        if ln_aff:
            b.norm(P + "self_attn_layer_norm", h, bias=bias)
        b.linear(P + "fc1", i, h, "mlp_up", bias=bias)
        b.linear(P + "fc2", h, i, "mlp_down", bias=bias)
        if ln_aff:
            b.norm(P + "final_layer_norm", h, bias=bias)
        if config_get(cfg, "do_layer_norm_before", default=True) and not config_get(cfg, "_remove_final_layer_norm",
                                                                          default=False):
            if ln_aff:
                b.norm("model.decoder.final_layer_norm", h, bias=bias, per_layer=False)
        tied = bool(config_get(cfg, "tie_word_embeddings", default=True))
        if not tied:
            b.top("lm_head.weight", (V, we), "output_head", "lm_head")
        return self.info(h, L, a, a, h // a, i, V, tied, b)

    def composite_gelu(self, arch: Any) -> bool:
        return False

    def resid_dropout(self, cfg: Mapping[str, Any]) -> float:
        """OPT's ``dropout`` (0.1 when the config has none)."""
        return float(cfg.get("dropout", 0.1) if "dropout" in cfg else 0.1)

    def qkv(self, tr: Any, ctx: Any, n1: Any) -> Tuple[Any, Any, Any]:
        h = ctx.arch.hidden_size
        q = linear(tr, ctx, n1, "q_proj", h, "q", "attention")
        k = linear(tr, ctx, n1, "k_proj", h, "k", "attention")
        v = linear(tr, ctx, n1, "v_proj", h, "v", "attention")
        if q.rg:
            q = tr.new("q scaled", q.numel, q.dtype, True, "T x h", "attention")
        return q, k, v
