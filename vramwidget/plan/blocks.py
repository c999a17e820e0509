"""The blocks' forward and backward, op by op, from their traces (``model/activations.py``).

Forward: each tensor a block's trace creates is allocated; autograd's saved tensors stay,
the others go once their consumer's output exists (``outlives``); the residual stream lives
until the next residual add.  Under full checkpointing nothing is saved but the block's
input, and backward reruns the block's forward first (non-reentrant
``torch.utils.checkpoint``).  Backward walks the ops in reverse: each op's consumer makes the
op's gradient, the saved tensors go as they are passed, the parameters' gradients appear
where their op ran.  Autocast's 16-bit weight copies are made per block and cached for
backward (``aten/src/ATen/autocast_mode.cpp`` ``cached_cast``: only leaves that require grad).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..units import DTYPE_BYTES
from .builder import KEYED_KINDS, canonical
from .context import StepContext
from .load import Loaded, Trainable
from .profile import dora_norm_bytes, dora_weight_copies_per_layer, layer_key, poly

#: one sized op of a block: ("new", name, bytes, requires_grad, saved, outlives, saved by its
#: producer, residual-stream role, group, formula, dtype, pack calls) or ("param", module) or
#: ("together", names)
Op = Tuple[Any, ...]
GradReady = Callable[[Tuple[str, int], Optional[int], Trainable], None]


def sized_ops(cx: StepContext, src: List[Tuple[Any, ...]]) -> List[Op]:
    """A profile's ops with their bytes at the step's sizes."""
    out: List[Op] = []
    for op in src:
        if op[0] != "new":
            out.append(op)
            continue
        _, name, dtype, rg, saved, coef, outlives, by_producer, cn, stream, group, formula, packs = op
        out.append(("new", name, DTYPE_BYTES[dtype] * poly(cn, coef, cx.M), rg, saved, outlives, by_producer, stream,
                    group, _formula(formula, dtype), dtype, packs))
    return out


def input_saved(ops: List[Op]) -> bool:
    """Whether the block keeps its input (its first norm saves it without a cast)."""
    return bool(ops) and ops[0][0] == "new" and ops[0][4]


@dataclass
class Layers:
    """The blocks of one setup at the step's sizes: which ops each layer runs."""

    ops: List[List[Op]]
    first_train: int
    #: each layer's residual stream bytes (an encoder-decoder's decoder layers carry b x t tokens)
    resid_bytes: List[Any]
    #: per layer: autocast's 16-bit copies of its fp32 weights, and whether the cache keeps them
    cast_bytes: Dict[int, List[Any]] = field(default_factory=dict)
    cached: Dict[int, bool] = field(default_factory=dict)
    #: DoRA: what each trained layer keeps beside its trace, and an adapted module's working set
    dora_kept_bytes: float = 0.0
    dora_norm_bytes: float = 0.0


def layers_of(cx: StepContext, ld: Loaded) -> Layers:
    arch, s, prof = cx.arch, cx.s, cx.prof
    L = cx.L
    first_train = L - s.trainable_layers if s.method == "freeze" else 0
    first_ops = sized_ops(cx, prof.alloc_ops[1])
    # each layer runs its own kind's block (a mixed stack's kinds, leading dense layers;
    # profile.layer_key), the first trained one its traced first block
    by_key = {k: sized_ops(cx, ops) for k, ops in prof.kind_alloc_ops.items()}
    steady = sized_ops(cx, prof.alloc_ops[0])
    order = arch.family.layer_order(arch) if by_key else None
    ops = [first_ops if layer == first_train else by_key.get(layer_key(arch, order, layer), steady)
           for layer in range(L)]
    resid = cx.T * cx.h * cx.resid_bytes
    kinds_order = arch.family.layer_order(arch) if s.target_len is not None else None
    resids = [cx.Th * cx.h * cx.resid_bytes if kinds_order and layer < len(kinds_order)
              and kinds_order[layer] in arch.family.target_kinds else resid for layer in range(L)]
    lay = Layers(ops, first_train, resids, dora_kept_bytes=dora_weight_copies_per_layer(arch, s, cx.P),
                 dora_norm_bytes=dora_norm_bytes(arch, s, cx.P))
    if s.autocast:
        c = cx.c
        for layer in range(L):
            lin = [(n, tr) for t, dt, nb, tr, n in ld.per_layer[layer] if t.linear and not t.is_bias and dt == "float32"]
            lay.cast_bytes[layer] = [n * DTYPE_BYTES[c] for n, _ in lin]
            lay.cached[layer] = any(tr for _, tr in lin)
        lay.cast_bytes[-1] = [n * DTYPE_BYTES[c] for t, dt, nb, tr, n in ld.before + ld.after
                              if (t.role == "output_head" or (t.role == "embedding" and arch.tie_word_embeddings))
                              and dt == "float32"]
    return lay


def forward_ops(cx: StepContext, ops: List[Op], x_key: Optional[int], keep_saved: bool,
                label: Tuple[Any, ...], held: Optional[List[int]] = None,
                packs: Optional[List[int]] = None) -> Tuple[Optional[int], List[int]]:
    """Allocate one block's (or the head's) tensors; returns the output's key and the kept keys.
    ``ops[0]`` is the input (the previous block's output).  ``held``: the transients still
    pending at the end are appended there instead of freed (the head's output, which the
    output head reads next).  ``packs``: each kept key's pack calls are appended there
    (activation offloading counts them)."""
    pb = cx.pb
    saved: List[int] = []
    # transients, each freed once the tensors it outlives exist (normally the next one: its
    # consumer's output): [key, tensors still to come]
    pending: List[List[Any]] = []
    resid = x_key                     # the residual stream lives until the next add
    out_key: Optional[int] = None
    for op in ops[1:]:
        if op[0] != "new":
            continue
        _, name, nbytes, rg, is_saved, outlives, _by_producer, stream, group, formula, dtype, n_packs = op
        key = pb.alloc(nbytes, name, "activations", group, formula, dtype, label=label + (name,))
        if packs is not None and is_saved and keep_saved and key is not None:
            packs.append(n_packs)
        for p in pending:
            p[1] -= 1
            if p[1] <= 0:
                pb.free(p[0])
        pending = [p for p in pending if p[1] > 0]
        if stream:
            # the residual stream lives until the next residual add; a norm may save it
            if resid is not None and resid != x_key and resid not in saved:
                pb.free(resid)
            resid = key
            if stream == "out":
                out_key = key
            elif is_saved and keep_saved and key is not None:
                saved.append(key)
            continue
        if is_saved and keep_saved:
            if key is not None:
                saved.append(key)
        elif key is not None:
            pending.append([key, outlives])
    for p in pending:
        if held is not None:
            held.append(p[0])
        else:
            pb.free(p[0])
    return out_key, saved


def backward_ops(cx: StepContext, ops: List[Op], grad_key: Optional[int], saved: List[int],
                 params: List[Trainable], input_grad_bytes: Any, label: Tuple[Any, ...], bucket: Tuple[str, int],
                 grad_ready: GradReady) -> Optional[int]:
    """Walk one block's ops in reverse: each op makes its input's gradient and frees its
    output's; parameter gradients appear where their op ran; saved tensors go as passed.
    Returns the key of the input's gradient (``input_grad_bytes``)."""
    pb = cx.pb
    by_module: Dict[str, List[Trainable]] = {}
    for entry in params:
        by_module.setdefault(entry.module, []).append(entry)
    saved_iter = list(saved)
    g = grad_key
    deferred: List[int] = []          # kept by the node that made them: freed after its backward
    # gradients one backward call makes together (profile "together" ops): name -> the group
    together = {n: names for op in ops if op[0] == "together" for names in (op[1],) for n in names}
    early: Dict[str, Optional[int]] = {}   # gradients made before their tensor's turn
    # the residual stream's gradient: AddBackward passes it to the branch unchanged and it
    # waits for the branch's gradient to be added to it, so it lives through the branch
    resid_g: Optional[int] = None
    deq: Optional[int] = None         # a 4-bit weight dequantized for its input's gradient
    sizes = {op[1]: op for op in ops if op[0] == "new"}
    for op in reversed(ops[1:]):
        if op[0] == "param":
            for entry in by_module.pop(op[1], []):
                grad_ready(bucket, param_grad(cx, entry, label + (op[1], "grad")), entry)
            continue
        if op[0] != "new":
            continue
        _, name, nbytes, rg, is_saved, _outlives, by_producer, _stream, group, formula, dtype, _packs = op
        # the consumer of this tensor runs: it makes the tensor's gradient, then autograd
        # releases what the node saved, then the consumer's own incoming gradient goes
        if name.endswith("dequantized weight"):
            # MatMul4Bit.backward dequantizes again for the input gradient (bitsandbytes
            # autograd/_functions.py: grad_A = grad_output @ dequantize_4bit(B).t()): the
            # 16-bit weight lives until that gradient exists
            pb.free(deq)
            deq = pb.alloc(nbytes, name, "activations", group, formula, dtype, label=label + (name,))
            continue
        if name in early:
            ng = early.pop(name)
        elif rg:
            ng = pb.alloc(nbytes, "grad of " + name, "activations", group, formula, dtype,
                          label=label + ("grad of", name))
            for other in together.get(name, ()):
                o = sizes.get(other)
                if other != name and o is not None and other not in early:
                    early[other] = pb.alloc(o[2], "grad of " + other, "activations", o[8], o[9], o[10],
                                            label=label + ("grad of", other))
        else:
            ng = None
        if deq is not None and ng is not None:
            pb.free(deq)
            deq = None
        if rg and deferred:
            # this gradient is the producer's backward output: the producer's saves go now
            for k in deferred:
                pb.free(k)
            deferred = []
        if is_saved and saved_iter:
            if by_producer:
                deferred.append(saved_iter.pop())
            else:
                pb.free(saved_iter.pop())
        if rg:
            if _stream:
                # a residual sum's gradient: the branch's gradient is added to the one the
                # residual connection passed on (autograd's InputBuffer, out of place)
                if resid_g is not g:
                    pb.free(resid_g)
                resid_g = ng
            if g is not resid_g or _stream:
                pb.free(g)
            g = ng
    for rest in by_module.values():      # parameters no op of the trace named (biases...)
        for entry in rest:
            grad_ready(bucket, param_grad(cx, entry, label + ("grad",)), entry)
    for k in saved_iter + deferred + list(early.values()) + [deq]:
        pb.free(k)
    ng = pb.alloc(input_grad_bytes, "grad of the block input", "activations", "residual stream",
                  "T x h (the residual stream)", cx.resid, label=label + ("grad of block input",))
    if resid_g is not g:
        pb.free(resid_g)
    pb.free(g)
    return ng


def param_grad(cx: StepContext, entry: Trainable, label: Tuple[Any, ...]) -> Optional[int]:
    """A parameter's gradient, in its dtype."""
    e = entry
    return cx.pb.alloc(e.nbytes, e.module, "gradients", e.group, f"{int(e.numel):,} x {DTYPE_BYTES[e.dtype]:g} B "
                       f"({e.dtype})", e.dtype, label=label)


def _formula(formula: str, dtype: str) -> str:
    return f"{formula} x {DTYPE_BYTES[dtype]:g} B ({dtype})" if formula else ""


@dataclass
class Kept:
    """What one block keeps from its forward for its backward."""

    inp: Optional[int]
    saved: List[int]
    casts: List[int]
    #: what the block keeps beside its trace (DoRA's per-layer norm vectors and weight copies)
    extra: List[int] = field(default_factory=list)


class Offload:
    """Activation offloading (torchtune ``training/_activation_offloading.py``
    ``OffloadActivations``, which TRL's ``activation_offloading`` copies): every pack call of
    a saved tensor gets an id; a tensor of at least 1 KiB is copied to pinned CPU memory and
    its GPU copy waits in a forward stash until a tensor ``max_fwd_stash_size`` (5) ids newer
    is packed.  In backward a tensor whose GPU copy went is brought back before its node
    runs; what is still in the stash is used as it is.  Here a block's saved tensors are
    packed when the block's forward ends (its residual stream is in use until then)."""

    STASH = 5

    def __init__(self, cx: StepContext):
        self.cx = cx
        self.ids = 0
        self.stash: List[Tuple[int, int]] = []      # (id, key), oldest first
        self.refs: Dict[int, int] = {}
        self.gone: Dict[int, Any] = {}              # key -> its bytes, now on the CPU only

    def pack(self, key: Optional[int], packs: int = 1) -> None:
        """``key`` is packed ``packs`` times (None: an id without bytes, e.g. checkpoint's
        placeholder)."""
        for _ in range(max(packs, 1)):
            self.ids += 1
            if key is not None:
                self.stash.append((self.ids, key))
                self.refs[key] = self.refs.get(key, 0) + 1
        while self.stash and self.stash[0][0] <= self.ids - self.STASH:
            _, k = self.stash.pop(0)
            self.refs[k] -= 1
            if self.refs[k] == 0 and k not in self.gone:
                self.gone[k] = self.cx.pb.sizes[k]
                self.cx.pb.host_bytes = self.cx.pb.host_bytes + self.cx.pb.sizes[k]
                self.cx.pb.free(k)

    def restore(self, key: Optional[int]) -> Optional[int]:
        """Bring ``key`` back to the GPU for its backward (a new allocation) if it went."""
        if key is None or key not in self.gone:
            return key
        info = self.cx.pb.info[key]
        return self.cx.pb.alloc(self.gone.pop(key), info.name + " (brought back from the CPU)", info.component,
                                info.group, info.formula, info.dtype)

    def forget(self) -> None:
        """The forward stash is dropped in backward: what it held stays where it is."""
        self.stash.clear()
        self.refs.clear()


@dataclass
class _Span:
    """One layer's events in the plan: [first, last) event and [first, last) key it made,
    its output, what it keeps, and the keys it handed on (autocast's cache, gradients)."""

    events: Tuple[int, int]
    keys: Tuple[int, int]
    out: Optional[int] = None
    kept: Optional[Kept] = None
    handed: List[Optional[int]] = field(default_factory=list)
    #: a backward span's parameter gradients: (bucket, key, trainable) as grad_ready got them
    grads: List[Tuple[Any, Optional[int], Trainable]] = field(default_factory=list)


def _begin(pb: Any) -> Tuple[int, int]:
    return len(pb.events), pb.last_key + 1


def _end(pb: Any, begin: Tuple[int, int], **kw: Any) -> _Span:
    return _Span((begin[0], len(pb.events)), (begin[1], pb.last_key + 1), **kw)


def _copy(pb: Any, src: _Span, layer: int, shifts: List[Tuple[int, int, int]]) -> Callable[[Optional[int]], Any]:
    """Append ``src``'s events as layer ``layer``'s: each key it made becomes the next key the
    builder hands out, every other key in a (lo, hi, delta) of ``shifts`` moves by delta (the
    same tensor one layer on); returns that key map."""
    D = pb.last_key + 1 - src.keys[0]

    def key_of(k: Optional[int]) -> Any:
        if k is None:
            return None
        if src.keys[0] <= k < src.keys[1]:
            return k + D
        for lo, hi, d in shifts:
            if lo <= k < hi:
                return k + d
        return k

    info, append = pb.info, pb.events.append
    span = pb.events[src.events[0]:src.events[1]]
    for kind, key, nbytes, label in span:
        if label.__class__ is tuple and label and label[0] == "layer":
            label = canonical(("layer", layer) + label[2:])
        if kind == "alloc":
            info[key + D] = info[key]
            append((kind, key + D, nbytes, label))
        else:
            append((kind, key_of(key), nbytes, label))
    pb.last_key += src.keys[1] - src.keys[0]
    if set(map(itemgetter(0), span)) <= KEYED_KINDS:     # (key_of moves any event's key: kept to these)
        pb.copied(src.events[0], len(span), src.keys[0], src.keys[1] - 1, D,
                  ranges=tuple((lo, hi - 1, d) for lo, hi, d in shifts), own_labels=True)
    return key_of



def _same_layers(cx: StepContext, lay: Layers, layers: List[int]) -> bool:
    """Whether these trained layers run the very same block (so one's events, shifted, are the
    next one's)."""
    if any(j < lay.first_train or j >= cx.L for j in layers):
        return False
    first = layers[0]
    return all(lay.ops[j] is lay.ops[first] and lay.cast_bytes.get(j) == lay.cast_bytes.get(first)
               and lay.cached.get(j) == lay.cached.get(first) and lay.resid_bytes[j] == lay.resid_bytes[first]
               for j in layers)


def forward_layers(cx: StepContext, lay: Layers, x: Optional[int], autocast_cache: List[int],
                   off: Optional[Offload] = None) -> Tuple[Optional[int], List[Kept], List[_Span]]:
    """Every block's forward: returns the last output's key, what each block keeps, and each
    layer's span of events.  A trained layer that runs the same block as the two before it is
    written as a copy of the one before, shifted (activation offloading's stash aside)."""
    pb = cx.pb
    keep: List[Kept] = []
    spans: List[_Span] = []
    for layer in range(cx.L):
        if cx.copy_layers and off is None and layer >= 2 and _same_layers(cx, lay, [layer - 2, layer - 1, layer]):
            src, before = spans[-1], spans[-2]
            key_of = _copy(pb, src, layer, [(before.keys[0], before.keys[1], src.keys[1] - src.keys[0])])
            b = src.kept
            kept = Kept(key_of(b.inp), [key_of(k) for k in b.saved], [key_of(k) for k in b.casts],
                        [key_of(k) for k in b.extra])
            span = _Span((src.events[1], len(pb.events)), (src.keys[1], pb.last_key + 1), key_of(src.out), kept,
                         [key_of(k) for k in src.handed])
            autocast_cache.extend(span.handed)
        else:
            begin = _begin(pb)
            out, kept, handed = _forward_layer(cx, lay, layer, x, off)
            autocast_cache.extend(handed)
            span = _end(pb, begin, out=out, kept=kept, handed=handed)
        spans.append(span)
        keep.append(span.kept)
        x = span.out
    if cx.gc:
        for k in keep:
            if k.inp is not None:
                info = pb.info[k.inp]
                pb.info[k.inp] = info._replace(name="layer input kept by checkpointing", group="checkpointed inputs")
    return x, keep, spans


def _forward_layer(cx: StepContext, lay: Layers, layer: int, x: Optional[int],
                   off: Optional[Offload]) -> Tuple[Optional[int], Kept, List[int]]:
    """One block's forward: (its output, what it keeps, the weight copies autocast caches)."""
    pb = cx.pb
    ops = lay.ops[layer]
    casts = [k for k in (pb.alloc(nb, "autocast copy of a block weight", "weights", "autocast copies (16-bit)",
                                  "out x in x 2 B", cx.c, label=("layer", layer, "weight cast"))
                         for nb in lay.cast_bytes.get(layer, [])) if k is not None]
    trained = layer >= lay.first_train
    _dora_working_set(cx, lay, trained)
    packs: List[int] = []
    handed: List[int] = []
    if cx.gc:
        out, saved = forward_ops(cx, ops, x, False, ("layer", layer))
        if lay.cached.get(layer):
            handed = casts
        else:
            for k in casts:
                pb.free(k)
        casts = []
    else:
        out, saved = forward_ops(cx, ops, x, trained, ("layer", layer), packs=packs)
    if not trained:
        # a frozen layer below the trained ones (freeze) runs outside autograd's graph: it
        # saves nothing, its input goes once it has run, and autocast's copies of its
        # weights are not cached (only leaves that require grad are: autocast_mode.cpp)
        for k in casts + ([x] if x is not None else []):
            pb.free(k)
        return out, Kept(None, [], []), handed
    if cx.gc:
        if off is not None:
            off.pack(None)               # checkpoint's _NoopSaveInputs: a placeholder and the input
            off.pack(x)
        return out, Kept(x, [], casts), handed
    # the block input is saved by the first norm (when it needs no cast) or freed
    kept_x = x if (x is not None and input_saved(ops)) else None
    if x is not None and kept_x is None:
        pb.free(x)
    kept = Kept(kept_x, saved, casts, _dora_kept(cx, lay, layer))
    if off is not None:
        if kept_x is not None:
            off.pack(kept_x, ops[0][11] if ops[0][0] == "new" else 1)
        for k, n in zip(saved, packs):
            off.pack(k, n)
    return out, kept, handed


def _dora_working_set(cx: StepContext, lay: Layers, trained: bool) -> None:
    """DoRA's weight-norm working set while an adapted module runs (``profile.dora_norm_bytes``:
    the largest adapted module's)."""
    if trained and lay.dora_norm_bytes:
        cx.pb.free(cx.pb.alloc(lay.dora_norm_bytes, "DoRA weight-norm working set", "activations", "adapters",
                               "in x in identity + in x r + 4 x out x in (adapter dtype), largest adapted module",
                               cx.P.adapter_dtype))


def _dora_kept(cx: StepContext, lay: Layers, layer: int) -> List[int]:
    """What DoRA keeps per layer beside the trace (``profile.dora_weight_copies_per_layer``)."""
    key = cx.pb.alloc(lay.dora_kept_bytes, "DoRA norm vectors and weight copies", "activations", "adapters",
                      "3 x out (+ out x in with dropout) per adapted module", cx.P.adapter_dtype,
                      label=("layer", layer, "DoRA kept")) if lay.dora_kept_bytes else None
    return [key] if key is not None else []


def backward_layers(cx: StepContext, lay: Layers, ld: Loaded, keep: List[Kept], g: Optional[int],
                    grad_ready: GradReady, off: Optional[Offload] = None,
                    fwd: Optional[List[_Span]] = None) -> Optional[int]:
    """Every trained block's backward, last first (recomputed first under checkpointing).  A
    layer that runs the same block as its neighbours is written as a copy of the one after
    it, shifted (``fwd``: the forward's spans; not with offloading or the optimizer in
    backward, whose steps make states of their own)."""
    pb = cx.pb
    if off is not None:
        off.forget()
    spans: Dict[int, _Span] = {}
    copyable = cx.copy_layers and off is None and fwd is not None and not cx.s.optimizer_in_backward
    for layer in reversed(range(lay.first_train, cx.L)):
        if copyable and layer + 2 in spans and _same_layers(cx, lay, [layer - 2, layer - 1, layer, layer + 1,
                                                                      layer + 2]):
            src, before = spans[layer + 1], spans[layer + 2]
            fstride = fwd[layer + 1].keys[0] - fwd[layer].keys[0]
            key_of = _copy(pb, src, layer, [(before.keys[0], before.keys[1], src.keys[1] - src.keys[0]),
                                            (fwd[layer].keys[0], fwd[layer + 1].keys[1], -fstride)])
            span = _Span((src.events[1], len(pb.events)), (src.keys[1], pb.last_key + 1), key_of(src.out),
                         grads=[(bucket, key_of(key), entry) for bucket, key, entry in src.grads])
            # what grad_ready did with each gradient: kept it (the copy hands it on) or freed it
            # at once (a later micro-batch's, added in place: the copied events free it)
            freed = {e[1] for e in pb.events[src.events[0]:src.events[1]] if e[0] == "free"}
            for (bucket, key, entry), (_, old, _) in zip(span.grads, src.grads):
                if old not in freed:
                    grad_ready(bucket, key, entry)
        else:
            begin = _begin(pb)
            given: List[Tuple[Any, Optional[int], Trainable]] = []

            def ready(bucket: Any, key: Optional[int], entry: Trainable) -> None:
                given.append((bucket, key, entry))
                grad_ready(bucket, key, entry)

            out = _backward_layer(cx, lay, ld, layer, keep[layer], g, ready, off)
            span = _end(pb, begin, out=out, grads=given)
        spans[layer] = span
        g = span.out
    return g


def _backward_layer(cx: StepContext, lay: Layers, ld: Loaded, layer: int, k: Kept, g: Optional[int],
                    grad_ready: GradReady, off: Optional[Offload]) -> Optional[int]:
    """One block's backward (its forward rerun first under checkpointing); returns the input's
    gradient."""
    pb = cx.pb
    ops = lay.ops[layer]
    if off is not None:
        k = Kept(off.restore(k.inp), [off.restore(x) for x in k.saved], k.casts, k.extra)
    saved, casts, extra = k.saved, k.casts, k.extra
    if cx.gc:
        # non-reentrant checkpointing: the block's forward runs again, keeping its saves
        casts = [pb.alloc(nb, "autocast copy of a block weight (recompute)", "weights",
                          "autocast copies (16-bit)", "out x in x 2 B", cx.c,
                          label=("layer", layer, "weight cast (recompute)"))
                 for nb in lay.cast_bytes.get(layer, [])]
        _dora_working_set(cx, lay, True)
        out, saved = forward_ops(cx, ops, k.inp, True, ("layer", layer, "(recomputed)"))
        extra = _dora_kept(cx, lay, layer)
        pb.free(out)      # the recomputed block's output is not needed again
    g = backward_ops(cx, ops, g, saved, ld.layer_params[layer], lay.resid_bytes[layer], ("layer", layer),
                     ("layer", layer), grad_ready)
    for c in casts + extra:
        pb.free(c)
    if k.inp is not None:
        pb.free(k.inp)
    return g
