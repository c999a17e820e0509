"""Qwen2-MoE (Qwen1.5-MoE): Qwen2 with routed experts (``moe_intermediate_size``) plus one
shared expert (``shared_expert_intermediate_size``) scaled by a sigmoid gate
(``mlp.shared_expert_gate``, 1 x h); transformers ``models/qwen2_moe/modular_qwen2_moe.py``."""

from typing import Any, Mapping, Tuple

from .base import register
from .blocks import config_get, required_count
from .qwen2 import Qwen2
from ...errors import VramError


@register
class Qwen2Moe(Qwen2):
    model_types = ("qwen2_moe",)
    gguf_arch = "qwen2moe"
    moe = True
    shared_expert_gate = True

    def check_moe(self, cfg: Mapping[str, Any], E: int) -> int:
        step = int(config_get(cfg, "decoder_sparse_step", default=1) or 1)
        if config_get(cfg, "mlp_only_layers") or step != 1:
            raise VramError("config: qwen MoE with mlp_only_layers or decoder_sparse_step != 1 is not supported",
                            field="mlp_only_layers")
        return 0

    def shared_expert(self, cfg: Mapping[str, Any], i_e: int) -> Tuple[int, str, str]:
        shared = required_count(cfg, "shared expert size", "shared_expert_intermediate_size")
        return shared, "model.layers.{i}.mlp.shared_expert.", "shared_expert_gate"
