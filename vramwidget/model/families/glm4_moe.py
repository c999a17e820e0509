"""GLM-4.5 (glm4_moe): Llama attention with biased q/k/v (not o), partial RoPE
(``partial_rotary_factor``, by slice + cat) and optional per-head q/k RMSNorm
(``use_qk_norm``), and DeepSeek-V3's MoE: ``first_k_dense_replace`` dense layers, then a
sigmoid router with a score-correction bias and group-limited top-k, routed experts
(``moe_intermediate_size``) and ``n_shared_experts`` shared ones (transformers
``models/glm4_moe/modular_glm4_moe.py``, ``Glm4MoeForCausalLM``).

The router runs in fp32 (``F.linear(x.float(), W.float())``): it keeps the fp32 copy of its
input (when the router trains), the sigmoid scores, the gathered top-k weights and their sum; the experts then
weight their outputs by fp32 routing weights.  The checkpoints' multi-token-prediction
layer (``num_nextn_predict_layers``) is not built by transformers and not counted.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Tuple

from .base import register
from .blocks import F32, ParamBuilder, config_get, attention_params, gated_mlp
from .deepseek import DeepseekV2
from .llama import Llama


@register
class Glm4Moe(Llama):
    model_types = ("glm4_moe",)
    gguf_arch = "glm4moe"
    moe = True
    q_heads_major = True      # partial RoPE: q = cat(rotated, pass)

    def qk_norm_of(self, cfg: Mapping[str, Any]) -> Optional[str]:
        """Per-head q/k RMSNorm when ``use_qk_norm`` (GLM-4.5 yes, GLM-4.5-Air no)."""
        return "head" if config_get(cfg, "use_qk_norm", default=False) else None

    def attention_params(self, b: ParamBuilder, cfg: Mapping[str, Any], P: str, info: Dict[str, Any]) -> None:
        attention_params(b, P, info["hidden_size"], info["num_heads"], info["num_kv_heads"], info["head_dim"],
                         qkv_bias=self.attention_bias(cfg), o_bias=False)

    def check_moe(self, cfg: Mapping[str, Any], E: int) -> int:
        return int(config_get(cfg, "first_k_dense_replace", default=1) or 0)

    def shared_expert(self, cfg: Mapping[str, Any], i_e: int) -> Tuple[int, str, str]:
        return DeepseekV2.shared_expert(self, cfg, i_e)

    def mlp(self, tr: Any, ctx: Any, n2: Any) -> Any:
        arch = ctx.arch
        if not arch.is_moe or ctx.dense_layer:
            return gated_mlp(tr, ctx, n2, int(arch.config.get("intermediate_size") or arch.intermediate_size))
        return sigmoid_routed_moe(tr, ctx, n2)


def sigmoid_routed_moe(tr: Any, ctx: Any, x: Any) -> Any:
    """DeepSeek-V3-style MoE: fp32 sigmoid router, grouped_mm experts weighted by fp32
    routing weights, shared experts added."""
    arch, T = ctx.arch, ctx.T
    E, k, ie, h = arch.num_experts, arch.experts_per_token, arch.expert_intermediate_size, arch.hidden_size
    c = ctx.c
    trains = ctx.linear_trains
    # router: F.linear(x.float(), W.float())
    if trains:
        tr.save(tr.cast(x, F32, "router input as fp32"))
    # (the fp32 copy of the router weight it also keeps, E x h x 4 B per layer, does not grow with
    # the tokens and is left out of the per-token block profile)
    rg = x.rg or trains
    if rg:
        tr.save(tr.new("router sigmoid scores (fp32)", T * E, F32, True, "T x E fp32", "router"))
        tr.save(tr.new("top-k indices (int64)", T * k, "int64", True, "T x k x 8 B", "router"))
        # Glm4MoeTopkRouter.forward (models/glm4_moe/modeling_glm4_moe.py): the group scores'
        # ``.topk(2)`` and ``topk(group_scores, k=topk_group)`` keep their int64 indices too
        n_group = int(config_get(arch.config, "n_group", default=1) or 1)
        topk_group = int(config_get(arch.config, "topk_group", default=1) or 1)
        tr.save(tr.new("group top-2 and top-k_group indices (int64)", T * (2 * n_group + topk_group), "int64", True,
                       "T x (2 n_group + topk_group) x 8 B", "router"))
        if config_get(arch.config, "norm_topk_prob", default=True):
            tr.save(tr.new("top-k weights and their sum (fp32)", T * (k + 1), F32, True, "T x (k+1) fp32",
                           "router"))
    Tk = T * k
    if trains:
        tr.save(tr.new("tokens copied to experts", Tk * h, x.dtype, x.rg, f"T*k x h (k={k})", "experts"))
    if rg:
        tr.save(tr.new("expert gate_up output", Tk * 2 * ie, c, True, "T*k x 2*i_e", "experts"))
        tr.save(tr.new("expert activation output", Tk * ie, c, True, "T*k x i_e", "experts"))
        if trains:
            tr.save(tr.new("expert act(gate) * up", Tk * ie, c, True, "T*k x i_e", "experts"))
        tr.save(tr.new("expert down output", Tk * h, c, True, "T*k x h", "experts"))
        tr.save(tr.new("routing weights (fp32, sorted)", Tk, F32, True, "T*k fp32", "router"))
        # grouped_mm's bookkeeping: the sort permutation, the sorted expert ids and the inverse
        # permutation (int64, T*k each), and the group-limited score mask (bool, T x E)
        tr.save(tr.new("expert sort/permutation indices (int64, 3 x T*k)", 3 * Tk, "int64", True, "3 x T*k x 8 B",
                       "router"))
        tr.save(tr.new("group score mask (bool)", T * E, "uint8", True, "T x E x 1 B", "router"))
    gated_mlp(tr, ctx, x, arch.shared_expert_intermediate_size, prefix="shared expert ", group="experts")
    return tr.new("moe output", T * h, c, True, "T x h", "experts")


