"""HF ``TrainingArguments`` / TRL ``SFTConfig`` JSON, as ``to_json_string()`` writes it, with
the PEFT ``LoraConfig`` and the ``BitsAndBytesConfig`` beside it.

"Beside it" means any of: keys ``peft_config`` / ``lora_config`` and ``quantization_config``
/ ``bnb_config`` in the same JSON (what people paste), or an ``adapter_config.json`` (PEFT's
saved LoraConfig) in the same folder.  Field names are transformers'
(transformers/training_args.py), TRL's (trl/trainer/sft_config.py: ``max_length``, older
``max_seq_length``, ``packing``, ``padding_free``, ``model_init_kwargs``, ``use_liger_kernel``)
and PEFT's (peft/tuners/lora/config.py: ``r``, ``lora_alpha``, ``target_modules``,
``use_dora``, ``modules_to_save``).
"""

from __future__ import annotations

from typing import Any, Mapping

from . import deepspeed
from ..errors import VramError
from ._common import HF_OPTIMIZERS, Mapper, dtype_name, integer, lora_targets, number, truthy

_MARKERS = ("per_device_train_batch_size", "gradient_accumulation_steps", "optim", "output_dir", "logging_steps",
            "save_strategy", "eval_strategy", "evaluation_strategy", "lr_scheduler_type", "report_to")
_PEFT_KEYS = ("peft_config", "lora_config", "adapter_config")
#: the Trainer's batch fields (LLaMA-Factory's YAML uses them too)
HF_BATCH = {"per_device_train_batch_size": ("batch_size", integer),
            "gradient_accumulation_steps": ("grad_accum_steps", integer)}
_BNB_KEYS = ("quantization_config", "bnb_config", "bitsandbytes_config")


def detect(raw: Mapping[str, Any]) -> int:
    """TrainingArguments JSON: many of its well-known keys; a lone PEFT/bnb config too."""
    n = sum(k in raw for k in _MARKERS)
    if raw.get("peft_type") == "LORA" or "load_in_4bit" in raw and "quant_method" in raw:
        n += 3
    # LLaMA-Factory YAMLs share the Trainer's names but say finetuning_type / model_name_or_path
    if "finetuning_type" in raw or "cutoff_len" in raw:
        n -= 5
    return n


def read(raw: Mapping[str, Any], m: Mapper) -> None:
    """A TrainingArguments / SFTConfig JSON (or a lone LoraConfig / BitsAndBytesConfig)."""
    if raw.get("peft_type") is not None:
        apply_peft(m, raw, "")
        return
    if "load_in_4bit" in raw or "load_in_8bit" in raw:
        apply_bnb(m, raw, "")
        return
    model = m.get("model_name_or_path")
    if isinstance(model, str) and model:
        m.model(model, "model_name_or_path")
    m.numbers(HF_BATCH)
    for key in ("max_length", "max_seq_length"):
        sl = m.whole(m.get(key), key)
        if sl is not None:
            m.set("seq_len", sl, key)
            break
    gc, ac = m.get("gradient_checkpointing", False), m.get("activation_checkpointing", False)
    if truthy(gc) or truthy(ac):
        m.set("gradient_checkpointing", "full", "gradient_checkpointing" if truthy(gc) else "activation_checkpointing")
    apply_optim(m, m.get("optim"), "optim", m.get("optim_args"))
    m.get("optim_target_modules")
    apply_precision(m, bf16=m.get("bf16"), fp16=m.get("fp16"),
                    dtype=_model_dtype(m), src_bf16="bf16", src_fp16="fp16")
    if m.get("tf32") is not None:
        m.set("tf32", truthy(raw["tf32"]), "tf32")
    # TRL's SFTConfig.model_init_kwargs are the from_pretrained keywords of the model it loads
    # (trl/trainer/sft_trainer.py create_model_from_path): attn_implementation among them
    for key in ("model_init_kwargs.attn_implementation", "attn_implementation"):
        attn = m.get(key)
        if isinstance(attn, str) and attn:
            m.set("attn_implementation", attn, key)
            break
    if truthy(m.get("torch_compile", False)):
        m.set("compile", True, "torch_compile")
    if truthy(m.get("use_liger_kernel", False)) or truthy(m.get("use_liger", False)):
        # transformers' Trainer applies Liger's patches, which swap the causal-LM loss for the
        # fused linear cross-entropy (liger_kernel/transformers/monkey_patch.py)
        m.set("loss", "liger", "use_liger_kernel")
    if truthy(m.get("packing", False)):
        m.set("packing", True, "packing")
    if truthy(m.get("padding_free", False)):
        m.set("packing", True, "padding_free")
    _apply_fsdp(m)
    deepspeed.apply_named(m, "deepspeed")
    for key in _PEFT_KEYS:
        if isinstance(raw.get(key), Mapping):
            m.get(key)
            apply_peft(m, raw[key], key + ".")
    if not any(isinstance(raw.get(k), Mapping) for k in _PEFT_KEYS):
        side = m.sibling("adapter_config.json")
        if side is not None:
            apply_peft(m, side, "adapter_config.json:")
    for key in _BNB_KEYS:
        if isinstance(raw.get(key), Mapping):
            m.get(key)
            apply_bnb(m, raw[key], key + ".")
            break
    else:
        for fn in ("quantization_config.json", "bnb_config.json"):
            side = m.sibling(fn)
            if side is not None:
                apply_bnb(m, side, fn + ":")
                break


def _model_dtype(m: Mapper) -> Any:
    for key in ("model_init_kwargs.torch_dtype", "model_init_kwargs.dtype", "torch_dtype", "dtype"):
        v = m.get(key)
        if v is not None:
            return dtype_name(v)
    return None


def apply_precision(m: Mapper, *, bf16: Any, fp16: Any, dtype: Any, src_bf16: str, src_fp16: str) -> None:
    """Trainer semantics: ``bf16``/``fp16`` turn on autocast; the weights' dtype is the model's.

    transformers 5 loads a checkpoint in its own dtype (``dtype="auto"``; bf16 for current
    LLMs), so ``bf16=True`` with no dtype given is pure bf16 weights under bf16 autocast:
    ``precision="bf16"``.  A model loaded in float32 with ``bf16=True`` is autocast mixed
    precision (``amp_bf16``).  ``fp16=True`` needs fp32 weights (the Trainer's GradScaler
    refuses fp16 gradients): ``amp_fp16``.
    """
    if truthy(bf16) and truthy(fp16):
        # transformers/training_args.py __post_init__: "At most one of fp16 and bf16 can be True, but not both"
        raise VramError(f"{src_bf16}: {src_bf16} and {src_fp16} are both true; transformers' TrainingArguments "
                        f"refuses it (at most one of fp16 and bf16)", field=src_bf16)
    if truthy(bf16):  # True, or "auto" (DeepSpeed/axolotl spelling)
        if dtype == "float32":
            m.set("precision", "amp_bf16", src_bf16)
        else:
            m.set("precision", "bf16", src_bf16)
            if dtype is None:
                m.note("bf16: assumes the model is loaded in bfloat16 (transformers 5 loads the checkpoint's "
                       "dtype); a float32 load would be precision='amp_bf16'")
    elif truthy(fp16):
        m.set("precision", "amp_fp16", src_fp16)
    elif dtype in ("bfloat16", "float16"):
        m.set("precision", "bf16" if dtype == "bfloat16" else "fp16", "dtype")
    elif dtype == "float32":
        m.set("precision", "fp32", "dtype")


def apply_optim(m: Mapper, optim: Any, src: str, optim_args: Any = None) -> None:
    """An ``optim`` name in transformers' spelling."""
    if not isinstance(optim, str) or not optim:
        return
    name = HF_OPTIMIZERS.get(optim.lower(), optim.lower())
    m.set("optimizer", name, src)
    if name.startswith("galore") and isinstance(optim_args, str):
        for part in optim_args.split(","):
            k, _, v = part.partition("=")
            rank = m.whole(v.strip(), "optim_args") if k.strip() == "rank" else None
            if rank is not None:
                m.set("galore_rank", rank, "optim_args")


def _apply_fsdp(m: Mapper) -> None:
    """``fsdp`` / ``fsdp_config``.  transformers < 5 writes fsdp as options ("full_shard auto_wrap
    offload"); transformers 5 keeps fsdp=True and puts ``version`` (default 2 there, FSDP1
    before), ``reshard_after_forward`` (a bool under FSDP2, a strategy name under FSDP1) and
    ``cpu_offload`` in fsdp_config (training_args.py ``_build_fsdp_plugin_args``,
    ``_apply_legacy_fsdp_to_config``)."""
    fsdp = m.get("fsdp")
    cfg = m.get("fsdp_config") or {}
    if not fsdp:
        return
    cfg = cfg if isinstance(cfg, Mapping) else {}
    opts = fsdp if isinstance(fsdp, list) else str(fsdp).split() if isinstance(fsdp, str) else []
    opts = [str(o).lower() for o in opts]
    vkey = "version" if "version" in cfg else "fsdp_version"
    version = integer(cfg.get(vkey)) or (1 if opts else 2)
    if vkey not in cfg and opts:
        m.note("fsdp options without fsdp_config.version: FSDP1 assumed (transformers < 5; 5 defaults to FSDP2)")
    if version == 2:
        m.par("fsdp_version", 2, f"fsdp_config.{vkey}" if vkey in cfg else "fsdp")
    reshard = cfg.get("reshard_after_forward")
    named = str(reshard).lower() if isinstance(reshard, str) and not reshard.lower() in ("true", "false") else ""
    if "shard_grad_op" in opts or named == "shard_grad_op" or \
            (reshard is not None and not named and not truthy(reshard)):
        strat = "fsdp_shard_grad_op"
    elif {"hybrid_shard", "hybrid_shard_zero2"} & set(opts) or named.startswith("hybrid_shard"):
        strat = "fsdp_hybrid"
    elif "no_shard" in opts or named == "no_shard":
        strat = "ddp"
    else:
        strat = "fsdp_full_shard"
    m.par("strategy", strat, "fsdp_config.reshard_after_forward" if reshard is not None else "fsdp")
    if "offload" in opts or truthy(cfg.get("cpu_offload", False)):
        m.par("offload_params", True, "fsdp" if "offload" in opts else "fsdp_config.cpu_offload")
    if truthy(cfg.get("activation_checkpointing", False)):
        m.set("gradient_checkpointing", "full", "fsdp_config.activation_checkpointing")
    m.note("the number of GPUs is set by the launcher (torchrun/accelerate), not TrainingArguments: pass num_gpus=")


def apply_peft(m: Mapper, peft: Mapping[str, Any], prefix: str) -> None:
    """A PEFT LoraConfig (``adapter_config.json``)."""
    ptype = str(peft.get("peft_type", "LORA")).upper()
    if ptype != "LORA":
        m.ignore(prefix + "peft_type", f"PEFT method {ptype} is not modelled (LoRA and DoRA are)")
        return
    m.set("method", "lora", prefix + "peft_type")
    base = peft.get("base_model_name_or_path")
    if isinstance(base, str) and base and m.cfg.model is None:
        m.model(base, prefix + "base_model_name_or_path")
    m.numbers({"r": ("lora_r", integer), "lora_alpha": ("lora_alpha", number),
               "lora_dropout": ("lora_dropout", number)}, prefix, source=peft)
    t = lora_targets(peft.get("target_modules"))
    if t:
        m.set("lora_targets", t, prefix + "target_modules")
    if truthy(peft.get("use_dora", False)):
        m.set("lora_variant", "dora", prefix + "use_dora")
    mts = peft.get("modules_to_save")
    if mts:
        m.set("modules_to_save", tuple(mts) if isinstance(mts, (list, tuple)) else (str(mts),),
              prefix + "modules_to_save")
    for key in peft:
        if key not in ("peft_type", "base_model_name_or_path", "r", "lora_alpha", "lora_dropout", "target_modules",
                       "use_dora", "modules_to_save") and peft[key] not in (None, False, [], {}, ""):
            m.ignore(prefix + key, "no effect on memory")


def apply_bnb(m: Mapper, bnb: Mapping[str, Any], prefix: str) -> None:
    """A BitsAndBytesConfig: 4-bit NF4/FP4 with or without double quantization, or LLM.int8."""
    if truthy(bnb.get("load_in_4bit", False)):
        qt = str(bnb.get("bnb_4bit_quant_type", "fp4")).lower()  # BitsAndBytesConfig's default is fp4
        m.set("quantization", "nf4" if qt == "nf4" else "fp4", prefix + "bnb_4bit_quant_type")
        m.set("double_quant", truthy(bnb.get("bnb_4bit_use_double_quant", False)),
              prefix + "bnb_4bit_use_double_quant")
    elif truthy(bnb.get("load_in_8bit", False)):
        m.set("quantization", "int8", prefix + "load_in_8bit")
    for key in bnb:
        if key not in ("load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type", "bnb_4bit_use_double_quant") \
                and bnb[key] not in (None, False, [], {}, ""):
            m.ignore(prefix + key, "no effect on memory")
    if m.cfg.setup.get("method") == "lora" and m.cfg.setup.get("quantization", "none") != "none":
        m.set("method", "qlora", prefix + "load_in_4bit")
