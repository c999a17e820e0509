"""Mistral: Llama with sliding-window attention (``sliding_window``; transformers
``models/mistral/modular_mistral.py`` builds it from Llama's modules)."""

from .base import register
from .llama import Llama


@register
class Mistral(Llama):
    model_types = ("mistral",)
    sliding = True
