"""The widget's "import training config" box (issue #12, item 5): a training config's text
fills the controls; what it cannot use is reported."""

from __future__ import annotations

import os

import pytest

import vramwidget as vw

HERE = os.path.join(os.path.dirname(__file__), "data", "training_configs")


def test_text_of_a_llamafactory_config_fills_the_controls():
    c = vw.Calculator("llama-3.2-1b", gpu="RTX 4090", num_gpus=2)
    text = open(os.path.join(HERE, "llamafactory_llama3_lora_sft_otfq.yaml")).read()
    c.training_config = text
    assert c.error == ""
    assert c.model == "meta-llama/Meta-Llama-3-8B-Instruct"
    assert (c.method, c.quantization, c.double_quant) == ("qlora", "nf4", True)
    assert (c.batch_size, c.seq_len, c.grad_accum_steps, c.lora_r, c.lora_alpha) == (1, 2048, 8, 8, 16.0)
    assert c.gradient_checkpointing == "full"
    assert c.lora_targets is None  # lora_target: all -> the widget's "every linear layer"
    # the file describes the whole setup: the 2 GPUs typed before go back to 1; the GPU stays
    assert (c.num_gpus, c.strategy, c.gpu) == (1, "none", "RTX 4090")
    r = c.training_config_report
    assert r["format"] == "llamafactory" and r["applied"]["method"] == "qlora" and r["error"] == ""
    # the estimate is what vw.estimate gives for the same file
    cfg = vw.from_training_config(os.path.join(HERE, "llamafactory_llama3_lora_sft_otfq.yaml"))
    assert c.estimate.peak_allocated_bytes == cfg.estimate().peak_allocated_bytes


def test_keywords_without_a_control_are_listed():
    c = vw.Calculator("llama-3.2-1b")
    cfg = c.load_training_config(os.path.join(HERE, "llamafactory_llama3_lora_sft_ds3.yaml"))
    assert c.strategy == "zero3" and c.offload_optimizer is True and c.offload_params is True
    assert "overlap_comm" in c.training_config_report["not_controls"]
    assert cfg.parallel["overlap_comm"] is False


def test_a_bad_config_says_why_and_keeps_the_estimate():
    c = vw.Calculator("llama-3.2-1b", batch_size=3)
    before = c.estimate.peak_allocated_bytes
    c.training_config = "- just\n- a list\n"
    assert "training_config" in c.error
    assert c.training_config_report["error"].startswith("training_config:")
    assert c.batch_size == 3 and c.estimate.peak_allocated_bytes == before
    c.training_config = "foo: 1\nbar: [2]\n"
    assert "not a training config" in c.error
    with pytest.raises(vw.VramError, match="not valid YAML"):
        c.load_training_config("a: [unclosed\nb: 2\n")
