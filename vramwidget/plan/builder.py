"""The recorder a step plan is written with: every tensor, when it is made and when it goes.

A mechanism (the load, a block's forward, the loss, an optimizer's step) calls
:meth:`PlanBuilder.alloc` for each tensor the program creates, with what it is (component,
module group, name, formula, dtype), and :meth:`PlanBuilder.free` when the program drops
it; :meth:`PlanBuilder.mark` says where a phase of the step begins.  The result, a
:class:`StepPlan`, is read by every view: the totals, the component trees, the allocator
replay and the snapshot (``plan/views.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

from .size import Size

#: one allocator event: ("alloc", key, bytes, label), ("free", key, 0, ""), ("step_end", step, 0, "")
Event = Tuple[str, Any, Any, Any]


class TensorInfo(NamedTuple):
    """What one planned tensor is: the tree it is drawn in and the formula of its bytes."""

    component: str
    group: str
    name: str
    formula: str
    dtype: str


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
        return self.alloc_as(nbytes, TensorInfo(*d) if info is None else info, label)

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
        self.events.append(("step_end", step, 0, ""))

    def plan(self, steps: int) -> StepPlan:
        return StepPlan(self.events, self.info, self.marks, steps, self.notes, self.host_bytes, tuple(self.repeats),
                        tuple(self.passes_copied))
