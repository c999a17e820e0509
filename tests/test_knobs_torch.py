"""The knobs of issue 12 against what autograd really keeps (torch + transformers + peft, CPU).

tools/saved_tensors.py traces tiny models; ``alive_only`` counts what the graph still holds
when the forward pass ends (DoRA builds a side graph for its weight norm and drops it).
Trainable-parameter counts are peft's own (``get_peft_model`` on the meta device).
Skipped when torch/transformers/peft are missing.
"""

import json
import os
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
from saved_tensors import predicted_block_bytes, predicted_total_bytes, traced_block_bytes  # noqa: E402

from vramwidget.model.architecture import load  # noqa: E402
from vramwidget.plan.params import param_storage  # noqa: E402
from vramwidget.training import TrainingSetup  # noqa: E402


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
@pytest.mark.parametrize("method,lora,setup", [
    ("lora", dict(use_dora=True), dict(lora_variant="dora")),
    ("lora", dict(use_dora=True, lora_dropout=0.1), dict(lora_variant="dora", lora_dropout=0.1)),
    ("norms", None, {}),
])
def test_block_saved_bytes_match_autograd(model_type, method, lora, setup):
    """DoRA keeps the base output, lora_B's output and three out-sized vectors per module
    (with dropout also a fp32 weight copy); norms-only tuning keeps what the norms need."""
    traced = traced_block_bytes(model_type, method=method, lora=lora, alive_only=True)["per_layer"]
    assert predicted_block_bytes(model_type, method=method, **setup) == traced


@pytest.mark.parametrize("extra,setup", [
    (dict(target_modules=["q_proj", "v_proj", "lm_head"]), dict(lora_targets=["q_proj", "v_proj", "lm_head"])),
    (dict(target_modules=["q_proj", "v_proj", "embed_tokens"]),
     dict(lora_targets=["q_proj", "v_proj", "embed_tokens"])),
    (dict(target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"]),
     dict(lora_targets=["q_proj", "v_proj"], modules_to_save=["lm_head"])),
    (dict(target_modules=["q_proj", "v_proj"], modules_to_save=["embed_tokens"]),
     dict(lora_targets=["q_proj", "v_proj"], modules_to_save=["embed_tokens"])),
])
def test_head_and_embedding_training_match_autograd(extra, setup):
    """LoRA on lm_head / embed_tokens and modules_to_save change what the head keeps and whether
    the first block's input needs a gradient: the difference to plain q/v LoRA, traced vs
    predicted (the loss is the same in both)."""
    base = dict(target_modules=["q_proj", "v_proj"])
    t = traced_block_bytes("llama", method="lora", lora=extra)["total_L"] - \
        traced_block_bytes("llama", method="lora", lora=base)["total_L"]
    p = predicted_total_bytes("llama", method="lora", **setup) - \
        predicted_total_bytes("llama", method="lora", lora_targets=["q_proj", "v_proj"])
    # where an embedding weight trains (the table itself, or peft's lora_embedding_A, read by
    # F.embedding(ids, lora_embedding_A.T)), F.embedding saves the token ids for its weight
    # gradient: autograd counts them as saved, but they are the input_ids tensor already on
    # the GPU (2 x 32 int64 = 512 B), which the plan does not count again
    embedding_trains = "embed_tokens" in tuple(setup.get("modules_to_save", ())) + tuple(setup["lora_targets"])
    ids_bytes = 2 * 32 * 8 if embedding_trains else 0
    assert p == t - ids_bytes


@pytest.mark.parametrize("kw,expected", [
    (dict(lora_targets=["q_proj", "lm_head", "embed_tokens"]), 5_218_304),
    (dict(modules_to_save=["lm_head"]), 273_940_480),
    (dict(lora_variant="dora"), 11_649_024),
    (dict(modules_to_save=["embed_tokens"], lora_targets=["v_proj"]), 263_323_648),
])
def test_trainable_parameters_match_peft(kw, expected):
    """Llama-3.2-1B (tied head): peft 0.21 get_peft_model(r=16) trainable counts, recorded on
    the meta device; recomputed here with the installed peft."""
    from transformers import AutoConfig, AutoModelForCausalLM

    P = param_storage(load("llama-3.2-1b"), TrainingSetup.from_kwargs(method="lora", **kw))
    assert P.trainable_numel == expected
    cfg = json.load(open(os.path.join(os.path.dirname(__file__), "..", "vramwidget", "presets",
                                      "llama-3.2-1b.json")))
    cfg = AutoConfig.for_model(**cfg.get("config", cfg))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model = peft.get_peft_model(model, peft.LoraConfig(
        r=16, lora_alpha=32, target_modules=kw.get("lora_targets", "all-linear"),
        use_dora=kw.get("lora_variant") == "dora", modules_to_save=kw.get("modules_to_save")))
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == expected
