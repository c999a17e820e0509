"""The GPU catalog: how much memory each card has and which number formats it runs.

The data lives in ``data/gpus.json``; this module only reads it.  Two memory figures per
card:

``memory_bytes``
    the capacity as sold (the box says "80 GB"; for DRAM that is binary, 80 GiB).
``usable_bytes``
    what the driver reports as device memory (``nvidia-smi`` memory.total) where it is
    known, else ``memory_bytes``.  An estimate's device total (allocator reserve + CUDA
    context) must stay under it for the run to fit.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
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
    def usable_bytes(self) -> float:
        """Device memory the driver reports, else the capacity as sold."""
        return self.total_mib * MIB if self.total_mib else self.memory_bytes

    @property
    def usable_gib(self) -> float:
        return self.usable_bytes / GIB

    @property
    def cuda_total_bytes(self) -> float:
        """The total ``torch.cuda.mem_get_info()`` reports (what serving engines multiply by
        ``gpu_memory_utilization``): below nvidia-smi's figure by the driver's own reserve.
        Where the catalog has no such measurement, nvidia-smi's total (:attr:`usable_bytes`)."""
        return self.cuda_total_mib * MIB if self.cuda_total_mib else self.usable_bytes

    @property
    def cuda_total_source(self) -> str:
        """Where :attr:`cuda_total_bytes` comes from ("nvidia-smi" when it is that figure)."""
        return self.cuda_total_from if self.cuda_total_mib else "nvidia-smi"

    @property
    def cuda_context_bytes(self) -> float:
        """The CUDA context (non-torch memory at start-up) measured on this GPU, else the
        package's default (620.8 MiB, measured on the H200)."""
        return self.cuda_context_mib * MIB if self.cuda_context_mib else CUDA_CONTEXT_BYTES

    @property
    def cuda_context_source(self) -> str:
        """Where :attr:`cuda_context_bytes` comes from."""
        return self.cuda_context_from if self.cuda_context_mib else "default: 620.8 MiB measured on an H200"

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
        )
        for g in raw
    )


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


def gpu_names() -> List[str]:
    """Names of every GPU in the catalog."""
    return [g.name for g in list_gpus()]


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
