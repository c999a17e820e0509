"""The verdict panel's data: does the setup fit the chosen GPU (three states with the
estimate's own band, :mod:`vramwidget.verdict`), the row of common GPUs with their
verdicts, the band's provenance and the practitioner defaults applied."""

from __future__ import annotations

import functools
from typing import Any, Dict, Optional, Tuple

from .. import gpus
from ..units import GIB
from ..verdict import capacity_bytes, describe, uncertainty
from ..verdict import verdict as verdict_of

#: the row of common GPUs shown with their verdicts (24, 40, 48, 80 and 141 GB classes)
COMMON_GPUS: Tuple[str, ...] = ("RTX 4090", "A100 40GB", "L40S", "H100 80GB", "H200")


class VerdictPanel:
    """Fills the summary's verdict keys and returns the ``verdict`` trait's value."""

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
