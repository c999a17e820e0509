"""Where a setup fits: a batch x sequence-length grid of verdicts on one GPU.

>>> import vramwidget as vw
>>> df = vw.fit_map("llama-3.1-8b", "RTX 4090", method="qlora")        # doctest: +SKIP
>>> df.pivot(index="seq_len", columns="batch_size", values="state")    # doctest: +SKIP

Every cell is what :func:`vramwidget.estimate` gives for that batch and sequence length,
exactly: the grid is computed by the estimator's own operations
(:func:`vramwidget.estimate.size_grid_totals`) on numpy arrays, so a 64 x 64 grid costs
about as much as a few single estimates (the saved activations are exact polynomials in
batch and sequence, traced once).  The state of a cell is :mod:`vramwidget.verdict`'s:
fits, tight (within the estimate's own uncertainty) or does_not_fit, judged on the device
total (reserved + CUDA context) against the GPU's usable memory.
"""

from __future__ import annotations

from functools import reduce
from typing import Any, List, Optional, Sequence

from .architecture import load
from .errors import VramError
from .inputs import MAX_ITEMS, check_int, fail
from .estimate import estimate_setup, size_grid_totals
from .gpus import get_gpu
from .training import TrainingSetup

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


def _array_safe(s: TrainingSetup) -> bool:
    """Whether the estimator's size-dependent operations take arrays for this setup: Liger's
    chunk rows (a power of two) and activation offloading's stash (a min) are steps, so
    those setups are estimated cell by cell."""
    return getattr(s, "loss", "standard") != "liger" and not getattr(s, "activation_offloading", False)


def fit_map(model: Any, gpu: Any, *, batch_sizes: Optional[Sequence[int]] = None,
            seq_lens: Optional[Sequence[int]] = None, **setup: Any):
    """A pandas DataFrame with one row per (batch_size, seq_len): ``batch_size``,
    ``seq_len``, ``peak_allocated_bytes``, ``device_total_bytes``, ``band_bytes`` and
    ``state`` (fits | tight | does_not_fit on ``gpu``).

    ``setup`` takes the keyword arguments of :func:`vramwidget.estimate` (one GPU, the
    training step); ``batch_size`` and ``seq_len`` there are ignored (the grid sets them).
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
    if _array_safe(s):
        tot = size_grid_totals(arch, s, b, sq, lambda *xs: reduce(np.maximum, xs))
        peak = np.broadcast_to(np.asarray(tot["peak_allocated_bytes"], dtype=float), b.shape)
        reserved = np.broadcast_to(np.asarray(tot["reserved_bytes"], dtype=float), b.shape)
        context = tot["cuda_context_bytes"]
    else:  # a mechanism with integer steps in the sizes: one estimate per cell (still exact)
        ests = [estimate_setup(arch, s.replace(batch_size=int(x), seq_len=int(y))) for x, y in zip(b, sq)]
        peak = np.array([e.peak_allocated_bytes for e in ests], dtype=float)
        reserved = np.array([e.reserved_bytes for e in ests], dtype=float)
        context = ests[0].cuda_context_bytes
    device = reserved + context
    band = reserved * verdict.uncertainty()["rel_error"]
    cap = float(g.usable_bytes)
    tight = np.abs(cap - device) <= band
    state = np.where(tight, "tight", np.where(device < cap, "fits", "does_not_fit"))
    return pd.DataFrame({"batch_size": b, "seq_len": sq, "peak_allocated_bytes": peak,
                         "device_total_bytes": device, "band_bytes": band, "state": state})
