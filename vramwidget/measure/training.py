"""Measure the memory of real training steps, in the format of the validation file.

This is how ground truth for the estimator is made: build a causal LM from an
architecture config with random weights directly on the device, run a few optimizer
steps on random tokens and read ``torch.cuda`` memory statistics around each phase
(forward + loss, backward, optimizer step).  The result is one record in the format
of ``vramwidget/data/h200_training_a.jsonl`` (see ``data/VALIDATION.md``)::

    {"id", "name", "model", "training",
     "measured": {params_total, params_trainable, weights_mib, persistent_after_step_mib,
                  forward_peak_mib, backward_peak_mib, optimizer_step_peak_mib,
                  peak_allocated_mib, first_step_peak_mib, max_reserved_mib, step_seconds},
     "env": {gpu, torch, transformers, peft, bitsandbytes, cuda_context_mib, ...}}

MiB are 2**20 bytes.  Step 1 creates the optimizer states lazily, so the per-phase
peaks, ``persistent_after_step_mib`` and ``step_seconds`` describe the steady state
(steps 2..N); ``first_step_peak_mib`` is step 1 alone.

On ``device="cpu"`` the whole code path runs (model build, LoRA wrapping, autocast,
every optimizer that does not need bitsandbytes) and parameter counts and timings are
real, but torch has no memory statistics for the CPU: every ``*_mib`` field is
``None`` and ``env["memory_stats"]`` says so.  QLoRA and 8-bit optimizers need
bitsandbytes and a CUDA GPU.

torch, transformers and peft are imported inside the functions that need them, so
``import vramwidget.measure.training`` works without them (``pip install vramwidget[measure]``).

Python API::

    from vramwidget.measure.training import case_from_setup, measure_case, measure_file
    case = case_from_setup(config_dict, "llama-3.2-1b", method="lora", batch_size=2, seq_len=2048)
    record = measure_case(case, device="cuda")
    measure_file("cases.jsonl", "measured.jsonl", device="cuda", deadline_s=3000)

Command line (``vramwidget measure ...`` or ``python -m vramwidget.measure.training ...``)::

    vramwidget measure CASES.jsonl --out OUT.jsonl [--device cuda] [--only SUBSTR] [--deadline S]
    vramwidget measure --model config.json --method lora --batch-size 2 --seq-len 512 --out OUT.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import IO, Any, Dict, Iterable, List, Mapping, Optional, Sequence, Union

from ..errors import VramError
from ..inputs import shown
from ..units import MIB, canonical_dtype

__all__ = [
    "METHODS",
    "OPTIMIZERS",
    "MEASURED_FIELDS",
    "case_from_setup",
    "normalize_case",
    "normalize_training",
    "default_lora_targets",
    "check_requirements",
    "environment",
    "load_cases",
    "measure_case",
    "measure_file",
    "main",
]

# --------------------------------------------------------------------------------------
# The vocabulary of a case (the "training" block of the validation file)
# --------------------------------------------------------------------------------------

METHODS = ("full", "lora", "qlora")

#: optimizer names and what each one builds (see ``_make_optimizer``)
OPTIMIZERS = (
    "adamw",  # torch.optim.AdamW, default (foreach) implementation
    "adamw_fused",  # torch.optim.AdamW(fused=True)
    "adamw_8bit",  # bitsandbytes.optim.AdamW8bit (CUDA + bitsandbytes)
    "adafactor",  # transformers.optimization.Adafactor(scale_parameter=False, relative_step=False)
    "sgd_momentum",  # torch.optim.SGD(momentum=0.9)
    "sgd",  # torch.optim.SGD without momentum (no optimizer state)
    "lion",  # lion_pytorch.Lion, else bitsandbytes.optim.Lion on CUDA
)

WEIGHT_DTYPES = ("float32", "bfloat16", "float16")
AUTOCAST_DTYPES = ("bfloat16", "float16")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")
QUANT_TYPES = ("nf4", "fp4")
COMPUTE_DTYPES = ("bfloat16", "float16", "float32")

#: keys of ``training``, in the order the validation file writes them
TRAINING_KEYS = (
    "method",
    "weights_dtype",
    "autocast_dtype",
    "optimizer",
    "gradient_checkpointing",
    "attn_implementation",
    "batch_size",
    "seq_len",
    "lora",
    "quantization",
    "prepare_model_for_kbit_training",
)
LORA_KEYS = ("r", "alpha", "dropout", "target_modules")
QUANTIZATION_KEYS = ("load_in_4bit", "quant_type", "double_quant", "compute_dtype")

#: LoRA on every projection of attention and MLP (the Llama/Qwen/Mistral module names)
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

#: architectures whose linear layers are named differently

LORA_DEFAULTS = {"r": 16, "alpha": 32, "dropout": 0.0}
QUANTIZATION_DEFAULTS = {"load_in_4bit": True, "quant_type": "nf4", "double_quant": True, "compute_dtype": "bfloat16"}

#: the fields of ``measured``, in the order the validation file writes them
MEASURED_FIELDS = (
    "params_total",
    "params_trainable",
    "weights_mib",
    "persistent_after_step_mib",
    "forward_peak_mib",
    "backward_peak_mib",
    "optimizer_step_peak_mib",
    "peak_allocated_mib",
    "first_step_peak_mib",
    "max_reserved_mib",
    "step_seconds",
)

#: learning rate of every optimizer (its value does not change memory)
LEARNING_RATE = 1e-5


def default_lora_targets(model_type: Optional[str]) -> List[str]:
    """The LoRA target module names used when a case names none."""
    from ..model.families import REGISTRY, resolve_model_type

    fam = REGISTRY.get(resolve_model_type(str(model_type or "").lower()))
    return list(fam.default_lora_targets if fam is not None and fam.default_lora_targets else DEFAULT_LORA_TARGETS)


# --------------------------------------------------------------------------------------
# Validation: every bad value is a VramError naming the field and what is allowed
# --------------------------------------------------------------------------------------


def _choice(value: Any, allowed: Sequence[str], field: str) -> str:
    key = str(value).strip().lower() if isinstance(value, str) else value
    if key not in allowed:
        raise VramError(f"{field} must be one of {', '.join(allowed)}; got {shown(value)}", field=field)
    return key


def _dtype(value: Any, allowed: Sequence[str], field: str) -> str:
    try:
        name = canonical_dtype(value)
    except (KeyError, TypeError):
        name = None
    if name not in allowed:
        raise VramError(f"{field} must be one of {', '.join(allowed)}; got {shown(value)}", field=field)
    return name


def _bool(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        raise VramError(f"{field} must be true or false; got {shown(value)}", field=field)
    return value


def _positive_int(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise VramError(f"{field} must be a positive integer; got {shown(value)}", field=field)
    return value


def _unknown_keys(given: Mapping[str, Any], allowed: Sequence[str], field: str) -> None:
    extra = [k for k in given if k not in allowed]
    if extra:
        raise VramError(
            f"{field} has unknown key(s) {', '.join(map(repr, extra))}; allowed: {', '.join(allowed)}",
            field=f"{field}.{extra[0]}",
        )


def _normalize_lora(lora: Any, model_type: Optional[str]) -> Dict[str, Any]:
    if lora is None:
        lora = {}
    if not isinstance(lora, Mapping):
        raise VramError(f"training.lora must be an object with keys {', '.join(LORA_KEYS)}; got {shown(lora)}",
                        field="training.lora")
    _unknown_keys(lora, LORA_KEYS, "training.lora")
    r = _positive_int(lora.get("r", LORA_DEFAULTS["r"]), "training.lora.r")
    alpha = lora.get("alpha", LORA_DEFAULTS["alpha"])
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise VramError(f"training.lora.alpha must be a positive number; got {shown(alpha)}", field="training.lora.alpha")
    dropout = lora.get("dropout", LORA_DEFAULTS["dropout"])
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise VramError(f"training.lora.dropout must be a number in [0, 1); got {shown(dropout)}",
                        field="training.lora.dropout")
    targets = lora.get("target_modules")
    if targets is None:
        targets = default_lora_targets(model_type)
    elif isinstance(targets, str):
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    if (not isinstance(targets, (list, tuple)) or not targets
            or not all(isinstance(t, str) and t for t in targets)):
        raise VramError(f"training.lora.target_modules must be a non-empty list of module names; got {shown(targets)}",
                        field="training.lora.target_modules")
    return {"r": r, "alpha": alpha, "dropout": float(dropout), "target_modules": list(targets)}


def _normalize_quantization(quant: Any) -> Dict[str, Any]:
    if quant is None:
        quant = {}
    if not isinstance(quant, Mapping):
        raise VramError(f"training.quantization must be an object with keys {', '.join(QUANTIZATION_KEYS)}; "
                        f"got {shown(quant)}", field="training.quantization")
    _unknown_keys(quant, QUANTIZATION_KEYS, "training.quantization")
    q = {**QUANTIZATION_DEFAULTS, **quant}
    if q["load_in_4bit"] is not True:
        raise VramError("training.quantization.load_in_4bit must be true: method 'qlora' measures 4-bit weights",
                        field="training.quantization.load_in_4bit")
    return {
        "load_in_4bit": True,
        "quant_type": _choice(q["quant_type"], QUANT_TYPES, "training.quantization.quant_type"),
        "double_quant": _bool(q["double_quant"], "training.quantization.double_quant"),
        "compute_dtype": _dtype(q["compute_dtype"], COMPUTE_DTYPES, "training.quantization.compute_dtype"),
    }


def normalize_training(training: Mapping[str, Any], model_type: Optional[str] = None) -> Dict[str, Any]:
    """Validate a ``training`` block and return it complete, in canonical form and key order.

    Missing keys get the defaults of :func:`case_from_setup`; dtype aliases such as
    ``"bf16"`` become ``"bfloat16"``.  The ``lora`` block is present exactly for
    LoRA/QLoRA, ``quantization`` and ``prepare_model_for_kbit_training`` exactly for
    QLoRA, as in the validation file (whose cases come back unchanged).
    """
    if not isinstance(training, Mapping):
        raise VramError(f"training must be an object; got {type(training).__name__}", field="training")
    _unknown_keys(training, TRAINING_KEYS, "training")
    method = _choice(training.get("method", "full"), METHODS, "training.method")
    autocast = training.get("autocast_dtype")
    if isinstance(autocast, str) and autocast.strip().lower() in ("", "none", "null", "off"):
        autocast = None
    out: Dict[str, Any] = {
        "method": method,
        "weights_dtype": _dtype(training.get("weights_dtype", "bfloat16"), WEIGHT_DTYPES, "training.weights_dtype"),
        "autocast_dtype": None if autocast is None else _dtype(autocast, AUTOCAST_DTYPES, "training.autocast_dtype"),
        "optimizer": _choice(training.get("optimizer", "adamw"), OPTIMIZERS, "training.optimizer"),
        "gradient_checkpointing": _bool(training.get("gradient_checkpointing", False),
                                        "training.gradient_checkpointing"),
        "attn_implementation": _choice(training.get("attn_implementation", "sdpa"), ATTN_IMPLEMENTATIONS,
                                       "training.attn_implementation"),
        "batch_size": _positive_int(training.get("batch_size", 1), "training.batch_size"),
        "seq_len": _positive_int(training.get("seq_len", 512), "training.seq_len"),
    }
    if method in ("lora", "qlora"):
        out["lora"] = _normalize_lora(training.get("lora"), model_type)
    elif training.get("lora") is not None:
        raise VramError("training.lora is only used with method 'lora' or 'qlora'", field="training.lora")
    if method == "qlora":
        out["quantization"] = _normalize_quantization(training.get("quantization"))
        out["prepare_model_for_kbit_training"] = _bool(training.get("prepare_model_for_kbit_training", False),
                                                       "training.prepare_model_for_kbit_training")
    else:
        if training.get("quantization") is not None:
            raise VramError("training.quantization is only used with method 'qlora'", field="training.quantization")
        if training.get("prepare_model_for_kbit_training"):
            raise VramError("training.prepare_model_for_kbit_training is only used with method 'qlora'",
                            field="training.prepare_model_for_kbit_training")
    return out


def _model_dict(model_config: Any) -> Dict[str, Any]:
    """A config.json dict (a transformers config object is converted with ``to_dict()``)."""
    if hasattr(model_config, "to_dict") and not isinstance(model_config, Mapping):
        model_config = model_config.to_dict()
    if not isinstance(model_config, Mapping):
        raise VramError(f"model must be a config.json object; got {type(model_config).__name__}", field="model")
    model_type = model_config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise VramError("model.model_type is missing: the model config must be a config.json dict with "
                        "'model_type' (e.g. 'llama', 'qwen2', 'gpt2')", field="model.model_type")
    return dict(model_config)


def normalize_case(case: Mapping[str, Any]) -> Dict[str, Any]:
    """Validate a case ``{"id", "name", "model", "training"}`` and return it in canonical form.

    Other keys (``measured``, ``env`` of a validation record) are dropped: they are
    what a measurement produces.  ``id`` defaults to ``name``, ``name`` to the model type.
    """
    if not isinstance(case, Mapping):
        raise VramError(f"a case must be an object with 'model' and 'training'; got {type(case).__name__}",
                        field="case")
    for key in ("model", "training"):
        if key not in case:
            raise VramError(f"case {case.get('id', '?')!s} has no '{key}'", field=key)
    model = _model_dict(case["model"])
    name = case.get("name") or model["model_type"]
    case_id = case.get("id") or name
    return {
        "id": str(case_id),
        "name": str(name),
        "model": model,
        "training": normalize_training(case["training"], model["model_type"]),
    }


def case_from_setup(
    model_config: Any, name: str, *, case_id: Optional[str] = None, **training: Any
) -> Dict[str, Any]:
    """Build a case from keyword arguments, with defaults for everything not given.

    ``training`` takes the keys of the validation file's ``training`` block:
    ``method`` ("full"), ``weights_dtype`` ("bfloat16"), ``autocast_dtype`` (None),
    ``optimizer`` ("adamw"), ``gradient_checkpointing`` (False),
    ``attn_implementation`` ("sdpa"), ``batch_size`` (1), ``seq_len`` (512), and for
    LoRA/QLoRA ``lora`` (a partial dict over r=16, alpha=32, dropout=0.0 and the
    attention + MLP projections of the architecture), for QLoRA ``quantization``
    (partial dict over nf4, double quantization, bfloat16 compute) and
    ``prepare_model_for_kbit_training`` (False).  A bad name or value raises
    :class:`VramError` naming the field and the allowed values.

    >>> case = case_from_setup({"model_type": "gpt2", "n_layer": 2}, "gpt2-tiny", method="lora")
    >>> case["training"]["lora"]["target_modules"]
    ['c_attn', 'c_proj', 'c_fc']
    """
    model = _model_dict(model_config)
    normalized = normalize_training(training, model["model_type"])
    if case_id is None:
        case_id = f"{name}-{normalized['method']}-b{normalized['batch_size']}-s{normalized['seq_len']}"
    return {"id": str(case_id), "name": str(name), "model": model, "training": normalized}


# --------------------------------------------------------------------------------------
# What a case needs, and what the machine has
# --------------------------------------------------------------------------------------


def module_available(name: str) -> bool:
    """Whether ``name`` can be imported here (without importing it)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _device_type(device: Any) -> str:
    return str(device).split(":", 1)[0].strip().lower()


def check_requirements(case: Mapping[str, Any], device: Any = "cuda") -> None:
    """Raise VramError when the case cannot run on ``device`` with the installed packages.

    QLoRA (4-bit weights) and ``adamw_8bit`` need bitsandbytes and a CUDA GPU;
    ``lion`` needs the ``lion-pytorch`` package, or bitsandbytes on a CUDA GPU.
    Runs without importing torch.
    """
    t = case["training"]
    on_cuda = _device_type(device) == "cuda"
    has_bnb = module_available("bitsandbytes")
    needs_bnb = []
    if t["method"] == "qlora":
        needs_bnb.append(("training.method", "method 'qlora' (4-bit weights)"))
    if t["optimizer"] == "adamw_8bit":
        needs_bnb.append(("training.optimizer", "optimizer 'adamw_8bit'"))
    for field, what in needs_bnb:
        if not on_cuda:
            raise VramError(f"{what} needs bitsandbytes and a CUDA GPU; it cannot run on device '{device}'",
                            field=field)
        if not has_bnb:
            raise VramError(f"{what} needs bitsandbytes and a CUDA GPU; bitsandbytes is not installed "
                            "(pip install bitsandbytes)", field=field)
    if t["optimizer"] == "lion" and not module_available("lion_pytorch") and not (on_cuda and has_bnb):
        raise VramError("optimizer 'lion' needs the lion-pytorch package (pip install lion-pytorch), "
                        "or bitsandbytes and a CUDA GPU", field="training.optimizer")


def import_stack():
    """torch, transformers and peft, or a VramError saying how to install them."""
    try:
        import peft
        import torch
        import transformers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise VramError(f"measuring needs torch, transformers and peft ({exc}); "
                        "pip install 'vramwidget[measure]'", field="device") from exc
    return torch, transformers, peft


def resolve_device(device: Any):
    """``device`` as a torch.device, checked to exist (a VramError naming it when not)."""
    torch, _, _ = import_stack()
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise VramError(f"device must be 'cpu', 'cuda' or 'cuda:N'; got {shown(device)}", field="device") from None
    if dev.type not in ("cpu", "cuda"):
        raise VramError(f"device must be 'cpu', 'cuda' or 'cuda:N'; got {shown(device)}", field="device")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise VramError(f"device {shown(device)} asked for, but torch {torch.__version__} sees no CUDA GPU "
                            "(use device='cpu' to test the code path without memory statistics)", field="device")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _version(module_name: str) -> Optional[str]:
    if not module_available(module_name):
        return None
    try:
        module = __import__(module_name)
        return str(getattr(module, "__version__", "unknown"))
    except Exception as exc:  # noqa: BLE001 - a broken install is reported, not raised
        return f"unusable: {type(exc).__name__}: {exc}"[:200]


_CONTEXT_MIB: Dict[int, float] = {}


def _cuda_context_mib(torch, dev) -> float:
    """Device memory held outside PyTorch's allocator: the CUDA context (and other processes).

    Taken once per device and process as used - reserved, right after CUDA is initialised.
    """
    if dev.index not in _CONTEXT_MIB:
        torch.zeros(1, device=dev)
        torch.cuda.synchronize(dev)
        free, total = torch.cuda.mem_get_info(dev)
        _CONTEXT_MIB[dev.index] = (total - free - torch.cuda.memory_reserved(dev)) / MIB
    return _CONTEXT_MIB[dev.index]


def environment(device: Any = "cpu") -> Dict[str, Any]:
    """The ``env`` block of a record: GPU name, package versions, CUDA context size."""
    torch, transformers, peft = import_stack()
    dev = resolve_device(device)
    env: Dict[str, Any] = {
        "gpu": None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "bitsandbytes": _version("bitsandbytes"),
        "cuda_context_mib": None,
    }
    if dev.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(dev)
        env["cuda_context_mib"] = round(_cuda_context_mib(torch, dev), 1)
        env["total_mib"] = round(torch.cuda.get_device_properties(dev).total_memory / MIB, 1)
    else:
        env["gpu"] = "cpu"
        env["memory_stats"] = f"unavailable on {dev.type}"
    return env


# --------------------------------------------------------------------------------------
# Memory probes: torch.cuda statistics, or None everywhere on the CPU
# --------------------------------------------------------------------------------------


class CudaMemory:
    """Reads torch.cuda allocator statistics (MiB) after synchronising the device."""

    available = True

    def __init__(self, torch, dev):
        self.torch, self.dev = torch, dev

    def sync(self) -> None:
        """Wait for the device (torch.cuda.synchronize) so that the statistics are current."""
        self.torch.cuda.synchronize(self.dev)

    def reset_peak(self) -> None:
        """Start a new peak (torch.cuda.reset_peak_memory_stats)."""
        self.sync()
        self.torch.cuda.reset_peak_memory_stats(self.dev)

    def allocated(self) -> float:
        """torch.cuda.memory_allocated, MiB."""
        self.sync()
        return self.torch.cuda.memory_allocated(self.dev) / MIB

    def peak(self) -> float:
        """torch.cuda.max_memory_allocated since the last reset, MiB."""
        self.sync()
        return self.torch.cuda.max_memory_allocated(self.dev) / MIB

    def peak_reserved(self) -> float:
        """torch.cuda.max_memory_reserved since the last reset, MiB."""
        self.sync()
        return self.torch.cuda.max_memory_reserved(self.dev) / MIB

    def release(self) -> None:
        """Collect garbage and return the cached blocks (torch.cuda.empty_cache)."""
        gc.collect()
        self.torch.cuda.empty_cache()

    def record_history(self) -> None:
        """Start recording every allocation and free with its Python frames
        (``torch.cuda.memory._record_memory_history``), for a snapshot of the case."""
        self.torch.cuda.memory._record_memory_history(max_entries=SNAPSHOT_MAX_ENTRIES, device=self.dev)

    def dump_snapshot(self, path: str) -> str:
        """Write ``torch.cuda.memory._snapshot()`` of the case to ``path`` (a pickle that
        PyTorch's memory_viz opens and :func:`vramwidget.load_snapshot` reads) and stop recording."""
        self.sync()
        self.torch.cuda.memory._dump_snapshot(path)
        self.torch.cuda.memory._record_memory_history(enabled=None, device=self.dev)
        return path


class NoMemory:
    """The CPU: no allocator statistics, every reading is None."""

    available = False

    def sync(self) -> None:
        """Nothing to wait for."""
        pass

    def reset_peak(self) -> None:
        """Nothing to reset."""
        pass

    def allocated(self) -> None:
        """No statistic: None."""
        return None

    def peak(self) -> None:
        """No statistic: None."""
        return None

    def peak_reserved(self) -> None:
        """No statistic: None."""
        return None

    def release(self) -> None:
        """Collect garbage."""
        gc.collect()

    def record_history(self) -> None:
        """No allocator history on the CPU."""
        pass

    def dump_snapshot(self, path: str) -> None:
        """No snapshot on the CPU: None."""
        return None


def round_or_none(value: Optional[float], digits: int = 1) -> Optional[float]:
    """``value`` rounded to ``digits``, None kept."""
    return None if value is None else round(value, digits)


def _max(values: Iterable[Optional[float]]) -> Optional[float]:
    values = list(values)
    if not values or any(v is None for v in values):
        return None
    return max(values)


# --------------------------------------------------------------------------------------
# Building the model and the optimizer
# --------------------------------------------------------------------------------------


def make_config(model: Mapping[str, Any]):
    """The transformers config of a case's ``model`` mapping (use_cache off), or a VramError naming what transformers refused."""
    from transformers import AutoConfig

    kwargs = dict(model)
    model_type = kwargs.pop("model_type")
    kwargs["use_cache"] = False
    try:
        return AutoConfig.for_model(model_type, **kwargs)
    except Exception as exc:  # noqa: BLE001 - unknown model_type, or the config's own validators
        message = " ".join(str(exc).split())
        field = "model.model_type" if "model_type" in message or "Unrecognized" in message else "model"
        raise VramError(f"model (model_type {shown(model_type)}): transformers {_version('transformers')} cannot "
                        f"build this config: {message}", field=field) from exc


def model_from_config(cfg, dtype, attn: str, dev):
    """A causal LM built from ``cfg`` on ``dev`` in ``dtype`` with attention ``attn`` (random weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device(dev):
            return AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn)
    except (ValueError, ImportError) as exc:
        raise VramError(f"cannot build a causal LM for model_type {shown(cfg.model_type)} with "
                        f"attn_implementation {shown(attn)}: {exc}", field="model") from exc


def load_quantized(cfg, t: Mapping[str, Any], dev):
    """QLoRA base model: build it in ``weights_dtype``, save it, reload it in 4 bits.

    transformers quantizes only while loading weights, so a random model goes through
    a temporary checkpoint; it is freed before the 4-bit model is loaded.
    """
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    q = t["quantization"]
    dtype = getattr(torch, t["weights_dtype"])
    tmp = tempfile.mkdtemp(prefix="vramwidget-qlora-")
    try:
        model = model_from_config(cfg, dtype, t["attn_implementation"], dev)
        model.save_pretrained(tmp)
        del model
        gc.collect()
        torch.cuda.empty_cache()
        bnb = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=q["quant_type"],
            bnb_4bit_use_double_quant=q["double_quant"],
            bnb_4bit_compute_dtype=getattr(torch, q["compute_dtype"]),
        )
        return AutoModelForCausalLM.from_pretrained(
            tmp, quantization_config=bnb, dtype=dtype, device_map={"": dev.index},
            attn_implementation=t["attn_implementation"],
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _targets_conv1d(model, targets: Sequence[str]) -> bool:
    """GPT-2 style models use transformers' Conv1D (weights stored transposed)."""
    wanted = set(targets)
    return any(type(module).__name__ == "Conv1D" and name.rsplit(".", 1)[-1] in wanted
               for name, module in model.named_modules())


def _build_model(case: Mapping[str, Any], dev):
    """The model exactly as the validation cases were run (see data/VALIDATION.md)."""
    with warnings.catch_warnings():
        # transformers 5 renamed gradient_checkpointing_* to activation_checkpointing_*;
        # the old names (used by peft too) are aliases that warn
        warnings.simplefilter("ignore", FutureWarning)
        return _build_model_quietly(case, dev)


def _build_model_quietly(case: Mapping[str, Any], dev):
    import peft
    import torch

    t = case["training"]
    cfg = make_config(case["model"])
    if t["method"] == "qlora":
        model = load_quantized(cfg, t, dev)
    else:
        model = model_from_config(cfg, getattr(torch, t["weights_dtype"]), t["attn_implementation"], dev)
    model.config.use_cache = False

    checkpointing = t["gradient_checkpointing"]
    prepare = t.get("prepare_model_for_kbit_training", False)
    gc_kwargs = {"use_reentrant": False}
    if checkpointing and not prepare:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gc_kwargs)

    if t["method"] in ("lora", "qlora"):
        if prepare:
            # freezes the base, upcasts non-quantized parameters to float32 and
            # enables checkpointing itself when asked
            model = peft.prepare_model_for_kbit_training(
                model, use_gradient_checkpointing=checkpointing, gradient_checkpointing_kwargs=gc_kwargs)
        lora = t["lora"]
        lora_config = peft.LoraConfig(
            r=lora["r"],
            lora_alpha=lora["alpha"],
            lora_dropout=lora["dropout"],
            target_modules=list(lora["target_modules"]),
            fan_in_fan_out=_targets_conv1d(model, lora["target_modules"]),
            task_type="CAUSAL_LM",
        )
        try:
            model = peft.get_peft_model(model, lora_config)
        except ValueError as exc:
            raise VramError(f"training.lora.target_modules {lora['target_modules']}: {exc}",
                            field="training.lora.target_modules") from exc
        if checkpointing:
            # checkpointed blocks of a frozen base need inputs that require grad
            model.enable_input_require_grads()
    model.train()
    return model


def _make_optimizer(name: str, params: List[Any]):
    import torch

    if not params:
        raise VramError("the model has no trainable parameters (check training.lora.target_modules)",
                        field="training")
    if name == "adamw":
        return torch.optim.AdamW(params, lr=LEARNING_RATE)
    if name == "adamw_fused":
        return torch.optim.AdamW(params, lr=LEARNING_RATE, fused=True)
    if name == "adamw_8bit":
        import bitsandbytes

        return bitsandbytes.optim.AdamW8bit(params, lr=LEARNING_RATE)
    if name == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(params, lr=LEARNING_RATE, scale_parameter=False, relative_step=False)
    if name == "sgd_momentum":
        return torch.optim.SGD(params, lr=LEARNING_RATE, momentum=0.9)
    if name == "sgd":
        return torch.optim.SGD(params, lr=LEARNING_RATE)
    if name == "lion":
        if module_available("lion_pytorch"):
            from lion_pytorch import Lion

            return Lion(params, lr=LEARNING_RATE)
        import bitsandbytes

        return bitsandbytes.optim.Lion(params, lr=LEARNING_RATE)
    raise VramError(f"training.optimizer must be one of {', '.join(OPTIMIZERS)}; got {shown(name)}",
                    field="training.optimizer")


def _vocab_size(model) -> int:
    cfg = model.config
    if hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config()
    return int(cfg.vocab_size)


# --------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------


#: trace entries a snapshot keeps (torch's default is 100,000; a 7B step makes far fewer)
SNAPSHOT_MAX_ENTRIES = 1_000_000


def measure_case(case: Mapping[str, Any], *, device: Any = "cuda", steps: int = 3,
                 snapshot_path: Optional[str] = None) -> Dict[str, Any]:
    """Run ``steps`` training steps of ``case`` on ``device`` and return a validation record.

    ``case`` is ``{"id", "name", "model", "training"}`` as in the validation file (or
    from :func:`case_from_setup`).  Each step is ``loss = model(input_ids=ids,
    labels=ids).loss`` (under ``torch.autocast`` when ``autocast_dtype`` is set),
    ``loss.backward()``, ``optimizer.step()``, ``optimizer.zero_grad(set_to_none=True)``
    on random token ids of shape (batch_size, seq_len).  Peak allocated memory is
    read separately for each phase; ``steps`` must be at least 2 since step 1 is not
    steady state.  Raises VramError for a bad case or a case this machine cannot run,
    and lets ``torch.cuda.OutOfMemoryError`` through (:func:`measure_file` records it).

    ``snapshot_path``: on a CUDA device, the allocator's history of the whole case (model
    build and every step) is recorded and written there as a ``torch.cuda.memory._snapshot()``
    pickle; the record names it under ``"snapshot"``.
    """
    case = normalize_case(case)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
        raise VramError(f"steps must be an integer >= 2 (step 1 creates optimizer states; steps 2.. are the "
                        f"steady state); got {shown(steps)}", field="steps")
    check_requirements(case, device)
    torch, _, _ = import_stack()
    dev = resolve_device(device)
    env = environment(dev)
    mem = CudaMemory(torch, dev) if dev.type == "cuda" else NoMemory()
    try:
        mem.release()
        if mem.available:
            # normally 0; anything else is memory a caller still holds, counted in every *_mib
            env["allocated_before_case_mib"] = round_or_none(mem.allocated())
        if snapshot_path and mem.available:
            mem.record_history()
        measured = _run_steps(case, dev, mem, steps)
        snapshot = mem.dump_snapshot(str(snapshot_path)) if snapshot_path and mem.available else None
    finally:
        mem.release()
    record = {"id": case["id"], "name": case["name"], "model": case["model"], "training": case["training"],
              "measured": measured, "env": env}
    if snapshot:
        record["snapshot"] = os.path.basename(snapshot)
    return record


def _run_steps(case: Mapping[str, Any], dev, mem, steps: int) -> Dict[str, Any]:
    import torch

    t = case["training"]
    mem.reset_peak()
    model = _build_model(case, dev)
    weights_mib = mem.allocated()

    params_total = params_trainable = 0
    for p in model.parameters():
        params_total += p.numel()
        if p.requires_grad:
            params_trainable += p.numel()

    optimizer = _make_optimizer(t["optimizer"], [p for p in model.parameters() if p.requires_grad])
    generator = torch.Generator(device=dev).manual_seed(0)
    ids = torch.randint(0, _vocab_size(model), (t["batch_size"], t["seq_len"]), device=dev, generator=generator)

    def autocast():
        if t["autocast_dtype"] is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=dev.type, dtype=getattr(torch, t["autocast_dtype"]))

    phases = []
    for _ in range(steps):
        ph: Dict[str, Any] = {}
        mem.reset_peak()
        start = time.perf_counter()

        with autocast():
            out = model(input_ids=ids, labels=ids)
        loss = out.loss
        del out  # only the loss (and the graph behind it) lives on into backward
        ph["forward"] = mem.peak()
        reserved = [mem.peak_reserved()]

        mem.reset_peak()
        loss.backward()
        del loss
        ph["backward"] = mem.peak()
        reserved.append(mem.peak_reserved())

        mem.reset_peak()
        optimizer.step()
        ph["optimizer_step"] = mem.peak()
        reserved.append(mem.peak_reserved())

        optimizer.zero_grad(set_to_none=True)
        ph["end"] = mem.allocated()
        mem.sync()
        ph["seconds"] = time.perf_counter() - start
        ph["reserved"] = _max(reserved)
        ph["peak"] = _max([ph["forward"], ph["backward"], ph["optimizer_step"]])
        phases.append(ph)

    steady = phases[1:]
    forward = _max(p["forward"] for p in steady)
    backward = _max(p["backward"] for p in steady)
    optimizer_step = _max(p["optimizer_step"] for p in steady)
    return {
        "params_total": None if t["method"] == "qlora" else params_total,
        "params_trainable": params_trainable,
        "weights_mib": round_or_none(weights_mib),
        "persistent_after_step_mib": round_or_none(steady[0]["end"]),
        "forward_peak_mib": round_or_none(forward),
        "backward_peak_mib": round_or_none(backward),
        "optimizer_step_peak_mib": round_or_none(optimizer_step),
        "peak_allocated_mib": round_or_none(_max([forward, backward, optimizer_step])),
        "first_step_peak_mib": round_or_none(phases[0]["peak"]),
        "max_reserved_mib": round_or_none(_max(p["reserved"] for p in phases)),
        "step_seconds": round(min(p["seconds"] for p in steady), 4),
    }


def load_cases(source: Union[str, "os.PathLike[str]", Iterable[Mapping[str, Any]]]) -> List[Dict[str, Any]]:
    """Cases from a JSON-lines file (one case a line; a JSON list also works) or a list.

    Every case is validated up front, so a typo fails before any GPU time is spent;
    the VramError names the case.
    """
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise VramError(f"cannot read cases file {shown(str(path))}: {exc.strerror or exc}", field="cases") from exc
        except UnicodeDecodeError:
            raise VramError(f"cases: {shown(str(path))} is not UTF-8 text (a JSON-lines file)", field="cases") from None
        raw: List[Any] = []
        try:
            if text.lstrip().startswith("["):
                try:
                    raw = json.loads(text)
                except json.JSONDecodeError as exc:
                    raise VramError(f"cases: {path}: not valid JSON ({exc})", field="cases") from exc
            else:
                for lineno, line in enumerate(text.splitlines(), 1):
                    if not line.strip():
                        continue
                    try:
                        raw.append(json.loads(line))
                    except json.JSONDecodeError as exc:
                        raise VramError(f"cases: {path}:{lineno}: not valid JSON ({exc.msg})", field="cases") from exc
        except RecursionError:
            raise VramError(f"cases: {path} nests deeper than a case", field="cases") from None
        if not isinstance(raw, list):
            raise VramError(f"cases: {path} holds a {type(raw).__name__}, not a list of cases", field="cases")
        where = [f"{path}:{i}" for i in range(1, len(raw) + 1)]
    else:
        raw = list(source)
        where = [f"case {i}" for i in range(1, len(raw) + 1)]
    cases = []
    for label, item in zip(where, raw):
        try:
            cases.append(normalize_case(item))
        except VramError as exc:
            ident = item.get("id") if isinstance(item, Mapping) else None
            raise VramError(f"{label}{f' ({ident})' if ident else ''}: {exc}", field=exc.field) from exc
    return cases


def _is_oom(exc: BaseException) -> bool:
    try:
        import torch

        if isinstance(exc, torch.cuda.OutOfMemoryError):
            return True
    except ImportError:  # pragma: no cover
        pass
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def _release_device_memory() -> None:
    gc.collect()
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()


def measure_file(
    cases: Union[str, "os.PathLike[str]", Iterable[Mapping[str, Any]]],
    out_path: Union[str, "os.PathLike[str]"],
    *,
    device: Any = "cuda",
    deadline_s: Optional[float] = None,
    only: Optional[str] = None,
    steps: int = 3,
    log: Optional[IO[str]] = None,
    snapshot_dir: Optional[Union[str, "os.PathLike[str]"]] = None,
) -> List[Dict[str, Any]]:
    """Measure many cases, appending one JSON line per case to ``out_path`` (``"-"``: stdout).

    ``cases`` is a JSON-lines file or a list of case dicts (all validated before the
    first run).  ``only`` keeps the cases whose id or name contains that substring.
    ``deadline_s`` is a budget in seconds from the call: once it has passed, no
    further case is started.  A case that runs out of device memory is recorded as
    ``{"id", "name", "model", "training", "oom": true, "error"}``, a case that fails
    otherwise (e.g. QLoRA without bitsandbytes) likewise with ``"oom": false``; the
    run goes on with the next case.  Each line is flushed as soon as it is written.
    Progress goes to ``log`` (e.g. ``sys.stderr``) when given.  ``snapshot_dir``: each
    case's allocator snapshot is written there as ``<id>.pickle`` (CUDA only; see
    :func:`measure_case`).  Returns the records written, in order.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
        raise VramError(f"steps must be an integer >= 2; got {shown(steps)}", field="steps")
    selected = load_cases(cases)
    if only:
        selected = [c for c in selected if only in c["id"] or only in c["name"]]
    say = (lambda msg: print(msg, file=log, flush=True)) if log is not None else (lambda msg: None)
    started = time.monotonic()
    records: List[Dict[str, Any]] = []
    out_file: IO[str]
    own_file = str(out_path) != "-"
    out_file = open(out_path, "a", encoding="utf-8") if own_file else sys.stdout
    try:
        for case in selected:
            elapsed = time.monotonic() - started
            if deadline_s is not None and elapsed >= deadline_s:
                say(f"{case['id']}: skipped, deadline of {deadline_s:g} s reached")
                continue
            t0 = time.monotonic()
            failure: Optional[Dict[str, Any]] = None
            try:
                snap = os.path.join(str(snapshot_dir), f"{case['id']}.pickle") if snapshot_dir else None
                if snap:
                    os.makedirs(str(snapshot_dir), exist_ok=True)
                record = measure_case(case, device=device, steps=steps, snapshot_path=snap)
            except Exception as exc:  # noqa: BLE001 - recorded, and the run goes on
                oom = _is_oom(exc)
                if oom:
                    message = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else "out of memory"
                elif isinstance(exc, VramError):
                    message = f"VramError: {exc}"
                else:
                    message = traceback.format_exc()[-1500:]
                failure = {"id": case["id"], "name": case["name"], "model": case["model"],
                           "training": case["training"], "oom": oom, "error": message}
            if failure is not None:
                record = failure
                _release_device_memory()  # the traceback that held the tensors is gone now
            out_file.write(json.dumps(record) + "\n")
            out_file.flush()
            records.append(record)
            seconds = time.monotonic() - t0
            if "measured" in record:
                m = record["measured"]
                peak = m["peak_allocated_mib"]
                peak_text = "n/a (no memory stats)" if peak is None else f"{peak:.1f} MiB"
                say(f"{case['id']} {case['name']}: peak {peak_text}, step {m['step_seconds']:.4f} s "
                    f"({seconds:.1f} s)")
            else:
                kind = "out of memory" if record["oom"] else "failed"
                first = record["error"].strip().splitlines()[-1] if record["error"].strip() else ""
                say(f"{case['id']} {case['name']}: {kind}: {first[:200]}")
    finally:
        if own_file:
            out_file.close()
    return records


# --------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing usage and exiting, so main() returns 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise _UsageError(message)


#: single-setup flags: (flag, dest, argparse kwargs)
_SETUP_FLAGS = [
    ("--name", "name", dict(help="name of the setup (default: the model type)")),
    ("--id", "case_id", dict(help="id of the record (default: NAME-METHOD-bB-sS)")),
    ("--method", "method", dict(help=f"one of {', '.join(METHODS)} (default full)")),
    ("--weights-dtype", "weights_dtype", dict(help="float32, bfloat16 or float16 (default bfloat16)")),
    ("--autocast-dtype", "autocast_dtype", dict(help="bfloat16 or float16 autocast around forward (default none)")),
    ("--optimizer", "optimizer", dict(help=f"one of {', '.join(OPTIMIZERS)} (default adamw)")),
    ("--gradient-checkpointing", "gradient_checkpointing",
     dict(action="store_const", const=True, help="turn on gradient checkpointing")),
    ("--attn-implementation", "attn_implementation",
     dict(help=f"one of {', '.join(ATTN_IMPLEMENTATIONS)} (default sdpa)")),
    ("--batch-size", "batch_size", dict(type=int, help="micro-batch size (default 1)")),
    ("--seq-len", "seq_len", dict(type=int, help="sequence length in tokens (default 512)")),
    ("--lora-r", "lora_r", dict(type=int, help="LoRA rank (default 16)")),
    ("--lora-alpha", "lora_alpha", dict(type=float, help="LoRA alpha (default 32)")),
    ("--lora-dropout", "lora_dropout", dict(type=float, help="LoRA dropout (default 0.0)")),
    ("--lora-targets", "lora_targets",
     dict(help="comma-separated module names (default: attention and MLP projections)")),
    ("--quant-type", "quant_type", dict(help="QLoRA 4-bit type: nf4 or fp4 (default nf4)")),
    ("--no-double-quant", "double_quant", dict(action="store_const", const=False,
                                               help="QLoRA without double quantization")),
    ("--compute-dtype", "compute_dtype", dict(help="QLoRA compute dtype (default bfloat16)")),
    ("--prepare-kbit", "prepare_model_for_kbit_training",
     dict(action="store_const", const=True, help="QLoRA: use peft's prepare_model_for_kbit_training")),
]


def _parser() -> _Parser:
    p = _Parser(
        prog="vramwidget measure",
        usage="vramwidget measure CASES.jsonl [--out OUT.jsonl] [--device cuda] [--only SUBSTR] [--deadline S]\n"
              "       vramwidget measure --model CONFIG.json [--method lora] [--batch-size 2] [--seq-len 512] "
              "[...] [--out OUT.jsonl]",
        description="Measure GPU memory of real training steps (random weights, random tokens) and append "
                    "one JSON line per case in the format of vramwidget/data/h200_training_a.jsonl.",
        epilog="examples:\n"
               "  vramwidget measure cases.jsonl --out measured.jsonl --deadline 3000\n"
               "  vramwidget measure --model config.json --method lora --batch-size 2 --seq-len 512 "
               "--out measured.jsonl",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("cases", nargs="?", help="JSON-lines file of cases (id, name, model, training)")
    p.add_argument("--out", default="-", help="JSON-lines file to append records to (default: stdout)")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (cpu: no memory statistics)")
    p.add_argument("--steps", type=int, default=3, help="training steps per case, at least 2 (default 3)")
    p.add_argument("--only", help="only cases whose id or name contains this")
    p.add_argument("--deadline", type=float, help="start no case after this many seconds")
    p.add_argument("--snapshots", help="folder for each case's allocator snapshot, <id>.pickle (CUDA only)")
    setup = p.add_argument_group("a single setup (instead of CASES)")
    setup.add_argument("--model", help="config.json of the architecture (or a folder holding one)")
    for flag, dest, kwargs in _SETUP_FLAGS:
        setup.add_argument(flag, dest=dest, default=None, **kwargs)
    return p


def _read_model_config(path: str) -> Dict[str, Any]:
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise VramError(f"--model: cannot read {shown(str(p))}: {exc.strerror or exc}", field="model") from exc
    except json.JSONDecodeError as exc:
        raise VramError(f"--model: {shown(str(p))} is not valid JSON ({exc.msg})", field="model") from exc
    return data


def _setup_case(args: argparse.Namespace) -> Dict[str, Any]:
    model = _read_model_config(args.model)
    training: Dict[str, Any] = {}
    for key in ("method", "weights_dtype", "autocast_dtype", "optimizer", "gradient_checkpointing",
                "attn_implementation", "batch_size", "seq_len", "prepare_model_for_kbit_training"):
        value = getattr(args, key)
        if value is not None:
            training[key] = value
    lora = {k: v for k, v in (("r", args.lora_r), ("alpha", args.lora_alpha), ("dropout", args.lora_dropout),
                              ("target_modules", args.lora_targets)) if v is not None}
    quant = {k: v for k, v in (("quant_type", args.quant_type), ("double_quant", args.double_quant),
                               ("compute_dtype", args.compute_dtype)) if v is not None}
    if lora:
        training["lora"] = lora
    if quant:
        training["quantization"] = quant
    name = args.name or (model.get("model_type") if isinstance(model, dict) else None) or "model"
    return case_from_setup(model, name, case_id=args.case_id, **training)


def main(argv: Optional[List[str]] = None) -> int:
    """``vramwidget measure``: 0 when every case ran (out of memory counts as a result),
    1 when a case failed otherwise, 2 on bad usage or input (one line on stderr)."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except _UsageError as exc:
        print(f"vramwidget measure: error: {exc}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help
        return int(exc.code or 0)

    setup_given = [flag for flag, dest, _ in _SETUP_FLAGS if getattr(args, dest) is not None]
    try:
        if args.cases and args.model:
            raise VramError("give either a CASES file or --model, not both", field="cases")
        if args.model:
            case = _setup_case(args)
            check_requirements(case, args.device)  # fail before loading torch on a hopeless setup
            cases: Any = [case]
        elif args.cases:
            if setup_given:
                raise VramError(f"{setup_given[0]} describes a single setup and needs --model, not a CASES file",
                                field="cases")
            cases = load_cases(args.cases)
        else:
            raise VramError("nothing to measure: give a CASES.jsonl file or --model CONFIG.json", field="cases")
        if args.steps < 2:
            raise VramError(f"--steps must be at least 2; got {args.steps}", field="steps")
        resolve_device(args.device)
        records = measure_file(cases, args.out, device=args.device, deadline_s=args.deadline, only=args.only,
                               steps=args.steps, log=sys.stderr, snapshot_dir=args.snapshots)
    except VramError as exc:
        print(f"vramwidget measure: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # e.g. --out in a folder that does not exist
        where = f" {exc.filename!r}" if exc.filename else ""
        print(f"vramwidget measure: error: cannot write{where}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("vramwidget measure: interrupted", file=sys.stderr)
        return 130
    failed = [r for r in records if "measured" not in r and not r.get("oom")]
    return 1 if failed else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
