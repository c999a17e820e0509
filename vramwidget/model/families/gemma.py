"""Gemma: Llama with tied embeddings by default and RMSNorm that multiplies by ``1 + w`` in
fp32 before casting back (transformers ``models/gemma/modular_gemma.py``, ``GemmaRMSNorm``)."""

from .base import register
from .llama import Llama


@register
class Gemma(Llama):
    model_types = ("gemma",)
    gguf_arch = "gemma"
    default_tie = True
    gemma_norm = True
    gemma_final_norm = True
