"""The notebook widget: controls, summary and treemaps, recomputed on every change.

``Calculator`` is an anywidget.  Its input traits carry the same names as the keyword
arguments of :func:`vramwidget.estimate` (plus ``config_json`` for a pasted config and
``gpu``); its output traits hold what the frontend draws.  Data flows one way: a user
changes a control, the frontend sets that trait, Python estimates, lays out the treemaps
and sets the output traits; the frontend only draws.

Three kinds of estimate, chosen by the traits:

* training on one GPU: :func:`vramwidget.estimate` (the default);
* training on several GPUs, as soon as a parallel trait (``num_gpus``, ``strategy``,
  ``tensor_parallel``, ``pipeline_parallel``, ``offload_optimizer``, ``offload_params``)
  leaves its default: :func:`vramwidget.parallel.estimate_parallel`, and the widget shows
  the worst GPU's per-GPU estimate;
* ``mode = "inference"``: :func:`vramwidget.inference.estimate_inference`.

With a GPU chosen, every scenario of the comparison carries a fits / does-not-fit verdict.
When the setup does not fit, the changes that would make it fit
(:func:`vramwidget.fit.suggestions`, tens of milliseconds) are computed *after* the update,
off the path that redraws the charts: on the kernel's event loop shortly after the last
change (or a timer thread where no loop runs), so dragging a control stays fast.

The frontend (``static/widget.js``, built from ``js/src/widget.js``) embeds each chart spec
once and afterwards swaps only its rows, so an update moves a few kilobytes.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import pathlib
import threading
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple

import anywidget
import traitlets as t

from . import charts, gpus
from .errors import VramError
from .result import Estimate
from .treemap import (
    KNOWN_COMPONENTS,
    UnitBox,
    comparison_rows,
    component_kind,
    fmt_gib,
    layout_rows,
    total_bytes,
    unit_box,
)
from .units import GIB

_STATIC = pathlib.Path(__file__).parent / "static"

DEFAULT_MODEL = "llama-3.2-1b"

#: chart sizes in pixels (the treemap layout is computed for exactly these)
DETAIL_SIZE = (640.0, 340.0)
COMPARISON_SIZE = (640.0, 206.0)
PHASE_SIZE = (640.0, 170.0)
#: height of the comparison's caption band: name and total, plus a verdict line with a GPU
COMPARISON_HEADER = 34.0
COMPARISON_HEADER_VERDICT = 48.0

#: the two kinds of question the widget answers
MODES: Tuple[str, ...] = ("training", "inference")

#: the scenario comparison: name -> what it changes in the user's setup
SCENARIOS: Tuple[Tuple[str, Dict[str, Any]], ...] = (
    ("FP32 full", dict(method="full", precision="fp32", quantization="none")),
    ("BF16 mixed", dict(method="full", precision="amp_bf16", quantization="none")),
    ("pure BF16", dict(method="full", precision="bf16", quantization="none")),
    ("4-bit QLoRA", dict(method="qlora", precision="bf16", quantization="nf4",
                         double_quant=True)),
)
YOUR_SETUP = "your setup"

#: the comparison in inference mode: the same context and batch in three weight formats
INFERENCE_SCENARIOS: Tuple[Tuple[str, Dict[str, Any]], ...] = (
    ("BF16", dict(weights="bf16")),
    ("8-bit (int8)", dict(weights="int8")),
    ("4-bit (NF4)", dict(weights="nf4")),
    ("4-bit (AWQ)", dict(weights="awq-4bit")),
)

#: choices shown until ``vramwidget.training.CHOICES`` provides them
_FALLBACK_CHOICES: Dict[str, List[Tuple[str, str]]] = {
    "method": [("full", "full fine-tuning"), ("lora", "LoRA"), ("qlora", "QLoRA (4-bit base)"),
               ("freeze", "freeze all but the last layers")],
    "precision": [("fp32", "FP32"), ("amp_bf16", "BF16 mixed (autocast, fp32 weights)"),
                  ("amp_fp16", "FP16 mixed (autocast, fp32 weights)"), ("bf16", "pure BF16"),
                  ("fp16", "pure FP16"), ("bf16_fp32_states", "BF16 weights, FP32 optimizer states"),
                  ("fp8", "FP8 matmuls")],
    "quantization": [("none", "none (16/32-bit base)"), ("nf4", "4-bit NF4"), ("fp4", "4-bit FP4"),
                     ("int8", "8-bit LLM.int8")],
    "quantized_groups": [("attn_qk", "attention Q, K"), ("attn_vo", "attention V, O"),
                         ("mlp", "MLP / FFN"), ("embedding", "embeddings"), ("lm_head", "output head")],
    "optimizer": [("adamw", "AdamW (foreach)"), ("adamw_fused", "AdamW (fused)"),
                  ("adamw_8bit", "AdamW 8-bit"), ("paged_adamw", "paged AdamW 32-bit"),
                  ("paged_adamw_8bit", "paged AdamW 8-bit"),
                  ("adafactor", "Adafactor"), ("sgd", "SGD"), ("sgd_momentum", "SGD + momentum"),
                  ("lion", "Lion")],
    "gradient_checkpointing": [("none", "none"), ("selective", "selective (attention)"),
                               ("full", "full (every layer)")],
    "attn_implementation": [("sdpa", "SDPA"), ("eager", "eager (materialises scores)"),
                            ("flash_attention_2", "FlashAttention 2")],
}

#: the keyword arguments of estimate() that the widget exposes, in order
ESTIMATE_INPUTS: Tuple[str, ...] = (
    "model", "method", "precision", "quantization", "double_quant", "quantized_groups",
    "prepare_kbit", "optimizer", "gradient_checkpointing", "attn_implementation",
    "batch_size", "seq_len", "grad_accum_steps", "lora_r", "lora_alpha", "lora_dropout",
    "lora_targets", "trainable_layers",
)
#: the keyword arguments of estimate_parallel() beyond the setup, with their defaults: when
#: every one is at its default the widget runs the single-GPU estimate
PARALLEL_DEFAULTS: Dict[str, Any] = {
    "strategy": "none", "num_gpus": 1, "tensor_parallel": 1, "pipeline_parallel": 1,
    "offload_optimizer": False, "offload_params": False,
}
PARALLEL_INPUTS: Tuple[str, ...] = tuple(PARALLEL_DEFAULTS)
#: the keyword arguments of estimate_inference() the widget exposes (gpu too)
INFERENCE_KEYWORDS: Tuple[str, ...] = (
    "weights", "kv_cache_dtype", "batch_size", "context_len", "attn_implementation",
    "gpu_memory_utilization",
)
#: input traits used only in inference mode
INFERENCE_INPUTS: Tuple[str, ...] = ("weights", "kv_cache_dtype", "context_len", "gpu_memory_utilization")
#: every input trait (what ``Calculator(...)`` accepts as keyword arguments)
INPUTS: Tuple[str, ...] = (ESTIMATE_INPUTS + ("config_json", "gpu", "mode") + PARALLEL_INPUTS
                           + INFERENCE_INPUTS)
#: input traits used only in training mode
TRAINING_ONLY: Tuple[str, ...] = tuple(
    k for k in ESTIMATE_INPUTS + PARALLEL_INPUTS if k not in ("model", "batch_size", "attn_implementation"))

#: short names of the parallel strategies for the drop-down (the long ones are parallel.STRATEGIES)
_STRATEGY_LABELS: Dict[str, str] = {
    "none": "none (one replica)", "ddp": "DDP", "zero0": "DeepSpeed ZeRO-0", "zero1": "DeepSpeed ZeRO-1",
    "zero2": "DeepSpeed ZeRO-2", "zero3": "DeepSpeed ZeRO-3", "fsdp_full_shard": "FSDP full shard",
    "fsdp_shard_grad_op": "FSDP shard grad + optimizer", "fsdp_hybrid": "FSDP hybrid shard",
    "megatron": "Megatron-LM DDP", "megatron_distopt": "Megatron-LM distributed optimizer",
}
_OFFLOAD_OPTIMIZER = ("zero1", "zero2", "zero3")
_OFFLOAD_PARAMS = ("zero3", "fsdp_full_shard", "fsdp_shard_grad_op", "fsdp_hybrid")
_KV_LABELS = {"bf16": "bf16", "fp16": "fp16", "fp32": "fp32", "fp8": "fp8 (E4M3, 1 byte)"}

_FOUR_BIT = ("nf4", "fp4")
_LORA_METHODS = ("lora", "qlora")


def _choices() -> Dict[str, List[Tuple[str, str]]]:
    try:
        from .training import CHOICES  # type: ignore[attr-defined]
    except ImportError:
        return dict(_FALLBACK_CHOICES)
    out = dict(_FALLBACK_CHOICES)
    out.update({k: [tuple(x) for x in v] for k, v in CHOICES.items()})
    return out


def _estimate_fn():
    """vramwidget.estimate.estimate, imported on first use."""
    from .estimate import estimate

    return estimate


def _run(arch: Any, kind: str, kw: Dict[str, Any]) -> Any:
    """One estimate: ``kind`` is "train" (estimate), "par" (estimate_parallel: a
    ParallelEstimate) or "infer" (estimate_inference)."""
    if kind == "train":
        return _estimate_fn()(arch, **kw)
    if kind == "par":
        from .parallel import estimate_parallel

        return estimate_parallel(arch, **kw)
    from .inference import estimate_inference

    return estimate_inference(arch, **kw)


def _shown(result: Any) -> Estimate:
    """The Estimate the charts draw: a parallel run's worst GPU, else the estimate itself."""
    return getattr(result, "per_gpu", result)


# ---------------------------------------------------------------------------------------
# Number formats: the bits of each storage dtype (the seeds' FP32/BF16/FP16 comparison)
# ---------------------------------------------------------------------------------------

def _float_format(name: str, exp_bits: int, man_bits: int, *, max_value: Optional[float] = None,
                  note: str = "") -> Dict[str, Any]:
    bias = 2 ** (exp_bits - 1) - 1
    if max_value is None:  # IEEE-style: the top exponent is reserved for inf/nan
        max_value = (2 - 2.0 ** -man_bits) * 2.0 ** bias
    min_normal = 2.0 ** (1 - bias)
    return {
        "name": name, "bits": 1 + exp_bits + man_bits, "bytes": (1 + exp_bits + man_bits) / 8,
        "sign": 1, "exponent": exp_bits, "mantissa": man_bits,
        "max": max_value, "min_normal": min_normal,
        "min_subnormal": min_normal * 2.0 ** -man_bits,
        "epsilon": 2.0 ** -man_bits,
        "decimal_digits": round(math.log10(2.0 ** (man_bits + 1)), 1),
        "note": note,
    }


def number_formats() -> List[Dict[str, Any]]:
    """FP32, BF16, FP16, FP8 (E4M3, E5M2), INT8 and NF4: bits, range and precision.

    ``epsilon`` is the gap between 1 and the next number (2^-mantissa); ``max`` and
    ``min_normal`` bound the range; E4M3 follows the OCP "fn" variant (no inf, max 448).
    """
    return [
        _float_format("FP32", 8, 23, note="full precision; master weights and Adam moments in mixed precision"),
        _float_format("BF16", 8, 7, note="FP32's range with 8 bits of precision: no loss scaling needed"),
        _float_format("FP16", 5, 10, note="more precision than BF16 but max 65504: needs loss scaling"),
        _float_format("FP8 E4M3", 4, 3, max_value=448.0, note="forward activations/weights in FP8 training"),
        _float_format("FP8 E5M2", 5, 2, note="gradients in FP8 training (wider range)"),
        {"name": "INT8", "bits": 8, "bytes": 1, "sign": 1, "exponent": 0, "mantissa": 7,
         "max": 127.0, "min_normal": 1.0, "min_subnormal": 1.0, "epsilon": 1.0,
         "decimal_digits": 2.1,
         "note": "integers -128..127 times a per-row/block scale (LLM.int8, 8-bit optimizers)"},
        {"name": "NF4", "bits": 4, "bytes": 0.5, "sign": 1, "exponent": 0, "mantissa": 3,
         "max": 1.0, "min_normal": 0.0796, "min_subnormal": 0.0796, "epsilon": 0.0796,
         "decimal_digits": 1.2,
         "note": "16 levels at normal-distribution quantiles in [-1, 1] times a per-block (64) absmax; "
                 "QLoRA's storage format, dequantized to BF16 for each matmul"},
    ]


# ---------------------------------------------------------------------------------------

def _doc(text: str) -> Dict[str, Any]:
    return {"help": text}


class Calculator(anywidget.AnyWidget):
    """GPU memory of one training step (on one GPU or per GPU of a parallel run) or of
    inference, as a live notebook widget.

    >>> calc = Calculator("llama-3.1-8b", method="qlora", batch_size=4)   # doctest: +SKIP
    >>> calc                                # the widget: controls, treemaps, summary
    >>> calc.estimate.peak_gib              # the current numbers, without the UI
    >>> calc.chart(); calc.to_dataframe()
    >>> calc.gpu = "RTX 4090"; calc.summary["fits"], calc.summary["max_batch_size"]
    >>> calc.fit_suggestions()              # what to change when it does not fit
    >>> calc.num_gpus = 8; calc.strategy = "zero3"     # per-GPU estimate (the worst GPU)
    >>> calc.mode = "inference"; calc.context_len = 32768

    Keyword arguments are the input traits (the names of the keyword arguments of
    ``estimate()``, ``estimate_parallel()`` and ``estimate_inference()`` plus ``config_json``,
    ``gpu`` and ``mode``); an unknown one raises ``TypeError``.
    """

    _esm = _STATIC / "widget.js"
    _css = _STATIC / "widget.css"

    # -- inputs: the same names as estimate()'s keyword arguments ------------------------
    model = t.Unicode(DEFAULT_MODEL, **_doc(
        "Preset name ('llama-3.1-8b'), Hub id ('org/name'), config.json path or a parameter "
        "count ('7B'). Ignored while config_json holds a pasted config.")).tag(sync=True)
    config_json = t.Unicode("", **_doc(
        "Text of a pasted or uploaded config.json; when not empty it is the model.")).tag(sync=True)
    method = t.Unicode("full", **_doc("full | lora | qlora | freeze")).tag(sync=True)
    precision = t.Unicode("bf16", **_doc(
        "fp32 | amp_bf16 | amp_fp16 | bf16 | fp16 | bf16_fp32_states | fp8")).tag(sync=True)
    quantization = t.Unicode("none", **_doc(
        "Storage of the frozen base weights: none | nf4 | fp4 | int8 (qlora implies nf4).")).tag(sync=True)
    double_quant = t.Bool(True, **_doc(
        "4-bit double quantization: quantize the quantization constants too.")).tag(sync=True)
    quantized_groups = t.List(t.Unicode(), default_value=["attn_qk", "attn_vo", "mlp"], **_doc(
        "Which module groups are stored quantized: attn_qk, attn_vo, mlp, embedding.")).tag(sync=True)
    prepare_kbit = t.Bool(False, **_doc(
        "peft's prepare_model_for_kbit_training: upcasts non-quantized parameters to fp32.")).tag(sync=True)
    optimizer = t.Unicode("adamw", **_doc(
        "adamw | adamw_fused | adamw_8bit | paged_adamw_8bit | adafactor | sgd | sgd_momentum | lion"
    )).tag(sync=True)
    gradient_checkpointing = t.Unicode("none", **_doc("none | selective | full")).tag(sync=True)
    attn_implementation = t.Unicode("sdpa", **_doc("sdpa | eager | flash_attention_2")).tag(sync=True)
    batch_size = t.Int(1, **_doc("Micro-batch size per GPU (sequences per forward pass).")).tag(sync=True)
    seq_len = t.Int(2048, **_doc("Tokens per sequence.")).tag(sync=True)
    grad_accum_steps = t.Int(1, **_doc(
        "Gradient accumulation steps (memory of one micro-batch; more steps, same peak).")).tag(sync=True)
    lora_r = t.Int(16, **_doc("LoRA rank r.")).tag(sync=True)
    lora_alpha = t.Float(32.0, **_doc("LoRA alpha (scales the update; no memory effect).")).tag(sync=True)
    lora_dropout = t.Float(0.0, **_doc(
        "LoRA dropout; above 0 it keeps a dropout mask/copy of each adapter input.")).tag(sync=True)
    lora_targets = t.List(t.Unicode(), default_value=None, allow_none=True, **_doc(
        "Linear modules LoRA adapts (e.g. ['q_proj', 'v_proj']); None = every linear layer "
        "of the blocks.")).tag(sync=True)
    trainable_layers = t.Int(None, allow_none=True, **_doc(
        "For method='freeze': how many of the last layers train.")).tag(sync=True)
    gpu = t.Unicode("", **_doc(
        "GPU to fit on (a name from vramwidget.gpus), '' for none; with several GPUs, the kind "
        "of every one of them.")).tag(sync=True)
    mode = t.Unicode("training", **_doc(
        "training | inference: what the estimate is of (one training step, or generate() / "
        "serving with the inference settings).")).tag(sync=True)

    # -- multi-GPU training: the names of estimate_parallel()'s keyword arguments ----------
    num_gpus = t.Int(1, **_doc(
        "GPUs of the run (data parallel = num_gpus / (tensor_parallel x pipeline_parallel)); "
        "more than one replica with strategy 'none' makes the strategy 'ddp'.")).tag(sync=True)
    strategy = t.Unicode("none", **_doc(
        "How data-parallel replicas store the model states: none | ddp | zero0 | zero1 | zero2 | "
        "zero3 | fsdp_full_shard | fsdp_shard_grad_op | fsdp_hybrid | megatron | megatron_distopt "
        "(vramwidget.parallel.STRATEGIES).")).tag(sync=True)
    tensor_parallel = t.Int(1, **_doc(
        "Tensor-parallel size: attention heads, MLP width and vocabulary split over this many "
        "GPUs (must divide the heads).")).tag(sync=True)
    pipeline_parallel = t.Int(1, **_doc(
        "Pipeline stages (1F1B schedule): the layers split into this many stages; the worst "
        "stage is shown and every stage listed.")).tag(sync=True)
    offload_optimizer = t.Bool(False, **_doc(
        "DeepSpeed ZeRO-Offload: optimizer states, fp32 master weights and gradients in CPU "
        "memory (strategy zero1, zero2 or zero3).")).tag(sync=True)
    offload_params = t.Bool(False, **_doc(
        "Parameters in CPU memory: ZeRO-3 parameter offload or FSDP CPUOffload (strategy zero3 "
        "or fsdp_*).")).tag(sync=True)

    # -- inference: the names of estimate_inference()'s keyword arguments ------------------
    weights = t.Unicode("bf16", **_doc(
        "Inference: storage format of the weights: bf16 | fp16 | fp32 | fp8 | int8 | nf4 | fp4 | "
        "gptq-4bit | gptq-8bit | awq-4bit | gguf-q4_k_m ... (vramwidget.inference.WEIGHT_FORMATS)."
    )).tag(sync=True)
    kv_cache_dtype = t.Unicode("auto", **_doc(
        "Inference: dtype of the KV cache: auto (the compute dtype) | bf16 | fp16 | fp32 | fp8."
    )).tag(sync=True)
    context_len = t.Int(4096, **_doc(
        "Inference: tokens per sequence at the end of generation (prompt + generated); the "
        "whole context is taken as the prompt (the worst prefill).")).tag(sync=True)
    gpu_memory_utilization = t.Float(None, allow_none=True, **_doc(
        "Inference: None for generate(); a fraction in (0, 1] (e.g. 0.9) for a vLLM-style server "
        "whose paged KV cache fills that share of the GPU (needs gpu).")).tag(sync=True)

    # -- outputs: set by Python, drawn by the frontend ------------------------------------
    specs = t.Dict(**_doc(
        "Vega-Lite spec of each chart (detail, comparison, phases), set once; each reads the "
        "named dataset of the same name.")).tag(sync=True)
    rows = t.Dict(**_doc("Dataset name -> list of row dicts, replaced on every update.")).tag(sync=True)
    summary = t.Dict(**_doc(
        "Peak, phase, device total, GPU fit, notes and warnings of the current estimate.")).tag(sync=True)
    table = t.List(**_doc("One row per component: name, colour, GiB, bytes, share.")).tag(sync=True)
    disabled = t.Dict(**_doc(
        "Control (trait name) -> why it does not apply now; absent = enabled.")).tag(sync=True)
    options = t.Dict(**_doc(
        "Control -> list of [value, label] choices; also presets, gpus and lora_targets.")).tag(sync=True)
    formats = t.List(**_doc("Number formats: bits, range and precision (FP32 ... NF4).")).tag(sync=True)
    error = t.Unicode("", **_doc(
        "Why the current input cannot be estimated ('' when it can); the charts keep the "
        "last valid estimate.")).tag(sync=True)
    error_field = t.Unicode("", **_doc("The control the error is about, if known.")).tag(sync=True)
    suggestions = t.List(**_doc(
        "When the setup does not fit the GPU (training): fit.suggestions as dicts (title, changes, "
        "saved_gib, device_total_gib, fits, cost, ...), ranked; [] otherwise.")).tag(sync=True)
    suggestions_status = t.Unicode("", **_doc(
        "'' (fits, no GPU or inference mode), 'computing' (the setup does not fit and its "
        "suggestions are being worked out after the update), 'ready', or 'failed: why'."
    )).tag(sync=True)

    #: seconds after the last change before suggestions are worked out; None = at once,
    #: inside the update (scripts and tests that want them synchronously)
    suggestions_delay: Optional[float] = 0.15

    def __init__(self, model: Any = DEFAULT_MODEL, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - set(INPUTS) - {"layout"})
        if unknown:
            raise TypeError(
                f"Calculator() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}; "
                f"accepted: {', '.join(INPUTS)}")
        if not isinstance(model, str):  # a dict/Architecture/path: show it as config text
            model, kwargs = self._model_from_object(model, kwargs)
        self._ready = False
        self._busy = False
        self._lock = threading.RLock()
        self._estimate: Optional[Estimate] = None
        self._result: Any = None          # the Estimate, ParallelEstimate or InferenceEstimate
        self._scenario_kw: List[Tuple[str, str, Dict[str, Any]]] = []
        self._cache: "OrderedDict[Tuple, Any]" = OrderedDict()
        self._boxes: "OrderedDict[Tuple, UnitBox]" = OrderedDict()
        self._box_fits: Dict[Tuple, Optional[bool]] = {}
        self._answers: "OrderedDict[Tuple, Any]" = OrderedDict()   # max batch, longest context
        self._sugg_cache: "OrderedDict[Tuple, List[Any]]" = OrderedDict()
        self._sugg_token = 0
        self._sugg_job: Optional[Tuple[Tuple, Any, Dict[str, Any]]] = None
        self._pending: Any = None
        self._arch_key: Optional[Tuple[str, str]] = None
        self._arch: Any = None
        super().__init__(model=model, **kwargs)
        self._specs_cache: Dict[str, Dict[str, Any]] = {}
        self.specs = self._specs_for(self.mode)
        self.formats = number_formats()
        # the links, for what the keywords set (observers are off during __init__)
        try:
            self._resolve_model()
        except Exception:
            pass  # reported by the first _update
        self._busy = True
        try:
            if "method" in kwargs and "quantization" not in kwargs:
                self._link({"name": "method", "old": "full", "new": self.method})
            elif "quantization" in kwargs and "method" not in kwargs:
                self._link({"name": "quantization", "old": "none", "new": self.quantization})
            elif self.method == "freeze" and self.trainable_layers is None:
                self._link({"name": "method", "old": "full", "new": "freeze"})
            if "num_gpus" in kwargs and "strategy" not in kwargs:
                self._link({"name": "num_gpus", "old": 1, "new": self.num_gpus})
            self._link(None)
        finally:
            self._busy = False
        self._ready = True
        self._update()
        if self.error:  # nothing valid to show yet: say so in Python, where it was typed
            raise VramError(self.error, field=self.error_field or None)

    @staticmethod
    def _model_from_object(model: Any, kwargs: Dict[str, Any]):
        import json
        import os

        if isinstance(model, os.PathLike):
            return os.fspath(model), kwargs
        if isinstance(model, dict):
            kwargs = dict(kwargs, config_json=json.dumps(model, indent=1))
            return model.get("_name_or_path") or model.get("model_type") or "custom", kwargs
        cfg = getattr(model, "config", None)  # an Architecture
        if isinstance(cfg, dict) and cfg.get("model_type"):
            kwargs = dict(kwargs, config_json=json.dumps(cfg, indent=1))
            return getattr(model, "name", "custom"), kwargs
        raise TypeError(f"Calculator(model=...): expected a preset name, Hub id, config.json path or "
                        f"dict, got {type(model).__name__}")

    # -- public API ------------------------------------------------------------------------
    @property
    def estimate(self) -> Estimate:
        """The current (last valid) estimate: one GPU's training step; with a parallel
        layout the worst GPU's per-GPU estimate; in inference mode the InferenceEstimate."""
        assert self._estimate is not None
        return self._estimate

    @property
    def parallel_estimate(self) -> Any:
        """The :class:`~vramwidget.parallel.ParallelEstimate` behind :attr:`estimate` (every
        stage, CPU offload), or None on the single-GPU and inference paths."""
        from .parallel import ParallelEstimate

        return self._result if isinstance(self._result, ParallelEstimate) else None

    @property
    def scenarios(self) -> List[Tuple[str, Estimate]]:
        """(name, Estimate) of the comparison: your setup, then FP32 full, BF16 mixed, pure
        BF16 and 4-bit QLoRA with your batch, sequence length, checkpointing and parallel
        layout (per GPU) -- or, in inference mode, BF16, int8, NF4 and AWQ weights at your
        context and batch (estimated anew: the widget keeps only their layouts)."""
        arch = self._resolve_model()
        out = []
        for name, kind, kw in self._scenario_kw:
            try:
                out.append((name, _shown(self._cached_estimate(arch, kind, kw))))
            except VramError:
                pass
        return out

    def chart(self, **kw: Any):
        """An Altair treemap of the current estimate (works and saves without the widget)."""
        return charts.detail_chart(self.estimate, **kw)

    def to_dataframe(self, phase: Optional[str] = None):
        """The current estimate's leaves as a pandas DataFrame."""
        return self.estimate.to_dataframe(phase)

    def setup(self) -> Dict[str, Any]:
        """The keyword arguments estimate() gets for the current traits (training)."""
        kw = {name: getattr(self, name) for name in ESTIMATE_INPUTS}
        kw["quantized_groups"] = tuple(kw["quantized_groups"])
        if kw["lora_targets"] is not None:
            kw["lora_targets"] = tuple(kw["lora_targets"])
        return kw

    def parallel_setup(self) -> Dict[str, Any]:
        """The parallel keyword arguments of estimate_parallel(); {} while every one is at its
        default (then the single-GPU estimate is shown)."""
        par = {k: getattr(self, k) for k in PARALLEL_INPUTS}
        return {} if par == PARALLEL_DEFAULTS else par

    def inference_setup(self) -> Dict[str, Any]:
        """The keyword arguments estimate_inference() gets in inference mode (``gpu`` when a
        known GPU is chosen; ``gpu_memory_utilization`` when set)."""
        kw = {k: getattr(self, k) for k in INFERENCE_KEYWORDS}
        if kw["gpu_memory_utilization"] is None:
            del kw["gpu_memory_utilization"]
        gpu = self._gpu_or_none()
        if gpu is not None:
            kw["gpu"] = gpu.name
        return kw

    def fit_suggestions(self) -> List[Any]:
        """:func:`vramwidget.fit.suggestions` for the current training setup on the chosen
        GPU (every GPU of a parallel run is that kind), computed now if not already: ranked
        :class:`~vramwidget.fit.Suggestion` objects, [] when it fits, there is no GPU or the
        mode is inference.  Also sets the ``suggestions`` trait."""
        with self._lock:
            job = self._sugg_job
            token = self._sugg_token
        if job is None:
            return []
        items = self._suggestions_for(job)
        self._publish_suggestions(token, items, "ready")
        return list(items)

    def close(self) -> None:
        self._cancel_pending()
        super().close()

    # -- the one observer --------------------------------------------------------------------
    @t.observe(*INPUTS)
    def _on_input(self, change: Dict[str, Any]) -> None:
        if not self._ready or self._busy:
            return
        with self._lock:
            self._busy = True
            try:
                self._link(change)
            finally:
                self._busy = False
            self._update()

    def _link(self, change: Optional[Dict[str, Any]]) -> None:
        """Linked controls (the rules of TrainingSetup): a choice that implies another sets it.

        A quantized base trains only through adapters, so quantization != "none" means
        QLoRA; leaving QLoRA drops the quantization; "freeze" needs a layer count.
        """
        name = change["name"] if change else None
        new = change["new"] if change else None
        if name == "method":
            if new == "qlora" and self.quantization == "none":
                self.quantization = "nf4"
            elif new != "qlora" and self.quantization != "none":
                self.quantization = "none"
            if new == "freeze" and self.trainable_layers is None:
                layers = getattr(self._arch, "num_layers", 8) or 8
                self.trainable_layers = max(1, layers // 4)
        elif name == "quantization":
            if new == "none" and self.method == "qlora":
                self.method = "lora"
            elif new != "none" and self.method in ("lora", "full", "freeze"):
                self.method = "qlora"
        elif name in ("num_gpus", "tensor_parallel", "pipeline_parallel"):
            # several data-parallel replicas need a strategy: DDP unless one is chosen
            mp = max(self.tensor_parallel, 1) * max(self.pipeline_parallel, 1)
            if self.strategy == "none" and self.num_gpus > mp and self.num_gpus % mp == 0:
                self.strategy = "ddp"
        elif name == "strategy":
            # offload that the new strategy cannot do is dropped
            if self.offload_optimizer and new not in _OFFLOAD_OPTIMIZER:
                self.offload_optimizer = False
            if self.offload_params and new not in _OFFLOAD_PARAMS:
                self.offload_params = False
        if self.quantization == "none" and self.prepare_kbit:
            self.prepare_kbit = False
        if name in ("model", "config_json"):
            self._arch_key = None
        self.disabled = self._disabled()

    def _disabled(self) -> Dict[str, str]:
        off: Dict[str, str] = {}
        if self.config_json.strip():
            off["model"] = "a pasted config.json is the model: clear it to use a preset or Hub id"
        if self.quantization == "none":
            why = "applies only to a quantized base (choose nf4, fp4 or int8)"
            off["quantized_groups"] = why
            off["prepare_kbit"] = why
        if self.quantization not in _FOUR_BIT:
            off["double_quant"] = "applies only to 4-bit quantization (nf4 or fp4)"
        if self.method not in _LORA_METHODS:
            why = "LoRA settings apply to method lora or qlora"
            for k in ("lora_r", "lora_alpha", "lora_dropout", "lora_targets"):
                off[k] = why
        if self.method != "freeze":
            off["trainable_layers"] = "applies only to method freeze (train the last N layers)"
        if self.strategy not in _OFFLOAD_OPTIMIZER:
            off["offload_optimizer"] = "needs DeepSpeed ZeRO-1, 2 or 3 (choose strategy zero1, zero2 or zero3)"
        if self.strategy not in _OFFLOAD_PARAMS:
            off["offload_params"] = "needs ZeRO-3 or FSDP (choose strategy zero3 or fsdp_*)"
        if not self.gpu.strip():
            off["gpu_memory_utilization"] = "a serving budget is a share of a GPU: choose the GPU first"
        if self.mode == "inference":
            for k in TRAINING_ONLY:
                off[k] = "training only (the mode is inference)"
        else:
            for k in INFERENCE_INPUTS:
                off[k] = "inference only (switch the mode to inference)"
        return off

    # -- recompute -------------------------------------------------------------------------
    def _resolve_model(self) -> Any:
        """The Architecture for the model or pasted config (cached while they stay)."""
        from . import architecture

        key = ("config", hashlib.sha1(self.config_json.encode()).hexdigest()) if self.config_json.strip() \
            else ("model", self.model.strip())
        if key != self._arch_key:
            if key[0] == "config":
                cfg = architecture.parse_config_text(self.config_json, source="pasted config.json")
                name = cfg.get("_name_or_path") or f"pasted config ({cfg.get('model_type', '?')})"
                self._arch = architecture.from_config(cfg, name=str(name))
            else:
                self._arch = architecture.load(self.model)
            self._arch_key = key
        return self._arch

    def _key(self, kind: str, kw: Dict[str, Any]) -> Tuple:
        return (self._arch_key, kind, tuple(sorted((k, v) for k, v in kw.items() if k != "model")))

    def _cached_estimate(self, arch: Any, kind: str, kw: Dict[str, Any]) -> Any:
        """The estimate of one setup (``kind``: see :func:`_run`); the last few are kept
        (toggling back is free)."""
        key = self._key(kind, kw)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        est = _run(arch, kind, {k: v for k, v in kw.items() if k != "model"})
        self._cache[key] = est
        if len(self._cache) > 8:
            self._cache.popitem(last=False)
        return est

    def _scenario_box(self, arch: Any, name: str, kind: str, kw: Dict[str, Any]
                      ) -> Tuple[UnitBox, Optional[bool]]:
        """A comparison scenario as a unit-square layout, and the estimate's own fits flag
        where it has one (a serving budget); only these are kept, not the estimate (a
        scenario equal to the user's setup reuses its estimate)."""
        key = self._key(kind, kw)
        hit = self._boxes.get(key)
        if hit is not None:
            self._boxes.move_to_end(key)
            return hit, self._box_fits.get(key)
        est = self._cache.get(key) or _run(arch, kind, {k: v for k, v in kw.items() if k != "model"})
        box = unit_box(_shown(est), name)
        serving = getattr(est, "serving", None)
        self._boxes[key] = box
        self._box_fits[key] = bool(est.fits) if serving else None
        if len(self._boxes) > 64:
            old, _ = self._boxes.popitem(last=False)
            self._box_fits.pop(old, None)
        return box, self._box_fits[key]

    def _scenario_setups(self, kw: Dict[str, Any], par: Optional[Dict[str, Any]] = None
                         ) -> List[Tuple[str, Dict[str, Any]]]:
        """The comparison's setups: the user's batch, sequence, checkpointing, attention and
        parallel layout with each scenario's method and precision (AdamW, default
        quantization settings).

        Built from the user's own keyword set, so a scenario equal to the user's setup has
        the same cache key and is not estimated twice.
        """
        out = []
        for name, change in SCENARIOS:
            s = dict(kw, **change, optimizer="adamw", prepare_kbit=False, trainable_layers=None)
            if change["method"] != "qlora":
                s.update(quantization="none", double_quant=True,
                         quantized_groups=("attn_qk", "attn_vo", "mlp"))
            if change["method"] not in _LORA_METHODS:  # LoRA fields do not matter: keep defaults
                s.update(lora_r=16, lora_alpha=32.0, lora_dropout=0.0, lora_targets=None)
            if s["precision"] == "fp32" and s["attn_implementation"] == "flash_attention_2":
                s["attn_implementation"] = "sdpa"  # flash attention has no fp32 kernel
            if par:
                s.update(par)
            out.append((name, s))
        return out

    def _update(self) -> None:
        """Estimate the setup and the scenarios; set every output trait at once.

        Nothing raises out of here (it runs in the comm handler when a frontend changes a
        trait): a failure sets ``error`` and leaves the last valid outputs in place.
        """
        with self._lock:
            try:
                outputs = self._compute()
            except VramError as e:
                self._set_error(str(e), getattr(e, "field", None) or "")
                return
            except Exception as e:  # a bug, not bad input: still never raise into the frontend
                self._set_error(f"internal error ({type(e).__name__}: {e}); please report it", "")
                return
            result, scenario_kw, traits, job = outputs
            self._result = result
            self._estimate = _shown(result)
            self._scenario_kw = scenario_kw
            # suggestions: from the cache, or worked out after this update (off the hot path)
            self._cancel_pending()
            self._sugg_token += 1
            self._sugg_job = job
            cached = self._sugg_cache.get(job[0]) if job else None
            if job is None:
                traits.update(suggestions=[], suggestions_status="")
            elif cached is not None:
                traits.update(suggestions=[_suggestion_dict(x) for x in cached], suggestions_status="ready")
            else:
                traits.update(suggestions=[], suggestions_status="computing")
            if traits["specs"] is self.specs:
                del traits["specs"]    # unchanged: the frontend keeps its embedded views
            with self.hold_sync():
                for name, value in traits.items():
                    setattr(self, name, value)
                self.error = ""
                self.error_field = ""
            if job is not None and cached is None:
                self._schedule_suggestions(self._sugg_token, job)

    def _compute(self) -> Tuple[Any, List[Tuple[str, str, Dict[str, Any]]], Dict[str, Any], Any]:
        """Everything an update sets, computed before any trait changes: the estimate, the
        comparison's setups, the output traits, and the suggestions job (None when the
        setup fits, there is no GPU or the mode is inference)."""
        if self.mode not in MODES:
            raise VramError(f"mode: {self.mode!r} is not one of {', '.join(MODES)}", field="mode")
        arch = self._resolve_model()
        gpu = self._gpu_or_none()
        if self.mode == "inference":
            kind, kw = "infer", self.inference_setup()
            setups = [(name, dict(kw, **change)) for name, change in INFERENCE_SCENARIOS]
        else:
            par = self.parallel_setup()
            kind, kw = ("par", dict(self.setup(), **par)) if par else ("train", self.setup())
            setups = self._scenario_setups(self.setup(), par)
        result = self._cached_estimate(arch, kind, kw)
        est = _shown(result)
        scenario_kw = [(YOUR_SETUP, kind, kw)] + [(name, kind, s) for name, s in setups]
        scenarios: List[Tuple[str, UnitBox]] = []
        own_fits: Dict[str, Optional[bool]] = {}
        skipped: List[str] = []
        for name, k, s in scenario_kw:
            try:
                box, own = self._scenario_box(arch, name, k, s)
            except VramError as e:  # a scenario the model cannot do: leave it out, say why
                skipped.append(f"{name}: {e}")
                continue
            scenarios.append((name, box))
            own_fits[name] = own
        cap = gpu.usable_bytes if gpu else None
        cap_label = f"{gpu.name} ({gpu.usable_gib:.1f} GiB)" if gpu else ""
        comparison = comparison_rows(
            scenarios, *COMPARISON_SIZE, capacity_bytes=cap, capacity_label=cap_label,
            header=COMPARISON_HEADER_VERDICT if gpu else COMPARISON_HEADER)
        if gpu is not None:
            _add_verdicts(comparison, gpu, own_fits)
        if self.mode == "inference":
            phases = _inference_phase_rows(est, capacity_bytes=cap, capacity_label=cap_label)
            summary = self._summary_inference(result, arch, gpu, kw, skipped)
        else:
            phases = charts.phase_rows(est, capacity_bytes=cap, capacity_label=cap_label)
            summary = self._summary(result, arch, gpu, skipped, kind, kw)
        rows = {
            charts.DETAIL: layout_rows(est, *DETAIL_SIZE),
            charts.COMPARISON: comparison,
            charts.PHASES_DATA: phases,
        }
        traits = {
            "rows": rows,
            "specs": self._specs_for(self.mode),
            "summary": summary,
            "table": self._table(est),
            "options": self._options(arch),
        }
        job = None
        if self.mode == "training" and gpu is not None and summary["fits"] is False:
            job = (self._key(kind, kw) + (gpu.name,), arch, dict(kw, gpu=gpu.name))
        return result, scenario_kw, traits, job

    # -- suggestions, off the hot path -----------------------------------------------------
    def _suggestions_for(self, job: Tuple[Tuple, Any, Dict[str, Any]]) -> List[Any]:
        """fit.suggestions for a job (key, arch, keyword arguments with gpu), cached."""
        from . import fit

        key, arch, kw = job
        with self._lock:
            hit = self._sugg_cache.get(key)
        if hit is not None:
            return hit
        kw = {k: v for k, v in kw.items() if k != "model"}
        gpu = kw.pop("gpu")
        items = fit.suggestions(arch, gpu, **kw)
        with self._lock:
            self._sugg_cache[key] = items
            if len(self._sugg_cache) > 16:
                self._sugg_cache.popitem(last=False)
        return items

    def _schedule_suggestions(self, token: int, job: Tuple[Tuple, Any, Dict[str, Any]]) -> None:
        """Work out the suggestions ``suggestions_delay`` seconds after the last change: on
        the running event loop (the Jupyter kernel's: the same thread, between messages),
        else on a timer thread; at once when the delay is None."""
        delay = self.suggestions_delay
        if delay is None:
            self._run_suggestions(token, job)
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is not None:
            self._pending = loop.call_later(delay, self._run_suggestions, token, job)
        else:
            timer = threading.Timer(delay, self._run_suggestions, (token, job))
            timer.daemon = True
            self._pending = timer
            timer.start()

    def _cancel_pending(self) -> None:
        pending = getattr(self, "_pending", None)   # None too when __init__ failed early
        self._pending = None
        if pending is not None:
            pending.cancel()

    def _run_suggestions(self, token: int, job: Tuple[Tuple, Any, Dict[str, Any]]) -> None:
        if token != self._sugg_token:
            return   # the setup changed since: its own update scheduled its own
        try:
            items = self._suggestions_for(job)
        except Exception as e:  # never raise out of a callback
            self._publish_suggestions(token, [], f"failed: {type(e).__name__}: {e}".splitlines()[0])
            return
        self._publish_suggestions(token, items, "ready")

    def _publish_suggestions(self, token: int, items: List[Any], status: str) -> None:
        with self._lock:
            if token != self._sugg_token:
                return
            with self.hold_sync():
                self.suggestions = [_suggestion_dict(x) for x in items]
                self.suggestions_status = status

    def _set_error(self, message: str, field: str) -> None:
        with self.hold_sync():
            self.error = message.splitlines()[0] if message else "invalid input"
            self.error_field = field

    def _gpu_or_none(self) -> Optional[gpus.GPU]:
        if not self.gpu.strip():
            return None
        try:
            return gpus.get_gpu(self.gpu)
        except VramError:
            return None

    # -- output builders ------------------------------------------------------------------
    def _specs_for(self, mode: str) -> Dict[str, Any]:
        """The chart specs of a mode, built once each (switching modes re-embeds the charts;
        other updates send only rows)."""
        mode = mode if mode in MODES else "training"
        hit = self._specs_cache.get(mode)
        if hit is None:
            hit = self._specs_cache[mode] = self._build_specs(mode)
        return hit

    @staticmethod
    def _build_specs(mode: str = "training") -> Dict[str, Any]:
        legend = _LEGEND_INFERENCE if mode == "inference" else _LEGEND_TRAINING
        return {
            charts.DETAIL: charts.detail_spec_chart(width=DETAIL_SIZE[0], height=DETAIL_SIZE[1],
                                                    legend_values=legend).to_dict(),
            charts.COMPARISON: charts.comparison_chart(width=COMPARISON_SIZE[0],
                                                       height=COMPARISON_SIZE[1]).to_dict(),
            charts.PHASES_DATA: charts.phase_chart(width=PHASE_SIZE[0], height=PHASE_SIZE[1]).to_dict(),
        }

    def _base_summary(self, est: Estimate, arch: Any, gpu: Optional[gpus.GPU], skipped: List[str],
                      fits: Optional[bool], phase_labels: Dict[str, str]) -> Dict[str, Any]:
        """The keys every mode's summary has."""
        warnings: List[str] = []
        if self.gpu.strip() and gpu is None:
            try:
                gpus.get_gpu(self.gpu)
            except VramError as e:
                warnings.append(str(e))
        warnings += [f"comparison left out {s}" for s in skipped]
        peak_label = phase_labels.get(est.peak_phase, est.peak_phase)
        return {
            "mode": self.mode,
            "model": est.model_name,
            "hub_id": getattr(arch, "hub_id", None) or "",
            "params_total": est.params_total,
            "params_trainable": est.params_trainable,
            "peak_bytes": est.peak_allocated_bytes,
            "peak_gib": est.peak_allocated_bytes / GIB,
            "peak_phase": est.peak_phase,
            "peak_phase_label": peak_label,
            "reserved_gib": est.reserved_bytes / GIB,
            "cuda_context_gib": est.cuda_context_bytes / GIB,
            "device_total_bytes": est.device_total_bytes,
            "device_total_gib": est.device_total_gib,
            "gpu": gpu.name if gpu else "",
            "gpu_gib": gpu.usable_gib if gpu else None,
            "fits": fits,
            "headroom_gib": (gpu.usable_bytes - est.device_total_bytes) / GIB if gpu else None,
            "phases_gib": {k: v / GIB for k, v in est.phases_bytes.items()},
            "recompute_overhead": est.recompute_overhead,
            "notes": list(est.notes),
            "warnings": warnings,
            "parallel": None,
            "max_batch_size": None,
            "inference": None,
        }

    def _summary(self, result: Any, arch: Any, gpu: Optional[gpus.GPU], skipped: List[str],
                 kind: str, kw: Dict[str, Any]) -> Dict[str, Any]:
        """Training: one GPU's numbers (the worst GPU's with a parallel layout), the layout,
        CPU offload, pipeline stages and the largest micro-batch that fits."""
        est = _shown(result)
        fits = est.device_total_bytes <= gpu.usable_bytes if gpu is not None else None
        out = self._base_summary(est, arch, gpu, skipped, fits, charts.PHASE_LABELS)
        if gpu is not None:
            ok, why = gpu.supports(self.precision)
            if not ok:
                out["warnings"].append(why)
            if self.quantization != "none" and gpu.vendor != "NVIDIA":
                out["warnings"].append(
                    f"bitsandbytes quantization on {gpu.vendor} GPUs is less mature than on CUDA")
            out["max_batch_size"] = self._max_batch(arch, gpu, kind, kw)
        par = None
        if kind == "par":
            par = _parallel_summary(result)
            out["parallel"] = par
            out["notes"] = list(dict.fromkeys(list(result.notes) + out["notes"]))
        peak_label = out["peak_phase_label"]
        who = f"per GPU (worst of {par['num_gpus']}) " if par else ""
        text = (f"{who}peak {fmt_gib(est.peak_allocated_bytes)} allocated at {peak_label}; "
                f"device total {fmt_gib(est.device_total_bytes)}")
        if par and par["cpu_per_gpu_gib"]:
            text += (f"; CPU offload {par['cpu_per_gpu_gib']:.2f} GiB per GPU, "
                     f"{par['cpu_per_node_gib']:.1f} GiB per node")
        if gpu:
            text += f"; {'fits' if fits else 'does not fit'} {gpu.name} ({gpu.usable_gib:.1f} GiB)"
            if out["max_batch_size"] is not None:
                text += f"; largest micro-batch that fits: {out['max_batch_size']}"
        out["text"] = text
        return out

    def _summary_inference(self, est: Any, arch: Any, gpu: Optional[gpus.GPU], kw: Dict[str, Any],
                           skipped: List[str]) -> Dict[str, Any]:
        """Inference: the KV cache (per token and in total), weights, the serving budget and
        the longest context that fits the GPU."""
        from .inference import MAX_SEARCH_TOKENS

        fits = (bool(est.fits) if est.fits is not None else est.device_total_bytes <= gpu.usable_bytes) \
            if gpu is not None else None
        out = self._base_summary(est, arch, gpu, skipped, fits, _INFERENCE_PHASE_LABELS)
        longest = self._longest(arch, gpu, kw) if gpu is not None else None
        serving = est.serving
        inf = {
            "weights": est.setup.get("weights"),
            "kv_cache_dtype": est.setup.get("kv_cache_dtype"),
            "weights_gib": est.weights_bytes / GIB,
            "kv_bytes_per_token": est.kv_bytes_per_token,
            "kv_cache_bytes": est.kv_cache_bytes,
            "kv_cache_gib": est.kv_cache_bytes / GIB,
            "kv_cache_prefill_gib": est.kv_cache_prefill_bytes / GIB,
            "context_len": est.setup.get("context_len"),
            "batch_size": est.setup.get("batch_size"),
            "longest_context": longest,
            "longest_context_capped": bool(longest) and longest >= MAX_SEARCH_TOKENS,
            "max_position_embeddings": getattr(arch, "max_position_embeddings", None),
            "serving": dict(serving) if serving else None,
        }
        out["inference"] = inf
        text = (f"peak {fmt_gib(est.peak_allocated_bytes)} allocated at {out['peak_phase_label']}; "
                f"device total {fmt_gib(est.device_total_bytes)}; KV cache "
                f"{est.kv_bytes_per_token / 1024:g} KiB per token, {fmt_gib(est.kv_cache_bytes)} in all")
        if gpu:
            text += f"; {'fits' if fits else 'does not fit'} {gpu.name} ({gpu.usable_gib:.1f} GiB)"
            if longest is not None:
                text += f"; longest context that fits {gpu.name}: {longest:,} tokens"
        out["text"] = text
        return out

    def _answer(self, key: Tuple, fn) -> Any:
        """A fit answer (largest batch, longest context), cached by the setup it depends on."""
        hit = self._answers.get(key, _MISSING)
        if hit is not _MISSING:
            self._answers.move_to_end(key)
            return hit
        try:
            value = fn()
        except VramError:
            value = None
        self._answers[key] = value
        if len(self._answers) > 32:
            self._answers.popitem(last=False)
        return value

    def _max_batch(self, arch: Any, gpu: gpus.GPU, kind: str, kw: Dict[str, Any]) -> Optional[int]:
        """fit.max_batch_size for the setup (every field but the batch): one search per setup,
        so changing the batch itself costs nothing."""
        from . import fit

        rest = {k: v for k, v in kw.items() if k not in ("batch_size", "model")}
        return self._answer(("max_batch", self._key(kind, rest), gpu.name),
                            lambda: fit.max_batch_size(arch, gpu, **rest))

    def _longest(self, arch: Any, gpu: gpus.GPU, kw: Dict[str, Any]) -> Optional[int]:
        """inference.longest_context for the setup (every field but the context)."""
        from .inference import longest_context

        rest = {k: v for k, v in kw.items() if k not in ("context_len", "gpu")}
        return self._answer(("longest", self._key("infer", rest), gpu.name),
                            lambda: longest_context(arch, gpu.name, **rest))

    @staticmethod
    def _table(est: Estimate) -> List[Dict[str, Any]]:
        total = total_bytes(est) or 1.0
        order = {k: i for i, k in enumerate(KNOWN_COMPONENTS)}
        comps = sorted(est.components, key=lambda c: order.get(c.name, 99))
        return [{
            "component": c.name,
            "color": charts.component_color(c.name),
            "bytes": c.bytes,
            "gib": c.bytes / GIB,
            "share": c.bytes / total,
            "groups": [{"name": g.name, "gib": g.bytes / GIB} for g in
                       sorted(c.children, key=lambda g: -g.bytes)],
            "formula": c.formula,
        } for c in comps]

    def _options(self, arch: Any) -> Dict[str, Any]:
        if getattr(self, "_options_key", None) == self._arch_key and self.options:
            return self.options
        self._options_key = self._arch_key
        opts: Dict[str, Any] = {k: [list(x) for x in v] for k, v in _choices().items()}
        from .inference import KV_CACHE_DTYPES, WEIGHT_FORMATS
        from .parallel import STRATEGIES

        opts["mode"] = [["training", "Training (one step)"], ["inference", "Inference (generate / serve)"]]
        opts["strategy"] = [[k, _STRATEGY_LABELS.get(k, k)] for k in STRATEGIES]
        opts["weights"] = [[k, f"{k}: {_short(v)}"] for k, v in WEIGHT_FORMATS.items()]
        opts["kv_cache_dtype"] = [["auto", "auto (the compute dtype)"]] + [
            [k, _KV_LABELS.get(k, k)] for k in KV_CACHE_DTYPES]
        opts["presets"] = _preset_options()
        opts["gpus"] = [[g.name, g.label] for g in gpus.list_gpus()]
        try:
            opts["lora_targets"] = [[m, m] for m in arch.linear_modules()]
        except Exception:
            opts["lora_targets"] = []
        return opts


def _preset_options() -> List[List[str]]:
    try:
        from . import presets
    except ImportError:
        return []
    out = []
    for name in presets.list_presets():
        p = presets.find(name) or {}
        label = " · ".join(x for x in (p.get("family"), p.get("params_label")) if x)
        out.append([name, label])
    return out


_MISSING = object()

#: the component kinds each mode's detail legend lists (every colour stays fixed)
_LEGEND_TRAINING: Tuple[str, ...] = tuple(
    k for k in KNOWN_COMPONENTS if k not in ("kv cache", "logits"))
_LEGEND_INFERENCE: Tuple[str, ...] = (
    "weights", "quantization constants", "kv cache", "activations", "logits", "workspace",
    "allocator reserve", "cuda context")

#: how each phase of an inference estimate is called on the phase chart
_INFERENCE_PHASE_LABELS: Dict[str, str] = {
    "after_load": "after load",
    "prefill": "prefill",
    "decode": "decode",
    "profile": "profiling forward",
    "serving": "serving (KV pool full)",
}


def _short(text: str) -> str:
    """The first clause of a format's description ('bitsandbytes 4-bit NF4')."""
    return text.split(":")[0].split(";")[0].strip()


def _add_verdicts(rows: List[Dict[str, Any]], gpu: gpus.GPU, own_fits: Dict[str, Optional[bool]]) -> None:
    """Give each scenario caption of the comparison a verdict line against ``gpu``:
    "✓ fits" or "✗ 3.2 GiB over" (device total vs the card's usable memory; a serving
    budget's own verdict where the estimate has one), and ``fits``/``over_gib`` fields."""
    usable = gpu.usable_bytes
    for r in rows:
        if r["level"] != "title":
            continue
        total = r["bytes"]
        own = own_fits.get(r["scenario"])
        fits = own if own is not None else total <= usable
        over = max(total - usable, 0.0) / GIB
        if fits:
            verdict = "✓ fits"
        elif own is not None:
            verdict = "✗ no KV room"
        else:
            verdict = f"✗ {over:.1f} GiB over" if over >= 0.05 else f"✗ {over * 1024:.0f} MiB over"
        r["fits"] = bool(fits)
        r["over_gib"] = 0.0 if fits else over
        r["text"] = f"{r['label']}\n{fmt_gib(total)}\n{verdict}"


def _inference_phase_rows(est: Estimate, *, capacity_bytes: Optional[float] = None,
                          capacity_label: str = "") -> List[Dict[str, Any]]:
    """The phase chart's rows for an inference estimate (after load, prefill, decode; or
    after load, profiling forward, serving), in the format of :func:`charts.phase_rows`."""
    rows: List[Dict[str, Any]] = []
    order = {k: i for i, k in enumerate(KNOWN_COMPONENTS)}
    for i, (phase, total) in enumerate(est.phases_bytes.items()):
        label = _INFERENCE_PHASE_LABELS.get(phase, phase)
        comps = est.phase_components.get(phase) or []
        for c in comps:
            rows.append({"level": "bar", "phase": label, "order": i, "component": c.name,
                         "kind": component_kind(c.name), "corder": order.get(c.name, 99),
                         "bytes": c.bytes, "gib": c.bytes / GIB, "text": ""})
        if not comps:
            rows.append({"level": "bar", "phase": label, "order": i, "component": charts.ALL_COMPONENTS,
                         "kind": charts.ALL_COMPONENTS, "corder": 99, "bytes": total, "gib": total / GIB,
                         "text": ""})
        peak = " (peak)" if phase == est.peak_phase else ""
        rows.append({"level": "total", "phase": label, "order": i, "component": "", "kind": "",
                     "corder": 0, "bytes": total, "gib": total / GIB, "text": fmt_gib(total) + peak})
    cap = capacity_bytes or 0.0
    rows.append({"level": "capacity", "phase": "", "order": 0, "component": "", "kind": "",
                 "corder": 0, "bytes": cap, "gib": cap / GIB,
                 "text": (capacity_label or fmt_gib(cap)) if cap else ""})
    return rows


def _parallel_summary(p: Any) -> Dict[str, Any]:
    """What the summary shows of a ParallelEstimate: layout, worst GPU, CPU offload, stages."""
    lay = p.layout
    stages = []
    if lay["pipeline_parallel"] > 1:
        for st in p.stages:
            first, last = st.layers
            stages.append({
                "stage": st.stage,
                "layers": f"{first}-{last}" if last >= first else "none",
                "holds": ", ".join(x for x, on in (("embeddings", st.embedding), ("output head", st.head)) if on),
                "in_flight": st.in_flight,
                "peak_gib": st.estimate.peak_allocated_bytes / GIB,
                "device_total_gib": st.device_total_bytes / GIB,
                "cpu_gib": sum(st.cpu.values()) / GIB,
                "worst": st.stage == p.worst_stage,
            })
    return {
        "strategy": p.strategy,
        "strategy_label": _STRATEGY_LABELS.get(p.strategy, p.strategy),
        "num_gpus": lay["num_gpus"],
        "data_parallel": lay["data_parallel"],
        "tensor_parallel": lay["tensor_parallel"],
        "pipeline_parallel": lay["pipeline_parallel"],
        "micro_batches": lay["micro_batches"],
        "shard": lay["shard"],
        "nodes": lay["nodes"],
        "offload_optimizer": lay["offload_optimizer"],
        "offload_params": lay["offload_params"],
        "per_gpu_device_total_gib": p.device_total_bytes / GIB,
        "per_gpu_peak_gib": p.peak_allocated_bytes / GIB,
        "cpu_per_gpu_gib": p.cpu_bytes_per_gpu / GIB,
        "cpu_per_node_gib": p.cpu_bytes_per_node / GIB,
        "worst_stage": p.worst_stage,
        "stages": stages,
    }


def _suggestion_dict(x: Any) -> Dict[str, Any]:
    """A fit.Suggestion as the frontend shows it; ``changes`` are trait names and values."""
    d = x.to_dict()
    d["changes"] = {k: (list(v) if isinstance(v, tuple) else v) for k, v in x.changes.items()}
    d["cpu_per_node_gib"] = x.cpu_bytes_per_node / GIB
    return d
