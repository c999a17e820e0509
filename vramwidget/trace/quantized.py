"""bitsandbytes' storage on a CPU trace: 4-bit linear layers and the 8-bit AdamW.

bitsandbytes' kernels are CUDA code, so a CPU trace cannot run them; these stand-ins
allocate what they allocate and keep what they keep, and nothing else:

* ``Linear4bit`` (bitsandbytes/nn/modules.py) stores its weight packed two 4-bit values
  per byte (``Params4bit``, a uint8 tensor of n/2 bytes) and a quantization state
  (bitsandbytes/functional.py ``quantize_4bit``): one absmax per 64 weights, fp32, or with
  double quantization uint8 absmax plus one fp32 scale per 256 of them, a 256-entry fp32
  code and an fp32 offset; the NF4/FP4 code itself is 16 fp32 values.  Its forward casts
  the input to the compute dtype, dequantizes the weight to a transient 16-bit copy and
  multiplies (bitsandbytes/autograd/_functions.py ``MatMul4Bit``); autograd keeps only the
  packed weight, and backward dequantizes again for the input's gradient.  The output is
  cast back to the input's dtype.
* ``AdamW8bit`` (bitsandbytes/optim/optimizer.py ``Optimizer2State.init_state``) keeps
  each moment as uint8 plus one fp32 absmax per 256 values for tensors of at least 4096
  elements (``min_8bit_size``), fp32 moments for smaller ones; its blockwise update runs
  in place (no temporaries).

Which layers are quantized follows transformers' bitsandbytes integration
(integrations/bitsandbytes.py ``replace_with_bnb_linear``): every ``nn.Linear`` except the
output head (``llm_int8_skip_modules`` defaults to it), and Conv1D layers (GPT-2).
"""

from __future__ import annotations

import math
from typing import List

import torch

from ..errors import VramError
from ..training import TrainingSetup

NF4_BLOCK = 64
DQ_BLOCK = 256
OPT_BLOCK = 256
OPT_MIN_8BIT = 4096


class _MatMul4Bit(torch.autograd.Function):
    """bitsandbytes' MatMul4Bit: a transient dequantized weight; keeps only the packed one."""

    @staticmethod
    def forward(ctx, x, packed, out_features, in_features, dtype):
        w = torch.empty((out_features, in_features), dtype=dtype, device=x.device)   # dequantize_4bit
        out = torch.nn.functional.linear(x, w)
        del w
        ctx.save_for_backward(packed)
        ctx.shape = (out_features, in_features, dtype)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_f, in_f, dtype = ctx.shape
        w = torch.empty((out_f, in_f), dtype=dtype, device=grad.device)
        gx = torch.matmul(grad, w.to(grad.dtype))
        return gx, None, None, None, None


class Linear4bitStandIn(torch.nn.Linear):
    """An nn.Linear whose weight is stored as bitsandbytes stores a 4-bit one."""

    def __init__(self, base: torch.nn.Linear, s: TrainingSetup, compute_dtype: torch.dtype):
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        n = self.in_features * self.out_features
        dev = base.weight.device
        bits = 8 if s.quantization == "int8" else 4
        self.weight = torch.nn.Parameter(torch.empty((math.ceil(n * bits / 8), 1), dtype=torch.uint8, device=dev),
                                         requires_grad=False)
        self.bias = base.bias
        blocks = math.ceil(n / NF4_BLOCK)
        if bits == 4 and s.double_quant:
            self.register_buffer("absmax", torch.empty(blocks, dtype=torch.uint8, device=dev), persistent=False)
            self.register_buffer("absmax_scale", torch.empty(math.ceil(blocks / DQ_BLOCK), dtype=torch.float32,
                                                             device=dev), persistent=False)
            self.register_buffer("absmax_code", torch.empty(256, dtype=torch.float32, device=dev), persistent=False)
            self.register_buffer("offset", torch.empty((), dtype=torch.float32, device=dev), persistent=False)
        elif bits == 4:
            self.register_buffer("absmax", torch.empty(blocks, dtype=torch.float32, device=dev), persistent=False)
        else:   # LLM.int8: one fp32 scale per output row
            self.register_buffer("absmax", torch.empty(self.out_features, dtype=torch.float32, device=dev),
                                 persistent=False)
        if bits == 4:
            self.register_buffer("code", torch.empty(16, dtype=torch.float32, device=dev), persistent=False)
        self.compute_dtype = compute_dtype

    def forward(self, x):
        dtype = x.dtype
        xc = x.to(self.compute_dtype)
        out = _MatMul4Bit.apply(xc, self.weight, self.out_features, self.in_features, self.compute_dtype)
        if self.bias is not None:
            out = out + self.bias.to(self.compute_dtype)
        return out.to(dtype)


def quantize_model(model, s: TrainingSetup) -> None:
    """Replace the linear layers transformers' bitsandbytes integration quantizes."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    compute = torch.bfloat16 if s.compute_dtype == "bfloat16" else torch.float16
    if s.quantization == "int8":
        raise VramError("quantization: LLM.int8 layers keep int8 copies of their inputs in bitsandbytes' own "
                        "autograd function, which the trace backend does not model; use nf4/fp4 or "
                        "backend='analytic'", field="quantization")
    if set(s.quantized_groups or ()) != {"attn_qk", "attn_vo", "mlp"}:
        raise VramError("quantized_groups: the trace backend quantizes what transformers' bitsandbytes integration "
                        "does (every linear layer of the blocks: attn_qk, attn_vo, mlp); use backend='analytic' "
                        "for another choice", field="quantized_groups")
    targets = []
    for name, mod in model.named_modules():
        for child_name, child in mod.named_children():
            if type(child) is torch.nn.Linear and child is not head:
                targets.append((mod, child_name, child))
            elif type(child).__name__ == "Conv1D":
                raise VramError("quantization: GPT-2 style Conv1D layers are quantized by bitsandbytes through a "
                                "transpose the trace backend does not model; use backend='analytic'",
                                field="quantization")
    for mod, child_name, child in targets:
        setattr(mod, child_name, Linear4bitStandIn(child, s, compute))
    model.is_loaded_in_4bit = s.quantization != "int8"
    model.is_loaded_in_8bit = s.quantization == "int8"
    model.is_quantized = True


class AdamW8bitStandIn(torch.optim.Optimizer):
    """bitsandbytes' AdamW8bit states (see the module docstring); the update is in place."""

    def __init__(self, params: List[torch.nn.Parameter], lr: float = 1e-5):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    if p.numel() >= OPT_MIN_8BIT:
                        blocks = math.ceil(p.numel() / OPT_BLOCK)
                        st["state1"] = torch.zeros_like(p, dtype=torch.uint8)
                        st["state2"] = torch.zeros_like(p, dtype=torch.uint8)
                        st["absmax1"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
                        st["absmax2"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
                    else:
                        st["state1"] = torch.zeros_like(p, dtype=torch.float32)
                        st["state2"] = torch.zeros_like(p, dtype=torch.float32)
                st["step"] += 1
        return None
