"""A model of PyTorch's CUDA caching allocator, replayed over a stream of allocations and frees.

What a run reserves on the device is decided by how the caching allocator places tensors
in the segments it gets from ``cudaMalloc``, not by how many bytes are allocated at once.
This module replays that placement in pure Python.  The rules are those of
``c10/cuda/CUDACachingAllocator.cpp`` (PyTorch 2.x, ``DeviceCachingAllocator``):

* ``round_size``: every request is rounded up to a multiple of 512 B (``kMinBlockSize``);
  with ``roundup_power2_divisions`` a request is rounded up to the next of N divisions
  between two powers of two.
* ``get_pool``: requests of at most 1 MiB (``kSmallSize``) come from the small pool, the
  rest from the large pool.
* ``get_allocation_size``: a new segment is 2 MiB (``kSmallBuffer``) for the small pool,
  20 MiB (``kLargeBuffer``) for requests under 10 MiB (``kMinLargeAlloc``), else the
  request rounded up to 2 MiB (``kRoundLarge``).
* ``get_free_block``: best fit, the smallest cached block of the pool that is large enough
  (ties by address); with ``max_split_size_mb`` a request below it never takes an oversize
  block and a request above it takes one only within 20 MiB of its size.
* ``should_split``: a small-pool block is split when at least 512 B remain; a large-pool
  block when the request is below ``max_split_size`` and more than 1 MiB remains
  (expandable segments: when at least 512 B remain).
* ``free_block`` / ``try_merge_blocks``: a freed block merges with free neighbours of its
  segment.
* ``malloc``: on a miss, ``garbage_collect_cached_blocks`` (if
  ``garbage_collection_threshold`` is set and reserved memory is above it) frees whole cached
  segments, oldest first; then ``alloc_block`` asks for a new segment; if the device is full,
  ``release_available_cached_blocks`` (oversize blocks, only with ``max_split_size_mb``) and
  then ``release_cached_blocks`` (every whole cached segment) are freed and the request is
  retried once: the free-and-retry before an out-of-memory error.
* ``expandable_segments:True``: one segment per pool that grows by mapping pages (2 MiB
  for the small pool, 20 MiB for the large pool) at its end (``try_allocate_expandable_block``);
  on a miss it first unmaps free pages (``release_cached_blocks`` -> ``unmap_block``).

With the default settings the replay also runs compiled (``creplay.c``, built where a C
compiler or a wheel is there; :func:`compiled_replay`), the same rules event for event; this
module's Python replays are the reference it is tested against, and what runs without it.

A single CUDA stream is modelled (a training step's work runs on the default stream), so
no cross-stream events or ``recordStream`` delays.  ``PYTORCH_CUDA_ALLOC_CONF`` strings are
parsed as ``c10/cuda/CUDAAllocatorConfig.cpp`` (``parseArgs``) reads them.
"""

from __future__ import annotations

import bisect
import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from ..errors import VramError
from ..units import MIB

try:  # the compiled replay (setup.py builds it where it can; optional)
    from . import creplay
except ImportError:  # pragma: no cover - a build without a C compiler
    creplay = None

K_MIN_BLOCK_SIZE = 512                 # kMinBlockSize
K_SMALL_SIZE = 1 * MIB                 # kSmallSize: largest small-pool request
K_SMALL_BUFFER = 2 * MIB               # kSmallBuffer: small-pool segment
K_MIN_LARGE_ALLOC = 10 * MIB           # kMinLargeAlloc
K_LARGE_BUFFER = 20 * MIB              # kLargeBuffer: segment for 1-10 MiB requests
K_ROUND_LARGE = 2 * MIB                # kRoundLarge
NO_LIMIT = 2**63                       # max_split_size default (SIZE_MAX)

#: max_memory_reserved / max_memory_allocated of a training step when no replay of the setup
#: is cached at any size: the median of the 45 measured cases of the validation set
#: (data/h200_training_a.jsonl, ``measured.max_reserved_mib / measured.peak_allocated_mib``;
#: range 1.010 to 1.403, p90 1.287; tests/test_provisional.py recomputes it)
DEFAULT_RESERVED_PER_ALLOCATED = 1.0812

#: the setup field's named values; anything else is read as a PYTORCH_CUDA_ALLOC_CONF string
ALLOCATOR_CHOICES = ("default", "expandable_segments")


@dataclass(frozen=True)
class AllocatorConfig:
    """The caching allocator's settings (``PYTORCH_CUDA_ALLOC_CONF``)."""

    max_split_size_bytes: int = NO_LIMIT
    #: divisions per power-of-two interval: a default for every size, and (interval start
    #: in bytes, divisions) overrides as ``roundup_power2_divisions:[256:1,512:2,>:8]`` gives
    roundup_power2_divisions: int = 0
    roundup_power2_intervals: Tuple[Tuple[int, int], ...] = ()
    garbage_collection_threshold: float = 0.0
    expandable_segments: bool = False
    text: str = "default"

    def divisions(self, size: int) -> int:
        """``CUDAAllocatorConfig::roundup_power2_divisions(size)``: the divisions of the
        power-of-two interval that holds ``size`` (the list form indexes intervals from 1 MiB)."""
        if not self.roundup_power2_intervals:
            return self.roundup_power2_divisions
        out = self.roundup_power2_divisions
        for start, div in self.roundup_power2_intervals:
            if size >= start:
                out = div
        return out


def parse_alloc_conf(text: str, field_name: str = "allocator") -> AllocatorConfig:
    """``"default"``, ``"expandable_segments"`` or a ``PYTORCH_CUDA_ALLOC_CONF`` string such as
    ``"max_split_size_mb:128,garbage_collection_threshold:0.8"``.

    Options (``CUDAAllocatorConfig::parseArgs``): ``max_split_size_mb`` (> 20),
    ``roundup_power2_divisions`` (a power of two, or ``[256:1,512:2,>:8]`` keyed by MiB),
    ``garbage_collection_threshold`` (strictly between 0 and 1), ``expandable_segments``
    (True/False), and the options that do not change placement (``backend:native``,
    ``release_lock_on_cudamalloc``, ``pinned_*``).  Anything else raises VramError naming the field.
    """
    raw = str(text if text is not None else "default").strip()
    if raw in ("", "default", "native"):
        return AllocatorConfig(text="default")
    if raw == "expandable_segments":
        return AllocatorConfig(expandable_segments=True, text=raw)
    kw: Dict[str, object] = {"text": raw}

    def bad(msg: str) -> VramError:
        return VramError(f"{field_name}: {msg} in {raw!r} (use 'default', 'expandable_segments' or a "
                         f"PYTORCH_CUDA_ALLOC_CONF string such as 'max_split_size_mb:128')", field=field_name)

    # split on commas outside [...]
    parts, depth, cur = [], 0, ""
    for ch in raw:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    for part in parts:
        part = part.strip()
        if not part:
            continue
        if ":" not in part:
            raise bad(f"option {part!r} has no value (key:value)")
        key, val = (x.strip() for x in part.split(":", 1))
        if key == "max_split_size_mb":
            try:
                mb = int(val)
            except ValueError:
                raise bad(f"max_split_size_mb must be an integer, got {val!r}") from None
            if mb <= K_LARGE_BUFFER // MIB:
                raise bad(f"max_split_size_mb must be > {K_LARGE_BUFFER // MIB}, got {mb}")
            kw["max_split_size_bytes"] = mb * MIB
        elif key == "garbage_collection_threshold":
            try:
                th = float(val)
            except ValueError:
                raise bad(f"garbage_collection_threshold must be a number, got {val!r}") from None
            if not 0.0 < th < 1.0:
                raise bad(f"garbage_collection_threshold must be between 0 and 1 (exclusive), got {val}")
            kw["garbage_collection_threshold"] = th
        elif key == "expandable_segments":
            if val not in ("True", "False", "true", "false"):
                raise bad(f"expandable_segments must be True or False, got {val!r}")
            kw["expandable_segments"] = val in ("True", "true")
        elif key == "roundup_power2_divisions":
            if val.startswith("["):
                if not val.endswith("]"):
                    raise bad("roundup_power2_divisions list is not closed with ']'")
                intervals = []
                default = 0
                for item in val[1:-1].split(","):
                    if ":" not in item:
                        raise bad(f"roundup_power2_divisions entry {item!r} is not size:divisions")
                    k, v = (x.strip() for x in item.split(":", 1))
                    d = _pow2_divisions(v, bad)
                    if k == ">":
                        default = d
                        intervals.append((-1, d))
                    else:
                        try:
                            mb = int(k)
                        except ValueError:
                            raise bad(f"roundup_power2_divisions size {k!r} is not an integer (MiB)") from None
                        if mb & (mb - 1):
                            raise bad(f"roundup_power2_divisions size {mb} must be a power of two (MiB)")
                        intervals.append((mb * MIB, d))
                # '>' sets every interval above the last listed one
                listed = sorted((s, d) for s, d in intervals if s >= 0)
                if default and listed:
                    listed.append((listed[-1][0] * 2, default))
                kw["roundup_power2_intervals"] = tuple(listed)
                kw["roundup_power2_divisions"] = listed[0][1] if listed else default
            else:
                kw["roundup_power2_divisions"] = _pow2_divisions(val, bad)
        elif key in ("backend",):
            if val not in ("native",):
                raise bad(f"backend {val!r} is not modelled (only the native caching allocator)")
        elif key in ("release_lock_on_cudamalloc", "pinned_use_cuda_host_register", "pinned_num_register_threads",
                     "pinned_use_background_threads", "per_process_memory_fraction"):
            continue
        else:
            raise bad(f"unknown option {key!r}")
    return AllocatorConfig(**kw)  # type: ignore[arg-type]


def _pow2_divisions(val: str, bad) -> int:
    try:
        d = int(val)
    except ValueError:
        raise bad(f"roundup_power2_divisions must be an integer, got {val!r}") from None
    if d < 0 or (d & (d - 1)):
        raise bad(f"roundup_power2_divisions must be a power of two, got {d}")
    return d


def round_size(size: int, cfg: AllocatorConfig) -> int:
    """``DeviceCachingAllocator::round_size``."""
    if size < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    div = cfg.divisions(size)
    if div > 1 and size > K_MIN_BLOCK_SIZE * div:
        return _roundup_power2_next_division(size, div)
    return -(-size // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE


def _roundup_power2_next_division(size: int, divisions: int) -> int:
    """``roundup_power2_next_division``: the next of ``divisions`` equal steps between the
    power of two below ``size`` and the one above."""
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = max(floor // divisions, 1)
    return floor + -(-(size - floor) // step) * step


def allocation_size(size: int) -> int:
    """``get_allocation_size``: the segment cudaMalloc'd for a request that missed the cache."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE


def _label(label: Any) -> str:
    """Event labels are strings or (prefix, name) pairs, joined only when shown."""
    if isinstance(label, tuple):
        return " ".join(str(x) for x in label if x != "")
    return str(label)


class OutOfMemory(Exception):
    """The replayed request that no segment and no new cudaMalloc could satisfy."""

    def __init__(self, index: int, size: int, label: str, reserved: int, allocated: int, capacity: int):
        super().__init__(label)
        self.index, self.size, self.label = index, size, label
        self.reserved, self.allocated, self.capacity = reserved, allocated, capacity

    def __str__(self) -> str:
        return (f"allocation {self.index} ({self.label}): {self.size / MIB:.1f} MiB requested with "
                f"{self.reserved / MIB:.1f} MiB reserved, {self.allocated / MIB:.1f} MiB allocated, "
                f"capacity {self.capacity / MIB:.1f} MiB")


class _Block:
    __slots__ = ("addr", "size", "seg", "prev", "next", "allocated", "small", "requested", "gc_age")

    def __init__(self, addr: int, size: int, seg: "_Segment", small: bool):
        self.addr, self.size, self.seg, self.small = addr, size, seg, small
        self.prev: Optional[_Block] = None
        self.next: Optional[_Block] = None
        self.allocated = False
        self.requested = 0
        self.gc_age = 0


class _Segment:
    __slots__ = ("addr", "size", "small", "expandable", "mapped")

    def __init__(self, addr: int, size: int, small: bool, expandable: bool = False):
        self.addr, self.size, self.small, self.expandable = addr, size, small, expandable
        self.mapped = size


@dataclass
class ReplayResult:
    """What a replay found: the peaks, the out-of-memory point, and the trace for snapshots."""

    max_reserved_bytes: int = 0
    #: the largest sum of live requests, each rounded up by ``round_size``: what the tensors
    #: occupy in blocks that fit them (the step plan's peak_allocated_bytes counts the same)
    max_allocated_bytes: int = 0
    #: torch's ``max_memory_allocated()``: the same with the whole of a cached block that a
    #: request took without splitting it (``should_split``: under 1 MiB left in a large block)
    max_block_allocated_bytes: int = 0
    reserved_bytes: int = 0
    allocated_bytes: int = 0
    #: reserved - allocated when reserved peaked: cached free blocks and rounding
    fragmentation_at_max_bytes: int = 0
    segments_allocated: int = 0
    #: torch's ``num_alloc_retries``: the times a new segment did not fit the capacity and the
    #: cached blocks were released to retry it (0 without a capacity).  A capacity replay with
    #: none did what the unlimited replay does, event for event (its reserve never reached
    #: the limit): every other field is the unlimited replay's
    num_alloc_retries: int = 0
    oom: Optional[OutOfMemory] = None
    num_events: int = 0
    #: (action, addr, size, label) in order, when recorded
    trace: List[Tuple[str, int, int, str]] = field(default_factory=list)
    #: the live segments at the end: (addr, size, small, [(addr, size, requested, allocated, label)])
    segments: List[Tuple[int, int, bool, List[Tuple[int, int, int, bool, str]]]] = field(default_factory=list)


def collects_by_age(config: Optional["AllocatorConfig"]) -> bool:
    """Whether ``garbage_collection_threshold`` is set: with a capacity it frees cached blocks
    below the limit, so a replay with one can part from the unlimited replay without a retry."""
    return config is not None and config.garbage_collection_threshold > 0


def limit_unreached(res: "ReplayResult", config: Optional["AllocatorConfig"]) -> bool:
    """Whether a replay with a capacity did what the same replay without one does, event for
    event, so that every field but ``num_alloc_retries`` (0 both) is the unlimited replay's:
    no retry at the limit (then no out-of-memory error either) and no garbage collection by
    age (:func:`collects_by_age`)."""
    return res.num_alloc_retries == 0 and res.oom is None and not collects_by_age(config)


def within_limit(unlimited: "ReplayResult", capacity_bytes: float, config: Optional["AllocatorConfig"]) -> bool:
    """Whether the replay without a capacity, ``unlimited``, is also the replay with
    ``capacity_bytes``: its reserve never passed the limit (so no retry), and no garbage
    collection by age runs (see :func:`limit_unreached`)."""
    return unlimited.max_reserved_bytes <= int(capacity_bytes) and not collects_by_age(config)


def _record_stats(res: "ReplayResult", al: "CachingAllocator") -> "ReplayResult":
    """Write the allocator's statistics at the end of a replay into ``res`` (and return it)."""
    res.max_reserved_bytes = al.max_reserved
    res.max_allocated_bytes = al.max_requested
    res.max_block_allocated_bytes = al.max_allocated
    res.reserved_bytes = al.reserved
    res.allocated_bytes = al.allocated
    res.fragmentation_at_max_bytes = al.frag_at_max
    res.segments_allocated = al.segments_allocated
    res.num_alloc_retries = al.num_alloc_retries
    return res


class _SegmentBook:
    """The segment bookkeeping of :class:`CachingAllocator`: the free lists per pool (sorted
    by size and address), new and expandable segments, releasing cached blocks and
    segments, and the garbage collection of ``garbage_collection_threshold``.  The state it
    keeps is set in :meth:`CachingAllocator.__init__`; the public ``malloc``/``free`` are there.
    """

    # -- free lists ---------------------------------------------------------------------
    def _insert_free(self, b: _Block) -> None:
        key = (b.size, b.addr)
        bisect.insort(self._free[b.small], key)
        self._by_key[key] = b
        b.gc_age = 0

    def _remove_free(self, b: _Block) -> None:
        key = (b.size, b.addr)
        lst = self._free[b.small]
        i = bisect.bisect_left(lst, key)
        del lst[i]
        del self._by_key[key]

    # -- the allocator ----------------------------------------------------------------------
    def _get_free_block(self, small: bool, size: int) -> Optional[_Block]:
        """``get_free_block``: best fit with the oversize-block rules."""
        lst = self._free[small]
        if self.cfg.garbage_collection_threshold > 0:
            for key in lst:
                self._by_key[key].gc_age += 1
        i = bisect.bisect_left(lst, (size, -1))
        if i == len(lst):
            return None
        b = self._by_key[lst[i]]
        ms = self.cfg.max_split_size_bytes
        if self.cfg.expandable_segments:
            pass
        elif size < ms and b.size >= ms:
            return None
        elif size >= ms and b.size >= size + K_LARGE_BUFFER:
            return None
        self._remove_free(b)
        return b


    def _new_segment(self, small: bool, size: int) -> Optional[_Block]:
        """``alloc_block``: cudaMalloc a segment (fails past the capacity)."""
        if self.capacity is not None and self.reserved + size > self.capacity:
            return None
        seg = _Segment(self._next_addr, size, small)
        self._next_addr += size + (1 << 21)
        self._segments[seg.addr] = seg
        self.reserved += size
        self.segments_allocated += 1
        if self.record:
            self.trace.append(("segment_alloc", seg.addr, size, ""))
        return _Block(seg.addr, size, seg, small)

    def _expand(self, small: bool, size: int) -> Optional[_Block]:
        """``try_allocate_expandable_block``: map pages at the end of the pool's one segment
        (the free block at its end grows; a request larger than it maps the difference)."""
        page = K_SMALL_BUFFER if small else K_LARGE_BUFFER
        seg = self._expandable[small]
        if seg is None:
            seg = _Segment(self._next_addr, 0, small, expandable=True)
            seg.mapped = 0
            self._next_addr += 1 << 44
            self._segments[seg.addr] = seg
            self._expandable[small] = seg
            tail = None
        else:
            tail = self._tail_free(seg)
        have = tail.size if tail is not None else 0
        need = -(-(size - have) // page) * page
        if self.capacity is not None and self.reserved + need > self.capacity:
            return None
        if self.record:
            self.trace.append(("segment_map", seg.addr + seg.mapped, need, ""))
        self.reserved += need
        self.segments_allocated += 1
        if tail is not None:
            self._remove_free(tail)
            tail.size += need
            seg.size += need
            seg.mapped += need
            return tail
        b = _Block(seg.addr + seg.mapped, need, seg, small)
        last = self._last_block(seg)
        if last is not None:
            last.next = b
            b.prev = last
        seg.size += need
        seg.mapped += need
        return b

    def _tail_free(self, seg: _Segment) -> Optional[_Block]:
        last = self._last_block(seg)
        return last if last is not None and not last.allocated else None

    def _last_block(self, seg: _Segment) -> Optional[_Block]:
        # the block whose end is the mapped end of the segment
        end = seg.addr + seg.mapped
        for b in self._live.values():
            if b.seg is seg and b.addr + b.size == end:
                return b
        for b in self._by_key.values():
            if b.seg is seg and b.addr + b.size == end:
                return b
        return None

    def _release_cached(self) -> None:
        """``release_cached_blocks``: cudaFree every cached block that is a whole segment
        (expandable segments: unmap the free pages at the segment's end)."""
        for small in (False, True):
            for key in list(self._free[small]):
                b = self._by_key[key]
                if b.seg.expandable:
                    if b.next is None:
                        self._unmap_tail(b)
                elif b.prev is None and b.next is None:
                    self._release_block(b)

    def _release_block(self, b: _Block) -> None:
        self._remove_free(b)
        del self._segments[b.seg.addr]
        self.reserved -= b.size
        if self.record:
            self.trace.append(("segment_free", b.addr, b.size, ""))

    def _unmap_tail(self, b: _Block) -> None:
        page = K_SMALL_BUFFER if b.small else K_LARGE_BUFFER
        seg = b.seg
        keep = b.addr - seg.addr
        keep_pages = -(-keep // page) * page
        cut = seg.addr + keep_pages
        unmap = (b.addr + b.size) - cut
        if unmap <= 0:
            return
        self._remove_free(b)
        if self.record:
            self.trace.append(("segment_unmap", cut, unmap, ""))
        self.reserved -= unmap
        seg.mapped -= unmap
        seg.size -= unmap
        b.size -= unmap
        if b.size > 0:
            self._insert_free(b)
        else:
            if b.prev is not None:
                b.prev.next = None

    def _release_oversize(self, size: int) -> bool:
        """``release_available_cached_blocks``: with max_split_size set, free the smallest
        whole oversize block that covers the request, else the largest ones until covered."""
        ms = self.cfg.max_split_size_bytes
        if ms >= NO_LIMIT:
            return False
        lst = self._free[False]
        key = max(size, ms)
        i = bisect.bisect_left(lst, (key, -1))
        if i < len(lst):
            b = self._by_key[lst[i]]
            if b.prev is None and b.next is None and not b.seg.expandable:
                self._release_block(b)
                return True
            return False
        released = 0
        for k in reversed(list(lst)):
            b = self._by_key[k]
            if released >= key or b.size < ms:
                break
            if b.prev is None and b.next is None and not b.seg.expandable:
                released += b.size
                self._release_block(b)
        return released >= key

    def _garbage_collect(self) -> None:
        """``garbage_collect_cached_blocks``: above ``threshold x capacity`` reserved, free
        whole cached large blocks whose age (best-fit searches since they were cached) is at
        least the average, until the excess is reclaimed."""
        if self.capacity is None:
            return
        threshold = self.cfg.garbage_collection_threshold * self.capacity
        if self.reserved <= threshold:
            return
        target = self.reserved - threshold
        reclaimed = 0
        while reclaimed < target:
            cands = [self._by_key[k] for k in self._free[False]]
            cands = [b for b in cands if b.prev is None and b.next is None and not b.seg.expandable]
            if not cands:
                return
            avg = sum(b.gc_age for b in cands) / len(cands)
            freed = False
            for b in cands:
                if b.gc_age >= avg:
                    reclaimed += b.size
                    self._release_block(b)
                    freed = True
            if not freed:
                return


class CachingAllocator(_SegmentBook):
    """A single-stream replay of ``DeviceCachingAllocator`` (see the module docstring).

    ``malloc(size)`` returns a block handle, ``free(handle)`` returns it to the cache;
    ``reserved`` / ``allocated`` are ``memory_reserved()`` / ``memory_allocated()`` (allocated
    counts the rounded block sizes, as torch's ``allocated_bytes`` does);
    ``capacity`` (bytes the allocator may reserve) makes the free-and-retry path and the
    out-of-memory error happen.
    """

    def __init__(self, config: Optional[AllocatorConfig] = None, capacity_bytes: Optional[float] = None,
                 record: bool = False):
        self.cfg = config or AllocatorConfig()
        self.capacity = int(capacity_bytes) if capacity_bytes is not None else None
        self.reserved = 0
        self.allocated = 0
        #: live requests, each rounded (``round_size``), and their largest sum
        self.requested = 0
        self.max_requested = 0
        self.max_reserved = 0
        self.max_allocated = 0
        self.frag_at_max = 0
        self.segments_allocated = 0
        self.num_alloc_retries = 0
        self._next_addr = 1 << 40
        # free blocks per pool, sorted by (size, addr)
        self._free: Dict[bool, List[Tuple[int, int]]] = {True: [], False: []}
        self._by_key: Dict[Tuple[int, int], _Block] = {}
        self._segments: Dict[int, _Segment] = {}
        self._expandable: Dict[bool, Optional[_Segment]] = {True: None, False: None}
        self.record = record
        self._simple = (self.cfg.max_split_size_bytes >= NO_LIMIT and not self.cfg.expandable_segments
                        and self.cfg.garbage_collection_threshold <= 0)
        self.trace: List[Tuple[str, int, int, str]] = []
        self.labels: Dict[int, str] = {}
        self._live: Dict[int, _Block] = {}

    def malloc(self, size: int, label: Any = "") -> _Block:
        """``DeviceCachingAllocator::malloc`` for one request of ``size`` bytes."""
        cfg = self.cfg
        if cfg.roundup_power2_divisions or cfg.roundup_power2_intervals or size < K_MIN_BLOCK_SIZE:
            size = round_size(int(size), cfg)
        else:
            size = (int(size) + 511) & ~511
        small = size <= K_SMALL_SIZE
        if self._simple:
            # get_free_block without the oversize and expandable rules (the default settings)
            lst = self._free[small]
            i = bisect.bisect_left(lst, (size, -1))
            if i < len(lst):
                key = lst.pop(i)
                b = self._by_key.pop(key)
            else:
                b = None
        else:
            b = self._get_free_block(small, size)
        if b is None:
            if cfg.garbage_collection_threshold > 0:
                self._garbage_collect()
            b = self._alloc_new(small, size)
            if b is None:
                # free-and-retry: oversize blocks first, then every whole cached segment
                self.num_alloc_retries += 1
                if not self._release_oversize(size) or (b := self._alloc_new(small, size)) is None:
                    self._release_cached()
                    b = self._alloc_new(small, size)
                if b is None:
                    raise OutOfMemory(-1, size, _label(label), self.reserved, self.allocated, self.capacity or 0)
        remaining = b.size - size
        if (remaining >= K_MIN_BLOCK_SIZE if (small or cfg.expandable_segments)
                else (remaining > K_SMALL_SIZE and size < cfg.max_split_size_bytes)):
            rest = _Block(b.addr + size, remaining, b.seg, small)
            rest.prev, rest.next = b, b.next
            if b.next is not None:
                b.next.prev = rest
            b.next = rest
            b.size = size
            key = (remaining, rest.addr)
            bisect.insort(self._free[small], key)
            self._by_key[key] = rest
        b.allocated = True
        b.requested = size
        self.allocated += b.size
        self.requested += size
        if self.requested > self.max_requested:
            self.max_requested = self.requested
        self._live[b.addr] = b
        if self.record:
            label = _label(label)
            self.trace.append(("alloc", b.addr, b.size, label))
            self.labels[b.addr] = label
        if self.allocated > self.max_allocated:
            self.max_allocated = self.allocated
        if self.reserved > self.max_reserved:
            self.max_reserved = self.reserved
            self.frag_at_max = self.reserved - self.allocated
        return b

    def cached_bytes(self) -> int:
        """Bytes of cached free blocks: reserved = allocated + cached (the fragmentation)."""
        return sum(k[0] for pool in self._free.values() for k in pool)

    def signature(self) -> Tuple[Any, ...]:
        """The allocator's state: every block's address, size and use (equal states replay
        equal event streams identically)."""
        return (tuple(sorted((b.addr, b.size) for b in self._live.values())),
                tuple(self._free[False]), tuple(self._free[True]), self.reserved)

    def _alloc_new(self, small: bool, size: int) -> Optional[_Block]:
        if self.cfg.expandable_segments:
            return self._expand(small, size)
        return self._new_segment(small, allocation_size(size))

    def free(self, b: _Block) -> None:
        """``free_block``: back to the pool, merged with free neighbours (``try_merge_blocks``)."""
        if not b.allocated:
            raise ValueError("double free in the replay")
        b.allocated = False
        self.allocated -= b.size
        self.requested -= b.requested
        del self._live[b.addr]
        if self.record:
            self.trace.append(("free_requested", b.addr, b.size, self.labels.get(b.addr, "")))
            self.trace.append(("free_completed", b.addr, b.size, self.labels.pop(b.addr, "")))
        lst = self._free[b.small]
        by_key = self._by_key
        nb = b.prev
        if nb is not None and not nb.allocated:
            key = (nb.size, nb.addr)
            del lst[bisect.bisect_left(lst, key)]
            del by_key[key]
            b.addr = nb.addr
            b.prev = nb.prev
            if nb.prev is not None:
                nb.prev.next = b
            b.size += nb.size
        nb = b.next
        if nb is not None and not nb.allocated:
            key = (nb.size, nb.addr)
            del lst[bisect.bisect_left(lst, key)]
            del by_key[key]
            b.next = nb.next
            if nb.next is not None:
                nb.next.prev = b
            b.size += nb.size
        key = (b.size, b.addr)
        bisect.insort(lst, key)
        by_key[key] = b
        b.gc_age = 0

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: release every whole cached segment."""
        self._release_cached()

    def reset_peak(self) -> None:
        """``torch.cuda.reset_peak_memory_stats()``: the peaks restart from the current values."""
        self.max_reserved = self.reserved
        self.max_allocated = self.allocated
        self.max_requested = self.requested
        self.frag_at_max = self.reserved - self.allocated

    def segments(self) -> List[Tuple[int, int, bool, List[Tuple[int, int, int, bool, str]]]]:
        """The live segments and their blocks (address order), as torch's snapshot lists them."""
        blocks: Dict[int, List[_Block]] = {}
        for b in list(self._live.values()) + list(self._by_key.values()):
            blocks.setdefault(b.seg.addr, []).append(b)
        out = []
        for addr in sorted(self._segments):
            seg = self._segments[addr]
            if seg.mapped <= 0:
                continue
            bl = sorted(blocks.get(addr, []), key=lambda x: x.addr)
            out.append((addr, seg.mapped, seg.small,
                        [(x.addr, x.size, x.requested, x.allocated, self.labels.get(x.addr, "")) for x in bl]))
        return out


# ----------------------------------------------------------------------------------
# Replaying an event stream
# ----------------------------------------------------------------------------------

#: one event: ("alloc", key, bytes, label) | ("free", key, 0, "") | ("reset_peak", ...) | ("empty_cache", ...)
Event = Tuple[str, object, float, str]


#: whether the default-settings replays run compiled (``creplay``, when it was built); the
#: environment variable VRAMWIDGET_PURE_PYTHON=1 turns it off, tests switch it per test
COMPILED = creplay is not None and os.environ.get("VRAMWIDGET_PURE_PYTHON", "") in ("", "0")


def _is_default(cfg: AllocatorConfig) -> bool:
    """The settings the compiled replay and the fast loop model: no ``max_split_size_mb``, no
    expandable segments, no power-of-two rounding, no garbage collection by age."""
    return (cfg.max_split_size_bytes >= NO_LIMIT and not cfg.expandable_segments and not cfg.roundup_power2_divisions
            and not cfg.roundup_power2_intervals and cfg.garbage_collection_threshold <= 0)


def compiled_replay(parts: Sequence[Any], config: Optional[AllocatorConfig] = None,
                    capacity_bytes: Optional[float] = None,
                    growth_log: Optional[List[Tuple[int, bool, int]]] = None) -> Optional[ReplayResult]:
    """``replay(expand_runs(parts), config, capacity_bytes)`` run by the compiled replay
    (``creplay.c``: the same rules as :class:`CachingAllocator` with the default settings, a
    :class:`StepRun`'s steps replayed from its template without writing them out), field for
    field; None where it does not run (not built, ``COMPILED`` off, settings other than the
    default) or a size is beyond its 64-bit arithmetic: the caller replays in Python.
    ``growth_log``: as :func:`replay_runs` fills it, in stream order."""
    if not COMPILED or not _is_default(config or AllocatorConfig()):
        return None
    packed = [(p.events, p.n_steps, p.renames) if isinstance(p, StepRun) else
              (p if isinstance(p, list) else list(p)) for p in parts]
    limit = -1 if capacity_bytes is None else int(capacity_bytes)
    try:
        out = creplay.replay(packed, limit, True, growth_log)
    except OverflowError:
        return None
    return _compiled_result(out, limit, lambda oom: oom[4])


def _compiled_result(out: Tuple[Any, ...], limit: int, label_of: Any) -> ReplayResult:
    """The compiled replay's tuple as a :class:`ReplayResult` (``label_of(oom)``: the label of
    the request that failed)."""
    (max_reserved, max_requested, max_allocated, reserved, allocated, frag, segs, n, retries, oom) = out
    res = ReplayResult(max_reserved_bytes=max_reserved, max_allocated_bytes=max_requested,
                       max_block_allocated_bytes=max_allocated, reserved_bytes=reserved, allocated_bytes=allocated,
                       fragmentation_at_max_bytes=frag, segments_allocated=segs, num_alloc_retries=retries,
                       num_events=n)
    if oom is not None:
        index, size, oom_reserved, oom_allocated, _ = oom
        res.oom = OutOfMemory(index, size, _label(label_of(oom)), oom_reserved, oom_allocated, limit)
    return res


def compiled_program(program: Any, config: Optional[AllocatorConfig] = None,
                     capacity_bytes: Optional[float] = None) -> Optional[ReplayResult]:
    """``replay(events, config, capacity_bytes)`` of a stream given as columns (``program``:
    codes, slots, sizes, labels from ``plan.views.program_at``) by the compiled replay, field
    for field; None where it does not run (not built, ``COMPILED`` off, settings other than
    the default, no program)."""
    if not COMPILED or program is None or not _is_default(config or AllocatorConfig()):
        return None
    codes, slots, sizes, labels = program
    limit = -1 if capacity_bytes is None else int(capacity_bytes)
    return _compiled_result(creplay.replay_program(codes, slots, sizes, limit, True), limit,
                            lambda oom: labels[oom[0]])


def replay(events: Iterable[Event], config: Optional[AllocatorConfig] = None,
           capacity_bytes: Optional[float] = None, record: bool = False, fast: bool = True) -> ReplayResult:
    """Replay ``events`` through the allocator model.

    ``alloc`` events name a key (freed later by a ``free`` event with the same key) and a
    size in bytes.  With ``capacity_bytes`` (what torch may reserve on the device) the first
    request that fails even after the free-and-retry is reported in ``oom`` and the replay
    stops there.  With the default settings and no recording the fast loop runs
    (``_replay_default``, the free-and-retry included); ``fast=False`` runs
    ``CachingAllocator`` itself, the reference it is tested against
    (tests/test_fast_paths.py).
    """
    cfg = config or AllocatorConfig()
    if fast and not record and COMPILED:
        events = events if isinstance(events, list) else list(events)
        res = compiled_replay([events], cfg, capacity_bytes)
        if res is not None:
            return res
    if (fast and not record and cfg.max_split_size_bytes >= NO_LIMIT and not cfg.expandable_segments
            and not cfg.roundup_power2_divisions and not cfg.roundup_power2_intervals):
        if capacity_bytes is None:
            return _replay_default(events)
        if cfg.garbage_collection_threshold <= 0:
            events = events if isinstance(events, list) else list(events)
            res = _replay_default(events, limit=int(capacity_bytes))
            if res is not None:
                return res
    al = CachingAllocator(config, capacity_bytes, record)
    live: Dict[object, _Block] = {}
    res = ReplayResult()
    n = 0
    malloc, free = al.malloc, al.free
    last_sig: Optional[Tuple[Any, ...]] = None
    last_retries = 0
    for n, (kind, key, nbytes, label) in enumerate(events):
        if kind == "alloc":
            try:
                live[key] = malloc(nbytes, label)
            except OutOfMemory as e:
                e.index = n
                res.oom = e
                break
        elif kind == "free":
            free(live.pop(key))
        elif kind == "step_end":
            # steps after the first repeat the same events: once a step leaves the allocator
            # as it found it, every later step replays identically (same peaks), so stop.  With
            # a capacity only after a step without a retry (the next one then has none either)
            # and without garbage collection by age (ages are not in the signature)
            if record or (capacity_bytes is not None and collects_by_age(al.cfg)):
                continue
            sig = al.signature()
            if key >= 2 and sig == last_sig and al.num_alloc_retries == last_retries:
                break
            last_sig, last_retries = sig, al.num_alloc_retries
        elif kind == "reset_peak":
            al.reset_peak()
        elif kind == "empty_cache":
            al.empty_cache()
        else:
            raise ValueError(f"unknown replay event {kind!r}")
    res.num_events = n + 1
    _record_stats(res, al)
    if record:
        res.trace = al.trace
        res.segments = al.segments()
    return res


def _replay_default(events: Iterable[Event], limit: Optional[float] = None) -> Optional[ReplayResult]:
    """``replay`` with the default settings and no recording: the same rules as
    ``CachingAllocator`` (best fit, split above 1 MiB / 512 B, merge on free, segments from
    ``get_allocation_size``) in one loop over plain lists, for speed.  A block is a list
    ``[addr, size, prev, next, allocated, small, requested]``.  (Reserved memory only grows
    where a segment is added, so its maximum is checked there.)

    ``limit``: what torch may reserve (``CachingAllocator``'s capacity): where a new segment
    would take the reserve past it, every cached block that is a whole segment is released
    and the segment tried again (``DeviceCachingAllocator::malloc``'s free-and-retry; with
    these settings no block is oversize), and a request that still fails is the ``oom``,
    where the replay stops.  It stops at a repeated step as the unlimited replay does (the
    state at a step's end equal to the previous step's), and with a limit only after a step
    without a retry, as ``replay`` with a capacity does.  None for an event this loop does not model
    (``empty_cache``): the caller replays the stream with ``CachingAllocator``."""
    small_free: List[Tuple[int, int]] = []     # (size, addr) sorted, per pool
    large_free: List[Tuple[int, int]] = []
    free_blocks: Dict[Tuple[int, int], list] = {}
    live: Dict[object, list] = {}
    insort, bisect_left = bisect.insort, bisect.bisect_left
    min_block, small_size, small_buffer = K_MIN_BLOCK_SIZE, K_SMALL_SIZE, K_SMALL_BUFFER
    min_large, large_buffer, round_large = K_MIN_LARGE_ALLOC, K_LARGE_BUFFER, K_ROUND_LARGE
    reserved = allocated = max_reserved = max_allocated = frag = segs = 0
    requested = max_requested = 0       # live requests, rounded (ReplayResult.max_allocated_bytes)
    retries = last_retries = 0
    next_addr = 1 << 40
    last_sig = None
    oom = None
    n = 0
    for n, (kind, key, nbytes, label) in enumerate(events):
        if kind == "alloc":
            size = (int(nbytes) + 511) & ~511 if nbytes >= min_block else min_block
            if size <= small_size:
                small = True
                lst = small_free
            else:
                small = False
                lst = large_free
            i = bisect_left(lst, (size, -1))
            grown = False
            if i < len(lst):
                b = free_blocks.pop(lst.pop(i))
            else:
                if small:
                    seg = small_buffer
                elif size < min_large:
                    seg = large_buffer
                else:
                    seg = -(-size // round_large) * round_large
                if limit is not None and reserved + seg > limit:
                    retries += 1
                    # release_cached_blocks: every cached whole segment, large pool first
                    for pool in (large_free, small_free):
                        for k2 in [x for x in pool if free_blocks[x][2] is None and free_blocks[x][3] is None]:
                            del pool[bisect_left(pool, k2)]
                            del free_blocks[k2]
                            reserved -= k2[0]
                    if reserved + seg > limit:
                        oom = OutOfMemory(n, size, _label(label), reserved, allocated, limit)
                        break
                b = [next_addr, seg, None, None, False, small, 0]
                next_addr += seg + (1 << 21)
                reserved += seg
                segs += 1
                grown = True
            remaining = b[1] - size
            if remaining >= min_block if small else remaining > small_size:
                nxt = b[3]
                rest = [b[0] + size, remaining, b, nxt, False, small, 0]
                if nxt is not None:
                    nxt[2] = rest
                b[3] = rest
                b[1] = size
                k2 = (remaining, rest[0])
                insort(lst, k2)
                free_blocks[k2] = rest
            b[4] = True
            b[6] = size
            allocated += b[1]
            requested += size
            if requested > max_requested:
                max_requested = requested
            live[key] = b
            if allocated > max_allocated:
                max_allocated = allocated
            if grown and reserved > max_reserved:
                max_reserved = reserved
                frag = reserved - allocated
        elif kind == "free":
            b = live.pop(key)
            b[4] = False
            allocated -= b[1]
            requested -= b[6]
            lst = small_free if b[5] else large_free
            nb = b[2]
            if nb is not None and not nb[4]:
                k2 = (nb[1], nb[0])
                del lst[bisect_left(lst, k2)]
                del free_blocks[k2]
                b[0] = nb[0]
                pp = b[2] = nb[2]
                if pp is not None:
                    pp[3] = b
                b[1] += nb[1]
            nb = b[3]
            if nb is not None and not nb[4]:
                k2 = (nb[1], nb[0])
                del lst[bisect_left(lst, k2)]
                del free_blocks[k2]
                nn = b[3] = nb[3]
                if nn is not None:
                    nn[2] = b
                b[1] += nb[1]
            k2 = (b[1], b[0])
            insort(lst, k2)
            free_blocks[k2] = b
        elif kind == "step_end":
            # a step that left the allocator as it found it, without a retry: the next one
            # replays it exactly (its retries included: none), so the replay stops here
            sig = (tuple(sorted((b[0], b[1]) for b in live.values())), tuple(large_free),
                   tuple(small_free), reserved)
            if key >= 2 and sig == last_sig and retries == last_retries:
                break
            last_sig, last_retries = sig, retries
        elif kind == "reset_peak":
            max_reserved, max_allocated, frag = reserved, allocated, reserved - allocated
            max_requested = requested
        elif limit is not None:
            return None     # an event the fast loop does not model (empty_cache): the full replay
        else:
            raise ValueError(f"unknown replay event {kind!r}")
    return ReplayResult(max_reserved_bytes=max_reserved, max_allocated_bytes=max_requested,
                        max_block_allocated_bytes=max_allocated, reserved_bytes=reserved,
                        allocated_bytes=allocated, fragmentation_at_max_bytes=frag, segments_allocated=segs,
                        num_events=n + 1, oom=oom, num_alloc_retries=retries)


# ----------------------------------------------------------------------------------
# Repeated steps whose sizes grow linearly: an exact skip-ahead
# ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class StepRun:
    """``n_steps`` repetitions of one step (a decode step of ``generate()``): step ``m``
    (0-based) replays ``events`` with each allocation's size ``c0 + c1 x m`` bytes.

    ``events``: ``("alloc", key, c0, c1, label)`` / ``("free", key, 0, 0, "")``; a free may
    name a key allocated before the run (the previous step's tensor).  After every step,
    ``renames`` (``(from_key, to_key)`` pairs) rename live keys: ``("k", 3, "new") -> ("k", 3)``
    makes this step's new cache tensor the one the next step frees."""

    events: Tuple[Tuple[str, Any, int, int, Any], ...]
    n_steps: int
    renames: Tuple[Tuple[Any, Any], ...] = ()


def expand_runs(parts: Iterable[Any]) -> List[Event]:
    """The flat event stream of ``parts`` (plain events and :class:`StepRun` s), every step's
    keys made unique: what :func:`replay_runs` replays, as :func:`replay` takes it."""
    out: List[Event] = []
    alias: Dict[Any, Any] = {}
    for r, part in enumerate(parts):
        if not isinstance(part, StepRun):
            for kind, key, nbytes, label in part:
                if kind == "alloc":
                    alias[key] = key
                elif kind == "free":
                    key = alias.pop(key, key)
                out.append((kind, key, nbytes, label))
            continue
        for m in range(part.n_steps):
            for kind, key, c0, c1, label in part.events:
                if kind == "alloc":
                    u = alias[key] = ("run", r, m, key)
                    out.append(("alloc", u, c0 + c1 * m, label))
                else:
                    out.append(("free", alias.pop(key), 0.0, ""))
            for a, b in part.renames:
                alias[b] = alias.pop(a)
    return out


def replay_runs(parts: Sequence[Any], config: Optional[AllocatorConfig] = None,
                capacity_bytes: Optional[float] = None, record: bool = False,
                growth_log: Optional[List[Tuple[int, bool, int]]] = None) -> ReplayResult:
    """``replay(expand_runs(parts), ...)``, byte for byte, without writing the steps of a
    :class:`StepRun` out.  With the default settings the compiled replay runs every step from
    the run's template (:func:`compiled_replay`: the 4.3 million events of a 32k-token
    decode's replay stream in about 0.4 s); what follows is the pure-Python replay, which
    skips steps where that is provably exact (11 s for the same decode).

    The skip (no capacity, no recording, no ``roundup_power2_divisions``): two consecutive
    (super)steps are replayed while every decision the allocator takes is recorded: for each
    request, which free block it takes and how every free block of its pool compares with it
    (``get_free_block``'s best fit and the ``max_split_size`` rules), and whether the block
    is split (``should_split``).  With the same decisions, every block size and address after a
    step is an affine function of those before it and of the requests, so when the two steps
    leave the same block structure and grow every block by the same bytes D, the state after
    step k is X1 + (k - 1) D for as long as every recorded comparison keeps its sign, which is
    an affine inequality in k: the replay jumps to the last step where all of them still hold
    and continues from there.  Requests must grow by whole 512-byte blocks per superstep (a
    superstep is P steps, with P x c1 a multiple of 512 for every size), so that ``round_size``
    is affine too.  tests/test_inference_replay.py checks the result equals the full replay.

    The two pools are replayed apart (:func:`_pool_parts`): without a capacity they never
    meet, and the small pool's steps (per-token tensors of constant size) then repeat exactly
    and are skipped even while the large pool's (the growing cache) are replayed one by one.
    Allocated memory is summed from the stream (:func:`_allocated_profile`).

    With ``growth_log`` (a list), each request that grew a pool's reserved memory is appended
    as (index in the whole stream, small pool?, that pool's reserved bytes after it): the
    reserved memory of every prefix of the stream, from one replay."""
    cfg = config or AllocatorConfig()
    if not record:
        res = compiled_replay(parts, cfg, capacity_bytes, growth_log)
        if res is not None:
            return res
        if growth_log is not None:
            del growth_log[:]        # what a replay that stopped at an oversized request logged
    if (record or capacity_bytes is not None or cfg.roundup_power2_divisions or cfg.roundup_power2_intervals
            or cfg.garbage_collection_threshold > 0):
        return replay(expand_runs(parts), cfg, capacity_bytes, record)
    split = _pool_parts(parts, cfg)
    if split is None:
        if growth_log is not None:
            raise ValueError("growth_log needs a stream without peak resets or empty_cache")
        return _replay_together(parts, cfg)
    import numpy as np

    reserved = segments = allocated = 0
    last = -1
    s_idx: List[Any] = []                 # global event index and bytes where a block's size
    s_val: List[Any] = []                 # differs from its rounded request (see _step)
    for pool in (True, False):
        al = CachingAllocator(cfg)
        live: Dict[Any, _Block] = {}
        for item in split[pool]:
            if isinstance(item, list):
                for kind, key, nbytes, label, g in item:
                    if kind == "alloc":
                        r0 = al.reserved
                        b = live[key] = al.malloc(nbytes, label)
                        if al.reserved != r0:
                            last = max(last, g)
                            if growth_log is not None:
                                growth_log.append((g, pool, al.reserved))
                        if b.size != b.requested:
                            s_idx.append(np.array([g]))
                            s_val.append(np.array([b.size - b.requested]))
                    else:
                        b = live.pop(key)
                        if b.size != b.requested:
                            s_idx.append(np.array([g]))
                            s_val.append(np.array([b.requested - b.size]))
                        al.free(b)
                continue
            run, orig, base, width = item
            growth: List[Any] = []
            slack: List[Any] = []
            _replay_run(al, live, run, growth, slack)
            for m, j, r in growth:
                last = max(last, base + m * width + orig[j])
                if growth_log is not None:
                    growth_log.append((base + m * width + orig[j], pool, r))
            if slack:
                o = np.asarray(orig, dtype=np.int64)
                pts = [x for x in slack if x[0] != "block"]
                if pts:
                    arr = np.array(pts, dtype=np.int64)
                    s_idx.append(base + arr[:, 0] * width + o[arr[:, 1]])
                    s_val.append(arr[:, 2])
                for x in slack:
                    if x[0] == "block":
                        s_idx.append(base + x[1] * width + o[x[2]])
                        s_val.append(x[3])
        reserved += al.reserved
        segments += al.segments_allocated
        allocated += al.allocated
    idx = np.concatenate(s_idx) if s_idx else np.zeros(0, dtype=np.int64)
    val = np.concatenate(s_val) if s_val else np.zeros(0, dtype=np.int64)
    order = np.argsort(idx, kind="stable")
    n, max_block_allocated, at_last = _allocated_profile(parts, cfg, last, idx[order], val[order])
    # the live requests' rounded sizes alone (what replay() reports as max_allocated_bytes)
    _, max_requested, _ = _allocated_profile(parts, cfg, last, idx[:0], val[:0]) if len(idx) else (
        n, max_block_allocated, at_last)
    return ReplayResult(max_reserved_bytes=reserved, max_allocated_bytes=max_requested,
                        max_block_allocated_bytes=max_block_allocated, reserved_bytes=reserved, allocated_bytes=allocated, fragmentation_at_max_bytes=reserved - at_last if last >= 0 else 0,
                        segments_allocated=segments, num_events=n)


def _apply(al: "CachingAllocator", live: Dict[Any, "_Block"], kind: str, key: Any, nbytes: float,
           label: Any) -> None:
    """One event of a written-out stream on ``al`` (``live``: key -> its block)."""
    if kind == "alloc":
        live[key] = al.malloc(nbytes, label)
    elif kind == "free":
        al.free(live.pop(key))
    elif kind == "reset_peak":
        al.reset_peak()
    elif kind == "empty_cache":
        al.empty_cache()
    else:
        raise ValueError(f"unknown replay event {kind!r}")


def _replay_together(parts: Sequence[Any], cfg: AllocatorConfig) -> ReplayResult:
    """:func:`replay_runs` on one allocator for both pools (streams with peak resets or
    ``empty_cache``)."""
    al = CachingAllocator(cfg)
    live: Dict[Any, _Block] = {}
    n = 0
    for part in parts:
        if isinstance(part, StepRun):
            n += _replay_run(al, live, part)
            continue
        for event in part:
            n += 1
            _apply(al, live, *event)
    return _record_stats(ReplayResult(num_events=n), al)


def _is_small(nbytes: float, cfg: AllocatorConfig) -> bool:
    return round_size(int(nbytes), cfg) <= K_SMALL_SIZE


def _split_run(run: StepRun, cfg: AllocatorConfig) -> List[Tuple[StepRun, int]]:
    """``run`` cut where a request changes pool (its size crosses 1 MiB): (sub-run, first step)."""
    cuts = {0, run.n_steps}
    for kind, _key, c0, c1, _label in run.events:
        if kind != "alloc" or not c1:
            continue
        # round_size(x) <= 1 MiB exactly when x <= 1 MiB (a multiple of 512): the size is affine
        # in m, so it crosses once, at the first m past (1 MiB - c0) / c1
        if c1 > 0 and c0 <= K_SMALL_SIZE:
            cut = (K_SMALL_SIZE - c0) // c1 + 1
        elif c1 < 0 and c0 > K_SMALL_SIZE:
            cut = -((K_SMALL_SIZE - c0) // c1)
        else:
            continue
        if 0 < cut < run.n_steps:
            cuts.add(int(cut))
    edges = sorted(cuts)
    out = []
    for a, b in zip(edges, edges[1:]):
        ev = tuple((k, key, c0 + c1 * a, c1, lb) if k == "alloc" else (k, key, c0, c1, lb)
                   for k, key, c0, c1, lb in run.events)
        out.append((StepRun(ev, b - a, run.renames), a))
    return out


def _pool_parts(parts: Sequence[Any], cfg: AllocatorConfig) -> Optional[Dict[bool, List[Any]]]:
    """The stream cut in two, one per pool (small: requests up to 1 MiB), each event with its
    index in the whole stream; None when it has peak resets or ``empty_cache`` (then both pools
    are replayed on one allocator).

    Without a capacity the two pools never meet (``get_free_block`` searches the request's
    pool only; nothing is released, since release happens only on the way to an
    out-of-memory error), so each pool's replay is the whole replay's, and reserved memory,
    which then only grows, peaks at the sum of the two pools' last values.  A decode run's
    frees of the previous step's tensors go to both pools' templates: the pool that does not
    hold the key passes over it (at the first step of a run the previous step may have
    placed it in the other pool)."""
    out: Dict[bool, List[Any]] = {True: [], False: []}
    pool_of: Dict[Any, bool] = {}
    g = 0
    for part in parts:
        if not isinstance(part, StepRun):
            ev: Dict[bool, List[Any]] = {True: [], False: []}
            for kind, key, nbytes, label in part:
                if kind == "alloc":
                    p = pool_of[key] = _is_small(nbytes, cfg)
                elif kind == "free":
                    p = pool_of.pop(key)
                else:
                    return None
                ev[p].append((kind, key, nbytes, label, g))
                g += 1
            out[True].append(ev[True])
            out[False].append(ev[False])
            continue
        for sub, _first in _split_run(part, cfg):
            width = len(sub.events)
            mine: Dict[Any, bool] = {}
            carried: List[Any] = []
            idx: Dict[bool, List[int]] = {True: [], False: []}
            for j, (kind, key, c0, _c1, _label) in enumerate(sub.events):
                if kind == "alloc":
                    p = mine[key] = _is_small(c0, cfg)
                    idx[p].append(j)
                elif key in mine:
                    idx[mine[key]].append(j)
                else:
                    carried.append(key)
                    idx[True].append(j)
                    idx[False].append(j)
            for p in (True, False):
                out[p].append((StepRun(tuple(sub.events[j] for j in idx[p]), sub.n_steps, sub.renames),
                               idx[p], g, width))
            g += width * sub.n_steps
            for key in carried:
                pool_of.pop(key, None)
            for a, b in sub.renames:
                if a in mine:
                    pool_of[b] = mine[a]
    return out


def _allocated_profile(parts: Sequence[Any], cfg: AllocatorConfig, at: int, slack_idx: Any, slack_val: Any
                       ) -> Tuple[int, int, int]:
    """(events, max_memory_allocated, memory_allocated just after event ``at``) of the stream:
    allocated memory is the sum of the live requests' rounded sizes (placement does not
    matter) plus, where a block was taken whole, what it has beyond the request (``slack_*``:
    sorted global event indices and bytes, from the pools' replays); summed here, a run's
    steps at once with numpy."""
    import numpy as np

    size: Dict[Any, int] = {}
    cur = top = at_value = 0
    g = 0
    ptr = 0
    n_slack = len(slack_idx)
    for part in parts:
        if not isinstance(part, StepRun):
            for kind, key, nbytes, _label in part:
                if kind == "alloc":
                    r = size[key] = round_size(int(nbytes), cfg)
                    cur += r
                else:
                    cur -= size.pop(key)
                while ptr < n_slack and slack_idx[ptr] == g:
                    cur += int(slack_val[ptr])
                    ptr += 1
                top = max(top, cur)
                if g == at:
                    at_value = cur
                g += 1
            continue
        ev = part.events
        width, n = len(ev), part.n_steps
        alloc_j = {key: j for j, (kind, key, *_r) in enumerate(ev) if kind == "alloc"}
        source = {b: alloc_j[a] for a, b in part.renames if a in alloc_j}
        c0 = np.array([e[2] if e[0] == "alloc" else 0 for e in ev], dtype=np.int64)
        c1 = np.array([e[3] if e[0] == "alloc" else 0 for e in ev], dtype=np.int64)
        is_alloc = np.array([e[0] == "alloc" for e in ev])
        chunk = max(1, 2_000_000 // max(width, 1))
        for m0 in range(0, n, chunk):
            ms = np.arange(m0, min(n, m0 + chunk), dtype=np.int64)[:, None]
            raw = c0[None, :] + c1[None, :] * ms
            r = np.where(raw < K_MIN_BLOCK_SIZE, K_MIN_BLOCK_SIZE, (raw + 511) // 512 * 512)
            delta = np.where(is_alloc[None, :], r, 0)
            for j, (kind, key, *_r) in enumerate(ev):
                if kind == "alloc":
                    continue
                if key in alloc_j and alloc_j[key] < j:
                    delta[:, j] = -r[:, alloc_j[key]]
                else:                         # the previous step's tensor (or one from before the run)
                    a = source[key]
                    prev = np.concatenate(([size[key] if m0 == 0 else int(last_r[a])], r[:-1, a]))
                    delta[:, j] = -prev
            flat_delta = delta.reshape(-1)
            lo = ptr
            ptr = int(np.searchsorted(slack_idx, g + flat_delta.size, side="left"))
            if ptr > lo:
                np.add.at(flat_delta, slack_idx[lo:ptr] - g, slack_val[lo:ptr])
            flat = np.cumsum(flat_delta) + cur
            top = max(top, int(flat.max()))
            if g <= at < g + flat.size:
                at_value = int(flat[at - g])
            cur = int(flat[-1])
            g += flat.size
            last_r = r[-1]
        for key in _carried_frees(ev, alloc_j):
            size.pop(key, None)
        for a, b in part.renames:
            if a in alloc_j:
                size[b] = int(last_r[alloc_j[a]])
    return g, top, at_value


def _carried_frees(ev: Sequence[Any], alloc_j: Dict[Any, int]) -> List[Any]:
    """Keys a step frees that it did not allocate (the previous step's)."""
    return [key for j, (kind, key, *_r) in enumerate(ev) if kind != "alloc" and not (key in alloc_j and alloc_j[key] < j)]


def _superstep(run: StepRun) -> Optional[int]:
    """P: the fewest steps over which every size grows by whole 512-byte blocks; None when a
    size is not an integer (then the run is replayed step by step)."""
    p = 1
    for kind, _key, c0, c1, _label in run.events:
        if kind != "alloc":
            continue
        if c0 != int(c0) or c1 != int(c1):
            return None
        g = math.gcd(int(c1), K_MIN_BLOCK_SIZE)
        p = p * (K_MIN_BLOCK_SIZE // g) // math.gcd(p, K_MIN_BLOCK_SIZE // g)
    return p


def _structure(al: CachingAllocator, owner: Dict[int, Any]) -> Tuple[Tuple[Any, ...], List[int], List[_Block]]:
    """The allocator's block structure (reserved bytes, each segment's blocks in address
    order with their use and owner: sizes left out), the sizes in that order (an allocated
    block's size followed by its rounded request), and the blocks."""
    at: Dict[int, _Block] = dict(al._live)
    for b in al._by_key.values():
        at[b.addr] = b
    shape: List[Any] = [al.reserved]
    sizes: List[int] = []
    order: List[_Block] = []
    for seg_addr in sorted(al._segments):
        b = at.get(seg_addr)
        shape.append(seg_addr)
        while b is not None:
            shape.append(owner.get(id(b), -1) if b.allocated else None)
            sizes.append(b.size)
            if b.allocated:
                sizes.append(b.requested)
            order.append(b)
            b = b.next
    return tuple(shape), sizes, order


#: weighs a size difference above any address difference of one pool (addresses start at
#: 2^40; the expandable segments at 2^44 above), so that one value orders (size, address)
_LEX = 1 << 46


def _step(al: CachingAllocator, live: Dict[Any, _Block], run: StepRun, m: int,
          rec: Optional[Tuple[List[Any], List[int], List[int], List[int]]], growth: Optional[List[Any]] = None,
          slack: Optional[List[Any]] = None) -> None:
    """Replay step ``m`` of ``run``; with ``rec`` = (decisions, comparisons, allocated after
    each event), record them (see :func:`replay_runs`).  With ``growth`` (one pool's replay:
    a free or rename of a key this pool does not hold belongs to the other pool and is passed
    over), ``growth`` gets (m, event index, reserved bytes after it) of each request that grew
    reserved memory,
    and ``slack`` gets (m, event index, bytes) where allocated memory moved by more than the
    rounded request: a block taken whole (not split) is allocated in full, and so is freed."""
    cfg = al.cfg
    ms = cfg.max_split_size_bytes
    for j, (kind, key, c0, c1, label) in enumerate(run.events):
        if kind != "alloc":
            b0 = live.pop(key, None)
            if b0 is None:
                if growth is None:
                    raise KeyError(key)
                continue
            extra = b0.size - b0.requested
            al.free(b0)
            if rec is not None:
                rec[2].append(al.allocated)
                rec[3].append((m, j, -extra))
            elif extra and slack is not None:
                slack.append((m, j, -extra))
            continue
        raw = c0 + c1 * m
        if rec is None:
            r0 = al.reserved
            b0 = live[key] = al.malloc(raw, label)
            if growth is not None and al.reserved != r0:
                growth.append((m, j, al.reserved))
            if slack is not None and b0.size != b0.requested:
                slack.append((m, j, b0.size - b0.requested))
            continue
        decisions, comps, alloc_after, extras = rec
        size = round_size(int(raw), cfg)
        small = size <= K_SMALL_SIZE
        free = sorted((al._by_key[k] for k in al._free[small]), key=lambda x: x.addr)
        before = {id(b): b.size for b in free}
        addrs = {id(b): b.addr for b in free}
        reserved = al.reserved
        b = live[key] = al.malloc(raw, label)
        if al.reserved != reserved:
            decisions.append(None)          # a new segment: never skipped over
            if growth is not None:
                growth.append((m, j, al.reserved))
            continue
        chosen = next(i for i, f in enumerate(free) if addrs[id(f)] == b.addr)
        csize, caddr = before[id(free[chosen])], b.addr
        decisions.append((chosen, small, b.size != csize))
        # each comparison as a value whose sign (>= 0 or < 0) must not change
        comps.append(int(raw) - K_MIN_BLOCK_SIZE)                  # round_size's 512-B floor
        comps.append(K_SMALL_SIZE - size)                          # get_pool
        for i, f in enumerate(free):
            fs = before[id(f)]
            comps.append(fs - size)                                # big enough (best fit)
            if i != chosen:                                        # not a better fit: (size, address) after
                comps.append((fs - csize) * _LEX + (addrs[id(f)] - caddr) - 1)
        rem = csize - size
        if small or cfg.expandable_segments:
            comps.append(rem - K_MIN_BLOCK_SIZE)                   # should_split
        else:
            comps.append(rem - K_SMALL_SIZE - 1)
        if ms < NO_LIMIT:
            comps.append(size - ms)
            comps.append(csize - ms)
            comps.append(csize - size - K_LARGE_BUFFER)
        alloc_after.append(al.allocated)
        extras.append((m, j, b.size - b.requested))
    if al.allocated > al.max_allocated:
        al.max_allocated = al.allocated
    for a, b2 in run.renames:
        if a in live or growth is None:
            live[b2] = live.pop(a)


def _horizon(va: List[int], vb: List[int]) -> Optional[int]:
    """The last k >= 2 such that every v(k) = va + (k - 1) (vb - va) has had, for each k' in
    1..k, the sign class (>= 0 or < 0) it had at k = 1 and 2; None when a sign already
    differs between the two (the regime is changing) or no value limits k (unbounded: -1)."""
    kmax = -1
    for a, b in zip(va, vb):
        if (a >= 0) != (b >= 0):
            return None
        s = b - a
        if a >= 0 and s < 0:
            k = 1 + a // (-s)                   # a + (k-1) s >= 0
        elif a < 0 and s > 0:
            k = 1 + (-a - 1) // s               # a + (k-1) s <= -1
        else:
            continue
        kmax = k if kmax < 0 else min(kmax, k)
    return kmax


#: probes in a row that skip too little, or steps hashed without a layout coming back, before
#: a run is replayed step by step to its end (the probes' recording and the per-step layout
#: hashing cost more than they save there)
_MAX_MISSES = 3
_MAX_HASHED = 160


def _replay_run(al: CachingAllocator, live: Dict[Any, _Block], run: StepRun,
                growth: Optional[List[Any]] = None, slack: Optional[List[Any]] = None) -> int:
    """Replay ``run`` on ``al``, skipping ahead where :func:`replay_runs` proves it exact;
    returns the number of events it stands for (``growth``, ``slack``: see :func:`_step`; a
    skipped stretch's slack is appended as one ("block", steps, event indices, bytes) of
    numpy arrays).

    The superstep is found, not assumed: the block structure (with owners) is hashed at every
    step boundary, and when it recurs after Q steps (the decode steps' cache tensors rotate
    through a segment and come back to the same layout after about L + 1 steps), two
    supersteps of lcm(Q, P) steps are replayed with their decisions recorded and the skip is
    tried over that period."""
    n = run.n_steps
    per_step = len(run.events)
    P = _superstep(run)
    m = 0
    seen: Dict[Tuple[Any, ...], int] = {}
    reserved = al.reserved
    misses = 0                            # probes in a row that skipped little
    hashed = 0                            # steps hashed since the last probe
    fixed = _FixedPoint(run, al.cfg)
    while m < n:
        jump = fixed.jump(al, live, m, n, slack)
        if jump:
            m = jump
            seen.clear()
            continue
        if P is None or misses >= _MAX_MISSES or hashed >= _MAX_HASHED or fixed.promising(m):
            fixed.step(al, live, m, growth, slack)
            m += 1
            continue
        if al.reserved != reserved:       # reserved only grows: no earlier layout comes back
            seen.clear()
            reserved = al.reserved
        owner = {id(b): k for k, b in live.items()}
        shape, sizes1, _ = _structure(al, owner)
        last = seen.get(shape)
        seen[shape] = m
        Q = 0 if last is None else (m - last) * P // math.gcd(m - last, P)
        hashed += 1
        if not Q or n - m < 3 * Q:
            fixed.step(al, live, m, growth, slack)
            m += 1
            continue
        start = m
        hashed = 0
        recs = []
        states = [sizes1]
        shapes = [shape]
        for _ in range(2):
            rec: Tuple[List[Any], List[int], List[int], List[Any]] = ([], [], [], [])
            for j in range(Q):
                _step(al, live, run, m + j, rec, growth)
            m += Q
            recs.append(rec)
            owner = {id(b): k for k, b in live.items()}
            sh, sz, _ = _structure(al, owner)
            shapes.append(sh)
            states.append(sz)
        (d1, c1, u1, x1), (d2, c2, u2, x2) = recs
        if slack is not None:             # the probes' own slack, as replayed
            slack.extend(x for x in x1 + x2 if x[2])
        misses += 1
        if not (shapes[0] == shapes[1] == shapes[2] and d1 == d2 and None not in d1 and len(c1) == len(c2)
                and [(a[0] - start, a[1]) for a in x1] == [(b[0] - start - Q, b[1]) for b in x2]):
            continue
        D = [b - a for a, b in zip(states[1], states[2])]
        if D != [b - a for a, b in zip(states[0], states[1])]:
            continue
        kmax = _horizon(c1, c2)
        if kmax is None:
            continue
        left = (n - m) // Q                       # supersteps that may still be skipped
        k = 2 + left if kmax < 0 else min(kmax, 2 + left)
        if k <= 2:
            continue
        if k - 2 >= 4:
            misses = 0
        # the peaks of the skipped supersteps 3..k: affine in k, so at an end
        for kk in (3, k):
            top = max((a + (kk - 1) * (b - a) for a, b in zip(u1, u2)), default=0)
            if top > al.max_allocated:
                al.max_allocated = top
        if slack is not None and x1:
            import numpy as np

            ks = np.arange(3, k + 1, dtype=np.int64)[:, None]
            q = np.array([a[0] - start for a in x1], dtype=np.int64)[None, :]
            da = np.array([a[2] for a in x1], dtype=np.int64)[None, :]
            db = np.array([b[2] for b in x2], dtype=np.int64)[None, :]
            vals = da + (ks - 1) * (db - da)
            steps = start + (ks - 1) * Q + q + 0 * vals
            js = np.array([a[1] for a in x1], dtype=np.int64)[None, :] + 0 * vals
            keep = vals != 0
            slack.append(("block", steps[keep], js[keep], vals[keep]))
        # jump: the state after superstep k is X1 + k D
        _, _, order = _structure(al, {})
        _set_sizes(al, order, [a + k * d for a, d in zip(sizes1, D)])
        m += (k - 2) * Q
    return n * per_step


class _FixedPoint:
    """The cheapest exact skip: a stretch of Q steps (Q <= 8) that left the pool exactly as it
    found it (every block's address, size, use and owner), with requests rounding to the same
    sizes in every step of it and after it, is followed by stretches that do the same, until
    some request rounds to another size (a decode step's constant-size tensors beside only
    slowly growing ones, such as generate()'s ``input_ids`` ping-ponging between two blocks:
    ``round_size`` changes every 512 / c1 steps).  Such steps reserve nothing new, so a card's
    limit changes nothing in them either."""

    MAX_PERIOD = 8

    def __init__(self, run: StepRun, cfg: AllocatorConfig):
        self.run, self.cfg = run, cfg
        self.growing = [(int(c0), int(c1)) for kind, _k, c0, c1, _l in run.events
                        if kind == "alloc" and c1 and c0 == int(c0) and c1 == int(c1)]
        self.ok = all(c0 == int(c0) and c1 == int(c1) for kind, _k, c0, c1, _l in run.events if kind == "alloc")
        #: (step, state before it, slack it added) of the last steps replayed in a row
        self.hist: List[Tuple[int, Tuple[Any, ...], List[Any]]] = []

    def _sizes_equal(self, m: int) -> bool:
        """Steps m - 1 and m request the same rounded sizes."""
        return all(round_size(c0 + c1 * (m - 1), self.cfg) == round_size(c0 + c1 * m, self.cfg)
                   for c0, c1 in self.growing)

    def _next_change(self, m: int, n: int) -> int:
        """The first step after m (at most n) whose rounded sizes differ from step m's (each
        size is monotone in the step, so a bisection finds it)."""
        out = n
        for c0, c1 in self.growing:
            r = round_size(c0 + c1 * m, self.cfg)
            if round_size(c0 + c1 * (n - 1), self.cfg) == r:
                continue
            lo, hi = m, n - 1                   # size(lo) == r != size(hi)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if round_size(c0 + c1 * mid, self.cfg) == r:
                    lo = mid
                else:
                    hi = mid
            out = min(out, hi)
        return out

    @staticmethod
    def state(al: CachingAllocator, live: Dict[Any, _Block]) -> Tuple[Any, ...]:
        owner = {id(b): k for k, b in live.items()}
        shape, sizes, _ = _structure(al, owner)
        return shape + tuple(sizes)

    def step(self, al: CachingAllocator, live: Dict[Any, _Block], m: int, growth: Optional[List[Any]],
             slack: Optional[List[Any]], stepper: Any = None) -> None:
        """Replay step m, keeping what :meth:`jump` compares (only where a jump could follow)."""
        watch = self.ok and (not self.growing or (m + 1 < self.run.n_steps and self._sizes_equal(m + 1)))
        before = self.state(al, live) if watch else None
        k = len(slack) if slack is not None else 0
        if stepper is not None:
            stepper(al, live, self.run, m)
        else:
            _step(al, live, self.run, m, None, growth, slack)
        if not watch:
            self.hist = []
            return
        if self.hist and self.hist[-1][0] != m - 1:
            self.hist = []
        self.hist.append((m, before, list(slack[k:]) if slack is not None else []))
        del self.hist[:-self.MAX_PERIOD]

    def promising(self, m: int) -> bool:
        """Whether to keep replaying plain steps for a jump rather than probe a superstep: the
        requests round to the same sizes from step to step, and fewer than 2 x MAX_PERIOD steps
        in a row have been replayed without one."""
        if not self.ok or (self.growing and not self._sizes_equal(m)):
            return False
        self.tries = getattr(self, "tries", 0) + 1
        if self.tries > 2 * self.MAX_PERIOD:
            if self.tries > 64:
                self.tries = 0
            return False
        return True

    def jump(self, al: CachingAllocator, live: Dict[Any, _Block], m: int, n: int,
             slack: Optional[List[Any]]) -> int:
        """The step to continue from when steps m.. repeat the last Q replayed ones exactly;
        0 when they may not."""
        h = self.hist
        if not h or h[-1][0] != m - 1 or (self.growing and not self._sizes_equal(m)):
            return 0
        now = None
        for Q in range(1, len(h) + 1):
            start, before, _ = h[-Q]
            if start != m - Q:
                break
            if self.growing and any(round_size(c0 + c1 * start, self.cfg) != round_size(c0 + c1 * m, self.cfg)
                                    for c0, c1 in self.growing):
                break
            if now is None:
                now = self.state(al, live)
            if now != before:
                continue
            end = self._next_change(m, n) if self.growing else n
            k = (end - m) // Q                      # whole periods that repeat
            if k <= 0:
                return 0
            if slack is not None:
                pattern = [(x[0] - start, x[1], x[2]) for st in h[-Q:] for x in st[2]]
                if pattern:
                    import numpy as np

                    ks = np.arange(k, dtype=np.int64)[:, None] * Q + m
                    off = np.array([x[0] for x in pattern], dtype=np.int64)[None, :]
                    js = np.array([x[1] for x in pattern], dtype=np.int64)[None, :]
                    vals = np.array([x[2] for x in pattern], dtype=np.int64)[None, :]
                    slack.append(("block", (ks + off).reshape(-1), (js + 0 * ks).reshape(-1),
                                  (vals + 0 * ks).reshape(-1)))
            self.hist = []
            self.tries = 0
            return m + k * Q
        return 0


def _set_sizes(al: CachingAllocator, order: List[_Block], sizes: List[int]) -> None:
    """Give every block (address order within each segment) its new size, and the addresses
    and free lists that follow."""
    al._live.clear()
    al._by_key.clear()
    al._free = {True: [], False: []}
    allocated = 0
    addr = None
    seg = None
    it = iter(sizes)
    for b in order:
        size = next(it)
        if b.allocated:
            b.requested = next(it)
        if b.seg is not seg:
            seg = b.seg
            addr = seg.addr
        b.addr, b.size = addr, size
        addr += size
        if b.allocated:
            al._live[b.addr] = b
            allocated += size
        else:
            key = (size, b.addr)
            al._free[b.small].append(key)
            al._by_key[key] = b
    for lst in al._free.values():
        lst.sort()
    al.allocated = allocated


def replay_runs_on_card(parts: Sequence[Any], config: Optional[AllocatorConfig] = None,
                        capacity_bytes: Optional[float] = None) -> ReplayResult:
    """``replay(expand_runs(parts), config, capacity_bytes)``, byte for byte, without writing
    the steps of a :class:`StepRun` out: each step is replayed on one allocator with the card's
    capacity (the free-and-retry at the limit, ``CachingAllocator.malloc``), except where
    :class:`_FixedPoint` proves that steps repeat exactly (such steps reserve nothing new, so
    the limit changes nothing in them).  For inference's capacity replays (``judge_on``), whose
    decode steps written out are millions of events; a step that fails is reported in ``oom``
    with its index in the written-out stream, and the replay stops there."""
    cfg = config or AllocatorConfig()
    compiled = compiled_replay(parts, cfg, capacity_bytes)
    if compiled is not None:
        return compiled
    al = CachingAllocator(cfg, capacity_bytes)
    live: Dict[Any, _Block] = {}
    res = ReplayResult()
    g = 0                                   # index of the next event in the written-out stream
    at = [0]                                # the event of the current step being replayed

    def stepper(al2: CachingAllocator, live2: Dict[Any, _Block], run: StepRun, m: int) -> None:
        for j, (kind, key, c0, c1, label) in enumerate(run.events):
            at[0] = j
            if kind == "alloc":
                live2[key] = al2.malloc(c0 + c1 * m, label)
            else:
                al2.free(live2.pop(key))
        for a, b in run.renames:
            live2[b] = live2.pop(a)

    try:
        for part in parts:
            if not isinstance(part, StepRun):
                for event in part:
                    _apply(al, live, *event)
                    g += 1
                continue
            width = len(part.events)
            fixed = _FixedPoint(part, cfg)
            m = 0
            while m < part.n_steps:
                jump = fixed.jump(al, live, m, part.n_steps, None)
                if jump:
                    g += (jump - m) * width
                    m = jump
                    continue
                at[0] = 0
                fixed.step(al, live, m, None, None, stepper)
                g += width
                m += 1
    except OutOfMemory as e:
        if parts and isinstance(part, StepRun):
            g += at[0]
        e.index = g
        res.oom = e
        res.num_events = g + 1
    else:
        res.num_events = g
    _record_stats(res, al)
    # the skip-ahead keeps the blocks' allocated peak (torch's statistic); a decode's requests
    # are whole blocks, so it is also the rounded requests' peak of the full replay
    res.max_allocated_bytes = al.max_allocated
    return res
