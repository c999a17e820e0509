"""The optimizer: its states, made on the first ``step()``, and what each step allocates.

* ``torch.optim.AdamW`` (foreach, ``adamw.py`` ``_multi_tensor_adamw``): exp_avg and
  exp_avg_sq in the parameter's dtype, ``_foreach_sqrt(exp_avg_sqs)`` one state-sized
  temporary per parameter at once; fused AdamW works in place;
* bitsandbytes 8-bit optimizers (``optim/optimizer.py`` ``Optimizer8bit.init_state``): 1-byte
  states with one fp32 absmax per 256 values; tensors under 4096 elements keep fp32 states;
* transformers' Adafactor (``optimization.py``): factored fp32 row and column statistics,
  per parameter fp32 copies of the gradient and the parameter and two update tensors.
"""

from __future__ import annotations

from typing import List

from ..units import DTYPE_BYTES
from .context import StepContext
from .load import Trainable
from .params import BNB_8BIT_MIN_SIZE, BNB_8BIT_OPT_BLOCK, state_dtypes


def create_states(cx: StepContext, ordered: List[Trainable]) -> None:
    """States created on the first ``step()``, parameter by parameter (``_init_group``)."""
    s, pb = cx.s, cx.pb
    opt = s.optimizer

    def state(nbytes: float, module: str, what: str, group: str, formula: str, dtype: str) -> None:
        pb.alloc(nbytes, f"{module} {what}", "optimizer states", group, formula, dtype, label=(module, what))

    for module, nb, dtype, numel, shape, group, _role in ordered:
        if opt in ("adamw_8bit", "paged_adamw_8bit"):
            if numel < BNB_8BIT_MIN_SIZE:
                state(numel * 4, module, "state1 (fp32)", group, "n x 4 B (under 4096 elements)", "float32")
                state(numel * 4, module, "state2 (fp32)", group, "n x 4 B (under 4096 elements)", "float32")
            else:
                blocks = -(-numel // BNB_8BIT_OPT_BLOCK)
                state(numel, module, "state1 (8-bit)", group, "n x 1 B", "uint8")
                state(numel, module, "state2 (8-bit)", group, "n x 1 B", "uint8")
                state(blocks * 4, module, "absmax1", group, "n/256 x 4 B", "float32")
                state(blocks * 4, module, "absmax2", group, "n/256 x 4 B", "float32")
        elif opt == "adafactor":
            if len(shape) >= 2:   # factored: one fp32 value per row and per column
                state(numel // shape[-1] * 4, module, "exp_avg_sq_row (fp32)", group, "rows x 4 B", "float32")
                state(numel // shape[-2] * 4, module, "exp_avg_sq_col (fp32)", group, "columns x 4 B", "float32")
            else:
                state(numel * 4, module, "exp_avg_sq (fp32)", group, "n x 4 B", "float32")
        else:
            for sd in state_dtypes(s, dtype):
                pb.alloc(numel * DTYPE_BYTES[sd], f"{module} state ({sd})", "optimizer states", group,
                         f"n x {DTYPE_BYTES[sd]:g} B ({sd})", sd)


def step_temporaries(cx: StepContext, ordered: List[Trainable]) -> None:
    """The temporaries of one ``step()``."""
    s, pb = cx.s, cx.pb
    opt = s.optimizer
    if opt == "adamw":
        # torch.optim.adamw._multi_tensor_adamw: exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)
        keys = []
        for module, nb, dtype, numel, _shape, group, _role in ordered:
            sd = state_dtypes(s, dtype)[1]
            keys.append(pb.alloc(numel * DTYPE_BYTES[sd], f"{module} sqrt(exp_avg_sq)", "optimizer temporaries",
                                 group, "sqrt(exp_avg_sq) for every parameter (foreach)", sd,
                                 label=(module, "sqrt(exp_avg_sq)")))
        for k in keys:
            pb.free(k)
    elif opt == "adafactor":
        # transformers' Adafactor.step: fp32 copies of grad and parameter, the update, per parameter
        for module, nb, dtype, numel, _shape, group, _role in ordered:
            keys = []
            if DTYPE_BYTES[dtype] < 4:
                keys.append(pb.alloc(numel * 4, f"{module} grad as fp32", "optimizer temporaries", group,
                                     "n x 4 B", "float32", label=(module, "grad as fp32")))
                keys.append(pb.alloc(numel * 4, f"{module} parameter as fp32", "optimizer temporaries", group,
                                     "n x 4 B", "float32", label=(module, "parameter as fp32")))
            keys.append(pb.alloc(numel * 4, f"{module} update", "optimizer temporaries", group, "n x 4 B", "float32",
                                 label=(module, "update")))
            keys.append(pb.alloc(numel * 4, f"{module} update (normalised)", "optimizer temporaries", group,
                                 "n x 4 B", "float32", label=(module, "update (normalised)")))
            for k in keys:
                pb.free(k)
