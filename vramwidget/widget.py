"""The notebook widget: controls, summary and treemaps, recomputed on every change.

``Calculator`` is an anywidget.  Its input traits carry the same names as the keyword
arguments of :func:`vramwidget.estimate` (plus ``config_json`` for a pasted config and
``gpu``); its output traits hold what the frontend draws.  Data flows one way: a user
changes a control, the frontend sets that trait, Python estimates, lays out the treemaps
and sets the output traits; the frontend only draws.

The frontend (``static/widget.js``, built from ``js/src/widget.js``) embeds each chart spec
once and afterwards swaps only its rows, so an update moves a few kilobytes.
"""

from __future__ import annotations

import hashlib
import math
import pathlib
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple

import anywidget
import traitlets as t

from . import charts, gpus
from .errors import VramError
from .result import Estimate
from .treemap import KNOWN_COMPONENTS, UnitBox, comparison_rows, fmt_gib, layout_rows, total_bytes, unit_box
from .units import GIB

_STATIC = pathlib.Path(__file__).parent / "static"

DEFAULT_MODEL = "llama-3.2-1b"

#: chart sizes in pixels (the treemap layout is computed for exactly these)
DETAIL_SIZE = (640.0, 340.0)
COMPARISON_SIZE = (640.0, 190.0)
PHASE_SIZE = (640.0, 170.0)

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

#: the keyword arguments of estimate() that the widget exposes, in order
ESTIMATE_INPUTS: Tuple[str, ...] = (
    "model", "method", "precision", "quantization", "double_quant", "quantized_groups",
    "prepare_kbit", "optimizer", "gradient_checkpointing", "attn_implementation",
    "batch_size", "seq_len", "grad_accum_steps", "lora_r", "lora_alpha", "lora_dropout",
    "lora_targets", "trainable_layers",
)
#: every input trait (what ``Calculator(...)`` accepts as keyword arguments)
INPUTS: Tuple[str, ...] = ESTIMATE_INPUTS + ("config_json", "gpu")

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
    """GPU memory of one training step, as a live notebook widget.

    >>> calc = Calculator("llama-3.1-8b", method="qlora", batch_size=4)   # doctest: +SKIP
    >>> calc                                # the widget: controls, treemaps, summary
    >>> calc.estimate.peak_gib              # the current numbers, without the UI
    >>> calc.chart(); calc.to_dataframe()

    Keyword arguments are the input traits (the names of ``estimate()``'s arguments plus
    ``config_json`` and ``gpu``); an unknown one raises ``TypeError``.
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
    gpu = t.Unicode("", **_doc("GPU to fit on (a name from vramwidget.gpus), '' for none.")).tag(sync=True)

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
        self._estimate: Optional[Estimate] = None
        self._scenario_kw: List[Tuple[str, Dict[str, Any]]] = []
        self._cache: "OrderedDict[Tuple, Estimate]" = OrderedDict()
        self._boxes: "OrderedDict[Tuple, UnitBox]" = OrderedDict()
        self._arch_key: Optional[Tuple[str, str]] = None
        self._arch: Any = None
        super().__init__(model=model, **kwargs)
        self.specs = self._build_specs()
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
        """The current (last valid) estimate."""
        assert self._estimate is not None
        return self._estimate

    @property
    def scenarios(self) -> List[Tuple[str, Estimate]]:
        """(name, Estimate) of the comparison: your setup, FP32 full, BF16 mixed, pure BF16,
        4-bit QLoRA, with your batch, sequence length and checkpointing (estimated anew:
        the widget keeps only their layouts)."""
        arch = self._resolve_model()
        out = []
        for name, kw in self._scenario_kw:
            try:
                out.append((name, self._cached_estimate(arch, kw)))
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
        """The keyword arguments estimate() gets for the current traits."""
        kw = {name: getattr(self, name) for name in ESTIMATE_INPUTS}
        kw["quantized_groups"] = tuple(kw["quantized_groups"])
        if kw["lora_targets"] is not None:
            kw["lora_targets"] = tuple(kw["lora_targets"])
        return kw

    # -- the one observer --------------------------------------------------------------------
    @t.observe(*INPUTS)
    def _on_input(self, change: Dict[str, Any]) -> None:
        if not self._ready or self._busy:
            return
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

    def _key(self, kw: Dict[str, Any]) -> Tuple:
        return (self._arch_key, tuple(sorted((k, v) for k, v in kw.items() if k != "model")))

    def _cached_estimate(self, arch: Any, kw: Dict[str, Any]) -> Estimate:
        """estimate() for the user's setup; the last few are kept (toggling back is free)."""
        key = self._key(kw)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        est = _estimate_fn()(arch, **{k: v for k, v in kw.items() if k != "model"})
        self._cache[key] = est
        if len(self._cache) > 8:
            self._cache.popitem(last=False)
        return est

    def _scenario_box(self, arch: Any, name: str, kw: Dict[str, Any]) -> UnitBox:
        """A comparison scenario as a unit-square layout; only that small layout is kept,
        not the estimate (a scenario equal to the user's setup reuses its estimate)."""
        key = self._key(kw)
        hit = self._boxes.get(key)
        if hit is not None:
            self._boxes.move_to_end(key)
            return hit
        est = self._cache.get(key) or _estimate_fn()(arch, **{k: v for k, v in kw.items() if k != "model"})
        box = unit_box(est, name)
        self._boxes[key] = box
        if len(self._boxes) > 64:
            self._boxes.popitem(last=False)
        return box

    def _scenario_setups(self, kw: Dict[str, Any]) -> List[Tuple[str, Dict[str, Any]]]:
        """The comparison's setups: the user's batch, sequence, checkpointing and attention
        with each scenario's method and precision (AdamW, default quantization settings).

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
            out.append((name, s))
        return out

    def _update(self) -> None:
        """Estimate the setup and the scenarios; set every output trait at once.

        Nothing raises out of here (it runs in the comm handler when a frontend changes a
        trait): a failure sets ``error`` and leaves the last valid outputs in place.
        """
        try:
            outputs = self._compute()
        except VramError as e:
            self._set_error(str(e), getattr(e, "field", None) or "")
            return
        except Exception as e:  # a bug, not bad input: still never raise into the frontend
            self._set_error(f"internal error ({type(e).__name__}: {e}); please report it", "")
            return
        est, scenario_kw, traits = outputs
        self._estimate = est
        self._scenario_kw = scenario_kw
        with self.hold_sync():
            for name, value in traits.items():
                setattr(self, name, value)
            self.error = ""
            self.error_field = ""

    def _compute(self) -> Tuple[Estimate, List[Tuple[str, Dict[str, Any]]], Dict[str, Any]]:
        """Everything an update sets, computed before any trait changes."""
        arch = self._resolve_model()
        kw = self.setup()
        est = self._cached_estimate(arch, kw)
        scenario_kw = [(YOUR_SETUP, kw)] + self._scenario_setups(kw)
        scenarios: List[Tuple[str, UnitBox]] = []
        skipped: List[str] = []
        for name, s in scenario_kw:
            try:
                scenarios.append((name, self._scenario_box(arch, name, s)))
            except VramError as e:  # a scenario the model cannot do: leave it out, say why
                skipped.append(f"{name}: {e}")
        gpu = self._gpu_or_none()
        cap = gpu.usable_bytes if gpu else None
        cap_label = f"{gpu.name} ({gpu.usable_gib:.1f} GiB)" if gpu else ""
        rows = {
            charts.DETAIL: layout_rows(est, *DETAIL_SIZE),
            charts.COMPARISON: comparison_rows(scenarios, *COMPARISON_SIZE, capacity_bytes=cap,
                                               capacity_label=cap_label),
            charts.PHASES_DATA: charts.phase_rows(est, capacity_bytes=cap, capacity_label=cap_label),
        }
        traits = {
            "rows": rows,
            "summary": self._summary(est, arch, gpu, skipped),
            "table": self._table(est),
            "options": self._options(arch),
        }
        return est, scenario_kw, traits

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
    def _build_specs(self) -> Dict[str, Any]:
        return {
            charts.DETAIL: charts.detail_chart(width=DETAIL_SIZE[0], height=DETAIL_SIZE[1]).to_dict(),
            charts.COMPARISON: charts.comparison_chart(width=COMPARISON_SIZE[0],
                                                       height=COMPARISON_SIZE[1]).to_dict(),
            charts.PHASES_DATA: charts.phase_chart(width=PHASE_SIZE[0], height=PHASE_SIZE[1]).to_dict(),
        }

    def _summary(self, est: Estimate, arch: Any, gpu: Optional[gpus.GPU],
                 skipped: List[str]) -> Dict[str, Any]:
        warnings: List[str] = []
        if self.gpu.strip() and gpu is None:
            try:
                gpus.get_gpu(self.gpu)
            except VramError as e:
                warnings.append(str(e))
        fits = None
        headroom = None
        if gpu is not None:
            fits = est.device_total_bytes <= gpu.usable_bytes
            headroom = (gpu.usable_bytes - est.device_total_bytes) / GIB
            ok, why = gpu.supports(self.precision)
            if not ok:
                warnings.append(why)
            if self.quantization != "none" and gpu.vendor != "NVIDIA":
                warnings.append(f"bitsandbytes quantization on {gpu.vendor} GPUs is less mature than on CUDA")
        warnings += [f"comparison left out {s}" for s in skipped]
        peak_label = charts.PHASE_LABELS.get(est.peak_phase, est.peak_phase)
        return {
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
            "headroom_gib": headroom,
            "phases_gib": {k: v / GIB for k, v in est.phases_bytes.items()},
            "recompute_overhead": est.recompute_overhead,
            "notes": list(est.notes),
            "warnings": warnings,
            "text": (f"peak {fmt_gib(est.peak_allocated_bytes)} allocated at {peak_label}; "
                     f"device total {fmt_gib(est.device_total_bytes)}"
                     + (f"; {'fits' if fits else 'does not fit'} {gpu.name} ({gpu.usable_gib:.1f} GiB)"
                        if gpu else "")),
        }

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
