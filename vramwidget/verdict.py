"""Does it fit?  One measure, three states, and a margin from the estimator's own error.

The measure is the **device total on the card**: what the GPU must hold, the caching
allocator's reserved memory plus *that card's own* CUDA context
(:func:`device_total_on`: :func:`vramwidget.gpus.context_for`, by generation, torch and
CUDA version, with its source; e.g. 426 MiB on Ada, 620.8 MiB on Hopper), against what CUDA
reports as the card's total (:func:`capacity_bytes`: ``torch.cuda.mem_get_info()``'s
total, :attr:`vramwidget.gpus.GPU.cuda_total_bytes`: nvidia-smi's total less what the
driver keeps).  So a setup fits exactly when its reserved memory is at most what torch can
allocate there, :func:`vramwidget.gpus.usable_capacity` (total less the context).
Allocated memory is a part of it, never the figure judged.  An estimate made without a GPU
counts the H200's measured context (620.8 MiB); judged on a card, the card's own counts.
These two functions (in :mod:`vramwidget.gpus`, re-exported here) are the one place the
judged need and capacity are chosen: fit, fit_map, the suggestions, the CLI and the widget
all call them.

Three states:

``fits``           need + band < capacity: fits even if the prediction is off by the band;
``tight``          need <= capacity <= need + band: under the line, by less than the
                   estimator's own uncertainty (or only with the allocator freeing its cache
                   at the card's limit);
``does_not_fit``   need > capacity (within the band above the line it may still run: said,
                   not called tight).

The band is the uncertainty of the predicted figure: the reserved memory times the
``QUANTILE`` of the relative error of the predicted ``max_reserved`` over the measured
validation cases shipped with the package (``data/h200_training_a.jsonl``).  It is computed
from those cases on first use, so it tightens by itself when the reserved-memory prediction
improves.  The CUDA context is a measured figure per card and adds no band.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Dict, Optional

from .gpus import capacity_bytes, device_total_on, fits  # noqa: F401  (the fit rule, re-exported)
from .units import MIB

#: the validation field whose error sets the band: the predicted reserved memory
FIELD = "max_reserved_mib"
#: the band is the 90th percentile of |relative error| over the validation cases
#: (validate.summarize's p90): nine cases in ten were predicted closer than that
QUANTILE = 0.9
STATES = ("fits", "tight", "does_not_fit")
MEASURE = "device_total"


@lru_cache(maxsize=1)
def uncertainty() -> Dict[str, Any]:
    """The relative error band of the predicted reserved memory, with its provenance.

    ``rel_error``: the ``QUANTILE`` of |predicted / measured - 1| of ``max_reserved`` over
    the shipped validation cases; ``median`` and ``max`` beside it; ``n_cases``, ``source``.
    """
    from . import validate as V

    result = V.validate(V.BUILTIN_CASES)
    stats = result["summary"][FIELD]
    return {
        "field": FIELD,
        "quantile": QUANTILE,
        "rel_error": stats["p90"],
        "median": stats["median"],
        "max": stats["max"],
        "n_cases": stats["n"],
        "source": "vramwidget/data/h200_training_a.jsonl (measured on an H200, PyTorch's caching allocator)",
    }


def band_bytes(reserved_bytes: float) -> float:
    """The uncertainty of a predicted device total whose reserved part is ``reserved_bytes``."""
    return float(reserved_bytes) * uncertainty()["rel_error"]


def mib_text(nbytes: float) -> str:
    """'620.8' / '426': MiB to one decimal, without a trailing '.0'."""
    return f"{nbytes / MIB:,.1f}".removesuffix(".0")


def state_of(need_bytes: float, capacity_bytes: float, band: float, squeezed: bool = False) -> str:
    """fits | tight | does_not_fit for a need against a capacity with a band: one meaning per
    word.  Over the line is ``does_not_fit`` (within the band it may still run: the verdict's
    text says so); ``tight`` is under the line by less than the band (the estimator's own
    uncertainty decides).  ``squeezed``: the need is the reserve of a replay with the card's
    capacity, which fits only because the allocator frees its cached blocks at the card's
    limit (``gpus.judge_on``): tight at best (it filled the card; how far below the line it
    would stay is not a margin)."""
    if need_bytes > capacity_bytes:
        return "does_not_fit"
    if capacity_bytes - need_bytes <= band or squeezed:
        return "tight"
    return "fits"


def verdict(est: Any, gpu: Any, *, num_gpus: int = 1, replay: bool = True) -> Dict[str, Any]:
    """The verdict of an estimate (an Estimate, or a ParallelEstimate: its worst GPU) on a GPU.

    Returns ``{"state", "measure": "device_total", "need_bytes", "capacity_bytes",
    "headroom_bytes", "band_bytes", "headroom_pct", "band_rel", "gpu", "num_gpus",
    "context_bytes", "usable_capacity_bytes", "context_note", "capacity_note", "reserved_bytes",
    "unlimited_reserved_bytes", "allocator_note", "squeezed", "may_free"}``:
    ``need_bytes`` is :func:`device_total_on` (reserved on the card + its own CUDA context:
    :func:`vramwidget.gpus.judge_on`, where a training step whose unlimited reserve is over the
    card but whose allocated peak is not is replayed with the card's capacity, its allocator
    freeing cached blocks at the limit; ``allocator_note`` says so and
    ``unlimited_reserved_bytes`` is the reserve without a limit),
    ``capacity_bytes`` :func:`capacity_bytes` (what CUDA reports as the card's total);
    ``context_bytes`` is the card's CUDA context, ``usable_capacity_bytes`` what torch can
    allocate on it (``gpus.usable_capacity``), ``context_note`` one line with the context
    figure and its source, ``capacity_note`` the derivation of the usable capacity;
    ``headroom_bytes`` is negative when it does not fit; ``squeezed``: it fits only with the
    allocator freeing its cache at the card's limit (tight at best); ``may_free``: it does
    not fit by its reserve only, and no replay at the card's limit says it runs out.  A serving estimate that judges
    its own fit (``est.fits`` with a serving budget: the KV pool must hold a sequence)
    gives ``does_not_fit`` when it says so.  ``replay=False`` runs no replay with the card's
    capacity (:func:`vramwidget.gpus.judge_on`): where one is needed and not cached the
    verdict carries ``"provisional": True`` and the unlimited reserve.
    """
    from .gpus import context_for, get_gpu, judge_on, usable_capacity

    g = get_gpu(gpu)
    shown = getattr(est, "per_gpu", est)
    judged = judge_on(est, g, replay=replay)    # the reserve on this card (device_total_on's)
    reserved = judged["reserved_bytes"]
    need = judged["need_bytes"]
    cap = capacity_bytes(g)
    context, context_src = context_for(g)
    torch_can, capacity_src = usable_capacity(g)
    note = f"CUDA context on {g.name}: {mib_text(context)} MiB ({context_src})"
    built = getattr(shown, "cuda_context_bytes", None)
    if built is not None and abs(float(built) - context) >= MIB:
        note += (f"; judged with it, not the {mib_text(float(built))} MiB the estimate counts as made "
                 f"({getattr(shown, 'cuda_context_source', '')})")
    band = band_bytes(reserved)
    state = state_of(need, cap, band, judged["squeezed"])
    own = getattr(est, "fits", None) if getattr(est, "serving", None) else None
    if own is False:
        state = "does_not_fit"
    return {
        "state": state,
        "measure": MEASURE,
        "need_bytes": need,
        "capacity_bytes": cap,
        "headroom_bytes": cap - need,
        "band_bytes": band,
        "headroom_pct": (cap - need) / cap * 100.0 if cap else 0.0,
        "band_rel": uncertainty()["rel_error"],
        "gpu": g.name,
        "num_gpus": int(num_gpus),
        "context_bytes": context,
        "usable_capacity_bytes": torch_can,
        "context_note": note,
        "capacity_note": capacity_src,
        "reserved_bytes": reserved,
        "unlimited_reserved_bytes": judged["unlimited_reserved_bytes"],
        "allocator_note": judged["note"],
        "squeezed": bool(judged["squeezed"]),
        # over the line by its reserve only, with no replay at the card's limit saying it runs
        # out (none yet, or none modelled: inference, multi-GPU): the allocator may free its
        # cache there and run it
        "may_free": state == "does_not_fit" and judged["oom"] is None and own is not False
        and float(shown.peak_allocated_bytes) + context <= cap,
        **({"provisional": True} if judged["provisional"] else {}),
    }


def describe(v: Optional[Dict[str, Any]]) -> str:
    """One line: 'fits RTX 4090: 3.2 GiB (13%) to spare' / 'tight ...' / 'does not fit ...'."""
    if not v:
        return ""
    from .units import fmt_bytes

    who = f"{v['num_gpus']} × {v['gpu']}" if v.get("num_gpus", 1) > 1 else v["gpu"]
    h = v["headroom_bytes"]
    if v["state"] == "fits":
        return f"fits {who}: {fmt_bytes(h)} ({v['headroom_pct']:.0f}%) to spare"
    if v["state"] == "tight":
        if v.get("squeezed"):
            return f"tight on {who}: fits only with the allocator freeing its cache at the limit"
        return f"tight on {who}: {fmt_bytes(h)} to spare, within the ±{fmt_bytes(v['band_bytes'])} uncertainty"
    text = f"does not fit {who}: {fmt_bytes(-h)} over"
    if v.get("may_free"):
        return text + "; it may run with the allocator freeing its cache at the limit"
    if -h <= v["band_bytes"]:
        return text + f", within the ±{fmt_bytes(v['band_bytes'])} uncertainty"
    return text
