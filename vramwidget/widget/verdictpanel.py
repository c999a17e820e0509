"""The verdict panel's data: does the setup fit the chosen GPU (three states with the
estimate's own band, :mod:`vramwidget.fit.verdict`), the row of common GPUs with their
verdicts, the band's provenance and the practitioner defaults applied; and the keys every
mode's summary has (``_base_summary``)."""

from __future__ import annotations

import functools
from typing import Any, Dict, List, Optional, Tuple

from .. import gpus
from ..errors import VramError
from ..result import Estimate
from ..units import GIB
from ..fit.verdict import capacity_bytes, describe, uncertainty
from ..fit.verdict import verdict as verdict_of
from .views import gpu_line

#: the row of common GPUs shown with their verdicts (24, 40, 48, 80 and 141 GB classes)
COMMON_GPUS: Tuple[str, ...] = ("RTX 4090", "A100 40GB", "L40S", "H100 80GB", "H200")


class VerdictPanel:
    """Fills the summary's verdict keys and returns the ``verdict`` trait's value; builds the
    keys every mode's summary has."""

    def _verdict_summary(self, summary: Dict[str, Any], result: Any, gpu: Optional[gpus.GPU],
                         num_gpus: int) -> Dict[str, Any]:
        v = verdict_of(result, gpu, num_gpus=num_gpus) if gpu is not None else {}
        summary["verdict"] = v
        summary["verdict_text"] = describe(v)
        # each card judged with its own CUDA context against its own CUDA total
        # (a card where the step needs a replay with its capacity, gpus.judge_on: provisional
        # until the worker has run it)
        row = []
        for g in (gpus.get_gpu(name) for name in COMMON_GPUS):
            vg = verdict_of(result, g, num_gpus=num_gpus, replay=not self._deferring)
            if vg.get("provisional"):
                self._want("refining", functools.partial(verdict_of, result, g, num_gpus=num_gpus))
            row.append(dict(vg, label=f"{g.name} ({capacity_bytes(g) / GIB:.1f} GiB CUDA total)"))
        summary["gpu_row"] = row
        summary["band"] = dict(uncertainty())
        said = list(getattr(self, "_defaults_said", []))
        if self.strategy == "ddp" and "strategy" not in getattr(self, "_explicit", ()) \
                and getattr(self, "_strategy_said", "") and self.mode == "training":
            said.append(self._strategy_said)
        summary["defaults"] = said
        return v

    def _base_summary(self, est: Estimate, arch: Any, gpu: Optional[gpus.GPU], skipped: List[str],
                      fits: Optional[bool], phase_labels: Dict[str, str]) -> Dict[str, Any]:
        """The keys every mode's summary has."""
        warnings: List[str] = []
        if self.gpu.strip() and gpu is None:
            try:
                gpus.get_gpu(self.gpu)
            except VramError as e:
                warnings.append(str(e))
        # a scenario of the comparison the model cannot do is said, grey: it is not about the setup
        comparison_notes = [f"the comparison leaves out {s}" for s in skipped]
        peak_label = phase_labels.get(est.peak_phase, est.peak_phase)
        return {
            "mode": self.mode,
            "model": est.model_name,
            "hub_id": getattr(arch, "hub_id", None) or "",
            "params_total": est.params_total,
            "params_trainable": est.params_trainable,
            "peak_bytes": est.peak_allocated_bytes,
            "peak_gib": est.peak_allocated_bytes / GIB,
            "peak_phase": est.peak_phase,
            "peak_phase_label": peak_label,
            "reserved_gib": est.reserved_bytes / GIB,
            "cuda_context_gib": est.cuda_context_bytes / GIB, "cuda_context_source": est.cuda_context_source,
            "device_total_bytes": est.device_total_bytes,
            "device_total_gib": est.device_total_gib,
            "gpu": gpu.name if gpu else "",
            "gpu_gib": gpu_line(gpu)[0] / GIB if gpu else None,
            "fits": fits,
            "headroom_gib": (gpu_line(gpu)[0] - est.device_total_bytes) / GIB if gpu else None,
            "phases_gib": {k: v / GIB for k, v in est.phases_bytes.items()},
            "recompute_overhead": est.recompute_overhead,
            "notes": list(est.notes) + comparison_notes,
            "warnings": warnings,
            "parallel": None,
            "max_batch_size": None,
            "inference": None,
            "time": None,
        }
