"""DeepSpeed ZeRO as it steps: what each GPU holds under stages 0-3, read from DeepSpeed's code.

Source: DeepSpeed 0.19.8, ``deepspeed/runtime/zero/stage3.py`` (``DeepSpeedZeroOptimizer_Stage3``),
``stage_1_and_2.py`` (``DeepSpeedZeroOptimizer``), ``partitioned_param_coordinator.py`` (what
ZeRO-3 gathers), ``parameter_offload.py`` (persistent parameters), ``config.py`` /
``offload_config.py`` (the defaults), ``engine.py`` ``get_data_types`` (the gradient dtype).

Symbols: ``P`` trainable parameters of this GPU's slice, ``N`` ranks a state is partitioned
over, ``b16`` the bytes of the model's dtype (2 for bf16/fp16, 4 for fp32 or torch autocast),
``sg`` the largest ZeRO-3 sub-group (``sub_group_size`` elements of this rank's partition).

ZeRO-3, per GPU (``stage3.py``):

* ``lp_param_buffer`` (``_create_fp16_partitions_with_defragmentation``): every parameter's
  partition in one flat buffer, ``b16 x params / N``; parameters of at most
  ``stage3_param_persistence_threshold`` elements (up to ``stage3_model_persistence_threshold``
  in all) are never partitioned (``parameter_offload.py mark_persistent_parameters``).
* ``fp32_partitioned_groups_flat`` (``_create_fp32_partitions``): the fp32 master partition,
  ``4 x P / N``; when the parameters are already fp32 (torch autocast, fp32 training) the
  partition itself is the master ("we don't need another copy of the weights").
* optimizer states on that fp32 partition, ``8 x P / N`` for Adam, created at the first step.
* ``grad_partitions_flat_buffer`` (``_setup_for_real_optimizer``): the gradient partitions,
  ``gradient_accumulation_dtype x P / N`` from start-up on (the model dtype unless
  ``data_types.grad_accum_dtype`` says otherwise: ``engine.py get_data_types``); on the host
  when the optimizer is offloaded (``self.device`` is the CPU then).
* one IPG bucket of ``reduce_bucket_size`` elements per communication dtype, allocated at
  start-up when ``contiguous_gradients`` (``_setup_for_real_optimizer``).
* gathered parameters: the module running, plus what ``stage3_prefetch_bucket_size`` fetches
  ahead while fewer than ``stage3_max_live_parameters`` are gathered, plus what stays
  gathered because it is used again within ``stage3_max_reuse_distance`` elements
  (``partitioned_param_coordinator.py _fetch_sub_module_impl``, ``__params_to_release``):
  :func:`gather_peaks` replays that schedule module by module.
* backward: the module's full gradients until they are copied into the IPG bucket
  (``__add_grad_to_ipg_bucket``); when the bucket is full it is reduce-scattered
  (``__avg_scatter_grads`` -> ``reduce_scatter_coalesced``, which ``torch.cat``s the bucket).
* the step (``step``): one sub-group at a time: ``_prepare_fp32_grad_for_sub_group``
  flattens the sub-group's gradient partitions (a ``b16 x sg`` copy) and converts them to
  fp32 (``4 x sg``), the optimizer steps that one flat tensor (torch's foreach AdamW adds
  ``sqrt(exp_avg_sq)``, ``4 x sg``; DeepSpeed's FusedAdam nothing), ``_release_sub_group``
  frees the fp32 gradient.

ZeRO-1/2, per GPU (``stage_1_and_2.py``): the 16-bit parameters stay whole (``bit16_groups_flat``);
the fp32 master partition ``single_partition_of_fp32_groups`` (always a clone, even of fp32
weights: ``.detach().clone().to(master dtype)``), ``4 x P / N``; Adam states ``8 x P / N``.
ZeRO-2 copies each reduced gradient's own part into ``grads_in_partition`` (``b16 x P / N``,
allocated at the first gradient of a backward) through ``1 + overlap_comm`` IPG buffers of
``reduce_bucket_size`` elements (``setup_buckets``, freed at the backward's end); ZeRO-1 keeps
every gradient whole until the step.  The step flattens the partition's gradients
(``b16 x P / N``), converts them to fp32 (``4 x P / N``), frees the 16-bit ones, steps.
``allgather_bucket_size`` moves no memory: ``all_gather_dp_groups`` gathers into the flat
buffer in place (``all_gather_into_tensor``; ``deepspeed/runtime/utils.py``).

Offload (``offload_optimizer`` / ``offload_param``, device ``cpu`` or ``nvme``): the master
partition, the states, the fp32 gradients and (ZeRO-3) the gradient partitions move to the
host (NVMe: the master and states to disk, swapped through pinned buffers); ``ratio`` < 1 keeps
the first sub-groups on the GPU (``_create_fp32_partitions``: ``i >= int((1 - ratio) x
n_subgroups)`` go to the CPU).  Parameter offload keeps the 16-bit partition on the host.

One GPU's step plan (``plan/per_gpu.py``, laid out by ``parallel._zero_layout``) reads this
module: :func:`buffers` (the partitions, master copy and buckets with their lifetimes),
:func:`gather_peaks`' gathered modules per block (``sets_by_layer``) and the step's sub-groups
(``ZeroPlan.step_parts``); ``ZeroPlan.model_states`` names each state once for the report.

DeepSpeed's own estimators (``estimate_zero2_model_states_mem_needs``: ``2 P + 18 P / N``;
``estimate_zero3_model_states_mem_needs``: ``4 x largest layer + 18 P / N``) count fp32
gradients for the whole partition at once and no 16-bit gradient partition in ZeRO-3: see
:func:`deepspeed_estimator_bytes` and ``tests/test_zero.py``.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ..errors import VramError
from ..inputs import shown
from ..units import DTYPE_BYTES

#: element bytes of each stored dtype (4-bit weights: the packed uint8 storage)
_ELEM = dict(DTYPE_BYTES, nf4=1, fp4=1, int8=1)


@dataclass(frozen=True)
class ZeroConfig:
    """DeepSpeed's ``zero_optimization`` section, with DeepSpeed's defaults
    (``deepspeed/runtime/zero/config.py`` ``DeepSpeedZeroConfig``, ``offload_config.py``)."""

    stage: int = 0
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    prefetch_bucket_size: int = 50_000_000            # stage3_prefetch_bucket_size
    param_persistence_threshold: int = 100_000        # stage3_param_persistence_threshold
    model_persistence_threshold: int = sys.maxsize    # stage3_model_persistence_threshold
    max_live_parameters: int = 1_000_000_000          # stage3_max_live_parameters
    max_reuse_distance: int = 1_000_000_000           # stage3_max_reuse_distance
    sub_group_size: int = 1_000_000_000
    contiguous_gradients: bool = True
    overlap_comm: Optional[bool] = None               # None: on for stage 3 (overlap_comm_valid)
    reduce_scatter: bool = True
    offload_optimizer: str = "none"                   # offload_optimizer.device: none | cpu | nvme
    offload_param: str = "none"                       # offload_param.device
    offload_ratio: float = 1.0                        # offload_optimizer.ratio
    optimizer_buffer_count: int = 4                   # offload_optimizer.buffer_count (NVMe swap buffers)
    param_buffer_count: int = 5                       # offload_param.buffer_count
    param_buffer_size: int = 100_000_000              # offload_param.buffer_size (elements)

    @property
    def overlap(self) -> bool:
        return (self.stage == 3) if self.overlap_comm is None else bool(self.overlap_comm)


#: DeepSpeed's JSON key (inside ``zero_optimization``) -> ZeroConfig field
DS_KEYS: Dict[str, str] = {
    "stage": "stage", "reduce_bucket_size": "reduce_bucket_size", "allgather_bucket_size": "allgather_bucket_size",
    "stage3_prefetch_bucket_size": "prefetch_bucket_size", "prefetch_bucket_size": "prefetch_bucket_size",
    "stage3_param_persistence_threshold": "param_persistence_threshold",
    "param_persistence_threshold": "param_persistence_threshold",
    "stage3_model_persistence_threshold": "model_persistence_threshold",
    "model_persistence_threshold": "model_persistence_threshold",
    "stage3_max_live_parameters": "max_live_parameters", "max_live_parameters": "max_live_parameters",
    "stage3_max_reuse_distance": "max_reuse_distance", "max_reuse_distance": "max_reuse_distance",
    "sub_group_size": "sub_group_size", "contiguous_gradients": "contiguous_gradients",
    "overlap_comm": "overlap_comm", "reduce_scatter": "reduce_scatter",
    "offload_optimizer.device": "offload_optimizer", "offload_param.device": "offload_param",
    "offload_optimizer.ratio": "offload_ratio", "offload_optimizer.buffer_count": "optimizer_buffer_count",
    "offload_param.buffer_count": "param_buffer_count", "offload_param.buffer_size": "param_buffer_size",
}
_BOOL_FIELDS = {"contiguous_gradients", "reduce_scatter"}


def check_keys(given: Any) -> Dict[str, Any]:
    """``zero_config`` as given: a mapping of DeepSpeed's ZeRO keys (values checked when the
    stage is known, by :func:`zero_config`)."""
    if not isinstance(given, Mapping):
        raise VramError(f"zero_config: must be a mapping of DeepSpeed zero_optimization keys, got {shown(given)}",
                        field="zero_config")
    for k, v in given.items():
        if k in ("offload_optimizer", "offload_param") and isinstance(v, Mapping):
            bad = [sub for sub in v if f"{k}.{sub}" not in DS_KEYS and sub not in _HOST_ONLY]
            if bad:
                raise VramError(f"zero_config: unknown key {shown(k + '.' + str(bad[0]))}; known under {k}: "
                                + ", ".join(sorted(x.split('.', 1)[1] for x in DS_KEYS if x.startswith(k + '.'))),
                                field="zero_config")
        elif k not in DS_KEYS:
            raise VramError(f"zero_config: unknown DeepSpeed ZeRO key {shown(k)}; known: "
                            + ", ".join(sorted(x for x in DS_KEYS if "." not in x)), field="zero_config")
    return dict(given)


#: offload keys that change only host-side behaviour (pinned or not, NVMe paths, pipelining)
_HOST_ONLY = ("pin_memory", "nvme_path", "pipeline_read", "pipeline_write", "fast_init", "max_in_cpu",
              "super_offload", "cpuadam_cores_perc")


#: "auto" as the HF integration fills it from the model's hidden size h
#: (transformers/integrations/deepspeed.py HfTrainerDeepSpeedConfig.trainer_config_finalize)
HIDDEN_AUTO = {"reduce_bucket_size": lambda h: h * h, "prefetch_bucket_size": lambda h: int(0.9 * h * h),
               "param_persistence_threshold": lambda h: 10 * h}


def zero_config(stage: int, given: Optional[Mapping[str, Any]] = None, hidden_size: Optional[int] = None,
                **flat: Any) -> ZeroConfig:
    """A validated :class:`ZeroConfig`: ``given`` holds DeepSpeed's own keys (those of
    :data:`DS_KEYS`; ``offload_optimizer`` / ``offload_param`` may be ``{"device": ...}``), ``flat``
    the same fields by their ZeroConfig names (None: not set).  ``"auto"`` for the three
    hidden-size keys is filled as the HF integration fills it (:data:`HIDDEN_AUTO`, from
    ``hidden_size``).  Bad values raise VramError."""
    out: Dict[str, Any] = {"stage": stage}
    for k, v in check_keys(given or {}).items():
        if k in ("offload_optimizer", "offload_param") and isinstance(v, Mapping):
            for sub, val in v.items():
                if f"{k}.{sub}" in DS_KEYS:
                    out[DS_KEYS[f"{k}.{sub}"]] = val
            continue
        if k == "stage" and v != stage:
            raise VramError(f"zero_config: stage {shown(v)} differs from the strategy's stage {stage}",
                            field="zero_config")
        out[DS_KEYS[k]] = v
    for k, v in flat.items():
        if v is None:
            continue
        if k in ("offload_optimizer", "offload_param") and v == "cpu" and out.get(k) in ("cpu", "nvme"):
            continue        # offloaded (the flat switch) to the device zero_config names
        if k in out and k != "stage" and out[k] != "auto" and _check(k, out[k]) != _check(k, v):
            raise VramError(f"{k}: given twice, as {shown(v)} and in zero_config as {shown(out[k])}", field=k)
        out[k] = v
    for k, fill in HIDDEN_AUTO.items():
        if out.get(k) == "auto":
            if not hidden_size:
                raise VramError(f"{k}: 'auto' needs the model's hidden size", field=k)
            out[k] = fill(int(hidden_size))
    for k, v in list(out.items()):
        out[k] = _check(k, v)
    if out.get("offload_param", "none") != "none" and out["stage"] != 3:
        raise VramError("offload_param: parameter offload needs ZeRO stage 3", field="offload_param")
    if out.get("offload_optimizer", "none") != "none" and out["stage"] == 0:
        raise VramError("offload_optimizer: optimizer offload needs ZeRO stage 1, 2 or 3", field="offload_optimizer")
    if out.get("offload_ratio", 1.0) < 1.0 and out["stage"] != 3:
        raise VramError("offload_ratio: partial offload needs ZeRO stage 3 (config.py offload_ratio_check)",
                        field="offload_ratio")
    return ZeroConfig(**out)


def _check(name: str, v: Any) -> Any:
    if name in ("offload_optimizer", "offload_param"):
        if v is True:
            return "cpu"
        if v is False or v is None:
            return "none"
        if isinstance(v, str) and v.lower() in ("none", "cpu", "nvme"):
            return v.lower()
        raise VramError(f"{name}: device must be 'none', 'cpu' or 'nvme', got {shown(v)}", field=name)
    if name == "overlap_comm":
        if v is None or isinstance(v, bool):
            return v
        raise VramError(f"overlap_comm: must be true or false, got {shown(v)}", field="overlap_comm")
    if name in _BOOL_FIELDS:
        if not isinstance(v, bool):
            raise VramError(f"{name}: must be true or false, got {shown(v)}", field=name)
        return v
    if name == "offload_ratio":
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
            raise VramError(f"offload_ratio: must be a number from 0 to 1, got {shown(v)}", field=name)
        return float(v)
    # element counts: DeepSpeed accepts 5e8 as well as 500000000
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v in (float("inf"), float("-inf")):
        raise VramError(f"{name}: must be a whole number of elements >= 0, got {shown(v)}", field=name)
    if v < 0 or (name == "reduce_bucket_size" and v <= 0) or (name == "stage" and not 0 <= v <= 3):
        allowed = "0-3" if name == "stage" else (">= 1" if name == "reduce_bucket_size" else ">= 0")
        raise VramError(f"{name}: must be {allowed}, got {shown(v)}", field=name)
    return int(v)


# ----------------------------------------------------------------------------------
# The model as ZeRO sees it: parameters in module order
# ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Param:
    """One parameter instance: its module (DeepSpeed gathers per module), the layer it sits in
    (-1 before the blocks, L after them), elements, bytes as stored, whether it trains, and
    whether it is an expert's (partitioned over the expert-data-parallel ranks)."""

    module: str
    layer: int
    numel: int
    nbytes: float
    grad_bytes: float
    trains: bool
    expert: bool


#: (id of the architecture, id of its ParamStorage, r) -> (the architecture, the storage, the
#: parameters in order): the same for every batch and sequence length of a setup shape, so a
#: solver's probes and the widget's batch changes list them once
_PARAMS_IN_ORDER: Dict[Tuple[int, int, int], Tuple[Any, Any, List[Param]]] = {}
#: (id of a params_in_order list, the gather_peaks arguments) -> (that list, its GatherPeaks)
_GATHER_PEAKS: Dict[Tuple[Any, ...], Tuple[List[Param], "GatherPeaks"]] = {}
_MAX_CACHED = 256


def clear_caches() -> None:
    """Forget the cached parameter lists and gather peaks (``allocator.replays.clear_caches``)."""
    _PARAMS_IN_ORDER.clear()
    _GATHER_PEAKS.clear()


def params_in_order(arch: Any, P: Any, lora_r: int = 0) -> List[Param]:
    """Every parameter instance of the slice in ``model.parameters()`` order (the order
    DeepSpeed groups, partitions and sub-groups them in); a block's LoRA factors (peft's
    ``lora_A`` / ``lora_B`` Linear modules, r x in and out x r) after the block's own.
    Cached per architecture, storage and rank (the list is shared: read it, do not change it)."""
    key = (id(arch), id(P), lora_r)
    hit = _PARAMS_IN_ORDER.get(key)
    if hit is not None and hit[0] is arch and hit[1] is P:
        return hit[2]
    out = _params_in_order(arch, P, lora_r)
    if len(_PARAMS_IN_ORDER) >= _MAX_CACHED:
        _PARAMS_IN_ORDER.clear()
    _PARAMS_IN_ORDER[key] = (arch, P, out)
    return out


def _params_in_order(arch: Any, P: Any, lora_r: int) -> List[Param]:
    from ..plan.load import instances as _instances

    before, after, per_layer = _instances(arch, P)
    out: List[Param] = []
    ad = DTYPE_BYTES.get(P.adapter_dtype, 4)

    def add(inst: Tuple[Any, ...], layer: int) -> None:
        t, dtype, nbytes, trains, numel = inst
        module = t.name.rsplit(".", 1)[0].replace("{i}", str(layer))
        grad = numel * DTYPE_BYTES.get(dtype, 2) if trains else 0.0
        out.append(Param(module, layer, int(numel), float(nbytes), grad, bool(trains), bool(t.experts)))

    extra: Dict[int, List[Param]] = {}
    if P.adapters:
        targets = arch.lora_tensors(P.lora_modules)
        for module, group, nbytes, numel in P.adapters:
            t = next((x for x in targets if x.module == module and x.group == group),
                     next((x for x in targets if x.module == module), None))
            if t is None or not t.layers or not lora_r:
                # not a block module's A/B pair (DoRA magnitudes, LoRA on the head or embedding)
                extra.setdefault(-1, []).append(Param(module + " (adapter)", -1, int(numel), float(nbytes),
                                                      float(nbytes), True, False))
                continue
            for layer in range(t.layers[0], t.layers[1] + 1):
                for part, feats in (("lora_A", t.in_features), ("lora_B", t.out_features)):
                    n = lora_r * feats
                    extra.setdefault(layer, []).append(Param(f"layers.{layer}.{module}.{part}", layer, n, n * ad,
                                                             n * ad, True, False))
    for inst in before:
        add(inst, -1)
    for layer, insts in enumerate(per_layer):
        for inst in insts:
            add(inst, layer)
        out.extend(extra.get(layer, []))
    for inst in after:
        add(inst, len(per_layer))
    if arch.tie_word_embeddings and before:
        # a tied head runs the embedding's parameter: DeepSpeed gathers it again at the head
        # (a marker without elements of its own)
        emb = next((p for p in out if p.layer == -1 and "embed" in p.module), None)
        if emb is not None:
            out.append(Param(emb.module, len(per_layer), 0, 0.0, 0.0, False, False))
    out.extend(extra.get(-1, []))
    return out


# ----------------------------------------------------------------------------------
# ZeRO-3's gather schedule
# ----------------------------------------------------------------------------------

@dataclass
class GatherPeaks:
    """What ZeRO-3 holds gathered (bytes, in the parameters' stored dtype) at its worst."""

    forward_bytes: float = 0.0       # gathered parameters, forward
    backward_bytes: float = 0.0      # gathered parameters + the module's full gradients + a bucket flush
    module_bytes: float = 0.0        # the largest module's parameters (what is always fetched)
    prefetched_bytes: float = 0.0    # fetched ahead of their use, at the forward peak
    reused_bytes: float = 0.0        # kept gathered since an earlier use (max_reuse_distance), at the forward peak
    retained_bytes: float = 0.0      # still gathered when the forward ends
    grad_bytes: float = 0.0          # the largest module's full gradients (backward)
    flush_bytes: float = 0.0         # reduce_scatter_coalesced's torch.cat of a full bucket (+ its partition)
    persistent_bytes: float = 0.0    # persistent parameters, whole, on every GPU
    persistent_numel: int = 0
    trace_len: int = 0
    #: the most gathered (bytes) while each block runs, per pass: ("forward" | "backward", layer),
    #: layer -1 before the blocks and L after them (the per-GPU plan gathers these)
    by_layer: Dict[Tuple[str, int], float] = field(default_factory=dict)
    #: the modules gathered then, as (module index, bytes): what the per-GPU plan allocates
    sets_by_layer: Dict[Tuple[str, int], Tuple[Tuple[int, float], ...]] = field(default_factory=dict)


def _modules(params: Sequence[Param], cfg: ZeroConfig) -> Tuple[List[Tuple[str, int, int, float, float]],
                                                                 float, int]:
    """Modules in forward order as (module, layer, numel, bytes, grad bytes) of their
    non-persistent parameters, and the persistent parameters' bytes and elements."""
    mods: Dict[str, List[Any]] = {}
    persistent_numel, persistent_bytes = 0, 0.0
    for p in params:
        if p.numel == 0:          # a tied head's marker (params_in_order)
            continue
        # parameter_offload.py mark_persistent_parameters: small parameters, while the
        # model's persistent total stays within model_persistence_threshold
        if p.numel <= cfg.param_persistence_threshold and \
                persistent_numel + p.numel <= cfg.model_persistence_threshold:
            persistent_numel += p.numel
            persistent_bytes += p.nbytes
            continue
        m = mods.setdefault(p.module, [p.module, p.layer, 0, 0.0, 0.0])
        m[2] += p.numel
        m[3] += p.nbytes
        m[4] += p.grad_bytes
    return [tuple(m) for m in mods.values()], persistent_bytes, persistent_numel  # type: ignore[misc]


def gather_peaks(params: Sequence[Param], cfg: ZeroConfig, checkpointing: bool, num_layers: int,
                 comm_bytes: float = 2.0, N: int = 1) -> GatherPeaks:
    """Replay ZeRO-3's parameter coordinator over one step (forward, then backward in reverse,
    each checkpointed block run forward again first) and return its largest gathered sets.

    ``partitioned_param_coordinator.py``: ``_fetch_sub_module_impl`` all-gathers the module's
    parameters (whatever ``max_live_parameters`` says), then prefetches from the trace until
    ``min(max_live_parameters - available, prefetch_bucket_size)`` elements are on their way;
    ``release_sub_module`` keeps a parameter that the trace uses again before
    ``max_reuse_distance`` elements have passed (``__params_to_release``) or that a prefetch
    already fetched for a later use.

    Cached per parameter list (``params_in_order``'s, by identity) and arguments: the same
    for every batch and sequence length (the result is shared: read it, do not change it).
    """
    key = (id(params), cfg, checkpointing, num_layers, comm_bytes, N)
    hit = _GATHER_PEAKS.get(key)
    if hit is not None and hit[0] is params:
        return hit[1]
    out = _gather_peaks(params, cfg, checkpointing, num_layers, comm_bytes, N)
    if len(_GATHER_PEAKS) >= _MAX_CACHED:
        _GATHER_PEAKS.clear()
    _GATHER_PEAKS[key] = (params, out)
    return out


def _gather_peaks(params: Sequence[Param], cfg: ZeroConfig, checkpointing: bool, num_layers: int,
                  comm_bytes: float, N: int) -> "GatherPeaks":
    mods, pb, pn = _modules(params, cfg)
    out = GatherPeaks(persistent_bytes=pb, persistent_numel=pn)
    if not mods:
        return out
    by_layer: Dict[int, List[int]] = {}
    for i, m in enumerate(mods):
        by_layer.setdefault(m[1], []).append(i)
    fwd = list(range(len(mods)))
    names = [m[0] for m in mods]
    tied = [names.index(p.module) for p in params if p.numel == 0 and p.module in names]
    fwd += tied                           # the tied head runs the embedding's parameter last
    bwd: List[Tuple[int, bool]] = [(i, True) for i in tied]   # (module, is a backward step)
    for layer in sorted(by_layer, reverse=True):
        idx = by_layer[layer]
        if checkpointing and 0 <= layer < num_layers:
            bwd.extend((i, False) for i in idx)   # the block's forward again (non-reentrant checkpointing)
        bwd.extend((i, True) for i in reversed(idx))
    trace = [(i, False) for i in fwd] + bwd
    n = len(trace)
    # the block each step of the trace runs in: a tied head's use of the embedding is after the blocks
    at_layer = [mods[i][1] for i in range(len(mods))] + [num_layers] * len(tied) \
        + [num_layers] * len(tied) + [mods[i][1] for i, _ in bwd[len(tied):]]
    out.trace_len = n
    numel = [m[2] for m in mods]
    nbytes = [m[3] for m in mods]
    # where each module is used next, and the elements the trace passes on the way
    prefix = [0] * (n + 1)
    for k, (i, _) in enumerate(trace):
        prefix[k + 1] = prefix[k] + numel[i]
    nxt = [n] * n
    last: Dict[int, int] = {}
    for k in range(n - 1, -1, -1):
        i = trace[k][0]
        nxt[k] = last.get(i, n)
        last[i] = k
    avail: Dict[int, bool] = {}       # module -> fetched ahead of its use (prefetch) rather than kept
    n_avail, b_avail = 0, 0.0
    qptr = 0
    bucket = 0.0
    cap_bucket = cfg.reduce_bucket_size * comm_bytes
    for k, (i, is_bwd) in enumerate(trace):
        if i not in avail:
            n_avail += numel[i]
            b_avail += nbytes[i]
        avail[i] = False                  # in use now: no longer "ahead"
        qptr = max(qptr, k + 1)
        budget = min(cfg.max_live_parameters - n_avail, cfg.prefetch_bucket_size)
        pre = 0
        while qptr < n and pre < budget:
            j = trace[qptr][0]
            qptr += 1
            if j not in avail:
                avail[j] = True
                n_avail += numel[j]
                b_avail += nbytes[j]
                pre += numel[j]
        extra = 0.0
        if is_bwd:
            g = mods[i][4]
            flush = 0.0
            if g and bucket + g > cap_bucket and bucket > 0:
                flush = bucket * (1.0 + 1.0 / N)       # torch.cat of the bucket + its reduced partition
                bucket = 0.0
            bucket += g
            loose = bucket if not cfg.contiguous_gradients else 0.0   # gradients wait as they are
            extra = g + flush + loose
            if flush > out.flush_bytes:
                out.flush_bytes = flush
            if g > out.grad_bytes:
                out.grad_bytes = g
        where = ("forward" if k < len(fwd) else "backward", at_layer[k])
        if b_avail > out.by_layer.get(where, -1.0):
            out.by_layer[where] = b_avail
            out.sets_by_layer[where] = tuple((j, nbytes[j]) for j in avail)
        if k < len(fwd):
            if b_avail > out.forward_bytes:
                out.forward_bytes = b_avail
                out.prefetched_bytes = sum(nbytes[j] for j, ahead in avail.items() if ahead)
                out.reused_bytes = b_avail - nbytes[i] - out.prefetched_bytes
        elif b_avail + extra > out.backward_bytes:
            out.backward_bytes = b_avail + extra
        if nbytes[i] > out.module_bytes:
            out.module_bytes = nbytes[i]
        # release unless used again soon (or already prefetched for a later use)
        reuse = nxt[k]
        keep = reuse < n and (prefix[reuse] - prefix[k + 1] < cfg.max_reuse_distance or reuse < qptr)
        if not keep:
            del avail[i]
            n_avail -= numel[i]
            b_avail -= nbytes[i]
        if k == len(fwd) - 1:
            out.retained_bytes = b_avail
    return out


# ----------------------------------------------------------------------------------
# Sub-groups and partitions
# ----------------------------------------------------------------------------------

def sub_groups(params: Sequence[Param], cfg: ZeroConfig, N: int, Ne: int) -> List[Tuple[int, float]]:
    """ZeRO-3's sub-groups of this rank's partition as (elements, bytes of the master dtype's
    partition): ``stage3.py _create_fp16_sub_groups`` walks the trainable parameters in order
    and closes a sub-group once its partition elements reach ``sub_group_size``.  Expert
    parameters form their own groups (their partition count differs)."""
    out: List[Tuple[int, float]] = []
    for expert, world in ((False, N), (True, Ne)):
        group = [p for p in params if p.trains and p.expert == expert]
        parts = [math.ceil(p.numel / world) for p in group]
        total = sum(parts)
        if not parts:
            continue
        if cfg.sub_group_size >= total:
            out.append((total, float(total)))
            continue
        cur = 0
        for k, n in enumerate(parts):
            cur += n
            if cur >= cfg.sub_group_size or k == len(parts) - 1:
                out.append((cur, float(cur)))
                cur = 0
    return out


# ----------------------------------------------------------------------------------
# The plan: per-GPU model states of one stage
# ----------------------------------------------------------------------------------

@dataclass
class ZeroPlan:
    """What ZeRO changes on one GPU.

    ``factors[component][phase]`` scales the single-GPU estimate's component trees (dense,
    experts); ``adds`` are new leaves ``(phases, component, name, bytes, formula)``;
    ``model_states`` / ``cpu`` / ``nvme`` name every state once, by where it lives."""

    factors: Dict[str, Dict[str, Tuple[float, float]]] = field(default_factory=dict)
    adds: List[Tuple[Tuple[str, ...], str, str, float, str]] = field(default_factory=list)
    model_states: Dict[str, float] = field(default_factory=dict)
    cpu: Dict[str, float] = field(default_factory=dict)
    nvme: Dict[str, float] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)
    gather: Optional[GatherPeaks] = None
    sub_groups: List[Tuple[int, float]] = field(default_factory=list)
    comm_buffers_bytes: float = 0.0
    #: the step on the GPU, sub-group by sub-group: (fp32 gradients, 16-bit flat copy, optimizer temporary)
    step_parts: List[Tuple[float, float, float]] = field(default_factory=list)


ALL = ("after_load", "forward", "backward", "optimizer_step")


def _every(f: float, fe: float) -> Dict[str, Tuple[float, float]]:
    return {p: (f, fe) for p in ALL}


def master_aliases(weights_dtype: str) -> bool:
    """ZeRO-3 keeps no separate fp32 master when the partition already is fp32 (torch autocast
    or fp32 training): ``stage3.py _create_fp32_partitions`` appends the 16-bit partition itself
    when its dtype is the master dtype.  ZeRO-1/2 always clone (``stage_1_and_2.py``)."""
    return weights_dtype == "float32"


def plan(params: Sequence[Param], cfg: ZeroConfig, N: int, Ne: int, *, weights_bytes: Tuple[float, float],
         grads_bytes: Tuple[float, float], states_bytes: Tuple[float, float], adapters_bytes: float,
         weights_dtype: str, optimizer: str, checkpointing: bool, num_layers: int,
         comm_dtypes: Sequence[str], state_count: int) -> ZeroPlan:
    """The per-GPU plan of ZeRO stage ``cfg.stage`` for this GPU's slice.

    ``weights_bytes``, ``grads_bytes``, ``states_bytes``: the single-GPU estimate's (dense,
    experts) totals of those components at full size (the states already fp32, as DeepSpeed
    keeps them); ``weights_dtype`` the parameters' dtype (bf16 / fp16 / fp32); ``N`` / ``Ne``
    the ranks dense / expert states are partitioned over (1 for stage 0)."""
    st = cfg.stage
    pl = ZeroPlan()
    W, We = weights_bytes
    G, Ge = grads_bytes
    S, Se = states_bytes
    fN, fNe = (1.0 / N, 1.0 / Ne) if st else (1.0, 1.0)
    tr = [p for p in params if p.trains]
    P_part = sum(p.numel for p in tr if not p.expert) * fN + sum(p.numel for p in tr if p.expert) * fNe
    gpart = G * fN + Ge * fNe                      # this rank's gradients in the parameters' dtype
    gacc = gpart / P_part if P_part else DTYPE_BYTES.get(weights_dtype, 2)
    off_opt, off_par = cfg.offload_optimizer != "none", cfg.offload_param != "none"
    opt_home = pl.nvme if cfg.offload_optimizer == "nvme" else pl.cpu
    ratio = cfg.offload_ratio if off_opt else 0.0
    on_gpu = 1.0 - ratio
    comm_b = [DTYPE_BYTES[d] for d in comm_dtypes] or [DTYPE_BYTES.get(weights_dtype, 2)]

    # -- parameters ---------------------------------------------------------------------------
    if st == 3:
        f = 0.0 if off_par else 1.0
        pl.factors["weights"] = _every(fN * f, fNe * f)
        pl.factors["adapters"] = _every(fN * f, fN * f)
        pl.model_states["weights"] = W * fN + We * fNe
        if off_par:
            pl.cpu["parameters"] = W * fN + We * fNe + adapters_bytes * fN
    else:
        pl.model_states["weights"] = W + We
    # -- optimizer states and the fp32 master -------------------------------------------------
    states = S * fN + Se * fNe
    pl.factors["optimizer states"] = _every(fN * on_gpu, fNe * on_gpu)
    pl.model_states["optimizer states"] = states
    if ratio:
        opt_home["optimizer states"] = states * ratio
    # ZeRO-3 steps an fp32 partition itself; ZeRO-1/2 clone it; stage 0's FP16_Optimizer keeps
    # an fp32 copy of 16-bit weights only (fp32 training steps the weights: no wrapper)
    alias = master_aliases(weights_dtype) and st in (0, 3)
    master = 0.0 if alias else 4.0 * P_part
    pl.model_states["fp32 master weights"] = master
    if alias and st == 3:
        pl.notes.append("ZeRO-3 steps the fp32 parameter partition itself: no separate fp32 master copy "
                        "(stage3.py _create_fp32_partitions)")
    if master:
        if ratio:
            opt_home["fp32 master weights"] = master * ratio
        name = {0: "fp32_groups_flat (FP16_Optimizer)", 3: "fp32_partitioned_groups_flat"}.get(
            st, "single_partition_of_fp32_groups")
        pl.adds.append((ALL, "optimizer states", "fp32 master weights", master * on_gpu,
                        f"4 B x {P_part:,.0f} trainable elements ({name})"))
    # -- gradients ----------------------------------------------------------------------------
    sgs = sub_groups(params, cfg, N, Ne) if st == 3 else []
    pl.sub_groups = sgs
    pl.model_states["gradients"] = gpart if st in (2, 3) else G + Ge
    if st == 3:
        pl.factors["gradients"] = _every(0.0, 0.0)
        if off_opt:
            # self.device is the CPU under optimizer offload (NVMe too: pinned host buffers)
            pl.cpu["gradient partitions"] = gpart
        else:
            pl.adds.append((ALL, "gradients", "gradient partitions (grad_partitions_flat_buffer)", gpart,
                            f"{gacc:g} B x {P_part:,.0f} elements, allocated at start-up"))
    elif st == 2:
        pl.factors["gradients"] = _every(0.0, 0.0)
        pl.adds.append((("backward",), "gradients", "gradient partition (grads_in_partition)", gpart,
                        f"{gacc:g} B x {P_part:,.0f} elements: each reduced gradient's own part"))
    else:
        # whole gradients through the backward; the step keeps them until its flat fp32 copy exists
        pl.factors["gradients"] = _every(1.0, 1.0)
    # -- the step: fp32 gradients and the optimizer's working set --------------------------------
    if st == 3:
        n_gpu_groups = int((1 - ratio) * len(sgs)) if off_opt else len(sgs)
        step_elems = max((n for k, (n, _) in enumerate(sgs) if k < n_gpu_groups), default=0)
    else:
        # stage 0 with fp32 parameters has no FP16_Optimizer: torch's optimizer steps them as they are
        step_elems = 0 if (off_opt or (st == 0 and alias)) else P_part
    pl.model_states["fp32 gradients"] = 4.0 * (max((n for n, _ in sgs), default=0) if st == 3 else
                                               (P_part if (st or not alias) else 0))
    if off_opt:
        pl.cpu["fp32 gradients"] = 4.0 * P_part      # DeepSpeedCPUAdam's gradients: on the host
    # the gradients still referenced while the flat fp32 copy is made (ZeRO-3's are in the
    # start-up buffer, counted above): stage 0/1 all of them, stage 2 its partition
    held = {0: G + Ge, 1: G + Ge, 2: gpart}.get(st, 0.0) if step_elems else 0.0
    if st in (0, 1) and step_elems:
        pl.factors["gradients"]["optimizer_step"] = (0.0, 0.0)
    flat_copy = 0.0 if gacc == 4.0 else gacc * step_elems      # _flatten_dense_tensors, freed after .to(fp32)
    temps = 4.0 * step_elems if optimizer == "adamw" else 0.0
    pl.factors["optimizer temporaries"] = _every(0.0, 0.0) if optimizer in ("adamw", "adamw_fused") and step_elems \
        else _every(fN * on_gpu, fNe * on_gpu)
    if st == 3:
        gpu_groups = [n for k, (n, _) in enumerate(sgs) if k < n_gpu_groups]
    else:
        gpu_groups = [step_elems] if step_elems else []
    pl.step_parts = [(4.0 * n, 0.0 if gacc == 4.0 else gacc * n, 4.0 * n if optimizer == "adamw" else 0.0)
                     for n in gpu_groups]
    if step_elems:
        where = f"one sub-group ({step_elems:,} elements; sub_group_size {cfg.sub_group_size:.3g})" \
            if st == 3 else f"the partition ({step_elems:,.0f} elements)"
        work = max(held + flat_copy, temps)
        pl.adds.append((("optimizer_step",), "gradients", "fp32 gradients of the step", 4.0 * step_elems,
                        f"4 B x {where}: the gradients flattened and converted to fp32"))
        pl.adds.append((("optimizer_step",), "optimizer temporaries", "step working set", work,
                        f"max(16-bit gradients still held {held / 2**20:,.0f} MiB + their flat copy "
                        f"{flat_copy / 2**20:,.0f} MiB before .to(fp32), "
                        + (f"foreach AdamW's sqrt(exp_avg_sq) of {where})" if temps else "no optimizer temporary)")))
        pl.model_states["step working set"] = work
    # -- buckets ------------------------------------------------------------------------------
    comm = 0.0
    if st == 3 and cfg.contiguous_gradients:
        comm = cfg.reduce_bucket_size * sum(comm_b)
        pl.adds.append((ALL, "gradients", "IPG bucket (contiguous gradients)", comm,
                        f"reduce_bucket_size {cfg.reduce_bucket_size:.3g} elements x "
                        f"({' + '.join(f'{b:g}' for b in comm_b)}) B, one per communication dtype, at start-up"))
    elif st in (1, 2) and cfg.contiguous_gradients:
        nbuf = 2 if cfg.overlap else 1
        comm = nbuf * cfg.reduce_bucket_size * sum(comm_b)
        pl.adds.append((("backward",), "gradients", "IPG buckets (contiguous gradients)", comm,
                        f"{nbuf} (overlap_comm {'on' if cfg.overlap else 'off'}) x reduce_bucket_size "
                        f"{cfg.reduce_bucket_size:.3g} x {'+'.join(f'{b:g}' for b in comm_b)} B, at each backward"))
    elif st == 0:
        # engine.allreduce_gradients -> buffered_allreduce_fallback: flat copies of
        # reduce_bucket_size elements at a time
        comm = cfg.reduce_bucket_size * max(comm_b)
        pl.adds.append((("backward",), "gradients", "all-reduce bucket (flat copy)", min(comm, G + Ge),
                        f"reduce_bucket_size {cfg.reduce_bucket_size:.3g} x {max(comm_b):g} B"))
    pl.comm_buffers_bytes = comm
    pl.model_states["communication buffers"] = comm
    if st == 3:
        _gathered(pl, params, cfg, checkpointing, num_layers, max(comm_b), N, off_par,
                  DTYPE_BYTES.get(weights_dtype, 2))
    elif st == 2:
        g_max = max((p.grad_bytes for p in tr), default=0.0)
        pl.adds.append((("backward",), "gradients", "a gradient before its bucket copy", g_max,
                        "the largest parameter's gradient until reduce_independent_p_g_buckets_and_remove_grads "
                        "copies it into the IPG bucket"))
    if cfg.offload_optimizer == "nvme":
        sg = max((n for n, _ in sgs), default=P_part) if st == 3 else P_part
        pl.cpu["optimizer swap buffers (pinned)"] = cfg.optimizer_buffer_count * 4.0 * sg * (1 + state_count)
    return pl


def _gathered(pl: ZeroPlan, params: Sequence[Param], cfg: ZeroConfig, checkpointing: bool, num_layers: int,
              comm_b: float, N: int, off_par: bool, b16: float) -> None:
    """ZeRO-3's gathered parameters, persistent parameters and backward gradients into ``pl``."""
    gp = gather_peaks(params, cfg, checkpointing, num_layers, comm_bytes=comm_b, N=N)
    pl.gather = gp
    persist_extra = gp.persistent_bytes * (1.0 - 1.0 / N) if not off_par else gp.persistent_bytes
    if persist_extra:
        pl.adds.append((ALL, "weights", "persistent parameters (never partitioned)", persist_extra,
                        f"{gp.persistent_numel:,} elements in parameters of <= stage3_param_persistence_threshold "
                        f"({cfg.param_persistence_threshold:,}) elements, whole on every GPU"))
    pl.model_states["persistent parameters"] = persist_extra
    bwd_params = max(gp.backward_bytes - gp.grad_bytes - gp.flush_bytes, 0.0)
    pl.adds.append((("forward",), "weights", "gathered parameters", gp.forward_bytes,
                    f"the module running ({gp.module_bytes / 2**20:,.0f} MiB at most) + prefetched "
                    f"(stage3_prefetch_bucket_size {cfg.prefetch_bucket_size:.3g}, stage3_max_live_parameters "
                    f"{cfg.max_live_parameters:.3g}) + kept for reuse (stage3_max_reuse_distance "
                    f"{cfg.max_reuse_distance:.3g}): the coordinator replayed over the step"))
    pl.adds.append((("backward",), "weights", "gathered parameters", bwd_params,
                    "the same schedule in backward (checkpointed blocks run forward again first)"))
    pl.adds.append((("backward",), "gradients", "module gradients before the bucket copy + bucket flush",
                    gp.grad_bytes + gp.flush_bytes,
                    "the module's full gradients (__add_grad_to_ipg_bucket) + reduce_scatter_coalesced's "
                    "torch.cat of a full bucket"))
    pl.model_states["gathered parameters"] = max(gp.forward_bytes, bwd_params)
    pl.model_states["gathered gradients"] = gp.grad_bytes
    pl.model_states["prefetched parameters"] = gp.prefetched_bytes
    if off_par:
        # the partition of the module being fetched is copied to the GPU before its all-gather
        pl.adds.append((("forward", "backward"), "weights", "offloaded partitions copied to the GPU",
                        gp.module_bytes / N, f"the fetched module's partition (1/{N}) on its way to the all-gather"))
        if cfg.offload_param == "nvme":
            pl.nvme["parameters"] = pl.cpu.pop("parameters", 0.0)
            pl.cpu["parameter swap buffers (pinned)"] = cfg.param_buffer_count * cfg.param_buffer_size * b16


#: the buffers of ``plan``'s additions whose lifetime the per-GPU plan gives them (every
#: other addition is a tensor the per-GPU plan makes where the program makes it: the gathered
#: parameters, a module's gradients, the step's fp32 gradients and temporaries)
_BACKWARD_BUFFERS = {
    # stage_1_and_2.py: ``grads_in_partition`` is made at the first reduced gradient
    # (copy_grads_in_partition) and read by ``step`` (get_flat_partition), then dropped
    "gradient partition (grads_in_partition)": "until_step",
    # the IPG buffers: made by DeepSpeedZeroOptimizer.backward before the loss's backward
    # (ipg_buffer, 1 + overlap_comm of them), dropped by independent_gradient_partition_epilogue
    # (_release_ipg_buffers) once the backward's gradients are reduced
    "IPG buckets (contiguous gradients)": "backward",
    # stage 0: engine.allreduce_gradients -> buffered_allreduce_fallback flattens
    # reduce_bucket_size elements at a time once the backward is done
    "all-reduce bucket (flat copy)": "after_backward",
}


def buffers(pl: ZeroPlan) -> List[Tuple[str, str, str, float, str]]:
    """ZeRO's own buffers on one GPU as (lifetime, component, name, bytes, formula): those of
    every phase live from start-up (``startup``), the backward's as :data:`_BACKWARD_BUFFERS` says."""
    out = []
    for phases, comp, name, nb, formula in pl.adds:
        if nb <= 0:
            continue
        if phases == ALL:
            out.append(("startup", comp, name, nb, formula))
        elif name in _BACKWARD_BUFFERS:
            out.append((_BACKWARD_BUFFERS[name], comp, name, nb, formula))
    return out


# ----------------------------------------------------------------------------------
# DeepSpeed's own estimators, as arithmetic
# ----------------------------------------------------------------------------------

def deepspeed_estimator_bytes(stage: int, total_params: float, largest_layer_params: float = 0.0,
                              num_gpus_per_node: int = 1, num_nodes: int = 1, cpu_offload: bool = False,
                              cpu_offload_params: bool = False, zero_init: bool = True,
                              additional_buffer_factor: float = 1.5) -> Tuple[int, int]:
    """(CPU bytes per node, GPU bytes per GPU) as DeepSpeed's
    ``estimate_zero2_model_states_mem_needs`` (``stage_1_and_2.py``) and
    ``estimate_zero3_model_states_mem_needs`` (``stage3.py``) compute them: ZeRO-2
    ``2 P + 18 P / N`` (offload: ``2 P`` on the GPU, ``P x max(4 N, 16) x 1.5`` on the host);
    ZeRO-3 ``4 x largest layer + 18 P / N`` (optimizer offload: ``4 L + 2 P / N``; all
    offloaded: ``4 L``)."""
    total_gpus = num_nodes * num_gpus_per_node
    if stage in (1, 2):
        if cpu_offload:
            return int(total_params * max(4 * total_gpus, 16) * additional_buffer_factor), int(2 * total_params)
        return (int(total_params * 4 * num_gpus_per_node * additional_buffer_factor),
                int(2 * total_params + int(18 * total_params / total_gpus)))
    gpus_factor = 1 / num_nodes
    largest = 4 * largest_layer_params
    if cpu_offload:
        if cpu_offload_params:
            gpu = largest
            cpu = total_params * (18 * gpus_factor if zero_init else max(4 * num_gpus_per_node, 18 * gpus_factor))
        else:
            gpu = largest + int(2 * total_params / total_gpus)
            cpu = total_params * (16 * gpus_factor if zero_init else max(4 * num_gpus_per_node, 16 * gpus_factor))
    else:
        gpu = largest + int(18 * total_params / total_gpus)
        cpu = (largest_layer_params if zero_init else total_params) * 4 * num_gpus_per_node
    return int(cpu * additional_buffer_factor), int(gpu)

