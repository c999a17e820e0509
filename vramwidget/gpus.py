"""The GPU catalog: how much memory each card has and which number formats it runs.

The data lives in ``data/gpus.json``; this module only reads it.  Two memory figures per
card:

``memory_bytes``
    the capacity as sold (the box says "80 GB"; for DRAM that is binary, 80 GiB).
``usable_bytes`` (= ``smi_total_bytes``)
    what the driver reports as device memory (``nvidia-smi`` memory.total) where it is
    known, else ``memory_bytes``.
``cuda_total_bytes``
    the device memory a process sees (``torch.cuda.mem_get_info()``'s total, the "total
    capacity" of torch's out-of-memory message): nvidia-smi's total less what the driver
    keeps for itself.  The verdict (:mod:`vramwidget.fit.verdict`) holds an estimate's device
    total (allocator reserve + the card's CUDA context) against it.

:func:`usable_capacity` says what torch itself can allocate on a card: that total less
the CUDA context, which depends on the GPU generation, the torch and CUDA versions (lazy
module loading) and, on GDDR cards, whether ECC is on.  Every figure comes with its source
(``data/gpus.json``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from statistics import median
from typing import Any, Dict, List, Optional, Tuple

from .errors import VramError
from .inputs import check_text, close_match, shown
from .units import CUDA_CONTEXT_BYTES, GIB, MIB

_DATA = Path(__file__).parent / "data" / "gpus.json"


@dataclass(frozen=True)
class GPU:
    """One card of the catalog."""

    name: str
    vendor: str
    architecture: str
    memory_gb: float
    total_mib: Optional[float]
    bf16: bool
    fp8: bool
    compute_capability: Optional[str] = None
    notes: str = ""
    aliases: Tuple[str, ...] = field(default=())
    cuda_total_mib: Optional[float] = None
    cuda_total_from: str = ""
    cuda_context_mib: Optional[float] = None
    cuda_context_from: str = ""
    #: dense peak TFLOP/s per matmul dtype (fp32 without TF32, tf32, bf16, fp16, fp8); None: unsupported
    tflops: Tuple[Tuple[str, Optional[float]], ...] = field(default=())
    memory_bandwidth_gb_per_s: Optional[float] = None
    pcie_gb_per_s: Optional[float] = None        # per direction
    nvlink_gb_per_s: Optional[float] = None      # per direction; None: no NVLink
    usd_per_gpu_hour: Optional[float] = None     # indicative on-demand price
    price_source: Optional[str] = None
    spec_source: Optional[str] = None
    #: GDDR cards: ECC's default state and the share of memory it takes when on (1/16)
    ecc_on_by_default: Optional[bool] = None
    ecc_reserved_fraction: float = 0.0

    def peak_flops_per_second(self, dtype: str, tf32: bool = False) -> Optional[float]:
        """Dense peak matmul FLOP/s for ``dtype`` (``float32``, ``bfloat16``, ``float16``,
        ``float8``); fp32 matmuls run as TF32 only when ``tf32`` is on (PyTorch's default
        is off: ``torch.backends.cuda.matmul.allow_tf32 = False``).  None when unknown."""
        t = dict(self.tflops)
        key = {"float32": "tf32" if tf32 else "fp32", "bfloat16": "bf16", "float16": "fp16",
               "float8": "fp8"}.get(dtype, "fp32")
        v = t.get(key)
        if v is None and key == "tf32":
            v = t.get("fp32")       # no TF32 units (Volta, Turing): plain fp32
        if v is None and key in ("bf16", "fp8"):
            v = t.get("fp16") if key == "bf16" else t.get("bf16") or t.get("fp16")   # emulated at best
        return v * 1e12 if v else None

    @property
    def memory_bandwidth_bytes_per_second(self) -> Optional[float]:
        """Peak memory bandwidth in bytes/s (the datasheet's GB/s are 10^9 bytes)."""
        return self.memory_bandwidth_gb_per_s * 1e9 if self.memory_bandwidth_gb_per_s else None

    @property
    def memory_bytes(self) -> float:
        """Capacity as sold, in bytes (the vendor's GB are binary for DRAM)."""
        return self.memory_gb * GIB

    @property
    def smi_total_bytes(self) -> float:
        """Device memory ``nvidia-smi`` reports (memory.total), else the capacity as sold."""
        return self.total_mib * MIB if self.total_mib else self.memory_bytes

    @property
    def usable_bytes(self) -> float:
        """Device memory the driver reports (:attr:`smi_total_bytes`); a process sees
        :attr:`cuda_total_bytes` of it, torch can allocate :func:`usable_capacity`."""
        return self.smi_total_bytes

    @property
    def usable_gib(self) -> float:
        return self.usable_bytes / GIB

    @property
    def cuda_total_bytes(self) -> float:
        """The total ``torch.cuda.mem_get_info()`` reports (what serving engines multiply by
        ``gpu_memory_utilization``): below nvidia-smi's figure by the driver's own reserve.
        Measured where the catalog has a source, else nvidia-smi's total less the driver's
        reserve of the same architecture (:func:`driver_reserve_bytes`)."""
        if self.cuda_total_mib:
            return self.cuda_total_mib * MIB
        return self.smi_total_bytes - driver_reserve_bytes(self.architecture)[0]

    @property
    def cuda_total_source(self) -> str:
        """Where :attr:`cuda_total_bytes` comes from."""
        if self.cuda_total_mib:
            return self.cuda_total_from
        reserve, why = driver_reserve_bytes(self.architecture)
        smi = f"nvidia-smi's {self.total_mib:,.0f} MiB" if self.total_mib else f"{self.memory_gb:g} GiB as sold"
        return f"derived: {smi} less the driver's reserve {reserve / MIB:.0f} MiB ({why})"

    @property
    def cuda_context_bytes(self) -> float:
        """The CUDA context (non-torch memory at start-up) measured on this GPU, else the
        figure of its architecture with lazy module loading (:func:`context_bytes`)."""
        return context_bytes(self)[0]

    @property
    def cuda_context_source(self) -> str:
        """Where :attr:`cuda_context_bytes` comes from."""
        return context_bytes(self)[1]

    @property
    def usable_capacity_bytes(self) -> float:
        """What torch can allocate on this card with a current torch and CUDA (:func:`usable_capacity`)."""
        return usable_capacity(self)[0]

    @property
    def label(self) -> str:
        """'H100 80GB (79.6 GiB usable)': what a drop-down shows."""
        return f"{self.name} ({self.usable_gib:.1f} GiB)"

    def supports(self, precision: str) -> Tuple[bool, str]:
        """Whether this card runs a training precision natively, and why not."""
        p = precision.lower()
        if "bf16" in p and not self.bf16:
            return False, f"{self.name} ({self.architecture}) has no bf16 math: use amp_fp16 or fp32"
        if "fp8" in p and not self.fp8:
            return False, f"{self.name} ({self.architecture}) has no fp8 tensor cores"
        return True, ""

    def to_dict(self) -> Dict[str, Any]:
        """A plain dict of this object (JSON-able)."""
        return {
            "name": self.name,
            "vendor": self.vendor,
            "architecture": self.architecture,
            "compute_capability": self.compute_capability,
            "memory_gb": self.memory_gb,
            "memory_bytes": int(self.memory_bytes),
            "usable_bytes": int(self.usable_bytes),
            "usable_gib": round(self.usable_gib, 3),
            "bf16": self.bf16,
            "fp8": self.fp8,
            "notes": self.notes,
            "tflops": dict(self.tflops),
            "memory_bandwidth_gb_per_s": self.memory_bandwidth_gb_per_s,
            "pcie_gb_per_s": self.pcie_gb_per_s,
            "nvlink_gb_per_s": self.nvlink_gb_per_s,
            "usd_per_gpu_hour": self.usd_per_gpu_hour,
            "price_source": self.price_source,
            "spec_source": self.spec_source,
        }


@lru_cache(maxsize=1)
def _catalog() -> Tuple[GPU, ...]:
    with open(_DATA, encoding="utf-8") as f:
        raw = json.load(f)["gpus"]
    return tuple(
        GPU(
            name=g["name"],
            vendor=g["vendor"],
            architecture=g["architecture"],
            memory_gb=float(g["memory_gb"]),
            total_mib=g.get("total_mib"),
            bf16=bool(g["bf16"]),
            fp8=bool(g["fp8"]),
            compute_capability=g.get("compute_capability"),
            notes=g.get("notes", ""),
            aliases=tuple(g.get("aliases", ())),
            cuda_total_mib=g.get("cuda_total_mib"),
            cuda_total_from=g.get("cuda_total_source", ""),
            cuda_context_mib=g.get("cuda_context_mib"),
            cuda_context_from=g.get("cuda_context_source", ""),
            tflops=tuple((k, None if v is None else float(v)) for k, v in (g.get("tflops") or {}).items()),
            memory_bandwidth_gb_per_s=g.get("memory_bandwidth_gb_per_s"),
            pcie_gb_per_s=g.get("pcie_gb_per_s"),
            nvlink_gb_per_s=g.get("nvlink_gb_per_s"),
            usd_per_gpu_hour=g.get("usd_per_gpu_hour"),
            price_source=g.get("price_source"),
            spec_source=g.get("spec_source"),
            ecc_on_by_default=g.get("ecc_on_by_default"),
            ecc_reserved_fraction=float(g.get("ecc_reserved_fraction") or 0.0),
        )
        for g in raw
    )


@lru_cache(maxsize=1)
def _context_table() -> Dict[str, Any]:
    with open(_DATA, encoding="utf-8") as f:
        return json.load(f)["cuda_context"]


@lru_cache(maxsize=None)
def driver_reserve_bytes(architecture: str) -> Tuple[float, str]:
    """What the driver keeps of the device memory nvidia-smi reports (nvidia-smi's total less
    ``mem_get_info()``'s): the median over the catalog's cards of ``architecture`` that have
    both figures, else over every card that has them.  Returns (bytes, how it was found)."""
    cards = {g.name: g for g in _catalog()}
    arch_vendor = next((g.vendor for g in _catalog() if g.architecture == architecture), "")
    pairs = [(g.name, g.total_mib - g.cuda_total_mib) for g in _catalog() if g.total_mib and g.cuda_total_mib]
    same = [(n, d) for n, d in pairs if cards[n].architecture == architecture]
    vendor = [(n, d) for n, d in pairs if cards[n].vendor == arch_vendor]
    if not (same or vendor):
        return 0.0, f"no measured card of {arch_vendor or architecture}: none subtracted"
    use, scope = (same, architecture) if same else (vendor, f"every measured {arch_vendor} card")
    value = float(median(d for _, d in use)) * MIB
    return value, f"median of {scope}: " + ", ".join(f"{n} {d:.0f}" for n, d in use)


def _version_tuple(text: Optional[str]) -> Optional[Tuple[int, ...]]:
    if text is None:
        return None
    parts = []
    for p in str(text).split("+")[0].split("."):
        digits = "".join(ch for ch in p if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    if not parts:
        raise VramError(f"version: cannot read a version number from {shown(text)} (e.g. '2.11' or '12.4')",
                        field="version")
    return tuple(parts)


def lazy_loading(torch_version: Optional[str] = None, cuda_version: Optional[str] = None) -> bool:
    """Whether CUDA kernels load lazily: torch >= 1.13 sets ``CUDA_MODULE_LOADING=LAZY`` with a
    CUDA runtime >= 11.7; from CUDA 12.2 the runtime does it by default.  Unknown versions
    (None) are taken as current ones."""
    t = _context_table()["lazy_loading"]
    tv, cv = _version_tuple(torch_version), _version_tuple(cuda_version)
    if cv is not None and cv < _version_tuple(t["min_cuda"]):
        return False
    if cv is not None and cv >= _version_tuple(t["cuda_default"]):
        return True
    return tv is None or tv >= _version_tuple(t["min_torch"])


def context_bytes(gpu: "str | GPU", torch_version: Optional[str] = None,
                  cuda_version: Optional[str] = None) -> Tuple[float, str]:
    """The CUDA context on ``gpu`` (bytes outside torch's allocator once CUDA is started) and
    its source: the card's own measurement, else its architecture's (``data/gpus.json``
    ``cuda_context``), plus eager module loading's extra where kernels load eagerly."""
    g = get_gpu(gpu)
    table = _context_table()
    if g.cuda_context_mib:
        mib, src = float(g.cuda_context_mib), g.cuda_context_from
    else:
        row = table["by_architecture"].get(g.architecture)
        if row is None:
            mib, src = CUDA_CONTEXT_BYTES / MIB, "no figure for this architecture: the H200's 620.8 MiB"
        else:
            mib, src = float(row["mib"]), f"{g.architecture}: {row['source']}"
    if not lazy_loading(torch_version, cuda_version):
        mib += float(table["eager_extra_mib"])
        src += f"; + {table['eager_extra_mib']:.0f} MiB for eager module loading ({table['eager_source']})"
    return mib * MIB, src


#: where the context an estimate counts comes from when no GPU is chosen
NO_GPU_CONTEXT_SOURCE = ("no GPU chosen: the H200's 620.8 MiB, measured with this package's validation cases "
                         "(data/h200_training_a.jsonl env.cuda_context_mib; torch 2.11.0+cu130)")


def context_for(gpu: "str | GPU | None") -> Tuple[float, str]:
    """The CUDA context an estimate counts in its device total, and its source: the chosen
    card's own (:func:`context_bytes`, current torch and CUDA), or with no GPU chosen
    (None) the H200 measurement of the validation cases (``units.CUDA_CONTEXT_BYTES``).
    The one place an estimate's context is chosen (``Estimate.set_gpu``, ``fit_map``)."""
    if gpu is None:
        return CUDA_CONTEXT_BYTES, NO_GPU_CONTEXT_SOURCE
    return context_bytes(gpu)


# the fit rule: the one place the judged need and capacity are chosen (vramwidget.fit.verdict,
# fit, fit_map, the suggestions, inference, the CLI and the widget call these)

def capacity_bytes(gpu: Any) -> float:
    """The capacity a device total is judged against on ``gpu``: what CUDA reports as the
    card's total (``torch.cuda.mem_get_info()``'s total, the "total capacity" of torch's
    out-of-memory message), :attr:`vramwidget.gpus.GPU.cuda_total_bytes` with its source."""
    return float(get_gpu(gpu).cuda_total_bytes)


def device_total_on(est: Any, gpu: Any) -> float:
    """The device total of ``est`` (an Estimate, or a ParallelEstimate: its worst GPU) on
    ``gpu``: the memory its allocator reserves on that card (:func:`judge_on`) plus that
    card's own CUDA context (:func:`vramwidget.gpus.context_for`).  Equal to
    ``est.device_total_bytes`` when the estimate was made on ``gpu`` (``Estimate.set_gpu``)."""
    return judge_on(est, gpu)["need_bytes"]


#: (id(arch), setup, capacity in bytes) -> (arch, replay): the capacity replays of judge_on
CAPACITY_REPLAYS: Dict[Tuple[Any, ...], Tuple[Any, Any]] = {}
_MAX_CAPACITY_REPLAYS = 256


def _sources(est: Any) -> Any:
    """The estimate's :class:`~vramwidget.result.EstimateSources` (None for an object without)."""
    return getattr(est, "sources", None)


def _capacity_key(est: Any, torch_capacity: float) -> Optional[Tuple[Any, ...]]:
    run = getattr(_sources(est), "replay_key", None)
    if run is None:
        return None
    try:
        hash(run[1])
        return (id(run[0]), run[1], int(torch_capacity))
    except TypeError:       # a setup with a dict field: its repr names every field
        return (id(run[0]), repr(run[1]), int(torch_capacity))


def _cached_capacity_replay(est: Any, torch_capacity: float) -> Any:
    key = _capacity_key(est, torch_capacity)
    if key is None:
        return None
    hit = CAPACITY_REPLAYS.get(key)
    run = _sources(est).replay_key
    return hit[1] if hit is not None and hit[0] is run[0] else None


def _capacity_replay(est: Any, torch_capacity: float) -> Any:
    """``est.replay(capacity_bytes=torch_capacity)``, cached per (architecture, setup, capacity)."""
    hit = _cached_capacity_replay(est, torch_capacity)
    if hit is not None:
        return hit
    res = est.replay(capacity_bytes=torch_capacity)
    key = _capacity_key(est, torch_capacity)
    if key is not None:
        if len(CAPACITY_REPLAYS) >= _MAX_CAPACITY_REPLAYS:
            CAPACITY_REPLAYS.clear()
        CAPACITY_REPLAYS[key] = (_sources(est).replay_key[0], res)
    return res


def _unlimited_reserved(est: Any) -> float:
    """What ``est``'s allocator reserves with no card limit (``Estimate.unlimited_reserved_bytes``;
    the ``reserved_bytes`` of an estimate without one, a ParallelEstimate's worst GPU's)."""
    one_gpu = getattr(est, "per_gpu", est)
    for obj in (est, one_gpu):
        r = getattr(obj, "unlimited_reserved_bytes", None)
        if r is not None:
            return float(r)
    return float(getattr(est, "reserved_bytes", one_gpu.reserved_bytes))


def _judges_on_card(est: Any) -> bool:
    """Whether ``est`` has a replay its allocator's free-and-retry at a card's limit can be
    judged with (a training step's; a parallel run's worst GPU, through its per-GPU estimate)."""
    return bool(getattr(est, "capacity_judged", False)) and getattr(_sources(est), "replay", None) is not None


def judge_on(est: Any, gpu: Any, *, replay: bool = True) -> Dict[str, Any]:
    """Whether ``est`` fits ``gpu``, with the caching allocator's free-and-retry at the card's
    limit: the one place the reserve on a card is decided (``Estimate.reserved_bytes`` on its
    own card, and through :func:`device_total_on` the verdict, fit, fit_map and the widget).

    An unlimited replay keeps every segment it ever reserved; on a card, when ``cudaMalloc``
    of a new segment fails the allocator frees its cached whole segments and tries again
    (torch ``c10/cuda/CUDACachingAllocator.cpp``, ``DeviceCachingAllocator::malloc``:
    ``alloc_block(params, false)`` || ``release_available_cached_blocks`` then ``alloc_block``
    || ``release_cached_blocks`` then ``alloc_block(params, true)``; only then the OOM error;
    modelled in ``allocator.CachingAllocator.malloc``).  So with ``cap`` = :func:`capacity_bytes`
    and ``context`` = the card's own CUDA context (:func:`context_for`):

    1. allocated peak + context > cap: does not fit (reserved >= allocated; no capacity replay);
    2. unlimited reserved + context <= cap: fits, with that reserve;
    3. otherwise a training step is replayed with ``cap - context`` as what torch may reserve
       (``est.replay(capacity_bytes=...)``, cached per setup and capacity): it fits exactly
       when that replay has no out-of-memory error, and the reserve on this card is that
       replay's (``max_reserved_bytes``).  With an error the unlimited reserve stays (over the
       line).  Inference's generate() is judged the same way (its replay at a capacity:
       ``allocator.replay_runs_on_card``); estimates without such a replay keep the unlimited
       reserve.

    ``replay=False`` runs no capacity replay: where one is needed and not cached yet the
    unlimited reserve is kept and ``"provisional"`` is True (the widget's update path, which
    leaves the replay to its worker).

    Returns ``{"fits", "need_bytes" (reserved on this card + context), "reserved_bytes" (on
    this card), "unlimited_reserved_bytes", "context_bytes", "capacity_bytes", "case"
    ("peak" | "reserve" | "capacity_replay"), "oom" (the failing request or None), "note",
    "provisional", "squeezed" (it fits only by the allocator freeing its cached blocks at the
    limit: the verdict's state is tight at best, ``verdict.state_of``)}``.
    """
    g = get_gpu(gpu)
    cap = capacity_bytes(g)
    context = context_for(g)[0]
    inner = getattr(est, "per_gpu", est)
    if inner is not est and _judges_on_card(inner):
        return judge_on(inner, g, replay=replay)    # a parallel run judged by its worst GPU's estimate
    out: Dict[str, Any] = {"context_bytes": context, "capacity_bytes": cap, "oom": None, "note": "",
                           "provisional": False, "squeezed": False}
    peak = float(est.peak_allocated_bytes)
    reserved = _unlimited_reserved(est)
    out.update(unlimited_reserved_bytes=reserved)
    given = getattr(est, "_on_card", None)
    if given is not None and _judges_on_card(est) and getattr(est, "gpu", None) == g:
        # made on this card and already judged (or drawn with a provisional reserve): that one
        done = getattr(est, "_judged", None)
        if done is not None and done["reserved_bytes"] == given:
            return dict(done)
        case = "capacity_replay" if given != reserved else ("peak" if peak + context > cap else "reserve")
        out.update(fits=given + context <= cap, case=case, reserved_bytes=float(given), need_bytes=given + context,
                   note=getattr(est, "allocator_note", ""), squeezed=given + context <= cap < reserved + context)
        return out
    if peak + context > cap:
        out.update(fits=False, case="peak", reserved_bytes=reserved, need_bytes=reserved + context)
        return out
    if reserved + context <= cap or not _judges_on_card(est):
        out.update(fits=reserved + context <= cap, case="reserve", reserved_bytes=reserved,
                   need_bytes=reserved + context)
        return out
    res = _capacity_replay(est, cap - context) if replay else _cached_capacity_replay(est, cap - context)
    if res is None:     # not replayed yet (replay=False): the unlimited reserve for now
        out.update(fits=False, case="capacity_replay", reserved_bytes=reserved, need_bytes=reserved + context,
                   provisional=True)
        return out
    if res.oom is not None:
        out.update(fits=False, case="capacity_replay", reserved_bytes=reserved, need_bytes=reserved + context,
                   oom=res.oom,
                   note=(f"at {g.name}'s limit the allocator frees its cached blocks and still runs out of "
                         f"memory: {res.oom}"))
        return out
    of = getattr(_sources(est), "reserved_from_replay", None)
    on_card = float(of(res)) if of is not None else float(max(res.max_reserved_bytes, peak))
    on_card = min(on_card, reserved)
    fits_here = on_card + context <= cap
    out.update(fits=fits_here, case="capacity_replay", reserved_bytes=on_card,
               need_bytes=on_card + context, squeezed=fits_here,
               note=(f"at {g.name}'s limit the allocator frees its cached blocks and retries (a device "
                     f"synchronization each time; tight at best): reserved on this card {on_card / GIB:.2f} GiB, "
                     f"{reserved / GIB:.2f} GiB without a limit"
                     + ("" if fits_here else " (this step's allocated peak with the cached blocks the replay "
                        "keeps at its own peak: still over the card)")))
    return out


def capacity_shortfall(est: Any, gpu: GPU) -> Optional[float]:
    """Bytes by which ``est``'s capacity replay on ``gpu`` (already run and cached: none is
    run here) failed: the reserve left after the free-and-retry plus the refused request,
    over what torch may reserve; None where no such replay failed.  A search for the line
    (``fit.solver``'s largest batch or sequence) guesses its next probe from it."""
    res = _cached_capacity_replay(est, capacity_bytes(gpu) - context_for(gpu)[0])
    if res is None or res.oom is None:
        return None
    oom = res.oom
    from .allocator.caching import K_MIN_BLOCK_SIZE

    return float(max(oom.reserved + oom.size - oom.capacity, K_MIN_BLOCK_SIZE))   # at least one block


def fits_on_card(est: Any, gpu: GPU) -> Optional[bool]:
    """Whether a one-GPU estimate on ``gpu`` whose allocated peak fits there fits the card,
    from one replay with the card's capacity, without the unlimited replay first; None where
    this does not decide (a parallel run; an estimate whose unlimited replay is cached, which
    ``device_total_bytes`` reads at no cost).

    The same answer as ``fits(device_total_bytes, ...)`` (``gpus.judge_on``): a replay with
    a capacity does what the unlimited one does until a segment would pass the capacity, so
    when the unlimited reserve fits this replay has no out-of-memory error; when it does not,
    judge_on's answer is that replay's: fits exactly without an error (its reserve is at most
    the capacity, its allocated peak fits: checked before)."""
    res = _first_capacity_replay(est, gpu)
    return None if res is None else res.oom is None


def _first_capacity_replay(est: Any, gpu: GPU) -> Any:
    """The replay with ``gpu``'s capacity of ``est`` (a parallel run: its worst GPU's
    estimate, as judge_on judges it), run before its unlimited replay; None where
    :func:`fits_on_card` does not decide."""
    inner = getattr(est, "per_gpu", est)
    if inner is not est:
        if not _judges_on_card(inner):
            return None
        est = inner
    if not _judges_on_card(est) or getattr(est, "gpu", None) != gpu:
        return None
    if getattr(_sources(est), "replay_key", None) is None or getattr(est, "unlimited_reserved_exact", True):
        return None
    if est.peak_allocated_bytes + context_for(gpu)[0] > capacity_bytes(gpu):
        return None         # judge_on's case 1: no replay decides it
    return _capacity_replay(est, capacity_bytes(gpu) - context_for(gpu)[0])


def reaches_limit_on_card(est: Any, gpu: GPU) -> Optional[bool]:
    """Whether ``est``'s replay with ``gpu``'s capacity reaches the limit (a retry, or an
    out-of-memory error), from that one replay, run before the unlimited one; None where
    this does not decide (as :func:`fits_on_card`, and with garbage collection by age).

    True means the unlimited reserve is over the card, so judge_on's answer is that replay's:
    does not fit (an error) or fits only by the allocator freeing its cached blocks, tight at
    best (``squeezed``): never the state ``fits``.  False means the replay is the unlimited
    one (``caching.limit_unreached``; the replays cache it as that), and the reserve fits."""
    from .allocator.caching import collects_by_age, limit_unreached, parse_alloc_conf

    cfg = parse_alloc_conf((getattr(est, "setup", None) or {}).get("allocator") or "default")
    if collects_by_age(cfg):
        return None         # the two replays part below the limit
    res = _first_capacity_replay(est, gpu)
    if res is None:
        return None
    return not limit_unreached(res, cfg)


def fits(need_bytes: float, capacity: float) -> bool:
    """The fit rule without the band: the device total at most the capacity."""
    return need_bytes <= capacity


def usable_capacity(gpu: "str | GPU", *, torch_version: Optional[str] = None, cuda_version: Optional[str] = None,
                    ecc: Optional[bool] = None) -> Tuple[float, str]:
    """What torch can allocate on ``gpu``: the device memory a process sees less the CUDA
    context.  Returns (bytes, source text).

    ``torch_version`` / ``cuda_version`` (e.g. ``"2.11"``, ``"12.4"``; None: current ones)
    decide lazy module loading; ``ecc`` (None: the card's default) on a GDDR card moves
    1/16 of nvidia-smi's total in or out.  The figures and their sources are in
    ``data/gpus.json``.
    """
    g = get_gpu(gpu)
    if ecc is not None and not isinstance(ecc, bool):
        raise VramError(f"ecc: must be True, False or None; got {shown(ecc)}", field="ecc")
    total, total_src = g.cuda_total_bytes, g.cuda_total_source
    if ecc is not None and g.ecc_on_by_default is not None and ecc != g.ecc_on_by_default and g.ecc_reserved_fraction:
        keep = 1.0 - g.ecc_reserved_fraction
        smi = g.smi_total_bytes * (keep if ecc else 1.0 / keep)
        reserve = g.smi_total_bytes - total
        total = smi - reserve
        total_src += f"; ECC {'on' if ecc else 'off'}: nvidia-smi's total x {keep if ecc else 1 / keep:.4f}"
    ctx, ctx_src = context_bytes(g, torch_version, cuda_version)
    text = (f"{g.name}: {total / GIB:.2f} GiB device memory ({total_src}) less the CUDA context "
            f"{ctx / MIB:.0f} MiB ({ctx_src})")
    return total - ctx, text


def _key(name: str) -> str:
    return "".join(ch for ch in str(name).lower() if ch.isalnum())


@lru_cache(maxsize=1)
def _index() -> Dict[str, GPU]:
    idx: Dict[str, GPU] = {}
    for g in _catalog():
        for n in (g.name,) + g.aliases:
            idx.setdefault(_key(n), g)
    return idx


def list_gpus() -> List[GPU]:
    """Every card in the catalog, smallest memory first."""
    return sorted(_catalog(), key=lambda g: (g.usable_bytes, g.name))


def get_gpu(name: "str | GPU") -> GPU:
    """The card called ``name`` (case, spaces and dashes ignored; aliases accepted).

    Raises :class:`VramError` naming close matches when the name is unknown.
    """
    if isinstance(name, GPU):
        return name
    check_text("gpu", name, max_chars=256, what="must be a GPU name (text) like 'H100-80GB'")
    g = _index().get(_key(name))
    if g is not None:
        return g
    names = [x.name for x in _catalog()]
    spelled = {n.lower(): g.name for g in _catalog() for n in (g.name,) + g.aliases}
    close = []
    for m in close_match(name.lower(), list(spelled), n=8, cutoff=0.4):
        if spelled[m] not in close:
            close.append(spelled[m])
    close = close[:3]
    hint = f"; did you mean {', '.join(close)}?" if close else f"; known: {', '.join(names)}"
    raise VramError(f"gpu: unknown GPU {shown(name)}{hint}", field="gpu")
