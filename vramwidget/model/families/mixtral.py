"""Mixtral: Mistral whose MLP is a routed mixture of experts (``num_local_experts``, top
``num_experts_per_tok``; each expert as wide as ``intermediate_size``).  transformers 5 fuses
the experts into ``mlp.experts.gate_up_proj`` (E x 2i x h) and ``down_proj`` (E x h x i),
with the router ``mlp.gate`` (``models/mixtral/modular_mixtral.py``)."""

from typing import Any, Mapping

from .base import register
from .blocks import Router
from .mistral import Mistral


@register
class Mixtral(Mistral):
    model_types = ("mixtral",)
    moe = True
    expert_size_field = "intermediate_size"

    def router(self, cfg: Mapping[str, Any]) -> Router:
        """``MixtralTopKRouter.forward`` (models/mixtral/modeling_mixtral.py): softmax of
        ``router_logits.float()``, top-k, always divided by their sum, left in fp32."""
        return Router(normalises=True, weights_fp32=True)
