"""Parameter tensors and the helpers family modules build them with.

:class:`ParamTensor` is one weight tensor (repeated across layers and experts);
:class:`ParamBuilder` collects a model's tensors; ``config_get``/``required_count``/``positive_count`` read a
config.json's fields with one-line errors.  Nothing here knows any model family: the
families (``vramwidget/model/families``) use these, and :mod:`vramwidget.model.architecture` turns their
tensors into an :class:`~vramwidget.model.architecture.Architecture`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ..errors import VramError
from ..inputs import MAX_COUNT, shown

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
    "attn_sink": "attention",      # learned attention sinks (gpt-oss), one logit per head
    "mixer": "mixer",              # short convolutions, linear-attention / state-space parameters
    "mixer_proj": "mixer",         # the linear projections of such a mixer
    "norm": "norms",
    "output_head": "output head",
}



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
    keep_fp32: bool = False                    # kept in fp32 when the model loads in 16 bits
    tower: str = ""                            # a side tower's tensors (vision), shown as their own group

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
        return f"{self.tower} tower" if self.tower else ROLE_GROUP[self.role]

    @property
    def is_bias(self) -> bool:
        return self.name.endswith(".bias")

    def to_dict(self) -> Dict[str, Any]:
        """A plain dict of this object (JSON-able)."""
        return {"name": self.name, "shape": list(self.shape), "role": self.role, "group": self.group,
                "module": self.module, "count": self.repeat, "numel": self.numel,
                "linear": self.linear, "layers": list(self.layers) if self.layers else None}



# ----------------------------------------------------------------------------------
# Reading a config.json
# ----------------------------------------------------------------------------------

def config_get(cfg: Mapping[str, Any], *names: str, default: Any = None) -> Any:
    """The first of ``names`` present (and not None) in cfg: old and new spellings."""
    for n in names:
        v = cfg.get(n)
        if v is not None:
            return v
    return default


def positive_count(cfg: Mapping[str, Any], value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value \
            or value in (float("inf"), float("-inf")) or value <= 0 or value > MAX_COUNT or int(value) != value:
        raise VramError(f"config: {what} must be a positive whole number, got {shown(value)}", field=what)
    return int(value)


def required_count(cfg: Mapping[str, Any], what: str, *names: str, default: Any = None) -> int:
    v = config_get(cfg, *names, default=default)
    if v is None:
        raise VramError(f"config: missing field {shown(names[0])} ({what})", field=names[0])
    return positive_count(cfg, v, names[0])


def experts_per_token(cfg: Mapping[str, Any], num_experts: int) -> int:
    """``num_experts_per_tok``: a whole number no larger than the routed experts (the router's
    ``torch.topk(router_logits, top_k)`` needs top_k <= experts: modeling_mixtral.py)."""
    k = required_count(cfg, "experts per token", "num_experts_per_tok")
    if k > num_experts:
        raise VramError(f"config: num_experts_per_tok ({k}) is more than the {num_experts} routed experts "
                        f"(each token picks top-k of them)", field="num_experts_per_tok")
    return k


#: the deepest model a config may describe (num_hidden_layers, n_layer, encoder_layers, ...):
#: the deepest published transformers have about a thousand blocks (DeepNet, Wang et al.
#: 2022: 1,000 layers), the largest LMs 61 to 126; each block is written into the step plan,
#: so the bound bounds the plan too (10**6 blocks ran for minutes and ran out of memory)
MAX_LAYERS = 1024
#: the config fields that count blocks, at the top level or in a sub-config (text_config,
#: vision_config: ``depth`` in Qwen2-VL's)
LAYER_FIELDS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "num_decoder_layers", "encoder_layers",
                "decoder_layers", "depth")


def check_depth(cfg: Mapping[str, Any]) -> None:
    """Every block count of ``cfg`` (and of its sub-configs) at most :data:`MAX_LAYERS`: a
    VramError naming the field, before any tensor is listed."""
    for sub in [cfg] + [v for v in cfg.values() if isinstance(v, Mapping)]:
        for name in LAYER_FIELDS:
            v = sub.get(name)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and v > MAX_LAYERS:
                raise VramError(f"config: {name} is {shown(v)}; at most {MAX_LAYERS:,} blocks are modelled (the "
                                f"deepest published transformers have about 1,000)", field=name)


class ParamBuilder:
    """Collects tensors for one architecture; each family's ``params`` fills one."""

    def __init__(self, L: int):
        self.L = L
        self.tensors: List[ParamTensor] = []

    def top(self, name: str, shape: Tuple[int, ...], role: str, module: str = "") -> None:
        self.tensors.append(ParamTensor(name, tuple(shape), role, module or name.split(".")[-2]))

    def layer(self, name: str, shape: Tuple[int, ...], role: str, *, repeat: Optional[int] = None,
              first: int = 0, linear: bool = False, experts: int = 0, transposed: bool = False,
              keep_fp32: bool = False) -> None:
        """A tensor present in layers [first, L): ``name`` holds ``{i}`` for the layer index.
        ``transposed``: a fused expert tensor stored (E, in, out) rather than (E, out, in)."""
        n_layers = self.L - first if repeat is None else repeat
        if n_layers <= 0:
            return
        parts = name.split(".")
        module = parts[-2] if parts[-1] in ("weight", "bias") else parts[-1]
        in_f = out_f = 0
        if linear:
            if experts:
                out_f, in_f = (shape[-1], shape[-2]) if transposed else (shape[-2], shape[-1])
            else:
                out_f, in_f = shape[0], shape[1]
        self.tensors.append(ParamTensor(name, tuple(shape), role, module, repeat=n_layers, linear=linear,
                                        layers=(first, first + n_layers - 1), in_features=in_f,
                                        out_features=out_f, experts=experts, keep_fp32=keep_fp32))

    def in_layers(self, layers: Sequence[int], add: Callable[["ParamBuilder"], None]) -> None:
        """Tensors present only in some layers (a hybrid's attention layers, interleaved MoE
        layers): ``add`` declares them on a builder, emitted once per contiguous run of
        ``layers`` so that each tensor's ``layers`` range stays exact."""
        runs: List[Tuple[int, int]] = []
        for j in sorted(set(layers)):
            if runs and runs[-1][1] == j - 1:
                runs[-1] = (runs[-1][0], j)
            else:
                runs.append((j, j))
        for lo, hi in runs:
            sub = ParamBuilder(hi + 1)
            add(sub)
            for t in sub.tensors:
                if t.layers is None:
                    self.tensors.append(t)
                    continue
                self.tensors.append(restrict_layers(t, lo, hi - lo + 1))

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
             first: int = 0, keep_fp32: bool = False) -> None:
        if per_layer:
            self.layer(name + ".weight", (dim,), role, first=first, keep_fp32=keep_fp32)
            if bias:
                self.layer(name + ".bias", (dim,), role, first=first, keep_fp32=keep_fp32)
        else:
            for part in ("weight", "bias") if bias else ("weight",):
                self.tensors.append(ParamTensor(f"{name}.{part}", (dim,), role, name.split(".")[-1],
                                                keep_fp32=keep_fp32))


def restrict_layers(t: ParamTensor, first: int, n: int) -> ParamTensor:
    """A per-layer tensor limited to n layers starting at ``first``."""
    return replace(t, repeat=n, layers=(first, first + n - 1))


