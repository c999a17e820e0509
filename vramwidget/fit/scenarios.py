"""The seed write-ups' scenarios, reproduced: their figures, where they come from, and
what the full estimate (and, where one exists, a measured H200 run) says instead.

Each function returns a plain dict (no pandas, no charts) so that tests, the CLI and the
quickstart notebook share one source.  GB = 10**9 bytes here, as the write-ups use.
"""

from __future__ import annotations

from typing import Any, Dict, List

from ..estimate import estimate
from ..units import GB, GIB, MIB


def _component_gb(est, name: str) -> float:
    return sum(c.bytes for c in est.components if c.name == name) / GB


def seven_b_fp32_vs_bf16() -> Dict[str, Any]:
    """7B (h 4096, 32 layers) at batch 32, seq 512: the write-up says 120-144 GB in FP32
    and 88-106 GB in BF16 with fp32 optimizer states.

    Their figures are model states plus an activation allowance: FP32 weights 4 B + grads
    4 B + Adam 8 B = 16 B/param (107.8 GB for Llama-2-7B's 6.74e9 parameters); BF16
    weights 2 B + grads 2 B + fp32 Adam moments 8 B = 12 B/param (80.9 GB).  What they
    leave out at batch 32 x 512 is the activations (tens of GB without checkpointing)
    and the fp32 logits of the loss.
    """
    n = 6_738_415_616
    rows: List[Dict[str, Any]] = []
    for label, precision, seed_lo, seed_hi, states_b in (
            ("FP32", "fp32", 120, 144, 16), ("BF16 + fp32 Adam states", "bf16_fp32_states", 88, 106, 12)):
        for gc in ("none", "full"):
            est = estimate("llama-2-7b", precision=precision, batch_size=32, seq_len=512, gradient_checkpointing=gc)
            rows.append({
                "scenario": label, "checkpointing": gc,
                "seed_gb": (seed_lo, seed_hi),
                "model_states_gb_by_formula": n * states_b / GB,
                "estimate_peak_gb": est.peak_allocated_bytes / GB,
                "weights_gb": _component_gb(est, "weights"),
                "activations_gb": est.phases_bytes["forward"] / GB - est.phases_bytes["persistent"] / GB,
                "peak_phase": est.peak_phase,
            })
    return {
        "title": "7B at FP32 vs BF16, batch 32 x seq 512",
        "rows": rows,
        "measured": [
            {"case": "a15", "setup": "llama-2-7b fp32 weights + bf16 autocast, fused AdamW, checkpointing, b32 s512",
             "peak_gb": 106582.9 * MIB / GB},
            {"case": "a16", "setup": "llama-2-7b pure bf16, AdamW, checkpointing, b32 s512",
             "peak_gb": 64326.7 * MIB / GB},
        ],
        "explanation": ("The write-ups count 16 (FP32) or 12 (BF16 + fp32 moments) bytes per parameter plus an "
                        "allowance for activations. Without checkpointing, batch 32 x 512 tokens keeps far more "
                        "activations than that allowance (every layer's norms, projections and MLP outputs); "
                        "with checkpointing the peak moves to the optimizer step, where foreach AdamW adds one "
                        "more parameter-sized temporary."),
    }


def thirteen_b_states() -> Dict[str, Any]:
    """13B: weights 26 GB (bf16) and Adam moments 104 GB (two fp32 states, 8 B/param)."""
    est = estimate("llama-2-13b", precision="bf16_fp32_states", batch_size=1, seq_len=512,
                   gradient_checkpointing="full")
    states = next(c for c in est.phase_components["optimizer_step"] if c.name == "optimizer states")
    moments = sum(n.bytes for _, n in states.leaves() if " exp_avg" in n.name)
    return {"title": "13B weights and Adam moments", "params": est.params_total,
            "weights_gb": _component_gb(est, "weights"), "seed_weights_gb": 26.0,
            "adam_moments_gb": moments / GB, "seed_adam_moments_gb": 104.0,
            "explanation": "13.0e9 parameters x 2 B (bf16) = 26 GB; two fp32 moments x 4 B x 13.0e9 = 104 GB."}


def checkpointing_tradeoff(model: str = "llama-2-7b", batch_size: int = 8, seq_len: int = 2048,
                           attn_implementation: str = "eager", gpu: str = "H100 80GB") -> Dict[str, Any]:
    """Full vs selective activation checkpointing: memory and recomputed FLOPs.

    The write-up: full checkpointing cuts activations e.g. 60 GB -> 8 GB for ~36% more
    compute; selective (Korthikanti et al.) recomputes only the attention core for ~4%.
    With eager attention the attention core is what selective checkpointing saves; with
    SDPA/flash the kernel already recomputes it, so selective changes nothing there.
    ``step_seconds`` / ``extra_time``: the step timed on ``gpu`` (timing.py); time grows by
    less than the FLOPs where memory-bound kernels and the optimizer step take their share.
    """
    rows = []
    base = None
    for gc in ("none", "selective", "full"):
        est = estimate(model, gpu=gpu, precision="bf16", batch_size=batch_size, seq_len=seq_len,
                       gradient_checkpointing=gc, attn_implementation=attn_implementation)
        acts = est.phases_bytes["forward"] - est.phases_bytes["persistent"]
        base = est.step_seconds if base is None else base
        rows.append({"checkpointing": gc, "activations_gb": acts / GB, "peak_gb": est.peak_allocated_bytes / GB,
                     "extra_compute": est.recompute_overhead, "step_seconds": est.step_seconds,
                     "extra_time": est.step_seconds / base - 1.0, "gpu": gpu})
    return {"title": "Activation checkpointing: full vs selective", "model": model, "rows": rows,
            "seed": {"full": "60 GB -> 8 GB, ~36% extra compute", "selective": "~4% extra compute"}}


def four_bit_loading(model: str = "llama-2-7b", batch_size: int = 4, seq_len: int = 2048) -> Dict[str, Any]:
    """Why loading in 4 bits shrinks weights but not gradients, optimizer states or activations.

    Full fine-tuning cannot train 4-bit weights; QLoRA freezes them, so gradients and
    optimizer states shrink because only adapters train, not because of the 4 bits.
    Activations barely change: gradients still flow through every frozen matmul.
    """
    out = {}
    for label, kw in (("full bf16", dict(method="full")), ("LoRA bf16 base", dict(method="lora")),
                      ("QLoRA nf4 base", dict(method="qlora"))):
        est = estimate(model, batch_size=batch_size, seq_len=seq_len, gradient_checkpointing="full", **kw)
        out[label] = {
            "weights_gb": _component_gb(est, "weights") + _component_gb(est, "quantization constants"),
            "trainable_params": est.params_trainable,
            "gradients_gb": sum(n.bytes for n in est.phase_components["optimizer_step"]
                                if n.name == "gradients") / GB,
            "optimizer_states_gb": _component_gb(est, "optimizer states"),
            "activations_gb": (est.phases_bytes["forward"] - est.phases_bytes["persistent"]) / GB,
            "peak_gb": est.peak_allocated_bytes / GB,
        }
    return {"title": "4-bit loading", "model": model, "rows": out}


def which_layers_to_quantize(model: str = "llama-2-7b") -> Dict[str, Any]:
    """Weight memory when only some module groups are quantized (NF4), as the second seed
    discusses: the FFN holds most weights and tolerates 4 bits; attention V/O tolerate it
    better than Q/K; embeddings can be quantized in 8 bits."""
    rows = []
    for groups in (("mlp",), ("attn_vo",), ("attn_qk",), ("attn_vo", "mlp"), ("attn_qk", "attn_vo", "mlp")):
        est = estimate(model, method="qlora", quantized_groups=groups, batch_size=1, seq_len=512,
                       gradient_checkpointing="full")
        rows.append({"quantized": "+".join(groups),
                     "weights_gib": (_component_gb(est, "weights") + _component_gb(est, "quantization constants"))
                     * GB / GIB})
    return {"title": "Which layers to quantize", "model": model, "rows": rows}


