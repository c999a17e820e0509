"""How long one training step takes on a GPU: matmuls, memory-bound kernels, launch overhead.

A step runs three phases one after another.  Each phase's time on the GPU is the sum of

matmul          FLOPs of every matmul (from the shapes the estimate traces) at the GPU's
                dense peak for the dtype the matmul actually runs in, times the fraction
                of peak large GEMMs reach (``MATMUL_EFFICIENCY``)
attention       the attention core's FLOPs (FlashAttention-style kernels) at
                ``ATTENTION_EFFICIENCY`` of the compute dtype's peak; eager and math
                attention run as plain matmuls, their b x a x s x s scores as memory traffic
memory          bytes that bandwidth-bound kernels move (norms, activations, residual adds,
                casts, RoPE, softmax and loss over the logits, optimizer updates, 4-bit
                dequantisation) at ``BANDWIDTH_EFFICIENCY`` of the GPU's peak bandwidth
kernels         ``GPU_SECONDS_PER_KERNEL`` per kernel launched

and PyTorch's eager mode dispatches every op from the CPU: when the host needs longer to
issue a phase's ops (``CPU_SECONDS_PER_OP`` each) than the GPU needs to run them, the GPU
waits and the phase takes the host's time.  That is what makes small models, LoRA's many
small adapter ops and bitsandbytes' per-layer Python slower than their FLOPs say.

Only the GPU-level constants below were fitted, all at once, to the 45 measured H200
steps of ``data/h200_training_a.jsonl`` (``step_seconds``); nothing depends on a model,
a case or a GPU's name.  Other GPUs use their datasheet peaks (``data/gpus.json``) with the
same fractions: an assumption, stated in the README.

Symbols: T tokens per micro-batch (b x s), h hidden, V vocabulary, L layers, a heads, d head dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

from .units import DTYPE_BYTES
from .parallel.strategies import strategy as strategy_record

# ----------------------------------------------------------------------------------
# The fitted GPU-level constants (one set for every model and setup)
# ----------------------------------------------------------------------------------

#: fraction of the dense datasheet peak that large cuBLAS GEMMs reach (bf16 and fp32 alike)
MATMUL_EFFICIENCY = 0.75
#: fraction of the compute dtype's peak that the attention core (FlashAttention 2 /
#: memory-efficient SDPA kernels) reaches, forward and backward
ATTENTION_EFFICIENCY = 0.35
#: fraction of the peak memory bandwidth that elementwise, reduction and optimizer kernels reach
BANDWIDTH_EFFICIENCY = 0.60
#: GPU time per kernel beyond its work (launch, ramp-up, tail)
GPU_SECONDS_PER_KERNEL = 5e-6
#: host time to dispatch one plain tensor op from Python (dispatcher + launch): optimizer loops
CPU_SECONDS_PER_OP = 8e-6
#: host time per op of the model's forward and backward: the same plus nn.Module calls and
#: autograd recording (per tensor the traced forward creates, model/activations.py)
CPU_SECONDS_PER_MODEL_OP = 40e-6

#: fraction of the peak memory bandwidth bitsandbytes' blockwise 8-bit optimizer kernels reach
#: (they dequantise and requantise both states through a 256-entry code per element)
EIGHT_BIT_OPTIMIZER_BANDWIDTH_EFFICIENCY = 0.08

#: FlashAttention 2's backward runs 5 matmuls of the forward's 2 (it recomputes the scores)
FLASH_BACKWARD_FLOPS_RATIO = 2.5

CONSTANTS: Dict[str, float] = {
    "matmul_efficiency": MATMUL_EFFICIENCY,
    "attention_efficiency": ATTENTION_EFFICIENCY,
    "bandwidth_efficiency": BANDWIDTH_EFFICIENCY,
    "gpu_seconds_per_kernel": GPU_SECONDS_PER_KERNEL,
    "cpu_seconds_per_op": CPU_SECONDS_PER_OP,
    "cpu_seconds_per_model_op": CPU_SECONDS_PER_MODEL_OP,
    "eight_bit_optimizer_bandwidth_efficiency": EIGHT_BIT_OPTIMIZER_BANDWIDTH_EFFICIENCY,
}


@dataclass
class Work:
    """What one phase asks of the GPU."""

    matmul_flops: Dict[str, float] = field(default_factory=dict)    # by the dtype the matmul runs in
    attention_flops: Dict[str, float] = field(default_factory=dict)
    memory_bytes: float = 0.0
    kernels: float = 0.0
    ops: float = 0.0                   # plain tensor ops the host dispatches (optimizer loops, hooks)
    model_ops: float = 0.0             # ops of the model's modules (nn.Module call + autograd recording)
    parts: Dict[str, float] = field(default_factory=dict)   # memory bytes by what moves them
    pcie_bytes: float = 0.0            # host <-> GPU copies on a side stream (activation offloading)

    def add_flops(self, dtype: str, flops: float, attention: bool = False) -> None:
        d = self.attention_flops if attention else self.matmul_flops
        d[dtype] = d.get(dtype, 0.0) + flops

    def add_bytes(self, what: str, nbytes: float) -> None:
        self.memory_bytes += nbytes
        self.parts[what] = self.parts.get(what, 0.0) + nbytes

    def scaled(self, k: float) -> "Work":
        return Work({d: f * k for d, f in self.matmul_flops.items()},
                    {d: f * k for d, f in self.attention_flops.items()},
                    self.memory_bytes * k, self.kernels * k, self.ops * k, self.model_ops * k,
                    {w: b * k for w, b in self.parts.items()}, self.pcie_bytes * k)

    def plus(self, other: "Work") -> "Work":
        out = self.scaled(1.0)
        for d, f in other.matmul_flops.items():
            out.add_flops(d, f)
        for d, f in other.attention_flops.items():
            out.add_flops(d, f, attention=True)
        for w, b in other.parts.items():
            out.add_bytes(w, b)
        out.kernels += other.kernels
        out.ops += other.ops
        out.model_ops += other.model_ops
        out.pcie_bytes += other.pcie_bytes
        return out

    @property
    def flops(self) -> float:
        return sum(self.matmul_flops.values()) + sum(self.attention_flops.values())


@dataclass
class PhaseTime:
    """One phase's time, split by what it is spent on."""

    matmul_seconds: float
    attention_seconds: float
    memory_seconds: float
    kernel_seconds: float
    cpu_seconds: float
    flops: float
    memory_bytes: float
    kernels: float
    pcie_seconds: float = 0.0     # copies on a side stream, overlapped with the phase's kernels

    @property
    def gpu_seconds(self) -> float:
        return self.matmul_seconds + self.attention_seconds + self.memory_seconds + self.kernel_seconds

    @property
    def seconds(self) -> float:
        return max(self.gpu_seconds, self.cpu_seconds, self.pcie_seconds)

    @property
    def bound(self) -> str:
        """What limits the phase: compute (matmuls + attention), memory, kernel launches, the
        host, or PCIe copies."""
        if self.pcie_seconds > max(self.gpu_seconds, self.cpu_seconds):
            return "PCIe"
        if self.cpu_seconds > self.gpu_seconds:
            return "host (op dispatch)"
        parts = {"compute": self.matmul_seconds + self.attention_seconds, "memory bandwidth": self.memory_seconds,
                 "kernel launches": self.kernel_seconds}
        return max(parts, key=parts.get)

    def to_dict(self) -> Dict[str, Any]:
        return {"seconds": self.seconds, "matmul_seconds": self.matmul_seconds,
                "attention_seconds": self.attention_seconds, "memory_seconds": self.memory_seconds,
                "kernel_seconds": self.kernel_seconds, "gpu_seconds": self.gpu_seconds,
                "cpu_dispatch_seconds": self.cpu_seconds, "pcie_seconds": self.pcie_seconds, "flops": self.flops,
                "memory_bytes": self.memory_bytes, "kernels": self.kernels, "bound": self.bound}


def phase_time(work: Work, gpu: Any, tf32: bool = False) -> PhaseTime:
    """Seconds for one phase's work on ``gpu`` (a :class:`~vramwidget.gpus.GPU`)."""
    mm = 0.0
    for dtype, f in work.matmul_flops.items():
        mm += f / (_peak(gpu, dtype, tf32) * MATMUL_EFFICIENCY)
    at = 0.0
    for dtype, f in work.attention_flops.items():
        at += f / (_peak(gpu, dtype, tf32) * ATTENTION_EFFICIENCY)
    bw = gpu.memory_bandwidth_bytes_per_second
    slow = work.parts.get("8-bit optimizer update", 0.0)
    mem = (work.memory_bytes - slow) / (bw * BANDWIDTH_EFFICIENCY) + slow / (bw * EIGHT_BIT_OPTIMIZER_BANDWIDTH_EFFICIENCY)
    pcie = work.pcie_bytes / ((gpu.pcie_gb_per_s or 16.0) * 1e9 * COMM_EFFICIENCY) if work.pcie_bytes else 0.0
    return PhaseTime(mm, at, mem, work.kernels * GPU_SECONDS_PER_KERNEL,
                     work.ops * CPU_SECONDS_PER_OP + work.model_ops * CPU_SECONDS_PER_MODEL_OP,
                     work.flops, work.memory_bytes, work.kernels, pcie)


def _peak(gpu: Any, dtype: str, tf32: bool) -> float:
    p = gpu.peak_flops_per_second(dtype, tf32)
    if not p:
        p = gpu.peak_flops_per_second("float32", False)
    return p


def has_timing(gpu: Any) -> bool:
    """Whether the catalogue gives this GPU the figures a step time needs."""
    return bool(gpu.memory_bandwidth_gb_per_s and gpu.peak_flops_per_second("float32"))


# ----------------------------------------------------------------------------------
# Optimizer updates: bytes each kernel sequence moves per element, and ops per tensor
# ----------------------------------------------------------------------------------

def optimizer_work(s: Any, trainable: List[Tuple[str, str, int, str, int]], state_dtypes: Any) -> Work:
    """The optimizer step's memory traffic and kernel count.

    ``trainable``: (name, group, numel, dtype, numel of one instance) per trainable tensor
    (repeated layers together); ``state_dtypes(param_dtype)``: the state dtypes.

    Bytes per element are counted from the kernels each implementation runs:

    * AdamW foreach (torch/optim/adam.py ``_multi_tensor_adam``): weight decay ``p *= 1 - lr wd``,
      ``lerp_(m, g)``, ``v *= b2``, ``addcmul_(v, g, g)``, ``t = sqrt(v)``, ``t /= bc2``,
      ``t += eps``, ``addcdiv_(p, m, t)``: p 4, g 2, m 3, v 5 accesses and 6 of the temporary t;
      one launch per foreach op per chunk of tensors.
    * AdamW fused (``_fused_adamw_``): one kernel reads p, g, m, v and writes p, m, v.
    * bitsandbytes 8-bit / paged AdamW (bitsandbytes/optim/optimizer.py ``Optimizer8bit.step``):
      a Python loop over parameters, one blockwise update kernel each reading p, g and the
      8-bit (or 32-bit) states with their absmax, writing them back.
    * SGD with momentum (``_multi_tensor_sgd``): ``buf *= mu``, ``buf += g``, ``p -= lr buf``.
    * Adafactor (transformers/optimization.py ``Adafactor.step``, ``scale_parameter=False``):
      a Python loop over parameters: fp32 copies of g and p, ``g**2 + eps``, row and column
      means, the rank-1 reconstruction, ``update *= g``, an RMS clip, ``p -= update``,
      ``p.copy_`` back: ~100 bytes and ~25 ops per element / tensor for 16-bit parameters.
    """
    w = Work()
    opt = s.optimizer
    n_tensors = 0.0
    for name, group, numel, dtype, each in trainable:
        n_tensors += numel / max(each, 1)
        pb = DTYPE_BYTES.get(dtype, 4)
        gb = pb
        if opt in ("adamw", "adamw_fused", "paged_adamw", "lion"):
            sd = state_dtypes(dtype)
            mb = DTYPE_BYTES[sd[0]]
            vb = DTYPE_BYTES[sd[-1]]
        elif opt in ("sgd_momentum",):
            mb = vb = DTYPE_BYTES[state_dtypes(dtype)[0]]
        else:
            mb = vb = 1.0
        if opt == "adamw":
            b = 4 * pb + 2 * gb + 3 * mb + 5 * vb + 6 * vb
        elif opt in ("adamw_fused", "paged_adamw"):
            b = 2 * pb + gb + 2 * mb + 2 * vb
        elif opt in ("adamw_8bit", "paged_adamw_8bit"):
            small = each < 4096
            sb = 4.0 if small else 1.0 + 4.0 / 256
            b = 2 * pb + gb + 4 * sb
        elif opt == "sgd_momentum":
            b = 2 * pb + gb + 5 * mb
        elif opt == "sgd":
            b = 2 * pb + gb
        elif opt == "lion":
            b = 3 * pb + 2 * gb + 5 * mb + 6 * pb
        elif opt == "adafactor":
            b = (2 + 4 + 2 + 4 + 4 + 8 + 8 + 4 + 4 + 4 + 12 + 4 + 8 + 8 + 8 + 12 + 6) if pb < 4 else 80.0
        else:
            b = 2 * pb + gb
        w.add_bytes("8-bit optimizer update" if opt.endswith("8bit") else "optimizer update", numel * b)
    per_tensor_ops = {"adamw": 0.0, "adamw_fused": 0.0, "sgd_momentum": 0.0, "sgd": 0.0,
                      "adamw_8bit": 4.0, "paged_adamw_8bit": 4.0, "paged_adamw": 4.0,
                      "adafactor": 25.0, "lion": 7.0}.get(opt, 2.0)
    # foreach ops: one launch per op per chunk of tensors (torch groups tensors by device and
    # dtype and launches each foreach kernel over chunks of them)
    foreach_ops = {"adamw": 9.0, "adamw_fused": 1.0, "sgd_momentum": 3.0, "sgd": 1.0}.get(opt, 0.0)
    chunks = max(1.0, n_tensors / 32.0)
    w.kernels += per_tensor_ops * n_tensors + foreach_ops * chunks
    w.ops += per_tensor_ops * n_tensors + foreach_ops * 4
    return w


# ----------------------------------------------------------------------------------
# The step
# ----------------------------------------------------------------------------------

@dataclass
class StepTime:
    """One training step's time on one GPU (one micro-batch x grad_accum_steps, then the update)."""

    gpu_name: str
    forward: PhaseTime
    backward: PhaseTime
    optimizer_step: PhaseTime
    grad_accum_steps: int
    tokens_per_step: int
    model_flops_per_step: float          # 6 x active params x tokens (+ attention): what MFU counts
    peak_flops_per_second: float         # the compute dtype's dense peak
    recompute_seconds: float = 0.0       # included in backward
    communication_seconds: float = 0.0   # exposed (not overlapped) communication, multi-GPU
    pipeline_bubble_seconds: float = 0.0
    communication: Optional[Dict[str, Any]] = None
    notes: List[str] = field(default_factory=list)
    #: the optimizer step run on the host (ZeRO-Offload's CPU Adam): not communication, and
    #: not the GPU's optimizer_step phase (which is empty then)
    cpu_optimizer_seconds: float = 0.0

    @property
    def step_seconds(self) -> float:
        micro = self.forward.seconds + self.backward.seconds
        return (micro * self.grad_accum_steps + self.optimizer_step.seconds + self.communication_seconds
                + self.pipeline_bubble_seconds + self.cpu_optimizer_seconds)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_step / self.step_seconds if self.step_seconds else 0.0

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation: useful matmul FLOPs per second over the dense peak."""
        if not self.step_seconds or not self.peak_flops_per_second:
            return 0.0
        return self.model_flops_per_step / self.step_seconds / self.peak_flops_per_second

    def breakdown(self) -> Dict[str, Any]:
        """Seconds per phase and per kind of work, and what dominates."""
        k = self.grad_accum_steps
        phases = {"forward": self.forward, "backward": self.backward, "optimizer_step": self.optimizer_step}
        kinds = {
            "matmul": k * (self.forward.matmul_seconds + self.backward.matmul_seconds)
            + self.optimizer_step.matmul_seconds,
            "attention": k * (self.forward.attention_seconds + self.backward.attention_seconds),
            "memory-bound kernels": k * (self.forward.memory_seconds + self.backward.memory_seconds)
            + self.optimizer_step.memory_seconds,
            "kernel launches": k * (self.forward.kernel_seconds + self.backward.kernel_seconds)
            + self.optimizer_step.kernel_seconds,
        }
        host_wait = sum((k if n != "optimizer_step" else 1) * max(0.0, p.cpu_seconds - p.gpu_seconds)
                        for n, p in phases.items())
        if host_wait:
            kinds["waiting for the host"] = host_wait
        pcie_wait = sum((k if n != "optimizer_step" else 1) * max(0.0, p.pcie_seconds - max(p.gpu_seconds, p.cpu_seconds))
                        for n, p in phases.items())
        if pcie_wait:
            kinds["waiting for PCIe (offloaded activations)"] = pcie_wait
        if self.communication_seconds:
            kinds["communication"] = self.communication_seconds
        if self.pipeline_bubble_seconds:
            kinds["pipeline bubble"] = self.pipeline_bubble_seconds
        if self.cpu_optimizer_seconds:
            kinds["optimizer step on the CPU"] = self.cpu_optimizer_seconds
        total = self.step_seconds or 1.0
        dominant = max(kinds, key=kinds.get)
        return {
            "gpu": self.gpu_name,
            "step_seconds": self.step_seconds,
            "phases_seconds": {**{n: p.seconds * (k if n != "optimizer_step" else 1) for n, p in phases.items()},
                               **({"communication": self.communication_seconds} if self.communication_seconds else {}),
                               **({"pipeline bubble": self.pipeline_bubble_seconds}
                                  if self.pipeline_bubble_seconds else {}),
                               **({"optimizer step on the CPU": self.cpu_optimizer_seconds}
                                  if self.cpu_optimizer_seconds else {})},
            "phases": {n: p.to_dict() for n, p in phases.items()},
            "kinds_seconds": kinds,
            "recompute_seconds": self.recompute_seconds * k,
            "communication_seconds": self.communication_seconds,
            "pipeline_bubble_seconds": self.pipeline_bubble_seconds,
            "communication": self.communication,
            "dominant": dominant,
            "dominant_share": kinds[dominant] / total,
            "grad_accum_steps": k,
            "notes": list(self.notes),
            "summary": f"{dominant} {kinds[dominant] / total:.0%} of the step; "
                       + ", ".join(f"{n.replace('_', ' ')} {p.seconds * (k if n != 'optimizer_step' else 1) * 1e3:.1f} ms"
                                   f" ({p.bound}-bound)" for n, p in phases.items()),
        }


def _mm_dtype(s: Any, weight_dtype: str) -> str:
    """The dtype a matmul runs in: the compute dtype under autocast and for 4/8-bit
    weights (dequantised to it), else the weight's own dtype."""
    if s.autocast or weight_dtype in ("nf4", "fp4", "int8"):
        return s.compute_dtype
    if s.precision == "fp8":
        return "float8"
    return weight_dtype


def step_work(arch: Any, s: Any, P: Any, A: Any, head_dtype: str,
              state_dtypes: Any, offloaded_bytes: float = 0.0) -> Tuple[Work, Work, Work, Work]:
    """(forward, backward, recompute, optimizer) work of one micro-batch step.

    ``P``: the estimate's per-tensor storage decisions, ``A``: its traced activations
    (``fwd_written_bytes_per_layer``, ``fwd_ops_per_layer``: every tensor the block's
    forward creates, one kernel each), ``offloaded_bytes``: saved activations that activation
    offloading copies to the host in forward and back in backward (torchtune's
    ``OffloadActivations`` runs the copies on a side stream: they cost time only where they
    outlast the phase's kernels).  Not modelled in time: ``torch.compile``'s fusion of the
    blocks' elementwise kernels, packing's shorter attention spans.
    """
    # an encoder-decoder with its own target length: which tokens each matmul runs over
    tokens_of, T_head, n_dec = _stack_tokens(arch, s)
    fwd_blocks, head, bwd_extra = Work(), Work(), Work()
    head_weight = _linear_work(arch, s, P, tokens_of, fwd_blocks, bwd_extra)
    _lora_work(arch, s, P, tokens_of, fwd_blocks, bwd_extra)
    att = _attention_work(arch, s, A, n_dec, fwd_blocks, bwd_extra)
    # the blocks' other kernels: every tensor the forward creates is written once and read
    # at least once; backward runs about two kernels and twice the traffic per forward op
    n_layers = A.n_saving_layers
    blk_bytes = 2 * A.fwd_written_bytes_per_layer * n_layers
    fwd_blocks.add_bytes("norms, activations, residuals, casts", blk_bytes)
    bwd_extra.add_bytes("norms, activations, residuals, casts", 2 * blk_bytes)
    fwd_blocks.kernels += A.fwd_ops_per_layer * n_layers
    fwd_blocks.model_ops += A.fwd_ops_per_layer * n_layers
    bwd_extra.kernels += 2 * A.fwd_ops_per_layer * n_layers
    bwd_extra.model_ops += A.fwd_ops_per_layer * n_layers
    _head_work(arch, s, A, T_head, head_weight, head_dtype, head, bwd_extra)
    fwd = fwd_blocks.plus(head)
    fwd.pcie_bytes += offloaded_bytes
    bwd_extra.pcie_bytes += offloaded_bytes
    recompute = _recompute_work(s, A, att, fwd_blocks, n_layers, arch.num_layers)
    opt = optimizer_work(s, P.trainable_tensors, state_dtypes)
    return fwd, bwd_extra, recompute, opt


def _linear_work(arch: Any, s: Any, P: Any, tokens_of: Callable[[Any], float], fwd: Work, bwd: Work) -> Any:
    """The blocks' matmuls (MoE experts with k / E of their parameters), bitsandbytes'
    dequantisation and autocast's gradient casts; returns the output head's weight
    (tensor, dtype, trains) or None."""
    k_active = (arch.experts_per_token / arch.num_experts) if arch.num_experts else 1.0
    head_weight = None
    for t, dtype, nbytes, trains in P.weights:
        if t.role == "output_head" or (t.role == "embedding" and arch.tie_word_embeddings):
            head_weight = (t, dtype, trains)
            continue
        if not t.linear or t.is_bias:
            continue
        n = t.numel * (k_active if t.experts else 1.0)
        md = _mm_dtype(s, dtype)
        Tn = tokens_of(t)
        fwd.add_flops(md, 2 * Tn * n)
        # backward: the input gradient wherever anything below trains; the weight gradient if it trains
        below_trains = s.trains_adapters or trains or s.method == "full"
        bwd.add_flops(md, 2 * Tn * n * ((1.0 if below_trains else 0.0) + (1.0 if trains else 0.0)))
        if dtype in ("nf4", "fp4", "int8"):
            # bitsandbytes dequantises the weight to the compute dtype for every matmul
            # (bitsandbytes/autograd/_functions.py MatMul4Bit: forward, and again for the
            # input gradient): read 0.5 B + constants, write 2 B, read it back in the GEMM
            deq = t.numel * (DTYPE_BYTES.get(dtype, 0.5) + 2 * DTYPE_BYTES[s.compute_dtype])
            fwd.add_bytes("4-bit dequantisation", deq)
            bwd.add_bytes("4-bit dequantisation", deq)
            # absmax dequant (double quantisation), + offset, dequantize_4bit, autograd.Function
            fwd.kernels += 3 * t.repeat
            fwd.model_ops += 6 * t.repeat
            bwd.kernels += 3 * t.repeat
            bwd.model_ops += 6 * t.repeat
        if trains and s.autocast:
            # autocast: the 16-bit weight gradient is cast to the fp32 .grad
            bwd.add_bytes("fp32 gradient casts", t.numel * (2 * DTYPE_BYTES[s.compute_dtype] + 4))
            bwd.kernels += t.repeat
            bwd.ops += t.repeat
    return head_weight


def _lora_work(arch: Any, s: Any, P: Any, tokens_of: Callable[[Any], float], fwd: Work, bwd: Work) -> None:
    """LoRA (peft/tuners/lora/layer.py Linear.forward): x cast to the adapter dtype, lora_A,
    lora_B, * scaling, added to the base output, cast back: small fp32 GEMMs and
    elementwise passes over T x out."""
    if not P.adapters:
        return
    ad = s.compute_dtype if s.autocast else P.adapter_dtype
    r = s.lora_r
    for t in arch.lora_tensors(P.lora_modules):
        io = (t.in_features + t.out_features) * t.repeat
        Tn = tokens_of(t)
        fwd.add_flops(ad, 2 * Tn * r * io)
        bwd.add_flops(ad, 2 * 2 * Tn * r * io)
        ab = DTYPE_BYTES[ad]
        # result + lora_B(...) * scaling in the adapter dtype, then .to(result dtype)
        out_bytes = Tn * t.out_features * t.repeat * (ab * 3 + ab * 2 + DTYPE_BYTES[s.compute_dtype] * 2)
        fwd.add_bytes("LoRA adapters", out_bytes)
        bwd.add_bytes("LoRA adapters", 2 * out_bytes)
        fwd.kernels += 4 * t.repeat
        fwd.model_ops += 4 * t.repeat
        bwd.kernels += 8 * t.repeat
        bwd.model_ops += 4 * t.repeat


class _Attention(NamedTuple):
    kernel: str          # the kernel that runs (flash, efficient, eager, math)
    core_flops: float    # the causal half of 4 b s^2 a d over every layer
    score_elems: float   # b x a x s x s over every layer
    dtype: str           # the dtype q, k, v come in
    eager_scores: Work   # a recomputed eager core's softmax traffic


def _attention_work(arch: Any, s: Any, A: Any, n_dec: int, fwd: Work, bwd: Work) -> _Attention:
    """The attention core of every layer, in forward and backward."""
    L = arch.num_layers
    b, sq = s.batch_size, s.seq_len
    core = 2 * b * sq * sq * arch.num_heads * arch.head_dim * L     # causal half of 4 b s^2 a d
    score_elems = b * arch.num_heads * sq * sq * L                   # b x a x s x s per layer
    if n_dec:
        # the encoder's layers b s^2; a decoder layer's causal self-attention over its t target
        # tokens (b t^2) and its cross-attention of t queries over the s encoder keys (b t s,
        # every pair: twice a causal half)
        tq, ad_ = s.target_len, arch.num_heads * arch.head_dim
        core = 2 * b * ad_ * (sq * sq * (L - n_dec) + (tq * tq + 2 * tq * sq) * n_dec)
        score_elems = b * arch.num_heads * (sq * sq * (L - n_dec) + (tq * tq + tq * sq) * n_dec)
    c = s.compute_dtype
    # q, k, v come in the residual stream's dtype: fp32 after prepare_model_for_kbit_training
    # (Linear4bit returns its input's dtype), the compute dtype otherwise
    ad = "float32" if (s.quantized and s.prepare_kbit) else c
    # selective checkpointing wraps the core in a checkpoint: the kernel is the one the
    # attention implementation picks (eager stays eager), run again in backward
    kernel = A.backend
    if kernel == "recompute":
        kernel = "eager" if s.attn_implementation == "eager" else "flash"
    eager_scores = Work()
    if kernel in ("flash", "efficient"):
        fwd.add_flops(ad, core, attention=True)
        bwd.add_flops(ad, FLASH_BACKWARD_FLOPS_RATIO * core, attention=True)
    else:
        # eager / math: two full b x a x s x s matmuls; the probabilities are in the trace,
        # the raw scores, their scaling and the causal mask's addition are three more passes
        fwd.add_flops(ad, 2 * core)
        bwd.add_flops(ad, 4 * core)
        scores = score_elems * DTYPE_BYTES[ad]
        fwd.add_bytes("attention scores", scores * 6)
        bwd.add_bytes("attention scores", scores * 12)
        fwd.kernels += 3 * L
        fwd.model_ops += 3 * L
        bwd.kernels += 6 * L
        if A.backend == "recompute":
            # the trace saved no probabilities (the core is recomputed): the softmax's fp32
            # output and its 16-bit copy are written and read in forward and again in recompute
            eager_scores.add_bytes("attention scores", score_elems * (4 + DTYPE_BYTES[ad]) * 2)
            fwd.add_bytes("attention scores", eager_scores.memory_bytes)
    return _Attention(kernel, core, score_elems, ad, eager_scores)


def _head_work(arch: Any, s: Any, A: Any, T: float, head_weight: Any, head_dtype: str, head: Work,
               bwd: Work) -> None:
    """The output head and the loss over the head's ``T`` tokens: logits (T x V), their fp32
    upcast, log_softmax and nll."""
    V, h = arch.vocab_size, arch.hidden_size
    c = s.compute_dtype
    if head_weight is not None:
        t, dtype, trains = head_weight
        md = _mm_dtype(s, dtype) if dtype not in ("nf4", "fp4", "int8") else c
        md = head_dtype if not s.autocast else md
        head.add_flops(md, 2 * T * V * h)
        bwd.add_flops(md, 2 * T * V * h * (1.0 + (1.0 if trains else 0.0)))
    head.add_bytes("norms, activations, residuals, casts", 2 * A.head_fwd_written_bytes)
    head.kernels += A.head_fwd_ops + 1     # + the embedding lookup
    head.model_ops += A.head_fwd_ops + 1
    cb = DTYPE_BYTES[head_dtype]
    # final logit soft-capping writes and reads one more T x V tensor (Gemma 2)
    softcap = T * V * cb if arch.final_logit_softcapping else 0.0
    if s.compile or s.loss == "liger":
        # one fused kernel per chunk (Liger's fused linear cross-entropy, a compiled loss): the
        # logits are written, read for the softmax and overwritten by their gradient in place
        head.add_bytes("logits and loss", T * V * cb * 3 + 2 * softcap)
        bwd.add_bytes("logits and loss", T * V * cb)
        head.kernels += 3
        head.model_ops += 3
    else:
        # standard or chunked (the same work, chunk by chunk): logits, their fp32 upcast and
        # log_softmax's output each written once and read once (log_softmax reads its input twice)
        live = T * V * (cb + (4 if cb != 4 else 0) + 4)
        head.add_bytes("logits and loss", 2 * live + T * V * 4 + 2 * softcap)
        # backward: nll_loss and log_softmax gradients (two fp32 T x V), the cast back
        bwd.add_bytes("logits and loss", T * V * (4 * 2 + 4 * 3 + cb * 2))
        head.kernels += 6
        head.model_ops += 6
    bwd.add_bytes("norms, activations, residuals, casts", 2 * 2 * A.head_fwd_written_bytes)
    bwd.kernels += 6 + 2 * A.head_fwd_ops
    bwd.model_ops += 6 + A.head_fwd_ops


def _recompute_work(s: Any, A: Any, att: _Attention, fwd_blocks: Work, n_layers: int, L: int) -> Work:
    """What checkpointing runs again in backward: the blocks' forward (full: ``n_layers``
    saving blocks), the attention core of each of the ``L`` layers (selective)."""
    recompute = Work()
    if s.gradient_checkpointing == "full":
        recompute = fwd_blocks.scaled(1.0)
        # torch.utils.checkpoint (non-reentrant): a Python pack hook per saved tensor in the
        # forward, an unpack hook and a recomputed-tensor check per tensor in backward
        recompute.ops += 3 * len(A.per_layer) * n_layers
    elif s.gradient_checkpointing == "selective":
        if att.kernel == "eager":
            recompute.add_flops(att.dtype, 2 * att.core_flops)
            recompute.add_bytes("attention scores", att.score_elems * DTYPE_BYTES[att.dtype] * 6
                                + att.eager_scores.memory_bytes)
            recompute.kernels += 6 * L
            recompute.model_ops += 6 * L
        else:
            recompute.add_flops(att.dtype, att.core_flops, attention=True)
            recompute.kernels += 4 * L
            recompute.model_ops += 4 * L
    return recompute


def _stack_tokens(arch: Any, s: Any) -> Tuple[Callable[[Any], float], float, int]:
    """(tokens a parameter's matmul runs over, the head's tokens, decoder layers): b x s for
    everything, except an encoder-decoder given a ``target_len`` (Family.has_target), whose
    decoder layers' matmuls run over b x t target tokens (their cross-attention k and v over
    the b x s encoder output: ``Family.reads_encoder``), as do the head and the loss."""
    T = s.tokens
    if s.target_len is None or not arch.family.has_target(arch):
        return (lambda t: T), T, 0
    order = arch.family.layer_order(arch)
    kinds = arch.family.target_kinds
    Tt = s.batch_size * s.target_len

    def tokens(t: Any) -> float:
        dec = bool(t.layers) and order[t.layers[0]] in kinds
        return Tt if dec and not arch.family.reads_encoder(t) else T

    return tokens, Tt, sum(1 for k in order if k in kinds)


def step_time(gpu: Any, s: Any, works: Tuple[Work, Work, Work, Work], communication_seconds: float = 0.0) -> StepTime:
    """The step's time on ``gpu`` from :func:`step_work`'s (forward, backward, recompute, optimizer)."""
    fwd, bwd, rec, opt = works
    f = phase_time(fwd, gpu, s.tf32)
    r = phase_time(rec, gpu, s.tf32)
    b = phase_time(bwd.plus(rec), gpu, s.tf32)
    o = phase_time(opt, gpu, s.tf32)
    model_flops = fwd.flops + bwd.flops
    notes = [f"{what} is not modelled in the step time" for flag, what in (
        (s.compile, "torch.compile's kernel fusion"), (s.packing, "packing's shorter attention spans")) if flag]
    return StepTime(notes=notes, gpu_name=gpu.name, forward=f, backward=b, optimizer_step=o, grad_accum_steps=s.grad_accum_steps,
                    tokens_per_step=s.tokens * s.grad_accum_steps, model_flops_per_step=model_flops * s.grad_accum_steps,
                    peak_flops_per_second=_peak(gpu, s.compute_dtype, s.tf32), recompute_seconds=r.seconds,
                    communication_seconds=communication_seconds)


# ----------------------------------------------------------------------------------
# Several GPUs: communication (estimate_parallel)
# ----------------------------------------------------------------------------------

#: fraction of a link's per-direction peak that NCCL's ring collectives reach (nccl-tests'
#: "bus bandwidth" on NVLink/InfiniBand is typically 70-85% of the link rate).  Not fitted:
#: no multi-GPU step was measured here.
COMM_EFFICIENCY = 0.75
#: network bandwidth per GPU between nodes, per direction (one 400 Gb/s NIC per GPU, the
#: usual H100/H200 cluster): an assumption, override with ``inter_node_gb_per_s``
INTER_NODE_GB_PER_S = 50.0
#: host memory bandwidth of a node, shared by its GPUs' CPU optimizers (ZeRO-Offload)
HOST_MEMORY_GB_PER_S = 100.0


def _ring(kind: str, nbytes: float, n: int, bw: float) -> float:
    """Seconds of one ring collective over ``n`` ranks of ``nbytes`` (the full tensor) at
    ``bw`` bytes/s per direction: all-reduce moves 2 (n-1)/n of it, reduce-scatter and
    all-gather (n-1)/n (Patarasuk & Yuan 2009; NCCL's busBw)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    f = 2.0 if kind == "all_reduce" else 1.0
    return f * (n - 1) / n * nbytes / (bw * COMM_EFFICIENCY)


def communication(gpu: Any, lay: Dict[str, Any], sizes: Dict[str, float], st: "StepTime",
                  inter_node_gb_per_s: float = INTER_NODE_GB_PER_S) -> Dict[str, Any]:
    """Per-step communication of one GPU of a parallel run, and how much of it is exposed.

    ``lay``: the layout (strategy, num_gpus, gpus_per_node, data_parallel, tensor_parallel,
    pipeline_parallel, context_parallel, expert_parallel, micro_batches, shard, overlap_comm,
    offload flags); ``sizes``: per-GPU bytes of the stage's gradients (``grad_bytes``), of its
    parameters as gathered (``param_bytes``), of one layer's T x h activation
    (``act_bytes``), its layers (``layers``), routed-token bytes per layer (``moe_bytes``),
    K/V bytes per layer (``kv_bytes``), trainable parameters (``trainable``).

    Volumes (the ZeRO paper, Rajbhandari et al. 2020, sec. 7): DDP, ZeRO-1/2 and Megatron
    all-reduce (or reduce-scatter + all-gather) the gradients once per step: 2 x Psi;
    ZeRO-3 and FSDP all-gather the parameters in forward and again in backward and
    reduce-scatter the gradients: 3 x Psi.  Megatron tensor parallelism all-reduces a
    T x h activation twice per layer in forward and twice in backward (Shoeybi et al. 2019);
    expert parallelism sends every routed token to its expert and back (all-to-all); ring
    attention passes K and V around the context-parallel ranks; the 1F1B pipeline idles
    (p - 1) micro-batch slots per step (Narayanan et al. 2021).

    Overlap: DDP buckets overlap the all-reduce with the last micro-batch's backward; ZeRO-3
    (``overlap_comm``, on by default) and FSDP prefetch parameters during forward and
    backward; DeepSpeed ZeRO-1/2 (``overlap_comm`` off by default), Megatron's gradient
    reduce, tensor-parallel all-reduces and all-to-alls sit on the critical path.
    """
    n_gpus = int(lay["num_gpus"])
    gpn = int(lay["gpus_per_node"])
    intra = (gpu.nvlink_gb_per_s or gpu.pcie_gb_per_s or 16.0) * 1e9
    inter = min(intra, inter_node_gb_per_s * 1e9)
    tp, pp, cp, ep = (int(lay.get(k, 1)) for k in ("tensor_parallel", "pipeline_parallel", "context_parallel",
                                                    "expert_parallel"))
    dp = int(lay.get("data_parallel", 1))
    shard = int(lay.get("shard", 1))
    m = int(lay.get("micro_batches", 1))
    strategy = lay["strategy"]
    # data-parallel groups span nodes when the model-parallel ranks fill a node first
    dp_bw = intra if dp * cp * tp <= gpn else inter
    reps = dp * cp
    G, W = sizes.get("grad_bytes", 0.0), sizes.get("param_bytes", 0.0)
    out: Dict[str, float] = {}
    overlappable = 0.0      # seconds that can hide behind compute
    exposed = 0.0
    cpu_step = 0.0
    fwd, bwd = st.forward.seconds, st.backward.seconds
    strat = strategy_record(strategy)      # what the strategy does: data/strategies.json
    overlapped = strat.overlaps(bool(lay.get("overlap_comm")))
    if strat.gradient_sync == "all_reduce" and reps > 1:
        t = _ring("all_reduce", G, reps, dp_bw)
        out["gradient all-reduce"] = t
        exposed += max(0.0, t - bwd) if overlapped else t
    elif strat.gradient_sync == "reduce_scatter" and not strat.parameter_all_gathers and reps > 1:
        rs = _ring("reduce_scatter", G, reps, dp_bw)
        ag = _ring("all_gather", W, reps, dp_bw)
        out["gradient reduce-scatter"] = rs
        out["parameter all-gather after the step"] = ag
        exposed += (max(0.0, rs - bwd) if overlapped else rs) + ag
    elif strat.parameter_all_gathers and reps > 1:
        within_node = strat.shard_group == "node"
        n = shard if within_node else reps
        bw = intra if within_node else dp_bw
        ag = strat.parameter_all_gathers * _ring("all_gather", W, n, bw) * (m if strat.gathers_every_micro_batch else 1)
        rs = _ring("reduce_scatter", G, n, bw)
        out["parameter all-gathers (forward and backward)"] = ag
        out["gradient reduce-scatter"] = rs
        overlappable += ag + rs
        if within_node and reps > n:
            t = _ring("all_reduce", G / n, reps // n, inter)
            out["gradient all-reduce across nodes"] = t
            exposed += t
    if tp > 1:
        recompute = 1.5 if st.recompute_seconds else 1.0
        t = 4 * sizes.get("layers", 0) * _ring("all_reduce", sizes.get("act_bytes", 0.0), tp, intra) * m * recompute
        out["tensor-parallel all-reduces"] = t
        exposed += t
    if ep > 1 and sizes.get("moe_bytes"):
        # dispatch and combine in forward, their gradients in backward; (e-1)/e of the tokens leave the GPU
        bw = intra if ep * tp <= gpn else inter
        t = 4 * sizes.get("moe_layers", 0) * sizes["moe_bytes"] * (ep - 1) / ep / (bw * COMM_EFFICIENCY) * m
        out["expert all-to-all"] = t
        exposed += t
    if cp > 1:
        bw = intra if cp * tp <= gpn else inter
        t = 3 * sizes.get("layers", 0) * sizes.get("kv_bytes", 0.0) * (cp - 1) / (bw * COMM_EFFICIENCY) * m
        out["ring-attention K/V passes"] = t
        exposed += max(0.0, t - (st.forward.attention_seconds + st.backward.attention_seconds) * m)
    if pp > 1:
        bw = intra if n_gpus <= gpn else inter
        t = 2 * 2 * sizes.get("act_bytes", 0.0) / (bw * COMM_EFFICIENCY) * m
        out["pipeline sends"] = t
        exposed += t
    if lay.get("offload_optimizer"):
        pcie = gpu.pcie_gb_per_s * 1e9 * COMM_EFFICIENCY
        t = (G / max(shard, 1) + W / max(shard, 1)) / pcie
        host = sizes.get("trainable", 0.0) / max(shard, 1) * 28 * min(gpn, n_gpus) / (HOST_MEMORY_GB_PER_S * 1e9)
        out["offload: gradients down, parameters up (PCIe)"] = t
        exposed += t
        cpu_step = host    # the host's own work, reported as the optimizer step on the CPU, not communication
    if lay.get("offload_params"):
        pcie = gpu.pcie_gb_per_s * 1e9 * COMM_EFFICIENCY
        t = 2 * W / max(shard, 1) / pcie * m
        out["offload: parameters fetched from the host (PCIe)"] = t
        exposed += t
    compute = (fwd + bwd) * m
    exposed += max(0.0, overlappable - compute)
    bubble = (pp - 1) * (fwd + bwd) if pp > 1 else 0.0
    return {"collectives_seconds": out, "total_seconds": sum(out.values()), "exposed_seconds": exposed,
            "cpu_optimizer_seconds": cpu_step, "pipeline_bubble_seconds": bubble, "intra_node_gb_per_s": intra / 1e9,
            "inter_node_gb_per_s": inter / 1e9}
