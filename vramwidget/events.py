"""One training run as the caching allocator sees it: every allocation and free, in order.

The estimate knows every tensor of a step (``estimate.param_storage`` for weights, gradients and
optimizer states, the block trace of ``activations.py`` for what the forward creates and
keeps).  This module lays those tensors out in time the way a transformers + PyTorch run
allocates them, so ``allocator.replay`` can say what the caching allocator reserves:

load        parameters one by one in module order (a tied head is made, then replaced by the
            embedding); 4-bit layers load their 16-bit weight, quantize it, drop it; LoRA
            adapters (fp32); ``prepare_model_for_kbit_training`` upcasts the other parameters
forward     the embedding output; per block, each tensor the trace creates, freed after its
            consumer unless autograd saves it (checkpointing keeps only the block's input);
            the final norm, the logits, the loss's fp32 upcast and log_softmax
backward    the loss gradients (three fp32 T x V), the head's gradients; per block in reverse
            (recomputed first under checkpointing): the input gradient of each op, the
            parameter gradients where the op used parameters, saved tensors freed as passed
optimizer   step 1 creates the states lazily; foreach AdamW's ``_foreach_sqrt`` list of
            temporaries; Adafactor's per-parameter fp32 working copies
zero_grad   ``set_to_none=True`` frees every gradient

Three steps, as the measurements run them (validation/README.md).  Sizes are the
estimate's own; the order is the one PyTorch's autograd and transformers' modules use.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from .activations import attention_backend
from .architecture import Architecture
from .allocator import DEFAULT_RESERVED_PER_ALLOCATED, parse_alloc_conf, replay
from .estimate import ALLOCATOR_REPLAY, CUBLAS_WORKSPACE_BYTES
from .plan.params import BNB_8BIT_MIN_SIZE, BNB_8BIT_OPT_BLOCK, param_storage, state_dtypes
from .plan.profile import block_profile, poly, residual_dtype, full_checkpointing, layer_key, logits_dtype, size_terms
from .stacks import behaviour
from .training import TrainingSetup
from .units import DTYPE_BYTES

Event = Tuple[str, Any, float, str]

#: transformers' loader (core_model_loading.convert_and_load_state_dict_in_model) materializes
#: checkpoint tensors on the GPU on GLOBAL_WORKERS = 4 threads while the main thread converts
#: them one by one; with on-the-fly (bitsandbytes) quantization, up to this many 16-bit tensors
#: wait beside the one being quantized.  transformers PR #44576 made quantized loading
#: synchronous (0 here); the measured cases (transformers 5.17) load asynchronously.
ASYNC_LOAD_WORKERS = 4
#: cuBLAS keeps two workspaces (cuBLAS and cuBLASLt), each its own 32 MiB allocation
CUBLAS_WORKSPACES = 2


_RAW_SIZES = threading.local()


class _Stream:
    """An event list with keys handed out in order."""

    def __init__(self) -> None:
        self.events: List[Event] = []
        self._n = 0
        if getattr(_RAW_SIZES, "on", False):     # stream_template's probes: sizes before int()
            self.alloc = self._alloc_raw          # type: ignore[method-assign]

    def _alloc_raw(self, nbytes: float, label: Any) -> Optional[int]:
        if nbytes <= 0:      # kept as a marker: at another size this may be an allocation
            self.events.append(("skip", None, nbytes, label))
            return None
        self._n += 1
        self.events.append(("alloc", self._n, nbytes, label))
        return self._n

    def alloc(self, nbytes: float, label: Any) -> Optional[int]:
        if nbytes <= 0:
            return None
        self._n += 1
        self.events.append(("alloc", self._n, int(nbytes), label))
        return self._n

    def free(self, key: Optional[int]) -> None:
        if key is not None:
            self.events.append(("free", key, 0.0, ""))


def _instances(arch: Architecture, P: Any) -> Tuple[List[Tuple[Any, ...]], List[Tuple[Any, ...]],
                                                    List[List[Tuple[Any, ...]]]]:
    """Parameters as the model constructs them: (before the blocks, after, per block), each
    an instance (tensor, dtype, bytes of one instance, trains, numel of one instance)."""
    before: List[Tuple[Any, ...]] = []
    after: List[Tuple[Any, ...]] = []
    per_layer: List[List[Tuple[Any, ...]]] = [[] for _ in range(arch.num_layers)]
    seen_layer = False
    for t, dtype, nbytes, trains in P.weights:
        if t.layers is None:
            # outside the decoder's blocks; a side tower's blocks (a VLM's vision encoder) repeat
            # one tensor per block: each block's is its own parameter
            for _ in range(max(t.repeat, 1)):
                (after if seen_layer else before).append((t, dtype, nbytes / t.repeat, trains, t.numel_each))
            continue
        seen_layer = True
        first, last = t.layers
        # a tensor restricted to a layer range (freeze) covers [first, first + repeat - 1]
        n_layers = last - first + 1
        per = t.repeat // max(n_layers, 1) if t.repeat >= n_layers else 1
        for layer in range(first, min(first + t.repeat // max(per, 1), arch.num_layers)):
            per_layer[layer].append((t, dtype, nbytes / t.repeat * per, trains, t.numel_each * per))
    return before, after, per_layer


def training_events(arch: Architecture, s: TrainingSetup, steps: int = 3) -> List[Event]:
    """The allocations and frees of loading the model and running ``steps`` training steps."""
    P = param_storage(arch, s)
    prof = block_profile(arch, s, P)
    st = _Stream()
    gc = full_checkpointing(s)
    b, sq = s.batch_size, s.seq_len
    T = b * sq
    # the size terms the block profile's coefficients multiply (an encoder-decoder's include
    # its target length: estimate.size_terms)
    M = size_terms(prof, b, sq, s.target_len)
    # the output head's and the loss's tokens: an encoder-decoder's decoder reads b x target_len
    Th = b * s.dec_len
    h, V = arch.hidden_size, arch.vocab_size
    c = s.compute_dtype
    L = arch.num_layers

    for _ in range(CUBLAS_WORKSPACES):          # left from an earlier matmul of the process
        st.alloc(CUBLAS_WORKSPACE_BYTES / CUBLAS_WORKSPACES, "cuBLAS workspace")

    # -- load ------------------------------------------------------------------------------
    before, after, per_layer = _instances(arch, P)
    consts = {t.name: nbytes / t.repeat for t, nbytes, _ in P.quant_consts}
    weight_keys: Dict[Tuple[str, int], Optional[int]] = {}
    base16 = "bfloat16" if c == "float32" else c

    pending: List[Tuple[Any, ...]] = []     # checkpoint tensors materialized, not yet converted

    def convert(item: Tuple[Any, ...]) -> None:
        inst, layer, tmp = item
        t, dtype, nbytes, trains, numel = inst
        if dtype in ("nf4", "fp4", "int8"):
            # bitsandbytes quantizes the 16-bit tensor on the GPU, then it is dropped
            weight_keys[(t.name, layer)] = st.alloc(nbytes, t.name)
            st.alloc(consts.get(t.name, 0.0), (t.name, "quantization constants"))
            st.free(tmp)
        elif s.quantized and s.prepare_kbit and dtype == "float32":
            weight_keys[(t.name, layer)] = None
            weight_keys[(t.name, layer, "tmp")] = tmp  # type: ignore[index]
        else:
            weight_keys[(t.name, layer)] = tmp

    def load_param(inst: Tuple[Any, ...], layer: int) -> None:
        t, dtype, nbytes, trains, numel = inst
        if not s.quantized:
            # built on the GPU in its dtype (from_config under torch.device)
            weight_keys[(t.name, layer)] = st.alloc(nbytes, t.name)
            return
        # from_pretrained with on-the-fly quantization: the 16-bit checkpoint tensor first
        size = numel * DTYPE_BYTES[base16] if dtype in ("nf4", "fp4", "int8", "float32") else nbytes
        pending.append((inst, layer, st.alloc(size, (t.name, "(checkpoint tensor)"))))
        if len(pending) > ASYNC_LOAD_WORKERS:
            convert(pending.pop(0))

    # outside the blocks each instance gets its own negative index (a tower repeats a tensor)
    for i, inst in enumerate(before):
        load_param(inst, -1 - i)
    for layer in range(L):
        for inst in per_layer[layer]:
            load_param(inst, layer)
    for i, inst in enumerate(after):
        load_param(inst, -1 - len(before) - i)
    while pending:
        convert(pending.pop(0))
    if arch.tie_word_embeddings:
        # the head is built with its own weight, then tied to the embedding (the copy is dropped)
        head = st.alloc(V * h * DTYPE_BYTES[base16 if s.quantized else s.weights_dtype], "lm_head (before tying)")
        st.free(head)
    if s.quantized and s.prepare_kbit:
        # prepare_model_for_kbit_training: every non-quantized parameter becomes fp32
        for key in [k for k in weight_keys if len(k) == 3]:
            name, layer = key[0], key[1]
            numel = next(i[4] for i in before + after + sum(per_layer, []) if i[0].name == name)
            weight_keys[(name, layer)] = st.alloc(numel * 4, name + " (fp32)")
            st.free(weight_keys.pop(key))
    adapters: Dict[Tuple[str, int], List[float]] = {}
    if P.adapters:
        for module, group, nbytes, numel in P.adapters:
            # a module name can repeat across groups (GPT-2's attn.c_proj and mlp.c_proj): the
            # group tells them apart
            targets = arch.lora_tensors(P.lora_modules)
            t = next((x for x in targets if x.module == module and x.group == group),
                     next((x for x in targets if x.module == module), None))
            if t is None:
                # not a block module's A/B pair: DoRA magnitudes, LoRA on lm_head/embed_tokens
                st.alloc(nbytes, (module, "adapter"))
                continue
            for layer in range(t.layers[0] if t.layers else 0, (t.layers[1] + 1) if t.layers else 1):
                a = s.lora_r * t.in_features * 4
                bb = s.lora_r * t.out_features * 4
                st.alloc(a, (module, "lora_A"))
                st.alloc(bb, (module, "lora_B"))
                adapters.setdefault((module, layer), []).extend([a, bb])

    # what trains, per block: module -> gradient bytes of each parameter instance
    def trainable(inst_list: List[Tuple[Any, ...]]) -> List[Tuple[Any, ...]]:
        out = []
        for t, dtype, nbytes, trains, numel in inst_list:
            if trains:
                out.append((t.module, numel * DTYPE_BYTES[dtype], dtype, numel, t.shape))
        return out

    layer_params: List[List[Tuple[Any, ...]]] = []
    for layer in range(L):
        lst = trainable(per_layer[layer])
        for (module, lyr), sizes in adapters.items():
            if lyr == layer:
                for nb in sizes:
                    lst.append((module, nb, P.adapter_dtype, int(nb // 4), (s.lora_r, int(nb // 4) // s.lora_r)))
        layer_params.append(lst)
    head_params = trainable(after)
    embed_params = trainable(before)
    # parameters in model.parameters() order: the optimizer's state and foreach order
    ordered = embed_params + [p for lp in layer_params for p in lp] + head_params

    # -- the block's forward, at this size ---------------------------------------------------
    def block_ops(src: List[Tuple[Any, ...]]) -> List[Tuple[Any, ...]]:
        out = []
        for op in src:
            if op[0] != "new":
                out.append(op)
            else:
                _, name, dtype, rg, saved, coef, outlives, by_producer, cn, *stream = op
                out.append(("new", name, DTYPE_BYTES[dtype] * poly(cn, coef, M), rg, saved, outlives,
                            by_producer, stream[0] if stream else ""))
        return out

    first_train = L - s.trainable_layers if s.method == "freeze" else 0
    first_ops = block_ops(prof.alloc_ops[1])
    # each layer runs its own kind's block (a mixed stack's kinds, leading dense layers;
    # estimate.layer_key), the first trained one its traced first block
    by_key = {k: block_ops(ops) for k, ops in prof.kind_alloc_ops.items()}
    steady = block_ops(prof.alloc_ops[0])
    order = arch.family.layer_order(arch) if by_key else None
    layer_ops = [first_ops if layer == first_train else by_key.get(layer_key(arch, order, layer), steady)
                 for layer in range(L)]
    resid_bytes = T * h * DTYPE_BYTES[residual_dtype(s)]
    # each layer's residual stream: an encoder-decoder's decoder layers carry the b x target_len
    # tokens (estimate.kind_context), the others b x s
    kinds_order = arch.family.layer_order(arch) if s.target_len is not None else None
    layer_resid = [Th * h * DTYPE_BYTES[residual_dtype(s)] if kinds_order and layer < len(kinds_order)
                   and kinds_order[layer] in arch.family.target_kinds else resid_bytes for layer in range(L)]
    backend = attention_backend(arch, s, c)

    def forward_block(ops: List[Tuple[Any, ...]], x_key: Optional[int], keep_saved: bool,
                      label: Tuple[Any, ...]) -> Tuple[Optional[int], List[int]]:
        """Allocate one block's tensors; returns the block output's key and the kept keys."""
        saved: List[int] = []
        # transients, each freed once the tensors it outlives exist (normally the next one:
        # its consumer's output): [key, tensors still to come]
        pending: List[List[Any]] = []
        resid = x_key                     # the residual stream lives until the next add
        out_key: Optional[int] = None
        for op in ops[1:]:                # ops[0] is the block input (the previous output)
            if op[0] != "new":
                continue
            _, name, nbytes, rg, is_saved, outlives, _by_producer, stream = op
            key = st.alloc(nbytes, label + (name,))
            for p in pending:
                p[1] -= 1
                if p[1] <= 0:
                    st.free(p[0])
            pending = [p for p in pending if p[1] > 0]
            if stream:
                # the residual stream lives until the next residual add; a norm may save it
                if resid is not None and resid != x_key and resid not in saved:
                    st.free(resid)
                resid = key
                if stream == "out":
                    out_key = key
                elif is_saved and keep_saved and key is not None:
                    saved.append(key)
                continue
            if is_saved and keep_saved:
                if key is not None:
                    saved.append(key)
            elif key is not None:
                pending.append([key, outlives])
        for p in pending:
            st.free(p[0])
        return out_key, saved

    def backward_block(ops: List[Tuple[Any, ...]], grad_key: Optional[int], saved: List[int], layer: int,
                       label: Tuple[Any, ...], grads: Dict[Tuple[str, int], List[int]]) -> Optional[int]:
        """Walk one block's ops in reverse: each op makes its input's gradient and frees its
        output's; parameter gradients appear where their op ran; saved tensors go as passed."""
        params: Dict[str, List[Tuple[Any, ...]]] = {}
        for entry in layer_params[layer]:
            params.setdefault(entry[0], []).append(entry)
        saved_iter = list(saved)
        g = grad_key
        deferred: List[int] = []          # kept by the node that made them: freed after its backward
        for op in reversed(ops[1:]):
            if op[0] == "param":
                for entry in params.pop(op[1], []):
                    grad_ready(("layer", layer), st.alloc(entry[1], label + (op[1], "grad")), entry)
                continue
            if op[0] != "new":
                continue
            _, name, nbytes, rg, is_saved, _outlives, by_producer, _stream = op
            # the consumer of this tensor runs: it makes the tensor's gradient, then autograd
            # releases what the node saved, then the consumer's own incoming gradient goes
            if name.endswith("dequantized weight"):
                # MatMul4Bit.backward dequantizes again for the input gradient
                st.free(st.alloc(nbytes, label + (name,)))
                continue
            ng = st.alloc(nbytes, label + ("grad of", name)) if rg else None
            if rg and deferred:
                # this gradient is the producer's backward output: the producer's saves go now
                for k in deferred:
                    st.free(k)
                deferred = []
            if is_saved and saved_iter:
                if by_producer:
                    deferred.append(saved_iter.pop())
                else:
                    st.free(saved_iter.pop())
            if rg:
                st.free(g)
                g = ng
        for rest in params.values():      # parameters no op of the trace named (biases...)
            for entry in rest:
                grad_ready(("layer", layer), st.alloc(entry[1], label + ("grad",)), entry)
        for k in saved_iter + deferred:
            st.free(k)
        # the block input's gradient, the size of the residual stream
        ng = st.alloc(layer_resid[layer], label + ("grad of block input",))
        st.free(g)
        return ng

    lg_dtype = logits_dtype(arch, s)
    lg_bytes = Th * V * DTYPE_BYTES[lg_dtype]
    # the cross-entropy's dtype: fp32 where the loss upcasts (transformers' ForCausalLMLoss),
    # else the logits' own (T5ForConditionalGeneration's CrossEntropyLoss; estimate.loss_memory)
    upcast = bool(behaviour(s.stack)["loss_upcast"]) and arch.family.loss_upcast
    fp32_TV = Th * V * 4.0 if upcast else lg_bytes
    head_trains = bool(head_params) or (s.method == "full")
    states_made = False
    cast_bytes = {}   # autocast's 16-bit weight copies, per layer (made in forward, kept for backward)
    cached = {}       # per layer: whether autocast's cache keeps them to the end of the forward pass
    if s.autocast:
        for layer in range(L):
            cast_bytes[layer] = [n * DTYPE_BYTES[c] for t, dt, nb, tr, n in per_layer[layer]
                                 if t.linear and not t.is_bias and dt == "float32"]
            # aten/src/ATen/autocast_mode.cpp cached_cast: only leaves that require grad are cached
            cached[layer] = any(tr for t, dt, nb, tr, n in per_layer[layer]
                                if t.linear and not t.is_bias and dt == "float32")
        cast_bytes[-1] = [n * DTYPE_BYTES[c] for t, dt, nb, tr, n in before + after
                          if (t.role == "output_head" or (t.role == "embedding" and arch.tie_word_embeddings))
                          and dt == "float32"]

    grads: Dict[Tuple[str, int], List[int]] = {}   # this step's gradients, per bucket

    def grad_ready(bucket: Tuple[str, int], key: Optional[int], entry: Tuple[Any, ...]) -> None:
        """A parameter's gradient is accumulated.  With the optimizer in backward (torchtune's
        register_optim_in_bwd_hooks, training/memory.py) its own optimizer steps in the
        post-accumulate-grad hook (making its states on the first step) and zero_grad frees
        the gradient at once; otherwise it waits for step()."""
        if not s.optimizer_in_backward:
            grads.setdefault(bucket, []).append(key)   # type: ignore[arg-type]
            return
        if not states_made:
            _optimizer_states(st, s, [entry])
        _optimizer_step(st, s, [entry])
        st.free(key)

    ids = st.alloc(T * 8, "input_ids")
    # an encoder-decoder with its own target length: the labels are a tensor of their own
    labels = st.alloc(Th * 8, "labels") if s.target_len is not None else None
    for step in range(1, steps + 1):
        # -- forward ----------------------------------------------------------------------
        x = st.alloc(resid_bytes, "embedding output")
        mask = st.alloc(b * sq * sq * DTYPE_BYTES[c], "causal mask (eager)") if backend == "eager" else None
        keep: List[Tuple[Optional[int], List[int], List[int]]] = []   # per block: input, saved, casts
        autocast_cache: List[int] = []    # casts of trainable weights under checkpointing: freed on autocast exit
        for layer in range(L):
            ops = layer_ops[layer]
            casts = [k for k in (st.alloc(nb, ("layer", layer, "weight cast")) for nb in cast_bytes.get(layer, []))
                     if k is not None]
            if gc:
                out, saved = forward_block(ops, x, False, ("layer", layer))
                if cached.get(layer):
                    autocast_cache.extend(casts)
                else:
                    for k in casts:
                        st.free(k)
                casts = []
            else:
                out, saved = forward_block(ops, x, layer >= first_train, ("layer", layer))
            if layer < first_train:
                # a frozen layer below the trained ones (freeze) runs outside autograd's graph: it
                # saves nothing, its input goes once it has run, and autocast's copies of its
                # weights are not cached (only leaves that require grad are: autocast_mode.cpp)
                keep.append((None, [], []))
                for k in casts + ([x] if x is not None else []):
                    st.free(k)
            elif gc:
                keep.append((x, [], casts))
            else:
                # the block input is saved by the first norm (when it needs no cast) or freed
                keep.append((None, saved, casts))
                if x is not None and not _input_saved(ops):
                    st.free(x)
                elif x is not None:
                    keep[-1] = (x, saved, casts)
            x = out
        # final norm, head, loss
        final_in = x
        head_casts = [st.alloc(nb, "head weight cast") for nb in cast_bytes.get(-1, [])]
        normed = st.alloc(Th * h * DTYPE_BYTES[c] * (2 if DTYPE_BYTES[residual_dtype(s)] > DTYPE_BYTES[c] else 1),
                          "final norm output")
        logits = st.alloc(lg_bytes, "logits")
        tanh = None
        if arch.final_logit_softcapping:
            # final logit soft-capping (Gemma 2, modeling_gemma2.py Gemma2ForCausalLM.forward):
            # logits / cap, tanh (autograd saves tanh's output for its backward), * cap
            scaled = st.alloc(lg_bytes, "logits / final_logit_softcapping")
            st.free(logits)
            tanh = st.alloc(lg_bytes, "soft-capped logits tanh (saved)")
            st.free(scaled)
            logits = st.alloc(lg_bytes, "soft-capped logits")
        up = st.alloc(fp32_TV, "logits upcast to fp32") if upcast and lg_dtype != "float32" else None
        logsm = st.alloc(fp32_TV, "log_softmax output (fp32)" if upcast else "log_softmax output")
        st.free(up)
        st.free(mask)
        for k in autocast_cache:   # leaving torch.autocast clears its cache (autocast_mode.cpp clear_cache)
            st.free(k)
        # -- backward: loss and head --------------------------------------------------------
        st.free(logits)            # del out: the logits are not saved (the head saves its input)
        g_nll = st.alloc(fp32_TV, "nll_loss gradient (fp32)" if upcast else "nll_loss gradient")
        g_ls = st.alloc(fp32_TV, "log_softmax gradient (fp32)" if upcast else "log_softmax gradient")
        st.free(logsm)
        st.free(g_nll)
        g_lg = st.alloc(lg_bytes, "logits gradient") if upcast and lg_dtype != "float32" else g_ls
        if g_lg is not g_ls:
            st.free(g_ls)
        if tanh is not None:
            # back through * cap, tanh (1 - y^2, then its saved output goes) and / cap
            g1 = st.alloc(lg_bytes, "gradient of the tanh output")
            st.free(g_lg)
            g2 = st.alloc(lg_bytes, "gradient of the tanh input")
            st.free(g1)
            st.free(tanh)
            g_lg = st.alloc(lg_bytes, "gradient of the head's logits")
            st.free(g2)
        grads.clear()
        tied_key: Optional[int] = None    # the tied head's gradient, waiting for the embedding's
        if head_trains:
            for entry in head_params:
                grad_ready(("head", 0), st.alloc(entry[1], (entry[0], "grad")), entry)
            if arch.tie_word_embeddings and s.method == "full":
                tied_key = st.alloc(V * h * DTYPE_BYTES[s.weights_dtype], "lm_head grad (tied to the embedding)")
        g = st.alloc(Th * h * DTYPE_BYTES[c], "head input gradient")
        st.free(g_lg)
        st.free(normed)
        for k in head_casts:
            st.free(k)
        g2 = st.alloc(Th * h * DTYPE_BYTES[residual_dtype(s)], "final norm input gradient")
        st.free(g)
        st.free(final_in)
        g = g2
        for layer in reversed(range(first_train, L)):
            xin, saved, casts = keep[layer]
            ops = layer_ops[layer]
            if gc:
                # non-reentrant checkpointing: the block's forward runs again, keeping its saves
                recasts = [st.alloc(nb, ("layer", layer, "weight cast (recompute)")) for nb in cast_bytes.get(layer, [])]
                out, saved = forward_block(ops, xin, True, ("layer", layer, "(recomputed)"))
                st.free(out)      # the recomputed block's output is not needed again
                casts = recasts
            g = backward_block(ops, g, saved, layer, ("layer", layer), grads)
            for k in casts:
                st.free(k)
            if xin is not None:
                st.free(xin)
        if embed_params:
            for entry in embed_params:
                module, nb = entry[0], entry[1]
                if arch.tie_word_embeddings and s.method == "full":
                    tmp = st.alloc(nb, "embedding gradient (accumulated into the tied head's)")
                    st.free(tmp)
                    grad_ready(("embed", 0), tied_key, entry)
                    tied_key = None
                else:
                    grad_ready(("embed", 0), st.alloc(nb, (module, "grad")), entry)
        if tied_key is not None:
            grads.setdefault(("head", 0), []).append(tied_key)
        st.free(g)
        # -- optimizer ------------------------------------------------------------------------
        if not s.optimizer_in_backward:
            if not states_made:
                _optimizer_states(st, s, ordered)
            _optimizer_step(st, s, ordered)
        states_made = True
        for keys in grads.values():
            for k in keys:
                st.free(k)
        st.events.append(("step_end", step, 0.0, ""))
    st.free(ids)
    st.free(labels)
    return st.events


def modelled(s: TrainingSetup) -> bool:
    """Whether the event stream lays out this setup's step as it runs: transformers' loss on
    full logits, no activation offloading, no optimizer in backward, one micro-batch per step,
    transformers + PEFT (the stack the measurements used), no torch.compile."""
    return (getattr(s, "loss", "standard") == "standard" and not getattr(s, "activation_offloading", False)
            and not getattr(s, "optimizer_in_backward", False) and getattr(s, "stack", "hf") == "hf"
            and s.grad_accum_steps == 1 and not getattr(s, "compile", False) and s.precision != "fp8")


def _input_saved(ops: List[Tuple[Any, ...]]) -> bool:
    return bool(ops) and ops[0][0] == "new" and ops[0][4]


def _optimizer_states(st: _Stream, s: TrainingSetup, ordered: List[Tuple[Any, ...]]) -> None:
    """States created on the first ``step()``, parameter by parameter (``_init_group``)."""
    opt = s.optimizer
    for module, nb, dtype, numel, shape in ordered:
        if opt in ("adamw_8bit", "paged_adamw_8bit"):
            if numel < BNB_8BIT_MIN_SIZE:
                st.alloc(numel * 4, (module, "state1 (fp32)"))
                st.alloc(numel * 4, (module, "state2 (fp32)"))
            else:
                blocks = -(-numel // BNB_8BIT_OPT_BLOCK)
                st.alloc(numel, (module, "state1 (8-bit)"))
                st.alloc(numel, (module, "state2 (8-bit)"))
                st.alloc(blocks * 4, (module, "absmax1"))
                st.alloc(blocks * 4, (module, "absmax2"))
        elif opt == "adafactor":
            if len(shape) >= 2:   # factored: one fp32 value per row and per column
                st.alloc(numel // shape[-1] * 4, (module, "exp_avg_sq_row (fp32)"))
                st.alloc(numel // shape[-2] * 4, (module, "exp_avg_sq_col (fp32)"))
            else:
                st.alloc(numel * 4, (module, "exp_avg_sq (fp32)"))
        else:
            for sd in state_dtypes(s, dtype):
                st.alloc(numel * DTYPE_BYTES[sd], f"{module} state ({sd})")


def _optimizer_step(st: _Stream, s: TrainingSetup, ordered: List[Tuple[Any, ...]]) -> None:
    """The temporaries of one ``step()``."""
    opt = s.optimizer
    if opt == "adamw":
        # torch.optim.adamw._multi_tensor_adamw: exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)
        keys = [st.alloc(numel * DTYPE_BYTES[state_dtypes(s, dtype)[1]], (module, "sqrt(exp_avg_sq)"))
                for module, nb, dtype, numel, _shape in ordered]
        for k in keys:
            st.free(k)
    elif opt == "adafactor":
        # transformers' Adafactor.step: fp32 copies of grad and parameter, the update, per parameter
        for module, nb, dtype, numel, _shape in ordered:
            keys = []
            if DTYPE_BYTES[dtype] < 4:
                keys.append(st.alloc(numel * 4, (module, "grad as fp32")))
                keys.append(st.alloc(numel * 4, (module, "parameter as fp32")))
            keys.append(st.alloc(numel * 4, (module, "update")))
            keys.append(st.alloc(numel * 4, (module, "update (normalised)")))
            for k in keys:
                st.free(k)


# ----------------------------------------------------------------------------------
# The replay behind Estimate.reserved_bytes
# ----------------------------------------------------------------------------------

#: (id(arch), setup) -> (arch, ReplayResult): the replays run so far (default settings, no
#: capacity, no recording).  The arch is kept beside its id so a recycled id never matches.
_REPLAYS: Dict[Tuple[Any, ...], Tuple[Architecture, Any]] = {}
#: (id(arch), the setup without batch_size and seq_len) -> (arch, {(batch, seq): ReplayResult}):
#: the same replays indexed by size, for :func:`provisional_reserved_bytes`
_BY_SHAPE: Dict[Tuple[Any, ...], Tuple[Architecture, Dict[Tuple[int, int], Any]]] = {}
#: replays being computed now (key -> Event): a second thread asking for the same setup waits
#: for the first one's result instead of replaying it again
_INFLIGHT: Dict[Tuple[Any, ...], threading.Event] = {}
_LOCK = threading.Lock()
_MAX_CACHED = 8192
_SIZE_FIELDS = ("batch_size", "seq_len")
_SHAPE_FIELDS = tuple(f.name for f in dataclasses.fields(TrainingSetup) if f.name not in _SIZE_FIELDS)



def clear_caches() -> None:
    """Forget every cached replay and stream template (benchmarks time cold setups), the
    replays with a card's capacity (``gpus.judge_on``) included."""
    from . import gpus

    with _LOCK:
        _REPLAYS.clear()
        _BY_SHAPE.clear()
        _BY_STREAM.clear()
        _TEMPLATES.clear()
        _SEEN.clear()
        gpus._CAPACITY_REPLAYS.clear()


def _shape_key(arch: Architecture, s: TrainingSetup) -> Tuple[Any, ...]:
    return (id(arch),) + tuple(getattr(s, f) for f in _SHAPE_FIELDS)


def cached_replay(arch: Architecture, s: TrainingSetup) -> Optional[Any]:
    """The replay of ``s`` (``allocator.ReplayResult``) when one was already run and cached,
    else None.  Never runs a replay."""
    hit = _REPLAYS.get((id(arch), s))
    return hit[1] if hit is not None and hit[0] is arch else None


def _store(arch: Architecture, s: TrainingSetup, res: Any) -> None:
    with _LOCK:
        if len(_REPLAYS) >= _MAX_CACHED:
            _REPLAYS.clear()
            _BY_SHAPE.clear()
            _BY_STREAM.clear()
        _REPLAYS[(id(arch), s)] = (arch, res)
        sk = _shape_key(arch, s)
        hit = _BY_SHAPE.get(sk)
        if hit is None or hit[0] is not arch:
            hit = _BY_SHAPE[sk] = (arch, {})
        hit[1][(s.batch_size, s.seq_len)] = res


def _nearest_index(arch: Architecture, s: TrainingSetup, b: Any, sq: Any) -> Tuple[List[Tuple[int, int]], List[Any], Any]:
    """The cached replays of ``s``'s setup (every field but the sizes equal): their sizes,
    their results, and for each (b, sq) of two arrays the index of the nearest one in
    |log b - log b'| + |log s - log s'| (the first of equals); empty lists when none."""
    import numpy as np

    hit = _BY_SHAPE.get(_shape_key(arch, s))
    if hit is None or hit[0] is not arch or not hit[1]:
        return [], [], None
    items = list(hit[1].items())
    sizes = [k for k, _ in items]
    lb = np.log(np.asarray([k[0] for k in sizes], dtype=float))
    ls = np.log(np.asarray([k[1] for k in sizes], dtype=float))
    qb = np.log(np.asarray(b, dtype=float)).reshape(-1, 1)
    qs = np.log(np.asarray(sq, dtype=float)).reshape(-1, 1)
    return sizes, [r for _, r in items], np.argmin(np.abs(qb - lb) + np.abs(qs - ls), axis=1)


def nearest_cached_replay(arch: Architecture, s: TrainingSetup) -> Optional[Tuple[Tuple[int, int], Any]]:
    """((batch, seq), ReplayResult) of the cached replay of the same setup (every field but
    ``batch_size`` and ``seq_len`` equal) nearest to ``s`` in |log b - log b'| + |log s - log s'|,
    or None.  Never runs a replay."""
    sizes, results, idx = _nearest_index(arch, s, [s.batch_size], [s.seq_len])
    if not sizes:
        return None
    return sizes[int(idx[0])], results[int(idx[0])]


def reserved_per_allocated(res: Any) -> float:
    """A replay's fragmentation as a ratio: ``max_reserved_bytes / max_allocated_bytes`` (>= 1)."""
    return max(1.0, float(res.max_reserved_bytes) / float(res.max_allocated_bytes)) if res.max_allocated_bytes else 1.0


def carried_ratios(arch: Architecture, s: TrainingSetup, b: Any, sq: Any) -> Any:
    """For each (batch, seq) of two arrays, the reserved / allocated ratio that
    :func:`provisional_reserved_bytes` carries over: the nearest cached replay's of the same
    setup, else :data:`DEFAULT_RESERVED_PER_ALLOCATED` (a numpy array)."""
    import numpy as np

    sizes, results, idx = _nearest_index(arch, s, b, sq)
    if not sizes:
        return np.full(np.shape(np.asarray(b)) or (1,), DEFAULT_RESERVED_PER_ALLOCATED, dtype=float).reshape(-1)
    return np.asarray([reserved_per_allocated(r) for r in results], dtype=float)[idx]


def provisional_reserved_bytes(arch: Architecture, s: TrainingSetup, peak_bytes: float) -> Tuple[float, bool]:
    """Reserved memory without running a replay: ``(bytes, exact)``.

    * the replay of ``s`` is cached: ``(reserved_bytes(arch, s, peak), True)``, the exact value;
    * else a replay of the same setup at another batch / sequence length is cached: the
      nearest one's fragmentation carried over as a ratio,
      ``peak_bytes x max(1, max_reserved / max_allocated of that replay)``, False;
    * else ``peak_bytes x DEFAULT_RESERVED_PER_ALLOCATED`` (1.0812, the validation set's
      median ratio), False.

    The one place where an unreplayed setup's reserve is guessed (the widget's first frame,
    ``Estimate.provisional_device_total_bytes``, the cells of ``fit_map`` it does not replay,
    which call :func:`carried_ratios` for the whole grid at once).
    """
    if cached_replay(arch, s) is not None:
        return reserved_bytes(arch, s, peak_bytes), True
    ratio = float(carried_ratios(arch, s, [s.batch_size], [s.seq_len])[0])
    return float(peak_bytes) * ratio, False


# ----------------------------------------------------------------------------------
# Event-stream templates: one stream per setup, instantiated at any (batch, seq)
# ----------------------------------------------------------------------------------

#: the (batch, seq) sizes a template is solved from: T = b x s and T2 = b x s^2 at these are
#: (128, 8192), (256, 16384), (256, 32768), so the solve divides by powers of two only (exact)
_PROBES = ((2, 64), (4, 64), (2, 128))
#: sizes are instantiated as c0 + c1 x T + c2 x T2 in floats; that equals the stream's own
#: arithmetic to the byte while every value is a multiple of 2^-10 below 2^43 bytes (53 bits)
_DYADIC = 1024
_EXACT_LIMIT_BYTES = 2.0 ** 43
_TEMPLATES: Dict[Tuple[Any, ...], Any] = {}
_MAX_TEMPLATES = 16
#: (template key, stream sizes key) -> (arch, ReplayResult): setups whose event streams are
#: equal (same setup, same T where no size depends on T2, ...) share one replay
_BY_STREAM: Dict[Tuple[Any, ...], Tuple[Architecture, Any]] = {}
#: template key -> sizes requested so far (a template is built at the second size)
_SEEN: Dict[Tuple[Any, ...], int] = {}


class StreamTemplate:
    """``training_events`` of one setup at every (batch, seq): the same events in the same
    order, each allocation's size ``c0 + c1 x T + c2 x T2`` (T = b x s tokens, T2 = b x s^2).

    Solved from the raw (not yet ``int()``-ed) sizes of the stream at the three
    :data:`_PROBES` and checked against the stream at a fourth size; any event whose size is
    not of that form, or any change in the events' order, fails the check and the setup keeps
    generating its stream directly.  An allocation the stream skips at the probes (size <= 0)
    is kept as a marker: at a size where it would be positive (or where a kept allocation's
    size would not be), the template declines (``events_at`` returns None) and the stream is
    generated directly.  A new size costs one numpy expression over the sizes instead of
    regenerating the stream, and sizes whose streams are equal share one replay
    (:meth:`size_key`)."""

    __slots__ = ("kinds", "keys", "labels", "idx", "coef", "skips", "uses_tokens", "uses_t2", "bound", "n")

    def __init__(self, base: List[Event], allocs: List[Tuple[Any, ...]], skips: List[Tuple[float, float, float]]):
        import numpy as np

        self.n = len(base)
        self.kinds = [e[0] for e in base]
        self.keys = [e[1] for e in base]
        self.labels = [e[3] for e in base]
        self.idx = np.array([a[0] for a in allocs], dtype=np.int64)
        self.coef = tuple(np.array([a[k] for a in allocs], dtype=np.float64) for k in (3, 4, 5))
        self.skips = tuple(np.array([x[k] for x in skips], dtype=np.float64) for k in range(3))
        # (the skipped sizes decide only whether the template applies: events_at)
        self.uses_tokens = bool(np.any(self.coef[1] != 0))
        self.uses_t2 = bool(np.any(self.coef[2] != 0))
        self.bound = tuple(float(np.max(np.abs(c))) if len(c) else 0.0 for c in self.coef)

    def raw_sizes(self, b: int, sq: int) -> List[float]:
        """Every allocation's size at (b, sq) before ``int()``, in stream order (floats)."""
        c0, c1, c2 = self.coef
        T, T2 = b * sq, b * sq * sq
        return (c0 + c1 * T + c2 * T2).tolist()

    def events_at(self, b: int, sq: int) -> Optional[Iterable[Event]]:
        """The stream at (b, sq) (an iterable of events, equal to ``training_events`` there),
        or None where the template cannot vouch for it: a kept size not positive, a skipped
        one positive, or a size beyond the exact range of floats (:data:`_EXACT_LIMIT_BYTES`)."""
        import numpy as np

        T, T2 = b * sq, b * sq * sq
        m0, m1, m2 = self.bound
        if m0 + m1 * T + m2 * T2 >= _EXACT_LIMIT_BYTES:
            return None
        c0, c1, c2 = self.coef
        v = c0 + c1 * T + c2 * T2          # the same operations, in the same order, as Python floats
        if len(v) and float(v.min()) <= 0:
            return None
        s0, s1, s2 = self.skips
        if len(s0) and float((s0 + s1 * T + s2 * T2).max()) > 0:
            return None
        sizes = np.zeros(self.n, dtype=np.int64)
        sizes[self.idx] = v.astype(np.int64)   # int(): truncation, the sizes are positive
        return zip(self.kinds, self.keys, sizes.tolist(), self.labels)

    def size_key(self, b: int, sq: int) -> Tuple[int, int]:
        """What the stream's sizes depend on: (T or 0, T2 or 0)."""
        return (b * sq if self.uses_tokens else 0, b * sq * sq if self.uses_t2 else 0)


def _template_key(arch: Architecture, s: TrainingSetup) -> Tuple[Any, ...]:
    return _shape_key(arch, s) + (arch.family.trace_key(arch, s),)


def _raw_events(arch: Architecture, s: TrainingSetup) -> List[Event]:
    _RAW_SIZES.on = True
    try:
        return training_events(arch, s)
    finally:
        _RAW_SIZES.on = False


def _solve_template(arch: Architecture, s: TrainingSetup) -> Optional[StreamTemplate]:
    """Build the template of ``s`` (see :class:`StreamTemplate`), or None when its stream is
    not of that form.

    Per allocation, with (T, T2) = (128, 8192), (256, 16384), (256, 32768) at the probes:
    c2 = (yc - yb) / 16384, c1 = (yb - ya - 8192 c2) / 128, c0 = ya - 128 c1 - 8192 c2.  Every
    size is checked to be a multiple of 2^-10 below 2^43 bytes, where these float operations
    are exact, and the template is checked to give every probe's and ``s``'s sizes back."""
    import numpy as np

    if s.target_len is not None:
        # an encoder-decoder's fixed target length adds b x t and b x s x t sizes, which the
        # probes (varying b and s only) cannot tell from c0 + c1 T + c2 T2: no template, the
        # stream is generated at each size
        return None
    tk = _template_key(arch, s)
    points = _PROBES + ((s.batch_size, s.seq_len),)
    streams = []
    for b, sq in points:
        try:
            probe = s.replace(batch_size=b, seq_len=sq)
        except Exception:   # a size the setup refuses: no template
            return None
        if _template_key(arch, probe) != tk:
            return None
        streams.append(_raw_events(arch, probe))
    first = streams[0]
    shape = [(e[0], e[1], e[3]) for e in first]
    if any([(e[0], e[1], e[3]) for e in x] != shape for x in streams[1:]):
        return None
    sized = [i for i, e in enumerate(first) if e[0] in ("alloc", "skip")]
    others = [i for i, e in enumerate(first) if e[0] not in ("alloc", "skip")]
    if any([x[i][2] for i in others] != [first[i][2] for i in others] for x in streams[1:]):
        return None
    ya, yb, yc, yd = (np.array([x[i][2] for i in sized], dtype=np.float64) for x in streams)

    # a size that is the same at every probe is a constant, kept as it is; the others must be
    # multiples of 2^-10 below 2^43 bytes for the solve to be exact
    varies = (ya != yb) | (yb != yc) | (yc != yd)

    def dyadic(v: Any) -> bool:
        v = v[varies]
        w = v * _DYADIC
        return bool(np.all(np.abs(v) < _EXACT_LIMIT_BYTES) and np.all(np.floor(w) == w))

    if not all(dyadic(v) for v in (ya, yb, yc)):
        return None
    (Ta, T2a), (Tb, T2b), (Tc, T2c) = ((b * q, b * q * q) for b, q in _PROBES)
    c2 = np.where(varies, (yc - yb) / (T2c - T2b), 0.0)
    c1 = np.where(varies, (yb - ya - c2 * (T2b - T2a)) / (Tb - Ta), 0.0)
    c0 = np.where(varies, ya - c1 * Ta - c2 * T2a, ya)
    if not all(dyadic(c) for c in (c0, c1, c2)):
        return None
    base: List[Event] = []
    allocs: List[Tuple[Any, ...]] = []
    skips: List[Tuple[float, float, float]] = []
    j = 0
    for i, e in enumerate(first):
        if e[0] == "skip":
            skips.append((float(c0[j]), float(c1[j]), float(c2[j])))
            j += 1
            continue
        if e[0] == "alloc":
            allocs.append((len(base), e[1], e[3], float(c0[j]), float(c1[j]), float(c2[j])))
            j += 1
        base.append(e)
    tpl = StreamTemplate(base, allocs, skips)
    for (b, sq), x in zip(points, streams):
        if tpl.raw_sizes(b, sq) != [float(e[2]) for e in x if e[0] == "alloc"]:
            return None
        s0, s1, s2 = tpl.skips
        T, T2 = b * sq, b * sq * sq
        if len(s0) and float((s0 + s1 * T + s2 * T2).max()) > 0:     # skipped there too
            return None
    return tpl


def stream_template(arch: Architecture, s: TrainingSetup, build: bool = True) -> Optional[StreamTemplate]:
    """The cached :class:`StreamTemplate` of ``s``'s setup (any size), built now when
    ``build`` and not tried before; None when it has none."""
    tk = _template_key(arch, s)
    hit = _TEMPLATES.get(tk)
    if hit is not None:
        return hit[1] if hit[0] is arch else None
    if not build:
        return None
    tpl = _solve_template(arch, s)
    with _LOCK:
        if len(_TEMPLATES) >= _MAX_TEMPLATES:
            _TEMPLATES.clear()
        _TEMPLATES[tk] = (arch, tpl)
    return tpl


def _replay_now(arch: Architecture, s: TrainingSetup) -> Any:
    """The default-settings replay of ``s``: through its stream template when the setup has
    one (built at the second size asked for), shared with any size whose stream is equal."""
    tk = _template_key(arch, s)
    seen = _SEEN.get(tk, 0)
    _SEEN[tk] = seen + 1
    if len(_SEEN) > _MAX_CACHED:
        _SEEN.clear()
    tpl = stream_template(arch, s, build=seen >= 1)
    events = tpl.events_at(s.batch_size, s.seq_len) if tpl is not None else None
    if events is None:      # no template, or one that does not vouch for this size
        return replay(training_events(arch, s), parse_alloc_conf(s.allocator))
    sk = tk + tpl.size_key(s.batch_size, s.seq_len)
    hit = _BY_STREAM.get(sk)
    if hit is not None and hit[0] is arch:
        return hit[1]
    res = replay(events, parse_alloc_conf(s.allocator))
    _BY_STREAM[sk] = (arch, res)
    return res


def replay_training(arch: Architecture, s: TrainingSetup, capacity_bytes: Optional[float] = None,
                    record: bool = False) -> Any:
    """Replay the caching allocator (``allocator.replay``, with the setup's ``allocator``
    settings) over this setup's load + three training steps; cached per architecture and
    setup when no capacity and no recording is asked for (safe across threads: two threads
    asking for the same setup run one replay)."""
    if capacity_bytes is not None or record:
        return replay(training_events(arch, s), parse_alloc_conf(s.allocator), capacity_bytes, record)
    def replay_and_store() -> Any:
        res = _replay_now(arch, s)
        _store(arch, s, res)
        return res

    return single_flight(_LOCK, _INFLIGHT, (id(arch), s), lambda: cached_replay(arch, s), replay_and_store)


def single_flight(lock: Any, inflight: Dict[Any, threading.Event], key: Any, lookup: Callable[[], Any],
                  compute: Callable[[], Any]) -> Any:
    """``lookup()`` if it has the result, else ``compute()`` (which stores it where ``lookup``
    finds it) run by one thread only: a thread asking for a ``key`` another thread is
    computing waits for it and takes the stored result."""
    while True:
        hit = lookup()
        if hit is not None:
            return hit
        with lock:
            hit = lookup()
            if hit is not None:
                return hit
            waiting = inflight.get(key)
            if waiting is None:
                done = inflight[key] = threading.Event()
                break
        waiting.wait()          # another thread computes this key: take its result
    try:
        return compute()
    finally:
        with lock:
            inflight.pop(key, None)
        done.set()


def reserved_bytes(arch: Architecture, s: TrainingSetup, peak: float) -> float:
    """``max_memory_reserved()`` of the setup whose allocated peak the estimate puts at ``peak``:
    the replay's own maximum where the event stream lays out the step (:func:`modelled`), else
    the replay's cached free blocks at its peak added to ``peak``."""
    return reserved_of(s, replay_training(arch, s), peak)


def reserved_of(s: TrainingSetup, r: Any, peak: float) -> float:
    """The reserve a replay ``r`` of ``s``'s step implies (with or without a card's capacity):
    its own maximum where the event stream lays out the step (:func:`modelled`), else its
    cached free blocks at its peak added to ``peak``."""
    if modelled(s):
        return max(float(r.max_reserved_bytes), float(peak))
    return float(peak) + max(0.0, float(r.max_reserved_bytes - r.max_allocated_bytes))


ALLOCATOR_REPLAY.update(replay=replay_training, reserved=reserved_bytes, provisional=provisional_reserved_bytes,
                        reserved_of=reserved_of)
