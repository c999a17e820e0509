"""The allocation log of one traced training step, and its replay at other sizes (pure Python).

Each :class:`Alloc` is one storage the step created: raw bytes, the event numbers of its
allocation and free, the phase and op that made it, and (after the step) what it was:
weights, gradients, optimizer states, activations, ... :func:`replay` walks the log and
returns the peak allocated bytes of every phase; given sizes predicted for another batch
and sequence (see ``profile.py``) it gives that setup's peaks without tracing again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

#: the CUDA caching allocator's smallest block and rounding unit
CUDA_ROUND_BYTES = 512


def cuda_rounded(nbytes: float) -> int:
    """Bytes the CUDA caching allocator reserves for one tensor of ``nbytes``."""
    n = int(nbytes)
    if n <= 0:
        return 0
    return -(-n // CUDA_ROUND_BYTES) * CUDA_ROUND_BYTES


@dataclass
class Alloc:
    """One storage: its raw bytes, when it was allocated and freed (event numbers)."""

    nbytes: int          # raw bytes (numel x element size), before rounding
    t_alloc: int
    t_free: Optional[int]
    phase: str
    op: str
    module: str
    kind: str = ""       # filled in after the step: weights, gradients, activations, ...
    group: str = ""
    dims: Optional[Tuple[int, ...]] = None   # the shape, where the storage is exactly one tensor's
    elsize: int = 1


def replay(sizes: List[int], allocs: List[Alloc], marks: List[Tuple[str, int]]) -> Dict[str, Tuple[int, int]]:
    """Peak allocated bytes per phase and the event time of each peak.

    ``sizes`` are the rounded bytes of each allocation (the ledger's own, or ones
    predicted for another batch and sequence).  Returns {phase: (peak_bytes, t_peak)}
    (a phase that runs twice, e.g. two micro-batches, keeps its larger peak) and, under
    ``"end:<phase>"``, the bytes live when the phase ends.
    """
    deltas: Dict[int, int] = {}
    for a, n in zip(allocs, sizes):
        if n:
            deltas[a.t_alloc] = deltas.get(a.t_alloc, 0) + n
            if a.t_free is not None:
                deltas[a.t_free] = deltas.get(a.t_free, 0) - n
    events = sorted(deltas.items())
    out: Dict[str, Tuple[int, int]] = {}

    def close(phase: str, peak: int, t_peak: int, cur: int, t_end: int) -> None:
        if phase not in out or peak > out[phase][0]:
            out[phase] = (peak, t_peak)
        out["end:" + phase] = (cur, t_end)

    cur = 0
    mi = 0
    phase = "load"
    peak, t_peak = 0, 0
    for t, d in events:
        while mi < len(marks) and marks[mi][1] <= t:
            close(phase, peak, t_peak, cur, marks[mi][1])
            phase = marks[mi][0]
            peak, t_peak = cur, marks[mi][1]
            mi += 1
        cur += d
        if cur > peak:
            peak, t_peak = cur, t
    while mi < len(marks):
        close(phase, peak, t_peak, cur, marks[mi][1])
        phase = marks[mi][0]
        peak, t_peak = cur, marks[mi][1]
        mi += 1
    close(phase, peak, t_peak, cur, t_peak)
    return out


def live_at(allocs: List[Alloc], sizes: List[int], t: int) -> List[Tuple[Alloc, int]]:
    """The allocations live at event ``t`` with their sizes."""
    return [(a, n) for a, n in zip(allocs, sizes) if n and a.t_alloc <= t and (a.t_free is None or a.t_free > t)]
