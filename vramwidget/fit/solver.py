"""What fits a GPU: the largest micro-batch, the longest sequence, the fewest GPUs, and the
single changes that make a setup fit.

**The fit rule.**  A setup fits a card when the estimate's *device total* on that card --
the predicted reserved memory of PyTorch's caching allocator plus the card's own CUDA
context (:func:`vramwidget.fit.verdict.device_total_on`) -- is at most what CUDA reports as
the card's total (:func:`vramwidget.fit.verdict.capacity_bytes`: ``mem_get_info()``'s total,
nvidia-smi's less the driver's own reserve); i.e. the reserved memory is at most what torch
can allocate there (:func:`vramwidget.gpus.usable_capacity`).  Every estimate here is made
on the card (``gpu=``), so it counts that context.  For a parallel run (any of the keywords of
:func:`vramwidget.parallel.estimate.estimate_parallel`) the worst GPU decides.  Host memory needed by
CPU offload is reported, not judged.

Every answer is computed by the estimator itself (binary search over its totals), so it is
consistent with it: the largest batch returned fits and one more does not.

    >>> from vramwidget.fit import max_batch_size, suggestions
    >>> max_batch_size("llama-3.1-8b", "H100 80GB", method="lora", seq_len=2048)   # doctest: +SKIP
    >>> for s in suggestions("llama-3.1-8b", "RTX 4090", batch_size=4): print(s)    # doctest: +SKIP

Command line: ``vramwidget fit MODEL --gpu H100-80GB [setup options] [--json]`` (in
:mod:`vramwidget.cli`; this module has no command-line code).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..model.architecture import Architecture, load
from ..errors import VramError
from ..estimate import check_setup, estimate_setup
from ..gpus import GPU, capacity_shortfall, context_for, fits_on_card, get_gpu, reaches_limit_on_card
from ..allocator.collector import with_gc_paused
from ..inputs import MAX_GPUS as DEPLOYMENT_GPUS, check_choice, check_int, fail
from ..stacks import stack_switches
from ..parallel.strategies import BY_NAME, suggested
from ..parallel.estimate import (PARALLEL_KEYS, STRATEGIES, AboveFloor, ParallelEstimate, estimate_parallel_setup,
                                 giving_up_above)
from ..plan import has_plan
from ..plan.step import forward_floor_bytes, setup_shape, state_floor_bytes
from ..training import TrainingSetup
from ..units import GIB
from .verdict import capacity_bytes, fits

#: sharding strategies min_gpus and suggestions try, in this order (data/strategies.json "suggest")
SHARDED = tuple(st.name for st in suggested())
#: the longest sequence searched by default (tokens)
MAX_SEQ_LIMIT = 1 << 20
MAX_BATCH_LIMIT = 1 << 16
#: judge candidates on what needs no unlimited replay first (``_Query.fits`` through
#: ``gpus.fits_on_card``, a parallel run's through its worst GPU's; combinations of
#: ``suggestions`` on their allocated peak's state, then on one replay with the card's
#: capacity, ``gpus.reaches_limit_on_card``): the same answers (tests/test_fast_paths.py
#: compares them with this off)
CHEAP_BOUNDS = True


# ----------------------------------------------------------------------------------
# One query: resolved once, probed many times
# ----------------------------------------------------------------------------------

class _Query:
    """A model, a card, a validated setup and parallel keywords; ``total(**changes)`` is the
    device total (bytes) of the worst GPU with some setup fields changed."""

    def __init__(self, model: Any, gpu: Any, kw: Dict[str, Any]):
        self.arch: Architecture = load(model)
        self.gpu: GPU = get_gpu(gpu)
        self.par = {k: kw[k] for k in PARALLEL_KEYS if k in kw}
        if self.par and self.par.get("strategy") is None:   # not given: the one default (defaults.strategy_for)
            from ..defaults import strategy_for

            self.par["strategy"] = strategy_for(self.par.get("num_gpus", 1), self.par.get("tensor_parallel", 1),
                                                self.par.get("pipeline_parallel", 1),
                                                self.par.get("context_parallel", 1))[0]
        setup_kw = {k: v for k, v in kw.items() if k not in PARALLEL_KEYS}
        self.setup = TrainingSetup.from_kwargs(**setup_kw)
        #: the capacity judged: what CUDA reports as the card's total (verdict.capacity_bytes)
        self.usable = capacity_bytes(self.gpu)
        #: the card's own CUDA context, which every estimate on it counts (Estimate.set_gpu)
        self.context_bytes = context_for(self.gpu)[0]

    def estimate(self, s: Optional[TrainingSetup] = None, par: Optional[Dict[str, Any]] = None,
                 give_up: Optional[Callable[[float], bool]] = None, forward_floor: bool = False):
        """The estimate on this card (its device total counts the card's own CUDA context).

        ``give_up``: a test of a lower bound of a GPU's allocated peak (bytes); where it
        holds, None is returned before the step plan is written: for a GPU of a parallel run
        (``parallel.estimate.giving_up_above``; the bound, what that GPU's plan must hold at
        the slice's phase peaks: ``plan.per_gpu.floor_bytes``), and for one GPU (the bound,
        the load and the optimizer states: ``plan.step.state_floor_bytes``; with
        ``forward_floor``, where the plan is not built yet, then the most live in step 1's
        forward: ``plan.step.forward_floor_bytes``, a fifth of a plan's events, for a search
        that asks each setup once, not a bisection that asks a shape at many sizes)."""
        s = self.setup if s is None else s
        par = self.par if par is None else par
        if par:
            if give_up is None or not CHEAP_BOUNDS:
                return estimate_parallel_setup(self.arch, s, **par).set_gpu(self.gpu)
            try:
                with giving_up_above(give_up):
                    est = estimate_parallel_setup(self.arch, s, **par)
            except AboveFloor:
                return None
            return est.set_gpu(self.gpu)
        if give_up is not None and CHEAP_BOUNDS:
            check_setup(self.arch, s)       # what estimate_setup refuses, before the bound is written
            if give_up(state_floor_bytes(self.arch, s)):
                return None      # the weights and optimizer states alone rule it out: no plan written
            if forward_floor and not has_plan(self.arch, s) and give_up(forward_floor_bytes(self.arch, s)):
                return None      # so does the first forward: no plan written
        return estimate_setup(self.arch, s, gpu=self.gpu)

    def over_card(self, floor_bytes: float, context_bytes: Optional[float] = None) -> bool:
        """Whether a GPU whose allocated peak is at least ``floor_bytes`` is over this card
        with the CUDA context (this card's unless given): reserved memory is never below
        allocated memory, so then its device total is too."""
        ctx = self.context_bytes if context_bytes is None else context_bytes
        return floor_bytes + ctx > self.usable

    def never_fits_with_margin(self, floor_bytes: float, context_bytes: Optional[float] = None) -> bool:
        """Whether a GPU whose allocated peak is at least ``floor_bytes`` can never be in the
        state ``fits`` on this card (verdict.state_of): the state only grows with the reserve
        (the need and the band both do), and the reserve is never below the allocated peak."""
        from .verdict import band_bytes, state_of

        ctx = self.context_bytes if context_bytes is None else context_bytes
        return state_of(floor_bytes + ctx, self.usable, band_bytes(floor_bytes)) != "fits"

    def total(self, s: Optional[TrainingSetup] = None, par: Optional[Dict[str, Any]] = None) -> float:
        return self.estimate(s, par).device_total_bytes

    def fits_allocated(self, s: Optional[TrainingSetup] = None, par: Optional[Dict[str, Any]] = None) -> bool:
        """A necessary condition of ``fits``: the allocated peak + CUDA context fit (no replay)."""
        est = self.estimate(s, par, give_up=self.over_card)
        return est is not None and self.allocated_fits(est)

    def allocated_fits(self, est: Any) -> bool:
        """A necessary condition of fitting, without the allocator replay: the allocated peak
        and the estimate's CUDA context are not over the card (:meth:`over_card`)."""
        return not self.over_card(est.peak_allocated_bytes, getattr(est, "per_gpu", est).cuda_context_bytes)

    def fits(self, s: Optional[TrainingSetup] = None, par: Optional[Dict[str, Any]] = None) -> bool:
        est = self.estimate(s, par, give_up=self.over_card)
        if est is None or not self.allocated_fits(est):
            return False
        on_card = fits_on_card(est, self.gpu) if CHEAP_BOUNDS else None
        if on_card is not None:
            return on_card
        return fits(est.device_total_bytes, self.usable)

    def shortfall(self, est: Any) -> Optional[float]:
        """Bytes by which a one-GPU estimate already judged not to fit is over this card: its
        allocated peak + CUDA context over the card, or its capacity replay's refusal
        (``gpus.capacity_shortfall``); None where that is not known."""
        over = est.peak_allocated_bytes + est.cuda_context_bytes - self.usable
        return float(over) if over > 0 else capacity_shortfall(est, self.gpu)

    def guess_below(self, at: Callable[[int], TrainingSetup]) -> Callable[[int], Optional[int]]:
        """``guess(bad)`` for :func:`_largest`, for setups ``at(k)`` on one GPU: the k below
        a failing ``bad`` where the allocated peak has come down by what ``bad`` was over by
        (:meth:`shortfall`), the peak's growth from k - 1 to k taken for every step; None
        where not known.  (A secant through two failures was tried: what a capacity replay
        is refused by is too uneven from one size to the next to draw a line through.)"""
        if self.par:
            return lambda bad: None

        def guess(bad: int) -> Optional[int]:
            if bad <= 1:
                return None
            est = self.estimate(at(bad))
            short = self.shortfall(est)
            per_k = est.peak_allocated_bytes - self.estimate(at(bad - 1)).peak_allocated_bytes
            if short is None or not per_k > 0:
                return None
            return bad - math.ceil(short / per_k)

        return guess

    def may_fit_with_margin(self, est: Any) -> bool:
        """A necessary condition of the state ``fits``, without the allocator replay: a setup
        already tight or over on its allocated peak alone is never ``fits``
        (:meth:`never_fits_with_margin`)."""
        return not self.never_fits_with_margin(float(est.peak_allocated_bytes),
                                               getattr(est, "per_gpu", est).cuda_context_bytes)



def _largest(ok, limit: int, cheap=None, guess=None) -> int:
    """The largest k in [1, limit] with ok(k), for ok monotone (true up to some k, then
    false): 0 when ok(1) is false.  Doubling, then bisection: about 2 log2(k) probes.

    ``cheap``: a necessary condition of ``ok`` that costs less (allocated memory fits, where
    ``ok`` replays the caching allocator): its answer bounds the search, and ``ok`` is probed
    downwards from there (usually once or twice).

    ``guess(bad)``: where the line probably is below a ``bad`` that failed (from how much it
    failed by: :meth:`_Query.shortfall`), or None; the search below ``hi`` then probes there
    instead of galloping and halving (:func:`_bracket`).  Any probe order finds the same k
    for a monotone ``ok``: the guess only decides how many probes it takes.  (The reserve on
    a card ripples over a few tokens of sequence length, so ``ok`` is not quite monotone
    there: then the k found fits and k + 1 does not, but another order may stop at another
    such k nearby.)"""
    if cheap is not None:
        hi = _largest(cheap, limit)
        if hi < 1 or ok(hi):
            return hi
        if guess is not None and CHEAP_BOUNDS:
            return _bracket(ok, hi, guess)
        # gallop down from hi until ok, then bisect between
        step = 1
        good = hi - step
        while good >= 1 and not ok(good):
            hi = good
            step *= 2
            good = max(hi - step, 0) if hi - step >= 1 else 0
        if good < 1:
            if not ok(1):
                return 0
            good = 1
        return _bisect(ok, good, hi)
    if limit < 1 or not ok(1):
        return 0
    good = 1
    bad = None
    while bad is None:
        nxt = min(good * 2, limit)
        if nxt == good:
            return good
        if ok(nxt):
            good = nxt
        else:
            bad = nxt
    return _bisect(ok, good, bad)


def _bracket(ok, bad: int, guess) -> int:
    """The largest k < ``bad`` with ok(k) (0: none), given not ok(bad), for ok monotone:
    each probe at ``guess(bad)`` for the lowest failing k so far, kept inside the bracket
    (good, bad); where a guess is missing or not above the best success, or two probes in a
    row did not halve the bracket, a bisection step (so at most three probes per halving;
    usually a handful in all)."""
    good = 0                  # 0: nothing found yet (ok(0) stands for "none fits")
    width, since = bad, 0     # the bracket's width when it last halved, probes since
    while bad - good > 1:
        g = guess(bad) if since < 2 else None
        if g is None or not good < g:
            g = (good + bad) // 2                       # no guess, or one at or below a success
        g = min(int(g), bad - 1)
        if ok(g):
            good = g
        else:
            bad = g
        since += 1
        if bad - good <= width // 2:
            width, since = bad - good, 0
    return good


def _bisect(ok, good: int, bad: int) -> int:
    """The largest k in [good, bad) with ok(k), given ok(good) and not ok(bad)."""
    while bad - good > 1:
        mid = (good + bad) // 2
        if ok(mid):
            good = mid
        else:
            bad = mid
    return good


def _largest_from(ok, limit: int, start: int) -> int:
    """:func:`_largest` (the largest k in [1, limit] with ok(k), ok monotone; 0 when ok(1) is
    false) probed first at ``start`` and next to it, galloping away from it (steps 1, 2, 4,
    ...) until the answer is bracketed, then bisecting: two probes where ``start`` is the
    answer, about 2 log2(distance) otherwise.  Any probe order finds the same k for a
    monotone ``ok``; a start near the answer (the answer at another size of the same setup
    shape: ``min_gpus``) only saves probes."""
    if limit < 1:
        return 0
    start = min(max(int(start), 1), limit)
    if ok(start):
        good, step = start, 1
        while True:
            nxt = min(good + step, limit)
            if nxt == good:
                return good
            if not ok(nxt):
                return _bisect(ok, good, nxt)
            good, step = nxt, step * 2
    bad, step = start, 1
    while True:
        nxt = bad - step
        if nxt < 1:
            return _bisect(ok, 1, bad) if bad > 1 and ok(1) else 0
        if ok(nxt):
            return _bisect(ok, nxt, bad)
        bad, step = nxt, step * 2


# ----------------------------------------------------------------------------------
# Public answers
# ----------------------------------------------------------------------------------

@dataclass
class FitCheck:
    """One setup against one card."""

    fits: bool
    device_total_bytes: float        # reserved + the card's own CUDA context
    usable_bytes: float              # what CUDA reports as the card's total (verdict.capacity_bytes)
    gpu: str
    estimate: Any   # Estimate or ParallelEstimate

    @property
    def headroom_bytes(self) -> float:
        """Memory left of the card's CUDA total (negative: how much is missing)."""
        return self.usable_bytes - self.device_total_bytes

    def to_dict(self) -> Dict[str, Any]:
        """A plain dict of this object (JSON-able)."""
        return {"fits": self.fits, "gpu": self.gpu, "device_total_bytes": int(round(self.device_total_bytes)),
                "usable_bytes": int(round(self.usable_bytes)), "headroom_bytes": int(round(self.headroom_bytes)),
                "device_total_gib": round(self.device_total_bytes / GIB, 3),
                "usable_gib": round(self.usable_bytes / GIB, 3)}


@with_gc_paused
def check(model: Any, gpu: Any, **kw: Any) -> FitCheck:
    """Whether ``model`` with this setup fits ``gpu``: the estimate's device total on the card
    (reserved + the card's own CUDA context; the worst GPU of a parallel run) against what
    CUDA reports as its total (see the module's fit rule)."""
    q = _Query(model, gpu, kw)
    est = q.estimate()
    total = est.device_total_bytes
    return FitCheck(fits(total, q.usable), total, q.usable, q.gpu.name, est)


@with_gc_paused
def max_batch_size(model: Any, gpu: Any, *, limit: int = MAX_BATCH_LIMIT, **kw: Any) -> int:
    """The largest micro-batch (``batch_size``; per data-parallel replica in a parallel run)
    whose device total fits ``gpu`` (the fit rule above); 0 when even one sequence does not fit.
    The rest of the setup (``seq_len``, method, precision, parallel keywords...) is fixed."""
    limit = check_int("limit", limit, lo=1)
    q = _Query(model, gpu, kw)
    s0 = q.setup
    return _largest(lambda b: q.fits(replace(s0, batch_size=b)), limit,
                    cheap=lambda b: q.fits_allocated(replace(s0, batch_size=b)),
                    guess=q.guess_below(lambda b: replace(s0, batch_size=b)))


@with_gc_paused
def max_seq_len(model: Any, gpu: Any, *, limit: int = MAX_SEQ_LIMIT, multiple_of: int = 1, **kw: Any) -> int:
    """The longest sequence (tokens, a multiple of ``multiple_of`` and of the context-parallel
    size) whose device total fits ``gpu``, with the next multiple not fitting; 0 when none
    does.  (The replayed reserve ripples over a few tokens near the line, its requests'
    512-byte and 2 MiB roundings deciding which freed blocks are reused: the length found is
    a boundary of that ripple.)  The model's own position
    limit is not applied (``Architecture.max_position_embeddings`` tells it).  For an
    encoder-decoder this is the input (encoder) length: a given ``target_len`` stays fixed,
    without one the target grows with it (the decoder reads as many tokens)."""
    limit = check_int("limit", limit, lo=1)
    step = check_int("multiple_of", multiple_of, lo=1)
    q = _Query(model, gpu, kw)
    s0 = q.setup
    cp = int(q.par.get("context_parallel", 1) or 1)
    step = step * cp // math.gcd(step, cp)
    return step * _largest(lambda k: q.fits(replace(s0, seq_len=k * step)), limit // step,
                           cheap=lambda k: q.fits_allocated(replace(s0, seq_len=k * step)),
                           guess=q.guess_below(lambda k: replace(s0, seq_len=k * step)))


#: the most GPUs min_gpus tries by default
MAX_GPUS_SEARCHED = 4096


@with_gc_paused
def min_gpus(model: Any, gpu: Any, strategy: str = "zero3", *, max_gpus: int = MAX_GPUS_SEARCHED,
             at_least: int = 1, **kw: Any) -> Optional[int]:
    """The fewest GPUs of kind ``gpu`` (``at_least`` or more) on which the setup fits under
    ``strategy`` (with the given tensor/pipeline/context/expert parallel sizes, which set the
    step: the count is a multiple of tensor x pipeline x context); ``None`` when no count up
    to ``max_gpus`` fits -- always the case when one replica does not fit and the strategy
    does not shard (``none``, ``ddp``, ``zero0``, ``megatron``).  Per-GPU memory never grows
    with the count under the sharding strategies, which makes the search a bisection (from
    ``at_least`` up: the suggestions for a run on 2 GPUs do not try 1)."""
    max_gpus = check_int("max_gpus", max_gpus, lo=1, hi=DEPLOYMENT_GPUS)
    at_least = check_int("at_least", at_least, lo=1, hi=DEPLOYMENT_GPUS)
    strategy = check_choice("strategy", strategy, tuple(STRATEGIES))
    kw = dict(kw)
    kw["strategy"] = strategy
    kw.pop("num_gpus", None)
    q = _Query(model, gpu, kw)
    key = (id(q.arch), repr(q.gpu), q.setup, repr(sorted(q.par.items())), CHEAP_BOUNDS, at_least)
    hit = _MIN_GPUS.get(key)
    if hit is not None and hit[0] is q.arch:
        searched, found = hit[1], hit[2]
        # the fewest that fit is the same under any larger limit (per-GPU memory never grows
        # with the count); none up to a limit is none up to a smaller one
        if found is not None:
            return found if found <= max_gpus else None
        if max_gpus <= searched:
            return None
    # the fewest found at another batch size or length of this setup shape (the widget's last
    # batch size), where this search starts probing (CHEAP_BOUNDS: the reference searches
    # from the fewest GPUs up)
    near_key = (id(q.arch), repr(q.gpu), setup_shape(q.setup), repr(sorted(q.par.items())), at_least)
    near = _MIN_GPUS_NEAR.get(near_key) if CHEAP_BOUNDS else None
    n = _min_gpus(q, strategy, max_gpus, at_least, near[1] if near is not None and near[0] is q.arch else None)
    if len(_MIN_GPUS) >= 256:
        _MIN_GPUS.clear()
    _MIN_GPUS[key] = (q.arch, max_gpus, n)
    if n is not None:
        if len(_MIN_GPUS_NEAR) >= 256:
            _MIN_GPUS_NEAR.clear()
        _MIN_GPUS_NEAR[near_key] = (q.arch, n)
    return n


#: (id of the architecture, the card, the setup, the parallel keywords, CHEAP_BOUNDS, at_least) -> (the architecture, the
#: limit searched, the fewest GPUs found or None): fit.answers asks for each strategy up to
#: 4,096 GPUs and its suggestions again up to 8
_MIN_GPUS: Dict[Tuple[Any, ...], Tuple[Architecture, int, Optional[int]]] = {}
#: (id of the architecture, the card, the setup shape, the parallel keywords, at_least) ->
#: (the architecture, the fewest GPUs found at the last size searched)
_MIN_GPUS_NEAR: Dict[Tuple[Any, ...], Tuple[Architecture, int]] = {}


def _min_gpus(q: "_Query", strategy: str, max_gpus: int, at_least: int = 1,
              near: Optional[int] = None) -> Optional[int]:
    """The fewest GPUs (see :func:`min_gpus`); ``near``: a count the answer is probably at
    or next to, where the search starts probing (the same answer, fewer GPU plans)."""
    tp = int(q.par.get("tensor_parallel", 1) or 1)
    pp = int(q.par.get("pipeline_parallel", 1) or 1)
    cp = int(q.par.get("context_parallel", 1) or 1)
    ep = int(q.par.get("expert_parallel", 1) or 1)
    unit = tp * pp * cp
    dp_step = ep // math.gcd(ep, cp)       # (dp x cp) must be a multiple of ep
    step = unit * dp_step

    seen: Dict[int, bool] = {}

    def ok(k: int) -> bool:       # asked again for the count found (below)
        if k not in seen:
            seen[k] = q.fits(par={**q.par, "num_gpus": k * step})
        return seen[k]

    if strategy not in STRATEGIES:
        q.estimate(par={**q.par, "num_gpus": step})   # raises the strategy error
    lo = -(-at_least // step)             # the fewest steps of GPUs asked for
    if BY_NAME[strategy].replicates:       # more replicas add no room
        if BY_NAME[strategy].gradient_sync == "none" and dp_step > 1:
            return None
        return lo * step if lo * step <= max_gpus and ok(lo) else None
    # the last count from ``lo`` on that does not fit (lo - 1: none)
    limit = max_gpus // step - (lo - 1)
    if near is not None and near // step - lo >= 1:
        k = lo - 1 + _largest_from(lambda i: not ok(lo - 1 + i), limit, near // step - lo)
    else:
        k = lo - 1 + _largest(lambda i: not ok(lo - 1 + i), limit)
    n = (k + 1) * step
    if n > max_gpus or not ok(k + 1):
        return None
    return n


# ----------------------------------------------------------------------------------
# Suggestions
# ----------------------------------------------------------------------------------

#: what a change costs, on one scale (where the GPU has no throughput figures it stands in for
#: the GPU time per token; a combination's cost is the sum of its changes'): free 0; extra
#: compute 10 x the extra share of FLOPs (selective checkpointing ~0.3, full ~3-5); smaller
#: micro-batches or the same GPUs sharded 2 + a little; quality 5 + a step per notch; more
#: GPUs 10 + one per GPU; CPU offload 20.
_BASE_SCORE = {"free": 0.0, "throughput": 2.0, "quality": 5.0, "hardware": 10.0, "offload": 20.0}
#: the order suggestions are ranked in (``Suggestion.sort_key``): what the change costs the
#: user, cheapest first.
#:
#: 0. free: the same training at most 5% slower per token (SDPA, fused AdamW, a fused or
#:    chunked loss, optimizer in backward, ...);
#: 1. time: the same training on the same GPUs, up to 50% more GPU time per token
#:    (activation checkpointing, smaller micro-batches with accumulation, sharding over the
#:    GPUs the run has);
#: 2. quality: what is trained or its precision changes (8-bit Adam states, bf16, LoRA,
#:    QLoRA), the smaller change first;
#: 3. slow: more than 50% more GPU time per token, or host memory (CPU offload);
#: 4. hardware: more GPUs, fewer before more.
#:
#: A combination falls in the tier of its costliest part.  Changes that fit come before
#: those that do not suffice alone (ranked by what they save).
RANK_TIERS = ("free", "time", "quality", "slow", "hardware")
FREE_TIME_CHANGE = 0.05
SLOW_TIME_CHANGE = 0.5
#: default ceiling of GPUs a suggestion may use: one node
MAX_GPUS = 8


@dataclass
class Suggestion:
    """One change, or a combination of up to three, to the setup, re-estimated.

    ``changes`` are the keywords that change (setup fields or parallel keywords);
    ``kwargs`` the whole keyword set to pass back to :func:`check` / the estimators.
    ``saved_bytes`` is the drop in device total; ``fits`` whether the device total is under
    the GPU's CUDA total (the fit rule above), ``state`` the verdict with the estimate's uncertainty band
    (:mod:`vramwidget.fit.verdict`: fits | tight | does_not_fit); ``cost`` says what the change
    costs in words and ``costs`` by axis (``quality``, ``time``, ``hardware``: "" when free
    on that axis); ``extra_compute`` the share of extra FLOPs per step where that is a cost
    (checkpointing), ``kind`` the costliest of free, compute, throughput, quality, hardware,
    offload; ``score`` the cost on one scale (see ``_BASE_SCORE``; sums over a combination);
    ``parts`` the titles of a combination's changes.
    """

    title: str
    changes: Dict[str, Any]
    kwargs: Dict[str, Any]
    device_total_bytes: float
    saved_bytes: float
    fits: bool
    kind: str
    cost: str
    extra_compute: Optional[float] = None
    cpu_bytes_per_node: float = 0.0
    cost_value: float = 0.0
    state: str = "does_not_fit"
    costs: Dict[str, str] = field(default_factory=dict)
    score: float = 0.0
    parts: Tuple[str, ...] = ()
    headroom_bytes: float = 0.0
    #: the step timed on the GPU (timing.py): seconds per step, tokens/s of the whole run,
    #: GPU-seconds per training token (what a token costs), its change against the current
    #: setup, and dollars per million tokens at the catalogue's indicative price
    step_seconds: Optional[float] = None
    tokens_per_second: Optional[float] = None
    gpu_seconds_per_token: Optional[float] = None
    time_change: Optional[float] = None
    usd_per_million_tokens: Optional[float] = None
    #: GPUs the change adds to the run (0: the same hardware)
    extra_gpus: int = 0
    #: how much the change alters what is trained (the sum of its quality changes' notches:
    #: 8-bit Adam states 1, bf16 mixed precision 1, pure bf16 2, LoRA 3, QLoRA 4); 0: none
    quality_cost: float = 0.0

    def tier(self) -> int:
        """Which of :data:`RANK_TIERS` the change falls in: what it costs the user (see there)."""
        if self.extra_gpus > 0:
            return 4
        slow = self.time_change if self.time_change is not None else None
        if self.cpu_bytes_per_node > 0 or (slow is not None and slow > SLOW_TIME_CHANGE) \
                or (slow is None and self.kind == "offload"):
            return 3
        if self.quality_cost > 0 or self.kind == "quality":
            return 2
        if (slow is not None and slow > FREE_TIME_CHANGE) or (slow is None and self.kind in ("compute", "throughput")):
            return 1
        return 0

    def sort_key(self) -> Tuple[int, int, int, int, float, float, int, float]:
        """The rank (:data:`RANK_TIERS`): changes that fit the GPU (with the margin or within
        the band) before those that do not suffice; among those that fit, by what the change
        costs the user: free knobs, then GPU time on the same cards, then quality, then slow
        changes or host memory (CPU offload), then more GPUs (fewer before more, whatever
        else); within a tier fitting with the margin before tight, then the quality notch (8-bit states <
        bf16 < LoRA < QLoRA), then the GPU time a training token costs (``score`` where the
        GPU is not timed), fewer changes, larger saving.  Those that do not suffice: by
        saving."""
        if not self.fits:
            return (1, 0, 0, 0, 0.0, 0.0, len(self.parts) or 1, -self.saved_bytes)
        tier = self.tier()
        time = self.time_change if self.time_change is not None else self.score
        gpus = int(self.kwargs.get("num_gpus", 1) or 1) if tier == 4 else 0
        return (0, tier, gpus, 0 if self.state == "fits" else 1, self.quality_cost, time, len(self.parts) or 1,
                -self.saved_bytes)

    def to_dict(self) -> Dict[str, Any]:
        """A plain dict of this object (JSON-able)."""
        return {"title": self.title, "changes": self.changes, "fits": self.fits, "state": self.state,
                "kind": self.kind, "cost": self.cost, "costs": dict(self.costs), "score": round(self.score, 3),
                "parts": list(self.parts), "extra_compute": self.extra_compute,
                "device_total_bytes": int(round(self.device_total_bytes)),
                "device_total_gib": round(self.device_total_bytes / GIB, 3),
                "headroom_bytes": int(round(self.headroom_bytes)),
                "saved_bytes": int(round(self.saved_bytes)), "saved_gib": round(self.saved_bytes / GIB, 3),
                "cpu_bytes_per_node": int(round(self.cpu_bytes_per_node)),
                "step_seconds": self.step_seconds, "tokens_per_second": self.tokens_per_second,
                "gpu_seconds_per_token": self.gpu_seconds_per_token, "time_change": self.time_change,
                "usd_per_million_tokens": self.usd_per_million_tokens}

    def __str__(self) -> str:
        verdict = {"fits": "fits", "tight": "tight"}.get(self.state, "still too big")
        return (f"{self.title}: saves {self.saved_bytes / GIB:.1f} GiB -> {self.device_total_bytes / GIB:.1f} GiB "
                f"({verdict}); cost: {self.cost}")


@dataclass
class _Move:
    """One candidate change: what it sets, its exclusive group, its cost by axis."""

    title: str
    kind: str
    cost: str
    setup: Dict[str, Any]
    par: Dict[str, Any]
    group: str
    compute_from_estimate: bool = False
    cost_value: float = 0.0
    quality: str = ""
    time: str = ""
    hardware: str = ""


_LOSS_TITLES = {"liger": "Liger fused linear cross-entropy", "chunked": "chunked cross-entropy"}


class SearchStopped(Exception):
    """A :func:`suggestions` search ended early by its caller's ``stop`` (the widget: a newer
    update asks for other suggestions)."""


@with_gc_paused
def suggestions(model: Any, gpu: Any, *, max_gpus: int = MAX_GPUS, combine: int = 3,
                progress: Optional[Callable[[List[Suggestion]], None]] = None,
                stop: Optional[Callable[[], bool]] = None, **kw: Any) -> List[Suggestion]:
    """Changes that lower the device total, alone and combined (up to ``combine`` at once),
    each re-estimated and ranked by what the change costs the user (:data:`RANK_TIERS`):
    among those that fit ``gpu`` (with the margin of the estimate's own uncertainty,
    :mod:`vramwidget.fit.verdict`, or within it) free knobs first, then GPU time on the same
    cards, then quality (the smaller change first), then slow changes or host memory, then
    more GPUs (fewer before more); then single changes that help but do not suffice (by
    memory saved; under 1% left out).  Each suggestion says its cost by axis (quality,
    time, hardware).  No suggestion uses more than ``max_gpus`` GPUs (default 8: one node).

    Tried: SDPA instead of eager attention, fused AdamW, the stack's loss without full logits
    (Liger or chunked cross-entropy), activation offloading where the stack
    has it, torchtune's optimizer in backward, selective and full activation
    checkpointing (cost: the extra compute of ``Estimate.recompute_overhead``), a smaller
    micro-batch with more gradient accumulation (same sequences per step), 8-bit AdamW,
    pure bf16 instead of fp32 weights, LoRA, QLoRA, ZeRO-2/ZeRO-3/FSDP across the fewest GPUs
    that fit (up to ``max_gpus``), and DeepSpeed CPU offload of the optimizer (and
    parameters).  A combination is listed only when it fits with the margin, none of its
    parts (a cheaper subset) already does, and the same changes on fewer GPUs of the same
    layout do not; a change that lowers no phase by 1% of the card is not combined
    (``_Search.combinable``).

    ``progress``: called once with the single changes, ranked, before the combinations are
    worked out (most of the time: the widget shows these first); the list returned holds
    them all again, with the combinations.  ``stop``: asked before each candidate setup is
    estimated; where it returns True the search ends there with :class:`SearchStopped`
    (what it built stays cached for the next search).
    """
    max_gpus = check_int("max_gpus", max_gpus, lo=1, hi=DEPLOYMENT_GPUS)
    combine = check_int("combine", combine, lo=1, hi=8, what="must be a whole number from 1 to 8 (changes at once)")
    if progress is not None and not callable(progress):
        raise fail("progress", "expected a function of the list of single-change suggestions, or None", progress)
    if stop is not None and not callable(stop):
        raise fail("stop", "expected a function of no arguments that says whether to stop, or None", stop)
    search = _Search(_Query(model, gpu, kw), max_gpus)
    search.stop = stop
    _try_setup_changes(search)
    _try_more_gpus(search)
    _try_cpu_offload(search)
    if progress is not None and combine > 1:
        progress(sorted(search.out, key=Suggestion.sort_key))
    _add_sharding_partners(search, combine)
    _try_combinations(search, combine)
    search.out.sort(key=Suggestion.sort_key)
    return search.out


class _Search:
    """The state of one :func:`suggestions` run: the query, its baseline, the setups already
    estimated, the candidate moves and the suggestions found so far."""

    def __init__(self, q: "_Query", max_gpus: int) -> None:
        self.q = q
        self.s = q.setup
        self.max_gpus = max_gpus
        base_est = q.estimate()
        self.base = base_est.device_total_bytes
        self.base_phases = dict(getattr(base_est, "per_gpu", base_est).phases_bytes)
        self.base_time = _timed(base_est, q.gpu)
        self.par0 = dict(q.par)
        self.strategy0 = self.par0.get("strategy", "none")
        self.n_now = int(self.par0.get("num_gpus", 1) or 1)
        self.out: List[Suggestion] = []
        self.seen: set = set()
        self.moves: List[_Move] = []
        #: asked before each candidate (``suggestions``' ``stop``)
        self.stop: Optional[Callable[[], bool]] = None

    def evaluate(self, ms: Sequence[_Move], give_up: Optional[Callable[[float], bool]] = None
                 ) -> Optional[Tuple[Any, Any, Dict[str, Any], Dict[str, Any]]]:
        q, s, seen, par0, max_gpus, n_now = self.q, self.s, self.seen, self.par0, self.max_gpus, self.n_now
        if self.stop is not None and self.stop():
            raise SearchStopped()
        setup_changes: Dict[str, Any] = {}
        par_changes: Dict[str, Any] = {}
        for m in ms:
            setup_changes.update(m.setup)
            par_changes.update(m.par)
        key = (tuple(sorted(setup_changes.items())), tuple(sorted(par_changes.items())))
        if key in seen:
            return None
        seen.add(key)
        try:
            s2 = s.replace(**setup_changes) if setup_changes else s
            par = {**par0, **par_changes}
            if int(par.get("num_gpus", 1) or 1) > max(max_gpus, n_now):
                return None
            est = q.estimate(s2, par, give_up=give_up, forward_floor=give_up is not None)
        except VramError:
            return None
        if est is None:
            return None
        return est, s2, par, {**setup_changes, **par_changes}

    def make(self, ms: Sequence[_Move], res) -> Suggestion:
        from .verdict import band_bytes, state_of

        q, s, base, base_time, n_now = self.q, self.s, self.base, self.base_time, self.n_now
        est, s2, par, changes = res
        total = est.device_total_bytes
        per_gpu = est.per_gpu if isinstance(est, ParallelEstimate) else est
        reserved = getattr(est, "reserved_bytes", per_gpu.reserved_bytes)
        state = state_of(total, q.usable, band_bytes(reserved), bool(getattr(per_gpu, "squeezed", False)))
        extra = None
        quality, time, hardware, words = [], [], [], []
        score = 0.0
        kinds = []
        for m in ms:
            cost = m.cost
            if m.compute_from_estimate:
                # the combination's own recompute share (checkpointing with LoRA costs less)
                extra = per_gpu.recompute_overhead
                cost = f"{extra * 100:.0f}% more compute per step ({m.cost})"
                score += 10.0 * extra
                time.append(f"+{extra * 100:.0f}% compute")
                kinds.append("compute")
            else:
                score += _BASE_SCORE.get(m.kind, 9.0) + m.cost_value * (0.05 if m.kind == "throughput" else 1.0)
                kinds.append(m.kind)
            quality += [m.quality] if m.quality else []
            time += [m.time] if m.time else []
            hardware += [m.hardware] if m.hardware else []
            words.append(cost)
        cpu = est.cpu_bytes_per_node if isinstance(est, ParallelEstimate) else 0.0
        if cpu:
            hardware.append(f"{cpu / GIB:.0f} GiB host memory per node")
            words[-1] += f"; needs {cpu / GIB:.0f} GiB of host memory per node"
        order = ["free", "compute", "throughput", "quality", "hardware", "offload"]
        kind = max(kinds, key=lambda k: order.index(k) if k in order else 9)
        kwargs = {**s.to_dict(), **s2.to_dict(), **par}
        title = " + ".join(m.title for m in ms)
        # the step timed on the GPU (timing.py): what a training token costs with the change
        t = _timed(est, q.gpu)
        change = None
        if t is not None:
            if base_time is not None:
                change = t[2] / base_time[2] - 1.0
                time.append(f"{change * 100:+.0f}% GPU time per token")
            words[-1] += (f"; {t[0]:.3g} s per step, {t[1]:,.0f} tokens/s"
                          + (f" ({change * 100:+.0f}% GPU time per token)" if change is not None else ""))
        usd = (t[2] * 1e6 / 3600 * q.gpu.usd_per_gpu_hour) if t and q.gpu.usd_per_gpu_hour else None
        return Suggestion(title, changes, kwargs, total, base - total, fits(total, q.usable), kind,
                          "; ".join(words) if len(ms) == 1 else " | ".join(words), extra, cpu,
                          ms[0].cost_value if len(ms) == 1 else score, state,
                          {"quality": ", ".join(quality), "time": ", ".join(time), "hardware": ", ".join(hardware)},
                          score, tuple(m.title for m in ms) if len(ms) > 1 else (), q.usable - total,
                          *(t if t is not None else (None, None, None)), change, usd,
                          max(int(par.get("num_gpus", 1) or 1) - n_now, 0),
                          sum(m.cost_value for m in ms if m.kind == "quality"))

    def combinable(self, est: Any) -> bool:
        """Whether a change whose estimate is ``est`` can help a combination: it lowers some
        phase's allocated bytes (on a parallel run's worst GPU) by at least 1% of the card.
        A change can save nothing at the peak and much in another phase (checkpointing when
        the optimizer step is the peak), which matters once another change lowers the peak
        (ZeRO-2 sharding the optimizer): so every phase counts.  What a change saves in a
        phase does not grow when the other changes are made with it (they shard, shrink or
        move the same tensors), so one that saves under 1% of the card everywhere (fused
        AdamW's temporaries on a LoRA run, selective checkpointing with SDPA) moves a
        combination by less than the verdict's own band (``verdict.uncertainty``, about 2%),
        and its combinations are not tried: a fix that is "fits" rather than "tight" only by
        such a change is not one to offer."""
        phases = getattr(est, "per_gpu", est).phases_bytes
        common = [p for p in self.base_phases if p in phases]
        if not common:
            return True
        return max(self.base_phases[p] - phases[p] for p in common) >= 0.01 * self.q.usable

    def attempt(self, title: str, kind: str, cost: str, setup_changes: Optional[Dict[str, Any]] = None,
                par_changes: Optional[Dict[str, Any]] = None, compute_from_estimate: bool = False,
                cost_value: float = 0.0, group: str = "", quality: str = "", time: str = "",
                hardware: str = "") -> None:
        base, evaluate, make, moves, out = self.base, self.evaluate, self.make, self.moves, self.out
        m = _Move(title, kind, cost, setup_changes or {}, par_changes or {}, group or title,
                  compute_from_estimate, cost_value, quality, time, hardware)
        res = evaluate([m])
        if res is None:
            return
        sug = make([m], res)
        if self.combinable(res[0]):
            moves.append(m)   # a candidate for combinations even when it saves nothing alone
        if sug.device_total_bytes >= base or (not sug.fits and base - sug.device_total_bytes < 0.01 * base):
            return   # no saving, or too small to matter (under 1%) and not enough anyway
        out.append(sug)


def _try_setup_changes(search: _Search) -> None:
    """Single changes of the training setup: attention, optimizer, checkpointing, micro-batch,
    the stack's own switches, precision, method."""
    q, s, attempt = search.q, search.s, search.attempt
    if s.attn_implementation == "eager":
        attempt("SDPA attention instead of eager", "free", "none (the same attention, without b x a x s x s "
                "score tensors)", {"attn_implementation": "sdpa"}, group="attention")
    if s.optimizer == "adamw":
        attempt("fused AdamW", "free", "none (the same update in one kernel, no foreach temporaries)",
                {"optimizer": "adamw_fused"}, group="optimizer")
    if s.gradient_checkpointing == "none":
        attempt("selective activation checkpointing", "compute", "attention recomputed in backward",
                {"gradient_checkpointing": "selective"}, compute_from_estimate=True, group="checkpointing")
    if s.gradient_checkpointing != "full":
        attempt("full activation checkpointing", "compute", "every block's forward recomputed in backward",
                {"gradient_checkpointing": "full"}, compute_from_estimate=True, group="checkpointing")
    if s.batch_size > 1:
        b = _largest(lambda b: q.fits(replace(s, batch_size=b)), s.batch_size - 1,
                     cheap=lambda b: q.fits_allocated(replace(s, batch_size=b))) or 1
        seqs = s.batch_size * s.grad_accum_steps
        acc = -(-seqs // b)
        attempt(f"micro-batch {b} with {acc} gradient accumulation steps", "throughput",
                f"the same {b * acc} sequences per step in {acc} smaller micro-steps: lower GPU utilisation",
                {"batch_size": b, "grad_accum_steps": acc}, cost_value=acc, group="batch",
                time=f"{acc} micro-steps per step")
    # the knobs the user's stack has, with its own switch for each (stacks.STACKS "switches")
    switches = stack_switches(s.stack)
    if s.loss == "standard" and "loss" in switches:
        loss, how = switches["loss"]
        attempt(f"{_LOSS_TITLES[loss]} loss", "free", f"the same loss without the full logits; {how}",
                {"loss": loss}, group="loss")
    if not s.activation_offloading and "activation_offloading" in switches:
        attempt("activation offloading to CPU memory", "throughput",
                "saved activations go to host memory over PCIe and come back for backward; "
                + switches["activation_offloading"], {"activation_offloading": True}, cost_value=2,
                group="offload activations", time="PCIe transfers of the saved activations")
    if ("optimizer_in_backward" in switches and not s.optimizer_in_backward and s.grad_accum_steps == 1
            and s.method in ("full", "freeze")):
        attempt("optimizer in backward", "free", "each parameter is stepped as its gradient is ready, so the full "
                "set of gradients never exists; no gradient accumulation or clipping; "
                + switches["optimizer_in_backward"], {"optimizer_in_backward": True}, group="optimizer in backward")
    if s.optimizer in ("adamw", "adamw_fused", "paged_adamw") and (s.method == "full" or s.method == "freeze"):
        attempt("8-bit AdamW (bitsandbytes)", "quality", "block-wise 8-bit Adam moments: usually on par with "
                "32-bit AdamW (Dettmers et al. 2022); watch for instabilities on long runs",
                {"optimizer": "adamw_8bit"}, cost_value=1, group="optimizer", quality="8-bit Adam moments")
    if s.weights_dtype == "float32" and not s.quantized:
        if q.gpu.bf16:
            attempt("bf16 instead of fp32", "quality", "pure bf16 weights, gradients and states (8-bit mantissa): "
                    "small updates can be lost; mixed precision (amp_bf16) keeps fp32 weights for less saving",
                    {"precision": "bf16"}, cost_value=2, group="precision", quality="pure bf16 weights")
            if s.precision == "fp32":
                attempt("bf16 mixed precision instead of fp32", "quality", "bf16 matmuls with fp32 master weights: "
                        "the standard recipe, rarely changes results", {"precision": "amp_bf16"}, cost_value=1,
                        group="precision", quality="bf16 matmuls")
        elif s.precision == "fp32":
            attempt("fp16 mixed precision instead of fp32", "quality",
                    f"{q.gpu.name} has no bf16: fp16 autocast needs loss scaling", {"precision": "amp_fp16"},
                    cost_value=1, group="precision", quality="fp16 matmuls, loss scaling")
    if s.method in ("full", "freeze"):
        lora_prec = s.precision if s.weights_dtype != "float32" else ("bf16" if q.gpu.bf16 else "fp16")
        attempt("LoRA (r=16, all linear layers)", "quality",
                "trains low-rank adapters only: close to full fine-tuning on narrow tasks, below it on broad ones",
                {"method": "lora", "precision": lora_prec, "lora_r": 16}, cost_value=3, group="method",
                quality="LoRA instead of full fine-tuning")
        attempt("QLoRA (4-bit NF4 base, r=16)", "quality",
                "4-bit base weights (QLoRA paper: on par with 16-bit LoRA); dequantization slows matmuls",
                {"method": "qlora", "quantization": "nf4", "precision": lora_prec, "lora_r": 16}, cost_value=4,
                group="method", quality="LoRA on a 4-bit base")
    elif s.method == "lora":
        attempt("QLoRA (4-bit NF4 base)", "quality",
                "4-bit base weights (QLoRA paper: on par with 16-bit LoRA); dequantization slows matmuls",
                {"method": "qlora", "quantization": "nf4"}, cost_value=4, group="method", quality="4-bit base")


def _try_more_gpus(search: _Search) -> None:
    """Sharding over more GPUs (never more than ``max_gpus``)."""
    q, s, attempt, par0, n_now, max_gpus = search.q, search.s, search.attempt, search.par0, search.n_now, search.max_gpus
    strategy0 = search.strategy0
    if BY_NAME[strategy0].engine in ("none", "torch"):     # one replica or plain DDP
        for strat in SHARDED:
            try:
                n = min_gpus(q.arch, q.gpu, strat, max_gpus=max(max_gpus, n_now), at_least=n_now,
                             **_kw_for(s, par0))
            except VramError:
                n = None
            if n is None:
                continue
            n = max(n, n_now)   # shard over the GPUs the run already has
            if n > 1:
                more = "" if n == n_now else f"{n} GPUs; "
                kind = "throughput" if n == n_now else "hardware"   # the same GPUs: only traffic changes
                offer = BY_NAME[strat]
                attempt(f"{offer.label} across {n} x {q.gpu.name}", kind,
                        f"{more}{offer.suggest.communication}", par_changes={"strategy": strat, "num_gpus": n},
                        cost_value=n if kind == "hardware" else offer.suggest.traffic_vs_ddp, group="gpus",
                        hardware=f"{n} × {q.gpu.name}" if n != n_now else "", time=offer.suggest.time)
    elif not BY_NAME[strategy0].replicates:      # already sharded: the same strategy on more GPUs
        try:
            n = min_gpus(q.arch, q.gpu, strategy0, max_gpus=max(max_gpus, n_now), at_least=n_now,
                         **_kw_for(s, par0))
        except VramError:
            n = None
        if n and n > par0.get("num_gpus", 1):
            attempt(f"{n} GPUs instead of {par0.get('num_gpus', 1)}", "hardware",
                    f"{n} GPUs; the same strategy", par_changes={"num_gpus": n}, cost_value=n, group="gpus",
                    hardware=f"{n} × {q.gpu.name}")


def _try_cpu_offload(search: _Search) -> None:
    """DeepSpeed's CPU offload of the optimizer (and the parameters)."""
    attempt, par0, n_now, strategy0 = search.attempt, search.par0, search.n_now, search.strategy0
    now = BY_NAME[strategy0]
    # ZeRO-Offload is a move from one replica, DDP or a DeepSpeed stage that keeps the parameters whole
    if now.engine in ("none", "torch", "deepspeed") and not now.gathers_parameters \
            and not par0.get("offload_optimizer"):
        attempt("DeepSpeed ZeRO-Offload: optimizer on the CPU", "offload",
                "the optimizer steps on the CPU; gradients go down and parameters come back over PCIe every step",
                par_changes={"strategy": "zero2", "offload_optimizer": True, "num_gpus": n_now}, group="gpus",
                time="PCIe transfers and a CPU optimizer step")
    if now.engine in ("none", "torch", "deepspeed") and not par0.get("offload_params"):
        attempt("DeepSpeed ZeRO-3 with optimizer and parameters on the CPU", "offload",
                "parameters are fetched from host memory over PCIe for every module, in forward and backward",
                par_changes={"strategy": "zero3", "offload_optimizer": True, "offload_params": True, "num_gpus": n_now},
                cost_value=1, group="gpus", time="PCIe transfers of every parameter and a CPU optimizer step")


def _add_sharding_partners(search: _Search, combine: int) -> None:
    """ZeRO-3 on 2, 4 and ``max_gpus`` GPUs as parts of combinations only."""
    q, moves, n_now, max_gpus, strategy0 = search.q, search.moves, search.n_now, search.max_gpus, search.strategy0
    # sharding across a few GPUs also combines with the cheaper changes: the fewest counts that
    # are not already a single suggestion (2, 4 and max_gpus), ZeRO-3
    if combine > 1 and BY_NAME[strategy0].engine in ("none", "torch"):
        for n in sorted({2, 4, max_gpus}):
            if n_now < n <= max_gpus and not any(m.group == "gpus" and m.par.get("num_gpus") == n for m in moves):
                z3 = BY_NAME["zero3"]
                moves.append(_Move(f"{z3.label} across {n} x {q.gpu.name}", "hardware",
                                   f"{n} GPUs; {z3.suggest.communication}", {}, {"strategy": "zero3", "num_gpus": n},
                                   "gpus", cost_value=n, hardware=f"{n} × {q.gpu.name}", time=z3.suggest.time))


def _try_combinations(search: _Search, combine: int) -> None:
    """Up to ``combine`` moves at once, cheaper subsets first.

    A combination with a change of GPUs is listed on the fewest GPUs of its layout that fit
    (more cost hardware for nothing).  Per-GPU memory never grows with the count under the
    sharding strategies (what :func:`min_gpus`'s bisection stands on), so the largest count
    of a layout is judged first: where it does not fit, no smaller count does, and those are
    passed over without their plans (Llama 2 7B full on an RTX 4090: 8 of the 97 combinations
    judged)."""
    from itertools import combinations

    moves, out = search.moves, search.out
    # combinations: cheaper subsets first; a superset of one that fits with the margin costs
    # more for nothing and is left out
    fitting = [frozenset([x.title]) for x in out if x.state == "fits"]
    # the same other changes with the same layout on fewer GPUs already fit: more GPUs cost
    # more hardware for nothing (the fewest are tried first; the order within one size of
    # combination changes nothing else)
    fewest: Dict[Tuple[Any, ...], int] = {}
    moves = sorted(moves, key=lambda m: int(m.par.get("num_gpus", 0) or 0))
    judged: Dict[frozenset, Optional[Suggestion]] = {}      # combination titles -> its fitting suggestion

    def judge(combo: Sequence[_Move]) -> Optional[Suggestion]:
        titles = frozenset(m.title for m in combo)
        if titles not in judged:
            judged[titles] = _fitting_combination(search, combo)
        return judged[titles]

    for k in range(2, max(combine, 1) + 1):
        for combo in combinations(moves, k):
            groups = [m.group for m in combo]
            if len(set(groups)) < k:
                continue   # two of one kind (two checkpointing modes, two methods, ...)
            titles = frozenset(m.title for m in combo)
            if any(f <= titles for f in fitting):
                continue
            layout = _layout_key(combo)
            if layout is not None and fewest.get(layout[0], layout[1] + 1) < layout[1]:
                fitting.append(titles)      # and so is every combination that holds this one
                continue
            if layout is not None:
                top = _largest_count(combo, moves)
                # (a largest count that holds a combination already fitting is not judged: it
                # is never listed, and where it fits it rules nothing out)
                if top is not None and not _holds_one(top, fitting) and judge(top) is None:
                    continue            # not on the most GPUs of this layout: not on fewer
            sug = judge(combo)
            if sug is not None:
                out.append(sug)
                fitting.append(titles)
                if layout is not None:
                    fewest[layout[0]] = min(fewest.get(layout[0], layout[1]), layout[1])


def _holds_one(combo: Sequence[_Move], fitting: Sequence[frozenset]) -> bool:
    """Whether ``combo`` holds every change of one of the ``fitting`` combinations."""
    titles = frozenset(m.title for m in combo)
    return any(f <= titles for f in fitting)


def _fitting_combination(search: _Search, combo: Sequence[_Move]) -> Optional[Suggestion]:
    """The suggestion of ``combo`` when it fits with the margin, else None."""
    # listed only when it fits with the margin: a parallel layout whose GPU cannot is
    # passed over before its plan is written
    res = search.evaluate(list(combo), give_up=search.q.never_fits_with_margin)
    if res is None or not (search.q.may_fit_with_margin(res[0]) if CHEAP_BOUNDS
                           else search.q.allocated_fits(res[0])):
        return None   # a combination is listed only when it fits: no replay for one that cannot
    if CHEAP_BOUNDS and reaches_limit_on_card(res[0], search.q.gpu):
        return None   # tight at best or over (one replay with the card's capacity): not listed
    sug = search.make(list(combo), res)
    return sug if sug.state == "fits" else None


def _largest_count(combo: Sequence[_Move], moves: Sequence[_Move]) -> Optional[Tuple[_Move, ...]]:
    """``combo`` with its change of GPUs on the largest count among ``moves`` of the same
    layout (strategy and options but the count), None when it is already that one."""
    gm = next(m for m in combo if m.group == "gpus" and m.par.get("num_gpus"))
    same = [m for m in moves if m.group == "gpus" and m.par.get("num_gpus")
            and {k: v for k, v in m.par.items() if k != "num_gpus"} == {k: v for k, v in gm.par.items()
                                                                        if k != "num_gpus"}]
    top = max(same, key=lambda m: int(m.par["num_gpus"]))
    if int(top.par["num_gpus"]) <= int(gm.par["num_gpus"]):
        return None
    return tuple(top if m is gm else m for m in combo)


def _layout_key(combo: Sequence[_Move]) -> Optional[Tuple[Tuple[Any, ...], int]]:
    """(the other changes' titles and the multi-GPU layout but its size, the number of GPUs)
    of a combination with a change of GPUs; None without one."""
    for m in combo:
        n = m.par.get("num_gpus")
        if m.group == "gpus" and n:
            layout = tuple(sorted((k, repr(v)) for k, v in m.par.items() if k != "num_gpus"))
            return (frozenset(x.title for x in combo if x is not m), layout), int(n)
    return None



def _timed(est: Any, gpu: GPU) -> Optional[Tuple[float, float, float]]:
    """(seconds per step, tokens/s of the run, GPU-seconds per token) of an estimate on
    ``gpu`` (timing.py), or None when the GPU has no throughput figures."""
    est.set_gpu(gpu)
    step = est.step_seconds
    tps = est.tokens_per_second
    if not step or not tps:
        return None
    gpus = est.layout["num_gpus"] if isinstance(est, ParallelEstimate) else est.gpus
    return step, tps, gpus / tps




def _kw_for(s: TrainingSetup, par: Dict[str, Any]) -> Dict[str, Any]:
    kw = {**s.to_dict(), **{k: v for k, v in par.items() if k not in ("strategy", "num_gpus")}}
    return {k: v for k, v in kw.items() if v is not None}


def _verdict(est: Any, gpu: GPU, num_gpus: int) -> Dict[str, Any]:
    from .verdict import verdict

    return verdict(est, gpu, num_gpus=num_gpus)


@with_gc_paused
def answers(model: Any, gpu: Any, **kw: Any) -> Dict[str, Any]:
    """Everything ``vramwidget fit`` prints, as a dict."""
    q = _Query(model, gpu, kw)
    c = check(q.arch, q.gpu, **kw)
    kw_nb = {k: v for k, v in kw.items() if k != "batch_size"}
    kw_ns = {k: v for k, v in kw.items() if k != "seq_len"}
    out: Dict[str, Any] = {
        "model": q.arch.name, "gpu": q.gpu.to_dict(), "setup": q.setup.to_dict(), "parallel": q.par,
        "check": c.to_dict(),
        "verdict": _verdict(c.estimate, q.gpu, int(q.par.get("num_gpus", 1) or 1)),
        "max_batch_size": max_batch_size(q.arch, q.gpu, batch_size=1, **kw_nb),
        "max_seq_len": max_seq_len(q.arch, q.gpu, seq_len=1, **kw_ns),
        "max_position_embeddings": q.arch.max_position_embeddings,
        "notes": q.setup.notes,    # the practitioner defaults applied, the options that do nothing
    }
    mg: Dict[str, Optional[int]] = {}
    base = {k: v for k, v in kw.items() if k not in ("strategy", "num_gpus")}
    for strat in ("ddp",) + SHARDED + ("fsdp_hybrid",):   # DDP, the offered shardings, and hybrid
        try:
            mg[strat] = min_gpus(q.arch, q.gpu, strat, **base)
        except VramError:
            mg[strat] = None
    out["min_gpus"] = mg
    ok, why = q.gpu.supports(q.setup.precision)
    out["precision_supported"] = ok
    out["precision_note"] = why
    out["suggestions"] = [s.to_dict() for s in suggestions(q.arch, q.gpu, **kw)]
    # the step time and a run's cost on this GPU (timing.py), as the setup stands
    est = c.estimate.set_gpu(q.gpu)
    one = est.slowest if isinstance(est, ParallelEstimate) else est
    out["time"] = one._time_dict()
    out["run_cost"] = one.run_cost(tokens=RUN_TOKENS) if one.step_seconds else None
    return out


#: the run whose cost ``answers`` (``vramwidget fit``) reports
RUN_TOKENS = 1e9
