"""What an estimate returns: a tree of memory components and per-phase totals.

The tree is component > module group > tensor.  Every node carries bytes and the
formula (in words a person can check) that produced it; a parent's bytes are the sum
of its children's.  Nothing here imports pandas, altair or torch at module level.
"""

from __future__ import annotations

from .inputs import shown

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from .allocator import DEFAULT_RESERVED_PER_ALLOCATED
from .units import GB, GIB, MIB

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
class Node:
    """One box of the treemap: a component, a module group or a tensor."""

    name: str
    bytes: float = 0.0
    formula: str = ""
    dtype: Optional[str] = None
    count: Optional[int] = None  # elements
    children: List["Node"] = field(default_factory=list)

    def add(self, child: "Node") -> "Node":
        """Append ``child`` and return it."""
        self.children.append(child)
        return child

    def total_bytes(self) -> float:
        """Bytes of this node: its own, or the sum of its children's."""
        if not self.children:
            return self.bytes
        return sum(c.total_bytes() for c in self.children)

    def finalize(self) -> "Node":
        """Drop empty children and set each parent's bytes to the sum of its children."""
        for c in self.children:
            c.finalize()
        self.children = [c for c in self.children if c.bytes > 0]
        if self.children:
            self.bytes = sum(c.bytes for c in self.children)
            if self.count is None and all(c.count is not None for c in self.children):
                self.count = sum(c.count for c in self.children)  # type: ignore[misc]
        return self

    def walk(self, path: Tuple[str, ...] = ()) -> Iterator[Tuple[Tuple[str, ...], "Node"]]:
        """Every node below (this one first), with its path of names."""
        here = path + (self.name,)
        yield here, self
        for c in self.children:
            yield from c.walk(here)

    def leaves(self, path: Tuple[str, ...] = ()) -> Iterator[Tuple[Tuple[str, ...], "Node"]]:
        """The nodes without children, with their paths."""
        for p, n in self.walk(path):
            if not n.children:
                yield p, n

    def to_dict(self) -> Dict[str, Any]:
        """A plain dict of this object (JSON-able)."""
        d: Dict[str, Any] = {"name": self.name, "bytes": int(round(self.bytes)), "formula": self.formula}
        if self.dtype:
            d["dtype"] = self.dtype
        if self.count is not None:
            d["count"] = int(self.count)
        if self.children:
            d["children"] = [c.to_dict() for c in self.children]
        return d


class Estimate:
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
                 backend: str = "analytic", cuda_context_source: Optional[str] = None):
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
        #: (replay with a capacity) -> the reserve it implies for this step (events.reserved_of)
        self._reserved_from_replay: Optional[Callable[[Any], float]] = None
        #: the caching-allocator replay behind ``reserved_bytes`` (``allocator.ReplayResult``), when one ran
        self._replay_fn: Optional[Callable[..., Any]] = None
        #: () -> (reserved bytes, exact) without running a replay (events.provisional_reserved_bytes)
        self._provisional_fn: Optional[Callable[[], Tuple[float, bool]]] = None
        #: (reserved bytes, exact=True) -> the peak's components with that allocator reserve,
        #: for builders that leave ``components`` to it (estimate.py's training step)
        self._components_at: Optional[Callable[..., List[Node]]] = None
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
        self._work: Optional[Callable[[], Any]] = None
        self._setup_obj: Any = None
        self.gpu: Any = None
        self.gpus: int = 1                       # GPUs the run uses (estimate_parallel sets it)
        self.tokens_per_step: Optional[int] = None   # all replicas' tokens per step (estimate_parallel)
        #: estimate_parallel: (gpu, StepTime) -> the step's communication (timing.communication)
        self._comm: Optional[Callable[[Any, Any], Dict[str, Any]]] = None
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
            if self._components is None and self._components_at is not None:
                self._components = self._components_at(self.reserved_bytes)
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
        if self._components is not None or self._components_at is None or self.reserved_exact:
            return self.components
        if self._phase_components is None:
            self._build()
        return self._context_now(self._components_at(self.provisional_reserved_bytes, False))

    @property
    def phase_components(self) -> Dict[str, List[Node]]:
        if self._phase_components is None:
            self._build()
        return self._phase_components if self._phase_components is not None else {}

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
            if self._components_at is not None:
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

    @property
    def step_time(self) -> Any:
        """The step's :class:`~vramwidget.timing.StepTime` on ``gpu`` (None without a GPU or
        when the catalogue lacks the GPU's throughput and bandwidth)."""
        if self._step_time is None and self.gpu is not None and self._work is not None:
            from .timing import has_timing, step_time

            if has_timing(self.gpu):
                st = step_time(self.gpu, self._setup_obj, self._work())
                if self._comm is not None:
                    c = self._comm(self.gpu, st)
                    st.communication = c
                    st.communication_seconds = c["exposed_seconds"]
                    st.cpu_optimizer_seconds = c.get("cpu_optimizer_seconds", 0.0)
                    st.pipeline_bubble_seconds = c["pipeline_bubble_seconds"]
                self._step_time = st
        return self._step_time

    @property
    def step_seconds(self) -> Optional[float]:
        """Seconds per optimizer step (all micro-batches of gradient accumulation); None without a GPU."""
        st = self.step_time
        return st.step_seconds if st else None

    @property
    def tokens_per_second(self) -> Optional[float]:
        """Training tokens per second over all the run's GPUs; None without a GPU."""
        st = self.step_time
        if not st:
            return None
        return (self.tokens_per_step or st.tokens_per_step) / st.step_seconds

    @property
    def mfu(self) -> Optional[float]:
        """Model FLOPs utilisation (useful matmul FLOPs / time / dense peak); None without a GPU."""
        st = self.step_time
        return st.mfu if st else None

    @property
    def time_breakdown(self) -> Optional[Dict[str, Any]]:
        """Seconds per phase (forward, backward with recompute, optimizer step) and per kind of
        work (matmul, attention, memory-bound kernels, launches, host waits), and what dominates."""
        st = self.step_time
        return st.breakdown() if st else None

    def run_cost(self, tokens: float, usd_per_gpu_hour: Optional[float] = None) -> Dict[str, Any]:
        """Steps, hours and dollars to train on ``tokens`` tokens.

        ``usd_per_gpu_hour`` defaults to the catalogue's indicative on-demand price of the GPU
        (``price_source`` says where it comes from); ``dollars`` is None when neither is known.
        """
        from .errors import VramError

        if isinstance(tokens, bool) or not isinstance(tokens, (int, float)) or not tokens > 0 \
                or tokens != tokens or tokens == float("inf"):
            raise VramError(f"tokens: must be a number > 0, got {shown(tokens)}", field="tokens")
        if usd_per_gpu_hour is not None and (isinstance(usd_per_gpu_hour, bool) or not isinstance(
                usd_per_gpu_hour, (int, float)) or not usd_per_gpu_hour >= 0 or usd_per_gpu_hour == float("inf")):
            raise VramError(f"usd_per_gpu_hour: must be a number >= 0, got {shown(usd_per_gpu_hour)}",
                            field="usd_per_gpu_hour")
        st = self.step_time
        if st is None:
            raise VramError("gpu: a run's cost needs a GPU; pass gpu=... to the estimate", field="gpu")
        import math

        tokens_per_step = self.tokens_per_step or st.tokens_per_step
        steps = math.ceil(tokens / tokens_per_step)
        hours = steps * st.step_seconds / 3600.0
        price = usd_per_gpu_hour if usd_per_gpu_hour is not None else self.gpu.usd_per_gpu_hour
        source = "given" if usd_per_gpu_hour is not None else self.gpu.price_source
        gpu_hours = hours * self.gpus
        return {"tokens": tokens, "steps": steps, "hours": hours, "gpu_hours": gpu_hours,
                "usd_per_gpu_hour": price, "dollars": gpu_hours * price if price is not None else None,
                "price_source": source, "gpus": self.gpus}

    def _time_dict(self) -> Optional[Dict[str, Any]]:
        st = self.step_time
        if st is None:
            return None
        return {"gpu": self.gpu.name, "step_seconds": self.step_seconds, "tokens_per_second": self.tokens_per_second,
                "mfu": self.mfu, "breakdown": self.time_breakdown,
                "usd_per_gpu_hour": self.gpu.usd_per_gpu_hour, "price_source": self.gpu.price_source}

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
        fn = self._provisional_fn
        return bool(fn()[1]) if fn is not None else False

    def _judged_here(self) -> bool:
        return self.capacity_judged and self.gpu is not None and self._replay_fn is not None

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
        fn = self._provisional_fn
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

    def replay(self, capacity_bytes: Optional[float] = None, record: bool = False):
        """The caching-allocator replay of this estimate's run (``allocator.ReplayResult``):
        ``max_reserved_bytes``, ``fragmentation_at_max_bytes`` and, with ``capacity_bytes``
        (what torch may reserve on the GPU), ``oom``: the first allocation that fails."""
        if self._replay_fn is None:
            raise ValueError("this estimate has no allocation trace to replay")
        return self._replay_fn(capacity_bytes=capacity_bytes, record=record)

    def to_memory_snapshot(self, capacity_bytes: Optional[float] = None) -> Dict[str, Any]:
        """The replayed run as a ``torch.cuda.memory._snapshot()`` dict: pickle it and open it
        in PyTorch's memory visualiser (``torch.cuda._memory_viz``, pytorch.org/memory_viz)."""
        from .snapshot import to_snapshot

        return to_snapshot(self.replay(capacity_bytes=capacity_bytes, record=True))

    @property
    def device_total_bytes(self) -> float:
        """What nvidia-smi would show: allocator reserve + CUDA context."""
        return self.reserved_bytes + self.cuda_context_bytes

    @property
    def paged_bytes(self) -> float:
        """Optimizer states a paged optimizer keeps in CUDA unified memory (vramwidget.paged):
        included in the peak, the reserve and the device total (on the card when paged in),
        outside torch's allocator statistics."""
        from .paged import paged_state_bytes

        return paged_state_bytes(self)

    @property
    def torch_max_memory_allocated_bytes(self) -> float:
        """What ``torch.cuda.max_memory_allocated()`` would report: the peak without paged states."""
        return self.peak_allocated_bytes - self.paged_bytes

    @property
    def torch_max_memory_reserved_bytes(self) -> float:
        """What ``torch.cuda.max_memory_reserved()`` would report: the reserve without paged states."""
        return self.reserved_bytes - self.paged_bytes

    @property
    def peak_gib(self) -> float:
        return self.peak_allocated_bytes / GIB

    @property
    def peak_gb(self) -> float:
        return self.peak_allocated_bytes / GB

    @property
    def peak_mib(self) -> float:
        return self.peak_allocated_bytes / MIB

    @property
    def device_total_gib(self) -> float:
        return self.device_total_bytes / GIB

    def tree(self, phase: Optional[str] = None) -> Node:
        """The whole tree under one root (the peak phase's, or another phase's)."""
        comps = self.components if phase is None else self.phase_components[phase]
        root = Node(self.model_name, children=list(comps))
        root.bytes = sum(c.bytes for c in comps)
        return root

    def component_bytes(self, phase: Optional[str] = None) -> Dict[str, float]:
        """Bytes per top-level component at the peak (or at ``phase``)."""
        comps = self.components if phase is None else self.phase_components[phase]
        return {c.name: c.bytes for c in comps}

    # -- export -------------------------------------------------------------------
    def rows(self, phase: Optional[str] = None) -> List[Dict[str, Any]]:
        """One row per leaf: component, group, tensor, bytes, GiB, GB, share, dtype, count, formula."""
        root = self.tree(phase)
        total = root.bytes or 1.0
        out = []
        for path, leaf in root.leaves():
            parts = list(path[1:]) + ["", "", ""]
            out.append({
                "component": parts[0],
                "group": parts[1] or parts[0],
                "tensor": parts[2] or parts[1] or parts[0],
                "bytes": leaf.bytes,
                "gib": leaf.bytes / GIB,
                "gb": leaf.bytes / GB,
                "share": leaf.bytes / total,
                "dtype": leaf.dtype or "",
                "count": leaf.count,
                "formula": leaf.formula,
            })
        return out

    def to_dataframe(self, phase: Optional[str] = None):
        """The leaves as a pandas DataFrame (pandas imported only here)."""
        import pandas as pd

        return pd.DataFrame(self.rows(phase))

    def to_dict(self) -> Dict[str, Any]:
        """A plain dict of this object (JSON-able)."""
        return {
            "model": self.model_name,
            "backend": self.backend,
            "setup": self.setup,
            "params_total": self.params_total,
            "params_trainable": self.params_trainable,
            "peak_allocated_bytes": int(round(self.peak_allocated_bytes)),
            "peak_allocated_gib": round(self.peak_allocated_bytes / GIB, 3),
            "peak_allocated_gb": round(self.peak_allocated_bytes / GB, 3),
            "peak_phase": self.peak_phase,
            "paged_bytes": int(round(self.paged_bytes)),
            "reserved_bytes": int(round(self.reserved_bytes)),
            "cuda_context_bytes": int(round(self.cuda_context_bytes)),
            "cuda_context_source": self.cuda_context_source,
            "device_total_bytes": int(round(self.device_total_bytes)),
            "phases": {k: int(round(v)) for k, v in self.phases_bytes.items()},
            "flops_per_step": self.flops_per_step,
            "recompute_overhead": self.recompute_overhead,
            "components": [c.to_dict() for c in self.components],
            "notes": list(self.notes),
            "time": self._time_dict(),
        }

    def to_json(self, **kw) -> str:
        """``to_dict()`` as a JSON string."""
        return json.dumps(self.to_dict(), **kw)

    def __repr__(self) -> str:
        return (f"Estimate({self.model_name!r}, peak {self.peak_gib:.2f} GiB at {self.peak_phase}, "
                f"device total {self.device_total_gib:.2f} GiB)")

    def summary_text(self) -> str:
        """A plain-text summary for front ends without HTML (``print(est)``, a terminal
        IPython): the setup, the peak and the device total, each component with its
        share, and the notes."""
        st = self.setup or {}
        what = ", ".join(str(st[k]) for k in ("method", "precision", "weights") if st.get(k))
        size = (f"batch {st['batch_size']} x {st['seq_len']} tokens" if "seq_len" in st and "batch_size" in st
                else f"batch {st.get('batch_size', 1)} x {st['context_len']} tokens" if "context_len" in st else "")
        lines = [f"{type(self).__name__}: {self.model_name}" + (f" ({what})" if what else "")
                 + (f", {size}" if size else ""),
                 f"peak allocated {self.peak_gib:.2f} GiB ({self.peak_phase}); device total "
                 f"{self.device_total_gib:.2f} GiB (allocator reserve + CUDA context)"]
        total = self.device_total_bytes or 1.0
        for name, nbytes in self.component_bytes().items():
            lines.append(f"  {name:<24} {nbytes / GIB:9.2f} GiB {100 * nbytes / total:6.1f}%")
        notes = [n for n in self.notes if n]
        if notes:
            lines.append("notes:")
            lines.extend(f"  - {n}" for n in notes)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary_text()

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        """IPython's plain-text display: the summary (``repr()`` stays one line)."""
        p.text(repr(self) if cycle else self.summary_text())
