"""Inference memory: weights in any storage format, the KV cache, prefill and decode, serving.

``estimate_inference(model, **setup)`` answers "will it run": what ``model.generate()``
holds on one GPU (Hugging Face transformers 5.x, the installed 5.23 read for every rule
below), or, given ``gpu_memory_utilization``, how many KV-cache tokens and concurrent
sequences a vLLM-style server with a paged KV cache fits.  Phases of ``generate()``:

after_load    weights (+ quantization constants) as stored on the GPU
prefill       + the KV cache of the prompt + the working set of the largest step of one
              layer at b x prompt tokens + the first forward's logits (generate sets
              ``logits_to_keep=1``: only the last position's b x V logits) + workspaces
decode        + the KV cache at ``context_len`` tokens + one decode step's transients
              (the cache's ``torch.cat`` copy of one layer, eager attention's repeated
              K/V, MLA's expanded K/V, MoE expert weights gathered by ``batched_mm``)

The peak is the larger of prefill and decode.  Each mechanism is one function below
with its formula; the symbols are those of :mod:`vramwidget.model.architecture` (h, L, a, kv,
d, i, V, E, k) plus b (batch), p (prompt tokens), S (tokens in the cache), T = b x p.

What transformers 5.23 does (read from its source; a GPU measurement is still to come):

* ``DynamicCache(config=...)`` (what generate builds) keeps sliding-window layers
  (Mistral v0.1, Gemma 2/3's local layers) as ``DynamicSlidingWindowLayer``: after a
  decode step each such layer's storage is ``min(S, W)`` tokens (it keeps the last W-1
  as a view of a W-token ``torch.cat`` result).  Right after the prefill the sliced view
  still holds the whole prompt's storage, so the prefill peak has the full cache.
* DeepSeek-V2/V3 attention caches the *compressed* latent: ``kv_a_layernorm(c_kv)``
  (kv_lora_rank) and the rotary key (qk_rope_head_dim), one "head", per layer and token,
  then expands it to per-head K and V with ``kv_b_proj`` at every step (a transient of
  S x a x (d_nope + d_v) + S x a x d_qk for one layer).  ``mla_cache="decompressed"``
  gives the per-head K/V cache of older transformers and of servers without MLA kernels.
* SDPA with no padding passes ``enable_gqa`` (no K/V copies); eager attention repeats K
  and V to every head (``repeat_kv``) and materialises b x a x q x S scores, an fp32
  softmax and its cast back.
* On a GPU, MoE decode switches ``grouped_mm`` experts to ``batched_mm``, which gathers
  every selected expert's weights: b x k x 3 x i_e x h weight elements for one layer.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from ..model.architecture import Architecture, load
from ..errors import VramError
from ..gpus import context_for
from ..inputs import MAX_BYTES, check_int, check_total
from ..result import Estimate, EstimateSources, Node
from ..units import DTYPE_BYTES, GIB
# the run's parts live one floor down (vramwidget/inference/); every public name is re-exported here
from .kv import KVLayout, kv_layout
from .setup import (ATTN_IMPLEMENTATIONS, BLOCK_SIZE, DEFAULT_MAX_NUM_BATCHED_TOKENS,  # noqa: F401
                          DEFAULT_MAX_NUM_SEQS, ENGINES, KV_CACHE_DTYPES, LOGITS_CHOICES, MLA_CACHE_CHOICES,
                          InferenceSetup)
from .steps import (attention_kernel, decode_transients, dequant_transients,  # noqa: F401
                          generation_temporaries, layer_steps, logits_items)
from .versions import DEFAULT_TRANSFORMERS, transformers_version  # noqa: F401
from .weights import (GGML_BPW, WEIGHT_FORMATS, StoredTensor, canonical_weights_format,  # noqa: F401
                            gguf_tensor_type, weight_storage)
# generate()'s allocator replay (it imports the parts above, never this module)
from .events import hooks as generate_hooks, peaks as generate_peaks, steps_before_oom

Model = Union[str, Dict[str, Any], Architecture]

_CHILD_ORDER = ("weights", "quantization constants", "kv cache", "activations", "logits", "generation", "workspace",
                "allocator reserve", "cuda context")


def weights_bytes(model: Model, weights: str = "bf16", **kw: Any) -> float:
    """Bytes of the weights plus their quantization constants in a storage format."""
    arch = load(model)
    s = InferenceSetup.from_kwargs(weights=weights, **kw)
    return sum(x.weight_bytes + x.const_bytes for x in weight_storage(arch, s))


def kv_cache_bytes(model: Model, tokens: int, *, batch_size: int = 1, kv_cache_dtype: str = "bfloat16",
                   mla_cache: str = "compressed", use_sliding_window: bool = True) -> float:
    """KV-cache bytes of ``batch_size`` sequences of ``tokens`` tokens each (after a decode
    step: sliding layers hold min(tokens, W))."""
    arch = load(model)
    s = InferenceSetup.from_kwargs(kv_cache_dtype=kv_cache_dtype, batch_size=batch_size, context_len=tokens,
                                   mla_cache=mla_cache, use_sliding_window=use_sliding_window)
    lay = kv_layout(arch, s.kv_cache_dtype, s.mla_cache, s.use_sliding_window)
    return _kv_node(lay, s.batch_size, tokens, window_applies=True).bytes


def _kv_node(lay: KVLayout, b: int, tokens: int, window_applies: bool) -> Node:
    node = Node("kv cache")
    if lay.state_bytes_per_seq:
        node.add(Node("fixed-size state of the conv / linear-attention layers", bytes=b * lay.state_bytes_per_seq,
                      formula=f"b {b} x {lay.state_bytes_per_seq:g} B per sequence (does not grow with S)"))
    names = ("latent (kv_lora_rank)", "rotary key (qk_rope_head_dim)") if lay.kind == "mla latent" \
        else ("keys", "values")
    for label, n_layers, sliding in (("full-attention layers", lay.full_layers, False),
                                     ("sliding-window layers", lay.sliding_layers, True)):
        if not n_layers:
            continue
        S = lay.layer_tokens(tokens, sliding) if window_applies else tokens
        grp = node.add(Node(f"{label} ({n_layers})"))
        why = f", min(S, W={lay.window})" if sliding and window_applies and lay.window else ""
        for nm, el in zip(names, (lay.k_elems, lay.v_elems)):
            grp.add(Node(nm, bytes=b * S * n_layers * el * lay.elem_bytes, count=b * S * n_layers * el,
                         formula=f"b {b} x S {S}{why} x {n_layers} layers x {el} x {lay.elem_bytes:g} B"))
    return node.finalize()


# ----------------------------------------------------------------------------------
# The estimate
# ----------------------------------------------------------------------------------

class InferenceEstimate(Estimate):
    """An :class:`~vramwidget.result.Estimate` of inference, with the KV-cache figures.

    ``kv_cache_bytes``: the cache at ``context_len`` tokens for the batch (decode);
    ``kv_cache_prefill_bytes``: the cache right after the prefill (sliding layers still
    hold the prompt); ``kv_bytes_per_token``: every layer's K/V for one token (no window);
    ``weights_bytes``: weights + quantization constants; ``serving``: with
    ``gpu_memory_utilization``, the paged KV budget (tokens, blocks, concurrent sequences);
    ``fits``: whether the device total fits the GPU (when a GPU is given).
    """

    def __init__(self, *args: Any, kv_cache_bytes: float = 0.0, kv_cache_prefill_bytes: float = 0.0,
                 kv_bytes_per_token: float = 0.0, weights_bytes: float = 0.0,
                 serving: Optional[Dict[str, Any]] = None, gpu: Optional[str] = None,
                 gpu_usable_bytes: Optional[float] = None, fits: Optional[bool] = None, **kw: Any):
        super().__init__(*args, **kw)
        self.kv_cache_bytes = kv_cache_bytes
        self.kv_cache_prefill_bytes = kv_cache_prefill_bytes
        self.kv_bytes_per_token = kv_bytes_per_token
        self.weights_bytes = weights_bytes
        self.serving = serving
        self.gpu = gpu
        self.gpu_usable_bytes = gpu_usable_bytes
        self._fits = fits

    @property
    def fits(self) -> Optional[bool]:
        """Whether the device total fits the GPU's usable memory (None without a GPU); a
        serving budget sets it from the KV pool.  Read lazily: it runs the allocator replay."""
        if self._fits is not None or self.gpu_usable_bytes is None:
            return self._fits
        from ..gpus import fits

        return fits(self.device_total_bytes, self.gpu_usable_bytes)

    @fits.setter
    def fits(self, value: Optional[bool]) -> None:
        self._fits = value

    @property
    def assumes(self) -> str:
        """The weight format and the transformers (or engine) behaviour this estimate assumes."""
        return assumptions(self)

    def to_dict(self) -> Dict[str, Any]:
        """A plain dict of this object (JSON-able)."""
        d = super().to_dict()
        d.update({"mode": "serving" if self.serving else "generate", "assumes": self.assumes,
                  "kv_cache_bytes": int(round(self.kv_cache_bytes)),
                  "kv_cache_gib": round(self.kv_cache_bytes / GIB, 4),
                  "kv_cache_prefill_bytes": int(round(self.kv_cache_prefill_bytes)),
                  "kv_bytes_per_token": self.kv_bytes_per_token,
                  "weights_bytes": int(round(self.weights_bytes)),
                  "gpu": self.gpu, "fits": self.fits, "serving": self.serving})
        d.pop("params_trainable", None)
        d.pop("flops_per_step", None)
        d.pop("recompute_overhead", None)
        return d

    def __repr__(self) -> str:
        extra = ""
        if self.serving:
            extra = f", serving {self.serving['kv_tokens']} KV tokens / {self.serving['max_concurrent_sequences']} seqs"
        return (f"InferenceEstimate({self.model_name!r}, peak {self.peak_gib:.2f} GiB at {self.peak_phase}, "
                f"KV cache {self.kv_cache_bytes / GIB:.2f} GiB{extra})")


def format_from_config(config: Any) -> Tuple[Dict[str, Any], str]:
    """The weight format a checkpoint ships in, from its config.json's ``quantization_config``
    (the keys transformers' quantizers read: ``quant_method`` and their own), as
    :func:`estimate_inference` keywords and a note; ``({}, "")`` when it names none we model.

    mxfp4 (gpt-oss) -> ``mxfp4``; fp8 with ``weight_block_size`` -> ``fp8-block``, without ->
    ``fp8``; gptq (``bits``, ``group_size``) -> ``gptq-4bit`` / ``gptq-8bit``; awq -> ``awq-4bit``;
    bitsandbytes (``load_in_4bit`` + ``bnb_4bit_quant_type``, ``load_in_8bit``) -> nf4 / fp4 /
    int8; compressed-tensors (the first ``config_groups`` entry's ``weights``: int 4 -> ct-w4a16,
    int 8 -> ct-w8a8, float 8 -> ct-fp8)."""
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    if not isinstance(qc, dict):
        return {}, ""
    m = str(qc.get("quant_method", "")).lower()
    kw: Dict[str, Any] = {}
    if m == "mxfp4":
        kw["weights"] = "mxfp4"
    elif m == "fp8":
        blk = qc.get("weight_block_size")
        if isinstance(blk, (list, tuple)) and blk:
            kw.update(weights="fp8-block", group_size=int(blk[0]))
        else:
            kw["weights"] = "fp8"
    elif m == "gptq":
        kw["weights"] = "gptq-8bit" if int(qc.get("bits", 4) or 4) == 8 else "gptq-4bit"
        if qc.get("group_size") is not None:
            kw["group_size"] = int(qc["group_size"])
    elif m == "awq":
        kw["weights"] = "awq-4bit"
        if qc.get("group_size") or qc.get("q_group_size"):
            kw["group_size"] = int(qc.get("group_size") or qc.get("q_group_size"))
    elif m == "bitsandbytes":
        if qc.get("load_in_4bit"):
            kw["weights"] = str(qc.get("bnb_4bit_quant_type", "nf4") or "nf4").lower()
            kw["double_quant"] = bool(qc.get("bnb_4bit_use_double_quant", False))
        elif qc.get("load_in_8bit"):
            kw["weights"] = "int8"
    elif m == "compressed-tensors":
        groups = qc.get("config_groups") or {}
        first = next(iter(groups.values()), {}) if isinstance(groups, dict) else {}
        w = first.get("weights") or {} if isinstance(first, dict) else {}
        bits, typ = int(w.get("num_bits", 8) or 8), str(w.get("type", "int")).lower()
        if typ == "float":
            kw["weights"] = "ct-fp8"
        elif bits == 4:
            kw["weights"] = "ct-w4a16"
            if w.get("group_size"):
                kw["group_size"] = int(w["group_size"])
        else:
            kw["weights"] = "ct-w8a8"
    if not kw:
        return {}, ""
    desc = ", ".join(f"{k}={v}" for k, v in kw.items())
    return kw, (f"weights: the checkpoint's config.json ships quantization_config (quant_method {m}): {desc} "
                f"assumed; pass weights= to override")


def _legacy_attention(setup: Dict[str, Any]) -> Tuple[Dict[str, Any], str]:
    """transformers < 4.36 had no SDPA path for its decoders (``_supports_sdpa`` came with 4.36):
    generate() ran the eager attention there, whatever ``sdpa`` asked."""
    ver = (setup.get("versions") or {}).get("transformers") if isinstance(setup.get("versions"), dict) else None
    if not ver:
        return setup, ""
    from .engines import parse_version

    if tuple(parse_version(ver)) < (4, 36) and str(setup.get("attn_implementation") or "sdpa").lower() == "sdpa":
        return {**setup, "attn_implementation": "eager"}, (f"attention: transformers {ver} has no SDPA path (4.36 "
                                                           f"added it): eager attention assumed")
    return setup, ""


def assumptions(est: "InferenceEstimate") -> str:
    """One line: the weight format and the transformers (or engine) behaviour the estimate assumes."""
    s = est.setup
    fmt = s.get("weights", "bf16")
    what = WEIGHT_FORMATS.get(fmt, fmt).split(":")[0]
    if est.serving:
        v = est.serving
        return f"weights {fmt} ({what}); {v['engine']} {v['version']} ({v['runtime']}) start-up: {v['budget_rule']}"
    ver = tuple((s.get("versions") or {}).get("transformers", "").split(".")) if (s.get("versions") or {}).get(
        "transformers") else None
    v = transformers_version(InferenceSetup(versions=s.get("versions") or {}))
    parts = [f"weights {fmt} ({what})",
             f"transformers {'.'.join(map(str, v[:2]))}{'' if ver else ' (the installed release)'} generate()"]
    parts.append("the legacy tuple cache: the previous step's keys and values live until the next step "
                 "(< 4.36)" if v < (4, 36) else "DynamicCache grown by torch.cat, one layer at a time")
    parts.append("every position's logits upcast in the model (< 4.45)" if v < (4, 45)
                 else "the last position's logits (logits_to_keep=1) and an fp32 copy")
    if s.get("min_new_tokens"):
        parts.append("min_new_tokens' logits processors")
    parts.append("a padded batch's mask" if s.get("padding") else "no padding (no mask for SDPA)")
    parts.append(f"{s.get('attn_implementation')} attention")
    return "; ".join(parts)


def with_shipped_format(arch: Architecture, setup: Dict[str, Any]) -> Tuple[Dict[str, Any], str]:
    """``setup`` with the checkpoint's own format (:func:`format_from_config`) where it names no
    ``weights``, and the note that says which was assumed; an explicit ``weights`` wins (the
    note then says what the checkpoint ships)."""
    shipped, note = format_from_config(arch.config)
    if not shipped:
        return dict(setup), ""
    if setup.get("weights") is None:
        return {**shipped, **{k: v for k, v in setup.items() if v is not None}}, note
    if canonical_weights_format(setup["weights"]) != shipped["weights"]:
        return dict(setup), (f"weights: {setup['weights']} as asked; the checkpoint ships {shipped['weights']} "
                             f"(its config.json's quantization_config)")
    return dict(setup), ""


def estimate_inference(model: Model, **setup: Any) -> InferenceEstimate:
    """Estimate the GPU memory of running ``model`` for inference.

    Parameters
    ----------
    model:
        A preset name, config.json path or dict, Hub id, Architecture or parameter count.
    weights:
        Storage format: ``bf16``, ``fp16``, ``fp32``, ``fp8``, ``int8``, ``nf4``, ``fp4``,
        ``gptq-4bit``, ``gptq-8bit``, ``awq-4bit``, ``gguf-q4_k_m`` and the other GGUF mixes
        (:data:`WEIGHT_FORMATS`).  GGUF sizes are llama.cpp's resident weights (transformers
        dequantizes a GGUF file on load: use bf16 for that).
    dtype:
        Compute dtype of quantized formats (default bf16; fp16 for GPTQ/AWQ).
    group_size, double_quant:
        GPTQ/AWQ group size (default 128; -1 = none, GPTQ); bitsandbytes double quantization.
    kv_cache_dtype:
        ``bf16``, ``fp16``, ``fp32`` or ``fp8`` (default: the compute dtype).
    batch_size, context_len, prompt_len:
        Sequences, tokens per sequence at the end (prompt + generated), prompt tokens
        (default: the whole context is the prompt, the worst case for the prefill).
    attn_implementation:
        ``sdpa`` (default), ``eager`` or ``flash_attention_2``.
    mla_cache, use_sliding_window, logits:
        ``compressed``/``decompressed`` MLA cache; False caches sliding layers in full;
        ``last`` (generate) or ``all`` (a plain forward's logits for every position).
    gpu, gpu_memory_utilization, max_num_seqs, max_num_batched_tokens, block_size:
        A GPU from the catalog (fit check); with a utilization, the vLLM-style serving
        budget instead of generate().

    Raises
    ------
    VramError
        naming the field that is wrong and what is allowed; for ``device_map`` /
        ``max_memory``, that the package's ``vramwidget.estimate_inference`` takes them
        (:mod:`vramwidget.inference.split`, which imports this module).
    """
    for name in ("device_map", "max_memory"):
        if name in setup:
            raise VramError(f"{name}: a device_map split is estimated by vramwidget.estimate_inference "
                            f"(vramwidget.inference.split); vramwidget.inference.estimate.estimate_inference runs one GPU",
                            field=name)
    arch = load(model)
    setup, note = with_shipped_format(arch, setup)
    setup, eager_note = _legacy_attention(setup)
    s = InferenceSetup.from_kwargs(**setup)
    est = estimate_inference_setup(arch, s)
    for n in (eager_note, note):
        if n:
            est.notes.insert(0, n)
    if est.provisional_device_total_bytes > MAX_BYTES:   # an input error, not an estimate (no replay run)
        if est.phases_bytes.get("after_load", 0.0) > MAX_BYTES:
            check_total(est.provisional_device_total_bytes, f"{arch.name}'s weights",
                        {"model": arch.name, "batch_size": s.batch_size})
        # the KV cache scales with both: the one furthest above its usual value first
        # (a batch of 1, 4,096 tokens: InferenceSetup's default context)
        check_total(est.provisional_device_total_bytes, "this inference run",
                    {"context_len": s.context_len, "batch_size": s.batch_size},
                    usual={"context_len": 4096, "batch_size": 1})
    return est


def _group_node(name: str, stored: List[StoredTensor], consts: bool) -> Node:
    top = Node(name)
    groups: Dict[str, Node] = {}
    for x in stored:
        g = groups.get(x.tensor.group)
        if g is None:
            g = groups[x.tensor.group] = top.add(Node(x.tensor.group))
        if consts:
            for label, nbytes, formula in x.consts:
                g.add(Node(f"{x.tensor.name} {label}", bytes=nbytes, formula=formula))
        elif len(x.parts) == 1:
            label, nbytes, dtype, formula = x.parts[0]
            g.add(Node(x.tensor.name, bytes=nbytes, dtype=dtype, count=x.tensor.numel, formula=formula))
        else:
            sub = g.add(Node(x.tensor.name))
            for label, nbytes, dtype, formula in x.parts:
                sub.add(Node(label, bytes=nbytes, dtype=dtype, formula=formula))
    return top.finalize()


def _list_node(name: str, items: List[Tuple[str, float, str]], formula: str = "") -> Node:
    n = Node(name, formula=formula)
    for label, nbytes, f in items:
        n.add(Node(label, bytes=nbytes, formula=f))
    return n.finalize()


#: the categories of the generate() stream's labels (generate_ops) -> the tree's components
_LIVE_GROUPS = ("kv cache", "activations", "logits", "generation", "workspace")


def _live_nodes(live: Dict[Any, Tuple[int, Any]], where: str) -> List[Node]:
    """The tensors live at a phase's peak (key -> (bytes, (category, name))), one node per
    category, one child per name (summed over the layers that hold one)."""
    groups: Dict[str, Dict[str, List[int]]] = {}
    for nbytes, label in live.values():
        cat, name = label if isinstance(label, tuple) and len(label) == 2 else ("activations", str(label))
        if cat in ("weights", "quantization constants"):
            continue
        groups.setdefault(cat, {}).setdefault(name, []).append(nbytes)
    out = []
    for cat in _LIVE_GROUPS:
        if cat not in groups:
            continue
        node = Node(cat, formula=f"live at the peak of {where}")
        for name, sizes in sorted(groups[cat].items(), key=lambda kv: -sum(kv[1])):
            n = len(sizes)
            node.add(Node(name, bytes=float(sum(sizes)),
                          formula=(f"{n} tensors, {sizes[0]:,} B each" if n > 1 and len(set(sizes)) == 1 else
                                   f"{n} tensors" if n > 1 else f"{sizes[0]:,} B")))
        out.append(node.finalize())
    return out


def _order(nodes: List[Node]) -> List[Node]:
    idx = {k: i for i, k in enumerate(_CHILD_ORDER)}
    return sorted([n for n in nodes if n.bytes > 0], key=lambda n: idx.get(n.name, 99))


def estimate_inference_setup(arch: Architecture, s: InferenceSetup) -> InferenceEstimate:
    """The estimate for a resolved architecture and a validated setup."""
    notes: List[str] = []
    if not arch.exact:
        notes.append(arch.assumption)
    if not s.serving and (s.tensor_parallel > 1 or s.pipeline_parallel > 1 or s.expert_parallel > 1):
        from .engines import check_layout, gpu_share

        check_layout(arch, s.tensor_parallel, s.pipeline_parallel, s.expert_parallel)
        arch = gpu_share(arch, s.tensor_parallel, s.pipeline_parallel, s.expert_parallel, stage=-1)
        notes.append(f"generate() with tensor_parallel={s.tensor_parallel}, pipeline_parallel="
                     f"{s.pipeline_parallel}: the last stage's rank-0 share (transformers' tp_plan column/row "
                     f"split; KV heads replicated when fewer than the TP size)")
    if s.weights == "mxfp4":
        if not getattr(arch.family, "mxfp4_experts", False):
            raise VramError(f"weights: mxfp4 is transformers' MXFP4 path for gpt-oss's experts; {arch.name} has none "
                            f"it converts (use fp8, fp8-block, nf4, gptq-4bit or awq-4bit)", field="weights")
        notes.append("MXFP4: the experts stay 4-bit with transformers' Triton kernels (compute capability >= 7.5, "
                     "Triton >= 3.4 and the kernels package); without them transformers dequantizes them to bf16 "
                     "(weights='bf16')")
    stored = weight_storage(arch, s)
    w_node = _group_node("weights", stored, consts=False)
    q_node = _group_node("quantization constants", stored, consts=True)
    w_bytes = w_node.bytes + q_node.bytes
    lay = kv_layout(arch, s.kv_cache_dtype, s.mla_cache, s.use_sliding_window)
    c = DTYPE_BYTES[s.dtype]
    if s.fmt_kind == "gguf":
        notes.append("GGUF: weight bytes as llama.cpp holds the file's tensors; the KV cache and activations "
                     "follow transformers' generate() (llama.cpp preallocates the KV cache for n_ctx and keeps "
                     "its own compute buffers)")
    if arch.max_position_embeddings and s.context_len > arch.max_position_embeddings:
        notes.append(f"context_len {s.context_len} is beyond the model's max_position_embeddings "
                     f"({arch.max_position_embeddings})")
    gpu = None
    if s.gpu:
        from ..gpus import get_gpu

        gpu = get_gpu(s.gpu)
    if s.serving:
        return _serving_estimate(arch, s, lay, gpu, notes)

    b, p, ctx = s.batch_size, s.prompt_len, s.context_len
    if arch.mla and s.mla_cache == "compressed":
        notes.append("MLA: transformers 5 caches the compressed latent (kv_lora_rank + qk_rope_head_dim per layer "
                     "and token) and re-expands K/V for one layer at a time")
    if b > 1:
        notes.append("batch: prompts of equal length (no padding); padded prompts give SDPA a mask, which "
                     "repeats K/V to every head and rules out the flash kernel")
    # prefill and decode: what the generate() stream (generate_ops, inference_events) has live at
    # each phase's largest moment, in the bytes the caching allocator counts
    kv_pre = _kv_node(lay, b, p, window_applies=False)
    kv_pre.name = "kv cache"
    kv_dec = _kv_node(lay, b, ctx, window_applies=True)
    peaks = generate_peaks(arch, s)
    prefill_nodes = _order([w_node, q_node] + _live_nodes(peaks["prefill"][1], f"prefill of b x p = {b} x {p} tokens"))
    prefill = float(peaks["prefill"][0])
    dec = peaks.get("decode", (0.0, {}))
    decode_nodes = _order([w_node, q_node] + _live_nodes(dec[1], f"a decode step (the cache up to {ctx} tokens)"))
    decode = float(dec[0])

    after_nodes = _order([w_node, q_node])
    phases = {"after_load": float(peaks["after_load"]), "prefill": prefill}
    if "decode" in peaks:
        phases["decode"] = decode
    peak_phase = "prefill" if prefill >= decode else "decode"
    peak = phases[peak_phase]
    phase_components = {"after_load": after_nodes, "prefill": prefill_nodes, "decode": decode_nodes}

    # the GPU's own CUDA context (the H200's without one): gpus.context_for, as training counts it
    context, context_src = context_for(gpu)

    def components_at(reserved_value: float, exact: bool = True) -> List[Node]:
        """The peak phase's components, the allocator reserve at ``reserved_value`` (the
        replayed one, or a provisional one until the replay has run) and the CUDA context."""
        formula = ("caching allocator: max_memory_reserved of a replay of CUDACachingAllocator over this "
                   "generate() call's allocations (inference/events.py) minus the allocated peak, on a card "
                   "with room for it (short of memory, torch frees its cached segments before it fails: "
                   "Estimate.replay(capacity_bytes=...).oom)")
        if not exact:
            formula = ("provisional, the replay has not run yet: allocated peak x the training cases' median "
                       "reserved / allocated ratio (inference_events.provisional_reserved_bytes)")
        return list(phase_components[peak_phase]) + [
            Node("allocator reserve", bytes=max(0.0, reserved_value - peak), formula=formula),
            Node("cuda context", bytes=context, formula=context_src)]

    reserved, replay_fn, provisional_fn = generate_hooks(arch, s, peak)
    if s.attn_implementation == "eager":
        notes.append("eager attention materialises b x a x q x S scores and repeats K/V to every head")
    if lay.sliding_layers and lay.window and p > lay.window:
        notes.append(f"sliding window {lay.window}: during the prefill the sliding layers still hold the whole "
                     f"prompt (the cached window is a view of it); after the first decode step they hold "
                     f"min(S, {lay.window}) tokens")
    est = InferenceEstimate(
        model_name=arch.name, setup=s.to_dict(), params_total=arch.params_total, params_trainable=0,
        components=None, phases_bytes=phases, peak_phase=peak_phase, peak_allocated_bytes=peak,
        reserved_bytes=reserved, cuda_context_bytes=context, cuda_context_source=context_src, notes=notes,
        phase_components=phase_components, kv_cache_bytes=kv_dec.bytes, kv_cache_prefill_bytes=kv_pre.bytes,
        kv_bytes_per_token=lay.bytes_per_token, weights_bytes=w_bytes,
        sources=EstimateSources(components_at=components_at, replay=replay_fn, provisional=provisional_fn,
                                # the resolved architecture and setup (longest_context reuses them)
                                inference=(arch, s), replay_key=(arch, s)))
    # on a card, the reserve is judged as a training step's is (gpus.judge_on): where the
    # unlimited reserve is over the card and the allocated peak is not, generate() is replayed
    # with the card's capacity, where torch frees its cached segments and retries
    est.capacity_judged = True
    if gpu is not None:
        from ..gpus import capacity_bytes

        est.gpu = gpu.name
        # whether it fits is read lazily (InferenceEstimate.fits: it runs the allocator replay)
        est.gpu_usable_bytes = capacity_bytes(gpu)
    return est


# ----------------------------------------------------------------------------------
# Serving: a paged KV cache inside a gpu_memory_utilization budget
# ----------------------------------------------------------------------------------

def serving_budget(plan: Any, lay: KVLayout, s: InferenceSetup) -> Dict[str, Any]:
    """The engine's KV budget as a dict: the engine's own start-up figures (blocks, tokens,
    maximum concurrency for ``context_len``) plus how many sequences of ``context_len`` fit
    when sliding-window layers hold at most ceil(W / block) + 1 blocks."""
    blk = plan.block_size
    budget = plan.kv_budget_bytes
    seq_blocks = -(-s.context_len // blk)
    bpt = plan.kv_bytes_per_token
    per_layer_token = bpt / max(lay.full_layers + lay.sliding_layers, 1)
    per_seq = seq_blocks * blk * bpt
    if lay.sliding_layers and lay.window and s.engine == "vllm":
        sl = lay.sliding_layers
        wb = min(seq_blocks, -(-lay.window // blk) + 1)
        per_seq = seq_blocks * blk * per_layer_token * (lay.full_layers) + wb * blk * per_layer_token * sl
    seqs = int(max(budget, 0) // per_seq) if per_seq else 0
    return {
        "engine": plan.engine,
        "version": plan.version,
        "runtime": plan.runtime,
        "budget_rule": plan.rule,
        "tensor_parallel": plan.tensor_parallel,
        "pipeline_parallel": plan.pipeline_parallel,
        "data_parallel": plan.data_parallel,
        "expert_parallel": plan.expert_parallel,
        "num_gpus": plan.num_gpus,
        "gpu_memory_utilization": plan.utilization,
        "capacity_bytes": int(round(plan.total_bytes)),
        "budget_bytes": int(round(plan.utilization * plan.total_bytes)),
        "weights_bytes": int(round(plan.weights_bytes)),
        "activation_peak_bytes": int(round(plan.activation_bytes)),
        "profile_tokens": plan.profile_tokens,
        "non_torch_bytes": int(round(plan.non_torch_bytes)),
        "kv_budget_bytes": int(round(budget)),
        "kv_bytes_per_token": bpt,
        "block_size": blk,
        "kv_blocks": plan.num_blocks,
        "kv_tokens": plan.kv_tokens,
        "max_concurrency": round(plan.max_concurrency, 4),
        "bytes_per_sequence": per_seq,
        "max_concurrent_sequences": seqs,
        "running_sequences": min(seqs, s.max_num_seqs),
        "context_len": s.context_len,
        "cuda_graph_bytes": int(round(plan.cuda_graph_bytes)),
        "cuda_graphs": plan.cuda_graph_count,
        "startup_lines": plan.startup_lines(),
        "fits": budget > 0 and plan.kv_tokens >= s.context_len,
    }


def _serving_estimate(arch: Architecture, s: InferenceSetup, lay: KVLayout, gpu: Any, notes: List[str]
                      ) -> InferenceEstimate:
    """Serving: the engine's start-up on one GPU of the layout (:mod:`vramwidget.inference.engines`):
    after load, the profiling forward, then the KV pool filling the budget, then CUDA graphs."""
    from .engines import plan as engine_plan

    p = engine_plan(arch, s, gpu)
    notes.extend(p.notes)
    w_node = Node("weights", children=[Node(f"weight shard (tp {p.tensor_parallel}, pp {p.pipeline_parallel}"
                                            f"{', ep ' + str(p.expert_parallel) if p.expert_parallel > 1 else ''})",
                                            bytes=p.weights_bytes,
                                            formula="this GPU's share of every tensor in the stored format "
                                                    "(+ vLLM's rotary cos/sin cache)")])
    w_node.finalize()
    act = _list_node("activations", p.activation_items,
                     formula=f"profiling forward of {p.profile_tokens} tokens" if p.profile_tokens else "")
    nt = _list_node("non-torch memory", p.non_torch_items)
    pool = max(p.num_blocks * p.block_size * p.kv_bytes_per_token, 0.0)
    unit = "tokens" if p.engine == "sglang" else f"blocks of {p.block_size} tokens"
    kv = Node("kv cache", children=[Node(f"paged KV pool ({p.num_blocks} {unit})", bytes=pool,
                                         formula=f"{p.kv_tokens} tokens x {p.kv_bytes_per_token:g} B per token "
                                                 f"(this GPU's layers and KV heads)")])
    kv.finalize()
    graphs = Node("cuda graphs", bytes=p.cuda_graph_bytes,
                  formula=f"{p.cuda_graph_count} captured decode graphs (enforce_eager: none)")
    after = _order([w_node])
    profile = _order([w_node, act])
    serving = _order([w_node, kv, act])
    phases = {"after_load": p.weights_bytes, "profile": p.weights_bytes + p.activation_bytes,
              "serving": p.weights_bytes + p.activation_bytes + pool}
    peak = phases["serving"]
    reserved = max(peak, p.utilization * p.total_bytes - p.non_torch_bytes)
    components = list(serving) + [
        Node("allocator reserve", bytes=reserved - peak, formula="budget not used by whole KV blocks"),
        Node("cuda context", bytes=gpu.cuda_context_bytes, formula=gpu.cuda_context_source)]
    if nt.bytes:
        comm = [x for x in p.non_torch_items if x[0] != "CUDA context"]
        if comm:
            components.append(_list_node("communication buffers", comm))
    if graphs.bytes:
        components.append(graphs)
    info = serving_budget(p, lay, s)
    if not info["fits"]:
        notes.append(f"does not start: the KV cache holds {p.kv_tokens:,} tokens, less than one "
                     f"{s.context_len:,}-token request (budget {p.kv_budget_bytes / GIB:.2f} GiB after weights, "
                     f"activations and non-torch memory)")
    from ..gpus import capacity_bytes

    ctx = gpu.cuda_context_bytes
    est = InferenceEstimate(
        model_name=arch.name, setup=s.to_dict(), params_total=arch.params_total, params_trainable=0,
        components=components, phases_bytes=phases, peak_phase="serving", peak_allocated_bytes=peak,
        reserved_bytes=reserved + sum(x[1] for x in p.non_torch_items if x[0] != "CUDA context")
        + p.cuda_graph_bytes, cuda_context_bytes=ctx, cuda_context_source=gpu.cuda_context_source, notes=notes,
        phase_components={"after_load": after, "profile": profile, "serving": serving},
        kv_cache_bytes=pool, kv_cache_prefill_bytes=0.0, kv_bytes_per_token=p.kv_bytes_per_token,
        weights_bytes=p.weights_bytes, serving=info, gpu=gpu.name, gpu_usable_bytes=capacity_bytes(gpu),
        fits=info["fits"])
    est.plan = p
    return est


# ----------------------------------------------------------------------------------
# The longest context that fits
# ----------------------------------------------------------------------------------

#: the search stops here (2**24 tokens = 16.8M)
MAX_SEARCH_TOKENS = 1 << 24
#: the most generated tokens longest_context replays from a fixed prompt (one replay holds every
#: decode step's allocator events: 131,072 steps of gpt2 are ~0.6 GiB of them)
MAX_DECODE_STEPS = 1 << 17


def longest_context(model: Model, gpu: Any, **kw: Any) -> int:
    """The longest ``context_len`` (a multiple of ``block_size``, 16) whose estimate fits
    ``gpu`` for the batch: that context fits, one more block does not.  0 if not even one
    block fits.

    generate() mode: the device total (reserve + the GPU's own CUDA context) must stay
    within what CUDA reports as its total (:mod:`vramwidget.fit.verdict`); the prompt is the whole context unless ``prompt_len`` is given (then
    min(prompt_len, context)).  Serving mode (``gpu_memory_utilization``): at least
    ``batch_size`` sequences of that context must fit the paged KV pool.
    """
    arch = load(model)
    if gpu is None:    # the card's memory is what bounds the context (None would be "no GPU")
        raise VramError("gpu: longest_context needs the GPU whose memory bounds the context (e.g. 'L4')", field="gpu")
    kw, _note = with_shipped_format(arch, kw)
    kw["gpu"] = gpu
    kw.pop("context_len", None)
    prompt = kw.pop("prompt_len", None)
    serving = InferenceSetup.from_kwargs(**kw).serving   # validate once, with the field names
    if prompt is not None:
        prompt = check_int("prompt_len", prompt, lo=1)
    blk = check_int("block_size", kw.get("block_size", BLOCK_SIZE), lo=1)
    batch = kw.get("batch_size") or 1

    def estimate_at(n_blocks: int) -> InferenceEstimate:
        ctx = n_blocks * blk
        p = min(prompt, ctx) if prompt else None
        return estimate_inference_setup(arch, InferenceSetup.from_kwargs(context_len=ctx, prompt_len=p, **kw))

    cap = max(MAX_SEARCH_TOKENS // blk, 1)
    if serving:
        return _largest_true(lambda n: bool((e := estimate_at(n)).serving
                                            and e.serving["max_concurrent_sequences"] >= batch), cap) * blk
    from ..gpus import fits as fits_rule

    # reserved memory is at least the allocated peak: the peak alone bounds the answer (no
    # replay); the replays then decide below that bound
    bound = _largest_true(lambda n: fits_rule((e := estimate_at(n)).peak_allocated_bytes + e.cuda_context_bytes,
                                              e.gpu_usable_bytes), cap)
    if bound == 0:
        return 0
    if not prompt or prompt >= bound * blk:
        # the whole context is the prompt: each estimate replays a prefill (no decode steps)
        return _largest_true(lambda n: bool(estimate_at(n).fits), bound) * blk
    # That replay holds every decode step's events: above MAX_DECODE_STEPS (gpt2 from a 128-token
    # prompt on an H100: a million steps, 4.4 GiB of events, then 16 GiB) it is not attempted
    if (bound * blk - prompt) > MAX_DECODE_STEPS:
        raise VramError(f"prompt_len: from a {prompt:,}-token prompt, {arch.name} fits {gpu} up to about "
                        f"{bound * blk:,} tokens by its allocated memory alone; a search through more than "
                        f"{MAX_DECODE_STEPS:,} generated tokens is not replayed (its allocator stream takes gigabytes): "
                        f"give a prompt_len nearer the context you serve, or check one context_len with "
                        f"estimate_inference", field="prompt_len")
    # a fixed prompt: the stream of a shorter context is the first events of the bound's, and so
    # is its replay at the card's capacity.  A context fits exactly when that replay runs without
    # an out-of-memory error (the verdict's rule, gpus.judge_on: the unlimited reserve fitting, or
    # the free-and-retry at the limit saving it), so one capacity replay of the bound decides
    # every context: the longest is the one whose last decode step ends before the failing
    # request (inference_events.steps_before_oom)
    top = estimate_at(bound)
    capacity = top.gpu_usable_bytes - top.cuda_context_bytes
    steps = steps_before_oom(*top.sources.inference, capacity)
    if steps is None:
        return bound * blk
    last = prompt + steps                        # the cache of the last step that ran whole
    return _largest_true(lambda n: n * blk <= max(last, prompt) and (n * blk > prompt or bool(estimate_at(n).fits)),
                         bound) * blk


def _largest_true(pred: Any, cap: int) -> int:
    """The largest n in [1, cap] with ``pred(n)`` (true up to some n, false after), 0 if none."""
    if not pred(1):
        return 0
    lo, hi = 1, 2
    while hi <= cap and pred(hi):
        lo = hi
        hi *= 2
    if hi > cap:
        if pred(cap):
            return cap
        hi = cap
    while hi - lo > 1:       # pred(lo), not pred(hi)
        mid = (lo + hi) // 2
        if pred(mid):
            lo = mid
        else:
            hi = mid
    return lo


# ----------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------

#: (flag, dest, type, help)
_CLI_OPTIONS = (
    ("--weights", "weights", str, "weight format: " + ", ".join(WEIGHT_FORMATS)),
    ("--dtype", "dtype", str, "compute dtype of quantized formats (bf16 or fp16)"),
    ("--group-size", "group_size", int, "GPTQ/AWQ group size (default 128; -1: GPTQ without groups)"),
    ("--kv-cache-dtype", "kv_cache_dtype", str, "KV cache dtype: " + ", ".join(KV_CACHE_DTYPES)),
    ("--batch-size", "batch_size", int, "sequences (default 1)"),
    ("--context-len", "context_len", int, "tokens per sequence: prompt + generated (default 4096); serving: "
                                          "the engine's max_model_len (--max-model-len)"),
    ("--prompt-len", "prompt_len", int, "prompt tokens (default: the whole context)"),
    ("--attn-implementation", "attn_implementation", str, "sdpa, eager or flash_attention_2"),
    ("--mla-cache", "mla_cache", str, "MLA cache: compressed (transformers 5) or decompressed"),
    ("--logits", "logits", str, "last (generate) or all (a plain forward)"),
    ("--gpu", "gpu", str, "a GPU from the catalog (e.g. H100-80GB): fit check"),
    ("--gpu-memory-utilization", "gpu_memory_utilization", float,
     "serving: fraction of the GPU a vLLM-style server may use (e.g. 0.9)"),
    ("--max-num-seqs", "max_num_seqs", int, f"serving: most sequences at once (default {DEFAULT_MAX_NUM_SEQS})"),
    ("--max-num-batched-tokens", "max_num_batched_tokens", int,
     "serving: tokens of the profiling forward (default: the engine release's own)"),
    ("--engine", "engine", str, "hf (generate(), default), vllm or sglang: whose start-up to reproduce"),
    ("--tensor-parallel-size", "tensor_parallel", int, "GPUs a layer is split over (default 1)"),
    ("--pipeline-parallel-size", "pipeline_parallel", int, "pipeline stages (default 1)"),
    ("--data-parallel-size", "data_parallel", int, "model replicas (default 1)"),
    ("--expert-parallel-size", "expert_parallel", int, "GPUs the experts are spread over (default 1)"),
    ("--vllm-version", "vllm_version", str, "the vLLM release whose memory profile to use (e.g. 0.6.4)"),
    ("--sglang-version", "sglang_version", str, "the SGLang release"),
    ("--mem-fraction-static", "mem_fraction_static", float, "SGLang's share of the GPU for weights + KV pool"),
    ("--concurrency", "concurrency", int,
     "with --engine vllm/sglang and --gpu: the fewest GPUs (and TP/PP layout) that hold this many "
     "requests of --context-len tokens at once"),
)

#: options that are not estimate_inference() settings
_RUN_ONLY = ("vllm_version", "sglang_version", "concurrency")


def add_arguments(parser: argparse.ArgumentParser, *, model: bool = True) -> argparse.ArgumentParser:
    """Add the inference options to ``parser`` (an ``infer`` subcommand, or ``estimate``
    with ``--inference``).  Options the parser already has (``--batch-size``,
    ``--attn-implementation``) are left alone and read by :func:`run` all the same."""
    have = getattr(parser, "_option_string_actions", {})
    if model:
        parser.add_argument("model", metavar="MODEL", help="a preset name, config.json path, Hub id or a "
                                                           "parameter count like 7B")
    for flag, dest, typ, text in _CLI_OPTIONS:
        if flag in have:
            continue
        aliases = {"--context-len": ("--max-model-len",), "--tensor-parallel-size": ("--tp",),
                   "--pipeline-parallel-size": ("--pp",)}.get(flag, ())
        parser.add_argument(flag, *[a for a in aliases if a not in have], dest=dest, type=typ, default=None,
                            help=text)
    for flag, dest, val, text in (("--double-quant", "double_quant", True, "bitsandbytes 4-bit double quantization"),
                                  ("--enforce-eager", "enforce_eager", True, "serving: no CUDA graphs"),
                                  ("--no-sliding-window", "use_sliding_window", False,
                                   "cache sliding-window layers in full"),
                                  ("--longest-context", "longest_context", True,
                                   "with --gpu: print the longest context that fits")):
        if flag not in have:
            parser.add_argument(flag, dest=dest, action="store_const", const=val, default=None, help=text)
    if "--json" not in have:
        parser.add_argument("--json", action="store_true", help="print JSON")
    return parser


def setup_from_args(args: argparse.Namespace) -> Dict[str, Any]:
    """The keyword arguments of :func:`estimate_inference` that ``args`` sets."""
    kw: Dict[str, Any] = {}
    for _, dest, _, _ in _CLI_OPTIONS:
        v = getattr(args, dest, None)
        if v is not None and dest not in _RUN_ONLY:
            kw[dest] = v
    versions = {k: getattr(args, f"{k}_version", None) for k in ("vllm", "sglang")}
    versions = {k: v for k, v in versions.items() if v}
    if versions:
        kw["versions"] = versions
    for dest in ("double_quant", "use_sliding_window", "enforce_eager"):
        v = getattr(args, dest, None)
        if v is not None:
            kw[dest] = v
    return kw


def run(args: argparse.Namespace, out=None) -> int:
    """Run the inference estimate for parsed ``args``; prints a table or JSON, returns 0.
    Raises VramError on bad input (the caller prints it as one line).  With ``--concurrency``
    (and a serving engine and GPU) it plans the deployment instead: the fewest GPUs and the
    TP/PP layout."""
    out = out or sys.stdout
    kw = setup_from_args(args)
    concurrency = getattr(args, "concurrency", None)
    if concurrency is not None:
        return _run_plan(args.model, kw, check_int("concurrency", concurrency, lo=1), out, getattr(args, "json", False))
    est = estimate_inference(args.model, **kw)
    longest = None
    if getattr(args, "longest_context", None):
        if not kw.get("gpu"):
            raise VramError("longest_context: needs --gpu", field="gpu")
        longest = longest_context(args.model, **kw)
    extra: Dict[str, Any] = {}
    if est.serving:
        extra = serving_report(args.model, kw)
    if getattr(args, "json", False):
        d = est.to_dict()
        if longest is not None:
            d["longest_context"] = longest
        d.update(extra)
        out.write(json.dumps(d, indent=2) + "\n")
        return 0
    out.write(format_table(est, longest) + "\n")
    if extra:
        out.write(f"  largest max_model_len that starts: {extra['largest_max_model_len']:,} tokens\n")
        if extra["command_note"]:
            out.write(f"  {'command' if extra['command'] else 'no command'}: {extra['command_note']}\n")
        if extra["command"]:
            out.write(f"  command: {extra['command']}\n")
    return 0


def serving_report(model: Model, kw: Dict[str, Any]) -> Dict[str, Any]:
    """What a serving estimate adds: the engine's start-up lines, the largest
    ``max_model_len`` that starts with this layout, and a copyable command line."""
    from .engines import plan, startable_command
    from ..gpus import get_gpu

    arch = load(model)
    s = InferenceSetup.from_kwargs(**kw)
    gpu = get_gpu(s.gpu)
    p = plan(arch, s, gpu)
    command, why, largest = startable_command(arch, s, gpu, arch.hub_id or arch.name)
    return {"startup_lines": p.startup_lines(), "largest_max_model_len": largest, "command": command,
            "command_note": why}


def _run_plan(model: Model, kw: Dict[str, Any], concurrency: int, out, as_json: bool) -> int:
    from .engines import fewest_gpus
    from ..gpus import get_gpu

    if not kw.get("gpu"):
        raise VramError("concurrency: planning needs --gpu (the card to deploy on)", field="gpu")
    if kw.get("engine", "vllm") == "hf" or "engine" not in kw:
        kw = {**kw, "engine": kw.get("engine") if kw.get("engine") not in (None, "hf") else "vllm"}
    arch = load(model)
    s = InferenceSetup.from_kwargs(**kw)
    p = fewest_gpus(arch, s, get_gpu(s.gpu), concurrency)
    name = arch.hub_id or arch.name
    if p is None:
        msg = (f"{arch.name}: no layout of up to 64 x {s.gpu} holds {concurrency} requests of {s.context_len:,} "
               f"tokens")
        if as_json:
            out.write(json.dumps({"model": arch.name, "fits": False, "message": msg}, indent=2) + "\n")
        else:
            out.write(msg + "\n")
        return 0
    d = {"model": arch.name, "gpu": s.gpu, "engine": p.engine, "version": p.version, "concurrency": concurrency,
         "context_len": s.context_len, "num_gpus": p.num_gpus, "tensor_parallel": p.tensor_parallel,
         "pipeline_parallel": p.pipeline_parallel, "kv_tokens_per_replica": p.kv_tokens,
         "max_concurrency": round(p.max_concurrency, 2), "startup_lines": p.startup_lines(),
         "command": p.command(name), "plan": p.to_dict()}
    if as_json:
        out.write(json.dumps(d, indent=2) + "\n")
        return 0
    out.write(f"{arch.name} on {s.gpu} with {p.engine} {p.version}: {concurrency} requests of "
              f"{s.context_len:,} tokens at once\n")
    out.write(f"  fewest GPUs: {p.num_gpus} (tensor parallel {p.tensor_parallel}, pipeline parallel "
              f"{p.pipeline_parallel})\n")
    out.write(f"  per GPU: weights {p.weights_bytes / GIB:.2f} GiB, profile activations "
              f"{p.activation_bytes / GIB:.2f} GiB, non-torch {p.non_torch_bytes / GIB:.2f} GiB, KV cache "
              f"{p.kv_budget_bytes / GIB:.2f} GiB; CUDA graphs {p.cuda_graph_bytes / GIB:.2f} GiB on top\n")
    out.write("  the engine will print:\n")
    for line in p.startup_lines():
        out.write(f"    {line}\n")
    out.write(f"  command: {p.command(name)}\n")
    return 0


def format_table(est: InferenceEstimate, longest: Optional[int] = None) -> str:
    """An inference estimate as the text the CLI prints."""
    s = est.setup
    lines = [f"{est.model_name}: inference, weights {s['weights']}, KV cache {s['kv_cache_dtype']}, "
             f"batch {s['batch_size']} x {s['context_len']} tokens (prompt {s['prompt_len']}), "
             f"{s['attn_implementation']}"]
    lines.append(f"  assumes: {est.assumes}")
    lines.append(f"  KV cache: {est.kv_bytes_per_token:,.0f} B per token (all layers); "
                 f"{est.kv_cache_bytes / GIB:.3f} GiB")
    for ph, v in est.phases_bytes.items():
        mark = "  <- peak" if ph == est.peak_phase else ""
        lines.append(f"  {ph:<12} {v / GIB:10.3f} GiB{mark}")
    lines.append(f"  components at the peak ({est.peak_phase}):")
    for c in est.components:
        lines.append(f"    {c.name:<24} {c.bytes / GIB:10.3f} GiB")
    lines.append(f"  device total (reserve + CUDA context): {est.device_total_gib:.3f} GiB")
    if est.serving:
        v = est.serving
        lines.append(f"  {v['engine']} {v['version']} ({v['runtime']}) on {v['num_gpus']} x {est.gpu}: tensor parallel "
                     f"{v['tensor_parallel']}, pipeline parallel {v['pipeline_parallel']}; per GPU: weights "
                     f"{v['weights_bytes'] / GIB:.2f} GiB, profile activations {v['activation_peak_bytes'] / GIB:.2f} "
                     f"GiB ({v['profile_tokens']} tokens), non-torch {v['non_torch_bytes'] / GIB:.2f} GiB, CUDA "
                     f"graphs {v['cuda_graph_bytes'] / GIB:.2f} GiB")
        lines.append("  the engine prints:")
        for line in v["startup_lines"]:
            lines.append(f"    {line}")
        lines.append(f"  serving on {est.gpu} at {v['gpu_memory_utilization']:g}: KV budget "
                     f"{v['kv_budget_bytes'] / GIB:.2f} GiB = {v['kv_tokens']:,} tokens ({v['kv_blocks']:,} blocks), "
                     f"{v['max_concurrent_sequences']} sequences of {v['context_len']} tokens "
                     f"(running at once: {v['running_sequences']})")
    elif est.gpu:
        room = est.gpu_usable_bytes - est.device_total_bytes
        state = ("fits, tight (only by the allocator freeing its cached blocks at the limit)" if est.fits and est.squeezed
                 else "fits" if est.fits else "does NOT fit")
        lines.append(f"  {est.gpu}: {state}: device total "
                     f"{est.device_total_bytes / GIB:.2f} GiB of {est.gpu_usable_bytes / GIB:.2f} GiB CUDA total "
                     f"({abs(room) / GIB:.2f} GiB {'to spare' if room >= 0 else 'over'}, "
                     f"{abs(room) / est.gpu_usable_bytes * 100:.0f}%)")
    if est.gpu and not est.serving and est.allocator_note:
        lines.append(f"  allocator: {est.allocator_note}")
    if longest is not None:
        lines.append(f"  longest context that fits: {longest:,} tokens")
    for n in est.notes:
        lines.append(f"  note: {n}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``vramwidget infer MODEL [options]`` as a standalone entry point."""
    parser = argparse.ArgumentParser(prog="vramwidget infer",
                                     description="GPU memory of running MODEL for inference.")
    add_arguments(parser)
    try:
        args = parser.parse_args(list(argv) if argv is not None else None)
        return run(args)
    except VramError as e:
        sys.stderr.write(f"vramwidget: error: {e}\n")
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
