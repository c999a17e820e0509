"""What an estimate returns: a tree of memory components and per-phase totals.

The tree is component > module group > tensor.  Every node carries bytes and the
formula (in words a person can check) that produced it; a parent's bytes are the sum
of its children's.  Nothing here imports pandas, altair or torch at module level.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from .allocator.caching import DEFAULT_RESERVED_PER_ALLOCATED
from .node import Node
from .result_views import EstimateViews, StepTimeViews

#: the top-level components, in drawing order, with the colour each gets in charts
COMPONENT_KINDS: Tuple[str, ...] = (
    "weights",
    "quantization constants",
    "adapters",
    "gradients",
    "optimizer states",
    "activations",
    "logits and loss",
    "optimizer temporaries",
    "kv cache",
    "logits",
    "workspace",
    "cuda context",
    "allocator reserve",
)


def _no_gpu_context_source() -> str:
    from .gpus import NO_GPU_CONTEXT_SOURCE

    return NO_GPU_CONTEXT_SOURCE


#: the phases of one training step, in time order
PHASES: Tuple[str, ...] = ("after_load", "forward", "backward", "optimizer_step")


@dataclass
class EstimateSources:
    """Where an :class:`Estimate`'s lazily computed figures come from: set by the estimator
    that builds it (``estimate.py``, ``parallel/estimate.py``, ``inference/estimate.py``) and read by the
    estimate, :func:`vramwidget.gpus.judge_on` and the timing model.  Every field may be None
    (that figure is then not available)."""

    #: () -> the step's work for the step time (``timing.step_work``)
    work: Optional[Callable[[], Any]] = None
    #: the setup object the work is of (a ``TrainingSetup``; a GPU's slice in a parallel run)
    setup: Any = None
    #: (capacity_bytes=None, record=False) -> the caching-allocator replay (``allocator.ReplayResult``)
    replay: Optional[Callable[..., Any]] = None
    #: () -> (reserved bytes, exact) without running a replay (``replays.provisional_reserved_bytes``)
    provisional: Optional[Callable[[], Tuple[float, bool]]] = None
    #: (reserved bytes, exact=True) -> the peak's components with that allocator reserve, for
    #: builders that leave ``components`` to it
    components_at: Optional[Callable[..., List[Node]]] = None
    #: (architecture, setup key): what the replay runs (``gpus.judge_on`` caches capacity replays by it)
    replay_key: Any = None
    #: (replay with a capacity) -> the reserve it implies for this step (``replays.reserved_of``)
    reserved_from_replay: Optional[Callable[[Any], float]] = None
    #: (gpu, StepTime) -> the step's communication (``timing.communication``; estimate_parallel)
    communication: Optional[Callable[[Any, Any], Dict[str, Any]]] = None
    #: the sizes a parallel GPU's communication moves (``parallel._comm_sizes``)
    communication_sizes: Any = None
    #: (architecture, InferenceSetup) resolved for an inference estimate (``longest_context``, validate)
    inference: Any = None


class Estimate(StepTimeViews, EstimateViews):
    """The memory of one training step on one GPU.

    Attributes
    ----------
    components:
        What is live at the peak, a list of top-level :class:`Node` s (weights,
        gradients, optimizer states, activations, ...), each a tree.  Built on first
        access (a sweep that reads only totals never builds the trees).
    phases_bytes:
        Allocated bytes at each phase's own peak: ``after_load``, ``forward``,
        ``backward``, ``optimizer_step``, plus ``first_step`` (step 1, when optimizer
        states are created lazily) and ``persistent`` (between steps).
    phase_components:
        The same trees for every phase (``after_load``, ``forward``, ``backward``,
        ``optimizer_step``).
    peak_phase:
        The phase that holds the peak (``forward``, ``backward`` or ``optimizer_step``).
    """

    def __init__(self, model_name: str, setup: Dict[str, Any], params_total: Optional[int],
                 params_trainable: Optional[int], components: Optional[List[Node]],
                 phases_bytes: Dict[str, float], peak_phase: str, peak_allocated_bytes: float,
                 reserved_bytes: "float | Callable[[], float]", cuda_context_bytes: float, flops_per_step: Optional[float] = None,
                 recompute_overhead: float = 0.0, notes: Optional[List[str]] = None,
                 phase_components: Optional[Dict[str, List[Node]]] = None,
                 builder: Optional[Callable[[], Tuple[List[Node], Dict[str, List[Node]]]]] = None,
                 backend: str = "analytic", cuda_context_source: Optional[str] = None,
                 sources: Optional[EstimateSources] = None):
        self.model_name = model_name
        #: how it was computed: "analytic" (the modelled families) or "trace" (a traced step)
        self.backend = backend
        self.setup = setup
        self.params_total = params_total
        self.params_trainable = params_trainable
        self.phases_bytes = phases_bytes
        self.peak_phase = peak_phase
        self.peak_allocated_bytes = peak_allocated_bytes
        self._reserved: Optional[float] = None
        self._reserved_fn: Optional[Callable[[], float]] = None
        #: the reserve on the chosen card (gpus.judge_on), once judged or given
        self._on_card: Optional[float] = None
        self.reserved_bytes = reserved_bytes  # type: ignore[assignment]
        #: whether the reserve on a chosen card is judged with the allocator's free-and-retry at
        #: its limit (gpus.judge_on: a replay with the card's capacity); a training step's is
        self.capacity_judged = False
        #: one line when the reserve on the card differs from the unlimited one (gpus.judge_on)
        self.allocator_note = ""
        #: gpus.judge_on's answer behind ``reserved_bytes`` on the chosen card
        self._judged: Optional[Dict[str, Any]] = None
        #: where the lazily computed figures come from (the replay, the step work, ...)
        self.sources = sources if sources is not None else EstimateSources()
        #: the CUDA context the device total counts: the chosen card's own (``set_gpu``:
        #: :func:`vramwidget.gpus.context_for`), the H200 measurement while no GPU is chosen
        self.cuda_context_bytes = cuda_context_bytes
        #: where ``cuda_context_bytes`` comes from
        self.cuda_context_source = cuda_context_source or _no_gpu_context_source()
        #: every context this estimate has counted (as built, then each set_gpu): the
        #: "cuda context" boxes holding one of them follow ``cuda_context_bytes``
        self._contexts_counted = {float(cuda_context_bytes)}
        self.flops_per_step = flops_per_step
        self.recompute_overhead = recompute_overhead
        self.notes = list(notes or [])
        self._components = components
        self._phase_components = phase_components if phase_components is not None else (
            None if builder else {})
        self._builder = builder
        # the step time (timing.py): set_gpu() picks the GPU; the work is computed lazily
        self.gpu: Any = None
        self.gpus: int = 1                       # GPUs the run uses (estimate_parallel sets it)
        self.tokens_per_step: Optional[int] = None   # all replicas' tokens per step (estimate_parallel)
        self._step_time: Any = None

    def _build(self) -> None:
        if self._builder is not None:
            comps, self._phase_components = self._builder()
            self._builder = None
            if comps is not None:
                self._components = comps

    @property
    def components(self) -> List[Node]:
        if self._components is None:
            self._build()
            if self._components is None and self.sources.components_at is not None:
                self._components = self.sources.components_at(self.reserved_bytes)
                if self.allocator_note:
                    self._components = [Node(n.name, bytes=n.bytes, formula=f"{n.formula}; {self.allocator_note}")
                                        if n.name == "allocator reserve" and not n.children else n
                                        for n in self._components]
        return self._context_now(self._components) if self._components is not None else []

    def _context_now(self, nodes: List[Node]) -> List[Node]:
        """``nodes`` with their "cuda context" box at the context this estimate counts now
        (``set_gpu`` may have changed it since the list was built)."""
        for i, n in enumerate(nodes):
            if n.name == "cuda context" and not n.children and float(n.bytes) in self._contexts_counted and (
                    n.bytes != self.cuda_context_bytes or n.formula != self.cuda_context_source):
                nodes[i] = Node("cuda context", bytes=self.cuda_context_bytes, formula=self.cuda_context_source)
        return nodes

    @property
    def provisional_components(self) -> List[Node]:
        """``components`` without running a replay: the allocator reserve at
        ``provisional_reserved_bytes`` (its formula says so) until ``reserved_exact``; then
        the very list ``components`` gives."""
        if self._components is not None or self.sources.components_at is None or self.reserved_exact:
            return self.components
        if self._phase_components is None:
            self._build()
        return self._context_now(self.sources.components_at(self.provisional_reserved_bytes, False))

    @property
    def phase_components(self) -> Dict[str, List[Node]]:
        if self._phase_components is None:
            self._build()
        return self._phase_components if self._phase_components is not None else {}

    def relabelled(self, setup: Dict[str, Any], params_total: Optional[int]) -> "Estimate":
        """A copy of this estimate naming another setup and parameter count (``parallel/estimate.py``:
        a GPU's estimate names the whole model's); its figures are this one's, its reserve and
        components read from this one when first asked for."""
        est = Estimate(model_name=self.model_name, setup=setup, params_total=params_total,
                       params_trainable=self.params_trainable, components=self._components,
                       phases_bytes=dict(self.phases_bytes), peak_phase=self.peak_phase,
                       peak_allocated_bytes=self.peak_allocated_bytes,
                       reserved_bytes=self.reserved_bytes if self.reserved_exact else (lambda: self.reserved_bytes),
                       cuda_context_bytes=self.cuda_context_bytes, cuda_context_source=self.cuda_context_source,
                       flops_per_step=self.flops_per_step, recompute_overhead=self.recompute_overhead,
                       notes=list(self.notes), phase_components=self.phase_components)
        est.sources.provisional = self.sources.provisional
        if est._components is None:    # composed with the reserve when first read (no replay before)
            est.sources.components_at = self.sources.components_at
        return est

    def provisional_view(self) -> "Estimate":
        """A shallow copy drawn with the provisional figures (``provisional_components`` and
        ``provisional_reserved_bytes``; ``provisional`` True) while the exact replay runs
        elsewhere (the widget's background worker)."""
        import copy

        components = self.provisional_components
        view = copy.copy(self)
        view._components = components
        view.reserved_bytes = self.provisional_reserved_bytes
        view.provisional = True
        return view

    # -- time -----------------------------------------------------------------------
    def set_gpu(self, gpu: Any) -> "Estimate":
        """Put the estimate on ``gpu`` (a catalogue name or GPU; None: no GPU): the step is
        timed there, and the device total and the "cuda context" box count that card's own
        CUDA context (:func:`vramwidget.gpus.context_for`: by generation, with its source;
        without a GPU the H200 measurement).  Returns self."""
        from .gpus import context_for, get_gpu

        before = self.gpu
        self.gpu = get_gpu(gpu) if gpu is not None else None
        self.cuda_context_bytes, self.cuda_context_source = context_for(self.gpu)
        if self.capacity_judged and self.gpu != before:     # judged again on the new card (gpus.judge_on)
            self._on_card, self.allocator_note, self._judged = None, "", None
            if self.sources.components_at is not None:
                self._components = None
        self._contexts_counted.add(float(self.cuda_context_bytes))
        self._step_time = None
        self._note_capability()
        return self

    def _note_capability(self) -> None:
        """A warning naming the card when it lacks the math the setup's precision needs (the
        catalogue's ``bf16`` / ``fp8``: a T4 has no bf16), replaced when the card changes."""
        old = getattr(self, "_gpu_note", "")
        if old in self.notes:
            self.notes.remove(old)
        precision = (self.setup or {}).get("precision") if isinstance(self.setup, dict) else None
        note = ""
        if self.gpu is not None and isinstance(precision, str):
            ok, why = self.gpu.supports(precision)
            note = "" if ok else f"warning: {why} (precision {precision!r})"
        if note and note not in self.notes:
            self.notes.insert(0, note)
        self._gpu_note = note

    # -- totals -------------------------------------------------------------------
    @property
    def unlimited_reserved_bytes(self) -> float:
        """``max_memory_reserved()`` without a card's limit: what the caching allocator holds at
        most (a replay of its placement rules over this step's allocations, run on first
        access; safe to read from a background thread while another reads it: the replay runs
        once)."""
        r = self._reserved
        if r is None:
            fn = self._reserved_fn
            if fn is None:      # another thread finished it meanwhile (it sets _reserved first)
                r = self._reserved
                return r if r is not None else 0.0
            r = self._reserved = float(fn())
            self._reserved_fn = None
        return r

    @property
    def unlimited_reserved_exact(self) -> bool:
        """Whether ``unlimited_reserved_bytes`` is known without running a replay.  Does no work."""
        if self._reserved is not None or self._reserved_fn is None:
            return True
        fn = self.sources.provisional
        return bool(fn()[1]) if fn is not None else False

    def _judged_here(self) -> bool:
        return self.capacity_judged and self.gpu is not None and self.sources.replay is not None

    @property
    def reserved_bytes(self) -> float:
        """``max_memory_reserved()`` on the chosen card: ``unlimited_reserved_bytes``, except
        for a training step whose unlimited reserve is over the card while its allocated peak
        is not; then the reserve of a replay with the card's capacity, where the allocator
        frees its cached blocks and retries before an out-of-memory error (``gpus.judge_on``,
        the one rule; ``allocator_note`` says so).  Without a GPU, the unlimited reserve."""
        r = self._on_card
        if r is not None:
            return r
        unlimited = self.unlimited_reserved_bytes
        if not self._judged_here():
            return unlimited
        from .gpus import judge_on

        judged = judge_on(self, self.gpu)
        self._judged = judged
        self.allocator_note = judged["note"]
        r = self._on_card = float(judged["reserved_bytes"])
        return r

    @property
    def squeezed(self) -> bool:
        """Whether this step fits its card only because the allocator frees its cached blocks
        at the card's limit (``gpus.judge_on``; the verdict is tight at best)."""
        if not self._judged_here():
            return False
        from .gpus import judge_on

        self.reserved_bytes
        return bool(judge_on(self, self.gpu)["squeezed"])

    @property
    def reserved_exact(self) -> bool:
        """Whether ``reserved_bytes`` is known without running a replay (already computed,
        or its replays are cached).  Does no work."""
        if self._on_card is not None:
            return True
        if not self.unlimited_reserved_exact:
            return False
        if not self._judged_here():
            return True
        from .gpus import judge_on

        # runs no replay: provisional where the capacity replay is needed and not cached yet
        return not judge_on(self, self.gpu, replay=False)["provisional"]

    @property
    def provisional_reserved_bytes(self) -> float:
        """``reserved_bytes`` when it is known (``reserved_exact``); the unlimited reserve when
        only the replay with the card's capacity is still to run (the larger figure); else the
        allocated peak plus the fragmentation carried over from the nearest cached replay of
        the same setup (``events.provisional_reserved_bytes``: the one place this guess is
        made).  Never runs a replay."""
        if self.reserved_exact:
            return self.reserved_bytes
        if self.unlimited_reserved_exact:
            return self.unlimited_reserved_bytes
        fn = self.sources.provisional
        if fn is not None:
            return float(fn()[0])
        return self.peak_allocated_bytes * DEFAULT_RESERVED_PER_ALLOCATED

    @property
    def provisional_device_total_bytes(self) -> float:
        """``device_total_bytes`` without running a replay: ``provisional_reserved_bytes`` +
        CUDA context (equal to ``device_total_bytes`` when ``reserved_exact``)."""
        return self.provisional_reserved_bytes + self.cuda_context_bytes

    @reserved_bytes.setter
    def reserved_bytes(self, value: "float | Callable[[], float]") -> None:
        """The unlimited reserve, or a function that replays it; a number is also the reserve
        shown on the card (a copy drawn with a provisional figure keeps it)."""
        if callable(value):
            self._reserved, self._reserved_fn, self._on_card = None, value, None
        else:
            self._reserved, self._reserved_fn, self._on_card = float(value), None, float(value)

    @property
    def device_total_bytes(self) -> float:
        """What nvidia-smi would show: allocator reserve + CUDA context."""
        return self.reserved_bytes + self.cuda_context_bytes
