"""The widget's stack and memory-saver controls (issue 12): the Calculator traits are the
estimate keywords; choosing a stack applies its defaults (vramwidget/stacks.py)."""

import vramwidget as vw


def test_stack_applies_its_defaults_and_keywords_win():
    c = vw.Calculator("llama-2-7b", stack="litgpt", method="lora", seq_len=1304, lora_r=16)
    assert (c.lora_r, c.lora_alpha, c.lora_dropout, c.loss, c.loss_chunks) == (16, 16.0, 0.05, "chunked", 11)
    assert c.lora_targets == ["q_proj", "v_proj"]
    assert c.error == ""
    kw = c.setup()
    kw.pop("model")
    est = vw.estimate("llama-2-7b", **kw)
    assert f"peak {est.peak_gib:.1f} GiB" in c.summary["text"]
    c.stack = "unsloth"
    assert (c.loss, c.gradient_checkpointing, c.activation_offloading) == ("liger", "full", True)


def test_knob_links_and_reasons():
    c = vw.Calculator("llama-3.2-1b", method="lora", lora_variant="dora")
    assert c.error == ""
    c.method = "full"
    assert c.lora_variant == "lora" and c.error == ""
    assert "full checkpointing" in c.disabled["compile"]
    assert "chunked" in c.disabled["loss_chunks"]
    c.gradient_checkpointing = "full"
    c.compile = True
    c.loss = "chunked"
    assert "compile" not in c.disabled and c.error == ""
    c.method = "lora"
    a = c.summary["text"]
    c.activation_offloading = True
    assert c.summary["text"] != a
