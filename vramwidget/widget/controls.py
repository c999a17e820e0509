"""The widget's controls: which input trait each one sets, how it is drawn and where it sits.

This list is the frontend's one source for its inputs: the JavaScript builds every control
from the ``controls`` trait and subscribes to the traits named there (no copy of the list
in ``js/``).  Every input trait of :mod:`.state` (``INPUTS``) has exactly one entry.

Progressive disclosure: about a dozen controls are visible by default, in fixed *slots* of
the core group (the same slot holds a training control and its inference counterpart, so
no control moves when the mode changes; a control both modes use keeps its slot); the rest
sit in named groups that open on a click and remember whether they are open.

Each entry: ``name`` (the trait), ``label``, ``hint`` (the tooltip), ``kind`` (select,
number, checkbox, checks: a list of checkboxes, model: the preset / Hub id box, mode: the
training / inference switch, config: the config.json box), ``group`` (``core`` or one of
:data:`GROUPS`), ``slot`` (core only: its place), ``mode`` (``training`` / ``inference``:
shown only then; absent: both), ``hidden_unless_enabled`` (shown only when it applies to
the model, e.g. an encoder-decoder's target length); numbers: ``number`` (int / float),
``optional`` (blank allowed), ``min``, ``max``, ``step``, ``placeholder``.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

from ..training import FIELDS
from .state import DERIVED_INPUTS, INPUTS

#: the named groups under the core controls: (key, title, title in inference mode, hint)
GROUPS: Tuple[Tuple[str, str, str, str], ...] = (
    ("multigpu", "Multi-GPU", "GPUs per replica", "Data, tensor and pipeline parallel, sharding, CPU offload"),
    ("knobs", "Knobs", "Knobs", "Gradient accumulation, LoRA settings, quantization details, frozen layers"),
    ("stack", "Stack and memory savers", "Stack and memory savers",
     "The training stack's defaults and code paths; losses without full logits, offloading, compile"),
    ("import", "Import config", "Import config", "A config.json, or your own training config, fills the controls"),
)

#: the core slots: (training control, inference control); None: that slot is empty in that mode
CORE_SLOTS: Tuple[Tuple[Any, Any], ...] = (
    ("mode", "mode"),
    ("model", "model"),
    ("gpu", "gpu"),
    ("num_gpus", "engine"),
    ("method", "weights"),
    ("precision", "kv_cache_dtype"),
    ("quantization", "gpu_memory_utilization"),
    ("attn_implementation", "attn_implementation"),
    ("batch_size", "batch_size"),
    ("seq_len", "context_len"),
    ("target_len", "prompt_len"),
    ("optimizer", None),
    ("gradient_checkpointing", None),
)


def _c(name: str, kind: str, label: str, hint: str, group: str = "core", **kw: Any) -> Dict[str, Any]:
    return dict(name=name, kind=kind, label=label, hint=hint, group=group, **kw)


def _n(name: str, label: str, hint: str, number: str = "int", *, group: str = "core", min: float = 1,
       step: Any = 1, max: Any = None, optional: bool = False, placeholder: str = "", **kw: Any) -> Dict[str, Any]:
    out = _c(name, "number", label, hint, group, number=number, min=min, step=step, optional=optional,
             placeholder=placeholder, **kw)
    if max is not None:
        out["max"] = max
    return out


#: the controls written out, in the order of their group (core: by slot)
WRITTEN_CONTROLS: Tuple[Dict[str, Any], ...] = (
    # -- core -----------------------------------------------------------------------------
    _c("mode", "mode", "Estimate", "What the estimate is of: one training step, or generate() / serving"),
    _c("model", "model", "Model", "Preset or Hub id: type to search the presets; or a Hub id, e.g. "
       "meta-llama/Llama-3.1-8B, or a size like 7B"),
    _c("gpu", "select", "GPU", "The card to fit on; with several GPUs, each is this kind"),
    _n("num_gpus", "GPUs", "GPUs of the run; above 1 needs a data-parallel strategy (DDP is picked; "
       "Multi-GPU for ZeRO, FSDP, tensor and pipeline parallel)", mode="training"),
    _c("engine", "select", "Engine", "generate(), or a serving engine whose start-up memory profile sizes the "
       "KV cache", mode="inference"),
    _c("method", "select", "Method", "What trains: every weight, LoRA adapters, or the last layers", mode="training"),
    _c("weights", "select", "Weights", "Storage format of the weights for inference", mode="inference"),
    _c("precision", "select", "Precision", "Storage and compute dtypes of weights, gradients and states",
       mode="training"),
    _c("kv_cache_dtype", "select", "KV cache", "dtype of the key/value cache (auto: the compute dtype)",
       mode="inference"),
    _c("quantization", "select", "Base weights", "Storage format of the frozen base weights (QLoRA: NF4)",
       mode="training"),
    _n("gpu_memory_utilization", "Serving", "Serving budget. Blank: generate(). A fraction such as 0.9: a "
       "vLLM-style server whose paged KV cache fills that share of the GPU", "float", min=0.05, step=0.05, max=1,
       optional=True, placeholder="none", mode="inference"),
    _c("attn_implementation", "select", "Attention", "eager materialises batch x heads x seq x seq scores"),
    _n("batch_size", "Batch size", "Micro-batch: sequences per forward pass (per GPU replica)"),
    _n("seq_len", "Sequence", "Sequence length: tokens per sequence (an encoder-decoder's input)", mode="training"),
    _n("context_len", "Context", "Context length: tokens per sequence at the end of generation (prompt + "
       "generated)", mode="inference"),
    _n("prompt_len", "Prompt", "Prompt tokens per sequence; the rest of the context is generated one decode "
       "step a token (blank: the whole context is the prompt, the worst prefill)", optional=True,
       placeholder="= context", mode="inference"),
    _n("target_len", "Target", "Encoder-decoders (T5, BART): target tokens per sample, what the decoder, head "
       "and loss read (blank: as long as the sequence)", optional=True, placeholder="= sequence", mode="training",
       hidden_unless_enabled=True),
    _c("optimizer", "select", "Optimizer", "Optimizer state per trainable parameter", mode="training"),
    _c("gradient_checkpointing", "select", "Checkpointing", "Recompute activations in the backward pass",
       mode="training"),
    # -- Multi-GPU (tensor and pipeline parallel first: both modes use them, in the same place) --
    _n("tensor_parallel", "Tensor par.", "Tensor parallel: heads, MLP width and vocabulary split over this many "
       "GPUs", group="multigpu"),
    _n("pipeline_parallel", "Pipeline", "Pipeline stages: layers split into this many stages (1F1B)",
       group="multigpu"),
    _c("strategy", "select", "Strategy", "How data-parallel replicas store parameters, gradients and optimizer "
       "states", "multigpu", mode="training"),
    _c("offload_optimizer", "checkbox", "Optimizer states on the CPU", "DeepSpeed ZeRO-Offload (ZeRO-1, 2 or 3)",
       "multigpu", mode="training"),
    _c("offload_params", "checkbox", "Parameters on the CPU", "ZeRO-3 parameter offload or FSDP CPUOffload",
       "multigpu", mode="training"),
    _n("max_gpus", "Max GPUs", "The most GPUs a suggestion may use (8: one node)", group="multigpu",
       mode="training"),
    # -- Knobs ---------------------------------------------------------------------------
    _n("grad_accum_steps", "Grad. accum.", "Gradient accumulation steps (same peak, more sequences per step)",
       group="knobs", mode="training"),
    _n("trainable_layers", "Last layers", "Method 'last layers': how many of the last layers train (blank: all)",
       group="knobs", optional=True, placeholder="all", mode="training"),
    _n("lora_r", "LoRA rank", "LoRA rank r", group="knobs", mode="training"),
    _n("lora_alpha", "LoRA alpha", "LoRA alpha (scales the update; no memory effect)", "float", group="knobs",
       min=0, step="any", mode="training"),
    _n("lora_dropout", "LoRA dropout", "LoRA dropout probability, in [0, 1)", "float", group="knobs", min=0,
       step=0.05, max=0.99, mode="training"),
    _c("lora_targets", "checks", "LoRA targets", "Linear modules LoRA adapts", "knobs", mode="training",
       all_label="every linear layer"),
    _c("double_quant", "checkbox", "Double quantization", "Quantize the 4-bit quantization constants too",
       "knobs", mode="training"),
    _c("prepare_kbit", "checkbox", "prepare_model_for_kbit_training", "Upcasts non-quantized parameters to fp32",
       "knobs", mode="training"),
    _c("quantized_groups", "checks", "Quantized module groups", "Which module groups are stored quantized",
       "knobs", mode="training"),
    # -- Stack and memory savers ---------------------------------------------------------
    _c("stack", "select", "Stack", "Training stack: its defaults and where its code keeps other tensors", "stack",
       mode="training"),
    _c("loss", "select", "Loss", "Cross-entropy: full logits, chunked, or Liger's fused linear cross-entropy",
       "stack", mode="training"),
    _n("loss_chunks", "Loss chunks", "Chunks of the chunked cross-entropy", group="stack",
       max=FIELDS["loss_chunks"].hi, mode="training"),
    _c("lora_variant", "select", "LoRA variant", "LoRA or DoRA (weight-decomposed)", "stack", mode="training"),
    _c("activation_offloading", "checkbox", "Offload activations", "Saved activations in CPU memory (torchtune)",
       "stack", mode="training"),
    _c("optimizer_in_backward", "checkbox", "Optimizer in backward", "Step each parameter as its gradient is ready",
       "stack", mode="training"),
    _c("packing", "checkbox", "Packed sequences", "No padding: varlen attention (FlashAttention 2 on HF)",
       "stack", mode="training"),
    _c("compile", "checkbox", "torch.compile", "Modelled with full checkpointing: the fused cross-entropy",
       "stack", mode="training"),
    # -- Import config -------------------------------------------------------------------
    _c("config_json", "config", "config.json", "Paste or upload a model's config.json: it is the model", "import"),
)


def field_control(name: str) -> Dict[str, Any]:
    """The control of a setup field from its declaration (training.FIELDS) alone: in the Knobs
    group, training mode, its description as the hint; a checkbox (bool), a select (choice),
    checks (names) or a number box (int, number: its range; blank allowed where None is the
    default)."""
    f = FIELDS[name]
    label = name.replace("_", " ").capitalize()
    if f.kind in ("int", "number"):
        lo = f.lo if f.lo is not None else (1 if f.kind == "int" else 0)
        return _n(name, label, f.doc, "int" if f.kind == "int" else "float", group="knobs", min=lo,
                  step=1 if f.kind == "int" else "any", max=f.hi, optional=f.default is None,
                  placeholder="none" if f.default is None else "", mode="training")
    kind = {"bool": "checkbox", "choice": "select", "names": "checks"}[f.kind]
    return _c(name, kind, label, f.doc, "knobs", mode="training")


#: every control, in the order of its group (core: by slot): those written out, then one per
#: setup field declared only in training.FIELDS (the end of the Knobs group)
CONTROLS: Tuple[Dict[str, Any], ...] = WRITTEN_CONTROLS + tuple(
    field_control(k) for k in DERIVED_INPUTS if k not in {c["name"] for c in WRITTEN_CONTROLS})


def _check() -> None:
    names = [c["name"] for c in CONTROLS]
    assert len(names) == len(set(names)) and set(names) == set(INPUTS), set(names) ^ set(INPUTS)
    slotted = {x for pair in CORE_SLOTS for x in pair if x}
    assert slotted == {c["name"] for c in CONTROLS if c["group"] == "core"}


_check()


def controls_spec() -> List[Dict[str, Any]]:
    """The ``controls`` trait: every control with its slot (core) or its group's order, and
    its trait's default (a group holding a control set away from it opens by itself)."""
    from .state import State

    traits = State.class_traits()
    slot = {}
    for i, (tr, inf) in enumerate(CORE_SLOTS):
        for name in (tr, inf):
            if name:
                slot[name] = i
    out = []
    for c in CONTROLS:
        d = dict(c, default=traits[c["name"]].default())
        if c["group"] == "core":
            d["slot"] = slot[c["name"]]
        out.append(d)
    return out


def groups_spec() -> List[Dict[str, str]]:
    """The ``control_groups`` part of the trait: key, title (per mode) and hint of each group."""
    return [{"key": k, "title": t, "title_inference": ti, "hint": h} for k, t, ti, h in GROUPS]


def visible_by_default(mode: str = "training") -> List[str]:
    """The controls shown with every group closed (the core of ``mode``), in slot order;
    a control hidden unless it applies (``hidden_unless_enabled``) is left out."""
    out = []
    for tr, inf in CORE_SLOTS:
        name = tr if mode == "training" else inf
        c = next((x for x in CONTROLS if x["name"] == name), None) if name else None
        if c and not c.get("hidden_unless_enabled"):
            out.append(name)
    return out
