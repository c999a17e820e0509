"""LitGPT finetune YAML (config_hub/finetune/*/*.yaml, litgpt/finetune/lora.py & full.py).

``checkpoint_dir`` names the model (``checkpoints/<org>/<name>``), ``precision``
("bf16-true", "bf16-mixed", "32-true", "16-mixed", "16-true"), ``quantize`` ("bnb.nf4",
"bnb.nf4-dq", "bnb.fp4", "bnb.fp4-dq", "bnb.int8-training"), ``devices``, the LoRA switches
``lora_query``/``lora_key``/``lora_value``/``lora_projection``/``lora_mlp``/``lora_head``,
and ``train.micro_batch_size`` / ``global_batch_size`` / ``max_seq_length``.  With more than
one device LitGPT's finetune scripts use FSDP with activation checkpointing of every Block
(litgpt/finetune/lora.py ``FSDPStrategy(... activation_checkpointing_policy={Block})``).
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from ._common import LORA_NUMBERS, Mapper, truthy

_PRECISION = {"bf16-true": "bf16", "bf16-mixed": "amp_bf16", "32-true": "fp32", "16-mixed": "amp_fp16",
              "16-true": "fp16", "transformer-engine": "fp8"}


def detect(raw: Mapping[str, Any]) -> int:
    """LitGPT: checkpoint_dir + precision / lora_query / train."""
    keys = ("checkpoint_dir", "precision", "quantize", "devices", "lora_query", "lora_value", "train", "out_dir")
    return 2 * sum(k in raw for k in keys) if "checkpoint_dir" in raw else 0


def read(raw: Mapping[str, Any], m: Mapper) -> None:
    """A LitGPT finetune config."""
    ck = m.get("checkpoint_dir")
    if isinstance(ck, str) and ck:
        m.model(re.sub(r"^(\./)?checkpoints/", "", ck.rstrip("/")), "checkpoint_dir")
    m.set("stack", "litgpt", "checkpoint_dir")
    lora = any(m.has(k) for k in ("lora_r", "lora_query", "lora_value"))
    q = m.get("quantize")
    if lora:
        m.set("method", "lora", "lora_r")
        m.numbers(LORA_NUMBERS)
        # litgpt/lora.py defaults: query and value on, the rest off
        switches = (("lora_query", ["q_proj"], True), ("lora_key", ["k_proj"], False),
                    ("lora_value", ["v_proj"], True), ("lora_projection", ["o_proj"], False),
                    ("lora_mlp", ["gate_proj", "up_proj", "down_proj"], False), ("lora_head", ["lm_head"], False))
        targets = []
        for key, names, default in switches:
            v = m.get(key)
            if truthy(default if v is None else v):
                targets += names
        if targets:
            m.set("lora_targets", tuple(targets), "lora_query")
    else:
        m.set("method", "full", "checkpoint_dir")
    if isinstance(q, str) and q:
        kind = q.replace("bnb.", "")
        if kind in ("nf4", "nf4-dq", "fp4", "fp4-dq"):
            m.set("quantization", kind.split("-")[0], "quantize")
            m.set("double_quant", kind.endswith("-dq"), "quantize")
        elif kind == "int8-training":
            m.set("quantization", "int8", "quantize")
        else:
            m.ignore("quantize", f"quantize {q!r} is not modelled")
        if lora and m.cfg.setup.get("quantization", "none") != "none":
            m.set("method", "qlora", "quantize")
    p = m.get("precision")
    if isinstance(p, str):
        if p in _PRECISION:
            m.set("precision", _PRECISION[p], "precision")
        else:
            m.ignore("precision", f"precision {p!r} is not modelled")
    mb = m.whole(m.get("train.micro_batch_size"), "train.micro_batch_size")
    if mb is not None:
        m.set("batch_size", mb, "train.micro_batch_size")
    devices = m.whole(m.get("devices"), "devices") or 1
    nodes = m.whole(m.get("num_nodes"), "num_nodes") or 1
    gb = m.whole(m.get("train.global_batch_size"), "train.global_batch_size")
    if gb is not None and mb:
        ga = max(1, gb // (mb * devices * nodes))
        m.set("grad_accum_steps", ga, "train.global_batch_size")
    sl = m.whole(m.get("train.max_seq_length"), "train.max_seq_length")
    if sl is not None:
        m.set("seq_len", sl, "train.max_seq_length")
    if devices * nodes > 1:
        m.par("strategy", "fsdp_full_shard", "devices")
        m.par("num_gpus", devices * nodes, "devices")
        m.set("gradient_checkpointing", "full", "devices")
    opt = m.get("optimizer")
    name = opt if isinstance(opt, str) else (opt.get("class_path") if isinstance(opt, Mapping) else None)
    if isinstance(name, str):
        short = name.split(".")[-1].lower()
        if short in ("adamw", "adam"):
            m.set("optimizer", "adamw", "optimizer")
        elif short == "sgd":
            m.set("optimizer", "sgd", "optimizer")
        else:
            m.ignore("optimizer", f"optimizer {name!r} is not modelled")
