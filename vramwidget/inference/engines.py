"""Serving engines: how vLLM and SGLang size their KV cache, per GPU, under tensor, pipeline,
data and expert parallelism -- and the start-up lines they print.

``serve(arch, setup)`` answers "can I serve this model at this context on these GPUs, and how
many requests at once?" the way the engine itself decides it at start-up.  Every term below is
read from the engine's source; the file is named next to each one.

The GPU each term describes is the one that gets the *fewest* KV blocks (the engines take the
minimum over workers): tensor-parallel rank 0 of the last pipeline stage, which also holds the
sampler (or the first stage when its embedding outweighs the head).

vLLM (``engine="vllm"``)
========================

One worker per GPU loads its weight shard, runs a *profiling forward* of
``max_num_batched_tokens`` tokens spread over ``max_num_seqs`` sequences plus the sampler over
those sequences' logits, measures the memory, and gives the KV cache what is left of
``gpu_memory_utilization x total`` (``total`` is what ``torch.cuda.mem_get_info()`` reports,
below what nvidia-smi shows).  What "what is left" subtracts changed between releases
(``vllm/worker/worker.py determine_num_available_blocks`` for the V0 engine,
``vllm/v1/worker/gpu_worker.py determine_available_memory`` for V1):

=========  ======  ===================================================================  =======
release    engine  KV budget = u x total - ...                                          context
=========  ======  ===================================================================  =======
0.2.0      V0      torch.cuda.max_memory_allocated(): weights + the profile's peak      no
0.2.5      V0      (total - free) after the profile: everything on the GPU (PR #2031)   counted
0.3.2      V0      (free at worker init - free after the profile)                       no
0.6.3      V0      torch peak allocated + non-torch memory (total - free - reserved)    counted
0.6.5      V0      memory_profiling(): weights + torch peak increase + non-torch        no
                   increase over the snapshot taken at worker init
0.7.0      V1      torch peak allocated + non-torch memory (VLLM_USE_V1=1; default      counted
                   from 0.8.0)
0.9.0      V1      memory_profiling() as V0 0.6.5 ("Available KV cache memory: X GiB")  no
=========  ======  ===================================================================  =======

The profiling forward (``vllm/worker/model_runner.py profile_run`` /
``vllm/v1/worker/gpu_model_runner.py profile_run``):

* tokens: V0 without chunked prefill runs ``max(max_model_len, 2048)`` tokens
  (``vllm/config.py SchedulerConfig``); V0 turns chunked prefill on by itself above a
  32K context (``vllm/engine/arg_utils.py``) and then, like V1, runs ``max_num_batched_tokens``
  (V0 chunked: 512, V1 serve: 2048);
* one decoder layer at a time is live; its largest step is the MLP (vLLM's fused
  ``gate_up_proj``, ``SiluAndMul``, ``down_proj``, ``vllm/model_executor/models/llama.py``):
  residual + normed input + gate_up (T x 2i/t) + act (T x i/t) + down output = T x (3h + 3i/t);
  MoE layers run ``fused_moe`` with three intermediate caches of T x k rows
  (``vllm/model_executor/layers/fused_moe/fused_moe.py``);
* the head: logits of the last token of every sequence (S = max_num_seqs rows; the
  vocab-parallel shard, then gathered), then the sampler's top-k/top-p over fp32 logits
  (``vllm/model_executor/layers/sampler.py _apply_top_k_top_p``: sort values and int64 indices,
  softmax, cumsum, two masks, the inverse permutation, the gathered result: 38 B per entry).

Blocks: ``num_gpu_blocks = budget // (block_size x layers x 2 x kv_local x d x kv bytes)``
(``vllm/worker/cache_engine.py get_cache_block_size``; V1 ``vllm/v1/core/kv_cache_utils.py``),
with kv_local = max(kv / t, 1): KV heads are replicated when fewer than the TP size
(``vllm/model_executor/models/llama.py LlamaAttention``).  Weights: the vocabulary is padded to a
multiple of 64 and split over the TP ranks (``vocab_parallel_embedding.py pad_vocab_size``), the
rotary ``cos_sin_cache`` (max_position x rotary_dim) is a buffer of every layer's shared rope.

After the KV cache is allocated, CUDA graphs are captured for the decode batch sizes (V1: 1, 2,
4 and every multiple of 8 up to 512, piecewise around attention, ``vllm/config.py
CompilationConfig``; V0: full graphs up to max_num_seqs); their memory comes on top of the budget
(``enforce_eager`` removes it).

SGLang (``engine="sglang"``)
============================

``python/sglang/srt/model_executor/model_runner.py profile_max_num_token``: free memory after the
weights (minimum over ranks) minus ``(1 - mem_fraction_static)`` of the free memory at start-up,
divided by the per-token cell (layers x 2 x kv_local x d x bytes).  ``mem_fraction_static``
defaults by TP size (``python/sglang/srt/server_args.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Tuple

from ..model.architecture import Architecture
from ..errors import VramError
from ..inputs import shown
from ..units import DTYPE_BYTES, GIB, MIB

# ----------------------------------------------------------------------------------
# Engines, releases and their defaults
# ----------------------------------------------------------------------------------

ENGINES = ("vllm", "sglang", "hf")

#: vLLM releases where the KV budget rule changed, per engine: (first release, engine, rule,
#: CUDA context counted, communication buffers counted, source).  Rules: see the module docstring.
VLLM_RELEASES: Tuple[Tuple[str, str, str, bool, bool, str], ...] = (
    ("0.2.0", "v0", "torch_peak", False, False,
     "vllm/worker/worker.py: peak_memory = torch.cuda.max_memory_allocated()"),
    ("0.2.5", "v0", "total_minus_free", True, True,
     "vllm/worker/worker.py: peak_memory = total_gpu_memory - free_gpu_memory (PR #2031)"),
    ("0.3.2", "v0", "init_minus_free", False, True,
     "vllm/worker/worker.py: peak_memory = self.init_gpu_memory - free_gpu_memory"),
    ("0.6.3", "v0", "peak_plus_non_torch", True, True,
     "vllm/worker/worker.py: peak = allocated_bytes.all.peak + (total - free - reserved)"),
    ("0.6.5", "v0", "baseline", False, True,
     "vllm/worker/worker.py + vllm/utils.py memory_profiling(baseline at worker init)"),
    ("0.7.0", "v1", "peak_plus_non_torch", True, True,
     "vllm/v1/worker/gpu_worker.py determine_available_memory: peak + non_torch_allocations"),
    ("0.9.0", "v1", "baseline", False, True,
     "vllm/v1/worker/gpu_worker.py: requested_memory - memory_profiling().non_kv_cache_memory"),
)
#: V1 became the default engine in this release (VLLM_USE_V1=1 before; V0 removed in 0.11)
VLLM_V1_DEFAULT = "0.8.0"
DEFAULT_VLLM_VERSION = "0.10.1"
DEFAULT_SGLANG_VERSION = "0.4.6"
#: the newest release line of each engine whose start-up accounting was read and checked
#: against published logs (vLLM 0.10.2's in the README's table; SGLang's model_runner of 0.4.x):
#: a later release may budget differently, so it is refused rather than assumed
NEWEST_MODELLED = {"vllm": (0, 10), "sglang": (0, 4)}
OLDEST_MODELLED = {"vllm": (0, 2), "sglang": (0, 4)}


def check_release(engine: str, version: Any) -> Tuple[int, ...]:
    """``version`` of ``engine`` parsed and within the release lines modelled (VramError naming
    ``versions`` otherwise: ``--vllm-version 99.1`` is not a release this package knows)."""
    v = parse_version(version)
    lo, hi = OLDEST_MODELLED[engine], NEWEST_MODELLED[engine]
    if not lo <= v[:2] <= hi:
        name = {"vllm": "vLLM", "sglang": "SGLang"}[engine]
        raise VramError(f"versions: {name} {shown(str(version))} is outside the releases modelled "
                        f"({lo[0]}.{lo[1]}.x to {hi[0]}.{hi[1]}.x); their start-up memory accounting was read from "
                        f"those releases' source", field="versions")
    return v

#: vLLM's KV page, in tokens (vllm/config.py CacheConfig block_size default)
VLLM_BLOCK_SIZE = 16
#: vLLM defaults (vllm/config.py SchedulerConfig, vllm/engine/arg_utils.py)
VLLM_MAX_NUM_SEQS = 256
VLLM_V0_MIN_BATCHED_TOKENS = 2048      # max(max_model_len, 2048) without chunked prefill
VLLM_V0_CHUNKED_ABOVE = 32768          # V0 enables chunked prefill for longer contexts
VLLM_V0_CHUNKED_BATCHED_TOKENS = 512   # ... with this budget (arg_utils.py, OPENAI_API_SERVER)
VLLM_V1_BATCHED_TOKENS = 2048          # V1 serve default (arg_utils.py _set_default_args_v1)
#: vLLM pads the vocabulary to a multiple of this (vocab_parallel_embedding.py)
VLLM_VOCAB_PADDING = 64
#: the sampler's fp32 working set per logit entry (bytes): logits.to(float32) 4, sort values 4 +
#: int64 indices 8, softmax 4, cumsum 4, top-k and top-p masks 1 + 1, inverse permutation 8,
#: gathered result 4 (vllm/model_executor/layers/sampler.py _apply_top_k_top_p; V1 uses the same
#: in vllm/v1/sample/ops/topk_topp_sampler.py)
SAMPLER_BYTES_PER_LOGIT = 38.0
#: fused_moe processes at most this many tokens at once (VLLM_FUSED_MOE_CHUNK_SIZE default)
FUSED_MOE_CHUNK = 32 * 1024
#: vLLM custom all-reduce: an 8 MiB IPC buffer, its metadata and the rank data
#: (vllm/distributed/device_communicators/custom_all_reduce.py, max_size = 8 MiB)
CUSTOM_ALLREDUCE_BYTES = 3 * 8 * MIB
#: NCCL communicator memory outside PyTorch's allocator with tensor parallel: 0.20 GiB
#: "non_torch_memory" on each TP rank of vLLM 0.8 (vLLM PR #14447, 3090s, "non_torch_memory takes
#: 0.20GiB"), the non-torch increase over the worker's start snapshot
NCCL_BYTES = 0.20 * GIB
#: V1 CUDA-graph capture sizes: 1, 2, 4, then every multiple of 8 up to 512, capped by
#: max_num_batched_tokens (vllm/config.py CompilationConfig; a 0.10.1 log lists all 67)
V1_CAPTURE_SIZES = (1, 2, 4) + tuple(range(8, 513, 8))
#: V0 CUDA-graph batch sizes: 1, 2, 4 and multiples of 8 up to 256, capped by max_num_seqs
#: (vllm/worker/model_runner.py _BATCH_SIZES_TO_CAPTURE)
V0_CAPTURE_SIZES = (1, 2, 4) + tuple(range(8, 257, 8))
#: V0 captures one full graph per batch size: 4 MiB of kernel nodes and bookkeeping each
#: (Qwen2.5-1.5B, 35 graphs: "Graph capturing finished in 43 secs, took 0.17 GiB")
GRAPH_OVERHEAD_BYTES = 4 * MIB
#: V1 captures piecewise graphs: every capture size splits at each attention op, layers + 1
#: pieces; 0.225 MiB a piece (Llama-3.1-8B, vLLM 0.10.1: 67 sizes x 33 pieces "took 0.52 GiB",
#: less its 512-token pool)
V1_PIECE_OVERHEAD_BYTES = 0.225 * MIB

#: SGLang mem_fraction_static defaults by TP size (python/sglang/srt/server_args.py)
SGLANG_MEM_FRACTION = ((16, 0.79), (8, 0.81), (4, 0.85), (2, 0.87), (1, 0.88))


def parse_version(v: Any) -> Tuple[int, ...]:
    """'0.6.4.post1' -> (0, 6, 4)."""
    parts = []
    for p in str(v).strip().lstrip("v").split("."):
        digits = "".join(ch for ch in p if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
        if len(parts) == 3:
            break
    if not parts:
        raise VramError(f"versions: cannot read a release number from {shown(v)} (e.g. '0.6.4')", field="versions")
    return tuple(parts + [0] * (3 - len(parts)))


@dataclass(frozen=True)
class VllmRelease:
    """The behaviour of one vLLM release line."""

    version: str
    runtime: str          # "v0" or "v1"
    rule: str
    context_counted: bool
    comm_counted: bool
    source: str


def vllm_release(version: Optional[str] = None, runtime: Optional[str] = None) -> VllmRelease:
    """The row of :data:`VLLM_RELEASES` that ``version`` (default :data:`DEFAULT_VLLM_VERSION`)
    falls in, for the engine ``runtime`` ("v0" or "v1"; default: V1 from 0.8.0, as
    ``VLLM_USE_V1`` defaults)."""
    ver = str(version or DEFAULT_VLLM_VERSION)
    v = check_release("vllm", ver)
    if runtime is None:
        runtime = "v1" if v >= parse_version(VLLM_V1_DEFAULT) else "v0"
    runtime = str(runtime).lower()
    if runtime not in ("v0", "v1"):
        raise VramError(f"versions: vllm_runtime must be v0 or v1, got {shown(runtime)}", field="versions")
    row = None
    for first, rt, rule, ctx, comm, src in VLLM_RELEASES:
        if rt == runtime and v >= parse_version(first):
            row = (rule, ctx, comm, src)
    if row is None:
        first = next(r[0] for r in VLLM_RELEASES if r[1] == runtime)
        raise VramError(f"versions: vLLM {ver} with the {runtime.upper()} engine predates the releases modelled "
                        f"(from {first})", field="versions")
    return VllmRelease(ver, runtime, *row)


def sglang_mem_fraction(tp: int) -> float:
    """SGLang's default ``mem_fraction_static`` for a TP size."""
    for at_least, frac in SGLANG_MEM_FRACTION:
        if tp >= at_least:
            return frac
    return SGLANG_MEM_FRACTION[-1][1]


# ----------------------------------------------------------------------------------
# The layout: which GPU holds what
# ----------------------------------------------------------------------------------

def pad_vocab(arch: Architecture, multiple: int) -> Architecture:
    """The architecture with its embedding and head padded to a multiple of ``multiple`` rows
    (vLLM's ``pad_vocab_size``)."""
    V = arch.vocab_size
    Vp = -(-V // multiple) * multiple
    if Vp == V:
        return arch
    tensors = []
    for t in arch.tensors:
        if t.role in ("embedding", "output_head") and t.shape and t.shape[0] == V:
            t = replace(t, shape=(Vp,) + tuple(t.shape[1:]))
        tensors.append(t)
    return replace(arch, tensors=tensors, vocab_size=Vp)


def check_layout(arch: Architecture, tp: int, pp: int, ep: int) -> None:
    """vLLM's own checks (``vllm/config.py verify_with_parallel_config``): heads divide by TP,
    KV heads divide TP or are divided by it, layers at least PP, experts divide by EP."""
    a, kv = arch.num_heads, arch.num_kv_heads
    if a % tp:
        raise VramError(f"tensor_parallel: {arch.name} has {a} attention heads, not divisible by "
                        f"tensor_parallel={tp}", field="tensor_parallel")
    if not arch.mla and kv % tp and tp % kv:
        raise VramError(f"tensor_parallel: {kv} KV heads and tensor_parallel={tp}: one must divide the other",
                        field="tensor_parallel")
    if pp > arch.num_layers:
        raise VramError(f"pipeline_parallel: {pp} stages for {arch.num_layers} layers", field="pipeline_parallel")
    if ep > 1:
        if not arch.is_moe:
            raise VramError(f"expert_parallel: {arch.name} has no experts", field="expert_parallel")
        if arch.num_experts % ep:
            raise VramError(f"expert_parallel: {arch.num_experts} experts not divisible by {ep}",
                            field="expert_parallel")


def pp_stages(num_layers: int, pp: int) -> List[Tuple[int, int]]:
    """vLLM's ``get_pp_indices``: layers split evenly, the remainder on the last stages
    (``vllm/distributed/utils.py``)."""
    base, extra = divmod(num_layers, pp)
    sizes = [base] * pp
    for i in range(extra):
        sizes[pp - 1 - i] += 1
    out, start = [], 0
    for n in sizes:
        out.append((start, start + n - 1))
        start += n
    return out


def gpu_share(arch: Architecture, tp: int = 1, pp: int = 1, ep: int = 1, stage: int = -1,
              vocab_padding: int = 1) -> Architecture:
    """The architecture one GPU holds: pipeline stage ``stage`` (default the last), cut by
    tensor and expert parallel (Megatron's column/row split, vocab-parallel embedding and head,
    KV heads replicated when fewer than ``tp``; :func:`vramwidget.parallel.estimate._slice`)."""
    from ..parallel.estimate import stage_slice

    a = pad_vocab(arch, vocab_padding) if vocab_padding > 1 else arch
    stages = pp_stages(a.num_layers, pp)
    i = stage % pp
    first, last = stages[i]
    if ep > 1 and tp > 1:
        # vLLM's expert parallel (--enable-expert-parallel): whole experts spread over the EP ranks,
        # not split by TP (vllm/model_executor/layers/fused_moe/layer.py); the rest is TP-split
        dense, _ = stage_slice(a, first, last, embed=(i == 0), head=(i == pp - 1), tp=tp, ep=1)
        experts, _ = stage_slice(a, first, last, embed=(i == 0), head=(i == pp - 1), tp=1, ep=ep)
        tensors = [t for t in dense.tensors if not t.experts] + [t for t in experts.tensors if t.experts]
        return replace(dense, tensors=tensors, expert_intermediate_size=a.expert_intermediate_size)
    cut, _ = stage_slice(a, first, last, embed=(i == 0), head=(i == pp - 1), tp=tp, ep=ep)
    return cut


# ----------------------------------------------------------------------------------
# vLLM's terms
# ----------------------------------------------------------------------------------

def rotary_cache_bytes(arch: Architecture, c: float) -> Tuple[float, str]:
    """vLLM's RotaryEmbedding keeps ``cos_sin_cache`` of max_position x rotary_dim in the model
    dtype; one instance is shared by every layer (``vllm/model_executor/layers/rotary_embedding.py
    get_rope`` caches them)."""
    if arch.mlp_kind != "gated" and arch.model_type not in ("gpt_neox", "falcon"):
        return 0.0, ""
    rot = arch.mla["qk_rope_head_dim"] if arch.mla else arch.head_dim
    frac = arch.config.get("partial_rotary_factor")
    if frac and not arch.mla:
        rot = int(rot * float(frac))
    n = int(arch.max_position_embeddings or 0)
    return n * rot * c, f"max_position {n} x rotary_dim {rot} x {c:g} B"


def profile_layer_items(arch: Architecture, T: int, c: float) -> Tuple[str, List[Tuple[str, float, str]]]:
    """The largest step of one decoder layer of vLLM's forward over T tokens, for the GPU's
    share ``arch`` (already cut by TP: heads and widths are local).  Returns (step, items)."""
    h = arch.hidden_size
    a, kv, d = arch.num_heads, arch.num_kv_heads, arch.head_dim
    base = [("residual", T * h * c, "T x h"), ("normed layer input", T * h * c, "T x h")]
    steps: Dict[str, List[Tuple[str, float, str]]] = {}
    if arch.mla:
        m = arch.mla
        qh = m["qk_nope_head_dim"] + m["qk_rope_head_dim"]
        steps["attention"] = base + [
            ("q (local heads)", T * a * qh * c, "T x a/t x d_qk"),
            ("compressed kv + k_pe", T * (m["kv_lora_rank"] + m["qk_rope_head_dim"]) * c, "T x (r_kv + d_rope)"),
            ("k, v expanded (local heads)", T * a * (qh + m["v_head_dim"]) * c, "T x a/t x (d_qk + d_v)"),
            ("attention output", T * a * m["v_head_dim"] * c, "T x a/t x d_v"),
            ("o_proj output", T * h * c, "T x h")]
    else:
        steps["attention"] = base + [
            ("qkv_proj output", T * (a + 2 * kv) * d * c, "T x (a + 2 kv)/t x d"),
            ("attention output", T * a * d * c, "T x a/t x d"),
            ("o_proj output", T * h * c, "T x h")]
    if arch.is_moe:
        E, k, ie = arch.num_experts, arch.experts_per_token, arch.expert_intermediate_size
        Tc = min(T, FUSED_MOE_CHUNK)
        steps["fused_moe"] = base + [
            ("router logits (fp32)", T * E * 4.0, "T x E x 4 B"),
            ("topk weights + ids", T * k * 8.0, "T x k x (4 + 4) B"),
            ("intermediate_cache1 (gate_up)", Tc * k * 2 * ie * c, "min(T, chunk) x k x 2 i_e/t"),
            ("intermediate_cache2 (act)", Tc * k * ie * c, "min(T, chunk) x k x i_e/t"),
            ("intermediate_cache3 (down)", Tc * k * h * c, "min(T, chunk) x k x h"),
            ("moe output", T * h * c, "T x h")]
        if arch.shared_expert_intermediate_size:
            ish = arch.shared_expert_intermediate_size
            steps["fused_moe"].append(("shared expert gate_up + act", T * 3 * ish * c, "T x 3 i_shared/t"))
        if arch.dense_layers:
            i_dense = int(arch.config.get("intermediate_size") or arch.intermediate_size)
            steps["mlp (dense layers)"] = base + [("gate_up output", T * 2 * i_dense * c, "T x 2i/t"),
                                                  ("act output", T * i_dense * c, "T x i/t"),
                                                  ("down_proj output", T * h * c, "T x h")]
    elif arch.mlp_kind == "gated":
        i = arch.intermediate_size
        steps["mlp"] = base + [("gate_up_proj output", T * 2 * i * c, "T x 2i/t"),
                               ("SiluAndMul output", T * i * c, "T x i/t"),
                               ("down_proj output", T * h * c, "T x h")]
    else:
        i = arch.intermediate_size
        steps["mlp"] = base + [("fc output", T * i * c, "T x i/t"), ("activation", T * i * c, "T x i/t"),
                               ("fc2 output", T * h * c, "T x h")]
    name = max(steps, key=lambda s: sum(x[1] for x in steps[s]))
    return name, steps[name]


def profile_head_items(arch: Architecture, T: int, S: int, c: float, V: int, tp: int
                       ) -> List[Tuple[str, float, str]]:
    """The head of the profiling forward: the final hidden states, the last token's logits of
    every sequence (vocab-parallel shard, gathered when TP > 1) and the sampler's working set."""
    h = arch.hidden_size
    Vl = -(-V // tp)
    out = [("final hidden states", T * h * c, "T x h"),
           ("logits shard (S x V/t)", S * Vl * c, "max_num_seqs x V/t")]
    if tp > 1:
        out.append(("logits gathered (S x V)", S * V * c, "max_num_seqs x V"))
    out.append(("sampler: fp32 logits, sort, softmax, cumsum, masks, inverse index",
                S * V * SAMPLER_BYTES_PER_LOGIT, f"max_num_seqs x V x {SAMPLER_BYTES_PER_LOGIT:g} B"))
    return out


def cuda_graph_bytes(arch: Architecture, c: float, max_num_seqs: int, runtime: str,
                     max_num_batched_tokens: int = 8192) -> Tuple[float, int, str]:
    """Memory CUDA graphs keep after capture: the graph pool holds the largest captured batch's
    layer working set (the pool is shared by every graph, captured largest first), plus each
    graph's own nodes -- V0: one full graph per size; V1: piecewise, layers + 1 pieces per size.
    Returns (bytes, graphs, formula)."""
    if runtime == "v1":
        sizes = [s for s in V1_CAPTURE_SIZES if s <= max(max_num_batched_tokens, 1)] or [1]
    else:
        sizes = [s for s in V0_CAPTURE_SIZES if s <= max(max_num_seqs, 1)] or [1]
    _, items = profile_layer_items(arch, max(sizes), c)
    pool = sum(x[1] for x in items)
    n = len(sizes)
    if runtime == "v1":
        pieces = n * (arch.num_layers + 1)
        return pool + pieces * V1_PIECE_OVERHEAD_BYTES, n, (
            f"{n} piecewise graphs (batch 1..{max(sizes)}) x {arch.num_layers + 1} pieces x 0.225 MiB + a pool of "
            f"one layer at {max(sizes)} tokens")
    return pool + n * GRAPH_OVERHEAD_BYTES, n, (f"{n} graphs (batch 1..{max(sizes)}): pool = one layer at "
                                               f"{max(sizes)} tokens + {n} x 4 MiB")


# ----------------------------------------------------------------------------------
# The estimate
# ----------------------------------------------------------------------------------

@dataclass
class ServingPlan:
    """What one engine does at start-up on one GPU of a parallel layout."""

    engine: str
    version: str
    runtime: str
    rule: str
    tensor_parallel: int
    pipeline_parallel: int
    data_parallel: int
    expert_parallel: int
    total_bytes: float                 # the driver-reported total torch sees
    utilization: float
    weights_bytes: float
    activation_bytes: float
    activation_items: List[Tuple[str, float, str]]
    profile_tokens: int
    non_torch_bytes: float
    non_torch_items: List[Tuple[str, float, str]]
    kv_budget_bytes: float
    kv_bytes_per_token: float          # this GPU's share, every layer of its stage
    block_size: int
    num_blocks: int
    cuda_graph_bytes: float
    cuda_graph_count: int
    max_model_len: int
    max_num_seqs: int
    notes: List[str]

    @property
    def kv_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_concurrency(self) -> float:
        return self.kv_tokens / self.max_model_len if self.max_model_len else 0.0

    @property
    def num_gpus(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel * self.data_parallel

    def startup_lines(self) -> List[str]:
        """The lines the engine prints at start-up, in its own words."""
        L = self.max_model_len
        if self.engine == "sglang":
            # SGLang prints the K and V buffers' sizes in GiB labelled "GB" (memory_pool.py); vLLM
            # issue 21348's "#tokens: 367404, K size: 8.23 GB" for 94 layers x 128 x 2 B is 8.23 GiB
            k = self.kv_tokens * self.kv_bytes_per_token / 2 / GIB
            return [f"KV Cache is allocated. #tokens: {self.kv_tokens}, K size: {k:.2f} GB, V size: {k:.2f} GB"]
        if self.runtime == "v1":
            return [f"Available KV cache memory: {self.kv_budget_bytes / GIB:.2f} GiB",
                    f"GPU KV cache size: {self.kv_tokens:,} tokens",
                    f"Maximum concurrency for {L:,} tokens per request: {self.max_concurrency:.2f}x"]
        lines = [f"# GPU blocks: {self.num_blocks}, # CPU blocks: (swap space)"]
        if parse_version(self.version) >= (0, 6, 3):
            lines.append(f"Maximum concurrency for {L} tokens per request: {self.max_concurrency:.2f}x")
        return lines

    def command(self, model: str) -> str:
        """A copyable command that starts this layout."""
        if self.engine == "sglang":
            parts = [f"python -m sglang.launch_server --model-path {model}", f"--tp {self.tensor_parallel}"]
            if self.pipeline_parallel > 1:
                parts.append(f"--pp-size {self.pipeline_parallel}")
            if self.data_parallel > 1:
                parts.append(f"--dp {self.data_parallel}")
            parts += [f"--context-length {self.max_model_len}", f"--mem-fraction-static {self.utilization:g}"]
            return " ".join(parts)
        parts = [f"vllm serve {model}", f"--tensor-parallel-size {self.tensor_parallel}"]
        if self.pipeline_parallel > 1:
            parts.append(f"--pipeline-parallel-size {self.pipeline_parallel}")
        if self.data_parallel > 1:
            parts.append(f"--data-parallel-size {self.data_parallel}")
        if self.expert_parallel > 1:
            parts.append("--enable-expert-parallel")
        parts += [f"--max-model-len {self.max_model_len}", f"--gpu-memory-utilization {self.utilization:g}"]
        return " ".join(parts)

    def to_dict(self) -> Dict[str, Any]:
        """A plain dict of this object (JSON-able)."""
        return {
            "engine": self.engine, "version": self.version, "runtime": self.runtime, "rule": self.rule,
            "tensor_parallel": self.tensor_parallel, "pipeline_parallel": self.pipeline_parallel,
            "data_parallel": self.data_parallel, "expert_parallel": self.expert_parallel,
            "num_gpus": self.num_gpus, "total_bytes": int(self.total_bytes), "utilization": self.utilization,
            "weights_bytes": int(round(self.weights_bytes)), "activation_bytes": int(round(self.activation_bytes)),
            "profile_tokens": self.profile_tokens, "non_torch_bytes": int(round(self.non_torch_bytes)),
            "kv_budget_bytes": int(round(self.kv_budget_bytes)), "kv_bytes_per_token": self.kv_bytes_per_token,
            "block_size": self.block_size, "num_blocks": self.num_blocks, "kv_tokens": self.kv_tokens,
            "max_model_len": self.max_model_len, "max_concurrency": round(self.max_concurrency, 4),
            "cuda_graph_bytes": int(round(self.cuda_graph_bytes)), "cuda_graph_count": self.cuda_graph_count,
            "startup_lines": self.startup_lines(), "notes": list(self.notes),
        }


def _weights_of(arch: Architecture, setup: Any) -> float:
    """Weights + quantization constants of ``arch`` in the setup's weight format: the setup
    (an ``InferenceSetup``) prices them itself, so this module needs nothing of inference."""
    return setup.stored_weights_bytes(arch)


def plan(arch: Architecture, s: Any, gpu: Any) -> ServingPlan:
    """How ``s.engine`` sizes its KV cache on each GPU of the layout ``s`` asks for.

    ``s`` is a validated :class:`vramwidget.inference.estimate.InferenceSetup`; ``gpu`` a catalog GPU.
    """
    engine = s.engine
    tp, pp, dp, ep = s.tensor_parallel, s.pipeline_parallel, s.data_parallel, s.expert_parallel
    check_layout(arch, tp, pp, ep)
    c = DTYPE_BYTES[s.dtype]
    kvb = DTYPE_BYTES[s.kv_cache_dtype]
    total = gpu.cuda_total_bytes
    L = s.context_len
    notes: List[str] = []
    if engine == "sglang":
        return _plan_sglang(arch, s, gpu, tp, pp, dp, ep, c, kvb, total, notes)
    rel = vllm_release(s.versions.get("vllm"), s.versions.get("vllm_runtime"))
    u = s.gpu_memory_utilization if s.gpu_memory_utilization is not None else 0.9
    seqs = s.max_num_seqs
    if rel.runtime == "v0" and not s.chunked_prefill_set:
        if L > VLLM_V0_CHUNKED_ABOVE:
            T = s.max_num_batched_tokens or VLLM_V0_CHUNKED_BATCHED_TOKENS
            notes.append(f"V0 turns chunked prefill on above {VLLM_V0_CHUNKED_ABOVE} tokens: the profile runs "
                         f"{T} tokens")
        else:
            T = s.max_num_batched_tokens or max(L, VLLM_V0_MIN_BATCHED_TOKENS)
    else:
        T = s.max_num_batched_tokens or VLLM_V1_BATCHED_TOKENS
    S = min(seqs, T)
    best: Optional[ServingPlan] = None
    for stage in sorted({0, pp - 1}):
        share = gpu_share(arch, tp, pp, ep, stage=stage, vocab_padding=VLLM_VOCAB_PADDING)
        w = _weights_of(share, s)
        rot, rot_f = rotary_cache_bytes(share, c)
        w += rot
        step, layer = profile_layer_items(share, T, c)
        act_items = [(f"{step}: {n}", v, f) for n, v, f in layer]
        act = sum(x[1] for x in layer)
        if stage == pp - 1:
            head = profile_head_items(share, T, S, c, pad_vocab(arch, VLLM_VOCAB_PADDING).vocab_size, tp)
            if sum(x[1] for x in head) > act:
                act_items, act = head, sum(x[1] for x in head)
        nt: List[Tuple[str, float, str]] = []
        if tp * pp > 1 and rel.comm_counted:
            nt.append(("NCCL communicators", NCCL_BYTES, "measured non-torch memory of a TP rank, vLLM PR #14447"))
        if tp > 1 and rel.comm_counted and not s.disable_custom_all_reduce and parse_version(rel.version) >= (0, 3, 0):
            nt.append(("custom all-reduce buffers", CUSTOM_ALLREDUCE_BYTES, "3 x 8 MiB"))
        if rel.context_counted:
            nt.append(("CUDA context", gpu.cuda_context_bytes, gpu.cuda_context_source))
        non_torch = sum(x[1] for x in nt)
        budget = u * total - w - act - non_torch
        share_kv = share
        lay_bpt = _kv_bytes_per_token(share_kv, kvb)
        blk = s.block_size
        blocks = int(max(budget, 0) // (blk * lay_bpt)) if lay_bpt else 0
        graphs, ng = (0.0, 0)
        if not s.enforce_eager:
            graphs, ng, _ = cuda_graph_bytes(share, c, seqs, rel.runtime, T)
        p = ServingPlan(engine="vllm", version=rel.version, runtime=rel.runtime, rule=rel.rule, tensor_parallel=tp,
                        pipeline_parallel=pp, data_parallel=dp, expert_parallel=ep, total_bytes=total,
                        utilization=u, weights_bytes=w, activation_bytes=act, activation_items=act_items,
                        profile_tokens=T, non_torch_bytes=non_torch, non_torch_items=nt, kv_budget_bytes=budget,
                        kv_bytes_per_token=lay_bpt, block_size=blk, num_blocks=blocks, cuda_graph_bytes=graphs,
                        cuda_graph_count=ng, max_model_len=L, max_num_seqs=seqs, notes=notes)
        if best is None or p.num_blocks < best.num_blocks:
            best = p
    assert best is not None
    if gpu.cuda_total_source == "nvidia-smi":
        best.notes.append(f"{gpu.name}: the total torch sees is not in the catalog; nvidia-smi's "
                          f"{gpu.usable_gib:.2f} GiB is used (torch typically sees 0.4-0.9 GiB less)")
    return best


def _kv_bytes_per_token(share: Architecture, kvb: float) -> float:
    """One token of every layer this GPU holds: 2 x kv_local x d (MLA: the latent + rope key)."""
    if share.mla:
        m = share.mla
        per_layer = (m["kv_lora_rank"] + m["qk_rope_head_dim"]) * kvb
    else:
        per_layer = 2 * share.num_kv_heads * share.head_dim * kvb
    return per_layer * share.num_layers


def _plan_sglang(arch: Architecture, s: Any, gpu: Any, tp: int, pp: int, dp: int, ep: int, c: float, kvb: float,
                 total: float, notes: List[str]) -> ServingPlan:
    """SGLang's ``profile_max_num_token``: rest = free after load - free at start x (1 - m)."""
    m = s.mem_fraction_static if s.mem_fraction_static is not None else sglang_mem_fraction(tp)
    share = gpu_share(arch, tp, pp, ep, stage=-1, vocab_padding=1)
    w = _weights_of(share, s)
    nt = [("CUDA context", gpu.cuda_context_bytes, gpu.cuda_context_source)]
    if tp * pp > 1:
        nt.append(("NCCL communicators", NCCL_BYTES, "as vLLM's (PR #14447)"))
    free_start = total - gpu.cuda_context_bytes
    non_torch = sum(x[1] for x in nt[1:])
    rest = (free_start - w - non_torch) - free_start * (1 - m)
    bpt = _kv_bytes_per_token(share, kvb)
    tokens = int(max(rest, 0) // bpt) if bpt else 0
    notes.append(f"SGLang: KV pool = free memory after the weights - (1 - mem_fraction_static {m:g}) x free "
                 f"memory at start; activations and CUDA graphs live in that reserve")
    # SGLang captures its CUDA graphs inside the (1 - mem_fraction_static) reserve: nothing on top
    graphs, ng = 0.0, 0
    if not s.enforce_eager:
        notes.append("SGLang's CUDA graphs and activations live in the (1 - mem_fraction_static) reserve")
    return ServingPlan(engine="sglang", version=str(s.versions.get("sglang", DEFAULT_SGLANG_VERSION)),
                       runtime="sglang", rule="mem_fraction_static", tensor_parallel=tp, pipeline_parallel=pp,
                       data_parallel=dp, expert_parallel=ep, total_bytes=total, utilization=m, weights_bytes=w,
                       activation_bytes=0.0, activation_items=[], profile_tokens=0, non_torch_bytes=non_torch,
                       non_torch_items=nt, kv_budget_bytes=rest, kv_bytes_per_token=bpt, block_size=1,
                       num_blocks=tokens, cuda_graph_bytes=graphs, cuda_graph_count=ng, max_model_len=s.context_len,
                       max_num_seqs=s.max_num_seqs, notes=notes)


def largest_max_model_len(arch: Architecture, s: Any, gpu: Any, limit: Optional[int] = None) -> int:
    """The largest ``max_model_len`` that starts: one request of that length fits the KV cache
    the engine sizes *for that length* (V0's profile grows with it).  A multiple of 16; 0 if
    not even one block fits."""
    cap = int(limit or arch.max_position_embeddings or (1 << 20))

    def fits(n: int) -> bool:
        p = plan(arch, replace(s, context_len=n, prompt_len=min(s.prompt_len, n)), gpu)
        return p.kv_tokens >= n

    blk = 16
    if not fits(blk):
        return 0
    lo, hi = 1, max(cap // blk, 1)
    if fits(hi * blk):
        return hi * blk
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid * blk):
            lo = mid
        else:
            hi = mid
    return lo * blk


def startable_command(arch: Architecture, s: Any, gpu: Any, model: str) -> Tuple[str, str, int]:
    """The command line to print for a serving setup, the sentence that goes with it, and the
    largest ``max_model_len`` that starts.  A command is printed only for a server that starts:
    the setup's own when its KV cache holds one request of ``max_model_len``; else the same
    layout at the largest ``max_model_len`` that starts, said so; else none (more GPUs, a
    smaller format, a higher budget), said so."""
    p = plan(arch, s, gpu)
    largest = largest_max_model_len(arch, s, gpu)
    if p.kv_tokens >= p.max_model_len:
        return p.command(model), "", largest
    if largest > 0:
        q = plan(arch, replace(s, context_len=largest, prompt_len=min(s.prompt_len, largest)), gpu)
        return (q.command(model), f"max_model_len {p.max_model_len:,} does not start on this layout; the largest "
                f"that starts is {largest:,}, and this command uses it", largest)
    return "", ("does not start at any max_model_len on this layout: more GPUs (--concurrency N plans the "
                "fewest), a smaller weight format or a higher memory budget"), largest


def layouts(arch: Architecture, n: int, gpus_per_node: int = 8) -> List[Tuple[int, int]]:
    """(tp, pp) pairs with tp x pp = n that vLLM accepts, TP within a node, fewest stages first."""
    out = []
    for tp in range(min(n, gpus_per_node), 0, -1):
        if n % tp:
            continue
        pp = n // tp
        try:
            check_layout(arch, tp, pp, 1)
        except VramError:
            continue
        out.append((tp, pp))
    return out


def fewest_gpus(arch: Architecture, s: Any, gpu: Any, concurrency: int, max_gpus: int = 64
                ) -> Optional[ServingPlan]:
    """The smallest layout (fewest GPUs, then fewest pipeline stages) whose KV cache holds
    ``concurrency`` requests of ``s.context_len`` tokens at once; None when even ``max_gpus``
    do not."""
    n = 1
    while n <= max_gpus:
        for tp, pp in layouts(arch, n):
            try:
                p = plan(arch, replace(s, tensor_parallel=tp, pipeline_parallel=pp), gpu)
            except VramError:
                continue
            need = concurrency * (-(-s.context_len // p.block_size) * p.block_size)
            if p.kv_tokens >= need and p.kv_tokens >= s.context_len:
                return p
        n = n + 1 if n < 8 else n + 8
    return None
