"""The training setup: every input of an estimate, validated, with the allowed values.

``TrainingSetup.from_kwargs(**kw)`` checks each field and raises a VramError that names
the field and what is allowed.  The keyword names are those of :func:`vramwidget.estimate`
and of the widget's traits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from .errors import VramError
from .inputs import Field, check_choice, check_int, check_keywords, check_number

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
    #: fp32 matmuls on TF32 tensor cores.  PyTorch's default is off
    #: (``torch.backends.cuda.matmul.allow_tf32 = False``): fp32 matmuls run on the CUDA
    #: cores at the plain fp32 rate.  Changes the step time only, never the memory.
    tf32: bool = False

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
        """A validated setup: each keyword checked by its declaration in :data:`FIELDS`
        (type, allowed values, range), then the links between fields."""
        check_keywords("setup field", kw, FIELDS)
        # None is "not given" (the dataclass default) for every field that says so
        v: Dict[str, Any] = {name: FIELDS[name].check(x) for name, x in kw.items()
                             if not (x is None and FIELDS[name].none == "default")}

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
    "quantization": {"4bit": "nf4", "8bit": "int8", "": "none"},
    "gradient_checkpointing": {"true": "full", "false": "none", "on": "full", "off": "none", True: "full",
                               False: "none"},
}


def _state_dtype(x: str) -> Optional[str]:
    from .units import canonical_dtype

    try:
        return canonical_dtype(x)
    except KeyError:
        return None


def _choice_field(name: str, doc: str = "") -> Field:
    return Field(name, "choice", default=getattr(TrainingSetup, name), doc=doc,
                 choices=lambda: [c for c, _ in CHOICES[name]], aliases=_ALIASES.get(name, {}))


#: every setup keyword, declared once: kind, default, allowed values or range.  Adding a
#: keyword is a dataclass field above plus one declaration here (and a CHOICES entry for a
#: choice); ``from_kwargs`` checks it, the fuzz tests feed it any value.
FIELDS: Dict[str, Field] = {f.name: f for f in (
    _choice_field("method"),
    _choice_field("precision"),
    _choice_field("quantization"),
    Field("double_quant", "bool", True, "bitsandbytes double quantization of the 4-bit constants"),
    Field("quantized_groups", "names", DEFAULT_QUANT_GROUPS, "module groups stored in 4/8 bits",
          choices=lambda: QUANT_GROUPS),
    Field("prepare_kbit", "bool", False, "peft's prepare_model_for_kbit_training"),
    _choice_field("optimizer"),
    Field("optimizer_state_dtypes", "names", None, "dtype of each optimizer state",
          choices=lambda: STATE_DTYPES, canon=_state_dtype, none="none"),
    _choice_field("gradient_checkpointing"),
    _choice_field("attn_implementation"),
    Field("batch_size", "int", 1, "micro-batch size", lo=1, none="error"),
    Field("seq_len", "int", 2048, "tokens per sequence", lo=1, none="error"),
    Field("grad_accum_steps", "int", 1, "micro-batches per optimizer step", lo=1, none="error"),
    Field("lora_r", "int", 16, "LoRA rank", lo=1, none="error"),
    Field("lora_alpha", "number", 32.0, "LoRA alpha", lo=0, lo_open=True, none="error"),
    Field("lora_dropout", "number", 0.0, "LoRA dropout probability", lo=0, hi=1, hi_open=True, none="error"),
    Field("lora_targets", "names", None, "modules LoRA adapts (or 'all-linear')", none="none",
          empty="name at least one module, or 'all-linear'"),
    Field("trainable_layers", "int", None, "last layers trained by method='freeze'", lo=1, none="none"),
    Field("tf32", "bool", False, "TF32 matmuls for fp32 (torch.backends.cuda.matmul.allow_tf32)"),
)}
assert set(FIELDS) == set(_FIELDS), "every TrainingSetup field has one declaration in FIELDS"


# helpers kept for callers that check one value the old way
def _choice(name: str, value: Any) -> str:
    return check_choice(name, value, [c for c, _ in CHOICES[name]], _ALIASES.get(name, {}))


def _posint(name: str, value: Any) -> int:
    return check_int(name, value, lo=1)


def _float(name: str, value: Any) -> float:
    return check_number(name, value)


def _posfloat(name: str, value: Any) -> float:
    return check_number(name, value, lo=0, lo_open=True)


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
    if training.get("tf32") is not None:
        kw["tf32"] = bool(training["tf32"])
    return TrainingSetup.from_kwargs(**kw)
