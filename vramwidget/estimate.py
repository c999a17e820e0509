"""The training-memory estimator: what one training step holds on the GPU, phase by phase.

``estimate(model, **setup)`` resolves the model to an :class:`Architecture`, validates the
setup, and walks one training step the way PyTorch runs it:

after load    weights (+ quantization constants, LoRA adapters) + library workspaces
forward       + optimizer states (from step 2) + saved activations + logits and loss
backward      + the loss's fp32 gradient buffers, then layer by layer: gradients appear
              while saved activations are released (checkpointing recomputes one layer)
optimizer     weights + states + all gradients + the optimizer's temporaries

The peak is the largest phase, never the sum of every part.  Each mechanism lives in one
function below, next to its formula; the per-op activation rules are in ``model/activations.py``.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple, Union

from .model.architecture import Architecture, load, resolve_targets
from .errors import VramError
from .gpus import context_for, get_gpu
from .inputs import MAX_BYTES, check_total
from .allocator import replays
from .model.activations import attention_backend
from .plan import plan_view
from .plan.params import ParamStorage, param_storage, state_dtypes
from .plan.profile import activations_at, has_target, logits_dtype, lora_head_targets
from .result import Estimate, EstimateSources, Node
from .stacks import behaviour
from .training import TrainingSetup
from .units import CUDA_CONTEXT_BYTES, MIB

#: cuBLAS + cuBLASLt workspaces the caching allocator holds after the first matmul
#: (measured on an H200 with PyTorch 2.11: weights_mib is 64 MiB above the weights
#: in every case but the first of a process).
CUBLAS_WORKSPACE_BYTES = 64 * MIB

Model = Union[str, Dict[str, Any], Architecture]
#: ``Estimate.phases_bytes``, in the order of a run: the weights after loading, the load's own
#: peak, the steady phases, the first step (states made), between steps
PHASE_ORDER = ("after_load", "load", "forward", "backward", "optimizer_step", "first_step", "persistent")


def estimate(model: Model, gpu: Any = None, **setup: Any) -> Estimate:
    """Estimate the GPU memory of one training step.

    Parameters
    ----------
    model:
        A preset name (``"llama-3.1-8b"``), a config.json path or dict, a Hub id, an
        :class:`~vramwidget.model.architecture.Architecture`, or a parameter count (``"7B"``).
    **setup:
        The fields of :class:`~vramwidget.training.TrainingSetup`: ``method``,
        ``precision``, ``quantization``, ``double_quant``, ``quantized_groups``,
        ``prepare_kbit``, ``optimizer``, ``optimizer_state_dtypes``,
        ``gradient_checkpointing``, ``attn_implementation``, ``batch_size``, ``seq_len``,
        ``target_len`` (an encoder-decoder's decoder tokens per sample; None: ``seq_len``),
        ``grad_accum_steps``, ``lora_r``, ``lora_alpha``, ``lora_dropout``,
        ``lora_targets``, ``trainable_layers``, ``tf32``, ``backend`` ("auto": analytic where
        the model's family is modelled, else traced; "analytic"; "trace": see ``vramwidget.trace``),
        and the knobs of training stacks: ``stack`` (hf, axolotl, torchtune, litgpt, unsloth:
        their defaults, vramwidget/stacks.py), ``loss`` (standard, chunked + ``loss_chunks``,
        liger), ``activation_offloading``, ``optimizer_in_backward``, ``compile``,
        ``lora_variant`` (lora, dora), ``modules_to_save``, ``galore_rank``, ``packing`` and
        ``versions`` ({"bitsandbytes": "0.41.1", "transformers": "4.40", "peft": "0.10"}).
    gpu:
        A catalogue GPU name (``"H100 80GB"``): the estimate then also gives the step time
        (``step_seconds``, ``tokens_per_second``, ``mfu``, ``time_breakdown``, ``run_cost``).

    Raises
    ------
    VramError
        naming the field that is wrong and what is allowed.
    """
    task = setup.pop("task", None)
    s = setup if isinstance(setup, TrainingSetup) else TrainingSetup.from_kwargs(**setup)
    if s.target_len is not None and s.backend != "analytic":
        # the traced step passes labels = input_ids (one length) and its size profile varies
        # batch and sequence only: a target length of its own is the analytic families' (T5, BART)
        _traced_target_len(model, s, task)
    if s.backend == "trace":
        from .trace import estimate_traced

        return estimate_traced(model, s, _cuda_accounting(), task=task).set_gpu(gpu)
    try:
        arch = load(model, task=task)
    except VramError as e:
        # the one place the backends meet: a family with no analytic model is traced
        if s.backend != "auto" or e.field != "model_type":
            raise
        from . import trace

        if not trace.available():
            raise VramError(f"{e} (or trace it: {trace.INSTALL_HINT})", field="model_type") from None
        try:
            return trace.estimate_traced(model, s, _cuda_accounting(), task=task).set_gpu(gpu)
        except VramError as t:   # neither backend: say both (the analytic families, then the trace)
            raise VramError(f"{e}; tracing it instead failed: {t}", field="model_type") from None
    est = estimate_setup(arch, s, gpu=gpu)
    check_physical(est, arch, s)
    return est


def _traced_target_len(model: Model, s: TrainingSetup, task: Optional[str]) -> None:
    """``target_len`` with a backend that may trace: refused unless the model is analytic."""
    if s.backend == "auto":
        try:
            load(model, task=task)
            return              # analytic: estimate_setup checks the model (check_target_len)
        except VramError as e:
            if e.field != "model_type":
                return          # the load's own error comes from the estimate itself
    raise VramError("target_len: the traced backend runs the decoder on the input ids (one length); a target "
                    "length of its own is modelled for the analytic encoder-decoders (T5, BART)", field="target_len")


def check_physical(est: Estimate, arch: Architecture, s: TrainingSetup) -> None:
    """More than 1 PiB on one GPU is an input error (:data:`~vramwidget.inputs.MAX_BYTES`),
    not an estimate: it names the LoRA rank when the adapters are the most of it, the model
    when the weights alone exceed it, else the inputs that scale the activations."""
    # allocated memory + context bounds the device total from below: no allocator replay is
    # needed to tell an input error from an estimate
    if est.peak_allocated_bytes + est.cuda_context_bytes <= MAX_BYTES:
        return
    parts = est.component_bytes()
    adapters = parts.get("adapters", 0.0)
    if adapters > parts.get("weights", 0.0) and adapters > parts.get("activations", 0.0) + parts.get(
            "logits and loss", 0.0):
        # the adapters (and their gradients and states) scale with the rank, not the model or the tokens
        check_total(est.device_total_bytes, "this training step's adapters", {"lora_r": s.lora_r, "model": arch.name})
    if est.phases_bytes.get("after_load", 0.0) > MAX_BYTES:
        check_total(est.device_total_bytes, f"{arch.name}'s weights", {"model": arch.name})
    # the inputs the activations scale with, the one furthest above its usual value first
    given = {"seq_len": s.seq_len, "batch_size": s.batch_size}
    if arch.towers and s.images_per_sample:
        given["images_per_sample"] = s.images_per_sample
        if s.image_patches:
            given["image_patches"] = s.image_patches
    check_total(est.device_total_bytes, "this training step", dict(given, model=arch.name), usual=_USUAL)


#: the usual size of each input the activations scale with (check_physical names first the
#: one furthest above it): 1,024 patches is a 448 x 448 image in 14-pixel patches
_USUAL = {"seq_len": 2048, "batch_size": 1, "images_per_sample": 1, "image_patches": 1024}


def _cuda_accounting():
    """The device constants a traced step adds (the same ones this module counts)."""
    from .trace.assemble import CudaAccounting

    return CudaAccounting(CUBLAS_WORKSPACE_BYTES, CUDA_CONTEXT_BYTES)


# ----------------------------------------------------------------------------------
# The estimate
# ----------------------------------------------------------------------------------

def estimate_setup(arch: Architecture, s: TrainingSetup, gpu: Any = None) -> Estimate:
    """The estimate for an already-resolved architecture and validated setup.

    The totals are computed here; the component trees (one per phase, every tensor with
    its formula) are built on first access of ``Estimate.components``.
    """
    return _estimate(arch, s, gpu=gpu)


def check_setup(arch: Architecture, s: TrainingSetup) -> Any:
    """The checks of a setup on this architecture that come before its plan is written (the
    LoRA targets, the knobs it has); returns its parameter storage."""
    if s.trains_adapters and s.lora_targets:
        resolve_targets(arch, s.lora_targets)
    P = param_storage(arch, s)
    if s.method in ("lora", "qlora") and not P.adapters:
        raise VramError(f"lora_targets: none of the targets are linear layers of {arch.name}", field="lora_targets")
    _check_knobs(arch, s)
    return P


def _estimate(arch: Architecture, s: TrainingSetup, gpu: Any = None) -> Estimate:
    """estimate_setup's body: the setup's step plan (``vramwidget.plan``) and what is read
    from it, the totals now, the trees, the replay and the step's work when asked for."""
    P = check_setup(arch, s)
    view = plan_view(arch, s)
    tot = view.totals
    phases = {k: float(tot.phases_bytes[k]) for k in PHASE_ORDER}
    peak = float(tot.peak_allocated_bytes)
    offloaded = view.host_bytes()
    notes = _notes(arch, s, P, offloaded)
    flops, overhead = _flops(arch, s, P)

    def build() -> Tuple[None, Dict[str, List[Node]]]:
        """Every phase's component tree: the tensors live at its peak (the plan's view)."""
        return None, view.trees()

    def components_at(reserved_value: float, exact: bool = True) -> List[Node]:
        """The peak's components plus the allocator reserve at ``reserved_value`` (the
        replayed one for ``Estimate.components``; a provisional one for
        ``Estimate.provisional_components``) and the CUDA context."""
        formula = ("caching allocator: cached free blocks and rounding when reserved memory peaks "
                   "(replay of CUDACachingAllocator over the step plan's allocations)")
        if not exact:
            formula = ("provisional, the replay has not run yet: allocated peak x the reserved / allocated "
                       "ratio of the nearest replayed size of this setup (replays.provisional_reserved_bytes)")
        return list(est.phase_components[tot.peak_phase]) + [
            Node("allocator reserve", bytes=max(0.0, reserved_value - peak), formula=formula),
            Node("cuda context", bytes=est.cuda_context_bytes, formula=est.cuda_context_source),
        ]

    def work() -> Any:
        """The step's work for the step time (timing.py), computed when first asked for."""
        from .timing import step_work

        return step_work(arch, s, P, activations_at(arch, s, P), logits_dtype(arch, s), lambda d: state_dtypes(s, d),
                         offloaded_bytes=offloaded)

    est = Estimate(model_name=arch.name, setup=s.to_dict(), params_total=arch.params_total,
                   params_trainable=P.trainable_numel, components=None, phases_bytes=phases,
                   peak_phase=tot.peak_phase, peak_allocated_bytes=peak,
                   reserved_bytes=lambda: replays.reserved_bytes(arch, s, peak),
                   cuda_context_bytes=context_for(get_gpu(gpu) if gpu is not None else None)[0],
                   flops_per_step=flops, recompute_overhead=overhead, notes=notes, builder=build,
                   sources=EstimateSources(
                       work=work, setup=s,
                       replay=lambda capacity_bytes=None, record=False: replays.replay_training(
                           arch, s, capacity_bytes, record),
                       provisional=lambda: replays.provisional_reserved_bytes(arch, s, peak),
                       components_at=components_at,
                       replay_key=(arch, s),   # what the replay runs (gpus.judge_on caches capacity replays by it)
                       reserved_from_replay=lambda res: replays.reserved_of(res, peak)))
    # on a card the reserve is judged with the allocator's free-and-retry at its limit
    # (gpus.judge_on: a replay with the card's capacity when the unlimited reserve is over it)
    est.capacity_judged = True
    if gpu is not None:
        est.set_gpu(gpu)
    return est


def _notes(arch: Architecture, s: TrainingSetup, P: ParamStorage, offloaded: float) -> List[str]:
    """What the estimate assumes or warns about, in words."""
    notes: List[str] = s.notes + list(arch.family.notes(arch))   # the setup's defaults and warnings first
    if not arch.exact:
        notes.append(arch.assumption)
    backend = attention_backend(arch, s, s.compute_dtype)
    if backend == "math":
        notes.append("SDPA falls back to the math kernel here (fp32 with grouped KV heads): "
                     "the b x a x s x s probabilities are kept for every layer")
    if backend == "eager":
        why = "" if s.attn_implementation == "eager" else (
            f"attn_implementation={s.attn_implementation!r} is not what runs: transformers has no SDPA path for "
            f"this model ({'logit soft-capping' if arch.attn_logit_softcapping else arch.model_type}) and runs "
            "it eager; ")
        notes.append(why + "eager attention keeps fp32 and 16-bit b x a x s x s probabilities for every layer")
    if s.optimizer.startswith("paged"):
        notes.append("paged optimizer states live in CUDA unified memory (bitsandbytes get_paged, outside PyTorch's "
                     "allocator): counted on the card in the peak, the reserve and the device total (paged in at each "
                     "step); torch.cuda.max_memory_allocated()/max_memory_reserved() do not count them "
                     "(est.torch_max_memory_allocated_bytes, vramwidget.allocator.paged); under memory pressure the driver moves "
                     "them to the CPU")
    if s.precision == "fp8":
        notes.append("fp8: linear inputs saved as fp8 copies (torchao-style); derived, not measured")
    if offloaded:
        notes.append(f"activation offloading keeps {offloaded / 2**30:.2f} GiB of saved activations in CPU memory")
    if s.optimizer_in_backward:
        notes.append("optimizer in backward: each parameter is stepped as its gradient is ready (no full gradient "
                     "set; no gradient accumulation or clipping)")
    notes.extend(unusual_input_notes(arch, s))
    notes.extend(_unquantized_notes(arch, s, P))
    notes.append(_versions_note(s))
    return notes


def unusual_input_notes(arch: Architecture, s: TrainingSetup) -> List[str]:
    """Warnings for legal but unusual input: it is estimated, and the note says why it may
    not be what the user meant (the widget shows them beside the estimate)."""
    out = []
    pos = arch.max_position_embeddings
    if pos and s.seq_len > pos:
        learned = any(t.role == "position_embedding" for t in arch.tensors)
        out.append(f"warning: seq_len {s.seq_len:,} is beyond {arch.name}'s {pos:,} positions from training ("
                   + ("its learned position table has no row past that: the model cannot run it as is"
                      if learned else "it was not trained that long: RoPE scaling or a longer-context model")
                   + "); memory estimated anyway")
    if s.trains_adapters and s.lora_r > arch.hidden_size:
        out.append(f"warning: lora_r {s.lora_r:,} is above the hidden size {arch.hidden_size:,}: an adapter's rank "
                   f"cannot exceed min(in, out) features, so the extra rank adds memory and no capacity")
    return out


def _unquantized_notes(arch: Architecture, s: TrainingSetup, P: ParamStorage) -> List[str]:
    """Where a "quantized" base keeps weights in 16 or 32 bits, and why.

    transformers' ``replace_with_bnb_linear`` (integrations/bitsandbytes.py) swaps only
    ``nn.Linear``/``Conv1D`` modules for bitsandbytes ones, and the 4-bit quantizer's
    ``param_needs_quantization`` (quantizers/quantizer_bnb_4bit.py) only their weights:
    fused MoE experts (``MixtralExperts.gate_up_proj``/``down_proj``, 3-D ``nn.Parameter``)
    stay in the load dtype.  peft's ``prepare_model_for_kbit_training`` (utils/other.py)
    then casts every fp16/bf16 parameter that is not ``Params4bit`` to fp32.  Both read in
    transformers 5.23 and peft 0.21.
    """
    if not s.quantized:
        return []
    qtypes = ("nf4", "fp4", "int8")
    experts = sum(nb for t, dt, nb, _ in P.weights if t.experts and dt not in qtypes)
    rest = sum(nb for t, dt, nb, _ in P.weights if dt not in qtypes)
    out = []
    dt = "fp32" if s.prepare_kbit else "16-bit"
    if experts:
        out.append(f"4-bit loading leaves the fused MoE expert weights unquantized ({experts / 2**30:.2f} GiB in {dt}): "
                   f"bitsandbytes replaces only nn.Linear modules and the experts are 3-D parameters"
                   + ("; prepare_model_for_kbit_training upcasts them to fp32" if s.prepare_kbit else ""))
    whole16 = sum(t.numel for t in arch.tensors) * 2.0
    if s.prepare_kbit and sum(nb for _, _, nb, _ in P.weights) > whole16:
        out.append(f"prepare_model_for_kbit_training upcasts every unquantized parameter to fp32 ({rest / 2**30:.2f} GiB): "
                   f"this base is larger than the whole model in 16 bits ({whole16 / 2**30:.2f} GiB); "
                   f"prepare_kbit=False or more quantized_groups keep it smaller")
    return out


def _versions_note(s: TrainingSetup) -> str:
    """Which library releases the estimate assumes."""
    named = dict(s.versions)
    parts = [f"{k} {v}" for k, v in sorted(named.items())]
    rest = [k for k in ("transformers", "peft", "bitsandbytes") if k not in named]
    txt = "versions: " + (", ".join(parts) + "; " if parts else "")
    return txt + "current releases of " + ", ".join(rest) if rest else txt.rstrip("; ")


def _check_knobs(arch: Architecture, s: TrainingSetup) -> None:
    """Knobs that the estimator refuses rather than guess, with the reason."""
    check_target_len(arch, s)
    if s.compile and s.gradient_checkpointing != "full":
        raise VramError("compile: without full activation checkpointing, which tensors inductor's partitioner "
                        "saves in each block depends on its recompute heuristics and is not modelled; use "
                        "gradient_checkpointing='full' (then only the loss's fusion matters) or compile=False",
                        field="compile")
    if s.packing and not behaviour(s.stack).get("packed_sdpa") and s.attn_implementation != "flash_attention_2":
        raise VramError("packing: transformers' padding-free path (DataCollatorWithFlattening, TRL padding_free) "
                        "runs FlashAttention's varlen kernel; set attn_implementation='flash_attention_2' (SDPA "
                        "would need a b x s x s block mask)", field="packing")
    if s.loss == "liger" and "lm_head" in lora_head_targets(s):
        raise VramError("loss: Liger's fused linear cross-entropy multiplies by lm_head.weight itself, so a LoRA "
                        "on lm_head is not applied there; drop 'lm_head' from lora_targets or use another loss",
                        field="loss")


def check_target_len(arch: Architecture, s: TrainingSetup) -> None:
    """``target_len`` is the decoder's length of a model with a decoder stack separate from
    its encoder (T5, BART: :func:`has_target`); anywhere else it is refused."""
    if s.target_len is None or has_target(arch):
        return
    what = "an encoder (no decoder)" if arch.family.encoder_decoder or arch.task in ("encoder", "masked_lm") \
        else "decoder-only"
    raise VramError(f"target_len: {arch.name} is {what}; its sequence is seq_len", field="target_len")


def merge_named(nodes: List[Node]) -> List[Node]:
    """Merge top-level nodes of the same name (e.g. two 'weights' entries)."""
    from .result import COMPONENT_KINDS

    merged: Dict[str, Node] = {}
    for n in nodes:
        if n.bytes <= 0:
            continue
        key = n.name
        if key in merged:
            merged[key].children.extend(n.children if n.children else [n])
            merged[key].bytes += n.bytes
        else:
            merged[key] = Node(key, bytes=n.bytes, formula=n.formula, children=list(n.children))
    order = {k: i for i, k in enumerate(COMPONENT_KINDS)}
    return sorted(merged.values(), key=lambda n: order.get(n.name, 99))


def _flops(arch: Architecture, s: TrainingSetup, P: ParamStorage) -> Tuple[float, float]:
    """Matmul FLOPs of one step and the extra share that checkpointing recomputes.

    forward = 2 x T x (linear params + head) + attention 2 x 2 x b x s^2 x a x d x L / 2 (causal);
    backward = 2 x forward with full fine-tuning (input and weight gradients), 1 x forward
    when the base is frozen (input gradients only) plus the adapters' weight gradients
    (2 x T x LoRA params).  MoE experts count with k / E of their parameters.
    """
    T = s.tokens
    lin = sum(t.numel for t in arch.tensors if t.linear and not t.experts)
    experts = sum(t.numel for t in arch.tensors if t.experts)
    if experts and arch.num_experts:
        lin += experts * arch.experts_per_token / arch.num_experts
    head = arch.vocab_size * arch.hidden_size
    mm = 2 * T * (lin + head)
    attn = 2 * s.batch_size * s.seq_len ** 2 * arch.num_heads * arch.head_dim * arch.num_layers  # causal half of 4bs^2ad
    if s.target_len is not None and has_target(arch):
        # an encoder-decoder with its own target length: the decoder's linears (its layers'
        # tensors) and the head run over b x t tokens, the encoder's over b x s; the decoder's
        # self-attention is b t^2, its cross-attention b t s (the encoder's b s^2 as above)
        kinds = dict(arch.family.layer_kinds(arch))
        n_enc = sum(n for k, n in kinds.items() if k not in arch.family.target_kinds)
        dec_lin = sum(t.numel for t in arch.tensors if t.linear and not t.experts and t.layers
                      and t.layers[0] >= n_enc)
        Tt = s.batch_size * s.target_len
        mm = 2 * T * (lin - dec_lin) + 2 * Tt * (dec_lin + head)
        n_dec = arch.num_layers - n_enc
        ad = arch.num_heads * arch.head_dim
        attn = (2 * s.batch_size * s.seq_len ** 2 * ad * n_enc + 2 * s.batch_size * s.target_len ** 2 * ad * n_dec
                + 4 * s.batch_size * s.target_len * s.seq_len * ad * n_dec)
        T = Tt
    fwd = mm + attn
    if s.method in ("full", "freeze"):
        bwd = 2 * fwd
    else:
        adapters = sum(a[3] for a in P.adapters)
        bwd = fwd + 2 * T * adapters
    total = fwd + bwd
    if s.gradient_checkpointing == "full":
        extra = fwd - 2 * T * head
    elif s.gradient_checkpointing == "selective":
        extra = attn
    else:
        extra = 0.0
    return total + extra, (extra / total if total else 0.0)
