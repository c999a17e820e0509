"""generate() on a ``device_map`` split: each GPU's own inference estimate
(``estimate_inference(model, device_map=..., max_memory=...)``).  The placement is
:mod:`vramwidget.parallel.device_map`'s; each GPU is estimated on its share of the model
(``parallel._slice``)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Mapping, Optional

from ..parallel.device_map import Device, Placement, place
from ..errors import VramError
from ..inputs import shown


#: the inference weight formats whose sizes transformers' placement sees as the estimator stores them
_INFER_FORMATS = {"bf16": dict(precision="bf16"), "fp16": dict(precision="fp16"), "fp32": dict(precision="fp32"),
                  "nf4": dict(method="qlora", quantization="nf4"), "fp4": dict(method="qlora", quantization="fp4"),
                  "int8": dict(method="qlora", quantization="int8")}


@dataclass
class SplitInference:
    """``generate()`` on a device_map split: each GPU's inference estimate (its layers' weights,
    their KV cache and the activations that pass through them; the embedding's GPU the
    embeddings, the head's GPU the logits), the placement, the worst GPU."""

    model_name: str
    placement: Placement
    per_device: Dict[Device, Any]
    notes: List[str] = field(default_factory=list)

    @property
    def worst(self) -> Device:
        return max(self.per_device, key=lambda d: self.per_device[d].device_total_bytes)

    @property
    def per_gpu(self) -> Any:
        return self.per_device[self.worst]

    @property
    def kv_cache_bytes(self) -> float:
        return sum(e.kv_cache_bytes for e in self.per_device.values())

    def to_dict(self) -> Dict[str, Any]:
        return {"model": self.model_name, "device_map": {k: v for k, v in self.placement.device_map.items()},
                "worst_gpu": self.worst, "notes": list(self.notes),
                "per_gpu": {str(d): e.to_dict() for d, e in self.per_device.items()}}


def estimate_inference_split(model: Any, device_map: Any = "auto", max_memory: Optional[Mapping[Any, Any]] = None,
                             **setup: Any) -> SplitInference:
    """``estimate_inference(model, device_map=..., max_memory=..., **setup)``: generate() with the
    layers placed as transformers places them, each GPU estimated on its own share
    (``parallel._slice``: its layers, the embedding on its GPU, the head and the logits on
    theirs).  Layers on the CPU or disk run on GPU 0 (accelerate's offload hooks): their KV
    cache is there and one module's weights at a time."""
    from ..model.architecture import load
    from ..plan.params import param_storage as _params
    from .estimate import InferenceSetup, estimate_inference_setup
    from ..parallel.estimate import stage_slice
    from ..training import TrainingSetup

    arch = load(model)
    s = InferenceSetup.from_kwargs(**setup)
    if s.serving or s.tensor_parallel > 1 or s.pipeline_parallel > 1:
        raise VramError("device_map: a device_map split is transformers' generate() on one replica; not with a "
                        "serving engine or tensor/pipeline parallel sizes", field="device_map")
    fmt = _INFER_FORMATS.get(s.weights)
    if fmt is None:
        raise VramError(f"device_map: placement sizes are modelled for {', '.join(_INFER_FORMATS)} weights, not "
                        f"{shown(s.weights)}", field="weights")
    P = _params(arch, TrainingSetup.from_kwargs(**fmt))
    pl = place(arch, P, device_map, max_memory, quantized=fmt.get("method") == "qlora")
    runs: Dict[Device, List[int]] = {}
    for i, d in enumerate(pl.layers):
        runs.setdefault(d if isinstance(d, int) else min(pl.gpus or [0]), []).append(i)
    out = SplitInference(arch.name, pl, {})
    for d, idx in sorted(runs.items(), key=lambda kv: kv[1][0]):
        if idx != list(range(idx[0], idx[-1] + 1)):
            raise VramError("device_map: a GPU runs layers that are not contiguous; not modelled", field="device_map")
        embed = pl.embedding == d or (not isinstance(pl.embedding, int) and d == min(pl.gpus or [0]))
        head = pl.head == d or (not isinstance(pl.head, int) and d == min(pl.gpus or [0]))
        cut, _ = stage_slice(arch, idx[0], idx[-1], embed, head, 1, 1)
        if not head:
            # inference_events lays out generate()'s head on every run: a one-entry vocabulary
            # stands in for the head this GPU does not hold (its logits are a few bytes)
            cut = replace(cut, vocab_size=1)
        est = estimate_inference_setup(cut, s)
        out.per_device[d] = est
    off = [i for i, d in enumerate(pl.layers) if not isinstance(d, int)]
    if off:
        out.notes.append(f"{len(off)} layers offloaded to {sorted({str(pl.layers[i]) for i in off})}: they run on GPU "
                         f"{min(pl.gpus or [0])}, which holds their KV cache and one module's weights at a time "
                         f"(accelerate AlignDevicesHook); the weights the GPU estimate counts for them are moved, not kept")
    return out


def estimate_inference(model: Any, **setup: Any) -> Any:
    """:func:`vramwidget.inference.estimate.estimate_inference`, and with ``device_map=`` /
    ``max_memory=`` (transformers' ``from_pretrained`` split: ``"auto"``, ``"balanced"``,
    ``"balanced_low_0"``, ``"sequential"`` or a mapping; memory per device) generate() on that
    split: a :class:`SplitInference` with each GPU's estimate."""
    if "device_map" in setup or "max_memory" in setup:
        return estimate_inference_split(model, setup.pop("device_map", "auto"), setup.pop("max_memory", None), **setup)
    from .estimate import estimate_inference as single

    return single(model, **setup)


def _doc() -> str:
    from . import estimate as inference

    return (inference.estimate_inference.__doc__ or "").rstrip() + """

    device_map, max_memory:
        generate() on transformers' ``device_map`` split with ``max_memory`` per device: a
        :class:`vramwidget.inference.split.SplitInference` with each GPU's estimate.
"""


estimate_inference.__doc__ = _doc()
