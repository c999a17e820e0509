"""Mixtral: Mistral whose MLP is a routed mixture of experts (``num_local_experts``, top
``num_experts_per_tok``; each expert as wide as ``intermediate_size``).  transformers 5 fuses
the experts into ``mlp.experts.gate_up_proj`` (E x 2i x h) and ``down_proj`` (E x h x i),
with the router ``mlp.gate`` (``models/mixtral/modular_mixtral.py``)."""

from .base import register
from .mistral import Mistral


@register
class Mixtral(Mistral):
    model_types = ("mixtral",)
    moe = True
    expert_size_field = "intermediate_size"
