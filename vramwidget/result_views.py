"""What an :class:`~vramwidget.result.Estimate` shows of itself: the step time on its GPU
(:class:`StepTimeViews`) and its totals in units, trees, table, dict, JSON and text
(:class:`EstimateViews`).  Both read only the estimate's public figures and its sources
(:class:`~vramwidget.result.EstimateSources`); nothing here computes memory.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional

from .errors import VramError
from .inputs import shown
from .node import Node
from .units import GB, GIB, MIB


class StepTimeViews:
    """The step timed on the estimate's GPU (:mod:`vramwidget.timing`), computed when first asked for."""

    @property
    def step_time(self) -> Any:
        """The step's :class:`~vramwidget.timing.StepTime` on ``gpu`` (None without a GPU or
        when the catalogue lacks the GPU's throughput and bandwidth)."""
        if self._step_time is None and self.gpu is not None and self.sources.work is not None:
            from .timing import has_timing, step_time

            if has_timing(self.gpu):
                st = step_time(self.gpu, self.sources.setup, self.sources.work())
                if self.sources.communication is not None:
                    c = self.sources.communication(self.gpu, st)
                    st.communication = c
                    st.communication_seconds = c["exposed_seconds"]
                    st.cpu_optimizer_seconds = c.get("cpu_optimizer_seconds", 0.0)
                    st.pipeline_bubble_seconds = c["pipeline_bubble_seconds"]
                self._step_time = st
        return self._step_time

    @property
    def step_seconds(self) -> Optional[float]:
        """Seconds per optimizer step (all micro-batches of gradient accumulation); None without a GPU."""
        st = self.step_time
        return st.step_seconds if st else None

    @property
    def tokens_per_second(self) -> Optional[float]:
        """Training tokens per second over all the run's GPUs; None without a GPU."""
        st = self.step_time
        if not st:
            return None
        return (self.tokens_per_step or st.tokens_per_step) / st.step_seconds

    @property
    def mfu(self) -> Optional[float]:
        """Model FLOPs utilisation (useful matmul FLOPs / time / dense peak); None without a GPU."""
        st = self.step_time
        return st.mfu if st else None

    @property
    def time_breakdown(self) -> Optional[Dict[str, Any]]:
        """Seconds per phase (forward, backward with recompute, optimizer step) and per kind of
        work (matmul, attention, memory-bound kernels, launches, host waits), and what dominates."""
        st = self.step_time
        return st.breakdown() if st else None

    def run_cost(self, tokens: float, usd_per_gpu_hour: Optional[float] = None) -> Dict[str, Any]:
        """Steps, hours and dollars to train on ``tokens`` tokens.

        ``usd_per_gpu_hour`` defaults to the catalogue's indicative on-demand price of the GPU
        (``price_source`` says where it comes from); ``dollars`` is None when neither is known.
        """
        from .errors import VramError

        if isinstance(tokens, bool) or not isinstance(tokens, (int, float)) or not tokens > 0 \
                or tokens != tokens or tokens == float("inf"):
            raise VramError(f"tokens: must be a number > 0, got {shown(tokens)}", field="tokens")
        if usd_per_gpu_hour is not None and (isinstance(usd_per_gpu_hour, bool) or not isinstance(
                usd_per_gpu_hour, (int, float)) or not usd_per_gpu_hour >= 0 or usd_per_gpu_hour == float("inf")):
            raise VramError(f"usd_per_gpu_hour: must be a number >= 0, got {shown(usd_per_gpu_hour)}",
                            field="usd_per_gpu_hour")
        st = self.step_time
        if st is None:
            raise VramError("gpu: a run's cost needs a GPU; pass gpu=... to the estimate", field="gpu")
        import math

        tokens_per_step = self.tokens_per_step or st.tokens_per_step
        steps = math.ceil(tokens / tokens_per_step)
        hours = steps * st.step_seconds / 3600.0
        price = usd_per_gpu_hour if usd_per_gpu_hour is not None else self.gpu.usd_per_gpu_hour
        source = "given" if usd_per_gpu_hour is not None else self.gpu.price_source
        gpu_hours = hours * self.gpus
        return {"tokens": tokens, "steps": steps, "hours": hours, "gpu_hours": gpu_hours,
                "usd_per_gpu_hour": price, "dollars": gpu_hours * price if price is not None else None,
                "price_source": source, "gpus": self.gpus}

    def _time_dict(self) -> Optional[Dict[str, Any]]:
        st = self.step_time
        if st is None:
            return None
        return {"gpu": self.gpu.name, "step_seconds": self.step_seconds, "tokens_per_second": self.tokens_per_second,
                "mfu": self.mfu, "breakdown": self.time_breakdown,
                "usd_per_gpu_hour": self.gpu.usd_per_gpu_hour, "price_source": self.gpu.price_source}


class EstimateViews:
    """The estimate's figures in GiB/GB/MiB, its trees, its table (``rows``, ``to_dataframe``),
    ``to_dict``/``to_json`` and its plain-text summary."""

    # -- the allocator's view ------------------------------------------------------
    def replay(self, capacity_bytes: Optional[float] = None, record: bool = False):
        """The caching-allocator replay of this estimate's run (``allocator.ReplayResult``):
        ``max_reserved_bytes``, ``fragmentation_at_max_bytes`` and, with ``capacity_bytes``
        (what torch may reserve on the GPU), ``oom``: the first allocation that fails."""
        if self.sources.replay is None:
            raise VramError("replay: this estimate has no allocation trace of its own to replay (a per-GPU "
                            "estimate without sharding carries the fragmentation of its slice's single-GPU "
                            "replay; replay vw.estimate(...) of that setup)", field="replay")
        return self.sources.replay(capacity_bytes=capacity_bytes, record=record)

    def to_memory_snapshot(self, capacity_bytes: Optional[float] = None) -> Dict[str, Any]:
        """The replayed run as a ``torch.cuda.memory._snapshot()`` dict: pickle it and open it
        in PyTorch's memory visualiser (``torch.cuda._memory_viz``, pytorch.org/memory_viz)."""
        from .allocator.snapshot import to_snapshot

        return to_snapshot(self.replay(capacity_bytes=capacity_bytes, record=True))

    @property
    def paged_bytes(self) -> float:
        """Optimizer states a paged optimizer keeps in CUDA unified memory (vramwidget.allocator.paged):
        included in the peak, the reserve and the device total (on the card when paged in),
        outside torch's allocator statistics."""
        from .allocator.paged import paged_state_bytes

        return paged_state_bytes(self)

    @property
    def torch_max_memory_allocated_bytes(self) -> float:
        """What ``torch.cuda.max_memory_allocated()`` would report: the peak without paged states."""
        return self.peak_allocated_bytes - self.paged_bytes

    @property
    def torch_max_memory_reserved_bytes(self) -> float:
        """What ``torch.cuda.max_memory_reserved()`` would report: the reserve without paged states."""
        return self.reserved_bytes - self.paged_bytes

    @property
    def peak_gib(self) -> float:
        return self.peak_allocated_bytes / GIB

    @property
    def peak_gb(self) -> float:
        return self.peak_allocated_bytes / GB

    @property
    def peak_mib(self) -> float:
        return self.peak_allocated_bytes / MIB

    @property
    def device_total_gib(self) -> float:
        return self.device_total_bytes / GIB

    def tree(self, phase: Optional[str] = None) -> Node:
        """The whole tree under one root (the peak phase's, or another phase's)."""
        comps = self.components if phase is None else self.phase_components[phase]
        root = Node(self.model_name, children=list(comps))
        root.bytes = sum(c.bytes for c in comps)
        return root

    def component_bytes(self, phase: Optional[str] = None) -> Dict[str, float]:
        """Bytes per top-level component at the peak (or at ``phase``)."""
        comps = self.components if phase is None else self.phase_components[phase]
        return {c.name: c.bytes for c in comps}

    # -- export -------------------------------------------------------------------
    def rows(self, phase: Optional[str] = None) -> List[Dict[str, Any]]:
        """One row per leaf: component, group, tensor, bytes, GiB, GB, share, dtype, count, formula."""
        root = self.tree(phase)
        total = root.bytes or 1.0
        out = []
        for path, leaf in root.leaves():
            parts = list(path[1:]) + ["", "", ""]
            out.append({
                "component": parts[0],
                "group": parts[1] or parts[0],
                "tensor": parts[2] or parts[1] or parts[0],
                "bytes": leaf.bytes,
                "gib": leaf.bytes / GIB,
                "gb": leaf.bytes / GB,
                "share": leaf.bytes / total,
                "dtype": leaf.dtype or "",
                "count": leaf.count,
                "formula": leaf.formula,
            })
        return out

    def to_dataframe(self, phase: Optional[str] = None):
        """The leaves as a pandas DataFrame (pandas imported only here)."""
        import pandas as pd

        return pd.DataFrame(self.rows(phase))

    def to_dict(self) -> Dict[str, Any]:
        """A plain dict of this object (JSON-able)."""
        return {
            "model": self.model_name,
            "backend": self.backend,
            "setup": self.setup,
            "params_total": self.params_total,
            "params_trainable": self.params_trainable,
            "peak_allocated_bytes": int(round(self.peak_allocated_bytes)),
            "peak_allocated_gib": round(self.peak_allocated_bytes / GIB, 3),
            "peak_allocated_gb": round(self.peak_allocated_bytes / GB, 3),
            "peak_phase": self.peak_phase,
            "paged_bytes": int(round(self.paged_bytes)),
            "reserved_bytes": int(round(self.reserved_bytes)),
            "cuda_context_bytes": int(round(self.cuda_context_bytes)),
            "cuda_context_source": self.cuda_context_source,
            "device_total_bytes": int(round(self.device_total_bytes)),
            "phases": {k: int(round(v)) for k, v in self.phases_bytes.items()},
            "flops_per_step": self.flops_per_step,
            "recompute_overhead": self.recompute_overhead,
            "components": [c.to_dict() for c in self.components],
            "notes": list(self.notes),
            "time": self._time_dict(),
        }

    def to_json(self, **kw) -> str:
        """``to_dict()`` as a JSON string."""
        return json.dumps(self.to_dict(), **kw)

    def __repr__(self) -> str:
        return (f"Estimate({self.model_name!r}, peak {self.peak_gib:.2f} GiB at {self.peak_phase}, "
                f"device total {self.device_total_gib:.2f} GiB)")

    def summary_text(self) -> str:
        """A plain-text summary for front ends without HTML (``print(est)``, a terminal
        IPython): the setup, the peak and the device total, each component with its
        share, and the notes."""
        st = self.setup or {}
        what = ", ".join(str(st[k]) for k in ("method", "precision", "weights") if st.get(k))
        size = (f"batch {st['batch_size']} x {st['seq_len']} tokens" if "seq_len" in st and "batch_size" in st
                else f"batch {st.get('batch_size', 1)} x {st['context_len']} tokens" if "context_len" in st else "")
        lines = [f"{type(self).__name__}: {self.model_name}" + (f" ({what})" if what else "")
                 + (f", {size}" if size else ""),
                 f"peak allocated {self.peak_gib:.2f} GiB ({self.peak_phase}); device total "
                 f"{self.device_total_gib:.2f} GiB (allocator reserve + CUDA context)"]
        total = self.device_total_bytes or 1.0
        for name, nbytes in self.component_bytes().items():
            lines.append(f"  {name:<24} {nbytes / GIB:9.2f} GiB {100 * nbytes / total:6.1f}%")
        notes = [n for n in self.notes if n]
        if notes:
            lines.append("notes:")
            lines.extend(f"  - {n}" for n in notes)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary_text()

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        """IPython's plain-text display: the summary (``repr()`` stays one line)."""
        p.text(repr(self) if cycle else self.summary_text())
