"""Shared building blocks the family modules compose.

Parameter side (each adds the tensors one transformers module instantiates to a
:class:`~vramwidget.model.architecture._Builder`): :func:`dims` (the shape numbers every decoder
reads), :func:`attention_params` (q/k/v/o projections), :func:`fused_qkv_params`,
:func:`gated_mlp_params`, :func:`experts_params` (router + fused experts), and norms
(``_Builder.norm``).

Trace side (each records what autograd saves, see :mod:`vramwidget.model.activations` for the
per-op rules): ``linear``, ``rms_norm``, ``layer_norm``, ``dropout``, ``sdpa_core`` (the
attention cores), :func:`rotary`, ``gated_mlp``, ``moe`` (router + experts), ``residual``.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Tuple

from ..activations import (F32, BlockContext, Trace, ForwardTensor, promote_dtype, dropout, gated_mlp, layer_norm,  # noqa: F401
                           linear, moe, Router, rms_norm, sdpa_core)
from ..tensors import ParamBuilder, config_get, positive_count, required_count, restrict_layers  # noqa: F401
from ..tensors import experts_per_token  # noqa: F401
from ...errors import VramError

__all__ = ["F32", "BlockContext", "Trace", "dropout", "gated_mlp", "layer_norm", "linear", "moe", "Router", "rms_norm",
           "sdpa_core", "rotary", "residual", "dims", "attention_params", "fused_qkv_params", "gated_mlp_params",
           "experts_params", "shared_mlp_params", "ParamBuilder", "config_get", "positive_count", "required_count", "restrict_layers",
           "experts_per_token"]


# ----------------------------------------------------------------------------------
# Parameters
# ----------------------------------------------------------------------------------

def dims(cfg: Mapping[str, Any]) -> Dict[str, int]:
    """h, L, a, kv, V, d of a Llama-style config (old and new field spellings), validated."""
    h = required_count(cfg, "hidden size", "hidden_size", "n_embd", "d_model")
    L = required_count(cfg, "number of layers", "num_hidden_layers", "n_layer", "num_layers")
    a = required_count(cfg, "attention heads", "num_attention_heads", "n_head")
    kv = positive_count(cfg, config_get(cfg, "num_key_value_heads", default=a), "num_key_value_heads")
    V = required_count(cfg, "vocabulary size", "vocab_size")
    head_dim = config_get(cfg, "head_dim")
    if head_dim is None:
        # transformers' attention modules take head_dim = hidden_size // num_attention_heads
        # when the config has none (models/llama/modeling_llama.py LlamaAttention.__init__:
        # getattr(config, "head_dim", config.hidden_size // config.num_attention_heads); the
        # same line in glm4_moe, qwen2, mistral ...): floor division, so 96 heads of a 4,096
        # hidden size have 42 dimensions each (Family.notes warns)
        head_dim = h // a
    d = positive_count(cfg, head_dim, "head_dim")
    if a % kv:
        raise VramError(f"config: num_key_value_heads ({kv}) must divide num_attention_heads ({a})",
                        field="num_key_value_heads")
    return dict(h=h, L=L, a=a, kv=kv, V=V, d=d)


def attention_params(b: ParamBuilder, P: str, h: int, a: int, kv: int, d: int, *, qkv_bias: bool = False,
                     o_bias: bool = False, prefix: str = "self_attn.", o_name: str = "o_proj") -> None:
    """Separate q, k, v and output projections (``{P}{prefix}q_proj`` ...)."""
    b.linear(P + prefix + "q_proj", a * d, h, "attn_q", bias=qkv_bias)
    b.linear(P + prefix + "k_proj", kv * d, h, "attn_k", bias=qkv_bias)
    b.linear(P + prefix + "v_proj", kv * d, h, "attn_v", bias=qkv_bias)
    b.linear(P + prefix + o_name, h, a * d, "attn_o", bias=o_bias)


def fused_qkv_params(b: ParamBuilder, P: str, h: int, a: int, kv: int, d: int, *, name: str = "self_attn.qkv_proj",
                     o_name: str = "self_attn.o_proj", bias: bool = False) -> None:
    """One fused q/k/v projection ((a + 2 kv) d outputs) and the output projection."""
    b.linear(P + name, (a + 2 * kv) * d, h, "attn_qkv", bias=bias)
    b.linear(P + o_name, h, a * d, "attn_o", bias=bias)


def gated_mlp_params(b: ParamBuilder, pre: str, h: int, i: int, *, bias: bool = False, first: int = 0,
                     role: str = "", fused: bool = False) -> None:
    """gate_proj, up_proj (or one fused gate_up_proj) and down_proj; ``role`` overrides the
    three roles (shared experts)."""
    if fused:
        b.linear(pre + "gate_up_proj", 2 * i, h, role or "mlp_gate_up", bias=bias, first=first)
    else:
        b.linear(pre + "gate_proj", i, h, role or "mlp_gate", bias=bias, first=first)
        b.linear(pre + "up_proj", i, h, role or "mlp_up", bias=bias, first=first)
    b.linear(pre + "down_proj", h, i, role or "mlp_down", bias=bias, first=first)


def shared_mlp_params(b: ParamBuilder, pre: str, h: int, i: int, *, first: int = 0) -> None:
    """A shared expert: a gated MLP whose tensors have the ``shared_expert`` role."""
    for nm, o, ii in (("gate_proj", i, h), ("up_proj", i, h), ("down_proj", h, i)):
        b.linear(pre + nm, o, ii, "shared_expert", first=first)


def experts_params(b: ParamBuilder, P: str, E: int, h: int, i_e: int, *, first: int = 0, router: str = "mlp.gate",
                   experts: str = "mlp.experts", router_bias: bool = False, expert_bias: bool = False) -> None:
    """The router (E x h) and the fused experts of transformers 5 (``gate_up_proj`` E x 2i_e x h,
    ``down_proj`` E x h x i_e)."""
    b.layer(P + router + ".weight", (E, h), "router", first=first)
    if router_bias:
        b.layer(P + router + ".bias", (E,), "router", first=first)
    b.layer(P + experts + ".gate_up_proj", (E, 2 * i_e, h), "expert_gate_up", first=first, linear=True, experts=E)
    if expert_bias:
        b.layer(P + experts + ".gate_up_proj_bias", (E, 2 * i_e), "expert_gate_up", first=first)
    b.layer(P + experts + ".down_proj", (E, h, i_e), "expert_down", first=first, linear=True, experts=E)
    if expert_bias:
        b.layer(P + experts + ".down_proj_bias", (E, h), "expert_down", first=first)


# ----------------------------------------------------------------------------------
# Trace
# ----------------------------------------------------------------------------------

def rotary(tr: Trace, ctx: BlockContext, q: ForwardTensor, k: ForwardTensor, q_numel: float, k_numel: float) -> Tuple[ForwardTensor, ForwardTensor]:
    """``apply_rotary_pos_emb``: ``q * cos + rotate_half(q) * sin`` keeps only cos/sin (no
    activation); the rotated q and k are new tensors, in the promoted dtype under autocast
    (cos/sin are fp32 there) and after prepare_model_for_kbit_training (4-bit linears return
    the fp32 hidden states' dtype)."""
    rope_dtype = promote_dtype(ctx.resid, ctx.c) if (ctx.setup.autocast or ctx.quant_base) else ctx.c
    qr = tr.new("q after rope", q_numel, rope_dtype, q.rg, "T x a*d", "attention")
    kr = tr.new("k after rope", k_numel, rope_dtype, k.rg, "T x kv*d", "attention")
    return qr, kr


def residual(tr: Trace, x: ForwardTensor, y: ForwardTensor, name: str) -> ForwardTensor:
    """``x + y``: a new tensor in the promoted dtype (the residual stream); add saves nothing."""
    return tr.residual_stream(tr.new(name, x.numel, promote_dtype(x.dtype, y.dtype), True, "T x h", "norms"))
