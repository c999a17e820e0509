"""A knob is added in one place (issue 22): its ``training.FIELDS`` declaration (and the
dataclass field beside it) plus its mechanism in one file of ``plan/``.

``zero_grad_set_to_none`` was added so: nothing in the CLI, the widget or the fuzz tests names
it, yet it is a ``--flag``, a synced trait with a control, and a fuzzed keyword.  Its mechanism
(plan/step.py ``_Grads.zero_grad``): ``optimizer.zero_grad(set_to_none=False)`` zeroes each
gradient in place (torch/optim/optimizer.py ``Optimizer.zero_grad``: ``p.grad.zero_()``;
torch/nn/modules/module.py ``Module.zero_grad`` the same), so every trainable parameter's
gradient stays allocated between steps and the next backward adds into it
(torch/csrc/autograd/functions/accumulate_grad.h: ``variable_grad += new_grad``).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest

import vramwidget as vw
from vramwidget import cli
from vramwidget.training import FIELDS, TrainingSetup

KNOB = "zero_grad_set_to_none"
#: the caching allocator rounds every block up to 512 bytes (c10/cuda/CUDACachingAllocator.cpp kMinBlockSize)
BLOCK_BYTES = 512


def _rounded(nbytes: int) -> int:
    return -(-nbytes // BLOCK_BYTES) * BLOCK_BYTES


def test_the_cli_has_the_flag_from_its_declaration(capsys):
    assert cli.main(["estimate", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--zero-grad-set-to-none" in out and "--no-zero-grad-set-to-none" in out
    assert " ".join(FIELDS[KNOB].doc.split()) + " (default on)" in out
    assert cli.main(["estimate", "llama-3.2-1b", "--seq-len", "128", "--no-zero-grad-set-to-none", "--json"]) == 0
    import json

    assert json.loads(capsys.readouterr().out)["setup"][KNOB] is False


def test_the_widget_has_a_trait_and_a_control_from_its_declaration():
    from vramwidget.widget.controls import controls_spec
    from vramwidget.widget.state import ESTIMATE_INPUTS, INPUTS, State

    trait = State.class_traits()[KNOB]
    assert trait.default() is True and trait.metadata["sync"] is True and trait.help == FIELDS[KNOB].doc
    assert KNOB in ESTIMATE_INPUTS and KNOB in INPUTS
    (c,) = [c for c in controls_spec() if c["name"] == KNOB]
    assert (c["kind"], c["group"], c["hint"], c["mode"], c["default"]) == ("checkbox", "knobs", FIELDS[KNOB].doc,
                                                                          "training", True)


def test_the_fuzz_feeds_it():
    # the fuzz's keyword list is the dataclass's fields (tests/test_fuzz_inputs.py TRAINING)
    assert KNOB in [f.name for f in dataclasses.fields(TrainingSetup)]
    with pytest.raises(vw.VramError, match=KNOB):
        TrainingSetup.from_kwargs(**{KNOB: "yes please"})


@pytest.fixture(scope="module")
def llama_model():
    """Llama 3.2 1B built by transformers on the meta device (no memory, exact shapes)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from vramwidget.model.presets import get

    config = transformers.AutoConfig.for_model(**get("llama-3.2-1b")["config"])
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def _pair(**kw):
    from test_step_plan import _check   # replay == peak to the byte, phases == their trees

    kw = dict(model="llama-3.2-1b", batch_size=1, seq_len=256, **kw)
    model = kw.pop("model")
    return _check(model, kw), _check(model, dict(kw, **{KNOB: False}))


def test_full_bf16_keeps_every_gradient_between_steps(llama_model):
    """Full fine-tuning, pure bf16: between steps the persistent memory grows by every
    trainable parameter's bf16 gradient, each rounded to the allocator's 512-byte blocks
    (1,235,814,400 parameters with the tied head counted once: 2,471,628,800 B); the peak
    (the optimizer step, where the gradients are live anyway) does not move, the forward
    of the steps after the first holds them too."""
    grads = sum(_rounded(p.numel() * 2) for p in llama_model.parameters())
    assert grads == 2_471_628_800
    on, off = _pair(method="full", precision="bf16")
    assert off.phases_bytes["persistent"] - on.phases_bytes["persistent"] == grads
    assert off.peak_allocated_bytes >= on.peak_allocated_bytes
    assert off.peak_allocated_bytes == on.peak_allocated_bytes   # the step's peak already holds them
    assert off.phases_bytes["forward"] - on.phases_bytes["forward"] == grads
    assert off.phases_bytes["after_load"] == on.phases_bytes["after_load"]


def test_gradient_accumulation_keeps_them_too():
    on, off = _pair(method="full", precision="bf16", grad_accum_steps=2)
    assert off.phases_bytes["persistent"] - on.phases_bytes["persistent"] == 2_471_628_800
    assert off.peak_allocated_bytes >= on.peak_allocated_bytes


def test_lora_keeps_the_adapters_gradients(llama_model):
    """LoRA r=16 on every linear layer of the blocks: the kept gradients are the adapters'
    (peft keeps them in fp32: ``autocast_adapter_dtype``; 11,272,192 parameters, the count
    tests/test_cli.py takes from validation case a06), and the peak grows by them (the
    backward peak of a LoRA step holds the activations, not yet every adapter gradient)."""
    peft = pytest.importorskip("peft")
    m = peft.get_peft_model(copy.deepcopy(llama_model), peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    trainable = [p for p in m.parameters() if p.requires_grad]
    assert sum(p.numel() for p in trainable) == 11_272_192
    grads = sum(_rounded(p.numel() * p.element_size()) for p in trainable)
    assert grads == 45_088_768
    on, off = _pair(method="lora", precision="bf16")
    assert off.phases_bytes["persistent"] - on.phases_bytes["persistent"] == grads
    assert off.peak_allocated_bytes - on.peak_allocated_bytes == grads


def test_with_the_optimizer_in_backward_it_does_nothing_and_says_so():
    on, off = _pair(method="full", precision="bf16", optimizer_in_backward=True)
    assert off.phases_bytes == on.phases_bytes
    assert any(KNOB in n and "does nothing" in n for n in off.notes)


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3", "fsdp_full_shard"])
def test_kept_gradients_under_a_sharding_engine_are_refused(strategy):
    """DeepSpeed's engine zeroes its own gradient partitions and FSDP keeps each rank's shard:
    the plan's kept full gradients are not what such a GPU holds, so the knob is refused there
    with one line naming it (DDP keeps full gradients per replica, as on one GPU)."""
    with pytest.raises(vw.VramError, match="zero_grad_set_to_none"):
        vw.estimate_parallel("llama-3.2-1b", strategy=strategy, num_gpus=2, method="full",
                             zero_grad_set_to_none=False)
    ddp = vw.estimate_parallel("llama-3.2-1b", strategy="ddp", num_gpus=2, method="full", zero_grad_set_to_none=False)
    kept = vw.estimate_parallel("llama-3.2-1b", strategy="ddp", num_gpus=2, method="full")
    assert ddp.per_gpu.phases_bytes["persistent"] > kept.per_gpu.phases_bytes["persistent"]
