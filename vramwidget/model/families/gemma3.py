"""Gemma 3 (text): Gemma 2 with per-head q/k RMSNorm and a 5:1 pattern of sliding-window to
global layers (``sliding_window_pattern``, default 6); transformers
``models/gemma3/modular_gemma3.py`` (``Gemma3TextModel``)."""

from typing import Any, Mapping

from .base import register
from .blocks import config_get
from .gemma2 import Gemma2


@register
class Gemma3Text(Gemma2):
    model_types = ("gemma3_text",)
    gguf_arch = "gemma3"
    qk_norm = "head"

    def default_sliding_layers(self, cfg: Mapping[str, Any], L: int) -> int:
        pattern = int(config_get(cfg, "sliding_window_pattern", default=6) or 6)
        return sum(1 for j in range(L) if (j + 1) % pattern)
