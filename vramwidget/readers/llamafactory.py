"""LLaMA-Factory YAML.

Field names from LLaMA-Factory's argument dataclasses (src/llamafactory/hparams/
model_args.py, finetuning_args.py, data_args.py; training arguments are HF's):
``model_name_or_path``, ``finetuning_type`` (lora/freeze/full), ``lora_target`` ("all" or
names), ``lora_rank``, ``lora_alpha`` (default rank x 2), ``lora_dropout``, ``use_dora``,
``additional_target`` (modules_to_save), ``freeze_trainable_layers``, ``quantization_bit``,
``cutoff_len``, ``packing``/``neat_packing``, ``flash_attn``, ``enable_liger_kernel``,
``use_unsloth``, ``pure_bf16``, ``deepspeed``.  Precision follows
src/llamafactory/model/adapter.py: trainable parameters are upcast to float32 unless
``pure_bf16`` (so a full fine-tune with ``bf16`` is autocast over fp32 weights).
"""

from __future__ import annotations

from typing import Any, Mapping

from . import deepspeed
from ._common import Mapper, integer, lora_targets, truthy
from .hf import HF_BATCH, apply_optim

_MARKERS = ("model_name_or_path", "finetuning_type", "lora_target", "cutoff_len", "template", "stage",
            "quantization_bit")


def detect(raw: Mapping[str, Any]) -> int:
    """LLaMA-Factory: finetuning_type / cutoff_len / lora_target beside model_name_or_path."""
    return 2 * sum(k in raw for k in _MARKERS) if "finetuning_type" in raw or "cutoff_len" in raw else 0


def read(raw: Mapping[str, Any], m: Mapper) -> None:
    """A LLaMA-Factory training YAML."""
    model = m.get("model_name_or_path")
    if isinstance(model, str) and model:
        m.model(model, "model_name_or_path")
    m.numbers({**HF_BATCH, "cutoff_len": ("seq_len", integer)})
    ft = str(m.get("finetuning_type", "lora")).lower()
    qbit = m.whole(m.get("quantization_bit"), "quantization_bit")
    qmethod = str(m.get("quantization_method", "bitsandbytes")).lower()
    if ft == "lora":
        m.set("method", "lora", "finetuning_type")
        r = m.whole(m.get("lora_rank"), "lora_rank")
        r = r if r is not None else 8  # LLaMA-Factory's default lora_rank
        m.set("lora_r", r, "lora_rank")
        alpha = m.real(m.get("lora_alpha"), "lora_alpha")
        m.set("lora_alpha", alpha if alpha is not None else 2.0 * r, "lora_alpha")
        d = m.real(m.get("lora_dropout"), "lora_dropout")
        if d is not None:
            m.set("lora_dropout", d, "lora_dropout")
        t = lora_targets(m.get("lora_target", "all"))
        if t:
            m.set("lora_targets", t, "lora_target")
        if truthy(m.get("use_dora", False)):
            m.set("lora_variant", "dora", "use_dora")
        extra = m.get("additional_target")
        if extra:
            items = [x.strip() for x in extra.split(",")] if isinstance(extra, str) else list(extra)
            m.set("modules_to_save", tuple(items), "additional_target")
    elif ft == "freeze":
        m.set("method", "freeze", "finetuning_type")
        n = m.whole(m.get("freeze_trainable_layers"), "freeze_trainable_layers")
        m.set("trainable_layers", abs(n) if n is not None else 2, "freeze_trainable_layers")  # default 2
    elif ft == "full":
        m.set("method", "full", "finetuning_type")
    else:
        m.ignore("finetuning_type", f"finetuning_type {ft!r} is not modelled")
    if qbit is not None:
        if qmethod != "bitsandbytes":
            m.ignore("quantization_method", f"{qmethod} quantization is not modelled (bitsandbytes is)")
        elif qbit == 4:
            # src/llamafactory/model/model_utils/quantization.py: nf4 with double quantization (defaults)
            qt = str(m.get("quantization_type", "nf4")).lower()
            m.set("quantization", "nf4" if qt == "nf4" else "fp4", "quantization_bit")
            m.set("double_quant", truthy(m.get("double_quantization", True)), "double_quantization")
        elif qbit == 8:
            m.set("quantization", "int8", "quantization_bit")
        else:
            m.ignore("quantization_bit", f"{qbit}-bit bitsandbytes is not modelled (4 and 8 are)")
        if m.cfg.setup.get("method") == "lora" and m.cfg.setup.get("quantization", "none") != "none":
            m.set("method", "qlora", "quantization_bit")
    pure = truthy(m.get("pure_bf16", False))
    if truthy(m.get("bf16", False)) or pure:
        full_upcast = ft in ("full", "freeze") and not pure
        m.set("precision", "amp_bf16" if full_upcast else "bf16", "pure_bf16" if pure else "bf16")
        if full_upcast:
            m.note("LLaMA-Factory upcasts trainable parameters to float32 unless pure_bf16: autocast over fp32 "
                   "weights (src/llamafactory/model/adapter.py)")
    elif truthy(m.get("fp16", False)):
        m.set("precision", "amp_fp16", "fp16")
    fa = m.get("flash_attn")
    if isinstance(fa, str):
        fa_map = {"fa2": "flash_attention_2", "sdpa": "sdpa", "disabled": "eager", "auto": "sdpa"}
        if fa.lower() in fa_map:
            m.set("attn_implementation", fa_map[fa.lower()], "flash_attn")
    if not truthy(m.get("disable_gradient_checkpointing", False)):
        # LLaMA-Factory turns gradient checkpointing on unless told not to
        # (src/llamafactory/model/model_utils/checkpointing.py)
        m.set("gradient_checkpointing", "full", "disable_gradient_checkpointing")
    if truthy(m.get("packing", False)) or truthy(m.get("neat_packing", False)):
        m.set("packing", True, "neat_packing" if truthy(raw.get("neat_packing")) else "packing")
    if truthy(m.get("enable_liger_kernel", False)):
        m.set("loss", "liger", "enable_liger_kernel")
    if truthy(m.get("use_unsloth", False)):
        m.set("stack", "unsloth", "use_unsloth")
    apply_optim(m, m.get("optim"), "optim", m.get("optim_args"))
    if truthy(m.get("use_galore", False)):
        m.set("optimizer", "galore_adamw", "use_galore")
        gr = m.whole(m.get("galore_rank"), "galore_rank")
        if gr is not None:
            m.set("galore_rank", gr, "galore_rank")
    if m.get("deepspeed"):
        deepspeed.apply_named(m, "deepspeed")
        m.note("the number of GPUs is set by the launcher (llamafactory-cli/torchrun): pass num_gpus=")
