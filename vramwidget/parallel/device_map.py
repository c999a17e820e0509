"""``device_map="auto"``: where transformers puts each layer over several GPUs, and what each GPU
then holds.

Placement is transformers 5's own (``transformers/integrations/accelerate.py``, which
``from_pretrained(device_map=...)`` runs, with accelerate's ``get_max_layer_size`` and
``clean_device_map``), replayed here over the model's module tree without torch:

* ``get_balanced_memory`` ("auto" and "balanced"): every GPU but the last gets at most
  ``total // n_gpus + int(1.25 x max(largest decoder layer, largest leaf module))`` bytes;
  ``balanced_low_0`` keeps GPU 0 as empty as the others allow; "sequential" fills GPU 0 first;
* ``infer_auto_device_map``: modules in order (the root's children, split into theirs when
  they do not fit; a decoder layer, ``_no_split_modules``, is never split); on the first
  GPU and the CPU the largest remaining layer's size is kept free (to run an offloaded layer
  there); a tied head goes where its embedding goes; then the next device; after the GPUs,
  the CPU, then the disk;
* module sizes: every parameter and buffer (the rotary ``inv_freq`` and ``original_inv_freq``
  in fp32) at its element size; a 4-bit bitsandbytes weight at 0.5 B per element (the
  quantizer's ``param_element_size``); a tied head counts once.

Each GPU then runs its own layers in turn (accelerate's ``AlignDevicesHook`` moves the hidden
states from one device to the next): it holds their weights, their share of the KV cache and
the activations that pass through them, GPU 0 the embeddings and the head's GPU the logits.
Layers placed on the CPU or disk run on GPU 0, their weights moved there one module at a time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from ..errors import VramError
from ..inputs import shown
from ..units import DTYPE_BYTES

Device = Union[int, str]

#: the strings from_pretrained takes for a computed placement
STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


@dataclass
class _Node:
    name: str
    size: float = 0.0
    children: List["_Node"] = field(default_factory=list)   # modules, then (for a leaf module) nothing
    params: List["_Node"] = field(default_factory=list)     # parameters directly on this module
    buffers: List["_Node"] = field(default_factory=list)
    no_split: bool = False
    tensor: bool = False

    def module_children(self) -> List["_Node"]:
        return [] if self.tensor else self.children


def _elem_bytes(dtype: str) -> float:
    return 0.5 if dtype in ("nf4", "fp4") else DTYPE_BYTES.get(dtype, 2)


def module_tree(arch: Any, P: Any) -> Tuple[_Node, List[List[str]]]:
    """The causal LM's module tree (``model`` with ``embed_tokens``, ``layers.<i>``, ``norm``,
    ``rotary_emb``; ``lm_head``), each node's size in bytes as transformers counts it, and the
    tied parameter groups."""
    if any(not (t.name.startswith("model.") or t.name.startswith("lm_head")) for t in arch.tensors) or \
            getattr(arch, "tower", None):
        raise VramError(f"device_map: placement is modelled for decoder-only causal LMs "
                        f"(model.layers.<i> + lm_head), not {arch.name}", field="device_map")
    root = _Node("")
    index: Dict[str, _Node] = {"": root}

    def node(path: str) -> _Node:
        if path in index:
            return index[path]
        parent, _, _ = path.rpartition(".")
        n = _Node(path, no_split=bool(re.fullmatch(r"model\.layers\.\d+", path)))
        node(parent).children.append(n)
        index[path] = n
        return n

    tied: List[List[str]] = []
    for t, dtype, nbytes, trains in P.weights:
        lo, hi = t.layers if t.layers else (0, 0)
        per = nbytes / max(t.repeat, 1)
        names = [t.name.replace("{i}", str(i)) for i in range(lo, hi + 1)] if t.layers else [t.name]
        for name in names:
            mod, _, _ = name.rpartition(".")
            p = _Node(name, size=per * (t.repeat // len(names)) if t.layers else nbytes, tensor=True)
            node(mod).params.append(p)
            index[name] = p
    if arch.tie_word_embeddings and "lm_head.weight" not in index:
        node("lm_head").params.append(_Node("lm_head.weight", size=0.0, tensor=True))
        tied.append(["lm_head.weight", "model.embed_tokens.weight"])
    if not any(t.role == "position_embedding" for t in arch.tensors):   # rotary positions
        rot = node("model.rotary_emb")
        half = max(1, arch.head_dim // 2)
        for b in ("inv_freq", "original_inv_freq"):
            rot.buffers.append(_Node(f"model.rotary_emb.{b}", size=half * 4.0, tensor=True))
    # registration order: the decoder's modules, then the head
    model = index.get("model")
    if model is not None:
        order = {"model.embed_tokens": 0, "model.layers": 1, "model.norm": 2, "model.rotary_emb": 3}
        model.children.sort(key=lambda c: order.get(c.name, 4))
        layers = index.get("model.layers")
        if layers is not None:
            layers.children.sort(key=lambda c: int(c.name.rsplit(".", 1)[1]))
    root.children.sort(key=lambda c: c.name != "model")
    _sizes(root)
    return root, tied


def _sizes(n: _Node) -> float:
    if n.tensor:
        return n.size
    n.size = sum(_sizes(c) for c in n.params + n.children + n.buffers)
    return n.size


def _all(n: _Node) -> List[_Node]:
    out = [n]
    for c in n.params + n.children + n.buffers:
        out.extend(_all(c))
    return out


def _max_layer(modules: Sequence[_Node]) -> Tuple[float, List[str]]:
    """accelerate.utils.modeling.get_max_layer_size: the largest module that is not split
    further (no child modules, or a no-split class)."""
    best, names = 0.0, []
    todo = list(modules)
    while todo:
        m = todo.pop(0)
        kids = m.module_children()
        if not kids or m.no_split:
            if m.size > best:
                best, names = m.size, [m.name]
            elif m.size == best:
                names.append(m.name)
        else:
            todo = kids + todo
    return best, names


def parse_max_memory(max_memory: Mapping[Any, Any]) -> Dict[Device, float]:
    """``max_memory`` as from_pretrained takes it: GPU index (int) or "cpu" / "disk" -> bytes
    or a size string ("20GiB", "20GB": accelerate's convert_file_size_to_int); a sequence of
    (device, size) pairs is taken as the mapping (hashable, for caches)."""
    if isinstance(max_memory, (tuple, list)) and all(isinstance(x, (tuple, list)) and len(x) == 2
                                                       for x in max_memory):
        max_memory = dict(max_memory)
    if not isinstance(max_memory, Mapping) or not max_memory:
        raise VramError(f"max_memory: a mapping of devices (0, 1, ..., 'cpu') to sizes, got {shown(max_memory)}",
                        field="max_memory")
    out: Dict[Device, float] = {}
    for k, v in max_memory.items():
        key: Device = k
        if isinstance(k, str) and k.isdigit():
            key = int(k)
        if not (isinstance(key, int) and not isinstance(key, bool) and key >= 0) and key not in ("cpu", "disk"):
            raise VramError(f"max_memory: device {shown(k)} is not a GPU index, 'cpu' or 'disk'", field="max_memory")
        out[key] = float(_size(v))
    gpus = sorted(d for d in out if isinstance(d, int))
    return {**{g: out[g] for g in gpus}, **{d: out[d] for d in ("cpu", "disk") if d in out}}


def _size(v: Any) -> int:
    """accelerate's convert_file_size_to_int: '10GiB' = 10 x 2**30, '10GB' = 10 x 10**9 (and
    GB spelled with a trailing 'b' means bits)."""
    if isinstance(v, bool):
        raise VramError(f"max_memory: {shown(v)} is not a size", field="max_memory")
    if isinstance(v, (int, float)):
        if v < 0:
            raise VramError(f"max_memory: {shown(v)} is negative", field="max_memory")
        return int(v)
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]i?B|[KMGT]i?b)\s*", str(v)) if isinstance(v, str) else None
    if not m:
        raise VramError(f"max_memory: {shown(v)} is not a size like '20GiB' or '24GB'", field="max_memory")
    num, unit = float(m.group(1)), m.group(2)
    power = "KMGT".index(unit[0]) + 1
    base = 2 ** (10 * power) if unit[1] == "i" else 10 ** (3 * power)
    val = int(num * base)
    return val // 8 if unit.endswith("b") else val


def balanced_memory(root: _Node, max_memory: Dict[Device, float], low_zero: bool = False,
                    flavor: str = "transformers") -> Dict[Device, float]:
    """get_balanced_memory as transformers (``integrations/accelerate.py``: the buffer is 1.25 x
    the larger of the largest decoder layer and the largest leaf module) or accelerate
    (``accelerate/utils/modeling.py``: 1.25 x the larger of the first decoder layer and the
    mean leaf module) computes it."""
    mm = dict(max_memory)
    gpus = [d for d in mm if isinstance(d, int) and mm[d] > 0]
    if not gpus:
        return mm
    if len(gpus) == 1:
        low_zero = False
    per_gpu = int(root.size) // (len(gpus) - 1 if low_zero else len(gpus))
    nodes = _all(root)
    blocks = [n.size for n in nodes if n.no_split]
    if flavor == "accelerate":
        leaves = [n for n in nodes if not n.tensor and not n.children and n is not root]
        mean_leaves = int(sum(n.size for n in leaves) / max(len(leaves), 1))
        per_gpu += int(1.25 * max(blocks[0] if blocks else 0.0, mean_leaves))
    else:
        leaves = [n for n in nodes if not n.tensor and (n.params or n.buffers)]
        biggest_leaf = max((sum(c.size for c in n.params + n.buffers) for n in leaves), default=0.0)
        per_gpu += int(1.25 * max(max(blocks, default=0.0), biggest_leaf))
    for idx in sorted(gpus)[:-1]:
        mm[idx] = min(mm[0] if low_zero and idx == 0 else per_gpu, mm[idx])
    if low_zero:
        mm[0] = min(max(0.0, root.size - sum(mm[i] for i in sorted(gpus)[1:])), mm[0])
    return mm


def infer_device_map(root: _Node, tied: List[List[str]], max_memory: Dict[Device, float],
                     flavor: str = "transformers") -> Dict[str, Device]:
    """infer_auto_device_map over the module tree (see the module docstring), as transformers
    writes it or as accelerate does (which splits a module only when it does not fit alone)."""
    devices: List[Device] = list(max_memory) + ([] if "disk" in max_memory else ["disk"])
    gpus = [d for d in devices if d not in ("cpu", "disk")]
    main = [gpus[0], "cpu"] if gpus else ["cpu"]
    todo: List[_Node] = list(root.params) + list(root.children) + list(root.buffers)
    placed: Dict[str, Device] = {}
    used = {d: 0.0 for d in devices}
    cur = 0
    max_size, max_names = _max_layer(todo)
    while todo:
        m = todo.pop(0)
        max_names = [n for n in max_names if n != m.name and not n.startswith(m.name + ".")]
        if not max_names:
            max_size, max_names = _max_layer([n for n in todo if not n.tensor])
        groups = [g for g in tied if any((m.name + ".") in (k + ".") for k in g)
                  and not all((m.name + ".") in (k + ".") for k in g)]
        tied_params = [p for g in groups for p in g if (m.name + ".") not in (p + ".")]
        dev = devices[cur]
        cap = max_memory[dev] if dev != "disk" else None
        reserved = 0.0
        if dev in main and cap is not None:
            cap -= max_size
            reserved = max_size
        with_ties, tied_mods = m.size, []
        for p in tied_params:
            hit = next((n for n in todo if p.startswith(n.name + ".")), None)
            if hit is not None:
                tied_mods.append(hit)
                with_ties += hit.size - _find(hit, p).size
        if cap is None or used[dev] + with_ties <= cap:
            used[dev] += with_ties
            placed[m.name] = dev
            for t in tied_mods:
                if t in todo:
                    todo.remove(t)
                placed[t.name] = dev
            continue
        if flavor == "accelerate" and cap is not None and used[dev] + m.size < cap and not tied_params:
            pass      # accelerate splits only a module that does not fit by itself: next device
        elif tied_params and used[dev] + m.size <= cap:
            split = next((t for t in tied_mods if t.module_children() and not t.no_split), None)
            if split is not None:
                i = todo.index(split)
                todo = [m] + todo[:i] + split.params + split.children + todo[i + 1:]
                max_size, max_names = _max_layer([n for n in todo if not n.tensor])
                continue
        kids = m.module_children()
        if kids and not m.no_split and not (flavor == "accelerate" and cap is not None and used[dev] + m.size < cap):
            todo = m.params + kids + todo
            max_size, max_names = _max_layer([n for n in todo if not n.tensor])
            continue
        used[dev] += reserved
        cur += 1
        if cur >= len(devices):
            raise VramError(f"max_memory: {m.name} fits on no device", field="max_memory")
        todo = [m] + todo
    return _clean(placed)


def _find(n: _Node, name: str) -> _Node:
    for c in _all(n):
        if c.name == name:
            return c
    return _Node(name)


def _clean(device_map: Dict[str, Device], module: str = "") -> Dict[str, Device]:
    """accelerate.utils.modeling.clean_device_map: one entry for a module whose parts all sit
    on one device."""
    prefix = "" if module == "" else f"{module}."
    values = [v for k, v in device_map.items() if k.startswith(prefix)]
    if len(set(values)) == 1 and len(values) > 1:
        for k in [k for k in device_map if k.startswith(prefix)]:
            del device_map[k]
        device_map[module] = values[0]
    kids = [k for k in device_map if k.startswith(prefix) and len(k) > len(module)]
    idx = len(module.split(".")) + 1 if module else 1
    for child in {".".join(k.split(".")[:idx]) for k in kids}:
        _clean(device_map, child)
    return device_map


@dataclass
class Placement:
    """Where each module sits: ``device_map`` (transformers' form), each decoder layer's
    device, the embedding's and the head's, and the bytes of weights per device."""

    device_map: Dict[str, Device]
    layers: List[Device]
    embedding: Device
    head: Device
    bytes_per_device: Dict[Device, float]
    max_memory: Dict[Device, float]

    def device_of(self, module: str) -> Device:
        best = ""
        for k in self.device_map:
            if (module == k or module.startswith(k + ".") or k == "") and len(k) >= len(best):
                best = k
        return self.device_map[best]

    @property
    def gpus(self) -> List[int]:
        return sorted({d for d in self.layers + [self.embedding, self.head] if isinstance(d, int)})


def place(arch: Any, P: Any, device_map: Any = "auto", max_memory: Optional[Mapping[Any, Any]] = None,
          quantized: bool = False, flavor: str = "transformers") -> Placement:
    """The placement ``from_pretrained(device_map=..., max_memory=...)`` computes for ``arch``
    with the parameter storage ``P`` (estimate._params); a dict ``device_map`` is taken as given.
    ``quantized``: a bitsandbytes load, whose quantizer keeps 10% of every device's max_memory
    for its buffers (``Bnb4BitHfQuantizer.adjust_max_memory``).  ``flavor``: "transformers"
    (what from_pretrained runs) or "accelerate" (accelerate's own functions)."""
    root, tied = module_tree(arch, P)
    if isinstance(device_map, (tuple, list)):
        device_map = dict(device_map)
    if isinstance(device_map, Mapping):
        dm: Dict[str, Device] = {str(k): v for k, v in device_map.items()}
        mm = parse_max_memory(max_memory) if max_memory is not None else {}
    else:
        if device_map not in STRATEGIES:
            raise VramError(f"device_map: must be one of {', '.join(STRATEGIES)} or a mapping of modules to devices, "
                            f"got {shown(device_map)}", field="device_map")
        if max_memory is None:
            raise VramError("max_memory: device_map needs the memory of each GPU (e.g. {0: '24GiB', 1: '24GiB'}); "
                            "there is no GPU here to ask", field="max_memory")
        given = parse_max_memory(max_memory)
        mm = given if device_map == "sequential" else balanced_memory(root, given, device_map == "balanced_low_0",
                                                                      flavor)
        if quantized:
            mm = {k: v * 0.90 for k, v in mm.items()}
        dm = infer_device_map(root, tied, mm, flavor)
    out = Placement(dm, [], "cpu", "cpu", {}, mm)
    L = arch.num_layers
    out.layers = [out.device_of(f"model.layers.{i}") for i in range(L)]
    out.embedding = out.device_of("model.embed_tokens")
    out.head = out.device_of("lm_head")
    for n in _all(root):
        if n.tensor:
            d = out.device_of(n.name)
            out.bytes_per_device[d] = out.bytes_per_device.get(d, 0.0) + n.size
    return out


def stages(pl: Placement) -> List[Tuple[int, int, bool, bool, Device]]:
    """The GPUs in layer order as (first layer, last layer, holds the embedding, holds the
    head, device): what each GPU runs of one forward.  Layers on the CPU or disk are refused
    (training through accelerate's offload hooks is not modelled)."""
    off = sorted({d for d in pl.layers + [pl.embedding, pl.head] if not isinstance(d, int)}, key=str)
    if off:
        raise VramError(f"device_map: modules placed on {', '.join(map(str, off))} (offloaded): a training step "
                        f"through accelerate's offload hooks is not modelled; give the GPUs more max_memory",
                        field="device_map")
    out: List[Tuple[int, int, bool, bool, Device]] = []
    for i, d in enumerate(pl.layers):
        if out and out[-1][4] == d:
            f, _, e, h, _ = out[-1]
            out[-1] = (f, i, e, h, d)
        elif any(x[4] == d for x in out):
            raise VramError("device_map: a GPU holds layers that are not contiguous", field="device_map")
        else:
            out.append((i, i, False, False, d))
    if not out:
        raise VramError("device_map: no decoder layer is placed on a GPU", field="device_map")
    for j, (f, l, e, h, d) in enumerate(out):
        out[j] = (f, l, d == pl.embedding, d == pl.head, d)
    if not any(x[2] for x in out) or not any(x[3] for x in out):
        raise VramError("device_map: the embedding or the head sits on a GPU without decoder layers; not modelled",
                        field="device_map")
    return out
