"""An allocation ledger: every tensor storage an op creates, when it is born and when it dies.

``Ledger`` is a ``TorchDispatchMode`` (it sees every aten op below autograd).  For each
output tensor whose storage it has not seen, it records one allocation: bytes, the phase
and the op.  A weak reference on the storage records the free when the last tensor using it
dies (autograd's saved tensors die when backward releases them), so the ledger sees
lifetimes as the CUDA caching allocator does.  Sizes are rounded as that allocator rounds
an allocation: up to a multiple of 512 bytes (``kMinBlockSize`` in
c10/cuda/CUDACachingAllocator.cpp, ``round_size``); ``memory_allocated()`` counts those
rounded block sizes.  A zero-byte tensor allocates nothing.

The ledger never keeps a tensor alive: it holds storage ids and weak references only.  It
runs under ``FakeTensorMode`` (no real memory), so a 70B model costs a few seconds.

Random in-place initialisers are identities here (the values of fake tensors do not
exist), and ``native_dropout`` allocates what the CUDA kernel allocates (the output and
a 1-byte mask; aten/src/ATen/native/cuda/Dropout.cu).

Gradient accumulation: where two gradients meet (a tied embedding and output head, a
residual branch), autograd's engine adds them in its input buffer, in place into the first
one when it holds the last reference to a plain (non-view) tensor and its storage, else out
of place (``accumulate`` and ``can_accumulate_inplace`` in
torch/csrc/autograd/input_buffer.cpp).  Under a dispatch mode every tensor counts as a
subclass, so the engine always adds out of place here; the ledger undoes that for an
``add.Tensor`` of backward whose first operand is no view and dies at once (the engine's
buffer dropped it): the sum takes that operand's place instead of overlapping it.
"""

from __future__ import annotations

import weakref
from typing import Dict, List, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .events import Alloc

aten = torch.ops.aten

def _random_ops():
    names = [("uniform_", "default"), ("normal_", "default"), ("bernoulli_", "float"), ("bernoulli_", "Tensor"),
             ("random_", "default"), ("random_", "from"), ("random_", "to"), ("exponential_", "default"),
             ("trunc_normal_", "default"), ("geometric_", "default"), ("cauchy_", "default"),
             ("log_normal_", "default")]
    out = set()
    for op, overload in names:
        packet = getattr(aten, op, None)
        if packet is not None and overload in packet.overloads():
            out.add(getattr(packet, overload))
    return out


_RANDOM_INPLACE = _random_ops()
_QUIET: Dict[object, bool] = {}


class Ledger(TorchDispatchMode):
    """Records every storage allocation and free while active (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.allocs: List[Alloc] = []
        self.live: Dict[int, int] = {}       # id(storage) -> index into allocs
        self.t = 0
        self.phase = "load"
        self.module = ""
        self._last_alloc = 0
        self.marks: List[Tuple[str, int]] = []
        # backward's accumulations: first operand's alloc index -> (the sum's index, event time)
        self._accum: Dict[int, Tuple[int, int]] = {}

    # -- recording ----------------------------------------------------------------------
    def mark(self, name: str) -> None:
        """Start a phase (its events run until the next mark)."""
        self.t += 1
        self.phase = name
        self.marks.append((name, self.t))

    def key(self, t: torch.Tensor) -> Optional[int]:
        """The id of ``t``'s storage if the ledger has it live."""
        k = id(t.untyped_storage())
        return self.live.get(k)

    def _track(self, t: torch.Tensor, op: str) -> None:
        st = t.untyped_storage()
        k = id(st)
        if k in self.live:
            return
        self.t += 1
        idx = len(self.allocs)
        nbytes = int(st.nbytes())
        es = t.element_size()
        dims = tuple(int(d) for d in t.shape) if t.numel() * es == nbytes else None
        self.allocs.append(Alloc(nbytes, self.t, None, self.phase, op, self.module, dims=dims, elsize=es))
        self._last_alloc = self.t
        self.live[k] = idx
        weakref.finalize(st, self._free, k, idx)

    def _free(self, k: int, idx: int) -> None:
        if self.live.get(k) == idx:
            del self.live[k]
        if self.allocs[idx].t_free is None:
            self.t += 1
            self.allocs[idx].t_free = self.t
            acc = self._accum.pop(idx, None)
            if acc is not None and acc[1] == self._last_alloc:
                # nothing was allocated between the sum and this free: the engine's add_ into it
                self.allocs[acc[0]].t_alloc = self.t

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        quiet = _QUIET.get(func)
        if quiet is None:
            # views, metadata queries: never a new storage (the fast path keeps big models quick)
            quiet = _QUIET[func] = bool(getattr(func, "is_view", False)) or func.namespace == "prim"
        if quiet:
            return func(*args, **kwargs)
        if func in _RANDOM_INPLACE:
            return args[0]
        if func is aten.native_dropout.default:
            x = args[0]
            out = (torch.empty_like(x), torch.empty_like(x, dtype=torch.bool))
        else:
            out = func(*args, **kwargs)
        name = func.__name__
        if isinstance(out, torch.Tensor):
            self._track(out, name)
            if func is aten.add.Tensor and self.phase == "backward":
                self._maybe_accumulation(args, out)
        else:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self._track(t, name)
        return out

    def _maybe_accumulation(self, args, out: torch.Tensor) -> None:
        """Remember an add of two same-shaped gradients whose first operand could have been
        accumulated into in place (see the module docstring)."""
        a, b = args[0], args[1] if len(args) > 1 else None
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a._is_view():
            return
        if a.shape != out.shape or b.shape != out.shape or a.dtype != out.dtype or not a.is_contiguous():
            return
        if a.untyped_storage().nbytes() != a.numel() * a.element_size():
            return
        ia, io = self.key(a), self.key(out)
        if ia is not None and io is not None and ia != io:
            self._accum[ia] = (io, self._last_alloc)

    # -- reading -------------------------------------------------------------------------
    def close(self) -> None:
        """Mark every storage still live as freed at the end (for reading the log)."""
        self.t += 1
        self.marks.append(("end", self.t))
