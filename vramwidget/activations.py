"""What autograd keeps for the backward pass: one transformer block, traced op by op.

Each function below mirrors one module of the transformers implementation and records,
for every tensor it creates, its size and dtype, and which tensors the autograd nodes
*save* (PyTorch saves an input only when the gradient that needs it is required: a
frozen Linear does not keep its input; ``x * cos`` keeps only ``cos``).  Views share
storage, so a tensor saved by two nodes is counted once.  The rules, each checked
against tensors recorded with ``torch.autograd.graph.saved_tensors_hooks``:

* Linear ``y = x W^T`` saves ``x`` iff ``W`` trains.  Under autocast the input is first
  cast to the compute dtype, one copy per Linear (casts of activations are not cached).
* LoRA (peft) casts ``x`` to the adapter dtype (fp32) once per adapted module and
  ``lora_A`` saves that copy; ``lora_B`` saves ``lora_A``'s output (T x r).
* RMSNorm (Llama) upcasts to fp32 and saves that copy and ``rsqrt`` (if its input needs a
  gradient), saves the normalised tensor cast back (if its weight trains); its output is a
  new tensor.  LayerNorm saves its input plus fp32 mean and rstd.
* RoPE's products keep only ``cos``/``sin``: the rotated q and k are new tensors.
* SDPA flash/memory-efficient kernels save q, k, v, the output and a fp32 logsumexp;
  the math fallback (fp32 with grouped KV heads) and eager attention keep
  batch x heads x seq x seq probabilities (eager: fp32 softmax output and its copy).
* Gated MLP: ``act(gate) * up`` saves gate, act(gate), up and the product.
* MoE experts (transformers 5): every token is copied to its top-k experts, so the
  expert tensors scale with tokens x k.

The symbols: T = batch x seq tokens, h hidden, i intermediate, a heads, kv KV heads, d head
dim, s seq, b batch, V vocab, E experts, k experts per token, r LoRA rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from .architecture import Architecture
from .training import TrainingSetup
from .units import DTYPE_BYTES

F32 = "float32"
#: module group of the tensors peft's LoRA layers save (fp32 input copies, lora_A outputs)
LORA_GROUP = "LoRA inputs (peft casts to fp32)"


@dataclass
class _T:
    """A tensor of the forward pass: storage name, elements, dtype, needs-grad flag."""

    name: str
    numel: float
    dtype: str
    rg: bool
    formula: str
    group: str


@dataclass
class SavedTensor:
    name: str
    group: str          # module group: attention, mlp, norms, experts, adapters, ...
    nbytes: float
    dtype: str
    numel: float
    formula: str


class Trace:
    """A recorder of forward tensors and of which ones autograd saves."""

    def __init__(self) -> None:
        self.saved: Dict[str, SavedTensor] = {}
        #: every tensor the forward creates and every parameter it uses, in order (the
        #: allocation events of the caching-allocator replay, ``events.py``)
        self.ops: List[Tuple[str, object]] = []

    def new(self, name: str, numel: float, dtype: str, rg: bool, formula: str, group: str) -> _T:
        """Record a new forward tensor (not yet saved)."""
        t = _T(name, numel, dtype, rg, formula, group)
        self.ops.append(("new", t))
        return t

    def param(self, module: str) -> None:
        """Record that the op just traced used ``module``'s parameters (their gradients are
        made when backward reaches it)."""
        self.ops.append(("param", module))

    def save(self, t: _T) -> None:
        """Mark ``t`` as kept for backward (once per storage)."""
        if t.name not in self.saved:
            self.saved[t.name] = SavedTensor(t.name, t.group, t.numel * DTYPE_BYTES[t.dtype], t.dtype, t.numel,
                                             t.formula)

    def cast(self, t: _T, dtype: str, name: str) -> _T:
        """``t.to(dtype)``: the same tensor when the dtype already matches, else a copy."""
        if t.dtype == dtype:
            return t
        return self.new(name, t.numel, dtype, t.rg, f"{t.formula} as {dtype}", t.group)

    @property
    def total_bytes(self) -> float:
        return sum(s.nbytes for s in self.saved.values())


@dataclass
class BlockContext:
    """What one block's trace needs to know about the run."""

    arch: Architecture
    setup: TrainingSetup
    T: int
    b: int
    s: int
    c: str                 # compute dtype
    resid: str             # residual-stream dtype
    norm_w_dtype: str      # dtype of norm weights (fp32 after prepare_model_for_kbit_training)
    linear_trains: bool    # base linear weights train (full fine-tuning of this block)
    norms_train: bool
    lora_modules: Tuple[str, ...]
    adapter_dtype: str
    attn_backend: str      # flash | efficient | math | eager
    quant_base: bool
    dense_layer: bool = False   # a dense (non-MoE) block inside an MoE model
    cpu: bool = False           # CPU kernels (for checking against torch without a GPU)


def attention_backend(arch: Architecture, setup: TrainingSetup, compute_dtype: str) -> str:
    """Which kernel scaled_dot_product_attention picks on a CUDA GPU (PyTorch 2.x).

    Flash attention needs 16-bit inputs and head dim <= 256; memory-efficient attention
    takes fp32 too but not grouped KV heads (``enable_gqa``); otherwise SDPA falls back to
    the math kernel, which materialises the scores.  ``selective`` checkpointing
    (Korthikanti et al.) wraps the attention core in a checkpoint: only its inputs q, k, v
    are kept and the core is recomputed in backward ("recompute").
    """
    impl = setup.attn_implementation
    if setup.gradient_checkpointing == "selective":
        return "recompute"
    if impl == "eager":
        return "eager"
    if impl == "flash_attention_2":
        return "flash"
    sixteen = compute_dtype in ("bfloat16", "float16")
    d = arch.head_dim
    if (arch.attn_logit_softcapping or arch.model_type == "bloom") and impl != "flash_attention_2":
        # SDPA cannot soft-cap (Gemma 2) or add ALiBi (BLOOM): transformers runs them eager
        return "eager"
    if arch.mla and arch.mla["v_head_dim"] != arch.mla["qk_rope_head_dim"] + arch.mla["qk_nope_head_dim"]:
        return "efficient"  # flash needs one head dim for q, k and v; MLA's v is narrower
    if sixteen and d <= 256:
        return "flash"
    if arch.num_kv_heads == arch.num_heads or arch.mla:
        return "efficient"
    return "math"


# ---------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------

def linear(tr: Trace, ctx: BlockContext, x: _T, module: str, out_features: float, name: str, group: str,
           *, trains: Optional[bool] = None, tokens: Optional[float] = None, in_features: Optional[float] = None
           ) -> _T:
    """``module(x)``: a Linear (possibly 4-bit, possibly with a LoRA adapter)."""
    trains = ctx.linear_trains if trains is None else trains
    n_tok = tokens if tokens is not None else ctx.T
    in_f = in_features if in_features is not None else x.numel / n_tok
    xin = x
    if ctx.setup.autocast or ctx.setup.precision == "fp8":
        target = ctx.c
        if xin.dtype != target:
            xin = tr.new(f"{module} input cast to {target}", x.numel, target, x.rg,
                         f"T x {_dim(in_f)} ({module} input, autocast copy)", group)
    if trains:
        if ctx.setup.precision == "fp8":
            xin = tr.new(f"{module} input (fp8)", x.numel, "float8", x.rg, f"T x {_dim(in_f)} fp8 copy", group)
        tr.save(xin)
    out_dtype = ctx.c if (ctx.setup.autocast or ctx.quant_base) else (xin.dtype if not ctx.quant_base else ctx.c)
    if ctx.quant_base and x.dtype == F32:
        out_dtype = F32  # bnb Linear4bit returns the input's dtype
    rg = trains or x.rg
    if ctx.quant_base:
        # bitsandbytes' MatMul4Bit dequantizes the weight for each matmul (a transient; not saved)
        tr.new(f"{module} dequantized weight", out_features * in_f, ctx.c, False,
               f"{_dim(out_features)} x {_dim(in_f)} (transient)", group)
    if module in ctx.lora_modules:
        rg = True
        r = ctx.setup.lora_r
        tag = f"{module} ({name})"   # GPT-2 has two modules named c_proj
        # peft's Linear.forward: result = base_layer(x) first, the adapter's path after it
        tr.new(f"{tag} base layer output", n_tok * out_features, out_dtype, rg, "T x out (transient)", group)
        xa = tr.cast(x, ctx.adapter_dtype, f"{tag} LoRA input as {ctx.adapter_dtype}")
        if xa is not x:
            xa.formula = f"T x {_dim(in_f)} ({module} input cast to the adapter dtype)"
            xa.group = LORA_GROUP
        if ctx.setup.lora_dropout > 0:
            tr.save(tr.new(f"{tag} LoRA dropout mask", x.numel, xa.dtype if ctx.cpu else "uint8", True,
                           f"T x {_dim(in_f)} bool", LORA_GROUP))
            xa = tr.new(f"{tag} LoRA dropped input", x.numel, xa.dtype, True, f"T x {_dim(in_f)}", LORA_GROUP)
        if ctx.setup.autocast:
            xa = tr.new(f"{tag} LoRA input cast to {ctx.c}", x.numel, ctx.c, True, f"T x {_dim(in_f)}", LORA_GROUP)
        tr.save(xa)
        a_dtype = ctx.c if ctx.setup.autocast else ctx.adapter_dtype
        tr.save(tr.new(f"{tag} lora_A output", n_tok * r, a_dtype, True, f"T x r (r={r})", LORA_GROUP))
        # lora_B(...) * scaling, added to the base result (promoted to the adapter dtype) and
        # cast back with result.to(torch_result_dtype): transients the trace need not keep
        tr.new(f"{tag} lora_B output", n_tok * out_features, a_dtype, True, "T x out (transient)", LORA_GROUP)
        tr.new(f"{tag} lora_B output x scaling", n_tok * out_features, a_dtype, True, "T x out (transient)",
               LORA_GROUP)
        if _promote(a_dtype, out_dtype) != out_dtype:
            tr.new(f"{tag} base + LoRA", n_tok * out_features, _promote(a_dtype, out_dtype), True,
                   "T x out (transient)", LORA_GROUP)
    out = tr.new(name, n_tok * out_features, out_dtype, rg, f"T x {_dim(out_features)}", group)
    tr.param(module)
    return out


def rms_norm(tr: Trace, ctx: BlockContext, x: _T, name: str, dim: float, group: str = "norms",
             gemma: bool = False, trains: Optional[bool] = None) -> _T:
    """Llama RMSNorm as transformers writes it (fp32 math, weight applied after casting
    back).  ``gemma=True``: the weight multiplies the fp32 normalised tensor and the result
    is cast back (Gemma's ``* (1 + w)``, OLMo 2's ``(w * x).to(dtype)``)."""
    trains = ctx.norms_train if trains is None else trains
    x32 = tr.cast(x, F32, f"{name} input as fp32")
    if x32 is not x:
        x32.formula, x32.group = f"T x {_dim(dim)} fp32 upcast", group
    rows = x.numel / dim
    if x.rg:
        tr.save(x32)
        tr.save(tr.new(f"{name} rsqrt", rows, F32, True, "T x 1 fp32", group))
    n32 = tr.new(f"{name} normalised fp32", x.numel, F32, x.rg or trains, f"T x {_dim(dim)} fp32", group)
    if gemma:
        if trains:
            tr.save(n32)
        out32 = tr.new(f"{name} output fp32", x.numel, F32, x.rg or trains, f"T x {_dim(dim)}", group)
        tr.param(name)
        return tr.cast(out32, x.dtype, f"{name} output")
    n_c = tr.cast(n32, x.dtype, f"{name} normalised")
    if n_c is not n32:
        n_c.formula = f"T x {_dim(dim)} ({name} normalised, cast back)"
    if trains:
        tr.save(n_c)
    out_dtype = _promote(ctx.norm_w_dtype, x.dtype)
    out = tr.new(f"{name} output", x.numel, out_dtype, x.rg or trains, f"T x {_dim(dim)}", group)
    tr.param(name)
    return out


def layer_norm(tr: Trace, ctx: BlockContext, x: _T, name: str, dim: float, group: str = "norms") -> _T:
    """nn.LayerNorm: saves its input and fp32 mean and rstd (autocast runs it in fp32)."""
    xin = tr.cast(x, F32, f"{name} input as fp32") if ctx.setup.autocast else x
    if x.rg or ctx.norms_train:
        tr.save(xin)
        tr.save(tr.new(f"{name} mean and rstd", 2 * x.numel / dim, F32, True, "2 x T fp32", group))
    out = tr.new(f"{name} output", x.numel, xin.dtype, x.rg or ctx.norms_train, f"T x {_dim(dim)}", group)
    tr.param(name)
    return out


def dropout(tr: Trace, x: _T, p: float, name: str, cpu: bool = False) -> _T:
    """nn.Dropout in training mode: keeps a 1-byte mask on CUDA (the CPU kernel keeps a
    mask in the input's dtype); p == 0 is the identity."""
    if p <= 0:
        return x
    if x.rg:
        tr.save(tr.new(f"{name} dropout mask", x.numel, x.dtype if cpu else "uint8", True,
                       f"{x.formula} bool mask", x.group))
    return tr.new(f"{name} after dropout", x.numel, x.dtype, x.rg, x.formula, x.group)


def sdpa_core(tr: Trace, ctx: BlockContext, q: _T, k: _T, v: _T, v_head_dim: int, group: str = "attention",
              softcap: bool = False, dropout_p: float = 0.0, softmax_fp32: bool = True,
              q_heads_major: bool = False) -> _T:
    """The attention core for the chosen backend; returns the (b, s, a*d) output."""
    a, kv = ctx.arch.num_heads, ctx.arch.num_kv_heads
    b, s, T = ctx.b, ctx.s, ctx.T
    backend = ctx.attn_backend
    rg = q.rg or k.rg or v.rg
    if ctx.setup.autocast and backend != "eager":
        q, k, v = (tr.cast(t, ctx.c, f"{t.name} cast to {ctx.c}") for t in (q, k, v))
    out_numel = T * a * v_head_dim
    scores = b * a * s * s
    if backend == "recompute":
        # the checkpointed core keeps its inputs; v is kept as its own (contiguous) tensor,
        # not as a view that would hold a fused QKV output alive
        if rg:
            for t, n, label in ((q, T * a * ctx.arch.head_dim, "q"), (k, T * kv * ctx.arch.head_dim, "k"),
                                (v, T * kv * v_head_dim, "v")):
                tr.save(t if t.numel == n else tr.new(f"{label} (kept for the recomputed core)", n, t.dtype, True,
                                                      "T x heads*d", group))
        return tr.new("attention output", out_numel, q.dtype, rg, "T x a*d", group)
    if backend in ("flash", "efficient"):
        if rg:
            for t in (q, k, v):
                tr.save(t)
            tr.save(tr.new("attention logsumexp", b * a * s, F32, True, "b x a x s fp32", group))
        out = tr.new("attention output", out_numel, q.dtype, rg, "T x a*d", group)
        if rg:
            tr.save(out)  # the kernel's backward needs its own output
        if q_heads_major and backend == "flash":
            # flash attention allocates its output in q's memory layout; a q built by torch.cat
            # (partial RoPE: Phi-3, GPT-NeoX) is (b, a, s, d)-contiguous, so transformers'
            # transpose(1, 2).contiguous() copies the output before the projection
            return tr.new("attention output (transposed copy)", out_numel, q.dtype, rg, "T x a*d", group)
        return out
    if backend == "math":
        c = q.dtype
        if rg:
            tr.save(tr.new("q scaled (math SDPA)", q.numel, c, True, "T x a*d", group))
            tr.save(tr.new("k repeated and scaled (math SDPA)", T * a * ctx.arch.head_dim, c, True, "T x a*d", group))
            # q @ k^T, masked in place; the softmax keeps only its output
            tr.new("attention scores (math SDPA)", scores, c, True, "b x a x s x s (transient)", group)
            tr.save(tr.new("attention probabilities (math SDPA)", scores, c, True, "b x a x s x s", group))
            if kv != a:
                tr.save(tr.new("v repeated (math SDPA)", T * a * v_head_dim, c, True, "T x a*d", group))
            else:
                tr.save(v)
        # the math kernel's output is (b, a, s, d)-contiguous: transformers copies it before o_proj
        return tr.new("attention output", out_numel, c, rg, "T x a*d (transposed copy)", group)
    # eager: explicit scores and softmax
    c = ctx.c
    n_rep = a // kv if kv else 1
    if rg:
        tr.save(tr.cast(q, c, "q cast"))
        # repeat_kv copies k and v to every head; the matmuls (under autocast: their 16-bit casts) keep them
        ke = tr.cast(k, c, "k cast") if n_rep == 1 else tr.new("k repeated to all heads", T * a * ctx.arch.head_dim,
                                                                c, True, "T x a*d (repeat_kv copy)", group)
        ve = tr.cast(v, c, "v cast") if n_rep == 1 else tr.new("v repeated to all heads", T * a * v_head_dim, c,
                                                                True, "T x a*d (repeat_kv copy)", group)
        tr.save(ke)
        tr.save(ve)
        # matmul(q, k^T) * scaling + causal mask: three b x a x s x s transients before the softmax
        for label in ("attention scores", "attention scores scaled", "attention scores masked"):
            tr.new(label, scores, c, True, "b x a x s x s (transient)", group)
        if softcap:
            tr.save(tr.new("soft-capped scores tanh", scores, c, True, "b x a x s x s", group))
        sm_dtype = F32 if softmax_fp32 else c
        if sm_dtype != c:
            # softmax(x, dtype=float32) converts its input first (at::softmax: input.toType(dtype))
            tr.new("attention scores as fp32 (softmax input)", scores, F32, True, "b x a x s x s fp32 (transient)",
                   group)
        p32 = tr.new("softmax output" + (" fp32" if softmax_fp32 else ""), scores, sm_dtype, True,
                     "b x a x s x s" + (" fp32" if softmax_fp32 else ""), group)
        tr.save(p32)
        p = tr.cast(p32, c, "attention probabilities")
        p.formula = "b x a x s x s"
        if dropout_p > 0:
            tr.save(tr.new("attention dropout mask", scores, c if ctx.cpu else "uint8", True, "b x a x s x s bool",
                       group))
            p = tr.new("attention probabilities after dropout", scores, c, True, "b x a x s x s", group)
        tr.save(p)
    return tr.new("attention output", out_numel, c, rg, "T x a*d (transposed copy)", group)


def _promote(a: str, b: str) -> str:
    if F32 in (a, b):
        return F32
    return b


def _dim(x: float) -> str:
    x = float(x)
    return str(int(x)) if x == int(x) else f"{x:g}"


# ---------------------------------------------------------------------------------
# Blocks
# ---------------------------------------------------------------------------------

def llama_block(tr: Trace, ctx: BlockContext, x: _T) -> _T:
    """One decoder layer of the Llama family (Mistral, Qwen, Gemma, Phi-3, OLMoE, DeepSeek...)."""
    arch, T = ctx.arch, ctx.T
    mt = arch.model_type
    h, a, kv, d = arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim
    gemma = mt.startswith("gemma")
    post_norms = mt in ("gemma2", "gemma3_text")
    if mt == "olmo2":
        n1 = x
        gemma = True   # OLMo 2's norms apply the weight in fp32 too
    else:
        n1 = rms_norm(tr, ctx, x, "input_layernorm", h, gemma=gemma)
    # --- attention ---
    # RoPE: q * cos + rotate_half(q) * sin with cos/sin in the hidden states' dtype
    # (fp32 under autocast, and after prepare_model_for_kbit_training where 4-bit linears return fp32)
    rope_dtype = _promote(ctx.resid, ctx.c) if (ctx.setup.autocast or ctx.quant_base) else ctx.c
    if arch.mla:
        m = arch.mla
        qh = m["qk_rope_head_dim"] + m["qk_nope_head_dim"]
        if m["q_lora_rank"]:
            qa = linear(tr, ctx, n1, "q_a_proj", m["q_lora_rank"], "q_a", "attention")
            qa_n = rms_norm(tr, ctx, qa, "q_a_layernorm", m["q_lora_rank"], "attention")
            q = linear(tr, ctx, qa_n, "q_b_proj", a * qh, "q", "attention", in_features=m["q_lora_rank"])
        else:
            q = linear(tr, ctx, n1, "q_proj", a * qh, "q", "attention")
        kva = linear(tr, ctx, n1, "kv_a_proj_with_mqa", m["kv_lora_rank"] + m["qk_rope_head_dim"], "kv_a",
                     "attention")
        # the latent (kv_lora_rank wide) is normalised; the rope part goes through complex RoPE
        latent = tr.new("kv latent", T * m["kv_lora_rank"], kva.dtype, kva.rg, "T x kv_lora_rank", "attention")
        kvn = rms_norm(tr, ctx, latent, "kv_a_layernorm", m["kv_lora_rank"], "attention")
        kvb = linear(tr, ctx, kvn, "kv_b_proj", a * (m["qk_nope_head_dim"] + m["v_head_dim"]), "kv_b output",
                     "attention", in_features=m["kv_lora_rank"])
        # query = cat(q_nope, rope(q_pe)) and key = a new tensor filled from k_nope and rope(k_pe);
        # value is a view of kv_b_proj's output, so the attention keeps all of that output
        qr = tr.new("q (nope + rope, concatenated)", T * a * qh, rope_dtype, True, "T x a x (nope+rope)",
                    "attention")
        kr = tr.new("k (nope + rope, new tensor)", T * a * qh, rope_dtype, True, "T x a x (nope+rope)",
                    "attention")
        v = kvb
        o_in = sdpa_core(tr, ctx, qr, kr, v, m["v_head_dim"])
    else:
        if mt == "phi3":
            qkv = linear(tr, ctx, n1, "qkv_proj", (a + 2 * kv) * d, "qkv", "attention")
            q = tr.new("q", T * a * d, qkv.dtype, qkv.rg, "T x a*d", "attention")
            k = tr.new("k", T * kv * d, qkv.dtype, qkv.rg, "T x kv*d", "attention")
            v = tr.new("qkv_proj output", qkv.numel, qkv.dtype, qkv.rg, "T x (a+2kv)*d", "attention")
        else:
            q = linear(tr, ctx, n1, "q_proj", a * d, "q_proj output", "attention")
            k = linear(tr, ctx, n1, "k_proj", kv * d, "k_proj output", "attention")
            v = linear(tr, ctx, n1, "v_proj", kv * d, "v", "attention")
        if mt in ("qwen3", "qwen3_moe", "gemma3_text"):
            q = rms_norm(tr, ctx, q, "q_norm", d, "attention", gemma=gemma)
            k = rms_norm(tr, ctx, k, "k_norm", d, "attention", gemma=gemma)
        elif mt in ("olmoe", "olmo2"):
            q = rms_norm(tr, ctx, q, "q_norm", a * d, "attention", gemma=gemma)
            k = rms_norm(tr, ctx, k, "k_norm", kv * d, "attention", gemma=gemma)
        qr = tr.new("q after rope", T * a * d, rope_dtype, q.rg, "T x a*d", "attention")
        kr = tr.new("k after rope", T * kv * d, rope_dtype, k.rg, "T x kv*d", "attention")
        o_in = sdpa_core(tr, ctx, qr, kr, v, d, softcap=bool(arch.attn_logit_softcapping),
                         dropout_p=float(arch.config.get("attention_dropout") or 0.0),
                         q_heads_major=(mt == "phi3"))
    o = linear(tr, ctx, o_in, "o_proj", h, "o_proj output", "attention", in_features=o_in.numel / T)
    if post_norms:
        o = rms_norm(tr, ctx, o, "post_attention_layernorm", h, gemma=gemma)
    elif mt == "olmo2":
        o = rms_norm(tr, ctx, o, "post_attention_layernorm", h, gemma=True)
    x1 = tr.new("residual after attention", x.numel, _promote(x.dtype, o.dtype), True, "T x h", "norms")
    # --- MLP / experts ---
    if mt == "olmo2":
        n2 = x1
    else:
        n2 = rms_norm(tr, ctx, x1, "pre_feedforward_layernorm" if post_norms else "post_attention_layernorm", h,
                      gemma=gemma)
    if arch.is_moe and not ctx.dense_layer:
        m = moe(tr, ctx, n2)
    else:
        i = arch.intermediate_size
        if arch.is_moe:
            i = int(arch.config.get("intermediate_size") or i)
        m = gated_mlp(tr, ctx, n2, i, fused=(mt == "phi3"))
    if post_norms:
        m = rms_norm(tr, ctx, m, "post_feedforward_layernorm", h, gemma=gemma)
    elif mt == "olmo2":
        m = rms_norm(tr, ctx, m, "post_feedforward_layernorm", h, gemma=True)
    return tr.new("block output", x.numel, _promote(x1.dtype, m.dtype), True, "T x h", "norms")


def gated_mlp(tr: Trace, ctx: BlockContext, x: _T, i: int, *, fused: bool = False, prefix: str = "",
              group: str = "mlp", trains: Optional[bool] = None, tokens: Optional[float] = None) -> _T:
    """``down(act(gate(x)) * up(x))``: gate, up, act(gate) and the product are kept."""
    T = tokens if tokens is not None else ctx.T
    if fused:
        gu = linear(tr, ctx, x, "gate_up_proj", 2 * i, prefix + "gate_up_proj output", group, trains=trains)
        g = gu
        u = gu
    else:
        g = linear(tr, ctx, x, "gate_proj", i, prefix + "gate_proj output", group, trains=trains, tokens=T)
        u = linear(tr, ctx, x, "up_proj", i, prefix + "up_proj output", group, trains=trains, tokens=T)
    rg = g.rg or u.rg
    if rg:
        tr.save(g)
        tr.save(u)
    act = tr.new(prefix + "activation output", T * i, g.dtype, rg, "T x i", group)
    if rg:
        tr.save(act)
    p = tr.new(prefix + "act(gate) * up", T * i, g.dtype, rg, "T x i", group)
    return linear(tr, ctx, p, "down_proj", ctx.arch.hidden_size, prefix + "down_proj output", group, trains=trains,
                  tokens=T, in_features=i)


def moe(tr: Trace, ctx: BlockContext, x: _T) -> _T:
    """Router + routed experts (+ shared experts); experts see T x k token copies."""
    arch, T = ctx.arch, ctx.T
    E, k, ie, h = arch.num_experts, arch.experts_per_token, arch.expert_intermediate_size, arch.hidden_size
    logits = linear(tr, ctx, x, "gate", E, "router logits", "router")
    if logits.rg:
        tr.save(tr.new("router softmax fp32", T * E, F32, True, "T x E fp32", "router"))
    Tk = T * k
    trains = ctx.linear_trains
    rg = x.rg or trains
    xe = tr.new("tokens copied to experts", Tk * h, x.dtype, x.rg, f"T*k x h (k={k})", "experts")
    if trains:
        tr.save(xe)
    gu = tr.new("expert gate_up output", Tk * 2 * ie, ctx.c, rg, "T*k x 2*i_e", "experts")
    act = tr.new("expert activation output", Tk * ie, ctx.c, rg, "T*k x i_e", "experts")
    p = tr.new("expert act(gate) * up", Tk * ie, ctx.c, rg, "T*k x i_e", "experts")
    down = tr.new("expert down output", Tk * h, ctx.c, rg, "T*k x h", "experts")
    if rg:
        for t in (gu, act, down):
            tr.save(t)
        if trains:
            tr.save(p)
        tr.save(tr.new("routing weights", Tk, ctx.c, True, "T x k", "router"))
    out = tr.new("experts output", T * h, ctx.c, rg, "T x h", "experts")
    if arch.shared_expert_intermediate_size:
        sh = gated_mlp(tr, ctx, x, arch.shared_expert_intermediate_size, prefix="shared expert ", group="experts")
        if arch.model_type == "qwen2_moe":
            gate = linear(tr, ctx, x, "shared_expert_gate", 1, "shared expert gate", "router")
            if gate.rg:
                tr.save(tr.new("shared expert gate sigmoid", T, ctx.c, True, "T x 1", "router"))
                tr.save(sh)
        out = tr.new("moe output", T * h, ctx.c, True, "T x h", "experts")
    return out


def plain_block(tr: Trace, ctx: BlockContext, x: _T) -> _T:
    """GPT-2, GPT-NeoX, OPT, BLOOM, Falcon: LayerNorm, fused or separate QKV, plain MLP."""
    arch, T = ctx.arch, ctx.T
    mt = arch.model_type
    h, a, kv, d, i = arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.intermediate_size
    cfg = arch.config
    resid_p = float(cfg.get("resid_pdrop", cfg.get("dropout", cfg.get("hidden_dropout", 0.0))) or 0.0)
    attn_p = float(cfg.get("attn_pdrop", cfg.get("attention_dropout", 0.0)) or 0.0)
    if mt == "opt":
        resid_p = float(cfg.get("dropout", 0.1) if "dropout" in cfg else 0.1)
    parallel = (mt == "gpt_neox" and cfg.get("use_parallel_residual", True)) or (
        mt == "falcon" and cfg.get("parallel_attn", True))
    n1 = layer_norm(tr, ctx, x, "ln_1", h)
    names = {"gpt2": ("c_attn", "c_proj", "c_fc", "c_proj"), "gpt_neox": ("query_key_value", "dense",
                                                                          "dense_h_to_4h", "dense_4h_to_h"),
             "bloom": ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"),
             "falcon": ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"),
             "opt": ("q_proj", "out_proj", "fc1", "fc2")}[mt]
    if mt == "opt":
        q = linear(tr, ctx, n1, "q_proj", h, "q", "attention")
        k = linear(tr, ctx, n1, "k_proj", h, "k", "attention")
        v = linear(tr, ctx, n1, "v_proj", h, "v", "attention")
        if q.rg:
            q = tr.new("q scaled", q.numel, q.dtype, True, "T x h", "attention")
    else:
        qkv = linear(tr, ctx, n1, names[0], (a + 2 * kv) * d, "qkv", "attention")
        q, k, v = qkv, qkv, qkv   # views of one storage
        if mt in ("gpt_neox", "falcon"):  # rotary embeddings make new q and k
            q = tr.new("q after rope", T * a * d, ctx.c, qkv.rg, "T x a*d", "attention")
            k = tr.new("k after rope", T * kv * d, ctx.c, qkv.rg, "T x kv*d", "attention")
            if ctx.attn_backend == "eager":
                # the eager matmul copies the strided v view; the fused qkv output is not kept
                v = tr.new("v (contiguous copy)", T * kv * d, ctx.c, qkv.rg, "T x kv*d", "attention")
    # BLOOM's ALiBi attention has no SDPA path: attention_backend() already chose eager,
    # flash_attention_2 or the recomputed core for it.  GPT-2 and Falcon run the eager
    # softmax in the compute dtype; OPT, NeoX and BLOOM upcast to fp32.
    o_in = sdpa_core(tr, ctx, q, k, v, d, dropout_p=attn_p, softmax_fp32=mt not in ("gpt2", "falcon"),
                     q_heads_major=(mt == "gpt_neox"))
    o = linear(tr, ctx, o_in, names[1], h, "attention projection output", "attention", in_features=a * d)
    o = dropout(tr, o, resid_p, "attention residual", ctx.cpu)
    if parallel:
        n2 = n1 if mt == "falcon" else layer_norm(tr, ctx, x, "ln_2", h)
    else:
        x1 = tr.new("residual after attention", x.numel, _promote(x.dtype, o.dtype), True, "T x h", "norms")
        n2 = layer_norm(tr, ctx, x1, "ln_2", h)
    f = linear(tr, ctx, n2, names[2], i, "fc output", "mlp")
    act = activation(tr, ctx, f, i)
    m = linear(tr, ctx, act, names[3], h, "mlp projection output", "mlp", in_features=i)
    m = dropout(tr, m, resid_p, "mlp residual", ctx.cpu)
    return tr.new("block output", x.numel, x.dtype, True, "T x h", "norms")


def activation(tr: Trace, ctx: BlockContext, f: _T, i: int) -> _T:
    """The plain MLP's activation; GPT-2's gelu_new and BLOOM's gelu are Python composites."""
    cfg = ctx.arch.config
    name = str(cfg.get("activation_function", cfg.get("hidden_act", "gelu")))
    mt = ctx.arch.model_type
    T = ctx.T
    if not f.rg:
        return tr.new("activation output", f.numel, f.dtype, False, "T x i", "mlp")
    if mt == "bloom":
        # BLOOM trains with its own autograd Function (GeLUFunction): it keeps only the input
        tr.save(f)
    elif mt == "gpt2" and name in ("gelu_new", "gelu_fast"):
        # 0.5*x*(1+tanh(sqrt(2/pi)*(x+0.044715*x^3))): pow saves x, tanh its output,
        # the last product both factors.  Autocast runs pow in fp32, so from there on the
        # chain is fp32 (pow saves an fp32 copy of x; only 0.5*x stays 16-bit).
        if ctx.setup.autocast and f.dtype != F32:
            tr.save(tr.new("gelu input as fp32 (autocast pow)", T * i, F32, True, "T x i fp32", "mlp"))
            wide = F32
        else:
            tr.save(f)
            wide = f.dtype
        tr.save(tr.new("gelu tanh output", T * i, wide, True, "T x i", "mlp"))
        tr.save(tr.new("gelu 0.5 * x", T * i, f.dtype, True, "T x i", "mlp"))
        tr.save(tr.new("gelu 1 + tanh", T * i, wide, True, "T x i", "mlp"))
        return tr.new("activation output", f.numel, wide, True, "T x i", "mlp")
    elif name == "relu":
        out = tr.new("activation output", f.numel, f.dtype, True, "T x i", "mlp")
        tr.save(out)
        return out
    else:
        tr.save(f)
    return tr.new("activation output", f.numel, f.dtype, True, "T x i", "mlp")


def trace_block(ctx: BlockContext, *, input_rg: bool = True, dense_layer: bool = False) -> Trace:
    """The tensors one block saves for backward, given whether its input needs a gradient."""
    tr = Trace()
    x = tr.new("block input", ctx.T * ctx.arch.hidden_size, ctx.resid, input_rg, "T x h", "norms")
    ctx.dense_layer = dense_layer
    if ctx.arch.mlp_kind == "plain":
        plain_block(tr, ctx, x)
    else:
        llama_block(tr, ctx, x)
    return tr
