"""Every weight tensor of a causal language model, from its config.json.

An :class:`Architecture` is built from a Hugging Face ``config.json`` (a path or a dict),
a built-in preset name, a Hub id, plain numbers (:func:`custom`) or a bare parameter count
(:func:`from_param_count`).  Its ``tensors`` list every parameter tensor the transformers
model instantiates, collapsed across layers and experts: name pattern, shape, role,
module group, how many instances, and whether it is a linear layer that LoRA or 4-bit
quantization can target.  Counts are checked to the parameter against transformers
(``tools/record_param_counts.py`` records them; ``tests/test_architecture.py`` compares).

The symbols used in formulas throughout the package, defined once:

====  ================================================================
h     hidden size (``hidden_size`` / ``n_embd``)
L     number of transformer blocks (``num_hidden_layers`` / ``n_layer``)
a     attention heads;  kv: key/value heads (GQA/MQA);  d: head dim
i     MLP intermediate size (``intermediate_size`` / ``n_inner`` / 4h)
V     vocabulary size
E     routed experts;  k: experts per token;  i_e: expert intermediate size
====  ================================================================
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple, Union

from .errors import VramError
from .inputs import MAX_COUNT, MAX_TEXT_CHARS, check_int, check_text, fail, shown

#: a config.json is a few kilobytes; longer text is not one
MAX_CONFIG_CHARS = 1 << 24

# Roles a tensor can have.  Module groups (for treemaps) are derived from them.
ROLE_GROUP = {
    "embedding": "embedding",
    "position_embedding": "embedding",
    "embedding_norm": "embedding",
    "attn_q": "attention",
    "attn_k": "attention",
    "attn_v": "attention",
    "attn_o": "attention",
    "attn_qkv": "attention",
    "attn_q_a": "attention",       # MLA low-rank query down-projection
    "attn_q_b": "attention",
    "attn_kv_a": "attention",      # MLA compressed KV down-projection
    "attn_kv_b": "attention",
    "attn_norm": "attention",      # q_norm / k_norm and MLA's latent norms
    "mlp_gate": "mlp",
    "mlp_up": "mlp",
    "mlp_gate_up": "mlp",
    "mlp_down": "mlp",
    "expert_gate_up": "experts",
    "expert_down": "experts",
    "shared_expert": "experts",
    "router": "router",
    "norm": "norms",
    "output_head": "output head",
}

SUPPORTED_MODEL_TYPES = (
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2",
    "gemma3_text", "phi3", "gpt2", "gpt_neox", "opt", "bloom", "falcon", "olmo", "olmo2", "olmoe",
    "deepseek_v2", "deepseek_v3", "smollm3",
)


@dataclass(frozen=True)
class ParamTensor:
    """One parameter tensor (repeated ``repeat`` times across layers and experts).

    ``module`` is the leaf module name that LoRA's ``target_modules`` match
    (``q_proj``, ``c_attn``, ...).  ``linear`` is true for the weight of an ``nn.Linear``
    (or GPT-2's Conv1D) inside the blocks: what LoRA wraps and bitsandbytes quantizes.
    ``in_features``/``out_features`` are set for linear weights.
    """

    name: str
    shape: Tuple[int, ...]
    role: str
    module: str
    repeat: int = 1
    linear: bool = False
    layers: Optional[Tuple[int, int]] = None   # [first, last] layer index, inclusive
    in_features: int = 0
    out_features: int = 0
    experts: int = 0                           # >0 for fused expert tensors (E, ., .)

    @property
    def numel_each(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def numel(self) -> int:
        return self.numel_each * self.repeat

    @property
    def group(self) -> str:
        return ROLE_GROUP[self.role]

    @property
    def is_bias(self) -> bool:
        return self.name.endswith(".bias")

    def to_dict(self) -> Dict[str, Any]:
        """A plain dict of this object (JSON-able)."""
        return {"name": self.name, "shape": list(self.shape), "role": self.role, "group": self.group,
                "module": self.module, "count": self.repeat, "numel": self.numel,
                "linear": self.linear, "layers": list(self.layers) if self.layers else None}


@dataclass
class Architecture:
    """A causal LM's shape: the numbers that memory depends on, and every weight tensor.

    ``exact`` is false for a model given only as a parameter count: then the tensors are
    a stated assumption (a Llama-like shape fitted to the count; see :func:`from_param_count`).
    """

    name: str
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    tensors: List[ParamTensor] = field(default_factory=list)
    mlp_kind: str = "gated"            # "gated" (gate, up, down) or "plain" (fc, proj)
    norm_kind: str = "rms"             # "rms" or "layernorm"
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    dense_layers: int = 0              # leading dense layers in an MoE model (DeepSeek)
    sliding_window: Optional[int] = None
    sliding_layers: int = 0            # how many layers use the sliding window
    attn_logit_softcapping: Optional[float] = None
    final_logit_softcapping: Optional[float] = None
    mla: Optional[Dict[str, int]] = None   # kv_lora_rank, q_lora_rank, qk_rope_head_dim, ...
    max_position_embeddings: Optional[int] = None
    hub_id: Optional[str] = None
    exact: bool = True
    assumption: str = ""
    config: Dict[str, Any] = field(default_factory=dict, repr=False)

    # -- counts --------------------------------------------------------------------
    @property
    def params_total(self) -> int:
        """Parameters as ``sum(p.numel() for p in model.parameters())`` (tied counted once)."""
        return sum(t.numel for t in self.tensors)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def linear_modules(self) -> List[str]:
        """Names of the nn.Linear modules inside the blocks (what ``target_modules`` may name;
        fused MoE expert parameters are not nn.Linear modules)."""
        seen: List[str] = []
        for t in self.tensors:
            if t.linear and not t.experts and t.module not in seen:
                seen.append(t.module)
        return seen

    def params_by_group(self) -> Dict[str, int]:
        """Parameters per module group (embedding, attention, mlp, experts, ...)."""
        out: Dict[str, int] = {}
        for t in self.tensors:
            out[t.group] = out.get(t.group, 0) + t.numel
        return out

    def params_by_role(self) -> Dict[str, int]:
        """Parameters per role (attn_q, mlp_up, output_head, ...)."""
        out: Dict[str, int] = {}
        for t in self.tensors:
            out[t.role] = out.get(t.role, 0) + t.numel
        return out

    def lora_params(self, r: int, targets: Optional[Iterable[str]] = None) -> int:
        """Trainable LoRA parameters: r x (in + out) per targeted linear, as peft counts them."""
        return sum(r * (t.in_features + t.out_features) * t.repeat for t in self.lora_tensors(targets))

    def lora_tensors(self, targets: Optional[Iterable[str]] = None) -> List[ParamTensor]:
        """The linear weights LoRA wraps for ``targets`` (all linear layers when None)."""
        tset = set(self.linear_modules() if targets is None else resolve_targets(self, targets))
        return [t for t in self.tensors if t.linear and t.module in tset and not t.experts]

    def to_dict(self) -> Dict[str, Any]:
        """A plain dict of this object (JSON-able)."""
        return {
            "name": self.name, "model_type": self.model_type, "hub_id": self.hub_id,
            "exact": self.exact, "assumption": self.assumption,
            "hidden_size": self.hidden_size, "num_layers": self.num_layers, "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size, "vocab_size": self.vocab_size,
            "tie_word_embeddings": self.tie_word_embeddings, "num_experts": self.num_experts,
            "experts_per_token": self.experts_per_token, "params_total": self.params_total,
            "params_by_group": self.params_by_group(),
            "tensors": [t.to_dict() for t in self.tensors],
        }


def resolve_targets(arch: Architecture, targets: Iterable[str]) -> List[str]:
    """LoRA ``target_modules`` -> the module names of ``arch`` they select.

    ``"all-linear"`` (peft's spelling) selects every linear module of the blocks.
    A name the model lacks raises a VramError listing the names it has.
    """
    if isinstance(targets, str):
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    targets = list(targets)
    have = arch.linear_modules()
    if any(t in ("all-linear", "all_linear", "all") for t in targets):
        return have
    missing = [t for t in targets if t not in have]
    experts = sorted({t.module for t in arch.tensors if t.experts} & set(missing))
    if experts:
        raise VramError(f"lora_targets: {', '.join(experts)} in {arch.name} are fused expert parameters "
                        f"(E x out x in), not nn.Linear modules; LoRA on experts is not modelled. Linear "
                        f"modules: {', '.join(have)}", field="lora_targets")
    if missing:
        raise VramError(
            f"lora_targets: {arch.name} has no module named {', '.join(missing)}; "
            f"its linear modules are {', '.join(have)} (or 'all-linear')", field="lora_targets")
    if not targets:
        raise VramError("lora_targets: name at least one module (or 'all-linear')", field="lora_targets")
    return targets


# ----------------------------------------------------------------------------------
# Reading a config.json
# ----------------------------------------------------------------------------------

def _get(cfg: Mapping[str, Any], *names: str, default: Any = None) -> Any:
    """The first of ``names`` present (and not None) in cfg: old and new spellings."""
    for n in names:
        v = cfg.get(n)
        if v is not None:
            return v
    return default


def _posint(cfg: Mapping[str, Any], value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise VramError(f"config: {what} must be a positive whole number, got {shown(value)}", field=what)
    if value <= 0 or value != value or value in (float("inf"), float("-inf")) or int(value) != value \
            or value > MAX_COUNT:
        raise VramError(f"config: {what} must be a positive whole number, got {shown(value)}", field=what)
    return int(value)


def _require(cfg: Mapping[str, Any], what: str, *names: str, default: Any = None) -> int:
    v = _get(cfg, *names, default=default)
    if v is None:
        raise VramError(f"config: missing field {names[0]!r} ({what})", field=names[0])
    return _posint(cfg, v, names[0])


class _Builder:
    """Collects tensors for one architecture; each family function below fills one."""

    def __init__(self, L: int):
        self.L = L
        self.tensors: List[ParamTensor] = []

    def top(self, name: str, shape: Tuple[int, ...], role: str, module: str = "") -> None:
        self.tensors.append(ParamTensor(name, tuple(shape), role, module or name.split(".")[-2]))

    def layer(self, name: str, shape: Tuple[int, ...], role: str, *, repeat: Optional[int] = None,
              first: int = 0, linear: bool = False, experts: int = 0) -> None:
        """A tensor present in layers [first, L): ``name`` holds ``{i}`` for the layer index."""
        n_layers = self.L - first if repeat is None else repeat
        if n_layers <= 0:
            return
        parts = name.split(".")
        module = parts[-2] if parts[-1] in ("weight", "bias") else parts[-1]
        in_f = out_f = 0
        if linear:
            if experts:
                out_f, in_f = shape[-2], shape[-1]
            else:
                out_f, in_f = shape[0], shape[1]
        self.tensors.append(ParamTensor(name, tuple(shape), role, module, repeat=n_layers, linear=linear,
                                        layers=(first, first + n_layers - 1), in_features=in_f,
                                        out_features=out_f, experts=experts))

    def linear(self, prefix: str, out_f: int, in_f: int, role: str, *, bias: bool = False,
               first: int = 0, conv1d: bool = False) -> None:
        shape = (in_f, out_f) if conv1d else (out_f, in_f)
        n = self.L - first
        if n <= 0:
            return
        parts = prefix.split(".")
        self.tensors.append(ParamTensor(prefix + ".weight", shape, role, parts[-1], repeat=n, linear=True,
                                        layers=(first, self.L - 1), in_features=in_f, out_features=out_f))
        if bias:
            self.tensors.append(ParamTensor(prefix + ".bias", (out_f,), role, parts[-1], repeat=n,
                                            layers=(first, self.L - 1)))

    def norm(self, name: str, dim: int, *, bias: bool = False, per_layer: bool = True, role: str = "norm",
             first: int = 0) -> None:
        if per_layer:
            self.layer(name + ".weight", (dim,), role, first=first)
            if bias:
                self.layer(name + ".bias", (dim,), role, first=first)
        else:
            self.top(name + ".weight", (dim,), role, name.split(".")[-1])
            if bias:
                self.top(name + ".bias", (dim,), role, name.split(".")[-1])


def _llama_like(cfg: Mapping[str, Any], mt: str) -> Dict[str, Any]:
    """Llama, Mistral, Mixtral, Qwen2/3(-MoE), Gemma 1/2/3, OLMo(E), Phi-3, DeepSeek V2/V3."""
    h = _require(cfg, "hidden size", "hidden_size", "n_embd", "d_model")
    L = _require(cfg, "number of layers", "num_hidden_layers", "n_layer", "num_layers")
    a = _require(cfg, "attention heads", "num_attention_heads", "n_head")
    kv = _posint(cfg, _get(cfg, "num_key_value_heads", default=a), "num_key_value_heads")
    V = _require(cfg, "vocabulary size", "vocab_size")
    head_dim = _get(cfg, "head_dim")
    if head_dim is None:
        if h % a:
            raise VramError(f"config: num_attention_heads ({a}) does not divide hidden_size ({h}) and no "
                            f"head_dim is given", field="num_attention_heads")
        head_dim = h // a
    d = _posint(cfg, head_dim, "head_dim")
    if a % kv:
        raise VramError(f"config: num_key_value_heads ({kv}) must divide num_attention_heads ({a})",
                        field="num_key_value_heads")
    default_tie = mt in ("gemma", "gemma2", "gemma3_text")
    tied = bool(_get(cfg, "tie_word_embeddings", default=default_tie))
    i = _get(cfg, "intermediate_size", "n_inner", "ffn_dim")
    i = _posint(cfg, i, "intermediate_size") if i is not None else None

    b = _Builder(L)
    P = "model.layers.{i}."
    b.top("model.embed_tokens.weight", (V, h), "embedding", "embed_tokens")
    info: Dict[str, Any] = dict(hidden_size=h, num_layers=L, num_heads=a, num_kv_heads=kv, head_dim=d,
                                vocab_size=V, tie_word_embeddings=tied)

    # --- attention ---
    attn_bias = bool(_get(cfg, "attention_bias", default=mt in ("qwen2", "qwen2_moe")))
    if mt in ("qwen2", "qwen2_moe"):
        b.linear(P + "self_attn.q_proj", a * d, h, "attn_q", bias=True)
        b.linear(P + "self_attn.k_proj", kv * d, h, "attn_k", bias=True)
        b.linear(P + "self_attn.v_proj", kv * d, h, "attn_v", bias=True)
        b.linear(P + "self_attn.o_proj", h, a * d, "attn_o")
    elif mt == "phi3":
        b.linear(P + "self_attn.qkv_proj", (a + 2 * kv) * d, h, "attn_qkv")
        b.linear(P + "self_attn.o_proj", h, a * d, "attn_o")
    elif mt in ("deepseek_v2", "deepseek_v3"):
        q_lora = _get(cfg, "q_lora_rank")
        kv_lora = _require(cfg, "MLA latent rank", "kv_lora_rank")
        rope_d = _require(cfg, "MLA rope head dim", "qk_rope_head_dim")
        nope_d = _require(cfg, "MLA no-rope head dim", "qk_nope_head_dim")
        v_d = _require(cfg, "MLA value head dim", "v_head_dim")
        q_head = rope_d + nope_d
        if q_lora:
            q_lora = _posint(cfg, q_lora, "q_lora_rank")
            b.linear(P + "self_attn.q_a_proj", q_lora, h, "attn_q_a", bias=attn_bias)
            b.norm(P + "self_attn.q_a_layernorm", q_lora, role="attn_norm")
            b.linear(P + "self_attn.q_b_proj", a * q_head, q_lora, "attn_q_b")
        else:
            b.linear(P + "self_attn.q_proj", a * q_head, h, "attn_q")
        b.linear(P + "self_attn.kv_a_proj_with_mqa", kv_lora + rope_d, h, "attn_kv_a", bias=attn_bias)
        b.norm(P + "self_attn.kv_a_layernorm", kv_lora, role="attn_norm")
        b.linear(P + "self_attn.kv_b_proj", a * (nope_d + v_d), kv_lora, "attn_kv_b")
        b.linear(P + "self_attn.o_proj", h, a * v_d, "attn_o", bias=attn_bias)
        info.update(head_dim=q_head, num_kv_heads=a, mla=dict(kv_lora_rank=kv_lora, q_lora_rank=q_lora or 0,
                                                                qk_rope_head_dim=rope_d, qk_nope_head_dim=nope_d,
                                                                v_head_dim=v_d))
    else:
        b.linear(P + "self_attn.q_proj", a * d, h, "attn_q", bias=attn_bias)
        b.linear(P + "self_attn.k_proj", kv * d, h, "attn_k", bias=attn_bias)
        b.linear(P + "self_attn.v_proj", kv * d, h, "attn_v", bias=attn_bias)
        b.linear(P + "self_attn.o_proj", h, a * d, "attn_o", bias=attn_bias)
    if mt in ("qwen3", "qwen3_moe", "gemma3_text"):
        b.norm(P + "self_attn.q_norm", d, role="attn_norm")
        b.norm(P + "self_attn.k_norm", d, role="attn_norm")
    if mt in ("olmoe", "olmo2"):
        b.norm(P + "self_attn.q_norm", a * d, role="attn_norm")
        b.norm(P + "self_attn.k_norm", kv * d, role="attn_norm")

    # --- MLP or mixture of experts ---
    mlp_bias = bool(_get(cfg, "mlp_bias", default=False))
    E = int(_get(cfg, "num_local_experts", "num_experts", "n_routed_experts", default=0) or 0)
    dense_first = 0
    if mt in ("deepseek_v2", "deepseek_v3"):
        dense_first = int(_get(cfg, "first_k_dense_replace", default=0) or 0)
        if E and int(_get(cfg, "moe_layer_freq", default=1) or 1) != 1:
            raise VramError("config: moe_layer_freq other than 1 is not supported", field="moe_layer_freq")
    if mt == "qwen2_moe" or mt == "qwen3_moe":
        step = int(_get(cfg, "decoder_sparse_step", default=1) or 1)
        if _get(cfg, "mlp_only_layers") or step != 1:
            raise VramError("config: qwen MoE with mlp_only_layers or decoder_sparse_step != 1 is not supported",
                            field="mlp_only_layers")
    if E and mt in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3"):
        k = _require(cfg, "experts per token", "num_experts_per_tok")
        if mt == "mixtral":
            i_e = _require(cfg, "expert intermediate size", "intermediate_size")
        elif mt == "olmoe":
            i_e = _require(cfg, "expert intermediate size", "intermediate_size")
        else:
            i_e = _require(cfg, "expert intermediate size", "moe_intermediate_size")
        if dense_first:
            i_dense = _require(cfg, "dense intermediate size", "intermediate_size")
            b.linear(P + "mlp.gate_proj", i_dense, h, "mlp_gate", bias=mlp_bias)
            b.linear(P + "mlp.up_proj", i_dense, h, "mlp_up", bias=mlp_bias)
            b.linear(P + "mlp.down_proj", h, i_dense, "mlp_down", bias=mlp_bias)
            b.tensors[-3:] = [_restrict(t, 0, dense_first) for t in b.tensors[-3:]]
        b.layer(P + "mlp.gate.weight", (E, h), "router", first=dense_first)
        # (DeepSeek-V3's e_score_correction_bias is a buffer in transformers, not a parameter)
        b.layer(P + "mlp.experts.gate_up_proj", (E, 2 * i_e, h), "expert_gate_up", first=dense_first,
                linear=True, experts=E)
        b.layer(P + "mlp.experts.down_proj", (E, h, i_e), "expert_down", first=dense_first, linear=True,
                experts=E)
        shared = 0
        if mt == "qwen2_moe":
            shared = _require(cfg, "shared expert size", "shared_expert_intermediate_size")
            pre = P + "mlp.shared_expert."
            gate_name = "shared_expert_gate"
        elif mt in ("deepseek_v2", "deepseek_v3"):
            n_shared = int(_get(cfg, "n_shared_experts", default=0) or 0)
            shared = n_shared * i_e
            pre = P + "mlp.shared_experts."
            gate_name = ""
        if shared:
            for nm, o, ii in (("gate_proj", shared, h), ("up_proj", shared, h), ("down_proj", h, shared)):
                b.linear(pre + nm, o, ii, "shared_expert", first=dense_first)
            if gate_name:
                b.layer(P + "mlp." + gate_name + ".weight", (1, h), "router", first=dense_first)
        info.update(num_experts=E, experts_per_token=k, expert_intermediate_size=i_e,
                    shared_expert_intermediate_size=shared, dense_layers=dense_first,
                    intermediate_size=i if i else i_e)
    else:
        if i is None:
            raise VramError("config: missing field 'intermediate_size' (MLP size)", field="intermediate_size")
        if mt == "phi3":
            b.linear(P + "mlp.gate_up_proj", 2 * i, h, "mlp_gate_up")
            b.linear(P + "mlp.down_proj", h, i, "mlp_down")
        else:
            b.linear(P + "mlp.gate_proj", i, h, "mlp_gate", bias=mlp_bias)
            b.linear(P + "mlp.up_proj", i, h, "mlp_up", bias=mlp_bias)
            b.linear(P + "mlp.down_proj", h, i, "mlp_down", bias=mlp_bias)
        info.update(intermediate_size=i)

    # --- norms ---
    if mt == "olmo":  # non-parametric layer norms
        pass
    elif mt == "olmo2":
        b.norm(P + "post_attention_layernorm", h)
        b.norm(P + "post_feedforward_layernorm", h)
    else:
        b.norm(P + "input_layernorm", h)
        b.norm(P + "post_attention_layernorm", h)
        if mt in ("gemma2", "gemma3_text"):
            b.norm(P + "pre_feedforward_layernorm", h)
            b.norm(P + "post_feedforward_layernorm", h)
    if mt != "olmo":
        b.norm("model.norm", h, per_layer=False)
    if not tied:
        b.top("lm_head.weight", (V, h), "output_head", "lm_head")

    if mt in ("mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma2", "gemma3_text", "phi3"):
        sw = _get(cfg, "sliding_window")
        use_sw = _get(cfg, "use_sliding_window", default=True)
        if sw and use_sw:
            info["sliding_window"] = int(sw)
            types = cfg.get("layer_types")
            if isinstance(types, list) and types:
                info["sliding_layers"] = sum(1 for t in types if t == "sliding_attention")
            elif mt == "gemma2":
                info["sliding_layers"] = L // 2
            elif mt == "gemma3_text":
                pattern = int(_get(cfg, "sliding_window_pattern", default=6) or 6)
                info["sliding_layers"] = sum(1 for j in range(L) if (j + 1) % pattern)
            else:
                info["sliding_layers"] = L
    if mt in ("gemma2", "gemma3_text"):
        info["attn_logit_softcapping"] = _get(cfg, "attn_logit_softcapping")
        info["final_logit_softcapping"] = _get(cfg, "final_logit_softcapping")
    info["tensors"] = b.tensors
    info["mlp_kind"] = "gated"
    info["norm_kind"] = "rms"
    return info


def _restrict(t: ParamTensor, first: int, n: int) -> ParamTensor:
    """A per-layer tensor limited to n layers starting at ``first``."""
    return ParamTensor(t.name, t.shape, t.role, t.module, repeat=n, linear=t.linear, layers=(first, first + n - 1),
                       in_features=t.in_features, out_features=t.out_features, experts=t.experts)


def _gpt2(cfg: Mapping[str, Any], mt: str) -> Dict[str, Any]:
    h = _require(cfg, "hidden size", "n_embd", "hidden_size")
    L = _require(cfg, "number of layers", "n_layer", "num_hidden_layers")
    a = _require(cfg, "attention heads", "n_head", "num_attention_heads")
    V = _require(cfg, "vocabulary size", "vocab_size")
    npos = _require(cfg, "positions", "n_positions", "max_position_embeddings", default=1024)
    if h % a:
        raise VramError(f"config: n_head ({a}) does not divide n_embd ({h})", field="n_head")
    i = _posint(cfg, _get(cfg, "n_inner", default=4 * h), "n_inner")
    b = _Builder(L)
    P = "transformer.h.{i}."
    b.top("transformer.wte.weight", (V, h), "embedding", "wte")
    b.top("transformer.wpe.weight", (npos, h), "position_embedding", "wpe")
    b.norm(P + "ln_1", h, bias=True)
    b.linear(P + "attn.c_attn", 3 * h, h, "attn_qkv", bias=True, conv1d=True)
    b.linear(P + "attn.c_proj", h, h, "attn_o", bias=True, conv1d=True)
    b.norm(P + "ln_2", h, bias=True)
    b.linear(P + "mlp.c_fc", i, h, "mlp_up", bias=True, conv1d=True)
    b.linear(P + "mlp.c_proj", h, i, "mlp_down", bias=True, conv1d=True)
    b.norm("transformer.ln_f", h, bias=True, per_layer=False)
    tied = bool(_get(cfg, "tie_word_embeddings", default=True))
    if not tied:
        b.top("lm_head.weight", (V, h), "output_head", "lm_head")
    return dict(hidden_size=h, num_layers=L, num_heads=a, num_kv_heads=a, head_dim=h // a, intermediate_size=i,
                vocab_size=V, tie_word_embeddings=tied, tensors=b.tensors, mlp_kind="plain", norm_kind="layernorm")


def _gpt_neox(cfg: Mapping[str, Any], mt: str) -> Dict[str, Any]:
    h = _require(cfg, "hidden size", "hidden_size")
    L = _require(cfg, "number of layers", "num_hidden_layers")
    a = _require(cfg, "attention heads", "num_attention_heads")
    V = _require(cfg, "vocabulary size", "vocab_size")
    i = _require(cfg, "MLP size", "intermediate_size", default=4 * h)
    if h % a:
        raise VramError(f"config: num_attention_heads ({a}) does not divide hidden_size ({h})",
                        field="num_attention_heads")
    bias = bool(_get(cfg, "attention_bias", default=True))
    b = _Builder(L)
    P = "gpt_neox.layers.{i}."
    b.top("gpt_neox.embed_in.weight", (V, h), "embedding", "embed_in")
    b.norm(P + "input_layernorm", h, bias=True)
    b.norm(P + "post_attention_layernorm", h, bias=True)
    b.linear(P + "attention.query_key_value", 3 * h, h, "attn_qkv", bias=bias)
    b.linear(P + "attention.dense", h, h, "attn_o", bias=bias)
    b.linear(P + "mlp.dense_h_to_4h", i, h, "mlp_up", bias=True)
    b.linear(P + "mlp.dense_4h_to_h", h, i, "mlp_down", bias=True)
    b.norm("gpt_neox.final_layer_norm", h, bias=True, per_layer=False)
    tied = bool(_get(cfg, "tie_word_embeddings", default=False))
    if not tied:
        b.top("lm_head.weight", (V, h), "output_head", "lm_head")
    return dict(hidden_size=h, num_layers=L, num_heads=a, num_kv_heads=a, head_dim=h // a, intermediate_size=i,
                vocab_size=V, tie_word_embeddings=tied, tensors=b.tensors, mlp_kind="plain", norm_kind="layernorm")


def _opt(cfg: Mapping[str, Any], mt: str) -> Dict[str, Any]:
    h = _require(cfg, "hidden size", "hidden_size")
    L = _require(cfg, "number of layers", "num_hidden_layers")
    a = _require(cfg, "attention heads", "num_attention_heads")
    V = _require(cfg, "vocabulary size", "vocab_size")
    i = _require(cfg, "MLP size", "ffn_dim", "intermediate_size", default=4 * h)
    npos = _require(cfg, "positions", "max_position_embeddings", default=2048)
    we = _posint(cfg, _get(cfg, "word_embed_proj_dim", default=h), "word_embed_proj_dim")
    if h % a:
        raise VramError(f"config: num_attention_heads ({a}) does not divide hidden_size ({h})",
                        field="num_attention_heads")
    bias = bool(_get(cfg, "enable_bias", default=True))
    ln_aff = bool(_get(cfg, "layer_norm_elementwise_affine", default=True))
    b = _Builder(L)
    P = "model.decoder.layers.{i}."
    b.top("model.decoder.embed_tokens.weight", (V, we), "embedding", "embed_tokens")
    b.top("model.decoder.embed_positions.weight", (npos + 2, h), "position_embedding", "embed_positions")
    if we != h:
        b.top("model.decoder.project_out.weight", (we, h), "output_head", "project_out")
        b.top("model.decoder.project_in.weight", (h, we), "embedding", "project_in")
    for nm, role in (("k_proj", "attn_k"), ("v_proj", "attn_v"), ("q_proj", "attn_q")):
        b.linear(P + "self_attn." + nm, h, h, role, bias=bias)
    b.linear(P + "self_attn.out_proj", h, h, "attn_o", bias=bias)
    if ln_aff:
        b.norm(P + "self_attn_layer_norm", h, bias=bias)
    b.linear(P + "fc1", i, h, "mlp_up", bias=bias)
    b.linear(P + "fc2", h, i, "mlp_down", bias=bias)
    if ln_aff:
        b.norm(P + "final_layer_norm", h, bias=bias)
    if _get(cfg, "do_layer_norm_before", default=True) and not _get(cfg, "_remove_final_layer_norm", default=False):
        if ln_aff:
            b.norm("model.decoder.final_layer_norm", h, bias=bias, per_layer=False)
    tied = bool(_get(cfg, "tie_word_embeddings", default=True))
    if not tied:
        b.top("lm_head.weight", (V, we), "output_head", "lm_head")
    return dict(hidden_size=h, num_layers=L, num_heads=a, num_kv_heads=a, head_dim=h // a, intermediate_size=i,
                vocab_size=V, tie_word_embeddings=tied, tensors=b.tensors, mlp_kind="plain", norm_kind="layernorm")


def _bloom(cfg: Mapping[str, Any], mt: str) -> Dict[str, Any]:
    h = _require(cfg, "hidden size", "hidden_size", "n_embed")
    L = _require(cfg, "number of layers", "n_layer", "num_hidden_layers")
    a = _require(cfg, "attention heads", "n_head", "num_attention_heads")
    V = _require(cfg, "vocabulary size", "vocab_size")
    if h % a:
        raise VramError(f"config: n_head ({a}) does not divide hidden_size ({h})", field="n_head")
    b = _Builder(L)
    P = "transformer.h.{i}."
    b.top("transformer.word_embeddings.weight", (V, h), "embedding", "word_embeddings")
    b.top("transformer.word_embeddings_layernorm.weight", (h,), "embedding_norm", "word_embeddings_layernorm")
    b.top("transformer.word_embeddings_layernorm.bias", (h,), "embedding_norm", "word_embeddings_layernorm")
    b.norm(P + "input_layernorm", h, bias=True)
    b.linear(P + "self_attention.query_key_value", 3 * h, h, "attn_qkv", bias=True)
    b.linear(P + "self_attention.dense", h, h, "attn_o", bias=True)
    b.norm(P + "post_attention_layernorm", h, bias=True)
    b.linear(P + "mlp.dense_h_to_4h", 4 * h, h, "mlp_up", bias=True)
    b.linear(P + "mlp.dense_4h_to_h", h, 4 * h, "mlp_down", bias=True)
    b.norm("transformer.ln_f", h, bias=True, per_layer=False)
    tied = bool(_get(cfg, "tie_word_embeddings", default=True))
    if not tied:
        b.top("lm_head.weight", (V, h), "output_head", "lm_head")
    return dict(hidden_size=h, num_layers=L, num_heads=a, num_kv_heads=a, head_dim=h // a, intermediate_size=4 * h,
                vocab_size=V, tie_word_embeddings=tied, tensors=b.tensors, mlp_kind="plain", norm_kind="layernorm")


def _falcon(cfg: Mapping[str, Any], mt: str) -> Dict[str, Any]:
    h = _require(cfg, "hidden size", "hidden_size")
    L = _require(cfg, "number of layers", "num_hidden_layers", "n_layer")
    a = _require(cfg, "attention heads", "num_attention_heads", "n_head")
    V = _require(cfg, "vocabulary size", "vocab_size")
    if h % a:
        raise VramError(f"config: num_attention_heads ({a}) does not divide hidden_size ({h})",
                        field="num_attention_heads")
    d = h // a
    new_arch = bool(_get(cfg, "new_decoder_architecture", default=False))
    if new_arch:
        kv = _posint(cfg, _get(cfg, "num_kv_heads", default=a), "num_kv_heads")
    elif _get(cfg, "multi_query", default=True):
        kv = 1
    else:
        kv = a
    bias = bool(_get(cfg, "bias", default=False))
    i = _posint(cfg, _get(cfg, "ffn_hidden_size", default=4 * h), "ffn_hidden_size")
    b = _Builder(L)
    P = "transformer.h.{i}."
    b.top("transformer.word_embeddings.weight", (V, h), "embedding", "word_embeddings")
    b.linear(P + "self_attention.query_key_value", (a + 2 * kv) * d, h, "attn_qkv", bias=bias)
    b.linear(P + "self_attention.dense", h, h, "attn_o", bias=bias)
    b.linear(P + "mlp.dense_h_to_4h", i, h, "mlp_up", bias=bias)
    b.linear(P + "mlp.dense_4h_to_h", h, i, "mlp_down", bias=bias)
    parallel = bool(_get(cfg, "parallel_attn", default=True))
    n_ln = int(_get(cfg, "num_ln_in_parallel_attn", default=2) or 2) if new_arch else 1
    if new_arch and n_ln == 2:
        b.norm(P + "ln_attn", h, bias=True)
        b.norm(P + "ln_mlp", h, bias=True)
    else:
        b.norm(P + "input_layernorm", h, bias=True)
        if not parallel:
            b.norm(P + "post_attention_layernorm", h, bias=True)
    b.norm("transformer.ln_f", h, bias=True, per_layer=False)
    tied = bool(_get(cfg, "tie_word_embeddings", default=True))
    if not tied:
        b.top("lm_head.weight", (V, h), "output_head", "lm_head")
    return dict(hidden_size=h, num_layers=L, num_heads=a, num_kv_heads=kv, head_dim=d, intermediate_size=i,
                vocab_size=V, tie_word_embeddings=tied, tensors=b.tensors, mlp_kind="plain", norm_kind="layernorm")


#: old and new spellings of the same size; a config that gives both must agree
_SYNONYMS = (("hidden_size", "n_embd"), ("num_hidden_layers", "n_layer"), ("num_attention_heads", "n_head"),
             ("max_position_embeddings", "n_positions"))

_FAMILIES = {
    "gpt2": _gpt2, "gpt_neox": _gpt_neox, "opt": _opt, "bloom": _bloom, "falcon": _falcon,
}


def from_config(config: Union[Mapping[str, Any], str, os.PathLike], name: Optional[str] = None) -> Architecture:
    """An Architecture from a config.json dict or a path to a config.json file."""
    if name is not None:
        check_text("name", name, max_chars=MAX_TEXT_CHARS)
    if not isinstance(config, Mapping):
        if not isinstance(config, (str, os.PathLike)):
            raise fail("model", "a config.json must be a dict or a path", config)
        path = os.fspath(config)
        if not isinstance(path, str) or len(path) > MAX_TEXT_CHARS:
            raise fail("model", f"a config.json path is text of at most {MAX_TEXT_CHARS:,} characters", path)
        try:
            with open(path, "r", encoding="utf-8") as f:
                text = f.read(MAX_CONFIG_CHARS + 1)
            if len(text) > MAX_CONFIG_CHARS:
                raise fail("model", f"{shown(path)} is larger than a config.json ({MAX_CONFIG_CHARS:,} characters at "
                                    "most)", show_value=False)
        except UnicodeDecodeError:
            raise fail("model", f"{shown(path)} is not UTF-8 text", show_value=False) from None
        except OSError as e:
            raise VramError(f"config: cannot read {shown(path)}: {e.strerror or e}", field="model") from None
        config = parse_config_text(text, source=path)
        if name is None:
            name = os.path.basename(os.path.dirname(os.path.abspath(path))) or "custom"
    cfg = dict(config)
    if "text_config" in cfg and isinstance(cfg["text_config"], Mapping) and "hidden_size" not in cfg:
        inner = dict(cfg["text_config"])
        inner.setdefault("model_type", str(cfg.get("model_type", ""))[:64] + "_text")
        cfg = inner
    mt = cfg.get("model_type")
    if not mt:
        raise VramError("config: missing field 'model_type' (e.g. \"llama\"); supported: "
                        + ", ".join(SUPPORTED_MODEL_TYPES), field="model_type")
    if not isinstance(mt, str):
        raise fail("model_type", "config: must be text, one of " + ", ".join(SUPPORTED_MODEL_TYPES), mt)
    if mt == "gemma3":
        mt = "gemma3_text"
    if cfg.get("is_encoder_decoder"):
        raise VramError(f"config: {mt} is an encoder-decoder model; vramwidget models decoder-only causal LMs",
                        field="model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise VramError(f"config: model_type {shown(mt)} is not supported; supported: "
                        + ", ".join(SUPPORTED_MODEL_TYPES), field="model_type")
    for a, b in _SYNONYMS:
        if cfg.get(a) is not None and cfg.get(b) is not None and cfg[a] != cfg[b]:
            raise VramError(f"config: contradictory fields {a}={shown(cfg[a])} and {b}={shown(cfg[b])} (two spellings of "
                            f"one size); keep one", field=a)
    builder = _FAMILIES.get(mt, _llama_like)
    try:
        info = builder(cfg, mt)
    except VramError:
        raise
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError, OverflowError) as e:
        # a field of the wrong type that no check above names (e.g. a list where a number
        # belongs): still one line, never a traceback
        raise VramError(f"config: a {mt} config.json field has a value of the wrong type or range "
                        f"({type(e).__name__}: {shown(str(e))})", field="config_json") from None
    pos = _get(cfg, "max_position_embeddings", "n_positions")
    if pos is not None:
        pos = _posint(cfg, pos, "max_position_embeddings")
    info.setdefault("max_position_embeddings", pos)
    given = name or cfg.get("_name_or_path")
    return Architecture(name=given if isinstance(given, str) and given else mt, model_type=mt, config=cfg, **info)


def parse_config_text(text: str, source: str = "config.json") -> Dict[str, Any]:
    """Parse config.json text with a one-line error naming the line and column."""
    check_text("config_json", text, max_chars=MAX_CONFIG_CHARS, what="config.json must be text")
    source = shown(source).strip("'\"")
    try:
        cfg = json.loads(text)
    except RecursionError:
        raise VramError(f"config: {source} is nested too deeply to be a config.json", field="config_json") from None
    except json.JSONDecodeError as e:
        raise VramError(f"config: {source} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})",
                        field="config_json") from None
    if not isinstance(cfg, dict):
        raise VramError(f"config: {source} must hold a JSON object, got {type(cfg).__name__}", field="config_json")
    return cfg


# ----------------------------------------------------------------------------------
# Custom shapes and bare parameter counts
# ----------------------------------------------------------------------------------

def custom(*, hidden_size: int, num_layers: int, num_heads: int, vocab_size: int,
           intermediate_size: Optional[int] = None, num_kv_heads: Optional[int] = None,
           head_dim: Optional[int] = None, mlp: str = "gated", tied: bool = False,
           name: str = "custom") -> Architecture:
    """An architecture from plain numbers.

    ``mlp="gated"`` gives a Llama-style block (RMSNorm, gate/up/down projections, no biases);
    ``mlp="plain"`` a GPT-style block (LayerNorm with bias, fc/proj with biases, learned positions
    are not added).
    """
    from .inputs import check_bool, check_choice

    mlp = check_choice("mlp", mlp, ("gated", "plain"))
    hidden_size, num_layers, num_heads, vocab_size = (
        check_int(k, v, what="must be a positive whole number") for k, v in (("hidden_size", hidden_size), ("num_layers", num_layers),
                                     ("num_heads", num_heads), ("vocab_size", vocab_size)))
    intermediate_size, num_kv_heads, head_dim = (
        None if v is None else check_int(k, v, what="must be a positive whole number") for k, v in (("intermediate_size", intermediate_size),
                                                            ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)))
    tied = check_bool("tied", tied)
    name = check_text("name", name, max_chars=256)
    cfg: Dict[str, Any] = {"model_type": "llama", "hidden_size": hidden_size, "num_hidden_layers": num_layers,
                           "num_attention_heads": num_heads, "vocab_size": vocab_size,
                           "num_key_value_heads": num_heads if num_kv_heads is None else num_kv_heads,
                           "tie_word_embeddings": tied,
                           "intermediate_size": intermediate_size if intermediate_size is not None else
                           (4 * hidden_size if mlp == "plain" else _llama_intermediate(hidden_size))}
    if head_dim is not None:
        cfg["head_dim"] = head_dim
    if mlp == "plain":
        cfg = {"model_type": "gpt_neox", "hidden_size": hidden_size, "num_hidden_layers": num_layers,
               "num_attention_heads": num_heads, "vocab_size": vocab_size, "intermediate_size":
               4 * hidden_size if intermediate_size is None else intermediate_size, "tie_word_embeddings": tied}
        if num_kv_heads is not None and num_kv_heads != num_heads:
            raise VramError("num_kv_heads: a plain (GPT-style) block has as many KV heads as heads",
                            field="num_kv_heads")
    arch = from_config(cfg, name=name)
    return arch


def _llama_intermediate(h: int) -> int:
    """Llama's rule: 2/3 of 4h, rounded up to a multiple of 256."""
    return int(math.ceil(8 * h / 3 / 256) * 256)


def parse_param_count(text: Union[str, int, float]) -> int:
    """'7B' -> 7e9, '350M' -> 3.5e8, 1.3e9 -> 1.3e9."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        n = float(text) if abs(text) < 1e300 else float("inf")
    elif not isinstance(text, str) or len(text) > 64:
        raise fail("model", "a parameter count is a number or text like '7B'", text)
    else:
        s = str(text).strip().upper().replace("_", "").replace(",", "")
        mult = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
        try:
            n = float(s[:-1]) * mult[s[-1]] if s and s[-1] in mult else float(s)
        except (ValueError, KeyError):
            raise VramError(f"model: {shown(text)} is neither a preset, a config.json, a Hub id nor a parameter "
                            f"count like '7B'", field="model") from None
    if not (n > 0) or n != n or n == float("inf"):
        raise VramError(f"model: a parameter count must be positive, got {shown(text)}", field="model")
    return int(round(n))


def from_param_count(count: Union[str, int, float], *, vocab_size: int = 32000) -> Architecture:
    """A stand-in architecture for a model known only by its parameter count.

    Assumption (stated on the result): a Llama-style dense decoder with hidden size from
    the Llama 2 family's aspect ratio (L = h / 128, i = 8h/3 rounded), full multi-head
    attention, untied embeddings of a 32k vocabulary; the hidden size is solved so the
    total matches the count.  Weights, gradients and optimizer states are then exact for
    that count; activations and logits follow the assumed shape and are marked derived.
    """
    n = parse_param_count(count)
    vocab_size = check_int("vocab_size", vocab_size, lo=1, hi=1 << 24)
    smallest = _assumed_total(256, vocab_size)
    if n < smallest:
        raise VramError(f"model: {_fmt_count(n)} parameters is below the smallest assumed shape ({_fmt_count(smallest)}: "
                        f"h=256, 2 layers, a {vocab_size:,}-token vocabulary); give a config.json for a model this "
                        f"small", field="model")
    if n > MAX_PARAMS:
        raise VramError(f"model: {_fmt_count(n)} parameters is more than 2**50 (a PiB of 1-byte weights): not a real "
                        f"model", field="model")
    best = None
    for h in range(256, 32768 + 1, 128):
        L = max(1, round(h / 128))
        i = _llama_intermediate(h)
        total = _assumed_total(h, vocab_size)
        if total > n and best is not None:
            break
        best = (total, h, L, i)
    assert best is not None
    _, h, L, i = best
    arch = custom(hidden_size=h, num_layers=L, num_heads=h // 128, vocab_size=vocab_size, intermediate_size=i,
                  head_dim=128, name=f"{_fmt_count(n)} (assumed shape)")
    # Scale the block tensors' repeat so the total equals the stated count exactly.
    arch.exact = False
    arch.assumption = (f"only a parameter count was given ({_fmt_count(n)}): weights, gradients and optimizer "
                       f"states use that count exactly; activations and logits assume a Llama-like shape "
                       f"h={h}, L={L}, heads={h // 128}, i={i}, vocab={vocab_size}")
    diff = n - arch.params_total
    if diff > 0:
        # The largest assumed shape not above the count; the remainder is one more tensor so
        # that weights, gradients and optimizer states follow the stated count exactly.
        arch.tensors.append(ParamTensor("(remainder to match the stated count)", (diff,), "norm", "other"))
    arch.config = {"param_count": n, "assumed": {"hidden_size": h, "num_layers": L, "intermediate_size": i}}
    return arch


def _assumed_total(h: int, vocab_size: int) -> int:
    """Parameters of the assumed Llama-like shape of hidden size h (L = h / 128, i = 8h/3)."""
    L, i = max(1, round(h / 128)), _llama_intermediate(h)
    return L * (4 * h * h + 3 * h * i + 2 * h) + 2 * vocab_size * h + h


#: a bare parameter count above this is an input error (a PiB of 1-byte weights)
MAX_PARAMS = 2 ** 50


def _fmt_count(n: int) -> str:
    for div, suf in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.3g}{suf}"
    return str(n)


# ----------------------------------------------------------------------------------
# The front door
# ----------------------------------------------------------------------------------

_CACHE: Dict[str, Architecture] = {}


def load(model: Union[str, Mapping[str, Any], "Architecture", os.PathLike]) -> Architecture:
    """Resolve what a user typed to an Architecture.

    Accepts an Architecture, a config dict, a path to a config.json (or to a folder holding
    one), a preset name (``llama-2-7b``), a preset's Hub id (``meta-llama/Llama-2-7b-hf``,
    resolved offline), another Hub id (fetches only config.json, needs ``huggingface_hub``
    and network; ``HF_TOKEN`` honoured), or a parameter count (``"7B"``).
    """
    if isinstance(model, Architecture):
        return model
    if isinstance(model, Mapping):
        return from_config(model)
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    if not isinstance(model, str):
        raise VramError(f"model: expected a preset name, config.json path or dict, Hub id or Architecture, "
                        f"got {type(model).__name__}", field="model")
    if len(model) > MAX_TEXT_CHARS:
        raise fail("model", f"a preset name, path or Hub id is at most {MAX_TEXT_CHARS:,} characters", model)
    key = model.strip()
    if not key:
        raise VramError("model: empty; give a preset name (e.g. 'llama-3.1-8b'), a config.json path, "
                        "a Hub id or a parameter count like '7B'", field="model")
    hit = _CACHE.get(key)
    if hit is not None:
        return hit
    arch = _load_uncached(key)
    if len(_CACHE) > 256:
        _CACHE.clear()
    _CACHE[key] = arch
    return arch


def _load_uncached(key: str) -> Architecture:
    from . import presets

    if os.path.isdir(key) and os.path.isfile(os.path.join(key, "config.json")):
        return from_config(os.path.join(key, "config.json"))
    if key.endswith(".json") or os.path.isfile(key):
        return from_config(key)
    preset = presets.find(key)
    if preset is not None:
        arch = from_config(preset["config"], name=preset["name"])
        arch.hub_id = preset.get("hub_id")
        return arch
    if "/" in key and not key.startswith((".", "/")):
        from .hub import fetch_config

        cfg = fetch_config(key)
        arch = from_config(cfg, name=key)
        arch.hub_id = key
        return arch
    if key[:1].isdigit():
        return from_param_count(key)
    raise presets.unknown_preset_error(key)
