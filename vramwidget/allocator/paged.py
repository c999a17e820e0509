"""Paged optimizer states: what each memory statistic sees of them.

bitsandbytes' paged optimizers (``PagedAdamW``, ``PagedAdamW8bit``; ``optim="paged_adamw_*"``)
allocate their states with ``cudaMallocManaged`` (``bitsandbytes/functional.py get_paged`` ->
``cget_managed_ptr``, prefetched to the device by ``prefetch_tensor`` before each step):
CUDA unified memory, outside PyTorch's caching allocator.  So:

* ``torch.cuda.max_memory_allocated()`` and ``max_memory_reserved()`` never count them;
* ``nvidia-smi`` (and what the card must hold) counts them once they are paged in, which the
  step does every time it runs;
* under memory pressure the driver can evict them to the host instead of failing, at the
  cost of page faults.

The estimate counts them on the card: ``peak_allocated_bytes``, ``reserved_bytes`` and
``device_total_bytes`` include them (the verdict judges the card with them paged in);
``torch_max_memory_allocated_bytes`` and ``torch_max_memory_reserved_bytes`` are what torch's
statistics would report, without them.
"""

from __future__ import annotations

from typing import Any

#: optimizers whose states live in CUDA unified memory
PAGED_OPTIMIZERS = ("paged_adamw", "paged_adamw_8bit")


def paged_state_bytes(est: Any) -> float:
    """Bytes of ``est``'s optimizer states that a paged optimizer keeps in unified memory (0
    for every other optimizer)."""
    setup = getattr(est, "setup", None) or {}
    if setup.get("optimizer") not in PAGED_OPTIMIZERS:
        return 0.0
    comps = (getattr(est, "phase_components", None) or {}).get("optimizer_step") or []
    return float(sum(c.bytes for c in comps if c.name == "optimizer states"))


NOTE = ("paged optimizer states ({gib:.2f} GiB) sit in CUDA unified memory (bitsandbytes get_paged, "
        "cudaMallocManaged): counted on the card in the peak, the reserve and the device total (paged in at "
        "each step, nvidia-smi shows them), not in torch.cuda.max_memory_allocated()/max_memory_reserved() "
        "(torch_max_memory_allocated_bytes, torch_max_memory_reserved_bytes)")
