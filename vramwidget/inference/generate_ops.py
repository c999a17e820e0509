"""``model.generate()`` op by op: every tensor transformers creates, in order, with its size.

:mod:`vramwidget.inference.events` lays one generate() call out as the caching allocator
sees it; this module writes the forward passes and the sampling loop of that call tensor by
tensor, as transformers 5.17 to 5.23 runs them for a Llama-shaped decoder (Llama, Mistral,
Qwen2/2.5/3, Gemma 1/2/3, Phi-3, OLMo...), read from the source and checked against a
``TorchDispatchMode`` trace of real ``generate()`` calls on the CPU
(tests/test_generate_trace.py: every allocation and free of a tiny Llama, Qwen2.5 and Gemma 2
model, byte for byte).  Module by module (``models/llama/modeling_llama.py`` and the modular
files of the other families):

``LlamaModel.forward``
    ``inputs_embeds = embed_tokens(input_ids)`` stays referenced until the forward returns
    (T x h); Gemma scales it into a second tensor (``inputs_embeds * normalizer``).  The mask
    functions (``masking_utils.py``) build nothing for SDPA without padding or a window in
    reach (``_ignore_causal_mask_sdpa``); else a (b, 1, q, kv) bool mask from q x kv
    comparisons, which eager attention turns into an additive mask in the compute dtype.
    The rotary embedding makes fp32 ``freqs`` (b x q x d/2), their ``cat`` (b x q x d), cos
    and sin scaled by ``attention_scaling``, and their 16-bit casts, kept for every layer.
    ``for decoder_layer in self.layers: hidden_states = decoder_layer(hidden_states, ...)``:
    the caller holds each layer's input until the layer returns.
``LlamaRMSNorm``
    ``x.to(float32)``, ``pow(2).mean(-1)`` (T x h x 4 and T x 4), ``x * rsqrt(var + eps)``,
    ``weight * x.to(input_dtype)``; Gemma's: ``_norm(x.float()) * (1.0 + weight.float())``
    then ``type_as(x)``.
``LlamaAttention``
    q, k, v projections; ``apply_rotary_pos_emb``: ``q * cos + rotate_half(q) * sin``
    (``rotate_half`` = ``cat(-x2, x1)``), the same for k, then the projections' outputs go;
    ``DynamicLayer.update`` (``cache_utils.py``): ``torch.cat`` of the cache and the new keys,
    the old keys dropped, then the values (a sliding layer cats both before dropping either);
    the attention core (SDPA: the kernel's output and its fp32 logsumexp; with a mask and
    grouped KV heads ``repeat_kv`` copies keys and values; eager: repeated K/V, q made
    contiguous for the batched matmul, scores, scaled, [soft-capped], masked, an fp32 copy, its
    softmax, the cast back, the output and its transposed copy); ``o_proj``.
``LlamaMLP``
    ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``: gate, act, (gate freed), up, product,
    (act and up freed), down.
``LlamaForCausalLM``
    the final norm; ``lm_head`` on the last position (generate passes ``logits_to_keep=1``):
    b x V; Gemma 2 soft-caps it (divide, tanh, multiply).
``GenerationMixin._sample`` (``generation/utils.py``)
    ``next_token_logits = outputs.logits[:, -1, :].to(copy=True, dtype=torch.float32)``; the
    logits processors (``MinLengthLogitsProcessor`` and ``MinNewTokensLengthLogitsProcessor``
    when ``min_new_tokens`` is set and the model has an EOS token: each ``scores.clone()``,
    an int64 ``arange(V)``, its ``isin`` mask and a ``torch.where`` result); the previous
    step's scores go when the new ones are assigned; ``argmax``; ``input_ids`` and the
    attention mask grow by ``torch.cat``; ``del outputs`` drops the logits.

Where the device matters (``device="cuda"``, the default, or ``"cpu"`` for the trace test):
CUDA's flash attention allocates its output in q's memory layout (so a (b, a, s, d)-major q,
built by ``torch.cat``, makes transformers' ``transpose(1, 2).contiguous()`` copy it), its
memory-efficient kernel takes a boolean mask as an additive one in the compute dtype
(``convert_boolean_attn_mask`` in aten/src/ATen/native/transformers/attention.cpp); the CPU's
flash kernel writes a (b, s, a, d) output.

Every event is ``(kind, key, bytes, label)`` with ``label = (category, name)``; the category
(activations, kv cache, logits, generation) is what the estimate's tree groups the tensors
live at the peak by.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..model.architecture import Architecture
from ..units import DTYPE_BYTES

Event = Tuple[str, Any, float, Any]

ACT, KV, LOGITS, GEN, WORKSPACE = "activations", "kv cache", "logits", "generation", "workspace"


class Stream:
    """Events with keys handed out in order (keys of a decode template are names)."""

    def __init__(self) -> None:
        self.events: List[Event] = []
        self._n = 0
        #: bytes of the cuBLAS workspace the next matmul makes (0: it exists already)
        self.workspace = 0

    def first_matmul(self) -> None:
        """A cuBLAS call: the first one of the process makes the handle's workspace
        (``getCurrentCUDABlasHandle`` -> ``getNewWorkspace``, after the op's output exists)."""
        if self.workspace:
            self.alloc(self.workspace, WORKSPACE, "cuBLAS workspace", key="workspace")
            self.workspace = 0

    def alloc(self, nbytes: float, cat: str, name: str, key: Any = None) -> Optional[Any]:
        if nbytes <= 0:
            return None
        if key is None:
            self._n += 1
            key = self._n
        self.events.append(("alloc", key, int(nbytes), (cat, name)))
        return key

    def free(self, *keys: Optional[Any]) -> None:
        for key in keys:
            if key is not None:
                self.events.append(("free", key, 0, ""))

    def temp(self, nbytes: float, cat: str, name: str) -> None:
        """A tensor made and dropped at once (a kernel's side output)."""
        self.free(self.alloc(nbytes, cat, name))


@dataclass
class Shape:
    """What one forward needs to know: the model's sizes, the batch, the kernels."""

    arch: Architecture
    c: float                  # compute dtype bytes
    b: int
    device: str               # "cuda" or "cpu"
    attn: str                 # "flash", "efficient", "math" or "eager"
    padded: bool              # the attention mask has masked positions (padding)
    #: the masks and the padding rows in even when none is masked: transformers < 5.18, whose
    #: generate() keeps an all-ones attention mask (5.18 drops it: GenerationMixin.generate,
    #: "We can drop the mask altogether if it's all 1s")
    kv_bytes: float           # bytes per cached element
    window: Optional[int]     # sliding window of the sliding layers (None: none)
    op_level: bool            # a Llama-shaped decoder: every op; else the layer's steps as blocks
    #: transformers < 5.19: the rotary embedding's freqs are a batched matmul (``inv_freq_expanded
    #: @ position_ids_expanded``), so the forward's first cuBLAS call; 5.19 made it a product
    rope_matmul: bool = False
    keeps_ones_mask: bool = False
    #: transformers >= 5.23: a single query token with a mask and grouped KV heads is packed
    #: into the KV heads (``pack_gqa`` in integrations/sdpa_attention.py) instead of repeat_kv
    packs_gqa: bool = False
    #: transformers < 4.36 (before ``cache_utils.Cache``): the attention returns
    #: ``past_key_value = (torch.cat([past_key_value[0], key_states], dim=2), ...)`` as a tuple
    #: (models/llama/modeling_llama.py of 4.35.2), the prefill keeps its k and v themselves, and
    #: the previous step's tuple stays referenced by generate() until the forward has returned
    legacy_cache: bool = False
    #: transformers < 4.45: no ``logits_to_keep`` (``num_logits_to_keep`` came in 4.45.0): the head
    #: runs on every position and ``LlamaForCausalLM`` upcasts them, ``logits = logits.float()``
    logits_all_fp32: bool = False
    #: bitsandbytes 4-bit linears: role -> weight elements (dequantized for every matmul of more
    #: than one row), and whether the absmax is double-quantized (dequantized to fp32 first)
    quant: Optional[Dict[str, int]] = None
    double_quant: bool = False

    @property
    def L(self) -> int:
        return self.arch.num_layers


def rms_norm(st: Stream, rows: int, dim: int, c: float, gemma: bool, name: str, cat: str = ACT) -> Any:
    """One RMSNorm of ``rows`` x ``dim`` elements in the compute dtype; returns the output's key."""
    n = rows * dim
    x32 = st.alloc(n * 4, cat, f"{name}: fp32 input")
    p = st.alloc(n * 4, cat, f"{name}: pow(2)")
    var = st.alloc(rows * 4, cat, f"{name}: variance")
    st.free(p)
    ve = st.alloc(rows * 4, cat, f"{name}: variance + eps")
    if gemma:
        st.free(var)
    r = st.alloc(rows * 4, cat, f"{name}: rsqrt")
    st.free(ve)
    y32 = st.alloc(n * 4, cat, f"{name}: normalised (fp32)")
    st.free(r, x32)
    if gemma:
        w32 = st.alloc(dim * 4, cat, f"{name}: weight.float()")
        w1 = st.alloc(dim * 4, cat, f"{name}: 1 + weight")
        st.free(w32)
        y2 = st.alloc(n * 4, cat, f"{name}: x (1 + w) (fp32)")
        st.free(w1, y32)
        out = st.alloc(n * c, cat, f"{name} output")
        st.free(y2)
        return out
    cast = st.alloc(n * c, cat, f"{name}: cast back")
    out = st.alloc(n * c, cat, f"{name} output")
    st.free(cast, y32, var)
    return out


def proj(st: Stream, sh: Shape, out_bytes: float, name: str, role: str, rows: int) -> Any:
    """One linear's output; a bitsandbytes 4-bit linear with more than one row first
    dequantizes its weight (``bnb.matmul_4bit`` -> ``MatMul4Bit``: ``dequantize_4bit`` makes the
    fp32 absmax of a double-quantized weight, then the 16-bit weight, which
    ``F.linear`` reads and drops; one row takes ``gemv_4bit`` instead)."""
    n = (sh.quant or {}).get(role)
    if not n or rows <= 1:
        out = st.alloc(out_bytes, ACT, name)
        st.first_matmul()
        return out
    absmax = st.alloc(n / 64 * 4, ACT, f"{name}: absmax dequantized (fp32)") if sh.double_quant else None
    w = st.alloc(n * sh.c, ACT, f"{name}: 4-bit weight dequantized")
    st.free(absmax)
    out = st.alloc(out_bytes, ACT, name)
    st.first_matmul()
    st.free(w)
    return out


def rope(st: Stream, n_heads_elems: int, c: float, name: str) -> Any:
    """``q * cos + rotate_half(q) * sin`` on ``n_heads_elems`` elements; returns the result."""
    m1 = st.alloc(n_heads_elems * c, ACT, f"{name} x cos")
    neg = st.alloc(n_heads_elems * c / 2, ACT, f"rotate_half({name}): -x2")
    cat = st.alloc(n_heads_elems * c, ACT, f"rotate_half({name})")
    st.free(neg)
    m2 = st.alloc(n_heads_elems * c, ACT, f"rotate_half({name}) x sin")
    st.free(cat)
    out = st.alloc(n_heads_elems * c, ACT, f"{name} after RoPE")
    st.free(m1, m2)
    return out


# ----------------------------------------------------------------------------------
# Masks and the rotary embedding (once per forward)
# ----------------------------------------------------------------------------------

def mask_needed(sh: Shape, q: int, kv_len: int, sliding: bool) -> bool:
    """Whether transformers materialises a mask for one layer kind: eager always; SDPA when
    the batch is padded or a sliding window is in reach (``_ignore_causal_mask_sdpa`` lets
    SDPA's ``is_causal`` or no mask stand in otherwise: q == 1 or q == kv, no padding, and
    kv < the window)."""
    if sh.attn == "eager":
        return True
    if sh.padded:
        return True
    return bool(sliding and sh.window and kv_len >= sh.window)


def build_mask(st: Stream, sh: Shape, q: int, kv_len: int, sliding: bool) -> Optional[Any]:
    """``create_causal_mask`` / ``create_sliding_window_causal_mask`` (masking_utils.py): the
    (q, kv) comparisons of the causal (and window) rules, the padding rows and-ed in (b, q, kv
    bool), and for eager attention the additive mask (``torch.where``, b x q x kv in the
    compute dtype).  Returns the mask the layers read."""
    b, QK = sh.b, q * kv_len
    if sliding:
        sub = st.alloc(q * 8, ACT, "mask: q index - window")
        gt = st.alloc(QK, ACT, "mask: window rule (q x kv bool)")
        st.free(sub)
        m1 = st.alloc(QK, ACT, "mask: and")
        st.free(gt)
        le = st.alloc(QK, ACT, "mask: causal rule (q x kv bool)")
        m = st.alloc(QK, ACT, "mask: and")
        st.free(le, m1)
        if sh.padded or sh.keeps_ones_mask:
            m2 = st.alloc(QK, ACT, "mask: and")
            st.free(m)
            m = m2
    elif sh.padded or sh.keeps_ones_mask:
        le = st.alloc(QK, ACT, "mask: causal rule (q x kv bool)")
        m = st.alloc(QK, ACT, "mask: and")
        st.free(le)
    else:
        m = st.alloc(QK, ACT, "mask: causal rule (q x kv bool)")
    if sh.padded or sh.keeps_ones_mask:
        idx = st.alloc(b * kv_len, ACT, "mask: padding rows (b x kv bool)")
        full = st.alloc(b * QK, ACT, "attention mask (b x q x kv bool)")
        st.free(idx, m)
        m = full
    if sh.attn != "eager":
        return m
    add = st.alloc(b * QK * sh.c, ACT, "attention mask (additive, b x q x kv)")
    st.free(m)
    return add


def rotary_tables(st: Stream, sh: Shape, q: int, rope_dim: int) -> Tuple[Any, Any]:
    """``LlamaRotaryEmbedding.forward``: fp32 freqs (b x q x d/2), emb = cat(freqs, freqs),
    cos and sin (x attention_scaling), cast to the compute dtype; returns (cos, sin)."""
    n = sh.b * q * rope_dim
    freqs = st.alloc(n * 2, ACT, "RoPE freqs (fp32)")
    if sh.rope_matmul:
        st.first_matmul()
    emb = st.alloc(n * 4, ACT, "RoPE cat(freqs, freqs) (fp32)")
    c0 = st.alloc(n * 4, ACT, "RoPE cos (fp32)")
    cos32 = st.alloc(n * 4, ACT, "RoPE cos x scaling (fp32)")
    st.free(c0)
    s0 = st.alloc(n * 4, ACT, "RoPE sin (fp32)")
    sin32 = st.alloc(n * 4, ACT, "RoPE sin x scaling (fp32)")
    st.free(s0)
    cos = st.alloc(n * sh.c, ACT, "RoPE cos")
    sin = st.alloc(n * sh.c, ACT, "RoPE sin")
    st.free(freqs, emb, cos32, sin32)
    return cos, sin


# ----------------------------------------------------------------------------------
# One decoder layer
# ----------------------------------------------------------------------------------

@dataclass
class LayerIO:
    """What a layer reads beyond its input: the cache keys and the forward's shared tensors."""

    q: int                       # new tokens per sequence
    S: int                       # tokens cached before this forward
    kind: Optional[bool]         # None: no KV cache (a hybrid's other layer); False full; True sliding
    decode: bool
    layer: int
    mask: Optional[Any] = None   # the mask this layer reads (a key), or None


def cache_tokens(sh: Shape, io: LayerIO) -> int:
    """Tokens of the keys ``DynamicLayer.update`` returns (and stores) for this forward: S + q;
    a sliding layer's ``torch.cat`` takes the last W - 1 cached tokens (``min(S, W - 1)``)."""
    if io.kind and sh.window and io.S:
        return min(io.S, sh.window - 1) + io.q
    return io.S + io.q


def cache_update(st: Stream, sh: Shape, io: LayerIO, k_new: Any, v_new: Any, elems: Tuple[int, int]) -> int:
    """``DynamicLayer.update`` / ``DynamicSlidingWindowLayer.update``: the cat results take
    the keys ("k", layer) and ("v", layer) (in a decode template, ("k", layer, "new")); the
    projections' outputs go when the attention reads the cache's tensors instead."""
    tokens = cache_tokens(sh, io)
    b, L = sh.b, io.layer
    new = (lambda x: (x, L, "new")) if io.decode else (lambda x: (x, L))
    kb, vb = (b * tokens * e * sh.kv_bytes for e in elems)
    if sh.legacy_cache:
        if not io.decode:
            # the prefill's (key_states, value_states) are the cache: k after RoPE, v's projection
            st.events.append(("rename", k_new, 0, ("k", L)))
            st.events.append(("rename", v_new, 0, ("v", L)))
            return tokens
        # the old tuple is freed once generate() has the new one (legacy_free_old)
        st.alloc(kb, KV, "keys (torch.cat, legacy tuple)", key=new("k"))
        st.alloc(vb, KV, "values (torch.cat, legacy tuple)", key=new("v"))
        st.free(k_new, v_new)
        return tokens
    if io.kind:                  # sliding: both cats, then both old tensors go
        st.alloc(kb, KV, "keys (torch.cat)", key=new("k"))
        st.alloc(vb, KV, "values (torch.cat)", key=new("v"))
        if io.decode:
            st.free(("k", L), ("v", L))
    else:
        st.alloc(kb, KV, "keys (torch.cat)", key=new("k"))
        if io.decode:
            st.free(("k", L))
        st.alloc(vb, KV, "values (torch.cat)", key=new("v"))
        if io.decode:
            st.free(("v", L))
    st.free(k_new, v_new)
    return tokens


def attention_core(st: Stream, sh: Shape, io: LayerIO, q_key: Any, tokens: int, d: int, dv: int,
                   q_heads_major: bool, softcap: bool) -> Tuple[Any, Optional[Any]]:
    """The attention kernel over ``tokens`` keys; returns (the o_proj input, the attention
    probabilities eager attention returns: the decoder layer keeps them in ``_`` until it
    returns).  Frees its own temporaries; q stays with the caller."""
    a, kvh, b, c, q = sh.arch.num_heads, sh.arch.num_kv_heads, sh.b, sh.c, io.q
    T = b * q
    n_rep = a // max(kvh, 1)
    out_bytes = T * a * dv * c
    if sh.attn == "eager":
        reps = []
        if n_rep > 1:
            reps = [st.alloc(b * a * tokens * d * c, ACT, "keys repeated to every head (repeat_kv)"),
                    st.alloc(b * a * tokens * dv * c, ACT, "values repeated to every head (repeat_kv)")]
        scores_n = b * a * q * tokens
        # matmul(q, k^T): q is (b, q, a, d)-major after RoPE; bmm needs it (b*a, q, d)-contiguous
        qc = st.alloc(T * a * d * c, ACT, "q made contiguous for the matmul") if q > 1 else None
        s0 = st.alloc(scores_n * c, ACT, "attention scores")
        st.free(qc)
        s1 = st.alloc(scores_n * c, ACT, "attention scores x scaling")
        st.free(s0)
        if softcap:
            for name in ("scores / softcap", "tanh(scores / softcap)", "soft-capped scores"):
                nxt = st.alloc(scores_n * c, ACT, name)
                st.free(s1)
                s1 = nxt
        sm = st.alloc(scores_n * c, ACT, "attention scores + mask")
        st.free(s1)
        s32 = st.alloc(scores_n * 4, ACT, "attention scores as fp32 (softmax input)")
        p32 = st.alloc(scores_n * 4, ACT, "softmax (fp32)")
        st.free(s32)
        p = st.alloc(scores_n * c, ACT, "attention probabilities")
        st.free(p32, sm)
        o = st.alloc(out_bytes, ACT, "attention output")
        if q == 1:                   # (b, a, 1, d) transposed is contiguous: no copy
            st.free(*reps)
            return o, p
        ot = st.alloc(out_bytes, ACT, "attention output (transposed copy)")
        st.free(o, *reps)
        return ot, p
    reps = []
    masked = io.mask is not None
    if masked and n_rep > 1 and not (sh.packs_gqa and q == 1):   # use_gqa_in_sdpa: a mask rules out enable_gqa
        reps = [st.alloc(b * a * tokens * d * c, ACT, "keys repeated to every head (repeat_kv)"),
                st.alloc(b * a * tokens * dv * c, ACT, "values repeated to every head (repeat_kv)")]
    add = None
    if masked:
        # scaled_dot_product_attention takes a boolean mask as an additive one in q's dtype
        # before it picks a kernel (convert_boolean_attn_mask, aten/src/ATen/native/transformers/
        # attention.cpp)
        add = st.alloc(b * q * tokens * c, ACT, "SDPA: bool mask as an additive mask")
    o = st.alloc(out_bytes, ACT, "attention output")
    if sh.attn == "math":
        st.temp(b * a * q * tokens * 4, ACT, "attention scores (math SDPA, fp32)")
    elif sh.attn == "flash" or sh.device == "cpu":
        # flash attention always writes its softmax's logsumexp (b x a x q fp32); the
        # memory-efficient kernel only when an input needs a gradient
        # (_efficient_attention_forward: compute_logsumexp), never under no_grad
        st.temp(b * a * q * 4, ACT, "attention logsumexp (fp32)")
    st.free(add, *reps)
    if sh.device == "cuda" and sh.attn == "flash" and q_heads_major and q > 1:
        ot = st.alloc(out_bytes, ACT, "attention output (transposed copy)")
        st.free(o)
        return ot, None
    return o, None


def attention(st: Stream, sh: Shape, io: LayerIO, cos_sin: Any, fam: Any) -> Tuple[Any, Optional[Any]]:
    """q, k, v, [q/k norm], RoPE, the cache update, the core and o_proj (on the normed input
    the caller holds); returns (o_proj's output, what the layer keeps until it returns)."""
    arch, c, b = sh.arch, sh.c, sh.b
    a, kvh, d = arch.num_heads, arch.num_kv_heads, arch.head_dim
    T = b * io.q
    if fused_qkv(arch):
        # Phi-3: q, k and v are views of one qkv_proj output, which the value view keeps
        # until the cache has copied it
        vp = proj(st, sh, T * (a + 2 * kvh) * d * c, "qkv projection", "attn_qkv", T)
        qp = kp = None
    else:
        qp = proj(st, sh, T * a * d * c, "q projection", "attn_q", T)
        kp = proj(st, sh, T * kvh * d * c, "k projection", "attn_k", T)
        vp = proj(st, sh, T * kvh * d * c, "v projection", "attn_v", T)
    kind = fam.qk_norm_of(arch.config) if hasattr(fam, "qk_norm_of") else None
    if kind:
        for nm, heads in (("q", a), ("k", kvh)):
            rows, dim = (T * heads, d) if kind == "head" else (T, heads * d)
            out = rms_norm(st, rows, dim, c, fam.gemma_norm, f"{nm}_norm")
            if nm == "q":
                st.free(qp)
                qp = out
            else:
                st.free(kp)
                kp = out
    if cos_sin is not None:
        qr = rope(st, T * a * d, c, "q")
        kr = rope(st, T * kvh * d, c, "k")
        st.free(qp, kp)
    else:
        qr, kr = qp, kp
    tokens = cache_update(st, sh, io, kr, vp, (kvh * d, kvh * d)) if io.kind is not None else io.S + io.q
    core, keep = attention_core(st, sh, io, qr, tokens, d, d, getattr(fam, "q_heads_major", False),
                                bool(arch.attn_logit_softcapping))
    o = proj(st, sh, T * arch.hidden_size * c, "o_proj output", "attn_o", T)
    st.free(core, qr)
    return o, keep


def fused_qkv(arch: Architecture) -> bool:
    return any(t.role == "attn_qkv" for t in arch.tensors)


def gated_mlp(st: Stream, sh: Shape, T: int, i: int, fused: bool) -> Any:
    """``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` (Phi-3: one gate_up_proj, chunked)."""
    c = sh.c
    if fused:
        gu = proj(st, sh, T * 2 * i * c, "gate_up projection", "mlp_gate_up", T)
        act = st.alloc(T * i * c, ACT, "act(gate)")
        prod = st.alloc(T * i * c, ACT, "act(gate) x up")
        st.free(act, gu)
    else:
        g = proj(st, sh, T * i * c, "gate projection", "mlp_gate", T)
        act = st.alloc(T * i * c, ACT, "act(gate)")
        st.free(g)
        up = proj(st, sh, T * i * c, "up projection", "mlp_up", T)
        prod = st.alloc(T * i * c, ACT, "act(gate) x up")
        st.free(act, up)
    down = proj(st, sh, T * sh.arch.hidden_size * c, "down projection", "mlp_down", T)
    st.free(prod)
    return down


def decoder_layer(st: Stream, sh: Shape, io: LayerIO, x: Any, cos_sin: Any, fam: Any) -> Any:
    """One ``LlamaDecoderLayer`` (with Gemma 2's sandwich norms where the family has them);
    ``x`` is the input the caller keeps; returns the layer's output."""
    arch, c = sh.arch, sh.c
    T, h = sh.b * io.q, arch.hidden_size
    gemma = fam.gemma_norm
    n1 = rms_norm(st, T, h, c, gemma, "input_layernorm") if fam.pre_norms else None
    o, keep = attention(st, sh, io, cos_sin, fam)
    st.free(n1)
    if fam.out_norms:
        on = rms_norm(st, T, h, c, gemma, "post_attention_layernorm")
        st.free(o)
        o = on
    x1 = st.alloc(T * h * c, ACT, "residual after attention")
    st.free(o)
    n2 = None
    if fam.pre_norms:
        n2 = rms_norm(st, T, h, c, gemma, "pre_feedforward_layernorm" if fam.out_norms else "post_attention_layernorm")
    i = arch.intermediate_size
    if arch.is_moe:
        i = int(arch.config.get("intermediate_size") or i)
    m = gated_mlp(st, sh, T, i, fam.fused_gate_up)
    st.free(n2)
    if fam.out_norms:
        mn = rms_norm(st, T, h, c, gemma, "post_feedforward_layernorm")
        st.free(m)
        m = mn
    x2 = st.alloc(T * h * c, ACT, "layer output")
    st.free(m, x1, keep)
    return x2


def op_level(arch: Architecture) -> bool:
    """Whether the family's forward is written op by op here: a Llama-shaped decoder (RMSNorm,
    q/k/v/o attention with RoPE, a gated MLP) without MLA, experts or recurrent layers; other
    families are laid out by their layer's steps (``inference.layer_steps``)."""
    from ..model.families.llama import Llama

    fam = arch.family
    return (isinstance(fam, Llama) and fam.norm_kind == "rms" and fam.mlp_kind == "gated" and not arch.mla
            and not arch.is_moe and arch.kv_cache_layers is None and not arch.state_elems_per_seq
            and fam.rotary)


# ----------------------------------------------------------------------------------
# The model's forward and the sampling loop
# ----------------------------------------------------------------------------------

def layer_kinds(arch: Architecture, sliding_layers: int, n_kv: int) -> List[Optional[bool]]:
    """Per layer: None (no KV cache: a hybrid's conv / linear-attention layer), False (full
    attention) or True (sliding window); the cached layers spread evenly over the stack (the
    config's ``layer_types`` where it lists them)."""
    L = arch.num_layers
    types = arch.config.get("layer_types") if isinstance(arch.config, dict) else None
    if (isinstance(types, list) and len(types) == L and n_kv == L
            and sum(t == "sliding_attention" for t in types) == sliding_layers):
        return [t == "sliding_attention" for t in types]
    out: List[Optional[bool]] = []
    i = 0
    for layer in range(L):
        if (layer * n_kv) // L == ((layer + 1) * n_kv) // L and n_kv < L:
            out.append(None)
            continue
        out.append((i * sliding_layers) // max(n_kv, 1) != ((i + 1) * sliding_layers) // max(n_kv, 1))
        i += 1
    return out


def model_forward(st: Stream, sh: Shape, q: int, S: int, kinds: Sequence[Optional[bool]], decode: bool,
                  layer_fn: Any = None) -> Any:
    """``LlamaModel.forward`` for b x q new tokens against S cached ones (see the module
    docstring); returns the final norm's output.  ``layer_fn(st, io, x, cos_sin)`` replaces
    the op-level decoder layer (families laid out by steps)."""
    arch, c, b = sh.arch, sh.c, sh.b
    fam = arch.family
    T, h = b * q, arch.hidden_size
    emb = st.alloc(T * h * c, ACT, "embedding output (inputs_embeds)")
    if getattr(fam, "gemma_norm", False):
        # Gemma's scaled embedding: embed_tokens(x) * sqrt(h) (the unscaled output dropped)
        scaled = st.alloc(T * h * c, ACT, "embedding x sqrt(h) (inputs_embeds)")
        st.free(emb)
        emb = scaled
    masks: Dict[bool, Any] = {}
    for sliding in (False, True):
        if sliding not in kinds:
            continue
        kv_len = cache_tokens(sh, LayerIO(q, S, sliding, decode, -1))
        if mask_needed(sh, q, kv_len, sliding):
            masks[sliding] = build_mask(st, sh, q, kv_len, sliding)
    tables: List[Any] = []
    if fam.rotary:
        rope_dim = arch.mla["qk_rope_head_dim"] if arch.mla else arch.head_dim
        tables.append(rotary_tables(st, sh, q, rope_dim))
        if arch.config.get("rope_local_base_freq"):        # Gemma 3: a second table for local layers
            tables.append(rotary_tables(st, sh, q, rope_dim))
    x = emb
    for layer, kind in enumerate(kinds):
        io = LayerIO(q, S, kind, decode, layer, masks.get(bool(kind)) if kind is not None else None)
        cos_sin = tables[-1 if (kind and len(tables) > 1) else 0] if tables else None
        if layer_fn is not None:
            out = layer_fn(st, io, x, cos_sin)
        else:
            out = decoder_layer(st, sh, io, x, cos_sin, fam)
        if x != emb:
            st.free(x)
        x = out
    normed = rms_norm(st, T, h, c, getattr(fam, "gemma_final_norm", False), "final norm")
    st.free(x, *masks.values(), emb)
    for cos, sin in tables:
        st.free(cos, sin)
    return normed


@dataclass(frozen=True)
class Sampling:
    """What ``_sample`` runs beside the model: the logits processors that are on, and the
    integer state that grows each step."""

    processors: int = 0       # MinLength + MinNewTokensLength (min_new_tokens with an EOS token): 2
    final_softcap: bool = False
    #: how ``_sample`` takes the next-token logits: "to_copy" (``.to(copy=True, dtype=float32)``,
    #: 4.46+ as 5.x), "clone_float" (``.clone().float()``, 4.45.0), "clone" (of the fp32 logits,
    #: 4.42-4.44), "view" (``outputs.logits[:, -1, :]``, through 4.41)
    next_logits: str = "to_copy"


def head(st: Stream, sh: Shape, normed: Any, sampling: Sampling, positions: int = 1, q: int = 1) -> Any:
    """``lm_head`` on the last position (b x V; generate's ``logits_to_keep=1``) and Gemma 2's
    final soft-capping; the model output goes when the forward returns.  Returns the logits."""
    V = sh.arch.vocab_size
    if sh.logits_all_fp32:
        positions = q
    n = sh.b * positions * V * sh.c
    logits = st.alloc(n, LOGITS, "logits (last position)" if positions == 1 else "logits (every position)")
    if sampling.final_softcap:
        for name in ("logits / softcap", "tanh(logits / softcap)", "logits (soft-capped)"):
            nxt = st.alloc(n, LOGITS, name)
            st.free(logits)
            logits = nxt
    if sh.logits_all_fp32:
        up = st.alloc(sh.b * positions * V * 4, LOGITS, "logits.float() (every position, in the model)")
        st.free(logits)
        logits = up
    st.free(normed)       # the model's output goes when the CausalLM forward returns
    return logits


def sample(st: Stream, sh: Shape, logits: Any, S: int, sampling: Sampling, first: bool) -> None:
    """One step of ``_sample`` after the forward, for a cache that now holds S tokens: the
    attention mask grows (``_update_model_kwargs_for_generation``), the fp32 copy of the
    logits, the processors, the previous step's scores go, ``input_ids`` grows by ``cat``,
    ``del outputs``.  Keys that live into the next step: "mask", "ids", "nl" (the fp32
    copy), "ns" (the processed scores; "nl" itself without processors); a decode template
    names the new ones "<key>.new"."""
    b, V = sh.b, sh.arch.vocab_size
    new = (lambda k: k) if first else (lambda k: k + ".new")
    if sh.padded or sh.keeps_ones_mask:
        # transformers >= 5.18 drops an all-ones attention mask before the loop: nothing grows
        st.alloc(b * (S + 1) * 8, GEN, "attention mask (torch.cat)", key=new("mask"))
        if not first:
            st.free("mask")
    if sampling.next_logits == "view":
        nl = st.alloc(0, LOGITS, "next-token logits (a view)", key=new("nl"))
    elif sampling.next_logits == "clone_float":
        cl = st.alloc(b * V * sh.c, LOGITS, "next-token logits .clone()")
        nl = st.alloc(b * V * 4, LOGITS, "next-token logits .float()", key=new("nl"))
        st.free(cl)
    else:
        nl = st.alloc(b * V * 4, LOGITS, "next-token logits (fp32 copy)", key=new("nl"))
    if not first and sampling.processors and nl is not None:
        st.free("nl")
    scores = nl
    for i in range(sampling.processors):
        # MinLengthLogitsProcessor builds its EOS mask before the clone, MinNewTokens after it
        if i == 0:
            ar = st.alloc(V * 8, GEN, "logits processor: arange(V) (int64)")
            eos = st.alloc(V, GEN, "logits processor: isin(arange, eos)")
            cl = st.alloc(b * V * 4, LOGITS, "logits processor: scores.clone()")
        else:
            cl = st.alloc(b * V * 4, LOGITS, "logits processor: scores.clone()")
            ar = st.alloc(V * 8, GEN, "logits processor: arange(V) (int64)")
            eos = st.alloc(V, GEN, "logits processor: isin(arange, eos)")
        last = i == sampling.processors - 1
        out = st.alloc(b * V * 4, LOGITS, "logits processor: torch.where(eos, -inf, scores)",
                       key=new("ns") if last else None)
        st.free(cl, ar, eos)
        if scores != nl:
            st.free(scores)
        scores = out
    if not first and (sampling.processors or nl is not None):
        st.free("ns" if sampling.processors else "nl")
    st.alloc(b * (S + 1) * 8, GEN, "input_ids (torch.cat)", key=new("ids"))
    if not first:
        st.free("ids")
    if sampling.next_logits == "view":
        # no ``del outputs`` then: the outputs (and the view into their logits) stay until the
        # next forward has returned
        st.events.append(("rename", logits, 0, new("lprev")))
    elif logits is not None:
        st.free(logits)


def prologue(st: Stream, b: int, p: int) -> None:
    """What generate() makes before the prefill (b x p int64 each): the attention mask from
    ``pad_token_id`` (``_prepare_attention_mask_for_generation``: ones, ``ne``, products), the
    position ids (``cumsum - 1``, ``masked_fill``), the prompt's clone for the forward ("clone")."""
    n = b * p
    ones = st.alloc(n * 8, GEN, "attention mask: ones")
    ne = st.alloc(n, GEN, "attention mask: ids != pad")
    lg = st.alloc(n * 8, GEN, "attention mask: .long()")
    st.free(ne)
    m1 = st.alloc(n * 8, GEN, "attention mask: product")
    m2 = st.alloc(n * 8, GEN, "attention mask: product")
    st.alloc(n * 8, GEN, "attention mask", key="mask0")
    st.free(m1, m2, ones, lg)
    cs = st.alloc(n * 8, GEN, "position ids: cumsum")
    sub = st.alloc(n * 8, GEN, "position ids: cumsum - 1")
    st.free(cs)
    eq = st.alloc(n, GEN, "position ids: mask == 0")
    st.alloc(n * 8, GEN, "position ids", key="pos0")
    st.free(eq, sub)
    st.alloc(n * 8, GEN, "input_ids clone (prepare_inputs_for_generation)", key="clone0")
