"""DeepSpeed JSON (``ds_config.json``): ZeRO stage, offload, bucket sizes, precision, batch.

Keys and defaults are DeepSpeed's (deepspeed/runtime/zero/config.py ``DeepSpeedZeroConfig``:
``reduce_bucket_size`` 5e8, ``stage3_prefetch_bucket_size`` 5e7, ``overlap_comm`` on for
stage 3; deepspeed/runtime/config.py for ``train_micro_batch_size_per_gpu``, ``bf16``,
``fp16``, ``torch_autocast``).  Every ZeRO key that moves memory goes to ``zero_config``
(vramwidget.parallel.zero.DS_KEYS: sub-groups, buckets, prefetch, persistence, live parameters, reuse
distance, contiguous gradients, offload devices, ratio and NVMe buffers).  "auto" batch and
precision values are filled in by the HF/accelerate integration at launch from the Trainer's
own arguments, so they are read from there, not here; the three hidden-size "auto" bucket
keys stay "auto" and are resolved from the model (transformers/integrations/deepspeed.py:
``hidden_size**2``, ``0.9 x hidden_size**2``, ``10 x hidden_size``).
"""

from __future__ import annotations

from typing import Any, Mapping

from ..errors import VramError
from ._common import Mapper, is_auto, number, truthy


def check_stage(stage: int, where: str) -> None:
    """ZeRO has stages 0-3 (deepspeed/runtime/zero/config.py ZeroStageEnum): any other is an error."""
    if not 0 <= stage <= 3:
        raise VramError(f"{where}: ZeRO stage {stage} does not exist (DeepSpeed has stages 0, 1, 2 and 3)",
                        field=where)

#: ZeRO keys mapped to zero_config as they are (numbers of elements or switches)
_ZERO_KEYS = ("sub_group_size", "allgather_bucket_size", "stage3_param_persistence_threshold",
              "stage3_model_persistence_threshold", "stage3_max_live_parameters", "stage3_max_reuse_distance",
              "contiguous_gradients", "reduce_scatter")
#: keys the HF integration fills from the model's hidden size when "auto"
_HIDDEN_AUTO = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")
#: ZeRO keys read and left aside, with the reason
_ZERO_NO_MEMORY = {
    "round_robin_gradients": "reorders gradient partitions across ranks (CPU offload speed): no memory effect",
    "stage3_gather_16bit_weights_on_model_save": "at checkpoint saving only",
    "gather_16bit_weights_on_model_save": "at checkpoint saving only",
    "allgather_partitions": "how ZeRO-1/2 gather updated partitions back, in place: no memory effect",
    "elastic_checkpoint": "checkpoint layout only", "load_from_fp32_weights": "checkpoint loading only",
    "ignore_unused_parameters": "no memory effect", "use_multi_rank_bucket_allreduce": "no memory effect",
}
#: offload sub-keys that change only the host side
_HOST_SIDE = ("pin_memory", "nvme_path", "pipeline_read", "pipeline_write", "fast_init", "max_in_cpu")

_KEYS = ("zero_optimization", "train_micro_batch_size_per_gpu", "train_batch_size", "zero_allow_untested_optimizer",
         "gradient_clipping", "steps_per_print", "wall_clock_breakdown")


def detect(raw: Mapping[str, Any]) -> int:
    """How many DeepSpeed-only keys ``raw`` has (0: not a DeepSpeed config)."""
    return 3 * sum(k in raw for k in _KEYS) if "zero_optimization" in raw or "train_micro_batch_size_per_gpu" in raw \
        else 0


def read(raw: Mapping[str, Any], m: Mapper) -> None:
    """A DeepSpeed config file on its own."""
    apply(m, "")
    m.note("the number of GPUs is set by the launcher, not the DeepSpeed file: pass num_gpus=")


def apply_named(m: Mapper, key: str = "deepspeed") -> None:
    """A DeepSpeed config that another config names by path (or holds inline) at ``key``:
    HF TrainingArguments' ``deepspeed``, axolotl's and LLaMA-Factory's too."""
    ds = m.get(key)
    if isinstance(ds, Mapping):
        apply(m, key + ".")
    elif isinstance(ds, str) and ds:
        inner = m.sibling(ds)
        if inner is None:
            m.ignore(key, f"DeepSpeed file {ds!r} not found beside the config: pass it separately")
        else:
            apply(m, f"{key}:{ds}:", inner)


def apply(m: Mapper, prefix: str, ds: Any = None) -> None:
    """Map a DeepSpeed config found at ``prefix`` of the raw config (or given as ``ds``)."""
    def get(key: str) -> Any:
        if ds is not None:
            cur: Any = ds
            for part in key.split("."):
                if not isinstance(cur, Mapping) or part not in cur:
                    return None
                cur = cur[part]
            return cur
        return m.get(prefix + key)

    src = (prefix or "") if ds is None else prefix
    zero = get("zero_optimization")
    stage = m.whole(get("zero_optimization.stage"), src + "zero_optimization.stage") \
        if isinstance(zero, Mapping) else None
    if stage is not None:
        check_stage(stage, src + "zero_optimization.stage")
        m.par("strategy", f"zero{stage}", src + "zero_optimization.stage")
    _offload(m, get, src)
    rb = get("zero_optimization.reduce_bucket_size")
    if m.real(rb, src + "zero_optimization.reduce_bucket_size") is not None:
        # elements of 16-bit gradients -> MB (10**6 bytes), as estimate_parallel's bucket_mb
        m.par("bucket_mb", number(rb) * 2 / 1e6, src + "zero_optimization.reduce_bucket_size")
    elif is_auto(rb):
        m.par_item("zero_config", "reduce_bucket_size", "auto", src + "zero_optimization.reduce_bucket_size")
    pf = get("zero_optimization.stage3_prefetch_bucket_size")
    if m.real(pf, src + "zero_optimization.stage3_prefetch_bucket_size") is not None:
        m.par("prefetch_elements", int(number(pf)), src + "zero_optimization.stage3_prefetch_bucket_size")
    elif is_auto(pf):
        m.par_item("zero_config", "stage3_prefetch_bucket_size", "auto",
                   src + "zero_optimization.stage3_prefetch_bucket_size")
    oc = get("zero_optimization.overlap_comm")
    if oc is not None and not is_auto(oc):
        m.par("overlap_comm", truthy(oc), src + "zero_optimization.overlap_comm")
    for key in _ZERO_KEYS:
        v = get("zero_optimization." + key)
        if v is None:
            continue
        if isinstance(v, bool) or number(v) is not None or (is_auto(v) and key in _HIDDEN_AUTO):
            m.par_item("zero_config", key, v if isinstance(v, bool) or is_auto(v) else number(v),
                       src + "zero_optimization." + key)
        else:
            m.ignore(src + "zero_optimization." + key, f"{v!r} is not a number of elements")
    for key, why in _ZERO_NO_MEMORY.items():
        if get("zero_optimization." + key) is not None:
            m.ignore(src + "zero_optimization." + key, why)
    mb = get("train_micro_batch_size_per_gpu")
    mb = m.whole(mb, src + "train_micro_batch_size_per_gpu")
    if mb is not None:
        m.set("batch_size", mb, src + "train_micro_batch_size_per_gpu")
    ga = get("gradient_accumulation_steps")
    ga = m.whole(ga, src + "gradient_accumulation_steps")
    if ga is not None:
        m.set("grad_accum_steps", ga, src + "gradient_accumulation_steps")
    bf16 = get("bf16.enabled")
    fp16 = get("fp16.enabled")
    if truthy(bf16) and truthy(fp16) and not is_auto(bf16) and not is_auto(fp16):
        # deepspeed/runtime/config.py: "bfloat16 and fp16 modes cannot be simultaneously enabled"
        raise VramError(f"{src}bf16.enabled: bf16 and fp16 are both enabled; DeepSpeed refuses it (one of them)",
                        field=f"{src}bf16.enabled")
    ta = get("torch_autocast.enabled")
    if ta is not None and not is_auto(ta) and truthy(ta):
        # fp32 parameters, torch.autocast in the engine's forward (deepspeed/runtime/torch_autocast.py)
        dt = str(get("torch_autocast.dtype") or "bfloat16")
        m.set("precision", "amp_fp16" if "16" in dt and "b" not in dt else "amp_bf16", src + "torch_autocast.enabled")
    elif bf16 is not None and not is_auto(bf16) and truthy(bf16):
        # DeepSpeed keeps bf16 weights and steps an fp32 master copy (parallel/estimate.py models the master)
        m.set("precision", "bf16", src + "bf16.enabled")
    elif fp16 is not None and not is_auto(fp16) and truthy(fp16):
        m.set("precision", "fp16", src + "fp16.enabled")
    opt = get("optimizer.type")
    if isinstance(opt, str):
        if opt.lower() in ("adam", "adamw"):
            # DeepSpeed builds FusedAdam (deepspeed/ops/adam/fused_adam.py, multi-tensor, no
            # parameter-sized temporary) or DeepSpeedCPUAdam when offloading
            m.set("optimizer", "adamw_fused", src + "optimizer.type")
        elif opt.lower() == "lion":
            m.set("optimizer", "lion", src + "optimizer.type")
        else:
            m.ignore(src + "optimizer.type", f"DeepSpeed optimizer {opt!r} is not modelled")
    if get("optimizer.params") is not None:
        pass  # learning rates and betas: no effect on memory
    ac = get("activation_checkpointing")
    if isinstance(ac, Mapping) and ac:
        m.ignore(src + "activation_checkpointing",
                 "DeepSpeed's own checkpointing applies to Megatron-style models; set gradient_checkpointing")


def _offload(m: Mapper, get: Any, src: str) -> None:
    """``offload_optimizer`` / ``offload_param``: the device (CPU or NVMe), ZeRO-3's partial
    ``ratio``, the NVMe swap buffers; pinning and paths change only the host side."""
    base = src + "zero_optimization."
    for key, flat in (("offload_optimizer", "offload_optimizer"), ("offload_param", "offload_params")):
        dev = get(f"zero_optimization.{key}.device")
        if not isinstance(dev, str) or dev.lower() not in ("cpu", "nvme"):
            continue
        m.par(flat, True, base + key + ".device")
        if dev.lower() == "nvme":
            m.par_item("zero_config", key, {"device": "nvme"}, base + key + ".device")
        for sub in ("ratio", "buffer_count", "buffer_size"):
            v = get(f"zero_optimization.{key}.{sub}")
            if v is None:
                continue
            if number(v) is None or (sub == "ratio" and key != "offload_optimizer") or \
                    (sub == "buffer_size" and key != "offload_param"):
                m.ignore(base + f"{key}.{sub}", f"{v!r}: not modelled here")
                continue
            m.cfg.parallel.setdefault("zero_config", {}).setdefault(key, {"device": dev.lower()})[sub] = number(v)
            m.cfg.mapped.append((base + f"{key}.{sub}", f"zero_config[{key!r}][{sub!r}]", number(v)))
        for sub in _HOST_SIDE:
            if get(f"zero_optimization.{key}.{sub}") is not None:
                m.ignore(base + f"{key}.{sub}", "host memory only: the GPU holds the same")


def apply_named(m: Mapper, key: str = "deepspeed") -> None:
    """A DeepSpeed config that a training config names by path (or holds inline) at
    ``key`` (here, beside :func:`apply`, so _common and this module do not import each other)."""
    ds = m.get(key)
    if isinstance(ds, Mapping):
        apply(m, key + ".")
    elif isinstance(ds, str) and ds:
        inner = m.sibling(ds)
        if inner is None:
            m.ignore(key, f"DeepSpeed file {ds!r} not found beside the config: pass it separately")
        else:
            apply(m, f"{key}:{ds}:", inner)
