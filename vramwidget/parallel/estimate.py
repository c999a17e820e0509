"""Per-GPU training memory under data, tensor, pipeline, context and expert parallelism.

``estimate_parallel(model, strategy=..., num_gpus=..., ...)`` answers "how much memory does
each GPU need?" for a sharded run.  It does not re-derive any memory mechanism: every GPU's
figure starts from the single-GPU estimator (:func:`vramwidget.estimate.estimate_setup`) run
on *that GPU's share of the model*, and then applies what the parallel framework changes.

1. **Model parallelism shapes the model each GPU holds.**  The architecture is cut into the
   slice one GPU runs and the estimator is run on that slice:

   * tensor parallel (t): Megatron's column/row split; attention heads, KV heads (replicated
     when fewer than t), the MLP and expert widths and the vocabulary (vocab-parallel
     embedding, output head and cross-entropy: logits are b x s x V/t) are divided by t.
     Tracing the block with a/t heads and i/t width gives Korthikanti et al.'s terms by
     construction: tensors inside the tensor-parallel regions shrink by t, the
     ``T x h`` tensors around them (norm inputs, residuals, the shared input of the QKV and
     MLP matmuls) do not -- sbh(10 + 24/t + 5as/(ht)) in their GPT notation.
   * sequence parallel: those remaining ``T x h`` tensors are split along the sequence too,
     so every activation is 1/t of the unsharded block's -- sbh(34/t + 5as/(ht)).  It is
     applied as ``activations(t = 1) / t`` on the stage's activation component.
   * context parallel (c): each GPU runs seq_len / c tokens (ring attention passes K/V
     chunks; the chunks in flight are not counted).
   * pipeline parallel (p): stage i runs its share of the layers; the first stage holds the
     embeddings, the last the final norm, the output head and the logits/loss (a tied head
     is a second copy of the embedding on the last stage, as Megatron keeps it).  Under the
     1F1B schedule stage i keeps the activations of min(p - i, m) micro-batches in flight.
   * expert parallel (e): each GPU holds E/e of the routed experts; with balanced routing it
     still processes about T x k token copies, so expert activations are unchanged.

2. **Data parallelism decides how model states are stored** (the ZeRO paper's "model
   states": parameters, gradients, optimizer states), over N = data-parallel x
   context-parallel replicas (experts over N/e):

   ==================  ==========  ==========  ================  ====================
   strategy            parameters  gradients   optimizer states  also
   ==================  ==========  ==========  ================  ====================
   none / ddp          full        full        full              DDP: reducer buckets
   zero0 (DeepSpeed)   full        full        full (+ master)   reduce bucket
   zero1               full        full        1/N (+ master)    reduce bucket
   zero2               full        1/N         1/N (+ master)    reduce bucket
   zero3               1/N         1/N         1/N (+ master)    gathered modules
   fsdp_shard_grad_op  1/N         1/N         1/N               whole model gathered
   fsdp_full_shard     1/N         1/N         1/N               gathered units
   fsdp_hybrid         1/n_node    1/n_node    1/n_node          gathered units
   megatron            full        fp32, full  full (+ master)   fused Adam
   megatron_distopt    full        fp32, full  1/N (+ master)    fused Adam
   ==================  ==========  ==========  ================  ====================

   DeepSpeed's ZeRO optimizer always steps an fp32 copy of its partition ("fp32 master
   weights", 4 B/param/N) with fp32 Adam moments, and converts the partition's gradients to
   fp32 for the step (4 B/param/N, the optimizer step only).  Megatron-LM keeps fp32
   ``main_grad`` buffers for every parameter and an fp32 master copy in its optimizer.
   PyTorch FSDP keeps no extra copy: its sharded parameters are the master weights
   (``amp_bf16`` = fp32 shards gathered as bf16 by ``MixedPrecision``).

   Communication buffers: PyTorch DDP's reducer allocates buckets (``bucket_cap_mb`` = 25 MB
   each) holding a copy of every gradient unless ``gradient_as_bucket_view=True``.
   DeepSpeed ZeRO-1/2 allocate a contiguous reduce (IPG) buffer of ``reduce_bucket_size``
   elements (5e8 by default; two with ``overlap_comm``) at each backward; ZeRO-3 allocates
   it once at start-up, keeps a flat 16-bit buffer for its gradient partition from start-up
   on, and gathers parameters module by module: the module running (the largest sets the
   peak: its 16-bit parameters and, in backward, its 16-bit gradients -- DeepSpeed's
   ``largest_layer_memory = 4 x largest_layer_params``) plus ``stage3_prefetch_bucket_size``
   (5e7) elements fetched ahead.  FSDP gathers whole units (each decoder block, and the root
   unit: embeddings, final norm and head, which stays gathered through forward and backward);
   with prefetching the current and the next block are gathered at once.

3. **Offload** (``offload_optimizer``: DeepSpeed ZeRO-Offload; ``offload_params``: ZeRO-3
   parameter offload or FSDP's ``CPUOffload``) moves those states to host memory, reported
   per GPU and per node; the per-node figure is multiplied by ``cpu_buffer_factor``
   (DeepSpeed's estimator uses ``additional_buffer_factor=1.5`` for pinned buffers and
   headroom).

Each GPU is one step plan (:mod:`vramwidget.plan.per_gpu`): its slice's plan with every
tensor transformed by what it is (a parameter's share, a gradient kept, sharded or reduced per
unit, a state's share, the gathered parameters of the block running) and the strategy's own
tensors placed where the engine makes them (``GpuLayout``, filled by ``_zero_layout``,
``_fsdp_layout``, ``_common_layout``).  The per-GPU :class:`~vramwidget.result.Estimate` reads
its phases, peak and trees from that plan and its reserve and verdict from the allocator
replayed over the same plan, so the two agree to the byte.  With ``strategy="none"`` and one
GPU the layout changes nothing and the per-GPU estimate is the single-GPU estimate.
"""

from __future__ import annotations

import math
import weakref
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from ..model.architecture import Architecture, ParamTensor, load
from ..errors import VramError
from ..inputs import shown
from ..defaults import strategy_for
from ..inputs import MAX_GPUS, Field, check_choice, check_int
from ..estimate import check_physical, estimate_setup
from ..plan.params import param_storage, state_dtypes
from ..plan.profile import full_checkpointing
from ..allocator.collector import gc_paused
from ..plan import has_plan, plan_view
from ..plan.step import forward_floor_bytes, load_floor_bytes
from ..plan.builder import StepPlan, TensorInfo
from ..plan.views import live_rows, row_infos
from ..plan.per_gpu import Buffer, GpuLayout, Shares, ZeroStepGroup, floor_bytes, per_gpu_plan, startup_buffers_plan
from ..result import Estimate, Node
from ..training import OPTIMIZER_STATE_COUNT, TrainingSetup
from ..units import DTYPE_BYTES, GIB
from . import zero as _zero
from .strategies import BY_NAME, names

#: strategy -> what it is (for help texts and the widget): data/strategies.json, read by
#: vramwidget/parallel/strategies.py, is the one list of strategies
STRATEGIES: Dict[str, str] = {name: s.title for name, s in BY_NAME.items()}

DEEPSPEED = names("deepspeed")
FSDP = names("fsdp")
MEGATRON = names("megatron")

#: PyTorch DDP ``bucket_cap_mb`` default: 25, which torch turns into 25 * 1024 * 1024 bytes
DDP_BUCKET_BYTES = 25 * 1024 * 1024
#: DeepSpeed defaults (deepspeed/runtime/zero/config.py), in elements
DS_REDUCE_BUCKET_ELEMENTS = int(5e8)
DS_ALLGATHER_BUCKET_ELEMENTS = int(5e8)
DS_PREFETCH_BUCKET_ELEMENTS = int(5e7)
DS_MAX_LIVE_PARAMETERS = int(1e9)
#: NCCL: NCCL_BUFFSIZE default (4 MiB) and the channels of one communicator assumed (NCCL
#: chooses 2 or more by topology; NCCL_MIN_NCHANNELS / NCCL_MAX_NCHANNELS set them)
NCCL_BUFFSIZE_BYTES = 4 * 2**20
NCCL_CHANNELS = 2
#: DeepSpeed's memory estimators multiply host memory by this ("to be conservative")
DS_ADDITIONAL_BUFFER_FACTOR = 1.5

_COLUMN_ROLES = {"attn_q", "attn_k", "attn_v", "attn_qkv", "mlp_gate", "mlp_up", "mlp_gate_up", "attn_q_b",
                 "attn_kv_b", "expert_gate_up"}
_ROW_ROLES = {"attn_o", "mlp_down", "expert_down"}
_EMBED_ROLES = {"embedding", "position_embedding", "embedding_norm"}



# ----------------------------------------------------------------------------------
# Results
# ----------------------------------------------------------------------------------

@dataclass
class StageEstimate:
    """One pipeline stage: what each of its GPUs holds.

    ``model_states`` are per-GPU bytes by part (each part at its full size, whichever phase
    it lives in): ``weights``, ``quantization constants``, ``adapters``, ``gradients``
    (parameter-dtype gradients), ``fp32 gradients`` (DeepSpeed's step-time partition or
    Megatron's main grads), ``fp32 master weights``, ``optimizer states``,
    ``gathered parameters`` / ``gathered gradients`` (ZeRO-3's largest module or FSDP's
    units), ``prefetched parameters``, ``communication buffers``.  ``cpu`` lists the host
    bytes per GPU under offload.
    """

    stage: int
    layers: Tuple[int, int]            # first and last decoder layer (inclusive); (0, -1) when none
    embedding: bool
    head: bool
    in_flight: int                     # micro-batches whose activations are held (1F1B)
    estimate: Estimate
    model_states: Dict[str, float]
    cpu: Dict[str, float]
    params_local: int                  # parameters of this GPU's slice before data-parallel sharding
    nvme: Dict[str, float] = field(default_factory=dict)   # DeepSpeed NVMe offload: bytes per GPU on disk

    @property
    def device_total_bytes(self) -> float:
        return self.estimate.device_total_bytes

    def to_dict(self) -> Dict[str, Any]:
        """A plain dict of this object (JSON-able)."""
        return {"stage": self.stage, "layers": list(self.layers), "embedding": self.embedding, "head": self.head,
                "in_flight_micro_batches": self.in_flight, "params_local": self.params_local,
                "peak_allocated_bytes": int(round(self.estimate.peak_allocated_bytes)),
                "peak_phase": self.estimate.peak_phase,
                "device_total_bytes": int(round(self.estimate.device_total_bytes)),
                "device_total_gib": round(self.estimate.device_total_bytes / GIB, 3),
                "phases": {k: int(round(v)) for k, v in self.estimate.phases_bytes.items()},
                "model_states": {k: int(round(v)) for k, v in self.model_states.items()},
                "cpu": {k: int(round(v)) for k, v in self.cpu.items()},
                "nvme": {k: int(round(v)) for k, v in self.nvme.items()}}


@dataclass
class ParallelEstimate:
    """Per-GPU memory of a parallel run: the worst GPU, and every pipeline stage.

    ``per_gpu`` is the :class:`Estimate` of the GPU that needs the most (device total);
    ``stages`` has one entry per pipeline stage (one entry without pipeline parallelism).
    Host memory: ``cpu_bytes_per_gpu`` (the offloaded states of one GPU) and
    ``cpu_bytes_per_node`` (all GPUs of a node, times ``cpu_buffer_factor``).
    """

    model_name: str
    strategy: str
    layout: Dict[str, Any]
    setup: Dict[str, Any]
    stages: List[StageEstimate]
    worst_stage: int
    buffers: Dict[str, Any]
    cpu_buffer_factor: float
    notes: List[str] = field(default_factory=list)

    @property
    def per_gpu(self) -> Estimate:
        return self.stages[self.worst_stage].estimate

    @property
    def model_states(self) -> Dict[str, float]:
        return self.stages[self.worst_stage].model_states

    @property
    def device_total_bytes(self) -> float:
        return self.per_gpu.device_total_bytes

    @property
    def device_total_gib(self) -> float:
        return self.device_total_bytes / GIB

    @property
    def peak_allocated_bytes(self) -> float:
        return self.per_gpu.peak_allocated_bytes

    @property
    def cpu_bytes_per_gpu(self) -> float:
        return max(sum(st.cpu.values()) for st in self.stages)

    @property
    def cpu_bytes_per_node(self) -> float:
        """Host memory of one node: its GPUs' offloaded states x ``cpu_buffer_factor``."""
        per = self.layout["gpus_on_node"]
        total = sum(sum(st.cpu.values()) for st in self.stages) / len(self.stages)
        return total * per * self.cpu_buffer_factor

    # -- time (timing.py) ---------------------------------------------------------
    def set_gpu(self, gpu: Any) -> "ParallelEstimate":
        """Put every stage on ``gpu`` (a catalogue name; None: no GPU): timed there, each
        device total counting the card's own CUDA context (``Estimate.set_gpu``); returns self."""
        for st in self.stages:
            st.estimate.set_gpu(gpu)
        return self

    @property
    def slowest(self) -> Estimate:
        """The per-GPU estimate of the stage that takes longest (it sets the step's pace)."""
        timed = [st.estimate for st in self.stages if st.estimate.step_seconds is not None]
        if not timed:
            return self.per_gpu
        return max(timed, key=lambda e: e.step_seconds)

    @property
    def step_seconds(self) -> Optional[float]:
        """Seconds per optimizer step, communication and pipeline bubble included; None without a GPU."""
        return self.slowest.step_seconds

    @property
    def tokens_per_second(self) -> Optional[float]:
        """Tokens per second of the whole run (all data-parallel replicas)."""
        return self.slowest.tokens_per_second

    @property
    def mfu(self) -> Optional[float]:
        return self.slowest.mfu

    @property
    def time_breakdown(self) -> Optional[Dict[str, Any]]:
        """The slowest stage's breakdown, with its communication (collectives, exposed seconds)."""
        return self.slowest.time_breakdown

    def run_cost(self, tokens: float, usd_per_gpu_hour: Optional[float] = None) -> Dict[str, Any]:
        """Steps, hours, GPU-hours and dollars (all ``num_gpus``) to train on ``tokens`` tokens."""
        return self.slowest.run_cost(tokens, usd_per_gpu_hour)

    def fits(self, gpu: Any) -> bool:
        """Whether the worst GPU's device total on ``gpu`` (reserved + the card's own CUDA
        context) stays within what CUDA reports as the card's total (:mod:`vramwidget.fit.verdict`)."""
        from ..gpus import capacity_bytes, device_total_on, fits

        return fits(device_total_on(self, gpu), capacity_bytes(gpu))

    def to_dict(self) -> Dict[str, Any]:
        """A plain dict of this object (JSON-able)."""
        return {"model": self.model_name, "strategy": self.strategy, "layout": dict(self.layout),
                "setup": self.setup, "worst_stage": self.worst_stage,
                "device_total_bytes": int(round(self.device_total_bytes)),
                "device_total_gib": round(self.device_total_gib, 3),
                "peak_allocated_bytes": int(round(self.peak_allocated_bytes)),
                "cpu_bytes_per_gpu": int(round(self.cpu_bytes_per_gpu)),
                "cpu_bytes_per_node": int(round(self.cpu_bytes_per_node)),
                "cpu_buffer_factor": self.cpu_buffer_factor,
                "buffers": self.buffers, "stages": [s.to_dict() for s in self.stages],
                "per_gpu": self.per_gpu.to_dict(), "notes": list(self.notes),
                "time": self.slowest._time_dict()}

    def summary_text(self) -> str:
        """A plain-text summary: the layout, then the worst GPU's estimate."""
        return repr(self) + "\nworst GPU: " + self.per_gpu.summary_text()

    def __str__(self) -> str:
        return self.summary_text()

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(repr(self) if cycle else self.summary_text())

    def __repr__(self) -> str:
        return (f"ParallelEstimate({self.model_name!r}, {self.strategy}, {self.layout['num_gpus']} GPUs: "
                f"worst GPU {self.device_total_gib:.2f} GiB device total"
                + (f", host {self.cpu_bytes_per_node / GIB:.1f} GiB per node" if self.cpu_bytes_per_gpu else "")
                + ")")


# ----------------------------------------------------------------------------------
# The layout
# ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Layout:
    strategy: str
    num_gpus: int
    gpus_per_node: int
    dp: int
    tp: int
    pp: int
    cp: int
    ep: int
    sp: bool
    micro_batches: int
    shard: int            # ranks over which dense model states are sharded (ZeRO/FSDP/dist-opt)
    shard_experts: int    # ... and expert model states

    @property
    def nodes(self) -> int:
        return -(-self.num_gpus // self.gpus_per_node)

    @property
    def gpus_on_node(self) -> int:
        return min(self.gpus_per_node, self.num_gpus)


def _posint(name: str, v: Any) -> int:
    return check_int(name, v, lo=1)


def _layout(arch: Architecture, s: TrainingSetup, strategy: str, num_gpus: Any, gpus_per_node: Any, tp: Any,
            pp: Any, sp: Any, cp: Any, ep: Any, micro_batches: Any) -> _Layout:
    strategy = check_choice("strategy", strategy, tuple(STRATEGIES))
    n = _posint("num_gpus", num_gpus)
    gpn = _posint("gpus_per_node", gpus_per_node)
    tp, pp, cp, ep = (_posint(k, v) for k, v in (("tensor_parallel", tp), ("pipeline_parallel", pp),
                                                   ("context_parallel", cp), ("expert_parallel", ep)))
    if not isinstance(sp, bool):
        raise VramError(f"sequence_parallel: must be true or false, got {shown(sp)}", field="sequence_parallel")
    model_par = tp * pp * cp
    if n % model_par:
        raise VramError(f"num_gpus: {n} GPUs cannot hold tensor x pipeline x context parallel = "
                        f"{tp} x {pp} x {cp} = {model_par} (num_gpus must be a multiple of it)", field="num_gpus")
    dp = n // model_par
    if strategy == "none" and dp > 1:
        raise VramError(f"strategy: {dp} data-parallel replicas need a data-parallel strategy (ddp, zero1-3, fsdp_*, "
                        f"megatron*); 'none' is one replica", field="strategy")
    if sp and tp == 1:
        raise VramError("sequence_parallel: needs tensor_parallel > 1 (it splits the tensor-parallel group's "
                        "sequence)", field="sequence_parallel")
    if tp > 1:
        if arch.num_heads % tp:
            raise VramError(f"tensor_parallel: {arch.name} has {arch.num_heads} attention heads, not divisible by "
                            f"{tp}", field="tensor_parallel")
        kv = arch.num_kv_heads
        if kv % tp and tp % kv:
            raise VramError(f"tensor_parallel: {kv} KV heads can be neither split nor replicated over {tp} GPUs",
                            field="tensor_parallel")
    if pp > arch.num_layers:
        raise VramError(f"pipeline_parallel: {arch.name} has {arch.num_layers} layers, fewer than {pp} stages",
                        field="pipeline_parallel")
    if pp > 1 and s.method == "freeze":
        raise VramError("pipeline_parallel: method='freeze' with pipeline stages is not modelled", field="method")
    if cp > 1 and s.target_len is not None:
        raise VramError("context_parallel: splitting an encoder-decoder's target_len across GPUs is not modelled; "
                        "use context_parallel=1", field="context_parallel")
    if cp > 1 and s.seq_len % cp:
        raise VramError(f"context_parallel: seq_len {s.seq_len} is not divisible by {cp}", field="context_parallel")
    if ep > 1:
        if not arch.is_moe:
            raise VramError(f"expert_parallel: {arch.name} has no experts", field="expert_parallel")
        if arch.num_experts % ep:
            raise VramError(f"expert_parallel: {arch.num_experts} experts are not divisible by {ep}",
                            field="expert_parallel")
        if (dp * cp) % ep:
            raise VramError(f"expert_parallel: {ep} must divide the data x context parallel size {dp * cp} "
                            f"(expert-parallel ranks are taken from the data-parallel ones)", field="expert_parallel")
    m = s.grad_accum_steps if micro_batches is None else _posint("micro_batches", micro_batches)
    replicas = dp * cp
    if BY_NAME[strategy].shard_group == "node":       # HYBRID_SHARD: sharded within a node
        per_node = max(1, gpn // (tp * pp))
        shard = max(1, min(replicas, per_node))
    elif BY_NAME[strategy].replicates:
        shard = 1
    else:
        shard = replicas
    shard_e = max(1, shard // ep) if ep > 1 else shard
    return _Layout(strategy, n, gpn, dp, tp, pp, cp, ep, sp, m, shard, shard_e)


# ----------------------------------------------------------------------------------
# The slice of the model one GPU runs
# ----------------------------------------------------------------------------------

#: (id(arch), the slice) -> (a weak reference to arch, (sliced, sliced without the tensor/expert cut))
_SLICE_CACHE: Dict[Tuple[Any, ...], Tuple[Any, Tuple[Architecture, Architecture]]] = {}


def _split(n: int, t: int) -> int:
    return -(-n // t)


def _tp_tensor(t: ParamTensor, arch: Architecture, tp: int, ep: int) -> ParamTensor:
    """One tensor's per-GPU shard under tensor parallel (Megatron's column/row split,
    vocab-parallel embedding/head) and expert parallel (E/ep experts)."""
    shape = list(t.shape)
    in_f, out_f = t.in_features, t.out_features
    experts = t.experts
    if ep > 1 and t.experts:
        shape[0] = t.experts // ep
        experts = t.experts // ep
    if tp > 1:
        role = t.role
        column = role in _COLUMN_ROLES or (role == "shared_expert" and t.module not in ("down_proj",))
        row = role in _ROW_ROLES or (role == "shared_expert" and t.module == "down_proj")
        kv = arch.num_kv_heads
        kv_local = kv // tp if kv >= tp else 1
        d = arch.head_dim

        def local_out(o: int) -> int:
            if role in ("attn_k", "attn_v") and not arch.mla:
                return kv_local * d
            if role == "attn_qkv" and o == (arch.num_heads + 2 * kv) * d:
                return (arch.num_heads // tp + 2 * kv_local) * d
            return _split(o, tp)

        if role in ("embedding", "output_head"):
            shape[0] = _split(shape[0], tp)
        elif t.is_bias:
            if column:
                shape[0] = local_out(shape[0])
        elif column or row:
            if t.experts:
                ax = 1 if column else 2
                shape[ax] = _split(shape[ax], tp)
                if column:
                    out_f = shape[1]
                else:
                    in_f = shape[2]
            else:
                # (out, in) for nn.Linear, (in, out) for GPT-2's Conv1D
                conv = len(shape) == 2 and shape[0] == t.in_features and shape[1] == t.out_features \
                    and t.in_features != t.out_features
                if column:
                    new = local_out(out_f)
                    shape[1 if conv else 0] = new
                    out_f = new
                else:
                    new = _split(in_f, tp)
                    shape[0 if conv else 1] = new
                    in_f = new
    if tuple(shape) == t.shape and experts == t.experts:
        return t
    return replace(t, shape=tuple(shape), in_features=in_f, out_features=out_f, experts=experts)


def stage_slice(arch: Architecture, first: int, last: int, embed: bool, head: bool, tp: int,
           ep: int) -> Tuple[Architecture, Architecture]:
    """The architecture one GPU runs: layers [first, last] of the pipeline stage, the
    embeddings on the first stage, the head on the last, cut by tensor and expert parallel.
    Returns (sliced, sliced without the tensor/expert cut) -- the second gives the unsharded
    activations sequence parallel divides."""
    L = arch.num_layers
    full_stage = first == 0 and last == L - 1 and embed and head
    if full_stage and tp == 1 and ep == 1:
        return arch, arch
    key = (id(arch), first, last, embed, head, tp, ep)
    hit = _SLICE_CACHE.get(key)
    if hit is not None and hit[0]() is arch:    # that very architecture: a freed one's id is reused
        return hit[1]
    tensors: List[ParamTensor] = []
    for t in arch.tensors:
        if t.layers is None:
            if t.role in _EMBED_ROLES:
                if not embed:
                    continue
            elif not head:
                continue
            tensors.append(t)
            continue
        lo, hi = t.layers
        a, b = max(lo, first), min(hi, last)
        if a > b:
            continue
        per = t.repeat // (hi - lo + 1)
        tensors.append(replace(t, repeat=per * (b - a + 1), layers=(a - first, b - first)))
    tied = arch.tie_word_embeddings
    if tied and head and not embed:
        emb = next((t for t in arch.tensors if t.role == "embedding"), None)
        if emb is not None:   # Megatron keeps a copy of the tied embedding as the last stage's head
            tensors.append(ParamTensor("lm_head.weight (tied copy)", emb.shape, "output_head", "lm_head"))
        tied = False
    n = last - first + 1
    dense = max(0, min(arch.dense_layers - 1, last) - first + 1) if arch.dense_layers else 0
    sliding = round(arch.sliding_layers * n / L) if arch.sliding_layers else 0
    # a mixed stack's stage holds its own layers' kinds (an encoder-decoder's first stages the
    # encoder's, a hybrid's its share of linear-attention and attention layers)
    order = arch.family.layer_order(arch)
    kinds = arch.layer_kinds
    if order:
        order = order[first:last + 1]
        kinds = [(kd, order.count(kd)) for kd in dict.fromkeys(order)]
    base = replace(arch, tensors=tensors, num_layers=n, dense_layers=dense, sliding_layers=sliding,
                   tie_word_embeddings=tied and embed and head,
                   vocab_size=arch.vocab_size if head else 0, layer_order=order, layer_kinds=kinds)
    if tp == 1 and ep == 1:
        out = (base, base)
    else:
        kv = arch.num_kv_heads
        cfg = dict(arch.config)
        if tp > 1 and arch.is_moe and cfg.get("intermediate_size"):
            cfg["intermediate_size"] = _split(int(cfg["intermediate_size"]), tp)
        cut = replace(base, tensors=[_tp_tensor(t, arch, tp, ep) for t in tensors],
                      num_heads=arch.num_heads // tp,
                      num_kv_heads=(kv // tp if kv >= tp else 1) if not arch.mla else arch.num_heads // tp,
                      intermediate_size=_split(arch.intermediate_size, tp),
                      expert_intermediate_size=_split(arch.expert_intermediate_size, tp)
                      if arch.expert_intermediate_size else 0,
                      shared_expert_intermediate_size=_split(arch.shared_expert_intermediate_size, tp)
                      if arch.shared_expert_intermediate_size else 0,
                      vocab_size=_split(arch.vocab_size, tp) if head else 0, config=cfg)
        out = (cut, base)
    if len(_SLICE_CACHE) > 256:
        _SLICE_CACHE.clear()
    _SLICE_CACHE[key] = (weakref.ref(arch), out)    # naming the architecture without keeping it alive
    return out


def _stages(L: int, pp: int) -> List[Tuple[int, int]]:
    """Layers per stage, as even as possible (earlier stages take the remainder)."""
    base, extra = divmod(L, pp)
    out, start = [], 0
    for i in range(pp):
        n = base + (1 if i < extra else 0)
        out.append((start, start + n - 1))
        start += n
    return out


# ----------------------------------------------------------------------------------
# The estimate
# ----------------------------------------------------------------------------------

def estimate_parallel(model: Any, *, strategy: Optional[str] = None, num_gpus: int = 1, gpus_per_node: int = 8,
                      tensor_parallel: int = 1, pipeline_parallel: int = 1, sequence_parallel: bool = False,
                      context_parallel: int = 1, expert_parallel: int = 1, micro_batches: Optional[int] = None,
                      offload_optimizer: bool = False, offload_params: bool = False,
                      bucket_mb: Optional[float] = None, prefetch_elements: Optional[int] = None,
                      overlap_comm: Optional[bool] = None, ddp_bucket_view: bool = False,
                      cpu_buffer_factor: Optional[float] = None, max_live_parameters: Optional[int] = None,
                      nccl_buffsize_mb: Optional[float] = None, nccl_channels: Optional[int] = None,
                      zero_config: Optional[Dict[str, Any]] = None, fsdp_version: int = 1,
                      reshard_after_forward: Optional[bool] = None, device_map: Any = None,
                      max_memory: Optional[Dict[Any, Any]] = None, gpu: Any = None,
                      **setup: Any) -> ParallelEstimate:
    """Per-GPU memory of one training step run across ``num_gpus`` GPUs.

    Parameters
    ----------
    model, **setup:
        as for :func:`vramwidget.estimate`; ``batch_size`` is the micro-batch of one
        data-parallel replica, ``seq_len`` the full sequence (context parallel splits it).
    strategy:
        one of :data:`STRATEGIES`: ``none``, ``ddp``, ``zero0``-``zero3`` (DeepSpeed),
        ``fsdp_full_shard``, ``fsdp_shard_grad_op``, ``fsdp_hybrid`` (PyTorch FSDP),
        ``megatron``, ``megatron_distopt`` (Megatron-LM).  Not given: ``ddp`` when the
        layout has several data-parallel replicas (said in the notes), else ``none``.
    num_gpus, gpus_per_node:
        all GPUs of the run; data-parallel size = num_gpus / (tensor x pipeline x context).
    tensor_parallel, sequence_parallel, context_parallel, pipeline_parallel, expert_parallel:
        model-parallel sizes (see the module docstring for what each divides).
    micro_batches:
        micro-batches per step and replica (pipeline schedule; default ``grad_accum_steps``).
    offload_optimizer, offload_params:
        DeepSpeed ZeRO-Offload (optimizer states, fp32 master weights and fp32 gradients to
        the CPU; ZeRO-1/2/3) and parameter offload (ZeRO-3); for FSDP, ``offload_params``
        is ``CPUOffload(offload_params=True)`` (parameters, gradients and the optimizer step
        on the CPU).
    bucket_mb:
        the gradient reduce bucket in MB (10**6 bytes): DDP's ``bucket_cap_mb`` (default
        25 MiB) or DeepSpeed's ``reduce_bucket_size`` (default 5e8 elements) in 16-bit bytes.
    prefetch_elements:
        ZeRO-3 ``stage3_prefetch_bucket_size`` (default 5e7 elements).
    overlap_comm:
        DeepSpeed ``overlap_comm`` (default: on for ZeRO-3 only); doubles the reduce buffer.
    ddp_bucket_view:
        DDP ``gradient_as_bucket_view=True``: gradients live in the buckets (no copy).
    cpu_buffer_factor:
        host-memory headroom factor for the per-node figure (default 1.5 with DeepSpeed,
        its ``additional_buffer_factor``; 1.0 otherwise).
    max_live_parameters:
        ZeRO-3 ``stage3_max_live_parameters`` (default 1e9 elements): the most parameters
        gathered at once.
    nccl_buffsize_mb, nccl_channels:
        NCCL's ``NCCL_BUFFSIZE`` in MiB (default 4) and channels per communicator (default 2;
        NCCL picks more on NVLink systems, up to ``NCCL_MAX_NCHANNELS``).
    zero_config:
        DeepSpeed's ``zero_optimization`` keys (:data:`vramwidget.parallel.zero.DS_KEYS`: ``sub_group_size``,
        ``reduce_bucket_size``, ``allgather_bucket_size``, ``stage3_prefetch_bucket_size``,
        ``stage3_param_persistence_threshold``, ``stage3_model_persistence_threshold``,
        ``stage3_max_live_parameters``, ``stage3_max_reuse_distance``, ``contiguous_gradients``,
        ``overlap_comm``, ``offload_optimizer`` / ``offload_param`` ``{"device": "cpu" | "nvme",
        "ratio": ...}``) for the ZeRO strategies (:mod:`vramwidget.parallel.zero`).
    fsdp_version, reshard_after_forward:
        FSDP1 (``FullyShardedDataParallel``'s flat parameters, accelerate's default) or FSDP2
        (``fully_shard``: torchtune, accelerate ``fsdp_version: 2``); ``reshard_after_forward``
        (default: True, False for ``fsdp_shard_grad_op``) frees each unit's gathered
        parameters after its forward (:mod:`vramwidget.parallel.fsdp`).
    device_map, max_memory:
        transformers' ``from_pretrained(device_map="auto" | "balanced" | "balanced_low_0" |
        "sequential" | {module: device}, max_memory={0: "24GiB", ...})``: the layers split over
        the GPUs as transformers places them (:mod:`vramwidget.parallel.device_map`), each GPU running its
        own layers in turn (one stage per GPU, one micro-batch in flight).
    gpu:
        a catalogue GPU: the step time with the strategy's communication over its NVLink or
        PCIe (and 50 GB/s per GPU between nodes), tokens/s of the whole run and its cost.
    """
    arch = load(model)
    s = setup.pop("setup") if "setup" in setup and isinstance(setup.get("setup"), TrainingSetup) else None
    if s is None:
        s = TrainingSetup.from_kwargs(**setup)
    elif setup:
        raise VramError(f"unknown setup field {shown(sorted(setup)[0])} beside setup=", field=sorted(setup)[0])
    said = ""
    if strategy is None:   # not given: DDP for several replicas (defaults.py, as the CLI and widget do)
        strategy, said = strategy_for(num_gpus, tensor_parallel, pipeline_parallel, context_parallel)
    pe = estimate_parallel_setup(
        arch, s, strategy=strategy, num_gpus=num_gpus, gpus_per_node=gpus_per_node,
        tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel, sequence_parallel=sequence_parallel,
        context_parallel=context_parallel, expert_parallel=expert_parallel, micro_batches=micro_batches,
        offload_optimizer=offload_optimizer, offload_params=offload_params, bucket_mb=bucket_mb,
        prefetch_elements=prefetch_elements, overlap_comm=overlap_comm, ddp_bucket_view=ddp_bucket_view,
        cpu_buffer_factor=cpu_buffer_factor, max_live_parameters=max_live_parameters,
        nccl_buffsize_mb=nccl_buffsize_mb, nccl_channels=nccl_channels, zero_config=zero_config,
        fsdp_version=fsdp_version, reshard_after_forward=reshard_after_forward, device_map=device_map,
        max_memory=max_memory)
    check_physical(pe.per_gpu, arch, s)
    if said:
        pe.notes.insert(0, said)
        pe.per_gpu.notes.insert(0, said)
    if gpu is not None:
        pe.set_gpu(gpu)
    return pe


#: the keyword arguments of estimate_parallel beyond the training setup
PARALLEL_KEYS = ("strategy", "num_gpus", "gpus_per_node", "tensor_parallel", "pipeline_parallel",
                 "sequence_parallel", "context_parallel", "expert_parallel", "micro_batches", "offload_optimizer",
                 "offload_params", "bucket_mb", "prefetch_elements", "overlap_comm", "ddp_bucket_view",
                 "cpu_buffer_factor", "max_live_parameters", "nccl_buffsize_mb",
                 "nccl_channels", "zero_config", "fsdp_version", "reshard_after_forward", "device_map",
                 "max_memory")


#: each keyword of estimate_parallel beyond the setup, declared once (kind and range; the
#: links between them and the model are checked in ``_layout``)
PARALLEL_FIELDS: Dict[str, Field] = {f.name: f for f in (
    Field("strategy", "choice", "none", choices=lambda: tuple(STRATEGIES), none="error"),
    Field("num_gpus", "int", 1, lo=1, hi=MAX_GPUS, none="error"),
    Field("gpus_per_node", "int", 8, lo=1, none="error"),
    Field("tensor_parallel", "int", 1, lo=1, none="error"),
    Field("pipeline_parallel", "int", 1, lo=1, none="error"),
    Field("sequence_parallel", "bool", False, none="error"),
    Field("context_parallel", "int", 1, lo=1, none="error"),
    Field("expert_parallel", "int", 1, lo=1, none="error"),
    Field("micro_batches", "int", None, lo=1, none="none"),
    Field("offload_optimizer", "bool", False, none="error"),
    Field("offload_params", "bool", False, none="error"),
    Field("bucket_mb", "number", None, lo=0, lo_open=True, none="none"),
    Field("prefetch_elements", "int", None, lo=1, none="none"),
    Field("overlap_comm", "bool", None, none="none"),
    Field("ddp_bucket_view", "bool", False, none="error"),
    Field("cpu_buffer_factor", "number", None, lo=1, none="none"),
    Field("max_live_parameters", "int", None, lo=1, none="none"),
    Field("nccl_buffsize_mb", "number", None, lo=0, lo_open=True, none="none"),
    Field("nccl_channels", "int", None, lo=1, none="none"),
    Field("zero_config", "custom", None, none="none", parse=lambda v: _zero.check_keys(v)),
    Field("fsdp_version", "int", 1, lo=1, hi=2, none="error"),
    Field("reshard_after_forward", "bool", None, none="none"),
    Field("device_map", "custom", None, none="none", parse=lambda v: v),
    Field("max_memory", "custom", None, none="none", parse=lambda v: v),
)}
assert set(PARALLEL_FIELDS) == set(PARALLEL_KEYS)


def estimate_parallel_setup(arch: Architecture, s: TrainingSetup, *, strategy: str = "none", num_gpus: int = 1,
                            gpus_per_node: int = 8, tensor_parallel: int = 1, pipeline_parallel: int = 1,
                            sequence_parallel: bool = False, context_parallel: int = 1, expert_parallel: int = 1,
                            micro_batches: Optional[int] = None, offload_optimizer: bool = False,
                            offload_params: bool = False, bucket_mb: Optional[float] = None,
                            prefetch_elements: Optional[int] = None, overlap_comm: Optional[bool] = None,
                            ddp_bucket_view: bool = False,
                            cpu_buffer_factor: Optional[float] = None, max_live_parameters: Optional[int] = None,
                            nccl_buffsize_mb: Optional[float] = None,
                            nccl_channels: Optional[int] = None,
                            zero_config: Optional[Dict[str, Any]] = None, fsdp_version: int = 1,
                            reshard_after_forward: Optional[bool] = None, device_map: Any = None,
                            max_memory: Optional[Dict[Any, Any]] = None) -> ParallelEstimate:
    """:func:`estimate_parallel` for a resolved architecture and a validated setup."""
    given = dict(locals())   # every keyword, each checked by its declaration in PARALLEL_FIELDS
    for k, f in PARALLEL_FIELDS.items():
        if given[k] is not None or f.none == "error":
            f.check(given[k])
    strategy = PARALLEL_FIELDS["strategy"].check(strategy)
    placed = None
    if device_map is not None:
        # transformers' device_map split: each GPU runs its layers in turn (vramwidget/parallel/device_map.py)
        from . import device_map as _dm

        if strategy != "none" or tensor_parallel != 1 or pipeline_parallel != 1:
            raise VramError("device_map: a device_map split runs one replica layer by layer; use it with "
                            "strategy='none' and no tensor or pipeline parallel size", field="device_map")
        placement = _dm.place(arch, param_storage(arch, s), device_map, max_memory, quantized=s.quantized)
        placed = _dm.stages(placement)
        num_gpus, pipeline_parallel, micro_batches = len(placed), len(placed), 1
    elif max_memory is not None:
        raise VramError("max_memory: needs device_map= (the split it sizes)", field="max_memory")
    lay = _layout(arch, s, strategy, num_gpus, gpus_per_node, tensor_parallel, pipeline_parallel,
                  sequence_parallel, context_parallel, expert_parallel, micro_batches)
    for name, v in (("offload_optimizer", offload_optimizer), ("offload_params", offload_params),
                    ("ddp_bucket_view", ddp_bucket_view)):
        if not isinstance(v, bool):
            raise VramError(f"{name}: must be true or false, got {shown(v)}", field=name)
    if offload_optimizer and not BY_NAME[strategy].offload_optimizer:
        hint = " (FSDP offloads parameters, gradients and the optimizer together: offload_params=True)" \
            if strategy in FSDP else ""
        raise VramError(f"offload_optimizer: needs DeepSpeed ZeRO-1, 2 or 3, not {shown(strategy)}{hint}",
                        field="offload_optimizer")
    if not s.zero_grad_set_to_none and strategy in DEEPSPEED + FSDP:
        # DeepSpeed's engine zeroes its own gradient partitions and FSDP keeps each rank's shard:
        # what a kept gradient costs per GPU there is not the plan's full gradient
        raise VramError(f"zero_grad_set_to_none: False is modelled on one GPU and with DDP; under "
                        f"{shown(strategy)} the engine keeps or zeroes its own gradient partitions (leave it True, torch's "
                        f"default)",
                        field="zero_grad_set_to_none")
    if offload_params and not BY_NAME[strategy].offload_params:
        raise VramError(f"offload_params: needs ZeRO-3 or FSDP, not {shown(strategy)}", field="offload_params")
    if bucket_mb is not None and (isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float))
                                  or not bucket_mb > 0 or bucket_mb == float("inf")):
        raise VramError(f"bucket_mb: must be a number > 0, got {shown(bucket_mb)}", field="bucket_mb")
    if prefetch_elements is not None:
        prefetch_elements = _posint("prefetch_elements", prefetch_elements)
    if max_live_parameters is not None:
        max_live_parameters = _posint("max_live_parameters", max_live_parameters)
    if nccl_channels is not None:
        nccl_channels = _posint("nccl_channels", nccl_channels)
    if nccl_buffsize_mb is not None and (isinstance(nccl_buffsize_mb, bool) or not isinstance(
            nccl_buffsize_mb, (int, float)) or not nccl_buffsize_mb > 0 or nccl_buffsize_mb == float("inf")):
        raise VramError(f"nccl_buffsize_mb: must be a number > 0, got {shown(nccl_buffsize_mb)}", field="nccl_buffsize_mb")
    if cpu_buffer_factor is None:
        cpu_buffer_factor = DS_ADDITIONAL_BUFFER_FACTOR if strategy in DEEPSPEED else 1.0
    elif isinstance(cpu_buffer_factor, bool) or not isinstance(cpu_buffer_factor, (int, float)) \
            or not cpu_buffer_factor >= 1.0 or cpu_buffer_factor == float("inf"):
        raise VramError(f"cpu_buffer_factor: must be a number >= 1, got {shown(cpu_buffer_factor)}",
                        field="cpu_buffer_factor")
    zcfg = None
    if strategy in DEEPSPEED:
        zcfg = _zero.zero_config(
            int(strategy[-1]), zero_config, hidden_size=arch.hidden_size,
            reduce_bucket_size=int(bucket_mb * 1e6 / 2) if bucket_mb else None,
            prefetch_bucket_size=prefetch_elements, max_live_parameters=max_live_parameters, overlap_comm=overlap_comm,
            offload_optimizer="cpu" if offload_optimizer else None, offload_param="cpu" if offload_params else None)
        offload_optimizer = zcfg.offload_optimizer != "none"
        offload_params = zcfg.offload_param != "none"
    elif zero_config:
        raise VramError(f"zero_config: DeepSpeed's ZeRO settings need a DeepSpeed strategy (zero0-zero3), not "
                        f"{shown(strategy)}", field="zero_config")
    opts = dict(offload_optimizer=offload_optimizer, offload_params=offload_params, bucket_mb=bucket_mb,
                prefetch_elements=prefetch_elements if prefetch_elements is not None else DS_PREFETCH_BUCKET_ELEMENTS,
                overlap_comm=zcfg.overlap if zcfg else ((strategy == "zero3") if overlap_comm is None
                                                        else bool(overlap_comm)),
                ddp_bucket_view=ddp_bucket_view,
                max_live_parameters=max_live_parameters if max_live_parameters is not None else DS_MAX_LIVE_PARAMETERS,
                nccl_buffsize_bytes=(nccl_buffsize_mb if nccl_buffsize_mb is not None else 4) * 2**20,
                nccl_channels=nccl_channels if nccl_channels is not None else NCCL_CHANNELS, zero=zcfg,
                fsdp_version=PARALLEL_FIELDS["fsdp_version"].check(fsdp_version),
                reshard_after_forward=reshard_after_forward)

    s_loc, pre_notes = _local_setup(arch, s, strategy, lay)

    ranges = _stages(arch.num_layers, lay.pp) if placed is None else [(f, l) for f, l, _, _, _ in placed]
    stages: List[StageEstimate] = []
    cache: Dict[Tuple[Any, ...], Tuple[Any, ...]] = {}
    for i, (first, last) in enumerate(ranges):
        embed, head = (i == 0, i == lay.pp - 1) if placed is None else placed[i][2:4]
        k = min(lay.pp - i, lay.micro_batches) if lay.pp > 1 else 1
        key = (first, last, embed, head, k)
        if key not in cache:
            cache[key] = _per_gpu_stage(arch, s, s_loc, lay, opts, first, last, embed, head, k)
        est, ms, cpu, n_local, _notes, nvme = cache[key]
        stages.append(StageEstimate(i, (first, last), embed, head, k, est, ms, cpu, n_local, nvme))
    # the fullest GPU: by device total, which replays the allocator per stage; one stage is
    # the fullest without a replay (max() would read the key of a single item too)
    worst = 0 if len(stages) == 1 else max(range(len(stages)), key=lambda j: stages[j].device_total_bytes)
    comm_layout = {"strategy": strategy, "num_gpus": lay.num_gpus, "gpus_per_node": lay.gpus_per_node,
                   "data_parallel": lay.dp, "tensor_parallel": lay.tp, "pipeline_parallel": lay.pp,
                   "context_parallel": lay.cp, "expert_parallel": lay.ep, "micro_batches": lay.micro_batches,
                   "shard": lay.shard, "overlap_comm": opts["overlap_comm"],
                   "offload_optimizer": offload_optimizer, "offload_params": offload_params}
    for st in stages:
        _attach_comm(st.estimate, comm_layout, s, lay)
    notes = pre_notes + list(cache[next(iter(cache))][4])
    layout = {"strategy": strategy, "num_gpus": lay.num_gpus, "gpus_per_node": lay.gpus_per_node,
              "nodes": lay.nodes, "gpus_on_node": lay.gpus_on_node, "data_parallel": lay.dp,
              "tensor_parallel": lay.tp, "pipeline_parallel": lay.pp, "context_parallel": lay.cp,
              "expert_parallel": lay.ep, "sequence_parallel": lay.sp, "micro_batches": lay.micro_batches,
              "shard": lay.shard, "shard_experts": lay.shard_experts,
              "offload_optimizer": offload_optimizer, "offload_params": offload_params}
    if placed is not None:
        layout["device_map"] = dict(placement.device_map)
        layout["gpu_of_stage"] = [d for _, _, _, _, d in placed]
    return ParallelEstimate(model_name=arch.name, strategy=strategy, layout=layout, setup=s.to_dict(), stages=stages,
                            worst_stage=worst, buffers=_buffer_settings(strategy, opts),
                            cpu_buffer_factor=float(cpu_buffer_factor), notes=notes)


def _attach_comm(est: Estimate, comm_layout: Dict[str, Any], s: TrainingSetup, lay: _Layout) -> None:
    """Give a stage's per-GPU estimate its communication (timing.communication) and the run's
    GPU count and tokens per step, for ``set_gpu`` / ``step_seconds`` / ``run_cost``."""
    from ..timing import communication

    sizes = getattr(getattr(est, "sources", None), "communication_sizes", None)
    if sizes is None:
        return
    est.gpus = lay.num_gpus
    est.tokens_per_step = s.batch_size * s.seq_len * max(s.grad_accum_steps, lay.micro_batches if lay.pp > 1 else 1) \
        * lay.dp
    est.sources.communication = lambda gpu, st: communication(gpu, comm_layout, sizes, st)


def _buffer_settings(strategy: str, opts: Dict[str, Any]) -> Dict[str, Any]:
    mb = opts["bucket_mb"]
    if strategy == "ddp":
        return {"ddp_bucket_cap_bytes": int(mb * 1e6) if mb else DDP_BUCKET_BYTES,
                "gradient_as_bucket_view": opts["ddp_bucket_view"]}
    if strategy in DEEPSPEED:
        return {"reduce_bucket_elements": int(mb * 1e6 / 2) if mb else DS_REDUCE_BUCKET_ELEMENTS,
                "allgather_bucket_elements": DS_ALLGATHER_BUCKET_ELEMENTS,
                "prefetch_bucket_elements": opts["prefetch_elements"] if strategy == "zero3" else 0,
                "max_live_parameters": opts["max_live_parameters"] if strategy == "zero3" else 0,
                "overlap_comm": opts["overlap_comm"]}
    return {}


def _comm_dtypes(P: Any, s: TrainingSetup) -> Tuple[str, ...]:
    """The dtypes DeepSpeed reduces gradients in, one IPG bucket each: the parameters' own, or
    under torch autocast the autocast dtype for the Linear layers and fp32 for the rest
    (deepspeed/runtime/torch_autocast.py: PARAM_COMM_DTYPE on LOWER_PRECISION_SAFE_MODULES)."""
    dts = {d for _, _, _, d, _ in P.trainable_tensors}
    if s.autocast:
        linear = any(t.linear and tr for t, _, _, tr in P.weights) or bool(P.adapters)
        other = any(not t.linear and tr for t, _, _, tr in P.weights)
        dts = ({s.compute_dtype} if linear else set()) | ({"float32"} if other else set())
    return tuple(sorted(dts)) or (s.weights_dtype,)


def _fsdp_units(cut: Architecture, s: TrainingSetup, P: Any) -> Any:
    from . import fsdp as _fsdp

    return _fsdp.units(cut, P, s.lora_r if s.method in ("lora", "qlora") else 0)


def _fsdp_reshards(strategy: str, opts: Dict[str, Any]) -> bool:
    reshard = opts["reshard_after_forward"]
    return strategy != "fsdp_shard_grad_op" if reshard is None else bool(reshard)


def _fsdp_plan(cut: Architecture, s: TrainingSetup, P: Any, lay: _Layout, opts: Dict[str, Any], strategy: str,
               off_par: bool, states_bytes: float):
    """This stage's FSDP plan (:mod:`vramwidget.parallel.fsdp`): FSDP1 flat parameters or FSDP2 shards."""
    from . import fsdp as _fsdp

    units = _fsdp_units(cut, s, P)
    pdt = DTYPE_BYTES[s.compute_dtype] if s.autocast else DTYPE_BYTES[s.weights_dtype]
    tr = sum(p.numel for u in units for p in u.params if p.trains)
    per = states_bytes / tr if tr else 0.0
    reshard = _fsdp_reshards(strategy, opts)
    if opts["fsdp_version"] == 2:
        return _fsdp.fsdp2_plan(units, lay.shard, param_dtype_bytes=pdt, reduce_dtype_bytes=pdt,
                                state_bytes_per_elem=per, reshard_after_forward=reshard,
                                checkpointing=full_checkpointing(s), offload=off_par)
    return _fsdp.fsdp1_plan(units, lay.shard, param_dtype_bytes=pdt, state_bytes_per_elem=per,
                            reshard_after_forward=reshard, offload=off_par)


def _ds_plan(cut: Architecture, s: TrainingSetup, P: Any, lay: _Layout, opts: Dict[str, Any],
             W: Tuple[float, float], G: Tuple[float, float], S: Tuple[float, float], adapters: float):
    """The ZeRO plan of one GPU (:func:`vramwidget.parallel.zero.plan`) for this stage's slice."""
    cfg = opts["zero"]
    params = _zero.params_in_order(cut, P, s.lora_r if s.method in ("lora", "qlora") else 0)
    return _zero.plan(params, cfg, lay.shard, lay.shard_experts, weights_bytes=W, grads_bytes=G, states_bytes=S,
                      adapters_bytes=adapters, weights_dtype=s.weights_dtype, optimizer=s.optimizer,
                      checkpointing=full_checkpointing(s), num_layers=cut.num_layers, comm_dtypes=_comm_dtypes(P, s),
                      state_count=OPTIMIZER_STATE_COUNT.get(s.optimizer, 0))


def _comm_sizes(cut: Architecture, s: TrainingSetup, s_loc: TrainingSetup, P: Any, lay: _Layout, mega: bool,
                grads: float, weights: float) -> Dict[str, float]:
    """The sizes this GPU's collectives move (timing.communication)."""
    c = DTYPE_BYTES[s_loc.compute_dtype]
    T = s_loc.tokens
    n_moe = max(0, cut.num_layers - min(cut.dense_layers, cut.num_layers)) if cut.is_moe else 0
    return {
        "grad_bytes": (4.0 * P.trainable_numel) if mega else grads,
        "param_bytes": (P.trainable_numel if s.method in ("full", "freeze") else 0) * c if s.autocast else weights,
        "act_bytes": T * cut.hidden_size * c,
        "layers": cut.num_layers,
        "moe_bytes": T * max(cut.experts_per_token, 1) * cut.hidden_size * c if n_moe else 0.0,
        "moe_layers": n_moe,
        "kv_bytes": T * 2 * cut.num_kv_heads * cut.head_dim * c * lay.tp,
        "trainable": float(P.trainable_numel),
    }


# ----------------------------------------------------------------------------------
# One GPU's plan: what the strategy shards, gathers, keeps whole and adds
# ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class StateSharding:
    """The share of each model state the strategy leaves one GPU (the ZeRO paper's model
    states, 1/N sharded over N ranks; ``*_experts`` over the expert-data-parallel ranks),
    before offload moves any of it to the host."""

    weights: float = 1.0
    weights_experts: float = 1.0
    grads: float = 1.0
    grads_experts: float = 1.0
    states: float = 1.0
    states_experts: float = 1.0

    @classmethod
    def of(cls, strategy: str, N: int, Ne: int) -> "StateSharding":
        partitions = BY_NAME[strategy].partitions      # data/strategies.json
        w = "parameters" in partitions
        g = "gradients" in partitions
        o = "optimizer_states" in partitions
        return cls(1.0 / N if w else 1.0, 1.0 / Ne if w else 1.0, 1.0 / N if g else 1.0, 1.0 / Ne if g else 1.0,
                   1.0 / N if o else 1.0, 1.0 / Ne if o else 1.0)


def _buffer(lifetime: str, component: str, name: str, nbytes: float, formula: str, dtype: str = "") -> Buffer:
    return Buffer(TensorInfo(component, name, name, formula, dtype), float(nbytes), lifetime)


def _zero_layout(gpu: GpuLayout, zero_plan: Any, sh: StateSharding, lay: _Layout, opts: Dict[str, Any], off_par: bool,
                 comm_bytes: float) -> None:
    """ZeRO's GPU (DeepSpeed 0.19.8, :mod:`vramwidget.parallel.zero`): partitions, buffers, the gathered
    set per block and the step sub-group by sub-group."""
    cfg = opts["zero"]
    st = cfg.stage
    on_gpu = 1.0 - (cfg.offload_ratio if cfg.offload_optimizer != "none" else 0.0)
    temps = zero_plan.factors.get("optimizer temporaries", {}).get("optimizer_step", (1.0, 1.0))
    gpu.shares = Shares(weights=0.0 if off_par else (sh.weights if st == 3 else 1.0),
                       weights_experts=0.0 if off_par else (sh.weights_experts if st == 3 else 1.0),
                       adapters=0.0 if off_par else (sh.weights if st == 3 else 1.0),
                       states=sh.states * on_gpu, states_experts=sh.states_experts * on_gpu,
                       temps=temps[0], temps_experts=temps[1])
    gpu.buffers += [_buffer(*b) for b in _zero.buffers(zero_plan)]
    gpu.zero_step = [ZeroStepGroup(flat, fp32, temp) for fp32, flat, temp in zero_plan.step_parts] or None
    if st in (2, 3):
        # stage_1_and_2.py reduce_independent_p_g_buckets_and_remove_grads / stage3.py
        # __add_grad_to_ipg_bucket: each full gradient is copied into the IPG bucket and freed
        gpu.grads = "shard"
    if st == 3 and zero_plan.gather is not None:
        # partitioned_param_coordinator.py: the coordinator's gathered set at each block (the
        # module running, the prefetched and the reused; zero.gather_peaks); under parameter
        # offload the fetched module's partition is first copied to the GPU
        copy = ((-1, zero_plan.gather.module_bytes / lay.shard),) if off_par else ()
        gpu.gathered = {k: v + copy for k, v in zero_plan.gather.sets_by_layer.items()}
        gpu.gathered_info = TensorInfo("weights", "gathered parameters", "gathered parameters (ZeRO-3 coordinator)",
                                      "the module running + prefetched (stage3_prefetch_bucket_size) + kept for reuse "
                                      "(stage3_max_reuse_distance): zero.gather_peaks per block", "")
        # stage3.py __avg_scatter_grads: a full bucket is torch.cat'ed before its reduce-scatter
        gpu.flush_bucket_bytes = cfg.reduce_bucket_size * comm_bytes
        gpu.flush_factor = 1.0 + 1.0 / lay.shard


def _fsdp_layout(gpu: GpuLayout, cut: Architecture, s: TrainingSetup, P: Any, sh: StateSharding, lay: _Layout,
                 opts: Dict[str, Any], strategy: str, off_par: bool) -> None:
    """FSDP's GPU (PyTorch 2.13, :mod:`vramwidget.parallel.fsdp`): shards, the units gathered, each
    unit's post-backward reduce-scatter."""
    from . import fsdp as _fsdp

    N, v2 = lay.shard, opts["fsdp_version"] == 2
    f = 0.0 if off_par else 1.0
    gpu.shares = Shares(weights=sh.weights * f, weights_experts=sh.weights_experts * f, adapters=sh.weights * f,
                       states=sh.states * f, states_experts=sh.states_experts * f, temps=sh.states * f,
                       temps_experts=sh.states_experts * f)
    units = _fsdp_units(cut, s, P)
    pdt = DTYPE_BYTES[s.compute_dtype] if s.autocast else DTYPE_BYTES[s.weights_dtype]
    by = _fsdp.gathered_by_unit(units, N, param_dtype_bytes=pdt, version=2 if v2 else 1)
    if off_par:
        for layer, nb in _fsdp.shard_by_unit(units, N).items():
            by[layer] = by.get(layer, 0.0) + nb
    gpu.root_bytes = by.pop(-1, 0.0)
    gpu.unit_bytes = by
    gpu.unit_info = TensorInfo("weights", "gathered units", f"FSDP{2 if v2 else 1} unsharded parameters",
                              "the unit's parameters all-gathered in param_dtype (padded: vramwidget.parallel.fsdp)", "")
    reshard = _fsdp_reshards(strategy, opts)
    # FSDP1: forward_prefetch off by default, BACKWARD_PRE gathers the next unit before the
    # current one's backward (_runtime_utils.py _prefetch_handle); FSDP2: the all-gather output
    # is kept until the next all-gather (_fsdp_param_group.py AllGatherState)
    gpu.units_forward = (2 if v2 else 1) if reshard else 0
    gpu.units_backward = 2 if reshard else 1
    gpu.grads = "unit"
    gpu.grad_shard = sh.grads * f
    gpu.grad_scale = DTYPE_BYTES[s.compute_dtype] / 4.0 if s.autocast else 1.0
    # FSDP2 _fsdp_collectives.py foreach_reduce copies the unit's gradients into one
    # reduce-scatter input and frees them; FSDP1 _runtime_utils.py _reduce_grad reduce-scatters
    # the flat parameter's own gradient into a new sharded gradient (no copy)
    gpu.reduce_scatter_copy = v2
    gpu.drop_casts = True


def _common_layout(gpu: GpuLayout, strategy: str, lay: _Layout, opts: Dict[str, Any], sh: StateSharding,
                   grads_bytes: float, trainable: Tuple[int, int], s_loc: TrainingSetup, ms: Dict[str, float]) -> None:
    """DDP's buckets, Megatron's buffers and NCCL's communicator buffers."""
    tr, tr_e = trainable
    if strategy == "ddp":
        # torch/nn/parallel/distributed.py Reducer: buckets made at wrap time
        if opts["ddp_bucket_view"]:
            gpu.grads = "none"
            gpu.buffers.append(_buffer("startup", "gradients", "DDP buckets (gradients as bucket views)", grads_bytes,
                                      "every gradient, in buckets allocated at wrap time"))
        else:
            cap = opts["bucket_mb"] * 1e6 if opts["bucket_mb"] else DDP_BUCKET_BYTES
            gpu.buffers.append(_buffer("startup", "gradients", "DDP reducer buckets (gradient copy)", grads_bytes,
                                      f"every gradient again, in {max(1, math.ceil(grads_bytes / cap))} buckets of "
                                      f"{cap / 2**20:.0f} MiB (gradient_as_bucket_view=False)"))
            ms["communication buffers"] = grads_bytes
    if strategy in MEGATRON:
        gpu.grads = "none"         # param.grad is never allocated: gradients go to fp32 main_grad buffers
        gpu.shares = Shares(states=sh.states, states_experts=sh.states_experts, temps=0.0, temps_experts=0.0)
        if s_loc.weights_dtype != "float32":
            # Float16OptimizerWithFloat16Params keeps an fp32 copy of 16-bit parameters
            # (megatron/core/optimizer/optimizer.py); fp32 parameters step in FP32Optimizer
            master = 4.0 * (tr * sh.states + tr_e * sh.states_experts)
            ms["fp32 master weights"] = master
            gpu.buffers.append(_buffer("startup", "optimizer states", "fp32 master weights", master,
                                      f"4 B x trainable params / {lay.shard} (Megatron optimizer's fp32 copy)",
                                      "float32"))
        main = 4.0 * (tr + tr_e)
        ms["fp32 gradients"] = main
        gpu.buffers.append(_buffer("startup", "gradients", "fp32 main gradients (Megatron DDP buffer)", main,
                                  "4 B x trainable params, allocated when the model is wrapped; all-reduced (or "
                                  "reduce-scattered with the distributed optimizer) in place", "float32"))
    # NCCL: every communicator this GPU belongs to keeps send and receive buffers of
    # NCCL_BUFFSIZE (default 4 MiB) per channel (NCCL environment variables, "NCCL_BUFFSIZE")
    groups = sum(1 for size in (lay.dp * lay.cp, lay.tp, lay.pp, lay.ep) if size > 1)
    nccl = groups * 2 * opts["nccl_channels"] * opts["nccl_buffsize_bytes"]
    if nccl:
        gpu.buffers.append(_buffer("startup", "workspace", "NCCL communicator buffers", nccl,
                                  f"{groups} communicator(s) x 2 (send, receive) x {opts['nccl_channels']} channels x "
                                  f"NCCL_BUFFSIZE ({opts['nccl_buffsize_bytes'] / 2**20:g} MiB)"))
        ms["NCCL buffers"] = nccl


def _local_setup(arch: Architecture, s: TrainingSetup, strategy: str, lay: _Layout
                 ) -> Tuple[TrainingSetup, List[str]]:
    """The setup each GPU runs (its sequence share, its micro-batches, the engine's
    precision and optimizer states) and the notes that say so."""
    s_loc = s
    if lay.cp > 1:
        s_loc = replace(s_loc, seq_len=s.seq_len // lay.cp)
    if lay.pp > 1 and lay.micro_batches > s_loc.grad_accum_steps:
        s_loc = replace(s_loc, grad_accum_steps=lay.micro_batches)   # gradients accumulate over micro-batches
    pre_notes: List[str] = []
    if strategy in MEGATRON and s.autocast:
        # Megatron has no autocast mode: --bf16 / --fp16 wrap the model in Float16Module
        # (megatron/core/transformer/module.py), 16-bit parameters with the optimizer's fp32 copy
        s_loc = replace(s_loc, precision="bf16" if s.compute_dtype == "bfloat16" else "fp16")
        pre_notes.append(f"Megatron runs {s.precision} as {s_loc.precision} parameters with an fp32 optimizer copy "
                         f"(--{s_loc.precision}: Float16Module); it has no torch autocast mode")
    if strategy in DEEPSPEED + MEGATRON and s.optimizer in OPTIMIZER_STATE_COUNT and not s.optimizer_state_dtypes:
        # (the optimizers whose states are in the parameter's dtype: training.OPTIMIZER_STATE_COUNT)
        fp32_states = ("float32",) * OPTIMIZER_STATE_COUNT[s.optimizer]
        # DeepSpeed and Megatron keep fp32 moments.  Where every trainable parameter's own
        # states are fp32 already (fp32 weights, LoRA's fp32 adapters; Megatron's 16-bit
        # parameters above are not), the setup is left as it is: the same states, and so the
        # one-GPU setup's plan, not a second plan of the same events
        if any(state_dtypes(s_loc, t[3]) != fp32_states for t in param_storage(arch, s_loc).trainable_tensors):
            s_loc = replace(s_loc, optimizer_state_dtypes=fp32_states)
    if strategy in DEEPSPEED and s.autocast:
        pre_notes.append("DeepSpeed with fp32 parameters and torch autocast is its torch_autocast mode (fp32 "
                         "partitions, autocast casts the gathered weights); HF Trainer's bf16=True with DeepSpeed "
                         "is DeepSpeed's bf16 mode: precision='bf16'")
    return s_loc, pre_notes


class AboveFloor(Exception):
    """Raised by :func:`estimate_parallel_setup` inside :func:`giving_up_above` when a GPU's
    lower bound (``plan.per_gpu.floor_bytes``) is one the caller has no use for."""

    def __init__(self, floor_bytes: float):
        super().__init__(f"a GPU holds at least {floor_bytes / GIB:.2f} GiB")
        self.floor_bytes = floor_bytes


#: the caller's test of a GPU's lower bound (True: give up), set by :func:`giving_up_above`
_GIVE_UP: ContextVar[Optional[Callable[[float], bool]]] = ContextVar("vramwidget_give_up", default=None)


@contextmanager
def giving_up_above(give_up: Callable[[float], bool]) -> Iterator[None]:
    """Within this block, an estimate whose GPU's allocated peak is bound to be one that
    ``give_up(floor_bytes)`` refuses raises :class:`AboveFloor` before that GPU's step plan
    is written (the solvers' candidates that cannot fit a card: fit.solver)."""
    token = _GIVE_UP.set(give_up)
    try:
        yield
    finally:
        _GIVE_UP.reset(token)


#: pass a GPU over by the bounds of :func:`_pre_plan_floors` before its slice's plan is
#: written (off: by ``per_gpu.floor_bytes`` alone, once the plan is written; the tests check
#: each bound)
PRE_PLAN_FLOOR = True


def _pre_plan_floors(cut: Architecture, s_loc: TrainingSetup, P: Any, strategy: str, lay: _Layout,
                     opts: Dict[str, Any], gathers: bool) -> Iterator[float]:
    """Lower bounds of the GPU's allocated peak before its slice's plan is written, the
    cheaper first: under ZeRO-2 without parameter offload, what the load leaves
    (``plan.step.load_floor_bytes``: kept whole, live to the end) with ZeRO's gradient
    partition (``grads_in_partition``, this rank's share of every trainable element's
    gradient, at 2 B an element or more: made at the step's first gradient and kept at least
    to the optimizer step, ``parallel.zero.plan``; Llama 2 7B full under ZeRO-Offload on one
    RTX 4090: 13.5 GB of bf16 weights and 13.5 GB of partition, over the card before a plan
    is written); where the GPU holds its slice's first forward whole
    (:func:`_keeps_first_forward`), the most live there (``plan.step.forward_floor_bytes``,
    a fifth of a plan's events)."""
    if strategy in DEEPSPEED and opts["zero"].stage == 2 and not opts["offload_params"]:
        tr_e = sum(n for _, g, n, _, _ in P.trainable_tensors if g == "experts")
        tr = P.trainable_numel - tr_e
        yield load_floor_bytes(cut, s_loc) + 2.0 * (tr / lay.shard + tr_e / lay.shard_experts)
    if _keeps_first_forward(strategy, lay, opts, gathers):
        yield forward_floor_bytes(cut, s_loc)


def _keeps_first_forward(strategy: str, lay: _Layout, opts: Dict[str, Any], gathers: bool) -> bool:
    """Whether the GPU's plan holds every tensor of its slice's first forward whole: the
    weights and adapters unsharded on the device (no ZeRO-3, no FSDP shard gathering, no
    parameter offload) and the activations at their full size (no sequence parallel); the
    layout may add buffers but drops none of them (``plan.per_gpu.kept_share`` is 1 for each:
    tests/test_parallel_plan.py checks it against the layouts :func:`_per_gpu_stage`
    builds).  Then the most live in the slice's first forward
    (``plan.step.forward_floor_bytes``) is a lower bound of the GPU's allocated peak."""
    if opts["offload_params"] or gathers or lay.sp:
        return False
    return not (strategy in DEEPSPEED and opts["zero"].stage == 3)


def _per_gpu_stage(arch: Architecture, s: TrainingSetup, s_loc: TrainingSetup, lay: _Layout, opts: Dict[str, Any],
                   first: int, last: int, embed: bool, head: bool, in_flight: int):
    """One pipeline stage's GPU: its slice's step plan transformed into that GPU's
    (:mod:`vramwidget.plan.per_gpu`), the estimate and the replay both read from it; the model
    states by part, the host and NVMe bytes."""
    strategy = lay.strategy
    cut, uncut = stage_slice(arch, first, last, embed, head, lay.tp, lay.ep)
    notes: List[str] = []
    N, Ne = lay.shard, lay.shard_experts
    off_opt, off_par = opts["offload_optimizer"], opts["offload_params"]
    ds, fsdp, mega = strategy in DEEPSPEED, strategy in FSDP, strategy in MEGATRON
    gathers = fsdp and N > 1        # FSDP with one rank per shard group runs as NO_SHARD
    sh = StateSharding.of(strategy, N, Ne)

    # -- the stage's parameters, gradients and states at full (unsharded) size ---------------
    P = param_storage(cut, s_loc)
    give_up = _GIVE_UP.get()
    if give_up is not None and PRE_PLAN_FLOOR and not has_plan(cut, s_loc):
        for floor in _pre_plan_floors(cut, s_loc, P, strategy, lay, opts, gathers):
            if give_up(floor):
                raise AboveFloor(floor)
    view = plan_view(cut, s_loc)
    step, loaded = _live_bytes(view, "optimizer_step"), _live_bytes(view, "after_load")
    G, Ge = step.get(("gradients", False), 0.0), step.get(("gradients", True), 0.0)
    S, Se = step.get(("optimizer states", False), 0.0), step.get(("optimizer states", True), 0.0)
    Tt, Tte = step.get(("optimizer temporaries", False), 0.0), step.get(("optimizer temporaries", True), 0.0)
    W, We = loaded.get(("weights", False), 0.0), loaded.get(("weights", True), 0.0)
    Qc = sum(v for (c, _), v in loaded.items() if c == "quantization constants")
    Qa = sum(v for (c, _), v in loaded.items() if c == "adapters")
    tr_e = sum(n for _, g, n, _, _ in P.trainable_tensors if g == "experts")
    tr = P.trainable_numel - tr_e
    ms: Dict[str, float] = {"weights": W * sh.weights + We * sh.weights_experts,
                            "quantization constants + adapters": Qc + Qa * sh.weights,
                            "gradients": (G * sh.grads + Ge * sh.grads_experts) if not mega else 0.0,
                            "optimizer states": S * sh.states + Se * sh.states_experts}
    cpu: Dict[str, float] = {}
    nvme: Dict[str, float] = {}
    gpu = GpuLayout()
    o_gpu = sh.states
    if ds:
        zero_plan = _ds_plan(cut, s_loc, P, lay, opts, (W, We), (G, Ge), (S, Se), Qa)
        qa = ms["quantization constants + adapters"]
        ms = dict(zero_plan.model_states, **{"quantization constants + adapters": qa})
        cpu.update(zero_plan.cpu)
        nvme.update(zero_plan.nvme)
        notes.extend(zero_plan.notes)
        _zero_layout(gpu, zero_plan, sh, lay, opts, off_par, max(DTYPE_BYTES[d] for d in _comm_dtypes(P, s_loc)))
        o_gpu = sh.states * (1.0 - opts["zero"].offload_ratio) if off_opt else sh.states
    elif gathers:
        fsdp_plan = _fsdp_plan(cut, s_loc, P, lay, opts, strategy, off_par, S + Se)
        ms["gathered parameters"] = fsdp_plan.unsharded_params + fsdp_plan.all_gather
        ms["gathered gradients"] = fsdp_plan.unsharded_grads
        ms["reduce-scatter buffers"] = fsdp_plan.reduce_scatter
        if off_par:
            ms["offloaded shards on the GPU"] = fsdp_plan.shard_copy
            cpu.update({"optimizer states": S * sh.states + Se * sh.states_experts,
                        "optimizer temporaries": Tt * sh.states + Tte * sh.states_experts,
                        "gradients": G * sh.grads + Ge * sh.grads_experts,
                        "parameters": W * sh.weights + We * sh.weights_experts + Qa * sh.weights})
        if s_loc.autocast:
            notes.append("FSDP MixedPrecision gathers the shards in the compute dtype, so the autocast weight cache "
                         "is not counted")
        _fsdp_layout(gpu, cut, s_loc, P, sh, lay, opts, strategy, off_par)
    elif fsdp:
        gpu.shares = Shares(states=sh.states, states_experts=sh.states_experts, temps=sh.states,
                           temps_experts=sh.states_experts)
    if not ds:
        ms["communication buffers"] = 0.0
    _common_layout(gpu, strategy, lay, opts, sh, G + Ge, (tr, tr_e), s_loc, ms)
    if lay.sp:
        # sequence parallel: the T x h tensors outside the tensor-parallel regions split too,
        # every activation 1/t of the unsharded block's (Korthikanti et al.)
        a_cut = sum(v for (c, _), v in _live_bytes(view, "forward").items() if c == "activations")
        a_full = sum(v for (c, _), v in _live_bytes(plan_view(uncut, s_loc), "forward").items() if c == "activations")
        if a_cut > 0:
            gpu.activation_share = (a_full / lay.tp) / a_cut
    if in_flight > 1:
        # 1F1B: stage i keeps min(p - i, m) micro-batches' saved activations
        acts = sum(v for (c, _), v in _live_bytes(view, "forward").items() if c == "activations") \
            * gpu.activation_share
        gpu.in_flight = _buffer("step", "activations", f"{in_flight - 1} more micro-batches in flight (1F1B)",
                               (in_flight - 1) * acts, f"stage keeps min(pp - stage, micro-batches) = {in_flight} "
                                                       f"micro-batches' saved activations")
    if give_up is not None:
        floor = floor_bytes(view, gpu)
        if give_up(floor):
            raise AboveFloor(floor)
    E = estimate_setup(cut, s_loc)
    est = E if gpu.changes_nothing() else _per_gpu_estimate(E, cut, s_loc, gpu, notes, (strategy, lay))
    # the per-GPU estimate reports the whole model's parameter counts and the user's setup
    est = _relabel(est, arch, s, E)
    # the step time (timing.py): this GPU's slice, its share of the optimizer update, and
    # the sizes its communication moves (estimate_parallel_setup attaches the collectives)
    est.sources.setup = s_loc
    est.sources.work = _sharded_work(E.sources.work, o_gpu if ds or not (off_opt or (fsdp and off_par)) else 0.0)
    est.sources.communication_sizes = _comm_sizes(cut, s, s_loc, P, lay, mega, G + Ge, W + We)
    return est, ms, cpu, cut.params_total, notes, nvme


def _per_gpu_estimate(E: Estimate, cut: Architecture, s_loc: TrainingSetup, gpu: GpuLayout, notes: List[str],
                      key: Any) -> Estimate:
    """One GPU's Estimate, every figure a view of its own plan: the phases and the peak
    (``views.totals``), the trees (``views.tree``), the reserve and the verdict (the caching
    allocator replayed over the same plan's events: :mod:`vramwidget.parallel.sharded_replay`)."""
    from . import sharded_replay
    from ..plan import TREE_PHASES
    from ..plan.views import totals, tree

    view = plan_view(cut, s_loc)
    plan, ix = _gpu_plan(view, gpu, cut.num_layers)
    sizes = view.sizes            # read at the slice's size (a plan of one size has its own)
    tot = totals(ix, view.cfg, *sizes)
    phases = {k: float(v) for k, v in tot.phases_bytes.items()}
    peak = float(tot.peak_allocated_bytes)

    def run(capacity_bytes: Optional[float] = None, record: bool = False) -> Any:
        return sharded_replay.replay_gpu_plan(plan, view.cfg, capacity_bytes, record, ix, sizes)

    def comps_at(reserved_b: float, exact: bool = True) -> List[Node]:
        return list(est.phase_components[tot.peak_phase]) + [
            Node("allocator reserve", bytes=max(0.0, reserved_b - peak),
                 formula="caching allocator: cached free blocks of this GPU's replayed step plan"),
            Node("cuda context", bytes=E.cuda_context_bytes, formula=E.cuda_context_source)]

    def provisional() -> Tuple[float, bool]:
        res = sharded_replay.cached(plan, ix, sizes)
        if res is not None:
            return max(float(res.max_reserved_bytes), peak), True
        # until it runs: the slice's single-GPU reserve per allocated byte
        return peak * max(1.0, E.provisional_reserved_bytes / E.peak_allocated_bytes
                          if E.peak_allocated_bytes else 1.0), False

    est = Estimate(model_name=E.model_name, setup=E.setup, params_total=E.params_total,
                   params_trainable=E.params_trainable, components=None, phases_bytes=phases,
                   peak_phase=tot.peak_phase, peak_allocated_bytes=peak,
                   reserved_bytes=lambda: max(float(run().max_reserved_bytes), peak),
                   cuda_context_bytes=E.cuda_context_bytes, flops_per_step=E.flops_per_step,
                   recompute_overhead=E.recompute_overhead, notes=list(E.notes) + notes,
                   builder=lambda: (None, {p: tree(ix, tot, tot.phase_events[p]) for p in TREE_PHASES}),
                   cuda_context_source=E.cuda_context_source)
    est.sources.components_at = comps_at
    est.sources.provisional = provisional
    est.sources.replay = run
    est.capacity_judged = True
    est.sources.replay_key = (cut, ("per GPU", s_loc, key, id(plan)))
    est.sources.reserved_from_replay = lambda res: max(float(res.max_reserved_bytes), peak)
    return est


#: (id of the slice's plan index, its size, the layout) -> (index, the GPU's plan, its index):
#: one plan per GPU setup, so that its replays (sharded_replay, gpus.judge_on's capacity
#: replays) are cached, and a solver asking again (min_gpus, then suggestions) reads it
_GPU_PLANS: Dict[Tuple[Any, ...], Tuple[Any, StepPlan, Any]] = {}
_MAX_GPU_PLANS = 64


def _gpu_plan(view: Any, gpu: GpuLayout, num_layers: int) -> Tuple[StepPlan, Any]:
    """The GPU's plan (``per_gpu.per_gpu_plan`` of the slice's ``view``) and its index: for
    a symbolic slice, one plan for every size of the setup shape and layout where the writer
    can write one (a batch or sequence change then costs no new plan: the widget, the
    solvers' probes), else the plan of the view's own size."""
    from ..plan.views import PlanIndex

    lay = repr(gpu)
    if view.symbolic:
        key = (id(view.index), "shape", lay)
        hit = _GPU_PLANS.get(key)
        if hit is None or hit[0] is not view.index:
            with gc_paused():       # as plan.plan_index writes a plan: no collection meanwhile
                hit = _written_gpu_plan(view.index, gpu, num_layers, symbolic=True)
            _store_gpu_plan(key, hit)
        if hit[1] is not None:
            return hit[1], hit[2]
    key = (id(view.index), view.sizes, lay)
    hit = _GPU_PLANS.get(key)
    if hit is not None and hit[0] is view.index:
        return hit[1], hit[2]
    with gc_paused():
        if view.symbolic:
            plan = per_gpu_plan(_concrete(view), gpu, num_layers)
            hit = (view.index, plan, PlanIndex(plan))
        else:
            hit = _written_gpu_plan(view.index, gpu, num_layers)
    _store_gpu_plan(key, hit)
    return hit[1], hit[2]


def _written_gpu_plan(ix: Any, gpu: GpuLayout, num_layers: int, symbolic: bool = False) -> Tuple[Any, Any, Any]:
    """(the slice's index ``ix``, the GPU's plan from the slice's plan, its index): for a
    layout that only adds start-up buffers, both read off the slice's index
    (``per_gpu.startup_buffers_plan``); else written by ``per_gpu.per_gpu_plan`` and indexed.
    A symbolic slice whose plan the layout cannot write for every size gives (ix, None,
    None), remembered: that layout is then written size by size."""
    from ..plan.size import NotPolynomial
    from ..plan.views import PlanIndex

    both = startup_buffers_plan(ix, gpu)
    if both is not None:
        return (ix,) + both
    try:
        plan = per_gpu_plan(ix.plan, gpu, num_layers)
    except NotPolynomial:
        if not symbolic:
            raise
        return ix, None, None
    return ix, plan, PlanIndex(plan)


#: the most events the cached GPU plans hold together (what ~20 GPU plans of a 70B slice hold:
#: a plan and its index are ~25 MB there)
_MAX_GPU_PLAN_EVENTS = 2_400_000


def _store_gpu_plan(key: Tuple[Any, ...], value: Tuple[Any, Any, Any]) -> None:
    held = sum(len(v[1].events) for v in _GPU_PLANS.values() if v[1] is not None)
    new = len(value[1].events) if value[1] is not None else 0
    if len(_GPU_PLANS) >= _MAX_GPU_PLANS or held + new > _MAX_GPU_PLAN_EVENTS:
        _GPU_PLANS.clear()
    _GPU_PLANS[key] = value


def _concrete(view: Any) -> StepPlan:
    """A symbolic plan's events at the view's own size, as a plan."""
    p = view.plan
    return StepPlan(view.events(), p.info, p.marks, p.steps, p.notes, p.host_bytes, p.repeats, p.passes_copied,
                    p.copies)


def _sharded_work(base: Any, optimizer_share: float):
    """The single-GPU estimate's step work with the optimizer update over this GPU's share of
    the states (ZeRO/FSDP shards; none left when the optimizer runs on the CPU)."""
    def work():
        fwd, bwd, rec, opt = base()
        return fwd, bwd, rec, opt.scaled(optimizer_share)
    return work


def _relabel(est: Estimate, arch: Architecture, s: TrainingSetup, E: Estimate) -> Estimate:
    """The per-GPU estimate names the whole model's parameter count and the user's setup
    (not the slice's count or the per-GPU sequence length)."""
    setup = s.to_dict()
    if est.params_total == arch.params_total and est.setup == setup:
        return est
    if est is E:   # do not alter the estimator's object
        est = E.relabelled(setup, arch.params_total)
    est.params_total = arch.params_total
    est.setup = setup
    return est


def _live_bytes(view: Any, phase: str) -> Dict[Tuple[str, bool], float]:
    """The slice's plan tensors live at ``phase``'s peak: requested bytes by (component, whether
    a routed expert's), read from what each tensor is (its TensorInfo)."""
    import numpy as np

    ix, tot = view.index, view.totals
    rows = live_rows(ix, tot.phase_events[phase])
    gid, distinct, _loaded = row_infos(ix)
    live = gid[rows]
    # whole bytes summed per tensor description (int64: exact, so in any order), then per
    # (component, expert), in the order the rows first meet each
    sums = np.zeros(len(distinct), dtype=np.int64)
    np.add.at(sums, live, np.asarray(tot.requested_bytes, dtype=np.int64)[rows])
    uniq, first = np.unique(live, return_index=True)
    out: Dict[Tuple[str, bool], float] = {}
    for g in uniq[np.argsort(first, kind="stable")].tolist():
        i = distinct[g]
        k = (i.component, i.group == "experts")
        out[k] = out.get(k, 0.0) + float(sums[g])
    return out
