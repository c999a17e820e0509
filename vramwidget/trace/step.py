"""One training step of any transformers model, traced on fake tensors.

The step is the one the validation cases measured (``measure/training.py``, data/VALIDATION.md):
the model built from its config alone (``AutoModelFor<task>.from_config``), LoRA through
peft, ``prepare_model_for_kbit_training`` where asked, then ``loss = model(input_ids=ids,
labels=ids).loss``, ``loss.backward()``, ``optimizer.step()``,
``optimizer.zero_grad(set_to_none=True)``.  Everything runs under ``FakeTensorMode`` with
the allocation :class:`~vramwidget.trace.ledger.Ledger` on top, so no memory is used and
nothing but the config is needed.

After the step every recorded storage is labelled with what it was: parameters (weights,
adapters), gradients (``p.grad``), optimizer states, tensors autograd saved (activations;
from the output head on: logits and loss), and the rest by phase (forward working tensors,
backward working buffers, optimizer temporaries).
"""

from __future__ import annotations

import contextlib
import copy
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from ..errors import VramError
from ..inputs import shown
from ..training import TrainingSetup
from .events import Alloc
from .kernels import cuda_kernels
from .ledger import Ledger

LEARNING_RATE = 1e-5
_DIGITS = re.compile(r"\.\d+(?=\.|$)")


@dataclass
class StepLog:
    """What one traced step allocated, labelled, plus the model's parameter counts."""

    allocs: List[Alloc]
    marks: List[Tuple[str, int]]
    params_total: int
    params_trainable: int
    model_class: str
    notes: List[str] = field(default_factory=list)


def _group(module_path: str) -> str:
    """``model.layers.3.self_attn.q_proj`` -> ``layers.*.self_attn.q_proj`` (one group for every layer)."""
    p = module_path
    for prefix in ("base_model.model.", "model.", "transformer."):
        if p.startswith(prefix):
            p = p[len(prefix):]
    return _DIGITS.sub(".*", p) or "model"


def make_config(config: Mapping[str, Any]):
    """The transformers config object of a config.json dict (no remote code)."""
    from transformers import AutoConfig

    kw = copy.deepcopy(dict(config))   # transformers edits nested dicts (rope_parameters) in place
    mt = kw.pop("model_type")
    kw["use_cache"] = False
    for k in ("_name_or_path", "transformers_version", "architectures"):
        kw.pop(k, None)
    try:
        return AutoConfig.for_model(mt, **kw)
    except Exception as exc:  # noqa: BLE001 - the config class's own validators
        msg = " ".join(str(exc).split())[:200]
        raise VramError(f"model: transformers cannot build a {shown(mt)} config from this config.json ({msg})",
                        field="model") from None


def _optimizer(name: str, params: List[torch.nn.Parameter]):
    """The optimizers of measure/training.py, with the implementation PyTorch picks for CUDA tensors
    (foreach for AdamW and SGD: torch/optim/optimizer.py ``_default_to_fused_or_foreach``
    chooses it for CUDA parameters, and a CPU trace must ask for it)."""
    if name == "adamw":
        return torch.optim.AdamW(params, lr=LEARNING_RATE, foreach=True)
    if name == "adamw_fused":
        return torch.optim.AdamW(params, lr=LEARNING_RATE, fused=True)
    if name == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(params, lr=LEARNING_RATE, scale_parameter=False, relative_step=False)
    if name == "sgd_momentum":
        return torch.optim.SGD(params, lr=LEARNING_RATE, momentum=0.9, foreach=True)
    if name == "sgd":
        return torch.optim.SGD(params, lr=LEARNING_RATE, foreach=True)
    if name == "adamw_8bit":
        from .quantized import AdamW8bitStandIn

        return AdamW8bitStandIn(params, lr=LEARNING_RATE)
    raise VramError(f"optimizer: {shown(name)} runs bitsandbytes', lion-pytorch's or GaLore's own code, which the trace "
                    f"backend does not run on a CPU; use adamw, adamw_fused, adamw_8bit, adafactor, sgd or sgd_momentum, or "
                    f"backend='analytic' for a modelled family", field="optimizer")


def _model_class(task: str):
    import transformers

    name = {"causal_lm": "AutoModelForCausalLM", "seq2seq_lm": "AutoModelForSeq2SeqLM",
            "masked_lm": "AutoModelForMaskedLM"}[task]
    return getattr(transformers, name)


def build_model(config: Mapping[str, Any], s: TrainingSetup, task: str = "causal_lm",
                notes: Optional[List[str]] = None):
    """The model as measure/training.py builds it, on fake CPU tensors (call under FakeTensorMode)."""
    notes = notes if notes is not None else []
    cfg = make_config(config)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[s.weights_dtype]
    attn = "eager" if s.attn_implementation == "eager" else "sdpa"
    auto = _model_class(task)
    try:
        try:
            model = auto.from_config(cfg, dtype=dtype, attn_implementation=attn)
        except ValueError as exc:
            if attn != "sdpa" or "scaled_dot_product_attention" not in str(exc):
                raise
            # no SDPA path in this model's transformers code: transformers' default is eager
            model = auto.from_config(cfg, dtype=dtype, attn_implementation="eager")
            notes.append(f"{cfg.model_type} has no SDPA attention in transformers: traced with eager attention "
                         f"(b x a x s x s scores kept)")
    except (ValueError, ImportError, KeyError) as exc:
        msg = " ".join(str(exc).split())[:200]
        raise VramError(f"model: transformers cannot build {auto.__name__} for model_type {shown(cfg.model_type)} "
                        f"({msg})", field="model") from None
    model.config.use_cache = False
    return model


def _peft_wrap(model, s: TrainingSetup):
    import peft

    gc = s.gradient_checkpointing == "full"
    gc_kwargs = {"use_reentrant": False}
    if s.quantized and s.prepare_kbit:
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=gc,
                                                     gradient_checkpointing_kwargs=gc_kwargs)
    targets: Any = list(s.lora_targets or ("all-linear",))
    if targets == ["all-linear"]:
        targets = "all-linear"
    conv1d = any(type(m).__name__ == "Conv1D" for m in model.modules())
    cfg = peft.LoraConfig(r=s.lora_r, lora_alpha=s.lora_alpha, lora_dropout=s.lora_dropout,
                          target_modules=targets, fan_in_fan_out=conv1d,
                          use_dora=getattr(s, "lora_variant", "lora") == "dora",
                          modules_to_save=list(getattr(s, "modules_to_save", ()) or ()) or None)
    try:
        model = peft.get_peft_model(model, cfg)
    except ValueError as exc:
        raise VramError(f"lora_targets: {' '.join(str(exc).split())[:200]}", field="lora_targets") from None
    if gc:
        model.enable_input_require_grads()
    return model


def trace_step(config: Mapping[str, Any], s: TrainingSetup, *, task: str = "causal_lm") -> StepLog:
    """Run one training step of ``config`` under ``s`` on fake tensors and label every allocation."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if s.quantized:
        from .quantized import quantize_model
    else:
        quantize_model = None
    notes: List[str] = []
    led = Ledger()
    kinds: Dict[int, Tuple[str, str]] = {}   # alloc index -> (kind, group)

    def label(t: torch.Tensor, kind: str, group: str) -> None:
        idx = led.key(t)
        if idx is not None and idx not in kinds:
            kinds[idx] = (kind, group)

    from .autocast import cuda_policy

    with warnings.catch_warnings(), FakeTensorMode(allow_non_fake_inputs=False), led, cuda_kernels(
            attn_implementation=s.attn_implementation), (
            cuda_policy() if s.autocast else contextlib.nullcontext()):
        warnings.simplefilter("ignore")
        model = build_model(config, s, task, notes)
        if quantize_model is not None:
            quantize_model(model, s)
        if s.gradient_checkpointing == "full" and not (s.quantized and s.prepare_kbit):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if s.trains_adapters:
            model = _peft_wrap(model, s)
        elif s.method == "freeze":
            _freeze(model, s)
        model.train()
        params = list(model.named_parameters())
        total = sum(p.numel() for _, p in params)
        trainable = [p for _, p in params if p.requires_grad]
        n_trainable = sum(p.numel() for p in trainable)
        for name, p in params:
            label(p, "adapters" if "lora_" in name else "weights", _group(name.rsplit(".", 1)[0]))
        for name, b in model.named_buffers():
            label(b, "weights", "buffers")
        if not trainable:
            raise VramError("method: the model has no trainable parameters (check lora_targets)", field="method")
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        module_names = {id(m): n for n, m in model.named_modules()}
        stack: List[str] = []

        def pre(mod, args):
            stack.append(led.module)
            led.module = module_names.get(id(mod), "")
            if mod is head and led.phase.startswith("forward"):
                led.phase = "forward_head"

        def post(mod, args, out):
            led.module = stack.pop() if stack else ""

        hooks = [m.register_forward_pre_hook(pre) for m in model.modules()]
        hooks += [m.register_forward_hook(post) for m in model.modules()]
        opt = _optimizer(s.optimizer, trainable)
        ids = torch.zeros((s.batch_size, s.seq_len), dtype=torch.long)
        led.mark("after_load")
        saved: List[int] = []

        def pack(t):
            idx = led.key(t)
            if idx is not None:
                saved.append(idx)
            return t

        micro = min(s.grad_accum_steps, 2)
        for m in range(micro):
            led.mark("forward")
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _autocast(s):
                out = model(input_ids=ids, labels=ids)
            loss = out.loss
            del out
            led.mark("backward")
            loss.backward()
            del loss
        for name, p in params:
            if p.grad is not None:
                label(p.grad, "gradients", _group(name.rsplit(".", 1)[0]))
        led.mark("optimizer_step")
        opt.step()
        for group in opt.param_groups:
            for p in group["params"]:
                for k, v in opt.state.get(p, {}).items():
                    if isinstance(v, torch.Tensor):
                        label(v, "optimizer states", k)
        opt.zero_grad(set_to_none=True)
        led.mark("end")
        for h in hooks:
            h.remove()
        model_class = type(model).__name__
        del model, opt, params, trainable, ids
    for idx in saved:
        if idx not in kinds:
            a = led.allocs[idx]
            kinds[idx] = ("logits and loss" if a.phase == "forward_head" else "activations", _group(a.module))
    for idx, a in enumerate(led.allocs):
        kind, group = kinds.get(idx, ("", ""))
        if not kind:
            if a.phase == "load" or a.phase == "after_load":
                kind, group = "weights", "buffers"
            elif a.phase == "forward_head":
                kind, group = "logits and loss", _group(a.module) if a.module else "loss"
            elif a.phase == "forward":
                kind, group = "activations", "forward working tensors"
            elif a.phase == "backward":
                kind, group = "activations", "backward working buffers"
            else:
                kind, group = "optimizer temporaries", a.op
        a.kind, a.group = kind, group
        if a.phase == "forward_head":
            a.phase = "forward"
    return StepLog(led.allocs, led.marks, total, n_trainable, model_class, notes)


def _freeze(model, s: TrainingSetup) -> None:
    """Train the last ``trainable_layers`` blocks, the final norm and an untied head."""
    layers = None
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) and name.endswith(("layers", "h", "blocks")):
            layers = mod
            break
    if layers is None:
        raise VramError("method: 'freeze' needs a model with a list of blocks; this model has none",
                        field="method")
    for p in model.parameters():
        p.requires_grad_(False)
    for blk in list(layers)[-s.trainable_layers:]:
        for p in blk.parameters():
            p.requires_grad_(True)


def _autocast(s: TrainingSetup):
    if not s.autocast:
        return contextlib.nullcontext()
    from .autocast import cuda_autocast

    return cuda_autocast(torch.bfloat16 if s.compute_dtype == "bfloat16" else torch.float16)


def explain_failure(exc: BaseException, config: Mapping[str, Any]) -> str:
    """One line saying why a model could not be traced and what would work instead."""
    mt = config.get("model_type", "this model")
    kind = type(exc).__name__
    first = (str(exc).strip().splitlines() or [""])[0][:160]
    op = getattr(exc, "func", None)
    where = f" ({op})" if op is not None else ""
    if kind in ("DataDependentOutputException", "DynamicOutputShapeException", "GuardOnDataDependentSymNode") \
            or "data-dependent" in first or "data dependent" in first:
        return (f"model: {mt}'s code reads tensor values to choose its shapes{where}, which a trace on fake tensors "
                f"cannot follow (data-dependent shapes); what would work: a family module (backend='analytic') or a "
                f"measurement on a GPU (vramwidget measure)")
    if kind in ("UnsupportedOperatorException", "UnsupportedFakeTensorException") or (
            isinstance(exc, (NotImplementedError, RuntimeError)) and ("Meta" in first or "fake" in first.lower())):
        return (f"model: {mt} calls a kernel with no shape rule{where} (a custom CUDA kernel without a fake/meta "
                f"implementation), which the trace cannot run; what would work: transformers' native code path "
                f"(attn_implementation='sdpa' or 'eager', no custom kernels) or a family module")
    return f"model: tracing {mt} failed ({kind}: {first}); backend='analytic' covers the modelled families"
