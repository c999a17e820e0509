"""The CUDA kernels a traced step stands in for, on CPU fake tensors.

A CPU build of PyTorch cannot make CUDA tensors, so the trace runs on CPU fake tensors
and replaces the few calls whose CUDA kernel keeps or allocates different memory than the
CPU one:

* ``scaled_dot_product_attention``: which backend CUDA would pick, by the same rules as
  ``activations.attention_backend`` (PyTorch's aten/src/ATen/native/transformers/cuda/
  sdp_utils.cpp): flash for 16-bit inputs with head dim <= 256 and no mask; memory-
  efficient for fp32 (or a mask) without grouped KV heads; else the math composite, which
  materialises the b x a x s x s probabilities.  Flash and memory-efficient attention keep
  q, k, v, the output and an fp32 logsumexp for backward (aten/src/ATen/native/
  transformers/cuda/attention.cu); their backward allocates dq, dk, dv plus an fp32
  ``softmax_d`` and, for flash, an fp32 ``dq_accum`` of the padded query shape and, with
  grouped KV heads, full-head dk/dv before they are summed (flash_attn/flash_api.cpp,
  ``mha_bwd``).
* transformers' ``find_packed_sequence_indices`` (masking_utils.py) reads position-id
  values to detect several sequences packed in one row; with fake tensors it cannot, keeps
  a packed-sequence mask and so materialises a b x 1 x s x s attention mask that a real
  run skips.  The step feeds one sequence per row, so the answer is "not packed" (None).
* ``nn.Module._apply`` (``.to(dtype)``, used by peft on its adapters and by
  ``prepare_model_for_kbit_training``): for fake parameters torch swaps the tensor objects,
  which fails while the fake-tensor converter holds weak references to them; the trace
  puts a new Parameter in place instead (torch's "overwrite" conversion,
  ``torch.__future__.set_overwrite_module_params_on_conversion``), which allocates the
  same tensors.
* transformers' MoE ``grouped_mm`` experts (integrations/moe.py): ``torch._grouped_mm``
  takes bf16 only (its shape rule checks it as the CUDA kernel does); other dtypes take
  transformers' own fallback op, which allocates the same output and gradients.
* ``F.dropout``: on a CUDA tensor aten's ``dropout`` runs the fused ``native_dropout``
  kernel, which keeps a 1-byte mask for backward (aten/src/ATen/native/Dropout.cpp,
  ``is_fused_kernel_acceptable`` needs ``input.is_cuda()``); on the CPU it multiplies by a
  noise tensor of the input's dtype and keeps that (4 bytes per element in fp32).  The
  trace calls ``native_dropout`` as CUDA does.
* ``_get_value`` of torch.optim: the step counter is read with ``.item()``, which a fake
  tensor cannot answer; the counter's value does not change any tensor's size.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

F32 = torch.float32


def cuda_sdpa_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor],
                      enable_gqa: bool) -> str:
    """flash | efficient | math: what PyTorch 2.x's SDPA dispatcher picks on a recent GPU."""
    sixteen = q.dtype in (torch.bfloat16, torch.float16)
    d, dv = q.shape[-1], v.shape[-1]
    gqa = q.shape[-3] != k.shape[-3]
    if sixteen and attn_mask is None and d == dv and d <= 256:
        return "flash"
    if not gqa and d <= 512 and dv <= 512:   # mem-efficient takes fp32, masks and unequal head dims
        return "efficient"
    return "math"


class _FusedAttention(torch.autograd.Function):
    """Flash / memory-efficient attention: the tensors the CUDA kernels allocate and keep."""

    @staticmethod
    def forward(ctx, q, k, v, backend):  # noqa: D401 - autograd signature
        b, a, s, d = q.shape
        dv = v.shape[-1]
        # flash writes its output in q's memory layout (empty_like of the (b, s, a, d) input)
        out = torch.empty_like(q) if dv == d else q.new_empty((b, s, a, dv)).transpose(1, 2)
        lse_len = s if backend == "flash" else -(-s // 32) * 32   # mem-efficient pads to 32 (kAlignLSE)
        lse = torch.empty((b, a, lse_len), dtype=F32, device=q.device)
        ctx.backend = backend
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        b, a, s, d = q.shape
        dout = dout.contiguous()
        s_r = -(-s // 128) * 128
        softmax_d = torch.empty((b, a, s_r), dtype=F32, device=q.device)
        work = []
        if ctx.backend == "flash":
            d_r = -(-d // 32) * 32
            work.append(torch.empty((b, s_r, a, d_r), dtype=F32, device=q.device))   # dq_accum
        dq = torch.empty_like(q)
        if k.shape[1] != a:   # grouped KV heads: full-head gradients, then summed per group
            dk_e = torch.empty((b, k.shape[2], a, k.shape[3]), dtype=k.dtype, device=k.device)
            dv_e = torch.empty((b, v.shape[2], a, v.shape[3]), dtype=v.dtype, device=v.device)
            dk = torch.empty_like(k)
            dv = torch.empty_like(v)
            del dk_e, dv_e
        else:
            dk = torch.empty_like(k)
            dv = torch.empty_like(v)
        del work, softmax_d
        return dq, dk, dv, None


#: set by cuda_kernels(): "flash_attention_2" runs every attention through the flash kernel
_FORCE = {"backend": None}


def cuda_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
              **kw):
    """``F.scaled_dot_product_attention`` as the CUDA dispatcher would run it (under
    autocast, SDPA is a 16-bit op: q, k and v are cast first)."""
    if torch.is_autocast_enabled("cpu"):
        low = torch.get_autocast_dtype("cpu")
        query, key, value = (t.to(low) if t.is_floating_point() and t.dtype != low else t
                             for t in (query, key, value))
    backend = _FORCE["backend"] or cuda_sdpa_backend(query, key, value, attn_mask, enable_gqa)
    if backend == "math":
        return torch.ops.aten._scaled_dot_product_attention_math(
            query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa)[0]
    if not (query.requires_grad or key.requires_grad or value.requires_grad):
        return _FusedAttention.forward(_NoCtx(), query, key, value, backend)
    return _FusedAttention.apply(query, key, value, backend)


_DROPOUT = F.dropout


def cuda_dropout(input, p=0.5, training=True, inplace=False):
    """``F.dropout`` as on a CUDA tensor: the fused kernel with a 1-byte mask."""
    if training and 0.0 < p < 1.0 and input.numel() > 0 and not inplace:
        return torch.ops.aten.native_dropout(input, p, True)[0]
    return _DROPOUT(input, p, training, inplace)


class _NoCtx:
    def save_for_backward(self, *a):
        pass


def _overwrite_apply(self, fn, recurse=True):
    """``Module._apply`` that puts new Parameters in place of converted ones (no swap)."""
    if recurse:
        for module in self.children():
            module._apply(fn)
    for key, param in list(self._parameters.items()):
        if param is None:
            continue
        with torch.no_grad():
            applied = fn(param)
        if applied is param:
            continue
        new = torch.nn.Parameter(applied, param.requires_grad)
        new.__dict__.update(param.__dict__)
        if param.grad is not None:
            with torch.no_grad():
                new.grad = fn(param.grad)
        self._parameters[key] = new
    for key, buf in list(self._buffers.items()):
        if buf is not None:
            self._buffers[key] = fn(buf)
    return self


@contextlib.contextmanager
def cuda_kernels(attn_implementation: str = "sdpa") -> Iterator[None]:
    """Patch SDPA and the optimizers' step-counter read for the duration of a trace.

    ``flash_attention_2`` (the flash-attn package, CUDA only) keeps what PyTorch's flash
    backend keeps; the trace builds the model with SDPA and sends every call to flash.
    """
    _FORCE["backend"] = "flash" if attn_implementation == "flash_attention_2" else None
    saved = [(F, "scaled_dot_product_attention", F.scaled_dot_product_attention), (F, "dropout", F.dropout)]
    F.scaled_dot_product_attention = cuda_sdpa
    F.dropout = cuda_dropout

    def _get_value(x):
        return 1.0 if isinstance(x, torch.Tensor) else x

    for name in ("torch.optim.optimizer", "torch.optim.adam", "torch.optim.adamw", "torch.optim.sgd",
                 "torch.optim.adafactor"):
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(mod, "_get_value"):
            saved.append((mod, "_get_value", mod._get_value))
            mod._get_value = _get_value
    try:
        import transformers.integrations.moe as moe

        can = moe._can_use_grouped_mm
        saved.append((moe, "_can_use_grouped_mm", can))
        moe._can_use_grouped_mm = lambda input, weight, offs: (
            input.dtype == weight.dtype == torch.bfloat16 and can(input, weight, offs))
    except (ImportError, AttributeError):
        pass
    saved.append((torch.nn.Module, "_apply", torch.nn.Module._apply))
    torch.nn.Module._apply = _overwrite_apply
    try:
        import transformers.masking_utils as mu

        saved.append((mu, "find_packed_sequence_indices", mu.find_packed_sequence_indices))
        mu.find_packed_sequence_indices = lambda position_ids: None
    except (ImportError, AttributeError):
        pass
    try:
        yield
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)
        _FORCE["backend"] = None

