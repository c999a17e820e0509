"""Qwen3-MoE: Qwen3's attention with routed experts (``moe_intermediate_size``), no shared
expert (transformers ``models/qwen3_moe/modular_qwen3_moe.py``)."""

from typing import Any, Mapping

from .base import register
from .qwen2_moe import Qwen2Moe
from .qwen3 import Qwen3


@register
class Qwen3Moe(Qwen3):
    model_types = ("qwen3_moe",)
    gguf_arch = "qwen3moe"
    moe = True

    def check_moe(self, cfg: Mapping[str, Any], E: int) -> int:
        return Qwen2Moe.check_moe(self, cfg, E)
