"""Qwen2: Llama with biases on q, k and v (not on o_proj) and an optional sliding window
(``use_sliding_window``; transformers ``models/qwen2/modular_qwen2.py``)."""

from typing import Any, Dict, Mapping

from .base import register
from .blocks import ParamBuilder, attention_params
from .llama import Llama


@register
class Qwen2(Llama):
    model_types = ("qwen2",)
    gguf_arch = "qwen2"
    sliding = True

    def attention_params(self, b: ParamBuilder, cfg: Mapping[str, Any], P: str, info: Dict[str, Any]) -> None:
        """Biases on q, k and v; none on o_proj."""
        attention_params(b, P, info["hidden_size"], info["num_heads"], info["num_kv_heads"], info["head_dim"],
                         qkv_bias=True, o_bias=False)
