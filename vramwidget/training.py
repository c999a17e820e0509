"""The training setup: every input of an estimate, validated, with the allowed values.

``TrainingSetup.from_kwargs(**kw)`` checks each field and raises a VramError that names
the field and what is allowed.  The keyword names are those of :func:`vramwidget.estimate`
and of the widget's traits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from .errors import VramError

#: choice fields: value -> label shown in the widget and CLI help
CHOICES: Dict[str, List[Tuple[str, str]]] = {
    "method": [
        ("full", "Full fine-tuning"),
        ("lora", "LoRA (frozen 16-bit base)"),
        ("qlora", "QLoRA (frozen 4-bit base)"),
        ("freeze", "Train only the last layers"),
    ],
    "precision": [
        ("bf16", "Pure BF16 (weights, grads, optimizer states in bf16)"),
        ("amp_bf16", "Mixed precision: fp32 weights, autocast to bf16"),
        ("fp32", "FP32"),
        ("bf16_fp32_states", "BF16 weights and gradients, fp32 optimizer states (the seeds' scheme)"),
        ("fp16", "Pure FP16"),
        ("amp_fp16", "Mixed precision: fp32 weights, autocast to fp16"),
        ("fp8", "FP8 matmuls (bf16 weights, fp8 saved linear inputs)"),
    ],
    "quantization": [
        ("none", "None"),
        ("nf4", "4-bit NF4 (bitsandbytes)"),
        ("fp4", "4-bit FP4 (bitsandbytes)"),
        ("int8", "8-bit LLM.int8 (bitsandbytes)"),
    ],
    "optimizer": [
        ("adamw", "AdamW (PyTorch default, foreach)"),
        ("adamw_fused", "AdamW fused"),
        ("adamw_8bit", "AdamW 8-bit (bitsandbytes)"),
        ("paged_adamw", "Paged AdamW 32-bit (bitsandbytes)"),
        ("paged_adamw_8bit", "Paged AdamW 8-bit (bitsandbytes)"),
        ("adafactor", "Adafactor (transformers)"),
        ("sgd", "SGD"),
        ("sgd_momentum", "SGD with momentum"),
        ("lion", "Lion"),
    ],
    "gradient_checkpointing": [
        ("none", "None"),
        ("selective", "Selective (recompute attention and MLP internals)"),
        ("full", "Full (keep each layer's input)"),
    ],
    "attn_implementation": [
        ("sdpa", "SDPA (PyTorch scaled_dot_product_attention)"),
        ("flash_attention_2", "FlashAttention 2"),
        ("eager", "Eager (scores materialised)"),
    ],
}

QUANT_GROUPS = ("attn_qk", "attn_vo", "mlp", "embedding", "lm_head")
DEFAULT_QUANT_GROUPS = ("attn_qk", "attn_vo", "mlp")
STATE_DTYPES = ("float32", "bfloat16", "float16", "int8")


@dataclass(frozen=True)
class TrainingSetup:
    """One training step's configuration (all fields validated)."""

    method: str = "full"
    precision: str = "bf16"
    quantization: str = "none"
    double_quant: bool = True
    quantized_groups: Tuple[str, ...] = DEFAULT_QUANT_GROUPS
    prepare_kbit: bool = False
    optimizer: str = "adamw"
    optimizer_state_dtypes: Optional[Tuple[str, ...]] = None
    gradient_checkpointing: str = "none"
    attn_implementation: str = "sdpa"
    batch_size: int = 1
    seq_len: int = 2048
    grad_accum_steps: int = 1
    lora_r: int = 16
    lora_alpha: float = 32.0
    lora_dropout: float = 0.0
    lora_targets: Optional[Tuple[str, ...]] = None
    trainable_layers: Optional[int] = None
    #: the caching allocator's settings: "default", "expandable_segments" or a PYTORCH_CUDA_ALLOC_CONF string
    allocator: str = "default"

    # -- derived dtypes ---------------------------------------------------------------
    @property
    def weights_dtype(self) -> str:
        """Storage dtype of the (non-quantized) weights."""
        if self.precision in ("fp32", "amp_bf16", "amp_fp16"):
            return "float32"
        if self.precision == "fp16":
            return "float16"
        return "bfloat16"

    @property
    def compute_dtype(self) -> str:
        """dtype of matmul outputs and most activations."""
        if self.precision == "fp32":
            return "float32"
        if self.precision in ("fp16", "amp_fp16"):
            return "float16"
        return "bfloat16"

    @property
    def autocast(self) -> bool:
        return self.precision in ("amp_bf16", "amp_fp16")

    @property
    def trains_adapters(self) -> bool:
        return self.method in ("lora", "qlora")

    @property
    def quantized(self) -> bool:
        return self.quantization != "none"

    @property
    def tokens(self) -> int:
        return self.batch_size * self.seq_len

    def replace(self, **changes: Any) -> "TrainingSetup":
        """A new validated setup with ``changes`` applied."""
        return TrainingSetup.from_kwargs(**{**self.to_dict(), **changes})

    def to_dict(self) -> Dict[str, Any]:
        """The setup as plain JSON-able values (tuples become lists)."""
        d = {f: getattr(self, f) for f in _FIELDS}
        for k in ("quantized_groups", "lora_targets", "optimizer_state_dtypes"):
            if d[k] is not None:
                d[k] = list(d[k])
        return d

    # -- construction and validation --------------------------------------------------
    @classmethod
    def from_kwargs(cls, **kw: Any) -> "TrainingSetup":
        allowed = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(kw) - allowed)
        if unknown:
            import difflib

            hints = []
            for u in unknown:
                m = difflib.get_close_matches(u, sorted(allowed), n=1)
                hints.append(f"{u!r}" + (f" (did you mean {m[0]!r}?)" if m else ""))
            raise VramError(f"unknown setup field {', '.join(hints)}; allowed: {', '.join(sorted(allowed))}",
                            field=unknown[0])
        v: Dict[str, Any] = {}
        for name in ("method", "precision", "quantization", "optimizer", "attn_implementation"):
            if name in kw and kw[name] is not None:
                v[name] = _choice(name, kw[name])
        if "gradient_checkpointing" in kw and kw["gradient_checkpointing"] is not None:
            gc = kw["gradient_checkpointing"]
            if gc is True:
                gc = "full"
            elif gc is False:
                gc = "none"
            v["gradient_checkpointing"] = _choice("gradient_checkpointing", gc)
        for name in ("batch_size", "seq_len", "grad_accum_steps"):
            if name in kw:
                v[name] = _posint(name, kw[name])
        if "lora_r" in kw:
            v["lora_r"] = _posint("lora_r", kw["lora_r"])
        if "lora_alpha" in kw:
            v["lora_alpha"] = _posfloat("lora_alpha", kw["lora_alpha"])
        if "lora_dropout" in kw:
            p = _float("lora_dropout", kw["lora_dropout"])
            if not 0.0 <= p < 1.0:
                raise VramError(f"lora_dropout: must be in [0, 1), got {p!r}", field="lora_dropout")
            v["lora_dropout"] = p
        if kw.get("lora_targets") is not None:
            t = kw["lora_targets"]
            if isinstance(t, str):
                t = [x.strip() for x in t.split(",") if x.strip()]
            t = tuple(str(x) for x in t)
            if not t:
                raise VramError("lora_targets: name at least one module, or 'all-linear'", field="lora_targets")
            v["lora_targets"] = t
        if kw.get("allocator") is not None:
            from .allocator import parse_alloc_conf

            if not isinstance(kw["allocator"], str):
                raise VramError(f"allocator: must be 'default', 'expandable_segments' or a PYTORCH_CUDA_ALLOC_CONF "
                                f"string, got {kw['allocator']!r}", field="allocator")
            v["allocator"] = parse_alloc_conf(kw["allocator"]).text
        if kw.get("trainable_layers") is not None:
            v["trainable_layers"] = _posint("trainable_layers", kw["trainable_layers"])
        for name in ("double_quant", "prepare_kbit"):
            if name in kw and kw[name] is not None:
                if not isinstance(kw[name], bool):
                    raise VramError(f"{name}: must be true or false, got {kw[name]!r}", field=name)
                v[name] = kw[name]
        if kw.get("quantized_groups") is not None:
            g = kw["quantized_groups"]
            if isinstance(g, str):
                g = [x.strip() for x in g.split(",") if x.strip()]
            bad = [x for x in g if x not in QUANT_GROUPS]
            if bad:
                raise VramError(f"quantized_groups: unknown group {', '.join(map(repr, bad))}; allowed: "
                                f"{', '.join(QUANT_GROUPS)}", field="quantized_groups")
            if not g:
                raise VramError("quantized_groups: name at least one group; allowed: " + ", ".join(QUANT_GROUPS),
                                field="quantized_groups")
            v["quantized_groups"] = tuple(dict.fromkeys(g))
        if kw.get("optimizer_state_dtypes") is not None:
            sd = kw["optimizer_state_dtypes"]
            if isinstance(sd, str):
                sd = [x.strip() for x in sd.split(",") if x.strip()]
            from .units import canonical_dtype

            out = []
            for x in sd:
                try:
                    c = canonical_dtype(x)
                except KeyError:
                    c = None
                if c not in STATE_DTYPES:
                    raise VramError(f"optimizer_state_dtypes: unknown dtype {x!r}; allowed: "
                                    f"{', '.join(STATE_DTYPES)}", field="optimizer_state_dtypes")
                out.append(c)
            v["optimizer_state_dtypes"] = tuple(out)

        # -- links between fields --
        method = v.get("method", "full")
        if method == "qlora" and v.get("quantization", "nf4") == "none":
            raise VramError("quantization: QLoRA needs a quantized base (nf4, fp4 or int8), got 'none'",
                            field="quantization")
        if method == "qlora":
            v.setdefault("quantization", "nf4")
        if v.get("quantization", "none") != "none" and method not in ("qlora", "lora"):
            raise VramError(f"method: full fine-tuning of {v['quantization']} weights is not possible (quantized "
                            f"weights cannot take gradient updates); use method='qlora' or quantization='none'",
                            field="method")
        if method == "lora" and v.get("quantization", "none") != "none":
            v["method"] = "qlora"  # a LoRA on a quantized base is QLoRA
        if v.get("prepare_kbit") and v.get("quantization", "none") == "none":
            raise VramError("prepare_kbit: prepare_model_for_kbit_training applies to a quantized base only",
                            field="prepare_kbit")
        if method == "freeze" and v.get("trainable_layers") is None:
            raise VramError("trainable_layers: method='freeze' needs how many last layers train (e.g. 2)",
                            field="trainable_layers")
        if v.get("precision") == "fp8" and v.get("quantization", "none") != "none":
            raise VramError("precision: fp8 compute with a bitsandbytes-quantized base is not modelled; "
                            "use bf16", field="precision")
        return cls(**v)


_FIELDS = tuple(TrainingSetup.__dataclass_fields__)


#: other spellings accepted for choice fields (transformers' and peft's names among them)
_ALIASES: Dict[str, Dict[Any, str]] = {
    "optimizer": {"adamw_torch": "adamw", "adamw_torch_fused": "adamw_fused", "adamw8bit": "adamw_8bit",
                  "adamw_bnb_8bit": "adamw_8bit", "paged_adamw_32bit": "paged_adamw", "sgd_nesterov": "sgd_momentum"},
    "attn_implementation": {"flash_attention": "flash_attention_2", "flash": "flash_attention_2"},
    "precision": {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "mixed": "amp_bf16", "amp": "amp_bf16"},
    "method": {"full_finetune": "full", "frozen": "freeze"},
    "quantization": {"4bit": "nf4", "8bit": "int8", None: "none", "": "none"},
    "gradient_checkpointing": {"true": "full", "false": "none", "on": "full", "off": "none"},
}


def _choice(name: str, value: Any) -> str:
    allowed = [c for c, _ in CHOICES[name]]
    s = str(value).strip().lower() if isinstance(value, str) else value
    s = _ALIASES.get(name, {}).get(s, s)
    if s not in allowed:
        raise VramError(f"{name}: {value!r} is not one of {', '.join(allowed)}", field=name)
    return s


def _posint(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            isinstance(value, float) and (math.isnan(value) or math.isinf(value) or value != int(value))):
        raise VramError(f"{name}: must be a whole number >= 1, got {value!r}", field=name)
    if value < 1:
        raise VramError(f"{name}: must be a whole number >= 1, got {value!r}", field=name)
    return int(value)


def _float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or math.isinf(value):
        raise VramError(f"{name}: must be a finite number, got {value!r}", field=name)
    return float(value)


def _posfloat(name: str, value: Any) -> float:
    x = _float(name, value)
    if x <= 0:
        raise VramError(f"{name}: must be > 0, got {value!r}", field=name)
    return x


def setup_from_case(training: Dict[str, Any]) -> TrainingSetup:
    """The validation file's ``training`` record -> a TrainingSetup."""
    wd = training.get("weights_dtype", "bfloat16")
    ac = training.get("autocast_dtype")
    if ac:
        precision = "amp_fp16" if "16" in ac and "b" not in ac else "amp_bf16"
    else:
        precision = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[wd]
    kw: Dict[str, Any] = dict(
        method=training.get("method", "full"), precision=precision,
        optimizer=training.get("optimizer", "adamw"),
        gradient_checkpointing=bool(training.get("gradient_checkpointing")),
        attn_implementation=training.get("attn_implementation", "sdpa"),
        batch_size=training["batch_size"], seq_len=training["seq_len"],
    )
    lora = training.get("lora")
    if lora:
        kw.update(lora_r=lora["r"], lora_alpha=lora.get("alpha", 32), lora_dropout=lora.get("dropout", 0.0),
                  lora_targets=lora.get("target_modules"))
    q = training.get("quantization")
    if q:
        if q.get("load_in_4bit"):
            kw["quantization"] = q.get("quant_type", "nf4")
        elif q.get("load_in_8bit"):
            kw["quantization"] = "int8"
        kw["double_quant"] = bool(q.get("double_quant", False))
        kw["prepare_kbit"] = bool(training.get("prepare_model_for_kbit_training", False))
    if training.get("method") == "qlora":
        kw.setdefault("quantization", "nf4")
    return TrainingSetup.from_kwargs(**kw)
