"""What every mechanism of the step plan reads: the setup, its parameters, its block traces
and the step's sizes (numbers, or :class:`~vramwidget.plan.size.Size` polynomials)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

from ..model.activations import attention_backend
from ..model.architecture import Architecture
from ..stacks import behaviour
from ..training import TrainingSetup
from ..units import DTYPE_BYTES
from .builder import PlanBuilder
from .params import ParamStorage, param_storage
from .profile import Profile, block_profile, full_checkpointing, logits_dtype, residual_dtype, size_terms

#: cuBLAS + cuBLASLt workspaces the caching allocator holds after the first matmul
#: (measured on an H200 with PyTorch 2.11: weights_mib is 64 MiB above the weights
#: in every case but the first of a process), two allocations of 32 MiB
CUBLAS_WORKSPACE_BYTES = 64 * 2 ** 20
CUBLAS_WORKSPACES = 2


@dataclass
class StepContext:
    """One setup's step, ready to be written into a plan."""

    arch: Architecture
    s: TrainingSetup
    P: ParamStorage
    prof: Profile
    pb: PlanBuilder
    b: Any                   # batch size
    sq: Any                  # sequence length (an encoder-decoder's input)
    M: Tuple[Any, ...]       # the size terms the block profile's coefficients multiply
    T: Any                   # tokens through the blocks: b x s
    Th: Any                  # tokens through the head and the loss: b x target (decoder) length
    #: checkpointing keeps only each block's input (``gradient_checkpointing="full"``)
    gc: bool
    #: the residual stream's dtype (fp32 under autocast or after prepare_model_for_kbit_training)
    resid: str
    #: the attention kernel transformers runs (flash, efficient, math, eager, recompute)
    backend: str
    #: write a layer that repeats the ones before as a shifted copy of their events (the same
    #: events a layer-by-layer build writes: tests/test_step_plan.py)
    copy_layers: bool = True

    @property
    def h(self) -> int:
        return self.arch.hidden_size

    @property
    def V(self) -> int:
        return self.arch.vocab_size

    @property
    def L(self) -> int:
        return self.arch.num_layers

    @property
    def c(self) -> str:
        """The compute dtype."""
        return self.s.compute_dtype

    @property
    def resid_bytes(self) -> int:
        return DTYPE_BYTES[self.resid]

    @property
    def logits_dtype(self) -> str:
        return logits_dtype(self.arch, self.s)

    @property
    def loss_upcast(self) -> bool:
        """transformers' ForCausalLMLoss upcasts the logits to fp32 (the stack and family say)."""
        return bool(behaviour(self.s.stack)["loss_upcast"]) and self.arch.family.loss_upcast


def step_context(arch: Architecture, s: TrainingSetup, pb: PlanBuilder, b: Any, sq: Any,
                 tq: Optional[Any] = None) -> StepContext:
    """The context of ``s`` at batch ``b``, sequence ``sq`` and target length ``tq`` (the
    setup's own when None; any of them a Size)."""
    P = param_storage(arch, s)
    prof = block_profile(arch, s, P)
    if tq is None:
        tq = s.target_len
    M = size_terms(prof, b, sq, tq)
    return StepContext(arch=arch, s=s, P=P, prof=prof, pb=pb, b=b, sq=sq, M=M, T=b * sq,
                       Th=b * (tq if tq is not None else sq), gc=full_checkpointing(s), resid=residual_dtype(s),
                       backend=attention_backend(arch, s, s.compute_dtype))
