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

#: id(plan) -> (plan, ReplayResult): the replays without a capacity run so far (the plan is
#: kept beside its id so a recycled id never matches)
_CACHE: Dict[int, Tuple[Any, Any]] = {}
_LOCK = threading.Lock()
_MAX = 256


def cached(plan: Any) -> Optional[Any]:
    """The replay of ``plan`` when it already ran, else None."""
    hit = _CACHE.get(id(plan))
    return hit[1] if hit is not None and hit[0] is plan else None


def replay_gpu_plan(plan: Any, cfg: AllocatorConfig, capacity_bytes: Optional[float] = None,
                    record: bool = False) -> Any:
    """``allocator.replay`` over one GPU's plan; without a capacity or recording, cached.  A
    replay with a capacity that never reaches it (no retry) is the unlimited replay, field
    for field (``ReplayResult.num_alloc_retries``): either one answers for the other, and
    such a replay is cached as the unlimited one."""
    if record:
        return replay(plan.events, cfg, capacity_bytes, record)
    hit = cached(plan)
    if capacity_bytes is not None:
        if hit is not None and within_limit(hit, capacity_bytes, cfg):
            return hit
        res = replay(plan.events, cfg, capacity_bytes)
        if hit is None and limit_unreached(res, cfg):
            _store(plan, res)
        return res
    if hit is not None:
        return hit
    res = replay(plan.events, cfg)
    _store(plan, res)
    return res


def _store(plan: Any, res: Any) -> None:
    with _LOCK:
        if len(_CACHE) >= _MAX:
            _CACHE.clear()
        _CACHE[id(plan)] = (plan, res)
