"""SmolLM3: Llama's tensors (some layers skip RoPE, which changes no memory); transformers
``models/smollm3/modular_smollm3.py``."""

from .base import register
from .llama import Llama


@register
class SmolLM3(Llama):
    model_types = ("smollm3",)
    gguf_arch = "smollm3"
