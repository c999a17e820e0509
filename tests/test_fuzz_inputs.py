"""Any JSON-like value, given to any keyword of every public function and to every input
trait of the widget: the only exception that may come out is VramError (issue 14).

The keywords are found by introspection, not listed here: the TrainingSetup and
InferenceSetup dataclass fields, the widget's ``INPUTS``, and each function's signature.
A keyword someone adds is fuzzed as soon as it exists.
"""

from __future__ import annotations

import dataclasses
import inspect
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import vramwidget as vw
from vramwidget.inference.estimate import InferenceSetup
from vramwidget.inputs import MAX_SHOWN_CHARS
from vramwidget.model.presets import get as preset
from vramwidget.training import CHOICES, TrainingSetup

TRAINING = [f.name for f in dataclasses.fields(TrainingSetup)]
INFERENCE = [f.name for f in dataclasses.fields(InferenceSetup)]
LLAMA_CONFIG = preset("llama-3.2-1b")["config"]


def keywords(fn, *skip):
    """The keyword parameters of a function (not ``**kw``)."""
    return [p.name for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name not in skip]


#: values users really type wrong: near-misses, the wrong container, huge, tiny, text numbers
NASTY_VALUES = [None, True, False, 0, -1, 1, 2.5, 1e9, 10 ** 30, -10 ** 30, float("nan"), float("inf"),
                "", " ", "abc", "1", "7B", "full", "lora", "zero3", "H100", "x" * 5000, [], ["lora"],
                ["q_proj", 5], {}, {"x": 1}, [[1, 2]], {"bitsandbytes": 1}]
NASTY = st.sampled_from(NASTY_VALUES)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6)
CHOICE_TEXT = st.sampled_from(sorted({c for v in CHOICES.values() for c, _ in v}))
VALUES = st.one_of(NASTY, JSON, CHOICE_TEXT)

#: every public function: (how to call it with one keyword set to a value, the keywords)
TARGETS = {
    "estimate": (lambda k, v: vw.estimate("llama-3.2-1b", **{k: v}), TRAINING + ["gpu"]),
    "estimate(model=...)": (lambda k, v: vw.estimate(v), ["model"]),
    "estimate_parallel": (lambda k, v: vw.estimate_parallel("llama-3.2-1b", **{"num_gpus": 2, "strategy": "zero3",
                                                                                k: v}),
                          keywords(vw.estimate_parallel, "model") + TRAINING),
    "estimate_inference": (lambda k, v: vw.estimate_inference("llama-3.2-1b", **{k: v}), INFERENCE),
    "max_batch_size": (lambda k, v: vw.max_batch_size("gpt2", "L4", **{k: v}),
                       keywords(vw.max_batch_size, "model", "gpu") + TRAINING),
    "max_seq_len": (lambda k, v: vw.max_seq_len("gpt2", "L4", **{k: v}),
                    keywords(vw.max_seq_len, "model", "gpu") + TRAINING),
    "min_gpus": (lambda k, v: vw.min_gpus("gpt2", "L4", **{k: v}), keywords(vw.min_gpus, "model", "gpu") + ["seq_len"]),
    "suggestions": (lambda k, v: vw.suggestions("gpt2", "T4", **{"batch_size": 8, k: v}),
                    keywords(vw.suggestions, "model", "gpu") + ["method", "precision", "seq_len"]),
    "longest_context": (lambda k, v: vw.longest_context("gpt2", "L4", **{k: v}),
                        keywords(vw.longest_context, "model", "gpu")
                        + [f for f in INFERENCE if f not in ("context_len", "gpu")]),
    "custom": (lambda k, v: vw.custom(**{**dict(hidden_size=64, num_layers=2, num_heads=4, vocab_size=1000), k: v}),
               keywords(vw.custom)),
    "from_param_count": (lambda k, v: vw.from_param_count(**{"count": "1B", k: v}), keywords(vw.from_param_count)),
    "from_config": (lambda k, v: vw.from_config(**{"config": LLAMA_CONFIG, k: v}), keywords(vw.from_config)),
    "from_config(field)": (lambda k, v: vw.from_config({**LLAMA_CONFIG, k: v}), sorted(LLAMA_CONFIG)),
    "load_architecture": (lambda k, v: vw.load_architecture(**{"model": "gpt2", k: v}),
                          keywords(vw.load_architecture)),
    "from_training_config": (lambda k, v: vw.from_training_config(**{"source": {"model_name_or_path": "gpt2"}, k: v}),
                             keywords(vw.from_training_config)),
    "fit_map": (lambda k, v: vw.fit_map("gpt2", "L4", **{k: v}), keywords(vw.fit_map, "model", "gpu")),
    "TrainingSetup.from_kwargs": (lambda k, v: TrainingSetup.from_kwargs(**{k: v}), TRAINING),
}
SETTINGS = dict(deadline=None, suppress_health_check=list(HealthCheck))


def call(fn, k, v):
    try:
        fn(k, v)
    except vw.VramError as e:
        msg = str(e)
        assert "\n" not in msg, msg
        assert e.field and e.field in msg, (e.field, msg[:200])   # the message names its field
        assert len(msg) < 1200, msg[:200]   # long values are shortened, never repeated whole
        return e
    return None


@pytest.mark.parametrize("target", sorted(TARGETS))
@settings(max_examples=60, **SETTINGS)
@given(data=st.data())
def test_any_value_to_any_keyword_raises_only_vram_error(target, data):
    fn, names = TARGETS[target]
    k = data.draw(st.sampled_from(names), label="keyword")
    v = data.draw(VALUES, label="value")
    call(fn, k, v)


@pytest.fixture(scope="module")
def calc():
    c = vw.Calculator("gpt2")
    c.suggestions_delay = None
    yield c
    c.close()


def test_every_input_trait_is_fuzzed():
    from vramwidget.widget.state import INPUTS

    assert {"batch_size", "precision", "gpu", "lora_targets", "config_json"} <= set(INPUTS)


@settings(max_examples=150, **SETTINGS)
@given(data=st.data())
def test_any_value_to_any_widget_trait_raises_only_vram_error(calc, data):
    """Setting a trait: a value of the wrong type is a VramError that sets `error` (the trait and
    the last estimate stay); a value of the right type is kept as entered, and the widget
    shows any error instead of raising."""
    from vramwidget.widget.state import INPUTS

    name = data.draw(st.sampled_from(sorted(INPUTS)), label="trait")
    value = data.draw(VALUES, label="value")
    before = getattr(calc, name)
    est = calc.estimate
    e = call(lambda k, v: setattr(calc, k, v), name, value)
    if e is not None:
        assert getattr(calc, name) == before and calc.estimate is est
        assert calc.error == str(e) and calc.error_field == name
    setattr(calc, name, before)        # back to a valid state for the next example
    if name == "mode" or calc.error:
        calc.mode = "training"


# ---------------------------------------------------------------------------------------
# the cases, one by one
# ---------------------------------------------------------------------------------------

def err(fn, *a, **k) -> vw.VramError:
    with pytest.raises(vw.VramError) as info:
        fn(*a, **k)
    assert "\n" not in str(info.value)
    return info.value


@pytest.mark.parametrize("field, value", [("lora_targets", 5), ("quantized_groups", 5),
                                          ("optimizer_state_dtypes", 3), ("method", ["lora"]),
                                          ("method", {"x": 1})])
def test_wrong_types_in_the_setup_are_vram_errors(field, value):
    """Were TypeError: 'int' object is not iterable / unhashable type."""
    kw = {"method": "lora" if field == "lora_targets" else "qlora", field: value}
    e = err(vw.estimate, "llama-3.2-1b", **kw)
    assert e.field == field and f"got {value!r}" in str(e)


def test_strategy_as_a_list():
    e = err(vw.estimate_parallel, "llama-3.2-1b", strategy=["zero3"], num_gpus=2)
    assert e.field == "strategy" and "['zero3']" in str(e)


@pytest.mark.parametrize("fn, kw, field", [(vw.max_batch_size, dict(limit="abc"), "limit"),
                                           (vw.max_seq_len, dict(multiple_of="a"), "multiple_of"),
                                           (vw.max_batch_size, dict(limit=0), "limit"),
                                           (vw.max_batch_size, dict(limit=-3), "limit"),
                                           (vw.min_gpus, dict(max_gpus=0), "max_gpus"),
                                           (vw.suggestions, dict(max_gpus=-1), "max_gpus")])
def test_fit_limits_are_checked(fn, kw, field):
    """Were a ValueError, or silently 0 / None / six suggestions."""
    e = err(fn, "llama-3.2-1b", "H100-80GB", **kw)
    assert e.field == field and "whole number >= 1" in str(e)


def test_suggestions_progress_must_be_a_function():
    """The fuzz run found progress=True raising TypeError from inside the search."""
    e = err(vw.suggestions, "llama-3.2-1b", "H100-80GB", progress=True)
    assert e.field == "progress" and "function" in str(e) and "True" in str(e)


@pytest.mark.parametrize("size", [10 ** 7, 10 ** 8])
def test_a_huge_path_is_cut_before_difflib(size):
    """A 2 GB path raised MemoryError in difflib, a 10 MB one gave a 10-million-character
    message; now the length is refused first and the message stays short (the value is shown
    in at most 80 characters)."""
    e = err(vw.estimate, "a" * size)
    assert e.field == "model" and len(str(e)) < 300 and f"({size:,} characters)" in str(e)


def test_long_unknown_names_are_shortened_to_80_characters():
    e = err(vw.estimate, "llama-3.2-1b", optimizer="adam" * 100)
    shown = str(e).split(" is not one of")[0].split(": ", 1)[1]
    assert len(shown) <= MAX_SHOWN_CHARS and shown.endswith("... (400 characters)")
    e = err(vw.estimate, "x" * 300)   # an unknown preset name of 300 characters
    assert "x" * 100 not in str(e)


@pytest.mark.parametrize("kw, field", [(dict(seq_len=10 ** 30), "seq_len"), (dict(seq_len=1e9), "seq_len"),
                                       (dict(batch_size=10 ** 9), "batch_size")])
def test_beyond_physics_is_an_input_error(kw, field):
    """Were silent numbers: 10**30 is above 2**53; gpt2 at 1e9 tokens would need 1.07 PiB;
    a billion sequences of llama-3.2-1b even more (more than 1 PiB is not a setup)."""
    e = err(vw.estimate, "gpt2" if kw.get("seq_len") == 1e9 else "llama-3.2-1b", **kw)
    assert e.field == field


def test_a_rank_beyond_physics_names_the_rank():
    """Named seq_len: gpt2's LoRA adapters at rank 10**9 (2 x 768 x 10**9 parameters per
    targeted projection, with their gradients and AdamW states) need 2.7 PiB; the tokens
    were the defaults."""
    e = err(vw.estimate, "gpt2", method="lora", lora_r=10 ** 9)
    assert e.field == "lora_r" and "adapters" in str(e)
    # at rank 10**11 the adapters alone are over 1 PiB once loaded: named the model
    assert err(vw.estimate, "gpt2", method="lora", lora_r=10 ** 11).field == "lora_r"
    assert err(vw.estimate, "1e15").field == "model"         # the weights alone


def test_loss_chunks_are_bounded():
    """10**9 chunks were accepted and every chunk written into the plan (the process ran for
    minutes, its memory growing); the bound is training.MAX_LOSS_CHUNKS."""
    from vramwidget.training import MAX_LOSS_CHUNKS

    e = err(vw.estimate, "gpt2", method="lora", loss="chunked", loss_chunks=10 ** 9)
    assert e.field == "loss_chunks" and f"{MAX_LOSS_CHUNKS:,}" in str(e)
    assert vw.estimate("gpt2", method="lora", loss="chunked", loss_chunks=MAX_LOSS_CHUNKS).setup["loss_chunks"] \
        == MAX_LOSS_CHUNKS


def test_cli_batch_size_beyond_physics(capsys):
    from vramwidget.cli import main

    assert main(["estimate", "llama-3.2-1b", "--batch-size", "1000000000"]) == 2
    assert "batch_size" in capsys.readouterr().err


def test_overlap_comm_must_be_a_bool():
    e = err(vw.estimate_parallel, "llama-3.2-1b", strategy="zero3", num_gpus=2, overlap_comm="yes")
    assert e.field == "overlap_comm" and "true or false" in str(e)


def test_a_parameter_count_below_the_assumed_shape():
    """'1' gave an 18-million-parameter model with a note claiming the count was used exactly."""
    e = err(vw.estimate, "1")
    assert e.field == "model" and "18.1M" in str(e)
    assert vw.estimate("20M").params_total == 20_000_000     # a count the shape can match: exact


def test_warnings_for_legal_but_unusual_input():
    """GPT-2 has 1,024 learned positions; a LoRA rank above the hidden size adds no rank."""
    gpt2 = vw.estimate("gpt2", seq_len=32768)
    assert any("beyond gpt2's 1,024 positions" in n for n in gpt2.notes)
    big_r = vw.estimate("llama-3.2-1b", method="lora", lora_r=100000)
    assert any("lora_r 100,000 is above the hidden size 2,048" in n for n in big_r.notes)
    assert not any(n.startswith("warning") for n in vw.estimate("llama-3.2-1b", method="lora").notes)


def test_the_widget_shows_the_warnings(calc):
    calc.seq_len = 4096     # gpt2: 1,024 positions
    assert any("beyond gpt2's 1,024 positions" in n for n in calc.summary["notes"])
    calc.seq_len = 512


@pytest.mark.parametrize("name, value", [("batch_size", "abc"), ("batch_size", 2.5), ("precision", None)])
def test_widget_wrong_types_are_vram_errors(calc, name, value):
    """Were traitlets' TraitError."""
    est = calc.estimate
    e = err(setattr, calc, name, value)
    assert e.field == name and calc.error == str(e) and calc.estimate is est
    calc.batch_size = 2    # any valid change clears it
    assert calc.error == ""
    calc.batch_size = 1


def test_widget_unknown_gpu_is_an_error(calc):
    calc.gpu = "RTX 9999"
    assert calc.error_field == "gpu" and "unknown GPU 'RTX 9999'" in calc.error
    calc.gpu = ""
    assert calc.error == ""


def test_text_summaries():
    est = vw.estimate("llama-3.2-1b", method="lora")
    text = str(est)
    assert text.startswith("Estimate: llama-3.2-1b (lora, bf16), batch 1 x 2048 tokens")
    assert f"peak allocated {est.peak_gib:.2f} GiB (backward)" in text and "activations" in text
    c = vw.Calculator("llama-3.2-1b", method="lora")
    assert repr(c).startswith("Calculator('llama-3.2-1b', mode='training')\nEstimate: llama-3.2-1b (lora")
    assert "object at 0x" not in str(c)
    c.close()


def test_messages_name_the_field_and_json_values_are_not_evaluated():
    e = err(vw.estimate, "llama-3.2-1b", versions={"bitsandbytes": 1})
    assert e.field == "versions"
    assert json.dumps({"ok": 1})   # keep json imported for the module's strategies


# ---------------------------------------------------------------------------------------
# command line and docs items of the issue
# ---------------------------------------------------------------------------------------

def _cases(tmp_path):
    p = tmp_path / "cases.jsonl"
    p.write_text(json.dumps({"id": "x", "model": "gpt2", "inference": {"prompt_len": 8, "new_tokens": 2}}) + "\n")
    return p


def test_measure_inference_without_a_gpu_exits_non_zero(tmp_path, capsys):
    """Was exit 0 with "0 case(s) measured" and the error only inside the output file."""
    from vramwidget.cli import main

    out = tmp_path / "out.jsonl"
    assert main(["measure-inference", str(_cases(tmp_path)), "--out", str(out)]) == 2
    err_text = capsys.readouterr().err
    assert "sees no CUDA GPU" in err_text and err_text.count("\n") == 1
    assert not out.exists()    # refused before any case


def test_measure_inference_without_torch_exits_non_zero(tmp_path, capsys, monkeypatch):
    import sys

    from vramwidget.cli import main

    monkeypatch.setitem(sys.modules, "torch", None)
    assert main(["measure-inference", str(_cases(tmp_path)), "--out", str(tmp_path / "o.jsonl")]) == 2
    assert "measuring needs torch" in capsys.readouterr().err


def test_validate_names_precisions_as_the_setup_does(capsys):
    """Was 'bflo' and 'floa+ac' (dtype names cut to four letters)."""
    from vramwidget.cli import main

    assert main(["validate"]) == 0
    table = capsys.readouterr().out
    rows = {line.split()[0]: line for line in table.splitlines() if line[:1] == "a"}
    assert " full bf16 adamw sdpa b2 s2048 " in rows["a01"]        # measured case a01: pure bf16
    assert " full amp_bf16 adamw sdpa b2 s2048 " in rows["a04"]    # a04: fp32 weights + bf16 autocast
    assert "bflo" not in table and "floa" not in table


def test_fit_says_why_no_gpu_count_fits(capsys):
    """Was 'ddp -, zero2 -, ...' with no explanation."""
    from vramwidget.cli import main

    assert main(["fit", "llama-3.1-70b", "--gpu", "H100-80GB"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("fewest GPUs"))
    assert " -" not in line
    assert "no count up to 4,096 GPUs fits with ddp (every GPU keeps a whole replica)" in line


@pytest.mark.parametrize("argv", [
    ["estimate", "a" * 100_000],
    ["estimate", "gpt2", "--batch-size", "9" * 5000],          # int() of 5,000 digits raises ValueError
    ["estimate", "gpt2", "--batch-size", "abc" + "x" * 5000],
    ["estimate", "gpt2", "--method", "x" * 5000],
    ["estimate", "gpt2", "--seq-len", "1e30"],
    ["fit", "gpt2", "--gpu", "RTX 9999" * 1000],
])
def test_cli_hostile_values_give_one_short_line(argv, capsys):
    from vramwidget.cli import main

    assert main(argv) == 2
    err_text = capsys.readouterr().err
    assert err_text.count("\n") == 1 and len(err_text) < 400, err_text[:400]


@pytest.mark.parametrize("block_size", [10 ** 9, 17, 512])
def test_a_vllm_page_size_vllm_refuses_is_an_input_error(block_size):
    """Were accepted: a 10**9-token KV page (vllm/config/cache.py BlockSize allows 1, 8, 16,
    32, 64, 128 and 256 tokens); the engine refuses any other at start-up."""
    e = err(vw.estimate_inference, "gpt2", engine="vllm", gpu="H100", block_size=block_size)
    assert e.field == "block_size" and "128" in str(e) and str(block_size) in str(e)
    assert vw.estimate_inference("gpt2", engine="vllm", gpu="H100", block_size=32).serving["block_size"] == 32


@pytest.mark.parametrize("cfg, field", [
    ({"model_type": "llama", "num_hidden_layers": 10 ** 6}, "num_hidden_layers"),
    ({"model_type": "t5", "num_layers": 2000}, "num_layers"),
])
def test_a_config_deeper_than_any_model_is_an_input_error(cfg, field):
    """10**6 blocks were accepted: listing their tensors and writing their step plan ran for
    90 s and ran out of memory (a config_json pasted into the widget would have killed the
    kernel).  model.tensors.MAX_LAYERS is 1,024."""
    from vramwidget.model.tensors import MAX_LAYERS

    base = {"hidden_size": 64, "d_model": 64, "num_attention_heads": 4, "num_heads": 4, "intermediate_size": 128,
            "d_ff": 128, "d_kv": 16, "vocab_size": 1000}
    e = err(vw.from_config, {**base, **cfg})
    assert e.field == field and f"{MAX_LAYERS:,}" in str(e)
    # at the bound it is accepted (T5's num_layers counts the encoder's and the decoder's blocks)
    assert vw.from_config({**base, **cfg, field: MAX_LAYERS}).num_layers in (MAX_LAYERS, 2 * MAX_LAYERS)
    assert err(vw.custom, hidden_size=64, num_layers=MAX_LAYERS + 1, num_heads=4, vocab_size=100).field == "num_layers"


def test_more_experts_per_token_than_experts_is_an_input_error():
    """Was accepted: top-8 of 4 experts (the router's torch.topk needs k <= experts)."""
    cfg = {"model_type": "mixtral", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "intermediate_size": 128, "vocab_size": 1000, "num_local_experts": 4, "num_experts_per_tok": 8}
    e = err(vw.from_config, cfg)
    assert e.field == "num_experts_per_tok" and "4 routed experts" in str(e)
    assert vw.from_config({**cfg, "num_experts_per_tok": 4}).experts_per_token == 4


@pytest.mark.parametrize("kw, field", [(dict(images_per_sample=10 ** 9), "images_per_sample"),
                                       (dict(images_per_sample=1, image_patches=10 ** 9), "image_patches")])
def test_images_beyond_physics_name_the_images(kw, field):
    """Named seq_len (2,048 tokens, the default): a billion images per sample, or a billion
    patches per image, of Qwen2.5-VL 7B need thousands of PiB in its vision tower."""
    assert err(vw.estimate, "qwen2.5-vl-7b", **kw).field == field


@pytest.mark.parametrize("model, kw, field", [
    ("qwen2.5-0.5b", dict(method="lora", loss="liger", batch_size=2 ** 40), "batch_size"),
    ("qwen2.5-vl-7b", dict(images_per_sample=2 ** 40), "images_per_sample"),
])
def test_requests_beyond_int64_are_input_errors(model, kw, field):
    """Were OverflowError (Python int too large to convert to C long): 2**40 sequences (Liger,
    whose plan is read at that size) or images (a vision tower's plan, built for one size,
    holds Python ints) make requests above 2**63 bytes; each request is cut to
    plan.views.SATURATED_REQUEST_BYTES."""
    e = err(vw.estimate, model, **kw)
    assert e.field == field and "at least" in str(e)


def test_an_inference_batch_beyond_physics_names_the_batch():
    """Named context_len (4,096, the default): 2**40 sequences of gpt2's KV cache."""
    assert err(vw.estimate_inference, "gpt2", batch_size=2 ** 40, gpu="H100").field == "batch_size"
    assert err(vw.estimate_inference, "gpt2", context_len=2 ** 45, gpu="H100").field == "context_len"
