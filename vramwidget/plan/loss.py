"""The output head and the loss: forward to the loss value, and their backward.

T = tokens through the head, V vocabulary, c the logits' dtype, n = ``loss_chunks``.

* ``standard`` (transformers ``loss/loss_utils.py`` ``ForCausalLMLoss``): the head's logits
  (T x V x c) held by the output, ``logits.float()`` (T x V x 4), cross-entropy's
  log_softmax output saved for backward (fp32); in backward nll_loss's and log_softmax's fp32
  gradients, then the logits' gradient in c.  Older transformers (``versions``): before 4.46
  the model itself returns ``lm_head(h).float()`` (the 16-bit logits are a transient; so do
  torchtune's models, ``modules/transformer.py``), before 4.49 the loss copies the shifted
  fp32 logits (``logits[..., :-1, :].contiguous()``, removed by transformers PR #35646).
  LitGPT's loss does not upcast.
* ``chunked`` (torchtune ``CEWithChunkedOutputLoss``, LitGPT ``chunked_cross_entropy``): the
  head runs per chunk, every chunk's 16-bit logits are kept, each chunk is upcast and
  log_softmax'ed alone (its upcast T/n x V x 4 at a time), every chunk's log_softmax output
  saved; in backward one chunk's gradients at a time, then ``h.chunk``'s backward joins the
  head input's gradient.
* compiled cross-entropy (``compile=True``: torchtune compiles the loss): the upcast,
  log_softmax and nll_loss are one kernel that keeps its input (the logits) and a per-row
  logsumexp (T x 4), and writes its input's gradient in backward.
* ``liger`` (Liger ``ops/fused_linear_cross_entropy.py``): no full logits.  The forward
  allocates the head input's gradient (T x h x c) and, if the head trains, its weight's (V x h),
  then per chunk of rows (cdiv(T, cdiv(V, h)) rounded up to a power of two) the chunk's
  logits (rows x V x c, the softmax gradient written in place) and the per-token loss
  (T x 4); the backward hands the two gradients on.
* Gemma 2's final soft-capping (``logits / cap``, ``tanh``, ``* cap``: ``modeling_gemma2.py``)
  keeps tanh's output.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

from ..stacks import behaviour
from ..units import DTYPE_BYTES
from .blocks import GradReady, Layers, backward_ops, forward_ops, input_saved, param_grad, sized_ops
from .context import StepContext
from .load import Loaded
from .size import NotPolynomial


@dataclass
class HeadForward:
    """What the forward leaves for the head's and the loss's backward."""

    final_in: Optional[int]        # the last block's output, while the final norm keeps it
    saved: List[int]               # what the final norm (and a LoRA head) keeps for backward
    casts: List[Optional[int]]
    #: per chunk of the head (one for the standard loss): its logits, log_softmax output (or
    #: the compiled loss's logsumexp), soft-capping's saved tanh
    logits: List[Optional[int]] = field(default_factory=list)
    kept: List[Optional[int]] = field(default_factory=list)
    tanh: List[Optional[int]] = field(default_factory=list)
    #: Liger: the head input's and weight's gradients, computed in the forward
    grad_input: Optional[int] = None
    grad_weight: Optional[int] = None


@dataclass
class _Loss:
    """How this setup's loss runs (the decisions of the module docstring)."""

    chunks: int
    in_model: bool      # the model returns fp32 logits
    upcast: bool        # the loss upcasts to fp32
    fused: bool         # compiled cross-entropy
    shift_copy: bool    # transformers < 4.49 copies the shifted logits

    @property
    def ce_bytes(self) -> int:
        """The dtype the cross-entropy runs in."""
        return 4 if (self.upcast or self.in_model) else 0


def _loss_of(cx: StepContext) -> _Loss:
    s = cx.s
    bh = behaviour(s.stack)
    in_model = s.loss == "standard" and (bool(bh["logits_fp32_in_model"]) or s.before("transformers", "4.46"))
    return _Loss(chunks=s.loss_chunks if s.loss == "chunked" else 1, in_model=in_model, upcast=cx.loss_upcast,
                 fused=bool(s.compile),
                 shift_copy=s.loss == "standard" and s.before("transformers", "4.49") and not bh.get("no_shift_copy"))


def head_trains(cx: StepContext, ld: Loaded) -> bool:
    """Whether the output head's weight gets a gradient (its own, or a tied embedding's)."""
    return any(e.role == "output_head" for e in ld.head_params) or (
        cx.arch.tie_word_embeddings and cx.s.method == "full")


def head_forward(cx: StepContext, lay: Layers, ld: Loaded, x: Optional[int]) -> HeadForward:
    """The final norm (its trace, ``profile.head_alloc_ops``), the head's logits and the loss,
    up to the loss value."""
    pb = cx.pb
    ops = sized_ops(cx, cx.prof.head_alloc_ops)
    held: List[int] = []              # the head's input (and a LoRA head's), read by lm_head next
    _, saved = forward_ops(cx, ops, x, True, ("head",), held)
    if not input_saved(ops):
        pb.free(x)                    # the final norm read it (hidden_states = self.norm(hidden_states))
        x = None
    casts = [pb.alloc(nb, "autocast copy of the head weight", "weights", "autocast copies (16-bit)", "V x h x 2 B",
                      cx.c, label="head weight cast") for nb in lay.cast_bytes.get(-1, [])]
    hf = HeadForward(x, saved, casts)
    if runs_liger(cx):
        _liger_forward(cx, ld, hf)
    else:
        _logits_and_loss(cx, hf)
    # the final norm's output is the decoder's last_hidden_state: the causal-LM forward holds
    # ``outputs`` until it returns (modeling_llama.py LlamaForCausalLM.forward), loss included
    for k in held:
        pb.free(k)
    return hf


def _logits_and_loss(cx: StepContext, hf: HeadForward) -> None:
    pb = cx.pb
    lo = _loss_of(cx)
    n = lo.chunks
    TVn = cx.Th * cx.V / n
    lg_dtype = cx.logits_dtype
    c = DTYPE_BYTES[lg_dtype]
    for _ in range(n):
        if lo.in_model:
            tmp = pb.alloc(TVn * c, "logits (16-bit, before .float())", "logits and loss", "output head", "T x V",
                           lg_dtype)
            lg = pb.alloc(TVn * 4, "logits upcast to fp32 in the model", "logits and loss", "output head",
                          "T x V x 4 B (the model returns output(h).float())", "float32")
            pb.free(tmp)
        else:
            lg = pb.alloc(TVn * c, "logits", "logits and loss", "output head",
                          f"T{'/' + str(n) if n > 1 else ''} x V x {c:g} B", lg_dtype)
        tanh = None
        if cx.arch.final_logit_softcapping:
            scaled = pb.alloc(TVn * c, "logits / final_logit_softcapping", "logits and loss", "output head", "T x V",
                              lg_dtype)
            pb.free(lg)
            tanh = pb.alloc(TVn * c, "soft-capped logits tanh (saved)", "logits and loss", "output head", "T x V",
                            lg_dtype)
            pb.free(scaled)
            lg = pb.alloc(TVn * c, "soft-capped logits", "logits and loss", "output head", "T x V", lg_dtype)
        hf.logits.append(lg)
        hf.tanh.append(tanh)
    d = lo.ce_bytes or c
    ce_dtype = "float32" if d == 4 else lg_dtype
    for j in range(n):
        if lo.fused:
            hf.kept.append(pb.alloc(cx.Th / n * 4, "per-row logsumexp (fused cross-entropy)", "logits and loss", "loss",
                                    "T x 4 B: the fused kernel keeps its input and one fp32 value per row",
                                    "float32"))
            continue
        up = None
        if lo.upcast and not lo.in_model and c != 4:
            up = pb.alloc(TVn * 4, "logits upcast to fp32", "logits and loss", "loss",
                          "T x V x 4 B (the loss calls logits.float())", "float32")
        shift = pb.alloc(TVn * 4, "shifted logits copy (fp32)", "logits and loss", "loss",
                         "T x V x 4 B (logits[..., :-1, :].contiguous())", "float32") if lo.shift_copy else None
        hf.kept.append(pb.alloc(TVn * d, "log_softmax output" + (" (fp32)" if d == 4 else ""), "logits and loss",
                                "loss", f"T x V x {d:g} B (cross_entropy keeps it for backward)", ce_dtype))
        pb.free(shift)
        pb.free(up)


def runs_liger(cx: StepContext) -> bool:
    """Liger's fused loss runs where the output head is: a pipeline stage without it
    (parallel's slice, vocabulary 0) has no logits, whatever the loss."""
    return cx.s.loss == "liger" and cx.V > 0


def _liger_forward(cx: StepContext, ld: Loaded, hf: HeadForward) -> None:
    pb = cx.pb
    T, V, h = cx.Th, cx.V, cx.h
    c = DTYPE_BYTES[cx.logits_dtype]
    rows = liger_chunk_rows(T, V, h)
    hf.grad_input = pb.alloc(T * h * c, "gradient of the head's input (Liger, kept)", "logits and loss",
                             "output head", "T x h, computed in the forward", cx.logits_dtype)
    if head_trains(cx, ld):
        hf.grad_weight = pb.alloc(V * h * c, "gradient of the head's weight (Liger)", "gradients", "output head",
                                  "V x h, computed in the forward", cx.logits_dtype)
    loss_1d = pb.alloc(T * 4, "per-token loss (fp32)", "logits and loss", "loss", "T x 4 B", "float32")
    # one chunk's logits, made and freed: the caching allocator serves every later chunk from
    # the block the first one freed (the same best fit, split and merged back), so the rest
    # (cdiv(T, rows) in all, the last one smaller) move no peak and no reserve
    # (tests/test_step_plan.py writes them all and compares)
    n = liger_chunks(T, rows)
    if n is None:       # a size of the batch and sequence: at least one chunk at every size
        if LIGER_CHUNKS_WRITTEN > 1:
            raise NotPolynomial("Liger's number of chunks at every size (only the first is written for all)")
        n = 1
    for _ in range(min(n, LIGER_CHUNKS_WRITTEN)):
        pb.free(pb.alloc(rows * V * c, "logits of one chunk of rows (Liger)", "logits and loss", "output head",
                         f"rows x V x {c:g} B (rows = min(T, next_pow2(cdiv(T, cdiv(V, h)))))", cx.logits_dtype))
    pb.free(loss_1d)


#: Liger's chunks of logits a step plan writes (every later one reuses the first one's block)
LIGER_CHUNKS_WRITTEN = 1


def liger_chunk_rows(T: Any, V: int, h: int) -> Any:
    """Liger's rows per chunk, so that a chunk's logits match the input
    (``fused_linear_cross_entropy.py``: inc_factor = cdiv(V, H), chunk_size =
    next_power_of_2(cdiv(BT, inc_factor)), at most BT); 0 for no tokens.  ``T`` a number, or
    a :class:`~vramwidget.plan.size.Size` of the batch and sequence: then a ``Size.step`` term
    of it, read at any size."""
    from .size import Size

    inc = -(-V // h)
    if isinstance(T, Size) and not T.is_constant():
        return Size.step(f"liger_rows(T, {inc})", _LigerRows(inc), T)
    return int(_LigerRows(inc)(int(T)))


def liger_chunks(T: Any, rows: Any) -> Optional[int]:
    """How many chunks Liger's loop runs (cdiv(T, rows)); None for a size of the batch and
    sequence (at least one at every size: every b, s >= 1 has tokens)."""
    from .size import Size

    if isinstance(T, Size) and not T.is_constant():
        return None
    T, rows = int(T), int(rows)
    return -(-T // rows) if rows > 0 else 0


@dataclass(frozen=True)
class _LigerRows:
    """min(T, next_pow2(cdiv(T, inc))) of a number or a numpy array of whole token counts
    (0 for none): equal by ``inc``, so equal rows share one term of a plan's coefficients."""

    inc: int

    def __call__(self, T: Any) -> Any:
        import numpy as np

        if not isinstance(T, np.ndarray):
            T = int(round(T))
            if T <= 0:
                return 0
            rows = -(-T // self.inc)
            return min(T, 1 << max(0, (rows - 1).bit_length()))
        t = np.rint(T).astype(np.int64)
        rows = -(-t // self.inc)
        # the least power of two >= rows: 2 ** bit_length(rows - 1), the exponent frexp gives
        p = np.ldexp(1.0, np.frexp(np.maximum(rows - 1, 0).astype(float))[1])
        return np.where(t > 0, np.minimum(t, p), 0).astype(float)


def del_outputs(cx: StepContext, hf: HeadForward) -> None:
    """``del out``: the logits go unless the loss kept them (the compiled loss keeps its input)."""
    if not cx.s.compile:
        for k in hf.logits:
            cx.pb.free(k)


def loss_backward(cx: StepContext, ld: Loaded, hf: HeadForward, grad_ready: GradReady
                  ) -> Tuple[Optional[int], Optional[int]]:
    """From the loss back to the final norm's input: (that gradient's key, the key of a tied
    head's gradient, which waits for the embedding's to be added into it)."""
    pb = cx.pb
    s, arch = cx.s, cx.arch
    Th, h, V = cx.Th, cx.h, cx.V
    tied = arch.tie_word_embeddings and s.method == "full"
    head_entries = [e for e in ld.head_params if e.role == "output_head"]
    tied_key: Optional[int] = None
    if runs_liger(cx):
        g = hf.grad_input             # handed on by the backward (scaled in place)
        if tied:
            tied_key = hf.grad_weight
        elif head_entries:
            grad_ready(("head", 0), hf.grad_weight, head_entries[0])
            for e in head_entries[1:]:
                grad_ready(("head", 0), param_grad(cx, e, (e.module, "grad")), e)
    else:
        g, tied_key = _chunks_backward(cx, hf, head_entries, tied, grad_ready)
    for k in hf.casts:
        pb.free(k)
    norm_params = [e for e in ld.head_params if e.role != "output_head"]
    ops = sized_ops(cx, cx.prof.head_alloc_ops)
    g2 = backward_ops(cx, ops, g, hf.saved, norm_params, Th * h * cx.resid_bytes, ("head",), ("head", 0), grad_ready)
    pb.free(hf.final_in)
    return g2, tied_key


def _chunks_backward(cx: StepContext, hf: HeadForward, head_entries: List[Any], tied: bool,
                     grad_ready: GradReady) -> Tuple[Optional[int], Optional[int]]:
    """The loss and the head, chunk by chunk (the last first): each chunk's logits gradient,
    then lm_head's backward (its weight's gradient: the first chunk's is kept, the others are
    added into it; its input's)."""
    pb = cx.pb
    s = cx.s
    lo = _loss_of(cx)
    n = lo.chunks
    Th, h, V = cx.Th, cx.h, cx.V
    TVn = Th * V / n
    lg_dtype = cx.logits_dtype
    c = DTYPE_BYTES[lg_dtype]
    d = lo.ce_bytes or c
    ce_dtype = "float32" if d == 4 else lg_dtype
    tied_key: Optional[int] = None
    parts: List[Optional[int]] = []
    for j in reversed(range(n)):
        if lo.fused:
            held = 4 if lo.in_model else c
            g_lg = pb.alloc(TVn * held, "gradient of the logits (fused cross-entropy)", "logits and loss", "loss",
                            f"T x V x {held:g} B", lg_dtype)
            pb.free(hf.kept[j])
            pb.free(hf.logits[j])      # the fused loss's saved input
        else:
            g_nll = pb.alloc(TVn * d, "nll_loss gradient", "logits and loss", "loss", "T x V", ce_dtype)
            g_ls = pb.alloc(TVn * d, "log_softmax gradient", "logits and loss", "loss", "T x V", ce_dtype)
            pb.free(hf.kept[j])
            pb.free(g_nll)
            g_lg = g_ls
            if d == 4 and c != 4:
                g_lg = pb.alloc(TVn * c, "logits gradient", "logits and loss", "output head", "T x V", lg_dtype)
                pb.free(g_ls)
        if hf.tanh[j] is not None:
            # back through * cap, tanh (1 - y^2, then its saved output goes) and / cap
            g1 = pb.alloc(TVn * c, "gradient of the tanh output", "logits and loss", "output head", "T x V", lg_dtype)
            pb.free(g_lg)
            g2 = pb.alloc(TVn * c, "gradient of the tanh input", "logits and loss", "output head", "T x V", lg_dtype)
            pb.free(g1)
            pb.free(hf.tanh[j])
            g_lg = pb.alloc(TVn * c, "gradient of the head's logits", "logits and loss", "output head", "T x V",
                            lg_dtype)
            pb.free(g2)
        # lm_head's backward for this chunk
        first = j == n - 1
        for e in head_entries:
            key = param_grad(cx, e, (e.module, "grad"))
            if first:
                grad_ready(("head", 0), key, e)
            else:
                pb.free(key)           # added into the first chunk's (AccumulateGrad, in place)
        if tied:
            key = pb.alloc(V * h * DTYPE_BYTES[s.weights_dtype], "lm_head gradient (tied to the embedding)",
                           "gradients", "output head", "V x h", s.weights_dtype)
            if first:
                tied_key = key
            else:
                pb.free(key)
        parts.append(pb.alloc(Th / n * h * DTYPE_BYTES[cx.c], "head input gradient", "activations", "output head",
                              "T x h" if n == 1 else f"T/{n} x h", cx.c))
        pb.free(g_lg)
    if n == 1:
        return parts[0], tied_key
    # h.chunk's backward joins the chunks' gradients
    g = pb.alloc(Th * h * DTYPE_BYTES[cx.c], "head input gradient", "activations", "output head", "T x h", cx.c)
    for k in parts:
        pb.free(k)
    return g, tied_key
