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
from typing import Any, Dict, List, Optional, Tuple

from ..training import TrainingSetup
from ..units import DTYPE_BYTES

F32 = "float32"
#: module group of the tensors peft's LoRA layers save (fp32 input copies, lora_A outputs)
LORA_GROUP = "LoRA inputs (peft casts to fp32)"


@dataclass
class ForwardTensor:
    """A tensor of the forward pass: storage name, elements, dtype, needs-grad flag."""

    name: str
    numel: float
    dtype: str
    rg: bool
    formula: str
    group: str
    #: for a transient: how many tensors created after it it outlives (1: freed once the next
    #: tensor exists; a Python variable reassigned by ``x = f(g(x))`` outlives all of f and g)
    outlives: int = 1


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
        #: every forward tensor created, for the step time (timing.py): one kernel each,
        #: and the bytes each writes (what bandwidth-bound kernels move)
        self.created_ops = 0
        self.created_bytes = 0.0
        #: every tensor the forward creates and every parameter it uses, in order (the
        #: allocation events of the caching-allocator replay, ``events.py``)
        self.ops: List[Tuple[str, Any]] = []
        #: saved-tensor pack events (``torch.autograd.graph.saved_tensors_hooks`` calls): one
        #: per autograd node that keeps a tensor, so a tensor kept by two ops counts twice
        #: (activation offloading's forward stash counts these, estimate._offload)
        self.packs = 0
        #: saved tensors that the node which *made* them keeps (softmax, exp, tanh save their
        #: output): autograd releases them after that node's backward, one op later than a
        #: tensor kept by its consumer (the replay's order, ``events.py``)
        self.saved_by_producer: set = set()
        #: the residual stream, by tensor name, for the allocator replay (``events.py``):
        #: "resid" for a tensor the block holds until the next one (a residual sum, or a
        #: post-LN block's normalised sum), "out" for the block's output (``trace_block``)
        self.stream: Dict[str, str] = {}
        #: pack calls per saved tensor (by name): the autograd nodes that keep it
        self.pack_counts: Dict[str, int] = {}

    def new(self, name: str, numel: float, dtype: str, rg: bool, formula: str, group: str) -> ForwardTensor:
        """Record a new forward tensor (not yet saved)."""
        self.created_ops += 1
        self.created_bytes += numel * DTYPE_BYTES[dtype]
        t = ForwardTensor(name, numel, dtype, rg, formula, group)
        self.ops.append(("new", t))
        return t

    def temp(self, name: str, numel: float, dtype: str, rg: bool, formula: str, group: str,
             outlives: int = 1) -> ForwardTensor:
        """A short-lived tensor that only the allocator replay needs to see (not saved and not
        counted in ``created_ops``/``created_bytes``, which the step-time model reads);
        ``outlives``: how many tensors created after it exist before it is freed."""
        t = ForwardTensor(name, numel, dtype, rg, formula, group, outlives)
        self.ops.append(("new", t))
        return t

    def residual_stream(self, t: ForwardTensor) -> ForwardTensor:
        """Mark ``t`` as the residual stream: it lives until the next stream tensor exists."""
        self.stream.setdefault(t.name, "resid")
        return t

    def together(self, *tensors: "ForwardTensor") -> None:
        """The node that consumed ``tensors`` makes all their gradients in one backward call
        (a product's two factors: ``MulBackward0``; SDPA's q, k and v: one backward kernel),
        so they exist at once beside its incoming gradient (the allocator replay, ``plan/blocks.py``)."""
        names = tuple(t.name for t in tensors if t.rg)
        if len(names) > 1:
            self.ops.append(("together", names))

    def param(self, module: str) -> None:
        """Record that the op just traced used ``module``'s parameters (their gradients are
        made when backward reaches it)."""
        self.ops.append(("param", module))

    def save(self, t: ForwardTensor, by_producer: bool = False, packs: int = 1) -> None:
        """Mark ``t`` as kept for backward (its bytes once per storage); ``by_producer``: the
        node that made ``t`` keeps it (a softmax's output), not only the node that consumes
        it; ``packs``: how many autograd nodes keep it (each one is a pack call of the
        saved-tensor hooks)."""
        self.packs += packs
        self.pack_counts[t.name] = self.pack_counts.get(t.name, 0) + packs
        if by_producer:
            self.saved_by_producer.add(t.name)
        if t.name not in self.saved:
            self.saved[t.name] = SavedTensor(t.name, t.group, t.numel * DTYPE_BYTES[t.dtype], t.dtype, t.numel,
                                             t.formula)

    def cast(self, t: ForwardTensor, dtype: str, name: str) -> ForwardTensor:
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

    arch: Any
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
    fused_qkv_lora: bool = False  # q, k and v adapters share one input (LitGPT's fused qkv)
    cpu: bool = False           # CPU kernels (for checking against torch without a GPU)
    kind: str = ""              # the block's kind in a mixed stack (Architecture.layer_kinds)
    #: an encoder-decoder's encoder tokens per sample: the keys and values of a decoder block's
    #: cross-attention, and the encoder side of the head (0: ``s``; a decoder block's own ``s``
    #: is the target length, TrainingSetup.target_len)
    enc_s: int = 0

    @property
    def src_s(self) -> int:
        """The encoder's tokens per sample (``enc_s``, else this block's own ``s``)."""
        return self.enc_s or self.s


def runs_eager(arch: Any, setup: TrainingSetup) -> bool:
    """Whether transformers runs its eager attention (explicit scores and softmax): asked for,
    or because SDPA cannot express the model's attention (Gemma 2's soft-capping, BLOOM's
    ALiBi: transformers falls back to eager unless flash_attention_2 is asked for).  A
    selective checkpoint recomputes this same kernel."""
    impl = setup.attn_implementation
    if impl == "eager":
        return True
    return bool(arch.attn_logit_softcapping or not arch.family.sdpa_supported) and impl != "flash_attention_2"


def attention_backend(arch: Any, setup: TrainingSetup, compute_dtype: str) -> str:
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
    if runs_eager(arch, setup):
        # asked for, or SDPA cannot soft-cap (Gemma 2) or add ALiBi (BLOOM)
        return "eager"
    if impl == "flash_attention_2":
        return "flash"
    sixteen = compute_dtype in ("bfloat16", "float16")
    d = arch.head_dim
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

def linear(tr: Trace, ctx: BlockContext, x: ForwardTensor, module: str, out_features: float, name: str, group: str,
           *, trains: Optional[bool] = None, tokens: Optional[float] = None, in_features: Optional[float] = None
           ) -> ForwardTensor:
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
    elif ctx.quant_base and x.rg and ctx.setup.quantization in ("nf4", "fp4") \
            and ctx.setup.before("bitsandbytes", "0.43.2"):
        # bitsandbytes < 0.43.2: MatMul4Bit kept its input on ctx whenever it needed a gradient
        # (ctx.tensors = (A, B)); "fix QLoRA mem bug" (bitsandbytes PR #1270, 0.43.2) keeps B only
        tr.save(xin)
    out_dtype = ctx.c if (ctx.setup.autocast or ctx.quant_base) else (xin.dtype if not ctx.quant_base else ctx.c)
    if ctx.quant_base and x.dtype == F32:
        out_dtype = F32  # bnb Linear4bit returns the input's dtype
    rg = trains or x.rg
    if ctx.quant_base:
        # bitsandbytes' MatMul4Bit dequantizes the weight for each matmul (a transient; not saved)
        tr.temp(f"{module} dequantized weight", out_features * in_f, ctx.c, False,
               f"{_dim(out_features)} x {_dim(in_f)} (transient)", group)
    if module in ctx.lora_modules:
        rg = True
        r = ctx.setup.lora_r
        tag = f"{module} ({name})"   # GPT-2 has two modules named c_proj
        if module in ("q_proj", "k_proj", "v_proj") and ctx.fused_qkv_lora:
            # LitGPT's LoRAQKVLinear: one dropout and one lora_A input for the fused qkv
            tag = "qkv (fused LoRA)"
        # peft's Linear.forward: result = base_layer(x) first, the adapter's path after it
        tr.temp(f"{tag} base layer output", n_tok * out_features, out_dtype, rg, "T x out (transient)", group)
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
        if tag == "qkv (fused LoRA)" and not {"q_proj", "k_proj", "v_proj"} <= set(ctx.lora_modules):
            # LitGPT LoRAQKVLinear.zero_pad (litgpt/lora.py; lit_gpt/lora.py in 2023) scatters
            # the adapted slices into the full qkv width with index_copy(_), whose backward
            # formula (derivatives.yaml: grad.index_select(dim, index).expand_as(source))
            # keeps its source: this module's slice of the conv1d (lora_B) output.  With all
            # of q, k, v adapted zero_pad returns its input and nothing is kept.
            tr.save(tr.new(f"{tag} {module} lora_B output (kept by zero_pad's index_copy)", n_tok * out_features,
                           a_dtype, True, f"T x {_dim(out_features)}", LORA_GROUP))
        else:
            tr.temp(f"{tag} lora_B output", n_tok * out_features, a_dtype, True, "T x out (transient)",
                    LORA_GROUP)
        tr.temp(f"{tag} lora_B output x scaling", n_tok * out_features, a_dtype, True, "T x out (transient)",
               LORA_GROUP)
        if promote_dtype(a_dtype, out_dtype) != out_dtype:
            tr.temp(f"{tag} base + LoRA", n_tok * out_features, promote_dtype(a_dtype, out_dtype), True,
                   "T x out (transient)", LORA_GROUP)
        if ctx.setup.lora_variant == "dora":
            # peft DoraLinearLayer.forward: (mag_norm_scale - 1) * base_result keeps the base
            # layer's output, mag_norm_scale * lora_result keeps lora_B's output (the magnitude
            # trains); with dropout, base_result is recomputed from a fp32 weight copy, which
            # estimate.activations_at adds per layer (it does not scale with tokens)
            base_dt = out_dtype if ctx.setup.lora_dropout == 0 else ctx.adapter_dtype
            tr.save(tr.new(f"{tag} DoRA base output", n_tok * out_features, base_dt, True,
                           f"T x {_dim(out_features)}", LORA_GROUP))
            tr.save(tr.new(f"{tag} DoRA lora_B output", n_tok * out_features, a_dtype, True,
                           f"T x {_dim(out_features)}", LORA_GROUP))
    out = tr.new(name, n_tok * out_features, out_dtype, rg, f"T x {_dim(out_features)}", group)
    tr.param(module)
    return out


def rms_norm(tr: Trace, ctx: BlockContext, x: ForwardTensor, name: str, dim: float, group: str = "norms",
             gemma: bool = False, trains: Optional[bool] = None) -> ForwardTensor:
    """Llama RMSNorm as transformers writes it (fp32 math, weight applied after casting
    back).  ``gemma=True``: the weight multiplies the fp32 normalised tensor and the result
    is cast back (Gemma's ``* (1 + w)``, OLMo 2's ``(w * x).to(dtype)``)."""
    trains = ctx.norms_train if trains is None else trains
    x32 = tr.cast(x, F32, f"{name} input as fp32")
    if x32 is not x:
        x32.formula, x32.group = f"T x {_dim(dim)} fp32 upcast", group
    rows = x.numel / dim
    if x.rg:
        # x32.pow(2) and x32 * rsqrt(...) each keep x32; rsqrt keeps its output for its own
        # backward and the product keeps it again: two packs each
        tr.save(x32, packs=2)
        tr.save(tr.new(f"{name} rsqrt", rows, F32, True, "T x 1 fp32", group), packs=2)
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
    out_dtype = promote_dtype(ctx.norm_w_dtype, x.dtype)
    out = tr.new(f"{name} output", x.numel, out_dtype, x.rg or trains, f"T x {_dim(dim)}", group)
    tr.param(name)
    return out


def layer_norm(tr: Trace, ctx: BlockContext, x: ForwardTensor, name: str, dim: float, group: str = "norms") -> ForwardTensor:
    """nn.LayerNorm: saves its input and fp32 mean and rstd (autocast runs it in fp32)."""
    xin = tr.cast(x, F32, f"{name} input as fp32") if ctx.setup.autocast else x
    if x.rg or ctx.norms_train:
        tr.save(xin)
        tr.save(tr.new(f"{name} mean and rstd", 2 * x.numel / dim, F32, True, "2 x T fp32", group), packs=2)
    out = tr.new(f"{name} output", x.numel, xin.dtype, x.rg or ctx.norms_train, f"T x {_dim(dim)}", group)
    tr.param(name)
    return out


def dropout(tr: Trace, x: ForwardTensor, p: float, name: str, cpu: bool = False) -> ForwardTensor:
    """nn.Dropout in training mode: keeps a 1-byte mask on CUDA (the CPU kernel keeps a
    mask in the input's dtype); p == 0 is the identity."""
    if p <= 0:
        return x
    if x.rg:
        tr.save(tr.new(f"{name} dropout mask", x.numel, x.dtype if cpu else "uint8", True,
                       f"{x.formula} bool mask", x.group))
    return tr.new(f"{name} after dropout", x.numel, x.dtype, x.rg, x.formula, x.group)


def sdpa_core(tr: Trace, ctx: BlockContext, q: ForwardTensor, k: ForwardTensor, v: ForwardTensor, v_head_dim: int, group: str = "attention",
              softcap: bool = False, dropout_p: float = 0.0, softmax_fp32: bool = True,
              q_heads_major: bool = False, kv_len: Optional[int] = None) -> ForwardTensor:
    """The attention core for the chosen backend; returns the (b, s, a*d) output.
    ``kv_len``: keys per sequence when they are not the queries' own (an encoder-decoder's
    cross-attention: ``s`` target queries over ``kv_len`` encoder keys, b x a x s x kv_len scores)."""
    a, kv = ctx.arch.num_heads, ctx.arch.num_kv_heads
    b, s, T = ctx.b, ctx.s, ctx.T
    kl = kv_len if kv_len is not None else s
    Tk = b * kl            # key/value tokens (T for self-attention)
    backend = ctx.attn_backend
    rg = q.rg or k.rg or v.rg
    if ctx.setup.autocast and backend != "eager":
        q, k, v = (tr.cast(t, ctx.c, f"{t.name} cast to {ctx.c}") for t in (q, k, v))
    out_numel = T * a * v_head_dim
    scores = b * a * s * kl
    if backend == "recompute":
        # the checkpointed core keeps its inputs; v is kept as its own (contiguous) tensor,
        # not as a view that would hold a fused QKV output alive.  The recomputed core is the
        # chosen kernel: eager reads q, k and v in the compute dtype (the casts the eager
        # branch below saves: fp32 outputs of 4-bit layers beside prepare_kbit's fp32 norms
        # are cast), the others read them as they are (in one dtype: SDPA refuses mixed ones)
        core = ctx.c if runs_eager(ctx.arch, ctx.setup) else q.dtype
        if rg:
            for t, n, label in ((q, T * a * ctx.arch.head_dim, "q"), (k, Tk * kv * ctx.arch.head_dim, "k"),
                                (v, Tk * kv * v_head_dim, "v")):
                if t.dtype != core:
                    t = tr.new(f"{label} cast", n, core, True, f"T x heads*d as {core}", group)
                tr.save(t if t.numel == n else tr.new(f"{label} (kept for the recomputed core)", n, core, True,
                                                      "T x heads*d", group))
        # the recomputed kernel's output, in the dtype it computes in (eager: the compute
        # dtype, as the eager branch below returns; the rest: q's)
        return tr.new("attention output", out_numel, core, rg, "T x a*d", group)
    if backend in ("flash", "efficient"):
        if rg:
            for t in (q, k, v):
                tr.save(t)
            tr.together(q, k, v)   # one backward kernel writes dq, dk and dv
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
        # the math kernel computes in fp32 from 16-bit q, k, v ("Keep query, key, value in high
        # precision for accuracy": _scaled_dot_product_attention_math in
        # aten/src/ATen/native/transformers/attention.cpp, unless allowFP16BF16ReductionMathSDP)
        # and casts its output back
        c = F32 if q.dtype in ("bfloat16", "float16") else q.dtype
        if rg:
            tr.save(tr.new("q scaled (math SDPA)", q.numel, c, True, "T x a*d", group))
            tr.save(tr.new("k repeated and scaled (math SDPA)", Tk * a * ctx.arch.head_dim, c, True, "T x a*d", group))
            # q @ k^T, masked in place; the softmax keeps only its output
            tr.temp("attention scores (math SDPA)", scores, c, True, "b x a x s x s (transient)", group)
            # _safe_softmax keeps its result for backward (derivatives.yaml), as the matmul does
            tr.save(tr.new("attention probabilities (math SDPA)", scores, c, True, "b x a x s x s", group),
                    by_producer=True)
            if kv != a:
                tr.save(tr.new("v repeated (math SDPA)", Tk * a * v_head_dim, c, True, "T x a*d", group))
            else:
                tr.save(tr.cast(v, c, "v as fp32 (math SDPA)"))
        # the math kernel's output is (b, a, s, d)-contiguous: transformers copies it before o_proj
        return tr.new("attention output", out_numel, q.dtype, rg, "T x a*d (transposed copy)", group)
    # eager: explicit scores and softmax
    c = ctx.c
    n_rep = a // kv if kv else 1
    if rg:
        tr.save(tr.cast(q, c, "q cast"))
        # repeat_kv copies k and v to every head; the matmuls (under autocast: their 16-bit casts) keep them
        ke = tr.cast(k, c, "k cast") if n_rep == 1 else tr.new("k repeated to all heads", Tk * a * ctx.arch.head_dim,
                                                                c, True, "T x a*d (repeat_kv copy)", group)
        ve = tr.cast(v, c, "v cast") if n_rep == 1 else tr.new("v repeated to all heads", Tk * a * v_head_dim, c,
                                                                True, "T x a*d (repeat_kv copy)", group)
        tr.save(ke)
        tr.save(ve)
        # matmul(q, k^T) * scaling + causal mask: three b x a x s x s transients before the softmax
        # (the mask's add passes its gradient through in backward: no gradient tensor of its own).
        # transformers' eager_attention_forward (models/llama/modeling_llama.py) writes
        # ``attn_weights = softmax(attn_weights, dtype=float32).to(query.dtype)``: the masked
        # scores stay referenced until that line has made the fp32 copy, the softmax output and
        # its 16-bit cast
        sm_dtype = F32 if softmax_fp32 else c
        in_statement = 1 + (sm_dtype != c) + (sm_dtype != c)
        for label, makes_grad in (("attention scores", True), ("attention scores scaled", True),
                                  ("attention scores masked", False)):
            tr.temp(label, scores, c, makes_grad, "b x a x s x s (transient)", group,
                    outlives=in_statement if label.endswith("masked") and not softcap else 1)
        if softcap:
            tr.save(tr.new("soft-capped scores tanh", scores, c, True, "b x a x s x s", group))
        if sm_dtype != c:
            # softmax(x, dtype=float32) converts its input first (at::softmax: input.toType(dtype))
            tr.temp("attention scores as fp32 (softmax input)", scores, F32, True, "b x a x s x s fp32 (transient)",
                   group)
        p32 = tr.new("softmax output" + (" fp32" if softmax_fp32 else ""), scores, sm_dtype, True,
                     "b x a x s x s" + (" fp32" if softmax_fp32 else ""), group)
        # SoftmaxBackward0 keeps its result (tools/autograd/derivatives.yaml: _softmax: result)
        tr.save(p32, by_producer=True)
        p = tr.cast(p32, c, "attention probabilities")
        p.formula = "b x a x s x s"
        if dropout_p > 0:
            tr.save(tr.new("attention dropout mask", scores, c if ctx.cpu else "uint8", True, "b x a x s x s bool",
                       group))
            p = tr.new("attention probabilities after dropout", scores, c, True, "b x a x s x s", group)
        tr.save(p)
    return tr.new("attention output", out_numel, c, rg, "T x a*d (transposed copy)", group)


def promote_dtype(a: str, b: str) -> str:
    """The dtype of an op on ``a`` and ``b``: fp32 when either is, else ``b``."""
    if F32 in (a, b):
        return F32
    return b


def _dim(x: float) -> str:
    x = float(x)
    return str(int(x)) if x == int(x) else f"{x:g}"


# ---------------------------------------------------------------------------------
# Shared blocks (the families in vramwidget/model/families compose these)
# ---------------------------------------------------------------------------------

def gated_mlp(tr: Trace, ctx: BlockContext, x: ForwardTensor, i: int, *, fused: bool = False, prefix: str = "",
              group: str = "mlp", trains: Optional[bool] = None, tokens: Optional[float] = None,
              names: Tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> ForwardTensor:
    """``down(act(gate(x)) * up(x))``: gate, up, act(gate) and the product are kept.
    ``names``: the three modules' names (what LoRA targets match)."""
    T = tokens if tokens is not None else ctx.T
    if fused:
        gu = linear(tr, ctx, x, "gate_up_proj", 2 * i, prefix + "gate_up_proj output", group, trains=trains)
        g = gu
        u = gu
    else:
        g = linear(tr, ctx, x, names[0], i, prefix + "gate_proj output", group, trains=trains, tokens=T)
        u = linear(tr, ctx, x, names[1], i, prefix + "up_proj output", group, trains=trains, tokens=T)
    rg = g.rg or u.rg
    if rg:
        tr.save(g)
        tr.save(u)
    act = tr.new(prefix + "activation output", T * i, g.dtype, rg, "T x i", group)
    if rg:
        tr.save(act)
    p = tr.new(prefix + "act(gate) * up", T * i, g.dtype, rg, "T x i", group)
    if not fused:
        tr.together(act, u)     # MulBackward0 returns both factors' gradients
    return linear(tr, ctx, p, names[2], ctx.arch.hidden_size, prefix + "down_proj output", group, trains=trains,
                  tokens=T, in_features=i)


@dataclass(frozen=True)
class Router:
    """What one family's softmax top-k router does differently (transformers 5.23's
    ``*TopKRouter.forward``: ``F.linear``, ``softmax(logits, dtype=float32)``, ``topk``, then):

    ``normalises``: ``router_top_value /= router_top_value.sum(dim=-1, keepdim=True)``
    (Mixtral always, Qwen2/3-MoE, Qwen3-Next and OLMoE when ``norm_topk_prob``);
    ``weights_fp32``: the top-k weights stay fp32 (Mixtral has no ``.to(router_logits.dtype)``;
    DeepSeek-V2's logits are fp32); ``fp32_linear``: ``F.linear(x.float(), W.float())``
    (``DeepseekV2TopkRouter``)."""

    normalises: bool = False
    weights_fp32: bool = False
    fp32_linear: bool = False


def moe(tr: Trace, ctx: BlockContext, x: ForwardTensor, *, shared_gate: bool = False) -> ForwardTensor:
    """Router + routed experts (+ shared experts); experts see T x k token copies.
    ``shared_gate``: a sigmoid gate (1 output) scales the shared expert (Qwen2-MoE).

    The router is the family's :class:`Router` (``Family.router``); the experts are
    transformers' default ``grouped_mm`` implementation (``integrations/moe.py``,
    ``grouped_mm_experts_forward``), whose bookkeeping autograd keeps: the token index
    ``perm // k`` (``hidden_states[perm // num_top_k]``), the sort permutation
    (``sample_weights[perm]``) and the inverse one (``weighted_out[inv_perm]``), int64, T*k
    each.  Its int32 ``offsets`` (E x 4 B per layer, kept by ``grouped_mm``) do not grow with
    the tokens and are left out of the per-token profile."""
    arch, T = ctx.arch, ctx.T
    E, k, ie, h = arch.num_experts, arch.experts_per_token, arch.expert_intermediate_size, arch.hidden_size
    spec = arch.family.router(arch.config)
    trains = ctx.linear_trains
    if spec.fp32_linear:
        # F.linear(x.float(), W.float()) keeps the fp32 copy of x when the weight trains (the
        # fp32 copy of W it keeps, E x h x 4 B per layer, does not grow with the tokens)
        if trains:
            tr.save(tr.cast(x, F32, "router input as fp32"))
        logits = tr.new("router logits (fp32)", T * E, F32, x.rg or trains, "T x E fp32", "router")
    else:
        logits = linear(tr, ctx, x, "gate", E, "router logits", "router")
    if logits.rg:
        # SoftmaxBackward0 keeps its fp32 result; TopkBackward0 its int64 indices
        # (tools/autograd/derivatives.yaml: _softmax: result; topk: indices)
        tr.save(tr.new("router softmax fp32", T * E, F32, True, "T x E fp32", "router"))
        tr.save(tr.new("top-k indices (int64)", T * k, "int64", True, "T x k x 8 B", "router"))
        if spec.normalises:
            # the in-place division keeps the top-k values and their sum (DivBackward0: self, other)
            tr.save(tr.new("top-k weights and their sum (fp32)", T * (k + 1), F32, True, "T x (k+1) fp32",
                           "router"))
    Tk = T * k
    rg = x.rg or trains
    if x.rg:
        tr.save(tr.new("token index perm // k (int64)", Tk, "int64", True, "T*k x 8 B", "router"))
    if logits.rg:
        tr.save(tr.new("expert sort permutation (int64)", Tk, "int64", True, "T*k x 8 B", "router"))
    if rg or logits.rg:
        tr.save(tr.new("inverse permutation (int64)", Tk, "int64", True, "T*k x 8 B", "router"))
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
        w_dtype = F32 if spec.weights_fp32 else logits.dtype
        tr.save(tr.new("routing weights (sorted)", Tk, w_dtype, True, "T*k", "router"))
    out = tr.new("experts output", T * h, ctx.c, rg, "T x h", "experts")
    if arch.shared_expert_intermediate_size:
        sh = gated_mlp(tr, ctx, x, arch.shared_expert_intermediate_size, prefix="shared expert ", group="experts")
        if shared_gate:
            gate = linear(tr, ctx, x, "shared_expert_gate", 1, "shared expert gate", "router")
            if gate.rg:
                tr.save(tr.new("shared expert gate sigmoid", T, ctx.c, True, "T x 1", "router"))
                tr.save(sh)
        out = tr.new("moe output", T * h, ctx.c, True, "T x h", "experts")
    return out


def trace_block(ctx: BlockContext, *, input_rg: bool = True, dense_layer: bool = False) -> Trace:
    """The tensors one block saves for backward, given whether its input needs a gradient."""
    tr = Trace()
    x = tr.new("block input", ctx.T * ctx.arch.hidden_size, ctx.resid, input_rg, "T x h", "norms")
    ctx.dense_layer = dense_layer
    out = ctx.arch.family.block(tr, ctx, x)
    if out is not None:
        tr.stream[out.name] = "out"
    return tr
