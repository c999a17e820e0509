"""Phi-3: Llama with one fused ``qkv_proj`` and one fused ``gate_up_proj`` (transformers
``models/phi3/modular_phi3.py``).  q and k are slices of the fused output; v stays a view
of it, so the attention keeps the whole qkv output; q built by the split is heads-major, so
flash attention's output is copied before ``o_proj``."""

from typing import Any, Dict, Mapping, Tuple

from .base import register
from .blocks import ParamBuilder, fused_qkv_params, linear
from .llama import Llama


@register
class Phi3(Llama):
    model_types = ("phi3",)
    gguf_arch = "phi3"
    sliding = True
    fused_gate_up = True
    q_heads_major = True
    default_lora_targets = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")

    def attention_params(self, b: ParamBuilder, cfg: Mapping[str, Any], P: str, info: Dict[str, Any]) -> None:
        """One fused qkv_proj and o_proj, no biases."""
        fused_qkv_params(b, P, info["hidden_size"], info["num_heads"], info["num_kv_heads"], info["head_dim"])

    def qkv(self, tr: Any, ctx: Any, n1: Any) -> Tuple[Any, Any, Any]:
        arch, T = ctx.arch, ctx.T
        a, kv, d = arch.num_heads, arch.num_kv_heads, arch.head_dim
        qkv = linear(tr, ctx, n1, "qkv_proj", (a + 2 * kv) * d, "qkv", "attention")
        q = tr.new("q", T * a * d, qkv.dtype, qkv.rg, "T x a*d", "attention")
        k = tr.new("k", T * kv * d, qkv.dtype, qkv.rg, "T x kv*d", "attention")
        v = tr.new("qkv_proj output", qkv.numel, qkv.dtype, qkv.rg, "T x (a+2kv)*d", "attention")
        return q, k, v
