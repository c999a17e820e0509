"""The Calculator widget: the state (traits) joined with the panels, one observer, one update.

Data flows one way: a user changes a control, the frontend sets that trait, Python
estimates, lays out the treemaps and sets the output traits; the frontend only draws.

Three kinds of estimate, chosen by the traits:

* training on one GPU: :func:`vramwidget.estimate` (the default; :mod:`.training`);
* training on several GPUs, as soon as a parallel trait (``num_gpus``, ``strategy``,
  ``tensor_parallel``, ``pipeline_parallel``, ``offload_optimizer``, ``offload_params``)
  leaves its default: :func:`vramwidget.parallel.estimate.estimate_parallel`, and the widget shows
  the worst GPU's per-GPU estimate (:mod:`.multigpu`);
* ``mode = "inference"``: :func:`vramwidget.inference.estimate.estimate_inference` (:mod:`.inference`).

With a GPU chosen, every scenario of the comparison carries a fits / does-not-fit verdict;
when the setup does not fit, :mod:`.suggestions` works out what would make it fit.

An update never waits for slow work.  It draws at once what is known, with a provisional
device total where an exact caching-allocator replay is not cached yet
(``Estimate.provisional_device_total_bytes``: the verdict carries ``"provisional": True``
and ``status`` is "refining"), and hands the slow part to one background thread
(:mod:`.worker`, latest request wins): the exact replays, a model with no analytic family
traced (``status`` "tracing"), the fit map, the largest micro-batch and the suggestions.
When they arrive the worker recomputes the outputs (now from caches) and sets them inside
``hold_sync``.  ``Calculator.wait()`` blocks until it is done.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple

import traitlets as t

from ..show import charts
from ..errors import VramError
from ..result import Estimate
from ..show.treemap import UnitBox
from .controls import controls_spec, groups_spec
from .formats import number_formats
from .inference import InferencePanel
from .multigpu import ParallelPanel
from .state import DEFAULT_MODEL, INFERENCE_INPUTS, INPUTS, MODES, TRAINING_ONLY, State, shown
from .suggestions import SuggestionsPanel
from .options import OptionsPanel
from .training import TrainingPanel
from .trainingconfig import TrainingConfigPanel
from .verdictpanel import VerdictPanel
from .background import BackgroundPanel
from .compute import ComputePanel
from .worker import Worker
from .views import COMPARISON_SIZE, ChartsPanel, build_specs


class Calculator(ComputePanel, BackgroundPanel, VerdictPanel, OptionsPanel, TrainingPanel, ParallelPanel, InferencePanel,
                 SuggestionsPanel, TrainingConfigPanel, ChartsPanel, State):
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
        self._box_notes: Dict[Tuple, str] = {}
        self._notes_now: Dict[str, str] = {}
        self._box_seconds: Dict[Tuple, Optional[float]] = {}   # scenario step times on a GPU
        self._answers: "OrderedDict[Tuple, Any]" = OrderedDict()   # max batch, longest context
        self._sugg_cache: "OrderedDict[Tuple, List[Any]]" = OrderedDict()
        self._sugg_token = 0
        self._sugg_job: Optional[Tuple[Tuple, Any, Dict[str, Any]]] = None
        self._sugg_partial: Optional[Tuple[Tuple, List[Any]]] = None   # (job key, its single changes)
        self._pending: Any = None
        self._worker = Worker()
        self._suggester = Worker("vramwidget-suggestions")
        self._rows_all: Dict[str, Any] = {}   # every dataset as last sent (rows may hold only some)
        self._tl = threading.local()       # the update pass running on this thread
        self._arch_key: Optional[Tuple[str, str]] = None
        self._arch: Any = None
        super().__init__(model=model, **kwargs)
        self._start_defaults(kwargs)
        self._specs_cache: Dict[str, Dict[str, Any]] = {}
        self._comparison_size = [float(COMPARISON_SIZE[0]), float(COMPARISON_SIZE[1])]
        self.specs = self._specs_for(self.mode)
        self.formats = number_formats()
        self.controls = controls_spec()
        self.control_groups = groups_spec()
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
            if kwargs.get("stack", "hf") != "hf":
                # the stack's defaults for what the keywords leave open
                from ..stacks import stack_defaults

                for k, v in stack_defaults(self.stack, {"seq_len": self.seq_len}).items():
                    if k not in kwargs and hasattr(self, k):
                        setattr(self, k, list(v) if isinstance(v, tuple) else v)
            self._link(None)
        finally:
            self._busy = False
        self._ready = True
        self._update()
        self._worker.wait()    # the first frame: every figure exact (a traced model: its trace)
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
    def scenarios(self) -> List[Tuple[str, Estimate]]:
        """(name, Estimate) of the comparison: your setup, then FP32 full, BF16 mixed, pure
        BF16 and 4-bit QLoRA with your batch, sequence length, checkpointing and parallel
        layout (per GPU) -- or, in inference mode, BF16, int8, NF4 and AWQ weights at your
        context and batch (estimated anew: the widget keeps only their layouts)."""
        arch = self._resolve_model()
        out = []
        for name, kind, kw in self._scenario_kw:
            try:
                out.append((name, shown(self._cached_estimate(arch, kind, kw))))
            except VramError:
                pass
        return out

    def chart(self, **kw: Any):
        """An Altair treemap of the current estimate (works and saves without the widget)."""
        return charts.detail_chart(self.estimate, **kw)

    def to_dataframe(self, phase: Optional[str] = None):
        """The current estimate's leaves as a pandas DataFrame."""
        return self.estimate.to_dataframe(phase)

    def close(self) -> None:
        self._cancel_pending()
        for name in ("_worker", "_suggester"):     # absent when __init__ failed early (bad keyword)
            worker = getattr(self, name, None)
            if worker is not None:
                worker.close()
        super().close()

    # -- the observers ----------------------------------------------------------------------
    @t.observe("training_config")
    def _training_config_changed(self, change: Dict[str, Any]) -> None:
        if self._ready and not self._busy:
            self._on_training_config(change)

    @t.observe("chart_width")
    def _chart_width_changed(self, change: Dict[str, Any]) -> None:
        """The frontend's column changed width: lay the treemaps out again (the estimates
        are cached: milliseconds)."""
        if self._ready and not self._busy and self._estimate is not None and change["old"] != change["new"]:
            with self._lock:
                self._update()

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
        """Linked controls (the rules of TrainingSetup): a choice that implies another sets it
        (each panel's rules: ``_link_training``, ``_link_parallel``)."""
        name = change["name"] if change else None
        new = change["new"] if change else None
        self._link_training(name, new)
        self._link_parallel(name, new)
        self._link_inference(name, new)
        if name in ("model", "config_json"):
            self._arch_key = None
        self.disabled = self._disabled()

    def _disabled(self) -> Dict[str, str]:
        off: Dict[str, str] = {}
        if self.config_json.strip():
            off["model"] = "a pasted config.json is the model: clear it to use a preset or Hub id"
        self._disabled_training(off)
        self._disabled_parallel(off)
        if not self.gpu.strip():
            off["gpu_memory_utilization"] = "a serving budget is a share of a GPU: choose the GPU first"
        if self.mode == "inference":
            for k in TRAINING_ONLY:
                off[k] = "training only (the mode is inference)"
        else:
            for k in INFERENCE_INPUTS:
                off[k] = "inference only (switch the mode to inference)"
        return off

    # -- output builders ------------------------------------------------------------------
    def _specs_for(self, mode: str) -> Dict[str, Any]:
        """The chart specs of a mode, built once each (switching modes re-embeds the charts;
        other updates send only rows)."""
        mode = mode if mode in MODES else "training"
        hit = self._specs_cache.get(mode)
        if hit is None:
            hit = self._specs_cache[mode] = build_specs(mode)
        return hit
