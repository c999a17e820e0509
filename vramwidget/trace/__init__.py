"""The tracing backend: any transformers model, one training step run on fake tensors.

``estimate_traced(model, setup)`` builds the model from its config alone under PyTorch's
``FakeTensorMode`` (no weights, no GPU, no memory), runs the step that the validation
cases measured with an allocation ledger that accounts as the CUDA caching allocator does,
and returns the same :class:`~vramwidget.result.Estimate` as the analytic path, with
``backend == "trace"``.  It needs the ``trace`` extra (``pip install "vramwidget[trace]"``:
torch, transformers, peft); this module itself imports none of them until a trace runs.

Traces are cached per model config and setup; a size profile in batch and sequence
(``profile.py``) makes later estimates of the same model and setup instant.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any, Dict, Mapping, Optional, Tuple

from ..errors import VramError
from ..inputs import shown
from ..result import Estimate
from ..training import TrainingSetup

#: the pip extra that brings what a trace needs
INSTALL_HINT = 'pip install "vramwidget[trace]"'
_LOCK = threading.Lock()


def available() -> bool:
    """Whether torch, transformers and peft can be imported (without importing them)."""
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers", "peft"))


def resolve_config(model: Any) -> Tuple[str, Dict[str, Any]]:
    """(name, config.json dict) of what a user typed: a dict, an Architecture, a preset, a path or a Hub id."""
    from ..model.architecture import Architecture, parse_config_text

    if isinstance(model, Architecture):
        return model.name, dict(model.config)
    if isinstance(model, Mapping):
        return str(model.get("_name_or_path") or model.get("model_type") or "custom"), dict(model)
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    if not isinstance(model, str) or not model.strip():
        raise VramError("model: the trace backend needs a config: a preset name, a config.json path or dict, or "
                        "a Hub id", field="model")
    key = model.strip()
    from ..model import presets

    if os.path.isdir(key) and os.path.isfile(os.path.join(key, "config.json")):
        key = os.path.join(key, "config.json")
    if key.endswith(".json") or os.path.isfile(key):
        try:
            with open(key, encoding="utf-8") as f:
                return os.path.basename(os.path.dirname(os.path.abspath(key))) or "custom", parse_config_text(
                    f.read(), source=key)
        except OSError as e:
            raise VramError(f"config: cannot read {shown(key)}: {e.strerror or e}", field="model") from None
    preset = presets.find(key)
    if preset is not None:
        return preset["name"], dict(preset["config"])
    if "/" in key and not key.startswith((".", "/")):
        from ..model.hub import fetch_config

        return key, fetch_config(key)
    if key[:1].isdigit():
        raise VramError(f"model: {shown(key)} is a parameter count; the trace backend needs the model's config.json "
                        f"(a preset, a path, a dict or a Hub id)", field="model")
    raise presets.unknown_preset_error(key)


def refusal(config: Mapping[str, Any]) -> Optional[str]:
    """Why no backend can build this config, or None.

    Remote code (``auto_map``: the modelling file lives in the model's repository) is never
    run; a model_type this transformers does not know cannot be built from its config.
    """
    mt = config.get("model_type")
    if config.get("auto_map") or config.get("trust_remote_code"):
        cls = next(iter((config.get("auto_map") or {}).values()), "its own modelling code")
        return (f"model: {mt or 'this model'} needs remote code ({cls}), which vramwidget never runs; use a "
                f"transformers-native port of the architecture (a config whose model_type transformers knows) "
                f"or vw.custom(...) with its sizes")
    if not mt:
        return "model: the config has no 'model_type'; the trace backend needs one transformers knows"
    try:
        from transformers import CONFIG_MAPPING
    except ImportError:
        return None
    if mt not in CONFIG_MAPPING:
        import transformers

        return (f"model: transformers {transformers.__version__} has no model_type {mt!r}; it needs remote code or "
                f"a newer transformers (pip install -U transformers), or vw.custom(...) with its sizes")
    return None


#: setup fields whose non-default values the traced step does not run (their stacks' code is
#: not transformers' + peft's): the analytic path models them
_UNTRACED = {"loss": "standard", "activation_offloading": False, "optimizer_in_backward": False,
             "packing": False, "compile": False, "stack": "hf", "optimizer_state_dtypes": None}
_UNTRACED_PRECISION = ("bf16_fp32_states", "fp8")


def _check_setup(s: TrainingSetup) -> None:
    for f, default in _UNTRACED.items():
        v = getattr(s, f, default)
        if v != default and not (f == "loss" and v is None):
            raise VramError(f"{f}: the trace backend runs Hugging Face transformers + peft as they are and cannot "
                            f"trace {f}={shown(v)}; use backend='analytic' (a modelled family) or {f}={shown(default)}",
                            field=f)
    if s.precision in _UNTRACED_PRECISION:
        raise VramError(f"precision: {shown(s.precision)} needs a training stack beyond transformers + PyTorch optimizers "
                        f"(fp32 optimizer states of bf16 weights, fp8 matmuls); the trace backend runs bf16, fp16, "
                        f"fp32, amp_bf16 and amp_fp16; use backend='analytic' for a modelled family",
                        field="precision")


def _encoder_decoder(config: Mapping[str, Any]) -> bool:
    if "is_encoder_decoder" in config:
        return bool(config["is_encoder_decoder"])
    from transformers import AutoConfig

    return bool(getattr(AutoConfig.for_model(config["model_type"]), "is_encoder_decoder", False))


def _key(config: Mapping[str, Any], s: TrainingSetup, task: str) -> str:
    return json.dumps([config, s.to_dict(), task], sort_keys=True, default=str)


_CACHE: Dict[str, Estimate] = {}


def cache_clear() -> None:
    """Forget every cached trace and profile (tools/readme_figures.py times a cold trace)."""
    from . import profile

    _CACHE.clear()
    profile.clear()


#: the model class a trace builds for each task (the names the analytic families use)
TASKS = ("causal_lm", "seq2seq_lm", "masked_lm")


def estimate_traced(model: Any, s: TrainingSetup, cuda: Any, *, task: Optional[str] = None) -> Estimate:
    """The Estimate of one training step of ``model`` under ``s``, traced (see the module docstring).

    ``cuda`` is :class:`~vramwidget.trace.assemble.CudaAccounting` (estimate.py makes it:
    the workspace, context and reserve the analytic path counts too).  Raises VramError with
    one line when the extra is missing or the model cannot be built.
    """
    if not available():
        raise VramError(f"backend: the trace backend needs torch, transformers and peft: {INSTALL_HINT}",
                        field="backend")
    _check_setup(s)
    name, config = resolve_config(model)
    why = refusal(config)
    if why:
        raise VramError(why, field="model")
    if task is None:   # the class a user fine-tunes: seq2seq LM for encoder-decoders, else causal LM
        task = "seq2seq_lm" if _encoder_decoder(config) else "causal_lm"
    if task not in TASKS:
        raise VramError(f"task: the trace backend builds {', '.join(TASKS)}; got {task!r}", field="task")
    if s.trains_adapters and not s.lora_targets:
        s = s.replace(lora_targets=default_lora_targets(config))
    from . import profile

    return profile.estimate(name, config, s, cuda, task)


def default_lora_targets(config: Mapping[str, Any]):
    """The modules LoRA adapts when the user names none: those the analytic path takes for a
    modelled family (every linear layer of the blocks, not the MoE router), else peft's
    ``all-linear``."""
    from ..model.architecture import from_config

    try:
        arch = from_config(config)
    except VramError:
        return ("all-linear",)
    return tuple(arch.linear_modules())


