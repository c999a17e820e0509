"""The optimizer: its states, made on the first ``step()``, and what each step allocates.

* ``torch.optim.AdamW`` (foreach, ``adamw.py`` ``_multi_tensor_adamw``): exp_avg and
  exp_avg_sq in the parameter's dtype (or ``optimizer_state_dtypes``),
  ``_foreach_sqrt(exp_avg_sqs)`` one state-sized temporary per parameter at once; fused
  AdamW, SGD and Lion's states work in place; paged AdamW's states are bitsandbytes'
  (``optim/optimizer.py``), its step fused;
* bitsandbytes 8-bit optimizers (``Optimizer8bit.init_state``): 1-byte states with one fp32
  absmax per 256 values; tensors under 4096 elements keep fp32 states;
* transformers' Adafactor (``optimization.py``): factored fp32 row and column statistics,
  per parameter fp32 copies of the gradient and the parameter and two update tensors;
* Lion (lion-pytorch ``lion_pytorch.py`` ``update_fn``): one momentum; the step's update
  and the interpolated momentum, two temporaries of a parameter at a time;
* GaLore AdamW (galore_torch ``adamw.py``, ``galore_projector.py``): a projected weight keeps
  its moments in the low-rank space (r x max(m, n) each; 8-bit with galore_adamw_8bit) and
  its projection (r x min(m, n) in the parameter dtype; an fp32 parameter's SVD slice keeps
  the whole min(m, n)^2 factor alive); every other parameter AdamW's two moments.  Its step
  loops over parameters: at a projection refresh, ``torch.linalg.svd`` of an fp32 copy of the
  gradient (m x n, U m x k, Vh k x n); at every step the low-rank gradient and update
  (r x max(m, n) each) and the update projected back (m x n).  A refresh comes every
  ``update_proj_gap`` steps; it is counted in every step, since a run's peak includes one.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from ..units import DTYPE_BYTES
from .context import StepContext
from .load import Trainable
from .params import BNB_8BIT_MIN_SIZE, BNB_8BIT_OPT_BLOCK, galore_shape, state_dtypes

#: state names of the optimizers that keep state_dtypes-typed states
_STATE_NAMES = {"adamw": ("exp_avg", "exp_avg_sq"), "adamw_fused": ("exp_avg", "exp_avg_sq"),
                "paged_adamw": ("exp_avg (paged)", "exp_avg_sq (paged)"), "lion": ("exp_avg",),
                "sgd_momentum": ("momentum_buffer",)}


def _state(cx: StepContext, e: Trainable, what: str, nbytes: float, formula: str, dtype: str) -> None:
    cx.pb.alloc(nbytes, f"{e.module} {what}", "optimizer states", e.group, formula, dtype, label=(e.module, what))


def _bnb_8bit(cx: StepContext, e: Trainable, numel: float, each: float, names: Tuple[str, str]) -> None:
    """bitsandbytes' blockwise 8-bit states of ``numel`` values (``each`` per tensor)."""
    if each < BNB_8BIT_MIN_SIZE:
        for n in names:
            _state(cx, e, n + " (fp32)", numel * 4, "n x 4 B (under 4096 elements)", "float32")
        return
    blocks = -(-int(numel) // BNB_8BIT_OPT_BLOCK)
    for n in names:
        _state(cx, e, n + " (8-bit)", numel, "n x 1 B", "uint8")
    for n in names:
        _state(cx, e, n + " absmax", blocks * 4, "n/256 x 4 B", "float32")


def _galore_states(cx: StepContext, e: Trainable) -> None:
    s = cx.s
    eight = s.optimizer == "galore_adamw_8bit"
    g = galore_shape(e.tensor, s) if e.tensor is not None else None
    if g is None:
        numel = e.numel
    else:
        m, n, r = g
        numel = r * max(m, n)
        k = min(m, n)
        if e.dtype == "float32":
            _state(cx, e, "GaLore projection", k * k * 4, "min(m, n)^2 x 4 B (the SVD factor the slice keeps)",
                   "float32")
        else:
            _state(cx, e, "GaLore projection", r * k * DTYPE_BYTES[e.dtype], "r x min(m, n)", e.dtype)
    if eight:
        _bnb_8bit(cx, e, numel, numel, ("exp_avg", "exp_avg_sq"))
    else:
        for what in ("exp_avg", "exp_avg_sq"):
            _state(cx, e, what, numel * DTYPE_BYTES[e.dtype], "r x max(m, n)" if g else "n", e.dtype)


def create_states(cx: StepContext, ordered: List[Trainable]) -> None:
    """States created on the first ``step()``, parameter by parameter (``_init_group``)."""
    s = cx.s
    opt = s.optimizer
    for e in ordered:
        if opt in ("adamw_8bit", "paged_adamw_8bit"):
            _bnb_8bit(cx, e, e.numel, e.numel, ("state1", "state2"))
        elif opt == "adafactor":
            if len(e.shape) >= 2:   # factored: one fp32 value per row and per column
                _state(cx, e, "exp_avg_sq_row (fp32)", e.numel // e.shape[-1] * 4, "rows x 4 B", "float32")
                _state(cx, e, "exp_avg_sq_col (fp32)", e.numel // e.shape[-2] * 4, "columns x 4 B", "float32")
            else:
                _state(cx, e, "exp_avg_sq (fp32)", e.numel * 4, "n x 4 B", "float32")
        elif opt.startswith("galore"):
            _galore_states(cx, e)
        else:
            for what, sd in zip(_STATE_NAMES.get(opt, ()), state_dtypes(s, e.dtype)):
                _state(cx, e, f"{what} ({sd})", e.numel * DTYPE_BYTES[sd], f"n x {DTYPE_BYTES[sd]:g} B ({sd})", sd)


def _temp(cx: StepContext, e: Trainable, what: str, nbytes: float, formula: str, dtype: str) -> Optional[int]:
    return cx.pb.alloc(nbytes, f"{e.module} {what}", "optimizer temporaries", e.group, formula, dtype,
                       label=(e.module, what))


def step_temporaries(cx: StepContext, ordered: List[Trainable]) -> None:
    """The temporaries of one ``step()``."""
    s, pb = cx.s, cx.pb
    opt = s.optimizer
    if opt == "adamw":
        # torch.optim.adamw._multi_tensor_adamw: exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)
        keys = []
        for e in ordered:
            sd = state_dtypes(s, e.dtype)[1]
            keys.append(_temp(cx, e, "sqrt(exp_avg_sq)", e.numel * DTYPE_BYTES[sd],
                              "sqrt(exp_avg_sq) for every parameter (foreach)", sd))
        for k in keys:
            pb.free(k)
        return
    for e in ordered:               # the per-parameter loops
        keys = []
        if opt == "adafactor":
            # transformers' Adafactor.step: fp32 copies of grad and parameter, the update
            if DTYPE_BYTES[e.dtype] < 4:
                keys.append(_temp(cx, e, "grad as fp32", e.numel * 4, "n x 4 B", "float32"))
                keys.append(_temp(cx, e, "parameter as fp32", e.numel * 4, "n x 4 B", "float32"))
            keys.append(_temp(cx, e, "update", e.numel * 4, "n x 4 B", "float32"))
            keys.append(_temp(cx, e, "update (normalised)", e.numel * 4, "n x 4 B", "float32"))
        elif opt == "lion":
            # update = exp_avg.clone().mul_(beta1).add(grad, alpha=1 - beta1).sign_(); the
            # momentum's interpolation: two parameter-sized temporaries in the compute dtype
            for what in ("update", "interpolated momentum"):
                keys.append(_temp(cx, e, what, e.numel * 2, "n x 2 B", "bfloat16"))
        elif opt.startswith("galore"):
            keys.extend(_galore_step(cx, e))
        for k in keys:
            pb.free(k)


def _galore_step(cx: StepContext, e: Trainable) -> List[Optional[int]]:
    s = cx.s
    d = DTYPE_BYTES[e.dtype]
    g = galore_shape(e.tensor, s) if e.tensor is not None else None
    if g is None:
        sd = e.dtype
        return [_temp(cx, e, "exp_avg_sq.sqrt()", e.numel * DTYPE_BYTES[sd], "n", sd)]
    m, n, r = g
    k = min(m, n)
    svd = [_temp(cx, e, "gradient as fp32 (SVD input)", m * n * 4, "m x n x 4 B", "float32"),
           _temp(cx, e, "SVD U", m * k * 4, "m x k x 4 B", "float32"),
           _temp(cx, e, "SVD Vh", k * n * 4, "k x n x 4 B", "float32")]
    for key in svd:
        cx.pb.free(key)
    return [_temp(cx, e, "low-rank gradient", r * max(m, n) * d, "r x max(m, n)", e.dtype),
            _temp(cx, e, "low-rank update", r * max(m, n) * d, "r x max(m, n)", e.dtype),
            _temp(cx, e, "update projected back", m * n * d, "m x n", e.dtype)]
