"""The multi-GPU panel: estimate_parallel()'s keyword arguments, the rules that link the
layout controls, and what the summary shows of a parallel run (layout, stages, CPU offload)."""

from __future__ import annotations

from typing import Any, Dict, Optional

from ..parallel.strategies import BY_NAME
from ..units import GIB
from .state import PARALLEL_DEFAULTS, PARALLEL_INPUTS

#: the strategy drop-down's entry for transformers' device_map split (not a data-parallel
#: strategy: estimate_parallel(strategy="none", device_map="auto", max_memory=...))
DEVICE_MAP = "device_map"
_DEVICE_MAP_LABEL = 'device_map="auto" (layers split over the GPUs)'
#: which strategies can offload what (data/strategies.json, vramwidget/parallel/strategies.py)
_OFFLOAD_OPTIMIZER = tuple(n for n, s in BY_NAME.items() if s.offload_optimizer)
_OFFLOAD_PARAMS = tuple(n for n, s in BY_NAME.items() if s.offload_params)


def _needs(strategies) -> str:
    """Why an offload box is greyed out: the strategies that can do it."""
    return "needs " + " or ".join(BY_NAME[n].label for n in strategies) + \
        " (choose strategy " + " or ".join(strategies) + ")"


class ParallelPanel:
    """Training on several GPUs: the worst GPU's per-GPU estimate is shown."""

    @property
    def parallel_estimate(self) -> Any:
        """The :class:`~vramwidget.parallel.estimate.ParallelEstimate` behind :attr:`estimate` (every
        stage, CPU offload), or None on the single-GPU and inference paths."""
        from ..parallel.estimate import ParallelEstimate

        return self._result if isinstance(self._result, ParallelEstimate) else None

    def parallel_setup(self) -> Dict[str, Any]:
        """The parallel keyword arguments of estimate_parallel(); {} while every one is at its
        default (then the single-GPU estimate is shown)."""
        par = {k: getattr(self, k) for k in PARALLEL_INPUTS}
        if par == PARALLEL_DEFAULTS:
            return {}
        if par["strategy"] == DEVICE_MAP:
            return device_map_setup(self.num_gpus, self.gpu)
        return par

    def _link_parallel(self, name: Optional[str], new: Any) -> None:
        if name in ("num_gpus", "tensor_parallel", "pipeline_parallel"):
            # several data-parallel replicas need a strategy: DDP unless one is chosen (the
            # one rule, defaults.strategy_for, as estimate_parallel applies it)
            from ..defaults import strategy_for

            chosen, said = strategy_for(self.num_gpus, self.tensor_parallel, self.pipeline_parallel)
            if self.strategy == "none" and chosen != "none":
                self.strategy = chosen
                self._strategy_said = said
        elif name == "strategy":
            if new == DEVICE_MAP:      # the split is by layers alone
                self.tensor_parallel = self.pipeline_parallel = 1
            # offload that the new strategy cannot do is dropped
            if self.offload_optimizer and new not in _OFFLOAD_OPTIMIZER:
                self.offload_optimizer = False
            if self.offload_params and new not in _OFFLOAD_PARAMS:
                self.offload_params = False

    def _disabled_parallel(self, off: Dict[str, str]) -> None:
        if self.strategy not in _OFFLOAD_OPTIMIZER:
            off["offload_optimizer"] = _needs(_OFFLOAD_OPTIMIZER)
        if self.strategy not in _OFFLOAD_PARAMS:
            off["offload_params"] = _needs(_OFFLOAD_PARAMS)
        if self.strategy == DEVICE_MAP:
            for k in ("tensor_parallel", "pipeline_parallel"):
                off[k] = "device_map places whole layers on the GPUs by their memory"


def strategy_options():
    """The strategy drop-down's [value, label] pairs."""
    return [[k, s.label] for k, s in BY_NAME.items()] + [[DEVICE_MAP, _DEVICE_MAP_LABEL]]


def device_map_setup(num_gpus: int, gpu: str) -> Dict[str, Any]:
    """estimate_parallel's keywords for the widget's device_map split: ``num_gpus`` cards of the
    chosen GPU (the H200 without one), each offering what torch can allocate on it as
    ``max_memory`` (what from_pretrained reads from the free memory of each GPU)."""
    from .. import gpus

    g = gpus.get_gpu(gpu) if (gpu or "").strip() else gpus.get_gpu("H200")
    cap = gpus.capacity_bytes(g) - gpus.context_for(g)[0]
    return {"strategy": "none", "device_map": "auto",
            "max_memory": tuple((i, cap) for i in range(max(int(num_gpus), 1)))}


def parallel_summary(p: Any) -> Dict[str, Any]:
    """What the summary shows of a ParallelEstimate: layout, worst GPU, CPU offload, stages."""
    lay = p.layout
    stages = []
    gpu_of = lay.get("gpu_of_stage")
    if lay["pipeline_parallel"] > 1 or gpu_of:
        for st in p.stages:
            first, last = st.layers
            stages.append({
                "stage": st.stage,
                "layers": f"{first}-{last}" if last >= first else "none",
                "holds": ", ".join(x for x, on in (("embeddings", st.embedding), ("output head", st.head)) if on),
                "in_flight": st.in_flight,
                "peak_gib": st.estimate.peak_allocated_bytes / GIB,
                "device_total_gib": st.device_total_bytes / GIB,
                "cpu_gib": sum(st.cpu.values()) / GIB,
                "worst": st.stage == p.worst_stage,
                "gpu": gpu_of[st.stage] if gpu_of else None,
            })
    return {
        "strategy": p.strategy,
        "strategy_label": BY_NAME[p.strategy].label if p.strategy in BY_NAME else p.strategy,
        "num_gpus": lay["num_gpus"],
        "data_parallel": lay["data_parallel"],
        "tensor_parallel": lay["tensor_parallel"],
        "pipeline_parallel": lay["pipeline_parallel"],
        "micro_batches": lay["micro_batches"],
        "shard": lay["shard"],
        "nodes": lay["nodes"],
        "offload_optimizer": lay["offload_optimizer"],
        "offload_params": lay["offload_params"],
        "per_gpu_device_total_gib": p.device_total_bytes / GIB,
        "per_gpu_peak_gib": p.peak_allocated_bytes / GIB,
        "cpu_per_gpu_gib": p.cpu_bytes_per_gpu / GIB,
        "cpu_per_node_gib": p.cpu_bytes_per_node / GIB,
        "worst_stage": p.worst_stage,
        "stages": stages,
        "device_map": bool(gpu_of),
        # the worst GPU's model states by part (ZeRO's partitions, master, buckets, gathered
        # parameters; FSDP's shards and units), largest first
        "model_states": [[k, v / GIB] for k, v in sorted(p.model_states.items(), key=lambda kv: -kv[1]) if v > 0],
    }
