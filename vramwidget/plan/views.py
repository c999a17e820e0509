"""Views of one step plan: the allocated bytes over time, each phase's peak, the tensors live
at it (the component trees), and the event stream the allocator replays.

What the plan counts as allocated is what PyTorch's ``allocated_bytes`` counts for a block
that fits its request: each tensor rounded up by the allocator (``round_size``: 512 B
steps).  A replay of the same events reaches the same maximum (``allocator.replay``'s
``max_allocated_bytes``); ``torch.cuda.max_memory_allocated()`` on a GPU also counts the
tail of a cached block that a request takes without splitting it (under 1 MiB each,
``should_split``), which the replay reports as ``max_block_allocated_bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import compress, repeat
from operator import itemgetter
from typing import Any, Dict, List, Optional, Tuple

from ..allocator.caching import AllocatorConfig, round_size
from ..result import COMPONENT_KINDS, Node
from .builder import Event, EventColumns, StepPlan, TensorInfo, event_columns
from .size import Size, coefficient_matrix, monomial_values, monomials

#: the phases a step plan reports, as the measurements name them (validation/README.md)
STEADY_PHASES = ("forward", "backward", "optimizer_step")
#: the peak's candidates, in the order a tie is broken: the steady phases first.  The load
#: (``phases_bytes["load"]``) is not among them: the measurements reset the peak once the
#: model is built, and a ``from_pretrained`` load has no spike of its own
PEAK_PHASES = STEADY_PHASES + ("first_step",)


#: an event's effect on the live allocations
_SIGN = {"alloc": 1, "free": -1}
#: the type of a key or size that needs no conversion
_INT = frozenset((int,))


class PlanIndex:
    """A plan's events as arrays (built once per plan): which allocation each event adds or
    removes, and the allocations' sizes as polynomial coefficients."""

    def __init__(self, plan: StepPlan):
        import numpy as np

        self.plan = plan
        # the builder hands out keys 1, 2, 3, ... in allocation order: allocation row = key - 1
        ev = plan.events
        n = len(ev)
        #: the events as the compiled replay's codes and slots (``program_at``): made here
        #: where every kind has a code and every key is an int (the builder's plans), so
        #: the signs and rows below are read off them in numpy, not event by event; a span
        #: the plan copied (``StepPlan.copies``) is read off its source's arrays
        got = _copied_columns(plan) if plan.copies and COPY_AWARE_INDEX else None
        self.codes = self.slots = None
        lit_rows = row_copies = lit_events = None
        if got is not None:
            kinds, keys, third, labels, self.codes, self.slots, lit_events, row_copies = got
        else:
            kinds, keys, third, labels = event_columns(ev)
            if set(map(type, keys)) <= _INT and set(kinds) <= _CODES.keys():
                self.codes = np.fromiter(map(_CODES.__getitem__, kinds), dtype=np.int8, count=n)
                self.slots = np.fromiter(keys, dtype=np.int64, count=n)
        if not isinstance(ev, EventColumns):
            plan.keep_columns(kinds, keys, third, labels)     # one tuple per column, not per event
        if self.codes is not None:
            raw = self._signs_and_rows()
        else:
            self.signs = np.fromiter(map(_SIGN.get, kinds, repeat(0, n)), dtype=np.int64, count=n)
            moves = self.signs != 0
            raw = np.zeros(n, dtype=np.int64)
            raw[moves] = np.fromiter(compress(keys, moves), dtype=np.int64, count=int(moves.sum())) - 1
        self.rows = raw
        made = self.signs == 1
        made_at = np.flatnonzero(made)
        n_alloc = len(made_at)
        if lit_events is not None:
            # the sizes of the allocations the plan wrote out; a copy's are its source's rows
            sizes = list(map(third.__getitem__, lit_events.tolist()))
            lit_rows = raw[lit_events]
        else:
            sizes = list(compress(third, made))
        #: the events' columns, for events_at
        self.columns = (kinds, keys, third, labels, made_at)
        self._lifetimes(made_at)
        self._sizes(sizes, n_alloc, lit_rows, row_copies)
        self._caches()

    def _signs_and_rows(self) -> Any:
        """``signs`` (+1 an allocation, -1 a free, 0 else) from the codes, and each event's
        allocation row (``rows``: the key - 1 of an allocation or free, else 0), returned."""
        import numpy as np

        self.signs = (self.codes == 0).astype(np.int64) - (self.codes == 1)     # _SIGN
        self.rows = np.where(self.signs != 0, self.slots - 1, 0)
        return self.rows

    def _lifetimes(self, made_at: Any) -> None:
        """Each allocation row's key, the event that makes it and the one that frees it (the
        number of events where none does)."""
        import numpy as np

        n, raw = len(self.rows), self.rows
        n_alloc = len(made_at)
        self.keys = list(range(1, n_alloc + 1))
        self.alloc_at = np.zeros(n_alloc, dtype=np.int64)
        self.free_at = np.full(n_alloc, n, dtype=np.int64)
        self.alloc_at[raw[made_at]] = made_at
        freed = np.flatnonzero(self.signs == -1)
        self.free_at[raw[freed]] = freed

    @classmethod
    def with_rows_inserted(cls, base: "PlanIndex", plan: StepPlan, at: int, row: int, nbytes: List[int]
                           ) -> "PlanIndex":
        """The index of ``plan``, which is ``base``'s plan with ``len(nbytes)`` allocations
        of those whole bytes inserted before event ``at`` and never freed, the first at
        allocation row ``row`` (every key after it moved up by as many) and each constant
        size as its whole bytes (``per_gpu._with_startup_buffers``: DDP's buckets and NCCL's
        buffers), read off ``base``'s arrays instead of ``plan``'s events: the same index
        (tests/test_parallel_plan.py).  ``PlanIndex(plan)`` where ``base`` has no codes or
        is symbolic in constants alone."""
        import numpy as np

        if base.codes is None or (base.symbolic and not np.any(base.coef[:, 1:])):
            return cls(plan)
        self = cls.__new__(cls)
        self.plan = plan
        nb = len(nbytes)
        c0 = base.codes
        s0 = base.slots.copy()
        s0[(c0 <= 1) & (s0 > row)] += nb
        self.codes = np.concatenate([c0[:at], np.zeros(nb, dtype=np.int8), c0[at:]])
        self.slots = np.concatenate([s0[:at], np.arange(row + 1, row + nb + 1, dtype=np.int64), s0[at:]])
        self._signs_and_rows()
        made_at = np.flatnonzero(self.signs == 1)
        ev = plan.events
        self.columns = (*event_columns(ev), made_at)
        self._lifetimes(made_at)
        new = np.asarray(nbytes, dtype=np.int64)
        self.symbolic = base.symbolic
        if self.symbolic:
            self.basis, self.sizes = base.basis, None
            coef = base.coef.copy()
            const = ~np.any(coef[:, 1:], axis=1)          # a constant Size: its whole bytes
            coef[const, 0] = _whole_bytes(coef[const, 0]).astype(float)
            rows = np.zeros((nb, coef.shape[1]), dtype=float)
            rows[:, 0] = new
            self.coef = np.concatenate([coef[:row], rows, coef[row:]])
        else:
            self.basis, self.coef = None, None
            self.sizes = np.minimum(np.concatenate([base.sizes[:row], new, base.sizes[row:]]), SATURATED_REQUEST_BYTES)
        self._caches()
        return self

    def _caches(self) -> None:
        """The plan's marks, and what the views fill in on first use (empty)."""
        self.marks = self.plan.marks
        #: replays of this plan's event streams, shared by sizes whose events are equal
        #: (``replays.replay_training``: the size's monomials and the capacity -> ReplayResult)
        self.stream_replays: Dict[Tuple[Any, ...], Any] = {}
        #: each allocation row's box in the component trees (``tree_keys``), made on first use
        self.tree_boxes: Any = None
        #: the events as the compiled replay's columns (``program_at``), made on first use
        self.program: Any = None
        #: the event indices of the gradient allocations (``gradient_events``), made on first use
        self.gradient_at: Any = None
        #: each allocation row's tensor description and whether the load made it
        #: (``row_infos``), made on first use
        self.info_rows: Any = None

    def _sizes(self, sizes: List[Any], n_alloc: int, lit_rows: Any, row_copies: Any) -> None:
        """The allocations' bytes: whole numbers (``self.sizes``) or polynomial coefficients
        over ``self.basis`` (``self.coef``), from ``sizes``, the bytes of every allocation
        row, or where ``lit_rows`` is given of those rows only, the rest copies of earlier
        rows (``row_copies``: (first source row, first row, count), from ``_copied_columns``)."""
        import numpy as np

        def expand(values: Any) -> Any:
            if lit_rows is None:
                return values
            out = np.empty((n_alloc,) + values.shape[1:], dtype=values.dtype)
            out[lit_rows] = values
            for src, dst, m in row_copies:
                out[dst:dst + m] = out[src:src + m]
            return out

        n_given = len(sizes)
        whole = None
        try:      # whole numbers of bytes (every concrete plan the builder writes): one pass in C
            whole = np.fromiter(sizes, dtype=np.int64, count=n_given) if set(map(type, sizes)) <= _INT else None
        except OverflowError:     # a request of 2**63 bytes or more: below
            pass
        self.symbolic = whole is None and any(x.__class__ is Size for x in sizes)
        if self.symbolic:
            # the numbers as constants in one pass; one row per distinct Size object (a
            # block's sizes repeat layer after layer)
            ids = list(map(id, sizes))
            by_id = dict(zip(ids, sizes))            # each distinct object, in first-seen order
            first: Dict[int, int] = {k: j for j, k in enumerate(by_id)}
            which = np.fromiter(map(first.__getitem__, ids), dtype=np.int64, count=n_given)
            distinct: List[Any] = list(by_id.values())
            is_size = np.fromiter(map(isinstance, distinct, repeat(Size, len(distinct))), dtype=bool,
                                  count=len(distinct))
            polys = list(compress(distinct, is_size))
            self.basis = monomials(polys)
            table = np.zeros((len(distinct), len(self.basis)), dtype=float)
            table[is_size] = coefficient_matrix(polys, self.basis)
            table[~is_size, 0] = np.fromiter(map(float, compress(distinct, ~is_size)), dtype=float,
                                             count=len(distinct) - len(polys))
            self.coef = table[expand(which)]
            self.sizes = None
        else:
            self.basis, self.coef = None, None
            if whole is None:
                try:
                    whole = np.asarray([int(x) for x in sizes], dtype=np.int64)
                except OverflowError:     # a request of 2**63 bytes or more
                    whole = np.asarray([min(int(x), SATURATED_REQUEST_BYTES) for x in sizes], dtype=np.int64)
            self.sizes = np.minimum(expand(whole), SATURATED_REQUEST_BYTES)

    def sizes_at(self, b: Any, s: Any, t: Any = 1) -> Any:
        """Every allocation's bytes at batch ``b``, sequence ``s``, target ``t`` (int64)."""
        import numpy as np

        if not self.symbolic:
            return self.sizes
        return _whole_bytes(self.coef @ monomial_values(self.basis, b, s, t))


#: read a plan's copied spans off their sources' arrays (off: every event read; the tests
#: compare the two)
COPY_AWARE_INDEX = True


def _copied_columns(plan: StepPlan) -> Optional[Tuple[Any, ...]]:
    """(kinds, keys, sizes, labels, codes, slots, the event indices of the allocations written
    out, (first source row, first row, count) of each copy's allocations) of a plan with
    copied spans (``StepPlan.copies``): the spans between copies read event by event (in C:
    ``map`` over their columns), each copy from its source's columns and arrays (its keys
    in ``lo``..``hi`` moved in numpy).  None where a span written out has a key that is not
    an int or a kind without a code, or a copy is not what its record says it is in counts
    (then the plan is read event by event)."""
    import numpy as np

    ev = plan.events
    n = len(ev)
    cols = isinstance(ev, EventColumns)
    K: Any = ev.kinds if cols else []
    Y: Any = ev.keys if cols else []
    B: Any = ev.sizes if cols else []
    L: Any = ev.labels if cols else []
    codes = np.empty(n, dtype=np.int8)
    slots = np.empty(n, dtype=np.int64)
    written = np.ones(n, dtype=bool)
    row_copies: List[Tuple[int, int, int]] = []
    pos = 0
    for c in list(plan.copies) + [None]:
        a, b = pos, (n if c is None else c.dst)
        if b < a or (c is not None and (c.src + c.n > c.dst or c.dst + c.n > n)):
            return None
        if b > a:
            if cols:
                kk, yy = K[a:b], Y[a:b]
            else:
                seg = ev[a:b]
                kk, yy = list(map(itemgetter(0), seg)), list(map(itemgetter(1), seg))
                K.extend(kk)
                Y.extend(yy)
                B.extend(map(itemgetter(2), seg))
                L.extend(map(itemgetter(3), seg))
            if not set(map(type, yy)) <= _INT or not set(kk) <= _CODES.keys():
                return None
            codes[a:b] = np.fromiter(map(_CODES.__getitem__, kk), dtype=np.int8, count=b - a)
            slots[a:b] = np.fromiter(yy, dtype=np.int64, count=b - a)
        if c is None:
            break
        s0, d0, m = c.src, c.dst, c.n
        cs = codes[s0:s0 + m]
        ks = slots[s0:s0 + m].copy()
        if int(np.count_nonzero(cs == 0)) != c.hi - c.lo + 1:
            return None
        moves, k0 = cs <= 1, slots[s0:s0 + m]
        for lo, hi, shift in ((c.lo, c.hi, c.shift),) + c.ranges:     # the first range a key is in
            hit = moves & (k0 >= lo) & (k0 <= hi)
            ks[hit] += shift
            moves &= ~hit
        if c.step is not None:
            ks[cs == 2] = c.step
        codes[d0:d0 + m] = cs
        slots[d0:d0 + m] = ks
        written[d0:d0 + m] = False
        if not cols:
            K.extend(K[s0:s0 + m])
            Y.extend(ks.tolist())
            B.extend(B[s0:s0 + m])
            L.extend(map(itemgetter(3), ev[d0:d0 + m]) if c.own_labels else L[s0:s0 + m])
        row_copies.append((c.lo - 1, c.lo - 1 + c.shift, c.hi - c.lo + 1))
        pos = d0 + m
    lit_events = np.flatnonzero(written & (codes == 0))
    if len(lit_events) + sum(r[2] for r in row_copies) != int(np.count_nonzero(codes == 0)):
        return None
    if not cols:
        K, Y, B, L = tuple(K), tuple(Y), tuple(B), tuple(L)
    return K, Y, B, L, codes, slots, lit_events, row_copies


def rounded(sizes: Any, cfg: AllocatorConfig) -> Any:
    """``round_size`` of every size (numpy int64)."""
    import numpy as np

    if not (cfg.roundup_power2_divisions or cfg.roundup_power2_intervals):
        return np.maximum(512, (sizes + 511) // 512 * 512)
    uniq, inv = np.unique(sizes, return_inverse=True)
    return np.asarray([round_size(int(x), cfg) for x in uniq], dtype=np.int64)[inv].reshape(np.shape(sizes))


@dataclass
class Totals:
    """The allocated bytes of one plan at one size: each phase's peak and where it is."""

    phases_bytes: Dict[str, int]
    #: the event index at which each phase's peak is reached
    phase_events: Dict[str, int]
    peak_phase: str
    peak_allocated_bytes: int
    rounded_bytes: Any       # every allocation's rounded bytes, by allocation row
    requested_bytes: Any     # the same as requested


def _phase_ranges(ix: PlanIndex) -> Dict[str, List[Tuple[int, int]]]:
    """The event ranges each reported phase's peak is taken over (the level when a phase
    starts counts: ``reset_peak_memory_stats`` sets the peak to it, so each range starts one
    event early).  A step of several micro-batches runs forward and backward once per
    micro-batch."""
    n = len(ix.rows)
    spans: Dict[Tuple[str, int], List[Tuple[int, int]]] = {}
    marks = ix.marks
    for j, (phase, step, start) in enumerate(marks):
        end = marks[j + 1][2] if j + 1 < len(marks) else n
        spans.setdefault((phase, step), []).append((max(start - 1, 0), end))
    inputs_at = next(i for p, st, i in marks if p == "inputs")
    steps = ix.plan.steps
    out = {"load": [(0, inputs_at)]}
    for phase in STEADY_PHASES:
        out[phase] = [r for st in range(2, steps + 1) for r in spans[(phase, st)]] or spans[(phase, 1)]
    out["first_step"] = [(spans[("forward", 1)][0][0], spans[("zero_grad", 1)][-1][1])]
    return out


def _levels(ix: PlanIndex) -> Dict[str, int]:
    """The events whose level is a phase's own figure: after the load (before the inputs) and
    between steps 2 and 3 (after zero_grad)."""
    marks = ix.marks
    inputs_at = next(i for p, st, i in marks if p == "inputs")
    steps = ix.plan.steps
    ends = [i for p, st, i in marks if p == "zero_grad" and st == min(2, steps)]
    nxt = [i for p, st, i in marks if i > ends[-1]]
    end2 = (min(nxt) if nxt else len(ix.rows)) - 1
    # the step's end: the last event before the next step's first mark (step_end included)
    return {"after_load": max(inputs_at - 1, 0), "persistent": end2}


def totals(ix: PlanIndex, cfg: AllocatorConfig, b: Any, s: Any, t: Any = 1) -> Totals:
    """The plan's phases at one size: ``after_load`` (before the inputs), ``load`` (its peak),
    the steady ``forward``, ``backward``, ``optimizer_step`` (the largest over steps 2 and
    on), ``first_step`` (step 1, when the states are made), ``persistent`` (between steps
    2 and 3) and the peak of the step (the largest of the steady phases and the first step)."""
    import numpy as np

    req = ix.sizes_at(b, s, t)
    rb = rounded(req, cfg)
    live = np.cumsum(ix.signs * rb[ix.rows])
    out: Dict[str, int] = {}
    where: Dict[str, int] = {}
    for name, ranges in _phase_ranges(ix).items():
        best, at = -1, 0
        for lo, hi in ranges:
            if hi > lo:
                k = lo + int(np.argmax(live[lo:hi]))
                if live[k] > best:
                    best, at = int(live[k]), k
        out[name], where[name] = max(best, 0), at
    for name, at in _levels(ix).items():
        out[name], where[name] = int(live[at]) if len(live) else 0, at
    peak_phase = max(PEAK_PHASES, key=lambda p: (out[p], -PEAK_PHASES.index(p)))
    return Totals(out, where, peak_phase, out[peak_phase], rb, req)


def grid_totals(ix: PlanIndex, cfg: AllocatorConfig, b: Any, s: Any, t: Any = 1, chunk: int = 256) -> Dict[str, Any]:
    """:func:`totals` at every cell of arrays ``b``, ``s`` (and ``t``) of one shape: each
    phase's bytes and ``peak_allocated_bytes`` as arrays of that shape (the same integer
    figures as :func:`totals`, cell by cell).

    How, without a cumulative sum over every event at every cell: a plan has few distinct
    size polynomials (a block's tensors repeat layer after layer), so the live bytes after
    event ``e`` are ``const[e] + sum_d count[e, d] x rounded_d(cell)``, with ``count[e, d]``
    the live allocations of the ``d``-th size that varies, ``const[e]`` the live rounded
    bytes of those that do not; and a range's largest level is reached after an allocation
    that the next event does not extend (a later allocation adds, a free removes, a mark
    changes nothing), or at the range's ends.  Cells with equal monomials (equal tokens
    b x s where no size depends on b x s^2) are computed once."""
    import numpy as np

    b, s, t = np.broadcast_arrays(np.asarray(b, dtype=float), np.asarray(s, dtype=float), np.asarray(t, dtype=float))
    shape = b.shape
    ranges = _phase_ranges(ix)
    levels = _levels(ix)
    names = list(ranges) + list(levels)
    mono = monomial_values(ix.basis, b.ravel(), s.ravel(), t.ravel()) if ix.symbolic else np.zeros((1, b.size))
    first, inverse = _distinct_rows(np.ascontiguousarray(mono.T).view(np.int64))
    cells = mono.T[first]
    parts = _grid_parts(ix, cfg, ranges, levels)
    K, const, count = parts["at"], parts["const"], parts["count"]
    # each figure's candidate events: a range phase's, over all its ranges, each distinct
    # (const, count) row once (steps 2 and 3 repeat each other, a block's events repeat at
    # every layer with the same live tensors: Llama 3.1 8B LoRA with full checkpointing,
    # 16,274 events read at every cell, 6,699 distinct rows); a level's one event
    rows: Dict[str, Tuple[Any, Any]] = {}
    for name, rs in ranges.items():
        idx = [np.arange(np.searchsorted(K, lo), np.searchsorted(K, hi)) for lo, hi in rs if hi > lo]
        idx = np.concatenate(idx) if idx else np.zeros(0, dtype=np.int64)
        idx = idx[_distinct_rows(np.column_stack([const[idx], count[idx]]))[0]]
        rows[name] = (const[idx], count[idx])
    for name, at in levels.items():
        j = np.searchsorted(K, at)
        rows[name] = (const[j:j + 1], count[j:j + 1])
    G = len(cells)
    out = {k: np.zeros(G, dtype=np.int64) for k in names}
    for c0 in range(0, G, chunk):
        sl = slice(c0, min(G, c0 + chunk))
        var = rounded(_whole_bytes(parts["coef"] @ cells[sl].T), cfg) if len(parts["coef"]) else None
        for name, (c, n) in rows.items():
            if not len(c):
                continue            # no event in the phase's ranges: 0
            best = _largest_level(c, n, var, sl.stop - sl.start)
            out[name][sl] = np.maximum(best, 0) if name in ranges else best
    peak = np.max(np.stack([out[p] for p in PEAK_PHASES]), axis=0)
    res = {k: v[inverse].reshape(shape) for k, v in out.items()}
    res["peak_allocated_bytes"] = peak[inverse].reshape(shape)
    return res


def _grid_parts(ix: PlanIndex, cfg: AllocatorConfig, ranges: Dict[str, List[Tuple[int, int]]],
                levels: Dict[str, int]) -> Dict[str, Any]:
    """What :func:`grid_totals` reads of a plan, whatever the cells: the events where a level
    can be a range's largest or is read (``at``, sorted), the live rounded bytes of the sizes
    that do not vary there (``const``), the live count of each size that varies (``count``)
    and those sizes' coefficients (``coef``)."""
    import numpy as np

    n = len(ix.rows)
    signs = ix.signs
    nxt = np.append(signs[1:], 0)
    keep = (signs == 1) & (nxt != 1)
    for rs in ranges.values():
        for lo, hi in rs:
            if hi > lo:
                keep[lo] = keep[hi - 1] = True
    for at in levels.values():
        if n:
            keep[at] = True
    at = np.flatnonzero(keep)
    coef = ix.coef if ix.symbolic else ix.sizes.astype(float).reshape(-1, 1)
    if len(coef) == 0:
        coef = np.zeros((0, max(1, len(ix.basis or ()))))
    first, which = _distinct_rows(np.ascontiguousarray(coef, dtype=float).view(np.int64))
    distinct = coef[first]
    varies = (distinct[:, 1:] != 0).any(axis=1) if distinct.shape[1] > 1 else np.zeros(len(distinct), dtype=bool)
    fixed_bytes = np.zeros(len(distinct), dtype=np.int64)
    if (~varies).any():
        fixed_bytes[~varies] = rounded(_whole_bytes(distinct[~varies, 0]), cfg)
    col = np.full(len(distinct), -1, dtype=np.int64)
    col[varies] = np.arange(int(varies.sum()))
    row_col = col[which]                  # the varying size of each allocation row, -1: fixed
    ev_col = row_col[ix.rows] if len(row_col) else np.zeros(n, dtype=np.int64)
    ev_fixed = signs * (fixed_bytes[which][ix.rows] if len(which) else 0)
    const = np.cumsum(np.where(ev_col < 0, ev_fixed, 0))[at]
    count = np.zeros((n, int(varies.sum())), dtype=np.int64)
    moving = np.flatnonzero((ev_col >= 0) & (signs != 0))
    count[moving, ev_col[moving]] = signs[moving]
    count = np.cumsum(count, axis=0)[at]
    return {"at": at, "const": const, "count": count, "coef": distinct[varies]}


#: the most bytes one request of a plan is given (1 PiB + 1 TiB; PlanIndex.sizes, sizes_at): any
#: request above inputs.MAX_BYTES (1 PiB) makes its setup an input error (the estimate
#: checks its total against that bound), so a larger one is cut to this and the int64 sums
#: of up to 8,184 live requests stay exact (uncut, a batch of 2**40 sequences overflowed
#: int64: numpy's "invalid value encountered in cast" and wrapped totals)
SATURATED_REQUEST_BYTES = 2 ** 50 + 2 ** 40


def _whole_bytes(v: Any) -> Any:
    """The builder's own arithmetic, int() of a float: exact products round to themselves
    (each cut to :data:`SATURATED_REQUEST_BYTES`)."""
    import numpy as np

    v = np.minimum(v, float(SATURATED_REQUEST_BYTES))
    r = np.rint(v)
    return np.where(np.abs(v - r) <= 1e-9 * np.maximum(1.0, np.abs(v)), r, np.floor(v)).astype(np.int64)


def whole_bytes(x: float) -> int:
    """One size's bytes as :meth:`PlanIndex.sizes_at` makes them (``_whole_bytes``), for a
    plan rewritten size by size (``per_gpu.per_gpu_plan`` of a constant :class:`Size`)."""
    return int(_whole_bytes(float(x)))


#: odd multipliers of :func:`_distinct_rows`' row hash (any fixed ones do: equal rows are checked)
_ROW_HASH = (0x9E3779B97F4A7C15 - 2 ** 64, 0xC2B2AE3D27D4EB4F - 2 ** 64, 0x165667B19E3779F9, 0x27D4EB2F165667C5)


def _distinct_rows(m: Any) -> Tuple[Any, Any]:
    """(one row index per distinct row of the int64 matrix ``m``, each row's position among
    them), as ``np.unique(m, axis=0, return_index=True, return_inverse=True)`` gives, but by
    a hash of each row (a one-dimensional unique, several times faster), checked: where two
    different rows share a hash, the exact ``np.unique`` is used."""
    import numpy as np

    if not len(m):
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    w = np.asarray([_ROW_HASH[j % len(_ROW_HASH)] + 2 * j for j in range(m.shape[1])], dtype=np.int64)
    with np.errstate(over="ignore"):
        h = (m * w).sum(axis=1) if m.shape[1] > 1 else m[:, 0]     # wraps modulo 2**64
    _, first, inv = np.unique(h, return_index=True, return_inverse=True)
    inv = np.asarray(inv).reshape(-1)
    if not (m[first][inv] == m).all():
        _, first, inv = np.unique(m, axis=0, return_index=True, return_inverse=True)
        inv = np.asarray(inv).reshape(-1)
    return first, inv


def _largest_level(const: Any, count: Any, var: Any, ncells: int) -> Any:
    """The largest of the levels ``const[e] + count[e] . var[:, cell]`` over the rows ``e``,
    at each cell (int64): in floating point where every partial sum is below 2**52 (counts
    and sizes are >= 0, so no partial sum exceeds the largest level: exact), else in int64."""
    import numpy as np

    if var is None or not count.shape[1]:
        return np.full(ncells, int(const.max()), dtype=np.int64)
    bound = float(count.max(axis=0) @ var.max(axis=1)) + float(np.abs(const).max(initial=0))
    if bound < 2.0 ** 52:
        # one product: [const | count] @ [1 ; var] (no pass over the rows x cells to add const)
        both = np.column_stack([const, count]).astype(float)
        lv = both @ np.vstack([np.ones((1, var.shape[1])), var.astype(float)])
        return np.rint(lv.max(axis=0)).astype(np.int64)
    return (const[:, None] + count @ var).max(axis=0)


def gradient_events(ix: PlanIndex) -> Any:
    """The event indices of the plan's gradient allocations, in order (kept on the index)."""
    import numpy as np

    if ix.gradient_at is None:
        info, keys = ix.plan.info, ix.columns[1]
        made = np.flatnonzero(ix.signs == 1)
        ix.gradient_at = made[np.fromiter((info[keys[j]].component == "gradients" for j in made.tolist()),
                                          dtype=bool, count=len(made))]
    return ix.gradient_at


def row_infos(ix: PlanIndex) -> Tuple[Any, List[Any], Any]:
    """(each allocation row's tensor description as an index into the list of distinct
    descriptions (one object per description: ``PlanBuilder``'s ``_infos``), that list,
    whether the row was made in the load: before the first ``input_ids``); computed once
    per plan, for what reads a share per description (``per_gpu.floor_bytes``)."""
    import numpy as np

    got = ix.info_rows
    if got is None:
        infos = list(map(ix.plan.info.__getitem__, ix.keys))
        ids = list(map(id, infos))
        by_id = dict(zip(ids, infos))           # each distinct object, in first-seen order
        g_of = {k: g for g, k in enumerate(by_id)}
        distinct: List[Any] = list(by_id.values())
        gid = np.fromiter(map(g_of.__getitem__, ids), dtype=np.int64, count=len(ids))
        load_end = len(ix.plan.events)
        inputs = [g for g, i in enumerate(distinct) if i.name == "input_ids"]
        if inputs:           # the first row made as an input_ids
            load_end = int(ix.alloc_at[int(np.flatnonzero(np.isin(gid, inputs))[0])])
        got = ix.info_rows = (gid, distinct, ix.alloc_at < load_end)
    return got


def live_rows(ix: PlanIndex, at: int) -> Any:
    """The allocation rows live just after event ``at``."""
    import numpy as np

    return np.nonzero((ix.alloc_at <= at) & (ix.free_at > at))[0]


def tree(ix: PlanIndex, tot: Totals, at: int) -> List[Node]:
    """The tensors live just after event ``at``: component > module group > tensor (the same
    name summed over layers, with how many there are), each at its requested bytes; what
    the allocator's rounding adds is its own box, so that the tree sums to the total.  A
    tensor's formula and dtype are those of its first live allocation."""
    import numpy as np

    info = ix.plan.info
    gid, keys = tree_keys(ix)
    rows = live_rows(ix, at)
    req = np.asarray(tot.requested_bytes)[rows].astype(np.int64)
    rounding = int((np.asarray(tot.rounded_bytes)[rows].astype(np.int64) - req).sum())
    live_gid = gid[rows]
    uniq, first, inv = np.unique(live_gid, return_index=True, return_inverse=True)
    sums = np.zeros(len(uniq), dtype=np.int64)
    np.add.at(sums, np.asarray(inv).reshape(-1), req)
    counts = np.bincount(np.asarray(inv).reshape(-1), minlength=len(uniq))
    comps: Dict[str, Node] = {}
    for j in np.argsort(first, kind="stable"):          # in the order of first appearance
        comp, group, name = keys[int(uniq[j])]
        i: TensorInfo = info[ix.keys[int(rows[first[j]])]]
        nbytes, count, formula = int(sums[j]), int(counts[j]), i.formula
        c = comps.get(comp)
        if c is None:
            c = comps[comp] = Node(comp)
        gnode = next((x for x in c.children if x.name == group), None)
        if gnode is None:
            gnode = c.add(Node(group))
        gnode.add(Node(name, bytes=float(nbytes), dtype=i.dtype or None,
                       formula=(f"{count} x {formula}" if count > 1 and formula else formula)))
    if rounding:
        comps["allocator rounding"] = Node("allocator rounding", bytes=float(rounding),
                                           formula="each request rounded up to a multiple of 512 B (round_size)")
    order = {k: j for j, k in enumerate(COMPONENT_KINDS)}
    out = [n.finalize() for n in sorted(comps.values(), key=lambda n: order.get(n.name, 99))]
    return [n for n in out if n.bytes > 0]


def tree_keys(ix: PlanIndex) -> Tuple[Any, List[Tuple[str, str, str]]]:
    """Each allocation row's box in the trees, (component, module group, name), as an index
    into the list of distinct boxes; computed once per plan."""
    import numpy as np

    got = ix.tree_boxes
    if got is None:
        info = ix.plan.info
        index: Dict[Tuple[str, str, str], int] = {}
        by_info: Dict[int, int] = {}
        gid = np.empty(len(ix.keys), dtype=np.int64)
        for row, key in enumerate(ix.keys):
            i = info[key]
            g = by_info.get(id(i))
            if g is None:
                g = by_info[id(i)] = index.setdefault((i.component, i.group or i.component, i.name), len(index))
            gid[row] = g
        got = ix.tree_boxes = (gid, list(index))
    return got


#: the event kinds as the compiled replay's codes (allocator/creplay.c, ``replay_program``)
_CODES = {"alloc": 0, "free": 1, "step_end": 2, "reset_peak": 3, "empty_cache": 4}


def program_at(ix: PlanIndex, b: Any, s: Any, t: Any = 1) -> Any:
    """The plan's events at one size as the compiled replay reads them (``caching.
    compiled_program``): (codes int8, slots int64, sizes int64, labels), the same stream as
    :func:`events_at` without a Python tuple per event; None where an event's kind is not one
    of ``_CODES`` or its key not an int (then the events go through ``allocator.replay``).  The codes and slots
    (the allocation's key, a step end's step) are made once per plan; an allocation's bytes
    are those of ``events_at`` (``sizes_at``: whole bytes)."""
    import numpy as np

    got = ix.program
    if got is None:
        _kinds, _keys, _third, labels, made = ix.columns
        got = ix.program = (ix.codes, ix.slots, made, labels) if ix.codes is not None else False
    if got is False:
        return None
    codes, slots, made, labels = got
    sizes = np.zeros(len(codes), dtype=np.int64)
    sizes[made] = ix.sizes_at(b, s, t)
    return codes, slots, sizes, labels


def events_at(ix: PlanIndex, b: Any, s: Any, t: Any = 1) -> List[Event]:
    """The plan's allocator events with sizes at one size (what ``allocator.replay`` reads)."""
    import numpy as np

    if not ix.symbolic:
        return ix.plan.events
    kinds, keys, third, labels, made = ix.columns
    col = np.array(third, dtype=object)
    col[made] = ix.sizes_at(b, s, t).tolist()
    return list(zip(kinds, keys, col.tolist(), labels))
