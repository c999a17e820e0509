"""A traced step's allocation log -> the same :class:`~vramwidget.result.Estimate` the analytic path returns.

Phases, as ``measure/training.py`` reads them on a GPU (data/VALIDATION.md):

after_load       storages live once the model (and its LoRA adapters) is built
forward          the traced step-1 forward peak + the optimizer states that exist from step 2 on
backward         the same for ``loss.backward()``
optimizer_step   the peak inside ``optimizer.step()`` (states are created there in step 1
                 and already exist in later steps: the same peak)
first_step       step 1's largest peak (no optimizer states yet in its forward and backward)
persistent       what stays between steps (weights + states)

The sequence of allocations and frees of step 2 is that of step 1 with the states live
throughout, so its peaks are step 1's plus the states' bytes.  Every phase also holds the
cuBLAS workspace the analytic path counts (``estimate.CUBLAS_WORKSPACE_BYTES``): a CPU
trace runs no cuBLAS.  The device's constants (that workspace, the CUDA context, the
allocator-reserve rule) come from ``estimate.py`` as a :class:`CudaAccounting`, so both
backends share one definition of each.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

from ..result import COMPONENT_KINDS, Estimate, Node
from ..training import TrainingSetup
from .events import Alloc, live_at, replay

#: what a trace's phases are called in the Estimate
_STEADY = ("forward", "backward", "optimizer_step")


@dataclass(frozen=True)
class CudaAccounting:
    """What a GPU holds beyond the traced tensors (defined once, in estimate.py)."""

    workspace_bytes: float                          # cuBLAS workspaces, held from the first matmul
    context_bytes: float                            # CUDA context (outside torch's allocator)


def phases_from_log(allocs: List[Alloc], marks: List[Tuple[str, int]], sizes: List[int], workspace_bytes: float
                    ) -> Tuple[Dict[str, float], Dict[str, int], float]:
    """Per-phase peak bytes (steady state), the event time of each step-1 peak, and the states' bytes."""
    ph = replay(sizes, allocs, marks)
    t_end = dict(marks).get("end")
    states = float(sum(n for a, n in zip(allocs, sizes) if a.kind == "optimizer states" and n
                       and (a.t_free is None or (t_end is not None and a.t_free > t_end))))
    w = workspace_bytes
    after_load = ph["end:load"][0] + w
    fwd1, bwd1, opt1 = (ph[p][0] + w for p in _STEADY)
    phases = {"after_load": after_load, "forward": fwd1 + states, "backward": bwd1 + states,
              "optimizer_step": opt1, "first_step": max(fwd1, bwd1, opt1),
              "persistent": ph["end:optimizer_step"][0] + w}
    times = {p: ph[p][1] for p in _STEADY}
    times["after_load"] = ph["end:load"][1]
    return phases, times, states


def _tree(live: List[Tuple[Alloc, int]], extra: List[Tuple[Alloc, int]], workspace_bytes: float) -> List[Node]:
    """component > group > op, each leaf the summed bytes of the storages one op made there."""
    agg: Dict[Tuple[str, str, str], List[float]] = defaultdict(lambda: [0.0, 0])
    for a, n in list(live) + list(extra):
        key = (a.kind or "activations", a.group or "model", a.op)
        agg[key][0] += n
        agg[key][1] += 1
    comps: Dict[str, Node] = {}
    groups: Dict[Tuple[str, str], Node] = {}
    for (kind, group, op), (nbytes, count) in agg.items():
        comp = comps.get(kind)
        if comp is None:
            comp = comps[kind] = Node(kind)
        g = groups.get((kind, group))
        if g is None:
            g = groups[(kind, group)] = comp.add(Node(group))
        g.add(Node(op, bytes=nbytes, formula=f"{count} storage(s) made by aten.{op}, traced "
                                               f"(sizes rounded up to 512 B as the CUDA caching allocator does)"))
    w = Node("workspace", children=[Node("cuBLAS workspace", bytes=workspace_bytes,
                                         formula="cuBLAS + cuBLASLt workspaces, 64 MiB (measured, H200, PyTorch 2.11)")])
    order = {k: i for i, k in enumerate(COMPONENT_KINDS)}
    out = [c.finalize() for c in comps.values()] + [w.finalize()]
    return sorted((c for c in out if c.bytes > 0), key=lambda c: order.get(c.name, 99))


def replayed_reserved(allocs: List[Alloc], sizes: List[int], peak: float, allocator: str = "default") -> float:
    """max_memory_reserved() of the traced step: its allocation log replayed through the
    caching-allocator model (``allocator/caching.py``); the replay's cached free blocks at its peak
    are added to the step's allocated peak."""
    from ..allocator.caching import parse_alloc_conf, replay

    timeline = []
    for i, (a, n) in enumerate(zip(allocs, sizes)):
        if n:
            timeline.append((a.t_alloc, 1, ("alloc", i, n, a.op)))
            if a.t_free is not None:
                timeline.append((a.t_free, 0, ("free", i, 0, "")))
    timeline.sort(key=lambda x: (x[0], x[1]))
    r = replay([e for _, _, e in timeline], parse_alloc_conf(allocator))
    return peak + max(0.0, float(r.max_reserved_bytes - r.max_allocated_bytes))


def estimate_from_log(name: str, s: TrainingSetup, allocs: List[Alloc], marks: List[Tuple[str, int]],
                      sizes: List[int], params_total: int, params_trainable: int, notes: List[str],
                      cuda: CudaAccounting) -> Estimate:
    """The Estimate of one traced setup (sizes: the rounded bytes of every allocation)."""
    phases, times, states_bytes = phases_from_log(allocs, marks, sizes, cuda.workspace_bytes)
    peak_phase = max(_STEADY, key=lambda p: phases[p])
    peak = phases[peak_phase]
    persistent = phases["persistent"]
    reserved = replayed_reserved(allocs, sizes, peak, s.allocator)
    t_end = dict(marks).get("end")
    states = [(a, n) for a, n in zip(allocs, sizes) if a.kind == "optimizer states" and n
              and (a.t_free is None or (t_end is not None and a.t_free > t_end))]

    def build():
        per_phase = {}
        for p, t in times.items():
            live = live_at(allocs, sizes, t)
            extra = states if p in ("forward", "backward") else []
            per_phase[p] = _tree(live, extra, cuda.workspace_bytes)
        comps = list(per_phase[peak_phase]) + [
            Node("allocator reserve", bytes=max(0.0, reserved - peak),
                 formula="caching allocator: freed blocks kept for reuse (predicted)"),
            # the estimate's own context (Estimate.set_gpu: the chosen card's) replaces it when read
            Node("cuda context", bytes=cuda.context_bytes, formula="CUDA context + kernels (Estimate.cuda_context_source)"),
        ]
        return comps, per_phase

    setup: Dict[str, Any] = s.to_dict()
    setup["backend"] = "trace"
    return Estimate(model_name=name, setup=setup, params_total=params_total, params_trainable=params_trainable,
                    components=None, phases_bytes=phases, peak_phase=peak_phase, peak_allocated_bytes=peak,
                    reserved_bytes=reserved, cuda_context_bytes=cuda.context_bytes, notes=notes, builder=build,
                    backend="trace")
