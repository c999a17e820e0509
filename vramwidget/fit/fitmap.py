"""Where a setup fits: a batch x sequence-length grid of verdicts on one GPU.

>>> import vramwidget as vw
>>> df = vw.fit_map("llama-3.1-8b", "RTX 4090", method="qlora")        # doctest: +SKIP
>>> df.pivot(index="seq_len", columns="batch_size", values="state")    # doctest: +SKIP

The allocated peak of every cell is what :func:`vramwidget.estimate` gives for that batch
and sequence length, exactly: the step plan is built once with its sizes as polynomials in
batch and sequence (``vramwidget.plan``) and read at every cell
(:func:`vramwidget.plan.grid_totals`).  The state of a cell is
:mod:`vramwidget.fit.verdict`'s: fits, tight (within the estimate's own uncertainty) or
does_not_fit, judged on the device total on the card (reserved + the card's own CUDA
context, :func:`vramwidget.fit.verdict.device_total_on`) against what CUDA reports as its total
(:func:`vramwidget.fit.verdict.capacity_bytes`).  Reserved memory needs an allocator replay per cell; only the cells whose state
depends on it are replayed (see :func:`fit_map`, and ``exact=True`` for all of them).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, List, Optional, Sequence, Tuple

from ..allocator import replays
from ..allocator.collector import with_gc_paused
from ..allocator.caching import allocation_size, collects_by_age, parse_alloc_conf
from ..model.architecture import load
from ..errors import VramError
from ..estimate import estimate_setup
from ..gpus import context_for, get_gpu
from ..inputs import MAX_ITEMS, check_int, fail
from ..plan import grid_totals, symbolic_plan
from ..training import TrainingSetup

#: default grid: powers of two
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_SEQ_LENS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


def _sizes(name: str, values: Optional[Sequence[int]], default: Sequence[int]) -> List[int]:
    if values is None:
        return list(default)
    if not isinstance(values, (list, tuple, range)) or len(values) > MAX_ITEMS:
        raise fail(name, f"expected a list of at most {MAX_ITEMS} whole numbers >= 1", values)
    out = []
    for v in values:
        if not hasattr(v, "__index__") or isinstance(v, bool):
            raise fail(name, "expected whole numbers >= 1", v)
        out.append(check_int(name, int(v), lo=1, what="expected whole numbers >= 1"))
    if not out:
        raise VramError(f"{name}: expected at least one size, got an empty list", field=name)
    return out


def _ranks(reserved: Any, context: float, cap: float, rel: float) -> Any:
    """0 fits, 1 tight, 2 does_not_fit: :func:`vramwidget.fit.verdict.state_of` on arrays (the
    device total ``reserved + context`` against ``cap`` with the band ``reserved x rel``).
    Non-decreasing in ``reserved``."""
    import numpy as np

    device = reserved + context
    band = reserved * rel
    return np.where(device > cap, 2, np.where(cap - device <= band, 1, 0))


def _tokens_only(ix: Any) -> bool:
    """Whether every size of a symbolic plan depends on the tokens T = b x s alone (a
    ``size.Step`` term where its argument does)."""
    from ..plan.size import Step

    tokens = ((0, 0, 0), (1, 1, 0))
    return ix is not None and all(all(a in tokens for a, _c in m.arg) if m.__class__ is Step else m in tokens
                                  for m in ix.basis)


def _chains(tokens_only: bool, b: Any, sq: Any, cells: Any) -> List[List[List[int]]]:
    """The cells to search, as chains of groups along which memory grows: when the plan's
    sizes depend on the tokens T = b x s only, one chain of the cells grouped by T (a group
    shares one replay: its events are the same); else one chain per sequence length, a
    cell per group, by batch size."""
    import numpy as np

    chains: List[List[List[int]]] = []
    if tokens_only:
        T = b[cells] * sq[cells]
        order = np.argsort(T, kind="stable")
        groups: List[List[int]] = []
        last = None
        for j in order:
            if T[j] != last:
                groups.append([])
                last = T[j]
            groups[-1].append(int(cells[j]))
        chains.append(groups)
        return chains
    for seq in np.unique(sq[cells]):
        col = cells[sq[cells] == seq]
        col = col[np.argsort(b[col], kind="stable")]
        chains.append([[int(i)] for i in col])
    return chains


def _sparse_reserved(arch: Any, s: TrainingSetup, b: Any, sq: Any, peak: Any, context: float, cap: float,
                     rel: float, exact: bool, gpu: Any = None) -> Tuple[Any, Any, Any]:
    """(reserved bytes, exact mask, state rank) of every cell, replaying only where the
    state depends on it (see :func:`fit_map`).  A replayed cell's reserve is the one on
    ``gpu`` (``gpus.judge_on``: where the unlimited reserve is over the card and the
    allocated peak is not, the replay with the card's capacity decides, as ``estimate``'s)."""
    import numpy as np

    n = len(b)
    reserved = np.zeros(n, dtype=float)
    known = np.zeros(n, dtype=bool)
    squeezed = np.zeros(n, dtype=bool)      # fits only by the allocator freeing its cache: tight at best
    refused = np.zeros(n, dtype=bool)       # the replay on the card runs out of memory: does not fit
    guessed = np.zeros(n, dtype=bool)       # refused, and its unlimited reserve not replayed
    rank = np.full(n, -1, dtype=np.int64)
    # garbage collection by age frees cached blocks below the limit: a capacity replay is then
    # not the unlimited one even without a retry, so the unlimited replay comes first
    by_age = collects_by_age(parse_alloc_conf(s.allocator))

    def ranks_of(cells: Any) -> Any:
        r = _ranks(reserved[cells], context, cap, rel)
        return np.where(refused[cells], 2, np.where(squeezed[cells] & (r == 0), 1, r))

    def evaluate(cells: Sequence[int]) -> None:
        for i in cells:
            if not known[i]:
                # the sizes only (checked by _sizes; no default or link of the setup reads
                # them: the solvers' bisections do the same)
                cell = replace(s, batch_size=int(b[i]), seq_len=int(sq[i]))
                pk = float(peak[i])
                known[i] = True
                over = pk + context > cap           # judge_on's case 1 (only with exact=True)
                if gpu is None or over or by_age or replays.cached_replay(arch, cell) is not None:
                    reserved[i] = replays.reserved_bytes(arch, cell, pk)
                    if gpu is not None and not over and reserved[i] + context > cap:
                        on_card = estimate_setup(arch, cell, gpu=gpu)    # gpus.judge_on's case 3
                        reserved[i] = on_card.reserved_bytes
                        squeezed[i] = on_card.squeezed
                    continue
                # the replay with the card's capacity first: without a retry it is the
                # unlimited replay (caching.limit_unreached; judge_on's case 2, the reserve
                # fits); with one and no error it fits only by the allocator freeing its cache
                # (case 3, squeezed); with an error it does not fit, and the unlimited reserve
                # judge_on reports is not replayed here
                res = replays.replay_training(arch, cell, cap - context)
                if res.oom is None:
                    reserved[i] = replays.reserved_of(res, pk)
                    squeezed[i] = res.num_alloc_retries > 0 and reserved[i] + context <= cap
                elif exact:         # the unlimited reserve, as judge_on reports it
                    refused[i] = True
                    reserved[i] = replays.reserved_bytes(arch, cell, pk)
                else:
                    refused[i] = guessed[i] = True
                    reserved[i] = max(pk * float(replays.carried_ratios(arch, s, b[i:i + 1], sq[i:i + 1])[0]),
                                      res.oom.reserved + allocation_size(res.oom.size))

    if exact:
        evaluate(range(n))
        return reserved, known, ranks_of(np.arange(n))
    # reserved >= allocated (the replay's own invariant, and reserved_bytes takes the max), and
    # the state only grows with reserved: a cell that does not fit on its allocated peak alone
    # does not fit whatever the fragmentation
    certain = _ranks(peak, context, cap, rel) == 2
    rank[certain] = 2
    todo = np.flatnonzero(~certain)
    if len(todo):
        tokens_only = _tokens_only(symbolic_plan(arch, s))

        def bounds(group: List[int]) -> Tuple[int, int]:
            evaluate(group)
            r = ranks_of(group)
            return int(r.min()), int(r.max())

        for groups in _chains(tokens_only, b, sq, todo):
            m = len(groups)
            lo, hi = 0, m                 # the first group where something is tight or over
            while lo < hi:
                mid = (lo + hi) // 2
                if bounds(groups[mid])[1] >= 1:
                    hi = mid
                else:
                    lo = mid + 1
            first_tight = lo
            lo, hi = first_tight, m       # the first group where nothing fits or is tight
            while lo < hi:
                mid = (lo + hi) // 2
                if bounds(groups[mid])[0] == 2:
                    hi = mid
                else:
                    lo = mid + 1
            first_over = lo
            # a group's cells share their events (one reserve, one state): the groups below
            # the first tight one fit, those from the first over on do not, and those between
            # (the strip around the line) are tight -- the bisections replayed some of them;
            # the others are not replayed (their totals provisional)
            for k, g in enumerate(groups):
                for i in g:
                    if not known[i]:
                        rank[i] = 0 if k < first_tight else (1 if k < first_over else 2)
    rank[known] = ranks_of(np.flatnonzero(known))
    far = ~known
    if far.any():
        reserved[far] = peak[far] * replays.carried_ratios(arch, s, b[far], sq[far])
    return reserved, known & ~guessed, rank


@with_gc_paused
def fit_map(model: Any, gpu: Any, *, batch_sizes: Optional[Sequence[int]] = None,
            seq_lens: Optional[Sequence[int]] = None, exact: bool = False, **setup: Any):
    """A pandas DataFrame with one row per (batch_size, seq_len): ``batch_size``,
    ``seq_len``, ``peak_allocated_bytes``, ``device_total_bytes`` (reserved + ``gpu``'s own
    CUDA context), ``band_bytes``, ``state`` (fits | tight | does_not_fit on ``gpu``) and
    ``reserved_exact``.

    ``setup`` takes the keyword arguments of :func:`vramwidget.estimate` (one GPU, the
    training step); ``batch_size`` and ``seq_len`` there are ignored (the grid sets them).
    For an encoder-decoder ``seq_len`` is the input (encoder) length: a given ``target_len``
    stays fixed on every cell, without one the target is as long as each cell's ``seq_len``.

    What is exact.  ``peak_allocated_bytes`` is, on every cell (the step plan read at each).  The device total needs the caching-allocator replay of the cell
    (reserved memory); by default only the cells whose state depends on it are replayed:

    * a cell whose allocated peak alone is over the line is ``does_not_fit`` whatever the
      fragmentation (reserved >= allocated), not replayed;
    * a cell to replay is replayed once, with the card's capacity (the allocator frees its
      cached blocks at the limit: ``gpus.judge_on``, as :func:`vramwidget.estimate` on the
      card): without a retry at the limit that replay is the unlimited one (its reserve
      fits); with one and no out-of-memory error the cell fits only that way, ``tight`` at
      best (``verdict.state_of``'s ``squeezed``); with the error it does not fit, and its
      device total is not replayed without the limit (``reserved_exact`` False; at least the
      reserve the refused request needed);
    * the other cells are searched along chains where memory grows (the tokens b x s when the
      allocation stream depends on them only, else batch size per sequence length): a
      bisection finds where the state first leaves ``fits`` and another where it is first
      ``does_not_fit``; cells below the first fit, cells from the second on do not, and the
      cells between (the strip around the capacity line) are tight.  Only the bisections'
      probes are replayed (this assumes the reserved memory grows with the size along a chain,
      as the allocated memory does; the cells of one token count share their events, so one
      state);
    * a cell not replayed shows its allocated peak times the reserved / allocated ratio of
      the nearest replayed size (``replays.provisional_reserved_bytes``'s mechanism) and
      ``reserved_exact`` False.

    Replayed cells (``reserved_exact``) equal :func:`vramwidget.estimate` in every column.
    ``exact=True`` replays every cell (without the limit too where the card refuses it).
    Measured (benchmarks/bench_fitmap.py): 64 x 64 cells of Llama 3.1 8B LoRA + full
    checkpointing on an H100 ran 13 replays (each with the card's capacity) and gave 44
    cells their exact device total, every state, peak and exact total equal to
    ``estimate(gpu=...)``'s; 0.16-0.21 s in single cold runs, 45-59x faster than 4,096
    ``estimate(gpu=...).device_total_bytes`` calls (8.5-9.5 s, 1,298 replays; 66-86x best
    of three).  Replaying the strip too (26 more replays, 163 exact cells) was 35-42x.
    The other device totals are provisional (``reserved_exact`` False).
    """
    import numpy as np
    import pandas as pd

    from . import verdict

    g = get_gpu(gpu)
    arch = load(model)
    bs = _sizes("batch_sizes", batch_sizes, DEFAULT_BATCH_SIZES)
    ss = _sizes("seq_lens", seq_lens, DEFAULT_SEQ_LENS)
    kw = {k: v for k, v in setup.items() if k not in ("batch_size", "seq_len")}
    s = TrainingSetup.from_kwargs(**kw)
    b = np.repeat(np.asarray(bs, dtype=np.int64), len(ss))
    sq = np.tile(np.asarray(ss, dtype=np.int64), len(bs))
    # validate the setup on this architecture (the checks estimate() makes) at the first cell
    estimate_setup(arch, s.replace(batch_size=int(b[0]), seq_len=int(sq[0])))
    ix = symbolic_plan(arch, s)
    context = context_for(g)[0]
    if ix is not None:
        t = s.target_len if s.target_len is not None else 1
        peak = grid_totals(ix, parse_alloc_conf(s.allocator), b, sq, t)["peak_allocated_bytes"].astype(float)
    else:  # a plan built for one size (Liger's power-of-two chunks): one estimate per cell
        peak = np.array([estimate_setup(arch, s.replace(batch_size=int(x), seq_len=int(y))).peak_allocated_bytes
                         for x, y in zip(b, sq)], dtype=float)
    rel = verdict.uncertainty()["rel_error"]
    cap = verdict.capacity_bytes(g)
    reserved, known, rank = _sparse_reserved(arch, s, b, sq, peak, context, cap, rel, bool(exact), g)
    state = np.asarray(verdict.STATES, dtype=object)[rank].astype(str)
    return pd.DataFrame({"batch_size": b, "seq_len": sq, "peak_allocated_bytes": peak,
                         "device_total_bytes": reserved + context, "band_bytes": reserved * rel, "state": state,
                         "reserved_exact": known})
