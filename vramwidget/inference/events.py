"""One ``generate()`` call as the caching allocator sees it: loading, prefill, decode.

The parts of the run (:mod:`vramwidget.inference`) know every tensor of it: the stored weights
(``weight_storage``), the KV cache (``kv_layout``), the live tensors at each step of one
layer (``layer_steps``), what generate() keeps around the head (``logits_items``,
``generation_temporaries``) and the decode transients (``decode_transients``).  This module
lays those same sizes out in time (the estimate, :mod:`vramwidget.inference.estimate`, imports it and
reads its peaks), so ``allocator.replay_runs`` can say what the caching
allocator reserves (``max_memory_reserved``) instead of a rule of thumb:

load      every stored tensor in module order (a bitsandbytes format: the 16-bit checkpoint
          tensor first, quantized on the GPU, then dropped; ``events.ASYNC_LOAD_WORKERS``
          wait beside the one being converted, as in the training stream)
prefill   cuBLAS's workspaces at the first matmul; RoPE's cos/sin and any mask; per layer,
          each step of ``layer_steps(p, p)`` in order (norm, projections, attention, MLP /
          experts) with only that step's tensors live, the norm before each half of the
          layer, the residual add after it; the KV cache written between projections and
          attention (``DynamicLayer.update`` on an empty cache: ``torch.cat`` allocates the
          prompt's keys, then its values); the final norm and the last position's logits,
          their fp32 copy (``logits_items``)
decode    ``context_len - prompt_len`` steps (then generate() returns: the last scores and
          the cache are dropped).  Per layer, the steps of ``layer_steps(1, S)``;
          the cache grows by ``torch.cat``: transformers' ``cache_utils.py``
          ``DynamicLayer.update`` does ``self.keys = torch.cat([self.keys, key_states], dim=-2)``
          then the same for values, so each layer allocates its keys at S + 1 tokens, drops
          the S-token ones, then its values (``DynamicSlidingWindowLayer.update``: the cat result
          of min(S, W - 1) + 1 tokens, of which the last W - 1 stay as a view).  Then the new
          logits, their fp32 copy, and the previous step's fp32 scores are dropped (the loop's
          ``next_token_scores``), then the logits (``del outputs``): ``generation/utils.py``
          ``_sample``.

The decode steps are :class:`~vramwidget.allocator.caching.StepRun` s: one step's events with each
size affine in the step (the cache grows by one token per step), split where a sliding
window fills.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..allocator.caching import (DEFAULT_RESERVED_PER_ALLOCATED, K_SMALL_SIZE, ReplayResult, StepRun, expand_runs, parse_alloc_conf,
                        replay_runs_on_card,
                        replay_runs)
from ..model.architecture import Architecture
from ..estimate import CUBLAS_WORKSPACE_BYTES
from ..plan.context import CUBLAS_WORKSPACES
from ..plan.load import ASYNC_LOAD_WORKERS
from ..allocator.replays import single_flight
from . import generate_ops as ops
from .kv import kv_layout
from .setup import InferenceSetup
from .steps import attention_kernel, decode_transients, dequant_transients, layer_steps
from .versions import transformers_version
from .weights import weight_storage
from ..units import DTYPE_BYTES

Event = Tuple[str, Any, float, Any]
_BASE = ("residual stream", "normed layer input")


def _step_order(arch: Architecture, steps: Dict[str, List[Tuple[str, float, str]]], layer: int
                ) -> Tuple[List[Tuple[str, float, str]], List[Tuple[str, float, str]], List[List[Tuple[str, float, str]]]]:
    """(norm, projections, [the MLP-side steps]) of one layer, each without the shared tensors."""
    def own(items: List[Tuple[str, float, str]]) -> List[Tuple[str, float, str]]:
        return [x for x in items if x[0] not in _BASE]

    norm = own(steps.get("norm", []))
    proj = own(next((v for k, v in steps.items() if k.startswith("q/k/v")), []))
    mlp: List[List[Tuple[str, float, str]]] = []
    if "mlp" in steps:
        mlp.append(own(steps["mlp"]))
    elif "experts" in steps:
        if "mlp (dense layers)" in steps and layer < arch.dense_layers:
            mlp.append(own(steps["mlp (dense layers)"]))
        else:
            mlp.append(own(steps["experts"]))
            if "shared experts" in steps:
                mlp.append(own(steps["shared experts"]))
    return norm, proj, mlp


def _coarse_layer(arch: Architecture, s: InferenceSetup, sh: ops.Shape, lay: Any, extra: List[Tuple[str, float, str]],
                  transient: List[Tuple[str, float, str]]) -> Callable[..., Any]:
    """A decoder layer laid out by its steps (``layer_steps``: each step's tensors live
    together, then go), for the families :func:`generate_ops.op_level` does not write op by
    op (MoE experts, MLA, LayerNorm decoders, hybrids)."""
    c = DTYPE_BYTES[s.dtype]
    h = arch.hidden_size
    cache: Dict[Tuple[int, int], Dict[str, List[Tuple[str, float, str]]]] = {}

    def run_step(st: ops.Stream, items: List[Tuple[str, float, str]]) -> None:
        keys = [st.alloc(nb, ops.ACT, name) for name, nb, _f in transient + items]
        st.free(*keys)

    def layer(st: ops.Stream, io: ops.LayerIO, x: Any, cos_sin: Any) -> Any:
        T = sh.b * io.q
        key = (io.q, io.S)
        if key not in cache:
            cache[key] = layer_steps(arch, s, io.q, io.S)
        steps = cache[key]
        attention = [x2 for x2 in steps["attention"] if x2[0] not in _BASE] + (extra if io.decode else [])
        norm, proj, mlp = _step_order(arch, steps, io.layer)
        run_step(st, norm)
        normed = st.alloc(T * h * c, ops.ACT, "normed layer input")
        st.first_matmul()
        run_step(st, proj)
        if io.kind is not None:
            ops.cache_update(st, sh, io, None, None, (lay.k_elems, lay.v_elems))
        run_step(st, attention)
        st.free(normed)
        x1 = st.alloc(T * h * c, ops.ACT, "residual after attention")
        for part in mlp:
            run_step(st, norm)
            normed = st.alloc(T * h * c, ops.ACT, "normed layer input")
            run_step(st, part)
            st.free(normed)
        out = st.alloc(T * h * c, ops.ACT, "layer output")
        st.free(x1)
        return out

    return layer


def _shape(arch: Architecture, s: InferenceSetup, lay: Any, device: str) -> ops.Shape:
    be = attention_kernel(arch, s, s.padding)
    quant: Dict[str, int] = {}
    if s.fmt_kind in ("nf4", "fp4"):
        for x in weight_storage(arch, s):
            if x.consts and x.tensor.layers is not None:
                quant[x.tensor.role] = x.tensor.numel_each
    return ops.Shape(arch=arch, c=DTYPE_BYTES[s.dtype], b=s.batch_size, device=device, attn=be, padded=s.padding,
                     kv_bytes=lay.elem_bytes, window=lay.window if lay.sliding_layers else None,
                     op_level=ops.op_level(arch) and s.fmt_kind in ("dense", "nf4", "fp4"),
                     rope_matmul=transformers_version(s) < (5, 19), keeps_ones_mask=transformers_version(s) < (5, 18),
                     packs_gqa=transformers_version(s) >= (5, 23),
                     legacy_cache=transformers_version(s) < (4, 36), logits_all_fp32=transformers_version(s) < (4, 45),
                     quant=quant or None,
                     double_quant=s.double_quant)


def sampling(arch: Architecture, s: InferenceSetup) -> ops.Sampling:
    """The logits processors generate() runs for ``s``: with ``min_new_tokens`` and an EOS
    token, ``MinLengthLogitsProcessor`` and ``MinNewTokensLengthLogitsProcessor``
    (``_get_logits_processor``; ``_prepare_generated_length`` sets ``min_length`` from
    ``min_new_tokens``)."""
    eos = arch.config.get("eos_token_id") if isinstance(arch.config, dict) else None
    v = transformers_version(s)
    # before 4.45 the processors set the EOS column in place (MinLengthLogitsProcessor of 4.35.2)
    n = 2 if (s.min_new_tokens and eos is not None and v >= (4, 45)) else 0
    nxt = ("to_copy" if v >= (4, 46) else "clone_float" if v >= (4, 45) else "clone" if v >= (4, 42) else "view")
    return ops.Sampling(processors=n, final_softcap=bool(arch.final_logit_softcapping), next_logits=nxt)


def _forward(st: ops.Stream, arch: Architecture, s: InferenceSetup, sh: ops.Shape, lay: Any,
             kinds: List[Optional[bool]], q: int, S: int, decode: bool, stored: Any) -> Any:
    """The model's forward for b x q new tokens against S cached ones; returns the final norm's
    output key."""
    if sh.op_level:
        return ops.model_forward(st, sh, q, S, kinds, decode)
    deq = dequant_transients(stored, s, sh.b * q)
    extra: List[Tuple[str, float, str]] = []
    if decode:
        att = {x[0] for x in layer_steps(arch, s, 1, S)["attention"]}
        at_step = dataclasses.replace(s, context_len=S + 1)      # this step's cache, not the run's end
        extra = [x for x in decode_transients(arch, at_step, lay, stored)
                 if not x[0].startswith("torch.cat") and x[0] not in att]
    return ops.model_forward(st, sh, q, S, kinds, decode, layer_fn=_coarse_layer(arch, s, sh, lay, extra, deq))


def _renamed(events: List[Event]) -> List[Event]:
    """Resolve the stream's "rename" markers ``("rename", key, 0, new_name)``: the tensor
    allocated as ``key`` is called ``new_name`` in every event (the name a later part of the
    stream, a decode step, frees it by)."""
    to_new: Dict[Any, Any] = {}
    for kind, key, _n, label in events:
        if kind == "rename":
            orig = next((o for o, nn in to_new.items() if nn == key), key)
            to_new[orig] = label
    return [(kind, to_new.get(key, key), n, label) for kind, key, n, label in events if kind != "rename"]


def _load(st: ops.Stream, arch: Architecture, s: InferenceSetup) -> None:
    """The stored weights, tensor by tensor in module order (see the module docstring)."""
    stored = weight_storage(arch, s)
    c = DTYPE_BYTES[s.dtype]
    before: List[Any] = []
    after: List[Any] = []
    per_layer: List[List[Any]] = [[] for _ in range(arch.num_layers)]
    seen_layer = False
    for x in stored:
        t = x.tensor
        if t.layers is None:
            (after if seen_layer else before).append((x, 1))
            continue
        seen_layer = True
        first, last = t.layers
        n_layers = max(last - first + 1, 1)
        per = max(t.repeat // n_layers, 1) if t.repeat >= n_layers else 1
        for layer in range(first, min(first + t.repeat // per, arch.num_layers)):
            per_layer[layer].append((x, t.repeat // per))
    on_the_fly = s.weights in ("nf4", "fp4", "int8")
    pending: List[Tuple[Any, int, Optional[int]]] = []

    def convert(item: Tuple[Any, int, Optional[int]]) -> None:
        x, n, tmp = item
        for label, nb, _dt, _f in x.parts:
            st.alloc(nb / n, "weights", f"{x.tensor.name} {label}")
        for label, nb, _f in x.consts:
            st.alloc(nb / n, "quantization constants", f"{x.tensor.name} {label}")
        st.free(tmp)

    for x, n in before + [i for lst in per_layer for i in lst] + after:
        if on_the_fly and x.consts:
            # from_pretrained with a BitsAndBytesConfig: the 16-bit checkpoint tensor first
            pending.append((x, n, st.alloc(x.tensor.numel / n * c, "weights", f"{x.tensor.name} (checkpoint tensor)")))
            if len(pending) > ASYNC_LOAD_WORKERS:
                convert(pending.pop(0))
        else:
            convert((x, n, None))
    while pending:
        convert(pending.pop(0))
    if arch.tie_word_embeddings and s.fmt_kind == "dense":
        # from_config builds lm_head with its own weight, then ties it to the embedding
        st.temp(arch.vocab_size * arch.hidden_size * c, "weights", "lm_head weight before tie_weights")


#: bytes of one cuBLAS workspace: torch keeps one per (handle, stream), and a handle per
#: thread; generate() under no_grad runs every matmul on the calling thread, so one
#: (training's backward adds the autograd thread's: estimate.CUBLAS_WORKSPACE_BYTES is two)
CUBLAS_WORKSPACE_PER_HANDLE_BYTES = CUBLAS_WORKSPACE_BYTES // CUBLAS_WORKSPACES


def _prefill(arch: Architecture, s: InferenceSetup, sh: ops.Shape, lay: Any, kinds: List[Optional[bool]],
             stored: Any, load: bool = True, workspace: bool = True) -> List[Event]:
    st = ops.Stream()
    if load:
        _load(st, arch, s)
    b, p = s.batch_size, s.prompt_len
    if lay.state_bytes_per_seq:
        st.alloc(b * lay.state_bytes_per_seq, ops.KV, "fixed-size conv / linear-attention state")
    st.alloc(b * p * 8, ops.GEN, "input_ids (the prompt)", key="prompt")
    ops.prologue(st, b, p)
    if not (sh.padded or sh.keeps_ones_mask):
        st.free("mask0")       # generate() >= 5.18 drops an all-ones mask once the positions are made
    if workspace:
        st.workspace = CUBLAS_WORKSPACE_PER_HANDLE_BYTES     # made by the first matmul
    normed = _forward(st, arch, s, sh, lay, kinds, p, 0, False, stored)
    st.workspace = 0
    if s.logits == "all":
        # a plain forward: every position's logits (logits_to_keep=0), no sampling
        logits = ops.head(st, sh, normed, sampling(arch, s), positions=p)
        st.free("clone0")
        return _renamed(st.events)
    logits = ops.head(st, sh, normed, sampling(arch, s), q=p)
    st.free("clone0")
    ops.sample(st, sh, logits, p, sampling(arch, s), first=True)
    return _renamed(st.events)


def _decode_step(arch: Architecture, s: InferenceSetup, sh: ops.Shape, lay: Any, kinds: List[Optional[bool]], S: int,
                 stored: Any) -> List[Event]:
    """One decode step from S cached tokens (keys are the template's names).  With the legacy
    tuple cache (transformers < 4.36) ``prepare_inputs_for_generation`` first drops the tuple of
    two steps back (the previous ``model_inputs`` held it), and the previous step's outputs
    (their logits) go once this forward has returned."""
    st = ops.Stream()
    if sh.legacy_cache and S > s.prompt_len:
        st.free(*[(x, layer) for layer, kind in enumerate(kinds) if kind is not None for x in ("kold", "vold")])
    normed = _forward(st, arch, s, sh, lay, kinds, 1, S, True, stored)
    logits = ops.head(st, sh, normed, sampling(arch, s))
    if sampling(arch, s).next_logits == "view":
        st.free("lprev")
    ops.sample(st, sh, logits, S + 1, sampling(arch, s), first=False)
    ev = _renamed(st.events)
    # template keys: a step's own tensors are numbered in order, the same every step
    return [(k, ("t", key) if isinstance(key, int) else key, n, label) for k, key, n, label in ev]


def _renames(kinds: List[Optional[bool]], smp: ops.Sampling, masked: bool, legacy: bool = False
             ) -> Tuple[Tuple[Any, Any], ...]:
    out: List[Tuple[Any, Any]] = []
    for layer, kind in enumerate(kinds):
        if kind is not None:
            if legacy:      # this step's tuple becomes the one two steps back
                out += [(("k", layer), ("kold", layer)), (("v", layer), ("vold", layer))]
            out += [(("k", layer, "new"), ("k", layer)), (("v", layer, "new"), ("v", layer))]
    if smp.next_logits == "view":
        out.append(("lprev.new", "lprev"))
    else:
        out.append(("nl.new", "nl"))
    out.append(("ids.new", "ids"))
    if masked:
        out.append(("mask.new", "mask"))
    if smp.processors:
        out.append(("ns.new", "ns"))
    return tuple(out)


def _template(a: List[Event], b: List[Event]) -> Optional[Tuple[Tuple[str, Any, int, int, Any], ...]]:
    """The step template from the steps at S and S + 1: each size c0 + c1 x m; None when the
    two differ in anything but sizes."""
    if len(a) != len(b):
        return None
    out = []
    for x, y in zip(a, b):
        if x[0] != y[0] or x[1] != y[1]:
            return None
        out.append((x[0], x[1], int(x[2]), int(y[2]) - int(x[2]), x[3]))
    return tuple(out)


def _matches(tpl: Tuple[Tuple[str, Any, int, int, Any], ...], m: int, ev: List[Event]) -> bool:
    return len(tpl) == len(ev) and all(t[0] == e[0] and t[1] == e[1] and t[2] + t[3] * m == int(e[2])
                                       for t, e in zip(tpl, ev))


def _boundaries(s: InferenceSetup, sh: ops.Shape, kinds: List[Optional[bool]]) -> List[int]:
    """Decode steps (cached tokens S) where a step's events can change: a sliding layer's
    ``torch.cat`` stops growing and its mask comes into reach once S >= W - 1."""
    out = []
    if sh.window and any(kinds):
        out.append(sh.window - 1)
    return [x for x in out if s.prompt_len < x < s.context_len]


_STEPS: Dict[Tuple[Any, ...], Tuple[Any, List[Event]]] = {}


def _step_cached(arch: Architecture, s: InferenceSetup, sh: ops.Shape, lay: Any, kinds: List[Optional[bool]], S: int,
                 stored: Any) -> List[Event]:
    """:func:`_decode_step`, kept per setup (whatever its context) and S: a longest-context
    search asks for the same steps at every context it tries.  The key holds ``id(arch)``, so
    a hit counts only for that very architecture (the id of one garbage-collected is given to
    the next: without the check, a 2-layer model's decode got a 1-layer model's step)."""
    key = _key(arch, dataclasses.replace(s, context_len=s.prompt_len)) + (S, sh.device)
    hit = _STEPS.get(key)
    if hit is not None and hit[0]() is arch:
        return hit[1]
    step = _decode_step(arch, s, sh, lay, kinds, S, stored)
    with _LOCK:
        if len(_STEPS) >= 4096:
            _STEPS.clear()
        # a weak reference: the cache names the architecture without keeping it alive
        _STEPS[key] = (weakref.ref(arch), step)
    return step


def decode_runs(arch: Architecture, s: InferenceSetup, sh: ops.Shape, lay: Any, kinds: List[Optional[bool]],
                stored: Any) -> List[StepRun]:
    """The decode steps from ``prompt_len`` to ``context_len`` cached tokens as StepRuns: sizes
    affine in the step (each run's template read off its first two steps and checked against
    its last), a new run where the events change (:func:`_boundaries`; any other change is
    found by bisection)."""
    renames = _renames(kinds, sampling(arch, s), sh.padded or sh.keeps_ones_mask, sh.legacy_cache)
    step = lambda n: _step_cached(arch, s, sh, lay, kinds, n, stored)  # noqa: E731
    out: List[StepRun] = []
    cuts = [s.prompt_len] + _boundaries(s, sh, kinds) + [s.context_len]
    for S, end in zip(cuts, cuts[1:]):
        while S < end:
            a = step(S)
            tpl = _template(a, step(S + 1)) if end - S > 1 else None
            if tpl is None:             # the last step, or the next one differs in its events
                tpl = _template(a, a)
                assert tpl is not None
                out.append(StepRun(tpl, 1, renames))
                S += 1
                continue
            lo, hi = 1, end - S - 1      # step lo matches the template
            if _matches(tpl, hi, step(S + hi)):
                lo = hi
            # past the first step that leaves the template none returns to it: bisection
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if _matches(tpl, mid, step(S + mid)):
                    lo = mid
                else:
                    hi = mid
            lo += 1                      # steps in the run
            out.append(StepRun(tpl, lo, renames))
            S += lo
    return out


def inference_runs(arch: Architecture, s: InferenceSetup, device: str = "cuda") -> List[Any]:
    """The run as ``allocator.replay_runs`` takes it: the load + prefill events, then the
    decode steps as :class:`~vramwidget.allocator.caching.StepRun` s (sizes affine in the step; a new
    run where a sliding window fills).  ``device="cpu"``: the CPU's kernels (the trace test)."""
    lay = kv_layout(arch, s.kv_cache_dtype, s.mla_cache, s.use_sliding_window)
    kinds = ops.layer_kinds(arch, lay.sliding_layers, lay.full_layers + lay.sliding_layers)
    sh = _shape(arch, s, lay, device)
    stored = weight_storage(arch, s)
    parts: List[Any] = [_prefill(arch, s, sh, lay, kinds, stored, workspace=device == "cuda")]
    if s.logits == "all":           # a plain forward: no sampling loop
        return parts + [[("free", k, 0, "") for k in (("mask0", "pos0") if (sh.padded or sh.keeps_ones_mask)
                                                       else ("pos0",))]]
    parts += decode_runs(arch, s, sh, lay, kinds, stored)
    # generate() returns the sequences: the loop's last scores and the cache go (with
    # return_dict_in_generate the cache is returned instead: the replay's peaks are the same)
    smp = sampling(arch, s)
    end = [("free", k, 0, "") for k in ("nl" if smp.next_logits != "view" else "lprev", "ns" if smp.processors else None,
                                        "mask" if (sh.padded or sh.keeps_ones_mask) else None,
                                        "mask0" if (sh.padded or sh.keeps_ones_mask) else None, "pos0") if k]
    end += [("free", (x, layer), 0, "") for layer, kind in enumerate(kinds) if kind is not None
            for x in (("k", "v", "kold", "vold") if (sh.legacy_cache and s.context_len > s.prompt_len + 1) else ("k", "v"))]
    parts.append(end)
    return parts


def protocol_runs(arch: Architecture, s: InferenceSetup, workspace_segment_bytes: Optional[int] = None) -> List[Any]:
    """generate() as ``vramwidget measure-inference`` (and the shared cases' script) measures
    it: the weights; the prompt; one full forward ``model(input_ids=ids, use_cache=True)``
    (every position's logits, the whole prompt's cache, no attention mask) deleted;
    ``gc.collect(); torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()``; then the
    generate() call of :func:`inference_runs`.  ``max_memory_reserved`` / ``_allocated`` of the
    replay are then the recorded ``max_reserved_mib`` / ``generate_peak_mib``.

    ``workspace_segment_bytes``: the process ran an earlier case, so the cuBLAS workspace
    exists already, in a cached segment of this size that the earlier case's first matmul
    carved it from (empty_cache cannot release a segment holding it); None: the first case,
    whose warm-up forward makes the workspace."""
    lay = kv_layout(arch, s.kv_cache_dtype, s.mla_cache, s.use_sliding_window)
    kinds = ops.layer_kinds(arch, lay.sliding_layers, lay.full_layers + lay.sliding_layers)
    sh = _shape(arch, s, lay, "cuda")
    stored = weight_storage(arch, s)
    b, p = s.batch_size, s.prompt_len
    pre: List[Event] = []
    if workspace_segment_bytes is not None:
        pre = [("alloc", "ws segment", int(workspace_segment_bytes), (ops.WORKSPACE, "earlier case's segment")),
               ("free", "ws segment", 0, ""),
               ("alloc", "workspace", CUBLAS_WORKSPACE_PER_HANDLE_BYTES, (ops.WORKSPACE, "cuBLAS workspace"))]
    st = ops.Stream()
    _load(st, arch, s)
    st.alloc(b * p * 8, ops.GEN, "input_ids (the prompt)", key="prompt")
    warm = ops.Stream()
    if workspace_segment_bytes is None:
        warm.workspace = CUBLAS_WORKSPACE_PER_HANDLE_BYTES
    # a plain forward: no attention mask, so no padding whatever the prompt holds
    sh_warm = ops.Shape(**{**sh.__dict__, "padded": False})
    normed = _forward(warm, arch, s, sh_warm, lay, kinds, p, 0, False, stored)
    n = b * p * arch.vocab_size * sh.c
    logits = warm.alloc(n, ops.LOGITS, "logits (every position)")
    if arch.final_logit_softcapping:
        for name in ("logits / softcap", "tanh(logits / softcap)", "logits (soft-capped)"):
            nxt = warm.alloc(n, ops.LOGITS, name)
            warm.free(logits)
            logits = nxt
    warm.free(normed, logits)
    warm.free(*[(x, layer) for layer, kind in enumerate(kinds) if kind is not None for x in ("k", "v")])
    warm_events = [(k, key if key == "workspace" else ("warm-up", key), nb, lb)
                   for k, key, nb, lb in _renamed(warm.events)]
    head = pre + _renamed(st.events) + warm_events + [("empty_cache", None, 0, ""), ("reset_peak", None, 0, "")]
    gen = _prefill(arch, s, sh, lay, kinds, stored, load=False, workspace=False)
    gen = [e for e in gen if not (e[0] == "alloc" and e[1] == "prompt")]
    return [head + gen] + decode_runs(arch, s, sh, lay, kinds, stored)


def replay_parts(parts: List[Any], cfg: Any = None) -> List[Any]:
    """The stream the allocator replay reads: :func:`inference_runs`' with each decode step's
    small constant temporaries left out (a tensor of at most 1 MiB, the same size every step,
    made and dropped inside the step: RMSNorm's rows, q/k/v and RoPE of one token, the MLP of one
    token).  They come from the small pool (``kSmallSize``: 2 MiB segments) in the free blocks
    the prefill left there and never reach the large pool, where the reserve of a long decode
    grows; the decode's growing and carried tensors (the cache, ``input_ids``, the scores) and
    everything above 1 MiB stay, and the prefill stays whole.  The allocated peak is read from
    the whole stream (:func:`phase_peaks`)."""
    from ..allocator.caching import AllocatorConfig, round_size

    cfg = cfg or AllocatorConfig()
    out: List[Any] = []
    for part in parts:
        if not isinstance(part, StepRun):
            out.append(part)
            continue
        carried = {a for a, _b in part.renames}
        alloc_at: Dict[Any, int] = {}
        drop = set()
        for j, (kind, key, c0, c1, _label) in enumerate(part.events):
            if kind == "alloc":
                alloc_at[key] = j
            elif key in alloc_at and key not in carried:
                a = part.events[alloc_at[key]]
                if a[3] == 0 and round_size(int(a[2]), cfg) <= K_SMALL_SIZE:
                    drop.add(key)
        events = tuple(e for e in part.events if e[1] not in drop)
        out.append(StepRun(events, part.n_steps, part.renames))
    return out


def inference_events(arch: Architecture, s: InferenceSetup, device: str = "cuda") -> List[Event]:
    """Every allocation and free of loading the model and one ``generate()`` call, in order
    (the decode steps written out: a million events at 8k new tokens; the replay takes
    :func:`inference_runs` instead)."""
    return expand_runs(inference_runs(arch, s, device))


# ----------------------------------------------------------------------------------
# The replay behind InferenceEstimate.reserved_bytes
# ----------------------------------------------------------------------------------

_REPLAYS: Dict[Tuple[Any, ...], Tuple[Architecture, ReplayResult]] = {}
_INFLIGHT: Dict[Tuple[Any, ...], threading.Event] = {}
_LOCK = threading.Lock()
_MAX_CACHED = 1024
#: decodes longer than this (new tokens) are replayed without a card at the largest card's
#: capacity (:func:`largest_card_bytes`): each step's ``torch.cat`` of every layer's keys and
#: values leaves the previous segment too small to reuse, so an allocator without a limit keeps
#: a new segment per layer and step (80 GiB for 32k tokens of Llama-3.1-8B, and at 10^6 tokens
#: more segments than the replay's memory holds), while a real allocator at its card's limit
#: frees its cached blocks and retries (``CachingAllocator.malloc``).  No card holds more than
#: the largest one, so the figure below that capacity is the unlimited one, and the replay's
#: own memory stays bounded (``replay_runs_on_card`` skips the steps that repeat exactly).
LONG_DECODE_STEPS = 32768


def largest_card_bytes() -> float:
    """The memory of the largest GPU of the catalog (``data/gpus.json``), in bytes."""
    from ..gpus import list_gpus

    return max(g.memory_bytes for g in list_gpus())


def _key(arch: Architecture, s: InferenceSetup) -> Tuple[Any, ...]:
    return (id(arch),) + tuple(tuple(sorted(v.items())) if isinstance(v, dict) else v
                               for v in (getattr(s, f) for f in s.FIELDS))


def cached_replay(arch: Architecture, s: InferenceSetup) -> Optional[ReplayResult]:
    """The cached replay of ``s``, or None.  Never runs one."""
    hit = _REPLAYS.get(_key(arch, s))
    return hit[1] if hit is not None and hit[0] is arch else None


def clear_caches() -> None:
    """Forget every cached replay (benchmarks time cold setups)."""
    with _LOCK:
        _REPLAYS.clear()
        _RATIOS.clear()
        _RUNS.clear()
        _STEPS.clear()


def replay_inference(arch: Architecture, s: InferenceSetup, capacity_bytes: Optional[float] = None,
                     record: bool = False) -> ReplayResult:
    """The caching allocator (with the setup's ``allocator`` settings) replayed over
    :func:`inference_runs`; cached per architecture and setup when no capacity and no
    recording is asked for (two threads asking for one setup run one replay)."""
    cfg = parse_alloc_conf(s.allocator)
    if record:
        return replay_runs(replay_parts(cached_runs(arch, s), cfg), cfg, capacity_bytes, record)
    if capacity_bytes is not None:
        return replay_runs_on_card(replay_parts(cached_runs(arch, s), cfg), cfg, capacity_bytes)
    key = _key(arch, s)

    def replay_and_store() -> ReplayResult:
        parts = replay_parts(cached_runs(arch, s), cfg)
        if s.context_len - s.prompt_len > LONG_DECODE_STEPS:
            res = replay_runs_on_card(parts, cfg, largest_card_bytes())
        else:
            res = replay_runs(parts, cfg)
        with _LOCK:
            if len(_REPLAYS) >= _MAX_CACHED:
                _REPLAYS.clear()
            _REPLAYS[key] = (arch, res)
        return res

    return single_flight(_LOCK, _INFLIGHT, key, lambda: cached_replay(arch, s), replay_and_store)


#: (id(arch), the setup but its sizes) -> (arch, reserved / allocated peak of the last such
#: setup replayed): the ratio a provisional reserve carries over
_RATIOS: Dict[Tuple[Any, ...], Tuple[Architecture, float]] = {}
_SIZES = ("batch_size", "context_len", "prompt_len")


def _shape_key(arch: Architecture, s: InferenceSetup) -> Tuple[Any, ...]:
    return tuple(v for f, v in zip(("id",) + s.FIELDS, _key(arch, s)) if f not in _SIZES)


def reserved_bytes(arch: Architecture, s: InferenceSetup, peak_bytes: float) -> float:
    """``max_memory_reserved()`` of the generate() call: the replay's maximum, never below the
    estimate's allocated peak (the analytic phases add one step's transients at their largest
    together, which the laid-out stream reaches only in part)."""
    out = max(float(replay_inference(arch, s).max_reserved_bytes), float(peak_bytes))
    if peak_bytes > 0:
        with _LOCK:
            if len(_RATIOS) >= _MAX_CACHED:
                _RATIOS.clear()
            _RATIOS[_shape_key(arch, s)] = (arch, out / float(peak_bytes))
    return out


def provisional_reserved_bytes(arch: Architecture, s: InferenceSetup, peak_bytes: float) -> Tuple[float, bool]:
    """Reserved memory without running a replay, ``(bytes, exact)``: the cached replay's when
    there is one; else the allocated peak x the reserved / allocated ratio of the last replayed
    setup that differs only in batch, context or prompt length; else the allocated peak x
    :data:`~vramwidget.allocator.caching.DEFAULT_RESERVED_PER_ALLOCATED` (the training cases' median),
    until the worker's replay replaces it."""
    if cached_replay(arch, s) is not None:
        return reserved_bytes(arch, s, peak_bytes), True
    hit = _RATIOS.get(_shape_key(arch, s))
    ratio = hit[1] if hit is not None and hit[0] is arch else DEFAULT_RESERVED_PER_ALLOCATED
    return float(peak_bytes) * ratio, False


def hooks(arch: Architecture, s: InferenceSetup, peak_bytes: float
          ) -> Tuple[Callable[[], float], Callable[..., ReplayResult], Callable[[], Tuple[float, bool]]]:
    """(reserved, replay, provisional) callables for an InferenceEstimate."""
    return (lambda: reserved_bytes(arch, s, peak_bytes),
            lambda capacity_bytes=None, record=False: replay_inference(arch, s, capacity_bytes, record),
            lambda: provisional_reserved_bytes(arch, s, peak_bytes))


def reserved_by_decode_steps(arch: Architecture, s: InferenceSetup) -> Callable[[int], float]:
    """``max_memory_reserved()`` of the same generate() call stopped after k decode steps, for
    every k up to ``s``'s: one replay (``replay_runs``' growth log), read at each prefix of the
    stream (the stream of context ``prompt_len + k`` is this stream's first events)."""
    import bisect

    parts = replay_parts(cached_runs(arch, s), parse_alloc_conf(s.allocator))
    log: List[Tuple[int, bool, int]] = []
    replay_runs(parts, parse_alloc_conf(s.allocator), growth_log=log)
    per_pool: Dict[bool, Tuple[List[int], List[int]]] = {True: ([], []), False: ([], [])}
    for g, pool, r in sorted(log):
        per_pool[pool][0].append(g)
        per_pool[pool][1].append(r)
    prefix = len(parts[0])                       # load + prefill (the last part is generate()'s return)
    runs = [(p.n_steps, len(p.events)) for p in parts if isinstance(p, StepRun)]

    def at(k: int) -> float:
        end, left = prefix, k
        for n, width in runs:
            take = min(n, left)
            end += take * width
            left -= take
        total = 0
        for idx, val in per_pool.values():
            i = bisect.bisect_left(idx, end) - 1     # the pool's last growth before the end
            total += val[i] if i >= 0 else 0
        return float(total)

    return at



# ----------------------------------------------------------------------------------
# The allocated peak of each phase, and what is live there (the estimate's tree)
# ----------------------------------------------------------------------------------

_LOAD = ("weights", "quantization constants")


def _rounded(nbytes: float) -> int:
    n = int(nbytes)
    return 512 if n < 512 else (n + 511) // 512 * 512


def _walk(live: Dict[Any, Tuple[int, Any]], events: Any, best: List[Any]) -> None:
    """Apply ``events`` ((kind, key, bytes, label)) to ``live`` (key -> (rounded bytes, label)),
    keeping in ``best`` = [peak bytes, live snapshot at it] the largest total."""
    total = sum(v[0] for v in live.values())
    for kind, key, nbytes, label in events:
        if kind == "alloc":
            n = _rounded(nbytes)
            live[key] = (n, label)
            total += n
            if total > best[0]:
                best[0] = total
                best[1] = dict(live)
        elif kind == "free":
            total -= live.pop(key)[0]


def phase_peaks(parts: List[Any]) -> Dict[str, Any]:
    """``{"after_load": bytes, "prefill": (bytes, live), "decode": (bytes, live)}`` of a run as
    :func:`inference_runs` lays it out, in the bytes the caching allocator counts (each request
    rounded up to 512 B); ``live`` maps each tensor live at the peak to (bytes, label).  A decode
    run's sizes are affine in the step, so its peak is at its first or its last step."""
    first = parts[0]
    load_keys = {e[1] for e in first if e[0] == "alloc" and e[3] and e[3][0] in _LOAD}
    last_load = max((i for i, e in enumerate(first) if e[1] in load_keys), default=-1)
    live: Dict[Any, Tuple[int, Any]] = {}
    load_best: List[Any] = [0, {}]
    _walk(live, first[:last_load + 1], load_best)
    after_load = sum(v[0] for v in live.values())
    pre: List[Any] = [after_load, dict(live)]
    _walk(live, first[last_load + 1:], pre)
    dec: List[Any] = [0, {}]
    for part in parts[1:]:
        if not isinstance(part, StepRun):
            continue
        ms = (0, part.n_steps - 1) if part.n_steps > 1 else (0,)
        for m in ms:
            state = dict(live)
            if m:
                # the carried tensors as the previous step left them
                for j, (kind, key, c0, c1, label) in enumerate(part.events):
                    if kind == "alloc":
                        for a, b in part.renames:
                            if a == key and b in state:
                                state[b] = (_rounded(c0 + c1 * (m - 1)), label)
            _walk(state, [(k, key, c0 + c1 * m, lb) for k, key, c0, c1, lb in part.events], dec)
            for a, b in part.renames:
                if a in state:
                    state[b] = state.pop(a)
        live = state
    out = {"after_load": after_load, "prefill": (pre[0], pre[1])}
    if any(isinstance(p, StepRun) for p in parts):
        out["decode"] = (dec[0], dec[1])
    return out


def peaks(arch: Architecture, s: InferenceSetup) -> Dict[str, Any]:
    """:func:`phase_peaks` of the setup's stream (the estimate's phases and tree)."""
    return phase_peaks(cached_runs(arch, s))


_RUNS: Dict[Tuple[Any, ...], Tuple[Architecture, List[Any]]] = {}


def cached_runs(arch: Architecture, s: InferenceSetup) -> List[Any]:
    """:func:`inference_runs`, kept per architecture and setup (the peak and the replay read it)."""
    key = _key(arch, s)
    hit = _RUNS.get(key)
    if hit is not None and hit[0] is arch:
        return hit[1]
    parts = inference_runs(arch, s)
    with _LOCK:
        if len(_RUNS) >= 64:
            _RUNS.clear()
        _RUNS[key] = (arch, parts)
    return parts



def measured_figures(arch: Architecture, s: InferenceSetup, workspace_segment_bytes: Optional[int] = None
                     ) -> Dict[str, float]:
    """What ``vramwidget measure-inference`` records for ``s`` (:func:`protocol_runs` replayed):
    ``weights_bytes`` (allocated once the model is built: the weights, and the cuBLAS workspace
    of an earlier case of the process), ``generate_peak_bytes`` and ``max_reserved_bytes``
    (``max_memory_allocated`` / ``_reserved`` after ``reset_peak_memory_stats``), and
    ``workspace_segment_bytes``: the cached segment the process's cuBLAS workspace sits in,
    which the next case starts with."""
    parts = protocol_runs(arch, s, workspace_segment_bytes)
    cfg = parse_alloc_conf(s.allocator)
    res = replay_runs(parts, cfg)
    weights = phase_peaks(cached_runs(arch, s))["after_load"]
    seg = workspace_segment_bytes
    if seg is None:
        # the first case: replay up to the workspace's allocation and read its segment
        from ..allocator.caching import CachingAllocator

        al = CachingAllocator(cfg)
        live: Dict[Any, Any] = {}
        for kind, key, nbytes, label in parts[0]:
            if kind == "alloc":
                live[key] = al.malloc(nbytes, label)
                if key == "workspace":
                    seg = live[key].seg.size
                    break
            elif kind == "free":
                al.free(live.pop(key))
    return {"weights_bytes": float(weights + (CUBLAS_WORKSPACE_PER_HANDLE_BYTES if workspace_segment_bytes else 0)),
            "generate_peak_bytes": float(res.max_allocated_bytes), "max_reserved_bytes": float(res.max_reserved_bytes),
            "workspace_segment_bytes": float(seg or CUBLAS_WORKSPACE_PER_HANDLE_BYTES)}


def likely_padding(batch_size: int, prompt_len: int, vocab_size: int) -> bool:
    """Whether a prompt of ``batch_size x prompt_len`` token ids drawn uniformly from the
    vocabulary (as the measured cases' script draws them) more likely than not holds
    ``pad_token_id`` somewhere, so that generate() infers an attention mask that masks it:
    1 - (1 - 1/V)^(b p) > 1/2."""
    return 1.0 - (1.0 - 1.0 / max(vocab_size, 1)) ** (batch_size * prompt_len) > 0.5


def steps_before_oom(arch: Architecture, s: InferenceSetup, capacity_bytes: float) -> Optional[int]:
    """The decode steps of ``s`` that run whole on a card where torch may reserve
    ``capacity_bytes`` (its replay at that capacity, ``replay_inference``); None when the whole
    call runs.  A call to a shorter context is the first steps of this one, so it fits exactly
    when it ends before the failing request.  -1: the prefill itself fails."""
    res = replay_inference(arch, s, capacity_bytes=capacity_bytes)
    if res.oom is None:
        return None
    parts = replay_parts(cached_runs(arch, s), parse_alloc_conf(s.allocator))
    g = len(parts[0])
    if res.oom.index < g:
        return -1
    done = 0
    for part in parts[1:]:
        if not isinstance(part, StepRun):
            break
        width = len(part.events)
        if res.oom.index < g + part.n_steps * width:
            return done + (res.oom.index - g) // width
        g += part.n_steps * width
        done += part.n_steps
    return done

