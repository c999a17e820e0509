"""PyTorch FSDP as it runs: what one rank holds under FSDP2 (``fully_shard``) and FSDP1
(``FullyShardedDataParallel``'s flat parameters), read from PyTorch 2.13's code.

Units: each decoder block is one FSDP unit (``fully_shard(layer)``, FSDP1's transformer
auto-wrap policy) and the root unit holds what is left (embeddings, final norm, head).
``ws`` is the shard group's size.  Per rank:

FSDP2 (``torch/distributed/fsdp/_fully_shard``):

* sharded parameters (``_fsdp_param.py _init_sharded_param``): each parameter's dim-0 chunk,
  padded to the first (largest) chunk, ``ceil(d0 / ws) x rest`` elements, in the parameter's
  dtype (``MixedPrecisionPolicy.param_dtype`` only changes what is gathered);
* all-gather (``_fsdp_collectives.py foreach_all_gather``): one flat output of ``ws x`` the
  unit's padded shard elements in ``param_dtype``, copied out into the unsharded parameters;
  the output is kept until the next all-gather (``AllGatherState``), so the latest unit's
  output is live at the forward's end; under checkpointing a block's recompute and the
  backward prefetch keep two;
* unsharded parameters: the unit running, plus the root unit from its forward to its
  backward (the root is not resharded after forward: ``_fsdp_state.py _lazy_init``);
  ``reshard_after_forward=False`` keeps every unit unsharded from its forward to its backward;
* backward: the unit's unsharded gradients (``param_dtype``), copied into one reduce-scatter
  input of ``ws x`` padded shard elements (``foreach_reduce``), whose output (one padded
  shard, viewed as each parameter's sharded gradient) stays as the sharded gradients;
* optimizer states: on the sharded parameters, padded shard sizes.
* ``CPUOffloadPolicy``: sharded parameters, gradients and optimizer states live on the host;
  each unit's shard is copied to the GPU for its all-gather, its reduced shard copied back.

FSDP1 (``torch/distributed/fsdp/_flat_param.py``): each unit's parameters are one
``FlatParameter``, padded so its elements divide by ``ws`` (``_get_shard``); ``_full_param_padded``
(the whole flat parameter in the compute dtype) is allocated at each unshard; ``BACKWARD_PRE``
prefetch gathers the next unit before the current one's backward: two units in backward;
the root is not resharded after forward.  ``CPUOffload(offload_params=True)`` keeps the
flat shard on the host and copies it to the GPU before the all-gather
(``FlatParamHandle.pre_unshard``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Sequence, Tuple

from ..units import DTYPE_BYTES


@dataclass(frozen=True)
class FsdpParam:
    """One parameter instance of a unit: elements, its dim 0, bytes per element as stored
    (the sharded parameter), whether it trains."""

    numel: int
    dim0: int
    elem_bytes: float
    trains: bool
    packed: bool = False        # 4/8-bit storage (bitsandbytes): gathered as stored, not cast

    def gathered_bytes(self, param_dtype_bytes: float) -> float:
        """Bytes per element once gathered: MixedPrecision's param_dtype for a floating
        parameter, the packed storage's own for a quantized one."""
        return self.elem_bytes if self.packed else param_dtype_bytes


@dataclass
class Unit:
    name: str
    layer: int                  # -1 for the root unit
    params: List[FsdpParam] = field(default_factory=list)

    def padded_shard(self, ws: int) -> int:
        """Elements of this unit's padded shard on one rank (FSDP2: per parameter)."""
        return sum(math.ceil(p.dim0 / ws) * (p.numel // max(p.dim0, 1)) for p in self.params)

    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    def trainable(self) -> int:
        return sum(p.numel for p in self.params if p.trains)


def units(arch: Any, P: Any, lora_r: int = 0) -> List[Unit]:
    """The root unit and one unit per decoder block, parameters in model order; a block's
    LoRA factors (peft's lora_A r x in, lora_B out x r) belong to the block's unit."""
    from ..plan.load import instances as _instances

    before, after, per_layer = _instances(arch, P)
    root = Unit("root", -1)
    blocks = [Unit(f"layers.{i}", i) for i in range(len(per_layer))]

    def add(unit: Unit, inst: Tuple[Any, ...]) -> None:
        t, dtype, nbytes, trains, numel = inst
        d0 = int(t.shape[0]) if t.shape else 1
        per = max(1, round(numel / max(t.numel_each, 1)))   # a tensor repeated inside one block
        for _ in range(per):
            unit.params.append(FsdpParam(int(t.numel_each), d0, nbytes / numel if numel else 0.0, bool(trains),
                                         dtype in ("nf4", "fp4", "int8")))

    for inst in before + after:
        add(root, inst)
    for i, insts in enumerate(per_layer):
        for inst in insts:
            add(blocks[i], inst)
    if P.adapters and lora_r:
        ad = DTYPE_BYTES.get(P.adapter_dtype, 4)
        for t in arch.lora_tensors(P.lora_modules):
            if not t.layers:
                continue
            for layer in range(t.layers[0], t.layers[1] + 1):
                blocks[layer].params.append(FsdpParam(lora_r * t.in_features, lora_r, ad, True))
                blocks[layer].params.append(FsdpParam(t.out_features * lora_r, t.out_features, ad, True))
    return [root] + blocks


@dataclass
class FsdpPlan:
    """Per-rank bytes by what FSDP keeps (each the most at once over a step, and the forward
    and backward amounts placed in those phases)."""

    sharded_params: float = 0.0
    optimizer_states: float = 0.0
    sharded_grads: float = 0.0
    unsharded_params: float = 0.0          # the most at once
    all_gather: float = 0.0
    unsharded_grads: float = 0.0
    reduce_scatter: float = 0.0
    forward: Dict[str, float] = field(default_factory=dict)    # gathered at the forward peak
    backward: Dict[str, float] = field(default_factory=dict)   # gathered / in flight in backward
    on_host: Dict[str, float] = field(default_factory=dict)
    shard_copy: float = 0.0                # offload: a unit's shard copied to the GPU for its all-gather

    def categories(self) -> Dict[str, float]:
        """The categories of torch.distributed._tools.fsdp2_mem_tracker (_FSDPRefType)."""
        return {"SHARDED_PARAM": self.sharded_params, "UNSHARDED_PARAM": self.unsharded_params,
                "ALL_GATHER": self.all_gather, "SHARDED_GRAD": self.sharded_grads,
                "UNSHARDED_GRAD": self.unsharded_grads, "REDUCE_SCATTER": self.reduce_scatter,
                "OPT": self.optimizer_states}


def fsdp2_plan(us: Sequence[Unit], ws: int, *, param_dtype_bytes: float, reduce_dtype_bytes: float,
               state_bytes_per_elem: float, reshard_after_forward: bool = True, checkpointing: bool = False,
               offload: bool = False) -> FsdpPlan:
    """What one rank of ``ws`` holds under FSDP2 (see the module docstring).

    ``param_dtype_bytes``: what is gathered (MixedPrecisionPolicy.param_dtype, else the
    parameters' own); ``reduce_dtype_bytes``: what gradients are reduced in;
    ``state_bytes_per_elem``: optimizer-state bytes per trainable sharded element."""
    pl = FsdpPlan()
    root, blocks = us[0], list(us[1:])
    for u in us:
        for p in u.params:
            shard = math.ceil(p.dim0 / ws) * (p.numel // max(p.dim0, 1))
            pl.sharded_params += shard * p.elem_bytes
            if p.trains:
                pl.sharded_grads += shard * p.elem_bytes
                pl.optimizer_states += shard * state_bytes_per_elem

    def gathered(u: Unit) -> float:
        return sum(math.ceil(p.dim0 / ws) * (p.numel // max(p.dim0, 1)) * ws * p.gathered_bytes(param_dtype_bytes)
                   for p in u.params)

    def grads(u: Unit) -> float:
        return sum(p.numel for p in u.params if p.trains) * param_dtype_bytes

    def rs(u: Unit) -> float:
        return sum(math.ceil(p.dim0 / ws) * (p.numel // max(p.dim0, 1)) for p in u.params if p.trains) \
            * ws * reduce_dtype_bytes

    big = max(blocks, key=gathered) if blocks else root
    block = gathered(big) if blocks else 0.0
    all_blocks = sum(gathered(b) for b in blocks)
    pl.unsharded_params = gathered(root) + (block if reshard_after_forward else all_blocks)
    pl.all_gather = max(gathered(u) for u in us) * (2 if checkpointing and blocks else 1)
    pl.unsharded_grads = max(grads(u) for u in us)
    pl.reduce_scatter = max(rs(u) for u in us)
    pl.forward = {"unsharded parameters": gathered(root) + (0.0 if reshard_after_forward else all_blocks),
                  "all-gather output (kept until the next all-gather)": block or gathered(root)}
    pl.backward = {"unsharded parameters": pl.unsharded_params,
                   "all-gather output": pl.all_gather,
                   "unsharded gradients + reduce-scatter input": pl.unsharded_grads + pl.reduce_scatter}
    if offload:
        pl.on_host = {"sharded parameters": pl.sharded_params, "sharded gradients": pl.sharded_grads,
                      "optimizer states": pl.optimizer_states}
        pl.shard_copy = max(sum(math.ceil(p.dim0 / ws) * (p.numel // max(p.dim0, 1)) * p.elem_bytes for p in u.params)
                            for u in us)
    return pl


def fsdp1_plan(us: Sequence[Unit], ws: int, *, param_dtype_bytes: float, state_bytes_per_elem: float,
               reshard_after_forward: bool = True, offload: bool = False) -> FsdpPlan:
    """What one rank holds under FSDP1's flat parameters (see the module docstring):
    ``_get_shard`` pads each unit's flat parameter to a multiple of ``ws``."""
    pl = FsdpPlan()

    # use_orig_params=False needs one requires_grad per FlatParameter: the frozen parameters
    # and the trainable ones (PEFT's fsdp_auto_wrap_policy wraps each LoRA module on its own)
    # form separate flat parameters; each is padded to a multiple of ws (_get_shard)
    def flat(u: Unit, trains: bool) -> float:
        """Bytes of the unit's (frozen or trainable) flat parameter, padded, as stored."""
        ps = [p for p in u.params if p.trains == trains]
        n = sum(p.numel for p in ps)
        b = sum(p.numel * p.elem_bytes for p in ps)
        return b * (math.ceil(n / ws) * ws) / n if n else 0.0

    def gathered(u: Unit) -> float:
        out = 0.0
        for trains in (False, True):
            ps = [p for p in u.params if p.trains == trains]
            n = sum(p.numel for p in ps)
            if n:
                out += sum(p.numel * p.gathered_bytes(param_dtype_bytes) for p in ps) * (math.ceil(n / ws) * ws) / n
        return out

    for u in us:
        pl.sharded_params += (flat(u, False) + flat(u, True)) / ws
        tr = flat(u, True)
        pl.sharded_grads += tr / ws
        ntr = sum(p.numel for p in u.params if p.trains)
        pl.optimizer_states += math.ceil(ntr / ws) * state_bytes_per_elem if ntr else 0.0
    root, blocks = us[0], list(us[1:])
    full = {u.name: gathered(u) for u in us}
    block = max((full[b.name] for b in blocks), default=0.0)
    every = sum(full[b.name] for b in blocks)
    # the unit running and the one BACKWARD_PRE prefetches; the root stays gathered
    pl.unsharded_params = full[root.name] + (2 * block if reshard_after_forward else every)
    pl.unsharded_grads = max((math.ceil(sum(p.numel for p in u.params if p.trains) / ws) * ws * param_dtype_bytes
                              for u in us), default=0.0)
    pl.reduce_scatter = pl.unsharded_grads / ws
    pl.forward = {"unsharded parameters": full[root.name] + (block if reshard_after_forward else every)}
    pl.backward = {"unsharded parameters": pl.unsharded_params,
                   "unsharded gradients + reduce-scatter output": pl.unsharded_grads + pl.reduce_scatter}
    if offload:
        pl.on_host = {"sharded parameters": pl.sharded_params, "sharded gradients": pl.sharded_grads,
                      "optimizer states": pl.optimizer_states}
        pl.shard_copy = max((flat(u, False) + flat(u, True)) / ws for u in us)
    return pl


def gathered_by_unit(us: Sequence[Unit], ws: int, *, param_dtype_bytes: float, version: int) -> Dict[int, float]:
    """Each unit's unsharded bytes on one rank (layer -> bytes; -1 the root), padded as the
    version pads: FSDP2 each parameter's dim 0 to a multiple of ``ws``
    (``_fsdp_param.py _init_sharded_param``; the all-gather output is ``ws x`` the padded
    shard), FSDP1 the unit's flat parameter (frozen and trainable ones apart) to a multiple of
    ``ws`` (``_flat_param.py FlatParamHandle._get_shard``, ``_full_param_padded``)."""
    out: Dict[int, float] = {}
    for u in us:
        if version == 2:
            b = sum(math.ceil(p.dim0 / ws) * (p.numel // max(p.dim0, 1)) * ws * p.gathered_bytes(param_dtype_bytes)
                    for p in u.params)
        else:
            b = 0.0
            for trains in (False, True):
                ps = [p for p in u.params if p.trains == trains]
                n = sum(p.numel for p in ps)
                if n:
                    b += sum(p.numel * p.gathered_bytes(param_dtype_bytes) for p in ps) * (math.ceil(n / ws) * ws) / n
        out[u.layer] = out.get(u.layer, 0.0) + b
    return out


def shard_by_unit(us: Sequence[Unit], ws: int) -> Dict[int, float]:
    """Each unit's shard as stored on one rank (layer -> bytes): what ``CPUOffload`` copies to
    the GPU before the unit's all-gather (FSDP1 ``FlatParamHandle.pre_unshard``; FSDP2
    ``FSDPParam``'s all-gather input)."""
    return {u.layer: sum(math.ceil(p.dim0 / ws) * (p.numel // max(p.dim0, 1)) * p.elem_bytes for p in u.params)
            for u in us}
