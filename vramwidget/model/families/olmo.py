"""OLMo: Llama whose LayerNorms have no parameters (transformers
``models/olmo/modular_olmo.py``, ``OlmoLayerNorm``): no norm tensors, no final norm
weight; the final norm's output goes straight to the head."""

from typing import Any

from .base import register
from .blocks import ParamBuilder
from .llama import Llama


@register
class Olmo(Llama):
    model_types = ("olmo",)
    gguf_arch = "olmo"

    def norm_params(self, b: ParamBuilder, P: str, h: int) -> None:
        """No per-layer norm weights."""
        pass

    def final_norm_params(self, b: ParamBuilder, h: int) -> None:
        """No final norm weight."""
        pass

    def final_norm(self, tr: Any, ctx: Any, x: Any) -> Any:
        return x
