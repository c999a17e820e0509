"""DeepSpeed JSON (``ds_config.json``): ZeRO stage, offload, bucket sizes, precision, batch.

Keys and defaults are DeepSpeed's (deepspeed/runtime/zero/config.py ``DeepSpeedZeroConfig``:
``reduce_bucket_size`` 5e8, ``stage3_prefetch_bucket_size`` 5e7, ``overlap_comm`` on for
stage 3; deepspeed/runtime/config.py for ``train_micro_batch_size_per_gpu``, ``bf16``,
``fp16``).  "auto" values are filled in by the HF/accelerate integration at launch from the
Trainer's own arguments, so they are read from there, not here.
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
    off_opt = get("zero_optimization.offload_optimizer.device")
    if isinstance(off_opt, str) and off_opt.lower() in ("cpu", "nvme"):
        m.par("offload_optimizer", True, src + "zero_optimization.offload_optimizer.device")
        if off_opt.lower() == "nvme":
            m.note("optimizer offload to NVMe is counted like offload to the CPU (off the GPU either way)")
    off_par = get("zero_optimization.offload_param.device")
    if isinstance(off_par, str) and off_par.lower() in ("cpu", "nvme"):
        m.par("offload_params", True, src + "zero_optimization.offload_param.device")
    rb = get("zero_optimization.reduce_bucket_size")
    if m.real(rb, src + "zero_optimization.reduce_bucket_size") is not None:
        # elements of 16-bit gradients -> MB (10**6 bytes), as estimate_parallel's bucket_mb
        m.par("bucket_mb", number(rb) * 2 / 1e6, src + "zero_optimization.reduce_bucket_size")
    elif is_auto(rb):
        m.ignore(src + "zero_optimization.reduce_bucket_size",
                 "'auto': the HF integration sets hidden_size**2; vramwidget's default for the stage is used")
    pf = get("zero_optimization.stage3_prefetch_bucket_size")
    if m.real(pf, src + "zero_optimization.stage3_prefetch_bucket_size") is not None:
        m.par("prefetch_elements", int(number(pf)), src + "zero_optimization.stage3_prefetch_bucket_size")
    elif is_auto(pf):
        m.ignore(src + "zero_optimization.stage3_prefetch_bucket_size",
                 "'auto': the HF integration sets 0.9 x hidden_size**2; vramwidget's default is used")
    oc = get("zero_optimization.overlap_comm")
    if oc is not None and not is_auto(oc):
        m.par("overlap_comm", truthy(oc), src + "zero_optimization.overlap_comm")
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
    if bf16 is not None and not is_auto(bf16) and truthy(bf16):
        # DeepSpeed keeps bf16 weights and steps an fp32 master copy (parallel.py models the master)
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
