"""Issue 27, the input contract at every door: one test per finding of the issue (each failed
on the code before the issue's fix), then the untrusted-file and extras items.

Findings: the same setup gave different answers in the API, the CLI and the widget; config
files were misread without a word; nonsense was accepted; output misled.
"""

from __future__ import annotations

import json
import os
import pickle
import re
from pathlib import Path

import pytest

import vramwidget as vw
from vramwidget import cli

ROOT = Path(__file__).resolve().parents[1]


def run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, *argv):
    code, out, err = run(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def write(tmp_path, name, content):
    p = tmp_path / name
    if isinstance(content, bytes):
        p.write_bytes(content)
    else:
        p.write_text(content)
    return str(p)


# ---------------------------------------------------------------------------------------
# the same setup, different answers
# ---------------------------------------------------------------------------------------

QLORA_NOTE = "default: gradient_checkpointing 'full' for QLoRA"


def test_qlora_checkpointing_default_is_one_answer_in_api_cli_and_widget(capsys):
    """Was: vw.estimate(method="qlora") applied no checkpointing (94.35 GiB for Llama 3.1 8B at
    batch 4), the README's vw.Calculator(...) line applied full checkpointing (~24 GiB), the
    CLI behaved like the API and said nothing.  Now the default lives in vramwidget.defaults
    (peft's prepare_model_for_kbit_training turns checkpointing on) and every door applies it
    and says so; passing gradient_checkpointing yourself wins."""
    kw = dict(method="qlora", batch_size=4)
    est = vw.estimate("llama-3.1-8b", **kw)
    assert est.setup["gradient_checkpointing"] == "full"
    assert any(n.startswith(QLORA_NOTE) for n in est.notes)
    assert est.peak_allocated_bytes == vw.estimate("llama-3.1-8b", gradient_checkpointing="full",
                                                   **kw).peak_allocated_bytes
    off = vw.estimate("llama-3.1-8b", gradient_checkpointing="none", **kw)
    assert off.peak_allocated_bytes > 3 * est.peak_allocated_bytes     # the user's value wins
    assert not any(n.startswith("default: gradient_checkpointing") for n in off.notes)
    d = run_json(capsys, "estimate", "llama-3.1-8b", "--method", "qlora", "--batch-size", "4")
    assert d["peak_allocated_bytes"] == est.peak_allocated_bytes
    code, text, _ = run(capsys, "estimate", "llama-3.1-8b", "--method", "qlora", "--batch-size", "4")
    assert code == 0 and QLORA_NOTE in text
    calc = vw.Calculator("llama-3.1-8b", **kw)
    try:
        assert calc.gradient_checkpointing == "full"
        assert calc.summary["peak_bytes"] == est.peak_allocated_bytes
        assert any(n.startswith(QLORA_NOTE) for n in calc.summary["defaults"])
        calc.method = "lora"             # the default no longer applies: back to none, unsaid
        calc.wait()
        assert calc.gradient_checkpointing == "none" and calc.summary["defaults"] == []
    finally:
        calc.close()


def _tiny_starcoder2(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    cfg = transformers.Starcoder2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=128, vocab_size=512,
                                        bos_token_id=0, eos_token_id=0, max_position_embeddings=256)
    d = tmp_path / "sc2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg.to_dict()))
    return str(d / "config.json")


def test_cli_chooses_the_backend_before_loading_the_model(tmp_path, capsys):
    """Was: `vramwidget estimate sc2/config.json --backend trace` (a starcoder2 config, no
    family module) failed with "not supported" while vw.estimate traced it: the CLI loaded
    the architecture before choosing the backend.  Now both trace it, to the same bytes."""
    path = _tiny_starcoder2(tmp_path)
    api = vw.estimate(path, backend="trace", seq_len=128)
    d = run_json(capsys, "estimate", path, "--backend", "trace", "--seq-len", "128")
    assert d["backend"] == "trace"
    assert d["peak_allocated_bytes"] == api.peak_allocated_bytes
    assert d["device_total_bytes"] == pytest.approx(api.device_total_bytes)
    code, text, _ = run(capsys, "estimate", path, "--backend", "trace", "--seq-len", "128")
    assert code == 0 and "traced: one training step" in text


#: the transformers model class each task counts
_TASK_CLASS = {"causal_lm": "AutoModelForCausalLM", "image_text_to_text": "AutoModelForImageTextToText",
               "seq2seq_lm": "AutoModelForSeq2SeqLM", "masked_lm": "AutoModelForMaskedLM"}


def _transformers_count(cfg_obj, task):
    import torch
    import transformers

    with torch.device("meta"):
        model = getattr(transformers, _TASK_CLASS[task]).from_config(cfg_obj)
    return sum(p.numel() for p in model.parameters())


def test_default_configs_count_as_transformers_builds_them():
    """Was: a default Glm4MoeConfig (96 heads, hidden size 4,096, no head_dim) was refused
    ("num_attention_heads (96) does not divide hidden_size") although transformers builds it
    with head_dim = 4096 // 96 = 42 (Glm4MoeAttention: getattr(config, "head_dim", hidden_size
    // num_attention_heads)).  Now every analytic family's default config counts exactly what
    transformers 5.23 builds on the meta device for the class a user trains (Glm4MoeConfig():
    103,481,200,640; Gemma3Config(), the image-text model: 2,723,312,896), and a head_dim that
    does not divide is said.  DeepseekV2Config() leaves num_experts_per_tok None (its forward
    cannot route), so it is given 6, the released V2-Lite's."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    from vramwidget.model.architecture import SUPPORTED_MODEL_TYPES

    checked = {}
    for mt in sorted(SUPPORTED_MODEL_TYPES):
        extra = {"num_experts_per_tok": 6} if mt == "deepseek_v2" else {}
        cfg = transformers.CONFIG_MAPPING[mt](**extra)
        arch = vw.load_architecture(cfg.to_dict())
        checked[mt] = (arch.params_total, _transformers_count(cfg, arch.task))
    assert {mt: a for mt, (a, b) in checked.items() if a != b} == {}
    assert checked["glm4_moe"][0] == 103_481_200_640 and checked["gemma3"][0] == 2_723_312_896
    glm = vw.estimate(transformers.Glm4MoeConfig().to_dict(), method="lora")
    assert any("head_dim = 4,096 // 96 = 42" in n for n in glm.notes)


# ---------------------------------------------------------------------------------------
# config files misread without a word
# ---------------------------------------------------------------------------------------

def test_axolotl_bf16_false_with_fp32_true_is_fp32(tmp_path):
    """Was estimated as bf16 (the axolotl stack's default precision won over the file).  axolotl's
    normalize_config loads float32 when neither bf16/bfloat16 nor fp16/float16 is on."""
    p = write(tmp_path, "ax.yml", "base_model: gpt2\nmicro_batch_size: 1\nbf16: false\nfp32: true\n")
    cfg = vw.from_training_config(p)
    assert cfg.setup["precision"] == "fp32"
    assert cfg.estimate().peak_allocated_bytes == vw.estimate("gpt2", stack="axolotl", precision="fp32",
                                                               batch_size=1).peak_allocated_bytes
    with pytest.raises(vw.VramError, match="contradicts"):     # the opposite, written outright
        vw.from_training_config(write(tmp_path, "ax2.yml", "base_model: gpt2\nbf16: true\nfloat32: true\n"))


def test_a_config_value_that_is_not_a_whole_number_is_said_not_truncated(tmp_path, capsys):
    """Was: micro_batch_size: "two" became 1 and sequence_len: 2048.7 became 2048, silently.
    Now neither is used and each is a warning in the plain output and the estimate's notes."""
    p = write(tmp_path, "ax.yml", "base_model: gpt2\nmicro_batch_size: two\nsequence_len: 2048.7\n")
    cfg = vw.from_training_config(p)
    assert "batch_size" not in cfg.setup and "seq_len" not in cfg.setup
    assert [w.split(":")[0] for w in cfg.warnings] == ["micro_batch_size", "sequence_len"]
    assert "2048.7" in cfg.warnings[1] and "not truncated" in cfg.warnings[1]
    assert sum("warning: config" in n for n in cfg.estimate().notes) == 2
    code, text, _ = run(capsys, "estimate", "--from", p)
    assert code == 0
    assert "micro_batch_size: warning: must be a number, got 'two'" in text
    assert "sequence_len: warning: must be a whole number, got 2048.7" in text


def test_deepspeed_stage_7_is_an_error(tmp_path, capsys):
    """Was ignored, the reason shown only in --json: ZeRO has stages 0-3."""
    p = write(tmp_path, "ds.json", json.dumps({"zero_optimization": {"stage": 7},
                                               "train_micro_batch_size_per_gpu": 2}))
    with pytest.raises(vw.VramError, match=r"zero_optimization\.stage: ZeRO stage 7 does not exist") as e:
        vw.from_training_config(p)
    assert e.value.field == "zero_optimization.stage"
    code, _, err = run(capsys, "estimate", "gpt2", "--from", p)
    assert code == 2 and "ZeRO stage 7 does not exist" in err and err.count("\n") == 1


def test_trl_model_init_kwargs_attn_implementation_is_read(tmp_path):
    """Was "not understood", and the packing check then refused the file asking for the
    setting it contained (TRL's SFTConfig.model_init_kwargs go to from_pretrained)."""
    p = write(tmp_path, "sft.json", json.dumps({
        "model_name_or_path": "gpt2", "per_device_train_batch_size": 2, "output_dir": "out", "packing": True,
        "max_length": 512, "model_init_kwargs": {"attn_implementation": "flash_attention_2"}}))
    cfg = vw.from_training_config(p)
    assert cfg.setup["attn_implementation"] == "flash_attention_2" and cfg.setup["packing"] is True
    assert ("model_init_kwargs.attn_implementation", "attn_implementation", "flash_attention_2") in cfg.mapped
    est = cfg.estimate()
    assert est.setup["packing"] is True and est.setup["attn_implementation"] == "flash_attention_2"


JUNK = [
    ("binary.yml", b"\x89PNG\r\n\x1a\n\x00\x00" * 50, "binary file"),
    ("latin1.yml", "base_model: caf\xe9\n".encode("latin-1"), "not UTF-8 text"),
    ("deep.yml", "a: " + "[" * 5000 + "]" * 5000 + "\n", "nests deeper"),
    ("deep.json", '{"a": ' + "[" * 100 + "]" * 100 + "}", "nests deeper"),
    ("empty.yml", "\n\n", "is empty"),
    ("list.yml", "- 1\n- 2\n", "not a mapping"),
    ("bomb.yml", "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [{', '.join(['*' + p] * 10)}]\n" for p, c in zip("abcdefgh", "bcdefghi")), "more than 100,000"),
    ("nan.json", '{"zero_optimization": {"stage": NaN}}', "not a number"),
]


@pytest.mark.parametrize("name, content, says", JUNK, ids=[j[0] for j in JUNK])
def test_a_junk_file_is_one_vram_error_naming_it(tmp_path, capsys, name, content, says):
    """Was: a binary file, a deeply nested YAML and a .nan gave "internal error" lines in the
    CLI and a raw UnicodeDecodeError / RecursionError / ValueError from from_training_config."""
    p = write(tmp_path, name, content)
    with pytest.raises(vw.VramError, match=re.escape(says)) as e:
        vw.from_training_config(p)
    assert name in str(e.value) and e.value.field == "config"
    code, _, err = run(capsys, "estimate", "gpt2", "--from", p)
    assert code == 2 and err.startswith("vramwidget: error: ") and name in err and err.count("\n") == 1


def test_a_nan_value_in_yaml_is_said_and_not_used(tmp_path, capsys):
    """`micro_batch_size: .nan` raised ValueError ("cannot convert float NaN to integer")."""
    p = write(tmp_path, "nan.yml", "base_model: gpt2\nmicro_batch_size: .nan\n")
    cfg = vw.from_training_config(p)
    assert cfg.warnings == ["micro_batch_size: must be a number, got nan: not used (the estimate takes the default)"]
    code, text, _ = run(capsys, "estimate", "--from", p)
    assert code == 0 and "micro_batch_size: warning" in text


def test_a_huge_config_file_is_refused(tmp_path):
    p = tmp_path / "huge.yml"
    p.write_text("base_model: gpt2\n" + "# padding\n" * 500_000)
    with pytest.raises(vw.VramError, match="larger than 4 MiB"):
        vw.from_training_config(str(p))


# ---------------------------------------------------------------------------------------
# accepted nonsense
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [3, 5])
def test_optimizer_state_dtypes_are_counted_against_the_optimizer_states(n):
    """Was: three or five dtypes for AdamW's two states changed the answer (five gave 119.7
    GiB for Llama 3.1 8B: the list was deduplicated to one and broadcast)."""
    with pytest.raises(vw.VramError, match=f"adamw keeps 2 state tensor.*got {n}") as e:
        vw.estimate("llama-3.1-8b", optimizer_state_dtypes=["fp32"] * n)
    assert e.value.field == "optimizer_state_dtypes"
    one = vw.estimate("llama-3.2-1b", optimizer_state_dtypes=["fp32"])
    two = vw.estimate("llama-3.2-1b", optimizer_state_dtypes=["fp32", "fp32"])
    assert one.peak_allocated_bytes == two.peak_allocated_bytes
    assert two.setup["optimizer_state_dtypes"] == ["float32", "float32"]


def test_a_million_gpus_is_not_a_deployment(capsys):
    """Was: 1,000,000 GPUs with ZeRO-3 reported 1.6 billion tokens per second."""
    with pytest.raises(vw.VramError, match="<= 262,144") as e:
        vw.estimate_parallel("llama-3.1-8b", strategy="zero3", num_gpus=1_000_000)
    assert e.value.field == "num_gpus"
    code, _, err = run(capsys, "estimate", "llama-3.1-8b", "--strategy", "zero3", "--num-gpus", "1000000")
    assert code == 2 and "num_gpus" in err
    with pytest.raises(vw.VramError, match="data_parallel"):      # a serving layout, likewise
        vw.estimate_inference("llama-3.1-8b", engine="vllm", gpu="H100 80GB", data_parallel=1_000_000)
    for fn in (vw.min_gpus, vw.suggestions):                        # and the searches' ceilings
        with pytest.raises(vw.VramError, match="max_gpus"):
            fn("llama-3.1-8b", "H100 80GB", max_gpus=10 ** 7)
    # a real ceiling above the suggestions' default of 8 works (the check once read that 8 as the limit)
    assert vw.min_gpus("llama-3.1-8b", "L4", "zero3", max_gpus=64, gradient_checkpointing="full") > 8


def test_an_engine_version_outside_the_modelled_releases_is_refused(capsys):
    """Was: --vllm-version 99.1 was accepted."""
    code, _, err = run(capsys, "infer", "llama-3.1-8b", "--engine", "vllm", "--gpu", "H100-80GB",
                       "--vllm-version", "99.1")
    assert code == 2 and "vLLM '99.1' is outside the releases modelled (0.2.x to 0.10.x)" in err
    with pytest.raises(vw.VramError, match="SGLang") as e:
        vw.estimate_inference("llama-3.1-8b", engine="sglang", gpu="H100-80GB", versions={"sglang": "9.0"})
    assert e.value.field == "versions"
    assert vw.estimate_inference("llama-3.1-8b", engine="vllm", gpu="H100-80GB",
                                 versions={"vllm": "0.10.2"}).serving


def test_bf16_on_a_card_without_bf16_is_a_warning_naming_it(capsys):
    """Was silent, though the catalogue says the T4 (Turing) has no bf16."""
    est = vw.estimate("gpt2", gpu="T4", seq_len=512)
    assert "warning: T4 (Turing) has no bf16 math: use amp_fp16 or fp32 (precision 'bf16')" in est.notes
    assert not any("bf16 math" in n for n in vw.estimate("gpt2", gpu="T4", seq_len=512, precision="fp32").notes)
    est.set_gpu("H100 80GB")                  # another card: the warning goes with the old one
    assert not any("bf16 math" in n for n in est.notes)
    code, text, _ = run(capsys, "estimate", "gpt2", "--gpu", "T4", "--seq-len", "512")
    assert code == 0 and "T4 (Turing) has no bf16 math" in text


def test_trainable_layers_with_lora_is_said_to_do_nothing(capsys):
    """Was ignored without a word (trainable_layers belongs to method='freeze')."""
    est = vw.estimate("gpt2", method="lora", trainable_layers=2, seq_len=512)
    assert "warning: trainable_layers=2 does nothing here: it applies to method='freeze' (how many last layers " \
           "train); ignored" in est.notes
    assert est.peak_allocated_bytes == vw.estimate("gpt2", method="lora", seq_len=512).peak_allocated_bytes
    code, text, _ = run(capsys, "estimate", "gpt2", "--method", "lora", "--trainable-layers", "2", "--seq-len", "512")
    assert code == 0 and "warning: trainable_layers=2 does nothing here" in text


# ---------------------------------------------------------------------------------------
# misleading output
# ---------------------------------------------------------------------------------------

def test_no_serve_command_for_a_server_that_does_not_start(capsys):
    """Was: `vllm serve ... --max-model-len 32768` printed right after "does not start".  Now
    the command carries the largest max_model_len that starts, or there is none, said so."""
    code, text, _ = run(capsys, "infer", "llama-3.1-70b", "--engine", "vllm", "--gpu", "RTX 4090",
                        "--context-len", "32768")
    assert code == 0 and "does not start" in text
    assert "vllm serve" not in text and "no command: does not start at any max_model_len" in text
    code, text, _ = run(capsys, "infer", "llama-3.1-8b", "--engine", "vllm", "--gpu", "RTX 4090",
                        "--context-len", "131072")
    largest = int(re.search(r"largest max_model_len that starts: ([\d,]+)", text).group(1).replace(",", ""))
    assert 0 < largest < 131072
    command = next(x for x in text.splitlines() if x.strip().startswith("command: vllm serve"))
    assert f"--max-model-len {largest} " in command and "--max-model-len 131072" not in text


def test_the_cpu_adam_step_is_not_called_communication():
    """Was: a CPU Adam step (ZeRO-Offload, 19.8 s) labelled "communication" next to
    "optimizer step 0 ms"."""
    p = vw.estimate_parallel("llama-3.1-8b", strategy="zero3", num_gpus=8, offload_optimizer=True,
                             gpu="H100 80GB")
    tb = p.time_breakdown
    cpu = tb["phases_seconds"]["optimizer step on the CPU"]
    assert cpu > 1.0 and tb["communication_seconds"] < cpu
    assert not any("optimizer step" in k for k in tb["communication"]["collectives_seconds"])
    assert p.step_seconds == pytest.approx(sum(tb["phases_seconds"].values()))


def test_longest_context_without_a_gpu_is_a_vram_error():
    """Found by the doors fuzz (call 3,396): longest_context(model, None) raised TypeError
    comparing the peak with a capacity of None."""
    with pytest.raises(vw.VramError, match="longest_context needs the GPU") as e:
        vw.longest_context("llama-3.2-1b", None, weights="q4_k_m")
    assert e.value.field == "gpu"


def test_longest_context_from_a_short_prompt_does_not_exhaust_memory():
    """Found by the doors fuzz (call 4,630: the process was killed by the kernel at 16.7 GiB):
    longest_context("gpt2", "H100 80GB", prompt_len=128) replayed a million decode steps
    (a 4.4 GiB array of events, then more).  Above 131,072 generated tokens the search is
    refused in one line naming prompt_len, before any replay."""
    with pytest.raises(vw.VramError, match="more than 131,072 generated tokens is not replayed") as e:
        vw.longest_context("gpt2", "H100 80GB", prompt_len=128)
    assert e.value.field == "prompt_len"


def test_cli_table_names_are_not_cut(capsys):
    """Was: names cut at 40 characters ("layer inputs kept by checkpointing (16 l"); the table
    now names each group's largest tensor whole (41 characters here)."""
    code, text, _ = run(capsys, "estimate", "llama-3.2-1b", "--method", "qlora")
    assert code == 0 and "largest model.layers.{i}.self_attn.q_proj.weight: 16 x 2048 x 2048" in text


# ---------------------------------------------------------------------------------------
# untrusted files stay data; extras that fit users' environments
# ---------------------------------------------------------------------------------------

class _Callable:
    """A pickle that would run code on load: pickle calls os.system with the marker's path."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_snapshot_pickle_carrying_a_callable_is_refused_and_runs_nothing(tmp_path):
    """vw.load_snapshot read snapshots with pickle.load: a snapshot someone sent ran their code."""
    marker = tmp_path / "ran"
    blob = pickle.dumps({"segments": [], "device_traces": [[_Callable(marker)]]})
    path = tmp_path / "snap.pickle"
    path.write_bytes(blob)
    for src in (blob, str(path)):
        with pytest.raises(vw.VramError, match=r"refused: the pickle asks for .*system") as e:
            vw.load_snapshot(src)
        assert e.value.field == "snapshot"
    assert not marker.exists()
    # data alone (dicts, lists, text, numbers, booleans) still loads: one 2 MiB segment, one
    # 1 MiB block allocated from the optimizer step
    frames = [{"filename": "torch/optim/adamw.py", "line": 1, "name": "step"}]
    seg = {"total_size": 2 << 20, "is_expandable": False,
           "blocks": [{"state": "active_allocated", "size": 1 << 20, "frames": frames}]}
    ok = pickle.dumps({"segments": [seg], "device_traces": [[{"action": "alloc", "addr": 1, "size": 1 << 20,
                                                              "frames": frames}]]})
    b = vw.load_snapshot(ok)
    assert (b.reserved_bytes, b.peak_allocated_bytes, sum(b.at_snapshot.values())) == (2 << 20, 1 << 20, 1 << 20)


def test_extras_state_floors_and_the_test_script_pins():
    """vramwidget[trace] pinned torch==2.13.0: any other torch conflicted or downloaded gigabytes.
    The extras state floors (the releases measured); scripts/test.sh pins what CI installs."""
    toml = (ROOT / "pyproject.toml").read_text()
    extras = toml.split("[project.optional-dependencies]")[1].split("\n[")[0]
    specs = re.findall(r'"([A-Za-z_.-]+)([<>=!~][^"]*)"', extras)
    assert specs and all(not op.startswith("==") for _, op in specs), specs
    trace = dict(re.findall(r'"([a-z]+)(>=[^"]+)"', extras.split("trace =")[1].split("\n")[0]))
    assert trace == {"torch": ">=2.11", "transformers": ">=5.17", "peft": ">=0.21"}
    script = (ROOT / "scripts" / "test.sh").read_text()
    for pin in ('"torch==2.13.0"', '"transformers==5.23.0"', '"peft==0.21.2"'):
        assert pin in script


def test_replaying_an_estimate_without_a_trace_is_a_vram_error():
    """A DDP replica's per-GPU estimate has no allocation trace of its own: asking for its
    replay was a ValueError, outside the contract (issue 27: VramError at every door)."""
    import vramwidget as vw

    e = vw.estimate_parallel("llama-3.2-1b", strategy="ddp", num_gpus=2, method="lora")
    # a DDP replica is a GPU plan of its own now (its buckets and NCCL buffers): it replays
    assert e.per_gpu.replay().max_allocated_bytes == e.per_gpu.peak_allocated_bytes
    est = e.per_gpu.relabelled(e.per_gpu.setup, e.per_gpu.params_total)
    est.sources.replay = None      # an estimate without an allocation trace
    with pytest.raises(vw.VramError, match="replay"):
        est.replay()
