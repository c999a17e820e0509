"""OLMoE: Llama with q/k RMSNorm over all heads and routed experts as wide as
``intermediate_size`` (transformers ``models/olmoe/modular_olmoe.py``)."""

from .base import register
from .llama import Llama


@register
class Olmoe(Llama):
    model_types = ("olmoe",)
    gguf_arch = "olmoe"
    qk_norm = "full"
    moe = True
    expert_size_field = "intermediate_size"
