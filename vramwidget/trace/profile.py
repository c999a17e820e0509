"""Traces cached per model and setup, and an exact size profile in batch and sequence.

A step's sequence of allocations and frees does not depend on the batch size b and the
sequence length s (transformers' code takes the same path); only the sizes do.  Every
dimension of every allocated tensor is a constant, or one of b, s, b*s, s^2, b*s^2 times
an integer (heads, head dim, vocabulary...), plus a small offset (the loss pads labels to
s + 1), or s rounded up to a kernel's tile (flash attention's backward pads to 128).  Two
traces at (b, s) and (b + 1, 2 s) identify each dimension's rule (the integer factor and
offset must come out whole and unique), so any other (b, s) is evaluated exactly, then
rounded as the CUDA allocator rounds, and replayed: no new trace.  When a dimension fits no
rule, or the two traces differ in structure, the profile is not used and each size is
traced (still cached).

A batch of one takes other paths than larger batches (an expanded position-id tensor is
already contiguous at b = 1, so no copy is made), and a sequence of one token others again
(no causal mask), so profiles are kept apart: b = 1 (two traces at sequence lengths s and
2 s, exact in s) and b >= 2; one-token sequences are always traced.

The estimator in this module is pure Python; torch is imported only by ``step.py`` when a
trace runs.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Tuple

from ..errors import VramError
from ..result import Estimate
from ..training import TrainingSetup
from .events import Alloc, cuda_rounded

if TYPE_CHECKING:
    from .assemble import CudaAccounting

#: the setup fields a trace's structure depends on (sizes excluded)
_SIZE_FIELDS = ("batch_size", "seq_len")
_ROUNDINGS = (8, 16, 32, 64, 128, 256)
_MAX_OFFSET = 64


@dataclass
class _Trace:
    allocs: List[Alloc]
    marks: List[Tuple[str, int]]
    params_total: int
    params_trainable: int
    notes: List[str]
    b: int
    s: int


@dataclass
class Profile:
    """One traced structure and, for each allocation, how its bytes follow (b, s)."""

    base: _Trace
    size_fns: Optional[List[Callable[[int, int], int]]]   # None: not profiled, trace each size

    def sizes(self, b: int, s: int) -> List[int]:
        assert self.size_fns is not None
        return [cuda_rounded(f(b, s)) for f in self.size_fns]


_LOCK = threading.RLock()
_TRACES: Dict[str, _Trace] = {}
_PROFILES: Dict[str, Profile] = {}
_MAX = 64


def clear() -> None:
    """Forget every cached trace and profile."""
    with _LOCK:
        _TRACES.clear()
        _PROFILES.clear()


def _monomials(b: int, s: int, with_b: bool = True) -> Dict[str, int]:
    if not with_b:   # a profile at one batch size: b is a constant of it
        return {"s": s, "ss": s * s}
    return {"b": b, "s": s, "bs": b * s, "ss": s * s, "bss": b * s * s}


def size_class(b: int, s: int) -> Optional[str]:
    """Which profile a size belongs to (None: always traced)."""
    if s < 2:
        return None
    return "b1" if b == 1 else "b2+"


def _dim_rule(v1: int, v2: int, p1: Tuple[int, int], p2: Tuple[int, int]) -> Optional[Callable[[int, int], int]]:
    """The rule of one dimension seen as v1 at p1 = (b1, s1) and v2 at p2, or None."""
    if v1 == v2:
        return lambda b, s, v=v1: v
    with_b = p1[0] != p2[0]
    m1, m2 = _monomials(*p1, with_b=with_b), _monomials(*p2, with_b=with_b)
    found = []
    for k in m1:
        dm = m2[k] - m1[k]
        if dm == 0 or (v2 - v1) % dm:
            continue
        alpha = (v2 - v1) // dm
        beta = v1 - alpha * m1[k]
        if alpha >= 1 and abs(beta) <= _MAX_OFFSET:
            found.append((k, alpha, beta))
    if len(found) == 1:
        k, alpha, beta = found[0]
        return lambda b, s, k=k, a=alpha, c=beta, w=with_b: a * _monomials(b, s, w)[k] + c
    if not found:
        for r in _ROUNDINGS:   # a kernel's tile: s rounded up to r
            if v1 == -(-p1[1] // r) * r and v2 == -(-p2[1] // r) * r:
                return lambda b, s, r=r: -(-s // r) * r
    return None


def _size_rule(a1: Alloc, a2: Alloc, p1, p2) -> Optional[Callable[[int, int], int]]:
    if a1.dims is not None and a2.dims is not None and len(a1.dims) == len(a2.dims) and a1.elsize == a2.elsize:
        rules = [_dim_rule(x, y, p1, p2) for x, y in zip(a1.dims, a2.dims)]
        if all(r is not None for r in rules):
            es = a1.elsize

            def f(b, s, rules=rules, es=es):
                n = es
                for r in rules:
                    n *= r(b, s)
                return n
            return f
    return _dim_rule(a1.nbytes, a2.nbytes, p1, p2)


def _fit(t1: _Trace, t2: _Trace) -> Optional[List[Callable[[int, int], int]]]:
    if len(t1.allocs) != len(t2.allocs) or t1.marks != t2.marks:
        return None
    fns = []
    p1, p2 = (t1.b, t1.s), (t2.b, t2.s)
    for a1, a2 in zip(t1.allocs, t2.allocs):
        if (a1.op, a1.t_alloc, a1.t_free, a1.kind) != (a2.op, a2.t_alloc, a2.t_free, a2.kind):
            return None
        f = _size_rule(a1, a2, p1, p2)
        if f is None:
            return None
        fns.append(f)
    return fns


def _key(config: Mapping[str, Any], s: TrainingSetup, task: str, sized: bool) -> str:
    d = s.to_dict()
    if not sized:
        for f in _SIZE_FIELDS:
            d.pop(f, None)
        d["size_class"] = size_class(s.batch_size, s.seq_len)
    return json.dumps([config, d, task], sort_keys=True, default=str)


def _trace(config: Mapping[str, Any], s: TrainingSetup, task: str) -> _Trace:
    key = _key(config, s, task, True)
    with _LOCK:
        hit = _TRACES.get(key)
    if hit is not None:
        return hit
    from .step import explain_failure, trace_step

    try:
        log = trace_step(config, s, task=task)
    except VramError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure inside the model's code becomes one line
        raise VramError(explain_failure(exc, config), field="model") from None
    tr = _Trace(log.allocs, log.marks, log.params_total, log.params_trainable, log.notes, s.batch_size, s.seq_len)
    tr.stem = _key(config, s, task, False)  # type: ignore[attr-defined]
    with _LOCK:
        if len(_TRACES) >= _MAX:
            _TRACES.pop(next(iter(_TRACES)))
        _TRACES[key] = tr
    return tr


def profile_for(config: Mapping[str, Any], s: TrainingSetup, task: str = "causal_lm",
                other: Optional[Tuple[int, int]] = None) -> Profile:
    """The size profile of this model and setup: two traces (cached), then any size is a replay.

    The second trace is at ``other`` = (b, s) (default (b + 1, 2 s)); its sequence length
    must differ from the first and its batch size too, so that every dimension's rule is
    unique."""
    key = _key(config, s, task, False)
    with _LOCK:
        hit = _PROFILES.get(key)
    if hit is not None:
        return hit
    one = s.batch_size == 1
    b2, s2 = other or ((1 if one else s.batch_size + 1), 2 * s.seq_len)
    if (b2 == s.batch_size) != one or s2 == s.seq_len:
        b2, s2 = (1 if one else s.batch_size + 1), 2 * s.seq_len
    t1 = _trace(config, s, task)
    t2 = _trace(config, s.replace(batch_size=b2, seq_len=s2), task)
    prof = Profile(t1, _fit(t1, t2))
    with _LOCK:
        if len(_PROFILES) >= _MAX:
            _PROFILES.pop(next(iter(_PROFILES)))
        _PROFILES[key] = prof
    return prof


def cached_profile(config: Mapping[str, Any], s: TrainingSetup, task: str = "causal_lm") -> Optional[Profile]:
    """The profile if one is already built (never traces)."""
    with _LOCK:
        return _PROFILES.get(_key(config, s, task, False))


def _traced_sizes(config: Mapping[str, Any], s: TrainingSetup, task: str) -> List[Tuple[int, int]]:
    """The (b, s) sizes already traced for this model and setup."""
    stem = _key(config, s, task, False)
    out = []
    with _LOCK:
        for t in _TRACES.values():
            if getattr(t, "stem", None) == stem:
                out.append((t.b, t.s))
    return out


def estimate(name: str, config: Mapping[str, Any], s: TrainingSetup, cuda: "CudaAccounting",
             task: str = "causal_lm") -> Estimate:
    """The traced Estimate.

    The first size of a model and setup is traced as asked (one trace); from the second
    size on, the profile is built from the earlier trace and this one, and every later size
    is a replay (instant)."""
    from .assemble import estimate_from_log

    prof = cached_profile(config, s, task)
    if prof is None and size_class(s.batch_size, s.seq_len) is not None:
        here = (s.batch_size, s.seq_len)
        earlier = [x for x in _traced_sizes(config, s, task) if x != here]
        if earlier:   # a second size: one more trace makes the profile
            apart = [x for x in earlier if (x[0] != here[0] or here[0] == 1) and x[1] != here[1]]
            b0, s0 = (apart or earlier)[0]
            prof = profile_for(config, s.replace(batch_size=b0, seq_len=s0), task, other=here if apart else None)
    if prof is not None and prof.size_fns is not None:
        tr = prof.base
        sizes = prof.sizes(s.batch_size, s.seq_len)
        notes = list(tr.notes) + ["traced (backend='trace'): sizes from the exact (b, s) profile of two traces"]
    else:
        tr = _trace(config, s, task)
        sizes = [cuda_rounded(a.nbytes) for a in tr.allocs]
        notes = list(tr.notes) + ["traced (backend='trace') at this batch and sequence"]
    return estimate_from_log(name, s, tr.allocs, tr.marks, sizes, tr.params_total, tr.params_trainable,
                             s.notes + notes, cuda)
