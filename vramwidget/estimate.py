"""The training-memory estimator: what one training step holds on the GPU, phase by phase.

``estimate(model, **setup)`` resolves the model to an :class:`Architecture`, validates the
setup, and walks one training step the way PyTorch runs it:

after load    weights (+ quantization constants, LoRA adapters) + library workspaces
forward       + optimizer states (from step 2) + saved activations + logits and loss
backward      + the loss's fp32 gradient buffers, then layer by layer: gradients appear
              while saved activations are released (checkpointing recomputes one layer)
optimizer     weights + states + all gradients + the optimizer's temporaries

The peak is the largest phase, never the sum of every part.  Each mechanism lives in one
function below, next to its formula; the per-op activation rules are in ``activations.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from .activations import LORA_GROUP, BlockContext, SavedTensor, Trace, attention_backend, runs_eager, trace_block
from .architecture import HEAD_TARGETS, Architecture, ParamTensor, _restrict, load, resolve_targets
from .errors import VramError
from .gpus import context_for, get_gpu
from .inputs import MAX_BYTES, check_total
from .result import Estimate, Node
from .stacks import behaviour
from .training import TrainingSetup
from .units import CUDA_CONTEXT_BYTES, DTYPE_BYTES, MIB

#: cuBLAS + cuBLASLt workspaces the caching allocator holds after the first matmul
#: (measured on an H200 with PyTorch 2.11: weights_mib is 64 MiB above the weights
#: in every case but the first of a process).
CUBLAS_WORKSPACE_BYTES = 64 * MIB
#: bitsandbytes block sizes
NF4_BLOCK = 64                 # 4-bit weights: one absmax per 64 weights
NF4_DQ_BLOCK = 256             # double quantization: one fp32 scale per 256 absmax values
BNB_8BIT_OPT_BLOCK = 256       # 8-bit optimizers: one fp32 absmax per 256 state values
BNB_8BIT_MIN_SIZE = 4096       # smaller tensors keep fp32 optimizer states

Model = Union[str, Dict[str, Any], Architecture]


def estimate(model: Model, gpu: Any = None, **setup: Any) -> Estimate:
    """Estimate the GPU memory of one training step.

    Parameters
    ----------
    model:
        A preset name (``"llama-3.1-8b"``), a config.json path or dict, a Hub id, an
        :class:`~vramwidget.architecture.Architecture`, or a parameter count (``"7B"``).
    **setup:
        The fields of :class:`~vramwidget.training.TrainingSetup`: ``method``,
        ``precision``, ``quantization``, ``double_quant``, ``quantized_groups``,
        ``prepare_kbit``, ``optimizer``, ``optimizer_state_dtypes``,
        ``gradient_checkpointing``, ``attn_implementation``, ``batch_size``, ``seq_len``,
        ``target_len`` (an encoder-decoder's decoder tokens per sample; None: ``seq_len``),
        ``grad_accum_steps``, ``lora_r``, ``lora_alpha``, ``lora_dropout``,
        ``lora_targets``, ``trainable_layers``, ``tf32``, ``backend`` ("auto": analytic where
        the model's family is modelled, else traced; "analytic"; "trace": see ``vramwidget.trace``),
        and the knobs of training stacks: ``stack`` (hf, axolotl, torchtune, litgpt, unsloth:
        their defaults, vramwidget/stacks.py), ``loss`` (standard, chunked + ``loss_chunks``,
        liger), ``activation_offloading``, ``optimizer_in_backward``, ``compile``,
        ``lora_variant`` (lora, dora), ``modules_to_save``, ``galore_rank``, ``packing`` and
        ``versions`` ({"bitsandbytes": "0.41.1", "transformers": "4.40", "peft": "0.10"}).
    gpu:
        A catalogue GPU name (``"H100 80GB"``): the estimate then also gives the step time
        (``step_seconds``, ``tokens_per_second``, ``mfu``, ``time_breakdown``, ``run_cost``).

    Raises
    ------
    VramError
        naming the field that is wrong and what is allowed.
    """
    task = setup.pop("task", None)
    s = setup if isinstance(setup, TrainingSetup) else TrainingSetup.from_kwargs(**setup)
    if s.target_len is not None and s.backend != "analytic":
        # the traced step passes labels = input_ids (one length) and its size profile varies
        # batch and sequence only: a target length of its own is the analytic families' (T5, BART)
        _traced_target_len(model, s, task)
    if s.backend == "trace":
        from .trace import estimate_traced

        return estimate_traced(model, s, _cuda_accounting(), task=task).set_gpu(gpu)
    try:
        arch = load(model, task=task)
    except VramError as e:
        # the one place the backends meet: a family with no analytic model is traced
        if s.backend != "auto" or e.field != "model_type":
            raise
        from . import trace

        if not trace.available():
            raise VramError(f"{e} (or trace it: {trace.INSTALL_HINT})", field="model_type") from None
        return trace.estimate_traced(model, s, _cuda_accounting(), task=task).set_gpu(gpu)
    est = estimate_setup(arch, s, gpu=gpu)
    check_physical(est, arch, s)
    return est


def _traced_target_len(model: Model, s: TrainingSetup, task: Optional[str]) -> None:
    """``target_len`` with a backend that may trace: refused unless the model is analytic."""
    if s.backend == "auto":
        try:
            load(model, task=task)
            return              # analytic: estimate_setup checks the model (check_target_len)
        except VramError as e:
            if e.field != "model_type":
                return          # the load's own error comes from the estimate itself
    raise VramError("target_len: the traced backend runs the decoder on the input ids (one length); a target "
                    "length of its own is modelled for the analytic encoder-decoders (T5, BART)", field="target_len")


def check_physical(est: Estimate, arch: Architecture, s: TrainingSetup) -> None:
    """More than 1 PiB on one GPU is an input error (:data:`~vramwidget.inputs.MAX_BYTES`),
    not an estimate: it names the model when the weights alone exceed it, else the inputs
    that scale the activations."""
    # allocated memory + context bounds the device total from below: no allocator replay is
    # needed to tell an input error from an estimate
    if est.peak_allocated_bytes + est.cuda_context_bytes <= MAX_BYTES:
        return
    if est.phases_bytes.get("after_load", 0.0) > MAX_BYTES:
        check_total(est.device_total_bytes, f"{arch.name}'s weights", {"model": arch.name})
    scaling = {"seq_len": s.seq_len, "batch_size": s.batch_size}
    if s.batch_size > s.seq_len / 2048:   # name first the one furthest above its default
        scaling = {"batch_size": s.batch_size, "seq_len": s.seq_len}
    check_total(est.device_total_bytes, "this training step", dict(scaling, model=arch.name))


def _cuda_accounting():
    """The device constants a traced step adds (the same ones this module counts)."""
    from .trace.assemble import CudaAccounting

    return CudaAccounting(CUBLAS_WORKSPACE_BYTES, CUDA_CONTEXT_BYTES)


# ----------------------------------------------------------------------------------
# Parameters: which train, how they are stored
# ----------------------------------------------------------------------------------

@dataclass
class _Params:
    """Per-tensor storage decisions for one setup."""

    weights: List[Tuple[ParamTensor, str, float, bool]]  # tensor, dtype, bytes, trains
    quant_consts: List[Tuple[ParamTensor, float, str]]   # tensor, bytes, formula
    adapters: List[Tuple[str, str, float, int]]          # module, group, bytes, numel
    adapter_dtype: str
    lora_modules: Tuple[str, ...]
    trainable_numel: int
    trainable_tensors: List[Tuple[str, str, int, str, int]]  # (name, group, numel, dtype, numel of one instance)
    largest_trainable_numel: int


def _quantizable(t: ParamTensor, groups: Tuple[str, ...]) -> bool:
    """Which weights a quantized base stores in 4 or 8 bits.

    bitsandbytes (through transformers) replaces the blocks' nn.Linear modules; fused MoE
    expert tensors are not nn.Linear and stay 16-bit.  ``embedding`` and ``lm_head`` are
    opt-in groups: transformers skips the output head by default, and embedding tables
    need a quantizer other than bitsandbytes' Linear4bit (torchao, GGUF-style loaders).
    """
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


_PARAMS: Dict[Tuple[Any, ...], Tuple[Architecture, _Params]] = {}
#: the setup fields that decide which parameters train and how they are stored
_PARAM_FIELDS = ("method", "precision", "quantization", "double_quant", "quantized_groups", "prepare_kbit",
                 "lora_r", "lora_targets", "trainable_layers", "stack", "lora_variant", "modules_to_save", "versions")


def _params(arch: Architecture, s: TrainingSetup) -> _Params:
    """Storage and training decisions per tensor (cached per architecture and setup)."""
    key = (id(arch),) + tuple(getattr(s, f) for f in _PARAM_FIELDS)
    hit = _PARAMS.get(key)
    if hit is not None and hit[0] is arch:
        return hit[1]
    P = _params_uncached(arch, s)
    if len(_PARAMS) > 8192:
        _PARAMS.clear()
    _PARAMS[key] = (arch, P)
    return P


def _params_uncached(arch: Architecture, s: TrainingSetup) -> _Params:
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
                tensors.append((_restrict(t, first, t.repeat - n_train), False))
            if n_train:
                tensors.append((_restrict(t, last - n_train + 1, n_train), True))
        elif s.method == "norms":
            # LayerNorm/RMSNorm-only tuning: the norms' weights (and biases) train
            tensors.append((t, t.role == "norm"))
        else:
            tensors.append((t, s.method == "full"))
    # peft modules_to_save (ModulesToSaveWrapper, peft/utils/other.py): the original module
    # stays frozen and a deepcopy of it trains in full, in the original's dtype (peft casts
    # only its tuner layers to fp32); a tied head gets an untied trainable copy
    for m in s.modules_to_save if s.trains_adapters else ():
        src = _head_or_embedding(arch, m)
        tensors.append((replace(src, name=f"{src.name} (modules_to_save copy)",
                                role="output_head" if m == "lm_head" else "embedding"), True))
    for t, trains in tensors:
        if quant != "none" and _quantizable(t, s.quantized_groups or ()):
            dtype = quant
            nbytes = t.numel * qbytes
            consts.append((t, _quant_const_bytes(t.numel, quant, s.double_quant), _quant_const_formula(quant, s.double_quant)))
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
            src = _head_or_embedding(arch, m)
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
    return _Params(weights, consts, adapters, adapter_dtype, lora_modules, trainable, tlist, largest)


def _head_or_embedding(arch: Architecture, module: str) -> ParamTensor:
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


def _quant_const_bytes(numel: float, quant: str, double_quant: bool) -> float:
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


def _quant_const_formula(quant: str, double_quant: bool) -> str:
    if quant in ("nf4", "fp4"):
        return ("n/64 x 1 B (8-bit absmax) + n/64/256 x 4 B (fp32 scales)" if double_quant
                else "n/64 x 4 B (fp32 absmax)")
    return "one fp32 scale per output row"


# ----------------------------------------------------------------------------------
# Optimizer states and temporaries
# ----------------------------------------------------------------------------------

def _state_dtypes(s: TrainingSetup, param_dtype: str) -> Tuple[str, ...]:
    """PyTorch optimizers keep state in the parameter's dtype unless told otherwise."""
    n = {"adamw": 2, "adamw_fused": 2, "paged_adamw": 2, "lion": 1, "sgd_momentum": 1}.get(s.optimizer, 0)
    if s.optimizer_state_dtypes:
        sd = tuple(s.optimizer_state_dtypes)
        if len(sd) == 1:
            sd = sd * n
        if len(sd) != n:
            raise VramError(f"optimizer_state_dtypes: {s.optimizer} keeps {n} state tensor(s) per parameter, got "
                            f"{len(sd)} dtypes", field="optimizer_state_dtypes")
        return sd
    if s.precision == "bf16_fp32_states":
        return ("float32",) * n
    return (param_dtype,) * n


def _galore_shape(t: ParamTensor, s: TrainingSetup) -> Optional[Tuple[int, int, int]]:
    """(m, n, r) for a weight GaLore projects: the blocks' 2-D linear weights (the "attn" and
    "mlp" modules its scripts and HF's optim_target_modules name); None for the rest
    (embeddings, head, norms, biases), which get plain AdamW states."""
    if not t.linear or t.is_bias or t.experts or len(t.shape) != 2:
        return None
    m, n = t.shape
    return m, n, min(s.galore_rank, m, n)


def _galore_states(P: _Params, s: TrainingSetup) -> List[Node]:
    """GaLore AdamW (galore_torch/adamw.py, galore_projector.py): a projected weight keeps its
    moments in the low-rank space, ``zeros_like(low_rank_grad)`` = r x max(m, n) each (8-bit
    with galore_adamw_8bit: bitsandbytes blockwise, 1 B + fp32 absmax per 256), and the
    projection matrix, r x min(m, n) in the parameter's dtype (SVD's Vh[:r] or U[:, r]; for
    an fp32 parameter that slice is a view that keeps the whole min(m, n)^2 factor alive).
    Every other parameter keeps AdamW's two full moments."""
    eight = s.optimizer == "galore_adamw_8bit"
    mom = Node("exp_avg + exp_avg_sq" + (" (8-bit)" if eight else ""),
               formula="GaLore: 2 x r x max(m, n) per projected weight; 2 x n for the rest")
    proj = Node("GaLore projection matrices", formula="r x min(m, n) in the parameter dtype (fp32: min(m, n)^2)")

    def moments(n_el: float, each: float, dtype: str) -> float:
        if eight:
            return 2 * (n_el * 1 + -(-each // BNB_8BIT_OPT_BLOCK) * 4 * (n_el / each)) if each >= BNB_8BIT_MIN_SIZE \
                else 2 * n_el * 4
        return 2 * n_el * DTYPE_BYTES[dtype]

    for t, dtype, _, trains in P.weights:
        if not trains:
            continue
        g = _galore_shape(t, s)
        if g is None:
            _add_to_group(mom, t.group, moments(t.numel, t.numel_each, dtype), t.numel, dtype, mom.formula)
            continue
        m, n, r = g
        low = r * max(m, n)
        _add_to_group(mom, t.group, moments(low * t.repeat, low, dtype), low * t.repeat, dtype, mom.formula)
        k = min(m, n)
        pb = (k * k * 4) if dtype == "float32" else r * k * DTYPE_BYTES[dtype]
        _add_to_group(proj, t.group, pb * t.repeat, None, dtype, proj.formula)
    return [mom, proj]


def _galore_temporaries(P: _Params, s: TrainingSetup) -> Node:
    """GaLore's step loops over parameters.  For the largest projected weight: at a projection
    refresh, torch.linalg.svd of an fp32 copy of its gradient (m x n, + U m x k, Vh k x n in
    fp32, k = min(m, n)); at every step, the low-rank gradient and update (r x max(m, n) each)
    and the update projected back to m x n.  The other parameters: AdamW's
    ``exp_avg_sq.sqrt()`` of the largest one."""
    node = Node("optimizer temporaries")
    best, label = 0.0, ""
    for t, dtype, _, trains in P.weights:
        if not trains:
            continue
        g = _galore_shape(t, s)
        d = DTYPE_BYTES[dtype]
        if g is None:
            b = t.numel_each * d
            if b > best:
                best, label = b, f"exp_avg_sq.sqrt() of {t.name}"
            continue
        m, n, r = g
        k = min(m, n)
        svd = (m * n + m * k + k * n) * 4
        step = m * n * d + 2 * r * max(m, n) * d
        if max(svd, step) > best:
            best, label = max(svd, step), f"SVD of {t.name}'s gradient in fp32 (m x n + U + Vh)" if svd >= step \
                else f"{t.name}'s update projected back (m x n) + low-rank gradient and update"
    if best:
        node.add(Node(label, bytes=best, formula="largest parameter of the per-parameter loop"))
    return node


def optimizer_states(P: _Params, s: TrainingSetup) -> List[Node]:
    """Optimizer state tensors, one node per state kind, split by module group."""
    nodes: List[Node] = []
    opt = s.optimizer
    if opt.startswith("galore"):
        return _galore_states(P, s)
    if opt in ("adamw_8bit", "paged_adamw_8bit"):
        for label in ("exp_avg (8-bit)", "exp_avg_sq (8-bit)"):
            node = Node(label, formula="1 B/param + fp32 absmax per 256 values; tensors < 4096 elements keep fp32")
            for name, group, numel, dtype, each in P.trainable_tensors:
                small = each < BNB_8BIT_MIN_SIZE
                b = numel * 4 if small else (each + -(-each // BNB_8BIT_OPT_BLOCK) * 4) * (numel // each)
                _add_to_group(node, group, b, numel, "uint8", node.formula)
            nodes.append(node)
        return nodes
    if opt == "adafactor":
        node = Node("exp_avg_sq factored (row + column)", formula="fp32 row (n_rows) + column (n_cols) statistics; "
                    "1-D tensors keep a full fp32 second moment")
        for t, dtype, _, trains in P.weights:
            if not trains:
                continue
            if len(t.shape) >= 2:
                rows = t.numel_each // t.shape[-1]
                cols = t.numel_each // t.shape[-2]
                b = (rows + cols) * 4 * t.repeat
            else:
                b = t.numel * 4
            _add_to_group(node, t.group, b, None, "float32", node.formula)
        for module, group, nbytes, numel in P.adapters:
            _add_to_group(node, "adapters", numel / 8 * 4, None, "float32", node.formula)  # r x (in+out) factored
        nodes.append(node)
        return nodes
    names = {"adamw": ("exp_avg", "exp_avg_sq"), "adamw_fused": ("exp_avg", "exp_avg_sq"),
             "paged_adamw": ("exp_avg (paged)", "exp_avg_sq (paged)"), "lion": ("exp_avg",),
             "sgd_momentum": ("momentum_buffer",)}.get(opt, ())
    for idx, label in enumerate(names):
        node = Node(label)
        for name, group, numel, dtype, _each in P.trainable_tensors:
            sd = _state_dtypes(s, dtype)[idx]
            _add_to_group(node, group, numel * DTYPE_BYTES[sd], numel, sd, f"n x {DTYPE_BYTES[sd]:g} B ({sd})")
        nodes.append(node)
    return nodes


def optimizer_temporaries(P: _Params, s: TrainingSetup) -> Node:
    """Memory ``optimizer.step()`` allocates on top of weights, gradients and states.

    foreach AdamW: ``_foreach_sqrt(exp_avg_sq)`` materialises one state-sized copy of every
    parameter at once.  Fused AdamW, SGD and bitsandbytes' 8-bit optimizers work in place.
    Adafactor loops over parameters: for a 16-bit parameter it makes fp32 copies of the
    gradient and the parameter plus two fp32 update tensors (the largest parameter sets
    the peak); Lion (lion-pytorch) keeps two temporaries of the largest parameter.
    """
    if s.optimizer.startswith("galore"):
        return _galore_temporaries(P, s)
    node = Node("optimizer temporaries")
    opt = s.optimizer
    if opt == "adamw" or (opt == "paged_adamw"):
        if opt == "paged_adamw":
            return node
        for name, group, numel, dtype, _each in P.trainable_tensors:
            sd = _state_dtypes(s, dtype)[1]
            _add_to_group(node, group, numel * DTYPE_BYTES[sd], numel, sd, "sqrt(exp_avg_sq) for every parameter (foreach)")
    elif opt == "adafactor":
        n = P.largest_trainable_numel
        pd = P.trainable_tensors[0][3] if P.trainable_tensors else "float32"
        copies = 4 if DTYPE_BYTES.get(pd, 4) < 4 else 2
        node.add(Node("per-parameter fp32 working copies", bytes=n * 4 * copies, dtype="float32", count=n * copies,
                      formula=f"{copies} x largest parameter ({n:,} elements) x 4 B"))
    elif opt == "lion":
        n = P.largest_trainable_numel
        node.add(Node("per-parameter update", bytes=2 * n * 2, formula=f"2 x largest parameter ({n:,}) x 2 B"))
    return node


def _add_to_group(parent: Node, group: str, nbytes: float, numel: Optional[float], dtype: str, formula: str) -> None:
    for c in parent.children:
        if c.name == group:
            c.bytes += nbytes
            if numel is not None and c.count is not None:
                c.count += int(numel)
            return
    parent.add(Node(group, bytes=nbytes, count=int(numel) if numel is not None else None, dtype=dtype, formula=formula))


# ----------------------------------------------------------------------------------
# Activations
# ----------------------------------------------------------------------------------

@dataclass
class _Acts:
    per_layer: List[SavedTensor]          # saved by one (steady) block
    per_layer_bytes: float
    first_layer_bytes: float              # the first trained block (its input may need no grad)
    n_saving_layers: int                  # blocks that save anything
    checkpoint_bytes_per_layer: float     # gradient checkpointing: each block's input
    head: List[Tuple[str, float, str]]    # final norm and output-head saves
    transient_layer_bytes: float          # backward working buffers of one layer
    backend: str
    layers_bytes: float = 0.0             # every saving block together (no checkpointing)
    # forward work of one block, for the step time (timing.py): tensors created (one
    # kernel each) and the bytes they write; the steady block and the first one
    # side towers (a VLM's vision encoder): saved tensors, not scaled by the text tokens
    tower: List[Tuple[str, float, str]] = field(default_factory=list)
    fwd_ops_per_layer: float = 0.0
    fwd_written_bytes_per_layer: float = 0.0
    head_fwd_ops: float = 0.0
    head_fwd_written_bytes: float = 0.0
    #: saved-tensor packs of the final norm, the newest ones at the end of the forward (_offload)
    head_packs: int = 0
    #: checkpointing: the largest block a backward rebuilds (the trained kinds' largest)
    recompute_layer_bytes: float = 0.0


@dataclass
class _Profile:
    """A block trace as a function of batch b, sequence s and (an encoder-decoder's) target
    length t: every saved tensor's bytes are a sum of coefficients times the size terms of
    :func:`size_terms`: ``alpha * b * s + beta * b * s**2`` for one sequence (T-linear tensors,
    and the b x a x s x s scores); for an encoder-decoder given a ``target_len``, five terms
    b s, b s^2 (the encoder), b t, b t^2 (the decoder's own tokens and self-attention scores)
    and b s t (its cross-attention scores over the encoder's keys)."""

    arch: Architecture
    per_layer: List[Tuple[str, str, str, str, Tuple[float, ...], Tuple[float, ...]]]  # name, group, dtype, formula, bytes, numel coefficients
    per: Tuple[float, ...]
    first: Tuple[float, ...]
    dense: Tuple[float, ...]
    head: List[Tuple[str, str, Tuple[float, ...]]]    # name, formula, bytes coefficients (one sequence: per token)
    backend: str
    written: Tuple[float, ...] = (0.0, 0.0)       # bytes the block's forward writes (a T + b T s)
    ops: float = 0.0                                # kernels of one block's forward
    head_written: Tuple[float, ...] = (0.0, 0.0)
    head_ops: float = 0.0
    head_packs: int = 0
    #: the blocks a checkpointed backward may rebuild, one (a, b) each: every kind among the
    #: trained layers after the first (the first alone when it is the only one trained)
    recompute: List[Tuple[float, float]] = field(default_factory=list)
    #: the block's forward in order, for the allocator replay: ("new", name, dtype, rg, saved,
    #: numel coefficients, outlives, by_producer, constant numel) per created tensor, ("param",
    #: module) per parameter use; steady and first block
    alloc_ops: Tuple[List[Tuple[Any, ...]], List[Tuple[Any, ...]]] = ([], [])
    #: the same per layer key (kind, leading dense) of a stack whose blocks differ (a mixed
    #: stack's kinds, DeepSeek-style dense layers): the replay runs each layer's own block
    #: (:func:`layer_key`); empty where every block is ``alloc_ops[0]``
    kind_alloc_ops: Dict[Tuple[str, bool], List[Tuple[Any, ...]]] = field(default_factory=dict)
    #: an encoder-decoder's five size terms (b s, b s^2, b t, b t^2, b s t); else (b s, b s^2)
    target: bool = False



#: an encoder-decoder's profile is traced at these (seq_len, target_len) sizes, batch 1, and
#: solved exactly for the coefficients of b s, b s^2, b t, b t^2 and b s t
_TARGET_PROBES = ((1, 1), (2, 1), (3, 1), (1, 2), (2, 2))


def _target_inverse() -> List[List[Any]]:
    """The inverse of the five size terms at :data:`_TARGET_PROBES` (exact rationals)."""
    from fractions import Fraction

    rows = [[Fraction(x) for x in (sq, sq * sq, tq, tq * tq, sq * tq)] for sq, tq in _TARGET_PROBES]
    n = len(rows)
    A = [r + [Fraction(int(i == j)) for j in range(n)] for i, r in enumerate(rows)]
    for col in range(n):
        piv = next(i for i in range(col, n) if A[i][col] != 0)
        A[col], A[piv] = A[piv], A[col]
        A[col] = [x / A[col][col] for x in A[col]]
        for i in range(n):
            if i != col and A[i][col] != 0:
                f = A[i][col]
                A[i] = [x - f * y for x, y in zip(A[i], A[col])]
    return [r[n:] for r in A]


_TARGET_INV = _target_inverse()


def has_target(arch: Architecture) -> bool:
    """Whether the model has a decoder stack of its own that reads the target tokens
    (``target_len``): the family says (``Family.has_target``)."""
    return arch.family.has_target(arch)


def size_terms(prof: "_Profile", b: Any, sq: Any, tq: Any = None) -> Tuple[Any, ...]:
    """The size terms a profile's coefficients multiply: (T, T2) = (b s, b s^2) for one
    sequence; an encoder-decoder's (b s, b s^2, b t, b t^2, b s t), t = ``tq`` (None: s)."""
    if not prof.target:
        return (b * sq, b * sq * sq)
    tq = sq if tq is None else tq
    return (b * sq, b * sq * sq, b * tq, b * tq * tq, b * sq * tq)


def _dot(coef: Tuple[float, ...], terms: Tuple[Any, ...]) -> Any:
    """``coef[0] * terms[0] + coef[1] * terms[1] + ...``, left to right (a T + b T2 for one
    sequence: the very operations the two-term profile always did)."""
    v = coef[0] * terms[0]
    for c, m in zip(coef[1:], terms[1:]):
        v = v + c * m
    return v


def _poly(const: float, coef: Tuple[float, ...], terms: Tuple[Any, ...]) -> Any:
    """``const + coef . terms``, left to right (c + a T + b T2 for one sequence)."""
    v = const
    for c, m in zip(coef, terms):
        v = v + c * m
    return v


_PROFILES: Dict[Tuple[Any, ...], _Profile] = {}
#: the setup fields a block trace depends on (not the sizes, the optimizer or LoRA's alpha)
_TRACE_FIELDS = ("method", "precision", "quantization", "prepare_kbit", "gradient_checkpointing",
                 "attn_implementation", "lora_r", "lora_dropout", "lora_targets", "stack", "versions", "lora_variant",
                 "modules_to_save", "compile")


def _activations(arch: Architecture, s: TrainingSetup, P: _Params, cpu: bool = False,
                 sizes: Optional[Tuple[Any, Any]] = None, mx: Callable[..., Any] = max) -> _Acts:
    """Saved activations per block and around the head, for this batch and sequence.

    The block is traced op by op (activations.py) at two small sizes and the result scaled:
    saved bytes are linear in tokens except the attention scores (b x a x s^2), so two
    traces give both coefficients exactly.  Profiles are cached per architecture and
    size-free setup.  ``cpu=True`` picks the kernels PyTorch uses on a CPU (SDPA keeps q,
    k, v, output and logsumexp whatever the dtype), for checking against torch without a
    GPU (tools/saved_tensors.py).

    ``sizes = (b, sq)`` replaces the setup's batch and sequence, e.g. with numpy arrays
    (``mx = _elementwise_max``): every size-dependent figure is then an array of the same
    floating-point operations (:func:`vramwidget.fitmap.fit_map`).
    """
    prof = _get_profile(arch, s, P, cpu)
    b, sq = sizes if sizes is not None else (s.batch_size, s.seq_len)
    # an encoder-decoder's target length: the setup's, else as long as the input (a grid of
    # sizes varies seq_len; a given target_len stays fixed there)
    tq = s.target_len if s.target_len is not None else sq
    M = size_terms(prof, b, sq, tq)
    T = b * sq
    # DoRA with dropout recomputes the base output from a fp32 copy of each adapted weight,
    # which F.linear keeps (a per-layer constant, not traced: it does not scale with tokens)
    dora_w = _dora_weight_copies_per_layer(arch, s, P)
    per = _dot(prof.per, M) + dora_w
    first = _dot(prof.first, M) + dora_w
    dense = _dot(prof.dense, M) + dora_w
    first_train, n_layers = _trained_range(arch, s)
    # DeepSeek-style leading dense layers among the trained ones (freeze trains the last layers)
    n_dense = max(0, min(arch.dense_layers, arch.num_layers) - first_train) if arch.is_moe else 0
    recompute = None
    for coef in prof.recompute:
        x = _dot(coef, M) + dora_w
        recompute = x if recompute is None else mx(recompute, x)
    # the first block (dense in DeepSeek-style MoE) + the other dense blocks + the MoE blocks
    layers = first + max(n_dense - 1, 0) * dense + (n_layers - max(n_dense, 1)) * per
    c = s.compute_dtype
    ckpt = T * arch.hidden_size * DTYPE_BYTES[_resid(s)]
    Tw, sw = T, sq     # the tokens and sequence of the widest block
    if prof.target:
        # checkpointing keeps each block's input: b x s x h per encoder layer, b x t x h per
        # decoder layer (the per-layer figure is their average over the trained layers)
        trained = _trained_layers(arch, s)
        n_dec = sum(1 for k, _ in trained if k in arch.family.target_kinds)
        ckpt = (T * (len(trained) - n_dec) + b * tq * n_dec) / len(trained) * arch.hidden_size \
            * DTYPE_BYTES[_resid(s)]
        sw = mx(sq, tq)
        Tw = b * sw
    # backward working buffers of one block: gradients of the widest intermediate tensors
    i_width = max(arch.intermediate_size, arch.expert_intermediate_size * max(arch.experts_per_token, 1))
    gw = DTYPE_BYTES[c] if not s.autocast else 4
    transient = 2 * Tw * i_width * DTYPE_BYTES[c] + Tw * arch.hidden_size * gw
    if prof.backend in ("eager", "math") or (prof.backend == "recompute" and runs_eager(arch, s)):
        transient = mx(transient, 2 * b * arch.num_heads * sw * sw * 4)
    per_layer = [SavedTensor(name, group, _dot(cb, M), dtype, _dot(cn, M), formula)
                 for name, group, dtype, formula, cb, cn in prof.per_layer]
    if dora_w:
        per_layer.append(SavedTensor("DoRA norm vectors" + (" and weight copies (dropout > 0)" if s.lora_dropout else ""),
                                     LORA_GROUP, dora_w, P.adapter_dtype, dora_w / DTYPE_BYTES[P.adapter_dtype],
                                     "3 x out" + (" + out x in" if s.lora_dropout else "") + " per adapted module"))
    head = [(name, _dot(coef, M), formula) for name, formula, coef in prof.head]
    tower = _tower_activations(arch, s, P, cpu) if arch.towers else []
    return _Acts(per_layer, per, first, n_layers, ckpt, head, transient, prof.backend, layers, tower=tower,
                 head_packs=prof.head_packs, recompute_layer_bytes=per if recompute is None else recompute,
                 **_timing_fields(prof, M))


def _timing_fields(prof: "_Profile", M: Tuple[Any, ...]) -> Dict[str, float]:
    return dict(
fwd_ops_per_layer=prof.ops, fwd_written_bytes_per_layer=_dot(prof.written, M),
                head_fwd_ops=prof.head_ops, head_fwd_written_bytes=_dot(prof.head_written, M))


def _tower_activations(arch: Architecture, s: TrainingSetup, P: _Params, cpu: bool
                       ) -> List[Tuple[str, float, str]]:
    """A side tower's saved tensors (a VLM's vision encoder over ``images_per_sample`` images
    of each sample): its blocks traced at its own token count (patches per image), each
    image attending within itself, in the sequences the tower family lays them out in
    (``tower_attention_layout``), plus what the tower saves once (``tower_saved_once``).
    Under checkpointing each tower layer keeps its input."""
    out: List[Tuple[str, float, str]] = []
    for name, tarch in arch.towers.items():
        per_sample = arch.family.tower_tokens(arch, name, s)
        if not per_sample or not s.images_per_sample:
            continue
        patches = per_sample // s.images_per_sample
        n_img = s.batch_size * s.images_per_sample
        T = n_img * patches
        c = s.compute_dtype
        backend = attention_backend(tarch, s, c)
        if cpu and backend in ("math", "efficient"):
            backend = "flash"
        full = s.method == "full"
        tfam = tarch.family
        seqs, seq_len = tfam.tower_attention_layout(n_img, patches, s)
        once = tfam.tower_saved_once(tarch, n_img, patches, s, backend, _resid(s))
        out.extend(once)
        ctx = BlockContext(arch=tarch, setup=s, T=T, b=seqs, s=seq_len, c=c, resid=_resid(s),
                           norm_w_dtype="float32" if (s.autocast or s.precision == "fp32") else s.weights_dtype,
                           linear_trains=full, norms_train=full, lora_modules=P.lora_modules,
                           adapter_dtype=P.adapter_dtype, attn_backend=backend, quant_base=s.quantized, cpu=cpu)
        L = tarch.num_layers
        if gc_mode(s):
            nbytes = L * T * tarch.hidden_size * DTYPE_BYTES[_resid(s)]
            out.append((f"{name} tower layer inputs kept by checkpointing ({L} layers)", nbytes,
                        f"{L} x images x patches x h_{name} ({n_img} x {patches} x {tarch.hidden_size})"))
            continue
        # layers whose attention sees other sequences (windows) are traced at their own layout
        # (T is the same; the scores of eager attention differ)
        total = 0.0
        for j, ((sq_n, sq_len), count) in enumerate(tfam.tower_layer_layouts(tarch, n_img, patches, s)):
            lctx = replace(ctx, b=sq_n, s=sq_len)
            steady = trace_block(lctx, input_rg=True).total_bytes
            if j == 0:
                lctx = replace(ctx, b=sq_n, s=sq_len)
                total += trace_block(lctx, input_rg=full).total_bytes + (count - 1) * steady
            else:
                total += count * steady
        out.append((f"{name} tower saved tensors ({L} layers)", total,
                    f"{L} blocks over images x patches ({n_img} x {patches})"))
    return out


def _get_profile(arch: Architecture, s: TrainingSetup, P: _Params, cpu: bool = False) -> _Profile:
    """The block trace of this architecture and size-free setup (cached)."""
    key = (id(arch), cpu) + tuple(getattr(s, f) for f in _TRACE_FIELDS) + (arch.family.trace_key(arch, s),
                                                                             _trained_layout(arch, s),
                                                                             s.target_len is not None)
    prof = _PROFILES.get(key)
    if prof is None or prof.arch is not arch:
        prof = _profile(arch, s, P, cpu)
        if len(_PROFILES) > 8192:
            _PROFILES.clear()
        _PROFILES[key] = prof
    return prof


def _profile(arch: Architecture, s: TrainingSetup, P: _Params, cpu: bool) -> _Profile:
    """Trace one block (steady, first, dense) and the head at (b, s) = (1, 1) and (1, 2); an
    encoder-decoder's with a ``target_len`` at the five (s, t) of :data:`_TARGET_PROBES` (see
    :class:`_Profile`; without one its decoder reads s tokens: the two traces, as before)."""
    target = has_target(arch) and s.target_len is not None
    if target:
        probes = [_trace_all(arch, s, P, cpu, 1, sq, tq) for sq, tq in _TARGET_PROBES]

        def coeffs(*ys: float) -> Tuple[float, ...]:
            from fractions import Fraction

            fy = [Fraction(y) for y in ys]
            return tuple(float(sum(w * y for w, y in zip(row, fy))) for row in _TARGET_INV)
    else:
        probes = [_trace_all(arch, s, P, cpu, 1, 1), _trace_all(arch, s, P, cpu, 1, 2)]

        def coeffs(*ys: float) -> Tuple[float, ...]:
            x1, x2 = ys
            beta = (x2 - 2 * x1) / 2     # x(1,1) = a + b, x(1,2) = 2a + 4b
            return x1 - beta, beta
    one = probes[0]

    def field(key: str) -> Tuple[float, ...]:
        return coeffs(*(p[key] for p in probes))

    per_layer = []
    for ts in zip(*(p["per_layer"] for p in probes)):
        t1 = ts[0]
        assert all(t.name == t1.name for t in ts), "every probe traces the same tensors"
        per_layer.append((t1.name, t1.group, t1.dtype, t1.formula, coeffs(*(t.nbytes for t in ts)),
                          coeffs(*(t.numel for t in ts))))

    def alloc_ops(key: Any, src: str = "") -> List[Tuple[Any, ...]]:
        os_ = [p[src][key] if src else p[key] for p in probes]
        o1 = os_[0]
        out: List[Tuple[Any, ...]] = []
        for ops in zip(*(o[0] for o in os_)):
            kind, t1 = ops[0]
            if kind == "param":
                out.append(("param", t1))
            else:
                # a tensor the same size at every probe does not scale with the tokens: a weight's
                # transient (bitsandbytes' dequantized weight), a constant, not a*T + b*T2
                sizes = [t.numel for _, t in ops]
                const = all(n == sizes[0] for n in sizes)
                cn = t1.numel if const else 0.0
                coef = tuple(0.0 for _ in sizes) if const else coeffs(*sizes)
                saved = o1[1]
                out.append(("new", t1.name, t1.dtype, t1.rg, t1.name in saved, coef, t1.outlives,
                            t1.name in saved and t1.name in o1[2], cn, o1[3].get(t1.name, "")))
        return out

    if target:
        heads = [{name: nbytes for name, nbytes, _ in p["head"]} for p in probes]
        head = [(name, formula, coeffs(*(h[name] for h in heads))) for name, _, formula in one["head"]]
    else:
        # one sequence: every head tensor is linear in the tokens (bytes per token at b s = 1)
        head = [(name, formula, (nbytes,)) for name, nbytes, formula in one["head"]]
    return _Profile(arch=arch, per_layer=per_layer, per=field("per"), first=field("first"), dense=field("dense"),
                    recompute=[coeffs(*xs) for xs in zip(*(p["recompute"] for p in probes))],
                    head=head, backend=one["backend"], written=field("written"), ops=one["ops"],
                    head_written=field("head_written"), head_ops=one["head_ops"], head_packs=one["head_packs"],
                    alloc_ops=(alloc_ops("alloc_ops"), alloc_ops("alloc_ops_first")),
                    kind_alloc_ops={k: alloc_ops(k, "kind_alloc_ops") for k in one["kind_alloc_ops"]}, target=target)


def _trace_all(arch: Architecture, s: TrainingSetup, P: _Params, cpu: bool, b: int, sq: int,
               tq: Optional[int] = None) -> Dict[str, Any]:
    """Every block trace and the head's at batch ``b``, sequence ``sq`` and (an
    encoder-decoder's) target length ``tq``: its decoder blocks, output head and loss read
    b x tq tokens, its cross-attention b x tq x sq scores."""
    T = b * sq
    # the output head's tokens: the decoder's of an encoder-decoder
    Th = b * tq if tq is not None else T
    c = s.compute_dtype
    resid = _resid(s)
    norm_w = "float32" if (s.autocast or s.precision == "fp32" or (s.quantized and s.prepare_kbit)) else (
        s.weights_dtype if not s.quantized else c)
    # after prepare_model_for_kbit_training the residual stream is fp32, 4-bit linears return
    # their input's dtype and RoPE's cos/sin follow the hidden states: attention sees fp32
    backend = attention_backend(arch, s, "float32" if (s.quantized and s.prepare_kbit) else c)
    if cpu and backend in ("math", "efficient"):  # CPU SDPA: one flash-style kernel
        backend = "flash"
    full = s.method == "full"
    ctx = BlockContext(arch=arch, setup=s, T=T, b=b, s=sq, c=c, resid=resid, norm_w_dtype=norm_w,
                       linear_trains=full, norms_train=full or s.method == "norms", lora_modules=P.lora_modules,
                       adapter_dtype=P.adapter_dtype, attn_backend=backend, quant_base=s.quantized, cpu=cpu,
                       fused_qkv_lora=bool(behaviour(s.stack).get("fused_qkv_lora")),
                       enc_s=sq if tq is not None else 0)
    if s.method == "freeze":
        ctx.linear_trains = True
        ctx.norms_train = True
    # Does the first trained block's input need a gradient?  Full fine-tuning: the
    # embedding trains.  PEFT: only with checkpointing (enable_input_require_grads).
    # A trained embedding (modules_to_save, or LoRA on embed_tokens) makes it need one too.
    head_targets = _head_targets(s)
    embed_trains = "embed_tokens" in head_targets or "embed_tokens" in s.modules_to_save
    first_rg = full or (s.trains_adapters and s.gradient_checkpointing == "full") or embed_trains
    dense = bool(arch.dense_layers and arch.is_moe)
    layers = _trained_layers(arch, s)
    (first_kind, first_dense), others = layers[0], layers[1:]
    order = arch.family.layer_order(arch)
    kinds: Dict[Tuple[str, bool], Trace] = {}     # each kind's steady block, for the replay
    if order:
        tr, by_kind = _mixed_stack(ctx, order, [kind for kind, _ in others or layers], tq)
        kinds = {(kind, False): t for kind, t in by_kind.items()}
        recompute = [by_kind[kind] for kind in dict.fromkeys(kind for kind, _ in others or layers)]
    else:
        tr = trace_block(ctx, input_rg=True)
        recompute = [tr]
    tr_first = trace_block(kind_context(ctx, first_kind, tq), input_rg=first_rg, dense_layer=first_dense)
    dense_bytes = tr.total_bytes
    if dense:
        # the leading dense layers: the stack's first kind
        dkind = order[0] if order else ""
        tr_dense = trace_block(kind_context(ctx, dkind, tq), input_rg=True, dense_layer=True)
        dense_bytes = tr_dense.total_bytes
        kinds[(dkind, True)] = tr_dense
        if any(d for _, d in others):
            recompute.append(tr_dense)
    # the only trained layer is the first: the one a backward rebuilds is that block itself
    recompute_bytes = [t.total_bytes for t in (recompute if others else [tr_first])]
    # final norm + output head input
    htr = Trace()
    x = htr.new("final norm input", Th * arch.hidden_size, resid, True, "T x h", "output head")
    head_trains = full or (s.method == "freeze" and not arch.tie_word_embeddings) or "lm_head" in s.modules_to_save
    ctx_head = BlockContext(**{**ctx.__dict__, "linear_trains": head_trains, "quant_base": False,
                               "lora_modules": (), "T": Th, "s": tq if tq is not None else sq})
    n = arch.family.final_norm(htr, ctx_head, x)
    norm_packs = htr.packs
    if s.autocast or s.precision == "fp8":
        if head_trains or n.rg:
            n_c = htr.cast(n, c, "output head input cast")
            if head_trains:
                htr.save(n_c)
    elif head_trains:
        htr.save(n)
    if "lm_head" in head_targets:
        # peft LoRA on the head: its input cast to the adapter dtype and lora_A's output are
        # kept; DoRA also keeps the base output and the LoRA output (T x V each)
        r, a_dt, V = s.lora_r, P.adapter_dtype, arch.vocab_size
        htr.save(htr.cast(n, a_dt, "lm_head LoRA input as " + a_dt))
        htr.save(htr.new("lm_head lora_A output", Th * r, a_dt, True, f"T x r (r={r})", "output head"))
        if s.lora_variant == "dora":
            htr.save(htr.new("lm_head DoRA base output", Th * V, logits_dtype(arch, s), True, "T x V", "output head"))
            htr.save(htr.new("lm_head DoRA LoRA output", Th * V, a_dt, True, "T x V", "output head"))
    if embed_trains:
        # F.embedding keeps the token ids for its weight gradient
        htr.save(htr.new("token ids (embedding backward)", T, "int64", True, "T x 8 B (int64)", "embedding"))
    if "embed_tokens" in head_targets:
        # peft lora.Embedding: after_A = embedding(ids, lora_embedding_A.T) (T x r) is kept by
        # the product with lora_embedding_B
        htr.save(htr.new("embed_tokens LoRA after_A", T * s.lora_r, P.adapter_dtype, True, "T x r", "embedding"))
    head = [(t.name, t.nbytes, t.formula) for t in htr.saved.values()]
    head += arch.family.head_saved(arch, Th, full)
    return {"per_layer": list(tr.saved.values()), "per": tr.total_bytes, "first": tr_first.total_bytes,
            "dense": dense_bytes, "head": head, "backend": backend, "recompute": recompute_bytes,
            "written": tr.created_bytes, "ops": tr.created_ops,
            "head_written": htr.created_bytes, "head_ops": htr.created_ops, "head_packs": norm_packs,
            "alloc_ops": (tr.ops, set(tr.saved), tr.saved_by_producer, tr.stream),
            "alloc_ops_first": (tr_first.ops, set(tr_first.saved), tr_first.saved_by_producer, tr_first.stream),
            "kind_alloc_ops": {k: (t.ops, set(t.saved), t.saved_by_producer, t.stream) for k, t in kinds.items()}}


def _dora_weight_copies_per_layer(arch: Architecture, s: TrainingSetup, P: _Params) -> float:
    """What DoRA keeps per layer that does not scale with tokens (peft DoraLinearLayer.forward):
    the weight norm, ``mag_norm_scale`` and ``mag_norm_scale - 1`` (out each, fp32); with
    lora_dropout > 0 the base output is recomputed as F.linear(dropout(x), weight.to(x.dtype))
    and that linear keeps the adapter-dtype copy of the weight: out x in per adapted module."""
    if s.lora_variant != "dora" or not P.lora_modules or not arch.num_layers:
        return 0.0
    mods = arch.lora_tensors(P.lora_modules)
    # weight_norm, mag_norm_scale and mag_norm_scale - 1: three out-sized vectors per module
    vectors = 3 * sum(t.out_features * t.repeat for t in mods) / arch.num_layers
    copies = sum(t.numel for t in mods) / arch.num_layers if s.lora_dropout > 0 else 0.0
    return (vectors + copies) * DTYPE_BYTES[P.adapter_dtype]


def dora_norm_bytes(arch: Architecture, s: TrainingSetup, P: _Params) -> float:
    """DoRA's weight-norm working set while one adapted module runs (peft DoraLinearLayer:
    ``lora_B(lora_A(eye(in))).T`` keeps the in x in identity and in x r; the base weight cast
    to the adapter dtype, ``scaling * lora_weight`` and their sum are out x in each; a 4-bit
    base is first dequantized to 16 bits): the largest adapted module sets it."""
    if s.lora_variant != "dora" or not P.adapters:
        return 0.0
    a = DTYPE_BYTES[P.adapter_dtype]
    best = 0.0
    shapes = [(t.in_features, t.out_features) for t in arch.lora_tensors(P.lora_modules)] if P.lora_modules else []
    shapes += [(arch.hidden_size, arch.vocab_size) for m in _head_targets(s) if m == "lm_head"]
    for i, o in shapes:
        b = (i * i + i * s.lora_r + 4 * o * i) * a + (o * i * DTYPE_BYTES[s.compute_dtype] if s.quantized else 0)
        best = max(best, b)
    return best


def _head_targets(s: TrainingSetup) -> Tuple[str, ...]:
    """The LoRA targets outside the blocks (``lm_head``, ``embed_tokens``)."""
    return tuple(t for t in (s.lora_targets or ()) if t in HEAD_TARGETS) if s.trains_adapters else ()


def _trained_range(arch: Architecture, s: TrainingSetup) -> Tuple[int, int]:
    """(index of the first trained layer, trained layers): every layer, or under freeze the
    last ``trainable_layers`` (LlamaFactory's freeze tuning trains the top layers; _params)."""
    L = arch.num_layers
    k = min(s.trainable_layers, L) if s.method == "freeze" else L
    return L - k, k


def layer_key(arch: Architecture, order: Optional[List[str]], layer: int) -> Tuple[str, bool]:
    """Layer ``layer``'s block as (kind, dense): the kind from the family's layer order
    (``order``; "" where every block is alike), dense for a DeepSeek-style leading dense layer."""
    lead = arch.dense_layers if arch.is_moe else 0
    return (order[layer] if order and layer < len(order) else "", layer < lead)


def _trained_layers(arch: Architecture, s: TrainingSetup) -> List[Tuple[str, bool]]:
    """The trained layers in order, each as (kind, dense): the kind from the family's layer
    order ("" where every block is alike), dense for a DeepSeek-style leading dense layer."""
    first, k = _trained_range(arch, s)
    order = arch.family.layer_order(arch)
    return [layer_key(arch, order, j) for j in range(first, first + max(k, 1))]


def _trained_layout(arch: Architecture, s: TrainingSetup) -> Tuple[Any, ...]:
    """What of the trained layers' layout the block trace depends on (part of its cache key):
    the first one's kind, the other kinds' proportions, whether another one is dense."""
    layers = _trained_layers(arch, s)
    counts: Dict[str, int] = {}
    for kind, _ in layers[1:]:
        counts[kind] = counts.get(kind, 0) + 1
    g = 0
    for c in counts.values():
        g = math.gcd(g, c)
    return (layers[0], tuple((kd, c // g) for kd, c in counts.items()), any(d for _, d in layers[1:]))


def kind_context(ctx: BlockContext, kind: str, tq: Optional[int]) -> BlockContext:
    """``ctx`` for a block of ``kind``: a decoder block of an encoder-decoder (a kind of the
    family's ``target_kinds``) reads b x tq target tokens (its self-attention t x t, its
    cross-attention t x s over the encoder's ``enc_s``); the others ``ctx``'s own sizes."""
    if tq is not None and kind in ctx.arch.family.target_kinds:
        return replace(ctx, kind=kind, T=ctx.b * tq, s=tq)
    return replace(ctx, kind=kind)


def _mixed_stack(ctx: BlockContext, order: List[str], trained: List[str],
                 tq: Optional[int] = None) -> Tuple[Trace, Dict[str, Trace]]:
    """A stack of blocks of several kinds (a hybrid's linear-attention and attention layers,
    an encoder-decoder's two stacks): the average steady block, each kind's saved tensors
    weighted by its share of ``trained`` (the trained layers after the first, so the first +
    their count x the average is what they save together), and every kind's steady block.
    Its forward work (kernels, bytes written) is averaged over every layer of ``order``:
    frozen layers run their forward too.  ``tq``: an encoder-decoder's target length (its
    decoder blocks' tokens, see kind_context)."""
    n = len(trained)
    L = len(order)
    avg = Trace()
    blocks: Dict[str, Trace] = {}
    for kind in dict.fromkeys(order):
        trk = blocks[kind] = trace_block(kind_context(ctx, kind, tq), input_rg=True)
        count = trained.count(kind)
        if count:
            w = count / n
            for t in trk.saved.values():
                name = f"{t.name} ({kind}, {count} of {n} layers)"
                avg.saved[name] = SavedTensor(name, t.group, t.nbytes * w, t.dtype, t.numel * w, t.formula)
        share = order.count(kind) / L
        avg.created_ops += trk.created_ops * share
        avg.created_bytes += trk.created_bytes * share
    return avg, blocks


def logits_dtype(arch: Architecture, s: TrainingSetup) -> str:
    """The output head computes in the compute dtype under autocast, else in its weight's
    dtype (fp32 after prepare_model_for_kbit_training, which upcasts the head)."""
    if s.autocast:
        return s.compute_dtype
    if s.quantized:
        return "float32" if s.prepare_kbit else s.compute_dtype
    return s.weights_dtype


def logits_bytes(arch: Architecture, s: TrainingSetup, tokens: Any = None) -> Dict[str, float]:
    """The output head's logits and the loss: what is live at the loss's forward peak
    (name -> bytes; see :func:`loss_memory`)."""
    return {k: b for k, b, _ in loss_memory(arch, s, tokens)[0]}


#: Liger's fused linear cross-entropy: rows per chunk so that a chunk's logits match the input
#: (src/liger_kernel/ops/fused_linear_cross_entropy.py: inc_factor = cdiv(V, H),
#: chunk_size = next_power_of_2(cdiv(BT, inc_factor)))
def _liger_chunk_rows(T: int, V: int, h: int) -> int:
    inc = -(-V // h)
    rows = -(-T // inc)
    return min(T, 1 << max(0, (rows - 1).bit_length()))


def loss_memory(arch: Architecture, s: TrainingSetup, tokens: Any = None
                ) -> Tuple[List[Tuple[str, float, str]], List[Tuple[str, float, str]]]:
    """The output head's logits and the cross-entropy, in one place: (forward, backward).

    ``forward``: tensors live at the loss's forward peak; ``backward``: those live at the
    peak of the loss's backward (beside the blocks' saved activations).  T = b x s tokens,
    V vocabulary, c the logits' dtype, n = ``loss_chunks``.

    * ``standard`` (transformers ForCausalLMLoss): logits (T x V x c) held by the output,
      ``logits.float()`` (T x V x 4), log_softmax's fp32 output saved for backward; in
      backward nll_loss's and log_softmax's fp32 gradients beside it (3 x T x V x 4).
      Older transformers (``versions``): before 4.46 the model itself returns
      ``lm_head(h).float()`` (LlamaForCausalLM; the 16-bit logits are a transient) and
      before 4.49 the loss copies the shifted fp32 logits (``shift_logits =
      logits[..., :-1, :].contiguous()``; removed by transformers PR #35646).
      torchtune's models return ``output(h).float()`` too; LitGPT's loss does not upcast.
    * ``chunked`` (torchtune CEWithChunkedOutputLoss, LitGPT chunked_cross_entropy): the
      head runs per chunk, every chunk's 16-bit logits are kept, each chunk is upcast and
      log_softmax'ed alone: the fp32 upcast is T/n x V, but every chunk's log_softmax
      output is still saved (T x V x 4 in all); in backward one chunk's two gradients.
    * compiled cross-entropy (``compile=True``: torchtune compiles the loss): the upcast,
      log_softmax and nll_loss are one kernel
      that keeps only its input and a per-row logsumexp (T x 4) and writes the gradient of
      its input in backward (T x V in the input's dtype, per chunk when chunked).
    * ``liger`` (Liger FusedLinearCrossEntropy): no full logits. Rows are processed in
      chunks (cdiv(T, cdiv(V, h)) rounded up to a power of two); each chunk's logits
      (rows x V x c) get the softmax gradient in place, and the gradient of the head's
      input (T x h x c) and, if the head trains, of its weight (V x h) are computed in the
      forward pass and kept for backward.
    """
    bh = behaviour(s.stack)
    # ``tokens`` replaces b x s (an array of sizes for fit_map); an encoder-decoder's head and
    # loss read the decoder's b x t target tokens (T5ForConditionalGeneration.forward:
    # lm_logits = self.lm_head(sequence_output), the decoder's output; labels b x t)
    T, V, h = (s.batch_size * s.dec_len if tokens is None else tokens), arch.vocab_size, arch.hidden_size
    c = DTYPE_BYTES[logits_dtype(arch, s)]
    TV = T * V
    fwd: List[Tuple[str, float, str]] = []
    bwd: List[Tuple[str, float, str]] = []
    softcap = bool(arch.final_logit_softcapping)
    # a pipeline stage without the output head (parallel._slice: vocab_size 0) runs no
    # Liger kernel; the terms below are then T x V = 0 like the other losses'
    if s.loss == "liger" and V > 0:
        rows = _liger_chunk_rows(T, V, h)
        head_trains = s.method in ("full", "freeze") and not (s.method == "freeze" and arch.tie_word_embeddings)
        head_trains = head_trains or ("lm_head" in (s.modules_to_save or ()))
        fwd.append(("gradient of the head's input (Liger, kept)", T * h * c, f"T x h x {c:g} B"))
        if head_trains:
            fwd.append(("gradient of the head's weight (Liger)", V * h * c, f"V x h x {c:g} B"))
        fwd.append(("logits of one chunk of rows (Liger)", rows * V * c,
                    f"{rows} rows x V x {c:g} B (rows = next_pow2(T / ceil(V/h)))"))
        fwd.append(("per-token loss (fp32)", T * 4.0, "T x 4 B"))
        bwd = [x for x in fwd if "gradient" in x[0]]
        return fwd, bwd
    fused = s.compile
    upcast = bool(bh["loss_upcast"]) and arch.family.loss_upcast
    in_model = s.loss == "standard" and (bool(bh["logits_fp32_in_model"]) or s.before("transformers", "4.46"))
    d = 4.0 if upcast else c            # the dtype the cross-entropy runs in
    n = s.loss_chunks if s.loss == "chunked" else 1
    held = 4.0 if in_model else c       # the logits the caller holds while the loss runs
    if in_model:
        fwd.append(("logits upcast to fp32 in the model", TV * 4.0,
                    "T x V x 4 B (the model returns output(h).float())"))
    else:
        fwd.append(("logits", TV * c, (f"b x s x V ({s.batch_size} x {s.seq_len} x {V})" if s.target_len is None
                                       else f"b x t x V ({s.batch_size} x {s.target_len} x {V})") + f" x {c:g} B"
                    + (f", {n} chunks" if n > 1 else "")))
    if softcap:
        fwd.append(("soft-capped logits tanh", TV * c, "T x V (final_logit_softcapping)"))
    if fused:
        fwd.append(("per-row logsumexp (fused cross-entropy)", T * 4.0,
                    "T x 4 B: the fused kernel keeps its input and one fp32 value per row"))
        bwd.append(("logits kept by the fused cross-entropy", TV * held,
                    f"T x V x {held:g} B"))
        bwd.append(("gradient of the logits (fused cross-entropy)", TV * held / n,
                    f"T{'/' + str(n) if n > 1 else ''} x V x {held:g} B"))
        bwd += [x for x in fwd if x[0] == "soft-capped logits tanh"]
        return fwd, bwd
    shift_copy = s.loss == "standard" and s.before("transformers", "4.49") and not bh.get("no_shift_copy")
    if upcast and not in_model and c != 4:
        fwd.append(("logits upcast to fp32", TV * 4.0 / n,
                    "b x s x V x 4 B (HF loss calls logits.float())" if n == 1 else
                    f"T/{n} x V x 4 B (one chunk upcast at a time)"))
    if shift_copy:
        fwd.append(("shifted logits copy (fp32)", TV * 4.0, "T x V x 4 B (logits[..., :-1, :].contiguous())"))
    ls = "log_softmax output (fp32)" if d == 4 else "log_softmax output"
    fwd.append((ls, TV * d, f"b x s x V x {d:g} B (cross_entropy keeps it for backward)"
                + (f", every chunk's" if n > 1 else "")))
    bwd.append((ls + ", saved", TV * d, f"T x V x {d:g} B"))
    bwd.append(("gradient of log_softmax output" + (" (fp32)" if d == 4 else ""), TV * d / n,
                f"T{'/' + str(n) if n > 1 else ''} x V x {d:g} B (nll_loss backward)"))
    bwd.append(("gradient of logits" + (" (fp32)" if d == 4 else ""), TV * d / n,
                f"T{'/' + str(n) if n > 1 else ''} x V x {d:g} B (log_softmax backward)"))
    bwd += [(k + " (saved)", b, f) for k, b, f in fwd if k == "soft-capped logits tanh"]
    return fwd, bwd


# ----------------------------------------------------------------------------------
# The estimate
# ----------------------------------------------------------------------------------

def estimate_setup(arch: Architecture, s: TrainingSetup, gpu: Any = None) -> Estimate:
    """The estimate for an already-resolved architecture and validated setup.

    The totals are computed here; the component trees (one per phase, every tensor with
    its formula) are built on first access of ``Estimate.components``.
    """
    return _estimate(arch, s, gpu=gpu)


def size_grid_totals(arch: Architecture, s: TrainingSetup, b: Any, sq: Any,
                     mx: Callable[..., Any], reserved: bool = True, gpu: Any = None) -> Dict[str, Any]:
    """The totals of ``s`` at every (batch ``b``, sequence ``sq``) of two broadcastable
    arrays, computed by the very operations :func:`estimate_setup` does for one size
    (``mx``: an element-wise max of any number of arrays): ``phases`` (forward, backward,
    optimizer_step, first_step, ...), ``peak_allocated_bytes``, ``reserved_bytes`` and
    ``cuda_context_bytes`` (``gpu``'s own, :func:`vramwidget.gpus.context_for`; the H200's
    without one).  Saved activations are exact polynomials in b and s (see
    :class:`_Profile`), so one trace serves the whole grid.  ``reserved=False`` leaves out
    ``reserved_bytes`` (one allocator replay per cell: ``fitmap`` chooses the cells)."""
    return _estimate(arch, s, gpu=gpu, sizes=(b, sq), mx=mx, grid_reserved=reserved)


def _estimate(arch: Architecture, s: TrainingSetup, gpu: Any = None, sizes: Optional[Tuple[Any, Any]] = None,
              mx: Callable[..., Any] = max, grid_reserved: bool = True) -> Any:
    """estimate_setup's body; with ``sizes`` it stops at the totals (see size_grid_totals)."""
    if s.trains_adapters and s.lora_targets:
        resolve_targets(arch, s.lora_targets)
    P = _params(arch, s)
    if s.method in ("lora", "qlora") and not P.adapters:
        raise VramError(f"lora_targets: none of the targets are linear layers of {arch.name}", field="lora_targets")
    # the output head's and the loss's tokens: an encoder-decoder's b x target_len (a grid of
    # sizes varies seq_len, a given target_len stays fixed)
    T = s.batch_size * s.dec_len if sizes is None else sizes[0] * (
        s.target_len if s.target_len is not None else sizes[1])
    gc = gc_mode(s)
    _check_knobs(arch, s)

    # -- model states ---------------------------------------------------------------------
    w_bytes = (sum(w[2] for w in P.weights) + sum(q[1] for q in P.quant_consts) + sum(a[2] for a in P.adapters))
    # dequantization scratch: a 4-bit Linear dequantizes its weight for each matmul
    deq = 0.0
    if P.quant_consts:
        deq = max(t.numel_each for t, _, _ in P.quant_consts) * DTYPE_BYTES[s.compute_dtype]
    grads = Node("gradients")
    for name, group, numel, dtype, _each in P.trainable_tensors:
        _add_to_group(grads, group, numel * DTYPE_BYTES[dtype], numel, dtype, f"n x {DTYPE_BYTES[dtype]:g} B ({dtype})")
    grads.finalize()
    states = optimizer_states(P, s)
    states_bytes = sum(n.total_bytes() for n in states)
    temps = optimizer_temporaries(P, s)
    temps.finalize()
    cast_cache = _autocast_cache(arch, s, P)
    cache_bytes = cast_cache.bytes
    # Under checkpointing the blocks' saved tensors (and with them their cached bf16 weight
    # copies) are dropped after forward; only the head's copy is still saved in backward.
    head_cache = sum(c.bytes for c in cast_cache.children if c.name in ("output head", "embedding"))
    bwd_cache = head_cache if gc else cache_bytes

    # -- activations and logits ---------------------------------------------------------------
    A = _activations(arch, s, P, sizes=sizes, mx=mx)
    L_save = A.n_saving_layers
    head_acts = sum(n for _, n, _ in A.head)
    if gc:
        layer_acts = A.checkpoint_bytes_per_layer * L_save
    else:
        layer_acts = A.layers_bytes
    offloaded = 0.0
    if s.activation_offloading:
        offloaded, layer_acts = _offload(A, layer_acts, gc)
    tower_acts = sum(n for _, n, _ in A.tower)
    acts_bytes = layer_acts + head_acts + tower_acts
    loss_fwd, loss_bwd_items = loss_memory(arch, s, T if sizes is not None else None)
    lg = {k: b for k, b, _ in loss_fwd}
    logits_fwd_bytes = sum(lg.values())

    # -- phases -------------------------------------------------------------------------------
    base = w_bytes + CUBLAS_WORKSPACE_BYTES
    persistent = base + states_bytes
    grads_bytes = grads.bytes
    accum_grads = grads_bytes if s.grad_accum_steps > 1 else 0.0
    # forward: saved activations + the loss's working set (or a recomputed layer under gc)
    recompute = A.recompute_layer_bytes if gc else 0.0   # one block's saved tensors, rebuilt in backward
    # DoRA computes each adapted weight's norm in the forward pass (and again when a
    # checkpointed layer is recomputed in backward)
    dora_tmp = dora_norm_bytes(arch, s, P)
    fwd_extra = mx(mx(logits_fwd_bytes, dora_tmp), mx(recompute, A.first_layer_bytes) if gc else 0.0)
    forward = persistent + accum_grads + cache_bytes + acts_bytes + fwd_extra + deq

    # backward: the loss gradient, then the layers one by one; the phase's peak is the
    # largest of these events (each lists what is live beside the persistent state).
    loss_bwd = sum(b for _, b, _ in loss_bwd_items)
    head_grad = sum(g for n, g in _head_grad_bytes(P, arch))
    embed_grad = _embed_grad_bytes(P, arch)
    layer_grad = (grads_bytes - head_grad) / max(arch.num_layers, 1)
    cache_per_layer = cache_bytes / max(arch.num_layers, 1)
    work = A.transient_layer_bytes + deq + (dora_tmp if gc else 0.0)
    if s.optimizer_in_backward:
        # each parameter steps in its post-accumulate-grad hook and its gradient is freed:
        # at most one parameter's gradient (+ that step's temporaries) is ever live
        live = _step_in_backward_bytes(P, s)
        head_grad = layer_grad = embed_grad_live = 0.0
        grads_live_first = grads_live_end = live
        head_grad = live
    else:
        # a tied head and embedding: the head's gradient waits in autograd's input buffer for the
        # embedding's; the engine adds the two in place only into a plain tensor it holds the last
        # reference to (torch/csrc/autograd/input_buffer.cpp, ``can_accumulate_inplace``).  The
        # head's weight gradient is a transposed view of its mm (linear's backward), so the sum
        # is a third V x h tensor; under autocast it arrives as the fp32 cast of that (a plain
        # tensor) and the embedding's is added into it (checked on the CPU: aten::add vs add_)
        embed_grad_live = (embed_grad * (1 if s.autocast else 2)) if arch.tie_word_embeddings else 0.0
        grads_live_first = grads_bytes - embed_grad - layer_grad * 2 / 3
        grads_live_end = grads_bytes
    ev = {
        # the loss: three fp32 T x V tensors beside every saved activation
        "loss backward": acts_bytes + loss_bwd + bwd_cache + accum_grads,
        # the last block, first in backward: all its activations are still there
        "last layer's backward": (acts_bytes - head_acts) + recompute + max(head_grad + layer_grad / 3, accum_grads)
        + bwd_cache + work,
        # the first block, last in backward: every gradient but the embedding's and most of its own
        # (under checkpointing it is the first block itself that is recomputed: a dense block in
        # DeepSeek-style MoE models, the same as the others elsewhere)
        "first layer's backward": (A.checkpoint_bytes_per_layer + A.first_layer_bytes if gc else A.first_layer_bytes)
        + max(grads_live_first, accum_grads)
        # autocast's 16-bit weight copies live only as saved tensors once forward's autocast
        # context exits (torch.autocast.__exit__ clears the cache): here the first block's own,
        # from forward or (checkpointing) from its recomputation, which re-enters autocast;
        # the head's copy went with the head's backward, long before
        + cache_per_layer + work,
        "end of backward": max(grads_live_end, accum_grads) + embed_grad_live,
    }
    backward = persistent + mx(*ev.values())
    optimizer = persistent + (grads_live_end if s.optimizer_in_backward else grads_bytes + temps.bytes)
    phases = {"after_load": base, "forward": forward, "backward": backward, "optimizer_step": optimizer}
    peak = mx(forward, backward, optimizer)
    phases["first_step"] = mx(forward - states_bytes, backward - states_bytes, optimizer)
    phases["persistent"] = persistent
    # the chosen card's CUDA context (the H200's without a GPU): gpus.context_for, the one
    # place it is chosen; Estimate.set_gpu below keeps it with the card
    context = context_for(get_gpu(gpu) if gpu is not None else None)[0]
    if sizes is not None:  # a grid of sizes: the totals only (a replay per cell for reserved memory)
        out = {"phases": phases, "peak_allocated_bytes": peak, "cuda_context_bytes": context}
        if grid_reserved:
            out["reserved_bytes"] = _grid_reserved(arch, s, sizes, peak)
        return out
    bwd_event = max(ev, key=ev.get)
    peak_phase = max(("forward", "backward", "optimizer_step"), key=lambda p: phases[p])

    def reserved() -> float:
        """max_memory_reserved(): the caching allocator replayed over the run (events.py)."""
        return ALLOCATOR_REPLAY["reserved"](arch, s, peak)

    notes: List[str] = list(arch.family.notes(arch))
    if not arch.exact:
        notes.append(arch.assumption)
    if A.backend == "math":
        notes.append("SDPA falls back to the math kernel here (fp32 with grouped KV heads): "
                     "the b x a x s x s probabilities are kept for every layer")
    if A.backend == "eager":
        why = "" if s.attn_implementation == "eager" else (
            f"attn_implementation={s.attn_implementation!r} is not what runs: transformers has no SDPA path for "
            f"this model ({'logit soft-capping' if arch.attn_logit_softcapping else arch.model_type}) and runs "
            "it eager; ")
        notes.append(why + "eager attention keeps fp32 and 16-bit b x a x s x s probabilities for every layer")
    if s.optimizer.startswith("paged"):
        notes.append("paged optimizer states live in unified memory and move to the CPU under memory pressure")
    if s.precision == "fp8":
        notes.append("fp8: linear inputs saved as fp8 copies (torchao-style); derived, not measured")
    if offloaded:
        notes.append(f"activation offloading keeps {offloaded / 2**30:.2f} GiB of saved activations in CPU memory")
    if s.optimizer_in_backward:
        notes.append("optimizer in backward: each parameter is stepped as its gradient is ready (no full gradient "
                     "set; no gradient accumulation or clipping)")
    notes.extend(unusual_input_notes(arch, s))
    notes.extend(_unquantized_notes(arch, s, P))
    notes.append(_versions_note(s))
    flops, overhead = _flops(arch, s, P)

    def build() -> Tuple[List[Node], Dict[str, List[Node]]]:
        """Every phase's component tree (component > module group > tensor, with formulas)."""
        weights = Node("weights")
        for t, dtype, nbytes, trains in P.weights:
            _child(weights, t.group).add(Node(
                t.name, bytes=nbytes, dtype=dtype, count=t.numel,
                formula=f"{t.repeat} x {' x '.join(map(str, t.shape))} x {DTYPE_BYTES[dtype]:g} B ({dtype})"))
        qconst = Node("quantization constants")
        for t, nbytes, formula in P.quant_consts:
            _child(qconst, t.group).add(Node(t.name, bytes=nbytes, formula=formula))
        adapters = Node("adapters")
        for module, group, nbytes, numel in P.adapters:
            adapters.add(Node(f"{module} lora_A + lora_B", bytes=nbytes, count=numel, dtype=P.adapter_dtype,
                              formula=f"r x (in + out) x layers x {DTYPE_BYTES[P.adapter_dtype]:g} B "
                                    f"(r={s.lora_r}, {P.adapter_dtype})"))
        workspace = Node("workspace", children=[Node(
            "cuBLAS workspace", bytes=CUBLAS_WORKSPACE_BYTES,
            formula="cuBLAS + cuBLASLt workspaces, 64 MiB (measured, H200, PyTorch 2.11)")])
        acts = Node("activations")
        if s.activation_offloading:
            acts.add(Node("saved tensors still on the GPU (the rest offloaded)", bytes=layer_acts,
                          formula=("the 5 most recent checkpointed layer inputs (forward stash)" if gc else
                                   "one block's saved tensors (in flight to or from the CPU)")))
        elif gc:
            acts.add(Node(f"layer inputs kept by checkpointing ({L_save} layers)", bytes=layer_acts,
                          formula=f"{L_save} x T x h x {DTYPE_BYTES[_resid(s)]:g} B"))
        else:
            groups: Dict[str, Node] = {}
            for t in A.per_layer:
                g = groups.get(t.group)
                if g is None:
                    g = groups[t.group] = acts.add(Node(t.group))
                g.add(Node(t.name, bytes=t.nbytes * (L_save - 1), dtype=t.dtype, count=int(t.numel * (L_save - 1)),
                           formula=f"{L_save - 1} layers x {t.formula} x {DTYPE_BYTES[t.dtype]:g} B"))
            acts.add(Node("first trained layer", bytes=A.first_layer_bytes,
                          formula="the first block's saved tensors (its input may need no gradient)"))
        for name, nbytes, formula in A.head:
            _child(acts, "output head").add(Node(name, bytes=nbytes, formula=formula))
        for name, nbytes, formula in A.tower:
            _child(acts, "vision tower").add(Node(name, bytes=nbytes, formula=formula))
        logits_fwd = Node("logits and loss", children=[Node(k, bytes=v, formula=f) for k, v, f in loss_fwd])
        state_node = Node("optimizer states", children=list(states))

        def grads_part(nbytes: float, formula: str) -> Node:
            """Gradients allocated so far, split by module group in proportion."""
            nbytes = max(nbytes, accum_grads)
            node = Node("gradients", formula=formula)
            scale = nbytes / grads_bytes if grads_bytes else 0.0
            for c in grads.children:
                node.add(Node(c.name, bytes=c.bytes * scale, dtype=c.dtype, formula=c.formula))
            return node

        def cache_part(nbytes: float) -> Node:
            return Node("weights", children=[Node(cast_cache.name, bytes=nbytes,
                                                  formula="16-bit weight copies still saved for backward")])

        def work_part() -> List[Node]:
            return [Node("activations", children=[
                Node("backward working buffers", bytes=A.transient_layer_bytes,
                     formula="2 x T x i + T x h gradient buffers of one layer"),
                Node("DoRA weight-norm working set (recomputed layer)", bytes=dora_tmp if gc else 0.0,
                     formula="in x in identity + in x r + 4 x out x in (adapter dtype), largest adapted module")]),
                    _deq_node(deq)]

        recomputed = Node("recomputed layer (checkpointing)", bytes=recompute,
                          formula="one block's saved tensors, rebuilt for its backward")
        if bwd_event == "loss backward":
            bwd = [acts, Node("logits and loss", children=[Node(k, bytes=v, formula=f)
                                                           for k, v, f in loss_bwd_items]),
                cache_part(bwd_cache), grads_part(0.0, "accumulated gradients")]
        elif bwd_event == "last layer's backward":
            bwd = [Node("activations", children=[
                Node("saved activations of all layers", bytes=acts_bytes - head_acts,
                     formula="every block's saved tensors (or checkpoints)"), recomputed]),
                grads_part(head_grad + layer_grad / 3, "output head + the last block's first gradients"),
                cache_part(bwd_cache)] + work_part()
        elif bwd_event == "first layer's backward":
            bwd = [Node("activations", children=[
                Node("first block's saved tensors" + (" (recomputed)" if gc else ""), bytes=A.first_layer_bytes,
                     formula="the first block's saved tensors" + (", rebuilt for its backward" if gc else "")),
                Node("first block's checkpointed input", bytes=A.checkpoint_bytes_per_layer if gc else 0.0,
                     formula="T x h")]),
                grads_part(grads_bytes - embed_grad - layer_grad * 2 / 3,
                           "all gradients but the embedding's and most of the first block's"),
                cache_part(cache_per_layer)] + work_part()
        else:
            bwd = [grads_part(grads_bytes, "every gradient"),
                   Node("activations", children=[Node("embedding gradient being accumulated",
                                                      bytes=embed_grad_live,
                                                      formula="V x h (tied head and embedding: two contributions"
                                                      + (", added in place)" if s.autocast else
                                                         ", added out of place: 2 x V x h beside the sum)"))])]
        fwd = [weights, qconst, adapters, state_node, acts, logits_fwd,
               Node("weights", children=[cast_cache]), _deq_node(deq), workspace]
        if accum_grads:
            fwd.append(grads)
        rec_part = max(recompute, A.first_layer_bytes) if gc else 0.0
        if gc and rec_part >= dora_tmp:
            fwd.append(Node("activations", children=[Node(
                "recomputed layer", formula="one block's tensors while it runs",
                bytes=max(0.0, fwd_extra - logits_fwd_bytes))]))
        elif dora_tmp:
            fwd.append(Node("activations", children=[Node(
                "DoRA weight-norm working set", formula="in x in identity + in x r + 4 x out x in (adapter dtype), "
                "largest adapted module", bytes=max(0.0, fwd_extra - logits_fwd_bytes))]))
        phase_components = {
            "after_load": _finish([weights, qconst, adapters, workspace]),
            "forward": _finish(fwd),
            "backward": _finish([weights, qconst, adapters, state_node] + bwd + [workspace]),
            "optimizer_step": _finish([weights, qconst, adapters, state_node, grads, temps, workspace]),
        }
        return None, phase_components    # the peak's list: components_at (it needs the reserve)

    def components_at(reserved_value: float, exact: bool = True) -> List[Node]:
        """The peak phase's components plus the allocator reserve at ``reserved_value`` (the
        replayed one for ``Estimate.components``; a provisional one for
        ``Estimate.provisional_components``) and the CUDA context."""
        formula = ("caching allocator: cached free blocks and rounding when reserved memory peaks "
                   "(replay of CUDACachingAllocator over this run's allocations)")
        if not exact:
            formula = ("provisional, the replay has not run yet: allocated peak x the reserved / allocated "
                       "ratio of the nearest replayed size of this setup (events.provisional_reserved_bytes)")
        return list(est.phase_components[peak_phase]) + [
            Node("allocator reserve", bytes=max(0.0, reserved_value - peak), formula=formula),
            Node("cuda context", bytes=est.cuda_context_bytes, formula=est.cuda_context_source),
        ]

    def work() -> Any:
        """The step's work for the step time (timing.py), computed when first asked for."""
        from .timing import step_work

        return step_work(arch, s, P, A, lg, logits_dtype(arch, s), lambda d: _state_dtypes(s, d),
                         offloaded_bytes=offloaded)

    est = Estimate(model_name=arch.name, setup=s.to_dict(), params_total=arch.params_total,
                   params_trainable=P.trainable_numel, components=None, phases_bytes=phases,
                   peak_phase=peak_phase, peak_allocated_bytes=peak, reserved_bytes=reserved,
                   cuda_context_bytes=context, flops_per_step=flops, recompute_overhead=overhead,
                   notes=notes, builder=build)
    est._work = work
    est._setup_obj = s
    est._replay_fn = lambda capacity_bytes=None, record=False: ALLOCATOR_REPLAY["replay"](arch, s, capacity_bytes,
                                                                                         record)
    est._provisional_fn = lambda: ALLOCATOR_REPLAY["provisional"](arch, s, peak)
    est._components_at = components_at
    # on a card the reserve is judged with the allocator's free-and-retry at its limit
    # (gpus.judge_on: a replay with the card's capacity when the unlimited reserve is over it)
    est.capacity_judged = True
    est._replayed = (arch, s)        # what the replay runs (gpus.judge_on caches capacity replays by it)
    est._reserved_from_replay = lambda res: ALLOCATOR_REPLAY["reserved_of"](s, res, peak)
    if gpu is not None:
        est.set_gpu(gpu)
    return est


#: torchtune OffloadActivations: max_fwd_stash_size (pack ids whose GPU copy waits for its
#: transfer; tensors under min_offload_size, 1 KiB, stay on the GPU)
OFFLOAD_FWD_STASH = 5
#: pack calls of one checkpointed layer: non-reentrant torch.utils.checkpoint saves its inputs
#: through _NoopSaveInputs (torch/utils/checkpoint.py): an empty placeholder tensor and the
#: layer input (keyword arguments such as masks are kept by reference, not packed)
CHECKPOINT_PACKS_PER_LAYER = 2


def _offload(A: _Acts, layer_acts: float, gc: bool) -> Tuple[float, float]:
    """Activation offloading: (bytes moved to the CPU, bytes still on the GPU).

    torchtune ``OffloadActivations`` (torchtune/training/_activation_offloading.py, which
    TRL's ``activation_offloading`` copies) gives every saved tensor a pack id and copies
    those of at least 1 KiB that are not parameters to pinned CPU memory; the GPU copy
    stays in a forward stash until a tensor 5 ids newer is offloaded (``pack_tensor``: ids
    <= id - max_fwd_stash_size leave the stash).  In backward each tensor is brought back
    just before its node runs.  The output head is excluded (a NoOpManager around
    ``model.output``), so the head's tensors and the logits stay.

    What is still on the GPU at the end of the forward is that stash.  Under full
    checkpointing the ids are each layer's two packs (placeholder + input), then the final
    norm's (``head_packs``: an fp32-upcast RMSNorm packs its fp32 input and its rsqrt twice
    each, plus the normalised tensor when its weight trains).  Those norm tensors are counted
    in the head's activations (not offloaded here); the layer inputs among the 5 newest ids
    stay beside them: Llama with LoRA (4 norm packs) keeps the last layer's input, full
    fine-tuning (5) keeps none.  The recomputed layer is not packed (backward runs outside
    the context).  Without checkpointing about one block's saved tensors wait in the stash.
    Unsloth's offloaded checkpointing moves the same layer inputs.
    """
    if gc:
        free_ids = max(OFFLOAD_FWD_STASH - A.head_packs, 0)
        inputs = min(math.ceil(free_ids / CHECKPOINT_PACKS_PER_LAYER), A.n_saving_layers)
        kept = inputs * A.checkpoint_bytes_per_layer
    else:
        kept = A.per_layer_bytes
    kept = min(kept, layer_acts)
    return layer_acts - kept, kept


def _step_in_backward_bytes(P: _Params, s: TrainingSetup) -> float:
    """Optimizer in backward (torchtune ``optimizer_in_bwd``: one optimizer per parameter,
    stepped in a ``register_post_accumulate_grad_hook`` hook that then calls ``zero_grad``:
    torchtune/training/memory.py ``register_optim_in_bwd_hooks``):
    the largest parameter's gradient plus what its step allocates (foreach AdamW: one
    state-sized sqrt(exp_avg_sq) of that parameter)."""
    g = 0.0
    for name, group, numel, dtype, each in P.trainable_tensors:
        b = each * DTYPE_BYTES[dtype]
        if s.optimizer in ("adamw", "galore_adamw"):
            b += each * DTYPE_BYTES[_state_dtypes(s, dtype)[1]] if s.optimizer == "adamw" else 0.0
        g = max(g, b)
    return g


def unusual_input_notes(arch: Architecture, s: TrainingSetup) -> List[str]:
    """Warnings for legal but unusual input: it is estimated, and the note says why it may
    not be what the user meant (the widget shows them beside the estimate)."""
    out = []
    pos = arch.max_position_embeddings
    if pos and s.seq_len > pos:
        learned = any(t.role == "position_embedding" for t in arch.tensors)
        out.append(f"warning: seq_len {s.seq_len:,} is beyond {arch.name}'s {pos:,} positions from training ("
                   + ("its learned position table has no row past that: the model cannot run it as is"
                      if learned else "it was not trained that long: RoPE scaling or a longer-context model")
                   + "); memory estimated anyway")
    if s.trains_adapters and s.lora_r > arch.hidden_size:
        out.append(f"warning: lora_r {s.lora_r:,} is above the hidden size {arch.hidden_size:,}: an adapter's rank "
                   f"cannot exceed min(in, out) features, so the extra rank adds memory and no capacity")
    return out


def _unquantized_notes(arch: Architecture, s: TrainingSetup, P: _Params) -> List[str]:
    """Where a "quantized" base keeps weights in 16 or 32 bits, and why.

    transformers' ``replace_with_bnb_linear`` (integrations/bitsandbytes.py) swaps only
    ``nn.Linear``/``Conv1D`` modules for bitsandbytes ones, and the 4-bit quantizer's
    ``param_needs_quantization`` (quantizers/quantizer_bnb_4bit.py) only their weights:
    fused MoE experts (``MixtralExperts.gate_up_proj``/``down_proj``, 3-D ``nn.Parameter``)
    stay in the load dtype.  peft's ``prepare_model_for_kbit_training`` (utils/other.py)
    then casts every fp16/bf16 parameter that is not ``Params4bit`` to fp32.  Both read in
    transformers 5.23 and peft 0.21.
    """
    if not s.quantized:
        return []
    qtypes = ("nf4", "fp4", "int8")
    experts = sum(nb for t, dt, nb, _ in P.weights if t.experts and dt not in qtypes)
    rest = sum(nb for t, dt, nb, _ in P.weights if dt not in qtypes)
    out = []
    dt = "fp32" if s.prepare_kbit else "16-bit"
    if experts:
        out.append(f"4-bit loading leaves the fused MoE expert weights unquantized ({experts / 2**30:.2f} GiB in {dt}): "
                   f"bitsandbytes replaces only nn.Linear modules and the experts are 3-D parameters"
                   + ("; prepare_model_for_kbit_training upcasts them to fp32" if s.prepare_kbit else ""))
    whole16 = sum(t.numel for t in arch.tensors) * 2.0
    if s.prepare_kbit and sum(nb for _, _, nb, _ in P.weights) > whole16:
        out.append(f"prepare_model_for_kbit_training upcasts every unquantized parameter to fp32 ({rest / 2**30:.2f} GiB): "
                   f"this base is larger than the whole model in 16 bits ({whole16 / 2**30:.2f} GiB); "
                   f"prepare_kbit=False or more quantized_groups keep it smaller")
    return out


def _versions_note(s: TrainingSetup) -> str:
    """Which library releases the estimate assumes."""
    named = dict(s.versions)
    parts = [f"{k} {v}" for k, v in sorted(named.items())]
    rest = [k for k in ("transformers", "peft", "bitsandbytes") if k not in named]
    txt = "versions: " + (", ".join(parts) + "; " if parts else "")
    return txt + "current releases of " + ", ".join(rest) if rest else txt.rstrip("; ")


def _check_knobs(arch: Architecture, s: TrainingSetup) -> None:
    """Knobs that the estimator refuses rather than guess, with the reason."""
    check_target_len(arch, s)
    if s.compile and s.gradient_checkpointing != "full":
        raise VramError("compile: without full activation checkpointing, which tensors inductor's partitioner "
                        "saves in each block depends on its recompute heuristics and is not modelled; use "
                        "gradient_checkpointing='full' (then only the loss's fusion matters) or compile=False",
                        field="compile")
    if s.packing and not behaviour(s.stack).get("packed_sdpa") and s.attn_implementation != "flash_attention_2":
        raise VramError("packing: transformers' padding-free path (DataCollatorWithFlattening, TRL padding_free) "
                        "runs FlashAttention's varlen kernel; set attn_implementation='flash_attention_2' (SDPA "
                        "would need a b x s x s block mask)", field="packing")
    if s.loss == "liger" and "lm_head" in _head_targets(s):
        raise VramError("loss: Liger's fused linear cross-entropy multiplies by lm_head.weight itself, so a LoRA "
                        "on lm_head is not applied there; drop 'lm_head' from lora_targets or use another loss",
                        field="loss")


def check_target_len(arch: Architecture, s: TrainingSetup) -> None:
    """``target_len`` is the decoder's length of a model with a decoder stack separate from
    its encoder (T5, BART: :func:`has_target`); anywhere else it is refused."""
    if s.target_len is None or has_target(arch):
        return
    what = "an encoder (no decoder)" if arch.family.encoder_decoder or arch.task in ("encoder", "masked_lm") \
        else "decoder-only"
    raise VramError(f"target_len: {arch.name} is {what}; its sequence is seq_len", field="target_len")


def _grid_reserved(arch: Architecture, s: TrainingSetup, sizes: Tuple[Any, Any], peak: Any) -> Any:
    """Reserved memory at every (batch, sequence) of a grid: one allocator replay per cell
    (numpy arrays in, an array out; the cells are the setups ``estimate_setup`` would see)."""
    import numpy as np

    b, sq, pk = np.broadcast_arrays(np.asarray(sizes[0]), np.asarray(sizes[1]), np.asarray(peak, dtype=float))
    out = np.empty(b.shape, dtype=float)
    for i in np.ndindex(b.shape):
        cell = s.replace(batch_size=int(b[i]), seq_len=int(sq[i]))
        out[i] = ALLOCATOR_REPLAY["reserved"](arch, cell, float(pk[i]))
    return out


def _autocast_cache(arch: Architecture, s: TrainingSetup, P: _Params) -> Node:
    """Autocast casts each fp32 matmul weight to 16 bits once per forward and caches the
    copy; the matmuls save it for backward (leaf tensors only: weights, not activations).

    Autocast caches only leaves that require grad (aten/src/ATen/autocast_mode.cpp,
    ``cached_cast``: ``arg.requires_grad() && arg.is_leaf()``).  A frozen fp32 weight (the
    base under LoRA) is cast afresh at each use; without checkpointing the matmul saves that
    copy for backward, so it lives as long as a cached one, but under full checkpointing the
    saved copy is dropped with the block's other saved tensors and exists only while its block
    runs: it is not held here.  The blocks below the first trained one (``method="freeze"``)
    run outside autograd's graph (nothing in them, nor their input, requires grad): their
    matmuls save nothing, so their weights' copies exist only while each runs."""
    name = "bf16 weight copies (autocast cache)" if s.compute_dtype == "bfloat16" else \
        "fp16 weight copies (autocast cache)"
    node = Node(name)
    first_train, _ = _trained_range(arch, s)
    if s.autocast:
        for t, dtype, nbytes, trains in P.weights:
            if not trains and gc_mode(s) and t.layers is not None:
                continue  # a frozen block weight's copy is recomputed with its block
            if not trains and t.layers is not None and t.layers[1] < first_train:
                continue  # a block below the trained ones keeps no copy
            if (t.linear or t.role == "output_head" or (t.role == "embedding" and arch.tie_word_embeddings)) \
                    and not t.is_bias and dtype == "float32":
                _add_to_group(node, t.group, t.numel * DTYPE_BYTES[s.compute_dtype], t.numel, s.compute_dtype,
                              "matmul weights cast once per forward and kept for backward")
    node.finalize()
    return node


def gc_mode(s: TrainingSetup) -> bool:
    """Whether full activation checkpointing is on."""
    return s.gradient_checkpointing == "full"


def _resid(s: TrainingSetup) -> str:
    if s.autocast or (s.quantized and s.prepare_kbit):
        return "float32"
    return s.weights_dtype if not s.quantized else s.compute_dtype


def _head_grad_bytes(P: _Params, arch: Architecture) -> List[Tuple[str, float]]:
    out = []
    for t, dtype, nbytes, trains in P.weights:
        if trains and t.layers is None:
            out.append((t.name, t.numel * DTYPE_BYTES[dtype]))
    return out


def _embed_grad_bytes(P: _Params, arch: Architecture) -> float:
    for t, dtype, nbytes, trains in P.weights:
        if trains and t.role == "embedding":
            return t.numel * DTYPE_BYTES[dtype]
    return 0.0


def _deq_node(deq: float) -> Node:
    return Node("quantization constants", children=[Node("dequantized weight (transient)", bytes=deq,
                                                          formula="largest 4-bit linear as 16-bit while it runs")])


def _child(parent: Node, name: str) -> Node:
    for c in parent.children:
        if c.name == name:
            return c
    return parent.add(Node(name))


def _merge_named(nodes: List[Node]) -> List[Node]:
    """Merge top-level nodes of the same name (e.g. two 'weights' entries)."""
    from .result import COMPONENT_KINDS

    merged: Dict[str, Node] = {}
    for n in nodes:
        if n.bytes <= 0:
            continue
        key = n.name
        if key in merged:
            merged[key].children.extend(n.children if n.children else [n])
            merged[key].bytes += n.bytes
        else:
            merged[key] = Node(key, bytes=n.bytes, formula=n.formula, children=list(n.children))
    order = {k: i for i, k in enumerate(COMPONENT_KINDS)}
    return sorted(merged.values(), key=lambda n: order.get(n.name, 99))


def _finish(nodes: List[Node]) -> List[Node]:
    """Finalize (idempotent: parents = sum of children) and merge same-named components.
    Phases share subtrees (the weights node is the same object in every phase)."""
    out = []
    for n in nodes:
        n.finalize()
        if n.bytes > 0:
            out.append(n)
    return _merge_named(out)


#: the caching-allocator replay behind reserved memory, registered by ``vramwidget.events``
#: when it is imported (``vramwidget/__init__`` does): ``replay(arch, s, capacity_bytes,
#: record)`` and ``reserved(arch, s, peak)``.  events.py builds its event stream from this
#: module's quantities, so this module cannot import it.
ALLOCATOR_REPLAY: Dict[str, Callable[..., Any]] = {}


def _flops(arch: Architecture, s: TrainingSetup, P: _Params) -> Tuple[float, float]:
    """Matmul FLOPs of one step and the extra share that checkpointing recomputes.

    forward = 2 x T x (linear params + head) + attention 2 x 2 x b x s^2 x a x d x L / 2 (causal);
    backward = 2 x forward with full fine-tuning (input and weight gradients), 1 x forward
    when the base is frozen (input gradients only) plus the adapters' weight gradients
    (2 x T x LoRA params).  MoE experts count with k / E of their parameters.
    """
    T = s.tokens
    lin = sum(t.numel for t in arch.tensors if t.linear and not t.experts)
    experts = sum(t.numel for t in arch.tensors if t.experts)
    if experts and arch.num_experts:
        lin += experts * arch.experts_per_token / arch.num_experts
    head = arch.vocab_size * arch.hidden_size
    mm = 2 * T * (lin + head)
    attn = 2 * s.batch_size * s.seq_len ** 2 * arch.num_heads * arch.head_dim * arch.num_layers  # causal half of 4bs^2ad
    if s.target_len is not None and has_target(arch):
        # an encoder-decoder with its own target length: the decoder's linears (its layers'
        # tensors) and the head run over b x t tokens, the encoder's over b x s; the decoder's
        # self-attention is b t^2, its cross-attention b t s (the encoder's b s^2 as above)
        kinds = dict(arch.family.layer_kinds(arch))
        n_enc = sum(n for k, n in kinds.items() if k not in arch.family.target_kinds)
        dec_lin = sum(t.numel for t in arch.tensors if t.linear and not t.experts and t.layers
                      and t.layers[0] >= n_enc)
        Tt = s.batch_size * s.target_len
        mm = 2 * T * (lin - dec_lin) + 2 * Tt * (dec_lin + head)
        n_dec = arch.num_layers - n_enc
        ad = arch.num_heads * arch.head_dim
        attn = (2 * s.batch_size * s.seq_len ** 2 * ad * n_enc + 2 * s.batch_size * s.target_len ** 2 * ad * n_dec
                + 4 * s.batch_size * s.target_len * s.seq_len * ad * n_dec)
        T = Tt
    fwd = mm + attn
    if s.method in ("full", "freeze"):
        bwd = 2 * fwd
    else:
        adapters = sum(a[3] for a in P.adapters)
        bwd = fwd + 2 * T * adapters
    total = fwd + bwd
    if s.gradient_checkpointing == "full":
        extra = fwd - 2 * T * head
    elif s.gradient_checkpointing == "selective":
        extra = attn
    else:
        extra = 0.0
    return total + extra, (extra / total if total else 0.0)
