"""One ``generate()`` call as the caching allocator sees it: loading, prefill, decode.

The inference estimate (:mod:`vramwidget.inference`) knows every tensor of the run: the
stored weights (``weight_storage``), the KV cache (``kv_layout``), the live tensors at each
step of one layer (``layer_steps``), what generate() keeps around the head (``logits_items``,
``generation_temporaries``) and the decode transients (``decode_transients``).  This module
lays those same sizes out in time, so ``allocator.replay_runs`` can say what the caching
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

The decode steps are :class:`~vramwidget.allocator.StepRun` s: one step's events with each
size affine in the step (the cache grows by one token per step), split where a sliding
window fills.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

from .allocator import (DEFAULT_RESERVED_PER_ALLOCATED, ReplayResult, StepRun, expand_runs, parse_alloc_conf,
                        replay_runs)
from .architecture import Architecture
from .estimate import CUBLAS_WORKSPACE_BYTES
from .plan.context import CUBLAS_WORKSPACES
from .plan.load import ASYNC_LOAD_WORKERS
from .replays import single_flight
from .inference import (GENERATE_REPLAY, InferenceSetup, _dequant_transient, _persistent_prefill, decode_transients, kv_layout,
                        layer_steps, logits_items, weight_storage)
from .units import DTYPE_BYTES

Event = Tuple[str, Any, float, str]
_BASE = ("residual stream", "normed layer input")


class _Stream:
    """Events with keys handed out in order (keys of the decode template are names)."""

    def __init__(self) -> None:
        self.events: List[Event] = []
        self._n = 0

    def alloc(self, nbytes: float, label: Any, key: Any = None) -> Optional[Any]:
        if nbytes <= 0:
            return None
        if key is None:
            self._n += 1
            key = self._n
        self.events.append(("alloc", key, int(nbytes), label))
        return key

    def free(self, key: Optional[Any]) -> None:
        if key is not None:
            self.events.append(("free", key, 0, ""))


def _kv_layers(arch: Architecture, lay: Any) -> List[Optional[bool]]:
    """Per layer: None (no KV cache: a hybrid's conv / linear-attention layer), False (full
    attention) or True (sliding window); the cached layers spread evenly over the stack."""
    L = arch.num_layers
    n_kv = lay.full_layers + lay.sliding_layers
    out: List[Optional[bool]] = []
    i = 0
    for layer in range(L):
        if (layer * n_kv) // L == ((layer + 1) * n_kv) // L and n_kv < L:
            out.append(None)
            continue
        sl = lay.sliding_layers
        out.append((i * sl) // max(n_kv, 1) != ((i + 1) * sl) // max(n_kv, 1))
        i += 1
    return out


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


def _forward(st: _Stream, arch: Architecture, s: InferenceSetup, q: int, S: int, kinds: List[Optional[bool]],
             lay: Any, extra_attention: List[Tuple[str, float, str]], transient: List[Tuple[str, float, str]],
             decode: bool) -> None:
    """The model's forward for b x q new tokens against S cached ones (the caller made the
    residual stream ``"x"``); the cache keys are ("k", layer) / ("v", layer)."""
    c = DTYPE_BYTES[s.dtype]
    b = s.batch_size
    T = b * q
    h = arch.hidden_size
    steps = layer_steps(arch, s, q, S)
    attention = [x for x in steps["attention"] if x[0] not in _BASE] + extra_attention
    x = "x"

    def run_step(items: List[Tuple[str, float, str]], label: Tuple[Any, ...]) -> None:
        keys = [st.alloc(nb, label + (name,)) for name, nb, _f in transient + items]
        for k in keys:
            st.free(k)

    for layer in range(arch.num_layers):
        lab = ("layer", layer)
        norm, proj, mlp = _step_order(arch, steps, layer)
        # input norm, then the projections (and RoPE) on the normed input
        run_step(norm, lab)
        normed = st.alloc(T * h * c, lab + ("normed layer input",))
        run_step(proj, lab)
        kind = kinds[layer]
        if kind is not None:
            for name, elems in (("k", lay.k_elems), ("v", lay.v_elems)):
                if decode:
                    tokens = min(S, lay.window - 1) + 1 if (kind and lay.window) else S + 1
                    st.alloc(b * tokens * elems * lay.elem_bytes, lab + (f"{name} cache (torch.cat)",),
                             key=(name, layer, "new"))
                    st.free((name, layer))
                else:
                    st.alloc(b * S * elems * lay.elem_bytes, lab + (f"{name} cache",), key=(name, layer))
        run_step(attention, lab)
        st.free(normed)
        # residual add, post-attention norm, MLP, residual add
        x2 = st.alloc(T * h * c, lab + ("residual stream",), key=("x", layer, "attn"))
        st.free(x)
        x = x2
        for part in mlp:
            run_step(norm, lab)
            normed = st.alloc(T * h * c, lab + ("normed layer input",))
            run_step(part, lab)
            st.free(normed)
        x2 = st.alloc(T * h * c, lab + ("residual stream",), key=("x", layer, "out"))
        st.free(x)
        x = x2
    st.events.append(("rename", x, 0, "x"))


def _renamed(events: List[Event]) -> List[Event]:
    """Resolve the stream's "rename" markers (the last residual becomes ``"x"``)."""
    alias: Dict[Any, Any] = {}
    out: List[Event] = []
    for kind, key, n, label in events:
        if kind == "rename":
            alias[label] = alias.get(key, key)
            continue
        out.append((kind, alias.get(key, key), n, label))
    return out


def _load(st: _Stream, arch: Architecture, s: InferenceSetup) -> None:
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
            st.alloc(nb / n, (x.tensor.name, label))
        for label, nb, _f in x.consts:
            st.alloc(nb / n, (x.tensor.name, label))
        st.free(tmp)

    for x, n in before + [i for lst in per_layer for i in lst] + after:
        if on_the_fly and x.consts:
            # from_pretrained with a BitsAndBytesConfig: the 16-bit checkpoint tensor first
            pending.append((x, n, st.alloc(x.tensor.numel / n * c, (x.tensor.name, "(checkpoint tensor)"))))
            if len(pending) > ASYNC_LOAD_WORKERS:
                convert(pending.pop(0))
        else:
            convert((x, n, None))
    while pending:
        convert(pending.pop(0))


def _head(st: _Stream, arch: Architecture, s: InferenceSetup, q: int, first: bool) -> None:
    """The final norm, the logits generate() keeps (the last position's), their fp32 copy
    (kept as ``"scores"`` into the decode loop); the previous step's fp32 scores go once the
    new copy exists; then the outputs."""
    c = DTYPE_BYTES[s.dtype]
    b, h = s.batch_size, arch.hidden_size
    T = b * q
    norm = st.alloc(T * h * 8.0, "final norm fp32 upcast + product")
    st.free(norm)
    out = st.alloc(T * h * c, "final norm output") if (first and s.logits == "all") else None
    items = logits_items(arch, s, q, first=True)
    if first and s.logits == "all":      # every position's logits; the loop still copies the last one
        items += [x for x in logits_items(arch, s, 1, first=True) if x[0].startswith("next-token")]
    scores = "scores" if first else "scores.new"
    keys = []
    for name, nb, _f in items:
        keys.append(st.alloc(nb, name, key=scores if name.startswith("next-token") else None))
    st.free(out)
    if not first:
        st.free("scores")
    st.free("x")
    for k in keys:
        if k != scores:
            st.free(k)


def _prefill(arch: Architecture, s: InferenceSetup, lay: Any, kinds: List[Optional[bool]]) -> List[Event]:
    st = _Stream()
    _load(st, arch, s)
    b, p = s.batch_size, s.prompt_len
    c = DTYPE_BYTES[s.dtype]
    if lay.state_bytes_per_seq:
        st.alloc(b * lay.state_bytes_per_seq, "fixed-size conv / linear-attention state")
    st.alloc(b * p * 8, "input_ids")
    st.alloc(b * p * arch.hidden_size * c, "embedding output", key="x")
    for _ in range(CUBLAS_WORKSPACES):          # made by the first matmul
        st.alloc(CUBLAS_WORKSPACE_BYTES / CUBLAS_WORKSPACES, "cuBLAS workspace")
    pers = [st.alloc(nb, name) for name, nb, _f in _persistent_prefill(arch, s, p, p)]
    deq = _dequant_transient(weight_storage(arch, s), s, b * p)
    _forward(st, arch, s, p, p, kinds, lay, [], deq, decode=False)
    for k in pers:
        st.free(k)
    _head(st, arch, s, p, first=True)
    return _renamed(st.events)


def _decode_step(arch: Architecture, s: InferenceSetup, lay: Any, kinds: List[Optional[bool]], S: int,
                 stored: Any) -> List[Event]:
    """One decode step from S cached tokens (keys are the template's names)."""
    st = _Stream()
    b = s.batch_size
    c = DTYPE_BYTES[s.dtype]
    st.alloc(b * arch.hidden_size * c, "embedding output", key="x")
    pers = [st.alloc(nb, name) for name, nb, _f in _persistent_prefill(arch, s, 1, S + 1)]
    # what decode_transients adds beyond the cache's torch.cat and the attention step
    att = {x[0] for x in layer_steps(arch, s, 1, S)["attention"]}
    extra = [x for x in decode_transients(arch, s, lay, stored)
             if not x[0].startswith("torch.cat") and x[0] not in att]
    deq = _dequant_transient(stored, s, b)
    _forward(st, arch, s, 1, S, kinds, lay, extra, deq, decode=True)
    for k in pers:
        st.free(k)
    _head(st, arch, s, 1, first=False)
    ev = _renamed(st.events)
    # template keys: a step's own tensors are numbered in order, the same every step
    return [(k, ("t", key) if isinstance(key, int) else key, n, label) for k, key, n, label in ev]


def _renames(kinds: List[Optional[bool]]) -> Tuple[Tuple[Any, Any], ...]:
    out: List[Tuple[Any, Any]] = []
    for layer, kind in enumerate(kinds):
        if kind is not None:
            out += [(("k", layer, "new"), ("k", layer)), (("v", layer, "new"), ("v", layer))]
    out.append(("scores.new", "scores"))
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


def inference_runs(arch: Architecture, s: InferenceSetup) -> List[Any]:
    """The run as ``allocator.replay_runs`` takes it: the load + prefill events, then the
    decode steps as :class:`~vramwidget.allocator.StepRun` s (sizes affine in the step; a new
    run where a sliding window fills)."""
    lay = kv_layout(arch, s.kv_cache_dtype, s.mla_cache, s.use_sliding_window)
    kinds = _kv_layers(arch, lay)
    parts: List[Any] = [_prefill(arch, s, lay, kinds)]
    stored = weight_storage(arch, s)
    renames = _renames(kinds)
    S, end = s.prompt_len, s.context_len
    step = lambda n: _decode_step(arch, s, lay, kinds, n, stored)  # noqa: E731
    while S < end:
        a = step(S)
        if end - S == 1:
            tpl = _template(a, a)
            assert tpl is not None
            parts.append(StepRun(tpl, 1, renames))
            break
        tpl = _template(a, step(S + 1))
        if tpl is None:
            raise AssertionError("decode steps differ in their events")
        # the sizes are piecewise affine in S, with a break only where a sliding window fills
        # (min(S, W - 1) + 1 tokens): past the first step that leaves the template, none
        # returns to it, so the run's last step is found by bisection
        lo, hi = 1, end - S - 1      # step lo matches the template
        if _matches(tpl, hi, step(S + hi)):
            lo = hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if _matches(tpl, mid, step(S + mid)):
                lo = mid
            else:
                hi = mid
        lo += 1                      # steps in the run
        parts.append(StepRun(tpl, lo, renames))
        S += lo
    # generate() returns: the loop's last scores and the cache (not returned) are dropped
    end = [("free", "scores", 0, "")]
    for layer, kind in enumerate(kinds):
        if kind is not None:
            end += [("free", ("k", layer), 0, ""), ("free", ("v", layer), 0, "")]
    parts.append(end)
    return parts


def inference_events(arch: Architecture, s: InferenceSetup) -> List[Event]:
    """Every allocation and free of loading the model and one ``generate()`` call, in order
    (the decode steps written out: a million events at 8k new tokens; the replay takes
    :func:`inference_runs` instead)."""
    return expand_runs(inference_runs(arch, s))


# ----------------------------------------------------------------------------------
# The replay behind InferenceEstimate.reserved_bytes
# ----------------------------------------------------------------------------------

_REPLAYS: Dict[Tuple[Any, ...], Tuple[Architecture, ReplayResult]] = {}
_INFLIGHT: Dict[Tuple[Any, ...], threading.Event] = {}
_LOCK = threading.Lock()
_MAX_CACHED = 1024


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


def replay_inference(arch: Architecture, s: InferenceSetup, capacity_bytes: Optional[float] = None,
                     record: bool = False) -> ReplayResult:
    """The caching allocator (with the setup's ``allocator`` settings) replayed over
    :func:`inference_runs`; cached per architecture and setup when no capacity and no
    recording is asked for (two threads asking for one setup run one replay)."""
    cfg = parse_alloc_conf(s.allocator)
    if capacity_bytes is not None or record:
        return replay_runs(inference_runs(arch, s), cfg, capacity_bytes, record)
    key = _key(arch, s)

    def replay_and_store() -> ReplayResult:
        res = replay_runs(inference_runs(arch, s), cfg)
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
    :data:`~vramwidget.allocator.DEFAULT_RESERVED_PER_ALLOCATED` (the training cases' median),
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

    parts = inference_runs(arch, s)
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


GENERATE_REPLAY.update(hooks=hooks, reserved_by_decode_steps=reserved_by_decode_steps)
