"""vramwidget.measure.training on the CPU: the whole code path with tiny models, no memory statistics.

Every model here is built from an inline config small enough that two training steps
take well under a second; parameter counts are checked against arithmetic done by hand.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vramwidget.errors import VramError
from vramwidget.measure.training import (
    MEASURED_FIELDS,
    OPTIMIZERS,
    case_from_setup,
    load_cases,
    main,
    measure_case,
    measure_file,
    normalize_case,
)

DATA = Path(__file__).resolve().parents[1] / "vramwidget" / "data" / "h200_training_a.jsonl"

# A Llama with hidden 64, 2 layers, 4 query heads and 2 KV heads of dim 16, vocab 256, tied embeddings.
TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# Parameters of TINY_LLAMA, by hand (h=64, I=128, kv width = 2 heads * 16 = 32, V=256, L=2):
#   embeddings  V*h = 256*64                                  = 16384
#   per layer   q 64*64 + k 64*32 + v 64*32 + o 64*64         = 4096 + 2048 + 2048 + 4096 = 12288
#               gate 64*128 + up 64*128 + down 128*64         = 8192 * 3                  = 24576
#               two RMSNorm weights 2*64                      = 128
#               layer total                                   = 36992
#   2 layers                                                  = 73984
#   final norm                                                = 64
#   lm_head tied to the embeddings                            = 0
TINY_LLAMA_PARAMS = 16384 + 2 * (12288 + 24576 + 128) + 64
assert TINY_LLAMA_PARAMS == 90432

# LoRA adds r*(in + out) per targeted linear layer: A is r x in, B is out x r.
LORA_R = 8
TINY_LLAMA_LORA = 2 * LORA_R * (
    (64 + 64)  # q_proj 64 -> 64
    + (64 + 32)  # k_proj 64 -> 32
    + (64 + 32)  # v_proj 64 -> 32
    + (64 + 64)  # o_proj 64 -> 64
    + (64 + 128)  # gate_proj 64 -> 128
    + (64 + 128)  # up_proj 64 -> 128
    + (128 + 64)  # down_proj 128 -> 64
)
assert TINY_LLAMA_LORA == 16384

# A GPT-2 with n_embd 64, 2 layers, 4 heads, vocab 256, 128 positions (tied lm_head).
TINY_GPT2 = {
    "model_type": "gpt2",
    "n_embd": 64,
    "n_layer": 2,
    "n_head": 4,
    "n_positions": 128,
    "vocab_size": 256,
    "bos_token_id": 0,
    "eos_token_id": 0,
}

# Parameters of TINY_GPT2, by hand (Conv1D layers have weight in*out and bias out):
#   wte 256*64 + wpe 128*64                                    = 16384 + 8192 = 24576
#   per layer  ln_1 2*64 + c_attn 64*192+192 + attn.c_proj 64*64+64
#              + ln_2 2*64 + c_fc 64*256+256 + mlp.c_proj 256*64+64
#                                                              = 128 + 12480 + 4160 + 128 + 16640 + 16448 = 49984
#   ln_f 2*64                                                  = 128
TINY_GPT2_PARAMS = 24576 + 2 * 49984 + 128
assert TINY_GPT2_PARAMS == 124672

# LoRA on GPT-2's c_attn (64->192), c_proj (attention 64->64 and MLP 256->64) and c_fc (64->256).
TINY_GPT2_LORA = 2 * LORA_R * ((64 + 192) + (64 + 64) + (256 + 64) + (64 + 256))
assert TINY_GPT2_LORA == 16384

MEMORY_FIELDS = [f for f in MEASURED_FIELDS if f.endswith("_mib")]


@pytest.fixture(scope="module")
def stack():
    """torch, transformers and peft, or skip (they are installed here and in CI)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    torch.manual_seed(0)
    return torch


def run(config, name, **training):
    training.setdefault("batch_size", 2)
    training.setdefault("seq_len", 32)
    return measure_case(case_from_setup(config, name, **training), device="cpu", steps=2)


def check_record(rec, case):
    assert list(rec) == ["id", "name", "model", "training", "measured", "env"]
    assert rec["id"] == case["id"] and rec["name"] == case["name"]
    assert rec["model"] == case["model"] and rec["training"] == case["training"]
    assert list(rec["measured"]) == list(MEASURED_FIELDS)
    for field in MEMORY_FIELDS:
        assert rec["measured"][field] is None, field
    assert rec["measured"]["step_seconds"] > 0
    env = rec["env"]
    for key in ("gpu", "torch", "transformers", "peft", "bitsandbytes", "cuda_context_mib"):
        assert key in env
    assert env["cuda_context_mib"] is None
    assert env["memory_stats"] == "unavailable on cpu"
    json.dumps(rec)  # a record is plain JSON


# ------------------------------------------------------------------------------ runs on the CPU


def test_full_bf16_adamw_counts_every_parameter(stack):
    case = case_from_setup(TINY_LLAMA, "llama-tiny", batch_size=2, seq_len=32)
    rec = measure_case(case, device="cpu", steps=2)
    check_record(rec, case)
    assert rec["training"]["weights_dtype"] == "bfloat16" and rec["training"]["optimizer"] == "adamw"
    assert rec["measured"]["params_total"] == TINY_LLAMA_PARAMS
    assert rec["measured"]["params_trainable"] == TINY_LLAMA_PARAMS


def test_amp_bf16_over_fp32_weights(stack):
    case = case_from_setup(TINY_GPT2, "gpt2-tiny", weights_dtype="fp32", autocast_dtype="bf16",
                           batch_size=2, seq_len=32)
    assert case["training"]["weights_dtype"] == "float32"
    assert case["training"]["autocast_dtype"] == "bfloat16"
    rec = measure_case(case, device="cpu", steps=2)
    check_record(rec, case)
    assert rec["measured"]["params_total"] == TINY_GPT2_PARAMS
    assert rec["measured"]["params_trainable"] == TINY_GPT2_PARAMS


def test_lora_with_gradient_checkpointing_trains_only_adapters(stack):
    case = case_from_setup(TINY_LLAMA, "llama-tiny", method="lora", gradient_checkpointing=True,
                           lora={"r": LORA_R}, batch_size=2, seq_len=32)
    assert case["training"]["lora"] == {
        "r": LORA_R, "alpha": 32, "dropout": 0.0,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    }
    rec = measure_case(case, device="cpu", steps=2)
    check_record(rec, case)
    assert rec["measured"]["params_trainable"] == TINY_LLAMA_LORA
    assert rec["measured"]["params_total"] == TINY_LLAMA_PARAMS + TINY_LLAMA_LORA


def test_lora_on_gpt2_conv1d_layers(stack):
    rec = run(TINY_GPT2, "gpt2-tiny", method="lora", lora={"r": LORA_R})
    assert rec["training"]["lora"]["target_modules"] == ["c_attn", "c_proj", "c_fc"]
    assert rec["measured"]["params_trainable"] == TINY_GPT2_LORA
    assert rec["measured"]["params_total"] == TINY_GPT2_PARAMS + TINY_GPT2_LORA


@pytest.mark.parametrize("optimizer", ["adafactor", "sgd_momentum", "adamw_fused", "sgd"])
def test_other_optimizers(stack, optimizer):
    case = case_from_setup(TINY_LLAMA, "llama-tiny", optimizer=optimizer, batch_size=2, seq_len=32)
    rec = measure_case(case, device="cpu", steps=2)
    check_record(rec, case)
    assert rec["training"]["optimizer"] == optimizer
    assert rec["measured"]["params_trainable"] == TINY_LLAMA_PARAMS


def test_validation_case_runs_shrunk_on_cpu(stack):
    """A case straight from the validation file (shrunk to 1 layer and a short sequence) runs as is."""
    raw = json.loads(DATA.read_text().splitlines()[20])  # a21: qwen2.5-0.5b full bf16 adamw
    raw["model"].pop("layer_types", None)  # one entry per layer; rebuilt for the new depth
    raw["model"].update(num_hidden_layers=1, vocab_size=512, hidden_size=64, intermediate_size=128,
                        num_attention_heads=4, num_key_value_heads=2)
    raw["training"].update(batch_size=1, seq_len=16)
    rec = measure_case(raw, device="cpu", steps=2)
    assert rec["id"] == "a21" and rec["training"] == raw["training"]
    assert rec["measured"]["params_total"] == rec["measured"]["params_trainable"] > 0


# ------------------------------------------------------------------ what needs bitsandbytes + CUDA


def test_qlora_on_cpu_says_bitsandbytes_and_cuda(stack):
    case = case_from_setup(TINY_LLAMA, "llama-tiny", method="qlora")
    assert case["training"]["quantization"] == {
        "load_in_4bit": True, "quant_type": "nf4", "double_quant": True, "compute_dtype": "bfloat16"}
    assert case["training"]["prepare_model_for_kbit_training"] is False
    with pytest.raises(VramError, match="bitsandbytes") as info:
        measure_case(case, device="cpu", steps=2)
    assert "CUDA" in str(info.value)
    assert info.value.field == "training.method"


def test_adamw_8bit_on_cpu_says_bitsandbytes(stack):
    with pytest.raises(VramError, match="bitsandbytes and a CUDA GPU") as info:
        run(TINY_LLAMA, "llama-tiny", optimizer="adamw_8bit")
    assert info.value.field == "training.optimizer"


# ----------------------------------------------------------------------------- input validation


@pytest.mark.parametrize("bad", ["adam", "AdamW-8bit", "", None])
def test_bad_optimizer_names_the_field(bad):
    with pytest.raises(VramError) as info:
        case_from_setup(TINY_LLAMA, "llama-tiny", optimizer=bad)
    assert info.value.field == "training.optimizer"
    message = str(info.value)
    assert "training.optimizer" in message
    for name in OPTIMIZERS:
        assert name in message


def test_bad_optimizer_in_a_case_dict(stack):
    case = {"id": "x", "name": "x", "model": TINY_LLAMA,
            "training": {"method": "full", "optimizer": "adamw16", "batch_size": 1, "seq_len": 8}}
    with pytest.raises(VramError, match="training.optimizer must be one of"):
        measure_case(case, device="cpu")


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"method": "dora"}, "training.method"),
        ({"weights_dtype": "int3"}, "training.weights_dtype"),
        ({"autocast_dtype": "float32"}, "training.autocast_dtype"),
        ({"attn_implementation": "magic"}, "training.attn_implementation"),
        ({"batch_size": 0}, "training.batch_size"),
        ({"seq_len": 2.5}, "training.seq_len"),
        ({"gradient_checkpointing": "yes"}, "training.gradient_checkpointing"),
        ({"grad_checkpointing": True}, "training.grad_checkpointing"),
        ({"method": "lora", "lora": {"r": 0}}, "training.lora.r"),
        ({"method": "lora", "lora": {"rank": 8}}, "training.lora.rank"),
        ({"method": "lora", "lora": {"target_modules": []}}, "training.lora.target_modules"),
        ({"method": "full", "lora": {"r": 8}}, "training.lora"),
        ({"method": "qlora", "quantization": {"quant_type": "int4"}}, "training.quantization.quant_type"),
        ({"method": "lora", "prepare_model_for_kbit_training": True}, "training.prepare_model_for_kbit_training"),
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(VramError) as info:
        case_from_setup(TINY_LLAMA, "llama-tiny", **kwargs)
    assert info.value.field == field
    assert field.split(".")[-1] in str(info.value)


def test_model_config_needs_model_type():
    with pytest.raises(VramError, match="model_type"):
        case_from_setup({"hidden_size": 64}, "nameless")


def test_unbuildable_config_is_a_vram_error(stack):
    with pytest.raises(VramError, match="model_type 'no-such-arch'"):
        measure_case(case_from_setup({"model_type": "no-such-arch"}, "x"), device="cpu", steps=2)
    inconsistent = dict(TINY_LLAMA, layer_types=["full_attention"] * 5)
    with pytest.raises(VramError, match="cannot build this config") as info:
        measure_case(case_from_setup(inconsistent, "x"), device="cpu", steps=2)
    assert info.value.field == "model"


def test_steps_must_cover_a_steady_state(stack):
    with pytest.raises(VramError, match="steps"):
        measure_case(case_from_setup(TINY_LLAMA, "llama-tiny"), device="cpu", steps=1)


def test_defaults_and_ids():
    case = case_from_setup(TINY_LLAMA, "llama-tiny")
    assert case["id"] == "llama-tiny-full-b1-s512"
    assert case["training"] == {
        "method": "full", "weights_dtype": "bfloat16", "autocast_dtype": None, "optimizer": "adamw",
        "gradient_checkpointing": False, "attn_implementation": "sdpa", "batch_size": 1, "seq_len": 512,
    }
    assert case_from_setup(TINY_LLAMA, "x", case_id="mine")["id"] == "mine"


def test_every_validation_case_normalizes_to_itself():
    lines = DATA.read_text().splitlines()
    assert len(lines) == 45
    for line in lines:
        rec = json.loads(line)
        case = normalize_case(rec)
        assert case["training"] == rec["training"], rec["id"]
        assert list(case["training"]) == list(rec["training"]), rec["id"]
        assert case["model"] == rec["model"] and case["id"] == rec["id"] and case["name"] == rec["name"]


def test_module_imports_without_torch():
    code = ("import sys\n"
            "for m in ('torch', 'transformers', 'peft'): sys.modules[m] = None\n"
            "import vramwidget.measure.training as m\n"
            "m.case_from_setup({'model_type': 'llama'}, 'x', method='lora')\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


# ------------------------------------------------------------------------------------ many cases


def test_measure_file_records_failures_and_goes_on(stack, tmp_path):
    cases = [
        case_from_setup(TINY_LLAMA, "llama-tiny", case_id="t1", batch_size=1, seq_len=16),
        case_from_setup(TINY_LLAMA, "llama-tiny", case_id="t2", method="qlora", batch_size=1, seq_len=16),
        case_from_setup(TINY_GPT2, "gpt2-tiny", case_id="t3", batch_size=1, seq_len=16),
    ]
    out = tmp_path / "out.jsonl"
    records = measure_file(cases, out, device="cpu", steps=2)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in lines] == ["t1", "t2", "t3"] == [r["id"] for r in records]
    assert lines[0]["measured"]["params_total"] == TINY_LLAMA_PARAMS
    assert lines[1]["oom"] is False and "bitsandbytes" in lines[1]["error"] and "measured" not in lines[1]
    assert lines[2]["measured"]["params_total"] == TINY_GPT2_PARAMS

    # appends, and `only` matches ids and names
    measure_file(cases, out, device="cpu", steps=2, only="gpt2")
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["t1", "t2", "t3", "t3"]


def test_measure_file_deadline_starts_nothing_late(stack, tmp_path):
    out = tmp_path / "out.jsonl"
    assert measure_file([case_from_setup(TINY_LLAMA, "x")], out, device="cpu", deadline_s=0) == []
    assert not out.exists() or out.read_text() == ""


def test_measure_file_records_out_of_memory(stack, tmp_path, monkeypatch):
    import vramwidget.measure.training as measure

    real = measure.measure_case

    def fake(case, **kwargs):
        if case["id"] == "big":
            raise stack.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")
        return real(case, **kwargs)

    monkeypatch.setattr(measure, "measure_case", fake)
    cases = [case_from_setup(TINY_LLAMA, "llama-tiny", case_id="big"),
             case_from_setup(TINY_LLAMA, "llama-tiny", case_id="small", seq_len=16)]
    out = tmp_path / "out.jsonl"
    measure_file(cases, out, device="cpu", steps=2)
    big, small = [json.loads(line) for line in out.read_text().splitlines()]
    assert big["id"] == "big" and big["oom"] is True and "out of memory" in big["error"]
    assert small["measured"]["params_total"] == TINY_LLAMA_PARAMS


def test_load_cases_names_the_bad_line(tmp_path):
    path = tmp_path / "cases.jsonl"
    good = case_from_setup(TINY_LLAMA, "ok")
    bad = dict(good, id="oops", training=dict(good["training"], optimizer="adam"))
    path.write_text(json.dumps(good) + "\n\n" + json.dumps(bad) + "\n")
    with pytest.raises(VramError) as info:
        load_cases(path)
    assert "cases.jsonl:2 (oops)" in str(info.value) and "training.optimizer" in str(info.value)
    assert len(load_cases([good, good])) == 2


# ------------------------------------------------------------------------------------------ CLI


def test_cli_single_setup(stack, tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_LLAMA))
    out = tmp_path / "out.jsonl"
    rc = main(["--model", str(config), "--method", "lora", "--lora-r", str(LORA_R), "--gradient-checkpointing",
               "--batch-size", "2", "--seq-len", "16", "--device", "cpu", "--steps", "2", "--out", str(out)])
    assert rc == 0
    (rec,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert rec["id"] == "llama-lora-b2-s16"
    assert rec["training"]["gradient_checkpointing"] is True
    assert rec["measured"]["params_trainable"] == TINY_LLAMA_LORA
    assert "llama-lora-b2-s16" in capsys.readouterr().err


def test_cli_cases_file_with_only(stack, tmp_path):
    cases = tmp_path / "cases.jsonl"
    cases.write_text("\n".join(json.dumps(case_from_setup(cfg, name, batch_size=1, seq_len=16))
                               for cfg, name in ((TINY_LLAMA, "llama-tiny"), (TINY_GPT2, "gpt2-tiny"))))
    out = tmp_path / "out.jsonl"
    assert main([str(cases), "--out", str(out), "--device", "cpu", "--steps", "2", "--only", "gpt2"]) == 0
    assert [json.loads(line)["name"] for line in out.read_text().splitlines()] == ["gpt2-tiny"]


@pytest.mark.parametrize(
    "argv, words",
    [
        ([], "nothing to measure"),
        (["--model", "{config}", "--optimizer", "adam", "--device", "cpu"], "training.optimizer"),
        (["--model", "{config}", "--method", "qlora", "--device", "cpu"], "bitsandbytes"),
        (["--model", "{config}", "--batch-size", "two"], "invalid int value"),
        (["--model", "{tmp}/missing.json"], "cannot read"),
        (["{cases}", "--method", "lora"], "needs --model"),
        (["--model", "{config}", "--device", "tpu"], "device must be"),
        (["--model", "{config}", "--device", "cpu", "--out", "{tmp}/no/such/dir/out.jsonl"], "cannot write"),
    ],
)
def test_cli_errors_are_one_line_and_exit_2(stack, tmp_path, capsys, argv, words):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_LLAMA))
    cases = tmp_path / "cases.jsonl"
    cases.write_text(json.dumps(case_from_setup(TINY_LLAMA, "x")) + "\n")
    argv = [a.format(config=config, cases=cases, tmp=tmp_path) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("vramwidget measure: error:") and words in err


def test_cli_help(capsys):
    assert main(["--help"]) == 0
    assert "vramwidget measure" in capsys.readouterr().out


# ------------------------------------------- the CUDA bookkeeping, with scripted memory readings


class ScriptedMemory:
    """Stands in for the torch.cuda probe: returns scripted MiB readings in call order."""

    available = True

    def __init__(self, allocated, peaks, reserved):
        self._allocated, self._peaks, self._reserved = list(allocated), list(peaks), list(reserved)

    def sync(self):
        pass

    def reset_peak(self):
        pass

    def release(self):
        pass

    def allocated(self):
        return self._allocated.pop(0)

    def peak(self):
        return self._peaks.pop(0)

    def peak_reserved(self):
        return self._reserved.pop(0)


def test_steady_state_bookkeeping(stack):
    """Step 1 only feeds first_step_peak_mib; the phase peaks are the max over steps 2..N."""
    from vramwidget.measure.training import _run_steps

    case = normalize_case(case_from_setup(TINY_LLAMA, "llama-tiny", batch_size=1, seq_len=8))
    mem = ScriptedMemory(
        # weights after the build, then allocated at the end of steps 1, 2, 3
        allocated=[100.04, 300.0, 310.0, 311.0],
        # forward, backward, optimizer step of steps 1, 2, 3
        peaks=[500.0, 600.0, 900.0, 400.0, 700.04, 350.0, 450.0, 650.0, 360.0],
        reserved=[1000.0 + i for i in range(9)],
    )
    m = _run_steps(case, stack.device("cpu"), mem, 3)
    assert m["weights_mib"] == 100.0
    assert m["first_step_peak_mib"] == 900.0
    assert m["forward_peak_mib"] == 450.0
    assert m["backward_peak_mib"] == 700.0
    assert m["optimizer_step_peak_mib"] == 360.0
    assert m["peak_allocated_mib"] == 700.0
    assert m["persistent_after_step_mib"] == 310.0  # after step 2, the first steady step
    assert m["max_reserved_mib"] == 1008.0
    assert m["params_total"] == TINY_LLAMA_PARAMS
