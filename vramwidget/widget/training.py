"""The training panel: the setup estimate() gets, the comparison's scenarios, the rules that
link the training controls, and the training summary (largest micro-batch that fits)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from ..show import charts
from .. import gpus
from ..show.treemap import fmt_gib
from ..units import GIB
from ..fit.verdict import capacity_bytes
from ..fit.verdict import fits as judge_fits
from .multigpu import parallel_summary
from .state import ESTIMATE_INPUTS, INPUTS, TracedModel, run_estimate, shown

#: the scenario comparison: name -> what it changes in the user's setup
SCENARIOS: Tuple[Tuple[str, Dict[str, Any]], ...] = (
    ("FP32 full", dict(method="full", precision="fp32", quantization="none")),
    ("BF16 mixed", dict(method="full", precision="amp_bf16", quantization="none")),
    ("pure BF16", dict(method="full", precision="bf16", quantization="none")),
    ("4-bit QLoRA", dict(method="qlora", precision="bf16", quantization="nf4",
                         double_quant=True)),
)
YOUR_SETUP = "your setup"

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

#: the run whose time and cost the summary shows
RUN_TOKENS = 1e9


def time_summary(result: Any, gpu: Optional[gpus.GPU]) -> Optional[Dict[str, Any]]:
    """The step time on ``gpu`` and a run's cost (timing.py), for the summary beside the
    verdict: None without a GPU.  A parallel run's slowest stage sets the pace."""
    if gpu is None or not hasattr(result, "set_gpu"):
        return None
    result.set_gpu(gpu)
    one = getattr(result, "slowest", result)
    if one.step_seconds is None:
        return None
    c = one.run_cost(tokens=RUN_TOKENS)
    b = one.time_breakdown
    text = (f"{one.step_seconds:.3g} s per step on {gpu.name}, {one.tokens_per_second:,.0f} tokens/s, "
            f"MFU {one.mfu * 100:.0f}%; {RUN_TOKENS:.0e} tokens: {c['gpu_hours']:,.1f} GPU-hours"
            + (f", ${c['dollars']:,.0f}" if c["dollars"] is not None else ""))
    return {"step_seconds": one.step_seconds, "tokens_per_second": one.tokens_per_second, "mfu": one.mfu,
            "dominant": b["dominant"], "dominant_share": b["dominant_share"],
            "phases_seconds": b["phases_seconds"], "run_tokens": RUN_TOKENS, "run_hours": c["hours"],
            "run_gpu_hours": c["gpu_hours"], "run_dollars": c["dollars"], "gpus": c["gpus"],
            "usd_per_gpu_hour": c["usd_per_gpu_hour"], "price_source": c["price_source"], "text": text}


_FOUR_BIT = ("nf4", "fp4")
_LORA_METHODS = ("lora", "qlora")


def setup_choices() -> Dict[str, List[Tuple[str, str]]]:
    """The training setup's choices per field (training.CHOICES), or the widget's fallback list."""
    try:
        from ..training import CHOICES  # type: ignore[attr-defined]
    except ImportError:
        return dict(_FALLBACK_CHOICES)
    out = dict(_FALLBACK_CHOICES)
    out.update({k: [tuple(x) for x in v] for k, v in CHOICES.items()})
    return out


#: the fit map's grid: powers of two (the current point is drawn where it falls)
FITMAP_BATCHES: Tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
FITMAP_SEQS: Tuple[int, ...] = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768)

class TrainingPanel:
    """Training on one GPU: estimate()'s keyword arguments, linked controls, summary."""

    def _start_defaults(self, kwargs: Dict[str, Any]) -> None:
        """The inputs the user has set (``_explicit``: the keywords here, then every change
        not made by a link, see :meth:`_link_training`): the practitioner defaults apply to
        the others, as estimate() applies them to the keywords it is not given."""
        self._explicit = set(kwargs) & set(INPUTS)
        self._defaulted: Dict[str, Any] = {}
        self._defaults_said: List[str] = []

    def _apply_defaults(self) -> None:
        """The practitioner defaults (:mod:`vramwidget.defaults`, the rules ``estimate()``
        applies) for the controls the user has not set (``_explicit``): each applied one is
        set and said (``summary["defaults"]``, the API's words); a control a default set goes
        back to its own default when the rule no longer applies and nobody changed it since."""
        from ..defaults import apply_training_defaults
        from ..stacks import stack_defaults

        explicit = getattr(self, "_explicit", set())
        given = {k: getattr(self, k) for k in explicit if k in ESTIMATE_INPUTS and k != "model"}
        values = {**{k: v for k, v in stack_defaults(self.stack, {"seq_len": self.seq_len}).items()
                     if k not in given}, **given}
        applied = apply_training_defaults(values)
        defaulted: Dict[str, Any] = getattr(self, "_defaulted", {})
        now: Dict[str, Any] = {}
        for name, _note in applied:
            if getattr(self, name) != values[name]:
                setattr(self, name, values[name])
            now[name] = values[name]
        for name, value in defaulted.items():
            if name not in now and name not in explicit and getattr(self, name) == value:
                setattr(self, name, self.traits()[name].default())
        self._defaulted = now
        self._defaults_said = [note for _, note in applied]

    def _fitmap(self, arch: Any, gpu: Optional[gpus.GPU], kw: Dict[str, Any]) -> List[Dict[str, Any]]:
        """The fit map's rows: the grid (:data:`FITMAP_BATCHES` x :data:`FITMAP_SEQS`) of
        verdicts for the setup on ``gpu``, computed by the estimator's vectorised path once
        per setup (every field but batch and sequence: changing those costs nothing), and
        the current point.  No rows without a GPU."""
        if gpu is None:
            return []
        rest = {k: v for k, v in kw.items() if k not in ("batch_size", "seq_len", "model", "gpu")}

        def grid() -> List[Dict[str, Any]]:
            from ..fit.fitmap import fit_map

            df = fit_map(arch, gpu, batch_sizes=FITMAP_BATCHES, seq_lens=FITMAP_SEQS, **rest)
            return charts.fitmap_rows(df, capacity_bytes=capacity_bytes(gpu))

        key = ("fitmap", self._key("train", rest), gpu.name)
        current = charts.fitmap_rows([], batch_size=kw.get("batch_size"), seq_len=kw.get("seq_len"))
        if isinstance(arch, TracedModel):
            return current
        if not self._deferring:
            return (self._answer(key, grid) or []) + current
        # not known yet: the grid is worked out by the background worker (see
        # calculator._answer_later); numpy and pandas are imported here, on this thread
        # (two threads importing them at once fail)
        import numpy  # noqa: F401
        import pandas  # noqa: F401

        return (self._answer_later(key, grid) or []) + current

    def setup_on(self, gpu: Optional[gpus.GPU]) -> Dict[str, Any]:
        """:meth:`setup` made on the chosen card: its device totals count that card's own CUDA
        context (``Estimate.set_gpu``); without a GPU, the H200's measured one."""
        return dict(self.setup(), gpu=gpu.name) if gpu is not None else self.setup()

    def setup(self) -> Dict[str, Any]:
        """The keyword arguments estimate() gets for the current traits (training)."""
        kw = {name: getattr(self, name) for name in ESTIMATE_INPUTS}
        if not self._has_target():
            kw["target_len"] = None     # kept for when an encoder-decoder comes back; not this model's
        # a control that does nothing with the rest (training.inapplicable: its control is
        # disabled) keeps what the user typed, and the estimate gets its default, as estimate()
        # would without it
        from ..errors import VramError
        from ..training import FIELDS, inapplicable

        for name in inapplicable(kw):
            if name in kw:
                try:
                    FIELDS[name].check(kw[name])
                except VramError:
                    continue        # a wrong value is named, as estimate() names it
                kw[name] = FIELDS[name].default
        kw["quantized_groups"] = tuple(kw["quantized_groups"])
        if kw["lora_targets"] is not None:
            kw["lora_targets"] = tuple(kw["lora_targets"])
        return kw

    def _link_training(self, name: Optional[str], new: Any) -> None:
        """A quantized base trains only through adapters, so quantization != "none" means
        QLoRA; leaving QLoRA drops the quantization; "freeze" needs a layer count.  A change
        that reaches here is the user's (links run with observers off); the practitioner
        defaults follow (:meth:`_apply_defaults`)."""
        if name is not None:
            self._explicit.add(name)
        self._link_controls(name, new)
        self._apply_defaults()

    def _link_controls(self, name: Optional[str], new: Any) -> None:
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
        if self.quantization == "none" and self.prepare_kbit:
            self.prepare_kbit = False
        if name == "stack":
            # a stack's own defaults (stacks.py), as its recipes set them
            from ..stacks import stack_defaults

            for k, v in stack_defaults(new, {"seq_len": self.seq_len}).items():
                if hasattr(self, k):
                    setattr(self, k, list(v) if isinstance(v, tuple) else v)
        if self.method not in _LORA_METHODS and self.lora_variant != "lora":
            self.lora_variant = "lora"

    def _has_target(self) -> bool:
        """Whether the current model has a decoder stack that reads its own target length
        (``estimate.has_target``: T5, BART); False while none is resolved."""
        from ..plan.profile import has_target

        try:
            return bool(self._arch is not None and has_target(self._arch))
        except Exception:   # a traced model (no family module) or none resolved yet
            return False

    def _disabled_training(self, off: Dict[str, str]) -> None:
        if not self._has_target():
            # the frontend hides a control whose reason says it applies to another kind of model
            off["target_len"] = "applies only to encoder-decoders (T5, BART): the decoder's target length"
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
        if self.method not in _LORA_METHODS:
            off["lora_variant"] = "DoRA applies to method lora or qlora"
        if self.loss != "chunked":
            off["loss_chunks"] = "applies only to the chunked loss"
        if self.gradient_checkpointing != "full":
            off["compile"] = "modelled only with full checkpointing (then only the loss's fusion matters)"
        if self.grad_accum_steps > 1:
            off["optimizer_in_backward"] = "steps each parameter in backward: no gradient accumulation"

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
                s.update(lora_r=16, lora_alpha=32.0, lora_dropout=0.0, lora_targets=None, lora_variant="lora")
            if s["precision"] == "fp32" and s["attn_implementation"] == "flash_attention_2":
                if s.get("packing"):
                    continue   # packed sequences need FlashAttention 2, which has no fp32 kernel
                s["attn_implementation"] = "sdpa"  # flash attention has no fp32 kernel
            if par:
                s.update(par)
            out.append((name, s))
        return out

    def _summary(self, result: Any, arch: Any, gpu: Optional[gpus.GPU], skipped: List[str],
                 kind: str, kw: Dict[str, Any]) -> Dict[str, Any]:
        """Training: one GPU's numbers (the worst GPU's with a parallel layout), the layout,
        CPU offload, pipeline stages and the largest micro-batch that fits."""
        est = shown(result)
        fits = judge_fits(est.device_total_bytes, capacity_bytes(gpu)) if gpu is not None else None
        out = self._base_summary(est, arch, gpu, skipped, fits, charts.PHASE_LABELS)
        if gpu is not None:
            ok, why = gpu.supports(self.precision)
            if not ok:
                out["warnings"].append(why)
                # the estimate's own note says the same (Estimate.set_gpu): shown once, as a warning
                out["notes"] = [n for n in out["notes"] if not n.startswith(f"warning: {why}")]
            if self.quantization != "none" and gpu.vendor != "NVIDIA":
                out["warnings"].append(
                    f"bitsandbytes quantization on {gpu.vendor} GPUs is less mature than on CUDA")
            out["max_batch_size"] = self._max_batch(arch, gpu, kind, kw)
        out["time"] = time_summary(result, gpu) if fits is not False else None
        par = None
        if kind == "par":
            par = parallel_summary(result)
            out["parallel"] = par
            out["notes"] = list(dict.fromkeys(list(result.notes) + out["notes"]))
            if par["pipeline_parallel"] > 1 or par["tensor_parallel"] > 1:
                out["params_scope"] = " on the fullest GPU (its share of the model)"
        out["notes"] += self._selective_note(arch, kind, kw, est)
        peak_label = out["peak_phase_label"]
        who = f"per GPU (the fullest of {par['num_gpus']}) " if par and par["num_gpus"] > 1 else ""
        text = (f"{who}peak {fmt_gib(est.peak_allocated_bytes)} allocated at {peak_label}; "
                f"device total {fmt_gib(est.device_total_bytes)}")
        if par and par["cpu_per_gpu_gib"]:
            text += (f"; CPU offload {par['cpu_per_gpu_gib']:.2f} GiB per GPU, "
                     f"{par['cpu_per_node_gib']:.1f} GiB per node")
        if gpu:
            text += (f"; {'fits' if fits else 'does not fit'} {gpu.name} "
                     f"({capacity_bytes(gpu) / GIB:.1f} GiB CUDA total)")
            if out["max_batch_size"] is not None:
                text += f"; largest micro-batch that fits: {out['max_batch_size']}"
            if out["time"]:
                text += f"; {out['time']['text']}"
        out["text"] = text
        return out

    def _selective_note(self, arch: Any, kind: str, kw: Dict[str, Any], est: Any) -> List[str]:
        """Selective checkpointing recomputes the attention core only (``activations.attention_backend``:
        "recompute"): under SDPA's flash or memory-efficient kernel that core keeps no score
        tensors, so it saves next to nothing; say so when it saves under 1%."""
        if self.gradient_checkpointing != "selective" or kind == "infer":
            return []
        try:
            plain = shown(self._cached_estimate(arch, kind, dict(kw, gradient_checkpointing="none")))
        except Exception:   # noqa: BLE001 - a note only; the setup's own estimate stands
            return []
        saved = plain.peak_allocated_bytes - est.peak_allocated_bytes
        if saved >= 0.01 * plain.peak_allocated_bytes:
            return []
        return [f"selective checkpointing recomputes only the attention core; with {self.attn_implementation} that "
                f"core keeps no score tensors, so it saves {fmt_gib(max(saved, 0.0))} here (full checkpointing "
                f"keeps only each layer's input)"]

    def _scenario_seconds(self, arch: Any, kind: str, kw: Dict[str, Any], gpu: gpus.GPU) -> Optional[float]:
        """A comparison scenario's step time on ``gpu`` (timing.py), cached beside its box."""
        key = self._key(kind, kw) + (gpu.name,)
        if key in self._box_seconds:
            return self._box_seconds[key]
        est = self._cache.get(self._key(kind, kw)) or run_estimate(arch, kind, {k: v for k, v in kw.items()
                                                                             if k != "model"})
        secs = est.set_gpu(gpu).step_seconds
        self._box_seconds[key] = secs
        if len(self._box_seconds) > 64:
            self._box_seconds.pop(next(iter(self._box_seconds)))
        return secs

    def _max_batch(self, arch: Any, gpu: gpus.GPU, kind: str, kw: Dict[str, Any]) -> Optional[int]:
        """fit.max_batch_size for the setup (every field but the batch): one search per setup,
        so changing the batch itself costs nothing."""
        from ..fit import solver as fit

        if isinstance(arch, TracedModel):
            return None
        rest = {k: v for k, v in kw.items() if k not in ("batch_size", "model", "gpu")}
        return self._answer_later(("max_batch", self._key(kind, rest), gpu.name),
                                  lambda: fit.max_batch_size(arch, gpu, **rest))
