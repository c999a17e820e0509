"""The caching allocator over one GPU of a sharded run: the replay of that GPU's own plan.

A sharded run's GPU has its own step plan (:func:`vramwidget.plan.per_gpu.per_gpu_plan`: its
slice's tensors sharded, gathered or kept whole, and the strategy's own buffers).  The per-GPU
estimate reads its totals and trees from that plan, and its reserve and verdict from this
replay of the same plan's events, so the replay's ``max_allocated_bytes`` is the estimate's
``peak_allocated_bytes`` to the byte.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, Optional, Tuple

from ..allocator.caching import AllocatorConfig, limit_unreached, replay, within_limit

#: (id(plan), the size where the plan is symbolic) -> (plan, ReplayResult): the replays
#: without a capacity run so far (the plan is kept beside its id so a recycled id never matches)
_CACHE: Dict[Tuple[int, Any], Tuple[Any, Any]] = {}
_LOCK = threading.Lock()
_MAX = 256


def _key(plan: Any, index: Any, sizes: Any) -> Tuple[int, Any]:
    return (id(plan), tuple(sizes) if index is not None and index.symbolic and sizes is not None else None)


def cached(plan: Any, index: Any = None, sizes: Any = None) -> Optional[Any]:
    """The replay of ``plan`` (at ``sizes`` where its ``index`` is symbolic) when it already
    ran, else None."""
    hit = _CACHE.get(_key(plan, index, sizes))
    return hit[1] if hit is not None and hit[0] is plan else None


def _replay(plan: Any, cfg: AllocatorConfig, capacity_bytes: Optional[float], record: bool, index: Any,
            sizes: Any) -> Any:
    """``allocator.replay`` of the plan's events; a symbolic plan's at ``sizes``
    (``plan.replay_index``, as ``PlanView.replay``)."""
    if index is None or not index.symbolic:
        return replay(plan.events, cfg, capacity_bytes, record)
    from ..plan import replay_index

    return replay_index(index, cfg, sizes, capacity_bytes, record)


def replay_gpu_plan(plan: Any, cfg: AllocatorConfig, capacity_bytes: Optional[float] = None,
                    record: bool = False, index: Any = None, sizes: Any = None) -> Any:
    """``allocator.replay`` over one GPU's plan (``index``: its ``PlanIndex``; a symbolic
    plan is replayed at ``sizes``, (batch, sequence, target)); without a capacity or
    recording, cached.  A replay with a capacity that never reaches it (no retry) is the
    unlimited replay, field for field (``ReplayResult.num_alloc_retries``): either one
    answers for the other, and such a replay is cached as the unlimited one."""
    if record:
        return _replay(plan, cfg, capacity_bytes, record, index, sizes)
    key = _key(plan, index, sizes)
    hit = cached(plan, index, sizes)
    if capacity_bytes is not None:
        if hit is not None and within_limit(hit, capacity_bytes, cfg):
            return hit
        res = _replay(plan, cfg, capacity_bytes, False, index, sizes)
        if hit is None and limit_unreached(res, cfg):
            _store(key, plan, res)
        return res
    if hit is not None:
        return hit
    res = _replay(plan, cfg, None, False, index, sizes)
    _store(key, plan, res)
    return res


def _store(key: Tuple[int, Any], plan: Any, res: Any) -> None:
    with _LOCK:
        if len(_CACHE) >= _MAX:
            _CACHE.clear()
        _CACHE[key] = (plan, res)
