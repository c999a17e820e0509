"""Loading the model: parameters in module order, quantization on the fly, adapters.

* ``from_config`` under ``torch.device``: every parameter built on the GPU in its dtype;
* ``from_pretrained`` with bitsandbytes quantization: each 16-bit checkpoint tensor is
  materialized, quantized, dropped (transformers' loader keeps up to
  :data:`ASYNC_LOAD_WORKERS` tensors in flight beside the one being converted);
* a tied head is built with its own weight, then replaced by the embedding's;
* ``prepare_model_for_kbit_training`` upcasts every parameter that is not quantized to fp32;
* peft builds each LoRA pair (lora_A, lora_B) per adapted module and layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

from ..model.architecture import Architecture
from ..units import DTYPE_BYTES
from .context import StepContext

#: transformers' loader (core_model_loading.convert_and_load_state_dict_in_model) materializes
#: checkpoint tensors on the GPU on GLOBAL_WORKERS = 4 threads while the main thread converts
#: them one by one; with on-the-fly (bitsandbytes) quantization, up to this many 16-bit tensors
#: wait beside the one being quantized.  transformers PR #44576 made quantized loading
#: synchronous (0 here); the measured cases (transformers 5.17) load asynchronously.
ASYNC_LOAD_WORKERS = 4

#: (tensor, dtype, bytes of one instance, trains, numel of one instance)
Instance = Tuple[Any, str, float, bool, float]
class Trainable(NamedTuple):
    """A trainable parameter (one instance: one layer's) as its gradient and optimizer see it."""

    module: str
    nbytes: float            # its gradient's bytes (the parameter's dtype)
    dtype: str
    numel: float
    shape: Tuple[int, ...]
    group: str
    role: str
    tensor: Any = None       # the ParamTensor it is an instance of (None: a LoRA matrix)


@dataclass
class Loaded:
    """The parameters after loading, as the step uses them."""

    before: List[Instance]
    after: List[Instance]
    per_layer: List[List[Instance]]
    #: per block: the trainable parameters (adapters included)
    layer_params: List[List[Trainable]] = field(default_factory=list)
    head_params: List[Trainable] = field(default_factory=list)
    embed_params: List[Trainable] = field(default_factory=list)

    @property
    def ordered(self) -> List[Trainable]:
        """``model.parameters()`` order: the optimizer's state and foreach order."""
        return self.embed_params + [p for lp in self.layer_params for p in lp] + self.head_params


def instances(arch: Architecture, P: Any) -> Tuple[List[Instance], List[Instance], List[List[Instance]]]:
    """Parameters as the model constructs them: (before the blocks, after, per block)."""
    before: List[Instance] = []
    after: List[Instance] = []
    per_layer: List[List[Instance]] = [[] for _ in range(arch.num_layers)]
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


def load_model(cx: StepContext) -> Loaded:
    """Write the load into the plan; returns what trains, per block and outside."""
    arch, s, P, pb = cx.arch, cx.s, cx.P, cx.pb
    before, after, per_layer = instances(arch, P)
    consts = {t.name: nbytes / t.repeat for t, nbytes, _ in P.quant_consts}
    base16 = "bfloat16" if cx.c == "float32" else cx.c
    pending: List[Tuple[Instance, int]] = []     # checkpoint tensors materialized, not converted
    upcast: List[Tuple[Instance, Optional[int]]] = []

    def weight(inst: Instance, nbytes: float, dtype: str, what: str = "") -> Optional[int]:
        t = inst[0]
        return pb.alloc(nbytes, t.name + what, "weights", t.group, _weight_formula(t, dtype), dtype)

    def convert(item: Tuple[Instance, Optional[int]]) -> None:
        inst, tmp = item
        t, dtype = inst[0], inst[1]
        if dtype in ("nf4", "fp4", "int8"):
            # bitsandbytes quantizes the 16-bit tensor on the GPU, then it is dropped
            weight(inst, inst[2], dtype)
            pb.alloc(consts.get(t.name, 0.0), t.name, "quantization constants", t.group, "bitsandbytes absmax",
                     "float32", label=(t.name, "quantization constants"))
            pb.free(tmp)
        elif s.quantized and s.prepare_kbit and dtype == "float32":
            upcast.append(item)
        elif dtype == "float32":
            # a module transformers keeps in fp32 (_keep_in_fp32_modules): cast on load
            weight(inst, inst[2], dtype)
            pb.free(tmp)
        elif tmp is not None:
            # a 16-bit tensor: the checkpoint tensor is the parameter
            pb.info[tmp] = pb.info[tmp]._replace(name=t.name, formula=_weight_formula(t, dtype))

    def load_param(inst: Instance) -> None:
        t, dtype, nbytes, trains, numel = inst
        if not s.quantized:
            weight(inst, nbytes, dtype)       # built on the GPU in its dtype (from_config)
            return
        # from_pretrained with on-the-fly quantization: the 16-bit checkpoint tensor first
        size = numel * DTYPE_BYTES[base16] if dtype in ("nf4", "fp4", "int8", "float32") else nbytes
        key = pb.alloc(size, t.name + " (checkpoint tensor)", "weights", t.group, "16-bit, while loading", base16,
                       label=(t.name, "(checkpoint tensor)"))
        pending.append((inst, key))
        if len(pending) > ASYNC_LOAD_WORKERS:
            convert(pending.pop(0))

    for inst in before:
        load_param(inst)
    for layer in range(cx.L):
        for inst in per_layer[layer]:
            load_param(inst)
    for inst in after:
        load_param(inst)
    while pending:
        convert(pending.pop(0))
    if arch.tie_word_embeddings:
        # the head is built with its own weight, then tied to the embedding (the copy is
        # dropped): the measured reserves of tied models show its segment, the quantized
        # loads' too (case a09: 80 MiB over with it, 422 MiB under without)
        dt = base16 if s.quantized else s.weights_dtype
        pb.free(pb.alloc(cx.V * cx.h * DTYPE_BYTES[dt], "lm_head (before tying)", "weights", "output head",
                         "V x h, replaced by the embedding's", dt))
    for inst, tmp in upcast:
        # prepare_model_for_kbit_training: every non-quantized parameter becomes fp32
        weight(inst, inst[4] * 4, "float32", " (fp32)")
        pb.free(tmp)
    loaded = Loaded(before, after, per_layer)
    _adapters_and_trainables(cx, loaded)
    return loaded


def _weight_formula(t: Any, dtype: str) -> str:
    shape = " x ".join(map(str, t.shape))
    return f"{shape} x {DTYPE_BYTES[dtype]:g} B ({dtype})"


def _adapters_and_trainables(cx: StepContext, ld: Loaded) -> None:
    """peft's LoRA pairs per adapted module and layer (in the adapter dtype), then what
    trains per block, before and after the blocks."""
    arch, s, P, pb = cx.arch, cx.s, cx.P, cx.pb
    adapters: Dict[Tuple[str, int], List[float]] = {}
    a_dt = P.adapter_dtype
    ab = DTYPE_BYTES[a_dt]
    for module, group, nbytes, numel in P.adapters:
        # a module name can repeat across groups (GPT-2's attn.c_proj and mlp.c_proj): the
        # group tells them apart
        targets = arch.lora_tensors(P.lora_modules)
        t = next((x for x in targets if x.module == module and x.group == group),
                 next((x for x in targets if x.module == module), None))
        if t is None:
            # not a block module's A/B pair: DoRA magnitudes, LoRA on lm_head/embed_tokens
            pb.alloc(nbytes, module, "adapters", group, f"r x (in + out) x {ab:g} B ({a_dt})", a_dt,
                     label=(module, "adapter"))
            continue
        for layer in range(t.layers[0] if t.layers else 0, (t.layers[1] + 1) if t.layers else 1):
            a = s.lora_r * t.in_features * ab
            bb = s.lora_r * t.out_features * ab
            pb.alloc(a, f"{module} lora_A", "adapters", group, f"r x in ({s.lora_r} x {t.in_features}) x {ab:g} B",
                     a_dt, label=(module, "lora_A"))
            pb.alloc(bb, f"{module} lora_B", "adapters", group,
                     f"out x r ({t.out_features} x {s.lora_r}) x {ab:g} B", a_dt, label=(module, "lora_B"))
            adapters.setdefault((module, layer), []).extend([a, bb])

    def trainable(inst_list: List[Instance]) -> List[Trainable]:
        return [Trainable(t.module, numel * DTYPE_BYTES[dtype], dtype, numel, t.shape, t.group, t.role, t)
                for t, dtype, nbytes, trains, numel in inst_list if trains]

    for layer in range(cx.L):
        lst = trainable(ld.per_layer[layer])
        for (module, lyr), sizes in adapters.items():
            if lyr == layer:
                for nb in sizes:
                    n = int(nb // ab)
                    lst.append(Trainable(module, nb, a_dt, n, (s.lora_r, n // s.lora_r), "adapters", "adapter"))
        ld.layer_params.append(lst)
    ld.head_params = trainable(ld.after)
    ld.embed_params = trainable(ld.before)
