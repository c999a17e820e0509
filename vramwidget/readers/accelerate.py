"""accelerate's launcher YAML (``accelerate config``): FSDP or DeepSpeed, process count,
mixed precision.

Keys are accelerate's (accelerate/commands/config/cluster.py writes them; FSDP's
``fsdp_sharding_strategy`` is FULL_SHARD / SHARD_GRAD_OP / HYBRID_SHARD / NO_SHARD or their
numbers 1-4, accelerate/utils/constants.py ``FSDP_SHARDING_STRATEGY``).
"""

from __future__ import annotations

from typing import Any, Mapping

from ._common import Mapper, truthy
from .deepspeed import check_stage

FSDP_STRATEGIES = {"FULL_SHARD": "fsdp_full_shard", "1": "fsdp_full_shard", "SHARD_GRAD_OP": "fsdp_shard_grad_op",
                    "2": "fsdp_shard_grad_op", "HYBRID_SHARD": "fsdp_hybrid", "4": "fsdp_hybrid",
                    "NO_SHARD": "ddp", "3": "ddp", "HYBRID_SHARD_ZERO2": "fsdp_hybrid", "5": "fsdp_hybrid"}


def detect(raw: Mapping[str, Any]) -> int:
    """accelerate configs have distributed_type and compute_environment."""
    return 5 * ("distributed_type" in raw) + 2 * ("compute_environment" in raw) + ("num_processes" in raw)


def _fsdp(fs: Any, m: Mapper) -> None:
    """``fsdp_config``.  accelerate >= 1.6 (utils/dataclasses.py ``FullyShardedDataParallelPlugin``)
    takes ``fsdp_version`` 1 or 2 and ``fsdp_reshard_after_forward``: a bool under FSDP2, a
    sharding strategy name under FSDP1 (``fsdp_sharding_strategy`` deprecated in its favour)."""
    fs = fs if isinstance(fs, Mapping) else {}
    version = m.whole(fs.get("fsdp_version"), "fsdp_config.fsdp_version") or 1
    if version == 2:
        m.par("fsdp_version", 2, "fsdp_config.fsdp_version")
    reshard = fs.get("fsdp_reshard_after_forward")
    if version == 2:
        # FSDP2 has no sharding strategy: reshard_after_forward=False is ZeRO-2-like
        keep = reshard is not None and not truthy(reshard)
        m.par("strategy", "fsdp_shard_grad_op" if keep else "fsdp_full_shard",
              "fsdp_config.fsdp_reshard_after_forward")
        if reshard is not None:
            m.par("reshard_after_forward", not keep, "fsdp_config.fsdp_reshard_after_forward")
    else:
        src = "fsdp_sharding_strategy" if "fsdp_sharding_strategy" in fs or reshard is None \
            else "fsdp_reshard_after_forward"
        strat = fs.get(src, "FULL_SHARD")
        key = str(strat).upper()
        m.par("strategy", FSDP_STRATEGIES.get(key, "fsdp_full_shard"), f"fsdp_config.{src}")
        if key not in FSDP_STRATEGIES:
            m.note(f"unknown {src} {strat!r}: full sharding assumed")
    if truthy(fs.get("fsdp_offload_params", False)):
        m.par("offload_params", True, "fsdp_config.fsdp_offload_params")
    if truthy(fs.get("fsdp_activation_checkpointing", False)):
        m.set("gradient_checkpointing", "full", "fsdp_config.fsdp_activation_checkpointing")
    used = ("fsdp_sharding_strategy", "fsdp_offload_params", "fsdp_activation_checkpointing",
            "fsdp_version", "fsdp_reshard_after_forward")
    for k in fs:
        if k not in used:
            m.ignore(f"fsdp_config.{k}", "no effect on the per-GPU memory vramwidget models")


def read(raw: Mapping[str, Any], m: Mapper) -> None:
    """An accelerate config YAML."""
    dist = str(m.get("distributed_type", "")).upper()
    n_proc = m.whole(m.get("num_processes"), "num_processes")
    n_mach = m.whole(m.get("num_machines"), "num_machines") or 1
    if n_proc:
        # accelerate's num_processes is the total over all machines
        m.par("num_gpus", n_proc, "num_processes")
        if n_mach > 1:
            m.par("gpus_per_node", max(1, n_proc // n_mach), "num_machines")
    mp = str(m.get("mixed_precision", "no")).lower()
    if mp == "bf16":
        # accelerate's mixed precision is autocast around fp32 parameters (FSDP: MixedPrecision)
        m.set("precision", "amp_bf16", "mixed_precision")
    elif mp == "fp16":
        m.set("precision", "amp_fp16", "mixed_precision")
    elif mp == "fp8":
        m.set("precision", "fp8", "mixed_precision")
    elif mp == "no":
        m.note("mixed_precision 'no': the model's own dtype decides the precision (set precision=)")
    if dist == "FSDP":
        _fsdp(m.get("fsdp_config") or {}, m)
    elif dist == "DEEPSPEED":
        ds = m.get("deepspeed_config") or {}
        if isinstance(ds, Mapping):
            stage = m.whole(ds.get("zero_stage"), "deepspeed_config.zero_stage")
            if stage is not None:
                check_stage(stage, "deepspeed_config.zero_stage")
                m.par("strategy", f"zero{stage}", "deepspeed_config.zero_stage")
            if str(ds.get("offload_optimizer_device", "none")).lower() in ("cpu", "nvme"):
                m.par("offload_optimizer", True, "deepspeed_config.offload_optimizer_device")
            if str(ds.get("offload_param_device", "none")).lower() in ("cpu", "nvme"):
                m.par("offload_params", True, "deepspeed_config.offload_param_device")
            if ds.get("deepspeed_config_file"):
                from . import deepspeed

                inner = m.sibling(ds["deepspeed_config_file"])
                if inner is not None:
                    deepspeed.apply(m, "deepspeed_config.deepspeed_config_file:", inner)
                else:
                    m.ignore("deepspeed_config.deepspeed_config_file", "file not found beside the config")
            for k in ds:
                if k not in ("zero_stage", "offload_optimizer_device", "offload_param_device", "deepspeed_config_file"):
                    m.ignore(f"deepspeed_config.{k}", "no effect on memory")
    elif dist in ("MULTI_GPU", "NO"):
        if (n_proc or 1) > 1:
            m.par("strategy", "ddp", "distributed_type")
    elif dist:
        m.ignore("distributed_type", f"{dist} is not modelled")
