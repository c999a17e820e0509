"""The Calculator's recompute: resolve the model, estimate every scenario the traits ask for,
lay out their treemaps and set the output traits (``_update``, ``_compute``), or the error.

A mixin of :class:`~vramwidget.widget.calculator.Calculator` (first among its panels, so its
methods are the Calculator's own); it reads the traits of :class:`.state.State` and calls the
panels' builders.
"""

from __future__ import annotations

import hashlib
from typing import Any, Dict, List, Optional, Tuple

from ..show import charts
from .. import gpus
from ..errors import VramError
from ..inputs import MAX_GPUS, shown as short_repr
from ..show.treemap import UnitBox, layout_rows, unit_box
from .inference import INFERENCE_SCENARIOS, inference_phase_rows
from .state import MODES, TracedModel, shown
from .options import nearest_presets
from .training import YOUR_SETUP
from .background import NotTracedYet, traits_specs_same
from .views import DETAIL_SIZE, gpu_line, table_rows


class ComputePanel:
    """Resolve, estimate, lay out and set the outputs: one update of the Calculator."""

    # -- recompute -------------------------------------------------------------------------
    def _resolve_model(self) -> Any:
        """The Architecture for the model or pasted config (cached while they stay)."""
        from ..model import architecture

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
