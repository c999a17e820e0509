"""Exact estimates of every built-in preset under a spread of setups (training and inference).

Recorded once before the family plug-in refactor (issue 11) into
tests/data/refactor_snapshot.json; tests/test_families.py recomputes them and requires the
same bytes, so moving code between modules cannot change a number.

usage: python tools/refactor_snapshot.py > tests/data/refactor_snapshot.json
"""

from __future__ import annotations

import json
import sys
from typing import Any, Dict, List

TRAIN_SETUPS: List[Dict[str, Any]] = [
    dict(method="full", precision="bf16", batch_size=2, seq_len=512),
    dict(method="full", precision="amp_bf16", attn_implementation="eager", batch_size=1, seq_len=256),
    dict(method="full", precision="fp32", gradient_checkpointing="full", batch_size=1, seq_len=1024),
    dict(method="lora", precision="bf16", lora_targets="all-linear", lora_dropout=0.05, batch_size=2, seq_len=512),
    dict(method="qlora", gradient_checkpointing="full", batch_size=4, seq_len=1024),
    dict(method="full", precision="bf16", gradient_checkpointing="selective", batch_size=1, seq_len=2048),
    dict(method="full", precision="bf16", attn_implementation="flash_attention_2", optimizer="adamw_8bit",
         batch_size=1, seq_len=4096),
]
INFER_SETUPS: List[Dict[str, Any]] = [
    dict(weights="bf16", context_len=8192),
    dict(weights="nf4", context_len=32768, batch_size=4, attn_implementation="eager"),
    dict(weights="q4_k_m", context_len=4096),
    dict(weights="awq-4bit", context_len=16384, batch_size=8),
]


def snapshot() -> Dict[str, Any]:
    import vramwidget as vw
    from vramwidget import list_presets

    out: Dict[str, Any] = {}
    for name in list_presets():
        row: Dict[str, Any] = {}
        for i, st in enumerate(TRAIN_SETUPS):
            try:
                e = vw.estimate(name, **st)
                row[f"train{i}"] = [e.peak_allocated_bytes, e.phases_bytes["forward"], e.phases_bytes["backward"],
                                    e.reserved_bytes]
            except vw.VramError as err:
                row[f"train{i}"] = f"error: {err}"
        for i, st in enumerate(INFER_SETUPS):
            try:
                r = vw.estimate_inference(name, **st)
                row[f"infer{i}"] = [r.peak_allocated_bytes, r.kv_cache_bytes, r.phases_bytes]
            except vw.VramError as err:
                row[f"infer{i}"] = f"error: {err}"
        out[name] = row
    return out


if __name__ == "__main__":
    json.dump(snapshot(), sys.stdout, indent=0, sort_keys=True)
    sys.stdout.write("\n")
