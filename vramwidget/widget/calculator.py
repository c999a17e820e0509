"""The Calculator widget: the state (traits) joined with the panels, one observer, one update.

Data flows one way: a user changes a control, the frontend sets that trait, Python
estimates, lays out the treemaps and sets the output traits; the frontend only draws.

Three kinds of estimate, chosen by the traits:

* training on one GPU: :func:`vramwidget.estimate` (the default; :mod:`.training`);
* training on several GPUs, as soon as a parallel trait (``num_gpus``, ``strategy``,
  ``tensor_parallel``, ``pipeline_parallel``, ``offload_optimizer``, ``offload_params``)
  leaves its default: :func:`vramwidget.parallel.estimate_parallel`, and the widget shows
  the worst GPU's per-GPU estimate (:mod:`.multigpu`);
* ``mode = "inference"``: :func:`vramwidget.inference.estimate_inference` (:mod:`.inference`).

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

import hashlib
import threading
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple

import traitlets as t

from .. import charts, gpus
from ..errors import VramError
from ..inputs import MAX_GPUS, shown as short_repr
from ..result import Estimate
from ..treemap import UnitBox, layout_rows, unit_box
from .controls import controls_spec, groups_spec
from .formats import number_formats
from .inference import INFERENCE_SCENARIOS, InferencePanel, inference_phase_rows
from .multigpu import ParallelPanel
from .state import DEFAULT_MODEL, INFERENCE_INPUTS, INPUTS, MODES, TRAINING_ONLY, State, TracedModel, shown
from .suggestions import SuggestionsPanel
from .options import OptionsPanel, nearest_presets
from .training import YOUR_SETUP, TrainingPanel
from .trainingconfig import TrainingConfigPanel
from .verdictpanel import VerdictPanel
from .background import BackgroundPanel, NotTracedYet, traits_specs_same
from .worker import Worker
from .views import COMPARISON_SIZE, DETAIL_SIZE, ChartsPanel, build_specs, gpu_line, table_rows


class Calculator(BackgroundPanel, VerdictPanel, OptionsPanel, TrainingPanel, ParallelPanel, InferencePanel,
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

    # -- recompute -------------------------------------------------------------------------
    def _resolve_model(self) -> Any:
        """The Architecture for the model or pasted config (cached while they stay)."""
        from .. import architecture

        key = ("config", hashlib.sha1(self.config_json.encode()).hexdigest()) if self.config_json.strip() \
            else ("model", self.model.strip())
        if key != self._arch_key:
            if key[0] == "config":
                cfg = architecture.parse_config_text(self.config_json, source="pasted config.json")
                name = str(cfg.get("_name_or_path") or f"pasted config ({cfg.get('model_type', '?')})")
                self._arch = self._load_or_trace(lambda: architecture.from_config(cfg, name=name),
                                                 lambda: (name, cfg), None)
            else:
                from ..trace import resolve_config

                model = self.model.strip()
                self._arch = self._load_or_trace(lambda: architecture.load(self.model),
                                                 lambda: resolve_config(model), model if "/" in model else None)
            self._arch_key = key
        return self._arch

    def _key(self, kind: str, kw: Dict[str, Any]) -> Tuple:
        return (self._arch_key, kind, tuple(sorted((k, v) for k, v in kw.items() if k != "model")))

    def _scenario_box(self, arch: Any, name: str, kind: str, kw: Dict[str, Any]
                      ) -> Tuple[UnitBox, Optional[bool]]:
        """A comparison scenario as a unit-square layout, and the estimate's own fits flag
        where it has one (a serving budget); only these are kept, not the estimate (a
        scenario equal to the user's setup reuses its estimate)."""
        key = self._key(kind, kw)
        hit = self._boxes.get(key)
        if isinstance(hit, VramError):
            raise hit
        if hit is not None:
            self._boxes.move_to_end(key)
            self._notes_now[name] = self._box_notes.get(key, "")
            return hit, self._box_fits.get(key)
        est = self._cached_estimate(arch, kind, kw)
        view = self._view(shown(est))
        box = unit_box(view, name)
        serving = getattr(est, "serving", None)
        if view is not shown(est):   # provisional: drawn now, not kept
            self._notes_now[name] = ""
            return box, None
        self._boxes[key] = box
        # under a serving budget every format fills the same share of the GPU: what differs
        # is the KV pool (tokens) and how many sequences run at once
        self._box_fits[key] = bool(est.fits) if serving else None
        self._box_notes[key] = (f"{serving.get('kv_tokens', 0):,} KV tokens\n"
                                f"{serving.get('max_concurrent_sequences', 0):,} "
                                f"{'seq' if serving.get('max_concurrent_sequences', 0) == 1 else 'seqs'} at once"
                                ) if serving else ""
        if len(self._boxes) > 64:
            old, _ = self._boxes.popitem(last=False)
            self._box_fits.pop(old, None)
            self._box_notes.pop(old, None)
        self._notes_now[name] = self._box_notes.get(key, "")
        return box, self._box_fits[key]

    def _update(self) -> None:
        """Estimate the setup and the scenarios; set every output trait at once.

        Nothing slow runs here (see the module docstring): what needs a replay or a trace is
        queued for the worker.  Nothing raises out of here (it runs in the comm handler when a
        frontend changes a trait): a failure sets ``error`` and leaves the last valid outputs
        in place.
        """
        with self._lock:
            self._cancel_pending()
            self._sugg_token += 1
            token = self._sugg_token
            self._worker.cancel()
            self._suggester.cancel()
            try:
                outputs, todo = self._pass()
            except NotTracedYet as later:   # its model is being traced: keep the last estimate, dimmed
                with self.hold_sync():
                    self.status = "tracing"
                    self.status_text = f"tracing {later.arch.name}… (its family has no analytic module)"
                    self.error = ""
                    self.error_field = ""
                self._background(token, later.todo)
                return
            except VramError as e:
                self._set_error(str(e), getattr(e, "field", None) or "")
                return
            except Exception as e:  # a bug, not bad input: still never raise into the frontend
                self._set_error(f"internal error ({type(e).__name__}: {e}); please report it", "")
                return
            self._publish(token, outputs, todo)
            job = self._sugg_job
            if todo or (job is not None and self._sugg_cache.get(job[0]) is None):
                self._background(token, todo)

    def _compute(self) -> Tuple[Any, List[Tuple[str, str, Dict[str, Any]]], Dict[str, Any], Any]:
        """Everything an update sets, computed before any trait changes: the estimate, the
        comparison's setups, the output traits, and the suggestions job (None when the
        setup fits, there is no GPU or the mode is inference)."""
        if self.mode not in MODES:
            raise VramError(f"mode: {short_repr(self.mode)} is not one of {', '.join(MODES)}", field="mode")
        if not 1 <= self.max_gpus <= MAX_GPUS:
            raise VramError(f"max_gpus: must be a whole number in [1, {MAX_GPUS:,}], got {self.max_gpus!r}", field="max_gpus")
        par: Dict[str, Any] = {}
        arch = self._resolve_model()
        # an unknown GPU name is an error the widget shows, not "no GPU"
        gpu = gpus.get_gpu(self.gpu) if self.gpu.strip() else None
        if self.mode == "inference":
            kind, kw = "infer", self.inference_setup()
            setups = [(name, dict(kw, **change)) for name, change in INFERENCE_SCENARIOS]
        else:
            par = self.parallel_setup()
            kind, kw = ("par", dict(self.setup_on(gpu), **par)) if par else ("train", self.setup_on(gpu))
            setups = self._scenario_setups(self.setup_on(gpu), par)
        result = self._cached_estimate(arch, kind, kw)
        # what is drawn: a single-GPU estimate whose replay is not cached yet, with its
        # provisional reserve (the worker replaces it with the exact one)
        view = self._view(result) if kind in ("train", "infer") else result
        est = shown(view)
        scenario_kw = [(YOUR_SETUP, kind, kw)] + [(name, kind, s) for name, s in setups]
        scenarios: List[Tuple[str, UnitBox]] = []
        own_fits: Dict[str, Optional[bool]] = {}
        skipped: List[str] = []
        times: Dict[str, float] = {}
        # scenarios not laid out yet: their estimates, exact replays and layouts are worked
        # out by the worker, and the comparison keeps its last rows until they arrive (the
        # status says "refining")
        later = sum([self._defer_box(arch, name, k, s) for name, k, s in scenario_kw]) > 0
        keep = later and bool(self._rows_all.get(charts.COMPARISON)) and traits_specs_same(self, self.mode)
        for name, k, s in ([] if keep else scenario_kw):
            if later and name != YOUR_SETUP and self._key(k, s) not in self._boxes:
                continue
            try:
                box, own = self._scenario_box(arch, name, k, s)
                if gpu is not None and k != "infer":
                    secs = self._scenario_seconds(arch, k, s, gpu)
                    if secs is not None:
                        times[name] = secs
            except VramError as e:  # a scenario the model cannot do: leave it out, say why
                skipped.append(f"{name}: {e}")
                continue
            except NotTracedYet:          # being traced: it joins the comparison when it arrives
                continue
            scenarios.append((name, box))
            own_fits[name] = own
        cap, cap_label = gpu_line(gpu)
        comparison = [] if keep else self._comparison(scenarios, gpu, own_fits, times)
        if self.mode == "inference":
            phases = inference_phase_rows(est, capacity_bytes=cap, capacity_label=cap_label)
            summary = self._summary_inference(view, arch, gpu, kw, skipped)
        else:
            phases = charts.phase_rows(est, capacity_bytes=cap, capacity_label=cap_label)
            summary = self._summary(view, arch, gpu, skipped, kind, kw)
        width = self._width()
        rows = {
            charts.DETAIL: layout_rows(est, width, DETAIL_SIZE[1]),
            charts.PHASES_DATA: phases,
        }
        if not keep:     # kept: not sent again (the frontend keeps a dataset that is absent)
            rows[charts.COMPARISON] = comparison
        traits = {
            "rows": rows,
            "specs": self._specs_for(self.mode),
            "summary": summary,
            "table": table_rows(est),
            "options": self._options(arch),
            "chart_sizes": dict(self.chart_sizes, **{charts.DETAIL: [width, DETAIL_SIZE[1]]},
                                **({charts.COMPARISON: self._comparison_size} if not keep else {})),
        }
        # the cards the verdict speaks of: a training run's GPUs, a server's tensor x pipeline GPUs
        n = int(par.get("num_gpus", 1) or 1) if self.mode == "training" and par else \
            max(self.tensor_parallel, 1) * max(self.pipeline_parallel, 1) if self.mode == "inference" else 1
        v = self._verdict_summary(summary, view, gpu, n)
        if v and getattr(est, "provisional", False):
            v = dict(v, provisional=True)
            summary["verdict"] = v
        summary["provisional"] = bool(getattr(est, "provisional", False))
        summary["backend"] = getattr(est, "backend", "analytic")
        if isinstance(arch, TracedModel):
            summary["notes"].insert(0, f"traced: model_type {arch.model_type!r} has no analytic family module, so "
                                       f"one training step was run on fake tensors (vramwidget.trace)")
        rows[charts.FITMAP] = self._fitmap(arch, gpu, kw) if kind == "train" else []
        if v.get("state") == "does_not_fit":
            summary["time"] = None     # no step time or cost for a run that cannot start
        traits["verdict"] = v
        job = None
        if self.mode == "training" and gpu is not None and v.get("state") != "fits" \
                and not isinstance(arch, TracedModel):
            job = (self._key(kind, kw) + (gpu.name, self.max_gpus), arch,
                   dict(kw, gpu=gpu.name, max_gpus=self.max_gpus))
        traits["disabled"] = self._disabled()     # which controls apply to the model resolved here
        return result, scenario_kw, traits, job

    def _set_error(self, message: str, field: str) -> None:
        message = message.splitlines()[0] if message else "invalid input"
        if field == "model" and "did you mean" not in message:
            near = nearest_presets(self.model)
            if near:
                message += f"; nearest presets: {', '.join(near)}"
        with self.hold_sync():
            self.error = message
            self.error_field = field
            self.status = "idle"
            self.status_text = ""

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
            hit = self._specs_cache[mode] = build_specs(mode)
        return hit
