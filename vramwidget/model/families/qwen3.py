"""Qwen3: Qwen2 without the q/k/v biases (``attention_bias``, default false) and with
RMSNorm over each head of q and k (``q_norm``, ``k_norm``, d wide) before RoPE
(transformers ``models/qwen3/modular_qwen3.py``)."""

from typing import Any, Dict, Mapping

from .base import register
from .blocks import ParamBuilder
from .llama import Llama
from .qwen2 import Qwen2


@register
class Qwen3(Qwen2):
    model_types = ("qwen3",)
    gguf_arch = "qwen3"
    qk_norm = "head"

    def attention_params(self, b: ParamBuilder, cfg: Mapping[str, Any], P: str, info: Dict[str, Any]) -> None:
        """Llama's projections: biases only with ``attention_bias``."""
        Llama.attention_params(self, b, cfg, P, info)
