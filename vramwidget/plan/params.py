"""Parameters: which train and how each is stored (dtype, quantization, adapters).

One decision per weight tensor of the architecture, made once per setup and read by the
step plan (its load, gradients and optimizer states), the inference estimate and the
parallel layouts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Tuple

from ..model.architecture import HEAD_TARGETS, Architecture, ParamTensor, restrict_layers, resolve_targets
from ..errors import VramError
from ..stacks import behaviour
from ..training import OPTIMIZER_STATE_COUNT, TrainingSetup
from ..units import DTYPE_BYTES

#: bitsandbytes block sizes
NF4_BLOCK = 64                 # 4-bit weights: one absmax per 64 weights


NF4_DQ_BLOCK = 256             # double quantization: one fp32 scale per 256 absmax values


BNB_8BIT_OPT_BLOCK = 256       # 8-bit optimizers: one fp32 absmax per 256 state values


BNB_8BIT_MIN_SIZE = 4096       # smaller tensors keep fp32 optimizer states


@dataclass
class ParamStorage:
    """Per-tensor storage decisions for one setup."""

    weights: List[Tuple[ParamTensor, str, float, bool]]  # tensor, dtype, bytes, trains
    quant_consts: List[Tuple[ParamTensor, float, str]]   # tensor, bytes, formula
    adapters: List[Tuple[str, str, float, int]]          # module, group, bytes, numel
    adapter_dtype: str
    lora_modules: Tuple[str, ...]
    trainable_numel: int
    trainable_tensors: List[Tuple[str, str, int, str, int]]  # (name, group, numel, dtype, numel of one instance)
    largest_trainable_numel: int


def quantizable(t: ParamTensor, groups: Tuple[str, ...], experts_linear: bool = False) -> bool:
    """Which weights a quantized base stores in 4 or 8 bits.

    bitsandbytes (through transformers) replaces the blocks' nn.Linear modules; fused MoE
    expert tensors are not nn.Linear and stay 16-bit.  ``experts_linear``: transformers < 5.0,
    whose MoE blocks hold each expert as its own nn.Linear modules (models/mixtral/modeling_mixtral.py
    of 4.57.0: ``nn.ModuleList([MixtralBlockSparseTop2MLP(config) ...])`` with w1/w2/w3; 5.x fuses
    them into ``MixtralExperts.gate_up_proj``/``down_proj`` parameters): bitsandbytes quantizes them
    with the MLP.  ``embedding`` and ``lm_head`` are opt-in groups: transformers skips the output
    head by default, and embedding tables need a quantizer other than bitsandbytes' Linear4bit
    (torchao, GGUF-style loaders).
    """
    if t.experts and experts_linear and t.linear and not t.is_bias:
        return "mlp" in groups
    if t.is_bias or t.experts:
        return False
    if t.role == "embedding":
        return "embedding" in groups
    if t.role == "output_head":
        return "lm_head" in groups
    if not t.linear:
        return False
    role = t.role
    if role in ("attn_q", "attn_k", "attn_q_a", "attn_q_b", "attn_kv_a", "attn_kv_b"):
        return "attn_qk" in groups
    if role in ("attn_v", "attn_o"):
        return "attn_vo" in groups
    if role == "attn_qkv":
        return "attn_qk" in groups or "attn_vo" in groups
    if role.startswith("mlp") or role == "shared_expert":
        return "mlp" in groups
    return False


_PARAMS: Dict[Tuple[Any, ...], Tuple[Architecture, ParamStorage]] = {}


#: the setup fields that decide which parameters train and how they are stored
STORAGE_FIELDS = ("method", "precision", "quantization", "double_quant", "quantized_groups", "prepare_kbit",
                 "lora_r", "lora_targets", "trainable_layers", "stack", "lora_variant", "modules_to_save", "versions")


def param_storage(arch: Architecture, s: TrainingSetup) -> ParamStorage:
    """Storage and training decisions per tensor (cached per architecture and setup)."""
    key = (id(arch),) + tuple(getattr(s, f) for f in STORAGE_FIELDS)
    hit = _PARAMS.get(key)
    if hit is not None and hit[0] is arch:
        return hit[1]
    P = _storage_uncached(arch, s)
    if len(_PARAMS) > 8192:
        _PARAMS.clear()
    _PARAMS[key] = (arch, P)
    return P


def _storage_uncached(arch: Architecture, s: TrainingSetup) -> ParamStorage:
    wd = s.weights_dtype
    quant = s.quantization
    qbytes = {"nf4": 0.5, "fp4": 0.5, "int8": 1.0}.get(quant, 0.0)
    base_dtype16 = "bfloat16" if s.compute_dtype == "float32" else s.compute_dtype
    lora_modules: Tuple[str, ...] = ()
    if s.trains_adapters:
        lora_modules = tuple(resolve_targets(arch, s.lora_targets) if s.lora_targets else arch.linear_modules())
    head_targets = tuple(t for t in (s.lora_targets or ()) if t in HEAD_TARGETS) if s.trains_adapters else ()
    trainable_layers = None
    if s.method == "freeze":
        if s.trainable_layers > arch.num_layers:
            raise VramError(f"trainable_layers: {arch.name} has {arch.num_layers} layers, got {s.trainable_layers}",
                            field="trainable_layers")
        trainable_layers = (arch.num_layers - s.trainable_layers, arch.num_layers - 1)
    weights, consts = [], []
    trainable = 0
    tlist: List[Tuple[str, str, int, str]] = []
    largest = 0
    tensors: List[Tuple[ParamTensor, bool]] = []
    for t in arch.tensors:
        if s.method == "freeze":
            if t.layers is None:   # the final norm and an untied head train; embeddings do not
                tensors.append((t, t.role in ("norm", "output_head")))
                continue
            first, last = t.layers
            n_train = max(0, last - max(first, trainable_layers[0]) + 1)
            if n_train < t.repeat:
                tensors.append((restrict_layers(t, first, t.repeat - n_train), False))
            if n_train:
                tensors.append((restrict_layers(t, last - n_train + 1, n_train), True))
        elif s.method == "norms":
            # LayerNorm/RMSNorm-only tuning: the norms' weights (and biases) train
            tensors.append((t, t.role == "norm"))
        else:
            tensors.append((t, s.method == "full"))
    # peft modules_to_save (ModulesToSaveWrapper, peft/utils/other.py): the original module
    # stays frozen and a deepcopy of it trains in full, in the original's dtype (peft casts
    # only its tuner layers to fp32); a tied head gets an untied trainable copy
    for m in s.modules_to_save if s.trains_adapters else ():
        src = head_or_embedding(arch, m)
        tensors.append((replace(src, name=f"{src.name} (modules_to_save copy)",
                                role="output_head" if m == "lm_head" else "embedding"), True))
    for t, trains in tensors:
        if quant != "none" and quantizable(t, s.quantized_groups or (), s.before("transformers", "5.0")):
            dtype = quant
            nbytes = t.numel * qbytes
            consts.append((t, quant_const_bytes(t.numel, quant, s.double_quant), quant_const_formula(quant, s.double_quant)))
        elif quant != "none":
            dtype = "float32" if (s.prepare_kbit or t.keep_fp32) else base_dtype16
            nbytes = t.numel * DTYPE_BYTES[dtype]
        else:
            # transformers' _keep_in_fp32_modules stay fp32 whatever the load dtype
            dtype = "float32" if t.keep_fp32 else wd
            nbytes = t.numel * DTYPE_BYTES[dtype]
        weights.append((t, dtype, nbytes, trains))
        if trains:
            trainable += t.numel
            tlist.append((t.name, t.group, t.numel, dtype, t.numel_each))
            largest = max(largest, t.numel_each)
    adapters = []
    # peft keeps adapters in fp32 when the base is 16-bit; torchtune and LitGPT build them in
    # the model's dtype (stacks.py)
    adapter_dtype = "float32" if behaviour(s.stack)["adapter_dtype"] == "float32" else s.weights_dtype
    if adapter_dtype == "float32" and quant == "none" and s.before("peft", "0.11"):
        # peft < 0.11 created the adapters in the base layer's dtype; 0.11 added
        # autocast_adapter_dtype=True (peft PR #1706), which keeps them in fp32 (a 4-bit base
        # has no float dtype to follow: its adapters were fp32 before too)
        adapter_dtype = wd
    if quant != "none" and adapter_dtype != "float32":
        adapter_dtype = base_dtype16
    if s.trains_adapters:
        for t in arch.lora_tensors(lora_modules):
            numel_a = s.lora_r * t.in_features * t.repeat
            numel_b = s.lora_r * t.out_features * t.repeat
            n = numel_a + numel_b
            adapters.append((t.module, t.group, n * DTYPE_BYTES[adapter_dtype], n))
            trainable += n
            tlist.append((f"{t.module} lora_A", "adapters", numel_a, adapter_dtype, s.lora_r * t.in_features))
            tlist.append((f"{t.module} lora_B", "adapters", numel_b, adapter_dtype, s.lora_r * t.out_features))
            largest = max(largest, s.lora_r * max(t.in_features, t.out_features))
        # LoRA on the output head (a Linear h -> V) and on the embedding (peft lora.Embedding:
        # lora_embedding_A r x V, lora_embedding_B h x r): r x (h + V) each
        for m in head_targets:
            src = head_or_embedding(arch, m)
            n = s.lora_r * (arch.hidden_size + arch.vocab_size)
            g = "output head" if m == "lm_head" else "embedding"
            adapters.append((m, g, n * DTYPE_BYTES[adapter_dtype], n))
            trainable += n
            tlist.append((f"{m} lora_A + lora_B", "adapters", n, adapter_dtype, s.lora_r * arch.vocab_size))
            largest = max(largest, s.lora_r * arch.vocab_size)
        if s.lora_variant == "dora":
            # DoRA's magnitude vector (peft tuners/lora/dora.py DoraLinearLayer.weight): one
            # value per output feature of each adapted module, in the adapter dtype
            mags = [(t.module, t.group, t.out_features * t.repeat, t.out_features)
                    for t in arch.lora_tensors(lora_modules)] if lora_modules else []
            mags += [(m, "output head" if m == "lm_head" else "embedding",
                      arch.vocab_size if m == "lm_head" else arch.hidden_size,
                      arch.vocab_size if m == "lm_head" else arch.hidden_size) for m in head_targets]
            for module, group, n, each in mags:
                adapters.append((f"{module} magnitude", group, n * DTYPE_BYTES[adapter_dtype], n))
                trainable += n
                tlist.append((f"{module} DoRA magnitude", "adapters", n, adapter_dtype, each))
    return ParamStorage(weights, consts, adapters, adapter_dtype, lora_modules, trainable, tlist, largest)


def head_or_embedding(arch: Architecture, module: str) -> ParamTensor:
    """The output head's weight (``lm_head``; the embedding when they are tied) or the token
    embedding (``embed_tokens``)."""
    role = "output_head" if module == "lm_head" else "embedding"
    for t in arch.tensors:
        if t.role == role:
            return t
    for t in arch.tensors:
        if t.role == "embedding":
            return t
    raise VramError(f"lora_targets: {arch.name} has no {module}", field="lora_targets")


def quant_const_bytes(numel: float, quant: str, double_quant: bool) -> float:
    """bitsandbytes quantization constants.

    4-bit: one absmax per 64 weights, fp32 (0.5 bit/param), or with double quantization
    an 8-bit absmax plus one fp32 scale per 256 of them (8/64 + 32/(64*256) = 0.127 bit/param,
    the QLoRA paper's figure).  LLM.int8: one fp32 scale per output row (taken as per 4096 weights).
    """
    if quant in ("nf4", "fp4"):
        blocks = numel / NF4_BLOCK
        if double_quant:
            return blocks * 1 + blocks / NF4_DQ_BLOCK * 4
        return blocks * 4
    if quant == "int8":
        return numel / 4096 * 4
    return 0.0


def quant_const_formula(quant: str, double_quant: bool) -> str:
    if quant in ("nf4", "fp4"):
        return ("n/64 x 1 B (8-bit absmax) + n/64/256 x 4 B (fp32 scales)" if double_quant
                else "n/64 x 4 B (fp32 absmax)")
    return "one fp32 scale per output row"


def state_dtypes(s: TrainingSetup, param_dtype: str) -> Tuple[str, ...]:
    """PyTorch optimizers keep state in the parameter's dtype unless told otherwise."""
    n = OPTIMIZER_STATE_COUNT.get(s.optimizer, 0)
    if s.optimizer_state_dtypes and n:   # 1 or n dtypes (TrainingSetup checks the count)
        sd = tuple(s.optimizer_state_dtypes)
        return sd * n if len(sd) == 1 else sd
    if s.precision == "bf16_fp32_states":
        return ("float32",) * n
    return (param_dtype,) * n


def galore_shape(t: ParamTensor, s: TrainingSetup) -> Optional[Tuple[int, int, int]]:
    """(m, n, r) for a weight GaLore projects: the blocks' 2-D linear weights (the "attn" and
    "mlp" modules its scripts and HF's optim_target_modules name); None for the rest
    (embeddings, head, norms, biases), which get plain AdamW states."""
    if not t.linear or t.is_bias or t.experts or len(t.shape) != 2:
        return None
    m, n = t.shape
    return m, n, min(s.galore_rank, m, n)
