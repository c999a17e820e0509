"""The block traces behind the step plan, as polynomials in the batch and sequence.

One transformer block (each kind of a mixed stack, the first trained one, a leading dense
one) and the output head are traced op by op (``model/activations.py``) at a few small sizes;
every tensor's bytes are then exact polynomials in b and s (and an encoder-decoder's target
length t), so one trace serves every size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..model.activations import LORA_GROUP, BlockContext, SavedTensor, Trace, attention_backend, runs_eager, trace_block
from ..model.architecture import HEAD_TARGETS, Architecture
from ..stacks import behaviour
from ..training import TrainingSetup
from ..units import DTYPE_BYTES
from .params import ParamStorage

@dataclass
class Activations:
    per_layer: List[SavedTensor]          # saved by one (steady) block
    per_layer_bytes: float
    first_layer_bytes: float              # the first trained block (its input may need no grad)
    n_saving_layers: int                  # blocks that save anything
    checkpoint_bytes_per_layer: float     # gradient checkpointing: each block's input
    head: List[Tuple[str, float, str]]    # final norm and output-head saves
    transient_layer_bytes: float          # backward working buffers of one layer
    backend: str
    layers_bytes: float = 0.0             # every saving block together (no checkpointing)
    # side towers (a VLM's vision encoder): saved tensors, not scaled by the text tokens
    tower: List[Tuple[str, float, str]] = field(default_factory=list)
    # forward work of one block, for the step time (timing.py): tensors created (one
    # kernel each) and the bytes they write; the same for the head
    fwd_ops_per_layer: float = 0.0
    fwd_written_bytes_per_layer: float = 0.0
    head_fwd_ops: float = 0.0
    head_fwd_written_bytes: float = 0.0
    #: saved-tensor packs of the final norm, the newest ones at the end of the forward (_offload)
    head_packs: int = 0
    #: checkpointing: the largest block a backward rebuilds (the trained kinds' largest)
    recompute_layer_bytes: float = 0.0


@dataclass
class Profile:
    """A block trace as a function of batch b, sequence s and (an encoder-decoder's) target
    length t: every saved tensor's bytes are a sum of coefficients times the size terms of
    :func:`size_terms`: ``alpha * b * s + beta * b * s**2`` for one sequence (T-linear tensors,
    and the b x a x s x s scores); for an encoder-decoder given a ``target_len``, five terms
    b s, b s^2 (the encoder), b t, b t^2 (the decoder's own tokens and self-attention scores)
    and b s t (its cross-attention scores over the encoder's keys)."""

    arch: Architecture
    per_layer: List[Tuple[str, str, str, str, Tuple[float, ...], Tuple[float, ...]]]  # name, group, dtype, formula, bytes, numel coefficients
    per: Tuple[float, ...]
    first: Tuple[float, ...]
    dense: Tuple[float, ...]
    head: List[Tuple[str, str, Tuple[float, ...]]]    # name, formula, bytes coefficients (one sequence: per token)
    backend: str
    written: Tuple[float, ...] = (0.0, 0.0)       # bytes the block's forward writes (a T + b T s)
    ops: float = 0.0                                # kernels of one block's forward
    head_written: Tuple[float, ...] = (0.0, 0.0)
    head_ops: float = 0.0
    head_packs: int = 0
    #: the blocks a checkpointed backward may rebuild, one (a, b) each: every kind among the
    #: trained layers after the first (the first alone when it is the only one trained)
    recompute: List[Tuple[float, float]] = field(default_factory=list)
    #: the block's forward in order, for the allocator replay: ("new", name, dtype, rg, saved,
    #: numel coefficients, outlives, by_producer, constant numel) per created tensor, ("param",
    #: module) per parameter use; steady and first block
    alloc_ops: Tuple[List[Tuple[Any, ...]], List[Tuple[Any, ...]]] = ([], [])
    #: the same per layer key (kind, leading dense) of a stack whose blocks differ (a mixed
    #: stack's kinds, DeepSeek-style dense layers): the replay runs each layer's own block
    #: (:func:`layer_key`); empty where every block is ``alloc_ops[0]``
    kind_alloc_ops: Dict[Tuple[str, bool], List[Tuple[Any, ...]]] = field(default_factory=dict)
    #: an encoder-decoder's five size terms (b s, b s^2, b t, b t^2, b s t); else (b s, b s^2)
    target: bool = False
    #: the final norm and the output head's input, op by op (as ``alloc_ops``; the first op is
    #: the last block's output)
    head_alloc_ops: List[Tuple[Any, ...]] = field(default_factory=list)
    #: what the forward keeps from the token embedding (the first op is the embedding output)
    embed_alloc_ops: List[Tuple[Any, ...]] = field(default_factory=list)


#: an encoder-decoder's profile is traced at these (seq_len, target_len) sizes, batch 1, and
#: solved exactly for the coefficients of b s, b s^2, b t, b t^2 and b s t
_TARGET_PROBES = ((1, 1), (2, 1), (3, 1), (1, 2), (2, 2))


def _target_inverse() -> List[List[Any]]:
    """The inverse of the five size terms at :data:`_TARGET_PROBES` (exact rationals)."""
    from fractions import Fraction

    rows = [[Fraction(x) for x in (sq, sq * sq, tq, tq * tq, sq * tq)] for sq, tq in _TARGET_PROBES]
    n = len(rows)
    A = [r + [Fraction(int(i == j)) for j in range(n)] for i, r in enumerate(rows)]
    for col in range(n):
        piv = next(i for i in range(col, n) if A[i][col] != 0)
        A[col], A[piv] = A[piv], A[col]
        A[col] = [x / A[col][col] for x in A[col]]
        for i in range(n):
            if i != col and A[i][col] != 0:
                f = A[i][col]
                A[i] = [x - f * y for x, y in zip(A[i], A[col])]
    return [r[n:] for r in A]


_TARGET_INV = _target_inverse()


def has_target(arch: Architecture) -> bool:
    """Whether the model has a decoder stack of its own that reads the target tokens
    (``target_len``): the family says (``Family.has_target``)."""
    return arch.family.has_target(arch)


def size_terms(prof: "Profile", b: Any, sq: Any, tq: Any = None) -> Tuple[Any, ...]:
    """The size terms a profile's coefficients multiply: (T, T2) = (b s, b s^2) for one
    sequence; an encoder-decoder's (b s, b s^2, b t, b t^2, b s t), t = ``tq`` (None: s)."""
    if not prof.target:
        return (b * sq, b * sq * sq)
    tq = sq if tq is None else tq
    return (b * sq, b * sq * sq, b * tq, b * tq * tq, b * sq * tq)


def dot_terms(coef: Tuple[float, ...], terms: Tuple[Any, ...]) -> Any:
    """``coef[0] * terms[0] + coef[1] * terms[1] + ...``, left to right (a T + b T2 for one
    sequence: the very operations the two-term profile always did)."""
    v = coef[0] * terms[0]
    for c, m in zip(coef[1:], terms[1:]):
        v = v + c * m
    return v


def poly(const: float, coef: Tuple[float, ...], terms: Tuple[Any, ...]) -> Any:
    """``const + coef . terms``, left to right (c + a T + b T2 for one sequence)."""
    v = const
    for c, m in zip(coef, terms):
        v = v + c * m
    return v


_BLOCK_PROFILES: Dict[Tuple[Any, ...], Profile] = {}


#: the setup fields a block trace depends on (not the sizes, the optimizer or LoRA's alpha)
TRACE_FIELDS = ("method", "precision", "quantization", "prepare_kbit", "gradient_checkpointing",
                 "attn_implementation", "lora_r", "lora_dropout", "lora_targets", "stack", "versions", "lora_variant",
                 "modules_to_save", "compile")


def activations_at(arch: Architecture, s: TrainingSetup, P: ParamStorage, cpu: bool = False,
                 sizes: Optional[Tuple[Any, Any]] = None, mx: Callable[..., Any] = max) -> Activations:
    """Saved activations per block and around the head, for this batch and sequence.

    The block is traced op by op (model/activations.py) at two small sizes and the result scaled:
    saved bytes are linear in tokens except the attention scores (b x a x s^2), so two
    traces give both coefficients exactly.  Profiles are cached per architecture and
    size-free setup.  ``cpu=True`` picks the kernels PyTorch uses on a CPU (SDPA keeps q,
    k, v, output and logsumexp whatever the dtype), for checking against torch without a
    GPU (tools/saved_tensors.py).

    ``sizes = (b, sq)`` replaces the setup's batch and sequence, e.g. with numpy arrays
    (``mx = _elementwise_max``): every size-dependent figure is then an array of the same
    floating-point operations (:func:`vramwidget.fit.fitmap.fit_map`).
    """
    prof = block_profile(arch, s, P, cpu)
    b, sq = sizes if sizes is not None else (s.batch_size, s.seq_len)
    # an encoder-decoder's target length: the setup's, else as long as the input (a grid of
    # sizes varies seq_len; a given target_len stays fixed there)
    tq = s.target_len if s.target_len is not None else sq
    M = size_terms(prof, b, sq, tq)
    T = b * sq
    # DoRA with dropout recomputes the base output from a fp32 copy of each adapted weight,
    # which F.linear keeps (a per-layer constant, not traced: it does not scale with tokens)
    dora_w = dora_weight_copies_per_layer(arch, s, P)
    per = dot_terms(prof.per, M) + dora_w
    first = dot_terms(prof.first, M) + dora_w
    dense = dot_terms(prof.dense, M) + dora_w
    first_train, n_layers = trained_range(arch, s)
    # DeepSeek-style leading dense layers among the trained ones (freeze trains the last layers)
    n_dense = max(0, min(arch.dense_layers, arch.num_layers) - first_train) if arch.is_moe else 0
    recompute = None
    for coef in prof.recompute:
        x = dot_terms(coef, M) + dora_w
        recompute = x if recompute is None else mx(recompute, x)
    # the first block (dense in DeepSeek-style MoE) + the other dense blocks + the MoE blocks
    layers = first + max(n_dense - 1, 0) * dense + (n_layers - max(n_dense, 1)) * per
    c = s.compute_dtype
    ckpt = T * arch.hidden_size * DTYPE_BYTES[residual_dtype(s)]
    Tw, sw = T, sq     # the tokens and sequence of the widest block
    if prof.target:
        # checkpointing keeps each block's input: b x s x h per encoder layer, b x t x h per
        # decoder layer (the per-layer figure is their average over the trained layers)
        trained = trained_layers(arch, s)
        n_dec = sum(1 for k, _ in trained if k in arch.family.target_kinds)
        ckpt = (T * (len(trained) - n_dec) + b * tq * n_dec) / len(trained) * arch.hidden_size \
            * DTYPE_BYTES[residual_dtype(s)]
        sw = mx(sq, tq)
        Tw = b * sw
    # backward working buffers of one block: gradients of the widest intermediate tensors
    i_width = max(arch.intermediate_size, arch.expert_intermediate_size * max(arch.experts_per_token, 1))
    gw = DTYPE_BYTES[c] if not s.autocast else 4
    transient = 2 * Tw * i_width * DTYPE_BYTES[c] + Tw * arch.hidden_size * gw
    if prof.backend in ("eager", "math") or (prof.backend == "recompute" and runs_eager(arch, s)):
        transient = mx(transient, 2 * b * arch.num_heads * sw * sw * 4)
    per_layer = [SavedTensor(name, group, dot_terms(cb, M), dtype, dot_terms(cn, M), formula)
                 for name, group, dtype, formula, cb, cn in prof.per_layer]
    if dora_w:
        per_layer.append(SavedTensor("DoRA norm vectors" + (" and weight copies (dropout > 0)" if s.lora_dropout else ""),
                                     LORA_GROUP, dora_w, P.adapter_dtype, dora_w / DTYPE_BYTES[P.adapter_dtype],
                                     "3 x out" + (" + out x in" if s.lora_dropout else "") + " per adapted module"))
    head = [(name, dot_terms(coef, M), formula) for name, formula, coef in prof.head]
    tower = tower_activations(arch, s, P, cpu) if arch.towers else []
    return Activations(per_layer, per, first, n_layers, ckpt, head, transient, prof.backend, layers, tower=tower,
                 head_packs=prof.head_packs, recompute_layer_bytes=per if recompute is None else recompute,
                 **_timing_fields(prof, M))


def _timing_fields(prof: "Profile", M: Tuple[Any, ...]) -> Dict[str, float]:
    return dict(
fwd_ops_per_layer=prof.ops, fwd_written_bytes_per_layer=dot_terms(prof.written, M),
                head_fwd_ops=prof.head_ops, head_fwd_written_bytes=dot_terms(prof.head_written, M))


def tower_activations(arch: Architecture, s: TrainingSetup, P: ParamStorage, cpu: bool
                       ) -> List[Tuple[str, float, str]]:
    """A side tower's saved tensors (a VLM's vision encoder over ``images_per_sample`` images
    of each sample): its blocks traced at its own token count (patches per image), each
    image attending within itself, in the sequences the tower family lays them out in
    (``tower_attention_layout``), plus what the tower saves once (``tower_saved_once``).
    Under checkpointing each tower layer keeps its input."""
    out: List[Tuple[str, float, str]] = []
    for name, tarch in arch.towers.items():
        per_sample = arch.family.tower_tokens(arch, name, s)
        if not per_sample or not s.images_per_sample:
            continue
        patches = per_sample // s.images_per_sample
        n_img = s.batch_size * s.images_per_sample
        T = n_img * patches
        c = s.compute_dtype
        backend = attention_backend(tarch, s, c)
        if cpu and backend in ("math", "efficient"):
            backend = "flash"
        full = s.method == "full"
        tfam = tarch.family
        seqs, seq_len = tfam.tower_attention_layout(n_img, patches, s)
        once = tfam.tower_saved_once(tarch, n_img, patches, s, backend, residual_dtype(s))
        out.extend(once)
        ctx = BlockContext(arch=tarch, setup=s, T=T, b=seqs, s=seq_len, c=c, resid=residual_dtype(s),
                           norm_w_dtype="float32" if (s.autocast or s.precision == "fp32") else s.weights_dtype,
                           linear_trains=full, norms_train=full, lora_modules=P.lora_modules,
                           adapter_dtype=P.adapter_dtype, attn_backend=backend, quant_base=s.quantized, cpu=cpu)
        L = tarch.num_layers
        if full_checkpointing(s):
            nbytes = L * T * tarch.hidden_size * DTYPE_BYTES[residual_dtype(s)]
            out.append((f"{name} tower layer inputs kept by checkpointing ({L} layers)", nbytes,
                        f"{L} x images x patches x h_{name} ({n_img} x {patches} x {tarch.hidden_size})"))
            continue
        # layers whose attention sees other sequences (windows) are traced at their own layout
        # (T is the same; the scores of eager attention differ)
        total = 0.0
        for j, ((sq_n, sq_len), count) in enumerate(tfam.tower_layer_layouts(tarch, n_img, patches, s)):
            lctx = replace(ctx, b=sq_n, s=sq_len)
            steady = trace_block(lctx, input_rg=True).total_bytes
            if j == 0:
                lctx = replace(ctx, b=sq_n, s=sq_len)
                total += trace_block(lctx, input_rg=full).total_bytes + (count - 1) * steady
            else:
                total += count * steady
        out.append((f"{name} tower saved tensors ({L} layers)", total,
                    f"{L} blocks over images x patches ({n_img} x {patches})"))
    return out


def block_profile(arch: Architecture, s: TrainingSetup, P: ParamStorage, cpu: bool = False) -> Profile:
    """The block trace of this architecture and size-free setup (cached)."""
    key = (id(arch), cpu) + tuple(getattr(s, f) for f in TRACE_FIELDS) + (arch.family.trace_key(arch, s),
                                                                             trained_layout(arch, s),
                                                                             s.target_len is not None)
    prof = _BLOCK_PROFILES.get(key)
    if prof is None or prof.arch is not arch:
        prof = _build_profile(arch, s, P, cpu)
        if len(_BLOCK_PROFILES) > 8192:
            _BLOCK_PROFILES.clear()
        _BLOCK_PROFILES[key] = prof
    return prof


def _build_profile(arch: Architecture, s: TrainingSetup, P: ParamStorage, cpu: bool) -> Profile:
    """Trace one block (steady, first, dense) and the head at (b, s) = (1, 1) and (1, 2); an
    encoder-decoder's with a ``target_len`` at the five (s, t) of :data:`_TARGET_PROBES` (see
    :class:`Profile`; without one its decoder reads s tokens: the two traces, as before)."""
    target = has_target(arch) and s.target_len is not None
    if target:
        probes = [trace_all(arch, s, P, cpu, 1, sq, tq) for sq, tq in _TARGET_PROBES]

        def coeffs(*ys: float) -> Tuple[float, ...]:
            from fractions import Fraction

            fy = [Fraction(y) for y in ys]
            return tuple(float(sum(w * y for w, y in zip(row, fy))) for row in _TARGET_INV)
    else:
        probes = [trace_all(arch, s, P, cpu, 1, 1), trace_all(arch, s, P, cpu, 1, 2)]

        def coeffs(*ys: float) -> Tuple[float, ...]:
            x1, x2 = ys
            beta = (x2 - 2 * x1) / 2     # x(1,1) = a + b, x(1,2) = 2a + 4b
            return x1 - beta, beta
    one = probes[0]

    def field(key: str) -> Tuple[float, ...]:
        return coeffs(*(p[key] for p in probes))

    per_layer = []
    for ts in zip(*(p["per_layer"] for p in probes)):
        t1 = ts[0]
        assert all(t.name == t1.name for t in ts), "every probe traces the same tensors"
        per_layer.append((t1.name, t1.group, t1.dtype, t1.formula, coeffs(*(t.nbytes for t in ts)),
                          coeffs(*(t.numel for t in ts))))

    def alloc_ops(key: Any, src: str = "") -> List[Tuple[Any, ...]]:
        os_ = [p[src][key] if src else p[key] for p in probes]
        o1 = os_[0]
        out: List[Tuple[Any, ...]] = []
        for ops in zip(*(o[0] for o in os_)):
            kind, t1 = ops[0]
            if kind in ("param", "together"):
                out.append((kind, t1))
            else:
                # a tensor the same size at every probe does not scale with the tokens: a weight's
                # transient (bitsandbytes' dequantized weight), a constant, not a*T + b*T2
                sizes = [t.numel for _, t in ops]
                const = all(n == sizes[0] for n in sizes)
                cn = t1.numel if const else 0.0
                coef = tuple(0.0 for _ in sizes) if const else coeffs(*sizes)
                saved = o1[1]
                out.append(("new", t1.name, t1.dtype, t1.rg, t1.name in saved, coef, t1.outlives,
                            t1.name in saved and t1.name in o1[2], cn, o1[3].get(t1.name, ""), t1.group,
                            t1.formula, o1[4].get(t1.name, 0)))
        return out

    if target:
        heads = [{name: nbytes for name, nbytes, _ in p["head"]} for p in probes]
        head = [(name, formula, coeffs(*(h[name] for h in heads))) for name, _, formula in one["head"]]
    else:
        # one sequence: every head tensor is linear in the tokens (bytes per token at b s = 1)
        head = [(name, formula, (nbytes,)) for name, nbytes, formula in one["head"]]
    return Profile(arch=arch, per_layer=per_layer, per=field("per"), first=field("first"), dense=field("dense"),
                    recompute=[coeffs(*xs) for xs in zip(*(p["recompute"] for p in probes))],
                    head=head, backend=one["backend"], written=field("written"), ops=one["ops"],
                    head_written=field("head_written"), head_ops=one["head_ops"], head_packs=one["head_packs"],
                    alloc_ops=(alloc_ops("alloc_ops"), alloc_ops("alloc_ops_first")),
                    kind_alloc_ops={k: alloc_ops(k, "kind_alloc_ops") for k in one["kind_alloc_ops"]}, target=target,
                    head_alloc_ops=alloc_ops("head_alloc"), embed_alloc_ops=alloc_ops("embed_alloc"))


def trace_all(arch: Architecture, s: TrainingSetup, P: ParamStorage, cpu: bool, b: int, sq: int,
               tq: Optional[int] = None) -> Dict[str, Any]:
    """Every block trace and the head's at batch ``b``, sequence ``sq`` and (an
    encoder-decoder's) target length ``tq``: its decoder blocks, output head and loss read
    b x tq tokens, its cross-attention b x tq x sq scores."""
    T = b * sq
    # the output head's tokens: the decoder's of an encoder-decoder
    Th = b * tq if tq is not None else T
    c = s.compute_dtype
    resid = residual_dtype(s)
    norm_w = "float32" if (s.autocast or s.precision == "fp32" or (s.quantized and s.prepare_kbit)) else (
        s.weights_dtype if not s.quantized else c)
    # after prepare_model_for_kbit_training the residual stream is fp32, 4-bit linears return
    # their input's dtype and RoPE's cos/sin follow the hidden states: attention sees fp32
    backend = attention_backend(arch, s, "float32" if (s.quantized and s.prepare_kbit) else c)
    if cpu and backend in ("math", "efficient"):  # CPU SDPA: one flash-style kernel
        backend = "flash"
    full = s.method == "full"
    ctx = BlockContext(arch=arch, setup=s, T=T, b=b, s=sq, c=c, resid=resid, norm_w_dtype=norm_w,
                       linear_trains=full, norms_train=full or s.method == "norms", lora_modules=P.lora_modules,
                       adapter_dtype=P.adapter_dtype, attn_backend=backend, quant_base=s.quantized, cpu=cpu,
                       fused_qkv_lora=bool(behaviour(s.stack).get("fused_qkv_lora")),
                       enc_s=sq if tq is not None else 0)
    if s.method == "freeze":
        ctx.linear_trains = True
        ctx.norms_train = True
    # Does the first trained block's input need a gradient?  Full fine-tuning: the
    # embedding trains.  PEFT: only with checkpointing (enable_input_require_grads).
    # A trained embedding (modules_to_save, or LoRA on embed_tokens) makes it need one too.
    head_targets = lora_head_targets(s)
    embed_trains = "embed_tokens" in head_targets or "embed_tokens" in s.modules_to_save
    first_rg = full or (s.trains_adapters and s.gradient_checkpointing == "full") or embed_trains
    dense = bool(arch.dense_layers and arch.is_moe)
    layers = trained_layers(arch, s)
    (first_kind, first_dense), others = layers[0], layers[1:]
    order = arch.family.layer_order(arch)
    kinds: Dict[Tuple[str, bool], Trace] = {}     # each kind's steady block, for the replay
    if order:
        tr, by_kind = mixed_stack(ctx, order, [kind for kind, _ in others or layers], tq)
        kinds = {(kind, False): t for kind, t in by_kind.items()}
        recompute = [by_kind[kind] for kind in dict.fromkeys(kind for kind, _ in others or layers)]
    else:
        tr = trace_block(ctx, input_rg=True)
        recompute = [tr]
    tr_first = trace_block(kind_context(ctx, first_kind, tq), input_rg=first_rg, dense_layer=first_dense)
    dense_bytes = tr.total_bytes
    if dense:
        # the leading dense layers: the stack's first kind
        dkind = order[0] if order else ""
        tr_dense = trace_block(kind_context(ctx, dkind, tq), input_rg=True, dense_layer=True)
        dense_bytes = tr_dense.total_bytes
        kinds[(dkind, True)] = tr_dense
        if any(d for _, d in others):
            recompute.append(tr_dense)
    # the only trained layer is the first: the one a backward rebuilds is that block itself
    recompute_bytes = [t.total_bytes for t in (recompute if others else [tr_first])]
    # final norm + output head input
    htr = Trace()
    x = htr.new("final norm input", Th * arch.hidden_size, resid, True, "T x h", "output head")
    head_trains = full or (s.method == "freeze" and not arch.tie_word_embeddings) or "lm_head" in s.modules_to_save
    ctx_head = BlockContext(**{**ctx.__dict__, "linear_trains": head_trains, "quant_base": False,
                               "lora_modules": (), "T": Th, "s": tq if tq is not None else sq})
    n = arch.family.final_norm(htr, ctx_head, x)
    norm_packs = htr.packs
    if s.autocast or s.precision == "fp8":
        if head_trains or n.rg:
            n_c = htr.cast(n, c, "output head input cast")
            if head_trains:
                htr.save(n_c)
    elif head_trains:
        htr.save(n)
    if "lm_head" in head_targets:
        # peft LoRA on the head: its input cast to the adapter dtype and lora_A's output are
        # kept; DoRA also keeps the base output and the LoRA output (T x V each)
        r, a_dt, V = s.lora_r, P.adapter_dtype, arch.vocab_size
        htr.save(htr.cast(n, a_dt, "lm_head LoRA input as " + a_dt))
        htr.save(htr.new("lm_head lora_A output", Th * r, a_dt, True, f"T x r (r={r})", "output head"))
        if s.lora_variant == "dora":
            htr.save(htr.new("lm_head DoRA base output", Th * V, logits_dtype(arch, s), True, "T x V", "output head"))
            htr.save(htr.new("lm_head DoRA LoRA output", Th * V, a_dt, True, "T x V", "output head"))
    # the embedding side: what the forward keeps from the token embedding for the backward.
    # F.embedding keeps the token ids for its weight gradient: they are the input_ids tensor
    # itself (already on the GPU), not a new one
    etr = Trace()
    etr.new("embedding output", T * arch.hidden_size, resid, True, "T x h", "embedding")
    if "embed_tokens" in head_targets:
        # peft lora.Embedding: after_A = embedding(ids, lora_embedding_A.T) (T x r) is kept by
        # the product with lora_embedding_B
        etr.save(etr.new("embed_tokens LoRA after_A", T * s.lora_r, P.adapter_dtype, True, "T x r", "embedding"))
    head = [(t.name, t.nbytes, t.formula) for t in list(htr.saved.values()) + list(etr.saved.values())]
    head += arch.family.head_saved(arch, Th, full)
    return {"per_layer": list(tr.saved.values()), "per": tr.total_bytes, "first": tr_first.total_bytes,
            "dense": dense_bytes, "head": head, "backend": backend, "recompute": recompute_bytes,
            "written": tr.created_bytes, "ops": tr.created_ops,
            "head_written": htr.created_bytes, "head_ops": htr.created_ops, "head_packs": norm_packs,
            "alloc_ops": (tr.ops, set(tr.saved), tr.saved_by_producer, tr.stream, tr.pack_counts),
            "alloc_ops_first": (tr_first.ops, set(tr_first.saved), tr_first.saved_by_producer, tr_first.stream, tr_first.pack_counts),
            "kind_alloc_ops": {k: (t.ops, set(t.saved), t.saved_by_producer, t.stream, t.pack_counts)
                               for k, t in kinds.items()},
            "head_alloc": (htr.ops, set(htr.saved), htr.saved_by_producer, htr.stream, htr.pack_counts),
            "embed_alloc": (etr.ops, set(etr.saved), etr.saved_by_producer, etr.stream, etr.pack_counts)}


def dora_weight_copies_per_layer(arch: Architecture, s: TrainingSetup, P: ParamStorage) -> float:
    """What DoRA keeps per layer that does not scale with tokens (peft DoraLinearLayer.forward):
    the weight norm, ``mag_norm_scale`` and ``mag_norm_scale - 1`` (out each, fp32); with
    lora_dropout > 0 the base output is recomputed as F.linear(dropout(x), weight.to(x.dtype))
    and that linear keeps the adapter-dtype copy of the weight: out x in per adapted module."""
    if s.lora_variant != "dora" or not P.lora_modules or not arch.num_layers:
        return 0.0
    mods = arch.lora_tensors(P.lora_modules)
    # weight_norm, mag_norm_scale and mag_norm_scale - 1: three out-sized vectors per module
    vectors = 3 * sum(t.out_features * t.repeat for t in mods) / arch.num_layers
    copies = sum(t.numel for t in mods) / arch.num_layers if s.lora_dropout > 0 else 0.0
    return (vectors + copies) * DTYPE_BYTES[P.adapter_dtype]


def dora_norm_bytes(arch: Architecture, s: TrainingSetup, P: ParamStorage) -> float:
    """DoRA's weight-norm working set while one adapted module runs (peft DoraLinearLayer:
    ``lora_B(lora_A(eye(in))).T`` keeps the in x in identity and in x r; the base weight cast
    to the adapter dtype, ``scaling * lora_weight`` and their sum are out x in each; a 4-bit
    base is first dequantized to 16 bits): the largest adapted module sets it."""
    if s.lora_variant != "dora" or not P.adapters:
        return 0.0
    a = DTYPE_BYTES[P.adapter_dtype]
    best = 0.0
    shapes = [(t.in_features, t.out_features) for t in arch.lora_tensors(P.lora_modules)] if P.lora_modules else []
    shapes += [(arch.hidden_size, arch.vocab_size) for m in lora_head_targets(s) if m == "lm_head"]
    for i, o in shapes:
        b = (i * i + i * s.lora_r + 4 * o * i) * a + (o * i * DTYPE_BYTES[s.compute_dtype] if s.quantized else 0)
        best = max(best, b)
    return best


def lora_head_targets(s: TrainingSetup) -> Tuple[str, ...]:
    """The LoRA targets outside the blocks (``lm_head``, ``embed_tokens``)."""
    return tuple(t for t in (s.lora_targets or ()) if t in HEAD_TARGETS) if s.trains_adapters else ()


def trained_range(arch: Architecture, s: TrainingSetup) -> Tuple[int, int]:
    """(index of the first trained layer, trained layers): every layer, or under freeze the
    last ``trainable_layers`` (LlamaFactory's freeze tuning trains the top layers; param_storage)."""
    L = arch.num_layers
    k = min(s.trainable_layers, L) if s.method == "freeze" else L
    return L - k, k


def layer_key(arch: Architecture, order: Optional[List[str]], layer: int) -> Tuple[str, bool]:
    """Layer ``layer``'s block as (kind, dense): the kind from the family's layer order
    (``order``; "" where every block is alike), dense for a DeepSeek-style leading dense layer."""
    lead = arch.dense_layers if arch.is_moe else 0
    return (order[layer] if order and layer < len(order) else "", layer < lead)


def trained_layers(arch: Architecture, s: TrainingSetup) -> List[Tuple[str, bool]]:
    """The trained layers in order, each as (kind, dense): the kind from the family's layer
    order ("" where every block is alike), dense for a DeepSeek-style leading dense layer."""
    first, k = trained_range(arch, s)
    order = arch.family.layer_order(arch)
    return [layer_key(arch, order, j) for j in range(first, first + max(k, 1))]


def trained_layout(arch: Architecture, s: TrainingSetup) -> Tuple[Any, ...]:
    """What of the trained layers' layout the block trace depends on (part of its cache key):
    the first one's kind, the other kinds' proportions, whether another one is dense."""
    layers = trained_layers(arch, s)
    counts: Dict[str, int] = {}
    for kind, _ in layers[1:]:
        counts[kind] = counts.get(kind, 0) + 1
    g = 0
    for c in counts.values():
        g = math.gcd(g, c)
    return (layers[0], tuple((kd, c // g) for kd, c in counts.items()), any(d for _, d in layers[1:]))


def kind_context(ctx: BlockContext, kind: str, tq: Optional[int]) -> BlockContext:
    """``ctx`` for a block of ``kind``: a decoder block of an encoder-decoder (a kind of the
    family's ``target_kinds``) reads b x tq target tokens (its self-attention t x t, its
    cross-attention t x s over the encoder's ``enc_s``); the others ``ctx``'s own sizes."""
    if tq is not None and kind in ctx.arch.family.target_kinds:
        return replace(ctx, kind=kind, T=ctx.b * tq, s=tq)
    return replace(ctx, kind=kind)


def mixed_stack(ctx: BlockContext, order: List[str], trained: List[str],
                 tq: Optional[int] = None) -> Tuple[Trace, Dict[str, Trace]]:
    """A stack of blocks of several kinds (a hybrid's linear-attention and attention layers,
    an encoder-decoder's two stacks): the average steady block, each kind's saved tensors
    weighted by its share of ``trained`` (the trained layers after the first, so the first +
    their count x the average is what they save together), and every kind's steady block.
    Its forward work (kernels, bytes written) is averaged over every layer of ``order``:
    frozen layers run their forward too.  ``tq``: an encoder-decoder's target length (its
    decoder blocks' tokens, see kind_context)."""
    n = len(trained)
    L = len(order)
    avg = Trace()
    blocks: Dict[str, Trace] = {}
    for kind in dict.fromkeys(order):
        trk = blocks[kind] = trace_block(kind_context(ctx, kind, tq), input_rg=True)
        count = trained.count(kind)
        if count:
            w = count / n
            for t in trk.saved.values():
                name = f"{t.name} ({kind}, {count} of {n} layers)"
                avg.saved[name] = SavedTensor(name, t.group, t.nbytes * w, t.dtype, t.numel * w, t.formula)
        share = order.count(kind) / L
        avg.created_ops += trk.created_ops * share
        avg.created_bytes += trk.created_bytes * share
    return avg, blocks


def logits_dtype(arch: Architecture, s: TrainingSetup) -> str:
    """The output head computes in the compute dtype under autocast, else in its weight's
    dtype (fp32 after prepare_model_for_kbit_training, which upcasts the head)."""
    if s.autocast:
        return s.compute_dtype
    if s.quantized:
        return "float32" if s.prepare_kbit else s.compute_dtype
    return s.weights_dtype


def full_checkpointing(s: TrainingSetup) -> bool:
    """Whether full activation checkpointing is on."""
    return s.gradient_checkpointing == "full"


def residual_dtype(s: TrainingSetup) -> str:
    if s.autocast or (s.quantized and s.prepare_kbit):
        return "float32"
    return s.weights_dtype if not s.quantized else s.compute_dtype
