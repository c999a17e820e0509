"""The training setup: every input of an estimate, validated, with the allowed values.

``TrainingSetup.from_kwargs(**kw)`` checks each field and raises a VramError that names
the field and what is allowed.  The keyword names are those of :func:`vramwidget.estimate`
and of the widget's traits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

from .errors import VramError
from .inputs import (MAX_TEXT_CHARS, Field, check_choice, check_int, check_keywords, check_names, check_number,
                     fail, shown)

#: choice fields: value -> label shown in the widget and CLI help
CHOICES: Dict[str, List[Tuple[str, str]]] = {
    "method": [
        ("full", "Full fine-tuning"),
        ("lora", "LoRA (frozen 16-bit base)"),
        ("qlora", "QLoRA (frozen 4-bit base)"),
        ("freeze", "Train only the last layers"),
        ("norms", "Train only the LayerNorm/RMSNorm weights"),
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
        ("galore_adamw", "GaLore AdamW (low-rank projected moments)"),
        ("galore_adamw_8bit", "GaLore AdamW 8-bit (bitsandbytes moments)"),
    ],
    "gradient_checkpointing": [
        ("none", "None"),
        ("selective", "Selective (recompute the attention core: saves its scores under eager attention, "
                      "next to nothing under SDPA or FlashAttention)"),
        ("full", "Full (keep each layer's input)"),
    ],
    "attn_implementation": [
        ("sdpa", "SDPA (PyTorch scaled_dot_product_attention)"),
        ("flash_attention_2", "FlashAttention 2"),
        ("eager", "Eager (scores materialised)"),
    ],
    "backend": [
        ("auto", "Analytic where the family is modelled, else traced"),
        ("analytic", "Analytic (the modelled families)"),
        ("trace", "Traced: one step of the transformers model on fake tensors (extra [trace])"),
    ],
    "loss": [
        ("standard", "Cross-entropy on the full logits (HF, torchtune default)"),
        ("chunked", "Chunked cross-entropy (torchtune CEWithChunkedOutputLoss, LitGPT)"),
        ("liger", "Fused linear cross-entropy (Liger kernels): no full logits"),
    ],
    "lora_variant": [
        ("lora", "LoRA"),
        ("dora", "DoRA (weight-decomposed LoRA, peft use_dora)"),
    ],
    "stack": [
        ("hf", "Hugging Face Trainer / TRL / PEFT"),
        ("torchtune", "torchtune recipes"),
        ("litgpt", "LitGPT"),
        ("unsloth", "Unsloth"),
        ("axolotl", "axolotl"),
    ],
}

#: the libraries whose release changes a modelled mechanism (see ``TrainingSetup.before``)
VERSIONED_PACKAGES = ("bitsandbytes", "transformers", "peft")
#: modules peft can train in full beside the adapters (``modules_to_save``)
SAVE_MODULES = ("lm_head", "embed_tokens")

#: the most chunks a chunked cross-entropy may have (``loss_chunks``): torchtune's
#: ``num_output_chunks`` is 8; LitGPT's chunks are 128 tokens (``lm_head_chunk_size``), 1,024
#: of them for a 128k-token sequence
MAX_LOSS_CHUNKS = 4096
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
    #: an encoder-decoder's target tokens per sample (what the decoder reads: the labels,
    #: shifted right); None: as many as ``seq_len``.  Refused for models without a decoder
    #: stack of their own (estimate._check_knobs)
    target_len: Optional[int] = None
    grad_accum_steps: int = 1
    lora_r: int = 16
    lora_alpha: float = 32.0
    lora_dropout: float = 0.0
    lora_targets: Optional[Tuple[str, ...]] = None
    trainable_layers: Optional[int] = None
    loss: str = "standard"
    loss_chunks: int = 8
    activation_offloading: bool = False
    optimizer_in_backward: bool = False
    lora_variant: str = "lora"
    modules_to_save: Tuple[str, ...] = ()
    galore_rank: int = 128
    packing: bool = False
    compile: bool = False
    versions: Tuple[Tuple[str, str], ...] = ()
    stack: str = "hf"
    #: fp32 matmuls on TF32 tensor cores.  PyTorch's default is off
    #: (``torch.backends.cuda.matmul.allow_tf32 = False``): fp32 matmuls run on the CUDA
    #: cores at the plain fp32 rate.  Changes the step time only, never the memory.
    tf32: bool = False
    #: images per training sample (vision-language models): the vision tower encodes them all
    images_per_sample: int = 0
    #: patches the vision tower sees per image (0: the model's own fixed count, e.g. Gemma 3's
    #: 896 x 896 / 14^2 = 4096; needed for dynamic-resolution towers such as Qwen2.5-VL)
    image_patches: int = 0
    backend: str = "auto"
    #: the caching allocator's settings: "default", "expandable_segments" or a
    #: PYTORCH_CUDA_ALLOC_CONF string (decides reserved memory, never allocated memory)
    allocator: str = "default"
    #: ``optimizer.zero_grad(set_to_none=True)`` (PyTorch's default since 2.0; transformers'
    #: Trainer calls ``model.zero_grad()``, which sets them to None too): the gradients go
    #: after each step.  False: they are zeroed in place and stay allocated between steps
    #: (plan/step.py ``_Grads.zero_grad``)
    zero_grad_set_to_none: bool = True

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


    def version(self, package: str) -> Optional[Tuple[int, ...]]:
        """The release of ``package`` the user named in ``versions`` (None: the current one)."""
        for name, v in self.versions:
            if name == package:
                return _parse_version(v)
        return None

    def before(self, package: str, release: str) -> bool:
        """Whether the user runs a ``package`` older than ``release`` (False when not named:
        the estimate assumes current releases)."""
        v = self.version(package)
        return v is not None and v < _parse_version(release)

    def replace(self, **changes: Any) -> "TrainingSetup":
        """A new validated setup with ``changes`` applied.  What this setup said (the
        defaults applied, the warnings) stays said for the fields ``changes`` leaves alone."""
        new = TrainingSetup._build({**self.to_dict(), **changes}, given=changes)
        kept = tuple(x for x in self.said if x[0] not in changes)
        object.__setattr__(new, "_said", kept + tuple(x for x in new.said if x not in kept))
        return new

    @property
    def said(self) -> Tuple[Tuple[str, str], ...]:
        """(field, note) for each practitioner default applied to a field nobody gave
        (:mod:`vramwidget.defaults`) and each given option that does nothing here; the
        estimate carries the notes (:meth:`notes`)."""
        return getattr(self, "_said", ())

    @property
    def notes(self) -> List[str]:
        """What the setup itself has to say: the defaults it applied, the options it ignores."""
        return [note for _, note in self.said]

    def to_dict(self) -> Dict[str, Any]:
        """The setup as plain JSON-able values (tuples become lists)."""
        d = {f: getattr(self, f) for f in _FIELDS}
        for k in ("quantized_groups", "lora_targets", "optimizer_state_dtypes", "modules_to_save"):
            if d[k] is not None:
                d[k] = list(d[k])
        d["versions"] = dict(self.versions)
        return d

    # -- construction and validation --------------------------------------------------
    @classmethod
    def from_kwargs(cls, **kw: Any) -> "TrainingSetup":
        """A validated setup: each keyword checked by its declaration in :data:`FIELDS`
        (type, allowed values, range), then the stack's defaults, then the practitioner
        defaults (:mod:`vramwidget.defaults`, said in :attr:`notes`), then the links between
        fields; a given option that does nothing with the rest is said too."""
        return cls._build(kw, given=kw)

    @classmethod
    def _build(cls, kw: Dict[str, Any], given: Dict[str, Any]) -> "TrainingSetup":
        """:meth:`from_kwargs` of ``kw``; ``given`` are the keywords the caller chose (what
        the warnings of options that do nothing look at)."""
        from .defaults import apply_training_defaults

        check_keywords("setup field", kw, FIELDS)
        # None is "not given" (the dataclass default) for every field that says so
        checked: Dict[str, Any] = {name: FIELDS[name].check(x) for name, x in kw.items()
                                   if not (x is None and FIELDS[name].none == "default")}
        from .stacks import stack_defaults

        stack = checked.get("stack", "hf")
        # a stack's defaults, where the user did not say otherwise (stacks.py, from each stack's source)
        v: Dict[str, Any] = {**{k: FIELDS[k].check(x) for k, x in stack_defaults(stack, checked).items()
                                if k not in checked}, **checked}
        if stack == "hf":
            v.pop("stack", None)
        # what practitioners run, for the fields still open (defaults.py: one place for every door)
        said = apply_training_defaults(v)

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
        if v.get("modules_to_save") and method not in ("lora", "qlora"):
            raise VramError("modules_to_save: trains whole modules beside LoRA adapters; use method='lora' or 'qlora'",
                            field="modules_to_save")
        if v.get("lora_variant", "lora") != "lora" and method not in ("lora", "qlora"):
            raise VramError(f"lora_variant: {shown(v['lora_variant'])} needs method='lora' or 'qlora'", field="lora_variant")
        if v.get("optimizer", "adamw").startswith("galore") and method != "full":
            raise VramError("optimizer: GaLore projects the gradients of full weight matrices; use method='full'",
                            field="optimizer")
        if v.get("optimizer_in_backward") and v.get("grad_accum_steps", 1) > 1:
            raise VramError("optimizer_in_backward: steps each parameter as its gradient is ready, which "
                            "gradient accumulation cannot do (torchtune refuses it too); use grad_accum_steps=1",
                            field="optimizer_in_backward")
        if v.get("precision") == "fp8" and v.get("quantization", "none") != "none":
            raise VramError("precision: fp8 compute with a bitsandbytes-quantized base is not modelled; "
                            "use bf16", field="precision")
        _check_state_dtypes(v)
        out = cls(**v)
        # a value the caller chose (not the field's default: the widget passes every control) that does nothing
        said += [(k, f"warning: {k}={shown(getattr(out, k))} does nothing here: it {why}; ignored")
                 for k, why in inapplicable(out.__dict__).items()
                 if k in given and k in checked and checked[k] != FIELDS[k].default]
        object.__setattr__(out, "_said", tuple(said))
        return out


_FIELDS = tuple(TrainingSetup.__dataclass_fields__)

#: state tensors per parameter whose dtype ``optimizer_state_dtypes`` sets (PyTorch's
#: AdamW: exp_avg and exp_avg_sq; Lion: exp_avg; SGD with momentum: momentum_buffer).
#: bitsandbytes' 8-bit optimizers keep 8-bit blocks, Adafactor factored fp32 statistics,
#: GaLore its projected moments, plain SGD nothing: the dtypes do nothing there.
OPTIMIZER_STATE_COUNT: Dict[str, int] = {"adamw": 2, "adamw_fused": 2, "paged_adamw": 2, "lion": 1,
                                         "sgd_momentum": 1}


def _check_state_dtypes(v: Dict[str, Any]) -> None:
    """``optimizer_state_dtypes`` names one dtype for every state, or one per state: the
    optimizer's own count (AdamW two, Lion one), not any other."""
    sd, opt = v.get("optimizer_state_dtypes"), v.get("optimizer", "adamw")
    n = OPTIMIZER_STATE_COUNT.get(opt, 0)
    if sd and n and len(sd) not in (1, n):
        raise VramError(f"optimizer_state_dtypes: {opt} keeps {n} state tensor(s) per parameter; give 1 dtype "
                        f"for all or {n}, got {len(sd)} ({', '.join(sd[:6])}{', ...' if len(sd) > 6 else ''})",
                        field="optimizer_state_dtypes")


def inapplicable(v: Mapping[str, Any]) -> Dict[str, str]:
    """The setup fields that do nothing with the rest of ``v`` (a setup's values, e.g. its
    ``__dict__`` or the widget's keywords), each with what it applies to.  The estimate warns
    when the user gave one; the widget passes such a control's default and disables it."""
    method, quant, opt = v.get("method", "full"), v.get("quantization", "none"), v.get("optimizer", "adamw")
    out: Dict[str, str] = {}
    if method != "freeze":
        out["trainable_layers"] = "applies to method='freeze' (how many last layers train)"
    if method not in ("lora", "qlora"):
        for k in ("lora_r", "lora_alpha", "lora_dropout", "lora_targets"):
            out[k] = "applies to method='lora' or 'qlora'"
    if v.get("loss", "standard") != "chunked":
        out["loss_chunks"] = "applies to loss='chunked'"
    if not str(opt).startswith("galore"):
        out["galore_rank"] = "applies to the GaLore optimizers"
    if quant not in ("nf4", "fp4"):
        out["double_quant"] = "applies to 4-bit quantization (nf4, fp4)"
    if quant in ("none", None):
        out["quantized_groups"] = "applies to a quantized base (nf4, fp4, int8)"
    if v.get("optimizer_in_backward"):
        out["zero_grad_set_to_none"] = ("applies without optimizer_in_backward (each gradient is freed in its "
                                        "parameter's hook)")
    if v.get("optimizer_state_dtypes") and not OPTIMIZER_STATE_COUNT.get(opt):
        out["optimizer_state_dtypes"] = (f"sets the dtype of {', '.join(sorted(OPTIMIZER_STATE_COUNT))}'s states; "
                                         f"{opt} keeps its own")
    return out


#: other spellings accepted for choice fields (transformers' and peft's names among them)
_ALIASES: Dict[str, Dict[Any, str]] = {
    "optimizer": {"adamw_torch": "adamw", "adamw_torch_fused": "adamw_fused", "adamw8bit": "adamw_8bit",
                  "adamw_bnb_8bit": "adamw_8bit", "paged_adamw_32bit": "paged_adamw", "sgd_nesterov": "sgd_momentum"},
    "attn_implementation": {"flash_attention": "flash_attention_2", "flash": "flash_attention_2"},
    "precision": {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "mixed": "amp_bf16", "amp": "amp_bf16"},
    "method": {"full_finetune": "full", "frozen": "freeze", "layernorm": "norms"},
    "loss": {"cross_entropy": "standard", "ce": "standard", "chunked_ce": "chunked", "fused_linear": "liger",
             "flce": "liger"},
    "quantization": {"4bit": "nf4", "8bit": "int8", None: "none", "": "none"},
    "gradient_checkpointing": {"true": "full", "false": "none", "on": "full", "off": "none", True: "full",
                               False: "none"},
}


def _parse_version(text: str) -> Tuple[int, ...]:
    """'0.43.2' -> (0, 43, 2); '4.40' -> (4, 40); pre-release tails ('0.44.0rc1', '2.5.0+cu121') cut."""
    import re

    parts = []
    if not isinstance(text, str) or len(text) > 64:
        raise fail("versions", "a release number is text like '0.43.2'", text)
    for p in text.strip().lstrip("v").split(".")[:3]:
        m = re.match(r"\d+", p)
        if not m:
            break
        parts.append(int(m.group()))
        if m.end() < len(p):
            break
    if not parts:
        raise VramError(f"versions: {shown(text)} is not a release number like '0.43.2'", field="versions")
    return tuple(parts)


def _versions(value: Any) -> Tuple[Tuple[str, str], ...]:
    if isinstance(value, (str, list, tuple, dict)) and len(value) > MAX_TEXT_CHARS:
        raise fail("versions", "a few PACKAGE=VERSION pairs", value)
    if isinstance(value, str):   # "bitsandbytes=0.41.1,transformers=4.40" (command line)
        pairs = [p.split("=", 1) for p in value.split(",") if p.strip()]
        if not all(len(p) == 2 for p in pairs):
            raise VramError(f"versions: expected PACKAGE=VERSION,..., got {shown(value)}", field="versions")
        value = {k.strip(): v.strip() for k, v in pairs}
    if not isinstance(value, dict):
        if isinstance(value, (list, tuple)) and all(isinstance(x, (list, tuple)) and len(x) == 2 for x in value):
            value = dict(value)
        else:
            raise VramError(f"versions: must be a mapping like {{'bitsandbytes': '0.41.1'}}, got {shown(value)}",
                            field="versions")
    out = []
    for k, ver in value.items():
        if not isinstance(k, str) or not isinstance(ver, str):
            raise fail("versions", "package names and releases are text, like {'bitsandbytes': '0.41.1'}",
                       {k: ver})
        name = k.strip().lower().replace("_", "-")
        if name not in VERSIONED_PACKAGES:
            raise VramError(f"versions: unknown package {shown(k)}; known: {', '.join(VERSIONED_PACKAGES)}",
                            field="versions")
        _parse_version(str(ver))
        out.append((name, str(ver).strip()))
    return tuple(sorted(out))


def check_allocator_conf(value: Any) -> str:
    """The caching allocator's settings, checked and written in one canonical spelling."""
    from .allocator.caching import parse_alloc_conf

    if not isinstance(value, str) or len(value) > MAX_TEXT_CHARS:
        raise fail("allocator", "'default', 'expandable_segments' or a PYTORCH_CUDA_ALLOC_CONF string such as "
                   "'max_split_size_mb:128'", value)
    return parse_alloc_conf(value).text


def _state_dtype(x: str) -> Optional[str]:
    from .units import canonical_dtype

    try:
        return canonical_dtype(x)
    except KeyError:
        return None


def _state_dtype_list(value: Any) -> Tuple[str, ...]:
    """One dtype per optimizer state, in order: checked as names, duplicates kept (AdamW's
    ("float32", "float32") is two states; a list of five is five, and refused for AdamW)."""
    check_names("optimizer_state_dtypes", value, allowed=STATE_DTYPES, canon=_state_dtype)
    items = [x.strip() for x in value.split(",") if x.strip()] if isinstance(value, str) else list(value)
    return tuple(_state_dtype(x) for x in items)


def _choice_field(name: str, doc: str = "") -> Field:
    return Field(name, "choice", default=getattr(TrainingSetup, name), doc=doc,
                 choices=lambda: [c for c, _ in CHOICES[name]], aliases=_ALIASES.get(name, {}))


#: every setup keyword, declared once: kind, default, allowed values or range.  Adding a
#: keyword is a dataclass field above plus one declaration here (and a CHOICES entry for a
#: choice); ``from_kwargs`` checks it, the fuzz tests feed it any value, the command line has
#: it as ``--its-name`` (cli.derived_setup_flags) and the widget as a trait and a Knobs control
#: (widget/state.py SetupTraits, widget/controls.py field_control), its description the help.
FIELDS: Dict[str, Field] = {f.name: f for f in (
    _choice_field("method"),
    _choice_field("precision"),
    _choice_field("quantization"),
    Field("double_quant", "bool", True, "bitsandbytes double quantization of the 4-bit constants"),
    Field("quantized_groups", "names", DEFAULT_QUANT_GROUPS, "module groups stored in 4/8 bits",
          choices=lambda: QUANT_GROUPS),
    Field("prepare_kbit", "bool", False, "peft's prepare_model_for_kbit_training"),
    _choice_field("optimizer"),
    Field("optimizer_state_dtypes", "custom", None, "dtype of each optimizer state, in the optimizer's order",
          none="none", parse=lambda x: _state_dtype_list(x)),
    _choice_field("gradient_checkpointing"),
    _choice_field("attn_implementation"),
    Field("batch_size", "int", 1, "micro-batch size", lo=1, none="error"),
    Field("seq_len", "int", 2048, "tokens per sequence (an encoder-decoder's input, what the encoder reads)",
          lo=1, none="error"),
    Field("target_len", "int", None, "an encoder-decoder's target tokens per sample, what the decoder, the "
          "output head and the loss read (None: seq_len)", lo=1, none="none"),
    Field("grad_accum_steps", "int", 1, "micro-batches per optimizer step", lo=1, none="error"),
    Field("lora_r", "int", 16, "LoRA rank", lo=1, none="error"),
    Field("lora_alpha", "number", 32.0, "LoRA alpha", lo=0, lo_open=True, none="error"),
    Field("lora_dropout", "number", 0.0, "LoRA dropout probability", lo=0, hi=1, hi_open=True, none="error"),
    Field("lora_targets", "names", None, "modules LoRA adapts (or 'all-linear')", none="none",
          empty="name at least one module, or 'all-linear'"),
    Field("trainable_layers", "int", None, "last layers trained by method='freeze'", lo=1, none="none"),
    _choice_field("loss"),
    # every chunk is written into the plan: the bound (MAX_LOSS_CHUNKS) bounds the plan too
    Field("loss_chunks", "int", 8, "chunks of the chunked cross-entropy", lo=1, hi=MAX_LOSS_CHUNKS, none="default"),
    Field("activation_offloading", "bool", False, "saved activations offloaded to the CPU"),
    Field("optimizer_in_backward", "bool", False, "each parameter stepped as its gradient is ready"),
    _choice_field("lora_variant"),
    Field("modules_to_save", "names", (), "modules peft trains in full beside the adapters",
          choices=lambda: SAVE_MODULES, min_items=0),
    Field("galore_rank", "int", 128, "GaLore projection rank", lo=1),
    Field("packing", "bool", False, "sequences packed without padding"),
    Field("compile", "bool", False, "torch.compile"),
    Field("versions", "custom", (), "releases of the libraries whose mechanisms changed", parse=_versions),
    _choice_field("stack"),
    Field("tf32", "bool", False, "TF32 matmuls for fp32 (torch.backends.cuda.matmul.allow_tf32)"),
    Field("images_per_sample", "int", 0, "images per sample a vision-language model's vision tower encodes", lo=0),
    Field("image_patches", "int", 0, "patches per image (0: the vision tower's own fixed count)", lo=0),
    _choice_field("backend", "analytic (modelled families), trace (a traced step) or auto (analytic where "
                             "modelled, else traced)"),
    Field("allocator", "custom", "default", "caching allocator: 'default', 'expandable_segments' or a "
          "PYTORCH_CUDA_ALLOC_CONF string", parse=check_allocator_conf),
    Field("zero_grad_set_to_none", "bool", True, "zero_grad(set_to_none=True) frees the gradients after "
          "each step; off: they are zeroed in place and stay allocated between steps"),
)}
assert set(FIELDS) == set(_FIELDS), "every TrainingSetup field has one declaration in FIELDS"


# helpers kept for callers that check one value the old way
def check_setup_choice(name: str, value: Any) -> str:
    """One setup field checked against its CHOICES (aliases allowed): the canonical value."""
    return check_choice(name, value, [c for c, _ in CHOICES[name]], _ALIASES.get(name, {}))


def _posint(name: str, value: Any) -> int:
    return check_int(name, value, lo=1)


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
