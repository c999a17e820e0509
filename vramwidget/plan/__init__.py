"""The step plan: one description of a training step that every figure reads.

``plan_view(arch, setup)`` gives the setup's plan at its own size: the totals (each phase's
peak), the component trees (the tensors live at each peak), the allocator's events and the
loss of the step.  The plan is built once per setup *shape* (everything but the batch,
sequence and target lengths) with sizes as polynomials (``plan/size.py``), so another size
costs an evaluation, not a build; a setup whose sizes are not polynomials (Liger's
power-of-two chunks, a vision tower traced at one size) is built for its own size.

Where each part of the step is written: ``load.py`` (parameters, quantization, adapters),
``blocks.py`` (each block's forward and backward, checkpointing, autocast copies,
activation offloading), ``loss.py`` (final norm, output head, every loss), ``optimizer.py``
(states and step temporaries of every optimizer), ``step.py`` (the steps, micro-batches,
zero_grad); ``views.py`` reads it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Dict, Iterator, List, Optional, Tuple

from ..allocator.caching import AllocatorConfig, ReplayResult, compiled_program, parse_alloc_conf, replay
from ..allocator.collector import gc_paused
from ..model.architecture import Architecture
from ..result import Node
from ..training import TrainingSetup
from .builder import StepPlan
from .size import NotPolynomial, Size, Step
from .step import STEPS, build_plan, setup_shape
from .views import PlanIndex, Totals, events_at, grid_totals, program_at, totals, tree

__all__ = ["PlanView", "plan_view", "plan_index", "has_plan", "plan_events", "grid_totals", "clear_caches", "replay_index"]

#: the phases a tree is drawn for
TREE_PHASES = ("after_load", "forward", "backward", "optimizer_step", "first_step")
_SIZE_FIELDS = ("batch_size", "seq_len", "target_len")
_LOCK = threading.Lock()
#: the plans built so far, most recently used last (a plan of an 8B model holds ~30,000-50,000
#: events, a 7B full fine-tune's ~14,000: a few MB each).  The cache keeps at most ``_MAX``
#: plans and ``_MAX_EVENTS`` events together (what 48 plans of an 8B model hold), so a search
#: over many setups of a smaller plan (``fit.suggestions``: ~100 shapes) builds each once
_INDEX: "OrderedDict[Tuple[Any, ...], Tuple[Architecture, Optional[PlanIndex]]]" = OrderedDict()
_MAX = 256
_MAX_EVENTS = 2_400_000
_HELD = [0]       # events held by the cached plans


def plan_index(arch: Architecture, s: TrainingSetup) -> Tuple[PlanIndex, bool]:
    """The indexed plan of ``s`` and whether it is symbolic (every size); cached per
    architecture and setup shape (or setup, when built for one size)."""
    key = (id(arch), "shape", setup_shape(s))
    hit = _lookup(key, arch)
    if hit is None:
        # a plan is written with the cyclic collector paused: its tens of thousands of event
        # tuples live only until the index keeps them as columns, and a collection meanwhile
        # would move them to the oldest generation, whose growth sets off full collections
        # (each walking every object of the process: ~0.17 s in a widget's kernel)
        with gc_paused():
            try:
                plan = build_plan(arch, s, Size.var("b"), Size.var("s"),
                                  Size.var("t") if s.target_len is not None else None)
            except NotPolynomial:
                plan = None
            # a shape whose sizes are not polynomials is remembered as such (None): not tried again
            hit = (arch, PlanIndex(plan) if plan is not None else None)
        _store(key, hit)
    if hit[1] is not None and hit[1].symbolic:
        return hit[1], True
    key1 = (id(arch), "size", s)
    one = _lookup(key1, arch)
    if one is None:
        with gc_paused():
            one = (arch, PlanIndex(build_plan(arch, s)))
        _store(key1, one)
    return one[1], False


def has_plan(arch: Architecture, s: TrainingSetup) -> bool:
    """Whether the plan :func:`plan_index` gives for ``s`` is built already (its shape's
    plan for every size, or its own size's): then reading it costs no build."""
    hit = _lookup((id(arch), "shape", setup_shape(s)), arch)
    if hit is None:
        return False
    if hit[1] is not None and hit[1].symbolic:
        return True
    return _lookup((id(arch), "size", s), arch) is not None


def _lookup(key: Tuple[Any, ...], arch: Architecture) -> Optional[Tuple[Architecture, Optional[PlanIndex]]]:
    with _LOCK:
        hit = _INDEX.get(key)
        if hit is None or hit[0] is not arch:
            return None
        _INDEX.move_to_end(key)
        return hit


def _store(key: Tuple[Any, ...], value: Tuple[Architecture, Optional[PlanIndex]]) -> None:
    with _LOCK:
        old = _INDEX.pop(key, None)
        if old is not None:
            _HELD[0] -= _events_of(old[1])
        _INDEX[key] = value
        _HELD[0] += _events_of(value[1])
        while len(_INDEX) > 1 and (len(_INDEX) > _MAX or _HELD[0] > _MAX_EVENTS):
            _, gone = _INDEX.popitem(last=False)
            _HELD[0] -= _events_of(gone[1])


def _events_of(ix: Optional[PlanIndex]) -> int:
    return 0 if ix is None else len(ix.rows)


def clear_caches() -> None:
    """Forget every built plan (benchmarks time cold setups), and the bounds read from the
    plan's own functions (``step.state_floor_bytes``)."""
    from . import step

    with _LOCK:
        _INDEX.clear()
        _HELD[0] = 0
    step.clear_floors()


class _Trees(Mapping):
    """A view's component tree of each phase of ``TREE_PHASES``, built on first read."""

    def __init__(self, view: "PlanView"):
        self._view = view
        self._built: Dict[str, List[Node]] = {}

    def __getitem__(self, phase: str) -> List[Node]:
        got = self._built.get(phase)
        if got is None:
            if phase not in TREE_PHASES:
                raise KeyError(phase)
            v = self._view
            got = self._built[phase] = tree(v.index, v.totals, v.totals.phase_events[phase])
        return got

    def __iter__(self) -> Iterator[str]:
        return iter(TREE_PHASES)

    def __len__(self) -> int:
        return len(TREE_PHASES)


class PlanView:
    """One setup's step plan at its own size."""

    def __init__(self, arch: Architecture, s: TrainingSetup):
        self.arch, self.s = arch, s
        self.index, self.symbolic = plan_index(arch, s)
        self.cfg: AllocatorConfig = parse_alloc_conf(s.allocator)
        self.sizes = (s.batch_size, s.seq_len, s.target_len if s.target_len is not None else 1)
        self._totals: Optional[Totals] = None

    @property
    def totals(self) -> Totals:
        """Each phase's allocated peak at this size (``views.totals``), computed on first read:
        a replay of the view (fit_map's cells, a solver's candidates) does not need it."""
        if self._totals is None:
            self._totals = totals(self.index, self.cfg, *self.sizes)
        return self._totals

    @property
    def plan(self) -> StepPlan:
        return self.index.plan

    def events(self) -> List[Any]:
        """The allocator events at this size (what ``allocator.replay`` reads)."""
        return events_at(self.index, *self.sizes)

    def replay(self, capacity_bytes: Optional[float] = None, record: bool = False) -> ReplayResult:
        """``allocator.replay(self.events(), ...)`` with the setup's allocator settings: by the
        compiled replay from the plan's columns where it runs (``program_at``), else the
        events through the Python replay."""
        return replay_index(self.index, self.cfg, self.sizes, capacity_bytes, record)

    def trees(self) -> Mapping[str, List[Node]]:
        """Every phase's component tree: the tensors live at the phase's peak, each built when
        first read (the widget's update draws the peak's; the other phases' wait)."""
        return _Trees(self)

    def tensors(self, component: Optional[str] = None) -> Dict[str, List[int]]:
        """Every tensor the step makes (of ``component``), by name: the bytes of each one made
        (what a mechanism creates, not only what is live at a peak)."""
        out: Dict[str, List[int]] = {}
        req = self.totals.requested_bytes
        for row, key in enumerate(self.index.keys):
            info = self.plan.info[key]
            if component is None or info.component == component:
                out.setdefault(info.name, []).append(int(req[row]))
        return out

    def stream_key(self) -> Optional[Tuple[Any, ...]]:
        """What decides this size's events: two sizes with equal keys replay the same events
        (a plan whose sizes depend on b x s alone has equal events at equal tokens)."""
        if not self.symbolic:
            return None
        b, sq, t = (float(x) for x in self.sizes)
        # numbers, not numpy: this runs for every replay looked up (the widget's update path)
        return (id(self.index),) + tuple(float(m.values(b, sq, t)) if m.__class__ is Step
                                         else b ** m[0] * sq ** m[1] * t ** m[2] for m in self.index.basis)

    def host_bytes(self) -> float:
        """What the plan keeps in CPU memory (activation offloading's copies)."""
        hb = self.plan.host_bytes
        if isinstance(hb, Size):
            from .size import coefficient_matrix, monomial_values

            basis = list(hb.terms) or [(0, 0, 0)]
            return float((coefficient_matrix([hb], basis) @ monomial_values(basis, *self.sizes))[0])
        return float(hb)


def replay_index(ix: PlanIndex, cfg: AllocatorConfig, sizes: Tuple[Any, ...], capacity_bytes: Optional[float] = None,
                 record: bool = False) -> ReplayResult:
    """``allocator.replay`` of an indexed plan's events at ``sizes`` (batch, sequence,
    target): by the compiled replay from the plan's columns where it runs (``program_at``),
    else the events through the Python replay."""
    if not record:
        res = compiled_program(program_at(ix, *sizes), cfg, capacity_bytes)
        if res is not None:
            return res
    return replay(events_at(ix, *sizes), cfg, capacity_bytes, record)


def plan_view(arch: Architecture, s: TrainingSetup) -> PlanView:
    return PlanView(arch, s)


def plan_events(arch: Architecture, s: TrainingSetup, steps: int = STEPS) -> List[Any]:
    """The allocator events of loading the model and running ``steps`` training steps at the
    setup's own size."""
    if steps == STEPS:
        return plan_view(arch, s).events()
    return build_plan(arch, s, steps=steps).events


def symbolic_plan(arch: Architecture, s: TrainingSetup) -> Optional[PlanIndex]:
    """The setup's plan for every size, or None when it is built for one size alone."""
    ix, sym = plan_index(arch, s)
    return ix if sym else None
