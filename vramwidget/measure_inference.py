"""Measure the GPU memory of real ``generate()`` runs, in the format ``validate`` reads.

A case is ``{"id", "name", "model", "inference"}`` where ``inference`` holds
``weights_dtype`` (``bfloat16`` ...), optionally ``quantization`` as in training cases
(``{"load_in_4bit": true, "quant_type": "nf4", "double_quant": true}``),
``attn_implementation``, ``batch_size``, ``prompt_len`` and ``max_new_tokens``.

The model is built from its config with random weights on the device (4-bit models go
through a temporary checkpoint, as for QLoRA training), then:

1. ``weights_mib``: allocated right after the build;
2. ``prefill_peak_mib``: the peak of one forward pass over the prompt with
   ``use_cache=True`` and ``logits_to_keep=1`` (what ``generate()`` runs first);
3. ``generate_peak_mib``: the peak of ``generate(max_new_tokens=n, min_new_tokens=n)``
   (greedy), its own prefill included: the number "will it run" is decided on;
4. ``kv_cache_mib``: the bytes of the cache tensors after ``generate()`` (prompt and new
   tokens), ``prefill_kv_cache_mib`` those after the prefill alone;
5. ``peak_allocated_mib``: the larger of the two peaks.

torch, transformers (and bitsandbytes for 4-bit) are imported inside the functions.
"""

from __future__ import annotations

import json
from typing import Any, Dict, Mapping

from .errors import VramError
from .inputs import shown
from .measure import (_CudaMemory, _NoMemory, _from_config, _import_stack, _make_config, _resolve_device, _round,
                      environment)
from .units import MIB

_KEYS = ("weights_dtype", "quantization", "attn_implementation", "batch_size", "prompt_len", "max_new_tokens")


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


def measure_inference_case(case: Mapping[str, Any], *, device: Any = "cuda") -> Dict[str, Any]:
    """Run one prefill and one ``generate()`` of ``case`` and return a record for ``validate``."""
    case = normalize_inference_case(case)
    inf = case["inference"]
    q = inf.get("quantization") or {}
    if q.get("load_in_4bit") or q.get("load_in_8bit"):
        from .measure import _module_available

        if _device_type(device) != "cuda" or not _module_available("bitsandbytes"):
            raise VramError("inference.quantization: bitsandbytes and a CUDA GPU are needed for quantized weights",
                            field="inference.quantization")
    torch, _, _ = _import_stack()
    dev = _resolve_device(device)
    env = environment(dev)
    mem = _CudaMemory(torch, dev) if dev.type == "cuda" else _NoMemory()
    mem.release()
    cfg = _make_config(case["model"])
    cfg.use_cache = True
    dtype = getattr(torch, inf["weights_dtype"])
    mem.reset_peak()
    if q.get("load_in_4bit") or q.get("load_in_8bit"):
        model = _load_quantized_for_inference(cfg, inf, dev)
    else:
        model = _from_config(cfg, dtype, inf["attn_implementation"], dev)
    model.eval()
    weights = mem.allocated()
    params = sum(p.numel() for p in model.parameters())
    g = torch.Generator(device=dev).manual_seed(0)
    vocab = int(model.config.get_text_config().vocab_size)
    ids = torch.randint(0, vocab, (inf["batch_size"], inf["prompt_len"]), device=dev, generator=g)
    with torch.no_grad():
        mem.reset_peak()
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        prefill = mem.peak()
        prefill_cache = _cache_bytes(out.past_key_values)
        del out
        mem.release()
        mem.reset_peak()
        gen = model.generate(ids, max_new_tokens=inf["max_new_tokens"], min_new_tokens=inf["max_new_tokens"],
                             do_sample=False, return_dict_in_generate=True, pad_token_id=0)
        decode = mem.peak()
        cache = _cache_bytes(gen.past_key_values) if getattr(gen, "past_key_values", None) is not None \
            else prefill_cache
    del gen, model
    mem.release()
    measured = {
        "params_total": None if q else params,
        "weights_mib": _round(weights),
        "kv_cache_mib": round(cache / MIB, 3),
        "kv_cache_bytes": int(cache),
        "prefill_kv_cache_mib": round(prefill_cache / MIB, 3),
        "prefill_peak_mib": _round(prefill),
        "generate_peak_mib": _round(decode),
        "peak_allocated_mib": None if prefill is None else _round(max(prefill, decode)),
    }
    return {"id": case["id"], "name": case["name"], "model": case["model"], "inference": inf,
            "measured": measured, "env": env}


def _device_type(device: Any) -> str:
    return str(device).split(":")[0]


def _load_quantized_for_inference(cfg, inf: Mapping[str, Any], dev):
    """Build, save and reload in 4 or 8 bits (transformers quantizes while loading)."""
    from .measure import _load_quantized

    q = inf["quantization"]
    t = {"weights_dtype": inf["weights_dtype"], "attn_implementation": inf["attn_implementation"],
         "quantization": {"quant_type": q.get("quant_type", "nf4"), "double_quant": bool(q.get("double_quant")),
                          "compute_dtype": q.get("compute_dtype", "bfloat16")}}
    return _load_quantized(cfg, t, dev)


def measure_inference_file(cases_path: str, out_path: str, *, device: Any = "cuda") -> int:
    """Measure every inference case of a JSON-lines file, appending one record a line.
    A case that fails (out of memory, say) is recorded with ``"error"``; returns how many ran.
    Without torch, or with ``device="cuda"`` and no CUDA GPU, raises VramError at once."""
    from .measure import _resolve_device

    _resolve_device(device)   # no torch or no CUDA GPU: one VramError before any case, not N recorded ones
    ok = 0
    with open(cases_path, encoding="utf-8") as f, open(out_path, "a", encoding="utf-8") as out:
        for line in f:
            if not line.strip():
                continue
            case = json.loads(line)
            try:
                rec = measure_inference_case(case, device=device)
                ok += 1
            except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
                rec = {"id": case.get("id"), "name": case.get("name"), "model": case.get("model"),
                       "inference": case.get("inference"), "error": f"{type(exc).__name__}: {exc}"[:500]}
            out.write(json.dumps(rec) + "\n")
            out.flush()
    return ok
