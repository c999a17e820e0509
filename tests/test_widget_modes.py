"""The Calculator beyond one GPU's training step: multi-GPU training (per-GPU estimate,
pipeline stages, CPU offload), fit verdicts and suggestions, and inference mode.

The numbers come from the back ends (vramwidget.parallel.estimate, vramwidget.fit.solver,
vramwidget.inference.estimate); these tests check that the widget shows exactly what they return
for the traits set, and that bad input leaves the last valid estimate in place.
"""

from __future__ import annotations

import asyncio
import time

import pytest

import vramwidget as vw
from vramwidget.fit import solver as fit, verdict
from vramwidget import gpus
from vramwidget.inference.estimate import WEIGHT_FORMATS, InferenceSetup, estimate_inference, longest_context
from vramwidget.parallel.estimate import PARALLEL_KEYS, STRATEGIES, estimate_parallel
from vramwidget.units import GIB, fmt_bytes
from vramwidget.widget import (
    INFERENCE_INPUTS,
    INFERENCE_SCENARIOS,
    INPUTS,
    PARALLEL_INPUTS,
    SCENARIOS,
    YOUR_SETUP,
    Calculator,
)

MODEL = "llama-3.2-1b"
GPU = "RTX 4090"


def _setup_kw(calc):
    return {k: v for k, v in calc.setup().items() if k != "model"}


def _on_gpu(calc):
    """The setup as the widget estimates it: on its GPU (whose own CUDA context the device
    totals count: an RTX 4090's 426 MiB, not the H200's 620.8)."""
    return dict(_setup_kw(calc), gpu=calc.gpu or None)


def _titles(calc):
    return {r["scenario"]: r for r in calc.rows["comparison"] if r["level"] == "title"}


def _wait_for(pred, timeout=120.0):
    """Wait for a background result (a guard against a hang, not a speed test: benchmarks/ time it)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


@pytest.fixture()
def calc():
    c = Calculator(MODEL, gpu=GPU)
    c.suggestions_delay = None    # suggestions inside the update: deterministic tests
    return c


# ---------------------------------------------------------------------------------------
# the traits are the back ends' keywords
# ---------------------------------------------------------------------------------------

def test_new_traits_carry_the_back_ends_keyword_names():
    assert set(PARALLEL_INPUTS) <= set(PARALLEL_KEYS)
    assert set(INFERENCE_INPUTS) <= set(InferenceSetup.FIELDS)
    for name in PARALLEL_INPUTS + INFERENCE_INPUTS + ("mode",):
        assert name in INPUTS
        trait = Calculator.class_traits()[name]
        assert trait.metadata.get("sync") is True and trait.help, name


def test_options_come_from_the_back_ends(calc):
    # the data-parallel strategies, then transformers' device_map split (vramwidget/widget/multigpu.py)
    assert [k for k, *_ in calc.options["strategy"]] == list(STRATEGIES) + ["device_map"]
    assert [k for k, *_ in calc.options["weights"]] == list(WEIGHT_FORMATS)
    assert [k for k, *_ in calc.options["kv_cache_dtype"]] == ["auto", "bf16", "fp16", "fp32", "fp8"]
    assert [k for k, *_ in calc.options["mode"]] == ["training", "inference"]


# ---------------------------------------------------------------------------------------
# multi-GPU training
# ---------------------------------------------------------------------------------------

def test_defaults_are_the_single_gpu_estimate(calc):
    assert calc.parallel_setup() == {}
    assert calc.parallel_estimate is None
    assert calc.summary["parallel"] is None
    direct = vw.estimate(MODEL, **_on_gpu(calc))
    assert calc.estimate.device_total_bytes == direct.device_total_bytes
    assert calc.estimate.cuda_context_bytes == gpus.context_bytes(GPU)[0] == 426 * 2**20


def test_zero3_shows_the_per_gpu_estimate_smaller_than_one_gpu(calc):
    one = calc.estimate.device_total_bytes
    calc.num_gpus = 8
    assert calc.strategy == "ddp"                    # several replicas: DDP is picked
    calc.strategy = "zero3"
    assert calc.error == ""
    direct = estimate_parallel(MODEL, strategy="zero3", num_gpus=8, **_on_gpu(calc))
    assert calc.parallel_estimate is not None
    assert calc.estimate is calc.parallel_estimate.per_gpu
    assert calc.estimate.device_total_bytes == direct.per_gpu.device_total_bytes
    assert calc.estimate.device_total_bytes < one
    # the treemaps and the summary are of that per-GPU estimate
    groups = [r for r in calc.rows["detail"] if r["level"] == "group"]
    assert sum(r["bytes"] for r in groups) == pytest.approx(sum(c.bytes for c in direct.per_gpu.components))
    par = calc.summary["parallel"]
    assert (par["strategy"], par["num_gpus"], par["data_parallel"], par["shard"]) == ("zero3", 8, 8, 8)
    assert par["per_gpu_device_total_gib"] == pytest.approx(direct.device_total_bytes / GIB)
    assert calc.summary["device_total_bytes"] == direct.device_total_bytes
    assert "per GPU" in calc.summary["text"]
    # every scenario of the comparison is laid out per GPU under the same layout
    scen = dict(calc.scenarios)
    fp32 = estimate_parallel(MODEL, strategy="zero3", num_gpus=8,
                             **dict(_on_gpu(calc), precision="fp32"))
    assert scen["FP32 full"].device_total_bytes == fp32.per_gpu.device_total_bytes
    assert _titles(calc)["FP32 full"]["bytes"] == pytest.approx(fp32.per_gpu.device_total_bytes)


def test_constructor_keywords_take_the_parallel_path():
    c = Calculator(MODEL, num_gpus=4)
    assert c.strategy == "ddp" and c.parallel_estimate is not None
    c = Calculator(MODEL, num_gpus=4, strategy="fsdp_full_shard")
    assert c.strategy == "fsdp_full_shard" and c.summary["parallel"]["shard"] == 4


def test_offload_reports_cpu_memory_and_follows_the_strategy(calc):
    assert "offload_optimizer" in calc.disabled and "offload_params" in calc.disabled
    calc.strategy = "zero3"
    calc.num_gpus = 4
    assert "offload_optimizer" not in calc.disabled and "offload_params" not in calc.disabled
    gpu_before = calc.estimate.device_total_bytes
    calc.offload_optimizer = True
    direct = estimate_parallel(MODEL, strategy="zero3", num_gpus=4, offload_optimizer=True, **_setup_kw(calc))
    par = calc.summary["parallel"]
    assert par["cpu_per_gpu_gib"] == pytest.approx(direct.cpu_bytes_per_gpu / GIB) and par["cpu_per_gpu_gib"] > 0
    assert par["cpu_per_node_gib"] == pytest.approx(direct.cpu_bytes_per_node / GIB)
    assert calc.estimate.device_total_bytes < gpu_before
    assert "CPU offload" in calc.summary["text"]
    calc.strategy = "ddp"                  # DDP cannot offload: the flag is dropped
    assert calc.offload_optimizer is False and calc.error == ""
    assert "ZeRO" in calc.disabled["offload_optimizer"]


def test_pipeline_stages_are_listed(calc):
    calc.pipeline_parallel = 2
    assert calc.error.startswith("num_gpus") and calc.error_field == "num_gpus"   # 1 GPU cannot hold 2 stages
    calc.num_gpus = 2
    assert calc.error == ""
    stages = calc.summary["parallel"]["stages"]
    direct = estimate_parallel(MODEL, num_gpus=2, pipeline_parallel=2, **_on_gpu(calc))
    assert [s["stage"] for s in stages] == [0, 1]
    assert stages[0]["holds"] == "embeddings" and stages[1]["holds"] == "output head"
    assert [s["device_total_gib"] for s in stages] == pytest.approx(
        [st.device_total_bytes / GIB for st in direct.stages])
    assert [s["worst"] for s in stages] == [i == direct.worst_stage for i in range(2)]
    assert calc.estimate.device_total_bytes == direct.per_gpu.device_total_bytes
    calc.pipeline_parallel = 1                # two replicas now: DDP is picked
    assert calc.strategy == "ddp" and calc.error == ""
    assert calc.summary["parallel"]["stages"] == []


# ---------------------------------------------------------------------------------------
# fits verdicts, largest batch, suggestions
# ---------------------------------------------------------------------------------------

def test_every_scenario_has_a_fits_verdict(calc):
    calc.batch_size = 2
    usable = verdict.capacity_bytes(GPU)          # what CUDA reports as the card's total
    assert usable == gpus.get_gpu(GPU).cuda_total_bytes == 24248 * 2**20
    titles = _titles(calc)
    assert list(titles) == [YOUR_SETUP] + [n for n, _ in SCENARIOS]
    scen = dict(calc.scenarios)
    verdicts = set()
    for name, r in titles.items():
        total = scen[name].device_total_bytes if name in scen else calc.estimate.device_total_bytes
        assert r["fits"] is (total <= usable), name
        lines = r["text"].splitlines()
        line = lines[2]
        est = scen[name] if name in scen else calc.estimate
        state = verdict.verdict(est, GPU)["state"]       # the badge's three states, here too
        assert r["state"] == state, name
        # the fourth line: the scenario's step time on the GPU (timing.py), for one that fits only
        # (issue 25: no time or cost for a run that cannot start)
        if state == "does_not_fit":
            assert len(lines) == 3 and "step_seconds" not in r
        else:
            assert lines[3] == f"{est.set_gpu(GPU).step_seconds:.3g} s/step" == f"{r['step_seconds']:.3g} s/step"
        if state == "tight":
            assert line.startswith("≈ tight")
        elif r["fits"]:
            assert line == "✓ fits"
        else:
            assert line == f"✗ {fmt_bytes(total - usable)} over"
            assert r["over_gib"] == pytest.approx((total - usable) / GIB)
        verdicts.add(r["fits"])
    assert verdicts == {True, False}         # FP32 does not fit a 4090 at batch 2, QLoRA does
    calc.gpu = ""                            # no GPU, no verdict
    assert all("fits" not in r and "✓" not in r["text"] for r in _titles(calc).values())


def test_largest_batch_in_the_summary(calc):
    calc.seq_len = 1024
    expected = fit.max_batch_size(MODEL, GPU, **{k: v for k, v in _setup_kw(calc).items() if k != "batch_size"})
    assert calc.summary["max_batch_size"] == expected > 0
    calc.batch_size = expected
    assert calc.summary["fits"] is True
    calc.batch_size = expected + 1
    assert calc.summary["fits"] is False
    calc.gpu = ""
    assert calc.summary["max_batch_size"] is None


def test_no_suggestions_while_it_fits(calc, monkeypatch):
    calls = []
    real = fit.suggestions
    monkeypatch.setattr(fit, "suggestions", lambda *a, **k: calls.append(1) or real(*a, **k))
    calc.batch_size = 1
    assert calc.summary["fits"] is True
    assert calc.suggestions == [] and calc.suggestions_status == ""
    calc.seq_len = 1024
    calc.gpu = ""                            # no GPU: nothing to fit
    calc.batch_size = 64
    assert calc.suggestions == [] and calc.suggestions_status == ""
    assert calls == []


def test_suggestions_when_it_does_not_fit_and_each_fits_flag_is_right(calc):
    calc.batch_size = 8
    assert calc.summary["fits"] is False
    assert calc.suggestions_status == "ready"
    items = calc.suggestions
    assert items and any(x["fits"] for x in items)
    direct = fit.suggestions(MODEL, GPU, **_setup_kw(calc))
    assert [x["title"] for x in items] == [s.title for s in direct]
    base = {name: getattr(calc, name) for name in INPUTS}
    for x in items:
        # apply the change the way the frontend's "apply" button does, then judge it again
        with calc.hold_trait_notifications():
            for k, v in x["changes"].items():
                setattr(calc, k, v)
        assert calc.error == "", (x["title"], calc.error)
        assert calc.summary["fits"] is x["fits"], x["title"]
        assert calc.summary["device_total_gib"] == pytest.approx(x["device_total_gib"], abs=1e-3), x["title"]
        assert x["saved_gib"] > 0 and x["cost"]
        with calc.hold_trait_notifications():
            for k, v in base.items():
                setattr(calc, k, v)
        assert calc.summary["fits"] is False
    # fit_suggestions() returns the same ranked list as Suggestion objects
    assert [s.title for s in calc.fit_suggestions()] == [x["title"] for x in items]
    calc.batch_size = 1                      # fits again: the panel empties
    assert calc.suggestions == [] and calc.suggestions_status == ""


def test_suggestions_for_a_parallel_run(calc):
    calc.num_gpus = 2
    calc.strategy = "zero2"
    calc.batch_size = 8
    assert calc.summary["fits"] is False and calc.suggestions_status == "ready"
    direct = fit.suggestions(MODEL, GPU, strategy="zero2", num_gpus=2, tensor_parallel=1, pipeline_parallel=1,
                             offload_optimizer=False, offload_params=False, **_setup_kw(calc))
    assert [x["title"] for x in calc.suggestions] == [s.title for s in direct]
    assert [x["fits"] for x in calc.suggestions] == [s.fits for s in direct]


def test_suggestions_are_worked_out_after_the_update():
    """With the default delay the update returns at once; a timer thread (no event loop
    here) fills the suggestions in; a change before it fires cancels it."""
    c = Calculator(MODEL, gpu=GPU)
    c.batch_size = 8
    assert c.summary["fits"] is False
    assert c.suggestions_status == "computing" and c.suggestions == []
    assert _wait_for(lambda: c.suggestions_status == "ready")
    assert c.suggestions and c.suggestions[0]["fits"]
    c.batch_size = 9                          # does not fit either: computing again ...
    assert c.suggestions_status == "computing"
    c.batch_size = 1                          # ... but fits before the timer fires
    assert c.suggestions_status == ""
    time.sleep(3 * c.suggestions_delay)
    assert c.suggestions_status == "" and c.suggestions == []
    c.batch_size = 8                          # seen before: from the cache, at once
    assert c.suggestions_status == "ready" and c.suggestions


def test_the_single_changes_are_shown_before_the_combinations():
    """The suggestions come in two steps: the single changes ("partial", while the
    combinations are worked out: a fraction of the time), then the whole ranked list
    ("ready"), which holds every single change shown first."""
    c = Calculator(MODEL, gpu=GPU)
    seen = []
    c.observe(lambda ch: seen.append((ch["new"], [x["title"] for x in c.suggestions],
                                      [len(x["parts"]) for x in c.suggestions])), names="suggestions_status")
    c.batch_size = 8
    assert _wait_for(lambda: c.suggestions_status == "ready")
    c.wait()
    statuses = [s for s, _, _ in seen]
    assert statuses[0] == "computing" and "partial" in statuses and statuses[-1] == "ready", statuses
    assert statuses.index("partial") < statuses.index("ready")
    _, first, parts = seen[statuses.index("partial")]
    assert first and all(n == 0 for n in parts)         # single changes only
    final = [x["title"] for x in c.suggestions]
    assert set(first) <= set(final) and any(x["parts"] for x in c.suggestions)


def test_suggestions_on_a_running_event_loop():
    """In a kernel the suggestions run on its event loop, after the message is handled."""
    async def main():
        c = Calculator(MODEL, gpu=GPU)
        c.batch_size = 8
        assert c.suggestions_status == "computing"
        for _ in range(6000):                 # a guard against a hang (120 s), not a speed test
            await asyncio.sleep(0.02)
            if c.suggestions_status == "ready":
                break
        return c

    c = asyncio.run(main())
    assert c.suggestions_status == "ready" and c.suggestions


# ---------------------------------------------------------------------------------------
# inference mode
# ---------------------------------------------------------------------------------------

def test_inference_mode_shows_estimate_inference(calc):
    calc.mode = "inference"
    assert calc.error == ""
    kw = calc.inference_setup()
    assert kw == {"weights": "bf16", "kv_cache_dtype": "auto", "batch_size": 1, "context_len": 4096,
                  "attn_implementation": "sdpa", "gpu": GPU}
    direct = estimate_inference(MODEL, **kw)
    est = calc.estimate
    assert est.device_total_bytes == direct.device_total_bytes
    kv = {c.name: c.bytes for c in est.components}["kv cache"]
    assert kv == {c.name: c.bytes for c in direct.components}["kv cache"]
    detail_kv = sum(r["bytes"] for r in calc.rows["detail"] if r["level"] == "group" and r["component"] == "kv cache")
    assert detail_kv == pytest.approx(kv)
    inf = calc.summary["inference"]
    assert inf["kv_bytes_per_token"] == direct.kv_bytes_per_token == 2 * 16 * 8 * 64 * 2
    assert inf["kv_cache_bytes"] == direct.kv_cache_bytes
    # capped at the model's position limit when that binds first, and said so (issue 10:
    # "longest context 131,120" for a 131,072-token model)
    by_memory = longest_context(MODEL, GPU, **{k: v for k, v in kw.items() if k not in ("gpu", "context_len")})
    limit = calc._resolve_model().max_position_embeddings
    assert inf["longest_context"] == min(by_memory, limit)
    assert inf["longest_context_by_model"] == (by_memory >= limit)
    assert f"{inf['longest_context']:,} tokens" in calc.summary["text"]
    assert calc.summary["fits"] is True and calc.summary["parallel"] is None
    # the comparison: your setup, BF16, int8, NF4, AWQ at the same context and batch
    titles = _titles(calc)
    assert list(titles) == [YOUR_SETUP] + [n for n, _ in INFERENCE_SCENARIOS]
    scen = dict(calc.scenarios)
    assert [scen[n].setup["weights"] for n, _ in INFERENCE_SCENARIOS] == ["bf16", "int8", "nf4", "awq-4bit"]
    assert all(e.setup["context_len"] == 4096 for e in scen.values())
    assert titles["4-bit (NF4)"]["bytes"] < titles["BF16"]["bytes"]
    assert all(r["fits"] for r in titles.values())
    # phases of generate()
    # the whole context is the prompt: generate() prefills it and decodes nothing
    labels = [r["phase"] for r in calc.rows["phases"] if r["level"] == "total"]
    assert labels == ["after load", "prefill"]
    # the summary says what the estimate assumes (the format and transformers' behaviour)
    assert inf["assumes"] == direct.assumes and "DynamicCache" in inf["assumes"]
    assert "assumes weights bf16" in calc.summary["text"]
    calc.prompt_len = 1024                      # 3,072 generated tokens: a decode phase
    assert [r["phase"] for r in calc.rows["phases"] if r["level"] == "total"] == ["after load", "prefill", "decode"]
    calc.prompt_len = None
    # no suggestions in inference mode
    calc.context_len = 1 << 20
    assert calc.summary["fits"] is False and calc.suggestions_status == ""


def test_inference_context_changes_cost_no_new_search(calc, monkeypatch):
    import vramwidget.inference.estimate as inference

    calc.mode = "inference"
    calls = []
    real = inference.longest_context
    monkeypatch.setattr(inference, "longest_context", lambda *a, **k: calls.append(1) or real(*a, **k))
    for n in (1024, 2048, 8192):
        calc.context_len = n
        assert calc.estimate.setup["context_len"] == n
    assert calls == []                        # the answer does not depend on the context
    calc.weights = "nf4"
    assert len(calls) == 1


def test_serving_budget(calc):
    calc.mode = "inference"
    calc.gpu_memory_utilization = 0.9
    assert calc.error == ""
    direct = estimate_inference(MODEL, **calc.inference_setup())
    serving = calc.summary["inference"]["serving"]
    assert serving["kv_tokens"] == direct.serving["kv_tokens"] > 0
    assert {c.name: c.bytes for c in calc.estimate.components}["kv cache"] == direct.kv_cache_bytes
    assert [r["phase"] for r in calc.rows["phases"] if r["level"] == "total"] == \
        ["after load", "profiling forward", "serving (KV pool full)"]
    calc.gpu = ""                              # a budget needs a GPU
    assert calc.error_field == "gpu" and "gpu_memory_utilization" in calc.disabled


def test_switching_modes_keeps_every_trait(calc):
    calc.method = "lora"
    calc.batch_size = 2
    calc.num_gpus = 2
    calc.strategy = "zero2"
    train_total = calc.estimate.device_total_bytes
    calc.mode = "inference"
    calc.weights = "nf4"
    calc.context_len = 8192
    calc.kv_cache_dtype = "fp8"
    traits = {name: getattr(calc, name) for name in INPUTS}
    inf_total = calc.estimate.device_total_bytes
    for _ in range(2):
        calc.mode = "training"
        assert calc.error == ""
        assert {n: getattr(calc, n) for n in INPUTS if n != "mode"} == \
            {n: v for n, v in traits.items() if n != "mode"}
        assert calc.estimate.device_total_bytes == train_total and calc.parallel_estimate is not None
        assert "weights" in calc.disabled and "method" not in calc.disabled
        calc.mode = "inference"
        assert {name: getattr(calc, name) for name in INPUTS} == traits
        assert calc.estimate.device_total_bytes == inf_total
        assert calc.estimate.setup["weights"] == "nf4" and calc.estimate.setup["kv_cache_dtype"] == "float8"
        assert "method" in calc.disabled and "num_gpus" in calc.disabled and "weights" not in calc.disabled
        assert "batch_size" not in calc.disabled and "attn_implementation" not in calc.disabled


def test_specs_follow_the_mode_only(calc):
    train_specs = calc.specs
    calc.batch_size = 3
    assert calc.specs is train_specs
    calc.mode = "inference"
    inf_specs = calc.specs
    assert inf_specs is not train_specs
    # the detail's legend is the frontend's, from the table: only the parts present
    legend = [layer for layer in inf_specs["detail"]["layer"] if "color" in layer.get("encoding", {})][0]
    assert legend["encoding"]["color"]["legend"] is None
    parts = [r["component"] for r in calc.table]
    assert "kv cache" in parts and "gradients" not in parts
    calc.context_len = 1024
    assert calc.specs is inf_specs
    calc.mode = "training"
    assert calc.specs is train_specs


# ---------------------------------------------------------------------------------------
# bad input: error, last estimate kept, traits as entered
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, value, field", [
    ("num_gpus", 0, "num_gpus"),
    ("strategy", "zero4", "strategy"),
    ("tensor_parallel", 0, "tensor_parallel"),
    ("pipeline_parallel", -1, "pipeline_parallel"),
    ("offload_params", True, "offload_params"),      # needs ZeRO-3 or FSDP
    ("mode", "serving", "mode"),
])
def test_bad_training_input_keeps_the_last_estimate(calc, name, value, field):
    calc.batch_size = 2
    est, rows, summary = calc.estimate, calc.rows, calc.summary
    before = {n: getattr(calc, n) for n in INPUTS if n != name}
    setattr(calc, name, value)
    assert calc.error and calc.error_field == field, calc.error
    assert getattr(calc, name) == value
    assert {n: getattr(calc, n) for n in INPUTS if n != name} == before
    assert calc.estimate is est and calc.rows is rows and calc.summary is summary


def test_tensor_parallel_not_dividing_the_heads(calc):
    calc.num_gpus = 3
    assert calc.strategy == "ddp" and calc.error == ""
    est = calc.estimate
    calc.tensor_parallel = 3                  # 32 heads
    assert calc.error_field == "tensor_parallel" and "32 attention heads" in calc.error
    assert calc.tensor_parallel == 3 and calc.num_gpus == 3
    assert calc.estimate is est
    calc.tensor_parallel = 1
    assert calc.error == ""


@pytest.mark.parametrize("name, value, field", [
    ("weights", "int3", "weights"),
    ("kv_cache_dtype", "fp4", "kv_cache_dtype"),
    ("context_len", 0, "context_len"),
    ("gpu_memory_utilization", 1.5, "gpu_memory_utilization"),
    ("batch_size", 0, "batch_size"),
])
def test_bad_inference_input_keeps_the_last_estimate(calc, name, value, field):
    calc.mode = "inference"
    est, rows = calc.estimate, calc.rows
    setattr(calc, name, value)
    assert calc.error and calc.error_field == field, calc.error
    assert getattr(calc, name) == value
    assert calc.estimate is est and calc.rows is rows
    calc.mode = "training"                    # a bad inference-only value does not matter here
    if name in INFERENCE_INPUTS:
        assert calc.error == ""


# ---------------------------------------------------------------------------------------
# the new rows draw with the bundled Vega (headless, as tests/test_bundle.py does)
# ---------------------------------------------------------------------------------------

def test_multi_gpu_and_inference_rows_render_with_the_bundled_vega():
    import json
    import shutil
    import subprocess
    from pathlib import Path

    js = Path(__file__).resolve().parents[1] / "js"
    node = shutil.which("node")
    if not (node and (js / "node_modules" / "vega-lite").is_dir()):
        pytest.skip("needs node and js/node_modules (run `cd js && npm ci`)")
    c = Calculator(MODEL, gpu=GPU, num_gpus=4, strategy="zero3", pipeline_parallel=2)
    c.suggestions_delay = None
    first_specs, first = c.specs, c.rows
    c.mode = "inference"
    c.gpu_memory_utilization = 0.9
    serving = c.rows
    c.gpu_memory_utilization = None
    c.context_len = 8192
    c.prompt_len = 8000               # 192 decode steps after the prefill (no prompt_len: prefill only)
    generate = c.rows
    for specs, updates in ((first_specs, [first]), (c.specs, [serving, generate])):
        for name, spec in specs.items():
            payload = {"spec": dict(spec, datasets={name: updates[0][name]}),
                       "updates": [{name: u[name]} for u in updates]}
            out = subprocess.run([node, "test/render.mjs"], cwd=js, input=json.dumps(payload),
                                 capture_output=True, text=True, timeout=120)
            assert out.returncode == 0, out.stderr[-2000:]
            res = json.loads(out.stdout)
            assert res["counts"][-1] == {name: len(updates[-1][name])}
            assert res["warnings"] == [], (name, res["warnings"])
            if name == "comparison":      # the verdict lines are drawn
                assert "fits" in res["svg"] or "over" in res["svg"]
            if name == "phases" and specs is c.specs:
                assert "prefill" in res["svg"] and "decode" in res["svg"]
