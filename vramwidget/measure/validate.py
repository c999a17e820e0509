"""Compare estimates with measured training steps (the validation file format).

Each line of a cases file holds ``model`` (a config.json dict), ``training`` and
``measured`` (see ``data/VALIDATION.md``).  The error of a field is
``(estimate - measured) / measured``.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Iterable, List, Optional, Union

from ..model.architecture import from_config
from ..errors import VramError
from ..inputs import shown
from ..estimate import CUBLAS_WORKSPACE_BYTES, estimate_setup
from ..training import setup_from_case
from ..units import MIB

DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data")
#: the 45 measured H200 cases shipped with the package
BUILTIN_CASES = os.path.join(DATA_DIR, "h200_training_a.jsonl")

FIELDS = ("weights_mib", "persistent_after_step_mib", "forward_peak_mib", "backward_peak_mib",
          "optimizer_step_peak_mib", "peak_allocated_mib", "first_step_peak_mib", "max_reserved_mib")
#: timed fields: predicted where the case's ``env.gpu`` names a catalogue GPU (timing.py)
TIME_FIELDS = ("step_seconds",)


def case_gpu(case: Dict[str, Any]) -> Any:
    """The catalogue GPU a case ran on (``env.gpu``, e.g. "NVIDIA H200"), or None."""
    from ..gpus import get_gpu

    name = (case.get("env") or {}).get("gpu")
    if not name:
        return None
    try:
        return get_gpu(name)
    except VramError:
        return None


def load_cases(path_or_lines: Union[str, Iterable[str]]) -> List[Dict[str, Any]]:
    """Read a JSONL cases file; a bad line gives a VramError naming its number."""
    if isinstance(path_or_lines, str):
        try:
            with open(path_or_lines, encoding="utf-8") as f:
                lines = f.readlines()
        except OSError as e:
            raise VramError(f"cases: cannot read {shown(path_or_lines)}: {e.strerror or e}", field="cases") from None
        except UnicodeDecodeError:
            raise VramError(f"cases: {shown(path_or_lines)} is not UTF-8 text (a JSON-lines file)",
                            field="cases") from None
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
        except RecursionError:
            raise VramError(f"cases: line {n} nests deeper than a case", field="cases") from None
        if not isinstance(c, dict):
            raise VramError(f"cases: line {n} holds a {type(c).__name__}, not a case (a JSON object)", field="cases")
        if "env" in c and "model" not in c:
            continue  # a raw file's header line
        if "model" not in c:
            raise VramError(f"cases: line {n} has no 'model' field", field="cases")
        if "training" not in c and "inference" not in c:
            raise VramError(f"cases: line {n} has neither a 'training' nor an 'inference' field", field="cases")
        c.setdefault("id", f"line{n}")
        cases.append(c)
    return cases


def predict_case(case: Dict[str, Any], *, cold_process: bool = False, backend: str = "analytic") -> Dict[str, Any]:
    """The estimate of one case in the measured fields' units (MiB).

    ``cold_process``: the case ran first in its process, so when its model was built no
    matmul had yet allocated the cuBLAS workspace (the cases of one file run one after
    another in one process, and the workspace, once allocated, stays).
    """
    setup = setup_from_case(case["training"])
    gpu = case_gpu(case)
    if backend == "analytic":
        arch = from_config(case["model"], name=case.get("name") or case["model"].get("model_type"))
        est = estimate_setup(arch, setup, gpu=gpu)
    else:
        from ..estimate import estimate

        est = estimate(case["model"], gpu=gpu, **{**setup.to_dict(), "backend": backend})
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
        # the measured field is the largest steady phase (steps 2 and 3; validation/README.md);
        # est.peak_allocated_bytes also counts the first step, when the states are made
        "peak_allocated_mib": max(ph["forward"], ph["backward"], ph["optimizer_step"]) / MIB,
        "first_step_peak_mib": ph["first_step"] / MIB,
        "max_reserved_mib": est.reserved_bytes / MIB,
        "step_seconds": est.step_seconds,
    }


#: measured fields of inference cases (generate() runs), where a file has them
INFERENCE_FIELDS = ("weights_mib", "kv_cache_mib", "prefill_peak_mib", "generate_peak_mib", "peak_allocated_mib")


def inference_setup_from_case(inference: Dict[str, Any]) -> Dict[str, Any]:
    """An inference case's record -> estimate_inference keywords.

    Reads the spellings a generate() measurement would naturally record: ``weights_dtype``
    (or ``dtype``), a ``quantization`` dict as in training cases (``load_in_4bit`` with
    ``quant_type``, ``load_in_8bit``) or a ``weights`` format name, ``batch_size``,
    ``prompt_len`` (or ``seq_len`` / ``input_len``), ``max_new_tokens`` (or
    ``new_tokens``), ``kv_cache_dtype`` and ``attn_implementation``.
    """
    kw: Dict[str, Any] = {}
    q = inference.get("quantization") or {}
    if inference.get("weights"):
        kw["weights"] = inference["weights"]
    elif q.get("load_in_4bit"):
        kw["weights"] = q.get("quant_type", "nf4")
        kw["double_quant"] = bool(q.get("double_quant", False))
    elif q.get("load_in_8bit"):
        kw["weights"] = "int8"
    else:
        kw["weights"] = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(
            inference.get("weights_dtype") or inference.get("dtype") or "bfloat16", "bf16")
    prompt = inference.get("prompt_len", inference.get("seq_len", inference.get("input_len")))
    new = inference.get("max_new_tokens", inference.get("new_tokens", 0)) or 0
    if prompt is not None:
        # generate() never feeds its last token back: the cache ends at prompt + new - 1
        kw["prompt_len"] = int(prompt)
        kw["context_len"] = int(prompt) + max(int(new) - 1, 0)
    for key in ("batch_size", "attn_implementation", "kv_cache_dtype", "padding"):
        if inference.get(key) is not None:
            kw[key] = inference[key]
    # the measured protocol (validation/README.md, measure-inference): generate(...,
    # min_new_tokens=n) unless the record says otherwise
    kw["min_new_tokens"] = int(inference.get("min_new_tokens", new) or 0)
    return kw


def predict_inference_case(case: Dict[str, Any], *, cold_process: bool = False,
                           workspace_segment_bytes: Optional[float] = None) -> Dict[str, Any]:
    """The inference estimate of one case in MiB (weights, KV cache, prefill and decode peaks),
    the generate() figures as the measurement protocol records them
    (``inference_events.measured_figures``: the warm-up forward, ``empty_cache``, the peaks
    reset, then generate()).  ``cold_process``: the case ran first in its process (no cuBLAS
    workspace yet); otherwise the workspace sits in a cached segment of
    ``workspace_segment_bytes`` (the first case's, ``workspace_segment_bytes`` of its row).
    The case's ``env.transformers`` picks the transformers behaviour modelled; a case that does
    not record whether its random prompt held ``pad_token_id`` (``padding``) gets the likelier
    answer (``inference_events.likely_padding``)."""
    from ..inference.estimate import estimate_inference
    from ..inference.events import likely_padding, measured_figures

    arch = from_config(case["model"], name=case.get("name") or case["model"].get("model_type"))
    kw = inference_setup_from_case(case["inference"])
    env = case.get("env") or {}
    if env.get("transformers") and "versions" not in kw:
        kw["versions"] = {"transformers": str(env["transformers"])}
    if "padding" not in kw:
        kw["padding"] = likely_padding(int(kw.get("batch_size", 1)), int(kw.get("prompt_len", 1)), arch.vocab_size)
    est = estimate_inference(arch, **kw)
    ph = est.phases_bytes
    seg = None if cold_process else int(workspace_segment_bytes or 32 * MIB)
    fig = measured_figures(*est.sources.inference, workspace_segment_bytes=seg)
    return {
        "params_total": est.params_total,
        "params_trainable": 0,
        "weights_mib": fig["weights_bytes"] / MIB,
        "kv_cache_mib": est.kv_cache_bytes / MIB,
        "prefill_peak_mib": ph.get("prefill", est.peak_allocated_bytes) / MIB,
        "decode_peak_mib": ph.get("decode", est.peak_allocated_bytes) / MIB,
        "generate_peak_mib": fig["generate_peak_bytes"] / MIB,
        "peak_allocated_mib": est.peak_allocated_bytes / MIB,
        "max_reserved_mib": fig["max_reserved_bytes"] / MIB,
        "workspace_segment_bytes": fig["workspace_segment_bytes"],
    }


def validate(cases: Union[str, List[Dict[str, Any]]], backend: str = "analytic") -> Dict[str, Any]:
    """Predict every case and compare; returns per-case rows and summary statistics.

    ``backend``: "analytic" (default), "trace" (every training case traced, see
    ``vramwidget.trace``) or "auto" (traced where no family module models the case)."""
    if isinstance(cases, str):
        cases = load_cases(cases)
    rows = []
    ws_segment: Optional[float] = None
    for n, c in enumerate(cases):
        inference = "training" not in c
        try:
            if inference:
                pred = predict_inference_case(c, cold_process=(n == 0), workspace_segment_bytes=ws_segment)
                if n == 0:
                    ws_segment = pred["workspace_segment_bytes"]
            else:
                pred = predict_case(c, cold_process=(n == 0), backend=backend)
        except VramError as e:
            rows.append({"id": c["id"], "name": c.get("name"), "error_message": str(e)})
            continue
        meas = c.get("measured") or {}
        err: Dict[str, Optional[float]] = {}
        for f in pred:
            m = meas.get(f)
            if f.endswith("_mib") or f in TIME_FIELDS:
                err[f] = (pred[f] - m) / m if (m and pred[f] is not None) else None
        rows.append({"id": c["id"], "name": c.get("name"), "training": c.get("training") or c.get("inference"),
                     "kind": "inference" if inference else "training", "predicted": pred, "measured": meas,
                     "error": err})
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
    for f in dict.fromkeys(FIELDS + INFERENCE_FIELDS + TIME_FIELDS):
        vals = sorted(abs(r["error"][f]) for r in rows if "error" in r and r["error"].get(f) is not None)
        if vals:
            out[f] = {"n": len(vals), "median": _pct(vals, 0.5), "p90": _pct(vals, 0.9), "max": vals[-1]}
    return out


def format_report(result: Dict[str, Any]) -> str:
    """The comparison as a text table plus the summary lines."""
    lines = [f"{'id':6} {'name':14} {'setup':44} {'measured':>10} {'estimate':>10} {'error':>7}"
             f"   {'step s':>7} {'est. s':>7} {'error':>7}"]
    for r in result["cases"]:
        if "error_message" in r:
            lines.append(f"{r['id']:6} {str(r['name'])[:14]:14} cannot estimate: {r['error_message']}")
            continue
        t = r["training"]
        if r.get("kind") == "inference":
            desc = (f"inference {t.get('weights') or t.get('weights_dtype', '')} {t.get('attn_implementation', '')} "
                    f"b{t.get('batch_size')} p{t.get('prompt_len', t.get('seq_len'))} "
                    f"+{t.get('max_new_tokens', t.get('new_tokens', 0))}")
        else:
            desc = (f"{t.get('method')} {_precision_label(t)} "
                    f"{t.get('optimizer')} {'gc ' if t.get('gradient_checkpointing') else ''}"
                    f"{t.get('attn_implementation')} b{t.get('batch_size')} s{t.get('seq_len')}")
        m = r["measured"].get("peak_allocated_mib")
        p = r["predicted"]["peak_allocated_mib"]
        e = r["error"]["peak_allocated_mib"]
        line = (f"{r['id']:6} {str(r['name'])[:14]:14} {desc[:44]:44} "
                f"{m if m is not None else float('nan'):10.1f} {p:10.1f} "
                f"{(e * 100 if e is not None else float('nan')):+6.1f}%")
        ts, tp, te = r["measured"].get("step_seconds"), r["predicted"].get("step_seconds"), r["error"].get("step_seconds")
        if ts is not None and tp is not None and te is not None:
            line += f"   {ts:7.3f} {tp:7.3f} {te * 100:+6.1f}%"
        lines.append(line)
    s = result["summary"]
    lines.append("")
    for f in ("weights_mib", "persistent_after_step_mib", "kv_cache_mib", "prefill_peak_mib", "generate_peak_mib",
              "peak_allocated_mib", "max_reserved_mib", "step_seconds"):
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
        keys = ("params_total", "params_trainable", "weights_mib", "peak_allocated_mib", "max_reserved_mib")
        if r.get("kind") == "inference":
            keys += ("kv_cache_mib", "prefill_peak_mib", "decode_peak_mib", "generate_peak_mib")
        pred = {k: (round(p[k], 1) if isinstance(p[k], float) else p[k]) for k in keys}
        if p.get("step_seconds") is not None:
            pred["step_seconds"] = round(p["step_seconds"], 4)
        out.append({
            "id": r["id"],
            "predicted": pred,
            "error": {k: (round(v, 4) if v is not None else None) for k, v in r["error"].items()},
        })
    return out


def _precision_label(training: Dict[str, Any]) -> str:
    """The case's precision as the estimator's setup names it (bf16, fp32, amp_bf16, ...)."""
    ac = training.get("autocast_dtype")
    if ac:
        return "amp_fp16" if str(ac) in ("float16", "fp16", "torch.float16") else "amp_bf16"
    wd = str(training.get("weights_dtype", ""))
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(wd, wd or "?")
