"""torchtune recipe YAML.

Keys are those of torchtune's recipes (recipes/full_finetune_single_device.py,
lora_finetune_single_device.py, *_distributed.py) and configs (recipes/configs/):
``model._component_`` (a builder such as ``torchtune.models.llama3_2.lora_llama3_2_3b``),
its ``lora_attn_modules`` / ``apply_lora_to_mlp`` / ``apply_lora_to_output`` / ``lora_rank``
/ ``lora_alpha``, ``batch_size``, ``gradient_accumulation_steps``, ``dtype``,
``enable_activation_checkpointing``, ``enable_activation_offloading``, ``optimizer_in_bwd``,
``compile``, ``loss._component_`` (``CEWithChunkedOutputLoss``: 8 output chunks,
torchtune/modules/loss/ce_chunked_output_loss.py), ``dataset.packed``,
``tokenizer.max_seq_len``, and for distributed recipes ``fsdp_cpu_offload`` /
``fsdp_reshard_after_forward``.  The QLoRA builders store the base as torchao NF4 (blocks of
64 with quantized scalers: NF4 with double quantization).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Mapping

from ._common import Mapper, integer, number, truthy

_TABLE = None


def _builders() -> Mapping[str, str]:
    global _TABLE
    if _TABLE is None:
        path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "torchtune_models.json")
        with open(path, encoding="utf-8") as f:
            _TABLE = json.load(f)["builders"]
    return _TABLE


def detect(raw: Mapping[str, Any]) -> int:
    """torchtune: ``_component_`` entries and its recipe keys."""
    comp = isinstance(raw.get("model"), Mapping) and "_component_" in raw["model"]
    keys = ("enable_activation_checkpointing", "enable_activation_offloading", "optimizer_in_bwd", "checkpointer",
            "dtype", "batch_size")
    return (6 if comp else 0) + sum(k in raw for k in keys) if comp or "checkpointer" in raw else 0


def _model(m: Mapper, builder: str) -> None:
    from ..model.presets import find, list_presets, get

    ckpt = m.get("checkpointer.checkpoint_dir")
    if isinstance(ckpt, str) and ckpt:
        cfg = os.path.join(ckpt, "config.json")
        if os.path.isfile(cfg):
            m.model(cfg, "checkpointer.checkpoint_dir")
            return
        tail = os.path.basename(os.path.normpath(ckpt)).lower()
        for name in list_presets():
            rec = get(name)
            ids = [rec.get("hub_id") or ""] + list(rec.get("aliases") or [])
            if any(i and i.split("/")[-1].lower() == tail for i in ids):
                m.model(name, "checkpointer.checkpoint_dir")
                return
    base = re.sub(r"^(q?lora_)", "", builder)
    preset = _builders().get(base)
    if preset and find(preset):
        m.model(preset, "model._component_")
    else:
        m.note(f"model: torchtune builder {builder!r} is not in vramwidget's table: give the model")


def read(raw: Mapping[str, Any], m: Mapper) -> None:
    """A torchtune recipe config."""
    comp = str(m.get("model._component_", ""))
    builder = comp.split(".")[-1]
    _model(m, builder)
    m.set("stack", "torchtune", "model._component_")
    if builder.startswith("qlora_"):
        m.set("method", "qlora", "model._component_")
        m.set("quantization", "nf4", "model._component_")
        m.set("double_quant", True, "model._component_")
    elif builder.startswith("lora_"):
        m.set("method", "lora", "model._component_")
    else:
        m.set("method", "full", "model._component_")
    if builder.startswith(("lora_", "qlora_")):
        targets = [{"output_proj": "o_proj"}.get(x, x) for x in (m.get("model.lora_attn_modules") or [])]
        if truthy(m.get("model.apply_lora_to_mlp", False)):
            targets += ["gate_proj", "up_proj", "down_proj"]
        if truthy(m.get("model.apply_lora_to_output", False)):
            targets += ["lm_head"]
        if targets:
            m.set("lora_targets", tuple(targets), "model.lora_attn_modules")
        m.numbers({"lora_rank": ("lora_r", integer), "lora_alpha": ("lora_alpha", number),
                   "lora_dropout": ("lora_dropout", number)}, "model.")
        if truthy(m.get("model.use_dora", False)):
            m.set("lora_variant", "dora", "model.use_dora")
    m.get("model.quantize_base")
    m.numbers({"batch_size": ("batch_size", integer), "gradient_accumulation_steps": ("grad_accum_steps", integer)})
    sl = m.whole(m.get("tokenizer.max_seq_len"), "tokenizer.max_seq_len")
    if sl is not None:
        m.set("seq_len", sl, "tokenizer.max_seq_len")
    else:
        m.note("tokenizer.max_seq_len is null: torchtune pads each batch to its longest sample; give seq_len")
    dt = str(m.get("dtype", "bf16")).lower()
    m.set("precision", {"bf16": "bf16", "fp32": "fp32", "fp16": "fp16"}.get(dt, dt), "dtype")
    if truthy(m.get("enable_activation_checkpointing", False)):
        m.set("gradient_checkpointing", "full", "enable_activation_checkpointing")
    if truthy(m.get("enable_activation_offloading", False)):
        m.set("activation_offloading", True, "enable_activation_offloading")
    if truthy(m.get("optimizer_in_bwd", False)):
        m.set("optimizer_in_backward", True, "optimizer_in_bwd")
    if truthy(m.get("compile", False)):
        m.set("compile", True, "compile")
    if truthy(m.get("dataset.packed", False)):
        m.set("packing", True, "dataset.packed")
    loss = str(m.get("loss._component_", ""))
    if loss.endswith(("CEWithChunkedOutputLoss", "LinearCrossEntropyLoss")):
        m.set("loss", "chunked", "loss._component_")
        chunks = m.whole(m.get("loss.num_output_chunks"), "loss.num_output_chunks")
        m.set("loss_chunks", chunks or 8, "loss._component_")
    opt = str(m.get("optimizer._component_", ""))
    fused = truthy(m.get("optimizer.fused", False))
    opt_map = {"torch.optim.AdamW": "adamw_fused" if fused else "adamw",
               "torch.optim.Adam": "adamw_fused" if fused else "adamw",
               "bitsandbytes.optim.PagedAdamW8bit": "paged_adamw_8bit", "bitsandbytes.optim.AdamW8bit": "adamw_8bit",
               "bitsandbytes.optim.PagedAdamW": "paged_adamw", "torchao.optim.AdamW8bit": "adamw_8bit",
               "torchao.prototype.low_bit_optim.AdamW8bit": "adamw_8bit", "torch.optim.SGD": "sgd"}
    if opt in opt_map:
        m.set("optimizer", opt_map[opt], "optimizer._component_")
        if opt == "torch.optim.SGD" and (m.real(m.get("optimizer.momentum"), "optimizer.momentum") or 0) > 0:
            m.set("optimizer", "sgd_momentum", "optimizer.momentum")
    elif opt:
        m.ignore("optimizer._component_", f"optimizer {opt!r} is not modelled")
    if m.has("fsdp_cpu_offload") or m.has("fsdp_reshard_after_forward"):
        reshard = m.get("fsdp_reshard_after_forward")
        m.par("strategy", "fsdp_shard_grad_op" if reshard is False else "fsdp_full_shard", "fsdp_reshard_after_forward")
        # the distributed recipes shard with FSDP2 (torchtune/training/_distributed.py
        # shard_model: fully_shard per layer and the root, reshard_after_forward passed through)
        m.par("fsdp_version", 2, "fsdp_reshard_after_forward" if m.has("fsdp_reshard_after_forward")
              else "fsdp_cpu_offload")
        if reshard is not None:
            m.par("reshard_after_forward", bool(truthy(reshard)), "fsdp_reshard_after_forward")
        if truthy(m.get("fsdp_cpu_offload", False)):
            m.par("offload_params", True, "fsdp_cpu_offload")
        m.note("the number of GPUs is tune run's --nproc_per_node, not in the YAML: pass num_gpus=")
