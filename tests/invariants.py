"""The invariants every estimate keeps, over a space of setups that covers every method.

Shared by ``tests/test_properties.py`` (hypothesis) and ``benchmarks/bench_fuzz.py``
(100,000 random setups).  ``SPACE`` lists what a setup draws from: every preset, every
value of the choice fields in ``vramwidget.CHOICES`` (new methods, such as ``norms``, are
drawn as soon as they are listed; a value the estimator refuses with a VramError is a
rejected draw, not a failure).
"""

from __future__ import annotations

import random
from typing import Any, Dict, List, Optional

from vramwidget import CHOICES, VramError, estimate
from vramwidget.model.architecture import load
from vramwidget.model.presets import list_presets


def _all(field: str) -> List[str]:
    return [c for c, _ in CHOICES[field]]


#: what a random setup draws from: a list (pick one) or an inclusive (low, high) range
SPACE: Dict[str, Any] = {
    "model": list_presets(),
    "method": _all("method"),
    "precision": _all("precision"),
    "optimizer": _all("optimizer"),
    "gradient_checkpointing": _all("gradient_checkpointing"),
    "attn_implementation": _all("attn_implementation"),
    "batch_size": (1, 16),
    "seq_len": (1, 4096),
    "grad_accum_steps": (1, 4),
    "lora_r": (1, 128),
    "trainable_layers": (1, 8),
    "prepare_kbit": [False, True],
}


def _mixed(name: str) -> bool:
    arch = load(name)
    return bool(arch.family.layer_order(arch)) or bool(arch.dense_layers and arch.is_moe)


#: presets whose layers are not all alike (encoder-decoders, hybrids, leading dense layers):
#: which kinds train under ``freeze`` depends on ``trainable_layers``
MIXED_STACKS: List[str] = [p for p in SPACE["model"] if _mixed(p)]


def random_setup(rng: random.Random) -> Dict[str, Any]:
    """One setup drawn from SPACE."""
    return {k: rng.choice(v) if isinstance(v, list) else rng.randint(*v) for k, v in SPACE.items()}


def kwargs(d: Dict[str, Any], **over: Any) -> Dict[str, Any]:
    """estimate()'s keywords for a drawn setup: fields that do not apply to the method are
    left out (a 4-bit base computes in 16 bits; prepare_kbit is QLoRA's; trainable_layers
    is freeze's, at most the model's layers)."""
    d = dict(d, **over)
    model = d["model"]
    kw = {k: v for k, v in d.items() if k not in ("model", "prepare_kbit", "trainable_layers")}
    if d["method"] == "qlora":
        if d["precision"] in ("fp32", "amp_bf16", "amp_fp16", "fp8"):
            kw["precision"] = "bf16"
        kw["prepare_kbit"] = d["prepare_kbit"]
    if d["method"] == "freeze":
        kw["trainable_layers"] = min(d["trainable_layers"], load(model).num_layers)
    return kw


def run(d: Dict[str, Any], **over: Any):
    """The estimate of a drawn setup with some fields changed."""
    return estimate(d["model"], **kwargs(d, **over))


def valid(d: Dict[str, Any]) -> Optional[Any]:
    """The estimate, or None when the estimator refuses the combination (a VramError)."""
    try:
        return run(d)
    except VramError:
        return None


def violations(d: Dict[str, Any], extra_batch: int = 1, extra_seq: int = 64, est: Any = None) -> List[str]:
    """Every invariant the setup breaks (an empty list: none).  ``d`` must be valid; ``est``
    is its estimate when the caller has it already (``valid(d)``), so it is not computed twice."""
    out: List[str] = []
    est = est if est is not None else run(d)
    peak = est.peak_allocated_bytes

    # more work never needs less memory
    if run(d, batch_size=d["batch_size"] + extra_batch).peak_allocated_bytes < peak:
        out.append(f"batch_size +{extra_batch} needs less")
    if run(d, seq_len=d["seq_len"] + extra_seq).peak_allocated_bytes < peak:
        out.append(f"seq_len +{extra_seq} needs less")

    # checkpointing never keeps more than it saves: up to one block's input in fp32 plus its
    # checkpoint and the norm's statistics (8 x T x h + 16 x T bytes; see test_properties);
    # an encoder-decoder's decoder blocks take the target's tokens (bart-large freeze, 1 x 1
    # input, 2,226-token target: full keeps 126 KiB more than none, within 8 x 2,226 x h)
    tokens = d["batch_size"] * max(d["seq_len"], d.get("target_len") or d["seq_len"])
    # each term as the caching allocator holds it, rounded up to its 512-byte blocks (qwen3-30b-a3b
    # QLoRA, 1 x 1 tokens: full keeps 16,896 B more than none = 16,384 B of block input + the
    # norm's 16 B statistics in a 512-byte block)
    slack = _blocks(8 * tokens * load(d["model"]).hidden_size) + _blocks(16 * tokens)
    by_gc = {gc: peak if gc == d["gradient_checkpointing"] else run(d, gradient_checkpointing=gc).peak_allocated_bytes
             for gc in ("none", "selective", "full")}
    none = by_gc["none"]
    for gc in ("selective", "full"):
        if by_gc[gc] > none + slack:
            out.append(f"gradient_checkpointing={gc} needs more than none")

    # a quantized base is smaller than the 16-bit one, or a note says where it is not
    if d["method"] in ("lora", "qlora"):
        try:
            lora = run(d, method="lora", precision="bf16")
            qlora = run(d, method="qlora", precision="bf16")
        except VramError:
            lora = qlora = None
        if lora is not None and qlora.phases_bytes["after_load"] >= lora.phases_bytes["after_load"] \
                and not any("unquantized" in n for n in qlora.notes):
            out.append("QLoRA weights are not below LoRA's and no note says why")

    # the allocator replay (reserved memory) holds at least what is allocated at the peak
    if not (peak <= est.reserved_bytes < 2 ** 50):
        out.append(f"reserved {est.reserved_bytes!r} bytes is not between the peak {peak!r} and 1 PiB")

    # the trees add up to the totals, every number is finite and positive
    root = est.tree()
    leaves = sum(n.bytes for _, n in root.leaves())
    if abs(leaves - root.bytes) > 1e-6 * root.bytes or abs(root.bytes - est.device_total_bytes) > 1e-6 * root.bytes:
        out.append("the tree's leaves do not add up to the device total")
    allocated = sum(c.bytes for c in est.components if c.name not in ("cuda context", "allocator reserve"))
    if abs(allocated - peak) > 1e-6 * peak:
        out.append("the components do not add up to the peak")
    for phase, nodes in est.phase_components.items():
        if abs(sum(n.bytes for n in nodes) - est.phases_bytes[phase]) > 1e-6 * est.phases_bytes[phase]:
            out.append(f"phase {phase}'s components do not add up")
    for _, n in root.walk():
        if not (0 <= n.bytes < 2 ** 50):
            out.append(f"{n.name}: {n.bytes!r} bytes")
            break
    return out


def _blocks(nbytes: int) -> int:
    """``nbytes`` rounded up to the caching allocator's 512-byte blocks (its smallest request)."""
    return max(512, -(-int(nbytes) // 512) * 512)
