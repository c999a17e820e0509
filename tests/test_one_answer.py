"""Issue 27, "one setup, one answer": for 200 random setups the API (``vw.estimate``), the
command line (``vramwidget estimate ... --json``, its ``main()`` called in-process) and the
widget (``vw.Calculator(model, **setup)``) give the same ``peak_allocated_bytes`` and
``device_total_bytes`` (the exact allocator replay; no GPU chosen, so the H200's measured
CUDA context in all three).

Each setup gives only some fields, as a user does: a field left out gets the same default
at every door (the dataclass's, the stack's, the practitioner defaults of
vramwidget/defaults.py: QLoRA with full checkpointing, a quantized base trained as QLoRA).
Small models and short sequences keep the 200 replays fast.
"""

from __future__ import annotations

import json
import random

import pytest

import vramwidget as vw
from vramwidget import cli

MODELS = ("gpt2", "pythia-1b", "llama-3.2-1b", "qwen2.5-0.5b")
N_SETUPS = int(__import__("os").environ.get("N_ONE_ANSWER", 200))

#: field -> values a draw picks from; a field is left out with probability 1/3
SPACE = {
    "method": ("full", "lora", "qlora"),
    "precision": ("bf16", "fp32", "amp_bf16", "fp16"),
    "optimizer": ("adamw", "adamw_fused", "adamw_8bit", "sgd_momentum", "adafactor"),
    "gradient_checkpointing": ("none", "selective", "full"),
    "attn_implementation": ("sdpa", "eager"),
    "batch_size": (1, 2, 3, 4),
    "seq_len": (64, 128, 256, 512),
    "lora_r": (4, 8, 32),
    "quantization": ("nf4", "fp4"),
}


def draw(i: int):
    """Setup i: a model and some fields (seeded: the same 200 every run)."""
    rng = random.Random(f"one-answer:{i}")
    kw = {k: rng.choice(v) for k, v in SPACE.items() if rng.random() < 2 / 3}
    if kw.get("method") in ("full",) and "quantization" in kw:
        kw.pop("quantization")           # a quantized base cannot be fully fine-tuned (an error everywhere)
    if kw.get("precision") in ("fp32", "amp_bf16") and kw.get("quantization"):
        kw["precision"] = "bf16"         # keep the 4-bit cases in the 16-bit compute they run in
    if "lora_r" in kw and kw.get("method") not in ("lora", "qlora") and "quantization" not in kw:
        kw.pop("lora_r")                 # a warning, not an answer, without adapters
    return rng.choice(MODELS), kw


def flags(kw):
    out = []
    for k, v in kw.items():
        out += ["--" + k.replace("_", "-"), str(v)]
    return out


@pytest.fixture(scope="module")
def setups():
    return [draw(i) for i in range(N_SETUPS)]


@pytest.fixture
def specs_once(monkeypatch):
    """The charts' Vega-Lite specs built once for the 200 widgets (Altair's schema validation
    costs ~0.75 s a widget; the specs are the same for every setup of a mode, and they are not
    what this test compares)."""
    import copy

    from vramwidget.widget import calculator

    built = {}

    def build_specs(mode):
        if mode not in built:
            built[mode] = original(mode)
        return copy.deepcopy(built[mode])

    original = calculator.build_specs
    monkeypatch.setattr(calculator, "build_specs", build_specs)


def test_the_draws_cover_what_the_doors_default(setups):
    """The draws leave fields out (the defaults' paths) and reach every method and the 4-bit link."""
    assert sum("gradient_checkpointing" not in kw for _, kw in setups) > 40
    assert sum(kw.get("method") == "qlora" and "gradient_checkpointing" not in kw for _, kw in setups) > 5
    assert sum("quantization" in kw and "method" not in kw for _, kw in setups) > 5
    assert {kw.get("method") for _, kw in setups} >= {"full", "lora", "qlora", None}


def test_api_cli_and_widget_give_the_same_numbers_for_200_setups(setups, capsys, specs_once):
    calc = None
    done = 0
    for model, kw in setups:
        try:
            api = vw.estimate(model, **kw)
            # whole bytes (the JSON's; the H200's CUDA context is 620.8 MiB, not whole bytes)
            expected = (round(api.peak_allocated_bytes), round(api.device_total_bytes))
        except vw.VramError as e:        # refused: refused the same way at every door
            expected = e
        code = cli.main(["estimate", model, *flags(kw), "--json"])
        out, err = capsys.readouterr()
        if isinstance(expected, vw.VramError):
            assert code == 2 and str(expected).split(":")[0] in err, (model, kw, err)
            with pytest.raises(vw.VramError):
                vw.Calculator(model, **kw)
            continue
        assert code == 0, (model, kw, err)
        d = json.loads(out)
        assert (round(d["peak_allocated_bytes"]), round(d["device_total_bytes"])) == expected, (model, kw)
        calc = vw.Calculator(model, **kw)
        try:
            s = calc.summary
            assert not s["provisional"], (model, kw)
            assert (round(s["peak_bytes"]), round(s["device_total_bytes"])) == expected, (model, kw)
        finally:
            calc.close()
        done += 1
    assert done > 150      # most draws are valid setups
