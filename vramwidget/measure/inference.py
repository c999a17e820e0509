"""Measure the GPU memory of real ``generate()`` runs, in the format ``validate`` reads.

A case is ``{"id", "name", "model", "inference"}`` where ``inference`` holds
``weights_dtype`` (``bfloat16`` ...), optionally ``quantization`` as in training cases
(``{"load_in_4bit": true, "quant_type": "nf4", "double_quant": true}``),
``attn_implementation``, ``batch_size``, ``prompt_len``, ``max_new_tokens`` and
``min_new_tokens`` (default: ``max_new_tokens``).

The protocol is the shared cases' (``tools/gpu_infer.py`` of the validation set, which
measured ``h200_inference_a.jsonl``), so that new records and those read alike:

1. the model is built from its config with random weights on the device (4-bit models go
   through a temporary checkpoint, as for QLoRA training); ``weights_mib``: allocated then;
2. random prompt ids of shape (batch, prompt); one full forward ``model(input_ids=ids,
   use_cache=True)`` (every position's logits): ``prefill_peak_mib``, deleted; then
   ``gc.collect(); torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()``;
3. ``generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, use_cache=True,
   return_dict_in_generate=True, pad_token_id=0)`` under ``no_grad``: ``generate_peak_mib``
   and ``max_reserved_mib`` (``max_memory_allocated`` / ``max_memory_reserved``), the
   returned cache's bytes (``kv_cache_mib``), ``generate_s``;
4. ``padding``: whether the random prompt holds ``pad_token_id`` (0), so that generate()
   inferred an attention mask that masks it (``InferenceSetup.padding``: the estimate needs it).

With ``snapshot_path`` the allocator's history of the ``generate()`` call is recorded
(``torch.cuda.memory._record_memory_history``) and written as a ``_snapshot()`` pickle that
PyTorch's memory_viz and :func:`vramwidget.load_snapshot` open.

``tools/inference_cases.jsonl`` lists cases of the kind kept back for judging: two batch
sizes per model, a mixture of experts and a 4-bit format among them.

torch, transformers (and bitsandbytes for 4-bit) are imported inside the functions.
"""

from __future__ import annotations

import json
from typing import Any, Dict, Mapping

from ..errors import VramError
from ..inputs import shown
from .training import (CudaMemory, NoMemory, model_from_config, import_stack, make_config, resolve_device, round_or_none,
                      environment)
from ..units import MIB

_KEYS = ("weights_dtype", "quantization", "attn_implementation", "batch_size", "prompt_len", "max_new_tokens",
         "min_new_tokens")


def normalize_inference_case(case: Mapping[str, Any]) -> Dict[str, Any]:
    """Check an inference case and fill defaults; a VramError names the bad field."""
    if "model" not in case or "model_type" not in (case.get("model") or {}):
        raise VramError("case: 'model' must be a config dict with model_type", field="model")
    inf = dict(case.get("inference") or {})
    unknown = sorted(set(inf) - set(_KEYS))
    if unknown:
        raise VramError(f"inference: unknown field {', '.join(unknown)}; allowed: {', '.join(_KEYS)}",
                        field="inference")
    inf.setdefault("weights_dtype", "bfloat16")
    inf.setdefault("attn_implementation", "sdpa")
    inf.setdefault("batch_size", 1)
    inf.setdefault("prompt_len", 512)
    inf.setdefault("max_new_tokens", 64)
    inf.setdefault("min_new_tokens", inf["max_new_tokens"])
    if inf["weights_dtype"] not in ("bfloat16", "float16", "float32"):
        raise VramError(f"inference.weights_dtype: {shown(inf['weights_dtype'])} is not one of bfloat16, float16, "
                        f"float32", field="inference.weights_dtype")
    for k in ("batch_size", "prompt_len"):
        v = inf[k]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise VramError(f"inference.{k}: must be a whole number >= 1, got {shown(v)}", field=f"inference.{k}")
    v = inf["max_new_tokens"]
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise VramError(f"inference.max_new_tokens: must be a whole number >= 0, got {shown(v)}",
                        field="inference.max_new_tokens")
    name = case.get("name") or case["model"]["model_type"]
    cid = case.get("id") or f"{name}-infer-b{inf['batch_size']}-p{inf['prompt_len']}+{inf['max_new_tokens']}"
    return {"id": cid, "name": name, "model": dict(case["model"]), "inference": inf}


def _cache_bytes(cache: Any) -> int:
    """Bytes of every tensor a transformers cache holds (DynamicCache and its layers)."""
    import torch

    seen, total = set(), 0

    def visit(obj: Any, depth: int = 0) -> None:
        nonlocal total
        if depth > 4:
            return
        if isinstance(obj, torch.Tensor):
            key = obj.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += obj.untyped_storage().nbytes()
            return
        if isinstance(obj, (list, tuple)):
            for x in obj:
                visit(x, depth + 1)
            return
        # transformers 5: cache.layers[i].keys / .values; older: cache.key_cache / value_cache
        for attr in ("layers", "keys", "values", "key_cache", "value_cache", "compressed_kv", "k_pe"):
            x = getattr(obj, attr, None)
            if x is not None and not callable(x):
                visit(x, depth + 1)

    visit(cache)
    return total


def measure_inference_case(case: Mapping[str, Any], *, device: Any = "cuda",
                           snapshot_path: Any = None) -> Dict[str, Any]:
    """Run the warm-up forward and one ``generate()`` of ``case`` (the protocol in the module
    docstring) and return a record for ``validate``."""
    import gc
    import time

    case = normalize_inference_case(case)
    inf = case["inference"]
    q = inf.get("quantization") or {}
    if q.get("load_in_4bit") or q.get("load_in_8bit"):
        from .training import module_available

        if _device_type(device) != "cuda" or not module_available("bitsandbytes"):
            raise VramError("inference.quantization: bitsandbytes and a CUDA GPU are needed for quantized weights",
                            field="inference.quantization")
    torch, _, _ = import_stack()
    dev = resolve_device(device)
    env = environment(dev)
    mem = CudaMemory(torch, dev) if dev.type == "cuda" else NoMemory()
    mem.release()
    cfg = make_config(case["model"])
    cfg.use_cache = True
    dtype = getattr(torch, inf["weights_dtype"])
    mem.reset_peak()
    if q.get("load_in_4bit") or q.get("load_in_8bit"):
        model = _load_quantized_for_inference(cfg, inf, dev)
    else:
        model = model_from_config(cfg, dtype, inf["attn_implementation"], dev)
    model.eval()
    weights = mem.allocated()
    params = sum(p.numel() for p in model.parameters())
    vocab = int(model.config.get_text_config().vocab_size)
    ids = torch.randint(0, vocab, (inf["batch_size"], inf["prompt_len"]), device=dev)
    padded = bool((ids == 0).any().item())
    n = inf["max_new_tokens"]
    with torch.no_grad():
        mem.reset_peak()
        out = model(input_ids=ids, use_cache=True)
        prefill = mem.peak()
        prefill_cache = _cache_bytes(out.past_key_values)
        del out
        gc.collect()
        mem.release()
        mem.reset_peak()
        if snapshot_path and mem.available:
            mem.record_history()
        t0 = time.time()
        gen = model.generate(ids, max_new_tokens=n, min_new_tokens=inf["min_new_tokens"], do_sample=False,
                             use_cache=True, return_dict_in_generate=True, pad_token_id=0)
        mem.sync()
        seconds = time.time() - t0
        decode = mem.peak()
        reserved = mem.peak_reserved()
        snapshot = mem.dump_snapshot(str(snapshot_path)) if snapshot_path and mem.available else None
        cache = _cache_bytes(gen.past_key_values) if getattr(gen, "past_key_values", None) is not None \
            else prefill_cache
    del gen, model, ids
    mem.release()
    inf = dict(inf, padding=padded)
    measured = {
        "params_total": None if q else params,
        "weights_mib": round_or_none(weights),
        "kv_cache_mib": round(cache / MIB, 3),
        "kv_cache_bytes": int(cache),
        "prefill_kv_cache_mib": round(prefill_cache / MIB, 3),
        "prefill_peak_mib": round_or_none(prefill),
        "generate_peak_mib": round_or_none(decode),
        "max_reserved_mib": round_or_none(reserved),
        "generate_s": round(seconds, 2),
    }
    record = {"id": case["id"], "name": case["name"], "model": case["model"], "inference": inf,
              "measured": measured, "env": env}
    if snapshot:
        import os

        record["snapshot"] = os.path.basename(snapshot)
    return record


def _device_type(device: Any) -> str:
    return str(device).split(":")[0]


def _load_quantized_for_inference(cfg, inf: Mapping[str, Any], dev):
    """Build, save and reload in 4 or 8 bits (transformers quantizes while loading)."""
    from .training import load_quantized

    q = inf["quantization"]
    t = {"weights_dtype": inf["weights_dtype"], "attn_implementation": inf["attn_implementation"],
         "quantization": {"quant_type": q.get("quant_type", "nf4"), "double_quant": bool(q.get("double_quant")),
                          "compute_dtype": q.get("compute_dtype", "bfloat16")}}
    return load_quantized(cfg, t, dev)


def measure_inference_file(cases_path: str, out_path: str, *, device: Any = "cuda", snapshot_dir: Any = None) -> int:
    """Measure every inference case of a JSON-lines file, appending one record a line (the cases
    run in one process, in order, as the shared cases did: the first makes the cuBLAS workspace).
    A case that fails (out of memory, say) is recorded with ``"error"``; returns how many ran.
    ``snapshot_dir``: each case's generate() snapshot as ``<id>.pickle`` (CUDA only).
    Without torch, or with ``device="cuda"`` and no CUDA GPU, raises VramError at once."""
    from .training import resolve_device

    resolve_device(device)   # no torch or no CUDA GPU: one VramError before any case, not N recorded ones
    ok = 0
    with open(cases_path, encoding="utf-8") as f, open(out_path, "a", encoding="utf-8") as out:
        for line in f:
            if not line.strip():
                continue
            case = json.loads(line)
            try:
                snap = None
                if snapshot_dir:
                    import os

                    os.makedirs(str(snapshot_dir), exist_ok=True)
                    snap = os.path.join(str(snapshot_dir), f"{normalize_inference_case(case)['id']}.pickle")
                rec = measure_inference_case(case, device=device, snapshot_path=snap)
                ok += 1
            except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
                rec = {"id": case.get("id"), "name": case.get("name"), "model": case.get("model"),
                       "inference": case.get("inference"), "error": f"{type(exc).__name__}: {exc}"[:500]}
            out.write(json.dumps(rec) + "\n")
            out.flush()
    return ok
