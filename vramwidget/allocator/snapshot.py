"""Memory snapshots in PyTorch's format: write the replay as one, read a user's run.

``torch.cuda.memory._snapshot()`` (with ``_record_memory_history`` on) returns a dict:
``segments`` (each cudaMalloc'd segment: ``address``, ``total_size``, ``segment_type``,
``blocks`` with ``address``, ``size``, ``requested_size``, ``state`` and ``frames``) and
``device_traces`` (per device, the actions ``alloc``, ``free_requested``, ``free_completed``,
``segment_alloc``, ``segment_free``, ``segment_map``, ``segment_unmap``, ``oom``, each with
``addr``, ``size``, ``stream`` and ``frames`` of ``filename``, ``line``, ``name``).  That is
what ``torch/cuda/_memory_viz.py`` (and pytorch.org/memory_viz) draws.

:func:`to_snapshot` turns an allocator replay (``allocator.ReplayResult`` recorded with
``record=True``) into that dict; every allocation's frame names the estimate's category and
tensor (``filename`` ``vramwidget:<category>``).  :func:`load_snapshot` reads a pickle of a
real run and breaks its memory down into the estimate's categories from the frames: at the
allocated peak of its trace, and what was live when the snapshot was taken.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Tuple

from ..errors import VramError

#: the estimate's categories, in the order ``result.COMPONENT_KINDS`` draws them
CATEGORIES = ("weights", "quantization constants", "adapters", "gradients", "optimizer states", "activations",
              "logits and loss", "optimizer temporaries", "workspace", "other")
FRAME_PREFIX = "vramwidget:"


def category_of_label(label: str) -> str:
    """The estimate's category of one replayed allocation, from its event label."""
    low = label.lower()
    if "cublas" in low:
        return "workspace"
    if "quantization constants" in low or "absmax" in low:
        return "quantization constants" if "absmax" not in low else "optimizer states"
    if "sqrt(exp_avg_sq)" in low or "update" in low or "as fp32" in low and ("grad as" in low or "parameter as" in low):
        return "optimizer temporaries"
    if "state" in low or "exp_avg" in low:
        return "optimizer states"
    if low.endswith(" grad") or "grad (tied" in low or " grad " in low and "grad of" not in low:
        return "gradients"
    if "lora_a" in low and "output" not in low or "lora_b" in low and "output" not in low:
        return "adapters"
    if any(k in low for k in ("logits", "log_softmax", "nll_loss")):
        return "logits and loss"
    if low.endswith(".weight") or low.endswith(".bias") or "checkpoint tensor" in low or "(fp32)" in low \
            and low.startswith("model.") or "lm_head (before tying)" in low:
        return "weights"
    if "weight cast" in low:
        return "weights"
    return "activations"


def to_snapshot(res: Any, device: int = 0) -> Dict[str, Any]:
    """A ``torch.cuda.memory._snapshot()``-shaped dict of a recorded replay (``record=True``)."""
    if not res.trace and not res.segments:
        raise ValueError("the replay was not recorded (replay(..., record=True))")

    def frames(label: str) -> List[Dict[str, Any]]:
        return [{"filename": FRAME_PREFIX + category_of_label(label), "line": 0, "name": label}]

    segments = []
    for addr, size, small, blocks in res.segments:
        out_blocks = []
        for baddr, bsize, requested, allocated, label in blocks:
            out_blocks.append({"address": baddr, "size": bsize,
                               "requested_size": requested if allocated else bsize,
                               "state": "active_allocated" if allocated else "inactive",
                               "frames": frames(label) if allocated else []})
        allocated_size = sum(b["size"] for b in out_blocks if b["state"] == "active_allocated")
        segments.append({"device": device, "address": addr, "total_size": size, "allocated_size": allocated_size,
                         "active_size": allocated_size, "requested_size": allocated_size, "stream": 0,
                         "segment_type": "small" if small else "large", "segment_pool_id": (0, 0),
                         "is_expandable": False, "frames": [], "blocks": out_blocks})
    trace = [{"action": action, "addr": addr, "size": size, "stream": 0,
              "frames": frames(label) if action in ("alloc", "free_requested", "free_completed") else []}
             for action, addr, size, label in res.trace]
    if res.oom is not None:
        trace.append({"action": "oom", "addr": 0, "size": int(res.oom.size), "stream": 0,
                      "device_free": max(0, int(res.oom.capacity - res.oom.reserved)),
                      "frames": frames(res.oom.label)})
    return {"segments": segments, "device_traces": [trace] if device == 0 else [[]] * device + [trace],
            "allocator_settings": {}}


# ----------------------------------------------------------------------------------
# Reading a real snapshot
# ----------------------------------------------------------------------------------

#: (where in a frame, what it contains, category): the first rule a frame stack matches wins;
#: stacks are read from the innermost frame out.  Files and functions are those of PyTorch,
#: transformers, peft and bitsandbytes that allocate each kind of tensor.
_RULES: Tuple[Tuple[str, str, str], ...] = (
    ("filename", FRAME_PREFIX, ""),                       # our own snapshots: the category is in the file name
    ("name", "_init_group", "optimizer states"),          # torch/optim/adam*.py, sgd.py: lazily created states
    ("name", "init_state", "optimizer states"),           # bitsandbytes/optim/optimizer.py
    ("name", "_init_state", "optimizer states"),
    ("filename", "bitsandbytes/optim", "optimizer temporaries"),
    ("filename", "torch/optim", "optimizer temporaries"),
    ("filename", "transformers/optimization.py", "optimizer temporaries"),
    ("name", "zero_grad", "gradients"),
    ("filename", "loss_utils.py", "logits and loss"),     # transformers/loss/loss_utils.py ForCausalLMLoss
    ("name", "cross_entropy", "logits and loss"),
    ("name", "quantize_4bit", "quantization constants"),
    ("filename", "peft/tuners", "adapters"),
    ("name", "from_pretrained", "weights"),
    ("name", "from_config", "weights"),
    ("name", "_load_state_dict", "weights"),
    ("name", "load_state_dict", "weights"),
    ("name", "prepare_model_for_kbit_training", "weights"),
    ("name", "_apply", "weights"),                        # nn.Module.to / cuda / half
    ("name", "backward", "gradients"),                    # torch/_tensor.py backward, autograd.backward
    ("filename", "torch/autograd", "gradients"),
    ("name", "forward", "activations"),
    ("filename", "modeling_", "activations"),
    ("filename", "torch/nn/", "activations"),
)


def category_of_frames(frames: Iterable[Dict[str, Any]]) -> str:
    """The estimate's category of an allocation from its Python frames (innermost first, as
    torch records them): the first rule of ``_RULES`` that any frame matches."""
    frames = list(frames or [])
    for f in frames:
        fn = str(f.get("filename", "")).replace("\\", "/")
        if fn.startswith(FRAME_PREFIX):
            cat = fn[len(FRAME_PREFIX):]
            return cat if cat in CATEGORIES else "other"
    for where, needle, cat in _RULES[1:]:
        for f in frames:
            text = str(f.get(where, "")).replace("\\", "/")
            if needle in text:
                return cat
    return "other" if frames else "workspace"


@dataclass
class SnapshotBreakdown:
    """A real run's memory by the estimate's categories (bytes)."""

    at_peak: Dict[str, float]
    at_snapshot: Dict[str, float]
    peak_allocated_bytes: float
    max_reserved_bytes: float
    reserved_bytes: float
    expandable_segments: bool
    segments: int
    notes: List[str] = field(default_factory=list)

    @property
    def fragmentation_bytes(self) -> float:
        """Reserved but not allocated when the snapshot was taken."""
        return self.reserved_bytes - sum(self.at_snapshot.values())

    def to_dict(self) -> Dict[str, Any]:
        """A plain dict (JSON-able)."""
        return {"at_peak": dict(self.at_peak), "at_snapshot": dict(self.at_snapshot),
                "peak_allocated_bytes": self.peak_allocated_bytes, "max_reserved_bytes": self.max_reserved_bytes,
                "reserved_bytes": self.reserved_bytes, "fragmentation_bytes": self.fragmentation_bytes,
                "expandable_segments": self.expandable_segments, "segments": self.segments, "notes": list(self.notes)}


class _Refused(Exception):
    """A pickle asked for a global (a class or function) or a persistent id."""


class _DataOnly(pickle.Unpickler):
    """An unpickler for data only: ``torch.cuda.memory._snapshot()`` is dicts, lists, strings,
    numbers and booleans, which pickle writes with its own opcodes; a global (a class, a
    function such as ``os.system`` that a crafted ``__reduce__`` asks for) is refused before
    anything is imported or called (the pattern of the ``pickle`` docs' "Restricting
    Globals", with nothing allowed)."""

    def find_class(self, module: str, name: str) -> Any:
        raise _Refused(f"{str(module)[:60]}.{str(name)[:60]}")

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused(f"persistent id {str(pid)[:60]!r}")


def load_snapshot(path_or_data: Any) -> SnapshotBreakdown:
    """Read a ``torch.cuda.memory._snapshot()`` pickle (a path, bytes, or the dict itself) and
    break it down by the estimate's categories.  The pickle is read as data only
    (:class:`_DataOnly`): one that names a class or function is refused, so a snapshot someone
    sent cannot run code on load.

    The trace (``device_traces``) is replayed: every allocation gets the category of its
    frames; ``at_peak`` is the breakdown when allocated memory was highest, ``at_snapshot``
    the live blocks of ``segments``.  Autograd's working buffers carry the frames of the
    ``backward()`` call, so they count as gradients here.
    """
    data = _read(path_or_data)
    segs = data.get("segments")
    traces = data.get("device_traces")
    if not isinstance(segs, list) or not isinstance(traces, list):
        raise VramError("snapshot: not a torch.cuda.memory._snapshot() dict (no 'segments' / 'device_traces')",
                        field="snapshot")
    at_snapshot = {c: 0.0 for c in CATEGORIES}
    reserved = 0.0
    expandable = False
    for seg in segs:
        reserved += float(seg.get("total_size", 0))
        expandable = expandable or bool(seg.get("is_expandable", False))
        for b in seg.get("blocks", []):
            if b.get("state") == "active_allocated":
                at_snapshot[category_of_frames(b.get("frames", []))] += float(b.get("size", 0))
    trace = max((t for t in traces if t), key=len, default=[])
    live: Dict[int, Tuple[float, str]] = {}
    cats = {c: 0.0 for c in CATEGORIES}
    total = peak = 0.0
    at_peak = dict(cats)
    seg_reserved = max_reserved = 0.0
    notes: List[str] = []
    for e in trace:
        act = e.get("action")
        size = float(e.get("size", 0))
        if act == "alloc":
            cat = category_of_frames(e.get("frames", []))
            live[e.get("addr")] = (size, cat)
            cats[cat] += size
            total += size
            if total > peak:
                peak, at_peak = total, dict(cats)
        elif act == "free_completed":
            hit = live.pop(e.get("addr"), None)
            if hit is not None:
                cats[hit[1]] -= hit[0]
                total -= hit[0]
        elif act in ("segment_alloc", "segment_map"):
            seg_reserved += size
            max_reserved = max(max_reserved, seg_reserved)
        elif act in ("segment_free", "segment_unmap"):
            seg_reserved -= size
        elif act == "oom":
            notes.append(f"out of memory: {size / 2**20:.1f} MiB requested")
    if not trace:
        notes.append("no trace (record_memory_history was off): only the live blocks are broken down")
    return SnapshotBreakdown(at_peak={k: v for k, v in at_peak.items() if v},
                             at_snapshot={k: v for k, v in at_snapshot.items() if v},
                             peak_allocated_bytes=peak, max_reserved_bytes=max(max_reserved, reserved),
                             reserved_bytes=reserved, expandable_segments=expandable, segments=len(segs), notes=notes)


def _read(src: Any) -> Dict[str, Any]:
    if isinstance(src, dict):
        return src
    try:
        if isinstance(src, (bytes, bytearray)):
            data = _DataOnly(io.BytesIO(bytes(src))).load()
        else:
            with open(src, "rb") as f:
                data = _DataOnly(f).load()
    except _Refused as e:
        raise VramError(f"snapshot: refused: the pickle asks for {e} (code, not data); a memory snapshot holds "
                        f"only dicts, lists, text, numbers and booleans, and a pickle that names anything else "
                        f"could run code when loaded", field="snapshot") from None
    except OSError as e:
        raise VramError(f"snapshot: cannot read {src!r}: {e.strerror or e}", field="snapshot") from None
    except Exception as e:  # noqa: BLE001 - a pickle of something else
        raise VramError(f"snapshot: not a pickled memory snapshot ({type(e).__name__})", field="snapshot") from None
    if not isinstance(data, dict):
        raise VramError("snapshot: the pickle holds no dict (torch.cuda.memory._snapshot() returns one)",
                        field="snapshot")
    return data
