"""The output head and the loss: forward to the loss value, and their backward.

transformers' causal-LM loss (``loss/loss_utils.py`` ``ForCausalLMLoss``): the head's
logits (T x V in the logits' dtype), ``logits.float()`` (T x V x 4), cross-entropy's
log_softmax output saved for backward (fp32); in backward nll_loss's and log_softmax's fp32
gradients, then the logits' gradient in the head's dtype.  Gemma 2's final soft-capping
(``logits / cap``, ``tanh``, ``* cap``: ``modeling_gemma2.py``) keeps tanh's output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

from ..units import DTYPE_BYTES
from .blocks import GradReady, Layers, backward_ops, forward_ops, input_saved, sized_ops
from .context import StepContext
from .load import Loaded


@dataclass
class HeadForward:
    """What the forward leaves for the head's and the loss's backward."""

    final_in: Optional[int]        # the last block's output, while the final norm keeps it
    saved: List[int]               # what the final norm (and a LoRA head) keeps for backward
    casts: List[Optional[int]]
    logits: Optional[int]
    logsm: Optional[int]
    tanh: Optional[int]


def head_forward(cx: StepContext, lay: Layers, x: Optional[int]) -> HeadForward:
    """The final norm (its trace, ``profile.head_alloc_ops``), the head's logits and the loss,
    up to the loss value."""
    pb = cx.pb
    Th, h, V = cx.Th, cx.h, cx.V
    lg_dtype = cx.logits_dtype
    lg_bytes = Th * V * DTYPE_BYTES[lg_dtype]
    upcast = cx.loss_upcast
    fp32_TV = Th * V * 4.0 if upcast else lg_bytes
    ops = sized_ops(cx, cx.prof.head_alloc_ops)
    held: List[int] = []              # the head's input (and a LoRA head's), read by lm_head next
    _, saved = forward_ops(cx, ops, x, True, ("head",), held)
    if not input_saved(ops):
        pb.free(x)                    # the final norm read it (hidden_states = self.norm(hidden_states))
        x = None
    casts = [pb.alloc(nb, "autocast copy of the head weight", "weights", "autocast copies (16-bit)", "V x h x 2 B",
                      cx.c, label="head weight cast") for nb in lay.cast_bytes.get(-1, [])]
    logits = pb.alloc(lg_bytes, "logits", "logits and loss", "output head", f"T x V x {DTYPE_BYTES[lg_dtype]:g} B",
                      lg_dtype)
    tanh = None
    if cx.arch.final_logit_softcapping:
        # final logit soft-capping (Gemma 2, modeling_gemma2.py Gemma2ForCausalLM.forward):
        # logits / cap, tanh (autograd saves tanh's output for its backward), * cap
        scaled = pb.alloc(lg_bytes, "logits / final_logit_softcapping", "logits and loss", "output head",
                          "T x V", lg_dtype)
        pb.free(logits)
        tanh = pb.alloc(lg_bytes, "soft-capped logits tanh (saved)", "logits and loss", "output head", "T x V",
                        lg_dtype)
        pb.free(scaled)
        logits = pb.alloc(lg_bytes, "soft-capped logits", "logits and loss", "output head", "T x V", lg_dtype)
    up = None
    if upcast and lg_dtype != "float32":
        up = pb.alloc(fp32_TV, "logits upcast to fp32", "logits and loss", "loss", "T x V x 4 B", "float32")
    logsm = pb.alloc(fp32_TV, "log_softmax output (fp32)" if upcast else "log_softmax output", "logits and loss",
                     "loss", "T x V (cross_entropy keeps it for backward)", "float32" if upcast else lg_dtype)
    pb.free(up)
    # the final norm's output is the decoder's last_hidden_state: the causal-LM forward holds
    # ``outputs`` until it returns (modeling_llama.py LlamaForCausalLM.forward), loss included
    for k in held:
        pb.free(k)
    return HeadForward(x, saved, casts, logits, logsm, tanh)


def loss_backward(cx: StepContext, ld: Loaded, hf: HeadForward, grad_ready: GradReady
                  ) -> Tuple[Optional[int], Optional[int]]:
    """From the loss back to the final norm's input: (that gradient's key, the key of a tied
    head's gradient, which waits for the embedding's to be added into it)."""
    pb = cx.pb
    s, arch = cx.s, cx.arch
    Th, h, V = cx.Th, cx.h, cx.V
    lg_dtype = cx.logits_dtype
    lg_bytes = Th * V * DTYPE_BYTES[lg_dtype]
    upcast = cx.loss_upcast
    fp32_TV = Th * V * 4.0 if upcast else lg_bytes
    ce_dtype = "float32" if upcast else lg_dtype
    g_nll = pb.alloc(fp32_TV, "nll_loss gradient", "logits and loss", "loss", "T x V", ce_dtype)
    g_ls = pb.alloc(fp32_TV, "log_softmax gradient", "logits and loss", "loss", "T x V", ce_dtype)
    pb.free(hf.logsm)
    pb.free(g_nll)
    g_lg = g_ls
    if upcast and lg_dtype != "float32":
        g_lg = pb.alloc(lg_bytes, "logits gradient", "logits and loss", "output head", "T x V", lg_dtype)
        pb.free(g_ls)
    if hf.tanh is not None:
        # back through * cap, tanh (1 - y^2, then its saved output goes) and / cap
        g1 = pb.alloc(lg_bytes, "gradient of the tanh output", "logits and loss", "output head", "T x V", lg_dtype)
        pb.free(g_lg)
        g2 = pb.alloc(lg_bytes, "gradient of the tanh input", "logits and loss", "output head", "T x V", lg_dtype)
        pb.free(g1)
        pb.free(hf.tanh)
        g_lg = pb.alloc(lg_bytes, "gradient of the head's logits", "logits and loss", "output head", "T x V",
                        lg_dtype)
        pb.free(g2)
    # lm_head's backward: its weight's gradient (a tied head's waits for the embedding's) and
    # its input's; then the final norm's backward, op by op
    tied_key: Optional[int] = None
    norm_params = [e for e in ld.head_params if e[6] != "output_head"]
    for entry in ld.head_params:
        if entry[6] == "output_head":
            grad_ready(("head", 0), pb.alloc(entry[1], entry[0], "gradients", entry[5],
                                             f"{int(entry[3]):,} x {DTYPE_BYTES[entry[2]]:g} B", entry[2],
                                             label=(entry[0], "grad")), entry)
    if arch.tie_word_embeddings and s.method == "full":
        tied_key = pb.alloc(V * h * DTYPE_BYTES[s.weights_dtype], "lm_head gradient (tied to the embedding)",
                            "gradients", "output head", "V x h", s.weights_dtype)
    g = pb.alloc(Th * h * DTYPE_BYTES[cx.c], "head input gradient", "activations", "output head", "T x h", cx.c)
    pb.free(g_lg)
    for k in hf.casts:
        pb.free(k)
    ops = sized_ops(cx, cx.prof.head_alloc_ops)
    g2 = backward_ops(cx, ops, g, hf.saved, norm_params, Th * h * cx.resid_bytes, ("head",), ("head", 0), grad_ready)
    pb.free(hf.final_in)
    return g2, tied_key
