"""Compare estimates with measured training steps (the validation file format).

Each line of a cases file holds ``model`` (a config.json dict), ``training`` and
``measured`` (see ``data/VALIDATION.md``).  The error of a field is
``(estimate - measured) / measured``.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Iterable, List, Optional, Union

from .architecture import from_config
from .errors import VramError
from .estimate import CUBLAS_WORKSPACE_BYTES, estimate_setup
from .training import setup_from_case
from .units import MIB

DATA_DIR = os.path.join(os.path.dirname(__file__), "data")
#: the 45 measured H200 cases shipped with the package
BUILTIN_CASES = os.path.join(DATA_DIR, "h200_training_a.jsonl")

FIELDS = ("weights_mib", "persistent_after_step_mib", "forward_peak_mib", "backward_peak_mib",
          "optimizer_step_peak_mib", "peak_allocated_mib", "first_step_peak_mib", "max_reserved_mib")


def load_cases(path_or_lines: Union[str, Iterable[str]]) -> List[Dict[str, Any]]:
    """Read a JSONL cases file; a bad line gives a VramError naming its number."""
    if isinstance(path_or_lines, str):
        try:
            with open(path_or_lines, encoding="utf-8") as f:
                lines = f.readlines()
        except OSError as e:
            raise VramError(f"cases: cannot read {path_or_lines!r}: {e.strerror or e}", field="cases") from None
    else:
        lines = list(path_or_lines)
    cases = []
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        try:
            c = json.loads(line)
        except json.JSONDecodeError as e:
            raise VramError(f"cases: line {n} is not valid JSON ({e.msg})", field="cases") from None
        if "env" in c and "model" not in c:
            continue  # a raw file's header line
        for key in ("model", "training"):
            if key not in c:
                raise VramError(f"cases: line {n} has no {key!r} field", field="cases")
        c.setdefault("id", f"line{n}")
        cases.append(c)
    return cases


def predict_case(case: Dict[str, Any], *, cold_process: bool = False) -> Dict[str, Any]:
    """The estimate of one case in the measured fields' units (MiB).

    ``cold_process``: the case ran first in its process, so when its model was built no
    matmul had yet allocated the cuBLAS workspace (the cases of one file run one after
    another in one process, and the workspace, once allocated, stays).
    """
    arch = from_config(case["model"], name=case.get("name") or case["model"].get("model_type"))
    setup = setup_from_case(case["training"])
    est = estimate_setup(arch, setup)
    ph = est.phases_bytes
    weights = ph["after_load"] - (CUBLAS_WORKSPACE_BYTES if cold_process else 0.0)
    return {
        "params_total": None if setup.quantized else est.params_total,
        "params_trainable": est.params_trainable,
        "weights_mib": weights / MIB,
        "persistent_after_step_mib": ph["persistent"] / MIB,
        "forward_peak_mib": ph["forward"] / MIB,
        "backward_peak_mib": ph["backward"] / MIB,
        "optimizer_step_peak_mib": ph["optimizer_step"] / MIB,
        "peak_allocated_mib": est.peak_allocated_bytes / MIB,
        "first_step_peak_mib": ph["first_step"] / MIB,
        "max_reserved_mib": est.reserved_bytes / MIB,
    }


def validate(cases: Union[str, List[Dict[str, Any]]]) -> Dict[str, Any]:
    """Predict every case and compare; returns per-case rows and summary statistics."""
    if isinstance(cases, str):
        cases = load_cases(cases)
    rows = []
    for n, c in enumerate(cases):
        try:
            pred = predict_case(c, cold_process=(n == 0))
        except VramError as e:
            rows.append({"id": c["id"], "name": c.get("name"), "error_message": str(e)})
            continue
        meas = c.get("measured") or {}
        err: Dict[str, Optional[float]] = {}
        for f in FIELDS:
            m = meas.get(f)
            err[f] = (pred[f] - m) / m if m else None
        rows.append({"id": c["id"], "name": c.get("name"), "training": c["training"], "predicted": pred,
                     "measured": meas, "error": err})
    return {"cases": rows, "summary": summarize(rows)}


def _pct(sorted_vals: List[float], q: float) -> float:
    if not sorted_vals:
        return float("nan")
    k = (len(sorted_vals) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (k - lo)


def summarize(rows: List[Dict[str, Any]]) -> Dict[str, Dict[str, float]]:
    """Median, 90th percentile and max of |error| for each measured field."""
    out: Dict[str, Dict[str, float]] = {}
    for f in FIELDS:
        vals = sorted(abs(r["error"][f]) for r in rows if "error" in r and r["error"].get(f) is not None)
        if vals:
            out[f] = {"n": len(vals), "median": _pct(vals, 0.5), "p90": _pct(vals, 0.9), "max": vals[-1]}
    return out


def format_report(result: Dict[str, Any]) -> str:
    """The comparison as a text table plus the summary lines."""
    lines = [f"{'id':6} {'name':14} {'setup':44} {'measured':>10} {'estimate':>10} {'error':>7}"]
    for r in result["cases"]:
        if "error_message" in r:
            lines.append(f"{r['id']:6} {str(r['name'])[:14]:14} cannot estimate: {r['error_message']}")
            continue
        t = r["training"]
        desc = (f"{t.get('method')} {t.get('weights_dtype', '')[:4]}{'+ac' if t.get('autocast_dtype') else ''} "
                f"{t.get('optimizer')} {'gc ' if t.get('gradient_checkpointing') else ''}"
                f"{t.get('attn_implementation')} b{t.get('batch_size')} s{t.get('seq_len')}")
        m = r["measured"].get("peak_allocated_mib")
        p = r["predicted"]["peak_allocated_mib"]
        e = r["error"]["peak_allocated_mib"]
        lines.append(f"{r['id']:6} {str(r['name'])[:14]:14} {desc[:44]:44} "
                     f"{m if m is not None else float('nan'):10.1f} {p:10.1f} "
                     f"{(e * 100 if e is not None else float('nan')):+6.1f}%")
    s = result["summary"]
    lines.append("")
    for f in ("weights_mib", "persistent_after_step_mib", "peak_allocated_mib", "max_reserved_mib"):
        if f in s:
            v = s[f]
            lines.append(f"{f:28} |error| median {v['median'] * 100:5.2f}%  p90 {v['p90'] * 100:5.2f}%  "
                         f"max {v['max'] * 100:5.2f}%  (n={v['n']})")
    return "\n".join(lines)


def to_json_rows(result: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The ``--json`` form: id, predicted (five fields) and the error of each."""
    out = []
    for r in result["cases"]:
        if "error_message" in r:
            out.append({"id": r["id"], "error_message": r["error_message"]})
            continue
        p = r["predicted"]
        out.append({
            "id": r["id"],
            "predicted": {k: (round(p[k], 1) if isinstance(p[k], float) else p[k]) for k in
                          ("params_total", "params_trainable", "weights_mib", "peak_allocated_mib",
                           "max_reserved_mib")},
            "error": {k: (round(v, 4) if v is not None else None) for k, v in r["error"].items()},
        })
    return out
