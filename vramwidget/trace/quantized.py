"""bitsandbytes 4-bit and 8-bit layers (placeholder until modelled: refuse clearly)."""

from __future__ import annotations

from ..errors import VramError
from ..training import TrainingSetup


def quantize_model(model, s: TrainingSetup) -> None:
    """Replace the quantizable linear layers by stand-ins of bitsandbytes' storage."""
    raise VramError(f"quantization: {s.quantization} layers run bitsandbytes' CUDA kernels, which the trace backend "
                    f"cannot run on a CPU; use backend='analytic' for a modelled family, or method='lora'",
                    field="quantization")
