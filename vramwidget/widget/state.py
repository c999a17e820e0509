"""The widget's state: every input and output trait, and the names that group them.

The input traits carry the names of the keyword arguments of :func:`vramwidget.estimate`,
:func:`vramwidget.parallel.estimate.estimate_parallel` and
:func:`vramwidget.inference.estimate.estimate_inference` (plus ``config_json``, ``gpu`` and ``mode``);
the output traits hold what the frontend draws.  Behaviour lives in the panel modules
(training, multigpu, inference, suggestions) and in :mod:`.calculator`, which joins them.
"""

from __future__ import annotations

import pathlib
from typing import Any, Dict, Optional, Tuple

import anywidget
import traitlets as t

from ..errors import VramError
from ..inputs import Field, guard_traits
from ..inputs import shown as short_repr
from ..result import Estimate
from ..parallel.strategies import BY_NAME
from ..training import FIELDS

_STATIC = pathlib.Path(__file__).resolve().parent.parent / "static"

DEFAULT_MODEL = "llama-3.2-1b"

#: the two kinds of question the widget answers
MODES: Tuple[str, ...] = ("training", "inference")

#: the keyword arguments of estimate() whose traits are written out in :class:`State`, in order
WRITTEN_INPUTS: Tuple[str, ...] = (
    "model", "method", "precision", "quantization", "double_quant", "quantized_groups",
    "prepare_kbit", "optimizer", "gradient_checkpointing", "attn_implementation",
    "batch_size", "seq_len", "target_len", "grad_accum_steps", "lora_r", "lora_alpha", "lora_dropout",
    "lora_targets", "trainable_layers", "stack", "loss", "loss_chunks", "activation_offloading",
    "optimizer_in_backward", "lora_variant", "packing", "compile",
)
#: setup fields (training.FIELDS) the widget has no input for; every other FIELDS entry is an
#: input trait: written out in State, or derived from its declaration (:class:`SetupTraits`)
NOT_INPUTS: Tuple[str, ...] = ("optimizer_state_dtypes", "modules_to_save", "galore_rank", "versions", "tf32",
                               "images_per_sample", "image_patches", "backend", "allocator")
#: the FIELDS entries whose trait (and control) comes from their declaration alone
DERIVED_INPUTS: Tuple[str, ...] = tuple(k for k in FIELDS if k not in WRITTEN_INPUTS and k not in NOT_INPUTS)
#: the keyword arguments of estimate() that the widget exposes, in order
ESTIMATE_INPUTS: Tuple[str, ...] = WRITTEN_INPUTS + DERIVED_INPUTS
#: the keyword arguments of estimate_parallel() beyond the setup, with their defaults: when
#: every one is at its default the widget runs the single-GPU estimate
PARALLEL_DEFAULTS: Dict[str, Any] = {
    "strategy": "none", "num_gpus": 1, "tensor_parallel": 1, "pipeline_parallel": 1,
    "offload_optimizer": False, "offload_params": False,
}
PARALLEL_INPUTS: Tuple[str, ...] = tuple(PARALLEL_DEFAULTS)
#: input traits of the widget itself (not estimate keywords): the ceiling of GPUs a
#: suggestion may use
WIDGET_INPUTS: Tuple[str, ...] = ("max_gpus",)
#: the keyword arguments of estimate_inference() the widget exposes (gpu too)
INFERENCE_KEYWORDS: Tuple[str, ...] = (
    "weights", "kv_cache_dtype", "batch_size", "context_len", "prompt_len", "attn_implementation",
    "gpu_memory_utilization", "engine",
)
#: input traits used only in inference mode
INFERENCE_INPUTS: Tuple[str, ...] = ("weights", "kv_cache_dtype", "context_len", "prompt_len", "gpu_memory_utilization",
                                     "engine")
#: input traits both modes use: the GPUs of one model replica are tensor_parallel x pipeline_parallel
#: (training adds num_gpus and a data-parallel strategy)
SHARED_PARALLEL: Tuple[str, ...] = ("tensor_parallel", "pipeline_parallel")
#: every input trait (what ``Calculator(...)`` accepts as keyword arguments)
INPUTS: Tuple[str, ...] = (ESTIMATE_INPUTS + ("config_json", "gpu", "mode") + PARALLEL_INPUTS
                           + INFERENCE_INPUTS + WIDGET_INPUTS)
#: input traits used only in training mode
TRAINING_ONLY: Tuple[str, ...] = tuple(
    k for k in ESTIMATE_INPUTS + PARALLEL_INPUTS + WIDGET_INPUTS
    if k not in ("model", "batch_size", "attn_implementation") + SHARED_PARALLEL)


def _doc(text: str) -> Dict[str, Any]:
    return {"help": text}


def field_trait(f: Field) -> t.TraitType:
    """The synced trait of a setup field, from its declaration: its kind's traitlets type, its
    default, its description as help (None allowed where None is the default)."""
    none = f.default is None
    if f.kind == "bool":
        trait: t.TraitType = t.Bool(f.default, **_doc(f.doc))
    elif f.kind == "int":
        trait = t.Int(f.default, allow_none=none, **_doc(f.doc))
    elif f.kind == "number":
        trait = t.Float(f.default, allow_none=none, **_doc(f.doc))
    elif f.kind in ("choice", "text"):
        trait = t.Unicode(f.default, allow_none=none, **_doc(f.doc))
    elif f.kind == "names":
        trait = t.List(t.Unicode(), default_value=None if none else list(f.default), allow_none=none, **_doc(f.doc))
    else:
        raise AssertionError(f"setup field {f.name} ({f.kind}) has no derived widget trait: write its trait "
                             f"in State or name it in NOT_INPUTS")
    return trait.tag(sync=True)


#: the traits of :data:`DERIVED_INPUTS`, made from training.FIELDS (State inherits them)
SetupTraits = type(t.HasTraits)("SetupTraits", (t.HasTraits,), dict(
    {k: field_trait(FIELDS[k]) for k in DERIVED_INPUTS}, __module__=__name__,
    __doc__="The input traits of the setup fields declared only in training.FIELDS."))


def estimate_fn():
    """vramwidget.estimate.estimate, imported on first use."""
    from ..estimate import estimate

    return estimate


class TracedModel:
    """A model whose family has no analytic module (vramwidget/model/families/): its config, which
    ``estimate(..., backend="auto")`` traces (vramwidget/trace/, seconds per setup; the
    widget runs it in its background worker)."""

    def __init__(self, name: str, config: Dict[str, Any], hub_id: Optional[str] = None) -> None:
        self.name = name
        self.config = dict(config, _name_or_path=name)
        self.hub_id = hub_id
        self.model_type = str(config.get("model_type", "?"))
        self.num_layers = config.get("num_hidden_layers") or config.get("n_layer") or 8
        self.max_position_embeddings = config.get("max_position_embeddings")

    def linear_modules(self):
        """The LoRA target choices of the analytic families' architectures; a traced model has no
        module list until it is built, so its LoRA targets stay the setup's own."""
        return []


def run_estimate(arch: Any, kind: str, kw: Dict[str, Any]) -> Any:
    """One estimate: ``kind`` is "train" (estimate), "par" (estimate_parallel: a
    ParallelEstimate) or "infer" (estimate_inference).  A :class:`TracedModel` is traced
    (training on one GPU only)."""
    if isinstance(arch, TracedModel):
        if kind != "train":
            what = "inference" if kind == "infer" else "a parallel layout"
            raise VramError(f"model: {arch.name} ({arch.model_type}) has no analytic family module, and the trace "
                            f"backend estimates one GPU's training step only, not {what}", field="model")
        return estimate_fn()(arch.config, **kw)
    if kind == "train":
        return estimate_fn()(arch, **kw)
    if kind == "par":
        from ..parallel.estimate import estimate_parallel

        return estimate_parallel(arch, **kw)
    from ..inference.estimate import estimate_inference

    return estimate_inference(arch, **kw)


def shown(result: Any) -> Estimate:
    """The Estimate the charts draw: a parallel run's worst GPU, else the estimate itself."""
    return getattr(result, "per_gpu", result)



class State(anywidget.AnyWidget, SetupTraits):
    """The traits of :class:`~vramwidget.widget.Calculator` (no behaviour here)."""

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
    seq_len = t.Int(2048, **_doc("Tokens per sequence (an encoder-decoder's input).")).tag(sync=True)
    target_len = t.Int(None, allow_none=True, **_doc(
        "An encoder-decoder's target tokens per sample (T5, BART: what the decoder, head and loss "
        "read); None = seq_len.  Shown only for such models; ignored (and hidden) for others.")).tag(sync=True)
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
    stack = t.Unicode("hf", **_doc(
        "Training stack: hf | axolotl | torchtune | litgpt | unsloth; choosing one applies its "
        "defaults (vramwidget/stacks.py) and its code paths.")).tag(sync=True)
    loss = t.Unicode("standard", **_doc(
        "Cross-entropy: standard | chunked (loss_chunks) | liger (fused linear, no full logits).")).tag(sync=True)
    loss_chunks = t.Int(8, **_doc("Chunks of the chunked cross-entropy.")).tag(sync=True)
    activation_offloading = t.Bool(False, **_doc(
        "Saved activations moved to CPU memory (torchtune OffloadActivations).")).tag(sync=True)
    optimizer_in_backward = t.Bool(False, **_doc(
        "Each parameter stepped as its gradient is ready: no full gradient set.")).tag(sync=True)
    lora_variant = t.Unicode("lora", **_doc("lora | dora (weight-decomposed LoRA).")).tag(sync=True)
    packing = t.Bool(False, **_doc(
        "Packed sequences without padding (varlen attention: FlashAttention 2 on HF).")).tag(sync=True)
    compile = t.Bool(False, **_doc(
        "torch.compile: modelled with full checkpointing (the fused cross-entropy).")).tag(sync=True)
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
        "How data-parallel replicas store the model states: " + " | ".join(BY_NAME) +
        " (vramwidget/data/strategies.json), or device_map.")).tag(sync=True)
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
        "gptq-4bit | gptq-8bit | awq-4bit | gguf-q4_k_m ... (vramwidget.inference.estimate.WEIGHT_FORMATS)."
    )).tag(sync=True)
    kv_cache_dtype = t.Unicode("auto", **_doc(
        "Inference: dtype of the KV cache: auto (the compute dtype) | bf16 | fp16 | fp32 | fp8."
    )).tag(sync=True)
    context_len = t.Int(4096, **_doc(
        "Inference: tokens per sequence at the end of generation (prompt + generated); the "
        "whole context is taken as the prompt (the worst prefill) unless prompt_len is set.")).tag(sync=True)
    prompt_len = t.Int(None, allow_none=True, **_doc(
        "Inference: prompt tokens per sequence (None: the whole context); the rest of the context "
        "is generated, one decode step a token.")).tag(sync=True)
    gpu_memory_utilization = t.Float(None, allow_none=True, **_doc(
        "Inference: None for generate(); a fraction in (0, 1] (e.g. 0.9) for a vLLM-style server "
        "whose paged KV cache fills that share of the GPU (needs gpu).")).tag(sync=True)
    engine = t.Unicode("hf", **_doc(
        "Inference: hf (transformers' generate()) | vllm | sglang: whose start-up memory profile "
        "and KV cache sizing to reproduce (a serving engine needs gpu).")).tag(sync=True)

    max_gpus = t.Int(8, **_doc(
        "The most GPUs a suggestion may use (default 8: one node).")).tag(sync=True)

    # -- the frontend's layout -------------------------------------------------------------
    controls = t.List(**_doc(
        "Every input control: trait name, label, hint, kind, group, slot, mode (widget/controls.py); set "
        "once. The frontend builds its controls from it and subscribes to the traits it names.")).tag(sync=True)
    control_groups = t.List(**_doc(
        "The named, collapsible groups under the core controls: key, title, title in inference mode, "
        "hint.")).tag(sync=True)
    chart_width = t.Int(640, **_doc(
        "Set by the frontend: the pixels its main chart column has. The treemaps are laid out for that "
        "width (their text fitted to their boxes).")).tag(sync=True)
    chart_sizes = t.Dict(**_doc(
        "Chart name -> [width, height] in pixels the rows of that chart were laid out for (the treemaps); "
        "the frontend sizes those views so.")).tag(sync=True)

    # -- outputs: set by Python, drawn by the frontend ------------------------------------
    verdict = t.Dict(**_doc(
        "Does it fit the chosen GPU: {state: fits | tight | does_not_fit, measure: 'device_total', "
        "need_bytes (reserved + the card's own CUDA context), capacity_bytes (what CUDA reports as the "
        "card's total), headroom_bytes, band_bytes, headroom_pct, band_rel, gpu, num_gpus, context_bytes, "
        "usable_capacity_bytes, context_note, capacity_note} (vramwidget.fit.verdict); {} without a GPU.")).tag(sync=True)
    specs = t.Dict(**_doc(
        "Vega-Lite spec of each chart (detail, comparison, phases), set once; each reads the "
        "named dataset of the same name.")).tag(sync=True)
    rows = t.Dict(**_doc(
        "Dataset name -> list of row dicts, replaced on every update.  While ``status`` is "
        "'refining' it may leave out the comparison (its scenarios are being worked out: the "
        "frontend keeps the dataset it has); when idle it holds every dataset.")).tag(sync=True)
    summary = t.Dict(**_doc(
        "Peak, phase, device total, GPU fit, notes and warnings of the current estimate.")).tag(sync=True)
    table = t.List(**_doc("One row per component: name, colour, GiB, bytes, share.")).tag(sync=True)
    disabled = t.Dict(**_doc(
        "Control (trait name) -> why it does not apply now; absent = enabled.")).tag(sync=True)
    options = t.Dict(**_doc(
        "Control -> list of [value, label] choices; also presets, gpus and lora_targets.")).tag(sync=True)
    formats = t.List(**_doc("Number formats: bits, range and precision (FP32 ... NF4).")).tag(sync=True)
    training_config = t.Unicode("", **_doc(
        "Text of a training config (axolotl/torchtune/LLaMA-Factory/LitGPT YAML, HF/TRL or DeepSpeed "
        "JSON, accelerate YAML); setting it fills the controls it names.")).tag(sync=True)
    training_config_report = t.Dict(**_doc(
        "What the last training config set: format, applied {trait: value}, not_controls, ignored "
        "[[field, reason]], notes, error.")).tag(sync=True)
    error = t.Unicode("", **_doc(
        "Why the current input cannot be estimated ('' when it can); the charts keep the "
        "last valid estimate.")).tag(sync=True)
    error_field = t.Unicode("", **_doc("The control the error is about, if known.")).tag(sync=True)
    suggestions = t.List(**_doc(
        "When the setup does not fit the GPU (training): fit.suggestions as dicts (title, changes, "
        "saved_gib, device_total_gib, fits, cost, ...), ranked; [] otherwise.")).tag(sync=True)
    status = t.Unicode("idle", **_doc(
        "What the background worker is doing for the current inputs: 'idle' (every figure shown "
        "is exact), 'refining' (the device totals shown are provisional: the exact caching-"
        "allocator replays are running) or 'tracing' (the model's family has no analytic "
        "module: one training step is being traced; the last estimate stays on screen)."
    )).tag(sync=True)
    status_text = t.Unicode("", **_doc(
        "The status line the frontend shows in its reserved slot ('refining…', 'tracing org/name…'); "
        "'' when idle.")).tag(sync=True)
    suggestions_status = t.Unicode("", **_doc(
        "'' (fits, no GPU or inference mode), 'computing' (the setup does not fit and its "
        "suggestions are being worked out after the update), 'partial' (the single changes are "
        "in ``suggestions``, the combinations are still being worked out), 'ready', or 'failed: why'."
    )).tag(sync=True)

    def __repr__(self) -> str:
        """A plain-text summary (``print(calc)``, terminals, front ends without widgets): the
        model and mode, the current error if any, then the shown estimate's summary."""
        head = f"Calculator({short_repr(self.model)}, mode={short_repr(self.mode)})"
        if self.error:
            head += f"\nerror ({self.error_field or 'input'}): {self.error}  [the estimate below is the last valid one]"
        result = getattr(self, "_result", None)
        if result is None:
            return head
        return head + "\n" + result.summary_text()

    #: None: the background work (exact replays, a trace, the fit map, suggestions) runs at
    #: once inside the update (scripts and tests that want every figure synchronously); a
    #: number: it runs on the background worker threads (the default), the suggestions
    #: search that many seconds after the fit answers.  No wait by default: a newer update
    #: ends a running search at its next candidate (``fit.suggestions``' ``stop``), so a
    #: drag of a slider does not queue searches (it waited 0.15 s before a search began)
    suggestions_delay: Optional[float] = 0.0


# every input trait checks its value's type before traitlets does: a VramError naming it
guard_traits(State, INPUTS)
