"""CUDA autocast's casting policy on a CPU trace.

The step runs under ``torch.autocast("cpu", dtype)``: the CPU policy casts the same
matmuls (linear, matmul, mm, bmm, addmm, baddbmm, conv) to 16 bits and caches the casts of
leaf weights for the forward pass, as CUDA's does (aten/src/ATen/autocast_mode.cpp,
``cached_cast``).  Where CUDA's policy differs, this mode adds CUDA's casts on top
(autocast_mode.cpp, the ``AT_FORALL_FP32`` and ``AT_FORALL_FP32_SET_OPT_DTYPE`` lists for
``DeviceType::CUDA``):

* fp32 ops (pow, exp, log, rsqrt, layer_norm, group_norm, softplus, logsumexp, the losses...)
  run on fp32 copies of 16-bit inputs;
* softmax, log_softmax, sum, prod, cumsum, cumprod compute in fp32 from 16-bit inputs
  (``dtype=torch.float32``: an fp32 output, no copy of the input).

It acts only while torch's own CPU autocast is enabled, so transformers' regions that
switch autocast off (rotary embeddings) stay off, and it stays installed for the whole step:
checkpointing's recomputation in backward re-enters autocast and must cast as the forward
pass did.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode

#: CUDA autocast: inputs cast to fp32 (autocast_mode.cpp, fp32 policy for CUDA)
FP32_OPS = frozenset({
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow", "__pow__", "__rpow__", "softplus", "layer_norm", "group_norm", "frobenius_norm",
    "nuclear_norm", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
    "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
})
#: CUDA autocast: computed in fp32 via the op's dtype argument (fp32_set_opt_dtype policy)
FP32_DTYPE_OPS = frozenset({"softmax", "log_softmax", "sum", "prod", "cumsum", "cumprod"})
_LOW = (torch.bfloat16, torch.float16)


def _to32(x):
    if isinstance(x, torch.Tensor) and x.dtype in _LOW:
        return x.to(torch.float32)
    if isinstance(x, (list, tuple)):
        return type(x)(_to32(y) for y in x)
    return x


class _CudaPolicy(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.is_autocast_enabled("cpu"):
            name = getattr(func, "__name__", "")
            if name in FP32_OPS:
                args = tuple(_to32(a) for a in args)
                kwargs = {k: _to32(v) for k, v in kwargs.items()}
            elif name in FP32_DTYPE_OPS and kwargs.get("dtype") is None and args \
                    and isinstance(args[0], torch.Tensor) and args[0].dtype in _LOW \
                    and len(args) <= (3 if name in ("softmax", "log_softmax") else 2):
                kwargs = dict(kwargs, dtype=torch.float32)
        return func(*args, **kwargs)


def cuda_policy() -> TorchFunctionMode:
    """The mode that adds CUDA's casts while CPU autocast is on (install it around the step)."""
    return _CudaPolicy()


@contextlib.contextmanager
def cuda_autocast(dtype: torch.dtype) -> Iterator[None]:
    """Autocast around the forward pass (with :func:`cuda_policy` installed around the step)."""
    with torch.autocast("cpu", dtype=dtype):
        yield
