"""The widget's inference mode: engine, GPU count and tensor-parallel controls, and the
engine's own start-up lines (the same ones estimate_inference and the CLI give)."""

from __future__ import annotations

import pytest

from vramwidget.inference.estimate import estimate_inference
from vramwidget.widget import INPUTS, Calculator

MODEL = "llama-3.1-8b"
GPU = "H100 80GB"


@pytest.fixture
def calc():
    c = Calculator(MODEL)
    c.suggestions_delay = None
    c.mode = "inference"
    c.gpu = GPU
    return c


def test_serving_controls_are_inputs_and_inference_only(calc):
    for name in ("engine", "tensor_parallel", "pipeline_parallel"):
        assert name in INPUTS and name not in calc.disabled
    assert "num_gpus" in calc.disabled and "strategy" in calc.disabled      # training's data parallel
    calc.mode = "training"
    assert "engine" in calc.disabled and "tensor_parallel" not in calc.disabled
    assert [o[0] for o in calc.options["engine"]] == ["hf", "vllm", "sglang"]  # [value, label, tooltip]


def test_engine_shows_the_engine_lines(calc):
    calc.engine = "vllm"
    assert calc.error == "" and calc.gpu_memory_utilization == 0.9      # a server gets vLLM's default budget
    calc.tensor_parallel = 2
    calc.pipeline_parallel = 2                  # 4 GPUs: TP 2 x PP 2
    assert calc.error == ""
    direct = estimate_inference(MODEL, engine="vllm", gpu=GPU, gpu_memory_utilization=0.9, tensor_parallel=2,
                                pipeline_parallel=2, context_len=calc.context_len, batch_size=calc.batch_size,
                                weights=calc.weights, attn_implementation=calc.attn_implementation)
    sv = calc.summary["inference"]["serving"]
    assert sv["startup_lines"] == direct.serving["startup_lines"]
    assert (sv["tensor_parallel"], sv["pipeline_parallel"], sv["num_gpus"]) == (2, 2, 4)
    assert sv["command"].startswith("vllm serve meta-llama/Llama-3.1-8B --tensor-parallel-size 2 "
                                    "--pipeline-parallel-size 2 --max-model-len")
    assert sv["largest_max_model_len"] >= calc.context_len


def test_generate_and_budget_are_linked(calc):
    calc.gpu_memory_utilization = 0.85          # a budget means a server
    assert calc.engine == "vllm"
    calc.engine = "hf"                          # generate() has no budget
    assert calc.gpu_memory_utilization is None and calc.estimate.serving is None
    calc.engine = "sglang"
    assert calc.error == "" and calc.summary["inference"]["serving"]["startup_lines"][0].startswith(
        "KV Cache is allocated. #tokens: ")


def test_bad_layout_names_the_control(calc):
    calc.engine = "vllm"
    calc.tensor_parallel = 3                    # 32 heads over 3 ranks
    assert calc.error_field == "tensor_parallel" and "32 attention heads" in calc.error
    calc.tensor_parallel = 4
    assert calc.error == "" and calc.summary["inference"]["serving"]["num_gpus"] == 4
