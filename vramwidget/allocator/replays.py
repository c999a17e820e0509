"""The allocator replays behind reserved memory: run when read, cached, shared across threads.

A setup's replay is ``allocator.replay`` over its step plan's events (``vramwidget.plan``:
the load and three training steps, the one description every figure reads).  It runs when
a reserve, a verdict or a snapshot is asked for, once per setup; a second thread asking for
the same setup waits for the first one's result.  Until it has run, the one guess of an
unreplayed setup's reserve is :func:`provisional_reserved_bytes`.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable, Dict, Optional, Tuple

from .collector import gc_paused
from .caching import (DEFAULT_RESERVED_PER_ALLOCATED, ReplayResult, limit_unreached, parse_alloc_conf, replay,
                      within_limit)
from ..model.architecture import Architecture
from ..training import TrainingSetup

#: (id(arch), setup) -> (arch, ReplayResult): the replays run so far (default settings, no
#: capacity, no recording).  The arch is kept beside its id so a recycled id never matches.
_REPLAYS: Dict[Tuple[Any, ...], Tuple[Architecture, ReplayResult]] = {}
#: (id(arch), the setup without batch_size and seq_len) -> (arch, {(batch, seq): ReplayResult}):
#: the same replays indexed by size, for :func:`provisional_reserved_bytes`
_BY_SHAPE: Dict[Tuple[Any, ...], Tuple[Architecture, Dict[Tuple[int, int], ReplayResult]]] = {}
#: replays being computed now (key -> Event)
_INFLIGHT: Dict[Tuple[Any, ...], threading.Event] = {}
_LOCK = threading.Lock()
_MAX_CACHED = 8192
_SIZE_FIELDS = ("batch_size", "seq_len")
_SHAPE_FIELDS = tuple(f.name for f in dataclasses.fields(TrainingSetup) if f.name not in _SIZE_FIELDS)


def clear_caches() -> None:
    """Forget every cached replay and plan (benchmarks time cold setups), the replays with a
    card's capacity (``gpus.judge_on``) included."""
    from .. import gpus, plan
    from ..parallel import zero

    with _LOCK:
        _REPLAYS.clear()
        _BY_SHAPE.clear()
        gpus.CAPACITY_REPLAYS.clear()
    plan.clear_caches()
    zero.clear_caches()


def _shape_key(arch: Architecture, s: TrainingSetup) -> Tuple[Any, ...]:
    return (id(arch),) + tuple(getattr(s, f) for f in _SHAPE_FIELDS)


def cached_replay(arch: Architecture, s: TrainingSetup) -> Optional[ReplayResult]:
    """The replay of ``s`` when one was already run and cached, else None.  Never runs one."""
    hit = _REPLAYS.get((id(arch), s))
    return hit[1] if hit is not None and hit[0] is arch else None


def _store(arch: Architecture, s: TrainingSetup, res: ReplayResult) -> None:
    with _LOCK:
        if len(_REPLAYS) >= _MAX_CACHED:
            _REPLAYS.clear()
            _BY_SHAPE.clear()
        _REPLAYS[(id(arch), s)] = (arch, res)
        sk = _shape_key(arch, s)
        hit = _BY_SHAPE.get(sk)
        if hit is None or hit[0] is not arch:
            hit = _BY_SHAPE[sk] = (arch, {})
        hit[1][(s.batch_size, s.seq_len)] = res


def reserved_per_allocated(res: ReplayResult) -> float:
    """A replay's fragmentation as a ratio: ``max_reserved_bytes / max_allocated_bytes`` (>= 1)."""
    return max(1.0, float(res.max_reserved_bytes) / float(res.max_allocated_bytes)) if res.max_allocated_bytes else 1.0


def carried_ratios(arch: Architecture, s: TrainingSetup, b: Any, sq: Any) -> Any:
    """For each (batch, seq) of two arrays, the reserved / allocated ratio that
    :func:`provisional_reserved_bytes` carries over: the cached replay of the same setup at
    the nearest size in |log b - log b'| + |log s - log s'| (the first of equals), else
    :data:`DEFAULT_RESERVED_PER_ALLOCATED` (a numpy array)."""
    import numpy as np

    hit = _BY_SHAPE.get(_shape_key(arch, s))
    if hit is None or hit[0] is not arch or not hit[1]:
        return np.full(np.shape(np.asarray(b)) or (1,), DEFAULT_RESERVED_PER_ALLOCATED, dtype=float).reshape(-1)
    items = list(hit[1].items())
    lb = np.log(np.asarray([k[0] for k, _ in items], dtype=float))
    ls = np.log(np.asarray([k[1] for k, _ in items], dtype=float))
    qb = np.log(np.asarray(b, dtype=float)).reshape(-1, 1)
    qs = np.log(np.asarray(sq, dtype=float)).reshape(-1, 1)
    idx = np.argmin(np.abs(qb - lb) + np.abs(qs - ls), axis=1)
    return np.asarray([reserved_per_allocated(r) for _, r in items], dtype=float)[idx]


def provisional_reserved_bytes(arch: Architecture, s: TrainingSetup, peak_bytes: float) -> Tuple[float, bool]:
    """Reserved memory without running a replay: ``(bytes, exact)``.

    * the replay of ``s`` is cached: ``(reserved_bytes(arch, s, peak), True)``, the exact value;
    * else a replay of the same setup at another batch / sequence length is cached: the
      nearest one's fragmentation carried over as a ratio,
      ``peak_bytes x max(1, max_reserved / max_allocated of that replay)``, False;
    * else ``peak_bytes x DEFAULT_RESERVED_PER_ALLOCATED`` (1.0812, the validation set's
      median ratio), False.

    The one place where an unreplayed setup's reserve is guessed (the widget's first frame,
    ``Estimate.provisional_device_total_bytes``, the cells of ``fit_map`` it does not replay,
    which call :func:`carried_ratios` for the whole grid at once).
    """
    if cached_replay(arch, s) is not None:
        return reserved_bytes(arch, s, peak_bytes), True
    ratio = float(carried_ratios(arch, s, [s.batch_size], [s.seq_len])[0])
    return float(peak_bytes) * ratio, False


def replay_training(arch: Architecture, s: TrainingSetup, capacity_bytes: Optional[float] = None,
                    record: bool = False) -> ReplayResult:
    """Replay the caching allocator (``allocator.replay``, with the setup's ``allocator``
    settings) over this setup's step plan: the load and three training steps; cached per
    architecture and setup when no capacity and no recording is asked for.

    Sizes whose events are equal (equal tokens where no size depends on b x s^2:
    ``PlanView.stream_key``) share one replay, with or without a capacity: the plan keeps
    them (``PlanIndex.stream_replays``, keyed by the size's monomials and the capacity), so
    they go when the plan does.  A capacity replay is not cached per setup (``gpus.judge_on``
    caches it per setup and capacity)."""
    from ..plan import plan_view

    view = plan_view(arch, s)
    sk = view.stream_key()

    def run() -> ReplayResult:
        with gc_paused():       # the replay's blocks are linked lists: no collection while it runs
            return view.replay(capacity_bytes, record)

    if record:
        return run()
    if capacity_bytes is not None:
        # a replay with a capacity that never reaches it (no retry) is the unlimited replay,
        # field for field (ReplayResult.num_alloc_retries; tests/test_fast_paths.py): either
        # one answers for the other
        cfg = parse_alloc_conf(s.allocator)
        unlimited = cached_replay(arch, s) or _shared_hit(view, sk, ("unlimited",))
        if unlimited is not None and within_limit(unlimited, capacity_bytes, cfg):
            return unlimited
        res = _shared(view, sk, ("capacity", float(capacity_bytes)), run)
        if limit_unreached(res, cfg) and cached_replay(arch, s) is None:
            _shared(view, sk, ("unlimited",), lambda: res)
            _store(arch, s, res)
        return res

    def replay_and_store() -> ReplayResult:
        res = _shared(view, sk, ("unlimited",), run)
        _store(arch, s, res)
        return res

    return single_flight(_LOCK, _INFLIGHT, (id(arch), s), lambda: cached_replay(arch, s), replay_and_store)


def _shared_hit(view: Any, sk: Optional[Tuple[Any, ...]], what: Tuple[Any, ...]) -> Optional[ReplayResult]:
    """What :func:`_shared` holds for ``what`` at these events, without running anything."""
    return None if sk is None else view.index.stream_replays.get(sk[1:] + what)


def _shared(view: Any, sk: Optional[Tuple[Any, ...]], what: Tuple[Any, ...],
            run: Callable[[], ReplayResult]) -> ReplayResult:
    """``run()``, shared by the sizes of one plan whose events are equal (``sk``, None: not
    shared) and kept on the plan itself."""
    if sk is None:
        return run()
    cache = view.index.stream_replays
    key = sk[1:] + what
    res = cache.get(key)
    if res is None:
        res = cache[key] = run()
    return res


def single_flight(lock: Any, inflight: Dict[Any, threading.Event], key: Any, lookup: Callable[[], Any],
                  compute: Callable[[], Any]) -> Any:
    """``lookup()`` if it has the result, else ``compute()`` (which stores it where ``lookup``
    finds it) run by one thread only: a thread asking for a ``key`` another thread is
    computing waits for it and takes the stored result."""
    while True:
        hit = lookup()
        if hit is not None:
            return hit
        with lock:
            hit = lookup()
            if hit is not None:
                return hit
            waiting = inflight.get(key)
            if waiting is None:
                done = inflight[key] = threading.Event()
                break
        waiting.wait()          # another thread computes this key: take its result
    try:
        return compute()
    finally:
        with lock:
            inflight.pop(key, None)
        done.set()


def reserved_bytes(arch: Architecture, s: TrainingSetup, peak: float) -> float:
    """``max_memory_reserved()`` of the setup whose allocated peak is ``peak``: its replay's."""
    return reserved_of(replay_training(arch, s), peak)


def reserved_of(r: ReplayResult, peak: float) -> float:
    """The reserve a replay ``r`` of a step implies (with or without a card's capacity): its
    own maximum, never below the allocated peak."""
    return max(float(r.max_reserved_bytes), float(peak))
