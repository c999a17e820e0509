"""One setup's step plan: the load, then training steps as the measurements run them.

Each step (``validation/README.md``; ``shared/tools/gpu_peak.py``): ``loss =
model(input_ids=ids, labels=ids).loss`` (forward), ``del out``, ``loss.backward()``
(backward), ``optimizer.step()`` (optimizer_step), ``optimizer.zero_grad(set_to_none=True)``
(zero_grad).  Step 1 creates the optimizer's states; steps 2 and 3 repeat themselves.
"""

from __future__ import annotations

import dataclasses
from itertools import compress
from operator import itemgetter
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

from ..model.architecture import Architecture
from ..training import TrainingSetup
from ..units import DTYPE_BYTES
from .blocks import Layers, Offload, backward_layers, forward_layers, forward_ops, layers_of, param_grad, sized_ops
from .builder import KEYED_KINDS, PlanBuilder, StepPlan
from .context import CUBLAS_WORKSPACE_BYTES, CUBLAS_WORKSPACES, StepContext, step_context
from .load import Loaded, Trainable, load_model
from .loss import del_outputs, head_forward, loss_backward
from .optimizer import create_states, step_temporaries
from .profile import has_target, tower_activations
from .size import NotPolynomial

#: steps the plan runs: the first (states made lazily) and two steady ones
STEPS = 3

#: micro-batches a step writes out, however many it accumulates: the first makes the
#: gradients; every later one runs the same forward and backward and adds its gradients into
#: them in place (``variable_grad += new_grad``, torch/csrc/autograd/functions/
#: accumulate_grad.h ``accumulateGrad``: the new gradient a transient, freed at once), so the
#: third and later repeat the second, tensor for tensor.  The third is written too, so the
#: caching allocator's cache is replayed once from the state a repeat leaves (GPT-2 and
#: Qwen2.5-0.5B, full and (Q)LoRA: 2 to 9 written micro-batches give the same allocated and
#: reserved peaks; tests/test_step_plan.py).  The torch trace runs two (trace/step.py).
#: Writing all ``grad_accum_steps`` made the plan grow without bound (10**9 micro-batches
#: were accepted and filled the memory of the process).
MICRO_BATCHES_WRITTEN = 3


def build_plan(arch: Architecture, s: TrainingSetup, b: Any = None, sq: Any = None, tq: Any = None,
               steps: int = STEPS, copy: bool = True) -> StepPlan:
    """The plan of ``s`` (at its own sizes, or at ``b``, ``sq``, ``tq``: numbers or Sizes).
    ``copy=False`` writes every layer and step out instead of copying the ones that repeat
    (the same events, slower: the reference the copies are tested against)."""
    pb = PlanBuilder()
    cx = step_context(arch, s, pb, s.batch_size if b is None else b, s.seq_len if sq is None else sq, tq)
    cx.copy_layers = copy
    _workspaces(pb)
    ld = load_model(cx)
    _training_steps(cx, ld, steps)
    pb.sizes.clear()         # only the builder's own mechanisms read them
    return pb.plan(steps)


def forward_prefix(arch: Architecture, s: TrainingSetup) -> Tuple[List[Any], int]:
    """(the first events of ``s``'s plan at its own size, up to the end of the loss's forward
    in step 1's first micro-batch; the index of that forward's first event)."""
    pb = PlanBuilder()
    cx = step_context(arch, s, pb, s.batch_size, s.seq_len, None)
    cx.copy_layers = True
    _workspaces(pb)
    ld = load_model(cx)
    lay = layers_of(cx, ld)
    _inputs(cx)
    start = len(pb.events)
    _forward_pass(cx, lay, ld, 1)
    return pb.events, start


def _workspaces(pb: PlanBuilder) -> None:
    for _ in range(CUBLAS_WORKSPACES):          # left from an earlier matmul of the process
        pb.alloc(CUBLAS_WORKSPACE_BYTES / CUBLAS_WORKSPACES, "cuBLAS workspace", "workspace", "cuBLAS",
                 "cuBLAS + cuBLASLt workspaces, 32 MiB each (measured, H200, PyTorch 2.11)", "uint8")


def forward_floor_bytes(arch: Architecture, s: TrainingSetup) -> float:
    """A lower bound of the allocated peak of ``s``'s plan (:func:`build_plan`) from the start
    of the plan alone: the most requested bytes live at an event of step 1's first forward
    (the level when it starts included), up to the loss's forward (the logits).  The plan's
    own functions write those events into a scratch builder, the same first events
    :func:`build_plan` writes (``_workspaces``, ``load_model``, ``_inputs``,
    ``_forward_pass``), so the bound is what the plan holds there; the peak of the step is
    never below it (its ``first_step`` phase covers that forward, and counts rounded sizes,
    never below the requests).  About a fifth of a plan's events for a model without
    checkpointing (the load and one forward of three steps' passes); the solvers pass a
    combination over by it before its plan is written (``fit.solver._Query.estimate``:
    LoRA on Llama 2 7B without checkpointing, whose activations alone are over an RTX 4090)."""
    # one per setup (its sizes included): a search asks the same setup again on another
    # layout (fit.solver's combinations with ZeRO-Offload: parallel.estimate._per_gpu_stage)
    cache_key = (id(arch), s)
    hit = _FORWARD_FLOORS.get(cache_key)
    if hit is not None and hit[0] is arch:
        return hit[1]
    events, start = forward_prefix(arch, s)
    sizes: Dict[int, Any] = {}
    live = best = 0
    for i, (kind, key, nbytes, _label) in enumerate(events):
        if kind == "alloc":
            sizes[key] = nbytes
            live += nbytes
        elif kind == "free":
            live -= sizes.pop(key, 0)
        if i >= start - 1 and live > best:
            best = live
    if len(_FORWARD_FLOORS) >= _MAX_FLOORS:
        _FORWARD_FLOORS.clear()
    _FORWARD_FLOORS[cache_key] = (arch, float(best))
    return float(best)


def setup_shape(s: TrainingSetup) -> TrainingSetup:
    """``s`` without its sizes (a target length stays "given" or "not given") and with the
    micro-batches its plan writes (``MICRO_BATCHES_WRITTEN``: 3, 4 or 100 micro-batches
    write the same events): what a symbolic plan and a state floor are kept by."""
    return dataclasses.replace(s, batch_size=1, seq_len=1, target_len=None if s.target_len is None else 1,
                               grad_accum_steps=min(s.grad_accum_steps, MICRO_BATCHES_WRITTEN))


#: (id of the architecture, the setup without its sizes) -> (the architecture, state_floor_bytes)
_FLOORS: Dict[Tuple[int, TrainingSetup], Tuple[Architecture, Tuple[float, float]]] = {}
#: (id of the architecture, the setup) -> (the architecture, forward_floor_bytes)
_FORWARD_FLOORS: Dict[Tuple[int, TrainingSetup], Tuple[Architecture, float]] = {}
_MAX_FLOORS = 512


def state_floor_bytes(arch: Architecture, s: TrainingSetup) -> float:
    """A lower bound of the allocated peak of ``s``'s plan (:func:`build_plan`), without
    writing its steps: what the load leaves live (the model's tensors, which every step
    keeps) and, unless the optimizer steps in backward, the optimizer states (made by step
    1's ``optimizer.step()`` and kept): both are live when step 2's optimizer step begins,
    which the peak is never below (it is the largest of the phases' levels, sums of rounded
    sizes, never below the requests).  Written by the plan's own functions (``load_model``,
    ``create_states``) into a scratch builder, so it is what the plan holds there, not a
    formula beside it.  The solvers pass over a setup whose bound is already over a card
    before its plan is written (``fit.solver._Query.estimate``: Llama 2 7B full fine-tunes,
    ~75 GiB of weights and AdamW states, on a 24 GiB card).  With the optimizer in backward
    each parameter's states are made in its hook, so they are left out (a bound needs no
    more)."""
    return _floors(arch, s)[1]


def load_floor_bytes(arch: Architecture, s: TrainingSetup) -> float:
    """What the load leaves live in ``s``'s plan (the model's tensors: weights, quantization
    constants, adapters, workspaces), which every later event of the plan holds: written
    with :func:`state_floor_bytes` and kept with it."""
    return _floors(arch, s)[0]


def _floors(arch: Architecture, s: TrainingSetup) -> Tuple[float, float]:
    """(:func:`load_floor_bytes`, :func:`state_floor_bytes`) of ``s``."""
    # the load and the states do not depend on the batch or the lengths: one per setup shape
    # (tests/test_state_floor.py), so fit's bisections over sizes write it once
    key = (id(arch), setup_shape(s))
    hit = _FLOORS.get(key)
    if hit is not None and hit[0] is arch:
        return hit[1]
    pb = PlanBuilder()
    cx = step_context(arch, s, pb, s.batch_size, s.seq_len, None)
    cx.copy_layers = True
    ld = load_model(cx)
    loaded = _live_sum(pb.events)
    if not s.optimizer_in_backward:
        create_states(cx, ld.ordered)
    floors = (loaded, _live_sum(pb.events))
    if len(_FLOORS) >= _MAX_FLOORS:
        _FLOORS.clear()
    _FLOORS[key] = (arch, floors)
    return floors


def _live_sum(events: List[Any]) -> float:
    """The requested bytes live after ``events``."""
    live: Dict[int, Any] = {}
    for kind, k, nbytes, _label in events:
        if kind == "alloc":
            live[k] = nbytes
        elif kind == "free":
            live.pop(k, None)
    return float(sum(float(v) for v in live.values()))


def clear_floors() -> None:
    """Forget the state and forward floors (``plan.clear_caches``)."""
    _FLOORS.clear()
    _FORWARD_FLOORS.clear()


def _embedding_side(cx: StepContext, x: Optional[int]) -> List[int]:
    """What the forward keeps from the embedding for the backward: a LoRA embedding's input
    (``profile.embed_alloc_ops``), what the family keeps there (``Family.head_saved``: GPT-2's
    embedding dropout mask) and a vision tower's saved tensors (``profile.tower_activations``:
    the images of each sample run through the tower before the text blocks)."""
    _, kept = forward_ops(cx, sized_ops(cx, cx.prof.embed_alloc_ops), x, True, ("embedding",))
    extra = list(cx.arch.family.head_saved(cx.arch, cx.T, cx.s.method == "full"))
    if cx.arch.towers and cx.s.images_per_sample:
        if hasattr(cx.b, "terms"):
            raise NotPolynomial("a vision tower's tensors are traced at one batch size")
        extra += tower_activations(cx.arch, cx.s, cx.P, False)
    for name, nbytes, formula in extra:
        key = cx.pb.alloc(nbytes, name, "activations", "vision tower" if "tower" in name else "embedding", formula,
                          "")
        if key is not None:
            kept.append(key)
    return kept


class _Grads:
    """This step's parameter gradients.  The first micro-batch makes them; later micro-batches
    add theirs in place (``AccumulateGrad``: the new gradient is a transient).  With the
    optimizer in backward (torchtune's ``register_optim_in_bwd_hooks``, training/memory.py)
    each parameter steps in its post-accumulate-grad hook (making its states on the first
    step) and its gradient goes at once.  With ``zero_grad_set_to_none=False`` the gradients
    of the first step stay (zeroed in place) and every later micro-batch adds into them."""

    def __init__(self, cx: StepContext):
        self.cx = cx
        self.keys: List[Optional[int]] = []
        self.micro = 0
        self.states_made = False
        #: the parameters hold gradients from before this micro-batch (kept by zero_grad)
        self.kept = False

    def ready(self, bucket: Tuple[str, int], key: Optional[int], entry: Trainable) -> None:
        cx = self.cx
        if cx.s.optimizer_in_backward:
            if not self.states_made:
                create_states(cx, [entry])
            step_temporaries(cx, [entry])
            cx.pb.free(key)
        elif self.micro == 0 and not self.kept:
            self.keys.append(key)
        else:
            cx.pb.free(key)

    def zero_grad(self) -> None:
        """``optimizer.zero_grad(set_to_none=...)`` (torch/optim/optimizer.py
        ``Optimizer.zero_grad``; torch/nn/modules/module.py ``Module.zero_grad``, what the HF
        Trainer calls, does the same): ``set_to_none=True`` sets each ``p.grad = None``, which
        frees it.  ``False`` calls ``p.grad.zero_()``: every gradient stays allocated, and the
        next backward's ``AccumulateGrad`` finds it defined and adds the new gradient into it
        in place (``variable_grad += new_grad``, torch/csrc/autograd/functions/
        accumulate_grad.h ``accumulateGrad``): the new one is a transient, as for a later
        micro-batch.  zero_() is in place: nothing is allocated."""
        if not self.cx.s.zero_grad_set_to_none:
            self.kept = bool(self.keys) or self.kept
            return
        for k in self.keys:
            self.cx.pb.free(k)
        self.keys = []


def _training_steps(cx: StepContext, ld: Loaded, steps: int) -> None:
    pb, s, arch = cx.pb, cx.s, cx.arch
    lay = layers_of(cx, ld)
    ids, labels = _inputs(cx)
    grads = _Grads(cx)
    first_grads: List[Optional[int]] = []
    for step in range(1, steps + 1):
        if step >= 3 and cx.copy_layers and _repeat_step(pb, step):
            continue
        if step == 2 and not s.optimizer_in_backward and cx.copy_layers and s.zero_grad_set_to_none:
            # forward and backward are those of step 1 (the first step differs only in its
            # optimizer step, which makes the states): the same events, new keys
            grads.keys = _copy_passes(pb, step, first_grads)
        else:
            for micro in range(min(s.grad_accum_steps, MICRO_BATCHES_WRITTEN)):
                grads.micro = micro
                _micro_batch(cx, lay, ld, grads, step)
        pb.mark("optimizer_step", step)
        if not s.optimizer_in_backward:
            if not grads.states_made:
                create_states(cx, ld.ordered)
            step_temporaries(cx, ld.ordered)
        grads.states_made = True
        pb.mark("zero_grad", step)
        first_grads = list(grads.keys)
        grads.zero_grad()
        pb.step_end(step)
    pb.free(ids)
    pb.free(labels)


def _inputs(cx: StepContext) -> Tuple[Optional[int], Optional[int]]:
    """The inputs of every step: (input_ids, labels), after the peak statistics are reset."""
    pb = cx.pb
    # the measurements reset the peak statistics once the model is built (gpu_peak.py); the
    # load's own peak is phases_bytes["load"]
    pb.mark("inputs", 0)
    pb.events.append(("reset_peak", 0, 0, ""))
    ids = pb.alloc(cx.T * 8, "input_ids", "activations", "inputs", "b x s x 8 B (int64)", "int64")
    # a causal LM is given labels=input_ids (the measurements' model(input_ids=ids, labels=ids));
    # an encoder-decoder's decoder reads labels of its own (b x target tokens)
    labels = pb.alloc(cx.Th * 8, "labels", "activations", "inputs", "b x t x 8 B (int64)",
                      "int64") if has_target(cx.arch) else None
    return ids, labels


def _repeat_step(pb: PlanBuilder, step: int) -> bool:
    """Write step ``step`` as a copy of the one before (the steps after the first repeat
    themselves: same tensors, same order); False (nothing written) when that step keeps an
    allocation of its own past its end, which a copy would not free."""
    prev = [(p, st, i) for p, st, i in pb.marks if st == step - 1]
    start = prev[0][2]
    end = pb.step_ends.get(step - 1)
    if end is None or end < start:
        return False
    span = pb.events[start:end]
    # (the span's kinds and keys as columns: a pass in C each)
    kinds, keys = list(map(itemgetter(0), span)), list(map(itemgetter(1), span))
    made = list(compress(keys, map("alloc".__eq__, kinds)))
    if not set(made) <= set(compress(keys, map("free".__eq__, kinds))):
        return False
    base = len(pb.events)
    _append_copy(pb, span, start, made)
    pb.marks.extend((p, step, i - start + base) for p, st, i in prev)
    pb.step_end(step)
    pb.repeats.append(step)
    return True


def _copy_passes(pb: PlanBuilder, step: int, grads: List[Optional[int]]) -> List[Optional[int]]:
    """Append a copy of step ``step - 1``'s forward and backward passes (its events from its
    first forward to its optimizer step) as step ``step``'s, every allocation a new key;
    returns the copies of that step's gradients ``grads`` (which zero_grad frees), in order."""
    prev = [(p, st, i) for p, st, i in pb.marks if st == step - 1]
    start = prev[0][2]
    end = next(i for p, st, i in prev if p == "optimizer_step")
    span = pb.events[start:end]
    new = _append_copy(pb, span, start)
    base = len(pb.events) - len(span)
    pb.marks.extend((p, step, i - start + base) for p, st, i in prev if i < end)
    pb.passes_copied.append(step)
    return [new.get(k, k) for k in grads]


def _append_copy(pb: PlanBuilder, span: List[Any], src: int, made: Optional[List[int]] = None) -> Dict[int, int]:
    """Append ``span`` (the events from ``src`` on) with a new key for each allocation made in
    it (frees of keys made before it are kept), recorded as a copy (``PlanBuilder.copied``);
    returns old key -> new key."""
    info = pb.info
    n = pb.last_key
    if made is None:        # the keys the span makes, in order
        made = [e[1] for e in span if e[0] == "alloc"]
    fresh = range(n + 1, n + 1 + len(made))
    new: Dict[int, int] = dict(zip(made, fresh))
    info.update(zip(fresh, [info[k] for k in made]))
    get = new.get
    pb.events.extend([(e[0], get(e[1], e[1]), e[2], e[3]) if e[0] in KEYED_KINDS else e for e in span])
    pb.last_key = n + len(made)
    if made and made[-1] - made[0] == len(made) - 1:
        # keys made in one run (the builder hands them out in order): a shift of that run
        pb.copied(src, len(span), made[0], made[-1], n + 1 - made[0])
    return new



def _micro_batch(cx: StepContext, lay: Layers, ld: Loaded, grads: _Grads, step: int) -> None:
    """One forward and backward (one micro-batch of the step)."""
    _backward_pass(cx, lay, ld, grads, step, _forward_pass(cx, lay, ld, step))


class _Forward(NamedTuple):
    """What a micro-batch's forward leaves its backward."""

    off: Optional[Offload]
    embed_kept: List[int]
    mask: Optional[int]
    autocast_cache: List[int]
    keep: List[Any]
    spans: List[Any]
    hf: Any


def _forward_pass(cx: StepContext, lay: Layers, ld: Loaded, step: int) -> _Forward:
    """A micro-batch's forward, up to the loss's (the logits)."""
    pb, s = cx.pb, cx.s
    pb.mark("forward", step)
    off = Offload(cx) if s.activation_offloading else None
    x = pb.alloc(cx.T * cx.h * cx.resid_bytes, "embedding output", "activations", "embedding", "T x h", cx.resid)
    embed_kept = _embedding_side(cx, x)
    mask = pb.alloc(cx.b * cx.sq * cx.sq * DTYPE_BYTES[cx.c], "causal mask (eager)", "activations", "attention",
                    "b x s x s", cx.c) if cx.backend == "eager" else None
    autocast_cache: List[int] = []   # casts of trainable weights under checkpointing
    x, keep, spans = forward_layers(cx, lay, x, autocast_cache, off)
    if not cx.gc:
        # the mask is the decoder's local (LlamaModel.forward's causal_mask): gone when it
        # returns, before the head; checkpointing keeps it by reference for the recompute
        pb.free(mask)
    if off is not None:
        for _ in range(cx.prof.head_packs):   # the final norm's packs: the newest ids
            off.pack(None)
    hf = head_forward(cx, lay, ld, x)
    return _Forward(off, embed_kept, mask, autocast_cache, keep, spans, hf)


def _backward_pass(cx: StepContext, lay: Layers, ld: Loaded, grads: _Grads, step: int, fw: _Forward) -> None:
    """The rest of a micro-batch after its forward: ``del out``, then the backward."""
    pb, s, arch = cx.pb, cx.s, cx.arch
    off, embed_kept, mask, autocast_cache, keep, spans, hf = fw
    for k in autocast_cache:   # leaving torch.autocast clears its cache (autocast_mode.cpp clear_cache)
        pb.free(k)
    del_outputs(cx, hf)        # del out: the logits go (the head saves its input)
    pb.mark("backward", step)
    g, tied_key = loss_backward(cx, ld, hf, grads.ready)
    g = backward_layers(cx, lay, ld, keep, g, grads.ready, off, spans)
    if cx.gc:
        pb.free(mask)
    for k in embed_kept:
        pb.free(k)
    for entry in ld.embed_params:
        if arch.tie_word_embeddings and s.method == "full" and tied_key is not None:
            # a tied head's gradient waits in autograd's input buffer for the embedding's; the
            # engine adds in place only into a plain tensor it holds the last reference to
            # (torch/csrc/autograd/input_buffer.cpp ``can_accumulate_inplace``): under autocast
            # the head's arrives as the fp32 cast of its mm (plain), else as a transposed view
            # of it, and the sum is a third V x h tensor (checked on the CPU: aten::add vs add_)
            emb = pb.alloc(entry.nbytes, "embedding gradient (added to the tied head's)", "gradients", "embedding",
                           "V x h", entry.dtype)
            if not s.autocast:
                total = pb.alloc(entry.nbytes, "tied head + embedding gradient", "gradients", "embedding",
                                 "V x h (the sum, out of place)", entry.dtype)
                pb.free(tied_key)
                tied_key = total
            pb.free(emb)
            grads.ready(("embed", 0), tied_key, entry)
            tied_key = None
        else:
            grads.ready(("embed", 0), param_grad(cx, entry, (entry.module, "grad")), entry)
    if tied_key is not None:
        grads.ready(("head", 0), tied_key, ld.head_params[0] if ld.head_params else ld.embed_params[0])
    pb.free(g)
