#!/usr/bin/env python3
"""Record reference parameter counts and tensor shapes with real transformers models.

For every preset in ``vramwidget/presets/*.json`` and every distinct architecture
config in ``vramwidget/data/h200_training_a.jsonl`` (keyed ``validation:<name>``),
the model is built with ``AutoModelForCausalLM.from_config`` on the ``meta``
device (shapes only, no memory, no weights) and the script records:

* ``params_total``: sum of ``numel`` over ``model.parameters()`` (tied weights once),
* ``tensors``: named parameters collapsed across layers/experts
  (``model.layers.{i}.mlp.experts.{e}.w1.weight``) with shape and count,
* ``tied``: parameter names that alias another parameter (not counted again),
* ``buffers_total``: numel of registered buffers (rotary tables and the like),
* ``lora``: peft LoRA trainable counts (validation configs: every distinct
  (r, target_modules) of the lora/qlora cases; a few extra reference points for
  llama-2-7b and qwen2.5-0.5b),
* versions of transformers/torch/peft, ``model_type`` and ``config_class``.

Output: ``tests/data/param_counts.json`` (sorted keys, indent 1).

Usage::

    python tools/record_param_counts.py                 # everything
    python tools/record_param_counts.py llama-2-7b gpt2 # only these (merged into the file)
    python tools/record_param_counts.py --check         # exit 1 on a validation mismatch

Needs torch, transformers and (for LoRA counts) peft. No network, no GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import re
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRESET_DIR = ROOT / "vramwidget" / "presets"
VALIDATION_FILE = ROOT / "vramwidget" / "data" / "h200_training_a.jsonl"
OUT_FILE = ROOT / "tests" / "data" / "param_counts.json"

ALL_PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# Extra LoRA reference points recorded for some presets: (r, target_modules).
EXTRA_LORA = {
    "llama-2-7b": [(8, ["q_proj", "v_proj"]), (16, "all-linear"), (16, ALL_PROJ)],
    "qwen2.5-0.5b": [(8, ["q_proj", "v_proj"]), (16, "all-linear"), (16, ALL_PROJ)],
}

# Keys of a config.json that are metadata, not constructor arguments.
_DROP_KEYS = {"_name_or_path", "transformers_version", "auto_map"}

_NUM = re.compile(r"(?<=\.)\d+(?=\.|$)")


def collapse_name(name: str) -> str:
    """Replace the first numeric path component by {i}, the second by {e}."""
    placeholders = iter(["{i}", "{e}", "{j}", "{k}"])
    return _NUM.sub(lambda m: next(placeholders), name)


def load_presets() -> dict[str, dict]:
    presets = {}
    for path in sorted(PRESET_DIR.glob("*.json")):
        data = json.loads(path.read_text())
        presets[data["name"]] = data
    return presets


def load_validation() -> tuple[dict[str, dict], dict[str, list[dict]]]:
    """Distinct model configs by case name, and the cases of each name."""
    configs: dict[str, dict] = {}
    cases: dict[str, list[dict]] = {}
    for line in VALIDATION_FILE.read_text().splitlines():
        if not line.strip():
            continue
        case = json.loads(line)
        name = case["name"]
        prev = configs.setdefault(name, case["model"])
        if prev != case["model"]:
            raise SystemExit(f"validation name {name!r} has more than one model config")
        cases.setdefault(name, []).append(case)
    return configs, cases


def build_config(fields: dict):
    import transformers

    fields = {k: v for k, v in fields.items() if k not in _DROP_KEYS}
    model_type = fields.pop("model_type")
    return transformers.AutoConfig.for_model(model_type, **fields)


@contextlib.contextmanager
def quiet():
    """Silence transformers/peft chatter (config warnings, init notices)."""
    import transformers

    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sink = io.StringIO()
        with contextlib.redirect_stderr(sink):
            try:
                yield
            finally:
                transformers.logging.set_verbosity(level)


#: the transformers Auto class of each vramwidget task (the model class a user fine-tunes)
AUTO_CLASS = {"causal_lm": "AutoModelForCausalLM", "image_text_to_text": "AutoModelForImageTextToText",
              "seq2seq_lm": "AutoModelForSeq2SeqLM", "masked_lm": "AutoModelForMaskedLM"}


def task_of(fields: dict, task: str | None = None) -> str:
    """The task vramwidget counts for this config (its family's default unless given)."""
    sys.path.insert(0, str(ROOT))
    from vramwidget.model.families import REGISTRY, resolve_model_type

    fam = REGISTRY.get(resolve_model_type(str(fields.get("model_type"))))
    return task or (fam.task if fam is not None else "causal_lm")


def build_model(fields: dict, task: str | None = None):
    import torch
    import transformers

    with quiet():
        config = build_config(fields)
        with torch.device("meta"):
            model = getattr(transformers, AUTO_CLASS[task_of(fields, task)]).from_config(config)
    return config, model


def describe(config, model) -> dict:
    import peft
    import torch
    import transformers

    tensors: dict[str, dict] = {}
    total = 0
    for name, param in model.named_parameters():
        total += param.numel()
        key = collapse_name(name)
        shape = list(param.shape)
        entry = tensors.get(key)
        if entry is None:
            tensors[key] = {"name": key, "shape": shape, "count": 1}
        elif entry["shape"] != shape:
            # Same collapsed name with another shape: keep them apart.
            alt = f"{key}#{'x'.join(map(str, shape))}"
            tensors.setdefault(alt, {"name": key, "shape": shape, "count": 0})["count"] += 1
        else:
            entry["count"] += 1
    assert total == sum(p.numel() for p in model.parameters())

    # Parameters reachable under a second name (tied weights), counted once above.
    first_name: dict[int, str] = {}
    tied = []
    for name, param in model.named_parameters(remove_duplicate=False):
        pid = id(param)
        if pid in first_name:
            tied.append({"name": name, "same_as": first_name[pid]})
        else:
            first_name[pid] = name

    buffers_total = sum(b.numel() for b in model.buffers())

    return {
        "params_total": total,
        "tensors": list(tensors.values()),
        "tied": tied,
        "buffers_total": buffers_total,
        "model_type": config.model_type,
        "config_class": type(config).__name__,
        "model_class": type(model).__name__,
        "transformers": transformers.__version__,
        "torch": torch.__version__.split("+")[0],
        "peft": peft.__version__,
    }


def lora_count(fields: dict, r: int, targets) -> dict:
    import peft

    _, model = build_model(fields)
    cfg = peft.LoraConfig(r=r, lora_alpha=32, lora_dropout=0.0, target_modules=targets)
    with quiet():
        pm = peft.get_peft_model(model, cfg)
    trainable = sum(p.numel() for p in pm.parameters() if p.requires_grad)
    total = sum(p.numel() for p in pm.parameters())
    lora_tensors: dict[str, dict] = {}
    for name, p in pm.named_parameters():
        if not p.requires_grad:
            continue
        key = collapse_name(name.removeprefix("base_model.model."))
        e = lora_tensors.setdefault(key, {"name": key, "shape": list(p.shape), "count": 0})
        e["count"] += 1
    return {
        "r": r,
        "lora_alpha": 32,
        "target_modules": targets,
        "params_trainable": trainable,
        "params_total": total,
        "tensors": list(lora_tensors.values()),
    }


def record_preset(name: str, preset: dict) -> dict:
    config, model = build_model(preset["config"], preset.get("task"))
    out = describe(config, model)
    out["source"] = f"vramwidget/presets/{name}.json"
    extras = EXTRA_LORA.get(name, [])
    if extras:
        out["lora"] = [lora_count(preset["config"], r, t) for r, t in extras]
    return out


def record_validation(name: str, fields: dict, cases: list[dict], problems: list[str]) -> dict:
    config, model = build_model(fields)
    out = describe(config, model)
    out["source"] = f"vramwidget/data/h200_training_a.jsonl ({', '.join(c['id'] for c in cases)})"
    full = [c for c in cases if c["training"]["method"] == "full"]
    measured_totals = {c["measured"]["params_total"] for c in full if c["measured"].get("params_total")}
    out["measured_params_total"] = sorted(measured_totals)
    for m in measured_totals:
        if m != out["params_total"]:
            problems.append(f"validation:{name}: params_total {out['params_total']} != measured {m}")

    lora_cases: dict[tuple, list[dict]] = {}
    for c in cases:
        t = c["training"]
        if t["method"] in ("lora", "qlora"):
            lc = t["lora"]
            key = (lc["r"], tuple(lc["target_modules"]))
            lora_cases.setdefault(key, []).append(c)
    loras = []
    for (r, targets), cs in sorted(lora_cases.items()):
        rec = lora_count(fields, r, list(targets))
        rec["cases"] = [c["id"] for c in cs]
        rec["measured_params_trainable"] = sorted({c["measured"]["params_trainable"] for c in cs})
        rec["measured_params_total"] = sorted(
            {c["measured"]["params_total"] for c in cs if c["measured"].get("params_total")}
        )
        for m in rec["measured_params_trainable"]:
            if m != rec["params_trainable"]:
                problems.append(
                    f"validation:{name} lora r={r}: trainable {rec['params_trainable']} != measured {m}"
                )
        for m in rec["measured_params_total"]:
            if m != rec["params_total"]:
                problems.append(
                    f"validation:{name} lora r={r}: peft total {rec['params_total']} != measured {m}"
                )
        loras.append(rec)
    if loras:
        out["lora"] = loras
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="only these presets / validation:<name> keys")
    ap.add_argument("--out", type=Path, default=OUT_FILE)
    ap.add_argument("--check", action="store_true", help="exit 1 if a validation count mismatches")
    args = ap.parse_args(argv)

    logging.getLogger("transformers").setLevel(logging.ERROR)
    presets = load_presets()
    vconfigs, vcases = load_validation()

    jobs = [(n, "preset") for n in presets] + [(f"validation:{n}", "validation") for n in vconfigs]
    if args.names:
        wanted = set(args.names)
        unknown = wanted - {j[0] for j in jobs}
        if unknown:
            print(f"unknown names: {sorted(unknown)}", file=sys.stderr)
            return 2
        jobs = [j for j in jobs if j[0] in wanted]

    results: dict[str, dict] = {}
    if args.names and args.out.exists():
        results = json.loads(args.out.read_text())

    failed: dict[str, str] = {}
    problems: list[str] = []
    for key, kind in jobs:
        t0 = time.time()
        try:
            if kind == "preset":
                results[key] = record_preset(key, presets[key])
            else:
                name = key.split(":", 1)[1]
                results[key] = record_validation(name, vconfigs[name], vcases[name], problems)
        except Exception as exc:  # report and go on with the others
            failed[key] = f"{type(exc).__name__}: {exc}"
            results.pop(key, None)
            print(f"FAILED {key}: {failed[key]}")
            continue
        print(f"{key:32s} {results[key]['params_total']:>16,d}  ({time.time() - t0:.1f}s)")

    # Presets that share a name with a validation config must agree with it.
    for name in vconfigs:
        a, b = results.get(name), results.get(f"validation:{name}")
        if a and b and a["params_total"] != b["params_total"]:
            problems.append(
                f"preset {name}: params_total {a['params_total']} != validation {b['params_total']}"
            )

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, sort_keys=True, indent=1) + "\n")
    print(f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}"
          f" ({len(results)} entries)")
    if failed:
        print("could not build:")
        for k, why in failed.items():
            print(f"  {k}: {why}")
    if problems:
        print("MISMATCHES:")
        for p in problems:
            print(f"  {p}")
    else:
        print("validation counts: all match")
    return 1 if (args.check and (problems or failed)) else 0


if __name__ == "__main__":
    sys.exit(main())
