"""The caching allocator over one GPU of a sharded run (ZeRO, FSDP): the per-GPU tensors in time.

The reserve of a sharded run's GPU is not the unsharded model's: its fragmentation comes from
the tensors that GPU allocates.  This module rewrites the single-GPU event stream of the
GPU's slice (its step plan's events, ``vramwidget.plan``: load, three steps; each tensor's
role read from what the plan says it is) into that GPU's:

load        each parameter's shard (the parameters' factor: 1/N when sharded), quantization
            constants whole; then the strategy's own buffers, allocated once (ZeRO's flat
            partitions, master copy, gradient-partition buffer and IPG bucket)
forward /   the activations exactly as on one GPU; each block's gathered parameters allocated
backward    as the block starts (the next block's prefetched before the previous is freed)
gradients   ``keep``: as on one GPU (DDP-like, ZeRO-0/1); ``shard``: each full gradient is made,
            its shard kept and the full one freed (ZeRO-2/3: copied into the IPG bucket, then
            into the partition buffer); ``unit``: a unit's gradients are made through its
            backward, then its post-backward copies them into one reduce-scatter input, frees
            them and keeps the reduce-scatter output (FSDP ``foreach_reduce``)
optimizer   states and the step's temporaries at their sharded sizes, or ZeRO's own step:
            per sub-group its flat 16-bit copy, the fp32 gradient and the optimizer's temporary

Only the shape of the stream matters for the reserve: :func:`fragmentation_bytes` is the
replay's cached free bytes at its peak (reserved - allocated), which the per-GPU estimate
adds to its own allocated peak.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

@dataclass
class ShardSpec:
    """How one GPU's stream differs from the single-GPU stream of its slice."""

    weights: float = 1.0                  # factor on each loaded parameter (and adapter)
    states: float = 1.0                   # factor on each optimizer state
    temps: float = 1.0                    # factor on each step temporary
    grads: str = "keep"                   # "keep" | "shard" | "unit"
    grad_shard: float = 1.0               # the kept shard's share of a gradient ("shard")
    buffers: List[Tuple[str, float]] = field(default_factory=list)   # allocated once, after load
    step: Optional[List[Tuple[float, float, float]]] = None   # ZeRO: per sub-group (fp32 grad, flat copy, temp)
    gather_layer: Dict[int, float] = field(default_factory=dict)    # gathered bytes per block
    gather_root: float = 0.0              # embeddings / head gathered around the forward and backward
    gather_window: float = 0.0            # gathered bytes kept at most (0: the running block + one prefetched)
    drop_casts: bool = False              # FSDP MixedPrecision: autocast finds the gathered weights already cast
    grad_scale: float = 1.0               # "unit": unsharded gradients in param_dtype (MixedPrecision) / as stored


def _layer(label: Any) -> Optional[int]:
    if isinstance(label, tuple) and len(label) >= 2 and label[0] == "layer" and isinstance(label[1], int):
        return label[1]
    return None


class _Out:
    def __init__(self) -> None:
        self.events: List[Tuple[str, Any, float, Any]] = []
        self._n = 0

    def alloc(self, nbytes: float, label: Any) -> Optional[Any]:
        if nbytes <= 0:
            return None
        self._n += 1
        key = ("sharded", self._n)
        self.events.append(("alloc", key, int(nbytes), label))
        return key

    def free(self, key: Any) -> None:
        if key is not None:
            self.events.append(("free", key, 0.0, ""))


def classify(events: Sequence[Tuple[str, Any, float, Any]], info: Dict[int, Any]) -> List[Tuple[str, Optional[int]]]:
    """Each event's role, from what the step plan says each tensor is (``info``: key ->
    TensorInfo): (code, layer), code one of load, quant (a quantized weight's constants, at
    load), input, cublas, embedding, state, temp, cast, grad, other."""
    out: List[Tuple[str, Optional[int]]] = []
    loading = True
    for kind, key, _nb, label in events:
        if kind != "alloc":
            out.append((kind, None))
            continue
        i = info[key]
        if loading:
            if i.name == "input_ids":
                loading = False
                out.append(("input", None))
            elif i.component == "workspace":
                out.append(("cublas", None))
            elif i.component == "quantization constants":
                out.append(("quant", None))
            else:
                out.append(("load", None))
            continue
        code = {"optimizer states": "state", "optimizer temporaries": "temp", "gradients": "grad"}.get(i.component,
                                                                                                   "other")
        if i.group == "autocast copies (16-bit)":
            code = "cast"
        elif i.name == "embedding output":
            code = "embedding"
        out.append((code, _layer(label)))
    return out


def per_gpu_events(events: Sequence[Tuple[str, Any, float, Any]], spec: ShardSpec,
                   classes: Sequence[Tuple[str, Optional[int]]]) -> List[Tuple[str, Any, float, Any]]:
    """The single-GPU stream ``events`` of a GPU's slice rewritten as that GPU's (see the module
    docstring); ``classes``: :func:`classify` of the stream."""
    out = _Out()
    ev = out.events
    dropped: set = set()
    resized: Dict[Any, Any] = {}       # single-GPU key -> key of its rewritten allocation
    gathered: List[Tuple[Any, float]] = []   # (key, bytes) of gathered blocks, oldest first
    state = {"layer": None, "root": None, "step_done": False}
    unit_grads: List[Tuple[Any, float]] = []    # "unit": the running unit's full gradients (as stored)

    def reduce_unit() -> None:
        """FSDP's post-backward of a unit: one reduce-scatter input, the full gradients freed,
        the reduce-scatter output kept as the sharded gradients (in the parameters' dtype)."""
        if not unit_grads:
            return
        total = sum(b for _, b in unit_grads)
        rs_in = out.alloc(total * spec.grad_scale, "reduce-scatter input")
        for k, _ in unit_grads:
            out.free(k)
        out.alloc(total * spec.grad_shard, "sharded gradients (reduce-scatter output)")
        out.free(rs_in)
        unit_grads.clear()

    def gather(layer: Optional[int]) -> None:
        if layer == state["layer"]:
            return
        reduce_unit()
        state["layer"] = layer
        if layer is None:
            return
        b = spec.gather_layer.get(layer, 0.0)
        gathered.append((out.alloc(b, ("gathered block", layer)), b))
        # the running block and what is gathered ahead of it: one block (FSDP's prefetch), or
        # ZeRO-3's window (the coordinator's gathered peak)
        while len(gathered) > 1 and (len(gathered) > 2 if not spec.gather_window
                                     else sum(x[1] for x in gathered) > spec.gather_window):
            out.free(gathered.pop(0)[0])

    for (kind, key, nbytes, label), (code, layer) in zip(events, classes):
        if kind == "free":
            if key in dropped:
                dropped.discard(key)
            else:
                out.free(resized.pop(key, key))
            continue
        if kind == "step_end":
            reduce_unit()
            if spec.step and not state["step_done"]:   # an optimizer without temporaries (fused): its step here
                _zero_step(out, spec.step)
            while gathered:
                out.free(gathered.pop(0)[0])
            out.free(state["root"])
            state.update(layer=None, root=None, step_done=False)
            ev.append((kind, key, nbytes, label))
            continue
        if kind != "alloc":
            ev.append((kind, key, nbytes, label))
        elif code in ("load", "quant"):
            resized[key] = out.alloc(nbytes * (1.0 if code == "quant" else spec.weights), label)
        elif code == "input":
            for name, b in spec.buffers:
                out.alloc(b, name)
            ev.append((kind, key, nbytes, label))
        elif code == "state":
            resized[key] = out.alloc(nbytes * spec.states, label)
        elif code == "temp":
            if spec.step is not None:
                dropped.add(key)
                if not state["step_done"]:
                    _zero_step(out, spec.step)
                    state["step_done"] = True
            else:
                resized[key] = out.alloc(nbytes * spec.temps, label)
        elif code == "cast" and spec.drop_casts:
            dropped.add(key)
        elif code == "grad" and spec.grads == "unit":
            dropped.add(key)           # freed by the unit's reduce-scatter, not by zero_grad
            unit_grads.append((out.alloc(nbytes * spec.grad_scale, label), nbytes))
        elif code == "grad" and spec.grads == "shard":
            full = out.alloc(nbytes, label)
            resized[key] = out.alloc(nbytes * spec.grad_shard, label)
            out.free(full)
        else:
            if code == "embedding" and spec.gather_root and state["root"] is None:
                state["root"] = out.alloc(spec.gather_root, "gathered root unit")
            gather(layer)
            ev.append((kind, key, nbytes, label))
    return ev


def _zero_step(out: _Out, groups: List[Tuple[float, float, float]]) -> None:
    """ZeRO's step, one sub-group at a time: the 16-bit flat copy, its fp32 conversion (the copy
    freed), the optimizer's temporary, then the fp32 gradient released (stage3.py step)."""
    for fp32, flat, temp in groups:
        f = out.alloc(flat, "flattened gradient partition")
        g = out.alloc(fp32, "fp32 gradients of the sub-group")
        out.free(f)
        t = out.alloc(temp, "optimizer temporary")
        out.free(t)
        out.free(g)


_CACHE: Dict[Any, Tuple[Any, Any]] = {}
#: (id(arch), setup) -> (arch, the slice's single-GPU stream, its classes): the same for every GPU count
_STREAMS: Dict[Any, Tuple[Any, Any, Any]] = {}


def _single_gpu_stream(arch: Any, s: Any) -> Tuple[List[Tuple[str, Any, float, Any]], List[Tuple[str, Any]]]:
    from ..plan import plan_view

    key = (id(arch), s)
    hit = _STREAMS.get(key)
    if hit is not None and hit[0] is arch:
        return hit[1], hit[2]
    view = plan_view(arch, s)
    ev = view.events()
    cls = classify(ev, view.plan.info)
    if len(_STREAMS) > 32:
        _STREAMS.clear()
    _STREAMS[key] = (arch, ev, cls)
    return ev, cls


def replay_per_gpu(arch: Any, s: Any, spec: ShardSpec, capacity_bytes: Optional[float] = None,
                   record: bool = False) -> Any:
    """The caching allocator (``allocator.replay``, the setup's allocator settings) over one
    GPU's stream; without a capacity or recording, cached per (architecture, setup, spec)."""
    from ..allocator.caching import parse_alloc_conf, replay

    key = (id(arch), s, repr(spec)) if capacity_bytes is None and not record else None
    hit = _CACHE.get(key) if key is not None else None
    if hit is not None and hit[0] is arch:
        return hit[1]
    ev, cls = _single_gpu_stream(arch, s)
    res = replay(per_gpu_events(ev, spec, cls), parse_alloc_conf(s.allocator), capacity_bytes, record)
    if key is not None:
        if len(_CACHE) > 256:
            _CACHE.clear()
        _CACHE[key] = (arch, res)
    return res


def fragmentation_bytes(arch: Any, s: Any, spec: ShardSpec) -> float:
    """Cached free bytes at the peak of the caching allocator replayed over one GPU's stream
    (``max_memory_reserved - max_memory_allocated``)."""
    res = replay_per_gpu(arch, s, spec)
    return max(0.0, float(res.max_reserved_bytes - res.max_allocated_bytes))
