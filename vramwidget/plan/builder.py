"""The recorder a step plan is written with: every tensor, when it is made and when it goes.

A mechanism (the load, a block's forward, the loss, an optimizer's step) calls
:meth:`PlanBuilder.alloc` for each tensor the program creates, with what it is (component,
module group, name, formula, dtype), and :meth:`PlanBuilder.free` when the program drops
it; :meth:`PlanBuilder.mark` says where a phase of the step begins.  The result, a
:class:`StepPlan`, is read by every view: the totals, the component trees, the allocator
replay and the snapshot (``plan/views.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Tuple, Union

from .size import Size

#: one allocator event: ("alloc", key, bytes, label), ("free", key, 0, ""), ("step_end", step, 0, "")
Event = Tuple[str, Any, Any, Any]
#: the kinds of event whose key is an allocation's (what a copy of a span moves)
KEYED_KINDS = frozenset(("alloc", "free"))


class TensorInfo(NamedTuple):
    """What one planned tensor is: the tree it is drawn in and the formula of its bytes."""

    component: str
    group: str
    name: str
    formula: str
    dtype: str


class Copy(NamedTuple):
    """A span of a plan's events written as a copy of an earlier span (a step that repeats
    the one before: ``step._append_copy``, ``per_gpu._copy_step`` and ``_copy_passes``; a
    block that runs the one before's: ``blocks._copy``): event ``dst + i`` is event
    ``src + i`` (the same kind, bytes and label objects) but for its key: an allocation's or
    free's key in ``lo``..``hi`` moves by ``shift`` (the tensors the source span made, made
    again), else by the shift of the first of ``ranges`` ((lo, hi, shift), inclusive) it is
    in (a block's input, made by the block before), and a step end's key is ``step`` where
    it is not None; with ``own_labels`` the copy's labels are its own (the next block's).
    What reads every event (``views.PlanIndex``) reads a copy off the source's arrays
    instead of event by event; ``copies_hold`` checks a plan's copies against its events."""

    dst: int
    src: int
    n: int
    lo: int
    hi: int
    shift: int
    step: Optional[int] = None
    ranges: Tuple[Tuple[int, int, int], ...] = ()
    own_labels: bool = False

    def moved(self, key: Any) -> Any:
        """The copy's key of an allocation's or free's ``key`` in the source."""
        for lo, hi, shift in ((self.lo, self.hi, self.shift),) + self.ranges:
            if lo <= key <= hi:
                return key + shift
        return key


class EventColumns(Sequence):
    """A plan's events kept as four columns (kinds, keys, sizes, labels: tuples), read as the
    list of ``(kind, key, bytes, label)`` events they were (an event, a slice of them as a
    list, iteration in order).  An indexed plan keeps its events so (``StepPlan.keep_columns``):
    one tuple per column instead of one per event, which Python's cyclic garbage collector
    walks object by object while the plan is cached (a symbolic event holds a Size, so its
    tuple is never untracked: 783,465 of them after two suggestions of an 8B QLoRA setup, a
    full collection 0.49 s), and about 70 bytes less per event."""

    __slots__ = ("kinds", "keys", "sizes", "labels")

    def __init__(self, kinds: Tuple[Any, ...], keys: Tuple[Any, ...], sizes: Tuple[Any, ...],
                 labels: Tuple[Any, ...]):
        self.kinds, self.keys, self.sizes, self.labels = kinds, keys, sizes, labels

    def __len__(self) -> int:
        return len(self.kinds)

    def __getitem__(self, i: Union[int, slice]) -> Any:
        if isinstance(i, slice):
            return list(zip(self.kinds[i], self.keys[i], self.sizes[i], self.labels[i]))
        return (self.kinds[i], self.keys[i], self.sizes[i], self.labels[i])

    def __iter__(self) -> Iterator[Event]:
        return zip(self.kinds, self.keys, self.sizes, self.labels)

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, (list, tuple, EventColumns)) and len(other) == len(self) and \
            all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"EventColumns({len(self)} events)"


def event_columns(events: Any) -> Tuple[Tuple[Any, ...], Tuple[Any, ...], Tuple[Any, ...], Tuple[Any, ...]]:
    """(kinds, keys, sizes, labels) of a plan's events: an :class:`EventColumns`' own
    columns, or a list of events split one column at a time (``zip(*events)`` makes an
    iterator per event: 1.7x slower on 137,722 events)."""
    if isinstance(events, EventColumns):
        return events.kinds, events.keys, events.sizes, events.labels
    return tuple(tuple(map(itemgetter(c), events)) for c in range(4))  # type: ignore[return-value]


@dataclass
class StepPlan:
    """Loading a model and running training steps, as the caching allocator sees it.

    ``events``: allocations and frees in program order (sizes are numbers, or
    :class:`~vramwidget.plan.size.Size` polynomials when the plan is built for every size);
    ``info``: key -> :class:`TensorInfo` of each allocation; ``marks``: (phase, step, index
    of the first event of the phase), phases ``forward``, ``backward``, ``optimizer_step``,
    ``zero_grad`` of steps 1, 2, ...; everything before step 1's forward is the load.
    """

    events: List[Event]
    info: Dict[int, TensorInfo]
    marks: List[Tuple[str, int, int]]
    steps: int
    notes: List[str] = field(default_factory=list)
    #: bytes kept off the GPU by the plan's mechanisms (activation offloading to pinned CPU memory)
    host_bytes: Any = 0.0
    #: the steps written as a copy of the step before (the same events, each allocation a new
    #: key: ``step._repeat_step``), which a plan rewritten from this one may copy too
    repeats: Tuple[int, ...] = ()
    #: the steps whose forward and backward passes (the events from the step's first mark to
    #: its optimizer step) are a copy of the step before's (``step._copy_passes``), every
    #: allocation a new key and every free one of the span's own
    passes_copied: Tuple[int, ...] = ()
    #: the spans of events written as copies of earlier spans (:class:`Copy`), by ``dst``
    copies: Tuple[Copy, ...] = ()

    def keep_columns(self, kinds: Tuple[Any, ...], keys: Tuple[Any, ...], sizes: Tuple[Any, ...],
                     labels: Tuple[Any, ...]) -> None:
        """Keep the events as these columns of them (:class:`EventColumns`: the same events,
        read the same way), once the plan is indexed (``views.PlanIndex``)."""
        cols = EventColumns(kinds, keys, sizes, labels)
        if len(cols) != len(self.events):
            raise ValueError(f"{len(cols)} events in the columns, {len(self.events)} in the plan")
        self.events = cols


#: one object per distinct label and tensor description across the plans built (a label
#: tuple such as ("layer", 7, "q_proj") or a TensorInfo recurs in every plan of a model):
#: what a plan keeps is then old objects, not new ones the cyclic collector walks at the end
#: of every search (a tuple made by concatenation is tracked until a collection looks at
#: it; 124,556 label tuples of Llama 2 7B full's suggestions, a 0.17 s collection)
_CANON: Dict[Any, Any] = {}
_MAX_CANON = 400_000


def canonical(x: Any) -> Any:
    """The one object equal to ``x`` that plans share (``x`` itself the first time)."""
    got = _CANON.get(x)
    if got is None:
        if len(_CANON) >= _MAX_CANON:
            _CANON.clear()
        got = _CANON.setdefault(x, x)
    return got


class PlanBuilder:
    """Hands out keys in order and records each tensor's :class:`TensorInfo`."""

    def __init__(self) -> None:
        self.events: List[Event] = []
        self.info: Dict[int, TensorInfo] = {}
        self.marks: List[Tuple[str, int, int]] = []
        self.notes: List[str] = []
        self.host_bytes: Any = 0.0
        #: the steps written as a copy of the step before (``StepPlan.repeats``)
        self.repeats: List[int] = []
        #: the steps whose passes copy the step before's (``StepPlan.passes_copied``)
        self.passes_copied: List[int] = []
        #: the spans written as copies (``StepPlan.copies``)
        self.copies: List[Copy] = []
        #: step -> the index of its first ``step_end`` event
        self.step_ends: Dict[int, int] = {}
        #: key -> bytes of every allocation
        self.sizes: Dict[int, Any] = {}
        #: the last key an allocation got (keys count up from 1; plan/blocks.py copies spans after it)
        self.last_key = 0
        self._infos: Dict[Tuple[str, ...], TensorInfo] = {}   # one object per distinct description

    def alloc(self, nbytes: Any, name: str, component: str, group: str = "", formula: str = "",
              dtype: str = "", label: Any = None) -> Optional[int]:
        """A tensor of ``nbytes`` is made; returns its key (None for an empty tensor).  ``label``:
        what the allocator snapshot calls it (default ``name``)."""
        d = (component, group, name, formula, dtype)
        info = self._infos.get(d)
        if info is None:
            info = self._infos[d] = canonical(TensorInfo(*d))
        return self.alloc_as(nbytes, info, label)

    def alloc_as(self, nbytes: Any, info: TensorInfo, label: Any = None) -> Optional[int]:
        """:meth:`alloc` of a tensor described by ``info`` (a plan rewritten tensor by tensor
        passes the source plan's own: ``plan/per_gpu.py``)."""
        if not nbytes:            # a Size that is zero at every size, or a zero
            return None
        if nbytes.__class__ is not Size:
            if nbytes <= 0:
                return None
            nbytes = int(nbytes)
        n = self.last_key = self.last_key + 1
        if label.__class__ is tuple:
            label = canonical(label)
        self.events.append(("alloc", n, nbytes, info.name if label is None else label))
        # one object per distinct description (a TensorInfo is the tuple it is keyed by)
        self.info[n] = self._infos.setdefault(info, info)
        self.sizes[n] = nbytes
        return n

    def free(self, key: Optional[int]) -> None:
        if key is not None:
            self.events.append(("free", key, 0, ""))

    def mark(self, phase: str, step: int) -> None:
        """``phase`` of ``step`` begins with the next event."""
        self.marks.append((phase, step, len(self.events)))

    def step_end(self, step: int) -> None:
        self.step_ends.setdefault(step, len(self.events))
        self.events.append(("step_end", step, 0, ""))

    def plan(self, steps: int) -> StepPlan:
        return StepPlan(self.events, self.info, self.marks, steps, self.notes, self.host_bytes, tuple(self.repeats),
                        tuple(self.passes_copied), tuple(self.copies))

    def copied(self, src: int, n: int, lo: int, hi: int, shift: int, step: Optional[int] = None,
               ranges: Tuple[Tuple[int, int, int], ...] = (), own_labels: bool = False) -> None:
        """Record that the last ``n`` events appended are a :class:`Copy` of the ``n`` from
        ``src``; none is recorded where the source made no keys in one run ``lo``..``hi``."""
        if n > 0 and lo <= hi:
            self.copies.append(Copy(len(self.events) - n, src, n, lo, hi, shift, step, ranges, own_labels))


def copies_hold(plan: StepPlan) -> bool:
    """Whether every :class:`Copy` of ``plan`` is what its events are (the tests check each
    plan the builder and the GPU writer make; a reader trusts them)."""
    ev = plan.events
    last = 0
    for c in plan.copies:
        if c.src + c.n > c.dst or c.dst < last or c.dst + c.n > len(ev):
            return False
        last = c.dst + c.n
        for (k0, key0, b0, l0), (k1, key1, b1, l1) in zip(ev[c.src:c.src + c.n], ev[c.dst:c.dst + c.n]):
            if k0 != k1 or not (b0 is b1 or (b0.__class__ is not Size and b0 == b1)) \
                    or not (c.own_labels or l0 is l1 or l0 == l1):
                return False
            if k0 in ("alloc", "free"):
                want = c.moved(key0)
            elif k0 == "step_end" and c.step is not None:
                want = c.step
            else:
                want = key0
            if key1 != want:
                return False
    return True
