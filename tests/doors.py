"""Every door fuzzed (issue 27, item 4): random calls of every public entry point beyond the
estimator, valid and broken, and what each may answer.

Doors: ``suggestions``, ``fit`` (``vramwidget.fit.solver.answers``, what ``vramwidget fit``
prints; ``min_gpus``), ``fit_map``, ``max_batch_size``, ``max_seq_len``,
``estimate_parallel``, ``estimate_inference`` with every engine and ``longest_context``,
``from_training_config`` (generated configs of each format, and junk files: binary, empty,
huge, deeply nested, wrong types), every CLI subcommand (``main()`` in-process), and the
widget's traits.  A call may return, or raise :class:`vramwidget.VramError` with one line
naming its field; the CLI may exit 0 or 2 with one ``vramwidget: error:`` line; the widget
keeps its last estimate when a value is refused.  Anything else is counted as an exception
other than VramError (the number that must be 0).

``run_door(name, rng, ctx)`` makes one call; ``benchmarks/bench_fuzz.py --doors N`` runs N of
each door, ``tests/test_fuzz_doors.py`` a seeded slice.  Draws use small models and short
sequences so that a call costs milliseconds, not seconds.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import tempfile
from typing import Any, Callable, Dict, List, Tuple

import vramwidget as vw
from vramwidget import VramError

MODELS = ("gpt2", "smollm2-135m", "qwen2.5-0.5b", "llama-3.2-1b")
GPUS = ("T4", "L4", "RTX 4090", "A100 40GB", "H100 80GB")
#: values users type wrong: near-misses, the wrong container, huge, tiny, text numbers
NASTY = [None, True, False, 0, -1, 1, 2.5, 1e9, 10 ** 30, float("nan"), float("inf"), "", " ", "abc", "1", "7B",
         "full", "lora", "zero3", "H100", "x" * 5000, [], ["lora"], ["q_proj", 5], {}, {"x": 1}, [[1, 2]]]
SETUP_SPACE = {
    "method": ("full", "lora", "qlora", "freeze", "norms"),
    "precision": ("bf16", "fp32", "amp_bf16", "fp16", "bf16_fp32_states"),
    "optimizer": ("adamw", "adamw_fused", "adamw_8bit", "adafactor", "sgd", "lion"),
    "gradient_checkpointing": ("none", "selective", "full"),
    "attn_implementation": ("sdpa", "eager", "flash_attention_2"),
    "batch_size": (1, 2, 4),
    "seq_len": (64, 128, 256, 512),
    "lora_r": (4, 8, 16),
    "trainable_layers": (1, 2),
}


def nasty(rng: random.Random) -> Any:
    """A broken value: a near-miss, or a random JSON-like one."""
    if rng.random() < 0.6:
        return rng.choice(NASTY)
    kind = rng.randrange(5)
    if kind == 0:
        return rng.choice([rng.randint(-5, 70000), 10 ** rng.randint(10, 400), -2 ** 70])
    if kind == 1:
        return rng.choice([rng.uniform(-1e6, 1e6), float("-inf"), 1e308, 5e-324])
    if kind == 2:
        return "".join(rng.choice("ab7BM_- ,./\\\x00é{}[]q0") for _ in range(rng.choice([1, 5, 40])))
    if kind == 3:
        return [nasty(rng) for _ in range(rng.randint(0, 3))] if rng.random() < 0.5 else [1, "a"]
    return {"k": rng.choice(NASTY[:12])}


def setup_kw(rng: random.Random, broken: float = 0.3) -> Dict[str, Any]:
    """Some setup fields; with probability ``broken`` one field (or an unknown one) is wrong."""
    kw = {k: rng.choice(v) for k, v in SETUP_SPACE.items() if rng.random() < 0.35}
    if kw.get("method") != "freeze" and rng.random() < 0.8:
        kw.pop("trainable_layers", None)     # mostly with freeze; sometimes given where it does nothing
    if rng.random() < broken:
        key = rng.choice(list(SETUP_SPACE) + ["quantization", "loss", "stack", "versions", "lora_targets",
                                              "optimizer_state_dtypes", "grad_accum_steps", "bogus_field"])
        kw[key] = nasty(rng)
    return kw


#: how often each model is drawn: the small ones most (a replay's cost follows the layers)
MODEL_WEIGHTS = (0.55, 0.2, 0.15, 0.1)


def _model(rng: random.Random) -> Any:
    return rng.choices(MODELS, MODEL_WEIGHTS)[0] if rng.random() > 0.05 else nasty(rng)


def _gpu(rng: random.Random) -> Any:
    return rng.choice(GPUS) if rng.random() > 0.05 else nasty(rng)


# ---------------------------------------------------------------------------------------
# the API doors
# ---------------------------------------------------------------------------------------

def door_suggestions(rng, ctx):
    extra = {}
    if rng.random() < 0.2:
        extra[rng.choice(["max_gpus", "combine"])] = rng.choice([1, 2, 3, nasty(rng)])
    vw.suggestions(_model(rng), rng.choice(("T4", "L4", "RTX 4090")), **extra, **setup_kw(rng, 0.2))


def door_fit(rng, ctx):
    from vramwidget.fit.solver import answers

    kw = setup_kw(rng, 0.2)
    if rng.random() < 0.2:
        kw.update(num_gpus=rng.choice([2, 4, nasty(rng)]), strategy=rng.choice(["zero3", "ddp", "fsdp_full_shard"]))
    answers(_model(rng), _gpu(rng), **kw)


def door_min_gpus(rng, ctx):
    strategy = rng.choice(["zero3", "ddp", "zero2", "fsdp_full_shard", "fsdp_hybrid", nasty(rng)])
    vw.min_gpus(_model(rng), _gpu(rng), strategy, max_gpus=rng.choice([8, 64, nasty(rng)]), **setup_kw(rng, 0.2))


def door_fit_map(rng, ctx):
    b = rng.choice([[1, 2], [1, 4, 16], None, nasty(rng)])
    s = rng.choice([[128, 512], [256], None, nasty(rng)])
    kw = setup_kw(rng, 0.2)
    if b is None or s is None:
        b, s = b or [1, 2], s or [128, 256]     # the default grid is 7 x 8 cells: too slow for a fuzz call
    vw.fit_map(_model(rng), _gpu(rng), batch_sizes=b, seq_lens=s, exact=rng.random() < 0.1, **kw)


def door_max_batch_size(rng, ctx):
    extra = {"limit": rng.choice([64, 1024, nasty(rng)])} if rng.random() < 0.3 else {}
    vw.max_batch_size(_model(rng), _gpu(rng), **extra, **setup_kw(rng, 0.2))


def door_max_seq_len(rng, ctx):
    extra = {}
    if rng.random() < 0.3:
        extra[rng.choice(["limit", "multiple_of"])] = rng.choice([64, 4096, nasty(rng)])
    vw.max_seq_len(_model(rng), _gpu(rng), **extra, **setup_kw(rng, 0.2))


def door_estimate_parallel(rng, ctx):
    par: Dict[str, Any] = {}
    for k, vals in (("strategy", ("ddp", "zero1", "zero2", "zero3", "fsdp_full_shard", "fsdp_hybrid", "megatron")),
                    ("num_gpus", (2, 4, 8, 16)), ("tensor_parallel", (1, 2)), ("pipeline_parallel", (1, 2)),
                    ("offload_optimizer", (True, False)), ("offload_params", (True, False)),
                    ("micro_batches", (1, 2, 4)), ("bucket_mb", (25, 500))):
        if rng.random() < 0.4:
            par[k] = rng.choice(vals)
    if rng.random() < 0.25:
        par[rng.choice(["strategy", "num_gpus", "tensor_parallel", "gpus_per_node", "context_parallel",
                        "expert_parallel", "overlap_comm", "nccl_channels", "max_live_parameters"])] = nasty(rng)
    p = vw.estimate_parallel(_model(rng), gpu=rng.choice([None, None, _gpu(rng)]), **par, **setup_kw(rng, 0.15))
    if rng.random() < 0.3:
        p.per_gpu.device_total_bytes, p.step_seconds


def _inference_kw(rng, engine):
    kw: Dict[str, Any] = {"engine": engine}
    for k, vals in (("weights", ("bf16", "int8", "nf4", "awq-4bit", "gptq-4bit", "q4_k_m")),
                    ("context_len", (512, 2048, 8192)), ("batch_size", (1, 4)),
                    ("kv_cache_dtype", ("bf16", "fp8")), ("attn_implementation", ("sdpa", "eager"))):
        if rng.random() < 0.4:
            kw[k] = rng.choice(vals)
    if engine != "hf":
        kw["gpu"] = _gpu(rng)
        if engine == "vllm" and rng.random() < 0.4:
            kw["gpu_memory_utilization"] = rng.choice([0.8, 0.9, 0.95])
        if rng.random() < 0.3:
            kw["versions"] = {engine: rng.choice(["0.6.4", "0.10.1", "0.2.5", "0.4.6", "99.1"])}
        if rng.random() < 0.3:
            kw[rng.choice(["tensor_parallel", "pipeline_parallel", "max_num_seqs"])] = rng.choice([1, 2, 4])
    elif rng.random() < 0.3:
        kw["gpu"] = _gpu(rng)
    if rng.random() < 0.25:
        kw[rng.choice(["weights", "context_len", "batch_size", "kv_cache_dtype", "gpu", "engine", "versions",
                       "gpu_memory_utilization", "mem_fraction_static", "prompt_len"])] = nasty(rng)
    return kw


def door_estimate_inference(rng, ctx):
    engine = rng.choice(("hf", "vllm", "sglang"))
    e = vw.estimate_inference(_model(rng), **_inference_kw(rng, engine))
    if rng.random() < 0.3:
        e.device_total_bytes


def door_longest_context(rng, ctx):
    kw = _inference_kw(rng, rng.choice(("hf", "vllm")))
    gpu = kw.pop("gpu", None) or _gpu(rng)
    kw.pop("context_len", None)
    vw.longest_context(_model(rng), gpu, **kw)


# ---------------------------------------------------------------------------------------
# training configs: generated ones of each format, and junk files
# ---------------------------------------------------------------------------------------

def _config_of(fmt: str, rng: random.Random) -> Dict[str, Any]:
    """A config of ``fmt`` built from that format's own field names (values mostly valid)."""
    b = rng.choice([1, 2, 4, "two", 2.5])
    s = rng.choice([512, 1024, 2048.7, ".nan"])
    if fmt == "hf":
        c = {"model_name_or_path": "gpt2", "per_device_train_batch_size": b, "output_dir": "o",
             "gradient_accumulation_steps": rng.choice([1, 4]), "optim": rng.choice(["adamw_torch", "adamw_8bit",
                                                                                      "paged_adamw_8bit"]),
             "bf16": rng.random() < 0.5, "fp16": rng.random() < 0.2, "gradient_checkpointing": rng.random() < 0.5,
             "max_length": s}
        if rng.random() < 0.4:
            c["peft_config"] = {"peft_type": "LORA", "r": rng.choice([8, 16, "x"]), "lora_alpha": 16,
                                "target_modules": rng.choice([["q_proj", "v_proj"], "all-linear", 5])}
        if rng.random() < 0.3:
            c["model_init_kwargs"] = {"attn_implementation": rng.choice(["flash_attention_2", "sdpa", "magic"])}
            c["packing"] = True
    elif fmt == "axolotl":
        c = {"base_model": "gpt2", "micro_batch_size": b, "sequence_len": s, "adapter": rng.choice(["lora", "qlora", ""]),
             "load_in_4bit": rng.random() < 0.3, "bf16": rng.choice([True, False, "auto"]),
             "fp16": rng.random() < 0.2, "fp32": rng.random() < 0.2, "gradient_checkpointing": rng.random() < 0.5,
             "optimizer": rng.choice(["adamw_torch_fused", "adamw_bnb_8bit", "lion_32bit"])}
    elif fmt == "torchtune":
        c = {"model": {"_component_": rng.choice(["torchtune.models.llama3_2.llama3_2_1b",
                                                  "torchtune.models.llama3_2.lora_llama3_2_1b"])},
             "batch_size": b, "dtype": rng.choice(["bf16", "fp32", "fp64"]),
             "enable_activation_checkpointing": rng.random() < 0.5, "tokenizer": {"max_seq_len": s},
             "optimizer": {"_component_": "torch.optim.AdamW", "fused": True}}
    elif fmt == "llamafactory":
        c = {"model_name_or_path": "gpt2", "finetuning_type": rng.choice(["lora", "full", "freeze"]),
             "per_device_train_batch_size": b, "cutoff_len": s, "lora_rank": rng.choice([8, "eight"]),
             "quantization_bit": rng.choice([None, 4, 8, 3]), "bf16": rng.random() < 0.5}
    elif fmt == "litgpt":
        c = {"checkpoint_dir": "checkpoints/openai-community/gpt2", "precision": rng.choice(["bf16-true", "32-true"]),
             "train": {"micro_batch_size": b, "max_seq_length": s, "global_batch_size": 16},
             "devices": rng.choice([1, 2, "two"]), "lora_r": 8}
    elif fmt == "deepspeed":
        c = {"zero_optimization": {"stage": rng.choice([0, 1, 2, 3, 7, "3"]),
                                   "offload_optimizer": {"device": rng.choice(["cpu", "none"])}},
             "train_micro_batch_size_per_gpu": b, "bf16": {"enabled": rng.random() < 0.6},
             "fp16": {"enabled": rng.random() < 0.2}}
    else:   # accelerate
        c = {"distributed_type": rng.choice(["FSDP", "DEEPSPEED", "MULTI_GPU"]), "num_processes": rng.choice([2, 8, "x"]),
             "mixed_precision": rng.choice(["bf16", "fp16", "no"]), "compute_environment": "LOCAL_MACHINE",
             "fsdp_config": {"fsdp_sharding_strategy": rng.choice(["FULL_SHARD", "HYBRID_SHARD", "ODD"])}}
    if rng.random() < 0.2:   # a wrong type somewhere
        key = rng.choice(list(c))
        c[key] = nasty(rng)
    return c


FORMATS = ("hf", "axolotl", "torchtune", "llamafactory", "litgpt", "deepspeed", "accelerate")


def _junk(rng: random.Random) -> Tuple[str, bytes]:
    kind = rng.choice(["binary", "empty", "huge", "deep", "list", "number", "bad_yaml", "bad_json", "bomb",
                       "random_bytes", "latin1"])
    if kind == "binary":
        return "x.yml", bytes(rng.randrange(256) for _ in range(200)) + b"\x00"
    if kind == "empty":
        return "x.yml", rng.choice([b"", b"\n\n", b"   "])
    if kind == "huge":
        return "x.yml", b"base_model: gpt2\n" + b"#" * (4 * 2 ** 20 + 10)
    if kind == "deep":
        n = rng.choice([40, 500, 5000])
        return rng.choice(["x.yml", "x.json"]), ('{"a": ' + "[" * n + "]" * n + "}").encode()
    if kind == "list":
        return "x.yml", b"- 1\n- 2\n"
    if kind == "number":
        return "x.json", b"42"
    if kind == "bad_yaml":
        return "x.yml", b"a: [1, 2\nb: {c"
    if kind == "bad_json":
        return "x.json", b'{"a": 1,, }'
    if kind == "bomb":
        lines = ["a: &a [x, x, x, x, x, x, x, x, x, x]"] + [
            f"{c}: &{c} [{', '.join(['*' + p] * 10)}]" for p, c in zip("abcdefgh", "bcdefghi")]
        return "x.yml", "\n".join(lines).encode()
    if kind == "latin1":
        return "x.yml", "base_model: caf\xe9\n".encode("latin-1")
    return "x.json", bytes(rng.randrange(1, 256) for _ in range(rng.choice([10, 300])))


def door_training_config(rng, ctx):
    tmp = ctx["tmp"]
    if rng.random() < 0.35:
        name, blob = _junk(rng)
        path = os.path.join(tmp, name)
        with open(path, "wb") as f:
            f.write(blob)
        vw.from_training_config(path)
        return
    fmt = rng.choice(FORMATS)
    raw = _config_of(fmt, rng)
    if rng.random() < 0.5:
        import yaml

        path = os.path.join(tmp, "c.json" if rng.random() < 0.5 else "c.yml")
        with open(path, "w") as f:
            f.write(json.dumps(raw) if path.endswith(".json") else yaml.safe_dump(raw))
        cfg = vw.from_training_config(path, format=fmt if rng.random() < 0.5 else None)
    else:
        cfg = vw.from_training_config(raw, format=fmt if rng.random() < 0.5 else None)
    if rng.random() < 0.5:
        cfg.estimate("gpt2", **({"seq_len": 256} if "seq_len" not in cfg.setup else {}))


# ---------------------------------------------------------------------------------------
# the command line
# ---------------------------------------------------------------------------------------

def _flag_value(rng: random.Random, good: Any) -> str:
    if rng.random() < 0.15:
        v = nasty(rng)
        return v if isinstance(v, str) else json.dumps(v) if not isinstance(v, float) else repr(v)
    return str(good)


def _cli_argv(rng: random.Random, ctx) -> List[str]:
    subs = ("estimate", "fit", "infer", "validate", "presets", "measure", "measure-inference", "models", "bogus")
    sub = rng.choices(subs, (3, 0.3, 2, 1, 0.5, 1, 1, 0.3, 0.3))[0]   # fit answers five questions: fewer
    if sub == "estimate":
        argv = ["estimate", str(_model(rng))]
        for k, v in setup_kw(rng, 0.0).items():
            argv += ["--" + k.replace("_", "-"), _flag_value(rng, v)]
        if rng.random() < 0.3:
            argv += ["--gpu", _flag_value(rng, rng.choice(GPUS))]
        if rng.random() < 0.2:
            argv += ["--num-gpus", _flag_value(rng, rng.choice([2, 4])), "--strategy", rng.choice(["zero3", "ddp"])]
        if rng.random() < 0.15:
            argv += ["--inference"]
        if rng.random() < 0.2:
            path = os.path.join(ctx["tmp"], "cfg.yml")
            import yaml

            with open(path, "w") as f:
                f.write(yaml.safe_dump(_config_of(rng.choice(FORMATS), rng)))
            argv += ["--from", path]
    elif sub == "fit":
        argv = ["fit", str(_model(rng)), "--gpu", _flag_value(rng, rng.choice(("T4", "L4", "RTX 4090")))]
        for k, v in setup_kw(rng, 0.0).items():
            argv += ["--" + k.replace("_", "-"), _flag_value(rng, v)]
    elif sub == "infer":
        argv = ["infer", str(_model(rng))]
        kw = _inference_kw(rng, rng.choice(("hf", "vllm", "sglang")))
        for k, v in kw.items():
            if k == "versions":
                eng, ver = next(iter(v.items())) if isinstance(v, dict) and v else ("vllm", v)
                argv += [f"--{eng}-version", _flag_value(rng, ver)]
            else:
                argv += ["--" + k.replace("_", "-"), _flag_value(rng, v)]
        if rng.random() < 0.2:
            argv += ["--concurrency", _flag_value(rng, rng.choice([4, 16]))]
    elif sub in ("validate", "measure", "measure-inference"):
        name, blob = _junk(rng)
        path = os.path.join(ctx["tmp"], "cases.jsonl")
        with open(path, "wb") as f:
            f.write(blob if rng.random() < 0.8 else b'{"id": "x", "model": {}}\n')
        argv = [sub, path] + (["--out", os.path.join(ctx["tmp"], "o.jsonl")] if sub != "validate" else [])
    else:
        argv = [sub] + (["--json"] if rng.random() < 0.5 else [])
    if rng.random() < 0.3 and sub in ("estimate", "fit", "infer"):
        argv.append("--json")
    return argv


def door_cli(rng, ctx):
    from vramwidget.cli import main

    argv = _cli_argv(rng, ctx)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    text = err.getvalue()
    if code not in (0, 2):
        raise AssertionError(f"exit {code}: {text[:300]}")
    if code == 2:
        lines = [x for x in text.splitlines() if x.strip()]
        if len(lines) != 1 or not lines[0].startswith(("vramwidget: error: ", "vramwidget measure: error: ")):
            raise AssertionError(f"not one error line: {text[:300]!r}")
        raise VramError(f"cli: {lines[0]}", field="cli")     # refused in one line: counted as a VramError
    if argv[0] == "estimate" and "--json" in argv:
        json.loads(out.getvalue())


# ---------------------------------------------------------------------------------------
# the widget
# ---------------------------------------------------------------------------------------

def door_widget(rng, ctx):
    """A random trait set to a random value: only VramError; a refused value leaves the trait,
    and an estimate the widget cannot make leaves the last one in place (``calc.error`` says)."""
    from vramwidget.widget.state import INPUTS

    calc = ctx["calc"]
    name = rng.choice(sorted(INPUTS))
    good = {"model": rng.choice(MODELS), "gpu": rng.choice(GPUS + ("",)), "mode": rng.choice(["training", "inference"]),
            **{k: rng.choice(v) for k, v in SETUP_SPACE.items()}}
    value = good.get(name, nasty(rng)) if rng.random() < 0.5 else nasty(rng)
    before, est = getattr(calc, name), calc._estimate
    try:
        setattr(calc, name, value)
    except VramError as e:
        if getattr(calc, name) != before or calc._estimate is not est:
            raise AssertionError(f"{name}={value!r}: a refused value changed the widget")
        if calc.error_field != name or calc.error != str(e):
            raise AssertionError(f"{name}: error_field {calc.error_field!r} / error not the raised one")
        raise
    if calc.error and calc._estimate is not est:
        raise AssertionError(f"{name}={value!r}: an invalid setup replaced the last estimate")
    if rng.random() < 0.3 or calc.error:      # back to a valid widget now and then
        with calc.hold_sync():
            for k in (name, "model", "mode", "config_json", "gpu"):
                try:
                    setattr(calc, k, calc.trait_defaults(k) if k != "model" else "gpt2")
                except VramError:
                    pass


#: door -> (call, relative weight of the draws: the heavy doors fewer)
DOORS: Dict[str, Tuple[Callable[[random.Random, Dict[str, Any]], None], float]] = {
    "suggestions": (door_suggestions, 0.15),
    "fit": (door_fit, 0.05),
    "min_gpus": (door_min_gpus, 0.4),
    "fit_map": (door_fit_map, 0.4),
    "max_batch_size": (door_max_batch_size, 0.3),
    "max_seq_len": (door_max_seq_len, 0.3),
    "estimate_parallel": (door_estimate_parallel, 1.0),
    "estimate_inference": (door_estimate_inference, 1.0),
    "longest_context": (door_longest_context, 0.3),
    "from_training_config": (door_training_config, 1.0),
    "cli": (door_cli, 1.0),
    "widget": (door_widget, 1.0),
}


def context() -> Dict[str, Any]:
    """What the doors share: a scratch folder and one widget."""
    calc = vw.Calculator("gpt2", seq_len=256)
    calc.suggestions_delay = None
    return {"tmp": tempfile.mkdtemp(prefix="vramwidget-doors-"), "calc": calc}


def close(ctx: Dict[str, Any]) -> None:
    import shutil

    ctx["calc"].close()
    shutil.rmtree(ctx["tmp"], ignore_errors=True)


def run_door(name: str, rng: random.Random, ctx: Dict[str, Any]) -> Tuple[str, str]:
    """One call of door ``name``: ("ok" | "VramError" | "other", detail).  A VramError must be
    one line naming its field (else "other")."""
    fn, _ = DOORS[name]
    try:
        fn(rng, ctx)
        return "ok", ""
    except VramError as e:
        msg = str(e)
        if "\n" in msg:
            return "other", f"multi-line VramError: {msg[:200]!r}"
        if not e.field or e.field not in msg:
            return "other", f"VramError not naming its field {e.field!r}: {msg[:200]}"
        return "VramError", ""
    except Exception as e:  # noqa: BLE001 - what must not happen, reported
        return "other", f"{type(e).__name__}: {str(e)[:300]}"


def schedule(seed: Any, n: int) -> List[Tuple[int, str]]:
    """The first ``n`` calls of a run: (number, door), each door drawn by its weight."""
    names = sorted(DOORS)
    weights = [DOORS[k][1] for k in names]
    out = []
    for i in range(n):
        rng = random.Random(f"{seed}:door:{i}")
        out.append((i, rng.choices(names, weights)[0]))
    return out
