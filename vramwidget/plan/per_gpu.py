"""One GPU of a sharded run as a step plan: the slice's plan with its tensors transformed.

A parallel layout does not change what a training step computes; it changes which bytes of
each tensor one GPU holds, and adds the strategy's own tensors.  :func:`per_gpu_plan` reads the
step plan of the GPU's slice (``vramwidget.plan``: the load and three steps, every tensor with
what it is) and writes that GPU's own plan, tensor by tensor, from a :class:`GpuLayout`
(``vramwidget.parallel`` fills it from the strategy, ``zero.py`` and ``fsdp.py``):

load        each parameter's share (:class:`Shares`: 1/N when sharded, experts over N/e),
            quantization constants whole (bitsandbytes' QuantState is no parameter); then the
            strategy's tensors that live from start-up on (``startup``: ZeRO's partitions,
            master copy and buckets, DDP's buckets, Megatron's main gradients, NCCL buffers)
forward /   the activations as on one GPU (sequence parallel: each x ``activation_share``);
backward    the gathered parameters of the block running (``gathered``: ZeRO-3's
            coordinator per block, FSDP's units with their prefetch, the root unit from the
            embedding to the step's end); 1F1B's other micro-batches in flight
gradients   ``keep``: as on one GPU; ``none``: never allocated (Megatron's main_grad, DDP's
            bucket views); ``shard``: each full gradient made, copied into the bucket and
            freed, its shard kept (ZeRO-2/3); ``unit``: FSDP's post-backward per unit
optimizer   states and temporaries at their shares, or ZeRO's step sub-group by sub-group

Every view of the GPU reads the result: the per-GPU totals and trees (``views.totals`` /
``views.tree``) and the allocator replay (its events), so the replay's allocated peak is the
per-GPU estimate's peak to the byte.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, Dict, List, Optional, Tuple

from .builder import KEYED_KINDS, EventColumns, PlanBuilder, StepPlan, TensorInfo
from .size import NotPolynomial, Size
from .views import gradient_events, live_rows, row_infos, whole_bytes


@dataclass(frozen=True)
class Shares:
    """The share of each kind of model state one GPU keeps on the device (1: whole, 1/N:
    sharded over N ranks, 0: off the GPU); ``*_experts`` for the routed experts' tensors."""

    weights: float = 1.0
    weights_experts: float = 1.0
    adapters: float = 1.0
    states: float = 1.0
    states_experts: float = 1.0
    temps: float = 1.0
    temps_experts: float = 1.0


@dataclass(frozen=True)
class Buffer:
    """A tensor of the strategy's own: what it is, its bytes, and when it lives: ``startup``
    (from the wrap to the end), ``backward`` (from the step's first backward to its optimizer
    step), ``until_step`` (from the step's first gradient until the optimizer step has read
    it), ``after_backward`` (a transient once the backward is done)."""

    info: TensorInfo
    nbytes: float
    lifetime: str = "startup"


@dataclass(frozen=True)
class ZeroStepGroup:
    """One sub-group of ZeRO's step on the GPU (stage3.py ``step``: ``_prepare_fp32_grad_for_sub_group``
    then the optimizer, then ``_release_sub_group``): bytes of its flat 16-bit gradient copy,
    its fp32 gradient and the optimizer's temporary."""

    flat_bytes: float
    fp32_bytes: float
    temp_bytes: float


@dataclass
class GpuLayout:
    """What one GPU's plan changes against its slice's single-GPU plan."""

    shares: Shares = field(default_factory=Shares)
    grads: str = "keep"                       # keep | none | shard | unit
    grad_shard: float = 0.0                   # "unit": the kept reduce-scatter output's share of a gradient
    grad_scale: float = 1.0                   # "unit": unsharded gradients in param_dtype / as stored
    reduce_scatter_copy: bool = True          # "unit": FSDP2 copies gradients into one reduce-scatter input
    buffers: List[Buffer] = field(default_factory=list)
    zero_step: Optional[List[ZeroStepGroup]] = None
    #: ZeRO-3's reduce_scatter_coalesced flush: (bucket bytes, 1 + 1/N) -- 0 bytes: none
    flush_bucket_bytes: float = 0.0
    flush_factor: float = 1.0
    #: the gathered modules per (pass, layer), each (module, bytes): pass "forward" |
    #: "backward", layer -1 (before the blocks), 0..L-1, L (after them)
    gathered: Dict[Tuple[str, int], Tuple[Tuple[int, float], ...]] = field(default_factory=dict)
    gathered_info: Optional[TensorInfo] = None
    #: FSDP: bytes of each block unit, the root unit, and how many units stay gathered
    unit_bytes: Dict[int, float] = field(default_factory=dict)
    root_bytes: float = 0.0
    units_forward: int = 2                    # the unit running + what is prefetched (0: all kept)
    units_backward: int = 2
    unit_info: Optional[TensorInfo] = None
    drop_casts: bool = False                  # FSDP MixedPrecision: autocast finds the weights cast
    activation_share: float = 1.0             # sequence parallel: activations(t = 1) / t over the cut's
    in_flight: Optional[Buffer] = None        # 1F1B: the other micro-batches' saved activations

    def adds_only_startup_buffers(self) -> bool:
        """Whether the GPU's plan is its slice's plan with tensors that live from start-up
        on added (DDP's reducer buckets, NCCL's buffers) and nothing else changed."""
        return (self.shares == Shares() and self.grads == "keep" and self.zero_step is None and not self.gathered
                and not self.unit_bytes and not self.root_bytes and not self.drop_casts
                and self.activation_share == 1.0 and self.in_flight is None
                and all(b.lifetime == "startup" for b in self.buffers))

    def changes_nothing(self) -> bool:
        """Whether the GPU's plan is its slice's plan, event for event."""
        return (self.shares == Shares() and self.grads == "keep" and not self.buffers and self.zero_step is None
                and not self.gathered and not self.unit_bytes and not self.root_bytes and not self.drop_casts
                and self.activation_share == 1.0 and self.in_flight is None)


def _layer(label: Any) -> Optional[int]:
    if isinstance(label, tuple) and len(label) >= 2 and label[0] == "layer" and isinstance(label[1], int):
        return label[1]
    return None


class _Writer:
    """Writes the GPU's plan while the slice's events are read (one pass, in order)."""

    def __init__(self, plan: StepPlan, lay: GpuLayout, num_layers: int):
        self.src, self.lay, self.L = plan, lay, num_layers
        self.pb = PlanBuilder()
        self.key: Dict[int, Optional[int]] = {}     # slice key -> GPU key (None: dropped)
        self.phase = "load"
        self.step = 0
        self.loading = True
        self.live_buffers: Dict[str, List[Optional[int]]] = {"backward": [], "until_step": []}
        self.layer: Optional[int] = None
        self.seen_layer = False
        self.gathered: List[Tuple[Any, Optional[int], float]] = []   # (layer, key, bytes)
        self.root: Optional[int] = None
        self.unit_grads: List[Tuple[Optional[int], float, TensorInfo]] = []
        self.bucket = 0.0
        self.step_done = False
        self.in_flight: Optional[int] = None
        self.opened: Dict[str, int] = {}
        self.sharded: Dict[Any, Optional[int]] = {}     # FSDP: each unit's kept sharded gradient

    # -- helpers ---------------------------------------------------------------------------
    def alloc(self, nbytes: float, info: TensorInfo, label: Any = None) -> Optional[int]:
        return self.pb.alloc_as(int(nbytes), info, label)

    def free(self, key: Optional[int]) -> None:
        self.pb.free(key)

    # -- marks -----------------------------------------------------------------------------
    def enter(self, phase: str, step: int) -> None:
        if phase == "inputs":
            for b in self.lay.buffers:
                if b.lifetime == "startup":
                    self.alloc(b.nbytes, b.info)
        if phase == "backward" and self.opened.get("backward") != step:
            self.opened["backward"] = step
            self.live_buffers["backward"] = [self.alloc(b.nbytes, b.info) for b in self.lay.buffers
                                             if b.lifetime == "backward"]
        if phase == "zero_grad":
            for k in self.sharded.values():         # the sharded gradients set to None
                self.free(k)
            self.sharded = {}
        if phase == "optimizer_step":
            for b in self.lay.buffers:
                if b.lifetime == "after_backward":
                    self.free(self.alloc(b.nbytes, b.info))
            self.reduce_unit()
            self.release_gathered()
            for k in self.live_buffers["backward"]:
                self.free(k)
            self.live_buffers["backward"] = []
            if self.in_flight is not None:
                self.free(self.in_flight)
                self.in_flight = None
            # the root unit is resharded once the backward is done (FSDP1
            # _post_backward_final_callback; FSDP2 the root's post-backward)
            self.free(self.root)
            self.root = None
        self.phase, self.step = phase, step
        self.pb.mark(phase, step)
        if phase == "forward" and self.lay.root_bytes and self.root is None:
            # the root unit (embeddings, final norm, head) is unsharded by its pre-forward and
            # stays so through the backward (it is not resharded after forward: FSDP1
            # _runtime_utils.py _lazy_init, FSDP2 _fsdp_state.py _lazy_init)
            self.root = self.alloc(self.lay.root_bytes, self.lay.unit_info, "gathered root unit")
        self.layer, self.seen_layer = None, False
        if phase == "forward" and self.lay.in_flight is not None and self.in_flight is None:
            self.in_flight = self.alloc(self.lay.in_flight.nbytes, self.lay.in_flight.info)

    # -- gathered parameters ------------------------------------------------------------------
    def release_gathered(self) -> None:
        for _, k, _ in self.gathered:
            self.free(k)
        self.gathered = []

    def at(self, layer: Optional[int]) -> None:
        """The next event belongs to block ``layer`` (None: outside the blocks): ZeRO-3's
        gathered set there, or FSDP's unit (and the last unit's post-backward)."""
        lay = self.lay
        pos: Any = layer
        if layer is None and lay.gathered and self.phase in ("forward", "backward"):
            fwd = self.phase == "forward"
            pos = ("outside", (self.L if self.seen_layer else -1) if fwd else (-1 if self.seen_layer else self.L))
        if pos == self.layer:
            return
        if lay.unit_bytes:
            self.reduce_unit()
        self.layer = pos
        if pos is None:
            return
        if isinstance(pos, int):
            self.seen_layer = True
        if lay.gathered:
            where = pos if isinstance(pos, int) else pos[1]
            want = dict(lay.gathered.get(("forward" if self.phase == "forward" else "backward", where), ()))
            # the coordinator's gathered set at this block: the modules it released freed, the
            # ones it fetched (the module running, prefetched) allocated
            keep = [g for g in self.gathered if g[0] in want and g[2] == want[g[0]]]
            for g in self.gathered:
                if g not in keep:
                    self.free(g[1])
            have = {g[0] for g in keep}
            self.gathered = keep + [(m, self.alloc(nb, lay.gathered_info, ("gathered", where)), nb)
                                    for m, nb in want.items() if m not in have]
        elif lay.unit_bytes and isinstance(pos, int):
            fwd = self.phase == "forward"
            if not any(g[0] == pos for g in self.gathered):
                nb = lay.unit_bytes.get(pos, 0.0)
                self.gathered.append((pos, self.alloc(nb, lay.unit_info, ("gathered unit", pos)), nb))
            keep = lay.units_forward if fwd else lay.units_backward
            if fwd and keep:
                while len(self.gathered) > keep:          # the oldest unit resharded
                    self.free(self.gathered.pop(0)[1])
            elif not fwd:
                # backward runs the blocks down: a unit whose backward is done is resharded,
                # the one before it stays gathered as the prefetched unit (``keep`` in all)
                done = [g for g in self.gathered if g[0] > pos + keep - 1]
                for g in done:
                    self.free(g[1])
                self.gathered = [g for g in self.gathered if g not in done]

    # -- gradients ----------------------------------------------------------------------------
    def first_gradient(self) -> None:
        """The step's first gradient: the buffers that live through the backward are made."""
        for life in ("until_step",):
            if self.live_buffers[life] or self.opened.get(life) == self.step:
                continue
            self.opened[life] = self.step
            self.live_buffers[life] = [self.alloc(b.nbytes, b.info) for b in self.lay.buffers if b.lifetime == life]

    def reduce_unit(self) -> None:
        """FSDP's post-backward of a unit (FSDP2 ``foreach_reduce``; FSDP1 ``_post_backward_hook``)."""
        if not self.unit_grads:
            return
        lay = self.lay
        total = sum(b for _, b, _ in self.unit_grads)
        info = self.unit_grads[0][2]
        rs_in = None
        if lay.reduce_scatter_copy:
            rs_in = self.alloc(total * lay.grad_scale, TensorInfo(
                "gradients", "reduce-scatter", "reduce-scatter input", "the unit's unsharded gradients, one flat copy "
                "(FSDP2 foreach_reduce)", info.dtype))
            for k, _, _ in self.unit_grads:
                self.free(k)
        out = self.alloc(total * lay.grad_shard, TensorInfo(
            "gradients", "sharded gradients", "sharded gradients (reduce-scatter output)",
            "the unit's gradients / shard group (padded shard)", info.dtype))
        unit = self.layer
        if unit in self.sharded:
            # a later micro-batch: its output is added into the kept sharded gradient and
            # dropped (FSDP1 _runtime_utils.py _accumulate_sharded_grad; FSDP2 foreach_reduce)
            self.free(out)
        else:
            self.sharded[unit] = out
        if rs_in is None:
            for k, _, _ in self.unit_grads:
                self.free(k)
        self.free(rs_in)
        self.unit_grads = []

    def gradient(self, key: int, nbytes: float, info: TensorInfo, label: Any) -> None:
        lay = self.lay
        self.first_gradient()
        if lay.grads == "none":
            self.key[key] = None
        elif lay.grads == "unit":
            self.key[key] = None          # freed by the unit's reduce-scatter, not by zero_grad
            self.unit_grads.append((self.alloc(nbytes * lay.grad_scale, info, label), nbytes, info))
        elif lay.grads == "shard":
            full = self.alloc(nbytes, info, label)
            if lay.flush_bucket_bytes:
                if self.bucket + nbytes > lay.flush_bucket_bytes and self.bucket > 0:
                    self.free(self.alloc(self.bucket * lay.flush_factor, _FLUSH))
                    self.bucket = 0.0
                self.bucket += nbytes
            self.free(full)
            self.key[key] = None
        else:
            self.key[key] = self.alloc(nbytes, info, label)

    # -- the optimizer ----------------------------------------------------------------------
    def zero_step(self) -> None:
        """ZeRO's step, one sub-group at a time (stage3.py ``step``; stage_1_and_2.py ``step``:
        the partition's gradients flattened, converted to fp32, the 16-bit copy freed)."""
        for g in self.lay.zero_step or []:
            f = self.alloc(g.flat_bytes, _FLAT)
            x = self.alloc(g.fp32_bytes, _FP32)
            self.free(f)
            for k in self.live_buffers["until_step"]:
                self.free(k)
            self.live_buffers["until_step"] = []
            t = self.alloc(g.temp_bytes, _TEMP)
            self.free(t)
            self.free(x)
        for k in self.live_buffers["until_step"]:
            self.free(k)
        self.live_buffers["until_step"] = []
        self.step_done = True


_FLUSH = TensorInfo("gradients", "IPG bucket", "reduce_scatter_coalesced flush (torch.cat of the bucket)",
                    "the full bucket + its reduced partition (stage3.py __avg_scatter_grads)", "")
_FLAT = TensorInfo("optimizer temporaries", "ZeRO step", "flattened 16-bit gradient partition",
                   "the sub-group's gradients, _flatten_dense_tensors, freed after .to(fp32)", "")
_FP32 = TensorInfo("gradients", "ZeRO step", "fp32 gradients of the sub-group",
                   "4 B x the sub-group's elements (_prepare_fp32_grad_for_sub_group)", "float32")
_TEMP = TensorInfo("optimizer temporaries", "ZeRO step", "optimizer temporary of the sub-group",
                   "foreach AdamW's sqrt(exp_avg_sq): 4 B x the sub-group's elements", "float32")


def kept_share(lay: GpuLayout, i: TensorInfo, loading: bool) -> Optional[float]:
    """The share of a slice tensor that the GPU's plan allocates in its place, as the
    slice's own alloc and free (1: as on one GPU); None where the writer does something
    else: a gradient (``_Writer.gradient``: kept, none, sharded or per unit), an optimizer
    temporary under ZeRO's step (``_Writer.zero_step``), a 16-bit autocast copy the
    strategy makes unneeded (dropped).  The load's tensors are parameters at their share,
    quantization constants and workspaces whole (bitsandbytes' QuantState is no parameter)."""
    sh = lay.shares
    comp, experts = i.component, i.group == "experts"
    if loading:
        if comp == "quantization constants" or comp == "workspace":
            return 1.0
        if comp == "adapters":
            return sh.adapters
        return sh.weights_experts if experts else sh.weights
    if comp == "optimizer states":
        return sh.states_experts if experts else sh.states
    if comp == "optimizer temporaries":
        return None if lay.zero_step is not None else (sh.temps_experts if experts else sh.temps)
    if comp == "gradients" or (i.group == "autocast copies (16-bit)" and lay.drop_casts):
        return None
    return lay.activation_share if comp == "activations" and i.name != "input_ids" else 1.0


def per_gpu_plan(plan: StepPlan, lay: GpuLayout, num_layers: int) -> StepPlan:
    """The GPU's own step plan from its slice's ``plan``, see the module docstring.  A slice
    tensor the GPU holds at a share (:func:`kept_share`: most of them) is written here, as
    ``_Writer.alloc`` would write it; the rest goes through the writer.

    The slice's plan may be symbolic (sizes as polynomials in batch and sequence,
    ``plan/size.py``): a constant size is written as the whole bytes the slice holds at any
    size, a size of the batch or sequence is kept whole (share 1: activations, their
    temporaries) or dropped (share 0), and the GPU's plan is then symbolic too (one per
    setup shape and layout, read at any size); what the writer cannot write for every size
    at once (a share of an activation under sequence parallelism, a bucket filled by such
    a size) raises :class:`~vramwidget.plan.size.NotPolynomial`, and the caller writes the
    plan of one size."""
    if ADD_ONLY_FAST_PATH and lay.adds_only_startup_buffers():
        out = _with_startup_buffers(plan, lay)
        if out is not None:
            return out
    w = _Writer(plan, lay, num_layers)
    pb = w.pb
    marks = {}
    for phase, step, at in plan.marks:
        marks.setdefault(at, []).append((phase, step))
    info = plan.info
    # where the block running matters (ZeRO-3's gathered set, FSDP's units); else at() has nothing to do
    tracks = bool(lay.gathered or lay.unit_bytes or lay.grads == "unit")
    # kept_share of each tensor description (by id: one object per description), in the load and after it
    shares_load: Dict[int, Optional[float]] = {}
    shares_run: Dict[int, Optional[float]] = {}
    whole_of: Dict[int, Any] = {}               # id of a Size -> its whole bytes if constant, else None
    keymap, out_info, infos = w.key, pb.info, pb._infos
    ev_append, pop = pb.events.append, keymap.pop
    missing = object()
    # a step of the slice written as a copy of the step before (StepPlan.repeats) is the GPU's
    # copy of its step before too, where the writer starts both in the same state
    # and the passes of a step copied from the step before's (StepPlan.passes_copied: step 2's
    # forward and backward, the same as step 1's) are the GPU's copy of its own, where the
    # writer starts both in the same state but for the tensors the passes never touch
    copied = _copied_passes(plan) if COPY_REPEATED_STEPS and plan.passes_copied else {}
    step_at = _step_starts(plan) if COPY_REPEATED_STEPS and (plan.repeats or copied) else {}
    #: the slice event of the optimizer-step mark that ends a copied step's source passes -> that step
    passes_end_at = {c[5]: st for st, c in copied.items()}
    #: step -> (out event, last key, out mark, writer state) where its passes ended
    passes_end: Dict[int, Tuple[int, int, int, Any]] = {}
    #: step -> (writer state, out event, last key, out mark, slice event) at its start
    starts: Dict[int, Tuple[Any, int, int, int, int]] = {}
    #: step -> (out events after its step_end, the slice's step_end index)
    ends: Dict[int, Tuple[int, int]] = {}
    events = enumerate(plan.events)
    # the events with marks, in order: a comparison per event instead of a lookup
    mark_at = sorted(marks) + [len(plan.events) + 1]
    next_mark, mi = mark_at[0], 0
    canon: Dict[int, TensorInfo] = {}          # id of a slice description -> the GPU plan's object
    for j, (kind, key, nbytes, label) in events:
        if j < next_mark:
            here = None
        else:
            here = marks.get(j)
            while mark_at[mi] <= j:
                mi += 1
            next_mark = mark_at[mi]
        if here is not None and j in passes_end_at:
            st = passes_end_at[j]
            passes_end[st - 1] = (len(pb.events), pb.last_key, len(pb.marks), _passes_state(w, *copied[st][3:5]))
        if here is not None and j in step_at:
            st = step_at[j]
            starts[st] = (_writer_state(w), len(pb.events), pb.last_key, len(pb.marks), j)
            if st in plan.repeats and st - 1 in starts and st - 1 in ends \
                    and starts[st - 1][0] == starts[st][0]:
                _copy_step(w, starts[st - 1], ends[st - 1][0], st)
                ends[st] = (len(pb.events), ends[st - 1][1] - starts[st - 1][4] + j)
                # the slice's step, passed over: a copy of the one before, so as long
                deque(islice(events, ends[st][1] - j), maxlen=0)
                continue
            c = copied.get(st)
            if c is not None and st - 1 in starts and st - 1 in passes_end \
                    and _but_keys(starts[st - 1][0]) == _but_keys(starts[st][0]) \
                    and _copy_passes(w, starts[st - 1], passes_end[st - 1], st, c[2]):
                # the slice's passes, passed over up to its optimizer step's mark (written next)
                deque(islice(events, c[1] - 1), maxlen=0)
                continue
        if kind == "alloc":
            i = info[key]
            if w.loading and i.name == "input_ids":
                w.loading = False
        if here is not None:
            for phase, step in here:
                w.enter(phase, step)
        if kind == "free":
            k = pop(key, None)
            if k is not None:
                ev_append(("free", k, 0, ""))
            continue
        if kind == "step_end":
            w.reduce_unit()
            if lay.zero_step is not None and not w.step_done:    # an optimizer without temporaries
                w.zero_step()
            w.release_gathered()
            w.free(w.root)
            w.root, w.layer, w.step_done, w.bucket = None, None, False, 0.0
            pb.step_end(key)
            ends[key] = (len(pb.events), j)
            continue
        if kind != "alloc":
            ev_append((kind, key, nbytes, label))
            continue
        if nbytes.__class__ is Size:
            c = whole_of.get(id(nbytes), missing)     # (the plan's events hold each Size alive)
            if c is missing:
                c = whole_of[id(nbytes)] = whole_bytes(nbytes.constant()) if nbytes.is_constant() else None
            if c is not None:
                nbytes = c      # a constant: the whole bytes the slice's events hold at any size
        loading = w.loading
        shares = shares_load if loading else shares_run
        f = shares.get(id(i), missing)
        if f is missing:
            f = shares[id(i)] = kept_share(lay, i, loading)
        comp = i.component
        if f is not None:
            if tracks and not loading and comp != "optimizer states" and comp != "optimizer temporaries":
                # _layer(label), written out: a block's label is ("layer", its index, ...)
                lyr = label[1] if (label.__class__ is tuple and len(label) >= 2 and label[0] == "layer"
                                   and isinstance(label[1], int)) else None
                if lyr is None or lyr != w.layer:     # at() has nothing to do within one block
                    w.at(lyr)
            # _Writer.alloc -> PlanBuilder.alloc_as, written out
            if nbytes.__class__ is Size:      # a size of the batch and sequence: whole or dropped
                if f != 1.0 and f != 0.0:
                    raise NotPolynomial("a share of a size that depends on the batch or sequence")
                nb = nbytes if f else 0
            else:
                nb = int(nbytes * f)
            if nb.__class__ is Size or nb > 0:
                n = pb.last_key = pb.last_key + 1
                ev_append(("alloc", n, nb, i.name if label is None else label))
                out_info[n] = canon.get(id(i)) or canon.setdefault(id(i), infos.setdefault(i, i))
                keymap[key] = n
            else:
                keymap[key] = None
        elif comp == "optimizer temporaries":         # ZeRO's step, sub-group by sub-group
            keymap[key] = None
            if not w.step_done:
                w.zero_step()
        elif comp == "gradients":
            if tracks:
                w.at(_layer(label))
            w.gradient(key, nbytes, i, label)
        else:                                         # dropped
            keymap[key] = None
    return pb.plan(plan.steps)


#: copy a repeated step of the slice's plan in the GPU's (off: every event written; the
#: tests compare the two)
COPY_REPEATED_STEPS = True
#: a layout that only adds tensors living from start-up on (DDP's buckets, NCCL's buffers)
#: written as the slice's events with those inserted (off: by the writer, event by event;
#: the tests compare the two)
ADD_ONLY_FAST_PATH = True


def startup_buffers_plan(ix: Any, lay: GpuLayout) -> Optional[Tuple[StepPlan, Any]]:
    """(the GPU's plan, its index) of a layout that only adds start-up buffers
    (:meth:`GpuLayout.adds_only_startup_buffers`), from the slice's indexed plan ``ix``:
    the plan as :func:`per_gpu_plan` writes it (:func:`_with_startup_buffers`), its index
    read off the slice's (``views.PlanIndex.with_rows_inserted``: no pass over the GPU's
    events).  None where the writer writes it (another layout, no one ``inputs`` mark)."""
    from .views import PlanIndex

    if not (ADD_ONLY_FAST_PATH and lay.adds_only_startup_buffers()):
        return None
    got = _startup_insert(ix.plan, lay)
    if got is None:
        return None
    plan, at, made_before, buffer_bytes = got
    return plan, PlanIndex.with_rows_inserted(ix, plan, at, made_before, buffer_bytes)


def _with_startup_buffers(plan: StepPlan, lay: GpuLayout) -> Optional[StepPlan]:
    """The GPU's plan of :func:`_startup_insert`, or None."""
    got = _startup_insert(plan, lay)
    return None if got is None else got[0]


def _startup_insert(plan: StepPlan, lay: GpuLayout) -> Optional[Tuple[StepPlan, int, int, List[int]]]:
    """The GPU's plan of a layout that keeps every slice tensor whole and only adds
    ``startup`` buffers (:meth:`GpuLayout.adds_only_startup_buffers`), as the writer writes
    it but column by column: the slice's events with the buffers allocated just before the
    ``inputs`` mark (``_Writer.enter``), each slice key made after them moved up by their
    number (keys count up in allocation order), a constant :class:`Size` as its whole bytes,
    every other event (a step's end, a peak reset) as it is; with the event the buffers go
    before, the number of slice keys made before them and the buffers' bytes.  None where
    the slice's plan has not one ``inputs`` mark: the writer writes it."""
    import numpy as np

    from .builder import event_columns

    inputs = [m for m in plan.marks if m[0] == "inputs"]
    ev = plan.events
    n = len(ev)
    if len(inputs) != 1 or inputs[0][2] >= n:
        return None
    kinds, keys, sizes, labels = event_columns(ev)
    at = inputs[0][2]
    made_before = kinds[:at].count("alloc")           # the slice's keys 1..made_before precede the buffers
    bufs = [(int(b.nbytes), b.info) for b in lay.buffers if int(b.nbytes) > 0]
    nb = len(bufs)
    # the keys: an allocation or free of a key made after the buffers moves up by nb
    moving = np.fromiter(map(KEYED_KINDS.__contains__, kinds), dtype=bool, count=n)
    k = np.fromiter(keys, dtype=np.int64, count=n)
    k[moving & (k > made_before)] += nb
    k_all = k.tolist()
    # the sizes: a constant Size as its whole bytes, once per distinct object
    ids = list(map(id, sizes))
    by_id = dict(zip(ids, sizes))
    for i, x in by_id.items():
        if x.__class__ is Size and x.is_constant():
            by_id[i] = whole_bytes(x.constant())
    new_sizes = tuple(map(by_id.__getitem__, ids))
    out_kinds = kinds[:at] + ("alloc",) * nb + kinds[at:]
    out_keys = tuple(k_all[:at]) + tuple(range(made_before + 1, made_before + nb + 1)) + tuple(k_all[at:])
    out_sizes = new_sizes[:at] + tuple(b[0] for b in bufs) + new_sizes[at:]
    out_labels = labels[:at] + tuple(b[1].name for b in bufs) + labels[at:]
    info_keys = np.fromiter(plan.info.keys(), dtype=np.int64, count=len(plan.info))
    info_keys += nb * (info_keys > made_before)
    info: Dict[int, TensorInfo] = dict(zip(info_keys.tolist(), plan.info.values()))
    for j, (_nbytes, i) in enumerate(bufs):
        info[made_before + 1 + j] = i
    # a mark at the inputs mark's event or after it moves by nb, but one entered before the
    # inputs mark at the same event (the writer marks it before the buffers); a mark after
    # the last event is never entered by the writer
    marks: List[Tuple[str, int, int]] = []
    passed = False
    for phase, step, j in plan.marks:
        if j >= n:
            continue
        passed = passed or phase == "inputs"
        marks.append((phase, step, j + nb if j > at or (j == at and passed) else j))
    # the slice's copies, at their new places: each lies after the buffers (a step's span)
    # and its keys among those moved up; else none is kept (each event is then read)
    copies = tuple(c._replace(dst=c.dst + nb, src=c.src + nb, lo=c.lo + nb, hi=c.hi + nb,
                              ranges=tuple((lo + nb, hi + nb, d) for lo, hi, d in c.ranges)) for c in plan.copies)
    if any(c.src < at or min((c.lo,) + tuple(r[0] for r in c.ranges)) <= made_before for c in plan.copies):
        copies = ()
    return StepPlan(EventColumns(out_kinds, out_keys, out_sizes, out_labels), info, marks, plan.steps, [], 0.0,
                    plan.repeats, plan.passes_copied, copies), at, made_before, [b[0] for b in bufs]


def _step_starts(plan: StepPlan) -> Dict[int, int]:
    """The event index of each step's first mark -> the step."""
    first: Dict[int, int] = {}
    for _phase, step, at in plan.marks:
        if step >= 1 and step not in first:
            first[step] = at
    return {at: step for step, at in first.items()}


def _writer_state(w: "_Writer") -> Tuple[Any, ...]:
    """What decides the events the writer writes for a step, from its start: every tensor it
    holds (the slice's keys it maps, the strategy's buffers, gathered parameters, units,
    sharded gradients), the bucket and the phase it is in."""
    return (dict(w.key), {k: list(v) for k, v in w.live_buffers.items()}, list(w.gathered), w.root,
            list(w.unit_grads), w.bucket, w.step_done, w.in_flight, dict(w.sharded), w.layer, w.seen_layer,
            w.phase, w.loading)


def _copied_passes(plan: StepPlan) -> Dict[int, Tuple[int, int, int, int, int, int]]:
    """Each step of ``StepPlan.passes_copied`` -> (the slice event of its first mark, the
    number of events of its passes, its key shift from the step before's, the first and last
    key the step before's passes made, the slice event of the step before's optimizer-step
    mark), where the step before's passes make keys in one run
    and free only keys they made (a copy frees what the copy made; else left out: written)."""
    first: Dict[int, int] = {}
    opt: Dict[int, int] = {}
    for phase, step, at in plan.marks:
        if step >= 1:
            first.setdefault(step, at)
        if phase == "optimizer_step":
            opt.setdefault(step, at)
    ev = plan.events
    out: Dict[int, Tuple[int, int, int, int, int, int]] = {}
    for st in plan.passes_copied:
        if not all(x in d for x in (st - 1, st) for d in (first, opt)):
            continue
        a0, a1, b0, b1 = first[st - 1], opt[st - 1], first[st], opt[st]
        if a1 - a0 != b1 - b0:
            continue
        rec = next((c for c in plan.copies if c.dst == b0 and c.src == a0 and c.n == b1 - b0 and c.step is None), None)
        if rec is not None and isinstance(ev, EventColumns):
            # the passes recorded as a copy (builder.Copy): keys made in one run, moved by its
            # shift; left to see is whether they free only keys they made (in numpy)
            import numpy as np

            keys = np.fromiter(ev.keys[a0:a1], dtype=np.int64, count=a1 - a0)
            frees = np.fromiter(map("free".__eq__, ev.kinds[a0:a1]), dtype=bool, count=a1 - a0)
            if not np.any(frees & ((keys < rec.lo) | (keys > rec.hi))):
                out[st] = (b0, b1 - b0, rec.shift, rec.lo, rec.hi, a1)
            continue
        made_a = [e[1] for e in ev[a0:a1] if e[0] == "alloc"]
        made_b = [e[1] for e in ev[b0:b1] if e[0] == "alloc"]
        if not made_a or len(made_a) != len(made_b) or made_a[-1] - made_a[0] != len(made_a) - 1 \
                or made_b[-1] - made_b[0] != len(made_b) - 1:
            continue
        lo, hi = made_a[0], made_a[-1]
        if any(e[0] == "free" and not lo <= e[1] <= hi for e in ev[a0:a1]):
            continue
        out[st] = (b0, b1 - b0, made_b[0] - lo, lo, hi, a1)
    return out


def _but_keys(state: Tuple[Any, ...]) -> Tuple[Any, ...]:
    """A :func:`_writer_state` without the slice's keys it maps and the phase it is in: what
    decides the events the writer writes for passes that free only keys they made."""
    return state[1:11] + state[12:]


def _passes_state(w: "_Writer", lo: int, hi: int) -> Tuple[Any, ...]:
    """What the writer holds when a step's passes end: the slice's keys ``lo``..``hi`` (made in
    them) it maps, and everything else it keeps (``_writer_state``)."""
    return ({k: v for k, v in w.key.items() if lo <= k <= hi}, {k: list(v) for k, v in w.live_buffers.items()},
            list(w.gathered), w.root, list(w.unit_grads), w.bucket, w.step_done, w.in_flight, dict(w.sharded),
            w.layer, w.seen_layer, w.phase, dict(w.opened))


def _copy_passes(w: "_Writer", start: Tuple[Any, int, int, int, int], end: Tuple[int, int, int, Any], step: int,
                 slice_shift: int) -> bool:
    """Append the GPU's events of the passes of the step before ``step`` (from ``start``, the
    writer's state, out event, last key and mark at that step's start, to ``end``, the out
    event, last key, mark and writer state where its passes ended) as ``step``'s: each
    allocation made in them a new key, in order, as the writer would hand them out; the
    writer is left as writing them would leave it (the slice's keys the passes made moved by
    ``slice_shift``).  False (nothing written) where the GPU's passes free a tensor made
    before them or hold an event other than an allocation or a free."""
    pb = w.pb
    _state, e0, k0, m0, _j = start
    e1, k1, m1, snap = end
    span = pb.events[e0:e1]
    if any(e[0] != "alloc" and (e[0] != "free" or not k0 < e[1] <= k1) for e in span):
        return False
    d = pb.last_key - k0
    base = len(pb.events)
    out_info = pb.info
    for n in range(k0 + 1, k1 + 1):
        out_info[n + d] = out_info[n]
    pb.events.extend([(e[0], e[1] + d, e[2], e[3]) for e in span])
    pb.copied(e0, len(span), k0 + 1, k1, d)
    pb.last_key += k1 - k0
    pb.marks.extend((phase, step, at - e0 + base) for phase, _st, at in pb.marks[m0:m1])
    pb.passes_copied.append(step)

    def moved(x: Optional[int]) -> Optional[int]:
        return x + d if x is not None and k0 < x <= k1 else x

    keys, live, gathered, root, unit_grads, bucket, step_done, in_flight, sharded, layer, seen, phase, opened = snap
    for k, v in keys.items():
        w.key[k + slice_shift] = moved(v)
    w.live_buffers = {life: [moved(x) for x in v] for life, v in live.items()}
    w.gathered = [(g[0], moved(g[1]), g[2]) for g in gathered]
    w.root, w.in_flight = moved(root), moved(in_flight)
    w.unit_grads = [(moved(k), nb, i) for k, nb, i in unit_grads]
    w.sharded = {u: moved(k) for u, k in sharded.items()}
    w.bucket, w.step_done, w.layer, w.seen_layer, w.phase, w.step = bucket, step_done, layer, seen, phase, step
    w.opened = {life: (step if st == step - 1 else st) for life, st in opened.items()}
    return True


def _copy_step(w: "_Writer", start: Tuple[Any, int, int, int, int], end_event: int, step: int) -> None:
    """Append the GPU's events of the step before ``step`` (from ``start``, its writer state,
    out event, last key and mark, to ``end_event``) as ``step``'s: each allocation made in it
    a new key, in order, as the writer would hand them out; the writer ends as it did."""
    pb = w.pb
    _state, e0, k0, m0, _j = start
    span = pb.events[e0:end_event]
    k1 = max([e[1] for e in span if e[0] == "alloc"], default=k0)
    d = pb.last_key - k0
    base = len(pb.events)
    out_info = pb.info
    for n in range(k0 + 1, k1 + 1):
        out_info[n + d] = out_info[n]
    pb.events.extend([(e[0], e[1] + d, e[2], e[3]) if e[0] == "alloc" or (e[0] == "free" and k0 < e[1] <= k1)
                      else (("step_end", step, e[2], e[3]) if e[0] == "step_end" else e) for e in span])
    pb.copied(e0, len(span), k0 + 1, k1, d, step)
    pb.last_key += k1 - k0
    pb.marks.extend((phase, step, at - e0 + base) for phase, _st, at in pb.marks[m0:] if at < end_event)
    pb.repeats.append(step)
    w.step = step
    for life, st in list(w.opened.items()):
        if st == step - 1:
            w.opened[life] = step


def floor_bytes(view: Any, lay: GpuLayout) -> float:
    """A lower bound of the GPU's allocated peak, from its slice's plan ``view`` and the
    layout alone, without writing the GPU's plan: at the slice's forward, backward and
    optimizer-step peaks, the bytes the GPU's plan holds there of the slice's live tensors
    (each at :func:`kept_share`; a gradient where the layout keeps gradients whole), with the
    strategy's tensors that live from start-up to the end (``startup`` buffers: ZeRO's
    partitions and master copy, DDP's buckets...) and, in the backward, those that live
    through it (``backward``).  Left out: what the layout adds by phase (gathered
    parameters, sharded or per-unit gradients, ZeRO's step, buffers of other lifetimes).
    The ``until_step`` buffers (ZeRO's gradient partition) count where the writer has made
    them and not yet freed them: ``_Writer.first_gradient`` makes them at a step's first
    gradient and only ``_Writer.zero_step`` frees them, so without ZeRO's step (CPU offload
    of the optimizer: ``zero_step`` None) they are live at every event after the plan's
    first gradient, and with it in a backward after that step's first gradient (ZeRO-Offload
    of Llama 2 7B full, 8-bit AdamW and full checkpointing, one RTX 4090: 13.8 -> 26.3 GiB
    against a peak of 27.4).  The GPU's plan frees a key where the slice does, so it holds
    all of these at those events, and its peak is the largest live sum (of rounded sizes,
    never below the requests): the largest of the three is never above
    ``peak_allocated_bytes`` (each share's truncation to whole bytes is taken off: one byte
    per tensor).  The solvers use it to pass over a layout whose bound is already over a
    card before its plan is written (``parallel.estimate.giving_up_above``)."""
    import numpy as np

    ix, tot = view.index, view.totals
    until_step = [b.nbytes for b in lay.buffers if b.lifetime == "until_step"]
    grad_at = gradient_events(ix) if until_step else None
    backward_marks = sorted(i for p, _st, i in ix.plan.marks if p == "backward")

    def until_step_live(phase: str, at: int) -> bool:
        if not until_step or not len(grad_at) or grad_at[0] >= at:
            return False
        if lay.zero_step is None:
            return True          # made at the first gradient, never freed
        if phase != "backward":
            return False
        j = int(np.searchsorted(backward_marks, at, side="right")) - 1
        if j < 0:
            return False
        g = int(np.searchsorted(grad_at, backward_marks[j]))     # this backward's first gradient
        return g < len(grad_at) and grad_at[g] < at
    # each row's share, per distinct (description, made in the load) (per_gpu_plan's
    # ``loading``: the load ends at the first input_ids), as one vector over the rows
    gid, distinct, loaded = row_infos(ix)
    row_share = np.zeros(len(gid), dtype=np.float64)
    if len(gid):
        shares = np.zeros((len(distinct), 2), dtype=np.float64)
        for g, i in enumerate(distinct):
            for loading in (False, True):
                f = kept_share(lay, i, loading)
                if f is None and i.component == "gradients" and lay.grads == "keep":
                    f = 1.0
                shares[g, int(loading)] = f or 0.0
        row_share = shares[gid, loaded.astype(np.int64)]
    requested = np.asarray(tot.requested_bytes, dtype=np.float64)

    def kept_at(phase: str, lifetimes: Tuple[str, ...]) -> float:
        at = tot.phase_events.get(phase)
        if at is None:
            return 0.0
        rows = live_rows(ix, at)
        total = float(np.dot(requested[rows], row_share[rows]))
        bufs = [b.nbytes for b in lay.buffers if b.lifetime in lifetimes]
        if until_step_live(phase, at):
            bufs += until_step
        return total + float(sum(bufs)) - float(np.size(rows) + len(bufs))

    return max(0.0, kept_at("forward", ("startup",)), kept_at("backward", ("startup", "backward")),
               kept_at("optimizer_step", ("startup",)))
