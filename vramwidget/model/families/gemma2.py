"""Gemma 2: Gemma with sandwich norms (``post_attention_layernorm`` on the attention output,
``pre_feedforward_layernorm``/``post_feedforward_layernorm`` around the MLP), soft-capped
attention scores and final logits, and sliding-window attention on every other layer
(transformers ``models/gemma2/modular_gemma2.py``)."""

from typing import Any, Mapping

from .base import register
from .gemma import Gemma


@register
class Gemma2(Gemma):
    model_types = ("gemma2",)
    gguf_arch = "gemma2"
    out_norms = True
    sliding = True
    softcapping = True

    def default_sliding_layers(self, cfg: Mapping[str, Any], L: int) -> int:
        return L // 2
