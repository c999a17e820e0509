"""axolotl YAML.

Field names from axolotl's config schema (src/axolotl/utils/schemas/config.py and
schemas/peft.py, model.py, training.py, integrations): ``base_model``, ``adapter``
(lora/qlora), ``load_in_4bit``/``load_in_8bit``, ``lora_r``/``lora_alpha``/``lora_dropout``,
``lora_target_modules``/``lora_target_linear``, ``lora_modules_to_save``, ``peft_use_dora``,
``sequence_len``, ``sample_packing``, ``micro_batch_size``, ``gradient_accumulation_steps``,
``optimizer``, ``bf16``/``fp16``/``tf32``, ``gradient_checkpointing`` (true or "offload",
axolotl's CPU-offloaded checkpointing), ``flash_attention``/``sdp_attention``/``attention``,
``deepspeed``, ``fsdp``/``fsdp_config``, Liger's ``liger_fused_linear_cross_entropy`` and
``cut_cross_entropy`` (both avoid materialising the logits), ``unfrozen_parameters``,
``torch_compile``.  axolotl loads the base in bf16 when ``bf16`` is true or "auto" on a GPU
that supports it (src/axolotl/loaders/model.py).
"""

from __future__ import annotations

from typing import Any, Mapping

from . import deepspeed
from ..errors import VramError
from ._common import LORA_NUMBERS, Mapper, integer, lora_targets, truthy
from .hf import apply_optim

_MARKERS = ("base_model", "adapter", "micro_batch_size", "sequence_len", "sample_packing", "lora_target_linear",
            "datasets", "dataset_prepared_path", "val_set_size", "load_in_4bit")


def detect(raw: Mapping[str, Any]) -> int:
    """axolotl: base_model + micro_batch_size / sequence_len / adapter ..."""
    return 2 * sum(k in raw for k in _MARKERS) if "base_model" in raw or "micro_batch_size" in raw else 0


def read(raw: Mapping[str, Any], m: Mapper) -> None:
    """An axolotl config."""
    base = m.get("base_model")
    if isinstance(base, str) and base:
        m.model(base, "base_model")
    m.numbers({"micro_batch_size": ("batch_size", integer), "gradient_accumulation_steps": ("grad_accum_steps", integer),
               "sequence_len": ("seq_len", integer)})
    adapter = m.get("adapter")
    if isinstance(adapter, str) and adapter.lower() in ("lora", "qlora"):
        m.set("method", "lora", "adapter")
    elif adapter:
        m.ignore("adapter", f"adapter {adapter!r} is not modelled (lora and qlora are)")
    l4, l8 = m.get("load_in_4bit", False), m.get("load_in_8bit", False)
    if truthy(l4):
        m.set("quantization", "nf4", "load_in_4bit")  # axolotl's bnb config: nf4, double quant
        m.set("double_quant", True, "load_in_4bit")
        m.note("load_in_4bit: axolotl quantizes to NF4 with double quantization (src/axolotl/loaders/model.py)")
    elif truthy(l8):
        m.set("quantization", "int8", "load_in_8bit")
    if m.cfg.setup.get("method") == "lora":
        if m.cfg.setup.get("quantization", "none") != "none":
            m.set("method", "qlora", "adapter")
        m.numbers(LORA_NUMBERS)
        if truthy(m.get("lora_target_linear", False)):
            m.set("lora_targets", ("all-linear",), "lora_target_linear")
        else:
            t = lora_targets(m.get("lora_target_modules"))
            if t:
                m.set("lora_targets", t, "lora_target_modules")
        if truthy(m.get("peft_use_dora", False)):
            m.set("lora_variant", "dora", "peft_use_dora")
        mts = m.get("lora_modules_to_save")
        if mts:
            m.set("modules_to_save", tuple(mts) if isinstance(mts, (list, tuple)) else (str(mts),),
                  "lora_modules_to_save")
    else:
        m.set("method", "full", "adapter")
        if m.get("unfrozen_parameters"):
            m.ignore("unfrozen_parameters", "a regex list of trained parameters is not modelled: full is assumed")
    _precision(m)
    if m.get("tf32") is not None:
        m.set("tf32", truthy(raw["tf32"]), "tf32")
    gc = m.get("gradient_checkpointing")
    if isinstance(gc, str) and gc.lower() == "offload":
        # axolotl's "offload": checkpointed layer inputs kept in CPU memory (Unsloth's scheme)
        m.set("gradient_checkpointing", "full", "gradient_checkpointing")
        m.set("activation_offloading", True, "gradient_checkpointing")
    elif truthy(gc):
        m.set("gradient_checkpointing", "full", "gradient_checkpointing")
    if truthy(m.get("activation_offloading", False)):
        m.set("activation_offloading", True, "activation_offloading")
    attn = m.get("attention")
    if truthy(m.get("flash_attention", False)) or (isinstance(attn, str) and attn.lower() in ("flash", "flash_attention_2")):
        m.set("attn_implementation", "flash_attention_2", "flash_attention" if m.has("flash_attention") else "attention")
    elif truthy(m.get("sdp_attention", False)) or (isinstance(attn, str) and attn.lower() == "sdpa"):
        m.set("attn_implementation", "sdpa", "sdp_attention" if m.has("sdp_attention") else "attention")
    elif truthy(m.get("eager_attention", False)) or (isinstance(attn, str) and attn.lower() == "eager"):
        m.set("attn_implementation", "eager", "eager_attention" if m.has("eager_attention") else "attention")
    if truthy(m.get("xformers_attention", False)):
        m.ignore("xformers_attention", "xformers attention is counted like SDPA's memory-efficient kernel")
    if truthy(m.get("sample_packing", False)):
        m.set("packing", True, "sample_packing")
    m.get("pad_to_sequence_len")
    apply_optim(m, m.get("optimizer"), "optimizer", m.get("optim_args"))
    m.get("optim_target_modules")
    if truthy(m.get("liger_fused_linear_cross_entropy", False)):
        m.set("loss", "liger", "liger_fused_linear_cross_entropy")
    elif truthy(m.get("cut_cross_entropy", False)):
        # Apple's Cut Cross-Entropy: like Liger's, logits are never held for the whole sequence
        m.set("loss", "liger", "cut_cross_entropy")
    for key in ("liger_rope", "liger_rms_norm", "liger_glu_activation", "liger_layer_norm", "liger_swiglu",
                "liger_cross_entropy"):
        if truthy(m.get(key, False)):
            m.ignore(key, "Liger's fused elementwise kernels change saved activations by a few percent: not modelled")
    m.get("plugins")
    if truthy(m.get("torch_compile", False)):
        m.set("compile", True, "torch_compile")
    deepspeed.apply_named(m, "deepspeed")
    fsdp = m.get("fsdp")
    # axolotl >= 0.10 runs FSDP2 from fsdp_version: 2 and fsdp_config alone (the fsdp list
    # deprecated); fsdp_config.reshard_after_forward is then FSDP2's bool
    version = integer(m.get("fsdp_version")) or integer(m.get("fsdp_config.fsdp_version")) or 1
    if fsdp or version == 2:
        from .accelerate import FSDP_STRATEGIES

        cfg = m.get("fsdp_config") or {}
        cfg = cfg if isinstance(cfg, Mapping) else {}
        opts = [str(o).lower() for o in (fsdp if isinstance(fsdp, list) else str(fsdp or "").split())]
        strat = "fsdp_shard_grad_op" if "shard_grad_op" in opts else "fsdp_hybrid" if "hybrid_shard" in opts \
            else "fsdp_full_shard"
        if cfg.get("fsdp_sharding_strategy"):
            strat = FSDP_STRATEGIES.get(str(cfg["fsdp_sharding_strategy"]).upper(), strat)
        reshard = cfg.get("reshard_after_forward", cfg.get("fsdp_reshard_after_forward"))
        if version == 2:
            m.par("fsdp_version", 2, "fsdp_version")
            if reshard is not None:
                strat = "fsdp_full_shard" if truthy(reshard) else "fsdp_shard_grad_op"
                m.par("reshard_after_forward", bool(truthy(reshard)), "fsdp_config.reshard_after_forward")
        m.par("strategy", strat, "fsdp")
        if truthy(cfg.get("fsdp_offload_params", False)) or truthy(cfg.get("offload_params", False)):
            m.par("offload_params", True, "fsdp_config.fsdp_offload_params")
        if truthy(cfg.get("activation_checkpointing", False)):
            m.set("gradient_checkpointing", "full", "fsdp_config.activation_checkpointing")
        m.note("the number of GPUs is set by the launcher (accelerate/torchrun), not the axolotl YAML: pass num_gpus=")


def _precision(m: Mapper) -> None:
    """The weights' dtype from every precision flag together, as axolotl decides it
    (src/axolotl/utils/config/__init__.py normalize_config): ``bf16`` ("auto" by default, the
    schema's: bf16 on a GPU that has it) turns ``fp16`` off; then the dtype is bfloat16 if
    ``bf16`` or ``bfloat16``, float16 if ``fp16``, ``float16`` or ``load_in_8bit``, else
    float32.  ``float32`` (and the ``fp32`` people write) asks for float32: said when the
    other flags decide otherwise, an error when they say the opposite outright."""
    raw = {k: m.get(k) for k in ("bf16", "fp16", "bfloat16", "float16", "float32", "fp32", "fp8")}
    bf16 = raw["bf16"] if raw["bf16"] is not None else "auto"     # the schema's default
    auto = str(bf16).strip().lower() == "auto"
    b16 = truthy(bf16)
    f16 = truthy(raw["fp16"]) and not b16
    want32 = [k for k in ("float32", "fp32") if truthy(raw[k])]
    if truthy(raw["fp16"]) and b16:
        m.note(f"fp16: true is turned off by bf16: {bf16} (axolotl's normalize_config: bf16 wins)")
    if truthy(raw["fp8"]):
        m.set("precision", "fp8", "fp8")
        return
    if b16 or truthy(raw["bfloat16"]):
        dtype, src = "bf16", "bf16" if b16 else "bfloat16"
    elif f16 or truthy(raw["float16"]) or truthy(m.get("load_in_8bit", False)):
        dtype, src = "fp16", "fp16" if f16 else "float16" if truthy(raw["float16"]) else "load_in_8bit"
    else:   # bf16 false (what decides it), or float32 asked for with nothing 16-bit on
        dtype, src = "fp32", "bf16" if raw["bf16"] is not None else next(iter(want32), "bf16")
    if want32 and dtype != "fp32":
        if not (auto and src == "bf16"):
            raise VramError(f"{want32[0]}: {want32[0]}: true contradicts {src}: true (one precision); drop one",
                            field=want32[0])
        m.note(f"{want32[0]}: true does not turn bf16 off: axolotl's bf16 defaults to 'auto' (bf16 on Ampere "
               f"and later), so bf16 is estimated; set bf16: false for fp32")
    m.set("precision", dtype, src)
    if auto and src == "bf16":
        m.note("bf16: auto: bf16 assumed (the GPU supports it); on a GPU without bf16 axolotl uses fp16")

